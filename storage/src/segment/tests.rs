use super::*;
use crate::head::Head;
use crate::segment::writer::write_segment;

/// Three series, 250 samples each, chunks of 100: known values to check against.
fn sample_head() -> Head {
    let mut h = Head::new(100, 100, 0);
    for g in 0..3 {
        let key = SeriesKey::new(
            "DCGM_FI_DEV_GPU_TEMP",
            vec![
                Label::new("gpu", g.to_string()),
                Label::new("Hostname", "h0"),
            ],
        )
        .unwrap();
        let r = h.get_or_create(key).unwrap();
        for i in 0..250i64 {
            let a = h.append(r, 1_700_000_000_000 + i * 1000, (g * 1000 + i) as f64);
            assert_eq!(a, crate::head::Appended::InOrder);
        }
    }
    let key = SeriesKey::new("DCGM_FI_DEV_POWER_USAGE", vec![Label::new("gpu", "0")]).unwrap();
    let r = h.get_or_create(key).unwrap();
    assert_eq!(h.append(r, 5, f64::NAN), crate::head::Appended::InOrder);
    h
}

fn write(dir: &Path) -> PathBuf {
    let frozen = sample_head().freeze();
    let dst = dir.join("a.gseg");
    let keys: Vec<KeyArc> = frozen.iter().map(|(k, _)| k.clone()).collect();
    let s = write_segment(&dir.join("a.tmp"), &dst, (7, 7), 3, &keys, |i, ts, vals| {
        for c in &frozen[i].1 {
            c.decode_into(ts, vals).unwrap();
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(s.series, 4);
    assert_eq!(s.samples, 751);
    assert_eq!((s.min_ts, s.max_ts), (5, 1_700_000_000_000 + 249_000));
    assert!(!dir.join("a.tmp").exists());
    dst
}

fn decode_series(seg: &Segment, ord: u32) -> Result<Vec<(i64, f64)>> {
    let (mut ts, mut vals) = (Vec::new(), Vec::new());
    for c in seg.chunks(ord) {
        seg.read_chunk(c, &mut ts, &mut vals)?;
    }
    Ok(ts.into_iter().zip(vals).collect())
}

#[test]
fn write_then_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let seg = Segment::open(&write(dir.path()), SegmentId(1)).unwrap();
    assert_eq!(seg.num_series(), 4);
    assert_eq!(seg.num_samples(), 751);

    let temp = seg.select(&[Matcher::equal("__name__", "DCGM_FI_DEV_GPU_TEMP")]);
    assert_eq!(temp.len(), 3);
    let g1 = seg.select(&[
        Matcher::equal("__name__", "DCGM_FI_DEV_GPU_TEMP"),
        Matcher::equal("gpu", "1"),
    ]);
    assert_eq!(g1.len(), 1);
    assert_eq!(seg.series_key(g1[0]).get("gpu"), Some("1"));
    // The head's three chunks of the series become one column chunk.
    assert_eq!(
        seg.chunks(g1[0])
            .iter()
            .map(|c| c.count)
            .collect::<Vec<_>>(),
        [250]
    );
    let got = decode_series(&seg, g1[0]).unwrap();
    let want: Vec<(i64, f64)> = (0..250i64)
        .map(|i| (1_700_000_000_000 + i * 1000, (1000 + i) as f64))
        .collect();
    assert_eq!(got, want);

    // != and absent labels: POWER_USAGE has no Hostname.
    let no_host = seg.select(&[Matcher::equal("Hostname", "")]);
    assert_eq!(no_host.len(), 1);
    let nan = decode_series(&seg, no_host[0]).unwrap();
    assert_eq!(nan.len(), 1);
    assert!(nan[0].1.is_nan());
    assert_eq!(seg.select(&[Matcher::not_equal("gpu", "0")]).len(), 2);
    // All four matcher types, postings and filters combined.
    let re = |n, p| Matcher::regex(n, p).unwrap();
    assert_eq!(
        seg.select(&[re("gpu", "1|2")]).len(),
        2,
        "two temperature series"
    );
    assert_eq!(
        seg.select(&[re("gpu", "1|2"), Matcher::not_regex("gpu", "2").unwrap()])
            .len(),
        1
    );
    assert_eq!(
        seg.select(&[re("__name__", ".*TEMP"), re("Hostname", "h.")])
            .len(),
        3
    );
    assert_eq!(
        seg.select(&[re("Hostname", "h")]).len(),
        0,
        "anchored: h does not match h0"
    );
    assert_eq!(
        seg.select(&[re("Hostname", ".*")]).len(),
        4,
        ".* also matches the absent label"
    );
    assert_eq!(
        seg.select(&[Matcher::not_regex("Hostname", ".+").unwrap()])
            .len(),
        1
    );
    assert!(seg.select(&[Matcher::equal("gpu", "9")]).is_empty());
}

/// Cutting the file anywhere is detected at open, with a located error.
#[test]
fn truncation_at_every_offset_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(write(dir.path())).unwrap();
    let p = dir.path().join("cut.gseg");
    for cut in 0..bytes.len() {
        std::fs::write(&p, &bytes[..cut]).unwrap();
        match Segment::open(&p, SegmentId(1)) {
            Err(Error::Corrupt { offset, .. }) => assert!(offset <= bytes.len() as u64),
            other => panic!("cut at {cut}: {other:?}"),
        }
    }
}

/// Flipping any bit is detected: at open, or when the chunk is decoded.
#[test]
fn bit_flips_are_detected() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(write(dir.path())).unwrap();
    let p = dir.path().join("flip.gseg");
    for i in 0..bytes.len() {
        for bit in [0u8, 3, 7] {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            std::fs::write(&p, &b).unwrap();
            let detected = match Segment::open(&p, SegmentId(1)) {
                Err(Error::Corrupt { .. }) => true,
                Err(e) => panic!("byte {i}: unexpected error {e}"),
                Ok(seg) => (0..seg.num_series() as u32).any(|o| decode_series(&seg, o).is_err()),
            };
            assert!(detected, "flip of bit {bit} in byte {i} went unnoticed");
        }
    }
}

