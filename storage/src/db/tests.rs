use super::*;
use crate::SegmentId;
use crate::error::Error;
use crate::files::{QUARANTINE_DIR, SEGMENTS_DIR};
use crate::head::SeriesRef;
use crate::series::{Label, Matcher};
use crate::wal;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::Ordering::Relaxed;

fn key(metric: &str, gpu: u32) -> SeriesKey {
    SeriesKey::new(metric, vec![Label::new("gpu", gpu.to_string())]).unwrap()
}

fn read(s: &SelectedSeries) -> Vec<(i64, f64)> {
    read_range(s, i64::MIN, i64::MAX)
}

fn read_range(s: &SelectedSeries, lo: i64, hi: i64) -> Vec<(i64, f64)> {
    let (mut t, mut v) = (Vec::new(), Vec::new());
    s.read_into(lo, hi, &mut t, &mut v).unwrap();
    t.into_iter().zip(v).collect()
}

/// Appends `n` samples at 1 s spacing starting at `t0` to metric m/gpu.
fn fill(st: &Storage, metric: &str, gpu: u32, t0: i64, n: i64) -> Vec<(i64, f64)> {
    let r = st.series_ref(key(metric, gpu)).unwrap();
    let samples: Vec<(i64, f64)> = (0..n)
        .map(|i| (t0 + i * 1000, (gpu as i64 * 100 + i) as f64 / 4.0))
        .collect();
    let ts: Vec<i64> = samples.iter().map(|s| s.0).collect();
    let vs: Vec<f64> = samples.iter().map(|s| s.1).collect();
    let out = st.append(&vec![r; ts.len()], &ts, &vs).unwrap();
    assert_eq!(out.accepted as i64, n);
    samples
}

#[test]
fn head_segments_and_reopen_answer_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.max_chunk_samples = 16;
    cfg.ooo_window = std::time::Duration::from_secs(60);
    let st = Storage::open(cfg.clone()).unwrap();
    let mut want = fill(&st, "temp", 0, 0, 50);
    st.flush().unwrap().expect("segment written");
    want.extend(fill(&st, "temp", 0, 50_000, 30));
    fill(&st, "power", 0, 0, 10);

    // Head + segment, merged in time order.
    let sel = st.select(&[Matcher::equal("__name__", "temp")], i64::MIN, i64::MAX);
    assert_eq!(sel.len(), 1);
    assert_eq!(read(&sel[0]), want);

    // A time range cuts inside chunks.
    let sel = st.select(&[Matcher::equal("__name__", "temp")], 10_000, 59_999);
    let got = read_range(&sel[0], 10_000, 59_999);
    assert_eq!(got.first().unwrap().0, 10_000);
    assert_eq!(got.last().unwrap().0, 59_000);
    assert_eq!(got.len(), 50);

    // The newest sample is at 79 s and the window is 60 s: 79 s again is a
    // duplicate, 10 ms is too old, 40.5 s is stored out of order (inside the
    // range already flushed), and 30 s is a duplicate of the flushed 30 s
    // sample: the first write wins. (Before rollups the head stored it and
    // readers hid it; now it is dropped, so rollups never count it.)
    let r = st.series_ref(key("temp", 0)).unwrap();
    let out = st
        .append(
            &[r, r, r, r, r],
            &[79_000, 10, 80_000, 40_500, 30_000],
            &[0.0, 0.0, 1.0, 0.5, 99.0],
        )
        .unwrap();
    assert_eq!(
        out,
        AppendOutcome {
            accepted: 2,
            out_of_order: 1,
            duplicates: 2,
            too_old: 1,
            duplicate_batch: false,
        }
    );
    want.push((40_500, 0.5));
    want.push((80_000, 1.0));
    want.sort_by_key(|s| s.0);
    let sel = st.select(&[Matcher::equal("__name__", "temp")], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want, "head view");

    st.flush().unwrap().expect("second segment");
    assert_eq!(st.flush().unwrap(), None, "nothing left to flush");
    drop(st);

    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.stats().segments, 2);
    let sel = st.select(&[Matcher::equal("__name__", "temp")], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want);
    let all = st.select(&[], i64::MIN, i64::MAX);
    assert_eq!(all.len(), 2);
}

