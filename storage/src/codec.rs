//! Little helpers to write and read index sections and WAL records: LEB128
//! varints and length-prefixed strings. The reader never panics; every
//! failure carries the absolute file offset where it happened.

use crate::error::Corruption;

pub(crate) fn put_uvarint(buf: &mut Vec<u8>, mut v: u64) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            buf.push(b);
            return;
        }
        buf.push(b | 0x80);
    }
}

pub(crate) fn put_varint(buf: &mut Vec<u8>, v: i64) {
    put_uvarint(buf, ((v << 1) ^ (v >> 63)) as u64);
}

pub(crate) fn put_str(buf: &mut Vec<u8>, s: &str) {
    put_uvarint(buf, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

/// Appends `raw` as a compressed section: `uvarint raw_len` and one zstd
/// frame of `raw` (level 3, as column blocks). [`zstd_section`] reads it.
pub(crate) fn put_zstd_section(out: &mut Vec<u8>, raw: &[u8]) {
    put_uvarint(out, raw.len() as u64);
    let z = crate::column::zstd_compress(raw).expect("BUG: zstd compression of a buffer failed");
    out.extend_from_slice(&z);
}

/// The bytes of a section written by [`put_zstd_section`], found at file
/// offset `base`. The stored bytes must be exactly one zstd frame that
/// decompresses to the declared length, at most `max_raw`. Memory follows
/// what the frame really holds, not the declared length, so a forged length
/// allocates nothing.
pub(crate) fn zstd_section(
    stored: &[u8],
    base: u64,
    max_raw: u64,
    what: &'static str,
) -> ReadResult<Vec<u8>> {
    use std::io::Read;
    let mut r = Reader::new(stored, base);
    let raw_len = r.uvarint(what)?;
    let frame = &stored[r.pos..];
    let bad = || Err((base, Corruption::OutOfBounds { what }));
    if raw_len > max_raw || zstd::zstd_safe::find_frame_compressed_size(frame) != Ok(frame.len()) {
        return bad();
    }
    let Ok(decoder) = zstd::stream::read::Decoder::with_buffer(frame) else {
        return bad();
    };
    // The first allocation is bounded by the frame's size; the vector grows
    // from there only as bytes really come out.
    let guess = raw_len.min(frame.len() as u64 * 16).min(1 << 26);
    let mut out = Vec::with_capacity(guess as usize);
    match decoder
        .single_frame()
        .take(raw_len.saturating_add(1))
        .read_to_end(&mut out)
    {
        Ok(n) if n as u64 == raw_len => Ok(out),
        _ => bad(),
    }
}

/// Reads a section; errors are `(absolute offset, what went wrong)`.
#[derive(Debug, Clone)]
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Absolute file offset of `buf[0]`, for error reports.
    base: u64,
}

pub(crate) type ReadResult<T> = Result<T, (u64, Corruption)>;

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], base: u64) -> Self {
        Self { buf, pos: 0, base }
    }

    pub(crate) fn offset(&self) -> u64 {
        self.base + self.pos as u64
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.pos >= self.buf.len()
    }

    fn err<T>(&self, what: &'static str) -> ReadResult<T> {
        Err((self.offset(), Corruption::OutOfBounds { what }))
    }

    pub(crate) fn uvarint(&mut self, what: &'static str) -> ReadResult<u64> {
        let mut out: u64 = 0;
        for shift in (0..70).step_by(7) {
            let Some(&b) = self.buf.get(self.pos) else {
                return self.err(what);
            };
            if shift == 63 && b > 1 {
                return self.err(what);
            }
            self.pos += 1;
            out |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(out);
            }
        }
        self.err(what)
    }

    pub(crate) fn varint(&mut self, what: &'static str) -> ReadResult<i64> {
        let v = self.uvarint(what)?;
        Ok(((v >> 1) as i64) ^ -((v & 1) as i64))
    }

    /// A varint that must fit in `usize` and be at most `max`.
    pub(crate) fn len(&mut self, what: &'static str, max: usize) -> ReadResult<usize> {
        let at = self.offset();
        let v = self.uvarint(what)?;
        if v > max as u64 {
            return Err((at, Corruption::OutOfBounds { what }));
        }
        Ok(v as usize)
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &'static str) -> ReadResult<&'a [u8]> {
        let Some(end) = self.pos.checked_add(n).filter(|&e| e <= self.buf.len()) else {
            return self.err(what);
        };
        let out = &self.buf[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    pub(crate) fn u32_le(&mut self, what: &'static str) -> ReadResult<u32> {
        let b = self.bytes(4, what)?;
        Ok(u32::from_le_bytes(b.try_into().expect("BUG: 4 bytes")))
    }

    pub(crate) fn u64_le(&mut self, what: &'static str) -> ReadResult<u64> {
        let b = self.bytes(8, what)?;
        Ok(u64::from_le_bytes(b.try_into().expect("BUG: 8 bytes")))
    }

    pub(crate) fn string(&mut self, what: &'static str) -> ReadResult<String> {
        self.str(what).map(str::to_owned)
    }

    /// [`Self::string`] without the copy: the text as it lies in the buffer.
    pub(crate) fn str(&mut self, what: &'static str) -> ReadResult<&'a str> {
        let at = self.offset();
        let n = self.len(what, self.buf.len())?;
        let b = self.bytes(n, what)?;
        std::str::from_utf8(b).map_err(|_| (at, Corruption::BadUtf8))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(raw: &[u8]) -> Vec<u8> {
        let mut s = Vec::new();
        put_zstd_section(&mut s, raw);
        s
    }

    fn refused(stored: &[u8]) -> bool {
        matches!(
            zstd_section(stored, 100, u64::MAX, "test section"),
            Err((
                100,
                Corruption::OutOfBounds {
                    what: "test section"
                }
            ))
        )
    }

    #[test]
    fn a_zstd_section_reads_back() {
        let raw: Vec<u8> = (0..10_000u32).flat_map(|i| (i % 7).to_le_bytes()).collect();
        let s = section(&raw);
        assert!(s.len() < raw.len() / 10);
        assert_eq!(zstd_section(&s, 0, u64::MAX, "x").unwrap(), raw);
        assert_eq!(zstd_section(&section(b""), 0, 0, "x").unwrap(), b"");
    }

    #[test]
    fn a_forged_zstd_section_is_refused() {
        let raw = b"label name, label value, label name, label value".repeat(50);
        let good = section(&raw);
        let frame = zstd::bulk::compress(&raw, 3).unwrap();
        let declared = |n: u64| {
            let mut s = Vec::new();
            put_uvarint(&mut s, n);
            s.extend_from_slice(&frame);
            s
        };
        // The declared length, one off either way, or absurd.
        assert!(refused(&declared(raw.len() as u64 + 1)));
        assert!(refused(&declared(raw.len() as u64 - 1)));
        assert!(refused(&declared(u64::MAX)));
        // Over the caller's limit, although it would decompress.
        assert!(zstd_section(&good, 0, raw.len() as u64 - 1, "x").is_err());
        assert!(zstd_section(&good, 0, raw.len() as u64, "x").is_ok());
        // A byte after the frame, a second frame, a cut frame, no frame.
        let mut s = good.clone();
        s.push(0);
        assert!(refused(&s));
        let mut s = good.clone();
        s.extend_from_slice(&frame);
        assert!(refused(&s));
        assert!(refused(&good[..good.len() - 1]));
        assert!(refused(&declared(0)[..1]));
        // The length varint itself cut short reports where it was.
        assert!(zstd_section(&[0x80], 100, u64::MAX, "test section").is_err());
        // A flipped bit in the frame's content (zstd frames carry no checksum
        // by default, so this may decode to other bytes: the section's CRC is
        // what catches that); it must never panic.
        for i in 0..good.len() {
            let mut s = good.clone();
            s[i] ^= 0x10;
            let _ = zstd_section(&s, 0, u64::MAX, "x");
        }
    }
}
