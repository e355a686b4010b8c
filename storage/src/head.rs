//! The head: in-memory, compressed chunks of recent samples.
//!
//! Every series has one open chunk, Gorilla-encoded, that samples are
//! appended to; at `max_chunk_samples` it is sealed into an immutable
//! [`MemChunk`], re-encoded as columns (two thirds of Gorilla's bytes on
//! the real H100 recordings, decoded 3-4 times faster; see
//! [`ChunkCodec::Columns`]), and a new one is opened. A flush takes all chunks out of the head ([`Head::freeze`]) and
//! writes them to a segment; the series themselves stay, so [`SeriesRef`]s held
//! by ingest streams remain valid and the per-series order check survives.
//!
//! Series churn: a series that took no sample since a flush at least
//! `series_idle` ago (and so holds nothing unflushed) leaves the head at the
//! next flush ([`Head::evict_idle`]), so `max_series` counts live series only. Its
//! samples are in segments; if it comes back it is created again, under a
//! new ref, with its order check restored from the segments by the caller.
//! Refs are never reused within a process: a ref a cache still holds after
//! its series left names no series at all ([`Head::was_issued`] tells such a
//! stale ref from one never handed out), never a different one.
//!
//! Ordering policy, per series (`docs/format/column.md` has the read side):
//! - a sample after the series' newest timestamp is appended in order;
//! - a sample with a timestamp the head already holds is a duplicate and is
//!   dropped: the first write wins (re-sent batches store nothing twice). That
//!   includes an out-of-order sample whose timestamp is in one of the series'
//!   head chunks (found by decoding the chunks whose range covers it: only
//!   late samples pay for it), and, through the caller's check
//!   ([`Head::append_with`]), one whose timestamp was already flushed to a
//!   segment. Before rollups, such samples were stored and then hidden by the
//!   readers' first-write-wins dedup; now they are dropped and counted as
//!   duplicates, so that rollups count exactly the samples queries see;
//! - an older sample within `ooo_window_ms` of the newest is kept in the
//!   series' out-of-order buffer, sealed as a chunk of its own;
//! - an older sample beyond the window is dropped as too old.
//!
//! Chunks of a series may therefore overlap in time. Readers sort and dedupe
//! a series whose samples are not in order ([`crate::db::normalize`]); the
//! common, in-order case costs one pass that checks it.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thin_vec::ThinVec;

use crate::column::{self, ColumnError};
use crate::gorilla::{DecodeError, GorillaDecoder, GorillaEncoder};
use crate::postings::{self, Postings};
use crate::series::{
    KeepSeries, KeyArc, KeyHasher, METRIC_NAME_LABEL, Matcher, SeriesKey, SharedKeys,
};
use crate::{Error, Result};

/// Handle of a series in the head. Valid while the series is in the head;
/// never reused for another series within the process (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SeriesRef(pub u32);

/// Hashes a ref (a small, dense integer) with one multiplication
/// (Fibonacci hashing): the ref lookup is on the path of every sample.
#[derive(Debug, Default, Clone, Copy)]
struct RefHasher(u64);

impl Hasher for RefHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = (n as u64 ^ 0x5bd1_e995).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type RefMap<V> = HashMap<u32, V, BuildHasherDefault<RefHasher>>;

/// Ref -> index in [`Head::series`], on the path of every sample. Refs are
/// handed out in order and the series keep that order, so the refs from
/// `base` on map through a dense table (4 bytes a ref, a hole where a series
/// left); the older ones that survive evictions, through a map. A rebuild
/// after evictions starts the table where at least half its refs are live,
/// so the holes cost at most as much as the live refs. (A map of every ref
/// took 12 bytes a series; docs/BENCHMARKS.md.)
#[derive(Debug, Default)]
struct Slots {
    base: u32,
    dense: Vec<u32>,
    old: RefMap<u32>,
}

impl Slots {
    /// A hole in the dense table.
    const NONE: u32 = u32::MAX;

    fn get(&self, r: u32) -> Option<u32> {
        if r >= self.base {
            let i = *self.dense.get((r - self.base) as usize)?;
            (i != Self::NONE).then_some(i)
        } else {
            self.old.get(&r).copied()
        }
    }

    /// Lists `r`, newer than every ref listed, at index `i`.
    fn push(&mut self, r: u32, i: u32) {
        debug_assert!(r >= self.base);
        let at = (r - self.base) as usize;
        debug_assert!(at >= self.dense.len(), "refs are listed in order");
        reserve_an_eighth(&mut self.dense, at + 1);
        self.dense.resize(at, Self::NONE);
        self.dense.push(i);
    }

    /// Lists `refs` (ascending, at indices 0, 1, ...) anew; `next` is the
    /// ref the next new series gets.
    fn rebuild(&mut self, refs: &[u32], next: u32) {
        // The first live ref from which the table is at least half full.
        let n = refs.len();
        let k = (0..n)
            .find(|&k| (next - refs[k]) as usize <= 2 * (n - k))
            .unwrap_or(n);
        self.base = refs.get(k).copied().unwrap_or(next);
        self.old = refs[..k]
            .iter()
            .enumerate()
            .map(|(i, &r)| (r, i as u32))
            .collect();
        self.dense = Vec::new();
        for (i, &r) in refs.iter().enumerate().skip(k) {
            self.push(r, i as u32);
        }
        self.dense.shrink_to_fit();
    }
}

/// How a [`MemChunk`] encodes its samples.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkCodec {
    /// Gorilla ([`GorillaEncoder`]) in the chunk's bytes: the open chunk,
    /// the out-of-order buffer, and chunks sealed before they were full (by
    /// a flush, which writes them out next).
    Gorilla,
    /// Columns ([`crate::column`]): the values in the chunk's bytes
    /// ([`crate::column::encode_head_values`]), the timestamps in a block of
    /// their own ([`crate::column::encode_head_ts`]), one copy of which the
    /// chunks of every series polled together share ([`TsBlocks`]). A full
    /// chunk is re-encoded so when it is sealed, where that is smaller
    /// (docs/BENCHMARKS.md has the sizes).
    Columns { timestamps: Arc<[u8]> },
}

/// The timestamp blocks of the head's column chunks, one copy of each: the
/// series of one GPU (and of one host, for an agent) share their poll
/// times, so their full chunks have the same timestamps. Found by a hash of
/// the timestamps and checked by decoding the block, which costs a fraction
/// of encoding it. Swept when a flush has taken the chunks that used a block.
#[derive(Debug, Default)]
pub(crate) struct TsBlocks {
    blocks: HashMap<u64, Arc<[u8]>>,
    scratch: Vec<i64>,
}

impl TsBlocks {
    /// The block of `ts` ([`column::encode_head_ts`]), shared.
    fn share(&mut self, ts: &[i64]) -> Arc<[u8]> {
        let hash = Self::hash(ts);
        if let Some(b) = self.blocks.get(&hash) {
            self.scratch.clear();
            if column::decode_ts(b, ts.len(), &mut self.scratch).is_ok() && self.scratch == ts {
                return b.clone();
            }
        }
        let mut block = Vec::with_capacity(16);
        column::encode_head_ts(ts, &mut block);
        let b: Arc<[u8]> = Arc::from(block);
        // (Two blocks with one hash: the later one is shared from now on.)
        self.blocks.insert(hash, b.clone());
        b
    }

    fn hash(ts: &[i64]) -> u64 {
        ts.iter().fold(ts.len() as u64, |h, &t| {
            (h.rotate_left(5) ^ t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        })
    }

    /// Drops the blocks no chunk holds any more.
    fn sweep(&mut self) {
        self.blocks.retain(|_, b| Arc::strong_count(b) > 1);
    }

    /// Blocks held, and their bytes.
    #[cfg(test)]
    fn len(&self) -> (usize, usize) {
        (
            self.blocks.len(),
            self.blocks.values().map(|b| b.len()).sum(),
        )
    }
}

/// A sealed, immutable chunk held in memory.
#[derive(Debug, Clone)]
pub struct MemChunk {
    pub min_ts: i64,
    pub max_ts: i64,
    pub count: u32,
    pub codec: ChunkCodec,
    pub bytes: Arc<[u8]>,
    /// Its samples are counted in the rollup files already: refilled from
    /// the WAL below the rollup cut, or kept for the next flush after this
    /// one's rollups were written. Rollups fold only the other chunks.
    pub rolled: bool,
}

/// A series in the head. Kept small: the head holds one per live series
/// (hundreds of thousands), so its sealed chunks are a [`ThinVec`] (one
/// word while empty), its rare out-of-order samples are out of it
/// ([`OooBuffers`]), flags share a word with the series' flush period, the
/// open chunk's first timestamp is read from its bytes and its encoder
/// packs its buffer and counts ([`GorillaEncoder`]) and keeps the newest
/// flushed timestamp while it is empty: 72 bytes
/// (docs/BENCHMARKS.md has the sizes).
#[derive(Debug)]
struct HeadSeries {
    key: KeyArc,
    closed: ThinVec<MemChunk>,
    /// The open chunk; while it is empty, it keeps the series' newest
    /// flushed timestamp ([`HeadSeries::flushed_max`]).
    open: GorillaEncoder,
    r: SeriesRef,
    flags: Flags,
}

/// A [`HeadSeries`]' flags, in the low bits, and above them the flush
/// period ([`Head::evict_idle`] calls so far) in which the series was
/// created or last stored a sample: in one word, the series took 96 bytes,
/// not 104 (72 now).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Flags(u32);

impl Flags {
    /// Defined in the current WAL generation (by a series record or a checkpoint).
    const LOGGED: u32 = 1;
    /// The open chunk's samples are counted in the rollup files already
    /// (see [`MemChunk::rolled`]).
    const OPEN_ROLLED: u32 = 2;
    /// The same of the out-of-order buffer's samples.
    const OOO_ROLLED: u32 = 4;
    /// The series has flushed samples ([`HeadSeries::flushed_max`]).
    const HAS_FLUSHED: u32 = 8;
    /// Bits below the period.
    const PERIOD_SHIFT: u32 = 4;
    /// The last period a series can name (2^28 flushes, at one a second,
    /// take 8 years).
    const MAX_PERIOD: u32 = u32::MAX >> Self::PERIOD_SHIFT;

