//! WAL records: framing, encoding and a decoder that never panics.
//!
//! ```text
//! record: len u32 LE | crc32c(type + payload) u32 LE | type u8 | payload (len - 1 bytes)
//! type 1, series:  uvarint ref | str metric | uvarint n | n x (str name, str value)
//! type 2, samples: uvarint n | n x uvarint ref | n x varint ts delta (from the
//!                  previous sample of the record; the first from 0) | n x u64 LE value bits
//! type 3, mark:    uvarint seq | str producer
//! type 4, series batch (WAL version 2): uvarint raw_len | one zstd frame of
//!                  uvarint n | n x (a type 1 payload)
//! ```
//!
//! A checkpoint defines every head series; as series batches, of at most
//! [`BATCH_SERIES`] series each, it is a tenth of its size as type 1 records
//! (label names and values repeat from series to series).
//!
//! A mark says that batch `seq` of `producer` (an agent's id and epoch) is
//! stored. It follows that batch's samples record in the same write, so a torn
//! write can lose the mark but never keep a mark without its samples.

use crate::codec::{Reader, put_str, put_uvarint, put_varint};
use crate::series::{Label, SeriesKey};

pub const TYPE_SERIES: u8 = 1;
pub const TYPE_SAMPLES: u8 = 2;
pub const TYPE_MARK: u8 = 3;
pub const TYPE_SERIES_BATCH: u8 = 4;
/// Most series in one series batch record, which bounds its decompressed size.
pub const BATCH_SERIES: usize = 16_384;
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
    /// Series definitions, as [`Record::Series`] each, in order.
    SeriesBatch(Vec<(u32, SeriesKey)>),
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

fn put_series(b: &mut Vec<u8>, wal_ref: u32, key: &SeriesKey) {
    put_uvarint(b, wal_ref as u64);
    put_str(b, key.metric());
    put_uvarint(b, key.labels().len() as u64);
    for l in key.labels() {
        put_str(b, &l.name);
        put_str(b, &l.value);
    }
}

pub fn encode_series(dst: &mut Vec<u8>, wal_ref: u32, key: &SeriesKey) {
    frame(dst, TYPE_SERIES, |b| put_series(b, wal_ref, key));
}

/// Appends series batch records defining `series`, [`BATCH_SERIES`] at most each.
pub fn encode_series_batches<'a>(
    dst: &mut Vec<u8>,
    mut series: impl ExactSizeIterator<Item = (u32, &'a SeriesKey)>,
) {
    let mut raw = Vec::new();
    while series.len() > 0 {
        raw.clear();
        let n = series.len().min(BATCH_SERIES);
        put_uvarint(&mut raw, n as u64);
        for (r, key) in series.by_ref().take(n) {
            put_series(&mut raw, r, key);
        }
        frame(dst, TYPE_SERIES_BATCH, |b| {
            crate::codec::put_zstd_section(b, &raw);
        });
    }
}

