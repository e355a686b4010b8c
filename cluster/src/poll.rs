//! Peer status calls: the poller every node runs, and the refresh a cluster
//! query makes before it plans.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpulse_proto::v1::NodeStatusRequest;
use gpulse_proto::v1::ingest_client::IngestClient;
use tokio::sync::watch;
use tonic::transport::Channel;
use tracing::{info, warn};

use super::ClusterState;

/// gRPC clients of the peers, by node id, kept between calls. Each call is
/// bounded by the timeout given at construction.
#[derive(Debug)]
pub struct PeerClients {
    timeout: Duration,
    clients: Mutex<HashMap<String, (String, IngestClient<Channel>)>>,
}

impl PeerClients {
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            clients: Mutex::default(),
        }
    }

    fn client(
        &self,
        id: &str,
        addr: std::net::SocketAddr,
        tls: Option<&crate::PeerTls>,
    ) -> IngestClient<Channel> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let key = addr.to_string();
        match clients.get(id) {
            Some((a, c)) if *a == key => c.clone(),
            _ => {
                let endpoint = crate::peer_endpoint(addr, tls)
                    .connect_timeout(self.timeout)
                    .timeout(self.timeout);
                let c = IngestClient::new(endpoint.connect_lazy());
                clients.insert(id.to_owned(), (key, c.clone()));
                c
            }
        }
    }
}

/// Asks every peer for its status once, in parallel, and records each
/// outcome in `state`; logs a peer going down, coming back, or running
/// with another cluster file.
///
/// A cluster query calls it before planning, so that it knows every shard
/// its live peers hold at that moment, not as of the last poll.
pub async fn refresh_peers(state: &ClusterState, clients: &PeerClients) {
    let map = state.map();
    let calls = map
        .nodes()
        .iter()
        .filter(|n| n.id != state.self_id())
        .map(|node| {
            let mut client = clients.client(&node.id, node.grpc, state.tls());
            let id = node.id.clone();
            let authorization = state.authorization();
            async move {
                let mut request = tonic::Request::new(NodeStatusRequest {});
                if let Some(a) = authorization.as_deref().and_then(|a| a.parse().ok()) {
                    request.metadata_mut().insert("authorization", a);
                }
                let r = client.node_status(request).await;
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
}

/// Refreshes every peer's status each `interval` (each call times out
/// after `interval` too) until `shutdown` turns true.
pub async fn poll_peers(
    state: Arc<ClusterState>,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let clients = PeerClients::new(interval);
    loop {
        refresh_peers(&state, &clients).await;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = shutdown.wait_for(|s| *s) => return,
        }
    }
}
