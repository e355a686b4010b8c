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
        Format::Json => to_json(&result).map(|mut v| {
            if !result.warnings.is_empty() {
                v["warnings"] = json!(result.warnings);
            }
            ("application/json", v.to_string().into_bytes())
        }),
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

/// Renders a result as the JSON described in the module docs.
pub fn to_json(result: &QueryResult) -> Result<Value, arrow::error::ArrowError> {
    let columns: Vec<Value> = result
        .schema
        .fields()
        .iter()
        .map(|f| json!({"name": f.name(), "type": f.data_type().to_string()}))
        .collect();
    let mut rows: Vec<Value> = Vec::with_capacity(result.num_rows());
    let options = FormatOptions::default();
    for batch in &result.batches {
        let cells: Vec<Box<dyn Fn(usize) -> Value + '_>> = batch
            .columns()
            .iter()
            .map(|a| json_column(a.as_ref(), &options))
            .collect::<Result<_, _>>()?;
        for r in 0..batch.num_rows() {
            rows.push(Value::Array(cells.iter().map(|c| c(r)).collect()));
        }
    }
    Ok(json!({"columns": columns, "rows": rows, "row_count": result.num_rows()}))
}

fn float_json(v: f64) -> Value {
    if v.is_nan() {
        json!("NaN")
    } else if v.is_infinite() {
        json!(if v > 0.0 { "+Inf" } else { "-Inf" })
    } else {
        json!(v)
    }
}

/// A per-row JSON converter for one column.
fn json_column<'a>(
    a: &'a dyn Array,
    options: &'a FormatOptions<'a>,
) -> Result<Box<dyn Fn(usize) -> Value + 'a>, arrow::error::ArrowError> {
    let with_nulls =
        move |f: Box<dyn Fn(usize) -> Value + 'a>| -> Box<dyn Fn(usize) -> Value + 'a> {
            Box::new(move |i| if a.is_null(i) { Value::Null } else { f(i) })
        };
    Ok(match a.data_type() {
        DataType::Boolean => {
            let b = a.as_boolean();
            with_nulls(Box::new(move |i| json!(b.value(i))))
        }
        DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64 => {
            let c = arrow::compute::cast(a, &DataType::Int64)?;
            with_nulls(Box::new(move |i| {
                json!(c.as_primitive::<Int64Type>().value(i))
            }))
        }
        DataType::UInt8 | DataType::UInt16 | DataType::UInt32 | DataType::UInt64 => {
            let c = arrow::compute::cast(a, &DataType::UInt64)?;
            with_nulls(Box::new(move |i| {
                json!(c.as_primitive::<UInt64Type>().value(i))
            }))
        }
        DataType::Float16 | DataType::Float32 | DataType::Float64 => {
            let c = arrow::compute::cast(a, &DataType::Float64)?;
            with_nulls(Box::new(move |i| {
                float_json(c.as_primitive::<Float64Type>().value(i))
            }))
        }
        _ => {
            let f = ArrayFormatter::try_new(a, options)?;
            with_nulls(Box::new(move |i| json!(f.value(i).to_string())))
        }
    })
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
