//! Limits that every query surface shares: HTTP SQL, the PostgreSQL
//! protocol, PromQL, remote read and Arrow Flight.
//!
//! - **Length and depth.** A query longer than [`QueryLimits::max_length`]
//!   bytes, or whose expression tree is deeper than
//!   [`QueryLimits::max_depth`], is refused before it is planned. The depth
//!   is measured on the parsed tree by a walk that stops at the limit, so
//!   nothing recurses past it: `1+1+…+1` with 3,000 terms is a clear error
//!   (HTTP 400, SQLSTATE 54001), not a stack overflow that takes the node
//!   down.
//! - **Where queries run.** Queries run on their own runtime
//!   ([`QueryGuard::spawn`], [`QueryGuard::spawn_blocking`]), whose threads
//!   have [`QUERY_STACK_BYTES`] of stack, apart from the runtime that
//!   ingests. A query that passes the depth limit cannot overflow them, and
//!   a heavy one does not take worker threads from ingest.
//! - **Time.** A query that has not finished after [`QueryLimits::timeout`]
//!   (waiting for a slot included) is stopped: DataFusion's streams are
//!   dropped, and the PromQL evaluator checks its [`Deadline`] between steps.
//!   HTTP 503 `timeout` (as Prometheus), SQLSTATE 57014.
//! - **Concurrency.** At most [`QueryLimits::max_concurrent`] queries run at
//!   once over all surfaces; the others wait for a slot within their time.
//! - **Memory.** Each SQL query gets a DataFusion memory pool of
//!   [`QueryLimits::memory_limit`] bytes ([`QueryGuard::session`]); an
//!   operator that needs more fails the query (HTTP 422, SQLSTATE 53200).
//!   Queries never spill to disk. PromQL has its own cap on samples held
//!   (`--query-max-samples`).
//!
//! Every refusal is counted in [`GuardMetrics`], rendered in `/metrics` as
//! `gpulse_query_refused_total{reason}`.

use std::future::Future;
use std::num::NonZeroUsize;
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use datafusion::execution::disk_manager::{DiskManagerBuilder, DiskManagerMode};
use datafusion::execution::memory_pool::{GreedyMemoryPool, TrackConsumersPool};
use datafusion::execution::runtime_env::{RuntimeEnv, RuntimeEnvBuilder};
use datafusion::execution::session_state::SessionStateBuilder;
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::{CopyToSource, DFParserBuilder, Statement as DfStatement};
use datafusion::sql::sqlparser::ast::{Expr as SqlExpr, Query, Visit, Visitor};
use tokio::sync::Semaphore;

/// Stack of each query thread. Reserved address space, not memory: only
/// the pages a query touches are backed.
pub const QUERY_STACK_BYTES: usize = 64 << 20;

/// The limits of one node's queries. Each is a `serve` flag (docs/LIMITS.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryLimits {
    /// Longest query text in bytes (`--max-query-length`, 64 KiB).
    pub max_length: usize,
    /// Deepest expression tree (`--max-query-depth`, 256): nested
    /// operators, function calls and subqueries.
    pub max_depth: usize,
    /// Longest a query may take, waiting for a slot included
    /// (`--query-timeout`, 2 minutes as Prometheus).
    pub timeout: Duration,
    /// Most queries running at once over every surface
    /// (`--max-concurrent-queries`, 20 as Prometheus).
    pub max_concurrent: usize,
    /// Most memory DataFusion's operators may reserve for one SQL query
    /// (`--query-memory-limit`, 1 GiB).
    pub memory_limit: usize,
}

impl Default for QueryLimits {
    fn default() -> Self {
        Self {
            max_length: 64 << 10,
            max_depth: 256,
            timeout: Duration::from_secs(120),
            max_concurrent: 20,
            memory_limit: 1 << 30,
        }
    }
}

/// Why a query was refused or stopped by a [`QueryLimits`] limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("the query is {len} bytes long, over the limit of {limit} (--max-query-length)")]
    TooLong { len: usize, limit: usize },
    #[error(
        "the query's expressions are nested more than {limit} deep (--max-query-depth); split it or use fewer nested operators"
    )]
    TooDeep { limit: usize },
    #[error("the query took longer than {}s (--query-timeout){}", limit.as_secs_f64(), if *waited { "; it waited for a free query slot (--max-concurrent-queries)" } else { "" })]
    Timeout { limit: Duration, waited: bool },
    #[error(
        "the query needs more than {limit} bytes of memory (--query-memory-limit); aggregate over fewer groups, add a WHERE on ts, or select fewer rows: {detail}"
    )]
    Memory { limit: usize, detail: String },
    #[error("the query failed to run: {0}")]
    Internal(String),
}

