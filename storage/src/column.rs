//! Column codecs of sealed segments: one block of timestamps and one block of
//! values per chunk, each choosing its own encoding and naming it in its
//! first byte (`docs/format/column.md`).
//!
//! What GPU telemetry looks like, and what each choice exploits:
//! - Every field of one poll shares the poll's timestamp, so many series have
//!   the same timestamp column. Timestamps are a block of their own, which the
//!   segment writer stores once and shares between chunks.
//! - Values are mostly decimals with a fixed number of digits (71.4 W,
//!   0.000006) or integers (MHz, MiB, counters). Such a chunk is stored as the
//!   integers `v * 10^d`, after the delta order (none, delta, delta of delta)
//!   that makes them smallest, in bit-packed frames of 128 ([`packed`]): a
//!   fixed-width unpack decodes them several times faster than varints. Where
//!   zigzag varints under zstd are clearly smaller (PCIe counters quantised to
//!   a few thousand distinct values, mostly constant columns), those are
//!   stored instead.
//! - Segments from version 6 also store such integers as byte planes
//!   ([`planes`]), each plane zstd-compressed when that saves an eighth of
//!   it, where that is smaller than the packed frames: noisy columns have
//!   random low bytes and high bytes that take few values, which zstd codes
//!   in a few bits. And a column whose values often repeat the one before
//!   them (a field refreshed more slowly than it is polled) may store a
//!   bitmap of the repeats and only the other values.
//! - Timestamps are delta-of-deltas in the same packed frames.
//! - zstd runs over a timestamp block, and a varint or fallback value block,
//!   when that makes it smaller.
//! - Anything else (NaN, -0.0, values with more than 9 decimals) falls back to
//!   Gorilla's XOR encoding, or to raw bits.
//!
//! All encodings are lossless and bit-exact. Decoders never panic; they check
//! every length, including the declared size of zstd output.

use crate::codec::{Reader, put_uvarint, put_varint};
use crate::gorilla::{XorDecoder, XorEncoder};

mod floats;
mod packed;
mod planes;

const ZSTD_FLAG: u8 = 0x80;
const ZSTD_LEVEL: i32 = 3;

const TS_DOD: u8 = 1;
const TS_PACKED: u8 = 2;

const VAL_RAW: u8 = 0;
const VAL_XOR: u8 = 1;
const VAL_DECIMAL: u8 = 2;
const VAL_PACKED: u8 = 3;
const VAL_REPEATS: u8 = 4;
const VAL_PLANES: u8 = 5;

/// The kind of a repeat mask's block: the bitmap as it is (zstd when smaller).
const MASK_BITMAP: u8 = 0;
/// A repeat mask is tried when at least one value in this many repeats the
/// one before it: below that its bit a sample (less under zstd) cannot pay.
const MASK_MIN_SHARE: usize = 32;

/// Largest decimal exponent tried: up to 9 digits after the point.
const MAX_SCALE: u8 = 9;
const POW10: [f64; 10] = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9];

/// A column block did not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ColumnError {
    #[error("block is empty")]
    Empty,
    #[error("unknown block encoding {0:#04x}")]
    UnknownEncoding(u8),
    #[error("block ends early or has trailing bytes")]
    BadLength,
    #[error("zstd payload is invalid")]
    Zstd,
    #[error("invalid decimal scale {0}")]
    BadScale(u8),
}

thread_local! {
    /// One zstd compression context per thread, reused: creating one per
    /// block (its tables allocated and cleared each time) was a third of the
    /// time of a flush of 200,000 series (docs/BENCHMARKS.md, issue #18).
    static CCTX: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// `data` compressed at [`ZSTD_LEVEL`] by this thread's context; the bytes
/// are those of `zstd::bulk::compress(data, ZSTD_LEVEL)`.
pub(crate) fn zstd_compress(data: &[u8]) -> std::io::Result<Vec<u8>> {
    CCTX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let cctx = match &mut *slot {
            Some(c) => c,
            None => slot.insert(zstd::bulk::Compressor::new(ZSTD_LEVEL)?),
        };
        cctx.compress(data)
    })
}

