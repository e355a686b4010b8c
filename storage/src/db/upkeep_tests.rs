//! Issue #14 (hardening): storage never writes what its readers refuse, a
//! flush failure is contained, a file that fails to open after its rename is
//! not counted twice, and upkeep (flush, compaction, retention) is serialized.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicI64;
use std::sync::atomic::Ordering::Relaxed;

use super::*;
use crate::error::Error;
use crate::files::{QUARANTINE_DIR, ROLLUPS_DIR};
use crate::head::Appended;
use crate::rollup::tests::{Model, append, check, config, key_of, slot_ts};
use crate::rollup::{RollupFilter, RollupLevel};
use crate::series::Label;
use crate::wal;
use crate::{MAX_TS_MS, MIN_TS_MS};

fn key(metric: &str, gpu: u32) -> SeriesKey {
    SeriesKey::new(metric, vec![Label::new("gpu", gpu.to_string())]).unwrap()
}

fn n(c: &AtomicU64) -> u64 {
    c.load(Relaxed)
}

/// Every sample of every series, read back: key -> (ts, value bits).
fn dump(st: &Storage) -> BTreeMap<String, Vec<(i64, u64)>> {
    let mut out = BTreeMap::new();
    for s in st.select(&[], i64::MIN, i64::MAX) {
        let (mut t, mut v) = (Vec::new(), Vec::new());
        s.read_into(i64::MIN, i64::MAX, &mut t, &mut v).unwrap();
        out.insert(
            s.key.to_string(),
            t.into_iter().zip(v.iter().map(|v| v.to_bits())).collect(),
        );
    }
    out
}

fn quarantined(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(rd) = fs::read_dir(dir.join(QUARANTINE_DIR)) else {
        return Vec::new();
    };
    let mut v: Vec<PathBuf> = rd
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    v.sort();
    v
}

fn wal_segments(dir: &Path) -> usize {
    wal::list_segments(&dir.join(files::WAL_DIR)).unwrap().len()
}

/// The storable range, at limit - 1, limit and limit + 1 on both ends: the
/// ends are stored, flushed, read back and rolled up; one past them is
/// refused whole and counted.
#[test]
fn append_refuses_timestamps_outside_the_storable_range() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = None;
    cfg.ooo_window = std::time::Duration::from_secs(u32::MAX as u64);
    let st = Storage::open(cfg.clone()).unwrap();
    let r = st.series_ref(key("m", 0)).unwrap();
    for bad in [MIN_TS_MS - 1, MAX_TS_MS + 1, i64::MIN, i64::MAX] {
        let e = st.append(&[r, r], &[0, bad], &[1.0, 2.0]).unwrap_err();
        assert!(
            matches!(e, Error::BadBatch { reason } if reason.contains("0001-01-01")),
            "{bad}: {e}"
        );
    }
    assert_eq!(n(&st.metrics().samples_out_of_range), 4);
    assert_eq!(st.stats().head_samples, 0, "a refused batch stores nothing");
    let good = [MIN_TS_MS, MIN_TS_MS + 1, 0, MAX_TS_MS - 1, MAX_TS_MS];
    let out = st
        .append(&[r; 5], &good, &[1.0, 2.0, 3.0, 4.0, 5.0])
        .unwrap();
    assert_eq!(out.accepted, 5);
    st.flush().unwrap().expect("a segment");
    assert_eq!(n(&st.metrics().flush_failures), 0);
    let want: Vec<(i64, u64)> = good
        .iter()
        .zip([1.0f64, 2.0, 3.0, 4.0, 5.0])
        .map(|(&t, v)| (t, v.to_bits()))
        .collect();
    assert_eq!(dump(&st)[&key("m", 0).to_string()], want);
    drop(st);
    let st = Storage::open(cfg).unwrap();
    assert_eq!(dump(&st)[&key("m", 0).to_string()], want);
    // Windows worked out by hand: both ends are whole days.
    for (tier, w) in [
        (RollupTier::Minute, 60_000),
        (RollupTier::Hour, 3_600_000),
        (RollupTier::Day, 86_400_000),
    ] {
        let got = st.select_rollups(
            tier,
            RollupLevel::Gpu,
            &RollupFilter::default(),
            i64::MIN,
            i64::MAX,
        );
        let ws: Vec<(i64, u64)> = got[0]
            .1
            .iter()
            .map(|r| (r.window_start_ms, r.count))
            .collect();
        assert_eq!(
            ws,
            [(MIN_TS_MS, 2), (0, 1), (MAX_TS_MS + 1 - w, 2)],
            "{tier:?}"
        );
    }
}

