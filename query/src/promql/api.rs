//! The Prometheus HTTP query API over [`PromEngine`], for Grafana's
//! Prometheus data source and other Prometheus clients.
//!
//! `/api/v1/query`, `/api/v1/query_range`, `/api/v1/series`,
//! `/api/v1/labels`, `/api/v1/label/{name}/values`, `/api/v1/metadata` and
//! `/api/v1/status/buildinfo`; GET, or POST with a form-encoded body. Times
//! are RFC 3339 or Unix seconds (fractions allowed); `step` is seconds or a
//! duration (`15s`, `1m`). Answers and errors have Prometheus's JSON shapes:
//! `{"status":"success","data":...}` and
//! `{"status":"error","errorType":"bad_data","error":"..."}`. In cluster
//! mode, an answer that lacks a shard has Prometheus's
//! `"warnings":["..."]` beside `data`; a cluster that refuses to answer (a
//! peer with another cluster file) gives 503 with `errorType`
//! `unavailable`. The warnings also carry the answer's notes, such as
//! windows answered from rollup tiers where raw samples have expired.

use std::collections::BTreeSet;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use promql_parser::parser::Expr;

use super::eval::Evaluator;
use super::value::Ascii;
use super::{Answer, LabelSet, PromEngine, PromError, PromValue, Series, labels_of, parse};

/// The Prometheus version reported by `/api/v1/status/buildinfo`. Grafana
/// enables features by it; this is the release the evaluator follows.
pub const PROMETHEUS_COMPAT_VERSION: &str = "2.42.0";

/// The router of the Prometheus API. Merge it into the node's HTTP router.
pub fn router(engine: PromEngine) -> Router {
    Router::new()
        .route("/api/v1/query", get(query).post(query))
        .route("/api/v1/query_range", get(query_range).post(query_range))
        .route("/api/v1/series", get(series).post(series))
        .route("/api/v1/labels", get(labels).post(labels))
        .route("/api/v1/label/{name}/values", get(label_values))
        .route("/api/v1/metadata", get(metadata))
        .route("/api/v1/status/buildinfo", get(buildinfo))
        .with_state(Arc::new(engine))
}

/// Request parameters: the URL's query string and a form-encoded body.
#[derive(Debug, Default)]
struct Params(Vec<(String, String)>);

