//! Rollups against a naive fold over the raw samples the test knows were
//! stored (first write wins), computed here without the code under test.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;
use crate::{Label, SeriesKey, Storage, StorageConfig};

/// Topology of test series `i`: (metric, cluster, row, rack, host label name, host, gpu, uuid).
fn topo(i: usize) -> [String; 8] {
    let pick = |n: usize, opts: &[&str]| opts[n % opts.len()].to_string();
    [
        pick(i, &["m0", "m1"]),
        pick(i / 2, &["c0", "", "c1"]),
        pick(i / 3, &["r0", ""]),
        pick(i / 5, &["k0", "k1", ""]),
        pick(i / 7, &["Hostname", "hostname", "Hostname"]),
        pick(i / 4, &["h0", "h1", ""]),
        pick(i / 6, &["0", "1"]),
        pick(i / 11, &["u0", "u1"]),
    ]
}

pub(crate) fn key_of(i: usize) -> SeriesKey {
    let t = topo(i);
    SeriesKey::new(
        t[0].clone(),
        vec![
            Label::new("cluster", t[1].clone()),
            Label::new("row", t[2].clone()),
            Label::new("rack", t[3].clone()),
            Label::new(t[4].clone(), t[5].clone()),
            Label::new("gpu", t[6].clone()),
            Label::new("UUID", t[7].clone()),
        ],
    )
    .unwrap()
}

/// The group of series `i` at `level`, from the topology (not from the code under test).
fn group_of(i: usize, level: RollupLevel) -> [String; 6] {
    let t = topo(i);
    let depth = match level {
        RollupLevel::Gpu => 5,
        RollupLevel::Host => 4,
        RollupLevel::Rack => 3,
        RollupLevel::Row => 2,
        RollupLevel::Cluster => 1,
    };
    let f = [&t[0], &t[1], &t[2], &t[3], &t[5], &t[6]];
    std::array::from_fn(|k| {
        if k <= depth {
            f[k].clone()
        } else {
            String::new()
        }
    })
}

/// A window folded by hand, with the ties rule of the module docs (shared
/// with the import tests).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Naive {
    pub(crate) count: u64,
    pub(crate) sum: f64,
    pub(crate) min: f64,
    pub(crate) max: f64,
    pub(crate) first: (i64, f64),
    pub(crate) last: (i64, f64),
}

impl Naive {
    pub(crate) const EMPTY: Naive = Naive {
        count: 0,
        sum: 0.0,
        min: f64::INFINITY,
        max: f64::NEG_INFINITY,
        first: (i64::MAX, f64::INFINITY),
        last: (i64::MIN, f64::NEG_INFINITY),
    };

    pub(crate) fn add(&mut self, t: i64, v: f64) {
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        if t < self.first.0 || (t == self.first.0 && v < self.first.1) {
            self.first = (t, v);
        }
        if t > self.last.0 || (t == self.last.0 && v > self.last.1) {
            self.last = (t, v);
        }
    }
}

pub(crate) type Model = HashMap<(usize, i64), f64>;

fn naive(
    stored: &Model,
    tier: RollupTier,
    level: RollupLevel,
) -> BTreeMap<[String; 6], BTreeMap<i64, Naive>> {
    let w = tier.window_ms();
    let mut out: BTreeMap<[String; 6], BTreeMap<i64, Naive>> = BTreeMap::new();
    for (&(i, t), &v) in stored {
        let ws = t.div_euclid(w) * w;
        out.entry(group_of(i, level))
            .or_default()
            .entry(ws)
            .or_insert(Naive::EMPTY)
            .add(t, v);
    }
    out
}

pub(crate) fn check(st: &Storage, stored: &Model) -> Result<(), TestCaseError> {
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            let want = naive(stored, tier, level);
            let got = st.select_rollups(tier, level, &RollupFilter::default(), i64::MIN, i64::MAX);
            let got_keys: Vec<[String; 6]> = got
                .iter()
                .map(|(g, _)| {
                    [
                        g.metric.clone(),
                        g.cluster.clone(),
                        g.row.clone(),
                        g.rack.clone(),
                        g.host.clone(),
                        g.gpu.clone(),
                    ]
                })
                .collect();
            let want_keys: Vec<[String; 6]> = want.keys().cloned().collect();
            prop_assert_eq!(&got_keys, &want_keys, "groups of {:?} {:?}", tier, level);
            for ((_, recs), (g, wins)) in got.iter().zip(&want) {
                prop_assert_eq!(recs.len(), wins.len(), "windows of {:?}", g);
                for (r, (&ws, n)) in recs.iter().zip(wins) {
                    let ctx = format!("{tier:?} {level:?} {g:?} window {ws}");
                    prop_assert_eq!(r.window_start_ms, ws, "{}", ctx);
                    prop_assert_eq!(r.count, n.count, "{}", ctx);
                    prop_assert_eq!(r.min, n.min, "{}", ctx);
                    prop_assert_eq!(r.max, n.max, "{}", ctx);
                    prop_assert_eq!((r.first_ts_ms, r.first), n.first, "{}", ctx);
                    prop_assert_eq!((r.last_ts_ms, r.last), n.last, "{}", ctx);
                    let tol = 1e-12 * n.sum.abs().max(1.0);
                    prop_assert!(
                        (r.sum - n.sum).abs() <= tol,
                        "{} sum {} vs {}",
                        ctx,
                        r.sum,
                        n.sum
                    );
                }
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone)]
enum Op {
    /// (series, timestamp slot, value)
    Batch(Vec<(usize, i64, i32)>),
    Flush,
    /// Drop without flushing, reopen (WAL replay).
    Crash,
    Compact,
    /// Raw retention at this slot's time: the gpu-level minutes of the
    /// older segments' samples go to a rollup file, then the segments go.
    Retain(i64),
    /// Only the first half of `Retain`, as a crash between the two leaves it.
    CutOnly(i64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop::collection::vec((0usize..14, 0i64..300, -40i32..40), 1..30).prop_map(Op::Batch),
        1 => Just(Op::Flush),
        1 => Just(Op::Crash),
        1 => Just(Op::Compact),
        1 => (0i64..300).prop_map(Op::Retain),
        1 => (0i64..300).prop_map(Op::CutOnly),
    ]
}

pub(crate) fn config(dir: &std::path::Path) -> StorageConfig {
    let mut cfg = StorageConfig::new(dir);
    cfg.max_chunk_samples = 7;
    // Wider than the whole test range: nothing is too old, so what is stored
    // is exactly the first write of each (series, timestamp).
    cfg.ooo_window = std::time::Duration::from_secs(30 * 86_400);
    cfg.compaction_window = std::time::Duration::from_secs(6 * 3600);
    cfg.retention = None;
    cfg
}

/// A slot spreads over ~3.5 days, so minute, hour and day windows all vary.
pub(crate) fn slot_ts(slot: i64) -> i64 {
    slot * 997_000 + (slot % 7) * 13_000
}

/// Appends `(series, slot, value)` rows one by one and records in `stored`
/// what they store (the first write of each).
pub(crate) fn append(st: &Storage, stored: &mut Model, rows: &[(usize, i64, f64)]) {
    for &(i, slot, v) in rows {
        let r = st.series_ref(key_of(i)).unwrap();
        st.append(&[r], &[slot_ts(slot)], &[v]).unwrap();
        stored.entry((i, slot_ts(slot))).or_insert(v);
    }
}

/// Makes the next segment writes fail: a directory sits where segments 1 to
/// 3 write their tmp files. Remove the returned paths to let them through.
pub(crate) fn block_segment_writes(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let blockers: Vec<_> = (1..4)
        .map(|id| crate::files::segment_tmp_path(dir, crate::SegmentId(id)))
        .collect();
    for b in &blockers {
        let _ = std::fs::create_dir(b);
    }
    blockers
}

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let mut st = Storage::open(cfg.clone()).unwrap();
    let mut stored = Model::new();
    // Samples before the raw cut are refused (their raw data may be gone).
    // The test tracks it from what it asked for, not from the store.
    let mut raw_cut = i64::MIN;
    for op in ops {
        match op {
            Op::Batch(rows) => {
                let refs: Vec<_> = rows
                    .iter()
                    .map(|r| st.series_ref(key_of(r.0)).unwrap())
                    .collect();
                let ts: Vec<i64> = rows.iter().map(|r| slot_ts(r.1)).collect();
                let vals: Vec<f64> = rows.iter().map(|r| r.2 as f64 * 0.25).collect();
                let out = st.append(&refs, &ts, &vals).unwrap();
                let before = ts.iter().filter(|&&t| t < raw_cut).count();
                prop_assert!(out.too_old as usize >= before, "{:?} {}", out, before);
                for (r, (&t, &v)) in rows.iter().zip(ts.iter().zip(&vals)) {
                    if t >= raw_cut {
                        stored.entry((r.0, t)).or_insert(v);
                    }
                }
            }
            Op::Flush => {
                st.flush().unwrap();
            }
            Op::Crash => {
                drop(st);
                st = Storage::open(cfg.clone()).unwrap();
            }
            Op::Compact => {
                st.compact().unwrap();
            }
            Op::Retain(slot) => {
                let t = slot_ts(slot);
                // The minute after the newest sample of a segment that ends
                // before the minute of `t`, if one does.
                let m = RollupTier::Minute;
                let newest = st
                    .segment_handles()
                    .iter()
                    .map(|s| s.time_range().1)
                    .filter(|&n| n < m.window_start(t))
                    .max();
                if let Some(n) = newest {
                    raw_cut = raw_cut.max(m.window_start(n) + m.window_ms());
                }
                st.drop_raw_before(t, t);
            }
            Op::CutOnly(slot) => {
                let t = RollupTier::Minute.window_start(slot_ts(slot));
                raw_cut = raw_cut.max(t);
                st.move_raw_cut(t, t).unwrap();
            }
        }
        prop_assert_eq!(st.raw_cut(), raw_cut);
        check(&st, &stored)?;
    }
    drop(st);
    let st = Storage::open(cfg).unwrap();
    check(&st, &stored)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Every tier and level equals the naive fold, after every operation:
    /// appends (late and duplicate samples included), flushes, crashes, compactions.
    #[test]
    fn rollups_equal_a_naive_fold(ops in prop::collection::vec(op(), 1..25)) {
        run(ops)?;
    }
}

