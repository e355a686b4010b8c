//! Read-only by plan (issue #14): one corpus of statements through both SQL
//! surfaces of a real `gpulse serve`, `POST /api/v1/sql` and the real
//! `psql`, with the same verdict expected from each, and afterwards no
//! table, view, schema or setting changed, as seen from both.
//!
//! The verdicts are written here by hand: a read answers (HTTP 200, psql
//! exit 0); a write is refused, over HTTP with 400 `bad_data` and over
//! PostgreSQL with SQLSTATE 25006, with the same message on both.

use serde_json::Value;

use crate::pg::psql;
use crate::support::Node;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// It ran.
    Ran,
    /// Refused by the read-only guard, with this message.
    Refused(String),
    /// Any other failure: status or SQLSTATE, and the message.
    Failed(String),
}

const PREFIX: &str = "gpulse is read-only: ";

/// Statements that must run on both surfaces.
const READS: &[&str] = &[
    "SELECT 1",
    "select count(*) from samples",
    "  SELECT  1 AS a  -- a comment\n",
    "/* leading comment */ SELECT 2",
    "WITH x AS (SELECT 1 AS a) SELECT a FROM x",
    "VALUES (1, 'a'), (2, 'b')",
    "SELECT * FROM samples WHERE value IN (SELECT max(value) FROM samples)",
    "EXPLAIN SELECT * FROM samples",
    "explain analyze select count(*) from samples",
    "SHOW TABLES",
    "SELECT table_schema, table_name FROM information_schema.tables ORDER BY 1, 2",
    "SELECT column_name, data_type FROM information_schema.columns WHERE table_name = 'samples'",
    // The catalog queries behind psql's \dt and \d (simplified; the
    // PostgreSQL listener also takes `pg_catalog.`-qualified function
    // names, DataFusion's parser over HTTP does not).
    "SELECT n.nspname, c.relname FROM pg_catalog.pg_class c \
     LEFT JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
     WHERE c.relkind IN ('r', 'p', 'v') AND n.nspname <> 'pg_catalog' \
     AND n.nspname <> 'information_schema' AND pg_table_is_visible(c.oid) \
     ORDER BY 1, 2",
    "SELECT a.attname, format_type(a.atttypid, a.atttypmod) \
     FROM pg_catalog.pg_attribute a WHERE a.attrelid = \
     (SELECT c.oid FROM pg_catalog.pg_class c WHERE c.relname = 'samples') \
     AND a.attnum > 0 ORDER BY a.attnum",
    "SELECT nspname FROM pg_catalog.pg_namespace ORDER BY 1",
    "SELECT * FROM rollup_1m LIMIT 1",
];

/// Statements that must be refused on both surfaces.
const WRITES: &[&str] = &[
    // issue #14: over psql this created a table HTTP then saw.
    "SELECT 1 AS a INTO stash1",
    "select * into stash2 from samples",
    "SELECT 1 AS a\n  INTO\tstash3 -- trailing comment",
    "CREATE TABLE stash4 AS SELECT 1 AS a",
    "create table stash5 (x int)",
    "/* why not */ CREATE VIEW stash6 AS SELECT * FROM samples",
    "CREATE SCHEMA stash7",
    "CREATE DATABASE stash8",
    "DROP TABLE samples",
    "drop view if exists pg_tables",
    "DROP SCHEMA public",
    "INSERT INTO samples (metric) VALUES ('x')",
    "insert into samples (metric) select 'y'",
    "DELETE FROM samples",
    "UPDATE samples SET value = 1",
    "COPY samples TO '/tmp/gpulse-readonly-copy.csv'",
    "copy (select 1) to '/tmp/gpulse-readonly-copy.parquet'",
    "EXPLAIN INSERT INTO samples (metric) VALUES ('x')",
    "EXPLAIN ANALYZE INSERT INTO samples (metric) VALUES ('x')",
    "SET datafusion.execution.batch_size = 1",
    "set DATAFUSION.EXECUTION.BATCH_SIZE to 1",
    "SET datafusion.catalog.information_schema = false",
    "SET foo.bar = 1",
    "PREPARE p AS SELECT 1",
    "EXECUTE p",
    "DEALLOCATE p",
    // Several statements in one string: a write anywhere refuses it.
    "SELECT 1; DROP TABLE samples",
    "SELECT 1 AS a INTO stash10; SELECT 2",
    "SELECT 1;\n-- then\nCREATE TABLE stash11 AS SELECT 1;",
];

