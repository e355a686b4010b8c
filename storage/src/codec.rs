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

/// Reads a section; errors are `(absolute offset, what went wrong)`.
#[derive(Debug)]
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

    pub(crate) fn string(&mut self, what: &'static str) -> ReadResult<String> {
        let at = self.offset();
        let n = self.len(what, self.buf.len())?;
        let b = self.bytes(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| (at, Corruption::BadUtf8))
    }
}
