//! Prometheus remote write 1.0 (`POST /api/v1/write`) and remote read
//! (`POST /api/v1/read`), so that Prometheus, or anything that speaks these
//! protocols, can send data to gpulse and read it back.
//!
//! Bodies are snappy block-compressed protobuf (`proto/prometheus/*.proto`).
//! The decompressed length in the snappy header is checked against
//! [`RemoteLimits::max_request_bytes`] before anything is allocated.
//!
//! Write: each series needs a `__name__`; labels keep their names as sent
//! (`Hostname` and `hostname` are different labels). Answers 204 when every
//! sample is stored or was already stored (a retry), 400 for input a retry
//! cannot fix (bad protobuf, a series without a name, native histograms,
//! samples older than the out-of-order window: the rest of the request is
//! stored), and 500 only when storage failed, which is worth retrying.
//!
//! Read: the response type is the first of the client's
//! `accepted_response_types` (or `SAMPLES` when it lists none):
//! - `SAMPLES`: one snappy-compressed `ReadResponse`, one result per query.
//! - `STREAMED_XOR_CHUNKS`: frames of a uvarint length, a big-endian CRC32C
//!   (Castagnoli) of the message, and one `ChunkedReadResponse` holding one
//!   series (a series larger than 1 MiB continues in the next frame), its
//!   samples in Prometheus XOR chunks of up to 120 samples ([`xor`]).
//!
//! Series come sorted by their label sets; matchers are Prometheus's four
//! types with fully anchored regexes, and time bounds are inclusive. A read
//! that passes [`RemoteLimits::max_samples`] or `max_response_bytes` fails
//! with 400 and says which limit.
//!
//! In cluster mode ([`router_with_cluster`]) a read selects from every node
//! ([`crate::cluster`]). The remote-read protocol has no way to mark an
//! answer partial, so a read that would lack a shard (no replica could
//! serve it) fails with 503 and a message naming the shards; Prometheus
//! shows a failing remote read as a warning of its query. A cluster that
//! refuses to answer (a peer with another cluster file) also gives 503.

pub mod decode;
pub mod forward;
pub mod wire;
pub mod xor;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

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
use prost::Message;
use storage::admission::{LabelLimits, RejectCounters, SampleWindow};
use storage::{Label, Matcher, SeriesKey, SeriesRef, Storage};
use tracing::warn;

use self::decode::BodyError;
use self::xor::{SAMPLES_PER_CHUNK, XorChunk, put_uvarint};
use crate::cluster::{ClusterError, ClusterReader, Source};

/// Frames of a streamed read are cut at about this size.
const MAX_FRAME_BYTES: usize = 1 << 20;

const STREAMED_CONTENT_TYPE: &str =
    "application/x-streamed-protobuf; proto=prometheus.ChunkedReadResponse";

/// Bounds on one remote read or write request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteLimits {
    /// Largest request body, compressed or decompressed (default 32 MiB,
    /// `--remote-max-request-bytes`; Prometheus batches stay far below it).
    pub max_request_bytes: usize,
    /// Labels of a written series: the same limits as gRPC ingest
    /// (`--max-labels`, `--max-label-bytes`).
    pub labels: LabelLimits,
    /// Sample timestamps a write may carry (`--retention`, `--max-future`).
    pub window: SampleWindow,
    /// Most samples one read may return (default 50,000,000, Prometheus's
    /// `query.max-samples`).
    pub max_samples: u64,
    /// Largest read response, before compression (default 1 GiB).
    pub max_response_bytes: usize,
}

impl Default for RemoteLimits {
    fn default() -> Self {
        Self {
            max_request_bytes: 32 << 20,
            labels: LabelLimits::default(),
            window: SampleWindow::default(),
            max_samples: 50_000_000,
            max_response_bytes: 1 << 30,
        }
    }
}

