//! Cluster mode (`gpulse agent --sharded`, issue #8): the agent's dual write.
//!
//! The agent asks a node (`gpulse.v1.Ingest/Owners`, the seeds of
//! `--ingest` in turn, with backoff) which nodes own its shard (its rack, or
//! the host itself without a rack), then delivers every batch to *each*
//! owner on its own stream. Each owner has its own [`Shipper`]: its own
//! queue, outbox and disk spool (`<spool_dir>/<node id>/`), its own epoch and
//! sequence numbers, and its own acks. A down owner's batches wait in its
//! buffer and spool and are delivered when it is back; the other owners are
//! not held up. There is no repair protocol: a replica is complete because
//! nothing is dropped for it (short of its spool filling up, which is
//! counted).
//!
//! Every `refresh_ms` (from the answer) the agent asks again, of the node
//! that answered last, the seeds, or any owner. When the owners change (a
//! membership epoch starts), polls from then on go to the new set: a new
//! owner gets a new shipper; a former owner's shipper gets no new polls,
//! delivers what it holds, and closes when that is acked. The node's address
//! is kept in `<spool_dir>/<node id>/owner.addr`, so that a restarted agent
//! finds the batches it spooled for any node, owner or not, and sends them.
//!
//! About once a second the agent publishes what it holds per owner, and each
//! shipper sends it on its stream (`Backlog`) when it changed: the nodes
//! report it as replica lag.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use gpulse_proto::v1::ingest_client::IngestClient;
use gpulse_proto::v1::{NodeAddress, OwnerBacklog, OwnersReply, OwnersRequest};
use rand::Rng;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::metrics::{AgentMetrics, OwnerMetrics};
use crate::shipper::{self, Control, SeriesTable, Shipper, ShipperStats};
use crate::source::GpuInfo;
use crate::spool;
use crate::{AgentConfig, AgentError, Poll};

/// In an owner's spool directory: the URL of the node's ingest.
pub(crate) const OWNER_ADDR_FILE: &str = "owner.addr";
/// Backlog reports, and the check for former owners with nothing left.
const TICK: Duration = Duration::from_secs(1);
/// One `Owners` call, connect included.
const OWNERS_TIMEOUT: Duration = Duration::from_secs(5);
/// When an answer carries no `refresh_ms`.
const DEFAULT_REFRESH: Duration = Duration::from_secs(10);
const MIN_REFRESH: Duration = Duration::from_millis(100);
const MAX_REFRESH: Duration = Duration::from_secs(60);

/// The seed URLs of a comma-separated list, each checked.
///
/// # Errors
/// No URL, or one that does not parse.
pub(crate) fn seeds(urls: &str) -> Result<Vec<String>, AgentError> {
    let seeds: Vec<String> = urls
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect();
    if seeds.is_empty() {
        return Err(AgentError::NoSeeds(urls.to_owned()));
    }
    for s in &seeds {
        shipper::endpoint(s)?;
    }
    Ok(seeds)
}

/// An owner node, as the agent uses it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Owner {
    pub(crate) id: String,
    /// `http://host:port` of its ingest service.
    pub(crate) url: String,
}

/// A node id names a spool directory, so it must be a plain file name: the
/// characters the cluster file allows, and not `.` or `..`.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 255
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

/// Checks the owners a node answered.
///
/// # Errors
/// Why the list is refused: empty, a bad or repeated node id, an address
/// that is not `host:port`.
pub(crate) fn owners_from(reply: &[NodeAddress]) -> Result<Vec<Owner>, String> {
    if reply.is_empty() {
        return Err("the list of owners is empty".into());
    }
    let mut out: Vec<Owner> = Vec::with_capacity(reply.len());
    for n in reply {
        if !valid_id(&n.id) {
            return Err(format!(
                "node id {:?} is not a valid node id (ASCII letters, digits, '-', '_' and '.')",
                n.id
            ));
        }
        if out.iter().any(|o| o.id == n.id) {
            return Err(format!("node {} is listed twice", n.id));
        }
        let port_ok = n
            .grpc
            .rsplit_once(':')
            .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
        let url = format!("http://{}", n.grpc);
        if !port_ok || n.grpc.contains('/') || shipper::endpoint(&url).is_err() {
            return Err(format!(
                "node {}: address {:?} is not host:port",
                n.id, n.grpc
            ));
        }
        out.push(Owner {
            id: n.id.clone(),
            url,
        });
    }
    Ok(out)
}