/// Appends `payload` to `out` under `kind`, zstd-compressed if that is smaller.
fn put_block(out: &mut Vec<u8>, kind: u8, payload: &[u8]) {
    put_block_saving(out, kind, payload, 1);
}

/// [`put_block`], zstd-compressed only if that saves at least `min_saving`
/// bytes.
fn put_block_saving(out: &mut Vec<u8>, kind: u8, payload: &[u8], min_saving: usize) {
    if payload.len() > 32
        && let Ok(z) = zstd_compress(payload)
    {
        let mut head = Vec::with_capacity(10);
        put_uvarint(&mut head, payload.len() as u64);
        if head.len() + z.len() + min_saving <= payload.len() {
            out.push(kind | ZSTD_FLAG);
            out.extend_from_slice(&head);
            out.extend_from_slice(&z);
            return;
        }
    }
    out.push(kind);
    out.extend_from_slice(payload);
}

thread_local! {
    /// One zstd decompression context per thread, reused: creating one (its
    /// tables and window buffer) cost more than decoding a series' block in
    /// a scan, 52 % of a full scan's time (docs/BENCHMARKS.md, issue #5).
    static DCTX: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { std::cell::RefCell::new(None) };
}

/// Splits a block into its kind and (decompressed) payload. `max_raw` bounds
/// the declared decompressed size, so a forged header cannot allocate much.
fn open_block(
    block: &[u8],
    max_raw: usize,
) -> Result<(u8, std::borrow::Cow<'_, [u8]>), ColumnError> {
    let (&first, rest) = block.split_first().ok_or(ColumnError::Empty)?;
    if first & ZSTD_FLAG == 0 {
        return Ok((first, rest.into()));
    }
    let mut r = Reader::new(rest, 0);
    let raw_len = r
        .len("zstd length", max_raw)
        .map_err(|_| ColumnError::BadLength)?;
    let z = &rest[r.offset() as usize..];
    let raw = DCTX.with(|cell| {
        let mut slot = cell.borrow_mut();
        let dctx = match &mut *slot {
            Some(d) => d,
            None => slot.insert(zstd::bulk::Decompressor::new().map_err(|_| ColumnError::Zstd)?),
        };
        dctx.decompress(z, raw_len).map_err(|_| ColumnError::Zstd)
    })?;
    if raw.len() != raw_len {
        return Err(ColumnError::BadLength);
    }
    Ok((first & !ZSTD_FLAG, raw.into()))
}

/// Encodes a timestamp column: bit-packed frames of the delta-of-deltas,
/// after the first value and the first delta, zstd-compressed if smaller.
pub fn encode_ts(ts: &[i64], out: &mut Vec<u8>) {
    let mut p = Vec::with_capacity(ts.len() + 16);
    packed::write(&packed::plan(ts, 2), &mut p);
    put_block(out, TS_PACKED, &p);
}

/// Encodes a column of integers (the rollup files' windows, counts and
/// offsets): a timestamp block's kind and payload, bit-packed frames at the
/// delta order that packs smallest, zstd-compressed if smaller (5 % smaller
/// rollup files on the simulated fleet than leaving it to the zstd run over
/// the whole rollup block). [`decode_ints`] reads it.
pub(crate) fn encode_ints(xs: &[i64], out: &mut Vec<u8>) {
    let mut p = Vec::with_capacity(xs.len() + 16);
    packed::write(&packed::plan_best(xs), &mut p);
    put_block(out, TS_PACKED, &p);
}

