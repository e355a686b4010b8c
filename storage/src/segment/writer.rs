//! Writes a sealed segment: `<id>.gseg.tmp`, fsync, rename, fsync the
//! directory. The layout is in `docs/format/segment.md`.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use super::{BlockRef, FOOTER_MAGIC, HEADER_LEN, MAGIC, MAX_CHUNK_SAMPLES, VERSION};
use crate::codec::{put_str, put_uvarint, put_varint};
use crate::column;
use crate::series::METRIC_NAME_LABEL;
use crate::series::{KeyArc, SeriesKey};
use crate::{Error, Result};

/// Summary of a written segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentSummary {
    pub series: u64,
    pub samples: u64,
    pub bytes: u64,
    pub min_ts: i64,
    pub max_ts: i64,
}

/// Writes the series `keys` (sorted) to `tmp`, then renames it to `dst`
/// ([`write_segment_tmp`], then [`publish`]); for tests (the storage opens
/// the temporary file between the two).
#[cfg(test)]
pub(crate) fn write_segment(
    tmp: &Path,
    dst: &Path,
    seq: (u64, u64),
    wal_cut: u64,
    keys: &[KeyArc],
    load: impl FnMut(usize, &mut Vec<i64>, &mut Vec<f64>) -> Result<()>,
) -> Result<SegmentSummary> {
    let summary = write_segment_tmp(tmp, dst, seq, wal_cut, keys, load)?;
    publish(tmp, dst)?;
    Ok(summary)
}

/// Renames a file fsynced at `tmp` to `dst` and fsyncs the directory: from
/// then on `dst` is durable (a segment written by [`write_segment_tmp`], a
/// rollup file).
pub(crate) fn publish(tmp: &Path, dst: &Path) -> Result<()> {
    fs::rename(tmp, dst).map_err(|e| Error::io(dst, e))?;
    if let Some(dir) = dst.parent() {
        sync_dir(dir)?;
    }
    Ok(())
}

/// Writes the series `keys` (sorted) to `tmp` and fsyncs it; a leftover
/// `*.tmp` is not a segment (open deletes it) until [`publish`]
/// renames it to `dst` (named in errors).
/// `load(i, ts, values)` appends the samples of `keys[i]`, in time order.
/// `seq` is the range of flush sequence numbers the segment covers (a flush
/// covers one; a compaction the union of its sources); `wal_cut` is the WAL
/// segment number before which every record is in this segment or an older
/// one (replay skips those WAL segments). When this returns `Ok`, the file
/// is fsynced.
///
/// Samples are encoded as column chunks of at most
/// [`super::MAX_CHUNK_SAMPLES`] samples ([`crate::column`]); a timestamp
/// block whose bytes were already written is shared instead of written (or
/// compressed) again.
pub(crate) fn write_segment_tmp(
    tmp: &Path,
    dst: &Path,
    seq: (u64, u64),
    wal_cut: u64,
    keys: &[KeyArc],
    mut load: impl FnMut(usize, &mut Vec<i64>, &mut Vec<f64>) -> Result<()>,
) -> Result<SegmentSummary> {
    write_segment_tmp_with(tmp, dst, seq, wal_cut, keys, |i, ts, vals| {
        load(i, ts, vals).map(|()| None)
    })
}

