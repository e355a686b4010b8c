//! The agent's own metrics, served on `/metrics` in the Prometheus text
//! format (version 0.0.4), so that the fleet's agents can be watched with the
//! same tools as everything else.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use axum::Router;
use axum::http::header;
use axum::routing::get;
use tokio::net::TcpListener;

/// Counters and gauges of one agent. Shared by the sampler, the shipper and
/// the `/metrics` endpoint.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    pub polls: AtomicU64,
    pub poll_errors: AtomicU64,
    /// Polls dropped because the queue from the sampler was full.
    pub polls_dropped: AtomicU64,
    pub samples: AtomicU64,
    pub batches_sent: AtomicU64,
    /// Of `batches_sent`, sent again after a reconnect.
    pub batches_resent: AtomicU64,
    pub batches_acked: AtomicU64,
    pub batches_rejected: AtomicU64,
    /// Acked by ingest as already stored (a re-send after a lost ack).
    pub batches_duplicate: AtomicU64,
    pub samples_acked: AtomicU64,
    /// Samples in acked batches that ingest did not store (duplicate timestamps, too old).
    pub samples_dropped_by_ingest: AtomicU64,
    pub reconnects: AtomicU64,
    /// Samples dropped because the memory buffer and the spool were full.
    pub samples_dropped: AtomicU64,
    pub batches_dropped: AtomicU64,
    /// Gauges: what waits for an ack.
    pub buffer_batches: AtomicU64,
    pub buffer_samples: AtomicU64,
    pub spool_batches: AtomicU64,
    pub spool_bytes: AtomicU64,
    /// Spool records found damaged when the spool was opened.
    pub spool_damaged_records: AtomicU64,
    /// NVML calls that failed, as the source counts them.
    pub nvml_errors: AtomicU64,
}

impl AgentMetrics {
    /// The metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let mut put = |name: &str, kind: &str, help: &str, v: &AtomicU64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            let _ = writeln!(out, "{name} {}", v.load(Relaxed));
        };
        let c = "counter";
        let g = "gauge";
        put(
            "gpulse_agent_polls_total",
            c,
            "Polls of the GPU source.",
            &self.polls,
        );
        put(
            "gpulse_agent_poll_errors_total",
            c,
            "Polls whose source call failed as a whole.",
            &self.poll_errors,
        );
        put(
            "gpulse_agent_polls_dropped_total",
            c,
            "Polls dropped because the queue to the shipper was full.",
            &self.polls_dropped,
        );
        put(
            "gpulse_agent_samples_total",
            c,
            "Samples read from the GPU source.",
            &self.samples,
        );
        put(
            "gpulse_agent_batches_sent_total",
            c,
            "Batches sent to ingest, re-sends included.",
            &self.batches_sent,
        );
        put(
            "gpulse_agent_batches_resent_total",
            c,
            "Batches sent again after a reconnect.",
            &self.batches_resent,
        );
        put(
            "gpulse_agent_batches_acked_total",
            c,
            "Batches acked by ingest.",
            &self.batches_acked,
        );
        put(
            "gpulse_agent_batches_rejected_total",
            c,
            "Batches ingest refused as invalid (dropped).",
            &self.batches_rejected,
        );
        put(
            "gpulse_agent_batches_duplicate_total",
            c,
            "Batches ingest acked as already stored.",
            &self.batches_duplicate,
        );
        put(
            "gpulse_agent_samples_acked_total",
            c,
            "Samples ingest stored.",
            &self.samples_acked,
        );
        put(
            "gpulse_agent_samples_dropped_by_ingest_total",
            c,
            "Samples in acked batches that ingest did not store.",
            &self.samples_dropped_by_ingest,
        );
        put(
            "gpulse_agent_reconnects_total",
            c,
            "Reconnects to ingest (retries).",
            &self.reconnects,
        );
        put(
            "gpulse_agent_samples_dropped_total",
            c,
            "Samples dropped because the buffer and the spool were full.",
            &self.samples_dropped,
        );
        put(
            "gpulse_agent_batches_dropped_total",
            c,
            "Batches dropped because the buffer and the spool were full.",
            &self.batches_dropped,
        );
        put(
            "gpulse_agent_buffer_batches",
            g,
            "Unacked batches held in memory.",
            &self.buffer_batches,
        );
        put(
            "gpulse_agent_buffer_samples",
            g,
            "Samples of the unacked batches held in memory.",
            &self.buffer_samples,
        );
        put(
            "gpulse_agent_spool_batches",
            g,
            "Unacked batches in the disk spool.",
            &self.spool_batches,
        );
        put(
            "gpulse_agent_spool_bytes",
            g,
            "Size of the disk spool.",
            &self.spool_bytes,
        );
        put(
            "gpulse_agent_spool_damaged_records_total",
            c,
            "Spool records found damaged at start.",
            &self.spool_damaged_records,
        );
        put(
            "gpulse_agent_nvml_errors_total",
            c,
            "NVML calls that failed.",
            &self.nvml_errors,
        );
        out
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: TcpListener,
    metrics: Arc<AgentMetrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new().route(
        "/metrics",
        get(move || {
            let m = metrics.clone();
            async move {
                (
                    [(
                        header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    m.render(),
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// Binds `addr` for [`serve`]; port 0 picks a free port.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await
}