/// Decodes `n` integers written by [`encode_ints`] and appends them to `out`.
pub(crate) fn decode_ints(block: &[u8], n: usize, out: &mut Vec<i64>) -> Result<(), ColumnError> {
    let (kind, payload) = open_block(block, n.saturating_mul(10).saturating_add(16))?;
    if kind != TS_PACKED {
        return Err(ColumnError::UnknownEncoding(kind));
    }
    out.reserve(n);
    packed::unpack(&payload, n, |f| out.extend_from_slice(f))
}

/// Decodes `n` timestamps from `block` and appends them to `out`.
pub fn decode_ts(block: &[u8], n: usize, out: &mut Vec<i64>) -> Result<(), ColumnError> {
    let (kind, payload) = open_block(block, n.saturating_mul(10).saturating_add(16))?;
    if kind == TS_PACKED {
        out.reserve(n);
        return packed::unpack(&payload, n, |f| out.extend_from_slice(f));
    }
    if kind != TS_DOD {
        return Err(ColumnError::UnknownEncoding(kind));
    }
    // Kind 1, segment v2: zigzag varints of the delta-of-deltas.
    let mut r = Varints {
        buf: &payload,
        pos: 0,
    };
    out.reserve(n);
    let (mut prev, mut prev_delta) = (0i64, 0i64);
    for i in 0..n {
        let x = r.next()?;
        let delta = if i < 2 { x } else { prev_delta.wrapping_add(x) };
        prev = prev.wrapping_add(delta);
        prev_delta = delta;
        out.push(prev);
    }
    if r.pos != payload.len() {
        return Err(ColumnError::BadLength);
    }
    Ok(())
}

/// Zigzag varints of a payload, read by the decoders' hot loops: the same
/// rules as [`Reader::varint`], without its error offsets.
struct Varints<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Varints<'_> {
    /// The next varint. One- and two-byte varints (most deltas of a
    /// decimal column) take one bounds check and no loop.
    #[inline(always)]
    fn next(&mut self) -> Result<i64, ColumnError> {
        let z = match self.buf.get(self.pos..) {
            Some(&[b0, ..]) if b0 < 0x80 => {
                self.pos += 1;
                b0 as u64
            }
            Some(&[b0, b1, ..]) if b1 < 0x80 => {
                self.pos += 2;
                (b0 & 0x7f) as u64 | (b1 as u64) << 7
            }
            _ => return self.next_long(),
        };
        Ok(((z >> 1) as i64) ^ -((z & 1) as i64))
    }

    /// A varint of any length, every byte checked.
    #[inline(never)]
    fn next_long(&mut self) -> Result<i64, ColumnError> {
        let mut z = 0u64;
        let mut shift = 0u32;
        loop {
            let &b = self.buf.get(self.pos).ok_or(ColumnError::BadLength)?;
            self.pos += 1;
            if shift == 63 && b > 1 {
                return Err(ColumnError::BadLength);
            }
            z |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(((z >> 1) as i64) ^ -((z & 1) as i64));
            }
            shift += 7;
            if shift > 63 {
                return Err(ColumnError::BadLength);
            }
        }
    }

    /// Fills `out` with the integers of `ORDER` rounds of differencing read
    /// from here, each passed through `f`. One loop per order and scale, so
    /// that neither is a branch per value.
    #[inline(always)]
    fn undiff_into<const ORDER: u8>(
        &mut self,
        out: &mut [f64],
        f: impl Fn(i64) -> f64,
    ) -> Result<(), ColumnError> {
        let (mut p1, mut p2) = (0i64, 0i64);
        for slot in out {
            let v = self.next()?;
            let x = match ORDER {
                0 => v,
                1 => p1.wrapping_add(v),
                _ => p1.wrapping_add(p2.wrapping_add(v)),
            };
            p2 = x.wrapping_sub(p1);
            p1 = x;
            *slot = f(x);
        }
        Ok(())
    }
}

