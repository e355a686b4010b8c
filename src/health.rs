//! The health engine of `serve` (issue #16): watches every stored batch
//! ([`storage::AppendObserver`]), turns the GPU fields in it into polls for
//! the detectors of `health`, and keeps their events:
//!
//! - in `<data_dir>/health/events.log` (`docs/format/health-events.md`), so
//!   that they survive a restart;
//! - in the SQL table `health_events` ([`query::health_events`]);
//! - as the series `gpulse_health_active{kind, severity, Hostname, gpu, UUID,
//!   rack, row, cluster}` (1 while the event is active, 0 once it cleared,
//!   rewritten every minute while active so that PromQL's 5-minute lookback
//!   always finds it) and `gpulse_health_events_total{kind, severity, rack}`
//!   (`Hostname` instead of `rack` for a GPU without one);
//! - at `GET /api/v1/health`: the active events and every GPU's state;
//! - with `--alertmanager-url`, as alerts in Alertmanager ([`alerts`]).
//!
//! The observer runs on the appending thread, so it only copies the batch
//! into a bounded queue; when the engine is behind, batches are dropped and
//! counted (`gpulse_health_batches_dropped_total`), never waited for. One
//! thread owns the engine. A series is mapped to (GPU, field) once, by its
//! key: `UUID` names the GPU, `Hostname`, `gpu`, `rack`, `row` and `cluster`
//! place it; series that are not a field a detector reads are skipped, and
//! from then on left out of the copies ([`Skipped`]). The queue is bounded
//! in bytes, not only in batches: a batch of a backfill holds thousands,
//! and 4,096 of them held 170 MB while a slowed engine (under heaptrack)
//! caught up.

mod alerts;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use crossbeam::channel::{Receiver, Sender, TrySendError, bounded};
use health::engine::{Change, Engine, Event, GpuState};
use health::log::EventLog;
use health::{Field, GpuId, HealthConfig, Inventory, Kind, Severity};
use storage::{AppendObserver, Label, SeriesKey, SeriesRef, Storage};
use tracing::{error, info, warn};

/// Batches the queue holds before the observer drops them.
const QUEUE_BATCHES: usize = 4096;
/// Bytes of samples the queue holds before the observer drops batches:
/// 40 MiB, about 14 s of the 24 fields the detectors read from 10,000 GPUs
/// polled every second (12 bytes a sample and a few runs of timestamps:
/// [`Batch::bytes`]).
const QUEUE_BYTES: usize = 40 << 20;
/// A GPU's poll in progress is complete once it is this much older than the
/// wall clock: an agent sends each poll whole within a batch or two.
const POLL_SETTLE_MS: i64 = 2_000;
/// How often active events are written again as `gpulse_health_active`.
const REASSERT_EVERY: Duration = Duration::from_secs(60);
/// How often the fleet's inventory is handed to the engine again (`drift`).
const INVENTORY_EVERY: Duration = Duration::from_secs(30);
/// ... and at most this soon after the engine met new GPUs.
const INVENTORY_NEW_GPUS: Duration = Duration::from_secs(2);
/// The log is rewritten (one record per event) past this many records.
const LOG_REWRITE_RECORDS: u64 = 4 * Engine::MAX_CLOSED as u64;
/// Event changes waiting for the Alertmanager pusher.
const ALERT_QUEUE: usize = 100_000;
/// A GPU without a poll for this long is `unknown` in `/api/v1/health`.
pub(crate) const STALE_MS: i64 = 60_000;

/// A copy of a stored batch, less the skipped series. The samples of a
/// GPU's poll share its timestamp and arrive together, so the timestamps
/// are kept as runs: a backfill's batch of 2,700 samples holds a few dozen,
/// and a queued sample takes 12 bytes, not 20 (the queue held 1-1.6 M
/// samples at the end of a 2 h backfill of 1,000 GPUs on 2 cores).
#[derive(Debug)]
struct Batch {
    refs: Vec<SeriesRef>,
    values: Vec<f64>,
    /// `(timestamp, samples)`: consecutive samples with one timestamp.
    ts_runs: Vec<(i64, u32)>,
}

impl Batch {
    fn push(&mut self, r: SeriesRef, ts_ms: i64, v: f64) {
        self.refs.push(r);
        self.values.push(v);
        match self.ts_runs.last_mut() {
            Some((t, n)) if *t == ts_ms && *n < u32::MAX => *n += 1,
            _ => self.ts_runs.push((ts_ms, 1)),
        }
    }

