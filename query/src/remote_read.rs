//! Prometheus remote read (`POST /api/v1/read`), so that Prometheus, or
//! anything that speaks the protocol, can read gpulse's samples. (Remote
//! write, a write path, is in `ingest::remote_write`.)
//!
//! Bodies are snappy block-compressed `prometheus.ReadRequest`s; the
//! decompressed length in the snappy header is checked against
//! [`RemoteReadLimits::max_request_bytes`] before anything is allocated
//! ([`gpulse_proto::prometheus_body`]).
//!
//! The response type is the first of the client's
//! `accepted_response_types` (or `SAMPLES` when it lists none):
//! - `SAMPLES`: one snappy-compressed `ReadResponse`, one result per query.
//! - `STREAMED_XOR_CHUNKS`: frames of a uvarint length, a big-endian CRC32C
//!   (Castagnoli) of the message, and one `ChunkedReadResponse` holding one
//!   series (a series larger than 1 MiB continues in the next frame), its
//!   samples in Prometheus XOR chunks of up to 120 samples ([`xor`]).
//!
//! Series come sorted by their label sets; matchers are Prometheus's four
//! types with fully anchored regexes, and time bounds are inclusive. A read
//! that passes [`RemoteReadLimits::max_samples`] or `max_response_bytes`
//! fails with 400 and says which limit.
//!
//! In cluster mode ([`router_with_cluster`]) a read selects from every node
//! ([`crate::cluster`]). The remote-read protocol has no way to mark an
//! answer partial, so a read that would lack a shard (no replica could
//! serve it) fails with 503 and a message naming the shards; Prometheus
//! shows a failing remote read as a warning of its query. A cluster that
//! refuses to answer (a peer with another cluster file) also gives 503.

pub mod xor;

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use gpulse_proto::prometheus::{
    Chunk, ChunkedReadResponse, ChunkedSeries, Label as PromLabel, LabelMatcher, QueryResult,
    ReadResponse, Sample, TimeSeries, chunk, label_matcher, read_request::ResponseType,
};
use gpulse_proto::prometheus_body::{self, BodyError};
use prost::Message;
use storage::{Matcher, Storage};
use tracing::warn;

use self::xor::{SAMPLES_PER_CHUNK, XorChunk, put_uvarint};
use crate::cluster::{ClusterError, ClusterReader, Source};

/// Frames of a streamed read are cut at about this size.
const MAX_FRAME_BYTES: usize = 1 << 20;

const STREAMED_CONTENT_TYPE: &str =
    "application/x-streamed-protobuf; proto=prometheus.ChunkedReadResponse";

/// Bounds on one remote read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteReadLimits {
    /// Largest request body, compressed or decompressed (default 32 MiB,
    /// `--remote-max-request-bytes`, shared with remote write).
    pub max_request_bytes: usize,
    /// Most samples one read may return (default 50,000,000, Prometheus's
    /// `query.max-samples`).
    pub max_samples: u64,
    /// Largest read response, before compression (default 1 GiB).
    pub max_response_bytes: usize,
}

impl Default for RemoteReadLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 32 << 20,
            max_samples: 50_000_000,
            max_response_bytes: 1 << 30,
        }
    }
}

/// Counters of `/api/v1/read`, for `/metrics`.
#[derive(Debug, Default)]
pub struct RemoteReadMetrics {
    pub requests: AtomicU64,
    /// Requests answered with an error.
    pub requests_failed: AtomicU64,
    pub series: AtomicU64,
    pub samples: AtomicU64,
}

impl RemoteReadMetrics {
    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let counters: [(&str, &str, &AtomicU64); 4] = [
            (
                "gpulse_remote_read_requests_total",
                "Remote-read requests received.",
                &self.requests,
            ),
            (
                "gpulse_remote_read_requests_failed_total",
                "Remote-read requests answered with an error.",
                &self.requests_failed,
            ),
            (
                "gpulse_remote_read_series_total",
                "Series returned by remote read.",
                &self.series,
            ),
            (
                "gpulse_remote_read_samples_total",
                "Samples returned by remote read.",
                &self.samples,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
    }
}

/// The route `/api/v1/read`, reading this node's storage.
pub fn router(
    storage: Arc<Storage>,
    limits: RemoteReadLimits,
    metrics: Arc<RemoteReadMetrics>,
) -> Router {
    routes(Source::Local(storage), limits, metrics)
}

/// The route of a cluster node: `/api/v1/read` reads the whole cluster
/// through `reader` (see the module docs for partial reads).
pub fn router_with_cluster(
    reader: ClusterReader,
    limits: RemoteReadLimits,
    metrics: Arc<RemoteReadMetrics>,
) -> Router {
    routes(Source::Cluster(reader), limits, metrics)
}

fn routes(source: Source, limits: RemoteReadLimits, metrics: Arc<RemoteReadMetrics>) -> Router {
    Router::new()
        .route("/api/v1/read", post(read))
        .with_state(Arc::new(Reads {
            limits,
            metrics,
            source,
        }))
        .layer(DefaultBodyLimit::max(limits.max_request_bytes))
}

/// The state of the read route: its limits and counters, and where reads
/// select (this node's storage, or the cluster).
#[derive(Debug)]
struct Reads {
    limits: RemoteReadLimits,
    metrics: Arc<RemoteReadMetrics>,
    source: Source,
}

/// An error answer: a status and a plain-text message, as Prometheus sends.
#[derive(Debug)]
struct HttpError(StatusCode, String);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        (self.0, format!("{}\n", self.1)).into_response()
    }
}

