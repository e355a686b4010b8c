//! Starting and stopping a real `gpulse serve` process.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// `n` free loopback ports for processes that must bind the same port again
/// after a restart (cluster nodes, Prometheus).
///
/// They are picked below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`), where no outgoing connection can take
/// one while its listener is down: a port from `bind(:0)` lies inside that
/// range, and once its node is killed any client socket on the machine may be
/// handed it, after which the restarted node cannot bind it.
pub(crate) fn listen_ports(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768)
        .clamp(2048, 65535);
    let span = low - 1024;
    // Processes running tests at once start at different places; threads of
    // one process take turns through the counter.
    let start = std::process::id().wrapping_mul(7919) % span;
    let mut ports = Vec::new();
    while ports.len() < n {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(k < span, "no free port below {low}");
        let port = (1024 + (start + k) % span) as u16;
        // Bound and closed again: free now, and below the ephemeral range
        // nobody but an explicit bind takes it later.
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            ports.push(port);
        }
    }
    ports
}

/// The last lines of a node's log, for a failure message.
pub(crate) fn log_tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// A `gpulse serve` child process on ephemeral ports.
pub(crate) struct Node {
    child: Child,
    pub(crate) grpc_url: String,
    pub(crate) http_url: String,
    /// `postgres://127.0.0.1:PORT` of the PostgreSQL listener.
    pub(crate) pg_url: String,
    pub(crate) log: PathBuf,
}

impl Node {
    /// Starts `gpulse serve` on `data_dir` and waits for its ready line.
    /// Flushes happen only at shutdown, so a restart test proves the final flush.
    pub(crate) fn start(data_dir: &Path) -> Node {
        Self::start_with(data_dir, "1h")
    }

    /// As [`Self::start`], with the given `--flush-interval`.
    pub(crate) fn start_with(data_dir: &Path, flush_interval: &str) -> Node {
        Self::start_with_args(data_dir, &["--flush-interval", flush_interval])
    }

    /// As [`Self::start`], with more `serve` flags (`--flush-interval`
    /// defaults to 1h here).
    pub(crate) fn start_with_args(data_dir: &Path, extra: &[&str]) -> Node {
        Self::start_command("serve", data_dir, extra)
    }

    /// As [`Self::start_with_args`], for another command that starts a
    /// node (`demo`).
    pub(crate) fn start_command(command: &str, data_dir: &Path, extra: &[&str]) -> Node {
        let log = data_dir.with_extension("log");
        let flush: &[&str] = if extra.contains(&"--flush-interval") {
            &[]
        } else {
            &["--flush-interval", "1h"]
        };
        // A cluster node listens where the cluster file says.
        let listen: &[&str] = if extra.contains(&"--cluster") {
            &[command, "--pg-listen", "127.0.0.1:0"]
        } else {
            &[
                command,
                "--grpc-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--pg-listen",
                "127.0.0.1:0",
            ]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpulse"))
            .args(listen)
            .arg("--data-dir")
            .arg(data_dir)
            .args(flush)
            .args(extra)
            // Some scenarios write timestamps near the epoch (1970); the default
            // retentions (raw 7 d, rollups 30 d to 5 y) would delete them at
            // the first upkeep.
            .args(if extra.contains(&"--retention") {
                &[][..]
            } else {
                &["--retention", "36500d"][..]
            })
            // The rollup tiers likewise, unless the test sets its own.
            .args(
                ["--retention-1m", "--retention-1h", "--retention-1d"]
                    .into_iter()
                    .filter(|flag| !extra.contains(flag))
                    .flat_map(|flag| [flag, "36500d"]),
            )
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .expect("log file"),
            )
            .spawn()
            .unwrap_or_else(|e| panic!("spawn gpulse {command}: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let (mut grpc_url, mut http_url, mut pg_url) = (None, None, None);
        let started = Instant::now();
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("read stdout");
            // grpcs:// and https:// with TLS.
            if let Some(i) = line.find("grpc://").or_else(|| line.find("grpcs://")) {
                grpc_url = Some(line[i..].split_whitespace().next().unwrap().to_string());
            }
            if let Some(i) = line.find("http://").or_else(|| line.find("https://")) {
                http_url = Some(line[i..].split_whitespace().next().unwrap().to_string());
            }
            if let Some(i) = line.find("postgres://") {
                pg_url = Some(line[i..].split_whitespace().next().unwrap().to_string());
            }
            if line.starts_with("gpulse ready") {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "serve did not become ready; {}:\n{}",
                log.display(),
                log_tail(&log)
            );
        }
        Node {
            child,
            grpc_url: grpc_url.unwrap_or_else(|| {
                panic!(
                    "no grpc:// endpoint printed; {}:\n{}",
                    log.display(),
                    log_tail(&log)
                )
            }),
            http_url: http_url.unwrap_or_else(|| {
                panic!(
                    "no http:// endpoint printed; {}:\n{}",
                    log.display(),
                    log_tail(&log)
                )
            }),
            pg_url: pg_url.unwrap_or_else(|| {
                panic!(
                    "no postgres:// endpoint printed; {}:\n{}",
                    log.display(),
                    log_tail(&log)
                )
            }),
            log,
        }
    }

    /// Runs SQL through `POST /api/v1/sql`; returns the JSON rows.
    pub(crate) fn sql(&self, query: &str) -> Vec<Vec<Value>> {
        let (status, body) = self.sql_raw(query);
        assert_eq!(status, 200, "query {query:?} failed: {body}");
        body["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|r| r.as_array().expect("row").clone())
            .collect()
    }

    pub(crate) fn sql_raw(&self, query: &str) -> (u16, Value) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut resp = agent
            .post(&format!("{}/api/v1/sql", self.http_url))
            .header("content-type", "text/plain")
            .send(query.as_bytes())
            .expect("HTTP request");
        let status = resp.status().as_u16();
        let body = resp.body_mut().read_to_string().expect("body");
        (
            status,
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("bad JSON {body:?}: {e}")),
        )
    }

