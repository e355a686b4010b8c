//! Shared by the storage benches: the fleet-shaped series keys and the
//! loader of the real DCGM recordings (with a synthetic fallback).

use std::collections::BTreeMap;
use std::path::Path;

use storage::{Label, SeriesKey};

/// Metrics per GPU in [`key`].
pub(crate) const METRICS: usize = 25;
/// GPUs per host in [`key`].
pub(crate) const GPUS: usize = 8;
/// Series per host in [`key`].
pub(crate) const PER_HOST: usize = METRICS * GPUS;

/// Series `i` of a fleet: dcgm-exporter label sets, 8 GPUs x 25 metrics per
/// host (the key shape of `append.rs`, 10 labels, about 223 bytes of label
/// strings).
pub(crate) fn key(i: usize) -> SeriesKey {
    let (host, gpu, metric) = (i / PER_HOST, (i / METRICS) % GPUS, i % METRICS);
    SeriesKey::new(
        metric_name(metric),
        vec![
            Label::new("gpu", gpu.to_string()),
            Label::new(
                "UUID",
                format!("GPU-{host:08x}-{gpu:04x}-4c22-9d1e-5a0f3b2c{gpu:04x}"),
            ),
            Label::new("pci_bus_id", format!("00000000:{:02X}:00.0", 0x18 + gpu)),
            Label::new("device", format!("nvidia{gpu}")),
            Label::new("modelName", "NVIDIA H100 80GB HBM3"),
            Label::new("Hostname", hostname(host)),
            Label::new("DCGM_FI_DRIVER_VERSION", "550.54.15"),
            Label::new("cluster", "prod-1"),
            Label::new("row", format!("row-{}", host / 40)),
            Label::new("rack", format!("rack-{}", host / 4)),
        ],
    )
    .expect("valid key")
}

pub(crate) fn metric_name(metric: usize) -> String {
    format!("DCGM_FI_DEV_METRIC_{metric:02}")
}

pub(crate) fn hostname(host: usize) -> String {
    format!("gpu-node-{host:05}")
}

/// Value sequences for fleet series: where the real recordings
/// (`shared/data/real`, read in place) are present, each (file, gpu, column)
/// of them in recording order (256 sequences of about 3,200 values, sampled
/// at 10 Hz); otherwise synthetic ones (constants, slow drift, counters,
/// noise). Returns the sequences and where they came from.
pub(crate) fn value_sequences() -> (Vec<Vec<f64>>, &'static str) {
    let values = |series: Vec<Series>| -> Vec<Vec<f64>> {
        series
            .into_iter()
            .map(|(_, v)| v)
            .filter(|v| !v.is_empty())
            .collect()
    };
    match real_series().map(values) {
        Some(s) if !s.is_empty() => (s, "shared/data/real"),
        _ => (values(synthetic_series()), "synthetic"),
    }
}

/// The values of series `i` at poll `p`: sequence `i % n`, started at an
/// offset that depends on the host, so hosts differ, cycling when it ends.
pub(crate) fn value(seqs: &[Vec<f64>], i: usize, p: usize) -> f64 {
    let host = i / PER_HOST;
    let s = &seqs[i % seqs.len()];
    s[(p + host * 131) % s.len()]
}

/// One series: timestamps and values.
pub(crate) type Series = (Vec<i64>, Vec<f64>);

/// Every (file, gpu, column) of the real recordings as one series.
pub(crate) fn real_series() -> Option<Vec<Series>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/real/atharvanihalani__gpu-telemetry-exploration");
    let mut out = Vec::new();
    for file in ["t13_node0_telemetry.csv", "b1_telemetry.csv"] {
        let text = std::fs::read_to_string(dir.join(file)).ok()?;
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next()?.split(',').collect();
        let metrics: Vec<usize> = (4..header.len()).collect();
        let mut by_key: BTreeMap<(String, usize), Series> = BTreeMap::new();
        for line in lines {
            let f: Vec<&str> = line.split(',').collect();
            let ts = (f[0].parse::<f64>().ok()? * 1000.0).round() as i64;
            for &m in metrics.iter().filter(|&&m| m < f.len()) {
                if let Ok(v) = f[m].parse::<f64>() {
                    let s = by_key.entry((f[2].to_string(), m)).or_default();
                    s.0.push(ts);
                    s.1.push(v);
                }
            }
        }
        out.extend(by_key.into_values());
    }
    Some(out)
}

/// Fallback: 128 series of 3000 samples at 100 ms with jitter; constants,
/// slow drift, counters and noise.
pub(crate) fn synthetic_series() -> Vec<Series> {
    let mut x: u64 = 42;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..128)
        .map(|i| {
            let mut t = 1_775_000_000_000i64;
            let mut acc = 0f64;
            (0..3000)
                .map(|k| {
                    t += 100 + (rnd() % 7) as i64 - 3;
                    let v = match i % 4 {
                        0 => 700.0,
                        1 => ((30.0 + k as f64 / 300.0) * 10.0).round() / 10.0,
                        2 => {
                            acc += (rnd() % 50_000) as f64;
                            acc
                        }
                        _ => (rnd() % 1_000_000) as f64 / 1e6,
                    };
                    (t, v)
                })
                .unzip()
        })
        .collect()
}

/// Every series cut into chunks of 4,096 samples and encoded as segment
/// columns: (timestamp block, value block, samples).
pub(crate) fn column_chunks(series: &[Series]) -> Vec<(Vec<u8>, Vec<u8>, usize)> {
    series
        .iter()
        .flat_map(|(t, v)| {
            t.chunks(4096).zip(v.chunks(4096)).map(|(t, v)| {
                let (mut tb, mut vb) = (Vec::new(), Vec::new());
                storage::column::encode_ts(t, &mut tb);
                storage::column::encode_segment_values(v, &mut vb);
                (tb, vb, t.len())
            })
        })
        .collect()
}
