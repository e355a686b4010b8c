//! `gpulse stats`: what a data directory holds and what it costs on disk.
//! Reads the segment and rollup files only (never writes), so it is safe
//! next to a running `serve`.

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use anyhow::Context;
use storage::KeyArc;
use storage::files::{self, ROLLUPS_DIR, SEGMENTS_DIR, WAL_DIR};
use storage::segment::Segment;
use storage::{RollupFile, RollupLevel, RollupTier};

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
    pub(crate) rollup_files: u64,
    pub(crate) rollup_bytes: u64,
    /// Rollup records per tier (1 min, 1 h, 1 d) and level (gpu .. cluster),
    /// as stored: records of one window in several files count once each.
    pub(crate) rollup_records: [[u64; 5]; 3],
    /// The largest raw cut of the rollup files (`RollupFile::raw_cut`).
    pub(crate) raw_cut: i64,
    /// Every file under the data directory, whatever it is.
    pub(crate) dir_bytes: u64,
    pub(crate) unreadable: Vec<String>,
}

/// Bytes of every file under `dir`, recursively (symbolic links not followed).
fn dir_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

pub(crate) fn collect(data_dir: &Path) -> anyhow::Result<DirStats> {
    let seg_dir = data_dir.join(SEGMENTS_DIR);
    let mut out = DirStats {
        raw_cut: i64::MIN,
        ..DirStats::default()
    };
    let mut keys: HashSet<KeyArc> = HashSet::new();
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
    if let Ok(entries) = std::fs::read_dir(data_dir.join(ROLLUPS_DIR)) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(id) = files::parse_rollup_file_name(&name) else {
                continue;
            };
            let f = match RollupFile::open(&e.path(), id) {
                Ok(f) => f,
                Err(e) => {
                    out.unreadable.push(e.to_string());
                    continue;
                }
            };
            out.rollup_files += 1;
            out.rollup_bytes += f.size_bytes();
            out.raw_cut = out.raw_cut.max(f.raw_cut());
            for tier in RollupTier::ALL {
                for level in RollupLevel::ALL {
                    let n = &mut out.rollup_records[tier as usize][level as usize];
                    if let Err(e) = f.for_each(tier, level, i64::MIN, i64::MAX, |_, _| *n += 1) {
                        out.unreadable.push(e.to_string());
                    }
                }
            }
        }
    }
    out.dir_bytes = dir_bytes(data_dir);
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
    let records: u64 = s.rollup_records.iter().flatten().sum();
    out += &format!(
        "rollups: {} files, {} bytes, {} records ({} B/record); per tier (gpu, host, rack, row, cluster):\n",
        s.rollup_files,
        s.rollup_bytes,
        records,
        per_sample(s.rollup_bytes, records)
    );
    for tier in RollupTier::ALL {
        let n = s.rollup_records[tier as usize].map(|n| n.to_string());
        out += &format!("  {:<3} {}\n", tier.label(), n.join(", "));
    }
    let cut = match s.raw_cut {
        i64::MIN => "from every raw sample".to_owned(),
        t => {
            let at = u64::try_from(t)
                .ok()
                .and_then(|ms| {
                    std::time::UNIX_EPOCH.checked_add(std::time::Duration::from_millis(ms))
                })
                .map_or_else(
                    || format!("{t} ms"),
                    |at| humantime::format_rfc3339_seconds(at).to_string(),
                );
            format!("from the raw samples since the raw cut, {at}")
        }
    };
    out += &format!(
        "  (gpu-level 1m records are not stored while raw data holds them: queries fold them {cut})\n"
    );
    out += &format!(
        "everything in the data directory: {} bytes, {} B per raw sample stored\n",
        s.dir_bytes,
        per_sample(s.dir_bytes, t.samples)
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
        out += &format!("unreadable: {u}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use storage::{Label, SeriesKey, Storage, StorageConfig};

    use super::*;

    /// Two GPUs' series, three minutes at 10 s, flushed: the report counts
    /// what the directory holds, checked against the directory itself.
    #[test]
    fn stats_count_the_rollups_and_the_whole_directory() {
        let dir = tempfile::tempdir().unwrap();
        let st = Storage::open(StorageConfig::new(dir.path())).unwrap();
        let key = |gpu: &str| {
            let labels = vec![Label::new("Hostname", "h0"), Label::new("gpu", gpu)];
            SeriesKey::new("DCGM_FI_DEV_GPU_TEMP", labels).unwrap()
        };
        let refs = st.series_refs(vec![key("0"), key("1")]).unwrap();
        let t0 = 1_700_000_040_000i64; // a whole minute
        for i in 0..18i64 {
            let ts = t0 + i * 10_000;
            st.append(&refs, &[ts, ts], &[40.0 + i as f64, 50.0])
                .unwrap();
        }
        st.flush().unwrap();
        drop(st);
        let s = collect(dir.path()).unwrap();
        assert_eq!((s.raw.samples, s.raw.series), (36, 2));
        // 18 samples of each GPU at 10 s from a whole minute: 3 minutes,
        // within one hour and one day.
        let (minute, hour, day) = (0, 1, 2);
        let (gpu, host) = (0, 1);
        // The gpu-level minutes are folded from the raw data it holds.
        assert_eq!(s.rollup_records[minute][gpu], 0);
        assert_eq!(s.rollup_records[minute][host], 3);
        assert_eq!(s.rollup_records[hour][gpu], 2);
        assert_eq!(s.rollup_records[day][host], 1);
        let on_disk = |sub: &str| -> (u64, u64) {
            std::fs::read_dir(dir.path().join(sub)).map_or((0, 0), |d| {
                d.flatten()
                    .map(|e| (1, e.metadata().unwrap().len()))
                    .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
            })
        };
        assert_eq!((s.rollup_files, s.rollup_bytes), on_disk("rollups"));
        let total: u64 = ["segments", "rollups", "wal", "health", "quarantine"]
            .iter()
            .map(|d| on_disk(d).1)
            .sum::<u64>()
            + std::fs::read_dir(dir.path())
                .unwrap()
                .flatten()
                .filter(|e| e.file_type().unwrap().is_file())
                .map(|e| e.metadata().unwrap().len())
                .sum::<u64>();
        assert_eq!(s.dir_bytes, total);
        let report = render(dir.path(), &s, false);
        assert!(report.contains("rollups: 1 files"), "{report}");
        assert!(report.contains(&format!("everything in the data directory: {total} bytes")));
    }
}
