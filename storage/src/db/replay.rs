//! WAL replay at open: refills the head (and its rollups) from the WAL
//! segments that no segment file holds yet.

use std::collections::HashMap;
use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tracing::{error, info, warn};

use super::set_aside::{sample_line, write_set_aside};
use super::{OUT_OF_RANGE, Producers, StorageMetrics, segments_have_sample};
use crate::Result;
use crate::files::QUARANTINE_DIR;
use crate::head::{Appended, Head, SeriesRef};
use crate::segment::Segment;
use crate::series::{KeyArc, KeyHasher, SeriesKey};
use crate::wal::record::Record;
use crate::wal::{self, ReplayReport};

/// Replays the WAL into `head`, skipping the WAL segments that the segments
/// already contain. Series that also live in segments start with their last
/// flushed timestamp, so that a batch re-sent after a restart counts as a
/// duplicate rather than as new samples.
///
/// A sample before `raw_cut` is not replayed: appends refused it (see
/// [`crate::Storage::raw_cut`]), or it repeats raw data that retention may
/// have dropped since. No sample the head held is there: retention moves
/// the cut past the head's samples only after flushing them
/// ([`crate::Storage::move_raw_cut`]).
pub(super) fn replay_wal(
    data_dir: &Path,
    segments: &[Arc<Segment>],
    rollup_cut: u64,
    raw_cut: i64,
    head: &mut Head,
    producers: &Producers,
    metrics: &StorageMetrics,
) -> Result<ReplayReport> {
    let mut flushed_until: HashMap<KeyArc, i64, KeyHasher> = HashMap::default();
    for seg in segments {
        for ord in 0..seg.num_series() as u32 {
            if let Some(max) = seg.chunks(ord).iter().map(|c| c.max_ts).max() {
                let e = flushed_until
                    .entry(seg.series_key(ord).clone())
                    .or_insert(max);
                *e = (*e).max(max);
            }
        }
    }
    // WAL segments below the newest segment's cut are fully in segments: a
    // crash came between a flush and the WAL truncation. Skip them.
    let skip_below = segments.iter().map(|s| s.wal_cut()).max().unwrap_or(0);
    let mut refs: HashMap<u32, SeriesRef> = HashMap::new();
    // Definitions not yet used by a sample: a series is created at its first
    // sample, so one the WAL only defines (a checkpoint entry of a series
    // that has since gone idle, its samples all in segments) stays out of
    // the head and does not count against `max_series`.
    let mut defs: HashMap<u32, SeriesKey> = HashMap::new();
    let (mut replayed, mut orphans, mut refused, mut below_cut) = (0u64, 0u64, 0u64, 0u64);
    // Samples storage cannot hold, written by a version that let them in:
    // set aside rather than replayed, so that they cannot wedge every flush.
    let mut unstorable: Vec<String> = Vec::new();
    // WAL segments at or after `skip_below` but below `rollup_cut` are
    // counted in a rollup file already (a crash between a flush's rollup
    // file and its segment): they refill the head but not the rollups.
    let report = wal::replay(data_dir, skip_below, |n, rec| match rec {
        Record::Series { wal_ref, key } => {
            // A later definition of a ref replaces an earlier one.
            refs.remove(&wal_ref);
            defs.insert(wal_ref, key);
        }
        Record::SeriesBatch(series) => {
            for (wal_ref, key) in series {
                refs.remove(&wal_ref);
                defs.insert(wal_ref, key);
            }
        }
        Record::Samples {
            refs: rs,
            ts_ms,
            values,
        } => {
            for ((wr, t), v) in rs.iter().zip(ts_ms).zip(values) {
                if !refs.contains_key(wr)
                    && let Some(key) = defs.remove(wr)
                {
                    let until = flushed_until.get(&key).copied();
                    match head.get_or_create(key) {
                        Ok(r) => {
                            if let Some(t) = until {
                                head.raise_flushed(r, t);
                            }
                            refs.insert(*wr, r);
                        }
                        Err(_) => refused += 1,
                    }
                }
                match refs.get(wr) {
                    Some(&r) if !crate::ts_storable(t) => {
                        unstorable.push(sample_line(head.key(r), t, v));
                    }
                    Some(_) if t < raw_cut => below_cut += 1,
                    Some(&r) => {
                        let seen = |key: &SeriesKey, ts| segments_have_sample(segments, key, ts);
                        let stored = matches!(
                            head.append_with(r, t, v, n >= rollup_cut, seen),
                            Appended::InOrder | Appended::OutOfOrder
                        );
                        replayed += stored as u64;
                    }
                    None => orphans += 1,
                }
            }
        }
        Record::Mark { producer, seq } => producers.raise(&producer, seq),
    })?;
    if let Some(t) = &report.torn_tail {
        warn!(file = %t.path.display(), offset = t.offset, "truncated a torn WAL tail (a write cut short by a crash; it was never acknowledged)");
    }
    for c in &report.corruption {
        error!(file = %c.path.display(), offset = c.offset, problem = c.what, "corrupt WAL record; kept the records before it and went on with the next segment");
        let q = data_dir.join(QUARANTINE_DIR);
        let name = c
            .path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if fs::create_dir_all(&q)
            .and_then(|_| fs::copy(&c.path, q.join(format!("wal-{name}"))))
            .is_err()
        {
            warn!(file = %c.path.display(), "could not copy the corrupt WAL segment to quarantine/");
        }
    }
    if orphans > 0 || refused > 0 {
        error!(
            orphan_samples = orphans,
            refused_series = refused,
            "WAL samples without a usable series definition were not replayed"
        );
    }
    if !unstorable.is_empty() {
        let n = unstorable.len() as u64;
        metrics.samples_out_of_range.fetch_add(n, Relaxed);
        match write_set_aside(data_dir, u64::MAX, "WAL replay", OUT_OF_RANGE, &unstorable) {
            Ok(path) => {
                metrics.samples_set_aside.fetch_add(n, Relaxed);
                error!(file = %path.display(), samples = n, "WAL samples outside the storable range were set aside, not replayed");
            }
            Err(e) => {
                error!(error = %e, samples = n, "WAL samples outside the storable range were dropped: they could not be set aside");
            }
        }
    }
    if below_cut > 0 {
        info!(
            samples = below_cut,
            raw_cut_ms = raw_cut,
            "WAL samples before the raw cut were not replayed (appends refused them as too old)"
        );
    }
    metrics.wal_replayed_samples.fetch_add(replayed, Relaxed);
    metrics.wal_orphan_samples.fetch_add(orphans, Relaxed);
    Ok(report)
}