/// The same node, however its URL is written.
fn same_node(a: &str, b: &str) -> bool {
    let strip = |u: &str| {
        u.trim_start_matches("grpc://")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_owned()
    };
    strip(a) == strip(b)
}

/// An error with its causes ("transport error: connection refused").
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(c) = source {
        s.push_str(": ");
        s.push_str(&c.to_string());
        source = c.source();
    }
    s
}

/// One `Owners` call to `url`.
async fn ask(
    url: &str,
    request: &OwnersRequest,
    token: Option<&str>,
    tls: Option<&shipper::ClientTls>,
) -> Result<OwnersReply, String> {
    let endpoint = shipper::connect_endpoint(url, tls)
        .map_err(|e| e.to_string())?
        .timeout(OWNERS_TIMEOUT);
    let channel = tokio::time::timeout(OWNERS_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| "connect: timed out".to_owned())?
        .map_err(|e| format!("connect: {}", chain(&e)))?;
    match IngestClient::new(channel)
        .owners(crate::authorized(request.clone(), token))
        .await
    {
        Ok(r) => Ok(r.into_inner()),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => Err(format!(
            "not a cluster node ({}); give the agent nodes started with a cluster file",
            s.message()
        )),
        Err(s) => Err(format!("{:?}: {}", s.code(), s.message())),
    }
}

/// What the lookup task learned.
#[derive(Debug)]
struct Answer {
    owners: Vec<Owner>,
    /// The node that answered.
    from: String,
    map_hash: String,
}

/// Asks for the owners until the coordinator goes away: after an answer,
/// again after its `refresh_ms`; after a round in which no node answered,
/// again after a backoff with jitter. Asks the node that answered last
/// first, then the seeds, then the owners it knows.
async fn lookup(
    seeds: Vec<String>,
    request: OwnersRequest,
    config: LookupConfig,
    metrics: Arc<AgentMetrics>,
    answers: mpsc::Sender<Answer>,
) {
    let shard = if request.rack.is_empty() {
        format!("host {} (no rack)", request.host)
    } else {
        format!("rack {}", request.rack)
    };
    let mut last_good: Option<String> = None;
    let mut owners: Vec<String> = Vec::new();
    let mut backoff = config.backoff_min;
    let mut answered_once = false;
    loop {
        let mut candidates: Vec<String> = Vec::new();
        for u in last_good.iter().chain(&seeds).chain(&owners) {
            if !candidates.iter().any(|c| same_node(c, u)) {
                candidates.push(u.clone());
            }
        }
        let mut errors = Vec::new();
        let mut answer = None;
        for node in &candidates {
            let outcome = ask(node, &request, config.token.as_deref(), config.tls.as_ref())
                .await
                .and_then(|reply| {
                    owners_from(&reply.owners)
                        .map(|o| (o, reply))
                        .map_err(|why| format!("refused its answer: {why}"))
                });
            match outcome {
                Ok((o, reply)) => {
                    answer = Some((node.clone(), o, reply));
                    break;
                }
                Err(why) => {
                    metrics.owner_lookup_errors.fetch_add(1, Relaxed);
                    warn!(node = %node, error = %why, "owners lookup failed at this node");
                    errors.push(format!("{node}: {why}"));
                }
            }
        }
        let wait = match answer {
            Some((from, o, reply)) => {
                backoff = config.backoff_min;
                answered_once = true;
                last_good = Some(from.clone());
                owners = o.iter().map(|o| o.url.clone()).collect();
                let a = Answer {
                    owners: o,
                    from,
                    map_hash: reply.map_hash,
                };
                if answers.send(a).await.is_err() {
                    return;
                }
                match reply.refresh_ms {
                    0 => DEFAULT_REFRESH,
                    ms => Duration::from_millis(ms.into()).clamp(MIN_REFRESH, MAX_REFRESH),
                }
            }
            None => {
                last_good = None;
                let wait = backoff.mul_f64(rand::rng().random_range(0.5..1.5));
                backoff = (backoff * 2).min(config.backoff_max);
                if answered_once {
                    warn!(%shard, errors = ?errors, retry_in_ms = wait.as_millis() as u64,
                        "cannot refresh the owners of this host's shard; delivering to the owners known");
                } else {
                    warn!(%shard, errors = ?errors, retry_in_ms = wait.as_millis() as u64,
                        queue_polls = config.queue_polls,
                        "waiting for a node to name the owners of this host's shard; until one does, \
                         polls wait in the queue (new ones are dropped and counted once it is full)");
                }
                wait
            }
        };
        tokio::time::sleep(wait).await;
    }
}

