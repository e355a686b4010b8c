use super::*;
use crate::QueryError;
use datafusion::sql::sqlparser::dialect::PostgreSqlDialect;
use datafusion::sql::sqlparser::parser::Parser;
use datafusion_postgres::arrow_pg::datatypes::df::encode_dataframe;
use pgwire::api::portal::Format;
use pgwire::messages::data::DataRow;
use storage::{Label, SeriesKey, Storage, StorageConfig};

/// 2026-11-30T10:00:00Z in ms.
const T0: i64 = 1_796_032_800_000;
/// 2000-01-01T00:00:00Z in ms: PostgreSQL's epoch for binary timestamps.
const PG_EPOCH_MS: i64 = 946_684_800_000;

fn engine(limits: ResultLimits) -> (tempfile::TempDir, QueryEngine) {
    let dir = tempfile::tempdir().unwrap();
    let st = Arc::new(Storage::open(StorageConfig::new(dir.path())).unwrap());
    let key = SeriesKey::new(
        "DCGM_FI_DEV_GPU_TEMP",
        vec![Label::new("Hostname", "node-a"), Label::new("gpu", "0")],
    )
    .unwrap();
    let r = st.series_ref(key).unwrap();
    st.append(&[r; 3], &[T0, T0 + 1000, T0 + 2000], &[46.5, 47.0, -0.25])
        .unwrap();
    (dir, QueryEngine::with_limits(st, limits))
}

fn statement(sql: &str) -> Statement {
    Parser::parse_sql(&PostgreSqlDialect {}, sql)
        .unwrap()
        .remove(0)
}

/// The fields of a DataRow: each is an i32 length (-1: NULL) and the bytes.
fn fields(row: &DataRow) -> Vec<Option<Vec<u8>>> {
    let mut d = &row.data[..];
    let mut out = Vec::new();
    for _ in 0..row.field_count {
        let len = i32::from_be_bytes(d[..4].try_into().unwrap());
        d = &d[4..];
        if len < 0 {
            out.push(None);
        } else {
            out.push(Some(d[..len as usize].to_vec()));
            d = &d[len as usize..];
        }
    }
    assert!(d.is_empty(), "trailing bytes in a DataRow");
    out
}

async fn encoded(engine: &QueryEngine, sql: &str, format: Format) -> Vec<Vec<Option<Vec<u8>>>> {
    let df = engine.context().sql(sql).await.unwrap();
    let mut resp = encode_dataframe(df, &format, None).await.unwrap();
    let mut rows = Vec::new();
    while let Some(row) = resp.data_rows.next().await {
        rows.push(fields(&row.unwrap()));
    }
    rows
}

const TYPES_SQL: &str = "SELECT ts, host, value, count(*) OVER () AS n, value > 0 AS warm, \
                         gpu IS NULL AS no_gpu FROM samples ORDER BY ts LIMIT 1";

#[tokio::test]
async fn our_column_types_have_postgres_types() {
    let (_dir, engine) = engine(ResultLimits::default());
    let df = engine.context().sql(TYPES_SQL).await.unwrap();
    let resp = encode_dataframe(df, &Format::UnifiedText, None)
        .await
        .unwrap();
    let types: Vec<_> = resp
        .row_schema()
        .iter()
        .map(|f| f.datatype().clone())
        .collect();
    use pgwire::api::Type;
    assert_eq!(
        types,
        [
            Type::TIMESTAMPTZ,
            Type::TEXT,
            Type::FLOAT8,
            Type::INT8,
            Type::BOOL,
            Type::BOOL
        ]
    );
}

#[tokio::test]
async fn text_and_binary_results_encode_like_postgres() {
    let (_dir, engine) = engine(ResultLimits::default());
    let text = encoded(&engine, TYPES_SQL, Format::UnifiedText).await;
    let t = |s: &str| Some(s.as_bytes().to_vec());
    assert_eq!(
        text,
        [vec![
            t("2026-11-30 10:00:00.000000+00"),
            t("node-a"),
            t("46.5"),
            t("3"),
            t("t"),
            t("f"),
        ]]
    );
    let binary = encoded(&engine, TYPES_SQL, Format::UnifiedBinary).await;
    let micros_since_2000 = (T0 - PG_EPOCH_MS) * 1000;
    assert_eq!(
        binary,
        [vec![
            Some(micros_since_2000.to_be_bytes().to_vec()),
            t("node-a"),
            Some(46.5f64.to_be_bytes().to_vec()),
            Some(3i64.to_be_bytes().to_vec()),
            Some(vec![1]),
            Some(vec![0]),
        ]]
    );
}

