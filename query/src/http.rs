//! HTTP query API.
//!
//! `POST /api/v1/sql` runs one SQL statement. The query is the body (plain
//! text), a JSON body `{"query": "..."}`, or the `query` URL parameter (GET
//! too). The output format is picked by the `format` parameter or the `Accept`
//! header: `json` (default), `csv` or `arrow` (Arrow IPC stream).
//!
//! JSON answer:
//! `{"columns":[{"name":"ts","type":"Timestamp(ms, \"UTC\")"},...],"rows":[[...],...],"row_count":N}`.
//! Non-finite floats are the strings `"NaN"`, `"+Inf"`, `"-Inf"`; timestamps
//! are RFC 3339 strings. Errors: HTTP 400 (bad query), 422 (the result passes
//! the engine's [`crate::ResultLimits`]) or 500 with
//! `{"status":"error","errorType":"bad_data"|"too_large"|"execution","error":"..."}`.
//!
//! Cluster mode: a result that lacks a shard (no replica could serve it) has
//! the header `X-Gpulse-Partial: true` in every format, one
//! `X-Gpulse-Warning` header per warning (when the text is a valid header
//! value), and in JSON a `"warnings":["..."]` field. A cluster that refuses
//! to answer (a peer with another cluster file) gives 503 with `errorType`
//! `unavailable`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use arrow::array::{Array, AsArray, RecordBatch};
use arrow::datatypes::{DataType, Float64Type, Int64Type, UInt64Type};
use arrow::util::display::{ArrayFormatter, FormatOptions};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tracing::debug;

use crate::{QueryEngine, QueryError, QueryResult};

/// Set to `true` on a result that lacks data (cluster mode).
pub const PARTIAL_HEADER: &str = "x-gpulse-partial";
/// One per warning of a partial result.
pub const WARNING_HEADER: &str = "x-gpulse-warning";

/// Builds the router of the HTTP API.
pub fn router(engine: QueryEngine) -> Router {
    Router::new()
        .route("/api/v1/sql", get(sql).post(sql))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(Arc::new(engine))
}

/// Limits of the HTTP listener ([`serve_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpConfig {
    /// HTTP/1: a client must send a request's complete headers within this
    /// long of connecting, or of the previous response on a kept-alive
    /// connection (so it is also the idle keep-alive timeout); otherwise the
    /// connection is closed (slowloris). HTTP/2: a PING after this long
    /// without frames, and the connection closes if the answer takes more
    /// than 20 s. Default 30 s (`--http-header-timeout`).
    pub header_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(30),
        }
    }
}

/// Counters of the HTTP listener's edges, for `/metrics`.
#[derive(Debug, Default)]
pub struct EdgeMetrics {
    /// Connections accepted.
    pub connections: AtomicU64,
    /// Connections closed because the request headers did not arrive within
    /// [`HttpConfig::header_timeout`] (slow clients, idle keep-alive ends
    /// quietly and is not counted).
    pub header_timeouts: AtomicU64,
    /// Admin requests refused as cross-origin or simple (browser-sendable).
    pub admin_refused: AtomicU64,
}

impl EdgeMetrics {
    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        for (name, help, v) in [
            (
                "gpulse_http_connections_total",
                "HTTP connections accepted.",
                &self.connections,
            ),
            (
                "gpulse_http_header_timeouts_total",
                "HTTP connections closed: request headers not complete within --http-header-timeout.",
                &self.header_timeouts,
            ),
            (
                "gpulse_http_admin_refused_total",
                "Admin requests refused (403/415): a cross-origin Origin or a browser-sendable content type.",
                &self.admin_refused,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
    }
}

/// A connection's byte stream: TCP, or TLS over it.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// Serves `router` (usually [`router`], merged with others such as
/// [`crate::promql::api::router`]) on `listener` until `shutdown` resolves,
/// then lets in-flight requests finish. Default [`HttpConfig`].
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(
        listener,
        router,
        HttpConfig::default(),
        Arc::default(),
        None,
        shutdown,
    )
    .await
}

