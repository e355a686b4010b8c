//! [`Storage`]: the head plus the sealed segments of one data directory.
//!
//! Write path: [`Storage::series_ref`] once per series, then
//! [`Storage::append`] per batch into the head. [`Storage::flush`] seals the
//! head into a new segment. Read path: [`Storage::select`] returns, per matching
//! series, handles to every chunk overlapping the time range, in time order.
//!
//! Durability: [`Storage::series_ref`] and [`Storage::append`] write to the
//! WAL ([`crate::wal`]) before they touch the head, and return only when the
//! WAL write is done under the configured [`SyncPolicy`]. [`Storage::open`]
//! replays the WAL into the head. A flush cuts the WAL and, once the new
//! segment file is durable, deletes the WAL before the cut.
//!
//! Locks are always taken in the order `gate` -> `state` -> `head`. Appends
//! hold `gate` shared from their WAL write to their head append, and a flush
//! holds it exclusively while it freezes the head and cuts the WAL; so every
//! sample in the head at a freeze is in the WAL before the cut, and every
//! sample after it is in the WAL after the cut. A query sees every sample
//! exactly once, whether a flush is running or not.
//!
//! Rollups ([`crate::rollup`]): a flush folds the chunks it froze into
//! 1-minute records and writes them to a rollup file *before* the segment, and
//! [`Storage::select_rollups`] merges rollup files with what it folds from a
//! flush in progress and the head, under the same `state` -> `head` locks as
//! [`Storage::select`]. A chunk whose samples a rollup file already counts
//! is marked [`MemChunk::rolled`](crate::head::MemChunk::rolled) and folded
//! by neither.
//!
//! The methods of [`Storage`] live in child modules, one job each: `open`
//! (and `replay`, the WAL replay at open), `append`, `flush` (with
//! `set_aside` for data a writer refuses and `write` for putting a new file
//! into place), `compact`, `retention`, `upkeep`, `select` and `import`.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};

use crate::files;
use crate::head::{FrozenSeries, Head, SeriesRef};
use crate::rollup::file::RollupFile;
use crate::rollup::{RollupDelta, RollupTier};
use crate::segment::Segment;
use crate::series::{KeyArc, SeriesKey};
use crate::wal::record;
use crate::wal::{ReplayReport, SyncPolicy, Wal};

#[cfg(doc)]
use crate::error::Error;
#[cfg(test)]
use faults::Faults;

/// Panics only if another thread panicked while holding the lock, which is a bug.
macro_rules! lock {
    ($e:expr) => {
        $e.expect("BUG: storage lock poisoned")
    };
}

/// Configuration of a [`Storage`].
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// Root of the data directory; created if missing.
    pub data_dir: PathBuf,
    /// Samples per head chunk before it is sealed. Default 240 (4 min at 1 Hz);
    /// at most `GorillaEncoder::MAX_SAMPLES` (about a million), which a larger
    /// setting is capped to.
    pub max_chunk_samples: u32,
    /// Most series the head holds; more are rejected. Default 5,000,000.
    /// Counts live series: see `series_idle`.
    pub max_series: usize,
    /// A series that stored no sample since a flush at least this long ago
    /// leaves the head at the next flush (its samples stay in segments; a
    /// ref held for it gets [`crate::Error::SeriesEvicted`]). Default 15 min;
    /// zero: idle through one whole flush period.
    pub series_idle: std::time::Duration,
    /// When a WAL write (and so an append) counts as done. Default [`SyncPolicy::Os`].
    pub wal_sync: SyncPolicy,
    /// Size at which a WAL segment is closed and the next one started. Default 128 MiB.
    pub wal_segment_bytes: u64,
    /// Raw samples older than this (by their timestamp, against the wall
    /// clock) are deleted, a segment at a time; their rollups stay. Default 7 d;
    /// `None` keeps them forever.
    pub retention: Option<std::time::Duration>,
    /// 1-minute rollup records whose window ended longer ago than this are
    /// dropped (the 1 h and 1 d records stay). Default 30 d; `None`: forever.
    pub retention_1m: Option<std::time::Duration>,
    /// As `retention_1m`, for 1-hour records. Default 400 d.
    pub retention_1h: Option<std::time::Duration>,
    /// As `retention_1m`, for 1-day records. Default 5 × 365 d.
    pub retention_1d: Option<std::time::Duration>,
    /// [`Storage::compact`] merges the segments of each finished window of this
    /// length into one. Default 2 h.
    pub compaction_window: std::time::Duration,
    /// How far behind a series' newest sample a sample may arrive and still
    /// be stored (see [`crate::head`]). Default 10 min.
    pub ooo_window: std::time::Duration,
    /// Samples the head may hold before it asks for a flush ahead of the
    /// timer ([`Storage::set_on_full`]): a long backfill then does not hold
    /// hours of data in memory. `None` (the default): only the timer flushes.
    pub head_max_samples: Option<u64>,
}

