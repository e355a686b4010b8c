//! Flushing: [`Storage::flush`] seals the head (and its rollups) into a new
//! segment (and rollup file), then cuts the WAL.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use tracing::{debug, error, info, warn};

use super::select::unrolled_minutes;
use super::{Storage, normalize};
use crate::error::Error;
use crate::files;
use crate::gorilla::DecodeError;
use crate::head::{FrozenSeries, MemChunk};
use crate::rollup::{DeltaTables, GroupRef, RollupDelta, RollupGroup, RollupRecord};
use crate::segment::Segment;
use crate::segment::writer::{
    Ahead, AheadHelper, EncodedSeries, SegmentSummary, publish, write_segment_tmp_with,
};
use crate::series::{KeyArc, SeriesKey};
use crate::{Result, SegmentId};

impl Storage {
    /// Seals everything in the head into a new segment. Returns `None` if the
    /// head was empty. One flush runs at a time; appends and queries go on
    /// while it writes.
    ///
    /// # Errors
    /// I/O errors: the frozen data then stays visible to queries and the next
    /// flush retries it. Data that a writer refuses ([`Error::Unwritable`],
    /// or a file that fails to open right after it was written) is set aside
    /// instead: the offending samples or rollup records (all of the frozen
    /// ones if they cannot be told apart) go to a `quarantine/set-aside-*.txt`
    /// file, the rest stays for the next flush, and the error is returned.
    /// Every failure is counted (`flush_failures`) and logged once per cause.
    pub fn flush(&self) -> Result<Option<SegmentSummary>> {
        let _upkeep = lock!(self.flush_lock.lock());
        let flushed = self.flush_locked();
        if matches!(flushed, Ok(Some(_))) {
            crate::malloc::release_free_memory();
        }
        flushed
    }

    /// [`Self::flush`], for a caller that holds the upkeep lock.
    pub(super) fn flush_locked(&self) -> Result<Option<SegmentSummary>> {
        let result = self.flush_inner();
        let mut last = lock!(self.flush_error.lock());
        match &result {
            Ok(_) => {
                if let Some(cause) = last.take() {
                    info!(previous_error = %cause, "flush succeeded after failing");
                }
            }
            Err(e) => {
                self.metrics.flush_failures.fetch_add(1, Relaxed);
                let cause = failure_cause(e);
                if last.as_deref() == Some(cause.as_str()) {
                    debug!(error = %e, "flush failed again, as before");
                } else {
                    error!(error = %e, "flush failed; the next flush retries (I/O) or the data was set aside in quarantine/ (data that cannot be written); counted in flush_failures");
                    *last = Some(cause);
                }
            }
        }
        result
    }

