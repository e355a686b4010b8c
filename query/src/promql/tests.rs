//! Evaluator tests. Every expected value is worked out by hand in the
//! comments next to it, from Prometheus 2.42's definitions.

use std::collections::BTreeMap;
use std::sync::Arc;

use storage::{Label, SeriesKey, Storage, StorageConfig};

use super::*;

const T0: i64 = 1_700_000_000_000;
const S: i64 = 1000;

struct Fixture {
    _dir: tempfile::TempDir,
    engine: PromEngine,
}

fn key(metric: &str, labels: &[(&str, &str)]) -> SeriesKey {
    SeriesKey::new(
        metric,
        labels.iter().map(|(n, v)| Label::new(*n, *v)).collect(),
    )
    .unwrap()
}

/// One series: metric, labels, [(seconds after T0, value)].
type Spec<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [(i64, f64)]);

fn fixture(series: &[Spec<'_>]) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    for (metric, labels, samples) in series {
        let r = st.series_ref(key(metric, labels)).unwrap();
        let ts: Vec<i64> = samples.iter().map(|s| T0 + s.0 * S).collect();
        let vs: Vec<f64> = samples.iter().map(|s| s.1).collect();
        st.append(&vec![r; ts.len()], &ts, &vs).unwrap();
    }
    Fixture {
        _dir: dir,
        engine: PromEngine::new(st),
    }
}

fn stale() -> f64 {
    f64::from_bits(STALE_NAN_BITS)
}

fn show(l: &LabelSet) -> String {
    let parts: Vec<String> = l.iter().map(|(n, v)| format!("{n}={v}")).collect();
    format!("{{{}}}", parts.join(","))
}

/// An instant vector as `{labels} -> value`.
fn vector(f: &Fixture, q: &str, t: i64) -> BTreeMap<String, f64> {
    match f
        .engine
        .instant(q, t)
        .unwrap_or_else(|e| panic!("{q}: {e}"))
    {
        PromValue::Vector(v) => {
            for s in &v {
                assert_eq!(s.t_ms, t, "{q}: sample time is the evaluation time");
            }
            v.into_iter().map(|s| (show(&s.labels), s.v)).collect()
        }
        other => panic!("{q}: expected a vector, got {other:?}"),
    }
}

fn one(f: &Fixture, q: &str, t: i64) -> f64 {
    let v = vector(f, q, t);
    assert_eq!(v.len(), 1, "{q}: {v:?}");
    *v.values().next().unwrap()
}

