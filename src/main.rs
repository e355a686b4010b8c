//! The `gpulse` binary: `serve`, `agent`, `sql` and `demo`.
//!
//! Logs go to stderr (`RUST_LOG` sets the filter, default `info`); what a
//! user asked for (endpoints, query results) goes to stdout.

// A command-line program: printing to stdout is its job.
#![allow(clippy::print_stdout)]

mod access;
mod cli;
mod cluster;
mod fleet;
mod health;
mod import;
mod node_metrics;
mod server;
mod stats;

use std::io::Write;
use std::time::Duration;

use agent::sim::{SimConfig, SimulatedSource};
use agent::{AgentConfig, Topology};
use anyhow::{Context, bail};
use clap::{CommandFactory, FromArgMatches};
use tracing::{info, warn};

use agent::cmd::shutdown_signal;
use cli::{Cli, Command, DemoArgs, NodeArgs, OutputFormat, ServeArgs, SqlArgs};
use server::{ServeConfig, Server};

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line, without a backtrace.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    storage::malloc::tune();
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    agent::cmd::init_logging();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if matches!(cli.command, Command::Agent(_)) {
        builder.worker_threads(agent::cmd::WORKER_THREADS);
    }
    let rt = builder
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => serve(a).await,
            Command::Agent(a) => {
                agent::cmd::run_agent(*a, matches.subcommand_matches("agent")).await
            }
            Command::Sql(a) => sql(a).await,
            Command::Demo(a) => demo(a).await,
            Command::Import(a) => {
                let cli::ImportFormat::Csv = a.format;
                let (input, dir) = (a.input, a.data_dir);
                let r = tokio::task::spawn_blocking(move || import::import(&input, dir)).await??;
                println!(
                    "imported {} of {} rows into {} series ({} bad rows skipped, {} samples dropped as duplicates or older than the out-of-order window)",
                    r.imported, r.rows, r.series, r.bad_rows, r.dropped
                );
                if r.bad_rows > 0 {
                    bail!("{} bad rows were skipped (see the lines above)", r.bad_rows);
                }
                Ok(())
            }
            Command::Cluster(cli::ClusterCommand::Status(a)) => {
                let token = a
                    .token_file
                    .as_deref()
                    .map(agent::cmd::read_token_file)
                    .transpose()?;
                let tls = match (&a.tls_ca, &a.tls_cert, &a.tls_key) {
                    (Some(ca), Some(cert), Some(key)) => Some(peer_tls(ca, cert, key)?),
                    _ => None,
                };
                let lines =
                    cluster::status(&a.cluster, a.interval, token.as_deref(), tls.as_ref()).await?;
                if a.json {
                    println!("{}", serde_json::to_string_pretty(&lines)?);
                } else {
                    print!("{}", cluster::render_status(&lines));
                }
                Ok(())
            }
            Command::Token(cli::TokenCommand::Create(a)) => token_create(&a),
            Command::Stats(a) => {
                let s = stats::collect(&a.data_dir)?;
                print!("{}", stats::render(&a.data_dir, &s, a.by_metric));
                Ok(())
            }
        }
    })
}

