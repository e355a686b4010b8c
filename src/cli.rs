//! Command-line interface: every flag also reads a `GPULSE_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use agent::cmd::{AgentArgs, parse_duration, parse_size};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::server::DEFAULT_PG_LISTEN;

#[derive(Debug, Parser)]
#[command(
    name = "gpulse",
    version,
    about = "GPU-fleet telemetry: NVML agent, gRPC ingest, compressed storage, SQL"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run an ingest + query node.
    Serve(ServeArgs),
    /// Run a node agent that streams GPU samples to ingest.
    Agent(Box<AgentArgs>),
    /// Run one SQL query against a node and print the result.
    Sql(SqlArgs),
    /// Run a node plus a simulated fleet of 128 GPUs streaming to it over gRPC.
    Demo(DemoArgs),
    /// Load a long-format CSV (labels,timestamp_ms,value) into a data directory.
    Import(ImportArgs),
    /// Print series, samples and bytes on disk (per sample) of a data directory.
    Stats(StatsArgs),
    /// Sharded cluster operations.
    #[command(subcommand)]
    Cluster(ClusterCommand),
    /// Access tokens (`--auth-file`).
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Debug, Subcommand)]
pub(crate) enum ClusterCommand {
    /// Per node of the cluster file: up or down, same file or not, racks owned,
    /// ingest rate, agent streams, and replica lag (batches agents hold for it).
    Status(ClusterStatusArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ClusterStatusArgs {
    /// The cluster file (the one the nodes run with).
    #[arg(long, env = "GPULSE_CLUSTER_FILE")]
    pub(crate) cluster: PathBuf,
    /// Time between the two status rounds the ingest rate is computed from.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) interval: Duration,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
    /// A file holding a token (write scope) for nodes that ask for one.
    #[arg(long, env = "GPULSE_TOKEN_FILE")]
    pub(crate) token_file: Option<PathBuf>,
    /// Nodes with TLS: the CA (PEM) that signed their certificates.
    #[arg(long, env = "GPULSE_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub(crate) tls_ca: Option<PathBuf>,
    /// A certificate (PEM) for nodes that require one (--tls-client-ca).
    #[arg(long, env = "GPULSE_TLS_CERT", requires = "tls_ca")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The key of --tls-cert (PEM).
    #[arg(long, env = "GPULSE_TLS_KEY", requires = "tls_ca")]
    pub(crate) tls_key: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum TokenCommand {
    /// Make a new token: prints the token (shown once) and the token-file
    /// entry that lets it in (only its SHA-256 is kept).
    Create(TokenCreateArgs),
}

#[derive(Debug, Args)]
pub(crate) struct TokenCreateArgs {
    /// Who or what uses it (letters, digits, `-`, `_`, `.`), e.g. `grafana`.
    #[arg(long, value_parser = token_name)]
    pub(crate) name: String,
    /// What it may do: `read`, `write`, `admin`, comma-separated.
    #[arg(long, value_delimiter = ',', required = true, value_parser = auth::Scope::parse)]
    pub(crate) scope: Vec<auth::Scope>,
    /// Append the entry to this token file (created with mode 0600) and
    /// print only the token.
    #[arg(long)]
    pub(crate) auth_file: Option<PathBuf>,
}

fn token_name(s: &str) -> Result<String, String> {
    if !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        Ok(s.to_owned())
    } else {
        Err("1 to 64 letters, digits, '-', '_' or '.'".into())
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum ImportFormat {
    /// Header `labels,timestamp_ms,value`; labels `k=v;k=v`, `metric=` names the metric.
    Csv,
}

#[derive(Debug, Args)]
pub(crate) struct ImportArgs {
    /// Input file, or `-` for standard input.
    pub(crate) input: String,
    #[arg(long, value_enum, default_value = "csv")]
    pub(crate) format: ImportFormat,
    /// Data directory to load into; must not be in use by a running serve.
    #[arg(long, env = "GPULSE_DATA_DIR", default_value = "./gpulse-data")]
    pub(crate) data_dir: PathBuf,
}

#[derive(Debug, Args)]
pub(crate) struct StatsArgs {
    #[arg(long, env = "GPULSE_DATA_DIR", default_value = "./gpulse-data")]
    pub(crate) data_dir: PathBuf,
    /// Also break bytes per sample down by metric.
    #[arg(long)]
    pub(crate) by_metric: bool,
}

/// A listen address, or `off` for none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OptionalListen(pub(crate) Option<SocketAddr>);

fn optional_listen(s: &str) -> Result<OptionalListen, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(OptionalListen(None));
    }
    s.parse()
        .map(|a| OptionalListen(Some(a)))
        .map_err(|e| format!("{s:?} is not an address like 127.0.0.1:7402 or `off`: {e}"))
}

fn positive_count(s: &str) -> Result<u64, String> {
    let n: u64 = s
        .replace('_', "")
        .parse()
        .map_err(|e| format!("{s:?} is not a count: {e}"))?;
    if n == 0 {
        return Err("must be greater than zero".into());
    }
    Ok(n)
}

#[derive(Debug, Clone, Args)]
pub(crate) struct NodeArgs {
    /// Data directory (segments); created if missing.
    #[arg(long, env = "GPULSE_DATA_DIR", default_value = "./gpulse-data")]
    pub(crate) data_dir: PathBuf,
    /// Address of the ingest gRPC listener (port 0 picks a free port).
    /// Default 127.0.0.1:7400, or the node's `grpc` in the cluster file.
    #[arg(long, env = "GPULSE_GRPC_LISTEN")]
    pub(crate) grpc_listen: Option<SocketAddr>,
    /// Address of the HTTP query listener (port 0 picks a free port).
    /// Default 127.0.0.1:7401, or the node's `http` in the cluster file.
    #[arg(long, env = "GPULSE_HTTP_LISTEN")]
    pub(crate) http_listen: Option<SocketAddr>,
    /// Address of the PostgreSQL wire-protocol listener (port 0 picks a free
    /// port), or `off`. No authentication: keep it on a trusted address.
    #[arg(long, env = "GPULSE_PG_LISTEN", default_value = DEFAULT_PG_LISTEN, value_parser = optional_listen)]
    pub(crate) pg_listen: OptionalListen,
    /// Most rows one query may return (HTTP and PostgreSQL); a larger result
    /// fails with an error instead of filling memory.
    #[arg(long, env = "GPULSE_MAX_RESULT_ROWS", default_value = "1000000", value_parser = positive_count)]
    pub(crate) max_result_rows: u64,
    /// Most bytes one query may return (Arrow memory over HTTP, encoded rows
    /// over PostgreSQL), e.g. 1GiB.
    #[arg(long, env = "GPULSE_MAX_RESULT_BYTES", default_value = "1GiB", value_parser = parse_size)]
    pub(crate) max_result_bytes: u64,
    /// Longest query text in bytes, over every query surface (SQL, PromQL,
    /// remote read matchers); longer ones get 400 / SQLSTATE 54001.
    #[arg(long, env = "GPULSE_MAX_QUERY_LENGTH", default_value = "64KiB", value_parser = parse_size)]
    pub(crate) max_query_length: u64,
    /// Deepest expression tree a query may have (nested operators, calls and
    /// subqueries), checked before it is planned: 400 / SQLSTATE 54001.
    #[arg(long, env = "GPULSE_MAX_QUERY_DEPTH", default_value = "256", value_parser = positive_count)]
    pub(crate) max_query_depth: u64,
    /// Longest a query may run, waiting for a slot included (SQL, PromQL,
    /// remote read, Flight): 503 `timeout` / SQLSTATE 57014.
    #[arg(long, env = "GPULSE_QUERY_TIMEOUT", default_value = "2m", value_parser = parse_duration)]
    pub(crate) query_timeout: Duration,
    /// Most queries running at once over every surface; the others wait
    /// for a slot within their --query-timeout.
    #[arg(long, env = "GPULSE_MAX_CONCURRENT_QUERIES", default_value = "20", value_parser = positive_count)]
    pub(crate) max_concurrent_queries: u64,
    /// Most memory DataFusion may reserve for one SQL query (hash tables,
    /// sorts); past it the query fails with 422 / SQLSTATE 53200. Queries
    /// never spill to disk.
    #[arg(long, env = "GPULSE_QUERY_MEMORY_LIMIT", default_value = "1GiB", value_parser = parse_size)]
    pub(crate) query_memory_limit: u64,
    /// Most samples one PromQL query may load from storage plus the points
    /// it produces (Prometheus's --query.max-samples): 422 `execution`.
    #[arg(long, env = "GPULSE_QUERY_MAX_SAMPLES", default_value = "50000000", value_parser = positive_count)]
    pub(crate) query_max_samples: u64,
    /// Most live series in the head; a batch that would create a series past
    /// it is refused (gRPC batch Reject, remote write 400). A series idle for
    /// 15 minutes with nothing unflushed leaves the head at the next flush,
    /// so the limit counts live series.
    #[arg(long, env = "GPULSE_MAX_SERIES", default_value = "5000000", value_parser = positive_count)]
    pub(crate) max_series: u64,
    /// How often the in-memory head is sealed into a segment file (and the
    /// WAL truncated).
    #[arg(long, env = "GPULSE_FLUSH_INTERVAL", default_value = "2m", value_parser = parse_duration)]
    pub(crate) flush_interval: Duration,
    /// Flush ahead of the interval once the head holds this many samples
    /// (about 3.4 bytes each in memory at a 10 s poll), so that a long
    /// backfill keeps at most that many in memory. 0 (the default): only
    /// the interval flushes. Each early flush costs a flush of every series
    /// (see docs/BENCHMARKS.md: 8 M slowed a 2-hour backfill of 53,000 series
    /// from 5.1 to 3.2 M samples/s).
    #[arg(long, env = "GPULSE_HEAD_MAX_SAMPLES", default_value_t = 0)]
    pub(crate) head_max_samples: u64,
    /// Push health events to this Alertmanager as alerts (API v2,
    /// `http://HOST:PORT`), resent each minute while active, resolved when
    /// they clear, retried while it is down. Default: no alerts.
    #[arg(long, env = "GPULSE_ALERTMANAGER_URL", value_parser = crate::health::check_alertmanager_url)]
    pub(crate) alertmanager_url: Option<String>,
    /// fsync the WAL before acknowledging a batch, so acked samples survive
    /// power loss. Without it an ack means the batch reached the OS, which
    /// survives a crash of the process (kill -9) but not of the machine.
    #[arg(long, env = "GPULSE_WAL_FSYNC")]
    pub(crate) wal_fsync: bool,
    /// Span of time, aligned to the Unix epoch, whose segments (and rollup
    /// files) compaction merges into one once a later flush has moved past it.
    #[arg(long, env = "GPULSE_COMPACTION_WINDOW", default_value = "2h", value_parser = parse_duration)]
    pub(crate) compaction_window: Duration,
    /// Delete raw samples older than this; their 1 min / 1 h / 1 d rollups stay.
    #[arg(long, env = "GPULSE_RETENTION", default_value = "7d", value_parser = parse_duration)]
    pub(crate) retention: Duration,
    /// Delete 1-minute rollup records older than this (1 h and 1 d records stay).
    #[arg(long = "retention-1m", env = "GPULSE_RETENTION_1M", default_value = "30d", value_parser = parse_duration)]
    pub(crate) retention_1m: Duration,
    /// Delete 1-hour rollup records older than this.
    #[arg(long = "retention-1h", env = "GPULSE_RETENTION_1H", default_value = "400d", value_parser = parse_duration)]
    pub(crate) retention_1h: Duration,
    /// Delete 1-day rollup records older than this.
    #[arg(long = "retention-1d", env = "GPULSE_RETENTION_1D", default_value = "1825d", value_parser = parse_duration)]
    pub(crate) retention_1d: Duration,
    /// How far behind a series' newest sample a late sample is still stored;
    /// older ones are dropped and counted. Equal timestamps: the first write wins.
    #[arg(long, env = "GPULSE_OOO_WINDOW", default_value = "10m", value_parser = humantime::parse_duration)]
    pub(crate) ooo_window: Duration,
    /// Refuse samples more than this far ahead of the node's clock (gRPC,
    /// remote write): a future-dated sample would pin its segment against
    /// retention. Samples older than --retention are refused too. Default
    /// 10m, as Grafana Mimir's create grace period.
    #[arg(long, env = "GPULSE_MAX_FUTURE", default_value = "10m", value_parser = parse_duration)]
    pub(crate) max_future: Duration,
    /// Most labels of one series (topology labels included, metric name
    /// not), for gRPC ingest and remote write alike.
    #[arg(long, env = "GPULSE_MAX_LABELS", default_value = "32", value_parser = positive_count)]
    pub(crate) max_labels: u64,
    /// Most bytes of one label name or value, metric name, host, topology
    /// label or agent id, for gRPC ingest and remote write alike.
    #[arg(long, env = "GPULSE_MAX_LABEL_BYTES", default_value = "512", value_parser = parse_size)]
    pub(crate) max_label_bytes: u64,
    /// Largest remote-write or remote-read request body, compressed and
    /// decompressed (the snappy header is checked before decompressing).
    #[arg(long, env = "GPULSE_REMOTE_MAX_REQUEST_BYTES", default_value = "32MiB", value_parser = parse_size)]
    pub(crate) remote_max_request_bytes: u64,
    /// HTTP: close a connection whose request headers are not complete
    /// within this long of connecting or of the previous response (slow
    /// clients, and idle keep-alive connections).
    #[arg(long, env = "GPULSE_HTTP_HEADER_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub(crate) http_header_timeout: Duration,
    /// gRPC: close an agent stream (DEADLINE_EXCEEDED) that has not sent
    /// its hello within this long.
    #[arg(long, env = "GPULSE_GRPC_HELLO_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub(crate) grpc_hello_timeout: Duration,
    /// gRPC: most concurrent streams on one HTTP/2 connection (an agent
    /// opens one); the client waits for a free one.
    #[arg(long, env = "GPULSE_GRPC_MAX_STREAMS_PER_CONNECTION", default_value = "16", value_parser = positive_count)]
    pub(crate) grpc_max_streams_per_connection: u64,
    /// gRPC: most agent streams open on the node; one more is refused with
    /// RESOURCE_EXHAUSTED (the agent retries with backoff).
    #[arg(long, env = "GPULSE_GRPC_MAX_STREAMS", default_value = "10000", value_parser = positive_count)]
    pub(crate) grpc_max_streams: u64,
}

impl NodeArgs {
    /// The admission and network-edge limits of these flags (issue #14).
    pub(crate) fn edge_limits(&self) -> crate::server::EdgeLimits {
        let usize_of = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        crate::server::EdgeLimits {
            max_future: self.max_future,
            labels: storage::admission::LabelLimits {
                max_labels: usize_of(self.max_labels),
                max_label_bytes: usize_of(self.max_label_bytes),
            },
            remote_max_request_bytes: usize_of(self.remote_max_request_bytes),
            http: query::http::HttpConfig {
                header_timeout: self.http_header_timeout,
            },
            grpc_hello_timeout: self.grpc_hello_timeout,
            grpc_max_streams_per_connection: u32::try_from(self.grpc_max_streams_per_connection)
                .unwrap_or(u32::MAX),
            grpc_max_streams: self.grpc_max_streams,
        }
    }
}

#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub(crate) node: NodeArgs,
    /// Run as a member of a sharded cluster described by this TOML file (the
    /// same file on every node; see README "Cluster"). The node's listeners
    /// default to its entry. SIGHUP re-reads the file.
    #[arg(long, env = "GPULSE_CLUSTER_FILE", requires = "node_id")]
    pub(crate) cluster: Option<PathBuf>,
    /// This node's id in the cluster file.
    #[arg(long, env = "GPULSE_NODE_ID", requires = "cluster")]
    pub(crate) node_id: Option<String>,
    /// Require a token on every surface (HTTP, gRPC, PostgreSQL, Flight):
    /// a TOML file of token hashes and scopes, made with `gpulse token
    /// create` (README "Security"). SIGHUP reads it again.
    #[arg(long, env = "GPULSE_AUTH_FILE")]
    pub(crate) auth_file: Option<PathBuf>,
    /// With --auth-file and --cluster: a file holding the token (read and
    /// write scopes) this node presents to its peers.
    #[arg(long, env = "GPULSE_CLUSTER_TOKEN_FILE", requires = "cluster")]
    pub(crate) cluster_token_file: Option<PathBuf>,
    /// Listen on non-loopback addresses although this version speaks
    /// plaintext only (no TLS yet): for a network you trust. Without it,
    /// `serve` refuses any address but loopback.
    #[arg(long, env = "GPULSE_INSECURE")]
    pub(crate) insecure: bool,
    /// TLS on every listener: the node's certificate chain (PEM). SIGHUP
    /// reads it and the key again.
    #[arg(long, env = "GPULSE_TLS_CERT", requires = "tls_key")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "GPULSE_TLS_KEY", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// mTLS for agents: CA certificates (PEM) that sign their client
    /// certificates; an agent then speaks only for the host its certificate
    /// names.
    #[arg(long, env = "GPULSE_TLS_CLIENT_CA", requires = "tls_cert")]
    pub(crate) tls_client_ca: Option<PathBuf>,
    /// With --tls-cert and --cluster: the CA (PEM) that signed the nodes'
    /// certificates, to check peers with; this node presents its own
    /// certificate to them.
    #[arg(long, env = "GPULSE_TLS_CA", requires = "tls_cert")]
    pub(crate) tls_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum OutputFormat {
    Table,
    Csv,
    Json,
}

#[derive(Debug, Args)]
pub(crate) struct SqlArgs {
    /// The SQL statement.
    pub(crate) query: String,
    /// Base URL of the node's HTTP API.
    #[arg(long, env = "GPULSE_URL", default_value = "http://127.0.0.1:7401")]
    pub(crate) url: String,
    #[arg(long, value_enum, default_value = "table")]
    pub(crate) format: OutputFormat,
    /// A file holding the token (read scope) to send, when the node asks for one.
    #[arg(long, env = "GPULSE_TOKEN_FILE")]
    pub(crate) token_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub(crate) node: NodeArgs,
    /// Poll interval of the simulated agents.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub(crate) interval: Duration,
    /// Seed of the simulated fleet.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Run the fleet without the three faults the demo seeds for the
    /// health engine to find (an XID 48, a thermal throttle, an XID 79).
    #[arg(long)]
    pub(crate) no_faults: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_flags() {
        let serve = |args: &[&str]| {
            let mut argv = vec!["gpulse", "serve"];
            argv.extend_from_slice(args);
            match Cli::try_parse_from(argv).map(|c| c.command) {
                Ok(Command::Serve(s)) => Ok(s.node),
                Ok(_) => panic!("not serve"),
                Err(e) => Err(e),
            }
        };
        let n = serve(&[]).unwrap();
        assert_eq!(
            n.pg_listen,
            OptionalListen(Some("127.0.0.1:7402".parse().unwrap()))
        );
        assert_eq!(
            (n.max_result_rows, n.max_result_bytes),
            (1_000_000, 1 << 30)
        );
        let n = serve(&[
            "--pg-listen",
            "off",
            "--max-result-rows",
            "10_000",
            "--max-result-bytes",
            "2MiB",
        ])
        .unwrap();
        assert_eq!(n.pg_listen, OptionalListen(None));
        assert_eq!((n.max_result_rows, n.max_result_bytes), (10_000, 2 << 20));
        assert!(serve(&["--pg-listen", "localhost"]).is_err());
        assert!(serve(&["--max-result-rows", "0"]).is_err());
    }

    #[test]
    fn cluster_flags_come_together() {
        let parse = |args: &[&str]| {
            let mut argv = vec!["gpulse", "serve"];
            argv.extend_from_slice(args);
            Cli::try_parse_from(argv).map(|c| match c.command {
                Command::Serve(s) => (s.cluster, s.node_id, s.node.grpc_listen),
                _ => panic!("not serve"),
            })
        };
        assert_eq!(parse(&[]).unwrap(), (None, None, None));
        let (file, id, grpc) = parse(&["--cluster", "c.toml", "--node-id", "a"]).unwrap();
        assert_eq!(
            (file.unwrap(), id.unwrap(), grpc),
            ("c.toml".into(), "a".to_string(), None)
        );
        let e = parse(&["--cluster", "c.toml"]).unwrap_err().to_string();
        assert!(e.contains("--node-id"), "{e}");
        let e = parse(&["--node-id", "a"]).unwrap_err().to_string();
        assert!(e.contains("--cluster"), "{e}");
    }
}
