//! Cluster mode of `gpulse serve` (`--cluster FILE --node-id ID`) and
//! `gpulse cluster status`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ::cluster::{ClusterState, PeerTls as ClusterTls, ShardKey, ShardMap};
use anyhow::{Context, bail};
use storage::Storage;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use crate::cli::NodeArgs;
use crate::server::ServeConfig;

/// How often a node asks each peer for its status.
pub(crate) const PEER_POLL: Duration = Duration::from_secs(1);

/// A validated cluster membership for one node.
#[derive(Debug, Clone)]
pub(crate) struct NodeConfig {
    pub(crate) file: PathBuf,
    pub(crate) node_id: String,
    pub(crate) map: ShardMap,
}

impl NodeConfig {
    pub(crate) fn spec(&self) -> &::cluster::NodeSpec {
        let i = self
            .map
            .node_index(&self.node_id)
            .expect("checked by configure");
        &self.map.nodes()[i]
    }
}

/// Loads the cluster file and puts this node's addresses into `config`.
///
/// # Errors
/// The file is invalid, the node id is not in it, or a listen flag names
/// another address than the file does for this node.
pub(crate) fn configure(
    mut config: ServeConfig,
    args: &NodeArgs,
    file: &Path,
    node_id: &str,
) -> anyhow::Result<ServeConfig> {
    let map = ShardMap::load(file)?;
    let Some(i) = map.node_index(node_id) else {
        let ids: Vec<&str> = map.nodes().iter().map(|n| n.id.as_str()).collect();
        bail!(
            "--node-id {node_id:?} is not in the cluster file {} (its nodes: {})",
            file.display(),
            ids.join(", ")
        );
    };
    let spec = map.nodes()[i].clone();
    let pick = |flag: &str, given: Option<SocketAddr>, file_addr: SocketAddr| match given {
        // Every interface on the file's port: a node behind the routable
        // address the file names.
        Some(a) if a.ip().is_unspecified() && a.port() == file_addr.port() => Ok(a),
        Some(a) if a != file_addr => bail!(
            "--{flag} {a} differs from node {node_id}'s address {file_addr} in {} (only that \
             address, or 0.0.0.0 with its port, may be given); drop the flag or change the file",
            file.display()
        ),
        _ => Ok(file_addr),
    };
    config.grpc_listen = pick("grpc-listen", args.grpc_listen, spec.grpc)?;
    config.http_listen = pick("http-listen", args.http_listen, spec.http)?;
    info!(
        node = node_id,
        nodes = map.nodes().len(),
        replication_factor = map.replication_factor(),
        epochs = map.epochs().len(),
        hash = map.hash(),
        "cluster file loaded"
    );
    config.cluster = Some(NodeConfig {
        file: file.to_owned(),
        node_id: node_id.to_owned(),
        map,
    });
    Ok(config)
}

/// Starts cluster mode: the node's state (seeded with the shards its data
/// directory already holds), the peer poller, and the SIGHUP reload.
pub(crate) async fn start(
    node: &NodeConfig,
    token: Option<String>,
    tls: Option<ClusterTls>,
    storage: &Arc<Storage>,
    stop: watch::Receiver<bool>,
    tasks: &mut Vec<(&'static str, JoinHandle<()>)>,
) -> anyhow::Result<Arc<ClusterState>> {
    let state = Arc::new(
        ClusterState::new(node.map.clone(), &node.node_id)
            .with_token(token)
            .with_tls(tls),
    );
    let (st, seeded) = (storage.clone(), state.clone());
    let shards = tokio::task::spawn_blocking(move || {
        for key in query::cluster::local_shard_keys(&st) {
            seeded.note_key(key);
        }
        seeded.local_keys().len()
    })
    .await?;
    info!(shards, "shards held in the data directory");

    tasks.push((
        "cluster-peers",
        tokio::spawn(::cluster::poll_peers(
            state.clone(),
            PEER_POLL,
            stop.clone(),
        )),
    ));
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        let (state, file, mut stop) = (state.clone(), node.file.clone(), stop);
        let spec = node.spec().clone();
        tasks.push((
            "cluster-reload",
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = hup.recv() => reload(&state, &file, &spec),
                        _ = stop.wait_for(|s| *s) => return,
                    }
                }
            }),
        ));
    }
    Ok(state)
}

