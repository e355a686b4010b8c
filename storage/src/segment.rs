//! Sealed segment files: immutable, memory-mapped, self-checking.
//!
//! A segment holds the column chunks of many series for one flush period (or
//! a compacted window), a series index (key -> chunk refs) and label postings
//! (label pair -> series). Layout (`docs/format/segment.md`), integers
//! little-endian:
//!
//! ```text
//! +--------------------------------------------------------------+
//! | header   magic "GPLSSEG1" | version u32 | crc32c(header) u32 |  16 B
//! +--------------------------------------------------------------+
//! | data     timestamp and value blocks (column.md), back to back |
//! +--------------------------------------------------------------+
//! | series index  (series -> labels, chunk refs + crc32c each),  |
//! |               zstd-compressed since version 4                |
//! +--------------------------------------------------------------+
//! | postings      (label name, value) -> ascending series ids,   |
//! |               zstd-compressed since version 4                |
//! +--------------------------------------------------------------+
//! | footer   offsets, lengths, counts, time range, flush range,  |
//! |          wal_cut, crc32cs, magic "GPLSEND1"                  | 108 B
//! +--------------------------------------------------------------+
//! ```
//!
//! Opening validates magic, version, every section checksum and every block
//! offset; block checksums are verified when a chunk is decoded. Any failure
//! is [`Error::Corrupt`] with the file and offset, never a panic.

pub(crate) mod writer;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::codec::{self, Reader};
use crate::column;
use crate::error::Corruption;
use crate::postings::Postings;
use crate::series::{
    InvalidSeries, KeyArc, KeyHasher, Label, LabelSet, METRIC_NAME_LABEL, Matcher, SeriesKey,
    SharedKeys,
};
use crate::{Error, Result, SegmentId};

pub(crate) const MAGIC: &[u8; 8] = b"GPLSSEG1";
pub(crate) const FOOTER_MAGIC: &[u8; 8] = b"GPLSEND1";
/// The version written: 6 since value blocks may be byte planes or repeat
/// masks (5 gave each chunk's index entry its last value, 4 compressed the
/// index and postings, 3 added bit-packed column blocks,
/// `docs/format/column.md`).
pub(crate) const VERSION: u32 = 6;
/// Versions read. Versions 2 and 3 store the index and postings as they
/// are; version 2 differs from 3, and 5 from 6, only in the column kinds
/// they may use.
const READS: std::ops::RangeInclusive<u32> = 2..=VERSION;
/// First version whose index and postings sections are compressed.
const ZSTD_SECTIONS: u32 = 4;
/// First version whose chunk entries carry the chunk's last value.
const LAST_VALUES: u32 = 5;
/// Largest index or postings section, decompressed.
pub(crate) const MAX_SECTION: u64 = u32::MAX as u64;
/// Most samples in one column chunk of a segment.
pub(crate) const MAX_CHUNK_SAMPLES: usize = 4096;
pub(crate) const HEADER_LEN: usize = 16;
pub(crate) const FOOTER_LEN: usize = 11 * 8 + 3 * 4 + 8;

/// Where one column block lives in the file, and its checksum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockRef {
    pub(crate) offset: u64,
    pub(crate) len: u32,
    pub(crate) crc: u32,
}

/// One chunk of a series: a timestamp block (possibly shared with other
/// chunks) and a value block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkRef {
    pub min_ts: i64,
    pub max_ts: i64,
    pub count: u32,
    /// The IEEE-754 bits of the value at `max_ts` (version 5 on).
    last_bits: Option<u64>,
    ts: BlockRef,
    values: BlockRef,
}

impl ChunkRef {
    /// The value of the chunk's newest sample (the one at `max_ts`), bit for
    /// bit, where the file records it (version 5 on); `None` in older files,
    /// whose chunks must be decoded for it.
    pub fn last_value(&self) -> Option<f64> {
        self.last_bits.map(f64::from_bits)
    }

    /// Bytes of the value block (the timestamp block may be shared).
    pub fn value_bytes(&self) -> u32 {
        self.values.len
    }
}

/// The parsed index: the series in key order, and the chunks of all of
/// them in one array (series `i` has `chunks[starts[i]..starts[i + 1]]`):
/// one allocation for the segment, not one per series.
#[derive(Debug)]
struct SeriesIndex {
    keys: Vec<KeyArc>,
    starts: Vec<u32>,
    chunks: Vec<ChunkRef>,
}