/// Counters of the remote endpoints, for `/metrics`.
#[derive(Debug, Default)]
pub struct RemoteMetrics {
    pub write_requests: AtomicU64,
    /// Write requests answered with a 4xx.
    pub write_requests_invalid: AtomicU64,
    /// Write requests answered with a 5xx.
    pub write_requests_failed: AtomicU64,
    pub write_samples_accepted: AtomicU64,
    /// Samples of accepted requests not stored (already stored, too old).
    pub write_samples_dropped: AtomicU64,
    pub read_requests: AtomicU64,
    /// Read requests answered with an error.
    pub read_requests_failed: AtomicU64,
    pub read_series: AtomicU64,
    pub read_samples: AtomicU64,
    /// Cluster mode: parts of write requests an owner did not take (down,
    /// or 5xx); the request was answered 503 for the sender to retry.
    pub write_forward_failed: AtomicU64,
    /// Samples refused by the admission policy, by reason (window, labels).
    pub write_samples_rejected: RejectCounters,
    /// Write requests refused with 415: not `Content-Type:
    /// application/x-protobuf`, or a `Content-Encoding` other than snappy
    /// (what a cross-origin form or `fetch` without preflight sends).
    pub write_requests_unsupported_media: AtomicU64,
}

impl RemoteMetrics {
    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let counters: [(&str, &str, &AtomicU64); 10] = [
            (
                "gpulse_remote_write_requests_total",
                "Remote-write requests received.",
                &self.write_requests,
            ),
            (
                "gpulse_remote_write_requests_invalid_total",
                "Remote-write requests refused as invalid (HTTP 4xx).",
                &self.write_requests_invalid,
            ),
            (
                "gpulse_remote_write_requests_failed_total",
                "Remote-write requests that failed in storage (HTTP 5xx).",
                &self.write_requests_failed,
            ),
            (
                "gpulse_remote_write_samples_total",
                "Remote-write samples stored.",
                &self.write_samples_accepted,
            ),
            (
                "gpulse_remote_write_samples_dropped_total",
                "Remote-write samples not stored: already stored, or too old.",
                &self.write_samples_dropped,
            ),
            (
                "gpulse_remote_write_forward_failed_total",
                "Cluster mode: request parts an owner did not take (the request was answered 503).",
                &self.write_forward_failed,
            ),
            (
                "gpulse_remote_read_requests_total",
                "Remote-read requests received.",
                &self.read_requests,
            ),
            (
                "gpulse_remote_read_requests_failed_total",
                "Remote-read requests answered with an error.",
                &self.read_requests_failed,
            ),
            (
                "gpulse_remote_read_series_total",
                "Series returned by remote read.",
                &self.read_series,
            ),
            (
                "gpulse_remote_read_samples_total",
                "Samples returned by remote read.",
                &self.read_samples,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        self.write_samples_rejected.render(
            out,
            "gpulse_remote_write_samples_rejected_total",
            "Remote-write samples refused (HTTP 400), by reason.",
        );
        let name = "gpulse_remote_write_requests_unsupported_media_total";
        let _ = writeln!(
            out,
            "# HELP {name} Remote-write requests refused with 415 (not application/x-protobuf, or not snappy).\n# TYPE {name} counter\n{name} {}",
            self.write_requests_unsupported_media.load(Relaxed)
        );
    }
}

#[derive(Debug)]
struct Remote {
    storage: Arc<Storage>,
    limits: RemoteLimits,
    metrics: Arc<RemoteMetrics>,
    cache: SeriesCache,
    /// Cluster mode: writes are split by shard and forwarded to the owners.
    cluster: Option<Arc<cluster::ClusterState>>,
}

/// Most bytes of label sets [`SeriesCache`] holds before it starts over.
const SERIES_CACHE_BYTES: usize = 256 << 20;

/// Head refs of the label sets remote write has seen, keyed by their exact
/// wire bytes. Prometheus sends every sample with its whole label set; the
/// cache spares decoding the labels into strings, validating them and
/// building a key for each. Only label bytes that once went through that
/// slow path are cached, so a hit is exactly a label set already checked.
/// Head refs live as long as the process, so entries never go stale.
#[derive(Debug, Default)]
struct SeriesCache {
    map: Mutex<CacheMap>,
}

#[derive(Debug, Default)]
struct CacheMap {
    refs: HashMap<Box<[u8]>, SeriesRef, foldhash::quality::RandomState>,
    bytes: usize,
}

thread_local! {
    /// Each blocking thread's decode buffers, kept between requests.
    static RAW_WRITE: std::cell::RefCell<wire::RawWrite> = std::cell::RefCell::default();
}

/// The routes `/api/v1/write` and `/api/v1/read`.
pub fn router(storage: Arc<Storage>, limits: RemoteLimits, metrics: Arc<RemoteMetrics>) -> Router {
    routes(
        storage.clone(),
        Source::Local(storage),
        limits,
        metrics,
        None,
    )
}

/// The routes of a cluster node: `/api/v1/read` reads the whole cluster
/// through `reader` (see the module docs for partial reads), and
/// `/api/v1/write` splits each request by shard and has every owner store
/// its part ([`forward`]).
pub fn router_with_cluster(
    reader: ClusterReader,
    limits: RemoteLimits,
    metrics: Arc<RemoteMetrics>,
) -> Router {
    let state = reader.state().clone();
    routes(
        reader.storage().clone(),
        Source::Cluster(reader),
        limits,
        metrics,
        Some(state),
    )
}

fn routes(
    storage: Arc<Storage>,
    source: Source,
    limits: RemoteLimits,
    metrics: Arc<RemoteMetrics>,
    cluster: Option<Arc<cluster::ClusterState>>,
) -> Router {
    let remote = Arc::new(Remote {
        storage,
        limits,
        metrics,
        cache: SeriesCache::default(),
        cluster,
    });
    Router::new()
        .route("/api/v1/write", post(write))
        .with_state(remote.clone())
        .merge(
            Router::new()
                .route("/api/v1/read", post(read))
                .with_state(Arc::new(Reads { remote, source })),
        )
        .layer(DefaultBodyLimit::max(limits.max_request_bytes))
}

/// The state of the read route: where reads select (this node's storage,
/// or the cluster).
#[derive(Debug)]
struct Reads {
    remote: Arc<Remote>,
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
        let status = match e {
            BodyError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            _ => StatusCode::BAD_REQUEST,
        };
        HttpError(status, e.to_string())
    }
}

