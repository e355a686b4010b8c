//! `gpulse import`: bulk-loads a long-format CSV straight into a data
//! directory (no server needed; the directory must not be in use).
//!
//! Format: header `labels,timestamp_ms,value`; `labels` is `key=value` pairs
//! joined by `;`, and `metric=` gives the metric name, e.g.
//! `metric=power_w;host=node0;gpu=3,1775016266006,71.4`. The row parsing is
//! shared with `gpulse agent --replay` ([`agent::replay::long_csv`]). A bad
//! row is reported with its line number and skipped; the good rows still
//! land. At the end the head is flushed, so everything is in sealed segments.

use std::collections::HashMap;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use agent::replay::long_csv;
use anyhow::Context;
use storage::{Label, SeriesKey, SeriesRef, Storage, StorageConfig};

/// Rows appended to storage per call.
const BATCH_ROWS: usize = 65_536;
/// Bad rows printed individually; the rest are only counted.
const MAX_REPORTED: u64 = 20;

/// Counts bytes read, for the progress line.
struct Counting<R> {
    inner: R,
    bytes: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes.fetch_add(n as u64, Relaxed);
        Ok(n)
    }
}

/// What an import did.
#[derive(Debug, Default)]
pub(crate) struct ImportReport {
    pub(crate) rows: u64,
    pub(crate) imported: u64,
    pub(crate) bad_rows: u64,
    /// Samples not stored: duplicates, or older than the out-of-order window.
    pub(crate) dropped: u64,
    pub(crate) series: usize,
}

fn parse_labels(field: &str) -> Result<SeriesKey, String> {
    let l = long_csv::parse_labels(field).map_err(|e| e.to_string())?;
    // The label limits every entry shares (storage::admission), at their defaults.
    storage::admission::LabelLimits::default()
        .check_series(l.metric, l.pairs.iter().copied())
        .map_err(|e| e.to_string())?;
    let labels = l.pairs.iter().map(|(k, v)| Label::new(*k, *v)).collect();
    SeriesKey::new(l.metric, labels).map_err(|e| e.to_string())
}

pub(crate) fn import(input: &str, data_dir: PathBuf) -> anyhow::Result<ImportReport> {
    let storage = Storage::open(StorageConfig::new(&data_dir)).with_context(|| {
        format!(
            "opening data dir {} (stop any gpulse serve using it)",
            data_dir.display()
        )
    })?;
    let bytes = Arc::new(AtomicU64::new(0));
    let (raw, total): (Box<dyn Read>, Option<u64>) = if input == "-" {
        (Box::new(std::io::stdin().lock()), None)
    } else {
        let f = std::fs::File::open(input).with_context(|| format!("opening {input}"))?;
        let len = f.metadata().ok().map(|m| m.len());
        (Box::new(f), len)
    };
    let reader = Counting {
        inner: std::io::BufReader::with_capacity(1 << 20, raw),
        bytes: bytes.clone(),
    };
    let mut csv = long_csv::reader(reader);
    long_csv::check_header(csv.headers().context("reading the CSV header")?)?;

    let progress = std::io::stderr().is_terminal();
    let started = Instant::now();
    let mut last_progress = Instant::now();
    let mut report = ImportReport::default();
    let mut refs_by_labels: HashMap<String, SeriesRef> = HashMap::new();
    let (mut refs, mut ts, mut vals) = (Vec::new(), Vec::new(), Vec::new());
    let mut record = csv::StringRecord::new();
    // The admission window (storage::admission): no sample before 1970 or
    // more than 10 min ahead of the clock. No retention bound: an import
    // loads history into a directory, whose node applies its own retention.
    let window = storage::admission::SampleWindow::default();
    let flush_batch = |refs: &mut Vec<SeriesRef>,
                       ts: &mut Vec<i64>,
                       vals: &mut Vec<f64>,
                       report: &mut ImportReport|
     -> anyhow::Result<()> {
        let out = storage.append(refs, ts, vals)?;
        report.imported += out.accepted as u64;
        report.dropped += out.dropped() as u64;
        refs.clear();
        ts.clear();
        vals.clear();
        Ok(())
    };
    loop {
        // The reader stands at the start of the next record: its 1-based line.
        let line = csv.position().line();
        match csv.read_record(&mut record) {
            Ok(false) => break,
            Ok(true) => {}
            Err(e) => {
                bad_row(&mut report, line, &format!("unreadable row: {e}"));
                continue;
            }
        }
        report.rows += 1;
        let parsed = (|| -> Result<(SeriesRef, i64, f64), String> {
            let row = long_csv::parse_row(&record).map_err(|e| e.to_string())?;
            window
                .bounds_now()
                .check(row.ts_ms)
                .map_err(|e| e.to_string())?;
            let r = match refs_by_labels.get(row.labels) {
                Some(r) => *r,
                None => {
                    let key = parse_labels(row.labels)?;
                    let r = storage.series_ref(key).map_err(|e| e.to_string())?;
                    refs_by_labels.insert(row.labels.to_string(), r);
                    r
                }
            };
            Ok((r, row.ts_ms, row.value))
        })();
        match parsed {
            Ok((r, t, v)) => {
                refs.push(r);
                ts.push(t);
                vals.push(v);
            }
            Err(msg) => bad_row(&mut report, line, &msg),
        }
        if refs.len() >= BATCH_ROWS {
            flush_batch(&mut refs, &mut ts, &mut vals, &mut report)?;
        }
        if progress && last_progress.elapsed() >= Duration::from_millis(250) {
            last_progress = Instant::now();
            print_progress(&report, bytes.load(Relaxed), total, started.elapsed());
        }
    }
    flush_batch(&mut refs, &mut ts, &mut vals, &mut report)?;
    if progress {
        print_progress(&report, bytes.load(Relaxed), total, started.elapsed());
        eprintln!();
    }
    report.series = refs_by_labels.len();
    if report.bad_rows > MAX_REPORTED {
        eprintln!(
            "... {} more bad rows not shown",
            report.bad_rows - MAX_REPORTED
        );
    }
    eprintln!("sealing segments ...");
    storage
        .flush()
        .context("sealing the imported samples into a segment")?;
    Ok(report)
}

