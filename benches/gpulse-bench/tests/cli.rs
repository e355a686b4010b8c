//! The `gpulse-bench` binary as a user runs it: the report over results
//! written by hand (ratios worked out here), and the errors a user sees.
//! The load generator and the query set against real servers are in the
//! workspace's end-to-end test (`tests/bench.rs`).

use std::process::Command;

fn bench(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpulse-bench"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env_remove("GPULSE_BIN")
        .output()
        .expect("run gpulse-bench")
}

fn ingest_line(system: &str, protocol: &str, per_core: f64, bytes_per_sample: f64) -> String {
    serde_json::json!({
        "kind": "ingest", "system": system, "protocol": protocol, "dataset": "simulated",
        "hosts": 8, "series": 1000, "samples_sent": 1_000_000, "samples_acked": 1_000_000,
        "samples_dropped": 0, "samples_rejected": 0, "requests": 100, "errors": 0,
        "wall_s": 10.0, "samples_per_s": 100_000.0, "samples_per_core_s": per_core,
        "ack_p50_ms": 1.0, "ack_p99_ms": 2.0, "bytes_per_sample": bytes_per_sample,
        "end_ms": 0
    })
    .to_string()
}

#[test]
fn report_states_the_ratios_against_the_peer_and_whether_each_goal_is_met() {
    let dir = tempfile::tempdir().unwrap();
    let results = dir.path().join("results.jsonl");
    // gpulse 900 k samples/s per core and 0.6 B/sample; VictoriaMetrics
    // 300 k and 1.2 B: 3.00x (goal >= 3, met) and 0.50x (goal <= 0.75, met).
    let lines = [
        ingest_line("gpulse", "agent", 900_000.0, 0.6),
        ingest_line("victoria-metrics", "remote-write", 300_000.0, 1.2),
    ];
    std::fs::write(&results, lines.join("\n")).unwrap();
    let md = dir.path().join("B.md");
    std::fs::write(
        &md,
        "# Benchmarks\n\n<!-- peers:begin -->\nold\n<!-- peers:end -->\ntail\n",
    )
    .unwrap();
    let out = bench(&[
        "report",
        results.to_str().unwrap(),
        "--markdown",
        md.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |what: &str| {
        stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {what}")))
            .unwrap_or_else(|| panic!("no row {what:?} in\n{stdout}"))
            .to_string()
    };
    let per_core = row("ingest samples/s per server core");
    assert!(per_core.contains("| 3.00× | ≥ 3 | **yes** |"), "{per_core}");
    let disk = row("bytes per sample on disk, simulated");
    assert!(disk.contains("| 0.50× | ≤ 0.75 | **yes** |"), "{disk}");
    // The victoria-metrics row of the ingest table: 900 k / 300 k per core.
    let vm = row("victoria-metrics | remote-write");
    assert!(vm.ends_with("| 3.00× slower |"), "{vm}");
    // The marked section is replaced; the rest of the file is kept.
    let text = std::fs::read_to_string(&md).unwrap();
    assert!(
        text.starts_with("# Benchmarks\n\n<!-- peers:begin -->\n"),
        "{text}"
    );
    assert!(!text.contains("old"), "{text}");
    assert!(text.ends_with("<!-- peers:end -->\ntail\n"), "{text}");
}

#[test]
fn errors_name_what_to_fix() {
    // A missing gpulse binary for a self-started server.
    let out = bench(&["ingest", "--quick", "--gpulse", "/nonexistent/gpulse"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent/gpulse") && err.contains("--gpulse"),
        "{err}"
    );
    // A rate that is not one.
    let out = bench(&["ingest", "--rate", "fast"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a rate"), "{err}");
    // Results that are not results.
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"kind\": \"nonsense\"}\n").unwrap();
    let out = bench(&["report", bad.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bad.jsonl:1") && err.contains("unknown result kind"),
        "{err}"
    );
}

#[test]
fn health_prints_the_tables_and_writes_the_json() {
    // 16 GPUs over 6 virtual minutes with many random faults: only the shape
    // of the output is checked here (the figures are the detectors' business).
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("health.json");
    let out = bench(&[
        "health",
        "--gpus",
        "16",
        "--hours",
        "0.1",
        "--fault-rate",
        "2",
        "--threads",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "fault kind",
        "detector kind",
        "clean run:",
        "goals:",
        "seed 1001 (held out)",
    ] {
        assert!(stdout.contains(want), "{want:?} missing:\n{stdout}");
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["kind"], "health");
    assert_eq!(v["config"]["gpus"], 16);
    assert_eq!(v["clean"]["healthy_gpu_hours"], 1.6);
    assert!(v["faulty"]["fault_kinds"].as_array().unwrap().len() >= 9);
    assert!(v["faulty"]["base_rate_per_gpu_hour"].is_number());
    // A tuning seed is said to be one; nonsense is refused.
    let out = bench(&[
        "health", "--gpus", "8", "--hours", "0.01", "--seed", "7", "--mode", "clean",
    ]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("TUNING seed"));
    let out = bench(&["health", "--hours", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--hours"));
}