impl Refusal {
    /// The PostgreSQL SQLSTATE of this refusal.
    pub fn sqlstate(&self) -> &'static str {
        match self {
            // statement_too_complex
            Self::TooLong { .. } | Self::TooDeep { .. } => "54001",
            // query_canceled
            Self::Timeout { .. } => "57014",
            // out_of_memory
            Self::Memory { .. } => "53200",
            Self::Internal(_) => "XX000",
        }
    }

    /// The HTTP status of this refusal.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::TooLong { .. } | Self::TooDeep { .. } => 400,
            Self::Timeout { .. } => 503,
            Self::Memory { .. } => 422,
            Self::Internal(_) => 500,
        }
    }

    /// The Prometheus `errorType` of this refusal.
    pub fn error_type(&self) -> &'static str {
        match self {
            Self::TooLong { .. } | Self::TooDeep { .. } => "bad_data",
            Self::Timeout { .. } => "timeout",
            Self::Memory { .. } => "too_large",
            Self::Internal(_) => "internal",
        }
    }
}

/// The message DataFusion gives a query that passed its memory pool, so
/// that front ends can tell it from other failures.
pub fn is_memory_exhausted(e: &datafusion::error::DataFusionError) -> bool {
    matches!(
        e.find_root(),
        datafusion::error::DataFusionError::ResourcesExhausted(_)
    )
}

/// Counters of the query limits, for `/metrics`.
#[derive(Debug, Default)]
pub struct GuardMetrics {
    pub too_long: AtomicU64,
    pub too_deep: AtomicU64,
    pub timeout: AtomicU64,
    pub memory: AtomicU64,
    /// Queries holding a slot now.
    pub running: AtomicI64,
    /// Queries waiting for a slot now.
    pub waiting: AtomicI64,
}

impl GuardMetrics {
    fn count(&self, r: &Refusal) {
        let c = match r {
            Refusal::TooLong { .. } => &self.too_long,
            Refusal::TooDeep { .. } => &self.too_deep,
            Refusal::Timeout { .. } => &self.timeout,
            Refusal::Memory { .. } => &self.memory,
            Refusal::Internal(_) => return,
        };
        c.fetch_add(1, Relaxed);
    }

    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(
            out,
            "# HELP gpulse_query_refused_total Queries refused or stopped by a query limit (docs/LIMITS.md).\n# TYPE gpulse_query_refused_total counter"
        );
        for (reason, c) in [
            ("too_long", &self.too_long),
            ("too_deep", &self.too_deep),
            ("timeout", &self.timeout),
            ("memory", &self.memory),
        ] {
            let _ = writeln!(
                out,
                "gpulse_query_refused_total{{reason=\"{reason}\"}} {}",
                c.load(Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP gpulse_queries_running Queries holding a query slot (--max-concurrent-queries).\n# TYPE gpulse_queries_running gauge\ngpulse_queries_running {}",
            self.running.load(Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP gpulse_queries_waiting Queries waiting for a query slot.\n# TYPE gpulse_queries_waiting gauge\ngpulse_queries_waiting {}",
            self.waiting.load(Relaxed)
        );
    }
}

/// When a query must stop. PromQL's evaluator checks it between steps.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    limit: Duration,
}

impl Deadline {
    pub fn after(limit: Duration) -> Self {
        Self {
            at: Instant::now() + limit,
            limit,
        }
    }

    /// A deadline that never passes (direct calls, tests).
    pub fn never() -> Self {
        Self::after(Duration::from_secs(100 * 365 * 24 * 3600))
    }

    /// The timeout this deadline was set with.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// # Errors
    /// [`Refusal::Timeout`] once the deadline has passed.
    pub fn check(&self) -> Result<(), Refusal> {
        if Instant::now() >= self.at {
            Err(Refusal::Timeout {
                limit: self.limit,
                waited: false,
            })
        } else {
            Ok(())
        }
    }

