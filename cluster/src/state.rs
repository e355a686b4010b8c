//! A node's live view of the cluster: the shard map in force, what it holds
//! itself, what its peers last said, and its agents' backlogs.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use gpulse_proto::v1::NodeStatusReply;

use super::{ShardKey, ShardMap};

/// TLS between nodes (`serve --tls-ca` with `--tls-cert`): the CA that
/// signed the nodes' certificates, and this node's own certificate and key,
/// presented to peers that ask for one (their gRPC port under mTLS).
#[derive(Debug, Clone)]
pub struct PeerTls {
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl PeerTls {
    /// A tonic endpoint for the peer listener at `addr`: `https://` with
    /// this TLS, the peer's certificate checked for the address's IP.
    ///
    /// # Errors
    /// The TLS configuration is refused.
    pub fn endpoint(
        &self,
        addr: std::net::SocketAddr,
    ) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
            .expect("BUG: a socket address makes a valid URI")
            .tls_config(
                ClientTlsConfig::new()
                    .ca_certificate(Certificate::from_pem(&self.ca_pem))
                    .identity(Identity::from_pem(&self.cert_pem, &self.key_pem)),
            )
    }
}

/// A tonic endpoint for the peer listener at `addr`: over `tls` when given.
pub fn peer_endpoint(
    addr: std::net::SocketAddr,
    tls: Option<&PeerTls>,
) -> tonic::transport::Endpoint {
    match tls {
        // A configuration refused here was refused at start already.
        Some(t) => t
            .endpoint(addr)
            .expect("BUG: the peer TLS configuration was checked at start"),
        None => tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .expect("BUG: a socket address makes a valid URI"),
    }
    .tcp_nodelay(true)
}

/// What this node last learned of one peer.
#[derive(Debug, Clone, Default)]
pub struct PeerView {
    /// The last status call answered (always true for the node itself).
    pub up: bool,
    /// When it last answered.
    pub last_ok: Option<Instant>,
    /// Why the last call failed, if it did.
    pub last_error: Option<String>,
    /// Its last answer.
    pub status: Option<NodeStatusReply>,
}

/// Shared by the ingest service, the query side and the peer poller.
#[derive(Debug)]
pub struct ClusterState {
    map: RwLock<Arc<ShardMap>>,
    self_id: String,
    started: Instant,
    local_keys: Mutex<BTreeSet<ShardKey>>,
    /// agent id -> (node id -> batches it holds for that node).
    backlog: Mutex<HashMap<String, BTreeMap<String, u64>>>,
    /// By node id.
    peers: Mutex<HashMap<String, PeerView>>,
    /// Bumped whenever what a read is planned from changes: a peer going
    /// up or down, or reporting other shards or another cluster file.
    generation: AtomicU64,
    /// Samples stored through paths other than agent streams (remote write).
    other_samples: AtomicU64,
    /// `--cluster-token-file`: the bearer token this node presents to its
    /// peers (Flight reads, `NodeStatus`, forwarded writes).
    token: Option<String>,
    /// TLS to peers.
    tls: Option<PeerTls>,
}

impl ClusterState {
    /// # Panics
    /// If `self_id` is not a node of `map` (checked by the caller at start).
    pub fn new(map: ShardMap, self_id: &str) -> Self {
        assert!(
            map.node_index(self_id).is_some(),
            "{self_id} not in the map"
        );
        Self {
            map: RwLock::new(Arc::new(map)),
            self_id: self_id.to_owned(),
            started: Instant::now(),
            local_keys: Mutex::default(),
            backlog: Mutex::default(),
            peers: Mutex::default(),
            generation: AtomicU64::new(0),
            other_samples: AtomicU64::new(0),
            token: None,
            tls: None,
        }
    }

    /// Speaks TLS to peers.
    #[must_use]
    pub fn with_tls(mut self, tls: Option<PeerTls>) -> Self {
        self.tls = tls;
        self
    }

    /// TLS to peers, when the nodes speak it.
    pub fn tls(&self) -> Option<&PeerTls> {
        self.tls.as_ref()
    }

    /// Sets the token this node presents to its peers.
    #[must_use]
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    /// The `Authorization` value for calls to peers, when authentication is on.
    pub fn authorization(&self) -> Option<String> {
        self.token.as_ref().map(|t| format!("Bearer {t}"))
    }

    /// The map in force. A reload swaps it; holders keep the one they took.
    pub fn map(&self) -> Arc<ShardMap> {
        self.map.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the map (`SIGHUP` after the file changed).
    ///
    /// # Errors
    /// This node is not in the new map; the old one stays.
    pub fn reload(&self, map: ShardMap) -> Result<(), String> {
        if map.node_index(&self.self_id).is_none() {
            return Err(format!(
                "node {:?} is not in the new cluster file",
                self.self_id
            ));
        }
        // What peers still in the map said stays: it names the shards they
        // hold until their next answer.
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|id, _| map.node_index(id).is_some());
        *self.map.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(map);
        self.generation.fetch_add(1, Relaxed);
        Ok(())
    }

    pub fn self_id(&self) -> &str {
        &self.self_id
    }

