//! Issue #3: `serve` is SIGKILLed at random moments under continuous ingest.
//! After each restart every acknowledged sample must be there, bit for bit,
//! and nothing may be stored twice.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::{Array, AsArray};
use arrow::datatypes::{Float64Type, Int64Type, TimestampMillisecondType};
use gpulse_proto::v1::ingest_client::IngestClient;
use gpulse_proto::v1::{AgentMessage, Batch, Hello, Label, SeriesDef, agent_message, ingest_reply};
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::support::{Fold, Node};

const SERIES: u32 = 8;
/// Kills per run of each test; `GPULSE_CRASH_KILLS=200 cargo test --test e2e
/// crash::` runs longer (see docs/CRASH.md).
const KILLS: usize = 20;
/// Batches sent and not yet acked, at most.
const WINDOW: usize = 8;

/// The sample of series `i` in batch `k`: integers, fractions, -0.0 and NaNs
/// with payloads, so that "bit for bit" means something.
fn value(i: u32, k: u64) -> f64 {
    match (i as u64 + k) % 13 {
        0 => f64::from_bits(0x7ff8_0000_0000_0000 | (k << 8) | i as u64),
        1 => -0.0,
        _ => (i as f64 * 1000.0 + k as f64) * 0.37,
    }
}

fn batch_msg(k: u64, define: bool) -> AgentMessage {
    let values = (0..SERIES).map(|i| value(i, k)).collect();
    batch_msg_at(k, 1_000_000 + k as i64 * 1000, values, define, 0xc4a5)
}

/// Batch `k` (seq `k + 1`) of producer `epoch`: `values[i]` at `ts` for
/// every series `i`, with the series definitions if `define`.
fn batch_msg_at(k: u64, ts: i64, values: Vec<f64>, define: bool, epoch: u64) -> AgentMessage {
    let new_series = if define {
        (0..SERIES)
            .map(|i| SeriesDef {
                id: i,
                metric: "crash_test".into(),
                labels: vec![Label {
                    name: "s".into(),
                    value: i.to_string(),
                }],
            })
            .collect()
    } else {
        Vec::new()
    };
    AgentMessage {
        msg: Some(agent_message::Msg::Batch(Batch {
            seq: k + 1,
            new_series,
            series_ids: (0..SERIES).collect(),
            timestamps_ms: vec![ts; SERIES as usize],
            values,
            epoch,
        })),
    }
}

/// Streams batches 0, 1, 2, ... to whatever URL `url` holds, re-sending the
/// unacked ones after every reconnect, until `stop` is set and all are acked.
/// Returns the number of batches, all acked.
async fn writer(url: Arc<Mutex<String>>, stop: Arc<AtomicBool>) -> u64 {
    let mut next: u64 = 0;
    let mut unacked: VecDeque<u64> = VecDeque::new();
    loop {
        if stop.load(Ordering::Relaxed) && unacked.is_empty() {
            return next;
        }
        let target = url.lock().unwrap().clone().replace("grpc://", "http://");
        let Ok(mut client) = IngestClient::connect(target).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let (tx, rx) = mpsc::channel(64);
        let hello = Hello {
            agent_id: "crash-writer".into(),
            host: "crash-host".into(),
            ..Default::default()
        };
        let _ = tx
            .send(AgentMessage {
                msg: Some(agent_message::Msg::Hello(hello)),
            })
            .await;
        let Ok(resp) = client.stream(ReceiverStream::new(rx)).await else {
            continue;
        };
        let mut replies = resp.into_inner();
        let mut defined = false;
        // Re-send everything unacked, in order.
        for &k in &unacked {
            let _ = tx.send(batch_msg(k, !defined)).await;
            defined = true;
        }
        loop {
            while unacked.len() < WINDOW && !stop.load(Ordering::Relaxed) {
                let _ = tx.send(batch_msg(next, !defined)).await;
                defined = true;
                unacked.push_back(next);
                next += 1;
            }
            if unacked.is_empty() {
                break;
            }
            match replies.message().await {
                Ok(Some(r)) => match r.reply {
                    Some(ingest_reply::Reply::Ack(a)) => {
                        let k = a.seq - 1;
                        assert_eq!(unacked.front(), Some(&k), "acks arrive in order");
                        unacked.pop_front();
                    }
                    other => panic!("unexpected reply {other:?}"),
                },
                _ => break, // the server died: reconnect
            }
        }
    }
}