    pub fn instant(&self) -> tokio::time::Instant {
        self.at.into()
    }
}

/// A query slot: dropping it lets the next waiting query run.
#[derive(Debug)]
pub struct Slot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    metrics: Arc<GuardMetrics>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.metrics.running.fetch_sub(1, Relaxed);
    }
}

/// The query runtime; shut down without waiting when the guard goes, since
/// a runtime may not be dropped inside another one.
struct QueryRuntime(Option<tokio::runtime::Runtime>);

impl Drop for QueryRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Applies [`QueryLimits`]: one per node, shared by every query surface.
pub struct QueryGuard {
    limits: QueryLimits,
    slots: Arc<Semaphore>,
    metrics: Arc<GuardMetrics>,
    runtime: OnceLock<QueryRuntime>,
}

impl std::fmt::Debug for QueryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryGuard")
            .field("limits", &self.limits)
            .finish()
    }
}

impl Default for QueryGuard {
    fn default() -> Self {
        Self::new(QueryLimits::default())
    }
}

impl QueryGuard {
    pub fn new(limits: QueryLimits) -> Self {
        Self {
            limits,
            slots: Arc::new(Semaphore::new(limits.max_concurrent.max(1))),
            metrics: Arc::default(),
            runtime: OnceLock::new(),
        }
    }

    pub fn limits(&self) -> &QueryLimits {
        &self.limits
    }

    pub fn metrics(&self) -> &Arc<GuardMetrics> {
        &self.metrics
    }

    /// The refusal for a DataFusion error from the memory pool, counted;
    /// `None` for any other error.
    pub fn memory_refusal(&self, e: &datafusion::error::DataFusionError) -> Option<Refusal> {
        if !is_memory_exhausted(e) {
            return None;
        }
        let r = Refusal::Memory {
            limit: self.limits.memory_limit,
            detail: e.find_root().to_string(),
        };
        self.metrics.count(&r);
        Some(r)
    }

    fn refuse<T>(&self, r: Refusal) -> Result<T, Refusal> {
        self.metrics.count(&r);
        Err(r)
    }

    /// The query runtime's handle, started on first use: one worker per
    /// core, threads named `gpulse-query` with [`QUERY_STACK_BYTES`] of stack.
    pub fn handle(&self) -> tokio::runtime::Handle {
        self.runtime
            .get_or_init(|| {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .thread_name("gpulse-query")
                    .thread_stack_size(QUERY_STACK_BYTES)
                    .enable_all()
                    .build()
                    .expect("BUG: cannot start the query runtime (out of threads?)");
                QueryRuntime(Some(rt))
            })
            .0
            .as_ref()
            .expect("BUG: the query runtime is present until drop")
            .handle()
            .clone()
    }

    /// Refuses `text` if it is longer than the limit.
    ///
    /// # Errors
    /// [`Refusal::TooLong`].
    pub fn check_length(&self, text: &str) -> Result<(), Refusal> {
        if text.len() > self.limits.max_length {
            return self.refuse(Refusal::TooLong {
                len: text.len(),
                limit: self.limits.max_length,
            });
        }
        Ok(())
    }

    /// Refuses SQL that is too long or nested too deep. Parse errors pass:
    /// DataFusion reports them with its own message when it plans.
    ///
    /// # Errors
    /// [`Refusal::TooLong`], [`Refusal::TooDeep`].
    pub fn check_sql(&self, sql: &str) -> Result<(), Refusal> {
        self.check_length(sql)?;
        if sql_depth_exceeds(sql, self.limits.max_depth) {
            return self.refuse(Refusal::TooDeep {
                limit: self.limits.max_depth,
            });
        }
        Ok(())
    }

    /// Refuses a parsed PromQL expression nested too deep.
    ///
    /// # Errors
    /// [`Refusal::TooDeep`].
    pub fn check_promql(&self, expr: &promql_parser::parser::Expr) -> Result<(), Refusal> {
        if promql_depth(expr) > self.limits.max_depth {
            return self.refuse(Refusal::TooDeep {
                limit: self.limits.max_depth,
            });
        }
        Ok(())
    }

    /// A deadline [`QueryLimits::timeout`] from now.
    pub fn deadline(&self) -> Deadline {
        Deadline::after(self.limits.timeout)
    }