/// The reproduction: one sample at -2^63 reached the head (here
/// through the WAL and the head directly, as a build without the append
/// check let it in). Before the fix every flush failed on it and left an
/// unreadable rollup file. Now the first flush sets it aside and fails, the
/// next one writes everything else, the WAL is truncated, and a restart
/// finds every good sample once.
#[test]
fn a_poison_sample_is_set_aside_and_the_next_flush_succeeds() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let mut stored = Model::new();
    append(&st, &mut stored, &[(0, 1, 1.0), (1, 2, 2.0), (0, 3, 3.0)]);
    st.flush().unwrap();
    append(&st, &mut stored, &[(0, 4, 4.0), (2, 5, 5.0), (1, 6, 6.0)]);
    // A new series, so that -2^63 is in order (and not too old).
    let poisoned = st.series_ref(key_of(5)).unwrap();
    let mut rec = Vec::new();
    record::encode_samples(&mut rec, &[poisoned.0], &[i64::MIN], &[9.0]);
    st.wal.write(rec).unwrap();
    let stored_poison = lock!(st.head.write()).append(poisoned, i64::MIN, 9.0);
    assert_eq!(stored_poison, Appended::InOrder);
    append(&st, &mut stored, &[(5, 7, 7.0)]);
    let rollup_files = st.rollup_files();

    let e = st.flush().unwrap_err();
    assert!(matches!(e, Error::Unwritable { .. }), "{e}");
    let m = st.metrics();
    assert_eq!(n(&m.flush_failures), 1);
    assert_eq!(n(&m.flushes), 1);
    assert_eq!(n(&m.rollup_records_set_aside), 1);
    assert_eq!(n(&m.samples_set_aside), 1);
    let aside = quarantined(dir.path(), "set-aside-");
    assert_eq!(aside.len(), 2, "{aside:?}");
    let text: String = aside
        .iter()
        .map(|p| fs::read_to_string(p).unwrap())
        .collect();
    assert!(text.contains("# why: refusing to write"), "{text}");
    assert!(text.contains(&format!("\t{}\t9\t", i64::MIN)), "{text}");
    assert_eq!(st.rollup_files(), rollup_files, "no file was written");
    let on_disk = fs::read_dir(dir.path().join(ROLLUPS_DIR)).unwrap().count();
    assert_eq!(on_disk, rollup_files, "no unreadable file left behind");
    check(&st, &stored).unwrap();

    let s = st.flush().unwrap().expect("the rest is written");
    assert_eq!(s.samples, 4);
    assert_eq!(n(&m.flushes), 2);
    assert_eq!(n(&m.flush_failures), 1, "nothing counted twice");
    assert_eq!(
        wal_segments(dir.path()),
        1,
        "the WAL before the cut is gone"
    );
    check(&st, &stored).unwrap();
    // Compaction and retention go on.
    st.compact().unwrap();
    st.enforce_retention(slot_ts(10));
    drop(st);
    let st = Storage::open(cfg).unwrap();
    check(&st, &stored).unwrap();
    assert_eq!(st.stats().segment_samples, stored.len() as u64);
    assert_eq!(
        n(&st.metrics().samples_out_of_range),
        0,
        "gone from the WAL"
    );
    append(&st, &mut stored, &[(3, 8, 8.0)]);
    st.flush().unwrap().expect("not wedged after a restart");
    check(&st, &stored).unwrap();
}

