use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;

use datafusion::common::{DFSchema, DFSchemaRef};
use datafusion::logical_expr::{
    Expr, Extension, LogicalPlanBuilder, UserDefinedLogicalNodeCore, expr_fn::exists,
};
use datafusion_postgres::datafusion_pg_catalog::sql::PostgresCompatibilityParser;
use storage::{Label, SeriesKey, Storage, StorageConfig};

use super::*;
use crate::QueryEngine;

/// 2026-11-30T10:00:00Z in ms.
const T0: i64 = 1_796_032_800_000;

fn engine() -> (tempfile::TempDir, QueryEngine) {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    let key = SeriesKey::new(
        "DCGM_FI_DEV_GPU_TEMP",
        vec![Label::new("Hostname", "node-a"), Label::new("gpu", "0")],
    )
    .unwrap();
    let r = st.series_ref(key).unwrap();
    st.append(&[r; 2], &[T0, T0 + 1000], &[46.5, 47.0]).unwrap();
    (dir, QueryEngine::new(st))
}

/// Every catalog.schema.table of the context, and its settings.
fn snapshot(ctx: &SessionContext) -> (BTreeSet<String>, Vec<(String, Option<String>)>) {
    let mut tables = BTreeSet::new();
    for c in ctx.catalog_names() {
        let catalog = ctx.catalog(&c).unwrap();
        for s in catalog.schema_names() {
            tables.insert(format!("{c}.{s}"));
            for t in catalog.schema(&s).unwrap().table_names() {
                tables.insert(format!("{c}.{s}.{t}"));
            }
        }
    }
    let settings = ctx
        .state()
        .config()
        .options()
        .entries()
        .into_iter()
        .map(|e| (e.key, e.value))
        .collect();
    (tables, settings)
}

async fn http_refusal(engine: &QueryEngine, sql: &str) -> Refusal {
    match plan_sql(&engine.context().state(), sql, &ReadOnlyMetrics::default()).await {
        Err(PlanError::Refused(r)) => r,
        Err(PlanError::DataFusion(e)) => panic!("{sql}: not refused but failed: {e}"),
        Ok(plan) => panic!("{sql}: passed as\n{plan}"),
    }
}

const READS: &[&str] = &[
    "SELECT 1",
    "select count(*) from samples",
    "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
    "VALUES (1, 'a'), (2, 'b')",
    "SELECT * FROM samples WHERE value IN (SELECT max(value) FROM samples)",
    "SELECT EXISTS (SELECT 1 FROM gpus)",
    "EXPLAIN SELECT * FROM samples",
    "EXPLAIN ANALYZE SELECT count(*) FROM samples",
    "DESCRIBE samples",
    "SHOW TABLES",
    "SHOW ALL",
    "SELECT table_name FROM information_schema.tables ORDER BY 1",
    "SELECT relname FROM pg_catalog.pg_class WHERE relkind = 'r'",
    "SELECT * FROM rollup_1m LIMIT 1",
];

#[tokio::test]
async fn reads_plan_and_pass() {
    let (_dir, engine) = engine();
    for sql in READS {
        let plan = plan_sql(&engine.context().state(), sql, &ReadOnlyMetrics::default())
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        assert_eq!(check(&plan), Ok(()), "{sql}");
    }
}

