//! The `Ingest` service implementation: one task per agent stream.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use gpulse_proto::v1::ingest_server::Ingest;
use gpulse_proto::v1::{
    Ack, AgentMessage, Batch, Hello, IngestReply, NodeAddress, NodeStatusReply, NodeStatusRequest,
    OwnerBacklog, OwnersReply, OwnersRequest, Reject, agent_message, ingest_reply,
};
use storage::admission::{RejectCounters, Rejection, check_agent_id};
use storage::{BatchOrigin, GpuRecord, KeyArc, Label, SeriesKey, SeriesRef, Storage};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{error, info, warn};

use crate::{IngestConfig, WriteError};
use cluster::{ClusterState, ShardKey};

/// Counters of the ingest service (`gpulse_ingest_*` once exported).
#[derive(Debug, Default)]
pub struct IngestMetrics {
    pub streams_opened: AtomicU64,
    pub streams_active: AtomicU64,
    pub batches_acked: AtomicU64,
    pub batches_rejected: AtomicU64,
    pub samples_accepted: AtomicU64,
    /// Samples in acked batches that storage dropped (duplicates, out of order).
    pub samples_dropped: AtomicU64,
    /// Batches acked without storing, as re-sends of stored (agent, epoch, seq).
    pub batches_duplicate: AtomicU64,
    /// Samples of rejected batches, by the reason of the rejection (window,
    /// labels; see [`storage::admission`]).
    pub samples_rejected: RejectCounters,
    /// Streams closed because no hello came within the hello timeout.
    pub streams_hello_timeout: AtomicU64,
    /// Streams refused at `--grpc-max-streams`.
    pub streams_refused_too_many: AtomicU64,
    /// Streams closed for a bad hello (agent id, host or topology too long
    /// or with a control character).
    pub streams_bad_hello: AtomicU64,
    /// Streams refused because the agent's client certificate does not name
    /// the host (or agent id) of its hello (mTLS, `--tls-client-ca`).
    pub streams_refused_identity: AtomicU64,
}

impl IngestMetrics {
    /// Appends the admission and stream-limit counters in the Prometheus
    /// text format.
    pub fn render_limits(&self, out: &mut String) {
        use std::fmt::Write as _;
        self.samples_rejected.render(
            out,
            "gpulse_ingest_samples_rejected_total",
            "Samples of gRPC batches rejected, by reason.",
        );
        let name = "gpulse_ingest_streams_refused_total";
        let _ = writeln!(
            out,
            "# HELP {name} Agent streams refused or closed by a limit, by reason.\n# TYPE {name} counter"
        );
        for (reason, v) in [
            ("hello_timeout", &self.streams_hello_timeout),
            ("too_many_streams", &self.streams_refused_too_many),
            ("bad_hello", &self.streams_bad_hello),
            ("identity", &self.streams_refused_identity),
        ] {
            let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {}", v.load(Relaxed));
        }
    }
}

/// The gRPC service. Cheap to clone.
#[derive(Debug, Clone)]
pub struct IngestService {
    storage: Arc<Storage>,
    config: Arc<IngestConfig>,
    metrics: Arc<IngestMetrics>,
    shutdown: watch::Sender<bool>,
    /// Cluster mode (`serve --cluster`): answers `Owners` and `NodeStatus`.
    cluster: Option<Arc<ClusterState>>,
}

impl IngestService {
    pub fn new(storage: Arc<Storage>, config: IngestConfig) -> Self {
        Self {
            storage,
            config: Arc::new(config),
            metrics: Arc::new(IngestMetrics::default()),
            shutdown: watch::Sender::new(false),
            cluster: None,
        }
    }

    /// Runs the service as a cluster node.
    pub fn with_cluster(self, cluster: Arc<ClusterState>) -> Self {
        Self {
            cluster: Some(cluster),
            ..self
        }
    }

    fn cluster(&self) -> Result<&Arc<ClusterState>, Status> {
        self.cluster.as_ref().ok_or_else(|| {
            Status::failed_precondition("this node runs without --cluster; it owns every host")
        })
    }

    pub fn config(&self) -> &IngestConfig {
        &self.config
    }

    pub fn metrics(&self) -> &Arc<IngestMetrics> {
        &self.metrics
    }

    /// Setting it to `true` ends every open stream.
    pub(crate) fn shutdown_handle(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }
}

type ReplyStream = ReceiverStream<Result<IngestReply, Status>>;

#[tonic::async_trait]
impl Ingest for IngestService {
    type StreamStream = ReplyStream;

