//! The agent's disk spool: batches that are not yet acked and do not fit in
//! the memory buffer, or were still in it at shutdown. It survives an agent
//! restart; see `docs/format/spool.md` for the byte layout.
//!
//! A spool directory holds:
//! - `agent.state`: the agent's epoch and the end of its reserved block of
//!   sequence numbers, rewritten atomically (write, fsync, rename);
//! - `NNNNNNNNNNNNNNNNNNNN.spool` files, numbered in write order, each a
//!   header and a run of checksummed records. A record is one `gpulse.v1.Batch`
//!   exactly as it goes on the wire, whose `new_series` define the series the
//!   file uses for the first time, so a file can be read back on its own.
//!
//! Sequence numbers are handed out from reserved blocks: before it uses a seq
//! past the block, the agent persists a new block end. After a crash it starts
//! at the end of the last block, so it never re-uses a seq that ingest may
//! already hold (ingest drops a batch whose seq is not above the highest it
//! stored for the agent's epoch). The gap this leaves is harmless.
//!
//! The spool is bounded: when a write would pass `max_bytes`, the oldest file
//! is deleted and its batches counted as dropped.
//!
//! A failed write (a full disk cuts a record short, then `ENOSPC`) is cut
//! back: the file is truncated to the end of its last whole record, so the
//! next record lands right after it and everything the spool reported stored
//! reads back, now and after a restart. If even the cut-back fails, the file
//! is closed and the next batch starts a new one.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use fileio::FileIo;
use gpulse_proto::v1::{Batch, SeriesDef};
use prost::Message;
use tracing::{error, info, warn};

const STATE_FILE: &str = "agent.state";
const STATE_MAGIC: &[u8; 8] = b"GPLSAGST";
const STATE_LEN: usize = 8 + 4 + 8 + 8 + 4;
const FILE_MAGIC: &[u8; 8] = b"GPLSPOOL";
const VERSION: u32 = 1;
/// Magic, version, crc32c of both.
const HEADER_LEN: u64 = 16;
/// Record frame: len u32 LE, crc32c u32 LE of the payload.
const FRAME_LEN: usize = 8;
/// A larger length field is corruption.
const MAX_RECORD_BYTES: usize = 64 << 20;
/// Sequence numbers reserved per state write.
const SEQ_BLOCK: u64 = 100_000;

/// A batch the agent holds until ingest acks it. `ids` index the shipper's
/// series table.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pending {
    pub(crate) epoch: u64,
    pub(crate) ids: Vec<u32>,
    pub(crate) ts_ms: Vec<i64>,
    pub(crate) values: Vec<f64>,
}

impl Pending {
    pub(crate) fn samples(&self) -> usize {
        self.ids.len()
    }
}

/// Where a spooled batch lies.
#[derive(Debug, Clone, Copy)]
struct Loc {
    file: u64,
    offset: u64,
    len: u32,
    samples: u32,
}

/// A batch found in a file at open: seq, place, epoch.
type Found = (u64, Loc, u64);

#[derive(Debug)]
struct SpoolFile {
    path: PathBuf,
    bytes: u64,
    /// Batches of the file not yet acked.
    live: usize,
    /// File-local series id -> shipper id, for files written by an earlier run.
    remap: Option<HashMap<u32, u32>>,
}

/// The file being appended to.
#[derive(Debug)]
struct Current {
    no: u64,
    file: File,
    defined: HashSet<u32>,
}

/// What was dropped to stay within the bound.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Dropped {
    pub(crate) batches: u64,
    pub(crate) samples: u64,
}

#[derive(Debug)]
pub(crate) struct Spool {
    dir: PathBuf,
    _lock: File,
    files: BTreeMap<u64, SpoolFile>,
    index: BTreeMap<u64, Loc>,
    current: Option<Current>,
    bytes: u64,
    max_bytes: u64,
    file_bytes: u64,
    epoch: u64,
    reserved_until: u64,
    /// Highest file number used or tried: a file whose creation failed half
    /// way is never tried again under the same name.
    last_no: u64,
    pub(crate) io: FileIo,
    /// Records found damaged at open.
    pub(crate) damaged: u64,
}

/// What [`Spool::open`] found.
#[derive(Debug)]
pub(crate) struct Opened {
    pub(crate) spool: Spool,
    /// The epoch to use and the first free sequence number.
    pub(crate) epoch: u64,
    pub(crate) next_seq: u64,
}