/// `series_refs_with_keys` hands out the head's own key, for a new series
/// and for one the head has, so that a caller keeping keys shares them.
#[test]
fn series_refs_share_the_heads_keys() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    let first = st
        .series_refs_with_keys(vec![key("temp", 0), key("temp", 1)])
        .unwrap();
    let again = st
        .series_refs_with_keys(vec![key("temp", 1), key("temp", 0)])
        .unwrap();
    assert_eq!((first[0].0, first[1].0), (again[1].0, again[0].0));
    assert_ne!(first[0].0, first[1].0);
    assert_eq!(*first[0].1, key("temp", 0));
    assert!(KeyArc::ptr_eq(&first[0].1, &again[1].1));
    assert!(KeyArc::ptr_eq(&first[1].1, &again[0].1));
    let head = st.head.read().unwrap();
    assert!(KeyArc::ptr_eq(&first[0].1, head.key_arc(first[0].0)));
}

/// A head chunk that does not decode fails the flush with a located error
/// and is counted, whichever thread decodes it; it neither hangs the flush
/// (the rollup thread, encoding the segment's last series ahead of its
/// writer, leaves a series it cannot decode to the writer, which reports
/// it) nor loses the other series.
#[test]
fn a_head_chunk_that_does_not_decode_fails_the_flush_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.max_chunk_samples = 4;
    let st = Storage::open(cfg).unwrap();
    // Many good series before and after the bad one in key order (gpu
    // "1000" sorts between "100" and "101"): more than the queue holds.
    let good: Vec<Vec<(i64, f64)>> = (0..300).map(|g| fill(&st, "temp", g, 1_000, 10)).collect();
    let bad = st.series_ref(key("temp", 1000)).unwrap();
    for i in 0..10 {
        st.append(&[bad], &[1_000 + i * 1000], &[i as f64]).unwrap();
    }
    st.head.write().unwrap().corrupt_sealed_chunks(bad);
    let e = st.flush().unwrap_err();
    assert!(
        matches!(&e, Error::ChunkDecode { series, .. } if series.contains("\"1000\"")),
        "{e}"
    );
    assert_eq!(st.metrics.chunk_read_errors.load(Relaxed), 1);
    for (g, want) in good.iter().enumerate() {
        let sel = st.select(
            &[
                Matcher::equal("gpu", g.to_string()),
                Matcher::equal("__name__", "temp"),
            ],
            i64::MIN,
            i64::MAX,
        );
        assert_eq!(read(&sel[0]), *want, "gpu {g}");
    }
}

#[test]
fn bad_batches_are_rejected_whole() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    let r = st.series_ref(key("m", 0)).unwrap();
    assert!(matches!(
        st.append(&[r], &[1, 2], &[0.0]),
        Err(Error::BadBatch { .. })
    ));
    assert!(matches!(
        st.append(&[r, SeriesRef(99)], &[1, 2], &[0.0, 0.0]),
        Err(Error::BadBatch { .. })
    ));
    assert!(st.select(&[], i64::MIN, i64::MAX).is_empty());
}

#[test]
fn corrupt_segment_is_quarantined_and_the_rest_served() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StorageConfig::new(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    fill(&st, "a", 0, 0, 10);
    st.flush().unwrap();
    let want_b = fill(&st, "b", 1, 0, 10);
    st.flush().unwrap();
    drop(st);

    // Damage the first segment's footer magic; leave a stray tmp file too.
    let first = files::segment_path(dir.path(), SegmentId(1));
    let mut bytes = fs::read(&first).unwrap();
    let n = bytes.len();
    bytes[n - 1] ^= 0xff;
    fs::write(&first, bytes).unwrap();
    fs::write(
        files::segment_tmp_path(dir.path(), SegmentId(9)),
        b"partial",
    )
    .unwrap();

    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.metrics().segments_quarantined.load(Relaxed), 1);
    assert!(
        dir.path()
            .join(QUARANTINE_DIR)
            .join(files::segment_file_name(SegmentId(1)))
            .exists()
    );
    assert!(!files::segment_tmp_path(dir.path(), SegmentId(9)).exists());
    let sel = st.select(&[], i64::MIN, i64::MAX);
    assert_eq!(sel.len(), 1);
    assert_eq!(read(&sel[0]), want_b);
    // New segments never reuse a quarantined id.
    fill(&st, "c", 2, 0, 1);
    st.flush().unwrap();
    assert!(files::segment_path(dir.path(), SegmentId(3)).exists());
}

