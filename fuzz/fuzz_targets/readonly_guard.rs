//! The read-only guard of SQL (query/src/readonly.rs) over arbitrary text.
//!
//! The text goes where `POST /api/v1/sql` sends it: the query limits
//! (`QueryGuard::check_sql`), then `readonly::plan_sql` over a context with
//! the node's tables (`QueryEngine::context`). Checks:
//!
//! - no panic, no stack overflow (on a `QUERY_STACK_BYTES` thread, as the
//!   node plans), no hang;
//! - a plan the guard accepts holds no node that writes: DDL, DML, COPY,
//!   SET/RESET, PREPARE/EXECUTE/DEALLOCATE, or an extension node. The walk
//!   here is this target's own (inputs and the subqueries of expressions),
//!   not the guard's;
//! - where the text is one PostgreSQL statement, the PostgreSQL side
//!   (`readonly::check_pg_statement`, as the pg hook calls it) agrees with
//!   HTTP on refusing it, except for what only PostgreSQL may do (the
//!   connection `SET`s, transactions, cursors).
#![no_main]

use std::sync::{Arc, OnceLock};

use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::{Expr, LogicalPlan, Statement as PlanStatement};
use datafusion::sql::sqlparser::ast::Statement as SqlStatement;
use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
use datafusion::sql::sqlparser::parser::Parser;
use libfuzzer_sys::fuzz_target;
use query::QueryEngine;
use query::limits::{QUERY_STACK_BYTES, QueryGuard};
use query::readonly::{PlanError, ReadOnlyMetrics, check_pg_statement, plan_sql};
use storage::{Storage, StorageConfig};

struct Fixture {
    engine: QueryEngine,
    guard: QueryGuard,
    runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir");
        let storage = Arc::new(Storage::open(StorageConfig::new(dir.path())).expect("open"));
        Fixture {
            engine: QueryEngine::new(storage),
            guard: QueryGuard::default(),
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime"),
            _dir: dir,
        }
    })
}

/// The first node of `plan` (its inputs and the subqueries in its
/// expressions included) that writes or changes shared state.
fn writer(plan: &LogicalPlan) -> Option<String> {
    let own = match plan {
        LogicalPlan::Ddl(_) | LogicalPlan::Dml(_) | LogicalPlan::Copy(_) => true,
        LogicalPlan::Extension(_) => true,
        LogicalPlan::Statement(s) => matches!(
            s,
            PlanStatement::SetVariable(_)
                | PlanStatement::ResetVariable(_)
                | PlanStatement::Prepare(_)
                | PlanStatement::Execute(_)
                | PlanStatement::Deallocate(_)
        ),
        _ => false,
    };
    if own {
        return Some(plan.display().to_string());
    }
    for input in plan.inputs() {
        if let Some(w) = writer(input) {
            return Some(w);
        }
    }
    let mut found = None;
    for e in plan.expressions() {
        let _ = e.apply(|e| {
            let sub = match e {
                Expr::ScalarSubquery(s) => Some(&s.subquery),
                Expr::Exists(x) => Some(&x.subquery.subquery),
                Expr::InSubquery(x) => Some(&x.subquery.subquery),
                Expr::SetComparison(x) => Some(&x.subquery.subquery),
                _ => None,
            };
            if let Some(sub) = sub {
                found = writer(sub);
            }
            Ok(if found.is_some() {
                TreeNodeRecursion::Stop
            } else {
                TreeNodeRecursion::Continue
            })
        });
        if found.is_some() {
            return found;
        }
    }
    None
}

/// Statements the PostgreSQL side decides without a plan, differently from
/// HTTP on purpose.
fn pg_only(statement: &SqlStatement) -> bool {
    match statement {
        SqlStatement::Set(set) => query::readonly::is_connection_setting(set),
        SqlStatement::StartTransaction { .. }
        | SqlStatement::Commit { .. }
        | SqlStatement::Rollback { .. }
        | SqlStatement::Fetch { .. }
        | SqlStatement::Close { .. }
        | SqlStatement::Declare { .. } => true,
        _ => false,
    }
}

fn run(sql: &str) {
    let f = fixture();
    if f.guard.check_sql(sql).is_err() {
        return;
    }
    let ctx = f.engine.context();
    let metrics = ReadOnlyMetrics::default();
    let http = f.runtime.block_on(plan_sql(&ctx.state(), sql, &metrics));
    let http_refused = match &http {
        Ok(plan) => {
            if let Some(w) = writer(plan) {
                panic!("the guard accepted a plan that writes: {w}\nSQL: {sql}");
            }
            false
        }
        Err(PlanError::Refused(_)) => true,
        // Not one statement, or it does not plan: nothing to compare.
        Err(PlanError::DataFusion(_)) => return,
    };
    let Ok(mut statements) = Parser::parse_sql(&PostgreSqlDialect {}, sql) else {
        return;
    };
    if statements.len() != 1 {
        return;
    }
    let statement = statements.pop().expect("one statement");
    if pg_only(&statement) {
        return;
    }
    let pg = f.runtime.block_on(check_pg_statement(ctx, &statement));
    // PostgreSQL passes a statement whose re-printed text does not plan:
    // the path that would run it plans that text and fails before running
    // anything (`check_pg_statement`), as HTTP fails on a text that does not
    // plan above. Nothing to compare (`SELECT 1BEGIN, INTO stash`: PostgreSQL
    // reads `INTO` as an alias, HTTP as `SELECT … INTO`).
    if pg.is_ok()
        && f.runtime
            .block_on(ctx.state().create_logical_plan(&statement.to_string()))
            .is_err()
    {
        return;
    }
    assert_eq!(
        http_refused,
        pg.is_err(),
        "HTTP and PostgreSQL disagree on {sql:?} (PostgreSQL: {pg:?}; HTTP: {})",
        match &http {
            Ok(_) => "accepted".to_owned(),
            Err(PlanError::Refused(r)) => r.to_string(),
            Err(PlanError::DataFusion(e)) => e.to_string(),
        }
    );
}

fuzz_target!(|data: &[u8]| {
    let Ok(sql) = std::str::from_utf8(data) else {
        return;
    };
    let sql = sql.to_owned();
    let worker = std::thread::Builder::new()
        .stack_size(QUERY_STACK_BYTES)
        .spawn(move || run(&sql))
        .expect("spawn a query thread");
    if let Err(p) = worker.join() {
        std::panic::resume_unwind(p);
    }
});
