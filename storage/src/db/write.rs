//! Putting a newly written file into place, for flushes, merges and imports:
//! opening a segment's temporary file before its rename, writing a rollup
//! file, and withdrawing a rollup file that fails to open after its rename.

use std::fs;
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;

use tracing::error;

use super::Storage;
use super::set_aside::move_to_quarantine;
use crate::error::Error;
use crate::files::{self, QUARANTINE_DIR};
use crate::rollup::file::{self as rollup_file, RollupFile};
use crate::segment::Segment;
use crate::{Result, SegmentId};

impl Storage {
    /// Opens and validates a segment written to its temporary file `tmp`,
    /// before the caller renames it to `dst` ([`publish`]): a segment that
    /// does not open is never published, and the caller deletes `tmp` (its
    /// data stays for a retry, or is set aside).
    ///
    /// [`publish`]: crate::segment::writer::publish
    pub(super) fn open_segment_tmp(
        &self,
        tmp: &Path,
        dst: &Path,
        id: SegmentId,
    ) -> Result<Segment> {
        #[cfg(test)]
        if self.faults.take(&self.faults.segment_open) {
            return Err(Error::io(
                dst,
                std::io::Error::other("injected fault: segment open"),
            ));
        }
        Segment::open_renamed(tmp, dst, id, &self.keys)
    }

    /// Moves a file that was renamed into place but could not be opened to
    /// `quarantine/` with a note of why (`<name>.why`), or deletes it: left
    /// in place, the next start would count its data a second time, next to
    /// the file that the retry writes. Returns whether the file is gone.
    fn withdraw(&self, path: &Path, name: &str, why: &Error) -> bool {
        let q = self.config.data_dir.join(QUARANTINE_DIR);
        let dir = path.parent().unwrap_or(Path::new("."));
        let note = format!(
            "{name} failed to open right after it was written: {why}\n\
             Its data stayed in memory and was written again by a later flush or merge.\n"
        );
        match move_to_quarantine(&q, path, name, Some(&note)) {
            Ok(()) => {
                error!(file = %path.display(), error = %why, "a file failed to open right after it was written; moved to quarantine/, its data is retried");
                true
            }
            Err(e) => match fs::remove_file(path) {
                Ok(()) => crate::segment::writer::sync_dir(dir).is_ok(),
                Err(r) if r.kind() == std::io::ErrorKind::NotFound => true,
                Err(r) => {
                    error!(file = %path.display(), error = %why, move_error = %e, remove_error = %r, "a file failed to open after it was written and cannot be moved or deleted");
                    false
                }
            },
        }
    }

    /// Writes a rollup file covering `covers` (plus its own new id), with
    /// `raw_cut` (see [`RollupFile::raw_cut`]), and opens it. A file that fails to open after its rename is withdrawn
    /// ([`Self::withdraw`]) before the error returns, so that the retry of its
    /// records cannot count them twice after a restart; if it cannot be
    /// withdrawn, the next write reuses its id and so replaces it.
    pub(super) fn write_rollups<T: crate::rollup::TableView>(
        &self,
        wal_cut: u64,
        raw_cut: i64,
        tables: &[[T; 5]; 3],
        covers: Option<Vec<(u64, u64)>>,
    ) -> Result<RollupFile> {
        let id = lock!(self.retry_rollup_id.lock())
            .take()
            .unwrap_or_else(|| self.next_rollup.fetch_add(1, Relaxed));
        let covers = rollup_file::union_covers(
            covers
                .unwrap_or_default()
                .into_iter()
                .chain([(id, id)])
                .collect(),
        );
        let tmp = files::rollup_tmp_path(&self.config.data_dir, id);
        let dst = files::rollup_path(&self.config.data_dir, id);
        if let Err(e) = rollup_file::write(&tmp, &dst, wal_cut, raw_cut, &covers, tables) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        #[cfg(test)]
        let opened = if self.faults.take(&self.faults.rollup_open) {
            Err(Error::io(
                &dst,
                std::io::Error::other("injected fault: rollup file open"),
            ))
        } else {
            RollupFile::open(&dst, id).and_then(|f| f.verify().map(|()| f))
        };
        // Every block checked now, not at its first read: the WAL behind
        // these records is about to be cut.
        #[cfg(not(test))]
        let opened = RollupFile::open(&dst, id).and_then(|f| f.verify().map(|()| f));
        opened.inspect_err(|e| {
            if !self.withdraw(&dst, &files::rollup_file_name(id), e) {
                *lock!(self.retry_rollup_id.lock()) = Some(id);
            }
        })
    }
}