/// [`write_segment_tmp`], where `load` may hand over a series already
/// encoded ([`EncodedSeries`], by another thread) instead of its samples:
/// the file's bytes are the same either way.
pub(crate) fn write_segment_tmp_with(
    tmp: &Path,
    dst: &Path,
    seq: (u64, u64),
    wal_cut: u64,
    keys: &[KeyArc],
    mut load: impl FnMut(usize, &mut Vec<i64>, &mut Vec<f64>) -> Result<Option<EncodedSeries>>,
) -> Result<SegmentSummary> {
    let io = |e| Error::io(tmp, e);
    let file = File::create(tmp).map_err(io)?;
    let mut w = BufWriter::with_capacity(1 << 20, file);

    let mut header = Vec::with_capacity(HEADER_LEN);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&VERSION.to_le_bytes());
    header.extend_from_slice(&crc32c::crc32c(&header).to_le_bytes());
    debug_assert_eq!(header.len(), HEADER_LEN);
    w.write_all(&header).map_err(io)?;

    // Data region and index, built together.
    let mut offset = HEADER_LEN as u64;
    let mut index = Vec::new();
    // Sorted by (name, value) when written: a B-tree of string pairs, looked
    // up for every label of every series, was 5 % of a flush's segment
    // thread.
    let mut postings: HashMap<(&str, &str), Vec<u32>, foldhash::fast::RandomState> =
        HashMap::default();
    // Timestamp blocks written so far, by their timestamps: every field of a
    // GPU poll, and every GPU of a host polled together, shares one.
    let mut ts_blocks: HashMap<Vec<i64>, BlockRef, foldhash::fast::RandomState> =
        HashMap::default();
    let (mut samples, mut min_ts, mut max_ts) = (0u64, i64::MAX, i64::MIN);
    let (mut ts, mut vals, mut block) = (Vec::new(), Vec::new(), Vec::new());
    let put = |w: &mut BufWriter<File>, bytes: &[u8], offset: &mut u64| -> Result<BlockRef> {
        w.write_all(bytes).map_err(io)?;
        let r = BlockRef {
            offset: *offset,
            len: bytes.len() as u32,
            crc: crc32c::crc32c(bytes),
        };
        *offset += bytes.len() as u64;
        Ok(r)
    };
    // What the reader relies on, checked before anything depends on it: keys
    // strictly ascending (lookups binary-search them).
    let unwritable = |key: &SeriesKey, what| Error::Unwritable {
        path: dst.to_path_buf(),
        item: key.to_string(),
        what,
    };
    if let Some(w) = keys.windows(2).find(|w| w[0] >= w[1]) {
        return Err(unwritable(&w[1], "series keys not strictly ascending"));
    }
    put_uvarint(&mut index, keys.len() as u64);
    for (i, key) in keys.iter().enumerate() {
        let ordinal = i as u32;
        put_str(&mut index, key.metric());
        put_uvarint(&mut index, key.labels().len() as u64);
        postings
            .entry((METRIC_NAME_LABEL, key.metric()))
            .or_default()
            .push(ordinal);
        for l in key.labels() {
            put_str(&mut index, &l.name);
            put_str(&mut index, &l.value);
            postings
                .entry((&l.name, &l.value))
                .or_default()
                .push(ordinal);
        }
        ts.clear();
        vals.clear();
        let encoded = match load(i, &mut ts, &mut vals)? {
            Some(e) => e,
            None => {
                EncodedSeries::check(&ts, &vals).map_err(|what| unwritable(key, what))?;
                EncodedSeries::default()
            }
        };
        let own = ts
            .chunks(MAX_CHUNK_SAMPLES)
            .zip(vals.chunks(MAX_CHUNK_SAMPLES))
            .map(|(t, v)| (t, ChunkValues::Samples(v)));
        let ahead = encoded
            .chunks
            .iter()
            .map(|c| (&*c.ts, ChunkValues::Encoded(&c.values, c.last)));
        put_uvarint(&mut index, (own.len() + ahead.len()) as u64);
        for (t, v) in own.chain(ahead) {
            // Looked up by the timestamps: a shared block is encoded once.
            let ts_ref = match ts_blocks.get(t) {
                Some(r) => *r,
                None => {
                    block.clear();
                    column::encode_ts(t, &mut block);
                    let r = put(&mut w, &block, &mut offset)?;
                    ts_blocks.insert(t.to_vec(), r);
                    r
                }
            };
            let (val_ref, last) = match v {
                ChunkValues::Samples(v) => {
                    block.clear();
                    column::encode_segment_values(v, &mut block);
                    (put(&mut w, &block, &mut offset)?, v[v.len() - 1])
                }
                ChunkValues::Encoded(bytes, last) => (put(&mut w, bytes, &mut offset)?, last),
            };
            let (lo, hi) = (t[0], t[t.len() - 1]);
            put_varint(&mut index, lo);
            put_uvarint(&mut index, hi.wrapping_sub(lo) as u64);
            put_uvarint(&mut index, t.len() as u64);
            for r in [ts_ref, val_ref] {
                put_uvarint(&mut index, r.offset);
                put_uvarint(&mut index, r.len as u64);
                index.extend_from_slice(&r.crc.to_le_bytes());
            }
            // The newest sample's value, so that a read of each series'
            // latest sample (an instant selector) decodes nothing.
            index.extend_from_slice(&last.to_bits().to_le_bytes());
            samples += t.len() as u64;
            min_ts = min_ts.min(lo);
            max_ts = max_ts.max(hi);
        }
    }
    let mut postings: Vec<_> = postings.into_iter().collect();
    postings.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let mut post = Vec::new();
    put_uvarint(&mut post, postings.len() as u64);
    for ((name, value), ids) in &postings {
        put_str(&mut post, name);
        put_str(&mut post, value);
        put_uvarint(&mut post, ids.len() as u64);
        let mut prev = 0u32;
        for &id in ids {
            put_uvarint(&mut post, (id - prev) as u64); // ids ascend: deltas are >= 0
            prev = id;
        }
    }

    // Both sections are zstd-compressed (version 4): label names repeat in
    // every series and values in every series of a GPU, so the index is
    // mostly repeats; it was 40 % of a segment's bytes on the simulated
    // fleet (docs/BENCHMARKS.md).
    if index.len() as u64 > super::MAX_SECTION || post.len() as u64 > super::MAX_SECTION {
        return Err(Error::Unwritable {
            path: dst.to_path_buf(),
            item: format!("{} series", keys.len()),
            what: "series index or postings over 4 GiB",
        });
    }
    let (index, post) = {
        let (mut i, mut p) = (Vec::new(), Vec::new());
        crate::codec::put_zstd_section(&mut i, &index);
        crate::codec::put_zstd_section(&mut p, &post);
        (i, p)
    };
    let index_offset = offset;
    let postings_offset = index_offset + index.len() as u64;
    w.write_all(&index).map_err(io)?;
    w.write_all(&post).map_err(io)?;
    if samples == 0 {
        (min_ts, max_ts) = (0, 0);
    }

    let mut footer = Vec::with_capacity(super::FOOTER_LEN);
    for v in [
        index_offset,
        index.len() as u64,
        postings_offset,
        post.len() as u64,
        keys.len() as u64,
        samples,
    ] {
        footer.extend_from_slice(&v.to_le_bytes());
    }
    footer.extend_from_slice(&min_ts.to_le_bytes());
    footer.extend_from_slice(&max_ts.to_le_bytes());
    footer.extend_from_slice(&seq.0.to_le_bytes());
    footer.extend_from_slice(&seq.1.to_le_bytes());
    footer.extend_from_slice(&wal_cut.to_le_bytes());
    footer.extend_from_slice(&crc32c::crc32c(&index).to_le_bytes());
    footer.extend_from_slice(&crc32c::crc32c(&post).to_le_bytes());
    footer.extend_from_slice(&crc32c::crc32c(&footer).to_le_bytes());
    footer.extend_from_slice(FOOTER_MAGIC);
    debug_assert_eq!(footer.len(), super::FOOTER_LEN);
    w.write_all(&footer).map_err(io)?;

    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    let bytes = file.metadata().map_err(io)?.len();
    drop(file);
    Ok(SegmentSummary {
        series: keys.len() as u64,
        samples,
        bytes,
        min_ts,
        max_ts,
    })
}

