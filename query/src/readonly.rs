//! The read-only guard of SQL: one decision, on DataFusion's logical plan,
//! for `POST /api/v1/sql` and the PostgreSQL listener.
//!
//! Both front ends run on one shared `SessionContext`, so anything that
//! writes (a table, a view, a schema, a file, a setting, a stored plan)
//! would be seen by every other client. [`check`] walks a plan, with its
//! subqueries and the plans under `EXPLAIN`/`EXPLAIN ANALYZE`, `PREPARE`
//! and `CREATE … AS`, and refuses:
//!
//! - `LogicalPlan::Ddl` (`CREATE TABLE/VIEW/SCHEMA/DATABASE/INDEX/FUNCTION`,
//!   `CREATE … AS`, `SELECT ... INTO`, `DROP …`);
//! - `LogicalPlan::Dml` (`INSERT`, `UPDATE`, `DELETE`, `TRUNCATE`, `MERGE`)
//!   and `LogicalPlan::Copy` (`COPY ... TO`);
//! - `SET`/`RESET` (`Statement::SetVariable`, `ResetVariable`): DataFusion's
//!   settings are shared by all clients; and SQL `PREPARE`, `EXECUTE`,
//!   `DEALLOCATE`, whose named plans live in the shared context too;
//! - `LogicalPlan::Extension`: a node gpulse does not know is not assumed
//!   to be read-only.
//!
//! `BEGIN`/`COMMIT`/`ROLLBACK` plans write nothing and pass.
//!
//! Over HTTP, [`plan_sql`] plans every statement of the request (in order)
//! and checks each plan before anything runs; the plan it returns is the
//! one that runs. Over PostgreSQL, [`check_pg_statement`] (called by the
//! hook in `pg.rs` before datafusion-postgres runs a statement) plans the
//! statement's text exactly as datafusion-postgres will (`SessionContext::sql`
//! of `statement.to_string()`) and checks that plan; at the extended
//! protocol's execute step the prepared plan itself is checked ([`check`]).
//! Statements that never reach DataFusion are decided on the statement:
//! the connection `SET`s of [`CONNECTION_SETTINGS`] and `SET TIME ZONE` (kept
//! per connection by datafusion-postgres), transaction and cursor
//! statements (`DECLARE … CURSOR FOR q` is decided on the plan of `q`).
//!
//! Every refusal reads the same on both surfaces (the [`Refusal`] text,
//! which starts with `gpulse is read-only:`): HTTP answers 400 `bad_data`,
//! PostgreSQL SQLSTATE [`SQLSTATE`] (25006, read_only_sql_transaction). Each
//! is counted in `gpulse_sql_statements_refused_total{protocol=...}`
//! ([`ReadOnlyMetrics`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::error::DataFusionError;
use datafusion::execution::SessionState;
use datafusion::logical_expr::{DdlStatement, LogicalPlan, Statement as PlanStatement, WriteOp};
use datafusion::prelude::SessionContext;
use datafusion::sql::parser::DFParserBuilder;
use datafusion::sql::sqlparser::ast::{Set, Statement as SqlStatement};
use datafusion::sql::sqlparser::dialect::dialect_from_str;

use crate::QueryError;

/// The PostgreSQL SQLSTATE of a refusal: 25006, read_only_sql_transaction.
pub const SQLSTATE: &str = "25006";

/// Connection-local settings that `SET` may change over PostgreSQL
/// (datafusion-postgres keeps them per connection and answers them itself;
/// they never reach DataFusion's shared settings). Every other `SET` is a
/// DataFusion `SetVariable`, which changes what all clients share.
pub const CONNECTION_SETTINGS: &[&str] = &[
    "statement_timeout",
    "datestyle",
    "bytea_output",
    "intervalstyle",
    "application_name",
    "extra_float_digits",
    "search_path",
    "client_encoding",
    "client_min_messages",
    "standard_conforming_strings",
];

