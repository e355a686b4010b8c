//! SQL aggregates evaluated where the data is (issue #19): in a cluster, an
//! aggregate over `samples` runs on every node over the shards it is asked
//! to read, and only its partial results travel, not the raw samples.
//!
//! # What is pushed down
//!
//! An `Aggregate` of the statement's plan whose input is `samples` (or
//! `samples` under an alias) with `WHERE` filters alone (no join, subquery or
//! projection between), whose
//! groups are plain `GROUP BY` expressions (no `GROUPING SETS`, `ROLLUP`,
//! `CUBE`), and whose aggregates are `count`, `sum`, `min`, `max` and `avg`
//! without `DISTINCT`, `FILTER` or `ORDER BY` (`sum` and `avg` of `Int64` or
//! `Float64` arguments). Every node runs
//!
//! ```sql
//! SELECT <group 1> AS g0, ..., count(<arg>) AS a0_c, sum(<arg>) AS a0_s, ...
//! FROM samples WHERE <filters> GROUP BY <group 1>, ...
//! ```
//!
//! over its shards (a `sql` Flight ticket, [`crate::cluster::wire`]), and this
//! node merges: `count` as the sum of the counts, `sum` as the sum of the
//! sums, `min` and `max` as the least and greatest, `avg` as the sum of the
//! sums over the sum of the counts. What stands above the aggregate (`HAVING`,
//! `ORDER BY`, `LIMIT`, outer projections) runs here on the merged rows, as
//! before. Every other statement reads raw samples, as before. `now()` in the
//! filters is folded to this node's clock first, so every node cuts at the
//! same instant.
//!
//! The series of one shard are all on each of its owners and the read plan
//! asks one owner per shard, so each row counts once. As for PromQL
//! ([`crate::promql`]'s pushdown), that holds within one epoch of the shard
//! map: when the filters' time range spans an epoch change (or has no
//! bounds and the cluster has had more than one epoch), the statement reads
//! raw samples.
//!
//! A node runs the partial statement in a context of its own with only
//! `samples` (of the listed shards) and DataFusion's built-in functions: a
//! statement that groups or filters by one of the PostgreSQL catalog
//! functions (`format_type`, ...) fails there, and so fails the query.
//!
//! # Exactness
//!
//! `count`, `min` and `max` are exact. `sum` adds the nodes' partial sums, so
//! its floating-point rounding can differ in the last bits from one node
//! adding every row in turn; `avg` is that sum over the count (DataFusion's
//! own `avg` also merges partial sums and counts, across its partitions).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use arrow::array::RecordBatch;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use async_trait::async_trait;
use datafusion::catalog::{
    CatalogProvider, CatalogProviderList, MemoryCatalogProvider, MemoryCatalogProviderList,
    MemorySchemaProvider, SchemaProvider, Session, TableProvider,
};
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::common::{Column, DFSchemaRef, ScalarValue};
use datafusion::datasource::{MemTable, provider_as_source};
use datafusion::error::DataFusionError;
use datafusion::execution::{SessionState, SessionStateBuilder};
use datafusion::functions::expr_fn::{coalesce, nullif};
use datafusion::functions_aggregate::expr_fn::{max, min, sum};
use datafusion::logical_expr::expr::AggregateFunction;
use datafusion::logical_expr::simplify::SimplifyContext;
use datafusion::logical_expr::{
    Aggregate, Expr, ExprSchemable, LogicalPlan, LogicalPlanBuilder, TableType, cast, col, lit,
};
use datafusion::optimizer::simplify_expressions::ExprSimplifier;
use datafusion::optimizer::{OptimizerConfig, OptimizerRule};
use datafusion::physical_plan::{ExecutionPlan, collect};
use datafusion::sql::unparser::expr_to_sql;
use storage::{Matcher, Storage};
use tracing::debug;

use crate::cluster::{ClusterReader, ShardFilter, Source};
use crate::samples::SamplesTable;

/// The name the merged partial results are scanned under.
const PARTIALS: &str = "__gpulse_partials";

