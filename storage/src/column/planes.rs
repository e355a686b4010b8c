//! Byte planes of integer columns (segment v6).
//!
//! The integers of a block, after `order` rounds of differencing, are offset
//! from their minimum, and byte `p` of every offset goes to plane `p`. Each
//! plane is a block of its own, zstd-compressed when that makes it smaller.
//! A noisy column (PCIe and NVLink rates, profiling ratios, an energy
//! counter's steps) has random low bytes and high bytes that take few
//! values: zstd leaves the first plane as it is and codes the others in a
//! few bits a value, where bit-packing pays the full width for every value
//! and zstd over varints mixes the bytes of all planes in one model (12 %
//! larger on the recorded H100 training run, docs/BENCHMARKS.md).
//!
//! ```text
//!  payload: order u8 | `order` zigzag varints (heads) | zigzag varint base
//!           | width u8 (0..=8) | width × (uvarint len | plane block)
//!  plane block: kind u8 (0, bit 7 set if zstd) | the plane's bytes, one per
//!               value after the heads (column.md's block, zstd when smaller)
//!  value i = base + Σ_p plane_p[i] << 8p, then the differencing undone
//! ```

use std::borrow::Cow;

use crate::codec::{Reader, put_uvarint, put_varint};

use super::packed::{FRAME, Plan, Undiff};
use super::{ColumnError, open_block, put_block_saving};

/// The kind of a plane's block.
const PLANE: u8 = 0;

/// Appends the byte-plane payload of the integers a packed [`Plan`] has
/// differenced (at its order), unless the planes' sizes estimated from their
/// byte frequencies add up to `budget` bytes or more (the size of a block
/// that is already at hand): then it returns false, having run no zstd, and
/// what it appended is to be dropped.
pub(crate) fn write(plan: &Plan, budget: usize, out: &mut Vec<u8>) -> bool {
    let rest = plan.rest();
    let base = rest.iter().copied().min().unwrap_or(0);
    // Offsets from the minimum fit u64 whatever the integers' spread.
    let offsets: Vec<u64> = rest.iter().map(|&x| x.wrapping_sub(base) as u64).collect();
    let max = offsets.iter().copied().max().unwrap_or(0);
    let width = (64 - max.leading_zeros()).div_ceil(8) as usize;
    let k = offsets.len();
    let mut planes = vec![0u8; width * k];
    for (p, plane) in planes.chunks_exact_mut(k.max(1)).enumerate().take(width) {
        for (b, &o) in plane.iter_mut().zip(&offsets) {
            *b = (o >> (8 * p)) as u8;
        }
    }
    let estimate: usize = planes.chunks(k.max(1)).map(estimated_size).sum();
    if estimate >= budget {
        return false;
    }
    out.push(plan.order());
    for &h in plan.heads() {
        put_varint(out, h);
    }
    put_varint(out, base);
    out.push(width as u8);
    let mut block = Vec::new();
    for plane in planes.chunks(k.max(1)).take(width) {
        block.clear();
        put_block_saving(&mut block, PLANE, plane, min_saving(plane.len()));
        put_uvarint(out, block.len() as u64);
        out.extend_from_slice(&block);
    }
    true
}

/// What a plane's block is expected to take: its bytes coded by their
/// frequencies (what zstd's Huffman stage does; its matches can do better on
/// runs), or the plane as it is, with a few bytes of headers.
fn estimated_size(plane: &[u8]) -> usize {
    let mut hist = [0u32; 256];
    for &b in plane {
        hist[b as usize] += 1;
    }
    // Σ c·log2(n/c) = n·log2(n) − Σ c·log2(c), the second from a table: a
    // logarithm per distinct byte of every plane was 5 % of a flush's
    // segment thread.
    let n = plane.len();
    let bits = c_log2_c(n) - hist.iter().map(|&c| c_log2_c(c as usize)).sum::<f64>();
    let coded = (bits / 8.0) as usize + 4;
    if coded + min_saving(plane.len()) <= plane.len() {
        coded
    } else {
        plane.len() + 4
    }
}

