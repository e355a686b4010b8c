//! gpulse node agent: samples a node's GPUs and streams the samples to ingest.
//!
//! Data flow: a [`GpuSource`] (NVML, or the simulated fleet) is polled every
//! `interval` on a dedicated thread, so that sampling never waits on the
//! network; polls go through a bounded queue to the shipper, which batches
//! them into the outbox (memory, then a disk spool) and streams them over
//! gRPC (`gpulse.v1.Ingest/Stream`), keeping each batch until ingest acks it.
//! See `shipper.rs` for the delivery guarantees and [`spool`] for the spool.
//!
//! In cluster mode ([`AgentConfig::sharded`], `gpulse agent --sharded`) the
//! agent asks a node which nodes own its shard and runs one shipper per
//! owner, each with its own outbox and spool: see `cluster.rs`.

pub mod catalog;
mod cluster;
pub mod cmd;
pub mod metrics;
pub mod nvml;
mod outbox;
pub mod replay;
mod shipper;
pub use shipper::ClientTls;
pub mod sim;
pub mod source;
pub mod spool;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

pub use metrics::{AgentMetrics, OwnerMetrics};
pub use outbox::BufferConfig;
pub use shipper::ShipperStats;
pub use source::{GpuInfo, GpuSource, Reading, SourceError};

/// Where a host sits in the fleet; attached once per stream by ingest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Topology {
    pub cluster: String,
    pub row: String,
    pub rack: String,
}

/// Configuration of one agent.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Ingest endpoint: `grpc://host:port` or `http://host:port`. In cluster
    /// mode, one or more seed nodes, comma-separated.
    pub ingest_url: String,
    /// Cluster mode: ask a seed node (`Owners`) which nodes own this host's
    /// shard, and deliver every batch to each of them, with one outbox and
    /// spool (`<spool_dir>/<node id>/`) per owner. Default off: everything
    /// goes to `ingest_url`.
    pub sharded: bool,
    /// Stable agent identity. Default: the host name.
    pub agent_id: String,
    /// Host name, stored as the `Hostname` label. Default: the OS host name.
    pub host: String,
    pub topology: Topology,
    /// Time between polls. Default 1 s.
    pub interval: Duration,
    /// Stop after this many polls (tests, load generators); `None` runs until shutdown.
    pub max_polls: Option<u64>,
    /// Polls queued between sampler and shipper before the sampler drops. Default 600.
    pub queue_polls: usize,
    /// Most batches sent and not yet acked. Default 256.
    pub max_in_flight: usize,
    /// Largest batch when a backlog is coalesced, in samples. Default 16,384.
    pub max_batch_samples: usize,
    /// First reconnect wait; doubles up to `reconnect_max`. Default 100 ms.
    pub reconnect_min: Duration,
    /// Longest reconnect wait. Default 10 s.
    pub reconnect_max: Duration,
    /// How long shutdown waits for outstanding acks. Default 5 s.
    pub drain_timeout: Duration,
    /// Memory buffer and disk spool for unacked batches.
    pub buffer: BufferConfig,
    /// Appends every sample the agent produces to this file, in the long CSV
    /// format of `gpulse import` (a trace to replay, or ground truth for a test).
    pub record: Option<PathBuf>,
    /// `--token-file`: the bearer token (write scope) sent with every call,
    /// for nodes started with `--auth-file`.
    pub token: Option<String>,
    /// `--tls-ca` and friends: TLS (and mTLS) to the node.
    pub tls: Option<shipper::ClientTls>,
}

impl AgentConfig {
    pub fn new(ingest_url: impl Into<String>) -> Self {
        let host = gethostname::gethostname().to_string_lossy().into_owned();
        Self {
            ingest_url: ingest_url.into(),
            sharded: false,
            agent_id: host.clone(),
            host,
            topology: Topology::default(),
            interval: Duration::from_secs(1),
            max_polls: None,
            queue_polls: 600,
            max_in_flight: 256,
            max_batch_samples: 16_384,
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(5),
            buffer: BufferConfig::default(),
            record: None,
            token: None,
            tls: None,
        }
    }
}