fn bad_row(report: &mut ImportReport, line: u64, msg: &str) {
    report.bad_rows += 1;
    if report.bad_rows <= MAX_REPORTED {
        eprintln!("line {line}: {msg}; row skipped");
    }
}

fn print_progress(r: &ImportReport, bytes: u64, total: Option<u64>, elapsed: Duration) {
    let secs = elapsed.as_secs_f64().max(1e-3);
    let pct = total
        .filter(|&t| t > 0)
        .map(|t| format!(" {:5.1}%", bytes as f64 * 100.0 / t as f64))
        .unwrap_or_default();
    eprint!(
        "\rimporting{pct}  {} rows  {:.1} MB  {:.0} rows/s  {} bad",
        r.rows,
        bytes as f64 / 1e6,
        r.rows as f64 / secs,
        r.bad_rows
    );
    let _ = std::io::stderr().flush();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_field() {
        let k = parse_labels("metric=power_w;host=node0;gpu=3").unwrap();
        assert_eq!(k.metric(), "power_w");
        assert_eq!(k.get("gpu"), Some("3"));
        assert_eq!(k.get("host"), Some("node0"));
        assert!(parse_labels("host=node0").unwrap_err().contains("metric"));
        assert!(
            parse_labels("metric=m;oops")
                .unwrap_err()
                .contains("key=value")
        );
    }

    /// Issue #14: import applies the admission policy, row by row.
    #[test]
    fn rows_outside_the_window_or_the_label_limits_are_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let now = storage::admission::now_ms();
        let long = "x".repeat(513);
        let csv = format!(
            "labels,timestamp_ms,value\n\
             metric=m;host=a,{now},1\n\
             metric=m;host=a,-9223372036854775808,2\n\
             metric=m;host=a,{},3\n\
             metric=m;host={long},{now},4\n\
             metric=m;host=b,0,5\n",
            now + 3_600_000
        );
        let input = dir.path().join("in.csv");
        std::fs::write(&input, csv).unwrap();
        let report = import(input.to_str().unwrap(), dir.path().join("data")).unwrap();
        assert_eq!(report.rows, 5);
        assert_eq!(report.bad_rows, 3);
        assert_eq!(report.imported, 2);
    }
}