fn reload(state: &ClusterState, file: &Path, spec: &::cluster::NodeSpec) {
    let map = match ShardMap::load(file) {
        Ok(m) => m,
        Err(e) => {
            return error!(error = %e, "SIGHUP: the cluster file is refused; the old map stays");
        }
    };
    if map.hash() == state.map().hash() {
        return info!("SIGHUP: the cluster file is unchanged");
    }
    if let Some(i) = map.node_index(state.self_id())
        && map.nodes()[i] != *spec
    {
        warn!("SIGHUP: this node's own addresses changed in the file; they take effect on restart");
    }
    let hash = map.hash().to_owned();
    match state.reload(map) {
        Ok(()) => info!(hash, "SIGHUP: cluster file reloaded"),
        Err(e) => error!(error = %e, "SIGHUP: the cluster file is refused; the old map stays"),
    }
}

/// One node's line in `gpulse cluster status`.
#[derive(Debug, serde::Serialize)]
pub(crate) struct NodeLine {
    pub(crate) id: String,
    pub(crate) grpc: String,
    pub(crate) up: bool,
    /// Why it is down, when it is.
    pub(crate) error: Option<String>,
    /// Its cluster file hash agrees with the file given to the command.
    pub(crate) same_file: Option<bool>,
    /// Shards whose owners now include this node, among all shards known.
    pub(crate) owned_racks: Vec<String>,
    /// Shards it holds data for: racks, and `host:NAME` for hosts without one.
    pub(crate) held_racks: Vec<String>,
    pub(crate) samples_per_s: Option<f64>,
    pub(crate) streams: Option<u64>,
    /// Batches agents hold for it (reported to any node): replica lag.
    pub(crate) lag_batches: u64,
    pub(crate) uptime_s: Option<u64>,
}

/// `gpulse cluster status`: asks every node of the file twice, `interval`
/// apart (for the ingest rate), and returns one line per node.
pub(crate) async fn status(
    file: &Path,
    interval: Duration,
    token: Option<&str>,
    tls: Option<&ClusterTls>,
) -> anyhow::Result<Vec<NodeLine>> {
    use gpulse_proto::v1::NodeStatusRequest;
    use gpulse_proto::v1::ingest_client::IngestClient;
    let map = ShardMap::load(file)?;
    let authorization: Option<tonic::metadata::MetadataValue<_>> = token
        .map(|t| format!("Bearer {t}").parse())
        .transpose()
        .context("the token makes no valid header")?;
    let ask = |addr: SocketAddr| {
        let authorization = authorization.clone();
        async move {
            let endpoint = ::cluster::peer_endpoint(addr, tls)
                .connect_timeout(Duration::from_secs(2))
                .timeout(Duration::from_secs(2));
            let mut c = IngestClient::connect(endpoint.clone())
                .await
                .map_err(|e| format!("cannot connect: {e}"))?;
            let mut request = tonic::Request::new(NodeStatusRequest {});
            if let Some(a) = authorization {
                request.metadata_mut().insert("authorization", a);
            }
            c.node_status(request)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| s.message().to_owned())
        }
    };
    let round = || futures::future::join_all(map.nodes().iter().map(|n| ask(n.grpc)));
    let first = round().await;
    tokio::time::sleep(interval).await;
    let second = round().await;

    let mut keys = std::collections::BTreeSet::new();
    let mut lag: BTreeMap<String, u64> = BTreeMap::new();
    for s in second.iter().flatten() {
        keys.extend(s.racks.iter().map(|r| ShardKey::Rack(r.clone())));
        keys.extend(s.hosts.iter().map(|h| ShardKey::Host(h.clone())));
        for b in &s.backlog {
            *lag.entry(b.node_id.clone()).or_default() += b.batches;
        }
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let mut owned: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for k in &keys {
        for o in map.owners_at(k, now) {
            owned.entry(o).or_default().push(match k {
                ShardKey::Rack(r) => r.clone(),
                ShardKey::Host(h) => format!("host:{h}"),
            });
        }
    }
    let mut lines = Vec::new();
    for (i, node) in map.nodes().iter().enumerate() {
        let (a, b) = (&first[i], &second[i]);
        let rate = match (a, b) {
            (Ok(a), Ok(b)) => Some(
                b.samples_accepted.saturating_sub(a.samples_accepted) as f64
                    / interval.as_secs_f64(),
            ),
            _ => None,
        };
        lines.push(NodeLine {
            id: node.id.clone(),
            grpc: node.grpc.to_string(),
            up: b.is_ok(),
            error: b.as_ref().err().cloned(),
            same_file: b.as_ref().ok().map(|s| s.map_hash == map.hash()),
            owned_racks: owned.remove(&i).unwrap_or_default(),
            held_racks: b.as_ref().map_or_else(
                |_| Vec::new(),
                |s| {
                    let hosts = s.hosts.iter().map(|h| format!("host:{h}"));
                    s.racks.iter().cloned().chain(hosts).collect()
                },
            ),
            samples_per_s: rate,
            streams: b.as_ref().ok().map(|s| s.streams_active),
            lag_batches: lag.get(&node.id).copied().unwrap_or(0),
            uptime_s: b.as_ref().ok().map(|s| s.uptime_s),
        });
    }
    Ok(lines)
}

