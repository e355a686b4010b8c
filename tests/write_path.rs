//! Issue #2: agent -> gRPC -> ingest -> storage -> SQL, checked against the
//! simulator's own output, and still answered after a restart.

use std::collections::BTreeMap;
use std::time::Duration;

use agent::catalog::Metric;
use agent::sim::{SimConfig, SimulatedSource};
use agent::{AgentConfig, GpuSource, Topology};
use serde_json::Value;

use crate::support::Node;

const SEED: u64 = 20261130;
const GPUS: u32 = 4;
const POLLS: u64 = 40;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Fold {
    count: u64,
    min: f64,
    max: f64,
    sum: f64,
}

fn sim_config() -> SimConfig {
    let mut c = SimConfig::new(SEED, GPUS);
    c.interval_ms = 20;
    c
}

/// What the agent must have sent: the simulator's readings for `POLLS`
/// polls, folded per (metric, gpu) without touching storage.
fn expected() -> BTreeMap<(String, String), Fold> {
    let mut sim = SimulatedSource::new(sim_config());
    let mut out: BTreeMap<(String, String), Fold> = BTreeMap::new();
    for _ in 0..POLLS {
        let mut readings = Vec::new();
        sim.sample(&mut readings).unwrap();
        for r in readings {
            let f = out
                .entry((r.metric.name().to_string(), r.gpu.to_string()))
                .or_insert(Fold {
                    count: 0,
                    min: f64::INFINITY,
                    max: f64::NEG_INFINITY,
                    sum: 0.0,
                });
            f.count += 1;
            f.min = f.min.min(r.value);
            f.max = f.max.max(r.value);
            f.sum += r.value;
        }
    }
    out
}

fn stored(node: &Node) -> BTreeMap<(String, String), Fold> {
    node.sql(
        "SELECT metric, gpu, count(*), min(value), max(value), sum(value) FROM samples \
         WHERE host = 'e2e-host' GROUP BY metric, gpu",
    )
    .into_iter()
    .map(|r| {
        let s = |v: &Value| v.as_str().expect("string cell").to_string();
        let f = |v: &Value| v.as_f64().expect("number cell");
        (
            (s(&r[0]), s(&r[1])),
            Fold {
                count: r[2].as_u64().expect("count"),
                min: f(&r[3]),
                max: f(&r[4]),
                sum: f(&r[5]),
            },
        )
    })
    .collect()
}

fn assert_matches(got: &BTreeMap<(String, String), Fold>, want: &BTreeMap<(String, String), Fold>) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "series differ"
    );
    for (k, w) in want {
        let g = &got[k];
        assert_eq!((g.count, g.min, g.max), (w.count, w.min, w.max), "{k:?}");
        // The sum's addition order differs between the test and the engine.
        let tol = 1e-9 * w.sum.abs().max(1.0);
        assert!(
            (g.sum - w.sum).abs() <= tol,
            "{k:?}: sum {} vs {}",
            g.sum,
            w.sum
        );
    }
}

#[test]
fn agent_to_sql_matches_the_simulator_and_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let node = Node::start(&data);

    let mut config = AgentConfig::new(&node.grpc_url);
    config.host = "e2e-host".into();
    config.agent_id = "e2e-agent".into();
    config.topology = Topology {
        cluster: "c-e2e".into(),
        row: "row-1".into(),
        rack: "rack-7".into(),
    };
    config.interval = Duration::from_millis(20);
    config.max_polls = Some(POLLS);
    let source = SimulatedSource::new(sim_config());
    let inventory: Vec<String> = source.inventory().iter().map(|g| g.uuid.clone()).collect();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let report = rt
        .block_on(agent::run(config, Box::new(source), std::future::pending()))
        .expect("agent run");
    // Every poll was sent and every batch acked: that is what "stored" means here.
    assert_eq!(report.polls, POLLS);
    assert_eq!(report.polls_dropped, 0);
    assert_eq!(report.shipper.batches_unacked, 0);
    assert_eq!(report.shipper.batches_rejected, 0);
    assert!(report.shipper.batches_acked >= 1);
    assert_eq!(report.shipper.batches_acked, report.shipper.batches_sent);
    assert_eq!(
        report.shipper.samples_acked,
        POLLS * GPUS as u64 * Metric::ALL.len() as u64
    );

    let want = expected();
    assert_eq!(want.len(), GPUS as usize * Metric::ALL.len());
    assert_matches(&stored(&node), &want);

    // Topology and dcgm-exporter labels arrive as columns.
    let labels =
        node.sql("SELECT DISTINCT cluster, \"row\", rack, gpu, uuid FROM samples ORDER BY gpu");
    let want_labels: Vec<Vec<Value>> = inventory
        .iter()
        .enumerate()
        .map(|(i, uuid)| {
            vec![
                "c-e2e".into(),
                "row-1".into(),
                "rack-7".into(),
                i.to_string().into(),
                uuid.clone().into(),
            ]
        })
        .collect();
    assert_eq!(labels, want_labels);

    // A graceful stop flushes the head; a new process answers the same.
    node.stop();
    assert!(
        std::fs::read_dir(data.join("segments")).unwrap().count() >= 1,
        "no segment written"
    );
    let node = Node::start(&data);
    assert_matches(&stored(&node), &want);
    node.stop();
}