/// Appends without a flush are replayed from the WAL by the next open.
#[test]
fn unflushed_appends_survive_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StorageConfig::new(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let a = fill(&st, "a", 0, 0, 30);
    st.flush().unwrap();
    let mut a2 = a.clone();
    a2.extend(fill(&st, "a", 0, 30_000, 5));
    let b = fill(&st, "b", 1, 0, 7);
    drop(st); // no flush: only the WAL has the last samples

    let st = Storage::open(cfg.clone()).unwrap();
    assert_eq!(st.metrics().wal_replayed_samples.load(Relaxed), 12);
    let sel = st.select(&[], i64::MIN, i64::MAX);
    assert_eq!(sel.len(), 2);
    assert_eq!(read(&sel[0]), a2);
    assert_eq!(read(&sel[1]), b);
    // New samples after the replay go on from where the series stopped.
    let more = fill(&st, "b", 1, 7_000, 3);
    drop(st);
    let st = Storage::open(cfg).unwrap();
    let sel = st.select(&[Matcher::equal("__name__", "b")], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), [b, more].concat());
}

/// A crash after a flush wrote its segment but before the WAL was truncated
/// must not store the flushed samples twice.
#[test]
fn flushed_samples_left_in_the_wal_are_not_duplicated() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StorageConfig::new(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let want = fill(&st, "a", 0, 0, 20);
    let wal_copy = tempfile::tempdir().unwrap();
    let wal_dir = dir.path().join(files::WAL_DIR);
    for e in fs::read_dir(&wal_dir).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), wal_copy.path().join(e.file_name())).unwrap();
    }
    st.flush().unwrap();
    drop(st);
    // Put the pre-flush WAL back, as if the truncation never happened.
    for e in fs::read_dir(wal_copy.path()).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), wal_dir.join(e.file_name())).unwrap();
    }
    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.metrics().wal_replayed_samples.load(Relaxed), 0);
    let sel = st.select(&[], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want);
}

#[test]
fn a_data_dir_is_opened_by_one_storage_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    assert!(matches!(
        Storage::open(StorageConfig::new(dir.path())),
        Err(Error::Locked { .. })
    ));
    drop(st);
    Storage::open(StorageConfig::new(dir.path())).unwrap();
}

fn segment_files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir.join(SEGMENTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn compaction_merges_a_finished_window_and_survives_a_crash_midway() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.compaction_window = std::time::Duration::from_secs(100);
    let st = Storage::open(cfg.clone()).unwrap();
    let mut want_a = Vec::new();
    let mut want_b = Vec::new();
    // Four flushes inside the first 100 s window, one in the next.
    for k in 0..4 {
        want_a.extend(fill(&st, "a", 0, k * 20_000, 20));
        want_b.extend(fill(&st, "b", 1, k * 20_000, 20));
        st.flush().unwrap();
    }
    fill(&st, "a", 0, 100_000, 5);
    st.flush().unwrap();
    assert_eq!(segment_files(dir.path()).len(), 5);
    // Keep a source's bytes, to fake a crash before the sources were deleted.
    let first_source = files::segment_path(dir.path(), SegmentId(1));
    let source_bytes = fs::read(&first_source).unwrap();

    let summary = st.compact().unwrap().expect("one window to merge");
    assert_eq!(summary.samples, 160);
    assert_eq!(st.compact().unwrap(), None, "nothing left to merge");
    assert_eq!(segment_files(dir.path()).len(), 2, "sources deleted");
    let sel = st.select(&[Matcher::equal("__name__", "b")], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want_b);
    let sel = st.select(&[Matcher::equal("__name__", "a")], i64::MIN, 99_999);
    assert_eq!(read_range(&sel[0], i64::MIN, 99_999), want_a);
    drop(st);

    fs::write(&first_source, source_bytes).unwrap();
    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.stats().segments, 2, "the leftover source is not served");
    let sel = st.select(&[Matcher::equal("__name__", "b")], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want_b, "no duplicates after the leftover");
    drop(sel);
    drop(st);
    assert!(!first_source.exists(), "the leftover source was deleted");
}

/// A window still open merges its flushes eight at a time, in tiers: 20
/// flushes, each followed by compaction as upkeep does, leave two merges of
/// eight and the last four flushes; 64 more make the eight tier-1 merges
/// one of tier 2. Every sample is read back once, also after a reopen.
#[test]
fn an_open_window_merges_its_flushes_eight_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.compaction_window = std::time::Duration::from_secs(100 * 86_400);
    let st = Storage::open(cfg.clone()).unwrap();
    let mut want = Vec::new();
    let mut flush = |st: &Storage, k: i64| {
        want.extend(fill(st, "a", 0, k * 10_000, 10));
        st.flush().unwrap().expect("a segment");
        while st.compact().unwrap().is_some() {}
    };
    for k in 0..20 {
        flush(&st, k);
    }
    let spans = |st: &Storage| -> Vec<u64> {
        let state = lock!(st.state.read());
        let spans = state.segments.iter().map(|s| {
            let (a, b) = s.seq_range();
            b - a + 1
        });
        spans.collect()
    };
    // Ids 1-8 merge as 9, 10-17 as 18, then 19-22 stay.
    assert_eq!(spans(&st), [8, 8, 1, 1, 1, 1]);
    for k in 20..84 {
        flush(&st, k);
    }
    // 84 flushes: one tier-2 merge of 8 x 8 (and the seven merges' ids in
    // between), two tier-1 merges, four flushes.
    let got = spans(&st);
    assert_eq!(got.len(), 7, "{got:?}");
    assert_eq!(got[0], 71, "{got:?}");
    assert_eq!(&got[1..], [8, 8, 1, 1, 1, 1]);
    let sel = st.select(&[Matcher::equal("__name__", "a")], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want);
    drop((sel, st));
    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.stats().segments, 7);
    let sel = st.select(&[Matcher::equal("__name__", "a")], i64::MIN, i64::MAX);
    assert_eq!(
        read(&sel[0]),
        want,
        "no sample lost or doubled after a reopen"
    );
}