    /// This node's index in the map in force.
    pub fn self_index(&self) -> usize {
        self.map()
            .node_index(&self.self_id)
            .expect("checked at new and reload")
    }

    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// Records that this node holds data of `key`.
    pub fn note_key(&self, key: ShardKey) {
        let mut keys = self.local_keys.lock().unwrap_or_else(|e| e.into_inner());
        if !keys.contains(&key) {
            keys.insert(key);
        }
    }

    pub fn local_keys(&self) -> BTreeSet<ShardKey> {
        self.local_keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Counts samples stored by remote write, for the node's ingest rate.
    pub fn add_samples(&self, n: u64) {
        self.other_samples.fetch_add(n, Relaxed);
    }

    /// Samples counted by [`Self::add_samples`].
    pub fn other_samples(&self) -> u64 {
        self.other_samples.load(Relaxed)
    }

    /// An agent's latest backlog report, replacing its previous one.
    pub fn set_backlog(&self, agent_id: &str, per_node: BTreeMap<String, u64>) {
        let mut b = self.backlog.lock().unwrap_or_else(|e| e.into_inner());
        if per_node.values().all(|&n| n == 0) {
            b.remove(agent_id);
        } else {
            b.insert(agent_id.to_owned(), per_node);
        }
    }

    /// Batches this node's agents hold, summed per target node id.
    pub fn backlog_by_node(&self) -> BTreeMap<String, u64> {
        let mut sum = BTreeMap::new();
        for per_node in self
            .backlog
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            for (node, n) in per_node {
                *sum.entry(node.clone()).or_insert(0) += n;
            }
        }
        sum
    }

    /// Records the outcome of a status call to `node_id`, and bumps
    /// [`Self::generation`] when it changes what reads are planned from.
    pub fn update_peer(&self, node_id: &str, outcome: Result<NodeStatusReply, String>) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let view = peers.entry(node_id.to_owned()).or_default();
        let changed = match (&outcome, &view.status) {
            (Ok(new), Some(old)) => {
                !view.up
                    || new.map_hash != old.map_hash
                    || new.racks != old.racks
                    || new.hosts != old.hosts
            }
            (Ok(_), None) => true,
            (Err(_), _) => view.up,
        };
        if changed {
            self.generation.fetch_add(1, Relaxed);
        }
        match outcome {
            Ok(status) => {
                view.up = true;
                view.last_ok = Some(Instant::now());
                view.last_error = None;
                view.status = Some(status);
            }
            Err(e) => {
                view.up = false;
                view.last_error = Some(e);
            }
        }
    }

    /// Changes each time a status call changes what this node knows of a
    /// peer's state, shards or cluster file. A read planned from this
    /// node's view while it refreshes the view (`query`'s cluster reader)
    /// compares it before and after: equal, the plan stands.
    pub fn generation(&self) -> u64 {
        self.generation.load(Relaxed)
    }

    /// What this node knows of `node_id` (the node itself is always up).
    pub fn peer(&self, node_id: &str) -> PeerView {
        if node_id == self.self_id {
            return PeerView {
                up: true,
                last_ok: Some(Instant::now()),
                ..PeerView::default()
            };
        }
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(node_id)
            .cloned()
            .unwrap_or_default()
    }

    /// Whether node `idx` of the map in force answered its last status call.
    pub fn is_up(&self, idx: usize) -> bool {
        let map = self.map();
        self.peer(&map.nodes()[idx].id).up
    }

    /// Shards known to exist anywhere: this node's, and every shard a peer
    /// has reported since this node started (kept while the peer is down, so
    /// that a missing rack is noticed and not silently dropped).
    pub fn known_keys(&self) -> BTreeSet<ShardKey> {
        let mut keys = self.local_keys();
        for view in self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            if let Some(s) = &view.status {
                keys.extend(s.racks.iter().map(|r| ShardKey::Rack(r.clone())));
                keys.extend(s.hosts.iter().map(|h| ShardKey::Host(h.clone())));
            }
        }
        keys
    }

    /// Problems that make a cluster-wide answer untrustworthy or incomplete
    /// before any shard is read:
    /// - `Err`: a reachable peer runs with a different cluster file (queries
    ///   are refused until the files agree);
    /// - `Ok(warnings)`: peers that are down and have not reported their
    ///   shards since this node started (whatever only they hold is unknown).
    ///
    /// # Errors
    /// The first disagreeing peer, with both hashes.
    pub fn preflight(&self) -> Result<Vec<String>, String> {
        let map = self.map();
        let mut warnings = Vec::new();
        for node in map.nodes() {
            if node.id == self.self_id {
                continue;
            }
            let view = self.peer(&node.id);
            if let Some(s) = &view.status
                && view.up
                && s.map_hash != map.hash()
            {
                return Err(format!(
                    "node {} runs with cluster file hash {}, this node with {}: \
                     cluster queries are refused until every node has the same file",
                    node.id,
                    s.map_hash,
                    map.hash()
                ));
            }
            if !view.up && view.status.is_none() {
                warnings.push(format!(
                    "node {} is down and has not reported its shards since this node \
                     started: data that only it holds may be missing",
                    node.id
                ));
            }
        }
        Ok(warnings)
    }
}
