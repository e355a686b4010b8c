//! The shipper: turns polls into columnar batches and streams them to ingest
//! over one bidirectional gRPC stream, keeping every batch until it is acked.
//!
//! Delivery is at least once at the agent and exactly once in storage: each
//! batch has a sequence number within the agent's epoch, kept across re-sends
//! and clean restarts (see [`crate::spool`]); ingest stores each (agent,
//! epoch, seq) once and acks a re-send as a duplicate.
//!
//! - Polls are always taken off the sampler's queue into the [`Outbox`] (memory,
//!   then spool, then drop-oldest), whether or not ingest is reachable, so
//!   sampling never waits on the network.
//! - While connected, the oldest unacked batches are sent, at most
//!   `max_in_flight` at a time. After a disconnect the shipper reconnects with
//!   exponential backoff plus jitter, sends a new hello, and sends every
//!   unacked batch again in order, re-defining the series it uses.
//! - On shutdown it keeps delivering for up to `drain_timeout`, then moves
//!   what is left to the spool, where the next run picks it up.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use gpulse_proto::v1::ingest_client::IngestClient;
use gpulse_proto::v1::{
    AgentMessage, Backlog, Batch, GpuInfo as WireGpu, Hello, Label, MigInstance as WireMig,
    OwnerBacklog, SeriesDef, Topology as WireTopology, agent_message, ingest_reply,
};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, error, info, warn};

use crate::catalog::Metric;
use crate::metrics::AgentMetrics;
use crate::outbox::Outbox;
use crate::source::{GpuInfo, SeriesLabel};
use crate::spool::Pending;
use crate::{AgentConfig, AgentError, Poll};

/// Counters of one agent run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShipperStats {
    pub batches_sent: u64,
    pub batches_resent: u64,
    pub batches_acked: u64,
    pub batches_rejected: u64,
    /// Acked by ingest as already stored.
    pub batches_duplicate: u64,
    pub samples_acked: u64,
    /// Samples ingest stored nothing for (duplicate timestamps, or too old).
    pub samples_dropped_by_ingest: u64,
    pub reconnects: u64,
    /// Samples dropped because the memory buffer and the spool were full.
    pub samples_dropped: u64,
    /// Batches still unacked when the run ended: in the spool if there is one,
    /// lost otherwise.
    pub batches_unacked: u64,
}

impl ShipperStats {
    pub(crate) fn from_metrics(m: &AgentMetrics, unacked: usize) -> Self {
        let g = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed);
        Self {
            batches_sent: g(&m.batches_sent),
            batches_resent: g(&m.batches_resent),
            batches_acked: g(&m.batches_acked),
            batches_rejected: g(&m.batches_rejected),
            batches_duplicate: g(&m.batches_duplicate),
            samples_acked: g(&m.samples_acked),
            samples_dropped_by_ingest: g(&m.samples_dropped_by_ingest),
            reconnects: g(&m.reconnects),
            samples_dropped: g(&m.samples_dropped),
            batches_unacked: unacked as u64,
        }
    }

    /// The sum of two runs' counters (cluster mode: one shipper per owner).
    pub(crate) fn plus(self, o: Self) -> Self {
        Self {
            batches_sent: self.batches_sent + o.batches_sent,
            batches_resent: self.batches_resent + o.batches_resent,
            batches_acked: self.batches_acked + o.batches_acked,
            batches_rejected: self.batches_rejected + o.batches_rejected,
            batches_duplicate: self.batches_duplicate + o.batches_duplicate,
            samples_acked: self.samples_acked + o.samples_acked,
            samples_dropped_by_ingest: self.samples_dropped_by_ingest + o.samples_dropped_by_ingest,
            reconnects: self.reconnects + o.reconnects,
            samples_dropped: self.samples_dropped + o.samples_dropped,
            batches_unacked: self.batches_unacked + o.batches_unacked,
        }
    }
}

enum StreamEnd {
    /// Input closed and everything acked, or shutdown deadline passed.
    Done,
    /// The connection failed; reconnect.
    Broken(String),
}