#[test]
fn acked_samples_survive_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Frequent flushes, so that kills also land inside flushes and WAL truncations.
    let mut node = Node::start_with(&data, "150ms");
    let url = Arc::new(Mutex::new(node.grpc_url.clone()));
    let stop = Arc::new(AtomicBool::new(false));
    let w = {
        let (url, stop) = (url.clone(), stop.clone());
        std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(writer(url, stop))
        })
    };
    let kills = std::env::var("GPULSE_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KILLS);
    let seed = std::env::var("GPULSE_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_c4a5u64);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for round in 0..kills {
        std::thread::sleep(Duration::from_millis(rng.random_range(30..400)));
        node.kill9();
        node = Node::start_with(&data, "150ms");
        *url.lock().unwrap() = node.grpc_url.clone();
        let _ = round;
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let batches = w.join().expect("writer");
    assert!(batches > 0);

    // One more crash with nothing in flight, then read everything back.
    node.kill9();
    let node = Node::start(&data);
    let mut seen: HashMap<(u32, i64), u64> = HashMap::new();
    for b in node.sql_arrow("SELECT labels, ts, value FROM samples WHERE metric = 'crash_test'") {
        let labels = b.column(0).as_string::<i32>();
        let ts = b.column(1).as_primitive::<TimestampMillisecondType>();
        let vals = b.column(2).as_primitive::<Float64Type>();
        for r in 0..b.num_rows() {
            let l: HashMap<String, String> = serde_json::from_str(labels.value(r)).unwrap();
            let i: u32 = l["s"].parse().unwrap();
            let t = ts.value(r);
            let prev = seen.insert((i, t), vals.value(r).to_bits());
            assert!(
                prev.is_none(),
                "sample s={i} ts={t} stored twice (seed {seed:#x})"
            );
            assert!(!vals.is_null(r));
        }
    }
    for k in 0..batches {
        for i in 0..SERIES {
            let t = 1_000_000 + k as i64 * 1000;
            let got = seen.get(&(i, t)).unwrap_or_else(|| {
                panic!(
                    "acked sample s={i} batch={k} is missing (seed {seed:#x}, {batches} batches)"
                )
            });
            assert_eq!(*got, value(i, k).to_bits(), "s={i} batch={k}: bits differ");
        }
    }
    assert_eq!(
        seen.len() as u64,
        batches * SERIES as u64,
        "samples that were never sent"
    );

    // The rollups, rebuilt from files and WAL after all those kills, equal a
    // fold over the raw samples read back above.
    for (table, window) in [
        ("rollup_1m", 60_000),
        ("rollup_1h", 3_600_000),
        ("rollup_1d", 86_400_000),
    ] {
        let want = Fold::windows(
            seen.iter()
                .map(|(&(_, t), &bits)| (t, f64::from_bits(bits))),
            window,
        );
        for level in ["gpu", "cluster"] {
            let mut got = Vec::new();
            for b in node.sql_arrow(&format!(
                "SELECT CAST(ts AS BIGINT) AS t, count, sum, min, max, first, last FROM {table} \
                 WHERE level = '{level}' AND metric = 'crash_test' ORDER BY t"
            )) {
                let f = |c: usize| b.column(c).as_primitive::<Float64Type>().clone();
                let (ts, n) = (
                    b.column(0).as_primitive::<Int64Type>().clone(),
                    b.column(1).as_primitive::<Int64Type>().clone(),
                );
                let (sum, min, max, first, last) = (f(2), f(3), f(4), f(5), f(6));
                for r in 0..b.num_rows() {
                    got.push((
                        ts.value(r),
                        n.value(r) as u64,
                        [sum.value(r), min.value(r), max.value(r)],
                        [first.value(r).to_bits(), last.value(r).to_bits()],
                    ));
                }
            }
            assert_eq!(got.len(), want.len(), "{table} {level}: windows");
            for (g, (ws, w)) in got.iter().zip(&want) {
                let what = format!("{table} {level} window {ws} (seed {seed:#x})");
                assert_eq!((g.0, g.1), (*ws, w.count), "{what}");
                let same = |a: f64, b: f64| {
                    (a.is_nan() && b.is_nan())
                        || (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
                };
                for (i, x) in [w.sum, w.min, w.max].into_iter().enumerate() {
                    assert!(same(g.2[i], x), "{what}: column {i}: {} vs {x}", g.2[i]);
                }
                assert_eq!(g.3, [w.first.1.to_bits(), w.last.1.to_bits()], "{what}");
            }
        }
    }
    node.stop();
}

// ---------------------------------------------------------------------------
// Issue #14: the same kills with upkeep on. Retention, 1-minute rollup
// retention and compaction run (every second, and on `POST
// /api/v1/admin/flush` at random moments from a second client) while the
// node is SIGKILLed. Timestamps follow the wall clock, so the door (now −
// retention … now + max-future) admits them, and the oldest part of the data
// passes the retention while the test runs: what is checked after every
// restart is that every acked sample still within the retention at the
// check is there bit for bit, that whatever is there was sent, with its
// bits, and is there once, and that the rollups equal a fold over every
// stored sample (rollups outlive raw data), 1-minute records past their own
// retention excepted. See docs/CRASH.md.
// ---------------------------------------------------------------------------

/// Raw retention of the upkeep-on test (`--retention`): short, so that
/// segments expire while the test runs.
const RETENTION_MS: i64 = 20_000;
/// 1-minute rollup retention (`--retention-1m`).
const RETENTION_1M_MS: i64 = 30_000;
/// The producer epoch of the upkeep-on writer.
const UPKEEP_EPOCH: u64 = 0x0c4a_5e14;

/// The sample of series `i` in batch `k` at `ts` in the upkeep-on test:
/// [`value`] in even minutes; in odd ones the same without NaNs, so that the
/// sums of their 1-minute rollups are compared for real.
fn upkeep_value(i: u32, k: usize, ts: i64) -> f64 {
    let v = value(i, k as u64);
    if ts.div_euclid(60_000) % 2 == 0 || !v.is_nan() {
        v
    } else {
        k as f64 + 0.25
    }
}

/// Batch `k` of the upkeep-on writer, stamped `ts`.
fn upkeep_batch(k: u64, ts: i64, define: bool) -> AgentMessage {
    let values = (0..SERIES)
        .map(|i| upkeep_value(i, k as usize, ts))
        .collect();
    batch_msg_at(k, ts, values, define, UPKEEP_EPOCH)
}

fn wall_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as i64
}

/// What became of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Sent, no answer yet.
    InFlight,
    Acked,
    /// Rejected: too old by the time it was (re-)sent. Its first send may
    /// still have been stored, with the ack lost in a kill.
    Refused,
}

