//! The ingest load: every host of a [`HostFeed`] set delivered over the
//! agent protocol (one gRPC stream per host, as agents do) or over
//! Prometheus remote-write 1.0 (HTTP POSTs of snappy protobuf, shaped as
//! Prometheus's own sender shapes them: one `TimeSeries` per sample).
//!
//! Both send `polls_per_batch` polls of one host per request, so the two
//! protocols carry the same samples in the same number of requests.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use gpulse_proto::v1::ingest_client::IngestClient;
use gpulse_proto::v1::{
    AgentMessage, Batch, Hello, Label, SeriesDef, Topology, agent_message, ingest_reply,
};
use tokio_stream::wrappers::ReceiverStream;

use super::fleet::HostFeed;

/// How the load is sent.
#[derive(Debug, Clone)]
pub(crate) struct LoadConfig {
    /// `grpc://host:port` (agent protocol) or the remote-write URL.
    pub(crate) url: String,
    pub(crate) protocol: Protocol,
    pub(crate) polls_per_batch: usize,
    /// Requests sent and not yet answered, per agent stream; for
    /// remote-write, the number of concurrent connections.
    pub(crate) concurrency: usize,
    /// Samples per second for the whole load; `None` as fast as acked.
    pub(crate) rate: Option<f64>,
    /// Agent protocol: feed `i` goes to `targets[i]` instead of `url`
    /// (a cluster's owners).
    pub(crate) targets: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Protocol {
    Agent,
    RemoteWrite,
}

impl Protocol {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Protocol::Agent => "agent",
            Protocol::RemoteWrite => "remote-write",
        }
    }
}

/// Counters shared by the senders and read by the progress line.
#[derive(Debug, Default)]
pub(crate) struct LoadStats {
    pub(crate) samples_sent: AtomicU64,
    pub(crate) samples_acked: AtomicU64,
    /// Acked but not stored (duplicates, too old), as the server says.
    pub(crate) samples_dropped: AtomicU64,
    /// Samples of requests the server refused.
    pub(crate) samples_rejected: AtomicU64,
    pub(crate) requests: AtomicU64,
    pub(crate) errors: AtomicU64,
    /// Ack latency of every request, in microseconds.
    pub(crate) latencies_us: Mutex<Vec<u32>>,
    /// The first error seen, for the report.
    pub(crate) first_error: Mutex<Option<String>>,
}

impl LoadStats {
    fn latency(&self, since: Instant) {
        let us = since.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
        self.latencies_us
            .lock()
            .expect("BUG: latency lock poisoned")
            .push(us);
    }

    fn error(&self, e: String) {
        self.errors.fetch_add(1, Relaxed);
        let mut first = self.first_error.lock().expect("BUG: error lock poisoned");
        if first.is_none() {
            tracing::warn!(error = %e, "load request failed");
            *first = Some(e);
        }
    }
}

/// Spaces requests so that the whole load runs at `rate` samples/s.
#[derive(Debug)]
struct Pacer {
    start: Instant,
    rate: Option<f64>,
    scheduled: AtomicU64,
}

impl Pacer {
    /// How long to wait before sending `n` more samples.
    fn wait(&self, n: u64) -> Option<Duration> {
        let rate = self.rate?;
        let before = self.scheduled.fetch_add(n, Relaxed);
        let due = self.start + Duration::from_secs_f64(before as f64 / rate);
        due.checked_duration_since(Instant::now())
    }
}