/// A statement refused because it would write. Its text is the same over
/// HTTP and PostgreSQL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("gpulse is read-only: {what} is not allowed; {why}")]
pub struct Refusal {
    /// What the statement would do, e.g. `CREATE TABLE stash1 (also SELECT ... INTO)`.
    pub what: String,
    why: &'static str,
}

const ONLY_READS: &str = "only queries (SELECT, WITH, VALUES), EXPLAIN, DESCRIBE and SHOW may run, \
                          and over PostgreSQL the connection SETs";
const SHARED_SETTINGS: &str = "the query settings are shared by every client; a PostgreSQL \
     connection may SET only statement_timeout, datestyle, bytea_output, intervalstyle, \
     application_name, extra_float_digits, search_path, client_encoding, client_min_messages, \
     standard_conforming_strings and TIME ZONE";
const SHARED_PLANS: &str = "SQL PREPARE keeps its plan in the context every client shares; \
                            use the extended protocol's prepared statements instead";

impl Refusal {
    fn write(what: String) -> Self {
        Self {
            what,
            why: ONLY_READS,
        }
    }

    fn setting(what: String) -> Self {
        Self {
            what,
            why: SHARED_SETTINGS,
        }
    }
}

/// Refusals per front end, for `/metrics`.
#[derive(Debug, Default)]
pub struct ReadOnlyMetrics {
    /// Statements refused over `POST /api/v1/sql`.
    pub http_refused: AtomicU64,
    /// Statements refused over the PostgreSQL protocol.
    pub pg_refused: AtomicU64,
}

impl ReadOnlyMetrics {
    /// Appends `gpulse_sql_statements_refused_total` in the Prometheus text
    /// format, one sample per protocol.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let name = "gpulse_sql_statements_refused_total";
        let _ = writeln!(
            out,
            "# HELP {name} SQL statements refused because they would write (read-only guard).\n\
             # TYPE {name} counter\n\
             {name}{{protocol=\"http\"}} {}\n\
             {name}{{protocol=\"postgres\"}} {}",
            self.http_refused.load(Relaxed),
            self.pg_refused.load(Relaxed),
        );
    }
}

