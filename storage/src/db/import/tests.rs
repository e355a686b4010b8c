//! Imports against a naive fold: imported records are folds (computed here,
//! without the code under test) of a "history" of samples, so after any mix of
//! imports, appends, flushes and crashes every tier and level must equal the
//! naive fold of history plus the raw samples stored.

use std::collections::BTreeMap;

use super::*;
use crate::rollup::tests::Naive;
use crate::{Label, RollupFilter, SeriesKey, StorageConfig};

/// Test series `i` (0..12): metric, host, gpu; rack from host; one row, one cluster.
fn topo(i: usize) -> [String; 6] {
    let metric = ["temp", "power"][i % 2];
    let host = (i / 2) % 3;
    let gpu = i / 6;
    let rack = if host < 2 { "k0" } else { "k1" };
    [
        metric.into(),
        "c0".into(),
        "r0".into(),
        rack.into(),
        format!("h{host}"),
        gpu.to_string(),
    ]
}

fn key_of(i: usize) -> SeriesKey {
    let t = topo(i);
    SeriesKey::new(
        t[0].clone(),
        vec![
            Label::new("cluster", t[1].clone()),
            Label::new("row", t[2].clone()),
            Label::new("rack", t[3].clone()),
            Label::new("Hostname", t[4].clone()),
            Label::new("gpu", t[5].clone()),
            Label::new("UUID", format!("GPU-{i}")),
        ],
    )
    .unwrap()
}

fn gpu_group(i: usize) -> RollupGroup {
    let [metric, cluster, row, rack, host, gpu] = topo(i);
    RollupGroup {
        metric,
        cluster,
        row,
        rack,
        host,
        gpu,
    }
}

/// The group of series `i` at `level`, blanked by hand.
fn group_of(i: usize, level: RollupLevel) -> [String; 6] {
    let keep = match level {
        RollupLevel::Gpu => 6,
        RollupLevel::Host => 5,
        RollupLevel::Rack => 4,
        RollupLevel::Row => 3,
        RollupLevel::Cluster => 2,
    };
    let t = topo(i);
    std::array::from_fn(|k| {
        if k < keep {
            t[k].clone()
        } else {
            String::new()
        }
    })
}

type Folded = BTreeMap<[String; 6], BTreeMap<i64, Naive>>;

/// Folds `(series, ts, value)` samples at `tier`, with the ties rule of the module docs.
fn fold(
    samples: &[(usize, i64, f64)],
    tier: RollupTier,
    group: impl Fn(usize) -> [String; 6],
) -> Folded {
    let w = tier.window_ms();
    let mut out = Folded::new();
    for &(i, t, v) in samples {
        out.entry(group(i))
            .or_default()
            .entry(t.div_euclid(w) * w)
            .or_insert(Naive::EMPTY)
            .add(t, v);
    }
    out
}

fn record(ws: i64, n: &Naive) -> RollupRecord {
    RollupRecord {
        window_start_ms: ws,
        count: n.count,
        sum: n.sum,
        min: n.min,
        max: n.max,
        first: n.first.1,
        first_ts_ms: n.first.0,
        last: n.last.1,
        last_ts_ms: n.last.0,
    }
}

/// Import items for `history`: per tier and series, the fold of its
/// even-indexed samples and, as a second item, of its odd-indexed ones, so the
/// import has to merge records of the same window.
fn items(history: &[(usize, i64, f64)]) -> Vec<(RollupTier, RollupGroup, Vec<RollupRecord>)> {
    let mut out = Vec::new();
    for parity in 0..2 {
        let part: Vec<_> = history
            .iter()
            .enumerate()
            .filter(|(k, _)| k % 2 == parity)
            .map(|(_, s)| *s)
            .collect();
        for tier in RollupTier::ALL {
            for i in 0..12 {
                let mine: Vec<_> = part.iter().copied().filter(|s| s.0 == i).collect();
                let recs: Vec<RollupRecord> = fold(&mine, tier, |i| group_of(i, RollupLevel::Gpu))
                    .into_values()
                    .flat_map(|w| w.into_iter().map(|(ws, n)| record(ws, &n)))
                    .collect();
                out.push((tier, gpu_group(i), recs));
            }
        }
    }
    out
}

/// Deterministic samples: `n` per series, every ~17 minutes from `t0`, integer values.
fn samples(seed: u64, t0: i64, n: i64) -> Vec<(usize, i64, f64)> {
    let mut x = seed;
    let mut next = move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 33) as i64
    };
    let mut out = Vec::new();
    for i in 0..12 {
        for k in 0..n {
            out.push((
                i,
                t0 + k * 1_013_000 + next() % 1000,
                (next() % 200 - 50) as f64,
            ));
        }
    }
    out
}