/// `request` with `authorization: Bearer <token>` when there is a token.
pub(crate) fn authorized<T>(request: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(request);
    if let Some(value) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// One poll of every GPU of the node.
#[derive(Debug, Clone)]
pub struct Poll {
    pub ts_ms: i64,
    pub readings: Vec<Reading>,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid ingest URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("cluster mode needs at least one seed node URL (comma-separated), got {0:?}")]
    NoSeeds(String),
    #[error("the sampling thread panicked")]
    SamplerPanicked,
    #[error("spool: {0}")]
    Spool(std::io::Error),
    #[error("cannot open the sample record {0}: {1}")]
    Record(PathBuf, std::io::Error),
}

/// What an agent run did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentReport {
    pub polls: u64,
    /// Polls dropped because the queue to the shipper was full.
    pub polls_dropped: u64,
    /// Polls whose source call failed as a whole.
    pub poll_errors: u64,
    pub shipper: ShipperStats,
}

/// Runs an agent until `max_polls` polls are delivered or `shutdown`
/// resolves; on shutdown it waits up to `drain_timeout` for outstanding acks.
///
/// # Errors
/// An invalid URL. Network errors are retried, never returned.
pub async fn run(
    config: AgentConfig,
    source: Box<dyn GpuSource>,
    shutdown: impl Future<Output = ()>,
) -> Result<AgentReport, AgentError> {
    run_with_metrics(config, source, Arc::default(), shutdown).await
}

/// [`run`], counting into `metrics` (which the caller may serve on `/metrics`).
///
/// # Errors
/// An invalid URL, or a spool or record file that cannot be opened.
pub async fn run_with_metrics(
    config: AgentConfig,
    source: Box<dyn GpuSource>,
    metrics: Arc<AgentMetrics>,
    shutdown: impl Future<Output = ()>,
) -> Result<AgentReport, AgentError> {
    let inventory = source.inventory().to_vec();
    let name = source.name();
    let (interval, max_polls) = (config.interval, config.max_polls);
    let (report, ()) = drive(
        config,
        inventory,
        name,
        metrics,
        shutdown,
        move |tx, stop, counters| {
            std::thread::Builder::new()
                .name("gpulse-sampler".into())
                .spawn(move || {
                    let sleep = std::thread::sleep;
                    sample_loop(source, tx, interval, max_polls, &stop, &counters, sleep)
                })
        },
    )
    .await?;
    Ok(report)
}

/// Runs the shipper against polls from a thread that `spawn` starts (given
/// the queue, a stop flag and the counters), until the thread's input is
/// done and everything is acked, or until `shutdown`. Returns the report and
/// what the thread returned.
pub(crate) async fn drive<T: Send + 'static>(
    config: AgentConfig,
    inventory: Vec<GpuInfo>,
    name: &'static str,
    metrics: Arc<AgentMetrics>,
    shutdown: impl Future<Output = ()>,
    spawn: impl FnOnce(
        mpsc::Sender<Poll>,
        Arc<AtomicBool>,
        Arc<AgentMetrics>,
    ) -> std::io::Result<std::thread::JoinHandle<T>>,
) -> Result<(AgentReport, T), AgentError> {
    // Opens the spool first: a spool in use fails the start, not later.
    let delivery = if config.sharded {
        Delivery::Sharded(cluster::Coordinator::new(
            config.clone(),
            inventory.clone(),
            name,
            metrics.clone(),
        )?)
    } else {
        shipper::endpoint(&config.ingest_url)?;
        Delivery::Single(shipper::Shipper::new(
            config.clone(),
            inventory.clone(),
            name,
            metrics.clone(),
        )?)
    };
    info!(source = name, gpus = inventory.len(), host = %config.host, interval_ms = config.interval.as_millis() as u64, url = %config.ingest_url, sharded = config.sharded, "agent starting");

    let (tx, rx) = mpsc::channel::<Poll>(config.queue_polls.max(1));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler =
        spawn(tx, stop.clone(), metrics.clone()).expect("BUG: cannot spawn the sampling thread");

    let (stop_tx, stop_rx) = watch::channel(false);
    let ship = async move {
        match delivery {
            Delivery::Single(shipper) => shipper.run(rx, stop_rx).await,
            Delivery::Sharded(coordinator) => coordinator.run(rx, stop_rx).await,
        }
    };
    tokio::pin!(ship);
    tokio::pin!(shutdown);
    let stats = tokio::select! {
        r = &mut ship => r,
        _ = &mut shutdown => {
            stop.store(true, Relaxed);
            let _ = stop_tx.send(true);
            ship.await
        }
    };
    stop.store(true, Relaxed);
    let joined = tokio::task::spawn_blocking(move || sampler.join()).await;
    let Ok(Ok(out)) = joined else {
        return Err(AgentError::SamplerPanicked);
    };
    let report = AgentReport {
        polls: metrics.polls.load(Relaxed),
        polls_dropped: metrics.polls_dropped.load(Relaxed),
        poll_errors: metrics.poll_errors.load(Relaxed),
        shipper: stats?,
    };
    info!(?report, "agent stopped");
    Ok((report, out))
}

