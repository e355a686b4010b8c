use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use crate::{QueryEngine, http::to_json};
use datafusion::prelude::{col, lit};
use serde_json::Value;
use storage::{Label, SeriesKey, StorageConfig};

const T0: i64 = 1_764_460_800_000; // 2025-11-30T00:00:00Z
const RACKS: [&str; 2] = ["k1", "k2"];
const METRICS: [&str; 2] = ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"];

fn key(metric: &str, rack: &str, host: &str, gpu: u32) -> SeriesKey {
    SeriesKey::new(
        metric,
        vec![
            Label::new("gpu", gpu.to_string()),
            Label::new("Hostname", host),
            Label::new("cluster", "c1"),
            Label::new("row", "r1"),
            Label::new("rack", rack),
        ],
    )
    .unwrap()
}

/// One stored sample with its topology.
#[derive(Debug, Clone)]
struct Sample {
    metric: &'static str,
    rack: &'static str,
    ts: i64,
    value: f64,
}

/// 2 racks x 2 hosts x 2 GPUs x 2 metrics, every 10 s for 3 h from T0 + 30 min
/// (so the hours are partial at both ends). Part is flushed to files, the
/// rest stays in the head. Returns the samples written.
fn fixture() -> (tempfile::TempDir, Arc<Storage>, Vec<Sample>) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = StorageConfig::new(dir.path());
    config.retention = None;
    config.retention_1m = None;
    config.retention_1h = None;
    config.retention_1d = None;
    let st = Arc::new(Storage::open(config).unwrap());
    let mut all = Vec::new();
    let n = 3 * 360;
    for (half, range) in [(0, 0..n / 2), (1, n / 2..n)] {
        for metric in METRICS {
            for rack in RACKS {
                for h in 0..2 {
                    let host = format!("{rack}-h{h}");
                    for gpu in 0..2u32 {
                        let r = st.series_ref(key(metric, rack, &host, gpu)).unwrap();
                        let samples: Vec<Sample> = range
                            .clone()
                            .map(|i| Sample {
                                metric,
                                rack,
                                ts: T0 + 1_800_000 + i * 10_000,
                                // Varies by GPU and time, with ties and a dip.
                                value: ((i * 7 + gpu as i64 * 3 + h) % 50) as f64 * 1.5,
                            })
                            .collect();
                        let ts: Vec<i64> = samples.iter().map(|s| s.ts).collect();
                        let vs: Vec<f64> = samples.iter().map(|s| s.value).collect();
                        st.append(&vec![r; ts.len()], &ts, &vs).unwrap();
                        all.extend(samples);
                    }
                }
            }
        }
        if half == 0 {
            st.flush().unwrap();
        }
    }
    (dir, st, all)
}

/// The expected row of one group and window, folded from the samples.
#[derive(Debug, Default, Clone, Copy)]
struct Fold {
    count: i64,
    sum: f64,
    min: f64,
    max: f64,
    first: (i64, f64),
    last: (i64, f64),
}

impl Fold {
    fn add(&mut self, ts: i64, v: f64) {
        if self.count == 0 {
            *self = Fold {
                count: 1,
                sum: v,
                min: v,
                max: v,
                first: (ts, v),
                last: (ts, v),
            };
            return;
        }
        self.count += 1;
        self.sum += v;
        self.min = self.min.min(v);
        self.max = self.max.max(v);
        // Several series share a timestamp: first takes the smallest value, last the largest.
        if (ts, v) < self.first {
            self.first = (ts, v);
        }
        if (ts, v) > self.last {
            self.last = (ts, v);
        }
    }
}