async fn write(
    State(remote): State<Arc<Remote>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let m = &remote.metrics;
    m.write_requests.fetch_add(1, Relaxed);
    if let Err(e) = check_media(&headers) {
        m.write_requests_invalid.fetch_add(1, Relaxed);
        m.write_requests_unsupported_media.fetch_add(1, Relaxed);
        warn!(error = %e.1, "remote write refused");
        return e.into_response();
    }
    let r = remote.clone();
    let forwarded = headers.contains_key(forward::FORWARDED_HEADER);
    // Decoding and the WAL write block: keep them off the async workers.
    let result = tokio::task::spawn_blocking(move || write_blocking(&r, &body, forwarded))
        .await
        .unwrap_or_else(|e| {
            Err(HttpError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("write task failed: {e}"),
            ))
        });
    match result {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => {
            if e.0.is_server_error() {
                m.write_requests_failed.fetch_add(1, Relaxed);
            } else {
                m.write_requests_invalid.fetch_add(1, Relaxed);
            }
            warn!(status = %e.0, error = %e.1, "remote write refused");
            e.into_response()
        }
    }
}

/// What `/api/v1/write` requires of the headers: `Content-Type:
/// application/x-protobuf` (Prometheus sends it, with `Content-Encoding:
/// snappy`). A browser page can send neither across origins without a CORS
/// preflight, which gpulse never answers, so no web page can write.
fn check_media(headers: &axum::http::HeaderMap) -> Result<(), HttpError> {
    let unsupported = |msg: String| HttpError(StatusCode::UNSUPPORTED_MEDIA_TYPE, msg);
    let ct = headers
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?"))
        .unwrap_or("");
    let media = ct.split(';').next().unwrap_or("").trim();
    if !media.eq_ignore_ascii_case("application/x-protobuf") {
        return Err(unsupported(format!(
            "remote write needs Content-Type: application/x-protobuf (a snappy-compressed \
             prometheus.WriteRequest); got {:?}",
            ct
        )));
    }
    // Remote write 2.0 names its message; only 1.0 is understood.
    if let Some(proto) = ct
        .split(';')
        .skip(1)
        .filter_map(|p| p.trim().strip_prefix("proto="))
        .next()
        .filter(|p| *p != "prometheus.WriteRequest")
    {
        return Err(unsupported(format!(
            "remote write 1.0 only: the body must be a prometheus.WriteRequest, not {proto}"
        )));
    }
    if let Some(enc) = headers.get(header::CONTENT_ENCODING)
        && !enc.as_bytes().eq_ignore_ascii_case(b"snappy")
    {
        return Err(unsupported(format!(
            "remote write needs Content-Encoding: snappy; got {:?}",
            enc.to_str().unwrap_or("?")
        )));
    }
    Ok(())
}

