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
//! Rollups ([`crate::rollup`]): every sample the head accepts is folded into
//! the head's rollups under the same head lock; a flush takes them out with
//! the chunks, writes them to a rollup file *before* the segment, and
//! [`Storage::select_rollups`] merges rollup files, a flush in progress and
//! the head under the same `state` -> `head` locks as [`Storage::select`].

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::time::Instant;

use tracing::{debug, error, info, warn};

use crate::error::Error;
use crate::files::{self, QUARANTINE_DIR, ROLLUPS_DIR, SEGMENTS_DIR, TMP_EXT};
use crate::gorilla::GorillaDecoder;
use crate::head::{Appended, FrozenSeries, Head, MemChunk, SeriesRef};
use crate::rollup::file::{self as rollup_file, RollupFile};
use crate::rollup::{
    Query, RollupDelta, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier,
};
use crate::segment::writer::{SegmentSummary, write_segment};
use crate::segment::{ChunkRef, Segment};
use crate::series::{Matcher, SeriesKey};
use crate::wal::record::{self, Record};
use crate::wal::{self, ReplayReport, SyncPolicy, Wal};
use crate::{Result, SegmentId};

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
    /// Samples per head chunk before it is sealed. Default 240 (4 min at 1 Hz).
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
    /// Dropped: older than the out-of-order window allows.
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
    /// Dropped: older than the out-of-order window allows.
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
        .any(|c| GorillaDecoder::new(&c.bytes, c.count).any(|s| s.is_ok_and(|(t, _)| t == ts_ms)))
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
    wal: Wal,
    next_segment: AtomicU64,
    next_rollup: AtomicU64,
    metrics: StorageMetrics,
    replay: ReplayReport,
    producers: Producers,
    inventory: crate::inventory::Inventory,
    /// Holds the directory's lock for the life of the storage.
    _lock: fs::File,
}

impl Storage {
    /// Opens (or creates) the data directory and every segment in it.
    /// Leftover `*.tmp` files of an interrupted flush are deleted. A segment
    /// that fails validation is moved to `quarantine/` and logged; the rest
    /// stay available.
    ///
    /// # Errors
    /// I/O errors on the directory itself.
    pub fn open(config: StorageConfig) -> Result<Self> {
        let seg_dir = config.data_dir.join(SEGMENTS_DIR);
        let q_dir = config.data_dir.join(QUARANTINE_DIR);
        fs::create_dir_all(&seg_dir).map_err(|e| Error::io(&seg_dir, e))?;
        let lock_path = config.data_dir.join(files::LOCK_FILE);
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| Error::io(&lock_path, e))?;
        // A lock held a moment longer than its holder (a process that is
        // exiting, or a child forked by another thread that has not yet
        // exec'd and so not yet closed the inherited descriptor) is waited
        // for, briefly; a directory in use by a running node is refused.
        let mut tries = 0;
        loop {
            match lock.try_lock() {
                Ok(()) => break,
                Err(fs::TryLockError::WouldBlock) if tries < 20 => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(fs::TryLockError::WouldBlock) => {
                    return Err(Error::Locked {
                        path: config.data_dir.clone(),
                    });
                }
                Err(fs::TryLockError::Error(e)) => return Err(Error::io(&lock_path, e)),
            }
        }
        let metrics = StorageMetrics::default();
        let started = Instant::now();

