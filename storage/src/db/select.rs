//! The read path: [`Storage::select`] for raw samples and
//! [`Storage::select_rollups`] for rollup records, each merging the files,
//! a flush in progress and the head.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tracing::error;

use super::{State, Storage, normalize};
use crate::Result;
use crate::error::Error;
use crate::gorilla::DecodeError;
use crate::head::{MemChunk, Newest};
use crate::rollup::{
    Query, RecordFields, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier,
    fold_minutes,
};
use crate::segment::{ChunkRef, Segment};
use crate::series::{KeepSeries, KeyArc, METRIC_NAME_LABEL, Matcher, SeriesKey};

/// A rollup group decoded from a file (its six strings and its records, in
/// a block whose other groups are decoded too) costs about as much as
/// reading eight raw samples: on the 1,000-GPU fleet of `benches/peers`,
/// 1.1 ms for a block of 4,096 groups against 0.5 ms for 14,400 samples
/// (`perf`, 2026-12-04).
pub(crate) const GROUP_READ_COST: usize = 8;

impl Storage {
    /// Every series matching all `matchers` with at least one chunk that
    /// overlaps `[min_ts, max_ts]`, sorted by key. Chunks are in time order.
    pub fn select(&self, matchers: &[Matcher], min_ts: i64, max_ts: i64) -> Vec<SelectedSeries> {
        self.select_where(matchers, min_ts, max_ts, &|_| true)
    }

    /// [`Self::select`] of the series `keep` accepts as well: tested before
    /// a series' chunks are gathered, so that a node reading a few of its
    /// shards for a cluster query does not gather the others.
    pub fn select_where(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        keep: KeepSeries<'_>,
    ) -> Vec<SelectedSeries> {
        let state = lock!(self.state.read());
        self.select_in(&state, (matchers, keep), min_ts, max_ts, true)
    }