/// (statement, what the refusal names). Spelled as users would, in several
/// cases and with comments.
const WRITES: &[(&str, &str)] = &[
    (
        "SELECT 1 AS a INTO stash1",
        "CREATE TABLE stash1 (also CREATE TABLE ... AS and SELECT ... INTO)",
    ),
    (
        "select * into stash2 from samples",
        "CREATE TABLE stash2 (also CREATE TABLE ... AS and SELECT ... INTO)",
    ),
    (
        "CREATE TABLE t AS SELECT 1 AS a",
        "CREATE TABLE t (also CREATE TABLE ... AS and SELECT ... INTO)",
    ),
    (
        "create table t (x int)",
        "CREATE TABLE t (also CREATE TABLE ... AS and SELECT ... INTO)",
    ),
    (
        "/* c */ CREATE VIEW v AS SELECT * FROM samples",
        "CREATE VIEW v",
    ),
    ("CREATE SCHEMA s", "CREATE SCHEMA s"),
    ("CREATE DATABASE d", "CREATE DATABASE d"),
    ("DROP TABLE samples", "DROP TABLE samples"),
    ("drop view if exists v", "DROP VIEW v"),
    ("DROP SCHEMA public", "DROP SCHEMA public"),
    (
        "INSERT INTO samples (metric) VALUES ('m')",
        "INSERT INTO samples",
    ),
    ("-- x\nDELETE FROM samples", "DELETE FROM samples"),
    ("UPDATE samples SET value = 1", "UPDATE samples"),
    ("COPY samples TO '/tmp/x.csv'", "COPY ... TO '/tmp/x.csv'"),
    (
        "copy (select 1) to '/tmp/y.parquet'",
        "COPY ... TO '/tmp/y.parquet'",
    ),
    (
        "EXPLAIN INSERT INTO samples (metric) VALUES ('m')",
        "INSERT INTO samples",
    ),
    (
        "EXPLAIN ANALYZE INSERT INTO samples (metric) VALUES ('m')",
        "INSERT INTO samples",
    ),
    (
        "SET datafusion.execution.batch_size = 1",
        "SET datafusion.execution.batch_size",
    ),
    ("PREPARE p AS SELECT 1", "PREPARE p"),
    ("EXECUTE p", "EXECUTE p"),
    ("DEALLOCATE p", "DEALLOCATE p"),
];

#[tokio::test]
async fn writes_are_refused_naming_what_they_would_do() {
    let (_dir, engine) = engine();
    let before = snapshot(engine.context());
    for (sql, what) in WRITES {
        let r = http_refusal(&engine, sql).await;
        assert_eq!(r.what, *what, "{sql}");
        assert!(
            r.to_string().starts_with("gpulse is read-only: "),
            "{sql}: {r}"
        );
        // Through the engine: 400 bad_data with the same text.
        match engine.sql(sql).await {
            Err(QueryError::ReadOnly(e)) => assert_eq!(e, r, "{sql}"),
            other => panic!("{sql}: {other:?}"),
        }
    }
    assert_eq!(
        engine.readonly_metrics().http_refused.load(Relaxed),
        WRITES.len() as u64
    );
    let mut text = String::new();
    engine.readonly_metrics().render(&mut text);
    assert!(
        text.contains(&format!(
            "gpulse_sql_statements_refused_total{{protocol=\"http\"}} {}\n",
            WRITES.len()
        )),
        "{text}"
    );
    assert_eq!(snapshot(engine.context()), before, "the context changed");
}

