//! Rollup files (`rollups/<id:016x>.groll`, `docs/format/rollup.md`): the
//! rollup records of one flush (or of several merged files), for every tier
//! and level. Written as `*.tmp`, fsynced, renamed, directory fsynced; never
//! modified afterwards; read through `mmap`.
//!
//! ```text
//! +---------------------------------------------------------------+
//! | header  magic "GPLSROL1" | version u32 | crc32c(header) u32    | 16 B
//! +---------------------------------------------------------------+
//! | blocks, back to back; each: 28-byte block header (tier, level,  |
//! | payload length, window range, crc32c of header+payload), then   |
//! | groups and their records                                        |
//! +---------------------------------------------------------------+
//! | covers: the ids of the files merged into this one (ranges), then  |
//! | (v5) the block directory: each block's group count, metric range |
//! +---------------------------------------------------------------+
//! | footer  offsets, counts, wal_cut, time range, raw_cut (v4),     | 72 B
//! |         crc32cs, magic                                          |
//! +---------------------------------------------------------------+
//! ```
//!
//! Opening a version 5 file checks its header, footer, covers and directory
//! and walks the block headers; each block's checksum and payload are checked
//! the first time it is read (and all of them by [`RollupFile::verify`], which
//! a flush calls on the file it wrote). Opening versions 1 to 4 checks every
//! checksum and parses every block. Any failure is [`Error::Corrupt`] with
//! path and offset.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::Mmap;

use super::{
    GroupRef, RecordFields, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier,
    TableView, Tables,
};
use crate::codec::{ReadResult, Reader, put_str, put_uvarint};
use crate::error::Corruption;
use crate::segment::writer::publish;
use crate::{Error, Result};

pub(crate) const MAGIC: &[u8; 8] = b"GPLSROL1";
pub(crate) const FOOTER_MAGIC: &[u8; 8] = b"GPLREND1";
/// Version 5 adds the block directory after the covers (each block's group
/// count and metric range), so that opening a file reads its block headers
/// and directory only; a block's checksum and payload are checked when it is
/// first read ([`RollupFile::verify`] checks them all). Version 4 adds
/// `raw_cut` to the footer: gpu-level 1-minute records are
/// no longer written for samples that raw segments still hold (see
/// [`RollupFile::raw_cut`]). Version 3 stores a block's records as columns
/// (the values as column blocks, `docs/format/column.md`); version 2 added
/// zstd-compressed block payloads (block flag bit 0). Versions 1 (flags all
/// 0) and 2, whose records are rows, 3 and 4 are still read, and validated
/// whole when opened.
pub(crate) const VERSION: u32 = 5;
/// First version whose blocks hold columns.
const COLUMNAR: u32 = 3;
/// First version with `raw_cut` in its footer, and without gpu-level
/// minute records of samples still in raw segments.
pub(crate) const RAW_CUT: u32 = 4;
/// First version with the block directory, whose blocks are checked when
/// first read.
const DIRECTORY: u32 = 5;
/// Block flag: the payload is `uvarint raw_len` + a zstd frame of `raw_len` bytes.
const FLAG_ZSTD: u16 = 1;
/// Largest decompressed block accepted: a block closes once it passes
/// [`MAX_BLOCK_PAYLOAD`], by at most one group's records.
const MAX_RAW_BLOCK: u64 = 4 * MAX_BLOCK_PAYLOAD as u64;
pub(crate) const HEADER_LEN: usize = 16;
pub(crate) const BLOCK_HEADER_LEN: usize = 28;
/// The footer of a version 4 file; earlier ones lack `raw_cut` (8 bytes less).
pub(crate) const FOOTER_LEN: usize = 7 * 8 + 2 * 4 + 8;

/// The footer's length in a file of `version`.
const fn footer_len(version: u32) -> usize {
    if version >= RAW_CUT {
        FOOTER_LEN
    } else {
        FOOTER_LEN - 8
    }
}
/// Most groups in one block, so a reader decodes a bounded amount at a time.
const MAX_BLOCK_GROUPS: usize = 4096;
/// Most records in one block (version 3): a reader decodes a block's columns
/// whole, 72 bytes a record, and a column block of constant values takes
/// almost no bytes, so the payload's size cannot bound them.
pub(crate) const MAX_BLOCK_RECORDS: usize = 1 << 20;
/// A block is closed once its payload passes this size (see `encode_table`).
const MAX_BLOCK_PAYLOAD: usize = 64 << 20;

#[derive(Debug)]
struct BlockInfo {
    tier: RollupTier,
    level: RollupLevel,
    min_ws: i64,
    max_ws: i64,
    /// Payload position in the file.
    start: usize,
    len: usize,
    /// The payload is zstd-compressed ([`FLAG_ZSTD`]).
    zstd: bool,
    /// The records are columns (version 3), not rows.
    columnar: bool,
    /// Smallest and largest metric of the block's groups, found when the file
    /// is opened: a query for one metric skips the blocks that cannot hold it
    /// without decoding them (groups are sorted metric first, so a block
    /// usually holds few metrics).
    metrics: Option<(Box<str>, Box<str>)>,
    /// How many groups the block holds (counted when the file is opened).
    groups: usize,
    /// Its checksum matched and its payload parsed into `groups` groups of
    /// the metrics in `metrics`: when the file was opened (versions 1 to 4),
    /// or when the block was first read (from version 5, whose directory
    /// gives `groups` and `metrics`).
    checked: AtomicBool,
}

impl BlockInfo {
    /// Whether [`RollupFile::for_each_matching`] decodes this block for
    /// these arguments.
    fn is_read(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        min_ws: i64,
        max_ws: i64,
        metric: Option<&str>,
    ) -> bool {
        if self.tier != tier || self.level != level || self.max_ws < min_ws || self.min_ws > max_ws
        {
            return false;
        }
        match (metric, &self.metrics) {
            (Some(m), Some((lo, hi))) => m >= &**lo && m <= &**hi,
            _ => true,
        }
    }
}