#[test]
fn from_bytes_reads_what_open_reads() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(write(dir.path())).unwrap();
    let seg = Segment::from_bytes(&bytes).unwrap();
    assert_eq!((seg.num_series(), seg.num_samples()), (4, 751));
    assert!(matches!(
        Segment::from_bytes(&[]),
        Err(Error::Corrupt { offset: 0, .. })
    ));
    assert!(matches!(
        Segment::from_bytes(&bytes[..50]),
        Err(Error::Corrupt { .. })
    ));
}

/// The segment format is stable: the same content encodes to exactly the
/// committed file, which also seeds the `segment_open` fuzz target (random
/// bytes rarely pass the magic and checksums). After a deliberate format
/// change (a new VERSION), regenerate it with `GPULSE_BLESS=1`.
#[test]
fn encoding_matches_the_committed_golden_file() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(write(dir.path())).unwrap();
    let committed = crate::golden::check("segment_open", "golden.gseg", &bytes);
    // And the committed file reads back as what was written.
    let seg = Segment::from_bytes(&committed).unwrap();
    assert_eq!((seg.num_series(), seg.num_samples()), (4, 751));
}

/// Segments of the earlier versions still open and read back sample for
/// sample what the same content reads back as from a current file: v2
/// (`golden-v2.gseg`, before bit-packed columns), v3 (`golden-v3.gseg`,
/// before compressed index and postings), v4 (`golden-v4.gseg`, before
/// each chunk's last value) and v5 (`golden-v5.gseg`, before byte planes
/// and repeat masks), the golden files of those versions.
#[test]
fn earlier_versions_read_as_the_same_samples() {
    let dir = tempfile::tempdir().unwrap();
    let new = Segment::open(&write(dir.path()), SegmentId(1)).unwrap();
    for version in [2u32, 3, 4, 5] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(format!("../fuzz/seeds/segment_open/golden-v{version}.gseg"));
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(bytes[8..12], version.to_le_bytes());
        let old = Segment::from_bytes(&bytes).unwrap();
        assert_eq!(new.num_series(), old.num_series());
        for ord in 0..old.num_series() as u32 {
            assert_eq!(old.series_key(ord), new.series_key(ord));
            // Only version 5 on records the last values.
            if version < 5 {
                assert!(old.chunks(ord).iter().all(|c| c.last_value().is_none()));
            } else {
                assert_eq!(
                    old.chunks(ord)
                        .iter()
                        .map(|c| c.last_value().map(f64::to_bits))
                        .collect::<Vec<_>>(),
                    new.chunks(ord)
                        .iter()
                        .map(|c| c.last_value().map(f64::to_bits))
                        .collect::<Vec<_>>()
                );
            }
            let (a, b) = (
                decode_series(&old, ord).unwrap(),
                decode_series(&new, ord).unwrap(),
            );
            assert_eq!(a.len(), b.len());
            for ((ta, va), (tb, vb)) in a.iter().zip(&b) {
                assert_eq!((ta, va.to_bits()), (tb, vb.to_bits()));
            }
        }
        for (name, value) in [("gpu", "1"), ("__name__", "DCGM_FI_DEV_POWER_USAGE")] {
            let m = [Matcher::equal(name, value)];
            assert_eq!(
                old.select(&m),
                new.select(&m),
                "{name}={value} in v{version}"
            );
        }
    }
    // A version after this one is refused, with its number.
    let mut v7 = std::fs::read(write(dir.path())).unwrap();
    v7[8..12].copy_from_slice(&7u32.to_le_bytes());
    let crc = crc32c::crc32c(&v7[..12]);
    v7[12..16].copy_from_slice(&crc.to_le_bytes());
    assert!(matches!(
        Segment::from_bytes(&v7),
        Err(Error::Corrupt {
            offset: 8,
            kind: Corruption::UnsupportedVersion { version: 7 },
            ..
        })
    ));
}