    fn flush_inner(&self) -> Result<Option<SegmentSummary>> {
        let (frozen, cut) = {
            let _gate = lock!(self.gate.write());
            let mut state = lock!(self.state.write());
            let mut carried = state
                .frozen
                .take()
                .map(|f| (*f).clone())
                .unwrap_or_default();
            let mut head = lock!(self.head.write());
            let mut fresh = head.freeze();
            // Appends after this one fill an empty head: the next full one
            // asks again.
            self.full_signalled.store(false, Relaxed);
            // Idle series leave before the checkpoint, so the next WAL
            // generation does not define them.
            let evicted = head.evict_idle(Instant::now(), self.config.series_idle) as u64;
            self.metrics.series_evicted.fetch_add(evicted, Relaxed);
            let mut checkpoint = Vec::new();
            head.checkpoint(&mut checkpoint);
            drop(head);
            self.producers.checkpoint(&mut checkpoint);
            if carried.is_empty() {
                carried = fresh;
            } else if !fresh.is_empty() {
                merge_frozen(&mut carried, &mut fresh);
            }
            if carried.is_empty() {
                // Nothing for a segment; records left over from a flush that
                // set some aside wait for the next one that has samples.
                return Ok(None);
            }
            let frozen = Arc::new(carried);
            state.frozen = Some(frozen.clone());
            // Samples from here on go to WAL segments at or after `cut`.
            let cut = self
                .wal
                .cut(checkpoint)
                .map_err(|e| Error::io(self.wal_dir(), e))?;
            (frozen, cut)
        };

        let started = Instant::now();
        let id = SegmentId(self.next_segment.fetch_add(1, Relaxed));
        let tmp = files::segment_tmp_path(&self.config.data_dir, id);
        let dst = files::segment_path(&self.config.data_dir, id);
        // Rollups first: a crash before the segment is durable leaves the WAL
        // in place, and replay then refills the head but not the rollups (the
        // WAL below this file's cut is counted in it). Meanwhile a second
        // thread writes the segment's bytes to its temporary file, which is
        // no segment until its rename below, after the rollups are durable.
        let (left_over, raw_cut) = {
            let state = lock!(self.state.read());
            (state.frozen_rollup.clone(), state.raw_cut())
        };
        // The segment is opened and validated on that thread too, before
        // its rename: a segment that does not open is never published.
        let write_tmp = |ahead: Option<&Ahead>| -> Result<(SegmentSummary, Segment)> {
            let summary = write_frozen(&tmp, &dst, (id.0, id.0), cut, &frozen, ahead)?;
            Ok((summary, self.open_segment_tmp(&tmp, &dst, id)?))
        };
        let ahead = Ahead::new(frozen.len());
        let (rollups, encoded) = std::thread::scope(|scope| {
            let (write_tmp, ahead) = (&write_tmp, &ahead);
            let helper = AheadHelper(ahead);
            let segment = std::thread::Builder::new()
                .name("gpulse-flush-segment".into())
                .spawn_scoped(scope, move || write_tmp(Some(ahead)));
            // The head's rollups are folded here, from the frozen chunks
            // they do not count yet, while the segment is written. The
            // gpu-level minutes of samples after the raw cut are folded from
            // the segment when read; those before it (late samples) are
            // written (see `RollupFile::raw_cut`).
            let tables = self.frozen_tables(&frozen, left_over.as_deref(), raw_cut);
            // The segment's series take longer than the folding: this thread
            // then encodes the last of them until the writer catches up, and
            // writes the rollup file while the writer finishes and checks
            // the segment's file.
            if segment.is_ok() {
                encode_ahead(&frozen, ahead);
            }
            drop(helper);
            let rollups = (!tables.is_empty())
                .then(|| self.write_rollups(cut, raw_cut, &tables.finish(), None));
            let encoded = match segment {
                Ok(handle) => handle
                    .join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
                // No second thread to be had: write it here, after.
                Err(_) => write_tmp(None),
            };
            (rollups, encoded)
        });
        // From here on the frozen chunks (in the state, for queries, and
        // kept for the next flush if this one fails) are counted in the
        // rollup files or in the records left over: they are `rolled`.
        let mut frozen = frozen;
        if let Some(rollups) = rollups {
            if rollups.is_err() {
                let _ = fs::remove_file(&tmp);
            }
            match rollups {
                Ok(file) => {
                    let mut state = lock!(self.state.write());
                    state.rollups.push(Arc::new(file));
                    state.frozen_rollup = None;
                    frozen = mark_rolled(&frozen);
                    state.frozen = Some(frozen.clone());
                }
                Err(e) if e.is_retryable() => return Err(e),
                Err(e) => {
                    // The records one at a time, to find those refused.
                    let delta = self.frozen_minutes(&frozen, left_over.as_deref());
                    let keep = self.set_aside_rollups(&delta, &e)?;
                    {
                        let mut state = lock!(self.state.write());
                        state.frozen_rollup = (!keep.is_empty()).then(|| Arc::new(keep));
                        frozen = mark_rolled(&frozen);
                        state.frozen = Some(frozen.clone());
                    }
                    // The raw samples behind refused records would fail the
                    // segment next: set aside those a segment cannot hold now,
                    // so that the next flush writes the rest.
                    if self.set_aside_samples(&frozen, &e, false)?
                        && lock!(self.state.read()).frozen_rollup.is_none()
                    {
                        self.truncate_wal(cut);
                    }
                    return Err(e);
                }
            }
        }
        let written = encoded.and_then(|(s, segment)| {
            publish(&tmp, &dst)?;
            Ok((s, segment))
        });
        let (summary, segment) = match written {
            Ok(w) => w,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                if !e.is_retryable() && self.set_aside_samples(&frozen, &e, true)? {
                    // Nothing of this flush is left to write: the WAL before
                    // the cut is in segments, rollup files or quarantine/.
                    self.truncate_wal(cut);
                }
                return Err(e);
            }
        };
        let mut state = lock!(self.state.write());
        state.segments.push(Arc::new(segment));
        state.frozen = None;
        drop(state);
        // The segment is durable: the WAL before the cut is no longer needed.
        self.truncate_wal(cut);
        self.metrics.flushes.fetch_add(1, Relaxed);
        info!(
            segment = %dst.display(),
            series = summary.series,
            samples = summary.samples,
            bytes = summary.bytes,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "flushed head to segment"
        );
        Ok(Some(summary))
    }

    /// A flush's rollup tables: of the gpu-level 1-minute records folded
    /// from the frozen chunks that the rollup files do not count yet, and of
    /// the records left over from a flush that set some aside; folded and
    /// merged one series at a time ([`DeltaTables`]). A chunk that does not
    /// decode is logged and counted (`chunk_read_errors`), and its series'
    /// records left out (the segment writer then refuses it too).
    fn frozen_tables(
        &self,
        frozen: &[FrozenSeries],
        left_over: Option<&RollupDelta>,
        gpu_minutes_below: i64,
    ) -> DeltaTables {
        let mut tables = DeltaTables::new(gpu_minutes_below);
        for (group, minutes) in left_over.into_iter().flatten() {
            tables.add((**group).as_ref(), minutes);
        }
        let folded = each_frozen_minutes(frozen, |key, minutes| {
            tables.add(GroupRef::of_series(key), minutes);
        });
        for (key, e) in folded.err().into_iter().flatten() {
            error!(error = %e, series = %key, "head chunk does not decode; its rollups are left out");
            self.metrics.chunk_read_errors.fetch_add(1, Relaxed);
        }
        tables
    }

    /// The records [`Self::frozen_tables`] merges, series by series, for a
    /// flush whose rollup file was refused: what it sets aside and keeps. A
    /// chunk that does not decode is left out (counted by the flush's
    /// `frozen_tables` already).
    fn frozen_minutes(
        &self,
        frozen: &[FrozenSeries],
        left_over: Option<&RollupDelta>,
    ) -> RollupDelta {
        let mut delta: RollupDelta = left_over.cloned().unwrap_or_default();
        let _ = each_frozen_minutes(frozen, |key, minutes| {
            delta.push((Arc::new(RollupGroup::of_series(key)), minutes.to_vec()));
        });
        delta
    }

    fn truncate_wal(&self, cut: u64) {
        if let Err(e) = self.wal.truncate(cut) {
            warn!(error = %e, "could not delete old WAL segments; replay skips them, since they lie below this segment's WAL cut");
        }
    }
}