#[derive(Debug, Clone)]
struct LookupConfig {
    token: Option<String>,
    tls: Option<shipper::ClientTls>,
    backoff_min: Duration,
    backoff_max: Duration,
    queue_polls: usize,
}

/// What a shipper is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// An owner now: gets every poll.
    Owner,
    /// Not an owner any more (or not yet known to be one, after a restart):
    /// delivers what it holds, then closes.
    Former,
}

/// One node's running shipper.
struct Ship {
    /// Tells a shipper's end from its successor's.
    generation: u64,
    url: String,
    role: Role,
    /// The shipper's queue; `None` once closed (the shipper then ends when
    /// everything it holds is acked).
    polls: Option<mpsc::Sender<Poll>>,
    control: watch::Sender<Control>,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<ShipperStats, AgentError>>,
    metrics: Arc<OwnerMetrics>,
}

/// Runs the owners' shippers: fans polls out to them, follows owner
/// changes, and publishes the backlog.
pub(crate) struct Coordinator {
    config: AgentConfig,
    seeds: Vec<String>,
    inventory: Vec<GpuInfo>,
    source_name: &'static str,
    metrics: Arc<AgentMetrics>,
    /// The spool root's `LOCK`, held while the agent runs.
    _lock: Option<File>,
    /// The `--record` file and the series table that names its rows.
    record: Option<(SeriesTable, BufWriter<File>)>,
    ships: BTreeMap<String, Ship>,
    /// Owners whose shipper could not start (spool errors), retried each tick.
    unstarted: BTreeMap<String, String>,
    /// Batches left unacked by each node's last shipper.
    unacked: BTreeMap<String, u64>,
    backlog: Arc<Vec<OwnerBacklog>>,
    done_tx: mpsc::UnboundedSender<(String, u64)>,
    done_rx: mpsc::UnboundedReceiver<(String, u64)>,
    next_generation: u64,
    map_hash: String,
    stopping: bool,
    input_closed: bool,
}

impl Coordinator {
    /// Checks the seeds and takes the spool root's lock (a spool in use fails
    /// the start, not later); opens the record file.
    ///
    /// # Errors
    /// No seed or a bad one; a spool root in use or not writable; a record
    /// file that cannot be opened.
    pub(crate) fn new(
        config: AgentConfig,
        inventory: Vec<GpuInfo>,
        source_name: &'static str,
        metrics: Arc<AgentMetrics>,
    ) -> Result<Self, AgentError> {
        let seeds = seeds(&config.ingest_url)?;
        let lock = match &config.buffer.spool_dir {
            Some(dir) => {
                let lock = spool::lock_dir(dir).map_err(AgentError::Spool)?;
                warn_single_spool(dir);
                Some(lock)
            }
            None => None,
        };
        let record = match &config.record {
            Some(path) => Some((
                SeriesTable::new(inventory.clone()),
                shipper::open_record(path)?,
            )),
            None => None,
        };
        metrics.set_sharded();
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Ok(Self {
            config,
            seeds,
            inventory,
            source_name,
            metrics,
            _lock: lock,
            record,
            ships: BTreeMap::new(),
            unstarted: BTreeMap::new(),
            unacked: BTreeMap::new(),
            backlog: Arc::default(),
            done_tx,
            done_rx,
            next_generation: 0,
            map_hash: String::new(),
            stopping: false,
            input_closed: false,
        })
    }

