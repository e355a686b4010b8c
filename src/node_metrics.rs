//! `GET /metrics` of `serve`: the node's own counters and gauges in the
//! Prometheus text format (0.0.4), so a Prometheus (or gpulse itself) can
//! watch ingest, storage, queries and rejected input.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use axum::Router;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use ingest::IngestMetrics;
use ingest::remote_write::RemoteWriteMetrics;
use query::QueryMetrics;
use query::remote_read::RemoteReadMetrics;
use storage::Storage;

/// Where the numbers come from.
pub(crate) struct NodeMetrics {
    pub(crate) storage: Arc<Storage>,
    pub(crate) ingest: Arc<IngestMetrics>,
    pub(crate) query: Arc<QueryMetrics>,
    pub(crate) promql: Arc<QueryMetrics>,
    pub(crate) remote_write: Arc<RemoteWriteMetrics>,
    pub(crate) remote_read: Arc<RemoteReadMetrics>,
    /// SQL statements refused by the read-only guard (HTTP and PostgreSQL).
    pub(crate) readonly: Arc<query::readonly::ReadOnlyMetrics>,
    /// Queries refused or stopped by a query limit; slots in use.
    pub(crate) guard: Arc<query::limits::GuardMetrics>,
    /// The HTTP listener's edges (timeouts, refused admin requests).
    pub(crate) http: Arc<query::http::EdgeMetrics>,
    /// Cluster mode: Flight and cluster-read counters.
    pub(crate) cluster: Option<Arc<query::cluster::ClusterMetrics>>,
    /// The health engine's input and events.
    pub(crate) health: Arc<crate::health::HealthMetrics>,
    /// Requests refused for their credentials (`--auth-file`).
    pub(crate) auth: Option<Arc<auth::AuthMetrics>>,
    /// TLS handshakes that failed (`--tls-cert`).
    pub(crate) tls: Option<Arc<auth::tls::TlsMetrics>>,
}

pub(crate) fn router(m: NodeMetrics) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .with_state(Arc::new(m))
}

