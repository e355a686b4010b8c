//! Gorilla chunk codec: delta-of-delta timestamps and XOR-compressed floats.
//!
//! This is the baseline codec the user's design names (Pelkonen et al., "Gorilla",
//! VLDB 2015), in the variant the Prometheus TSDB uses for millisecond
//! timestamps. Format of one chunk, bit by bit (`docs/format/gorilla.md`):
//!
//! ```text
//! sample 0: ts as zigzag LEB128 varint (8-bit groups) | value: 64 raw bits
//! sample 1: ts delta as zigzag varint                 | value: XOR block
//! sample n: delta-of-delta bucket                     | value: XOR block
//!
//! delta-of-delta buckets (two's complement payload):
//!   '0'                      dod == 0
//!   '10'   + 14 bits         dod in [-8192, 8191]
//!   '110'  + 17 bits         dod in [-65536, 65535]
//!   '1110' + 20 bits         dod in [-524288, 524287]
//!   '1111' + 64 bits         anything else
//! XOR block:
//!   '0'                      value bits equal the previous value's bits
//!   '10' + meaningful bits   the XOR fits the previous leading/trailing window
//!   '11' + 5 bits leading zeros + 6 bits meaningful length (64 stored as 0)
//!        + meaningful bits
//! ```
//!
//! Departures from the paper: timestamps are milliseconds, not seconds, so the
//! delta-of-delta buckets are Prometheus's 14/17/20 bits instead of 7/9/12; the
//! first timestamp is a varint instead of a 64-bit aligned header, and the
//! sample count lives outside the bit stream (in the chunk's index entry), so a
//! decoder always knows where the chunk ends. Values are compared bit for bit:
//! NaN payloads, -0.0 and infinities round-trip exactly.

mod bits;

use bits::{BitReader, BitWriter};

/// A chunk's bytes did not decode. `bit` is the bit offset inside the chunk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("chunk ended early at bit {bit} while decoding sample {sample} of {count}")]
    Truncated { bit: usize, sample: u32, count: u32 },
    #[error(
        "invalid XOR window at bit {bit} (sample {sample}): leading {leading} + length {len} > 64"
    )]
    BadXorWindow {
        bit: usize,
        sample: u32,
        leading: u8,
        len: u8,
    },
    #[error("XOR block at bit {bit} (sample {sample}) reuses a window before one was set")]
    NoXorWindow { bit: usize, sample: u32 },
    /// A head chunk re-encoded as columns ([`crate::ChunkCodec`]).
    #[error("column chunk: {0}")]
    Column(#[from] crate::column::ColumnError),
}

/// Encodes samples of one series into a Gorilla chunk.
///
/// Timestamps need not be increasing: deltas are signed and wrap, so any
/// `i64` sequence round-trips. Callers keep them increasing so that queries can
/// merge chunks in order.
#[derive(Debug, Clone, Default)]
pub struct GorillaEncoder {
    /// The bits so far ([`BitWriter`]), in a boxed slice whose bytes past
    /// them are zero: the head holds an encoder per series, and a `Vec`
    /// took a word more.
    bytes: Box<[u8]>,
    t: i64,
    t_delta: i64,
    /// The value half ([`XorState`]'s fields, not the struct: the head holds
    /// an encoder per series, and the struct's padding cost each 8 bytes).
    v: u64,
    /// Bits written.
    bits: u32,
    /// The sample count in the low [`Self::COUNT_BITS`] bits and the XOR
    /// window above them ([`Self::window`]): in one word, the encoder is
    /// 48 bytes, not 56.
    count_window: u32,
}

/// The value half of the codec: the previous value's bits and the current
/// (leading zeros, trailing zeros) window, once set.
#[derive(Debug, Clone, Copy, Default)]
struct XorState {
    v: u64,
    window: Option<(u8, u8)>,
}

impl XorState {
    fn write(&mut self, w: &mut BitWriter<'_>, vbits: u64) {
        write_xor(w, &mut self.v, &mut self.window, vbits);
    }
}