    /// Delivers polls to the owners until `polls` closes and every owner has
    /// acked everything, or until `stop` fires and each shipper's drain
    /// deadline passes (what is left stays in each owner's spool).
    pub(crate) async fn run(
        mut self,
        mut polls: mpsc::Receiver<Poll>,
        mut stop: watch::Receiver<bool>,
    ) -> Result<ShipperStats, AgentError> {
        let request = OwnersRequest {
            rack: self.config.topology.rack.clone(),
            host: self.config.host.clone(),
        };
        info!(seeds = ?self.seeds, rack = %request.rack, host = %request.host,
            "cluster mode: asking for the owners of this host's shard");
        let (answers_tx, mut answers) = mpsc::channel(1);
        let lookup = tokio::spawn(lookup(
            self.seeds.clone(),
            request,
            LookupConfig {
                token: self.config.token.clone(),
                tls: self.config.tls.clone(),
                backoff_min: self.config.reconnect_min,
                backoff_max: self.config.reconnect_max,
                queue_polls: self.config.queue_polls,
            },
            self.metrics.clone(),
            answers_tx,
        ));
        self.resume_spooled();
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut known = false;
        loop {
            if (self.input_closed || self.stopping) && self.ships.is_empty() {
                break;
            }
            tokio::select! {
                poll = polls.recv(), if known && !self.input_closed => match poll {
                    Some(p) => self.fan_out(p).await,
                    None => {
                        self.input_closed = true;
                        for s in self.ships.values_mut() {
                            s.polls = None;
                        }
                    }
                },
                // Once the input is closed no poll is left to route: an
                // answer then would only restart shippers that are ending
                // (with a queue nobody closes, so the agent never ends).
                Some(a) = answers.recv(), if !self.stopping && !self.input_closed => {
                    known = true;
                    self.apply(a).await;
                }
                Some((id, generation)) = self.done_rx.recv() => self.ended(&id, generation).await,
                _ = tick.tick() => self.tick(),
                _ = stop.changed(), if !self.stopping => {
                    self.stopping = true;
                    for s in self.ships.values() {
                        s.stop.send_replace(true);
                    }
                }
            }
        }
        lookup.abort();
        polls.close();
        let mut lost = 0u64;
        while polls.try_recv().is_ok() {
            lost += 1;
        }
        if lost > 0 {
            self.metrics.polls_dropped.fetch_add(lost, Relaxed);
            if known {
                error!(polls = lost, "stopping: these last polls reached no owner");
            } else {
                error!(
                    polls = lost,
                    "stopping before any node named the owners of this host's shard: \
                     these polls were never delivered"
                );
            }
        }
        if let Some((_, w)) = &mut self.record {
            w.flush().ok();
        }
        let mut total = ShipperStats::default();
        for (id, o) in self.metrics.owners() {
            let unacked = self.unacked.get(&id).copied().unwrap_or(0);
            total = total.plus(ShipperStats::from_metrics(&o.shipper, unacked as usize));
        }
        Ok(total)
    }

