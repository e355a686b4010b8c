//! Opening a data directory: [`Storage::open`] takes the directory lock,
//! opens the segments and rollup files (cleaning up after an interrupted
//! flush or merge, quarantining files that fail validation) and replays the
//! WAL.

use std::fs;
use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tracing::{error, info, warn};

#[cfg(test)]
use super::faults::Faults;
use super::replay::replay_wal;
use super::set_aside::move_to_quarantine;
use super::{Producers, State, Storage, StorageConfig, StorageMetrics};
use crate::Result;
use crate::error::Error;
use crate::files::{self, QUARANTINE_DIR, ROLLUPS_DIR, SEGMENTS_DIR, TMP_EXT};
use crate::head::Head;
use crate::rollup::file::RollupFile;
use crate::rollup::{RollupLevel, RollupTier};
use crate::segment::Segment;
use crate::wal::Wal;

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
        let keys = Arc::new(crate::series::SharedKeys::default());
        let mut segments = Vec::with_capacity(ids.len());
        for id in ids {
            max_id = max_id.max(id.0);
            let path = files::segment_path(&config.data_dir, id);
            match Segment::open_sharing(&path, id, &keys) {
                Ok(s) => segments.push(Arc::new(s)),
                Err(e @ Error::Corrupt { .. }) => {
                    error!(error = %e, "quarantining corrupt segment");
                    move_to_quarantine(&q_dir, &path, &files::segment_file_name(id), None)?;
                    metrics.segments_quarantined.fetch_add(1, Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let segments = drop_compacted_sources(segments, &q_dir, &metrics)?;
        let (rollups, max_rollup_id) = open_rollups(&config.data_dir, &q_dir, &metrics)?;
        let samples: u64 = segments.iter().map(|s| s.num_samples()).sum();
        let mut head = Head::with_keys(
            config.max_chunk_samples,
            config.max_series,
            config.ooo_window.as_millis() as i64,
            keys.clone(),
        );
        let producers = Producers::default();
        let inventory = crate::inventory::Inventory::open(&config.data_dir)?;
        let rollup_cut = rollups.iter().map(|f| f.wal_cut()).max().unwrap_or(0);
        let raw_cut = rollups
            .iter()
            .map(|f| f.raw_cut())
            .max()
            .unwrap_or(i64::MIN);
        let replay = replay_wal(
            &config.data_dir,
            &segments,
            rollup_cut,
            raw_cut,
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
        let storage = Self {
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
            raw_floor: AtomicI64::new(raw_cut),
            wal,
            next_segment: AtomicU64::new(max_id + 1),
            next_rollup: AtomicU64::new(max_rollup_id + 1),
            metrics,
            replay,
            producers,
            inventory,
            keys,
            on_full: std::sync::OnceLock::new(),
            full_signalled: std::sync::atomic::AtomicBool::new(false),
            observer: std::sync::OnceLock::new(),
            _lock: lock,
        };
        storage.migrate_legacy_rollups()?;
        // Migration may have set a raw cut.
        storage.raw_floor.fetch_max(storage.raw_cut(), Relaxed);
        Ok(storage)
    }

    /// Rewrites the rollup files that flushes wrote before version 4, which
    /// hold the gpu-level minute records of every sample, as one file
    /// without those that raw data still holds: from the minute of the
    /// oldest raw sample on, they are folded from the raw data when read
    /// ([`RollupFile::raw_cut`]), and would otherwise count twice. Without
    /// raw data, every record stays and the cut goes after the newest.
    ///
    /// # Errors
    /// Writing the new file; the old ones then stay, and the next open
    /// tries again.
    fn migrate_legacy_rollups(&self) -> Result<()> {
        let state = lock!(self.state.read());
        let legacy: Vec<_> = state
            .rollups
            .iter()
            .filter(|f| f.is_legacy_flush())
            .cloned()
            .collect();
        if legacy.is_empty() {
            return Ok(());
        }
        let minute = RollupTier::Minute;
        let oldest_raw = self
            .select_in(&state, (&[], &|_| true), i64::MIN, i64::MAX, true)
            .iter()
            .filter_map(|s| s.min_ts())
            .min();
        drop(state);
        let raw_cut = match oldest_raw {
            Some(t) => minute.window_start(t),
            None => legacy
                .iter()
                .map(|f| f.time_range().1)
                .max()
                .map_or(i64::MIN, |t| {
                    minute.window_start(t).saturating_add(minute.window_ms())
                }),
        };
        info!(
            files = legacy.len(),
            raw_cut_ms = raw_cut,
            "rewriting rollup files of an earlier version without the gpu-level minutes that raw data holds"
        );
        self.merge_rollups(&legacy, raw_cut, |tier, level, ws| {
            tier == minute && level == RollupLevel::Gpu && ws >= raw_cut
        })
    }
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
                move_to_quarantine(q_dir, &path, &files::rollup_file_name(id), None)?;
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
