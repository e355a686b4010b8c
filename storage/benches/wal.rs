//! WAL throughput on its own: encoding fleet-shaped sample batches into WAL
//! records, writing them under the default sync policy, decoding them back,
//! and replaying a WAL when a storage opens.
//!
//!   cargo bench --profile perf -p storage --bench wal
//!
//! Each batch is one poll of 10,000 series (the key shape of `append.rs`), as
//! ingest hands `Storage::append_from` a batch: a samples record plus the
//! batch's mark record.
//!
//! What is measured through which API: the WAL writer (`storage::wal::Wal`,
//! its group-commit thread) and `wal::replay` are crate-private. The public
//! record codec (`storage::wal::record`) is the narrowest public API that
//! isolates the WAL, so:
//! - `encode`: `record::encode_samples` + `record::encode_mark`, exactly the
//!   encoding `Storage::append_from` does before its WAL write;
//! - `encode_write_os`: the same plus what the writer thread does for one
//!   batch under the default `SyncPolicy::Os`: one `write(2)` of the records
//!   to the open segment file, a new segment every 128 MiB (the default
//!   `wal_segment_bytes`). It is a copy of the writer's file handling, not
//!   the writer itself: the channel hand-off to the writer thread is not
//!   included (it is in `append`'s `wal_os`, with the head);
//! - `decode`: `record::decode` over 100 batches in memory (the CRC check and
//!   parse that replay does per record);
//! - `replay_open`: `Storage::open` on a data directory whose WAL holds 100
//!   batches after the 10,000 series records. This is replay as a restart
//!   sees it: reading the segment files (from the page cache), decoding, and
//!   appending every sample to the head (Gorilla chunks and rollups), plus
//!   the fixed cost of an open. Each iteration opens a fresh copy of the
//!   directory (the copy is not timed).
//!
//! Throughput is in samples; the bench prints the record bytes per batch, so
//! MB/s = samples/s x bytes per sample.

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

// Not every bench uses every helper.
#[allow(dead_code)]
mod fleet;

use std::fs::{self, File, OpenOptions};
use std::hint::black_box;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use storage::wal::record::{self, Record};
use storage::{BatchOrigin, SeriesRef, Storage, StorageConfig};

const SERIES: usize = 10_000;
/// Batches in the `decode` buffer and in the replayed WAL.
const BATCHES: usize = 100;
const T0: i64 = 1_775_000_000_000;
const PRODUCER: &str = "gpu-node-00007/0000019a3f2c1e00";
/// `StorageConfig`'s default `wal_segment_bytes`.
const SEGMENT_BYTES: u64 = 128 << 20;

/// One poll of every series: refs, timestamps (one per poll, as an agent
/// stamps it) and values.
struct Batch {
    refs: Vec<SeriesRef>,
    ts: Vec<i64>,
    vals: Vec<f64>,
}

fn batch(seqs: &[Vec<f64>], p: usize) -> Batch {
    Batch {
        refs: (0..SERIES as u32).map(SeriesRef).collect(),
        ts: vec![T0 + p as i64 * 1000; SERIES],
        vals: (0..SERIES).map(|i| fleet::value(seqs, i, p)).collect(),
    }
}

/// The records `Storage::append_from` writes for a batch, encoded the same way.
fn encode(b: &Batch, seq: u64) -> Vec<u8> {
    let wal_refs: Vec<u32> = b.refs.iter().map(|r| r.0).collect();
    let mut buf = Vec::with_capacity(b.refs.len() * 12 + 48);
    record::encode_samples(&mut buf, &wal_refs, &b.ts, &b.vals);
    record::encode_mark(&mut buf, PRODUCER, seq);
    buf
}

/// The writer thread's segment file handling under `SyncPolicy::Os`.
struct Segments<'a> {
    dir: &'a Path,
    n: u64,
    file: File,
    size: u64,
}