/// An open, validated rollup file.
#[derive(Debug)]
pub struct RollupFile {
    id: u64,
    path: PathBuf,
    map: Mmap,
    blocks: Vec<BlockInfo>,
    covers: Vec<(u64, u64)>,
    wal_cut: u64,
    /// See [`RollupFile::raw_cut`]; `i64::MIN` before version 4.
    raw_cut: i64,
    version: u32,
    min_ts: i64,
    max_ts: i64,
    deleted: AtomicBool,
}

fn corrupt(path: &Path, (offset, kind): (u64, Corruption)) -> Error {
    Error::Corrupt {
        path: path.to_path_buf(),
        offset,
        kind,
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("BUG: 8 bytes"))
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("BUG: 4 bytes"))
}

fn f64_of(r: &mut Reader<'_>, what: &'static str) -> ReadResult<f64> {
    let b = r.bytes(8, what)?;
    Ok(f64::from_le_bytes(b.try_into().expect("BUG: 8 bytes")))
}

/// A block's payload as [`decode_payload`] reads it: as stored, or
/// decompressed (its declared size checked before anything is allocated).
fn payload<'a>(stored: &'a [u8], b: &BlockInfo) -> ReadResult<std::borrow::Cow<'a, [u8]>> {
    if !b.zstd {
        return Ok(std::borrow::Cow::Borrowed(stored));
    }
    let mut r = Reader::new(stored, b.start as u64);
    let raw_len = r.uvarint("block size")?;
    if raw_len > MAX_RAW_BLOCK {
        return Err((
            b.start as u64,
            Corruption::OutOfBounds { what: "block size" },
        ));
    }
    let frame = &stored[(r.offset() - b.start as u64) as usize..];
    let raw = zstd::bulk::decompress(frame, raw_len as usize).map_err(|_| {
        (
            b.start as u64,
            Corruption::OutOfBounds { what: "zstd block" },
        )
    })?;
    if raw.len() as u64 != raw_len {
        return Err((
            b.start as u64,
            Corruption::OutOfBounds { what: "block size" },
        ));
    }
    Ok(std::borrow::Cow::Owned(raw))
}

/// What is wrong with `r` as a record of `tier`, if anything: the one rule
/// that the reader ([`decode_payload`]), the writer ([`check_tables`]) and
/// [`crate::Storage::import_rollups`] share. A record's window is aligned to
/// its tier and starts within [`crate::MIN_TS_MS`]..=[`crate::MAX_TS_MS`]
/// (a range whose ends are whole days, so the window ends inside it too), its
/// count is at least 1, and its first and last timestamps lie in the window,
/// first not after last.
pub(crate) fn record_problem(tier: RollupTier, r: &RollupRecord) -> Option<&'static str> {
    let ws = r.window_start_ms;
    if !crate::ts_storable(ws) {
        return Some("window start outside the storable range (years 1 to 9999)");
    }
    if ws.rem_euclid(tier.window_ms()) != 0 {
        return Some("window start not aligned to its tier");
    }
    if r.count == 0 {
        return Some("record with count 0");
    }
    let end = ws + tier.window_ms(); // no overflow: ws <= MAX_TS_MS
    if r.first_ts_ms < ws || r.last_ts_ms >= end || r.first_ts_ms > r.last_ts_ms {
        return Some("first/last timestamps outside the window or out of order");
    }
    None
}