/// Calls `f` with each frozen series that has samples the rollup files do
/// not count yet, and their gpu-level 1-minute records (window order).
/// Series whose chunks do not decode are skipped, and returned with their
/// error.
fn each_frozen_minutes(
    frozen: &[FrozenSeries],
    mut f: impl FnMut(&SeriesKey, &[RollupRecord]),
) -> std::result::Result<(), Vec<(&SeriesKey, DecodeError)>> {
    let mut failed = Vec::new();
    let mut scratch = (Vec::new(), Vec::new());
    let mut minutes = Vec::new();
    for (key, chunks) in frozen {
        minutes.clear();
        match unrolled_minutes(chunks, &mut scratch, |r| minutes.push(r)) {
            Ok(()) if minutes.is_empty() => {}
            Ok(()) => f(key, &minutes),
            Err(e) => failed.push((&**key, e)),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed)
    }
}

/// What makes two flush failures "the same" for the log: the kind of I/O
/// error (paths change with every retry's file id), or the writer's reason.
fn failure_cause(e: &Error) -> String {
    match e {
        Error::Io { source, .. } => format!("I/O: {:?}", source.kind()),
        Error::Unwritable { what, .. } => format!("unwritable: {what}"),
        Error::Corrupt { kind, .. } => format!("corrupt: {kind}"),
        e => e.to_string(),
    }
}

