//! gpulse storage: codecs, the in-memory head, and memory-mapped segment files.
//!
//! Where it sits: `ingest` appends agent batches through [`Storage`]; `query`
//! reads them back through [`Storage::select`]. This crate knows nothing of
//! gRPC, HTTP or DataFusion.
//!
//! Guarantees: samples are stored bit-exact (NaN payloads included); a sample
//! is durable once [`Storage::append`] returns (in the WAL, under the
//! configured [`SyncPolicy`]); corrupt files are reported with their path and
//! offset and never cause a panic.

mod codec;
pub mod column;
mod db;
pub mod error;
pub mod files;
pub mod gorilla;
mod head;
pub mod inventory;
pub mod rollup;
pub mod segment;
pub mod series;
pub mod wal;

pub use db::{
    AppendOutcome, BatchOrigin, RollupImportSummary, SelectedSeries, Storage, StorageConfig,
    StorageMetrics, StorageStats,
};
pub use error::{Error, Result};
pub use head::{MemChunk, SeriesRef};
pub use inventory::{GpuRecord, Inventory};
pub use rollup::file::RollupFile;
pub use rollup::{RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier};
pub use segment::writer::SegmentSummary;
pub use series::{Label, Matcher, Pattern, SeriesKey};
pub use wal::{ReplayReport, SyncPolicy, WalDamage};

/// Identifies a segment file; ids grow with every flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(pub u64);