/// How one aggregate of the statement is merged from the partial columns.
#[derive(Debug, Clone, Copy)]
enum Merge {
    /// The sum of the partial counts.
    Count,
    Sum,
    Min,
    Max,
    /// The sum of the partial sums over the sum of the partial counts.
    Avg,
}

/// One aggregate node to push down.
#[derive(Debug)]
struct Candidate {
    /// The statement each node runs.
    sql: String,
    /// The statement's result columns.
    schema: SchemaRef,
    /// Number of groups (`g0`, `g1`, ...).
    groups: usize,
    merges: Vec<Merge>,
    /// What the scan would select with, to plan the shards to read.
    filters: Vec<Expr>,
}

/// The optimizer rule of a cluster node's sessions: rewrites every
/// aggregate that can be pushed down (see the module docs) into a merge of
/// the nodes' partial results, which [`PartialsTable`] reads when the plan
/// is made executable. It runs first, on the plan as written, so that every
/// surface (HTTP SQL, PostgreSQL) gets it.
#[derive(Debug)]
pub(crate) struct SqlPushdown {
    reader: ClusterReader,
}

impl SqlPushdown {
    pub(crate) fn new(reader: ClusterReader) -> Self {
        Self { reader }
    }
}

impl OptimizerRule for SqlPushdown {
    fn name(&self) -> &str {
        "gpulse_sql_pushdown"
    }

    fn rewrite(
        &self,
        plan: LogicalPlan,
        config: &dyn OptimizerConfig,
    ) -> Result<Transformed<LogicalPlan>, DataFusionError> {
        let now = config.query_execution_start_time();
        plan.transform_up(|node| {
            let LogicalPlan::Aggregate(a) = &node else {
                return node.recompute_schema().map(Transformed::no);
            };
            let Some(c) = candidate(a, now)? else {
                return Ok(Transformed::no(node));
            };
            let (matchers, min_ts, max_ts) = crate::samples::scan_bounds(&c.filters);
            if self.reader.spans_epochs(min_ts, max_ts) {
                debug!("SQL pushdown: the range spans an epoch change; reading raw samples");
                return Ok(Transformed::no(node));
            }
            // A name of its own for each scan of partial results, across the
            // optimizer's passes too.
            static NEXT: AtomicU64 = AtomicU64::new(1);
            let n = NEXT.fetch_add(1, Relaxed);
            let table = PartialsTable {
                schema: c.schema.clone(),
                sql: c.sql.clone(),
                matchers,
                min_ts,
                max_ts,
                reader: self.reader.clone(),
            };
            match merge_plan(&c, table, node.schema(), n)? {
                Some(merged) => Ok(Transformed::yes(merged)),
                None => Ok(Transformed::no(node)),
            }
        })
    }
}

