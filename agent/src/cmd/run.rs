//! The agent command (`gpulse-agent`, and `gpulse agent`): configuration (flags, `GPULSE_*` environment, an optional
//! TOML file, a topology file) and the run itself, with `/metrics`.
//!
//! Precedence, highest first: a flag, its environment variable, the TOML
//! file, the default. The TOML keys are the long flag names with `_` for `-`:
//!
//! ```toml
//! ingest = "grpc://ingest-1:7400"
//! # cluster mode: ingest lists seed nodes, comma-separated
//! # sharded = true
//! interval = "1s"
//! cluster = "c1"
//! topology_file = "/etc/gpulse/topology.csv"
//! spool_dir = "/var/lib/gpulse-agent"
//! metrics_listen = "0.0.0.0:9401"
//! ```
//!
//! The topology file maps hosts to their place in the fleet, one per line:
//! `host,cluster,row,rack` (a header line naming those columns is allowed).
//! The agent looks up its own host; flags and variables for cluster, row and
//! rack win over the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::replay::{ReplayConfig, ReplayOptions, ReplaySource, ReplayTimestamps};
use crate::sim::{FaultConfig, GroundTruth, GroundTruthFormat, SimConfig, SimulatedSource};
use crate::{AgentConfig, AgentMetrics, AgentReport, GpuSource, Reading, SourceError, Topology};
use anyhow::{Context, bail};
use clap::ArgMatches;
use clap::parser::ValueSource;
use serde::Deserialize;
use tracing::{info, warn};

use super::args::{AgentArgs, ReplayTimestampsArg, parse_duration, parse_size};

/// The TOML configuration file; every key is optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentFile {
    ingest: Option<String>,
    sharded: Option<bool>,
    agent_id: Option<String>,
    host: Option<String>,
    cluster: Option<String>,
    row: Option<String>,
    rack: Option<String>,
    topology_file: Option<PathBuf>,
    interval: Option<String>,
    simulate: Option<bool>,
    gpus: Option<u32>,
    seed: Option<u64>,
    spool_dir: Option<PathBuf>,
    no_spool: Option<bool>,
    buffer_samples: Option<usize>,
    spool_max_bytes: Option<String>,
    metrics_listen: Option<String>,
    drain_timeout: Option<String>,
    record: Option<PathBuf>,
    token_file: Option<PathBuf>,
    tls_ca: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_server_name: Option<String>,
}

/// Fills every argument not given by flag or environment from `file`.
pub(crate) fn apply_file(
    args: &mut AgentArgs,
    matches: &ArgMatches,
    file: AgentFile,
) -> anyhow::Result<()> {
    // True when the user did not set `id` by flag or environment.
    let unset = |id: &str| {
        !matches!(
            matches.value_source(id),
            Some(ValueSource::CommandLine | ValueSource::EnvVariable)
        )
    };
    macro_rules! take {
        ($field:ident) => {
            if let Some(v) = file.$field
                && unset(stringify!($field))
            {
                args.$field = v.into();
            }
        };
        ($field:ident, $parse:expr) => {
            if let Some(v) = file.$field
                && unset(stringify!($field))
            {
                args.$field = $parse(&v)
                    .map_err(|e| anyhow::anyhow!("config: {} = {v:?}: {e}", stringify!($field)))?;
            }
        };
    }
    take!(ingest);
    take!(sharded);
    take!(agent_id);
    take!(host);
    take!(cluster);
    take!(row);
    take!(rack);
    take!(topology_file);
    take!(interval, parse_duration);
    take!(simulate);
    take!(gpus);
    take!(seed);
    take!(spool_dir);
    take!(no_spool);
    take!(buffer_samples);
    take!(spool_max_bytes, parse_size);
    take!(metrics_listen, |s: &str| Ok::<_, String>(s.to_string()));
    take!(drain_timeout, parse_duration);
    take!(record);
    macro_rules! take_option {
        ($field:ident) => {
            if let Some(v) = file.$field
                && unset(stringify!($field))
            {
                args.$field = Some(v);
            }
        };
    }
    take_option!(token_file);
    take_option!(tls_ca);
    take_option!(tls_cert);
    take_option!(tls_key);
    take_option!(tls_server_name);
    Ok(())
}

/// Reads a token from `path`: its one line, without surrounding space.
///
/// # Errors
/// The file cannot be read, is empty, or holds more than one line.
pub fn read_token_file(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        bail!(
            "the token file {} must hold one token (from `gpulse token create`)",
            path.display()
        );
    }
    Ok(token.to_owned())
}

