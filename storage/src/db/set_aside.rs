//! Setting aside what storage cannot store: the samples and rollup records
//! that a writer refuses go to a `quarantine/set-aside-*.txt` file that says
//! why, instead of wedging every flush.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use tracing::error;

use super::Storage;
use crate::Result;
use crate::error::Error;
use crate::files::{self, QUARANTINE_DIR};
use crate::head::{FrozenSeries, MemChunk};
use crate::rollup::file as rollup_file;
use crate::rollup::{RollupDelta, RollupGroup, RollupRecord, RollupTier};
use crate::series::SeriesKey;

impl Storage {
    /// Sets aside the samples of `frozen` that a segment cannot hold (all of
    /// them if none is found at fault and `or_all`), in a `quarantine/` file
    /// that says why; the rest stays frozen for the next flush. Returns
    /// whether nothing is left.
    ///
    /// # Errors
    /// I/O errors writing the file; the data then stays as it was.
    pub(super) fn set_aside_samples(
        &self,
        frozen: &Arc<Vec<FrozenSeries>>,
        why: &Error,
        or_all: bool,
    ) -> Result<bool> {
        let (mut keep, mut lines, mut n) = split_frozen(frozen);
        if n == 0 {
            if !or_all {
                return Ok(false);
            }
            keep = Vec::new();
            (lines, n) = describe_frozen(frozen);
        }
        let path = self.write_set_aside("flush: raw samples", why, &lines)?;
        self.metrics.samples_set_aside.fetch_add(n, Relaxed);
        error!(file = %path.display(), samples = n, error = %why, "set aside samples that a segment cannot hold");
        let empty = keep.is_empty();
        lock!(self.state.write()).frozen = (!empty).then(|| Arc::new(keep));
        Ok(empty)
    }

    /// As [`Self::set_aside_samples`], for a flush's rollup records: sets
    /// aside those that no rollup file may hold, or all of them, and returns
    /// the rest, for the caller to keep for the next flush.
    pub(super) fn set_aside_rollups(
        &self,
        delta: &RollupDelta,
        why: &Error,
    ) -> Result<RollupDelta> {
        let (mut keep, mut lines) = (Vec::new(), Vec::new());
        for (g, minutes) in delta.iter() {
            let (good, bad): (Vec<RollupRecord>, Vec<RollupRecord>) = minutes
                .iter()
                .partition(|r| rollup_file::record_problem(RollupTier::Minute, r).is_none());
            lines.extend(bad.iter().map(|r| rollup_line(g, r)));
            if !good.is_empty() {
                keep.push((g.clone(), good));
            }
        }
        if lines.is_empty() {
            keep.clear();
            for (g, minutes) in delta.iter() {
                lines.extend(minutes.iter().map(|r| rollup_line(g, r)));
            }
        }
        let path = self.write_set_aside("flush: 1-minute rollup records", why, &lines)?;
        self.metrics
            .rollup_records_set_aside
            .fetch_add(lines.len() as u64, Relaxed);
        error!(file = %path.display(), records = lines.len(), error = %why, "set aside rollup records that a rollup file cannot hold");
        Ok(keep)
    }

    fn write_set_aside(&self, what: &str, why: &Error, lines: &[String]) -> Result<PathBuf> {
        let n = self.set_aside_seq.fetch_add(1, Relaxed);
        write_set_aside(&self.config.data_dir, n, what, &why.to_string(), lines)
    }
}

/// One set-aside sample: `sample <key> <ts_ms> <value> <value bits>`,
/// tab-separated (the bits keep NaN payloads).
pub(super) fn sample_line(key: &SeriesKey, ts_ms: i64, v: f64) -> String {
    format!("sample\t{key}\t{ts_ms}\t{v}\t{:#018x}", v.to_bits())
}

/// One set-aside 1-minute rollup record, tab-separated.
fn rollup_line(g: &RollupGroup, r: &RollupRecord) -> String {
    format!(
        "rollup_1m\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
        g.metric,
        g.cluster,
        g.row,
        g.rack,
        g.host,
        g.gpu,
        r.window_start_ms,
        r.count,
        r.sum,
        r.min,
        r.max,
        r.first,
        r.first_ts_ms,
        r.last,
        r.last_ts_ms
    )
}

