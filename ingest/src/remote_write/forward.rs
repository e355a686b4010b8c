//! Cluster mode of remote write: a request sent to any node is split by
//! shard (the series' `rack` label, else its `Hostname`) and every part goes
//! to each of its shard's owners, this node storing its own part directly.
//!
//! The answer is 204 only when every owner stored its part. When an owner is
//! unreachable the reachable ones have stored theirs, and the answer is 503,
//! so that Prometheus keeps the request and retries it; a retry stores
//! nothing twice (each series drops samples at or before its newest), and
//! the down owner gets everything once it is back. A forwarded part carries
//! `X-Gpulse-Forwarded` and is stored where it lands, never forwarded again.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use axum::http::StatusCode;
use cluster::ShardKey;
use gpulse_proto::prometheus::{Label as PromLabel, Sample, TimeSeries, WriteRequest};
use prost::Message;

use super::{HttpError, Remote, bad, store, wire};

/// The header that marks a part forwarded by another node; its value is
/// that node's id.
pub const FORWARDED_HEADER: &str = "x-gpulse-forwarded";

/// How long a forward to one owner may take.
const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

/// The shard of a label set, by the one placement rule.
fn shard_key(labels: &[(String, String)]) -> ShardKey {
    ShardKey::of_labels(|name| {
        labels
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    })
}

/// Stores a part another node forwarded here, noting its shards.
pub(super) fn store_forwarded(remote: &Remote, w: &wire::RawWrite) -> Result<(), HttpError> {
    if let Some(cluster) = &remote.cluster {
        for (i, s) in w.series.iter().enumerate() {
            let labels = wire::labels(&w.label_bytes[s.labels.clone()])
                .map_err(|e| bad(format!("series {i}: {e}")))?;
            cluster.note_key(shard_key(&labels));
        }
    }
    store(remote, w, None)
}

/// Splits `w` by owner; stores this node's part and forwards the others.
pub(super) fn route(remote: &Remote, w: &wire::RawWrite) -> Result<(), HttpError> {
    let cluster = remote.cluster.as_ref().expect("BUG: route without cluster");
    let map = cluster.map();
    let me = cluster.self_index();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let mut labels_of = Vec::with_capacity(w.series.len());
    let mut parts: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, s) in w.series.iter().enumerate() {
        if s.histograms {
            return Err(bad(format!(
                "series {i}: native histograms are not supported; send classic histograms"
            )));
        }
        let labels = wire::labels(&w.label_bytes[s.labels.clone()])
            .map_err(|e| bad(format!("series {i}: {e}")))?;
        if !s.samples.is_empty() {
            let key = shard_key(&labels);
            let owners = map.owners_at(&key, now);
            if owners.contains(&me) {
                cluster.note_key(key);
            }
            for o in owners {
                parts.entry(o).or_default().push(i);
            }
        }
        labels_of.push(labels);
    }
    let local = parts.remove(&me);
    // Forward in parallel while this node stores its own part.
    let outcomes = std::thread::scope(|scope| {
        let forwards: Vec<_> = parts
            .iter()
            .map(|(&node, series)| {
                let body = encode_part(w, &labels_of, series);
                let spec = &map.nodes()[node];
                let me_id = cluster.self_id();
                let authorization = cluster.authorization();
                let tls = remote.forward_tls.as_ref();
                scope.spawn(move || {
                    (
                        spec.id.clone(),
                        forward(
                            &spec.http.to_string(),
                            me_id,
                            authorization.as_deref(),
                            tls,
                            body,
                        ),
                    )
                })
            })
            .collect();
        let local = local.map(|series| store(remote, w, Some(&series)));
        let forwarded: Vec<_> = forwards
            .into_iter()
            .map(|h| h.join().expect("BUG: a forward thread panicked"))
            .collect();
        (local, forwarded)
    });
    let (local, forwarded) = outcomes;
    if let Some(r) = local {
        r?;
    }
    let mut down = Vec::new();
    for (id, r) in forwarded {
        match r {
            Ok(()) => {}
            Err(Forward::Refused(msg)) => return Err(bad(format!("owner {id} refused: {msg}"))),
            Err(Forward::Failed(msg)) => {
                remote.metrics.forward_failed.fetch_add(1, Relaxed);
                down.push(format!("{id} ({msg})"));
            }
        }
    }
    if !down.is_empty() {
        return Err(HttpError(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "stored on the reachable owners, but not on {}; retry the request \
                 (nothing is stored twice)",
                down.join(", ")
            ),
        ));
    }
    Ok(())
}

