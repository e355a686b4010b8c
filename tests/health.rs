//! Issue #16: the health engine inside the real binary. `gpulse demo` seeds
//! three faults in its simulated fleet; they must show up in
//! `health_events`, `GET /api/v1/health` and `gpulse_health_active`, on the
//! GPUs they were put on and on no other, and stay after a restart.

use std::time::{Duration, Instant};

use gpulse_proto::v1::{AgentMessage, Batch, Hello, Label, SeriesDef, agent_message, ingest_reply};
use serde_json::Value;

use super::support::{Node, http, listen_ports, log_tail, now_ms, open_stream};

/// The demo's faults, by where it puts them (its host naming: row, rack,
/// host of 2 rows × 2 racks × 4 hosts): host index 0, 5 and 10.
const XID48: (&str, i64) = ("node-r0k0-00", 3);
const THERMAL: (&str, i64) = ("node-r0k1-01", 6);
const XID79: (&str, i64) = ("node-r1k0-02", 1);

/// Active events as (kind, severity, host, gpu, xid).
fn active(node: &Node) -> Vec<(String, String, String, i64, Option<i64>)> {
    node.sql(
        "SELECT kind, severity, host, CAST(gpu AS BIGINT), xid FROM health_events \
         WHERE cleared_at IS NULL ORDER BY id",
    )
    .into_iter()
    .map(|r| {
        (
            r[0].as_str().unwrap().to_string(),
            r[1].as_str().unwrap().to_string(),
            r[2].as_str().unwrap().to_string(),
            r[3].as_i64().unwrap(),
            r[4].as_i64(),
        )
    })
    .collect()
}

fn has(
    events: &[(String, String, String, i64, Option<i64>)],
    kind: &str,
    at: (&str, i64),
    xid: Option<i64>,
) -> bool {
    events
        .iter()
        .any(|e| e.0 == kind && e.2 == at.0 && e.3 == at.1 && e.4 == xid)
}

/// An instant PromQL query's whole answer.
fn promql(node: &Node, q: &str) -> Value {
    let body = http()
        .get(format!("{}/api/v1/query", node.http_url))
        .query("query", q)
        .call()
        .unwrap_or_else(|e| panic!("PromQL {q}: {e}"))
        .body_mut()
        .read_to_string()
        .unwrap();
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad JSON for {q}: {e}: {body}"))
}