fn check(st: &Storage, all: &[(usize, i64, f64)]) {
    for tier in RollupTier::ALL {
        for level in RollupLevel::ALL {
            let want = fold(all, tier, |i| group_of(i, level));
            let got = st.select_rollups(tier, level, &RollupFilter::default(), i64::MIN, i64::MAX);
            let got_keys: Vec<[String; 6]> = got
                .iter()
                .map(|(g, _)| {
                    [&g.metric, &g.cluster, &g.row, &g.rack, &g.host, &g.gpu].map(|s| s.clone())
                })
                .collect();
            let want_keys: Vec<[String; 6]> = want.keys().cloned().collect();
            assert_eq!(got_keys, want_keys, "groups of {tier:?} {level:?}");
            for ((_, recs), (g, wins)) in got.iter().zip(&want) {
                assert_eq!(
                    recs.len(),
                    wins.len(),
                    "windows of {tier:?} {level:?} {g:?}"
                );
                for (r, (&ws, n)) in recs.iter().zip(wins) {
                    let ctx = format!("{tier:?} {level:?} {g:?} window {ws}");
                    assert_eq!(r.window_start_ms, ws, "{ctx}");
                    assert_eq!(r.count, n.count, "{ctx}");
                    assert_eq!(r.sum, n.sum, "{ctx} (integer values: sums are exact)");
                    assert_eq!((r.min, r.max), (n.min, n.max), "{ctx}");
                    assert_eq!((r.first_ts_ms, r.first), n.first, "{ctx}");
                    assert_eq!((r.last_ts_ms, r.last), n.last, "{ctx}");
                }
            }
        }
    }
}

fn config(dir: &std::path::Path) -> StorageConfig {
    let mut cfg = StorageConfig::new(dir);
    cfg.max_chunk_samples = 7;
    cfg.ooo_window = std::time::Duration::from_secs(30 * 86_400);
    cfg.retention = None;
    cfg
}

/// Appends `rows` one sample per call; returns them (all have distinct
/// (series, ts), so every one is stored).
fn append(st: &Storage, rows: &[(usize, i64, f64)]) {
    for &(i, t, v) in rows {
        let r = st.series_ref(key_of(i)).unwrap();
        let out = st.append(&[r], &[t], &[v]).unwrap();
        assert_eq!(out.accepted, 1);
    }
}

/// Import, append, crash (drop without flush), reopen: rollups equal the
/// import plus the fold of the raw samples, with raw samples appended before
/// the import (still in the head, or flushed) and after it.
#[test]
fn import_then_crash_replays_exactly_the_unflushed_samples() {
    const T0: i64 = 1_780_000_000_000;
    // History overlaps the raw samples' hour and day windows.
    let history = samples(1, T0 - 3 * 86_400_000, 300);
    let raw_a = samples(2, T0, 40);
    let raw_b = samples(3, T0 + 40 * 1_013_000, 40);
    for flush_before_import in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let cfg = config(dir.path());
        let st = Storage::open(cfg.clone()).unwrap();
        append(&st, &raw_a);
        if flush_before_import {
            st.flush().unwrap();
        }
        let files = st.rollup_files();
        let s = st.import_rollups(items(&history)).unwrap();
        assert_eq!(st.rollup_files(), files + 1, "one file per import");
        assert!(s.file_id.is_some() && s.bytes > 0 && s.records > s.gpu_records);
        append(&st, &raw_b);
        let all: Vec<_> = history
            .iter()
            .chain(&raw_a)
            .chain(&raw_b)
            .copied()
            .collect();
        check(&st, &all);
        drop(st);
        let st = Storage::open(cfg.clone()).unwrap();
        check(&st, &all);
        // And once more through a flush, a compaction and a clean reopen.
        st.flush().unwrap();
        while st.compact().unwrap().is_some() {}
        check(&st, &all);
        drop(st);
        let st = Storage::open(cfg).unwrap();
        check(&st, &all);
    }
}