/// Reads and parses the TOML file.
pub(crate) fn read_file(path: &Path) -> anyhow::Result<AgentFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Looks `host` up in a topology file (`host,cluster,row,rack`).
pub(crate) fn topology_for(path: &Path, host: &str) -> anyhow::Result<Option<Topology>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split(',').map(str::trim).collect();
        if fields.len() != 4 {
            bail!(
                "{}:{}: expected host,cluster,row,rack, found {} fields",
                path.display(),
                n + 1,
                fields.len()
            );
        }
        if n == 0 && fields == ["host", "cluster", "row", "rack"] {
            continue;
        }
        if fields[0] == host {
            return Ok(Some(Topology {
                cluster: fields[1].into(),
                row: fields[2].into(),
                rack: fields[3].into(),
            }));
        }
    }
    Ok(None)
}

/// The agent's configuration from its (merged) arguments.
pub(crate) fn agent_config(args: &AgentArgs) -> anyhow::Result<AgentConfig> {
    let mut config = AgentConfig::new(&args.ingest);
    config.sharded = args.sharded;
    if let Some(h) = &args.host {
        config.host = h.clone();
    }
    config.agent_id = args.agent_id.clone().unwrap_or_else(|| config.host.clone());
    let mut topology = match &args.topology_file {
        Some(path) => match topology_for(path, &config.host)? {
            Some(t) => t,
            None => {
                warn!(file = %path.display(), host = %config.host, "host not in the topology file");
                Topology::default()
            }
        },
        None => Topology::default(),
    };
    for (flag, dst) in [
        (&args.cluster, &mut topology.cluster),
        (&args.row, &mut topology.row),
        (&args.rack, &mut topology.rack),
    ] {
        if !flag.is_empty() {
            *dst = flag.clone();
        }
    }
    config.topology = topology;
    config.interval = args.interval;
    config.max_polls = args.polls;
    config.drain_timeout = args.drain_timeout;
    config.buffer.memory_samples = args.buffer_samples;
    config.buffer.spool_max_bytes = args.spool_max_bytes;
    config.buffer.spool_dir = (!args.no_spool).then(|| args.spool_dir.clone());
    config.record = args.record.clone();
    config.token = args
        .token_file
        .as_deref()
        .map(read_token_file)
        .transpose()?;
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    config.tls = match &args.tls_ca {
        Some(ca) => Some(crate::shipper::ClientTls {
            ca_pem: read(ca)?,
            identity: match (&args.tls_cert, &args.tls_key) {
                (Some(c), Some(k)) => Some((read(c)?, read(k)?)),
                _ => None,
            },
            server_name: args.tls_server_name.clone(),
        }),
        None if args.ingest.contains("grpcs://") => {
            bail!("a grpcs:// ingest URL needs --tls-ca: the CA that signed the node's certificate")
        }
        None => None,
    };
    Ok(config)
}

/// `off` (or empty) disables the endpoint.
fn metrics_addr(s: &str) -> anyhow::Result<Option<SocketAddr>> {
    if s.is_empty() || s == "off" {
        return Ok(None);
    }
    s.parse()
        .map(Some)
        .with_context(|| format!("--metrics-listen {s:?}: expected host:port or off"))
}

pub async fn run_agent(mut args: AgentArgs, matches: Option<&ArgMatches>) -> anyhow::Result<()> {
    if let Some(path) = args.config.clone() {
        let file = read_file(&path)?;
        if let Some(m) = matches {
            apply_file(&mut args, m, file)?;
        }
    }
    let config = agent_config(&args)?;
    let metrics_listen = metrics_addr(&args.metrics_listen)?;
    let metrics = Arc::new(AgentMetrics::default());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let metrics_task = match metrics_listen {
        Some(addr) => {
            let listener = crate::metrics::bind(addr)
                .await
                .with_context(|| format!("binding the metrics listener {addr}"))?;
            let local = listener.local_addr()?;
            info!(addr = %local, "serving agent metrics on /metrics");
            println!("agent metrics  http://{local}/metrics");
            let mut stop = stop_rx.clone();
            let m = metrics.clone();
            Some(tokio::spawn(crate::metrics::serve(
                listener,
                m,
                async move {
                    let _ = stop.wait_for(|s| *s).await;
                },
            )))
        }
        None => None,
    };
    let result = match args.replay.clone() {
        Some(path) => replay(&args, &path, config, metrics).await,
        None => sample(&args, config, metrics).await,
    };
    stop_tx.send_replace(true);
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    let report = result?;
    let s = report.shipper;
    info!(
        polls = report.polls,
        samples_acked = s.samples_acked,
        batches_duplicate = s.batches_duplicate,
        samples_dropped = s.samples_dropped,
        unacked = s.batches_unacked,
        "agent done"
    );
    if s.batches_unacked > 0 && args.no_spool {
        bail!(
            "{} batches were not acknowledged before shutdown and there is no spool to keep them",
            s.batches_unacked
        );
    }
    if s.batches_unacked > 0 {
        println!(
            "{} unacked batches kept in the spool {}; the next run sends them",
            s.batches_unacked,
            args.spool_dir.display()
        );
    }
    Ok(())
}