/// A sample repeating a flushed timestamp, within the out-of-order window,
/// must count once, before and after a crash.
#[test]
fn late_duplicate_of_a_flushed_sample_counts_once() {
    run(vec![
        Op::Batch(vec![(0, 10, 1), (0, 12, 2), (0, 14, 3)]),
        Op::Flush,
        Op::Batch(vec![(0, 12, 9), (0, 11, 5), (0, 13, 4), (0, 13, 8)]),
        Op::Crash,
        Op::Batch(vec![(0, 12, 7), (0, 11, 6)]),
        Op::Flush,
        Op::Batch(vec![(0, 10, 7), (0, 13, 6)]),
    ])
    .unwrap();
}

/// A flushed sample sent again after its flush, then retention past it: the
/// raw cut writes its minute once (found by `rollups_equal_a_naive_fold`).
#[test]
fn duplicate_of_a_flushed_sample_then_retention_counts_once() {
    run(vec![
        Op::Batch(vec![(10, 160, 0)]),
        Op::Flush,
        Op::Batch(vec![(10, 160, 0)]),
        Op::Retain(161),
    ])
    .unwrap();
}

/// A flush fails after its rollup file is durable and before its segment is,
/// and the process dies; replay refills the head with those samples (not the
/// rollups, which the file holds but for their gpu-level minutes, folded from
/// raw data). Retention then moves the raw cut past them while only the head
/// holds them: it flushes them first, so their gpu-level minutes are written.
#[test]
fn retention_past_samples_replayed_after_a_failed_flush_writes_their_minutes() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let mut stored = Model::new();
    append(&st, &mut stored, &[(0, 1, 1.0), (0, 3, 3.0), (0, 5, 5.0)]);
    st.flush().unwrap();
    // Series 1's sample is older than series 0's newest flushed one.
    append(&st, &mut stored, &[(1, 2, 2.0)]);
    let blockers = block_segment_writes(dir.path());
    assert!(st.flush().is_err(), "the segment write fails");
    assert_eq!(st.rollup_files(), 2, "the rollup file was written first");
    drop(st);
    for b in &blockers {
        let _ = std::fs::remove_dir(b);
    }
    let st = Storage::open(cfg.clone()).unwrap();
    assert_eq!(st.stats().head_samples, 1, "replay refilled the head");
    check(&st, &stored).unwrap();
    // Past slot 5's minute: the cut goes past series 1's sample too.
    assert_eq!(st.drop_raw_before(slot_ts(7), slot_ts(7)), 2);
    assert_eq!(st.stats().head_samples, 0, "flushed before the cut moved");
    assert!(st.raw_cut() > slot_ts(5));
    check(&st, &stored).unwrap();
    drop(st);
    check(&Storage::open(cfg).unwrap(), &stored).unwrap();
}

/// The flush fails after its rollup file is durable and before its segment
/// is (a directory sits where the segment's tmp file goes). Retried without a
/// crash, and with a crash in between: rollups still equal the fold.
#[test]
fn crash_between_rollup_file_and_segment() {
    for crash in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let st = Storage::open(cfg.clone()).unwrap();
        let mut stored = Model::new();
        append(&st, &mut stored, &[(0, 1, 1.0), (1, 2, 2.0), (0, 3, 3.0)]);
        st.flush().unwrap();
        append(&st, &mut stored, &[(0, 4, 4.0), (2, 5, 5.0), (0, 2, 6.0)]);
        let blockers = block_segment_writes(dir.path());
        assert!(st.flush().is_err(), "the segment write fails");
        assert_eq!(st.rollup_files(), 2, "the rollup file was written first");
        check(&st, &stored).unwrap();
        append(&st, &mut stored, &[(0, 6, 7.0), (1, 1, 8.0)]);
        check(&st, &stored).unwrap();
        for b in &blockers {
            let _ = std::fs::remove_dir(b);
        }
        let st = if crash {
            drop(st);
            Storage::open(cfg.clone()).unwrap()
        } else {
            st
        };
        check(&st, &stored).unwrap();
        st.flush().unwrap();
        check(&st, &stored).unwrap();
        drop(st);
        let st = Storage::open(cfg).unwrap();
        check(&st, &stored).unwrap();
    }
}

/// Raw data expires; the rollups of its windows stay. Then 1-minute records
/// expire while the hour and day records stay.
#[test]
fn rollups_survive_raw_retention() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.retention = Some(std::time::Duration::from_millis(1));
    cfg.retention_1m = Some(std::time::Duration::from_secs(86_400));
    let st = Storage::open(cfg.clone()).unwrap();
    let mut stored = Model::new();
    for slot in 0..40 {
        for i in 0..5 {
            let r = st.series_ref(key_of(i)).unwrap();
            st.append(&[r], &[slot_ts(slot)], &[(slot + i as i64) as f64])
                .unwrap();
            stored.insert((i, slot_ts(slot)), (slot + i as i64) as f64);
        }
        if slot % 9 == 0 {
            st.flush().unwrap();
        }
    }
    st.flush().unwrap();
    let max_ts = slot_ts(39);
    assert!(st.stats().segments > 0);
    // Raw retention only (cut at the minute of its cutoff): the minute
    // records are younger than a day at this "now".
    assert!(st.enforce_retention(max_ts + 60_000) > 0);
    assert_eq!(st.stats().segments, 0, "raw data expired");
    assert!(st.select(&[], i64::MIN, i64::MAX).is_empty());
    check(&st, &stored).unwrap();
    drop(st);
    let st = Storage::open(cfg.clone()).unwrap();
    check(&st, &stored).unwrap();

    // Two days later, the minute records are gone; hours and days stay.
    let now = max_ts + 2 * 86_400_000;
    st.enforce_retention(now);
    let minute = st.select_rollups(
        RollupTier::Minute,
        RollupLevel::Gpu,
        &RollupFilter::default(),
        i64::MIN,
        i64::MAX,
    );
    assert!(minute.is_empty(), "minute records expired: {minute:?}");
    for tier in [RollupTier::Hour, RollupTier::Day] {
        for level in RollupLevel::ALL {
            let got = st.select_rollups(tier, level, &RollupFilter::default(), i64::MIN, i64::MAX);
            let want = naive(&stored, tier, level);
            let count = |it: &mut dyn Iterator<Item = u64>| it.sum::<u64>();
            assert_eq!(
                count(&mut got.iter().flat_map(|(_, r)| r.iter().map(|r| r.count))),
                count(&mut want.values().flat_map(|w| w.values().map(|n| n.count))),
            );
            assert_eq!(got.len(), want.len());
        }
    }
    assert_eq!(
        st.rollup_files(),
        1,
        "expired files merged into one archive"
    );
    drop(st);
    let st = Storage::open(cfg).unwrap();
    assert_eq!(st.rollup_files(), 1);
}

#[test]
fn filters_and_time_range() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(config(dir.path())).unwrap();
    let mut stored = Model::new();
    for slot in 0..20 {
        for i in 0..14 {
            let r = st.series_ref(key_of(i)).unwrap();
            st.append(&[r], &[slot_ts(slot)], &[i as f64]).unwrap();
            stored.insert((i, slot_ts(slot)), i as f64);
        }
        if slot == 10 {
            st.flush().unwrap();
        }
    }
    let f = RollupFilter {
        metric: Some("m1".into()),
        cluster: Some("c0".into()),
        ..Default::default()
    };
    let (lo, hi) = (slot_ts(5), slot_ts(15));
    let got = st.select_rollups(RollupTier::Minute, RollupLevel::Rack, &f, lo, hi);
    let want = naive(&stored, RollupTier::Minute, RollupLevel::Rack);
    let want: Vec<_> = want
        .into_iter()
        .filter(|(g, _)| g[0] == "m1" && g[1] == "c0")
        .map(|(g, w)| {
            let w: Vec<i64> = w
                .into_keys()
                .filter(|&ws| ws <= hi && ws + 59_999 >= lo)
                .collect();
            (g, w)
        })
        .filter(|(_, w)| !w.is_empty())
        .collect();
    assert!(!want.is_empty());
    assert_eq!(got.len(), want.len());
    for ((g, recs), (wg, ws)) in got.iter().zip(&want) {
        assert_eq!(
            [&g.metric, &g.cluster, &g.row, &g.rack],
            [&wg[0], &wg[1], &wg[2], &wg[3]]
        );
        assert_eq!(g.host, "");
        assert_eq!(
            recs.iter().map(|r| r.window_start_ms).collect::<Vec<_>>(),
            *ws
        );
    }
}

#[test]
fn corrupt_rollup_file_is_quarantined_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let r = st.series_ref(key_of(0)).unwrap();
    st.append(&[r], &[1000], &[1.0]).unwrap();
    st.flush().unwrap();
    drop(st);
    let path = crate::files::rollup_path(dir.path(), 1);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[20] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let st = Storage::open(cfg).unwrap();
    assert_eq!(
        st.metrics()
            .rollup_files_quarantined
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    assert!(
        dir.path()
            .join("quarantine")
            .join(crate::files::rollup_file_name(1))
            .exists()
    );
    assert_eq!(st.rollup_files(), 0);
}

/// A version 5 file opens without reading its blocks: a block corrupted on
/// disk is found by the first query that reads it (counted and skipped), and
/// by the merge of its compaction window, which quarantines the file rather
/// than fail every round.
#[test]
fn a_corrupt_block_is_found_when_read_and_quarantined_when_merged() {
    use std::sync::atomic::Ordering::Relaxed;
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    let r = st.series_ref(key_of(0)).unwrap();
    // Two files in the first 6-hour window, a third that finishes it.
    for ts in [1_000, 61_000, 7 * 3_600_000] {
        st.append(&[r], &[ts], &[1.0]).unwrap();
        st.flush().unwrap();
    }
    assert_eq!(st.rollup_files(), 3);
    drop(st);
    let path = crate::files::rollup_path(dir.path(), 1);
    let mut bytes = std::fs::read(&path).unwrap();
    // Inside the first block's payload (a host-level minute block).
    assert_eq!(bytes[file::HEADER_LEN..file::HEADER_LEN + 2], [0, 1]);
    bytes[file::HEADER_LEN + file::BLOCK_HEADER_LEN + 4] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();

    let st = Storage::open(cfg).unwrap();
    let m = st.metrics();
    assert_eq!(m.rollup_files_quarantined.load(Relaxed), 0);
    assert_eq!(st.rollup_files(), 3);
    let host_minutes = |st: &Storage| {
        st.select_rollups(
            RollupTier::Minute,
            RollupLevel::Host,
            &RollupFilter::default(),
            0,
            i64::MAX,
        )
        .iter()
        .flat_map(|(_, rs)| rs.iter().map(|r| r.window_start_ms))
        .collect::<Vec<_>>()
    };
    // The corrupt block is skipped: minute 0 is missing, the others are there.
    assert_eq!(host_minutes(&st), [60_000, 7 * 3_600_000]);
    assert_eq!(m.rollup_read_errors.load(Relaxed), 1);
    st.compact().unwrap();
    assert_eq!(m.rollup_files_quarantined.load(Relaxed), 1);
    assert_eq!(st.rollup_files(), 2);
    let q = dir.path().join("quarantine");
    assert!(q.join(crate::files::rollup_file_name(1)).exists());
    assert_eq!(host_minutes(&st), [60_000, 7 * 3_600_000]);
    // The next round has nothing left to merge in that window, and no error.
    st.compact().unwrap();
    assert_eq!(m.rollup_files_quarantined.load(Relaxed), 1);
}

