use super::*;
use crate::{QueryEngine, QueryError, http::to_json};
use datafusion::prelude::{col, lit};
use storage::{Label, StorageConfig};

const T0: i64 = 1_764_460_800_000; // 2025-11-30T00:00:00Z

fn gpu_key(metric: &str, host: &str, gpu: u32) -> SeriesKey {
    SeriesKey::new(
        metric,
        vec![
            Label::new("gpu", gpu.to_string()),
            Label::new("UUID", format!("GPU-{host}-{gpu}")),
            Label::new("modelName", "NVIDIA H100 80GB HBM3"),
            Label::new("Hostname", host),
            Label::new("cluster", "c1"),
            Label::new("row", "r1"),
            Label::new("rack", "k1"),
            Label::new("err_code", if gpu == 1 { "79" } else { "" }),
        ],
    )
    .unwrap()
}

/// Two hosts x two GPUs x two metrics, 100 samples each at 1 s; value i*gpu+h.
/// Returns the storage and the samples written, keyed by (metric, host, gpu).
/// Samples written per (metric, host, gpu).
type Written = Vec<((String, String, u32), Vec<(i64, f64)>)>;

fn fixture() -> (tempfile::TempDir, Arc<Storage>, Written) {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    let mut written = Vec::new();
    for metric in ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE"] {
        for (h, host) in ["node-a", "node-b"].iter().enumerate() {
            for gpu in 0..2u32 {
                let r = st.series_ref(gpu_key(metric, host, gpu)).unwrap();
                let samples: Vec<(i64, f64)> = (0..100)
                    .map(|i| {
                        (
                            T0 + i * 1000,
                            (i * (gpu as i64 + 1) + h as i64) as f64 * 0.5,
                        )
                    })
                    .collect();
                let ts: Vec<i64> = samples.iter().map(|s| s.0).collect();
                let vs: Vec<f64> = samples.iter().map(|s| s.1).collect();
                st.append(&vec![r; 100], &ts, &vs).unwrap();
                written.push(((metric.to_string(), host.to_string(), gpu), samples));
            }
        }
    }
    // Half of it in a segment, the rest in the head.
    st.flush().unwrap();
    (dir, st, written)
}

fn rows(v: &serde_json::Value) -> Vec<Vec<serde_json::Value>> {
    v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().clone())
        .collect()
}

#[tokio::test]
async fn aggregates_match_a_naive_fold() {
    let (_dir, st, written) = fixture();
    let engine = QueryEngine::new(st);
    let r = engine
        .sql(
            "SELECT metric, host, gpu, count(*) AS n, min(value), max(value), sum(value) \
             FROM samples GROUP BY metric, host, gpu ORDER BY metric, host, gpu",
        )
        .await
        .unwrap();
    let got = rows(&to_json(&r).unwrap());
    assert_eq!(got.len(), written.len());
    for (row, ((metric, host, gpu), samples)) in got.iter().zip(&written) {
        assert_eq!(row[0], *metric);
        assert_eq!(row[1], *host);
        assert_eq!(row[2], gpu.to_string());
        assert_eq!(row[3], samples.len());
        let vals: Vec<f64> = samples.iter().map(|s| s.1).collect();
        assert_eq!(
            row[4].as_f64().unwrap(),
            vals.iter().cloned().fold(f64::INFINITY, f64::min)
        );
        assert_eq!(
            row[5].as_f64().unwrap(),
            vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max)
        );
        assert_eq!(row[6].as_f64().unwrap(), vals.iter().sum::<f64>());
    }
}

