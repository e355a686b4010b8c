//! The shipper: turns polls into columnar batches and streams them to ingest
//! over one bidirectional gRPC stream, keeping every batch until it is acked.
//!
//! Delivery: each batch has a per-agent sequence number. Unacked batches stay
//! in memory (at most `max_in_flight`); after a disconnect the shipper
//! reconnects with exponential backoff plus jitter, sends a new hello, and
//! re-sends every unacked batch in order, re-defining the series it uses.
//! Ingest drops samples at or before a series' last timestamp, so a batch that
//! was stored but whose ack was lost is not stored twice. While the shipper
//! waits, the sampler keeps sampling into its bounded queue and counts what
//! it must drop; the spool to disk is issue #4.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use gpulse_proto::v1::ingest_client::IngestClient;
use gpulse_proto::v1::{
    AgentMessage, Batch, GpuInfo as WireGpu, Hello, Label, SeriesDef, Topology as WireTopology,
    agent_message, ingest_reply,
};
use rand::Rng;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use crate::catalog::Metric;
use crate::source::GpuInfo;
use crate::{AgentConfig, AgentError, Poll};

/// Counters of one agent run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShipperStats {
    pub batches_sent: u64,
    pub batches_acked: u64,
    pub batches_rejected: u64,
    pub samples_acked: u64,
    /// Samples ingest stored nothing for (duplicates after a re-send, or out of order).
    pub samples_dropped_by_ingest: u64,
    pub reconnects: u64,
    /// Batches still unacked when the run ended (shutdown deadline).
    pub batches_unacked: u64,
}

#[derive(Debug)]
struct Pending {
    ids: Vec<u32>,
    ts_ms: Vec<i64>,
    values: Vec<f64>,
}

enum StreamEnd {
    /// Input closed and everything acked, or shutdown deadline passed.
    Done,
    /// The connection failed; reconnect.
    Broken(String),
}

pub(crate) struct Shipper {
    config: AgentConfig,
    inventory: Vec<GpuInfo>,
    source_name: &'static str,
    ids: HashMap<(u32, Metric), u32>,
    defs: Vec<SeriesDef>,
    next_seq: u64,
    unacked: BTreeMap<u64, Pending>,
    stats: ShipperStats,
    input_closed: bool,
}

impl Shipper {
    pub(crate) fn new(
        config: AgentConfig,
        inventory: Vec<GpuInfo>,
        source_name: &'static str,
    ) -> Self {
        Self {
            config,
            inventory,
            source_name,
            ids: HashMap::new(),
            defs: Vec::new(),
            next_seq: 1,
            unacked: BTreeMap::new(),
            stats: ShipperStats::default(),
            input_closed: false,
        }
    }

    /// Ships polls until `polls` closes and everything is acked, or until
    /// `stop` fires and the drain deadline passes.
    pub(crate) async fn run(
        mut self,
        mut polls: mpsc::Receiver<Poll>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> Result<ShipperStats, AgentError> {
        let endpoint = endpoint(&self.config.ingest_url)?;
        let mut backoff = self.config.reconnect_min;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        loop {
            let deadline_passed = drain_deadline.is_some_and(|d| tokio::time::Instant::now() >= d);
            if (self.input_closed && self.unacked.is_empty()) || deadline_passed {
                break;
            }
            let end = match endpoint.connect().await {
                Ok(channel) => {
                    backoff = self.config.reconnect_min;
                    self.stream(channel, &mut polls, &mut stop, &mut drain_deadline)
                        .await
                }
                Err(e) => StreamEnd::Broken(format!("connect: {e}")),
            };
            match end {
                StreamEnd::Done => break,
                StreamEnd::Broken(why) => {
                    if self.input_closed && self.unacked.is_empty() {
                        break;
                    }
                    self.stats.reconnects += 1;
                    // Full jitter on top of the exponential step keeps a fleet of
                    // agents from reconnecting in lockstep after an ingest restart.
                    let jitter = rand::rng().random_range(0.5..1.5);
                    let wait = backoff.mul_f64(jitter);
                    warn!(url = %self.config.ingest_url, error = %why, unacked = self.unacked.len(), retry_in_ms = wait.as_millis() as u64, "ingest stream lost; reconnecting");
                    backoff = (backoff * 2).min(self.config.reconnect_max);
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = stop.changed(), if drain_deadline.is_none() => {
                            drain_deadline = Some(tokio::time::Instant::now() + self.config.drain_timeout);
                        }
                    }
                }
            }
        }
        self.stats.batches_unacked = self.unacked.len() as u64;
        Ok(self.stats)
    }