/// Every truncation and every bit flip is an error, never a panic.
#[test]
fn every_truncation_and_flip_is_detected() {
    let mut tables = empty_tables();
    let g = RollupGroup {
        metric: "m".into(),
        gpu: "3".into(),
        ..Default::default()
    };
    add_to_tables(
        &mut tables,
        &g,
        &[
            RollupRecord::of_sample(60_000, 61_000, 2.5),
            RollupRecord::of_sample(180_000, 180_500, -1.0),
        ],
    );
    let bytes = file::encode(7, i64::MIN, &[(4, 4)], &tables);
    let f = file::RollupFile::from_bytes(&bytes).unwrap();
    assert_eq!(f.wal_cut(), 7);
    assert_eq!(f.covers(), [(4, 4)]);
    // Opening checks the header, footer, covers and directory; a block's
    // checksum and payload are checked when it is first read.
    let check = |b: &[u8]| file::RollupFile::from_bytes(b).and_then(|f| f.verify());
    f.verify().unwrap();
    for n in 0..bytes.len() {
        assert!(check(&bytes[..n]).is_err(), "truncated at {n}");
    }
    let mut payload_flips_open = 0;
    for i in 0..bytes.len() {
        for bit in 0..8 {
            let mut b = bytes.clone();
            b[i] ^= 1 << bit;
            assert!(check(&b).is_err(), "flip at {i} bit {bit}");
            if file::RollupFile::from_bytes(&b).is_ok() {
                payload_flips_open += 1;
                // Found by the first read of the block, whatever reads it.
                let f = file::RollupFile::from_bytes(&b).unwrap();
                let read = RollupTier::ALL.iter().try_for_each(|&t| {
                    RollupLevel::ALL
                        .iter()
                        .try_for_each(|&l| f.for_each(t, l, i64::MIN, i64::MAX, |_, _| {}))
                });
                assert!(read.is_err(), "flip at {i} bit {bit} read");
            }
        }
    }
    // The flips that opening leaves to the first read are those of the
    // block payloads and of the checksums over them.
    assert!(payload_flips_open > 0);
}

/// The rollup format is stable: the same tables encode to exactly the
/// committed file, which also seeds the `rollup_open` fuzz target. After a
/// deliberate format change, regenerate it with `GPULSE_BLESS=1`.
/// The tables of the golden files.
fn golden_tables() -> Tables {
    let mut tables = empty_tables();
    for (gpu, host) in [("0", "h0"), ("1", "h0"), ("0", "h1")] {
        let g = RollupGroup {
            metric: "DCGM_FI_DEV_GPU_TEMP".into(),
            cluster: "c0".into(),
            host: host.into(),
            gpu: gpu.into(),
            ..Default::default()
        };
        add_to_tables(
            &mut tables,
            &g,
            &[
                RollupRecord::of_sample(60_000, 61_000, 41.0),
                RollupRecord::of_sample(120_000, 150_000, f64::NAN),
                RollupRecord::of_sample(3_600_000, 3_600_500, -0.0),
            ],
        );
    }
    tables
}

#[test]
fn encoding_matches_the_committed_golden_file() {
    let tables = golden_tables();
    let bytes = file::encode(9, 180_000, &[(3, 5)], &tables);
    let committed = crate::golden::check("rollup_open", "golden.groll", &bytes);
    let f = file::RollupFile::from_bytes(&committed).unwrap();
    assert_eq!((f.wal_cut(), f.covers()), (9, &[(3, 5)][..]));
    assert_eq!((f.version(), f.raw_cut()), (5, 180_000));
    let seed = |name: &str| {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/rollup_open");
        std::fs::read(dir.join(name)).unwrap()
    };
    // The golden file of version 4 (before the directory) reads as the same
    // records, and is the current file less its directory.
    let v4 = seed("golden-v4.groll");
    assert_eq!(v4[8..12], 4u32.to_le_bytes());
    let old = file::RollupFile::from_bytes(&v4).unwrap();
    assert_eq!((old.version(), old.raw_cut()), (4, 180_000));
    assert_eq!(read_all(&v4), read_all(&committed));
    assert_eq!(as_version(&committed, 4), v4);
    // The golden file of version 3 (before `raw_cut`) reads as the same
    // records, with no raw cut.
    let v3 = seed("golden-v3.groll");
    assert_eq!(v3[8..12], 3u32.to_le_bytes());
    let old = file::RollupFile::from_bytes(&v3).unwrap();
    assert_eq!(
        (old.version(), old.raw_cut(), old.wal_cut()),
        (3, i64::MIN, 9)
    );
    assert_eq!(read_all(&v3), read_all(&committed));
    assert_eq!(
        as_version(&committed, 3),
        v3,
        "a v5 file less its directory and raw cut is v3"
    );
}

/// Rewrites a current file as an earlier `version` wrote it: the same
/// blocks, the covers without the block directory (before version 5), the
/// footer without `raw_cut` (before version 4; `docs/format/rollup.md`),
/// offsets and checksums recomputed.
pub(crate) fn as_version(cur: &[u8], version: u32) -> Vec<u8> {
    use crate::codec::put_uvarint;
    let covers = file::RollupFile::from_bytes(cur).unwrap().covers().to_vec();
    let mut out = cur[..8].to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    let fo = cur.len() - file::FOOTER_LEN;
    let co = u64::from_le_bytes(cur[fo..fo + 8].try_into().unwrap()) as usize;
    out.extend_from_slice(&cur[file::HEADER_LEN..co]);
    let mut c = Vec::new();
    put_uvarint(&mut c, covers.len() as u64);
    for (lo, hi) in covers {
        put_uvarint(&mut c, lo);
        put_uvarint(&mut c, hi - lo);
    }
    out.extend_from_slice(&c);
    let mut footer = cur[fo..].to_vec();
    footer[8..16].copy_from_slice(&(c.len() as u64).to_le_bytes());
    footer[56..60].copy_from_slice(&crc32c::crc32c(&c).to_le_bytes());
    let crc = crc32c::crc32c(&footer[..60]);
    footer[60..64].copy_from_slice(&crc.to_le_bytes());
    if version >= file::RAW_CUT {
        out.extend_from_slice(&footer);
    } else {
        out.extend_from_slice(&earlier_footer(&footer));
    }
    out
}

/// A version 4 footer as versions 1 to 3 have it: without `raw_cut` (at
/// offset 48), its checksum recomputed.
fn earlier_footer(v4_footer: &[u8]) -> Vec<u8> {
    let mut footer = v4_footer[..48].to_vec();
    footer.extend_from_slice(&v4_footer[56..]);
    let crc = crc32c::crc32c(&footer[..52]);
    footer[52..56].copy_from_slice(&crc.to_le_bytes());
    footer
}

#[test]
fn merge_is_order_independent_on_ties() {
    let a = RollupRecord::of_sample(0, 5, 1.0);
    let b = RollupRecord::of_sample(0, 5, 2.0);
    let (mut ab, mut ba) = (a, b);
    ab.merge(&b);
    ba.merge(&a);
    assert_eq!(ab, ba);
    assert_eq!((ab.first, ab.last), (1.0, 2.0));
}

/// The minute records of one series' samples (distinct timestamps, folded
/// in the given order), computed from the documented semantics: `sum` in
/// arrival order, `min`/`max` ignore NaN unless every value is NaN, `first`
/// and `last` are the values at the smallest and largest timestamp.
fn naive_minutes(samples: &[(i64, f64)]) -> Vec<RollupRecord> {
    let mut by_window: BTreeMap<i64, Vec<(i64, f64)>> = BTreeMap::new();
    for &(t, v) in samples {
        let ws = (t as i128).div_euclid(60_000) * 60_000;
        let ws = i64::try_from(ws).unwrap_or(i64::MIN);
        by_window.entry(ws).or_default().push((t, v));
    }
    by_window
        .into_iter()
        .map(|(ws, s)| {
            let numbers: Vec<f64> = s.iter().map(|x| x.1).filter(|v| !v.is_nan()).collect();
            let extreme = |pick: fn(f64, f64) -> bool| {
                let mut it = numbers.iter().copied();
                let first = it.next().unwrap_or(f64::NAN);
                it.fold(first, |a, b| if pick(b, a) { b } else { a })
            };
            let first = s.iter().min_by_key(|x| x.0).unwrap();
            let last = s.iter().max_by_key(|x| x.0).unwrap();
            RollupRecord {
                window_start_ms: ws,
                count: s.len() as u64,
                sum: s.iter().fold(0.0, |a, x| a + x.1),
                min: extreme(|a, b| a < b),
                max: extreme(|a, b| a > b),
                first: first.1,
                first_ts_ms: first.0,
                last: last.1,
                last_ts_ms: last.0,
            }
        })
        .collect()
}

