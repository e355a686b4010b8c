//! gpulse read path: DataFusion tables over [`storage`], the HTTP query API
//! and the PostgreSQL wire protocol.
//!
//! [`QueryEngine`] owns a DataFusion `SessionContext` with the `samples` table
//! ([`samples`]), the rollup tables `rollup_1m`, `rollup_1h`, `rollup_1d` and
//! the tier-picking function `rollup(start, end, step)` ([`rollups`]), the
//! `gpus` inventory ([`gpus`]) and a `pg_catalog` schema (so
//! that PostgreSQL clients can list tables); [`http::router`] serves
//! `POST /api/v1/sql` and [`pg::serve`] the PostgreSQL protocol on top of it.
//! Queries are read-only: DDL, DML and SET statements are refused. Results
//! larger than the engine's [`ResultLimits`] fail instead of filling memory.
//!
//! In a cluster ([`cluster`]), an engine made with
//! [`QueryEngine::with_cluster`] reads `samples` from every node, and a
//! result that lacks a shard says so in [`QueryResult::warnings`].

pub mod cluster;
pub mod gpus;
pub mod health_events;
pub mod http;
pub mod limits;
pub mod pg;
pub mod promql;
mod pushdown;
pub mod readonly;
pub mod remote_read;
pub mod rollups;
pub mod samples;
mod sql_pushdown;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::error::DataFusionError;
use datafusion::execution::{SessionStateBuilder, TaskContext};
use datafusion::physical_plan::execute_stream;
use datafusion::prelude::{SessionConfig, SessionContext};
use futures::StreamExt;
use storage::Storage;

/// A SQL query failed. Maps to an HTTP status in [`http`].
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The query is invalid: parse, plan or type errors (HTTP 400).
    #[error("{0}")]
    BadQuery(DataFusionError),
    /// The query was valid but failed while running (HTTP 500).
    #[error("{0}")]
    Execution(DataFusionError),
    /// The result is larger than [`ResultLimits`] allows (HTTP 422).
    #[error("{0}")]
    TooLarge(LimitExceeded),
    /// The cluster cannot answer: a peer runs with another cluster file
    /// (HTTP 503).
    #[error("{0}")]
    Unavailable(String),
    /// The statement would write: DDL, DML, COPY, SET, PREPARE
    /// ([`readonly`]; HTTP 400).
    #[error("{0}")]
    ReadOnly(readonly::Refusal),
    /// A query limit refused or stopped the query ([`limits::QueryLimits`]).
    #[error("{0}")]
    Refused(limits::Refusal),
}

/// How large one query's result may be. Both front ends (HTTP and the
/// PostgreSQL protocol) enforce the same limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultLimits {
    /// Most rows of one result (default 1,000,000).
    pub max_rows: u64,
    /// Most bytes of one result (default 1 GiB): Arrow memory of the
    /// batches over HTTP, encoded row bytes over the PostgreSQL protocol.
    pub max_bytes: u64,
}

impl Default for ResultLimits {
    fn default() -> Self {
        Self {
            max_rows: 1_000_000,
            max_bytes: 1 << 30,
        }
    }
}

/// A result passed one of the [`ResultLimits`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitExceeded {
    #[error(
        "the result has more than {limit} rows (--max-result-rows); add a LIMIT, a WHERE on ts, or aggregate"
    )]
    Rows { limit: u64 },
    #[error(
        "the result is larger than {limit} bytes (--max-result-bytes); select fewer columns or rows, or aggregate"
    )]
    Bytes { limit: u64 },
    #[error(
        "the query reads more than {limit} samples from other nodes of the cluster; narrow the time range or the labels"
    )]
    PeerSamples { limit: u64 },
}

/// Counts what a result has produced so far against [`ResultLimits`].
#[derive(Debug)]
pub struct LimitCounter {
    limits: ResultLimits,
    rows: u64,
    bytes: u64,
}

impl LimitCounter {
    pub fn new(limits: ResultLimits) -> Self {
        Self {
            limits,
            rows: 0,
            bytes: 0,
        }
    }

