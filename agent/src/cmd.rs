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
pub use run::{read_token_file, run_agent, shutdown_signal, sim_config};

/// Logs to stderr, filtered by `RUST_LOG` (default `info`): the setup of both
/// binaries, `gpulse` and `gpulse-agent`.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// Tokio worker threads of the agent: its async work is one gRPC stream (one
/// per owner in cluster mode) and `/metrics`, so two are plenty; one per core
/// (64 on a big GPU node) would only cost memory on a machine whose cores
/// belong to the jobs.
pub const WORKER_THREADS: usize = 2;
