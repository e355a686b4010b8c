//! Rollup-tier answers against raw evaluation: the same engine over the same
//! storage, with and without tiers, on seeded random data, must give the same
//! label sets and values (sums up to rounding), and the tiers must answer
//! the aligned queries.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use storage::{Label, SeriesKey, Storage, StorageConfig};

use super::super::{PromEngine, PromError, PromValue};

/// 2026-11-30T10:00:00Z: a whole hour (not a whole day).
const T0: i64 = 1_796_032_800_000;
const H: i64 = 3_600_000;
const D: i64 = 24 * H;

/// xorshift64*: seeded, independent of the code under test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn key(metric: &str, host: &str, gpu: &str, extra: Option<(&str, &str)>) -> SeriesKey {
    let mut labels = vec![
        Label::new("Hostname", host),
        Label::new("gpu", gpu),
        Label::new("rack", "r0"),
    ];
    labels.extend(extra.map(|(n, v)| Label::new(n, v)));
    SeriesKey::new(metric, labels).unwrap()
}

/// 16 series (2 metrics × 2 hosts × 4 GPUs) from an hour before `T0` to 30 h
/// after, at random intervals of 20-400 s; a sample on a whole hour with
/// probability `on_hour` in 1000. The first 60 % flushed, the rest in the head.
fn storage(seed: u64, on_hour: u64) -> (tempfile::TempDir, Arc<Storage>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = None;
    let st = Arc::new(Storage::open(cfg).unwrap());
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut flushed = false;
    let mut all: Vec<(SeriesKey, Vec<i64>, Vec<f64>)> = Vec::new();
    for metric in ["m0", "m1"] {
        for host in ["h0", "h1"] {
            for gpu in ["0", "1", "2", "3"] {
                let (mut ts, mut vs) = (Vec::new(), Vec::new());
                let mut t = T0 - H + rng.below(400_000) as i64;
                while t < T0 + 30 * H {
                    let at = if rng.below(1000) < on_hour {
                        (t / H + 1) * H
                    } else {
                        t
                    };
                    if ts.last().is_none_or(|&l| at > l) {
                        ts.push(at);
                        vs.push((rng.below(200_000) as f64 - 100_000.0) / 1000.0);
                    }
                    t = at + 20_000 + rng.below(380_000) as i64;
                }
                all.push((key(metric, host, gpu, None), ts, vs));
            }
        }
    }
    for phase in 0..2 {
        let split = T0 + 18 * H;
        for (k, ts, vs) in &all {
            let r = st.series_ref(k.clone()).unwrap();
            let keep: Vec<usize> = (0..ts.len())
                .filter(|&i| (ts[i] < split) == (phase == 0))
                .collect();
            let t: Vec<i64> = keep.iter().map(|&i| ts[i]).collect();
            let v: Vec<f64> = keep.iter().map(|&i| vs[i]).collect();
            st.append(&vec![r; t.len()], &t, &v).unwrap();
        }
        if !flushed {
            st.flush().unwrap();
            flushed = true;
        }
    }
    (dir, st)
}

/// A result's series: labels (as text) and points, sorted by labels.
type Points = Vec<(String, Vec<(i64, f64)>)>;

/// A result as [`Points`], for comparison.
fn points(v: Result<PromValue, PromError>) -> Result<Points, PromError> {
    let mut out: Points = match v? {
        PromValue::Vector(v) => v
            .into_iter()
            .map(|s| (format!("{:?}", s.labels), vec![(s.t_ms, s.v)]))
            .collect(),
        PromValue::Matrix(m) => m
            .into_iter()
            .map(|s| {
                let pts = s.points.clone();
                (format!("{:?}", s.labels), pts)
            })
            .collect(),
        other => panic!("unexpected {other:?}"),
    };
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

fn same(q: &str, tiered: Result<PromValue, PromError>, raw: Result<PromValue, PromError>) {
    let (a, b) = (points(tiered), points(raw));
    match (&a, &b) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.len(), b.len(), "{q}: series {a:?} vs {b:?}");
            for ((la, pa), (lb, pb)) in a.iter().zip(b) {
                assert_eq!(la, lb, "{q}");
                assert_eq!(pa.len(), pb.len(), "{q} {la}: points");
                for (&(ta, va), &(tb, vb)) in pa.iter().zip(pb) {
                    assert_eq!(ta, tb, "{q} {la}");
                    let close = va == vb || (va - vb).abs() <= 1e-12 * vb.abs().max(1.0);
                    assert!(close, "{q} {la} at {ta}: tier {va} vs raw {vb}");
                }
            }
        }
        _ => assert_eq!(a, b, "{q}"),
    }
}

