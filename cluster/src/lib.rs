//! Cluster membership and the shard map (issue #8).
//!
//! Membership is a static TOML file, the same on every node, as in
//! VictoriaMetrics cluster and Thanos: no consensus protocol. It lists the
//! nodes, the replication factor, and the membership *epochs*, each with a
//! start time, so that the map keeps its history: a query over an older time
//! range also asks the owners of that time.
//!
//! ```toml
//! replication_factor = 2
//!
//! [[node]]
//! id = "a"
//! grpc = "127.0.0.1:7400"
//! http = "127.0.0.1:7401"
//! flight = "127.0.0.1:7403"
//! # ... one [[node]] per node
//!
//! # Optional. Without it, one epoch holds every node since the beginning of time.
//! [[epoch]]
//! start = "2026-01-01T00:00:00Z"
//! nodes = ["a", "b", "c"]
//! [[epoch]]
//! start = "2026-11-30T12:00:00Z"
//! nodes = ["a", "b", "c", "d"]
//! ```
//!
//! The unit of sharding is a rack ([`ShardKey`]); a host without a rack is
//! its own unit. A key's owners in an epoch are the `replication_factor`
//! members with the highest rendezvous score `xxh64(node id ‖ 0x00 ‖ key)`,
//! so adding or removing a node moves only the keys whose top set it enters
//! or leaves. The score function is part of the on-disk contract: changing
//! it would move every rack, so its values are pinned by a test.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::Digest;

/// Why a cluster file was refused. Each message names the file and the field.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("cannot read the cluster file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cluster file {path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// One node of the cluster and where it listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub id: String,
    /// Agent streams and the `Owners` call.
    pub grpc: SocketAddr,
    /// Prometheus API, SQL over HTTP, remote read and write, `/api/v1/cluster`.
    pub http: SocketAddr,
    /// Arrow Flight: the node-to-node read path.
    pub flight: SocketAddr,
}

/// A membership epoch: from `start_ms` (inclusive) until the next epoch's
/// start, the members listed own the keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Epoch {
    /// Unix milliseconds; `i64::MIN` for an epoch that has always been.
    pub start_ms: i64,
    /// Indexes into [`ShardMap::nodes`], in file order.
    pub members: Vec<usize>,
}

/// The unit of sharding: a rack, or a host that has no rack.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ShardKey {
    Rack(String),
    Host(String),
}

impl ShardKey {
    /// The key of a host: its rack, or the host itself when the rack is empty.
    pub fn of(rack: &str, host: &str) -> Self {
        if rack.is_empty() {
            Self::Host(host.to_owned())
        } else {
            Self::Rack(rack.to_owned())
        }
    }

    /// The placement rule: the shard of a series, read from its labels.
    /// Its `rack` label when it has one (and it is not empty), else its
    /// host: the `Hostname` label, or `hostname` when there is no
    /// `Hostname` (as the `host` column and the rollup groups read it);
    /// empty when both are absent. Everything that places or finds a series
    /// (agents through their hello, remote-write forwarding, the stored
    /// series a node serves to its peers, read planning) goes through this
    /// or [`ShardKey::of`].
    pub fn of_labels<'a>(label: impl Fn(&str) -> Option<&'a str>) -> Self {
        match ShardRef::of_labels(label) {
            ShardRef::Rack(r) => Self::Rack(r.to_owned()),
            ShardRef::Host(h) => Self::Host(h.to_owned()),
        }
    }

    /// The bytes the rendezvous score hashes: `rack/<id>` or `host/<name>`.
    fn hash_bytes(&self) -> Vec<u8> {
        match self {
            Self::Rack(r) => [b"rack/", r.as_bytes()].concat(),
            Self::Host(h) => [b"host/", h.as_bytes()].concat(),
        }
    }
}

/// A [`ShardKey`] that borrows its name from a series' labels: the shard of
/// each series a read tests, without a copy of the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardRef<'a> {
    Rack(&'a str),
    Host(&'a str),
}

impl<'a> ShardRef<'a> {
    /// [`ShardKey::of_labels`], borrowed.
    pub fn of_labels(label: impl Fn(&str) -> Option<&'a str>) -> Self {
        match label("rack").filter(|r| !r.is_empty()) {
            Some(rack) => Self::Rack(rack),
            None => Self::Host(
                label("Hostname")
                    .or_else(|| label("hostname"))
                    .unwrap_or(""),
            ),
        }
    }
}

impl fmt::Display for ShardKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rack(r) => write!(f, "rack {r}"),
            Self::Host(h) => write!(f, "host {h} (no rack)"),
        }
    }
}

