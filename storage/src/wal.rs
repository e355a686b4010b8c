//! Write-ahead log: every series definition and sample batch is written here
//! before it reaches the head, so an acknowledged sample survives a crash.
//!
//! Layout (`docs/format/wal.md`): `wal/<n:016x>.wal` segments, each a 16-byte
//! header (`"GPLSWAL1"`, version, CRC32C) followed by records framed with a
//! length and a CRC32C ([`record`]).
//!
//! Group commit: one writer thread owns the open segment. Callers hand it
//! encoded records and block until their bytes are written; the thread takes
//! every request queued at that moment, writes them with one `write(2)` and,
//! under [`SyncPolicy::Fsync`], one `fdatasync`, then wakes them all.
//!
//! Durability: with [`SyncPolicy::Os`] (the default) a returned write is in
//! the kernel's page cache and survives `kill -9` of the process, not a power
//! loss; [`SyncPolicy::Fsync`] survives power loss too.
//!
//! Checkpoints: a flush *cuts* the WAL: it opens a new segment that starts with
//! a series record for every head series, so that segments after the cut
//! replay on their own; once the flushed segment file is durable, every WAL
//! segment before the cut is deleted.

pub mod record;

use std::fs::{self, File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::thread::JoinHandle;

use crossbeam::channel::{Receiver, Sender, bounded, unbounded};
use fileio::FileIo;
use tracing::{error, warn};

use crate::files::{self, WAL_DIR};
use crate::{Error, Result};
use record::{Bad, Record};

const MAGIC: &[u8; 8] = b"GPLSWAL1";
/// Version 2 added series batch records (`record::TYPE_SERIES_BATCH`);
/// version 1 segments, which have none, are still read.
const VERSION: u32 = 2;
const READS: std::ops::RangeInclusive<u32> = 1..=VERSION;
pub(crate) const HEADER_LEN: usize = 16;

/// When a WAL write counts as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SyncPolicy {
    /// After `write(2)`: survives a crash of the process (`kill -9`), not of the machine.
    #[default]
    Os,
    /// After `write(2)` and `fdatasync`: survives power loss.
    Fsync,
}

enum Request {
    Write {
        bytes: Vec<u8>,
        done: Sender<io::Result<()>>,
    },
    /// Open segment `next`, write `checkpoint` at its start, and return `next`.
    Cut {
        checkpoint: Vec<u8>,
        done: Sender<io::Result<u64>>,
    },
    /// Delete every segment numbered below `before`.
    Truncate {
        before: u64,
        done: Sender<io::Result<usize>>,
    },
}

/// Handle to the WAL writer thread. Dropping it stops the thread after the
/// requests already queued.
#[derive(Debug)]
pub(crate) struct Wal {
    tx: Option<Sender<Request>>,
    thread: Option<JoinHandle<()>>,
    /// Writes that failed (disk full, I/O error) and were refused.
    write_errors: Arc<AtomicU64>,
}