    /// Waits for a query slot until `deadline`.
    ///
    /// # Errors
    /// [`Refusal::Timeout`] if no slot came free in time.
    pub async fn slot(&self, deadline: Deadline) -> Result<Slot, Refusal> {
        self.metrics.waiting.fetch_add(1, Relaxed);
        let got =
            tokio::time::timeout_at(deadline.instant(), self.slots.clone().acquire_owned()).await;
        self.metrics.waiting.fetch_sub(1, Relaxed);
        match got {
            Ok(Ok(permit)) => {
                self.metrics.running.fetch_add(1, Relaxed);
                Ok(Slot {
                    _permit: permit,
                    metrics: self.metrics.clone(),
                })
            }
            Ok(Err(_closed)) => Err(Refusal::Internal("the query slots are closed".into())),
            Err(_elapsed) => self.refuse(Refusal::Timeout {
                limit: deadline.limit,
                waited: true,
            }),
        }
    }

    /// Runs `fut` on the query runtime with a slot, stopping it (dropping
    /// it there) at the deadline.
    ///
    /// # Errors
    /// [`Refusal::Timeout`]; [`Refusal::Internal`] if the task panicked.
    pub async fn spawn<F>(&self, fut: F) -> Result<F::Output, Refusal>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let deadline = self.deadline();
        let slot = self.slot(deadline).await?;
        let task = self.handle().spawn(async move {
            let out = fut.await;
            drop(slot);
            out
        });
        let abort = task.abort_handle();
        match tokio::time::timeout_at(deadline.instant(), task).await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(Refusal::Internal(format!("query task failed: {e}"))),
            Err(_elapsed) => {
                abort.abort();
                self.refuse(Refusal::Timeout {
                    limit: deadline.limit,
                    waited: false,
                })
            }
        }
    }

    /// Runs blocking `f` on a query thread with a slot. `f` gets the
    /// deadline and should check it as it goes; the answer does not wait
    /// past it either way (the slot is held until `f` returns).
    ///
    /// # Errors
    /// [`Refusal::Timeout`]; [`Refusal::Internal`] if `f` panicked.
    pub async fn spawn_blocking<T, F>(&self, f: F) -> Result<T, Refusal>
    where
        F: FnOnce(Deadline) -> T + Send + 'static,
        T: Send + 'static,
    {
        let deadline = self.deadline();
        let slot = self.slot(deadline).await?;
        let task = self.handle().spawn_blocking(move || {
            let out = f(deadline);
            drop(slot);
            out
        });
        match tokio::time::timeout_at(deadline.instant(), task).await {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(Refusal::Internal(format!("query task failed: {e}"))),
            Err(_elapsed) => self.refuse(Refusal::Timeout {
                limit: deadline.limit,
                waited: false,
            }),
        }
    }

    /// Counts a timeout that the evaluator found itself through its
    /// [`Deadline`].
    pub fn count_timeout(&self) {
        self.metrics.timeout.fetch_add(1, Relaxed);
    }

    /// A context over the same tables and functions as `ctx`, whose queries
    /// may reserve at most [`QueryLimits::memory_limit`] bytes and never
    /// spill to disk. One per query (or per PostgreSQL connection, which
    /// runs one query at a time).
    pub fn session(&self, ctx: &SessionContext) -> SessionContext {
        let state = SessionStateBuilder::new_from_existing(ctx.state())
            .with_runtime_env(self.runtime())
            .build();
        SessionContext::new_with_state(state)
    }

    /// A runtime whose memory pool lets a query reserve at most
    /// [`QueryLimits::memory_limit`] bytes and never spill to disk: one
    /// per query, given to the task context that executes its plan.
    pub fn runtime(&self) -> Arc<RuntimeEnv> {
        let pool = TrackConsumersPool::new(
            GreedyMemoryPool::new(self.limits.memory_limit),
            NonZeroUsize::new(3).expect("3 is not zero"),
        );
        RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(pool))
            .with_disk_manager_builder(
                DiskManagerBuilder::default().with_mode(DiskManagerMode::Disabled),
            )
            .build_arc()
            .expect("BUG: a runtime without a disk manager always builds")
    }
}

