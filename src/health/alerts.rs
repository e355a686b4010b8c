//! Pushes health events to Alertmanager (`--alertmanager-url`), API v2:
//! `POST /api/v2/alerts` with one alert per event.
//!
//! Labels: `alertname="GpuHealth"`, `kind`, `severity`, `Hostname`, `gpu`,
//! `UUID`, and `rack`, `row`, `cluster`, `xid` where known; annotations
//! `action`, `evidence` and `event_id`; `startsAt` is the event's onset. An
//! active alert has no `endsAt`, so Alertmanager keeps it for its
//! `resolve_timeout`; every active alert is sent again each minute to keep
//! it firing. A cleared event is sent once with `endsAt` = its clearing
//! time, which resolves it. While Alertmanager cannot be reached (or
//! answers with an error) nothing is lost: the alerts wait and are retried
//! with backoff from 1 s to 30 s, counted in
//! `gpulse_health_alert_push_failures_total`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam::channel::{Receiver, RecvTimeoutError};
use health::engine::Event;
use tracing::{info, warn};

/// How often active alerts are sent again.
const RESEND_EVERY: Duration = Duration::from_secs(60);
/// Most alerts per request; more go in several.
const MAX_PER_REQUEST: usize = 1000;
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Counters of the pusher, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct AlertMetrics {
    pub(crate) alerts_sent: AtomicU64,
    pub(crate) push_failures: AtomicU64,
}

/// Checks `--alertmanager-url`: `http://host:port` (no TLS client yet).
pub(crate) fn check_url(url: &str) -> anyhow::Result<String> {
    let url = url.trim_end_matches('/');
    if !url.starts_with("http://") || url.len() <= "http://".len() {
        anyhow::bail!(
            "--alertmanager-url must be http://HOST:PORT (https is not supported yet), got {url:?}"
        );
    }
    Ok(url.to_string())
}

struct Pending {
    event: Event,
    /// Sent since it last changed.
    sent: bool,
}

pub(crate) struct Pusher {
    pub(crate) url: String,
    pub(crate) rx: Receiver<Event>,
    pub(crate) metrics: std::sync::Arc<AlertMetrics>,
}

impl Pusher {
    /// Runs until `stop`, then makes one last attempt to deliver what waits.
    pub(crate) fn run(self, stop: &AtomicBool) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(10)))
            .http_status_as_error(false)
            .build()
            .into();
        let endpoint = format!("{}/api/v2/alerts", self.url);
        let mut alerts: BTreeMap<u64, Pending> = BTreeMap::new();
        let mut last_full = Instant::now();
        let mut next_try = Instant::now();
        let mut backoff = Duration::from_secs(1);
        let mut failing = false;
        loop {
            let stopping = stop.load(Relaxed);
            match self.rx.recv_timeout(Duration::from_millis(500)) {
                Ok(e) => {
                    alerts.insert(
                        e.id,
                        Pending {
                            event: e,
                            sent: false,
                        },
                    );
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    if !stopping {
                        return;
                    }
                }
            }
            while let Ok(e) = self.rx.try_recv() {
                alerts.insert(
                    e.id,
                    Pending {
                        event: e,
                        sent: false,
                    },
                );
            }
            let due = alerts.values().any(|a| !a.sent)
                || (!alerts.is_empty() && last_full.elapsed() >= RESEND_EVERY);
            if due && (Instant::now() >= next_try || stopping) {
                let body: Vec<serde_json::Value> =
                    alerts.values().map(|a| alert_json(&a.event)).collect();
                let result = body.chunks(MAX_PER_REQUEST).try_for_each(|chunk| {
                    let mut resp = agent
                        .post(&endpoint)
                        .header("content-type", "application/json")
                        .send(serde_json::to_vec(chunk).expect("BUG: JSON of alerts"))
                        .map_err(|e| e.to_string())?;
                    if resp.status().is_success() {
                        Ok(())
                    } else {
                        let text = resp.body_mut().read_to_string().unwrap_or_default();
                        Err(format!("HTTP {}: {}", resp.status(), text.trim()))
                    }
                });
                match result {
                    Ok(()) => {
                        self.metrics
                            .alerts_sent
                            .fetch_add(body.len() as u64, Relaxed);
                        // A resolved alert is done once Alertmanager has it.
                        alerts.retain(|_, a| a.event.is_active());
                        for a in alerts.values_mut() {
                            a.sent = true;
                        }
                        last_full = Instant::now();
                        backoff = Duration::from_secs(1);
                        if failing {
                            info!(url = %self.url, "Alertmanager reachable again; alerts delivered");
                            failing = false;
                        }
                    }
                    Err(e) => {
                        self.metrics.push_failures.fetch_add(1, Relaxed);
                        if !failing {
                            warn!(url = %self.url, error = %e, "cannot push health alerts to Alertmanager; retrying with backoff, nothing is dropped");
                            failing = true;
                        }
                        next_try = Instant::now() + backoff;
                        backoff = (backoff * 2).min(MAX_BACKOFF);
                    }
                }
            }
            if stopping {
                return;
            }
        }
    }
}

fn rfc3339(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_millis(t).to_string()
}

/// The API v2 `postableAlert` of an event.
pub(crate) fn alert_json(e: &Event) -> serde_json::Value {
    let mut labels = serde_json::Map::new();
    let mut put = |k: &str, v: String| {
        labels.insert(k.to_string(), serde_json::Value::String(v));
    };
    put("alertname", "GpuHealth".into());
    put("kind", e.kind.as_str().into());
    put("severity", e.severity.as_str().into());
    put("Hostname", e.gpu.host.clone());
    put("gpu", e.gpu.gpu.to_string());
    put("UUID", e.gpu.uuid.clone());
    for (k, v) in [
        ("rack", &e.gpu.rack),
        ("row", &e.gpu.row),
        ("cluster", &e.gpu.cluster),
    ] {
        if let Some(v) = v {
            put(k, v.clone());
        }
    }
    if let Some(x) = e.xid {
        put("xid", x.to_string());
    }
    let mut alert = serde_json::json!({
        "labels": labels,
        "annotations": {
            "action": e.action,
            "evidence": e.evidence,
            "event_id": e.id.to_string(),
        },
        "startsAt": rfc3339(e.onset_ts_ms),
    });
    if let Some(at) = e.cleared_ts_ms {
        // Alertmanager resolves an alert whose end is past; a clearing
        // stamped after the wall clock (a skewed agent) resolves now.
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64);
        alert["endsAt"] = rfc3339(at.min(now)).into();
    }
    alert
}