pub(crate) fn serve_config(node: &NodeArgs) -> ServeConfig {
    let default = |a: &str| a.parse().expect("BUG: a default address parses");
    ServeConfig {
        data_dir: node.data_dir.clone(),
        alertmanager_url: node.alertmanager_url.clone(),
        grpc_listen: node
            .grpc_listen
            .unwrap_or_else(|| default(server::DEFAULT_GRPC_LISTEN)),
        http_listen: node
            .http_listen
            .unwrap_or_else(|| default(server::DEFAULT_HTTP_LISTEN)),
        cluster: None,
        auth: None,
        cluster_token: None,
        tls: None,
        peer_tls: None,
        pg_listen: node.pg_listen.0,
        limits: query::ResultLimits {
            max_rows: node.max_result_rows,
            max_bytes: node.max_result_bytes,
        },
        query: query::limits::QueryLimits {
            max_length: usize::try_from(node.max_query_length).unwrap_or(usize::MAX),
            max_depth: usize::try_from(node.max_query_depth).unwrap_or(usize::MAX),
            timeout: node.query_timeout,
            max_concurrent: usize::try_from(node.max_concurrent_queries).unwrap_or(usize::MAX),
            memory_limit: usize::try_from(node.query_memory_limit).unwrap_or(usize::MAX),
        },
        prom: query::promql::PromLimits {
            max_samples: usize::try_from(node.query_max_samples).unwrap_or(usize::MAX),
            ..query::promql::PromLimits::default()
        },
        max_series: usize::try_from(node.max_series).unwrap_or(usize::MAX),
        flush_interval: node.flush_interval,
        head_max_samples: (node.head_max_samples > 0).then_some(node.head_max_samples),
        compaction_window: node.compaction_window,
        retention: Some(node.retention),
        retention_1m: Some(node.retention_1m),
        retention_1h: Some(node.retention_1h),
        retention_1d: Some(node.retention_1d),
        ooo_window: node.ooo_window,
        edges: node.edge_limits(),
        wal_sync: if node.wal_fsync {
            storage::SyncPolicy::Fsync
        } else {
            storage::SyncPolicy::Os
        },
    }
}

fn print_endpoints(s: &Server, node: &NodeArgs, tls: bool) {
    let (grpc, http, ssl) = if tls {
        ("grpcs", "https", "?sslmode=verify-full")
    } else {
        ("grpc", "http", "")
    };
    println!("gpulse {} serving", env!("CARGO_PKG_VERSION"));
    println!("  ingest (gRPC)   {grpc}://{}", s.grpc_addr);
    println!(
        "  query (HTTP)    {http}://{}   (POST /api/v1/sql)",
        s.http_addr
    );
    println!("  fleet UI        {http}://{}", s.http_addr);
    if let Some(pg) = s.pg_addr {
        println!("  query (pg)      postgres://{pg}   (psql \"postgresql://{pg}/gpulse{ssl}\")");
    }
    println!("  data dir        {}", node.data_dir.display());
    if let Some(c) = &s.cluster {
        let map = c.map();
        println!(
            "  cluster         node {} of {} (replication factor {}, file hash {})",
            c.self_id(),
            map.nodes().len(),
            map.replication_factor(),
            map.hash()
        );
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let mut config = serve_config(&args.node);
    if let (Some(file), Some(id)) = (&args.cluster, &args.node_id) {
        config = cluster::configure(config, &args.node, file, id)?;
    }
    secure(&mut config, &args)?;
    let server = Server::start(&config).await?;
    print_endpoints(&server, &args.node, config.tls.is_some());
    println!("gpulse ready");
    std::io::stdout().flush()?;
    shutdown_signal().await;
    server.shutdown().await
}

/// Applies `--auth-file`, `--cluster-token-file`, the TLS files and
/// `--insecure`: loads the tokens and certificates, and refuses a
/// non-loopback listener unless TLS and tokens are both on, or `--insecure`
/// is given.
fn secure(config: &mut ServeConfig, args: &ServeArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.auth_file {
        let gate = auth::Gate::load(path)?;
        info!(file = %path.display(), tokens = ?gate.tokens(), "tokens required on every surface");
        config.auth = Some(std::sync::Arc::new(gate));
    }
    if let (Some(cert), Some(key)) = (&args.tls_cert, &args.tls_key) {
        if config.cluster.is_some() {
            let Some(ca) = &args.tls_ca else {
                bail!(
                    "--tls-cert with --cluster needs --tls-ca: the CA that signed the nodes' certificates, to check peers with"
                );
            };
            config.peer_tls = Some(peer_tls(ca, cert, key)?);
        }
        let tls = auth::tls::ServerTls::load(auth::tls::TlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: args.tls_client_ca.clone(),
        })
        .map_err(|e| anyhow::anyhow!(e))?;
        info!(cert = %cert.display(), agents_need_certificates = tls.mutual(), "TLS on every listener");
        config.tls = Some(std::sync::Arc::new(tls));
    }
    match (&args.cluster_token_file, &config.auth, &config.cluster) {
        (Some(path), Some(gate), Some(_)) => {
            let token = agent::cmd::read_token_file(path)?;
            for need in [auth::Scope::Read, auth::Scope::Write] {
                gate.tokens().authorize(&token, need).map_err(|d| {
                    anyhow::anyhow!(
                        "--cluster-token-file {}: {d}; peers need read and write with it",
                        path.display()
                    )
                })?;
            }
            config.cluster_token = Some(token);
        }
        (None, Some(_), Some(_)) => bail!(
            "--auth-file with --cluster needs --cluster-token-file: the token (read and write scopes) this node presents to its peers"
        ),
        (Some(_), None, _) => bail!("--cluster-token-file needs --auth-file"),
        _ => {}
    }
    let mut listeners = vec![("gRPC", config.grpc_listen), ("HTTP", config.http_listen)];
    listeners.extend(config.pg_listen.map(|a| ("PostgreSQL", a)));
    listeners.extend(
        config
            .cluster
            .as_ref()
            .map(|c| ("Arrow Flight", c.spec().flight)),
    );
    let open: Vec<String> = listeners
        .iter()
        .filter(|(_, a)| !a.ip().is_loopback())
        .map(|(what, a)| format!("{what} on {a}"))
        .collect();
    let (tls, tokens) = (config.tls.is_some(), config.auth.is_some());
    if open.is_empty() || (tls && tokens) {
        return Ok(());
    }
    if !args.insecure {
        let missing = match (tls, tokens) {
            (false, false) => "TLS (--tls-cert, --tls-key) and tokens (--auth-file)",
            (false, true) => "TLS (--tls-cert, --tls-key)",
            _ => "tokens (--auth-file)",
        };
        bail!(
            "refusing to listen beyond loopback ({}) without {missing}: data and credentials would be open to the network. \
             Give them, or --insecure (GPULSE_INSECURE=true) to serve a network you trust anyway",
            open.join(", ")
        );
    }
    warn!(
        listeners = %open.join(", "),
        tls,
        tokens,
        "--insecure: serving beyond loopback without TLS and tokens"
    );
    Ok(())
}