    /// What it takes of the queue's [`QUEUE_BYTES`].
    fn bytes(&self) -> usize {
        self.refs.len() * std::mem::size_of::<SeriesRef>()
            + self.values.len() * std::mem::size_of::<f64>()
            + self.ts_runs.len() * std::mem::size_of::<(i64, u32)>()
    }

    /// Its samples in order: `(ref, timestamp, value)`.
    fn samples(&self) -> impl Iterator<Item = (SeriesRef, i64, f64)> + '_ {
        self.ts_runs
            .iter()
            .flat_map(|&(t, n)| std::iter::repeat_n(t, n as usize))
            .zip(self.refs.iter().zip(&self.values))
            .map(|(t, (&r, &v))| (r, t, v))
    }
}

/// The series the engine found to be no field of a detector (storage refs,
/// small dense integers, as bits): the observer leaves their samples out of
/// what it queues. About half of dcgm-exporter's fields are read by no
/// detector. Refs are never reused within a process, so a bit once set
/// stays true.
#[derive(Debug, Default)]
struct Skipped {
    bits: std::sync::RwLock<Vec<u64>>,
}

impl Skipped {
    fn insert(&self, r: SeriesRef) {
        let (word, bit) = ((r.0 / 64) as usize, r.0 % 64);
        let mut bits = self.bits.write().unwrap_or_else(|p| p.into_inner());
        if bits.len() <= word {
            bits.resize(word + 1, 0);
        }
        bits[word] |= 1 << bit;
    }

    /// The samples of `refs` not skipped, as a batch (`None` if none is
    /// left).
    fn keep(&self, refs: &[SeriesRef], ts_ms: &[i64], values: &[f64]) -> Option<Batch> {
        let bits = self.bits.read().unwrap_or_else(|p| p.into_inner());
        let kept = |r: &SeriesRef| {
            let word = (r.0 / 64) as usize;
            bits.get(word).is_none_or(|w| w & (1 << (r.0 % 64)) == 0)
        };
        let n = refs.iter().filter(|r| kept(r)).count();
        if n == 0 {
            return None;
        }
        let mut b = Batch {
            refs: Vec::with_capacity(n),
            values: Vec::with_capacity(n),
            ts_runs: Vec::new(),
        };
        for ((r, &t), &v) in refs.iter().zip(ts_ms).zip(values) {
            if kept(r) {
                b.push(*r, t, v);
            }
        }
        b.ts_runs.shrink_to_fit();
        Some(b)
    }
}

/// The storage observer: copies each batch, less the series the engine
/// skips, into the engine's queue.
struct Observer {
    tx: Sender<Batch>,
    skipped: Arc<Skipped>,
    /// Bytes in the queue (the worker takes off what it has taken in).
    queued: Arc<AtomicUsize>,
    metrics: Arc<HealthMetrics>,
}

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("health::Observer")
    }
}

impl AppendObserver for Observer {
    fn appended(&self, refs: &[SeriesRef], ts_ms: &[i64], values: &[f64]) {
        let Some(batch) = self.skipped.keep(refs, ts_ms, values) else {
            return;
        };
        let n = batch.bytes();
        let now = self.queued.fetch_add(n, Relaxed) + n;
        if now > QUEUE_BYTES {
            self.queued.fetch_sub(n, Relaxed);
            self.metrics.batches_dropped.fetch_add(1, Relaxed);
            return;
        }
        self.metrics.queue_peak.fetch_max(now, Relaxed);
        match self.tx.try_send(batch) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.queued.fetch_sub(n, Relaxed);
                self.metrics.batches_dropped.fetch_add(1, Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {
                self.queued.fetch_sub(n, Relaxed);
            }
        }
    }
}

/// Counters of the health engine, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct HealthMetrics {
    batches_dropped: AtomicU64,
    /// The most bytes the queue has held at once.
    queue_peak: AtomicUsize,
    polls: AtomicU64,
    late_samples: AtomicU64,
    log_write_errors: AtomicU64,
    /// Events opened, by kind and severity at opening.
    opened: Mutex<HashMap<(Kind, Severity), u64>>,
    alerts: Arc<alerts::AlertMetrics>,
}