fn write_blocking(remote: &Remote, body: &[u8], forwarded: bool) -> Result<(), HttpError> {
    let raw = decode::decompress(body, remote.limits.max_request_bytes)?;
    RAW_WRITE.with_borrow_mut(|w| {
        w.read(&raw)
            .map_err(|e| bad(format!("body is not a prometheus.WriteRequest: {e}")))?;
        match (&remote.cluster, forwarded) {
            (Some(_), false) => forward::route(remote, w),
            (Some(_), true) => forward::store_forwarded(remote, w),
            (None, _) => store(remote, w, None),
        }
    })
}

/// Stores the series of `w`, or only those listed (ascending) in `only`.
///
/// Admission ([`storage::admission`]): a series past the label limits
/// refuses the whole request (400, nothing stored), as a series that cannot
/// be named; samples outside the time window are left out, counted by
/// reason, and the request is answered 400 naming the first of them once
/// the others are stored (Prometheus drops a request on 4xx and never
/// retries it).
fn store(remote: &Remote, w: &wire::RawWrite, only: Option<&[usize]>) -> Result<(), HttpError> {
    store_attempt(remote, w, only, true)
}

/// [`store`]; `may_retry`: a cached ref whose series left the head (idle
/// through a flush) empties the cache and the request is resolved again once.
/// Nothing is stored or counted before the append, so the retry is clean.
fn store_attempt(
    remote: &Remote,
    w: &wire::RawWrite,
    only: Option<&[usize]>,
    may_retry: bool,
) -> Result<(), HttpError> {
    let picked = |i: usize| only.is_none_or(|o| o.binary_search(&i).is_ok());
    let storage = &remote.storage;
    let metrics = &remote.metrics;
    let labels_of = |series: &wire::RawSeries| &w.label_bytes[series.labels.clone()];
    let total: usize = w
        .series
        .iter()
        .enumerate()
        .filter(|(i, _)| picked(*i))
        .map(|(_, s)| s.samples.len())
        .sum();
    // 0. The time window: `keep` stays empty while every sample is inside.
    // Refusals are counted once the request is settled (it may be resolved
    // again after an eviction).
    let bounds = remote.limits.window.bounds_now();
    let window_refused = RejectCounters::default();
    let mut keep: Vec<bool> = Vec::new();
    let mut refused = 0usize;
    let mut first_refused: Option<(usize, i64)> = None;
    for (i, series) in w.series.iter().enumerate() {
        if !picked(i) {
            continue;
        }
        for j in series.samples.clone() {
            let t = w.timestamps[j];
            if let Some(reason) = bounds.reason(t) {
                if keep.is_empty() {
                    keep = vec![true; w.timestamps.len()];
                }
                keep[j] = false;
                window_refused.add(reason, 1);
                refused += 1;
                first_refused.get_or_insert((i, t));
            }
        }
    }
    let kept = |j: usize| keep.is_empty() || keep[j];
    let has_samples = |i: usize, s: &wire::RawSeries| picked(i) && s.samples.clone().any(&kept);
    // 1. Cached refs, by label bytes.
    let mut refs_of: Vec<Option<SeriesRef>> = Vec::with_capacity(w.series.len());
    {
        let map = remote.cache.map.lock().expect("BUG: series cache poisoned");
        for (i, series) in w.series.iter().enumerate() {
            if series.histograms {
                return Err(bad(format!(
                    "series {i}: native histograms are not supported; send classic histograms"
                )));
            }
            refs_of.push(if has_samples(i, series) {
                map.refs.get(labels_of(series)).copied()
            } else {
                None
            });
        }
    }
    // 2. The rest through the slow path, which decodes and validates the
    // labels (UTF-8, one `__name__`, no name twice, the label limits); new
    // series are created together (one WAL write).
    let mut missing = Vec::new();
    let mut keys = Vec::new();
    let refuse_request = |reason: storage::admission::Reason, msg: String| {
        metrics.write_samples_rejected.add(reason, total as u64);
        bad(msg)
    };
    for (i, series) in w.series.iter().enumerate() {
        if refs_of[i].is_none() && has_samples(i, series) {
            let labels = wire::labels(labels_of(series)).map_err(|e| {
                refuse_request(
                    storage::admission::Reason::InvalidLabel,
                    format!("series {i}: {e}"),
                )
            })?;
            let key = series_key(labels, &remote.limits.labels)
                .map_err(|(reason, e)| refuse_request(reason, format!("series {i}: {e}")))?;
            keys.push(key);
            missing.push(i);
        }
    }
    if !keys.is_empty() {
        let created = storage.series_refs(keys).map_err(|e| match e {
            storage::Error::SeriesLimit { .. } | storage::Error::InvalidSeries(_) => {
                bad(e.to_string())
            }
            e => HttpError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        })?;
        let mut map = remote.cache.map.lock().expect("BUG: series cache poisoned");
        for (i, r) in missing.into_iter().zip(created) {
            let bytes = labels_of(&w.series[i]);
            if map.bytes + bytes.len() > SERIES_CACHE_BYTES {
                *map = CacheMap::default();
            }
            if map.refs.insert(bytes.into(), r).is_none() {
                map.bytes += bytes.len();
            }
            refs_of[i] = Some(r);
        }
    }
    let n = w.timestamps.len();
    let (mut refs, mut ts, mut vals) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for (i, series) in w.series.iter().enumerate() {
        if !has_samples(i, series) {
            continue;
        }
        let r = refs_of[i].expect("BUG: every series with samples has a ref by now");
        if keep.is_empty() {
            refs.extend(std::iter::repeat_n(r, series.samples.len()));
            ts.extend_from_slice(&w.timestamps[series.samples.clone()]);
            vals.extend_from_slice(&w.values[series.samples.clone()]);
        } else {
            for j in series.samples.clone().filter(|&j| kept(j)) {
                refs.push(r);
                ts.push(w.timestamps[j]);
                vals.push(w.values[j]);
            }
        }
    }
    let mut problems = Vec::new();
    let count_refused = || {
        for r in storage::admission::Reason::ALL {
            metrics.write_samples_rejected.add(r, window_refused.get(r));
        }
    };
    if let Some((i, t)) = first_refused {
        let e = bounds
            .check(t)
            .expect_err("BUG: a refused sample fails the check");
        let name = wire::labels(labels_of(&w.series[i]))
            .map(|l| describe_labels(&l))
            .unwrap_or_default();
        problems.push(format!(
            "{refused} of {total} samples are outside the accepted time window and were not stored; \
             the first: series {i} {name}: {e}"
        ));
    }
    if !refs.is_empty() {
        let outcome = match storage.append(&refs, &ts, &vals) {
            Err(storage::Error::SeriesEvicted { .. }) if may_retry => {
                *remote.cache.map.lock().expect("BUG: series cache poisoned") = CacheMap::default();
                return store_attempt(remote, w, only, false);
            }
            r => r.map_err(|e| match e {
                storage::Error::BadBatch { .. } => bad(e.to_string()),
                storage::Error::SeriesEvicted { .. } => {
                    HttpError(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
                }
                e => HttpError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            })?,
        };
        metrics
            .write_samples_accepted
            .fetch_add(u64::from(outcome.accepted), Relaxed);
        if let Some(c) = &remote.cluster {
            c.add_samples(u64::from(outcome.accepted));
        }
        metrics
            .write_samples_dropped
            .fetch_add(u64::from(outcome.dropped()), Relaxed);
        if outcome.too_old > 0 {
            problems.push(format!(
                "{} of {} samples are older than the out-of-order window (--ooo-window) and were dropped",
                outcome.too_old,
                refs.len()
            ));
        }
    }
    // Settled (stored, or nothing to store): count the window's refusals once.
    count_refused();
    if problems.is_empty() {
        return Ok(());
    }
    Err(bad(format!(
        "{}; the others are stored",
        problems.join("; ")
    )))
}

/// `{name="value", ...}`, at most about 200 bytes, for error messages.
fn describe_labels(labels: &[(String, String)]) -> String {
    let mut out = String::from("{");
    for (k, (n, v)) in labels.iter().enumerate() {
        if out.len() > 200 {
            out.push_str(", …");
            break;
        }
        if k > 0 {
            out.push_str(", ");
        }
        let v: String = v.chars().take(64).collect();
        let _ = write!(out, "{n}={v:?}");
    }
    out.push('}');
    out
}

/// A series key from Prometheus labels: `__name__` is the metric. Checks
/// the label limits every entry shares ([`LabelLimits`]).
fn series_key(
    labels: Vec<(String, String)>,
    limits: &LabelLimits,
) -> Result<SeriesKey, (storage::admission::Reason, String)> {
    use storage::admission::Reason;
    let mut metric = None;
    let mut rest = Vec::with_capacity(labels.len());
    for (name, value) in labels {
        if name == "__name__" {
            if metric.replace(value).is_some() {
                return Err((
                    Reason::InvalidLabel,
                    "label \"__name__\" appears more than once".into(),
                ));
            }
        } else {
            rest.push(Label::new(name, value));
        }
    }
    let metric = metric.filter(|m| !m.is_empty()).ok_or((
        Reason::InvalidLabel,
        "the series has no __name__ label".to_string(),
    ))?;
    limits
        .check_series(
            &metric,
            rest.iter().map(|l| (l.name.as_str(), l.value.as_str())),
        )
        .map_err(|e| (e.reason, e.message))?;
    SeriesKey::new(metric, rest).map_err(|e| (Reason::InvalidLabel, e.to_string()))
}

async fn read(State(reads): State<Arc<Reads>>, body: Bytes) -> Response {
    let remote = reads.remote.clone();
    remote.metrics.read_requests.fetch_add(1, Relaxed);
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
            remote.metrics.read_requests_failed.fetch_add(1, Relaxed);
            warn!(status = %e.0, error = %e.1, "remote read failed");
            e.into_response()
        }
    }
}