#[tokio::test]
async fn time_and_label_filters_return_exact_rows() {
    let (_dir, st, _) = fixture();
    let engine = QueryEngine::new(st);
    // 10 s window: samples 10..=19 of one series.
    let r = engine
        .sql(
            "SELECT ts, value FROM samples WHERE metric = 'DCGM_FI_DEV_GPU_TEMP' AND host = 'node-b' \
             AND gpu = '1' AND ts >= TIMESTAMP '2025-11-30T00:00:10Z' AND ts < TIMESTAMP '2025-11-30T00:00:20Z' ORDER BY ts",
        )
        .await
        .unwrap();
    let got = rows(&to_json(&r).unwrap());
    let want: Vec<f64> = (10..20).map(|i| (i * 2 + 1) as f64 * 0.5).collect();
    assert_eq!(
        got.iter()
            .map(|r| r[1].as_f64().unwrap())
            .collect::<Vec<_>>(),
        want
    );
    assert_eq!(got[0][0], "2025-11-30T00:00:10Z");

    // `row` and the topology columns, and other labels as JSON.
    let r = engine
        .sql("SELECT DISTINCT cluster, \"row\", rack, uuid, model_name, labels FROM samples WHERE gpu = '1' AND host = 'node-a'")
        .await
        .unwrap();
    let got = rows(&to_json(&r).unwrap());
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0],
        [
            "c1",
            "r1",
            "k1",
            "GPU-node-a-1",
            "NVIDIA H100 80GB HBM3",
            r#"{"err_code":"79"}"#
        ]
        .map(serde_json::Value::from)
        .to_vec()
    );

    let r = engine
        .sql("SELECT count(DISTINCT gpu || host) FROM samples")
        .await
        .unwrap();
    assert_eq!(rows(&to_json(&r).unwrap())[0][0], 4);

    // count(*) scans with no column projected (it failed with HTTP 500 once).
    let r = engine.sql("SELECT count(*) FROM samples").await.unwrap();
    assert_eq!(rows(&to_json(&r).unwrap())[0][0], 2 * 2 * 2 * 100);
    let r = engine
        .sql("SELECT count(*) FROM samples WHERE gpu = '1' AND ts >= TIMESTAMP '2025-11-30T00:01:00Z'")
        .await
        .unwrap();
    assert_eq!(rows(&to_json(&r).unwrap())[0][0], 2 * 2 * 40);
}

/// `host` is `Hostname` (dcgm-exporter) or `hostname`: a filter on it finds
/// both, through one storage selection per name, and a series that has both
/// once.
#[tokio::test]
async fn host_filters_find_either_label_name_once() {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    let series = [
        ("upper", vec![Label::new("Hostname", "n1")]),
        ("lower", vec![Label::new("hostname", "n1")]),
        (
            "both",
            vec![Label::new("Hostname", "n1"), Label::new("hostname", "n1")],
        ),
        ("other", vec![Label::new("Hostname", "n2")]),
    ];
    for (i, (metric, labels)) in series.iter().enumerate() {
        let r = st
            .series_ref(SeriesKey::new(*metric, labels.clone()).unwrap())
            .unwrap();
        st.append(&[r], &[T0], &[i as f64]).unwrap();
    }
    let engine = QueryEngine::new(st);
    let r = engine
        .sql("SELECT metric, value FROM samples WHERE host = 'n1' ORDER BY metric")
        .await
        .unwrap();
    assert_eq!(
        rows(&to_json(&r).unwrap()),
        [
            [serde_json::json!("both"), serde_json::json!(2.0)],
            [serde_json::json!("lower"), serde_json::json!(1.0)],
            [serde_json::json!("upper"), serde_json::json!(0.0)],
        ]
    );
}

#[tokio::test]
async fn queries_are_read_only_and_errors_are_bad_queries() {
    let (_dir, st, _) = fixture();
    let engine = QueryEngine::new(st);
    for q in ["CREATE TABLE t AS SELECT 1", "DROP TABLE samples"] {
        match engine.sql(q).await {
            Err(QueryError::ReadOnly(_)) => {}
            other => panic!("{q}: {other:?}"),
        }
    }
    for q in ["SELECT nope FROM samples", "SELEC 1"] {
        match engine.sql(q).await {
            Err(QueryError::BadQuery(_)) => {}
            other => panic!("{q}: {other:?}"),
        }
    }
}