/// Equality of records: `first` and `last` bit for bit (they are sample
/// values), `sum`, `min` and `max` as numbers with NaN equal to NaN (the sign
/// of a zero sum or extreme is not specified).
fn same_records(got: &[RollupRecord], want: &[RollupRecord]) -> Result<(), TestCaseError> {
    let exact = |r: &RollupRecord| {
        (
            r.window_start_ms,
            r.count,
            (r.first_ts_ms, r.first.to_bits()),
            (r.last_ts_ms, r.last.to_bits()),
        )
    };
    let same = |a: f64, b: f64| a == b || (a.is_nan() && b.is_nan());
    prop_assert_eq!(got.len(), want.len(), "{:?} vs {:?}", got, want);
    for (g, w) in got.iter().zip(want) {
        prop_assert_eq!(exact(g), exact(w), "{:?} vs {:?}", g, w);
        prop_assert!(
            same(g.sum, w.sum) && same(g.min, w.min) && same(g.max, w.max),
            "{:?} vs {:?}",
            g,
            w
        );
    }
    Ok(())
}

/// What the head's rollups are: the samples (distinct timestamps, in any
/// order) put in time order and folded by [`fold_minutes`].
fn fold_series(samples: &[(i64, f64)]) -> Vec<RollupRecord> {
    let mut sorted = samples.to_vec();
    sorted.sort_by_key(|s| s.0);
    let (ts, vals): (Vec<i64>, Vec<f64>) = sorted.into_iter().unzip();
    let mut out = Vec::new();
    fold_minutes(&ts, &vals, |r| out.push(r));
    out
}

fn check_series(samples: &[(i64, f64)]) -> Result<(), TestCaseError> {
    same_records(&fold_series(samples), &naive_minutes(samples))
}

/// In order within a minute, across minutes, a late sample into the current
/// minute, into a sealed minute and into a minute that has no record yet.
#[test]
fn series_rollup_in_order_and_late_samples() {
    let m = 60_000;
    let cases: &[&[(i64, f64)]] = &[
        &[],
        &[(5, 1.0)],
        &[
            (1, 1.0),
            (2, 5.0),
            (3, -2.0),
            (m, 4.0),
            (m + 1, 0.5),
            (3 * m, 7.0),
        ],
        // Late into the current minute: it becomes `first`, not `last`.
        &[(m + 10, 1.0), (m + 20, 2.0), (m + 5, -3.0), (m + 30, 9.0)],
        // Late into a sealed minute, before and after its own samples.
        &[
            (10, 1.0),
            (20, 2.0),
            (m + 1, 3.0),
            (2 * m, 4.0),
            (15, 8.0),
            (5, -8.0),
            (30, 0.0),
        ],
        // Late into minutes without a record: before the first, and between two.
        &[
            (3 * m, 1.0),
            (5 * m, 2.0),
            (m, 3.0),
            (4 * m + 7, 4.0),
            (-m, 5.0),
            (4 * m, 6.0),
        ],
        // A sample after a late one, in the current minute, still is `last`.
        &[(m + 50, 1.0), (m + 40, 2.0), (m + 60, 3.0)],
    ];
    for samples in cases {
        check_series(samples).unwrap();
    }
}

/// NaN is no number for min and max (unless every value is NaN) and still a
/// value for first, last and sum.
#[test]
fn series_rollup_nan_values() {
    let nan = f64::NAN;
    let cases: &[&[(i64, f64)]] = &[
        &[(1, nan)],
        &[(1, nan), (2, nan)],
        &[(1, nan), (2, 3.0), (3, -1.0)],
        &[(1, 3.0), (2, nan), (3, -1.0)],
        &[(1, 3.0), (2, -1.0), (3, nan)],
        &[(10, 3.0), (20, 4.0), (5, nan)],
        &[(10, nan), (20, nan), (5, 2.0), (70_000, nan), (15, nan)],
        &[(1, -0.0), (2, 0.0), (3, -0.0)],
        &[(1, f64::INFINITY), (2, f64::NEG_INFINITY), (3, nan)],
    ];
    for samples in cases {
        check_series(samples).unwrap();
    }
    let r = fold_series(&[(1, nan), (2, 3.0), (3, nan)]);
    let rec = &r[0];
    assert_eq!((rec.count, rec.min, rec.max), (3, 3.0, 3.0));
    assert!(rec.first.is_nan() && rec.last.is_nan() && rec.sum.is_nan());
}

/// Timestamps at the ends of `i64`: the first window's start saturates, the
/// last window is cut short. Neither may take the in-order path wrongly.
#[test]
fn series_rollup_extreme_timestamps() {
    let (lo, hi) = (i64::MIN, i64::MAX);
    let first_full = lo + (60_000 - lo.rem_euclid(60_000));
    let cases: &[&[(i64, f64)]] = &[
        &[
            (lo, 1.0),
            (lo + 1, 2.0),
            (first_full - 1, 3.0),
            (first_full, 4.0),
        ],
        &[(first_full, 4.0), (lo + 1, 2.0), (lo, 1.0)],
        &[(hi - 70_000, 1.0), (hi - 1, 2.0), (hi, 3.0)],
        &[(hi, 3.0), (hi - 1, 2.0), (lo, 0.0)],
    ];
    for samples in cases {
        check_series(samples).unwrap();
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any order of distinct timestamps over a few minutes, NaN among the values.
    #[test]
    fn series_rollup_equals_a_naive_fold(
        raw in prop::collection::vec((0i64..400_000, prop_oneof![
            8 => (-50i32..50).prop_map(f64::from),
            1 => Just(f64::NAN),
            1 => Just(-0.0),
        ]), 0..80),
    ) {
        let mut seen = std::collections::HashSet::new();
        let samples: Vec<(i64, f64)> = raw.into_iter().filter(|s| seen.insert(s.0)).collect();
        check_series(&samples)?;
    }
}

/// A selected group and its (window start, count, sum) records.
type Selected = ([String; 6], Vec<(i64, u64, f64)>);

/// Filtered queries over a few hundred series, part in rollup files and part
/// in the head, at every level: the naive fold of the series whose group *at
/// that level* passes the filter. Filters on fields that the level blanks
/// match "" only.
#[test]
fn filtered_queries_over_many_series() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(config(dir.path())).unwrap();
    let mut stored = Model::new();
    let n = 400;
    for slot in 0..6 {
        for i in 0..n {
            let r = st.series_ref(key_of(i)).unwrap();
            let (t, v) = (slot_ts(slot) + i as i64, (i % 13) as f64 - slot as f64);
            st.append(&[r], &[t], &[v]).unwrap();
            stored.insert((i, t), v);
        }
        if slot == 2 {
            st.flush().unwrap();
        }
    }
    let s = |v: &str| Some(v.to_string());
    let filters = [
        RollupFilter::default(),
        RollupFilter {
            metric: s("m1"),
            ..Default::default()
        },
        RollupFilter {
            cluster: s("c1"),
            rack: s("k0"),
            ..Default::default()
        },
        RollupFilter {
            host: s("h1"),
            ..Default::default()
        },
        RollupFilter {
            host: s(""),
            gpu: s(""),
            ..Default::default()
        },
        RollupFilter {
            metric: s("m0"),
            row: s(""),
            gpu: s("1"),
            ..Default::default()
        },
        RollupFilter {
            metric: s("m0"),
            cluster: s(""),
            row: s("r0"),
            rack: s("k1"),
            host: s("h0"),
            gpu: s("0"),
        },
        RollupFilter {
            metric: s("no such metric"),
            ..Default::default()
        },
    ];
    let (lo, hi) = (slot_ts(1), slot_ts(4));
    let mut nonempty = 0;
    for level in RollupLevel::ALL {
        for tier in [RollupTier::Minute, RollupTier::Hour] {
            let all = naive(&stored, tier, level);
            for f in &filters {
                let passes = |g: &[String; 6]| {
                    let ok = |f: &Option<String>, v: &String| f.as_ref().is_none_or(|f| f == v);
                    ok(&f.metric, &g[0])
                        && ok(&f.cluster, &g[1])
                        && ok(&f.row, &g[2])
                        && ok(&f.rack, &g[3])
                        && ok(&f.host, &g[4])
                        && ok(&f.gpu, &g[5])
                };
                let want: Vec<Selected> = all
                    .iter()
                    .filter(|(g, _)| passes(g))
                    .map(|(g, w)| {
                        let recs = w
                            .iter()
                            .filter(|(ws, _)| **ws <= hi && **ws + tier.window_ms() > lo)
                            .map(|(ws, n)| (*ws, n.count, n.sum))
                            .collect();
                        (g.clone(), recs)
                    })
                    .filter(|(_, recs): &(_, Vec<_>)| !recs.is_empty())
                    .collect();
                let got: Vec<Selected> = st
                    .select_rollups(tier, level, f, lo, hi)
                    .into_iter()
                    .map(|(g, recs)| {
                        (
                            [g.metric, g.cluster, g.row, g.rack, g.host, g.gpu],
                            recs.iter()
                                .map(|r| (r.window_start_ms, r.count, r.sum))
                                .collect(),
                        )
                    })
                    .collect();
                assert_eq!(got, want, "{level:?} {tier:?} {f:?}");
                nonempty += usize::from(!want.is_empty());
            }
        }
    }
    // Not a vacuous comparison: about half of the (level, tier, filter)
    // triples select something (42 of 80 with this topology).
    assert!((30..70).contains(&nonempty), "{nonempty}");
}

/// `matches_at` is `matches` of the projection, for every level and a
/// filter on each single field, with the field's value, "" and another one.
#[test]
fn matches_at_is_matches_of_the_projection() {
    let g = RollupGroup {
        metric: "m".into(),
        cluster: "c".into(),
        row: "r".into(),
        rack: "k".into(),
        host: "h".into(),
        gpu: "0".into(),
    };
    let mut filters = vec![RollupFilter::default()];
    for v in ["m", "c", "r", "k", "h", "0", "", "x"] {
        let v = Some(v.to_string());
        let mut fs: [RollupFilter; 6] = Default::default();
        fs[0].metric = v.clone();
        fs[1].cluster = v.clone();
        fs[2].row = v.clone();
        fs[3].rack = v.clone();
        fs[4].host = v.clone();
        fs[5].gpu = v;
        filters.extend(fs);
    }
    let mut matched = 0;
    for level in RollupLevel::ALL {
        for f in &filters {
            let want = f.matches(&g.at_level(level));
            assert_eq!(f.matches_at(&g, level), want, "{level:?} {f:?}");
            matched += usize::from(want);
        }
    }
    assert!(matched > 0 && matched < 5 * filters.len());
}