#[tokio::test]
async fn a_write_anywhere_in_a_string_refuses_it() {
    let (_dir, engine) = engine();
    let r = http_refusal(&engine, "SELECT 1; DROP TABLE samples").await;
    assert_eq!(r.what, "DROP TABLE samples");
    let r = http_refusal(&engine, "select 1 into t1;\n select 2").await;
    assert!(r.what.starts_with("CREATE TABLE t1 "), "{r}");
    // Reads only: still one statement per request.
    match engine.sql("SELECT 1; SELECT 2").await {
        Err(QueryError::BadQuery(e)) => {
            assert!(
                e.to_string().contains("one SQL statement per request"),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
    match engine.sql("  -- nothing\n").await {
        Err(QueryError::BadQuery(e)) => {
            assert!(e.to_string().contains("No SQL statements"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    // A statement that does not plan is its own error, not a refusal:
    // DataFusion plans no BEGIN or SET TIME ZONE (the PostgreSQL listener
    // answers those per connection).
    for sql in ["SELECT * FROM nowhere", "BEGIN", "SET TIME ZONE 'UTC'"] {
        assert!(
            matches!(engine.sql(sql).await, Err(QueryError::BadQuery(_))),
            "{sql}"
        );
    }
    // A transaction's plan writes nothing.
    let begin = LogicalPlan::Statement(PlanStatement::TransactionStart(
        datafusion::logical_expr::TransactionStart {
            access_mode: datafusion::logical_expr::TransactionAccessMode::ReadOnly,
            isolation_level: datafusion::logical_expr::TransactionIsolationLevel::ReadCommitted,
        },
    ));
    assert_eq!(check(&begin), Ok(()));
}

/// A node gpulse does not know.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Opaque {
    schema: DFSchemaRef,
}

impl PartialOrd for Opaque {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        (self == other).then_some(std::cmp::Ordering::Equal)
    }
}

impl UserDefinedLogicalNodeCore for Opaque {
    fn name(&self) -> &str {
        "Opaque"
    }
    fn inputs(&self) -> Vec<&LogicalPlan> {
        vec![]
    }
    fn schema(&self) -> &DFSchemaRef {
        &self.schema
    }
    fn expressions(&self) -> Vec<Expr> {
        vec![]
    }
    fn fmt_for_explain(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Opaque")
    }
    fn with_exprs_and_inputs(
        &self,
        _exprs: Vec<Expr>,
        _inputs: Vec<LogicalPlan>,
    ) -> datafusion::error::Result<Self> {
        Ok(self.clone())
    }
}

#[tokio::test]
async fn writes_inside_subqueries_and_unknown_nodes_are_found() {
    let (_dir, engine) = engine();
    let insert = engine
        .context()
        .state()
        .create_logical_plan("INSERT INTO samples (metric) VALUES ('m')")
        .await
        .unwrap();
    // SELECT 1 WHERE EXISTS (<insert>): only a walk into expressions sees it.
    let hidden = LogicalPlanBuilder::empty(true)
        .filter(exists(Arc::new(insert)))
        .unwrap()
        .build()
        .unwrap();
    assert_eq!(check(&hidden).unwrap_err().what, "INSERT INTO samples");

    let opaque = LogicalPlan::Extension(Extension {
        node: Arc::new(Opaque {
            schema: Arc::new(DFSchema::empty()),
        }),
    });
    let under = LogicalPlanBuilder::from(opaque.clone())
        .limit(0, Some(1))
        .unwrap()
        .build()
        .unwrap();
    for plan in [opaque, under] {
        assert_eq!(
            check(&plan).unwrap_err().what,
            "a plan node gpulse does not know (Opaque)"
        );
    }
}

fn pg_statement(sql: &str) -> SqlStatement {
    let mut s = PostgresCompatibilityParser::new().parse(sql).unwrap();
    assert_eq!(s.len(), 1, "{sql}");
    s.remove(0)
}

#[tokio::test]
async fn postgres_refuses_what_http_refuses_with_the_same_text() {
    let (_dir, engine) = engine();
    let ctx = engine.context();
    let before = snapshot(ctx);
    for (sql, _) in WRITES {
        // Over PostgreSQL, SET TIME ZONE is the connection's own.
        if sql.starts_with("SET TIME ZONE") {
            continue;
        }
        let http = http_refusal(&engine, sql).await;
        let pg = check_pg_statement(ctx, &pg_statement(sql))
            .await
            .expect_err(sql);
        assert_eq!(pg.to_string(), http.to_string(), "{sql}");
    }
    for sql in READS {
        assert_eq!(
            check_pg_statement(ctx, &pg_statement(sql)).await,
            Ok(()),
            "{sql}"
        );
    }
    assert_eq!(snapshot(ctx), before, "the context changed");
}

#[tokio::test]
async fn postgres_session_statements_are_decided_on_the_statement() {
    let (_dir, engine) = engine();
    let ctx = engine.context();
    for sql in [
        "SET application_name = 'grafana'",
        "SET DateStyle = 'ISO, MDY'",
        "set extra_float_digits = 3",
        "SET statement_timeout = '5s'",
        "SET client_encoding = 'UTF8'",
        "SET TIME ZONE 'Europe/Berlin'",
        "BEGIN",
        "COMMIT",
        "ROLLBACK",
        "DECLARE c CURSOR FOR SELECT * FROM samples",
        "FETCH NEXT FROM c",
        "CLOSE c",
    ] {
        assert_eq!(
            check_pg_statement(ctx, &pg_statement(sql)).await,
            Ok(()),
            "{sql}"
        );
    }
    for (sql, what) in [
        // DataFusion cannot plan these; they are refused on the statement.
        ("SET LOCAL TIME ZONE 'UTC'", "SET LOCAL TIME ZONE 'UTC'"),
        // A name that is not a connection setting is a DataFusion setting.
        ("SET foo = 1", "SET foo"),
        (
            "DECLARE c CURSOR FOR SELECT 1 AS a INTO stash3",
            "CREATE TABLE stash3 (also CREATE TABLE ... AS and SELECT ... INTO)",
        ),
    ] {
        let r = check_pg_statement(ctx, &pg_statement(sql))
            .await
            .expect_err(sql);
        assert_eq!(r.what, what, "{sql}");
    }
}

/// fuzz/crashes/readonly_guard/crash-4bc374…: `EXECUTE` of a name with `#`
/// and non-ASCII letters. HTTP plans it and refuses it; over PostgreSQL the
/// statement's re-printed text did not plan, so it passed the check (and
/// then failed to run). SQL PREPARE, EXECUTE and DEALLOCATE are refused
/// over PostgreSQL by kind, planned or not, as HTTP refuses their plans.
#[tokio::test]
async fn postgres_refuses_sql_prepared_statements_by_kind() {
    let (_dir, engine) = engine();
    let ctx = engine.context();
    let crash = "\t\t\t\t\t\t\t\t\t\t\t\t\t\t\tEXECUTE\t\t\tT#EETO\u{76a}";
    let http = http_refusal(&engine, crash).await;
    assert!(http.to_string().contains("EXECUTE"), "{http}");
    for sql in [
        crash,
        "EXECUTE nowhere",
        "EXECUTE p(1, 2)",
        "PREPARE q AS SELECT 1",
        "DEALLOCATE q",
    ] {
        let statement = pg_statement(sql);
        let pg = check_pg_statement(ctx, &statement).await.expect_err(sql);
        assert!(
            pg.to_string().contains("SQL PREPARE keeps its plan"),
            "{sql}: {pg}"
        );
    }
}

/// fuzz/crashes/readonly_guard/crash-468c5d…: `SELECT 1BEGIN, INTO stash`.
/// DataFusion's dialect (HTTP) reads `INTO stash` as `SELECT … INTO`, a
/// `CREATE TABLE`, and refuses it. PostgreSQL's reads `INTO` as a column
/// alias, and the statement's re-printed text does not parse: the check
/// passes it, and the path that would run it fails on that same text before
/// running anything. The surfaces' verdicts differ; neither writes.
#[tokio::test]
async fn a_select_into_that_postgres_reads_as_an_alias_runs_on_neither_surface() {
    let (_dir, engine) = engine();
    let ctx = engine.context();
    let sql = "SELECT 1BEGIN, INTO stash";
    let http = http_refusal(&engine, sql).await;
    assert!(http.to_string().contains("CREATE TABLE stash"), "{http}");
    let statement = pg_statement(sql);
    let printed = statement.to_string();
    assert_eq!(printed, "SELECT 1 AS BEGIN, INTO AS stash");
    check_pg_statement(ctx, &statement).await.expect(sql);
    let before = snapshot(ctx);
    assert!(ctx.sql(&printed).await.is_err(), "{printed} planned");
    assert_eq!(snapshot(ctx), before);
}
