//! Sharded cluster (issue #8): real `gpulse serve --cluster` nodes on
//! 127.0.0.1, each with its own data directory and ports.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpulse_proto::prometheus::{Label, Sample, TimeSeries, WriteRequest};
use prost::Message;
use serde_json::Value;

use super::remote::post;
use super::support::{Node, listen_ports};

pub(crate) struct Cluster {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) file: PathBuf,
    pub(crate) ids: Vec<String>,
    pub(crate) nodes: Vec<Option<Node>>,
}

impl Cluster {
    /// Writes a cluster file for `n` nodes (ids a, b, c, ...) and starts them.
    pub(crate) fn start(n: usize, rf: usize) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let ports = listen_ports(3 * n);
        let ids: Vec<String> = (0..n)
            .map(|i| ((b'a' + i as u8) as char).to_string())
            .collect();
        let mut text = format!("replication_factor = {rf}\n");
        for (i, id) in ids.iter().enumerate() {
            let p = &ports[3 * i..3 * i + 3];
            text += &format!(
                "\n[[node]]\nid = \"{id}\"\ngrpc = \"127.0.0.1:{}\"\nhttp = \"127.0.0.1:{}\"\nflight = \"127.0.0.1:{}\"\n",
                p[0], p[1], p[2]
            );
        }
        let file = dir.path().join("cluster.toml");
        std::fs::write(&file, text).unwrap();
        let mut c = Cluster {
            dir,
            file,
            ids,
            nodes: Vec::new(),
        };
        for i in 0..n {
            let node = c.spawn(i);
            c.nodes.push(Some(node));
        }
        c.wait_converged();
        c
    }

    /// Waits until every running node has heard from every other running
    /// node: until then a node flags its answers partial, as it cannot know
    /// which shards a peer it has not heard from holds.
    pub(crate) fn wait_converged(&self) {
        for _ in 0..100 {
            let partial = self
                .nodes
                .iter()
                .flatten()
                .any(|n| sql_partial(n, "SELECT count(*) FROM samples").0.is_some());
            if !partial {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!("the nodes did not hear from each other within 10 s");
    }

    fn spawn(&self, i: usize) -> Node {
        let data = self.dir.path().join(&self.ids[i]);
        let file = self.file.to_str().unwrap();
        Node::start_with_args(&data, &["--cluster", file, "--node-id", &self.ids[i]])
    }

    pub(crate) fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("node is running")
    }

    pub(crate) fn kill(&mut self, i: usize) {
        self.nodes[i].take().expect("node is running").kill9();
    }

    pub(crate) fn restart(&mut self, i: usize) {
        assert!(self.nodes[i].is_none(), "node {i} is running");
        self.nodes[i] = Some(self.spawn(i));
        self.wait_converged();
    }

    /// `gpulse cluster status --json`, by node id.
    pub(crate) fn status(&self) -> BTreeMap<String, Value> {
        let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
            .args([
                "cluster",
                "status",
                "--interval",
                "200ms",
                "--json",
                "--cluster",
            ])
            .arg(&self.file)
            .output()
            .expect("run gpulse cluster status");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
        lines
            .into_iter()
            .map(|l| (l["id"].as_str().unwrap().to_owned(), l))
            .collect()
    }

    /// SIGHUP: the node re-reads the cluster file.
    pub(crate) fn reload(&self, i: usize) {
        self.node(i).signal("HUP");
    }

    /// Waits until every running node runs with the file as it is now.
    pub(crate) fn wait_same_file(&self) {
        for _ in 0..100 {
            let status = self.status();
            if status
                .values()
                .all(|l| l["up"] == false || l["same_file"] == true)
            {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        panic!(
            "the nodes did not reload the cluster file: {:?}",
            self.status()
        );
    }

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// 8 racks of 4 hosts, 2 series a host, `n` samples each from `from`, 10 s
/// apart in 2023.
pub(crate) fn write_request(from: i64, n: i64) -> WriteRequest {
    request(1_700_000_000_000 + from * 10_000, 10_000, from, n)
}

/// As [`write_request`], `n` samples 1 s apart from `start_ms`.
fn write_request_at(start_ms: i64, n: i64) -> WriteRequest {
    request(start_ms, 1_000, 0, n)
}

fn request(start_ms: i64, step_ms: i64, from: i64, n: i64) -> WriteRequest {
    let mut timeseries = Vec::new();
    for rack in 0..8 {
        for h in 0..4 {
            let host = format!("r{rack}-h{h}");
            for metric in ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"] {
                let labels = [
                    ("__name__", metric.to_owned()),
                    ("Hostname", host.clone()),
                    ("gpu", "0".to_owned()),
                    ("rack", format!("rack-{rack}")),
                ]
                .into_iter()
                .map(|(name, value)| Label {
                    name: name.into(),
                    value,
                })
                .collect();
                let samples = (0..n)
                    .map(|i| Sample {
                        timestamp: start_ms + i * step_ms,
                        value: (rack * 100 + h * 10) as f64 + (from + i) as f64 * 0.5,
                    })
                    .collect();
                timeseries.push(TimeSeries {
                    labels,
                    samples,
                    ..TimeSeries::default()
                });
            }
        }
    }
    WriteRequest {
        timeseries,
        ..WriteRequest::default()
    }
}

/// What a request holds per rack: (samples, sum of values).
fn per_rack(w: &WriteRequest) -> BTreeMap<String, (u64, f64)> {
    let mut out: BTreeMap<String, (u64, f64)> = BTreeMap::new();
    for ts in &w.timeseries {
        let rack = ts.labels.iter().find(|l| l.name == "rack").unwrap();
        let e = out.entry(rack.value.clone()).or_default();
        e.0 += ts.samples.len() as u64;
        e.1 += ts.samples.iter().map(|s| s.value).sum::<f64>();
    }
    out
}

/// Per rack, the nodes holding it (from `cluster status`).
fn holders(c: &Cluster) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (id, line) in c.status() {
        for r in line["held_racks"].as_array().unwrap() {
            out.entry(r.as_str().unwrap().to_owned())
                .or_default()
                .push(id.clone());
        }
    }
    out
}

#[test]
fn remote_write_reaches_every_owner_and_a_down_owner_gets_it_on_retry() {
    let mut c = Cluster::start(3, 2);
    let first = write_request(0, 30);
    let (status, _, body) = post(c.node(0), "/api/v1/write", &first.encode_to_vec(), false);
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));

    // Every rack is held by exactly two nodes, each with all its samples.
    let want = per_rack(&first);
    let held = holders(&c);
    assert_eq!(
        held.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (rack, nodes) in &held {
        assert_eq!(nodes.len(), 2, "{rack}: {nodes:?}");
    }

    // One node down: a write that touches its racks is stored on the
    // reachable owners and answered 503, for the sender to retry.
    c.kill(1);
    let second = write_request(30, 30);
    let (status, _, body) = post(c.node(0), "/api/v1/write", &second.encode_to_vec(), false);
    let body = String::from_utf8_lossy(&body);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not on b"), "{body}");
    let status = c.status();
    assert_eq!(status["b"]["up"], false);
    assert_eq!(status["a"]["up"], true);

    // Back up: the retry completes, and nothing is stored twice.
    c.restart(1);
    let (status, _, body) = post(c.node(2), "/api/v1/write", &second.encode_to_vec(), false);
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
    let (status, _, _) = post(c.node(0), "/api/v1/write", &second.encode_to_vec(), false);
    assert_eq!(status, 204, "a second retry changes nothing");

    let mut total = per_rack(&first);
    for (rack, (n, sum)) in per_rack(&second) {
        let e = total.get_mut(&rack).unwrap();
        e.0 += n;
        e.1 += sum;
    }
    for (rack, nodes) in holders(&c) {
        let (n, sum) = total[&rack];
        for id in nodes {
            let i = c.ids.iter().position(|x| *x == id).unwrap();
            let rows = c.node(i).sql(&format!(
                "SELECT count(*), sum(value) FROM samples WHERE rack = '{rack}'"
            ));
            assert_eq!(rows[0][0].as_u64(), Some(n), "{rack} on {id}");
            let got = rows[0][1].as_f64().unwrap();
            assert!(
                (got - sum).abs() < 1e-6 * sum.abs(),
                "{rack} on {id}: {got} vs {sum}"
            );
        }
    }
}