/// An open, validated, memory-mapped segment.
#[derive(Debug)]
pub struct Segment {
    id: SegmentId,
    path: PathBuf,
    map: Mmap,
    series: SeriesIndex,
    /// label name -> label value -> ascending series ordinals.
    postings: Postings,
    samples: u64,
    min_ts: i64,
    max_ts: i64,
    /// End of the data region (= start of the index).
    data_end: u64,
    /// Flush sequence numbers covered, inclusive.
    seq: (u64, u64),
    /// Every WAL record in a WAL segment below this number is in this
    /// segment or an older one.
    wal_cut: u64,
    /// Set when retention or compaction dropped the segment: the file is
    /// deleted when the last reader lets go of it.
    deleted: std::sync::atomic::AtomicBool,
    /// Names this open segment for [`TS_BLOCK`]: unique in the process, so
    /// a segment opened at a dropped one's address is not taken for it.
    instance: u64,
}

/// Hands out [`Segment::instance`] numbers.
static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

thread_local! {
    /// The last timestamp block this thread decoded: (segment instance,
    /// block offset, count) and its timestamps. Every field of a GPU's poll,
    /// and every GPU of a host, shares one block (the writer stores it
    /// once), and a selection lists a host's series together, so the next
    /// chunk read usually names the same block: it is then copied, neither
    /// checksummed nor decoded again (a quarter of the decoding of a
    /// one-metric query over the fleet, `callgrind`).
    static TS_BLOCK: std::cell::RefCell<((u64, u64, u32), Vec<i64>)> =
        const { std::cell::RefCell::new(((u64::MAX, 0, 0), Vec::new())) };
}

impl Segment {
    /// Opens and validates a segment file.
    ///
    /// # Errors
    /// [`Error::Io`] if the file can't be read, [`Error::Corrupt`] with the
    /// offset of the first problem if it doesn't validate.
    pub fn open(path: &Path, id: SegmentId) -> Result<Self> {
        Self::open_sharing(path, id, &SharedKeys::default())
    }

