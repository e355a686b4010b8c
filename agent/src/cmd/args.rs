//! The agent's flags, shared by `gpulse-agent` and `gpulse agent`: every flag
//! also reads a `GPULSE_*` environment variable.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use crate::replay::ReplaySpeed;

/// `gpulse-agent`: the per-node agent as a binary of its own.
#[derive(Debug, Parser)]
#[command(
    name = "gpulse-agent",
    version,
    about = "gpulse node agent: samples NVML (or a simulated fleet) and streams it to ingest over gRPC"
)]
pub struct AgentCli {
    #[command(flatten)]
    pub args: AgentArgs,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Ingest endpoint. With --sharded: seed nodes of the cluster,
    /// comma-separated.
    #[arg(
        long,
        env = "GPULSE_INGEST_URL",
        default_value = "grpc://127.0.0.1:7400"
    )]
    pub ingest: String,
    /// Cluster mode: ask a node of --ingest (each in turn) which nodes own
    /// this host's shard (its rack), and deliver every batch to each of them,
    /// with a memory buffer and a spool (a subdirectory of --spool-dir) per
    /// owner. The owners are asked again as the nodes direct.
    #[arg(long, env = "GPULSE_SHARDED")]
    pub sharded: bool,
    /// Use the simulated GPU source even if NVML is available.
    #[arg(long)]
    pub simulate: bool,
    /// GPUs of the simulated source.
    #[arg(long, env = "GPULSE_SIM_GPUS", default_value_t = 8)]
    pub gpus: u32,
    /// Seed of the simulated source.
    #[arg(long, env = "GPULSE_SIM_SEED", default_value_t = 1)]
    pub seed: u64,
    /// Time between polls, e.g. 1s or 100ms.
    #[arg(long, env = "GPULSE_INTERVAL", default_value = "1s", value_parser = duration)]
    pub interval: Duration,
    /// Host name reported as the Hostname label (default: the OS host name).
    #[arg(long, env = "GPULSE_HOST")]
    pub host: Option<String>,
    #[arg(long, env = "GPULSE_CLUSTER", default_value = "")]
    pub cluster: String,
    #[arg(long, env = "GPULSE_ROW", default_value = "")]
    pub row: String,
    #[arg(long, env = "GPULSE_RACK", default_value = "")]
    pub rack: String,
    /// Stop after this many polls (default: run until interrupted).
    #[arg(long)]
    pub polls: Option<u64>,
    /// TOML file with any of these options (keys are the flag names with `_`);
    /// flags and GPULSE_* variables win over it.
    #[arg(long, env = "GPULSE_CONFIG")]
    pub config: Option<PathBuf>,
    /// A file holding the token (write scope) to send, for nodes started
    /// with `--auth-file`.
    #[arg(long, env = "GPULSE_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// TLS to the node: the CA certificate (PEM) that signed the node's
    /// certificate. The ingest URL may then be grpcs:// (or grpc://).
    #[arg(long, env = "GPULSE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This agent's certificate (PEM), for a node that requires one (mTLS):
    /// it must name this host (a DNS subject alternative name).
    #[arg(
        long,
        env = "GPULSE_TLS_CERT",
        requires = "tls_key",
        requires = "tls_ca"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "GPULSE_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The name the node's certificate must hold (default: the URL's host).
    #[arg(long, env = "GPULSE_TLS_SERVER_NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
    /// Agent identity for de-duplication at ingest (default: the host name).
    #[arg(long, env = "GPULSE_AGENT_ID")]
    pub agent_id: Option<String>,
    /// CSV of `host,cluster,row,rack`; the agent takes its own host's line.
    #[arg(long, env = "GPULSE_TOPOLOGY_FILE")]
    pub topology_file: Option<PathBuf>,
    /// Directory of the disk spool, which keeps unacked batches across
    /// restarts and outages longer than the memory buffer holds.
    #[arg(long, env = "GPULSE_SPOOL_DIR", default_value = "./gpulse-agent-spool")]
    pub spool_dir: PathBuf,
    /// Keep unacked batches in memory only (lost on restart).
    #[arg(long, env = "GPULSE_NO_SPOOL")]
    pub no_spool: bool,
    /// Unacked samples held in memory before the oldest go to the spool.
    #[arg(long, env = "GPULSE_BUFFER_SAMPLES", default_value_t = 131_072)]
    pub buffer_samples: usize,
    /// Largest spool; when full, its oldest batches are dropped and counted.
    #[arg(long, env = "GPULSE_SPOOL_MAX_BYTES", default_value = "1GiB", value_parser = parse_size)]
    pub spool_max_bytes: u64,
    /// Address of the agent's /metrics endpoint (Prometheus text), or `off`.
    #[arg(long, env = "GPULSE_METRICS_LISTEN", default_value = "127.0.0.1:9401")]
    pub metrics_listen: String,
    /// How long shutdown waits for acks before spooling what is left.
    #[arg(long, env = "GPULSE_DRAIN_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// Append every sample produced to this file, in the CSV format of
    /// `gpulse import` (a trace to keep or replay).
    #[arg(long, env = "GPULSE_RECORD")]
    pub record: Option<PathBuf>,
    /// Inject faults into the simulated source (implies --simulate): thermal
    /// throttling, graded stragglers, degraded clocks, XID 79, XID 48,
    /// row-remap growth and zombie GPUs (frozen or hung), about one per GPU
    /// per hour, and a 2 % chance that the node runs a drifted driver; on a
    /// schedule seeded by --seed.
    #[arg(long, env = "GPULSE_SIM_FAULTS")]
    pub sim_faults: bool,
    /// At shutdown, write the faults --sim-faults injected to FILE (CSV for
    /// a .csv name, JSON Lines otherwise), to score health detection.
    #[arg(
        long,
        env = "GPULSE_GROUND_TRUTH",
        value_name = "FILE",
        requires = "sim_faults"
    )]
    pub ground_truth: Option<PathBuf>,
    /// Stream a recorded long-format CSV (the `gpulse import` format)
    /// instead of sampling GPUs; stops at the end of the file. Polls follow
    /// the recording's timestamps (--interval is not used).
    #[arg(long, env = "GPULSE_REPLAY", value_name = "FILE", conflicts_with_all = ["simulate", "sim_faults"])]
    pub replay: Option<PathBuf>,
    /// Pace of --replay: `recorded`, `max` (as fast as ingest acks), or a
    /// speed-up such as `10x`.
    #[arg(long, default_value = "recorded", value_parser = replay_speed)]
    pub replay_speed: ReplaySpeed,
    /// Timestamps of --replay: `shift` moves the whole recording so that its
    /// first poll is now (storage drops samples older than a series' newest
    /// by more than --ooo-window, and duplicates); `recorded` keeps them.
    #[arg(long, value_enum, default_value = "shift")]
    pub replay_timestamps: ReplayTimestampsArg,
    /// With --replay: only the rows of this host (`Hostname` or `host`
    /// label); required when the file has several hosts.
    #[arg(long)]
    pub replay_host: Option<String>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ReplayTimestampsArg {
    Shift,
    Recorded,
}