#[test]
fn retention_deletes_expired_segments_after_their_last_reader() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = Some(std::time::Duration::from_secs(60));
    let st = Storage::open(cfg).unwrap();
    let old = fill(&st, "a", 0, 0, 10);
    st.flush().unwrap();
    let new = fill(&st, "a", 0, 1_000_000, 10);
    st.flush().unwrap();
    let held = st.select(&[], i64::MIN, i64::MAX);
    // At t = 1,000,000 + 60 s, only the first segment (newest sample at 9 s) is expired.
    assert_eq!(st.enforce_retention(1_060_000), 1);
    assert_eq!(st.stats().segments, 1);
    let expired = files::segment_path(dir.path(), SegmentId(1));
    assert!(expired.exists(), "a query still holds it");
    assert_eq!(
        read(&held[0]),
        [old, new.clone()].concat(),
        "and can still read it"
    );
    drop(held);
    assert!(!expired.exists(), "deleted once the query let go");
    let sel = st.select(&[], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), new);
}

/// An out-of-order sample acked after a flush, older than what was flushed,
/// must survive a crash (WAL replay), and later flushes and compaction must
/// neither lose nor duplicate it.
#[test]
fn out_of_order_samples_after_a_flush_survive_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.ooo_window = std::time::Duration::from_secs(60);
    cfg.compaction_window = std::time::Duration::from_secs(3600);
    let st = Storage::open(cfg.clone()).unwrap();
    let mut want = fill(&st, "a", 0, 0, 20);
    st.flush().unwrap();
    let r = st.series_ref(key("a", 0)).unwrap();
    let out = st.append(&[r, r], &[5_500, 3_000], &[7.0, 123.0]).unwrap();
    // 3_000 repeats the flushed sample at 3 s: a duplicate, the first write wins.
    assert_eq!((out.accepted, out.out_of_order, out.duplicates), (1, 1, 1));
    want.push((5_500, 7.0));
    want.sort_by_key(|s| s.0);
    drop(st); // crash

    let st = Storage::open(cfg.clone()).unwrap();
    assert_eq!(st.metrics().wal_replayed_samples.load(Relaxed), 1);
    let sel = st.select(&[], i64::MIN, i64::MAX);
    assert_eq!(read(&sel[0]), want);
    drop(sel);
    st.flush().unwrap();
    fill(&st, "a", 0, 4_000_000, 1); // a later window, so the first one is finished
    st.flush().unwrap();
    st.compact()
        .unwrap()
        .expect("two segments in the first window");
    drop(st);
    let st = Storage::open(cfg).unwrap();
    let sel = st.select(&[], i64::MIN, 3_999_999);
    assert_eq!(read_range(&sel[0], i64::MIN, 3_999_999), want);
}