/// axum middleware for read requests that do their own work (remote read):
/// each waits for a query slot and is answered within `--query-timeout`
/// (503 `timeout` otherwise, in Prometheus's JSON error shape). Requests to
/// other paths than `/api/v1/read` pass untouched.
pub async fn read_slot(
    axum::extract::State(guard): axum::extract::State<Arc<QueryGuard>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    if req.uri().path() != "/api/v1/read" {
        return next.run(req).await;
    }
    let refused = |r: Refusal| {
        let status = axum::http::StatusCode::from_u16(r.http_status())
            .unwrap_or(axum::http::StatusCode::SERVICE_UNAVAILABLE);
        let body = serde_json::json!({"status": "error", "errorType": r.error_type(), "error": r.to_string()});
        (
            status,
            [("content-type", "application/json")],
            body.to_string(),
        )
            .into_response()
    };
    let deadline = guard.deadline();
    let slot = match guard.slot(deadline).await {
        Ok(s) => s,
        Err(r) => return refused(r),
    };
    let out = tokio::time::timeout_at(deadline.instant(), next.run(req)).await;
    drop(slot);
    match out {
        Ok(response) => response,
        Err(_elapsed) => {
            guard.count_timeout();
            refused(Refusal::Timeout {
                limit: deadline.limit,
                waited: false,
            })
        }
    }
}

/// Measures expression depth, stopping as soon as it passes `limit`.
struct DepthVisitor {
    depth: usize,
    limit: usize,
}

impl DepthVisitor {
    fn enter(&mut self) -> ControlFlow<()> {
        self.depth += 1;
        if self.depth > self.limit {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    }
}

impl Visitor for DepthVisitor {
    type Break = ();

    fn pre_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        self.enter()
    }

    fn post_visit_query(&mut self, _: &Query) -> ControlFlow<()> {
        self.depth -= 1;
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, _: &SqlExpr) -> ControlFlow<()> {
        self.enter()
    }

    fn post_visit_expr(&mut self, _: &SqlExpr) -> ControlFlow<()> {
        self.depth -= 1;
        ControlFlow::Continue(())
    }
}

/// Whether any statement of `sql` nests expressions and subqueries more than
/// `limit` deep, parsed as DataFusion parses it. The walk stops at the limit.
fn sql_depth_exceeds(sql: &str, limit: usize) -> bool {
    let Ok(mut parser) = DFParserBuilder::new(sql).build() else {
        return false;
    };
    let Ok(statements) = parser.parse_statements() else {
        return false;
    };
    let mut v = DepthVisitor { depth: 0, limit };
    statements.iter().any(|s| {
        v.depth = 0;
        df_statement_exceeds(s, &mut v)
    })
}

fn df_statement_exceeds(s: &DfStatement, v: &mut DepthVisitor) -> bool {
    match s {
        DfStatement::Statement(s) => s.visit(v).is_break(),
        DfStatement::Explain(e) => df_statement_exceeds(&e.statement, v),
        DfStatement::CopyTo(c) => match &c.source {
            CopyToSource::Query(q) => q.visit(v).is_break(),
            CopyToSource::Relation(_) => false,
        },
        DfStatement::CreateExternalTable(_) | DfStatement::Reset(_) => false,
    }
}

/// The depth of a PromQL expression tree, without recursion.
pub fn promql_depth(expr: &promql_parser::parser::Expr) -> usize {
    use promql_parser::parser::Expr;
    let mut max = 0;
    let mut stack = vec![(expr, 1usize)];
    while let Some((e, d)) = stack.pop() {
        max = max.max(d);
        match e {
            Expr::Aggregate(a) => {
                stack.push((&a.expr, d + 1));
                if let Some(p) = &a.param {
                    stack.push((p, d + 1));
                }
            }
            Expr::Unary(u) => stack.push((&u.expr, d + 1)),
            Expr::Binary(b) => {
                stack.push((&b.lhs, d + 1));
                stack.push((&b.rhs, d + 1));
            }
            Expr::Paren(p) => stack.push((&p.expr, d + 1)),
            Expr::Subquery(s) => stack.push((&s.expr, d + 1)),
            Expr::Call(c) => stack.extend(c.args.args.iter().map(|a| (a.as_ref(), d + 1))),
            Expr::Extension(_)
            | Expr::NumberLiteral(_)
            | Expr::StringLiteral(_)
            | Expr::VectorSelector(_)
            | Expr::MatrixSelector(_) => {}
        }
    }
    max
}

#[cfg(test)]
mod tests;
