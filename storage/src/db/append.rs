//! The write path: [`Storage::series_ref`] and [`Storage::append`].

use std::sync::RwLockReadGuard;
use std::sync::atomic::Ordering::Relaxed;

use super::{AppendOutcome, BatchOrigin, OUT_OF_RANGE, State, Storage};
use crate::Result;
use crate::error::Error;
use crate::head::{Appended, SeriesRef};
use crate::series::{KeyArc, SeriesKey};
#[cfg(doc)]
use crate::wal::SyncPolicy;
use crate::wal::record;

impl Storage {
    /// Returns the head handle of a series, creating the series if needed.
    ///
    /// # Errors
    /// [`Error::SeriesLimit`] when the head is full.
    pub fn series_ref(&self, key: SeriesKey) -> Result<SeriesRef> {
        Ok(self.series_refs(vec![key])?[0])
    }

    /// [`Self::series_ref`] for many keys at once: one head lock and one WAL
    /// write for all the series that are new, instead of one each (an agent's
    /// first batch defines hundreds).
    ///
    /// # Errors
    /// [`Error::SeriesLimit`] when the head is full (the series created before
    /// it are kept and logged), or the WAL write failed.
    pub fn series_refs(&self, keys: Vec<SeriesKey>) -> Result<Vec<SeriesRef>> {
        let refs = self.series_refs_with_keys(keys)?;
        Ok(refs.into_iter().map(|(r, _)| r).collect())
    }