#[test]
fn resent_batches_are_dropped_by_producer_seq_across_crash_and_flush() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StorageConfig::new(dir.path());
    let origin = |producer, seq| Some(BatchOrigin { producer, seq });
    // Every batch has fresh timestamps and values, so only the sequence
    // number can tell a re-send from new data.
    let mut t = 0i64;
    let mut batch = |st: &Storage, o: Option<BatchOrigin<'_>>| {
        let r = st.series_ref(key("temp", 0)).unwrap();
        t += 1000;
        st.append_from(o, &[r, r], &[t, t + 500], &[t as f64, 1.5])
            .unwrap()
    };
    let count = |st: &Storage| {
        let sel = st.select(&[Matcher::equal("__name__", "temp")], i64::MIN, i64::MAX);
        read(&sel[0]).len()
    };

    let st = Storage::open(cfg.clone()).unwrap();
    assert_eq!(batch(&st, origin("a/1", 1)).accepted, 2);
    assert_eq!(batch(&st, origin("a/1", 2)).accepted, 2);
    let dup = batch(&st, origin("a/1", 2));
    assert!(dup.duplicate_batch);
    assert_eq!(dup.accepted, 0);
    assert!(batch(&st, origin("a/1", 1)).duplicate_batch);
    // Another producer (or another epoch of the same agent) has its own numbers.
    assert_eq!(batch(&st, origin("a/2", 1)).accepted, 2);
    assert_eq!(batch(&st, None).accepted, 2);
    assert_eq!(count(&st), 8);
    assert_eq!(st.metrics().batches_duplicate.load(Relaxed), 2);

    // A crash: the marks come back from the WAL.
    drop(st);
    let st = Storage::open(cfg.clone()).unwrap();
    assert!(batch(&st, origin("a/1", 2)).duplicate_batch);
    assert!(batch(&st, origin("a/2", 1)).duplicate_batch);
    assert_eq!(count(&st), 8);

    // A flush deletes the WAL that held the marks; the checkpoint keeps them.
    st.flush().unwrap().expect("segment written");
    drop(st);
    let wal_files = wal::list_segments(&dir.path().join(files::WAL_DIR)).unwrap();
    assert_eq!(
        wal_files.len(),
        1,
        "only the post-flush WAL segment is left"
    );
    let st = Storage::open(cfg).unwrap();
    assert!(batch(&st, origin("a/1", 2)).duplicate_batch);
    assert_eq!(batch(&st, origin("a/1", 3)).accepted, 2);
    assert_eq!(count(&st), 10);
    assert_eq!(st.stats().producers, 2);
}

/// Appends with an origin and flushes at the same time: a flush reads every
/// producer for its checkpoint while appends hold theirs.
#[test]
fn flushes_and_deduplicated_appends_do_not_deadlock() {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let writers: Vec<_> = (0..2u32)
        .map(|w| {
            let (st, done) = (st.clone(), done_tx.clone());
            std::thread::spawn(move || {
                let r = st.series_ref(key("m", w)).unwrap();
                let producer = format!("w{w}/1");
                // Batches large enough that encoding one takes a while.
                const N: i64 = 2000;
                for seq in 1..=300u64 {
                    let origin = Some(BatchOrigin {
                        producer: &producer,
                        seq,
                    });
                    let ts: Vec<i64> = (0..N).map(|i| seq as i64 * N + i).collect();
                    let out = st
                        .append_from(origin, &vec![r; N as usize], &ts, &vec![1.5; N as usize])
                        .unwrap();
                    assert_eq!(out.accepted as i64, N);
                }
                done.send(()).unwrap();
            })
        })
        .collect();
    let flusher = {
        let st = st.clone();
        std::thread::spawn(move || {
            for _ in 0..300 {
                st.flush().unwrap();
            }
        })
    };
    for _ in 0..2 {
        done_rx
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("appends and flushes deadlocked");
    }
    for w in writers {
        w.join().unwrap();
    }
    flusher.join().unwrap();
}

/// Records what it is shown.
#[derive(Debug, Default)]
struct Recorder(Mutex<Vec<(u32, i64, f64)>>);

impl AppendObserver for Recorder {
    fn appended(&self, refs: &[SeriesRef], ts_ms: &[i64], values: &[f64]) {
        let mut seen = self.0.lock().unwrap();
        for i in 0..refs.len() {
            seen.push((refs[i].0, ts_ms[i], values[i]));
        }
    }
}

#[test]
fn the_observer_sees_stored_batches_but_not_refused_or_resent_ones() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    let rec = Arc::new(Recorder::default());
    st.set_observer(rec.clone()).unwrap();
    assert!(
        st.set_observer(Arc::new(Recorder::default())).is_err(),
        "once"
    );
    let a = st.series_ref(key("a", 0)).unwrap();
    let b = st.series_ref(key("b", 1)).unwrap();
    assert_eq!(
        st.head_series_key(b).unwrap().to_string(),
        key("b", 1).to_string()
    );
    assert!(st.head_series_key(SeriesRef(999)).is_none());
    let origin = BatchOrigin {
        producer: "agent/1",
        seq: 7,
    };
    st.append_from(Some(origin), &[a, b], &[1000, 1000], &[1.5, 2.5])
        .unwrap();
    // A re-send of seq 7 and a refused batch (unknown ref) are not shown.
    st.append_from(Some(origin), &[a], &[2000], &[9.0]).unwrap();
    assert!(st.append(&[SeriesRef(999)], &[3000], &[1.0]).is_err());
    // A sample the head drops as a duplicate is shown with its batch.
    st.append(&[a, a], &[1000, 4000], &[7.0, 4.0]).unwrap();
    assert_eq!(
        *rec.0.lock().unwrap(),
        vec![
            (a.0, 1000, 1.5),
            (b.0, 1000, 2.5),
            (a.0, 1000, 7.0),
            (a.0, 4000, 4.0)
        ]
    );
}