/// A chunk's values for the writer: its samples to encode, or its value
/// block encoded already, with its last value.
enum ChunkValues<'a> {
    Samples(&'a [f64]),
    Encoded(&'a [u8], f64),
}

/// A series' chunks encoded ahead of a segment writer, by another thread
/// ([`write_segment_tmp_with`]): what the writer would encode from the same
/// samples, but for the timestamp blocks, which it shares across series.
#[derive(Debug, Default)]
pub(crate) struct EncodedSeries {
    chunks: Vec<EncodedChunk>,
}

#[derive(Debug)]
struct EncodedChunk {
    /// Shared by the chunks of other series with the same timestamps.
    ts: Arc<[i64]>,
    values: Vec<u8>,
    last: f64,
}

impl EncodedSeries {
    /// Encodes a series' samples as the writer does. `shared` holds the
    /// timestamps seen so far, so that the series polled together keep one
    /// copy. `None` if the writer would refuse them: it then finds why.
    pub(crate) fn encode(
        ts: &[i64],
        vals: &[f64],
        shared: &mut std::collections::HashSet<Arc<[i64]>, foldhash::fast::RandomState>,
    ) -> Option<Self> {
        Self::check(ts, vals).ok()?;
        let chunks = ts
            .chunks(MAX_CHUNK_SAMPLES)
            .zip(vals.chunks(MAX_CHUNK_SAMPLES))
            .map(|(t, v)| {
                let ts = match shared.get(t) {
                    Some(ts) => ts.clone(),
                    None => {
                        let ts: Arc<[i64]> = t.into();
                        shared.insert(ts.clone());
                        ts
                    }
                };
                let mut values = Vec::new();
                column::encode_segment_values(v, &mut values);
                EncodedChunk {
                    ts,
                    values,
                    last: v[v.len() - 1],
                }
            });
        Some(EncodedSeries {
            chunks: chunks.collect(),
        })
    }

    /// What the reader relies on: chunks inside the storable range, and
    /// timestamps that ascend strictly (one sample per timestamp, in time
    /// order).
    fn check(ts: &[i64], vals: &[f64]) -> std::result::Result<(), &'static str> {
        if ts.len() != vals.len() {
            return Err("timestamp and value columns differ in length");
        }
        if !ts.iter().all(|&t| crate::ts_storable(t)) {
            return Err("sample timestamp outside the storable range (years 1 to 9999)");
        }
        if ts.windows(2).any(|w| w[0] >= w[1]) {
            return Err("sample timestamps not strictly ascending");
        }
        Ok(())
    }
}

