//! Writes a sealed segment: `<id>.gseg.tmp`, fsync, rename, fsync the
//! directory. The layout is in `docs/format/segment.md`.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::Path;

use super::{FOOTER_MAGIC, HEADER_LEN, MAGIC, VERSION};
use crate::codec::{put_str, put_uvarint, put_varint};
use crate::head::FrozenSeries;
use crate::series::METRIC_NAME_LABEL;
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

/// Writes `series` (sorted by key, as [`crate::head::Head::freeze`] returns
/// them) to `tmp`, then renames it to `dst`. When this returns `Ok`, the segment
/// is durable: file and directory entry are fsynced.
pub(crate) fn write_segment(
    tmp: &Path,
    dst: &Path,
    series: &[FrozenSeries],
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

    // Chunk data, with the index built alongside.
    let mut offset = HEADER_LEN as u64;
    let mut index = Vec::new();
    let mut postings: BTreeMap<(&str, &str), Vec<u32>> = BTreeMap::new();
    let (mut samples, mut min_ts, mut max_ts) = (0u64, i64::MAX, i64::MIN);
    put_uvarint(&mut index, series.len() as u64);
    for (ordinal, (key, chunks)) in series.iter().enumerate() {
        let ordinal = ordinal as u32;
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
        put_uvarint(&mut index, chunks.len() as u64);
        for c in chunks {
            w.write_all(&c.bytes).map_err(io)?;
            put_varint(&mut index, c.min_ts);
            put_uvarint(&mut index, c.max_ts.wrapping_sub(c.min_ts) as u64);
            put_uvarint(&mut index, c.count as u64);
            put_uvarint(&mut index, offset);
            put_uvarint(&mut index, c.bytes.len() as u64);
            index.extend_from_slice(&crc32c::crc32c(&c.bytes).to_le_bytes());
            offset += c.bytes.len() as u64;
            samples += c.count as u64;
            min_ts = min_ts.min(c.min_ts);
            max_ts = max_ts.max(c.max_ts);
        }
    }

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
        series.len() as u64,
        samples,
    ] {
        footer.extend_from_slice(&v.to_le_bytes());
    }
    footer.extend_from_slice(&min_ts.to_le_bytes());
    footer.extend_from_slice(&max_ts.to_le_bytes());
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
    fs::rename(tmp, dst).map_err(|e| Error::io(dst, e))?;
    if let Some(dir) = dst.parent() {
        sync_dir(dir)?;
    }
    Ok(SegmentSummary {
        series: series.len() as u64,
        samples,
        bytes,
        min_ts,
        max_ts,
    })
}

/// Makes a rename or create inside `dir` durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, e))
}
