//! Tests of the cluster read path: three in-process nodes, each with its own
//! storage and a real Flight server on loopback, a shard map with RF = 2, and
//! every shard's data written to its owners. Expected answers are computed
//! here from the data written, never by the code under test.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use arrow::array::{Array, AsArray, Int32Array, RecordBatch};
use arrow::datatypes::{Float64Type, TimestampMillisecondType};
use arrow_flight::{FlightClient, Ticket};
use cluster::{ClusterState, ShardKey, ShardMap};
use futures::StreamExt;
use gpulse_proto::v1::NodeStatusReply;
use storage::{Label, Matcher, SeriesKey, Storage, StorageConfig};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use super::wire::{self, AnswerDecoder, BatchBuilder};
use super::*;
use crate::promql::{PromEngine, PromLimits, PromValue};
use crate::{QueryEngine, QueryError, QueryResult, ResultLimits};

/// 2026-11-30T10:00:00Z in ms.
const T0: i64 = 1_796_032_800_000;
const STEP: i64 = 15_000;
/// Samples per series.
const N: i64 = 20;
const METRICS: [&str; 2] = ["temp", "power"];
const NODES: [&str; 3] = ["a", "b", "c"];

/// One sample as the tests compare them: metric, rack, host, gpu, ts, value bits.
type Row = (String, String, String, String, i64, u64);

/// The shards of the test fleet: racks, and two hosts without a rack.
fn shards() -> Vec<ShardKey> {
    let mut keys: Vec<ShardKey> = (0..10).map(|i| ShardKey::Rack(format!("r{i}"))).collect();
    keys.push(ShardKey::Host("solo-0".into()));
    keys.push(ShardKey::Host("solo-1".into()));
    keys
}

/// The hosts of a shard.
fn hosts(key: &ShardKey) -> Vec<String> {
    match key {
        ShardKey::Rack(r) => vec![format!("h-{r}-0"), format!("h-{r}-1")],
        ShardKey::Host(h) => vec![h.clone()],
    }
}

/// One series of the fleet and its samples.
#[derive(Debug, Clone)]
struct TestSeries {
    shard: ShardKey,
    metric: &'static str,
    host: String,
    gpu: String,
    /// (k, value): the sample at `T0 + k * STEP`.
    samples: Vec<(i64, f64)>,
}

impl TestSeries {
    fn rack(&self) -> String {
        match &self.shard {
            ShardKey::Rack(r) => r.clone(),
            ShardKey::Host(_) => String::new(),
        }
    }

    fn key(&self) -> SeriesKey {
        let mut labels = vec![
            Label::new("Hostname", self.host.as_str()),
            Label::new("gpu", self.gpu.as_str()),
        ];
        if let ShardKey::Rack(r) = &self.shard {
            labels.push(Label::new("rack", r.as_str()));
        }
        SeriesKey::new(self.metric, labels).unwrap()
    }

    fn rows(&self) -> Vec<Row> {
        self.samples
            .iter()
            .map(|&(k, v)| {
                (
                    self.metric.to_string(),
                    self.rack(),
                    self.host.clone(),
                    self.gpu.clone(),
                    T0 + k * STEP,
                    v.to_bits(),
                )
            })
            .collect()
    }
}

/// Every series of the fleet, each sample with a value of its own.
fn fleet() -> Vec<TestSeries> {
    let mut out = Vec::new();
    for (si, shard) in shards().iter().enumerate() {
        for (hi, host) in hosts(shard).into_iter().enumerate() {
            for (mi, metric) in METRICS.iter().enumerate() {
                for gpu in 0..2 {
                    let base = (si * 1000 + hi * 100 + mi * 10 + gpu) as f64;
                    out.push(TestSeries {
                        shard: shard.clone(),
                        metric,
                        host: host.clone(),
                        gpu: gpu.to_string(),
                        samples: (0..N).map(|k| (k, base + k as f64 * 0.25)).collect(),
                    });
                }
            }
        }
    }
    out
}

fn write(storage: &Storage, s: &TestSeries, ks: impl Fn(i64) -> bool) {
    let r = storage.series_ref(s.key()).unwrap();
    let (ts, vs): (Vec<i64>, Vec<f64>) = s
        .samples
        .iter()
        .filter(|(k, _)| ks(*k))
        .map(|&(k, v)| (T0 + k * STEP, v))
        .unzip();
    storage.append(&vec![r; ts.len()], &ts, &vs).unwrap();
}

/// One node: storage in a temp dir and a Flight server on loopback.
struct Node {
    id: &'static str,
    storage: Arc<Storage>,
    _dir: tempfile::TempDir,
    flight: SocketAddr,
    metrics: Arc<ClusterMetrics>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Node {
    /// Stops the Flight server and waits until it has.
    async fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            task.await.unwrap();
        }
    }
}

/// How node `c` listens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NodeC {
    Flight,
    /// A TCP server that answers every connection with garbage bytes.
    Garbage,
}

struct Fixture {
    map: ShardMap,
    nodes: Vec<Node>,
    fleet: Vec<TestSeries>,
    /// The state of node `a`, the one that answers queries.
    state: Arc<ClusterState>,
    reader: ClusterReader,
}

fn map_text(flight: &[SocketAddr], epochs: &str) -> String {
    let grpc: Vec<SocketAddr> = (0..NODES.len())
        .map(|i| SocketAddr::from(([127, 0, 0, 1], 17_400 + i as u16)))
        .collect();
    map_text_grpc(flight, &grpc, epochs)
}

/// [`map_text`] with the nodes' gRPC (status) addresses given.
fn map_text_grpc(flight: &[SocketAddr], grpc: &[SocketAddr], epochs: &str) -> String {
    let mut text = String::from("replication_factor = 2\n");
    for (i, id) in NODES.iter().enumerate() {
        text += &format!(
            "[[node]]\nid = \"{id}\"\ngrpc = \"{}\"\nhttp = \"127.0.0.1:{}\"\nflight = \"{}\"\n",
            grpc[i],
            17_500 + i,
            flight[i]
        );
    }
    text + epochs
}

/// A status reply of node `id` listing the shards it holds.
fn status(id: &str, keys: &BTreeSet<ShardKey>, hash: &str) -> NodeStatusReply {
    NodeStatusReply {
        node_id: id.to_string(),
        map_hash: hash.to_string(),
        racks: keys
            .iter()
            .filter_map(|k| match k {
                ShardKey::Rack(r) => Some(r.clone()),
                ShardKey::Host(_) => None,
            })
            .collect(),
        hosts: keys
            .iter()
            .filter_map(|k| match k {
                ShardKey::Host(h) => Some(h.clone()),
                ShardKey::Rack(_) => None,
            })
            .collect(),
        ..Default::default()
    }
}

impl Fixture {
    /// Three nodes; every sample `k` of a shard is written to the owners of
    /// the shard at `T0 + k * STEP` (and, where `both(k)`, also to the owners
    /// of the other epoch: a replica that caught up late).
    async fn start(c: NodeC, epochs: &str, both: impl Fn(i64) -> bool) -> Self {
        let mut listeners = Vec::new();
        for _ in NODES {
            listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
        }
        let addrs: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let map = ShardMap::parse(&map_text(&addrs, epochs), Path::new("cluster.toml")).unwrap();
        let mut nodes = Vec::new();
        for (i, listener) in listeners.into_iter().enumerate() {
            let dir = tempfile::tempdir().unwrap();
            let storage = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
            let metrics = Arc::new(ClusterMetrics::default());
            let (tx, rx) = oneshot::channel::<()>();
            let task = if i == 2 && c == NodeC::Garbage {
                tokio::spawn(garbage_server(listener, rx))
            } else {
                let (st, m) = (storage.clone(), metrics.clone());
                tokio::spawn(async move {
                    serve_flight(
                        listener,
                        st,
                        m,
                        None,
                        crate::limits::QueryLimits::default().timeout,
                        auth::Access::default(),
                        async {
                            let _ = rx.await;
                        },
                    )
                    .await
                    .unwrap();
                })
            };
            nodes.push(Node {
                id: NODES[i],
                storage,
                _dir: dir,
                flight: addrs[i],
                metrics,
                stop: Some(tx),
                task: Some(task),
            });
        }
        let fleet = fleet();
        let mut held: Vec<BTreeSet<ShardKey>> = vec![BTreeSet::new(); NODES.len()];
        for s in &fleet {
            let mut owners_of_k: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
            for k in 0..N {
                let at = T0 + k * STEP;
                let mut owners: BTreeSet<usize> = map.owners_at(&s.shard, at).into_iter().collect();
                if both(k) {
                    for e in 0..map.epochs().len() {
                        owners.extend(map.owners_in(e, &s.shard));
                    }
                }
                for o in owners {
                    owners_of_k.entry(o).or_default().push(k);
                }
            }
            for (o, ks) in owners_of_k {
                write(&nodes[o].storage, s, |k| ks.contains(&k));
                held[o].insert(s.shard.clone());
            }
        }
        let state = Arc::new(ClusterState::new(map.clone(), "a"));
        for k in &held[0] {
            state.note_key(k.clone());
        }
        for i in 1..NODES.len() {
            state.update_peer(NODES[i], Ok(status(NODES[i], &held[i], map.hash())));
        }
        let reader = ClusterReader::new(
            state.clone(),
            nodes[0].storage.clone(),
            nodes[0].metrics.clone(),
            // The tests set the peers' state by hand; there is no gRPC
            // status service to refresh it from.
            ReaderConfig {
                refresh_timeout: None,
                ..ReaderConfig::default()
            },
        );
        Self {
            map,
            nodes,
            fleet,
            state,
            reader,
        }
    }

    async fn three() -> Self {
        Self::start(NodeC::Flight, "", |_| false).await
    }

    fn idx(&self, id: &str) -> usize {
        self.map.node_index(id).unwrap()
    }

