//! Prometheus's XOR chunk encoding (`tsdb/chunkenc/xor.go`), the chunk
//! format of remote read's `STREAMED_XOR_CHUNKS` responses.
//!
//! ```text
//! +------------------+----------------------------------------------------+
//! | samples: u16 BE  | bit stream, padded with zero bits to a whole byte  |
//! +------------------+----------------------------------------------------+
//! sample 0: ts as a zigzag varint (bytes), value as 64 raw bits
//! sample 1: ts delta as a uvarint (bytes), value XORed with the previous
//! sample n: delta-of-delta in '0' | '10'+14 bits | '110'+17 | '1110'+20 | '1111'+64,
//!           value XORed: '0' same | '10' + bits in the previous window |
//!           '11' + 5 bits leading zeros + 6 bits length (0 = 64) + bits
//! ```
//!
//! gpulse's own Gorilla chunks (`storage/src/gorilla.rs`) differ in detail,
//! so remote read re-encodes samples in this format. [`decode`] reads it back
//! (for clients and tests), written from Prometheus's iterator rather than
//! from the encoder here.

/// Most samples per chunk, as Prometheus cuts them.
pub const SAMPLES_PER_CHUNK: usize = 120;

#[derive(Debug, Default)]
struct BitWriter {
    bytes: Vec<u8>,
    /// Bits used in the last byte (0 = a new byte is needed).
    used: u8,
}

impl BitWriter {
    fn bit(&mut self, bit: bool) {
        if self.used == 0 {
            self.bytes.push(0);
        }
        if bit {
            *self.bytes.last_mut().expect("BUG: pushed above") |= 0x80 >> self.used;
        }
        self.used = (self.used + 1) % 8;
    }

    /// The low `n` bits of `v`, most significant first.
    fn bits(&mut self, v: u64, n: u32) {
        for i in (0..n).rev() {
            self.bit((v >> i) & 1 == 1);
        }
    }

    /// Whole bytes, at the current bit position (as Prometheus's
    /// `writeByte`, which need not be byte-aligned).
    fn byte(&mut self, b: u8) {
        self.bits(u64::from(b), 8);
    }
}

/// Appends samples to one XOR chunk.
#[derive(Debug)]
pub struct XorChunk {
    w: BitWriter,
    count: u16,
    t: i64,
    v: f64,
    t_delta: u64,
    leading: u8,
    trailing: u8,
}

impl Default for XorChunk {
    fn default() -> Self {
        Self::new()
    }
}

impl XorChunk {
    pub fn new() -> Self {
        Self {
            w: BitWriter {
                bytes: vec![0, 0],
                used: 0,
            },
            count: 0,
            t: 0,
            v: 0.0,
            t_delta: 0,
            leading: 0xff,
            trailing: 0,
        }
    }

    /// Appends a sample; timestamps must not decrease.
    pub fn append(&mut self, t: i64, v: f64) {
        let mut t_delta = 0;
        match self.count {
            0 => {
                let mut buf = Vec::with_capacity(10);
                put_varint(&mut buf, t);
                for b in buf {
                    self.w.byte(b);
                }
                self.w.bits(v.to_bits(), 64);
            }
            1 => {
                t_delta = t.wrapping_sub(self.t) as u64;
                let mut buf = Vec::with_capacity(10);
                put_uvarint(&mut buf, t_delta);
                for b in buf {
                    self.w.byte(b);
                }
                self.write_value(v);
            }
            _ => {
                t_delta = t.wrapping_sub(self.t) as u64;
                let dod = t_delta.wrapping_sub(self.t_delta) as i64;
                if dod == 0 {
                    self.w.bit(false);
                } else if bit_range(dod, 14) {
                    self.w.bits(0b10, 2);
                    self.w.bits(dod as u64, 14);
                } else if bit_range(dod, 17) {
                    self.w.bits(0b110, 3);
                    self.w.bits(dod as u64, 17);
                } else if bit_range(dod, 20) {
                    self.w.bits(0b1110, 4);
                    self.w.bits(dod as u64, 20);
                } else {
                    self.w.bits(0b1111, 4);
                    self.w.bits(dod as u64, 64);
                }
                self.write_value(v);
            }
        }
        self.t = t;
        self.v = v;
        self.t_delta = t_delta;
        self.count += 1;
        self.w.bytes[..2].copy_from_slice(&self.count.to_be_bytes());
    }