/// A `gpulse agent --sharded` for one simulated host of one GPU.
struct Agent {
    child: std::process::Child,
    record: PathBuf,
    host: String,
    rack: String,
}

fn start_agent(c: &Cluster, rack: usize, h: usize, polls: u32) -> Agent {
    let host = format!("r{rack}-h{h}");
    let dir = c.path().join(format!("agent-{host}"));
    std::fs::create_dir_all(&dir).unwrap();
    let record = dir.join("produced.csv");
    let seeds: Vec<String> = (0..c.ids.len())
        .map(|i| c.node(i).grpc_url.clone())
        .collect();
    let child = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args(["agent", "--simulate", "--gpus", "1", "--sharded"])
        .args(["--seed", &(rack * 10 + h).to_string()])
        .args(["--host", &host, "--agent-id", &host, "--cluster", "fleet"])
        .args([
            "--row",
            &format!("row-{}", rack / 4),
            "--rack",
            &format!("rack-{rack}"),
        ])
        .args(["--ingest", &seeds.join(",")])
        .args(["--interval", "250ms", "--polls", &polls.to_string()])
        .args(["--metrics-listen", "off", "--drain-timeout", "20s"])
        .arg("--spool-dir")
        .arg(dir.join("spool"))
        .arg("--record")
        .arg(&record)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join("agent.log")).unwrap())
        .spawn()
        .expect("spawn gpulse agent");
    Agent {
        child,
        record,
        host,
        rack: format!("rack-{rack}"),
    }
}