/// The answer to the instant query `q`, once its first sample's value is
/// `want` (within 30 s): the health series are appended by the engine's
/// thread just after its events change, so a reader that saw the event in
/// `health_events` may be a moment ahead of them.
fn promql_until(node: &Node, q: &str, want: &str) -> Value {
    let started = Instant::now();
    loop {
        let r = promql(node, q);
        if r["data"]["result"][0]["value"][1] == want || started.elapsed() > Duration::from_secs(30)
        {
            return r;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The rows `query` answers, once there are some (within 30 s).
fn wait_rows(node: &Node, query: &str, what: &str) -> Vec<Vec<Value>> {
    let started = Instant::now();
    loop {
        let rows = node.sql(query);
        if !rows.is_empty() {
            return rows;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{what}; node log:\n{}",
            log_tail(&node.log)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn get_json(url: &str) -> Value {
    let body = http()
        .get(url)
        .call()
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .body_mut()
        .read_to_string()
        .unwrap();
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad JSON from {url}: {e}: {body}"))
}

#[test]
fn the_demo_finds_its_seeded_faults_on_their_gpus_only_and_keeps_them_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let node = Node::start_command("demo", &data, &["--flush-interval", "10s"]);
    // XID 48 at poll 15, XID 79 at 25, the thermal fault from poll 20 (the
    // temperature climbs 3 °C/s to the slowdown point, then the throttle
    // must hold 10 s).
    let started = Instant::now();
    let events = loop {
        let events = active(&node);
        if has(&events, "xid", XID48, Some(48))
            && has(&events, "xid", XID79, Some(79))
            && has(&events, "thermal_throttle", THERMAL, None)
        {
            break events;
        }
        assert!(
            started.elapsed() < Duration::from_secs(150),
            "the seeded faults were not all found; active: {events:?}\n{}",
            log_tail(&node.log)
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    // One incident per fault (an XID 48 also shows as ECC errors and a new
    // remapped row: one row), and nothing on the 125 GPUs without a fault.
    assert_eq!(events.len(), 3, "{events:?}");
    let faulty = [XID48, THERMAL, XID79];
    for e in &events {
        assert!(
            faulty.iter().any(|f| f.0 == e.2 && f.1 == e.3),
            "an event on a healthy GPU: {e:?}; all: {events:?}"
        );
    }
    let xid = |at: (&str, i64)| {
        events
            .iter()
            .find(|e| e.0 == "xid" && (e.2.as_str(), e.3) == at)
    };
    assert_eq!(xid(XID48).unwrap().1, "critical");
    assert_eq!(xid(XID79).unwrap().1, "critical");

    // GET /api/v1/health: 128 GPUs, the faulty ones not ok.
    let report = get_json(&format!("{}/api/v1/health", node.http_url));
    let d = &report["data"];
    assert_eq!(d["gpus"], 128, "{report}");
    let not_ok: Vec<(&str, &str)> = d["not_ok"]["host"]
        .as_array()
        .unwrap()
        .iter()
        .zip(d["not_ok"]["state"].as_array().unwrap())
        .map(|(h, s)| (h.as_str().unwrap(), s.as_str().unwrap()))
        .collect();
    assert!(not_ok.contains(&(XID48.0, "critical")), "{report}");
    assert!(d["active"].as_array().unwrap().len() >= 3, "{report}");

    // PromQL: the XID 48 event is a series at 1.
    let r = promql(&node, "gpulse_health_active{kind=\"xid\", xid=\"48\"} == 1");
    let series = r["data"]["result"].as_array().unwrap();
    assert_eq!(series.len(), 1, "{r}");
    assert_eq!(series[0]["metric"]["Hostname"], XID48.0, "{r}");
    assert_eq!(series[0]["metric"]["gpu"], XID48.1.to_string(), "{r}");
    assert_eq!(series[0]["metric"]["severity"], "critical", "{r}");

    // A restart (as `serve`, no agents) answers the same events, still open.
    let ids_before = node.sql("SELECT id, kind, host, gpu FROM health_events ORDER BY id");
    node.stop();
    let node = Node::start_with_args(&data, &[]);
    let ids_after = node.sql("SELECT id, kind, host, gpu FROM health_events ORDER BY id");
    for row in &ids_before {
        assert!(
            ids_after.contains(row),
            "{row:?} is gone after the restart: {ids_after:?}\n{}",
            log_tail(&node.log)
        );
    }
    let after = active(&node);
    assert!(has(&after, "xid", XID48, Some(48)), "{after:?}");
    node.stop();
}

/// A real Alertmanager (Debian's `prometheus-alertmanager`) on loopback.
struct Alertmanager {
    child: std::process::Child,
    url: String,
}

impl Alertmanager {
    /// Starts it on `port` (from [`listen_ports`]) and waits until it is ready.
    fn start_on(dir: &std::path::Path, port: u16) -> Alertmanager {
        let config = dir.join("alertmanager.yml");
        std::fs::write(
            &config,
            "route:\n  receiver: discard\n  group_wait: 1s\nreceivers:\n  - name: discard\n",
        )
        .unwrap();
        let log = std::fs::File::create(dir.join("alertmanager.log")).unwrap();
        let child = std::process::Command::new("prometheus-alertmanager")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.path={}", dir.join("am-data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            // One instance, no gossip.
            .arg("--cluster.listen-address=")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("prometheus-alertmanager (Debian: apt-get install prometheus-alertmanager)");
        let url = format!("http://127.0.0.1:{port}");
        let started = Instant::now();
        while http().get(format!("{url}/-/ready")).call().is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "Alertmanager did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Alertmanager { child, url }
    }

    /// The labels of the alerts Alertmanager holds as active.
    fn active(&self) -> Vec<serde_json::Map<String, Value>> {
        let v = get_json(&format!(
            "{}/api/v2/alerts?active=true&silenced=false&inhibited=false",
            self.url
        ));
        v.as_array()
            .unwrap()
            .iter()
            .filter(|a| a["status"]["state"] == "active")
            .map(|a| a["labels"].as_object().unwrap().clone())
            .collect()
    }
}

impl Drop for Alertmanager {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One poll of `DCGM_FI_DEV_XID_ERRORS` per second from `t0`, with `xid`
/// from `from` on, as one batch of series 0.
fn xid_polls(seq: u64, define: bool, t0: i64, n: i64, from: i64, xid: f64) -> AgentMessage {
    let mut b = Batch {
        seq,
        ..Default::default()
    };
    if define {
        b.new_series.push(SeriesDef {
            id: 0,
            metric: "DCGM_FI_DEV_XID_ERRORS".into(),
            labels: vec![
                Label {
                    name: "gpu".into(),
                    value: "2".into(),
                },
                Label {
                    name: "UUID".into(),
                    value: "GPU-alert-test".into(),
                },
            ],
        });
    }
    for i in 0..n {
        let t = t0 + i * 1000;
        b.series_ids.push(0);
        b.timestamps_ms.push(t);
        b.values.push(if t >= from { xid } else { 0.0 });
    }
    AgentMessage {
        msg: Some(agent_message::Msg::Batch(b)),
    }
}

fn is_xid_13(a: &serde_json::Map<String, Value>) -> bool {
    a["alertname"] == "GpuHealth" && a["kind"] == "xid" && a.get("xid") == Some(&Value::from("13"))
}

/// An XID 13 (a non-fatal, application-level XID: warning) reaches
/// Alertmanager as an alert with the GPU's labels, and resolves there when
/// the event clears (an hour of sample time without a new XID); an
/// Alertmanager that was down when the event opened gets it once it is up.
#[test]
fn health_events_reach_a_real_alertmanager_and_resolve_there() {
    let dir = tempfile::tempdir().unwrap();
    let am_dir = dir.path().join("am");
    std::fs::create_dir_all(&am_dir).unwrap();
    // Alertmanager's port is chosen, but it is not started yet.
    let port = listen_ports(1)[0];
    let am_url = format!("http://127.0.0.1:{port}");
    let node = Node::start_with_args(&dir.path().join("data"), &["--alertmanager-url", &am_url]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    // Two hours ago: the XID at t0 + 10 s, polls up to t0 + 20 s.
    let t0 = now_ms() - 2 * 3_600_000;
    let tx = rt.block_on(async {
        let (tx, mut replies) = open_stream(
            &node.grpc_url,
            AgentMessage {
                msg: Some(agent_message::Msg::Hello(Hello {
                    agent_id: "alert-agent".into(),
                    host: "alert-host".into(),
                    ..Default::default()
                })),
            },
        )
        .await;
        tx.send(xid_polls(1, true, t0, 21, t0 + 10_000, 13.0))
            .await
            .unwrap();
        match replies.message().await.unwrap().unwrap().reply.unwrap() {
            ingest_reply::Reply::Ack(a) => assert_eq!(a.accepted, 21),
            other => panic!("{other:?}"),
        }
        (tx, replies)
    });
    // The event opens whether or not Alertmanager is there.
    wait_rows(
        &node,
        "SELECT id FROM health_events WHERE kind = 'xid' AND xid = 13",
        "no xid 13 event",
    );
    // Now Alertmanager comes up, on the port the node was told.
    let am = Alertmanager::start_on(&am_dir, port);
    assert_eq!(am.url, am_url);
    let started = Instant::now();
    let alert = loop {
        if let Some(a) = am
            .active()
            .into_iter()
            .find(|a| a["alertname"] == "GpuHealth")
        {
            break a;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no alert in Alertmanager; node log:\n{}",
            log_tail(&node.log)
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    assert_eq!(alert["kind"], "xid");
    assert_eq!(alert["xid"], "13");
    assert_eq!(alert["severity"], "warning");
    assert_eq!(alert["Hostname"], "alert-host");
    assert_eq!(alert["gpu"], "2");
    assert_eq!(alert["UUID"], "GPU-alert-test");
    // An hour of polls without a new XID (the gauge keeps showing 13):
    // the event clears at t0 + 10 s + 1 h, and the alert resolves.
    let (tx, mut replies) = tx;
    rt.block_on(async {
        let t1 = t0 + 21_000;
        tx.send(xid_polls(2, false, t1, 3_600, t0 + 10_000, 13.0))
            .await
            .unwrap();
        match replies.message().await.unwrap().unwrap().reply.unwrap() {
            ingest_reply::Reply::Ack(a) => assert_eq!(a.accepted, 3_600),
            other => panic!("{other:?}"),
        }
    });
    let started = Instant::now();
    while am.active().iter().any(is_xid_13) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the alert did not resolve; node log:\n{}",
            log_tail(&node.log)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // PromQL's newest gpulse_health_active for it is 0 now.
    let r = promql(&node, "gpulse_health_active{kind=\"xid\", xid=\"13\"}");
    let series = r["data"]["result"].as_array().unwrap();
    assert_eq!(series.len(), 1, "{r}");
    assert_eq!(series[0]["value"][1], "0", "{r}");
    let cleared = node.sql("SELECT CAST(cleared_at AS BIGINT) FROM health_events WHERE xid = 13");
    assert_eq!(cleared.len(), 1);
    assert!(!cleared[0][0].is_null(), "cleared in health_events too");
    drop(tx);
    node.stop();
}

/// `drift` in the real binary: the inventory an agent sends in its hello
/// (the `gpus` table) reaches the engine, and the one GPU of six whose
/// driver differs from the others' gets a warning, the others nothing.
#[test]
fn a_gpu_whose_driver_differs_from_the_fleets_is_drift() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let driver = |i: u32| if i == 4 { "535.129.03" } else { "550.54.15" };
    let uuid = |i: u32| format!("GPU-drift-{i}");
    let hello = Hello {
        agent_id: "drift-agent".into(),
        host: "drift-host".into(),
        gpus: (0..6)
            .map(|i| gpulse_proto::v1::GpuInfo {
                index: i,
                uuid: uuid(i),
                model_name: "NVIDIA H100 80GB HBM3".into(),
                driver_version: driver(i).into(),
                vbios_version: "96.00.89.00.01".into(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    // Two polls of every GPU's temperature, so that the engine knows them.
    let t0 = now_ms() - 60_000;
    let mut b = Batch {
        seq: 1,
        ..Default::default()
    };
    for i in 0..6u32 {
        b.new_series.push(SeriesDef {
            id: i,
            metric: "DCGM_FI_DEV_GPU_TEMP".into(),
            labels: vec![
                Label {
                    name: "gpu".into(),
                    value: i.to_string(),
                },
                Label {
                    name: "UUID".into(),
                    value: uuid(i),
                },
            ],
        });
        for k in 0..2 {
            b.series_ids.push(i);
            b.timestamps_ms.push(t0 + k * 1000);
            b.values.push(40.0);
        }
    }
    let stream = rt.block_on(async {
        let (tx, mut replies) = open_stream(
            &node.grpc_url,
            AgentMessage {
                msg: Some(agent_message::Msg::Hello(hello)),
            },
        )
        .await;
        tx.send(AgentMessage {
            msg: Some(agent_message::Msg::Batch(b)),
        })
        .await
        .unwrap();
        match replies.message().await.unwrap().unwrap().reply.unwrap() {
            ingest_reply::Reply::Ack(a) => assert_eq!(a.accepted, 12),
            other => panic!("{other:?}"),
        }
        (tx, replies)
    });
    let query = "SELECT uuid, severity, evidence FROM health_events WHERE kind = 'drift'";
    let rows = wait_rows(&node, query, "no drift event");
    // Give a wrongly judged GPU time to show up too.
    std::thread::sleep(Duration::from_secs(3));
    let rows_after = node.sql(query);
    assert_eq!(rows_after.len(), 1, "{rows_after:?}");
    assert_eq!(rows[0][0], "GPU-drift-4");
    assert_eq!(rows[0][1], "warning");
    assert_eq!(
        rows[0][2],
        "driver 535.129.03, while 5 of 6 GPUs of the fleet run 550.54.15"
    );
    drop(stream);
    node.stop();
}

/// `DCGM_FI_DEV_XID_ERRORS` of 6 racks × 2 hosts × 2 GPUs, one sample a
/// second over `[t0, t0 + n s)`; the GPUs in `faulty` show XID 13 from the
/// 5th sample on.
fn fleet_xids(t0: i64, n: i64, faulty: &[&str]) -> gpulse_proto::prometheus::WriteRequest {
    use gpulse_proto::prometheus::{Label as PLabel, Sample, TimeSeries, WriteRequest};
    let mut timeseries = Vec::new();
    for rack in 0..6 {
        for h in 0..2 {
            for g in 0..2 {
                let uuid = format!("GPU-r{rack}h{h}g{g}");
                let xid = if faulty.contains(&uuid.as_str()) {
                    13.0
                } else {
                    0.0
                };
                let labels = [
                    ("__name__", "DCGM_FI_DEV_XID_ERRORS".to_owned()),
                    ("Hostname", format!("r{rack}-h{h}")),
                    ("UUID", uuid),
                    ("gpu", g.to_string()),
                    ("rack", format!("rack-{rack}")),
                ]
                .into_iter()
                .map(|(name, value)| PLabel {
                    name: name.into(),
                    value,
                })
                .collect();
                let samples = (0..n)
                    .map(|i| Sample {
                        timestamp: t0 + i * 1000,
                        value: if i >= 4 { xid } else { 0.0 },
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

/// In a cluster (3 nodes, 2 replicas of each rack), every node answers
/// `health_events`, `GET /api/v1/health` and the health series for the
/// whole cluster: each event once though two nodes evaluate its GPU, and
/// still whole with one node killed.
#[test]
fn health_events_and_the_health_api_answer_for_the_whole_cluster() {
    use prost::Message as _;
    let mut c = super::cluster::Cluster::start(3, 2);
    let faulty = ["GPU-r0h1g0", "GPU-r3h0g1", "GPU-r5h1g1"];
    let t0 = now_ms() - 15_000;
    let body = fleet_xids(t0, 12, &faulty).encode_to_vec();
    let (status, text, _) = super::remote::post(c.node(0), "/api/v1/write", &body, false);
    assert_eq!(status, 204, "{text}");
    let want: Vec<Value> = faulty.iter().map(|u| Value::from(*u)).collect();
    let query = "SELECT uuid, id, severity FROM health_events WHERE kind = 'xid' AND xid = 13 \
                 ORDER BY uuid";
    // Every node: each event once, from the node that evaluates its rack
    // or from its replica.
    let check = |c: &super::cluster::Cluster, alive: &[usize]| {
        for &i in alive {
            let node = c.node(i);
            let started = Instant::now();
            let (partial, warnings, body) = loop {
                let got = super::cluster::sql_partial(node, query);
                if got.2["rows"].as_array().map_or(0, Vec::len) >= faulty.len()
                    || started.elapsed() > Duration::from_secs(30)
                {
                    break got;
                }
                std::thread::sleep(Duration::from_millis(200));
            };
            assert_eq!(partial, None, "node {i}: {warnings:?}");
            let rows = body["rows"].as_array().unwrap();
            let uuids: Vec<Value> = rows.iter().map(|r| r[0].clone()).collect();
            assert_eq!(uuids, want, "node {i}: {body}");
            assert!(rows.iter().all(|r| r[2] == "warning"), "node {i}: {body}");
            let mut ids: Vec<i64> = rows.iter().map(|r| r[1].as_i64().unwrap()).collect();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), faulty.len(), "ids are unique: {body}");

            let api = get_json(&format!("{}/api/v1/health", node.http_url));
            assert!(api.get("warnings").is_none(), "node {i}: {api}");
            let data = &api["data"];
            assert_eq!(data["gpus"], 24, "node {i}: every GPU once: {api}");
            let mut active: Vec<Value> = data["active"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|e| e["kind"] == "xid")
                .map(|e| e["uuid"].clone())
                .collect();
            active.sort_by_key(|u| u.as_str().unwrap().to_owned());
            assert_eq!(active, want, "node {i}: {api}");
            for u in &faulty {
                let listed = data["not_ok"]["uuid"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|x| x == u);
                assert!(listed, "node {i}: {u} is not ok: {api}");
            }

            // The health series: once per event, and the per-rack counts
            // of events opened add up to the cluster's.
            let r = promql_until(node, "count(gpulse_health_active{kind=\"xid\"} == 1)", "3");
            assert_eq!(r["data"]["result"][0]["value"][1], "3", "node {i}: {r}");
            let r = promql_until(node, "sum(gpulse_health_events_total{kind=\"xid\"})", "3");
            assert_eq!(r["data"]["result"][0]["value"][1], "3", "node {i}: {r}");
        }
    };
    check(&c, &[0, 1, 2]);
    // One node down: every rack still has an owner up.
    c.kill(1);
    check(&c, &[0, 2]);
}