fn rows(r: &crate::QueryResult) -> Vec<Vec<Value>> {
    to_json(r).unwrap()["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().clone())
        .collect()
}

fn ts_text(ms: i64) -> String {
    crate::pushdown::format_ms(ms)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// The fold of the first metric's samples per rack and hour.
fn rack_hours(samples: &[Sample]) -> BTreeMap<(&'static str, i64), Fold> {
    let mut want: BTreeMap<(&str, i64), Fold> = BTreeMap::new();
    for s in samples.iter().filter(|s| s.metric == METRICS[0]) {
        want.entry((s.rack, s.ts - s.ts.rem_euclid(3_600_000)))
            .or_default()
            .add(s.ts, s.value);
    }
    want
}

#[tokio::test]
async fn rack_hours_equal_a_fold_of_the_raw_samples() {
    let (_dir, st, samples) = fixture();
    let want = rack_hours(&samples);
    let engine = QueryEngine::new(st);
    let r = engine
        .sql(&format!(
            "SELECT rack, ts, count, sum, min, max, first, last, avg, host, gpu, level \
             FROM rollup_1h WHERE level = 'rack' AND metric = '{}' ORDER BY rack, ts",
            METRICS[0]
        ))
        .await
        .unwrap();
    let got = rows(&r);
    assert_eq!(got.len(), want.len(), "{got:?}");
    assert_eq!(want.len(), 2 * 4, "3 h from :30 touch four hours per rack");
    for (row, ((rack, hour), f)) in got.iter().zip(&want) {
        assert_eq!(row[0], *rack);
        assert_eq!(row[1], ts_text(*hour).as_str(), "{row:?}");
        assert_eq!(row[2], f.count);
        for (i, w) in [
            (3, f.sum),
            (4, f.min),
            (5, f.max),
            (6, f.first.1),
            (7, f.last.1),
        ] {
            assert!(
                close(row[i].as_f64().unwrap(), w),
                "col {i}: {row:?} vs {f:?}"
            );
        }
        assert!(close(row[8].as_f64().unwrap(), f.sum / f.count as f64));
        assert_eq!(row[9], Value::Null, "host is below rack level");
        assert_eq!(row[10], Value::Null);
        assert_eq!(row[11], "rack");
    }
}

/// Storage decodes only the record fields a scan's columns show
/// (`fields_of`): every projection, and a filter on a column the query does
/// not show, still gives the fold's values, on a file's first read (which
/// decodes every field) and on the reads after it (which do not).
#[tokio::test]
async fn projections_and_filters_read_the_fields_they_need() {
    let (_dir, st, samples) = fixture();
    let want = rack_hours(&samples);
    // A cut that keeps some windows and drops others.
    let mut firsts: Vec<f64> = want.values().map(|f| f.first.1).collect();
    firsts.sort_by(f64::total_cmp);
    let cut = firsts[firsts.len() / 2];
    assert!(firsts[0] < cut, "{firsts:?}");
    let engine = QueryEngine::new(st);
    let from = "FROM rollup_1h WHERE level = 'rack' AND metric";
    for round in 0..2 {
        for (select, field) in [
            (
                "avg",
                (|f: &Fold| f.sum / f.count as f64) as fn(&Fold) -> f64,
            ),
            ("sum", |f| f.sum),
            ("min", |f| f.min),
            ("max", |f| f.max),
            ("first", |f| f.first.1),
            ("last", |f| f.last.1),
            ("count", |f| f.count as f64),
        ] {
            let sql = format!(
                "SELECT rack, ts, {select} {from} = '{}' ORDER BY rack, ts",
                METRICS[0]
            );
            let got = rows(&engine.sql(&sql).await.unwrap());
            assert_eq!(got.len(), want.len(), "{sql}");
            for (row, ((rack, hour), f)) in got.iter().zip(&want) {
                assert_eq!(
                    (&row[0], &row[1]),
                    (&Value::from(*rack), &Value::from(ts_text(*hour)))
                );
                assert!(
                    close(row[2].as_f64().unwrap(), field(f)),
                    "round {round}, {select}: {row:?} vs {f:?}"
                );
            }
        }
        // `first` is not shown: DataFusion filters on it above the scan,
        // which must still read it.
        let sql = format!(
            "SELECT rack, ts {from} = '{}' AND first >= {cut} ORDER BY rack, ts",
            METRICS[0]
        );
        let got = rows(&engine.sql(&sql).await.unwrap());
        let expected: Vec<Vec<Value>> = want
            .iter()
            .filter(|(_, f)| f.first.1 >= cut)
            .map(|((rack, hour), _)| vec![Value::from(*rack), Value::from(ts_text(*hour))])
            .collect();
        assert_eq!(got, expected, "round {round}");
    }
    // Bounds on `ts` (exact by a whole millisecond: no filter above the
    // scan) keep the windows that start within them, strict or not, and
    // nothing of a window that only overlaps them.
    let hours: Vec<i64> = want.keys().map(|&(_, h)| h).collect();
    let (lo, hi) = (hours[1], hours[2]);
    for (op_lo, op_hi, keep) in [
        (
            ">",
            "<=",
            (|h, lo, hi| h > lo && h <= hi) as fn(i64, i64, i64) -> bool,
        ),
        (">=", "<", |h, lo, hi| h >= lo && h < hi),
        (">=", "<=", |h, lo, hi| h >= lo && h <= hi),
        (">", "<", |h, lo, hi| h > lo - 1 && h < hi + 1),
    ] {
        let (a, b) = if op_lo == ">" && op_hi == "<" {
            (lo - 1, hi + 1)
        } else {
            (lo, hi)
        };
        let sql = format!(
            "SELECT rack, ts {from} = '{}' AND ts {op_lo} TIMESTAMP '{}' AND ts {op_hi} TIMESTAMP '{}' ORDER BY rack, ts",
            METRICS[0],
            ts_text(a),
            ts_text(b)
        );
        let got = rows(&engine.sql(&sql).await.unwrap());
        let expected: Vec<Vec<Value>> = want
            .keys()
            .filter(|&&(_, h)| keep(h, lo, hi))
            .map(|&(rack, h)| vec![Value::from(rack), Value::from(ts_text(h))])
            .collect();
        assert!(!expected.is_empty());
        assert_eq!(got, expected, "{sql}");
    }
}

#[tokio::test]
async fn every_level_of_a_tier_counts_every_sample() {
    let (_dir, st, samples) = fixture();
    let engine = QueryEngine::new(st);
    for table in ["rollup_1m", "rollup_1h", "rollup_1d"] {
        let r = engine
            .sql(&format!(
                "SELECT level, sum(count), count(DISTINCT gpu), count(DISTINCT host) \
                 FROM {table} GROUP BY level ORDER BY level"
            ))
            .await
            .unwrap();
        let got = rows(&r);
        let levels: Vec<&str> = got.iter().map(|r| r[0].as_str().unwrap()).collect();
        assert_eq!(levels, ["cluster", "gpu", "host", "rack", "row"], "{table}");
        for row in &got {
            assert_eq!(row[1], samples.len() as i64, "{table}: {row:?}");
            let (gpus, hosts) = match row[0].as_str().unwrap() {
                "gpu" => (2, 4),
                "host" => (0, 4),
                _ => (0, 0),
            };
            assert_eq!(
                (row[2].as_i64(), row[3].as_i64()),
                (Some(gpus), Some(hosts))
            );
        }
    }
}

#[tokio::test]
async fn filters_reach_storage_and_show_in_explain() {
    let (_dir, st, samples) = fixture();
    let engine = QueryEngine::new(st);
    let from = T0 + 3_600_000;
    let sql = format!(
        "SELECT host, sum(count) FROM rollup_1m WHERE level IN ('host', 'gpu') \
         AND metric = '{}' AND rack = 'k2' AND ts >= TIMESTAMP '{}' GROUP BY host",
        METRICS[1],
        ts_text(from)
    );
    let physical = crate::physical_plan(&engine, &sql).await;
    let want = format!(
        "RollupScanExec: table=rollup_1m, levels=[gpu, host], metric={}, rack=k2, ts=[{}, +inf]",
        METRICS[1],
        ts_text(from)
    );
    assert!(physical.contains(&want), "{physical}");

    // The gpu and host levels each count every matching sample once.
    let n = samples
        .iter()
        .filter(|s| s.metric == METRICS[1] && s.rack == "k2" && s.ts >= from)
        .count() as i64;
    let got = rows(&engine.sql(&sql).await.unwrap());
    assert_eq!(got.len(), 2, "{got:?}");
    let total: i64 = got.iter().map(|r| r[1].as_i64().unwrap()).sum();
    assert_eq!(total, 2 * n);
}

#[test]
fn pushdown_reads_levels_fields_and_time() {
    let ms = |v| {
        lit(ScalarValue::TimestampMillisecond(
            Some(v),
            Some("UTC".into()),
        ))
    };
    let p = Pushdown::from_filters(&[
        col("level")
            .eq(lit("rack"))
            .or(col("level").eq(lit("row")).or(lit("gpu").eq(col("level")))),
        col("level").eq(lit("host")).or(col("metric").eq(lit("x"))), // not understood
        col("metric").eq(lit("m")),
        lit("k1").eq(col("rack")),
        col("ts").between(ms(10), ms(20)),
        col("avg").gt(lit(3.0)),
    ]);
    assert_eq!(p.filter.metric.as_deref(), Some("m"));
    assert_eq!(p.filter.rack.as_deref(), Some("k1"));
    assert_eq!((p.time.min_ts, p.time.max_ts), (10, 20));
    // A rack filter also rules out the row and cluster levels, where rack is blank.
    assert_eq!(p.levels(), [RollupLevel::Gpu, RollupLevel::Rack]);

    let p = Pushdown::from_filters(&[
        col("level").in_list(vec![lit("rack"), lit("cluster"), lit("nope")], false),
        col("level").eq(lit("cluster")),
    ]);
    assert_eq!(p.levels(), [RollupLevel::Cluster]);

    let p = Pushdown::from_filters(&[col("metric").eq(lit("a")), col("metric").eq(lit("b"))]);
    assert!(p.levels().is_empty(), "contradicting filters match nothing");

    let p = Pushdown::from_filters(&[col("level").eq(lit("galaxy"))]);
    assert!(p.levels().is_empty());

    let table = RollupTable::new(
        Arc::new(Storage::open(StorageConfig::new(tempfile::tempdir().unwrap().path())).unwrap()),
        RollupTier::Hour,
    );
    let or = col("level").eq(lit("rack")).or(col("rack").eq(lit("k1")));
    let eq = col("host").eq(lit("h")).and(col("level").eq(lit("host")));
    let levels = col("level").in_list(vec![lit("rack"), lit("row")], false);
    let empty = col("host").eq(lit(""));
    let time = col("ts").gt_eq(ms(10)).and(col("ts").lt(ms(20)));
    let fine = col("ts").gt(lit(ScalarValue::TimestampNanosecond(
        Some(10_500_000),
        None,
    )));
    let not_eq = col("metric").gt(lit("m"));
    use TableProviderFilterPushDown::{Exact, Inexact, Unsupported};
    assert_eq!(
        table
            .supports_filters_pushdown(&[&or, &eq, &levels, &empty, &time, &fine, &not_eq])
            .unwrap(),
        // Storage keeps exactly the groups an equality or a level names; an
        // empty field is NULL in SQL, which no `=` keeps. The scan keeps the
        // windows that start within a bound by a whole millisecond; one
        // between two milliseconds is left to DataFusion.
        [
            Unsupported,
            Exact,
            Exact,
            Inexact,
            Exact,
            Inexact,
            Unsupported
        ]
    );
    // Strict bounds by a whole millisecond exclude it.
    let p = Pushdown::from_filters(&[col("ts").gt(ms(10)), col("ts").lt(ms(20))]);
    assert_eq!((p.time.min_ts, p.time.max_ts), (11, 19));
    let p = Pushdown::from_filters(&[fine]);
    assert_eq!((p.time.min_ts, p.time.max_ts), (10, i64::MAX));
}

#[test]
fn tier_choice_follows_step_and_retention() {
    let day = Duration::from_secs(86_400);
    let mut config = StorageConfig::new("/nonexistent");
    config.retention_1m = Some(30 * day);
    config.retention_1h = Some(400 * day);
    config.retention_1d = Some(5 * 365 * day);
    let now = T0;
    let ago = |d: i64| now - d * 86_400_000;
    let (min, hour) = (60_000, 3_600_000);
    // Recent data: the coarsest tier no coarser than the step.
    assert_eq!(pick_tier(&config, now, ago(1), 5 * min), RollupTier::Minute);
    assert_eq!(pick_tier(&config, now, ago(1), hour), RollupTier::Hour);
    assert_eq!(pick_tier(&config, now, ago(1), 6 * hour), RollupTier::Hour);
    assert_eq!(pick_tier(&config, now, ago(1), 86_400_000), RollupTier::Day);
    // Finer than a minute: minutes are the finest rollups there are.
    assert_eq!(pick_tier(&config, now, ago(1), 1_000), RollupTier::Minute);
    // Minutes are gone after 30 days: hours, though coarser than asked.
    assert_eq!(pick_tier(&config, now, ago(60), 5 * min), RollupTier::Hour);
    assert_eq!(pick_tier(&config, now, ago(500), hour), RollupTier::Day);
    // Older than every tier: the one kept longest.
    assert_eq!(pick_tier(&config, now, ago(4000), hour), RollupTier::Day);
    config.retention_1h = None;
    assert_eq!(pick_tier(&config, now, ago(4000), hour), RollupTier::Hour);
}

#[test]
fn steps_parse() {
    assert_eq!(parse_duration_ms("15m"), Some(900_000));
    assert_eq!(parse_duration_ms("1 hour"), Some(3_600_000));
    assert_eq!(parse_duration_ms(" 2 days"), Some(172_800_000));
    assert_eq!(parse_duration_ms("90s"), Some(90_000));
    assert_eq!(parse_duration_ms("1w"), Some(604_800_000));
    assert_eq!(parse_duration_ms("h"), None);
    assert_eq!(parse_duration_ms("5 fortnights"), None);
    assert_eq!(parse_duration_ms("99999999999999999999d"), None);
}

#[tokio::test]
async fn rollup_function_picks_a_tier_and_bounds_the_windows() {
    let (_dir, st, samples) = fixture();
    let engine = QueryEngine::new(st);
    let (from, to) = (T0 + 3_600_000, T0 + 3 * 3_600_000);
    let n = samples
        .iter()
        .filter(|s| s.metric == METRICS[0] && s.ts >= from && s.ts < to)
        .count() as i64;
    for (step, tier) in [("'15m'", "1m"), ("INTERVAL '1 hour'", "1h"), ("'2h'", "1h")] {
        let r = engine
            .sql(&format!(
                "SELECT tier, min(ts), max(ts), sum(count) FROM rollup('{}', '{}', {step}) \
                 WHERE level = 'cluster' AND metric = '{}' GROUP BY tier",
                ts_text(from),
                ts_text(to),
                METRICS[0]
            ))
            .await
            .unwrap();
        let got = rows(&r);
        assert_eq!(got.len(), 1, "{step}: {got:?}");
        assert_eq!(got[0][0], tier, "{step}");
        assert_eq!(got[0][1], ts_text(from).as_str());
        let last_window = to - if tier == "1m" { 60_000 } else { 3_600_000 };
        assert_eq!(got[0][2], ts_text(last_window).as_str());
        assert_eq!(got[0][3], n, "{step}");
    }

    // The day tier: its one window starts before `from`, so no rows.
    let r = engine
        .sql(&format!(
            "SELECT count(*) FROM rollup('{}', '{}', '1d')",
            ts_text(from),
            ts_text(to)
        ))
        .await
        .unwrap();
    assert_eq!(rows(&r)[0][0], 0);

    // Constant expressions work; bad arguments are plan errors that say why.
    engine
        .sql("SELECT count(*) FROM rollup(now() - interval '1 day', now(), '1h')")
        .await
        .unwrap();
    for (args, says) in [
        (
            "'2025-11-30T00:00:00Z', '2025-11-30T01:00:00Z'",
            "takes 3 arguments",
        ),
        (
            "'yesterday', '2025-11-30T01:00:00Z', '1h'",
            "start must be a timestamp",
        ),
        (
            "'2025-11-30T00:00:00Z', '2025-11-30T01:00:00Z', '0h'",
            "step must be",
        ),
        (
            "'2025-11-30T01:00:00Z', '2025-11-30T00:00:00Z', '1h'",
            "end must be after start",
        ),
    ] {
        let e = engine
            .sql(&format!("SELECT * FROM rollup({args})"))
            .await
            .unwrap_err();
        assert!(
            matches!(e, crate::QueryError::BadQuery(_)) && e.to_string().contains(says),
            "{args}: {e}"
        );
    }
}

/// A text column built from runs equals the one `StringBuilder` builds a
/// row at a time: values, NULLs and empty strings, runs of 0 to 300 rows.
#[test]
fn text_runs_equal_a_row_at_a_time() {
    let values = [
        Some("rack-0001"),
        None,
        Some(""),
        Some("a"),
        Some("host-with-a-much-longer-name-0042"),
    ];
    let mut runs = TextRuns::default();
    let mut rows = arrow::array::StringBuilder::new();
    for (i, n) in [0usize, 1, 2, 3, 7, 64, 300, 1, 0, 5, 129]
        .into_iter()
        .enumerate()
    {
        let v = values[i % values.len()];
        runs.push(v, n);
        for _ in 0..n {
            rows.append_option(v);
        }
    }
    assert_eq!(runs.finish().unwrap(), rows.finish());
}