/// Version 4 stores the index and the postings as `uvarint raw length` and
/// one zstd frame (magic 0xFD2FB528, little-endian): read from the footer's
/// offsets, independently of the reader.
#[test]
fn index_and_postings_are_one_zstd_frame_each() {
    let dir = tempfile::tempdir().unwrap();
    let b = std::fs::read(write(dir.path())).unwrap();
    let footer = &b[b.len() - FOOTER_LEN..];
    let at = |i: usize| u64::from_le_bytes(footer[i * 8..i * 8 + 8].try_into().unwrap()) as usize;
    for (off, len) in [(at(0), at(1)), (at(2), at(3))] {
        let s = &b[off..off + len];
        let n = s.iter().position(|&x| x & 0x80 == 0).unwrap() + 1;
        assert_eq!(s[n..n + 4], [0x28, 0xb5, 0x2f, 0xfd]);
        let raw = zstd::decode_all(&s[n..]).unwrap();
        let mut declared = 0u64;
        for (i, x) in s[..n].iter().enumerate() {
            declared |= u64::from(x & 0x7f) << (7 * i);
        }
        assert_eq!(raw.len() as u64, declared);
    }
}

/// Each chunk's index entry records its newest sample's value, bit for bit
/// (a NaN too): the sample head's last values, and what the value block
/// decodes to at `max_ts`.
#[test]
fn chunks_record_their_last_value() {
    let dir = tempfile::tempdir().unwrap();
    let seg = Segment::open(&write(dir.path()), SegmentId(1)).unwrap();
    let mut lasts = Vec::new();
    for ord in 0..seg.num_series() as u32 {
        for c in seg.chunks(ord) {
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            seg.read_chunk(c, &mut ts, &mut vs).unwrap();
            assert_eq!(ts.last(), Some(&c.max_ts));
            let last = c.last_value().unwrap();
            assert_eq!(last.to_bits(), vs.last().unwrap().to_bits());
            lasts.push(last.to_bits());
        }
    }
    let expected: Vec<u64> = [249.0, 1249.0, 2249.0, f64::NAN]
        .iter()
        .map(|v: &f64| v.to_bits())
        .collect();
    assert_eq!(lasts, expected);
}

