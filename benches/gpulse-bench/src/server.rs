//! A `gpulse serve` child process for benchmarks that bring their own
//! server: on free loopback ports, over a temporary directory.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail};

#[derive(Debug)]
pub(crate) struct Spawned {
    child: Child,
    pub(crate) pid: u32,
    pub(crate) grpc_addr: SocketAddr,
    pub(crate) http_addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Spawned {
    /// Starts the server and waits for its `gpulse ready` line.
    pub(crate) async fn start(gpulse: &Path) -> anyhow::Result<Self> {
        let gpulse = gpulse.to_path_buf();
        tokio::task::spawn_blocking(move || Self::start_blocking(&gpulse)).await?
    }

    fn start_blocking(gpulse: &Path) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("gpulse-bench-")
            .tempdir()
            .context("creating a temporary data directory")?;
        let mut child = Command::new(gpulse)
            .args([
                "serve",
                "--grpc-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(["--pg-listen", "off", "--data-dir"])
            .arg(dir.path())
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!(
                    "starting {} serve (give the gpulse binary with --gpulse or GPULSE_BIN)",
                    gpulse.display()
                )
            })?;
        let pid = child.id();
        let stdout = child.stdout.take().expect("BUG: stdout is piped");
        let (mut grpc, mut http) = (None, None);
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading the server's output")?;
            let addr = |prefix: &str| -> Option<SocketAddr> {
                let rest = line.split_once(prefix)?.1;
                rest.split_whitespace().next()?.parse().ok()
            };
            grpc = grpc.or(addr("grpc://"));
            if line.contains("query (HTTP)") {
                http = http.or(addr("http://"));
            }
            if line.starts_with("gpulse ready") {
                break;
            }
        }
        let (Some(grpc_addr), Some(http_addr)) = (grpc, http) else {
            let status = child.wait().ok();
            bail!("gpulse serve did not start (exit status {status:?}); see its log above");
        };
        Ok(Self {
            child,
            pid,
            grpc_addr,
            http_addr,
            dir,
        })
    }

    pub(crate) fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// SIGTERM (a graceful stop with a final flush), then SIGKILL after 60 s.
    pub(crate) async fn stop(mut self) {
        let pid = self.pid.to_string();
        let _ = tokio::task::spawn_blocking(move || {
            let _ = Command::new("kill").args(["-TERM", &pid]).status();
            for _ in 0..600 {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        })
        .await;
    }
}
