//! [`ClusterReader`]: plans, fans out, fails over and merges one select.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arrow::array::RecordBatch;
use arrow_flight::flight_service_client::FlightServiceClient;
use arrow_flight::{FlightClient, Ticket};
use cluster::{ClusterState, Prefer, ReadPlan, ShardKey, ShardMap};
use futures::{FutureExt, StreamExt};
use health::GpuId;
use health::engine::{Event, GpuState};
use storage::{
    KeyArc, Matcher, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier, Storage,
};
use tonic::transport::Channel;
use tracing::{debug, warn};

use crate::health_events::{HealthSource, shard_of_gpu};

use super::wire::{self, AnswerDecoder};
use super::{ClusterError, ClusterMetrics, ClusterSeries, Part, Selection, shard_may_match};

/// Largest Flight message accepted from a peer (they send about 2 MiB).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// Timeouts of peer reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReaderConfig {
    /// To open a connection to a peer (default 2 s).
    pub connect_timeout: Duration,
    /// Longest wait for the next message of a peer's answer (default 30 s);
    /// past it the peer counts as failed and its shards go to other replicas.
    pub idle_timeout: Duration,
    /// Most samples one select may receive from peers (default 50,000,000,
    /// Prometheus's `query.max-samples`): peers' answers are held in memory
    /// until the query has them all, so past this the select fails with
    /// [`ClusterError::TooLarge`] instead of filling memory.
    pub max_peer_samples: usize,
    /// Ask every peer for its status with each read (each call bounded by
    /// this), alongside the read's first round, and plan the read again if
    /// the answers changed what it was planned from, so that the shards live
    /// peers hold are known as of now and not as of the last poll: a rack
    /// written a moment ago to two nodes, one of which then fails, is still
    /// read from the other. `None` relies on the peer poller alone (tests
    /// that set the peers' state by hand).
    pub refresh_timeout: Option<Duration>,
}

impl Default for ReaderConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(2),
            idle_timeout: Duration::from_secs(30),
            max_peer_samples: 50_000_000,
            refresh_timeout: Some(Duration::from_secs(1)),
        }
    }
}

/// Why a batch of a peer's answer was not taken.
#[derive(Debug)]
enum BatchError {
    /// It is not what the ticket asks for.
    Malformed(String),
    /// It takes the answer past the select's limit.
    TooLarge,
}

/// Why a peer's answer was not taken.
#[derive(Debug)]
enum FetchError {
    /// The peer failed: try another replica.
    Failed(String),
    /// The select received more samples than it may: stop it.
    TooLarge,
}

impl FetchError {
    /// The error as the reads without a sample limit report it.
    fn into_message(self) -> String {
        match self {
            FetchError::Failed(e) => e,
            FetchError::TooLarge => "the answer passed the select's sample limit".into(),
        }
    }
}

impl From<String> for FetchError {
    fn from(e: String) -> Self {
        Self::Failed(e)
    }
}

/// Answers selects for the whole cluster. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ClusterReader {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    state: Arc<ClusterState>,
    storage: Arc<Storage>,
    config: ReaderConfig,
    metrics: Arc<ClusterMetrics>,
    /// Channels to peers, by Flight address (they reconnect by themselves).
    channels: Mutex<HashMap<SocketAddr, Channel>>,
    /// The runtime that runs the reads of [`ClusterReader::select_blocking`].
    runtime: tokio::runtime::Handle,
    /// Status calls of the refresh before planning.
    peers: Option<cluster::PeerClients>,
}

/// The answer of a cluster rollup read: groups sorted, records in window
/// order, and why it may be incomplete.
#[derive(Debug, Clone, Default)]
pub struct RollupSelection {
    pub groups: Vec<(RollupGroup, Vec<RollupRecord>)>,
    pub warnings: Vec<String>,
}

/// The cluster's health events ([`ClusterReader::health_events`]).
#[derive(Debug, Default)]
pub struct ClusterEvents {
    /// By detection time, then id.
    pub events: Vec<Event>,
    pub warnings: Vec<String>,
}

/// The state of every GPU of the cluster ([`ClusterReader::health_states`]).
#[derive(Debug, Default)]
pub struct ClusterStates {
    /// By host, GPU index and UUID.
    pub states: Vec<(GpuId, GpuState)>,
    pub warnings: Vec<String>,
}

/// One node's health answer, of the part asked for.
#[derive(Debug, Default)]
pub(super) struct HealthAnswer {
    pub(super) events: Vec<Event>,
    pub(super) states: Vec<(GpuId, GpuState)>,
}

/// The `id` an event of the node at `node` has in a cluster-wide answer.
fn cluster_event_id(node: usize, id: u64) -> u64 {
    ((node as u64) << 48) | (id & ((1 << 48) - 1))
}

/// The partial results of a pushed-down PromQL aggregation and the
/// warnings of the shards missing, or `None` where it cannot be pushed down.
type PartialsAnswer =
    Result<Option<(Vec<wire::PartialRow>, Vec<String>)>, crate::promql::PromError>;

/// The answer of one node for some shards.
type NodeAnswer = Result<Vec<(KeyArc, Part)>, FetchError>;

/// Whether a read's plan held ([`ClusterReader::fan_out`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Planned {
    /// Every answer was merged.
    Held,
    /// The peers' status, asked alongside the first round, changed the
    /// view the read was planned from: nothing was merged, plan again.
    Stale,
}