/// One produced sample: (host, metric, gpu, ts) -> value bits.
type Samples = BTreeMap<(String, String, String, i64), u64>;

/// What the agents produced (their `--record` files), with each host's rack.
fn produced(agents: &[Agent]) -> (Samples, BTreeMap<String, String>) {
    let mut out = Samples::new();
    let mut racks = BTreeMap::new();
    for a in agents {
        racks.insert(a.host.clone(), a.rack.clone());
        // The first line is the header `labels,timestamp_ms,value`.
        for line in std::fs::read_to_string(&a.record).unwrap().lines().skip(1) {
            let mut f = line.rsplitn(3, ',');
            let value: f64 = f.next().unwrap().parse().unwrap();
            let ts: i64 = f.next().unwrap().parse().unwrap();
            let labels: BTreeMap<&str, &str> = f
                .next()
                .unwrap()
                .split(';')
                .map(|kv| kv.split_once('=').unwrap())
                .collect();
            let key = (
                a.host.clone(),
                labels["metric"].to_owned(),
                labels["gpu"].to_owned(),
                ts,
            );
            assert!(
                out.insert(key, value.to_bits()).is_none(),
                "produced twice: {line}"
            );
        }
    }
    (out, racks)
}

/// Every sample a node answers for the whole cluster, through SQL.
fn sql_samples(node: &Node) -> Samples {
    use arrow::array::AsArray;
    use arrow::datatypes::{Float64Type, TimestampMillisecondType};
    let mut got = Samples::new();
    // The agents' samples; not the nodes' own health series.
    for b in node.sql_arrow(
        "SELECT host, metric, gpu, ts, value FROM samples WHERE metric NOT LIKE 'gpulse_health%'",
    ) {
        let (h, m, g) = (
            b.column(0).as_string::<i32>(),
            b.column(1).as_string::<i32>(),
            b.column(2).as_string::<i32>(),
        );
        let ts = b.column(3).as_primitive::<TimestampMillisecondType>();
        let v = b.column(4).as_primitive::<Float64Type>();
        for r in 0..b.num_rows() {
            let key = (
                h.value(r).to_owned(),
                m.value(r).to_owned(),
                g.value(r).to_owned(),
                ts.value(r),
            );
            let prev = got.insert(key.clone(), v.value(r).to_bits());
            assert!(prev.is_none(), "{key:?} answered twice");
        }
    }
    got
}

