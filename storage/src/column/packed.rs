//! Frame-of-reference bit-packing of integer columns (segment v3).
//!
//! The integers of a block, after `order` rounds of differencing, are cut into
//! frames of [`FRAME`] values. A frame stores its minimum and each value's
//! offset from it in the fewest bits that hold the largest offset. Decoding
//! is a fixed-width unpack per frame, with no branch per value, where the
//! varints of the older encoding needed a branch per byte.
//!
//! The first `order` integers (the start of the differencing) go before the
//! frames as zigzag varints, so that a large first value does not widen the
//! first frame. A frame may pack fewer bits than its largest offset needs:
//! the few offsets that do not fit are exceptions ("patched" frame of
//! reference), whose high bits follow the packed ones. A job's start or a
//! spike then costs a few bytes, not the width of the whole frame.
//!
//! ```text
//!  payload:   order u8 | `order` zigzag varints | frame | frame | ...
//!  frame:     w u8 | zigzag varint min | ceil(len * width / 8) bytes | [exceptions]
//!             w: bits 0-6 the width (0..=64), bit 7 set if exceptions follow
//!  exceptions: count u8 (1..=len) | count × (index u8, uvarint offset >> width)
//! ```
//!
//! Offsets are packed least significant bit first; a frame's last byte is
//! padded with zero bits. Every frame holds [`FRAME`] values but the last.

use crate::codec::{Reader, put_uvarint, put_varint};

use super::ColumnError;

/// Values per frame.
pub(crate) const FRAME: usize = 128;

/// Bytes of a zigzag varint of `v`.
fn varint_len(v: i64) -> usize {
    let z = ((v << 1) ^ (v >> 63)) as u64;
    (64 - (z | 1).leading_zeros() as usize).div_ceil(7)
}

/// The first `order` values of `xs` (x0, then x1 - x0) and the `order`-th
/// differences after them.
fn differences(xs: &[i64], order: u8) -> (Vec<i64>, Vec<i64>) {
    let heads: Vec<i64> = match order {
        0 => Vec::new(),
        1 => xs.iter().take(1).copied().collect(),
        _ => xs
            .iter()
            .take(2)
            .enumerate()
            .map(|(i, &x)| if i == 0 { x } else { x.wrapping_sub(xs[0]) })
            .collect(),
    };
    let rest = match order {
        0 => xs.to_vec(),
        1 => xs.windows(2).map(|w| w[1].wrapping_sub(w[0])).collect(),
        _ => xs
            .windows(3)
            .map(|w| {
                w[2].wrapping_sub(w[1])
                    .wrapping_sub(w[1].wrapping_sub(w[0]))
            })
            .collect(),
    };
    (heads, rest)
}

/// Flag in a frame's width byte: exceptions follow the packed bits.
const PATCHED: u8 = 0x80;

/// How one frame is packed: its minimum, the packed width, and the bytes it
/// takes in all (header, packed bits and exceptions).
#[derive(Debug, Clone, Copy)]
struct Shape {
    min: i64,
    width: u32,
    /// Offsets wider than `width`.
    exceptions: usize,
    len: usize,
}

/// Bytes of a uvarint of a value of `bits` significant bits.
fn uvarint_len_bits(bits: u32) -> usize {
    (bits.max(1) as usize).div_ceil(7)
}