/// Rewrites a current (version 4) file as version 1 or 2 wrote it: each
/// block's records as rows, per `docs/format/rollup.md` (an encoder of its
/// own, not the file module's), raw (version 1, flags 0) or under zstd
/// (version 2); checksums and offsets recomputed. Expects one block per tier
/// and level, as small tables have.
fn as_rows(cur: &[u8], version: u32) -> Vec<u8> {
    let v4 = as_version(cur, 4);
    let v3 = &v4[..];
    use crate::codec::{put_str, put_uvarint, put_varint};
    let u64_at = |b: &[u8], at: usize| u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
    let f = file::RollupFile::from_bytes(v3).unwrap();
    let fo = v3.len() - file::FOOTER_LEN;
    let (co, cl) = (u64_at(v3, fo) as usize, u64_at(v3, fo + 8) as usize);
    let mut out = v3[..8].to_vec();
    out.extend_from_slice(&version.to_le_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    let mut pos = file::HEADER_LEN;
    while pos < co {
        let h = &v3[pos..pos + file::BLOCK_HEADER_LEN];
        let plen = u32::from_le_bytes(h[4..8].try_into().unwrap()) as usize;
        let (tier, level) = (
            RollupTier::ALL[h[0] as usize],
            RollupLevel::ALL[h[1] as usize],
        );
        let mut groups: Vec<(RollupGroup, Vec<RollupRecord>)> = Vec::new();
        f.for_each(tier, level, i64::MIN, i64::MAX, |g, r| {
            match groups.last_mut() {
                Some((last, rs)) if last == g => rs.push(r),
                _ => groups.push((g.clone(), vec![r])),
            }
        })
        .unwrap();
        let mut raw = Vec::new();
        put_uvarint(&mut raw, groups.len() as u64);
        for (g, rs) in &groups {
            for s in [&g.metric, &g.cluster, &g.row, &g.rack, &g.host, &g.gpu] {
                put_str(&mut raw, s);
            }
            put_uvarint(&mut raw, rs.len() as u64);
            let mut prev = None;
            for r in rs {
                let ws = r.window_start_ms;
                put_varint(&mut raw, prev.map_or(ws, |p| ws - p));
                prev = Some(ws);
                put_uvarint(&mut raw, r.count);
                for v in [r.sum, r.min, r.max, r.first] {
                    raw.extend_from_slice(&v.to_le_bytes());
                }
                put_uvarint(&mut raw, (r.first_ts_ms - ws) as u64);
                raw.extend_from_slice(&r.last.to_le_bytes());
                put_uvarint(&mut raw, (r.last_ts_ms - ws) as u64);
            }
        }
        let stored = if version == 1 {
            raw
        } else {
            let mut z = Vec::new();
            put_uvarint(&mut z, raw.len() as u64);
            z.extend_from_slice(&zstd::bulk::compress(&raw, 3).unwrap());
            z
        };
        let mut nh = h[..24].to_vec();
        nh[2] = u8::from(version == 2);
        nh[3] = 0;
        nh[4..8].copy_from_slice(&(stored.len() as u32).to_le_bytes());
        let crc = crc32c::crc32c_append(crc32c::crc32c(&nh), &stored);
        nh.extend_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&nh);
        out.extend_from_slice(&stored);
        pos += file::BLOCK_HEADER_LEN + plen;
    }
    let new_co = out.len() as u64;
    out.extend_from_slice(&v3[co..co + cl]);
    let mut footer = v3[fo..].to_vec();
    footer[..8].copy_from_slice(&new_co.to_le_bytes());
    out.extend_from_slice(&earlier_footer(&footer));
    out
}

/// A record's fields as bits, so that NaN compares equal to itself.
fn bits(r: &RollupRecord) -> [u64; 9] {
    [
        r.window_start_ms as u64,
        r.count,
        r.sum.to_bits(),
        r.min.to_bits(),
        r.max.to_bits(),
        r.first.to_bits(),
        r.first_ts_ms as u64,
        r.last.to_bits(),
        r.last_ts_ms as u64,
    ]
}

/// Every record of every tier and level, in the reader's order.
fn read_all(bytes: &[u8]) -> Vec<(RollupTier, RollupLevel, RollupGroup, [u64; 9])> {
    let f = file::RollupFile::from_bytes(bytes).unwrap();
    let mut all = Vec::new();
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            f.for_each(tier, level, i64::MIN, i64::MAX, |g, r| {
                all.push((tier, level, g.clone(), bits(&r)));
            })
            .unwrap();
        }
    }
    all
}

/// GPU `i`'s group of `metric`: 8 GPUs a host, `per_rack` GPUs a rack.
fn gpu_group(metric: String, i: usize, per_rack: usize) -> RollupGroup {
    RollupGroup {
        metric,
        cluster: "c".into(),
        row: "r".into(),
        rack: format!("rack-{}", i / per_rack),
        host: format!("host-{}", i / 8),
        gpu: (i % 8).to_string(),
    }
}

/// 200 GPUs' groups, 30 minutes each, values that move a little from
/// minute to minute and from GPU to GPU (as temperatures do).
fn gpu_tables() -> Tables {
    let mut tables = empty_tables();
    for i in 0..200usize {
        let g = gpu_group(format!("DCGM_FI_DEV_METRIC_{:02}", i % 20), i, 50);
        let records: Vec<RollupRecord> = (0..30i64)
            .map(|m| {
                RollupRecord::of_sample(
                    m * 60_000,
                    m * 60_000 + 7,
                    (i as f64 * 3.0 + m as f64).floor(),
                )
            })
            .collect();
        add_to_tables(&mut tables, &g, &records);
    }
    tables
}