/// Writes the XOR block of `vbits` after the value `v` with the current
/// `window`, and updates both.
#[inline]
fn write_xor(w: &mut BitWriter<'_>, v: &mut u64, window: &mut Option<(u8, u8)>, vbits: u64) {
    let xor = vbits ^ *v;
    *v = vbits;
    if xor == 0 {
        w.write_bit(false);
        return;
    }
    // Leading zeros are stored in 5 bits, so cap them at 31.
    let leading = (xor.leading_zeros() as u8).min(31);
    let trailing = xor.trailing_zeros() as u8;
    if let Some((pl, pt)) = *window
        && leading >= pl
        && trailing >= pt
    {
        w.write_bits(0b10, 2);
        w.write_bits(xor >> pt, 64 - pl - pt);
        return;
    }
    let len = 64 - leading - trailing;
    w.write_bits(0b11, 2);
    w.write_bits(leading as u64, 5);
    // A 64-bit window is written as 0: 6 bits hold 0..=63.
    w.write_bits((len & 63) as u64, 6);
    w.write_bits(xor >> trailing, len);
    *window = Some((leading, trailing));
}

impl XorState {
    /// Reads one XOR block; `None` on bad input, with `kind` saying why.
    fn read(&mut self, r: &mut BitReader<'_>) -> Result<(), XorFault> {
        if !r.read_bit().map_err(|_| XorFault::Eof)? {
            return Ok(()); // same value
        }
        let new_window = r.read_bit().map_err(|_| XorFault::Eof)?;
        let (leading, trailing) = if new_window {
            let leading = r.read_bits(5).map_err(|_| XorFault::Eof)? as u8;
            let mut len = r.read_bits(6).map_err(|_| XorFault::Eof)? as u8;
            if len == 0 {
                len = 64;
            }
            if leading as u16 + len as u16 > 64 {
                return Err(XorFault::Window { leading, len });
            }
            let w = (leading, 64 - leading - len);
            self.window = Some(w);
            w
        } else {
            self.window.ok_or(XorFault::NoWindow)?
        };
        let bits = r
            .read_bits(64 - leading - trailing)
            .map_err(|_| XorFault::Eof)?;
        // The window is at least one bit wide, so trailing <= 63.
        self.v ^= bits << trailing;
        Ok(())
    }
}

enum XorFault {
    Eof,
    Window { leading: u8, len: u8 },
    NoWindow,
}

impl XorFault {
    /// The error for a fault in the XOR block of `sample` that starts at `bit`.
    fn at(self, bit: usize, sample: u32, count: u32) -> DecodeError {
        match self {
            XorFault::Eof => DecodeError::Truncated { bit, sample, count },
            XorFault::Window { leading, len } => DecodeError::BadXorWindow {
                bit,
                sample,
                leading,
                len,
            },
            XorFault::NoWindow => DecodeError::NoXorWindow { bit, sample },
        }
    }
}

impl GorillaEncoder {
    /// Bits of [`Self::count_window`] that count samples.
    const COUNT_BITS: u32 = 20;
    /// The most samples an encoder takes (about a million; the head seals
    /// its chunks at `max_chunk_samples`, 240 by default, and caps that
    /// setting here). Their bits stay far below 2^32.
    pub const MAX_SAMPLES: u32 = (1 << Self::COUNT_BITS) - 1;
    /// The window's bits, above the count: set (1), leading zeros (5:
    /// capped at 31) and trailing zeros (6: at most 63, the XOR not 0).
    const WINDOW_SET: u32 = 1 << 11;

    pub fn new() -> Self {
        Self::default()
    }

