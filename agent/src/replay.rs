//! Replays a recorded long-format CSV (the format of `gpulse import`, see
//! [`long_csv`]) as if a node were sampling it: `gpulse agent --replay FILE`.
//!
//! [`ReplaySource::open`] reads the file once to build the inventory (one
//! GPU per distinct `gpu` label, with `UUID`, `modelName`, `pci_bus_id` and
//! `DCGM_FI_DRIVER_VERSION` from the labels; the to_long_csv.py names
//! `uuid`, `gpu_model`, `host` are accepted too) and to count what it will
//! skip; [`run`] then streams it a second time, one poll per distinct
//! timestamp, so memory does not grow with the file.
//!
//! - A poll is a run of consecutive rows with the same `timestamp_ms` (all
//!   GPUs of a host share a poll's timestamp in dcgm and in the recordings
//!   in `shared/data/real`). Rows should be in time order, as `to_long_csv.py`
//!   and `sim_csv` write them; a timestamp that goes back starts a new poll
//!   and is sent as it is.
//! - Metrics are matched by their dcgm-exporter name ([`Metric::name`]) or by
//!   the to_long_csv.py column names of the real recordings (`power_w`,
//!   `temp_c`, ... see [`ALIASES`]; same units). Other metrics are skipped,
//!   counted, and named once in a log line at open.
//! - A file with rows from several hosts needs [`ReplayConfig::host`]: one
//!   agent is one host.
//!
//! # Timestamps
//! By default ([`ReplayTimestamps::Shift`]) every timestamp is shifted by
//! the same offset so that the first poll is "now"; the spacing is kept. The
//! recorded timestamps ([`ReplayTimestamps::Recorded`]) are kept only on
//! request, because storage drops them in the common cases:
//! a sample at or before a series' newest timestamp is a duplicate (first
//! write wins) or, more than `--ooo-window` (10 min) behind it, too old
//! (`storage::head`); so replaying a file a second time, or into a node that
//! already has newer samples of the same GPUs, stores nothing. `--retention`
//! deletes segments older than the retention by the wall clock, so last
//! month's recording vanishes at the next flush; and queries of the form
//! `ts > now() - INTERVAL ...` never see it. Keep recorded timestamps to
//! score detection against a recording's own times, into a fresh data dir.
//! At `max` speed, shifted timestamps run ahead of the wall clock by up to
//! the length of the recording.
//!
//! # The hook into the agent
//! The agent's sampling loop (`crate::run`) stamps each poll with the wall
//! clock and paces polls by `--interval`. A replay brings both its own
//! timestamps and its own pacing, so [`run`] is a copy of `crate::run` whose
//! sampling thread asks the source for the next timestamp
//! ([`ReplaySource::next_timestamp_ms`]), sleeps until it is due, and never
//! drops a poll (it waits for the shipper instead). Folding it into
//! `crate::run` takes one default method on `GpuSource`
//! (`fn next_timestamp_ms(&mut self) -> Option<Option<i64>> { None }`, where
//! `Some(None)` means "exhausted") and a branch in `sample_loop`.

pub mod long_csv;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::future::Future;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::catalog::Metric;
use crate::source::{GpuInfo, GpuSource, Reading, SourceError};
use crate::{AgentConfig, AgentError, AgentMetrics, AgentReport, Poll};

/// Column names of `shared/data/real/to_long_csv.py` that are catalog
/// metrics in the catalog's unit (see the README there for the DCGM field of
/// each). Its other columns (NVLink rates in bytes/s, `mem_total_mib`) have
/// no catalog metric.
pub const ALIASES: [(&str, Metric); 13] = [
    ("sm_active", Metric::SmActive),
    ("fp16_active", Metric::PipeFp16Active),
    ("throttle_reasons", Metric::ClockThrottleReasons),
    ("power_w", Metric::PowerUsage),
    ("temp_c", Metric::GpuTemp),
    ("mem_used_mib", Metric::FbUsed),
    ("gpu_util_pct", Metric::GpuUtil),
    ("mem_util_pct", Metric::MemCopyUtil),
    ("tensor_active", Metric::PipeTensorActive),
    ("dram_active", Metric::DramActive),
    ("pcie_tx_bytes_s", Metric::PcieTxBytes),
    ("pcie_rx_bytes_s", Metric::PcieRxBytes),
    ("energy_mj", Metric::TotalEnergyConsumption),
];

