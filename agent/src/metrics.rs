//! The agent's own metrics, served on `/metrics` in the Prometheus text
//! format (version 0.0.4), so that the fleet's agents can be watched with the
//! same tools as everything else.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::http::header;
use axum::routing::get;
use tokio::net::TcpListener;

/// Counters and gauges of one agent. Shared by the sampler, the shipper and
/// the `/metrics` endpoint.
///
/// In cluster mode (`--sharded`) each owner node has its own shipper, which
/// counts into its own [`OwnerMetrics`]; `/metrics` then shows the shipper
/// metrics once per owner, with an `owner` label, and the sampler metrics
/// (polls, samples, NVML errors) once.
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
    /// Time spent in the source's `sample` calls, ns: the cost of a poll.
    pub poll_nanos: AtomicU64,
    /// Cluster mode: `Owners` calls that failed (a node down or not in
    /// cluster mode, or an answer the agent refused).
    pub owner_lookup_errors: AtomicU64,
    /// Set once in cluster mode: shipper metrics are per owner.
    sharded: AtomicBool,
    /// Cluster mode: by node id, every node this run has shipped to.
    owners: Mutex<BTreeMap<String, Arc<OwnerMetrics>>>,
}

/// Cluster mode: one owner node's shipper.
#[derive(Debug, Default)]
pub struct OwnerMetrics {
    /// The counters and gauges of the node's shipper (its sampler fields stay 0).
    pub shipper: Arc<AgentMetrics>,
    /// 1 while the node is an owner of this host's shard.
    pub current: AtomicU64,
    /// 1 while a shipper runs for the node: an owner, or a former owner that
    /// still delivers what it holds.
    pub shipping: AtomicU64,
}

impl OwnerMetrics {
    /// Batches held for the node and not yet acked by it (memory and spool).
    pub fn backlog(&self) -> u64 {
        self.shipper.buffer_batches.load(Relaxed) + self.shipper.spool_batches.load(Relaxed)
    }
}

/// Who writes a metric: the sampler (one value per agent) or a shipper (one
/// per owner in cluster mode).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scope {
    Agent,
    Shipper,
}

type Field = fn(&AgentMetrics) -> &AtomicU64;

const COUNTER: &str = "counter";
const GAUGE: &str = "gauge";

/// Every metric, in `/metrics` order.
const METRICS: &[(&str, &str, &str, Scope, Field)] = &[
    (
        "gpulse_agent_polls_total",
        COUNTER,
        "Polls of the GPU source.",
        Scope::Agent,
        |m| &m.polls,
    ),
    (
        "gpulse_agent_poll_errors_total",
        COUNTER,
        "Polls whose source call failed as a whole.",
        Scope::Agent,
        |m| &m.poll_errors,
    ),
    (
        "gpulse_agent_polls_dropped_total",
        COUNTER,
        "Polls dropped because the queue to the shipper was full.",
        Scope::Agent,
        |m| &m.polls_dropped,
    ),
    (
        "gpulse_agent_samples_total",
        COUNTER,
        "Samples read from the GPU source.",
        Scope::Agent,
        |m| &m.samples,
    ),
    (
        "gpulse_agent_batches_sent_total",
        COUNTER,
        "Batches sent to ingest, re-sends included.",
        Scope::Shipper,
        |m| &m.batches_sent,
    ),
    (
        "gpulse_agent_batches_resent_total",
        COUNTER,
        "Batches sent again after a reconnect.",
        Scope::Shipper,
        |m| &m.batches_resent,
    ),
    (
        "gpulse_agent_batches_acked_total",
        COUNTER,
        "Batches acked by ingest.",
        Scope::Shipper,
        |m| &m.batches_acked,
    ),
    (
        "gpulse_agent_batches_rejected_total",
        COUNTER,
        "Batches ingest refused as invalid (dropped).",
        Scope::Shipper,
        |m| &m.batches_rejected,
    ),
    (
        "gpulse_agent_batches_duplicate_total",
        COUNTER,
        "Batches ingest acked as already stored.",
        Scope::Shipper,
        |m| &m.batches_duplicate,
    ),
    (
        "gpulse_agent_samples_acked_total",
        COUNTER,
        "Samples ingest stored.",
        Scope::Shipper,
        |m| &m.samples_acked,
    ),
    (
        "gpulse_agent_samples_dropped_by_ingest_total",
        COUNTER,
        "Samples in acked batches that ingest did not store.",
        Scope::Shipper,
        |m| &m.samples_dropped_by_ingest,
    ),
    (
        "gpulse_agent_reconnects_total",
        COUNTER,
        "Reconnects to ingest (retries).",
        Scope::Shipper,
        |m| &m.reconnects,
    ),
    (
        "gpulse_agent_samples_dropped_total",
        COUNTER,
        "Samples dropped because the buffer and the spool were full.",
        Scope::Shipper,
        |m| &m.samples_dropped,
    ),
    (
        "gpulse_agent_batches_dropped_total",
        COUNTER,
        "Batches dropped because the buffer and the spool were full.",
        Scope::Shipper,
        |m| &m.batches_dropped,
    ),
    (
        "gpulse_agent_buffer_batches",
        GAUGE,
        "Unacked batches held in memory.",
        Scope::Shipper,
        |m| &m.buffer_batches,
    ),
    (
        "gpulse_agent_buffer_samples",
        GAUGE,
        "Samples of the unacked batches held in memory.",
        Scope::Shipper,
        |m| &m.buffer_samples,
    ),
    (
        "gpulse_agent_spool_batches",
        GAUGE,
        "Unacked batches in the disk spool.",
        Scope::Shipper,
        |m| &m.spool_batches,
    ),
    (
        "gpulse_agent_spool_bytes",
        GAUGE,
        "Size of the disk spool.",
        Scope::Shipper,
        |m| &m.spool_bytes,
    ),
    (
        "gpulse_agent_spool_damaged_records_total",
        COUNTER,
        "Spool records found damaged at start.",
        Scope::Shipper,
        |m| &m.spool_damaged_records,
    ),
    (
        "gpulse_agent_nvml_errors_total",
        COUNTER,
        "NVML calls that failed.",
        Scope::Agent,
        |m| &m.nvml_errors,
    ),
];