/// The pushdown of aggregate `a`, if it can be pushed down.
fn candidate(
    a: &Aggregate,
    now: Option<chrono::DateTime<chrono::Utc>>,
) -> Result<Option<Candidate>, DataFusionError> {
    // The input: filters over a scan of `samples`, perhaps under an alias
    // (`FROM samples s`).
    let mut filters = Vec::new();
    let mut alias = None;
    let mut input = a.input.as_ref();
    loop {
        match input {
            LogicalPlan::Filter(f) if alias.is_none() => {
                filters.push(f.predicate.clone());
                input = f.input.as_ref();
            }
            LogicalPlan::SubqueryAlias(sa) if alias.is_none() => {
                alias = Some(sa.alias.table().to_owned());
                input = sa.input.as_ref();
            }
            LogicalPlan::TableScan(t)
                if t.table_name.table() == "samples"
                    && t.table_name.schema().is_none_or(|s| s == "public")
                    && t.filters.is_empty()
                    && t.fetch.is_none() =>
            {
                break;
            }
            _ => return Ok(None),
        }
    }
    let schema = a.input.schema();
    // `now()` as of this statement's start, so that every node cuts at the
    // same instant.
    let mut context = SimplifyContext::builder().with_schema(schema.clone());
    if let Some(now) = now {
        context = context.with_query_execution_start_time(Some(now));
    }
    let simplifier = ExprSimplifier::new(context.build());
    let mut filters: Vec<Expr> = filters
        .into_iter()
        .map(|f| simplifier.simplify(f))
        .collect::<Result<_, _>>()?;
    filters.reverse();

    let sql_of = |e: &Expr| expr_to_sql(e).map(|s| s.to_string()).ok();
    let nullable = |name: String, t: DataType| Field::new(name, t, true);
    let mut select = Vec::new();
    let mut fields = Vec::new();
    let mut group_by = Vec::new();
    for (i, g) in a.group_expr.iter().enumerate() {
        if matches!(g, Expr::GroupingSet(_)) {
            return Ok(None);
        }
        let Some(text) = sql_of(g) else {
            return Ok(None);
        };
        select.push(format!("{text} AS \"g{i}\""));
        fields.push(nullable(format!("g{i}"), g.get_type(schema.as_ref())?));
        group_by.push(text);
    }
    let mut merges = Vec::new();
    for (i, e) in a.aggr_expr.iter().enumerate() {
        let Some((merge, arg)) = aggregate_of(e, schema)? else {
            return Ok(None);
        };
        let Some(text) = sql_of(arg) else {
            return Ok(None);
        };
        let t = arg.get_type(schema.as_ref())?;
        match merge {
            Merge::Count => {
                select.push(format!("count({text}) AS \"a{i}_c\""));
                fields.push(nullable(format!("a{i}_c"), DataType::Int64));
            }
            Merge::Sum => {
                select.push(format!("sum({text}) AS \"a{i}_s\""));
                fields.push(nullable(format!("a{i}_s"), t));
            }
            Merge::Min | Merge::Max => {
                let f = if matches!(merge, Merge::Min) {
                    "min"
                } else {
                    "max"
                };
                select.push(format!("{f}({text}) AS \"a{i}_m\""));
                fields.push(nullable(format!("a{i}_m"), t));
            }
            Merge::Avg => {
                select.push(format!("sum({text}) AS \"a{i}_s\""));
                select.push(format!("count({text}) AS \"a{i}_c\""));
                fields.push(nullable(format!("a{i}_s"), t));
                fields.push(nullable(format!("a{i}_c"), DataType::Int64));
            }
        }
        merges.push(merge);
    }
    let from = match &alias {
        None => "samples".to_owned(),
        Some(a) => format!("samples AS \"{}\"", a.replace('"', "\"\"")),
    };
    let mut sql = format!("SELECT {} FROM {from}", select.join(", "));
    if !filters.is_empty() {
        let mut parts = Vec::new();
        for f in &filters {
            let Some(text) = sql_of(f) else {
                return Ok(None);
            };
            parts.push(format!("({text})"));
        }
        sql.push_str(&format!(" WHERE {}", parts.join(" AND ")));
    }
    if !group_by.is_empty() {
        sql.push_str(&format!(" GROUP BY {}", group_by.join(", ")));
    }
    Ok(Some(Candidate {
        sql,
        schema: Arc::new(Schema::new(fields)),
        groups: a.group_expr.len(),
        merges,
        filters,
    }))
}

/// The merge of aggregate `e` and its argument, if it is one this module
/// pushes down.
fn aggregate_of<'a>(
    e: &'a Expr,
    schema: &DFSchemaRef,
) -> Result<Option<(Merge, &'a Expr)>, DataFusionError> {
    let e = match e {
        Expr::Alias(a) => a.expr.as_ref(),
        e => e,
    };
    let Expr::AggregateFunction(AggregateFunction { func, params }) = e else {
        return Ok(None);
    };
    if params.distinct
        || params.filter.is_some()
        || !params.order_by.is_empty()
        || params.null_treatment.is_some()
        || params.args.len() != 1
    {
        return Ok(None);
    }
    let arg = &params.args[0];
    let numeric = || -> Result<bool, DataFusionError> {
        Ok(matches!(
            arg.get_type(schema.as_ref())?,
            DataType::Int64 | DataType::Float64
        ))
    };
    let merge = match func.name() {
        "count" => Merge::Count,
        "min" => Merge::Min,
        "max" => Merge::Max,
        "sum" if numeric()? => Merge::Sum,
        "avg" if numeric()? => Merge::Avg,
        _ => return Ok(None),
    };
    Ok(Some((merge, arg)))
}