    /// [`Self::series_refs`], each with the head's own copy of its key: a
    /// caller that keeps the keys (an ingest stream, to resolve a series
    /// again after it left the head) shares them with the head instead of
    /// holding a second copy of every label string.
    ///
    /// # Errors
    /// As [`Self::series_refs`].
    pub fn series_refs_with_keys(&self, keys: Vec<SeriesKey>) -> Result<Vec<(SeriesRef, KeyArc)>> {
        let mut out: Vec<Option<(SeriesRef, KeyArc)>> = {
            let head = lock!(self.head.read());
            keys.iter()
                .map(|k| {
                    let r = head.lookup(k).filter(|&r| head.is_logged(r))?;
                    Some((r, head.key_arc(r).clone()))
                })
                .collect()
        };
        if out.iter().all(Option::is_some) {
            return Ok(out.into_iter().flatten().collect());
        }
        let _gate = lock!(self.gate.read());
        // A series new to the head may have been in it before (evicted when
        // idle): its newest flushed timestamp restores the order check, as
        // replay does, so a re-sent sample is still a duplicate.
        let flushed: Vec<Option<i64>> = {
            let state = lock!(self.state.read());
            keys.iter()
                .zip(&out)
                .map(|(k, slot)| slot.is_none().then(|| state.newest_flushed(k)).flatten())
                .collect()
        };
        let mut head = lock!(self.head.write());
        let (mut buf, mut logged_now, mut failed) = (Vec::new(), Vec::new(), None);
        for ((slot, key), flushed) in out.iter_mut().zip(keys).zip(flushed) {
            if slot.is_some() {
                continue;
            }
            match head.get_or_create(key) {
                Ok(r) => {
                    if let Some(t) = flushed {
                        head.raise_flushed(r, t);
                    }
                    if !head.is_logged(r) && !logged_now.contains(&r) {
                        record::encode_series(&mut buf, r.0, head.key(r));
                        logged_now.push(r);
                    }
                    *slot = Some((r, head.key_arc(r).clone()));
                }
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        if !buf.is_empty() {
            // Logged under the head lock, so no sample can reference a new
            // series in the WAL before its definition does.
            self.wal
                .write(buf)
                .map_err(|e| Error::io(self.wal_dir(), e))?;
            for r in logged_now {
                head.set_logged(r);
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(out.into_iter().flatten().collect()),
        }
    }

    /// Appends a columnar batch to the head. Row `i` is
    /// `(refs[i], ts_ms[i], values[i])`. When this returns, the accepted
    /// samples are in the WAL (durable under the [`SyncPolicy`]) and visible to
    /// queries. All-or-nothing on errors. Blocks for the WAL write.
    ///
    /// # Errors
    /// [`Error::BadBatch`] if the columns differ in length, a ref is unknown,
    /// or a timestamp is outside [`crate::MIN_TS_MS`]..=[`crate::MAX_TS_MS`]
    /// (counted in `samples_out_of_range`); [`Error::Io`] if the WAL write
    /// failed (nothing was stored).
    pub fn append(
        &self,
        refs: &[SeriesRef],
        ts_ms: &[i64],
        values: &[f64],
    ) -> Result<AppendOutcome> {
        self.append_from(None, refs, ts_ms, values)
    }

    /// [`Storage::append`] for a batch with an origin: a batch whose sequence
    /// number is at or below the highest stored one of its producer is
    /// dropped whole (`duplicate_batch`). The mark that records the batch goes
    /// into the same WAL write as its samples, so de-duplication survives a
    /// crash, and into every WAL checkpoint, so it survives a flush.
    ///
    /// # Errors
    /// As [`Storage::append`].
    pub fn append_from(
        &self,
        origin: Option<BatchOrigin<'_>>,
        refs: &[SeriesRef],
        ts_ms: &[i64],
        values: &[f64],
    ) -> Result<AppendOutcome> {
        // Lock order: the gate, then the producer. A flush holds the gate
        // exclusively while it reads every producer for the WAL checkpoint.
        let _gate = lock!(self.gate.read());
        let producer = origin.map(|o| self.producers.get(o.producer));
        let mut hwm = producer.as_ref().map(|p| lock!(p.lock()));
        if let (Some(o), Some(h)) = (origin, hwm.as_deref())
            && o.seq <= *h
        {
            self.metrics.batches_duplicate.fetch_add(1, Relaxed);
            return Ok(AppendOutcome {
                duplicate_batch: true,
                ..Default::default()
            });
        }
        if refs.len() != ts_ms.len() || refs.len() != values.len() {
            return Err(Error::BadBatch {
                reason: "columns differ in length",
            });
        }
        let out_of_range = ts_ms.iter().filter(|&&t| !crate::ts_storable(t)).count();
        if out_of_range > 0 {
            self.metrics
                .samples_out_of_range
                .fetch_add(out_of_range as u64, Relaxed);
            return Err(Error::BadBatch {
                reason: OUT_OF_RANGE,
            });
        }
        // Idle series leave the head at a flush (`Head::evict_idle`, under
        // the exclusive gate, which this append holds shared until its samples
        // are in): every distinct ref is checked, under one lock.
        {
            let head = lock!(self.head.read());
            let mut prev = None;
            for &r in refs {
                if prev != Some(r) && !head.contains(r) {
                    return Err(if head.was_issued(r) {
                        Error::SeriesEvicted { series_ref: r.0 }
                    } else {
                        Error::BadBatch {
                            reason: "unknown series ref",
                        }
                    });
                }
                prev = Some(r);
            }
        }
        let wal_refs: Vec<u32> = refs.iter().map(|r| r.0).collect();
        let mut buf = Vec::with_capacity(refs.len() * 12 + 48);
        record::encode_samples(&mut buf, &wal_refs, ts_ms, values);
        if let Some(o) = origin {
            record::encode_mark(&mut buf, o.producer, o.seq);
        }
        self.wal
            .write(buf)
            .map_err(|e| Error::io(self.wal_dir(), e))?;
        if let (Some(o), Some(h)) = (origin, hwm.as_deref_mut()) {
            *h = o.seq;
        }
        let mut head = lock!(self.head.write());
        let mut out = AppendOutcome::default();
        // Raised only under the exclusive gate, so fixed for this batch.
        let floor = self.raw_floor.load(Relaxed);
        // Taken only for a late sample that may repeat a flushed timestamp. The
        // gate keeps freezes out, so what the segments hold cannot change
        // meanwhile, and the sample is asked about again under the head lock;
        // the head lock is let go first to keep the lock order state -> head.
        let mut flushed: Option<RwLockReadGuard<'_, State>> = None;
        let mut i = 0;
        while i < refs.len() {
            let (r, t, v) = (refs[i], ts_ms[i], values[i]);
            if t < floor {
                out.too_old += 1;
                i += 1;
                continue;
            }
            if flushed.is_none() && head.maybe_flushed(r, t) {
                drop(head);
                flushed = Some(lock!(self.state.read()));
                head = lock!(self.head.write());
                continue;
            }
            i += 1;
            let seen =
                |key: &SeriesKey, ts| flushed.as_deref().is_some_and(|s| s.has_sample(key, ts));
            match head.append_with(r, t, v, true, seen) {
                Appended::InOrder => out.accepted += 1,
                Appended::OutOfOrder => {
                    out.accepted += 1;
                    out.out_of_order += 1;
                }
                Appended::Duplicate => out.duplicates += 1,
                Appended::TooOld => out.too_old += 1,
            }
        }
        let full = self
            .config
            .head_max_samples
            .is_some_and(|max| head.num_samples() >= max);
        drop(head);
        drop(flushed);
        if full
            && let Some(f) = self.on_full.get()
            && !self.full_signalled.swap(true, Relaxed)
        {
            (f.0)();
        }
        let m = &self.metrics;
        m.samples_appended.fetch_add(out.accepted as u64, Relaxed);
        m.samples_out_of_order
            .fetch_add(out.out_of_order as u64, Relaxed);
        m.samples_duplicate
            .fetch_add(out.duplicates as u64, Relaxed);
        m.samples_too_old.fetch_add(out.too_old as u64, Relaxed);
        if let Some(o) = self.observer.get() {
            o.appended(refs, ts_ms, values);
        }
        Ok(out)
    }
}