/// A snappy-compressed `WriteRequest` of the series `picked` of `w`.
fn encode_part(
    w: &wire::RawWrite,
    labels_of: &[Vec<(String, String)>],
    picked: &[usize],
) -> Vec<u8> {
    let timeseries = picked
        .iter()
        .map(|&i| {
            let s = &w.series[i];
            TimeSeries {
                labels: labels_of[i]
                    .iter()
                    .map(|(name, value)| PromLabel {
                        name: name.clone(),
                        value: value.clone(),
                    })
                    .collect(),
                samples: s
                    .samples
                    .clone()
                    .map(|j| Sample {
                        value: w.values[j],
                        timestamp: w.timestamps[j],
                    })
                    .collect(),
                ..TimeSeries::default()
            }
        })
        .collect();
    let raw = WriteRequest {
        timeseries,
        ..WriteRequest::default()
    }
    .encode_to_vec();
    snap::raw::Encoder::new()
        .compress_vec(&raw)
        .expect("BUG: snappy compresses any input")
}

enum Forward {
    /// The owner answered 4xx: the part is invalid there too.
    Refused(String),
    /// The owner did not answer, or answered 5xx: worth a retry.
    Failed(String),
}

/// The HTTPS client of forwards between nodes that speak TLS: the nodes'
/// CA, and this node's certificate for peers that ask for one.
pub(super) fn tls_agent(tls: &cluster::PeerTls) -> ureq::Agent {
    use ureq::tls::{Certificate, ClientCert, PrivateKey, RootCerts, TlsConfig, TlsProvider};
    let roots: Vec<Certificate<'static>> = ureq::tls::parse_pem(&tls.ca_pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    let chain: Vec<Certificate<'static>> = ureq::tls::parse_pem(&tls.cert_pem)
        .filter_map(|item| match item {
            Ok(ureq::tls::PemItem::Certificate(c)) => Some(c),
            _ => None,
        })
        .collect();
    let client_cert = PrivateKey::from_pem(&tls.key_pem)
        .ok()
        .map(|key| ClientCert::new_with_certs(&chain, key));
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(FORWARD_TIMEOUT))
        .tls_config(
            TlsConfig::builder()
                .provider(TlsProvider::Rustls)
                .unversioned_rustls_crypto_provider(std::sync::Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .root_certs(RootCerts::new_with_certs(&roots))
                .client_cert(client_cert)
                .build(),
        )
        .build()
        .into()
}

fn forward(
    http: &str,
    me: &str,
    authorization: Option<&str>,
    tls: Option<&ureq::Agent>,
    body: Vec<u8>,
) -> Result<(), Forward> {
    thread_local! {
        static AGENT: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(FORWARD_TIMEOUT))
            .build()
            .into();
    }
    let send = |agent: &ureq::Agent| {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut request = agent
            .post(&format!("{scheme}://{http}/api/v1/write"))
            .header("content-type", "application/x-protobuf")
            .header("content-encoding", "snappy")
            .header("x-prometheus-remote-write-version", "0.1.0")
            .header(FORWARDED_HEADER, me);
        if let Some(a) = authorization {
            request = request.header("authorization", a);
        }
        request.send(&body[..])
    };
    let response = match tls {
        Some(agent) => send(agent),
        None => AGENT.with(send),
    };
    let mut response = response.map_err(|e| Forward::Failed(e.to_string()))?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let text = response
        .body_mut()
        .read_to_string()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let msg = format!("HTTP {}: {text}", status.as_u16());
    if status.is_client_error() {
        Err(Forward::Refused(msg))
    } else {
        Err(Forward::Failed(msg))
    }
}