/// Checks `tables` against everything [`RollupFile::open`] checks of a
/// record, so that no rollup file is written that its reader would refuse.
/// Returns the first offending group and the problem.
pub(crate) fn check_tables<T: TableView>(
    tables: &[[T; 5]; 3],
) -> std::result::Result<(), (String, &'static str)> {
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            let mut last_group: Option<&RollupGroup> = None;
            for (g, windows) in tables[tier.index()][level.index()].groups() {
                let name = || format!("{g:?} ({tier:?}, {level:?})");
                if !g.is_at_level(level) {
                    return Err((name(), "group field below its level"));
                }
                if last_group.is_some_and(|l| l >= g) {
                    return Err((name(), "groups not strictly ascending"));
                }
                last_group = Some(g);
                let mut last_ws: Option<i64> = None;
                for r in windows {
                    if last_ws.is_some_and(|l| l >= r.window_start_ms) {
                        return Err((name(), "windows not strictly ascending"));
                    }
                    last_ws = Some(r.window_start_ms);
                    if let Some(what) = record_problem(tier, r) {
                        return Err((name(), what));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Checks a block's CRC (its header's first 24 bytes and its stored payload).
fn check_crc(file: &[u8], b: &BlockInfo) -> ReadResult<()> {
    let pos = b.start - BLOCK_HEADER_LEN;
    let h = &file[pos..b.start];
    let crc = crc32c::crc32c_append(crc32c::crc32c(&h[..24]), &file[b.start..b.start + b.len]);
    if u32_at(h, 24) != crc {
        return Err((
            pos as u64,
            Corruption::ChecksumMismatch {
                section: "block",
                expected: u32_at(h, 24),
                actual: crc,
            },
        ));
    }
    Ok(())
}

/// The groups a block's payload holds and their smallest and largest metric,
/// counted while it is parsed: what a version 5 directory entry says.
#[derive(Debug, Default, PartialEq)]
struct BlockContents {
    groups: usize,
    metrics: Option<(Box<str>, Box<str>)>,
}

impl BlockContents {
    /// Counts `g`; always `false`, so that a parse to count copies nothing.
    fn add(&mut self, g: &GroupRef<'_>) -> bool {
        // Min and max rather than first and last: pruning must not depend on
        // the groups being sorted (nothing checks that).
        let m = g.metric;
        self.groups += 1;
        match &mut self.metrics {
            None => self.metrics = Some((m.into(), m.into())),
            Some((lo, _)) if m < &**lo => *lo = m.into(),
            Some((_, hi)) if m > &**hi => *hi = m.into(),
            Some(_) => {}
        }
        false
    }
}

/// Parses one block's payload, calling `f` with each group that `keep`
/// accepts (asked once per group, on the fields as they lie in the payload:
/// only kept groups are copied out) and its records, in window order.
/// Decodes the fields of `fields` (see [`RecordFields`]); a version 1 or 2
/// payload has them all.
/// Checks that windows are aligned, ascending per group and inside the
/// block's range, that the sample timestamps it decodes lie in their window,
/// and that group fields below the level are empty; of a columnar payload
/// the records only if `check` (its block's first read, see
/// [`decode_columns`]).
fn decode_payload(
    buf: &[u8],
    base: u64,
    b: &BlockInfo,
    fields: RecordFields,
    check: bool,
    keep: impl FnMut(&GroupRef<'_>) -> bool,
    f: impl FnMut(&RollupGroup, Vec<RollupRecord>),
) -> ReadResult<()> {
    if b.columnar {
        decode_columns(buf, base, b, fields, check, keep, f)
    } else {
        decode_rows(buf, base, b, keep, f)
    }
}

/// Reads a group's six fields and checks them against the block's level.
fn read_group<'a>(r: &mut Reader<'a>, b: &BlockInfo) -> ReadResult<GroupRef<'a>> {
    let g = GroupRef {
        metric: r.str("metric")?,
        cluster: r.str("cluster")?,
        row: r.str("row")?,
        rack: r.str("rack")?,
        host: r.str("host")?,
        gpu: r.str("gpu")?,
    };
    if !g.is_at_level(b.level) {
        return Err((
            r.offset(),
            Corruption::OutOfBounds {
                what: "group field below its level",
            },
        ));
    }
    Ok(g)
}

/// Room left in a group's vector of records for the windows that later
/// files add to it: a query over the hour tier finds a group's older hours
/// in one file and the last few in the files of the flushes since, and
/// appending those to a vector without room copied all of it (a 30-day
/// rack query copied 16 MB).
const LATER_WINDOWS: usize = 16;

/// A version 3 payload: the groups with their record counts, then each
/// field of every record as a column (`docs/format/rollup.md`). Columns
/// outside `fields` are stepped over, not decoded; so are the records of
/// groups not kept, unless every field is asked for (a block's first read,
/// which checks them all).
///
/// `check`: every record is checked (window order and alignment, offsets,
/// counts). A block's first read checks its CRC and every record of it;
/// later reads of the same mapped bytes decode the same records, so they
/// skip the per-record checks (a tenth of a 30-day rack query's read) and
/// keep only what guards against overflow.
fn decode_columns(
    buf: &[u8],
    base: u64,
    b: &BlockInfo,
    fields: RecordFields,
    check: bool,
    mut keep: impl FnMut(&GroupRef<'_>) -> bool,
    mut f: impl FnMut(&RollupGroup, Vec<RollupRecord>),
) -> ReadResult<()> {
    let oob = |at: u64, what| Err((at, Corruption::OutOfBounds { what }));
    let mut r = Reader::new(buf, base);
    let w = b.tier.window_ms();
    // Every group takes at least 7 bytes, and a block holds at most
    // MAX_BLOCK_RECORDS records, which bounds both counts before anything is
    // allocated.
    let n_groups = r.len("group count", buf.len() / 7)?;
    let mut groups = Vec::with_capacity(n_groups);
    let mut total = 0usize;
    for _ in 0..n_groups {
        let g = read_group(&mut r, b)?;
        let n = r.len("record count", MAX_BLOCK_RECORDS - total)?;
        total += n;
        let kept = keep(&g).then(|| g.to_group());
        groups.push((g.metric, kept, n));
    }
    // The integer columns, then the value columns, each a column block
    // (`docs/format/column.md`) after its length.
    fn block<'a>(r: &mut Reader<'a>, what: &'static str) -> ReadResult<(u64, &'a [u8])> {
        let at = r.offset();
        let len = r.len(what, usize::MAX)?;
        Ok((at, r.bytes(len, what)?))
    }
    let all = fields == RecordFields::ALL;
    let times = fields.times();
    let mut ints: [Vec<i64>; 4] = Default::default();
    for ((v, what), wanted) in ints
        .iter_mut()
        .zip(["window", "count", "first_ts", "span"])
        .zip([true, true, times, times])
    {
        let (at, bytes) = block(&mut r, what)?;
        if !wanted {
            continue;
        }
        crate::column::decode_ints(bytes, total, v).map_err(|e| (at, Corruption::BadBlock(e)))?;
        if v.len() != total {
            return oob(at, what);
        }
    }
    // The values: five column blocks for each run of groups of one metric.
    let mut values: [Vec<f64>; 5] = Default::default();
    let wanted = [
        fields.sum,
        fields.min,
        fields.max,
        fields.first,
        fields.last,
    ];
    for n in metric_runs(groups.iter().map(|&(metric, _, n)| (metric, n))) {
        for ((v, what), wanted) in values
            .iter_mut()
            .zip(["sum", "min", "max", "first", "last"])
            .zip(wanted)
        {
            let (at, bytes) = block(&mut r, what)?;
            if !wanted {
                continue;
            }
            let before = v.len();
            crate::column::decode_values(bytes, n, v).map_err(|e| (at, Corruption::BadBlock(e)))?;
            if v.len() != before + n {
                return oob(at, what);
            }
        }
    }
    if !r.is_empty() {
        return oob(r.offset(), "bytes after the last column");
    }
    let value = |col: &Vec<f64>, i: usize| col.get(i).copied().unwrap_or(f64::NAN);
    let [sum, min, max, first, last] = &values;
    let [windows, counts, first_off, span] = &ints;
    // Record `i`, its window starting at `start`.
    let record = |i: usize, start: i64| {
        let (f_off, s_off) = if times {
            (first_off[i], span[i])
        } else {
            (0, 0)
        };
        RollupRecord {
            window_start_ms: start,
            count: counts[i] as u64,
            sum: value(sum, i),
            min: value(min, i),
            max: value(max, i),
            first: value(first, i),
            first_ts_ms: start.saturating_add(f_off),
            last: value(last, i),
            last_ts_ms: start.saturating_add(f_off.saturating_add(s_off)),
        }
    };
    let mut from = 0;
    for (_, kept, n) in &groups {
        let group = from..from + n;
        from += n;
        if kept.is_none() && !all {
            continue;
        }
        if !check {
            // Checked on the block's first read: no record needs a test.
            let Some(g) = kept else { continue };
            let mut records = Vec::with_capacity(n + LATER_WINDOWS);
            records.extend(group.map(|i| record(i, windows[i].wrapping_mul(w))));
            f(g, records);
            continue;
        }
        let mut records = Vec::with_capacity(if kept.is_some() {
            *n + LATER_WINDOWS
        } else {
            0
        });
        for i in group.clone() {
            // A window is its start over the tier's window length; they
            // ascend within a group.
            if i > group.start && windows[i] <= windows[i - 1] {
                return oob(base, "window order");
            }
            let start = windows[i].checked_mul(w);
            let Some(start) = start.filter(|s| *s >= b.min_ws && *s <= b.max_ws) else {
                return oob(base, "window start");
            };
            // Offsets past the window, or negative, are refused before they
            // are added, so that the sums below cannot overflow.
            let (f_off, s_off) = if times {
                (first_off[i], span[i])
            } else {
                (0, 0)
            };
            if !(0..w).contains(&f_off) || !(0..w).contains(&s_off) || counts[i] < 1 {
                return oob(base, "record");
            }
            let rec = record(i, start);
            if let Some(what) = record_problem(b.tier, &rec) {
                return oob(base, what);
            }
            if kept.is_some() {
                records.push(rec);
            }
        }
        if let Some(g) = kept {
            f(g, records);
        }
    }
    Ok(())
}

/// The number of records of each run of consecutive groups that share a
/// metric (groups with no record count for nothing): a version 3 block
/// encodes the values of each run apart, so that each metric has its own
/// decimal scale and delta order.
fn metric_runs<'a>(groups: impl Iterator<Item = (&'a str, usize)>) -> Vec<usize> {
    let mut runs: Vec<(&str, usize)> = Vec::new();
    for (metric, n) in groups.filter(|&(_, n)| n > 0) {
        match runs.last_mut() {
            Some((m, len)) if *m == metric => *len += n,
            _ => runs.push((metric, n)),
        }
    }
    runs.into_iter().map(|(_, n)| n).collect()
}