#[tokio::test]
async fn results_stop_with_54000_past_the_row_limit() {
    let limits = ResultLimits {
        max_rows: 2,
        max_bytes: u64::MAX,
    };
    let (_dir, engine) = engine(limits);
    for (sql, ok_rows, fails) in [
        ("SELECT value FROM samples LIMIT 2", 2, false),
        ("SELECT value FROM samples", 2, true),
    ] {
        let df = engine.context().sql(sql).await.unwrap();
        let resp = encode_dataframe(df, &Format::UnifiedText, None)
            .await
            .unwrap();
        let mut rows = limit_rows(resp, limits, running(engine.guard()).await).data_rows;
        let (mut ok, mut err) = (0, None);
        while let Some(r) = rows.next().await {
            match r {
                Ok(_) => ok += 1,
                Err(e) => err = Some(ErrorInfo::from(e)),
            }
        }
        assert_eq!(ok, ok_rows, "{sql}");
        match err {
            Some(e) => {
                assert!(fails, "{sql}: {e:?}");
                assert_eq!(e.code, "54000");
                assert!(e.message.contains("more than 2 rows"), "{}", e.message);
            }
            None => assert!(!fails, "{sql} passed the limit"),
        }
    }
    // The HTTP path counts the same way.
    assert!(
        engine
            .sql("SELECT value FROM samples LIMIT 2")
            .await
            .is_ok()
    );
    assert!(matches!(
        engine.sql("SELECT value FROM samples").await,
        Err(QueryError::TooLarge(LimitExceeded::Rows { limit: 2 }))
    ));
}

#[tokio::test]
async fn byte_limit_applies_to_both_front_ends() {
    // Each text row of `value` is 4 bytes of length plus the digits.
    let limits = ResultLimits {
        max_rows: u64::MAX,
        max_bytes: 10,
    };
    let (_dir, engine) = engine(limits);
    let df = engine
        .context()
        .sql("SELECT value FROM samples ORDER BY ts")
        .await
        .unwrap();
    let resp = encode_dataframe(df, &Format::UnifiedText, None)
        .await
        .unwrap();
    let mut rows = limit_rows(resp, limits, running(engine.guard()).await).data_rows;
    // "46.5" -> 8 bytes: fits; "47" -> 6 more: 14 > 10.
    assert!(rows.next().await.unwrap().is_ok());
    let e = ErrorInfo::from(rows.next().await.unwrap().unwrap_err());
    assert_eq!(e.code, "54000");
    assert!(e.message.contains("--max-result-bytes"), "{}", e.message);
    assert!(rows.next().await.is_none());
    assert!(matches!(
        engine.sql("SELECT value FROM samples").await,
        Err(QueryError::TooLarge(LimitExceeded::Bytes { limit: 10 }))
    ));
}

#[tokio::test]
async fn only_read_only_statements_pass() {
    let (_dir, engine) = engine(ResultLimits::default());
    let hook = ReadOnlyHook {
        metrics: engine.readonly_metrics().clone(),
    };
    for ok in [
        "SELECT 1",
        "WITH x AS (SELECT 1) SELECT * FROM x",
        "EXPLAIN SELECT * FROM samples",
        "SHOW search_path",
        "BEGIN",
        "COMMIT",
        "SET application_name = 'grafana'",
        "SET extra_float_digits = 3",
        "SET TIME ZONE 'UTC'",
        "DECLARE c CURSOR FOR SELECT 1",
    ] {
        let verdict = hook.check(&statement(ok), engine.context()).await;
        assert!(verdict.is_none(), "{ok}: {verdict:?}");
    }
    let bad = [
        "CREATE TABLE t (x INT)",
        "CREATE VIEW v AS SELECT 1",
        "DROP TABLE samples",
        "INSERT INTO samples (metric) VALUES ('m')",
        "DELETE FROM samples",
        "COPY samples TO '/tmp/x.csv'",
        "EXPLAIN INSERT INTO samples (metric) VALUES ('m')",
        "SET datafusion.execution.batch_size = 1",
        "SET LOCAL TIME ZONE 'UTC'",
        // issue #14: these passed a check on the statement's kind.
        "SELECT 1 AS a INTO stash1",
        "DECLARE c CURSOR FOR SELECT 1 AS a INTO stash2",
    ];
    for sql in bad {
        let e = hook
            .check(&statement(sql), engine.context())
            .await
            .unwrap_or_else(|| panic!("{sql} passed"));
        let info = ErrorInfo::from(e);
        assert_eq!(info.code, "25006", "{sql}");
        assert!(
            info.message.starts_with("gpulse is read-only: "),
            "{sql}: {}",
            info.message
        );
    }
    assert_eq!(
        engine
            .readonly_metrics()
            .pg_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        bad.len() as u64
    );
    // Nothing was created on the way.
    let tables = engine
        .context()
        .catalog("datafusion")
        .unwrap()
        .schema("public")
        .unwrap()
        .table_names();
    for t in ["t", "v", "stash1", "stash2"] {
        assert!(!tables.contains(&t.to_owned()), "{t} in {tables:?}");
    }
}