/// A Prometheus API GET; returns the JSON answer.
fn prom_get(node: &Node, path: &str, params: &[(&str, &str)]) -> Value {
    let mut req = ureq::get(&format!("{}{path}", node.http_url));
    for (k, v) in params {
        req = req.query(*k, *v);
    }
    let mut resp = req.call().expect("Prometheus API request");
    serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap()
}

/// `sum by (Hostname) (count_over_time(METRIC[1h]))` at `at_ms`, by host,
/// and the answer's warnings.
fn prom_counts(node: &Node, metric: &str, at_ms: i64) -> (BTreeMap<String, u64>, Vec<Value>) {
    let v = prom_get(
        node,
        "/api/v1/query",
        &[
            (
                "query",
                &format!("sum by (Hostname) (count_over_time({metric}[1h]))"),
            ),
            ("time", &format!("{:.3}", at_ms as f64 / 1000.0)),
        ],
    );
    assert_eq!(v["status"], "success", "{v}");
    let counts = v["data"]["result"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["metric"]["Hostname"].as_str().unwrap().to_owned(),
                r["value"][1].as_str().unwrap().parse::<f64>().unwrap() as u64,
            )
        })
        .collect();
    let warnings = v["warnings"].as_array().cloned().unwrap_or_default();
    (counts, warnings)
}

#[test]
fn agents_stream_through_a_node_kill_and_every_node_answers_every_sample_once() {
    let mut c = Cluster::start(3, 2);
    // 32 hosts in 8 racks, 4 polls a second for 40 s.
    let mut agents = Vec::new();
    for rack in 0..8 {
        for h in 0..4 {
            agents.push(start_agent(&c, rack, h, 160));
        }
    }
    std::thread::sleep(std::time::Duration::from_secs(5));
    c.kill(1);
    std::thread::sleep(std::time::Duration::from_secs(30));
    c.restart(1);
    // The agents stop by themselves after their 160 polls, once every owner
    // has acked them (the restarted one included).
    for a in &mut agents {
        let status = a.child.wait().unwrap();
        assert!(
            status.success(),
            "agent {} failed; see its agent.log",
            a.host
        );
    }
    let (want, racks) = produced(&agents);
    assert!(
        want.len() > 32 * 150 * 40,
        "only {} samples produced",
        want.len()
    );

    // Every node answers every sample, once, bit for bit: SQL.
    for i in 0..3 {
        let got = sql_samples(c.node(i));
        let missing = want.keys().filter(|k| !got.contains_key(*k)).count();
        assert_eq!(
            missing,
            0,
            "node {}: {missing} of {} samples missing",
            c.ids[i],
            want.len()
        );
        assert_eq!(
            got.len(),
            want.len(),
            "node {} answers samples never produced",
            c.ids[i]
        );
        for (k, bits) in &want {
            assert_eq!(got[k], *bits, "node {}: {k:?} differs", c.ids[i]);
        }
    }

    // PromQL: per host, as many samples as were produced, no warnings.
    let last_ts = want.keys().map(|k| k.3).max().unwrap();
    let mut per_metric: BTreeMap<&str, BTreeMap<String, u64>> = BTreeMap::new();
    for k in want.keys() {
        *per_metric
            .entry(k.1.as_str())
            .or_default()
            .entry(k.0.clone())
            .or_default() += 1;
    }
    for i in 0..3 {
        for (metric, per_host) in &per_metric {
            let (counts, warnings) = prom_counts(c.node(i), metric, last_ts);
            assert!(warnings.is_empty(), "node {}: {warnings:?}", c.ids[i]);
            assert_eq!(&counts, per_host, "{metric} through node {}", c.ids[i]);
        }
    }

    // Rollups at rack, row and cluster level equal a fold of the samples.
    check_rollups(&c, &want, &racks);
}