    /// An encoder whose buffer has room for `bytes` before it grows: a head
    /// series sizes its next chunk by its last one, so that its open chunk
    /// neither reallocates its way up nor holds twice what it needs.
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            bytes: BitWriter::buffer(bytes),
            ..Self::default()
        }
    }

    /// Number of samples encoded.
    pub fn count(&self) -> u32 {
        self.count_window & Self::MAX_SAMPLES
    }

    /// The (leading, trailing) zeros of the XOR window, once set.
    fn window(&self) -> Option<(u8, u8)> {
        let w = self.count_window >> Self::COUNT_BITS;
        (w & Self::WINDOW_SET != 0).then_some((((w >> 6) & 31) as u8, (w & 63) as u8))
    }

    fn set_window(&mut self, window: Option<(u8, u8)>) {
        let w = window.map_or(0, |(leading, trailing)| {
            debug_assert!(leading <= 31 && trailing <= 63);
            Self::WINDOW_SET | (leading as u32) << 6 | trailing as u32
        });
        self.count_window = self.count() | w << Self::COUNT_BITS;
    }

    /// The encoded bytes so far (zero-padded to a byte). Decode them with
    /// [`GorillaDecoder::new`] and [`Self::count`].
    pub fn bytes(&self) -> &[u8] {
        BitWriter::written(&self.bytes, self.bits)
    }

    /// Timestamp of the first sample, if any: read back from the bytes (a
    /// varint at the start), so that a head series need not keep it.
    pub fn first_ts(&self) -> Option<i64> {
        if self.count() == 0 {
            return None;
        }
        BitReader::new(self.bytes()).read_varint().ok()
    }

    /// Timestamp of the last sample, if any.
    pub fn last_ts(&self) -> Option<i64> {
        (self.count() > 0).then_some(self.t)
    }

    /// Keeps `ts_ms` for the encoder's owner while it has no sample, in the
    /// word that holds the last sample's timestamp ([`Self::parked_ts`]): a
    /// head series keeps its newest flushed timestamp there. The first
    /// sample appended replaces it.
    pub fn park_ts(&mut self, ts_ms: i64) {
        debug_assert_eq!(self.count(), 0);
        if self.count() == 0 {
            self.t = ts_ms;
        }
    }

    /// The timestamp [`Self::park_ts`] kept (0 if none was) while the
    /// encoder has no sample; `None` once it has one.
    pub fn parked_ts(&self) -> Option<i64> {
        (self.count() == 0).then_some(self.t)
    }

    /// The last sample, if any, without decoding.
    pub fn last(&self) -> Option<(i64, f64)> {
        (self.count() > 0).then(|| (self.t, f64::from_bits(self.v)))
    }

    /// Appends one sample.
    ///
    /// # Panics
    /// Past [`Self::MAX_SAMPLES`] samples.
    pub fn append(&mut self, ts_ms: i64, value: f64) {
        let count = self.count();
        assert!(count < Self::MAX_SAMPLES, "BUG: a chunk past MAX_SAMPLES");
        let vbits = value.to_bits();
        let mut window = self.window();
        let w = &mut BitWriter::new(&mut self.bytes, &mut self.bits);
        match count {
            0 => {
                w.write_varint(ts_ms);
                w.write_bits(vbits, 64);
                self.v = vbits;
            }
            1 => {
                let delta = ts_ms.wrapping_sub(self.t);
                w.write_varint(delta);
                write_xor(w, &mut self.v, &mut window, vbits);
                self.t_delta = delta;
            }
            _ => {
                let delta = ts_ms.wrapping_sub(self.t);
                let dod = delta.wrapping_sub(self.t_delta);
                // '10' + 14 bits covers |dod| < 8 s: at 100 ms or 1 s polling with
                // jitter of a few ms, and most stalls, samples land here or in '0'.
                if dod == 0 {
                    w.write_bit(false);
                } else if fits(dod, 14) {
                    w.write_bits(0b10, 2);
                    w.write_bits(dod as u64, 14);
                } else if fits(dod, 17) {
                    w.write_bits(0b110, 3);
                    w.write_bits(dod as u64, 17);
                } else if fits(dod, 20) {
                    w.write_bits(0b1110, 4);
                    w.write_bits(dod as u64, 20);
                } else {
                    w.write_bits(0b1111, 4);
                    w.write_bits(dod as u64, 64);
                }
                write_xor(w, &mut self.v, &mut window, vbits);
                self.t_delta = delta;
            }
        }
        self.t = ts_ms;
        self.count_window += 1;
        self.set_window(window);
    }
}

/// True if `v` is representable as an `nbits`-bit two's complement integer.
#[inline]
fn fits(v: i64, nbits: u32) -> bool {
    let lim = 1i64 << (nbits - 1);
    (-lim..lim).contains(&v)
}

/// Sign-extends the low `nbits` bits of `v`.
#[inline]
fn sign_extend(v: u64, nbits: u32) -> i64 {
    let shift = 64 - nbits;
    ((v << shift) as i64) >> shift
}

/// Decodes a chunk written by [`GorillaEncoder`]; an iterator of samples.
///
/// Never panics on arbitrary bytes: malformed input yields one `Err` and then
/// the iterator ends.
#[derive(Debug, Clone)]
pub struct GorillaDecoder<'a> {
    r: BitReader<'a>,
    count: u32,
    i: u32,
    t: i64,
    t_delta: i64,
    xor: XorState,
    failed: bool,
}

impl<'a> GorillaDecoder<'a> {
    /// `count` is the number of samples in the chunk (kept outside the bytes).
    pub fn new(bytes: &'a [u8], count: u32) -> Self {
        Self {
            r: BitReader::new(bytes),
            count,
            i: 0,
            t: 0,
            t_delta: 0,
            xor: XorState::default(),
            failed: false,
        }
    }