/// A version 1 or 2 payload: per group, its fields and its records as rows.
fn decode_rows(
    buf: &[u8],
    base: u64,
    b: &BlockInfo,
    mut keep: impl FnMut(&GroupRef<'_>) -> bool,
    mut f: impl FnMut(&RollupGroup, Vec<RollupRecord>),
) -> ReadResult<()> {
    let oob = |r: &Reader<'_>, what| Err((r.offset(), Corruption::OutOfBounds { what }));
    let mut r = Reader::new(buf, base);
    let w = b.tier.window_ms();
    let n_groups = r.len("group count", buf.len())?;
    for _ in 0..n_groups {
        let g = read_group(&mut r, b)?;
        let kept = keep(&g).then(|| g.to_group());
        let n = r.len("record count", buf.len())?;
        let mut records = Vec::new();
        let mut prev: Option<i64> = None;
        for _ in 0..n {
            let d = r.varint("window start")?;
            let ws = match prev {
                None => d,
                Some(p) if d > 0 => match p.checked_add(d) {
                    Some(ws) => ws,
                    None => return oob(&r, "window start"),
                },
                Some(_) => return oob(&r, "window order"),
            };
            prev = Some(ws);
            if ws < b.min_ws || ws > b.max_ws {
                return oob(&r, "window start");
            }
            let count = r.uvarint("count")?;
            let sum = f64_of(&mut r, "sum")?;
            let min = f64_of(&mut r, "min")?;
            let max = f64_of(&mut r, "max")?;
            let first = f64_of(&mut r, "first")?;
            let first_off = r.uvarint("first_ts")?;
            let last = f64_of(&mut r, "last")?;
            let last_off = r.uvarint("last_ts")?;
            // Offsets past the window are refused before they are added, so
            // that the sums below cannot overflow.
            if first_off >= w as u64 || last_off >= w as u64 {
                return oob(&r, "record");
            }
            let rec = RollupRecord {
                window_start_ms: ws,
                count,
                sum,
                min,
                max,
                first,
                first_ts_ms: ws.saturating_add(first_off as i64),
                last,
                last_ts_ms: ws.saturating_add(last_off as i64),
            };
            // The writer refuses exactly what this refuses (`check_tables`).
            if let Some(what) = record_problem(b.tier, &rec) {
                return oob(&r, what);
            }
            if kept.is_some() {
                records.push(rec);
            }
        }
        if let Some(g) = &kept {
            f(g, records);
        }
    }
    if !r.is_empty() {
        return oob(&r, "bytes after the last group");
    }
    Ok(())
}

impl RollupFile {
    /// Opens and validates a rollup file.
    ///
    /// # Errors
    /// [`Error::Io`] if it can't be read, [`Error::Corrupt`] if it doesn't validate.
    pub fn open(path: &Path, id: u64) -> Result<Self> {
        let map = crate::files::map_sealed(path)?;
        Self::from_map(path, id, map)
    }

    /// Validates a rollup file held in memory (fuzzing, tools).
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let path = Path::new("<memory>");
        let map = crate::files::map_copy(bytes)?;
        let mut f = Self::from_map(path, 0, map)?;
        // The anonymous map has at least one byte; an empty input never validates.
        f.id = 0;
        Ok(f)
    }

    fn from_map(path: &Path, id: u64, map: Mmap) -> Result<Self> {
        let bad = |offset: u64, kind| corrupt(path, (offset, kind));
        let b: &[u8] = &map;
        let len = b.len();
        if len < HEADER_LEN + footer_len(1) {
            return Err(bad(0, Corruption::TooShort { len: len as u64 }));
        }
        if &b[..8] != MAGIC {
            return Err(bad(0, Corruption::BadMagic));
        }
        let crc = crc32c::crc32c(&b[..12]);
        if u32_at(b, 12) != crc {
            return Err(bad(
                12,
                Corruption::ChecksumMismatch {
                    section: "header",
                    expected: u32_at(b, 12),
                    actual: crc,
                },
            ));
        }
        let version = u32_at(b, 8);
        if !(1..=VERSION).contains(&version) {
            return Err(bad(8, Corruption::UnsupportedVersion { version }));
        }
        if len < HEADER_LEN + footer_len(version) {
            return Err(bad(0, Corruption::TooShort { len: len as u64 }));
        }
        let fo = len - footer_len(version);
        // The two checksums follow the footer's u64 fields.
        let crcs = fo + footer_len(version) - 16;
        if &b[len - 8..] != FOOTER_MAGIC {
            return Err(bad((len - 8) as u64, Corruption::BadMagic));
        }
        let crc = crc32c::crc32c(&b[fo..crcs + 4]);
        if u32_at(b, crcs + 4) != crc {
            return Err(bad(
                (crcs + 4) as u64,
                Corruption::ChecksumMismatch {
                    section: "footer",
                    expected: u32_at(b, crcs + 4),
                    actual: crc,
                },
            ));
        }
        let covers_off = u64_at(b, fo);
        let covers_len = u64_at(b, fo + 8);
        let n_blocks = u64_at(b, fo + 16);
        let wal_cut = u64_at(b, fo + 24);
        let min_ts = u64_at(b, fo + 32) as i64;
        let max_ts = u64_at(b, fo + 40) as i64;
        let raw_cut = if version >= RAW_CUT {
            u64_at(b, fo + 48) as i64
        } else {
            i64::MIN
        };
        if covers_off < HEADER_LEN as u64 || covers_off.checked_add(covers_len) != Some(fo as u64) {
            return Err(bad(fo as u64, Corruption::OutOfBounds { what: "covers" }));
        }
        let (co, cl) = (covers_off as usize, covers_len as usize);
        let crc = crc32c::crc32c(&b[co..co + cl]);
        if u32_at(b, crcs) != crc {
            return Err(bad(
                co as u64,
                Corruption::ChecksumMismatch {
                    section: "covers",
                    expected: u32_at(b, crcs),
                    actual: crc,
                },
            ));
        }
        let mut covers = Vec::new();
        let mut r = Reader::new(&b[co..co + cl], co as u64);
        let n = r.len("covers count", cl).map_err(|e| corrupt(path, e))?;
        for _ in 0..n {
            let lo = r.uvarint("covers").map_err(|e| corrupt(path, e))?;
            let d = r.uvarint("covers").map_err(|e| corrupt(path, e))?;
            let hi = lo
                .checked_add(d)
                .ok_or_else(|| bad(r.offset(), Corruption::OutOfBounds { what: "covers" }))?;
            covers.push((lo, hi));
        }
        // Version 5: each block's group count and metric range, in file order.
        let mut directory = Vec::new();
        if version >= DIRECTORY {
            let n = r
                .len("directory count", cl / 3)
                .map_err(|e| corrupt(path, e))?;
            if n as u64 != n_blocks {
                return Err(bad(
                    r.offset(),
                    Corruption::OutOfBounds {
                        what: "directory count",
                    },
                ));
            }
            for _ in 0..n {
                let at = r.offset();
                let entry = (|| {
                    let groups = r.len("directory groups", MAX_BLOCK_GROUPS)?;
                    let lo: Box<str> = r.str("directory metric")?.into();
                    let hi: Box<str> = r.str("directory metric")?.into();
                    Ok((groups, lo, hi))
                })()
                .map_err(|e| corrupt(path, e))?;
                if entry.0 == 0 || entry.1 > entry.2 {
                    return Err(bad(
                        at,
                        Corruption::OutOfBounds {
                            what: "directory entry",
                        },
                    ));
                }
                directory.push(entry);
            }
        }
        if !r.is_empty() {
            return Err(bad(r.offset(), Corruption::OutOfBounds { what: "covers" }));
        }
        let mut directory = directory.into_iter();

        let mut blocks = Vec::new();
        let mut pos = HEADER_LEN;
        while pos < co {
            if co - pos < BLOCK_HEADER_LEN {
                return Err(bad(
                    pos as u64,
                    Corruption::OutOfBounds {
                        what: "block header",
                    },
                ));
            }
            let h = &b[pos..pos + BLOCK_HEADER_LEN];
            let (Some(tier), Some(level)) =
                (RollupTier::from_index(h[0]), RollupLevel::from_index(h[1]))
            else {
                return Err(bad(
                    pos as u64,
                    Corruption::OutOfBounds {
                        what: "tier or level",
                    },
                ));
            };
            let flags = u16::from_le_bytes([h[2], h[3]]);
            let known = if version >= 2 { FLAG_ZSTD } else { 0 };
            if flags & !known != 0 {
                return Err(bad(
                    pos as u64 + 2,
                    Corruption::OutOfBounds {
                        what: "block flags",
                    },
                ));
            }
            let plen = u32_at(h, 4) as usize;
            let start = pos + BLOCK_HEADER_LEN;
            if plen > co - start {
                return Err(bad(
                    pos as u64 + 4,
                    Corruption::OutOfBounds {
                        what: "block length",
                    },
                ));
            }
            let mut info = BlockInfo {
                tier,
                level,
                min_ws: u64_at(h, 8) as i64,
                max_ws: u64_at(h, 16) as i64,
                start,
                len: plen,
                zstd: flags & FLAG_ZSTD != 0,
                columnar: version >= COLUMNAR,
                metrics: None,
                groups: 0,
                checked: AtomicBool::new(false),
            };
            if version >= DIRECTORY {
                // Checked when first read (`RollupFile::read_block`).
                let Some((groups, lo, hi)) = directory.next() else {
                    return Err(bad(
                        fo as u64 + 16,
                        Corruption::OutOfBounds {
                            what: "block count",
                        },
                    ));
                };
                info.groups = groups;
                info.metrics = Some((lo, hi));
            } else {
                let mut seen = BlockContents::default();
                check_crc(b, &info)
                    .and_then(|()| {
                        let raw = payload(&b[start..start + plen], &info)?;
                        decode_payload(
                            &raw,
                            start as u64,
                            &info,
                            RecordFields::ALL,
                            true,
                            |g| seen.add(g),
                            |_, _| {},
                        )
                    })
                    .map_err(|e| corrupt(path, e))?;
                (info.groups, info.metrics) = (seen.groups, seen.metrics);
                info.checked = AtomicBool::new(true);
            }
            blocks.push(info);
            pos = start + plen;
        }
        if blocks.len() as u64 != n_blocks {
            return Err(bad(
                fo as u64 + 16,
                Corruption::OutOfBounds {
                    what: "block count",
                },
            ));
        }
        Ok(Self {
            id,
            path: path.to_path_buf(),
            map,
            blocks,
            covers,
            wal_cut,
            raw_cut,
            version,
            min_ts,
            max_ts,
            deleted: AtomicBool::new(false),
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// WAL segments numbered below this are fully counted in rollup files.
    pub fn wal_cut(&self) -> u64 {
        self.wal_cut
    }

    /// Raw samples before this time (ms, a minute boundary) have their
    /// gpu-level 1-minute records in rollup files; later ones do not: while
    /// raw data holds them, those records are folded from it when read, and
    /// retention writes them when it drops the raw data. The store's cut is
    /// the largest of its files'. `i64::MIN` for a file before version 4.
    pub fn raw_cut(&self) -> i64 {
        self.raw_cut
    }

    /// Whether this file was written by a flush (or merged from one) before
    /// version 4, and so may hold gpu-level 1-minute records of samples that
    /// raw segments still hold. Imported files (`wal_cut` 0) do not.
    pub(crate) fn is_legacy_flush(&self) -> bool {
        self.version < RAW_CUT && self.wal_cut > 0
    }

    /// The format version the file was written in.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Ids of the rollup files this one replaces (its own included), as inclusive ranges.
    pub fn covers(&self) -> &[(u64, u64)] {
        &self.covers
    }

    pub(crate) fn covers_id(&self, id: u64) -> bool {
        self.covers.iter().any(|&(lo, hi)| lo <= id && id <= hi)
    }

    /// Inclusive range of the sample timestamps counted in this file.
    pub fn time_range(&self) -> (i64, i64) {
        (self.min_ts, self.max_ts)
    }

    pub fn size_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Oldest window start of `tier` in this file, if it has records of it.
    pub(crate) fn min_window(&self, tier: RollupTier) -> Option<i64> {
        self.blocks
            .iter()
            .filter(|b| b.tier == tier)
            .map(|b| b.min_ws)
            .min()
    }

    /// Calls `f` with every record of (`tier`, `level`) in blocks whose window
    /// range overlaps `[min_ws, max_ws]` (record-level filtering is the caller's).
    ///
    /// # Errors
    /// [`Error::Corrupt`] if a block no longer decodes (it did when opened).
    pub fn for_each(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        min_ws: i64,
        max_ws: i64,
        f: impl FnMut(&RollupGroup, RollupRecord),
    ) -> Result<()> {
        self.for_each_matching(tier, level, min_ws, max_ws, &RollupFilter::default(), f)
    }

    /// As [`Self::for_each`], for the groups that `filter` matches only:
    /// blocks whose metric range excludes the filter's metric are skipped
    /// whole, and the records of other groups are parsed but not passed on.
    ///
    /// # Errors
    /// As [`Self::for_each`].
    pub fn for_each_matching(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        min_ws: i64,
        max_ws: i64,
        filter: &RollupFilter,
        mut f: impl FnMut(&RollupGroup, RollupRecord),
    ) -> Result<()> {
        let window = (min_ws, max_ws);
        self.for_each_group(tier, level, window, filter, RecordFields::ALL, |g, rs| {
            for r in rs {
                f(g, r);
            }
        })
    }

    /// As [`Self::for_each_matching`], a group's records of a block at a
    /// time (in window order), with the fields of `fields` only (see
    /// [`RecordFields`]): the columns of the others are not decoded.
    ///
    /// # Errors
    /// As [`Self::for_each`].
    pub fn for_each_group(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        (min_ws, max_ws): (i64, i64),
        filter: &RollupFilter,
        fields: RecordFields,
        mut f: impl FnMut(&RollupGroup, Vec<RollupRecord>),
    ) -> Result<()> {
        for b in &self.blocks {
            if b.is_read(tier, level, min_ws, max_ws, filter.metric.as_deref()) {
                self.read_block(b, fields, |g| filter.matches_ref(g), &mut f)?;
            }
        }
        Ok(())
    }

    /// Checks every block not yet checked: its CRC, its payload, and that it
    /// holds what the directory says. Opening a version 5 file checks its
    /// header, footer, covers and directory only; queries check the blocks
    /// they read, the first time they read them.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for the first block that fails.
    pub fn verify(&self) -> Result<()> {
        for b in &self.blocks {
            if !b.checked.load(Ordering::Acquire) {
                self.read_block(b, RecordFields::ALL, |_| false, |_, _| {})?;
            }
        }
        Ok(())
    }

    /// Parses one block, calling `f` with each group `keep` accepts and its
    /// records, decoded to `fields`; the first read of a block of a version
    /// 5 file decodes every field and checks it as opening an earlier
    /// version does.
    fn read_block(
        &self,
        b: &BlockInfo,
        fields: RecordFields,
        mut keep: impl FnMut(&GroupRef<'_>) -> bool,
        f: impl FnMut(&RollupGroup, Vec<RollupRecord>),
    ) -> Result<()> {
        let first = !b.checked.load(Ordering::Acquire);
        if first {
            check_crc(&self.map, b).map_err(|e| corrupt(&self.path, e))?;
        }
        let fields = if first { RecordFields::ALL } else { fields };
        let mut seen = BlockContents::default();
        let raw =
            payload(&self.map[b.start..b.start + b.len], b).map_err(|e| corrupt(&self.path, e))?;
        decode_payload(
            &raw,
            b.start as u64,
            b,
            fields,
            first,
            |g| {
                if first {
                    seen.add(g);
                }
                keep(g)
            },
            f,
        )
        .map_err(|e| corrupt(&self.path, e))?;
        if first {
            if seen.groups != b.groups || seen.metrics != b.metrics {
                let at = (b.start - BLOCK_HEADER_LEN) as u64;
                return Err(corrupt(
                    &self.path,
                    (
                        at,
                        Corruption::OutOfBounds {
                            what: "block directory entry",
                        },
                    ),
                ));
            }
            b.checked.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// How many groups [`Self::for_each_matching`] decodes for these
    /// arguments and a filter on `metric`: every group of every block it
    /// reads, matching or not.
    pub fn groups_read(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        min_ws: i64,
        max_ws: i64,
        metric: Option<&str>,
    ) -> usize {
        self.blocks
            .iter()
            .filter(|b| b.is_read(tier, level, min_ws, max_ws, metric))
            .map(|b| b.groups)
            .sum()
    }

    /// Merges every record of the file into `tables`.
    ///
    /// # Errors
    /// As [`Self::for_each`].
    pub(crate) fn merge_into(&self, tables: &mut Tables) -> Result<()> {
        for tier in RollupTier::ALL {
            for level in RollupLevel::ALL {
                let t = &mut tables[tier.index()][level.index()];
                self.for_each(tier, level, i64::MIN, i64::MAX, |g, r| {
                    let w = match t.get_mut(g) {
                        Some(w) => w,
                        None => t.entry(g.clone()).or_default(),
                    };
                    w.entry(r.window_start_ms)
                        .and_modify(|m| m.merge(&r))
                        .or_insert(r);
                })?;
            }
        }
        Ok(())
    }

    /// Deletes the file once no one holds it any more.
    pub(crate) fn delete_when_unused(&self) {
        self.deleted.store(true, Ordering::Release);
    }
}

impl Drop for RollupFile {
    fn drop(&mut self) {
        if self.deleted.load(Ordering::Acquire)
            && let Err(e) = fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(file = %self.path.display(), error = %e, "could not delete a dropped rollup file; the next start deletes it");
        }
    }
}

/// Appends the blocks of one table to `out`, and each block's directory
/// entry (group count, smallest and largest metric) to `directory`.
fn encode_table(
    table: &impl TableView,
    tier: RollupTier,
    level: RollupLevel,
    out: &mut Vec<u8>,
    directory: &mut Vec<(usize, String, String)>,
) {
    let mut groups = table.groups().filter(|(_, w)| w.len() > 0).peekable();
    // A group whose windows did not all fit in the previous block.
    let mut pending = None;
    let w = tier.window_ms();
    // Reused from block to block: fresh buffers of a block's size (megabytes
    // for a flush of many series) cost their page faults every time.
    let (mut body, mut raw, mut block) = (Vec::new(), Vec::new(), Vec::new());
    let mut ints: [Vec<i64>; 4] = Default::default();
    let mut values: [Vec<f64>; 5] = Default::default();
    // The metric and record count of each group of the block.
    let mut block_groups: Vec<(&String, usize)> = Vec::new();
    while pending.is_some() || groups.peek().is_some() {
        // A block ends after MAX_BLOCK_GROUPS groups or MAX_BLOCK_RECORDS
        // records, or once its payload would pass MAX_BLOCK_PAYLOAD (at most
        // 90 bytes a record), so that its length fits the u32 field and its
        // columns bound what a reader allocates. A group with more windows
        // than a block holds (an import can give it many) goes on in the
        // next block.
        body.clear();
        block_groups.clear();
        ints.iter_mut().for_each(Vec::clear);
        values.iter_mut().for_each(Vec::clear);
        let mut n_groups = 0usize;
        let (mut min_ws, mut max_ws) = (i64::MAX, i64::MIN);
        while n_groups < MAX_BLOCK_GROUPS
            && ints[0].len() < MAX_BLOCK_RECORDS
            && body.len() + 90 * ints[0].len() < MAX_BLOCK_PAYLOAD
        {
            let Some((g, mut windows)) = pending.take().or_else(|| groups.next()) else {
                break;
            };
            n_groups += 1;
            for s in [&g.metric, &g.cluster, &g.row, &g.rack, &g.host, &g.gpu] {
                put_str(&mut body, s);
            }
            let take = windows.len().min(MAX_BLOCK_RECORDS - ints[0].len());
            put_uvarint(&mut body, take as u64);
            block_groups.push((&g.metric, take));
            for r in windows.by_ref().take(take) {
                let start = r.window_start_ms;
                min_ws = min_ws.min(start);
                max_ws = max_ws.max(start);
                // Aligned (`check_tables`): a group's windows count up by
                // one wherever it has no gap, and its offsets are alike
                // from window to window.
                let [windows, counts, first_off, span] = &mut ints;
                windows.push(start / w);
                counts.push(r.count as i64);
                first_off.push(r.first_ts_ms - start);
                span.push(r.last_ts_ms - r.first_ts_ms);
                for (col, v) in values
                    .iter_mut()
                    .zip([r.sum, r.min, r.max, r.first, r.last])
                {
                    col.push(v);
                }
            }
            if windows.len() > 0 {
                pending = Some((g, windows));
            }
        }
        // Every column as a column block: integers and decimal values
        // bit-packed after the delta order that suits them (neighbouring
        // windows of a group, and neighbouring groups of a metric, hold close
        // values). The values are cut by metric: one metric's fractions
        // would otherwise scale another's integers.
        for col in &ints {
            block.clear();
            crate::column::encode_ints(col, &mut block);
            put_uvarint(&mut body, block.len() as u64);
            body.extend_from_slice(&block);
        }
        let mut at = 0;
        for n in metric_runs(block_groups.iter().map(|(m, n)| (m.as_str(), *n))) {
            for col in &values {
                block.clear();
                crate::column::encode_values(&col[at..at + n], &mut block);
                put_uvarint(&mut body, block.len() as u64);
                body.extend_from_slice(&block);
            }
            at += n;
        }
        raw.clear();
        put_uvarint(&mut raw, n_groups as u64);
        raw.extend_from_slice(&body);
        // Group strings repeat from group to group: zstd (level 3, as column
        // blocks) over the whole payload.
        let mut payload = Vec::with_capacity(raw.len() / 4 + 16);
        put_uvarint(&mut payload, raw.len() as u64);
        payload.extend_from_slice(
            &crate::column::zstd_compress(&raw).expect("BUG: zstd compression of a buffer failed"),
        );
        let plen = u32::try_from(payload.len())
            .expect("BUG: a rollup block over 4 GiB (callers bound windows per group)");
        let mut h = Vec::with_capacity(BLOCK_HEADER_LEN);
        let flags = FLAG_ZSTD.to_le_bytes();
        h.extend_from_slice(&[tier.index() as u8, level.index() as u8, flags[0], flags[1]]);
        h.extend_from_slice(&plen.to_le_bytes());
        h.extend_from_slice(&min_ws.to_le_bytes());
        h.extend_from_slice(&max_ws.to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&h), &payload);
        h.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&h);
        out.extend_from_slice(&payload);
        let metrics = block_groups.iter().map(|(m, _)| m.as_str());
        let lo = metrics.clone().min().unwrap_or_default();
        let hi = metrics.max().unwrap_or_default();
        directory.push((n_groups, lo.to_owned(), hi.to_owned()));
    }
}

/// Encodes `tables` as a rollup file's bytes.
pub(crate) fn encode<T: TableView>(
    wal_cut: u64,
    raw_cut: i64,
    covers: &[(u64, u64)],
    tables: &[[T; 5]; 3],
) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(&out).to_le_bytes());
    let mut directory = Vec::new();
    let (mut min_ts, mut max_ts) = (i64::MAX, i64::MIN);
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            let t = &tables[tier.index()][level.index()];
            for r in t.groups().flat_map(|(_, w)| w) {
                min_ts = min_ts.min(r.first_ts_ms);
                max_ts = max_ts.max(r.last_ts_ms);
            }
            encode_table(t, tier, level, &mut out, &mut directory);
        }
    }
    let covers_off = out.len() as u64;
    let mut c = Vec::new();
    put_uvarint(&mut c, covers.len() as u64);
    for &(lo, hi) in covers {
        put_uvarint(&mut c, lo);
        put_uvarint(&mut c, hi - lo);
    }
    put_uvarint(&mut c, directory.len() as u64);
    for (groups, lo, hi) in &directory {
        put_uvarint(&mut c, *groups as u64);
        put_str(&mut c, lo);
        put_str(&mut c, hi);
    }
    out.extend_from_slice(&c);
    let fo = out.len();
    for v in [
        covers_off,
        c.len() as u64,
        directory.len() as u64,
        wal_cut,
        min_ts as u64,
        max_ts as u64,
        raw_cut as u64,
    ] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&crc32c::crc32c(&c).to_le_bytes());
    let crc = crc32c::crc32c(&out[fo..]);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(FOOTER_MAGIC);
    debug_assert_eq!(out.len() - fo, FOOTER_LEN);
    out
}