/// Series that share a timestamp block read their own timestamps whatever
/// was read before on the thread: the same block again (served from the
/// thread's copy), another block of the same length, or the same offsets
/// in another segment (same layout, timestamps one ms later).
#[test]
fn shared_timestamp_blocks_read_back_after_any_other_read() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<KeyArc> = (0..4)
        .map(|i| KeyArc::new(SeriesKey::new("m", vec![Label::new("gpu", i.to_string())]).unwrap()))
        .collect();
    // Series 0, 1 and 3 share timestamps `a`; series 2 has `b`, as many.
    let a: Vec<i64> = (0..300).map(|i| 1_000_000 + i * 10_000 + i % 7).collect();
    let b: Vec<i64> = (0..300).map(|i| 2_000_000 + i * 10_000 + i % 5).collect();
    let ts_of = |shift: i64, i: usize| -> Vec<i64> {
        let base = if i == 2 { &b } else { &a };
        base.iter().map(|t| t + shift).collect()
    };
    let vals_of = |i: usize| -> Vec<f64> { (0..300).map(|j| (i * 1000 + j) as f64).collect() };
    let write = |name: &str, shift: i64| {
        let dst = dir.path().join(format!("{name}.gseg"));
        write_segment(
            &dir.path().join(format!("{name}.tmp")),
            &dst,
            (1, 1),
            0,
            &keys,
            |i, ts, vals| {
                ts.extend(ts_of(shift, i));
                vals.extend(vals_of(i));
                Ok(())
            },
        )
        .unwrap();
        Segment::open(&dst, SegmentId(1)).unwrap()
    };
    let first = write("first", 0);
    let second = write("second", 1);
    // The block is shared in the file, so the cache is what is under test.
    let block_of = |seg: &Segment, ord: u32| seg.chunks(ord)[0].ts.offset;
    assert_eq!(block_of(&first, 0), block_of(&first, 1));
    assert_ne!(block_of(&first, 0), block_of(&first, 2));
    assert_eq!(block_of(&first, 0), block_of(&second, 0));
    for (seg, shift, ord) in [
        (&first, 0, 0),
        (&first, 0, 1),
        (&first, 0, 2),
        (&first, 0, 3),
        (&second, 1, 3),
        (&second, 1, 0),
        (&first, 0, 0),
        (&second, 1, 2),
        (&first, 0, 2),
    ] {
        let got = decode_series(seg, ord).unwrap();
        let want: Vec<(i64, f64)> = ts_of(shift, ord as usize)
            .into_iter()
            .zip(vals_of(ord as usize))
            .collect();
        assert_eq!(got, want, "segment shifted by {shift}, series {ord}");
    }
}

/// Parsing the index shares one copy of a metric name (and of a label set)
/// between the series that repeat it.
#[test]
fn parsed_keys_share_their_names() {
    let dir = tempfile::tempdir().unwrap();
    let seg = Segment::open(&write(dir.path()), SegmentId(1)).unwrap();
    let temp = seg.select(&[Matcher::equal("__name__", "DCGM_FI_DEV_GPU_TEMP")]);
    let names: Vec<Arc<String>> = temp
        .iter()
        .map(|&o| seg.series_key(o).parts().0.clone())
        .collect();
    assert_eq!(names.len(), 3);
    assert!(names.iter().all(|n| Arc::ptr_eq(n, &names[0])));
}