    /// No flag set, in `period`.
    fn new(period: u32) -> Self {
        let mut f = Self(0);
        f.set_period(period);
        f
    }

    fn period(self) -> u32 {
        self.0 >> Self::PERIOD_SHIFT
    }

    fn set_period(&mut self, period: u32) {
        debug_assert!(period <= Self::MAX_PERIOD);
        let flags = self.0 & ((1 << Self::PERIOD_SHIFT) - 1);
        self.0 = period << Self::PERIOD_SHIFT | flags;
    }

    fn get(self, flag: u32) -> bool {
        self.0 & flag != 0
    }

    fn set(&mut self, flag: u32, on: bool) {
        if on {
            self.0 |= flag;
        } else {
            self.0 &= !flag;
        }
    }
}

impl MemChunk {
    /// A Gorilla chunk of `samples`, in the order given.
    pub(crate) fn gorilla(samples: &[(i64, f64)], rolled: bool) -> Option<Self> {
        let mut e = GorillaEncoder::new();
        for &(t, v) in samples {
            e.append(t, v);
        }
        Some(MemChunk {
            min_ts: samples.iter().map(|s| s.0).min()?,
            max_ts: samples.iter().map(|s| s.0).max()?,
            count: e.count(),
            codec: ChunkCodec::Gorilla,
            bytes: Arc::from(e.bytes()),
            rolled,
        })
    }

    /// Appends the chunk's samples, in chunk order, to `ts` and `vals`. On
    /// an error some of them may have been appended.
    pub fn decode_into(&self, ts: &mut Vec<i64>, vals: &mut Vec<f64>) -> Result<(), DecodeError> {
        match &self.codec {
            ChunkCodec::Gorilla => {
                ts.reserve(self.count as usize);
                vals.reserve(self.count as usize);
                for s in GorillaDecoder::new(&self.bytes, self.count) {
                    let (t, v) = s?;
                    ts.push(t);
                    vals.push(v);
                }
                Ok(())
            }
            ChunkCodec::Columns { timestamps } => {
                let n = self.count as usize;
                let (t0, v0) = (ts.len(), vals.len());
                column::decode_ts(&timestamps[..], n, ts)?;
                column::decode_values(&self.bytes, n, vals)?;
                if ts.len() - t0 != n || vals.len() - v0 != n {
                    return Err(DecodeError::Column(ColumnError::BadLength));
                }
                Ok(())
            }
        }
    }

    /// The samples that decode: a Gorilla chunk's up to the first error, a
    /// column chunk's all or none.
    pub(crate) fn salvage(&self) -> Vec<(i64, f64)> {
        match self.codec {
            ChunkCodec::Gorilla => GorillaDecoder::new(&self.bytes, self.count)
                .map_while(|s| s.ok())
                .collect(),
            ChunkCodec::Columns { .. } => self.samples().unwrap_or_default(),
        }
    }

    /// Whether the chunk holds a sample at `ts_ms` (false if it does not
    /// decode).
    pub(crate) fn holds(&self, ts_ms: i64) -> bool {
        match &self.codec {
            ChunkCodec::Gorilla => GorillaDecoder::new(&self.bytes, self.count)
                .any(|s| s.is_ok_and(|(t, _)| t == ts_ms)),
            // The timestamps alone.
            ChunkCodec::Columns { timestamps } => {
                let mut ts = Vec::new();
                column::decode_ts(timestamps, self.count as usize, &mut ts).is_ok()
                    && ts.contains(&ts_ms)
            }
        }
    }

    /// The chunk's samples, in chunk order.
    pub fn samples(&self) -> Result<Vec<(i64, f64)>, DecodeError> {
        let (mut ts, mut vals) = (Vec::new(), Vec::new());
        self.decode_into(&mut ts, &mut vals)?;
        Ok(ts.into_iter().zip(vals).collect())
    }

    /// This Gorilla chunk as columns ([`ChunkCodec::Columns`]), its
    /// timestamp block shared through `blocks`, if its values take fewer
    /// bytes than the whole Gorilla chunk did (a timestamp block is shared
    /// by many chunks, so its bytes are not counted).
    fn to_columns(&self, blocks: &mut TsBlocks) -> Option<MemChunk> {
        if self.codec != ChunkCodec::Gorilla {
            return None;
        }
        let (mut ts, mut vals) = (Vec::new(), Vec::new());
        self.decode_into(&mut ts, &mut vals).ok()?;
        let mut bytes = Vec::with_capacity(self.bytes.len() / 2);
        column::encode_head_values(&vals, &mut bytes);
        if bytes.len() >= self.bytes.len() {
            return None;
        }
        let c = MemChunk {
            codec: ChunkCodec::Columns {
                timestamps: blocks.share(&ts),
            },
            bytes: Arc::from(bytes),
            ..self.clone()
        };
        debug_assert!(c.samples().is_ok_and(|s| {
            s.iter()
                .zip(ts.iter().zip(&vals))
                .all(|(a, (t, v))| a.0 == *t && a.1.to_bits() == v.to_bits())
                && s.len() == ts.len()
        }));
        Some(c)
    }
}

impl HeadSeries {
    fn new(r: SeriesRef, key: KeyArc, period: u32) -> Self {
        Self {
            key,
            closed: ThinVec::new(),
            open: GorillaEncoder::new(),
            r,
            flags: Flags::new(period),
        }
    }

    /// The newest timestamp taken, or flushed by this series or an earlier
    /// one of its key ([`Self::raise_flushed`]): samples at or before it
    /// are out of order. The open chunk's last sample is the newest taken
    /// in order while it has samples (every sealed chunk is older, and an
    /// out-of-order sample older than a timestamp taken before); when it is
    /// empty, the sealed chunks' newest is, or the flush took them all.
    fn last_ts(&self) -> Option<i64> {
        let taken = self
            .open
            .last_ts()
            .or_else(|| self.closed.iter().map(|c| c.max_ts).max());
        taken.max(self.flushed_max())
    }

    /// The newest timestamp the series has in segments (or in a flush in
    /// progress), if it has flushed samples, or a bound at or above it: an
    /// older sample may duplicate a flushed one. The series does not keep it
    /// apart (8 bytes a series): an empty open chunk keeps it
    /// ([`GorillaEncoder::park_ts`]), exactly, as a flush and a new series
    /// leave it; once the open chunk has samples, those are all newer (taken
    /// in order), and the timestamp before its first bounds it. A bound
    /// above it holds only while a chunk newer than the bound is in the
    /// head, so the newest timestamp taken ([`Self::last_ts`]) stays exact.
    fn flushed_max(&self) -> Option<i64> {
        if !self.flags.get(Flags::HAS_FLUSHED) {
            return None;
        }
        match self.open.parked_ts() {
            Some(t) => Some(t),
            None => self.open.first_ts().map(|t| t.saturating_sub(1)),
        }
    }

    /// Raises the newest flushed timestamp to `ts_ms`, if that is newer.
    fn raise_flushed(&mut self, ts_ms: i64) {
        if let Some(first) = self.open.first_ts() {
            if ts_ms < first {
                // Bounded by the open chunk already.
                self.flags.set(Flags::HAS_FLUSHED, true);
                return;
            }
            // (Not expected: a flushed sample at or after one taken in
            // order.) Sealed, the open chunk keeps the bound exact.
            self.seal_open(u32::MAX, None);
        }
        let t = self.flushed_max().map_or(ts_ms, |t| t.max(ts_ms));
        self.open.park_ts(t);
        self.flags.set(Flags::HAS_FLUSHED, true);
    }

    fn open_rolled(&self) -> bool {
        self.flags.get(Flags::OPEN_ROLLED)
    }

    fn ooo_rolled(&self) -> bool {
        self.flags.get(Flags::OOO_ROLLED)
    }

    /// The open chunk's first timestamp, if it has samples.
    fn open_min_ts(&self) -> Option<i64> {
        self.open.first_ts()
    }

    fn open_chunk(&self) -> Option<MemChunk> {
        let max_ts = self.open.last_ts()?;
        Some(MemChunk {
            min_ts: self.open_min_ts()?,
            max_ts,
            count: self.open.count(),
            codec: ChunkCodec::Gorilla,
            bytes: Arc::from(self.open.bytes()),
            rolled: self.open_rolled(),
        })
    }

    /// Seals the open chunk, if it has samples. A full one is re-encoded as
    /// columns where that is smaller (a flush seals every open chunk and
    /// writes it out next: those stay Gorilla). The next one starts with
    /// room for as many bytes as this one took and an eighth more, when it
    /// was full: series change slowly, so most chunks then fit without
    /// growing (a doubling buffer holds a third more than it uses, on
    /// average, and leaves its smaller copies behind in the allocator).
    fn seal_open(&mut self, max_samples: u32, columns: Option<&mut TsBlocks>) {
        let Some(c) = self.open_chunk() else {
            return;
        };
        let flushed = self.flushed_max();
        let full = c.count >= max_samples;
        let room = if full {
            c.bytes.len() + c.bytes.len() / 8
        } else {
            0
        };
        let sealed = match columns {
            Some(blocks) if full => c.to_columns(blocks).unwrap_or(c),
            _ => c,
        };
        self.closed.push(sealed);
        self.open = GorillaEncoder::with_capacity(room);
        if let Some(t) = flushed {
            self.open.park_ts(t);
        }
    }

