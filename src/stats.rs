//! `gpulse stats`: what a data directory holds and what it costs on disk.
//! Reads the segment files only (never writes), so it is safe next to a
//! running `serve`.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use storage::SeriesKey;
use storage::files::{self, SEGMENTS_DIR, WAL_DIR};
use storage::segment::Segment;

/// Figures of one tier (today only `raw`).
#[derive(Debug, Default, Clone)]
pub(crate) struct TierStats {
    pub(crate) segments: u64,
    pub(crate) series: u64,
    pub(crate) samples: u64,
    /// Timestamp and value blocks.
    pub(crate) chunk_bytes: u64,
    /// Value blocks alone (timestamp blocks are shared between series).
    pub(crate) value_bytes: u64,
    pub(crate) file_bytes: u64,
    /// metric -> (samples, value bytes)
    pub(crate) by_metric: BTreeMap<String, (u64, u64)>,
}

#[derive(Debug, Default, Clone)]
pub(crate) struct DirStats {
    pub(crate) raw: TierStats,
    pub(crate) wal_segments: u64,
    pub(crate) wal_bytes: u64,
    pub(crate) unreadable: Vec<String>,
}

pub(crate) fn collect(data_dir: &Path) -> anyhow::Result<DirStats> {
    let seg_dir = data_dir.join(SEGMENTS_DIR);
    let mut out = DirStats::default();
    let mut keys: HashSet<Arc<SeriesKey>> = HashSet::new();
    let entries =
        std::fs::read_dir(&seg_dir).with_context(|| format!("reading {}", seg_dir.display()))?;
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(id) = files::parse_segment_file_name(&name) else {
            continue;
        };
        let seg = match Segment::open(&entry.path(), id) {
            Ok(s) => s,
            Err(e) => {
                out.unreadable.push(e.to_string());
                continue;
            }
        };
        let t = &mut out.raw;
        t.segments += 1;
        t.samples += seg.num_samples();
        t.file_bytes += seg.size_bytes();
        t.chunk_bytes += seg.data_bytes();
        for ord in 0..seg.num_series() as u32 {
            let key = seg.series_key(ord);
            keys.insert(key.clone());
            let (n, b) = seg.chunks(ord).iter().fold((0u64, 0u64), |(n, b), c| {
                (n + c.count as u64, b + c.value_bytes() as u64)
            });
            t.value_bytes += b;
            let m = t.by_metric.entry(key.metric().to_string()).or_default();
            m.0 += n;
            m.1 += b;
        }
    }
    out.raw.series = keys.len() as u64;
    if let Ok(entries) = std::fs::read_dir(data_dir.join(WAL_DIR)) {
        for e in entries.flatten() {
            out.wal_segments += 1;
            out.wal_bytes += e.metadata().map(|m| m.len()).unwrap_or(0);
        }
    }
    Ok(out)
}

fn per_sample(bytes: u64, samples: u64) -> String {
    if samples == 0 {
        "-".into()
    } else {
        format!("{:.3}", bytes as f64 / samples as f64)
    }
}

/// Renders the report printed by `gpulse stats`.
pub(crate) fn render(data_dir: &Path, s: &DirStats, by_metric: bool) -> String {
    let t = &s.raw;
    let mut out = format!("data dir {}\n\n", data_dir.display());
    out += &format!(
        "{:<6} {:>9} {:>8} {:>14} {:>14} {:>14} {:>13} {:>13}\n",
        "tier",
        "segments",
        "series",
        "samples",
        "chunk bytes",
        "file bytes",
        "chunk B/smp",
        "total B/smp"
    );
    out += &format!(
        "{:<6} {:>9} {:>8} {:>14} {:>14} {:>14} {:>13} {:>13}\n",
        "raw",
        t.segments,
        t.series,
        t.samples,
        t.chunk_bytes,
        t.file_bytes,
        per_sample(t.chunk_bytes, t.samples),
        per_sample(t.file_bytes, t.samples)
    );
    out += &format!(
        "\nchunk bytes = timestamp blocks {} (shared by series polled together) + value blocks {};\n'total' adds headers, the series index, postings and footers.\n",
        t.chunk_bytes - t.value_bytes,
        t.value_bytes
    );
    out += &format!(
        "WAL: {} segments, {} bytes (replayed into memory at the next start, deleted by the next flush)\n",
        s.wal_segments, s.wal_bytes
    );
    if by_metric {
        out += &format!(
            "\n{:<44} {:>12} {:>12} {:>11}\n",
            "metric", "samples", "value bytes", "B/sample"
        );
        for (m, (n, b)) in &t.by_metric {
            out += &format!("{m:<44} {n:>12} {b:>12} {:>11}\n", per_sample(*b, *n));
        }
    }
    for u in &s.unreadable {
        out += &format!("unreadable segment: {u}\n");
    }
    out
}