/// A WAL written by a build that let an unstorable sample in: replay sets it
/// aside instead of putting it back into the head, and flushes work.
#[test]
fn replay_sets_aside_unstorable_samples() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let r = st.series_ref(key_of(0)).unwrap();
    st.append(&[r, r], &[slot_ts(1), slot_ts(2)], &[1.0, 2.0])
        .unwrap();
    let mut rec = Vec::new();
    record::encode_samples(
        &mut rec,
        &[r.0, r.0, r.0],
        &[slot_ts(3), MAX_TS_MS + 1, i64::MIN],
        &[3.0, 4.0, 5.0],
    );
    st.wal.write(rec).unwrap();
    drop(st);
    let st = Storage::open(cfg.clone()).unwrap();
    assert_eq!(n(&st.metrics().samples_out_of_range), 2);
    assert_eq!(n(&st.metrics().samples_set_aside), 2);
    let aside = quarantined(dir.path(), "set-aside-");
    assert_eq!(aside.len(), 1);
    let text = fs::read_to_string(&aside[0]).unwrap();
    assert_eq!(
        text.lines().filter(|l| l.starts_with("sample\t")).count(),
        2
    );
    let mut stored = Model::new();
    for (slot, v) in [(1, 1.0), (2, 2.0), (3, 3.0)] {
        stored.insert((0, slot_ts(slot)), v);
    }
    check(&st, &stored).unwrap();
    st.flush().unwrap().expect("a segment");
    drop(st);
    let st = Storage::open(cfg).unwrap();
    check(&st, &stored).unwrap();
    assert_eq!(n(&st.metrics().samples_out_of_range), 0);
}

/// A rollup file fails to open right after its rename (an injected I/O
/// error). Before the fix the file stayed in `rollups/` while its records
/// were written again under a new id, and a restart counted them twice.
/// Now it is moved to `quarantine/` first; after a restart the rollups equal
/// a fold of the raw samples. The same for a merge by compaction.
#[test]
fn rollup_file_failing_to_open_after_rename_counts_once() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.compaction_window = std::time::Duration::from_secs(3600);
    let st = Storage::open(cfg.clone()).unwrap();
    let mut stored = Model::new();
    append(&st, &mut stored, &[(0, 1, 1.0), (1, 1, 2.0), (0, 2, 3.0)]);
    st.faults.rollup_open.store(1, Relaxed);
    assert!(st.flush().is_err(), "the injected fault fails the flush");
    assert_eq!(n(&st.metrics().flush_failures), 1);
    check(&st, &stored).unwrap();
    st.flush().unwrap().expect("retried");
    check(&st, &stored).unwrap();
    // More flushes in later compaction windows, then a merge whose result
    // fails to open: the sources stay, the next compaction merges them.
    for slot in [3, 4, 9, 10, 20] {
        append(&st, &mut stored, &[(slot as usize % 4, slot, slot as f64)]);
        st.flush().unwrap();
    }
    let before = st.rollup_files();
    st.faults.rollup_open.store(1, Relaxed);
    st.compact().unwrap();
    assert_eq!(
        st.rollup_files(),
        before,
        "the failed merge changed nothing"
    );
    check(&st, &stored).unwrap();
    st.compact().unwrap();
    assert!(st.rollup_files() < before, "merged on the second try");
    check(&st, &stored).unwrap();
    drop(st);
    let st = Storage::open(cfg).unwrap();
    check(&st, &stored).unwrap();
    let withdrawn = quarantined(dir.path(), "");
    assert_eq!(
        withdrawn.len(),
        4,
        "two files and their notes: {withdrawn:?}"
    );
}

/// Retention asked for while a compaction merges: it waits for the merge.
/// Before the fix it dropped the sources meanwhile, and the compaction
/// panicked (`BUG: only compaction removes segments`).
#[test]
fn retention_waits_for_a_compaction_in_progress() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.compaction_window = std::time::Duration::from_secs(100);
    cfg.retention = Some(std::time::Duration::from_secs(1));
    let st = Arc::new(Storage::open(cfg.clone()).unwrap());
    let r = st.series_ref(key("m", 0)).unwrap();
    for t in [1_000, 2_000, 200_000] {
        st.append(&[r], &[t], &[t as f64]).unwrap();
        st.flush().unwrap();
    }
    assert_eq!(st.stats().segments, 3);
    let (tx, rx) = std::sync::mpsc::channel();
    *lock!(st.faults.before_compaction_swap.lock()) = Some(tx);
    let compaction = {
        let st = st.clone();
        std::thread::spawn(move || st.compact().unwrap().expect("window 0 merged"))
    };
    rx.recv().unwrap();
    // Everything is past the retention at this "now".
    assert_eq!(
        st.enforce_retention(1_000_000),
        2,
        "the merged one and the newest"
    );
    let merged = compaction.join().expect("compaction panicked");
    assert_eq!(merged.samples, 2);
    assert_eq!(st.stats().segments, 0);
    assert!(st.select(&[], i64::MIN, i64::MAX).is_empty());
    drop(st);
    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.stats().segments, 0);
}