/// The rendezvous score of `node_id` for `key`: higher wins.
pub fn rendezvous_score(node_id: &str, key: &ShardKey) -> u64 {
    let mut bytes = Vec::with_capacity(node_id.len() + 1 + 64);
    bytes.extend_from_slice(node_id.as_bytes());
    bytes.push(0);
    bytes.extend_from_slice(&key.hash_bytes());
    twox_hash::XxHash64::oneshot(0, &bytes)
}

/// Membership and ownership, parsed and validated from the cluster file.
#[derive(Debug, Clone)]
pub struct ShardMap {
    replication_factor: usize,
    nodes: Vec<NodeSpec>,
    epochs: Vec<Epoch>,
    hash: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRepr {
    replication_factor: Option<usize>,
    #[serde(default, rename = "node")]
    nodes: Vec<NodeRepr>,
    #[serde(default, rename = "epoch")]
    epochs: Vec<EpochRepr>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeRepr {
    id: String,
    grpc: String,
    http: String,
    flight: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EpochRepr {
    start: String,
    nodes: Vec<String>,
}

impl ShardMap {
    /// Reads and validates a cluster file.
    ///
    /// # Errors
    /// The file cannot be read, is not TOML of the documented shape, or fails
    /// a check (see [`ShardMap::parse`]).
    pub fn load(path: &Path) -> Result<Self, ClusterError> {
        let text = std::fs::read_to_string(path).map_err(|source| ClusterError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates cluster-file text; `path` only names it in errors.
    ///
    /// # Errors
    /// [`ClusterError::Invalid`] naming the first problem: no nodes; an
    /// empty, badly formed or repeated node id; an address that does not
    /// parse or that two listeners share; a replication factor of 0 or above
    /// an epoch's member count; an epoch with an unknown or repeated node, an
    /// unparsable start, or a start not after the previous epoch's.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ClusterError> {
        let invalid = |message: String| ClusterError::Invalid {
            path: path.to_owned(),
            message,
        };
        let repr: FileRepr = toml::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if repr.nodes.is_empty() {
            return Err(invalid("no [[node]] entries".into()));
        }
        let rf = repr
            .replication_factor
            .ok_or_else(|| invalid("replication_factor is missing".into()))?;
        if rf == 0 {
            return Err(invalid("replication_factor must be at least 1".into()));
        }

        let mut nodes = Vec::with_capacity(repr.nodes.len());
        let mut ids = HashSet::new();
        let mut addrs = HashSet::new();
        for (i, n) in repr.nodes.iter().enumerate() {
            let at = format!("[[node]] #{} ({:?})", i + 1, n.id);
            if n.id.is_empty() {
                return Err(invalid(format!("{at}: id is empty")));
            }
            if !n
                .id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
            {
                return Err(invalid(format!(
                    "{at}: id may hold only ASCII letters, digits, '-', '_' and '.'"
                )));
            }
            if !ids.insert(n.id.clone()) {
                return Err(invalid(format!("{at}: id {:?} appears twice", n.id)));
            }
            let mut addr = |field: &str, value: &str| -> Result<SocketAddr, ClusterError> {
                let a: SocketAddr = value.parse().map_err(|e| {
                    invalid(format!("{at}: {field} = {value:?} is not host:port ({e})"))
                })?;
                if !addrs.insert(a) {
                    return Err(invalid(format!(
                        "{at}: {field} = {a} is also used by another listener"
                    )));
                }
                Ok(a)
            };
            nodes.push(NodeSpec {
                id: n.id.clone(),
                grpc: addr("grpc", &n.grpc)?,
                http: addr("http", &n.http)?,
                flight: addr("flight", &n.flight)?,
            });
        }

        let index_of = |id: &str| nodes.iter().position(|n| n.id == id);
        let mut epochs = Vec::new();
        if repr.epochs.is_empty() {
            epochs.push(Epoch {
                start_ms: i64::MIN,
                members: (0..nodes.len()).collect(),
            });
        }
        for (i, e) in repr.epochs.iter().enumerate() {
            let at = format!("[[epoch]] #{} (start {:?})", i + 1, e.start);
            let start = chrono::DateTime::parse_from_rfc3339(&e.start)
                .map_err(|err| {
                    invalid(format!(
                        "{at}: start is not an RFC 3339 time such as \
                         \"2026-11-30T12:00:00Z\" ({err})"
                    ))
                })?
                .timestamp_millis();
            if let Some(prev) = epochs.last()
                && start <= prev.start_ms
            {
                return Err(invalid(format!(
                    "{at}: starts no later than the epoch before it; list epochs oldest first"
                )));
            }
            let mut members = Vec::with_capacity(e.nodes.len());
            for id in &e.nodes {
                let idx = index_of(id)
                    .ok_or_else(|| invalid(format!("{at}: node {id:?} has no [[node]] entry")))?;
                if members.contains(&idx) {
                    return Err(invalid(format!("{at}: node {id:?} is listed twice")));
                }
                members.push(idx);
            }
            members.sort_unstable();
            epochs.push(Epoch {
                start_ms: start,
                members,
            });
        }
        for (i, e) in epochs.iter().enumerate() {
            if e.members.len() < rf {
                return Err(invalid(format!(
                    "replication_factor = {rf}, but epoch #{} has only {} node(s)",
                    i + 1,
                    e.members.len()
                )));
            }
        }

        let map = Self {
            replication_factor: rf,
            nodes,
            epochs,
            hash: String::new(),
        };
        Ok(Self {
            hash: map.canonical_hash(),
            ..map
        })
    }

    /// SHA-256 (first 16 hex digits) of the map's canonical form: nodes,
    /// addresses, epochs and the replication factor, independent of comments,
    /// layout and the order of `[[node]]` entries. Nodes compare it before
    /// they serve cluster queries.
    fn canonical_hash(&self) -> String {
        let mut nodes: Vec<&NodeSpec> = self.nodes.iter().collect();
        nodes.sort_by(|a, b| a.id.cmp(&b.id));
        let mut canon = format!("rf={}\n", self.replication_factor);
        for n in nodes {
            canon += &format!("node={},{},{},{}\n", n.id, n.grpc, n.http, n.flight);
        }
        for e in &self.epochs {
            let mut ids: Vec<&str> = e.members.iter().map(|&i| &*self.nodes[i].id).collect();
            ids.sort_unstable();
            canon += &format!("epoch={},{}\n", e.start_ms, ids.join(","));
        }
        let digest = sha2::Sha256::digest(canon.as_bytes());
        digest[..8].iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn replication_factor(&self) -> usize {
        self.replication_factor
    }

    pub fn nodes(&self) -> &[NodeSpec] {
        &self.nodes
    }

    pub fn epochs(&self) -> &[Epoch] {
        &self.epochs
    }

    /// See [`ShardMap::parse`]'s canonical form.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    pub fn node_index(&self, id: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.id == id)
    }

    /// The epoch in force at `at_ms`; before the first epoch's start, the first.
    pub fn epoch_at(&self, at_ms: i64) -> usize {
        self.epochs
            .iter()
            .rposition(|e| e.start_ms <= at_ms)
            .unwrap_or(0)
    }

    /// Owners of `key` in epoch `epoch`, best score first.
    pub fn owners_in(&self, epoch: usize, key: &ShardKey) -> Vec<usize> {
        let mut scored: Vec<(u64, usize)> = self.epochs[epoch]
            .members
            .iter()
            .map(|&i| (rendezvous_score(&self.nodes[i].id, key), i))
            .collect();
        // Highest score first; equal scores (never seen, but possible) by id.
        scored.sort_unstable_by(|a, b| {
            b.0.cmp(&a.0)
                .then_with(|| self.nodes[a.1].id.cmp(&self.nodes[b.1].id))
        });
        scored
            .into_iter()
            .take(self.replication_factor)
            .map(|(_, i)| i)
            .collect()
    }

    /// Owners of `key` at time `at_ms`, best score first.
    pub fn owners_at(&self, key: &ShardKey, at_ms: i64) -> Vec<usize> {
        self.owners_in(self.epoch_at(at_ms), key)
    }

    /// The epochs whose time overlaps `[min_ms, max_ms]`, oldest first.
    pub fn epochs_overlapping(&self, min_ms: i64, max_ms: i64) -> Vec<usize> {
        let first = self.epoch_at(min_ms);
        (first..self.epochs.len())
            .filter(|&i| i == first || self.epochs[i].start_ms <= max_ms)
            .collect()
    }
}

mod plan;
mod poll;
mod state;

pub use plan::{MissingShard, Prefer, ReadPlan};
pub use poll::{PeerClients, poll_peers, refresh_peers};
pub use state::{ClusterState, PeerTls, PeerView, peer_endpoint};

#[cfg(test)]
mod tests;