/// As [`serve`], with the listener's limits and counters. HTTP/1.1 and
/// HTTP/2 (prior knowledge) on one port, as `axum::serve`, but on hyper's
/// connection builder, which has the header read timeout that
/// `axum::serve` does not expose. Accept errors (out of file descriptors)
/// are logged and retried after 50 ms, never fatal. With `tls`, each
/// connection's handshake runs in its own task (ALPN: h2, http/1.1).
///
/// # Errors
/// None today; the signature keeps room for listener errors.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    router: Router,
    config: HttpConfig,
    metrics: Arc<EdgeMetrics>,
    tls: Option<Arc<auth::tls::ServerTls>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto::Builder;
    use hyper_util::service::TowerToHyperService;

    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.header_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(config.header_timeout)
        .keep_alive_timeout(Duration::from_secs(20));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "HTTP accept failed; retrying in 50 ms");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        metrics.connections.fetch_add(1, Relaxed);
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let (builder, watcher, metrics, tls) = (
            builder.clone(),
            graceful.watcher(),
            metrics.clone(),
            tls.clone(),
        );
        tokio::spawn(async move {
            // The handshake runs here, off the accept loop.
            let io: Box<dyn Io> = match tls {
                Some(tls) => match tls.accept(auth::tls::Listener::Http, stream).await {
                    Ok(s) => Box::new(s),
                    Err(_) => return,
                },
                None => Box::new(stream),
            };
            let conn = builder.serve_connection(TokioIo::new(io), service);
            if let Err(e) = watcher.watch(conn).await {
                let timeout = e
                    .downcast_ref::<hyper::Error>()
                    .is_some_and(hyper::Error::is_timeout);
                if timeout {
                    metrics.header_timeouts.fetch_add(1, Relaxed);
                }
                debug!(%peer, error = %e, timeout, "HTTP connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Csv,
    Arrow,
}

fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"status": "error", "errorType": kind, "error": message});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// Maps query errors onto HTTP, in one place.
fn http_status(e: &QueryError) -> (StatusCode, &'static str) {
    match e {
        QueryError::Refused(r) => (
            StatusCode::from_u16(r.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            r.error_type(),
        ),
        QueryError::BadQuery(_) | QueryError::ReadOnly(_) => (StatusCode::BAD_REQUEST, "bad_data"),
        QueryError::Execution(_) => (StatusCode::INTERNAL_SERVER_ERROR, "execution"),
        QueryError::TooLarge(_) => (StatusCode::UNPROCESSABLE_ENTITY, "too_large"),
        QueryError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
    }
}

async fn sql(
    State(engine): State<Arc<QueryEngine>>,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let query = if let Some(q) = params.get("query") {
        q.clone()
    } else if content_type.starts_with("application/json") {
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(o)) => match o.get("query") {
                Some(Value::String(q)) => q.clone(),
                _ => {
                    return error_response(
                        StatusCode::BAD_REQUEST,
                        "bad_data",
                        "JSON body needs a string field \"query\"",
                    );
                }
            },
            _ => {
                return error_response(
                    StatusCode::BAD_REQUEST,
                    "bad_data",
                    "body is not a JSON object",
                );
            }
        }
    } else {
        match String::from_utf8(body.to_vec()) {
            Ok(q) => q,
            Err(_) => {
                return error_response(StatusCode::BAD_REQUEST, "bad_data", "query is not UTF-8");
            }
        }
    };
    if query.trim().is_empty() {
        return error_response(
            StatusCode::BAD_REQUEST,
            "bad_data",
            "empty query: send SQL as the body or the query parameter",
        );
    }
    let format = match pick_format(params.get("format").map(String::as_str), &headers) {
        Ok(f) => f,
        Err(msg) => return error_response(StatusCode::BAD_REQUEST, "bad_data", &msg),
    };
    debug!(%query, ?format, "sql");
    let result = match engine.sql(&query).await {
        Ok(r) => r,
        Err(e) => {
            let (status, kind) = http_status(&e);
            return error_response(status, kind, &e.to_string());
        }
    };
    let rendered = match format {
        Format::Json => {
            let mut out = Vec::with_capacity(64 * result.num_rows() + 256);
            write_json(&result, &mut out).map(|()| ("application/json", out))
        }
        Format::Csv => to_csv(&result).map(|b| ("text/csv; charset=utf-8", b)),
        Format::Arrow => to_arrow_ipc(&result).map(|b| ("application/vnd.apache.arrow.stream", b)),
    };
    match rendered {
        Ok((ct, bytes)) => {
            let mut response = ([(header::CONTENT_TYPE, ct)], bytes).into_response();
            if !result.warnings.is_empty() {
                let h = response.headers_mut();
                h.insert(PARTIAL_HEADER, header::HeaderValue::from_static("true"));
                for w in &result.warnings {
                    if let Ok(v) = header::HeaderValue::from_str(w) {
                        h.append(WARNING_HEADER, v);
                    }
                }
            }
            response
        }
        Err(e) => error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "execution",
            &e.to_string(),
        ),
    }
}

