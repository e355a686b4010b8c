//! Errors of the storage crate.
//!
//! Three kinds are kept apart: bad input ([`Error::InvalidSeries`],
//! [`Error::SeriesLimit`]), corruption ([`Error::Corrupt`],
//! [`Error::ChunkDecode`]: located, drives quarantine), and environment
//! ([`Error::Io`]). [`Error::Unwritable`] is the writer's side of
//! corruption: data that a reader would refuse, caught before it is written.

use std::path::PathBuf;

use crate::gorilla::DecodeError;
use crate::series::InvalidSeries;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What exactly is wrong in a corrupt segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Corruption {
    TooShort {
        len: u64,
    },
    BadMagic,
    UnsupportedVersion {
        version: u32,
    },
    ChecksumMismatch {
        section: &'static str,
        expected: u32,
        actual: u32,
    },
    /// A length or offset points outside its section.
    OutOfBounds {
        what: &'static str,
    },
    /// A string is not UTF-8.
    BadUtf8,
    /// A series key in the index is invalid.
    BadSeries(InvalidSeries),
    /// A column block passed its checksum but does not decode.
    BadBlock(crate::column::ColumnError),
}

impl std::fmt::Display for Corruption {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooShort { len } => write!(f, "file too short ({len} bytes)"),
            Self::BadMagic => f.write_str("bad magic number"),
            Self::UnsupportedVersion { version } => {
                write!(f, "unsupported format version {version}")
            }
            Self::ChecksumMismatch {
                section,
                expected,
                actual,
            } => write!(
                f,
                "{section} checksum mismatch (stored {expected:#010x}, computed {actual:#010x})"
            ),
            Self::OutOfBounds { what } => write!(f, "{what} out of bounds"),
            Self::BadUtf8 => f.write_str("string is not UTF-8"),
            Self::BadSeries(e) => write!(f, "invalid series in index: {e}"),
            Self::BadBlock(e) => write!(f, "column block does not decode: {e}"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("corrupt segment {path} at offset {offset}: {kind}")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        kind: Corruption,
    },
    #[error("corrupt chunk {chunk} of series {series} in {path}: {source}")]
    ChunkDecode {
        path: PathBuf,
        series: String,
        chunk: usize,
        #[source]
        source: DecodeError,
    },
    #[error("data directory {path} is in use by another process (it holds {path}/LOCK)")]
    Locked { path: PathBuf },
    #[error("invalid series: {0}")]
    InvalidSeries(#[from] InvalidSeries),
    #[error("bad batch: {reason}")]
    BadBatch { reason: &'static str },
    #[error("series limit reached: the head holds {limit} series")]
    SeriesLimit { limit: usize },
    /// The batch names a series ref whose series left the head (idle
    /// through a flush). Nothing was stored; resolve the series again
    /// ([`crate::Storage::series_refs`]) and retry. Refs are never reused,
    /// so a stale ref never names another series.
    #[error("series ref {series_ref} is stale: its series left the head after a flush")]
    SeriesEvicted { series_ref: u32 },
    /// A writer refused data that its reader would reject (a sample or
    /// record outside what the format holds); nothing was written. Not
    /// retryable: the same data fails the same way, so a flush sets it aside
    /// (`quarantine/`) instead of retrying it.
    #[error("refusing to write {path}: {what} ({item})")]
    Unwritable {
        path: PathBuf,
        /// The series or rollup group at fault.
        item: String,
        what: &'static str,
    },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }

    /// True for environment errors that may succeed when retried.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Io { .. } | Self::SeriesEvicted { .. })
    }
}
