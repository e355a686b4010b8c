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
//!
//! In cluster mode ([`PromEngine::with_cluster`]) every selector reads the
//! whole cluster; an answer that lacks a shard carries warnings
//! ([`Answer::warnings`], the `warnings` field of the HTTP answer). `sum`,
//! `count`, `min`, `max`, `avg`, `group`, `topk` and `bottomk` over one
//! series-wise expression are evaluated by the owners of the data, which
//! send partial results (`pushdown.rs`).

mod aggregate;
pub mod api;
mod binary;
mod eval;
mod functions;
mod parallel;
mod pushdown;
mod tiers;
mod value;

pub(crate) use pushdown::{Plan as PushdownPlan, partials as pushdown_partials};

use std::sync::Arc;

use promql_parser::parser::Expr;

use storage::{Storage, Sym};

use crate::cluster::{ClusterError, ClusterReader, Selection, Source};

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
pub type LabelSet = Vec<(Sym, Sym)>;

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
    /// The cluster cannot answer: a peer runs with another cluster file
    /// (HTTP 503, `unavailable`).
    #[error("{0}")]
    Unavailable(String),
    /// A query limit refused or stopped the query: too long or deep (400,
    /// `bad_data`), past `--query-timeout` (503, `timeout`).
    #[error("{0}")]
    Refused(crate::limits::Refusal),
}

impl From<ClusterError> for PromError {
    fn from(e: ClusterError) -> Self {
        match e {
            ClusterError::Refused(m) => Self::Unavailable(m),
            ClusterError::Internal(m) => Self::Internal(m),
            ClusterError::TooLarge(l) => Self::Execution(l.to_string()),
        }
    }
}

impl PromError {
    /// HTTP status code and Prometheus `errorType`.
    pub fn status(&self) -> (u16, &'static str) {
        match self {
            Self::BadData(_) => (400, "bad_data"),
            Self::Execution(_) => (422, "execution"),
            Self::Internal(_) => (500, "internal"),
            Self::Unavailable(_) => (503, "unavailable"),
            Self::Refused(r) => (r.http_status(), r.error_type()),
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

/// A query's value and why it may be incomplete.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub value: PromValue,
    /// Shards that no replica could serve (cluster mode); empty when the
    /// answer is complete.
    pub warnings: Vec<String>,
    /// How a complete answer was made where a user should know it, such as
    /// windows answered from rollup tiers because raw samples expired
    /// ([`tiers`]). Shown with the warnings over HTTP; not an error.
    pub notes: Vec<String>,
}

/// Evaluates PromQL over a [`Storage`], or over the whole cluster. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct PromEngine {
    storage: Arc<Storage>,
    /// Whether range functions may be answered from rollup tiers
    /// ([`tiers`]); on unless [`Self::without_rollup_tiers`].
    rollup_tiers: bool,
    source: Source,
    limits: PromLimits,
    metrics: Arc<crate::QueryMetrics>,
    guard: Arc<crate::limits::QueryGuard>,
    parsed: Arc<ParseCache>,
}

/// Expressions parsed before, by query text: a dashboard sends the same
/// queries at every refresh, and parsing one (its regular expressions
/// compiled) took an eighth of an instant `sum` over 1,000 series. Holds at
/// most [`ParseCache::CAPACITY`] entries and starts over when full, so a
/// client that never repeats a query costs one lookup and a copy of its
/// text more.
#[derive(Debug, Default)]
struct ParseCache(std::sync::Mutex<std::collections::HashMap<String, Arc<Expr>>>);

impl ParseCache {
    const CAPACITY: usize = 512;

    fn parse(&self, query: &str) -> Result<Arc<Expr>, PromError> {
        let lock = || self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(expr) = lock().get(query) {
            return Ok(expr.clone());
        }
        // Shared, not cloned: a clone of a parsed regular expression
        // builds it a new matching cache.
        let expr = Arc::new(parse(query)?);
        let mut cache = lock();
        if cache.len() >= Self::CAPACITY {
            cache.clear();
        }
        cache.insert(query.to_owned(), expr.clone());
        Ok(expr)
    }
}

impl PromEngine {
    pub fn new(storage: Arc<Storage>) -> Self {
        Self::with_limits(storage, PromLimits::default())
    }

    pub fn with_limits(storage: Arc<Storage>, limits: PromLimits) -> Self {
        Self {
            source: Source::Local(storage.clone()),
            storage,
            rollup_tiers: true,
            limits,
            metrics: Arc::default(),
            guard: Arc::default(),
            parsed: Arc::default(),
        }
    }

    /// An engine of a cluster node: selectors (and the `series`, `labels`
    /// and `label values` endpoints) read the whole cluster through
    /// `reader`. Evaluation must run on a blocking thread (the HTTP API
    /// does), since a select waits for peers.
    pub fn with_cluster(reader: ClusterReader, limits: PromLimits) -> Self {
        Self {
            storage: reader.storage().clone(),
            rollup_tiers: true,
            source: Source::Cluster(reader),
            limits,
            metrics: Arc::default(),
            guard: Arc::default(),
            parsed: Arc::default(),
        }
    }