/// The smallest decimal exponent `d` such that every value is exactly
/// `n / 10^d` for an integer `|n| < 2^53`, with its integers.
fn as_decimal(vals: &[f64]) -> Option<(u8, Vec<i64>)> {
    let mut d = 0u8;
    // The integers of the values so far at `d`: when a value needs a finer
    // scale, those before it are rescaled rather than found again (most
    // columns of halves or tenths start with a whole number).
    let mut ints = Vec::with_capacity(vals.len());
    let mut rescaled = true;
    for &v in vals {
        loop {
            if let Some(n) = exact_at(v, d) {
                ints.push(n);
                break;
            }
            d += 1;
            if d > MAX_SCALE {
                return None;
            }
            rescaled = rescaled && rescale(&mut ints);
        }
    }
    if rescaled {
        return Some((d, ints));
    }
    // A value so large that ten times its integer might not be what
    // `exact_at` finds at the finer scale: all of them at the last one.
    vals.iter()
        .map(|&v| exact_at(v, d))
        .collect::<Option<Vec<i64>>>()
        .map(|ints| (d, ints))
}

/// The integers of [`exact_at`] at scale `d - 1` as those at `d`, each ten
/// times as large, or false (and `ints` partly rescaled) if one is too large
/// for that to hold. For `|10n| < 2^50` it does: `v` is `n / 10^(d-1)`
/// rounded once, so `v * 10^d`, rounded once more, is within a quarter of
/// `10n`, which rounds to it, and `10n / 10^d` is the same quotient as
/// `n / 10^(d-1)`, rounded to the same `v`.
fn rescale(ints: &mut [i64]) -> bool {
    const LIMIT: i64 = (1 << 50) / 10;
    for n in ints {
        if n.abs() >= LIMIT {
            return false;
        }
        *n *= 10;
    }
    true
}

/// The integer `n` the decoder would see for `v` at scale `d`, if `v`
/// round-trips bit-exactly through it: `round(v * 10^d)`, `|n| < 2^53`, and
/// `n as f64 / 10^d` is `v`. Going through the integer is what turns away
/// -0.0, which would come back as +0.0.
#[inline]
fn exact_at(v: f64, d: u8) -> Option<i64> {
    let n = round_to_int(v * POW10[d as usize])?;
    ((n as f64 / POW10[d as usize]).to_bits() == v.to_bits()).then_some(n)
}

/// `x` rounded half away from zero, as `f64::round` does, if `|x| < 2^53`.
/// Without SSE4.1 `f64::round` is a call into libm, and this is the
/// encoder's inner loop; `x - trunc(x)` is exact in this range.
#[inline]
fn round_to_int(x: f64) -> Option<i64> {
    // (NaN fails the comparison too.)
    if x.abs().partial_cmp(&9_007_199_254_740_992.0) != Some(std::cmp::Ordering::Less) {
        return None;
    }
    let t = x as i64;
    let f = x - t as f64;
    let n = if f >= 0.5 {
        t + 1
    } else if f <= -0.5 {
        t - 1
    } else {
        t
    };
    (n.unsigned_abs() < 1 << 53).then_some(n)
}

/// Zigzag varints of `ints` after `order` rounds of differencing.
fn diff_varints(ints: &[i64], order: u8, out: &mut Vec<u8>) {
    let (mut p1, mut p2) = (0i64, 0i64);
    for &x in ints {
        let d1 = x.wrapping_sub(p1);
        let v = match order {
            0 => x,
            1 => d1,
            _ => d1.wrapping_sub(p2),
        };
        put_varint(out, v);
        p1 = x;
        p2 = d1;
    }
}

/// How much larger than varints under zstd a bit-packed value block, which
/// decodes about twice as fast, may be and still be chosen: 10 %, or 1/64 of
/// a byte per sample (docs/BENCHMARKS.md, "Codec throughput").
const PACKED_SLACK_PCT: usize = 10;
const PACKED_SLACK_SAMPLES_PER_BYTE: usize = 64;

/// Encodes a value column with the kinds rollup files use (0 to 3). Picks
/// the smallest encoding, or bit-packed frames if they are at most a little
/// larger.
pub fn encode_values(vals: &[f64], out: &mut Vec<u8>) {
    encode_values_with(vals, out, false);
}