    /// [`Self::open`], its series keys taken from (or added to) `keys`: a
    /// storage's segments and head share one copy of each.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub(crate) fn open_sharing(path: &Path, id: SegmentId, keys: &SharedKeys) -> Result<Self> {
        let map = crate::files::map_sealed(path)?;
        Self::from_map(path, id, map, keys)
    }

    /// Opens and validates a segment just written to `tmp`, before its
    /// rename to `path` (the map stays valid across the rename: same file);
    /// the segment reports `path`.
    ///
    /// # Errors
    /// As [`Self::open`], naming `path`.
    pub(crate) fn open_renamed(
        tmp: &Path,
        path: &Path,
        id: SegmentId,
        keys: &SharedKeys,
    ) -> Result<Self> {
        let map = crate::files::map_sealed(tmp)?;
        Self::from_map(path, id, map, keys)
    }

    /// Validates a segment held in memory (fuzzing, tools). The bytes are copied
    /// into an anonymous map; the segment reports the path `<memory>`.
    ///
    /// # Errors
    /// As [`Self::open`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let path = Path::new("<memory>");
        let map = crate::files::map_copy(bytes)?;
        if bytes.is_empty() {
            return Err(Error::Corrupt {
                path: path.into(),
                offset: 0,
                kind: Corruption::TooShort { len: 0 },
            });
        }
        Self::from_map(path, SegmentId(0), map, &SharedKeys::default())
    }

    fn from_map(path: &Path, id: SegmentId, map: Mmap, keys: &SharedKeys) -> Result<Self> {
        let corrupt = |offset: u64, kind: Corruption| Error::Corrupt {
            path: path.to_path_buf(),
            offset,
            kind,
        };
        let len = map.len();
        if len < HEADER_LEN + FOOTER_LEN {
            return Err(corrupt(0, Corruption::TooShort { len: len as u64 }));
        }
        if &map[..8] != MAGIC {
            return Err(corrupt(0, Corruption::BadMagic));
        }
        let stored = u32::from_le_bytes(map[12..16].try_into().expect("BUG: 4 bytes"));
        let actual = crc32c::crc32c(&map[..12]);
        if stored != actual {
            return Err(corrupt(
                12,
                Corruption::ChecksumMismatch {
                    section: "header",
                    expected: stored,
                    actual,
                },
            ));
        }
        let version = u32::from_le_bytes(map[8..12].try_into().expect("BUG: 4 bytes"));
        if !READS.contains(&version) {
            return Err(corrupt(8, Corruption::UnsupportedVersion { version }));
        }

        let fstart = len - FOOTER_LEN;
        let footer = &map[fstart..];
        if &footer[FOOTER_LEN - 8..] != FOOTER_MAGIC {
            return Err(corrupt((len - 8) as u64, Corruption::BadMagic));
        }
        let u64_at = |i: usize| {
            u64::from_le_bytes(footer[i * 8..i * 8 + 8].try_into().expect("BUG: 8 bytes"))
        };
        let u32_at =
            |o: usize| u32::from_le_bytes(footer[o..o + 4].try_into().expect("BUG: 4 bytes"));
        let (stored, actual) = (u32_at(96), crc32c::crc32c(&footer[..96]));
        if stored != actual {
            return Err(corrupt(
                (fstart + 96) as u64,
                Corruption::ChecksumMismatch {
                    section: "footer",
                    expected: stored,
                    actual,
                },
            ));
        }
        let (index_off, index_len, post_off, post_len) =
            (u64_at(0), u64_at(1), u64_at(2), u64_at(3));
        let (series_count, samples) = (u64_at(4), u64_at(5));
        let (min_ts, max_ts) = (u64_at(6) as i64, u64_at(7) as i64);
        let seq = (u64_at(8), u64_at(9));
        let wal_cut = u64_at(10);
        if seq.0 > seq.1 {
            return Err(corrupt(
                fstart as u64 + 64,
                Corruption::OutOfBounds {
                    what: "flush sequence range",
                },
            ));
        }
        let section = |off: u64, n: u64, what: &'static str| -> Result<&[u8]> {
            off.checked_add(n)
                .filter(|&end| off >= HEADER_LEN as u64 && end <= fstart as u64)
                .map(|end| &map[off as usize..end as usize])
                .ok_or_else(|| corrupt(fstart as u64, Corruption::OutOfBounds { what }))
        };
        let index = section(index_off, index_len, "index section")?;
        let post = section(post_off, post_len, "postings section")?;
        for (bytes, off, stored, name) in [
            (index, index_off, u32_at(88), "index"),
            (post, post_off, u32_at(92), "postings"),
        ] {
            let actual = crc32c::crc32c(bytes);
            if actual != stored {
                return Err(corrupt(
                    off,
                    Corruption::ChecksumMismatch {
                        section: name,
                        expected: stored,
                        actual,
                    },
                ));
            }
        }

        // Offsets in errors inside a compressed section are its file offset
        // plus the position in its decompressed bytes.
        let unzip = |stored, off, what| {
            section_bytes(version, stored, off, what).map_err(|(o, k)| corrupt(o, k))
        };
        let index = unzip(index, index_off, "compressed index")?;
        let post = unzip(post, post_off, "compressed postings")?;
        let data_end = index_off;
        let (parsed, starts, chunks) =
            parse_index(&index, index_off, data_end, series_count, version)
                .map_err(|(o, k)| corrupt(o, k))?;
        let postings =
            parse_postings(&post, post_off, parsed.len()).map_err(|(o, k)| corrupt(o, k))?;
        // Shared once the whole file validated: a corrupt one adds no keys.
        let series = SeriesIndex {
            keys: keys.share_all(parsed),
            starts,
            chunks,
        };
        let postings = keys.share_postings(postings);
        Ok(Self {
            id,
            path: path.to_path_buf(),
            map,
            series,
            postings,
            samples,
            min_ts,
            max_ts,
            data_end,
            seq,
            wal_cut,
            deleted: std::sync::atomic::AtomicBool::new(false),
            instance: INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }

    /// The flush sequence numbers this segment covers, inclusive: one for a
    /// flushed segment, the union of its sources for a compacted one.
    pub fn seq_range(&self) -> (u64, u64) {
        self.seq
    }

    /// WAL segments numbered below this are fully contained in segments.
    pub fn wal_cut(&self) -> u64 {
        self.wal_cut
    }

    /// Deletes the file once no one holds this segment any more. Queries
    /// that hold it keep reading it until they finish.
    pub(crate) fn delete_when_unused(&self) {
        self.deleted
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub fn id(&self) -> SegmentId {
        self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn num_series(&self) -> usize {
        self.series.keys.len()
    }

    pub fn num_samples(&self) -> u64 {
        self.samples
    }

    pub fn size_bytes(&self) -> u64 {
        self.map.len() as u64
    }

    /// Inclusive time range of the samples in the segment.
    pub fn time_range(&self) -> (i64, i64) {
        (self.min_ts, self.max_ts)
    }

    /// Ordinals of the series matching all `matchers`, ascending: the
    /// postings answer what they can ([`crate::postings::select`]), the
    /// other matchers are checked against each candidate's labels.
    pub fn select(&self, matchers: &[Matcher]) -> Vec<u32> {
        let (candidates, rest) = crate::postings::select(&self.postings, matchers);
        let all = || (0..self.series.keys.len() as u32).collect();
        candidates
            .unwrap_or_else(all)
            .into_iter()
            .filter(|&i| {
                // Ordinals from the postings were checked against the index
                // when the segment opened.
                self.series
                    .keys
                    .get(i as usize)
                    .is_some_and(|k| rest.iter().all(|m| m.matches(k)))
            })
            .collect()
    }

    pub fn series_key(&self, ordinal: u32) -> &KeyArc {
        &self.series.keys[ordinal as usize]
    }

    /// Ordinal of the series with exactly this key (the index is sorted by key).
    pub(crate) fn find_series(&self, key: &SeriesKey) -> Option<u32> {
        self.series
            .keys
            .binary_search_by(|k| k.as_ref().cmp(key))
            .ok()
            .map(|i| i as u32)
    }

    /// Whether the series `key` has a sample at exactly `ts_ms` here. A chunk
    /// that does not decode counts as not holding it.
    pub(crate) fn has_sample(&self, key: &SeriesKey, ts_ms: i64) -> bool {
        if ts_ms < self.min_ts || ts_ms > self.max_ts {
            return false;
        }
        let Some(ord) = self.find_series(key) else {
            return false;
        };
        let (mut ts, mut vals) = (Vec::new(), Vec::new());
        self.chunks(ord)
            .iter()
            .filter(|c| c.min_ts <= ts_ms && ts_ms <= c.max_ts)
            .any(|c| {
                ts.clear();
                vals.clear();
                self.read_chunk(c, &mut ts, &mut vals).is_ok() && ts.contains(&ts_ms)
            })
    }

    pub fn chunks(&self, ordinal: u32) -> &[ChunkRef] {
        let i = ordinal as usize;
        let s = &self.series;
        &s.chunks[s.starts[i] as usize..s.starts[i + 1] as usize]
    }

    /// Bytes of the data region: every timestamp and value block.
    pub fn data_bytes(&self) -> u64 {
        self.data_end - HEADER_LEN as u64
    }

    fn block(&self, r: &BlockRef, what: &'static str) -> Result<&[u8]> {
        // Bounds were validated at open.
        let bytes = &self.map[r.offset as usize..r.offset as usize + r.len as usize];
        let actual = crc32c::crc32c(bytes);
        if actual != r.crc {
            return Err(Error::Corrupt {
                path: self.path.clone(),
                offset: r.offset,
                kind: Corruption::ChecksumMismatch {
                    section: what,
                    expected: r.crc,
                    actual,
                },
            });
        }
        Ok(bytes)
    }

    /// Checks the chunk's checksums, decodes it and appends its samples.
    ///
    /// # Errors
    /// [`Error::Corrupt`] if a checksum does not match or a block does not
    /// decode; nothing is appended then.
    pub fn read_chunk(
        &self,
        c: &ChunkRef,
        ts_ms: &mut Vec<i64>,
        values: &mut Vec<f64>,
    ) -> Result<()> {
        let (t0, v0, n) = (ts_ms.len(), values.len(), c.count as usize);
        let bad_block = |offset: u64, e: column::ColumnError| Error::Corrupt {
            path: self.path.clone(),
            offset,
            kind: Corruption::BadBlock(e),
        };
        let at = (self.instance, c.ts.offset, c.count);
        let hit = TS_BLOCK.with_borrow(|(key, ts)| {
            let hit = *key == at;
            if hit {
                ts_ms.extend_from_slice(ts);
            }
            hit
        });
        if !hit {
            let tb = self.block(&c.ts, "timestamp block")?;
            if let Err(e) = column::decode_ts(tb, n, ts_ms) {
                ts_ms.truncate(t0);
                return Err(bad_block(c.ts.offset, e));
            }
            TS_BLOCK.with_borrow_mut(|(key, ts)| {
                *key = at;
                ts.clear();
                ts.extend_from_slice(&ts_ms[t0..]);
            });
        }
        let decoded = self.block(&c.values, "value block").and_then(|vb| {
            column::decode_values(vb, n, values).map_err(|e| bad_block(c.values.offset, e))
        });
        if decoded.is_err() {
            ts_ms.truncate(t0);
            values.truncate(v0);
        }
        decoded
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.deleted.load(std::sync::atomic::Ordering::Acquire)
            && let Err(e) = std::fs::remove_file(&self.path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(segment = %self.path.display(), error = %e, "could not delete a dropped segment; the next start deletes it");
        }
    }
}

/// A section's bytes as [`parse_index`] and [`parse_postings`] read them:
/// decompressed from version [`ZSTD_SECTIONS`] on, as stored before.
fn section_bytes<'a>(
    version: u32,
    stored: &'a [u8],
    offset: u64,
    what: &'static str,
) -> codec::ReadResult<Cow<'a, [u8]>> {
    if version < ZSTD_SECTIONS {
        return Ok(Cow::Borrowed(stored));
    }
    // The writer refuses sections over 4 GiB decompressed.
    codec::zstd_section(stored, offset, MAX_SECTION, what).map(Cow::Owned)
}