/// Bad rows logged one by one at open; the rest are only counted.
const MAX_LOGGED_BAD_ROWS: u64 = 5;

/// What to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayConfig {
    pub path: PathBuf,
    /// Keep only rows whose `Hostname` (or `hostname`, `host`) label is
    /// this. Required when the file has rows of several hosts. Default: none.
    pub host: Option<String>,
}

impl ReplayConfig {
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            host: None,
        }
    }
}

/// How fast polls are sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReplaySpeed {
    /// As fast as the shipper takes them.
    Max,
    /// The recorded spacing divided by this factor (1.0: recorded speed).
    Scaled(f64),
}

/// Which timestamps polls carry. See the module docs for the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReplayTimestamps {
    /// Shifted so that the first poll is the wall-clock time it is sent.
    #[default]
    Shift,
    /// As recorded.
    Recorded,
}

/// Why a replay could not start (or stopped).
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("opening {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: csv::Error },
    #[error("{path}: {source}")]
    Header {
        path: PathBuf,
        source: long_csv::RowError,
    },
    #[error(
        "{path} has rows of {} hosts ({}); replay one at a time with a host filter",
        hosts.len(),
        hosts.iter().cloned().collect::<Vec<_>>().join(", ")
    )]
    SeveralHosts {
        path: PathBuf,
        hosts: BTreeSet<String>,
    },
    #[error("{path} has no rows of a GPU with a catalog metric{}", host.as_ref().map(|h| format!(" for host {h:?}")).unwrap_or_default())]
    NoGpus { path: PathBuf, host: Option<String> },
}

/// Counts of a replay, for the summary line and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayStats {
    /// Data rows in the file.
    pub rows: u64,
    /// Rows turned into readings.
    pub readings: u64,
    /// Polls (distinct consecutive timestamps) with at least one reading.
    pub polls: u64,
    /// Rows skipped: the metric is not in the catalog, by metric name.
    pub unknown_metrics: BTreeMap<String, u64>,
    /// Rows skipped: no `gpu` label, or one that is not an integer.
    pub no_gpu: u64,
    /// Rows skipped: another host than [`ReplayConfig::host`].
    pub other_host: u64,
    /// Rows skipped: unparsable (bad field count, timestamp, value or labels).
    pub bad_rows: u64,
    /// Readings skipped: their (shifted) timestamp is before 1970, which
    /// every gpulse node refuses (`storage::admission`).
    pub too_old: u64,
    /// Readings skipped (recorded timestamps only): more than
    /// [`ReplayOptions::max_future`] ahead of the clock when due. Shifted
    /// timestamps are never skipped: the replay waits instead.
    pub too_far_in_future: u64,
}

impl ReplayStats {
    /// Rows skipped because their metric is not in the catalog.
    pub fn unknown_metric_rows(&self) -> u64 {
        self.unknown_metrics.values().sum()
    }
}

/// What a labels field maps to: a reading of GPU (inventory position) and metric, or a reason to skip.
#[derive(Debug, Clone)]
enum Key {
    Reading(u32, Metric),
    Unknown(String),
    NoGpu,
    OtherHost,
}

/// A recorded CSV as a [`GpuSource`]. See the module docs.
#[derive(Debug)]
pub struct ReplaySource {
    path: PathBuf,
    /// The host the replayed rows belong to, if they name one.
    host: Option<String>,
    inventory: Vec<GpuInfo>,
    /// Labels field -> what it maps to; filled at open, so pass two never parses labels.
    keys: HashMap<String, Key>,
    reader: csv::Reader<BufReader<File>>,
    record: csv::StringRecord,
    /// The first reading of the next poll, read ahead to find the poll's end.
    ahead: Option<(i64, Reading)>,
    done: bool,
    /// Counts of pass two (what was actually replayed).
    stats: ReplayStats,
    /// A read error that ended pass two early.
    error: Option<String>,
}

