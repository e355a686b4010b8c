//! Flush cost per series: the head's samples to a segment and its minute
//! rollups to a rollup file (all 15 tiers and levels), for a fleet of many
//! series with a few minutes of data each.
//!
//!   cargo bench -p storage --bench flush
//!
//! Each iteration opens a fresh storage, appends polls 10 s apart for every
//! series (`fleet::key`: dcgm-exporter label sets, 8 GPUs x 25 metrics per
//! host), then times `Storage::flush` alone. Criterion runs 20,000 series x
//! 10 minutes. Once, first, it times the flush of issue #18's table: 200,000
//! series x 1 hour (72 M samples, 60 minute records per series, as the raw
//! hour of `benches/rollup_queries.rs`'s history), and prints it.
//!
//! Instructions of the flush alone, on both of its threads (20,000 series):
//!
//!   GPULSE_FLUSH_SERIES=20000 valgrind --tool=callgrind --separate-threads=yes \
//!     --toggle-collect='*flush_locked*' --toggle-collect='*write_frozen*' \
//!     --toggle-collect='*Segment::open*' target/release/deps/flush-* --bench nomatch
//!
//! (callgrind runs one thread at a time, so it counts the work, not how the
//! two threads share it: `perf record -F 999` and the samples per thread
//! over time show that.)

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use storage::{SeriesRef, Storage, StorageConfig};

#[allow(dead_code)]
mod fleet;
use fleet::key;

/// Polls are 10 s apart.
const POLL_MS: i64 = 10_000;
const START_MS: i64 = 1_775_000_000_000;

/// A storage over a fresh directory holding `polls` polls of `n` series,
/// not flushed.
fn filled(n: usize, polls: usize) -> (tempfile::TempDir, Storage) {
    let dir = tempfile::tempdir().unwrap();
    let mut config = StorageConfig::new(dir.path());
    config.max_series = config.max_series.max(n);
    let st = Storage::open(config).unwrap();
    let refs: Vec<SeriesRef> = (0..n).map(|i| st.series_ref(key(i)).unwrap()).collect();
    let mut values = vec![0.0; n];
    for p in 0..polls {
        let ts = vec![START_MS + p as i64 * POLL_MS; n];
        for (i, v) in values.iter_mut().enumerate() {
            *v = ((i * 7 + p * 13) % 1_000) as f64 * 0.5;
        }
        st.append(&refs, &ts, &values).unwrap();
    }
    (dir, st)
}

fn flush_once(n: usize, polls: usize) -> Duration {
    let (_dir, st) = filled(n, polls);
    let t = Instant::now();
    st.flush().unwrap().expect("a segment");
    t.elapsed()
}

fn bench(c: &mut Criterion) {
    // GPULSE_FLUSH_SERIES sets the series of this one flush (a smaller one
    // for `valgrind --tool=callgrind`, whose instruction counts do not move
    // with the machine's load).
    let n = std::env::var("GPULSE_FLUSH_SERIES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
    let polls = 360;
    let took = flush_once(n, polls);
    println!(
        "flush of {n} series x {polls} samples (their segment and 60 minute records each): {:.2} s, {:.1} us per series",
        took.as_secs_f64(),
        took.as_secs_f64() * 1e6 / n as f64
    );

    let (n, polls) = (20_000, 60);
    let mut g = c.benchmark_group("flush");
    g.sample_size(10);
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("20k_series_x_60", |b| {
        b.iter_custom(|iters| (0..iters).map(|_| flush_once(n, polls)).sum());
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