const FUNCTIONS: [&str; 5] = [
    "sum_over_time",
    "count_over_time",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
];

/// Every function, selector and alignment: the tiered engine answers as the
/// raw one. Returns how many answers came from a tier.
fn differential(st: &Arc<Storage>) -> u64 {
    let tiered = PromEngine::new(st.clone());
    let raw = PromEngine::new(st.clone()).without_rollup_tiers();
    let day = (T0 / D + 1) * D;
    for f in FUNCTIONS {
        for sel in [
            "m0",
            r#"m1{gpu="1"}"#,
            r#"m0{Hostname="h1"}"#,
            r#"{rack="r0"}"#,
        ] {
            for (range, offset) in [("1h", ""), ("1h", " offset 2h"), ("1d", ""), ("30m", "")] {
                let q = format!("{f}({sel}[{range}]{offset})");
                for t in [
                    T0 + 2 * H,
                    T0 + 10 * H,
                    T0 + 29 * H,
                    T0 + 29 * H + 1,
                    day + D,
                ] {
                    same(&q, tiered.instant(&q, t), raw.instant(&q, t));
                }
                for (start, end, step) in [
                    (T0 + H, T0 + 29 * H, H),
                    (T0 + 3 * H, T0 + 27 * H, 3 * H),
                    (T0 + H + 60_000, T0 + 29 * H, H),
                ] {
                    let tier = tiered.range(&q, start, end, step);
                    same(&q, tier, raw.range(&q, start, end, step));
                }
                // Under an aggregation, as dashboards have it.
                let agg = format!("avg by (Hostname) ({q})");
                same(
                    &agg,
                    tiered.range(&agg, T0 + H, T0 + 29 * H, H),
                    raw.range(&agg, T0 + H, T0 + 29 * H, H),
                );
            }
        }
    }
    assert_eq!(raw.metrics().rollup_tier_answers.load(Relaxed), 0);
    tiered.metrics().rollup_tier_answers.load(Relaxed)
}

#[test]
fn rollup_tier_answers_equal_raw_evaluation() {
    // Seeds 1-4: no sample on a whole hour, so the aligned queries are all
    // answered from the tiers.
    for seed in 1..=4 {
        let (_dir, st) = storage(seed, 0);
        let answered = differential(&st);
        assert!(answered >= 100, "seed {seed}: {answered} tier answers");
    }
    // Seeds 5-8: samples on whole hours, which the tiers must leave to raw
    // evaluation wherever they touch a window.
    for seed in 5..=8 {
        let (_dir, st) = storage(seed, 30);
        differential(&st);
    }
}

/// A tier answer is the same every time: its elements come in label order
/// (as raw evaluation's do), so an aggregation over them sums in one order,
/// whatever order the records were read in.
#[test]
fn tier_answers_are_the_same_every_time() {
    let (_dir, st) = storage(3, 0);
    let q = "sum(sum_over_time(m0[1h])) / 7 + avg(avg_over_time(m1[1h]))";
    let bits = |p: &Points| -> Vec<u64> {
        p.iter()
            .flat_map(|(_, pts)| pts.iter().map(|&(_, v)| v.to_bits()))
            .collect()
    };
    let tiered = PromEngine::new(st.clone());
    let first = points(tiered.range(q, T0 + H, T0 + 29 * H, H)).unwrap();
    assert_eq!(first[0].1.len(), 29);
    for _ in 0..30 {
        let again = points(tiered.range(q, T0 + H, T0 + 29 * H, H)).unwrap();
        assert_eq!(bits(&again), bits(&first), "{q}");
    }
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 31 * 2);
}

