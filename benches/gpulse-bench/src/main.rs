//! `gpulse-bench`: the end-to-end load generator and query benchmark, and
//! the report that compares gpulse with its peers (`benches/peers/run.sh`).
//! A binary of its own, so that `gpulse serve` links none of it.
//!
//! * `gpulse-bench ingest` drives simulated agents (or a recorded CSV) over
//!   real gRPC or Prometheus remote-write into a server, and measures the
//!   server from `/proc`: CPU-seconds per million samples, RSS, and bytes on
//!   disk per sample after a flush. Without `--url` it starts `gpulse serve`
//!   (`--gpulse`) over a temporary directory and measures that.
//! * `gpulse-bench query` runs the fixed query set ([`queries`]) as PromQL
//!   and SQL.
//! * `gpulse-bench health` scores the fleet-health detectors against the
//!   simulator's injected faults, in process on a virtual clock ([`health`]).
//! * `gpulse-bench report` turns the JSON lines both write into tables of
//!   ratios, a `docs/BENCHMARKS.md` section and PNG charts.
//!
//! Results are JSON lines (one object per measurement) appended to `--json`.

// A command-line program: printing to stdout is its job.
#![allow(clippy::print_stdout)]

mod fleet;
mod health;
mod load;
mod probe;
mod queries;
mod report;
mod server;

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use agent::cmd::parse_duration;
use load::{LoadConfig, LoadStats, Protocol};
use probe::Probe;

/// Load generator, query benchmark and report for gpulse and its peers.
#[derive(Debug, Parser)]
#[command(name = "gpulse-bench", version)]
pub(crate) struct BenchArgs {
    #[command(subcommand)]
    pub(crate) command: BenchCommand,
    /// The `gpulse` binary to start when no `--url` is given. Default:
    /// `gpulse` beside this binary, else the one on `PATH`.
    #[arg(long, global = true, env = "GPULSE_BIN", value_name = "PATH")]
    pub(crate) gpulse: Option<PathBuf>,
}