/// The plan that stands for the aggregate whose output is `out`: the merge
/// of the partial results `table` reads, with the aggregate's output names.
/// `None` when the merge would not give the aggregate's types.
fn merge_plan(
    c: &Candidate,
    table: PartialsTable,
    out: &DFSchemaRef,
    n: u64,
) -> Result<Option<LogicalPlan>, DataFusionError> {
    let name = format!("{PARTIALS}_{n}");
    let scan = LogicalPlanBuilder::scan(&name, provider_as_source(Arc::new(table)), None)?;
    let p = |c: String| col(Column::new(Some(name.as_str()), c));
    let groups: Vec<Expr> = (0..c.groups).map(|i| p(format!("g{i}"))).collect();
    let mut aggregates = Vec::new();
    for (i, m) in c.merges.iter().enumerate() {
        match m {
            Merge::Count => aggregates.push(sum(p(format!("a{i}_c"))).alias(format!("m{i}_c"))),
            Merge::Sum => aggregates.push(sum(p(format!("a{i}_s"))).alias(format!("m{i}_s"))),
            Merge::Min => aggregates.push(min(p(format!("a{i}_m"))).alias(format!("m{i}_m"))),
            Merge::Max => aggregates.push(max(p(format!("a{i}_m"))).alias(format!("m{i}_m"))),
            Merge::Avg => {
                aggregates.push(sum(p(format!("a{i}_s"))).alias(format!("m{i}_s")));
                aggregates.push(sum(p(format!("a{i}_c"))).alias(format!("m{i}_c")));
            }
        }
    }
    let merged = scan.aggregate(groups, aggregates)?;
    let mut exprs = Vec::new();
    for i in 0..c.groups {
        exprs.push(col(format!("g{i}")));
    }
    for (i, m) in c.merges.iter().enumerate() {
        exprs.push(match m {
            // A count of nothing is 0, not the NULL a sum of nothing is.
            Merge::Count => coalesce(vec![col(format!("m{i}_c")), lit(0i64)]),
            Merge::Sum => col(format!("m{i}_s")),
            Merge::Min | Merge::Max => col(format!("m{i}_m")),
            Merge::Avg => {
                cast(col(format!("m{i}_s")), DataType::Float64)
                    / cast(
                        nullif(col(format!("m{i}_c")), lit(ScalarValue::Int64(Some(0)))),
                        DataType::Float64,
                    )
            }
        });
    }
    let exprs: Vec<Expr> = exprs
        .into_iter()
        .zip(out.iter())
        .map(|(e, (q, f))| e.alias_qualified(q.cloned(), f.name()))
        .collect();
    let plan = merged.project(exprs)?.build()?;
    let types_match = plan
        .schema()
        .fields()
        .iter()
        .zip(out.fields())
        .all(|(a, b)| a.data_type() == b.data_type());
    if !types_match {
        debug!(sql = %c.sql, "SQL pushdown: the merge would change a column's type; reading raw samples");
        return Ok(None);
    }
    Ok(Some(plan))
}

/// The partial results of one pushed-down aggregate, read from the nodes
/// when the plan is made executable (as `samples` reads its series).
#[derive(Debug)]
struct PartialsTable {
    schema: SchemaRef,
    sql: String,
    matchers: Vec<Matcher>,
    min_ts: i64,
    max_ts: i64,
    reader: ClusterReader,
}

