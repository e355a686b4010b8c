//! Issue #4: `gpulse agent --replay` streams a recorded long CSV into a real
//! node; `gpulse agent --sim-faults --ground-truth` writes its injected faults.

use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use crate::support::Node;

/// Rows of the test recording: (metric, gpu, timestamp_ms, value), in file order.
const ROWS: [(&str, u32, i64, f64); 8] = [
    ("DCGM_FI_DEV_GPU_TEMP", 0, 1_700_000_000_000, 40.0),
    ("DCGM_FI_DEV_POWER_USAGE", 0, 1_700_000_000_000, 71.25),
    ("DCGM_FI_DEV_GPU_TEMP", 1, 1_700_000_000_000, 45.0),
    ("DCGM_FI_DEV_GPU_TEMP", 0, 1_700_000_000_100, 41.0),
    ("DCGM_FI_DEV_POWER_USAGE", 0, 1_700_000_000_100, 72.5),
    ("DCGM_FI_DEV_GPU_TEMP", 1, 1_700_000_000_100, 46.0),
    ("DCGM_FI_DEV_GPU_TEMP", 0, 1_700_000_000_250, 42.0),
    ("DCGM_FI_DEV_GPU_TEMP", 1, 1_700_000_000_250, 47.0),
];

fn write_recording(path: &Path) {
    let mut s = String::from("labels,timestamp_ms,value\n");
    for (m, gpu, ts, v) in ROWS {
        s.push_str(&format!(
            "metric={m};gpu={gpu};UUID=GPU-e2e-{gpu};modelName=NVIDIA H100 80GB HBM3;Hostname=rec-host,{ts},{v}\n"
        ));
    }
    // A metric the catalog does not have: skipped.
    s.push_str("metric=mem_total_mib;gpu=0;Hostname=rec-host,1700000000000,0.5\n");
    std::fs::write(path, s).unwrap();
}

fn replay(node: &Node, file: &Path, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args(["agent", "--ingest", &node.grpc_url, "--replay-speed", "max"])
        .args(["--no-spool", "--metrics-listen", "off"])
        .arg("--replay")
        .arg(file)
        .args(extra)
        .output()
        .expect("run gpulse agent --replay");
    assert!(
        out.status.success(),
        "agent --replay failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// (metric, gpu, ts_ms, value) stored for `host`, in time order.
fn stored(node: &Node, host: &str) -> Vec<(String, u32, i64, f64)> {
    node.sql(&format!(
        "SELECT metric, gpu, CAST(ts AS BIGINT) AS ts_ms, value, uuid FROM samples \
         WHERE host = '{host}' ORDER BY ts_ms, gpu, metric"
    ))
    .into_iter()
    .map(|r| {
        let s = |v: &Value| v.as_str().expect("string cell").to_string();
        assert_eq!(
            s(&r[4]),
            format!("GPU-e2e-{}", s(&r[1])),
            "UUID label from the CSV"
        );
        (
            s(&r[0]),
            s(&r[1]).parse().unwrap(),
            r[2].as_i64().expect("ts"),
            r[3].as_f64().expect("value"),
        )
    })
    .collect()
}

fn expected(shift_ms: i64) -> Vec<(String, u32, i64, f64)> {
    let mut v: Vec<_> = ROWS
        .iter()
        .map(|(m, g, t, x)| (m.to_string(), *g, t + shift_ms, *x))
        .collect();
    v.sort_by(|a, b| (a.2, a.1, &a.0).cmp(&(b.2, b.1, &b.0)));
    v
}

#[test]
fn replay_lands_with_shifted_or_recorded_timestamps() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let file = dir.path().join("rec.csv");
    write_recording(&file);

    // Default: shifted so that the first poll is now, spacing kept.
    let before = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let summary = replay(&node, &file, &[]);
    assert!(
        summary.contains(
            "replayed 3 polls, 8 readings from 9 rows; skipped 1 rows of metrics not in the catalog"
        ),
        "{summary}"
    );
    // The host defaults to the recording's.
    let got = stored(&node, "rec-host");
    assert_eq!(got.len(), ROWS.len());
    let shift = got[0].2 - ROWS[0].2;
    assert!(
        (before..before + 60_000).contains(&(ROWS[0].2 + shift)),
        "first poll at {} should be about now ({before})",
        ROWS[0].2 + shift
    );
    assert_eq!(got, expected(shift));

    // Recorded timestamps, on request (another host, so other series).
    replay(
        &node,
        &file,
        &["--replay-timestamps", "recorded", "--host", "rec-host-2"],
    );
    assert_eq!(stored(&node, "rec-host-2"), expected(0));
    node.stop();
}

#[test]
fn sim_faults_write_their_ground_truth() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let truth = dir.path().join("truth.csv");
    let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args(["agent", "--ingest", &node.grpc_url, "--sim-faults"])
        .args(["--no-spool", "--metrics-listen", "off"])
        .args(["--gpus", "2", "--polls", "3", "--interval", "20ms"])
        .arg("--ground-truth")
        .arg(&truth)
        .output()
        .expect("run gpulse agent --sim-faults");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Three 20 ms polls at one fault per GPU-hour: almost surely none, but
    // the file is written, with its header.
    let text = std::fs::read_to_string(&truth).unwrap();
    assert_eq!(
        text.lines().next(),
        Some(
            "gpu,uuid,kind,xid,start_tick,end_tick,start_ts_ms,end_ts_ms,magnitude,variant,shown_tick,shown_ticks"
        )
    );
    node.stop();
}