    /// Sends a poll to every owner (and records it once).
    async fn fan_out(&mut self, poll: Poll) {
        if let Some((series, w)) = &mut self.record {
            let ids: Vec<u32> = poll
                .readings
                .iter()
                .map(|r| series.id(r.gpu, r.metric, r.label))
                .collect();
            let ts = vec![poll.ts_ms; ids.len()];
            let values: Vec<f64> = poll.readings.iter().map(|r| r.value).collect();
            if let Err(e) = shipper::record_rows(w, series.defs(), &ids, &ts, &values) {
                error!(error = %e, "could not write the sample record; recording stops");
                self.record = None;
            }
        }
        for (id, url) in &self.unstarted {
            let m = self.metrics.owner(id).shipper.clone();
            m.samples_dropped
                .fetch_add(poll.readings.len() as u64, Relaxed);
            m.batches_dropped.fetch_add(1, Relaxed);
            warn!(node = %id, %url, "no shipper for this owner (its spool could not be opened): poll dropped for it");
        }
        let owners: Vec<String> = self
            .ships
            .iter()
            .filter(|(_, s)| s.role == Role::Owner && s.polls.is_some())
            .map(|(id, _)| id.clone())
            .collect();
        for id in owners {
            let Some(tx) = self.ships.get(&id).and_then(|s| s.polls.clone()) else {
                continue;
            };
            let Err(mpsc::error::SendError(p)) = tx.send(poll.clone()).await else {
                continue;
            };
            if !self.stopping {
                // The shipper ended on its own (it never should while it
                // owns): start another on its spool and hand it the poll.
                error!(node = %id, "the shipper of an owner stopped unexpectedly; restarting it");
                self.replace(&id).await;
                if let Some(tx) = self.ships.get(&id).and_then(|s| s.polls.clone())
                    && tx.send(p).await.is_ok()
                {
                    continue;
                }
            }
            // Shutting down, and this owner's drain deadline has passed.
            let m = self.metrics.owner(&id).shipper.clone();
            m.samples_dropped
                .fetch_add(poll.readings.len() as u64, Relaxed);
            m.batches_dropped.fetch_add(1, Relaxed);
            warn!(node = %id, "a last poll came after this owner's shipper had stopped; dropped for it");
        }
    }

    /// Follows an answer: new owners get a shipper, former owners keep
    /// theirs only until it has delivered what it holds.
    async fn apply(&mut self, answer: Answer) {
        if answer.map_hash != self.map_hash {
            if !self.map_hash.is_empty() {
                info!(node = %answer.from, old = %self.map_hash, new = %answer.map_hash, "the cluster file changed");
            }
            self.map_hash = answer.map_hash.clone();
        }
        let mut before: Vec<String> = self
            .ships
            .iter()
            .filter(|(_, s)| s.role == Role::Owner)
            .map(|(id, _)| id.clone())
            .chain(self.unstarted.keys().cloned())
            .collect();
        before.sort_unstable();
        let wanted: Vec<&str> = answer.owners.iter().map(|o| o.id.as_str()).collect();
        let mut sorted = wanted.clone();
        sorted.sort_unstable();
        if sorted != before {
            info!(node = %answer.from, owners = ?answer.owners.iter().map(|o| format!("{} ({})", o.id, o.url)).collect::<Vec<_>>(),
                before = ?before, "owners of this host's shard");
        }
        self.unstarted.retain(|id, _| wanted.contains(&id.as_str()));
        for o in &answer.owners {
            let closing = self.ships.get(&o.id).is_some_and(|s| s.polls.is_none());
            if closing {
                // Its shipper is winding down and holds the spool: let it
                // spool what it still has, then start over on that spool.
                if let Some(s) = self.ships.remove(&o.id) {
                    s.stop.send_replace(true);
                    self.finish(&o.id, s).await;
                }
            }
            match self.ships.get_mut(&o.id) {
                Some(s) => {
                    if s.role == Role::Former {
                        info!(node = %o.id, "the node owns this host's shard again");
                        s.role = Role::Owner;
                        s.metrics.current.store(1, Relaxed);
                    }
                    if s.url != o.url {
                        info!(node = %o.id, old = %s.url, new = %o.url, "the node moved");
                        s.url = o.url.clone();
                        s.control.send_modify(|c| c.url = o.url.clone());
                        self.remember_addr(&o.id, &o.url);
                    }
                }
                None => self.start(&o.id, &o.url, Role::Owner),
            }
        }
        for (id, s) in &mut self.ships {
            if s.role == Role::Owner && !wanted.contains(&id.as_str()) {
                s.role = Role::Former;
                s.metrics.current.store(0, Relaxed);
                info!(node = %id, held = s.metrics.backlog(),
                    "the node no longer owns this host's shard: it gets no new polls, and its stream \
                     closes once what is held for it is delivered");
            }
        }
    }

