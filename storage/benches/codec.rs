//! Codec throughput and size on the real DCGM recordings (`shared/data/real`,
//! read in place, never copied) or, where they are absent, on a synthetic grid.
//!
//!   cargo bench -p storage --bench codec
//!
//! Prints bytes per sample for each codec, then criterion's throughput in
//! samples per second (one core).

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use storage::column::{
    decode_ts, decode_values, encode_head_ts, encode_head_values, encode_segment_values, encode_ts,
};
use storage::gorilla::{GorillaDecoder, GorillaEncoder};

// The recordings' loader, shared with the wal and scan benches.
#[allow(dead_code)]
mod fleet;
use fleet::{real_series, synthetic_series};

fn bench(c: &mut Criterion) {
    let (series, source) = match real_series() {
        Some(s) => (s, "shared/data/real"),
        None => (synthetic_series(), "synthetic grid"),
    };
    let samples: usize = series.iter().map(|s| s.0.len()).sum();

    let gorilla: Vec<(Vec<u8>, u32)> = series
        .iter()
        .flat_map(|(t, v)| {
            t.chunks(240).zip(v.chunks(240)).map(|(t, v)| {
                let mut e = GorillaEncoder::new();
                t.iter().zip(v).for_each(|(&t, &v)| e.append(t, v));
                (e.bytes().to_vec(), e.count())
            })
        })
        .collect();
    let columns = fleet::column_chunks(&series);
    // What the head seals a full chunk into: 240 samples, its own
    // timestamps, no zstd.
    let head_columns: Vec<(Vec<u8>, Vec<u8>, usize)> = series
        .iter()
        .flat_map(|(t, v)| {
            t.chunks(240).zip(v.chunks(240)).map(|(t, v)| {
                let (mut tb, mut vb) = (Vec::new(), Vec::new());
                encode_head_ts(t, &mut tb);
                encode_head_values(v, &mut vb);
                (tb, vb, t.len())
            })
        })
        .collect();
    let h_bytes: usize = head_columns.iter().map(|c| c.0.len() + c.1.len()).sum();
    let g_bytes: usize = gorilla.iter().map(|c| c.0.len()).sum();
    let v_bytes: usize = columns.iter().map(|c| c.1.len()).sum();
    let t_bytes: usize = columns.iter().map(|c| c.0.len()).sum();
    let mut distinct_ts: Vec<&Vec<u8>> = columns.iter().map(|c| &c.0).collect();
    distinct_ts.sort();
    distinct_ts.dedup();
    let t_shared: usize = distinct_ts.iter().map(|b| b.len()).sum();
    println!(
        "codec sizes on {source}: {samples} samples in {} series",
        series.len()
    );
    println!(
        "  gorilla (240-sample chunks)      {:.3} B/sample",
        g_bytes as f64 / samples as f64
    );
    println!(
        "  head columns (240, own ts)       {:.3} B/sample (what the head seals)",
        h_bytes as f64 / samples as f64
    );
    println!(
        "  columns, values + own ts         {:.3} B/sample",
        (v_bytes + t_bytes) as f64 / samples as f64
    );
    println!(
        "  columns, values + shared ts      {:.3} B/sample (what a segment stores)",
        (v_bytes + t_shared) as f64 / samples as f64
    );
    // Which encoding each value block chose (docs/format/column.md kinds;
    // bit 7 is zstd).
    let mut kinds = std::collections::BTreeMap::<u8, (usize, usize)>::new();
    for (_, vb, n) in &columns {
        let k = kinds.entry(vb[0]).or_default();
        k.0 += vb.len();
        k.1 += n;
    }
    for (kind, (bytes, n)) in kinds {
        println!(
            "  value blocks of kind {kind:#04x}: {n} samples, {:.3} B/sample",
            bytes as f64 / n as f64
        );
    }

    let mut g = c.benchmark_group("codec");
    g.throughput(Throughput::Elements(samples as u64));
    g.sample_size(10);
    g.bench_function("gorilla_encode", |b| {
        b.iter(|| {
            for (t, v) in &series {
                let mut e = GorillaEncoder::new();
                t.iter().zip(v).for_each(|(&t, &v)| e.append(t, v));
                black_box(e.bytes().len());
            }
        })
    });
    g.bench_function("gorilla_decode_sum", |b| {
        b.iter(|| {
            let mut sum = 0.0;
            for (bytes, n) in &gorilla {
                for s in GorillaDecoder::new(bytes, *n) {
                    sum += s.unwrap().1;
                }
            }
            black_box(sum)
        })
    });
    type Encode = fn(&[i64], &[f64], &mut Vec<u8>, &mut Vec<u8>);
    let head: Encode = |t, v, tb, vb| {
        encode_head_ts(t, tb);
        encode_head_values(v, vb);
    };
    let segment: Encode = |t, v, tb, vb| {
        encode_ts(t, tb);
        encode_segment_values(v, vb);
    };
    for (name, chunk, encode, blocks) in [
        ("head_column", 240, head, &head_columns),
        ("column", 4096, segment, &columns),
    ] {
        g.bench_function(format!("{name}_encode"), |b| {
            let (mut tb, mut vb) = (Vec::new(), Vec::new());
            b.iter(|| {
                for (t, v) in &series {
                    for (t, v) in t.chunks(chunk).zip(v.chunks(chunk)) {
                        tb.clear();
                        vb.clear();
                        encode(t, v, &mut tb, &mut vb);
                    }
                }
                black_box(vb.len())
            })
        });
        g.bench_function(format!("{name}_decode_sum"), |b| {
            let (mut ts, mut vals) = (Vec::new(), Vec::new());
            b.iter(|| {
                let mut sum = 0.0;
                for (tb, vb, n) in blocks {
                    ts.clear();
                    vals.clear();
                    decode_ts(tb, *n, &mut ts).unwrap();
                    decode_values(vb, *n, &mut vals).unwrap();
                    sum += vals.iter().sum::<f64>();
                }
                black_box(sum)
            })
        });
    }
    // The chunks as a segment holds them: the series of a GPU's poll share
    // one timestamp block (the size printed above as "shared ts"), and a
    // scan thread decodes it once while consecutive chunks name it, keeping
    // the decoded copy (the per-thread reuse of `segment::TS_BLOCK`, keyed there
    // by the block's offset and here by its index).
    let mut shared: Vec<&[u8]> = Vec::new();
    let segment_chunks: Vec<(usize, &[u8], usize)> = columns
        .iter()
        .map(|(tb, vb, n)| {
            if shared.last() != Some(&tb.as_slice()) {
                shared.push(tb);
            }
            (shared.len() - 1, vb.as_slice(), *n)
        })
        .collect();
    println!(
        "  {} chunks name {} timestamp blocks as a segment stores them",
        segment_chunks.len(),
        shared.len()
    );
    g.bench_function("column_shared_ts_decode_sum", |b| {
        let (mut ts, mut vals) = (Vec::new(), Vec::new());
        b.iter(|| {
            let mut sum = 0.0;
            let mut decoded = usize::MAX;
            for &(t, vb, n) in &segment_chunks {
                if t != decoded {
                    ts.clear();
                    decode_ts(shared[t], n, &mut ts).unwrap();
                    decoded = t;
                }
                vals.clear();
                decode_values(vb, n, &mut vals).unwrap();
                sum += vals.iter().sum::<f64>();
            }
            black_box(sum)
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