impl AgentMetrics {
    /// The metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let sharded = self.sharded.load(Relaxed);
        let owners = self.owners();
        for &(name, kind, help, scope, field) in METRICS {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            if sharded && scope == Scope::Shipper {
                for (id, o) in &owners {
                    let v = field(&o.shipper).load(Relaxed);
                    let _ = writeln!(out, "{name}{{owner=\"{id}\"}} {v}");
                }
            } else {
                let _ = writeln!(out, "{name} {}", field(self).load(Relaxed));
            }
        }
        let name = "gpulse_agent_poll_duration_seconds_total";
        let _ = writeln!(
            out,
            "# HELP {name} Time spent reading the GPU source (NVML calls), over all polls."
        );
        let _ = writeln!(out, "# TYPE {name} {COUNTER}");
        let secs = self.poll_nanos.load(Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name} {secs}");
        if sharded {
            let mut per_owner =
                |name: &str, kind: &str, help: &str, v: &dyn Fn(&OwnerMetrics) -> u64| {
                    let _ = writeln!(out, "# HELP {name} {help}");
                    let _ = writeln!(out, "# TYPE {name} {kind}");
                    for (id, o) in &owners {
                        let _ = writeln!(out, "{name}{{owner=\"{id}\"}} {}", v(o));
                    }
                };
            per_owner(
                "gpulse_agent_owner_backlog_batches",
                GAUGE,
                "Batches held for the owner node and not yet acked by it (replica lag).",
                &OwnerMetrics::backlog,
            );
            per_owner(
                "gpulse_agent_owner_current",
                GAUGE,
                "1 while the node owns this host's shard.",
                &|o| o.current.load(Relaxed),
            );
            per_owner(
                "gpulse_agent_owner_shipping",
                GAUGE,
                "1 while a shipper delivers to the node (an owner, or a former owner with batches left).",
                &|o| o.shipping.load(Relaxed),
            );
            let name = "gpulse_agent_owner_lookup_errors_total";
            let _ = writeln!(
                out,
                "# HELP {name} Owners calls that failed or were answered with a list the agent refused."
            );
            let _ = writeln!(out, "# TYPE {name} {COUNTER}");
            let _ = writeln!(out, "{name} {}", self.owner_lookup_errors.load(Relaxed));
        }
        out
    }

    /// Cluster mode: shipper metrics are per owner from now on.
    pub(crate) fn set_sharded(&self) {
        self.sharded.store(true, Relaxed);
    }

    /// Cluster mode: the metrics of owner `node_id`, registered on first use.
    pub(crate) fn owner(&self, node_id: &str) -> Arc<OwnerMetrics> {
        self.owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(node_id.to_owned())
            .or_default()
            .clone()
    }

    /// Cluster mode: every node this run has shipped to, by id.
    pub fn owners(&self) -> Vec<(String, Arc<OwnerMetrics>)> {
        self.owners
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(id, o)| (id.clone(), o.clone()))
            .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipper_metrics_are_per_owner_in_cluster_mode() {
        let m = AgentMetrics::default();
        m.polls.store(7, Relaxed);
        m.batches_acked.store(3, Relaxed);
        m.poll_nanos.store(2_500_000_000, Relaxed);
        let text = m.render();
        assert!(text.contains("\ngpulse_agent_polls_total 7\n"), "{text}");
        assert!(
            text.contains("\ngpulse_agent_poll_duration_seconds_total 2.5\n"),
            "{text}"
        );
        assert!(
            text.contains("\ngpulse_agent_batches_acked_total 3\n"),
            "{text}"
        );
        assert!(!text.contains("owner"), "{text}");
        assert_eq!(text.matches("# TYPE ").count(), METRICS.len() + 1);

        m.set_sharded();
        let b = m.owner("b");
        b.shipper.batches_acked.store(5, Relaxed);
        b.shipper.buffer_batches.store(2, Relaxed);
        b.shipper.spool_batches.store(40, Relaxed);
        b.current.store(1, Relaxed);
        let a = m.owner("a");
        a.shipping.store(1, Relaxed);
        m.owner_lookup_errors.store(4, Relaxed);
        let text = m.render();
        for line in [
            "gpulse_agent_polls_total 7",
            "gpulse_agent_batches_acked_total{owner=\"a\"} 0",
            "gpulse_agent_batches_acked_total{owner=\"b\"} 5",
            "gpulse_agent_owner_backlog_batches{owner=\"b\"} 42",
            "gpulse_agent_owner_current{owner=\"b\"} 1",
            "gpulse_agent_owner_current{owner=\"a\"} 0",
            "gpulse_agent_owner_shipping{owner=\"a\"} 1",
            "gpulse_agent_owner_lookup_errors_total 4",
        ] {
            assert!(
                text.contains(&format!("\n{line}\n")),
                "{line} not in\n{text}"
            );
        }
        // The agent-wide value of a shipper metric is not shown beside the owners'.
        assert!(
            !text.contains("\ngpulse_agent_batches_acked_total 3\n"),
            "{text}"
        );
        assert_eq!(m.owners().len(), 2);
    }
}