    /// Its out-of-order buffer `ooo` as a chunk, sorted by time.
    fn ooo_chunk(&self, ooo: &[(i64, f64)]) -> Option<MemChunk> {
        if ooo.is_empty() {
            return None;
        }
        let mut sorted = ooo.to_vec();
        sorted.sort_by_key(|s| s.0);
        MemChunk::gorilla(&sorted, self.ooo_rolled())
    }

    /// Whether a sealed or open chunk of the head holds a sample at `ts_ms`
    /// (the out-of-order buffer is checked by the caller).
    fn holds(&self, ts_ms: i64) -> bool {
        let has = |bytes: &[u8], count: u32| {
            GorillaDecoder::new(bytes, count).any(|s| s.is_ok_and(|(t, _)| t == ts_ms))
        };
        self.closed
            .iter()
            .any(|c| c.min_ts <= ts_ms && ts_ms <= c.max_ts && c.holds(ts_ms))
            || (self.open_min_ts().is_some_and(|min| min <= ts_ms)
                && has(self.open.bytes(), self.open.count()))
    }

    /// Seals its out-of-order buffer, if it has one in `ooo`.
    fn seal_ooo(&mut self, ooo: &mut OooBuffers) {
        // (Out-of-order samples are rare: the buffer's room goes too.)
        if let Some(buf) = ooo.take(self.r)
            && let Some(c) = self.ooo_chunk(&buf)
        {
            self.closed.push(c);
        }
    }
}

/// The series' out-of-order samples, unsorted, until sealed into a chunk:
/// by ref, out of the series, since few series have any (a buffer in each
/// took 8 bytes a series).
#[derive(Debug, Default)]
struct OooBuffers(RefMap<Vec<(i64, f64)>>);

impl OooBuffers {
    /// The buffer of `r`, empty if it has none.
    fn of(&self, r: SeriesRef) -> &[(i64, f64)] {
        if self.0.is_empty() {
            return &[];
        }
        self.0.get(&r.0).map_or(&[], |b| b.as_slice())
    }

    fn push(&mut self, r: SeriesRef, sample: (i64, f64)) -> usize {
        let buf = self.0.entry(r.0).or_default();
        buf.push(sample);
        buf.len()
    }

    fn take(&mut self, r: SeriesRef) -> Option<Vec<(i64, f64)>> {
        if self.0.is_empty() {
            return None;
        }
        let buf = self.0.remove(&r.0);
        if self.0.is_empty() {
            self.0 = RefMap::default();
        }
        buf
    }
}

/// What [`Head::append`] did with a sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Appended {
    InOrder,
    OutOfOrder,
    Duplicate,
    TooOld,
}

/// The chunks of one series taken out of the head by [`Head::freeze`].
pub(crate) type FrozenSeries = (KeyArc, Vec<MemChunk>);

#[derive(Debug)]
pub(crate) struct Head {
    /// Live series in ref order (creation order; eviction keeps the order).
    series: Vec<HeadSeries>,
    /// Ref -> index in `series`.
    slots: Slots,
    by_key: KeyIndex,
    /// (label, value) -> the refs of its live series, ascending; the metric
    /// name under `__name__`. A selector visits the series its equality and
    /// regex matchers pick through them, not every series.
    postings: Postings,
    /// The live series' keys, one copy each (with their metric names and
    /// label sets), shared with the open segments; swept when series leave.
    keys: Arc<SharedKeys>,
    /// The column chunks' timestamp blocks, one copy each.
    ts_blocks: TsBlocks,
    /// The series' out-of-order buffers.
    ooo: OooBuffers,
    /// The ref the next new series gets; refs are never reused.
    next_ref: u32,
    /// Flush periods so far: [`Self::evict_idle`] ends one.
    period: u32,
    /// When recent periods ended, oldest first.
    period_ends: VecDeque<(u32, Instant)>,
    max_chunk_samples: u32,
    max_series: usize,
    ooo_window_ms: i64,
    samples: u64,
}

impl Head {
    #[cfg(test)]
    pub(crate) fn new(max_chunk_samples: u32, max_series: usize, ooo_window_ms: i64) -> Self {
        Self::with_keys(
            max_chunk_samples,
            max_series,
            ooo_window_ms,
            Arc::new(SharedKeys::default()),
        )
    }

    /// A head whose series keys come from (and stay in) `keys`.
    pub(crate) fn with_keys(
        max_chunk_samples: u32,
        max_series: usize,
        ooo_window_ms: i64,
        keys: Arc<SharedKeys>,
    ) -> Self {
        Self {
            series: Vec::new(),
            slots: Slots::default(),
            by_key: KeyIndex::default(),
            postings: Postings::default(),
            keys,
            ts_blocks: TsBlocks::default(),
            ooo: OooBuffers::default(),
            next_ref: 0,
            period: 0,
            period_ends: VecDeque::new(),
            max_chunk_samples: max_chunk_samples.clamp(1, GorillaEncoder::MAX_SAMPLES),
            max_series,
            ooo_window_ms: ooo_window_ms.max(0),
            samples: 0,
        }
    }

    pub(crate) fn lookup(&self, key: &SeriesKey) -> Option<SeriesRef> {
        let i = self.by_key.find(&self.series, key)?;
        Some(self.series[i as usize].r)
    }

    /// The live series of `r`.
    ///
    /// # Panics
    /// If `r` is not live (callers check with [`Self::contains`]).
    fn get(&self, r: SeriesRef) -> &HeadSeries {
        let i = self.slots.get(r.0).expect("BUG: ref checked live");
        &self.series[i as usize]
    }

    fn get_mut(&mut self, r: SeriesRef) -> &mut HeadSeries {
        let i = self.slots.get(r.0).expect("BUG: ref checked live");
        &mut self.series[i as usize]
    }

    /// Returns the series' handle, creating the series if it is new.
    pub(crate) fn get_or_create(&mut self, key: SeriesKey) -> Result<SeriesRef> {
        if let Some(r) = self.lookup(&key) {
            return Ok(r);
        }
        if self.series.len() >= self.max_series {
            return Err(Error::SeriesLimit {
                limit: self.max_series,
            });
        }
        // 2^32 series created in one process (at a million new series an
        // hour, 490 years) would exhaust the refs; refuse rather than reuse.
        let Some(next) = self.next_ref.checked_add(1) else {
            return Err(Error::SeriesLimit {
                limit: self.max_series,
            });
        };
        let r = SeriesRef(self.next_ref);
        self.next_ref = next;
        let key = self.keys.share(key);
        self.slots.push(r.0, self.series.len() as u32);
        let want = self.series.len() + 1;
        reserve_an_eighth(&mut self.series, want);
        self.series
            .push(HeadSeries::new(r, key.clone(), self.period));
        index(&mut self.postings, &key, r);
        self.by_key
            .insert(&self.series, self.series.len() as u32 - 1);
        Ok(r)
    }

    /// Cuts the series' sealed chunks to one byte each, so that they no
    /// longer decode (tests of the readers' error paths).
    #[cfg(test)]
    pub(crate) fn corrupt_sealed_chunks(&mut self, r: SeriesRef) {
        for c in &mut self.get_mut(r).closed {
            c.bytes = Arc::from(&c.bytes[..1]);
        }
    }

    pub(crate) fn key(&self, r: SeriesRef) -> &SeriesKey {
        &self.get(r).key
    }

    pub(crate) fn key_arc(&self, r: SeriesRef) -> &KeyArc {
        &self.get(r).key
    }

    pub(crate) fn is_logged(&self, r: SeriesRef) -> bool {
        self.get(r).flags.get(Flags::LOGGED)
    }

    pub(crate) fn set_logged(&mut self, r: SeriesRef) {
        self.get_mut(r).flags.set(Flags::LOGGED, true);
    }

    /// The series has flushed samples up to `ts_ms` (WAL replay at open, or
    /// an earlier series of its key, evicted): samples at or before it are
    /// out of order, and may duplicate a flushed one.
    pub(crate) fn raise_flushed(&mut self, r: SeriesRef, ts_ms: i64) {
        self.get_mut(r).raise_flushed(ts_ms);
    }

    /// Whether a sample of `r` at `ts_ms` may duplicate a flushed one, so that
    /// [`Self::append_with`] will ask. Changes at a freeze, and when the open
    /// chunk takes its first sample (whose timestamp then bounds the flushed
    /// ones): ask under the head lock that the append takes.
    pub(crate) fn maybe_flushed(&self, r: SeriesRef, ts_ms: i64) -> bool {
        let s = self.get(r);
        // In order (the common case): newer than everything flushed.
        if s.open.last_ts().is_some_and(|last| ts_ms > last) {
            return false;
        }
        s.flushed_max().is_some_and(|m| ts_ms <= m)
    }

    /// Encodes a WAL series record for every series (their refs as WAL refs)
    /// and marks them all logged: the checkpoint that starts a WAL segment.
    pub(crate) fn checkpoint(&mut self, dst: &mut Vec<u8>) {
        let defs = self.series.iter().map(|s| (s.r.0, &*s.key));
        crate::wal::record::encode_series_batches(dst, defs);
        for s in &mut self.series {
            s.flags.set(Flags::LOGGED, true);
        }
    }

    /// Whether `r` names a live series.
    pub(crate) fn contains(&self, r: SeriesRef) -> bool {
        self.slots.get(r.0).is_some()
    }

    /// Whether this head ever handed out `r`: a ref that was issued but is
    /// not [`Self::contains`] belongs to a series that was evicted.
    pub(crate) fn was_issued(&self, r: SeriesRef) -> bool {
        r.0 < self.next_ref
    }