/// A read decodes the fields it is asked for, bit for bit, and leaves the
/// others NaN (values) or at the window start (timestamps); a block's first
/// read decodes every field, whatever it is asked.
#[test]
fn a_read_decodes_the_fields_asked_for() {
    // Records of two samples each, so that every field differs from the others.
    let mut tables = empty_tables();
    for i in 0..60usize {
        let g = gpu_group(format!("M{}", i % 3), i, 16);
        let records: Vec<RollupRecord> = (0..90i64)
            .map(|m| {
                let mut r = RollupRecord::of_sample(m * 60_000, m * 60_000 + 7, i as f64 + 0.25);
                r.merge(&RollupRecord::of_sample(
                    m * 60_000,
                    m * 60_000 + 41_000,
                    m as f64 * 1.5,
                ));
                r
            })
            .collect();
        add_to_tables(&mut tables, &g, &records);
    }
    let bytes = file::encode(3, i64::MIN, &[(1, 1)], &tables);
    let read = |f: &file::RollupFile, tier, level, fields| {
        let mut out = Vec::new();
        f.for_each_group(
            tier,
            level,
            (i64::MIN, i64::MAX),
            &RollupFilter::default(),
            fields,
            |g, rs| {
                out.extend(rs.into_iter().map(|r| (g.clone(), r)));
            },
        )
        .unwrap();
        out
    };
    let on = |sum, min, max, first, last| RecordFields {
        sum,
        min,
        max,
        first,
        last,
    };
    let subsets = [
        RecordFields::NONE,
        on(true, false, false, false, false),
        on(false, true, true, false, false),
        on(false, false, false, true, false),
        on(false, false, false, false, true),
        RecordFields::ALL,
    ];
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            let fresh = file::RollupFile::from_bytes(&bytes).unwrap();
            // The first read, asked for nothing, decodes everything.
            let all = read(&fresh, tier, level, RecordFields::NONE);
            let want: Vec<_> = tables[tier.index()][level.index()]
                .groups()
                .flat_map(|(g, rs)| rs.map(move |r| (g.clone(), *r)))
                .collect();
            assert!(!want.is_empty());
            assert_eq!(all.len(), want.len(), "{tier:?} {level:?}");
            for ((g, r), (wg, w)) in all.iter().zip(&want) {
                assert_eq!((g, bits(r)), (wg, bits(w)));
            }
            for fields in subsets {
                let got = read(&fresh, tier, level, fields);
                assert_eq!(got.len(), want.len());
                for ((g, r), (wg, w)) in got.iter().zip(&want) {
                    assert_eq!(g, wg);
                    let value = |asked: bool, got: f64, want: f64| {
                        if asked {
                            assert_eq!(got.to_bits(), want.to_bits(), "{fields:?}");
                        } else {
                            assert!(got.is_nan(), "{fields:?}: {got}");
                        }
                    };
                    assert_eq!((r.window_start_ms, r.count), (w.window_start_ms, w.count));
                    value(fields.sum, r.sum, w.sum);
                    value(fields.min, r.min, w.min);
                    value(fields.max, r.max, w.max);
                    value(fields.first, r.first, w.first);
                    value(fields.last, r.last, w.last);
                    let times = fields.first || fields.last;
                    let ws = w.window_start_ms;
                    assert_eq!(
                        (r.first_ts_ms, r.last_ts_ms),
                        if times {
                            (w.first_ts_ms, w.last_ts_ms)
                        } else {
                            (ws, ws)
                        },
                        "{fields:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn earlier_versions_read_as_they_did_and_columns_are_smaller() {
    let tables = gpu_tables();
    let v4 = file::encode(3, i64::MIN, &[(1, 1)], &tables);
    let v3 = as_version(&v4, 3);
    assert_eq!(v3[8..12], 3u32.to_le_bytes());
    let (v1, v2) = (as_rows(&v4, 1), as_rows(&v4, 2));
    assert!(
        v2.len() * 3 < v1.len(),
        "zstd blocks: {} vs {} bytes",
        v2.len(),
        v1.len()
    );
    assert!(
        v3.len() * 2 < v2.len(),
        "columns: {} vs rows {} bytes",
        v3.len(),
        v2.len()
    );
    let (a, b, c) = (read_all(&v1), read_all(&v2), read_all(&v3));
    assert_eq!(c, read_all(&v4));
    let minutes_at_gpu = a
        .iter()
        .filter(|x| x.0 == RollupTier::Minute && x.1 == RollupLevel::Gpu)
        .count();
    assert_eq!(minutes_at_gpu, 200 * 30);
    assert_eq!(a, b);
    assert_eq!(a, c);
    // What the tables hold, record for record: the reader's order is the
    // tables' (groups ascending, windows ascending).
    let mut want = Vec::new();
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            for (g, windows) in &tables[tier.index()][level.index()] {
                for r in windows.values() {
                    want.push((tier, level, g.clone(), bits(r)));
                }
            }
        }
    }
    assert_eq!(c, want);
    // A version 1 file may not carry version 2's flags.
    let mut flagged = v1.clone();
    flagged[file::HEADER_LEN + 2] = 1;
    assert!(file::RollupFile::from_bytes(&flagged).is_err());
    // The golden file of version 2 still reads as the tables it was made of.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/seeds/rollup_open/golden-v2.groll");
    let old = std::fs::read(path).unwrap();
    assert_eq!(old[8..12], 2u32.to_le_bytes());
    assert_eq!(
        read_all(&old),
        read_all(&file::encode(9, i64::MIN, &[(3, 5)], &golden_tables()))
    );
}

/// The names are what SQL users filter on (`level = 'rack'`, `tier = '1h'`)
/// and what cluster peers send in rollup tickets: fixed, and read back.
#[test]
fn tier_and_level_names_are_fixed_and_read_back() {
    let tiers: Vec<&str> = RollupTier::ALL.iter().map(|t| t.label()).collect();
    assert_eq!(tiers, ["1m", "1h", "1d"]);
    let levels: Vec<&str> = RollupLevel::ALL.iter().map(|l| l.name()).collect();
    assert_eq!(levels, ["gpu", "host", "rack", "row", "cluster"]);
    for t in RollupTier::ALL {
        assert_eq!(RollupTier::by_label(t.label()), Some(t));
    }
    for l in RollupLevel::ALL {
        assert_eq!(RollupLevel::by_name(l.name()), Some(l));
    }
    assert_eq!(RollupTier::by_label("1s"), None);
    assert_eq!(RollupLevel::by_name("Rack"), None);
}

/// The old flush path, one series at a time through [`add_to_tables`]
/// (each gpu-level group's minutes merged first, as it did), against the
/// level-by-level [`delta_tables`]: the same tables. Sample values are small
/// integers, so sums are exact in any order of merging.
fn delta_tables_by_series(delta: &RollupDelta) -> Tables {
    let mut tables = empty_tables();
    let mut by_group: BTreeMap<&RollupGroup, Vec<RollupRecord>> = BTreeMap::new();
    for (g, minutes) in delta {
        by_group.entry(g).or_default().extend_from_slice(minutes);
    }
    for (g, minutes) in by_group {
        let mut merged: BTreeMap<i64, RollupRecord> = BTreeMap::new();
        for r in minutes {
            merged
                .entry(r.window_start_ms)
                .and_modify(|m| m.merge(&r))
                .or_insert(r);
        }
        let merged: Vec<RollupRecord> = merged.into_values().collect();
        add_to_tables(&mut tables, g, &merged);
    }
    tables
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn delta_tables_level_by_level_equal_the_series_one_by_one(
        series in prop::collection::vec(
            (
                0usize..3,  // metric
                0usize..16, // gpu slot: 2 rows x 2 racks x 2 hosts x 2 gpus; a
                            // (metric, slot) drawn twice is a repeated group
                prop::collection::vec((0i64..200, 0i64..60_000, -50i32..50), 0..12),
            ),
            0..40,
        )
    ) {
        let delta: RollupDelta = series
            .into_iter()
            .map(|(metric, slot, samples)| {
                let group = Arc::new(RollupGroup {
                    metric: format!("m{metric}"),
                    cluster: "c".into(),
                    row: format!("row-{}", slot / 8),
                    rack: format!("rack-{}", slot / 4),
                    host: format!("host-{}", slot / 2),
                    gpu: (slot % 2).to_string(),
                });
                // One series' minutes: each sample folded into its minute,
                // in window order, as a head series holds them.
                let mut minutes: BTreeMap<i64, RollupRecord> = BTreeMap::new();
                for (minute, offset, v) in samples {
                    let ts = minute * 60_000 + offset;
                    let ws = RollupTier::Minute.window_start(ts);
                    minutes
                        .entry(ws)
                        .and_modify(|r| r.add(ts, f64::from(v)))
                        .or_insert_with(|| RollupRecord::of_sample(ws, ts, f64::from(v)));
                }
                (group, minutes.into_values().collect())
            })
            .collect();
        let runs = delta_tables(&delta, i64::MAX);
        // Groups and windows in order, as the encoder needs them.
        for table in runs.iter().flatten() {
            prop_assert!(table.windows(2).all(|w| w[0].0 < w[1].0), "groups in order");
            for (_, windows) in table {
                prop_assert!(
                    windows
                        .windows(2)
                        .all(|w| w[0].window_start_ms < w[1].window_start_ms)
                );
            }
        }
        let as_maps: Tables = runs.map(|levels| {
            levels.map(|table| {
                table
                    .into_iter()
                    .map(|(g, w)| {
                        let windows = w.into_iter().map(|r| (r.window_start_ms, r));
                        (Arc::unwrap_or_clone(g), windows.collect())
                    })
                    .collect()
            })
        });
        let mut want = delta_tables_by_series(&delta);
        prop_assert_eq!(&as_maps, &want);
        // With a cut, the gpu-level minutes before it only; the rest as is.
        let cut = 100 * 60_000;
        let gpu_minutes = &mut want[RollupTier::Minute.index()][RollupLevel::Gpu.index()];
        gpu_minutes.retain(|_, windows| {
            windows.retain(|&ws, _| ws < cut);
            !windows.is_empty()
        });
        let cut_maps: Tables = delta_tables(&delta, cut).map(|levels| {
            levels.map(|table| {
                table
                    .into_iter()
                    .map(|(g, w)| {
                        let windows = w.into_iter().map(|r| (r.window_start_ms, r));
                        (Arc::unwrap_or_clone(g), windows.collect())
                    })
                    .collect()
            })
        });
        prop_assert_eq!(cut_maps, want);
    }
}

/// Times `delta_tables` on a flush-sized delta (200,000 series x 60
/// minutes); run by hand: `cargo test --release -p storage --lib
/// delta_tables_timing -- --ignored --nocapture`.
#[test]
#[ignore = "a timing, run by hand"]
fn delta_tables_timing() {
    let delta: RollupDelta = (0..200_000usize)
        .map(|i| {
            let (host, gpu, metric) = (i / 200, (i / 25) % 8, i % 25);
            let g = Arc::new(RollupGroup {
                metric: format!("DCGM_FI_DEV_METRIC_{metric:02}"),
                cluster: "prod-1".into(),
                row: format!("row-{}", host / 40),
                rack: format!("rack-{}", host / 4),
                host: format!("gpu-node-{host:05}"),
                gpu: gpu.to_string(),
            });
            let minutes = (0..60i64)
                .map(|m| RollupRecord::of_sample(m * 60_000, m * 60_000 + 5, (i % 100) as f64))
                .collect();
            (g, minutes)
        })
        .collect();
    let t = std::time::Instant::now();
    let tables = delta_tables(&delta, i64::MAX);
    let built = t.elapsed();
    drop(tables);
    eprintln!(
        "delta_tables: built in {built:?}, dropped in {:?}",
        t.elapsed() - built
    );
}

#[test]
fn is_at_level_is_equality_with_the_projection() {
    for mask in 0..16u8 {
        let field = |bit: u8, v: &str| {
            if mask & bit != 0 {
                v.to_string()
            } else {
                String::new()
            }
        };
        let g = RollupGroup {
            metric: "m".into(),
            cluster: "c".into(),
            row: field(1, "r"),
            rack: field(2, "k"),
            host: field(4, "h"),
            gpu: field(8, "0"),
        };
        for level in RollupLevel::ALL {
            assert_eq!(
                g.is_at_level(level),
                g == g.at_level(level),
                "{g:?} {level:?}"
            );
        }
    }
}

/// A file of one block (zstd-compressed, as version 3 writes them) whose
/// raw payload is `raw`, every checksum right: what the reader sees when a
/// payload that passes its CRC is wrong.
fn file_of_payload(tier: RollupTier, level: RollupLevel, ws: (i64, i64), raw: &[u8]) -> Vec<u8> {
    use crate::codec::put_uvarint;
    let mut out = b"GPLSROL1".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    let crc = crc32c::crc32c(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    let mut stored = Vec::new();
    put_uvarint(&mut stored, raw.len() as u64);
    stored.extend_from_slice(&zstd::bulk::compress(raw, 3).unwrap());
    let mut h = vec![tier.index() as u8, level.index() as u8, 1, 0];
    h.extend_from_slice(&(stored.len() as u32).to_le_bytes());
    h.extend_from_slice(&ws.0.to_le_bytes());
    h.extend_from_slice(&ws.1.to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&h), &stored);
    h.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&stored);
    let covers_off = out.len() as u64;
    let covers = [0u8];
    out.extend_from_slice(&covers);
    let fo = out.len();
    for v in [covers_off, 1, 1, 0, ws.0 as u64, ws.1 as u64 + 59_999] {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out.extend_from_slice(&crc32c::crc32c(&covers).to_le_bytes());
    let crc = crc32c::crc32c(&out[fo..]);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(b"GPLREND1");
    out
}

/// A version 3 payload: one gpu-level group of minute records given as
/// (window start in minutes, count, first offset, last - first, value).
fn columnar_payload(records: &[(i64, i64, i64, i64, f64)], extra: &[u8]) -> Vec<u8> {
    use crate::codec::{put_str, put_uvarint};
    let mut raw = Vec::new();
    put_uvarint(&mut raw, 1);
    for s in ["m", "c", "", "", "h", "0"] {
        put_str(&mut raw, s);
    }
    put_uvarint(&mut raw, records.len() as u64);
    let mut block = Vec::new();
    for col in [
        records.iter().map(|r| r.0).collect::<Vec<_>>(),
        records.iter().map(|r| r.1).collect(),
        records.iter().map(|r| r.2).collect(),
        records.iter().map(|r| r.3).collect(),
    ] {
        block.clear();
        crate::column::encode_ints(&col, &mut block);
        put_uvarint(&mut raw, block.len() as u64);
        raw.extend_from_slice(&block);
    }
    let values: Vec<f64> = records.iter().map(|r| r.4).collect();
    for _ in 0..5 {
        block.clear();
        crate::column::encode_values(&values, &mut block);
        put_uvarint(&mut raw, block.len() as u64);
        raw.extend_from_slice(&block);
    }
    raw.extend_from_slice(extra);
    raw
}

#[test]
fn a_forged_columnar_block_is_corrupt_never_a_panic() {
    let (t, l) = (RollupTier::Minute, RollupLevel::Gpu);
    let range = (60_000, 180_000);
    let open = |records: &[(i64, i64, i64, i64, f64)], extra: &[u8]| {
        file::RollupFile::from_bytes(&file_of_payload(
            t,
            l,
            range,
            &columnar_payload(records, extra),
        ))
    };
    // Well formed: minutes 1 and 3, counts 6 and 1.
    let good = [(1, 6, 0, 50_000, 2.5), (3, 1, 7, 0, 3.0)];
    let f = open(&good, &[]).unwrap();
    let mut got = Vec::new();
    f.for_each(t, l, i64::MIN, i64::MAX, |_, r| got.push(r))
        .unwrap();
    assert_eq!(
        got.iter()
            .map(|r| (r.window_start_ms, r.count, r.last_ts_ms, r.sum))
            .collect::<Vec<_>>(),
        [(60_000, 6, 110_000, 2.5), (180_000, 1, 180_007, 3.0)]
    );
    let corrupt =
        |r: crate::Result<file::RollupFile>| matches!(r, Err(crate::Error::Corrupt { .. }));
    // Windows not ascending (equal, then going back), a window past the
    // block's range, a count of 0 or negative, a first offset of a whole
    // window or negative, a span past the window or negative, bytes after
    // the columns.
    assert!(corrupt(open(&[(1, 6, 0, 1, 1.0), (1, 1, 0, 1, 1.0)], &[])));
    assert!(corrupt(open(&[(2, 6, 0, 1, 1.0), (1, 1, 0, 1, 1.0)], &[])));
    assert!(corrupt(open(&[(4, 6, 0, 1, 1.0)], &[])));
    assert!(corrupt(open(&[(1, 0, 0, 1, 1.0)], &[])));
    assert!(corrupt(open(&[(1, -1, 0, 1, 1.0)], &[])));
    assert!(corrupt(open(&[(1, 1, 60_000, 0, 1.0)], &[])));
    assert!(corrupt(open(&[(1, 1, -1, 0, 1.0)], &[])));
    assert!(corrupt(open(&[(1, 2, 9, 59_991, 1.0)], &[])));
    assert!(corrupt(open(&[(1, 2, 9, -1, 1.0)], &[])));
    assert!(corrupt(open(&good, &[0])));
    // A window that overflows when turned into milliseconds.
    assert!(corrupt(open(&[(i64::MAX / 2, 1, 0, 0, 1.0)], &[])));
    // Every cut of the payload, and every byte changed, behind valid
    // checksums: an error or a file that reads, never a panic.
    let raw = columnar_payload(&good, &[]);
    for cut in 0..raw.len() {
        assert!(corrupt(file::RollupFile::from_bytes(&file_of_payload(
            t,
            l,
            range,
            &raw[..cut]
        ))));
    }
    for i in 0..raw.len() {
        for x in [0x01u8, 0x80, 0xff] {
            let mut b = raw.clone();
            b[i] ^= x;
            if let Ok(f) = file::RollupFile::from_bytes(&file_of_payload(t, l, range, &b)) {
                f.for_each(t, l, i64::MIN, i64::MAX, |_, _| {}).unwrap();
            }
        }
    }
}

/// A group with more windows than a block holds (an import of years of
/// minutes) goes on in the next block, and reads back whole, in order.
#[test]
fn a_group_longer_than_a_block_spans_blocks() {
    let n = file::MAX_BLOCK_RECORDS as i64 + 5;
    let mut tables = empty_tables();
    let (a, b) = (
        RollupGroup {
            metric: "a".into(),
            gpu: "0".into(),
            ..Default::default()
        },
        RollupGroup {
            metric: "b".into(),
            gpu: "0".into(),
            ..Default::default()
        },
    );
    let t = &mut tables[RollupTier::Minute.index()][RollupLevel::Gpu.index()];
    t.entry(a.clone()).or_default().extend((0..n).map(|m| {
        (
            m * 60_000,
            RollupRecord::of_sample(m * 60_000, m * 60_000 + 1, m as f64),
        )
    }));
    t.entry(b.clone())
        .or_default()
        .insert(0, RollupRecord::of_sample(0, 2, -1.0));
    let bytes = file::encode(1, i64::MIN, &[(1, 1)], &tables);
    let f = file::RollupFile::from_bytes(&bytes).unwrap();
    let mut got: Vec<(String, i64, f64)> = Vec::new();
    f.for_each(
        RollupTier::Minute,
        RollupLevel::Gpu,
        i64::MIN,
        i64::MAX,
        |g, r| got.push((g.metric.clone(), r.window_start_ms, r.sum)),
    )
    .unwrap();
    assert_eq!(got.len() as i64, n + 1);
    for (m, (metric, ws, sum)) in got.iter().take(n as usize).enumerate() {
        assert_eq!(
            (metric.as_str(), *ws, *sum),
            ("a", m as i64 * 60_000, m as f64)
        );
    }
    assert_eq!(got[n as usize], ("b".to_owned(), 0, -1.0));
    // Two blocks (the footer's count; only this table has records): the
    // first full, the second with the rest of `a` and all of `b`.
    let fo = bytes.len() - file::FOOTER_LEN;
    assert_eq!(bytes[fo + 16..fo + 24], 2u64.to_le_bytes());
}

/// Encoding and opening the rollup file of 200,000 series x 1 h of noisy
/// minutes (15 M records in all tiers and levels), the flush's share of
/// issue #18's table. Run with
/// `cargo test --release -p storage --lib rollup_file_timing -- --ignored --nocapture`.
#[test]
#[ignore = "timing, for docs/BENCHMARKS.md"]
fn rollup_file_timing() {
    let value = |i: usize, k: usize| ((i * 7 + k * 13) % 1_000) as f64 * 0.5;
    let delta: RollupDelta = (0..200_000usize)
        .map(|i| {
            let (host, gpu, metric) = (i / 200, (i / 25) % 8, i % 25);
            let g = Arc::new(RollupGroup {
                metric: format!("DCGM_FI_DEV_METRIC_{metric:02}"),
                cluster: "prod-1".into(),
                row: format!("row-{}", host / 40),
                rack: format!("rack-{}", host / 4),
                host: format!("gpu-node-{host:05}"),
                gpu: gpu.to_string(),
            });
            let minutes = (0..60i64)
                .map(|m| {
                    let ws = m * 60_000;
                    let mut r = RollupRecord::of_sample(ws, ws + 5, value(i, m as usize * 6));
                    for k in 1..6 {
                        let s = RollupRecord::of_sample(
                            ws,
                            ws + 5 + k * 10_000,
                            value(i, (m * 6 + k) as usize),
                        );
                        r.merge(&s);
                    }
                    r
                })
                .collect();
            (g, minutes)
        })
        .collect();
    // As a flush writes them: the gpu-level minutes are folded from raw data.
    let tables = delta_tables(&delta, i64::MIN);
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let bytes = file::encode(1, i64::MIN, &[(1, 1)], &tables);
        let encoded = t.elapsed();
        let t = std::time::Instant::now();
        let f = file::RollupFile::from_bytes(&bytes).unwrap();
        eprintln!(
            "encode {encoded:?} ({} bytes), open {:?}",
            bytes.len(),
            t.elapsed()
        );
        drop(f);
    }
}