fn parse_index(
    buf: &[u8],
    base: u64,
    data_end: u64,
    expect: u64,
    version: u32,
) -> codec::ReadResult<(Vec<SeriesKey>, Vec<u32>, Vec<ChunkRef>)> {
    let mut r = Reader::new(buf, base);
    // Every series takes at least 3 bytes, so a count above that is corrupt;
    // checking it first keeps a forged count from driving a huge allocation.
    let n = r.len("series count", buf.len() / 3)?;
    if n as u64 != expect {
        return Err((
            base,
            Corruption::OutOfBounds {
                what: "series count",
            },
        ));
    }
    let mut out = Vec::with_capacity(n);
    let mut starts = Vec::with_capacity(n + 1);
    starts.push(0u32);
    let mut all_chunks: Vec<ChunkRef> = Vec::with_capacity(n);
    // The series of one GPU repeat one label set, those of one metric one
    // name: each is checked and copied once, and found again by its bytes
    // (the storage's shared keys take them after). Allocating every string
    // of every series, to drop them all for the shared copies, was three
    // quarters of opening a segment (callgrind).
    let mut names: HashMap<&[u8], Arc<String>, KeyHasher> = HashMap::default();
    let mut label_sets: HashMap<&[u8], LabelSet, KeyHasher> = HashMap::default();
    let at_pos = |r: &Reader| (r.offset() - base) as usize;
    for _ in 0..n {
        let at = r.offset();
        let name = r.len("metric name", buf.len())?;
        let name = r.bytes(name, "metric name")?;
        let metric = match names.get(name) {
            Some(m) => m.clone(),
            None => {
                let m = std::str::from_utf8(name).map_err(|_| (at, Corruption::BadUtf8))?;
                let m = Arc::new(m.to_owned());
                names.insert(name, m.clone());
                m
            }
        };
        let bad = |e| (at, Corruption::BadSeries(e));
        let from = r.clone();
        let seen = skip_labels(&mut r, buf.len())
            .ok()
            .and_then(|()| label_sets.get(&buf[at_pos(&from)..at_pos(&r)]));
        let labels = match seen {
            Some(set) if !metric.is_empty() => set.clone(),
            Some(_) => return Err(bad(InvalidSeries::EmptyMetric)),
            // The first of its kind, or a bad one: parsed in full, the
            // first error in the order the bytes lie in.
            None => {
                r = from.clone();
                let labels = parse_labels(&mut r, buf.len())?;
                if metric.is_empty() {
                    return Err(bad(InvalidSeries::EmptyMetric));
                }
                let set = SeriesKey::label_set(labels).map_err(bad)?;
                label_sets.insert(&buf[at_pos(&from)..at_pos(&r)], set.clone());
                set
            }
        };
        let key = SeriesKey::from_parts(metric, labels);
        let nc = r.len("chunk count", buf.len())?;
        for _ in 0..nc {
            let at = r.offset();
            let min_ts = r.varint("chunk min_ts")?;
            let span = r.uvarint("chunk span")?;
            let count = r.len("chunk sample count", MAX_CHUNK_SAMPLES)? as u32;
            let mut block = |what| -> codec::ReadResult<BlockRef> {
                let offset = r.uvarint(what)?;
                let len = r.len(what, u32::MAX as usize)? as u32;
                let crc = r.u32_le(what)?;
                let in_bounds = offset >= HEADER_LEN as u64
                    && offset
                        .checked_add(len as u64)
                        .is_some_and(|end| end <= data_end);
                if !in_bounds || len == 0 {
                    return Err((at, Corruption::OutOfBounds { what }));
                }
                Ok(BlockRef { offset, len, crc })
            };
            let ts = block("timestamp block")?;
            let values = block("value block")?;
            let last_bits = if version >= LAST_VALUES {
                Some(r.u64_le("chunk last value")?)
            } else {
                None
            };
            if count == 0 {
                return Err((
                    at,
                    Corruption::OutOfBounds {
                        what: "chunk sample count",
                    },
                ));
            }
            // The writer refuses samples outside the storable range, so a
            // chunk outside it is corrupt (and its span cannot overflow).
            let max_ts = i64::try_from(span)
                .ok()
                .and_then(|s| min_ts.checked_add(s))
                .filter(|&m| crate::ts_storable(min_ts) && crate::ts_storable(m));
            let Some(max_ts) = max_ts else {
                return Err((
                    at,
                    Corruption::OutOfBounds {
                        what: "chunk time range",
                    },
                ));
            };
            all_chunks.push(ChunkRef {
                min_ts,
                max_ts,
                count,
                last_bits,
                ts,
                values,
            });
        }
        out.push(key);
        // Every chunk takes more than one byte of the index, so their count
        // stays far below u32::MAX for any index that fits in memory.
        let end = u32::try_from(all_chunks.len()).map_err(|_| {
            (
                at,
                Corruption::OutOfBounds {
                    what: "chunk count",
                },
            )
        })?;
        starts.push(end);
    }
    if !r.is_empty() {
        return Err((
            r.offset(),
            Corruption::OutOfBounds {
                what: "index trailing bytes",
            },
        ));
    }
    Ok((out, starts, all_chunks))
}

