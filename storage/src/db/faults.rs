//! Faults that tests inject into storage (test builds only).

use std::sync::Mutex;
use std::sync::atomic::Ordering::Relaxed;

/// Faults that tests inject: each counter is how many more times the
/// operation fails.
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

impl Faults {
    pub(crate) fn take(&self, n: &std::sync::atomic::AtomicU32) -> bool {
        n.fetch_update(Relaxed, Relaxed, |v| v.checked_sub(1))
            .is_ok()
    }
}