/// A copy of `e` for each waiting writer; an OS error keeps its code
/// (`ENOSPC` stays recognisable).
fn clone_err(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

impl Wal {
    /// Starts a writer on a new segment `first`, beginning with `checkpoint`.
    pub(crate) fn start(
        data_dir: &Path,
        first: u64,
        checkpoint: &[u8],
        policy: SyncPolicy,
        max_segment_bytes: u64,
    ) -> Result<Self> {
        Self::start_with(
            data_dir,
            first,
            checkpoint,
            policy,
            max_segment_bytes,
            FileIo::default(),
        )
    }

    /// [`Self::start`] with the file operations given (tests inject faults).
    pub(crate) fn start_with(
        data_dir: &Path,
        first: u64,
        checkpoint: &[u8],
        policy: SyncPolicy,
        max_segment_bytes: u64,
        io: FileIo,
    ) -> Result<Self> {
        let dir = data_dir.join(WAL_DIR);
        fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let write_errors = Arc::new(AtomicU64::new(0));
        let mut w = Writer {
            dir,
            file: None,
            seg: first,
            size: 0,
            policy,
            max_segment_bytes,
            broken: false,
            io,
            write_errors: write_errors.clone(),
        };
        w.cut(first, checkpoint)
            .map_err(|e| Error::io(w.path(), e))?;
        let (tx, rx) = unbounded();
        let thread = std::thread::Builder::new()
            .name("gpulse-wal".into())
            .spawn(move || w.run(rx))
            .map_err(|e| Error::io(data_dir, e))?;
        Ok(Self {
            tx: Some(tx),
            thread: Some(thread),
            write_errors,
        })
    }

    /// Writes refused so far because the bytes could not be written (disk
    /// full, I/O error).
    pub(crate) fn write_errors(&self) -> u64 {
        self.write_errors.load(Relaxed)
    }

    fn call<T>(&self, make: impl FnOnce(Sender<io::Result<T>>) -> Request) -> io::Result<T> {
        let (done, rx) = bounded(1);
        let tx = self.tx.as_ref().expect("BUG: WAL used after close");
        tx.send(make(done))
            .map_err(|_| io::Error::other("WAL writer stopped"))?;
        rx.recv()
            .map_err(|_| io::Error::other("WAL writer stopped"))?
    }

    /// Writes encoded records; returns once they are durable under the policy.
    pub(crate) fn write(&self, bytes: Vec<u8>) -> io::Result<()> {
        self.call(|done| Request::Write { bytes, done })
    }

    /// Starts a new segment with `checkpoint` at its head; returns its number.
    pub(crate) fn cut(&self, checkpoint: Vec<u8>) -> io::Result<u64> {
        self.call(|done| Request::Cut { checkpoint, done })
    }

    /// Deletes the segments before `before`; returns how many.
    pub(crate) fn truncate(&self, before: u64) -> io::Result<usize> {
        self.call(|done| Request::Truncate { before, done })
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        drop(self.tx.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Writer {
    dir: PathBuf,
    file: Option<File>,
    seg: u64,
    /// Bytes of the open segment that are fully written: the offset of the
    /// next record. The file's length and offset are kept equal to it.
    size: u64,
    policy: SyncPolicy,
    max_segment_bytes: u64,
    /// A failed write could not be cut back (or a sync failed, after which
    /// the file's unsynced pages are in doubt): the next write starts a new
    /// segment instead of appending behind a torn record.
    broken: bool,
    io: FileIo,
    write_errors: Arc<AtomicU64>,
}

impl Writer {
    fn path(&self) -> PathBuf {
        files::wal_segment_path_in(&self.dir, self.seg)
    }

    /// Creates segment `n` with its header, fsynced, without touching the
    /// open one. On failure the new file is removed again, so that a retry
    /// can create it and no headerless file sits between segments.
    fn create(&self, n: u64) -> io::Result<File> {
        let path = files::wal_segment_path_in(&self.dir, n);
        let mut f = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)?;
        let mut header = Vec::with_capacity(HEADER_LEN);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&crc32c::crc32c(&header).to_le_bytes());
        let r = self
            .io
            .write_all(&mut f, &header)
            .and_then(|_| f.sync_all())
            .and_then(|_| File::open(&self.dir)?.sync_all());
        if let Err(e) = r {
            drop(f);
            if let Err(e2) = fs::remove_file(&path) {
                error!(file = %path.display(), error = %e2, "cannot remove a WAL segment whose header failed to write");
            }
            return Err(e);
        }
        Ok(f)
    }

    /// Opens segment `n` and writes `checkpoint` at its start. All or
    /// nothing: on failure the new file is removed and the open segment stays
    /// the one written to.
    fn cut(&mut self, n: u64, checkpoint: &[u8]) -> io::Result<()> {
        let mut f = self.create(n)?;
        let r = self
            .io
            .write_all(&mut f, checkpoint)
            .and_then(|_| match self.policy {
                SyncPolicy::Os => Ok(()),
                SyncPolicy::Fsync => f.sync_data(),
            });
        if let Err(e) = r {
            drop(f);
            let path = files::wal_segment_path_in(&self.dir, n);
            if let Err(e2) = fs::remove_file(&path) {
                error!(file = %path.display(), error = %e2, "cannot remove a WAL segment whose checkpoint failed to write");
            }
            return Err(e);
        }
        self.file = Some(f);
        self.seg = n;
        self.size = (HEADER_LEN + checkpoint.len()) as u64;
        self.broken = false;
        Ok(())
    }

    /// Writes `bytes` to the open segment and syncs under the policy. On
    /// failure (a short write, `ENOSPC`, `EIO`) the segment is cut back to its
    /// last fully written record and the file offset moved back there, so a
    /// partial record never sits in front of later ones: the next write lands
    /// exactly where the failed one began. If the cut-back fails, the next
    /// write starts a new segment instead.
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        if self.broken
            || (self.size + bytes.len() as u64 > self.max_segment_bytes
                && self.size > HEADER_LEN as u64)
        {
            self.cut(self.seg + 1, &[])?;
        }
        let f = self.file.as_mut().expect("BUG: WAL segment open");
        let mut synced = true;
        let r = self.io.write_all(f, bytes).and_then(|_| match self.policy {
            SyncPolicy::Os => Ok(()),
            SyncPolicy::Fsync => f.sync_data().inspect_err(|_| synced = false),
        });
        match r {
            Ok(()) => {
                self.size += bytes.len() as u64;
                Ok(())
            }
            Err(e) => {
                let back = self
                    .io
                    .set_len(f, self.size)
                    .and_then(|_| f.seek(SeekFrom::Start(self.size)).map(|_| ()));
                if let Err(e2) = back {
                    error!(file = %self.path().display(), offset = self.size, error = %e2, "cannot cut a failed WAL write back; the next write starts a new segment");
                    self.broken = true;
                } else if !synced {
                    self.broken = true;
                }
                Err(e)
            }
        }
    }

    fn run(mut self, rx: Receiver<Request>) {
        while let Ok(first) = rx.recv() {
            let mut buf: Vec<u8> = Vec::new();
            let mut waiting: Vec<Sender<io::Result<()>>> = Vec::new();
            for req in std::iter::once(first).chain(rx.try_iter().take(4096)) {
                match req {
                    Request::Write { bytes, done } => {
                        buf.extend_from_slice(&bytes);
                        waiting.push(done);
                    }
                    Request::Cut { checkpoint, done } => {
                        self.commit(&mut buf, &mut waiting);
                        let next = self.seg + 1;
                        let r = self.cut(next, &checkpoint).map(|_| next);
                        if let Err(e) = &r {
                            error!(file = %self.path().display(), error = %e, "WAL cut failed; writes go on in the open segment");
                        }
                        let _ = done.send(r);
                    }
                    Request::Truncate { before, done } => {
                        self.commit(&mut buf, &mut waiting);
                        let _ = done.send(self.truncate(before));
                    }
                }
            }
            self.commit(&mut buf, &mut waiting);
        }
        if let Some(f) = &self.file
            && let Err(e) = f.sync_all()
        {
            warn!(error = %e, "syncing the WAL at close");
        }
    }

    fn commit(&mut self, buf: &mut Vec<u8>, waiting: &mut Vec<Sender<io::Result<()>>>) {
        let r = self.write_all(buf);
        if let Err(e) = &r {
            self.write_errors.fetch_add(1, Relaxed);
            error!(file = %self.path().display(), error = %e, "WAL write failed; the writes are refused");
        }
        for w in waiting.drain(..) {
            let _ = w.send(r.as_ref().map(|_| ()).map_err(clone_err));
        }
        buf.clear();
    }

    fn truncate(&self, before: u64) -> io::Result<usize> {
        let mut n = 0;
        for (seg, path) in list_segments(&self.dir)? {
            if seg < before && seg != self.seg {
                fs::remove_file(&path)?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// WAL segments in `dir`, ascending.
pub(crate) fn list_segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if let Some(n) = files::parse_wal_file_name(&entry.file_name().to_string_lossy()) {
            out.push((n, entry.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// A problem found while replaying, with the file and byte offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalDamage {
    pub path: PathBuf,
    pub offset: u64,
    pub what: &'static str,
}

/// What a replay found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplayReport {
    pub segments: usize,
    pub records: u64,
    /// The last segment ended inside a record (a write cut short by a crash);
    /// the file was truncated there.
    pub torn_tail: Option<WalDamage>,
    /// Records that failed their checksum or did not parse, before the end.
    /// Replay kept the good records before each and went on with the next segment.
    pub corruption: Vec<WalDamage>,
    /// Highest segment number seen (0 if none).
    pub last_segment: u64,
}

/// Replays every WAL segment numbered `skip_below` or more, in order, calling
/// `apply` for each good record.
///
/// A torn tail of the last segment is truncated (logged with file and offset).
/// Corruption elsewhere stops that segment at the bad record; the damage is
/// reported with file and offset and replay goes on with the next segment.
/// Never panics on any file content.
///
/// # Errors
/// I/O errors reading the directory or files.
pub(crate) fn replay(
    data_dir: &Path,
    skip_below: u64,
    mut apply: impl FnMut(u64, Record),
) -> Result<ReplayReport> {
    let dir = data_dir.join(WAL_DIR);
    let mut segments = list_segments(&dir).map_err(|e| Error::io(&dir, e))?;
    let last_seen = segments.last().map_or(0, |s| s.0);
    segments.retain(|s| s.0 >= skip_below);
    let mut report = ReplayReport {
        segments: segments.len(),
        ..Default::default()
    };
    let last = segments.last().map(|s| s.0);
    report.last_segment = last_seen;
    for (n, path) in segments {
        let is_last = Some(n) == last;
        let buf = fs::read(&path).map_err(|e| Error::io(&path, e))?;
        let damage = |offset: usize, what| WalDamage {
            path: path.clone(),
            offset: offset as u64,
            what,
        };
        let header_ok = buf.len() >= HEADER_LEN
            && &buf[..8] == MAGIC
            && buf[12..16] == crc32c::crc32c(&buf[..12]).to_le_bytes()
            && READS.contains(&u32::from_le_bytes(
                buf[8..12].try_into().expect("BUG: 4 bytes"),
            ));
        if !header_ok {
            if is_last && buf.len() < HEADER_LEN {
                // Created but never completely written: nothing to lose.
                report.torn_tail = Some(damage(0, "segment header cut short"));
                fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
            } else {
                report.corruption.push(damage(0, "bad segment header"));
            }
            continue;
        }
        let mut pos = HEADER_LEN;
        while pos < buf.len() {
            match record::decode(&buf[pos..]) {
                Ok((rec, len)) => {
                    apply(n, rec);
                    report.records += 1;
                    pos += len;
                }
                Err(bad) => {
                    let reaches_end = bad == Bad::Truncated
                        || (bad == Bad::Checksum
                            && declared_end(&buf[pos..]).is_some_and(|e| pos + e >= buf.len()));
                    if is_last && reaches_end {
                        report.torn_tail =
                            Some(damage(pos, "record cut short at the end of the log"));
                        truncate_file(&path, pos as u64)?;
                    } else {
                        let what = match bad {
                            Bad::Truncated => {
                                "record runs past the end of a segment that is not the last"
                            }
                            Bad::Length => "impossible record length",
                            Bad::Checksum => "record checksum mismatch",
                            Bad::Payload => "record does not parse",
                        };
                        report.corruption.push(damage(pos, what));
                    }
                    break;
                }
            }
        }
    }
    Ok(report)
}

/// End of the record at the start of `buf` according to its length field.
fn declared_end(buf: &[u8]) -> Option<usize> {
    let len = u32::from_le_bytes(buf.get(0..4)?.try_into().ok()?) as usize;
    Some(8 + len)
}

fn truncate_file(path: &Path, len: u64) -> Result<()> {
    let f = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    f.set_len(len)
        .and_then(|_| f.sync_all())
        .map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests;