    /// Ends a flush period (call at a flush, after [`Self::freeze`]) and
    /// evicts every series that stored no sample since a flush at least
    /// `idle` before `now`, holding nothing unflushed (no chunk, no
    /// out-of-order buffer). With `idle` zero, that
    /// is every series idle through the whole period before this one; a
    /// series created in the period ending now always stays. Returns how
    /// many left. Their refs are not reused; their samples are in segments.
    pub(crate) fn evict_idle(&mut self, now: Instant, idle: Duration) -> usize {
        self.period_ends.push_back((self.period, now));
        self.period = (self.period + 1).min(Flags::MAX_PERIOD);
        // Series last active in a period that ended at least `idle` ago
        // (before the one ending now) go.
        let Some(idle_up_to) = self
            .period_ends
            .iter()
            .take_while(|(p, end)| {
                p.saturating_add(1) < self.period && now.saturating_duration_since(*end) >= idle
            })
            .map(|(p, _)| *p)
            .last()
        else {
            return 0;
        };
        while self
            .period_ends
            .front()
            .is_some_and(|(p, _)| *p < idle_up_to)
        {
            self.period_ends.pop_front();
        }
        let before = self.series.len();
        let ooo = &self.ooo;
        self.series.retain(|s| {
            let holds = !s.closed.is_empty() || s.open.count() > 0 || !ooo.of(s.r).is_empty();
            s.flags.period() > idle_up_to || holds
        });
        let evicted = before - self.series.len();
        if evicted > 0 {
            let refs: Vec<u32> = self.series.iter().map(|s| s.r.0).collect();
            self.slots.rebuild(&refs, self.next_ref);
            self.by_key.rebuild(&self.series);
            self.postings.clear();
            for s in &self.series {
                index(&mut self.postings, &s.key, s.r);
            }
            self.keys.sweep();
        }
        evicted
    }

    /// Appends one sample under the ordering policy in the module docs.
    ///
    /// # Panics
    /// If `r` did not come from this head (callers check with [`Self::contains`]).
    #[cfg(test)]
    pub(crate) fn append(&mut self, r: SeriesRef, ts_ms: i64, value: f64) -> Appended {
        self.append_with(r, ts_ms, value, true, |_, _| false)
    }

    /// [`Self::append`]; an accepted sample goes into a chunk marked
    /// [`MemChunk::rolled`] unless `fold` (it is to be folded into the
    /// rollups at the next flush). For a late sample at or before the series' newest flushed
    /// timestamp, `flushed(key, ts_ms)` says whether a segment (or a flush in
    /// progress) already holds that timestamp; if so it is a duplicate.
    pub(crate) fn append_with(
        &mut self,
        r: SeriesRef,
        ts_ms: i64,
        value: f64,
        fold: bool,
        flushed: impl FnOnce(&SeriesKey, i64) -> bool,
    ) -> Appended {
        let (max, period) = (self.max_chunk_samples, self.period);
        let i = self.slots.get(r.0).expect("BUG: ref checked live");
        let s = &mut self.series[i as usize];
        if let Some(last) = s.last_ts()
            && ts_ms <= last
        {
            if ts_ms == last || self.ooo.of(r).iter().any(|&(t, _)| t == ts_ms) {
                return Appended::Duplicate;
            }
            if last.saturating_sub(ts_ms) > self.ooo_window_ms {
                return Appended::TooOld;
            }
            if s.holds(ts_ms)
                || (s.flushed_max().is_some_and(|m| ts_ms <= m) && flushed(&s.key, ts_ms))
            {
                return Appended::Duplicate;
            }
            if !self.ooo.of(r).is_empty() && s.ooo_rolled() == fold {
                s.seal_ooo(&mut self.ooo);
            }
            s.flags.set(Flags::OOO_ROLLED, !fold);
            if self.ooo.push(r, (ts_ms, value)) >= max as usize {
                s.seal_ooo(&mut self.ooo);
            }
            s.flags.set_period(period);
            self.samples += 1;
            return Appended::OutOfOrder;
        }
        // A chunk's samples are all rolled or none: replay's switch from
        // samples the rollup files hold to those they do not seals the chunk.
        if s.open.count() >= max || (s.open.count() > 0 && s.open_rolled() == fold) {
            s.seal_open(max, Some(&mut self.ts_blocks));
        }
        if s.open.count() == 0 {
            s.flags.set(Flags::OPEN_ROLLED, !fold);
        }
        s.open.append(ts_ms, value);
        s.flags.set_period(period);
        self.samples += 1;
        Appended::InOrder
    }

    pub(crate) fn num_series(&self) -> usize {
        self.series.len()
    }

    /// Samples currently held (since the last freeze).
    pub(crate) fn num_samples(&self) -> u64 {
        self.samples
    }

    /// The oldest timestamp the head holds, if any.
    pub(crate) fn min_ts(&self) -> Option<i64> {
        self.series
            .iter()
            .flat_map(|s| {
                let open = s.open_min_ts();
                let closed = s.closed.iter().map(|c| c.min_ts);
                let ooo = self.ooo.of(s.r).iter().map(|&(t, _)| t);
                closed.chain(open).chain(ooo)
            })
            .min()
    }