fn over_http(node: &Node, sql: &str) -> Verdict {
    let (status, body) = node.sql_raw(sql);
    let error = body["error"].as_str().unwrap_or_default().to_owned();
    match status {
        200 => Verdict::Ran,
        400 if body["errorType"] == "bad_data" && error.starts_with(PREFIX) => {
            Verdict::Refused(error)
        }
        _ => Verdict::Failed(format!("HTTP {status}: {body}")),
    }
}

fn over_psql(node: &Node, sql: &str) -> Verdict {
    let out = psql(node, &[sql]);
    if out.status.success() {
        return Verdict::Ran;
    }
    let err = String::from_utf8_lossy(&out.stderr);
    // VERBOSITY=verbose: "ERROR:  25006: <message>" on one line.
    match err
        .lines()
        .find_map(|l| l.strip_prefix("ERROR:  25006: "))
        .filter(|m| m.starts_with(PREFIX))
    {
        Some(m) => Verdict::Refused(m.to_owned()),
        None => Verdict::Failed(err.into_owned()),
    }
}

/// The tables, schemas and settings of the shared context, from both
/// surfaces: (HTTP rows, psql lines).
fn shared_state(node: &Node) -> Vec<String> {
    let tables = "SELECT table_catalog, table_schema, table_name, table_type \
                  FROM information_schema.tables ORDER BY 1, 2, 3";
    let schemata =
        "SELECT catalog_name, schema_name FROM information_schema.schemata ORDER BY 1, 2";
    let settings = "SELECT name, value FROM information_schema.df_settings ORDER BY 1";
    let mut state = Vec::new();
    for sql in [tables, schemata, settings] {
        let http: Vec<String> = node
            .sql(sql)
            .iter()
            .map(|row| {
                row.iter()
                    .map(|v| match v {
                        Value::String(s) => s.clone(),
                        Value::Null => String::new(),
                        other => other.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("|")
            })
            .collect();
        let out = psql(node, &[sql]);
        assert!(
            out.status.success(),
            "{sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let pg: Vec<String> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(str::to_owned)
            .collect();
        assert_eq!(http, pg, "{sql}: HTTP and PostgreSQL see different things");
        assert!(!http.is_empty(), "{sql}");
        state.extend(http);
    }
    state
}

/// `gpulse_sql_statements_refused_total` per protocol, from `/metrics`.
fn refused_counts(node: &Node) -> (u64, u64) {
    let body = ureq::get(&format!("{}/metrics", node.http_url))
        .call()
        .expect("GET /metrics")
        .body_mut()
        .read_to_string()
        .expect("metrics body");
    let count = |protocol: &str| {
        let key = format!("gpulse_sql_statements_refused_total{{protocol=\"{protocol}\"}} ");
        body.lines()
            .find_map(|l| l.strip_prefix(key.as_str()))
            .unwrap_or_else(|| panic!("no {key} in /metrics"))
            .parse()
            .unwrap()
    };
    (count("http"), count("postgres"))
}

#[test]
fn both_surfaces_give_the_same_verdicts_and_nothing_is_written() {
    assert!(READS.len() + WRITES.len() >= 30);
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let before = shared_state(&node);
    assert!(
        before
            .iter()
            .any(|r| r.ends_with("|public|samples|BASE TABLE")),
        "{before:?}"
    );

    let mut wrong = Vec::new();
    for sql in READS {
        let (http, pg) = (over_http(&node, sql), over_psql(&node, sql));
        if http != Verdict::Ran || pg != Verdict::Ran {
            wrong.push(format!("read {sql:?}: HTTP {http:?}, psql {pg:?}"));
        }
    }
    for sql in WRITES {
        let (http, pg) = (over_http(&node, sql), over_psql(&node, sql));
        match (&http, &pg) {
            (Verdict::Refused(h), Verdict::Refused(p)) if h == p => {}
            _ => wrong.push(format!("write {sql:?}: HTTP {http:?}, psql {pg:?}")),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} wrong:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    assert_eq!(
        refused_counts(&node),
        (WRITES.len() as u64, WRITES.len() as u64)
    );
    // DataFusion's own syntax: refused over HTTP; the PostgreSQL parser
    // does not know it (a syntax error, so it cannot run either).
    let external = "CREATE EXTERNAL TABLE stash9 STORED AS CSV LOCATION '/tmp/gpulse-readonly.csv'";
    assert!(matches!(over_http(&node, external), Verdict::Refused(_)));
    assert!(
        matches!(over_psql(&node, external), Verdict::Failed(m) if m.contains("ERROR:  42601")),
        "{external}"
    );
    // psql's own \dt and \d still work, and list only gpulse's tables.
    let out = psql(&node, &["\\dt", "\\d samples"]);
    let listed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        listed.contains("samples") && !listed.contains("stash"),
        "{listed}"
    );

    // Nothing was created, dropped or set, seen from either surface.
    assert_eq!(shared_state(&node), before);
    for stash in ["stash1", "stash4", "stash10"] {
        let sql = format!("SELECT * FROM {stash}");
        assert!(
            matches!(over_http(&node, &sql), Verdict::Failed(m) if m.starts_with("HTTP 400")),
            "{stash} exists"
        );
        assert!(
            matches!(over_psql(&node, &sql), Verdict::Failed(m) if m.contains("42P01")),
            "{stash} exists"
        );
    }
    for file in [
        "/tmp/gpulse-readonly-copy.csv",
        "/tmp/gpulse-readonly-copy.parquet",
        "/tmp/gpulse-readonly.csv",
    ] {
        assert!(!std::path::Path::new(file).exists(), "{file} was written");
    }
    node.stop();
}

/// What only a PostgreSQL session has: connection settings, transactions
/// and cursors run over psql and change nothing HTTP sees; over HTTP (no
/// session) a SET is a shared setting and is refused (`SET TIME ZONE`, which
/// DataFusion cannot plan, fails with 400).
#[test]
fn connection_statements_stay_in_the_connection() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let before = shared_state(&node);
    for sql in [
        "SET application_name = 'grafana'",
        "SET DateStyle = 'ISO, MDY'",
        "SET extra_float_digits = 3",
        "SET statement_timeout = '5s'",
        "SET client_encoding = 'UTF8'",
        "SET TIME ZONE 'Europe/Berlin'",
    ] {
        assert_eq!(over_psql(&node, sql), Verdict::Ran, "{sql}");
        // DataFusion does not plan SET TIME ZONE: 400, but no refusal.
        let http = over_http(&node, sql);
        assert!(
            matches!(&http, Verdict::Refused(_))
                || matches!(&http, Verdict::Failed(m) if m.starts_with("HTTP 400")),
            "{sql} over HTTP: {http:?}"
        );
    }
    let out = psql(
        &node,
        &[
            "BEGIN",
            "DECLARE c CURSOR FOR SELECT 41 + 1 AS a",
            "FETCH NEXT FROM c",
            "CLOSE c",
            "COMMIT",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("42"));
    // A cursor over a write is refused like the write itself.
    let cursor = over_psql(&node, "DECLARE c CURSOR FOR SELECT 1 AS a INTO stash12");
    assert_eq!(
        cursor,
        over_http(&node, "SELECT 1 AS a INTO stash12"),
        "cursor"
    );
    assert!(matches!(cursor, Verdict::Refused(_)), "{cursor:?}");
    // A SET that is not a connection setting is refused over psql too.
    assert!(matches!(
        over_psql(&node, "SET LOCAL TIME ZONE 'UTC'"),
        Verdict::Refused(_)
    ));
    assert_eq!(shared_state(&node), before);
    node.stop();
}
