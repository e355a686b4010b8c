//! PromQL over [`storage`]: the evaluator behind the Prometheus HTTP API
//! ([`api::router`]).
//!
//! Queries are parsed with the `promql-parser` crate and evaluated here, step
//! by step, with Prometheus 2.42's semantics: a 5-minute lookback for instant
//! vectors (a sample at exactly `t - 5m` still counts), closed range windows
//! `[t - range, t]`, staleness markers (a sample whose bits are
//! [`STALE_NAN_BITS`] ends its series), `extrapolatedRate` for
//! `rate`/`increase`/`delta`, and the metric name dropped exactly where
//! Prometheus drops it. A range query evaluates at `start`, `start + step`,
//! ... up to and including `end`.
//!
//! Labels are returned as stored: nothing is renamed.

pub mod api;
mod eval;
mod functions;

use std::sync::Arc;

use storage::Storage;

/// The bit pattern of Prometheus's staleness marker (`value.StaleNaN`).
pub const STALE_NAN_BITS: u64 = 0x7ff0_0000_0000_0002;

/// Whether `v` is a staleness marker (a NaN with exactly these bits).
pub fn is_stale_nan(v: f64) -> bool {
    v.to_bits() == STALE_NAN_BITS
}

/// Prometheus's default lookback delta.
pub const DEFAULT_LOOKBACK_MS: i64 = 5 * 60 * 1000;
/// Prometheus's default `--query.max-samples`.
pub const DEFAULT_MAX_SAMPLES: usize = 50_000_000;
/// Most points a range query may return per series (as Prometheus's API).
pub const MAX_POINTS_PER_SERIES: i64 = 11_000;

/// A label set, sorted by name, with the metric name as `__name__` (absent
/// where Prometheus drops it).
pub type LabelSet = Vec<(String, String)>;

/// One sample of an instant vector.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub labels: Arc<LabelSet>,
    pub t_ms: i64,
    pub v: f64,
}

/// One series of a range vector or of a range query's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub labels: Arc<LabelSet>,
    pub points: Vec<(i64, f64)>,
}

/// A query result, as the Prometheus API types it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromValue {
    Scalar { t_ms: i64, v: f64 },
    String { t_ms: i64, v: String },
    Vector(Vec<Sample>),
    Matrix(Vec<Series>),
}

/// Why a query failed. [`PromError::status`] maps it onto HTTP as
/// Prometheus does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PromError {
    /// The query or a parameter is invalid (HTTP 400, `bad_data`).
    #[error("{0}")]
    BadData(String),
    /// The query is valid but cannot be evaluated: unsupported constructs,
    /// many-to-many matching, too many samples (HTTP 422, `execution`).
    #[error("{0}")]
    Execution(String),
    /// Storage could not be read (HTTP 500, `internal`).
    #[error("{0}")]
    Internal(String),
}

impl PromError {
    /// HTTP status code and Prometheus `errorType`.
    pub fn status(&self) -> (u16, &'static str) {
        match self {
            Self::BadData(_) => (400, "bad_data"),
            Self::Execution(_) => (422, "execution"),
            Self::Internal(_) => (500, "internal"),
        }
    }
}

/// Limits of one query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromLimits {
    /// Most samples loaded from storage plus points produced by one query
    /// (Prometheus's `--query.max-samples`, 50 M by default).
    pub max_samples: usize,
    /// Lookback of instant vector selectors (5 minutes).
    pub lookback_ms: i64,
}

impl Default for PromLimits {
    fn default() -> Self {
        Self {
            max_samples: DEFAULT_MAX_SAMPLES,
            lookback_ms: DEFAULT_LOOKBACK_MS,
        }
    }
}

/// Evaluates PromQL over a [`Storage`]. Cheap to clone.
#[derive(Debug, Clone)]
pub struct PromEngine {
    storage: Arc<Storage>,
    limits: PromLimits,
    metrics: Arc<crate::QueryMetrics>,
}