/// `newest` gives, for every range, the last sample of a merged read
/// (`select` + `read_into`) and of a model of what was accepted, with the
/// series spread over two segments, a flush in progress (a failed flush
/// leaves its data frozen) and the head, with out-of-order samples, chunks
/// sealed in the head and ranges that end in the past or between samples.
#[test]
fn newest_is_the_last_sample_of_a_merged_read() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.max_chunk_samples = 7;
    cfg.ooo_window = std::time::Duration::from_secs(3600);
    let st = Storage::open(cfg).unwrap();
    // series -> ts -> the value stored (the first write of a timestamp).
    let mut model: std::collections::BTreeMap<(u32, i64), f64> = Default::default();
    let mut lcg = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        lcg = lcg
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (lcg >> 33) % n
    };
    let mut t_now = [0i64; 5];
    let mut phase = |st: &Storage,
                     model: &mut std::collections::BTreeMap<_, _>,
                     next: &mut dyn FnMut(u64) -> u64| {
        for _ in 0..60 {
            let gpu = next(5) as u32;
            let r = st.series_ref(key("temp", gpu)).unwrap();
            // Mostly forward in 1-20 s steps, sometimes back by up to 5 min.
            let ts = if next(5) == 0 {
                (t_now[gpu as usize] - 1000 * next(300) as i64).max(0)
            } else {
                t_now[gpu as usize] += 1000 * (1 + next(20) as i64);
                t_now[gpu as usize]
            };
            let v = next(1000) as f64 / 8.0;
            let out = st.append(&[r], &[ts], &[v]).unwrap();
            if out.accepted == 1 {
                assert!(model.insert((gpu, ts), v).is_none(), "accepted a duplicate");
            }
        }
    };
    // Every range checked against a merged read and the model, at each
    // stage: segments alone (the head and the flush in progress empty, as
    // after a restart), then all four sources.
    let temp = [Matcher::equal("__name__", "temp")];
    let check = |st: &Storage,
                 model: &std::collections::BTreeMap<(u32, i64), f64>,
                 next: &mut dyn FnMut(u64) -> u64| {
        let end = *model.keys().map(|(_, t)| t).max().unwrap();
        let mut ranges = vec![(i64::MIN, i64::MAX), (0, end), (end - 300_000, end)];
        for _ in 0..200 {
            let lo = next(end as u64 + 1) as i64;
            ranges.push((lo, lo + next(400_000) as i64));
        }
        for (lo, hi) in ranges {
            let mut got: Vec<(String, i64, f64)> = st
                .newest(&temp, lo, hi)
                .into_iter()
                .map(|(k, n)| (k.to_string(), n.ts_ms, n.value))
                .collect();
            got.sort_by(|a, b| a.0.cmp(&b.0));
            let merged: Vec<(String, i64, f64)> = st
                .select(&temp, lo, hi)
                .iter()
                .filter_map(|s| {
                    let &(t, v) = read_range(s, lo, hi).last()?;
                    Some((s.key.to_string(), t, v))
                })
                .collect();
            assert_eq!(got, merged, "range [{lo}, {hi}]");
            let mut modelled: Vec<(String, i64, f64)> = (0..5)
                .filter_map(|gpu| {
                    let (&(_, t), &v) = model.range((gpu, lo)..=(gpu, hi)).next_back()?;
                    Some((key("temp", gpu).to_string(), t, v))
                })
                .collect();
            modelled.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(got, modelled, "range [{lo}, {hi}]");
            // The merged read itself, whole, against the model: chunks cut
            // by the range at either end or both are trimmed to it.
            let read: std::collections::BTreeMap<String, Vec<(i64, f64)>> = st
                .select(&temp, lo, hi)
                .iter()
                .map(|s| (s.key.to_string(), read_range(s, lo, hi)))
                .filter(|(_, samples)| !samples.is_empty())
                .collect();
            let want: std::collections::BTreeMap<String, Vec<(i64, f64)>> = (0..5)
                .map(|gpu| {
                    let samples = model
                        .range((gpu, lo)..=(gpu, hi))
                        .map(|(&(_, t), &v)| (t, v))
                        .collect::<Vec<_>>();
                    (key("temp", gpu).to_string(), samples)
                })
                .filter(|(_, samples)| !samples.is_empty())
                .collect();
            assert_eq!(read, want, "range [{lo}, {hi}]");
            // The same reads of the series `keep` accepts: those of the
            // whole reads, in every source.
            let keep = |k: &SeriesKey| matches!(k.get("gpu"), Some("1" | "3" | "4"));
            let kept =
                |k: &str| ["temp{gpu=\"1\"}", "temp{gpu=\"3\"}", "temp{gpu=\"4\"}"].contains(&k);
            let mut got_kept: Vec<(String, i64, f64)> = st
                .newest_where(&temp, lo, hi, &keep)
                .into_iter()
                .map(|(k, n)| (k.to_string(), n.ts_ms, n.value))
                .collect();
            got_kept.sort_by(|a, b| a.0.cmp(&b.0));
            got.retain(|(k, ..)| kept(k));
            assert_eq!(got_kept, got, "range [{lo}, {hi}]");
            let read_kept: std::collections::BTreeMap<String, Vec<(i64, f64)>> = st
                .select_where(&temp, lo, hi, &keep)
                .iter()
                .map(|s| (s.key.to_string(), read_range(s, lo, hi)))
                .filter(|(_, samples)| !samples.is_empty())
                .collect();
            let mut want = want;
            want.retain(|k, _| kept(k));
            assert_eq!(read_kept, want, "range [{lo}, {hi}]");
        }
    };
    phase(&st, &mut model, &mut next);
    st.flush().unwrap().expect("first segment");
    check(&st, &model, &mut next);
    phase(&st, &mut model, &mut next);
    st.flush().unwrap().expect("second segment");
    check(&st, &model, &mut next);
    phase(&st, &mut model, &mut next);
    st.faults.segment_open.store(1, Relaxed);
    st.flush().unwrap_err();
    phase(&st, &mut model, &mut next);
    assert!(
        lock!(st.state.read()).frozen.is_some(),
        "a flush in progress"
    );
    assert_eq!(st.stats().segments, 2);
    check(&st, &model, &mut next);
    assert_eq!(st.metrics.chunk_read_errors.load(Relaxed), 0);
}

