//! WAL records: framing, encoding and a decoder that never panics.
//!
//! ```text
//! record: len u32 LE | crc32c(type + payload) u32 LE | type u8 | payload (len - 1 bytes)
//! type 1, series:  uvarint ref | str metric | uvarint n | n x (str name, str value)
//! type 2, samples: uvarint n | n x uvarint ref | n x varint ts delta (from the
//!                  previous sample of the record; the first from 0) | n x u64 LE value bits
//! type 3, mark:    uvarint seq | str producer
//! ```
//!
//! A mark says that batch `seq` of `producer` (an agent's id and epoch) is
//! stored. It follows that batch's samples record in the same write, so a torn
//! write can lose the mark but never keep a mark without its samples.

use crate::codec::{Reader, put_str, put_uvarint, put_varint};
use crate::series::{Label, SeriesKey};

pub const TYPE_SERIES: u8 = 1;
pub const TYPE_SAMPLES: u8 = 2;
pub const TYPE_MARK: u8 = 3;
/// Bytes before the payload: len, crc, type.
pub const FRAME_LEN: usize = 9;
/// Largest record accepted on replay; a larger length field is corruption.
pub const MAX_RECORD_BYTES: usize = 256 << 20;

/// A decoded record.
#[derive(Debug, Clone, PartialEq)]
pub enum Record {
    Series {
        wal_ref: u32,
        key: SeriesKey,
    },
    Samples {
        refs: Vec<u32>,
        ts_ms: Vec<i64>,
        values: Vec<f64>,
    },
    Mark {
        producer: String,
        seq: u64,
    },
}

/// Appends one framed record of `kind` whose payload `body` writes.
fn frame(dst: &mut Vec<u8>, kind: u8, body: impl FnOnce(&mut Vec<u8>)) {
    let start = dst.len();
    dst.extend_from_slice(&[0; 8]);
    dst.push(kind);
    body(dst);
    let len = (dst.len() - start - 8) as u32;
    let crc = crc32c::crc32c(&dst[start + 8..]);
    dst[start..start + 4].copy_from_slice(&len.to_le_bytes());
    dst[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
}

pub fn encode_series(dst: &mut Vec<u8>, wal_ref: u32, key: &SeriesKey) {
    frame(dst, TYPE_SERIES, |b| {
        put_uvarint(b, wal_ref as u64);
        put_str(b, key.metric());
        put_uvarint(b, key.labels().len() as u64);
        for l in key.labels() {
            put_str(b, &l.name);
            put_str(b, &l.value);
        }
    });
}

pub fn encode_samples(dst: &mut Vec<u8>, refs: &[u32], ts_ms: &[i64], values: &[f64]) {
    frame(dst, TYPE_SAMPLES, |b| {
        b.reserve(refs.len() * 12);
        put_uvarint(b, refs.len() as u64);
        for &r in refs {
            put_uvarint(b, r as u64);
        }
        let mut prev = 0i64;
        for &t in ts_ms {
            put_varint(b, t.wrapping_sub(prev));
            prev = t;
        }
        for v in values {
            b.extend_from_slice(&v.to_bits().to_le_bytes());
        }
    });
}

pub fn encode_mark(dst: &mut Vec<u8>, producer: &str, seq: u64) {
    frame(dst, TYPE_MARK, |b| {
        put_uvarint(b, seq);
        put_str(b, producer);
    });
}

/// Why a record could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// The input ends inside the record (a torn write at the tail).
    Truncated,
    /// The length field is impossible.
    Length,
    /// The checksum does not match.
    Checksum,
    /// The checksum matched but the payload does not parse (a bug or an
    /// unknown record type).
    Payload,
}

/// Reads the record at the start of `buf`; returns it and its framed length.
pub fn decode(buf: &[u8]) -> Result<(Record, usize), Bad> {
    if buf.len() < FRAME_LEN {
        return Err(Bad::Truncated);
    }
    let len = u32::from_le_bytes(buf[0..4].try_into().expect("BUG: 4 bytes")) as usize;
    if len == 0 || len > MAX_RECORD_BYTES {
        return Err(Bad::Length);
    }
    let Some(body) = buf.get(8..8 + len) else {
        return Err(Bad::Truncated);
    };
    let crc = u32::from_le_bytes(buf[4..8].try_into().expect("BUG: 4 bytes"));
    if crc32c::crc32c(body) != crc {
        return Err(Bad::Checksum);
    }
    let record = parse(body[0], &body[1..]).ok_or(Bad::Payload)?;
    Ok((record, 8 + len))
}