impl HealthMetrics {
    pub(crate) fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        for (name, help, v) in [
            (
                "gpulse_health_batches_dropped_total",
                "Stored batches the health engine did not see: its queue was full.",
                &self.batches_dropped,
            ),
            (
                "gpulse_health_polls_total",
                "GPU polls fed to the health detectors.",
                &self.polls,
            ),
            (
                "gpulse_health_late_samples_total",
                "Samples older than their GPU's poll in progress, not used by the detectors.",
                &self.late_samples,
            ),
            (
                "gpulse_health_log_write_errors_total",
                "Failed writes of the health event log.",
                &self.log_write_errors,
            ),
            (
                "gpulse_health_alerts_sent_total",
                "Alerts delivered to Alertmanager (each minute's resend counts again).",
                &self.alerts.alerts_sent,
            ),
            (
                "gpulse_health_alert_push_failures_total",
                "Failed pushes to Alertmanager; the alerts wait and are retried.",
                &self.alerts.push_failures,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
        let name = "gpulse_health_queue_peak_bytes";
        let _ = writeln!(
            out,
            "# HELP {name} The most bytes of samples the health engine's queue has held at once (it drops batches past {QUEUE_BYTES}).\n# TYPE {name} gauge\n{name} {}",
            self.queue_peak.load(Relaxed)
        );
        let name = "gpulse_health_events_total";
        let _ = writeln!(
            out,
            "# HELP {name} Health events opened, by kind and severity at opening.\n# TYPE {name} counter"
        );
        let opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<_> = opened.iter().collect();
        rows.sort();
        for ((kind, severity), n) in rows {
            let _ = writeln!(out, "{name}{{kind=\"{kind}\",severity=\"{severity}\"}} {n}");
        }
    }
}

/// What readers share with the engine's thread.
#[derive(Debug)]
pub(crate) struct Shared {
    engine: Mutex<Engine>,
    pub(crate) metrics: Arc<HealthMetrics>,
}

impl Shared {
    fn engine(&self) -> std::sync::MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The `/api/v1/health` answer of this node alone.
    pub(crate) fn report(&self, now_ms: i64) -> serde_json::Value {
        let engine = self.engine();
        let mut active: Vec<Event> = engine.active().cloned().collect();
        active.sort_by_key(|e| e.id);
        let states: Vec<(GpuId, GpuState)> = engine
            .states(now_ms, STALE_MS)
            .into_iter()
            .map(|(id, s)| (id.clone(), s))
            .collect();
        drop(engine);
        report_json(&active, &states, &[])
    }
}

/// The `/api/v1/health` answer: active events, and each GPU's state. GPUs
/// are listed in three parallel arrays (UUID, host, state), and only those
/// not `ok`, so the answer stays small at 100,000 GPUs. `warnings` (a
/// cluster's partial answer) are listed as the Prometheus API lists them.
fn report_json(
    active: &[Event],
    states: &[(GpuId, GpuState)],
    warnings: &[String],
) -> serde_json::Value {
    let mut counts: HashMap<&str, u64> = HashMap::new();
    let (mut uuid, mut host, mut state) = (Vec::new(), Vec::new(), Vec::new());
    for (id, s) in states {
        *counts.entry(s.as_str()).or_default() += 1;
        if *s != GpuState::Ok {
            uuid.push(id.uuid.as_str());
            host.push(id.host.as_str());
            state.push(s.as_str());
        }
    }
    let mut answer = serde_json::json!({
        "status": "success",
        "data": {
            "gpus": states.len(),
            "states": counts,
            "not_ok": {"uuid": uuid, "host": host, "state": state},
            "active": active.iter().map(event_json).collect::<Vec<_>>(),
        }
    });
    if !warnings.is_empty() {
        answer["warnings"] = serde_json::json!(warnings);
    }
    answer
}

fn event_json(e: &Event) -> serde_json::Value {
    serde_json::json!({
        "id": e.id,
        "kind": e.kind.as_str(),
        "severity": e.severity.as_str(),
        "cluster": e.gpu.cluster,
        "row": e.gpu.row,
        "rack": e.gpu.rack,
        "host": e.gpu.host,
        "gpu": e.gpu.gpu,
        "uuid": e.gpu.uuid,
        "xid": e.xid,
        "onset_at_ms": e.onset_ts_ms,
        "detected_at_ms": e.detected_ts_ms,
        "action": e.action,
        "evidence": e.evidence,
    })
}

impl Shared {
    /// The engine's GPUs in slot order. A slot's GPU never changes and new
    /// GPUs take new slots at the end, so a reader can keep what it derives
    /// from this list while [`Self::slot_states`] returns as many states.
    pub(crate) fn slot_ids(&self) -> Vec<GpuId> {
        self.engine()
            .states(0, STALE_MS)
            .into_iter()
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The state of each engine slot at `now_ms` (see [`Self::slot_ids`]).
    pub(crate) fn slot_states(&self, now_ms: i64) -> Vec<GpuState> {
        self.engine()
            .states(now_ms, STALE_MS)
            .into_iter()
            .map(|(_, s)| s)
            .collect()
    }
}

impl query::health_events::HealthSource for Shared {
    fn events(&self) -> Vec<Event> {
        self.engine().events().cloned().collect()
    }