    /// The server's process id (for `/proc` measurements).
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no shutdown code runs.
    pub(crate) fn kill9(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("wait");
    }

    /// Runs SQL and returns the Arrow IPC answer, decoded (exact bits).
    pub(crate) fn sql_arrow(&self, query: &str) -> Vec<arrow::array::RecordBatch> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let mut resp = agent
            .post(&format!("{}/api/v1/sql?format=arrow", self.http_url))
            .header("content-type", "text/plain")
            .send(query.as_bytes())
            .expect("HTTP request");
        if resp.status() != 200 {
            let body = resp.body_mut().read_to_string().unwrap_or_default();
            panic!("query {query:?} failed ({}): {body}", resp.status());
        }
        let body = resp
            .body_mut()
            .with_config()
            .limit(u64::MAX)
            .read_to_vec()
            .expect("body");
        let reader = arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)
            .expect("Arrow IPC");
        reader.collect::<Result<_, _>>().expect("batches")
    }

    /// Sends `signal` (`HUP`, `TERM`, ...) to serve.
    pub(crate) fn signal(&self, signal: &str) {
        let pid = self.child.id().to_string();
        let ok = Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill")
            .success();
        assert!(ok, "kill -{signal} {pid} failed");
    }

    /// SIGTERM, then waits for a clean exit.
    pub(crate) fn stop(mut self) {
        self.signal("TERM");
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                assert!(
                    status.success(),
                    "serve exited with {status}; see {}",
                    self.log.display()
                );
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "serve did not stop; see {}",
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Opens an ingest stream to `grpc_url` whose first message is `first` (a
/// hello, or anything a test wants refused); returns the sender for the rest
/// of the stream and the replies.
pub(crate) async fn open_stream(
    grpc_url: &str,
    first: gpulse_proto::v1::AgentMessage,
) -> (
    tokio::sync::mpsc::Sender<gpulse_proto::v1::AgentMessage>,
    tonic::Streaming<gpulse_proto::v1::IngestReply>,
) {
    let url = grpc_url.replace("grpc://", "http://");
    let mut client = gpulse_proto::v1::ingest_client::IngestClient::connect(url)
        .await
        .expect("connect to ingest");
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tx.send(first).await.expect("queue the first message");
    let replies = client
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("open the stream")
        .into_inner();
    (tx, replies)
}

/// A rollup record folded from raw samples in the test, by the rules the
/// rollup tables document: `min`/`max` ignore NaN unless every value is NaN;
/// `first` is the value at the smallest timestamp and `last` at the largest,
/// ties going to the smaller (first) or larger (last) value in `total_cmp`
/// order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fold {
    pub count: u64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub first: (i64, f64),
    pub last: (i64, f64),
}

impl Fold {
    pub(crate) fn of(ts: i64, v: f64) -> Self {
        Self {
            count: 1,
            sum: v,
            min: v,
            max: v,
            first: (ts, v),
            last: (ts, v),
        }
    }

    pub(crate) fn add(&mut self, ts: i64, v: f64) {
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        if ts
            .cmp(&self.first.0)
            .then(v.total_cmp(&self.first.1))
            .is_lt()
        {
            self.first = (ts, v);
        }
        if ts.cmp(&self.last.0).then(v.total_cmp(&self.last.1)).is_gt() {
            self.last = (ts, v);
        }
    }

    /// Folds `(ts, value)` pairs into windows of `window_ms`, keyed by start.
    pub(crate) fn windows(
        samples: impl IntoIterator<Item = (i64, f64)>,
        window_ms: i64,
    ) -> std::collections::BTreeMap<i64, Fold> {
        let mut out = std::collections::BTreeMap::new();
        for (ts, v) in samples {
            out.entry(ts - ts.rem_euclid(window_ms))
                .and_modify(|f: &mut Fold| f.add(ts, v))
                .or_insert_with(|| Fold::of(ts, v));
        }
        out
    }
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// An HTTP client that hands error statuses back as answers.
pub(crate) fn http() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

/// POSTs `body` to `path` of `node` with `headers`: (status, body). Status
/// 0 when the server closed the connection instead (a body it refuses).
pub(crate) fn post(
    node: &Node,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut req = http().post(&format!("{}{path}", node.http_url));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    match req.send(body) {
        Ok(mut resp) => (
            resp.status().as_u16(),
            resp.body_mut()
                .with_config()
                .limit(64 << 20)
                .read_to_string()
                .unwrap_or_default(),
        ),
        Err(e) => (0, e.to_string()),
    }
}

/// The headers of a Prometheus remote-write request.
pub(crate) const PROTOBUF: &[(&str, &str)] = &[
    ("content-type", "application/x-protobuf"),
    ("content-encoding", "snappy"),
    ("x-prometheus-remote-write-version", "0.1.0"),
];