    /// Stops node `id`'s Flight server; with `mark`, the poller's view says
    /// it is down too.
    async fn down(&mut self, id: &str, mark: bool) {
        let i = self.idx(id);
        self.nodes[i].stop().await;
        if mark {
            self.state
                .update_peer(id, Err("transport error: connection refused".into()));
        }
    }

    /// Shards whose owners (one epoch) are exactly `ids`.
    fn shards_owned_by(&self, ids: &[&str]) -> Vec<ShardKey> {
        let want: BTreeSet<usize> = ids.iter().map(|id| self.idx(id)).collect();
        shards()
            .into_iter()
            .filter(|k| {
                self.map
                    .owners_at(k, T0)
                    .into_iter()
                    .collect::<BTreeSet<_>>()
                    == want
            })
            .collect()
    }

    /// The rows of the fleet whose series `keep` accepts, sorted.
    fn expected(&self, keep: impl Fn(&TestSeries) -> bool) -> Vec<Row> {
        let mut rows: Vec<Row> = self
            .fleet
            .iter()
            .filter(|s| keep(s))
            .flat_map(TestSeries::rows)
            .collect();
        rows.sort();
        rows
    }

    fn sql_engine(&self) -> QueryEngine {
        QueryEngine::with_cluster(
            self.nodes[0].storage.clone(),
            ResultLimits::default(),
            self.reader.clone(),
        )
    }

    fn prom_engine(&self) -> PromEngine {
        PromEngine::with_cluster(self.reader.clone(), PromLimits::default())
    }
}

/// Answers every connection with bytes that are not HTTP/2.
async fn garbage_server(listener: TcpListener, mut stop: oneshot::Receiver<()>) {
    use tokio::io::AsyncWriteExt;
    loop {
        tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => {
                let (mut socket, _) = accepted.unwrap();
                let _ = socket.write_all(b"this is not HTTP/2\r\n\r\n\x00\xff garbage").await;
                let _ = socket.shutdown().await;
            }
        }
    }
}

const ROWS_SQL: &str = "SELECT metric, rack, host, gpu, ts, value FROM samples";

/// The rows of a result of [`ROWS_SQL`], sorted.
fn rows_of(r: &QueryResult) -> Vec<Row> {
    let mut out = Vec::new();
    for b in &r.batches {
        let text = |i: usize, row: usize| -> String {
            let c = b.column(i);
            if c.is_null(row) {
                return String::new();
            }
            c.as_string::<i32>().value(row).to_string()
        };
        let ts = b.column(4).as_primitive::<TimestampMillisecondType>();
        let v = b.column(5).as_primitive::<Float64Type>();
        for row in 0..b.num_rows() {
            out.push((
                text(0, row),
                text(1, row),
                text(2, row),
                text(3, row),
                ts.value(row),
                v.value(row).to_bits(),
            ));
        }
    }
    out.sort();
    out
}

/// The rows of a PromQL range result over the fleet's steps.
fn rows_of_matrix(v: &PromValue) -> Vec<Row> {
    let PromValue::Matrix(series) = v else {
        panic!("not a matrix: {v:?}");
    };
    let mut out = Vec::new();
    for s in series {
        let get = |n: &str| {
            s.labels
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, v)| v.to_string())
                .unwrap_or_default()
        };
        for &(t, v) in &s.points {
            out.push((
                get("__name__"),
                get("rack"),
                get("Hostname"),
                get("gpu"),
                t,
                v.to_bits(),
            ));
        }
    }
    out.sort();
    out
}