    /// Starts a shipper for node `id` on its spool (`<spool_dir>/<id>`).
    fn start(&mut self, id: &str, url: &str, role: Role) {
        let metrics = self.metrics.owner(id);
        let mut config = self.config.clone();
        config.ingest_url = url.to_owned();
        config.sharded = false;
        config.record = None;
        config.buffer.spool_dir = self.config.buffer.spool_dir.as_ref().map(|d| d.join(id));
        let (control, control_rx) = watch::channel(Control {
            url: url.to_owned(),
            backlog: self.backlog.clone(),
        });
        let shipper = match Shipper::new(
            config,
            self.inventory.clone(),
            self.source_name,
            metrics.shipper.clone(),
        ) {
            Ok(s) => s.with_control(control_rx),
            Err(e) => {
                error!(node = %id, error = %e, "cannot start the shipper of this node; retrying every second");
                if role == Role::Owner {
                    self.unstarted.insert(id.to_owned(), url.to_owned());
                }
                return;
            }
        };
        self.unstarted.remove(id);
        if role == Role::Former && shipper.is_idle() {
            return;
        }
        self.remember_addr(id, url);
        let (tx, rx) = mpsc::channel(self.config.queue_polls.max(1));
        let (stop, stop_rx) = watch::channel(self.stopping);
        let generation = self.next_generation;
        self.next_generation += 1;
        let done = self.done_tx.clone();
        let node = id.to_owned();
        let task = tokio::spawn(async move {
            let r = shipper.run(rx, stop_rx).await;
            let _ = done.send((node, generation));
            r
        });
        metrics
            .current
            .store(u64::from(role == Role::Owner), Relaxed);
        metrics.shipping.store(1, Relaxed);
        if role == Role::Former {
            info!(node = %id, %url, held = metrics.backlog(), "delivering what an earlier run spooled for this node");
        }
        self.ships.insert(
            id.to_owned(),
            Ship {
                generation,
                url: url.to_owned(),
                role,
                polls: Some(tx),
                control,
                stop,
                task,
                metrics,
            },
        );
    }

    /// Waits for a shipper that is ending and keeps its count of unacked batches.
    async fn finish(&mut self, id: &str, ship: Ship) {
        let unacked = match ship.task.await {
            Ok(Ok(stats)) => stats.batches_unacked,
            Ok(Err(e)) => {
                error!(node = %id, error = %e, "the shipper of this node failed");
                ship.metrics.backlog()
            }
            Err(e) => {
                error!(node = %id, error = %e, "the shipper of this node panicked");
                ship.metrics.backlog()
            }
        };
        if self.config.buffer.spool_dir.is_some() {
            // The next shipper of the node opens the same spool.
            self.unacked.insert(id.to_owned(), unacked);
        } else {
            *self.unacked.entry(id.to_owned()).or_default() += unacked;
        }
        ship.metrics.shipping.store(0, Relaxed);
        if ship.role == Role::Former {
            ship.metrics.current.store(0, Relaxed);
        }
    }

    /// A shipper ended.
    async fn ended(&mut self, id: &str, generation: u64) {
        if self
            .ships
            .get(id)
            .is_none_or(|s| s.generation != generation)
        {
            return; // already replaced
        }
        let ship = self.ships.remove(id).expect("BUG: checked above");
        let (role, url, open) = (ship.role, ship.url.clone(), ship.polls.is_some());
        self.finish(id, ship).await;
        if role == Role::Owner && open && !self.input_closed && !self.stopping {
            error!(node = %id, "the shipper of an owner stopped unexpectedly; restarting it");
            self.start(id, &url, Role::Owner);
        } else if role == Role::Former {
            info!(node = %id, "delivered everything held for a former owner; its stream is closed");
        }
    }