/// Refuses `plan` if it, a subquery of it, or a plan it wraps (EXPLAIN,
/// EXPLAIN ANALYZE, PREPARE, CREATE … AS) would write anything.
///
/// # Errors
/// The first writing node met, top down.
pub fn check(plan: &LogicalPlan) -> Result<(), Refusal> {
    let mut refusal = None;
    // The visitor never fails; only `refusal` carries the verdict.
    let _ = plan.apply_with_subqueries(|node| {
        refusal = refusal_of(node);
        Ok(if refusal.is_some() {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    refusal.map_or(Ok(()), Err)
}

/// Why this one node (not its inputs) writes, if it does.
fn refusal_of(node: &LogicalPlan) -> Option<Refusal> {
    let what = match node {
        LogicalPlan::Ddl(ddl) => match ddl {
            DdlStatement::CreateExternalTable(c) => format!("CREATE EXTERNAL TABLE {}", c.name),
            DdlStatement::CreateMemoryTable(c) => {
                format!(
                    "CREATE TABLE {} (also CREATE TABLE ... AS and SELECT ... INTO)",
                    c.name
                )
            }
            DdlStatement::CreateView(c) => format!("CREATE VIEW {}", c.name),
            DdlStatement::CreateCatalogSchema(c) => format!("CREATE SCHEMA {}", c.schema_name),
            DdlStatement::CreateCatalog(c) => format!("CREATE DATABASE {}", c.catalog_name),
            DdlStatement::CreateIndex(c) => format!("CREATE INDEX ON {}", c.table),
            DdlStatement::DropTable(d) => format!("DROP TABLE {}", d.name),
            DdlStatement::DropView(d) => format!("DROP VIEW {}", d.name),
            DdlStatement::DropCatalogSchema(d) => format!("DROP SCHEMA {}", d.name),
            DdlStatement::CreateFunction(c) => format!("CREATE FUNCTION {}", c.name),
            DdlStatement::DropFunction(d) => format!("DROP FUNCTION {}", d.name),
        },
        LogicalPlan::Dml(dml) => {
            let op = match &dml.op {
                WriteOp::Insert(_) => "INSERT INTO",
                WriteOp::Delete => "DELETE FROM",
                WriteOp::Update => "UPDATE",
                WriteOp::Ctas => "CREATE TABLE ... AS",
                WriteOp::Truncate => "TRUNCATE",
                WriteOp::MergeInto(_) => "MERGE INTO",
                // WriteOp is non_exhaustive: a new kind of write is a write.
                _ => "a write to",
            };
            format!("{op} {}", dml.table_name)
        }
        LogicalPlan::Copy(c) => format!("COPY ... TO '{}'", c.output_url),
        LogicalPlan::Statement(s) => match s {
            PlanStatement::TransactionStart(_) | PlanStatement::TransactionEnd(_) => return None,
            PlanStatement::SetVariable(v) => {
                return Some(Refusal::setting(format!("SET {}", v.variable)));
            }
            PlanStatement::ResetVariable(v) => {
                return Some(Refusal::setting(format!("RESET {}", v.variable)));
            }
            PlanStatement::Prepare(p) => {
                return Some(Refusal {
                    what: format!("PREPARE {}", p.name),
                    why: SHARED_PLANS,
                });
            }
            PlanStatement::Execute(e) => {
                return Some(Refusal {
                    what: format!("EXECUTE {}", e.name),
                    why: SHARED_PLANS,
                });
            }
            PlanStatement::Deallocate(d) => {
                return Some(Refusal {
                    what: format!("DEALLOCATE {}", d.name),
                    why: SHARED_PLANS,
                });
            }
        },
        LogicalPlan::Extension(e) => {
            format!("a plan node gpulse does not know ({})", e.node.name())
        }
        _ => return None,
    };
    Some(Refusal::write(what))
}

/// Why HTTP SQL did not plan: a refusal, or DataFusion's own error.
#[derive(Debug)]
pub enum PlanError {
    Refused(Refusal),
    DataFusion(DataFusionError),
}

impl From<DataFusionError> for PlanError {
    fn from(e: DataFusionError) -> Self {
        Self::DataFusion(e)
    }
}

impl From<PlanError> for QueryError {
    fn from(e: PlanError) -> Self {
        match e {
            PlanError::Refused(r) => QueryError::ReadOnly(r),
            PlanError::DataFusion(e) => e.into(),
        }
    }
}

/// Plans `sql` for `POST /api/v1/sql` and checks it: the plan returned is
/// read-only and is the one to run.
///
/// Every statement of `sql` is planned and checked in order before any
/// error about their number, so that a write anywhere in the string is
/// refused as it is over PostgreSQL (which runs the statements one by one).
/// Parsing is DataFusion's, with the session's dialect and recursion limit,
/// as `SessionContext::sql` does.
///
/// # Errors
/// [`PlanError::Refused`] for a write (counted in `metrics`);
/// [`PlanError::DataFusion`] when a statement does not parse or plan, or
/// when there is not exactly one.
pub async fn plan_sql(
    state: &SessionState,
    sql: &str,
    metrics: &ReadOnlyMetrics,
) -> Result<LogicalPlan, PlanError> {
    let statements = {
        // The dialect is not Send: parse before any await.
        let parser_options = &state.config().options().sql_parser;
        let dialect = dialect_from_str(parser_options.dialect).ok_or_else(|| {
            DataFusionError::Plan(format!(
                "unsupported SQL dialect {}",
                parser_options.dialect
            ))
        })?;
        DFParserBuilder::new(sql)
            .with_dialect(dialect.as_ref())
            .with_recursion_limit(parser_options.recursion_limit.get())
            .build()?
            .parse_statements()?
    };
    let count = statements.len();
    let mut plans = Vec::with_capacity(count);
    for statement in statements {
        let plan = state.statement_to_plan(statement).await?;
        check(&plan).map_err(|r| {
            metrics.http_refused.fetch_add(1, Relaxed);
            PlanError::Refused(r)
        })?;
        plans.push(plan);
    }
    match plans.pop() {
        Some(plan) if count == 1 => Ok(plan),
        Some(_) => Err(DataFusionError::NotImplemented(
            "one SQL statement per request: the context currently only supports a single SQL statement"
                .to_owned(),
        )
        .into()),
        None => Err(DataFusionError::Plan(
            "No SQL statements were provided in the query string".to_owned(),
        )
        .into()),
    }
}

/// Decides one statement that the PostgreSQL listener parsed, before
/// datafusion-postgres (or one of its hooks) runs it.
///
/// Connection `SET`s, `SET TIME ZONE`, transaction statements, `FETCH` and
/// `CLOSE` never reach DataFusion and pass. `DECLARE … CURSOR FOR q` is
/// decided on the plan of `q`, which the cursor hook runs. Everything else
/// is planned from `statement.to_string()` exactly as datafusion-postgres'
/// simple query path does, and that plan is checked. A statement that does
/// not plan passes here: the path that would run it plans the same text and
/// fails the same way, before it runs anything. The one exception is `SET`,
/// which datafusion-postgres answers itself (ignoring DataFusion's error):
/// a `SET` that is not a connection setting is refused even if it does not
/// plan.
///
/// # Errors
/// The refusal.
pub async fn check_pg_statement(
    ctx: &SessionContext,
    statement: &SqlStatement,
) -> Result<(), Refusal> {
    match statement {
        SqlStatement::Set(set) if is_connection_setting(set) => Ok(()),
        SqlStatement::StartTransaction { .. }
        | SqlStatement::Commit { .. }
        | SqlStatement::Rollback { .. }
        | SqlStatement::Fetch { .. }
        | SqlStatement::Close { .. } => Ok(()),
        SqlStatement::Declare { stmts } => {
            for declare in stmts {
                if let Some(query) = &declare.for_query {
                    check_text(ctx, &query.to_string()).await?;
                }
            }
            Ok(())
        }
        // SQL prepared statements are refused by kind: HTTP refuses their
        // plans, and over PostgreSQL a statement's re-printed text may not
        // plan at all (an `EXECUTE` of a name the dialects print differently).
        SqlStatement::Prepare { name, .. } => Err(Refusal {
            what: format!("PREPARE {name}"),
            why: SHARED_PLANS,
        }),
        SqlStatement::Execute { name, .. } => Err(Refusal {
            what: match name {
                Some(name) => format!("EXECUTE {name}"),
                None => "EXECUTE".to_owned(),
            },
            why: SHARED_PLANS,
        }),
        SqlStatement::Deallocate { name, .. } => Err(Refusal {
            what: format!("DEALLOCATE {name}"),
            why: SHARED_PLANS,
        }),
        SqlStatement::Set(_) => {
            // The refusal of the plan, for the same text as over HTTP; any
            // other SET by its statement text.
            let text = statement.to_string();
            match ctx
                .state()
                .create_logical_plan(&text)
                .await
                .map(|p| check(&p))
            {
                Ok(Err(refusal)) => Err(refusal),
                _ => Err(Refusal::setting(text)),
            }
        }
        _ => check_text(ctx, &statement.to_string()).await,
    }
}

/// Plans `sql` as `SessionContext::sql` does and checks the plan; a text
/// that does not plan passes (whoever runs it fails the same way first).
async fn check_text(ctx: &SessionContext, sql: &str) -> Result<(), Refusal> {
    match ctx.state().create_logical_plan(sql).await {
        Ok(plan) => check(&plan),
        Err(_) => Ok(()),
    }
}

/// `SET name = value` of a [`CONNECTION_SETTINGS`] name, or
/// `SET TIME ZONE` (not `LOCAL`): datafusion-postgres keeps these in the
/// connection.
pub fn is_connection_setting(set: &Set) -> bool {
    match set {
        Set::SetTimeZone { local: false, .. } => true,
        Set::SingleAssignment {
            scope: None,
            hivevar: false,
            variable,
            ..
        } => {
            let name = variable.to_string().to_lowercase();
            CONNECTION_SETTINGS.contains(&name.as_str())
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests;