const DAY_S: u64 = 86_400;

impl StorageConfig {
    /// Retention of a rollup tier.
    pub fn rollup_retention(&self, tier: RollupTier) -> Option<std::time::Duration> {
        match tier {
            RollupTier::Minute => self.retention_1m,
            RollupTier::Hour => self.retention_1h,
            RollupTier::Day => self.retention_1d,
        }
    }

    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            max_chunk_samples: 240,
            max_series: 5_000_000,
            series_idle: std::time::Duration::from_secs(15 * 60),
            wal_sync: SyncPolicy::Os,
            wal_segment_bytes: 128 << 20,
            retention: Some(std::time::Duration::from_secs(7 * DAY_S)),
            retention_1m: Some(std::time::Duration::from_secs(30 * DAY_S)),
            retention_1h: Some(std::time::Duration::from_secs(400 * DAY_S)),
            retention_1d: Some(std::time::Duration::from_secs(5 * 365 * DAY_S)),
            compaction_window: std::time::Duration::from_secs(2 * 3600),
            ooo_window: std::time::Duration::from_secs(600),
            head_max_samples: None,
        }
    }
}

/// Counters of the storage engine (exported by the binaries).
#[derive(Debug, Default)]
pub struct StorageMetrics {
    /// Samples stored, in order or out of order.
    pub samples_appended: AtomicU64,
    /// Of those, stored out of order (within the window).
    pub samples_out_of_order: AtomicU64,
    /// Dropped: a sample with that timestamp was already stored.
    pub samples_duplicate: AtomicU64,
    /// Dropped: older than the out-of-order window allows, or before the
    /// raw cut (see [`Storage::raw_cut`]).
    pub samples_too_old: AtomicU64,
    pub segments_quarantined: AtomicU64,
    pub flushes: AtomicU64,
    /// Samples put back into the head by WAL replay at open.
    pub wal_replayed_samples: AtomicU64,
    pub compactions: AtomicU64,
    pub segments_expired: AtomicU64,
    /// WAL samples that referenced a series whose definition was lost to corruption.
    pub wal_orphan_samples: AtomicU64,
    /// Batches dropped whole because their producer's sequence number was already stored.
    pub batches_duplicate: AtomicU64,
    /// Rollup files moved to quarantine/ because they failed validation.
    pub rollup_files_quarantined: AtomicU64,
    /// Rollup file blocks that failed to decode at query time (skipped).
    pub rollup_read_errors: AtomicU64,
    /// Raw chunks that failed to decode in [`Storage::newest`] (their series
    /// left out of the answer). Other reads return the error to the caller.
    pub chunk_read_errors: AtomicU64,
    /// Rollup files written by merges (compaction and downsampling).
    pub rollup_compactions: AtomicU64,
    /// Series that left the head at a flush because they took no sample
    /// for `series_idle` ([`crate::head::Head::evict_idle`]).
    pub series_evicted: AtomicU64,
    /// Flushes that failed: I/O (the data stays in memory and the next
    /// flush retries it), or data a writer refused (set aside, see
    /// `samples_set_aside`). Each failure is counted; the log says it once
    /// per cause.
    pub flush_failures: AtomicU64,
    /// Samples refused because their timestamp is outside
    /// [`crate::MIN_TS_MS`]..=[`crate::MAX_TS_MS`]: by an append (the batch
    /// is refused whole) or by WAL replay (the sample is set aside).
    pub samples_out_of_range: AtomicU64,
    /// Samples that a flush or WAL replay could not store and wrote to a
    /// `quarantine/set-aside-*.txt` file instead.
    pub samples_set_aside: AtomicU64,
    /// Rollup records that a flush could not write, set aside likewise.
    pub rollup_records_set_aside: AtomicU64,
}