/// The agent's series: shipper ids, their definitions, and the lookups that
/// find an id for a reading or for a definition read back from the spool.
#[derive(Debug, Default)]
pub(crate) struct SeriesTable {
    inventory: Vec<GpuInfo>,
    ids: HashMap<(u32, Metric, Option<SeriesLabel>), u32>,
    by_def: HashMap<String, u32>,
    defs: Vec<SeriesDef>,
}

fn def_key(metric: &str, labels: &[Label]) -> String {
    let mut k = String::from(metric);
    for l in labels {
        k.push('\0');
        k.push_str(&l.name);
        k.push('=');
        k.push_str(&l.value);
    }
    k
}

impl SeriesTable {
    pub(crate) fn new(inventory: Vec<GpuInfo>) -> Self {
        Self {
            inventory,
            ..Default::default()
        }
    }

    pub(crate) fn defs(&self) -> &[SeriesDef] {
        &self.defs
    }

    /// The id of a series definition, adding it if new.
    pub(crate) fn intern_def(&mut self, metric: &str, labels: Vec<Label>) -> u32 {
        let key = def_key(metric, &labels);
        if let Some(&id) = self.by_def.get(&key) {
            return id;
        }
        let id = self.defs.len() as u32;
        self.defs.push(SeriesDef {
            id,
            metric: metric.to_string(),
            labels,
        });
        self.by_def.insert(key, id);
        id
    }

    pub(crate) fn id(&mut self, gpu: u32, metric: Metric, extra: Option<SeriesLabel>) -> u32 {
        if let Some(&id) = self.ids.get(&(gpu, metric, extra)) {
            return id;
        }
        let g = self
            .inventory
            .get(gpu as usize)
            .cloned()
            .unwrap_or_default();
        let label = |name: &str, value: String| Label {
            name: name.into(),
            value,
        };
        // dcgm-exporter's GPU labels; ingest adds Hostname and the topology.
        let mut labels = vec![
            label("gpu", gpu.to_string()),
            label("UUID", g.uuid),
            label("pci_bus_id", g.pci_bus_id),
            label("device", format!("nvidia{gpu}")),
            label("modelName", g.model_name),
            label("DCGM_FI_DRIVER_VERSION", g.driver_version),
        ];
        match extra {
            None => {}
            Some(SeriesLabel::Xid(x)) => labels.push(label("xid", x.to_string())),
            Some(SeriesLabel::GpuInstance(i)) => {
                // dcgm-exporter's labels of a MIG instance's series.
                let profile = g
                    .mig_instances
                    .iter()
                    .find(|m| m.gpu_instance_id == i)
                    .map(|m| m.profile.clone())
                    .unwrap_or_default();
                labels.push(label("GPU_I_ID", i.to_string()));
                labels.push(label("GPU_I_PROFILE", profile));
            }
        }
        let id = self.intern_def(metric.name(), labels);
        self.ids.insert((gpu, metric, extra), id);
        id
    }
}

/// Cluster mode: what the agent's coordinator tells one owner's shipper
/// while it runs (`crate::cluster`).
#[derive(Debug, Clone)]
pub(crate) struct Control {
    /// The owner's ingest URL, taken at each connect: a node that moved is
    /// found at its new address after the stream to the old one breaks.
    pub(crate) url: String,
    /// Batches the agent holds per owner node, sent on the stream whenever a
    /// new list is published (the coordinator publishes at most once a second).
    pub(crate) backlog: Arc<Vec<OwnerBacklog>>,
}

pub(crate) struct Shipper {
    config: AgentConfig,
    /// Cluster mode only.
    control: Option<watch::Receiver<Control>>,
    source_name: &'static str,
    series: SeriesTable,
    outbox: Outbox,
    metrics: Arc<AgentMetrics>,
    record: Option<BufWriter<File>>,
    /// Highest seq sent by this process: sending one at or below it is a re-send.
    max_sent: u64,
    input_closed: bool,
}

