//! Wire types of gpulse, generated from `proto/gpulse/v1/*.proto`.
//!
//! Generated code only, no logic. `v1` is the agent -> ingest protocol; see
//! `proto/gpulse/v1/ingest.proto` for the stream's contract. `prometheus` is
//! Prometheus's remote read and write protocol.

#![allow(unreachable_pub, missing_debug_implementations, clippy::all)]

/// `gpulse.v1`: agent -> ingest streaming protocol.
pub mod v1 {
    tonic::include_proto!("gpulse.v1");
}

/// `prometheus`: the remote write 1.0 and remote read messages (`prompb`).
pub mod prometheus {
    tonic::include_proto!("prometheus");
}