/// [`encode_values`], or, if `planes`, choosing between bit-packed frames
/// and byte planes (kind 5) for decimals.
fn encode_values_with(vals: &[f64], out: &mut Vec<u8>, planes: bool) {
    let Some((d, ints)) = as_decimal(vals) else {
        let mut x = XorEncoder::default();
        for &v in vals {
            x.append(v);
        }
        let mut xor = Vec::new();
        put_block(&mut xor, VAL_XOR, x.bytes());
        let raw: Vec<u8> = vals
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        let mut block = Vec::new();
        put_block(&mut block, VAL_RAW, &raw);
        out.extend_from_slice(if block.len() < xor.len() {
            &block
        } else {
            &xor
        });
        return;
    };
    // Bit-packed frames, at the delta order that packs smallest.
    let mut packed = vec![VAL_PACKED, d];
    let plan = packed::plan_best(&ints);
    packed::write(&plan, &mut packed);
    // (Bit-packed frames under zstd were smaller still on 40 % of the real
    // recordings, all nearly constant, for 0.005 B/sample in all; not worth
    // a third zstd run per chunk at flush.)
    // Byte planes, at the order that packed smallest.
    if planes {
        let mut b = vec![VAL_PLANES, d];
        let smaller = planes::write(&plan, packed.len(), &mut b) && b.len() < packed.len();
        out.extend_from_slice(if smaller { &b } else { &packed });
        return;
    }
    // (Varints under zstd beside byte planes: 0.2 % smaller on the real
    // recordings, for their encoding and a zstd run; segments do not try
    // them.)
    // Varints under zstd, at the delta order with the fewest varint bytes.
    // (Judging each order by its size after zstd saved 0.5 % on the real
    // recordings, for two more zstd runs per chunk: docs/BENCHMARKS.md.)
    let p = (0..=2u8)
        .map(|order| {
            let mut p = vec![d, order];
            diff_varints(&ints, order, &mut p);
            p
        })
        .min_by_key(|p| p.len())
        .expect("BUG: three orders");
    let mut varints = Vec::new();
    put_block(&mut varints, VAL_DECIMAL, &p);
    let slack =
        (varints.len() * PACKED_SLACK_PCT / 100).max(vals.len() / PACKED_SLACK_SAMPLES_PER_BYTE);
    out.extend_from_slice(if packed.len() <= varints.len() + slack {
        &packed
    } else {
        &varints
    });
}

/// Encodes a value column of a sealed head chunk: decimals as bit-packed
/// frames at the delta order that packs smallest, anything else as Gorilla's
/// XOR or raw bits, whichever is smaller. No zstd and no byte planes: it
/// runs on the ingest path, once per chunk when it fills, and the flush
/// re-encodes the samples for the segment anyway. [`decode_values`] reads it.
pub fn encode_head_values(vals: &[f64], out: &mut Vec<u8>) {
    let Some((d, ints)) = as_decimal(vals) else {
        let mut x = XorEncoder::default();
        for &v in vals {
            x.append(v);
        }
        if x.bytes().len() < vals.len() * 8 {
            out.push(VAL_XOR);
            out.extend_from_slice(x.bytes());
        } else {
            out.push(VAL_RAW);
            out.extend(vals.iter().flat_map(|v| v.to_bits().to_le_bytes()));
        }
        return;
    };
    out.extend_from_slice(&[VAL_PACKED, d]);
    packed::write(&packed::plan_best(&ints), out);
}

/// Encodes a timestamp column of a sealed head chunk: [`encode_ts`]'s
/// bit-packed delta-of-deltas, without zstd (see [`encode_head_values`]).
pub fn encode_head_ts(ts: &[i64], out: &mut Vec<u8>) {
    out.push(TS_PACKED);
    packed::write(&packed::plan(ts, 2), out);
}

