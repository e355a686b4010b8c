//! Wire types of gpulse, generated from `proto/gpulse/v1/*.proto`.
//!
//! Generated code, and the snappy framing of Prometheus bodies
//! ([`prometheus_body`]). `v1` is the agent -> ingest protocol; see
//! `proto/gpulse/v1/ingest.proto` for the stream's contract. `prometheus` is
//! Prometheus's remote read and write protocol.

pub mod prometheus_body;

/// `gpulse.v1`: agent -> ingest streaming protocol.
#[allow(unreachable_pub, missing_debug_implementations, clippy::all)]
pub mod v1 {
    tonic::include_proto!("gpulse.v1");
}

/// `prometheus`: the remote write 1.0 and remote read messages (`prompb`).
#[allow(unreachable_pub, missing_debug_implementations, clippy::all)]
pub mod prometheus {
    tonic::include_proto!("prometheus");
}
