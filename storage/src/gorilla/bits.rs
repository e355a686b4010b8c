//! Bit-level writer and reader used by the Gorilla codec.
//!
//! Bits are written most significant first, as in the Gorilla paper and in the
//! Prometheus `bstream`. The reader never panics: running past the end is an
//! [`Eof`] error that the decoder turns into a located corruption error.

/// Appends bits to a byte buffer, most significant bit first. It borrows
/// the buffer and the count of bits written from their owner, which keeps
/// them where its layout has room: a head series holds an encoder, whose
/// buffer is a boxed slice (two words, where a `Vec` takes three) and whose
/// 32-bit count of bits sits beside its other small fields. The bytes past
/// the bits written are zero, so that writing ORs bits in.
#[derive(Debug)]
pub(crate) struct BitWriter<'a> {
    buf: &'a mut Box<[u8]>,
    bits: &'a mut u32,
}

impl<'a> BitWriter<'a> {
    /// A writer that appends to the first `bits` bits of `buf`, whose bytes
    /// after them are zero (an empty buffer and 0 to start).
    #[inline]
    pub(crate) fn new(buf: &'a mut Box<[u8]>, bits: &'a mut u32) -> Self {
        debug_assert!(bits.div_ceil(8) as usize <= buf.len());
        Self { buf, bits }
    }

    /// The whole bytes that hold the first `bits` bits of `buf`, the last
    /// one zero-padded.
    #[inline]
    pub(crate) fn written(buf: &[u8], bits: u32) -> &[u8] {
        &buf[..bits.div_ceil(8) as usize]
    }

    /// A zeroed buffer with room for `bytes` (none allocated for 0).
    pub(crate) fn buffer(bytes: usize) -> Box<[u8]> {
        vec![0; bytes].into_boxed_slice()
    }

    /// Writes the low `nbits` bits of `value` (`nbits` in 0..=64).
    ///
    /// # Panics
    /// Past 2^32 bits (512 MiB): the encoders hold far fewer
    /// ([`super::GorillaEncoder::MAX_SAMPLES`]).
    #[inline]
    pub(crate) fn write_bits(&mut self, value: u64, nbits: u8) {
        debug_assert!(nbits <= 64);
        let end = *self.bits as usize + nbits as usize;
        if end.div_ceil(8) > self.buf.len() {
            Self::grow(self.buf, end.div_ceil(8));
        }
        let (mut pos, mut n) = (*self.bits as usize, nbits);
        while n > 0 {
            let free = 8 - (pos % 8) as u8;
            let take = n.min(free);
            // The `take` bits just below position `n` of `value`.
            let chunk = ((value >> (n - take)) & ((1u64 << take) - 1)) as u8;
            self.buf[pos / 8] |= chunk << (free - take);
            pos += take as usize;
            n -= take;
        }
        *self.bits = u32::try_from(end).expect("BUG: a bit stream past 2^32 bits");
    }

    /// Replaces `buf` by a zero-padded copy with room for at least `need`
    /// bytes: twice as many as before, 16 at least (one sample's 15 bytes
    /// in glibc's smallest chunk).
    #[cold]
    fn grow(buf: &mut Box<[u8]>, need: usize) {
        let cap = need.max(buf.len() * 2).max(16);
        let mut grown = Vec::with_capacity(cap);
        grown.extend_from_slice(buf);
        grown.resize(cap, 0);
        *buf = grown.into_boxed_slice();
    }

    #[inline]
    pub(crate) fn write_bit(&mut self, bit: bool) {
        self.write_bits(bit as u64, 1);
    }

    /// Writes an unsigned LEB128 varint as whole 8-bit groups.
    pub(crate) fn write_uvarint(&mut self, mut v: u64) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                self.write_bits(b as u64, 8);
                return;
            }
            self.write_bits((b | 0x80) as u64, 8);
        }
    }

    pub(crate) fn write_varint(&mut self, v: i64) {
        self.write_uvarint(zigzag(v));
    }

    /// The bytes written so far; the last byte is zero-padded.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> &[u8] {
        Self::written(self.buf, *self.bits)
    }
}

/// Ran past the end of the input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Eof;

/// Reads bits written by [`BitWriter`].
#[derive(Debug, Clone)]
pub(crate) struct BitReader<'a> {
    bytes: &'a [u8],
    /// Position in bits from the start of `bytes`.
    pos: usize,
}