impl Params {
    fn from(raw: Option<String>, headers: &HeaderMap, body: &Bytes) -> Self {
        let mut out: Vec<(String, String)> = Vec::new();
        let form = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/x-www-form-urlencoded"));
        if form {
            out.extend(form_urlencoded::parse(body).into_owned());
        }
        if let Some(q) = raw {
            out.extend(form_urlencoded::parse(q.as_bytes()).into_owned());
        }
        Self(out)
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn all(&self, name: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis().min(i64::MAX as u128) as i64)
        .unwrap_or(0)
}

/// Prometheus's `parseTime`: Unix seconds (rounded to the millisecond) or
/// RFC 3339.
pub fn parse_time(s: &str) -> Result<i64, String> {
    if let Ok(f) = s.parse::<f64>()
        && f.is_finite()
    {
        if f.abs() > (super::eval::MAX_ABS_MS / 1000) as f64 {
            return Err(format!("timestamp {s:?} is out of range"));
        }
        let secs = f.trunc();
        let frac = ((f - secs) * 1000.0).round();
        return in_range(secs as i64 * 1000 + frac as i64, s);
    }
    chrono::DateTime::parse_from_rfc3339(s)
        .map_err(|_| format!("cannot parse {s:?} to a valid timestamp"))
        .and_then(|t| in_range(t.timestamp_millis(), s))
}

fn in_range(t_ms: i64, s: &str) -> Result<i64, String> {
    if !(-super::eval::MAX_ABS_MS..=super::eval::MAX_ABS_MS).contains(&t_ms) {
        return Err(format!("timestamp {s:?} is out of range"));
    }
    Ok(t_ms)
}

/// Prometheus's `parseDuration`: seconds as a float, or a duration (`1m`).
pub fn parse_step(s: &str) -> Result<i64, String> {
    if let Ok(f) = s.parse::<f64>() {
        let ns = f * 1e9;
        if !ns.is_finite() || ns >= i64::MAX as f64 || ns <= i64::MIN as f64 {
            return Err(format!(
                "cannot parse {s:?} to a valid duration. It overflows int64"
            ));
        }
        return Ok(ns as i64 / 1_000_000);
    }
    promql_parser::util::parse_duration(s)
        .map(|d| d.as_millis().min(i64::MAX as u128) as i64)
        .map_err(|_| format!("cannot parse {s:?} to a valid duration"))
}

fn error(e: &PromError) -> Response {
    let (status, kind) = e.status();
    let body = format!(
        r#"{{"status":"error","errorType":"{kind}","error":{}}}"#,
        serde_json::to_string(&e.to_string()).unwrap_or_else(|_| "\"\"".into())
    );
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}

fn success(data: &str) -> Response {
    success_with(data, &[])
}

/// A success answer with Prometheus's `warnings` when there are any.
fn success_with(data: &str, warnings: &[String]) -> Response {
    let mut body = String::with_capacity(data.len() + 64);
    body.push_str(r#"{"status":"success","data":"#);
    body.push_str(data);
    json_body(body, warnings)
}

/// A success body started with `{"status":"success","data":` and its data,
/// ended with the warnings.
fn json_body(body: String, warnings: &[String]) -> Response {
    json_body_of(vec![body], warnings)
}

/// [`json_body`] of a body in pieces, sent in order without being joined.
fn json_body_of(mut pieces: Vec<String>, warnings: &[String]) -> Response {
    let mut end = String::new();
    if !warnings.is_empty() {
        let list: Vec<String> = warnings.iter().map(|w| json_str(w)).collect();
        end.push_str(r#","warnings":["#);
        end.push_str(&list.join(","));
        end.push(']');
    }
    end.push('}');
    pieces.push(end);
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::new(Pieces::new(pieces)),
    )
        .into_response()
}

/// A response body of texts sent one after another, its length known
/// (`Content-Length`): a large matrix is written in pieces across threads,
/// and joining them copied the whole answer again (2.5 % of a dashboard
/// panel's instructions, callgrind of the server).
struct Pieces {
    rest: std::vec::IntoIter<String>,
    left: u64,
}

impl Pieces {
    fn new(pieces: Vec<String>) -> Self {
        Self {
            left: pieces.iter().map(|p| p.len() as u64).sum(),
            rest: pieces.into_iter(),
        }
    }
}

impl axum::body::HttpBody for Pieces {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        let next = this.rest.find(|p| !p.is_empty()).map(|p| {
            this.left -= p.len() as u64;
            Ok(http_body::Frame::data(Bytes::from(p)))
        });
        std::task::Poll::Ready(next)
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.left)
    }
}