/// Encodes a value column of a segment (version 6 on): as [`encode_values`]
/// but with byte planes in place of varints for decimals, or, where values
/// often repeat the one before them, as a mask of the repeats and the other
/// values, whichever is smaller. DCGM's profiling
/// fields and counters refresh more slowly than they are polled, so a noisy
/// column repeats itself at every stalled poll (a tenth of the samples of
/// the recorded H100 training run), and a repeat costs its full width in
/// every other encoding.
pub fn encode_segment_values(vals: &[f64], out: &mut Vec<u8>) {
    let start = out.len();
    encode_values_with(vals, out, true);
    let repeats = vals
        .windows(2)
        .filter(|w| w[0].to_bits() == w[1].to_bits())
        .count();
    if repeats == 0 || repeats * MASK_MIN_SHARE < vals.len() {
        return;
    }
    let mut bits = vec![0u8; vals.len().div_ceil(8)];
    let mut rest = Vec::with_capacity(vals.len() - repeats);
    for (i, &v) in vals.iter().enumerate() {
        if i > 0 && v.to_bits() == vals[i - 1].to_bits() {
            bits[i / 8] |= 1 << (i % 8);
        } else {
            rest.push(v);
        }
    }
    let mut mask = Vec::new();
    put_block(&mut mask, MASK_BITMAP, &bits);
    let mut block = vec![VAL_REPEATS];
    put_uvarint(&mut block, mask.len() as u64);
    block.extend_from_slice(&mask);
    encode_values_with(&rest, &mut block, true);
    if block.len() < out.len() - start {
        out.truncate(start);
        out.extend_from_slice(&block);
    }
}

/// Decodes `n` values from `block` and appends them to `out`.
pub fn decode_values(block: &[u8], n: usize, out: &mut Vec<f64>) -> Result<(), ColumnError> {
    decode_values_of(block, n, out, true)
}

/// [`decode_values`], with a repeat mask (kind 4) accepted only at the top:
/// the values under a mask never carry another.
fn decode_values_of(
    block: &[u8],
    n: usize,
    out: &mut Vec<f64>,
    masks: bool,
) -> Result<(), ColumnError> {
    let (kind, payload) = open_block(block, n.saturating_mul(10).saturating_add(16))?;
    out.reserve(n);
    match kind {
        VAL_REPEATS if masks => decode_repeats(&payload, n, out)?,
        VAL_RAW => {
            if payload.len() != n * 8 {
                return Err(ColumnError::BadLength);
            }
            out.extend(
                payload.chunks_exact(8).map(|c| {
                    f64::from_bits(u64::from_le_bytes(c.try_into().expect("BUG: 8 bytes")))
                }),
            );
        }
        VAL_XOR => {
            for v in XorDecoder::new(&payload, n as u32) {
                out.push(v.map_err(|_| ColumnError::BadLength)?);
            }
        }
        VAL_DECIMAL => {
            let (&d, rest) = payload.split_first().ok_or(ColumnError::BadLength)?;
            let (&order, rest) = rest.split_first().ok_or(ColumnError::BadLength)?;
            if d > MAX_SCALE {
                return Err(ColumnError::BadScale(d));
            }
            if order > 2 {
                return Err(ColumnError::BadLength);
            }
            let mut r = Varints { buf: rest, pos: 0 };
            let start = out.len();
            out.resize(start + n, 0.0);
            let dst = &mut out[start..];
            let scale = POW10[d as usize];
            let decoded = match (order, d) {
                (0, 0) => r.undiff_into::<0>(dst, |x| x as f64),
                (1, 0) => r.undiff_into::<1>(dst, |x| x as f64),
                (_, 0) => r.undiff_into::<2>(dst, |x| x as f64),
                (0, _) => r.undiff_into::<0>(dst, |x| x as f64 / scale),
                (1, _) => r.undiff_into::<1>(dst, |x| x as f64 / scale),
                (_, _) => r.undiff_into::<2>(dst, |x| x as f64 / scale),
            };
            if let Err(e) = decoded {
                out.truncate(start);
                return Err(e);
            }
            if r.pos != rest.len() {
                return Err(ColumnError::BadLength);
            }
        }
        VAL_PACKED | VAL_PLANES => {
            let (&d, rest) = payload.split_first().ok_or(ColumnError::BadLength)?;
            if d > MAX_SCALE {
                return Err(ColumnError::BadScale(d));
            }
            fn unpack(
                kind: u8,
                payload: &[u8],
                n: usize,
                frame: impl FnMut(&[i64]),
            ) -> Result<(), ColumnError> {
                if kind == VAL_PACKED {
                    packed::unpack(payload, n, frame)
                } else {
                    planes::unpack(payload, n, frame)
                }
            }
            let start = out.len();
            let scale = (d > 0).then(|| POW10[d as usize]);
            let unpacked = unpack(kind, rest, n, |f| floats::extend(out, f, scale));
            if let Err(e) = unpacked {
                out.truncate(start);
                return Err(e);
            }
        }
        other => return Err(ColumnError::UnknownEncoding(other)),
    }
    Ok(())
}