/// TLS to cluster nodes: their CA, and this certificate and key for nodes
/// that ask for one.
fn peer_tls(
    ca: &std::path::Path,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> anyhow::Result<::cluster::PeerTls> {
    let read =
        |p: &std::path::Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = ::cluster::PeerTls {
        ca_pem: read(ca)?,
        cert_pem: read(cert)?,
        key_pem: read(key)?,
    };
    // Refused here, not at the first call to a peer.
    let any = std::net::SocketAddr::from(([127, 0, 0, 1], 1));
    tls.endpoint(any)
        .map_err(|e| anyhow::anyhow!("TLS to peers ({}): {e}", ca.display()))?;
    Ok(tls)
}

/// `gpulse token create`.
fn token_create(args: &cli::TokenCreateArgs) -> anyhow::Result<()> {
    let token = auth::new_token();
    let entry = auth::entry(&args.name, auth::Scopes::of(&args.scope), &token);
    match &args.auth_file {
        Some(path) => {
            use std::os::unix::fs::OpenOptionsExt as _;
            // Checked before writing: a file that would not load is not made worse.
            let before = std::fs::read_to_string(path).unwrap_or_default();
            let after = format!(
                "{before}{}{entry}",
                if before.is_empty() { "" } else { "\n" }
            );
            auth::Tokens::parse(&after).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(path)
                .with_context(|| format!("opening {}", path.display()))?;
            f.write_all(&after.as_bytes()[before.len()..])?;
            println!("{token}");
            eprintln!(
                "token {:?} added to {}; send SIGHUP to serve (or restart it) to use it. The token is shown once.",
                args.name,
                path.display()
            );
        }
        None => {
            println!("{token}");
            eprintln!("# the token above is shown once. Add this to the --auth-file:\n{entry}");
        }
    }
    Ok(())
}

async fn sql(args: SqlArgs) -> anyhow::Result<()> {
    let url = format!("{}/api/v1/sql", args.url.trim_end_matches('/'));
    let format = match args.format {
        OutputFormat::Json => "json",
        OutputFormat::Table | OutputFormat::Csv => "arrow",
    };
    let query = args.query.clone();
    let authorization = args
        .token_file
        .as_deref()
        .map(agent::cmd::read_token_file)
        .transpose()?
        .map(|t| format!("Bearer {t}"));
    let (status, body) = tokio::task::spawn_blocking(move || -> anyhow::Result<(u16, Vec<u8>)> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(300)))
            .build()
            .into();
        let mut request = agent
            .post(&url)
            .query("format", format)
            .header("content-type", "text/plain; charset=utf-8");
        if let Some(a) = &authorization {
            request = request.header("authorization", a);
        }
        let mut resp = request
            .send(query.as_bytes())
            .with_context(|| format!("sending the query to {url}"))?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(u64::MAX)
            .read_to_vec()?;
        Ok((status, body))
    })
    .await??;
    if status != 200 {
        let msg = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
        bail!("query failed (HTTP {status}): {msg}");
    }
    let mut out = std::io::stdout().lock();
    match args.format {
        OutputFormat::Json => {
            out.write_all(&body)?;
            writeln!(out)?;
        }
        OutputFormat::Table | OutputFormat::Csv => {
            let reader =
                arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(body), None)?;
            let schema = reader.schema();
            let batches = reader.collect::<Result<Vec<_>, _>>()?;
            if matches!(args.format, OutputFormat::Table) {
                writeln!(
                    out,
                    "{}",
                    arrow::util::pretty::pretty_format_batches(&batches)?
                )?;
                let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
                writeln!(out, "{rows} row{}", if rows == 1 { "" } else { "s" })?;
            } else {
                let mut w = arrow::csv::WriterBuilder::new()
                    .with_header(true)
                    .build(&mut out);
                if batches.is_empty() {
                    w.write(&arrow::array::RecordBatch::new_empty(schema))?;
                }
                for b in &batches {
                    w.write(b)?;
                }
            }
        }
    }
    Ok(())
}