/// Who sent a batch, for de-duplication of re-sends: a producer (an agent's
/// id and epoch) numbers its batches 1, 2, 3, ... and sends them in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchOrigin<'a> {
    pub producer: &'a str,
    pub seq: u64,
}

/// Highest stored batch per producer. One mutex per producer, so that the
/// check and the append of one producer are atomic while producers append
/// (and group-commit the WAL) in parallel.
#[derive(Debug, Default)]
struct Producers {
    by_name: Mutex<HashMap<String, Arc<Mutex<u64>>>>,
}

impl Producers {
    fn get(&self, producer: &str) -> Arc<Mutex<u64>> {
        let mut map = lock!(self.by_name.lock());
        if let Some(p) = map.get(producer) {
            return p.clone();
        }
        let p = Arc::new(Mutex::new(0));
        map.insert(producer.to_string(), p.clone());
        p
    }

    fn raise(&self, producer: &str, seq: u64) {
        let p = self.get(producer);
        let mut hwm = lock!(p.lock());
        *hwm = (*hwm).max(seq);
    }

    /// One mark record per producer, so that the marks outlive the WAL
    /// segments a flush deletes.
    fn checkpoint(&self, dst: &mut Vec<u8>) {
        let map = lock!(self.by_name.lock());
        for (name, p) in map.iter() {
            record::encode_mark(dst, name, *lock!(p.lock()));
        }
    }

    fn len(&self) -> usize {
        lock!(self.by_name.lock()).len()
    }
}

/// What [`Storage::append`] did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppendOutcome {
    /// Stored, in order or out of order.
    pub accepted: u32,
    /// Of `accepted`, stored out of order (within the window).
    pub out_of_order: u32,
    /// Dropped: a sample with that timestamp was already stored.
    pub duplicates: u32,
    /// Dropped: older than the out-of-order window allows, or before the
    /// raw cut (see [`Storage::raw_cut`]).
    pub too_old: u32,
    /// The whole batch was dropped unread: its producer's sequence number
    /// was already stored (a re-send after a lost ack).
    pub duplicate_batch: bool,
}

impl AppendOutcome {
    /// Samples not stored.
    pub fn dropped(&self) -> u32 {
        self.duplicates + self.too_old
    }
}

/// Point-in-time figures of a [`Storage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageStats {
    pub head_series: u64,
    pub head_samples: u64,
    pub segments: u64,
    pub segment_samples: u64,
    pub segment_bytes: u64,
    /// Producers (agent id and epoch) whose batches are de-duplicated.
    pub producers: u64,
    /// WAL writes refused because they could not be written (disk full, I/O
    /// error); a counter since open.
    pub wal_write_errors: u64,
}

#[derive(Debug, Default)]
struct State {
    segments: Vec<Arc<Segment>>,
    /// Head data being written to a segment; visible to queries meanwhile.
    frozen: Option<Arc<Vec<FrozenSeries>>>,
    /// Rollup files, by id.
    rollups: Vec<Arc<RollupFile>>,
    /// Head rollups being written to a rollup file; visible to queries meanwhile.
    frozen_rollup: Option<Arc<RollupDelta>>,
}

