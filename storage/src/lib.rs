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

pub mod admission;
mod codec;
pub mod column;
mod db;
pub mod error;
pub mod files;
#[cfg(test)]
mod golden;
pub mod gorilla;
mod head;
pub mod inventory;
pub mod malloc;
mod postings;
pub mod rollup;
pub mod segment;
pub mod series;
mod sym;
pub mod wal;

pub use db::{
    AppendObserver, AppendOutcome, BatchOrigin, OnFullFn, RollupImportSummary, SelectedSeries,
    Storage, StorageConfig, StorageMetrics, StorageStats, UpkeepReport,
};
pub use error::{Error, Result};
pub use head::{ChunkCodec, MemChunk, Newest, SeriesRef};
pub use inventory::{GpuRecord, Inventory};
pub use rollup::file::RollupFile;
pub use rollup::{RecordFields, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier};
pub use segment::writer::SegmentSummary;
pub use series::{KeepSeries, KeyArc, Label, Matcher, Pattern, SeriesKey, Sym};
pub use wal::{ReplayReport, SyncPolicy, WalDamage};

/// Oldest sample timestamp storage holds: 0001-01-01T00:00:00Z, in ms since
/// the Unix epoch. With [`MAX_TS_MS`], the range of `google.protobuf.Timestamp`
/// and of RFC 3339's four-digit years. [`Storage::append`] refuses a batch
/// with a timestamp outside it ([`Error::BadBatch`]), WAL replay sets such
/// samples aside, and the segment and rollup writers and readers check it.
/// Both ends are whole days, so every 1 min, 1 h and 1 d window of a
/// timestamp in the range lies inside it, and every delta a file stores
/// fits an `i64`.
pub const MIN_TS_MS: i64 = -62_135_596_800_000;
/// Newest sample timestamp storage holds: 9999-12-31T23:59:59.999Z.
pub const MAX_TS_MS: i64 = 253_402_300_799_999;

const _: () = assert!(MIN_TS_MS % 86_400_000 == 0 && (MAX_TS_MS + 1) % 86_400_000 == 0);

/// Whether storage can hold a sample at `ts_ms` ([`MIN_TS_MS`]..=[`MAX_TS_MS`]).
pub const fn ts_storable(ts_ms: i64) -> bool {
    MIN_TS_MS <= ts_ms && ts_ms <= MAX_TS_MS
}

/// Identifies a segment file; ids grow with every flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(pub u64);