/// Splits frozen chunks into what a segment can hold and the samples it
/// cannot (a timestamp outside the storable range), as set-aside lines.
/// Chunks without such samples are kept as they are; the others are
/// re-encoded without them. Returns the kept series, the lines and their count.
fn split_frozen(frozen: &[FrozenSeries]) -> (Vec<FrozenSeries>, Vec<String>, u64) {
    let (mut keep, mut lines) = (Vec::with_capacity(frozen.len()), Vec::new());
    for (key, chunks) in frozen {
        let mut kept: Vec<MemChunk> = Vec::with_capacity(chunks.len());
        for c in chunks {
            let samples = c.salvage();
            if samples.len() == c.count as usize
                && crate::ts_storable(c.min_ts)
                && crate::ts_storable(c.max_ts)
                && samples.iter().all(|&(t, _)| crate::ts_storable(t))
            {
                kept.push(c.clone());
                continue;
            }
            let mut storable = Vec::with_capacity(samples.len());
            for &(t, v) in &samples {
                if crate::ts_storable(t) {
                    storable.push((t, v));
                } else {
                    lines.push(sample_line(key, t, v));
                }
            }
            if samples.len() < c.count as usize {
                lines.push(format!(
                    "undecodable_chunk\t{key}\t{}\t{}\t{}",
                    c.count - samples.len() as u32,
                    c.min_ts,
                    c.max_ts
                ));
            }
            kept.extend(MemChunk::gorilla(&storable, c.rolled));
        }
        if !kept.is_empty() {
            keep.push((key.clone(), kept));
        }
    }
    let n = lines.len() as u64;
    (keep, lines, n)
}

/// Every sample of `frozen` as set-aside lines, and their count.
fn describe_frozen(frozen: &[FrozenSeries]) -> (Vec<String>, u64) {
    let mut lines = Vec::new();
    for (key, chunks) in frozen {
        for c in chunks {
            let mut n = 0;
            for (t, v) in c.salvage() {
                lines.push(sample_line(key, t, v));
                n += 1;
            }
            if n < c.count {
                lines.push(format!(
                    "undecodable_chunk\t{key}\t{}\t{}\t{}",
                    c.count - n,
                    c.min_ts,
                    c.max_ts
                ));
            }
        }
    }
    let n = lines.len() as u64;
    (lines, n)
}

/// Moves the file at `path` into the quarantine directory `q_dir` as
/// `name`, writes `note` beside it (`<name>.why`) when there is one, and
/// syncs the directory the file left, so that a restart does not find it
/// there again. The one way every corrupt or unusable file leaves the store.
///
/// # Errors
/// I/O errors of the move or the sync; a note that cannot be written is not
/// one (the move stands without it).
pub(super) fn move_to_quarantine(
    q_dir: &Path,
    path: &Path,
    name: &str,
    note: Option<&str>,
) -> Result<()> {
    fs::create_dir_all(q_dir).map_err(|e| Error::io(q_dir, e))?;
    fs::rename(path, q_dir.join(name)).map_err(|e| Error::io(path, e))?;
    if let Some(note) = note {
        let _ = fs::write(files::quarantine_note_path(q_dir, name), note);
    }
    crate::segment::writer::sync_dir(path.parent().unwrap_or(Path::new(".")))
}

/// Writes (and fsyncs) `quarantine/set-aside-<unix ms>-<n>.txt`: what was
/// set aside, why, then one tab-separated line per sample or record.
pub(super) fn write_set_aside(
    data_dir: &Path,
    n: u64,
    what: &str,
    why: &str,
    lines: &[String],
) -> Result<PathBuf> {
    use std::io::Write as _;
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let q = data_dir.join(QUARANTINE_DIR);
    fs::create_dir_all(&q).map_err(|e| Error::io(&q, e))?;
    let path = files::set_aside_path(data_dir, now_ms, n);
    let mut text = format!(
        "# gpulse set aside data it could not store ({what}).\n\
         # why: {why}\n\
         # when: {now_ms} ms since the Unix epoch\n\
         # lines: sample<TAB>series<TAB>ts_ms<TAB>value<TAB>value bits, or\n\
         # rollup_1m<TAB>metric<TAB>cluster<TAB>row<TAB>rack<TAB>host<TAB>gpu<TAB>window_start_ms<TAB>count<TAB>sum<TAB>min<TAB>max<TAB>first<TAB>first_ts_ms<TAB>last<TAB>last_ts_ms\n"
    );
    for l in lines {
        text.push_str(l);
        text.push('\n');
    }
    let io = |e| Error::io(&path, e);
    let mut f = fs::File::create(&path).map_err(io)?;
    f.write_all(text.as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)?;
    crate::segment::writer::sync_dir(&q)?;
    Ok(path)
}