    async fn stream(
        &mut self,
        channel: Channel,
        polls: &mut mpsc::Receiver<Poll>,
        stop: &mut tokio::sync::watch::Receiver<bool>,
        drain_deadline: &mut Option<tokio::time::Instant>,
    ) -> StreamEnd {
        let mut client = IngestClient::new(channel);
        let (tx, rx) = mpsc::channel::<AgentMessage>(64);
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(self.hello())),
        };
        if tx.send(hello).await.is_err() {
            return StreamEnd::Broken("request stream closed".into());
        }
        let mut inbound = match client.stream(ReceiverStream::new(rx)).await {
            Ok(r) => r.into_inner(),
            Err(status) => return StreamEnd::Broken(format!("open stream: {status}")),
        };
        info!(url = %self.config.ingest_url, source = self.source_name, resend = self.unacked.len(), "streaming to ingest");

        // Series defined on this stream so far; a new stream starts empty.
        let mut defined: HashSet<u32> = HashSet::new();
        let resend: Vec<u64> = self.unacked.keys().copied().collect();
        for seq in resend {
            let msg = self.batch_message(seq, &mut defined);
            if tx.send(msg).await.is_err() {
                return StreamEnd::Broken("request stream closed".into());
            }
            self.stats.batches_sent += 1;
        }

        loop {
            if self.input_closed && self.unacked.is_empty() {
                return StreamEnd::Done;
            }
            let room = self.unacked.len() < self.config.max_in_flight;
            let deadline = *drain_deadline;
            tokio::select! {
                poll = polls.recv(), if room && !self.input_closed => match poll {
                    Some(first) => {
                        let seq = self.add_batch(first, polls);
                        let msg = self.batch_message(seq, &mut defined);
                        if tx.send(msg).await.is_err() {
                            return StreamEnd::Broken("request stream closed".into());
                        }
                        self.stats.batches_sent += 1;
                    }
                    None => self.input_closed = true,
                },
                reply = inbound.message() => match reply {
                    Ok(Some(r)) => self.on_reply(r),
                    Ok(None) => return StreamEnd::Broken("ingest closed the stream".into()),
                    Err(status) => return StreamEnd::Broken(status.to_string()),
                },
                _ = stop.changed(), if deadline.is_none() => {
                    *drain_deadline = Some(tokio::time::Instant::now() + self.config.drain_timeout);
                }
                _ = sleep_until(deadline), if deadline.is_some() => {
                    warn!(unacked = self.unacked.len(), "shutdown deadline passed with batches unacked");
                    return StreamEnd::Done;
                }
            }
        }
    }

    fn on_reply(&mut self, r: gpulse_proto::v1::IngestReply) {
        match r.reply {
            Some(ingest_reply::Reply::Ack(a)) => {
                if self.unacked.remove(&a.seq).is_some() {
                    self.stats.batches_acked += 1;
                    self.stats.samples_acked += a.accepted as u64;
                    self.stats.samples_dropped_by_ingest += a.dropped as u64;
                } else {
                    debug!(seq = a.seq, "ack for a batch no longer pending");
                }
            }
            Some(ingest_reply::Reply::Reject(rej)) => {
                // Not retryable: the batch is malformed. Drop it and say so.
                warn!(seq = rej.seq, reason = %rej.message, "ingest rejected a batch");
                if self.unacked.remove(&rej.seq).is_some() {
                    self.stats.batches_rejected += 1;
                }
            }
            None => debug!("empty reply"),
        }
    }

    /// Turns `first` and any polls already queued behind it (up to
    /// `max_batch_samples`) into one pending batch; returns its seq.
    fn add_batch(&mut self, first: Poll, polls: &mut mpsc::Receiver<Poll>) -> u64 {
        let mut p = Pending {
            ids: Vec::with_capacity(first.readings.len()),
            ts_ms: Vec::with_capacity(first.readings.len()),
            values: Vec::with_capacity(first.readings.len()),
        };
        let mut next = Some(first);
        while let Some(poll) = next.take() {
            for r in &poll.readings {
                let id = self.series_id(r.gpu, r.metric);
                p.ids.push(id);
                p.ts_ms.push(poll.ts_ms);
                p.values.push(r.value);
            }
            if p.ids.len() < self.config.max_batch_samples {
                match polls.try_recv() {
                    Ok(more) => next = Some(more),
                    Err(mpsc::error::TryRecvError::Disconnected) => self.input_closed = true,
                    Err(mpsc::error::TryRecvError::Empty) => {}
                }
            }
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.unacked.insert(seq, p);
        seq
    }

    fn series_id(&mut self, gpu: u32, metric: Metric) -> u32 {
        if let Some(&id) = self.ids.get(&(gpu, metric)) {
            return id;
        }
        let id = self.defs.len() as u32;
        let g = self
            .inventory
            .get(gpu as usize)
            .cloned()
            .unwrap_or_default();
        let label = |name: &str, value: String| Label {
            name: name.into(),
            value,
        };
        self.defs.push(SeriesDef {
            id,
            metric: metric.name().into(),
            // dcgm-exporter's GPU labels; ingest adds Hostname and the topology.
            labels: vec![
                label("gpu", gpu.to_string()),
                label("UUID", g.uuid),
                label("pci_bus_id", g.pci_bus_id),
                label("device", format!("nvidia{gpu}")),
                label("modelName", g.model_name),
                label("DCGM_FI_DRIVER_VERSION", g.driver_version),
            ],
        });
        self.ids.insert((gpu, metric), id);
        id
    }

    fn batch_message(&self, seq: u64, defined: &mut HashSet<u32>) -> AgentMessage {
        let p = &self.unacked[&seq];
        let mut new_series = Vec::new();
        for &id in &p.ids {
            if defined.insert(id) {
                new_series.push(self.defs[id as usize].clone());
            }
        }
        AgentMessage {
            msg: Some(agent_message::Msg::Batch(Batch {
                seq,
                new_series,
                series_ids: p.ids.clone(),
                timestamps_ms: p.ts_ms.clone(),
                values: p.values.clone(),
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
                })
                .collect(),
            agent_version: env!("CARGO_PKG_VERSION").into(),
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
pub(crate) fn endpoint(url: &str) -> Result<Endpoint, AgentError> {
    let http = match url.strip_prefix("grpc://") {
        Some(rest) => format!("http://{rest}"),
        None => url.to_string(),
    };
    Endpoint::from_shared(http)
        .map(|e| e.connect_timeout(Duration::from_secs(5)).tcp_nodelay(true))
        .map_err(|e| AgentError::InvalidUrl {
            url: url.to_string(),
            reason: e.to_string(),
        })
}