#[async_trait]
impl TableProvider for PartialsTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Temporary
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        let Some((batches, warnings)) = self
            .reader
            .sql_partials(&self.sql, &self.matchers, self.min_ts, self.max_ts)
            .await
            .map_err(|e| DataFusionError::External(Box::new(e)))?
        else {
            return Err(DataFusionError::Execution(
                "the cluster's shard map changed while the query was planned; run it again".into(),
            ));
        };
        crate::cluster::report_sql_warnings(warnings).map_err(crate::cluster::refuse_unseen)?;
        let batches = batches
            .into_iter()
            .map(|b| conform(&self.schema, &b))
            .collect::<Result<Vec<_>, _>>()?;
        MemTable::try_new(self.schema.clone(), vec![batches])?
            .scan(state, projection, filters, limit)
            .await
    }
}

/// `b` in `schema`. A timestamp may come back without its time zone: the
/// statement's text names a cast to `TIMESTAMP` where the plan had one to
/// `TIMESTAMP` in UTC, the same instants; it gets the zone back. Any other
/// difference is an error.
fn conform(schema: &SchemaRef, b: &RecordBatch) -> Result<RecordBatch, DataFusionError> {
    let mut columns = Vec::with_capacity(b.num_columns());
    for (c, f) in b.columns().iter().zip(schema.fields()) {
        match (c.data_type(), f.data_type()) {
            (got, want) if got == want => columns.push(c.clone()),
            (DataType::Timestamp(u1, None), DataType::Timestamp(u2, Some(tz)))
                if u1 == u2 && matches!(tz.as_ref(), "UTC" | "+00:00") =>
            {
                columns.push(arrow::compute::cast(c, f.data_type())?);
            }
            (got, want) => {
                return Err(DataFusionError::Execution(format!(
                    "a node's partial result has a column {} of type {got}, not {want}",
                    f.name()
                )));
            }
        }
    }
    Ok(RecordBatch::try_new(schema.clone(), columns)?)
}

/// Runs `sql` over a `samples` table of this node's shards that `filter`
/// admits: what a node does for a `sql` ticket, and this node for its own
/// shards.
///
/// # Errors
/// A statement that is not a read-only query, or that fails.
pub(crate) async fn run_partial(
    storage: Arc<Storage>,
    filter: ShardFilter,
    sql: &str,
) -> Result<(SchemaRef, Vec<RecordBatch>), String> {
    // A copy of one state built once, with a catalog of its own holding
    // this ticket's `samples`: a context built for each ticket registered
    // every function again (docs/BENCHMARKS.md).
    static BASE: OnceLock<SessionState> = OnceLock::new();
    let mut state = BASE
        .get_or_init(|| SessionStateBuilder::new().with_default_features().build())
        .clone();
    let options = state.config().options().catalog.clone();
    let schema_provider = MemorySchemaProvider::new();
    schema_provider
        .register_table(
            "samples".to_owned(),
            Arc::new(SamplesTable::over(Source::Shards(storage, filter))),
        )
        .map_err(|e| e.to_string())?;
    let catalog = MemoryCatalogProvider::new();
    catalog
        .register_schema(&options.default_schema, Arc::new(schema_provider))
        .map_err(|e| e.to_string())?;
    let catalogs = MemoryCatalogProviderList::new();
    catalogs.register_catalog(options.default_catalog.clone(), Arc::new(catalog));
    state.register_catalog_list(Arc::new(catalogs));
    let plan = crate::readonly::plan_sql(&state, sql, &crate::readonly::ReadOnlyMetrics::default())
        .await
        .map_err(|e| match e {
            crate::readonly::PlanError::Refused(r) => r.to_string(),
            crate::readonly::PlanError::DataFusion(e) => e.to_string(),
        })?;
    let schema: SchemaRef = Arc::new(plan.schema().as_arrow().clone());
    let physical = state
        .create_physical_plan(&plan)
        .await
        .map_err(|e| e.to_string())?;
    let batches = collect(physical, state.task_ctx())
        .await
        .map_err(|e| e.to_string())?;
    Ok((schema, batches))
}