/// count, sum, min, max of one rollup window.
type Window = (u64, f64, f64, f64);

/// `rollup_1m` at rack, row and cluster level, through every node, against
/// a fold of `want` computed here.
fn check_rollups(c: &Cluster, want: &Samples, racks: &BTreeMap<String, String>) {
    use super::support::Fold;
    const METRIC: &str = "DCGM_FI_DEV_GPU_TEMP";
    for (level, group_of) in [
        (
            "rack",
            &(|rack: &str| rack.to_owned()) as &dyn Fn(&str) -> String,
        ),
        ("row", &|rack: &str| {
            let n: usize = rack.trim_start_matches("rack-").parse().unwrap();
            format!("row-{}", n / 4)
        }),
        ("cluster", &|_: &str| "fleet".to_owned()),
    ] {
        let mut samples: BTreeMap<String, Vec<(i64, f64)>> = BTreeMap::new();
        for ((host, metric, _, ts), bits) in want {
            if metric == METRIC {
                samples
                    .entry(group_of(&racks[host]))
                    .or_default()
                    .push((*ts, f64::from_bits(*bits)));
            }
        }
        let column = if level == "cluster" { "cluster" } else { level };
        for i in 0..3 {
            let rows = c.node(i).sql(&format!(
                "SELECT {column}, CAST(ts AS BIGINT), count, sum, min, max FROM rollup_1m \
                 WHERE level = '{level}' AND metric = '{METRIC}' ORDER BY 1, 2"
            ));
            let mut got: BTreeMap<String, BTreeMap<i64, Window>> = BTreeMap::new();
            for r in &rows {
                got.entry(r[0].as_str().unwrap().to_owned())
                    .or_default()
                    .insert(
                        r[1].as_i64().unwrap(),
                        (
                            r[2].as_u64().unwrap(),
                            r[3].as_f64().unwrap(),
                            r[4].as_f64().unwrap(),
                            r[5].as_f64().unwrap(),
                        ),
                    );
            }
            assert_eq!(
                got.keys().collect::<Vec<_>>(),
                samples.keys().collect::<Vec<_>>(),
                "{level} groups through node {}",
                c.ids[i]
            );
            for (group, s) in &samples {
                let folds = Fold::windows(s.iter().copied(), 60_000);
                let g = &got[group];
                assert_eq!(
                    g.keys().collect::<Vec<_>>(),
                    folds.keys().collect::<Vec<_>>(),
                    "{level} {group} windows through node {}",
                    c.ids[i]
                );
                for (w, f) in &folds {
                    let (count, sum, min, max) = g[w];
                    assert_eq!(
                        (count, min, max),
                        (f.count, f.min, f.max),
                        "{level} {group} {w}"
                    );
                    assert!(
                        (sum - f.sum).abs() <= 1e-9 * f.sum.abs(),
                        "{level} {group} {w}: {sum} vs {}",
                        f.sum
                    );
                }
            }
        }
    }
}

/// The HTTP SQL answer's partial header and warnings.
pub(crate) fn sql_partial(node: &Node, query: &str) -> (Option<String>, Vec<Value>, Value) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut resp = agent
        .post(&format!("{}/api/v1/sql", node.http_url))
        .header("content-type", "text/plain")
        .send(query.as_bytes())
        .expect("HTTP request");
    assert_eq!(resp.status().as_u16(), 200);
    let partial = resp
        .headers()
        .get("x-gpulse-partial")
        .map(|v| v.to_str().unwrap().to_owned());
    let body: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
    let warnings = body["warnings"].as_array().cloned().unwrap_or_default();
    (partial, warnings, body)
}