fn pick_format(param: Option<&str>, headers: &HeaderMap) -> Result<Format, String> {
    if let Some(p) = param {
        return match p {
            "json" => Ok(Format::Json),
            "csv" => Ok(Format::Csv),
            "arrow" => Ok(Format::Arrow),
            other => Err(format!("unknown format {other:?}: use json, csv or arrow")),
        };
    }
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    Ok(if accept.contains("application/vnd.apache.arrow.stream") {
        Format::Arrow
    } else if accept.contains("text/csv") {
        Format::Csv
    } else {
        Format::Json
    })
}

/// Renders a result as the JSON described in the module docs, as a value
/// for tests to index (the handler writes the bytes with [`write_json`]).
#[cfg(test)]
pub(crate) fn to_json(result: &QueryResult) -> Result<Value, arrow::error::ArrowError> {
    let mut out = Vec::new();
    write_json(result, &mut out)?;
    serde_json::from_slice(&out).map_err(|e| arrow::error::ArrowError::JsonError(e.to_string()))
}

/// Writes a result as the JSON described in the module docs, cell by cell
/// straight from the Arrow arrays. Building a `serde_json::Value` tree first
/// took two thirds of a 31,800-row answer's time, most of it in `malloc`
/// and `free` (docs/BENCHMARKS.md, "SQL answers written without a JSON tree").
pub fn write_json(result: &QueryResult, out: &mut Vec<u8>) -> Result<(), arrow::error::ArrowError> {
    // Keys in serde_json's default (sorted) order, as the `json!` tree had them.
    out.extend_from_slice(b"{\"columns\":[");
    for (n, f) in result.schema.fields().iter().enumerate() {
        if n > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"name\":");
        json_str(out, f.name());
        out.extend_from_slice(b",\"type\":");
        json_str(out, &f.data_type().to_string());
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"row_count\":");
    out.extend_from_slice(itoa::Buffer::new().format(result.num_rows()).as_bytes());
    out.extend_from_slice(b",\"rows\":[");
    let options = FormatOptions::default();
    let mut scratch = String::new();
    let mut first = true;
    for batch in &result.batches {
        let cells: Vec<JsonColumn<'_>> = batch
            .columns()
            .iter()
            .map(|a| JsonColumn::new(a.as_ref(), &options))
            .collect::<Result<_, _>>()?;
        for r in 0..batch.num_rows() {
            if !first {
                out.push(b',');
            }
            first = false;
            out.push(b'[');
            for (n, c) in cells.iter().enumerate() {
                if n > 0 {
                    out.push(b',');
                }
                c.write(r, out, &mut scratch);
            }
            out.push(b']');
        }
    }
    out.push(b']');
    if !result.warnings.is_empty() {
        out.extend_from_slice(b",\"warnings\":[");
        for (n, w) in result.warnings.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            json_str(out, w);
        }
        out.push(b']');
    }
    out.push(b'}');
    Ok(())
}

/// A JSON string, escaped as serde_json escapes it.
fn json_str(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(out, s).expect("writing to a Vec cannot fail");
}

/// One column's cells as JSON: numbers as numbers (non-finite floats as
/// strings), everything else as its Arrow display text, and `null` where
/// the column's logical nulls say so (a `NULL` literal's column has no
/// validity buffer; its logical nulls are every cell).
struct JsonColumn<'a> {
    nulls: Option<arrow::buffer::NullBuffer>,
    cells: Cells<'a>,
}