    /// Adds `rows` rows of `bytes` bytes.
    ///
    /// # Errors
    /// The limit that the totals now pass.
    pub fn add(&mut self, rows: u64, bytes: u64) -> Result<(), LimitExceeded> {
        self.rows = self.rows.saturating_add(rows);
        self.bytes = self.bytes.saturating_add(bytes);
        if self.rows > self.limits.max_rows {
            return Err(LimitExceeded::Rows {
                limit: self.limits.max_rows,
            });
        }
        if self.bytes > self.limits.max_bytes {
            return Err(LimitExceeded::Bytes {
                limit: self.limits.max_bytes,
            });
        }
        Ok(())
    }
}

/// The physical plan `EXPLAIN` prints for `sql` (for tests of pushdown).
#[cfg(test)]
pub(crate) async fn physical_plan(engine: &QueryEngine, sql: &str) -> String {
    let r = engine.sql(&format!("EXPLAIN {sql}")).await.unwrap();
    let v = http::to_json(&r).unwrap();
    let rows = v["rows"].as_array().unwrap();
    rows.iter()
        .find(|r| r[0] == "physical_plan")
        .unwrap_or_else(|| panic!("no physical plan in {rows:?}"))[1]
        .as_str()
        .unwrap()
        .to_string()
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        if let DataFusionError::External(inner) = e.find_root()
            && let Some(c) = inner.downcast_ref::<cluster::ClusterError>()
        {
            match c {
                cluster::ClusterError::Refused(m) => return QueryError::Unavailable(m.clone()),
                cluster::ClusterError::TooLarge(l) => return QueryError::TooLarge(l.clone()),
                cluster::ClusterError::Internal(_) => {}
            }
        }
        match e.find_root() {
            DataFusionError::SQL(..)
            | DataFusionError::Plan(_)
            | DataFusionError::SchemaError(..)
            | DataFusionError::NotImplemented(_) => QueryError::BadQuery(e),
            _ => QueryError::Execution(e),
        }
    }
}

/// The result of a query: its schema and batches, and why it may be
/// incomplete (cluster mode: shards that no replica could serve).
#[derive(Debug, Clone)]
pub struct QueryResult {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
    /// Empty when the result is complete.
    pub warnings: Vec<String>,
}

impl QueryResult {
    pub fn num_rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

/// Upper bounds (seconds) of the query latency histogram's buckets.
const LATENCY_BUCKETS: [f64; 10] = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0];

/// Counts and times queries, for `/metrics`: the SQL queries of
/// [`QueryEngine::sql`] and the PromQL ones of [`promql::PromEngine`].
#[derive(Debug, Default)]
pub struct QueryMetrics {
    /// Cumulative counts per bucket of [`LATENCY_BUCKETS`] (the last: all).
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    /// Sum of the latencies in microseconds.
    sum_us: AtomicU64,
    /// Queries refused as invalid or too large, or failed while running.
    pub failed: AtomicU64,
    /// PromQL range functions answered from a rollup tier instead of raw
    /// samples (`promql::tiers`).
    pub rollup_tier_answers: AtomicU64,
}

impl QueryMetrics {
    pub(crate) fn observe(&self, took: std::time::Duration, ok: bool) {
        let s = took.as_secs_f64();
        for (i, &le) in LATENCY_BUCKETS.iter().enumerate() {
            if s <= le {
                self.buckets[i].fetch_add(1, Relaxed);
            }
        }
        self.buckets[LATENCY_BUCKETS.len()].fetch_add(1, Relaxed);
        self.sum_us
            .fetch_add(took.as_micros().try_into().unwrap_or(u64::MAX), Relaxed);
        if !ok {
            self.failed.fetch_add(1, Relaxed);
        }
    }

    /// Appends the histogram and counters in the Prometheus text format, as
    /// `gpulse_<kind>_query_duration_seconds` and
    /// `gpulse_<kind>_queries_failed_total`.
    pub fn render(&self, out: &mut String, kind: &str) {
        use std::fmt::Write as _;
        let name = format!("gpulse_{kind}_query_duration_seconds");
        let _ = writeln!(
            out,
            "# HELP {name} Time to plan and run a {kind} query over HTTP.\n# TYPE {name} histogram"
        );
        for (i, le) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{le}\"}} {}",
                self.buckets[i].load(Relaxed)
            );
        }
        let count = self.buckets[LATENCY_BUCKETS.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_us.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count {count}");
        let failed = format!("gpulse_{kind}_queries_failed_total");
        let _ = writeln!(
            out,
            "# HELP {failed} {kind} queries over HTTP that failed or were refused.\n# TYPE {failed} counter\n{failed} {}",
            self.failed.load(Relaxed)
        );
        if kind == "promql" {
            let tier = "gpulse_promql_rollup_tier_answers_total";
            let _ = writeln!(
                out,
                "# HELP {tier} PromQL range functions answered from a rollup tier instead of raw samples.\n# TYPE {tier} counter\n{tier} {}",
                self.rollup_tier_answers.load(Relaxed)
            );
        }
    }
}