fn remote_read_status(node: &Node) -> (u16, String) {
    use gpulse_proto::prometheus::{
        LabelMatcher, Query, ReadRequest, label_matcher::Type, read_request::ResponseType,
    };
    let req = ReadRequest {
        queries: vec![Query {
            start_timestamp_ms: 0,
            end_timestamp_ms: i64::MAX / 2,
            matchers: vec![LabelMatcher {
                r#type: Type::Re as i32,
                name: "__name__".into(),
                value: "DCGM_.+".into(),
            }],
            ..Query::default()
        }],
        accepted_response_types: vec![ResponseType::Samples as i32],
    };
    let (status, _, body) = post(node, "/api/v1/read", &req.encode_to_vec(), false);
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[test]
fn with_one_node_down_answers_are_complete_and_with_both_owners_down_they_say_partial() {
    let mut c = Cluster::start(3, 2);
    let data = write_request(0, 20);
    let (status, _, body) = post(c.node(0), "/api/v1/write", &data.encode_to_vec(), false);
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
    let want = per_rack(&data);
    let total: u64 = want.values().map(|v| v.0).sum();
    // Which racks each node owns, while all are up.
    let status = c.status();
    let owned = |id: &str| -> Vec<String> {
        status[id]["owned_racks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    let query = "SELECT rack, count(*) AS n FROM samples GROUP BY rack ORDER BY rack";
    let counts = |body: &Value| -> BTreeMap<String, u64> {
        body["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| (r[0].as_str().unwrap().to_owned(), r[1].as_u64().unwrap()))
            .collect()
    };

    // One node down: complete everywhere, no warnings.
    c.kill(0);
    let peers_see_it_down = || {
        for _ in 0..50 {
            if c.status()["a"]["up"] == false {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    };
    peers_see_it_down();
    for i in [1, 2] {
        let node = c.node(i);
        let (partial, warnings, body) = sql_partial(node, query);
        assert_eq!(partial, None, "node {}: {warnings:?}", c.ids[i]);
        assert!(warnings.is_empty(), "{warnings:?}");
        let want_counts: BTreeMap<String, u64> =
            want.iter().map(|(r, v)| (r.clone(), v.0)).collect();
        assert_eq!(counts(&body), want_counts, "node {}", c.ids[i]);
        let v = prom_get(
            node,
            "/api/v1/query",
            &[
                ("query", r#"count({__name__=~"DCGM_.+"})"#),
                ("time", "1700000200"),
            ],
        );
        assert!(v.get("warnings").is_none(), "{v}");
        let (status, body) = remote_read_status(node);
        assert_eq!(status, 200, "{body}");
        let out = super::pg::psql(node, &["SELECT count(*) FROM samples"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            total.to_string()
        );
        assert!(!stderr.contains("WARNING"), "{stderr}");
    }

    // Both owners of some racks down: every protocol says partial, naming them.
    let (a, b) = (owned("a"), owned("b"));
    let lost: Vec<&String> = a.iter().filter(|r| b.contains(r)).collect();
    assert!(
        !lost.is_empty(),
        "no rack is owned by both a and b: {a:?} {b:?}"
    );
    c.kill(1);
    let node = c.node(2);
    for _ in 0..50 {
        if c.status()["b"]["up"] == false {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let (partial, warnings, body) = sql_partial(node, query);
    assert_eq!(partial.as_deref(), Some("true"), "{body}");
    for rack in &lost {
        assert!(
            warnings
                .iter()
                .any(|w| w.as_str().unwrap().contains(rack.as_str())),
            "{rack}: {warnings:?}"
        );
        assert!(!counts(&body).contains_key(*rack));
    }
    for (rack, n) in counts(&body) {
        assert_eq!(
            n, want[&rack].0,
            "the racks still served are complete: {rack}"
        );
    }
    let v = prom_get(
        node,
        "/api/v1/query",
        &[
            ("query", r#"count({__name__=~"DCGM_.+"})"#),
            ("time", "1700000200"),
        ],
    );
    let warnings = v["warnings"].as_array().cloned().unwrap_or_default();
    assert!(
        lost.iter().all(|r| warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains(r.as_str()))),
        "{v}"
    );
    let (status, body) = remote_read_status(node);
    assert_eq!(status, 503, "{body}");
    assert!(lost.iter().all(|r| body.contains(r.as_str())), "{body}");
    let out = super::pg::psql(node, &["SELECT count(*) FROM samples"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("WARNING"), "{stderr}");
    assert!(lost.iter().all(|r| stderr.contains(r.as_str())), "{stderr}");
}

#[test]
fn a_fourth_node_joins_at_an_epoch_and_a_range_across_the_change_is_complete() {
    let c = Cluster::start(4, 2);
    // The first file: d is listed but not yet a member.
    let members = |ids: &[&str]| {
        ids.iter()
            .map(|i| format!("\"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let base = std::fs::read_to_string(&c.file).unwrap();
    std::fs::write(
        &c.file,
        format!(
            "{base}\n[[epoch]]\nstart = \"2020-01-01T00:00:00Z\"\nnodes = [{}]\n",
            members(&["a", "b", "c"])
        ),
    )
    .unwrap();
    for i in 0..4 {
        c.reload(i);
    }
    c.wait_same_file();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    // Data before the change, timestamped before it.
    let first = write_request_at(now() - 60_000, 20);
    let (status, _, body) = post(c.node(0), "/api/v1/write", &first.encode_to_vec(), false);
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));
    assert!(c.status()["d"]["held_racks"].as_array().unwrap().is_empty());

    // d joins 3 s from now.
    let change = now() + 3_000;
    let start = humantime::format_rfc3339_millis(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(change as u64),
    )
    .to_string();
    let text = std::fs::read_to_string(&c.file).unwrap();
    std::fs::write(
        &c.file,
        format!(
            "{text}\n[[epoch]]\nstart = \"{start}\"\nnodes = [{}]\n",
            members(&["a", "b", "c", "d"])
        ),
    )
    .unwrap();
    for i in 0..4 {
        c.reload(i);
    }
    c.wait_same_file();
    std::thread::sleep(std::time::Duration::from_millis(
        (change - now()).max(0) as u64 + 500,
    ));
    let second = write_request_at(now(), 20);
    let (status, _, body) = post(c.node(1), "/api/v1/write", &second.encode_to_vec(), false);
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));

    // d took some racks, and holds only data written after the change.
    let status = c.status();
    let moved = status["d"]["held_racks"].as_array().unwrap().len();
    assert!(moved > 0, "the new node took no rack: {status:?}");
    assert!(moved < 8, "the new node took every rack");

    // A range across the change: every sample, once, through every node.
    let mut want = per_rack(&first);
    for (rack, (n, sum)) in per_rack(&second) {
        let e = want.get_mut(&rack).unwrap();
        e.0 += n;
        e.1 += sum;
    }
    for i in 0..4 {
        let rows = c
            .node(i)
            .sql("SELECT rack, count(*), sum(value) FROM samples GROUP BY rack ORDER BY rack");
        let got: BTreeMap<String, (u64, f64)> = rows
            .iter()
            .map(|r| {
                (
                    r[0].as_str().unwrap().to_owned(),
                    (r[1].as_u64().unwrap(), r[2].as_f64().unwrap()),
                )
            })
            .collect();
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>()
        );
        for (rack, (n, sum)) in &want {
            assert_eq!(got[rack].0, *n, "{rack} through node {}", c.ids[i]);
            assert!(
                (got[rack].1 - sum).abs() < 1e-9 * sum.abs(),
                "{rack} through node {}",
                c.ids[i]
            );
        }
    }
}