/// Sends every poll of `feeds`, returning when all are answered, with the
/// number of series the feeds defined.
pub(crate) async fn run(
    config: &LoadConfig,
    feeds: Vec<Box<dyn HostFeed>>,
    stats: Arc<LoadStats>,
) -> anyhow::Result<u64> {
    let mut series = 0u64;
    let pacer = Arc::new(Pacer {
        start: Instant::now(),
        rate: config.rate,
        scheduled: AtomicU64::new(0),
    });
    match config.protocol {
        Protocol::Agent => {
            let endpoint = match &config.targets {
                Some(_) => None,
                None => Some(agent_endpoint(&config.url)?),
            };
            let mut tasks = tokio::task::JoinSet::new();
            for (i, feed) in feeds.into_iter().enumerate() {
                let endpoint = match (&endpoint, &config.targets) {
                    (Some(e), _) => e.clone(),
                    (None, Some(t)) => agent_endpoint(&t[i])?,
                    (None, None) => unreachable!("one of the two is set"),
                };
                let (stats, pacer) = (stats.clone(), pacer.clone());
                let (k, window) = (config.polls_per_batch, config.concurrency);
                tasks.spawn(async move {
                    let host = feed.host().name.clone();
                    match agent_host(endpoint, feed, k, window, &stats, &pacer).await {
                        Ok(n) => n,
                        Err(e) => {
                            stats.error(format!("{host}: {e:#}"));
                            0
                        }
                    }
                });
            }
            while let Some(r) = tasks.join_next().await {
                series += r.context("a sender task panicked")?;
            }
        }
        Protocol::RemoteWrite => {
            let threads = config.concurrency.max(1);
            let mut groups: Vec<Vec<Box<dyn HostFeed>>> =
                (0..threads).map(|_| Vec::new()).collect();
            for (i, f) in feeds.into_iter().enumerate() {
                groups[i % threads].push(f);
            }
            let mut handles = Vec::new();
            for group in groups.into_iter().filter(|g| !g.is_empty()) {
                let (url, stats, pacer) = (config.url.clone(), stats.clone(), pacer.clone());
                let k = config.polls_per_batch;
                handles.push(tokio::task::spawn_blocking(move || {
                    remote_write_hosts(&url, group, k, &stats, &pacer)
                }));
            }
            for h in handles {
                series += h.await.context("a sender thread panicked")?;
            }
        }
    }
    Ok(series)
}

fn agent_endpoint(url: &str) -> anyhow::Result<tonic::transport::Endpoint> {
    let http = if let Some(rest) = url.strip_prefix("grpc://") {
        format!("http://{rest}")
    } else if url.starts_with("http://") {
        url.to_string()
    } else {
        bail!("agent-protocol URL {url:?} must start with grpc:// or http://");
    };
    tonic::transport::Endpoint::from_shared(http)
        .with_context(|| format!("invalid URL {url:?}"))
        .map(|e| e.tcp_nodelay(true))
}

/// One agent: its own connection and stream, `window` batches in flight.
/// Returns the number of series it defined.
async fn agent_host(
    endpoint: tonic::transport::Endpoint,
    mut feed: Box<dyn HostFeed>,
    polls_per_batch: usize,
    window: usize,
    stats: &LoadStats,
    pacer: &Pacer,
) -> anyhow::Result<u64> {
    let channel = endpoint.connect().await.context("connecting")?;
    let mut client = IngestClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20);
    let (tx, rx) = tokio::sync::mpsc::channel::<AgentMessage>(window + 1);
    let host = feed.host().clone();
    tx.send(AgentMessage {
        msg: Some(agent_message::Msg::Hello(Hello {
            agent_id: format!("bench-{}", host.name),
            host: host.name.clone(),
            topology: Some(Topology {
                cluster: host.cluster.clone(),
                row: host.row.clone(),
                rack: host.rack.clone(),
            }),
            gpus: Vec::new(),
            agent_version: concat!("gpulse-bench ", env!("CARGO_PKG_VERSION")).into(),
        })),
    })
    .await
    .ok()
    .context("stream closed before hello")?;
    let mut replies = client
        .stream(ReceiverStream::new(rx))
        .await
        .context("opening the stream")?
        .into_inner();
    // A fresh epoch per run, so that a second run is not taken for re-sends.
    let epoch = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as u64)
        | 1;
    let mut in_flight: VecDeque<(u64, Instant, u64)> = VecDeque::new();
    let (mut seq, mut defined, mut done) = (0u64, 0usize, false);
    let mut poll = Vec::new();
    loop {
        while !done && in_flight.len() < window.max(1) {
            let mut batch = Batch {
                seq: seq + 1,
                epoch,
                ..Default::default()
            };
            for _ in 0..polls_per_batch {
                let Some(ts) = feed.next_poll(&mut poll) else {
                    done = true;
                    break;
                };
                for &(s, v) in &poll {
                    batch.series_ids.push(s);
                    batch.timestamps_ms.push(ts);
                    batch.values.push(v);
                }
            }
            if batch.series_ids.is_empty() {
                break;
            }
            let series = feed.series();
            batch.new_series = series[defined..]
                .iter()
                .enumerate()
                .map(|(i, s)| SeriesDef {
                    id: (defined + i) as u32,
                    metric: s.metric.clone(),
                    labels: s
                        .labels
                        .iter()
                        .map(|(k, v)| Label {
                            name: k.clone(),
                            value: v.clone(),
                        })
                        .collect(),
                })
                .collect();
            defined = series.len();
            let n = batch.series_ids.len() as u64;
            if let Some(d) = pacer.wait(n) {
                tokio::time::sleep(d).await;
            }
            seq += 1;
            stats.samples_sent.fetch_add(n, Relaxed);
            in_flight.push_back((seq, Instant::now(), n));
            tx.send(AgentMessage {
                msg: Some(agent_message::Msg::Batch(batch)),
            })
            .await
            .ok()
            .context("the server closed the stream")?;
        }
        if in_flight.is_empty() {
            return Ok(defined as u64);
        }
        let reply = replies
            .message()
            .await
            .context("receiving acks")?
            .context("the server ended the stream with batches unacked")?;
        let (acked_seq, outcome) = match reply.reply {
            Some(ingest_reply::Reply::Ack(a)) => (a.seq, Ok((a.accepted, a.dropped))),
            Some(ingest_reply::Reply::Reject(r)) => (r.seq, Err(r.message)),
            None => bail!("an empty reply"),
        };
        let Some(pos) = in_flight.iter().position(|b| b.0 == acked_seq) else {
            bail!("a reply for batch {acked_seq}, which is not in flight");
        };
        let (_, sent_at, n) = in_flight.remove(pos).expect("BUG: position is in range");
        stats.requests.fetch_add(1, Relaxed);
        stats.latency(sent_at);
        match outcome {
            Ok((accepted, dropped)) => {
                stats.samples_acked.fetch_add(u64::from(accepted), Relaxed);
                stats.samples_dropped.fetch_add(u64::from(dropped), Relaxed);
            }
            Err(message) => {
                stats.samples_rejected.fetch_add(n, Relaxed);
                stats.error(format!("batch {acked_seq} rejected: {message}"));
            }
        }
    }
}