/// Writes `tables` to `tmp`, fsyncs, renames to `dst` and fsyncs the
/// directory. When this returns `Ok`, the file is durable.
///
/// # Errors
/// [`Error::Unwritable`] (nothing written) for a record that
/// [`RollupFile::open`] would refuse; I/O errors, after which `tmp` may be
/// left behind (the caller removes it).
pub(crate) fn write<T: TableView>(
    tmp: &Path,
    dst: &Path,
    wal_cut: u64,
    raw_cut: i64,
    covers: &[(u64, u64)],
    tables: &[[T; 5]; 3],
) -> Result<()> {
    if let Err((group, what)) = check_tables(tables) {
        return Err(Error::Unwritable {
            path: dst.to_path_buf(),
            item: group,
            what,
        });
    }
    let bytes = encode(wal_cut, raw_cut, covers, tables);
    let io = |e| Error::io(tmp, e);
    let file = File::create(tmp).map_err(io)?;
    let mut w = BufWriter::new(file);
    w.write_all(&bytes).map_err(io)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    drop(file);
    publish(tmp, dst)
}

/// Merges sorted, inclusive id ranges.
pub(crate) fn union_covers(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.sort();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (lo, hi) in ranges {
        match out.last_mut() {
            Some(l) if lo <= l.1.saturating_add(1) => l.1 = l.1.max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}
