//! The event log: `<data_dir>/health/events.log`, where `serve` keeps every
//! change of every health event so that `health_events` survives a
//! restart. Layout (`docs/format/health-events.md`):
//!
//! ```text
//! header   magic "GPHEALTH" (8) | version u32 LE = 1 | reserved u32 = 0
//! record   length u32 LE | crc32c(payload) u32 LE | payload (length bytes)
//! payload  id u64 | kind u8 | severity u8 | flags u8 | xid u32 | gpu u32
//!          | onset i64 | detected i64 | cleared i64
//!          | uuid, host, rack, row, cluster, action, evidence: each u32 LE length + UTF-8
//! ```
//!
//! Integers are little-endian. `flags`: bit 0 the event has an XID, bit 1
//! it has cleared, bits 2-4 rack, row, cluster are known. A change appends
//! the whole event; reading keeps the last record of each id. A record that
//! runs past the end of the file or fails its checksum ends the readable
//! log (a write torn by a crash): [`EventLog::open`] cuts the file there
//! and says how many bytes it dropped. [`EventLog::rewrite`] replaces the
//! file with one record per event (tmp file, fsync, rename).

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use crate::engine::Event;
use crate::{GpuId, Kind, Severity};

/// The file's first 8 bytes.
pub const MAGIC: &[u8; 8] = b"GPHEALTH";
/// The layout version this code writes and reads.
pub const VERSION: u32 = 1;
const HEADER_BYTES: u64 = 16;
/// A record longer than this is damage, not an event.
const MAX_RECORD_BYTES: u32 = 1 << 20;

/// What [`EventLog::open`] found.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Recovered {
    /// The events, last record of each id, by id.
    pub events: Vec<Event>,
    /// Records read.
    pub records: u64,
    /// Bytes cut from the end: a torn or damaged tail.
    pub dropped_bytes: u64,
}

/// An open event log, appending.
#[derive(Debug)]
pub struct EventLog {
    path: PathBuf,
    file: BufWriter<File>,
    /// Records in the file, for deciding when to rewrite it.
    records: u64,
}

impl EventLog {
    /// Opens (or creates) the log at `path` and reads it back.
    ///
    /// # Errors
    /// I/O errors, or a file that is not an event log (wrong magic) or of
    /// another version: it is left as it is.
    pub fn open(path: &Path) -> io::Result<(Self, Recovered)> {
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let mut recovered = Recovered::default();
        if bytes.is_empty() {
            file.write_all(&header())?;
            file.sync_all()?;
        } else {
            recovered = read(&bytes, path)?;
            let good = bytes.len() as u64 - recovered.dropped_bytes;
            if good < bytes.len() as u64 {
                file.set_len(good)?;
                file.sync_all()?;
            }
        }
        let records = recovered.records;
        Ok((
            EventLog {
                path: path.to_path_buf(),
                file: BufWriter::new(file),
                records,
            },
            recovered,
        ))
    }

    /// Appends the event as it is now. Buffered: call [`EventLog::sync`].
    ///
    /// # Errors
    /// I/O errors.
    pub fn append(&mut self, e: &Event) -> io::Result<()> {
        let payload = encode(e);
        self.file.write_all(&(payload.len() as u32).to_le_bytes())?;
        self.file
            .write_all(&crc32c::crc32c(&payload).to_le_bytes())?;
        self.file.write_all(&payload)?;
        self.records += 1;
        Ok(())
    }

    /// Writes what is buffered and fsyncs it.
    ///
    /// # Errors
    /// I/O errors.
    pub fn sync(&mut self) -> io::Result<()> {
        self.file.flush()?;
        self.file.get_ref().sync_data()
    }

    /// Records in the file.
    pub fn records(&self) -> u64 {
        self.records
    }

    /// Replaces the file with one record per event of `events`.
    ///
    /// # Errors
    /// I/O errors; the old file then stays in use.
    pub fn rewrite<'a>(&mut self, events: impl IntoIterator<Item = &'a Event>) -> io::Result<()> {
        self.sync()?;
        let tmp = self.path.with_extension("log.tmp");
        let mut out = BufWriter::new(File::create(&tmp)?);
        out.write_all(&header())?;
        let mut records = 0;
        for e in events {
            let payload = encode(e);
            out.write_all(&(payload.len() as u32).to_le_bytes())?;
            out.write_all(&crc32c::crc32c(&payload).to_le_bytes())?;
            out.write_all(&payload)?;
            records += 1;
        }
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, &self.path)?;
        if let Some(dir) = self.path.parent() {
            File::open(dir)?.sync_all()?;
        }
        let file = OpenOptions::new().append(true).open(&self.path)?;
        self.file = BufWriter::new(file);
        self.records = records;
        Ok(())
    }
}

