//! Segment scan throughput through `Storage::select` + `SelectedSeries::read_into`,
//! the API the SQL `samples` table, PromQL and remote read all scan with.
//!
//!   cargo bench --profile perf -p storage --bench scan
//!
//! Data: 10,000 fleet-shaped series (the key shape of `append.rs`: 50 hosts x
//! 8 GPUs x 25 metrics, dcgm-exporter labels), 30 minutes at 1 Hz (1,800
//! samples per series, 18 M samples). Values are the real DCGM recordings
//! (`shared/data/real`, read in place; synthetic sequences where absent),
//! each series replaying one recorded (gpu, column) sequence, re-timed onto
//! the 1 s grid. Appended one 10,000-sample poll per call, then flushed:
//! every 2 minutes of data (the server's default `--flush-interval`, 15
//! segments of 120-sample chunks, the shape before compaction) and, in a
//! second storage, once (one segment of 1,800-sample chunks, the shape after
//! compaction). The head is empty when the scans run.
//!
//! Scans, each over the whole time range, summing the values:
//! - `full`: every sample of every series (`select(&[], ..)`);
//! - `host`: one host's 200 series (`Hostname = ...`);
//! - `series`: one series (`__name__`, `Hostname`, `gpu`).
//!
//! Throughput is in samples read per second, one core.

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

// Not every bench uses every helper.
#[allow(dead_code)]
mod fleet;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use storage::{Matcher, SeriesRef, Storage, StorageConfig};

const HOSTS: usize = 50;
const SERIES: usize = HOSTS * fleet::PER_HOST;
const POLLS: usize = 1800;
const T0: i64 = 1_775_000_000_000;

/// Builds a storage in a fresh directory, flushing every `flush_every` polls.
fn build(seqs: &[Vec<f64>], flush_every: usize) -> (tempfile::TempDir, Storage) {
    let dir = tempfile::tempdir().unwrap();
    let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
    let refs: Vec<SeriesRef> = (0..SERIES)
        .map(|i| st.series_ref(fleet::key(i)).unwrap())
        .collect();
    let started = Instant::now();
    let mut flush_time = Duration::ZERO;
    let mut vals = vec![0.0; SERIES];
    for p in 0..POLLS {
        for (i, v) in vals.iter_mut().enumerate() {
            *v = fleet::value(seqs, i, p);
        }
        let out = st
            .append(&refs, &vec![T0 + p as i64 * 1000; SERIES], &vals)
            .unwrap();
        assert_eq!(out.accepted as usize, SERIES);
        if (p + 1) % flush_every == 0 || p + 1 == POLLS {
            let f = Instant::now();
            st.flush().unwrap();
            flush_time += f.elapsed();
        }
    }
    let stats = st.stats();
    assert_eq!(stats.head_samples, 0);
    assert_eq!(stats.segment_samples as usize, SERIES * POLLS);
    println!(
        "scan: built {} segments ({:.3} B/sample) in {:.1} s, of which flushes {:.1} s",
        stats.segments,
        stats.segment_bytes as f64 / stats.segment_samples as f64,
        started.elapsed().as_secs_f64(),
        flush_time.as_secs_f64()
    );
    (dir, st)
}

/// Reads every selected sample over the whole range; returns (count, sum).
fn scan(st: &Storage, matchers: &[Matcher]) -> (usize, f64) {
    let (mut ts, mut vs) = (Vec::new(), Vec::new());
    let (mut n, mut sum) = (0, 0.0);
    for s in st.select(matchers, i64::MIN, i64::MAX) {
        ts.clear();
        vs.clear();
        s.read_into(i64::MIN, i64::MAX, &mut ts, &mut vs).unwrap();
        n += vs.len();
        sum += vs.iter().sum::<f64>();
    }
    (n, sum)
}

fn bench(c: &mut Criterion) {
    let (seqs, source) = fleet::value_sequences();
    println!("scan: values from {source}");
    let host = fleet::hostname(7);
    let cases: [(&str, Vec<Matcher>, usize); 3] = [
        ("full", vec![], SERIES),
        (
            "host",
            vec![Matcher::equal("Hostname", host.as_str())],
            fleet::PER_HOST,
        ),
        (
            "series",
            vec![
                Matcher::equal("__name__", fleet::metric_name(3)),
                Matcher::equal("Hostname", host.as_str()),
                Matcher::equal("gpu", "5"),
            ],
            1,
        ),
    ];
    for (layout, flush_every) in [("2min_segments", 120), ("one_segment", POLLS)] {
        let (_dir, st) = build(&seqs, flush_every);
        let mut g = c.benchmark_group(format!("scan_{layout}"));
        g.sample_size(10);
        g.measurement_time(Duration::from_secs(4));
        for (name, matchers, series) in &cases {
            let want = series * POLLS;
            assert_eq!(scan(&st, matchers).0, want, "{name}");
            g.throughput(Throughput::Elements(want as u64));
            g.bench_function(*name, |b| b.iter(|| black_box(scan(&st, matchers))));
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