/// The demo fleet: 2 rows x 2 racks x 4 hosts x 8 GPUs = 128 GPUs.
const DEMO_ROWS: u32 = 2;
const DEMO_RACKS_PER_ROW: u32 = 2;
const DEMO_HOSTS_PER_RACK: u32 = 4;
const DEMO_GPUS_PER_HOST: u32 = 8;
/// Faults the demo seeds, for `health_events` to find: (host index, GPU,
/// kind, first poll, polls it lasts).
const DEMO_FAULTS: [(u64, u32, agent::sim::FaultKind, u64, Option<u64>); 3] = [
    (0, 3, agent::sim::FaultKind::Xid48DoubleBitEcc, 15, None),
    (5, 6, agent::sim::FaultKind::ThermalThrottle, 20, Some(300)),
    (10, 1, agent::sim::FaultKind::Xid79FallenOffBus, 25, None),
];

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let server = Server::start(&serve_config(&args.node)).await?;
    let url = format!("grpc://{}", server.grpc_addr);
    let (stop_tx, _) = tokio::sync::watch::channel(false);
    let mut agents = Vec::new();
    let mut host_index = 0u64;
    for row in 0..DEMO_ROWS {
        for rack in 0..DEMO_RACKS_PER_ROW {
            for h in 0..DEMO_HOSTS_PER_RACK {
                let host = format!("node-r{row}k{rack}-{h:02}");
                let mut config = AgentConfig::new(&url);
                config.host = host.clone();
                config.agent_id = host;
                config.topology = Topology {
                    cluster: "demo".into(),
                    row: format!("row-{row}"),
                    rack: format!("rack-{row}-{rack}"),
                };
                config.interval = args.interval;
                let mut sim = SimConfig::new(
                    args.seed.wrapping_mul(1000).wrapping_add(host_index),
                    DEMO_GPUS_PER_HOST,
                );
                sim.interval_ms = args.interval.as_millis() as u64;
                if !args.no_faults {
                    sim.faults.scheduled = DEMO_FAULTS
                        .iter()
                        .filter(|f| f.0 == host_index)
                        .map(|&(_, gpu, kind, start_tick, duration_ticks)| {
                            agent::sim::ScheduledFault {
                                gpu,
                                kind,
                                start_tick,
                                duration_ticks,
                            }
                        })
                        .collect();
                }
                host_index += 1;
                let mut stop = stop_tx.subscribe();
                let shutdown = async move {
                    let _ = stop.wait_for(|s| *s).await;
                };
                agents.push(tokio::spawn(agent::run(
                    config,
                    Box::new(SimulatedSource::new(sim)),
                    shutdown,
                )));
            }
        }
    }
    print_endpoints(&server, &args.node, false);
    let gpus = DEMO_ROWS * DEMO_RACKS_PER_ROW * DEMO_HOSTS_PER_RACK * DEMO_GPUS_PER_HOST;
    println!(
        "  fleet           {} simulated hosts, {gpus} GPUs, 1 cluster / {DEMO_ROWS} rows / {} racks, polled every {}",
        agents.len(),
        DEMO_ROWS * DEMO_RACKS_PER_ROW,
        humantime::format_duration(args.interval)
    );
    if !args.no_faults {
        let host_of = |i: u64| {
            let per_row = u64::from(DEMO_RACKS_PER_ROW * DEMO_HOSTS_PER_RACK);
            let (row, in_row) = (i / per_row, i % per_row);
            let (rack, h) = (
                in_row / u64::from(DEMO_HOSTS_PER_RACK),
                in_row % u64::from(DEMO_HOSTS_PER_RACK),
            );
            format!("node-r{row}k{rack}-{h:02}")
        };
        let faults: Vec<String> = DEMO_FAULTS
            .iter()
            .map(|&(host, gpu, kind, start, _)| {
                format!(
                    "{} on {} GPU {gpu} after {start} polls",
                    kind.as_str(),
                    host_of(host)
                )
            })
            .collect();
        println!(
            "  faults          {} (--no-faults: none)",
            faults.join("; ")
        );
    }
    let sql_url = if server.http_addr.to_string() == server::DEFAULT_HTTP_LISTEN {
        String::new()
    } else {
        format!(" --url http://{}", server.http_addr)
    };
    println!();
    println!("Try (in another terminal):");
    for q in [
        "SELECT count(DISTINCT gpu || host) AS gpus FROM samples",
        "SELECT rack, round(avg(value), 1) AS avg_temp_c FROM samples WHERE metric = 'DCGM_FI_DEV_GPU_TEMP' GROUP BY rack ORDER BY rack",
        "SELECT host, gpu, max(value) AS watts FROM samples WHERE metric = 'DCGM_FI_DEV_POWER_USAGE' AND ts > now() - INTERVAL '1 minute' GROUP BY host, gpu ORDER BY watts DESC LIMIT 5",
        "SELECT kind, severity, host, gpu, xid, detected_at, cleared_at, action FROM health_events ORDER BY id",
    ] {
        println!("  cargo run --release -- sql{sql_url} \"{q}\"");
    }
    println!();
    println!("gpulse ready (Ctrl-C to stop)");
    std::io::stdout().flush()?;

    shutdown_signal().await;
    // Agents first, so that what they sampled is acked before the final flush.
    stop_tx.send_replace(true);
    for a in agents {
        match a.await {
            Ok(Ok(r)) if r.shipper.batches_unacked > 0 => warn!(
                unacked = r.shipper.batches_unacked,
                "agent stopped with unacked batches"
            ),
            Ok(Ok(_)) => {}
            Ok(Err(e)) => warn!(error = %e, "agent failed"),
            Err(e) => warn!(error = %e, "agent task panicked"),
        }
    }
    server.shutdown().await
}