fn file_name(no: u64) -> String {
    format!("{no:020}.spool")
}

fn io_err(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

impl Spool {
    /// Opens or creates the spool in `dir` and indexes what it holds.
    /// `intern` maps each series definition found to the shipper's id.
    /// A torn record at the end of the newest file (a crash mid-write) is cut
    /// off; a damaged record elsewhere ends its file's index there, and is
    /// logged and counted. Never panics on file content.
    ///
    /// # Errors
    /// I/O errors, and a spool already locked by another agent.
    pub(crate) fn open(
        dir: &Path,
        max_bytes: u64,
        file_bytes: u64,
        mut intern: impl FnMut(&SeriesDef) -> u32,
    ) -> io::Result<Opened> {
        let lock = lock_dir(dir)?;
        let state = read_state(&dir.join(STATE_FILE));
        let mut spool = Spool {
            dir: dir.to_path_buf(),
            _lock: lock,
            files: BTreeMap::new(),
            index: BTreeMap::new(),
            current: None,
            bytes: 0,
            max_bytes,
            file_bytes,
            epoch: 0,
            reserved_until: 0,
            last_no: 0,
            io: FileIo::default(),
            damaged: 0,
        };
        let mut numbers = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
            let entry = entry.map_err(|e| io_err(dir, e))?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if let Some(no) = name
                .strip_suffix(".spool")
                .and_then(|n| n.parse::<u64>().ok())
            {
                numbers.push(no);
            }
        }
        numbers.sort_unstable();
        let newest = numbers.last().copied();
        spool.last_no = newest.unwrap_or(0);
        let mut max_seq = 0u64;
        let mut epochs = HashSet::new();
        for no in numbers {
            let path = dir.join(file_name(no));
            let (f, locs) = spool.load_file(&path, no, Some(no) == newest, &mut intern)?;
            let mut f = f;
            for (seq, loc, epoch) in locs {
                max_seq = max_seq.max(seq);
                epochs.insert(epoch);
                if let std::collections::btree_map::Entry::Vacant(v) = spool.index.entry(seq) {
                    v.insert(loc);
                    f.live += 1;
                }
            }
            spool.bytes += f.bytes;
            spool.files.insert(no, f);
        }
        // Files whose batches were all acked before a crash.
        let empty: Vec<u64> = spool
            .files
            .iter()
            .filter(|(_, f)| f.live == 0)
            .map(|(&no, _)| no)
            .collect();
        for no in empty {
            spool.delete_file(no);
        }
        let (epoch, next_seq) = match state {
            Some((epoch, reserved_until)) => (epoch, reserved_until.max(max_seq + 1)),
            None => {
                let epoch = loop {
                    let e: u64 = rand::random();
                    if e != 0 && !epochs.contains(&e) {
                        break e;
                    }
                };
                if !spool.index.is_empty() {
                    warn!(dir = %dir.display(), "spool state missing: starting a new epoch; spooled batches keep theirs");
                }
                (epoch, max_seq + 1)
            }
        };
        spool.epoch = epoch;
        spool.reserve(next_seq)?;
        if !spool.index.is_empty() || spool.damaged > 0 {
            info!(dir = %dir.display(), batches = spool.index.len(), bytes = spool.bytes, damaged = spool.damaged, "spool loaded");
        }
        Ok(Opened {
            spool,
            epoch,
            next_seq,
        })
    }

    /// Makes sure sequence numbers below `seq + 1` are reserved on disk.
    pub(crate) fn reserve(&mut self, seq: u64) -> io::Result<()> {
        if seq < self.reserved_until {
            return Ok(());
        }
        let until = seq + SEQ_BLOCK;
        write_state(&self.dir, self.epoch, until)?;
        self.reserved_until = until;
        Ok(())
    }

    fn load_file(
        &mut self,
        path: &Path,
        no: u64,
        newest: bool,
        intern: &mut impl FnMut(&SeriesDef) -> u32,
    ) -> io::Result<(SpoolFile, Vec<Found>)> {
        let buf = fs::read(path).map_err(|e| io_err(path, e))?;
        let mut f = SpoolFile {
            path: path.to_path_buf(),
            bytes: buf.len() as u64,
            live: 0,
            remap: Some(HashMap::new()),
        };
        let mut locs = Vec::new();
        if buf.len() < HEADER_LEN as usize || !header_ok(&buf[..HEADER_LEN as usize]) {
            if buf.len() >= HEADER_LEN as usize || !newest {
                self.damaged += 1;
                error!(file = %path.display(), "spool file has a bad header; ignoring it");
            }
            return Ok((f, locs));
        }
        let mut pos = HEADER_LEN as usize;
        while pos < buf.len() {
            match decode_record(&buf[pos..]) {
                Ok((batch, len)) => {
                    let remap = f.remap.as_mut().expect("BUG: loaded files have a remap");
                    for def in &batch.new_series {
                        remap.insert(def.id, intern(def));
                    }
                    if batch.series_ids.iter().all(|id| remap.contains_key(id)) {
                        let loc = Loc {
                            file: no,
                            offset: pos as u64,
                            len: len as u32,
                            samples: batch.series_ids.len() as u32,
                        };
                        locs.push((batch.seq, loc, batch.epoch));
                    } else {
                        self.damaged += 1;
                        error!(file = %path.display(), offset = pos, seq = batch.seq, "spooled batch uses an undefined series; dropping it");
                    }
                    pos += len;
                }
                Err(why) => {
                    if newest && why == "truncated" {
                        warn!(file = %path.display(), offset = pos, "cutting off a torn spool record (a write cut short by a crash)");
                        let file = OpenOptions::new()
                            .write(true)
                            .open(path)
                            .map_err(|e| io_err(path, e))?;
                        file.set_len(pos as u64).map_err(|e| io_err(path, e))?;
                        f.bytes = pos as u64;
                    } else {
                        self.damaged += 1;
                        error!(file = %path.display(), offset = pos, problem = why, "damaged spool record; the batches after it in this file are lost");
                    }
                    break;
                }
            }
        }
        Ok((f, locs))
    }

    /// Appends batch `seq` (whose series are defined in `defs`, indexed by
    /// id). Deletes the oldest files as needed to stay within the bound and
    /// reports what that dropped; a batch larger than the whole bound is
    /// itself dropped.
    pub(crate) fn append(
        &mut self,
        seq: u64,
        p: &Pending,
        defs: &[SeriesDef],
    ) -> io::Result<Dropped> {
        let mut dropped = Dropped::default();
        let needs_new = self
            .current
            .as_ref()
            .is_none_or(|c| self.files[&c.no].bytes >= self.file_bytes);
        if needs_new {
            self.rotate()?;
        }
        let cur = self.current.as_mut().expect("BUG: rotate opens a file");
        let mut new_series = Vec::new();
        for &id in &p.ids {
            if !cur.defined.contains(&id) && !new_series.iter().any(|d: &SeriesDef| d.id == id) {
                new_series.push(defs[id as usize].clone());
            }
        }
        let record = encode_record(&Batch {
            seq,
            new_series,
            series_ids: p.ids.clone(),
            timestamps_ms: p.ts_ms.clone(),
            values: p.values.clone(),
            epoch: p.epoch,
        });
        let len = record.len() as u64;
        if len > self.max_bytes {
            warn!(
                seq,
                bytes = len,
                max = self.max_bytes,
                "batch larger than the whole spool; dropping it"
            );
            return Ok(Dropped {
                batches: 1,
                samples: p.samples() as u64,
            });
        }
        let cur_no = cur.no;
        while self.bytes + len > self.max_bytes {
            let Some((&oldest, _)) = self.files.iter().find(|(no, _)| **no != cur_no) else {
                break;
            };
            let d = self.drop_file(oldest);
            dropped.batches += d.batches;
            dropped.samples += d.samples;
        }
        let cur = self.current.as_mut().expect("BUG: rotate opens a file");
        let f = self
            .files
            .get_mut(&cur.no)
            .expect("BUG: current file listed");
        let offset = f.bytes;
        if let Err(e) = self.io.write_all(&mut cur.file, &record) {
            // The file is opened for appending: once cut back to `offset`,
            // the next record lands there, right after the last whole one.
            if let Err(e2) = self.io.set_len(&cur.file, offset) {
                error!(file = %f.path.display(), offset, error = %e2, "cannot cut a failed spool write back; the next batch starts a new file");
                self.current = None;
            }
            return Err(io_err(&f.path, e));
        }
        cur.defined.extend(p.ids.iter().copied());
        f.bytes += len;
        f.live += 1;
        self.bytes += len;
        self.index.insert(
            seq,
            Loc {
                file: cur.no,
                offset,
                len: len as u32,
                samples: p.samples() as u32,
            },
        );
        Ok(dropped)
    }

    fn rotate(&mut self) -> io::Result<()> {
        if let Some(old) = self.current.take() {
            old.file.sync_data().ok();
            if self.files.get(&old.no).is_some_and(|f| f.live == 0) {
                self.delete_file(old.no);
            }
        }
        let no = self
            .files
            .keys()
            .next_back()
            .map_or(1, |n| n + 1)
            .max(self.last_no + 1);
        self.last_no = no;
        let path = self.dir.join(file_name(no));
        let mut file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        if let Err(e) = self.io.write_all(&mut file, &header()) {
            drop(file);
            if let Err(e2) = fs::remove_file(&path) {
                warn!(file = %path.display(), error = %e2, "cannot remove a spool file whose header failed to write");
            }
            return Err(io_err(&path, e));
        }
        self.bytes += HEADER_LEN;
        self.files.insert(
            no,
            SpoolFile {
                path,
                bytes: HEADER_LEN,
                live: 0,
                remap: None,
            },
        );
        self.current = Some(Current {
            no,
            file,
            defined: HashSet::new(),
        });
        Ok(())
    }

    /// Reads spooled batch `seq` back, with series ids of this run.
    pub(crate) fn read(&self, seq: u64) -> io::Result<Option<Pending>> {
        let Some(loc) = self.index.get(&seq) else {
            return Ok(None);
        };
        let f = &self.files[&loc.file];
        let file = File::open(&f.path).map_err(|e| io_err(&f.path, e))?;
        let mut buf = vec![0; loc.len as usize];
        file.read_exact_at(&mut buf, loc.offset)
            .map_err(|e| io_err(&f.path, e))?;
        let (batch, _) = decode_record(&buf).map_err(|why| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} at {}: {why}", f.path.display(), loc.offset),
            )
        })?;
        let ids = match &f.remap {
            None => batch.series_ids,
            Some(m) => batch.series_ids.iter().map(|id| m[id]).collect(),
        };
        Ok(Some(Pending {
            epoch: batch.epoch,
            ids,
            ts_ms: batch.timestamps_ms,
            values: batch.values,
        }))
    }

    /// Forgets an acked batch; deletes its file once nothing in it is live.
    /// Returns whether the batch was in the spool.
    pub(crate) fn ack(&mut self, seq: u64) -> bool {
        let Some(loc) = self.index.remove(&seq) else {
            return false;
        };
        let f = self.files.get_mut(&loc.file).expect("BUG: indexed file");
        f.live -= 1;
        let is_current = self.current.as_ref().is_some_and(|c| c.no == loc.file);
        if f.live == 0 && !is_current {
            self.delete_file(loc.file);
        }
        true
    }

    /// Deletes a file and forgets its batches; returns what that dropped.
    fn drop_file(&mut self, no: u64) -> Dropped {
        let seqs: Vec<(u64, u32)> = self
            .index
            .iter()
            .filter(|(_, l)| l.file == no)
            .map(|(&s, l)| (s, l.samples))
            .collect();
        let mut d = Dropped::default();
        for (seq, samples) in seqs {
            self.index.remove(&seq);
            d.batches += 1;
            d.samples += samples as u64;
        }
        warn!(
            file = no,
            batches = d.batches,
            samples = d.samples,
            "spool full: dropped its oldest file"
        );
        self.delete_file(no);
        d
    }

    fn delete_file(&mut self, no: u64) {
        if let Some(f) = self.files.remove(&no) {
            self.bytes -= f.bytes;
            if let Err(e) = fs::remove_file(&f.path) {
                warn!(file = %f.path.display(), error = %e, "could not delete a spool file");
            }
        }
    }

    /// Makes everything written so far durable.
    pub(crate) fn sync(&self) -> io::Result<()> {
        if let Some(c) = &self.current {
            c.file.sync_data()?;
        }
        Ok(())
    }

    /// Spooled batches, oldest first, from `seq` on.
    pub(crate) fn first_at_or_after(&self, seq: u64) -> Option<u64> {
        self.index.range(seq..).next().map(|(&s, _)| s)
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, seq: u64) -> bool {
        self.index.contains_key(&seq)
    }

    pub(crate) fn batches(&self) -> usize {
        self.index.len()
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Creates `dir` if needed and takes its `LOCK` (`flock`), held until the
/// returned file is dropped.
///
/// # Errors
/// I/O errors, and a directory already locked by another agent.
pub(crate) fn lock_dir(dir: &Path) -> io::Result<File> {
    fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    let lock_path = dir.join("LOCK");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| io_err(&lock_path, e))?;
    match lock.try_lock() {
        Ok(()) => Ok(lock),
        Err(fs::TryLockError::WouldBlock) => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("spool {} is in use by another agent", dir.display()),
        )),
        Err(fs::TryLockError::Error(e)) => Err(io_err(&lock_path, e)),
    }
}