/// Runs SQL over the tables of one storage, or of the whole cluster.
#[derive(Clone)]
pub struct QueryEngine {
    ctx: Arc<SessionContext>,
    limits: ResultLimits,
    metrics: Arc<QueryMetrics>,
    guard: Arc<limits::QueryGuard>,
    readonly: Arc<readonly::ReadOnlyMetrics>,
    /// A cluster node's reader: tables of node-local state read through it
    /// or warn.
    reader: Option<cluster::ClusterReader>,
}

impl std::fmt::Debug for QueryEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryEngine")
            .field("session", &self.ctx.session_id())
            .finish()
    }
}

impl QueryEngine {
    /// An engine with the default [`ResultLimits`].
    pub fn new(storage: Arc<Storage>) -> Self {
        Self::with_limits(storage, ResultLimits::default())
    }

    pub fn with_limits(storage: Arc<Storage>, limits: ResultLimits) -> Self {
        Self::build(storage.clone(), cluster::Source::Local(storage), limits)
    }

    /// An engine of a cluster node: `samples` holds the whole cluster's
    /// samples, read through `reader` (made over this node's `storage`).
    /// The rollup tables and `rollup(…)` read the cluster's rollups too
    /// ([`cluster::ClusterReader::rollups`]). Results that lack a shard carry
    /// [`QueryResult::warnings`]; the HTTP API shows them, PostgreSQL
    /// clients get them as notices. `gpus` reads this node's inventory alone
    /// and says so in a warning.
    pub fn with_cluster(
        storage: Arc<Storage>,
        limits: ResultLimits,
        reader: cluster::ClusterReader,
    ) -> Self {
        Self::build(storage, cluster::Source::Cluster(reader), limits)
    }

    fn build(storage: Arc<Storage>, source: cluster::Source, limits: ResultLimits) -> Self {
        let config = SessionConfig::new().with_information_schema(true);
        let (clustered, reader) = match &source {
            cluster::Source::Local(_) | cluster::Source::Shards(..) => (false, None),
            cluster::Source::Cluster(r) => (true, Some(r.clone())),
        };
        let mut state = SessionStateBuilder::new()
            .with_config(config)
            .with_default_features()
            .build();
        if let Some(r) = &reader {
            // Aggregates over `samples` run where the data is: first, on the
            // plan as written, for every surface ([`sql_pushdown`]).
            let mut rules = state.optimizers().to_vec();
            rules.insert(0, Arc::new(sql_pushdown::SqlPushdown::new(r.clone())));
            state = SessionStateBuilder::new_from_existing(state)
                .with_optimizer_rules(rules)
                .build();
        }
        let ctx = SessionContext::new_with_state(state);
        ctx.register_table("samples", Arc::new(samples::SamplesTable::over(source)))
            .expect("BUG: registering a table in a fresh context");
        ctx.register_table(
            "gpus",
            Arc::new(gpus::GpusTable::new(storage.clone()).local_in_cluster(clustered)),
        )
        .expect("BUG: registering a table in a fresh context");
        for tier in storage::RollupTier::ALL {
            ctx.register_table(
                rollups::table_name(tier),
                Arc::new(
                    rollups::RollupTable::new(storage.clone(), tier).in_cluster(reader.clone()),
                ),
            )
            .expect("BUG: registering a table in a fresh context");
        }
        ctx.register_udtf(
            "rollup",
            Arc::new(rollups::RollupFunction::new(storage).in_cluster(reader.clone())),
        );
        // pg_catalog.pg_class, pg_namespace, pg_attribute, ... and the
        // functions psql's \dt and \d call (pg_table_is_visible, format_type).
        // They read the context's catalog, so they list `samples` as it is.
        pg::setup_catalog(&ctx);
        Self {
            ctx: Arc::new(ctx),
            limits,
            metrics: Arc::default(),
            guard: Arc::default(),
            readonly: Arc::default(),
            reader,
        }
    }