/// Series that a second thread encodes ahead of a segment writer: the
/// writer goes forward from the first series, the helper claims batches
/// back from the last one while the writer is far enough behind, and the
/// writer takes the helper's series in order when it gets there. The flush
/// uses it to end its two threads together: its rollup thread, done with
/// the rollups, encodes the segment's last series.
#[derive(Debug)]
pub(crate) struct Ahead {
    state: std::sync::Mutex<AheadState>,
    ready: std::sync::Condvar,
}

#[derive(Debug)]
struct AheadState {
    /// The writer's next series.
    next: usize,
    /// The first series claimed by the helper (all from it on are).
    claimed: usize,
    /// Batches the helper encoded, by their first series; `None` for a
    /// series the helper could not encode (the writer then does, and tells
    /// why if it cannot either).
    done: std::collections::BTreeMap<usize, Vec<Option<EncodedSeries>>>,
    /// The helper claims nothing more and has delivered what it claimed, or
    /// died.
    finished: bool,
}

impl Ahead {
    /// For a segment of `n` series.
    pub(crate) fn new(n: usize) -> Self {
        Ahead {
            state: std::sync::Mutex::new(AheadState {
                next: 0,
                claimed: n,
                done: Default::default(),
                finished: false,
            }),
            ready: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AheadState> {
        // Each critical section leaves the state whole: a panic elsewhere
        // does not make it wrong.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The helper's next batch of up to `batch` series (a range it
    /// encodes, then [`Self::deliver`]s), while the writer is more than two
    /// batches away from it; `None` once it is not.
    pub(crate) fn claim(&self, batch: usize) -> Option<std::ops::Range<usize>> {
        let mut s = self.lock();
        let end = s.claimed;
        let start = end.checked_sub(batch)?;
        if s.finished || start < s.next.saturating_add(2 * batch) {
            return None;
        }
        s.claimed = start;
        Some(start..end)
    }

    /// Hands over the claimed batch that starts at `start`.
    pub(crate) fn deliver(&self, start: usize, encoded: Vec<Option<EncodedSeries>>) {
        self.lock().done.insert(start, encoded);
        self.ready.notify_all();
    }

    /// The helper claims no more. Also called if it unwinds (see
    /// [`AheadHelper`]): the writer then encodes what was not delivered.
    pub(crate) fn finish(&self) {
        self.lock().finished = true;
        self.ready.notify_all();
    }

    /// The writer has stopped (done, or failed): the helper claims no more.
    pub(crate) fn writer_done(&self) {
        self.lock().next = usize::MAX;
    }

    /// The writer's turn at series `i` (in ascending order): the helper's
    /// encoding of it, waiting for it if the helper has claimed it, or
    /// `None` for the writer to load it itself.
    pub(crate) fn take(&self, i: usize) -> Option<EncodedSeries> {
        let mut s = self.lock();
        s.next = s.next.max(i + 1);
        if i < s.claimed {
            return None;
        }
        loop {
            if let Some((&start, batch)) = s.done.range_mut(..=i).next_back()
                && let Some(slot) = batch.get_mut(i - start)
            {
                let encoded = slot.take();
                if i - start + 1 == batch.len() {
                    s.done.remove(&start);
                }
                return encoded;
            }
            if s.finished {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Calls [`Ahead::finish`] when dropped, unwinding included, so that a
/// writer never waits on a helper that is gone.
pub(crate) struct AheadHelper<'a>(pub(crate) &'a Ahead);

impl Drop for AheadHelper<'_> {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Makes a rename or create inside `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}
