//! PromQL evaluation throughput: `query::promql::PromEngine` on a fleet's
//! DCGM metrics, in raw samples read per second.
//!
//!   cargo bench --profile perf --workspace --bench promql
//!
//! (`--workspace`, not `-p query`: building the query crate alone unifies
//! different features and rebuilds DataFusion.)
//!
//! Data: 64 hosts x 8 GPUs (16 racks of 4 hosts, dcgm-exporter labels:
//! `Hostname`, `gpu`, `UUID`, `rack`, `row`, `cluster`, ...) x 4 metrics
//! (`DCGM_FI_DEV_GPU_TEMP`, `DCGM_FI_DEV_POWER_USAGE`,
//! `DCGM_FI_DEV_GPU_UTIL`, and the counter
//! `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` in mJ), every 10 s for 7 hours:
//! 2,048 series, 5.2 M samples. Values come from a seeded, stateless
//! generator (a load curve per GPU with noise, at each sensor's resolution).
//! Appended one 2,048-sample poll per call and flushed every 2 hours of data
//! (4 segments, like compacted ones); the head is empty when queries run.
//!
//! Queries, all ending at the last sample:
//! - `avg by (rack) (DCGM_FI_DEV_GPU_TEMP)`, range over 1 h, step 60 s;
//! - `sum by (Hostname) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m]))`,
//!   range over 6 h, step 5 m;
//! - `topk(10, DCGM_FI_DEV_GPU_TEMP)`, instant;
//! - `max_over_time(DCGM_FI_DEV_POWER_USAGE[1h])`, instant.
//!
//! The throughput of each is the number of raw samples its selector reads
//! (every sample of the matching series in `[first step - lookback or range,
//! last step]`, as the evaluator loads them), counted from the generator's
//! grid and checked once against `Storage::select` before timing. One core.

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use query::promql::{PromEngine, PromValue};
use storage::{Label, Matcher, SeriesKey, SeriesRef, Storage, StorageConfig};

const HOSTS: usize = 64;
const GPUS: usize = 8;
const METRICS: [&str; 4] = [
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
];
const SERIES: usize = HOSTS * GPUS * METRICS.len();
/// Series per metric.
const PER_METRIC: usize = HOSTS * GPUS;
const INTERVAL_MS: i64 = 10_000;
/// 7 hours at 10 s.
const POLLS: usize = 7 * 360;
/// Flush every 2 hours of data.
const FLUSH_EVERY: usize = 2 * 360;
/// 2026-04-01T00:00:00Z.
const T0: i64 = 1_775_001_600_000;
const T_END: i64 = T0 + (POLLS as i64 - 1) * INTERVAL_MS;
const MIN: i64 = 60_000;
const HOUR: i64 = 60 * MIN;
const LOOKBACK: i64 = 5 * MIN;

/// Series `i`: metric `i % 4` of GPU `(i / 4) % 8` of host `i / 32`.
fn key(i: usize) -> SeriesKey {
    let (host, gpu, metric) = (i / (GPUS * 4), (i / 4) % GPUS, i % 4);
    SeriesKey::new(
        METRICS[metric],
        vec![
            Label::new("gpu", gpu.to_string()),
            Label::new(
                "UUID",
                format!("GPU-{host:08x}-{gpu:04x}-4c22-9d1e-5a0f3b2c{gpu:04x}"),
            ),
            Label::new("pci_bus_id", format!("00000000:{:02X}:00.0", 0x18 + gpu)),
            Label::new("device", format!("nvidia{gpu}")),
            Label::new("modelName", "NVIDIA H100 80GB HBM3"),
            Label::new("Hostname", format!("gpu-node-{host:05}")),
            Label::new("DCGM_FI_DRIVER_VERSION", "550.54.15"),
            Label::new("cluster", "prod-1"),
            Label::new("row", format!("row-{}", host / 16)),
            Label::new("rack", format!("rack-{}", host / 4)),
        ],
    )
    .expect("valid key")
}