enum Cells<'a> {
    Bool(&'a arrow::array::BooleanArray),
    Int(arrow::array::ArrayRef),
    UInt(arrow::array::ArrayRef),
    Float(arrow::array::ArrayRef),
    Text(ArrayFormatter<'a>),
}

impl<'a> JsonColumn<'a> {
    fn new(
        a: &'a dyn Array,
        options: &'a FormatOptions<'a>,
    ) -> Result<Self, arrow::error::ArrowError> {
        let cells = match a.data_type() {
            DataType::Boolean => Cells::Bool(a.as_boolean()),
            DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
                Cells::Int(arrow::compute::cast(a, &DataType::Int64)?)
            }
            DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
                Cells::UInt(arrow::compute::cast(a, &DataType::UInt64)?)
            }
            DataType::Float16 | DataType::Float32 | DataType::Float64 => {
                Cells::Float(arrow::compute::cast(a, &DataType::Float64)?)
            }
            _ => Cells::Text(ArrayFormatter::try_new(a, options)?),
        };
        Ok(Self {
            nulls: a.logical_nulls(),
            cells,
        })
    }

    fn write(&self, i: usize, out: &mut Vec<u8>, scratch: &mut String) {
        use std::fmt::Write as _;
        if self.nulls.as_ref().is_some_and(|n| n.is_null(i)) {
            out.extend_from_slice(b"null");
            return;
        }
        match &self.cells {
            Cells::Bool(b) => out.extend_from_slice(if b.value(i) { b"true" } else { b"false" }),
            Cells::Int(c) => {
                let v = c.as_primitive::<Int64Type>().value(i);
                out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
            }
            Cells::UInt(c) => {
                let v = c.as_primitive::<UInt64Type>().value(i);
                out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
            }
            Cells::Float(c) => {
                let v = c.as_primitive::<Float64Type>().value(i);
                if v.is_nan() {
                    out.extend_from_slice(b"\"NaN\"");
                } else if v.is_infinite() {
                    out.extend_from_slice(if v > 0.0 { b"\"+Inf\"" } else { b"\"-Inf\"" });
                } else {
                    serde_json::to_writer(out, &v).expect("writing to a Vec cannot fail");
                }
            }
            Cells::Text(f) => {
                scratch.clear();
                // An ArrayFormatter only fails on a value it cannot display,
                // which try_new already refused.
                let _ = write!(scratch, "{}", f.value(i));
                json_str(out, scratch);
            }
        }
    }
}

fn to_csv(result: &QueryResult) -> Result<Vec<u8>, arrow::error::ArrowError> {
    let mut out = Vec::new();
    {
        let mut w = arrow::csv::WriterBuilder::new()
            .with_header(true)
            .build(&mut out);
        if result.batches.is_empty() {
            w.write(&RecordBatch::new_empty(result.schema.clone()))?;
        }
        for b in &result.batches {
            w.write(b)?;
        }
    }
    Ok(out)
}

