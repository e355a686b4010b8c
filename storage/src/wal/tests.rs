use super::*;
use crate::series::{Label, SeriesKey};

fn key(i: u32) -> SeriesKey {
    SeriesKey::new("m", vec![Label::new("gpu", i.to_string())]).unwrap()
}

/// Writes two segments of records: series 0..3, then sample batches.
/// Returns the records in order and the byte offset where each starts.
fn write_log(dir: &Path) -> Vec<Record> {
    let mut checkpoint = Vec::new();
    record::encode_series(&mut checkpoint, 0, &key(0));
    let wal = Wal::start(dir, 1, &checkpoint, SyncPolicy::Fsync, 120).unwrap();
    let mut want = vec![Record::Series {
        wal_ref: 0,
        key: key(0),
    }];
    for i in 1..3u32 {
        let mut b = Vec::new();
        record::encode_series(&mut b, i, &key(i));
        wal.write(b).unwrap();
        want.push(Record::Series {
            wal_ref: i,
            key: key(i),
        });
    }
    for k in 0..6i64 {
        let (refs, ts, vals) = (
            vec![0, 1, 2],
            vec![k * 1000; 3],
            vec![k as f64, -(k as f64), f64::NAN],
        );
        let mut b = Vec::new();
        record::encode_samples(&mut b, &refs, &ts, &vals);
        wal.write(b).unwrap();
        want.push(Record::Samples {
            refs,
            ts_ms: ts,
            values: vals,
        });
    }
    want
}

fn replay_all(dir: &Path) -> (ReplayReport, Vec<Record>) {
    let mut got = Vec::new();
    let report = replay(dir, 0, |_, r| got.push(r)).unwrap();
    (report, got)
}

/// NaN != NaN, so compare records through their encoding.
fn same(a: &[Record], b: &[Record]) -> bool {
    let enc = |rs: &[Record]| {
        let mut buf = Vec::new();
        for r in rs {
            match r {
                Record::Series { wal_ref, key } => record::encode_series(&mut buf, *wal_ref, key),
                Record::Samples {
                    refs,
                    ts_ms,
                    values,
                } => record::encode_samples(&mut buf, refs, ts_ms, values),
                Record::Mark { producer, seq } => record::encode_mark(&mut buf, producer, *seq),
            }
        }
        buf
    };
    enc(a) == enc(b)
}

#[test]
fn replays_everything_across_segments() {
    let dir = tempfile::tempdir().unwrap();
    let want = write_log(dir.path());
    let (report, got) = replay_all(dir.path());
    assert!(
        report.segments >= 3,
        "the 120-byte limit must have rotated segments"
    );
    assert!(report.torn_tail.is_none() && report.corruption.is_empty());
    assert!(same(&got, &want));
}

#[test]
fn truncation_at_every_offset_of_the_last_segment_keeps_the_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let want = write_log(dir.path());
    let wal_dir = dir.path().join(WAL_DIR);
    let segs = list_segments(&wal_dir).unwrap();
    let (_, last) = segs.last().unwrap().clone();
    let full = fs::read(&last).unwrap();
    // Records in the earlier segments.
    let (_, all) = replay_all(dir.path());
    assert!(same(&all, &want));
    let mut before_last = 0;
    {
        let tmp = tempfile::tempdir().unwrap();
        fs::create_dir_all(tmp.path().join(WAL_DIR)).unwrap();
        for (_, p) in &segs[..segs.len() - 1] {
            fs::copy(p, tmp.path().join(WAL_DIR).join(p.file_name().unwrap())).unwrap();
        }
        before_last = replay_all(tmp.path()).1.len().max(before_last);
    }
    for cut in 0..full.len() {
        fs::write(&last, &full[..cut]).unwrap();
        let (report, got) = replay_all(dir.path());
        assert!(
            report.corruption.is_empty(),
            "cut {cut}: {:?}",
            report.corruption
        );
        // A prefix of what was written, and everything before the last segment.
        assert!(
            got.len() >= before_last && same(&got, &want[..got.len()]),
            "cut {cut}"
        );
        let at_boundary = cut >= HEADER_LEN && report.torn_tail.is_none();
        if !at_boundary {
            let t = report.torn_tail.as_ref().expect("torn tail reported");
            assert!(t.offset <= cut as u64);
        }
        // The torn part is gone: a second replay is clean.
        let (again, got2) = replay_all(dir.path());
        assert!(
            again.torn_tail.is_none() && again.corruption.is_empty(),
            "cut {cut}"
        );
        assert_eq!(got2.len(), got.len());
        fs::write(&last, &full).unwrap();
    }
}

#[test]
fn corruption_in_an_earlier_segment_is_located_and_later_segments_replay() {
    let dir = tempfile::tempdir().unwrap();
    write_log(dir.path());
    let segs = list_segments(&dir.path().join(WAL_DIR)).unwrap();
    assert!(segs.len() >= 3);
    let (_, first) = &segs[0];
    let orig = fs::read(first).unwrap();
    for i in 0..orig.len() {
        let mut b = orig.clone();
        b[i] ^= 0x04;
        fs::write(first, &b).unwrap();
        let (report, got) = replay_all(dir.path());
        assert_eq!(report.corruption.len(), 1, "flip in byte {i}");
        let c = &report.corruption[0];
        assert_eq!(&c.path, first);
        assert!(c.offset <= i as u64, "byte {i} reported at {}", c.offset);
        // The later segments still replay.
        assert!(!got.is_empty());
    }
    fs::write(first, &orig).unwrap();
}

#[test]
fn truncate_keeps_the_open_segment() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::start(dir.path(), 1, &[], SyncPolicy::Os, 1 << 20).unwrap();
    let cut = wal.cut(Vec::new()).unwrap();
    assert_eq!(cut, 2);
    assert_eq!(wal.truncate(cut).unwrap(), 1);
    assert_eq!(wal.truncate(u64::MAX).unwrap(), 0, "the open segment stays");
    drop(wal);
    assert_eq!(list_segments(&dir.path().join(WAL_DIR)).unwrap().len(), 1);
}

/// An earlier segment cut short (a lost tail that is not at the end of the
/// log) is corruption: located, the good prefix kept, later segments replayed.
#[test]
fn truncation_of_an_earlier_segment_is_located_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let want = write_log(dir.path());
    let segs = list_segments(&dir.path().join(WAL_DIR)).unwrap();
    let (_, first) = &segs[0];
    let orig = fs::read(first).unwrap();
    let in_first = {
        let mut n = 0;
        let mut pos = HEADER_LEN;
        while let Ok((_, len)) = record::decode(&orig[pos..]) {
            pos += len;
            n += 1;
        }
        n
    };
    for cut in 0..orig.len() {
        fs::write(first, &orig[..cut]).unwrap();
        let (report, got) = replay_all(dir.path());
        if cut < orig.len() && !report.corruption.is_empty() {
            let c = &report.corruption[0];
            assert_eq!(&c.path, first);
            assert!(c.offset <= cut as u64, "cut {cut} reported at {}", c.offset);
        }
        // Records of later segments always replay.
        let kept_first = got.len() - (want.len() - in_first);
        assert!(kept_first <= in_first, "cut {cut}");
        assert!(
            same(&got[..kept_first], &want[..kept_first]),
            "cut {cut}: not a prefix"
        );
        assert!(
            same(&got[kept_first..], &want[in_first..]),
            "cut {cut}: later segments differ"
        );
        fs::write(first, &orig).unwrap();
    }
}