impl<'a> Segments<'a> {
    fn open(dir: &'a Path, n: u64) -> Self {
        let path = dir.join(format!("{n:016x}.wal"));
        let mut file = OpenOptions::new()
            .create_new(true)
            .write(true)
            .open(&path)
            .unwrap();
        // Header as the writer makes it (magic, version, CRC), synced with the dir.
        let mut header = b"GPLSWAL1".to_vec();
        header.extend_from_slice(&1u32.to_le_bytes());
        header.extend_from_slice(&crc32c::crc32c(&header).to_le_bytes());
        file.write_all(&header).unwrap();
        file.sync_all().unwrap();
        File::open(dir).unwrap().sync_all().unwrap();
        Self {
            dir,
            n,
            file,
            size: header.len() as u64,
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        if self.size + bytes.len() as u64 > SEGMENT_BYTES {
            let old = self.dir.join(format!("{:016x}.wal", self.n));
            *self = Self::open(self.dir, self.n + 1);
            // A flush would delete it later; here it only bounds the disk used.
            fs::remove_file(old).unwrap();
        }
        self.file.write_all(bytes).unwrap();
        self.size += bytes.len() as u64;
    }
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            fs::copy(e.path(), dst).unwrap();
        }
    }
}

fn bench(c: &mut Criterion) {
    let (seqs, source) = fleet::value_sequences();
    let batches: Vec<Batch> = (0..BATCHES).map(|p| batch(&seqs, p)).collect();
    let encoded: Vec<u8> = batches
        .iter()
        .enumerate()
        .flat_map(|(p, b)| encode(b, p as u64 + 1))
        .collect();
    let per_batch = encoded.len() / BATCHES;
    println!(
        "wal: {SERIES}-sample batches (values from {source}), {per_batch} record bytes per batch, {:.2} B/sample",
        per_batch as f64 / SERIES as f64
    );

    let mut g = c.benchmark_group("wal");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(4));

    g.throughput(Throughput::Elements(SERIES as u64));
    let mut seq = 0u64;
    g.bench_function("encode", |b| {
        b.iter(|| {
            seq += 1;
            black_box(encode(&batches[seq as usize % BATCHES], seq).len())
        })
    });

    let dir = tempfile::tempdir().unwrap();
    let mut segments = Segments::open(dir.path(), 1);
    g.bench_function("encode_write_os", |b| {
        b.iter(|| {
            seq += 1;
            let bytes = encode(&batches[seq as usize % BATCHES], seq);
            segments.write(&bytes);
        })
    });
    drop(segments);
    drop(dir);

    g.throughput(Throughput::Elements((SERIES * BATCHES) as u64));
    g.bench_function("decode", |b| {
        b.iter(|| {
            let (mut pos, mut samples) = (0, 0usize);
            while pos < encoded.len() {
                let (rec, len) = record::decode(&encoded[pos..]).unwrap();
                if let Record::Samples { values, .. } = rec {
                    samples += values.len();
                }
                pos += len;
            }
            assert_eq!(samples, SERIES * BATCHES);
            black_box(samples)
        })
    });

    // A data directory whose WAL holds the series records and BATCHES batches.
    let src = tempfile::tempdir().unwrap();
    {
        let st = Storage::open(StorageConfig::new(src.path())).unwrap();
        for i in 0..SERIES {
            assert_eq!(st.series_ref(fleet::key(i)).unwrap(), SeriesRef(i as u32));
        }
        for (p, b) in batches.iter().enumerate() {
            let origin = BatchOrigin {
                producer: PRODUCER,
                seq: p as u64 + 1,
            };
            let out = st
                .append_from(Some(origin), &b.refs, &b.ts, &b.vals)
                .unwrap();
            assert_eq!(out.accepted as usize, SERIES);
        }
    }
    let wal_bytes: u64 = fs::read_dir(src.path().join("wal"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    println!("wal: replaying {wal_bytes} WAL bytes ({BATCHES} batches)");
    g.bench_function("replay_open", |b| {
        b.iter_batched(
            || {
                let dst = tempfile::tempdir().unwrap();
                copy_dir(src.path(), dst.path());
                dst
            },
            |dst| {
                let st = Storage::open(StorageConfig::new(dst.path())).unwrap();
                let replayed = st
                    .metrics()
                    .wal_replayed_samples
                    .load(std::sync::atomic::Ordering::Relaxed);
                assert_eq!(replayed as usize, SERIES * BATCHES);
                // Dropped after the timing: closing syncs the new WAL segment.
                (st, dst)
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