    fn write_value(&mut self, v: f64) {
        let delta = v.to_bits() ^ self.v.to_bits();
        if delta == 0 {
            self.w.bit(false);
            return;
        }
        self.w.bit(true);
        let leading = (delta.leading_zeros() as u8).min(31);
        let trailing = delta.trailing_zeros() as u8;
        if self.leading != 0xff && leading >= self.leading && trailing >= self.trailing {
            self.w.bit(false);
            let n = 64 - u32::from(self.leading) - u32::from(self.trailing);
            self.w.bits(delta >> self.trailing, n);
            return;
        }
        self.leading = leading;
        self.trailing = trailing;
        self.w.bit(true);
        self.w.bits(u64::from(leading), 5);
        let sigbits = 64 - u32::from(leading) - u32::from(trailing);
        // 64 significant bits are written as 0 in the 6-bit field.
        self.w.bits(u64::from(sigbits), 6);
        self.w.bits(delta >> trailing, sigbits);
    }

    /// The chunk's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.w.bytes
    }
}

/// Whether `x` fits the signed `nbits` range Prometheus uses:
/// `[-(2^(n-1) - 1), 2^(n-1)]`.
fn bit_range(x: i64, nbits: u32) -> bool {
    -((1i64 << (nbits - 1)) - 1) <= x && x <= 1i64 << (nbits - 1)
}

/// Go's `binary.PutUvarint`.
pub(crate) fn put_uvarint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Go's `binary.PutVarint` (zigzag).
fn put_varint(out: &mut Vec<u8>, v: i64) {
    put_uvarint(out, ((v << 1) ^ (v >> 63)) as u64);
}

/// Reads bits most significant first; `None` past the end.
struct BitReader<'a> {
    b: &'a [u8],
    pos: usize,
}

impl BitReader<'_> {
    fn bit(&mut self) -> Option<bool> {
        let byte = self.b.get(self.pos / 8)?;
        let v = byte & (0x80 >> (self.pos % 8)) != 0;
        self.pos += 1;
        Some(v)
    }

    fn bits(&mut self, n: u32) -> Option<u64> {
        let mut acc = 0;
        for _ in 0..n {
            acc = (acc << 1) | u64::from(self.bit()?);
        }
        Some(acc)
    }

    fn uvarint(&mut self) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.bits(8)?;
            v |= (b & 0x7f).checked_shl(shift)?;
            if b < 0x80 {
                return Some(v);
            }
        }
        None
    }
}

/// Prometheus's reading of an n-bit delta-of-delta: `2^(n-1)` is positive.
fn signed(v: u64, n: u32) -> i64 {
    if v > 1 << (n - 1) {
        v as i64 - (1i64 << n)
    } else {
        v as i64
    }
}

/// Decodes one XOR chunk.
///
/// # Errors
/// The chunk ends before its header's sample count, or a value field has an
/// impossible width.
pub fn decode(chunk: &[u8]) -> Result<Vec<(i64, f64)>, &'static str> {
    const SHORT: &str = "the chunk ends before its last sample";
    let n = match chunk {
        [a, b, ..] => u16::from_be_bytes([*a, *b]) as usize,
        _ => return Err("the chunk has no header"),
    };
    let mut r = BitReader {
        b: &chunk[2..],
        pos: 0,
    };
    let mut out = Vec::with_capacity(n);
    let (mut t, mut v, mut delta) = (0i64, 0u64, 0i64);
    let (mut leading, mut trailing) = (0u32, 0u32);
    for i in 0..n {
        if i == 0 {
            let z = r.uvarint().ok_or(SHORT)?;
            t = ((z >> 1) as i64) ^ -((z & 1) as i64);
            v = r.bits(64).ok_or(SHORT)?;
            out.push((t, f64::from_bits(v)));
            continue;
        }
        if i == 1 {
            delta = r.uvarint().ok_or(SHORT)? as i64;
        } else {
            let mut ones = 0;
            while ones < 4 && r.bit().ok_or(SHORT)? {
                ones += 1;
            }
            let dod = match ones {
                0 => 0,
                1 => signed(r.bits(14).ok_or(SHORT)?, 14),
                2 => signed(r.bits(17).ok_or(SHORT)?, 17),
                3 => signed(r.bits(20).ok_or(SHORT)?, 20),
                _ => r.bits(64).ok_or(SHORT)? as i64,
            };
            delta = delta.wrapping_add(dod);
        }
        t = t.wrapping_add(delta);
        if r.bit().ok_or(SHORT)? {
            if r.bit().ok_or(SHORT)? {
                leading = r.bits(5).ok_or(SHORT)? as u32;
                let sig = match r.bits(6).ok_or(SHORT)? as u32 {
                    0 => 64,
                    s => s,
                };
                trailing = 64u32
                    .checked_sub(leading + sig)
                    .ok_or("a value field is wider than 64 bits")?;
            }
            let sig = 64 - leading - trailing;
            v ^= r.bits(sig).ok_or(SHORT)?.checked_shl(trailing).unwrap_or(0);
        }
        out.push((t, f64::from_bits(v)));
    }
    Ok(out)
}