impl Remote {
    /// Counts a series into the read metrics, once the response holds
    /// `response_bytes`; fails past the byte limit.
    fn count_series(&self, s: &ReadSeries, response_bytes: usize) -> Result<(), HttpError> {
        if response_bytes > self.limits.max_response_bytes {
            return Err(bad(format!(
                "the response is larger than the limit of {} bytes; narrow the matchers or the time range",
                self.limits.max_response_bytes
            )));
        }
        self.metrics.read_series.fetch_add(1, Relaxed);
        self.metrics
            .read_samples
            .fetch_add(s.ts.len() as u64, Relaxed);
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
    let remote = &*reads.remote;
    let req = decode::read_request(body, remote.limits.max_request_bytes)?;
    let streamed = match req.accepted_response_types.first() {
        None => false,
        Some(&t) => match ResponseType::try_from(t) {
            Ok(ResponseType::Samples) => false,
            Ok(ResponseType::StreamedXorChunks) => true,
            Err(_) => return Err(bad(format!("unknown response type {t}"))),
        },
    };
    let mut samples_left = remote.limits.max_samples;
    if streamed {
        let mut out = Vec::new();
        for (qi, q) in req.queries.iter().enumerate() {
            for s in select(
                &reads.source,
                q,
                &mut samples_left,
                remote.limits.max_samples,
            )? {
                write_frames(&mut out, qi as i64, &s);
                remote.count_series(&s, out.len())?;
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
            remote.limits.max_samples,
        )? {
            // Encoded size, near enough: 2 varints and a double per sample.
            bytes += s.ts.len() * 20
                + s.labels
                    .iter()
                    .map(|l| l.name.len() + l.value.len() + 4)
                    .sum::<usize>();
            remote.count_series(&s, bytes)?;
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
            name: l.name.clone(),
            value: l.value.clone(),
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