/// One remote-write connection sending the polls of `hosts`, round robin,
/// `polls_per_batch` polls of one host per request. Returns the number of
/// series the hosts defined.
fn remote_write_hosts(
    url: &str,
    mut hosts: Vec<Box<dyn HostFeed>>,
    polls_per_batch: usize,
    stats: &LoadStats,
    pacer: &Pacer,
) -> u64 {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into();
    let mut labels: Vec<Vec<Vec<u8>>> = hosts.iter().map(|_| Vec::new()).collect();
    let (mut poll, mut body, mut snappy) = (Vec::new(), Vec::new(), snap::raw::Encoder::new());
    let mut live: Vec<usize> = (0..hosts.len()).collect();
    while !live.is_empty() {
        live.retain(|&h| {
            let feed = &mut hosts[h];
            body.clear();
            let mut n = 0u64;
            for _ in 0..polls_per_batch {
                let Some(ts) = feed.next_poll(&mut poll) else {
                    break;
                };
                let series = feed.series();
                let host = feed.host();
                while labels[h].len() < series.len() {
                    let s = &series[labels[h].len()];
                    labels[h].push(encode_labels(&s.metric, &s.labels, &host.stream_labels()));
                }
                for &(s, v) in &poll {
                    encode_sample(&mut body, &labels[h][s as usize], ts, v);
                }
                n += poll.len() as u64;
            }
            if n == 0 {
                return false;
            }
            if let Some(d) = pacer.wait(n) {
                std::thread::sleep(d);
            }
            stats.samples_sent.fetch_add(n, Relaxed);
            let compressed = match snappy.compress_vec(&body) {
                Ok(c) => c,
                Err(e) => {
                    stats.error(format!("snappy: {e}"));
                    return false;
                }
            };
            let sent_at = Instant::now();
            let r = agent
                .post(url)
                .header("content-encoding", "snappy")
                .header("content-type", "application/x-protobuf")
                .header("x-prometheus-remote-write-version", "0.1.0")
                .send(&compressed[..]);
            stats.requests.fetch_add(1, Relaxed);
            match r {
                Ok(mut resp) if resp.status().is_success() => {
                    // Read to the end, so that the connection is reused.
                    let _ = resp.body_mut().read_to_vec();
                    stats.latency(sent_at);
                    stats.samples_acked.fetch_add(n, Relaxed);
                }
                Ok(mut resp) => {
                    let status = resp.status();
                    let text = resp.body_mut().read_to_string().unwrap_or_default();
                    stats.samples_rejected.fetch_add(n, Relaxed);
                    stats.error(format!("HTTP {status}: {}", text.trim()));
                }
                Err(e) => {
                    stats.samples_rejected.fetch_add(n, Relaxed);
                    stats.error(format!("POST {url}: {e}"));
                }
            }
            true
        });
    }
    hosts.iter().map(|h| h.series().len() as u64).sum()
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes_field(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
    out.push(tag);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The `labels` fields of a `prometheus.TimeSeries`, encoded once per series:
/// `__name__` plus the series' and the stream's labels, sorted by name as
/// Prometheus's remote-write sender sorts them.
fn encode_labels(metric: &str, own: &[(String, String)], stream: &[(&str, &str)]) -> Vec<u8> {
    let mut all: Vec<(&str, &str)> = vec![("__name__", metric)];
    all.extend(own.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    all.extend(stream.iter().copied().filter(|(_, v)| !v.is_empty()));
    all.sort_unstable();
    let mut out = Vec::new();
    let mut label = Vec::new();
    for (k, v) in all {
        label.clear();
        put_bytes_field(&mut label, 0x0a, k.as_bytes());
        put_bytes_field(&mut label, 0x12, v.as_bytes());
        put_bytes_field(&mut out, 0x0a, &label);
    }
    out
}

/// Appends one `WriteRequest.timeseries` entry holding one sample. Written
/// by hand because the load generator shares two cores with the server: the
/// label bytes are encoded once per series, not once per sample.
fn encode_sample(out: &mut Vec<u8>, labels: &[u8], ts: i64, v: f64) {
    let mut sample = [0u8; 20];
    sample[0] = 0x09; // value: double
    sample[1..9].copy_from_slice(&v.to_le_bytes());
    sample[9] = 0x10; // timestamp: int64 varint
    let mut len = 10;
    let mut t = ts as u64;
    while t >= 0x80 {
        sample[len] = (t as u8) | 0x80;
        t >>= 7;
        len += 1;
    }
    sample[len] = t as u8;
    len += 1;
    let series_len = labels.len() + 2 + len;
    out.push(0x0a);
    put_varint(out, series_len as u64);
    out.extend_from_slice(labels);
    out.push(0x12);
    out.push(len as u8);
    out.extend_from_slice(&sample[..len]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpulse_proto::prometheus::WriteRequest;
    use prost::Message;

    #[test]
    fn hand_encoded_write_requests_decode_with_prost() {
        let labels = encode_labels(
            "DCGM_FI_DEV_GPU_TEMP",
            &[("gpu".into(), "3".into()), ("UUID".into(), "GPU-x".into())],
            &[("Hostname", "h1"), ("cluster", "")],
        );
        let mut body = Vec::new();
        encode_sample(&mut body, &labels, 1_764_000_000_123, 41.5);
        encode_sample(&mut body, &labels, 0, -0.0);
        encode_sample(&mut body, &labels, -5, f64::NAN);
        let req = WriteRequest::decode(&body[..]).unwrap();
        assert_eq!(req.timeseries.len(), 3);
        let names: Vec<(&str, &str)> = req.timeseries[0]
            .labels
            .iter()
            .map(|l| (l.name.as_str(), l.value.as_str()))
            .collect();
        // Sorted by name; the empty stream label left out.
        assert_eq!(
            names,
            [
                ("Hostname", "h1"),
                ("UUID", "GPU-x"),
                ("__name__", "DCGM_FI_DEV_GPU_TEMP"),
                ("gpu", "3")
            ]
        );
        let s: Vec<(i64, u64)> = req
            .timeseries
            .iter()
            .map(|t| (t.samples[0].timestamp, t.samples[0].value.to_bits()))
            .collect();
        assert_eq!(
            s,
            [
                (1_764_000_000_123, 41.5f64.to_bits()),
                (0, (-0.0f64).to_bits()),
                (-5, f64::NAN.to_bits())
            ]
        );
    }

    #[test]
    fn the_pacer_spaces_samples_at_the_rate() {
        let p = Pacer {
            start: Instant::now(),
            rate: Some(1000.0),
            scheduled: AtomicU64::new(0),
        };
        assert!(p.wait(500).is_none_or(|d| d < Duration::from_millis(5)));
        let d = p.wait(500).expect("the second 500 are due at 0.5 s");
        assert!(
            d > Duration::from_millis(400) && d <= Duration::from_millis(500),
            "{d:?}"
        );
        let free = Pacer { rate: None, ..p };
        assert!(free.wait(1 << 40).is_none());
    }
}
