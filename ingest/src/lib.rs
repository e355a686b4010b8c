//! gpulse ingest: the gRPC server that accepts agent streams
//! (`gpulse.v1.Ingest/Stream`) and appends their batches to [`storage`].
//!
//! Per stream: the first message must be a hello (host and topology); each
//! series definition is checked against the limits in [`IngestConfig`] and
//! resolved to a storage series once, with `Hostname`, `cluster`, `row` and
//! `rack` attached from the hello; each batch is validated as a whole, appended,
//! and answered with an ack (stored) or a reject (invalid, not retryable). A bad
//! batch never closes the stream.

pub mod cluster;
mod service;

pub use service::{IngestMetrics, IngestService};

use std::future::Future;
use std::sync::Arc;

use gpulse_proto::v1::ingest_server::IngestServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

/// Limits on what one agent stream may send. Bad input beyond them is rejected
/// with a clear message and counted.
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Series one stream may define. Default 100,000.
    pub max_series_per_stream: usize,
    /// Labels per series definition, topology labels included. Default 32.
    pub max_labels: usize,
    /// Bytes in one label name or value (and in a metric name). Default 512.
    pub max_label_bytes: usize,
    /// Largest gRPC message accepted, in bytes. Default 16 MiB.
    pub max_message_bytes: usize,
}

impl Default for IngestConfig {
    fn default() -> Self {
        Self {
            max_series_per_stream: 100_000,
            max_labels: 32,
            max_label_bytes: 512,
            max_message_bytes: 16 << 20,
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
    let max = service.config().max_message_bytes;
    let stop = service.shutdown_handle();
    let shutdown = async move {
        shutdown.await;
        stop.send_replace(true);
    };
    tonic::transport::Server::builder()
        .add_service(IngestServer::new(service).max_decoding_message_size(max))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), shutdown)
        .await
}

/// Convenience for tests and the demo: the service over shared storage.
pub fn service(storage: Arc<storage::Storage>, config: IngestConfig) -> IngestService {
    IngestService::new(storage, config)
}