        let mut max_id = max_segment_id(&q_dir)?;
        let ids = list_sealed(&seg_dir, "segment", files::parse_segment_file_name)?;
        let mut segments = Vec::with_capacity(ids.len());
        for id in ids {
            max_id = max_id.max(id.0);
            let path = files::segment_path(&config.data_dir, id);
            match Segment::open(&path, id) {
                Ok(s) => segments.push(Arc::new(s)),
                Err(e @ Error::Corrupt { .. }) => {
                    error!(error = %e, "quarantining corrupt segment");
                    fs::create_dir_all(&q_dir).map_err(|e| Error::io(&q_dir, e))?;
                    let dst = q_dir.join(files::segment_file_name(id));
                    fs::rename(&path, &dst).map_err(|e| Error::io(&path, e))?;
                    metrics.segments_quarantined.fetch_add(1, Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let segments = drop_compacted_sources(segments, &q_dir, &metrics)?;
        let (rollups, max_rollup_id) = open_rollups(&config.data_dir, &q_dir, &metrics)?;
        let samples: u64 = segments.iter().map(|s| s.num_samples()).sum();
        let mut head = Head::new(
            config.max_chunk_samples,
            config.max_series,
            config.ooo_window.as_millis() as i64,
        );
        let producers = Producers::default();
        let inventory = crate::inventory::Inventory::open(&config.data_dir)?;
        let rollup_cut = rollups.iter().map(|f| f.wal_cut()).max().unwrap_or(0);
        let replay = replay_wal(
            &config.data_dir,
            &segments,
            rollup_cut,
            &mut head,
            &producers,
            &metrics,
        )?;
        let mut checkpoint = Vec::new();
        head.checkpoint(&mut checkpoint);
        producers.checkpoint(&mut checkpoint);
        let wal = Wal::start(
            &config.data_dir,
            replay.last_segment + 1,
            &checkpoint,
            config.wal_sync,
            config.wal_segment_bytes,
        )?;
        info!(
            dir = %config.data_dir.display(),
            segments = segments.len(),
            samples,
            wal_segments = replay.segments,
            wal_replayed_samples = metrics.wal_replayed_samples.load(Relaxed),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "storage opened"
        );
        Ok(Self {
            config,
            state: RwLock::new(State {
                segments,
                frozen: None,
                rollups,
                frozen_rollup: None,
            }),
            head: RwLock::new(head),
            flush_lock: Mutex::new(()),
            flush_error: Mutex::new(None),
            retry_rollup_id: Mutex::new(None),
            set_aside_seq: AtomicU64::new(0),
            #[cfg(test)]
            faults: Faults::default(),
            gate: RwLock::new(()),
            wal,
            next_segment: AtomicU64::new(max_id + 1),
            next_rollup: AtomicU64::new(max_rollup_id + 1),
            metrics,
            replay,
            producers,
            inventory,
            _lock: lock,
        })
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

    /// Returns the head handle of a series, creating the series if needed.
    ///
    /// # Errors
    /// [`Error::SeriesLimit`] when the head is full.
    pub fn series_ref(&self, key: SeriesKey) -> Result<SeriesRef> {
        Ok(self.series_refs(vec![key])?[0])
    }

    /// [`Self::series_ref`] for many keys at once: one head lock and one WAL
    /// write for all the series that are new, instead of one each (an agent's
    /// first batch defines hundreds).
    ///
    /// # Errors
    /// [`Error::SeriesLimit`] when the head is full (the series created before
    /// it are kept and logged), or the WAL write failed.
    pub fn series_refs(&self, keys: Vec<SeriesKey>) -> Result<Vec<SeriesRef>> {
        let mut out: Vec<Option<SeriesRef>> = {
            let head = lock!(self.head.read());
            keys.iter()
                .map(|k| head.lookup(k).filter(|&r| head.is_logged(r)))
                .collect()
        };
        if out.iter().all(Option::is_some) {
            return Ok(out.into_iter().flatten().collect());
        }
        let _gate = lock!(self.gate.read());
        // A series new to the head may have been in it before (evicted when
        // idle): its newest flushed timestamp restores the order check, as
        // replay does, so a re-sent sample is still a duplicate.
        let flushed: Vec<Option<i64>> = {
            let state = lock!(self.state.read());
            keys.iter()
                .zip(&out)
                .map(|(k, slot)| slot.is_none().then(|| state.newest_flushed(k)).flatten())
                .collect()
        };
        let mut head = lock!(self.head.write());
        let (mut buf, mut logged_now, mut failed) = (Vec::new(), Vec::new(), None);
        for ((slot, key), flushed) in out.iter_mut().zip(keys).zip(flushed) {
            if slot.is_some() {
                continue;
            }
            match head.get_or_create(key) {
                Ok(r) => {
                    if let Some(t) = flushed {
                        head.raise_last_ts(r, t);
                        head.raise_flushed(r, t);
                    }
                    if !head.is_logged(r) && !logged_now.contains(&r) {
                        record::encode_series(&mut buf, r.0, head.key(r));
                        logged_now.push(r);
                    }
                    *slot = Some(r);
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if !buf.is_empty() {
            // Logged under the head lock, so no sample can reference a new
            // series in the WAL before its definition does.
            self.wal
                .write(buf)
                .map_err(|e| Error::io(self.wal_dir(), e))?;
            for r in logged_now {
                head.set_logged(r);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(out.into_iter().flatten().collect()),
        }
    }

    fn wal_dir(&self) -> PathBuf {
        self.config.data_dir.join(files::WAL_DIR)
    }

    /// Appends a columnar batch to the head. Row `i` is
    /// `(refs[i], ts_ms[i], values[i])`. When this returns, the accepted
    /// samples are in the WAL (durable under the [`SyncPolicy`]) and visible to
    /// queries. All-or-nothing on errors. Blocks for the WAL write.
    ///
    /// # Errors
    /// [`Error::BadBatch`] if the columns differ in length, a ref is unknown,
    /// or a timestamp is outside [`crate::MIN_TS_MS`]..=[`crate::MAX_TS_MS`]
    /// (counted in `samples_out_of_range`); [`Error::Io`] if the WAL write
    /// failed (nothing was stored).
    pub fn append(
        &self,
        refs: &[SeriesRef],
        ts_ms: &[i64],
        values: &[f64],
    ) -> Result<AppendOutcome> {
        self.append_from(None, refs, ts_ms, values)
    }

    /// [`Storage::append`] for a batch with an origin: a batch whose sequence
    /// number is at or below the highest stored one of its producer is
    /// dropped whole (`duplicate_batch`). The mark that records the batch goes
    /// into the same WAL write as its samples, so de-duplication survives a
    /// crash, and into every WAL checkpoint, so it survives a flush.
    ///
    /// # Errors
    /// As [`Storage::append`].
    pub fn append_from(
        &self,
        origin: Option<BatchOrigin<'_>>,
        refs: &[SeriesRef],
        ts_ms: &[i64],
        values: &[f64],
    ) -> Result<AppendOutcome> {
        // Lock order: the gate, then the producer. A flush holds the gate
        // exclusively while it reads every producer for the WAL checkpoint.
        let _gate = lock!(self.gate.read());
        let producer = origin.map(|o| self.producers.get(o.producer));
        let mut hwm = producer.as_ref().map(|p| lock!(p.lock()));
        if let (Some(o), Some(h)) = (origin, hwm.as_deref())
            && o.seq <= *h
        {
            self.metrics.batches_duplicate.fetch_add(1, Relaxed);
            return Ok(AppendOutcome {
                duplicate_batch: true,
                ..Default::default()
            });
        }
        if refs.len() != ts_ms.len() || refs.len() != values.len() {
            return Err(Error::BadBatch {
                reason: "columns differ in length",
            });
        }
        let out_of_range = ts_ms.iter().filter(|&&t| !crate::ts_storable(t)).count();
        if out_of_range > 0 {
            self.metrics
                .samples_out_of_range
                .fetch_add(out_of_range as u64, Relaxed);
            return Err(Error::BadBatch {
                reason: OUT_OF_RANGE,
            });
        }
        // Idle series leave the head at a flush (`Head::evict_idle`, under
        // the exclusive gate, which this append holds shared until its samples
        // are in): every distinct ref is checked, under one lock.
        {
            let head = lock!(self.head.read());
            let mut prev = None;
            for &r in refs {
                if prev != Some(r) && !head.contains(r) {
                    return Err(if head.was_issued(r) {
                        Error::SeriesEvicted { series_ref: r.0 }
                    } else {
                        Error::BadBatch {
                            reason: "unknown series ref",
                        }
                    });
                }
                prev = Some(r);
            }
        }
        let wal_refs: Vec<u32> = refs.iter().map(|r| r.0).collect();
        let mut buf = Vec::with_capacity(refs.len() * 12 + 48);
        record::encode_samples(&mut buf, &wal_refs, ts_ms, values);
        if let Some(o) = origin {
            record::encode_mark(&mut buf, o.producer, o.seq);
        }
        self.wal
            .write(buf)
            .map_err(|e| Error::io(self.wal_dir(), e))?;
        if let (Some(o), Some(h)) = (origin, hwm.as_deref_mut()) {
            *h = o.seq;
        }
        let mut head = lock!(self.head.write());
        let mut out = AppendOutcome::default();
        // Taken only for a late sample that may repeat a flushed timestamp. The
        // gate keeps freezes out, so `maybe_flushed` cannot change meanwhile;
        // the head lock is let go first to keep the lock order state -> head.
        let mut flushed: Option<RwLockReadGuard<'_, State>> = None;
        let mut i = 0;
        while i < refs.len() {
            let (r, t, v) = (refs[i], ts_ms[i], values[i]);
            if flushed.is_none() && head.maybe_flushed(r, t) {
                drop(head);
                flushed = Some(lock!(self.state.read()));
                head = lock!(self.head.write());
                continue;
            }
            i += 1;
            let seen =
                |key: &SeriesKey, ts| flushed.as_deref().is_some_and(|s| s.has_sample(key, ts));
            match head.append_with(r, t, v, true, seen) {
                Appended::InOrder => out.accepted += 1,
                Appended::OutOfOrder => {
                    out.accepted += 1;
                    out.out_of_order += 1;
                }
                Appended::Duplicate => out.duplicates += 1,
                Appended::TooOld => out.too_old += 1,
            }
        }
        drop(head);
        drop(flushed);
        let m = &self.metrics;
        m.samples_appended.fetch_add(out.accepted as u64, Relaxed);
        m.samples_out_of_order
            .fetch_add(out.out_of_order as u64, Relaxed);
        m.samples_duplicate
            .fetch_add(out.duplicates as u64, Relaxed);
        m.samples_too_old.fetch_add(out.too_old as u64, Relaxed);
        Ok(out)
    }

    /// Seals everything in the head into a new segment. Returns `None` if the
    /// head was empty. One flush runs at a time; appends and queries go on
    /// while it writes.
    ///
    /// # Errors
    /// I/O errors: the frozen data then stays visible to queries and the next
    /// flush retries it. Data that a writer refuses ([`Error::Unwritable`],
    /// or a file that fails to open right after it was written) is set aside
    /// instead: the offending samples or rollup records (all of the frozen
    /// ones if they cannot be told apart) go to a `quarantine/set-aside-*.txt`
    /// file, the rest stays for the next flush, and the error is returned.
    /// Every failure is counted (`flush_failures`) and logged once per cause.
    pub fn flush(&self) -> Result<Option<SegmentSummary>> {
        let _upkeep = lock!(self.flush_lock.lock());
        self.flush_locked()
    }

    /// [`Self::flush`], for a caller that holds the upkeep lock.
    fn flush_locked(&self) -> Result<Option<SegmentSummary>> {
        let result = self.flush_inner();
        let mut last = lock!(self.flush_error.lock());
        match &result {
            Ok(_) => {
                if let Some(cause) = last.take() {
                    info!(previous_error = %cause, "flush succeeded after failing");
                }
            }
            Err(e) => {
                self.metrics.flush_failures.fetch_add(1, Relaxed);
                let cause = failure_cause(e);
                if last.as_deref() == Some(cause.as_str()) {
                    debug!(error = %e, "flush failed again, as before");
                } else {
                    error!(error = %e, "flush failed; the next flush retries (I/O) or the data was set aside in quarantine/ (data that cannot be written); counted in flush_failures");
                    *last = Some(cause);
                }
            }
        }
        result
    }

    fn flush_inner(&self) -> Result<Option<SegmentSummary>> {
        let (frozen, cut) = {
            let _gate = lock!(self.gate.write());
            let mut state = lock!(self.state.write());
            let mut carried = state
                .frozen
                .take()
                .map(|f| (*f).clone())
                .unwrap_or_default();
            let mut head = lock!(self.head.write());
            let mut fresh = head.freeze();
            let fresh_rollup = head.take_rollups();
            // Idle series leave before the checkpoint, so the next WAL
            // generation does not define them.
            let evicted = head.evict_idle(Instant::now(), self.config.series_idle) as u64;
            self.metrics.series_evicted.fetch_add(evicted, Relaxed);
            let mut checkpoint = Vec::new();
            head.checkpoint(&mut checkpoint);
            drop(head);
            self.producers.checkpoint(&mut checkpoint);
            if carried.is_empty() {
                carried = fresh;
            } else if !fresh.is_empty() {
                merge_frozen(&mut carried, &mut fresh);
            }
            let mut rollup = state
                .frozen_rollup
                .take()
                .map(|f| (*f).clone())
                .unwrap_or_default();
            rollup.extend(fresh_rollup);
            state.frozen_rollup = (!rollup.is_empty()).then(|| Arc::new(rollup));
            if carried.is_empty() {
                // Only rollups left over from a flush whose segment was set
                // aside: nothing for a segment, the next flush writes them.
                return Ok(None);
            }
            let frozen = Arc::new(carried);
            state.frozen = Some(frozen.clone());
            // Samples from here on go to WAL segments at or after `cut`.
            let cut = self
                .wal
                .cut(checkpoint)
                .map_err(|e| Error::io(self.wal_dir(), e))?;
            (frozen, cut)
        };

        let started = Instant::now();
        // Rollups first: a crash before the segment is durable leaves the WAL
        // in place, and replay then refills the head but not the rollups (the
        // WAL below this file's cut is counted in it).
        let frozen_rollup = lock!(self.state.read()).frozen_rollup.clone();
        if let Some(delta) = frozen_rollup {
            match self.write_rollups(cut, &crate::rollup::delta_tables(&delta), None) {
                Ok(file) => {
                    let mut state = lock!(self.state.write());
                    state.rollups.push(Arc::new(file));
                    state.frozen_rollup = None;
                }
                Err(e) if e.is_retryable() => return Err(e),
                Err(e) => {
                    self.set_aside_rollups(&delta, &e)?;
                    // The raw samples behind refused records would fail the
                    // segment next: set aside those a segment cannot hold now,
                    // so that the next flush writes the rest.
                    if self.set_aside_samples(&frozen, &e, false)?
                        && lock!(self.state.read()).frozen_rollup.is_none()
                    {
                        self.truncate_wal(cut);
                    }
                    return Err(e);
                }
            }
        }
        let id = SegmentId(self.next_segment.fetch_add(1, Relaxed));
        let tmp = files::segment_tmp_path(&self.config.data_dir, id);
        let dst = files::segment_path(&self.config.data_dir, id);
        let written = write_frozen(&tmp, &dst, (id.0, id.0), cut, &frozen).and_then(|s| {
            let opened = self.open_written_segment(&dst, id);
            Ok((s, opened?))
        });
        let (summary, segment) = match written {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                if !e.is_retryable() && self.set_aside_samples(&frozen, &e, true)? {
                    // Nothing of this flush is left to write: the WAL before
                    // the cut is in segments, rollup files or quarantine/.
                    self.truncate_wal(cut);
                }
                return Err(e);
            }
        };
        let mut state = lock!(self.state.write());
        state.segments.push(Arc::new(segment));
        state.frozen = None;
        drop(state);
        // The segment is durable: the WAL before the cut is no longer needed.
        self.truncate_wal(cut);
        self.metrics.flushes.fetch_add(1, Relaxed);
        info!(
            segment = %dst.display(),
            series = summary.series,
            samples = summary.samples,
            bytes = summary.bytes,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "flushed head to segment"
        );
        Ok(Some(summary))
    }

    fn truncate_wal(&self, cut: u64) {
        if let Err(e) = self.wal.truncate(cut) {
            warn!(error = %e, "could not delete old WAL segments; replay skips them, since they lie below this segment's WAL cut");
        }
    }

    /// Opens a segment just renamed into place; if that fails, takes the file
    /// out of `segments/` again (see [`Self::withdraw`]).
    fn open_written_segment(&self, dst: &Path, id: SegmentId) -> Result<Segment> {
        #[cfg(test)]
        if self.faults.take(&self.faults.segment_open) {
            let e = Error::io(dst, std::io::Error::other("injected fault: segment open"));
            self.withdraw(dst, &files::segment_file_name(id), &e);
            return Err(e);
        }
        Segment::open(dst, id).inspect_err(|e| {
            self.withdraw(dst, &files::segment_file_name(id), e);
        })
    }

    /// Moves a file that was renamed into place but could not be opened to
    /// `quarantine/` with a note of why (`<name>.why`), or deletes it: left
    /// in place, the next start would count its data a second time, next to
    /// the file that the retry writes. Returns whether the file is gone.
    fn withdraw(&self, path: &Path, name: &str, why: &Error) -> bool {
        let q = self.config.data_dir.join(QUARANTINE_DIR);
        let dir = path.parent().unwrap_or(Path::new("."));
        let moved = fs::create_dir_all(&q)
            .and_then(|()| fs::rename(path, q.join(name)))
            .map_err(|e| Error::io(path, e))
            .and_then(|()| crate::segment::writer::sync_dir(dir));
        match moved {
            Ok(()) => {
                let note = format!(
                    "{name} failed to open right after it was written: {why}\n\
                     Its data stayed in memory and was written again by a later flush or merge.\n"
                );
                let _ = fs::write(files::quarantine_note_path(&q, name), note);
                error!(file = %path.display(), error = %why, "a file failed to open right after it was written; moved to quarantine/, its data is retried");
                true
            }
            Err(e) => match fs::remove_file(path) {
                Ok(()) => crate::segment::writer::sync_dir(dir).is_ok(),
                Err(r) if r.kind() == std::io::ErrorKind::NotFound => true,
                Err(r) => {
                    error!(file = %path.display(), error = %why, move_error = %e, remove_error = %r, "a file failed to open after it was written and cannot be moved or deleted");
                    false
                }
            },
        }
    }

    /// Sets aside the samples of `frozen` that a segment cannot hold (all of
    /// them if none is found at fault and `or_all`), in a `quarantine/` file
    /// that says why; the rest stays frozen for the next flush. Returns
    /// whether nothing is left.
    ///
    /// # Errors
    /// I/O errors writing the file; the data then stays as it was.
    fn set_aside_samples(
        &self,
        frozen: &Arc<Vec<FrozenSeries>>,
        why: &Error,
        or_all: bool,
    ) -> Result<bool> {
        let (mut keep, mut lines, mut n) = split_frozen(frozen);
        if n == 0 {
            if !or_all {
                return Ok(false);
            }
            keep = Vec::new();
            (lines, n) = describe_frozen(frozen);
        }
        let path = self.write_set_aside("flush: raw samples", why, &lines)?;
        self.metrics.samples_set_aside.fetch_add(n, Relaxed);
        error!(file = %path.display(), samples = n, error = %why, "set aside samples that a segment cannot hold");
        let empty = keep.is_empty();
        lock!(self.state.write()).frozen = (!empty).then(|| Arc::new(keep));
        Ok(empty)
    }

    /// As [`Self::set_aside_samples`], for the frozen rollup records: those
    /// that no rollup file may hold, or all of them.
    fn set_aside_rollups(&self, delta: &Arc<RollupDelta>, why: &Error) -> Result<()> {
        let (mut keep, mut lines) = (Vec::new(), Vec::new());
        for (g, minutes) in delta.iter() {
            let (good, bad): (Vec<RollupRecord>, Vec<RollupRecord>) = minutes
                .iter()
                .partition(|r| rollup_file::record_problem(RollupTier::Minute, r).is_none());
            lines.extend(bad.iter().map(|r| rollup_line(g, r)));
            if !good.is_empty() {
                keep.push((g.clone(), good));
            }
        }
        if lines.is_empty() {
            keep.clear();
            for (g, minutes) in delta.iter() {
                lines.extend(minutes.iter().map(|r| rollup_line(g, r)));
            }
        }
        let path = self.write_set_aside("flush: 1-minute rollup records", why, &lines)?;
        self.metrics
            .rollup_records_set_aside
            .fetch_add(lines.len() as u64, Relaxed);
        error!(file = %path.display(), records = lines.len(), error = %why, "set aside rollup records that a rollup file cannot hold");
        lock!(self.state.write()).frozen_rollup = (!keep.is_empty()).then(|| Arc::new(keep));
        Ok(())
    }

    fn write_set_aside(&self, what: &str, why: &Error, lines: &[String]) -> Result<PathBuf> {
        let n = self.set_aside_seq.fetch_add(1, Relaxed);
        write_set_aside(&self.config.data_dir, n, what, &why.to_string(), lines)
    }

    /// Every series matching all `matchers` with at least one chunk that
    /// overlaps `[min_ts, max_ts]`, sorted by key. Chunks are in time order.
    pub fn select(&self, matchers: &[Matcher], min_ts: i64, max_ts: i64) -> Vec<SelectedSeries> {
        let overlaps = |lo: i64, hi: i64| lo <= max_ts && hi >= min_ts;
        let mut by_key: std::collections::BTreeMap<Arc<SeriesKey>, Vec<ChunkSource>> =
            Default::default();
        let state = lock!(self.state.read());
        for seg in &state.segments {
            let (lo, hi) = seg.time_range();
            if !overlaps(lo, hi) {
                continue;
            }
            for ord in seg.select(matchers) {
                let chunks: Vec<ChunkSource> = seg
                    .chunks(ord)
                    .iter()
                    .filter(|c| overlaps(c.min_ts, c.max_ts))
                    .map(|c| ChunkSource::Segment(seg.clone(), *c))
                    .collect();
                if !chunks.is_empty() {
                    by_key
                        .entry(seg.series_key(ord).clone())
                        .or_default()
                        .extend(chunks);
                }
            }
        }
        let mem = |by_key: &mut std::collections::BTreeMap<_, Vec<_>>,
                   key: &Arc<SeriesKey>,
                   chunks: Vec<MemChunk>| {
            let chunks: Vec<ChunkSource> = chunks
                .into_iter()
                .filter(|c| overlaps(c.min_ts, c.max_ts))
                .map(ChunkSource::Mem)
                .collect();
            if !chunks.is_empty() {
                by_key.entry(key.clone()).or_default().extend(chunks);
            }
        };
        if let Some(frozen) = &state.frozen {
            for (key, chunks) in frozen.iter() {
                if matchers.iter().all(|m| m.matches(key)) {
                    mem(&mut by_key, key, chunks.clone());
                }
            }
        }
        lock!(self.head.read()).for_each_series(
            |k| matchers.iter().all(|m| m.matches(k)),
            |key, chunks| mem(&mut by_key, key, chunks),
        );
        drop(state);
        by_key
            .into_iter()
            .map(|(key, chunks)| SelectedSeries { key, chunks })
            .collect()
    }

    /// Writes a rollup file covering `covers` (plus its own new id) and
    /// opens it. A file that fails to open after its rename is withdrawn
    /// ([`Self::withdraw`]) before the error returns, so that the retry of its
    /// records cannot count them twice after a restart; if it cannot be
    /// withdrawn, the next write reuses its id and so replaces it.
    fn write_rollups(
        &self,
        wal_cut: u64,
        tables: &crate::rollup::Tables,
        covers: Option<Vec<(u64, u64)>>,
    ) -> Result<RollupFile> {
        let id = lock!(self.retry_rollup_id.lock())
            .take()
            .unwrap_or_else(|| self.next_rollup.fetch_add(1, Relaxed));
        let covers = rollup_file::union_covers(
            covers
                .unwrap_or_default()
                .into_iter()
                .chain([(id, id)])
                .collect(),
        );
        let tmp = files::rollup_tmp_path(&self.config.data_dir, id);
        let dst = files::rollup_path(&self.config.data_dir, id);
        if let Err(e) = rollup_file::write(&tmp, &dst, wal_cut, &covers, tables) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        #[cfg(test)]
        let opened = if self.faults.take(&self.faults.rollup_open) {
            Err(Error::io(
                &dst,
                std::io::Error::other("injected fault: rollup file open"),
            ))
        } else {
            RollupFile::open(&dst, id)
        };
        #[cfg(not(test))]
        let opened = RollupFile::open(&dst, id);
        opened.inspect_err(|e| {
            if !self.withdraw(&dst, &files::rollup_file_name(id), e) {
                *lock!(self.retry_rollup_id.lock()) = Some(id);
            }
        })
    }

    /// Groups matching `filter` with their records whose window overlaps
    /// `[min_ts, max_ts]`; groups sorted, records in window order. Merges the
    /// rollup files, a flush in progress and the head, so it counts every
    /// stored sample exactly once. A file block that fails to decode is
    /// logged, counted (`rollup_read_errors`) and skipped.
    pub fn select_rollups(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        filter: &RollupFilter,
        min_ts: i64,
        max_ts: i64,
    ) -> Vec<(RollupGroup, Vec<RollupRecord>)> {
        let mut q = Query {
            tier,
            level,
            filter,
            min_ts,
            max_ts,
            out: Default::default(),
        };
        if min_ts > max_ts {
            return Vec::new();
        }
        let state = lock!(self.state.read());
        for f in &state.rollups {
            let read = f.for_each_matching(
                tier,
                level,
                tier.window_start(min_ts),
                max_ts,
                filter,
                |g, r| {
                    if q.overlaps(r.window_start_ms) {
                        q.add_record(g, r);
                    }
                },
            );
            if let Err(e) = read {
                error!(error = %e, "rollup file block does not decode; skipped");
                self.metrics.rollup_read_errors.fetch_add(1, Relaxed);
            }
        }
        if let Some(delta) = &state.frozen_rollup {
            for (g, minutes) in delta.iter() {
                q.add_minutes(g, minutes);
            }
        }
        lock!(self.head.read()).for_each_rollup(|g, r| q.add_minutes(g, r.records()));
        drop(state);
        q.finish()
    }

    /// Rollup files currently in use (for stats and tests).
    pub fn rollup_files(&self) -> usize {
        lock!(self.state.read()).rollups.len()
    }

    /// Merges `sources` into one new rollup file, dropping the records that
    /// `expired` says are past their tier's retention, then swaps them in and
    /// deletes the sources. Caller holds the flush lock.
    fn merge_rollups(
        &self,
        sources: &[Arc<RollupFile>],
        expired: impl Fn(RollupTier, i64) -> bool,
    ) -> Result<()> {
        let started = Instant::now();
        let mut tables = crate::rollup::empty_tables();
        for f in sources {
            f.merge_into(&mut tables)?;
        }
        for tier in RollupTier::ALL {
            for t in &mut tables[tier.index()] {
                for w in t.values_mut() {
                    w.retain(|&ws, _| !expired(tier, ws));
                }
                t.retain(|_, w| !w.is_empty());
            }
        }
        let wal_cut = sources.iter().map(|f| f.wal_cut()).max().unwrap_or(0);
        let covers = sources
            .iter()
            .flat_map(|f| f.covers().iter().copied())
            .collect();
        let merged = Arc::new(self.write_rollups(wal_cut, &tables, Some(covers))?);
        let mut state = lock!(self.state.write());
        state
            .rollups
            .retain(|f| !sources.iter().any(|s| Arc::ptr_eq(s, f)));
        state.rollups.push(merged.clone());
        state.rollups.sort_by_key(|f| f.id());
        drop(state);
        for s in sources {
            s.delete_when_unused();
        }
        self.metrics.rollup_compactions.fetch_add(1, Relaxed);
        info!(
            sources = sources.len(),
            file = %merged.path().display(),
            bytes = merged.size_bytes(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "merged rollup files"
        );
        Ok(())
    }

    /// Merges the rollup files of the oldest finished compaction window (by
    /// their newest sample), if it has two or more. Caller holds the flush lock.
    fn compact_rollups(&self) -> Result<bool> {
        let window_ms = (self.config.compaction_window.as_millis() as i64).max(1);
        let files = lock!(self.state.read()).rollups.clone();
        let window_of = |f: &RollupFile| f.time_range().1.div_euclid(window_ms);
        let Some(newest) = files.iter().map(|f| window_of(f)).max() else {
            return Ok(false);
        };
        let mut by_window: std::collections::BTreeMap<i64, Vec<Arc<RollupFile>>> =
            Default::default();
        for f in &files {
            let w = window_of(f);
            if w < newest {
                by_window.entry(w).or_default().push(f.clone());
            }
        }
        let Some(group) = by_window.into_values().find(|g| g.len() >= 2) else {
            return Ok(false);
        };
        self.merge_rollups(&group, |_, _| false)?;
        Ok(true)
    }

    /// Merges the segments of the oldest finished compaction window (one that a
    /// later segment has moved past) into one segment, if it has two or more.
    /// Call it repeatedly to catch up. Queries go on meanwhile; the sources are
    /// deleted once the last query holding them finishes.
    ///
    /// # Errors
    /// I/O errors, or a source chunk that fails its checksum; the sources
    /// then stay as they are.
    pub fn compact(&self) -> Result<Option<SegmentSummary>> {
        let _upkeep = lock!(self.flush_lock.lock());
        self.compact_locked()
    }

    /// [`Self::compact`], for a caller that holds the upkeep lock.
    fn compact_locked(&self) -> Result<Option<SegmentSummary>> {
        // Rollup files first: one merge per call, like segments.
        if let Err(e) = self.compact_rollups() {
            error!(error = %e, "rollup compaction failed; the files stay as they are");
        }
        let window_ms = (self.config.compaction_window.as_millis() as i64).max(1);
        let segments = lock!(self.state.read()).segments.clone();
        let window_of = |s: &Segment| s.time_range().1.div_euclid(window_ms);
        let mut group: Vec<Arc<Segment>> = Vec::new();
        for (i, s) in segments.iter().enumerate() {
            let w = window_of(s);
            let finished = segments[i + 1..].iter().any(|later| window_of(later) > w);
            if finished && group.last().is_none_or(|g| window_of(g) == w) {
                group.push(s.clone());
            } else if group.len() >= 2 {
                break;
            } else {
                group.clear();
                if finished {
                    group.push(s.clone());
                }
            }
        }
        if group.len() < 2 {
            return Ok(None);
        }

        let started = Instant::now();
        let mut refs: std::collections::BTreeMap<Arc<SeriesKey>, Vec<(usize, u32)>> =
            Default::default();
        for (gi, seg) in group.iter().enumerate() {
            for ord in 0..seg.num_series() as u32 {
                refs.entry(seg.series_key(ord).clone())
                    .or_default()
                    .push((gi, ord));
            }
        }
        let keys: Vec<Arc<SeriesKey>> = refs.keys().cloned().collect();
        let sources: Vec<&Vec<(usize, u32)>> = refs.values().collect();
        let seq = (group[0].seq_range().0, group[group.len() - 1].seq_range().1);
        let wal_cut = group.iter().map(|s| s.wal_cut()).max().unwrap_or(0);
        let id = SegmentId(self.next_segment.fetch_add(1, Relaxed));
        let tmp = files::segment_tmp_path(&self.config.data_dir, id);
        let dst = files::segment_path(&self.config.data_dir, id);
        let written = write_segment(&tmp, &dst, seq, wal_cut, &keys, |i, ts, vals| {
            // Sources are in flush order, so each series' samples stay in time order.
            for &(gi, ord) in sources[i] {
                for c in group[gi].chunks(ord) {
                    group[gi].read_chunk(c, ts, vals)?;
                }
            }
            normalize(ts, vals, 0);
            Ok(())
        })
        .and_then(|s| {
            let opened = self.open_written_segment(&dst, id);
            Ok((s, opened?))
        });
        let (summary, merged) = match written {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        #[cfg(test)]
        if let Some(tx) = lock!(self.faults.before_compaction_swap.lock()).take() {
            let _ = tx.send(());
            std::thread::sleep(std::time::Duration::from_millis(300));
        }
        let mut state = lock!(self.state.write());
        // Compaction and retention, the only removers of segments, both hold
        // the upkeep lock, so the group is still in place; checked anyway,
        // since a wrong splice would drop other segments from view.
        let at = state
            .segments
            .iter()
            .position(|s| Arc::ptr_eq(s, &group[0]))
            .filter(|&at| {
                state.segments.len() >= at + group.len()
                    && group
                        .iter()
                        .zip(&state.segments[at..])
                        .all(|(g, s)| Arc::ptr_eq(g, s))
            });
        let Some(at) = at else {
            drop(state);
            error!(segment = %dst.display(), "compaction sources changed while they were merged; discarding the merged segment");
            merged.delete_when_unused();
            return Ok(None);
        };
        state
            .segments
            .splice(at..at + group.len(), [Arc::new(merged)]);
        drop(state);
        for s in &group {
            s.delete_when_unused();
        }
        self.metrics.compactions.fetch_add(1, Relaxed);
        info!(
            sources = group.len(),
            segment = %dst.display(),
            series = summary.series,
            samples = summary.samples,
            bytes = summary.bytes,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "compacted segments"
        );
        Ok(Some(summary))
    }

    /// Drops every segment whose newest sample is older than the retention
    /// (see [`StorageConfig::retention`]) at `now_ms`. A query that holds a
    /// dropped segment keeps reading it; the file goes when the query ends.
    /// Returns how many segments were dropped.
    ///
    /// Rollups have their own tiers ([`StorageConfig::retention_1m`] etc.):
    /// the rollup files holding a record whose window ended before its
    /// tier's cutoff are merged, with the files that hold no 1-minute records
    /// any more (earlier results of this), into one file without the expired
    /// records. So raw data and 1-minute records expire while the 1 h and 1 d
    /// records stay. Errors there are logged; the files stay as they were.
    pub fn enforce_retention(&self, now_ms: i64) -> usize {
        let _upkeep = lock!(self.flush_lock.lock());
        self.retention_locked(now_ms)
    }

    /// One round of upkeep under one lock, so that no two of them interleave
    /// (a flush on request and the periodic one, compaction and retention):
    /// a flush, then at most `max_compactions` compactions (a backlog does
    /// not stall the next flush), then retention. Compaction and retention
    /// run even when the flush failed: retention is what frees the disk.
    pub fn upkeep(&self, now_ms: i64, max_compactions: usize) -> UpkeepReport {
        let _upkeep = lock!(self.flush_lock.lock());
        let flush = self.flush_locked();
        let (mut compactions, mut compaction_error) = (0, None);
        while compactions < max_compactions {
            match self.compact_locked() {
                Ok(Some(_)) => compactions += 1,
                Ok(None) => break,
                Err(e) => {
                    error!(error = %e, "compaction failed; the segments stay as they are");
                    compaction_error = Some(e);
                    break;
                }
            }
        }
        let segments_expired = self.retention_locked(now_ms);
        UpkeepReport {
            flush,
            compactions,
            compaction_error,
            segments_expired,
        }
    }

    /// [`Self::enforce_retention`], for a caller that holds the upkeep lock.
    fn retention_locked(&self, now_ms: i64) -> usize {
        self.enforce_rollup_retention(now_ms);
        let Some(keep) = self.config.retention else {
            return 0;
        };
        let cutoff = now_ms.saturating_sub(keep.as_millis() as i64);
        let mut state = lock!(self.state.write());
        let (expired, kept): (Vec<_>, Vec<_>) = state
            .segments
            .drain(..)
            .partition(|s| s.time_range().1 < cutoff);
        state.segments = kept;
        drop(state);
        for s in &expired {
            info!(segment = %s.path().display(), newest_sample_ms = s.time_range().1, "retention: dropping expired segment");
            s.delete_when_unused();
        }
        self.metrics
            .segments_expired
            .fetch_add(expired.len() as u64, Relaxed);
        expired.len()
    }

    /// Caller holds the upkeep lock.
    fn enforce_rollup_retention(&self, now_ms: i64) {
        let cutoff = |tier: RollupTier| {
            self.config
                .rollup_retention(tier)
                .map(|d| now_ms.saturating_sub(d.as_millis() as i64))
        };
        let expired = |tier: RollupTier, ws: i64| {
            cutoff(tier).is_some_and(|c| ws.saturating_add(tier.window_ms() - 1) < c)
        };
        let files = lock!(self.state.read()).rollups.clone();
        let stale: Vec<_> = files
            .iter()
            .filter(|f| {
                RollupTier::ALL
                    .iter()
                    .any(|&t| f.min_window(t).is_some_and(|ws| expired(t, ws)))
            })
            .cloned()
            .collect();
        if stale.is_empty() {
            return;
        }
        let mut sources = stale;
        for f in &files {
            if f.min_window(RollupTier::Minute).is_none()
                && !sources.iter().any(|s| Arc::ptr_eq(s, f))
            {
                sources.push(f.clone());
            }
        }
        if let Err(e) = self.merge_rollups(&sources, expired) {
            error!(error = %e, "rollup retention failed; the files stay as they are");
        }
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

/// What one [`Storage::upkeep`] did.
#[derive(Debug)]
pub struct UpkeepReport {
    /// The flush's result (already counted and logged by storage).
    pub flush: Result<Option<SegmentSummary>>,
    /// Compactions done.
    pub compactions: usize,
    /// The compaction that failed, if one did (logged); later ones were not tried.
    pub compaction_error: Option<Error>,
    /// Segments dropped by retention.
    pub segments_expired: usize,
}

/// Faults that tests inject: each counter is how many more times the
/// operation fails.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// Opening a rollup file right after its rename.
    pub(crate) rollup_open: std::sync::atomic::AtomicU32,
    /// Opening a segment right after its rename.
    pub(crate) segment_open: std::sync::atomic::AtomicU32,
    /// Compaction signals here, then waits 300 ms, between writing the
    /// merged segment and swapping it in for its sources.
    pub(crate) before_compaction_swap: Mutex<Option<std::sync::mpsc::Sender<()>>>,
}

#[cfg(test)]
impl Faults {
    pub(crate) fn take(&self, n: &std::sync::atomic::AtomicU32) -> bool {
        n.fetch_update(Relaxed, Relaxed, |v| v.checked_sub(1))
            .is_ok()
    }
}

/// What makes two flush failures "the same" for the log: the kind of I/O
/// error (paths change with every retry's file id), or the writer's reason.
fn failure_cause(e: &Error) -> String {
    match e {
        Error::Io { source, .. } => format!("I/O: {:?}", source.kind()),
        Error::Unwritable { what, .. } => format!("unwritable: {what}"),
        Error::Corrupt { kind, .. } => format!("corrupt: {kind}"),
        e => e.to_string(),
    }
}

/// One set-aside sample: `sample <key> <ts_ms> <value> <value bits>`,
/// tab-separated (the bits keep NaN payloads).
fn sample_line(key: &SeriesKey, ts_ms: i64, v: f64) -> String {
    format!("sample\t{key}\t{ts_ms}\t{v}\t{:#018x}", v.to_bits())
}

/// One set-aside 1-minute rollup record, tab-separated.
fn rollup_line(g: &RollupGroup, r: &RollupRecord) -> String {
    format!(
        "rollup_1m\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
        g.metric,
        g.cluster,
        g.row,
        g.rack,
        g.host,
        g.gpu,
        r.window_start_ms,
        r.count,
        r.sum,
        r.min,
        r.max,
        r.first,
        r.first_ts_ms,
        r.last,
        r.last_ts_ms
    )
}

/// Splits frozen chunks into what a segment can hold and the samples it
/// cannot (a timestamp outside the storable range), as set-aside lines.
/// Chunks without such samples are kept as they are; the others are
/// re-encoded without them. Returns the kept series, the lines and their count.
fn split_frozen(frozen: &[FrozenSeries]) -> (Vec<FrozenSeries>, Vec<String>, u64) {
    let (mut keep, mut lines) = (Vec::with_capacity(frozen.len()), Vec::new());
    for (key, chunks) in frozen {
        let mut kept: Vec<MemChunk> = Vec::with_capacity(chunks.len());
        for c in chunks {
            let samples: Vec<(i64, f64)> = GorillaDecoder::new(&c.bytes, c.count)
                .map_while(|s| s.ok())
                .collect();
            if samples.len() == c.count as usize
                && crate::ts_storable(c.min_ts)
                && crate::ts_storable(c.max_ts)
                && samples.iter().all(|&(t, _)| crate::ts_storable(t))
            {
                kept.push(c.clone());
                continue;
            }
            let mut enc = crate::gorilla::GorillaEncoder::new();
            let (mut lo, mut hi) = (i64::MAX, i64::MIN);
            for &(t, v) in &samples {
                if crate::ts_storable(t) {
                    enc.append(t, v);
                    (lo, hi) = (lo.min(t), hi.max(t));
                } else {
                    lines.push(sample_line(key, t, v));
                }
            }
            if samples.len() < c.count as usize {
                lines.push(format!(
                    "undecodable_chunk\t{key}\t{}\t{}\t{}",
                    c.count - samples.len() as u32,
                    c.min_ts,
                    c.max_ts
                ));
            }
            if enc.count() > 0 {
                kept.push(MemChunk {
                    min_ts: lo,
                    max_ts: hi,
                    count: enc.count(),
                    bytes: Arc::from(enc.bytes()),
                });
            }
        }
        if !kept.is_empty() {
            keep.push((key.clone(), kept));
        }
    }
    let n = lines.len() as u64;
    (keep, lines, n)
}

/// Every sample of `frozen` as set-aside lines, and their count.
fn describe_frozen(frozen: &[FrozenSeries]) -> (Vec<String>, u64) {
    let mut lines = Vec::new();
    for (key, chunks) in frozen {
        for c in chunks {
            let mut n = 0;
            for (t, v) in GorillaDecoder::new(&c.bytes, c.count).map_while(|s| s.ok()) {
                lines.push(sample_line(key, t, v));
                n += 1;
            }
            if n < c.count {
                lines.push(format!(
                    "undecodable_chunk\t{key}\t{}\t{}\t{}",
                    c.count - n,
                    c.min_ts,
                    c.max_ts
                ));
            }
        }
    }
    let n = lines.len() as u64;
    (lines, n)
}

/// Writes (and fsyncs) `quarantine/set-aside-<unix ms>-<n>.txt`: what was
/// set aside, why, then one tab-separated line per sample or record.
fn write_set_aside(
    data_dir: &Path,
    n: u64,
    what: &str,
    why: &str,
    lines: &[String],
) -> Result<PathBuf> {
    use std::io::Write as _;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let q = data_dir.join(QUARANTINE_DIR);
    fs::create_dir_all(&q).map_err(|e| Error::io(&q, e))?;
    let path = files::set_aside_path(data_dir, now_ms, n);
    let mut text = format!(
        "# gpulse set aside data it could not store ({what}).\n\
         # why: {why}\n\
         # when: {now_ms} ms since the Unix epoch\n\
         # lines: sample<TAB>series<TAB>ts_ms<TAB>value<TAB>value bits, or\n\
         # rollup_1m<TAB>metric<TAB>cluster<TAB>row<TAB>rack<TAB>host<TAB>gpu<TAB>window_start_ms<TAB>count<TAB>sum<TAB>min<TAB>max<TAB>first<TAB>first_ts_ms<TAB>last<TAB>last_ts_ms\n"
    );
    for l in lines {
        text.push_str(l);
        text.push('\n');
    }
    let io = |e| Error::io(&path, e);
    let mut f = fs::File::create(&path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    crate::segment::writer::sync_dir(&q)?;
    Ok(path)
}

/// Appends `fresh` (newer) chunks to `carried` (older, from a failed flush),
/// keeping the result sorted by key.
fn merge_frozen(carried: &mut Vec<FrozenSeries>, fresh: &mut Vec<FrozenSeries>) {
    let mut map: std::collections::BTreeMap<Arc<SeriesKey>, Vec<MemChunk>> =
        carried.drain(..).collect();
    for (k, chunks) in fresh.drain(..) {
        map.entry(k).or_default().extend(chunks);
    }
    carried.extend(map);
}

/// The ids of the sealed files in `dir`, sorted. Leftover `*.tmp` files of an
/// interrupted flush (`what`: "segment", "rollup file") are deleted.
fn list_sealed<T: Ord>(
    dir: &Path,
    what: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Vec<T>> {
    let mut ids = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.ends_with(&format!(".{TMP_EXT}")) {
            warn!(file = %entry.path().display(), "removing unfinished {what} of an interrupted flush");
            fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
        } else if let Some(id) = parse(&name) {
            ids.push(id);
        }
    }
    ids.sort();
    Ok(ids)
}

/// Replays the WAL into `head`, skipping the WAL segments that the segments
/// already contain. Series that also live in segments start with their last
/// flushed timestamp, so that a batch re-sent after a restart counts as a
/// duplicate rather than as new samples.
fn replay_wal(
    data_dir: &Path,
    segments: &[Arc<Segment>],
    rollup_cut: u64,
    head: &mut Head,
    producers: &Producers,
    metrics: &StorageMetrics,
) -> Result<ReplayReport> {
    let mut flushed_until: HashMap<Arc<SeriesKey>, i64> = HashMap::new();
    for seg in segments {
        for ord in 0..seg.num_series() as u32 {
            if let Some(max) = seg.chunks(ord).iter().map(|c| c.max_ts).max() {
                let e = flushed_until
                    .entry(seg.series_key(ord).clone())
                    .or_insert(max);
                *e = (*e).max(max);
            }
        }
    }
    // WAL segments below the newest segment's cut are fully in segments: a
    // crash came between a flush and the WAL truncation. Skip them.
    let skip_below = segments.iter().map(|s| s.wal_cut()).max().unwrap_or(0);
    let mut refs: HashMap<u32, SeriesRef> = HashMap::new();
    // Definitions not yet used by a sample: a series is created at its first
    // sample, so one the WAL only defines (a checkpoint entry of a series
    // that has since gone idle, its samples all in segments) stays out of
    // the head and does not count against `max_series`.
    let mut defs: HashMap<u32, SeriesKey> = HashMap::new();
    let (mut replayed, mut orphans, mut refused) = (0u64, 0u64, 0u64);
    // Samples storage cannot hold, written by a version that let them in:
    // set aside rather than replayed, so that they cannot wedge every flush.
    let mut unstorable: Vec<String> = Vec::new();
    // WAL segments at or after `skip_below` but below `rollup_cut` are
    // counted in a rollup file already (a crash between a flush's rollup
    // file and its segment): they refill the head but not the rollups.
    let report = wal::replay(data_dir, skip_below, |n, rec| match rec {
        Record::Series { wal_ref, key } => {
            // A later definition of a ref replaces an earlier one.
            refs.remove(&wal_ref);
            defs.insert(wal_ref, key);
        }
        Record::Samples {
            refs: rs,
            ts_ms,
            values,
        } => {
            for ((wr, t), v) in rs.iter().zip(ts_ms).zip(values) {
                if !refs.contains_key(wr)
                    && let Some(key) = defs.remove(wr)
                {
                    let until = flushed_until.get(&key).copied();
                    match head.get_or_create(key) {
                        Ok(r) => {
                            if let Some(t) = until {
                                head.raise_last_ts(r, t);
                                head.raise_flushed(r, t);
                            }
                            refs.insert(*wr, r);
                        }
                        Err(_) => refused += 1,
                    }
                }
                match refs.get(wr) {
                    Some(&r) if !crate::ts_storable(t) => {
                        unstorable.push(sample_line(head.key(r), t, v));
                    }
                    Some(&r) => {
                        let seen = |key: &SeriesKey, ts| segments_have_sample(segments, key, ts);
                        let stored = matches!(
                            head.append_with(r, t, v, n >= rollup_cut, seen),
                            Appended::InOrder | Appended::OutOfOrder
                        );
                        replayed += stored as u64;
                    }
                    None => orphans += 1,
                }
            }
        }
        Record::Mark { producer, seq } => producers.raise(&producer, seq),
    })?;
    if let Some(t) = &report.torn_tail {
        warn!(file = %t.path.display(), offset = t.offset, "truncated a torn WAL tail (a write cut short by a crash; it was never acknowledged)");
    }
    for c in &report.corruption {
        error!(file = %c.path.display(), offset = c.offset, problem = c.what, "corrupt WAL record; kept the records before it and went on with the next segment");
        let q = data_dir.join(QUARANTINE_DIR);
        let name = c
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if fs::create_dir_all(&q)
            .and_then(|_| fs::copy(&c.path, q.join(format!("wal-{name}"))))
            .is_err()
        {
            warn!(file = %c.path.display(), "could not copy the corrupt WAL segment to quarantine/");
        }
    }
    if orphans > 0 || refused > 0 {
        error!(
            orphan_samples = orphans,
            refused_series = refused,
            "WAL samples without a usable series definition were not replayed"
        );
    }
    if !unstorable.is_empty() {
        let n = unstorable.len() as u64;
        metrics.samples_out_of_range.fetch_add(n, Relaxed);
        match write_set_aside(data_dir, u64::MAX, "WAL replay", OUT_OF_RANGE, &unstorable) {
            Ok(path) => {
                metrics.samples_set_aside.fetch_add(n, Relaxed);
                error!(file = %path.display(), samples = n, "WAL samples outside the storable range were set aside, not replayed");
            }
            Err(e) => {
                error!(error = %e, samples = n, "WAL samples outside the storable range were dropped: they could not be set aside");
            }
        }
    }
    metrics.wal_replayed_samples.fetch_add(replayed, Relaxed);
    metrics.wal_orphan_samples.fetch_add(orphans, Relaxed);
    Ok(report)
}

/// Puts the samples from `start` on in time order and drops repeated
/// timestamps, keeping the first occurrence (the earliest write: chunks are
/// read oldest first). A no-op, after one check, when they are in order.
pub(crate) fn normalize(ts: &mut Vec<i64>, vals: &mut Vec<f64>, start: usize) {
    if ts[start..].windows(2).all(|w| w[0] < w[1]) {
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

/// Writes frozen head chunks as a segment (see [`write_segment`]).
fn write_frozen(
    tmp: &Path,
    dst: &Path,
    seq: (u64, u64),
    wal_cut: u64,
    frozen: &[FrozenSeries],
) -> Result<SegmentSummary> {
    let keys: Vec<Arc<SeriesKey>> = frozen.iter().map(|(k, _)| k.clone()).collect();
    write_segment(tmp, dst, seq, wal_cut, &keys, |i, ts, vals| {
        let (key, chunks) = &frozen[i];
        for c in chunks {
            for s in GorillaDecoder::new(&c.bytes, c.count) {
                let (t, v) = s.map_err(|source| Error::ChunkDecode {
                    path: PathBuf::from("<head>"),
                    series: key.to_string(),
                    chunk: 0,
                    source,
                })?;
                ts.push(t);
                vals.push(v);
            }
        }
        normalize(ts, vals, 0);
        Ok(())
    })
}

/// Orders segments by the flush sequence numbers they cover, and deletes
/// those whose range lies inside another's: the sources of a compaction that
/// crashed after writing its result and before deleting them. A partial
/// overlap is never written by gpulse; such a segment is quarantined.
fn drop_compacted_sources(
    mut segments: Vec<Arc<Segment>>,
    q_dir: &Path,
    metrics: &StorageMetrics,
) -> Result<Vec<Arc<Segment>>> {
    segments.sort_by_key(|s| (s.seq_range().0, std::cmp::Reverse(s.seq_range().1)));
    let mut kept: Vec<Arc<Segment>> = Vec::with_capacity(segments.len());
    for s in segments {
        let (lo, hi) = s.seq_range();
        if let Some(last) = kept.last() {
            let (klo, khi) = last.seq_range();
            if lo >= klo && hi <= khi {
                warn!(segment = %s.path().display(), within = %last.path().display(), "deleting a compacted segment's leftover source");
                s.delete_when_unused();
                continue;
            }
            if lo <= khi {
                error!(segment = %s.path().display(), other = %last.path().display(), "segments overlap in flush sequence; quarantining the later one");
                fs::create_dir_all(q_dir).map_err(|e| Error::io(q_dir, e))?;
                let name = s
                    .path()
                    .file_name()
                    .map(|n| n.to_owned())
                    .unwrap_or_default();
                fs::rename(s.path(), q_dir.join(name)).map_err(|e| Error::io(s.path(), e))?;
                metrics.segments_quarantined.fetch_add(1, Relaxed);
                continue;
            }
        }
        kept.push(s);
    }
    Ok(kept)
}

/// Opens every rollup file: deletes leftover `*.tmp` files and the sources
/// of a merge that crashed before deleting them (a file whose id a newer file
/// covers), and quarantines files that fail validation. Returns the files by
/// id and the largest id seen (quarantine included).
fn open_rollups(
    data_dir: &Path,
    q_dir: &Path,
    metrics: &StorageMetrics,
) -> Result<(Vec<Arc<RollupFile>>, u64)> {
    let dir = data_dir.join(ROLLUPS_DIR);
    fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let mut max_id = 0;
    if let Ok(entries) = fs::read_dir(q_dir) {
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(q_dir, e))?;
            if let Some(id) = files::parse_rollup_file_name(&entry.file_name().to_string_lossy()) {
                max_id = max_id.max(id);
            }
        }
    }
    let ids = list_sealed(&dir, "rollup file", files::parse_rollup_file_name)?;
    let mut out: Vec<Arc<RollupFile>> = Vec::with_capacity(ids.len());
    for id in ids {
        max_id = max_id.max(id);
        let path = files::rollup_path(data_dir, id);
        match RollupFile::open(&path, id) {
            Ok(f) => out.push(Arc::new(f)),
            Err(e @ Error::Corrupt { .. }) => {
                error!(error = %e, "quarantining corrupt rollup file");
                fs::create_dir_all(q_dir).map_err(|e| Error::io(q_dir, e))?;
                let dst = q_dir.join(files::rollup_file_name(id));
                fs::rename(&path, &dst).map_err(|e| Error::io(&path, e))?;
                metrics.rollup_files_quarantined.fetch_add(1, Relaxed);
            }
            Err(e) => return Err(e),
        }
    }
    let all = out.clone();
    out.retain(|f| {
        let leftover = all.iter().any(|g| g.id() > f.id() && g.covers_id(f.id()));
        if leftover {
            warn!(file = %f.path().display(), "deleting a merged rollup file's leftover source");
            f.delete_when_unused();
        }
        !leftover
    });
    Ok((out, max_id))
}

fn max_segment_id(dir: &Path) -> Result<u64> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(0);
    };
    let mut max = 0;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        if let Some(id) = files::parse_segment_file_name(&entry.file_name().to_string_lossy()) {
            max = max.max(id.0);
        }
    }
    Ok(max)
}

#[derive(Debug, Clone)]
enum ChunkSource {
    Segment(Arc<Segment>, ChunkRef),
    Mem(MemChunk),
}

/// One series selected by [`Storage::select`]: its key and chunk handles. The
/// handles keep segments mapped while they live.
#[derive(Debug, Clone)]
pub struct SelectedSeries {
    pub key: Arc<SeriesKey>,
    chunks: Vec<ChunkSource>,
}

impl SelectedSeries {
    /// Decodes the samples in `[min_ts, max_ts]` and appends them to `ts_ms`
    /// and `values` in time order, one sample per timestamp (the first write
    /// wins where out-of-order writes overlapped).
    ///
    /// # Errors
    /// [`Error::Corrupt`] or [`Error::ChunkDecode`] if a chunk fails its
    /// checksum or does not decode; nothing is appended for that chunk onward.
    pub fn read_into(
        &self,
        min_ts: i64,
        max_ts: i64,
        ts_ms: &mut Vec<i64>,
        values: &mut Vec<f64>,
    ) -> Result<()> {
        let start = ts_ms.len();
        let (mut t_buf, mut v_buf) = (Vec::new(), Vec::new());
        for (i, c) in self.chunks.iter().enumerate() {
            match c {
                ChunkSource::Segment(seg, r) if r.min_ts >= min_ts && r.max_ts <= max_ts => {
                    seg.read_chunk(r, ts_ms, values)?;
                }
                ChunkSource::Segment(seg, r) => {
                    t_buf.clear();
                    v_buf.clear();
                    seg.read_chunk(r, &mut t_buf, &mut v_buf)?;
                    for (&t, &v) in t_buf.iter().zip(&v_buf) {
                        if t >= min_ts && t <= max_ts {
                            ts_ms.push(t);
                            values.push(v);
                        }
                    }
                }
                ChunkSource::Mem(m) => {
                    for s in GorillaDecoder::new(&m.bytes, m.count) {
                        let (t, v) = s.map_err(|source| Error::ChunkDecode {
                            path: PathBuf::from("<head>"),
                            series: self.key.to_string(),
                            chunk: i,
                            source,
                        })?;
                        if t >= min_ts && t <= max_ts {
                            ts_ms.push(t);
                            values.push(v);
                        }
                    }
                }
            }
        }
        normalize(ts_ms, values, start);
        Ok(())
    }

    /// Upper bound of the samples in the selected chunks.
    pub fn max_samples(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| match c {
                ChunkSource::Segment(_, r) => r.count as usize,
                ChunkSource::Mem(m) => m.count as usize,
            })
            .sum()
    }
}

mod import;
pub use import::RollupImportSummary;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod upkeep_tests;
