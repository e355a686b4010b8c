//! The agent's dual write in cluster mode (issue #8), over real gRPC on
//! loopback: real `ingest::serve` nodes, each on a real `storage::Storage` in
//! a temp dir, and `agent::run_with_metrics` with a simulated source.
//!
//! The ground truth is the agent's `record` file (every sample it produced,
//! written as it hands each poll to its owners); each owner's storage must
//! hold exactly that, no sample twice (the samples ingest accepted, summed
//! over a node's restarts, equal the record's count), and a node that owns
//! nothing of the host must hold nothing of it.
//!
//! Waits are for states (acks, backlogs, shippers ending), never for times;
//! each has a generous limit only so that a bug fails instead of hanging.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use agent::sim::{SimConfig, SimulatedSource};
use agent::{AgentConfig, AgentMetrics, AgentReport, OwnerMetrics};
use cluster::{ClusterState, ShardKey, ShardMap};
use ingest::{IngestConfig, IngestMetrics, IngestService};
use storage::{Matcher, Storage, StorageConfig};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// (series, timestamp) -> value bits. A series is its metric and its labels
/// other than the four ingest attaches, sorted, without empty values.
type Samples = BTreeMap<(String, i64), u64>;

fn series_name(metric: &str, mut labels: Vec<(String, String)>) -> String {
    labels.retain(|(k, v)| {
        !v.is_empty() && !matches!(k.as_str(), "Hostname" | "cluster" | "row" | "rack")
    });
    labels.sort();
    let mut s = metric.to_owned();
    for (k, v) in labels {
        s += &format!(";{k}={v}");
    }
    s
}

/// The agent's record: the header `labels,timestamp_ms,value`, then
/// `metric=NAME;label=value;...,timestamp_ms,value`.
/// Two polls may carry the same millisecond (the sampler catching up after
/// a stall); storage keeps the first sample of a series at a timestamp, and
/// so does this.
fn recorded(path: &Path) -> Samples {
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = Samples::new();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("labels,timestamp_ms,value"));
    for line in lines {
        let mut f = line.rsplitn(3, ',');
        let value: f64 = f.next().unwrap().parse().unwrap();
        let ts: i64 = f.next().unwrap().parse().unwrap();
        let mut labels = Vec::new();
        let mut metric = String::new();
        for kv in f.next().unwrap().split(';') {
            let (k, v) = kv.split_once('=').unwrap();
            if k == "metric" {
                metric = v.to_owned();
            } else {
                labels.push((k.to_owned(), v.to_owned()));
            }
        }
        out.entry((series_name(&metric, labels), ts))
            .or_insert(value.to_bits());
    }
    out
}