    /// This engine, evaluating every range function from raw samples (the
    /// reference of the rollup tiers' differential test).
    pub fn without_rollup_tiers(mut self) -> Self {
        self.rollup_tiers = false;
        self
    }

    /// This node's storage, when it answers alone (not a cluster) and range
    /// functions may be answered from rollup tiers.
    pub(crate) fn tier_storage(&self) -> Option<&Arc<Storage>> {
        match &self.source {
            Source::Local(s) if self.rollup_tiers => Some(s),
            _ => None,
        }
    }

    /// Whether this engine reads one node's storage, whole or the series of
    /// some of its shards (a node's part of a pushdown), not a cluster,
    /// whose answer can hold two series with one label set. Such an engine
    /// takes the aggregations' shortcuts that read each series with only
    /// its group's labels: the pushdown's part on each node took the long
    /// way before, building every series' whole label set (`perf` of a
    /// pushed-down `avg`, 2026-12-07).
    pub(crate) fn is_local(&self) -> bool {
        matches!(self.source, Source::Local(_) | Source::Shards(..))
    }

    /// Selects series for a query (this node's storage, or the cluster).
    pub(crate) fn select(
        &self,
        matchers: &[storage::Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, PromError> {
        Ok(self.source.select_blocking(matchers, min_ts, max_ts)?)
    }

    /// Each matching series' newest sample in `[min_ts, max_ts]` from this
    /// node's storage; `None` in a cluster (see [`crate::cluster::Source`]).
    pub(crate) fn newest(
        &self,
        matchers: &[storage::Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Option<Vec<(storage::KeyArc, storage::Newest)>> {
        self.source.newest_blocking(matchers, min_ts, max_ts)
    }

    /// Selects series for their label sets only (their samples must not be
    /// read: in cluster mode peers send none).
    pub(crate) fn series(
        &self,
        matchers: &[storage::Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, PromError> {
        Ok(self.source.series_blocking(matchers, min_ts, max_ts)?)
    }

    /// Applies `guard`'s query limits (one guard per node, shared by every
    /// query surface) instead of a default one of this engine's own.
    pub fn with_guard(mut self, guard: Arc<crate::limits::QueryGuard>) -> Self {
        self.guard = guard;
        self
    }

    /// The query limits: length and depth are checked by every evaluation;
    /// the HTTP API runs evaluations through it (slot, thread, deadline).
    pub fn guard(&self) -> &Arc<crate::limits::QueryGuard> {
        &self.guard
    }

    /// Parses `query` within the length and depth limits.
    pub(crate) fn parse(&self, query: &str) -> Result<Arc<Expr>, PromError> {
        self.guard.check_length(query).map_err(PromError::Refused)?;
        let expr = self.parsed.parse(query)?;
        self.guard.check_promql(&expr).map_err(PromError::Refused)?;
        Ok(expr)
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

    /// Evaluates `query` at `time_ms`.
    ///
    /// # Errors
    /// [`PromError`]: parse errors, unsupported constructs, limits; and,
    /// in cluster mode, an answer that would lack a shard
    /// ([`PromError::Unavailable`]): [`Self::instant_answer`] returns those
    /// with their warnings.
    pub fn instant(&self, query: &str, time_ms: i64) -> Result<PromValue, PromError> {
        complete(self.instant_answer(query, time_ms)?)
    }

    /// Evaluates `query` at `time_ms` (`/api/v1/query`), with the warnings
    /// of an incomplete answer.
    ///
    /// # Errors
    /// [`PromError`]: parse errors, unsupported constructs, limits.
    pub fn instant_answer(&self, query: &str, time_ms: i64) -> Result<Answer, PromError> {
        self.instant_answer_until(query, time_ms, crate::limits::Deadline::never())
    }

    /// [`Self::instant_answer`] that stops at `deadline`.
    ///
    /// # Errors
    /// As [`Self::instant_answer`], and [`PromError::Refused`] at the deadline.
    pub fn instant_answer_until(
        &self,
        query: &str,
        time_ms: i64,
        deadline: crate::limits::Deadline,
    ) -> Result<Answer, PromError> {
        let started = std::time::Instant::now();
        let result = self.run_instant(query, time_ms, deadline);
        self.metrics.observe(started.elapsed(), result.is_ok());
        self.count_timeout(&result);
        result
    }

    fn count_timeout<T>(&self, result: &Result<T, PromError>) {
        if let Err(PromError::Refused(crate::limits::Refusal::Timeout { .. })) = result {
            self.guard.count_timeout();
        }
    }

    fn run_instant(
        &self,
        query: &str,
        time_ms: i64,
        deadline: crate::limits::Deadline,
    ) -> Result<Answer, PromError> {
        check_time(time_ms)?;
        let expr = self.parse(query)?;
        let ev = eval::Evaluator::new(self, time_ms, time_ms, 0, deadline)?;
        let value = ev.instant(&expr)?;
        Ok(Answer {
            value,
            warnings: ev.warnings(),
            notes: ev.notes(),
        })
    }

    /// Evaluates `query` at `start_ms`, `start_ms + step_ms`, ... `<= end_ms`.
    ///
    /// # Errors
    /// [`PromError`]: a bad range or step, parse errors, unsupported
    /// constructs, limits; in cluster mode, an incomplete answer, as
    /// [`Self::instant`].
    pub fn range(
        &self,
        query: &str,
        start_ms: i64,
        end_ms: i64,
        step_ms: i64,
    ) -> Result<PromValue, PromError> {
        complete(self.range_answer(query, start_ms, end_ms, step_ms)?)
    }

    /// Evaluates `query` at `start_ms`, `start_ms + step_ms`, ... `<= end_ms`
    /// (`/api/v1/query_range`), with the warnings of an incomplete answer.
    ///
    /// # Errors
    /// [`PromError`]: a bad range or step, parse errors, unsupported
    /// constructs, limits.
    pub fn range_answer(
        &self,
        query: &str,
        start_ms: i64,
        end_ms: i64,
        step_ms: i64,
    ) -> Result<Answer, PromError> {
        self.range_answer_until(
            query,
            start_ms,
            end_ms,
            step_ms,
            crate::limits::Deadline::never(),
        )
    }

    /// [`Self::range_answer`] that stops at `deadline`.
    ///
    /// # Errors
    /// As [`Self::range_answer`], and [`PromError::Refused`] at the deadline.
    pub fn range_answer_until(
        &self,
        query: &str,
        start_ms: i64,
        end_ms: i64,
        step_ms: i64,
        deadline: crate::limits::Deadline,
    ) -> Result<Answer, PromError> {
        let started = std::time::Instant::now();
        let result = self.run_range(query, start_ms, end_ms, step_ms, deadline);
        self.metrics.observe(started.elapsed(), result.is_ok());
        self.count_timeout(&result);
        result
    }

    fn run_range(
        &self,
        query: &str,
        start_ms: i64,
        end_ms: i64,
        step_ms: i64,
        deadline: crate::limits::Deadline,
    ) -> Result<Answer, PromError> {
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
        let expr = self.parse(query)?;
        let ev = eval::Evaluator::new(self, start_ms, end_ms, step_ms, deadline)?;
        let value = ev.range(&expr)?;
        Ok(Answer {
            value,
            warnings: ev.warnings(),
            notes: ev.notes(),
        })
    }
}

/// The value of a complete answer; an incomplete one is an error.
fn complete(a: Answer) -> Result<PromValue, PromError> {
    if a.warnings.is_empty() {
        Ok(a.value)
    } else {
        Err(PromError::Unavailable(a.warnings.join("; ")))
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

/// [`parse`] through a process-wide [`ParseCache`]: the texts of the
/// cluster pushdown, which the asking node parses back to check them and
/// then evaluates over its own shards, and each peer evaluates, at every
/// refresh of a dashboard (their regular expressions compiled each time
/// were 8 % of the asking node's CPU for a pushed-down `avg`, `perf`).
pub(crate) fn parse_shared(query: &str) -> Result<Arc<Expr>, PromError> {
    static CACHE: std::sync::LazyLock<ParseCache> = std::sync::LazyLock::new(ParseCache::default);
    CACHE.parse(query)
}

/// Parses a PromQL expression; errors are `bad_data`.
pub(crate) fn parse(query: &str) -> Result<promql_parser::parser::Expr, PromError> {
    promql_parser::parser::parse(query)
        .map_err(|e| PromError::BadData(format!("invalid parameter \"query\": {e}")))
}

/// A label set from a stored series key: `__name__` plus the labels, sorted.
pub(crate) fn labels_of(key: &storage::SeriesKey) -> LabelSet {
    let mut out = unnamed_labels_of(key);
    let at = out.partition_point(|(n, _)| n.as_str() < value::METRIC_NAME);
    out.insert(at, name_label(key.metric()));
    out
}

/// The label `__name__="<metric>"`, from one copy per thread of the name and
/// of the last metric asked for: the series of a selector share their
/// metric's string instead of an allocation each, and a thread's clones
/// count on its own copies.
pub(crate) fn name_label(metric: &str) -> (Sym, Sym) {
    thread_local! {
        static NAMES: std::cell::RefCell<(Sym, Sym)> =
            std::cell::RefCell::new((Sym::from(value::METRIC_NAME), Sym::default()));
    }
    NAMES.with(|names| {
        let mut names = names.borrow_mut();
        if names.1 != metric {
            names.1 = Sym::from(metric);
        }
        names.clone()
    })
}

/// [`labels_of`] without `__name__`: what a function that drops the name
/// gives, without making the named set first.
pub(crate) fn unnamed_labels_of(key: &storage::SeriesKey) -> LabelSet {
    let mut out: LabelSet = Vec::with_capacity(key.labels().len() + 1);
    out.extend(
        key.labels()
            .iter()
            .map(|l| (l.name.clone(), l.value.clone())),
    );
    // A key's labels are sorted by name, each name once
    // (`SeriesKey::labels`).
    debug_assert!(out.is_sorted_by(|a, b| a.0 < b.0));
    out
}

#[cfg(test)]
mod tests;
