//! The agent as a command: its flags ([`AgentArgs`]), its TOML configuration
//! file and topology file, and the run itself with `/metrics`. The
//! `gpulse-agent` binary is this module behind a `main`; `gpulse agent` is the
//! same command inside the node binary.

mod args;
// A command: what its user asked for (endpoints, the end-of-run summary) goes
// to stdout, as in the gpulse binary.
#[allow(clippy::print_stdout)]
mod run;

pub use args::{AgentArgs, AgentCli, ReplayTimestampsArg, parse_duration, parse_size};
pub use run::{run_agent, shutdown_signal, sim_config};

/// Tokio worker threads of the agent: its async work is one gRPC stream (one
/// per owner in cluster mode) and `/metrics`, so two are plenty; one per core
/// (64 on a big GPU node) would only cost memory on a machine whose cores
/// belong to the jobs.
pub const WORKER_THREADS: usize = 2;
