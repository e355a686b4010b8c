//! Importing pre-aggregated rollup history: [`Storage::import_rollups`].
//!
//! An import writes one new rollup file holding the given gpu-level records
//! and the host, rack, row and cluster records merged from them, each in the
//! tier it was given in (an hour record is not folded into the day tier: a
//! caller that imports both supplies both). Rollup records are deltas, so the
//! file simply adds to what is already stored, like a flush's file does.
//!
//! # The WAL cut of an imported file
//!
//! A rollup file's `wal_cut` claims "every WAL segment numbered below this is
//! counted in rollup files"; WAL replay folds samples into the rollups only
//! from WAL segments at or after the *largest* cut of all rollup files, and a
//! merge of files takes the largest cut of its sources. An imported file
//! counts no WAL sample at all, so it records `wal_cut = 0`, the claim that
//! is always true: the largest cut stays the one of the newest flush (or of a
//! merge of flushed files), and replay after a crash refolds exactly the
//! samples that no flushed rollup file holds, whether they were appended
//! before or after the import. Recording the WAL position at import time
//! instead would drop, at the next replay, the rollups of the samples still
//! in the head (the head is not flushed by an import).
//!
//! The file is written like any rollup file (`*.tmp`, fsync, rename,
//! directory fsync), so an import is all or nothing across a crash. Records
//! are validated first; a bad one fails the whole import with
//! [`Error::BadBatch`] and nothing is written.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::Storage;
use crate::Result;
use crate::error::Error;
use crate::rollup::{
    RollupGroup, RollupLevel, RollupRecord, RollupTier, Table, Tables, empty_tables,
};

/// Most windows one tier of one import may span, so that no group's records
/// outgrow a rollup file block (2^24 windows: 31 years of minutes).
const MAX_WINDOWS: i64 = 1 << 24;

/// What [`Storage::import_rollups`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RollupImportSummary {
    /// Id of the new rollup file; `None` when there was nothing to import.
    pub file_id: Option<u64>,
    /// Gpu-level records after merging the ones of the same group and window.
    pub gpu_records: u64,
    /// Records written over all levels.
    pub records: u64,
    /// Size of the new file.
    pub bytes: u64,
}

fn bad(reason: &'static str) -> Error {
    Error::BadBatch { reason }
}

/// Checks one record of `tier`: the rule every rollup file reader and
/// writer applies (`rollup::file::record_problem`).
fn check(tier: RollupTier, r: &RollupRecord) -> Result<()> {
    match crate::rollup::file::record_problem(tier, r) {
        Some(reason) => Err(bad(reason)),
        None => Ok(()),
    }
}

/// Merges `r` into `windows` (same rules as every rollup merge).
fn merge(windows: &mut BTreeMap<i64, RollupRecord>, r: &RollupRecord) {
    windows
        .entry(r.window_start_ms)
        .and_modify(|m| m.merge(r))
        .or_insert(*r);
}

/// Fills the coarser levels of one tier from its gpu-level table. The gpu
/// table is sorted by (metric, cluster, row, rack, host, gpu) and a coarser
/// group blanks a suffix of those fields, so the gpu groups of one coarser
/// group are consecutive: one run, one insertion.
fn fill_levels(tier_tables: &mut [Table; 5]) {
    let (gpu, coarser) = tier_tables.split_at_mut(1);
    for (i, table) in coarser.iter_mut().enumerate() {
        let level = RollupLevel::ALL[i + 1];
        let mut run: Option<(RollupGroup, BTreeMap<i64, RollupRecord>)> = None;
        for (g, windows) in &gpu[0] {
            let cg = g.at_level(level);
            match &mut run {
                Some((rg, w)) if *rg == cg => windows.values().for_each(|r| merge(w, r)),
                _ => {
                    if let Some((rg, w)) = run.take() {
                        table.insert(rg, w);
                    }
                    run = Some((cg, windows.clone()));
                }
            }
        }
        if let Some((rg, w)) = run {
            table.insert(rg, w);
        }
    }
}

impl Storage {
    /// Imports pre-aggregated rollup history: per item, a tier, a gpu-level
    /// group (the group of one GPU's metric, as [`RollupGroup::of_series`]
    /// builds it) and records of that tier. Records of the same (tier,
    /// group, window), in one item or several, are merged. Writes one new
    /// rollup file with these records and the host, rack, row and cluster
    /// records merged from them, per tier; tiers are not derived from one
    /// another. The records add to what is stored (rollups are deltas):
    /// importing the same history twice counts it twice, and an imported
    /// window that raw samples also fill holds both. Appends, flushes and
    /// queries go on while the records are merged; the file write waits for
    /// a flush in progress. See the module docs for the file's WAL cut.
    ///
    /// # Errors
    /// [`Error::BadBatch`] for a record that is not a valid rollup record of
    /// its tier (window start not aligned or outside [`crate::MIN_TS_MS`]..=
    /// [`crate::MAX_TS_MS`], count 0, first
    /// or last timestamp outside the window or first after last), or a tier
    /// spanning more than 2^24 windows; nothing is written then. I/O errors
    /// writing the file (nothing is kept).
    pub fn import_rollups<I>(&self, items: I) -> Result<RollupImportSummary>
    where
        I: IntoIterator<Item = (RollupTier, RollupGroup, Vec<RollupRecord>)>,
    {
        let mut tables: Tables = empty_tables();
        let mut span: [Option<(i64, i64)>; 3] = [None; 3];
        for (tier, group, records) in items {
            if records.is_empty() {
                continue;
            }
            for r in &records {
                check(tier, r)?;
                let s = &mut span[tier.index()];
                let (lo, hi) = s.get_or_insert((r.window_start_ms, r.window_start_ms));
                *lo = (*lo).min(r.window_start_ms);
                *hi = (*hi).max(r.window_start_ms);
                if (*hi - *lo) / tier.window_ms() >= MAX_WINDOWS {
                    return Err(bad("rollup import: a tier spans more than 2^24 windows"));
                }
            }
            let table = &mut tables[tier.index()][RollupLevel::Gpu.index()];
            let windows = table.entry(group).or_default();
            for r in &records {
                merge(windows, r);
            }
        }
        let count = |t: &Table| t.values().map(|w| w.len() as u64).sum::<u64>();
        let gpu_records: u64 = RollupTier::ALL
            .iter()
            .map(|t| count(&tables[t.index()][RollupLevel::Gpu.index()]))
            .sum();
        if gpu_records == 0 {
            return Ok(RollupImportSummary::default());
        }
        for tier_tables in tables.iter_mut() {
            fill_levels(tier_tables);
        }
        let records = tables.iter().flatten().map(count).sum();
        let _one_at_a_time = lock!(self.flush_lock.lock());
        let raw_cut = lock!(self.state.read()).raw_cut();
        let file = self.write_rollups(0, raw_cut, &tables, None)?;
        let summary = RollupImportSummary {
            file_id: Some(file.id()),
            gpu_records,
            records,
            bytes: file.size_bytes(),
        };
        let mut state = lock!(self.state.write());
        state.rollups.push(Arc::new(file));
        state.rollups.sort_by_key(|f| f.id());
        Ok(summary)
    }
}

#[cfg(test)]
mod tests;