/// The blockwise order check of `normalize` agrees with a pairwise one on
/// every prefix of ascending timestamps with one placed out of order or
/// repeated, across the blocks.
#[test]
fn the_order_check_agrees_with_a_pairwise_one() {
    let pairwise = |ts: &[i64]| ts.windows(2).all(|p| p[0] < p[1]);
    let ascending: Vec<i64> = (0..200).map(|i| i * 10).collect();
    for len in 0..ascending.len() {
        assert!(strictly_ascending(&ascending[..len]), "len {len}");
        for at in 1..len {
            for odd in [ascending[at - 1], ascending[at - 1] - 1] {
                let mut ts = ascending[..len].to_vec();
                ts[at] = odd;
                assert!(!pairwise(&ts));
                assert_eq!(strictly_ascending(&ts), pairwise(&ts), "len {len} at {at}");
            }
        }
    }
    // Timestamps far outside storage's range take the exact compare: the
    // differences of these overflow, and the ones near ±2^62 are at the
    // bounds of the fast check.
    let far = [
        (i64::MIN, i64::MAX, true),
        (i64::MAX, i64::MIN, false),
        (-(1 << 62) - 1, 1 << 62, true),
        ((1 << 62) - 1, 1 << 62, true),
        (1 << 62, (1 << 62) - 1, false),
        (-(1 << 62), (1 << 62) - 1, true),
        (i64::MAX - 1, i64::MAX, true),
        (i64::MIN, i64::MIN + 1, true),
        (i64::MIN + 1, i64::MIN, false),
        (5, 5, false),
        // Within the fast check's range before, far below after: the
        // difference wraps to a positive number.
        ((1 << 62) - 1, i64::MIN, false),
        ((1 << 62) - 1, i64::MIN + (1 << 62) - 2, false),
        // Steps at the fast check's largest and just past it.
        (0, 1 << 57, true),
        (0, (1 << 57) + 1, true),
        (-(1 << 62), i64::MAX, true),
    ];
    // Steps of one that wrap past i64::MAX: small steps, but no order.
    let wrapping: Vec<i64> = (i64::MAX - 100..=i64::MAX)
        .chain(i64::MIN..i64::MIN + 100)
        .collect();
    for from in [0, 40, 90] {
        assert!(!pairwise(&wrapping[from..]));
        assert!(!strictly_ascending(&wrapping[from..]), "from {from}");
    }
    // Steps of 2^57 that wrap once between a first or a last timestamp
    // within the fast check's range and one outside it.
    let big = 1i64 << 57;
    let into_range: Vec<i64> = [i64::MAX - 1, i64::MAX]
        .into_iter()
        .chain((0..=32).map(|k| i64::MIN + k * big))
        .collect();
    let out_of_range: Vec<i64> = (0..34)
        .map(|k| ((1i64 << 62) - 1).wrapping_add(k * big))
        .collect();
    for ts in [into_range, out_of_range] {
        assert!(!pairwise(&ts));
        assert!(!strictly_ascending(&ts), "{ts:?}");
    }
    for (x, y, want) in far {
        // Ascending by one before and after the pair, as many as fit in
        // i64, so that only the pair decides; the pair at the start, at the
        // end, and on either side of a block's end.
        let below = x.abs_diff(i64::MIN).min(200) as i64;
        let above = y.abs_diff(i64::MAX).min(200) as i64;
        for k in [0, 1, 62, 63, 64, 130].map(|k| k.min(below)) {
            for m in [0, 1, 70].map(|m| m.min(above)) {
                let ts: Vec<i64> = (0..k)
                    .map(|i| x - (k - i))
                    .chain([x, y])
                    .chain((1..=m).map(|i| y + i))
                    .collect();
                assert_eq!(pairwise(&ts), want, "{x} {y}, {k} before, {m} after");
                assert_eq!(
                    strictly_ascending(&ts),
                    want,
                    "{x} {y}, {k} before, {m} after"
                );
            }
        }
    }
}