    fn states(&self, now_ms: i64) -> Vec<(GpuId, GpuState)> {
        self.engine()
            .states(now_ms, STALE_MS)
            .into_iter()
            .map(|(id, s)| (id.clone(), s))
            .collect()
    }
}

/// The running engine: its shared state and its threads.
pub(crate) struct Health {
    pub(crate) shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// With `--alertmanager-url`: the pusher, and its own stop flag (it
    /// stops after the engine, to send the engine's last changes).
    pusher: Option<(Arc<AtomicBool>, std::thread::JoinHandle<()>)>,
}

impl Health {
    /// Reads the event log back, installs the observer on `storage` and
    /// starts the engine's thread (and with `alertmanager`, a URL checked by
    /// [`check_alertmanager_url`], the pusher's).
    pub(crate) fn start(storage: Arc<Storage>, alertmanager: Option<&str>) -> anyhow::Result<Self> {
        let mut engine = Engine::new(HealthConfig::default()).context("health configuration")?;
        let path = storage.data_dir().join("health").join("events.log");
        let (mut log, recovered) =
            EventLog::open(&path).with_context(|| format!("opening {}", path.display()))?;
        if recovered.dropped_bytes > 0 {
            warn!(
                path = %path.display(),
                bytes = recovered.dropped_bytes,
                "health event log: cut a torn or damaged tail; the events before it are kept"
            );
        }
        let active = recovered.events.iter().filter(|e| e.is_active()).count();
        info!(
            events = recovered.events.len(),
            active, "health engine: events read back"
        );
        engine.restore(recovered.events);
        if log.records() > LOG_REWRITE_RECORDS {
            log.rewrite(engine.events())
                .with_context(|| format!("rewriting {}", path.display()))?;
        }
        let metrics = Arc::new(HealthMetrics::default());
        let pusher = match alertmanager {
            Some(url) => {
                let (tx, rx) = bounded(ALERT_QUEUE);
                let stop = Arc::new(AtomicBool::new(false));
                let p = alerts::Pusher {
                    url: url.to_string(),
                    rx,
                    metrics: metrics.alerts.clone(),
                };
                // Alertmanager learns the events open at the restart again.
                for e in engine.active() {
                    let _ = tx.try_send(e.clone());
                }
                let thread = {
                    let stop = stop.clone();
                    std::thread::Builder::new()
                        .name("gpulse-alerts".into())
                        .spawn(move || p.run(&stop))
                        .context("starting the Alertmanager pusher's thread")?
                };
                info!(url, "health alerts go to Alertmanager");
                Some((tx, stop, thread))
            }
            None => None,
        };
        let shared = Arc::new(Shared {
            engine: Mutex::new(engine),
            metrics: metrics.clone(),
        });
        let (tx, rx) = bounded(QUEUE_BATCHES);
        let skipped = Arc::new(Skipped::default());
        let queued = Arc::new(AtomicUsize::new(0));
        if storage
            .set_observer(Arc::new(Observer {
                tx,
                skipped: skipped.clone(),
                queued: queued.clone(),
                metrics: metrics.clone(),
            }))
            .is_err()
        {
            anyhow::bail!("BUG: the storage already has an observer");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut worker = Worker {
            storage,
            shared: shared.clone(),
            log,
            series: Vec::new(),
            skipped,
            queued,
            own: HashMap::new(),
            totals: HashMap::new(),
            last_reassert: Instant::now(),
            last_inventory: None,
            changes: Vec::new(),
            alerts: pusher.as_ref().map(|p| p.0.clone()),
        };
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("gpulse-health".into())
                .spawn(move || worker.run(&rx, &stop))
                .context("starting the health engine's thread")?
        };
        Ok(Health {
            shared,
            stop,
            thread: Some(thread),
            pusher: pusher.map(|(_, stop, thread)| (stop, thread)),
        })
    }

