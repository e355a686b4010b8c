//! gpulse ingest: the write paths. The gRPC server that accepts agent
//! streams (`gpulse.v1.Ingest/Stream`), and Prometheus remote write
//! ([`remote_write`]), append to [`storage`] under the same limits
//! ([`WriteLimits`]) and answer storage errors the same way ([`WriteError`]).
//!
//! Per stream: the first message must be a hello (host and topology); each
//! series definition is checked against the limits in [`IngestConfig`] and
//! resolved to a storage series once, with `Hostname`, `cluster`, `row` and
//! `rack` attached from the hello; each batch is validated as a whole, appended,
//! and answered with an ack (stored) or a reject (invalid, not retryable). A bad
//! batch never closes the stream.

pub mod remote_write;
mod service;

pub use service::{IngestMetrics, IngestService};

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use gpulse_proto::v1::ingest_server::IngestServer;
use storage::admission::{LabelLimits, SampleWindow};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// What every written series and sample must satisfy, whichever path it
/// comes by (see [`storage::admission`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteLimits {
    /// Labels per series (topology labels included) and bytes per name or
    /// value (`--max-labels`, `--max-label-bytes`, default 32 and 512). On
    /// gRPC they also bound the hello's host, topology and `agent_id`.
    pub labels: LabelLimits,
    /// Sample timestamps admitted (`--retention`, `--max-future`). A gRPC
    /// batch with one sample outside is rejected as a whole; remote write
    /// stores the rest of the request and answers 400.
    pub window: SampleWindow,
}

/// Why a write (a gRPC batch, a remote-write request) was not stored: the
/// one mapping of storage errors to answers on both paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteError {
    /// The input is wrong, and sending it again cannot succeed. gRPC: the
    /// batch is rejected (`Reject`), the stream goes on; HTTP: 400.
    Invalid(String),
    /// Storage cannot take it now (I/O, a series evicted midway); the
    /// sender keeps it and retries. gRPC: the stream ends `UNAVAILABLE` and
    /// the agent resends from its spool; HTTP: 503.
    Unavailable(String),
}

impl From<storage::Error> for WriteError {
    fn from(e: storage::Error) -> Self {
        if e.is_retryable() {
            WriteError::Unavailable(format!("storage unavailable: {e}"))
        } else {
            WriteError::Invalid(e.to_string())
        }
    }
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Invalid(m) | WriteError::Unavailable(m) => f.write_str(m),
        }
    }
}

/// Limits on what one agent stream may send. Bad input beyond them is rejected
/// with a clear message and counted.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Series one stream may define. Default 100,000.
    pub max_series_per_stream: usize,
    /// Labels and sample times: those of remote write.
    pub limits: WriteLimits,
    /// Largest gRPC message accepted, in bytes. Default 16 MiB.
    pub max_message_bytes: usize,
    /// How long a new stream may take to send its hello before it is closed
    /// with `DEADLINE_EXCEEDED` (`--grpc-hello-timeout`). Default 10 s.
    pub hello_timeout: Duration,
    /// Concurrent streams (requests) per HTTP/2 connection
    /// (`--grpc-max-streams-per-connection`). Default 16: an agent opens one.
    pub max_streams_per_connection: u32,
    /// Agent streams open at once on the node (`--grpc-max-streams`); one
    /// more is refused with `RESOURCE_EXHAUSTED`. Default 10,000.
    pub max_streams: u64,
    /// HTTP/2 keepalive: a PING after this long without frames; the
    /// connection is closed when its answer takes more than 20 s. Default 30 s.
    pub keepalive_interval: Duration,
    /// `--auth-file`: every call needs a token with the write scope (agents'
    /// streams and `Owners`, and peers' `NodeStatus`). `None`: open.
    pub auth: Option<Arc<auth::Gate>>,
    /// `--tls-cert`: TLS on the listener; with a client CA, agents present
    /// certificates and speak only for the hosts they name.
    pub tls: Option<Arc<auth::tls::ServerTls>>,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_series_per_stream: 100_000,
            limits: WriteLimits::default(),
            max_message_bytes: 16 << 20,
            hello_timeout: Duration::from_secs(10),
            max_streams_per_connection: 16,
            max_streams: 10_000,
            keepalive_interval: Duration::from_secs(30),
            auth: None,
            tls: None,
        }
    }
}

/// Serves the ingest gRPC service on `listener` until `shutdown` resolves;
/// open streams are then told to end.
///
/// # Errors
/// Transport errors of the gRPC server.
pub async fn serve(
    listener: TcpListener,
    service: IngestService,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let config = service.config().clone();
    let max = config.max_message_bytes;
    let stop = service.shutdown_handle();
    let shutdown = async move {
        shutdown.await;
        stop.send_replace(true);
    };
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(config.max_streams_per_connection)
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(tonic::service::interceptor::InterceptedService::new(
            IngestServer::new(service).max_decoding_message_size(max),
            auth::interceptor(config.auth, auth::Surface::Grpc, auth::Scope::Write),
        ));
    match config.tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(
                    tls.incoming(listener, auth::tls::Listener::Grpc),
                    shutdown,
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(
                    // As the TLS path does: no reply waits on a delayed ACK.
                    TcpListenerStream::new(listener).map_ok(|s| {
                        let _ = s.set_nodelay(true);
                        s
                    }),
                    shutdown,
                )
                .await
        }
    }
}

/// Convenience for tests and the demo: the service over shared storage.
pub fn service(storage: Arc<storage::Storage>, config: IngestConfig) -> IngestService {
    IngestService::new(storage, config)
}
