//! `gpulse-bench`: the load generator delivers the whole simulated fleet over
//! both protocols (the same samples either way), measures the server, and
//! the query set and report run over what it loaded.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::support::Node;

/// The `gpulse-bench` binary of the same build as `gpulse`: another package
/// of the workspace, so cargo builds it for `cargo test --workspace` (its own
/// tests need it) but not for `cargo test --test e2e`; then it is built here.
fn bench_binary() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let exe = Path::new(env!("CARGO_BIN_EXE_gpulse")).with_file_name("gpulse-bench");
            if !exe.is_file() {
                let status = Command::new(env!("CARGO"))
                    .args(["build", "-p", "gpulse-bench", "--bin", "gpulse-bench"])
                    .status()
                    .expect("run cargo build -p gpulse-bench");
                assert!(status.success(), "cargo build -p gpulse-bench failed");
            }
            assert!(exe.is_file(), "{} was not built", exe.display());
            exe
        })
        .clone()
}

fn bench(args: &[&str]) -> String {
    let out = Command::new(bench_binary())
        .args(args)
        .env("GPULSE_BIN", env!("CARGO_BIN_EXE_gpulse"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run gpulse-bench");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gpulse-bench {args:?} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn json_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (metric, host, gpu) -> (count, sum of values) as the node stores them.
fn per_series(node: &Node) -> BTreeMap<(String, String, String), (i64, f64)> {
    node.sql(
        "SELECT metric, host, gpu, count(*), sum(value) FROM samples \
         WHERE metric NOT LIKE 'gpulse_health%' GROUP BY metric, host, gpu",
    )
    .into_iter()
    .map(|r| {
        (
            (
                r[0].as_str().unwrap().to_string(),
                r[1].as_str().unwrap().to_string(),
                r[2].as_str().unwrap().to_string(),
            ),
            (r[3].as_i64().unwrap(), r[4].as_f64().unwrap()),
        )
    })
    .collect()
}

#[test]
fn both_protocols_deliver_the_same_fleet_and_the_report_compares_them() {
    let dir = tempfile::tempdir().unwrap();
    let (dir_a, dir_b) = (dir.path().join("a"), dir.path().join("b"));
    let (a, b) = (Node::start(&dir_a), Node::start(&dir_b));
    let results = dir.path().join("results.jsonl");
    // A recent end on a 10 s grid; 20 GPUs are 3 hosts (8 + 8 + 4).
    let end_ms = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
        / 10_000)
        * 10_000;
    let end = end_ms.to_string();
    let common = [
        "--gpus",
        "20",
        "--span",
        "10m",
        "--interval",
        "10s",
        "--end-ms",
        &end,
    ];
    for (node, protocol, url, data_dir) in [
        (&a, "agent", a.grpc_url.clone(), &dir_a),
        (
            &b,
            "remote-write",
            format!("{}/api/v1/write", b.http_url),
            &dir_b,
        ),
    ] {
        let pid = node.pid().to_string();
        let flush = format!("{}/api/v1/admin/flush", node.http_url);
        let mut args = vec![
            "ingest",
            "--protocol",
            protocol,
            "--url",
            &url,
            "--server-pid",
            &pid,
            "--flush-url",
            &flush,
            "--disk-path",
            data_dir.to_str().unwrap(),
            "--json",
            results.to_str().unwrap(),
        ];
        args.extend(common);
        let out = bench(&args);
        assert!(out.contains("samples acked"), "{out}");
    }

    // What the nodes stored, counted by the nodes: every series holds the 60
    // polls of 10 minutes at 10 s, inside the span, on both nodes alike.
    let (sa, sb) = (per_series(&a), per_series(&b));
    assert!(!sa.is_empty());
    assert!(sa.values().all(|&(n, _)| n == 60), "{sa:?}");
    assert_eq!(sa.len(), sb.len(), "the same series over both protocols");
    for (k, (n, sum)) in &sa {
        let (m, s) = sb
            .get(k)
            .unwrap_or_else(|| panic!("{k:?} missing over remote-write"));
        assert_eq!(n, m, "{k:?}");
        assert!(
            (sum - s).abs() <= 1e-9 * sum.abs().max(1.0),
            "{k:?}: {sum} vs {s}"
        );
    }
    let hosts = a.sql(
        "SELECT count(DISTINCT host), count(DISTINCT host || gpu), min(ts), max(ts) FROM samples \
         WHERE metric NOT LIKE 'gpulse_health%'",
    );
    assert_eq!(hosts[0][0], 3);
    assert_eq!(hosts[0][1], 20);
    let stored: i64 = sa.values().map(|v| v.0).sum();

    // The measurements agree with what the nodes hold.
    let lines = json_lines(&results);
    assert_eq!(lines.len(), 2);
    for (r, data_dir) in lines.iter().zip([&dir_a, &dir_b]) {
        assert_eq!(r["samples_acked"].as_i64(), Some(stored), "{r}");
        assert_eq!(r["samples_sent"], r["samples_acked"], "{r}");
        assert_eq!(r["errors"], 0, "{r}");
        assert_eq!(r["series"].as_u64(), Some(sa.len() as u64), "{r}");
        assert_eq!(r["hosts"], 3);
        let disk = r["disk_bytes"].as_f64().unwrap();
        assert!(disk > 0.0 && disk <= dir_size(data_dir) as f64 * 1.5, "{r}");
        let bps = r["bytes_per_sample"].as_f64().unwrap();
        assert!((bps - disk / stored as f64).abs() < 1e-9, "{r}");
        assert!(r["cpu_s_per_million"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["rss_peak_bytes"].as_u64().unwrap() >= r["rss_end_bytes"].as_u64().unwrap());
        assert!(r["ack_p99_ms"].as_f64().unwrap() >= r["ack_p50_ms"].as_f64().unwrap());
    }
    b.stop();

    // The query set over A: every form answers, and the answers are the
    // fleet's shape (10 hottest GPUs, 1 rack, 3 hosts).
    let at = end.clone();
    bench(&[
        "query",
        "--url",
        &a.http_url,
        "--sql",
        "--at-ms",
        &at,
        "--reps",
        "2",
        "--json",
        results.to_str().unwrap(),
    ]);
    let lines = json_lines(&results);
    let queries: Vec<&Value> = lines.iter().filter(|l| l["kind"] == "query").collect();
    assert_eq!(queries.len(), 6 + 5 + 3, "PromQL, SQL and SQL over rollups");
    let results_of = |q: &str, lang: &str| {
        queries
            .iter()
            .find(|l| l["query"] == q && l["language"] == lang)
            .and_then(|l| l["results"].as_u64())
    };
    assert!(queries.iter().all(|l| l["error"].is_null()), "{queries:?}");
    assert_eq!(results_of("top10_hottest", "promql"), Some(10));
    assert_eq!(results_of("top10_hottest", "sql"), Some(10));
    assert_eq!(results_of("rack_util_1h", "promql"), Some(1));
    assert_eq!(results_of("rack_util_1h", "sql"), Some(1));
    assert_eq!(results_of("host_energy_rate_6h", "promql"), Some(3));
    // The dashboard's eight panels: six with a series per GPU (temperature,
    // power, SM clock, utilisation, framebuffer, tensor activity), the
    // average temperature and the power total with one each.
    assert_eq!(results_of("dashboard_6h", "promql"), Some(6 * 20 + 2));

    let md = dir.path().join("B.md");
    let out = bench(&[
        "report",
        results.to_str().unwrap(),
        "--markdown",
        md.to_str().unwrap(),
    ]);
    assert!(out.contains("### Ingest, simulated data"), "{out}");
    let text = std::fs::read_to_string(&md).unwrap();
    assert!(text.contains("| gpulse | remote-write |"), "{text}");
    assert!(text.contains("<!-- peers:end -->"));
    a.stop();
}

fn dir_size(path: &Path) -> u64 {
    let mut total = 0;
    for e in std::fs::read_dir(path).unwrap() {
        let e = e.unwrap();
        let m = e.metadata().unwrap();
        total += if m.is_dir() {
            dir_size(&e.path())
        } else {
            m.len()
        };
    }
    total
}