/// Every batch the upkeep-on writer has sent: its timestamp (fixed at its
/// first send, strictly increasing in `k`) and its fate.
#[derive(Debug, Default)]
struct Ledger {
    ts: Vec<i64>,
    fate: Vec<Fate>,
}

/// The test's hold on the writer: `pause` stops new batches; the writer
/// answers a pause of `epoch` by setting `idle_epoch` once every batch it
/// sent has an answer.
#[derive(Debug, Default)]
struct Control {
    pause: bool,
    stop: bool,
    epoch: u64,
    idle_epoch: u64,
}

/// The node of the moment: its incarnation (one per start) and URLs.
#[derive(Debug, Default, Clone)]
struct Endpoint {
    incarnation: u64,
    grpc: String,
    http: String,
}

#[derive(Debug, Default)]
struct Shared {
    node: Mutex<Endpoint>,
    ledger: Mutex<Ledger>,
    control: Mutex<Control>,
    /// Set when the admin-flush client should end.
    done: AtomicBool,
    /// `POST /api/v1/admin/flush` answered 200.
    admin_flushes: std::sync::atomic::AtomicU64,
    /// Answers other than 200 to an admin flush (status, body): must stay empty.
    admin_errors: Mutex<Vec<(u16, String)>>,
    /// The highest value of each counter seen per incarnation.
    counters: Mutex<HashMap<u64, HashMap<String, u64>>>,
}

/// Counters of `/metrics` that the upkeep-on test watches.
const WATCHED: [&str; 10] = [
    "gpulse_storage_flushes_total",
    "gpulse_storage_compactions_total",
    "gpulse_storage_rollup_merges_total",
    "gpulse_storage_segments_expired_total",
    "gpulse_storage_flush_failures_total",
    "gpulse_storage_segments_quarantined_total",
    "gpulse_storage_rollup_files_quarantined_total",
    "gpulse_storage_rollup_read_errors_total",
    "gpulse_wal_orphan_samples_total",
    "gpulse_ingest_batches_rejected_total",
];

fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

impl Shared {
    fn endpoint(&self) -> Endpoint {
        self.node.lock().unwrap().clone()
    }

