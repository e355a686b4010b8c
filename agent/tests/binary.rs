//! The `gpulse-agent` binary end to end: the real executable, real gRPC on
//! loopback to a real `ingest::serve` over a real `storage::Storage` in a
//! temp dir. The oracle is the agent's own `--record` file (every sample it
//! produced), read here without the agent's code: storage must hold exactly
//! those samples, bit for bit.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use agent::replay::{ReplayConfig, ReplaySource};
use agent::source::GpuSource;
use ingest::{IngestConfig, IngestService};
use storage::{Matcher, Storage, StorageConfig};
use tokio::net::TcpListener;

const BIN: &str = env!("CARGO_BIN_EXE_gpulse-agent");

/// (metric and sorted labels, timestamp) -> value bits; without the four
/// labels ingest attaches from the stream's hello (Hostname, cluster, row,
/// rack), which the record does not carry.
type Samples = BTreeMap<(String, i64), u64>;

fn name(metric: &str, mut labels: Vec<(String, String)>) -> String {
    labels.retain(|(k, v)| {
        !v.is_empty() && !matches!(k.as_str(), "Hostname" | "cluster" | "row" | "rack")
    });
    labels.sort();
    labels
        .into_iter()
        .fold(metric.to_owned(), |s, (k, v)| format!("{s};{k}={v}"))
}

/// The record: a CSV with the header `labels,timestamp_ms,value`, then
/// `metric=NAME;label=value;...,timestamp_ms,value` per sample.
fn recorded(path: &Path) -> Samples {
    let mut out = Samples::new();
    let mut csv = csv::Reader::from_path(path).unwrap();
    assert_eq!(
        csv.headers().unwrap(),
        vec!["labels", "timestamp_ms", "value"]
    );
    for row in csv.records() {
        let row = row.unwrap();
        let value: f64 = row[2].parse().unwrap();
        let ts: i64 = row[1].parse().unwrap();
        let (mut metric, mut labels) = (String::new(), Vec::new());
        for kv in row[0].split(';') {
            let (k, v) = kv.split_once('=').unwrap();
            if k == "metric" {
                metric = v.to_owned();
            } else {
                labels.push((k.to_owned(), v.to_owned()));
            }
        }
        // Storage keeps the first sample of a series at a timestamp.
        out.entry((name(&metric, labels), ts))
            .or_insert(value.to_bits());
    }
    out
}

fn stored(storage: &Storage, host: &str) -> Samples {
    let mut out = Samples::new();
    for s in storage.select(&[Matcher::equal("Hostname", host)], i64::MIN, i64::MAX) {
        let labels = s
            .key
            .labels()
            .iter()
            .map(|l| (l.name.to_string(), l.value.to_string()))
            .collect();
        let n = name(s.key.metric(), labels);
        let (mut ts, mut values) = (Vec::new(), Vec::new());
        s.read_into(i64::MIN, i64::MAX, &mut ts, &mut values)
            .unwrap();
        for (t, v) in ts.into_iter().zip(values) {
            out.insert((n.clone(), t), v.to_bits());
        }
    }
    out
}

#[test]
fn help_and_version() {
    let help = Command::new(BIN).arg("--help").output().unwrap();
    assert!(help.status.success());
    let text = String::from_utf8(help.stdout).unwrap();
    for flag in [
        "--ingest",
        "--spool-dir",
        "--config",
        "--sharded",
        "--replay",
    ] {
        assert!(text.contains(flag), "--help lists {flag}:\n{text}");
    }
    let version = Command::new(BIN).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8(version.stdout).unwrap().trim(),
        format!("gpulse-agent {}", env!("CARGO_PKG_VERSION"))
    );
    // A bad flag value is a usage error, not a run.
    let bad = Command::new(BIN)
        .args(["--interval", "0s"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// Settings from the TOML file (`--config`), a flag winning over the file,
/// and every produced sample stored exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_every_sample_to_ingest() {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(StorageConfig::new(dir.path().join("data"))).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = IngestService::new(storage.clone(), IngestConfig::default());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(ingest::serve(listener, service, async {
        let _ = stopped.await;
    }));

    let record = dir.path().join("record.csv");
    let config = dir.path().join("agent.toml");
    std::fs::write(
        &config,
        format!(
            "ingest = \"grpc://{addr}\"\nhost = \"node-from-file\"\nrack = \"rack-file\"\ngpus = 2\ninterval = \"5s\"\n"
        ),
    )
    .unwrap();
    let out = tokio::task::spawn_blocking({
        let (record, config) = (record.clone(), config.clone());
        move || {
            Command::new(BIN)
                .arg("--config")
                .arg(&config)
                .args(["--simulate", "--polls", "3", "--interval", "50ms"])
                .args(["--no-spool", "--metrics-listen", "off"])
                .arg("--record")
                .arg(&record)
                .env("RUST_LOG", "warn")
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "gpulse-agent failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    let want = recorded(&record);
    let got = stored(&storage, "node-from-file");
    assert!(!want.is_empty());
    assert_eq!(got.len(), want.len(), "as many samples stored as produced");
    let diff = got.iter().zip(&want).find(|(g, w)| g != w);
    assert!(
        diff.is_none(),
        "first difference (stored, produced): {diff:?}"
    );
    // The file's rack reached ingest (through the stream's hello).
    let racks: std::collections::BTreeSet<String> = storage
        .select(
            &[Matcher::equal("Hostname", "node-from-file")],
            i64::MIN,
            i64::MAX,
        )
        .iter()
        .map(|s| s.key.get("rack").unwrap_or_default().to_owned())
        .collect();
    assert_eq!(racks, ["rack-file".to_owned()].into());
    // Three polls (the flag beat the file's 5 s interval: it ran in well
    // under the test's time) of two GPUs, labelled from the file.
    let times: std::collections::BTreeSet<i64> = want.keys().map(|(_, t)| *t).collect();
    assert_eq!(times.len(), 3);
    let gpus: std::collections::BTreeSet<&str> = want
        .keys()
        .filter_map(|(n, _)| n.split(';').find_map(|kv| kv.strip_prefix("gpu=")))
        .collect();
    assert_eq!(gpus, ["0", "1"].into());
    // The record is a file --replay takes: the same GPUs and polls.
    let mut replay = ReplaySource::open(&ReplayConfig::new(&record)).unwrap();
    assert_eq!(replay.inventory().len(), 2);
    let mut polls = 0;
    while replay.next_timestamp_ms().is_some() {
        let mut r = Vec::new();
        replay.sample(&mut r).unwrap();
        assert!(!r.is_empty());
        polls += 1;
    }
    assert_eq!(polls, 3);

    stop.send(()).unwrap();
    server.await.unwrap().unwrap();
}