fn bad(msg: impl Into<String>) -> HttpError {
    HttpError(StatusCode::BAD_REQUEST, msg.into())
}

impl From<BodyError> for HttpError {
    fn from(e: BodyError) -> Self {
        let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::BAD_REQUEST);
        HttpError(status, e.to_string())
    }
}

async fn read(State(reads): State<Arc<Reads>>, body: Bytes) -> Response {
    let metrics = reads.metrics.clone();
    metrics.requests.fetch_add(1, Relaxed);
    let result = tokio::task::spawn_blocking(move || read_blocking(&reads, &body))
        .await
        .unwrap_or_else(|e| {
            Err(HttpError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("read task failed: {e}"),
            ))
        });
    match result {
        Ok(r) => r,
        Err(e) => {
            metrics.requests_failed.fetch_add(1, Relaxed);
            warn!(status = %e.0, error = %e.1, "remote read failed");
            e.into_response()
        }
    }
}

impl Reads {
    /// Counts a series into the read metrics, once the response holds
    /// `response_bytes`; fails past the byte limit.
    fn count_series(&self, s: &ReadSeries, response_bytes: usize) -> Result<(), HttpError> {
        if response_bytes > self.limits.max_response_bytes {
            return Err(bad(format!(
                "the response is larger than the limit of {} bytes; narrow the matchers or the time range",
                self.limits.max_response_bytes
            )));
        }
        self.metrics.series.fetch_add(1, Relaxed);
        self.metrics.samples.fetch_add(s.ts.len() as u64, Relaxed);
        Ok(())
    }
}

/// One series of a read answer: Prometheus labels (sorted) and samples.
struct ReadSeries {
    labels: Vec<PromLabel>,
    ts: Vec<i64>,
    values: Vec<f64>,
}

fn read_blocking(reads: &Reads, body: &[u8]) -> Result<Response, HttpError> {
    let req = prometheus_body::read_request(body, reads.limits.max_request_bytes)?;
    let streamed = match req.accepted_response_types.first() {
        None => false,
        Some(&t) => match ResponseType::try_from(t) {
            Ok(ResponseType::Samples) => false,
            Ok(ResponseType::StreamedXorChunks) => true,
            Err(_) => return Err(bad(format!("unknown response type {t}"))),
        },
    };
    let mut samples_left = reads.limits.max_samples;
    if streamed {
        let mut out = Vec::new();
        for (qi, q) in req.queries.iter().enumerate() {
            for s in select(
                &reads.source,
                q,
                &mut samples_left,
                reads.limits.max_samples,
            )? {
                write_frames(&mut out, qi as i64, &s);
                reads.count_series(&s, out.len())?;
            }
        }
        return Ok((
            [(header::CONTENT_TYPE, STREAMED_CONTENT_TYPE)],
            Bytes::from(out),
        )
            .into_response());
    }
    let mut results = Vec::with_capacity(req.queries.len());
    let mut bytes = 0usize;
    for q in &req.queries {
        let mut timeseries = Vec::new();
        for s in select(
            &reads.source,
            q,
            &mut samples_left,
            reads.limits.max_samples,
        )? {
            // Encoded size, near enough: 2 varints and a double per sample.
            bytes += s.ts.len() * 20
                + s.labels
                    .iter()
                    .map(|l| l.name.len() + l.value.len() + 4)
                    .sum::<usize>();
            reads.count_series(&s, bytes)?;
            timeseries.push(TimeSeries {
                labels: s.labels,
                samples: s
                    .ts
                    .iter()
                    .zip(&s.values)
                    .map(|(&timestamp, &value)| Sample { value, timestamp })
                    .collect(),
                ..Default::default()
            });
        }
        results.push(QueryResult { timeseries });
    }
    let encoded = ReadResponse { results }.encode_to_vec();
    let compressed = snap::raw::Encoder::new()
        .compress_vec(&encoded)
        .map_err(|e| HttpError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-protobuf"),
            (header::CONTENT_ENCODING, "snappy"),
        ],
        Bytes::from(compressed),
    )
        .into_response())
}