async fn prom_range(engine: &PromEngine, q: &str) -> crate::promql::Answer {
    let (engine, q) = (engine.clone(), q.to_string());
    tokio::task::spawn_blocking(move || engine.range_answer(&q, T0, T0 + (N - 1) * STEP, STEP))
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sample_exactly_once_through_one_node() {
    let f = Fixture::three().await;
    // Each node holds only some shards, so a complete answer needs all three.
    for node in &f.nodes {
        assert!(
            local_shard_keys(&node.storage).len() < shards().len(),
            "{} holds everything",
            node.id
        );
    }
    let r = f.sql_engine().sql(ROWS_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    let want = f.expected(|_| true);
    assert_eq!(want.len(), f.fleet.len() * N as usize);
    assert_eq!(rows_of(&r), want);

    // Pushed filters narrow the fan-out: one rack is read from one node.
    let reads_before = f.nodes[0].metrics.peer_reads.load(Relaxed);
    let rack = f.shards_owned_by(&["b", "c"]).remove(0);
    let ShardKey::Rack(rack_name) = &rack else {
        panic!("not a rack: {rack}")
    };
    let r = f
        .sql_engine()
        .sql(&format!(
            "{ROWS_SQL} WHERE rack = '{rack_name}' AND metric = 'power'"
        ))
        .await
        .unwrap();
    assert_eq!(
        rows_of(&r),
        f.expected(|s| s.shard == rack && s.metric == "power")
    );
    assert_eq!(
        f.nodes[0].metrics.peer_reads.load(Relaxed),
        reads_before + 1
    );

    // PromQL: every series of `temp` with every sample, at its own steps.
    let a = prom_range(&f.prom_engine(), "temp").await;
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    assert_eq!(rows_of_matrix(&a.value), f.expected(|s| s.metric == "temp"));

    // An aggregation over all nodes: sum by rack at one instant.
    let k = 7;
    let mut want: BTreeMap<String, f64> = BTreeMap::new();
    for s in f.fleet.iter().filter(|s| s.metric == "power") {
        *want.entry(s.rack()).or_default() += s.samples[k as usize].1;
    }
    let engine = f.prom_engine();
    let got = tokio::task::spawn_blocking(move || {
        engine.instant_answer("sum by (rack) (power)", T0 + k * STEP)
    })
    .await
    .unwrap()
    .unwrap();
    let PromValue::Vector(samples) = got.value else {
        panic!("not a vector")
    };
    let got: BTreeMap<String, f64> = samples
        .iter()
        .map(|s| {
            let rack = s
                .labels
                .iter()
                .find(|(n, _)| n == "rack")
                .map(|(_, v)| v.to_string())
                .unwrap_or_default();
            (rack, s.v)
        })
        .collect();
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_down_is_failed_over() {
    // Marked down by the poller: its shards are planned on the other owner.
    let mut f = Fixture::three().await;
    f.down("c", true).await;
    let r = f.sql_engine().sql(ROWS_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(rows_of(&r), f.expected(|_| true));
    assert_eq!(f.nodes[0].metrics.peer_read_failures.load(Relaxed), 0);

    // Stopped but still believed up (the poller has not noticed): the read
    // fails and its shards go to the other owner, still complete.
    let mut f = Fixture::three().await;
    f.down("b", false).await;
    let a = prom_range(&f.prom_engine(), "power").await;
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    assert_eq!(
        rows_of_matrix(&a.value),
        f.expected(|s| s.metric == "power")
    );
    assert!(f.nodes[0].metrics.peer_read_failures.load(Relaxed) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_owners_down_is_a_warning_naming_the_shard() {
    let mut f = Fixture::three().await;
    let lost = f.shards_owned_by(&["b", "c"]);
    assert!(
        !lost.is_empty(),
        "the fixture needs a shard owned by b and c"
    );
    f.down("b", true).await;
    f.down("c", false).await;
    let kept = |s: &TestSeries| !lost.contains(&s.shard);

    // SQL: every other shard complete, a warning per lost shard.
    let r = f.sql_engine().sql(ROWS_SQL).await.unwrap();
    assert_eq!(rows_of(&r), f.expected(kept));
    assert_eq!(r.warnings.len(), lost.len(), "{:?}", r.warnings);
    for k in &lost {
        let w = r
            .warnings
            .iter()
            .find(|w| w.contains(&format!("{k} could be read")))
            .unwrap_or_else(|| panic!("no warning for {k}: {:?}", r.warnings));
        assert!(w.starts_with("partial result"), "{w}");
        assert!(
            w.contains("b: down (transport error: connection refused)"),
            "{w}"
        );
        assert!(w.contains("c: read failed"), "{w}");
    }
    assert!(f.nodes[0].metrics.selects_partial.load(Relaxed) >= 1);

    // PromQL: the same, in the answer's warnings; `range` alone refuses.
    let engine = f.prom_engine();
    let a = prom_range(&engine, "temp").await;
    assert_eq!(
        rows_of_matrix(&a.value),
        f.expected(|s| kept(s) && s.metric == "temp")
    );
    assert_eq!(a.warnings.len(), lost.len(), "{:?}", a.warnings);
    for k in &lost {
        assert!(
            a.warnings
                .iter()
                .any(|w| w.contains(&format!("{k} could be read"))),
            "no warning for {k}: {:?}",
            a.warnings
        );
    }
    let e = tokio::task::spawn_blocking(move || engine.range("temp", T0, T0 + STEP, STEP))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, crate::promql::PromError::Unavailable(m) if m.contains("partial result")),
        "{e:?}"
    );

    // A query that cannot touch a lost shard is complete and says nothing.
    let safe = f.shards_owned_by(&["a", "b"]).remove(0);
    let ShardKey::Rack(rack) = &safe else {
        panic!("not a rack: {safe}")
    };
    let r = f
        .sql_engine()
        .sql(&format!("{ROWS_SQL} WHERE rack = '{rack}'"))
        .await
        .unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(rows_of(&r), f.expected(|s| s.shard == safe));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_with_another_map_refuses_the_query() {
    let f = Fixture::three().await;
    f.state
        .update_peer("b", Ok(status("b", &BTreeSet::new(), "0123456789abcdef")));
    let e = f.sql_engine().sql(ROWS_SQL).await.unwrap_err();
    let QueryError::Unavailable(m) = &e else {
        panic!("{e:?}")
    };
    assert!(
        m.contains("node b runs with cluster file hash 0123456789abcdef"),
        "{m}"
    );
    let engine = f.prom_engine();
    let e = tokio::task::spawn_blocking(move || engine.instant_answer("temp", T0))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, crate::promql::PromError::Unavailable(m) if m.contains("cluster queries are refused")),
        "{e:?}"
    );
    assert_eq!(f.nodes[0].metrics.selects_refused.load(Relaxed), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbage_peer_is_failed_over_and_counted() {
    let f = Fixture::start(NodeC::Garbage, "", |_| false).await;
    // Shards that `a` must read from `c` first (c ranks above b).
    let via_c: Vec<ShardKey> = shards()
        .into_iter()
        .filter(|k| {
            let o = f.map.owners_at(k, T0);
            o == vec![f.idx("c"), f.idx("b")]
        })
        .collect();
    assert!(!via_c.is_empty(), "the fixture needs a shard ranked c, b");
    let r = f.sql_engine().sql(ROWS_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(rows_of(&r), f.expected(|_| true));
    assert!(f.nodes[0].metrics.peer_read_failures.load(Relaxed) >= 1);
}

/// Epochs of the map: a and b, then from `change` on a, b and c.
fn c_joins_at(change: i64) -> String {
    let start = chrono::DateTime::from_timestamp_millis(change)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    format!(
        "[[epoch]]\nstart = \"2020-01-01T00:00:00Z\"\nnodes = [\"a\", \"b\"]\n\
         [[epoch]]\nstart = \"{start}\"\nnodes = [\"a\", \"b\", \"c\"]\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_epochs_owners_are_merged_each_sample_once() {
    // Node c joins at T0 + 10 steps; samples 8..12 are on both epochs'
    // owners (a replica that caught up), so the merge sees them twice.
    let change = T0 + 10 * STEP;
    let epochs = c_joins_at(change);
    let f = Fixture::start(NodeC::Flight, &epochs, |k| (8..12).contains(&k)).await;
    assert_eq!(f.map.epoch_at(change), 1);
    let moved: Vec<ShardKey> = shards()
        .into_iter()
        .filter(|k| !f.map.owners_in(1, k).contains(&f.idx("a")))
        .collect();
    assert!(!moved.is_empty(), "the fixture needs a shard that left a");
    let r = f.sql_engine().sql(ROWS_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(rows_of(&r), f.expected(|_| true));
    let a = prom_range(&f.prom_engine(), "temp").await;
    assert_eq!(rows_of_matrix(&a.value), f.expected(|s| s.metric == "temp"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flight_refuses_bad_tickets_and_other_calls() {
    let f = Fixture::three().await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", f.nodes[1].flight))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = FlightClient::new(channel);
    for bad in [
        &b"not json"[..],
        br#"{"v":2,"matchers":[],"min_ts":0,"max_ts":1,"shards":[]}"#,
        br#"{"v":1,"matchers":[{"name":"a","op":"<","value":"1"}],"min_ts":0,"max_ts":1,"shards":[]}"#,
        br#"{"v":1,"matchers":[{"name":"a","op":"=~","value":"("}],"min_ts":0,"max_ts":1,"shards":[]}"#,
        br#"{"v":1,"matchers":[],"min_ts":0,"max_ts":1,"shards":[{"rack":"r1","host":"h"}]}"#,
    ] {
        let e = match client.do_get(Ticket::new(bad.to_vec())).await {
            Ok(mut s) => s.next().await.unwrap().unwrap_err(),
            Err(e) => e,
        };
        let arrow_flight::error::FlightError::Tonic(status) = &e else {
            panic!("{e:?}")
        };
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    }
    assert_eq!(f.nodes[1].metrics.flight_bad_tickets.load(Relaxed), 5);

    let e = client.list_actions().await.err().unwrap();
    let arrow_flight::error::FlightError::Tonic(status) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(status.code(), tonic::Code::Unimplemented);

    // A good ticket: exactly the listed shard's series, over real gRPC.
    let held: Vec<ShardKey> = local_shard_keys(&f.nodes[1].storage).into_iter().collect();
    let one: BTreeSet<ShardKey> = [held[0].clone()].into();
    let ticket = wire::encode_ticket(
        &[Matcher::equal("__name__", "temp")],
        T0,
        T0 + 4 * STEP,
        &one,
        false,
    );
    let mut stream = client.do_get(Ticket::new(ticket)).await.unwrap();
    let mut decoder = AnswerDecoder::default();
    while let Some(b) = stream.next().await {
        decoder.push(&b.unwrap()).unwrap();
    }
    let got: BTreeMap<SeriesKey, Vec<(i64, u64)>> = decoder
        .finish()
        .into_iter()
        .map(|(k, s)| {
            (
                k,
                s.ts.iter()
                    .zip(&s.values)
                    .map(|(&t, v)| (t, v.to_bits()))
                    .collect(),
            )
        })
        .collect();
    let want: BTreeMap<SeriesKey, Vec<(i64, u64)>> = f
        .fleet
        .iter()
        .filter(|s| s.shard == held[0] && s.metric == "temp")
        .map(|s| {
            (
                s.key(),
                s.samples[..5]
                    .iter()
                    .map(|&(k, v)| (T0 + k * STEP, v.to_bits()))
                    .collect(),
            )
        })
        .collect();
    assert!(!want.is_empty());
    assert_eq!(got, want);
}

#[test]
fn answers_round_trip_and_long_series_continue() {
    let key = SeriesKey::new("m", vec![Label::new("rack", "r1"), Label::new("x", "é")]).unwrap();
    let other = SeriesKey::new("m", vec![Label::new("rack", "r2")]).unwrap();
    let ts: Vec<i64> = (0..10).collect();
    // NaN payloads survive bit-exact.
    let vs: Vec<f64> = (0..10)
        .map(|i| f64::from_bits(0x7ff0_0000_0000_0002 + i))
        .collect();
    let mut b = BatchBuilder::new();
    b.push(&key, &ts[..4], &vs[..4]);
    b.push(&other, &[5], &[1.5]);
    let first = b.finish();
    b.push(&key, &ts[4..], &vs[4..]);
    let second = b.finish();
    let mut d = AnswerDecoder::default();
    d.push(&first).unwrap();
    d.push(&second).unwrap();
    assert_eq!(d.samples(), 11);
    let got = d.finish();
    assert_eq!(got[&key].ts, ts);
    assert_eq!(
        got[&key]
            .values
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>(),
        vs.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
    assert_eq!(got[&other].ts, [5]);
}

#[test]
fn malformed_answers_are_refused() {
    let key = SeriesKey::new("m", vec![Label::new("rack", "r1")]).unwrap();
    // Another schema.
    let wrong = RecordBatch::try_from_iter([(
        "x",
        Arc::new(Int32Array::from(vec![1])) as arrow::array::ArrayRef,
    )])
    .unwrap();
    let e = AnswerDecoder::default().push(&wrong).unwrap_err();
    assert!(e.contains("schema"), "{e}");
    // Times that go back within a series, across rows.
    let mut b = BatchBuilder::new();
    b.push(&key, &[10, 20], &[1.0, 2.0]);
    b.push(&key, &[20, 30], &[2.0, 3.0]);
    let e = AnswerDecoder::default().push(&b.finish()).unwrap_err();
    assert!(e.contains("do not increase (20 then 20)"), "{e}");
    // Time and value lists of different lengths.
    let good = {
        let mut b = BatchBuilder::new();
        b.push(&key, &[1, 2], &[1.0, 2.0]);
        b.finish()
    };
    let short_values = arrow::array::ListArray::new(
        Arc::new(arrow::datatypes::Field::new_list_field(
            arrow::datatypes::DataType::Float64,
            false,
        )),
        arrow::buffer::OffsetBuffer::new(vec![0, 1].into()),
        Arc::new(arrow::array::Float64Array::from(vec![1.0])),
        None,
    );
    let bad = RecordBatch::try_new(
        good.schema(),
        vec![
            good.column(0).clone(),
            good.column(1).clone(),
            good.column(2).clone(),
            Arc::new(short_values),
        ],
    )
    .unwrap();
    let e = AnswerDecoder::default().push(&bad).unwrap_err();
    assert!(e.contains("2 times but 1 values"), "{e}");
    // A label named __name__ is not a valid series.
    let mut b = BatchBuilder::new();
    b.push(&SeriesKey::new("m", vec![]).unwrap(), &[1], &[1.0]);
    let batch = b.finish();
    let labels = {
        let mut mb = arrow::array::MapBuilder::new(
            None,
            arrow::array::StringBuilder::new(),
            arrow::array::StringBuilder::new(),
        );
        mb.keys().append_value("__name__");
        mb.values().append_value("x");
        mb.append(true).unwrap();
        mb.finish()
    };
    let bad = RecordBatch::try_new(
        batch.schema(),
        vec![
            batch.column(0).clone(),
            Arc::new(labels),
            batch.column(2).clone(),
            batch.column(3).clone(),
        ],
    )
    .unwrap();
    let e = AnswerDecoder::default().push(&bad).unwrap_err();
    assert!(e.contains("invalid series"), "{e}");
}

#[test]
fn merge_keeps_each_timestamp_once_first_part_wins() {
    let (t, v) = merge_first_wins(
        &[1, 3, 5, 7],
        &[1.0, 3.0, 5.0, 7.0],
        &[2, 3, 7, 8],
        &[20.0, 30.0, 70.0, 80.0],
    );
    assert_eq!(t, [1, 2, 3, 5, 7, 8]);
    assert_eq!(v, [1.0, 20.0, 3.0, 5.0, 7.0, 80.0]);
    let (t, v) = merge_first_wins(&[], &[], &[4], &[4.0]);
    assert_eq!((t, v), (vec![4], vec![4.0]));
}

#[test]
fn shard_pruning_follows_rack_and_hostname_matchers() {
    let rack = ShardKey::Rack("r1".into());
    let host = ShardKey::Host("h9".into());
    let m = |ms: &[Matcher], k: &ShardKey| shard_may_match(k, ms);
    assert!(m(&[Matcher::equal("rack", "r1")], &rack));
    assert!(!m(&[Matcher::equal("rack", "r2")], &rack));
    assert!(!m(&[Matcher::equal("rack", "r1")], &host));
    assert!(m(&[Matcher::equal("rack", "")], &host));
    assert!(m(&[Matcher::regex("rack", "r.*").unwrap()], &rack));
    assert!(m(&[Matcher::equal("Hostname", "h9")], &host));
    assert!(!m(&[Matcher::equal("Hostname", "h8")], &host));
    // A rack holds many hosts: a host matcher does not rule it out.
    assert!(m(&[Matcher::equal("Hostname", "h8")], &rack));
    assert!(m(&[Matcher::equal("gpu", "0")], &rack));
}

/// Serves node `a`'s HTTP API (SQL, Prometheus, remote read) on loopback.
async fn serve_http(f: &Fixture) -> (String, oneshot::Sender<()>) {
    let router = crate::http::router(f.sql_engine())
        .merge(crate::promql::api::router(f.prom_engine()))
        .merge(crate::remote_read::router_with_cluster(
            f.reader.clone(),
            crate::remote_read::RemoteReadLimits::default(),
            Arc::default(),
        ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(crate::http::serve(listener, router, async {
        let _ = rx.await;
    }));
    (url, tx)
}

/// An HTTP answer: status, headers (lower-case names, repeated ones kept), body.
type HttpAnswer = (u16, Vec<(String, String)>, Vec<u8>);

async fn http(method: &'static str, url: String, body: Vec<u8>, ct: &'static str) -> HttpAnswer {
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut resp = if method == "GET" {
            agent.get(&url).call().unwrap()
        } else {
            agent
                .post(&url)
                .header("content-type", ct)
                .send(&body[..])
                .unwrap()
        };
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_string(), v.to_str().unwrap_or("").to_string()))
            .collect();
        let body = resp.body_mut().read_to_vec().unwrap();
        (resp.status().as_u16(), headers, body)
    })
    .await
    .unwrap()
}

fn header<'a>(a: &'a HttpAnswer, name: &str) -> Vec<&'a str> {
    a.1.iter()
        .filter(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .collect()
}

fn json(a: &HttpAnswer) -> serde_json::Value {
    serde_json::from_slice(&a.2)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&a.2)))
}

/// A remote-read request for one metric over the fleet's time range.
fn read_request(metric: &str) -> Vec<u8> {
    use gpulse_proto::prometheus::{LabelMatcher, Query, ReadRequest, label_matcher};
    use prost::Message;
    let req = ReadRequest {
        queries: vec![Query {
            start_timestamp_ms: T0,
            end_timestamp_ms: T0 + (N - 1) * STEP,
            matchers: vec![LabelMatcher {
                r#type: label_matcher::Type::Eq as i32,
                name: "__name__".into(),
                value: metric.into(),
            }],
            hints: None,
        }],
        accepted_response_types: vec![],
    };
    snap::raw::Encoder::new()
        .compress_vec(&req.encode_to_vec())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_answers_are_complete_or_say_they_are_partial() {
    // All up: no partial marks; remote read returns every sample once.
    let f = Fixture::three().await;
    let (url, _stop) = serve_http(&f).await;
    let a = http(
        "POST",
        format!("{url}/api/v1/sql"),
        b"SELECT count(*) FROM samples".to_vec(),
        "text/plain",
    )
    .await;
    assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.2));
    assert!(header(&a, "x-gpulse-partial").is_empty());
    let v = json(&a);
    assert_eq!(v["rows"][0][0], f.fleet.len() as u64 * N as u64);
    assert!(v.get("warnings").is_none(), "{v}");

    let a = http(
        "POST",
        format!("{url}/api/v1/read"),
        read_request("power"),
        "application/x-protobuf",
    )
    .await;
    assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.2));
    let raw = snap::raw::Decoder::new().decompress_vec(&a.2).unwrap();
    let resp =
        <gpulse_proto::prometheus::ReadResponse as prost::Message>::decode(&raw[..]).unwrap();
    let mut got: Vec<Row> = Vec::new();
    for ts in &resp.results[0].timeseries {
        let get = |n: &str| {
            ts.labels
                .iter()
                .find(|l| l.name == n)
                .map(|l| l.value.clone())
                .unwrap_or_default()
        };
        for s in &ts.samples {
            got.push((
                get("__name__"),
                get("rack"),
                get("Hostname"),
                get("gpu"),
                s.timestamp,
                s.value.to_bits(),
            ));
        }
    }
    got.sort();
    assert_eq!(got, f.expected(|s| s.metric == "power"));

    // Both owners of some shards down.
    let mut f = Fixture::three().await;
    let (url, _stop) = serve_http(&f).await;
    let lost = f.shards_owned_by(&["b", "c"]);
    f.down("b", true).await;
    f.down("c", true).await;
    let kept_rows = f.expected(|s| !lost.contains(&s.shard)).len() as u64;

    for format in ["json", "csv"] {
        let a = http(
            "POST",
            format!("{url}/api/v1/sql?format={format}"),
            b"SELECT count(*) FROM samples".to_vec(),
            "text/plain",
        )
        .await;
        assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.2));
        assert_eq!(header(&a, "x-gpulse-partial"), ["true"], "{format}");
        let warned = header(&a, "x-gpulse-warning");
        assert_eq!(warned.len(), lost.len(), "{warned:?}");
        if format == "json" {
            let v = json(&a);
            assert_eq!(v["rows"][0][0], kept_rows);
            let w = v["warnings"].as_array().unwrap();
            assert_eq!(w.len(), lost.len(), "{v}");
            for k in &lost {
                assert!(
                    w.iter()
                        .any(|w| w.as_str().unwrap().contains(&format!("{k} could be read"))),
                    "{v}"
                );
            }
        } else {
            assert_eq!(
                String::from_utf8_lossy(&a.2),
                format!("count(*)\n{kept_rows}\n")
            );
        }
    }

    let temp_kept = f
        .fleet
        .iter()
        .filter(|s| s.metric == "temp" && !lost.contains(&s.shard))
        .count();
    let a = http(
        "GET",
        format!("{url}/api/v1/query?query=count(temp)&time={}", T0 / 1000),
        Vec::new(),
        "",
    )
    .await;
    assert_eq!(a.0, 200, "{}", String::from_utf8_lossy(&a.2));
    let v = json(&a);
    assert_eq!(v["status"], "success");
    assert_eq!(v["data"]["result"][0]["value"][1], temp_kept.to_string());
    assert_eq!(v["warnings"].as_array().unwrap().len(), lost.len(), "{v}");

    let a = http(
        "GET",
        format!("{url}/api/v1/series?match[]=temp"),
        Vec::new(),
        "",
    )
    .await;
    let v = json(&a);
    assert_eq!(v["data"].as_array().unwrap().len(), temp_kept, "{v}");
    assert_eq!(v["warnings"].as_array().unwrap().len(), lost.len(), "{v}");

    // Remote read cannot mark an answer partial: it fails.
    let a = http(
        "POST",
        format!("{url}/api/v1/read"),
        read_request("temp"),
        "application/x-protobuf",
    )
    .await;
    assert_eq!(a.0, 503);
    let msg = String::from_utf8_lossy(&a.2);
    assert!(
        msg.contains("remote read refused: the answer would be partial"),
        "{msg}"
    );
    assert!(msg.contains(&lost[0].to_string()), "{msg}");
}

/// Reads one backend message: its type byte and body.
async fn pg_message(s: &mut tokio::net::TcpStream) -> (u8, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let kind = s.read_u8().await.unwrap();
    let len = s.read_i32().await.unwrap();
    let mut body = vec![0; len as usize - 4];
    s.read_exact(&mut body).await.unwrap();
    (kind, body)
}

/// Sends a simple query and returns the messages up to ReadyForQuery.
async fn pg_query(s: &mut tokio::net::TcpStream, sql: &str) -> Vec<(u8, Vec<u8>)> {
    use tokio::io::AsyncWriteExt;
    let mut msg = vec![b'Q'];
    msg.extend_from_slice(&(4 + sql.len() as i32 + 1).to_be_bytes());
    msg.extend_from_slice(sql.as_bytes());
    msg.push(0);
    s.write_all(&msg).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = pg_message(s).await;
        if m.0 == b'Z' {
            return out;
        }
        out.push(m);
    }
}