/// A segment that fails to open right after it was written is never put in
/// `segments/`; the retry writes its data: after a restart every sample is
/// in exactly one segment.
#[test]
fn segment_failing_to_open_after_it_was_written_is_not_published() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let r = st.series_ref(key_of(0)).unwrap();
    st.append(&[r, r], &[slot_ts(1), slot_ts(2)], &[1.0, 2.0])
        .unwrap();
    st.faults.segment_open.store(1, Relaxed);
    let e = st.flush().unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert_eq!(st.stats().segments, 0);
    let in_segments: Vec<_> = fs::read_dir(dir.path().join(files::SEGMENTS_DIR))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(in_segments.is_empty(), "{in_segments:?}");
    assert_eq!(quarantined(dir.path(), ""), Vec::<PathBuf>::new());
    st.append(&[r], &[slot_ts(3)], &[3.0]).unwrap();
    st.flush().unwrap().expect("retried");
    drop(st);
    let st = Storage::open(cfg).unwrap();
    let s = st.stats();
    assert_eq!((s.segments, s.segment_samples, s.head_samples), (1, 3, 0));
    let mut stored = Model::new();
    for (slot, v) in [(1, 1.0), (2, 2.0), (3, 3.0)] {
        stored.insert((0, slot_ts(slot)), v);
    }
    check(&st, &stored).unwrap();
}