    /// Stops the engine after it has taken in what is queued, then the
    /// pusher after one last attempt to deliver.
    pub(crate) fn stop(mut self) {
        self.stop.store(true, Relaxed);
        if let Some(t) = self.thread.take()
            && t.join().is_err()
        {
            error!("the health engine's thread panicked");
        }
        if let Some((stop, t)) = self.pusher.take() {
            stop.store(true, Relaxed);
            if t.join().is_err() {
                error!("the Alertmanager pusher's thread panicked");
            }
        }
    }
}

impl Drop for Health {
    /// A node that fails to start after the engine did: the thread ends
    /// within half a second (not waited for).
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        if let Some((stop, _)) = &self.pusher {
            stop.store(true, Relaxed);
        }
    }
}

/// Checks `--alertmanager-url`.
pub(crate) fn check_alertmanager_url(url: &str) -> anyhow::Result<String> {
    alerts::check_url(url)
}

/// What a series is to the engine.
#[derive(Debug, Clone, Copy)]
enum Mapped {
    Field(health::engine::GpuSlot, Field),
    Skip,
}

struct Worker {
    storage: Arc<Storage>,
    shared: Arc<Shared>,
    log: EventLog,
    /// Storage ref (a small, dense integer) -> what it is, resolved once:
    /// an index, not a hash, on the path of every stored sample.
    series: Vec<Option<Mapped>>,
    /// The refs mapped to [`Mapped::Skip`], for the observer.
    skipped: Arc<Skipped>,
    /// Bytes in the queue: less each batch's once taken in.
    queued: Arc<AtomicUsize>,
    /// The engine's own output series, by labels: their refs.
    own: HashMap<SeriesKey, SeriesRef>,
    /// Events opened since start, by `gpulse_health_events_total` series.
    totals: HashMap<SeriesKey, u64>,
    last_reassert: Instant,
    /// When the fleet's inventory was last handed to the engine (`drift`),
    /// and how many GPUs the engine knew then.
    last_inventory: Option<(Instant, usize)>,
    changes: Vec<Change>,
    /// With `--alertmanager-url`: every changed event goes to the pusher.
    alerts: Option<Sender<Event>>,
}

impl Worker {
    fn run(&mut self, rx: &Receiver<Batch>, stop: &AtomicBool) {
        loop {
            match rx.recv_timeout(Duration::from_millis(500)) {
                Ok(batch) => self.take(batch),
                Err(crossbeam::channel::RecvTimeoutError::Timeout) => {}
                Err(crossbeam::channel::RecvTimeoutError::Disconnected) => return,
            }
            // Drain what else is queued before settling polls.
            while let Ok(batch) = rx.try_recv() {
                self.take(batch);
            }
            let now = now_ms();
            self.tell_inventory();
            {
                let mut engine = self.shared.engine();
                engine.finish_before(now - POLL_SETTLE_MS, &mut self.changes);
                engine.tick(now, &mut self.changes);
            }
            self.publish(now);
            if stop.load(Relaxed) {
                self.shared.engine().finish_all(&mut self.changes);
                self.publish(now);
                return;
            }
        }
    }

    /// The inventory of each GPU the engine knows (from its agent's hello,
    /// the `gpus` table), for `drift`: every [`INVENTORY_EVERY`], and within
    /// [`INVENTORY_NEW_GPUS`] of the engine meeting new GPUs.
    fn tell_inventory(&mut self) {
        let gpus = self.shared.engine().num_gpus();
        if let Some((at, known)) = self.last_inventory {
            let due = at.elapsed() >= INVENTORY_EVERY
                || (gpus != known && at.elapsed() >= INVENTORY_NEW_GPUS);
            if !due {
                return;
            }
        }
        self.last_inventory = Some((Instant::now(), gpus));
        let records = self.storage.inventory().snapshot();
        let mut engine = self.shared.engine();
        for r in records {
            if let Some(slot) = engine.find(&r.uuid) {
                engine.set_inventory(
                    slot,
                    Inventory {
                        model: r.model_name,
                        driver_version: r.driver_version,
                        vbios_version: r.vbios_version,
                        inforom_version: r.inforom_version,
                    },
                );
            }
        }
    }

    fn take(&mut self, b: Batch) {
        self.take_in(&b);
        // Its memory goes before the queue may take more in its place.
        let n = b.bytes();
        drop(b);
        self.queued.fetch_sub(n, Relaxed);
    }

    fn take_in(&mut self, b: &Batch) {
        let mut engine = self.shared.engine.lock().unwrap_or_else(|p| p.into_inner());
        for (r, ts_ms, v) in b.samples() {
            let at = r.0 as usize;
            let mapped = match self.series.get(at) {
                Some(Some(m)) => *m,
                _ => {
                    let m = match self.storage.head_series_key(r) {
                        Some(key) => map_series(&key, &mut engine),
                        None => Mapped::Skip,
                    };
                    if matches!(m, Mapped::Skip) {
                        self.skipped.insert(r);
                    }
                    if self.series.len() <= at {
                        self.series.resize(at + 1, None);
                    }
                    self.series[at] = Some(m);
                    m
                }
            };
            if let Mapped::Field(slot, field) = mapped {
                engine.sample(slot, field, ts_ms, v, &mut self.changes);
            }
        }
    }