    /// [`Self::select`] in a state its caller has locked; without the head
    /// and a flush in progress unless `memory`.
    pub(super) fn select_in(
        &self,
        state: &State,
        (matchers, keep): (&[Matcher], KeepSeries<'_>),
        min_ts: i64,
        max_ts: i64,
        memory: bool,
    ) -> Vec<SelectedSeries> {
        let overlaps = |lo: i64, hi: i64| lo <= max_ts && hi >= min_ts;
        // Each source's series in the order met: segments (their index is
        // sorted by key), a flush in progress, then the head. One stable sort
        // of the whole list, then equal keys merged, keeps every series'
        // chunks in source order; for a single segment the sort only checks
        // that the list is sorted, where a map of keys compared each key with
        // ten others (5 % of the instructions of a 1,000-series query, `callgrind`).
        let mut found: Vec<(KeyArc, Vec<ChunkSource>)> = Vec::new();
        for seg in &state.segments {
            let (lo, hi) = seg.time_range();
            if !overlaps(lo, hi) {
                continue;
            }
            for ord in seg.select(matchers) {
                if !keep(seg.series_key(ord)) {
                    continue;
                }
                let chunks: Vec<ChunkSource> = seg
                    .chunks(ord)
                    .iter()
                    .filter(|c| overlaps(c.min_ts, c.max_ts))
                    .map(|c| ChunkSource::Segment(seg.clone(), *c))
                    .collect();
                if !chunks.is_empty() {
                    found.push((seg.series_key(ord).clone(), chunks));
                }
            }
        }
        let mem =
            |found: &mut Vec<(KeyArc, Vec<ChunkSource>)>, key: &KeyArc, chunks: Vec<MemChunk>| {
                let chunks: Vec<ChunkSource> = chunks
                    .into_iter()
                    .filter(|c| overlaps(c.min_ts, c.max_ts))
                    .map(ChunkSource::Mem)
                    .collect();
                if !chunks.is_empty() {
                    found.push((key.clone(), chunks));
                }
            };
        if let Some(frozen) = state.frozen.as_ref().filter(|_| memory) {
            for (key, chunks) in frozen.iter() {
                if matchers.iter().all(|m| m.matches(key)) && keep(key) {
                    mem(&mut found, key, chunks.clone());
                }
            }
        }
        if memory {
            lock!(self.head.read()).for_each_series_where((matchers, keep), |key, chunks| {
                mem(&mut found, key, chunks)
            });
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out: Vec<SelectedSeries> = Vec::with_capacity(found.len());
        for (key, chunks) in found {
            match out.last_mut() {
                Some(last) if last.key == key => last.chunks.extend(chunks),
                _ => out.push(SelectedSeries { key, chunks }),
            }
        }
        out
    }

    /// The newest sample in `[min_ts, max_ts]` of every series matching all
    /// `matchers`, in no particular order: the last sample that
    /// [`Self::select`] and [`SelectedSeries::read_into`] would give, without
    /// merging every sample of every series to find it. For a live read
    /// (the range ends now) nothing in the head is decoded, the open chunk's
    /// last sample being at hand, and a chunk elsewhere is decoded only if
    /// it could hold a newer sample than those found. A chunk that does not
    /// decode is logged and counted (`chunk_read_errors`) and its series
    /// left out, as a merged read of it would fail.
    pub fn newest(&self, matchers: &[Matcher], min_ts: i64, max_ts: i64) -> Vec<(KeyArc, Newest)> {
        self.newest_where(matchers, min_ts, max_ts, &|_| true)
    }

    /// [`Self::newest`] of the series `keep` accepts as well, tested before
    /// a series is searched ([`Self::select_where`]).
    pub fn newest_where(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        keep: KeepSeries<'_>,
    ) -> Vec<(KeyArc, Newest)> {
        let range = (min_ts, max_ts);
        let overlaps = |lo: i64, hi: i64| lo <= max_ts && hi >= min_ts;
        // Each series met: its newest sample so far, and whether a chunk of
        // it failed to decode.
        let mut found: Vec<(KeyArc, Option<Newest>, bool)> = Vec::new();
        let count_failure = |key: &SeriesKey, e: &dyn std::fmt::Display| {
            error!(series = %key, error = %e, "chunk does not decode; the series is left out of the read");
            self.metrics.chunk_read_errors.fetch_add(1, Relaxed);
        };
        let (segments, frozen) = {
            let state = lock!(self.state.read());
            let n_segments = state.segments.len() as u32;
            let newest = |key: &KeyArc, n: std::result::Result<Newest, _>| match n {
                Ok(n) => found.push((key.clone(), Some(n), false)),
                Err(e) => {
                    count_failure(key, &e);
                    found.push((key.clone(), None, true));
                }
            };
            lock!(self.head.read()).for_each_newest(
                (matchers, keep),
                range,
                n_segments + 1,
                newest,
            );
            // Sources are numbered in read order: segments, then a flush in
            // progress, then the head.
            let segments: Vec<(u32, Arc<Segment>)> = (0..)
                .zip(&state.segments)
                .filter(|(_, s)| {
                    let (lo, hi) = s.time_range();
                    overlaps(lo, hi)
                })
                .map(|(i, s)| (i, s.clone()))
                .collect();
            (segments, state.frozen.clone().map(|f| (n_segments, f)))
        };
        if !segments.is_empty() || frozen.is_some() {
            // A series met in two sources is found by its key, hashed with
            // foldhash (SipHash of a key's dozen strings was a fifth of an
            // instant `sum` over 1,000 series). Where one segment is the
            // only source (the head holds nothing in range), its series are
            // distinct and need no lookup.
            let alone = found.is_empty() && frozen.is_none() && segments.len() == 1;
            let mut index: std::collections::HashMap<KeyArc, usize, foldhash::fast::RandomState> =
                if alone {
                    Default::default()
                } else {
                    found
                        .iter()
                        .enumerate()
                        .map(|(i, (k, ..))| (k.clone(), i))
                        .collect()
                };
            type Found = Vec<(KeyArc, Option<Newest>, bool)>;
            let mut entry = |found: &mut Found, key: &KeyArc| -> usize {
                if alone {
                    found.push((key.clone(), None, false));
                    return found.len() - 1;
                }
                *index.entry(key.clone()).or_insert_with(|| {
                    found.push((key.clone(), None, false));
                    found.len() - 1
                })
            };
            if let Some((source, frozen)) = &frozen {
                for (key, chunks) in frozen.iter() {
                    if !matchers.iter().all(|m| m.matches(key)) || !keep(key) {
                        continue;
                    }
                    let i = entry(&mut found, key);
                    let (_, best, failed) = &mut found[i];
                    if !*failed && let Err(e) = Newest::search_mem(best, chunks, *source, range) {
                        count_failure(key, &e);
                        *failed = true;
                    }
                }
            }
            let (mut ts, mut values) = (Vec::new(), Vec::new());
            for (source, seg) in &segments {
                for ord in seg.select(matchers) {
                    let key = seg.series_key(ord);
                    if !keep(key) {
                        continue;
                    }
                    let i = entry(&mut found, key);
                    let (_, best, failed) = &mut found[i];
                    if *failed {
                        continue;
                    }
                    let span = |c: &ChunkRef| (c.min_ts, c.max_ts);
                    let decode = |c: &ChunkRef, best: &mut Option<Newest>, at| {
                        // A chunk's samples ascend: where its newest one is in
                        // range and the file records its value, that is the
                        // chunk's answer, and nothing is decoded.
                        if let Some(value) = c.last_value()
                            && min_ts <= c.max_ts
                            && c.max_ts <= max_ts
                        {
                            let n = Newest {
                                ts_ms: c.max_ts,
                                value,
                                at,
                            };
                            Newest::offer(best, n);
                            return Ok(());
                        }
                        ts.clear();
                        values.clear();
                        seg.read_chunk(c, &mut ts, &mut values)?;
                        let samples = ts.iter().copied().zip(values.iter().copied());
                        Newest::offer_newest(best, samples, range, at);
                        Ok::<(), Error>(())
                    };
                    let searched =
                        Newest::search(best, seg.chunks(ord), *source, range, span, decode);
                    if let Err(e) = searched {
                        count_failure(key, &e);
                        *failed = true;
                    }
                }
            }
        }
        found
            .into_iter()
            .filter_map(|(key, best, failed)| Some((key, best.filter(|_| !failed)?)))
            .collect()
    }

    /// About how much work [`Self::select_rollups`] does for a filter on
    /// `metric` over an hour or day tier (not the gpu-level minutes, which
    /// also fold raw samples), in raw samples' worth, so that a caller that
    /// could read raw samples instead weighs it against their count: each
    /// group it decodes from the rollup files counts [`GROUP_READ_COST`],
    /// each sample of the metric it folds from memory (the head and a flush
    /// in progress, those the files do not count yet) one, and each record
    /// left from a flush that set some aside one.
    pub fn rollup_read_cost(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        metric: Option<&str>,
        min_ts: i64,
        max_ts: i64,
    ) -> usize {
        let by_metric: Vec<Matcher> = metric
            .map(|m| Matcher::equal(METRIC_NAME_LABEL, m))
            .into_iter()
            .collect();
        let state = lock!(self.state.read());
        let files: usize = state
            .rollups
            .iter()
            .map(|f| f.groups_read(tier, level, tier.window_start(min_ts), max_ts, metric))
            .sum();
        let set_aside: usize = state
            .frozen_rollup
            .as_ref()
            .map_or(0, |d| d.iter().map(|(_, r)| r.len()).sum());
        let frozen: usize = state.frozen.as_ref().map_or(0, |f| {
            f.iter()
                .filter(|(key, _)| by_metric.iter().all(|m| m.matches(key)))
                .flat_map(|(_, chunks)| chunks)
                .filter(|c| !c.rolled)
                .map(|c| c.count as usize)
                .sum()
        });
        let head = lock!(self.head.read()).unrolled_samples(&by_metric);
        files * GROUP_READ_COST + set_aside + frozen + head
    }

    /// Groups matching `filter` with their records whose window overlaps
    /// `[min_ts, max_ts]`; groups sorted, records in window order. Merges the
    /// rollup files, a flush in progress and the head, so it counts every
    /// stored sample exactly once. Gpu-level minutes of the samples after the
    /// raw cut ([`RollupFile::raw_cut`](crate::rollup::file::RollupFile::raw_cut))
    /// are folded from the raw samples, wherever they are. A file block that
    /// fails to decode is logged, counted (`rollup_read_errors`) and skipped;
    /// a raw chunk likewise (`chunk_read_errors`).
    pub fn select_rollups(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        filter: &RollupFilter,
        min_ts: i64,
        max_ts: i64,
    ) -> Vec<(RollupGroup, Vec<RollupRecord>)> {
        self.select_rollup_fields(tier, level, filter, (min_ts, max_ts), RecordFields::ALL)
    }

    /// As [`Self::select_rollups`], with the fields of `fields` only (see
    /// [`RecordFields`]): the rollup files' columns of the others are not
    /// decoded. Records from memory have every field.
    pub fn select_rollup_fields(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        filter: &RollupFilter,
        (min_ts, max_ts): (i64, i64),
        fields: RecordFields,
    ) -> Vec<(RollupGroup, Vec<RollupRecord>)> {
        let mut q = Query::new(tier, level, filter, min_ts, max_ts);
        if min_ts > max_ts {
            return Vec::new();
        }
        let state = lock!(self.state.read());
        let windows = (tier.window_start(min_ts), max_ts);
        for f in &state.rollups {
            let read = f.for_each_group(tier, level, windows, filter, fields, |g, records| {
                q.add_records(g, records)
            });
            if let Err(e) = read {
                error!(error = %e, "rollup file block does not decode; skipped");
                self.metrics.rollup_read_errors.fetch_add(1, Relaxed);
            }
        }
        // Memory's records of the windows before this are not in the files
        // yet; after it, only here for the gpu-level minutes.
        let mut memory_below = i64::MAX;
        if (tier, level) == (RollupTier::Minute, RollupLevel::Gpu) {
            let raw_cut = state.raw_cut();
            let from = tier.window_start(min_ts).max(raw_cut);
            let to = tier
                .window_start(max_ts)
                .saturating_add(tier.window_ms() - 1);
            self.fold_raw_minutes(&state, filter, from, to, true, |g, r| q.add_record(g, r));
            // Late samples before the raw cut: the next flush writes them.
            memory_below = raw_cut;
        }
        let below = |r: &&RollupRecord| r.window_start_ms < memory_below;
        if let Some(delta) = &state.frozen_rollup {
            for (g, minutes) in delta.iter() {
                q.add_minutes(g, minutes.iter().filter(below));
            }
        }
        // The windows the query reads, in its tier, and before the cut.
        let from = tier.window_start(min_ts);
        let to = tier
            .window_start(max_ts)
            .saturating_add(tier.window_ms() - 1)
            .min(memory_below.saturating_sub(1));
        if from <= to {
            self.for_each_unrolled(&state, (filter, level), (from, to), |g, minutes| {
                q.add_minutes(g, minutes.iter().filter(below))
            });
        }
        drop(state);
        q.finish()
    }

    /// Folds the raw samples in `[min_ts, max_ts]` of the series whose
    /// gpu-level group `filter` matches into gpu-level minute records, and
    /// passes each to `f` (a series' records in window order); those of the
    /// segments only unless `memory` (see [`Self::select_in`]). A chunk that
    /// does not decode is logged and counted (`chunk_read_errors`), and its
    /// series left out.
    pub(super) fn fold_raw_minutes(
        &self,
        state: &State,
        filter: &RollupFilter,
        min_ts: i64,
        max_ts: i64,
        memory: bool,
        mut f: impl FnMut(&RollupGroup, RollupRecord),
    ) {
        if min_ts > max_ts {
            return;
        }
        let by_metric: Vec<Matcher> = filter
            .metric
            .iter()
            .map(|m| Matcher::equal(METRIC_NAME_LABEL, m.as_str()))
            .collect();
        let (mut ts, mut vals) = (Vec::new(), Vec::new());
        for s in self.select_in(state, (&by_metric, &|_| true), min_ts, max_ts, memory) {
            let group = RollupGroup::of_series(&s.key);
            if !filter.matches(&group) {
                continue;
            }
            ts.clear();
            vals.clear();
            if let Err(e) = s.read_into(min_ts, max_ts, &mut ts, &mut vals) {
                error!(error = %e, series = %s.key, "raw chunk does not decode; its gpu-level minutes are left out");
                self.metrics.chunk_read_errors.fetch_add(1, Relaxed);
                continue;
            }
            fold_minutes(&ts, &vals, |r| f(&group, r));
        }
    }

    /// Calls `f` with the gpu-level group and 1-minute records of each series
    /// in memory (a flush in progress and the head) whose group, projected to
    /// `level`, `filter` matches, folded from its samples that the rollup files do not count
    /// yet (chunks not [`MemChunk::rolled`]) in the chunks that overlap
    /// `[min_ts, max_ts]`. The chunks are gathered under the locks and
    /// decoded after the head's is released. A chunk that does not decode is
    /// logged and counted (`chunk_read_errors`), and its series left out.
    fn for_each_unrolled(
        &self,
        state: &State,
        (filter, level): (&RollupFilter, RollupLevel),
        (min_ts, max_ts): (i64, i64),
        mut f: impl FnMut(&RollupGroup, &[RollupRecord]),
    ) {
        let by_metric: Vec<Matcher> = filter
            .metric
            .iter()
            .map(|m| Matcher::equal(METRIC_NAME_LABEL, m.as_str()))
            .collect();
        let mut found: Vec<(KeyArc, Vec<MemChunk>)> = Vec::new();
        let mut gather = |key: &KeyArc, chunks: &mut dyn Iterator<Item = MemChunk>| {
            let chunks: Vec<MemChunk> = chunks
                .filter(|c| !c.rolled && c.min_ts <= max_ts && c.max_ts >= min_ts)
                .collect();
            if !chunks.is_empty() {
                found.push((key.clone(), chunks));
            }
        };
        if let Some(frozen) = &state.frozen {
            for (key, chunks) in frozen.iter() {
                if by_metric.iter().all(|m| m.matches(key)) {
                    gather(key, &mut chunks.iter().cloned());
                }
            }
        }
        lock!(self.head.read()).for_each_series(&by_metric, |key, chunks| {
            gather(key, &mut chunks.into_iter())
        });
        let mut scratch = (Vec::new(), Vec::new());
        let mut minutes = Vec::new();
        for (key, chunks) in found {
            let group = RollupGroup::of_series(&key);
            if !filter.matches_at(&group, level) {
                continue;
            }
            minutes.clear();
            match unrolled_minutes(&chunks, &mut scratch, |r| minutes.push(r)) {
                Ok(()) => f(&group, &minutes),
                Err(e) => {
                    error!(error = %e, series = %key, "head chunk does not decode; its rollups are left out");
                    self.metrics.chunk_read_errors.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

/// Folds the samples of `chunks` not yet in the rollup files (those not
/// [`MemChunk::rolled`]) into gpu-level 1-minute records, passed to `f` in
/// window order. `scratch` holds the decoded samples.
pub(crate) fn unrolled_minutes(
    chunks: &[MemChunk],
    (ts, vals): &mut (Vec<i64>, Vec<f64>),
    f: impl FnMut(RollupRecord),
) -> std::result::Result<(), DecodeError> {
    ts.clear();
    vals.clear();
    for c in chunks.iter().filter(|c| !c.rolled) {
        c.decode_into(ts, vals)?;
    }
    if ts.is_empty() {
        return Ok(());
    }
    // Out-of-order chunks overlap the others in time (the head stores no
    // timestamp twice, so only the order needs fixing).
    normalize(ts, vals, 0);
    fold_minutes(ts, vals, f);
    Ok(())
}

#[derive(Debug, Clone)]
enum ChunkSource {
    Segment(Arc<Segment>, ChunkRef),
    Mem(MemChunk),
}

/// One series selected by [`Storage::select`]: its key and chunk handles. The
/// handles keep segments mapped while they live.
#[derive(Debug, Clone)]
pub struct SelectedSeries {
    pub key: KeyArc,
    chunks: Vec<ChunkSource>,
}

/// Appends the samples of a head chunk, or nothing if it does not decode.
fn decode_mem(
    m: &MemChunk,
    key: &SeriesKey,
    chunk: usize,
    ts_ms: &mut Vec<i64>,
    values: &mut Vec<f64>,
) -> Result<()> {
    let (at, vat) = (ts_ms.len(), values.len());
    m.decode_into(ts_ms, values).map_err(|source| {
        ts_ms.truncate(at);
        values.truncate(vat);
        Error::ChunkDecode {
            path: PathBuf::from("<head>"),
            series: key.to_string(),
            chunk,
            source,
        }
    })
}

/// Keeps, of the samples appended from `at` on, those in `[min_ts, max_ts]`.
fn trim_to_range(
    ts_ms: &mut Vec<i64>,
    values: &mut Vec<f64>,
    at: usize,
    (min_ts, max_ts): (i64, i64),
) {
    let (t_new, v_new) = (&ts_ms[at..], &values[at..]);
    if t_new.len() == v_new.len() && t_new.is_sorted() {
        let lo = at + t_new.partition_point(|&t| t < min_ts);
        let hi = (at + t_new.partition_point(|&t| t <= max_ts)).max(lo);
        ts_ms.truncate(hi);
        values.truncate(hi);
        ts_ms.drain(at..lo);
        values.drain(at..lo);
    } else {
        let mut kept = at;
        for j in at..ts_ms.len().min(values.len()) {
            let t = ts_ms[j];
            if t >= min_ts && t <= max_ts {
                ts_ms[kept] = t;
                values[kept] = values[j];
                kept += 1;
            }
        }
        ts_ms.truncate(kept);
        values.truncate(kept);
    }
}

impl SelectedSeries {
    /// Decodes the samples in `[min_ts, max_ts]` and appends them to `ts_ms`
    /// and `values` in time order, one sample per timestamp (the first write
    /// wins where out-of-order writes overlapped).
    ///
    /// # Errors
    /// [`Error::Corrupt`] or [`Error::ChunkDecode`] if a chunk fails its
    /// checksum or does not decode; nothing is appended for that chunk onward.
    pub fn read_into(
        &self,
        min_ts: i64,
        max_ts: i64,
        ts_ms: &mut Vec<i64>,
        values: &mut Vec<f64>,
    ) -> Result<()> {
        let start = ts_ms.len();
        for (i, c) in self.chunks.iter().enumerate() {
            match c {
                ChunkSource::Segment(seg, r) if r.min_ts >= min_ts && r.max_ts <= max_ts => {
                    seg.read_chunk(r, ts_ms, values)?;
                }
                ChunkSource::Mem(m) if m.min_ts >= min_ts && m.max_ts <= max_ts => {
                    decode_mem(m, &self.key, i, ts_ms, values)?;
                }
                c => {
                    // A chunk that the range cuts is decoded in place and
                    // trimmed: a cut at the end (a query up to now) costs
                    // a truncation, one at the start a move of the rest.
                    let at = ts_ms.len();
                    match c {
                        ChunkSource::Segment(seg, r) => seg.read_chunk(r, ts_ms, values)?,
                        ChunkSource::Mem(m) => decode_mem(m, &self.key, i, ts_ms, values)?,
                    }
                    trim_to_range(ts_ms, values, at, (min_ts, max_ts));
                }
            }
        }
        normalize(ts_ms, values, start);
        Ok(())
    }

    /// The oldest timestamp of the selected chunks, if any.
    pub(crate) fn min_ts(&self) -> Option<i64> {
        self.chunks
            .iter()
            .map(|c| match c {
                ChunkSource::Segment(_, r) => r.min_ts,
                ChunkSource::Mem(m) => m.min_ts,
            })
            .min()
    }

    /// Upper bound of the samples in the selected chunks.
    pub fn max_samples(&self) -> usize {
        self.chunks
            .iter()
            .map(|c| match c {
                ChunkSource::Segment(_, r) => r.count as usize,
                ChunkSource::Mem(m) => m.count as usize,
            })
            .sum()
    }
}
