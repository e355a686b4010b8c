//! Retention: [`Storage::enforce_retention`] drops expired segments, after
//! writing the gpu-level minute records of their samples, and the expired
//! records of each rollup tier.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tracing::{error, info};

use super::Storage;
#[cfg(doc)]
use super::StorageConfig;
use crate::Result;
use crate::rollup::{RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier};

/// About how many raw samples one rollup file written by
/// [`Storage::advance_raw_cut`] folds: its records are gathered in memory
/// first, one per series and minute (at most one per sample).
const RAW_CUT_STEP_SAMPLES: u64 = 4 << 20;

impl Storage {
    /// Drops every segment whose newest sample is older than the retention
    /// (see [`StorageConfig::retention`]) at `now_ms`, rounded down to a minute. A query that holds a dropped segment keeps reading it; the
    /// file goes when the query ends. Returns how many segments were dropped.
    ///
    /// Before that, the gpu-level minute records of every raw sample before
    /// the minute after the newest sample to drop are written to rollup
    /// files, which move the raw cut there ([`Self::advance_raw_cut`]). If that fails, it is logged and no
    /// segment is dropped.
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

    /// [`Self::enforce_retention`], for a caller that holds the upkeep lock.
    pub(super) fn retention_locked(&self, now_ms: i64) -> usize {
        self.enforce_rollup_retention(now_ms);
        let Some(keep) = self.config.retention else {
            return 0;
        };
        self.drop_raw_before(now_ms.saturating_sub(keep.as_millis() as i64), now_ms)
    }