/// Two series in one gpu-level group (they differ in a label the group does
/// not have): the group's record is theirs together, so a selector of one
/// of them is answered from raw samples.
#[test]
fn a_group_of_two_series_is_answered_from_raw_samples() {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    for (pod, v) in [("a", 1.0), ("b", 100.0)] {
        let r = st
            .series_ref(key("m0", "h0", "0", Some(("pod", pod))))
            .unwrap();
        let ts: Vec<i64> = (0..60).map(|i| T0 + 30_000 + i * 60_000).collect();
        st.append(&vec![r; ts.len()], &ts, &vec![v; ts.len()])
            .unwrap();
    }
    let tiered = PromEngine::new(st.clone());
    let q = r#"sum_over_time(m0{pod="a"}[1h])"#;
    let got = points(tiered.instant(q, T0 + H)).unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].1,
        vec![(T0 + H, 60.0)],
        "pod a alone: 60 samples of 1"
    );
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 0);
    // Equalities on the group's labels narrow the count of its members,
    // not past the label the group lacks.
    let q = r#"sum_over_time(m0{pod="a", rack="r0", gpu="0", Hostname="h0"}[1h])"#;
    let got = points(tiered.instant(q, T0 + H)).unwrap();
    assert_eq!(got[0].1, vec![(T0 + H, 60.0)]);
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 0);
    // Both pods: each series is still not alone in its group.
    let both = points(tiered.instant("sum_over_time(m0[1h])", T0 + H)).unwrap();
    assert_eq!(both.len(), 2);
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 0);
}

/// Appends one sample a minute (at second 1) of `v` over hours `[from, to)`
/// after `T0`, `stale` at `T0 + 1h30m` if asked, and flushes them.
fn minutes(st: &Storage, k: &SeriesKey, from: i64, to: i64, v: f64, stale_in_hour_1: bool) {
    let r = st.series_ref(k.clone()).unwrap();
    let stale = f64::from_bits(crate::promql::STALE_NAN_BITS);
    let ts: Vec<i64> = (from * 60..to * 60)
        .map(|m| T0 + m * 60_000 + 1_000)
        .collect();
    let vs: Vec<f64> = ts
        .iter()
        .map(|&t| {
            if stale_in_hour_1 && t == T0 + H + 30 * 60_000 + 1_000 {
                stale
            } else {
                v
            }
        })
        .collect();
    st.append(&vec![r; ts.len()], &ts, &vs).unwrap();
}

/// A staleness marker (which raw evaluation drops, and a record counts as a
/// NaN) leaves the answer to raw evaluation.
#[test]
fn stale_markers_are_left_to_raw_evaluation() {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    minutes(&st, &key("m0", "h0", "0", None), 0, 5, 2.0, true);
    st.flush().unwrap();
    let tiered = PromEngine::new(st.clone());
    let raw = PromEngine::new(st.clone()).without_rollup_tiers();
    let q = "sum_over_time(m0[1h])";
    same(q, tiered.instant(q, T0 + 2 * H), raw.instant(q, T0 + 2 * H));
    assert_eq!(
        points(raw.instant(q, T0 + 2 * H)).unwrap()[0].1,
        vec![(T0 + 2 * H, 118.0)],
        "59 samples of 2: the marker is not one"
    );
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 0);
    // Hour 3 alone is answered from the tier.
    same(q, tiered.instant(q, T0 + 3 * H), raw.instant(q, T0 + 3 * H));
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 1);
}

/// A range answer's points as (labels, [(t, v)]) sorted, and its notes.
fn answer(a: crate::promql::Answer) -> (Points, Vec<String>) {
    assert!(a.warnings.is_empty(), "{:?}", a.warnings);
    (points(Ok(a.value)).unwrap(), a.notes)
}