/// A data directory whose rollup files a flush wrote before version 4 (with
/// the gpu-level minutes of every sample) opens with every tier and level
/// counting each sample once: the gpu-level minutes that raw data still
/// holds are dropped from those files, once, and those of samples whose raw
/// data is gone are kept.
#[test]
fn rollup_files_of_version_3_count_each_sample_once() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let st = Storage::open(cfg.clone()).unwrap();
    // Raw data from slot 100 on; slots 0..50 had theirs dropped by retention
    // (they are only in the old rollup file).
    let mut in_raw = Model::new();
    let mut gone = Model::new();
    for i in 0..6 {
        for slot in (0..50).chain(100..160) {
            let v = (i * 1000) as f64 + slot as f64 * 0.5;
            let m = if slot < 50 { &mut gone } else { &mut in_raw };
            m.insert((i, slot_ts(slot)), v);
        }
    }
    let mut keys: Vec<_> = in_raw.keys().copied().collect();
    keys.sort();
    for &(i, t) in &keys {
        let r = st.series_ref(key_of(i)).unwrap();
        st.append(&[r], &[t], &[in_raw[&(i, t)]]).unwrap();
    }
    st.flush().unwrap().expect("a segment");
    let flushed = st.rollup_file_handles();
    assert_eq!(flushed.len(), 1);
    let (id, wal_cut, path) = (
        flushed[0].id(),
        flushed[0].wal_cut(),
        flushed[0].path().to_path_buf(),
    );
    assert!(wal_cut > 0);
    drop(flushed);
    drop(st);
    // The same flush as version 3 wrote it, with the older samples too.
    let mut everything = in_raw.clone();
    everything.extend(gone.iter().map(|(k, v)| (*k, *v)));
    let mut tables = empty_tables();
    let mut by_series: BTreeMap<(usize, i64), f64> = BTreeMap::new();
    by_series.extend(everything.iter().map(|(k, v)| (*k, *v)));
    for i in 0..6 {
        let mut minutes: Vec<RollupRecord> = Vec::new();
        for (&(_, t), &v) in by_series.range((i, i64::MIN)..=(i, i64::MAX)) {
            let ws = RollupTier::Minute.window_start(t);
            match minutes.last_mut() {
                Some(r) if r.window_start_ms == ws => r.add(t, v),
                _ => minutes.push(RollupRecord::of_sample(ws, t, v)),
            }
        }
        add_to_tables(&mut tables, &RollupGroup::of_series(&key_of(i)), &minutes);
    }
    let v3 = as_version(&file::encode(wal_cut, i64::MIN, &[(id, id)], &tables), 3);
    std::fs::write(&path, &v3).unwrap();

    for _ in 0..2 {
        let st = Storage::open(cfg.clone()).unwrap();
        check(&st, &everything).unwrap();
        let files = st.rollup_file_handles();
        assert!(files.iter().all(|f| f.version() == file::VERSION));
        assert_eq!(
            st.raw_cut(),
            RollupTier::Minute.window_start(slot_ts(100)),
            "the cut is the minute of the oldest raw sample"
        );
    }
    // With no raw data left at all, the old file's records all stay.
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    drop(Storage::open(cfg.clone()).unwrap());
    std::fs::write(
        dir.path()
            .join(crate::files::ROLLUPS_DIR)
            .join(crate::files::rollup_file_name(7)),
        &v3,
    )
    .unwrap();
    let st = Storage::open(cfg.clone()).unwrap();
    check(&st, &everything).unwrap();
    drop(st);
    let st = Storage::open(cfg).unwrap();
    check(&st, &everything).unwrap();
    // Samples after the newest old record are folded from raw data.
    let t = slot_ts(200);
    let r = st.series_ref(key_of(0)).unwrap();
    st.append(&[r], &[t], &[1.5]).unwrap();
    st.flush().unwrap();
    everything.insert((0, t), 1.5);
    check(&st, &everything).unwrap();
}