impl State {
    /// The store's raw cut: the largest of its rollup files' (see
    /// [`RollupFile::raw_cut`]); `i64::MIN` when none has one.
    fn raw_cut(&self) -> i64 {
        self.rollups
            .iter()
            .map(|f| f.raw_cut())
            .max()
            .unwrap_or(i64::MIN)
    }

    /// The newest timestamp of `key` in the segments and the flush in
    /// progress, if any.
    fn newest_flushed(&self, key: &SeriesKey) -> Option<i64> {
        let in_segments = self.segments.iter().filter_map(|s| {
            let ord = s.find_series(key)?;
            s.chunks(ord).iter().map(|c| c.max_ts).max()
        });
        let in_frozen = self.frozen.as_deref().and_then(|f| {
            let i = f.binary_search_by(|(k, _)| k.as_ref().cmp(key)).ok()?;
            f[i].1.iter().map(|c| c.max_ts).max()
        });
        in_segments.chain(in_frozen).max()
    }

    /// Whether a segment or the flush in progress holds a sample of `key` at `ts_ms`.
    fn has_sample(&self, key: &SeriesKey, ts_ms: i64) -> bool {
        self.frozen
            .as_deref()
            .is_some_and(|f| frozen_has_sample(f, key, ts_ms))
            || segments_have_sample(&self.segments, key, ts_ms)
    }
}

fn segments_have_sample(segments: &[Arc<Segment>], key: &SeriesKey, ts_ms: i64) -> bool {
    segments.iter().any(|s| s.has_sample(key, ts_ms))
}

fn frozen_has_sample(frozen: &[FrozenSeries], key: &SeriesKey, ts_ms: i64) -> bool {
    let Ok(i) = frozen.binary_search_by(|(k, _)| k.as_ref().cmp(key)) else {
        return false;
    };
    frozen[i]
        .1
        .iter()
        .filter(|c| c.min_ts <= ts_ms && ts_ms <= c.max_ts)
        .any(|c| c.holds(ts_ms))
}

/// What an append calls when the head is full ([`Storage::set_on_full`]).
pub type OnFullFn = Box<dyn Fn() + Send + Sync>;

struct OnFull(OnFullFn);

impl std::fmt::Debug for OnFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnFull")
    }
}

/// The storage engine of one data directory. Thread-safe.
#[derive(Debug)]
pub struct Storage {
    config: StorageConfig,
    state: RwLock<State>,
    head: RwLock<Head>,
    /// The upkeep lock: flushes, compactions, retention and rollup imports
    /// run one at a time ([`Storage::upkeep`] holds it for all three).
    flush_lock: Mutex<()>,
    /// The cause of the last failed flush, so that a failure repeated by
    /// every retry is logged once; `None` after a success.
    flush_error: Mutex<Option<String>>,
    /// A rollup file id whose file could be neither used nor moved away after
    /// its rename: the next rollup write reuses it, replacing that file.
    retry_rollup_id: Mutex<Option<u64>>,
    /// Numbers the set-aside files of this process.
    set_aside_seq: AtomicU64,
    #[cfg(test)]
    faults: Faults,
    /// Shared by appends from WAL write to head append; exclusive for a freeze + cut.
    gate: RwLock<()>,
    /// Appends refuse samples before this (as too old): the raw cut, or
    /// where retention is moving it ([`Storage::move_raw_cut`]). Raised
    /// under the exclusive gate, read under the shared one.
    raw_floor: AtomicI64,
    wal: Wal,
    next_segment: AtomicU64,
    next_rollup: AtomicU64,
    metrics: StorageMetrics,
    replay: ReplayReport,
    producers: Producers,
    inventory: crate::inventory::Inventory,
    /// One copy of each series key, for the head and every open segment.
    keys: Arc<crate::series::SharedKeys>,
    /// Called when the head reaches `head_max_samples` ([`Storage::set_on_full`]).
    on_full: std::sync::OnceLock<OnFull>,
    /// Set when `on_full` was called; cleared when a flush freezes the head,
    /// so that it is called once per filling.
    full_signalled: std::sync::atomic::AtomicBool,
    /// Sees every accepted batch ([`Storage::set_observer`]).
    observer: std::sync::OnceLock<Arc<dyn AppendObserver>>,
    /// Holds the directory's lock for the life of the storage.
    _lock: fs::File,
}

