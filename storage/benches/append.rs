//! End-to-end append throughput (WAL + head) and head memory per series.
//!
//!   cargo bench -p storage --bench append
//!
//! A fleet-shaped workload: 10,000 series (dcgm-exporter label sets: 8 GPUs x
//! 25 metrics x 50 hosts), appended one poll (10,000 samples) per call, as
//! ingest does with a batch. Memory per series is measured from RSS before
//! and after creating 100,000 series with one sample each.

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use storage::{SeriesRef, Storage, StorageConfig, SyncPolicy};

// The fleet's key shape, shared with the wal and scan benches.
#[allow(dead_code)]
mod fleet;
use fleet::key;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn head_memory_per_series() {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    let n = 100_000;
    let before = rss_bytes();
    let refs: Vec<SeriesRef> = (0..n).map(|i| st.series_ref(key(i)).unwrap()).collect();
    st.append(&refs, &vec![1_775_000_000_000; n], &vec![1.0; n])
        .unwrap();
    // The bench's own vector of refs (4 bytes a series) is not the head's.
    drop(refs);
    let after = rss_bytes();
    let label_bytes: usize = (0..n)
        .map(|i| {
            let k = key(i);
            k.metric().len()
                + k.labels()
                    .iter()
                    .map(|l| l.name.len() + l.value.len())
                    .sum::<usize>()
        })
        .sum();
    // The sample's own compressed bytes (a Gorilla chunk of one sample):
    // the figure is what the head takes beyond them.
    let mut one = storage::gorilla::GorillaEncoder::new();
    one.append(1_775_000_000_000, 1.0);
    let per_series = (after - before) as f64 / n as f64;
    println!(
        "head memory: {:.0} bytes per active series with one sample, {:.0} beyond its {} compressed bytes ({} series; label strings alone {:.0} bytes)",
        per_series,
        per_series - one.bytes().len() as f64,
        one.bytes().len(),
        n,
        label_bytes as f64 / n as f64
    );
}

fn bench(c: &mut Criterion) {
    head_memory_per_series();
    let series = 10_000;
    let mut g = c.benchmark_group("append");
    g.throughput(Throughput::Elements(series as u64));
    g.measurement_time(Duration::from_secs(5));
    for (name, policy) in [("wal_os", SyncPolicy::Os), ("wal_fsync", SyncPolicy::Fsync)] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = StorageConfig::new(dir.path());
        cfg.wal_sync = policy;
        let st = Storage::open(cfg).unwrap();
        let refs: Vec<SeriesRef> = (0..series)
            .map(|i| st.series_ref(key(i)).unwrap())
            .collect();
        let vals: Vec<f64> = (0..series).map(|i| (i % 700) as f64 + 0.5).collect();
        let mut t = 1_775_000_000_000i64;
        g.bench_function(name, |b| {
            b.iter(|| {
                t += 1000;
                let out = st.append(&refs, &vec![t; series], &vals).unwrap();
                black_box(out.accepted)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