fn main() -> std::process::ExitCode {
    let args = BenchArgs::parse();
    agent::cmd::init_logging();
    let run = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")
        .and_then(|rt| rt.block_on(run(args)));
    match run {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// A rate in samples per second, with an optional `k` or `M` suffix.
fn parse_rate(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let (num, mult) = match t.strip_suffix(['k', 'K']) {
        Some(n) => (n, 1e3),
        None => match t.strip_suffix('M') {
            Some(n) => (n, 1e6),
            None => (t, 1.0),
        },
    };
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a rate (e.g. 500k or 1.5M samples/s)"))?;
    if !(v.is_finite() && v > 0.0) {
        return Err("must be greater than zero".into());
    }
    Ok(v * mult)
}

/// The `gpulse` binary to start: `--gpulse`, else `gpulse` beside this
/// binary (as cargo and the release archive put them), else `PATH`'s.
fn gpulse_binary(flag: Option<&std::path::Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    std::env::current_exe()
        .ok()
        .map(|exe| exe.with_file_name("gpulse"))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("gpulse"))
}

#[derive(Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Load a server with a simulated fleet or a recording; measure it.
    Ingest(IngestArgs),
    /// Time the fixed query set (PromQL, and SQL for gpulse).
    Query(QueryArgs),
    /// Turn results (JSON lines) into tables, a Markdown section and charts.
    Report(ReportArgs),
    /// Score the fleet-health detectors against the simulator's injected
    /// faults: per kind recall, precision, time to detect, and false alerts
    /// per healthy GPU-hour (a fault-free run). Runs in process on a virtual
    /// clock; seeds below 1000 are tuning seeds, 1000 and above held out.
    Health(health::HealthArgs),
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ProtocolArg {
    /// gpulse's agent protocol (gRPC stream per host).
    Agent,
    /// Prometheus remote-write 1.0 (snappy protobuf over HTTP).
    RemoteWrite,
}

#[derive(Debug, Args)]
pub(crate) struct IngestArgs {
    /// Server to load: `grpc://host:port` for the agent protocol, the
    /// remote-write URL otherwise. Default: start `gpulse serve` (see
    /// `--gpulse`) on free ports over a temporary data directory.
    #[arg(long)]
    pub(crate) url: Option<String>,
    #[arg(long, value_enum, default_value = "agent")]
    pub(crate) protocol: ProtocolArg,
    /// Simulated GPUs (hosts of 8, 4 hosts a rack, 8 racks a row).
    #[arg(long, default_value_t = 1000)]
    pub(crate) gpus: u32,
    /// Time between two polls of a GPU.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) interval: Duration,
    /// Simulated time to load, ending at `--end-ms`.
    #[arg(long, default_value = "3h", value_parser = parse_duration)]
    pub(crate) span: Duration,
    /// End of the loaded data, Unix ms. Default: now.
    #[arg(long)]
    pub(crate) end_ms: Option<i64>,
    /// Load this long-format CSV (`labels,timestamp_ms,value`, one host per
    /// `source` label) instead of the simulated fleet; each host is shifted
    /// in time to end at `--end-ms`.
    #[arg(long, value_name = "FILE")]
    pub(crate) recorded: Option<PathBuf>,
    /// Polls of one host per request.
    #[arg(long, default_value_t = 5)]
    pub(crate) polls_per_batch: usize,
    /// Batches in flight per agent stream; for remote-write, connections.
    #[arg(long, default_value_t = 4)]
    pub(crate) concurrency: usize,
    /// Samples per second for the whole load (e.g. 500k). Default: as fast
    /// as the server acks.
    #[arg(long, value_parser = parse_rate)]
    pub(crate) rate: Option<f64>,
    /// The server process to measure (CPU, RSS). Default: the started one.
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
    /// URLs POSTed in order after the load, to make the server flush (and
    /// merge) before its disk use is measured. Default for a started
    /// gpulse: its `/api/v1/admin/flush`.
    #[arg(long = "flush-url")]
    pub(crate) flush_urls: Vec<String>,
    /// After the flush URLs, wait until this metric reads 0 on this
    /// Prometheus-format page, e.g. `http://127.0.0.1:8428/metrics#vm_active_force_merges`
    /// (VictoriaMetrics merges in the background after `/internal/force_merge`).
    #[arg(long, value_name = "URL#METRIC")]
    pub(crate) settle_metric: Option<String>,
    /// Directory whose size is the server's disk use after the flush; it is
    /// measured once it stops changing.
    #[arg(long)]
    pub(crate) disk_path: Option<PathBuf>,
    /// Name of the system under test in the results.
    #[arg(long, default_value = "gpulse")]
    pub(crate) system: String,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Append the result to this file as one JSON line.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// A smoke run: 64 GPUs over 30 minutes.
    #[arg(long)]
    pub(crate) quick: bool,
    /// Load a cluster (agent protocol): every host streams to each owner of
    /// its rack in this cluster file, as agents in cluster mode do. `--url`
    /// is then not used, and the acked count includes every replica.
    #[arg(long, value_name = "FILE")]
    pub(crate) cluster: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct QueryArgs {
    /// Base URL of the Prometheus-compatible query API (gpulse's HTTP
    /// listener, VictoriaMetrics, Prometheus). Default: a started gpulse
    /// that is first loaded as `gpulse-bench ingest --quick` would load it.
    #[arg(long)]
    pub(crate) url: Option<String>,
    /// Also run the SQL forms (gpulse only), raw and over rollups.
    #[arg(long)]
    pub(crate) sql: bool,
    /// Skip the PromQL forms.
    #[arg(long)]
    pub(crate) no_promql: bool,
    /// End of the loaded data, Unix ms (what `gpulse-bench ingest --end-ms` got).
    #[arg(long)]
    pub(crate) at_ms: Option<i64>,
    /// Timed runs per query, after one warm-up run.
    #[arg(long, default_value_t = 20)]
    pub(crate) reps: usize,
    #[arg(long, default_value = "gpulse")]
    pub(crate) system: String,
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
    /// Three runs per query.
    #[arg(long)]
    pub(crate) quick: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ReportArgs {
    /// JSON-lines files written by `gpulse-bench ingest` and `gpulse-bench query`.
    #[arg(required = true)]
    pub(crate) results: Vec<PathBuf>,
    /// Replace the section between the `<!-- peers:begin -->` and
    /// `<!-- peers:end -->` markers of this Markdown file.
    #[arg(long)]
    pub(crate) markdown: Option<PathBuf>,
    /// Write PNG charts into this directory.
    #[arg(long)]
    pub(crate) charts: Option<PathBuf>,
    /// Path of the charts as the Markdown file links them.
    #[arg(long, default_value = "bench")]
    pub(crate) charts_link: String,
    /// Free text for the section's header (machine, versions, command).
    #[arg(long)]
    pub(crate) note: Option<String>,
}

/// One ingest measurement (a JSON line).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct IngestResult {
    pub(crate) kind: String,
    pub(crate) system: String,
    pub(crate) protocol: String,
    pub(crate) dataset: String,
    pub(crate) hosts: u64,
    pub(crate) series: u64,
    pub(crate) samples_sent: u64,
    pub(crate) samples_acked: u64,
    pub(crate) samples_dropped: u64,
    pub(crate) samples_rejected: u64,
    pub(crate) requests: u64,
    pub(crate) errors: u64,
    pub(crate) first_error: Option<String>,
    pub(crate) wall_s: f64,
    pub(crate) samples_per_s: f64,
    pub(crate) server_cpu_s: Option<f64>,
    pub(crate) samples_per_core_s: Option<f64>,
    pub(crate) cpu_s_per_million: Option<f64>,
    pub(crate) rss_end_bytes: Option<u64>,
    pub(crate) rss_peak_bytes: Option<u64>,
    pub(crate) rss_per_series: Option<f64>,
    pub(crate) ack_p50_ms: f64,
    pub(crate) ack_p99_ms: f64,
    pub(crate) flush_s: Option<f64>,
    pub(crate) disk_bytes: Option<u64>,
    pub(crate) bytes_per_sample: Option<f64>,
    pub(crate) end_ms: i64,
}

/// One query measurement (a JSON line).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct QueryResult {
    pub(crate) kind: String,
    pub(crate) system: String,
    pub(crate) query: String,
    /// `promql`, `sql` or `sql-rollup`.
    pub(crate) language: String,
    pub(crate) reps: usize,
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    pub(crate) results: Option<u64>,
    pub(crate) error: Option<String>,
}

async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let gpulse = gpulse_binary(args.gpulse.as_deref());
    match args.command {
        BenchCommand::Ingest(a) => {
            let json = a.json.clone();
            let r = ingest(a, &gpulse).await?;
            print_ingest(&r);
            if let Some(path) = json {
                append_json(&path, &r)?;
            }
            if r.samples_acked < r.samples_sent {
                bail!(
                    "{} of {} samples were not acked (first error: {})",
                    r.samples_sent - r.samples_acked,
                    r.samples_sent,
                    r.first_error.as_deref().unwrap_or("none")
                );
            }
            Ok(())
        }
        BenchCommand::Query(a) => query(a, &gpulse).await,
        BenchCommand::Report(a) => tokio::task::spawn_blocking(move || report::run(&a)).await?,
        BenchCommand::Health(a) => tokio::task::spawn_blocking(move || health::run(&a)).await?,
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn append_json(path: &std::path::Path, value: &impl Serialize) -> anyhow::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{}", serde_json::to_string(value)?)
        .with_context(|| format!("writing {}", path.display()))
}

async fn ingest(mut a: IngestArgs, gpulse: &std::path::Path) -> anyhow::Result<IngestResult> {
    if a.quick {
        a.gpus = 64;
        a.span = Duration::from_secs(1800);
    }
    let protocol = match a.protocol {
        ProtocolArg::Agent => Protocol::Agent,
        ProtocolArg::RemoteWrite => Protocol::RemoteWrite,
    };
    if a.cluster.is_some() {
        if protocol != Protocol::Agent {
            bail!(
                "--cluster loads over the agent protocol; for remote write, give --url of any node"
            );
        }
        let url = String::from("(cluster)");
        let probe = a.server_pid.map(|pid| Probe { pid });
        return ingest_into(
            &a,
            protocol,
            &url,
            probe,
            &a.flush_urls,
            a.disk_path.clone(),
        )
        .await;
    }
    let started = match &a.url {
        Some(_) => None,
        None => Some(server::Spawned::start(gpulse).await?),
    };
    let url = match (&a.url, &started) {
        (Some(u), _) => u.clone(),
        (None, Some(s)) => match protocol {
            Protocol::Agent => format!("grpc://{}", s.grpc_addr),
            Protocol::RemoteWrite => format!("http://{}/api/v1/write", s.http_addr),
        },
        (None, None) => unreachable!("a server is started when no URL is given"),
    };
    let probe = a
        .server_pid
        .or(started.as_ref().map(|s| s.pid))
        .map(|pid| Probe { pid });
    let flush_urls = match (&started, a.flush_urls.is_empty()) {
        (Some(s), true) => vec![format!("http://{}/api/v1/admin/flush", s.http_addr)],
        _ => a.flush_urls.clone(),
    };
    let disk_path = a
        .disk_path
        .clone()
        .or(started.as_ref().map(|s| s.data_dir().to_path_buf()));
    let r = ingest_into(&a, protocol, &url, probe, &flush_urls, disk_path).await;
    if let Some(s) = started {
        s.stop().await;
    }
    r
}

async fn ingest_into(
    a: &IngestArgs,
    protocol: Protocol,
    url: &str,
    probe: Option<Probe>,
    flush_urls: &[String],
    disk_path: Option<PathBuf>,
) -> anyhow::Result<IngestResult> {
    let end_ms = a.end_ms.unwrap_or_else(now_ms);
    let make_feeds = || async {
        anyhow::Ok(match &a.recorded {
            Some(path) => {
                let p = path.clone();
                let feeds =
                    tokio::task::spawn_blocking(move || fleet::recorded(&p, end_ms)).await??;
                (feeds, "recorded".to_string())
            }
            None => {
                let interval_ms = a.interval.as_millis().max(1) as i64;
                let polls = (a.span.as_millis() as i64 / interval_ms).max(1) as u64;
                let sim = fleet::SimFleet {
                    gpus: a.gpus.max(1),
                    interval_ms,
                    polls,
                    end_ms,
                    seed: a.seed,
                };
                (sim.feeds(), "simulated".to_string())
            }
        })
    };
    let (mut feeds, dataset) = make_feeds().await?;
    let hosts = feeds.len() as u64;
    // A cluster: one copy of every host per replica, each to its owner.
    let mut targets = None;
    if let Some(file) = &a.cluster {
        let map = cluster::ShardMap::load(file)?;
        let mut urls = Vec::new();
        let mut all = Vec::new();
        for rank in 0..map.replication_factor() {
            let copy = if rank == 0 {
                std::mem::take(&mut feeds)
            } else {
                make_feeds().await?.0
            };
            for f in copy {
                let h = f.host();
                let key = cluster::ShardKey::of(&h.rack, &h.name);
                let owner = map.owners_at(&key, end_ms)[rank];
                urls.push(format!("grpc://{}", map.nodes()[owner].grpc));
                all.push(f);
            }
        }
        feeds = all;
        targets = Some(urls);
    }
    let polls: u64 = feeds.iter().map(|f| f.polls_left()).sum();
    eprintln!(
        "bench: loading {hosts} hosts ({polls} polls, {dataset}) into {url} over {}",
        protocol.name()
    );
    let config = LoadConfig {
        url: url.to_string(),
        protocol,
        polls_per_batch: a.polls_per_batch.max(1),
        concurrency: a.concurrency.max(1),
        rate: a.rate,
        targets,
    };
    let stats = Arc::new(LoadStats::default());
    let cpu0 = probe.and_then(|p| p.cpu_seconds());
    let t0 = Instant::now();
    let progress = tokio::spawn(progress(stats.clone(), probe));
    let series = load::run(&config, feeds, stats.clone()).await;
    progress.abort();
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu_s = match (cpu0, probe.and_then(|p| p.cpu_seconds())) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let series = series?;
    let rss = probe.and_then(|p| p.rss_bytes());
    let acked = stats.samples_acked.load(Relaxed);

    let mut flush_s = None;
    if !flush_urls.is_empty() {
        let t = Instant::now();
        for u in flush_urls {
            eprintln!("bench: flushing: POST {u}");
            post_empty(u).await?;
        }
        if let Some(s) = &a.settle_metric {
            settle(s).await?;
        }
        flush_s = Some(t.elapsed().as_secs_f64());
    }
    let disk_bytes = match disk_path {
        Some(p) => Some(tokio::task::spawn_blocking(move || steady_dir_bytes(&p)).await??),
        None => None,
    };
    let mut lat: Vec<f64> = stats
        .latencies_us
        .lock()
        .expect("BUG: latency lock poisoned")
        .iter()
        .map(|&us| f64::from(us) / 1000.0)
        .collect();
    lat.sort_by(f64::total_cmp);
    let per = |x: f64| (acked > 0).then(|| x / acked as f64);
    Ok(IngestResult {
        kind: "ingest".into(),
        system: a.system.clone(),
        protocol: protocol.name().into(),
        dataset,
        hosts,
        series,
        samples_sent: stats.samples_sent.load(Relaxed),
        samples_acked: acked,
        samples_dropped: stats.samples_dropped.load(Relaxed),
        samples_rejected: stats.samples_rejected.load(Relaxed),
        requests: stats.requests.load(Relaxed),
        errors: stats.errors.load(Relaxed),
        first_error: stats
            .first_error
            .lock()
            .expect("BUG: error lock poisoned")
            .clone(),
        wall_s,
        samples_per_s: acked as f64 / wall_s,
        server_cpu_s: cpu_s,
        samples_per_core_s: cpu_s.filter(|&c| c > 0.0).map(|c| acked as f64 / c),
        cpu_s_per_million: cpu_s.and_then(|c| per(c * 1e6)),
        rss_end_bytes: rss.map(|r| r.0),
        rss_peak_bytes: rss.map(|r| r.1),
        rss_per_series: rss
            .filter(|_| series > 0)
            .map(|r| r.0 as f64 / series as f64),
        ack_p50_ms: queries::percentile(&lat, 0.5),
        ack_p99_ms: queries::percentile(&lat, 0.99),
        flush_s,
        disk_bytes,
        bytes_per_sample: disk_bytes.and_then(|d| per(d as f64)),
        end_ms,
    })
}

/// A progress line on stderr every 2 s while the load runs.
async fn progress(stats: Arc<LoadStats>, probe: Option<Probe>) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    tick.tick().await;
    let (mut last_acked, mut last_cpu, mut last_t) =
        (0u64, probe.and_then(|p| p.cpu_seconds()), Instant::now());
    loop {
        tick.tick().await;
        let acked = stats.samples_acked.load(Relaxed);
        let dt = last_t.elapsed().as_secs_f64();
        let cpu = probe.and_then(|p| p.cpu_seconds());
        let server = match (probe, last_cpu, cpu) {
            (Some(p), Some(c0), Some(c1)) => {
                let rss = p.rss_bytes().map_or(0, |r| r.0) >> 20;
                format!(", server {:.2} cores, RSS {rss} MiB", (c1 - c0) / dt)
            }
            _ => String::new(),
        };
        eprintln!(
            "bench: {:.1} M samples acked, {:.2} M/s{server}, {} errors",
            acked as f64 / 1e6,
            (acked - last_acked) as f64 / dt / 1e6,
            stats.errors.load(Relaxed)
        );
        (last_acked, last_cpu, last_t) = (acked, cpu, Instant::now());
    }
}

