//! End-to-end tests: each module is a scenario that starts real `gpulse`
//! processes on 127.0.0.1 and talks to them over gRPC, HTTP and the
//! PostgreSQL protocol (through the real `psql`).

mod bench;
mod cluster;
mod crash;
mod delivery;
mod edges;
mod health;
mod hostile;
mod ingest_protocol;
mod inventory;
mod pg;
mod promql;
mod readonly;
mod remote;
mod replay;
mod security;
mod support;
mod ui;
mod write_path;