/// The series of one query, sorted by label set, with their samples in the
/// inclusive range; series without samples there are left out.
fn select(
    source: &Source,
    q: &gpulse_proto::prometheus::Query,
    samples_left: &mut u64,
    max_samples: u64,
) -> Result<Vec<ReadSeries>, HttpError> {
    let matchers = q
        .matchers
        .iter()
        .map(matcher)
        .collect::<Result<Vec<_>, _>>()?;
    let (min, max) = (q.start_timestamp_ms, q.end_timestamp_ms);
    let selection = source
        .select_blocking(&matchers, min, max)
        .map_err(|e| match e {
            ClusterError::Refused(m) => HttpError(StatusCode::SERVICE_UNAVAILABLE, m),
            ClusterError::Internal(m) => HttpError(StatusCode::INTERNAL_SERVER_ERROR, m),
            ClusterError::TooLarge(l) => bad(l.to_string()),
        })?;
    if !selection.warnings.is_empty() {
        return Err(HttpError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "remote read refused: the answer would be partial, and remote read cannot say so: {}",
                selection.warnings.join("; ")
            ),
        ));
    }
    let mut out = Vec::new();
    for s in selection.series {
        let (mut ts, mut values) = (Vec::new(), Vec::new());
        s.read_into(min, max, &mut ts, &mut values)
            .map_err(|e| HttpError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        if ts.is_empty() {
            continue;
        }
        *samples_left = samples_left
            .checked_sub(ts.len() as u64)
            .ok_or_else(|| {
                bad(format!(
                    "the query selects more than {} samples (the remote-read sample limit); narrow the matchers or the time range",
                    max_samples
                ))
            })?;
        let mut labels: Vec<PromLabel> = std::iter::once(PromLabel {
            name: "__name__".into(),
            value: s.key.metric().into(),
        })
        .chain(s.key.labels().iter().map(|l| PromLabel {
            name: l.name.to_string(),
            value: l.value.to_string(),
        }))
        .collect();
        labels.sort_by(|a, b| a.name.cmp(&b.name));
        out.push(ReadSeries { labels, ts, values });
    }
    // Prometheus orders label sets pairwise by (name, value).
    out.sort_by(|a, b| {
        a.labels
            .iter()
            .map(|l| (&l.name, &l.value))
            .cmp(b.labels.iter().map(|l| (&l.name, &l.value)))
    });
    Ok(out)
}

fn matcher(m: &LabelMatcher) -> Result<Matcher, HttpError> {
    let re = |r: Result<Matcher, regex::Error>| {
        r.map_err(|e| {
            bad(format!(
                "invalid regex {:?} for label {:?}: {e}",
                m.value, m.name
            ))
        })
    };
    match label_matcher::Type::try_from(m.r#type) {
        Ok(label_matcher::Type::Eq) => Ok(Matcher::equal(&m.name, &m.value)),
        Ok(label_matcher::Type::Neq) => Ok(Matcher::not_equal(&m.name, &m.value)),
        Ok(label_matcher::Type::Re) => re(Matcher::regex(&m.name, &m.value)),
        Ok(label_matcher::Type::Nre) => re(Matcher::not_regex(&m.name, &m.value)),
        Err(_) => Err(bad(format!("unknown matcher type {}", m.r#type))),
    }
}

/// Appends the frames of one series: its chunks, cut into frames of about
/// [`MAX_FRAME_BYTES`].
fn write_frames(out: &mut Vec<u8>, query_index: i64, s: &ReadSeries) {
    let mut chunks = Vec::new();
    let mut size = 0;
    let flush = |out: &mut Vec<u8>, chunks: &mut Vec<Chunk>| {
        let msg = ChunkedReadResponse {
            chunked_series: vec![ChunkedSeries {
                labels: s.labels.clone(),
                chunks: std::mem::take(chunks),
            }],
            query_index,
        }
        .encode_to_vec();
        put_uvarint(out, msg.len() as u64);
        out.extend_from_slice(&crc32c::crc32c(&msg).to_be_bytes());
        out.extend_from_slice(&msg);
    };
    for (ts, vs) in
        s.ts.chunks(SAMPLES_PER_CHUNK)
            .zip(s.values.chunks(SAMPLES_PER_CHUNK))
    {
        let mut c = XorChunk::new();
        for (&t, &v) in ts.iter().zip(vs) {
            c.append(t, v);
        }
        size += c.bytes().len();
        chunks.push(Chunk {
            min_time_ms: ts[0],
            max_time_ms: ts[ts.len() - 1],
            r#type: chunk::Encoding::Xor as i32,
            data: c.bytes().to_vec(),
        });
        if size >= MAX_FRAME_BYTES {
            flush(out, &mut chunks);
            size = 0;
        }
    }
    if !chunks.is_empty() {
        flush(out, &mut chunks);
    }
}

#[cfg(test)]
mod tests;
