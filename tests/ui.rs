//! Issue #17: the fleet web UI in a real browser. Starts `gpulse demo` (its
//! simulated fleet with the three seeded faults), backfills an hour of
//! temperatures for a host whose GPU heats up half-way (for replay) and
//! writes a GPU whose host name is HTML, then runs the browser tests of
//! `tests/ui/` (`node --test`, playwright-core driving Debian's Chromium)
//! against it. They assert on what a person sees; see `tests/ui/*.test.mjs`.
//!
//! Without node, `/usr/bin/chromium` or `tests/ui/node_modules` the test says
//! so and passes, unless `GPULSE_REQUIRE_BROWSER=1` (set by `.ci/run`, which
//! installs them). `GPULSE_UI_SHOTS=DIR` keeps the screenshots there
//! (`GPULSE_UI_SHOTS=docs/ui` refreshes the README's pictures).
//! `GPULSE_UI_HOLD=FILE` sets everything up, writes the URL and the facts
//! to FILE and keeps the server running instead of running the tests (for
//! working on the UI, with `GPULSE_UI_DIR=ui`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use gpulse_proto::prometheus::{Label, Sample, TimeSeries, WriteRequest};
use prost::Message;
use serde_json::{Value, json};

use super::support::{Node, log_tail, now_ms};

/// Where the demo puts its seeded faults (see tests/health.rs).
const XID48: (&str, u32) = ("node-r0k0-00", 3);
const XID79: (&str, u32) = ("node-r1k0-02", 1);
const HEALTHY: (&str, u32) = ("node-r0k0-00", 0);
const HEATED_HOST: &str = "replay-host";
const HOSTILE_HOST: &str = "<img src=x onerror=alert(1)>";

/// What the browser tests need, if this machine can run them.
fn browser_ready(root: &Path) -> Result<(), String> {
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|o| o.status.success()) {
        return Err("node is not installed".into());
    }
    if !Path::new("/usr/bin/chromium").exists() {
        return Err("/usr/bin/chromium is not installed (Debian's chromium)".into());
    }
    if !root.join("tests/ui/node_modules/playwright-core").is_dir() {
        return Err("tests/ui/node_modules is missing (npm ci --prefix tests/ui)".into());
    }
    Ok(())
}

fn series(host: &str, uuid: &str, points: impl Iterator<Item = (i64, f64)>) -> TimeSeries {
    let labels = [
        ("__name__", "DCGM_FI_DEV_GPU_TEMP"),
        ("Hostname", host),
        ("UUID", uuid),
        ("gpu", "0"),
        ("rack", "rack-replay"),
        ("row", "row-replay"),
    ]
    .into_iter()
    .map(|(name, value)| Label {
        name: name.into(),
        value: value.into(),
    })
    .collect();
    TimeSeries {
        labels,
        samples: points
            .map(|(timestamp, value)| Sample { timestamp, value })
            .collect(),
        ..TimeSeries::default()
    }
}

/// An hour of temperatures every 10 s up to a minute ago: the heated GPU at
/// 35 °C, then 85 °C for the last half hour; the hostile host's at 40 °C.
fn backfill(now: i64) -> WriteRequest {
    let end = now - 60_000;
    let start = end - 3_600_000;
    let times = move || (start..=end).step_by(10_000);
    let half = start + 1_800_000;
    WriteRequest {
        timeseries: vec![
            series(
                HEATED_HOST,
                "GPU-replay-heated",
                times().map(move |t| (t, if t < half { 35.0 } else { 85.0 })),
            ),
            series(HOSTILE_HOST, "GPU-hostile", times().map(|t| (t, 40.0))),
        ],
        ..WriteRequest::default()
    }
}

fn layout(node: &Node) -> Value {
    let body = super::support::http()
        .get(format!("{}/api/v1/fleet/layout", node.http_url))
        .call()
        .expect("GET /api/v1/fleet/layout")
        .body_mut()
        .read_to_string()
        .expect("layout body");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("layout JSON {body:?}: {e}"))
}

