//! Retention: [`Storage::enforce_retention`] drops expired segments and the
//! expired records of each rollup tier.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tracing::{error, info};

use super::Storage;
#[cfg(doc)]
use super::StorageConfig;
use crate::rollup::RollupTier;

impl Storage {
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

    /// [`Self::enforce_retention`], for a caller that holds the upkeep lock.
    pub(super) fn retention_locked(&self, now_ms: i64) -> usize {
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
}
