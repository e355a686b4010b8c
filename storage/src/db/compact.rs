//! Compaction: [`Storage::compact`] merges the segments, and the rollup
//! files, of a finished compaction window into one.

use std::fs;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use tracing::{error, info};

use super::set_aside::move_to_quarantine;
use super::{Storage, normalize};
use crate::files;
use crate::rollup::file::RollupFile;
use crate::rollup::{RollupLevel, RollupTier};
use crate::segment::Segment;
use crate::segment::writer::{SegmentSummary, publish, write_segment_tmp};
use crate::series::KeyArc;
use crate::{Error, Result, SegmentId};

impl Storage {
    /// Merges `sources` into one new rollup file, dropping the records that
    /// `dropped(tier, level, window_start)` says go (past their tier's
    /// retention, say), then swaps them in and deletes the sources. The new
    /// file's raw cut is the largest of `raw_cut` and the sources'. Caller
    /// holds the flush lock.
    pub(super) fn merge_rollups(
        &self,
        sources: &[Arc<RollupFile>],
        raw_cut: i64,
        dropped: impl Fn(RollupTier, RollupLevel, i64) -> bool,
    ) -> Result<()> {
        let started = Instant::now();
        let mut tables = crate::rollup::empty_tables();
        for f in sources {
            if let Err(e) = f.merge_into(&mut tables) {
                if matches!(e, Error::Corrupt { .. }) {
                    self.quarantine_rollups(f, &e);
                }
                return Err(e);
            }
        }
        for tier in RollupTier::ALL {
            for level in RollupLevel::ALL {
                let t = &mut tables[tier.index()][level.index()];
                for w in t.values_mut() {
                    w.retain(|&ws, _| !dropped(tier, level, ws));
                }
                t.retain(|_, w| !w.is_empty());
            }
        }
        let wal_cut = sources.iter().map(|f| f.wal_cut()).max().unwrap_or(0);
        let raw_cut = sources.iter().map(|f| f.raw_cut()).fold(raw_cut, i64::max);
        let covers = sources
            .iter()
            .flat_map(|f| f.covers().iter().copied())
            .collect();
        let merged = Arc::new(self.write_rollups(wal_cut, raw_cut, &tables, Some(covers))?);
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

    /// Takes a rollup file that failed to read out of the store and moves it
    /// to `quarantine/`, as opening does with one that fails to validate: a
    /// block found corrupt at its first read (version 5 files check their
    /// blocks then) would otherwise fail every merge of its window.
    fn quarantine_rollups(&self, f: &Arc<RollupFile>, why: &Error) {
        lock!(self.state.write())
            .rollups
            .retain(|g| !Arc::ptr_eq(f, g));
        let q = self.config.data_dir.join(files::QUARANTINE_DIR);
        let name = files::rollup_file_name(f.id());
        let note = format!("{name} failed to read when merged: {why}\n");
        if let Err(e) = move_to_quarantine(&q, f.path(), &name, Some(&note)) {
            error!(file = %f.path().display(), error = %e, "could not move a corrupt rollup file to quarantine/; deleting it");
            f.delete_when_unused();
        }
        error!(file = %f.path().display(), error = %why, "quarantined a corrupt rollup file; its records are lost");
        self.metrics.rollup_files_quarantined.fetch_add(1, Relaxed);
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
        self.merge_rollups(&group, i64::MIN, |_, _, _| false)?;
        Ok(true)
    }

    /// Merges the segments of the oldest finished compaction window (one that a
    /// later segment has moved past) into one segment, if it has two or more;
    /// failing that, [`EAGER_MERGE`] segments of the same tier in a window
    /// still open (see [`eager_group`]).
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
    pub(super) fn compact_locked(&self) -> Result<Option<SegmentSummary>> {
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
            group = eager_group(&segments, window_of);
        }
        if group.len() < 2 {
            return Ok(None);
        }

        let started = Instant::now();
        let mut refs: std::collections::BTreeMap<KeyArc, Vec<(usize, u32)>> = Default::default();
        for (gi, seg) in group.iter().enumerate() {
            for ord in 0..seg.num_series() as u32 {
                refs.entry(seg.series_key(ord).clone())
                    .or_default()
                    .push((gi, ord));
            }
        }
        let keys: Vec<KeyArc> = refs.keys().cloned().collect();
        let sources: Vec<&Vec<(usize, u32)>> = refs.values().collect();
        let seq = (group[0].seq_range().0, group[group.len() - 1].seq_range().1);
        let wal_cut = group.iter().map(|s| s.wal_cut()).max().unwrap_or(0);
        let id = SegmentId(self.next_segment.fetch_add(1, Relaxed));
        let tmp = files::segment_tmp_path(&self.config.data_dir, id);
        let dst = files::segment_path(&self.config.data_dir, id);
        let written = write_segment_tmp(&tmp, &dst, seq, wal_cut, &keys, |i, ts, vals| {
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
            // Validated before its rename: a merge that does not open is
            // never published.
            let merged = self.open_segment_tmp(&tmp, &dst, id)?;
            publish(&tmp, &dst)?;
            Ok((s, merged))
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
}

/// How many segments of one tier in a window still open are merged into one.
/// A window's flushes stay open until it finishes, and each open segment
/// holds its series index in memory (about 110 B a series) and is one more
/// place for a query to look: at the default 2-minute flush and 2-hour
/// window that was 60 segments. Merged eight at a time, in tiers, a window
/// holds at most seven of each tier (at most 14 for 60 flushes), and a
/// sample is rewritten about once per tier (`log8` of the flushes in a
/// window) before the window's final merge.
pub(crate) const EAGER_MERGE: usize = 8;

/// The tier of a segment: `log8` of the flush sequence numbers it covers (a
/// flushed segment covers one; a merge of eight of them about eight, plus
/// the numbers merges took in between).
fn tier(s: &Segment) -> u32 {
    let (a, b) = s.seq_range();
    (b.saturating_sub(a) + 1).ilog(EAGER_MERGE as u64)
}

/// The oldest [`EAGER_MERGE`] consecutive segments of one tier in one window
/// that no later segment has moved past, or nothing.
fn eager_group(
    segments: &[Arc<Segment>],
    window_of: impl Fn(&Segment) -> i64,
) -> Vec<Arc<Segment>> {
    let newest = segments.iter().map(|s| window_of(s)).max();
    let mut run: Vec<Arc<Segment>> = Vec::new();
    for s in segments {
        let open = Some(window_of(s)) == newest;
        let joins = run
            .last()
            .is_some_and(|r| window_of(r) == window_of(s) && tier(r) == tier(s));
        if !(open && joins) {
            run.clear();
        }
        if open {
            run.push(s.clone());
        }
        if run.len() == EAGER_MERGE {
            return run;
        }
    }
    Vec::new()
}