/// What one cluster read plans over: the map, this node's index in it, the
/// shards any node reported, the shards to read, and the time range to plan
/// for.
#[derive(Debug, Clone, Copy)]
struct Round<'a> {
    map: &'a ShardMap,
    me: usize,
    /// Which owner of a shard to ask: this node for a raw read (the fewest
    /// bytes move), spread evenly for a pushdown (its answers are small).
    prefer: Prefer,
    known: &'a BTreeSet<ShardKey>,
    keys: &'a BTreeSet<ShardKey>,
    min_ts: i64,
    max_ts: i64,
    /// The [`ClusterState::generation`] the read was planned at, when its
    /// first round is to refresh the peers' status alongside the reads and
    /// check that the view held; `None` once the view is fresh.
    view: Option<u64>,
}

impl ClusterReader {
    /// A reader over `state` with this node's `storage`, counting into
    /// `metrics` (the Flight server's too, usually).
    ///
    /// # Panics
    /// Outside a tokio runtime: the reader keeps a handle of the current one.
    pub fn new(
        state: Arc<ClusterState>,
        storage: Arc<Storage>,
        metrics: Arc<ClusterMetrics>,
        config: ReaderConfig,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                state,
                storage,
                metrics,
                channels: Mutex::default(),
                runtime: tokio::runtime::Handle::current(),
                peers: config.refresh_timeout.map(cluster::PeerClients::new),
                config,
            }),
        }
    }

    pub fn state(&self) -> &Arc<ClusterState> {
        &self.inner.state
    }

    pub fn storage(&self) -> &Arc<Storage> {
        &self.inner.storage
    }

    pub fn metrics(&self) -> &Arc<ClusterMetrics> {
        &self.inner.metrics
    }

    /// [`Self::select`] (or with `labels_only`, [`Self::series`]) from a
    /// blocking thread: the reads run on the
    /// reader's runtime while this thread waits. Never call it on an async
    /// worker thread (it would hold the worker while it waits).
    ///
    /// # Errors
    /// As [`Self::select`].
    pub fn select_blocking(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        labels_only: bool,
    ) -> Result<Selection, ClusterError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let (this, matchers) = (self.clone(), matchers.to_vec());
        self.inner.runtime.spawn(async move {
            let _ = tx.send(this.run(&matchers, min_ts, max_ts, labels_only).await);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(ClusterError::Internal(
                "the cluster read task ended without an answer (is the runtime shutting down?)"
                    .into(),
            ))
        })
    }

    /// Every series of the cluster that matches all `matchers`, with samples
    /// in `[min_ts, max_ts]` (series are selected as [`Storage::select`]
    /// does: by chunks overlapping the range), sorted by key, with a warning
    /// for each shard that no replica could serve.
    ///
    /// # Errors
    /// [`ClusterError::Refused`] when a reachable peer runs with another
    /// cluster file.
    pub async fn select(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, ClusterError> {
        self.run(matchers, min_ts, max_ts, false).await
    }

    /// [`Self::select`] for the label sets only: peers send no samples, and
    /// the series' samples must not be read (their parts from peers are
    /// empty). For the `series`, `labels` and `label values` endpoints.
    ///
    /// # Errors
    /// As [`Self::select`].
    pub async fn series(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, ClusterError> {
        self.run(matchers, min_ts, max_ts, true).await
    }

    /// What every cluster read does first: counts it and refuses while a
    /// reachable peer runs another cluster file. Returns the warnings to
    /// start the answer with, and the view to plan from: the peers' status
    /// as last heard, whose [`ClusterState::generation`] the read's first
    /// round checks after asking them again alongside the reads
    /// ([`Self::fan_out`]). Refreshing first cost every read a round trip
    /// to the peers (0.1-0.45 ms of a 1.1-3.5 ms query on the 2-core VM;
    /// docs/BENCHMARKS.md). A refusal is decided on a fresh status.
    async fn begin(&self) -> Result<(Vec<String>, Option<u64>), ClusterError> {
        let inner = &self.inner;
        inner.metrics.selects.fetch_add(1, Relaxed);
        let Some(peers) = &inner.peers else {
            return Ok((self.checked()?, None));
        };
        let view = inner.state.generation();
        if let Ok(warnings) = inner.state.preflight() {
            return Ok((warnings, Some(view)));
        }
        cluster::refresh_peers(&inner.state, peers).await;
        Ok((self.checked()?, None))
    }

    /// The warnings of the view as it stands, or its refusal (counted).
    fn checked(&self) -> Result<Vec<String>, ClusterError> {
        self.inner.state.preflight().map_err(|e| {
            self.inner.metrics.selects_refused.fetch_add(1, Relaxed);
            ClusterError::Refused(e)
        })
    }

    async fn run(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        labels_only: bool,
    ) -> Result<Selection, ClusterError> {
        let inner = &self.inner;
        let (mut warnings, mut view) = self.begin().await?;
        loop {
            let map = inner.state.map();
            let me = self.self_index(&map)?;
            let (known, keys) = self.shards_to_read(matchers);

            // Node -> why it was not read (failed reads; peers marked down are
            // described from the state when a warning needs it).
            let mut failed: BTreeMap<usize, String> = BTreeMap::new();
            let mut missing: BTreeMap<ShardKey, BTreeSet<usize>> = BTreeMap::new();
            let mut merged: BTreeMap<KeyArc, Vec<Part>> = BTreeMap::new();
            let received = AtomicUsize::new(0);
            let round = Round {
                map: &map,
                me,
                prefer: Prefer::Node(me),
                known: &known,
                keys: &keys,
                min_ts,
                max_ts,
                view,
            };
            let planned = self
                .fan_out(
                    round,
                    &mut failed,
                    &mut missing,
                    |local_keys, unknown_too| {
                        let storage = inner.storage.clone();
                        let matchers = matchers.to_vec();
                        on_blocking_pool("reading this node's storage", move || {
                            read_local(&storage, &matchers, min_ts, max_ts, local_keys, unknown_too)
                        })
                    },
                    |node, shards| {
                        let addr = map.nodes()[node].flight;
                        let ticket =
                            wire::encode_ticket(matchers, min_ts, max_ts, shards, labels_only);
                        let received = &received;
                        async move { self.fetch(addr, ticket, received).await }
                    },
                    |series| {
                        for (key, part) in series {
                            merged.entry(key).or_default().push(part);
                        }
                    },
                )
                .await?;
            if planned == Planned::Stale {
                (warnings, view) = (self.checked()?, None);
                continue;
            }

            self.missing_warnings(&map, missing, &failed, &mut warnings);
            debug!(
                series = merged.len(),
                warnings = warnings.len(),
                "cluster select"
            );
            return Ok(Selection {
                series: merged
                    .into_iter()
                    .map(|(key, parts)| ClusterSeries { key, parts })
                    .collect(),
                warnings,
            });
        }
    }

    /// A warning per shard in `missing`, naming its owners and why each was
    /// not read.
    fn missing_warnings(
        &self,
        map: &ShardMap,
        missing: BTreeMap<ShardKey, BTreeSet<usize>>,
        failed: &BTreeMap<usize, String>,
        warnings: &mut Vec<String>,
    ) {
        if !missing.is_empty() {
            self.inner.metrics.selects_partial.fetch_add(1, Relaxed);
        }
        for (key, owners) in missing {
            let why: Vec<String> = owners
                .iter()
                .map(|&o| {
                    let id = &map.nodes()[o].id;
                    match failed.get(&o) {
                        Some(e) => format!("{id}: read failed: {e}"),
                        None => match self.inner.state.peer(id).last_error {
                            Some(e) => format!("{id}: down ({e})"),
                            None => format!("{id}: down"),
                        },
                    }
                })
                .collect();
            warnings.push(format!(
                "partial result: no replica of {key} could be read, its data is missing \
                 (owners tried: {})",
                why.join("; ")
            ));
        }
    }

    /// The cluster's rollup records at `level` of `tier` matching `filter`,
    /// for windows that overlap `[min_ts, max_ts]` (as
    /// [`Storage::select_rollups`] over all the cluster's data), groups
    /// sorted and records in window order, with warnings as
    /// [`Self::select`]'s.
    ///
    /// Each shard is read from one replica per epoch: gpu and host groups
    /// as stored; rack, row and cluster groups as each node's aggregate of
    /// the shards it was asked for, merged here (count and sum add, min and
    /// max, first and last by timestamp). Each window is read from the
    /// owners of the epoch its start lies in; a window that spans an epoch
    /// change therefore lacks the samples after the change, and the answer
    /// says so.
    ///
    /// # Errors
    /// As [`Self::select`].
    pub async fn rollups(
        &self,
        tier: RollupTier,
        level: RollupLevel,
        filter: &RollupFilter,
        min_ts: i64,
        max_ts: i64,
    ) -> Result<RollupSelection, ClusterError> {
        let inner = &self.inner;
        let (mut warnings, mut view) = self.begin().await?;
        if min_ts > max_ts {
            return Ok(RollupSelection::default());
        }
        'plan: loop {
            let map = inner.state.map();
            let me = self.self_index(&map)?;
            let known = inner.state.known_keys();
            let keys: BTreeSet<ShardKey> = known
                .iter()
                .filter(|k| match k {
                    ShardKey::Rack(r) => filter.rack.as_ref().is_none_or(|f| f == r),
                    ShardKey::Host(h) => {
                        filter.rack.as_ref().is_none_or(String::is_empty)
                            && filter.host.as_ref().is_none_or(|f| f == h)
                    }
                })
                .cloned()
                .collect();
            let req = wire::RollupRequest {
                tier,
                level,
                filter: filter.clone(),
            };
            let first_start = tier.window_start(min_ts);
            let epochs = map.epochs_overlapping(min_ts, max_ts);
            let mut merged = wire::RollupMap::new();
            let mut failed: BTreeMap<usize, String> = BTreeMap::new();
            let mut missing: BTreeMap<ShardKey, BTreeSet<usize>> = BTreeMap::new();
            for (i, &e) in epochs.iter().enumerate() {
                let epoch_start = map.epochs()[e].start_ms;
                // Windows starting in [lo, hi] are read from this epoch's owners.
                let lo = if i == 0 { first_start } else { epoch_start };
                let hi = match epochs.get(i + 1) {
                    Some(&next) => map.epochs()[next].start_ms - 1,
                    None => max_ts,
                };
                if i > 0 && epoch_start.rem_euclid(tier.window_ms()) != 0 {
                    warnings.push(format!(
                        "partial result: the {} window that holds the membership change at {} \
                     counts only the samples before the change",
                        tier.label(),
                        crate::pushdown::format_ms(epoch_start)
                    ));
                }
                // Plan within this epoch alone.
                let round = Round {
                    map: &map,
                    me,
                    prefer: Prefer::Node(me),
                    known: &known,
                    keys: &keys,
                    min_ts: lo.max(epoch_start),
                    max_ts: hi.max(lo.max(epoch_start)),
                    view: if i == 0 { view } else { None },
                };
                let planned = self
                    .fan_out(
                        round,
                        &mut failed,
                        &mut missing,
                        |local_keys, unknown_too| {
                            let (storage, req) = (inner.storage.clone(), req.clone());
                            on_blocking_pool("reading this node's rollups", move || {
                                crate::cluster::shard_rollups(&storage, &req, lo, hi, |k| {
                                    local_keys.as_ref().is_some_and(|a| a.contains(k))
                                        || unknown_too.as_ref().is_some_and(|u| !u.contains(k))
                                })
                            })
                        },
                        |node, shards| {
                            let addr = map.nodes()[node].flight;
                            let ticket = wire::encode_rollup_ticket(&req, lo, hi, shards);
                            async move {
                                self.fetch_rollups(addr, ticket)
                                    .await
                                    .map_err(FetchError::Failed)
                            }
                        },
                        |part| {
                            for (g, windows) in &part {
                                for r in windows.values() {
                                    wire::merge_record(&mut merged, g, r);
                                }
                            }
                        },
                    )
                    .await?;
                if planned == Planned::Stale {
                    (warnings, view) = (self.checked()?, None);
                    continue 'plan;
                }
            }
            self.missing_warnings(&map, missing, &failed, &mut warnings);
            return Ok(RollupSelection {
                groups: merged
                    .into_iter()
                    .map(|(g, w)| (g, w.into_values().collect()))
                    .collect(),
                warnings,
            });
        }
    }

    /// The health events of the whole cluster: those of each shard from
    /// one of its owners (each owner evaluates the shard's GPUs itself),
    /// this node's from `local`. Shards are planned for the current
    /// membership epoch: after a membership change, a shard's events from
    /// before it stay with its former owners and are not read.
    ///
    /// # Errors
    /// As [`Self::select`].
    pub async fn health_events(
        &self,
        local: &Arc<dyn HealthSource>,
    ) -> Result<ClusterEvents, ClusterError> {
        let (answer, warnings) = self.health(local, wire::HealthPart::Events).await?;
        let mut events = answer.events;
        events.sort_by_key(|e| (e.detected_ts_ms, e.id));
        Ok(ClusterEvents { events, warnings })
    }

    /// The state of every GPU of the cluster, each from one owner of its
    /// shard, as [`Self::health_events`] reads events.
    ///
    /// # Errors
    /// As [`Self::select`].
    pub async fn health_states(
        &self,
        local: &Arc<dyn HealthSource>,
    ) -> Result<ClusterStates, ClusterError> {
        let (answer, warnings) = self.health(local, wire::HealthPart::States).await?;
        let mut states = answer.states;
        states.sort_by(|(a, _), (b, _)| (&a.host, a.gpu, &a.uuid).cmp(&(&b.host, b.gpu, &b.uuid)));
        Ok(ClusterStates { states, warnings })
    }

    async fn health(
        &self,
        local: &Arc<dyn HealthSource>,
        part: wire::HealthPart,
    ) -> Result<(HealthAnswer, Vec<String>), ClusterError> {
        let inner = &self.inner;
        let (mut warnings, mut view) = self.begin().await?;
        loop {
            let map = inner.state.map();
            let me = self.self_index(&map)?;
            let known = inner.state.known_keys();
            let now_ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64);
            let mut failed: BTreeMap<usize, String> = BTreeMap::new();
            let mut missing: BTreeMap<ShardKey, BTreeSet<usize>> = BTreeMap::new();
            let mut merged = HealthAnswer::default();
            let round = Round {
                map: &map,
                me,
                prefer: Prefer::Node(me),
                known: &known,
                keys: &known,
                min_ts: now_ms,
                max_ts: now_ms,
                view,
            };
            let planned = self
                .fan_out(
                    round,
                    &mut failed,
                    &mut missing,
                    |local_keys, unknown_too| {
                        let local = local.clone();
                        async move {
                            let keep = |k: &ShardKey| {
                                local_keys.as_ref().is_some_and(|a| a.contains(k))
                                    || unknown_too.as_ref().is_some_and(|u| !u.contains(k))
                            };
                            Ok((me, local_health(local.as_ref(), part, now_ms, keep)))
                        }
                    },
                    |node, shards| {
                        let addr = map.nodes()[node].flight;
                        let ticket = wire::encode_health_ticket(part, now_ms, shards);
                        async move {
                            self.fetch_health(addr, ticket, part)
                                .await
                                .map(|a| (node, a))
                                .map_err(FetchError::Failed)
                        }
                    },
                    |(node, answer): (usize, HealthAnswer)| {
                        merged.events.extend(answer.events.into_iter().map(|mut e| {
                            e.id = cluster_event_id(node, e.id);
                            e
                        }));
                        merged.states.extend(answer.states);
                    },
                )
                .await?;
            if planned == Planned::Stale {
                (warnings, view) = (self.checked()?, None);
                continue;
            }
            self.missing_warnings(&map, missing, &failed, &mut warnings);
            return Ok((merged, warnings));
        }
    }

    /// The fan-out/failover loop of every cluster read. Plans `keys` over
    /// the owners that can be read, reads this node's share with `local`
    /// (given the shards assigned here and, in the first round, the shards
    /// nobody reported, whose series this node may hold too: better read
    /// twice, merged, than never) and each peer's share with `remote`, all at
    /// once, and hands every answer to `merge`. The shards of a peer that
    /// failed are planned again onto their other replicas until every shard
    /// is read or has no replica left; those are added to `missing`, and
    /// every failed peer to `failed`.
    ///
    /// With a `view` in `round`, the first round also asks the peers for
    /// their status; if that changed the view the read was planned from
    /// (a peer up or down, other shards), nothing is merged and the read
    /// returns [`Planned::Stale`], for its caller to plan it again.
    async fn fan_out<A, L, LFut, R, RFut>(
        &self,
        round: Round<'_>,
        failed: &mut BTreeMap<usize, String>,
        missing: &mut BTreeMap<ShardKey, BTreeSet<usize>>,
        mut local: L,
        remote: R,
        mut merge: impl FnMut(A),
    ) -> Result<Planned, ClusterError>
    where
        L: FnMut(Option<BTreeSet<ShardKey>>, Option<BTreeSet<ShardKey>>) -> LFut,
        LFut: Future<Output = Result<A, ClusterError>>,
        R: Fn(usize, &BTreeSet<ShardKey>) -> RFut,
        RFut: Future<Output = Result<A, FetchError>>,
    {
        let Round {
            map,
            me,
            prefer,
            known,
            keys,
            min_ts,
            max_ts,
            view,
        } = round;
        let mut plan = self.plan(map, keys, (min_ts, max_ts), (me, prefer), failed);
        let mut first_round = true;
        loop {
            let plan_missing = std::mem::take(&mut plan.missing);
            let local_keys = plan.assignments.remove(&me);
            let unknown_too = first_round.then(|| known.clone());
            let local_read = (local_keys.is_some() || unknown_too.is_some())
                .then(|| local(local_keys, unknown_too));
            let local_read = async move {
                match local_read {
                    Some(read) => read.await.map(Some),
                    None => Ok(None),
                }
            };
            let remote_reads =
                futures::future::join_all(plan.assignments.iter().map(|(&node, shards)| {
                    let read = remote(node, shards);
                    async move { (node, read.await) }
                }));
            let refresh = async {
                if let (true, Some(_), Some(peers)) = (first_round, view, &self.inner.peers) {
                    cluster::refresh_peers(&self.inner.state, peers).await;
                }
            };
            let (local_answer, remote_answers, ()) =
                futures::join!(local_read, remote_reads, refresh);
            if let Some(v) = view.filter(|_| first_round)
                && self.inner.state.generation() != v
            {
                self.inner.metrics.selects_replanned.fetch_add(1, Relaxed);
                debug!("the peers' status changed during the read; planning it again");
                return Ok(Planned::Stale);
            }
            for m in plan_missing {
                missing.entry(m.key).or_default().extend(m.owners);
            }
            if let Some(answer) = local_answer? {
                merge(answer);
            }
            let mut replan: BTreeSet<ShardKey> = BTreeSet::new();
            for (node, answer) in remote_answers {
                match answer {
                    Ok(answer) => merge(answer),
                    Err(FetchError::TooLarge) => {
                        return Err(ClusterError::TooLarge(crate::LimitExceeded::PeerSamples {
                            limit: self.inner.config.max_peer_samples as u64,
                        }));
                    }
                    Err(FetchError::Failed(e)) => {
                        let id = &map.nodes()[node].id;
                        warn!(peer = %id, error = %e, "cluster read of a peer failed; trying other replicas");
                        self.inner.metrics.peer_read_failures.fetch_add(1, Relaxed);
                        replan.extend(plan.assignments[&node].iter().cloned());
                        failed.insert(node, e);
                    }
                }
            }
            if replan.is_empty() {
                return Ok(Planned::Held);
            }
            plan = self.plan(map, &replan, (min_ts, max_ts), (me, prefer), failed);
            first_round = false;
        }
    }

    /// Reads one peer's rollup answer, all of it or nothing.
    async fn fetch_rollups(
        &self,
        addr: SocketAddr,
        ticket: Vec<u8>,
    ) -> Result<wire::RollupMap, String> {
        let mut out = wire::RollupMap::new();
        self.read_answer(addr, ticket, |b| {
            wire::merge_rollup_batch(&mut out, b).map_err(BatchError::Malformed)
        })
        .await
        .map_err(FetchError::into_message)?;
        Ok(out)
    }

    /// Starts a `DoGet` of `ticket` at the peer `addr` (counted in
    /// `peer_reads`), within the idle timeout.
    async fn do_get(
        &self,
        addr: SocketAddr,
        ticket: Vec<u8>,
    ) -> Result<arrow_flight::decode::FlightRecordBatchStream, String> {
        self.inner.metrics.peer_reads.fetch_add(1, Relaxed);
        let idle = self.inner.config.idle_timeout;
        let client = FlightServiceClient::new(self.channel(addr))
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let mut client = FlightClient::new_from_inner(client);
        if let Some(a) = self.inner.state.authorization() {
            client
                .add_header("authorization", &a)
                .map_err(|e| format!("the cluster token makes no valid header: {e}"))?;
        }
        tokio::time::timeout(idle, client.do_get(Ticket::new(ticket)))
            .await
            .map_err(|_| format!("no answer from {addr} within {idle:?}"))?
            .map_err(|e| format!("Flight DoGet at {addr}: {e}"))
    }

    /// Reads one peer's health answer, all of it or nothing.
    async fn fetch_health(
        &self,
        addr: SocketAddr,
        ticket: Vec<u8>,
        part: wire::HealthPart,
    ) -> Result<HealthAnswer, String> {
        let mut out = HealthAnswer::default();
        self.read_answer(addr, ticket, |b| {
            match part {
                wire::HealthPart::Events => {
                    crate::health_events::events_from_batch(b).map(|e| out.events.extend(e))
                }
                wire::HealthPart::States => {
                    crate::health_events::states_from_batch(b).map(|s| out.states.extend(s))
                }
            }
            .map_err(|e| BatchError::Malformed(e.to_string()))
        })
        .await
        .map_err(FetchError::into_message)?;
        Ok(out)
    }

    /// The shards any node reported, and those of them that may hold a
    /// series all of `matchers` match.
    fn shards_to_read(&self, matchers: &[Matcher]) -> (BTreeSet<ShardKey>, BTreeSet<ShardKey>) {
        let known = self.inner.state.known_keys();
        let keys = known
            .iter()
            .filter(|k| shard_may_match(k, matchers))
            .cloned()
            .collect();
        (known, keys)
    }

    /// This node's index in `map`.
    fn self_index(&self, map: &ShardMap) -> Result<usize, ClusterError> {
        map.node_index(self.inner.state.self_id())
            .ok_or_else(|| ClusterError::Internal("this node is not in the cluster map".into()))
    }

    fn plan(
        &self,
        map: &ShardMap,
        keys: &BTreeSet<ShardKey>,
        (min_ts, max_ts): (i64, i64),
        (me, prefer): (usize, Prefer),
        failed: &BTreeMap<usize, String>,
    ) -> ReadPlan {
        let usable = |i: usize| {
            if i == me {
                return true;
            }
            if failed.contains_key(&i) {
                return false;
            }
            // Up, or never asked yet (just started): worth a try.
            let view = self.inner.state.peer(&map.nodes()[i].id);
            view.up || (view.status.is_none() && view.last_error.is_none())
        };
        map.plan_read_by(keys, min_ts, max_ts, usable, prefer)
    }

    fn channel(&self, addr: SocketAddr) -> Channel {
        let mut channels = self
            .inner
            .channels
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        channels
            .entry(addr)
            .or_insert_with(|| {
                // The channel's worker task goes to the reader's runtime, which
                // outlives any query runtime that happens to open it.
                let _on_reader_runtime = self.inner.runtime.enter();
                cluster::peer_endpoint(addr, self.inner.state.tls())
                    .connect_timeout(self.inner.config.connect_timeout)
                    .connect_lazy()
            })
            .clone()
    }

    /// Streams one peer's answer to `ticket` into `take`, batch by batch,
    /// each within the idle timeout. A batch `take` finds malformed, or one
    /// Arrow cannot decode, is a malformed answer (`peer_bad_answers`).
    async fn read_answer(
        &self,
        addr: SocketAddr,
        ticket: Vec<u8>,
        mut take: impl FnMut(&arrow::array::RecordBatch) -> Result<(), BatchError>,
    ) -> Result<(), FetchError> {
        let metrics = &self.inner.metrics;
        let idle = self.inner.config.idle_timeout;
        let mut stream = self.do_get(addr, ticket).await?;
        loop {
            // Arrow's IPC decoder panics on some malformed schemas (arrow-ipc
            // 59.3.2 unwraps a schema's field list): a peer's answer is input,
            // so a panic there is a malformed answer, not a failed query task.
            let next = std::panic::AssertUnwindSafe(stream.next()).catch_unwind();
            let batch = match tokio::time::timeout(idle, next).await {
                Err(_) => return Err(format!("{addr} sent nothing for {idle:?}").into()),
                Ok(Err(_panic)) => Err(BatchError::Malformed("Arrow could not decode it".into())),
                Ok(Ok(None)) => return Ok(()),
                Ok(Ok(Some(Err(e)))) => return Err(format!("Flight DoGet at {addr}: {e}").into()),
                Ok(Ok(Some(Ok(batch)))) => take(&batch),
            };
            match batch {
                Ok(()) => {}
                Err(BatchError::TooLarge) => return Err(FetchError::TooLarge),
                Err(BatchError::Malformed(e)) => {
                    metrics.peer_bad_answers.fetch_add(1, Relaxed);
                    return Err(format!("{addr} sent a malformed answer: {e}").into());
                }
            }
        }
    }

    /// Reads one peer's answer for a ticket, all of it or nothing, adding
    /// its samples to `received` (the select's, against the limit).
    async fn fetch(&self, addr: SocketAddr, ticket: Vec<u8>, received: &AtomicUsize) -> NodeAnswer {
        let metrics = &self.inner.metrics;
        let limit = self.inner.config.max_peer_samples;
        let mut decoder = AnswerDecoder::default();
        self.read_answer(addr, ticket, |batch| {
            let before = decoder.samples();
            decoder.push(batch).map_err(BatchError::Malformed)?;
            let added = decoder.samples() - before;
            if received.fetch_add(added, Relaxed) + added > limit {
                return Err(BatchError::TooLarge);
            }
            Ok(())
        })
        .await?;
        metrics
            .peer_samples_received
            .fetch_add(decoder.samples() as u64, Relaxed);
        let series = decoder.finish();
        metrics
            .peer_series_received
            .fetch_add(series.len() as u64, Relaxed);
        Ok(series
            .into_iter()
            .map(|(k, s)| (KeyArc::new(k), Part::Fetched(Arc::new(s))))
            .collect())
    }

    /// A PromQL aggregation pushed down (`crate::promql`'s pushdown): each
    /// node evaluates `plan`'s queries over the shards it is asked to read,
    /// this node over its own, and their partial results come back with a
    /// warning per shard that no replica could serve (a peer whose
    /// evaluation fails counts as failed, and its shards go to another
    /// replica). `None` when the samples the queries read span more than
    /// one epoch of the shard map, where a series may be split between
    /// owners: the caller reads raw samples then. Call it from a blocking
    /// thread (as [`Self::select_blocking`]).
    ///
    /// # Errors
    /// As [`Self::select`], and this node's own evaluation's errors.
    pub(crate) fn promql_partials_blocking(
        &self,
        plan: &crate::promql::PushdownPlan,
        deadline: crate::limits::Deadline,
    ) -> PartialsAnswer {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let this = self.clone();
        let (request, matchers) = (plan.request.clone(), plan.matchers.clone());
        let (data_min, data_max) = (plan.data_min, plan.data_max);
        self.inner.runtime.spawn(async move {
            let answer = this
                .promql_partials(request, &matchers, data_min, data_max, deadline)
                .await;
            let _ = tx.send(answer);
        });
        rx.recv().unwrap_or_else(|_| {
            Err(ClusterError::Internal(
                "the cluster read task ended without an answer (is the runtime shutting down?)"
                    .into(),
            )
            .into())
        })
    }

    async fn promql_partials(
        &self,
        request: wire::PromqlRequest,
        matchers: &[Matcher],
        data_min: i64,
        data_max: i64,
        deadline: crate::limits::Deadline,
    ) -> PartialsAnswer {
        let inner = &self.inner;
        let queries = request.queries.len();
        let mut rows = Vec::new();
        let mut local_error = None;
        let warnings = self
            .partial_read(
                matchers,
                data_min,
                data_max,
                |local_keys, unknown_too| {
                    let storage = inner.storage.clone();
                    let request = request.clone();
                    let filter = super::ShardFilter::new(local_keys, unknown_too);
                    on_blocking_pool("evaluating on this node", move || {
                        crate::promql::pushdown_partials(&storage, filter, &request, deadline)
                    })
                },
                |addr, shards| {
                    let ticket = wire::encode_promql_ticket(&request, shards);
                    async move { self.fetch_partials(addr, ticket, queries).await.map(Ok) }
                },
                |answer| match answer {
                    Ok(r) => rows.extend(r),
                    Err(e) => local_error = Some(e),
                },
            )
            .await?;
        let Some(warnings) = warnings else {
            debug!("PromQL pushdown: the range spans an epoch change; reading raw samples");
            return Ok(None);
        };
        if let Some(e) = local_error {
            return Err(e);
        }
        inner.metrics.promql_pushdowns.fetch_add(1, Relaxed);
        Ok(Some((rows, warnings)))
    }

    /// A read that each planned owner answers with a partial result of its
    /// shards (`local` for this node's, `remote` for a peer's at its Flight
    /// address), passed to `merge`: the PromQL and SQL pushdowns. Returns
    /// the read's warnings, or `None` when the data `[data_min, data_max]`
    /// spans an epoch change (a series may be split between owners) and
    /// nothing was read.
    async fn partial_read<A, L, LFut, R, RFut>(
        &self,
        matchers: &[Matcher],
        data_min: i64,
        data_max: i64,
        mut local: L,
        remote: R,
        mut merge: impl FnMut(A),
    ) -> Result<Option<Vec<String>>, ClusterError>
    where
        L: FnMut(Option<BTreeSet<ShardKey>>, Option<BTreeSet<ShardKey>>) -> LFut,
        LFut: Future<Output = Result<A, ClusterError>>,
        R: Fn(SocketAddr, &BTreeSet<ShardKey>) -> RFut,
        RFut: Future<Output = Result<A, FetchError>>,
    {
        let map = self.inner.state.map();
        if map.epochs_overlapping(data_min, data_max).len() > 1 {
            return Ok(None);
        }
        let (mut warnings, mut view) = self.begin().await?;
        let me = self.self_index(&map)?;
        loop {
            let (known, keys) = self.shards_to_read(matchers);
            let mut failed: BTreeMap<usize, String> = BTreeMap::new();
            let mut missing: BTreeMap<ShardKey, BTreeSet<usize>> = BTreeMap::new();
            let round = Round {
                map: &map,
                me,
                prefer: Prefer::Balance,
                known: &known,
                keys: &keys,
                min_ts: data_min,
                max_ts: data_max,
                view,
            };
            let planned = self
                .fan_out(
                    round,
                    &mut failed,
                    &mut missing,
                    &mut local,
                    |node, shards| remote(map.nodes()[node].flight, shards),
                    &mut merge,
                )
                .await?;
            if planned == Planned::Stale {
                (warnings, view) = (self.checked()?, None);
                continue;
            }
            self.missing_warnings(&map, missing, &failed, &mut warnings);
            return Ok(Some(warnings));
        }
    }

    /// Reads one peer's PromQL answer to a ticket of `queries` queries, all
    /// of it or nothing.
    async fn fetch_partials(
        &self,
        addr: SocketAddr,
        ticket: Vec<u8>,
        queries: usize,
    ) -> Result<Vec<wire::PartialRow>, FetchError> {
        let metrics = &self.inner.metrics;
        let limit = self.inner.config.max_peer_samples;
        let mut rows = Vec::new();
        let mut points = 0usize;
        self.read_answer(addr, ticket, |batch| {
            points +=
                wire::decode_partials(batch, queries, &mut rows).map_err(BatchError::Malformed)?;
            if points > limit {
                return Err(BatchError::TooLarge);
            }
            Ok(())
        })
        .await?;
        metrics
            .peer_partial_points_received
            .fetch_add(points as u64, Relaxed);
        Ok(rows)
    }

    /// Whether the data `[min_ts, max_ts]` spans an epoch change of the
    /// shard map (a series may then be split between owners).
    pub(crate) fn spans_epochs(&self, min_ts: i64, max_ts: i64) -> bool {
        self.inner
            .state
            .map()
            .epochs_overlapping(min_ts, max_ts)
            .len()
            > 1
    }

    /// Runs the partial statement `sql` of an aggregate on the owners of
    /// the shards `matchers` may select (each shard on one owner, this node
    /// included) and returns their results, with the warnings of the read.
    /// `None` when the data `[data_min, data_max]` spans an epoch change:
    /// the caller reads raw samples then ([`crate::sql_pushdown`]).
    ///
    /// # Errors
    /// As [`Self::select`], and this node's own run of the statement.
    pub(crate) async fn sql_partials(
        &self,
        sql: &str,
        matchers: &[Matcher],
        data_min: i64,
        data_max: i64,
    ) -> Result<Option<(Vec<RecordBatch>, Vec<String>)>, ClusterError> {
        let inner = &self.inner;
        let mut batches: Vec<RecordBatch> = Vec::new();
        let mut local_error = None;
        let warnings = self
            .partial_read(
                matchers,
                data_min,
                data_max,
                |local_keys, unknown_too| {
                    let storage = inner.storage.clone();
                    async move {
                        let filter = super::ShardFilter::new(local_keys, unknown_too);
                        Ok(crate::sql_pushdown::run_partial(storage, filter, sql)
                            .await
                            .map(|(_, b)| b))
                    }
                },
                |addr, shards| {
                    let ticket = wire::encode_sql_ticket(sql, shards);
                    async move { self.fetch_sql_partials(addr, ticket).await.map(Ok) }
                },
                |answer| match answer {
                    Ok(b) => batches.extend(b),
                    Err(e) => local_error = Some(e),
                },
            )
            .await?;
        let Some(warnings) = warnings else {
            return Ok(None);
        };
        if let Some(e) = local_error {
            return Err(ClusterError::Internal(format!(
                "running the pushed-down SQL on this node: {e}"
            )));
        }
        inner.metrics.sql_pushdowns.fetch_add(1, Relaxed);
        Ok(Some((batches, warnings)))
    }

    /// Reads one peer's answer to a SQL ticket, all of it or nothing.
    async fn fetch_sql_partials(
        &self,
        addr: SocketAddr,
        ticket: Vec<u8>,
    ) -> Result<Vec<RecordBatch>, FetchError> {
        let limit = self.inner.config.max_peer_samples;
        let mut batches = Vec::new();
        let mut rows = 0usize;
        self.read_answer(addr, ticket, |batch| {
            rows += batch.num_rows();
            if rows > limit {
                return Err(BatchError::TooLarge);
            }
            batches.push(batch.clone());
            Ok(())
        })
        .await?;
        self.inner
            .metrics
            .peer_partial_points_received
            .fetch_add(rows as u64, Relaxed);
        Ok(batches)
    }
}