/// Something that watches the samples as they are stored (the health
/// engine). [`AppendObserver::appended`] runs on the appending thread,
/// after the batch is in the WAL and the head and before the append
/// returns: it must be quick and must not block (hand the batch to another
/// thread, and drop it, counted, when that thread is behind). WAL replay at
/// open is not observed, nor a batch dropped whole as a re-send.
pub trait AppendObserver: Send + Sync + std::fmt::Debug {
    /// `refs`, `ts_ms` and `values` are the batch as appended (of equal
    /// length); samples the head dropped (duplicates, too old) are in it.
    fn appended(&self, refs: &[SeriesRef], ts_ms: &[i64], values: &[f64]);
}

impl Storage {
    /// Installs what an append calls, once, when the head holds
    /// `head_max_samples` or more: a server wakes its flush task with it. It
    /// runs on the appending thread, so it must be quick and must not block
    /// (nor flush itself: the append holds the gate a flush takes). Called
    /// again only after a flush. Once per storage.
    ///
    /// # Errors
    /// The hook back, if one is installed already.
    pub fn set_on_full(&self, f: OnFullFn) -> std::result::Result<(), OnFullFn> {
        self.on_full.set(OnFull(f)).map_err(|OnFull(f)| f)
    }

    /// Installs the observer of appends. Once per storage.
    ///
    /// # Errors
    /// The observer back, if one is installed already.
    pub fn set_observer(
        &self,
        o: Arc<dyn AppendObserver>,
    ) -> std::result::Result<(), Arc<dyn AppendObserver>> {
        self.observer.set(o)
    }

    /// The key of a series in the head, `None` once it has left the head.
    pub fn head_series_key(&self, r: SeriesRef) -> Option<KeyArc> {
        let head = lock!(self.head.read());
        head.contains(r).then(|| head.key_arc(r).clone())
    }

    /// What WAL replay found when this storage was opened.
    pub fn replay_report(&self) -> &ReplayReport {
        &self.replay
    }

    /// The configuration this storage was opened with.
    pub fn config(&self) -> &StorageConfig {
        &self.config
    }

    pub fn data_dir(&self) -> &Path {
        &self.config.data_dir
    }

    /// The fleet's GPU inventory, kept next to the data.
    pub fn inventory(&self) -> &crate::inventory::Inventory {
        &self.inventory
    }

    pub fn metrics(&self) -> &StorageMetrics {
        &self.metrics
    }

    fn wal_dir(&self) -> PathBuf {
        self.config.data_dir.join(files::WAL_DIR)
    }

    /// Rollup files currently in use (for stats and tests).
    pub fn rollup_files(&self) -> usize {
        lock!(self.state.read()).rollups.len()
    }

    /// The raw cut (see [`RollupFile::raw_cut`]): gpu-level minute records
    /// of raw samples before it are in rollup files, later ones are folded
    /// from raw data when read. `i64::MIN` before any.
    ///
    /// Appends refuse a sample before the raw cut, counted as too old:
    /// the raw data there may be gone, so a repeat of a stored sample could
    /// not be told from a new one and would count twice in the rollups.
    /// Retention moves the cut only past raw data older than the raw
    /// retention, so this refuses nothing the retention would keep.
    pub fn raw_cut(&self) -> i64 {
        lock!(self.state.read()).raw_cut()
    }

    /// The segments in use.
    #[cfg(test)]
    pub(crate) fn segment_handles(&self) -> Vec<Arc<Segment>> {
        lock!(self.state.read()).segments.clone()
    }

    /// The rollup files in use, by id.
    #[cfg(test)]
    pub(crate) fn rollup_file_handles(&self) -> Vec<Arc<RollupFile>> {
        lock!(self.state.read()).rollups.clone()
    }

