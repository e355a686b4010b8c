//! Prometheus remote write 1.0 (`POST /api/v1/write`): Prometheus, or
//! anything that speaks the protocol, sends samples here. The other write
//! path beside the agents' gRPC streams ([`crate::IngestService`]), with the
//! same limits ([`WriteLimits`]) and the same answers to storage errors
//! ([`WriteError`]).
//!
//! Bodies are snappy block-compressed `prometheus.WriteRequest`s; the
//! decompressed length in the snappy header is checked against
//! [`RemoteWriteConfig::max_request_bytes`] before anything is allocated
//! ([`gpulse_proto::prometheus_body`]).
//!
//! Each series needs a `__name__`; labels keep their names as sent
//! (`Hostname` and `hostname` are different labels). Answers 204 when every
//! sample is stored or was already stored (a retry), 400 for input a retry
//! cannot fix (bad protobuf, a series without a name, native histograms,
//! samples outside the time window: the rest of the request is stored), 413
//! for a body over the limit, 415 for another content type, and 503 when
//! storage could not take it now, which Prometheus retries.
//!
//! In cluster mode ([`router`] with a cluster) a request is split by shard
//! and every owner stores its part ([`forward`]).

pub mod forward;
pub mod wire;

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
use gpulse_proto::prometheus_body::{self, BodyError};
use storage::admission::{LabelLimits, RejectCounters};
use storage::{Label, SeriesKey, SeriesRef, Storage};
use tracing::warn;

use crate::{WriteError, WriteLimits};

/// Bounds on one remote-write request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemoteWriteConfig {
    /// Labels and sample times: those of gRPC ingest.
    pub limits: WriteLimits,
    /// Largest request body, compressed or decompressed (default 32 MiB,
    /// `--remote-max-request-bytes`; Prometheus batches stay far below it).
    pub max_request_bytes: usize,
}

impl Default for RemoteWriteConfig {
    fn default() -> Self {
        Self {
            limits: WriteLimits::default(),
            max_request_bytes: 32 << 20,
        }
    }
}

/// Counters of `/api/v1/write`, for `/metrics`.
#[derive(Debug, Default)]
pub struct RemoteWriteMetrics {
    pub requests: AtomicU64,
    /// Requests answered with a 4xx.
    pub requests_invalid: AtomicU64,
    /// Requests answered with a 5xx.
    pub requests_failed: AtomicU64,
    pub samples_accepted: AtomicU64,
    /// Samples of accepted requests not stored (already stored, too old).
    pub samples_dropped: AtomicU64,
    /// Cluster mode: parts of requests an owner did not take (down, or
    /// 5xx); the request was answered 503 for the sender to retry.
    pub forward_failed: AtomicU64,
    /// Samples refused by the admission policy, by reason (window, labels).
    pub samples_rejected: RejectCounters,
    /// Requests refused with 415: not `Content-Type:
    /// application/x-protobuf`, or a `Content-Encoding` other than snappy
    /// (what a cross-origin form or `fetch` without preflight sends).
    pub requests_unsupported_media: AtomicU64,
}

impl RemoteWriteMetrics {
    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let counters: [(&str, &str, &AtomicU64); 6] = [
            (
                "gpulse_remote_write_requests_total",
                "Remote-write requests received.",
                &self.requests,
            ),
            (
                "gpulse_remote_write_requests_invalid_total",
                "Remote-write requests refused as invalid (HTTP 4xx).",
                &self.requests_invalid,
            ),
            (
                "gpulse_remote_write_requests_failed_total",
                "Remote-write requests that failed in storage (HTTP 5xx).",
                &self.requests_failed,
            ),
            (
                "gpulse_remote_write_samples_total",
                "Remote-write samples stored.",
                &self.samples_accepted,
            ),
            (
                "gpulse_remote_write_samples_dropped_total",
                "Remote-write samples not stored: already stored, or too old.",
                &self.samples_dropped,
            ),
            (
                "gpulse_remote_write_forward_failed_total",
                "Cluster mode: request parts an owner did not take (the request was answered 503).",
                &self.forward_failed,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        self.samples_rejected.render(
            out,
            "gpulse_remote_write_samples_rejected_total",
            "Remote-write samples refused (HTTP 400), by reason.",
        );
        let name = "gpulse_remote_write_requests_unsupported_media_total";
        let _ = writeln!(
            out,
            "# HELP {name} Remote-write requests refused with 415 (not application/x-protobuf, or not snappy).\n# TYPE {name} counter\n{name} {}",
            self.requests_unsupported_media.load(Relaxed)
        );
    }
}

#[derive(Debug)]
struct Remote {
    storage: Arc<Storage>,
    config: RemoteWriteConfig,
    metrics: Arc<RemoteWriteMetrics>,
    cache: SeriesCache,
    /// Cluster mode: writes are split by shard and forwarded to the owners.
    cluster: Option<Arc<cluster::ClusterState>>,
    /// Cluster mode with TLS between nodes: the HTTPS client of forwards.
    forward_tls: Option<ureq::Agent>,
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

/// The route `/api/v1/write`. With `cluster`, each request is split by
/// shard and every owner stores its part ([`forward`]).
pub fn router(
    storage: Arc<Storage>,
    config: RemoteWriteConfig,
    metrics: Arc<RemoteWriteMetrics>,
    cluster: Option<Arc<cluster::ClusterState>>,
) -> Router {
    let forward_tls = cluster
        .as_ref()
        .and_then(|c| c.tls())
        .map(forward::tls_agent);
    let remote = Arc::new(Remote {
        storage,
        config,
        metrics,
        cache: SeriesCache::default(),
        cluster,
        forward_tls,
    });
    Router::new()
        .route("/api/v1/write", post(write))
        .with_state(remote)
        .layer(DefaultBodyLimit::max(config.max_request_bytes))
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

impl From<WriteError> for HttpError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Invalid(m) => HttpError(StatusCode::BAD_REQUEST, m),
            WriteError::Unavailable(m) => HttpError(StatusCode::SERVICE_UNAVAILABLE, m),
        }
    }
}

async fn write(
    State(remote): State<Arc<Remote>>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let m = &remote.metrics;
    m.requests.fetch_add(1, Relaxed);
    if let Err(e) = check_media(&headers) {
        m.requests_invalid.fetch_add(1, Relaxed);
        m.requests_unsupported_media.fetch_add(1, Relaxed);
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
                m.requests_failed.fetch_add(1, Relaxed);
            } else {
                m.requests_invalid.fetch_add(1, Relaxed);
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
    let raw = prometheus_body::decompress(body, remote.config.max_request_bytes)?;
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
    let bounds = remote.config.limits.window.bounds_now();
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
        metrics.samples_rejected.add(reason, total as u64);
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
            let key = series_key(labels, &remote.config.limits.labels)
                .map_err(|(reason, e)| refuse_request(reason, format!("series {i}: {e}")))?;
            keys.push(key);
            missing.push(i);
        }
    }
    if !keys.is_empty() {
        let created = storage
            .series_refs(keys)
            .map_err(|e| HttpError::from(WriteError::from(e)))?;
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
            metrics.samples_rejected.add(r, window_refused.get(r));
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
            r => r.map_err(|e| HttpError::from(WriteError::from(e)))?,
        };
        metrics
            .samples_accepted
            .fetch_add(u64::from(outcome.accepted), Relaxed);
        if let Some(c) = &remote.cluster {
            c.add_samples(u64::from(outcome.accepted));
        }
        metrics
            .samples_dropped
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

#[cfg(test)]
mod tests;
