//! [`Storage`]: the head plus the sealed segments of one data directory.
//!
//! Write path: [`Storage::series_ref`] once per series, then
//! [`Storage::append`] per batch into the head. [`Storage::flush`] seals the
//! head into a new segment. Read path: [`Storage::select`] returns, per matching
//! series, handles to every chunk overlapping the time range, in time order.
//!
//! Durability in this version: a sample is durable once a flush that includes
//! it returns. There is no WAL yet (issue #3), so a crash loses the head; a
//! graceful shutdown flushes it.
//!
//! Locks are always taken in the order `state` -> `head`, so a query sees
//! every sample exactly once, whether a flush is running or not.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tracing::{error, info, warn};

use crate::error::Error;
use crate::files::{self, QUARANTINE_DIR, SEGMENTS_DIR, TMP_EXT};
use crate::gorilla::{DecodeError, GorillaDecoder};
use crate::head::{FrozenSeries, Head, MemChunk, SeriesRef};
use crate::segment::writer::{SegmentSummary, write_segment};
use crate::segment::{ChunkRef, Segment};
use crate::series::{Matcher, SeriesKey};
use crate::{Result, SegmentId};

/// Configuration of a [`Storage`].
#[derive(Debug, Clone)]
pub struct StorageConfig {
    /// Root of the data directory; created if missing.
    pub data_dir: PathBuf,
    /// Samples per head chunk before it is sealed. Default 240 (4 min at 1 Hz).
    pub max_chunk_samples: u32,
    /// Most series the head holds; more are rejected. Default 5,000,000.
    pub max_series: usize,
}

impl StorageConfig {
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            max_chunk_samples: 240,
            max_series: 5_000_000,
        }
    }
}

/// Counters of the storage engine (exported by the binaries).
#[derive(Debug, Default)]
pub struct StorageMetrics {
    pub samples_appended: AtomicU64,
    pub samples_out_of_order: AtomicU64,
    pub segments_quarantined: AtomicU64,
    pub flushes: AtomicU64,
}

/// What [`Storage::append`] did with a batch.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppendOutcome {
    pub accepted: u32,
    /// Dropped: at or before the series' last timestamp.
    pub out_of_order: u32,
}

/// Point-in-time figures of a [`Storage`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StorageStats {
    pub head_series: u64,
    pub head_samples: u64,
    pub segments: u64,
    pub segment_samples: u64,
    pub segment_bytes: u64,
}

#[derive(Debug, Default)]
struct State {
    segments: Vec<Arc<Segment>>,
    /// Head data being written to a segment; visible to queries meanwhile.
    frozen: Option<Arc<Vec<FrozenSeries>>>,
}

/// The storage engine of one data directory. Thread-safe.
#[derive(Debug)]
pub struct Storage {
    config: StorageConfig,
    state: RwLock<State>,
    head: RwLock<Head>,
    flush_lock: Mutex<()>,
    next_segment: AtomicU64,
    metrics: StorageMetrics,
}

