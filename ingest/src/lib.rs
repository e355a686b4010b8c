//! gpulse ingest: the gRPC server that accepts agent streams
//! (`gpulse.v1.Ingest/Stream`) and appends their batches to [`storage`].
//!
//! Per stream: the first message must be a hello (host and topology); each
//! series definition is checked against the limits in [`IngestConfig`] and
//! resolved to a storage series once, with `Hostname`, `cluster`, `row` and
//! `rack` attached from the hello; each batch is validated as a whole, appended,
//! and answered with an ack (stored) or a reject (invalid, not retryable). A bad
//! batch never closes the stream.

mod service;

pub use service::{IngestMetrics, IngestService};

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use gpulse_proto::v1::ingest_server::IngestServer;
use storage::admission::{LabelLimits, SampleWindow};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// Limits on what one agent stream may send. Bad input beyond them is rejected
/// with a clear message and counted.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Series one stream may define. Default 100,000.
    pub max_series_per_stream: usize,
    /// Labels per series (topology labels included) and bytes per name or
    /// value: the limits remote write applies too (`--max-labels`,
    /// `--max-label-bytes`, default 32 and 512). They also bound the hello's
    /// host, topology and `agent_id`.
    pub labels: LabelLimits,
    /// Sample timestamps admitted (`--retention`, `--max-future`); a batch
    /// with one sample outside is rejected as a whole.
    pub window: SampleWindow,
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
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_series_per_stream: 100_000,
            labels: LabelLimits::default(),
            window: SampleWindow::default(),
            max_message_bytes: 16 << 20,
            hello_timeout: Duration::from_secs(10),
            max_streams_per_connection: 16,
            max_streams: 10_000,
            keepalive_interval: Duration::from_secs(30),
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
    tonic::transport::Server::builder()
        .max_concurrent_streams(config.max_streams_per_connection)
        .http2_keepalive_interval(Some(config.keepalive_interval))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .add_service(IngestServer::new(service).max_decoding_message_size(max))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
}

/// Convenience for tests and the demo: the service over shared storage.
pub fn service(storage: Arc<storage::Storage>, config: IngestConfig) -> IngestService {
    IngestService::new(storage, config)
}