    /// Ends node `id`'s shipper and starts another on its spool.
    async fn replace(&mut self, id: &str) {
        let Some(ship) = self.ships.remove(id) else {
            return;
        };
        let (role, url) = (ship.role, ship.url.clone());
        ship.stop.send_replace(true);
        self.finish(id, ship).await;
        if !self.stopping && !self.input_closed {
            self.start(id, &url, role);
        }
    }

    /// Once a second: retries owners without a shipper, closes former
    /// owners' queues once nothing is held for them, publishes the backlog.
    fn tick(&mut self) {
        if !self.stopping && !self.input_closed {
            for (id, url) in std::mem::take(&mut self.unstarted) {
                self.start(&id, &url, Role::Owner);
            }
        }
        for (id, s) in &mut self.ships {
            let Some(tx) = &s.polls else { continue };
            // Queue first, then the outbox: a poll the shipper has taken is
            // in its outbox by the time the gauge is read again.
            if s.role == Role::Former
                && tx.capacity() == tx.max_capacity()
                && s.metrics.backlog() == 0
            {
                info!(node = %id, "nothing left for a former owner; closing its stream");
                s.polls = None;
            }
        }
        let backlog: Vec<OwnerBacklog> = self
            .ships
            .iter()
            .map(|(id, s)| OwnerBacklog {
                node_id: id.clone(),
                batches: s.metrics.backlog(),
            })
            .collect();
        if backlog != *self.backlog {
            self.backlog = Arc::new(backlog);
            for s in self.ships.values() {
                let b = self.backlog.clone();
                s.control.send_modify(|c| c.backlog = b);
            }
        }
    }

    /// Starts a shipper for each node an earlier run spooled batches for:
    /// they are delivered whether or not the node still owns the shard.
    fn resume_spooled(&mut self) {
        let Some(root) = self.config.buffer.spool_dir.clone() else {
            return;
        };
        let Ok(entries) = fs::read_dir(&root) else {
            return;
        };
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !entry.path().is_dir() || !valid_id(&name) {
                continue;
            }
            match read_addr(&entry.path()) {
                Ok(url) => found.push((name, url)),
                Err(why) => {
                    warn!(dir = %entry.path().display(), reason = %why, "cannot tell which node this spool is for; it is sent once that node owns this host's shard");
                }
            }
        }
        for (id, url) in found {
            self.start(&id, &url, Role::Former);
        }
    }

    /// Writes `<spool_dir>/<id>/owner.addr` (write, rename).
    fn remember_addr(&self, id: &str, url: &str) {
        let Some(root) = &self.config.buffer.spool_dir else {
            return;
        };
        let dir = root.join(id);
        if let Err(e) = write_addr(&dir, url) {
            warn!(dir = %dir.display(), error = %e, "cannot record the node's address in its spool; after a restart, its spooled batches wait until it owns this host's shard again");
        }
    }
}

fn write_addr(dir: &Path, url: &str) -> std::io::Result<()> {
    let tmp = dir.join(format!("{OWNER_ADDR_FILE}.tmp"));
    fs::write(&tmp, format!("{url}\n"))?;
    fs::rename(&tmp, dir.join(OWNER_ADDR_FILE))
}

fn read_addr(dir: &Path) -> Result<String, String> {
    let path: PathBuf = dir.join(OWNER_ADDR_FILE);
    let text = fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let url = text.trim();
    shipper::endpoint(url).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(url.to_owned())
}

/// Cluster mode leaves the spool root's own batches (a run without
/// `--sharded`) alone: say so, once.
fn warn_single_spool(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let n = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".spool"))
        .count();
    if n > 0 {
        warn!(dir = %dir.display(), files = n,
            "the spool holds batches of a run without --sharded; cluster mode does not send them \
             (run once without --sharded to deliver them)");
    }
}

#[cfg(test)]
mod tests;