/// The head and every open segment point at one copy of each series key
/// (`SharedKeys`): a series flushed twice is one key in memory, after a
/// reopen too, and the head's series is that same copy.
#[test]
fn segments_and_the_head_share_one_copy_of_each_key() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = StorageConfig::new(dir.path());
    let same_in_both = |st: &Storage| {
        let segments = lock!(st.state.read()).segments.clone();
        assert_eq!(segments.len(), 2);
        let of = |s: &Segment, k: &SeriesKey| s.series_key(s.find_series(k).unwrap()).clone();
        for gpu in [0, 1] {
            let (a, b) = (
                of(&segments[0], &key("temp", gpu)),
                of(&segments[1], &key("temp", gpu)),
            );
            assert_eq!(*a, key("temp", gpu));
            assert!(KeyArc::ptr_eq(&a, &b), "gpu {gpu}: two copies of one key");
        }
        of(&segments[1], &key("temp", 0))
    };
    {
        let st = Storage::open(cfg.clone()).unwrap();
        fill(&st, "temp", 0, 0, 10);
        fill(&st, "temp", 1, 0, 10);
        st.flush().unwrap().expect("segment written");
        fill(&st, "temp", 0, 10_000, 10);
        fill(&st, "temp", 1, 10_000, 10);
        st.flush().unwrap().expect("segment written");
        let k = same_in_both(&st);
        let r = st.series_ref(key("temp", 0)).unwrap();
        assert!(std::ptr::eq(lock!(st.head.read()).key(r), &*k));
        // temp/0 and temp/1: one name, two label sets.
        assert_eq!(st.keys.len(), (2, 1, 2));
    }
    let st = Storage::open(cfg).unwrap();
    same_in_both(&st);
    assert_eq!(st.keys.len(), (2, 1, 2));
}

/// A head that reaches `head_max_samples` asks for a flush once (the hook
/// runs on the append that filled it), and again only after a flush has
/// emptied it and it filled again.
#[test]
fn a_full_head_asks_for_a_flush_once_per_filling() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.head_max_samples = Some(100);
    let st = Storage::open(cfg).unwrap();
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let a = asked.clone();
    st.set_on_full(Box::new(move || {
        a.fetch_add(1, Relaxed);
    }))
    .map_err(|_| "a second hook")
    .unwrap();
    fill(&st, "a", 0, 0, 99);
    assert_eq!(asked.load(Relaxed), 0, "99 samples: not full");
    fill(&st, "a", 1, 0, 1);
    assert_eq!(asked.load(Relaxed), 1, "the 100th sample fills it");
    fill(&st, "a", 2, 0, 50);
    assert_eq!(asked.load(Relaxed), 1, "asked once per filling");
    st.flush().unwrap().expect("a segment");
    fill(&st, "a", 0, 200_000, 60);
    assert_eq!(asked.load(Relaxed), 1, "60 samples since the flush");
    fill(&st, "a", 1, 200_000, 40);
    assert_eq!(asked.load(Relaxed), 2, "full again");
}