    /// Reads `/metrics` of the current node, keeping each watched counter's
    /// highest value for its incarnation. A node that is being killed does
    /// not answer: nothing is recorded.
    fn scrape(&self, agent: &ureq::Agent) {
        let ep = self.endpoint();
        let Ok(mut resp) = agent.get(&format!("{}/metrics", ep.http)).call() else {
            return;
        };
        if resp.status() != 200 {
            return;
        }
        let Ok(body) = resp.body_mut().read_to_string() else {
            return;
        };
        let mut all = self.counters.lock().unwrap();
        let seen = all.entry(ep.incarnation).or_default();
        for line in body.lines() {
            let mut parts = line.split_whitespace();
            let (Some(name), Some(v)) = (parts.next(), parts.next()) else {
                continue;
            };
            if WATCHED.contains(&name) {
                let v: u64 = v.parse().unwrap_or_else(|e| panic!("{line:?}: {e}"));
                let e = seen.entry(name.to_string()).or_default();
                *e = (*e).max(v);
            }
        }
    }

    /// The sum over incarnations of a counter's highest value.
    fn counter(&self, name: &str) -> u64 {
        self.counters
            .lock()
            .unwrap()
            .values()
            .map(|m| m.get(name).copied().unwrap_or(0))
            .sum()
    }
}

/// The second client: at random moments, `POST /api/v1/admin/flush` to the
/// node of the moment (an upkeep round racing the periodic one, ingest and
/// the kills), then a scrape of `/metrics`.
fn admin_flusher(shared: Arc<Shared>, seed: u64) {
    let agent = http_agent();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0xf1u64);
    while !shared.done.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(rng.random_range(20..400)));
        let http = shared.endpoint().http;
        let sent = agent
            .post(&format!("{http}/api/v1/admin/flush"))
            .header("content-type", "application/json")
            .send_empty();
        // A node killed mid-request does not answer: not an error.
        if let Ok(mut resp) = sent {
            let status = resp.status().as_u16();
            if status == 200 {
                shared.admin_flushes.fetch_add(1, Ordering::Relaxed);
            } else {
                let body = resp.body_mut().read_to_string().unwrap_or_default();
                shared.admin_errors.lock().unwrap().push((status, body));
            }
        }
        shared.scrape(&agent);
    }
}