    pub fn stats(&self) -> StorageStats {
        let state = lock!(self.state.read());
        let head = lock!(self.head.read());
        StorageStats {
            head_series: head.num_series() as u64,
            head_samples: head.num_samples(),
            segments: state.segments.len() as u64,
            segment_samples: state.segments.iter().map(|s| s.num_samples()).sum(),
            segment_bytes: state.segments.iter().map(|s| s.size_bytes()).sum(),
            producers: self.producers.len() as u64,
            wal_write_errors: self.wal.write_errors(),
        }
    }
}

/// The reason of [`Error::BadBatch`] for a timestamp storage cannot hold.
const OUT_OF_RANGE: &str =
    "sample timestamp outside the range storage holds (0001-01-01 to 9999-12-31 UTC)";

/// Puts the samples from `start` on in time order and drops repeated
/// timestamps, keeping the first occurrence (the earliest write: chunks are
/// read oldest first). A no-op, after one check, when they are in order.
pub(crate) fn normalize(ts: &mut Vec<i64>, vals: &mut Vec<f64>, start: usize) {
    if strictly_ascending(&ts[start..]) {
        return;
    }
    let mut pairs: Vec<(i64, f64)> = ts[start..]
        .iter()
        .copied()
        .zip(vals[start..].iter().copied())
        .collect();
    pairs.sort_by_key(|p| p.0); // stable: the first write stays first
    pairs.dedup_by_key(|p| p.0);
    ts.truncate(start);
    vals.truncate(start);
    for (t, v) in pairs {
        ts.push(t);
        vals.push(v);
    }
}

/// Whether every timestamp is above the one before it. Checked a block
/// at a time without stopping at the first miss, which the compiler
/// vectorises (`windows(2).all(..)` stops early and runs a sample at a
/// time: 2 % of a 1,000-series `rate` query, `perf`).
///
/// The x86-64 baseline has no 64-bit vector compare, so a compare of two
/// timestamps cost 8 instructions a sample (callgrind of the server's
/// `host_energy_rate_6h`, 5 % of it). Instead a block's steps `y - x`
/// (wrapping) are checked to lie in `1..=2^57` by one OR of `y - x - 1`,
/// which SSE2 has, and its first and last timestamps to lie within ±2^62
/// (storage holds years 1 to 9999, about ±2^48). Then the block ascends:
/// its at most 64 steps add up to at most 2^63, which is congruent to
/// `last - first` (within ±2^63), so they add up to `last - first` with no
/// wrap, and every timestamp is `first` plus the steps before it. Where a
/// check fails (a fall, a step of over 2^57 ms, a timestamp outside the
/// range), the block is compared exactly.
fn strictly_ascending(ts: &[i64]) -> bool {
    const BLOCK: usize = 64;
    const MAX_STEP: u64 = 1 << 57;
    let in_range = |t: &i64| t.wrapping_add(1 << 62) >= 0;
    let Some(next) = ts.get(1..) else {
        return true;
    };
    ts.chunks(BLOCK).zip(next.chunks(BLOCK)).all(|(a, b)| {
        let steps = a.iter().zip(b).fold(0u64, |acc, (&x, &y)| {
            acc | y.wrapping_sub(x).wrapping_sub(1) as u64
        });
        let fast =
            steps < MAX_STEP && a.first().is_some_and(in_range) && b.last().is_some_and(in_range);
        fast || a.iter().zip(b).fold(true, |ok, (x, y)| ok & (x < y))
    })
}

mod append;
mod compact;
#[cfg(test)]
mod faults;
mod flush;
mod import;
mod open;
mod replay;
mod retention;
mod select;
#[cfg(test)]
pub(crate) use select::GROUP_READ_COST;
#[cfg(test)]
pub(crate) use select::unrolled_minutes;
mod set_aside;
mod upkeep;
mod write;

pub use import::RollupImportSummary;
pub use select::SelectedSeries;
pub use upkeep::UpkeepReport;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod upkeep_tests;
