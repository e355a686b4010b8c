//! Sharded cluster (issue #8): real `gpulse serve --cluster` nodes on
//! 127.0.0.1, each with its own data directory and ports.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use gpulse_proto::prometheus::{Label, Sample, TimeSeries, WriteRequest};
use prost::Message;
use serde_json::Value;

use super::remote::post;
use super::support::Node;

/// Free loopback ports, four per node (gRPC, HTTP, Flight, spare). The
/// listeners are closed again before the nodes bind them.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

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
        let ports = free_ports(3 * n);
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
        c
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

    pub(crate) fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// 8 racks of 4 hosts, 2 series a host, `n` samples each from `from`.
fn write_request(from: i64, n: i64) -> WriteRequest {
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
                let samples = (from..from + n)
                    .map(|i| Sample {
                        timestamp: 1_700_000_000_000 + i * 10_000,
                        value: (rack * 100 + h * 10) as f64 + i as f64 * 0.5,
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
    let _ = c.path();
}
