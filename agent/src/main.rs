//! `gpulse-agent`: the per-node agent, a binary without the query engine.
//! It takes the same flags, `GPULSE_*` variables and configuration file as
//! `gpulse agent` (`gpulse-agent --help`).
//!
//! Logs go to stderr (`RUST_LOG` sets the filter, default `info`).

use std::process::ExitCode;

use agent::cmd::{AgentCli, WORKER_THREADS, run_agent};
use clap::{CommandFactory, FromArgMatches};

fn main() -> ExitCode {
    let matches = AgentCli::command().get_matches();
    let cli = AgentCli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    agent::cmd::init_logging();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKER_THREADS)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run_agent(cli.args, Some(&matches))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line.
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