impl PromEngine {
    pub fn new(storage: Arc<Storage>) -> Self {
        Self::with_limits(storage, PromLimits::default())
    }

    pub fn with_limits(storage: Arc<Storage>, limits: PromLimits) -> Self {
        Self {
            storage,
            limits,
            metrics: Arc::default(),
        }
    }

    /// Latencies and failures of [`Self::instant`] and [`Self::range`].
    pub fn metrics(&self) -> &Arc<crate::QueryMetrics> {
        &self.metrics
    }

    pub fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    pub fn limits(&self) -> PromLimits {
        self.limits
    }

    /// Evaluates `query` at `time_ms` (`/api/v1/query`).
    ///
    /// # Errors
    /// [`PromError`]: parse errors, unsupported constructs, limits.
    pub fn instant(&self, query: &str, time_ms: i64) -> Result<PromValue, PromError> {
        let started = std::time::Instant::now();
        let result = self.run_instant(query, time_ms);
        self.metrics.observe(started.elapsed(), result.is_ok());
        result
    }

    fn run_instant(&self, query: &str, time_ms: i64) -> Result<PromValue, PromError> {
        check_time(time_ms)?;
        let expr = parse(query)?;
        eval::Evaluator::new(self, time_ms, time_ms, 0)?.instant(&expr)
    }

    /// Evaluates `query` at `start_ms`, `start_ms + step_ms`, ... `<= end_ms`
    /// (`/api/v1/query_range`).
    ///
    /// # Errors
    /// [`PromError`]: a bad range or step, parse errors, unsupported
    /// constructs, limits.
    pub fn range(
        &self,
        query: &str,
        start_ms: i64,
        end_ms: i64,
        step_ms: i64,
    ) -> Result<PromValue, PromError> {
        let started = std::time::Instant::now();
        let result = self.run_range(query, start_ms, end_ms, step_ms);
        self.metrics.observe(started.elapsed(), result.is_ok());
        result
    }

    fn run_range(
        &self,
        query: &str,
        start_ms: i64,
        end_ms: i64,
        step_ms: i64,
    ) -> Result<PromValue, PromError> {
        check_time(start_ms)?;
        check_time(end_ms)?;
        if end_ms < start_ms {
            return Err(PromError::BadData(
                "end timestamp must not be before start time".into(),
            ));
        }
        if step_ms <= 0 {
            return Err(PromError::BadData(
                "zero or negative query resolution step widths are not accepted. Try a positive integer".into(),
            ));
        }
        if (end_ms - start_ms) / step_ms > MAX_POINTS_PER_SERIES {
            return Err(PromError::BadData(
                "exceeded maximum resolution of 11,000 points per timeseries. Try decreasing the query resolution (?step=XX)".into(),
            ));
        }
        let expr = parse(query)?;
        eval::Evaluator::new(self, start_ms, end_ms, step_ms)?.range(&expr)
    }
}

fn check_time(t_ms: i64) -> Result<(), PromError> {
    if !(-eval::MAX_ABS_MS..=eval::MAX_ABS_MS).contains(&t_ms) {
        return Err(PromError::BadData(format!(
            "time {t_ms} ms is out of range"
        )));
    }
    Ok(())
}

/// Parses a PromQL expression; errors are `bad_data`.
pub(crate) fn parse(query: &str) -> Result<promql_parser::parser::Expr, PromError> {
    promql_parser::parser::parse(query)
        .map_err(|e| PromError::BadData(format!("invalid parameter \"query\": {e}")))
}

/// A label set from a stored series key: `__name__` plus the labels, sorted.
pub(crate) fn labels_of(key: &storage::SeriesKey) -> LabelSet {
    let mut out: LabelSet = Vec::with_capacity(key.labels().len() + 1);
    out.push(("__name__".to_string(), key.metric().to_string()));
    out.extend(
        key.labels()
            .iter()
            .map(|l| (l.name.clone(), l.value.clone())),
    );
    out.sort();
    out
}

#[cfg(test)]
mod tests;