/// Where the polls go: one ingest, or every owner of the host's shard.
enum Delivery {
    Single(shipper::Shipper),
    Sharded(cluster::Coordinator),
}

/// Polls `source` on a fixed schedule (`start + k * interval`), never
/// blocking on the queue: a full queue drops the poll and counts it. Waits
/// for the next tick with `sleep` (`std::thread::sleep`; tests oversleep).
fn sample_loop(
    mut source: Box<dyn GpuSource>,
    tx: mpsc::Sender<Poll>,
    interval: Duration,
    max_polls: Option<u64>,
    stop: &AtomicBool,
    counters: &AgentMetrics,
    mut sleep: impl FnMut(Duration),
) {
    let start = Instant::now();
    let mut k: u32 = 0;
    let mut last_ts_ms = i64::MIN;
    let mut last_drop_log = Instant::now() - Duration::from_secs(60);
    while !stop.load(Relaxed) && max_polls.is_none_or(|m| counters.polls.load(Relaxed) < m) {
        let due = start + interval * k;
        let now = Instant::now();
        if due > now {
            // Sleep in short steps so that shutdown is prompt at long intervals.
            sleep((due - now).min(Duration::from_millis(100)));
            continue;
        }
        k += 1;
        // Never two polls in one millisecond: each series would get two
        // values at one timestamp, and storage keeps only the first. A tick
        // can fall within a millisecond of a late one, however they are
        // scheduled, so wait for the clock to move on (under a millisecond).
        let mut ts_ms = wall_clock_ms();
        while ts_ms == last_ts_ms {
            std::thread::sleep(Duration::from_micros(100));
            ts_ms = wall_clock_ms();
        }
        last_ts_ms = ts_ms;
        let mut readings =
            Vec::with_capacity(source.inventory().len() * catalog::Metric::ALL.len());
        let began = Instant::now();
        let sampled = source.sample(&mut readings);
        let took = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
        counters.poll_nanos.fetch_add(took, Relaxed);
        counters.nvml_errors.store(source.errors(), Relaxed);
        if let Err(e) = sampled {
            counters.poll_errors.fetch_add(1, Relaxed);
            warn!(error = %e, "sampling failed");
            continue;
        }
        counters.polls.fetch_add(1, Relaxed);
        counters.samples.fetch_add(readings.len() as u64, Relaxed);
        match tx.try_send(Poll { ts_ms, readings }) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                let n = counters.polls_dropped.fetch_add(1, Relaxed) + 1;
                if last_drop_log.elapsed() >= Duration::from_secs(10) {
                    last_drop_log = Instant::now();
                    warn!(dropped_total = n, "send queue full; dropping polls");
                }
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
        // After a stall (suspended process, slow NVML, a late wake-up), skip
        // the missed ticks instead of sampling in a burst.
        k = next_tick(k, start.elapsed(), interval);
    }
}

/// The tick to poll after a poll that ended `elapsed` after the start: `k`,
/// unless it is already due (the poll was more than an interval late), then
/// the first tick still ahead.
fn next_tick(k: u32, elapsed: Duration, interval: Duration) -> u32 {
    let due = elapsed.as_nanos() / interval.as_nanos().max(1);
    k.max(u32::try_from(due + 1).unwrap_or(u32::MAX))
}

fn wall_clock_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