    /// Drops the segments whose newest sample is before the minute of
    /// `cutoff`, after moving the raw cut past them. The cut thus stays at
    /// or before `cutoff`, and appends refuse nothing newer (see
    /// [`Storage::raw_cut`]). Caller holds the upkeep lock.
    pub(crate) fn drop_raw_before(&self, cutoff: i64, now_ms: i64) -> usize {
        let cutoff = RollupTier::Minute.window_start(cutoff);
        // The minute after the newest sample to drop: raw samples before it
        // have their gpu-level minutes in rollup files once this succeeds.
        let newest = lock!(self.state.read())
            .segments
            .iter()
            .map(|s| s.time_range().1)
            .filter(|&t| t < cutoff)
            .max();
        let Some(newest) = newest else {
            return 0;
        };
        let raw_cut = RollupTier::Minute
            .window_start(newest)
            .saturating_add(RollupTier::Minute.window_ms());
        if let Err(e) = self.move_raw_cut(raw_cut, now_ms) {
            error!(error = %e, "retention: writing the gpu-level minutes of expiring raw data failed; the raw data stays");
            return 0;
        }
        // Every sample before the raw cut (at or before `cutoff`) has its
        // minutes in rollup files now, those of a segment the raw cut's
        // flush wrote too.
        let mut state = lock!(self.state.write());
        let (expired, kept): (Vec<_>, Vec<_>) = state
            .segments
            .drain(..)
            .partition(|s| s.time_range().1 < raw_cut);
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

    /// Moves the raw cut to `cut` (a minute boundary): from here on appends
    /// refuse samples before it ([`Storage::raw_cut`]); if memory still holds
    /// one (a late sample, or a flush that failed), the head is flushed; then
    /// [`Self::advance_raw_cut`] writes the gpu-level minutes. So the WAL
    /// after the last flush holds no stored sample before the cut, only
    /// refused ones, and replay, which refuses what is before the cut, agrees
    /// with what appends did even after retention dropped the raw data a
    /// refused repeat would have been checked against. Caller holds the
    /// upkeep lock.
    ///
    /// # Errors
    /// The flush or a rollup file's write; the refusal stays in force, the
    /// cut where the last file put it.
    pub(crate) fn move_raw_cut(&self, cut: i64, now_ms: i64) -> Result<()> {
        {
            // No append is between its WAL write and its head append.
            let _gate = lock!(self.gate.write());
            self.raw_floor.fetch_max(cut, Relaxed);
        }
        let oldest_in_memory = {
            let state = lock!(self.state.read());
            let frozen = state.frozen.as_ref().and_then(|f| {
                f.iter()
                    .flat_map(|(_, chunks)| chunks.iter().map(|c| c.min_ts))
                    .min()
            });
            let head = lock!(self.head.read()).min_ts();
            frozen.into_iter().chain(head).min()
        };
        if let Some(oldest) = oldest_in_memory.filter(|&t| t < cut) {
            info!(
                oldest_sample_ms = oldest,
                raw_cut_ms = cut,
                "retention: flushing first, since memory holds samples before the new raw cut"
            );
            self.flush_locked()?;
        }
        self.advance_raw_cut(cut, now_ms)
    }

    /// Writes the gpu-level minute records of the segments' raw samples
    /// between the raw cut and `cut` (a minute boundary) to rollup files,
    /// each file moving the raw cut to where it ends. A file covers about
    /// [`RAW_CUT_STEP_SAMPLES`] samples (from the chunks' counts), and a
    /// stretch without samples costs nothing. Records that `retention_1m` has
    /// expired at `now_ms` are not written. The raw samples stay: the cut
    /// makes queries fold only those after it. A crash between a file and
    /// the deletion of the raw data thus counts nothing twice. Samples before
    /// the cut that are still in memory (late ones) are left to the next
    /// flush, which writes the gpu-level minutes before the cut. Caller holds
    /// the upkeep lock.
    ///
    /// # Errors
    /// Writing a rollup file; the cut stays where the last file put it.
    pub(crate) fn advance_raw_cut(&self, cut: i64, now_ms: i64) -> Result<()> {
        self.advance_raw_cut_by(cut, now_ms, RAW_CUT_STEP_SAMPLES)
    }

    /// [`Self::advance_raw_cut`] with files of about `step_samples` samples.
    pub(crate) fn advance_raw_cut_by(
        &self,
        cut: i64,
        now_ms: i64,
        step_samples: u64,
    ) -> Result<()> {
        let minute = RollupTier::Minute;
        let expired_1m = self
            .config
            .rollup_retention(minute)
            .map(|d| now_ms.saturating_sub(d.as_millis() as i64));
        loop {
            let state = lock!(self.state.read());
            let from = state.raw_cut();
            if from >= cut {
                return Ok(());
            }
            // The step ends at the first chunk start where the samples
            // counted pass the budget: those of the chunks that straddle
            // `from`, then of the chunks that start in [from, cut), in
            // order. So each step passes at least one chunk start, and a
            // stretch without samples costs nothing.
            let (mut straddling, mut starts) = (0u64, Vec::new());
            for seg in &state.segments {
                let (lo, hi) = seg.time_range();
                if hi < from || lo >= cut {
                    continue;
                }
                for ord in 0..seg.num_series() as u32 {
                    for c in seg.chunks(ord) {
                        if c.max_ts < from || c.min_ts >= cut {
                            continue;
                        }
                        if c.min_ts < from {
                            straddling += u64::from(c.count);
                        } else {
                            starts.push((c.min_ts, u64::from(c.count)));
                        }
                    }
                }
            }
            starts.sort_unstable();
            let lo = match (straddling, starts.first()) {
                (0, Some(&(first, _))) => minute.window_start(first),
                (0, None) => cut,
                _ => from,
            };
            let mut samples = straddling;
            let over = starts.iter().find(|&&(_, n)| {
                samples += n;
                samples > step_samples
            });
            let to = over.map_or(cut, |&(t, _)| {
                minute
                    .window_start(t)
                    .max(lo.saturating_add(minute.window_ms()))
                    .min(cut)
            });
            let mut groups: BTreeMap<RollupGroup, BTreeMap<i64, RollupRecord>> = BTreeMap::new();
            let filter = RollupFilter::default();
            self.fold_raw_minutes(&state, &filter, lo, to - 1, false, |g, r| {
                let gone = expired_1m
                    .is_some_and(|c| r.window_start_ms.saturating_add(minute.window_ms() - 1) < c);
                if !gone {
                    let w = match groups.get_mut(g) {
                        Some(w) => w,
                        None => groups.entry(g.clone()).or_default(),
                    };
                    w.entry(r.window_start_ms)
                        .and_modify(|m| m.merge(&r))
                        .or_insert(r);
                }
            });
            let wal_cut = state.rollups.iter().map(|f| f.wal_cut()).max().unwrap_or(0);
            drop(state);
            let mut tables = crate::rollup::empty_tables();
            tables[minute.index()][RollupLevel::Gpu.index()] = groups;
            let file = self.write_rollups(wal_cut, to, &tables, None)?;
            info!(file = %file.path().display(), raw_cut_ms = to, bytes = file.size_bytes(), "retention: wrote the gpu-level minutes of expiring raw data");
            let mut state = lock!(self.state.write());
            state.rollups.push(Arc::new(file));
            state.rollups.sort_by_key(|f| f.id());
        }
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
        if let Err(e) = self.merge_rollups(&sources, i64::MIN, |tier, _, ws| expired(tier, ws)) {
            error!(error = %e, "rollup retention failed; the files stay as they are");
        }
    }
}