/// The status lines as a table.
pub(crate) fn render_status(lines: &[NodeLine]) -> String {
    let mut out = format!(
        "{:<10} {:<22} {:<5} {:<5} {:>6} {:>6} {:>12} {:>8} {:>10}  {}\n",
        "NODE",
        "GRPC",
        "STATE",
        "FILE",
        "OWNS",
        "HOLDS",
        "SAMPLES/S",
        "STREAMS",
        "LAG",
        "RACKS OWNED"
    );
    for l in lines {
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        out += &format!(
            "{:<10} {:<22} {:<5} {:<5} {:>6} {:>6} {:>12} {:>8} {:>10}  {}\n",
            l.id,
            l.grpc,
            if l.up { "up" } else { "DOWN" },
            match l.same_file {
                Some(true) => "same",
                Some(false) => "DIFF",
                None => "-",
            },
            l.owned_racks.len(),
            l.held_racks.len(),
            opt(l.samples_per_s.map(|r| format!("{r:.0}"))),
            opt(l.streams.map(|s| s.to_string())),
            l.lag_batches,
            l.owned_racks.join(",")
        );
        if let Some(e) = &l.error {
            out += &format!("           ({e})\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    fn node_args(extra: &[&str]) -> NodeArgs {
        let mut argv = vec!["gpulse", "serve"];
        argv.extend_from_slice(extra);
        match crate::cli::Cli::parse_from(argv).command {
            crate::cli::Command::Serve(s) => s.node,
            _ => panic!("not serve"),
        }
    }

    const FILE: &str = r#"
replication_factor = 1
[[node]]
id = "a"
grpc = "127.0.0.1:7500"
http = "127.0.0.1:7501"
flight = "127.0.0.1:7503"
"#;

    #[test]
    fn the_node_listens_where_the_file_says_and_conflicts_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("cluster.toml");
        std::fs::write(&file, FILE).unwrap();
        let base = |args: &NodeArgs| crate::serve_config(args);

        let args = node_args(&[]);
        let c = configure(base(&args), &args, &file, "a").unwrap();
        assert_eq!(c.grpc_listen, "127.0.0.1:7500".parse().unwrap());
        assert_eq!(c.http_listen, "127.0.0.1:7501".parse().unwrap());
        let node = c.cluster.unwrap();
        assert_eq!(node.spec().flight, "127.0.0.1:7503".parse().unwrap());

        // The same address given as a flag is fine; another is refused.
        let args = node_args(&["--grpc-listen", "127.0.0.1:7500"]);
        assert!(configure(base(&args), &args, &file, "a").is_ok());
        let args = node_args(&["--grpc-listen", "0.0.0.0:7500"]);
        let c = configure(base(&args), &args, &file, "a").unwrap();
        assert_eq!(c.grpc_listen, "0.0.0.0:7500".parse().unwrap());
        let args = node_args(&["--grpc-listen", "0.0.0.0:7600"]);
        assert!(configure(base(&args), &args, &file, "a").is_err());
        let args = node_args(&["--http-listen", "127.0.0.1:9999"]);
        let e = configure(base(&args), &args, &file, "a")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--http-listen 127.0.0.1:9999 differs from node a's address 127.0.0.1:7501"),
            "{e}"
        );

        let e = configure(base(&args), &args, &file, "x")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--node-id \"x\" is not in the cluster file") && e.contains("its nodes: a"),
            "{e}"
        );
        let e = configure(base(&args), &args, &dir.path().join("none.toml"), "a")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read the cluster file"), "{e}");
    }
}
