//! Every on-disk file name and extension of a gpulse data directory.
//!
//! ```text
//! <data-dir>/
//!   segments/<id:016x>.gseg        sealed segment (docs/format/segment.md)
//!   segments/<id:016x>.gseg.tmp    segment being written; deleted on open
//!   quarantine/<id:016x>.gseg      segment that failed validation, kept for inspection
//!   wal/<n:016x>.wal               write-ahead log segment (docs/format/wal.md)
//!   rollups/<id:016x>.groll        rollup records of one flush or merge (docs/format/rollup.md)
//!   rollups/<id:016x>.groll.tmp    rollup file being written; deleted on open
//!   quarantine/<id:016x>.groll     rollup file that failed validation
//!   quarantine/<name>.why          why a file just written was moved there
//!   quarantine/set-aside-<ms>-<n>.txt  samples or rollup records a flush or
//!                                  WAL replay could not store, and why
//!   LOCK                           locked while a process has the directory open
//! ```

use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{Error, Result, SegmentId};

pub const SEGMENTS_DIR: &str = "segments";
pub const QUARANTINE_DIR: &str = "quarantine";
pub const SEGMENT_EXT: &str = "gseg";
pub const TMP_EXT: &str = "tmp";
pub const WAL_DIR: &str = "wal";
/// Held (`flock`) by the process that has the data directory open for writing.
pub const LOCK_FILE: &str = "LOCK";
pub const WAL_EXT: &str = "wal";
/// The GPU inventory (`crate::inventory`).
pub const INVENTORY_FILE: &str = "inventory.ginv";
pub const ROLLUPS_DIR: &str = "rollups";
pub const ROLLUP_EXT: &str = "groll";

pub fn rollup_file_name(id: u64) -> String {
    format!("{id:016x}.{ROLLUP_EXT}")
}

pub fn rollup_path(data_dir: &Path, id: u64) -> PathBuf {
    data_dir.join(ROLLUPS_DIR).join(rollup_file_name(id))
}

pub fn rollup_tmp_path(data_dir: &Path, id: u64) -> PathBuf {
    data_dir
        .join(ROLLUPS_DIR)
        .join(format!("{}.{TMP_EXT}", rollup_file_name(id)))
}

/// Parses `<id:016x>.groll`; anything else is `None`.
pub fn parse_rollup_file_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(&format!(".{ROLLUP_EXT}"))?;
    (stem.len() == 16)
        .then(|| u64::from_str_radix(stem, 16).ok())
        .flatten()
}

/// `quarantine/<name>.why`: a note on why the file `name` was moved to `q_dir`.
pub fn quarantine_note_path(q_dir: &Path, name: &str) -> PathBuf {
    q_dir.join(format!("{name}.why"))
}

/// `quarantine/set-aside-<unix_ms:013>-<n:016x>.txt`: data a flush (or WAL
/// replay) could not store, one line per sample or record, with the reason.
pub fn set_aside_path(data_dir: &Path, unix_ms: u64, n: u64) -> PathBuf {
    data_dir
        .join(QUARANTINE_DIR)
        .join(format!("set-aside-{unix_ms:013}-{n:016x}.txt"))
}

pub fn wal_segment_path_in(wal_dir: &Path, n: u64) -> PathBuf {
    wal_dir.join(format!("{n:016x}.{WAL_EXT}"))
}

/// Parses `<n:016x>.wal`; anything else is `None`.
pub fn parse_wal_file_name(name: &str) -> Option<u64> {
    let stem = name.strip_suffix(&format!(".{WAL_EXT}"))?;
    (stem.len() == 16)
        .then(|| u64::from_str_radix(stem, 16).ok())
        .flatten()
}

pub fn segment_file_name(id: SegmentId) -> String {
    format!("{:016x}.{SEGMENT_EXT}", id.0)
}

pub fn segment_path(data_dir: &Path, id: SegmentId) -> PathBuf {
    data_dir.join(SEGMENTS_DIR).join(segment_file_name(id))
}

pub fn segment_tmp_path(data_dir: &Path, id: SegmentId) -> PathBuf {
    data_dir
        .join(SEGMENTS_DIR)
        .join(format!("{}.{TMP_EXT}", segment_file_name(id)))
}

/// Parses `<id:016x>.gseg`; anything else is `None`.
pub fn parse_segment_file_name(name: &str) -> Option<SegmentId> {
    let stem = name.strip_suffix(&format!(".{SEGMENT_EXT}"))?;
    if stem.len() != 16 {
        return None;
    }
    u64::from_str_radix(stem, 16).ok().map(SegmentId)
}

/// Maps a sealed file (a segment or a rollup file) read-only.
pub(crate) fn map_sealed(path: &Path) -> Result<Mmap> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: sealed files are never modified or truncated in place: they are
    // written as *.tmp, fsynced and renamed, and only deleted whole.
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

/// Copies `bytes` into an anonymous read-only map (at least one byte long),
/// so that a decoder of sealed files can validate bytes held in memory
/// (fuzzing, tools).
pub(crate) fn map_copy(bytes: &[u8]) -> Result<Mmap> {
    let path = Path::new("<memory>");
    let mut anon =
        memmap2::MmapMut::map_anon(bytes.len().max(1)).map_err(|e| Error::io(path, e))?;
    anon[..bytes.len()].copy_from_slice(bytes);
    anon.make_read_only().map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let id = SegmentId(0x2a);
        assert_eq!(segment_file_name(id), "000000000000002a.gseg");
        assert_eq!(parse_segment_file_name("000000000000002a.gseg"), Some(id));
        assert_eq!(parse_segment_file_name("000000000000002a.gseg.tmp"), None);
        assert_eq!(parse_segment_file_name("2a.gseg"), None);
        assert_eq!(rollup_file_name(0x2a), "000000000000002a.groll");
        assert_eq!(parse_rollup_file_name("000000000000002a.groll"), Some(0x2a));
        assert_eq!(parse_rollup_file_name("000000000000002a.groll.tmp"), None);
    }
}