/// A bad record fails the whole import, writes nothing and does not panic.
#[test]
fn bad_records_are_rejected_and_nothing_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(config(dir.path())).unwrap();
    let h = RollupTier::Hour.window_ms();
    let good = RollupRecord {
        window_start_ms: 10 * h,
        count: 2,
        sum: 3.0,
        min: 1.0,
        max: 2.0,
        first: 1.0,
        first_ts_ms: 10 * h,
        last: 2.0,
        last_ts_ms: 11 * h - 1,
    };
    let bads = [
        RollupRecord {
            window_start_ms: 10 * h + 1,
            first_ts_ms: 10 * h + 1,
            ..good
        },
        RollupRecord { count: 0, ..good },
        RollupRecord {
            first_ts_ms: 10 * h - 1,
            ..good
        },
        RollupRecord {
            last_ts_ms: 11 * h,
            ..good
        },
        RollupRecord {
            first_ts_ms: 10 * h + 5,
            last_ts_ms: 10 * h + 4,
            ..good
        },
        RollupRecord {
            window_start_ms: i64::MIN,
            first_ts_ms: i64::MIN,
            last_ts_ms: i64::MIN,
            ..good
        },
        RollupRecord {
            window_start_ms: i64::MAX - i64::MAX % h,
            first_ts_ms: i64::MAX - i64::MAX % h,
            last_ts_ms: i64::MAX,
            ..good
        },
    ];
    for bad in bads {
        let items = vec![
            (RollupTier::Hour, gpu_group(0), vec![good]),
            (RollupTier::Hour, gpu_group(1), vec![good, bad]),
        ];
        let e = st.import_rollups(items).unwrap_err();
        assert!(matches!(e, Error::BadBatch { .. }), "{bad:?}: {e}");
    }
    // Windows far apart: too many for one file block.
    let far = RollupRecord {
        window_start_ms: 10 * h + (1 << 24) * h,
        first_ts_ms: 10 * h + (1 << 24) * h,
        last_ts_ms: 10 * h + (1 << 24) * h,
        ..good
    };
    let e = st
        .import_rollups([(RollupTier::Hour, gpu_group(0), vec![good, far])])
        .unwrap_err();
    assert!(matches!(e, Error::BadBatch { .. }), "{e}");
    assert_eq!(st.rollup_files(), 0);
    assert_eq!(
        st.import_rollups([(RollupTier::Day, gpu_group(0), vec![])])
            .unwrap(),
        RollupImportSummary::default()
    );
    assert_eq!(st.rollup_files(), 0);
    let none = st.select_rollups(
        RollupTier::Hour,
        RollupLevel::Cluster,
        &RollupFilter::default(),
        i64::MIN,
        i64::MAX,
    );
    assert!(none.is_empty());
    // The good record alone imports, at every level.
    st.import_rollups([(RollupTier::Hour, gpu_group(0), vec![good])])
        .unwrap();
    for level in RollupLevel::ALL {
        let got = st.select_rollups(
            RollupTier::Hour,
            level,
            &RollupFilter::default(),
            i64::MIN,
            i64::MAX,
        );
        assert_eq!(got.len(), 1, "{level:?}");
        assert_eq!(got[0].1, vec![good], "{level:?}");
    }
    assert!(
        st.select_rollups(
            RollupTier::Day,
            RollupLevel::Gpu,
            &RollupFilter::default(),
            i64::MIN,
            i64::MAX
        )
        .is_empty(),
        "an hour record is not folded into the day tier"
    );
}

/// More groups than one file block holds, over several metrics: a metric
/// filter (which skips blocks by their metric range) returns exactly the
/// filtered groups of the unfiltered answer.
#[test]
fn metric_filter_skips_blocks_but_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(config(dir.path())).unwrap();
    let h = RollupTier::Hour.window_ms();
    let rec = |v: f64| RollupRecord {
        window_start_ms: 7 * h,
        count: 1,
        sum: v,
        min: v,
        max: v,
        first: v,
        first_ts_ms: 7 * h + 5,
        last: v,
        last_ts_ms: 7 * h + 5,
    };
    let items = (0..9000u32).map(|i| {
        let g = RollupGroup {
            metric: format!("m{}", i % 3),
            cluster: "c".into(),
            row: "r".into(),
            rack: format!("k{}", i / 64),
            host: format!("h{}", i / 8),
            gpu: (i % 8).to_string(),
        };
        (RollupTier::Hour, g, vec![rec(f64::from(i))])
    });
    st.import_rollups(items).unwrap();
    let all = st.select_rollups(
        RollupTier::Hour,
        RollupLevel::Gpu,
        &RollupFilter::default(),
        i64::MIN,
        i64::MAX,
    );
    assert_eq!(all.len(), 9000);
    for m in ["m0", "m1", "m2", "m", "m3", "a", "z"] {
        let filter = RollupFilter {
            metric: Some(m.into()),
            ..Default::default()
        };
        let got = st.select_rollups(
            RollupTier::Hour,
            RollupLevel::Gpu,
            &filter,
            i64::MIN,
            i64::MAX,
        );
        let want: Vec<_> = all.iter().filter(|(g, _)| g.metric == m).cloned().collect();
        assert_eq!(got, want, "metric {m}");
    }
}