/// `frozen` with every chunk marked [`MemChunk::rolled`].
fn mark_rolled(frozen: &[FrozenSeries]) -> Arc<Vec<FrozenSeries>> {
    let marked = frozen.iter().map(|(key, chunks)| {
        let chunks = chunks.iter().map(|c| MemChunk {
            rolled: true,
            ..c.clone()
        });
        (key.clone(), chunks.collect())
    });
    Arc::new(marked.collect())
}

/// Appends `fresh` (newer) chunks to `carried` (older, from a failed flush),
/// keeping the result sorted by key.
fn merge_frozen(carried: &mut Vec<FrozenSeries>, fresh: &mut Vec<FrozenSeries>) {
    let mut map: std::collections::BTreeMap<KeyArc, Vec<MemChunk>> = carried.drain(..).collect();
    for (k, chunks) in fresh.drain(..) {
        map.entry(k).or_default().extend(chunks);
    }
    carried.extend(map);
}

/// Writes frozen head chunks to a segment's temporary file (see
/// [`write_segment_tmp_with`]); [`publish`] makes it the segment `dst`.
/// Series that `ahead`'s helper encoded ([`encode_ahead`]) are taken from
/// it.
fn write_frozen(
    tmp: &Path,
    dst: &Path,
    seq: (u64, u64),
    wal_cut: u64,
    frozen: &[FrozenSeries],
    ahead: Option<&Ahead>,
) -> Result<SegmentSummary> {
    let keys: Vec<KeyArc> = frozen.iter().map(|(k, _)| k.clone()).collect();
    let written = write_segment_tmp_with(tmp, dst, seq, wal_cut, &keys, |i, ts, vals| {
        if let Some(encoded) = ahead.and_then(|a| a.take(i)) {
            return Ok(Some(encoded));
        }
        let (key, chunks) = &frozen[i];
        decode_series(chunks, ts, vals).map_err(|(chunk, source)| Error::ChunkDecode {
            path: PathBuf::from("<head>"),
            series: key.to_string(),
            chunk,
            source,
        })?;
        Ok(None)
    });
    // Failed early, it leaves the helper nothing to encode.
    if let Some(ahead) = ahead {
        ahead.writer_done();
    }
    written
}

/// Encodes batches of the last series of `frozen` for [`write_frozen`],
/// from the end, while its writer is far enough behind ([`Ahead`]). A
/// series that does not decode or would be refused is left to the writer,
/// which reports it.
fn encode_ahead(frozen: &[FrozenSeries], ahead: &Ahead) {
    // About a millisecond of encoding: the writer seldom waits for one.
    const BATCH: usize = 32;
    let mut shared = HashSet::default();
    let (mut ts, mut vals) = (Vec::new(), Vec::new());
    while let Some(claimed) = ahead.claim(BATCH) {
        let start = claimed.start;
        let batch = frozen[claimed].iter().map(|(_, chunks)| {
            ts.clear();
            vals.clear();
            decode_series(chunks, &mut ts, &mut vals).ok()?;
            EncodedSeries::encode(&ts, &vals, &mut shared)
        });
        ahead.deliver(start, batch.collect());
    }
}

/// Appends the samples of every chunk of a series, in time order; on an
/// error, the chunk that did not decode.
fn decode_series(
    chunks: &[MemChunk],
    ts: &mut Vec<i64>,
    vals: &mut Vec<f64>,
) -> std::result::Result<(), (usize, DecodeError)> {
    for (i, c) in chunks.iter().enumerate() {
        c.decode_into(ts, vals).map_err(|e| (i, e))?;
    }
    normalize(ts, vals, 0);
    Ok(())
}