fn open_reader(path: &Path) -> Result<csv::Reader<BufReader<File>>, ReplayError> {
    let f = File::open(path).map_err(|source| ReplayError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    let mut r = long_csv::reader(BufReader::with_capacity(1 << 16, f));
    let header = r.headers().map_err(|source| ReplayError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    long_csv::check_header(header).map_err(|source| ReplayError::Header {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(r)
}

fn host_of<'a>(l: &long_csv::Labels<'a>) -> Option<&'a str> {
    l.get("Hostname")
        .or_else(|| l.get("hostname"))
        .or_else(|| l.get("host"))
}

fn metric_by_name(names: &HashMap<&'static str, Metric>, name: &str) -> Option<Metric> {
    names.get(name).copied().or_else(|| {
        ALIASES
            .iter()
            .find(|(alias, _)| *alias == name)
            .map(|(_, m)| *m)
    })
}

impl ReplaySource {
    /// Reads `config.path` once for the inventory and the skip counts, and
    /// positions the source at the first poll.
    ///
    /// # Errors
    /// The file cannot be read, has the wrong header, has several hosts and
    /// no host filter, or has no GPU reading at all.
    pub fn open(config: &ReplayConfig) -> Result<Self, ReplayError> {
        let path = config.path.clone();
        let names: HashMap<&'static str, Metric> =
            Metric::ALL.iter().map(|m| (m.name(), *m)).collect();
        let mut reader = open_reader(&path)?;
        let mut record = csv::StringRecord::new();
        // Labels field -> (host, gpu index, GpuInfo, metric), before positions are known.
        type Parsed = Result<(Option<String>, u32, GpuInfo, Result<Metric, String>), ()>;
        let mut parsed: HashMap<String, Parsed> = HashMap::new();
        let mut hosts = BTreeSet::new();
        let mut scan = ReplayStats::default();
        let wanted = |host: &Option<String>| {
            config
                .host
                .as_ref()
                .is_none_or(|want| host.as_deref() == Some(want.as_str()))
        };
        loop {
            let line = reader.position().line();
            match reader.read_record(&mut record) {
                Ok(false) => break,
                Ok(true) => {}
                Err(e) if matches!(e.kind(), csv::ErrorKind::Io(_)) => {
                    return Err(ReplayError::Read { path, source: e });
                }
                Err(e) => {
                    scan.rows += 1;
                    scan.bad_rows += 1;
                    if scan.bad_rows <= MAX_LOGGED_BAD_ROWS {
                        warn!(path = %path.display(), line, error = %e, "replay: unreadable row skipped");
                    }
                    continue;
                }
            }
            scan.rows += 1;
            let row = match long_csv::parse_row(&record) {
                Ok(r) => r,
                Err(e) => {
                    scan.bad_rows += 1;
                    if scan.bad_rows <= MAX_LOGGED_BAD_ROWS {
                        warn!(path = %path.display(), line, error = %e, "replay: bad row skipped");
                    }
                    continue;
                }
            };
            if !parsed.contains_key(row.labels) {
                let p: Parsed = match long_csv::parse_labels(row.labels) {
                    Err(e) => {
                        if scan.bad_rows < MAX_LOGGED_BAD_ROWS {
                            warn!(path = %path.display(), line, error = %e, "replay: bad row skipped");
                        }
                        Err(())
                    }
                    Ok(l) => match l.get("gpu").and_then(|g| g.parse::<u32>().ok()) {
                        None => Ok((None, u32::MAX, GpuInfo::default(), Err(String::new()))),
                        Some(index) => {
                            let info = GpuInfo {
                                index,
                                uuid: l.get("UUID").or_else(|| l.get("uuid")).unwrap_or("").into(),
                                pci_bus_id: l.get("pci_bus_id").unwrap_or("").into(),
                                model_name: l
                                    .get("modelName")
                                    .or_else(|| l.get("gpu_model"))
                                    .unwrap_or("")
                                    .into(),
                                driver_version: l
                                    .get("DCGM_FI_DRIVER_VERSION")
                                    .unwrap_or("")
                                    .into(),
                                ..GpuInfo::default()
                            };
                            let metric =
                                metric_by_name(&names, l.metric).ok_or(l.metric.to_string());
                            Ok((host_of(&l).map(str::to_string), index, info, metric))
                        }
                    },
                };
                parsed.insert(row.labels.to_string(), p);
            }
            match &parsed[row.labels] {
                Err(()) => scan.bad_rows += 1,
                Ok((_, u32::MAX, _, _)) => scan.no_gpu += 1,
                Ok((host, _, _, metric)) if wanted(host) => {
                    if let Some(h) = host {
                        hosts.insert(h.clone());
                    }
                    if let Err(name) = metric {
                        *scan.unknown_metrics.entry(name.clone()).or_default() += 1;
                    }
                }
                Ok(_) => scan.other_host += 1,
            }
        }
        if config.host.is_none() && hosts.len() > 1 {
            return Err(ReplayError::SeveralHosts { path, hosts });
        }

        // Inventory: the GPUs with at least one catalog metric, by GPU index.
        let mut gpus: BTreeMap<u32, GpuInfo> = BTreeMap::new();
        for (host, index, info, metric) in parsed.values().flatten() {
            if *index != u32::MAX && metric.is_ok() && wanted(host) {
                let e = gpus.entry(*index).or_insert_with(|| info.clone());
                // Fill what one series carried and another did not.
                for (have, got) in [
                    (&mut e.uuid, &info.uuid),
                    (&mut e.pci_bus_id, &info.pci_bus_id),
                    (&mut e.model_name, &info.model_name),
                    (&mut e.driver_version, &info.driver_version),
                ] {
                    if have.is_empty() {
                        have.clone_from(got);
                    }
                }
            }
        }
        if gpus.is_empty() {
            return Err(ReplayError::NoGpus {
                path,
                host: config.host.clone(),
            });
        }
        let position: HashMap<u32, u32> = gpus
            .keys()
            .enumerate()
            .map(|(pos, index)| (*index, pos as u32))
            .collect();
        let inventory: Vec<GpuInfo> = gpus.into_values().collect();
        let keys: HashMap<String, Key> = parsed
            .into_iter()
            .filter_map(|(labels, p)| {
                let key = match p.ok()? {
                    (_, u32::MAX, ..) => Key::NoGpu,
                    (host, ..) if !wanted(&host) => Key::OtherHost,
                    (_, _, _, Err(name)) => Key::Unknown(name),
                    (_, index, _, Ok(m)) => Key::Reading(position[&index], m),
                };
                Some((labels, key))
            })
            .collect();

        if !scan.unknown_metrics.is_empty() {
            let names: Vec<&str> = scan.unknown_metrics.keys().map(String::as_str).collect();
            warn!(path = %path.display(), rows = scan.unknown_metric_rows(), metrics = %names.join(","), "replay: skipping metrics that are not in the catalog");
        }
        info!(path = %path.display(), rows = scan.rows, gpus = inventory.len(), bad_rows = scan.bad_rows, rows_without_gpu = scan.no_gpu, rows_of_other_hosts = scan.other_host, "replay file scanned");

        Ok(Self {
            reader: open_reader(&path)?,
            path,
            host: config.host.clone().or_else(|| hosts.into_iter().next()),
            inventory,
            keys,
            record,
            ahead: None,
            done: false,
            stats: ReplayStats::default(),
            error: None,
        })
    }

    /// The timestamp of the poll the next [`GpuSource::sample`] returns, as
    /// recorded; `None` once the file is exhausted (or a read error ended it,
    /// see [`Self::error`]).
    pub fn next_timestamp_ms(&mut self) -> Option<i64> {
        if self.ahead.is_none() && !self.done {
            self.ahead = self.read_reading();
            self.done = self.ahead.is_none();
        }
        self.ahead.map(|(ts, _)| ts)
    }

    /// The host of the replayed rows (their `Hostname` or `host` label), if any.
    pub fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// What has been replayed so far.
    pub fn stats(&self) -> &ReplayStats {
        &self.stats
    }

    /// The read error that ended the replay early, if any.
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// The next row that is a reading; counts the rows it skips.
    fn read_reading(&mut self) -> Option<(i64, Reading)> {
        loop {
            match self.reader.read_record(&mut self.record) {
                Ok(false) => return None,
                Ok(true) => {}
                Err(e) if matches!(e.kind(), csv::ErrorKind::Io(_)) => {
                    warn!(path = %self.path.display(), error = %e, "replay: read failed; stopping");
                    self.error = Some(format!("reading {}: {e}", self.path.display()));
                    return None;
                }
                Err(_) => {
                    self.stats.rows += 1;
                    self.stats.bad_rows += 1;
                    continue;
                }
            }
            self.stats.rows += 1;
            let Ok(row) = long_csv::parse_row(&self.record) else {
                self.stats.bad_rows += 1;
                continue;
            };
            match self.keys.get(row.labels) {
                Some(Key::Reading(gpu, metric)) => {
                    self.stats.readings += 1;
                    return Some((row.ts_ms, Reading::new(*gpu, *metric, row.value)));
                }
                Some(Key::Unknown(name)) => {
                    if let Some(n) = self.stats.unknown_metrics.get_mut(name) {
                        *n += 1;
                    } else {
                        self.stats.unknown_metrics.insert(name.clone(), 1);
                    }
                }
                Some(Key::NoGpu) => self.stats.no_gpu += 1,
                Some(Key::OtherHost) => self.stats.other_host += 1,
                // Labels that did not parse at open (or a file that changed since).
                None => self.stats.bad_rows += 1,
            }
        }
    }
}

impl GpuSource for ReplaySource {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.inventory
    }

    /// Appends the next poll's readings (nothing once the file is exhausted).
    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        let Some(ts) = self.next_timestamp_ms() else {
            return Ok(());
        };
        let (_, first) = self
            .ahead
            .take()
            .expect("BUG: next_timestamp_ms read ahead");
        out.push(first);
        loop {
            match self.read_reading() {
                Some((t, r)) if t == ts => out.push(r),
                Some(next) => {
                    self.ahead = Some(next);
                    break;
                }
                None => {
                    self.done = true;
                    break;
                }
            }
        }
        self.stats.polls += 1;
        Ok(())
    }
}