    /// Takes every chunk out of the head, sorted by series key. Series with
    /// no samples are left out.
    pub(crate) fn freeze(&mut self) -> Vec<FrozenSeries> {
        // The blocks of the chunks the last flush took (and has written by
        // now, or holds on to) go when nothing holds them.
        self.ts_blocks.sweep();
        let mut out: Vec<FrozenSeries> = Vec::new();
        for s in &mut self.series {
            s.seal_open(self.max_chunk_samples, None);
            s.seal_ooo(&mut self.ooo);
            if let Some(m) = s.closed.iter().map(|c| c.max_ts).max() {
                s.raise_flushed(m);
            }
            if !s.closed.is_empty() {
                let chunks = std::mem::take(&mut s.closed).into_iter().collect();
                out.push((s.key.clone(), chunks));
            }
        }
        self.samples = 0;
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// How many samples of the series matching all `matchers` the rollup
    /// files do not count yet (what a rollup read folds from the head).
    pub(crate) fn unrolled_samples(&self, matchers: &[Matcher]) -> usize {
        let mut n = 0;
        self.matching((matchers, &|_| true), |s| {
            let closed = s.closed.iter().filter(|c| !c.rolled);
            n += closed.map(|c| c.count as usize).sum::<usize>();
            n += if s.open_rolled() {
                0
            } else {
                s.open.count() as usize
            };
            n += if s.ooo_rolled() {
                0
            } else {
                self.ooo.of(s.r).len()
            };
        });
        n
    }

    /// Calls `f` with each series that matches all `matchers` and a copy of
    /// its chunks (the open chunk included). Chunks are shared, except the
    /// open one's bytes.
    pub(crate) fn for_each_series(
        &self,
        matchers: &[Matcher],
        f: impl FnMut(&KeyArc, Vec<MemChunk>),
    ) {
        self.for_each_series_where((matchers, &|_| true), f);
    }

    /// [`Self::for_each_series`] of the series `keep` accepts as well.
    pub(crate) fn for_each_series_where(
        &self,
        select: (&[Matcher], KeepSeries<'_>),
        mut f: impl FnMut(&KeyArc, Vec<MemChunk>),
    ) {
        self.matching(select, |s| {
            let mut chunks = s.closed.to_vec();
            chunks.extend(s.open_chunk());
            chunks.extend(s.ooo_chunk(self.ooo.of(s.r)));
            if !chunks.is_empty() {
                f(&s.key, chunks);
            }
        });
    }

    /// Calls `f` with each series that matches all `matchers` (and that
    /// `keep` accepts) and its newest
    /// sample in `[min_ts, max_ts]`, if it has one (see [`Newest`] for which
    /// sample that is). Reads the open chunk's last sample without decoding
    /// when it is in range, which it is for a live read, and decodes only
    /// chunks that could hold a newer one otherwise. A chunk that does not
    /// decode ends that series' search with `Err` passed to `f`.
    pub(crate) fn for_each_newest(
        &self,
        select: (&[Matcher], KeepSeries<'_>),
        (min_ts, max_ts): (i64, i64),
        source: u32,
        mut f: impl FnMut(&KeyArc, std::result::Result<Newest, DecodeError>),
    ) {
        self.matching(select, |s| {
            let mut best = None;
            let mut search = || -> std::result::Result<(), DecodeError> {
                // Read order in the head: sealed chunks, the open one, then
                // the out-of-order buffer. [`Newest::offer`] does not depend
                // on the order of offers, so the open chunk goes first: when
                // its last sample is in range, no sealed chunk can beat it
                // and none is decoded.
                let closed = s.closed.len() as u32;
                let at = (source, closed);
                let at_ooo = |closed: u32| (source, closed + 1);
                match s.open.last() {
                    Some(last @ (t, _)) if min_ts <= t && t <= max_ts => {
                        Newest::offer_newest(&mut best, [last], (min_ts, max_ts), at);
                    }
                    Some((t, _))
                        if Newest::may_beat(
                            best,
                            s.open_min_ts().unwrap_or(t),
                            t,
                            (min_ts, max_ts),
                            at,
                        ) =>
                    {
                        let (bytes, count) = (s.open.bytes(), s.open.count());
                        Newest::scan(&mut best, bytes, count, (min_ts, max_ts), at)?;
                    }
                    _ => {}
                }
                let ooo = self.ooo.of(s.r).iter().copied();
                Newest::offer_newest(&mut best, ooo, (min_ts, max_ts), at_ooo(closed));
                Newest::search_mem(&mut best, &s.closed, source, (min_ts, max_ts))
            };
            match search() {
                Err(e) => f(&s.key, Err(e)),
                Ok(()) => {
                    if let Some(n) = best {
                        f(&s.key, Ok(n));
                    }
                }
            }
        });
    }

    /// Calls `f` with each live series that matches all `matchers` and that
    /// `keep` accepts, in ref order: those the postings pick, or every
    /// series when no matcher can go through them, tested against the
    /// other matchers and `keep`.
    fn matching(
        &self,
        (matchers, keep): (&[Matcher], KeepSeries<'_>),
        mut f: impl FnMut(&HeadSeries),
    ) {
        let (picked, rest) = postings::select(&self.postings, matchers);
        let mut visit = |s: &HeadSeries| {
            if rest.iter().all(|m| m.matches(&s.key)) && keep(&s.key) {
                f(s);
            }
        };
        match picked {
            None => self.series.iter().for_each(visit),
            Some(refs) => refs.into_iter().for_each(|r| visit(self.get(SeriesRef(r)))),
        }
    }
}

/// Series key -> index in [`Head::series`]. The table holds 4-byte indices
/// and compares keys in the series themselves: a map of `Arc` keys to refs
/// took 16 bytes a slot (docs/BENCHMARKS.md, head memory per series).
#[derive(Debug, Default)]
struct KeyIndex {
    table: hashbrown::HashTable<u32>,
    hasher: KeyHasher,
}

impl KeyIndex {
    fn find(&self, series: &[HeadSeries], key: &SeriesKey) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        let i = self
            .table
            .find(hash, |&i| *series[i as usize].key == *key)?;
        Some(*i)
    }

    /// Lists `series[i]`, which is not listed yet.
    fn insert(&mut self, series: &[HeadSeries], i: u32) {
        let hasher = &self.hasher;
        let hash_of = |&j: &u32| hasher.hash_one(&*series[j as usize].key);
        self.table.insert_unique(hash_of(&i), i, hash_of);
    }

    /// Lists every series again (their indices moved).
    fn rebuild(&mut self, series: &[HeadSeries]) {
        self.table = hashbrown::HashTable::with_capacity(series.len());
        for i in 0..series.len() as u32 {
            self.insert(series, i);
        }
    }
}

/// Lists a new series under each of its labels and its metric name.
fn index(postings: &mut Postings, key: &SeriesKey, r: SeriesRef) {
    postings::add(postings, METRIC_NAME_LABEL, key.metric(), r.0);
    for l in key.labels() {
        postings::add(postings, &l.name, &l.value, r.0);
    }
}

/// A series' newest sample in a time range, as a merged read
/// ([`crate::SelectedSeries::read_into`]) would end with: the greatest
/// timestamp, and of samples at one timestamp the one read first. `at`
/// orders where it was read: (source, chunk), sources being segments in
/// order, then a flush in progress, then the head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Newest {
    pub ts_ms: i64,
    pub value: f64,
    pub at: (u32, u32),
}

impl Newest {
    /// Keeps `n` in `best` if it comes after it in a merged read.
    pub(crate) fn offer(best: &mut Option<Newest>, n: Newest) {
        if best.is_none_or(|b| n.ts_ms > b.ts_ms || (n.ts_ms == b.ts_ms && n.at < b.at)) {
            *best = Some(n);
        }
    }

    /// Whether a chunk spanning `[lo, hi]`, read at `at`, could hold a
    /// sample in `range` that [`Self::offer`] keeps over `best`.
    pub(crate) fn may_beat(
        best: Option<Newest>,
        lo: i64,
        hi: i64,
        range: (i64, i64),
        at: (u32, u32),
    ) -> bool {
        let (min_ts, max_ts) = range;
        if lo > max_ts || hi < min_ts {
            return false;
        }
        let top = hi.min(max_ts);
        best.is_none_or(|b| top > b.ts_ms || (top == b.ts_ms && at < b.at))
    }

    /// Offers the newest sample in `range` of `chunks`, the chunks of one
    /// series in one source, read at `(source, index)`: newest chunk first,
    /// each decoded by `decode` only if it [may beat](Self::may_beat) what
    /// was found. The first decoding error ends the search.
    pub(crate) fn search<C, E>(
        best: &mut Option<Newest>,
        chunks: &[C],
        source: u32,
        range: (i64, i64),
        span: impl Fn(&C) -> (i64, i64),
        mut decode: impl FnMut(&C, &mut Option<Newest>, (u32, u32)) -> Result<(), E>,
    ) -> Result<(), E> {
        for (i, c) in chunks.iter().enumerate().rev() {
            let at = (source, i as u32);
            let (lo, hi) = span(c);
            if Self::may_beat(*best, lo, hi, range, at) {
                decode(c, best, at)?;
            }
        }
        Ok(())
    }

    /// [`Self::search`] over chunks in memory.
    pub(crate) fn search_mem(
        best: &mut Option<Newest>,
        chunks: &[MemChunk],
        source: u32,
        range: (i64, i64),
    ) -> Result<(), DecodeError> {
        let span = |c: &MemChunk| (c.min_ts, c.max_ts);
        Self::search(best, chunks, source, range, span, |c, best, at| {
            if c.codec == ChunkCodec::Gorilla {
                return Self::scan(best, &c.bytes, c.count, range, at);
            }
            let (mut ts, mut vals) = (Vec::new(), Vec::new());
            c.decode_into(&mut ts, &mut vals)?;
            Newest::offer_newest(best, ts.into_iter().zip(vals), range, at);
            Ok(())
        })
    }

    /// Decodes a Gorilla chunk and offers its newest sample in `range`.
    pub(crate) fn scan(
        best: &mut Option<Newest>,
        bytes: &[u8],
        count: u32,
        range: (i64, i64),
        at: (u32, u32),
    ) -> Result<(), DecodeError> {
        let mut failed = None;
        let samples =
            GorillaDecoder::new(bytes, count).map_while(|s| s.map_err(|e| failed = Some(e)).ok());
        Newest::offer_newest(best, samples, range, at);
        failed.map_or(Ok(()), Err)
    }

    /// Offers the newest of `samples` (in any order) in `range`: of several
    /// at its timestamp, the first.
    pub(crate) fn offer_newest(
        best: &mut Option<Newest>,
        samples: impl IntoIterator<Item = (i64, f64)>,
        (min_ts, max_ts): (i64, i64),
        at: (u32, u32),
    ) {
        let mut found: Option<(i64, f64)> = None;
        for (t, v) in samples {
            if min_ts <= t && t <= max_ts && found.is_none_or(|(ft, _)| t > ft) {
                found = Some((t, v));
            }
        }
        if let Some((ts_ms, value)) = found {
            Newest::offer(best, Newest { ts_ms, value, at });
        }
    }
}

/// Makes room in `v` for `want` elements, growing it by an eighth (at
/// least 64), not by doubling: a head of 100,000 series held 31 % more room
/// than it used. Growing by an eighth moves each element about eight times
/// as the vector grows (at 120 bytes a series, 100 MB of copies over 100,000
/// series). The head's series and its ref table grow this way.
fn reserve_an_eighth<T>(v: &mut Vec<T>, want: usize) {
    if want > v.capacity() {
        let len = v.len();
        v.reserve_exact((want - len).max(len / 8).max(64));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::series::Label;

    fn key(g: &str) -> SeriesKey {
        SeriesKey::new("m", vec![Label::new("gpu", g)]).unwrap()
    }

    fn decode_all(chunks: &[MemChunk]) -> Vec<(i64, f64)> {
        chunks.iter().flat_map(|c| c.samples().unwrap()).collect()
    }

    proptest::proptest! {
        /// The ref table answers what a map of every live ref does, through
        /// rounds of new series and evictions (a rebuild after each).
        #[test]
        fn slots_map_refs_as_a_map_of_every_ref_does(
            rounds in proptest::collection::vec(
                (0..300u32, proptest::collection::vec(proptest::bool::ANY, 0..400)),
                1..6,
            ),
        ) {
            let (mut slots, mut live, mut next) = (Slots::default(), Vec::<u32>::new(), 0u32);
            for (new, keep) in rounds {
                for _ in 0..new {
                    slots.push(next, live.len() as u32);
                    live.push(next);
                    next += 1;
                }
                let want: HashMap<u32, u32> =
                    live.iter().enumerate().map(|(i, &r)| (r, i as u32)).collect();
                for r in 0..next + 2 {
                    proptest::prop_assert_eq!(slots.get(r), want.get(&r).copied());
                }
                let mut i = 0;
                live.retain(|_| {
                    i += 1;
                    keep.get(i - 1).copied().unwrap_or(true)
                });
                slots.rebuild(&live, next);
                proptest::prop_assert!(
                    slots.dense.len() <= 2 * live.len(),
                    "the dense table is at least half full"
                );
            }
        }
    }

    /// A series' flags and its flush period share a word without touching
    /// each other; the period stops at the last one the word can hold.
    #[test]
    fn flags_and_period_share_a_word() {
        let mut f = Flags::new(5);
        f.set(Flags::LOGGED, true);
        f.set(Flags::HAS_FLUSHED, true);
        f.set_period(Flags::MAX_PERIOD);
        assert_eq!(f.period(), (1 << 28) - 1);
        assert!(f.get(Flags::LOGGED) && f.get(Flags::HAS_FLUSHED));
        assert!(!f.get(Flags::OPEN_ROLLED) && !f.get(Flags::OOO_ROLLED));
        f.set(Flags::LOGGED, false);
        f.set_period(7);
        assert_eq!(
            (f.period(), f.get(Flags::LOGGED), f.get(Flags::HAS_FLUSHED)),
            (7, false, true)
        );
    }

    /// The head holds one per live series: a field added here costs every
    /// series its bytes (docs/BENCHMARKS.md, head memory per series).
    #[test]
    fn a_head_series_takes_at_most_72_bytes() {
        assert!(std::mem::size_of::<GorillaEncoder>() <= 48);
        assert!(std::mem::size_of::<HeadSeries>() <= 72);
    }

    /// The newest flushed timestamp lives in the empty open chunk: exact
    /// after a flush and after a raise, a bound (the timestamp before the
    /// open chunk's first) while the open chunk has samples; the newest
    /// timestamp taken stays exact through seals, flushes and raises.
    #[test]
    fn the_newest_flushed_timestamp_is_parked_in_the_open_chunk() {
        let mut h = Head::new(2, 10, 1_000_000);
        let r = h.get_or_create(key("0")).unwrap();
        assert!(!h.maybe_flushed(r, 0));
        for t in [1000, 2000, 3000] {
            assert_eq!(h.append(r, t, 1.0), Appended::InOrder);
        }
        assert_eq!(h.freeze().len(), 1);
        // Exact after the flush: 3000, not later.
        assert!(h.maybe_flushed(r, 3000) && !h.maybe_flushed(r, 3001));
        assert_eq!(h.append(r, 3000, 1.0), Appended::Duplicate);
        // A late sample the segments hold is a duplicate; one they do not is kept.
        let seen = |_: &SeriesKey, t: i64| t == 2000;
        assert_eq!(h.append_with(r, 2000, 1.0, true, seen), Appended::Duplicate);
        assert_eq!(
            h.append_with(r, 2500, 1.0, true, seen),
            Appended::OutOfOrder
        );
        // Samples in order: the bound is the one before the first, 3999.
        assert_eq!(h.append(r, 4000, 1.0), Appended::InOrder);
        assert!(h.maybe_flushed(r, 3999) && !h.maybe_flushed(r, 4000));
        assert!(!h.maybe_flushed(r, 4001));
        // A full open chunk seals; the newest taken stays 6000.
        for t in [5000, 6000] {
            assert_eq!(h.append(r, t, 1.0), Appended::InOrder);
        }
        assert_eq!(h.append(r, 6000, 1.0), Appended::Duplicate);
        assert_eq!(h.append(r, 5500, 1.0), Appended::OutOfOrder);
        assert_eq!(h.append(r, 7000, 1.0), Appended::InOrder);
        // A raise past the open chunk's first sample (not expected) seals it:
        // 8000 is then the newest, and 7500 late.
        h.raise_flushed(r, 8000);
        assert_eq!(h.append(r, 8000, 1.0), Appended::Duplicate);
        assert_eq!(h.append(r, 7500, 1.0), Appended::OutOfOrder);
        assert!(h.maybe_flushed(r, 8000) && !h.maybe_flushed(r, 8001));
        // The flush takes every sample and parks their newest, 8000.
        let frozen = h.freeze();
        let mut ts = Vec::new();
        for c in &frozen[0].1 {
            c.decode_into(&mut ts, &mut Vec::new()).unwrap();
        }
        ts.sort_unstable();
        assert_eq!(ts, [2500, 4000, 5000, 5500, 6000, 7000, 7500]);
        assert!(h.maybe_flushed(r, 8000) && !h.maybe_flushed(r, 8001));
        assert_eq!(h.append(r, 8001, 1.0), Appended::InOrder);
    }

    #[test]
    fn cuts_chunks_and_freezes_everything() {
        let mut h = Head::new(3, 10, 0);
        let a = h.get_or_create(key("0")).unwrap();
        assert_eq!(h.get_or_create(key("0")).unwrap(), a);
        for t in 0..7 {
            assert_eq!(h.append(a, t, t as f64), Appended::InOrder);
        }
        let mut seen = Vec::new();
        h.for_each_series(&[], |_, c| seen.push(c));
        assert_eq!(seen.len(), 1);
        assert_eq!(
            seen[0].iter().map(|c| c.count).collect::<Vec<_>>(),
            [3, 3, 1]
        );
        assert_eq!(
            decode_all(&seen[0]),
            (0..7).map(|t| (t, t as f64)).collect::<Vec<_>>()
        );

        let frozen = h.freeze();
        assert_eq!(frozen.len(), 1);
        assert_eq!(decode_all(&frozen[0].1).len(), 7);
        assert_eq!(h.num_samples(), 0);
        // The series survives the freeze, and so does its order check.
        assert_eq!(h.append(a, 6, 0.0), Appended::Duplicate);
        assert_eq!(h.append(a, 7, 0.0), Appended::InOrder);
    }

    /// Full chunks are sealed as columns where that is smaller, and every
    /// chunk reads back bit-exact: decimals, and values only Gorilla's XOR
    /// or raw bits hold (NaN payloads, -0.0, infinities, subnormals).
    #[test]
    fn full_chunks_are_sealed_as_columns_and_read_back_bit_exact() {
        let mut h = Head::new(240, 10, 3_600_000);
        let (a, b) = (
            h.get_or_create(key("0")).unwrap(),
            h.get_or_create(key("1")).unwrap(),
        );
        // A power reading to two decimals, polled every 10 s with jitter.
        let power: Vec<(i64, f64)> = (0..600i64)
            .map(|i| {
                (
                    i * 10_000 + (i * 37) % 11,
                    (7_000 + (i * 7919) % 400) as f64 / 100.0,
                )
            })
            .collect();
        let odd = [
            f64::NAN,
            f64::from_bits(0x7ff8_dead_beef_0001),
            -0.0,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::MIN_POSITIVE / 3.0,
            1e300,
            0.1 + 0.2,
        ];
        let weird: Vec<(i64, f64)> = (0..500i64)
            .map(|i| (i * 10_000, odd[i as usize % odd.len()]))
            .collect();
        for (&(t, v), &(u, w)) in power.iter().zip(&weird) {
            assert_eq!(h.append(a, t, v), Appended::InOrder);
            assert_eq!(h.append(b, u, w), Appended::InOrder);
        }
        for &(t, v) in &power[weird.len()..] {
            assert_eq!(h.append(a, t, v), Appended::InOrder);
        }
        let mut seen = Vec::new();
        h.for_each_series(&[], |_, c| seen.push(c));
        let bits = |s: &[(i64, f64)]| s.iter().map(|&(t, v)| (t, v.to_bits())).collect::<Vec<_>>();
        for (chunks, want) in seen.iter().zip([&power, &weird]) {
            assert_eq!(bits(&decode_all(chunks)), bits(want));
            assert_eq!(chunks.iter().map(|c| c.count).collect::<Vec<_>>(), {
                let mut n = vec![240; want.len() / 240];
                n.push(want.len() as u32 % 240);
                n
            });
        }
        // The decimals' full chunks are columns, their values in under a
        // third of the bytes Gorilla takes for the samples; the open chunk
        // is not.
        let gorilla_len = |s: &[(i64, f64)]| {
            let mut e = GorillaEncoder::new();
            s.iter().for_each(|&(t, v)| e.append(t, v));
            e.bytes().len()
        };
        for (c, samples) in seen[0].iter().zip(power.chunks(240)) {
            if c.count == 240 {
                assert!(matches!(c.codec, ChunkCodec::Columns { .. }));
                assert!(
                    c.bytes.len() * 3 < gorilla_len(samples),
                    "{} bytes",
                    c.bytes.len()
                );
                assert_eq!((c.min_ts, c.max_ts), (samples[0].0, samples[239].0));
            } else {
                assert_eq!(c.codec, ChunkCodec::Gorilla);
            }
        }
        // A late sample is checked against the column chunks: a timestamp
        // they hold is a duplicate, one they do not is kept.
        assert_eq!(h.append(a, power[300].0, 1.0), Appended::Duplicate);
        assert_eq!(h.append(a, power[300].0 + 1, 1.0), Appended::OutOfOrder);
        // A flush seals the open chunks as they are and reads everything back.
        let frozen = h.freeze();
        let mut want = power.clone();
        want.push((power[300].0 + 1, 1.0));
        assert_eq!(bits(&decode_all(&frozen[0].1)), bits(&want));
        assert_eq!(bits(&decode_all(&frozen[1].1)), bits(&weird));
        assert_eq!(frozen[0].1[2].codec, ChunkCodec::Gorilla);
    }

    /// Series polled together share one copy of each full chunk's
    /// timestamps; the copy goes once no chunk holds it.
    #[test]
    fn series_polled_together_share_their_timestamp_blocks() {
        let mut h = Head::new(240, 10, 0);
        let refs: Vec<_> = (0..3)
            .map(|g| h.get_or_create(key(&g.to_string())).unwrap())
            .collect();
        for i in 0..500i64 {
            let t = i * 10_000 + (i * 7) % 5;
            for (g, &r) in refs.iter().enumerate() {
                assert_eq!(
                    h.append(r, t, (i % 9 + g as i64) as f64 / 8.0),
                    Appended::InOrder
                );
            }
        }
        let mut seen = Vec::new();
        h.for_each_series(&[], |_, c| seen.push(c));
        let block = |c: &MemChunk| match &c.codec {
            ChunkCodec::Columns { timestamps } => timestamps.clone(),
            ChunkCodec::Gorilla => panic!("a full chunk of eighths is columns"),
        };
        for k in 0..2 {
            let first = block(&seen[0][k]);
            for chunks in &seen[1..] {
                assert!(Arc::ptr_eq(&first, &block(&chunks[k])), "chunk {k}");
            }
        }
        assert!(!Arc::ptr_eq(&block(&seen[0][0]), &block(&seen[0][1])));
        assert_eq!(h.ts_blocks.len().0, 2);
        drop(seen);
        let frozen = h.freeze();
        assert_eq!(h.ts_blocks.len().0, 2, "the flush holds them");
        drop(frozen);
        h.freeze();
        assert_eq!(h.ts_blocks.len(), (0, 0));
    }

    /// A block found under a timestamp list's hash is shared only if it
    /// holds those timestamps.
    #[test]
    fn a_timestamp_block_under_the_same_hash_is_checked() {
        let mut blocks = TsBlocks::default();
        let (a, b): (Vec<i64>, Vec<i64>) = (
            (0..240).map(|i| i * 10).collect(),
            (0..240).map(|i| i * 10 + 1).collect(),
        );
        let block_a = blocks.share(&a);
        assert!(Arc::ptr_eq(&block_a, &blocks.share(&a)));
        // As if `b` hashed like `a`.
        blocks.blocks.insert(TsBlocks::hash(&b), block_a.clone());
        let block_b = blocks.share(&b);
        assert!(!Arc::ptr_eq(&block_a, &block_b));
        let mut got = Vec::new();
        column::decode_ts(&block_b, 240, &mut got).unwrap();
        assert_eq!(got, b);
    }

    /// A column chunk cut short or with a forged timestamp length fails to
    /// decode with an error, whatever reads it.
    #[test]
    fn a_damaged_column_chunk_is_an_error_not_a_panic() {
        let samples: Vec<(i64, f64)> = (0..240)
            .map(|i| (i * 1000, (i % 13) as f64 / 4.0))
            .collect();
        let c = MemChunk::gorilla(&samples, false)
            .unwrap()
            .to_columns(&mut TsBlocks::default())
            .unwrap();
        assert_eq!(c.samples().unwrap(), samples);
        for cut in 0..c.bytes.len() {
            let short = MemChunk {
                bytes: Arc::from(&c.bytes[..cut]),
                ..c.clone()
            };
            assert!(short.samples().is_err(), "cut at {cut}");
            assert!(short.salvage().is_empty());
            // A late sample's check reads the timestamps alone: they are
            // still whole, and the timestamp is taken.
            assert!(short.holds(samples[0].0));
        }
        let ChunkCodec::Columns { timestamps } = &c.codec else {
            panic!("{:?}", c.codec)
        };
        for cut in 0..timestamps.len() {
            let short = MemChunk {
                codec: ChunkCodec::Columns {
                    timestamps: Arc::from(&timestamps[..cut]),
                },
                ..c.clone()
            };
            assert!(short.samples().is_err(), "timestamps cut at {cut}");
            assert!(!short.holds(samples[0].0));
        }
        let mut forged = c.bytes.to_vec();
        forged[0] = 0x7f;
        let forged = MemChunk {
            bytes: Arc::from(forged),
            ..c.clone()
        };
        assert!(matches!(forged.samples(), Err(DecodeError::Column(_))));
        let miscounted = MemChunk {
            count: 241,
            ..c.clone()
        };
        assert!(miscounted.samples().is_err());
    }

    #[test]
    fn out_of_order_window_and_duplicates() {
        let mut h = Head::new(100, 10, 5);
        let a = h.get_or_create(key("0")).unwrap();
        assert_eq!(h.append(a, 10, 1.0), Appended::InOrder);
        assert_eq!(
            h.append(a, 10, 2.0),
            Appended::Duplicate,
            "same timestamp: first write wins"
        );
        assert_eq!(h.append(a, 7, 3.0), Appended::OutOfOrder);
        assert_eq!(h.append(a, 7, 4.0), Appended::Duplicate);
        assert_eq!(
            h.append(a, 5, 5.0),
            Appended::OutOfOrder,
            "exactly at the window edge"
        );
        assert_eq!(h.append(a, 4, 6.0), Appended::TooOld);
        assert_eq!(h.append(a, 11, 7.0), Appended::InOrder);
        assert_eq!(h.num_samples(), 4);
        let mut seen = Vec::new();
        h.for_each_series(&[], |_, c| seen = c);
        // In-order chunk, then the out-of-order chunk, sorted within itself.
        assert_eq!(
            decode_all(&seen),
            [(10, 1.0), (11, 7.0), (5, 5.0), (7, 3.0)]
        );
        let frozen = h.freeze();
        assert_eq!(
            decode_all(&frozen[0].1),
            [(10, 1.0), (11, 7.0), (5, 5.0), (7, 3.0)]
        );
    }

    /// The rollup records the head's series would add at a flush (those of
    /// its chunks not `rolled`), in series order.
    fn rollups(h: &Head) -> Vec<crate::rollup::RollupRecord> {
        let mut out = Vec::new();
        let mut scratch = (Vec::new(), Vec::new());
        h.for_each_series(&[], |_, chunks| {
            crate::db::unrolled_minutes(&chunks, &mut scratch, |r| out.push(r)).unwrap();
        });
        out
    }

    /// Duplicates (same timestamp as the newest sample, as a late one, as one
    /// in a sealed chunk) and too-old samples never reach the rollups.
    #[test]
    fn rejected_samples_are_not_folded() {
        let mut h = Head::new(2, 10, 90_000);
        let a = h.get_or_create(key("0")).unwrap();
        assert_eq!(h.append(a, 60_010, 1.0), Appended::InOrder);
        assert_eq!(h.append(a, 60_010, 100.0), Appended::Duplicate);
        assert_eq!(h.append(a, 60_020, 2.0), Appended::InOrder);
        assert_eq!(h.append(a, 60_030, 3.0), Appended::InOrder);
        assert_eq!(h.append(a, 60_030, -100.0), Appended::Duplicate);
        assert_eq!(h.append(a, 60_005, 4.0), Appended::OutOfOrder);
        assert_eq!(h.append(a, 60_005, 100.0), Appended::Duplicate);
        assert_eq!(
            h.append(a, 60_020, 100.0),
            Appended::Duplicate,
            "in a sealed chunk"
        );
        assert_eq!(h.append(a, 120_000, 5.0), Appended::InOrder);
        assert_eq!(h.append(a, 20_000, 100.0), Appended::TooOld);
        assert_eq!(h.append(a, 59_000, 6.0), Appended::OutOfOrder);
        let r = rollups(&h);
        let summary: Vec<_> = r
            .iter()
            .map(|r| {
                let (ws, n, sum, min, max) = (r.window_start_ms, r.count, r.sum, r.min, r.max);
                (
                    ws,
                    n,
                    sum,
                    min,
                    max,
                    r.first_ts_ms,
                    r.first,
                    r.last_ts_ms,
                    r.last,
                )
            })
            .collect();
        assert_eq!(
            summary,
            [
                (0, 1, 6.0, 6.0, 6.0, 59_000, 6.0, 59_000, 6.0),
                (60_000, 4, 10.0, 1.0, 4.0, 60_005, 4.0, 60_030, 3.0),
                (120_000, 1, 5.0, 5.0, 5.0, 120_000, 5.0, 120_000, 5.0),
            ]
        );
        // A freeze takes the chunks, and so the rollups, out; the next
        // sample starts afresh.
        assert_eq!(h.freeze().len(), 1);
        assert!(rollups(&h).is_empty());
        assert_eq!(h.append(a, 120_001, 7.0), Appended::InOrder);
        let r = rollups(&h);
        assert_eq!((r.len(), r[0].window_start_ms, r[0].count), (1, 120_000, 1));
    }

    /// Samples appended without `fold` (replayed from the WAL below the
    /// rollup cut) go into chunks marked `rolled`, the switch to samples with
    /// it seals the chunk, and the rollups fold only the others; the
    /// out-of-order buffer likewise.
    #[test]
    fn samples_already_in_the_rollups_are_kept_apart() {
        let mut h = Head::new(100, 10, 90_000);
        let a = h.get_or_create(key("0")).unwrap();
        let seen = |_: &SeriesKey, _| false;
        for (t, v, fold) in [
            (60_000, 1.0, false),
            (60_010, 2.0, false),
            (60_005, 50.0, false),
            (60_020, 4.0, true),
            (60_015, 8.0, true),
            (120_000, 16.0, true),
        ] {
            let got = h.append_with(a, t, v, fold, seen);
            assert!(
                matches!(got, Appended::InOrder | Appended::OutOfOrder),
                "{t}"
            );
        }
        let r = rollups(&h);
        let summary: Vec<_> = r
            .iter()
            .map(|r| (r.window_start_ms, r.count, r.sum, r.first, r.last))
            .collect();
        assert_eq!(
            summary,
            [(60_000, 2, 12.0, 8.0, 4.0), (120_000, 1, 16.0, 16.0, 16.0)]
        );
        let frozen = h.freeze();
        let chunks = &frozen[0].1;
        let flags: Vec<(bool, Vec<(i64, f64)>)> = chunks
            .iter()
            .map(|c| (c.rolled, decode_all(std::slice::from_ref(c))))
            .collect();
        assert_eq!(
            flags,
            [
                (true, vec![(60_000, 1.0), (60_010, 2.0)]),
                (true, vec![(60_005, 50.0)]),
                (false, vec![(60_020, 4.0), (120_000, 16.0)]),
                (false, vec![(60_015, 8.0)]),
            ]
        );
    }

    #[test]
    fn series_limit() {
        let mut h = Head::new(100, 2, 0);
        h.get_or_create(key("0")).unwrap();
        h.get_or_create(key("1")).unwrap();
        assert!(matches!(
            h.get_or_create(key("2")),
            Err(Error::SeriesLimit { limit: 2 })
        ));
        // An existing series is still found at the limit.
        assert!(h.get_or_create(key("1")).is_ok());
    }

    /// A selector that names its metric visits that metric's series only,
    /// in ref order, also after evictions moved the series around.
    #[test]
    fn series_of_one_metric_are_found_by_name() {
        let named = |m: &str, g: &str| SeriesKey::new(m, vec![Label::new("gpu", g)]).unwrap();
        let mut h = Head::new(100, 100, 0);
        let t0 = h.get_or_create(named("temp", "0")).unwrap();
        let p0 = h.get_or_create(named("power", "0")).unwrap();
        let t1 = h.get_or_create(named("temp", "1")).unwrap();
        for (i, r) in [t0, p0, t1].into_iter().enumerate() {
            h.append(r, 1, i as f64);
        }
        let visit = |h: &Head, m: Option<&str>| {
            let mut seen = Vec::new();
            let by_name: Vec<Matcher> = m
                .map(|m| Matcher::equal("__name__", m))
                .into_iter()
                .collect();
            h.for_each_series(&by_name, |k, _| seen.push((**k).clone()));
            seen
        };
        assert_eq!(
            visit(&h, Some("temp")),
            [named("temp", "0"), named("temp", "1")]
        );
        assert_eq!(visit(&h, Some("power")), [named("power", "0")]);
        assert!(visit(&h, Some("clock")).is_empty());
        assert_eq!(visit(&h, None).len(), 3);
        // temp/0 goes idle and leaves; temp/1 and power/0 keep writing.
        h.freeze();
        h.evict_idle(Instant::now(), Duration::ZERO);
        h.append(p0, 2, 0.0);
        h.append(t1, 2, 0.0);
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 1);
        // (Only series holding samples are visited.)
        h.append(t1, 3, 0.0);
        h.append(p0, 3, 0.0);
        assert_eq!(visit(&h, Some("temp")), [named("temp", "1")]);
        let t2 = h.get_or_create(named("temp", "2")).unwrap();
        h.append(t2, 3, 0.0);
        assert_eq!(
            visit(&h, Some("temp")),
            [named("temp", "1"), named("temp", "2")]
        );
        assert_eq!(visit(&h, Some("power")), [named("power", "0")]);
    }

    /// The postings pick the same series as testing every matcher on every
    /// series, before and after an eviction rebuilds them.
    #[test]
    fn postings_pick_what_a_scan_picks() {
        let mut h = Head::new(100, 1000, 0);
        let mut refs = Vec::new();
        for i in 0..60u32 {
            let mut labels = vec![
                Label::new("host", format!("h{}", i % 7)),
                Label::new("gpu", (i % 8).to_string()),
            ];
            if i % 3 == 0 {
                labels.push(Label::new("rack", format!("r{}", i % 2)));
            }
            let metric = ["temp", "power", "util"][i as usize % 3];
            let k = SeriesKey::new(metric, labels).unwrap();
            refs.push(h.get_or_create(k).unwrap());
        }
        let re = |n: &str, p: &str| Matcher::regex(n, p).unwrap();
        let selectors = [
            vec![],
            vec![Matcher::equal("__name__", "temp")],
            vec![Matcher::equal("host", "h3"), Matcher::equal("gpu", "3")],
            vec![re("host", "h[12]"), Matcher::not_equal("gpu", "1")],
            vec![Matcher::equal("rack", "")],
            vec![Matcher::equal("rack", "r1"), re("__name__", "temp|util")],
            vec![
                Matcher::not_regex("host", "h0|h1").unwrap(),
                re("rack", "r.*|"),
            ],
            vec![Matcher::equal("host", "nowhere")],
        ];
        let check = |h: &Head| {
            for m in &selectors {
                let mut picked = Vec::new();
                h.for_each_series(m, |k, _| picked.push(k.to_string()));
                let mut want = Vec::new();
                for s in &h.series {
                    if m.iter().all(|m| m.matches(&s.key)) && s.open.count() > 0 {
                        want.push(s.key.to_string());
                    }
                }
                assert_eq!(picked, want, "{m:?}");
            }
        };
        for (i, &r) in refs.iter().enumerate() {
            h.append(r, 1, i as f64);
        }
        check(&h);
        // Flush 1, then only every other series takes a sample: the rest
        // leave at flush 2, and the postings are rebuilt without them.
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 0);
        for &r in refs.iter().step_by(2) {
            h.append(r, 2, 2.0);
        }
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 30);
        for &r in refs.iter().step_by(2) {
            h.append(r, 3, 3.0);
        }
        check(&h);
    }