#[test]
fn pushdown_extracts_time_bounds_and_labels() {
    let ms = |v| {
        lit(ScalarValue::TimestampMillisecond(
            Some(v),
            Some("UTC".into()),
        ))
    };
    let ns = |v| {
        lit(ScalarValue::TimestampNanosecond(
            Some(v),
            Some("+00:00".into()),
        ))
    };
    let p = Pushdown::from_filters(&[
        col("ts").gt_eq(ms(1000)),
        ns(5_000_500_000).gt(col("ts")), // ts < 5000.5 ms -> max 5001 (conservative)
        col("metric").eq(lit("m")),
        col("host").eq(lit("h")),
        col("value").gt(lit(1.0)),
    ]);
    assert_eq!(p.time.min_ts, 1000);
    assert_eq!(p.time.max_ts, 5001);
    assert_eq!(
        p.equal,
        vec![
            (Col::Metric, "m".into()),
            (Col::by_name("host").unwrap(), "h".into())
        ]
    );
    // host maps to two label names, so only the metric becomes a storage
    // matcher of its own; a scan selects once per name of host.
    assert_eq!(p.matchers(), vec![Matcher::equal("__name__", "m")]);
    let name = |n: &str| Matcher::equal("__name__", n);
    assert_eq!(
        p.matcher_sets(),
        [
            vec![name("m"), Matcher::equal("Hostname", "h")],
            vec![name("m"), Matcher::equal("hostname", "h")],
        ]
    );
    // Two columns of two names each make four sets; a third is left to
    // the filter.
    let p = Pushdown::from_filters(&[
        col("host").eq(lit("h")),
        col("uuid").eq(lit("u")),
        col("gpu").eq(lit("0")),
        col("host").eq(lit("h2")),
    ]);
    let sets = p.matcher_sets();
    assert_eq!(sets.len(), 4);
    assert!(sets.iter().all(|s| s.contains(&Matcher::equal("gpu", "0"))));
    for name in ["Hostname", "hostname"] {
        assert!(!sets.iter().any(|s| s.contains(&Matcher::equal(name, "h2"))));
    }

    let table = SamplesTable::new(Arc::new(
        Storage::open(StorageConfig::new(tempfile::tempdir().unwrap().path())).unwrap(),
    ));
    let value_filter = col("value").gt(lit(1.0));
    let ts_filter = col("ts").lt(ms(5));
    let support = table
        .supports_filters_pushdown(&[&value_filter, &ts_filter])
        .unwrap();
    assert_eq!(
        support,
        [
            TableProviderFilterPushDown::Unsupported,
            TableProviderFilterPushDown::Inexact
        ]
    );
}

#[tokio::test]
async fn nan_and_infinities_render_as_strings() {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    let r = st.series_ref(SeriesKey::new("m", vec![]).unwrap()).unwrap();
    st.append(
        &[r, r, r],
        &[1, 2, 3],
        &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY],
    )
    .unwrap();
    let res = QueryEngine::new(st)
        .sql("SELECT value FROM samples ORDER BY ts")
        .await
        .unwrap();
    let got: Vec<serde_json::Value> = rows(&to_json(&res).unwrap())
        .into_iter()
        .map(|r| r[0].clone())
        .collect();
    assert_eq!(
        got,
        ["NaN", "+Inf", "-Inf"]
            .map(serde_json::Value::from)
            .to_vec()
    );
}

#[tokio::test]
async fn explain_shows_the_pushed_filters_and_what_storage_selected() {
    let (_dir, st, _) = fixture();
    let engine = QueryEngine::new(st);
    let physical = crate::physical_plan(
        &engine,
        "SELECT avg(value) FROM samples WHERE metric = 'DCGM_FI_DEV_GPU_TEMP' \
         AND host = 'node-a' AND ts >= TIMESTAMP '2025-11-30T00:00:10Z'",
    )
    .await;
    // Two GPUs of node-a have that metric; 100 samples each at most.
    assert!(
        physical.contains(
            "SamplesScanExec: metric=DCGM_FI_DEV_GPU_TEMP, host=node-a, \
             ts=[2025-11-30T00:00:10Z, +inf], series=2, samples<=200, projection=[ts, metric, host, value]"
        ),
        "{physical}"
    );
}