fn parse(kind: u8, payload: &[u8]) -> Option<Record> {
    let mut r = Reader::new(payload, 0);
    let record = match kind {
        TYPE_SERIES => {
            let wal_ref = u32::try_from(r.uvarint("ref").ok()?).ok()?;
            let metric = r.string("metric").ok()?;
            let n = r.len("labels", payload.len()).ok()?;
            let mut labels = Vec::with_capacity(n.min(64));
            for _ in 0..n {
                labels.push(Label::new(r.string("name").ok()?, r.string("value").ok()?));
            }
            Record::Series {
                wal_ref,
                key: SeriesKey::new(metric, labels).ok()?,
            }
        }
        TYPE_SAMPLES => {
            // Each sample takes at least 10 bytes, which bounds a forged count.
            let n = r.len("count", payload.len() / 10).ok()?;
            let mut refs = Vec::with_capacity(n);
            for _ in 0..n {
                refs.push(u32::try_from(r.uvarint("ref").ok()?).ok()?);
            }
            let mut ts_ms = Vec::with_capacity(n);
            let mut prev = 0i64;
            for _ in 0..n {
                prev = prev.wrapping_add(r.varint("ts").ok()?);
                ts_ms.push(prev);
            }
            let bits = r.bytes(n * 8, "values").ok()?;
            let values = bits
                .chunks_exact(8)
                .map(|c| f64::from_bits(u64::from_le_bytes(c.try_into().expect("BUG: 8 bytes"))))
                .collect();
            Record::Samples {
                refs,
                ts_ms,
                values,
            }
        }
        TYPE_MARK => {
            let seq = r.uvarint("seq").ok()?;
            let producer = r.string("producer").ok()?;
            Record::Mark { producer, seq }
        }
        _ => return None,
    };
    r.is_empty().then_some(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_golden_frame() {
        let key = SeriesKey::new("m", vec![Label::new("gpu", "0")]).unwrap();
        let mut buf = Vec::new();
        encode_series(&mut buf, 7, &key);
        // payload: type 1 | ref 7 | "m" | 1 label | "gpu" | "0"
        let payload = [1u8, 7, 1, b'm', 1, 3, b'g', b'p', b'u', 1, b'0'];
        assert_eq!(&buf[0..4], &(payload.len() as u32).to_le_bytes());
        assert_eq!(&buf[4..8], &crc32c::crc32c(&payload).to_le_bytes());
        assert_eq!(&buf[8..], &payload);
        let n = buf.len();
        encode_samples(&mut buf, &[7, 7], &[1000, 2000], &[f64::NAN, -0.0]);
        let (r1, l1) = decode(&buf).unwrap();
        assert_eq!(r1, Record::Series { wal_ref: 7, key });
        assert_eq!(l1, n);
        let (r2, l2) = decode(&buf[n..]).unwrap();
        assert_eq!(l2, buf.len() - n);
        let Record::Samples {
            refs,
            ts_ms,
            values,
        } = r2
        else {
            panic!()
        };
        assert_eq!((refs, ts_ms), (vec![7, 7], vec![1000, 2000]));
        assert!(values[0].is_nan() && values[1].to_bits() == (-0.0f64).to_bits());
    }

    #[test]
    fn mark_round_trip() {
        let mut buf = Vec::new();
        encode_mark(&mut buf, "node-7/00000000deadbeef", 300);
        // payload: type 3 | seq 300 (uvarint 0xac 0x02) | str
        assert_eq!(&buf[8..11], &[3, 0xac, 0x02]);
        let (r, len) = decode(&buf).unwrap();
        assert_eq!(len, buf.len());
        assert_eq!(
            r,
            Record::Mark {
                producer: "node-7/00000000deadbeef".into(),
                seq: 300
            }
        );
    }

    #[test]
    fn every_truncation_and_flip_is_an_error() {
        let mut buf = Vec::new();
        encode_samples(&mut buf, &[1, 2, 3], &[5, 6, 7], &[1.0, 2.0, 3.0]);
        for cut in 0..buf.len() {
            assert!(decode(&buf[..cut]).is_err(), "cut {cut}");
        }
        for i in 0..buf.len() {
            let mut b = buf.clone();
            b[i] ^= 0x10;
            assert!(decode(&b).is_err(), "flip in byte {i}");
        }
    }
}