/// A series' labels in the index: their count, then each name and value.
fn parse_labels(r: &mut Reader<'_>, max: usize) -> codec::ReadResult<Vec<Label>> {
    let nl = r.len("label count", max)?;
    let mut labels = Vec::with_capacity(nl.min(64));
    for _ in 0..nl {
        labels.push(Label::new(r.str("label name")?, r.str("label value")?));
    }
    Ok(labels)
}

/// Moves `r` past what [`parse_labels`] reads, checking lengths only.
fn skip_labels(r: &mut Reader<'_>, max: usize) -> codec::ReadResult<()> {
    let nl = r.len("label count", max)?;
    for _ in 0..nl {
        for what in ["label name", "label value"] {
            let n = r.len(what, max)?;
            r.bytes(n, what)?;
        }
    }
    Ok(())
}

fn parse_postings(buf: &[u8], base: u64, nseries: usize) -> codec::ReadResult<Postings> {
    let mut r = Reader::new(buf, base);
    let n = r.len("postings count", buf.len())?;
    let mut out = Postings::default();
    let mut ids: Vec<u32> = Vec::new();
    for _ in 0..n {
        let name = r.string("postings label name")?;
        let value = r.string("postings label value")?;
        let k = r.len("postings list length", nseries)?;
        ids.clear();
        let mut cur: u64 = 0;
        for i in 0..k {
            let at = r.offset();
            let d = r.uvarint("postings delta")?;
            cur = cur.saturating_add(d);
            if cur >= nseries as u64 || (i > 0 && d == 0) {
                return Err((
                    at,
                    Corruption::OutOfBounds {
                        what: "postings series id",
                    },
                ));
            }
            ids.push(cur as u32);
        }
        // Ascending (a zero delta after the first is refused above): the
        // bitmap takes them without checking each against the last, as
        // `push` does.
        let mut bitmap =
            roaring::RoaringBitmap::from_sorted_iter(ids.iter().copied()).map_err(|_| {
                (
                    r.offset(),
                    Corruption::OutOfBounds {
                        what: "postings series ids not ascending",
                    },
                )
            })?;
        // Its smallest form: a segment's series are in key order, so each
        // metric's ids are one run.
        bitmap.optimize();
        out.entry(name.into())
            .or_default()
            .insert(value.into(), bitmap);
    }
    if !r.is_empty() {
        return Err((
            r.offset(),
            Corruption::OutOfBounds {
                what: "postings trailing bytes",
            },
        ));
    }
    // The metric name must be indexed for every series; this catches a postings
    // section that was valid but belongs to another file.
    let named: usize = out
        .get(METRIC_NAME_LABEL)
        .map_or(0, |v| v.values().map(|ids| ids.len() as usize).sum());
    if named != nseries {
        return Err((
            base,
            Corruption::OutOfBounds {
                what: "metric name postings",
            },
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