#[tokio::test]
async fn the_extended_protocol_is_checked_at_parse_and_on_the_plan_it_runs() {
    let (_dir, engine) = engine(ResultLimits::default());
    let hook = ReadOnlyHook {
        metrics: engine.readonly_metrics().clone(),
    };
    let ctx = engine.context();
    let mut client = datafusion_postgres::testing::MockClient::new();
    let code = |e: PgWireError| ErrorInfo::from(e).code;
    // Parse: a write fails before a portal exists.
    match hook
        .handle_extended_parse_query(&statement("SELECT 1 AS a INTO stash1"), ctx, &client)
        .await
    {
        Some(Err(e)) => assert_eq!(code(e), "25006"),
        Some(Ok(plan)) => panic!("planned as {plan}"),
        None => panic!("passed"),
    }
    assert!(
        hook.handle_extended_parse_query(&statement("SELECT 1"), ctx, &client)
            .await
            .is_none()
    );
    // Execute: the plan decides, whatever statement it came with.
    let no_params = ParamValues::List(vec![]);
    let write = ctx
        .state()
        .create_logical_plan("INSERT INTO samples (metric) VALUES ('m')")
        .await
        .unwrap();
    match hook
        .handle_extended_query(&statement("SELECT 1"), &write, &no_params, ctx, &mut client)
        .await
    {
        Some(Err(e)) => assert_eq!(code(e), "25006"),
        Some(Ok(_)) => panic!("ran"),
        None => panic!("passed"),
    }
    let read = ctx.state().create_logical_plan("SELECT 1").await.unwrap();
    assert!(
        hook.handle_extended_query(&statement("SELECT 1"), &read, &no_params, ctx, &mut client)
            .await
            .is_none()
    );
    assert_eq!(
        engine
            .readonly_metrics()
            .pg_refused
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

#[tokio::test]
async fn errors_get_a_sqlstate_and_the_http_message() {
    let (_dir, engine) = engine(ResultLimits::default());
    for (sql, code) in [
        ("SELECT no_such_column FROM samples", "42703"),
        ("SELECT * FROM no_such_table", "42P01"),
        ("SELEC 1", "42601"),
    ] {
        let df_err = engine.context().sql(sql).await.unwrap_err();
        let http_message = match engine.sql(sql).await {
            Err(e @ QueryError::BadQuery(_)) => e.to_string(),
            other => panic!("{sql}: {other:?}"),
        };
        let mut e = PgWireError::ApiError(Box::new(df_err));
        with_sqlstate(&mut e);
        let info = ErrorInfo::from(e);
        assert_eq!(
            (info.severity.as_str(), info.code.as_str()),
            ("ERROR", code),
            "{sql}"
        );
        assert_eq!(info.message, http_message);
    }
    // A parser error from the PostgreSQL-compatible parser.
    let mut e = PgWireError::ApiError(Box::new(ParserError::ParserError("boom".into())));
    with_sqlstate(&mut e);
    assert_eq!(ErrorInfo::from(e).code, "42601");
}

#[tokio::test]
async fn rows_stop_with_57014_at_the_deadline_and_free_the_slot() {
    let (_dir, engine) = engine(ResultLimits::default());
    let guard = Arc::new(crate::limits::QueryGuard::new(crate::limits::QueryLimits {
        timeout: std::time::Duration::from_millis(300),
        max_concurrent: 1,
        ..Default::default()
    }));
    let df = engine
        .context()
        .sql("SELECT value FROM samples ORDER BY ts")
        .await
        .unwrap();
    let resp = encode_dataframe(df, &Format::UnifiedText, None)
        .await
        .unwrap();
    let mut rows = limit_rows(resp, ResultLimits::default(), running(&guard).await).data_rows;
    assert!(rows.next().await.unwrap().is_ok());
    assert_eq!(
        guard
            .metrics()
            .running
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    let e = ErrorInfo::from(rows.next().await.unwrap().unwrap_err());
    assert_eq!(e.code, "57014");
    assert!(e.message.contains("--query-timeout"), "{}", e.message);
    assert!(rows.next().await.is_none());
    drop(rows);
    assert_eq!(
        guard
            .metrics()
            .running
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    assert_eq!(
        guard
            .metrics()
            .timeout
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}