impl Shipper {
    /// Opens the spool (if configured) and takes over what it holds.
    pub(crate) fn new(
        config: AgentConfig,
        inventory: Vec<GpuInfo>,
        source_name: &'static str,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Self, AgentError> {
        let mut series = SeriesTable::new(inventory);
        let outbox = Outbox::open(&config.buffer, metrics.clone(), |d| {
            series.intern_def(&d.metric, d.labels.clone())
        })
        .map_err(AgentError::Spool)?;
        let record = config.record.as_deref().map(open_record).transpose()?;
        Ok(Self {
            config,
            control: None,
            source_name,
            series,
            outbox,
            metrics,
            record,
            max_sent: 0,
            input_closed: false,
        })
    }

    /// Nothing to deliver: no batch held in memory or in the spool.
    pub(crate) fn is_idle(&self) -> bool {
        self.outbox.is_empty()
    }

    /// Cluster mode: follows `control` (the owner's address, the backlog
    /// report to send).
    pub(crate) fn with_control(mut self, control: watch::Receiver<Control>) -> Self {
        self.config.ingest_url = control.borrow().url.clone();
        self.control = Some(control);
        self
    }

    /// Ships polls until `polls` closes and everything is acked, or until
    /// `stop` fires and the drain deadline passes; then spools what is left.
    pub(crate) async fn run(
        mut self,
        mut polls: mpsc::Receiver<Poll>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<ShipperStats, AgentError> {
        let mut control = self.control.take();
        let mut backoff = self.config.reconnect_min;
        let mut deadline: Option<tokio::time::Instant> = None;
        info!(
            epoch = format_args!("{:016x}", self.outbox.epoch()),
            unacked = self.outbox.len(),
            "shipper starting"
        );
        'run: loop {
            if self.finished(deadline) {
                break;
            }
            // Connect, taking polls meanwhile.
            let endpoint = connect_endpoint(&self.config.ingest_url, self.config.tls.as_ref())?;
            let connect = endpoint.connect();
            tokio::pin!(connect);
            let connected = loop {
                tokio::select! {
                    c = &mut connect => break c,
                    poll = polls.recv(), if !self.input_closed => self.take(poll, &mut polls),
                    () = control_changed(&mut control) => self.follow(&mut control),
                    _ = stop.changed(), if deadline.is_none() => deadline = Some(self.drain_deadline()),
                    _ = sleep_until(deadline), if deadline.is_some() => break 'run,
                }
                if self.finished(deadline) {
                    break 'run;
                }
            };
            let end = match connected {
                Ok(channel) => {
                    backoff = self.config.reconnect_min;
                    self.stream(channel, &mut polls, &mut stop, &mut deadline, &mut control)
                        .await
                }
                Err(e) => StreamEnd::Broken(format!("connect: {e}")),
            };
            let why = match end {
                StreamEnd::Done => break,
                StreamEnd::Broken(why) => why,
            };
            if self.finished(deadline) {
                break;
            }
            self.metrics.reconnects.fetch_add(1, Relaxed);
            // Full jitter on top of the exponential step keeps a fleet of
            // agents from reconnecting in lockstep after an ingest restart.
            let jitter = rand::rng().random_range(0.5..1.5);
            let wait = backoff.mul_f64(jitter);
            warn!(url = %self.config.ingest_url, error = %why, unacked = self.outbox.len(), retry_in_ms = wait.as_millis() as u64, "ingest stream lost; reconnecting");
            backoff = (backoff * 2).min(self.config.reconnect_max);
            let sleep = tokio::time::sleep(wait);
            tokio::pin!(sleep);
            loop {
                tokio::select! {
                    _ = &mut sleep => break,
                    poll = polls.recv(), if !self.input_closed => self.take(poll, &mut polls),
                    () = control_changed(&mut control) => self.follow(&mut control),
                    _ = stop.changed(), if deadline.is_none() => deadline = Some(self.drain_deadline()),
                    _ = sleep_until(deadline), if deadline.is_some() => break 'run,
                }
            }
        }
        // Whatever the sampler queued last still counts. Closing first makes
        // a later send fail (and keep its poll) instead of landing here.
        polls.close();
        while let Ok(poll) = polls.try_recv() {
            self.take(Some(poll), &mut polls);
        }
        let lost = self.outbox.close(&self.series.defs);
        let unacked = self.outbox.len();
        if unacked > 0 {
            warn!(
                unacked,
                spooled = unacked - lost.min(unacked),
                "stopping with batches unacked"
            );
        }
        if let Some(r) = &mut self.record {
            r.flush().ok();
        }
        Ok(ShipperStats::from_metrics(&self.metrics, unacked.max(lost)))
    }