/// Runs `f`, this node's part of a read, on the blocking pool; `what` names
/// it in the error if the task fails.
async fn on_blocking_pool<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ClusterError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ClusterError::Internal(format!("{what} failed: {e}")))
}

/// This node's health answer for the shards `keep` accepts.
pub(super) fn local_health(
    source: &dyn HealthSource,
    part: wire::HealthPart,
    now_ms: i64,
    keep: impl Fn(&ShardKey) -> bool,
) -> HealthAnswer {
    match part {
        wire::HealthPart::Events => HealthAnswer {
            events: source
                .events()
                .into_iter()
                .filter(|e| keep(&shard_of_gpu(&e.gpu)))
                .collect(),
            states: Vec::new(),
        },
        wire::HealthPart::States => HealthAnswer {
            events: Vec::new(),
            states: source
                .states(now_ms)
                .into_iter()
                .filter(|(g, _)| keep(&shard_of_gpu(g)))
                .collect(),
        },
    }
}

/// This node's series of `assigned` shards, and with `unknown_too` those of
/// shards not in it.
fn read_local(
    storage: &Storage,
    matchers: &[Matcher],
    min_ts: i64,
    max_ts: i64,
    assigned: Option<BTreeSet<ShardKey>>,
    unknown_too: Option<BTreeSet<ShardKey>>,
) -> Vec<(KeyArc, Part)> {
    let filter = super::ShardFilter::new(assigned, unknown_too);
    filter
        .select_series(storage, matchers, min_ts, max_ts)
        .into_iter()
        .map(|s| (s.key.clone(), Part::Local(s)))
        .collect()
}