    /// The series of one GPU share one label set and the series of a metric
    /// one name; what no live key uses leaves the sets when series leave.
    #[test]
    fn keys_share_names_and_label_sets() {
        let mut h = Head::new(100, 1000, 0);
        let named = |m: &str, g: &str| SeriesKey::new(m, vec![Label::new("gpu", g)]).unwrap();
        let t0 = h.get_or_create(named("temp", "0")).unwrap();
        let p0 = h.get_or_create(named("power", "0")).unwrap();
        let t1 = h.get_or_create(named("temp", "1")).unwrap();
        let parts = |r| {
            let (m, l) = h.key(r).parts();
            (m.clone(), l.clone())
        };
        let ((m_t0, l_t0), (m_p0, l_p0), (m_t1, l_t1)) = (parts(t0), parts(p0), parts(t1));
        assert!(l_t0.ptr_eq(&l_p0) && !l_t0.ptr_eq(&l_t1));
        assert!(Arc::ptr_eq(&m_t0, &m_t1) && !Arc::ptr_eq(&m_t0, &m_p0));
        assert_eq!(*h.key(t1), named("temp", "1"));
        assert_eq!(h.keys.len(), (3, 2, 2));
        drop((m_t0, l_t0, m_p0, l_p0, m_t1, l_t1));
        // gpu 1 and power stay idle through two flushes and leave.
        h.append(t0, 1, 1.0);
        h.freeze();
        h.evict_idle(Instant::now(), Duration::ZERO);
        h.append(t0, 2, 1.0);
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 2);
        assert_eq!(h.keys.len(), (1, 1, 1));
        // A new series of gpu 0 gets its label set again.
        let c0 = h.get_or_create(named("clock", "0")).unwrap();
        assert!(h.key(c0).parts().1.ptr_eq(h.key(t0).parts().1));
    }

    /// Issue #14: a series idle through a flush leaves the head at the next
    /// one; the limit then counts live series only, and refs are never
    /// reused (a stale ref is told from one never issued).
    #[test]
    fn idle_series_leave_and_refs_are_not_reused() {
        let mut h = Head::new(100, 2, 0);
        let a = h.get_or_create(key("a")).unwrap();
        let b = h.get_or_create(key("b")).unwrap();
        h.append(a, 1, 1.0);
        // Flush 1: a took a sample, b is new: both stay.
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 0);
        h.append(a, 2, 2.0);
        // Flush 2: a is active, b took nothing since flush 1: b leaves.
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 1);
        assert!(h.contains(a) && !h.contains(b) && h.was_issued(b));
        assert_eq!(h.lookup(&key("b")), None);
        assert_eq!(h.num_series(), 1);
        // Room for one more (limit - 1 live, then limit, then limit + 1).
        let c = h.get_or_create(key("c")).unwrap();
        assert!(matches!(
            h.get_or_create(key("d")),
            Err(Error::SeriesLimit { limit: 2 })
        ));
        assert_ne!(c, b, "refs are never reused");
        assert!(!h.was_issued(SeriesRef(c.0 + 1)));
        // The checkpoint names the live series under their own refs.
        let mut cp = Vec::new();
        h.checkpoint(&mut cp);
        let mut pos = 0;
        let mut named = Vec::new();
        while pos < cp.len() {
            let (rec, len) = crate::wal::record::decode(&cp[pos..]).unwrap();
            if let crate::wal::record::Record::SeriesBatch(series) = rec {
                named.extend(series);
            }
            pos += len;
        }
        assert_eq!(named, [(a.0, key("a")), (c.0, key("c"))]);
        // Samples after the eviction land on the right series.
        assert_eq!(h.append(c, 5, 5.0), Appended::InOrder);
        let mut seen = Vec::new();
        h.for_each_series(&[], |k, ch| {
            seen.push((k.as_ref().clone(), decode_all(&ch)))
        });
        assert_eq!(seen, [(key("c"), vec![(5, 5.0)])]);
        // Flush 3 and 4 with no samples: both leave; nothing is left.
        h.freeze();
        assert_eq!(
            h.evict_idle(Instant::now(), Duration::ZERO),
            1,
            "a took no sample since flush 2"
        );
        h.freeze();
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 1);
        assert_eq!(h.num_series(), 0);
        let b2 = h.get_or_create(key("b")).unwrap();
        assert!(b2.0 > c.0, "a series that comes back gets a new ref");
    }

    /// With a minimum idle time, back-to-back flushes evict nothing: a
    /// series goes once its last sample is behind a flush that long ago.
    #[test]
    fn idle_time_is_measured_from_the_flush_after_the_last_sample() {
        let mut h = Head::new(100, 10, 0);
        let a = h.get_or_create(key("a")).unwrap();
        h.append(a, 1, 1.0);
        let t0 = Instant::now();
        let idle = Duration::from_secs(600);
        let at = |s: u64| t0 + Duration::from_secs(s);
        for s in [0, 1, 2, 300, 599] {
            h.freeze();
            assert_eq!(h.evict_idle(at(s), idle), 0, "{s} s after");
        }
        // The sample came before the flush at 0 s; 600 s later it goes.
        h.freeze();
        assert_eq!(h.evict_idle(at(600), idle), 1);
        assert!(!h.contains(a));
    }

    /// A series with samples not yet frozen is never evicted, whatever its
    /// flags say (the freeze is what empties it).
    #[test]
    fn a_series_holding_samples_stays() {
        let mut h = Head::new(100, 10, 0);
        let a = h.get_or_create(key("a")).unwrap();
        h.append(a, 1, 1.0);
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 0);
        // No freeze in between: the sample is still in the head.
        assert_eq!(h.evict_idle(Instant::now(), Duration::ZERO), 0);
        assert!(h.contains(a));
    }
}

#[cfg(test)]
mod churn_tests;