fn to_arrow_ipc(result: &QueryResult) -> Result<Vec<u8>, arrow::error::ArrowError> {
    let mut out = Vec::new();
    {
        let mut w = arrow::ipc::writer::StreamWriter::try_new(&mut out, &result.schema)?;
        for b in &result.batches {
            w.write(b)?;
        }
        w.finish()?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{
        BooleanArray, Float32Array, Float64Array, Int32Array, NullArray, StringArray,
        TimestampMillisecondArray, UInt8Array,
    };
    use arrow::datatypes::{Field, Schema};

    fn result(warnings: Vec<String>) -> QueryResult {
        let schema = Arc::new(Schema::new(vec![
            Field::new("s", DataType::Utf8, true),
            Field::new(
                "ts",
                DataType::Timestamp(arrow::datatypes::TimeUnit::Millisecond, Some("UTC".into())),
                true,
            ),
            Field::new("f", DataType::Float64, true),
            Field::new("g", DataType::Float32, true),
            Field::new("i", DataType::Int32, true),
            Field::new("u", DataType::UInt8, true),
            Field::new("b", DataType::Boolean, true),
            Field::new("n", DataType::Null, true),
        ]));
        let batch = |s: Vec<Option<&str>>, ts: Vec<Option<i64>>, f: Vec<Option<f64>>, n: usize| {
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(s)),
                    Arc::new(TimestampMillisecondArray::from(ts).with_timezone("UTC")),
                    Arc::new(Float64Array::from(f)),
                    Arc::new(Float32Array::from(vec![Some(0.5f32); n])),
                    Arc::new(Int32Array::from(vec![Some(-7); n])),
                    Arc::new(UInt8Array::from(vec![None; n])),
                    Arc::new(BooleanArray::from(vec![Some(true); n])),
                    Arc::new(NullArray::new(n)),
                ],
            )
            .unwrap()
        };
        QueryResult {
            schema: schema.clone(),
            batches: vec![
                batch(
                    vec![Some("a\"b\\c\n"), None],
                    vec![Some(1_765_065_600_123), None],
                    vec![Some(1.0), Some(f64::NAN)],
                    2,
                ),
                batch(
                    vec![Some("é")],
                    vec![Some(0)],
                    vec![Some(f64::NEG_INFINITY)],
                    1,
                ),
                batch(vec![], vec![], vec![], 0),
                batch(vec![Some("")], vec![Some(-1)], vec![Some(f64::INFINITY)], 1),
            ],
            warnings,
        }
    }

    /// The bytes a client gets, against the text written out by hand.
    #[test]
    fn a_result_is_written_as_json_cell_by_cell() {
        let mut out = Vec::new();
        write_json(&result(vec![]), &mut out).unwrap();
        let want = concat!(
            r#"{"columns":[{"name":"s","type":"Utf8"},{"name":"ts","type":"Timestamp(ms, \"UTC\")"},"#,
            r#"{"name":"f","type":"Float64"},{"name":"g","type":"Float32"},{"name":"i","type":"Int32"},"#,
            r#"{"name":"u","type":"UInt8"},{"name":"b","type":"Boolean"},{"name":"n","type":"Null"}],"#,
            r#""row_count":4,"rows":["#,
            r#"["a\"b\\c\n","2025-12-07T00:00:00.123Z",1.0,0.5,-7,null,true,null],"#,
            r#"[null,null,"NaN",0.5,-7,null,true,null],"#,
            r#"["é","1970-01-01T00:00:00Z","-Inf",0.5,-7,null,true,null],"#,
            r#"["","1969-12-31T23:59:59.999Z","+Inf",0.5,-7,null,true,null]]}"#,
        );
        assert_eq!(String::from_utf8(out).unwrap(), want);
    }

    /// A dictionary cell whose key is valid but whose value is null is
    /// null (its logical nulls, not only its keys' validity).
    #[test]
    fn a_dictionary_null_value_is_null() {
        use arrow::array::{DictionaryArray, Int32Array};
        let dict = DictionaryArray::try_new(
            Int32Array::from(vec![Some(0), Some(1), None]),
            Arc::new(StringArray::from(vec![Some("a"), None])),
        )
        .unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new(
            "d",
            dict.data_type().clone(),
            true,
        )]));
        let r = QueryResult {
            batches: vec![RecordBatch::try_new(schema.clone(), vec![Arc::new(dict)]).unwrap()],
            schema,
            warnings: vec![],
        };
        let mut out = Vec::new();
        write_json(&r, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.ends_with(r#""rows":[["a"],[null],[null]]}"#), "{text}");
    }

    #[test]
    fn warnings_and_empty_results_are_written_too() {
        let mut empty = result(vec![
            "shard 3 unavailable".into(),
            "a \"quoted\" one".into(),
        ]);
        empty.batches.clear();
        let v = to_json(&empty).unwrap();
        assert_eq!(v["rows"], json!([]));
        assert_eq!(v["row_count"], 0);
        assert_eq!(v["columns"].as_array().unwrap().len(), 8);
        assert_eq!(
            v["warnings"],
            json!(["shard 3 unavailable", "a \"quoted\" one"])
        );
        assert!(to_json(&result(vec![])).unwrap().get("warnings").is_none());
    }
}
