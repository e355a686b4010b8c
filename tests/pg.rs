//! The PostgreSQL wire protocol, through the real `psql`: exact aggregate
//! results, Grafana's query shape, `\dt`, errors that leave the connection
//! usable, read-only refusals and the result-size limit (also over HTTP).

use std::process::{Command, Output};

use gpulse_proto::v1::{
    AgentMessage, Batch, GpuInfo, Hello, Label, SeriesDef, Topology, agent_message, ingest_reply,
};

use crate::support::{Fold, Node, open_stream};

/// 2026-11-30T10:00:00Z in ms.
const T0: i64 = 1_796_032_800_000;
const TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
const POWER: &str = "DCGM_FI_DEV_POWER_USAGE";
/// `--max-result-rows` of the node under test.
const MAX_ROWS: usize = 10;

/// One GPU's series: host, rack, gpu, metric, (offset from T0 in s, value).
struct Series {
    host: &'static str,
    rack: &'static str,
    gpu: &'static str,
    metric: &'static str,
    points: &'static [(i64, f64)],
}

const FLEET: &[Series] = &[
    Series {
        host: "node-a",
        rack: "k1",
        gpu: "0",
        metric: TEMP,
        points: &[(0, 40.0), (30, 42.0), (60, 44.0), (90, 46.5)],
    },
    Series {
        host: "node-a",
        rack: "k1",
        gpu: "1",
        metric: TEMP,
        points: &[(0, 50.0), (30, 52.0), (60, 54.0), (90, 56.0)],
    },
    Series {
        host: "node-b",
        rack: "k2",
        gpu: "0",
        metric: TEMP,
        // The first point is an hour before the Grafana window.
        points: &[
            (-3600, 99.0),
            (0, 60.0),
            (30, 61.0),
            (60, 62.0),
            (90, 63.25),
        ],
    },
    Series {
        host: "node-b",
        rack: "k2",
        gpu: "0",
        metric: POWER,
        points: &[(0, 300.0), (60, 310.0)],
    },
];

/// The driver each host runs: node-b is the odd one out.
fn driver_of(host: &str) -> &'static str {
    if host == "node-b" {
        "535.104.05"
    } else {
        "550.54.15"
    }
}

/// The inventory a host's hello carries: its GPUs in FLEET.
fn gpus_of(host: &str) -> Vec<GpuInfo> {
    let mut gpus: Vec<&str> = FLEET
        .iter()
        .filter(|s| s.host == host)
        .map(|s| s.gpu)
        .collect();
    gpus.dedup();
    gpus.iter()
        .map(|g| GpuInfo {
            index: g.parse().unwrap(),
            uuid: format!("GPU-{host}-{g}"),
            model_name: "NVIDIA H100 80GB HBM3".into(),
            driver_version: driver_of(host).into(),
            ..Default::default()
        })
        .collect()
}

/// Streams the fleet to ingest: one stream per host, with its topology.
fn write_fleet(grpc_url: &str) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for host in ["node-a", "node-b"] {
            let rack = FLEET.iter().find(|s| s.host == host).unwrap().rack;
            let hello = AgentMessage {
                msg: Some(agent_message::Msg::Hello(Hello {
                    agent_id: host.into(),
                    host: host.into(),
                    topology: Some(Topology {
                        cluster: "c1".into(),
                        row: "r1".into(),
                        rack: rack.into(),
                    }),
                    gpus: gpus_of(host),
                    ..Default::default()
                })),
            };
            let (tx, mut replies) = open_stream(grpc_url, hello).await;
            let mut batch = Batch {
                seq: 1,
                ..Default::default()
            };
            for (id, s) in FLEET.iter().filter(|s| s.host == host).enumerate() {
                batch.new_series.push(SeriesDef {
                    id: id as u32,
                    metric: s.metric.into(),
                    labels: vec![Label {
                        name: "gpu".into(),
                        value: s.gpu.into(),
                    }],
                });
                for &(dt, v) in s.points {
                    batch.series_ids.push(id as u32);
                    batch.timestamps_ms.push(T0 + dt * 1000);
                    batch.values.push(v);
                }
            }
            let n = batch.values.len() as u32;
            tx.send(AgentMessage {
                msg: Some(agent_message::Msg::Batch(batch)),
            })
            .await
            .unwrap();
            match replies.message().await.unwrap().unwrap().reply.unwrap() {
                ingest_reply::Reply::Ack(a) => assert_eq!((a.seq, a.accepted), (1, n)),
                other => panic!("{other:?}"),
            }
        }
    });
}