/// Reads a whole log from memory: what [`EventLog::open`] reads from its
/// file (the fuzz target `health_log` feeds it anything).
///
/// # Errors
/// No `GPHEALTH` header, or another version; `path` names the file in the
/// message.
pub fn read(bytes: &[u8], path: &Path) -> io::Result<Recovered> {
    check_header(bytes, path)?;
    let (events, records, good) = read_records(&bytes[HEADER_BYTES as usize..]);
    Ok(Recovered {
        events,
        records,
        dropped_bytes: (bytes.len() - HEADER_BYTES as usize - good) as u64,
    })
}

fn header() -> [u8; HEADER_BYTES as usize] {
    let mut h = [0u8; HEADER_BYTES as usize];
    h[..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h
}

fn check_header(bytes: &[u8], path: &Path) -> io::Result<()> {
    let bad = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    if bytes.len() < HEADER_BYTES as usize || &bytes[..8] != MAGIC {
        return Err(bad(format!(
            "{} is not a gpulse health event log (no GPHEALTH header)",
            path.display()
        )));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(bad(format!(
            "{} is a health event log of version {version}; this gpulse reads version {VERSION}",
            path.display()
        )));
    }
    Ok(())
}

/// Reads records until the end or the first damaged one: the events (last
/// record per id), the records read and the bytes they span.
fn read_records(mut rest: &[u8]) -> (Vec<Event>, u64, usize) {
    let total = rest.len();
    let mut by_id = BTreeMap::new();
    let mut records = 0;
    loop {
        if rest.len() < 8 {
            break;
        }
        let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        if len > MAX_RECORD_BYTES || rest.len() < 8 + len as usize {
            break;
        }
        let payload = &rest[8..8 + len as usize];
        if crc32c::crc32c(payload) != crc {
            break;
        }
        let Some(e) = decode(payload) else {
            break;
        };
        by_id.insert(e.id, e);
        records += 1;
        rest = &rest[8 + len as usize..];
    }
    (by_id.into_values().collect(), records, total - rest.len())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn encode(e: &Event) -> Vec<u8> {
    let mut out = Vec::with_capacity(96 + e.evidence.len() + e.action.len());
    out.extend_from_slice(&e.id.to_le_bytes());
    let kind = Kind::ALL
        .iter()
        .position(|&k| k == e.kind)
        .expect("BUG: every kind is in ALL");
    out.push(kind as u8);
    out.push(e.severity as u8);
    let g = &e.gpu;
    let flags = u8::from(e.xid.is_some())
        | u8::from(e.cleared_ts_ms.is_some()) << 1
        | u8::from(g.rack.is_some()) << 2
        | u8::from(g.row.is_some()) << 3
        | u8::from(g.cluster.is_some()) << 4;
    out.push(flags);
    out.extend_from_slice(&e.xid.unwrap_or(0).to_le_bytes());
    out.extend_from_slice(&g.gpu.to_le_bytes());
    for t in [
        e.onset_ts_ms,
        e.detected_ts_ms,
        e.cleared_ts_ms.unwrap_or(0),
    ] {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for s in [
        g.uuid.as_str(),
        &g.host,
        g.rack.as_deref().unwrap_or(""),
        g.row.as_deref().unwrap_or(""),
        g.cluster.as_deref().unwrap_or(""),
        &e.action,
        &e.evidence,
    ] {
        put_str(&mut out, s);
    }
    out
}

/// Reads a payload; `None` for one that does not parse.
fn decode(p: &[u8]) -> Option<Event> {
    let mut r = Reader(p);
    let id = u64::from_le_bytes(r.take(8)?.try_into().ok()?);
    let kind = *Kind::ALL.get(r.take(1)?[0] as usize)?;
    let severity = match r.take(1)?[0] {
        0 => Severity::Info,
        1 => Severity::Warning,
        2 => Severity::Critical,
        _ => return None,
    };
    let flags = r.take(1)?[0];
    let xid = u32::from_le_bytes(r.take(4)?.try_into().ok()?);
    let gpu = u32::from_le_bytes(r.take(4)?.try_into().ok()?);
    let mut ts = [0i64; 3];
    for t in &mut ts {
        *t = i64::from_le_bytes(r.take(8)?.try_into().ok()?);
    }
    let mut s: [String; 7] = Default::default();
    for x in &mut s {
        let len = u32::from_le_bytes(r.take(4)?.try_into().ok()?) as usize;
        *x = String::from_utf8(r.take(len)?.to_vec()).ok()?;
    }
    if !r.0.is_empty() {
        return None;
    }
    let [uuid, host, rack, row, cluster, action, evidence] = s;
    let known = |bit: u8, v: String| (flags & (1 << bit) != 0).then_some(v);
    Some(Event {
        id,
        gpu: GpuId {
            uuid,
            host,
            gpu,
            rack: known(2, rack),
            row: known(3, row),
            cluster: known(4, cluster),
        },
        kind,
        severity,
        xid: (flags & 1 != 0).then_some(xid),
        onset_ts_ms: ts[0],
        detected_ts_ms: ts[1],
        cleared_ts_ms: (flags & 2 != 0).then_some(ts[2]),
        action,
        evidence,
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests;