fn header() -> [u8; HEADER_LEN as usize] {
    let mut h = [0u8; HEADER_LEN as usize];
    h[..8].copy_from_slice(FILE_MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..].copy_from_slice(&crc.to_le_bytes());
    h
}

fn header_ok(h: &[u8]) -> bool {
    h.len() == HEADER_LEN as usize && h == header()
}

pub fn encode_record(batch: &Batch) -> Vec<u8> {
    let len = batch.encoded_len();
    let mut buf = Vec::with_capacity(FRAME_LEN + len);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    buf.extend_from_slice(&[0; 4]);
    batch
        .encode(&mut buf)
        .expect("BUG: a Vec grows to fit the message");
    let crc = crc32c::crc32c(&buf[FRAME_LEN..]);
    buf[4..8].copy_from_slice(&crc.to_le_bytes());
    buf
}

/// Decodes the record at the start of `buf`; returns it and its framed length.
pub fn decode_record(buf: &[u8]) -> Result<(Batch, usize), &'static str> {
    let Some(head) = buf.get(..FRAME_LEN) else {
        return Err("truncated");
    };
    let len = u32::from_le_bytes(head[..4].try_into().expect("BUG: 4 bytes")) as usize;
    if len > MAX_RECORD_BYTES {
        return Err("impossible record length");
    }
    let Some(payload) = buf.get(FRAME_LEN..FRAME_LEN + len) else {
        return Err("truncated");
    };
    if crc32c::crc32c(payload).to_le_bytes() != head[4..8] {
        return Err("checksum mismatch");
    }
    let batch = Batch::decode(payload).map_err(|_| "record does not parse")?;
    let n = batch.series_ids.len();
    if batch.timestamps_ms.len() != n || batch.values.len() != n {
        return Err("record columns differ in length");
    }
    Ok((batch, FRAME_LEN + len))
}