async fn metrics(State(m): State<Arc<NodeMetrics>>) -> impl IntoResponse {
    // `stats` takes storage's locks: keep it off the async workers.
    let body = tokio::task::spawn_blocking(move || render(&m))
        .await
        .unwrap_or_else(|e| format!("# rendering failed: {e}\n"));
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, value: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

pub(crate) fn render(m: &NodeMetrics) -> String {
    let mut out = String::new();
    let i = &m.ingest;
    let counters: [(&str, &str, &AtomicU64); 6] = [
        (
            "gpulse_ingest_streams_opened_total",
            "Agent streams opened.",
            &i.streams_opened,
        ),
        (
            "gpulse_ingest_batches_acked_total",
            "Agent batches stored and acked.",
            &i.batches_acked,
        ),
        (
            "gpulse_ingest_batches_rejected_total",
            "Agent batches rejected as invalid (bad input).",
            &i.batches_rejected,
        ),
        (
            "gpulse_ingest_batches_duplicate_total",
            "Agent batches acked as re-sends of stored ones.",
            &i.batches_duplicate,
        ),
        (
            "gpulse_ingest_samples_total",
            "Samples stored from agent batches.",
            &i.samples_accepted,
        ),
        (
            "gpulse_ingest_samples_dropped_total",
            "Samples of acked agent batches that storage did not store (already stored, too old).",
            &i.samples_dropped,
        ),
    ];
    for (name, help, v) in counters {
        metric(&mut out, name, "counter", help, v.load(Relaxed));
    }
    metric(
        &mut out,
        "gpulse_ingest_streams_active",
        "gauge",
        "Agent streams open now.",
        i.streams_active.load(Relaxed),
    );

    let s = m.storage.metrics();
    let counters: [(&str, &str, &AtomicU64); 19] = [
        (
            "gpulse_storage_flush_failures_total",
            "Flushes that failed (I/O: retried by the next flush; data a writer refused: set aside in quarantine/).",
            &s.flush_failures,
        ),
        (
            "gpulse_storage_samples_out_of_range_total",
            "Samples refused by storage: timestamp outside 0001-01-01..9999-12-31 UTC (append: batch refused; WAL replay: set aside).",
            &s.samples_out_of_range,
        ),
        (
            "gpulse_storage_samples_set_aside_total",
            "Samples a flush or WAL replay could not store, written to quarantine/set-aside-*.txt.",
            &s.samples_set_aside,
        ),
        (
            "gpulse_storage_rollup_records_set_aside_total",
            "1-minute rollup records a flush could not write, written to quarantine/set-aside-*.txt.",
            &s.rollup_records_set_aside,
        ),
        (
            "gpulse_storage_samples_appended_total",
            "Samples stored (WAL and head).",
            &s.samples_appended,
        ),
        (
            "gpulse_storage_samples_out_of_order_total",
            "Samples stored out of order, within the out-of-order window.",
            &s.samples_out_of_order,
        ),
        (
            "gpulse_storage_samples_duplicate_total",
            "Samples dropped: their timestamp was already stored.",
            &s.samples_duplicate,
        ),
        (
            "gpulse_storage_samples_too_old_total",
            "Samples dropped: older than the out-of-order window.",
            &s.samples_too_old,
        ),
        (
            "gpulse_storage_flushes_total",
            "Head flushes to segment files.",
            &s.flushes,
        ),
        (
            "gpulse_storage_compactions_total",
            "Segment compactions.",
            &s.compactions,
        ),
        (
            "gpulse_storage_segments_expired_total",
            "Segments deleted by retention.",
            &s.segments_expired,
        ),
        (
            "gpulse_storage_rollup_merges_total",
            "Rollup files written by merges (compaction, and retention of the 1-minute tier).",
            &s.rollup_compactions,
        ),
        (
            "gpulse_storage_segments_quarantined_total",
            "Segments moved to quarantine/ as corrupt.",
            &s.segments_quarantined,
        ),
        (
            "gpulse_storage_rollup_files_quarantined_total",
            "Rollup files moved to quarantine/ as corrupt.",
            &s.rollup_files_quarantined,
        ),
        (
            "gpulse_storage_rollup_read_errors_total",
            "Rollup blocks skipped at query time because they failed to decode.",
            &s.rollup_read_errors,
        ),
        (
            "gpulse_storage_chunk_read_errors_total",
            "Raw chunks that failed to decode in a newest-sample read (the fleet view); their series were left out.",
            &s.chunk_read_errors,
        ),
        (
            "gpulse_wal_replayed_samples_total",
            "Samples put back into the head by WAL replay at start.",
            &s.wal_replayed_samples,
        ),
        (
            "gpulse_wal_orphan_samples_total",
            "WAL samples whose series definition was lost to corruption.",
            &s.wal_orphan_samples,
        ),
        (
            "gpulse_storage_batches_duplicate_total",
            "Batches dropped whole as re-sends of stored ones.",
            &s.batches_duplicate,
        ),
    ];
    for (name, help, v) in counters {
        metric(&mut out, name, "counter", help, v.load(Relaxed));
    }
    let st = m.storage.stats();
    for (name, help, v) in [
        (
            "gpulse_head_series",
            "Series in the in-memory head.",
            st.head_series,
        ),
        (
            "gpulse_head_samples",
            "Samples in the in-memory head.",
            st.head_samples,
        ),
        ("gpulse_segments", "Segment files in use.", st.segments),
        (
            "gpulse_segment_samples",
            "Samples in segment files.",
            st.segment_samples,
        ),
        (
            "gpulse_segment_bytes",
            "Bytes of segment files.",
            st.segment_bytes,
        ),
        (
            "gpulse_rollup_files",
            "Rollup files in use.",
            m.storage.rollup_files() as u64,
        ),
        (
            "gpulse_producers",
            "Producers (agent id and epoch) whose batches are de-duplicated.",
            st.producers,
        ),
    ] {
        metric(&mut out, name, "gauge", help, v);
    }
    metric(
        &mut out,
        "gpulse_storage_head_series",
        "gauge",
        "Live series in the head (what --max-series counts; idle series leave at a flush).",
        st.head_series,
    );
    metric(
        &mut out,
        "gpulse_storage_series_evicted_total",
        "counter",
        "Series that left the head at a flush because they took no sample for series_idle (15 min).",
        m.storage.metrics().series_evicted.load(Relaxed),
    );
    metric(
        &mut out,
        "gpulse_storage_wal_write_errors_total",
        "counter",
        "WAL writes refused because they could not be written (disk full, I/O error); cut back, nothing acked.",
        st.wal_write_errors,
    );
    m.query.render(&mut out, "sql");
    m.promql.render(&mut out, "promql");
    m.remote_write.render(&mut out);
    m.remote_read.render(&mut out);
    m.ingest.render_limits(&mut out);
    m.http.render(&mut out);
    m.readonly.render(&mut out);
    m.guard.render(&mut out);
    m.health.render(&mut out);
    if let Some(a) = &m.auth {
        a.render(&mut out);
    }
    if let Some(t) = &m.tls {
        t.render(&mut out);
    }
    if let Some(c) = &m.cluster {
        c.render(&mut out);
    }
    out
}