/// Decodes a repeat mask's payload (kind 4): the mask's block, then the
/// values that do not repeat, which are spread over the `n` slots in place.
fn decode_repeats(payload: &[u8], n: usize, out: &mut Vec<f64>) -> Result<(), ColumnError> {
    let mut r = Reader::new(payload, 0);
    let mask_len = r
        .len("mask length", payload.len())
        .map_err(|_| ColumnError::BadLength)?;
    let mask = r
        .bytes(mask_len, "mask")
        .map_err(|_| ColumnError::BadLength)?;
    let inner = &payload[r.offset() as usize..];
    let (kind, bits) = open_block(mask, n.div_ceil(8).saturating_add(16))?;
    if kind != MASK_BITMAP {
        return Err(ColumnError::UnknownEncoding(kind));
    }
    if bits.len() != n.div_ceil(8) {
        return Err(ColumnError::BadLength);
    }
    // Bit i set: value i repeats value i - 1. The first has none before it,
    // and the bits past the last value are clear.
    let tail_clear = n.is_multiple_of(8) || bits[bits.len() - 1] >> (n % 8) == 0;
    if (n > 0 && bits[0] & 1 != 0) || !tail_clear {
        return Err(ColumnError::BadLength);
    }
    let repeats: usize = bits.iter().map(|b| b.count_ones() as usize).sum();
    let start = out.len();
    decode_values_of(inner, n - repeats, out, false)?;
    out.resize(start + n, 0.0);
    spread_repeats(&bits, &mut out[start..], n - repeats);
    Ok(())
}

/// Spreads the first `kept` values of `dst` over all its slots, in place:
/// slot i takes the value of the last clear bit of `bits` at or before it.
/// From the back, where that value's index is below i unless every slot up
/// to i is clear (then it is i itself). `bits` is checked: its first bit
/// is clear and it has `dst.len() - kept` bits set, none past the end.
fn spread_repeats(bits: &[u8], dst: &mut [f64], mut kept: usize) {
    let n = dst.len();
    for (byte, &b) in bits.iter().enumerate().rev() {
        let lo = byte * 8;
        let hi = (lo + 8).min(n);
        if b == 0 && hi - lo == 8 {
            // No repeats among these eight (half the bytes of a noisy
            // column): the eight values before `kept`, as they are.
            let run: [f64; 8] = dst[kept - 8..kept].try_into().expect("BUG: eight values");
            dst[lo..hi].copy_from_slice(&run);
            kept -= 8;
            continue;
        }
        for i in (lo..hi).rev() {
            dst[i] = dst[kept - 1];
            kept -= usize::from((b >> (i - lo)) & 1 == 0);
        }
    }
}

#[cfg(test)]
mod tests;