/// A hash of (series, poll) mapped to [-1, 1).
fn noise(i: usize, p: usize) -> f64 {
    let mut z = ((i as u64) << 32) ^ (p as u64) ^ 0x9e37_79b9_7f4a_7c15;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// Load of a GPU at poll `p`, 0..1: a one-hour cycle with a per-GPU phase.
fn load(gpu_index: usize, p: usize) -> f64 {
    let phase = (gpu_index * 37 % 100) as f64 / 100.0;
    let x = 0.55 + 0.45 * (std::f64::consts::TAU * (p as f64 / 360.0 + phase)).sin();
    x.clamp(0.0, 1.0)
}

/// Power in W (mW resolution) of GPU `g` at poll `p`.
fn power(g: usize, p: usize) -> f64 {
    ((75.0 + 620.0 * load(g, p) + 15.0 * noise(g * 4 + 1, p)) * 1000.0).round() / 1000.0
}

fn build() -> (tempfile::TempDir, Arc<Storage>) {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    let refs: Vec<SeriesRef> = (0..SERIES)
        .map(|i| st.series_ref(key(i)).unwrap())
        .collect();
    let started = Instant::now();
    // Energy counters in mJ, one per GPU.
    let mut energy: Vec<f64> = (0..HOSTS * GPUS).map(|g| 2.3e11 + g as f64 * 1e9).collect();
    let mut vals = vec![0.0; SERIES];
    for p in 0..POLLS {
        for (g, e) in energy.iter_mut().enumerate() {
            let w = power(g, p);
            let l = load(g, p);
            *e += (w * INTERVAL_MS as f64).round();
            let i = g * 4;
            vals[i] = (32.0 + 50.0 * l + 2.0 * noise(i, p)).round();
            vals[i + 1] = w;
            vals[i + 2] = (100.0 * l + 3.0 * noise(i + 2, p))
                .round()
                .clamp(0.0, 100.0);
            vals[i + 3] = *e;
        }
        let ts = vec![T0 + p as i64 * INTERVAL_MS; SERIES];
        let out = st.append(&refs, &ts, &vals).unwrap();
        assert_eq!(out.accepted as usize, SERIES);
        if (p + 1) % FLUSH_EVERY == 0 || p + 1 == POLLS {
            st.flush().unwrap();
        }
    }
    let stats = st.stats();
    assert_eq!(stats.head_samples, 0);
    assert_eq!(stats.segment_samples as usize, SERIES * POLLS);
    println!(
        "promql: {SERIES} series, {} samples in {} segments, built in {:.1} s",
        stats.segment_samples,
        stats.segments,
        started.elapsed().as_secs_f64()
    );
    (dir, Arc::new(st))
}

/// Samples of one metric's series with timestamps in `[lo, hi]`, from the grid.
fn grid_samples(lo: i64, hi: i64) -> usize {
    let n = (0..POLLS)
        .map(|p| T0 + p as i64 * INTERVAL_MS)
        .filter(|t| (lo..=hi).contains(t))
        .count();
    n * PER_METRIC
}

/// The same, read through storage, and the samples of the chunks that
/// overlap `[lo, hi]` (what is decoded to read them).
fn stored_samples(st: &Storage, metric: &str, lo: i64, hi: i64) -> (usize, usize) {
    let (mut ts, mut vs) = (Vec::new(), Vec::new());
    let mut decoded = 0;
    for s in st.select(&[Matcher::equal("__name__", metric)], lo, hi) {
        s.read_into(lo, hi, &mut ts, &mut vs).unwrap();
        decoded += s.max_samples();
    }
    (ts.len(), decoded)
}

/// One benchmarked query: a range query (`step > 0`) or an instant one at `end`.
struct Case {
    name: &'static str,
    query: &'static str,
    metric: &'static str,
    start: i64,
    end: i64,
    step: i64,
    /// How far before the first step the selector reads: lookback or range.
    reach: i64,
    /// Series (range queries) or samples (instant queries) in the result.
    result_len: usize,
    /// Points per series of a range query's result.
    points: usize,
}

impl Case {
    fn run(&self, engine: &PromEngine) -> PromValue {
        if self.step > 0 {
            engine.range(self.query, self.start, self.end, self.step)
        } else {
            engine.instant(self.query, self.end)
        }
        .unwrap_or_else(|e| panic!("{}: {e}", self.query))
    }

    fn check(&self, v: &PromValue) {
        match v {
            PromValue::Matrix(m) => {
                assert_eq!(m.len(), self.result_len, "{}", self.query);
                for s in m {
                    assert_eq!(s.points.len(), self.points, "{}", self.query);
                }
            }
            PromValue::Vector(v) => assert_eq!(v.len(), self.result_len, "{}", self.query),
            other => panic!("{}: unexpected {other:?}", self.query),
        }
    }
}

fn bench(c: &mut Criterion) {
    let (_dir, st) = build();
    let engine = PromEngine::new(st.clone());
    let cases = [
        Case {
            name: "avg_by_rack_temp_range_1h_step_60s",
            query: "avg by (rack) (DCGM_FI_DEV_GPU_TEMP)",
            metric: "DCGM_FI_DEV_GPU_TEMP",
            start: T_END - HOUR,
            end: T_END,
            step: MIN,
            reach: LOOKBACK,
            result_len: HOSTS / 4,
            points: 61,
        },
        Case {
            name: "sum_by_host_rate_energy_5m_range_6h_step_5m",
            query: "sum by (Hostname) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m]))",
            metric: "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            start: T_END - 6 * HOUR,
            end: T_END,
            step: 5 * MIN,
            reach: 5 * MIN,
            result_len: HOSTS,
            points: 73,
        },
        Case {
            name: "topk_10_temp_instant",
            query: "topk(10, DCGM_FI_DEV_GPU_TEMP)",
            metric: "DCGM_FI_DEV_GPU_TEMP",
            start: T_END,
            end: T_END,
            step: 0,
            reach: LOOKBACK,
            result_len: 10,
            points: 0,
        },
        Case {
            name: "max_over_time_power_1h_instant",
            query: "max_over_time(DCGM_FI_DEV_POWER_USAGE[1h])",
            metric: "DCGM_FI_DEV_POWER_USAGE",
            start: T_END,
            end: T_END,
            step: 0,
            reach: HOUR,
            result_len: PER_METRIC,
            points: 0,
        },
    ];

    let mut g = c.benchmark_group("promql");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(4));
    for case in &cases {
        let (lo, hi) = (case.start - case.reach, case.end);
        let samples = grid_samples(lo, hi);
        let (stored, decoded) = stored_samples(&st, case.metric, lo, hi);
        assert_eq!(stored, samples, "{}", case.name);
        case.check(&case.run(&engine));
        println!(
            "promql: {} reads {samples} samples (from chunks of {decoded})",
            case.query
        );
        g.throughput(Throughput::Elements(samples as u64));
        g.bench_function(case.name, |b| b.iter(|| black_box(case.run(&engine))));
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
