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
/// offset: one pass over all planes, where a pass per plane cost 25
/// instructions a value on the simulated fleet (callgrind).
fn combine(planes: &[Cow<'_, [u8]>], range: std::ops::Range<usize>, base: i64, out: &mut [i64]) {
    #[cfg(target_arch = "x86_64")]
    if !planes.is_empty() {
        let mut p: [&[u8]; 8] = [&[]; 8];
        for (p, plane) in p.iter_mut().zip(planes) {
            *p = &plane[range.clone()];
        }
        let done = sse2::combine(&p, planes.len(), base, out);
        if done == out.len() {
            return;
        }
        let rest = range.start + done..range.end;
        return combine_scalar(planes, rest, base, &mut out[done..]);
    }
    combine_scalar(planes, range, base, out)
}

/// [`combine`] a value at a time.
fn combine_scalar(
    planes: &[Cow<'_, [u8]>],
    range: std::ops::Range<usize>,
    base: i64,
    out: &mut [i64],
) {
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

/// [`combine`] sixteen values at a time with SSE2, which every x86-64
/// processor has: the compiler left the loops scalar (4.1, 8 and 11
/// instructions a value for one to three planes, callgrind), where this
/// takes about 3.7 up to four planes; five to eight add a second set of
/// unpacks.
#[cfg(target_arch = "x86_64")]
mod sse2 {
    use std::arch::x86_64::{
        __m128i, _mm_add_epi64, _mm_loadu_si128, _mm_set1_epi64x, _mm_setzero_si128,
        _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpackhi_epi16, _mm_unpackhi_epi32,
        _mm_unpacklo_epi8, _mm_unpacklo_epi16, _mm_unpacklo_epi32,
    };

    /// Puts together the first whole sixteens of `out` from the first
    /// `width` (one to eight) planes of `p` (the low bytes first, each as
    /// long as `out`; the others empty) and returns how many values it
    /// wrote (none if a plane is shorter).
    pub(super) fn combine(p: &[&[u8]; 8], width: usize, base: i64, out: &mut [i64]) -> usize {
        let n = out.len() / 16 * 16;
        if !(1..=8).contains(&width) || p[..width].iter().any(|p| p.len() < n) {
            return 0;
        }
        // SAFETY: SSE2 is part of x86-64: every processor this code runs
        // on has it.
        unsafe {
            if width <= 4 {
                combine_sse2::<false>(p, base, &mut out[..n]);
            } else {
                combine_sse2::<true>(p, base, &mut out[..n]);
            }
        }
        n
    }

    /// Sixteen bytes.
    #[target_feature(enable = "sse2")]
    fn load(p: &[u8; 16]) -> __m128i {
        // SAFETY: `p` is 16 bytes; the load is unaligned.
        unsafe { _mm_loadu_si128(p.as_ptr().cast::<__m128i>()) }
    }

    /// The sixteen bytes of plane `p` from `i`, zeros for an absent plane.
    #[target_feature(enable = "sse2")]
    fn bytes(p: &[u8], i: usize) -> __m128i {
        match p.get(i..i + 16) {
            Some(b) => load(b.try_into().expect("BUG: 16 bytes")),
            None => _mm_setzero_si128(),
        }
    }

    /// Sixteen 32-bit values `a | b << 8 | c << 16 | d << 24` from the
    /// bytes at `i` of four planes, in order, four to a register.
    #[target_feature(enable = "sse2")]
    fn quads(p: &[&[u8]], i: usize) -> [__m128i; 4] {
        let (a, b, c, d) = (
            bytes(p[0], i),
            bytes(p[1], i),
            bytes(p[2], i),
            bytes(p[3], i),
        );
        // Bytes interleaved: 16-bit lanes `a | b << 8` and `c | d << 8`.
        let ab = [_mm_unpacklo_epi8(a, b), _mm_unpackhi_epi8(a, b)];
        let cd = [_mm_unpacklo_epi8(c, d), _mm_unpackhi_epi8(c, d)];
        [
            _mm_unpacklo_epi16(ab[0], cd[0]),
            _mm_unpackhi_epi16(ab[0], cd[0]),
            _mm_unpacklo_epi16(ab[1], cd[1]),
            _mm_unpackhi_epi16(ab[1], cd[1]),
        ]
    }

    /// `out.len()` is a multiple of sixteen and every plane of `p` at
    /// least as long (an absent one empty); `WIDE`: planes five to eight
    /// are there too.
    #[target_feature(enable = "sse2")]
    fn combine_sse2<const WIDE: bool>(p: &[&[u8]; 8], base: i64, out: &mut [i64]) {
        let base = _mm_set1_epi64x(base);
        for (j, dst) in out.chunks_exact_mut(16).enumerate() {
            let i = 16 * j;
            let low = quads(&p[..4], i);
            // The high 32 bits of each value: planes five to eight.
            let high = if WIDE {
                quads(&p[4..], i)
            } else {
                [_mm_setzero_si128(); 4]
            };
            let dst = dst.as_mut_ptr();
            for (k, (lo, hi)) in low.into_iter().zip(high).enumerate() {
                let pair = [
                    _mm_add_epi64(_mm_unpacklo_epi32(lo, hi), base),
                    _mm_add_epi64(_mm_unpackhi_epi32(lo, hi), base),
                ];
                for (h, x) in pair.into_iter().enumerate() {
                    // SAFETY: `dst` points at 16 i64s (a chunk of
                    // `chunks_exact_mut(16)`) and `4k + 2h + 2 <= 16`; the
                    // store is unaligned.
                    unsafe { _mm_storeu_si128(dst.add(4 * k + 2 * h).cast::<__m128i>(), x) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every width, lengths around the SSE2 path's sixteens, ranges that
    /// start inside the planes, and bases whose sums wrap: each value
    /// against its bytes added up one by one.
    #[test]
    fn combined_values_are_their_bytes_over_the_base() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        let mut byte = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        };
        for width in 0..=8usize {
            for len in [0usize, 1, 15, 16, 17, 31, 32, 33, 100, 127, 128] {
                for skip in [0usize, 1, 5] {
                    let planes: Vec<Cow<'_, [u8]>> = (0..width)
                        .map(|_| Cow::Owned((0..skip + len).map(|_| byte()).collect()))
                        .collect();
                    for base in [0i64, -7, 1 << 40, i64::MAX, i64::MIN] {
                        let mut out = vec![0i64; len];
                        combine(&planes, skip..skip + len, base, &mut out);
                        for (i, &x) in out.iter().enumerate() {
                            let offset = planes
                                .iter()
                                .enumerate()
                                .fold(0u64, |o, (p, b)| o | (b[skip + i] as u64) << (8 * p));
                            let want = base.wrapping_add(offset as i64);
                            assert_eq!(x, want, "width {width} len {len} skip {skip} value {i}");
                        }
                    }
                }
            }
        }
    }
}