#[test]
fn the_fleet_ui_in_headless_chromium() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let hold = std::env::var_os("GPULSE_UI_HOLD");
    if hold.is_none()
        && let Err(why) = browser_ready(root)
    {
        assert!(
            std::env::var_os("GPULSE_REQUIRE_BROWSER").is_none(),
            "GPULSE_REQUIRE_BROWSER is set, but {why}"
        );
        eprintln!("skipping the browser tests: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_command("demo", &dir.path().join("data"), &[]);
    let body = backfill(now_ms()).encode_to_vec();
    let (status, text, _) = super::remote::post(&node, "/api/v1/write", &body, false);
    assert_eq!(status, 204, "{text}");

    // The seeded faults show (XID 48 at poll 15, XID 79 at 25), and the
    // backfilled GPUs are in the layout.
    let started = Instant::now();
    loop {
        let rows = node.sql(
            "SELECT count(*) FROM health_events WHERE kind = 'xid' AND xid IN (48, 79) \
             AND cleared_at IS NULL",
        );
        let l = layout(&node);
        let hosts = l["data"]["host"].as_array().cloned().unwrap_or_default();
        let found = |h: &str| hosts.iter().any(|x| x == h);
        if rows[0][0] == 2 && found(HEATED_HOST) && found(HOSTILE_HOST) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the demo's faults or the backfilled GPUs did not show; node log:\n{}",
            log_tail(&node.log)
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    // The data API itself, against what was written: the backfilled GPUs'
    // newest temperatures (a minute old, within the lookback), and the
    // faulty GPUs' health codes (2 critical, 4 lost).
    let l = layout(&node);
    let index = |host: &str, gpu: u32| {
        let d = &l["data"];
        (0..d["gpus"].as_u64().unwrap() as usize)
            .find(|&i| d["host"][i] == host && d["gpu"][i] == gpu)
            .unwrap_or_else(|| panic!("{host}/{gpu} not in the layout: {l}"))
    };
    let frame = |color: &str| -> Value {
        let body = super::support::http()
            .get(format!("{}/api/v1/fleet/frame", node.http_url))
            .query("color", color)
            .call()
            .expect("GET /api/v1/fleet/frame")
            .body_mut()
            .read_to_string()
            .unwrap();
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["data"]["version"], l["data"]["version"], "{v}");
        v["data"]["values"].clone()
    };
    let temps = frame("DCGM_FI_DEV_GPU_TEMP");
    assert_eq!(temps[index(HEATED_HOST, 0)], 85.0, "{temps}");
    assert_eq!(temps[index(HOSTILE_HOST, 0)], 40.0, "{temps}");
    let health = frame("health");
    assert_eq!(health[index(XID48.0, XID48.1)], 2, "{health}");
    assert_eq!(health[index(XID79.0, XID79.1)], 4, "{health}");
    assert_eq!(health[index(HEALTHY.0, HEALTHY.1)], 0, "{health}");

    let gpu = |(host, gpu): (&str, u32)| json!({"host": host, "gpu": gpu});
    let facts = json!({
        "critical": gpu(XID48),
        "lost": gpu(XID79),
        "healthy": gpu(HEALTHY),
        "heated": gpu((HEATED_HOST, 0)),
        "hostile_host": HOSTILE_HOST,
    });
    if let Some(file) = hold {
        let url = json!({"url": node.http_url, "facts": facts});
        std::fs::write(&file, url.to_string()).unwrap();
        eprintln!(
            "holding {} (facts in {file:?}); kill this test to stop",
            node.http_url
        );
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }

    let shots = match std::env::var_os("GPULSE_UI_SHOTS") {
        Some(d) => root.join(d),
        None => dir.path().join("shots"),
    };
    let out = Command::new("node")
        .args(["--test", "--test-concurrency=1", "tests/ui/"])
        .current_dir(root)
        .env("GPULSE_UI_URL", &node.http_url)
        .env("GPULSE_UI_FACTS", facts.to_string())
        .env("GPULSE_UI_SHOTS", &shots)
        .output()
        .expect("run node --test");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "browser tests failed:\n{report}\n{}\nnode log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        log_tail(&node.log)
    );
    // Every test ran: none skipped for want of the server or the facts.
    assert!(
        report.contains("# skipped 0"),
        "some browser tests were skipped:\n{report}"
    );
    eprintln!("{report}");
    node.stop();
}

/// A node with `--auth-file`: the UI asks for a token and then works
/// (`tests/ui/auth.spec.mjs`).
#[test]
fn the_fleet_ui_asks_for_a_token() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    if let Err(why) = browser_ready(root) {
        assert!(
            std::env::var_os("GPULSE_REQUIRE_BROWSER").is_none(),
            "GPULSE_REQUIRE_BROWSER is set, but {why}"
        );
        eprintln!("skipping the browser test: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens.toml");
    let (read, write) = (
        super::security::create(&file, "ui", "read"),
        super::security::create(&file, "agent", "write"),
    );
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &["--auth-file", file.to_str().unwrap()],
    );
    let gpus = 2;
    let token = dir.path().join("agent.token");
    std::fs::write(&token, &write).unwrap();
    let agent = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args([
            "agent",
            "--simulate",
            "--gpus",
            &gpus.to_string(),
            "--polls",
            "3",
        ])
        .args([
            "--interval",
            "200ms",
            "--no-spool",
            "--metrics-listen",
            "off",
        ])
        .args(["--ingest", &node.grpc_url, "--token-file"])
        .arg(&token)
        .output()
        .unwrap();
    assert!(
        agent.status.success(),
        "{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    let out = Command::new("node")
        .args(["--test", "tests/ui/auth.spec.mjs"])
        .current_dir(root)
        .env("GPULSE_UI_AUTH_URL", &node.http_url)
        .env("GPULSE_UI_TOKEN", &read)
        .env("GPULSE_UI_GPUS", gpus.to_string())
        .output()
        .expect("run node --test");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && report.contains("# pass 1") && report.contains("# skipped 0"),
        "browser test failed:\n{report}\n{}\nnode log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        log_tail(&node.log)
    );
    node.stop();
}