fn replay_speed(s: &str) -> Result<ReplaySpeed, String> {
    match s {
        "recorded" => Ok(ReplaySpeed::Scaled(1.0)),
        "max" => Ok(ReplaySpeed::Max),
        _ => {
            let factor: f64 =
                s.strip_suffix('x').unwrap_or(s).parse().map_err(|_| {
                    format!("expected recorded, max or a factor like 10x; found {s:?}")
                })?;
            if !(factor.is_finite() && factor > 0.0) {
                return Err(format!("the factor must be positive; found {s:?}"));
            }
            Ok(ReplaySpeed::Scaled(factor))
        }
    }
}

/// A duration such as `1s` or `250ms`; zero is refused.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    duration(s)
}

/// A byte size: a number with an optional KiB/MiB/GiB (or K/M/G) suffix.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512MiB)"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "K" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        u => return Err(format!("unknown size unit {u:?} (use B, KiB, MiB or GiB)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

fn duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| e.to_string())?;
    if d.is_zero() {
        return Err("must be greater than zero".into());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(argv: &[&str]) -> Result<AgentArgs, clap::Error> {
        AgentCli::try_parse_from(argv).map(|c| c.args)
    }

    #[test]
    fn replay_speeds() {
        assert_eq!(replay_speed("recorded"), Ok(ReplaySpeed::Scaled(1.0)));
        assert_eq!(replay_speed("max"), Ok(ReplaySpeed::Max));
        assert_eq!(replay_speed("10x"), Ok(ReplaySpeed::Scaled(10.0)));
        assert_eq!(replay_speed("0.5"), Ok(ReplaySpeed::Scaled(0.5)));
        assert!(replay_speed("0x").is_err());
        assert!(replay_speed("fast").is_err());
    }

    #[test]
    fn agent_flags() {
        let a = parse(&["gpulse-agent", "--sim-faults", "--ground-truth", "t.csv"]).unwrap();
        assert!(a.sim_faults && a.ground_truth.is_some() && a.replay.is_none());
        // --ground-truth only makes sense with injected faults.
        assert!(parse(&["gpulse-agent", "--ground-truth", "t.csv"]).is_err());
        assert!(parse(&["gpulse-agent", "--replay", "r.csv", "--simulate"]).is_err());
        let a = parse(&[
            "gpulse-agent",
            "--replay",
            "r.csv",
            "--replay-speed",
            "max",
            "--replay-timestamps",
            "recorded",
        ])
        .unwrap();
        assert_eq!(a.replay_speed, ReplaySpeed::Max);
        assert!(matches!(a.replay_timestamps, ReplayTimestampsArg::Recorded));
        assert!(parse(&["gpulse-agent", "--interval", "0s"]).is_err());
    }
}