/// Smallest and largest value of a frame.
fn min_max(frame: &[i64]) -> (i64, i64) {
    frame
        .iter()
        .fold((i64::MAX, i64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// The width that makes one frame smallest, exceptions included.
fn frame_shape(frame: &[i64]) -> Shape {
    let (min, max) = min_max(frame);
    if min >= max {
        // Constant: a regular timestamp grid, a value that did not move.
        return Shape {
            min,
            width: 0,
            exceptions: 0,
            len: 1 + varint_len(min),
        };
    }
    // How many offsets need exactly b bits, b = 0..=64.
    // (A frame has at most 128 values: the counts fit a byte.)
    let mut hist = [0u8; 65];
    for &x in frame {
        hist[(64 - (x.wrapping_sub(min) as u64).leading_zeros()) as usize] += 1;
    }
    let hist = hist.map(usize::from);
    let max_bits = (0..=64).rev().find(|&b| hist[b] > 0).unwrap_or(0) as u32;
    let head = 1 + varint_len(min);
    let mut best = Shape {
        min,
        width: max_bits,
        exceptions: 0,
        len: head + (frame.len() * max_bits as usize).div_ceil(8),
    };
    // Narrower widths: the offsets wider than `w` become exceptions, each an
    // index byte and the varint of its bits above `w`. Each costs at least
    // 16 bits, so narrowing stops once a quarter of the frame would be
    // exceptions.
    let mut exceptions = 0;
    for w in (0..max_bits).rev() {
        exceptions += hist[w as usize + 1];
        if exceptions * 4 > frame.len() {
            break;
        }
        let exception_bytes: usize = (w + 1..=max_bits)
            .map(|b| hist[b as usize] * (1 + uvarint_len_bits(b - w)))
            .sum();
        let len = head + (frame.len() * w as usize).div_ceil(8) + 1 + exception_bytes;
        if len < best.len {
            best = Shape {
                min,
                width: w,
                exceptions,
                len,
            };
        }
    }
    best
}

/// What [`write`] writes for some integers at one delta order, and its size.
pub(crate) struct Plan {
    order: u8,
    heads: Vec<i64>,
    rest: Vec<i64>,
    shapes: Vec<Shape>,
    /// Bytes of the payload.
    pub(crate) len: usize,
}

impl Plan {
    /// The delta order planned.
    pub(super) fn order(&self) -> u8 {
        self.order
    }

    /// The first `order` integers as the payload stores them.
    pub(super) fn heads(&self) -> &[i64] {
        &self.heads
    }

    /// The `order`-th differences after the heads.
    pub(super) fn rest(&self) -> &[i64] {
        &self.rest
    }
}

/// Undoes `order` rounds of differencing, frame after frame: the last value
/// and the last first difference carry over. Shared by the packed frames
/// and the byte planes, whose payloads both start with the order and the
/// heads.
pub(super) struct Undiff {
    order: u8,
    p1: i64,
    p2: i64,
}

impl Undiff {
    /// Reads a payload's order byte and its heads (at most `n`), and puts
    /// the values they stand for at the start of `buf`; returns how many.
    pub(super) fn read_heads(
        r: &mut Reader<'_>,
        n: usize,
        buf: &mut [i64; FRAME],
    ) -> Result<(Self, usize), ColumnError> {
        let bad = |_| ColumnError::BadLength;
        let order = r.bytes(1, "order").map_err(bad)?[0];
        if order > 2 {
            return Err(ColumnError::BadLength);
        }
        let mut u = Undiff {
            order,
            p1: 0,
            p2: 0,
        };
        let heads = (order as usize).min(n);
        for (i, slot) in buf.iter_mut().enumerate().take(heads) {
            let h = r.varint("head").map_err(bad)?;
            let x = if i == 0 { h } else { u.p1.wrapping_add(h) };
            u.p2 = x.wrapping_sub(u.p1);
            u.p1 = x;
            *slot = x;
        }
        Ok((u, heads))
    }

    /// Turns the `order`-th differences in `out`, which follow those of the
    /// frame before, into values.
    pub(super) fn apply(&mut self, out: &mut [i64]) {
        match self.order {
            0 => {}
            1 => {
                for x in out.iter_mut() {
                    self.p1 = self.p1.wrapping_add(*x);
                    *x = self.p1;
                }
            }
            _ => {
                for x in out.iter_mut() {
                    self.p2 = self.p2.wrapping_add(*x);
                    self.p1 = self.p1.wrapping_add(self.p2);
                    *x = self.p1;
                }
            }
        }
    }
}

/// Plans the payload of `xs` after `order` (0..=2) rounds of differencing.
pub(crate) fn plan(xs: &[i64], order: u8) -> Plan {
    let (heads, rest) = differences(xs, order);
    plan_of(order, heads, rest)
}

fn plan_of(order: u8, heads: Vec<i64>, rest: Vec<i64>) -> Plan {
    let shapes: Vec<Shape> = rest.chunks(FRAME).map(frame_shape).collect();
    let len = 1
        + heads.iter().map(|&h| varint_len(h)).sum::<usize>()
        + shapes.iter().map(|s| s.len).sum::<usize>();
    Plan {
        order,
        heads,
        rest,
        shapes,
        len,
    }
}

/// [`plan`] at the delta order whose frames pack smallest before exceptions
/// are considered (which would cost a histogram per frame and order).
pub(crate) fn plan_best(xs: &[i64]) -> Plan {
    let (order, heads, rest) = (0..=2u8)
        .map(|order| {
            let (heads, rest) = differences(xs, order);
            (order, heads, rest)
        })
        .min_by_key(|(_, heads, rest)| {
            let frames: usize = rest
                .chunks(FRAME)
                .map(|f| {
                    let (min, max) = min_max(f);
                    let width = 64 - (max.wrapping_sub(min) as u64).leading_zeros() as usize;
                    1 + varint_len(min) + (f.len() * width).div_ceil(8)
                })
                .sum();
            heads.iter().map(|&h| varint_len(h)).sum::<usize>() + frames
        })
        .expect("BUG: three orders");
    plan_of(order, heads, rest)
}

/// Appends a planned payload.
pub(crate) fn write(plan: &Plan, out: &mut Vec<u8>) {
    out.reserve(plan.len);
    out.push(plan.order);
    for &h in &plan.heads {
        put_varint(out, h);
    }
    for (f, s) in plan.rest.chunks(FRAME).zip(&plan.shapes) {
        let &Shape {
            min,
            width: w,
            exceptions,
            ..
        } = s;
        out.push(w as u8 | if exceptions > 0 { PATCHED } else { 0 });
        put_varint(out, min);
        if w == 0 && exceptions == 0 {
            continue;
        }
        let mask = if w == 64 { u64::MAX } else { (1u64 << w) - 1 };
        let offsets = f.iter().map(|&x| x.wrapping_sub(min) as u64);
        let (mut acc, mut bits) = (0u128, 0u32);
        for o in offsets.clone() {
            acc |= ((o & mask) as u128) << bits;
            bits += w;
            if bits >= 64 {
                out.extend_from_slice(&(acc as u64).to_le_bytes());
                acc >>= 64;
                bits -= 64;
            }
        }
        out.extend_from_slice(&(acc as u64).to_le_bytes()[..bits.div_ceil(8) as usize]);
        if exceptions > 0 {
            out.push(exceptions as u8);
            for (i, o) in offsets.enumerate().filter(|&(_, o)| o > mask) {
                out.push(i as u8);
                put_uvarint(out, o >> w);
            }
        }
    }
}

/// Appends the packed payload of `xs` after `order` rounds of differencing.
#[cfg(test)]
pub(crate) fn pack(xs: &[i64], order: u8, out: &mut Vec<u8>) {
    write(&plan(xs, order), out);
}

/// Decodes `n` integers from a payload made by [`pack`], calling `frame` with
/// each run of decoded integers (at most [`FRAME`] at a time, in order).
/// Checks every length: a payload that ends early, has trailing bytes, or
/// names a width over 64 is an error, never a panic.
pub(crate) fn unpack(
    payload: &[u8],
    n: usize,
    mut frame: impl FnMut(&[i64]),
) -> Result<(), ColumnError> {
    let bad = |_| ColumnError::BadLength;
    let mut r = Reader::new(payload, 0);
    let mut buf = [0i64; FRAME];
    let (mut undiff, heads) = Undiff::read_heads(&mut r, n, &mut buf)?;
    if heads > 0 {
        frame(&buf[..heads]);
    }
    let mut left = n - heads;
    while left > 0 {
        let len = left.min(FRAME);
        let flags = r.bytes(1, "width").map_err(bad)?[0];
        let w = (flags & !PATCHED) as u32;
        if w > 64 {
            return Err(ColumnError::BadLength);
        }
        let min = r.varint("frame min").map_err(bad)?;
        let at = r.offset() as usize;
        let packed = r
            .bytes((len * w as usize).div_ceil(8), "frame")
            .map_err(bad)?;
        let out = &mut buf[..len];
        // Unaligned 8-byte loads need 8 readable bytes past each value's
        // first byte: in place when the payload has them, else from a copy.
        if w == 0 {
            out.fill(min);
        } else if w <= 56 && payload.len() >= at + packed.len() + 8 {
            let src = &payload[at..at + packed.len() + 8];
            if len == FRAME {
                unpack_frame(src, w, min, out);
            } else {
                unpack_fast(src, w, min, out);
            }
        } else {
            unpack_slow(packed, w, min, out);
        }
        if flags & PATCHED != 0 {
            let count = r.bytes(1, "exceptions").map_err(bad)?[0] as usize;
            if count == 0 || count > len || w == 64 {
                return Err(ColumnError::BadLength);
            }
            for _ in 0..count {
                let i = r.bytes(1, "exception index").map_err(bad)?[0] as usize;
                let high = r.uvarint("exception").map_err(bad)?;
                let x = out.get_mut(i).ok_or(ColumnError::BadLength)?;
                *x = x.wrapping_add((high << w) as i64);
            }
        }
        undiff.apply(out);
        frame(out);
        left -= len;
    }
    if !r.is_empty() {
        return Err(ColumnError::BadLength);
    }
    Ok(())
}

/// Unpacks `out.len()` values of `w` ≤ 56 bits; `src` has 8 bytes past the
/// packed ones, so every value is one unaligned little-endian load.
#[inline]
fn unpack_fast(src: &[u8], w: u32, min: i64, out: &mut [i64]) {
    let mask = (1u64 << w) - 1;
    for (i, x) in out.iter_mut().enumerate() {
        let bit = i * w as usize;
        let at = bit / 8;
        let word = u64::from_le_bytes(src[at..at + 8].try_into().expect("BUG: 8 bytes"));
        *x = min.wrapping_add(((word >> (bit % 8)) & mask) as i64);
    }
}

/// [`unpack_fast`] of a whole frame, with the width a constant: the
/// compiler then unrolls the loop with constant shifts and offsets.
fn unpack_frame(src: &[u8], w: u32, min: i64, out: &mut [i64]) {
    macro_rules! widths {
        ($($w:literal)*) => {
            match w {
                $($w => unpack_const::<$w>(src, min, out),)*
                _ => unpack_fast(src, w, min, out),
            }
        };
    }
    widths!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28
        29 30 31 32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56)
}

#[inline(always)]
fn unpack_const<const W: usize>(src: &[u8], min: i64, out: &mut [i64]) {
    let src = &src[..FRAME * W / 8 + 8];
    let out = &mut out[..FRAME];
    let mask = (1u64 << W) - 1;
    for (i, x) in out.iter_mut().enumerate() {
        let bit = i * W;
        let word = u64::from_le_bytes(src[bit / 8..bit / 8 + 8].try_into().expect("BUG: 8 bytes"));
        *x = min.wrapping_add(((word >> (bit % 8)) & mask) as i64);
    }
}

/// Unpacks `out.len()` values of any width from exactly the packed bytes.
fn unpack_slow(src: &[u8], w: u32, min: i64, out: &mut [i64]) {
    let mask = if w == 64 { u64::MAX } else { (1u64 << w) - 1 };
    let (mut acc, mut bits, mut next) = (0u128, 0u32, 0usize);
    for x in out.iter_mut() {
        while bits < w {
            acc |= (src[next] as u128) << bits;
            next += 1;
            bits += 8;
        }
        *x = min.wrapping_add((acc as u64 & mask) as i64);
        acc >>= w;
        bits -= w;
    }
}
