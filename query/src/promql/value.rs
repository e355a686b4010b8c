//! The values of evaluation (instant vectors, range inputs), label-set
//! helpers and the formatting of values and label sets.

use std::sync::Arc;

use super::{LabelSet, PromError};

type Result<T> = std::result::Result<T, PromError>;

pub(super) const METRIC_NAME: &str = "__name__";

/// One element of an instant vector at one step.
#[derive(Debug, Clone)]
pub(super) struct Elem {
    pub(super) labels: Arc<LabelSet>,
    pub(super) v: f64,
}

pub(super) type Vector = Vec<Elem>;

/// The value of a node for every step of the query.
#[derive(Debug)]
pub(super) enum Val {
    Scalar(Vec<f64>),
    Vector(Vec<Vector>),
    Str(String),
}

/// One series of a range vector: samples in time order, staleness markers
/// removed.
#[derive(Debug)]
pub(super) struct RawSeries {
    pub(super) labels: Arc<LabelSet>,
    pub(super) ts: Vec<i64>,
    pub(super) vs: Vec<f64>,
}

/// A range vector argument (`x[5m]` or a subquery) and how to cut its
/// window at each step: `[reference - range, reference]`, closed.
#[derive(Debug)]
pub(super) struct RangeInput {
    pub(super) series: Vec<RawSeries>,
    pub(super) range_ms: i64,
    pub(super) offset_ms: i64,
    pub(super) at_ms: Option<i64>,
}

impl RangeInput {
    pub(super) fn reference(&self, step_ms: i64) -> i64 {
        self.at_ms.unwrap_or(step_ms) - self.offset_ms
    }

    /// Indices `[lo, hi)` of `s`'s samples in the window ending at `reference`.
    pub(super) fn window(&self, s: &RawSeries, reference: i64) -> (usize, usize) {
        let lo = s.ts.partition_point(|&t| t < reference - self.range_ms);
        let hi = s.ts.partition_point(|&t| t <= reference);
        (lo, hi.max(lo))
    }
}

/// `labels` without `__name__` (shared when there is none).
pub(super) fn drop_name(labels: &Arc<LabelSet>) -> Arc<LabelSet> {
    if labels.iter().any(|(n, _)| n == METRIC_NAME) {
        Arc::new(
            labels
                .iter()
                .filter(|(n, _)| n != METRIC_NAME)
                .cloned()
                .collect(),
        )
    } else {
        labels.clone()
    }
}

pub(super) fn get<'l>(labels: &'l LabelSet, name: &str) -> Option<&'l str> {
    labels
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Sets (or, for an empty value, removes) one label, keeping the order.
pub(super) fn set_label(labels: &mut LabelSet, name: &str, value: &str) {
    match labels.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
        Ok(i) if value.is_empty() => {
            labels.remove(i);
        }
        Ok(i) => labels[i].1 = value.to_string(),
        Err(_) if value.is_empty() => {}
        Err(i) => labels.insert(i, (name.to_string(), value.to_string())),
    }
}

/// A hashable identity of a whole label set.
pub(super) fn key_of(labels: &LabelSet) -> String {
    let mut s = String::new();
    for (n, v) in labels {
        s.push_str(n);
        s.push('\u{ff}');
        s.push_str(v);
        s.push('\u{fe}');
    }
    s
}

pub(super) fn check_unique(v: &Vector) -> Result<()> {
    if v.len() < 2 {
        return Ok(());
    }
    let mut seen = std::collections::HashSet::with_capacity(v.len());
    for e in v {
        if !seen.insert(key_of(&e.labels)) {
            return Err(PromError::Execution(
                "vector cannot contain metrics with the same labelset".into(),
            ));
        }
    }
    Ok(())
}

pub(super) fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(super) fn display(labels: &LabelSet) -> String {
    let mut s = String::from("{");
    for (i, (n, v)) in labels.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!("{n}={v:?}"));
    }
    s.push('}');
    s
}

/// Go's `strconv.FormatFloat(v, 'f', -1, 64)`, with Prometheus's spelling
/// of the non-finite values.
pub(super) fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}
