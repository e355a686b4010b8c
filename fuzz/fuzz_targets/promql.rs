//! PromQL, parsed and evaluated over a small real store: any text must
//! give a value or a `PromError`, never a panic, a stack overflow or a hang.
//!
//! The store (built once, in a tempdir) holds a few series of two DCGM
//! metrics, half flushed to a segment and half in the head, with NaN, ±Inf
//! and -0.0 among the values. Each UTF-8 input is evaluated as an instant
//! query and as a small range query, under the engine's query limits
//! (`QueryGuard`: length and depth) and a short deadline.
//!
//! Where it runs: on a thread of `QUERY_STACK_BYTES` (64 MiB), as the node
//! runs every query (`QueryGuard::spawn_blocking`). The depth limit is what
//! keeps a deep expression from overflowing that stack; a crash here with
//! "stack overflow" means the limit does not hold. libFuzzer's own
//! `-rss_limit_mb` (2 GiB by default) catches an evaluation that the
//! samples limit fails to bound.
#![no_main]

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use query::limits::{Deadline, QUERY_STACK_BYTES, QueryGuard, QueryLimits, Refusal};
use query::promql::{PromEngine, PromError, PromLimits, PromValue};
use storage::{Label, SeriesKey, Storage, StorageConfig};

/// First sample; queries look at [T0, T0 + 10 min].
const T0: i64 = 1_700_000_000_000;
const STEP_MS: i64 = 15_000;
const RANGE_END: i64 = T0 + 600_000;
const RANGE_STEP: i64 = 60_000;
/// Smaller than the default so that the fuzzer reaches it.
const MAX_LENGTH: usize = 2048;

struct Fixture {
    engine: PromEngine,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut config = StorageConfig::new(dir.path());
        config.retention = None;
        let storage = Arc::new(Storage::open(config).expect("open storage"));
        let odd = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 0.0];
        for (metric, counter) in [
            ("DCGM_FI_DEV_GPU_TEMP", false),
            ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", true),
        ] {
            for (host, gpu) in [("h1", "0"), ("h1", "1"), ("h2", "0")] {
                let key = SeriesKey::new(
                    metric,
                    vec![
                        Label::new("Hostname", host),
                        Label::new("gpu", gpu),
                        Label::new("UUID", format!("GPU-{host}-{gpu}")),
                    ],
                )
                .expect("valid key");
                let r = storage.series_ref(key).expect("series");
                let (mut ts, mut vs) = (Vec::new(), Vec::new());
                for i in 0..41i64 {
                    ts.push(T0 + i * STEP_MS);
                    let v = if counter {
                        // A reset half way.
                        ((i % 20) * 1000) as f64
                    } else if i % 7 == 3 {
                        odd[(i as usize / 7) % odd.len()]
                    } else {
                        40.0 + (i % 5) as f64
                    };
                    vs.push(v);
                }
                let refs = vec![r; ts.len()];
                storage
                    .append(&refs[..20], &ts[..20], &vs[..20])
                    .expect("append");
                storage.flush().expect("flush");
                storage
                    .append(&refs[20..], &ts[20..], &vs[20..])
                    .expect("append");
            }
        }
        let guard = QueryGuard::new(QueryLimits {
            max_length: MAX_LENGTH,
            ..QueryLimits::default()
        });
        let limits = PromLimits {
            max_samples: 1_000_000,
            ..PromLimits::default()
        };
        let engine = PromEngine::with_limits(storage, limits).with_guard(Arc::new(guard));
        Fixture { engine, _dir: dir }
    })
}

fn check_limits(query: &str, result: &Result<PromValue, PromError>) {
    if query.len() > MAX_LENGTH {
        assert!(
            matches!(result, Err(PromError::Refused(Refusal::TooLong { .. }))),
            "a query of {} bytes passed the length limit: {result:?}",
            query.len()
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(query) = std::str::from_utf8(data) else {
        return;
    };
    let engine = fixture().engine.clone();
    let query = query.to_owned();
    let worker = std::thread::Builder::new()
        .stack_size(QUERY_STACK_BYTES)
        .spawn(move || {
            let deadline = Deadline::after(Duration::from_millis(500));
            let at = T0 + 300_000;
            let instant = engine
                .instant_answer_until(&query, at, deadline)
                .map(|a| a.value);
            check_limits(&query, &instant);
            if let Ok(PromValue::Vector(samples)) = &instant {
                for s in samples {
                    assert_eq!(s.t_ms, at, "an instant vector sample is at the query time");
                }
            }
            let deadline = Deadline::after(Duration::from_millis(500));
            let range = engine
                .range_answer_until(&query, T0, RANGE_END, RANGE_STEP, deadline)
                .map(|a| a.value);
            check_limits(&query, &range);
            if let Ok(PromValue::Matrix(series)) = &range {
                let mut seen = std::collections::HashSet::new();
                for s in series {
                    assert!(
                        seen.insert(s.labels.clone()),
                        "two series with one label set: {:?}",
                        s.labels
                    );
                    let mut prev = None;
                    for &(t, _) in &s.points {
                        assert!(
                            (T0..=RANGE_END).contains(&t) && (t - T0) % RANGE_STEP == 0,
                            "a range query point off the step grid: {t}"
                        );
                        assert!(prev < Some(t), "range query points out of order");
                        prev = Some(t);
                    }
                }
            }
        })
        .expect("spawn a query thread");
    if let Err(p) = worker.join() {
        std::panic::resume_unwind(p);
    }
});