    /// Logs, counts and writes out the changes since the last call, and
    /// writes the active events again when a minute has passed.
    fn publish(&mut self, now: i64) {
        {
            let engine = self.shared.engine();
            let c = engine.counters();
            self.shared.metrics.polls.store(c.polls, Relaxed);
            self.shared
                .metrics
                .late_samples
                .store(c.late_samples, Relaxed);
        }
        let reassert = self.last_reassert.elapsed() >= REASSERT_EVERY;
        if self.changes.is_empty() && !reassert {
            return;
        }
        let changes = std::mem::take(&mut self.changes);
        let mut samples: Vec<(SeriesKey, i64, f64)> = Vec::new();
        for c in &changes {
            let e = c.event();
            if let Err(err) = self.log.append(e) {
                self.shared.metrics.log_write_errors.fetch_add(1, Relaxed);
                error!(error = %err, "health event log: append failed");
            }
            match c {
                Change::Opened(e) => {
                    info!(id = e.id, kind = %e.kind, severity = %e.severity, host = %e.gpu.host, gpu = e.gpu.gpu, uuid = %e.gpu.uuid, evidence = %e.evidence, "health event opened");
                    *self
                        .shared
                        .metrics
                        .opened
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .entry((e.kind, e.severity))
                        .or_default() += 1;
                    let key = total_key(e);
                    let total = self.totals.entry(key.clone()).or_default();
                    *total += 1;
                    samples.push((key, e.detected_ts_ms, *total as f64));
                    samples.push((active_key(e, e.severity), e.detected_ts_ms, 1.0));
                }
                Change::Escalated(e) => {
                    info!(id = e.id, kind = %e.kind, severity = %e.severity, uuid = %e.gpu.uuid, "health event escalated");
                    for s in [Severity::Info, Severity::Warning, Severity::Critical] {
                        let v = if s == e.severity { 1.0 } else { 0.0 };
                        samples.push((active_key(e, s), now.max(e.detected_ts_ms), v));
                    }
                }
                Change::Cleared(e) => {
                    info!(id = e.id, kind = %e.kind, uuid = %e.gpu.uuid, "health event cleared");
                    // The 0 must be the series' newest sample: after the 1
                    // that the minute's re-assert wrote at the wall clock.
                    let at = e.cleared_ts_ms.unwrap_or(now).max(now);
                    samples.push((active_key(e, e.severity), at, 0.0));
                }
            }
        }
        if !changes.is_empty()
            && let Err(err) = self.log.sync()
        {
            self.shared.metrics.log_write_errors.fetch_add(1, Relaxed);
            error!(error = %err, "health event log: fsync failed");
        }
        if reassert {
            self.last_reassert = Instant::now();
            let engine = self.shared.engine();
            for e in engine.active() {
                samples.push((active_key(e, e.severity), now, 1.0));
            }
        }
        if self.log.records() > LOG_REWRITE_RECORDS {
            let engine = self.shared.engine();
            if let Err(err) = self.log.rewrite(engine.events()) {
                error!(error = %err, "health event log: rewrite failed; appending goes on");
            }
        }
        self.write(samples);
        // Alertmanager hears of a change only once the log and the stored
        // series have it: whoever reacts to the alert and queries
        // `gpulse_health_active` finds the same state.
        if let Some(tx) = &self.alerts {
            for c in &changes {
                let e = c.event();
                if tx.try_send(e.clone()).is_err() {
                    self.shared
                        .metrics
                        .alerts
                        .push_failures
                        .fetch_add(1, Relaxed);
                    warn!(
                        id = e.id,
                        "Alertmanager pusher's queue is full; this change is not sent"
                    );
                }
            }
        }
    }