/// Reading one metric's gpu-level minutes for 2 h of a 200-GPU fleet (10 s
/// interval), folded from the raw segment, and then from a rollup file once
/// retention's cut has passed the raw data. Run with
/// `cargo test --release -p storage --lib gpu_minutes_read_timing -- --ignored --nocapture`.
#[test]
#[ignore = "timing, for docs/BENCHMARKS.md"]
fn gpu_minutes_read_timing() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.max_chunk_samples = 720;
    let st = Storage::open(cfg).unwrap();
    let (metrics, gpus, step, n) = (53usize, 200usize, 10_000i64, 720i64);
    let keys: Vec<SeriesKey> = (0..metrics * gpus)
        .map(|i| {
            let (m, g) = (i % metrics, i / metrics);
            SeriesKey::new(
                format!("DCGM_FI_DEV_METRIC_{m:02}"),
                vec![
                    Label::new("Hostname", format!("node-{:03}", g / 8)),
                    Label::new("gpu", (g % 8).to_string()),
                    Label::new("rack", format!("rack-{}", g / 32)),
                ],
            )
            .unwrap()
        })
        .collect();
    let refs = st.series_refs(keys).unwrap();
    let t0 = 1_796_032_800_000i64;
    for k in 0..n {
        let ts = vec![t0 + k * step; refs.len()];
        let vals: Vec<f64> = (0..refs.len())
            .map(|i| ((i * 31 + k as usize * 7) % 500) as f64 * 0.25)
            .collect();
        st.append(&refs, &ts, &vals).unwrap();
    }
    st.flush().unwrap();
    let filter = RollupFilter {
        metric: Some("DCGM_FI_DEV_METRIC_07".into()),
        ..RollupFilter::default()
    };
    let read = |what: &str| {
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let got = st.select_rollups(
                RollupTier::Minute,
                RollupLevel::Gpu,
                &filter,
                t0,
                t0 + n * step,
            );
            let records: usize = got.iter().map(|(_, r)| r.len()).sum();
            eprintln!("{what}: {records} records in {:?}", t.elapsed());
            assert_eq!(records, gpus * 120);
        }
    };
    read("folded from raw data");
    st.advance_raw_cut(t0 + n * step, t0 + n * step).unwrap();
    read("from a rollup file");
}

/// Moving the raw cut over raw data that spans the whole storable range
/// sparsely, and over dense data, writes a file per step of samples (not
/// per hour of time), and every tier and level still counts each sample once.
#[test]
fn the_raw_cut_moves_in_steps_of_samples_not_of_time() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path());
    cfg.ooo_window = std::time::Duration::from_secs(u32::MAX as u64 * 1000);
    cfg.retention_1m = None;
    let st = Storage::open(cfg).unwrap();
    let mut stored = Model::new();
    // Both ends of the storable range, and 40 dense samples in between.
    let mut at: Vec<i64> = vec![crate::MIN_TS_MS, crate::MAX_TS_MS];
    at.extend((0..40).map(slot_ts));
    for (k, &t) in at.iter().enumerate() {
        let i = k % 3;
        let r = st.series_ref(key_of(i)).unwrap();
        st.append(&[r], &[t], &[k as f64]).unwrap();
        stored.insert((i, t), k as f64);
    }
    st.flush().unwrap();
    let files = st.rollup_files();
    let cut = RollupTier::Minute.window_start(crate::MAX_TS_MS);
    st.advance_raw_cut_by(cut, crate::MAX_TS_MS, 10).unwrap();
    assert_eq!(st.raw_cut(), cut);
    // 41 samples before the cut (one chunk each at most 7 samples), 10 a step:
    // a handful of files, where steps of time would be billions.
    let written = st.rollup_files() - files;
    assert!((2..=8).contains(&written), "{written} files");
    check(&st, &stored).unwrap();
    let minutes = st.select_rollups(
        RollupTier::Minute,
        RollupLevel::Gpu,
        &RollupFilter::default(),
        i64::MIN,
        i64::MAX,
    );
    let n: u64 = minutes.iter().flat_map(|(_, r)| r).map(|r| r.count).sum();
    assert_eq!(n, at.len() as u64);
}

/// `rollup_read_cost` counts the groups of every block a read decodes (at
/// `GROUP_READ_COST` each) and the head's samples of the metric: 3 metrics
/// of 10 GPUs flushed into one block per level (30 gpu-level groups, the
/// block's metrics m0..m2), then 5 series more in the head, with 2 samples
/// each.
#[test]
fn read_cost_counts_the_groups_decoded_and_the_head_samples() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = None;
    let st = Storage::open(cfg).unwrap();
    let key = |m: &str, gpu: usize| {
        SeriesKey::new(
            m,
            vec![
                Label::new("Hostname", "h0"),
                Label::new("gpu", gpu.to_string()),
            ],
        )
        .unwrap()
    };
    const T: i64 = 1_796_032_800_000;
    for m in ["m0", "m1", "m2"] {
        for gpu in 0..10 {
            let r = st.series_ref(key(m, gpu)).unwrap();
            st.append(&[r, r], &[T + 1_000, T + 61_000], &[1.0, 2.0])
                .unwrap();
        }
    }
    st.flush().unwrap();
    for gpu in 10..15 {
        let r = st.series_ref(key("m3", gpu)).unwrap();
        let at = [T + 2 * 3_600_000, T + 3 * 3_600_000];
        st.append(&[r, r], &at, &[1.0, 2.0]).unwrap();
    }
    let head = 10;
    let cost = |m: Option<&str>, from: i64, to: i64| {
        st.rollup_read_cost(RollupTier::Hour, RollupLevel::Gpu, m, from, to)
    };
    let day = T + 86_400_000;
    let block = 30 * crate::db::GROUP_READ_COST;
    assert_eq!(cost(Some("m1"), T, day), block);
    assert_eq!(cost(None, T, day), block + head);
    // A metric past the block's, and windows after it: nothing decoded.
    assert_eq!(cost(Some("m3"), T, day), head);
    assert_eq!(cost(Some("m1"), T + 3_600_000, day), 0);
}

proptest! {
    /// A query's records, added run by run in any order (files, a flush in
    /// progress, memory), come out one per window in window order, each the
    /// fold of every record of its window, as computed here field by field.
    #[test]
    fn query_merges_records_added_in_any_order(
        adds in prop::collection::vec((0usize..3, 0i64..8, 0i64..50, 0u64..4), 0..60),
    ) {
        let groups: Vec<RollupGroup> = (0..3)
            .map(|i| RollupGroup {
                metric: "m".into(),
                rack: format!("k{i}"),
                ..Default::default()
            })
            .collect();
        let filter = RollupFilter::default();
        let mut q = Query::new(RollupTier::Minute, RollupLevel::Rack, &filter, i64::MIN, i64::MAX);
        // (group, window) -> (count, sum, min, max, (first_ts, first), (last_ts, last))
        type Fold = (u64, f64, f64, f64, (i64, f64), (i64, f64));
        let mut want: BTreeMap<(usize, i64), Fold> = BTreeMap::new();
        for &(g, w, v, c) in &adds {
            let ws = w * 60_000;
            let (ts, v) = (ws + v * 1000, v as f64);
            let r = RollupRecord {
                window_start_ms: ws,
                count: c + 1,
                sum: v * (c + 1) as f64,
                min: v,
                max: v,
                first: v,
                first_ts_ms: ts,
                last: v,
                last_ts_ms: ts,
            };
            q.add_record(&groups[g], r);
            let e = want.entry((g, ws)).or_insert((0, 0.0, f64::MAX, f64::MIN, (i64::MAX, 0.0), (i64::MIN, 0.0)));
            e.0 += c + 1;
            e.1 += v * (c + 1) as f64;
            e.2 = e.2.min(v);
            e.3 = e.3.max(v);
            if (ts, v) < e.4 {
                e.4 = (ts, v);
            }
            if (ts, v) > e.5 {
                e.5 = (ts, v);
            }
        }
        let got: Vec<((usize, i64), Fold)> = q
            .finish()
            .into_iter()
            .flat_map(|(g, records)| {
                let gi = groups.iter().position(|x| *x == g).unwrap();
                records.into_iter().map(move |r| {
                    ((gi, r.window_start_ms), (r.count, r.sum, r.min, r.max, (r.first_ts_ms, r.first), (r.last_ts_ms, r.last)))
                })
            })
            .collect();
        prop_assert_eq!(got, want.into_iter().collect::<Vec<_>>());
    }
}

/// A flush looks groups up by their borrowed text: that must hash and
/// compare as the owned group does, at every level.
#[test]
fn borrowed_groups_hash_and_compare_as_owned_ones() {
    use std::hash::BuildHasher;
    let hasher = crate::series::KeyHasher::default();
    for i in 0..200 {
        let key = key_of(i);
        let owned = RollupGroup {
            metric: key.metric().to_string(),
            cluster: key.get("cluster").unwrap_or_default().to_string(),
            row: key.get("row").unwrap_or_default().to_string(),
            rack: key.get("rack").unwrap_or_default().to_string(),
            host: (key.get("Hostname").or_else(|| key.get("hostname")))
                .unwrap_or_default()
                .to_string(),
            gpu: key.get("gpu").unwrap_or_default().to_string(),
        };
        assert_eq!(RollupGroup::of_series(&key), owned);
        for level in RollupLevel::ALL {
            let (o, b) = (
                owned.at_level(level),
                GroupRef::of_series(&key).at_level(level),
            );
            assert_eq!(b.to_group(), o);
            assert_eq!(hasher.hash_one(b), hasher.hash_one(&o));
            assert!(hashbrown::Equivalent::equivalent(&b, &o));
        }
    }
}