/// Raw data dropped by retention (hours 0-5), whose hour records stay: the
/// windows before the raw cut are answered from the tier, as the records
/// have them, with a note; the later ones as raw evaluation has them.
#[test]
fn windows_before_the_raw_cut_are_answered_from_the_tier_with_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = Some(std::time::Duration::from_secs(3600));
    let st = Arc::new(Storage::open(cfg).unwrap());
    // GPU h0/0: hours 0-10 in two segments, a stale marker in hour 1.
    // GPU h1/0: hours 0-5 only. Both have a label the groups do not keep.
    let (a, b) = (
        key("m0", "h0", "0", Some(("job", "dcgm"))),
        key("m0", "h1", "0", Some(("pod", "x"))),
    );
    // GPU h2/0 names its host `hostname`, which its group keeps as
    // `Hostname`: hours 0-10.
    let c = SeriesKey::new(
        "m0",
        vec![
            Label::new("hostname", "h2"),
            Label::new("gpu", "0"),
            Label::new("rack", "r0"),
        ],
    )
    .unwrap();
    minutes(&st, &a, 0, 5, 2.0, true);
    minutes(&st, &b, 0, 5, 3.0, false);
    minutes(&st, &c, 0, 5, 5.0, false);
    st.flush().unwrap();
    minutes(&st, &a, 5, 10, 2.0, false);
    minutes(&st, &c, 5, 10, 5.0, false);
    st.flush().unwrap();
    assert_eq!(st.enforce_retention(T0 + 6 * H), 1);
    assert_eq!(
        st.raw_cut(),
        T0 + 5 * H,
        "the minute after the newest dropped sample"
    );

    let tiered = PromEngine::new(st.clone());
    let raw = PromEngine::new(st.clone()).without_rollup_tiers();
    let q = "sum_over_time(m0[1h])";
    let (got, notes) = answer(tiered.range_answer(q, T0 + 2 * H, T0 + 9 * H, H).unwrap());
    let labels_a = r#"[("Hostname", "h0"), ("gpu", "0"), ("job", "dcgm"), ("rack", "r0")]"#;
    let labels_b = r#"[("Hostname", "h1"), ("gpu", "0"), ("rack", "r0")]"#;
    let labels_c = r#"[("gpu", "0"), ("hostname", "h2"), ("rack", "r0")]"#;
    // h0/0, with the labels of its live series: no point for hour 1 (its
    // record holds the marker's NaN), then 60 samples of 2 an hour; h1/0
    // with its group's labels (no `pod`): 60 samples of 3; h2/0: 60 of 5.
    let hours = |from: i64, to: i64, v: f64| (from..=to).map(|h| (T0 + h * H, v)).collect();
    assert_eq!(
        got,
        vec![
            (labels_a.to_string(), hours(3, 9, 120.0)),
            (labels_b.to_string(), hours(2, 5, 180.0)),
            (labels_c.to_string(), hours(2, 9, 300.0)),
        ]
    );
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with("raw samples before 2026-11-30T15:00:00")
            && notes[0].contains("answered from the gpu-level 1h rollups"),
        "{notes:?}"
    );
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 1);
    // The live windows are raw evaluation's.
    let (live, raw_notes) = answer(raw.range_answer(q, T0 + 6 * H, T0 + 9 * H, H).unwrap());
    assert_eq!(
        live,
        vec![
            (labels_a.to_string(), hours(6, 9, 120.0)),
            (labels_c.to_string(), hours(6, 9, 300.0)),
        ]
    );
    assert!(raw_notes.is_empty());

    // `Hostname="h2"` matches h2/0's group, not its series: the expired
    // windows from the group, nothing after them.
    let q = r#"sum_over_time(m0{Hostname="h2"}[1h])"#;
    let (got, _) = answer(tiered.range_answer(q, T0 + 2 * H, T0 + 9 * H, H).unwrap());
    let group_c = r#"[("Hostname", "h2"), ("gpu", "0"), ("rack", "r0")]"#;
    assert_eq!(got, vec![(group_c.to_string(), hours(2, 5, 300.0))]);
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 2);

    // A matcher on a label the groups do not keep: raw evaluation, which
    // has nothing left of h1/0, and a note that says so.
    let q = r#"sum_over_time(m0{pod="x"}[1h])"#;
    let (got, notes) = answer(tiered.range_answer(q, T0 + 2 * H, T0 + 9 * H, H).unwrap());
    assert!(got.is_empty(), "{got:?}");
    assert!(notes[0].contains("misses them"), "{notes:?}");
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 2);

    // After the cut, the tier answers as before, without a note.
    let q = "sum_over_time(m0[1h])";
    let (got, notes) = answer(tiered.range_answer(q, T0 + 7 * H, T0 + 9 * H, H).unwrap());
    assert_eq!(
        got,
        vec![
            (labels_a.to_string(), hours(7, 9, 120.0)),
            (labels_c.to_string(), hours(7, 9, 300.0)),
        ]
    );
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(tiered.metrics().rollup_tier_answers.load(Relaxed), 3);
}