/// `psql -At` against the node, one `-c` per command, verbose errors (with
/// the SQLSTATE).
pub(crate) fn psql(node: &Node, commands: &[&str]) -> Output {
    let url = format!(
        "{}/gpulse",
        node.pg_url.replace("postgres://", "postgresql://")
    );
    let mut cmd = Command::new("psql");
    cmd.arg(url)
        .args(["-X", "-At", "-v", "VERBOSITY=verbose"])
        .env("PGCONNECT_TIMEOUT", "10")
        .env_remove("PGPASSWORD")
        .env_remove("PGSERVICE");
    for c in commands {
        cmd.args(["-c", c]);
    }
    cmd.output()
        .expect("running psql (Debian: apt-get install postgresql-client)")
}

/// Runs commands that must succeed; returns stdout's lines.
fn psql_ok(node: &Node, commands: &[&str]) -> Vec<String> {
    let out = psql(node, commands);
    assert!(
        out.status.success(),
        "psql {commands:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// gpulse's float8 text form: the shortest digits that round-trip, with a
/// `.0` on whole numbers (PostgreSQL itself would print `40`, not `40.0`).
fn pg_float(v: f64) -> String {
    format!("{v:?}")
}

#[test]
fn psql_runs_aggregates_grafana_queries_and_catalog_commands() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &["--max-result-rows", &MAX_ROWS.to_string()],
    );
    write_fleet(&node.grpc_url);

    // An aggregate per rack, against a fold over the input.
    let got = psql_ok(
        &node,
        &[&format!(
            "SELECT rack, count(*), sum(value), min(value), max(value) FROM samples \
             WHERE metric = '{TEMP}' GROUP BY rack ORDER BY rack"
        )],
    );
    let mut want = Vec::new();
    for rack in ["k1", "k2"] {
        let vs: Vec<f64> = FLEET
            .iter()
            .filter(|s| s.rack == rack && s.metric == TEMP)
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .collect();
        want.push(format!(
            "{rack}|{}|{}|{}|{}",
            vs.len(),
            pg_float(vs.iter().sum()),
            pg_float(vs.iter().copied().fold(f64::INFINITY, f64::min)),
            pg_float(vs.iter().copied().fold(f64::NEG_INFINITY, f64::max)),
        ));
    }
    assert_eq!(got, want);

    // Labels from the hello's topology, text and timestamptz columns.
    // (`cluster` after the first column must be quoted: sqlparser 0.62 reads
    // it as the start of a CLUSTER BY clause, over HTTP too.)
    let got = psql_ok(
        &node,
        &[&format!(
            "SELECT ts, \"cluster\", \"row\", rack, host, gpu, value FROM samples \
             WHERE metric = '{POWER}' ORDER BY ts"
        )],
    );
    assert_eq!(
        got,
        [
            "2026-11-30 10:00:00.000000+00|c1|r1|k2|node-b|0|300.0",
            "2026-11-30 10:01:00.000000+00|c1|r1|k2|node-b|0|310.0",
        ]
    );

    // Grafana's time series shape: $__timeFilter(ts) expanded both ways it
    // may be, minute buckets with date_bin, ORDER BY 1.
    for filter in [
        "ts BETWEEN '2026-11-30T10:00:00Z' AND '2026-11-30T11:00:00Z'",
        "ts BETWEEN '2026-11-30T10:00:00Z'::timestamptz AND '2026-11-30T11:00:00Z'::timestamptz",
    ] {
        let got = psql_ok(
            &node,
            &[&format!(
                "SELECT date_bin(INTERVAL '1 minute', ts, TIMESTAMP '1970-01-01') AS \"time\", \
                 host AS metric, avg(value) AS value FROM samples \
                 WHERE {filter} AND metric = '{TEMP}' GROUP BY 1, 2 ORDER BY 1, 2"
            )],
        );
        let mut want = Vec::new();
        for (minute, offsets) in [(0, [0, 30]), (1, [60, 90])] {
            for host in ["node-a", "node-b"] {
                let vs: Vec<f64> = FLEET
                    .iter()
                    .filter(|s| s.host == host && s.metric == TEMP)
                    .flat_map(|s| s.points.iter())
                    .filter(|p| offsets.contains(&p.0))
                    .map(|p| p.1)
                    .collect();
                let avg = vs.iter().sum::<f64>() / vs.len() as f64;
                want.push(format!(
                    "2026-11-30 10:0{minute}:00.000000+00|{host}|{}",
                    pg_float(avg)
                ));
            }
        }
        assert_eq!(got, want, "{filter}");
    }

    // The rack-hour rollups, against a fold over the input.
    let got = psql_ok(
        &node,
        &[&format!(
            "SELECT rack, ts, count, sum, min, max, first, last, avg FROM rollup_1h \
             WHERE level = 'rack' AND metric = '{TEMP}' ORDER BY rack, ts"
        )],
    );
    let mut want = Vec::new();
    for rack in ["k1", "k2"] {
        let points = FLEET
            .iter()
            .filter(|s| s.rack == rack && s.metric == TEMP)
            .flat_map(|s| s.points.iter().map(|&(dt, v)| (T0 + dt * 1000, v)));
        for (hour, f) in Fold::windows(points, 3_600_000) {
            want.push(format!(
                "{rack}|2026-11-30 {:02}:00:00.000000+00|{}|{}|{}|{}|{}|{}|{}",
                10 + (hour - T0) / 3_600_000,
                f.count,
                pg_float(f.sum),
                pg_float(f.min),
                pg_float(f.max),
                pg_float(f.first.1),
                pg_float(f.last.1),
                pg_float(f.sum / f.count as f64),
            ));
        }
    }
    assert_eq!(want.len(), 3, "k1 at 10:00, k2 at 09:00 and 10:00");
    assert_eq!(got, want);

    // The tier-picking function: an hourly step over two hours reads rollup_1h.
    let got = psql_ok(
        &node,
        &[&format!(
            "SELECT tier, sum(count) FROM rollup('2026-11-30T09:00:00Z', '2026-11-30T11:00:00Z', '1h') \
             WHERE level = 'cluster' AND metric = '{TEMP}' GROUP BY tier"
        )],
    );
    let temps: usize = FLEET
        .iter()
        .filter(|s| s.metric == TEMP)
        .map(|s| s.points.len())
        .sum();
    assert_eq!(got, [format!("1h|{temps}")]);

    // The inventory: one row per GPU from the hellos, and the hosts whose
    // driver differs from the fleet's majority.
    let got = psql_ok(
        &node,
        &["SELECT host, gpu, uuid, driver_version FROM gpus ORDER BY host, gpu"],
    );
    let mut want = Vec::new();
    for host in ["node-a", "node-b"] {
        for g in gpus_of(host) {
            want.push(format!(
                "{host}|{}|{}|{}",
                g.index, g.uuid, g.driver_version
            ));
        }
    }
    assert_eq!(got, want);
    let got = psql_ok(
        &node,
        &[
            "WITH m AS (SELECT driver_version FROM gpus GROUP BY driver_version \
           ORDER BY count(*) DESC LIMIT 1) \
           SELECT DISTINCT host FROM gpus \
           WHERE driver_version <> (SELECT driver_version FROM m) ORDER BY host",
        ],
    );
    assert_eq!(got, ["node-b"]);

    // \dt lists the tables (psql's own pg_catalog query).
    let got = psql_ok(&node, &["\\dt"]);
    for table in [
        "samples",
        "gpus",
        "rollup_1m",
        "rollup_1h",
        "rollup_1d",
        "health_events",
    ] {
        assert!(
            got.iter()
                .any(|l| l.starts_with(&format!("public|{table}|table|"))),
            "{table}: {got:?}"
        );
    }

    // A bad query: an error with its SQLSTATE, a non-zero exit, and the
    // connection still answers the next command.
    let out = psql(&node, &["SELECT no_such_column FROM samples"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ERROR:  42703") && err.contains("no_such_column"),
        "{err}"
    );
    let out = psql(&node, &["SELEC 1", "SELECT count(*) FROM samples"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ERROR:  42601"), "{err}");
    let total: usize = FLEET.iter().map(|s| s.points.len()).sum();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        total.to_string()
    );

    // Read-only: DDL, DML and shared settings are refused, nothing changes.
    for stmt in [
        "CREATE TABLE t (x INT)",
        "DROP TABLE samples",
        "INSERT INTO samples (metric) VALUES ('x')",
        "SET datafusion.execution.batch_size = 1",
    ] {
        let out = psql(&node, &[stmt]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stmt} ran");
        assert!(err.contains("ERROR:  25006"), "{stmt}: {err}");
    }
    assert_eq!(
        psql_ok(&node, &["SELECT count(*) FROM samples"]),
        [total.to_string()]
    );

    // The result limit, over both front ends; total > MAX_ROWS.
    assert!(total > MAX_ROWS);
    let out = psql(&node, &["SELECT * FROM samples"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("ERROR:  54000") && err.contains("--max-result-rows"),
        "{err}"
    );
    let (status, body) = node.sql_raw("SELECT * FROM samples");
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["errorType"], "too_large");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains(&format!("more than {MAX_ROWS} rows")),
        "{body}"
    );
    // Exactly at the limit is fine.
    let rows = node.sql(&format!("SELECT value FROM samples LIMIT {MAX_ROWS}"));
    assert_eq!(rows.len(), MAX_ROWS);
    node.stop();
}