    /// Registers the `health_events` table over the node's health engine
    /// ([`health_events`]). In cluster mode it lists the whole cluster's
    /// events, each shard's from one of its owners.
    pub fn with_health(self, source: Arc<dyn health_events::HealthSource>) -> Self {
        self.ctx
            .register_table(
                "health_events",
                Arc::new(health_events::HealthEventsTable::new(
                    source,
                    self.reader.clone(),
                )),
            )
            .expect("BUG: registering a table that is not there yet");
        self
    }

    /// Statements refused by the read-only guard, per protocol.
    pub fn readonly_metrics(&self) -> &Arc<readonly::ReadOnlyMetrics> {
        &self.readonly
    }

    /// Applies `guard`'s query limits (one guard per node, shared by every
    /// query surface) instead of a default one of this engine's own.
    pub fn with_guard(mut self, guard: Arc<limits::QueryGuard>) -> Self {
        self.guard = guard;
        self
    }

    pub fn guard(&self) -> &Arc<limits::QueryGuard> {
        &self.guard
    }

    pub fn metrics(&self) -> &Arc<QueryMetrics> {
        &self.metrics
    }

    pub fn limits(&self) -> ResultLimits {
        self.limits
    }

    /// The DataFusion context, for protocol front ends.
    pub fn context(&self) -> &Arc<SessionContext> {
        &self.ctx
    }

    /// Plans and runs one read-only SQL statement.
    ///
    /// # Errors
    /// [`QueryError::BadQuery`] for invalid SQL; [`QueryError::ReadOnly`]
    /// for a statement that would change anything ([`readonly`]); [`QueryError::Execution`] when running fails;
    /// [`QueryError::TooLarge`] as soon as the result passes the limits (the
    /// query stops there).
    ///
    /// The query runs on the query runtime under the engine's
    /// [`limits::QueryLimits`]: [`QueryError::Refused`] when it is too long
    /// or deep, takes too long, or needs too much memory.
    pub async fn sql(&self, query: &str) -> Result<QueryResult, QueryError> {
        let started = std::time::Instant::now();
        let (this, query) = (self.clone(), query.to_owned());
        let result = self
            .guard
            .spawn(async move {
                // Checked on a query thread: the parse and the walk run
                // where a deep tree has room.
                this.guard.check_sql(&query).map_err(QueryError::Refused)?;
                let (result, warnings) = cluster::collect_sql_warnings(this.run_sql(&query)).await;
                result
                    .map(|r| QueryResult { warnings, ..r })
                    .map_err(|e| match e {
                        QueryError::Execution(df) => match this.guard.memory_refusal(&df) {
                            Some(r) => QueryError::Refused(r),
                            None => QueryError::Execution(df),
                        },
                        e => e,
                    })
            })
            .await
            .unwrap_or_else(|r| Err(QueryError::Refused(r)));
        self.metrics.observe(started.elapsed(), result.is_ok());
        result
    }

    async fn run_sql(&self, query: &str) -> Result<QueryResult, QueryError> {
        // One copy of the session state, planned in and executed with a
        // runtime of its own (the memory pool of this query alone). A
        // context built for each query re-registered every function, and
        // DataFusion's own path copies the state three more times: a fifth
        // of a small query's CPU (docs/BENCHMARKS.md).
        let state = self.ctx.state();
        // Read-only by plan: the plan checked is the plan that runs. What
        // is left after the check is a query, which
        // `SessionContext::execute_logical_plan` would plan as this does.
        let plan = readonly::plan_sql(&state, query, &self.readonly).await?;
        let schema: SchemaRef = Arc::new(plan.schema().as_arrow().clone());
        let physical = state.create_physical_plan(&plan).await?;
        let task = TaskContext::from(&state).with_runtime(self.guard.runtime());
        let mut stream = execute_stream(physical, Arc::new(task))?;
        let mut counter = LimitCounter::new(self.limits);
        let mut batches = Vec::new();
        while let Some(batch) = stream.next().await {
            let batch = batch?;
            counter
                .add(
                    batch.num_rows() as u64,
                    batch.get_array_memory_size() as u64,
                )
                .map_err(QueryError::TooLarge)?;
            batches.push(batch);
        }
        Ok(QueryResult {
            schema,
            batches,
            warnings: Vec::new(),
        })
    }
}
