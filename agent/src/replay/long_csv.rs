//! The long-format CSV that `gpulse import` loads and `gpulse agent --replay`
//! streams: one sample per row.
//!
//! Header `labels,timestamp_ms,value`. `labels` is `key=value` pairs joined by
//! `;`, and `metric=` names the metric, e.g.
//! `metric=power_w;host=node0;gpu=3,1775016266006,71.4`. `timestamp_ms` is
//! integer Unix epoch milliseconds, `value` a float. This module only splits
//! and parses rows; what a row means is up to the caller.

use std::num::{ParseFloatError, ParseIntError};

/// The header every file starts with.
pub const HEADER: [&str; 3] = ["labels", "timestamp_ms", "value"];

/// Why a header or row was rejected. The messages name the bad text, so a
/// caller can print them with a line number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowError {
    #[error("expected the header labels,timestamp_ms,value; found {found}")]
    Header { found: String },
    #[error("expected 3 fields, found {found}")]
    Fields { found: usize },
    #[error("bad timestamp_ms {text:?}: {source}")]
    Timestamp { text: String, source: ParseIntError },
    #[error("bad value {text:?}: {source}")]
    Value {
        text: String,
        source: ParseFloatError,
    },
    #[error("label {pair:?} is not key=value")]
    Label { pair: String },
    #[error("no metric= label")]
    NoMetric,
}

/// One row, borrowing the record it came from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Row<'a> {
    /// The raw labels field: a stable key for caching what it parses to.
    pub labels: &'a str,
    pub ts_ms: i64,
    pub value: f64,
}

/// A parsed labels field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Labels<'a> {
    /// The `metric=` value.
    pub metric: &'a str,
    /// Every other pair, in file order.
    pub pairs: Vec<(&'a str, &'a str)>,
}

impl<'a> Labels<'a> {
    /// The value of label `name`, if present.
    pub fn get(&self, name: &str) -> Option<&'a str> {
        self.pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| *v)
    }
}

/// A CSV reader set up for the format: the first line is the header, and a
/// row with the wrong number of fields reaches [`parse_row`] (which names
/// the count) instead of failing inside the reader.
pub fn reader<R: std::io::Read>(r: R) -> csv::Reader<R> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .from_reader(r)
}

/// Checks that `header` is [`HEADER`].
///
/// # Errors
/// [`RowError::Header`] with the header found.
pub fn check_header(header: &csv::StringRecord) -> Result<(), RowError> {
    if header.iter().eq(HEADER) {
        Ok(())
    } else {
        Err(RowError::Header {
            found: header.iter().collect::<Vec<_>>().join(","),
        })
    }
}

/// Splits a record into labels, timestamp and value (labels unparsed).
///
/// # Errors
/// A wrong field count, or a timestamp or value that does not parse.
pub fn parse_row(record: &csv::StringRecord) -> Result<Row<'_>, RowError> {
    if record.len() != 3 {
        return Err(RowError::Fields {
            found: record.len(),
        });
    }
    let ts_ms = record[1]
        .trim()
        .parse()
        .map_err(|source| RowError::Timestamp {
            text: record[1].to_string(),
            source,
        })?;
    let value = record[2].trim().parse().map_err(|source| RowError::Value {
        text: record[2].to_string(),
        source,
    })?;
    Ok(Row {
        labels: &record[0],
        ts_ms,
        value,
    })
}

/// Parses a labels field. Empty pairs (`a=1;;b=2`, a trailing `;`) are ignored.
///
/// # Errors
/// A pair without `=`, or no `metric=` pair.
pub fn parse_labels(field: &str) -> Result<Labels<'_>, RowError> {
    let mut metric = None;
    let mut pairs = Vec::new();
    for pair in field.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').ok_or_else(|| RowError::Label {
            pair: pair.to_string(),
        })?;
        if k == "metric" {
            metric = Some(v);
        } else {
            pairs.push((k, v));
        }
    }
    Ok(Labels {
        metric: metric.ok_or(RowError::NoMetric)?,
        pairs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_field() {
        let l = parse_labels("metric=power_w;host=node0;gpu=3").unwrap();
        assert_eq!(l.metric, "power_w");
        assert_eq!(l.pairs, vec![("host", "node0"), ("gpu", "3")]);
        assert_eq!(l.get("gpu"), Some("3"));
        assert_eq!(l.get("UUID"), None);
        assert_eq!(parse_labels("host=node0").unwrap_err(), RowError::NoMetric);
        assert!(
            parse_labels("metric=m;oops")
                .unwrap_err()
                .to_string()
                .contains("key=value")
        );
        assert_eq!(parse_labels(";metric=m;;").unwrap().metric, "m");
    }

    #[test]
    fn rows_and_header() {
        let data = "labels,timestamp_ms,value\n\
                    metric=m;gpu=0,1775016266006, 71.4\n\
                    metric=m,17x,1\n\
                    metric=m,1,abc\n\
                    metric=m,1\n";
        let mut r = reader(data.as_bytes());
        check_header(r.headers().unwrap()).unwrap();
        let recs: Vec<csv::StringRecord> = r
            .records()
            .collect::<Result<_, _>>()
            .expect("flexible field counts are a row error, not a reader error");
        assert_eq!(
            parse_row(&recs[0]).unwrap(),
            Row {
                labels: "metric=m;gpu=0",
                ts_ms: 1_775_016_266_006,
                value: 71.4
            }
        );
        assert!(
            matches!(parse_row(&recs[1]), Err(RowError::Timestamp { text, .. }) if text == "17x")
        );
        assert!(matches!(parse_row(&recs[2]), Err(RowError::Value { text, .. }) if text == "abc"));
        assert_eq!(parse_row(&recs[3]), Err(RowError::Fields { found: 2 }));

        let mut bad = reader("labels,ts,value\n".as_bytes());
        assert_eq!(
            check_header(bad.headers().unwrap())
                .unwrap_err()
                .to_string(),
            "expected the header labels,timestamp_ms,value; found labels,ts,value"
        );
    }
}
