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
/// Kills per run; `GPULSE_CRASH_KILLS=500 cargo test --test e2e crash` runs longer.
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
            timestamps_ms: vec![1_000_000 + k as i64 * 1000; SERIES as usize],
            values: (0..SERIES).map(|i| value(i, k)).collect(),
            epoch: 0xc4a5,
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