fn read_state(path: &Path) -> Option<(u64, u64)> {
    let buf = fs::read(path).ok()?;
    let ok = buf.len() == STATE_LEN
        && &buf[..8] == STATE_MAGIC
        && buf[8..12] == VERSION.to_le_bytes()
        && buf[STATE_LEN - 4..] == crc32c::crc32c(&buf[..STATE_LEN - 4]).to_le_bytes();
    if !ok {
        error!(file = %path.display(), "spool state file is damaged; starting a new epoch");
        return None;
    }
    let epoch = u64::from_le_bytes(buf[12..20].try_into().ok()?);
    let until = u64::from_le_bytes(buf[20..28].try_into().ok()?);
    Some((epoch, until))
}

fn write_state(dir: &Path, epoch: u64, reserved_until: u64) -> io::Result<()> {
    let mut buf = Vec::with_capacity(STATE_LEN);
    buf.extend_from_slice(STATE_MAGIC);
    buf.extend_from_slice(&VERSION.to_le_bytes());
    buf.extend_from_slice(&epoch.to_le_bytes());
    buf.extend_from_slice(&reserved_until.to_le_bytes());
    let crc = crc32c::crc32c(&buf);
    buf.extend_from_slice(&crc.to_le_bytes());
    let tmp = dir.join(format!("{STATE_FILE}.tmp"));
    let dst = dir.join(STATE_FILE);
    let mut f = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
    f.write_all(&buf)
        .and_then(|_| f.sync_all())
        .map_err(|e| io_err(&tmp, e))?;
    fs::rename(&tmp, &dst).map_err(|e| io_err(&dst, e))?;
    File::open(dir).and_then(|d| d.sync_all()).ok();
    Ok(())
}

#[cfg(test)]
mod tests;
