//! One round of upkeep: [`Storage::upkeep`] flushes, compacts and enforces
//! retention under one lock.

use tracing::error;

use super::Storage;
use crate::Result;
use crate::error::Error;
use crate::segment::writer::SegmentSummary;

impl Storage {
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
        if compactions > 0 || segments_expired > 0 {
            // Keys that only dropped segments listed (a segment a query
            // still reads keeps its keys until a later round).
            self.keys.sweep();
        }
        if matches!(flush, Ok(Some(_))) || compactions > 0 || segments_expired > 0 {
            crate::malloc::release_free_memory();
        }
        UpkeepReport {
            flush,
            compactions,
            compaction_error,
            segments_expired,
        }
    }
}

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