    /// Appends the engine's own series to storage.
    fn write(&mut self, samples: Vec<(SeriesKey, i64, f64)>) {
        if samples.is_empty() {
            return;
        }
        let missing: Vec<SeriesKey> = samples
            .iter()
            .map(|s| &s.0)
            .filter(|k| !self.own.contains_key(*k))
            .cloned()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if !missing.is_empty() {
            match self.storage.series_refs(missing.clone()) {
                Ok(refs) => {
                    for (k, r) in missing.into_iter().zip(refs) {
                        self.own.insert(k, r);
                    }
                }
                Err(e) => {
                    warn!(error = %e, "health: could not create its series");
                    return;
                }
            }
        }
        let mut sorted = samples;
        sorted.sort_by_key(|s| s.1);
        let refs: Vec<SeriesRef> = sorted.iter().map(|s| self.own[&s.0]).collect();
        let ts: Vec<i64> = sorted.iter().map(|s| s.1).collect();
        let values: Vec<f64> = sorted.iter().map(|s| s.2).collect();
        match self.storage.append(&refs, &ts, &values) {
            Ok(_) => {}
            Err(storage::Error::SeriesEvicted { .. }) => {
                // Idle through a flush: resolve them again next time.
                self.own.clear();
            }
            Err(e) => warn!(error = %e, "health: could not store its series"),
        }
    }
}

/// What a series is: a field of a GPU (registering the GPU), or nothing
/// the detectors read.
fn map_series(key: &SeriesKey, engine: &mut Engine) -> Mapped {
    let Some(field) = Field::from_name(key.metric()) else {
        return Mapped::Skip;
    };
    let (Some(uuid), Some(host)) = (key.get("UUID"), key.get("Hostname")) else {
        return Mapped::Skip;
    };
    let known = |name: &str| key.get(name).filter(|v| !v.is_empty()).map(str::to_owned);
    let id = GpuId {
        uuid: uuid.to_owned(),
        host: host.to_owned(),
        gpu: key.get("gpu").and_then(|g| g.parse().ok()).unwrap_or(0),
        rack: known("rack"),
        row: known("row"),
        cluster: known("cluster"),
    };
    Mapped::Field(engine.gpu(id), field)
}

fn active_key(e: &Event, severity: Severity) -> SeriesKey {
    let mut labels = vec![
        Label::new("kind", e.kind.as_str()),
        Label::new("severity", severity.as_str()),
        Label::new("Hostname", e.gpu.host.as_str()),
        Label::new("gpu", e.gpu.gpu.to_string()),
        Label::new("UUID", e.gpu.uuid.as_str()),
    ];
    for (name, v) in [
        ("rack", &e.gpu.rack),
        ("row", &e.gpu.row),
        ("cluster", &e.gpu.cluster),
    ] {
        if let Some(v) = v {
            labels.push(Label::new(name, v.as_str()));
        }
    }
    if let Some(x) = e.xid {
        labels.push(Label::new("xid", x.to_string()));
    }
    SeriesKey::new("gpulse_health_active", labels).expect("BUG: health labels are valid")
}

/// The stored count of events opened: one series per kind, severity and
/// shard (the GPU's `rack`, or its `Hostname` where it has no rack), so that
/// in a cluster each shard's count is stored with the shard, on the nodes
/// that evaluate it, and read once; `sum by (kind, severity)` totals it.
fn total_key(e: &Event) -> SeriesKey {
    let mut labels = vec![
        Label::new("kind", e.kind.as_str()),
        Label::new("severity", e.severity.as_str()),
    ];
    labels.push(match &e.gpu.rack {
        Some(rack) => Label::new("rack", rack.as_str()),
        None => Label::new("Hostname", e.gpu.host.as_str()),
    });
    SeriesKey::new("gpulse_health_events_total", labels).expect("BUG: health labels are valid")
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// `GET /api/v1/health`: this node's answer, or with `cluster` the whole
/// cluster's (each shard's events and GPU states from one of its owners).
pub(crate) fn router(
    shared: Arc<Shared>,
    cluster: Option<query::cluster::ClusterReader>,
) -> axum::Router {
    #[derive(Clone)]
    struct State {
        shared: Arc<Shared>,
        cluster: Option<query::cluster::ClusterReader>,
    }
    async fn health(
        axum::extract::State(state): axum::extract::State<State>,
    ) -> axum::response::Response {
        use axum::response::IntoResponse;
        let Some(reader) = &state.cluster else {
            return axum::Json(state.shared.report(now_ms())).into_response();
        };
        let source: Arc<dyn query::health_events::HealthSource> = state.shared.clone();
        let answer = async {
            let events = reader.health_events(&source).await?;
            let states = reader.health_states(&source).await?;
            Ok::<_, query::cluster::ClusterError>((events, states))
        };
        match answer.await {
            Ok((events, states)) => {
                let active: Vec<Event> =
                    events.events.into_iter().filter(Event::is_active).collect();
                let mut warnings = events.warnings;
                for w in states.warnings {
                    if !warnings.contains(&w) {
                        warnings.push(w);
                    }
                }
                axum::Json(report_json(&active, &states.states, &warnings)).into_response()
            }
            Err(e) => {
                use axum::http::StatusCode;
                let (status, kind) = match &e {
                    query::cluster::ClusterError::Refused(_) => {
                        (StatusCode::SERVICE_UNAVAILABLE, "unavailable")
                    }
                    query::cluster::ClusterError::Internal(_) => {
                        (StatusCode::INTERNAL_SERVER_ERROR, "internal")
                    }
                    query::cluster::ClusterError::TooLarge(_) => {
                        (StatusCode::UNPROCESSABLE_ENTITY, "execution")
                    }
                };
                let body = serde_json::json!({
                    "status": "error",
                    "errorType": kind,
                    "error": e.to_string(),
                });
                (status, axum::Json(body)).into_response()
            }
        }
    }
    axum::Router::new()
        .route("/api/v1/health", axum::routing::get(health))
        .with_state(State { shared, cluster })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(ids: &[u32]) -> Vec<SeriesRef> {
        ids.iter().map(|&r| SeriesRef(r)).collect()
    }

    #[test]
    fn skipped_series_are_left_out_of_the_copies() {
        let skipped = Skipped::default();
        let r = refs(&[3, 64, 65, 200]);
        let (ts, v) = ([10, 20, 30, 40], [1.0, 2.0, 3.0, 4.0]);
        let all = skipped.keep(&r, &ts, &v).unwrap();
        assert_eq!(
            all.samples().collect::<Vec<_>>(),
            vec![
                (SeriesRef(3), 10, 1.0),
                (SeriesRef(64), 20, 2.0),
                (SeriesRef(65), 30, 3.0),
                (SeriesRef(200), 40, 4.0)
            ]
        );
        skipped.insert(SeriesRef(64));
        skipped.insert(SeriesRef(3));
        let some = skipped.keep(&r, &ts, &v).unwrap();
        assert_eq!(
            some.samples().collect::<Vec<_>>(),
            vec![(SeriesRef(65), 30, 3.0), (SeriesRef(200), 40, 4.0)]
        );
        assert!(
            skipped
                .keep(&refs(&[3, 64]), &[1, 2], &[1.0, 2.0])
                .is_none()
        );
    }

    #[test]
    fn a_batch_keeps_its_timestamps_as_runs_and_its_samples_in_order() {
        let skipped = Skipped::default();
        let r = refs(&[1, 2, 3, 4, 5, 6]);
        let ts = [5, 5, 5, 7, 7, 5];
        let v = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = skipped.keep(&r, &ts, &v).unwrap();
        assert_eq!(b.ts_runs, vec![(5, 3), (7, 2), (5, 1)]);
        let back: Vec<_> = b.samples().collect();
        let want: Vec<_> = (0..6).map(|i| (r[i], ts[i], v[i])).collect();
        assert_eq!(back, want);
        // 4 + 8 bytes a sample, 16 a run.
        assert_eq!(b.bytes(), 6 * 12 + 3 * 16);
        // A backfill's batch: 50 polls of 54 samples each.
        let n = 50 * 54;
        let r: Vec<SeriesRef> = (0..n as u32).map(SeriesRef).collect();
        let ts: Vec<i64> = (0..n as i64).map(|i| 10_000 * (i / 54)).collect();
        let b = skipped.keep(&r, &ts, &vec![0.5; n]).unwrap();
        assert_eq!(b.bytes(), n * 12 + 50 * 16);
    }

    #[test]
    fn the_queue_drops_batches_past_its_bytes_and_counts_them() {
        let (tx, rx) = bounded(QUEUE_BATCHES);
        let queued = Arc::new(AtomicUsize::new(0));
        let metrics = Arc::new(HealthMetrics::default());
        let observer = Observer {
            tx,
            skipped: Arc::new(Skipped::default()),
            queued: queued.clone(),
            metrics: metrics.clone(),
        };
        // One timestamp: 12 bytes a sample and 16 for the run. Leave room
        // for a batch of one sample (28 bytes) and not of two (40).
        let n = (QUEUE_BYTES - 16 - 28) / 12;
        let first = n * 12 + 16;
        let (r, ts, v) = (vec![SeriesRef(1); n], vec![0; n], vec![0.0; n]);
        observer.appended(&r, &ts, &v);
        observer.appended(&r[..1], &ts[..1], &v[..1]);
        assert!(QUEUE_BYTES - (first + 28) < 40);
        observer.appended(&r[..2], &ts[..2], &v[..2]);
        assert_eq!(queued.load(Relaxed), first + 28);
        assert_eq!(metrics.batches_dropped.load(Relaxed), 1);
        assert_eq!(metrics.queue_peak.load(Relaxed), first + 28);
        let lens: Vec<usize> = rx.try_iter().map(|b| b.refs.len()).collect();
        assert_eq!(lens, vec![n, 1]);
        // Once the worker took them in, batches are queued again.
        queued.store(0, Relaxed);
        observer.appended(&r[..2], &ts[..2], &v[..2]);
        let lens: Vec<usize> = rx.try_iter().map(|b| b.refs.len()).collect();
        assert_eq!(lens, vec![2]);
        assert_eq!(metrics.batches_dropped.load(Relaxed), 1);
    }
}