/// The simulated source's configuration from the agent's flags.
pub fn sim_config(args: &AgentArgs) -> SimConfig {
    let mut c = SimConfig::new(args.seed, args.gpus);
    c.interval_ms = args.interval.as_millis() as u64;
    if args.sim_faults {
        c.faults = FaultConfig::typical();
    }
    c
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("BUG: installing a SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Samples the live source (NVML, else the simulator) until shutdown.
async fn sample(
    args: &AgentArgs,
    config: AgentConfig,
    metrics: Arc<AgentMetrics>,
) -> anyhow::Result<AgentReport> {
    let mut ground_truth = None;
    let source: Box<dyn GpuSource> = if args.simulate || args.sim_faults {
        info!(
            faults = args.sim_faults,
            "simulated GPU source selected by --simulate or --sim-faults"
        );
        let sim = SimulatedSource::new(sim_config(args));
        match &args.ground_truth {
            Some(path) => {
                let clocked = Clocked::new(sim);
                ground_truth = Some((
                    path.clone(),
                    clocked.truth.clone(),
                    clocked.ticks_ms.clone(),
                ));
                Box::new(clocked)
            }
            None => Box::new(sim),
        }
    } else {
        match crate::nvml::NvmlSource::open() {
            Ok(s) => Box::new(s),
            Err(e) => {
                warn!(reason = %e, "NVML is not available; using the simulated GPU source");
                Box::new(SimulatedSource::new(sim_config(args)))
            }
        }
    };
    let report = crate::run_with_metrics(config, source, metrics, shutdown_signal()).await?;
    if let Some((path, truth, ticks_ms)) = ground_truth {
        let n = write_ground_truth(&path, &truth, &ticks_ms)?;
        info!(path = %path.display(), faults = n, "ground truth written");
    }
    Ok(report)
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The simulator plus the wall-clock time of each of its ticks, so that the
/// ground truth can carry timestamps; the simulator itself never reads the
/// clock. A tick's time is taken just after the agent stamps the poll, so
/// the two agree to within a millisecond or so.
struct Clocked {
    inner: SimulatedSource,
    truth: GroundTruth,
    ticks_ms: Arc<Mutex<Vec<i64>>>,
}

impl Clocked {
    fn new(inner: SimulatedSource) -> Self {
        Self {
            truth: inner.ground_truth(),
            inner,
            ticks_ms: Arc::default(),
        }
    }
}

impl GpuSource for Clocked {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn inventory(&self) -> &[crate::GpuInfo] {
        self.inner.inventory()
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        self.ticks_ms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(now_ms());
        self.inner.sample(out)
    }
}

/// Writes the injected faults, stamped with their ticks' times; returns how many.
fn write_ground_truth(
    path: &Path,
    truth: &GroundTruth,
    ticks_ms: &Mutex<Vec<i64>>,
) -> anyhow::Result<usize> {
    let ticks = ticks_ms.lock().unwrap_or_else(|p| p.into_inner());
    let mut events = truth.events();
    for e in &mut events {
        e.stamp(|t| ticks.get(t as usize).copied());
    }
    let f = std::fs::File::create(path)
        .with_context(|| format!("creating the ground-truth file {}", path.display()))?;
    crate::sim::write_ground_truth(
        &events,
        GroundTruthFormat::for_path(path),
        std::io::BufWriter::new(f),
    )
    .with_context(|| format!("writing the ground-truth file {}", path.display()))?;
    Ok(events.len())
}

async fn replay(
    args: &AgentArgs,
    path: &Path,
    mut config: AgentConfig,
    metrics: Arc<AgentMetrics>,
) -> anyhow::Result<AgentReport> {
    let mut rc = ReplayConfig::new(path);
    rc.host = args.replay_host.clone();
    let source = tokio::task::spawn_blocking(move || ReplaySource::open(&rc)).await??;
    if args.host.is_none()
        && let Some(h) = source.host()
    {
        // The recording's host, not this machine's.
        config.host = h.to_string();
        config.agent_id = h.to_string();
    }
    let options = ReplayOptions {
        speed: args.replay_speed,
        timestamps: match args.replay_timestamps {
            ReplayTimestampsArg::Shift => ReplayTimestamps::Shift,
            ReplayTimestampsArg::Recorded => ReplayTimestamps::Recorded,
        },
        max_future: crate::replay::DEFAULT_MAX_FUTURE,
    };
    let report = crate::replay::run(config, source, options, metrics, shutdown_signal()).await?;
    let st = &report.stats;
    println!(
        "replayed {} polls, {} readings from {} rows; skipped {} rows of metrics not in the catalog, {} without a GPU, {} of other hosts, {} bad",
        st.polls,
        st.readings,
        st.rows,
        st.unknown_metric_rows(),
        st.no_gpu,
        st.other_host,
        st.bad_rows
    );
    if let Some(e) = report.error {
        bail!("the replay stopped early: {e}");
    }
    Ok(report.agent)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cmd::AgentCli;
    use clap::{CommandFactory, FromArgMatches};

    fn parse(argv: &[&str], toml_text: &str) -> anyhow::Result<AgentArgs> {
        let matches = AgentCli::command().try_get_matches_from(argv)?;
        let mut args = AgentCli::from_arg_matches(&matches)?.args;
        let file: AgentFile = toml::from_str(toml_text)?;
        apply_file(&mut args, &matches, file)?;
        Ok(args)
    }

    #[test]
    fn a_flag_beats_the_file_and_the_file_beats_the_default() {
        let args = parse(
            &["gpulse-agent", "--interval", "250ms"],
            "interval = \"5s\"\nrack = \"r7\"\nspool_max_bytes = \"2MiB\"\nbuffer_samples = 10",
        )
        .unwrap();
        assert_eq!(args.interval, std::time::Duration::from_millis(250));
        assert_eq!(args.rack, "r7");
        assert_eq!(args.spool_max_bytes, 2 << 20);
        assert_eq!(args.buffer_samples, 10);
        assert_eq!(args.ingest, "grpc://127.0.0.1:7400");
    }

    #[test]
    fn cluster_mode_takes_seed_nodes() {
        let args = parse(
            &[
                "gpulse-agent",
                "--sharded",
                "--ingest",
                "grpc://n1:7400,grpc://n2:7400",
            ],
            "",
        )
        .unwrap();
        let c = agent_config(&args).unwrap();
        assert!(c.sharded);
        assert_eq!(c.ingest_url, "grpc://n1:7400,grpc://n2:7400");
        // Off by default; the file can turn it on.
        assert!(
            !agent_config(&parse(&["gpulse-agent"], "").unwrap())
                .unwrap()
                .sharded
        );
        let file = parse(&["gpulse-agent"], "sharded = true").unwrap();
        assert!(agent_config(&file).unwrap().sharded);
    }

    #[test]
    fn bad_config_files_are_clear_errors() {
        let unknown = parse(&["gpulse-agent"], "intervall = \"1s\"").unwrap_err();
        assert!(unknown.to_string().contains("intervall"), "{unknown}");
        let bad = parse(&["gpulse-agent"], "interval = \"soon\"").unwrap_err();
        assert!(bad.to_string().contains("config: interval"), "{bad}");
    }

    #[test]
    fn topology_file_lookup() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("topo.csv");
        std::fs::write(
            &path,
            "host,cluster,row,rack\n# comment\nnode-1, c1, row-a, rack-3\nnode-2,c1,row-b,rack-9\n",
        )
        .unwrap();
        let t = topology_for(&path, "node-2").unwrap().unwrap();
        assert_eq!(
            (t.cluster.as_str(), t.row.as_str(), t.rack.as_str()),
            ("c1", "row-b", "rack-9")
        );
        assert_eq!(topology_for(&path, "node-3").unwrap(), None);
        std::fs::write(&path, "node-1,c1,row-a\n").unwrap();
        let err = topology_for(&path, "node-1").unwrap_err().to_string();
        assert!(err.contains(":1: expected host,cluster,row,rack"), "{err}");

        // A flag overrides the file's field; the file fills the rest.
        std::fs::write(&path, "node-1,c1,row-a,rack-3\n").unwrap();
        let mut args = parse(
            &["gpulse-agent", "--host", "node-1", "--rack", "rack-X"],
            "",
        )
        .unwrap();
        args.topology_file = Some(path);
        let c = agent_config(&args).unwrap();
        assert_eq!(c.topology.row, "row-a");
        assert_eq!(c.topology.rack, "rack-X");
    }
}