    fn truncated(&self) -> DecodeError {
        DecodeError::Truncated {
            bit: self.r.bit_pos(),
            sample: self.i,
            count: self.count,
        }
    }

    fn next_sample(&mut self) -> Result<(i64, f64), DecodeError> {
        match self.i {
            0 => {
                self.t = self.r.read_varint().map_err(|_| self.truncated())?;
                self.xor.v = self.r.read_bits(64).map_err(|_| self.truncated())?;
            }
            1 => {
                let delta = self.r.read_varint().map_err(|_| self.truncated())?;
                self.t_delta = delta;
                self.t = self.t.wrapping_add(delta);
                self.read_xor()?;
            }
            _ => {
                let mut prefix = 0u8;
                while prefix < 4 {
                    let bit = self.r.read_bit().map_err(|_| self.truncated())?;
                    if !bit {
                        break;
                    }
                    prefix += 1;
                }
                let dod = match prefix {
                    0 => 0,
                    1 => self.read_signed(14)?,
                    2 => self.read_signed(17)?,
                    3 => self.read_signed(20)?,
                    _ => self.r.read_bits(64).map_err(|_| self.truncated())? as i64,
                };
                self.t_delta = self.t_delta.wrapping_add(dod);
                self.t = self.t.wrapping_add(self.t_delta);
                self.read_xor()?;
            }
        }
        self.i += 1;
        Ok((self.t, f64::from_bits(self.xor.v)))
    }

    fn read_signed(&mut self, nbits: u32) -> Result<i64, DecodeError> {
        let raw = self
            .r
            .read_bits(nbits as u8)
            .map_err(|_| self.truncated())?;
        Ok(sign_extend(raw, nbits))
    }

    fn read_xor(&mut self) -> Result<(), DecodeError> {
        let (bit, sample, count) = (self.r.bit_pos(), self.i, self.count);
        self.xor
            .read(&mut self.r)
            .map_err(|f| f.at(bit, sample, count))
    }
}

impl Iterator for GorillaDecoder<'_> {
    type Item = Result<(i64, f64), DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.i >= self.count {
            return None;
        }
        let r = self.next_sample();
        if r.is_err() {
            self.failed = true;
        }
        Some(r)
    }
}

/// Gorilla's XOR coding of values alone: the first value as 64 raw bits, then
/// one XOR block per value. The fallback value encoding of segment columns.
#[derive(Debug, Clone, Default)]
pub struct XorEncoder {
    bytes: Box<[u8]>,
    /// Bits written ([`BitWriter`]).
    bits: u32,
    count: u32,
    xor: XorState,
}

impl XorEncoder {
    pub fn append(&mut self, value: f64) {
        let vbits = value.to_bits();
        let w = &mut BitWriter::new(&mut self.bytes, &mut self.bits);
        if self.count == 0 {
            w.write_bits(vbits, 64);
            self.xor.v = vbits;
        } else {
            self.xor.write(w, vbits);
        }
        self.count += 1;
    }

    pub fn bytes(&self) -> &[u8] {
        BitWriter::written(&self.bytes, self.bits)
    }
}

/// Decodes what [`XorEncoder`] wrote; never panics, ends after an error.
#[derive(Debug, Clone)]
pub struct XorDecoder<'a> {
    r: BitReader<'a>,
    count: u32,
    i: u32,
    xor: XorState,
    failed: bool,
}

impl<'a> XorDecoder<'a> {
    pub fn new(bytes: &'a [u8], count: u32) -> Self {
        Self {
            r: BitReader::new(bytes),
            count,
            i: 0,
            xor: XorState::default(),
            failed: false,
        }
    }
}

impl Iterator for XorDecoder<'_> {
    type Item = Result<f64, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.i >= self.count {
            return None;
        }
        let (bit, sample, count) = (self.r.bit_pos(), self.i, self.count);
        let r = if self.i == 0 {
            self.r
                .read_bits(64)
                .map(|v| self.xor.v = v)
                .map_err(|_| XorFault::Eof)
        } else {
            self.xor.read(&mut self.r)
        };
        self.i += 1;
        match r {
            Ok(()) => Some(Ok(f64::from_bits(self.xor.v))),
            Err(f) => {
                self.failed = true;
                Some(Err(f.at(bit, sample, count)))
            }
        }
    }
}

#[cfg(test)]
mod tests;