/// The fields of an ErrorResponse or NoticeResponse, by code.
fn pg_fields(body: &[u8]) -> BTreeMap<u8, String> {
    let mut out = BTreeMap::new();
    let mut rest = body;
    while let Some((&code, tail)) = rest.split_first() {
        if code == 0 {
            break;
        }
        let end = tail.iter().position(|&b| b == 0).unwrap();
        out.insert(code, String::from_utf8(tail[..end].to_vec()).unwrap());
        rest = &tail[end + 1..];
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_clients_get_partial_results_as_notices() {
    use tokio::io::AsyncWriteExt;
    let mut f = Fixture::three().await;
    let lost = f.shards_owned_by(&["b", "c"]);
    f.down("b", true).await;
    f.down("c", true).await;
    let kept_rows = f.expected(|s| !lost.contains(&s.shard)).len();

    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, rx) = oneshot::channel::<()>();
    tokio::spawn(crate::pg::serve(
        listener,
        f.sql_engine(),
        None,
        None,
        async {
            let _ = rx.await;
        },
    ));
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut startup = Vec::new();
    startup.extend_from_slice(&196_608i32.to_be_bytes());
    startup.extend_from_slice(b"user\0test\0database\0gpulse\0\0");
    let mut msg = (4 + startup.len() as i32).to_be_bytes().to_vec();
    msg.extend_from_slice(&startup);
    s.write_all(&msg).await.unwrap();
    while pg_message(&mut s).await.0 != b'Z' {}

    let messages = pg_query(&mut s, "SELECT count(*) FROM samples").await;
    let notices: Vec<BTreeMap<u8, String>> = messages
        .iter()
        .filter(|(k, _)| *k == b'N')
        .map(|(_, b)| pg_fields(b))
        .collect();
    assert_eq!(notices.len(), lost.len(), "{notices:?}");
    for (n, k) in notices.iter().zip(&lost) {
        assert_eq!(n[&b'S'], "WARNING");
        assert_eq!(n[&b'C'], "01000");
        assert!(n[&b'M'].contains(&format!("{k} could be read")), "{n:?}");
    }
    // The rows still come: the count of what the other shards hold.
    let row = messages.iter().find(|(k, _)| *k == b'D').unwrap();
    let len = i32::from_be_bytes(row.1[2..6].try_into().unwrap()) as usize;
    assert_eq!(
        std::str::from_utf8(&row.1[6..6 + len]).unwrap(),
        kept_rows.to_string()
    );
    // The notices come before the result.
    let first_notice = messages.iter().position(|(k, _)| *k == b'N').unwrap();
    let description = messages.iter().position(|(k, _)| *k == b'T').unwrap();
    assert!(first_notice < description);
    // The count ran where the data is, for PostgreSQL clients too.
    assert_eq!(f.nodes[0].metrics.sql_pushdowns.load(Relaxed), 1);
    assert_eq!(f.nodes[0].metrics.peer_samples_received.load(Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_samples_from_peers_fail_the_query() {
    let f = Fixture::three().await;
    let reader = ClusterReader::new(
        f.state.clone(),
        f.nodes[0].storage.clone(),
        f.nodes[0].metrics.clone(),
        ReaderConfig {
            max_peer_samples: 10,
            refresh_timeout: None,
            ..ReaderConfig::default()
        },
    );
    let engine = QueryEngine::with_cluster(
        f.nodes[0].storage.clone(),
        ResultLimits::default(),
        reader.clone(),
    );
    let e = engine.sql(ROWS_SQL).await.unwrap_err();
    assert!(
        matches!(
            e,
            QueryError::TooLarge(crate::LimitExceeded::PeerSamples { limit: 10 })
        ),
        "{e:?}"
    );
    let prom = PromEngine::with_cluster(reader, PromLimits::default());
    let e = tokio::task::spawn_blocking(move || prom.instant_answer("temp", T0))
        .await
        .unwrap()
        .unwrap_err();
    assert!(
        matches!(&e, crate::promql::PromError::Execution(m) if m.contains("more than 10 samples from other nodes")),
        "{e:?}"
    );
}

/// One rollup row: level, metric, rack, host, gpu, window start, count,
/// and the bits of sum, min, max, first, last.
type RollupRow = (String, String, String, String, String, i64, i64, [u64; 5]);

const ROLLUP_SQL: &str = "SELECT level, metric, rack, host, gpu, ts, count, sum, min, max, first, last \
                          FROM rollup_1m";

fn rollup_rows_of(r: &QueryResult) -> Vec<RollupRow> {
    let mut out = Vec::new();
    for b in &r.batches {
        let text = |i: usize, row: usize| -> String {
            let c = b.column(i);
            if c.is_null(row) {
                return String::new();
            }
            c.as_string::<i32>().value(row).to_string()
        };
        let ts = b.column(5).as_primitive::<TimestampMillisecondType>();
        let count = b.column(6).as_primitive::<arrow::datatypes::Int64Type>();
        let f = |i: usize, row: usize| {
            b.column(i)
                .as_primitive::<Float64Type>()
                .value(row)
                .to_bits()
        };
        for row in 0..b.num_rows() {
            out.push((
                text(0, row),
                text(1, row),
                text(2, row),
                text(3, row),
                text(4, row),
                ts.value(row),
                count.value(row),
                [f(7, row), f(8, row), f(9, row), f(10, row), f(11, row)],
            ));
        }
    }
    out.sort();
    out
}

/// The 1-minute rollups of the fleet's series that `keep` accepts, at every
/// level, computed from the samples written.
fn expected_rollups(fleet: &[TestSeries], keep: impl Fn(&TestSeries) -> bool) -> Vec<RollupRow> {
    // (level, metric, rack, host, gpu, window) -> samples (ts, value).
    type Group = (String, String, String, String, String, i64);
    let mut groups: BTreeMap<Group, Vec<(i64, f64)>> = BTreeMap::new();
    for s in fleet.iter().filter(|s| keep(s)) {
        for &(k, v) in &s.samples {
            let t = T0 + k * STEP;
            let window = t - t.rem_euclid(60_000);
            let (rack, host, gpu) = (s.rack(), s.host.clone(), s.gpu.clone());
            let e = String::new;
            for (level, r, h, g) in [
                ("gpu", rack.clone(), host.clone(), gpu.clone()),
                ("host", rack.clone(), host.clone(), e()),
                ("rack", rack.clone(), e(), e()),
                ("row", e(), e(), e()),
                ("cluster", e(), e(), e()),
            ] {
                groups
                    .entry((level.into(), s.metric.into(), r, h, g, window))
                    .or_default()
                    .push((t, v));
            }
        }
    }
    let mut out: Vec<RollupRow> = groups
        .into_iter()
        .map(|((level, metric, rack, host, gpu, window), mut samples)| {
            // first: smallest time, then smallest value; last: largest time, then largest value.
            samples.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
            let values: Vec<f64> = samples.iter().map(|s| s.1).collect();
            let sum: f64 = values.iter().sum();
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (
                level,
                metric,
                rack,
                host,
                gpu,
                window,
                samples.len() as i64,
                [
                    sum.to_bits(),
                    min.to_bits(),
                    max.to_bits(),
                    samples[0].1.to_bits(),
                    samples[samples.len() - 1].1.to_bits(),
                ],
            )
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollups_are_cluster_wide_at_every_level() {
    let f = Fixture::three().await;
    let r = f.sql_engine().sql(ROLLUP_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    let want = expected_rollups(&f.fleet, |_| true);
    // Every level is there (5 windows of 4 samples per series).
    assert!(want.iter().any(|r| r.0 == "cluster" && r.6 > 4));
    assert_eq!(rollup_rows_of(&r), want);

    // rollup(…) and a pushed-down rack and level.
    let lost = f.shards_owned_by(&["b", "c"]);
    let ShardKey::Rack(rack) = &lost[0] else {
        panic!("not a rack")
    };
    let sql = format!(
        "SELECT level, metric, rack, host, gpu, ts, count, sum, min, max, first, last \
         FROM rollup('{}', '{}', '1m') WHERE rack = '{rack}' AND level IN ('host', 'rack')",
        crate::pushdown::format_ms(T0),
        crate::pushdown::format_ms(T0 + N * STEP)
    );
    let r = f.sql_engine().sql(&sql).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    let want: Vec<RollupRow> = expected_rollups(&f.fleet, |s| s.shard == lost[0])
        .into_iter()
        .filter(|r| r.0 == "host" || r.0 == "rack")
        .collect();
    assert!(!want.is_empty());
    assert_eq!(rollup_rows_of(&r), want);

    // A node down: failed over, still complete.
    let mut f = f;
    f.down("c", false).await;
    let r = f.sql_engine().sql(ROLLUP_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(rollup_rows_of(&r), expected_rollups(&f.fleet, |_| true));

    // Both owners of some shards down: the others complete, at every level
    // (row and cluster without the lost shards), and a warning for each.
    f.down("b", true).await;
    let r = f.sql_engine().sql(ROLLUP_SQL).await.unwrap();
    assert_eq!(
        rollup_rows_of(&r),
        expected_rollups(&f.fleet, |s| !lost.contains(&s.shard))
    );
    assert_eq!(r.warnings.len(), lost.len(), "{:?}", r.warnings);
    for k in &lost {
        assert!(
            r.warnings
                .iter()
                .any(|w| w.contains(&format!("{k} could be read"))),
            "{:?}",
            r.warnings
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollups_across_an_epoch_change_warn_about_the_split_window() {
    let change = T0 + 10 * STEP; // 2.5 minutes in: inside a 1-minute window
    let epochs = c_joins_at(change);
    let f = Fixture::start(NodeC::Flight, &epochs, |_| false).await;
    let r = f
        .sql_engine()
        .sql(&format!("{ROLLUP_SQL} WHERE level = 'gpu'"))
        .await
        .unwrap();
    assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    assert!(
        r.warnings[0].contains("window that holds the membership change at")
            && r.warnings[0].contains(&crate::pushdown::format_ms(change)),
        "{:?}",
        r.warnings
    );
    // Windows wholly inside one epoch are exact: the first two minutes and
    // the last two.
    let whole = |w: i64| !(T0 + 120_000..T0 + 180_000).contains(&w);
    let got: Vec<RollupRow> = rollup_rows_of(&r)
        .into_iter()
        .filter(|r| whole(r.5))
        .collect();
    let want: Vec<RollupRow> = expected_rollups(&f.fleet, |_| true)
        .into_iter()
        .filter(|r| r.0 == "gpu" && whole(r.5))
        .collect();
    assert_eq!(got, want);
}

/// fuzz/crashes/flight_answer: a 4-byte input whose first word, read as an
/// IPC metadata length, declared about 2 GB, which Arrow's reader then
/// allocated. Lengths are checked against the input first; a whole answer
/// still reads.
#[test]
fn a_raw_answer_that_declares_more_than_it_holds_is_refused_before_reading() {
    use super::fuzzing::answer;
    assert!(!answer(&[0x01, 0xb5, 0x01, 0x7e]));
    // Every input the fuzzer crashed on (fuzz/crashes/flight_answer/):
    // the OOM above, and schema messages without a field list, on which
    // arrow-ipc 59.3.2 panics: each is a malformed answer.
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/crashes/flight_answer");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        assert!(
            !answer(&std::fs::read(&path).unwrap()),
            "{}",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 3, "the crash inputs are in {}", dir.display());
    // A body length past the end: a real schema message, cut after its
    // metadata.
    let key = storage::SeriesKey::new("power", vec![storage::Label::new("gpu", "0")]).unwrap();
    let mut b = super::wire::BatchBuilder::new();
    b.push(&key, &[1_000, 2_000], &[1.5, -0.0]);
    let batch = b.finish();
    let mut whole = Vec::new();
    {
        let mut w =
            arrow::ipc::writer::StreamWriter::try_new(&mut whole, &super::wire::schema()).unwrap();
        w.write(&batch).unwrap();
        w.finish().unwrap();
    }
    assert!(answer(&whole));
    for cut in [8, whole.len() / 2, whole.len() - 9] {
        assert!(!answer(&whole[..cut]), "cut at {cut} of {}", whole.len());
    }
}

/// fuzz/crashes/flight_health: a record batch whose validity buffer is
/// shorter than its array; Arrow's IPC decoder (arrow-buffer 59.3.2,
/// `BooleanBuffer::new`) panics building it. The node catches a panic of
/// that step as a malformed answer, and so does the harness; a peer's real
/// health answers still read.
#[test]
fn a_health_answer_that_arrow_cannot_decode_is_refused() {
    use super::fuzzing::health_answer;
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/crashes/flight_health");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        assert!(
            !health_answer(&std::fs::read(&path).unwrap()),
            "{}",
            path.display()
        );
        n += 1;
    }
    assert!(n >= 1, "the crash inputs are in {}", dir.display());
    assert!(!super::fuzzing::in_arrow_decoder(), "the flag is cleared");
    let seeds =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/flight_health");
    for name in ["events", "states"] {
        let bytes = std::fs::read(seeds.join(name)).unwrap();
        assert!(health_answer(&bytes), "{name}");
    }
}

/// Every sample of the fleet in one storage: a single node's answers, the
/// reference of the pushdown tests.
fn single_node(f: &Fixture) -> (tempfile::TempDir, PromEngine) {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    for s in &f.fleet {
        write(&storage, s, |_| true);
    }
    (dir, PromEngine::new(storage).without_rollup_tiers())
}

/// Label set -> points, values compared to a relative 1e-12 (a pushed-down
/// `sum` adds the nodes' partial sums in another order).
fn assert_same_matrix(q: &str, got: &PromValue, want: &PromValue) {
    let (PromValue::Matrix(got), PromValue::Matrix(want)) = (got, want) else {
        panic!("{q}: not matrices: {got:?} {want:?}");
    };
    let labels =
        |m: &[crate::promql::Series]| -> Vec<_> { m.iter().map(|s| s.labels.clone()).collect() };
    assert_eq!(labels(got), labels(want), "{q}: label sets");
    assert!(!want.is_empty(), "{q}: the reference answer is empty");
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g.points.len(), w.points.len(), "{q} {:?}: points", w.labels);
        for (&(gt, gv), &(wt, wv)) in g.points.iter().zip(&w.points) {
            assert_eq!(gt, wt, "{q} {:?}", w.labels);
            let close =
                (gv - wv).abs() <= 1e-12 * wv.abs().max(1.0) || (gv.is_nan() && wv.is_nan());
            assert!(close, "{q} {:?} at {wt}: {gv} vs {wv}", w.labels);
        }
    }
}

const PUSHED: [&str; 14] = [
    "sum by (rack) (rate(power[1m]))",
    "topk(3, temp)",
    "bottomk by (rack) (2, power)",
    // Ties: the series first in key order wins, as on one node.
    "topk(7, floor(temp / 100000))",
    "min(power)",
    "max(-temp)",
    "count(temp)",
    "avg(temp)",
    "count by (Hostname) (temp > 2000)",
    "min by (rack) (power)",
    "max without (gpu) (temp)",
    "group by (rack) (power)",
    "sum(power) / 2",
    "avg by (rack) (avg_over_time(temp[2m] offset 30s))",
];

/// `q` over the fixture's range through node a, which must push it down
/// (one pushdown more, no raw sample from a peer) and answer it whole.
async fn pushed_down(f: &Fixture, q: &str) -> PromValue {
    let m = &f.nodes[0].metrics;
    let (pushdowns, samples) = (
        m.promql_pushdowns.load(Relaxed),
        m.peer_samples_received.load(Relaxed),
    );
    let a = prom_range(&f.prom_engine(), q).await;
    assert!(a.warnings.is_empty(), "{q}: {:?}", a.warnings);
    assert_eq!(
        m.promql_pushdowns.load(Relaxed),
        pushdowns + 1,
        "{q} was pushed down"
    );
    assert_eq!(
        m.peer_samples_received.load(Relaxed),
        samples,
        "{q} read no raw samples from peers"
    );
    a.value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregations_are_pushed_down_and_answer_as_one_node() {
    let mut f = Fixture::three().await;
    let (_dir, reference) = single_node(&f);
    let m = f.nodes[0].metrics.clone();
    for q in PUSHED {
        let got = pushed_down(&f, q).await;
        assert_same_matrix(q, &got, &prom_range(&reference, q).await.value);
    }
    assert!(m.peer_partial_points_received.load(Relaxed) > 0);
    let sent: u64 = f.nodes[1..]
        .iter()
        .map(|n| n.metrics.flight_bytes_sent.load(Relaxed))
        .sum();
    assert!(sent > 0, "peers count the bytes they send");

    // By hand, at one instant: the hottest GPU per host and the mean power.
    let k = 11;
    let engine = f.prom_engine();
    let got = tokio::task::spawn_blocking(move || {
        [
            engine.instant("max by (Hostname) (temp)", T0 + k * STEP),
            engine.instant("avg(power)", T0 + k * STEP),
        ]
    })
    .await
    .unwrap();
    let mut hottest: BTreeMap<String, f64> = BTreeMap::new();
    let (mut sum, mut count) = (0.0, 0.0);
    for s in &f.fleet {
        let v = s.samples[k as usize].1;
        if s.metric == "temp" {
            let e = hottest.entry(s.host.clone()).or_insert(f64::MIN);
            *e = e.max(v);
        } else {
            sum += v;
            count += 1.0;
        }
    }
    let [max, avg] = got;
    let PromValue::Vector(max) = max.unwrap() else {
        panic!("not a vector")
    };
    let max: BTreeMap<String, f64> = max
        .iter()
        .map(|s| (s.labels[0].1.to_string(), s.v))
        .collect();
    assert_eq!(max, hottest);
    let PromValue::Vector(avg) = avg.unwrap() else {
        panic!("not a vector")
    };
    assert_eq!(avg.len(), 1);
    assert!(
        (avg[0].v - sum / count).abs() < 1e-9,
        "{} vs {}",
        avg[0].v,
        sum / count
    );

    // A peer that stopped (not yet noticed): its shards go to their other
    // owner, evaluated there; the answer is still whole.
    f.down("b", false).await;
    for q in PUSHED {
        let a = prom_range(&f.prom_engine(), q).await;
        assert!(a.warnings.is_empty(), "{q}: {:?}", a.warnings);
        assert_same_matrix(q, &a.value, &prom_range(&reference, q).await.value);
    }
    assert!(m.peer_read_failures.load(Relaxed) >= 1);
}

/// Range queries of one series at a time: evaluated where the series are.
const SERIES_PUSHED: [&str; 6] = [
    "temp",
    "power * 1000000",
    "rate(power[1m])",
    "clamp_max(temp, 2000)",
    "timestamp(power)",
    "(avg_over_time(temp[2m] offset 30s))",
];

/// Label set -> points with their values' bits: a series-wise pushdown
/// evaluates each series whole on one node, as one node does.
fn matrix_bits(v: &PromValue) -> Vec<(String, Vec<(i64, u64)>)> {
    let PromValue::Matrix(m) = v else {
        panic!("not a matrix: {v:?}")
    };
    m.iter()
        .map(|s| {
            (
                format!("{:?}", s.labels),
                s.points.iter().map(|&(t, v)| (t, v.to_bits())).collect(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn series_wise_range_queries_are_pushed_down_and_answer_as_one_node() {
    let f = Fixture::three().await;
    let (_dir, reference) = single_node(&f);
    let m = f.nodes[0].metrics.clone();
    for q in SERIES_PUSHED {
        let got = pushed_down(&f, q).await;
        let want = prom_range(&reference, q).await.value;
        assert!(!matrix_bits(&want).is_empty(), "{q}: empty reference");
        assert_eq!(matrix_bits(&got), matrix_bits(&want), "{q}");
    }
    // Each series' samples, every step, are the written ones.
    let a = prom_range(&f.prom_engine(), "temp").await;
    assert_eq!(rows_of_matrix(&a.value), f.expected(|s| s.metric == "temp"));

    // Steps shorter than 10 s read raw samples (the points would outnumber
    // them), with the same answer.
    let pushdowns = m.promql_pushdowns.load(Relaxed);
    let (engine, reference) = (f.prom_engine(), reference.clone());
    let (got, want) = tokio::task::spawn_blocking(move || {
        let q = "rate(power[1m])";
        let (end, step) = (T0 + (N - 1) * STEP, 5_000);
        (
            engine.range_answer(q, T0, end, step).unwrap().value,
            reference.range_answer(q, T0, end, step).unwrap().value,
        )
    })
    .await
    .unwrap();
    assert_eq!(matrix_bits(&got), matrix_bits(&want));
    assert_eq!(m.promql_pushdowns.load(Relaxed), pushdowns);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregation_across_an_epoch_change_reads_raw_samples() {
    let change = T0 + 10 * STEP;
    let epochs = c_joins_at(change);
    let f = Fixture::start(NodeC::Flight, &epochs, |_| false).await;
    let (_dir, reference) = single_node(&f);
    for q in PUSHED.into_iter().chain(SERIES_PUSHED) {
        let a = prom_range(&f.prom_engine(), q).await;
        assert_same_matrix(q, &a.value, &prom_range(&reference, q).await.value);
    }
    assert_eq!(f.nodes[0].metrics.promql_pushdowns.load(Relaxed), 0);
}

#[test]
fn promql_tickets_round_trip_and_bad_ones_are_refused() {
    let req = wire::PromqlRequest {
        queries: vec!["sum by (rack) (x)".into(), "count by (rack) (x)".into()],
        start: T0,
        end: T0 + 60_000,
        step: 15_000,
        lookback_ms: 300_000,
    };
    let shards: BTreeSet<ShardKey> = [ShardKey::Rack("r1".into())].into();
    let back = wire::decode_ticket(&wire::encode_promql_ticket(&req, &shards)).unwrap();
    assert_eq!(back.promql.as_ref(), Some(&req));
    assert_eq!(back.shards, shards);
    let bad = |edit: &dyn Fn(&mut wire::PromqlRequest)| {
        let mut r = req.clone();
        edit(&mut r);
        wire::decode_ticket(&wire::encode_promql_ticket(&r, &shards)).unwrap_err()
    };
    assert!(bad(&|r| r.queries.clear()).contains("1 to 4 queries"));
    assert!(bad(&|r| r.step = -1).contains("bad PromQL evaluation times"));
    assert!(bad(&|r| r.step = 0).contains("bad PromQL evaluation times"));
    assert!(bad(&|r| r.end = r.start + 20_000 * r.step).contains("at most 11000 steps"));
    assert!(bad(&|r| r.lookback_ms = 0).contains("lookback"));
    let both = br#"{"v":1,"matchers":[],"min_ts":0,"max_ts":0,"shards":[],"health":"events","promql":{"queries":["sum(x)"],"start":0,"end":0,"step":0,"lookback_ms":1}}"#;
    assert!(
        wire::decode_ticket(both)
            .unwrap_err()
            .contains("not several")
    );
}

#[test]
fn malformed_partial_answers_are_refused() {
    let batch = |query: &str, labels: &[(&str, &str)], ts: &[i64], vs: &[f64]| {
        let mut b = BatchBuilder::new();
        b.push_labels(query, labels.iter().copied(), ts, vs);
        b.finish()
    };
    let mut rows = Vec::new();
    let ok = batch(
        "1",
        &[("Hostname", "h"), ("rack", "r")],
        &[1, 2],
        &[0.5, f64::NAN],
    );
    assert_eq!(wire::decode_partials(&ok, 2, &mut rows), Ok(2));
    assert_eq!(rows[0].query, 1);
    assert_eq!(
        rows[0].labels,
        [("Hostname".into(), "h".into()), ("rack".into(), "r".into())]
    );
    for (b, why) in [
        (batch("2", &[], &[1], &[0.0]), "names none"),
        (batch("x", &[], &[1], &[0.0]), "names none"),
        (
            batch("0", &[("rack", "r"), ("Hostname", "h")], &[1], &[0.0]),
            "not sorted",
        ),
        (
            batch("0", &[("rack", "r"), ("rack", "s")], &[1], &[0.0]),
            "not sorted",
        ),
        (batch("0", &[], &[2, 1], &[0.0, 1.0]), "do not increase"),
    ] {
        let e = wire::decode_partials(&b, 2, &mut rows).unwrap_err();
        assert!(e.contains(why), "{e}");
    }
}

/// The fuzz target's seeds (`fuzz/seeds/flight_ticket/`) are tickets this
/// node accepts, so that the fuzzer starts from the format as it is.
#[test]
fn the_flight_ticket_fuzz_seeds_decode() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/flight_ticket");
    let (mut promql, mut sql) = (0, 0);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let req = wire::decode_ticket(&std::fs::read(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        promql += usize::from(req.promql.is_some());
        sql += usize::from(req.sql.is_some());
    }
    assert_eq!(promql, 1, "one seed is a PromQL ticket");
    assert_eq!(sql, 1, "one seed is a SQL ticket");
}

/// SQL aggregates over `samples` that run on each owner (`sql_pushdown`).
/// The fleet's values are multiples of 0.25 under 2^20, so every sum is
/// exact in any order and the answers must be equal to the last bit.
const SQL_PUSHED: [&str; 9] = [
    "SELECT count(*) FROM samples",
    "SELECT rack, metric, count(*), sum(value), min(value), max(value), avg(value) \
     FROM samples GROUP BY rack, metric ORDER BY rack, metric",
    "SELECT host, avg(value) AS mean FROM samples WHERE metric = 'temp' AND ts >= \
     to_timestamp_millis(1796032875000) GROUP BY host HAVING avg(value) > 1000 ORDER BY mean DESC, host",
    "SELECT date_bin(INTERVAL '1 minute', ts) AS minute, max(value), min(ts) FROM samples \
     WHERE metric = 'power' GROUP BY minute ORDER BY minute",
    "SELECT count(value), sum(value), avg(value) FROM samples WHERE metric = 'none'",
    "SELECT gpu, count(*) AS n FROM samples WHERE ts > now() - INTERVAL '3650 days' \
     GROUP BY gpu ORDER BY gpu",
    "SELECT upper(host) AS h, sum(value * 2) FROM samples WHERE rack <> '' OR gpu = '1' \
     GROUP BY upper(host) ORDER BY h LIMIT 5",
    // DataFusion turns it into a count over a GROUP BY host, which is pushed.
    "SELECT count(DISTINCT host) FROM samples",
    "SELECT s.metric, min(s.value) AS low FROM samples s WHERE s.gpu = '0' GROUP BY s.metric \
     ORDER BY s.metric",
];

fn table_text(q: &str, r: &QueryResult) -> String {
    let names: Vec<&str> = r
        .schema
        .fields()
        .iter()
        .map(|f| f.name().as_str())
        .collect();
    let text = arrow::util::pretty::pretty_format_batches(&r.batches).unwrap();
    format!("{q}\n{names:?}\n{text}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_aggregates_are_pushed_down_and_answer_as_one_node() {
    let mut f = Fixture::three().await;
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    for s in &f.fleet {
        write(&storage, s, |_| true);
    }
    let reference = QueryEngine::new(storage);
    let m = f.nodes[0].metrics.clone();
    for q in SQL_PUSHED {
        let (pushdowns, samples) = (
            m.sql_pushdowns.load(Relaxed),
            m.peer_samples_received.load(Relaxed),
        );
        let got = f.sql_engine().sql(q).await.unwrap();
        assert!(got.warnings.is_empty(), "{q}: {:?}", got.warnings);
        let want = reference.sql(q).await.unwrap();
        assert!(
            want.batches.iter().any(|b| b.num_rows() > 0),
            "{q}: empty reference"
        );
        assert_eq!(table_text(q, &got), table_text(q, &want));
        assert_eq!(
            m.sql_pushdowns.load(Relaxed),
            pushdowns + 1,
            "{q} was pushed down"
        );
        assert_eq!(
            m.peer_samples_received.load(Relaxed),
            samples,
            "{q} read no raw samples from peers"
        );
    }

    // By hand: the count of every sample, and the hottest temperature.
    let got = f
        .sql_engine()
        .sql("SELECT count(*), max(value) FROM samples WHERE metric = 'temp'")
        .await
        .unwrap();
    let b = &got.batches[0];
    let temps: Vec<f64> = f
        .fleet
        .iter()
        .filter(|s| s.metric == "temp")
        .flat_map(|s| s.samples.iter().map(|&(_, v)| v))
        .collect();
    assert_eq!(
        b.column(0)
            .as_primitive::<arrow::datatypes::Int64Type>()
            .value(0),
        temps.len() as i64
    );
    let hottest = temps.iter().copied().fold(f64::MIN, f64::max);
    assert_eq!(b.column(1).as_primitive::<Float64Type>().value(0), hottest);

    // Two aggregates in one statement, the second pushed down only after
    // DataFusion rewrote its DISTINCT: both run on the owners.
    let q = "SELECT * FROM (SELECT count(*) AS a FROM samples) x \
             CROSS JOIN (SELECT count(DISTINCT host) AS b FROM samples) y";
    let before = m.sql_pushdowns.load(Relaxed);
    let got = f.sql_engine().sql(q).await.unwrap();
    assert_eq!(
        table_text(q, &got),
        table_text(q, &reference.sql(q).await.unwrap())
    );
    assert_eq!(m.sql_pushdowns.load(Relaxed), before + 2, "{q}");

    // Not pushed down, and still right: a join, an aggregate DISTINCT with
    // another one, a median.
    for q in [
        "SELECT count(DISTINCT host), count(DISTINCT gpu) FROM samples",
        "SELECT median(value) FROM samples",
        "SELECT count(*) FROM samples a JOIN samples b ON a.host = b.host AND a.ts = b.ts \
         AND a.metric = b.metric AND a.gpu = b.gpu",
    ] {
        let before = m.sql_pushdowns.load(Relaxed);
        let got = f.sql_engine().sql(q).await.unwrap();
        assert_eq!(
            table_text(q, &got),
            table_text(q, &reference.sql(q).await.unwrap())
        );
        assert_eq!(
            m.sql_pushdowns.load(Relaxed),
            before,
            "{q} read raw samples"
        );
    }

    // A peer that stopped (not yet noticed): its shards are run on their
    // other owner; the answer is still whole.
    f.down("b", false).await;
    for q in SQL_PUSHED {
        let got = f.sql_engine().sql(q).await.unwrap();
        assert!(got.warnings.is_empty(), "{q}: {:?}", got.warnings);
        assert_eq!(
            table_text(q, &got),
            table_text(q, &reference.sql(q).await.unwrap())
        );
    }
    assert!(m.peer_read_failures.load(Relaxed) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sql_aggregate_across_an_epoch_change_reads_raw_samples() {
    let change = T0 + 10 * STEP;
    let epochs = c_joins_at(change);
    let f = Fixture::start(NodeC::Flight, &epochs, |_| false).await;
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    for s in &f.fleet {
        write(&storage, s, |_| true);
    }
    let reference = QueryEngine::new(storage);
    for q in SQL_PUSHED {
        let got = f.sql_engine().sql(q).await.unwrap();
        assert_eq!(
            table_text(q, &got),
            table_text(q, &reference.sql(q).await.unwrap())
        );
    }
    assert_eq!(f.nodes[0].metrics.sql_pushdowns.load(Relaxed), 0);
    // Within one epoch (before the change) it is pushed down again.
    let q = "SELECT count(*) FROM samples WHERE ts < to_timestamp_millis(1796032900000)";
    let got = f.sql_engine().sql(q).await.unwrap();
    assert_eq!(
        table_text(q, &got),
        table_text(q, &reference.sql(q).await.unwrap())
    );
    assert_eq!(f.nodes[0].metrics.sql_pushdowns.load(Relaxed), 1);
}

#[test]
fn sql_tickets_round_trip_and_bad_ones_are_refused() {
    let shards: BTreeSet<ShardKey> = [ShardKey::Host("h1".into())].into();
    let sql = "SELECT count(value) AS \"a0_c\" FROM samples";
    let back = wire::decode_ticket(&wire::encode_sql_ticket(sql, &shards)).unwrap();
    assert_eq!(back.sql.as_deref(), Some(sql));
    assert_eq!(back.shards, shards);
    assert!(back.promql.is_none() && back.rollups.is_none() && back.health.is_none());
    let long = "x".repeat(64 * 1024 + 1);
    let err = wire::decode_ticket(&wire::encode_sql_ticket(&long, &shards)).unwrap_err();
    assert!(err.contains("over the limit"), "{err}");
    let both = br#"{"v":1,"matchers":[],"min_ts":0,"max_ts":0,"shards":[],"sql":"SELECT 1","health":"events"}"#;
    assert!(
        wire::decode_ticket(both)
            .unwrap_err()
            .contains("not several")
    );
}

/// A peer runs a SQL ticket read-only, over the listed shards alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sql_ticket_reads_its_shards_alone_and_writes_nothing() {
    let f = Fixture::three().await;
    let b = &f.nodes[f.idx("b")];
    let shard = local_shard_keys(&b.storage).into_iter().next().unwrap();
    let want = f.fleet.iter().filter(|s| s.shard == shard).count() * N as usize;
    let mut client = FlightClient::new(
        tonic::transport::Channel::from_shared(format!("http://{}", b.flight))
            .unwrap()
            .connect()
            .await
            .unwrap(),
    );
    let shards: BTreeSet<ShardKey> = [shard].into();
    let ticket = wire::encode_sql_ticket("SELECT count(*) AS n FROM samples", &shards);
    let batches: Vec<RecordBatch> = client
        .do_get(Ticket::new(ticket))
        .await
        .unwrap()
        .map(|b| b.unwrap())
        .collect()
        .await;
    let n = batches[0]
        .column(0)
        .as_primitive::<arrow::datatypes::Int64Type>()
        .value(0);
    assert_eq!(n as usize, want);
    for sql in [
        "DROP TABLE samples",
        "INSERT INTO samples SELECT * FROM samples",
    ] {
        let ticket = wire::encode_sql_ticket(sql, &shards);
        let err = client.do_get(Ticket::new(ticket)).await.err();
        assert!(err.is_some(), "{sql} was run");
    }
}

/// A shard filter admits the series of the shards assigned, and with
/// `unknown_too` those of shards not in it, by the placement rule (rack,
/// else `Hostname`, else `hostname`).
#[test]
fn a_shard_filter_admits_series_by_their_shard() {
    let series = |labels: &[(&str, &str)]| {
        SeriesKey::new(
            "DCGM_FI_DEV_GPU_TEMP",
            labels.iter().map(|(n, v)| Label::new(*n, *v)).collect(),
        )
        .unwrap()
    };
    let set = |keys: &[ShardKey]| keys.iter().cloned().collect::<BTreeSet<ShardKey>>();
    let (r1, r2) = (ShardKey::Rack("r1".into()), ShardKey::Rack("r2".into()));
    let h9 = ShardKey::Host("h9".into());
    let in_r1 = series(&[("rack", "r1"), ("Hostname", "h1")]);
    let in_r2 = series(&[("rack", "r2"), ("Hostname", "h9")]);
    let in_r3 = series(&[("rack", "r3"), ("Hostname", "h9")]);
    let on_h9 = series(&[("hostname", "h9")]);
    let on_h8 = series(&[("Hostname", "h8"), ("rack", "")]);

    let only = ShardFilter::only(set(&[r1.clone(), h9.clone()]));
    let admitted = |f: &ShardFilter| [&in_r1, &in_r2, &in_r3, &on_h9, &on_h8].map(|k| f.admits(k));
    assert_eq!(admitted(&only), [true, false, false, true, false]);
    // Assigned r1; and every shard but r1, r2 and h9, which others read.
    let first_round = ShardFilter::new(
        Some(set(std::slice::from_ref(&r1))),
        Some(set(&[r1, r2, h9])),
    );
    assert_eq!(admitted(&first_round), [true, false, true, false, true]);
    let unknown_only = ShardFilter::new(None, Some(BTreeSet::new()));
    assert_eq!(admitted(&unknown_only), [true; 5]);
}

/// A node's gRPC service with `NodeStatus` alone, answering what the test
/// set; the other calls are refused.
struct StatusOnly(Arc<std::sync::Mutex<NodeStatusReply>>);

#[tonic::async_trait]
impl gpulse_proto::v1::ingest_server::Ingest for StatusOnly {
    type StreamStream =
        futures::stream::Empty<Result<gpulse_proto::v1::IngestReply, tonic::Status>>;

    async fn stream(
        &self,
        _: tonic::Request<tonic::Streaming<gpulse_proto::v1::AgentMessage>>,
    ) -> Result<tonic::Response<Self::StreamStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("status only"))
    }

    async fn owners(
        &self,
        _: tonic::Request<gpulse_proto::v1::OwnersRequest>,
    ) -> Result<tonic::Response<gpulse_proto::v1::OwnersReply>, tonic::Status> {
        Err(tonic::Status::unimplemented("status only"))
    }

    async fn node_status(
        &self,
        _: tonic::Request<gpulse_proto::v1::NodeStatusRequest>,
    ) -> Result<tonic::Response<NodeStatusReply>, tonic::Status> {
        Ok(tonic::Response::new(self.0.lock().unwrap().clone()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_planned_from_a_stale_view_is_planned_again_from_the_peers_status() {
    let f = Fixture::three().await;
    let held: Vec<BTreeSet<ShardKey>> = f
        .nodes
        .iter()
        .map(|n| local_shard_keys(&n.storage))
        .collect();
    let mut listeners = Vec::new();
    for _ in NODES {
        listeners.push(TcpListener::bind("127.0.0.1:0").await.unwrap());
    }
    let grpc: Vec<SocketAddr> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
    let flight: Vec<SocketAddr> = f.nodes.iter().map(|n| n.flight).collect();
    let map = ShardMap::parse(
        &map_text_grpc(&flight, &grpc, ""),
        Path::new("cluster.toml"),
    )
    .unwrap();
    // b and c answer status calls with what they hold.
    for (i, listener) in listeners.into_iter().enumerate().skip(1) {
        let reply = Arc::new(std::sync::Mutex::new(status(
            NODES[i],
            &held[i],
            map.hash(),
        )));
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(gpulse_proto::v1::ingest_server::IngestServer::new(
                    StatusOnly(reply),
                ))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
    }
    // Node a's view, as the poller left it: b had reported nothing yet, and
    // c had not answered.
    let state = Arc::new(ClusterState::new(map.clone(), "a"));
    for k in &held[0] {
        state.note_key(k.clone());
    }
    state.update_peer("b", Ok(status("b", &BTreeSet::new(), map.hash())));
    state.update_peer("c", Err("transport error: connection refused".into()));
    let metrics = f.nodes[0].metrics.clone();
    let reader = ClusterReader::new(
        state.clone(),
        f.nodes[0].storage.clone(),
        metrics.clone(),
        ReaderConfig::default(),
    );
    let (sql, prom) = (
        QueryEngine::with_cluster(
            f.nodes[0].storage.clone(),
            ResultLimits::default(),
            reader.clone(),
        ),
        PromEngine::with_cluster(reader, PromLimits::default()),
    );

    // Planned from that view, the read lacks b's and c's shards; their
    // status, asked alongside it, says so, and it is planned again.
    let generation = state.generation();
    let r = sql.sql(ROWS_SQL).await.unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(rows_of(&r), f.expected(|_| true));
    assert_eq!(metrics.selects_replanned.load(Relaxed), 1);
    assert!(state.generation() > generation);

    // The view holds now: one round, the same answer.
    let r = sql.sql(ROWS_SQL).await.unwrap();
    assert_eq!(rows_of(&r), f.expected(|_| true));
    let a = prom_range(&prom, "temp").await;
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    assert_eq!(rows_of_matrix(&a.value), f.expected(|s| s.metric == "temp"));
    assert_eq!(metrics.selects_replanned.load(Relaxed), 1);
}