struct Running {
    storage: Arc<Storage>,
    cluster: Option<Arc<ClusterState>>,
    metrics: Arc<IngestMetrics>,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// One ingest node: its address and data dir stay across restarts.
struct Node {
    id: String,
    addr: SocketAddr,
    dir: PathBuf,
    /// `None`: a node without `--cluster`.
    map: Option<ShardMap>,
    running: Option<Running>,
    /// Samples accepted and streams opened by earlier runs.
    accepted_before: u64,
    streams_before: u64,
}

impl Node {
    fn start(&mut self, listener: TcpListener) {
        let storage = Arc::new(Storage::open(StorageConfig::new(&self.dir)).unwrap());
        let mut service = IngestService::new(storage.clone(), IngestConfig::default());
        let cluster = self
            .map
            .as_ref()
            .map(|map| Arc::new(ClusterState::new(map.clone(), &self.id)));
        if let Some(c) = &cluster {
            service = service.with_cluster(c.clone());
        }
        let metrics = service.metrics().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            ingest::serve(listener, service, async {
                let _ = stopped.await;
            })
            .await
            .unwrap();
        });
        self.running = Some(Running {
            storage,
            cluster,
            metrics,
            stop,
            task,
        });
    }

    /// Starts again on the same port and data dir.
    async fn restart(&mut self) {
        let listener = TcpListener::bind(self.addr).await.unwrap();
        self.start(listener);
    }

    /// Stops serving and closes the storage (its lock is free again).
    async fn stop(&mut self) {
        let r = self.running.take().expect("node is running");
        r.stop.send(()).unwrap();
        r.task.await.unwrap();
        // Stream tasks let go of the storage once they see the shutdown.
        wait_for("the node's streams to end", || {
            Arc::strong_count(&r.storage) == 1
        })
        .await;
        self.accepted_before += r.metrics.samples_accepted.load(Relaxed);
        self.streams_before += r.metrics.streams_opened.load(Relaxed);
    }

    fn running(&self) -> &Running {
        self.running.as_ref().expect("node is running")
    }

    fn cluster(&self) -> &ClusterState {
        self.running().cluster.as_ref().expect("a cluster node")
    }

    fn accepted(&self) -> u64 {
        self.accepted_before + self.running().metrics.samples_accepted.load(Relaxed)
    }

    fn streams(&self) -> u64 {
        self.streams_before + self.running().metrics.streams_opened.load(Relaxed)
    }

    /// What the node stores for `host`.
    fn samples(&self, host: &str) -> Samples {
        let mut out = Samples::new();
        let storage = &self.running().storage;
        for s in storage.select(&[Matcher::equal("Hostname", host)], i64::MIN, i64::MAX) {
            let labels = s
                .key
                .labels()
                .iter()
                .map(|l| (l.name.to_string(), l.value.to_string()))
                .collect();
            let name = series_name(s.key.metric(), labels);
            let (mut ts, mut values) = (Vec::new(), Vec::new());
            s.read_into(i64::MIN, i64::MAX, &mut ts, &mut values)
                .unwrap();
            for (t, v) in ts.into_iter().zip(values) {
                out.insert((name.clone(), t), v.to_bits());
            }
        }
        out
    }

    fn seed(&self) -> String {
        format!("grpc://{}", self.addr)
    }
}

/// Cluster nodes on loopback, all running. `epochs` is the cluster file's
/// `[[epoch]]` part (empty: every node, always).
async fn cluster(dir: &Path, ids: &[&str], epochs: &str) -> Vec<Node> {
    let mut listeners = Vec::new();
    let mut text = String::from("replication_factor = 2\n");
    for id in ids {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        text += &format!(
            "\n[[node]]\nid = \"{id}\"\ngrpc = \"127.0.0.1:{port}\"\n\
             http = \"127.0.0.2:{port}\"\nflight = \"127.0.0.3:{port}\"\n"
        );
        listeners.push(l);
    }
    text += epochs;
    let map = ShardMap::parse(&text, Path::new("cluster.toml")).unwrap();
    let mut nodes = Vec::new();
    for (id, l) in ids.iter().zip(listeners) {
        let mut n = Node {
            id: (*id).to_owned(),
            addr: l.local_addr().unwrap(),
            dir: dir.join(format!("node-{id}")),
            map: Some(map.clone()),
            running: None,
            accepted_before: 0,
            streams_before: 0,
        };
        n.start(l);
        nodes.push(n);
    }
    nodes
}

/// Node ids owning `rack` at `at_ms`, by the nodes' own shard map.
fn owners(nodes: &[Node], rack: &str, host: &str, at_ms: i64) -> Vec<String> {
    let map = nodes[0].map.as_ref().unwrap();
    map.owners_at(&ShardKey::of(rack, host), at_ms)
        .into_iter()
        .map(|i| map.nodes()[i].id.clone())
        .collect()
}

fn node<'a>(nodes: &'a mut [Node], id: &str) -> &'a mut Node {
    nodes.iter_mut().find(|n| n.id == id).unwrap()
}