    /// Takes the coordinator's latest address (cluster mode).
    fn follow(&mut self, control: &mut Option<watch::Receiver<Control>>) {
        if let Some(c) = control {
            self.config.ingest_url = c.borrow_and_update().url.clone();
        }
    }

    fn drain_deadline(&self) -> tokio::time::Instant {
        tokio::time::Instant::now() + self.config.drain_timeout
    }

    fn finished(&self, deadline: Option<tokio::time::Instant>) -> bool {
        (self.input_closed && self.outbox.is_empty())
            || deadline.is_some_and(|d| tokio::time::Instant::now() >= d)
    }

    async fn stream(
        &mut self,
        channel: Channel,
        polls: &mut mpsc::Receiver<Poll>,
        stop: &mut tokio::sync::watch::Receiver<bool>,
        deadline: &mut Option<tokio::time::Instant>,
        control: &mut Option<watch::Receiver<Control>>,
    ) -> StreamEnd {
        let mut client = IngestClient::new(channel);
        // Room for every batch in flight plus the hello (and a backlog
        // report): batch sends never wait.
        let (tx, rx) = mpsc::channel::<AgentMessage>(self.config.max_in_flight + 3);
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(self.hello())),
        };
        if tx.send(hello).await.is_err() {
            return StreamEnd::Broken("request stream closed".into());
        }
        let request = crate::authorized(ReceiverStream::new(rx), self.config.token.as_deref());
        let mut inbound = match client.stream(request).await {
            Ok(r) => r.into_inner(),
            Err(status) => return StreamEnd::Broken(format!("open stream: {status}")),
        };
        info!(url = %self.config.ingest_url, source = self.source_name, unacked = self.outbox.len(), "streaming to ingest");
        // Cluster mode: the backlog report to send (the node learns it from
        // each new stream), and the one last sent on this stream.
        let mut backlog = control
            .as_mut()
            .map(|c| c.borrow_and_update().backlog.clone());
        let mut reported: Option<Arc<Vec<OwnerBacklog>>> = None;

        // Series defined on this stream so far; a new stream starts empty.
        let mut defined: HashSet<u32> = HashSet::new();
        let mut in_flight: BTreeSet<u64> = BTreeSet::new();
        let mut cursor = 0u64;
        loop {
            if self.input_closed && self.outbox.is_empty() {
                return StreamEnd::Done;
            }
            let room = self.config.max_in_flight.saturating_sub(in_flight.len());
            if let Some(b) = &backlog
                && let Err(end) = report_backlog(&tx, b, &mut reported, room)
            {
                return end;
            }
            while in_flight.len() < self.config.max_in_flight {
                let Some(seq) = self.outbox.next_from(cursor) else {
                    break;
                };
                cursor = seq + 1;
                let Some(p) = self.outbox.get(seq) else {
                    continue;
                };
                let msg = self.batch_message(seq, p, &mut defined);
                if tx.try_send(msg).is_err() {
                    return StreamEnd::Broken("request stream closed".into());
                }
                in_flight.insert(seq);
                self.metrics.batches_sent.fetch_add(1, Relaxed);
                if seq <= self.max_sent {
                    self.metrics.batches_resent.fetch_add(1, Relaxed);
                }
                self.max_sent = self.max_sent.max(seq);
            }
            tokio::select! {
                poll = polls.recv(), if !self.input_closed => self.take(poll, polls),
                reply = inbound.message() => match reply {
                    Ok(Some(r)) => self.on_reply(r, &mut in_flight),
                    Ok(None) => return StreamEnd::Broken("ingest closed the stream".into()),
                    Err(status) => return StreamEnd::Broken(status.to_string()),
                },
                () = control_changed(control) => {
                    if let Some(c) = control {
                        let latest = c.borrow_and_update().clone();
                        self.config.ingest_url = latest.url;
                        backlog = Some(latest.backlog);
                    }
                }
                _ = stop.changed(), if deadline.is_none() => *deadline = Some(self.drain_deadline()),
                _ = sleep_until(*deadline), if deadline.is_some() => {
                    warn!(unacked = self.outbox.len(), "shutdown deadline passed with batches unacked");
                    return StreamEnd::Done;
                }
            }
        }
    }

    fn on_reply(&mut self, r: gpulse_proto::v1::IngestReply, in_flight: &mut BTreeSet<u64>) {
        let m = &self.metrics;
        match r.reply {
            Some(ingest_reply::Reply::Ack(a)) => {
                in_flight.remove(&a.seq);
                if self.outbox.ack(a.seq) {
                    m.batches_acked.fetch_add(1, Relaxed);
                    m.samples_acked.fetch_add(a.accepted as u64, Relaxed);
                    m.samples_dropped_by_ingest
                        .fetch_add(a.dropped as u64, Relaxed);
                    if a.duplicate {
                        m.batches_duplicate.fetch_add(1, Relaxed);
                    }
                } else {
                    debug!(seq = a.seq, "ack for a batch no longer pending");
                }
            }
            Some(ingest_reply::Reply::Reject(rej)) => {
                // Not retryable: the batch is malformed. Drop it and say so.
                warn!(seq = rej.seq, reason = %rej.message, "ingest rejected a batch");
                in_flight.remove(&rej.seq);
                if self.outbox.ack(rej.seq) {
                    m.batches_rejected.fetch_add(1, Relaxed);
                }
            }
            None => debug!("empty reply"),
        }
    }

    /// Turns `first` and any polls already queued behind it (up to
    /// `max_batch_samples`) into one batch in the outbox. `None` means the
    /// sampler is done.
    fn take(&mut self, first: Option<Poll>, polls: &mut mpsc::Receiver<Poll>) {
        let Some(first) = first else {
            self.input_closed = true;
            return;
        };
        let n = first.readings.len();
        let (mut ids, mut ts, mut values) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let mut next = Some(first);
        while let Some(poll) = next.take() {
            for r in &poll.readings {
                ids.push(self.series.id(r.gpu, r.metric, r.label));
                ts.push(poll.ts_ms);
                values.push(r.value);
            }
            if ids.len() < self.config.max_batch_samples {
                match polls.try_recv() {
                    Ok(more) => next = Some(more),
                    Err(mpsc::error::TryRecvError::Disconnected) => self.input_closed = true,
                    Err(mpsc::error::TryRecvError::Empty) => {}
                }
            }
        }
        if let Some(w) = &mut self.record
            && let Err(e) = record_rows(w, &self.series.defs, &ids, &ts, &values)
        {
            error!(error = %e, "could not write the sample record; recording stops");
            self.record = None;
        }
        self.outbox.push(ids, ts, values, &self.series.defs);
    }

    fn batch_message(&self, seq: u64, p: Pending, defined: &mut HashSet<u32>) -> AgentMessage {
        let mut new_series = Vec::new();
        for &id in &p.ids {
            if defined.insert(id) {
                new_series.push(self.series.defs[id as usize].clone());
            }
        }
        AgentMessage {
            msg: Some(agent_message::Msg::Batch(Batch {
                seq,
                new_series,
                series_ids: p.ids,
                timestamps_ms: p.ts_ms,
                values: p.values,
                epoch: p.epoch,
            })),
        }
    }

    fn hello(&self) -> Hello {
        let c = &self.config;
        Hello {
            agent_id: c.agent_id.clone(),
            host: c.host.clone(),
            topology: Some(WireTopology {
                cluster: c.topology.cluster.clone(),
                row: c.topology.row.clone(),
                rack: c.topology.rack.clone(),
            }),
            gpus: self
                .series
                .inventory
                .iter()
                .map(|g| WireGpu {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    model_name: g.model_name.clone(),
                    driver_version: g.driver_version.clone(),
                    serial: g.serial.clone(),
                    vbios_version: g.vbios_version.clone(),
                    inforom_version: g.inforom_image_version.clone(),
                    cuda_driver_version: g.cuda_driver_version.clone(),
                    mig_mode: match g.mig_enabled {
                        None => 0,
                        Some(false) => 1,
                        Some(true) => 2,
                    },
                    mig_instances: g
                        .mig_instances
                        .iter()
                        .map(|m| WireMig {
                            gpu_instance_id: m.gpu_instance_id,
                            profile: m.profile.clone(),
                        })
                        .collect(),
                })
                .collect(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
        }
    }
}