    async fn stream(
        &self,
        request: Request<Streaming<AgentMessage>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let peer = request
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        // With mTLS, the agent's verified certificate: who it may speak for.
        let certs = request.peer_certs();
        let inbound = request.into_inner();
        // Reserve a place first, so that concurrent opens cannot pass the limit.
        let active = self.metrics.streams_active.fetch_add(1, Relaxed);
        if active >= self.config.max_streams {
            self.metrics.streams_active.fetch_sub(1, Relaxed);
            self.metrics.streams_refused_too_many.fetch_add(1, Relaxed);
            warn!(%peer, limit = self.config.max_streams, "agent stream refused: too many streams");
            return Err(Status::resource_exhausted(format!(
                "this node has {} agent streams open, its limit (--grpc-max-streams); retry later",
                self.config.max_streams
            )));
        }
        let (tx, rx) = mpsc::channel(256);
        let svc = self.clone();
        tokio::spawn(async move {
            svc.metrics.streams_opened.fetch_add(1, Relaxed);
            if let Err(status) = svc.run_stream(inbound, certs, &tx, &peer).await {
                warn!(%peer, code = ?status.code(), message = status.message(), "agent stream failed");
                let _ = tx.send(Err(status)).await;
            }
            svc.metrics.streams_active.fetch_sub(1, Relaxed);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn owners(
        &self,
        request: Request<OwnersRequest>,
    ) -> Result<Response<OwnersReply>, Status> {
        let cluster = self.cluster()?;
        let req = request.into_inner();
        if req.rack.is_empty() && req.host.is_empty() {
            return Err(Status::invalid_argument("owners: give a rack or a host"));
        }
        let map = cluster.map();
        let now = now_ms();
        let key = ShardKey::of(&req.rack, &req.host);
        let owners = map
            .owners_at(&key, now)
            .into_iter()
            .map(|i| {
                let n = &map.nodes()[i];
                NodeAddress {
                    id: n.id.clone(),
                    grpc: n.grpc.to_string(),
                }
            })
            .collect();
        // Ask again every 10 s, and just after the next epoch starts.
        let next_epoch = map
            .epochs()
            .iter()
            .map(|e| e.start_ms)
            .find(|&s| s > now)
            .map(|s| (s - now + 1) as u64);
        let refresh_ms = next_epoch.unwrap_or(10_000).clamp(100, 10_000) as u32;
        Ok(Response::new(OwnersReply {
            owners,
            map_hash: map.hash().to_owned(),
            refresh_ms,
        }))
    }

    async fn node_status(
        &self,
        _request: Request<NodeStatusRequest>,
    ) -> Result<Response<NodeStatusReply>, Status> {
        let cluster = self.cluster()?;
        let (mut racks, mut hosts) = (Vec::new(), Vec::new());
        for key in cluster.local_keys() {
            match key {
                ShardKey::Rack(r) => racks.push(r),
                ShardKey::Host(h) => hosts.push(h),
            }
        }
        let backlog = cluster
            .backlog_by_node()
            .into_iter()
            .map(|(node_id, batches)| OwnerBacklog { node_id, batches })
            .collect();
        Ok(Response::new(NodeStatusReply {
            node_id: cluster.self_id().to_owned(),
            map_hash: cluster.map().hash().to_owned(),
            racks,
            hosts,
            samples_accepted: self.metrics.samples_accepted.load(Relaxed) + cluster.other_samples(),
            streams_active: self.metrics.streams_active.load(Relaxed),
            backlog,
            uptime_s: cluster.uptime().as_secs(),
        }))
    }
}

/// State of one agent stream.
struct StreamState {
    agent_id: String,
    host: String,
    /// Labels attached to every series of the stream: Hostname and topology.
    stream_labels: Vec<Label>,
    /// Stream-local series id -> storage series.
    refs: HashMap<u32, SeriesRef>,
    /// Stream-local series id -> its key, to resolve a series again after it
    /// left the head (idle through a flush: `storage::Error::SeriesEvicted`).
    /// The head's own copy, shared.
    keys: HashMap<u32, KeyArc>,
}

impl IngestService {
    async fn run_stream(
        &self,
        mut inbound: Streaming<AgentMessage>,
        certs: Option<Arc<Vec<auth::tls::CertificateDer<'static>>>>,
        tx: &mpsc::Sender<Result<IngestReply, Status>>,
        peer: &str,
    ) -> Result<(), Status> {
        let mut stop = self.shutdown.subscribe();
        let first = tokio::time::timeout(self.config.hello_timeout, inbound.message()).await;
        let Ok(first) = first else {
            self.metrics.streams_hello_timeout.fetch_add(1, Relaxed);
            return Err(Status::deadline_exceeded(format!(
                "no hello within {:?} of opening the stream (--grpc-hello-timeout)",
                self.config.hello_timeout
            )));
        };
        let hello = match first? {
            Some(AgentMessage {
                msg: Some(agent_message::Msg::Hello(h)),
            }) => h,
            Some(_) => {
                return Err(Status::invalid_argument(
                    "the first message of a stream must be a hello",
                ));
            }
            None => return Ok(()),
        };
        self.check_identity(&hello, certs.as_deref(), peer)?;
        let mut state = self.open_stream(&hello).inspect_err(|_| {
            self.metrics.streams_bad_hello.fetch_add(1, Relaxed);
        })?;
        if let Some(cluster) = &self.cluster {
            let rack = hello.topology.as_ref().map_or("", |t| t.rack.as_str());
            cluster.note_key(ShardKey::of(rack, &hello.host));
        }
        // A new GPU is written to disk at once: keep that off the async workers.
        tokio::task::block_in_place(|| {
            self.storage
                .inventory()
                .observe(inventory(&hello), now_ms())
        });
        info!(%peer, agent = %hello.agent_id, host = %hello.host, gpus = hello.gpus.len(), "agent stream opened");
        loop {
            let msg = tokio::select! {
                m = inbound.message() => m?,
                _ = stop.wait_for(|s| *s) => {
                    info!(%peer, agent = %hello.agent_id, "closing agent stream for shutdown");
                    return Err(Status::unavailable("ingest is shutting down"));
                }
            };
            let reply = match msg {
                None => {
                    info!(%peer, agent = %hello.agent_id, "agent stream closed");
                    return Ok(());
                }
                Some(AgentMessage {
                    msg: Some(agent_message::Msg::Batch(batch)),
                }) => {
                    // Storage blocks on the WAL write; keep it off the async workers' hot loop.
                    tokio::task::block_in_place(|| self.on_batch(&mut state, batch))?
                }
                Some(AgentMessage {
                    msg: Some(agent_message::Msg::Backlog(b)),
                }) => {
                    if let Some(cluster) = &self.cluster {
                        let per_node = b
                            .owners
                            .into_iter()
                            .map(|o| (o.node_id, o.batches))
                            .collect();
                        cluster.set_backlog(&hello.agent_id, per_node);
                    }
                    continue;
                }
                Some(AgentMessage {
                    msg: Some(agent_message::Msg::Hello(_)),
                }) => return Err(Status::invalid_argument("hello sent twice on one stream")),
                Some(AgentMessage { msg: None }) => {
                    return Err(Status::invalid_argument("empty agent message"));
                }
            };
            if tx.send(Ok(reply)).await.is_err() {
                return Ok(()); // the agent went away
            }
        }
    }

    /// With mTLS (`--tls-client-ca`), a stream speaks only for the host and
    /// agent id its client certificate names (a DNS subject alternative
    /// name); the hello's own word is not enough.
    fn check_identity(
        &self,
        hello: &Hello,
        certs: Option<&Vec<auth::tls::CertificateDer<'static>>>,
        peer: &str,
    ) -> Result<(), Status> {
        if !self.config.tls.as_ref().is_some_and(|t| t.mutual()) {
            return Ok(());
        }
        let cert = certs.and_then(|c| c.first());
        let names = |name: &str| cert.is_some_and(|c| auth::tls::certificate_names(c, name));
        if names(&hello.host) && names(&hello.agent_id) {
            return Ok(());
        }
        self.metrics.streams_refused_identity.fetch_add(1, Relaxed);
        warn!(%peer, host = %hello.host, agent = %hello.agent_id, "agent stream refused: its certificate does not name its host");
        Err(Status::permission_denied(format!(
            "this stream speaks for host {:?} (agent id {:?}), which its client certificate does not name: an agent may speak only for the host its certificate names",
            hello.host, hello.agent_id
        )))
    }

    fn open_stream(&self, hello: &Hello) -> Result<StreamState, Status> {
        let limits = &self.config.limits.labels;
        let hello_err = |e: Rejection| Status::invalid_argument(format!("hello: {e}"));
        check_agent_id(&hello.agent_id, limits.max_label_bytes).map_err(hello_err)?;
        let topo = hello.topology.clone().unwrap_or_default();
        let mut stream_labels = Vec::new();
        for (name, value) in [
            ("Hostname", &hello.host),
            ("cluster", &topo.cluster),
            ("row", &topo.row),
            ("rack", &topo.rack),
        ] {
            limits.check_value(name, value).map_err(hello_err)?;
            stream_labels.push(Label::new(name, value.clone()));
        }
        Ok(StreamState {
            agent_id: hello.agent_id.clone(),
            host: hello.host.clone(),
            stream_labels,
            refs: HashMap::new(),
            keys: HashMap::new(),
        })
    }

    /// Stores a batch and builds the reply. A batch that can never succeed
    /// gets a reject; a storage failure that may pass (I/O) fails the stream
    /// with `UNAVAILABLE`, so that the agent reconnects and re-sends it.
    fn on_batch(&self, state: &mut StreamState, batch: Batch) -> Result<IngestReply, Status> {
        let seq = batch.seq;
        self.storage.inventory().touch(&state.host, now_ms());
        match self.store_batch(state, batch) {
            Ok(ack) => {
                self.metrics.batches_acked.fetch_add(1, Relaxed);
                if ack.duplicate {
                    self.metrics.batches_duplicate.fetch_add(1, Relaxed);
                }
                self.metrics
                    .samples_accepted
                    .fetch_add(ack.accepted as u64, Relaxed);
                self.metrics
                    .samples_dropped
                    .fetch_add(ack.dropped as u64, Relaxed);
                Ok(IngestReply {
                    reply: Some(ingest_reply::Reply::Ack(ack)),
                })
            }
            Err(WriteError::Invalid(message)) => {
                self.metrics.batches_rejected.fetch_add(1, Relaxed);
                warn!(seq, reason = %message, "rejected batch");
                Ok(IngestReply {
                    reply: Some(ingest_reply::Reply::Reject(Reject { seq, message })),
                })
            }
            Err(WriteError::Unavailable(message)) => {
                error!(seq, error = %message, "storage failed; asking the agent to retry");
                Err(Status::unavailable(message))
            }
        }
    }

    /// Validates the whole batch first, then defines its series and appends.
    /// Nothing is stored for a batch that is rejected.
    fn store_batch(&self, state: &mut StreamState, batch: Batch) -> Result<Ack, WriteError> {
        let n = batch.series_ids.len();
        if batch.timestamps_ms.len() != n || batch.values.len() != n {
            return Err(WriteError::Invalid(format!(
                "columns differ in length: {n} series ids, {} timestamps, {} values",
                batch.timestamps_ms.len(),
                batch.values.len()
            )));
        }
        let limits = &self.config.limits;
        let max_series = self.config.max_series_per_stream;
        if state.refs.len() + batch.new_series.len() > max_series {
            return Err(WriteError::Invalid(format!(
                "series limit: the stream would define {} series, over the limit of {}",
                state.refs.len() + batch.new_series.len(),
                max_series
            )));
        }
        let mut keys = Vec::with_capacity(batch.new_series.len());
        let mut new_ids = std::collections::HashSet::with_capacity(batch.new_series.len());
        let rejected = |e: Rejection, what: String| {
            self.metrics.samples_rejected.add(e.reason, n as u64);
            WriteError::Invalid(format!("{what}: {e}"))
        };
        for def in &batch.new_series {
            if state.refs.contains_key(&def.id) || !new_ids.insert(def.id) {
                return Err(WriteError::Invalid(format!(
                    "series id {} is defined twice",
                    def.id
                )));
            }
            let what = || format!("series {}", def.id);
            limits
                .labels
                .check_count(def.labels.len() + state.stream_labels.len())
                .map_err(|e| rejected(e, what()))?;
            limits
                .labels
                .check_series(
                    &def.metric,
                    def.labels
                        .iter()
                        .map(|l| (l.name.as_str(), l.value.as_str())),
                )
                .map_err(|e| rejected(e, what()))?;
            let mut labels: Vec<Label> = def
                .labels
                .iter()
                .map(|l| Label::new(&l.name, &l.value))
                .collect();
            labels.extend(state.stream_labels.iter().cloned());
            let key = SeriesKey::new(&def.metric, labels)
                .map_err(|e| WriteError::Invalid(format!("series {}: {e}", def.id)))?;
            keys.push((def.id, key));
        }
        // One sample outside the window rejects the batch: the agent never
        // re-sends a rejected batch, and a batch is stored whole or not at all.
        let bounds = limits.window.bounds_now();
        if let Some((i, &ts)) = batch
            .timestamps_ms
            .iter()
            .enumerate()
            .find(|(_, t)| !bounds.admits(**t))
        {
            let e = bounds.check(ts).expect_err("BUG: admits and check agree");
            let series = batch.series_ids[i];
            return Err(rejected(e, format!("sample {i} (series {series})")));
        }
        let defined = |id: &u32| state.refs.contains_key(id) || new_ids.contains(id);
        if let Some(id) = batch.series_ids.iter().find(|id| !defined(id)) {
            return Err(WriteError::Invalid(format!(
                "series id {id} is used but was never defined on this stream"
            )));
        }
        if !keys.is_empty() {
            let (ids, keys): (Vec<u32>, Vec<SeriesKey>) = keys.into_iter().unzip();
            self.resolve(state, ids, keys)?;
        }
        let refs: Vec<SeriesRef> = batch.series_ids.iter().map(|id| state.refs[id]).collect();
        // The series above are defined even for a duplicate: later batches of
        // this stream refer to them.
        let producer = format!("{}/{:016x}", state.agent_id, batch.epoch);
        let origin = (batch.epoch != 0).then_some(BatchOrigin {
            producer: &producer,
            seq: batch.seq,
        });
        let mut out = self
            .storage
            .append_from(origin, &refs, &batch.timestamps_ms, &batch.values);
        if let Err(storage::Error::SeriesEvicted { .. }) = out {
            // Series of this stream went idle and left the head at a flush:
            // resolve the batch's series again and retry once (nothing was
            // stored). A second failure asks the agent to retry.
            let mut ids = batch.series_ids.clone();
            ids.sort_unstable();
            ids.dedup();
            let keys = ids.iter().map(|id| (*state.keys[id]).clone()).collect();
            self.resolve(state, ids, keys)?;
            let refs: Vec<SeriesRef> = batch.series_ids.iter().map(|id| state.refs[id]).collect();
            out = self
                .storage
                .append_from(origin, &refs, &batch.timestamps_ms, &batch.values);
        }
        let out = out.map_err(WriteError::from)?;
        Ok(Ack {
            seq: batch.seq,
            accepted: out.accepted,
            dropped: out.dropped(),
            duplicate: out.duplicate_batch,
        })
    }
}

impl IngestService {
    /// Finds or creates the storage series of `keys` and maps the stream's
    /// ids `ids` to them, keeping the head's copy of each key.
    fn resolve(
        &self,
        state: &mut StreamState,
        ids: Vec<u32>,
        keys: Vec<SeriesKey>,
    ) -> Result<(), WriteError> {
        let resolved = self
            .storage
            .series_refs_with_keys(keys)
            .map_err(WriteError::from)?;
        for (id, (r, key)) in ids.into_iter().zip(resolved) {
            state.keys.insert(id, key);
            state.refs.insert(id, r);
        }
        Ok(())
    }

    /// Test seam for the `ingest_stream` fuzz target (fuzz/): runs one agent
    /// stream over `messages` with no network, as [`Ingest::stream`] does:
    /// the first message must be a hello, then batches are stored and
    /// answered, backlogs noted, and a second hello or an empty message ends
    /// the stream with an error. Returns the replies sent before the stream
    /// ended, and how it ended. Not an API: use the gRPC service.
    #[doc(hidden)]
    pub fn run_messages(
        &self,
        messages: impl IntoIterator<Item = AgentMessage>,
    ) -> (Vec<IngestReply>, Result<(), Status>) {
        let mut replies = Vec::new();
        let mut messages = messages.into_iter();
        let hello = match messages.next() {
            Some(AgentMessage {
                msg: Some(agent_message::Msg::Hello(h)),
            }) => h,
            Some(_) => {
                let e = Status::invalid_argument("the first message of a stream must be a hello");
                return (replies, Err(e));
            }
            None => return (replies, Ok(())),
        };
        let mut state = match self.open_stream(&hello) {
            Ok(s) => s,
            Err(e) => {
                self.metrics.streams_bad_hello.fetch_add(1, Relaxed);
                return (replies, Err(e));
            }
        };
        self.storage
            .inventory()
            .observe(inventory(&hello), now_ms());
        for msg in messages {
            match msg.msg {
                Some(agent_message::Msg::Batch(batch)) => match self.on_batch(&mut state, batch) {
                    Ok(reply) => replies.push(reply),
                    Err(e) => return (replies, Err(e)),
                },
                Some(agent_message::Msg::Backlog(_)) => {}
                Some(agent_message::Msg::Hello(_)) => {
                    let e = Status::invalid_argument("hello sent twice on one stream");
                    return (replies, Err(e));
                }
                None => {
                    return (
                        replies,
                        Err(Status::invalid_argument("empty agent message")),
                    );
                }
            }
        }
        (replies, Ok(()))
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The inventory records of the GPUs a hello announces.
fn inventory(hello: &Hello) -> Vec<GpuRecord> {
    let topo = hello.topology.clone().unwrap_or_default();
    hello
        .gpus
        .iter()
        .map(|g| GpuRecord {
            cluster: topo.cluster.clone(),
            row: topo.row.clone(),
            rack: topo.rack.clone(),
            host: hello.host.clone(),
            gpu: g.index.to_string(),
            uuid: g.uuid.clone(),
            pci_bus_id: g.pci_bus_id.clone(),
            model_name: g.model_name.clone(),
            serial: g.serial.clone(),
            vbios_version: g.vbios_version.clone(),
            driver_version: g.driver_version.clone(),
            inforom_version: g.inforom_version.clone(),
            cuda_driver_version: g.cuda_driver_version.clone(),
            mig_mode: match g.mig_mode {
                1 => "disabled".into(),
                2 => "enabled".into(),
                _ => String::new(),
            },
            first_seen_ms: 0,
            last_seen_ms: 0,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use gpulse_proto::v1::{Label as PLabel, SeriesDef};
    use storage::{Matcher, StorageConfig};

    use super::*;

    /// A stream's series that left the head (idle through a flush) are
    /// resolved again from the keys the stream keeps, the head's own: the
    /// batch after the eviction is stored whole, under the same series.
    #[test]
    fn a_stream_resolves_its_evicted_series_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = StorageConfig::new(dir.path());
        config.series_idle = Duration::ZERO;
        let storage = Arc::new(Storage::open(config).unwrap());
        let service = IngestService::new(storage.clone(), crate::IngestConfig::default());
        let t = now_ms() - 60_000;
        let def = |id: u32, gpu: &str| SeriesDef {
            id,
            metric: "DCGM_FI_DEV_GPU_TEMP".into(),
            labels: vec![PLabel {
                name: "gpu".into(),
                value: gpu.into(),
            }],
        };
        let batch =
            |seq: u64, new_series: Vec<SeriesDef>, ts: i64, values: [f64; 2]| AgentMessage {
                msg: Some(agent_message::Msg::Batch(Batch {
                    seq,
                    new_series,
                    series_ids: vec![0, 1],
                    timestamps_ms: vec![ts, ts],
                    values: values.to_vec(),
                    epoch: 0,
                })),
            };
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(Hello {
                agent_id: "agent-a".into(),
                host: "host-1".into(),
                ..Default::default()
            })),
        };
        let first = batch(1, vec![def(0, "0"), def(1, "1")], t, [40.0, 41.0]);
        let second = batch(2, Vec::new(), t + 10_000, [50.0, 51.0]);
        // Two flushes between the batches: the first ends the period in
        // which the series took their sample, the second evicts them.
        let mut flushes = 0;
        let messages = [Some(hello), Some(first), None, None, Some(second)]
            .into_iter()
            .filter_map(|m| {
                if m.is_none() {
                    storage.flush().unwrap();
                    flushes += 1;
                    if flushes == 2 {
                        assert_eq!(storage.stats().head_series, 0, "both evicted");
                    }
                }
                m
            });
        let (replies, ended) = service.run_messages(messages);
        ended.unwrap();
        let accepted: Vec<u32> = replies
            .iter()
            .map(|r| match &r.reply {
                Some(ingest_reply::Reply::Ack(a)) => a.accepted,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(accepted, [2, 2]);
        assert_eq!(storage.stats().head_series, 2);
        let temp = [Matcher::equal("__name__", "DCGM_FI_DEV_GPU_TEMP")];
        let mut got = Vec::new();
        for s in storage.select(&temp, t - 1, t + 20_000) {
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            s.read_into(t - 1, t + 20_000, &mut ts, &mut vs).unwrap();
            let gpu = s.key.labels().iter().find(|l| l.name == "gpu").unwrap();
            got.push((gpu.value.clone(), ts, vs));
        }
        assert_eq!(
            got,
            [
                ("0".into(), vec![t, t + 10_000], vec![40.0, 50.0]),
                ("1".into(), vec![t, t + 10_000], vec![41.0, 51.0]),
            ]
        );
    }
}