/// Streams batches 0, 1, 2, ... stamped with the wall clock (strictly
/// increasing, at most 1 s ahead) to the node of the moment, re-sending the
/// unanswered ones after every reconnect, until stopped with none in flight.
/// Pauses when the test asks (see [`Control`]).
async fn upkeep_writer(shared: Arc<Shared>) {
    let mut unacked: VecDeque<u64> = VecDeque::new();
    loop {
        let target = shared.endpoint().grpc.replace("grpc://", "http://");
        let Ok(mut client) = IngestClient::connect(target).await else {
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let (tx, rx) = mpsc::channel(64);
        let hello = Hello {
            agent_id: "crash-upkeep-writer".into(),
            host: "crash-host".into(),
            ..Default::default()
        };
        let _ = tx
            .send(AgentMessage {
                msg: Some(agent_message::Msg::Hello(hello)),
            })
            .await;
        let Ok(resp) = client.stream(ReceiverStream::new(rx)).await else {
            continue;
        };
        let mut replies = resp.into_inner();
        let mut defined = false;
        let ts_of = |k: u64| shared.ledger.lock().unwrap().ts[k as usize];
        for &k in &unacked {
            let _ = tx.send(upkeep_batch(k, ts_of(k), !defined)).await;
            defined = true;
        }
        loop {
            let (pause, stop, epoch) = {
                let c = shared.control.lock().unwrap();
                (c.pause, c.stop, c.epoch)
            };
            while unacked.len() < WINDOW && !pause && !stop {
                let now = wall_ms();
                let (k, ts) = {
                    let mut l = shared.ledger.lock().unwrap();
                    let ts = l.ts.last().map_or(now, |&t| (t + 1).max(now));
                    if ts > now + 1000 {
                        break;
                    }
                    l.ts.push(ts);
                    l.fate.push(Fate::InFlight);
                    (l.ts.len() as u64 - 1, ts)
                };
                let _ = tx.send(upkeep_batch(k, ts, !defined)).await;
                defined = true;
                unacked.push_back(k);
            }
            if unacked.is_empty() {
                if stop {
                    return;
                }
                if pause {
                    let mut c = shared.control.lock().unwrap();
                    if c.epoch == epoch {
                        c.idle_epoch = epoch;
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
                continue;
            }
            let reply = tokio::time::timeout(Duration::from_millis(200), replies.message()).await;
            let reply = match reply {
                Err(_) => continue, // look at the controls again
                Ok(Ok(Some(r))) => r.reply,
                Ok(_) => break, // the server died: reconnect
            };
            match reply {
                Some(ingest_reply::Reply::Ack(a)) => {
                    let k = a.seq - 1;
                    assert_eq!(unacked.front(), Some(&k), "acks arrive in order");
                    unacked.pop_front();
                    shared.ledger.lock().unwrap().fate[k as usize] = Fate::Acked;
                }
                Some(ingest_reply::Reply::Reject(r)) => {
                    let k = r.seq - 1;
                    assert_eq!(unacked.front(), Some(&k), "answers arrive in order");
                    let (now, ts) = (wall_ms(), ts_of(k));
                    // The only refusal this writer can earn: a re-send that
                    // the retention overtook while the node restarted.
                    assert!(
                        ts < now - RETENTION_MS,
                        "batch {k} (ts {ts}, {} ms old) refused: {}",
                        now - ts,
                        r.message
                    );
                    unacked.pop_front();
                    shared.ledger.lock().unwrap().fate[k as usize] = Fate::Refused;
                    // Later batches of this stream may lean on series that
                    // the refused one defined: start a new stream.
                    break;
                }
                other => panic!("unexpected reply {other:?}"),
            }
        }
    }
}

/// A rollup record as the tables answer it: window start, count, sum, min,
/// max, and the bits of first and last.
type RollupRow = (i64, u64, [f64; 3], [u64; 2]);

fn fold_matches(g: &RollupRow, w: &Fold) -> bool {
    let same = |a: f64, b: f64| {
        (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    };
    g.1 == w.count
        && [w.sum, w.min, w.max]
            .into_iter()
            .enumerate()
            .all(|(i, x)| same(g.2[i], x))
        && g.3 == [w.first.1.to_bits(), w.last.1.to_bits()]
}

/// The rollup tiers: table, window, retention in the test (`None`: kept).
const TIERS: [(&str, i64, Option<i64>); 3] = [
    ("rollup_1m", 60_000, Some(RETENTION_1M_MS)),
    ("rollup_1h", 3_600_000, None),
    ("rollup_1d", 86_400_000, None),
];

/// What the test knows is stored, kept up to date check by check: the
/// rollups folded from every stored batch, and the refused batches whose
/// first send may or may not have been stored.
#[derive(Debug, Default)]
struct Expected {
    /// Batches below this are folded or listed in `unsure`.
    seen: usize,
    /// Per tier: window start → fold of the stored samples.
    folds: [std::collections::BTreeMap<i64, Fold>; 3],
    /// Refused batches not seen in storage (yet): stored or not, unknown.
    unsure: Vec<usize>,
    /// Batches below this are absent and past the retention: never looked
    /// at again.
    gone: usize,
    /// 1-minute rollup windows absent at the last check, past their retention.
    expired_1m: usize,
}

impl Expected {
    fn fold_in(&mut self, k: usize, ts: i64) {
        for (t, (_, window, _)) in TIERS.iter().enumerate() {
            let ws = ts - ts.rem_euclid(*window);
            for i in 0..SERIES {
                let v = upkeep_value(i, k, ts);
                self.folds[t]
                    .entry(ws)
                    .and_modify(|f| f.add(ts, v))
                    .or_insert_with(|| Fold::of(ts, v));
            }
        }
    }
}

/// Files a killed node left half written (`*.tmp` of a segment or rollup
/// file): the kill landed in a flush, a compaction or a rollup merge.
fn half_written(data: &std::path::Path) -> usize {
    ["segments", "rollups"]
        .iter()
        .filter_map(|d| std::fs::read_dir(data.join(d)).ok())
        .flatten()
        .filter(|e| {
            e.as_ref()
                .is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        })
        .count()
}

/// Pauses the writer and waits until every batch it sent has an answer.
fn drain(shared: &Shared, writer: &std::thread::JoinHandle<()>) {
    let epoch = {
        let mut c = shared.control.lock().unwrap();
        c.epoch += 1;
        c.pause = true;
        c.epoch
    };
    let started = std::time::Instant::now();
    while shared.control.lock().unwrap().idle_epoch != epoch {
        assert!(!writer.is_finished(), "the writer ended (panicked?)");
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the writer did not get answers for its batches within 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Checks the node against the ledger (the writer is drained): raw samples
/// bit for bit and once each, every acked one within the retention present,
/// and the rollups. Returns the number of batches there.
fn check_upkeep(node: &Node, shared: &Shared, exp: &mut Expected, what: &str) -> usize {
    let (ts_of, fates) = {
        let l = shared.ledger.lock().unwrap();
        (l.ts.clone(), l.fate.clone())
    };
    for k in exp.seen..ts_of.len() {
        match fates[k] {
            Fate::Acked => exp.fold_in(k, ts_of[k]),
            Fate::Refused => exp.unsure.push(k),
            Fate::InFlight => panic!("{what}: batch {k} in flight after the drain"),
        }
    }
    exp.seen = ts_of.len();

    // Raw samples: which series of each batch are there.
    let mut present: HashMap<usize, u32> = HashMap::new();
    for b in node.sql_arrow("SELECT labels, ts, value FROM samples WHERE metric = 'crash_test'") {
        let labels = b.column(0).as_string::<i32>();
        let ts = b.column(1).as_primitive::<TimestampMillisecondType>();
        let vals = b.column(2).as_primitive::<Float64Type>();
        for r in 0..b.num_rows() {
            let l: HashMap<String, String> = serde_json::from_str(labels.value(r)).unwrap();
            let i: u32 = l["s"].parse().unwrap();
            let t = ts.value(r);
            let k = ts_of
                .binary_search(&t)
                .unwrap_or_else(|_| panic!("{what}: sample s={i} ts={t} was never sent"));
            assert!(!vals.is_null(r), "{what}: s={i} batch={k}: null value");
            assert_eq!(
                vals.value(r).to_bits(),
                upkeep_value(i, k, t).to_bits(),
                "{what}: s={i} batch={k}: bits differ"
            );
            let bits = present.entry(k).or_default();
            assert!(
                *bits & (1 << i) == 0,
                "{what}: s={i} batch={k} ts={t} stored twice"
            );
            *bits |= 1 << i;
        }
    }
    // Read after the answer: whatever retention dropped before the query
    // ran is older than this cutoff.
    let cutoff = wall_ms() - RETENTION_MS;
    let all = (1u32 << SERIES) - 1;
    for (&k, &bits) in &present {
        assert_eq!(
            bits, all,
            "{what}: batch {k} is there in part (series mask {bits:#x})"
        );
        assert_ne!(fates[k], Fate::InFlight);
    }
    // A refused batch that is there was stored by an earlier send.
    let mut unsure = std::mem::take(&mut exp.unsure);
    unsure.retain(|&k| {
        let stored = present.contains_key(&k);
        if stored {
            exp.fold_in(k, ts_of[k]);
        }
        !stored
    });
    exp.unsure = unsure;
    for k in exp.gone..ts_of.len() {
        if present.contains_key(&k) {
            continue;
        }
        if ts_of[k] < cutoff {
            if exp.gone == k {
                exp.gone = k + 1;
            }
            continue;
        }
        assert_ne!(
            fates[k],
            Fate::Acked,
            "{what}: acked batch {k} (ts {}, {} ms within the retention) is missing",
            ts_of[k],
            ts_of[k] - cutoff
        );
    }

    // Rollups: every record there equals the fold of the stored samples of
    // its window (with or without each refused batch whose fate is
    // unknown); every window of the fold is there, 1-minute records past
    // their retention excepted.
    for (t, &(table, window, retention)) in TIERS.iter().enumerate() {
        for level in ["gpu", "cluster"] {
            let mut got: Vec<RollupRow> = Vec::new();
            for b in node.sql_arrow(&format!(
                "SELECT CAST(ts AS BIGINT) AS t, count, sum, min, max, first, last FROM {table} \
                 WHERE level = '{level}' AND metric = 'crash_test' ORDER BY t"
            )) {
                let f = |c: usize| b.column(c).as_primitive::<Float64Type>().clone();
                let (ts, n) = (
                    b.column(0).as_primitive::<Int64Type>().clone(),
                    b.column(1).as_primitive::<Int64Type>().clone(),
                );
                let (sum, min, max, first, last) = (f(2), f(3), f(4), f(5), f(6));
                for r in 0..b.num_rows() {
                    got.push((
                        ts.value(r),
                        n.value(r) as u64,
                        [sum.value(r), min.value(r), max.value(r)],
                        [first.value(r).to_bits(), last.value(r).to_bits()],
                    ));
                }
            }
            let cutoff = retention.map(|r| wall_ms() - r);
            let expired = |ws: i64| cutoff.is_some_and(|c| ws + window - 1 < c);
            let mut windows: std::collections::BTreeSet<i64> =
                exp.folds[t].keys().copied().collect();
            let unsure_in = |ws: i64| -> Vec<usize> {
                exp.unsure
                    .iter()
                    .copied()
                    .filter(|&k| ts_of[k] - ts_of[k].rem_euclid(window) == ws)
                    .collect()
            };
            let mut last_ws = None;
            for g in &got {
                let ws = g.0;
                let what = format!("{what}: {table} {level} window {ws}");
                assert!(last_ws < Some(ws), "{what}: listed twice or out of order");
                last_ws = Some(ws);
                windows.remove(&ws);
                let unsure = unsure_in(ws);
                assert!(
                    unsure.len() <= 10,
                    "{what}: {} batches of unknown fate",
                    unsure.len()
                );
                let sure = exp.folds[t].get(&ws).copied();
                let matched = (0u32..1 << unsure.len()).any(|mask| {
                    let mut f = sure;
                    for (j, &k) in unsure.iter().enumerate() {
                        if mask & (1 << j) != 0 {
                            for i in 0..SERIES {
                                let (ts, v) = (ts_of[k], upkeep_value(i, k, ts_of[k]));
                                match &mut f {
                                    Some(f) => f.add(ts, v),
                                    None => f = Some(Fold::of(ts, v)),
                                }
                            }
                        }
                    }
                    f.is_some_and(|f| fold_matches(g, &f))
                });
                assert!(
                    matched,
                    "{what}: {g:?} is not the fold {sure:?} of its stored samples"
                );
            }
            if t == 0 && level == "gpu" {
                exp.expired_1m = windows.len();
            }
            for ws in windows {
                assert!(
                    expired(ws),
                    "{what}: {table} {level} window {ws} is missing ({:?})",
                    exp.folds[t][&ws]
                );
            }
        }
    }
    present.len()
}

#[test]
fn acked_samples_survive_sigkill_with_upkeep() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let args = [
        "--flush-interval",
        "1s",
        "--retention",
        "20s",
        "--retention-1m",
        "30s",
        "--compaction-window",
        "5s",
    ];
    let kills = std::env::var("GPULSE_CRASH_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(KILLS);
    let seed = std::env::var("GPULSE_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0x5eed_c4a5u64);
    let started = std::time::Instant::now();
    let shared = Arc::new(Shared::default());
    let mut incarnation = 0;
    let mut start = |shared: &Shared| {
        let node = Node::start_with_args(&data, &args);
        incarnation += 1;
        *shared.node.lock().unwrap() = Endpoint {
            incarnation,
            grpc: node.grpc_url.clone(),
            http: node.http_url.clone(),
        };
        node
    };
    let mut node = start(&shared);
    let writer = {
        let shared = shared.clone();
        std::thread::spawn(move || {
            tokio::runtime::Runtime::new()
                .unwrap()
                .block_on(upkeep_writer(shared))
        })
    };
    let flusher = {
        let shared = shared.clone();
        std::thread::spawn(move || admin_flusher(shared, seed))
    };
    let agent = http_agent();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut exp = Expected::default();
    let mut mid_write_kills = 0;
    for round in 0..kills {
        // Up to 1.5 s: kills land in periodic flushes (every second), in
        // admin flushes, in compactions and retention rounds, and in ingest.
        std::thread::sleep(Duration::from_millis(rng.random_range(30..1500)));
        shared.scrape(&agent);
        // Every third kill aims at an upkeep round: an admin flush is asked
        // for, and the node is killed 0 to 40 ms later, while it flushes,
        // compacts, merges rollup files or applies retention.
        if round % 3 == 2 {
            let url = format!("{}/api/v1/admin/flush", shared.endpoint().http);
            let agent = agent.clone();
            std::thread::spawn(move || {
                // The node dies under this request: no answer is expected.
                let _ = agent
                    .post(&url)
                    .header("content-type", "application/json")
                    .send_empty();
            });
            std::thread::sleep(Duration::from_millis(rng.random_range(0..40)));
        }
        node.kill9();
        if half_written(&data) > 0 {
            mid_write_kills += 1;
        }
        node = start(&shared);
        drain(&shared, &writer);
        let what = format!("kill {} of {kills} (seed {seed:#x})", round + 1);
        let present = check_upkeep(&node, &shared, &mut exp, &what);
        shared.control.lock().unwrap().pause = false;
        if (round + 1) % 25 == 0 {
            eprintln!(
                "crash with upkeep: {what}: {:.0?}, {} batches sent, {present} there, {} expired",
                started.elapsed(),
                shared.ledger.lock().unwrap().ts.len(),
                exp.gone
            );
        }
    }
    // A short run on a fast machine may end before the first segment has
    // passed the retention: go on ingesting (and flushing) until upkeep has
    // compacted, merged rollup files and expired a segment, or the time is
    // up (then the assertions below fail).
    std::thread::sleep(Duration::from_millis(300));
    let upkept = || {
        [
            "gpulse_storage_compactions_total",
            "gpulse_storage_rollup_merges_total",
            "gpulse_storage_segments_expired_total",
        ]
        .iter()
        .all(|name| shared.counter(name) > 0)
    };
    let deadline = Duration::from_millis(RETENTION_MS as u64 * 2 + 60_000);
    while !upkept() && started.elapsed() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        shared.scrape(&agent);
    }
    // The end: stop the writer with every batch answered, kill once more
    // with nothing in flight, and check again.
    shared.control.lock().unwrap().stop = true;
    writer.join().expect("writer");
    shared.scrape(&agent);
    node.kill9();
    let node = start(&shared);
    shared.done.store(true, Ordering::Relaxed);
    flusher.join().expect("admin flusher");
    shared.scrape(&agent);
    let present = check_upkeep(
        &node,
        &shared,
        &mut exp,
        &format!("after the last kill (seed {seed:#x})"),
    );

    let (sent, acked, refused) = {
        let l = shared.ledger.lock().unwrap();
        let count = |fate| l.fate.iter().filter(|&&f| f == fate).count();
        (l.ts.len(), count(Fate::Acked), count(Fate::Refused))
    };
    let c = |name: &str| shared.counter(name);
    // Kills between a merge's rename and the deletion of its sources.
    let log = std::fs::read_to_string(data.with_extension("log")).unwrap_or_default();
    let leftover_sources = log.matches("leftover source").count();
    let summary = format!(
        "{kills} kills in {:.0?}: {sent} batches ({} samples) sent, {acked} acked, {refused} refused, \
         {present} batches present at the end ({} expired, and {} 1-minute rollup windows); \
         {} admin flushes; flushes {}, compactions {}, rollup merges {}, segments expired {}; \
         {mid_write_kills} kills left a half-written file, {leftover_sources} a merge's sources",
        started.elapsed(),
        sent * SERIES as usize,
        exp.gone,
        exp.expired_1m,
        shared.admin_flushes.load(Ordering::Relaxed),
        c("gpulse_storage_flushes_total"),
        c("gpulse_storage_compactions_total"),
        c("gpulse_storage_rollup_merges_total"),
        c("gpulse_storage_segments_expired_total"),
    );
    eprintln!("crash with upkeep (seed {seed:#x}): {summary}");
    // Nothing was found corrupt or set aside.
    let quarantined: Vec<_> = std::fs::read_dir(data.join("quarantine"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert!(
        quarantined.is_empty(),
        "quarantine/ holds {quarantined:?}: {summary}"
    );
    let errors = shared.admin_errors.lock().unwrap().clone();
    assert!(errors.is_empty(), "admin flushes failed: {errors:?}");
    assert!(
        shared.admin_flushes.load(Ordering::Relaxed) > 0,
        "{summary}"
    );
    // Upkeep did happen, while the kills did.
    for moved in [
        "gpulse_storage_flushes_total",
        "gpulse_storage_compactions_total",
        "gpulse_storage_rollup_merges_total",
        "gpulse_storage_segments_expired_total",
    ] {
        assert!(c(moved) > 0, "{moved} never moved: {summary}");
    }
    for zero in [
        "gpulse_storage_flush_failures_total",
        "gpulse_storage_segments_quarantined_total",
        "gpulse_storage_rollup_files_quarantined_total",
        "gpulse_storage_rollup_read_errors_total",
        "gpulse_wal_orphan_samples_total",
    ] {
        assert_eq!(c(zero), 0, "{zero}: {summary}");
    }
    node.stop();
}