/// `c·log2(c)` (0 for 0), from a table for the counts of a segment chunk's
/// planes.
fn c_log2_c(c: usize) -> f64 {
    static TABLE: std::sync::LazyLock<Vec<f64>> = std::sync::LazyLock::new(|| {
        (0..=crate::segment::MAX_CHUNK_SAMPLES)
            .map(|c| {
                if c == 0 {
                    0.0
                } else {
                    c as f64 * (c as f64).log2()
                }
            })
            .collect()
    });
    match TABLE.get(c) {
        Some(&x) => x,
        None => c as f64 * (c as f64).log2(),
    }
}

/// What zstd must save on a plane for the plane to be stored compressed:
/// an eighth of it. Decompressing a plane rebuilds zstd's Huffman table,
/// which costs as much as decoding hundreds of values; a plane that shrinks
/// by less (the middle bytes of a noisy column) is cheaper to read as it is.
fn min_saving(len: usize) -> usize {
    len / 8
}

/// Decodes `n` integers from a payload made by [`write`], calling `frame`
/// with each run of decoded integers (at most [`FRAME`] at a time, in
/// order). Checks every length: a plane of the wrong length, a width over 8
/// or trailing bytes is an error, never a panic.
pub(crate) fn unpack(
    payload: &[u8],
    n: usize,
    mut frame: impl FnMut(&[i64]),
) -> Result<(), ColumnError> {
    let bad = |_| ColumnError::BadLength;
    let mut r = Reader::new(payload, 0);
    let mut buf = [0i64; FRAME];
    let (mut undiff, heads) = Undiff::read_heads(&mut r, n, &mut buf)?;
    let base = r.varint("base").map_err(bad)?;
    let width = r.bytes(1, "width").map_err(bad)?[0] as usize;
    if width > 8 {
        return Err(ColumnError::BadLength);
    }
    let k = n - heads;
    let mut planes: [Cow<'_, [u8]>; 8] = Default::default();
    for plane in &mut planes[..width] {
        let len = r.len("plane length", payload.len()).map_err(bad)?;
        let block = r.bytes(len, "plane").map_err(bad)?;
        let (kind, bytes) = open_block(block, k.saturating_add(16))?;
        if kind != PLANE {
            return Err(ColumnError::UnknownEncoding(kind));
        }
        if bytes.len() != k {
            return Err(ColumnError::BadLength);
        }
        *plane = bytes;
    }
    if !r.is_empty() {
        return Err(ColumnError::BadLength);
    }
    if heads > 0 {
        frame(&buf[..heads]);
    }
    let planes = &planes[..width];
    for start in (0..k).step_by(FRAME) {
        let out = &mut buf[..FRAME.min(k - start)];
        let end = start + out.len();
        combine(planes, start..end, base, out);
        undiff.apply(out);
        frame(out);
    }
    Ok(())
}

/// Puts together values `range` from their planes, each `base` plus its
/// offset: one pass over all planes for the common widths, where a pass per
/// plane cost 25 instructions a value on the simulated fleet (callgrind).
fn combine(planes: &[Cow<'_, [u8]>], range: std::ops::Range<usize>, base: i64, out: &mut [i64]) {
    let p = |i: usize| &planes[i][range.clone()];
    let o = out.iter_mut();
    let at = |offset: u64| base.wrapping_add(offset as i64);
    match planes.len() {
        0 => out.fill(base),
        1 => o.zip(p(0)).for_each(|(x, &a)| *x = at(a as u64)),
        2 => o
            .zip(p(0))
            .zip(p(1))
            .for_each(|((x, &a), &b)| *x = at(u16::from_le_bytes([a, b]) as u64)),
        3 => o
            .zip(p(0))
            .zip(p(1))
            .zip(p(2))
            .for_each(|(((x, &a), &b), &c)| *x = at(u32::from_le_bytes([a, b, c, 0]) as u64)),
        4 => o
            .zip(p(0))
            .zip(p(1))
            .zip(p(2))
            .zip(p(3))
            .for_each(|((((x, &a), &b), &c), &d)| *x = at(u32::from_le_bytes([a, b, c, d]) as u64)),
        _ => {
            out.fill(0);
            for (i, plane) in planes.iter().enumerate() {
                for (x, &b) in out.iter_mut().zip(&plane[range.clone()]) {
                    *x |= (b as i64) << (8 * i);
                }
            }
            out.iter_mut().for_each(|x| *x = at(*x as u64));
        }
    }
}