/// An index written by hand (no chunks): series that repeat a label set's
/// bytes or a metric name share one copy of it, their keys equal those built
/// from the strings, and a repeated set is still checked against its series
/// (an empty metric) while a bad one is refused where it first lies.
#[test]
fn parsed_label_sets_are_checked_once_and_shared() {
    use crate::codec::{put_str, put_uvarint};
    type Labels<'a> = &'a [(&'a str, &'a [u8])];
    fn series(out: &mut Vec<u8>, metric: &[u8], labels: Labels<'_>) {
        put_uvarint(out, metric.len() as u64);
        out.extend_from_slice(metric);
        put_uvarint(out, labels.len() as u64);
        for (name, value) in labels {
            put_str(out, name);
            put_uvarint(out, value.len() as u64);
            out.extend_from_slice(value);
        }
        put_uvarint(out, 0); // chunks
    }
    let index = |all: &[(&[u8], Labels<'_>)]| {
        let mut out = Vec::new();
        put_uvarint(&mut out, all.len() as u64);
        let mut starts = Vec::new();
        for (metric, labels) in all {
            starts.push(out.len() as u64);
            series(&mut out, metric, labels);
        }
        (out, starts)
    };
    let parse = |buf: &[u8], n: usize| parse_index(buf, 1000, 2000, n as u64, VERSION);
    let gpu0: Labels<'_> = &[("gpu", b"0"), ("Hostname", b"h0")];
    let (buf, _) = index(&[
        (b"temp", gpu0),
        (b"power", gpu0),
        (
            b"temp",
            &[("Hostname", b"h1"), ("gpu", b"0"), ("rack", b"")],
        ),
    ]);
    let (keys, starts, chunks) = parse(&buf, 3).unwrap();
    let want = |m: &str, host: &str| {
        SeriesKey::new(
            m,
            vec![Label::new("Hostname", host), Label::new("gpu", "0")],
        )
        .unwrap()
    };
    assert_eq!(
        keys,
        vec![want("temp", "h0"), want("power", "h0"), want("temp", "h1")]
    );
    assert_eq!((starts, chunks.len()), (vec![0, 0, 0, 0], 0));
    assert!(keys[0].parts().1.ptr_eq(keys[1].parts().1));
    assert!(Arc::ptr_eq(keys[0].parts().0, keys[2].parts().0));

    // An empty metric name, its labels those of a valid series before it.
    let (buf, at) = index(&[(b"temp", gpu0), (b"", gpu0)]);
    assert_eq!(
        parse(&buf, 2).unwrap_err(),
        (
            1000 + at[1],
            Corruption::BadSeries(InvalidSeries::EmptyMetric)
        )
    );
    // A label set named twice is refused at its first series, the next
    // one not reached.
    let twice: Labels<'_> = &[("gpu", b"0"), ("gpu", b"1")];
    let (buf, at) = index(&[(b"temp", gpu0), (b"temp", twice), (b"power", twice)]);
    assert_eq!(
        parse(&buf, 3).unwrap_err(),
        (
            1000 + at[1],
            Corruption::BadSeries(InvalidSeries::DuplicateLabel("gpu".into()))
        )
    );
    // A value that is not UTF-8: refused at its length's offset, the first
    // error in the bytes' order although a later length runs past the end.
    let (mut buf, at) = index(&[(b"temp", &[("gpu", b"\xff"), ("zz", b"abc")])]);
    buf.truncate(buf.len() - 2);
    let value_at = at[0] + 1 + 4 + 1 + 1 + 3;
    assert_eq!(
        parse(&buf, 1).unwrap_err(),
        (1000 + value_at, Corruption::BadUtf8)
    );
}

/// Series encoded ahead by another thread ([`writer::EncodedSeries`]) make
/// the same file as the writer encoding them itself: whichever series are
/// handed over encoded (none, some, all), the bytes are those of the plain
/// writer, timestamp blocks shared across the two kinds included. A series
/// the writer would refuse is not encoded ahead.
#[test]
fn series_encoded_ahead_write_the_same_bytes() {
    use std::collections::HashSet;
    use writer::{EncodedSeries, write_segment_tmp_with};
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<KeyArc> = (0..12)
        .map(|i| {
            KeyArc::new(SeriesKey::new("m", vec![Label::new("gpu", format!("{i:02}"))]).unwrap())
        })
        .collect();
    // Several chunks a series (the last one short), timestamps shared by
    // every other series, values of several shapes.
    let n = MAX_CHUNK_SAMPLES * 2 + 17;
    let ts_of = |i: usize| -> Vec<i64> {
        (0..n as i64)
            .map(|j| 1_700_000_000_000 + j * 10_000 + (i % 2) as i64)
            .collect()
    };
    let vals_of = |i: usize| -> Vec<f64> {
        (0..n)
            .map(|j| match i % 3 {
                0 => (j % 50) as f64 * 0.25,
                1 => ((i * 7919 + j * 104_729) % 65_521) as f64,
                _ => (j as f64).sin(),
            })
            .collect()
    };
    let write = |name: &str, ahead: &dyn Fn(usize) -> bool| {
        let tmp = dir.path().join(format!("{name}.tmp"));
        let mut shared = HashSet::default();
        write_segment_tmp_with(&tmp, &tmp, (1, 1), 0, &keys, |i, ts, vals| {
            if ahead(i) {
                return Ok(Some(
                    EncodedSeries::encode(&ts_of(i), &vals_of(i), &mut shared).unwrap(),
                ));
            }
            ts.extend(ts_of(i));
            vals.extend(vals_of(i));
            Ok(None)
        })
        .unwrap();
        std::fs::read(&tmp).unwrap()
    };
    let plain = write("plain", &|_| false);
    assert_eq!(write("all", &|_| true), plain);
    assert_eq!(write("odd", &|i| i % 2 == 1), plain);
    assert_eq!(write("tail", &|i| i >= 7), plain);
    // Refused: not ascending, out of the storable range, lengths that differ.
    let mut shared = HashSet::default();
    assert!(EncodedSeries::encode(&[2, 1], &[0.0, 0.0], &mut shared).is_none());
    assert!(EncodedSeries::encode(&[i64::MAX], &[0.0], &mut shared).is_none());
    assert!(EncodedSeries::encode(&[1, 2], &[0.0], &mut shared).is_none());
}

/// The writer and a helper thread share out the series through
/// [`writer::Ahead`]: every series is taken exactly once, in order, the
/// helper's from the end, and a helper that dies with batches claimed but
/// not delivered leaves them to the writer instead of hanging it.
#[test]
fn ahead_shares_the_series_between_writer_and_helper() {
    use std::collections::HashSet;
    use writer::{Ahead, AheadHelper, EncodedSeries};
    let encoded = |i: usize| {
        let mut shared = HashSet::default();
        EncodedSeries::encode(&[i as i64 + 1], &[i as f64], &mut shared).unwrap()
    };
    for (n, deliver) in [(1_000, true), (1_000, false), (3, true), (0, true)] {
        let ahead = Ahead::new(n);
        let (own, claimed) = std::thread::scope(|s| {
            let helper = s.spawn(|| {
                let _guard = AheadHelper(&ahead);
                let mut claimed = Vec::new();
                while let Some(r) = ahead.claim(8) {
                    claimed.extend(r.clone());
                    if deliver {
                        ahead.deliver(r.start, r.clone().map(|i| Some(encoded(i))).collect());
                    } else if claimed.len() >= 16 {
                        // Dies with two batches claimed, none delivered.
                        return claimed;
                    }
                }
                claimed
            });
            let mut own = Vec::new();
            for i in 0..n {
                match ahead.take(i) {
                    Some(e) => {
                        assert_eq!(format!("{e:?}"), format!("{:?}", encoded(i)), "series {i}")
                    }
                    None => own.push(i),
                }
                if i % 64 == 0 {
                    std::thread::yield_now();
                }
            }
            (own, helper.join().unwrap())
        });
        let mut claimed = claimed;
        claimed.sort_unstable();
        if deliver {
            // The writer's and the helper's are all the series, once each,
            // the helper's a tail.
            let mut all: Vec<usize> = own.iter().chain(&claimed).copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..n).collect::<Vec<_>>(), "n = {n}");
            assert!(claimed.iter().all(|&i| i >= own.len()), "n = {n}");
        } else {
            assert_eq!(own, (0..n).collect::<Vec<_>>(), "n = {n}");
        }
    }
}