fn close(a: f64, b: f64) -> bool {
    a == b || (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

fn assert_vec(f: &Fixture, q: &str, t: i64, want: &[(&str, f64)]) {
    let got = vector(f, q, t);
    let want: BTreeMap<String, f64> = want.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{q}: label sets"
    );
    for (k, w) in &want {
        assert!(close(got[k], *w), "{q}: {k} = {} want {w}", got[k]);
    }
}

fn gauges() -> Fixture {
    fixture(&[
        ("m", &[("a", "1")], &[(0, 1.0), (60, 2.0)]),
        ("m", &[("a", "2")], &[(0, 5.0), (30, stale()), (90, 7.0)]),
        // A counter with a reset between 15 s and 30 s.
        ("c", &[], &[(0, 10.0), (15, 20.0), (30, 5.0), (45, 15.0)]),
        // A counter starting near zero.
        ("z", &[], &[(20, 1.0), (30, 11.0), (40, 21.0)]),
        ("used", &[("host", "h1"), ("gpu", "0")], &[(0, 30.0)]),
        ("used", &[("host", "h1"), ("gpu", "1")], &[(0, 50.0)]),
        ("total", &[("host", "h1"), ("gpu", "0")], &[(0, 100.0)]),
        ("total", &[("host", "h1"), ("gpu", "1")], &[(0, 200.0)]),
        ("hostinfo", &[("host", "h1"), ("rack", "r7")], &[(0, 2.0)]),
        ("temp", &[("g", "a")], &[(0, 10.0)]),
        ("temp", &[("g", "b")], &[(0, 20.0)]),
        ("temp", &[("g", "c")], &[(0, 40.0)]),
        ("temp", &[("g", "d")], &[(0, 70.0)]),
        ("lat_bucket", &[("job", "x"), ("le", "0.1")], &[(0, 10.0)]),
        ("lat_bucket", &[("job", "x"), ("le", "0.5")], &[(0, 30.0)]),
        ("lat_bucket", &[("job", "x"), ("le", "1")], &[(0, 40.0)]),
        ("lat_bucket", &[("job", "x"), ("le", "+Inf")], &[(0, 40.0)]),
    ])
}

#[test]
fn lookback_is_five_minutes_inclusive() {
    let f = gauges();
    // The newest sample at or before t, at most 5 minutes old.
    assert_eq!(one(&f, r#"m{a="1"}"#, T0), 1.0);
    assert_eq!(one(&f, r#"m{a="1"}"#, T0 + 59 * S), 1.0);
    assert_eq!(one(&f, r#"m{a="1"}"#, T0 + 60 * S), 2.0);
    // Exactly 5 minutes after the last sample still sees it (2.42).
    assert_eq!(one(&f, r#"m{a="1"}"#, T0 + 360 * S), 2.0);
    assert!(vector(&f, r#"m{a="1"}"#, T0 + 360 * S + 1).is_empty());
    assert!(vector(&f, r#"m{a="1"}"#, T0 - 1).is_empty());
    // offset moves the reference time back.
    assert_eq!(one(&f, r#"m{a="1"} offset 1m"#, T0 + 60 * S), 1.0);
    // @ fixes the reference time (T0 is 1700000000 s).
    assert_eq!(one(&f, r#"m{a="1"} @ 1700000000"#, T0 + 300 * S), 1.0);
    assert_eq!(
        one(&f, r#"m{a="1"} @ 1700000060 offset 1m"#, T0 + 300 * S),
        1.0
    );
}

#[test]
fn a_stale_marker_ends_the_series() {
    let f = gauges();
    assert_eq!(one(&f, r#"m{a="2"}"#, T0 + 10 * S), 5.0);
    // At and after the marker the series is absent, although 5.0 is within
    // the lookback...
    assert!(vector(&f, r#"m{a="2"}"#, T0 + 30 * S).is_empty());
    assert!(vector(&f, r#"m{a="2"}"#, T0 + 60 * S).is_empty());
    // ...until a new sample arrives.
    assert_eq!(one(&f, r#"m{a="2"}"#, T0 + 90 * S), 7.0);
    // Range functions skip the marker: 5 and 7 are the window's samples.
    assert_eq!(
        one(&f, r#"count_over_time(m{a="2"}[2m])"#, T0 + 90 * S),
        2.0
    );
}

#[test]
fn rate_and_increase_extrapolate_like_prometheus() {
    let f = gauges();
    let t = T0 + 60 * S;
    // Window [0 s, 60 s]: 10, 20, 5 (reset), 15. Increase 15-10 = 5, plus 20
    // for the reset = 25. Sampled 45 s over 3 intervals: 15 s average,
    // threshold 16.5 s. To start 0 s (< threshold: +0), to end 15 s
    // (< threshold: +15). Zero point 45*10/25 = 18 s is not < 0 s.
    // Extrapolated over 60 s: 25 * 60/45 = 100/3.
    assert!(close(one(&f, "increase(c[1m])", t), 100.0 / 3.0));
    assert!(close(one(&f, "rate(c[1m])", t), 100.0 / 3.0 / 60.0));
    // delta ignores resets: 5 * 60/45 = 20/3.
    assert!(close(one(&f, "delta(c[1m])", t), 20.0 / 3.0));
    // Window [10 s, 100 s]: 20, 5, 15; increase -5 + 20 = 15. Sampled 30 s,
    // average 15 s. To start 5 s (+5), to end 55 s (> 16.5: +7.5).
    // 15 * 42.5/30 = 21.25; rate = 21.25/90.
    let t = T0 + 100 * S;
    assert!(close(one(&f, "increase(c[90s])", t), 21.25));
    assert!(close(one(&f, "rate(c[90s])", t), 21.25 / 90.0));
    // z: 1, 11, 21 at 20/30/40 s, window [0 s, 60 s]. Increase 20, sampled
    // 20 s, average 10 s, threshold 11 s. To start 20 s, but the zero point
    // is 20*1/20 = 1 s before the first sample: +1. To end 20 s: +5.
    // 20 * 26/20 = 26.
    assert!(close(one(&f, "increase(z[1m])", T0 + 60 * S), 26.0));
    // Fewer than two samples: no result.
    assert!(vector(&f, "rate(c[10s])", T0 + 60 * S).is_empty());
}

#[test]
fn irate_and_idelta_use_the_last_two_samples() {
    let f = gauges();
    // 5 -> 15 over 15 s.
    assert!(close(one(&f, "irate(c[1m])", T0 + 60 * S), 10.0 / 15.0));
    // 20 -> 5 is a reset: the increase is 5, over 15 s.
    assert!(close(one(&f, "irate(c[1m])", T0 + 35 * S), 5.0 / 15.0));
    assert_eq!(one(&f, "idelta(c[1m])", T0 + 35 * S), -15.0);
    // deriv of z: exactly 1 per second.
    assert!(close(one(&f, "deriv(z[1m])", T0 + 60 * S), 1.0));
}

#[test]
fn over_time_functions() {
    let f = gauges();
    let t = T0 + 60 * S;
    // Window [0 s, 60 s] of c: 10, 20, 5, 15.
    assert_eq!(one(&f, "sum_over_time(c[1m])", t), 50.0);
    assert_eq!(one(&f, "avg_over_time(c[1m])", t), 12.5);
    assert_eq!(one(&f, "min_over_time(c[1m])", t), 5.0);
    assert_eq!(one(&f, "max_over_time(c[1m])", t), 20.0);
    assert_eq!(one(&f, "count_over_time(c[1m])", t), 4.0);
    // Sorted 5, 10, 15, 20; rank 0.5*3 = 1.5: 10*0.5 + 15*0.5.
    assert_eq!(one(&f, "quantile_over_time(0.5, c[1m])", t), 12.5);
    assert_eq!(one(&f, "changes(c[1m])", t), 3.0);
    assert_eq!(one(&f, "resets(c[1m])", t), 1.0);
    // last_over_time keeps the metric name; the others drop it.
    assert_vec(&f, "last_over_time(c[1m])", t, &[("{__name__=c}", 15.0)]);
    assert_vec(&f, "max_over_time(c[1m])", t, &[("{}", 20.0)]);
}

#[test]
fn binary_operators_match_like_prometheus() {
    let f = gauges();
    let t = T0 + 10 * S;
    assert_vec(
        &f,
        "used / total",
        t,
        &[("{gpu=0,host=h1}", 0.3), ("{gpu=1,host=h1}", 0.25)],
    );
    assert_vec(
        &f,
        "used / on(gpu) total",
        t,
        &[("{gpu=0}", 0.3), ("{gpu=1}", 0.25)],
    );
    // One-to-one matching drops the ignored labels from the result.
    assert_vec(
        &f,
        "used / ignoring(host) total",
        t,
        &[("{gpu=0}", 0.3), ("{gpu=1}", 0.25)],
    );
    // group_left copies rack from the one side.
    assert_vec(
        &f,
        "used * on(host) group_left(rack) hostinfo",
        t,
        &[
            ("{gpu=0,host=h1,rack=r7}", 60.0),
            ("{gpu=1,host=h1,rack=r7}", 100.0),
        ],
    );
    assert_vec(
        &f,
        "hostinfo * on(host) group_right used",
        t,
        &[("{gpu=0,host=h1}", 60.0), ("{gpu=1,host=h1}", 100.0)],
    );
    // Comparisons filter and keep the name; bool drops it.
    assert_vec(
        &f,
        "used > 40",
        t,
        &[("{__name__=used,gpu=1,host=h1}", 50.0)],
    );
    assert_vec(
        &f,
        "40 < used",
        t,
        &[("{__name__=used,gpu=1,host=h1}", 50.0)],
    );
    assert_vec(
        &f,
        "used > bool 40",
        t,
        &[("{gpu=0,host=h1}", 0.0), ("{gpu=1,host=h1}", 1.0)],
    );
    assert_vec(
        &f,
        "used * 2 - 1",
        t,
        &[("{gpu=0,host=h1}", 59.0), ("{gpu=1,host=h1}", 99.0)],
    );
    assert_eq!(
        f.engine.instant("2 ^ 3 % 5", t).unwrap(),
        PromValue::Scalar { t_ms: t, v: 3.0 }
    );
    // Set operators.
    assert_vec(
        &f,
        r#"used and on(gpu) total{gpu="1"}"#,
        t,
        &[("{__name__=used,gpu=1,host=h1}", 50.0)],
    );
    assert_vec(
        &f,
        r#"used unless total{gpu="1"}"#,
        t,
        &[("{__name__=used,gpu=0,host=h1}", 30.0)],
    );
    assert_vec(
        &f,
        "used or hostinfo",
        t,
        &[
            ("{__name__=hostinfo,host=h1,rack=r7}", 2.0),
            ("{__name__=used,gpu=0,host=h1}", 30.0),
            ("{__name__=used,gpu=1,host=h1}", 50.0),
        ],
    );
    // Two series on the right with host=h1: many-to-many is an error.
    let e = f.engine.instant("used + on(host) total", t).unwrap_err();
    assert!(matches!(e, PromError::Execution(_)), "{e:?}");
    assert!(e.to_string().contains("many-to-many"), "{e}");
    // Matching on __name__ and the other matchers.
    assert_eq!(
        vector(&f, r#"{__name__=~"used|total", gpu!="1"}"#, t).len(),
        2
    );
    assert_eq!(
        vector(&f, r#"{__name__!~"u.*|t.*", host="h1"}"#, t).len(),
        1
    );
}

#[test]
fn aggregations_by_and_without() {
    let f = gauges();
    let t = T0 + 10 * S;
    assert_vec(&f, "sum by (host) (used)", t, &[("{host=h1}", 80.0)]);
    assert_vec(&f, "sum without (gpu) (used)", t, &[("{host=h1}", 80.0)]);
    assert_vec(&f, "avg(used)", t, &[("{}", 40.0)]);
    assert_vec(
        &f,
        "max by (gpu) (used)",
        t,
        &[("{gpu=0}", 30.0), ("{gpu=1}", 50.0)],
    );
    assert_vec(&f, "min(used)", t, &[("{}", 30.0)]);
    assert_vec(&f, "count(temp)", t, &[("{}", 4.0)]);
    // Population standard deviation of 30 and 50.
    assert_vec(&f, "stddev(used)", t, &[("{}", 10.0)]);
    // topk/bottomk keep the whole series, name included.
    assert_vec(
        &f,
        "topk(1, used)",
        t,
        &[("{__name__=used,gpu=1,host=h1}", 50.0)],
    );
    assert_vec(
        &f,
        "bottomk(2, temp)",
        t,
        &[("{__name__=temp,g=a}", 10.0), ("{__name__=temp,g=b}", 20.0)],
    );
    // 10, 20, 40, 70: rank 0.25*3 = 0.75 -> 10*0.25 + 20*0.75 = 17.5.
    assert_vec(&f, "quantile(0.25, temp)", t, &[("{}", 17.5)]);
    assert_vec(&f, "quantile(0.5, used)", t, &[("{}", 40.0)]);
    assert_vec(
        &f,
        r#"count_values("v", used)"#,
        t,
        &[("{v=30}", 1.0), ("{v=50}", 1.0)],
    );
    // Dashboard shape: max by a label that some series lack.
    assert_vec(
        &f,
        "max(used) by (host, gpu, uuid)",
        t,
        &[("{gpu=0,host=h1}", 30.0), ("{gpu=1,host=h1}", 50.0)],
    );
}

/// Several folding aggregations of one operand (a pushed-down `avg`'s
/// `sum` and `count`) read it once and answer as each would alone; other
/// mixes are refused.
#[test]
fn folds_of_one_operand() {
    let f = gauges();
    let t = T0 + 10 * S;
    let ev = eval::Evaluator::new(&f.engine, t, t, 0, crate::limits::Deadline::never()).unwrap();
    let aggs = |qs: &[&str]| -> Vec<promql_parser::parser::AggregateExpr> {
        qs.iter()
            .map(|q| match promql_parser::parser::parse(q).unwrap() {
                promql_parser::parser::Expr::Aggregate(a) => a,
                other => panic!("{q}: {other:?}"),
            })
            .collect()
    };
    let folds = |qs: &[&str]| -> Option<Vec<Vec<(String, f64)>>> {
        let aggs = aggs(qs);
        let refs: Vec<_> = aggs.iter().collect();
        let out = ev.eval_folds(&refs).unwrap()?;
        Some(
            out.into_iter()
                .map(|per_step| {
                    assert_eq!(per_step.len(), 1, "one step");
                    let mut v: Vec<(String, f64)> =
                        per_step[0].iter().map(|e| (show(&e.labels), e.v)).collect();
                    v.sort_by(|a, b| a.0.cmp(&b.0));
                    v
                })
                .collect(),
        )
    };
    let h1 = |v: f64| vec![("{host=h1}".to_string(), v)];
    // used: 30 and 50 on host h1.
    assert_eq!(
        folds(&[
            "sum by (host) (used)",
            "count by (host) (used)",
            "max by (host) (used)"
        ]),
        Some(vec![h1(80.0), h1(2.0), h1(50.0)])
    );
    // temp: 10, 20, 40, 70, each its only sample within the minute.
    let all = |v: f64| vec![("{}".to_string(), v)];
    assert_eq!(
        folds(&[
            "sum((avg_over_time(temp[1m])))",
            "min((avg_over_time(temp[1m])))"
        ]),
        Some(vec![all(140.0), all(10.0)])
    );
    assert_eq!(folds(&["sum(used)", "count by (host) (used)"]), None);
    assert_eq!(folds(&["sum(used)", "count(temp)"]), None);
    assert_eq!(folds(&["sum(used)", "quantile(0.5, used)"]), None);
    assert_eq!(folds(&["sum(used)", "topk(1, used)"]), None);
}

/// `topk`/`bottomk` straight over a selector at an instant rank the
/// series by their newest samples before making any label set; the answers,
/// worked out by hand, are those of the general path (a range query's
/// step): NaN ranks after every number, ties keep the series' order,
/// stale, too old and later samples are not seen, groups by and without.
#[test]
fn topk_over_a_selector_at_an_instant() {
    let f = fixture(&[
        ("t", &[("h", "a"), ("g", "0")], &[(0, 5.0)]),
        ("t", &[("h", "a"), ("g", "1")], &[(0, 9.0)]),
        ("t", &[("h", "a"), ("g", "2")], &[(0, f64::NAN)]),
        ("t", &[("h", "b"), ("g", "0")], &[(0, 9.0)]),
        ("t", &[("h", "b"), ("g", "1")], &[(0, 1.0), (30, stale())]),
        ("t", &[("h", "b"), ("g", "2")], &[(0, 3.0)]),
        // Older than the lookback at 60 s, and later than 60 s.
        ("t", &[("h", "c"), ("g", "0")], &[(-400, 8.0)]),
        ("t", &[("h", "c"), ("g", "1")], &[(0, 2.0), (90, 200.0)]),
        ("t", &[("h", "c"), ("g", "3")], &[(90, 100.0)]),
        ("other", &[("h", "a"), ("g", "0")], &[(0, 1000.0)]),
    ]);
    let t = T0 + 60 * S;
    let cases: &[(&str, &[(&str, f64)])] = &[
        // Keys sort by g, then h: 5 (0/a), 9 (0/b), 9 (1/a), 2 (1/c),
        // NaN (2/a), 3 (2/b); ranked 9 (0/b), 9 (1/a), 5, 3, 2, NaN.
        ("topk(1, t)", &[("{__name__=t,g=0,h=b}", 9.0)]),
        (
            "topk(3, t)",
            &[
                ("{__name__=t,g=0,h=b}", 9.0),
                ("{__name__=t,g=1,h=a}", 9.0),
                ("{__name__=t,g=0,h=a}", 5.0),
            ],
        ),
        (
            "bottomk(2, t)",
            &[("{__name__=t,g=1,h=c}", 2.0), ("{__name__=t,g=2,h=b}", 3.0)],
        ),
        (
            "topk by (h) (1, t)",
            &[
                ("{__name__=t,g=1,h=a}", 9.0),
                ("{__name__=t,g=0,h=b}", 9.0),
                ("{__name__=t,g=1,h=c}", 2.0),
            ],
        ),
        (
            "bottomk without (g) (1, t)",
            &[
                ("{__name__=t,g=0,h=a}", 5.0),
                ("{__name__=t,g=2,h=b}", 3.0),
                ("{__name__=t,g=1,h=c}", 2.0),
            ],
        ),
        // At 0 s: the same 9s, b/1 not yet stale.
        ("topk(1, t offset 1m)", &[("{__name__=t,g=0,h=b}", 9.0)]),
        ("bottomk(1, t offset 1m)", &[("{__name__=t,g=1,h=b}", 1.0)]),
        ("topk(0, t)", &[]),
        ("bottomk(-1, t)", &[]),
    ];
    for &(q, want) in cases {
        let got = match f.engine.instant(q, t).unwrap() {
            PromValue::Vector(v) => v,
            other => panic!("{q}: {other:?}"),
        };
        let got: Vec<(String, f64)> = got.iter().map(|s| (show(&s.labels), s.v)).collect();
        let want: Vec<(String, f64)> = want.iter().map(|(l, v)| (l.to_string(), *v)).collect();
        assert_eq!(got, want, "{q}");
        // The general path: the same query as a range of two steps.
        let range = f.engine.range(q, t - 60 * S, t, 60 * S).unwrap();
        let PromValue::Matrix(series) = range else {
            panic!("{q}: {range:?}")
        };
        let mut at_t: Vec<(String, f64)> = series
            .iter()
            .filter_map(|s| {
                let v = s.points.iter().find(|p| p.0 == t)?.1;
                Some((show(&s.labels), v))
            })
            .collect();
        at_t.sort_by(|a, b| a.0.cmp(&b.0));
        let mut sorted = want.clone();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        assert_eq!(at_t, sorted, "{q} as a range");
    }
    // With room for all: NaN last, the stale, old and later ones absent.
    let all = match f.engine.instant("topk(10, t)", t).unwrap() {
        PromValue::Vector(v) => v,
        other => panic!("{other:?}"),
    };
    let shown: Vec<String> = all.iter().map(|s| show(&s.labels)).collect();
    assert_eq!(
        shown,
        [
            "{__name__=t,g=0,h=b}",
            "{__name__=t,g=1,h=a}",
            "{__name__=t,g=0,h=a}",
            "{__name__=t,g=2,h=b}",
            "{__name__=t,g=1,h=c}",
            "{__name__=t,g=2,h=a}",
        ]
    );
    assert!(all[5].v.is_nan());
}

#[test]
fn histogram_quantile_over_classic_buckets() {
    let f = gauges();
    let t = T0 + 10 * S;
    // 40 observations; rank 20 falls in (0.1, 0.5] holding 20 of them, 10
    // before it: 0.1 + 0.4 * 10/20 = 0.3.
    assert_vec(
        &f,
        "histogram_quantile(0.5, lat_bucket)",
        t,
        &[("{job=x}", 0.3)],
    );
    // Rank 38 falls in (0.5, 1] holding 10, 30 before: 0.5 + 0.5 * 8/10.
    assert_vec(
        &f,
        "histogram_quantile(0.95, lat_bucket)",
        t,
        &[("{job=x}", 0.9)],
    );
    assert_vec(
        &f,
        "histogram_quantile(1, lat_bucket)",
        t,
        &[("{job=x}", 1.0)],
    );
    assert_vec(
        &f,
        "histogram_quantile(-1, lat_bucket)",
        t,
        &[("{job=x}", f64::NEG_INFINITY)],
    );
}

#[test]
fn label_replace_and_join() {
    let f = gauges();
    let t = T0 + 10 * S;
    assert_vec(
        &f,
        r#"label_replace(used, "node", "n-$1", "host", "h(.*)")"#,
        t,
        &[
            ("{__name__=used,gpu=0,host=h1,node=n-1}", 30.0),
            ("{__name__=used,gpu=1,host=h1,node=n-1}", 50.0),
        ],
    );
    // No match: unchanged. The regex is anchored.
    assert_vec(
        &f,
        r#"label_replace(hostinfo, "node", "$1", "host", "1")"#,
        t,
        &[("{__name__=hostinfo,host=h1,rack=r7}", 2.0)],
    );
    assert_vec(
        &f,
        r#"label_join(hostinfo, "where", "/", "rack", "host")"#,
        t,
        &[("{__name__=hostinfo,host=h1,rack=r7,where=r7/h1}", 2.0)],
    );
    // Dropping the distinguishing label makes duplicates: an error.
    let e = f
        .engine
        .instant(r#"label_replace(used, "gpu", "", "gpu", ".*")"#, t)
        .unwrap_err();
    assert!(e.to_string().contains("same labelset"), "{e}");
}

#[test]
fn functions_on_values() {
    let f = gauges();
    let t = T0 + 10 * S;
    assert_vec(
        &f,
        "clamp(used, 35, 45)",
        t,
        &[("{gpu=0,host=h1}", 35.0), ("{gpu=1,host=h1}", 45.0)],
    );
    assert_vec(
        &f,
        "clamp_max(hostinfo, 1)",
        t,
        &[("{host=h1,rack=r7}", 1.0)],
    );
    assert_vec(&f, "abs(-hostinfo)", t, &[("{host=h1,rack=r7}", 2.0)]);
    assert_vec(
        &f,
        "round(hostinfo / 3, 0.5)",
        t,
        &[("{host=h1,rack=r7}", 0.5)],
    );
    assert_vec(&f, "vector(7)", t, &[("{}", 7.0)]);
    assert_eq!(
        f.engine.instant("scalar(hostinfo) * 2", t).unwrap(),
        PromValue::Scalar { t_ms: t, v: 4.0 }
    );
    assert_eq!(
        f.engine.instant("time()", t).unwrap(),
        PromValue::Scalar {
            t_ms: t,
            v: t as f64 / 1000.0
        }
    );
    // The sample's own time, not the evaluation time.
    assert_vec(
        &f,
        r#"timestamp(m{a="1"})"#,
        T0 + 100 * S,
        &[("{a=1}", (T0 + 60 * S) as f64 / 1000.0)],
    );
    assert_vec(&f, "absent(nope{x=\"y\"})", t, &[("{x=y}", 1.0)]);
    // Nothing in [0 s, 10 s] of nope; c has samples there.
    assert_vec(
        &f,
        r#"absent_over_time(nope{x="y", z=~"a"}[10s])"#,
        t,
        &[("{x=y}", 1.0)],
    );
    assert!(vector(&f, "absent_over_time(c[10s])", t).is_empty());
    // c's last sample is at 45 s: absent over [50 s, 60 s].
    assert_vec(&f, "absent_over_time(c[10s])", T0 + 60 * S, &[("{}", 1.0)]);
    assert!(vector(&f, "absent(used)", t).is_empty());
    match f.engine.instant("sort_desc(temp)", t).unwrap() {
        PromValue::Vector(v) => {
            let vals: Vec<f64> = v.iter().map(|s| s.v).collect();
            assert_eq!(vals, vec![70.0, 40.0, 20.0, 10.0]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn range_queries_evaluate_at_start_plus_k_steps() {
    let f = gauges();
    let m = |q: &str, start: i64, end: i64, step: i64| match f.engine.range(q, start, end, step) {
        Ok(PromValue::Matrix(m)) => m,
        other => panic!("{q}: {other:?}"),
    };
    // Start, start+60 s, start+120 s; start+180 s is past the end.
    let r = m(r#"m{a="1"}"#, T0, T0 + 130 * S, 60 * S);
    assert_eq!(r.len(), 1);
    assert_eq!(
        r[0].points,
        vec![(T0, 1.0), (T0 + 60 * S, 2.0), (T0 + 120 * S, 2.0)]
    );
    // Not aligned to the step: Prometheus does not align either.
    let r = m(r#"m{a="1"}"#, T0 + 7 * S, T0 + 127 * S, 60 * S);
    assert_eq!(
        r[0].points,
        vec![(T0 + 7 * S, 1.0), (T0 + 67 * S, 2.0), (T0 + 127 * S, 2.0)]
    );
    // The stale marker leaves a gap: 5 at 0 s, nothing at 30 s and 60 s, 7 at 90 s.
    let r = m(r#"m{a="2"}"#, T0, T0 + 90 * S, 30 * S);
    assert_eq!(r[0].points, vec![(T0, 5.0), (T0 + 90 * S, 7.0)]);
    // A scalar becomes one series without labels.
    let r = m("time()", T0, T0 + 20 * S, 10 * S);
    assert_eq!(r.len(), 1);
    assert!(r[0].labels.is_empty());
    let secs = T0 as f64 / 1000.0;
    assert_eq!(
        r[0].points,
        vec![
            (T0, secs),
            (T0 + 10 * S, secs + 10.0),
            (T0 + 20 * S, secs + 20.0)
        ]
    );
    // rate over a range: the same extrapolation at every step.
    let r = m("increase(c[1m])", T0 + 60 * S, T0 + 60 * S, 15 * S);
    assert!(close(r[0].points[0].1, 100.0 / 3.0));
    // A subquery: max of rate over the last 30 s at 15 s steps.
    let v = one(&f, "max_over_time(irate(c[1m])[30s:15s])", T0 + 60 * S);
    // T0 is 5 s past a multiple of 15 s, so the inner steps in [30 s, 60 s]
    // are at 40 s (irate 5/15 after the reset) and 55 s (10/15).
    assert!(close(v, 10.0 / 15.0));
}

#[test]
fn errors_are_typed_and_never_panic() {
    let f = gauges();
    let bad = |q: &str| f.engine.instant(q, T0).unwrap_err();
    assert!(matches!(bad("sum(("), PromError::BadData(_)));
    assert_eq!(bad("sum((").status(), (400, "bad_data"));
    let e = bad(r#"limitk(1, c)"#);
    assert!(matches!(e, PromError::Execution(_)), "{e:?}");
    assert_eq!(e.status(), (422, "execution"));
    assert!(matches!(
        f.engine.range("c", T0, T0 + S, 0),
        Err(PromError::BadData(_))
    ));
    assert!(matches!(
        f.engine.range("c", T0 + S, T0, S),
        Err(PromError::BadData(_))
    ));
    assert!(matches!(
        f.engine.range("c[1m]", T0, T0 + S, S),
        Err(PromError::BadData(_))
    ));
    assert!(matches!(
        f.engine.range("c", T0, T0 + 20_000 * S, S),
        Err(PromError::BadData(_))
    ));
    // The sample limit.
    let small = PromEngine::with_limits(
        f.engine.storage().clone(),
        PromLimits {
            max_samples: 3,
            ..PromLimits::default()
        },
    );
    let e = small
        .instant("sum_over_time(c[1m])", T0 + 60 * S)
        .unwrap_err();
    assert!(e.to_string().contains("too many samples"), "{e}");
    // Extreme times and durations are refused or answered, never overflow.
    assert!(matches!(
        f.engine.instant("c", i64::MIN),
        Err(PromError::BadData(_))
    ));
    assert!(matches!(
        f.engine.range("c", i64::MIN, i64::MAX, i64::MAX),
        Err(PromError::BadData(_))
    ));
    for q in [
        "c offset 100000000000y",
        "c offset -100000000000y",
        "rate(c[100000000000y])",
        "c @ 100000000000000",
        "max_over_time(c[100000000000y:1y])",
        "max_over_time(c[1y:1ms])",
    ] {
        let _ = f.engine.instant(q, T0);
        let _ = f.engine.range(q, T0, T0 + 60 * S, 30 * S);
    }
    // Instant query of a range vector: the raw samples.
    match f.engine.instant("c[20s]", T0 + 30 * S).unwrap() {
        PromValue::Matrix(m) => {
            assert_eq!(m[0].points, vec![(T0 + 15 * S, 20.0), (T0 + 30 * S, 5.0)])
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn api_parsing_and_rendering() {
    use super::api::{parse_step, parse_time, render};
    assert_eq!(parse_time("1700000000.123").unwrap(), 1_700_000_000_123);
    assert_eq!(parse_time("1700000000").unwrap(), 1_700_000_000_000);
    assert_eq!(
        parse_time("2023-11-14T22:13:20.5Z").unwrap(),
        1_700_000_000_500
    );
    assert_eq!(
        parse_time("2023-11-14T23:13:20+01:00").unwrap(),
        1_700_000_000_000
    );
    assert!(parse_time("yesterday").is_err());
    assert!(parse_time("1e300").is_err());
    assert!(parse_time("-1e300").is_err());
    assert!(parse_step("1e300").is_err());
    assert!(parse_step("100000000000y").is_err());
    assert_eq!(parse_step("15").unwrap(), 15_000);
    assert_eq!(parse_step("0.5").unwrap(), 500);
    assert_eq!(parse_step("1m").unwrap(), 60_000);
    assert_eq!(parse_step("1m30s").unwrap(), 90_000);
    assert!(parse_step("soon").is_err());
    let v = PromValue::Vector(vec![Sample {
        labels: Arc::new(vec![
            ("__name__".into(), "up".into()),
            ("Hostname".into(), "h\"1".into()),
        ]),
        t_ms: 1_700_000_000_123,
        v: f64::NAN,
    }]);
    assert_eq!(
        render(&v),
        r#"{"resultType":"vector","result":[{"metric":{"__name__":"up","Hostname":"h\"1"},"value":[1700000000.123,"NaN"]}]}"#
    );
    let m = PromValue::Matrix(vec![Series {
        labels: Arc::new(vec![]),
        points: vec![
            (1_700_000_000_000, f64::INFINITY),
            (1_700_000_000_050, -0.25),
        ],
    }]);
    assert_eq!(
        render(&m),
        r#"{"resultType":"matrix","result":[{"metric":{},"values":[[1700000000,"+Inf"],[1700000000.050,"-0.25"]]}]}"#
    );
    assert_eq!(
        render(&PromValue::Scalar { t_ms: 5, v: 1e21 }),
        r#"{"resultType":"scalar","result":[0.005,"1000000000000000000000"]}"#
    );
}

/// Enough samples that the reads and the range function are split across
/// the scan threads (`parallel::MIN_PARALLEL_SAMPLES`): 64 series of 600
/// samples, gpu `g` at second `i` holding `1000 g + i`, except that every
/// seventh gpu has a staleness marker at second 300. Every series keeps its
/// own answer and the series their order (each thread reads series after
/// series into the same buffers).
#[test]
fn series_split_across_cores_keep_their_own_answers() {
    const SERIES: i64 = 128;
    const SAMPLES: i64 = 600;
    let marked = |g: i64| g % 7 == 3;
    assert!((SERIES * SAMPLES) as usize >= super::parallel::MIN_PARALLEL_SAMPLES);
    let gpus: Vec<String> = (0..SERIES).map(|g| format!("{g:03}")).collect();
    let samples: Vec<Vec<(i64, f64)>> = (0..SERIES)
        .map(|g| {
            (0..SAMPLES)
                .map(|i| match i {
                    300 if marked(g) => (i, stale()),
                    _ => (i, (1000 * g + i) as f64),
                })
                .collect()
        })
        .collect();
    let labels: Vec<[(&str, &str); 1]> = gpus.iter().map(|g| [("gpu", g.as_str())]).collect();
    let specs: Vec<Spec<'_>> = (0..SERIES as usize)
        .map(|g| ("m", &labels[g][..], &samples[g][..]))
        .collect();
    let f = fixture(&specs);
    let end = T0 + (SAMPLES - 1) * S;
    // The whole hour holds all 600: sum 600 * 1000 g + (0 + ... + 599).
    let sums = vector(&f, "sum_over_time(m[1h])", end);
    assert_eq!(sums.len(), SERIES as usize);
    for (g, gpu) in gpus.iter().enumerate() {
        let g = g as i64;
        let marker = if marked(g) { 1000 * g + 300 } else { 0 };
        let expected = (600_000 * g + 599 * 600 / 2 - marker) as f64;
        assert_eq!(sums[&format!("{{gpu={gpu}}}")], expected, "gpu {gpu}");
    }
    // At each minute, the newest sample is the one at that second.
    let r = match f
        .engine
        .range("last_over_time(m[1m])", T0 + 60 * S, end, 60 * S)
    {
        Ok(PromValue::Matrix(m)) => m,
        other => panic!("{other:?}"),
    };
    let got: Vec<String> = r.iter().map(|s| show(&s.labels)).collect();
    let want: Vec<String> = gpus
        .iter()
        .map(|g| format!("{{__name__=m,gpu={g}}}"))
        .collect();
    assert_eq!(got, want, "series in label order");
    for (g, s) in r.iter().enumerate() {
        let g = g as i64;
        let expected: Vec<(i64, f64)> = (1..=9)
            .map(|k| match k {
                // The marker is dropped: the sample before it is the newest.
                5 if marked(g) => (T0 + k * 60 * S, (1000 * g + k * 60 - 1) as f64),
                _ => (T0 + k * 60 * S, (1000 * g + k * 60) as f64),
            })
            .collect();
        assert_eq!(s.points, expected, "gpu {g}");
    }
    // The selector at each minute: the newest sample, none where it is
    // the marker.
    let r = match f.engine.range("m", T0 + 60 * S, end, 60 * S) {
        Ok(PromValue::Matrix(m)) => m,
        other => panic!("{other:?}"),
    };
    assert_eq!(r.len(), SERIES as usize);
    for (g, s) in r.iter().enumerate() {
        let g = g as i64;
        let expected: Vec<(i64, f64)> = (1..=9)
            .filter(|&k| !(k == 5 && marked(g)))
            .map(|k| (T0 + k * 60 * S, (1000 * g + k * 60) as f64))
            .collect();
        assert_eq!(s.points, expected, "gpu {g}");
    }
}

/// Aggregations over a selector or a range function fold each series'
/// points in place (`aggregate::aggregate_series`); the same expression
/// times `scalar(vector(1))` (not a number literal, so it goes step by
/// step through a vector per step, as every aggregation did before) must
/// give the same answer to the bit: the same groups at each step, their
/// values folded in the same order. Likewise a vector against a number
/// literal, series by series (`binary::scalar_operand`). Counters that
/// reset, gaps, and values whose sums round.
#[test]
fn aggregations_series_by_series_equal_those_step_by_step() {
    let hosts = ["h0", "h1", "h2"];
    // Metric, gpu and host labels, samples.
    type Owned = (String, [(&'static str, String); 2], Vec<(i64, f64)>);
    let mut specs_owned: Vec<Owned> = Vec::new();
    let mut x = 11u64;
    for (h, host) in hosts.iter().enumerate() {
        for gpu in 0..5 {
            for metric in ["a", "b"] {
                let mut v = 0.0;
                let mut samples = Vec::new();
                for i in 0..240i64 {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    // A gap of two minutes in some series, a reset now and then.
                    if gpu == 1 && (100..220).contains(&i) {
                        continue;
                    }
                    v += (x >> 40) as f64 / 3.7e4;
                    if (x >> 20).is_multiple_of(97) {
                        v = 0.1 * h as f64;
                    }
                    samples.push((i * 15, v));
                }
                specs_owned.push((
                    metric.to_string(),
                    [("gpu", gpu.to_string()), ("host", host.to_string())],
                    samples,
                ));
            }
        }
    }
    let labels: Vec<[(&str, &str); 2]> = specs_owned
        .iter()
        .map(|(_, l, _)| [(l[0].0, l[0].1.as_str()), (l[1].0, l[1].1.as_str())])
        .collect();
    let specs: Vec<Spec<'_>> = specs_owned
        .iter()
        .zip(&labels)
        .map(|((m, _, s), l)| (m.as_str(), &l[..], &s[..]))
        .collect();
    let f = fixture(&specs);
    let bits = |v: PromValue| -> Vec<(String, Vec<(i64, u64)>)> {
        match v {
            PromValue::Matrix(m) => m
                .into_iter()
                .map(|s| {
                    let points = s.points.iter().map(|&(t, v)| (t, v.to_bits())).collect();
                    (show(&s.labels), points)
                })
                .collect(),
            PromValue::Vector(v) => v
                .into_iter()
                .map(|s| (show(&s.labels), vec![(s.t_ms, s.v.to_bits())]))
                .collect(),
            other => panic!("{other:?}"),
        }
    };
    let (start, end) = (T0 + 300 * S, T0 + 3600 * S);
    for (agg, inner) in [
        ("sum by (host)", "rate(a[5m])"),
        ("avg by (host)", "increase(a[5m])"),
        ("max", "rate(a[2m])"),
        ("min without (gpu)", "avg_over_time(a[3m])"),
        ("stdvar by (host)", "delta(a[5m])"),
        ("stddev", "sum_over_time(a[1m])"),
        ("count by (host)", "a"),
        ("group by (host)", "a"),
        ("avg", "a"),
        ("sum", "{__name__=~\"a|b\"}"),
    ] {
        let fast = format!("{agg} ({inner})");
        let slow = format!("{agg} ({inner} * scalar(vector(1)))");
        let range = |q: &str| bits(f.engine.range(q, start, end, 60 * S).unwrap());
        let got = range(&fast);
        assert!(
            !got.is_empty() && got.iter().all(|(_, p)| p.len() > 10),
            "{fast}: {got:?}"
        );
        assert_eq!(got, range(&slow), "{fast}");
        for t in [T0 + 1500 * S, end] {
            let instant = |q: &str| bits(f.engine.instant(q, t).unwrap());
            assert_eq!(instant(&fast), instant(&slow), "{fast} at {t}");
        }
    }
    for (fast, slow) in [
        ("a * 1000000", "a * scalar(vector(1000000))"),
        (
            "(2 ^ (a / 100))",
            "scalar(vector(2)) ^ (a / scalar(vector(100)))",
        ),
        ("a > 30", "a > scalar(vector(30))"),
        ("30 < a", "scalar(vector(30)) < a"),
        ("a >= bool 30", "a >= bool scalar(vector(30))"),
        (
            "sum by (host) (rate(a[5m]) * 60)",
            "sum by (host) (rate(a[5m]) * scalar(vector(60)))",
        ),
        ("avg(-(a - 7))", "avg(-(a - scalar(vector(7))))"),
        (
            "{__name__=~\"a|b\"} > 40",
            "{__name__=~\"a|b\"} > scalar(vector(40))",
        ),
    ] {
        let range = |q: &str| bits(f.engine.range(q, start, end, 60 * S).unwrap());
        let got = range(fast);
        assert!(!got.is_empty(), "{fast}");
        assert_eq!(got, range(slow), "{fast}");
        let instant = |q: &str| bits(f.engine.instant(q, end).unwrap());
        assert_eq!(instant(fast), instant(slow), "{fast}");
    }
    // a and b have one label set once their names go: the range function's
    // vector holds it twice, which Prometheus refuses; so is arithmetic's.
    for q in ["{__name__=~\"a|b\"} * 2", "2 * {__name__=~\"a|b\"}"] {
        let err = f.engine.range(q, start, end, 60 * S).unwrap_err();
        assert!(err.to_string().contains("same labelset"), "{q}: {err}");
    }
    let err = f
        .engine
        .range("sum(rate({__name__=~\"a|b\"}[5m]))", start, end, 60 * S)
        .unwrap_err();
    assert!(err.to_string().contains("same labelset"), "{err}");
}

/// A range query whose steps reach far before and after a series' samples
/// (which the evaluator skips without visiting) answers at every step what
/// the samples in that step's window give, computed here from the samples:
/// range functions and selectors, with `offset` and `@` too.
#[test]
fn range_functions_over_steps_beyond_the_data_answer_from_their_windows() {
    // Samples from 1,000 s to 1,600 s after T0, a gap at 1,200-1,300 s.
    let samples: Vec<(i64, f64)> = (0..=60i64)
        .filter(|i| !(20..30).contains(i))
        .map(|i| (1000 + i * 10, (i * i) as f64 / 7.0))
        .collect();
    let f = fixture(&[("c", &[("gpu", "0")], &samples)]);
    let (start, end, step) = (T0, T0 + 3000 * S, 10 * S);
    type Of = fn(&[(i64, f64)]) -> f64;
    let sum: Of = |w| w.iter().map(|s| s.1).sum();
    let last: Of = |w| w[w.len() - 1].1;
    // Query, window length and offset in seconds, `@` in seconds after T0,
    // and what the window's samples give. A selector's window is the 5 min
    // lookback, both ends included (Prometheus 2.42).
    let cases: [(&str, i64, i64, Option<i64>, Of); 10] = [
        ("avg_over_time(c[2m])", 120, 0, None, |w| {
            w.iter().map(|s| s.1).sum::<f64>() / w.len() as f64
        }),
        ("last_over_time(c[5m])", 300, 0, None, last),
        ("count_over_time(c[30s])", 30, 0, None, |w| w.len() as f64),
        ("sum_over_time(c[2m] offset 3m)", 120, 180, None, sum),
        ("max_over_time(c[1m] offset -2m)", 60, -120, None, |w| {
            w.iter().map(|s| s.1).fold(f64::MIN, f64::max)
        }),
        (
            "min_over_time(c[1m] @ 1700001300)",
            60,
            0,
            Some(1300),
            |w| w.iter().map(|s| s.1).fold(f64::MAX, f64::min),
        ),
        ("c", 300, 0, None, last),
        ("c offset 4m", 300, 240, None, last),
        ("timestamp(c)", 300, 0, None, |w| {
            (T0 / S + w[w.len() - 1].0) as f64
        }),
        ("sum(c)", 300, 0, None, last),
    ];
    for (q, range, offset, at, of) in cases {
        let got = match f.engine.range(q, start, end, step).unwrap() {
            PromValue::Matrix(m) => m.into_iter().flat_map(|s| s.points).collect::<Vec<_>>(),
            other => panic!("{q}: {other:?}"),
        };
        let mut want = Vec::new();
        let mut t = start;
        while t <= end {
            let r = at.unwrap_or((t - T0) / S) - offset;
            let w: Vec<(i64, f64)> = samples
                .iter()
                .copied()
                .filter(|s| r - range <= s.0 && s.0 <= r)
                .collect();
            if !w.is_empty() {
                want.push((t, of(&w)));
            }
            t += step;
        }
        // Some steps answer; without `@`, most are outside the data.
        assert!(want.len() > 2, "{q}: {want:?}");
        assert!(at.is_some() || want.len() < 150, "{q}: {want:?}");
        assert_eq!(got.len(), want.len(), "{q}: {got:?} {want:?}");
        for (g, w) in got.iter().zip(&want) {
            assert!(g.0 == w.0 && close(g.1, w.1), "{q}: {g:?} against {w:?}");
        }
    }
}

#[test]
fn a_repeated_query_answers_as_the_first_time() {
    // temp{g=~".*"} keeps all four series (the matcher is left out of the
    // select); sum = 10 + 20 + 40 + 70.
    let f = gauges();
    for _ in 0..3 {
        assert_vec(&f, r#"sum(temp{g=~".*", h=~".*"})"#, T0, &[("{}", 140.0)]);
        assert_vec(&f, r#"sum(temp{g=~"a|d"})"#, T0, &[("{}", 80.0)]);
    }
    // A parse error is not remembered as an answer.
    for _ in 0..2 {
        assert!(matches!(
            f.engine.instant("sum(temp", T0),
            Err(PromError::BadData(_))
        ));
    }
}

#[test]
fn the_parse_cache_starts_over_when_full() {
    let cache = ParseCache::default();
    for i in 0..=ParseCache::CAPACITY {
        cache.parse(&format!("m{i}")).unwrap();
    }
    // The 513th query found it full: it is alone in the new one.
    let held = cache.0.lock().unwrap();
    assert_eq!(held.len(), 1);
    assert!(held.contains_key(&format!("m{}", ParseCache::CAPACITY)));
}

#[test]
fn aggregations_over_a_selector_group_by_the_labels_they_name() {
    // Read with only their groups' labels: the groups must be those of the
    // whole label sets. used{gpu=0,1} = 30, 50; total{gpu=0,1} = 100, 200.
    let f = gauges();
    assert_vec(
        &f,
        r#"sum by (__name__) ({__name__=~"used|total"})"#,
        T0,
        &[("{__name__=used}", 80.0), ("{__name__=total}", 300.0)],
    );
    assert_vec(
        &f,
        r#"count without (gpu) ({__name__=~"used|total"})"#,
        T0,
        &[("{host=h1}", 4.0)],
    );
    assert_vec(
        &f,
        "max by (host, gpu) (used)",
        T0,
        &[("{gpu=0,host=h1}", 30.0), ("{gpu=1,host=h1}", 50.0)],
    );
    assert_vec(
        &f,
        "min by (gpu, __name__) (total)",
        T0,
        &[
            ("{__name__=total,gpu=0}", 100.0),
            ("{__name__=total,gpu=1}", 200.0),
        ],
    );
    // (10 + 20 + 40 + 70) / 4; `g` alone told the series apart.
    assert_vec(&f, "avg without (g) (temp)", T0, &[("{}", 35.0)]);
    // Two series with one group are not two series with one label set.
    assert_vec(&f, "group by (host) (used)", T0, &[("{host=h1}", 1.0)]);
}

#[test]
fn aggregations_over_a_range_function_group_by_the_labels_they_name() {
    // Energy counters rising 1, 2 and 4 J/s, sampled every 15 s from 0 to
    // 300 s: at 300 s, a 5 m window holds 0..=300, so each rate is its
    // slope exactly, and the last value 300 times it.
    let series: Vec<Vec<(i64, f64)>> = [1.0, 2.0, 4.0]
        .iter()
        .map(|slope| {
            (0..=20)
                .map(|i| (15 * i, slope * (15 * i) as f64))
                .collect()
        })
        .collect();
    let labels: [&[(&str, &str)]; 3] = [
        &[("host", "h1"), ("gpu", "0"), ("rack", "r1")],
        &[("host", "h1"), ("gpu", "1"), ("rack", "r1")],
        &[("host", "h2"), ("gpu", "0"), ("rack", "r2")],
    ];
    let mut specs: Vec<Spec<'_>> = (0..3).map(|i| ("e", labels[i], &series[i][..])).collect();
    // Another metric with the same labels, which no query below selects.
    specs.push(("f", labels[0], &series[2][..]));
    let f = fixture(&specs);
    let t = T0 + 300 * S;
    assert_vec(
        &f,
        "sum by (host) (rate(e[5m]))",
        t,
        &[("{host=h1}", 3.0), ("{host=h2}", 4.0)],
    );
    assert_vec(
        &f,
        r#"sum without (gpu, rack) (increase({__name__="e"}[5m]))"#,
        t,
        &[("{host=h1}", 900.0), ("{host=h2}", 1200.0)],
    );
    assert_vec(
        &f,
        "max by (rack) ((max_over_time(e[5m])))",
        t,
        &[("{rack=r1}", 600.0), ("{rack=r2}", 1200.0)],
    );
    // The name that `rate` drops makes no group; `last_over_time` keeps it,
    // and `without` drops it from the groups.
    assert_vec(&f, "sum by (__name__) (rate(e[5m]))", t, &[("{}", 7.0)]);
    assert_vec(
        &f,
        "sum by (__name__) (last_over_time(e[5m]))",
        t,
        &[("{__name__=e}", 2100.0)],
    );
    assert_vec(
        &f,
        "sum without (gpu) (last_over_time(e[5m]))",
        t,
        &[("{host=h1,rack=r1}", 900.0), ("{host=h2,rack=r2}", 1200.0)],
    );
    assert_vec(
        &f,
        "count by (gpu) (quantile_over_time(0.5, e[5m]))",
        t,
        &[("{gpu=0}", 2.0), ("{gpu=1}", 1.0)],
    );
    // A range query gives each step its own sums. At 150 s the window
    // [-150 s, 150 s] holds the rise over 0..=150 s, not extrapolated
    // before 0 s (the counters start at zero there): half the slope.
    let m = match f
        .engine
        .range("sum by (host) (rate(e[5m]))", T0 + 150 * S, t, 150 * S)
        .unwrap()
    {
        PromValue::Matrix(m) => m,
        other => panic!("{other:?}"),
    };
    let got: Vec<(String, Vec<f64>)> = m
        .iter()
        .map(|s| (show(&s.labels), s.points.iter().map(|p| p.1).collect()))
        .collect();
    assert_eq!(
        got,
        [
            ("{host=h1}".to_string(), vec![1.5, 3.0]),
            ("{host=h2}".to_string(), vec![2.0, 4.0])
        ]
    );
}

/// Points reserved for every step reached are given back where most steps
/// found none, and kept (the same allocation) where most did.
#[test]
fn sparse_points_give_back_their_room() {
    let mut sparse: Vec<(u32, f64)> = Vec::with_capacity(1000);
    sparse.extend((0..10).map(|i| (i, 1.0)));
    eval::shrink_if_sparse(&mut sparse);
    assert!(sparse.capacity() < 20, "{}", sparse.capacity());
    let mut dense: Vec<(u32, f64)> = Vec::with_capacity(1000);
    dense.extend((0..600).map(|i| (i, 1.0)));
    let at = dense.as_ptr();
    eval::shrink_if_sparse(&mut dense);
    assert_eq!((dense.capacity(), dense.as_ptr()), (1000, at));
    assert_eq!(sparse.len() + dense.len(), 610);
}
