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
//!   that makes them smallest, as zigzag varints. Repeats and constant runs
//!   then become runs of zero bytes.
//! - zstd runs over either block when that makes it smaller.
//! - Anything else (NaN, -0.0, values with more than 9 decimals) falls back to
//!   Gorilla's XOR encoding, or to raw bits.
//!
//! All encodings are lossless and bit-exact. Decoders never panic; they check
//! every length, including the declared size of zstd output.

use crate::codec::{Reader, put_uvarint, put_varint};
use crate::gorilla::{XorDecoder, XorEncoder};

const ZSTD_FLAG: u8 = 0x80;
const ZSTD_LEVEL: i32 = 3;

const TS_DOD: u8 = 1;

const VAL_RAW: u8 = 0;
const VAL_XOR: u8 = 1;
const VAL_DECIMAL: u8 = 2;

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
    if payload.len() > 32
        && let Ok(z) = zstd_compress(payload)
    {
        let mut head = Vec::with_capacity(10);
        put_uvarint(&mut head, payload.len() as u64);
        if head.len() + z.len() < payload.len() {
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

/// Encodes a timestamp column: first value, first delta, then delta-of-delta,
/// all zigzag varints.
pub fn encode_ts(ts: &[i64], out: &mut Vec<u8>) {
    let mut p = Vec::with_capacity(ts.len() + 16);
    ts_payload(ts, &mut p);
    ts_block(&p, out);
}

/// A timestamp column's payload before compression ([`encode_ts`] is
/// [`ts_block`] of it). Equal payloads make equal blocks, so a writer that
/// shares timestamp blocks looks them up by payload and compresses each
/// distinct one once. Appends to `p`.
pub fn ts_payload(ts: &[i64], p: &mut Vec<u8>) {
    p.reserve(ts.len() + 16);
    let (mut prev, mut prev_delta) = (0i64, 0i64);
    for (i, &t) in ts.iter().enumerate() {
        let delta = t.wrapping_sub(prev);
        put_varint(
            p,
            if i < 2 {
                delta
            } else {
                delta.wrapping_sub(prev_delta)
            },
        );
        prev = t;
        prev_delta = delta;
    }
}

/// Appends the block of a payload made by [`ts_payload`] to `out`.
pub fn ts_block(payload: &[u8], out: &mut Vec<u8>) {
    put_block(out, TS_DOD, payload);
}

/// Decodes `n` timestamps from `block` and appends them to `out`.
pub fn decode_ts(block: &[u8], n: usize, out: &mut Vec<i64>) -> Result<(), ColumnError> {
    let (kind, payload) = open_block(block, n.saturating_mul(10))?;
    if kind != TS_DOD {
        return Err(ColumnError::UnknownEncoding(kind));
    }
    let mut r = Reader::new(&payload, 0);
    out.reserve(n);
    let (mut prev, mut prev_delta) = (0i64, 0i64);
    for i in 0..n {
        let x = r.varint("ts").map_err(|_| ColumnError::BadLength)?;
        let delta = if i < 2 { x } else { prev_delta.wrapping_add(x) };
        prev = prev.wrapping_add(delta);
        prev_delta = delta;
        out.push(prev);
    }
    if !r.is_empty() {
        return Err(ColumnError::BadLength);
    }
    Ok(())
}

/// The smallest decimal exponent `d` such that every value is exactly
/// `n / 10^d` for an integer `|n| < 2^53`, with its integers.
fn as_decimal(vals: &[f64]) -> Option<(u8, Vec<i64>)> {
    let mut d = 0u8;
    for &v in vals {
        while !exact_at(v, d) {
            d += 1;
            if d > MAX_SCALE {
                return None;
            }
        }
    }
    let ints = vals
        .iter()
        .map(|&v| (v * POW10[d as usize]).round() as i64)
        .collect();
    Some((d, ints))
}

/// True if `v` round-trips bit-exactly through the integer the decoder sees,
/// `round(v * 10^d) as i64`, divided by `10^d`. Going through the integer is
/// what turns away -0.0, which would come back as +0.0.
#[inline]
fn exact_at(v: f64, d: u8) -> bool {
    let n = (v * POW10[d as usize]).round();
    n.abs() < 9_007_199_254_740_992.0
        && ((n as i64) as f64 / POW10[d as usize]).to_bits() == v.to_bits()
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

/// Encodes a value column, picking the smallest encoding.
pub fn encode_values(vals: &[f64], out: &mut Vec<u8>) {
    let mut best: Option<Vec<u8>> = None;
    let mut consider = |candidate: Vec<u8>| {
        if best.as_ref().is_none_or(|b| candidate.len() < b.len()) {
            best = Some(candidate);
        }
    };
    if let Some((d, ints)) = as_decimal(vals) {
        // Judge each delta order by its final size: after zstd, the order with
        // the fewest varint bytes is not always the smallest.
        for order in 0..=2u8 {
            let mut p = vec![d, order];
            diff_varints(&ints, order, &mut p);
            let mut block = Vec::new();
            put_block(&mut block, VAL_DECIMAL, &p);
            consider(block);
        }
    } else {
        let mut x = XorEncoder::default();
        for &v in vals {
            x.append(v);
        }
        let mut block = Vec::new();
        put_block(&mut block, VAL_XOR, x.bytes());
        consider(block);
        let raw: Vec<u8> = vals
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        let mut block = Vec::new();
        put_block(&mut block, VAL_RAW, &raw);
        consider(block);
    }
    out.extend_from_slice(&best.expect("BUG: at least one encoding"));
}

/// Decodes `n` values from `block` and appends them to `out`.
pub fn decode_values(block: &[u8], n: usize, out: &mut Vec<f64>) -> Result<(), ColumnError> {
    let (kind, payload) = open_block(block, n.saturating_mul(10).saturating_add(16))?;
    out.reserve(n);
    match kind {
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
            let scale = POW10[d as usize];
            let mut r = Reader::new(rest, 0);
            let (mut p1, mut p2) = (0i64, 0i64);
            for _ in 0..n {
                let v = r.varint("value").map_err(|_| ColumnError::BadLength)?;
                let x = match order {
                    0 => v,
                    1 => p1.wrapping_add(v),
                    2 => p1.wrapping_add(p2.wrapping_add(v)),
                    _ => return Err(ColumnError::BadLength),
                };
                p2 = x.wrapping_sub(p1);
                p1 = x;
                out.push(x as f64 / scale);
            }
            if !r.is_empty() {
                return Err(ColumnError::BadLength);
            }
        }
        other => return Err(ColumnError::UnknownEncoding(other)),
    }
    Ok(())
}

#[cfg(test)]
mod tests;