/// `avg(avg_over_time(m[1h]))` over 7 days at 1-hour steps for 320 GPUs
/// (30 s interval, 6.5 M samples), from raw samples and from the hour tier.
/// Run with `CARGO_PROFILE_RELEASE_DEBUG_ASSERTIONS=true cargo test --release
/// -p query --lib tier_timing -- --ignored --nocapture` (the PostgreSQL
/// tests of the library need debug assertions to build).
#[test]
#[ignore = "timing, for docs/BENCHMARKS.md"]
fn tier_timing() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = None;
    cfg.max_chunk_samples = 1024;
    let st = Arc::new(Storage::open(cfg).unwrap());
    let keys: Vec<SeriesKey> = (0..320)
        .map(|g| {
            key(
                "power",
                &format!("h{:02}", g / 8),
                &(g % 8).to_string(),
                None,
            )
        })
        .collect();
    let refs = st.series_refs(keys).unwrap();
    let start = T0 - 7 * D;
    let mut t = start + 1_000;
    let mut k = 0u64;
    while t < T0 {
        let vals: Vec<f64> = (0..refs.len() as u64)
            .map(|i| ((i * 7919 + k * 104_729) % 7000) as f64 / 10.0)
            .collect();
        st.append(&refs, &vec![t; refs.len()], &vals).unwrap();
        t += 30_000;
        k += 1;
        if k.is_multiple_of(2880) {
            st.flush().unwrap();
        }
    }
    st.flush().unwrap();
    let q = "avg(avg_over_time(power[1h]))";
    for (what, engine) in [
        (
            "raw samples",
            PromEngine::new(st.clone()).without_rollup_tiers(),
        ),
        ("hour tier", PromEngine::new(st.clone())),
    ] {
        for _ in 0..3 {
            let t = std::time::Instant::now();
            let v = engine.range(q, start + H, T0, H).unwrap();
            let n = match v {
                PromValue::Matrix(m) => m.iter().map(|s| s.points.len()).sum::<usize>(),
                _ => 0,
            };
            eprintln!("{what}: {n} points in {:?}", t.elapsed());
        }
    }
}

/// The tier answers where it reads less than raw evaluation would: 48 hours
/// of one series at 10 s (17,280 samples) flushed to the rollup files,
/// against the 1,500 samples of another series of the metric in the head
/// (folded by every tier read of the metric), and not for the last two of
/// those hours (about 1,000 raw samples). Either way every hour holds 360
/// samples of 2.
#[test]
fn the_tier_answers_where_it_reads_less_than_raw_samples() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.retention = None;
    let st = Arc::new(Storage::open(cfg).unwrap());
    let r = st.series_ref(key("m0", "h0", "0", None)).unwrap();
    let ts: Vec<i64> = (0..48 * 360).map(|i| T0 + 5_000 + i * 10_000).collect();
    st.append(&vec![r; ts.len()], &ts, &vec![2.0; ts.len()])
        .unwrap();
    st.flush().unwrap();
    let other = st.series_ref(key("m0", "h1", "1", None)).unwrap();
    let ts: Vec<i64> = (0..1500).map(|i| T0 + i * 1_000).collect();
    st.append(&vec![other; ts.len()], &ts, &vec![1.0; ts.len()])
        .unwrap();
    let tiered = PromEngine::new(st.clone());
    let q = r#"sum_over_time(m0{gpu="0"}[1h])"#;
    let answered = || tiered.metrics().rollup_tier_answers.load(Relaxed);
    // One series (its labels aside) with 720 at every hour.
    let expect = |from: i64, to: i64| -> Points {
        vec![(
            String::new(),
            (from..=to).map(|h| (T0 + h * H, 720.0)).collect(),
        )]
    };
    let strip =
        |p: Points| -> Points { p.into_iter().map(|(_, pts)| (String::new(), pts)).collect() };
    let all = strip(points(tiered.range(q, T0 + H, T0 + 48 * H, H)).unwrap());
    assert_eq!(all, expect(1, 48));
    assert_eq!(answered(), 1, "48 hours from the tier");
    let last = strip(points(tiered.range(q, T0 + 47 * H, T0 + 48 * H, H)).unwrap());
    assert_eq!(last, expect(47, 48));
    assert_eq!(answered(), 1, "two hours from raw samples");
}