/// How a replay is paced and stamped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplayOptions {
    pub speed: ReplaySpeed,
    pub timestamps: ReplayTimestamps,
    /// The admission window's future bound of the nodes (`serve
    /// --max-future`, default [`DEFAULT_MAX_FUTURE`]). A shifted poll is
    /// never sent further ahead of the clock than this (at `max` speed the
    /// replay waits); a recorded one that is is skipped and counted, as is
    /// any poll stamped before 1970: the node would reject its batch.
    pub max_future: Duration,
}

/// The nodes' default `--max-future`: 10 minutes.
pub const DEFAULT_MAX_FUTURE: Duration = Duration::from_secs(600);

/// What a replay run did.
#[derive(Debug, Clone, Default)]
pub struct ReplayReport {
    pub agent: AgentReport,
    pub stats: ReplayStats,
    /// A read error that ended the replay before the end of the file.
    pub error: Option<String>,
}

/// Streams `source` to ingest like [`crate::run`], with the recorded
/// timestamps (shifted per `options`) and pacing, until the file is
/// exhausted (or `config.max_polls` are sent) and every poll is acked, or
/// until `shutdown` resolves. `config.interval` is not used. Unlike the live
/// agent it never drops a poll: when the queue to the shipper is full, it
/// waits.
///
/// # Errors
/// An invalid ingest URL. Network errors are retried, never returned.
pub async fn run(
    config: AgentConfig,
    source: ReplaySource,
    options: ReplayOptions,
    metrics: Arc<AgentMetrics>,
    shutdown: impl Future<Output = ()>,
) -> Result<ReplayReport, AgentError> {
    let inventory = source.inventory().to_vec();
    info!(speed = ?options.speed, timestamps = ?options.timestamps, "replaying");
    let max_polls = config.max_polls;
    let (agent, source) = crate::drive(
        config,
        inventory,
        "replay",
        metrics,
        shutdown,
        move |tx, stop, counters| {
            std::thread::Builder::new()
                .name("gpulse-replay".into())
                .spawn(move || replay_loop(source, tx, options, max_polls, &stop, &counters.polls))
        },
    )
    .await?;
    let report = ReplayReport {
        agent,
        stats: source.stats().clone(),
        error: source.error().map(str::to_string),
    };
    info!(stats = ?report.stats, "replay stopped");
    Ok(report)
}