/// Appends from several threads while flush, compact, enforce_retention and
/// upkeep (the admin flush) run concurrently from others, retention
/// dropping segments as the data moves on. Before the fix, retention could
/// drop a segment that a compaction was merging: a `BUG:` panic, or a
/// splice that dropped other segments from view. Afterwards, and after a
/// restart: no sample is stored twice, every sample newer than the last
/// retention cutoff is there with its value, and the 1-minute rollups count
/// every appended sample exactly once.
#[test]
fn concurrent_upkeep_under_load_keeps_every_sample_once() {
    const WRITERS: u32 = 4;
    const BATCHES: i64 = 1500;
    const PER_BATCH: i64 = 20;
    const STEP_MS: i64 = 100;
    const RETENTION_MS: i64 = 30_000;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.max_chunk_samples = 16;
    cfg.compaction_window = std::time::Duration::from_secs(5);
    cfg.retention = Some(std::time::Duration::from_millis(RETENTION_MS as u64));
    let st = Arc::new(Storage::open(cfg.clone()).unwrap());
    // The newest timestamp every writer has passed: retention's "now".
    let progress: Arc<Vec<AtomicI64>> = Arc::new((0..WRITERS).map(|_| AtomicI64::new(0)).collect());
    let now = {
        let p = progress.clone();
        move || p.iter().map(|a| a.load(Relaxed)).min().unwrap()
    };
    let max_now = Arc::new(AtomicI64::new(0));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Set while writer 0 waits for a compaction; see below.
    let holding = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (st, progress, holding) = (st.clone(), progress.clone(), holding.clone());
            std::thread::spawn(move || {
                let refs = [
                    st.series_ref(key("a", w)).unwrap(),
                    st.series_ref(key("b", w)).unwrap(),
                ];
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
                let mut flushes_seen = 0;
                for b in 0..BATCHES {
                    if w == 0 && b == BATCHES / 2 {
                        // Halfway, wait for a compaction to have run while
                        // the others keep appending: on a loaded machine the
                        // compacting thread may otherwise not get a turn
                        // before retention drops its inputs. Retention's
                        // "now" is the slowest writer's, so it waits too.
                        holding.store(true, Relaxed);
                        while st.metrics().compactions.load(Relaxed) == 0
                            && std::time::Instant::now() < deadline
                        {
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        }
                        holding.store(false, Relaxed);
                    } else if holding.load(Relaxed) {
                        // Meanwhile the others append one batch (2 s of data)
                        // per segment at most, so every 5 s compaction window
                        // gets two or more segments, however slow the disk's
                        // fsync is next to the appends. The previous batch
                        // has left the head once the second flush after it
                        // is done (the first may have frozen the head before
                        // it), or once the head is empty.
                        while st.metrics().flushes.load(Relaxed) <= flushes_seen + 1
                            && st.stats().head_samples > 0
                            && holding.load(Relaxed)
                            && std::time::Instant::now() < deadline
                        {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                    }
                    let ts: Vec<i64> = (0..PER_BATCH)
                        .map(|i| (b * PER_BATCH + i) * STEP_MS)
                        .collect();
                    let mut rr = Vec::new();
                    let mut tt = Vec::new();
                    let mut vv = Vec::new();
                    for (k, r) in refs.iter().enumerate() {
                        for &t in &ts {
                            rr.push(*r);
                            tt.push(t);
                            vv.push(value(w, k, t));
                        }
                    }
                    let out = st.append(&rr, &tt, &vv).unwrap();
                    assert_eq!(out.accepted as usize, rr.len());
                    progress[w as usize].store(*ts.last().unwrap(), Relaxed);
                    flushes_seen = st.metrics().flushes.load(Relaxed);
                    // Let upkeep interleave with the appends.
                    std::thread::sleep(std::time::Duration::from_micros(300));
                }
            })
        })
        .collect();
    fn value(w: u32, k: usize, t: i64) -> f64 {
        (w as i64 * 1_000_000 + k as i64 * 100_000 + t / STEP_MS) as f64 / 8.0
    }
    let upkeepers: Vec<_> = (0..4)
        .map(|kind| {
            let (st, stop, now, max_now) = (st.clone(), stop.clone(), now.clone(), max_now.clone());
            std::thread::spawn(move || {
                while !stop.load(Relaxed) {
                    let t = now();
                    max_now.fetch_max(t, Relaxed);
                    match kind {
                        0 => {
                            st.flush().unwrap();
                        }
                        1 => {
                            st.compact().unwrap();
                        }
                        2 => {
                            st.enforce_retention(t);
                        }
                        _ => {
                            let r = st.upkeep(t, 4);
                            r.flush.unwrap();
                            assert!(r.compaction_error.is_none());
                        }
                    }
                }
            })
        })
        .collect();
    for w in writers {
        w.join().expect("a writer panicked");
    }
    stop.store(true, Relaxed);
    for u in upkeepers {
        u.join().expect("an upkeep thread panicked");
    }
    let cutoff = max_now.load(Relaxed) - RETENTION_MS;
    let verify = |st: &Storage| {
        let all = dump(st);
        let mut kept = 0;
        for w in 0..WRITERS {
            for (k, m) in ["a", "b"].iter().enumerate() {
                let name = key(m, w).to_string();
                let got = all.get(&name).cloned().unwrap_or_default();
                let want: Vec<(i64, u64)> = (0..BATCHES * PER_BATCH)
                    .map(|i| i * STEP_MS)
                    .filter(|&t| t >= cutoff || got.binary_search_by_key(&t, |g| g.0).is_ok())
                    .map(|t| (t, value(w, k, t).to_bits()))
                    .collect();
                assert_eq!(
                    got, want,
                    "{name}: newer than {cutoff} all there, all values right"
                );
                kept += got.len();
            }
        }
        // No chunk holds a sample that another chunk also holds.
        let held: usize = st
            .select(&[], i64::MIN, i64::MAX)
            .iter()
            .map(|s| s.max_samples())
            .sum();
        assert_eq!(held, kept, "a sample is stored twice");
        let s = st.stats();
        assert_eq!((s.segment_samples + s.head_samples) as usize, kept);
        // Rollups keep what raw retention dropped: every appended sample, once.
        let minutes = st.select_rollups(
            RollupTier::Minute,
            RollupLevel::Gpu,
            &RollupFilter::default(),
            i64::MIN,
            i64::MAX,
        );
        let counted: u64 = minutes
            .iter()
            .flat_map(|(_, rs)| rs.iter().map(|r| r.count))
            .sum();
        assert_eq!(counted, (WRITERS as i64 * 2 * BATCHES * PER_BATCH) as u64);
        all
    };
    let before = verify(&st);
    assert!(n(&st.metrics().segments_expired) > 0, "retention ran");
    assert!(n(&st.metrics().compactions) > 0, "compaction ran");
    drop(st);
    let st = Storage::open(cfg).unwrap();
    assert_eq!(verify(&st), before, "a restart changes nothing");
}