/// Opens the `--record` file for appending, in the long CSV format of
/// `gpulse import` and `--replay` (`labels,timestamp_ms,value`, labels
/// `metric=NAME;label=value;...`). A new or empty file gets the header, so
/// the record is itself a file `--replay` and `gpulse import` take.
pub(crate) fn open_record(path: &std::path::Path) -> Result<BufWriter<File>, AgentError> {
    let err = |e| AgentError::Record(path.to_owned(), e);
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(err)?;
    let mut w = BufWriter::new(file);
    if w.get_ref().metadata().map_err(err)?.len() == 0 {
        writeln!(w, "{}", crate::replay::long_csv::HEADER.join(",")).map_err(err)?;
        w.flush().map_err(err)?;
    }
    Ok(w)
}

/// Appends rows to a record opened by [`open_record`].
pub(crate) fn record_rows(
    w: &mut BufWriter<File>,
    defs: &[SeriesDef],
    ids: &[u32],
    ts: &[i64],
    values: &[f64],
) -> std::io::Result<()> {
    let mut labels = String::new();
    for ((&id, &t), &v) in ids.iter().zip(ts).zip(values) {
        let d = &defs[id as usize];
        labels.clear();
        labels.push_str("metric=");
        labels.push_str(&d.metric);
        for l in &d.labels {
            let _ = write!(labels, ";{}={}", l.name, l.value);
        }
        // A label value with a comma, quote or line break (a host or model
        // name, say) is quoted as CSV quotes it.
        if labels.contains([',', '"', '\n', '\r']) {
            writeln!(w, "\"{}\",{t},{v}", labels.replace('"', "\"\""))?;
        } else {
            writeln!(w, "{labels},{t},{v}")?;
        }
    }
    // A batch is recorded whole or not at all as far as a reader after a
    // crash can tell (the last line may be cut, never a middle one).
    w.flush()
}