fn agent_config(dir: &Path, seeds: &str, host: &str, rack: &str) -> AgentConfig {
    let mut c = AgentConfig::new(seeds);
    c.sharded = true;
    c.agent_id = format!("agent-{host}");
    c.host = host.to_owned();
    c.topology.rack = rack.to_owned();
    c.interval = Duration::from_millis(10);
    c.reconnect_min = Duration::from_millis(20);
    c.reconnect_max = Duration::from_millis(200);
    c.drain_timeout = Duration::from_secs(2);
    // Small: a down owner's batches overflow to its spool.
    c.buffer.memory_samples = 300;
    c.buffer.spool_dir = Some(dir.join("spool"));
    c.record = Some(dir.join("record.csv"));
    c
}

type AgentTask = JoinHandle<Result<AgentReport, agent::AgentError>>;

/// Runs an agent on 2 simulated GPUs; it stops when `shutdown` fires (or
/// after `max_polls`, all delivered).
fn spawn_agent(
    config: AgentConfig,
    metrics: Arc<AgentMetrics>,
    shutdown: Option<oneshot::Receiver<()>>,
) -> AgentTask {
    let source = Box::new(SimulatedSource::new(SimConfig::new(7, 2)));
    tokio::spawn(agent::run_with_metrics(
        config,
        source,
        metrics,
        async move {
            match shutdown {
                Some(rx) => {
                    let _ = rx.await;
                }
                None => std::future::pending().await,
            }
        },
    ))
}

fn owner(metrics: &AgentMetrics, id: &str) -> Option<Arc<OwnerMetrics>> {
    metrics
        .owners()
        .into_iter()
        .find(|(o, _)| o == id)
        .map(|(_, m)| m)
}

fn acked(metrics: &AgentMetrics, id: &str) -> u64 {
    owner(metrics, id).map_or(0, |o| o.shipper.batches_acked.load(Relaxed))
}

fn backlog(metrics: &AgentMetrics, id: &str) -> u64 {
    owner(metrics, id).map_or(0, |o| o.backlog())
}

async fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "gave up waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// Every owner holds exactly the record; the other nodes nothing.
fn assert_replicated(nodes: &[Node], owner_ids: &[String], host: &str, expected: &Samples) {
    for n in nodes {
        if owner_ids.contains(&n.id) {
            let got = n.samples(host);
            assert_eq!(got.len(), expected.len(), "node {}: sample count", n.id);
            assert!(
                got == *expected,
                "node {} holds other samples than the record",
                n.id
            );
            assert_eq!(
                n.accepted(),
                expected.len() as u64,
                "node {}: every sample accepted exactly once",
                n.id
            );
        } else {
            assert!(n.samples(host).is_empty(), "non-owner {} holds data", n.id);
            assert_eq!(
                n.streams(),
                0,
                "the agent opened a stream to non-owner {}",
                n.id
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_owner_gets_every_sample_once_while_one_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(dir.path(), &["a", "b", "c"], "").await;
    let (host, rack) = ("gpu-host-1", "rack-7");
    let owner_ids = owners(&nodes, rack, host, now_ms());
    let down = owner_ids[1].clone();
    let seeds: Vec<String> = nodes.iter().map(Node::seed).collect();
    let mut config = agent_config(dir.path(), &seeds.join(","), host, rack);
    config.max_polls = Some(150);
    let metrics = Arc::new(AgentMetrics::default());
    let agent = spawn_agent(config, metrics.clone(), None);

    wait_for("the second owner to ack 5 batches", || {
        acked(&metrics, &down) >= 5
    })
    .await;
    node(&mut nodes, &down).stop().await;
    wait_for("20 batches held for the stopped owner", || {
        backlog(&metrics, &down) >= 20
    })
    .await;
    let held = owner(&metrics, &down).unwrap();
    assert!(
        held.shipper.spool_batches.load(Relaxed) > 0,
        "past the memory buffer, a down owner's batches go to its spool"
    );
    // The live owner hears of the backlog (replica lag) on its stream.
    let up = node(&mut nodes, &owner_ids[0]);
    wait_for("the live owner to learn the backlog", || {
        up.cluster().backlog_by_node().get(&down).copied() >= Some(20)
    })
    .await;
    node(&mut nodes, &down).restart().await;

    let report = agent.await.unwrap().unwrap();
    assert_eq!(report.polls, 150);
    assert_eq!(report.polls_dropped, 0);
    assert_eq!(report.shipper.batches_unacked, 0);
    assert_eq!(report.shipper.samples_dropped, 0);
    let expected = recorded(&dir.path().join("record.csv"));
    let polls: std::collections::BTreeSet<i64> = expected.keys().map(|(_, t)| *t).collect();
    assert!(
        polls.len() <= 150 && polls.len() > 140,
        "{} timestamps",
        polls.len()
    );
    assert_replicated(&nodes, &owner_ids, host, &expected);
    assert!(
        owner(&metrics, &down)
            .unwrap()
            .shipper
            .reconnects
            .load(Relaxed)
            > 0
    );

    // One spool per owner, each naming its node.
    for n in &nodes {
        let addr = dir.path().join("spool").join(&n.id).join("owner.addr");
        if owner_ids.contains(&n.id) {
            assert_eq!(
                std::fs::read_to_string(&addr).unwrap(),
                format!("http://{}\n", n.addr)
            );
        } else {
            assert!(!addr.exists(), "{}", addr.display());
        }
    }
    // /metrics: the shipper metrics per owner.
    let text = metrics.render();
    for id in &owner_ids {
        let line = format!("gpulse_agent_owner_current{{owner=\"{id}\"}} 1");
        assert!(text.contains(&line), "{line} not in\n{text}");
    }
    assert!(
        !text.contains("\ngpulse_agent_batches_acked_total "),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_resumes_each_owners_spool() {
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = cluster(dir.path(), &["a", "b", "c"], "").await;
    let (host, rack) = ("gpu-host-2", "rack-3");
    let owner_ids = owners(&nodes, rack, host, now_ms());
    let down = owner_ids[0].clone();
    let seeds: Vec<String> = nodes.iter().map(Node::seed).collect();
    let config = agent_config(dir.path(), &seeds.join(","), host, rack);

    // Run 1 stops while an owner is down: its batches stay in its spool.
    let metrics = Arc::new(AgentMetrics::default());
    let (shutdown, shutdown_rx) = oneshot::channel();
    let agent = spawn_agent(config.clone(), metrics.clone(), Some(shutdown_rx));
    wait_for("the first owner to ack 3 batches", || {
        acked(&metrics, &down) >= 3
    })
    .await;
    node(&mut nodes, &down).stop().await;
    wait_for("10 batches held for the stopped owner", || {
        backlog(&metrics, &down) >= 10
    })
    .await;
    shutdown.send(()).unwrap();
    let first = agent.await.unwrap().unwrap();
    assert!(first.shipper.batches_unacked >= 10, "{first:?}");
    let spooled = std::fs::read_dir(dir.path().join("spool").join(&down))
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .ends_with(".spool")
        })
        .count();
    assert!(spooled > 0, "the down owner's batches are in its spool");
    node(&mut nodes, &down).restart().await;

    // Run 2 sends them, and its own polls, to each owner.
    let mut config = config;
    config.max_polls = Some(30);
    let metrics = Arc::new(AgentMetrics::default());
    let second = spawn_agent(config, metrics.clone(), None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.shipper.batches_unacked, 0);
    let expected = recorded(&dir.path().join("record.csv"));
    let polls: std::collections::BTreeSet<i64> = expected.keys().map(|(_, t)| *t).collect();
    assert!(polls.len() as u64 <= first.polls + 30 && polls.len() as u64 > first.polls);
    assert_replicated(&nodes, &owner_ids, host, &expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn new_owners_take_over_at_an_epoch_and_a_former_owner_drains() {
    let dir = tempfile::tempdir().unwrap();
    // Node d joins in an epoch that starts in 3 s; the agent's first answer
    // says to ask again then.
    let change = now_ms() + 3000;
    let start = chrono::DateTime::from_timestamp_millis(change)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let epochs = format!(
        "\n[[epoch]]\nstart = \"2020-01-01T00:00:00Z\"\nnodes = [\"a\", \"b\", \"c\"]\n\
         [[epoch]]\nstart = \"{start}\"\nnodes = [\"a\", \"b\", \"c\", \"d\"]\n"
    );
    let mut nodes = cluster(dir.path(), &["a", "b", "c", "d"], &epochs).await;
    let host = "gpu-host-3";
    // A rack that d takes from one of its owners.
    let rack = (0..1000)
        .map(|i| format!("rack-{i}"))
        .find(|r| owners(&nodes, r, host, change).contains(&"d".to_owned()))
        .unwrap();
    let before = owners(&nodes, &rack, host, change - 1);
    let after = owners(&nodes, &rack, host, change);
    let stays = before.iter().find(|o| after.contains(o)).unwrap().clone();
    let leaves = before.iter().find(|o| !after.contains(o)).unwrap().clone();
    let never = ["a", "b", "c"]
        .into_iter()
        .find(|n| !before.iter().any(|o| o == n))
        .unwrap();
    assert!(!after.iter().any(|o| o == never));

    let seeds: Vec<String> = nodes.iter().map(Node::seed).collect();
    let mut config = agent_config(dir.path(), &seeds.join(","), host, &rack);
    config.drain_timeout = Duration::from_secs(10);
    let metrics = Arc::new(AgentMetrics::default());
    let (shutdown, shutdown_rx) = oneshot::channel();
    let agent = spawn_agent(config, metrics.clone(), Some(shutdown_rx));

    // The leaving owner goes down before the change, so that it holds a
    // backlog when it stops being an owner.
    wait_for("the leaving owner to ack 3 batches", || {
        acked(&metrics, &leaves) >= 3
    })
    .await;
    let stopped_at = now_ms();
    node(&mut nodes, &leaves).stop().await;
    wait_for("the new owner to ack 10 batches", || {
        acked(&metrics, "d") >= 10
    })
    .await;
    let gone = owner(&metrics, &leaves).unwrap();
    assert_eq!(gone.current.load(Relaxed), 0);
    node(&mut nodes, &leaves).restart().await;
    wait_for("the former owner's shipper to deliver and stop", || {
        gone.shipping.load(Relaxed) == 0
    })
    .await;
    shutdown.send(()).unwrap();
    let report = agent.await.unwrap().unwrap();
    assert_eq!(report.shipper.batches_unacked, 0);
    assert_eq!(report.shipper.samples_dropped, 0);

    let expected = recorded(&dir.path().join("record.csv"));
    let stayed = node(&mut nodes, &stays).samples(host);
    assert!(
        stayed == expected,
        "the owner of both epochs holds everything"
    );
    let old = node(&mut nodes, &leaves).samples(host);
    let new = node(&mut nodes, "d").samples(host);
    assert!(!old.is_empty() && !new.is_empty());
    // The polls before the switch went to the old owner, those after to d.
    let old_last = old.keys().map(|(_, t)| *t).max().unwrap();
    let new_first = new.keys().map(|(_, t)| *t).min().unwrap();
    assert!(old_last < new_first, "{old_last} >= {new_first}");
    let mut union = old.clone();
    union.extend(new.clone());
    assert_eq!(union.len(), old.len() + new.len());
    assert!(
        union == expected,
        "old and new owner together hold the record"
    );
    assert!(
        old_last > stopped_at,
        "what was held for the former owner while it was down was delivered after it came back"
    );
    for id in [&stays, &leaves, &"d".to_owned()] {
        let n = node(&mut nodes, id);
        assert_eq!(n.accepted(), n.samples(host).len() as u64, "node {id}");
    }
    let n = node(&mut nodes, never);
    assert!(n.samples(host).is_empty());
    assert_eq!(n.streams(), 0);
    assert_eq!(owner(&metrics, "d").unwrap().current.load(Relaxed), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seeds_are_tried_in_turn() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = cluster(dir.path(), &["a", "b", "c"], "").await;
    // A port nothing listens on, and a node without --cluster.
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let plain_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut plain = Node {
        id: "plain".into(),
        addr: plain_listener.local_addr().unwrap(),
        dir: dir.path().join("node-plain"),
        map: None,
        running: None,
        accepted_before: 0,
        streams_before: 0,
    };
    plain.start(plain_listener);
    let (host, rack) = ("gpu-host-4", "");
    let owner_ids = owners(&nodes, rack, host, now_ms());
    let seeds = format!("grpc://{dead},{},{}", plain.seed(), nodes[2].seed());
    let mut config = agent_config(dir.path(), &seeds, host, rack);
    config.max_polls = Some(20);
    let metrics = Arc::new(AgentMetrics::default());
    let report = spawn_agent(config, metrics.clone(), None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(report.shipper.batches_unacked, 0);
    assert!(metrics.owner_lookup_errors.load(Relaxed) >= 2);
    let expected = recorded(&dir.path().join("record.csv"));
    assert_replicated(&nodes, &owner_ids, host, &expected);
    assert!(plain.samples(host).is_empty());
    assert_eq!(plain.streams(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_delivers_what_it_spooled_for_a_former_owner() {
    let dir = tempfile::tempdir().unwrap();
    let base = "\n[[epoch]]\nstart = \"2020-01-01T00:00:00Z\"\nnodes = [\"a\", \"b\", \"c\"]\n";
    let mut nodes = cluster(dir.path(), &["a", "b", "c", "d"], base).await;
    let host = "gpu-host-5";
    // A rack that d, once a member, takes from one of its owners: d is among
    // the two highest rendezvous scores of the four.
    let rack = (0..1000)
        .map(|i| format!("rack-{i}"))
        .find(|r| {
            let key = ShardKey::of(r, host);
            let mut scores: Vec<(u64, &str)> = ["a", "b", "c", "d"]
                .into_iter()
                .map(|n| (cluster::rendezvous_score(n, &key), n))
                .collect();
            scores.sort_unstable_by(|x, y| y.cmp(x));
            scores[..2].iter().any(|&(_, n)| n == "d")
        })
        .unwrap();
    let before = owners(&nodes, &rack, host, now_ms());
    let seeds: Vec<String> = nodes.iter().map(Node::seed).collect();
    let config = agent_config(dir.path(), &seeds.join(","), host, &rack);

    // Run 1 stops while an owner is down: its batches stay in its spool.
    let leaves = before[1].clone();
    let metrics = Arc::new(AgentMetrics::default());
    let (shutdown, shutdown_rx) = oneshot::channel();
    let agent = spawn_agent(config.clone(), metrics.clone(), Some(shutdown_rx));
    wait_for("the second owner to ack 3 batches", || {
        acked(&metrics, &leaves) >= 3
    })
    .await;
    node(&mut nodes, &leaves).stop().await;
    wait_for("10 batches held for the stopped owner", || {
        backlog(&metrics, &leaves) >= 10
    })
    .await;
    shutdown.send(()).unwrap();
    let first = agent.await.unwrap().unwrap();
    let spooled = backlog(&metrics, &leaves);
    assert!(
        spooled >= 10 && first.shipper.batches_unacked >= spooled,
        "{first:?}"
    );
    let run1 = recorded(&dir.path().join("record.csv"));

    // Node d joins: from now on it owns the rack in place of `leaves`.
    let joined = format!(
        "{base}[[epoch]]\nstart = \"{}\"\nnodes = [\"a\", \"b\", \"c\", \"d\"]\n",
        chrono::DateTime::from_timestamp_millis(now_ms())
            .unwrap()
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
    );
    let text = std::iter::once("replication_factor = 2\n".to_owned())
        .chain(nodes.iter().map(|n| {
            let port = n.addr.port();
            format!(
                "\n[[node]]\nid = \"{}\"\ngrpc = \"127.0.0.1:{port}\"\n\
                 http = \"127.0.0.2:{port}\"\nflight = \"127.0.0.3:{port}\"\n",
                n.id
            )
        }))
        .collect::<String>()
        + &joined;
    let map2 = ShardMap::parse(&text, Path::new("cluster.toml")).unwrap();
    for n in &mut nodes {
        n.map = Some(map2.clone());
        if n.running.is_some() {
            n.cluster().reload(map2.clone()).unwrap();
        }
    }
    node(&mut nodes, &leaves).restart().await;
    let after = owners(&nodes, &rack, host, now_ms());
    assert!(after.contains(&"d".to_owned()) && !after.contains(&leaves));

    // Run 2: new polls go to the new owners; the spool of `leaves` is
    // delivered to it all the same, and its shipper then stops.
    let mut config = config;
    config.max_polls = Some(30);
    let metrics = Arc::new(AgentMetrics::default());
    let second = spawn_agent(config, metrics.clone(), None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(second.shipper.batches_unacked, 0);
    let all = recorded(&dir.path().join("record.csv"));
    let run2: Samples = all
        .iter()
        .filter(|(k, _)| !run1.contains_key(k))
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    assert_eq!(run2.len() + run1.len(), all.len());
    let stays = before.iter().find(|o| after.contains(o)).unwrap().clone();
    assert!(node(&mut nodes, &stays).samples(host) == all);
    assert!(node(&mut nodes, &leaves).samples(host) == run1);
    assert!(node(&mut nodes, "d").samples(host) == run2);
    for n in &nodes {
        assert_eq!(n.accepted(), n.samples(host).len() as u64, "node {}", n.id);
    }
    let former = owner(&metrics, &leaves).unwrap();
    assert_eq!(former.current.load(Relaxed), 0);
    assert_eq!(former.shipping.load(Relaxed), 0);
    // Every spooled batch, and perhaps some acked ones again: a spool file
    // comes back whole after a restart, and ingest acks those as duplicates.
    let acked = former.shipper.batches_acked.load(Relaxed);
    let duplicate = former.shipper.batches_duplicate.load(Relaxed);
    assert!(
        acked >= spooled && acked - spooled <= duplicate,
        "{acked} {spooled} {duplicate}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_sharded_the_agent_streams_to_its_one_node_as_before() {
    let dir = tempfile::tempdir().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut single = Node {
        id: "single".into(),
        addr: listener.local_addr().unwrap(),
        dir: dir.path().join("node-single"),
        map: None,
        running: None,
        accepted_before: 0,
        streams_before: 0,
    };
    single.start(listener);
    let host = "gpu-host-6";
    let mut config = agent_config(dir.path(), &single.seed(), host, "rack-1");
    config.sharded = false;
    config.max_polls = Some(100);
    let metrics = Arc::new(AgentMetrics::default());
    let agent = spawn_agent(config, metrics.clone(), None);
    wait_for("5 acked batches", || {
        metrics.batches_acked.load(Relaxed) >= 5
    })
    .await;
    single.stop().await;
    wait_for("10 batches held", || {
        metrics.buffer_batches.load(Relaxed) + metrics.spool_batches.load(Relaxed) >= 10
    })
    .await;
    single.restart().await;
    let report = agent.await.unwrap().unwrap();
    assert_eq!(report.shipper.batches_unacked, 0);
    let expected = recorded(&dir.path().join("record.csv"));
    assert!(single.samples(host) == expected);
    assert_eq!(single.accepted(), expected.len() as u64);
    // One spool, in the spool directory itself; metrics without owners.
    let spool = dir.path().join("spool");
    assert!(spool.join("agent.state").exists());
    let subdirs = std::fs::read_dir(&spool)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().is_dir())
        .count();
    assert_eq!(subdirs, 0);
    assert!(metrics.owners().is_empty());
    let text = metrics.render();
    assert!(text.contains(&format!(
        "\ngpulse_agent_batches_acked_total {}\n",
        report.shipper.batches_acked
    )));
    assert!(!text.contains("owner"), "{text}");
}