impl<'a> BitReader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// Current position in bits, for error reports.
    pub(crate) fn bit_pos(&self) -> usize {
        self.pos
    }

    #[inline]
    pub(crate) fn read_bit(&mut self) -> Result<bool, Eof> {
        let byte = *self.bytes.get(self.pos / 8).ok_or(Eof)?;
        let bit = (byte >> (7 - (self.pos % 8))) & 1;
        self.pos += 1;
        Ok(bit == 1)
    }

    /// Reads `nbits` bits (0..=64) into the low bits of the result: one
    /// big-endian load of the 16 bytes from the current one (9 would do:
    /// 64 bits at an offset of up to 7) and two shifts, where the stream
    /// has them; the last bytes go through a zero-padded copy.
    #[inline]
    pub(crate) fn read_bits(&mut self, nbits: u8) -> Result<u64, Eof> {
        debug_assert!(nbits <= 64);
        let end = self.pos + nbits as usize;
        if end > self.bytes.len() * 8 {
            return Err(Eof);
        }
        if nbits == 0 {
            return Ok(0);
        }
        let at = self.pos / 8;
        let word = match self.bytes.get(at..at + 16) {
            Some(b) => u128::from_be_bytes(b.try_into().expect("BUG: 16 bytes")),
            None => {
                let mut buf = [0u8; 16];
                let tail = &self.bytes[at..];
                buf[..tail.len()].copy_from_slice(tail);
                u128::from_be_bytes(buf)
            }
        };
        // Drop the bits before `pos`, then keep the top `nbits`.
        let out = (word << (self.pos % 8)) >> (128 - nbits as u32);
        self.pos = end;
        Ok(out as u64)
    }

    pub(crate) fn read_uvarint(&mut self) -> Result<u64, Eof> {
        let mut out: u64 = 0;
        for shift in (0..70).step_by(7) {
            let b = self.read_bits(8)?;
            if shift == 63 && b > 1 {
                return Err(Eof); // would overflow u64: treat as malformed input
            }
            out |= (b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(out);
            }
        }
        Err(Eof)
    }

    pub(crate) fn read_varint(&mut self) -> Result<i64, Eof> {
        self.read_uvarint().map(unzigzag)
    }
}

#[inline]
pub(crate) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

#[inline]
pub(crate) fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_round_trip_across_byte_boundaries() {
        let (mut buf, mut bits) = (Box::default(), 0);
        let mut w = BitWriter::new(&mut buf, &mut bits);
        w.write_bits(0b101, 3);
        w.write_bits(u64::MAX, 64);
        w.write_bit(false);
        w.write_bits(0x1234, 13);
        // 3 + 64 + 1 + 13 = 81 bits -> 11 bytes.
        assert_eq!(w.bytes().len(), 11);
        let mut r = BitReader::new(w.bytes());
        assert_eq!(r.read_bits(3), Ok(0b101));
        assert_eq!(r.read_bits(64), Ok(u64::MAX));
        assert_eq!(r.read_bit(), Ok(false));
        assert_eq!(r.read_bits(13), Ok(0x1234 & 0x1fff));
        // 7 padding bits remain, then EOF.
        assert_eq!(r.read_bits(7), Ok(0));
        assert_eq!(r.read_bit(), Err(Eof));
    }

    #[test]
    fn known_bit_pattern() {
        let (mut buf, mut bits) = (Box::default(), 0);
        let mut w = BitWriter::new(&mut buf, &mut bits);
        w.write_bits(0b1, 1);
        w.write_bits(0b0000001, 7);
        w.write_bits(0xff, 8);
        assert_eq!(w.bytes(), &[0x81, 0xff]);
    }

    #[test]
    fn varints() {
        for v in [0i64, 1, -1, 63, -64, 1000, i64::MAX, i64::MIN] {
            let (mut buf, mut bits) = (Box::default(), 0);
            let mut w = BitWriter::new(&mut buf, &mut bits);
            w.write_bit(true); // unaligned on purpose
            w.write_varint(v);
            let mut r = BitReader::new(w.bytes());
            assert_eq!(r.read_bit(), Ok(true));
            assert_eq!(r.read_varint(), Ok(v), "{v}");
        }
        // 2000 = 0x7d0 -> LEB128 d0 0f (zigzag(1000) = 2000).
        let (mut buf, mut bits) = (Box::default(), 0);
        let mut w = BitWriter::new(&mut buf, &mut bits);
        w.write_varint(1000);
        assert_eq!(w.bytes(), &[0xd0, 0x0f]);
    }

    proptest::proptest! {
        /// Reads of any widths, from any stream, give the bits one at a time
        /// would (most significant first) and fail exactly where the stream
        /// ends, near its end (the padded load) as well as before it.
        #[test]
        fn read_bits_is_bit_by_bit(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40),
            widths in proptest::collection::vec(0u8..=64, 0..20),
        ) {
            let bit = |i: usize| (bytes[i / 8] >> (7 - i % 8)) & 1;
            let mut r = BitReader::new(&bytes);
            let mut pos = 0;
            for n in widths {
                let n_usize = n as usize;
                if pos + n_usize > bytes.len() * 8 {
                    proptest::prop_assert_eq!(r.read_bits(n), Err(Eof));
                    continue;
                }
                let want = (pos..pos + n_usize).fold(0u64, |acc, i| (acc << 1) | bit(i) as u64);
                proptest::prop_assert_eq!(r.read_bits(n), Ok(want));
                pos += n_usize;
                proptest::prop_assert_eq!(r.bit_pos(), pos);
            }
        }
    }

    #[test]
    fn overlong_varint_is_an_error_not_a_panic() {
        let bytes = [0xffu8; 12];
        assert_eq!(BitReader::new(&bytes).read_uvarint(), Err(Eof));
    }
}
