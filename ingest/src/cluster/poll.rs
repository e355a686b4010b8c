//! The peer poller: every node asks every other node for its status.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use gpulse_proto::v1::NodeStatusRequest;
use gpulse_proto::v1::ingest_client::IngestClient;
use tokio::sync::watch;
use tonic::transport::{Channel, Endpoint};
use tracing::{info, warn};

use super::ClusterState;

/// Polls every peer's `NodeStatus` each `interval` (each call times out
/// after `interval` too) until `shutdown` turns true. Logs a peer going
/// down, coming back, and running with another cluster file.
pub async fn poll_peers(
    state: Arc<ClusterState>,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut clients: HashMap<String, (String, IngestClient<Channel>)> = HashMap::new();
    loop {
        let map = state.map();
        let calls = map
            .nodes()
            .iter()
            .filter(|n| n.id != state.self_id())
            .map(|node| {
                let addr = node.grpc.to_string();
                let client = match clients.get(&node.id) {
                    Some((a, c)) if *a == addr => c.clone(),
                    _ => {
                        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
                            .expect("a SocketAddr makes a valid URI")
                            .connect_timeout(interval)
                            .timeout(interval);
                        let c = IngestClient::new(endpoint.connect_lazy());
                        clients.insert(node.id.clone(), (addr, c.clone()));
                        c
                    }
                };
                let id = node.id.clone();
                async move {
                    let mut client = client;
                    let r = client.node_status(NodeStatusRequest {}).await;
                    (
                        id,
                        r.map(|r| r.into_inner())
                            .map_err(|s| s.message().to_owned()),
                    )
                }
            })
            .collect::<Vec<_>>();
        for (id, outcome) in futures::future::join_all(calls).await {
            let before = state.peer(&id);
            match &outcome {
                Ok(s)
                    if s.map_hash != map.hash()
                        && before
                            .status
                            .as_ref()
                            .is_none_or(|b| b.map_hash != s.map_hash) =>
                {
                    warn!(peer = %id, theirs = %s.map_hash, ours = %map.hash(), "peer runs with another cluster file; cluster queries are refused until the files agree");
                }
                Ok(_) if !before.up => info!(peer = %id, "peer is up"),
                Err(e) if before.up => warn!(peer = %id, error = %e, "peer is down"),
                _ => {}
            }
            state.update_peer(&id, outcome);
        }
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}