/// Logs the first skipped poll, then every 1000th.
fn warn_skipped(ts_ms: i64, readings: usize) {
    static SKIPPED: AtomicU64 = AtomicU64::new(0);
    let n = SKIPPED.fetch_add(1, Relaxed);
    if n.is_multiple_of(1000) {
        warn!(
            ts_ms,
            readings,
            skipped_polls = n + 1,
            "replay: poll outside the nodes' time window (before 1970, or past --max-future) skipped"
        );
    }
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Sends one poll per recorded timestamp, paced by `options.speed`, until
/// the file ends, `max_polls` are sent, `stop` is set or the shipper is
/// gone. Returns the source for its counts.
fn replay_loop(
    mut source: ReplaySource,
    tx: mpsc::Sender<Poll>,
    options: ReplayOptions,
    max_polls: Option<u64>,
    stop: &AtomicBool,
    polls: &AtomicU64,
) -> ReplaySource {
    // (first recorded timestamp, when it was sent, timestamp shift)
    let mut origin: Option<(i64, Instant, i64)> = None;
    while !stop.load(Relaxed) && max_polls.is_none_or(|m| polls.load(Relaxed) < m) {
        let Some(ts) = source.next_timestamp_ms() else {
            break;
        };
        let (t0, sent0, shift) = *origin.get_or_insert_with(|| {
            let shift = match options.timestamps {
                ReplayTimestamps::Shift => now_ms() - ts,
                ReplayTimestamps::Recorded => 0,
            };
            (ts, Instant::now(), shift)
        });
        if let ReplaySpeed::Scaled(factor) = options.speed {
            // Due relative to the first poll, so sleeps do not accumulate drift;
            // a timestamp that goes back is due at once.
            let offset_s = (ts - t0).max(0) as f64 / 1000.0 / factor;
            let due = sent0 + Duration::from_secs_f64(offset_s.min(1e9));
            while !stop.load(Relaxed) {
                let now = Instant::now();
                if now >= due {
                    break;
                }
                // Short steps keep shutdown prompt across long recorded gaps.
                std::thread::sleep((due - now).min(Duration::from_millis(100)));
            }
            if stop.load(Relaxed) {
                break;
            }
        }
        let stamped = ts.saturating_add(shift);
        let ahead_ms = i64::try_from(options.max_future.as_millis()).unwrap_or(i64::MAX);
        if options.timestamps == ReplayTimestamps::Shift {
            // At `max` speed shifted stamps run ahead of the clock: wait
            // until the node's window admits this one.
            while !stop.load(Relaxed) && stamped.saturating_sub(ahead_ms) > now_ms() {
                let wait = (stamped.saturating_sub(ahead_ms) - now_ms()).clamp(1, 100);
                std::thread::sleep(Duration::from_millis(wait as u64));
            }
            if stop.load(Relaxed) {
                break;
            }
        }
        let mut readings = Vec::with_capacity(source.inventory().len() * Metric::ALL.len());
        source
            .sample(&mut readings)
            .expect("BUG: the replay source does not fail");
        let skipped = if stamped < 0 {
            Some(&mut source.stats.too_old)
        } else if stamped.saturating_sub(ahead_ms) > now_ms() {
            Some(&mut source.stats.too_far_in_future)
        } else {
            None
        };
        if let Some(count) = skipped {
            *count += readings.len() as u64;
            warn_skipped(stamped, readings.len());
            continue;
        }
        polls.fetch_add(1, Relaxed);
        let poll = Poll {
            ts_ms: stamped,
            readings,
        };
        if tx.blocking_send(poll).is_err() {
            break;
        }
    }
    source
}

#[cfg(test)]
mod tests;