/// Resolves when the coordinator publishes a new [`Control`]; never without
/// one (outside cluster mode, or once the coordinator is gone).
async fn control_changed(control: &mut Option<watch::Receiver<Control>>) {
    let Some(c) = control else {
        return std::future::pending().await;
    };
    if c.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Sends `backlog` on the stream unless it is the list already sent there (or
/// empty on a new stream). The request queue keeps room for `batch_room`
/// more batches (batch sends never wait); without more room than that, the
/// report waits for the stream's next event.
fn report_backlog(
    tx: &mpsc::Sender<AgentMessage>,
    backlog: &Arc<Vec<OwnerBacklog>>,
    reported: &mut Option<Arc<Vec<OwnerBacklog>>>,
    batch_room: usize,
) -> Result<(), StreamEnd> {
    let same = match reported {
        Some(r) => Arc::ptr_eq(r, backlog) || **r == **backlog,
        None => backlog.is_empty(),
    };
    if same || tx.capacity() <= batch_room {
        return Ok(());
    }
    let msg = AgentMessage {
        msg: Some(agent_message::Msg::Backlog(Backlog {
            owners: backlog.to_vec(),
        })),
    };
    match tx.try_send(msg) {
        Ok(()) => {
            *reported = Some(backlog.clone());
            Ok(())
        }
        Err(mpsc::error::TrySendError::Full(_)) => Ok(()),
        Err(mpsc::error::TrySendError::Closed(_)) => {
            Err(StreamEnd::Broken("request stream closed".into()))
        }
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Accepts `grpc://host:port` (what `gpulse serve` prints) or `http://host:port`.
/// TLS to the node: `--tls-ca` (the CA that signed the node's
/// certificate), `--tls-cert`/`--tls-key` (this agent's certificate, for a
/// node that asks for one), `--tls-server-name`.
#[derive(Debug, Clone)]
pub struct ClientTls {
    pub ca_pem: Vec<u8>,
    /// Certificate chain and key, PEM.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The name the node's certificate must hold; default: the URL's host.
    pub server_name: Option<String>,
}

/// The endpoint of `url`, over TLS with `tls` (the scheme becomes https).
pub(crate) fn connect_endpoint(url: &str, tls: Option<&ClientTls>) -> Result<Endpoint, AgentError> {
    let Some(tls) = tls else {
        return endpoint(url);
    };
    let rest = url
        .strip_prefix("grpcs://")
        .or_else(|| url.strip_prefix("grpc://"))
        .or_else(|| url.strip_prefix("https://"))
        .or_else(|| url.strip_prefix("http://"))
        .unwrap_or(url);
    let mut config = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&tls.ca_pem));
    if let Some((cert, key)) = &tls.identity {
        config = config.identity(tonic::transport::Identity::from_pem(cert, key));
    }
    if let Some(name) = &tls.server_name {
        config = config.domain_name(name.clone());
    }
    endpoint(&format!("https://{rest}"))?
        .tls_config(config)
        .map_err(|e| AgentError::InvalidUrl {
            url: url.to_string(),
            reason: format!("TLS: {e}"),
        })
}

pub(crate) fn endpoint(url: &str) -> Result<Endpoint, AgentError> {
    let http = match url.strip_prefix("grpc://") {
        Some(rest) => format!("http://{rest}"),
        None => match url.strip_prefix("grpcs://") {
            Some(rest) => format!("https://{rest}"),
            None => url.to_string(),
        },
    };
    Endpoint::from_shared(http)
        .map(|e| {
            // Keepalive pings find a connection that went silent (a network
            // partition, not a reset) within 15 s, so that the shipper
            // reconnects instead of waiting on it forever.
            e.connect_timeout(Duration::from_secs(5))
                .tcp_nodelay(true)
                .http2_keep_alive_interval(Duration::from_secs(10))
                .keep_alive_timeout(Duration::from_secs(5))
                .keep_alive_while_idle(true)
        })
        .map_err(|e| AgentError::InvalidUrl {
            url: url.to_string(),
            reason: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::MigInstance;

    fn labels(t: &SeriesTable, id: u32) -> Vec<(String, String)> {
        t.defs[id as usize]
            .labels
            .iter()
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect()
    }

    #[test]
    fn labelled_readings_get_their_own_series() {
        let gpu = GpuInfo {
            index: 0,
            uuid: "GPU-1".into(),
            mig_instances: vec![MigInstance {
                gpu_instance_id: 3,
                profile: "1g.10gb".into(),
            }],
            ..GpuInfo::default()
        };
        let mut t = SeriesTable::new(vec![gpu]);
        let plain = t.id(0, Metric::FbUsed, None);
        let mig = t.id(0, Metric::FbUsed, Some(SeriesLabel::GpuInstance(3)));
        let x79 = t.id(0, Metric::XidErrorsTotal, Some(SeriesLabel::Xid(79)));
        let x48 = t.id(0, Metric::XidErrorsTotal, Some(SeriesLabel::Xid(48)));
        assert_eq!(t.defs.len(), 4);
        assert_eq!(
            t.id(0, Metric::XidErrorsTotal, Some(SeriesLabel::Xid(79))),
            x79
        );
        assert!(!labels(&t, plain).iter().any(|(k, _)| k == "GPU_I_ID"));
        let m = labels(&t, mig);
        assert!(m.contains(&("GPU_I_ID".into(), "3".into())));
        assert!(m.contains(&("GPU_I_PROFILE".into(), "1g.10gb".into())));
        assert!(labels(&t, x79).contains(&("xid".into(), "79".into())));
        assert!(labels(&t, x48).contains(&("xid".into(), "48".into())));
        // A definition read back from a spool finds the same id.
        let d = t.defs[x48 as usize].clone();
        assert_eq!(t.intern_def(&d.metric, d.labels), x48);
    }
}