/// Polls `URL#METRIC` until the metric reads 0 (at most 10 minutes).
async fn settle(spec: &str) -> anyhow::Result<()> {
    let Some((url, metric)) = spec.rsplit_once('#') else {
        bail!("--settle-metric {spec:?}: expected URL#METRIC");
    };
    let (url, metric) = (url.to_string(), metric.to_string());
    // The merge a flush URL started may not have registered yet.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (u, m) = (url.clone(), metric.clone());
        let value = tokio::task::spawn_blocking(move || -> anyhow::Result<Option<f64>> {
            let mut resp = queries::http_agent()
                .get(&u)
                .call()
                .with_context(|| format!("GET {u}"))?;
            let text = resp
                .body_mut()
                .with_config()
                .limit(64 << 20)
                .read_to_string()?;
            Ok(metric_value(&text, &m))
        })
        .await??;
        match value {
            Some(0.0) => return Ok(()),
            None => bail!("{url} has no metric {metric}"),
            Some(v) if Instant::now() > deadline => {
                bail!("{metric} still {v} after 10 minutes")
            }
            Some(v) => {
                eprintln!("bench: waiting for {metric} = {v} to reach 0");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

/// The value of an unlabelled sample of `name` in Prometheus text format.
fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = rest.strip_prefix(' ')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The size of `path` once it has not changed for 5 s (at most two minutes):
/// servers merge in the background after a flush and delete merged files a
/// little after writing new ones (VictoriaMetrics's sizes varied by a third
/// between runs with a 1-second wait).
fn steady_dir_bytes(path: &std::path::Path) -> anyhow::Result<u64> {
    let measure =
        || probe::dir_bytes(path).with_context(|| format!("measuring {}", path.display()));
    let mut last = measure()?;
    let mut unchanged = 0;
    for _ in 0..120 {
        std::thread::sleep(Duration::from_secs(1));
        let now = measure()?;
        unchanged = if now == last { unchanged + 1 } else { 0 };
        last = now;
        if unchanged >= 5 {
            break;
        }
    }
    Ok(last)
}

async fn post_empty(url: &str) -> anyhow::Result<()> {
    let url = url.to_string();
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let agent = queries::http_agent();
        let mut resp = agent
            .post(&url)
            .send_empty()
            .with_context(|| format!("POST {url}"))?;
        let status = resp.status();
        let body = resp.body_mut().read_to_string().unwrap_or_default();
        if !status.is_success() {
            bail!("POST {url}: HTTP {status}: {}", body.trim());
        }
        Ok(())
    })
    .await?
}

fn print_ingest(r: &IngestResult) {
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or_else(|| "-".into(), f);
    println!(
        "system            {} ({}, {} data)",
        r.system, r.protocol, r.dataset
    );
    println!("hosts / series    {} / {}", r.hosts, r.series);
    println!(
        "samples acked     {} of {} ({} dropped by the server, {} rejected, {} errors)",
        r.samples_acked, r.samples_sent, r.samples_dropped, r.samples_rejected, r.errors
    );
    println!(
        "throughput        {:.0} samples/s over {:.1} s",
        r.samples_per_s, r.wall_s
    );
    println!(
        "per server core   {} samples/s, {} CPU-s per million samples",
        opt(r.samples_per_core_s, &|v| format!("{v:.0}")),
        opt(r.cpu_s_per_million, &|v| format!("{v:.3}"))
    );
    println!(
        "server RSS        {} MiB at the end, {} MiB peak, {} B per series",
        opt(r.rss_end_bytes.map(|b| b as f64), &|v| format!(
            "{:.0}",
            v / 1048576.0
        )),
        opt(r.rss_peak_bytes.map(|b| b as f64), &|v| format!(
            "{:.0}",
            v / 1048576.0
        )),
        opt(r.rss_per_series, &|v| format!("{v:.0}"))
    );
    println!(
        "ack latency       p50 {:.2} ms, p99 {:.2} ms",
        r.ack_p50_ms, r.ack_p99_ms
    );
    println!(
        "on disk           {} bytes, {} B/sample (after a flush of {} s)",
        opt(r.disk_bytes.map(|b| b as f64), &|v| format!("{v:.0}")),
        opt(r.bytes_per_sample, &|v| format!("{v:.3}")),
        opt(r.flush_s, &|v| format!("{v:.1}"))
    );
}

async fn query(a: QueryArgs, gpulse: &std::path::Path) -> anyhow::Result<()> {
    let reps = if a.quick { 3 } else { a.reps };
    // Without a URL: a started gpulse, loaded as `gpulse-bench ingest --quick` loads it.
    let (started, base, at_ms) = match &a.url {
        Some(u) => (None, u.clone(), a.at_ms.unwrap_or_else(now_ms)),
        None => {
            let s = server::Spawned::start(gpulse).await?;
            let end_ms = a.at_ms.unwrap_or_else(now_ms);
            let feeds = fleet::SimFleet {
                gpus: 64,
                interval_ms: 10_000,
                polls: 180,
                end_ms,
                seed: 1,
            }
            .feeds();
            let stats = Arc::new(LoadStats::default());
            let config = LoadConfig {
                url: format!("grpc://{}", s.grpc_addr),
                protocol: Protocol::Agent,
                polls_per_batch: 5,
                concurrency: 4,
                rate: None,
                targets: None,
            };
            load::run(&config, feeds, stats.clone()).await?;
            post_empty(&format!("http://{}/api/v1/admin/flush", s.http_addr)).await?;
            let base = format!("http://{}", s.http_addr);
            (Some(s), base, end_ms)
        }
    };
    let anchor = queries::Anchor {
        at_ms,
        host: fleet::host_name(0),
        gpu: "0".into(),
        rack: fleet::rack_name(0),
    };
    let (system, json, sql, promql) = (a.system.clone(), a.json.clone(), a.sql, !a.no_promql);
    let results = tokio::task::spawn_blocking(move || {
        let agent = queries::http_agent();
        let mut out = Vec::new();
        for q in queries::query_set(&anchor) {
            eprintln!("bench: {}: {}", q.name, q.what);
            let mut forms = Vec::new();
            if promql {
                forms.push((
                    "promql",
                    queries::Request::PromQl {
                        base: base.clone(),
                        query: q.promql.clone(),
                    },
                ));
            }
            if sql && let Some(raw) = &q.sql_raw {
                forms.push((
                    "sql",
                    queries::Request::Sql {
                        base: base.clone(),
                        query: raw.clone(),
                    },
                ));
            }
            if sql && let Some(r) = &q.sql_rollup {
                forms.push((
                    "sql-rollup",
                    queries::Request::Sql {
                        base: base.clone(),
                        query: r.clone(),
                    },
                ));
            }
            for (language, req) in forms {
                let t = queries::time(&agent, &req, reps);
                let r = QueryResult {
                    kind: "query".into(),
                    system: system.clone(),
                    query: q.name.into(),
                    language: language.into(),
                    reps,
                    p50_ms: t.as_ref().ok().map(|t| t.p50_ms),
                    p99_ms: t.as_ref().ok().map(|t| t.p99_ms),
                    results: t.as_ref().ok().map(|t| t.results),
                    error: t.as_ref().err().map(|e| format!("{e:#}")),
                };
                match &r.error {
                    None => println!(
                        "{:<20} {:<10} {:<10} p50 {:>9.2} ms  p99 {:>9.2} ms  {} results",
                        r.query,
                        r.language,
                        r.system,
                        r.p50_ms.unwrap_or(f64::NAN),
                        r.p99_ms.unwrap_or(f64::NAN),
                        r.results.unwrap_or(0)
                    ),
                    Some(e) => println!(
                        "{:<20} {:<10} {:<10} failed: {e}",
                        r.query, r.language, r.system
                    ),
                }
                out.push(r);
            }
        }
        out
    })
    .await?;
    if let Some(s) = started {
        s.stop().await;
    }
    if let Some(path) = &json {
        for r in &results {
            append_json(path, r)?;
        }
    }
    // (Results are written even when some queries failed: a peer may not
    // support one, and the report shows which.)
    let failed: Vec<&QueryResult> = results.iter().filter(|r| r.error.is_some()).collect();
    if !failed.is_empty() {
        bail!(
            "{} of {} queries failed; the first: {} ({}): {}",
            failed.len(),
            results.len(),
            failed[0].query,
            failed[0].language,
            failed[0].error.as_deref().unwrap_or("")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_take_k_and_m_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_rate("500k"), Ok(500_000.0));
        assert_eq!(parse_rate("1.5M"), Ok(1_500_000.0));
        assert_eq!(parse_rate(" 20 "), Ok(20.0));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-3k").is_err());
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("NaN").is_err());
    }

    #[test]
    fn metric_values_are_read_from_the_text_format() {
        let text = "# HELP vm_active_force_merges x\nvm_active_force_merges_total 9\nvm_active_force_merges 2\n";
        assert_eq!(metric_value(text, "vm_active_force_merges"), Some(2.0));
        assert_eq!(metric_value(text, "vm_other"), None);
    }
}