/// Panics only if another thread panicked while holding the lock, which is a bug.
macro_rules! lock {
    ($e:expr) => {
        $e.expect("BUG: storage lock poisoned")
    };
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
        let metrics = StorageMetrics::default();
        let started = Instant::now();

        let mut max_id = max_segment_id(&q_dir)?;
        let mut ids = Vec::new();
        for entry in fs::read_dir(&seg_dir).map_err(|e| Error::io(&seg_dir, e))? {
            let entry = entry.map_err(|e| Error::io(&seg_dir, e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.ends_with(&format!(".{TMP_EXT}")) {
                warn!(file = %entry.path().display(), "removing unfinished segment of an interrupted flush");
                fs::remove_file(entry.path()).map_err(|e| Error::io(entry.path(), e))?;
            } else if let Some(id) = files::parse_segment_file_name(&name) {
                ids.push(id);
            }
        }
        ids.sort();
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
        let samples: u64 = segments.iter().map(|s| s.num_samples()).sum();
        info!(
            dir = %config.data_dir.display(),
            segments = segments.len(),
            samples,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "storage opened"
        );
        let head = Head::new(config.max_chunk_samples, config.max_series);
        Ok(Self {
            config,
            state: RwLock::new(State {
                segments,
                frozen: None,
            }),
            head: RwLock::new(head),
            flush_lock: Mutex::new(()),
            next_segment: AtomicU64::new(max_id + 1),
            metrics,
        })
    }

    pub fn data_dir(&self) -> &Path {
        &self.config.data_dir
    }

    pub fn metrics(&self) -> &StorageMetrics {
        &self.metrics
    }

    /// Returns the head handle of a series, creating the series if needed.
    ///
    /// # Errors
    /// [`Error::SeriesLimit`] when the head is full.
    pub fn series_ref(&self, key: SeriesKey) -> Result<SeriesRef> {
        if let Some(r) = lock!(self.head.read()).lookup(&key) {
            return Ok(r);
        }
        lock!(self.head.write()).get_or_create(key)
    }

    /// Appends a columnar batch to the head. Row `i` is
    /// `(refs[i], ts_ms[i], values[i])`. When this returns, the accepted
    /// samples are visible to queries. All-or-nothing on errors.
    ///
    /// # Errors
    /// [`Error::BadBatch`] if the columns differ in length or a ref is unknown.
    pub fn append(
        &self,
        refs: &[SeriesRef],
        ts_ms: &[i64],
        values: &[f64],
    ) -> Result<AppendOutcome> {
        if refs.len() != ts_ms.len() || refs.len() != values.len() {
            return Err(Error::BadBatch {
                reason: "columns differ in length",
            });
        }
        let mut head = lock!(self.head.write());
        if !refs.iter().all(|&r| head.contains(r)) {
            return Err(Error::BadBatch {
                reason: "unknown series ref",
            });
        }
        let mut out = AppendOutcome::default();
        for ((&r, &t), &v) in refs.iter().zip(ts_ms).zip(values) {
            if head.append(r, t, v) {
                out.accepted += 1;
            } else {
                out.out_of_order += 1;
            }
        }
        drop(head);
        self.metrics
            .samples_appended
            .fetch_add(out.accepted as u64, Relaxed);
        self.metrics
            .samples_out_of_order
            .fetch_add(out.out_of_order as u64, Relaxed);
        Ok(out)
    }

    /// Seals everything in the head into a new segment. Returns `None` if the
    /// head was empty. One flush runs at a time; appends and queries go on
    /// while it writes.
    ///
    /// # Errors
    /// I/O errors. The frozen data then goes back to queries' view and is
    /// retried by the next flush.
    pub fn flush(&self) -> Result<Option<SegmentSummary>> {
        let _one_at_a_time = lock!(self.flush_lock.lock());
        let frozen = {
            let mut state = lock!(self.state.write());
            let mut carried = state
                .frozen
                .take()
                .map(|f| (*f).clone())
                .unwrap_or_default();
            let mut fresh = lock!(self.head.write()).freeze();
            if carried.is_empty() {
                carried = fresh;
            } else if !fresh.is_empty() {
                merge_frozen(&mut carried, &mut fresh);
            }
            if carried.is_empty() {
                return Ok(None);
            }
            let frozen = Arc::new(carried);
            state.frozen = Some(frozen.clone());
            frozen
        };

        let started = Instant::now();
        let id = SegmentId(self.next_segment.fetch_add(1, Relaxed));
        let tmp = files::segment_tmp_path(&self.config.data_dir, id);
        let dst = files::segment_path(&self.config.data_dir, id);
        let written =
            write_segment(&tmp, &dst, &frozen).and_then(|s| Ok((s, Segment::open(&dst, id)?)));
        let (summary, segment) = match written {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                error!(error = %e, "flush failed; the data stays in memory and is retried by the next flush");
                return Err(e);
            }
        };
        let mut state = lock!(self.state.write());
        state.segments.push(Arc::new(segment));
        state.frozen = None;
        drop(state);
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

    pub fn stats(&self) -> StorageStats {
        let state = lock!(self.state.read());
        let head = lock!(self.head.read());
        StorageStats {
            head_series: head.num_series() as u64,
            head_samples: head.num_samples(),
            segments: state.segments.len() as u64,
            segment_samples: state.segments.iter().map(|s| s.num_samples()).sum(),
            segment_bytes: state.segments.iter().map(|s| s.size_bytes()).sum(),
        }
    }
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
    /// Decodes the samples in `[min_ts, max_ts]` and appends them, in time
    /// order, to `ts_ms` and `values`.
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
        for (i, c) in self.chunks.iter().enumerate() {
            let decode_err = |source: DecodeError, path: &Path| Error::ChunkDecode {
                path: path.to_path_buf(),
                series: self.key.to_string(),
                chunk: i,
                source,
            };
            let (decoder, path): (GorillaDecoder<'_>, &Path) = match c {
                ChunkSource::Segment(seg, r) => (seg.chunk_decoder(r)?, seg.path()),
                ChunkSource::Mem(m) => {
                    (GorillaDecoder::new(&m.bytes, m.count), Path::new("<head>"))
                }
            };
            for s in decoder {
                let (t, v) = s.map_err(|e| decode_err(e, path))?;
                if t >= min_ts && t <= max_ts {
                    ts_ms.push(t);
                    values.push(v);
                }
            }
        }
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

#[cfg(test)]
mod tests;