/// Renders an answer into a whole success body, in pieces, but for its
/// warnings and notes (returned, for [`json_body_of`]): the data is written
/// once, where it stays (an answer can be megabytes).
fn render_answer(a: &Answer) -> (Vec<String>, Vec<String>) {
    let mut warnings = a.warnings.clone();
    crate::cluster::add_warnings(&mut warnings, a.notes.iter().cloned());
    let head = String::from(r#"{"status":"success","data":"#);
    let body = match &a.value {
        PromValue::Matrix(series) => {
            let mut pieces = vec![head + MATRIX_HEAD];
            pieces.extend(matrix_pieces(series));
            pieces.push(MATRIX_END.to_string());
            pieces
        }
        value => {
            let mut body = head;
            render_into(&mut body, value);
            vec![body]
        }
    };
    (body, warnings)
}

fn bad(msg: impl Into<String>) -> PromError {
    PromError::BadData(msg.into())
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Appends `s` as a JSON string, as [`json_str`] writes it. JSON escapes
/// only `"`, `\` and the control characters below U+0020; a string with
/// none of them (every label name, and the values dcgm-exporter writes) is
/// copied between quotes. A series' labels went through `serde_json` into a
/// new `String` each, 8 % of a dashboard panel of 1,000 GPUs' temperatures
/// (callgrind of the server).
fn push_json_str(out: &mut String, s: &str) {
    if s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        out.push_str(&json_str(s));
    } else {
        out.push('"');
        out.push_str(s);
        out.push('"');
    }
}

/// `MarshalTimestamp`: seconds with the milliseconds as a fraction.
fn write_ts(out: &mut String, t: i64) {
    let mut b = Ascii::<32>::new();
    push_ts(&mut b, t);
    b.flush(out);
}

/// A timestamp in seconds, with milliseconds where there are any; needs
/// 25 bytes of room.
fn push_ts<const N: usize>(b: &mut Ascii<N>, t: i64) {
    if t < 0 {
        b.push(b'-');
    }
    let t = t.unsigned_abs();
    b.push_u64(t / 1000);
    push_millis(b, t % 1000);
}

/// A timestamp's milliseconds (`ms` < 1000) as three fraction digits
/// after a point; nothing for a whole second.
fn push_millis<const N: usize>(b: &mut Ascii<N>, ms: u64) {
    if ms != 0 {
        let digit = |d: u64| b'0' + (d % 10) as u8;
        b.extend(&[b'.', digit(ms / 100), digit(ms / 10), digit(ms)]);
    }
}

/// The whole seconds of a series' timestamps as text, carried from one
/// point to the next: a point is mostly a few seconds after the one before
/// it, and adding the difference to the digits takes a digit or two where
/// formatting them (`itoa`, 10 digits) took about 90 instructions
/// (callgrind of the server answering `gpu_last_hour`'s 19,080 points:
/// 9.79 M -> 9.22 M instructions a query).
struct Seconds {
    /// The seconds written; `None` before the first.
    secs: Option<u64>,
    /// Their digits, `text[..len]`; a `u64` has at most 20.
    text: [u8; 20],
    len: usize,
}

impl Seconds {
    fn new() -> Self {
        Self {
            secs: None,
            text: [0; 20],
            len: 0,
        }
    }

    /// Makes the text that of `secs`: the digits before plus the
    /// difference where `secs` is later by under a million and has as many
    /// digits, written afresh otherwise.
    fn set(&mut self, secs: u64) {
        match self.secs {
            Some(last) if last == secs => return,
            Some(last) if secs > last && secs - last < 1_000_000 => {
                // From the last digit: the digit plus what is to add, its
                // ones kept and the rest carried, until a digit takes it.
                let mut add = secs - last;
                for i in (0..self.len.min(20)).rev() {
                    let d = u64::from(self.text[i].wrapping_sub(b'0')) + add;
                    if d < 10 {
                        self.text[i] = b'0' + d as u8;
                        self.secs = Some(secs);
                        return;
                    }
                    self.text[i] = b'0' + (d % 10) as u8;
                    add = d / 10;
                }
                // A digit more (999 -> 1000).
            }
            _ => {}
        }
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(secs).as_bytes();
        self.text[..digits.len()].copy_from_slice(digits);
        self.len = digits.len();
        self.secs = Some(secs);
    }
}

/// [`push_ts`] for a series' timestamps in turn, their seconds carried in
/// `secs`; the same text.
fn push_ts_carried<const N: usize>(b: &mut Ascii<N>, t: i64, secs: &mut Seconds) {
    let Ok(t) = u64::try_from(t) else {
        return push_ts(b, t);
    };
    secs.set(t / 1000);
    b.extend_prefix(&secs.text, secs.len);
    push_millis(b, t % 1000);
}

/// The text of the timestamps of the series a matrix piece wrote before,
/// by place in the series: an answer's series mostly share their
/// timestamps (a range query's steps; the fields of one GPU, polled
/// together), so a point whose timestamp is that of the point at its place
/// in the series before copies its text instead of writing it again.
#[derive(Default)]
struct Stamps {
    /// (timestamp, its text, the text's length), by place.
    at: Vec<(i64, [u8; STAMP_MAX], u8)>,
}

/// The longest timestamp text [`Stamps`] keeps: a sign, 16 digits of
/// seconds, a point and three digits.
const STAMP_MAX: usize = 24;

impl Stamps {
    /// The timestamp `t` of a series' point `j` onto `b` (as
    /// [`push_ts_carried`] writes it), from the text kept for place `j`
    /// when it is `t`'s; kept there otherwise. `j` is at most the number
    /// of places kept (points come in order). Needs 25 bytes of room.
    fn push<const N: usize>(&mut self, b: &mut Ascii<N>, j: usize, t: i64, secs: &mut Seconds) {
        if let Some((at, text, len)) = self.at.get(j)
            && *at == t
        {
            b.extend_prefix(text, usize::from(*len));
            return;
        }
        let start = b.len();
        push_ts_carried(b, t, secs);
        let written = b.since(start);
        if written.len() > STAMP_MAX {
            return;
        }
        let mut text = [0; STAMP_MAX];
        text[..written.len()].copy_from_slice(written);
        let kept = (t, text, written.len() as u8);
        match self.at.get_mut(j) {
            Some(place) => *place = kept,
            None => self.at.push(kept),
        }
    }
}

/// Room for a separating `,`, `[`, a timestamp, `,"`, a value and `"]`.
const POINT_MAX: usize = 1 + 1 + 25 + 2 + super::value::VALUE_MAX + 2;

/// `[<seconds>,"<value>"]`, after a `,` unless `first`, onto `b`, or through
/// it onto `out` where the value needs the float formatter; `b` is flushed
/// first if it lacks room. `ts` writes the timestamp (25 bytes of room).
fn push_point<const N: usize>(
    b: &mut Ascii<N>,
    out: &mut String,
    first: bool,
    v: f64,
    ts: impl FnOnce(&mut Ascii<N>),
) {
    if b.room() < POINT_MAX {
        b.flush(out);
    }
    if !first {
        b.push(b',');
    }
    b.push(b'[');
    ts(b);
    b.extend(b",\"");
    if super::value::push_value(b, v) {
        b.extend(b"\"]");
    } else {
        use std::fmt::Write;
        b.flush(out);
        let _ = write!(out, "{v}");
        out.push_str("\"]");
    }
}

fn write_point(out: &mut String, t: i64, v: f64) {
    let mut b = Ascii::<POINT_MAX>::new();
    push_point(&mut b, out, true, v, |b| push_ts(b, t));
    b.flush(out);
}

fn write_labels(out: &mut String, labels: &LabelSet) {
    out.push('{');
    for (i, (n, v)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_str(out, n);
        out.push(':');
        push_json_str(out, v);
    }
    out.push('}');
}

/// How many pieces a matrix is written in (see [`render`]).
const RENDER_PIECES: usize = 16;

/// About what one point of a matrix takes in JSON (`[1733312345,"243.57"]`).
const POINT_BYTES: usize = 24;

/// One series of a matrix; series after the first in a piece get a comma.
fn write_series(out: &mut String, s: &Series, stamps: &mut Stamps) {
    if !out.is_empty() {
        out.push(',');
    }
    out.push_str(r#"{"metric":"#);
    write_labels(out, &s.labels);
    out.push_str(r#","values":["#);
    // The points go through one stack buffer, moved to `out` when full.
    let mut b = Ascii::<1024>::new();
    let mut secs = Seconds::new();
    for (j, &(t, v)) in s.points.iter().enumerate() {
        push_point(&mut b, out, j == 0, v, |b| stamps.push(b, j, t, &mut secs));
    }
    b.flush(out);
    out.push_str("]}");
}

/// The `data` object of a query answer.
pub fn render(value: &PromValue) -> String {
    let mut out = String::new();
    render_into(&mut out, value);
    out
}

/// [`render`] onto `out`.
fn render_into(out: &mut String, value: &PromValue) {
    match value {
        PromValue::Scalar { t_ms, v } => {
            out.push_str(r#"{"resultType":"scalar","result":"#);
            write_point(out, *t_ms, *v);
        }
        PromValue::String { t_ms, v } => {
            out.push_str(r#"{"resultType":"string","result":["#);
            write_ts(out, *t_ms);
            out.push(',');
            out.push_str(&json_str(v));
            out.push(']');
        }
        PromValue::Vector(samples) => {
            out.push_str(r#"{"resultType":"vector","result":["#);
            for (i, s) in samples.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(r#"{"metric":"#);
                write_labels(out, &s.labels);
                out.push_str(r#","value":"#);
                write_point(out, s.t_ms, s.v);
                out.push('}');
            }
            out.push(']');
        }
        PromValue::Matrix(series) => {
            let written = matrix_pieces(series);
            out.reserve(written.iter().map(String::len).sum::<usize>() + 64);
            out.push_str(MATRIX_HEAD);
            for text in &written {
                out.push_str(text);
            }
            out.push_str(MATRIX_END);
            return;
        }
    }
    out.push('}');
}

/// A matrix's `data` object is these around [`matrix_pieces`].
const MATRIX_HEAD: &str = r#"{"resultType":"matrix","result":["#;
const MATRIX_END: &str = "]}";

/// The series of a matrix as JSON, in pieces that follow one another: a
/// large matrix (a dashboard panel of every GPU: hundreds of thousands of
/// points) is written across the scan pool's threads, each piece but the
/// last ended with the `,` before the next.
fn matrix_pieces(series: &[Series]) -> Vec<String> {
    let points: usize = series.iter().map(|s| s.points.len()).sum();
    let pieces: Vec<&[Series]> = series
        .chunks(series.len().div_ceil(RENDER_PIECES).max(1))
        .collect();
    let last = pieces.len().saturating_sub(1);
    let numbered: Vec<(usize, &[Series])> = pieces.into_iter().enumerate().collect();
    super::parallel::map(&numbered, points, |&(i, piece)| {
        let n: usize = piece.iter().map(|s| s.points.len()).sum();
        let mut text = String::with_capacity(n * POINT_BYTES + piece.len() * 256 + 1);
        let mut stamps = Stamps::default();
        for s in piece.iter() {
            write_series(&mut text, s, &mut stamps);
        }
        if i < last {
            text.push(',');
        }
        text
    })
}

/// Runs blocking engine work on a query thread, within a query slot and
/// `--query-timeout` ([`crate::limits::QueryGuard`]).
async fn blocking<T: Send + 'static>(
    engine: &PromEngine,
    f: impl FnOnce(crate::limits::Deadline) -> Result<T, PromError> + Send + 'static,
) -> Result<T, PromError> {
    engine
        .guard()
        .spawn_blocking(f)
        .await
        .map_err(PromError::Refused)?
}

async fn query(
    State(engine): State<Arc<PromEngine>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let p = Params::from(raw, &headers, &body);
    let run = || -> Result<(String, i64), PromError> {
        let q = p
            .get("query")
            .ok_or_else(|| bad("invalid parameter \"query\": query must not be empty"))?;
        let t = match p.get("time") {
            Some(t) => {
                parse_time(t).map_err(|e| bad(format!("invalid parameter \"time\": {e}")))?
            }
            None => now_ms(),
        };
        Ok((q.to_string(), t))
    };
    let (q, t) = match run() {
        Ok(x) => x,
        Err(e) => return error(&e),
    };
    let engine = (*engine).clone();
    let guarded = engine.clone();
    match blocking(&guarded, move |deadline| {
        engine
            .instant_answer_until(&q, t, deadline)
            .map(|a| render_answer(&a))
    })
    .await
    {
        Ok((body, warnings)) => json_body_of(body, &warnings),
        Err(e) => error(&e),
    }
}

async fn query_range(
    State(engine): State<Arc<PromEngine>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let p = Params::from(raw, &headers, &body);
    let run = || -> Result<(String, i64, i64, i64), PromError> {
        let need = |name: &str| {
            p.get(name)
                .ok_or_else(|| bad(format!("invalid parameter \"{name}\": missing")))
        };
        let start = parse_time(need("start")?)
            .map_err(|e| bad(format!("invalid parameter \"start\": {e}")))?;
        let end =
            parse_time(need("end")?).map_err(|e| bad(format!("invalid parameter \"end\": {e}")))?;
        let step = parse_step(need("step")?)
            .map_err(|e| bad(format!("invalid parameter \"step\": {e}")))?;
        let q = p
            .get("query")
            .ok_or_else(|| bad("invalid parameter \"query\": query must not be empty"))?;
        Ok((q.to_string(), start, end, step))
    };
    let (q, start, end, step) = match run() {
        Ok(x) => x,
        Err(e) => return error(&e),
    };
    let engine = (*engine).clone();
    let guarded = engine.clone();
    match blocking(&guarded, move |deadline| {
        engine
            .range_answer_until(&q, start, end, step, deadline)
            .map(|a| render_answer(&a))
    })
    .await
    {
        Ok((body, warnings)) => json_body_of(body, &warnings),
        Err(e) => error(&e),
    }
}

/// Time bounds of the metadata endpoints (everything when absent).
fn bounds(p: &Params) -> Result<(i64, i64), PromError> {
    let start = match p.get("start") {
        Some(s) => parse_time(s).map_err(|e| bad(format!("invalid parameter \"start\": {e}")))?,
        None => i64::MIN,
    };
    let end = match p.get("end") {
        Some(s) => parse_time(s).map_err(|e| bad(format!("invalid parameter \"end\": {e}")))?,
        None => i64::MAX,
    };
    Ok((start, end))
}

/// The label sets of the series selected by `match[]` (all series when
/// none is given and `required` is false) with data in the time bounds,
/// and the warnings of the reads (cluster mode).
fn matched_series(
    engine: &PromEngine,
    p: &Params,
    required: bool,
) -> Result<(Vec<LabelSet>, Vec<String>), PromError> {
    let (start, end) = bounds(p)?;
    let selectors = p.all("match[]");
    if selectors.is_empty() && required {
        return Err(bad("no match[] parameter provided"));
    }
    let mut sets: Vec<Vec<storage::Matcher>> = Vec::new();
    for s in &selectors {
        engine.guard().check_length(s).map_err(PromError::Refused)?;
        match parse(s) {
            Ok(Expr::VectorSelector(vs)) => sets.push(Evaluator::matchers(&vs)?),
            Ok(_) => {
                return Err(bad(format!(
                    "invalid parameter \"match[]\": {s:?} is not a series selector"
                )));
            }
            Err(e) => return Err(bad(format!("invalid parameter \"match[]\": {e}"))),
        }
    }
    if sets.is_empty() {
        sets.push(vec![
            storage::Matcher::regex("__name__", ".+")
                .map_err(|e| PromError::Internal(e.to_string()))?,
        ]);
    }
    let mut out: BTreeSet<LabelSet> = BTreeSet::new();
    let mut warnings = Vec::new();
    for m in &sets {
        let selection = engine.series(m, start, end)?;
        crate::cluster::add_warnings(&mut warnings, selection.warnings);
        for s in selection.series {
            out.insert(labels_of(&s.key));
        }
    }
    Ok((out.into_iter().collect(), warnings))
}

async fn series(
    State(engine): State<Arc<PromEngine>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let p = Params::from(raw, &headers, &body);
    let engine = (*engine).clone();
    let guarded = engine.clone();
    let r = blocking(&guarded, move |_deadline| {
        let (all, warnings) = matched_series(&engine, &p, true)?;
        let mut out = String::from("[");
        for (i, l) in all.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            write_labels(&mut out, l);
        }
        out.push(']');
        Ok((out, warnings))
    })
    .await;
    match r {
        Ok((d, w)) => success_with(&d, &w),
        Err(e) => error(&e),
    }
}

fn string_list<'a>(items: impl IntoIterator<Item = &'a String>) -> String {
    let mut out = String::from("[");
    for (i, s) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_str(&mut out, s);
    }
    out.push(']');
    out
}

async fn labels(
    State(engine): State<Arc<PromEngine>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let p = Params::from(raw, &headers, &body);
    let engine = (*engine).clone();
    let guarded = engine.clone();
    let r = blocking(&guarded, move |_deadline| {
        let (all, warnings) = matched_series(&engine, &p, false)?;
        let names: BTreeSet<String> = all
            .into_iter()
            .flat_map(|l| l.into_iter().map(|(n, _)| String::from(n)))
            .collect();
        Ok((string_list(&names), warnings))
    })
    .await;
    match r {
        Ok((d, w)) => success_with(&d, &w),
        Err(e) => error(&e),
    }
}

async fn label_values(
    State(engine): State<Arc<PromEngine>>,
    Path(name): Path<String>,
    RawQuery(raw): RawQuery,
) -> Response {
    if !super::value::valid_label_name(&name) {
        return error(&bad(format!("invalid label name: {name:?}")));
    }
    let p = Params::from(raw, &HeaderMap::new(), &Bytes::new());
    let engine = (*engine).clone();
    let guarded = engine.clone();
    let r = blocking(&guarded, move |_deadline| {
        let (all, warnings) = matched_series(&engine, &p, false)?;
        let values: BTreeSet<String> = all
            .into_iter()
            .filter_map(|l| {
                l.into_iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| String::from(v))
            })
            .collect();
        Ok((string_list(&values), warnings))
    })
    .await;
    match r {
        Ok((d, w)) => success_with(&d, &w),
        Err(e) => error(&e),
    }
}

/// gpulse keeps no metric metadata (type, help, unit): the answer is empty,
/// as Prometheus's is for series without scrape metadata.
async fn metadata() -> Response {
    success("{}")
}

async fn buildinfo() -> Response {
    success(&format!(
        r#"{{"version":"{PROMETHEUS_COMPAT_VERSION}","revision":"gpulse-{}","branch":"gpulse","buildUser":"gpulse","buildDate":"","goVersion":""}}"#,
        env!("CARGO_PKG_VERSION")
    ))
}

#[cfg(test)]
mod tests {
    /// A string is written as `serde_json` writes it, whatever character
    /// it holds where: every ASCII character, multi-byte ones and
    /// U+2028, alone and between others, and strings read back as
    /// themselves.
    #[test]
    fn json_strings_are_written_as_serde_json_writes_them() {
        let mut cases: Vec<String> =
            vec![String::new(), "host-00001".into(), "é✓😀\u{2028}".into()];
        for c in (0u8..0x80)
            .map(char::from)
            .chain(['é', '\u{7f}', '\u{2028}', '😀'])
        {
            cases.extend([
                c.to_string(),
                format!("a{c}"),
                format!("{c}b"),
                format!("GPU-{c}-x"),
            ]);
        }
        for s in cases {
            let mut out = String::from("[");
            super::push_json_str(&mut out, &s);
            assert_eq!(out[1..], serde_json::to_string(&s).unwrap(), "{s:?}");
            let back: String = serde_json::from_str(&out[1..]).unwrap();
            assert_eq!(back, s);
        }
    }

    /// Go's `MarshalTimestamp`: whole seconds bare, milliseconds as three
    /// fraction digits, negative times signed.
    #[test]
    fn timestamps_are_seconds_with_milliseconds() {
        for (t, want) in [
            (0, "0"),
            (1_000, "1"),
            (1_796_346_840_000, "1796346840"),
            (1_796_346_840_005, "1796346840.005"),
            (1_796_346_840_050, "1796346840.050"),
            (1_796_346_840_500, "1796346840.500"),
            (1_796_346_840_999, "1796346840.999"),
            (-1_500, "-1.500"),
            (-7, "-0.007"),
        ] {
            let mut out = String::new();
            super::write_ts(&mut out, t);
            assert_eq!(out, want, "{t}");
        }
    }

    /// A series' timestamps with their seconds carried from one to the
    /// next are the text of each alone: steps of every size (a digit more,
    /// 999 -> 1000 and 9,999,999,999 -> 10,000,000,000), repeats, steps
    /// back, negative times and jumps past the carry's reach.
    #[test]
    fn carried_seconds_write_what_each_timestamp_alone_writes() {
        use super::{Ascii, Seconds, push_ts, push_ts_carried};
        let mut ts: Vec<i64> = vec![0, 0, 1, 999_000, 1_000_000, 1_000_500, 9_999_999_999_999];
        ts.extend([
            10_000_000_000_000,
            10_000_000_009_999,
            10_000_001_000_000,
            -1_500,
            5,
        ]);
        ts.extend([
            1_796_346_840_000,
            1_796_346_830_000,
            i64::MAX,
            i64::MIN,
            1_000,
        ]);
        // A series at 10 s and 15 s steps with jitter, over a change of
        // digit count in the middle of it.
        let mut t: i64 = 99_999_000_000 - 3_600_000;
        let mut x = 7u64;
        while t < 99_999_000_000 + 3_600_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            t += 10_000 + (x >> 33) as i64 % 5_001 - 2_000;
            ts.push(t);
        }
        for k in 0..ts.len() {
            // Every suffix: each starts the carry at another point.
            let mut secs = Seconds::new();
            for &t in &ts[k..] {
                let (mut want, mut got) = (Ascii::<64>::new(), Ascii::<64>::new());
                push_ts(&mut want, t);
                push_ts_carried(&mut got, t, &mut secs);
                let (mut w, mut g) = (String::new(), String::new());
                want.flush(&mut w);
                got.flush(&mut g);
                assert_eq!(g, w, "{t} after {:?}", secs.secs);
            }
        }
    }

    /// A point is its timestamp and its value as a string, whichever way
    /// the value is written: on the stack or by the float formatter.
    #[test]
    fn points_are_a_timestamp_and_a_quoted_value() {
        for (t, v, want) in [
            (1_500, 71.0, r#"[1.500,"71"]"#),
            (-7, 312.125, r#"[-0.007,"312.125"]"#),
            (i64::MIN, -0.05, r#"[-9223372036854775.808,"-0.05"]"#),
            (
                1_796_346_840_000,
                1.0 / 3.0,
                r#"[1796346840,"0.3333333333333333"]"#,
            ),
            (0, -0.0, r#"[0,"-0"]"#),
            (0, 1e300, &format!(r#"[0,"{}"]"#, 1e300)),
            (0, f64::NAN, r#"[0,"NaN"]"#),
            (0, f64::NEG_INFINITY, r#"[0,"-Inf"]"#),
        ] {
            let mut out = String::from("x");
            super::write_point(&mut out, t, v);
            assert_eq!(out, format!("x{want}"), "{t} {v}");
        }
    }

    /// A matrix's answer goes out in pieces (its series written across
    /// threads, not joined): the body, read whole, is the matrix as
    /// `render` writes it in one string, its length the exact size told,
    /// for every count of series around the number of pieces, warnings or
    /// none.
    #[tokio::test]
    async fn a_matrix_in_pieces_is_the_whole_answer() {
        use super::super::{Answer, PromValue, Series};
        use std::sync::Arc;
        for n in [0usize, 1, 2, 15, 16, 17, 33, 100] {
            let series: Vec<Series> = (0..n)
                .map(|i| Series {
                    labels: Arc::new(vec![("gpu".into(), i.to_string().into())]),
                    points: (0..i as i64 % 5).map(|j| (j * 1500, j as f64)).collect(),
                })
                .collect();
            let value = PromValue::Matrix(series);
            for warnings in [vec![], vec!["shard \"b\" missing".to_string()]] {
                let answer = Answer {
                    value: value.clone(),
                    warnings: warnings.clone(),
                    notes: Vec::new(),
                };
                let (pieces, w) = super::render_answer(&answer);
                assert!(
                    n < 2 || pieces.len() > 3,
                    "{n} series in {} pieces",
                    pieces.len()
                );
                let response = super::json_body_of(pieces, &w);
                // What hyper sends as `Content-Length`.
                let length = axum::body::HttpBody::size_hint(response.body()).exact();
                let body = axum::body::to_bytes(response.into_body(), usize::MAX)
                    .await
                    .unwrap();
                assert_eq!(length, Some(body.len() as u64));
                let mut want = format!(r#"{{"status":"success","data":{}"#, super::render(&value));
                if !warnings.is_empty() {
                    want.push_str(r#","warnings":["shard \"b\" missing"]"#);
                }
                want.push('}');
                assert_eq!(std::str::from_utf8(&body).unwrap(), want, "{n} series");
                let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(parsed["data"]["result"].as_array().unwrap().len(), n);
            }
        }
    }

    /// Series that share their timestamps, in whole or in part, at other
    /// places or not at all, give the text of each point written alone:
    /// the seconds, a point and three digits where there are milliseconds,
    /// the value quoted.
    #[test]
    fn timestamps_shared_between_series_are_written_as_their_own() {
        use super::super::{PromValue, Series};
        use std::sync::Arc;
        let steps: Vec<i64> = (0..50).map(|i| 1_796_547_240_000 + 60_000 * i).collect();
        let jittered: Vec<i64> = (0..50)
            .map(|i| 1_796_547_240_000 + 10_000 * i + (i * 37) % 1000)
            .collect();
        let times: Vec<Vec<i64>> = vec![
            steps.clone(),
            steps.clone(),
            // Steps missing: the same times at other places.
            steps.iter().copied().filter(|t| t % 180_000 != 0).collect(),
            steps[..10].to_vec(),
            jittered.clone(),
            jittered.clone(),
            // Longer than any before, then shorter again.
            (0..80).map(|i| 1_796_547_240_000 + 60_000 * i).collect(),
            vec![-1_500, -1_000, 0, 999, 1_000, 1_001],
            steps.clone(),
            Vec::new(),
            jittered,
        ];
        let ts_text = |t: i64| {
            let (sign, a) = (if t < 0 { "-" } else { "" }, t.unsigned_abs());
            match a % 1000 {
                0 => format!("{sign}{}", a / 1000),
                ms => format!("{sign}{}.{ms:03}", a / 1000),
            }
        };
        // Counts of series that the pieces split one by one and several
        // to a piece, each after every other kind.
        for n in [1, 2, 5, 11, 17, 33, 40, 121] {
            let series: Vec<Series> = (0..n)
                .map(|i| (i, &times[(i * 7 + i / times.len()) % times.len()]))
                .map(|(i, ts)| Series {
                    labels: Arc::new(vec![("gpu".into(), i.to_string().into())]),
                    points: ts.iter().map(|&t| (t, (t % 7_919) as f64)).collect(),
                })
                .collect();
            let want: Vec<String> = series
                .iter()
                .map(|s| {
                    let points: Vec<String> = s
                        .points
                        .iter()
                        .map(|&(t, v)| format!("[{},\"{v}\"]", ts_text(t)))
                        .collect();
                    format!(
                        r#"{{"metric":{{"gpu":"{}"}},"values":[{}]}}"#,
                        s.labels[0].1,
                        points.join(",")
                    )
                })
                .collect();
            let want = format!(r#"{{"resultType":"matrix","result":[{}]}}"#, want.join(","));
            assert_eq!(
                super::render(&PromValue::Matrix(series)),
                want,
                "{n} series"
            );
        }
    }
}