fn parse_series(r: &mut Reader<'_>, max: usize) -> Option<(u32, SeriesKey)> {
    let wal_ref = u32::try_from(r.uvarint("ref").ok()?).ok()?;
    let metric = r.string("metric").ok()?;
    let n = r.len("labels", max).ok()?;
    let mut labels = Vec::with_capacity(n.min(64));
    for _ in 0..n {
        labels.push(Label::new(r.str("name").ok()?, r.str("value").ok()?));
    }
    Some((wal_ref, SeriesKey::new(metric, labels).ok()?))
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
            let (wal_ref, key) = parse_series(&mut r, payload.len())?;
            Record::Series { wal_ref, key }
        }
        TYPE_SERIES_BATCH => {
            let raw =
                crate::codec::zstd_section(payload, 0, MAX_RECORD_BYTES as u64, "series batch")
                    .ok()?;
            let mut b = Reader::new(&raw, 0);
            // Each series takes at least 4 bytes (ref, metric, label count).
            let n = b
                .len("batch count", (raw.len() / 4).min(BATCH_SERIES))
                .ok()?;
            let mut series = Vec::with_capacity(n);
            for _ in 0..n {
                series.push(parse_series(&mut b, raw.len())?);
            }
            if !b.is_empty() {
                return None;
            }
            // The frame is the whole payload: nothing is left for `r`.
            return Some(Record::SeriesBatch(series));
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

    fn batch_key(i: u32) -> SeriesKey {
        SeriesKey::new(
            "DCGM_FI_DEV_GPU_TEMP",
            vec![
                Label::new("Hostname", format!("host-{:05}", i / 8)),
                Label::new("UUID", format!("GPU-{i:08x}-0000-0000-0000-000000000000")),
                Label::new("gpu", (i % 8).to_string()),
            ],
        )
        .unwrap()
    }

    #[test]
    fn series_batches_round_trip_and_split() {
        let keys: Vec<SeriesKey> = (0..BATCH_SERIES as u32 + 5).map(batch_key).collect();
        let mut buf = Vec::new();
        encode_series_batches(
            &mut buf,
            keys.iter().enumerate().map(|(i, k)| (i as u32 * 3, k)),
        );
        // Two records: a full batch and the 5 left over.
        let (r1, l1) = decode(&buf).unwrap();
        let (r2, l2) = decode(&buf[l1..]).unwrap();
        assert_eq!(l1 + l2, buf.len());
        let (Record::SeriesBatch(a), Record::SeriesBatch(b)) = (r1, r2) else {
            panic!("not series batches")
        };
        assert_eq!((a.len(), b.len()), (BATCH_SERIES, 5));
        for (i, (r, k)) in a.iter().chain(&b).enumerate() {
            assert_eq!((*r, k), (i as u32 * 3, &keys[i]));
        }
        // The same definitions as type 1 records take over 8x the bytes.
        let mut plain = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            encode_series(&mut plain, i as u32 * 3, k);
        }
        assert!(
            plain.len() > 8 * buf.len(),
            "{} vs {}",
            plain.len(),
            buf.len()
        );
        // No series, no record.
        let mut none = Vec::new();
        encode_series_batches(&mut none, std::iter::empty());
        assert!(none.is_empty());
    }

    /// The decompressed payload of a batch is `uvarint n` and `n` type 1
    /// payloads, byte for byte (the frame's own bytes depend on zstd).
    #[test]
    fn a_series_batch_holds_type_1_payloads() {
        let key = SeriesKey::new("m", vec![Label::new("gpu", "0")]).unwrap();
        let mut buf = Vec::new();
        encode_series_batches(&mut buf, [(7, &key), (9, &key)].into_iter());
        assert_eq!(buf[8], TYPE_SERIES_BATCH);
        let one = [7u8, 1, b'm', 1, 3, b'g', b'p', b'u', 1, b'0'];
        let mut want = vec![2u8];
        want.extend_from_slice(&one);
        want.extend_from_slice(&one);
        want[11] = 9;
        assert_eq!(buf[9], want.len() as u8); // uvarint raw length
        assert_eq!(zstd::decode_all(&buf[10..]).unwrap(), want);
    }

    #[test]
    fn a_forged_series_batch_is_refused() {
        let key = SeriesKey::new("m", vec![Label::new("gpu", "0")]).unwrap();
        let one = [7u8, 1, b'm', 1, 3, b'g', b'p', b'u', 1, b'0'];
        let framed = |raw: &[u8]| {
            let mut b = Vec::new();
            frame(&mut b, TYPE_SERIES_BATCH, |b| {
                crate::codec::put_zstd_section(b, raw)
            });
            b
        };
        // Well formed, for reference.
        let mut raw = vec![1u8];
        raw.extend_from_slice(&one);
        assert_eq!(
            decode(&framed(&raw)).unwrap().0,
            Record::SeriesBatch(vec![(7, key)])
        );
        // A count above what follows, bytes after the last series, a count
        // over the batch limit, an invalid series, a payload that is no frame.
        let mut more = raw.clone();
        more[0] = 2;
        let mut trailing = raw.clone();
        trailing.push(0);
        let mut over = Vec::new();
        put_uvarint(&mut over, BATCH_SERIES as u64 + 1);
        for _ in 0..=BATCH_SERIES {
            over.extend_from_slice(&one);
        }
        let unnamed = [1u8, 7, 0, 0];
        for bad in [&more[..], &trailing, &over, &unnamed] {
            assert_eq!(decode(&framed(bad)), Err(Bad::Payload));
        }
        let mut b = Vec::new();
        frame(&mut b, TYPE_SERIES_BATCH, |b| b.extend_from_slice(&raw));
        assert_eq!(decode(&b), Err(Bad::Payload));
    }

    /// `fuzz/seeds/wal_record/series-batch` was written by the zstd command
    /// line tool from the format's description (type 4, then the payload);
    /// framed, it decodes as the three definitions it was made from.
    #[test]
    fn the_fuzz_seed_from_another_encoder_decodes() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/seeds/wal_record/series-batch");
        let body = std::fs::read(path).unwrap();
        let mut b = Vec::new();
        b.extend_from_slice(&(body.len() as u32).to_le_bytes());
        b.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        b.extend_from_slice(&body);
        let Ok((Record::SeriesBatch(series), _)) = decode(&b) else {
            panic!("the seed does not decode as a series batch")
        };
        let want: Vec<(u32, SeriesKey)> = (0..3u32)
            .map(|i| {
                let labels = vec![
                    Label::new("Hostname", "host-00001"),
                    Label::new("gpu", i.to_string()),
                ];
                (i, SeriesKey::new("DCGM_FI_DEV_GPU_TEMP", labels).unwrap())
            })
            .collect();
        assert_eq!(series, want);
    }
}
