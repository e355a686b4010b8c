//! `gpulse serve`: ingest (gRPC) and query (HTTP) over one data directory,
//! with a periodic flush of the head to segments and a final flush on
//! shutdown.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use storage::{Storage, StorageConfig};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

/// Default ports, documented in the README.
pub(crate) const DEFAULT_GRPC_LISTEN: &str = "127.0.0.1:7400";
pub(crate) const DEFAULT_HTTP_LISTEN: &str = "127.0.0.1:7401";
pub(crate) const DEFAULT_PG_LISTEN: &str = "127.0.0.1:7402";

#[derive(Debug, Clone)]
pub(crate) struct ServeConfig {
    pub(crate) data_dir: PathBuf,
    /// `--alertmanager-url`: where health events go as alerts.
    pub(crate) alertmanager_url: Option<String>,
    pub(crate) grpc_listen: SocketAddr,
    pub(crate) http_listen: SocketAddr,
    /// `None`: no PostgreSQL listener.
    pub(crate) pg_listen: Option<SocketAddr>,
    pub(crate) limits: query::ResultLimits,
    /// Length, depth, time, concurrency and memory of queries.
    pub(crate) query: query::limits::QueryLimits,
    /// PromQL's cap on samples held (`--query-max-samples`).
    pub(crate) prom: query::promql::PromLimits,
    /// Most live series in the head (`--max-series`).
    pub(crate) max_series: usize,
    pub(crate) flush_interval: Duration,
    /// Samples in the head that wake the flush task early (`--head-max-samples`).
    pub(crate) head_max_samples: Option<u64>,
    /// Segments and rollup files of one such span are merged (`--compaction-window`).
    pub(crate) compaction_window: Duration,
    pub(crate) wal_sync: storage::SyncPolicy,
    pub(crate) retention: Option<Duration>,
    pub(crate) retention_1m: Option<Duration>,
    pub(crate) retention_1h: Option<Duration>,
    pub(crate) retention_1d: Option<Duration>,
    pub(crate) ooo_window: Duration,
    /// Admission and network-edge limits (issue #14).
    pub(crate) edges: EdgeLimits,
    /// Cluster mode (`--cluster`, `--node-id`).
    pub(crate) cluster: Option<crate::cluster::NodeConfig>,
    /// `--auth-file`: tokens every surface asks for. `None`: open.
    pub(crate) auth: Option<Arc<auth::Gate>>,
    /// `--cluster-token-file`: the token this node presents to its peers.
    pub(crate) cluster_token: Option<String>,
    /// `--tls-cert`, `--tls-key`, `--tls-client-ca`: TLS on every listener.
    pub(crate) tls: Option<Arc<auth::tls::ServerTls>>,
    /// With a cluster and TLS (`--tls-ca`): TLS to the peers.
    pub(crate) peer_tls: Option<::cluster::PeerTls>,
}

/// What is admitted at the door, and the network edges' limits: the flags
/// of [`crate::cli::NodeArgs::edge_limits`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct EdgeLimits {
    /// Samples more than this ahead of the clock are refused (`--max-future`).
    pub(crate) max_future: Duration,
    /// Labels of a series, for gRPC and remote write alike.
    pub(crate) labels: storage::admission::LabelLimits,
    pub(crate) remote_max_request_bytes: usize,
    pub(crate) http: query::http::HttpConfig,
    pub(crate) grpc_hello_timeout: Duration,
    pub(crate) grpc_max_streams_per_connection: u32,
    pub(crate) grpc_max_streams: u64,
}

impl EdgeLimits {
    /// The window of sample timestamps: not older than the raw retention
    /// (none without one: then only not before 1970), not more than
    /// `max_future` ahead.
    fn window(&self, retention: Option<Duration>) -> storage::admission::SampleWindow {
        storage::admission::SampleWindow {
            max_age: retention,
            max_future: self.max_future,
        }
    }
}

/// Refuses what a web page in a browser could send to an admin route
/// without the user's knowing (CSRF): a request whose `Origin` (or
/// `Sec-Fetch-Site`) says another site sent it gets 403, and a body of a
/// type an HTML form can send (`application/x-www-form-urlencoded`,
/// `multipart/form-data`, `text/plain`) gets 415. `curl -X POST` and the
/// benchmark scripts send neither. Counted in `gpulse_http_admin_refused_total`.
async fn same_origin_only(
    axum::extract::State(metrics): axum::extract::State<Arc<query::http::EdgeMetrics>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::http::{StatusCode, header};
    use axum::response::IntoResponse;
    let h = request.headers();
    let text = |name: header::HeaderName| {
        h.get(name)
            .map(|v| v.to_str().unwrap_or("?").trim().to_ascii_lowercase())
    };
    let host = text(header::HOST).unwrap_or_default();
    let cross_origin = text(header::ORIGIN).is_some_and(|o| {
        let authority = o
            .strip_prefix("http://")
            .or_else(|| o.strip_prefix("https://"))
            .unwrap_or("?");
        authority != host
    }) || text(header::HeaderName::from_static("sec-fetch-site"))
        .is_some_and(|s| s == "cross-site" || s == "same-site");
    let media = text(header::CONTENT_TYPE)
        .map(|c| c.split(';').next().unwrap_or("").trim().to_string())
        .unwrap_or_default();
    let simple = matches!(
        media.as_str(),
        "application/x-www-form-urlencoded" | "multipart/form-data" | "text/plain"
    );
    let refusal = if cross_origin {
        Some((
            StatusCode::FORBIDDEN,
            "cross-origin request refused: admin routes take requests from the node's own origin or from clients without a browser's Origin header",
        ))
    } else if simple {
        Some((
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "admin routes take no form or text body: send no body, or Content-Type: application/json",
        ))
    } else {
        None
    };
    if let Some((code, message)) = refusal {
        metrics
            .admin_refused
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        warn!(status = %code, path = %request.uri().path(), "admin request refused");
        let body =
            serde_json::json!({"status": "error", "errorType": "forbidden", "error": message});
        return (
            code,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response();
    }
    next.run(request).await
}

/// One round of upkeep: flush the head, merge finished compaction windows
/// (at most a few per round, so that a backlog does not stall the next
/// flush), and drop segments past the retention, all under storage's one
/// upkeep lock ([`Storage::upkeep`]), so that the periodic round and one
/// asked for over HTTP never interleave. Compaction and retention run even
/// when the flush fails; the flush's error is returned (storage has counted
/// and logged it).
/// Connections a listener queues before it accepts them. Tokio's default
/// is 1,024; when an ingest node restarts, every agent of a large fleet
/// reconnects at once (1,250 hosts of 8 GPUs for 10,000 GPUs), and
/// connections beyond the queue were reset (`TcpExtListenOverflows`) while
/// the node was busy. The kernel caps it at `net.core.somaxconn`.
const LISTEN_BACKLOG: u32 = 8192;

/// How often the server hands the memory glibc holds free back to the OS
/// (`storage::malloc::release_free_memory`), besides after every flush.
const TRIM_EVERY: Duration = Duration::from_secs(10);

/// Binds `addr` (with `SO_REUSEADDR`, as [`TcpListener::bind`] does) and
/// listens with [`LISTEN_BACKLOG`].
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// SIGHUP: reads the TLS files and the token file again. New connections
/// get the new certificate, the next request is checked against the new
/// tokens; a file that does not load leaves the old one in force (logged,
/// and counted for TLS).
fn reload_on_sighup(
    tls: Option<Arc<auth::tls::ServerTls>>,
    gate: Option<Arc<auth::Gate>>,
    mut stop: watch::Receiver<bool>,
) -> anyhow::Result<JoinHandle<()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = signal(SignalKind::hangup()).context("listening for SIGHUP")?;
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = hup.recv() => {
                    if let Some(tls) = &tls {
                        match tls.reload() {
                            Ok(()) => info!("TLS certificate and key reloaded"),
                            Err(e) => error!(error = %e, "TLS reload failed; the previous certificate stays in use"),
                        }
                    }
                    if let Some(gate) = &gate {
                        match gate.reload() {
                            Ok(n) => info!(tokens = n, "token file reloaded"),
                            Err(e) => error!(error = %e, "token file reload failed; the previous tokens stay in force"),
                        }
                    }
                }
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }))
}

fn maintain(st: &Storage) -> storage::Result<()> {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    let report = st.upkeep(now_ms, 4);
    if let Err(e) = st.inventory().persist() {
        error!(error = %e, "could not write the GPU inventory; retried at the next upkeep");
    }
    report.flush.map(|_| ())
}

/// `POST /api/v1/admin/flush`: one round of upkeep now (flush the head to a
/// segment, merge finished compaction windows, apply retention), as
/// VictoriaMetrics's `/internal/force_flush`. Benchmarks call it before they
/// measure the data directory; operators before a backup.
fn admin_router(storage: Arc<Storage>) -> axum::Router {
    use axum::http::StatusCode;
    use axum::response::IntoResponse;
    async fn flush(
        axum::extract::State(st): axum::extract::State<Arc<Storage>>,
    ) -> axum::response::Response {
        let json = |code: StatusCode, v: serde_json::Value| {
            (code, [("content-type", "application/json")], v.to_string()).into_response()
        };
        match tokio::task::spawn_blocking(move || maintain(&st)).await {
            Ok(Ok(())) => json(StatusCode::OK, serde_json::json!({"status": "success"})),
            Ok(Err(e)) => {
                error!(error = %e, "flush on request failed");
                json(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    serde_json::json!({"status": "error", "errorType": "internal", "error": e.to_string()}),
                )
            }
            Err(e) => json(
                StatusCode::INTERNAL_SERVER_ERROR,
                serde_json::json!({"status": "error", "errorType": "internal", "error": format!("flush task failed: {e}")}),
            ),
        }
    }
    axum::Router::new()
        .route("/api/v1/admin/flush", axum::routing::post(flush))
        .with_state(storage)
}

/// A running node. Dropping it does not stop it: call [`Self::shutdown`].
pub(crate) struct Server {
    pub(crate) grpc_addr: SocketAddr,
    pub(crate) http_addr: SocketAddr,
    pub(crate) pg_addr: Option<SocketAddr>,
    pub(crate) storage: Arc<Storage>,
    /// Cluster mode: this node's view of the cluster.
    pub(crate) cluster: Option<Arc<::cluster::ClusterState>>,
    stop: watch::Sender<bool>,
    tasks: Vec<(&'static str, JoinHandle<()>)>,
    health: crate::health::Health,
}

impl Server {
    /// Opens storage, binds the listeners and starts serving.
    pub(crate) async fn start(config: &ServeConfig) -> anyhow::Result<Self> {
        let mut storage_config = StorageConfig::new(&config.data_dir);
        storage_config.wal_sync = config.wal_sync;
        storage_config.retention = config.retention;
        storage_config.retention_1m = config.retention_1m;
        storage_config.retention_1h = config.retention_1h;
        storage_config.retention_1d = config.retention_1d;
        storage_config.ooo_window = config.ooo_window;
        storage_config.compaction_window = config.compaction_window;
        storage_config.head_max_samples = config.head_max_samples;
        storage_config.max_series = config.max_series;
        let storage = tokio::task::spawn_blocking(move || Storage::open(storage_config))
            .await?
            .with_context(|| format!("opening data dir {}", config.data_dir.display()))?;
        let storage = Arc::new(storage);
        // Before any listener: the engine sees every batch stored.
        let health =
            crate::health::Health::start(storage.clone(), config.alertmanager_url.as_deref())?;

        let grpc = listen(config.grpc_listen)
            .with_context(|| format!("binding the gRPC listener on {}", config.grpc_listen))?;
        let http = listen(config.http_listen)
            .with_context(|| format!("binding the HTTP listener on {}", config.http_listen))?;
        let pg = match config.pg_listen {
            Some(addr) => Some(listen(addr).with_context(|| {
                format!("binding the PostgreSQL listener on {addr} (--pg-listen off disables it)")
            })?),
            None => None,
        };
        let (grpc_addr, http_addr) = (grpc.local_addr()?, http.local_addr()?);
        let pg_addr = pg.as_ref().map(TcpListener::local_addr).transpose()?;
        let (stop, _) = watch::channel(false);
        let stopped = |stop: &watch::Sender<bool>| {
            let mut rx = stop.subscribe();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };

        let mut tasks = Vec::new();
        let edges = &config.edges;
        // The two write paths, gRPC and remote write, share their limits.
        let write_limits = ingest::WriteLimits {
            labels: edges.labels,
            window: edges.window(config.retention),
        };
        let mut service = ingest::service(
            storage.clone(),
            ingest::IngestConfig {
                limits: write_limits,
                hello_timeout: edges.grpc_hello_timeout,
                max_streams_per_connection: edges.grpc_max_streams_per_connection,
                max_streams: edges.grpc_max_streams,
                auth: config.auth.clone(),
                tls: config.tls.clone(),
                ..ingest::IngestConfig::default()
            },
        );
        let cluster = match &config.cluster {
            Some(node) => {
                let state = crate::cluster::start(
                    node,
                    config.cluster_token.clone(),
                    config.peer_tls.clone(),
                    &storage,
                    stop.subscribe(),
                    &mut tasks,
                )
                .await?;
                service = service.with_cluster(state.clone());
                Some(state)
            }
            None => None,
        };
        let ingest_metrics = service.metrics().clone();
        let fut = ingest::serve(grpc, service, stopped(&stop));
        tasks.push((
            "ingest",
            tokio::spawn(async move {
                if let Err(e) = fut.await {
                    error!(error = %e, "gRPC server failed");
                }
            }),
        ));

        let remote_write_metrics = Arc::new(ingest::remote_write::RemoteWriteMetrics::default());
        let remote_write = ingest::remote_write::router(
            storage.clone(),
            ingest::remote_write::RemoteWriteConfig {
                limits: write_limits,
                max_request_bytes: edges.remote_max_request_bytes,
            },
            remote_write_metrics.clone(),
            cluster.clone(),
        );
        let remote_read_metrics = Arc::new(query::remote_read::RemoteReadMetrics::default());
        let remote_read_limits = query::remote_read::RemoteReadLimits {
            max_request_bytes: edges.remote_max_request_bytes,
            ..query::remote_read::RemoteReadLimits::default()
        };
        let edge_metrics = Arc::new(query::http::EdgeMetrics::default());
        // Cluster mode: reads of every kind answer for the whole cluster,
        // fetching other nodes' shards over Arrow Flight.
        let mut flight_addr = None;
        let (engine, prom, remote_read, cluster_metrics, cluster_reader) =
            match (&cluster, &config.cluster) {
                (Some(state), Some(node)) => {
                    let metrics = Arc::new(query::cluster::ClusterMetrics::default());
                    let addr = node.spec().flight;
                    let fl = listen(addr)
                        .with_context(|| format!("binding the Arrow Flight listener on {addr}"))?;
                    flight_addr = Some(fl.local_addr()?);
                    let fut = query::cluster::serve_flight(
                        fl,
                        storage.clone(),
                        metrics.clone(),
                        Some(health.shared.clone()),
                        config.query.timeout,
                        auth::Access {
                            tokens: config.auth.clone(),
                            tls: config.tls.clone(),
                        },
                        stopped(&stop),
                    );
                    tasks.push((
                        "flight",
                        tokio::spawn(async move {
                            if let Err(e) = fut.await {
                                error!(error = %e, "Arrow Flight server failed");
                            }
                        }),
                    ));
                    let reader = query::cluster::ClusterReader::new(
                        state.clone(),
                        storage.clone(),
                        metrics.clone(),
                        query::cluster::ReaderConfig::default(),
                    );
                    (
                        query::QueryEngine::with_cluster(
                            storage.clone(),
                            config.limits,
                            reader.clone(),
                        ),
                        query::promql::PromEngine::with_cluster(reader.clone(), config.prom),
                        query::remote_read::router_with_cluster(
                            reader.clone(),
                            remote_read_limits,
                            remote_read_metrics.clone(),
                        ),
                        Some(metrics),
                        Some(reader),
                    )
                }
                _ => (
                    query::QueryEngine::with_limits(storage.clone(), config.limits),
                    query::promql::PromEngine::with_limits(storage.clone(), config.prom),
                    query::remote_read::router(
                        storage.clone(),
                        remote_read_limits,
                        remote_read_metrics.clone(),
                    ),
                    None,
                    None,
                ),
            };
        // One guard for every query surface: the slots are the node's.
        let guard = Arc::new(query::limits::QueryGuard::new(config.query));
        let (engine, prom) = (
            engine
                .with_guard(guard.clone())
                .with_health(health.shared.clone()),
            prom.with_guard(guard.clone()),
        );
        let promql_metrics = prom.metrics().clone();
        let fleet = crate::fleet::router(
            health.shared.clone(),
            prom.clone(),
            storage.clone(),
            cluster_reader.clone(),
        );
        let router = query::http::router(engine.clone())
            .merge(query::promql::api::router(prom))
            .merge(fleet)
            .merge(remote_read.layer(axum::middleware::from_fn_with_state(
                guard.clone(),
                query::limits::read_slot,
            )))
            .merge(remote_write)
            .merge(crate::health::router(health.shared.clone(), cluster_reader))
            .merge(crate::node_metrics::router(
                crate::node_metrics::NodeMetrics {
                    storage: storage.clone(),
                    ingest: ingest_metrics,
                    query: engine.metrics().clone(),
                    promql: promql_metrics,
                    remote_write: remote_write_metrics,
                    remote_read: remote_read_metrics,
                    readonly: engine.readonly_metrics().clone(),
                    guard: guard.metrics().clone(),
                    cluster: cluster_metrics,
                    http: edge_metrics.clone(),
                    health: health.shared.metrics.clone(),
                    auth: config.auth.as_ref().map(|g| g.metrics().clone()),
                    tls: config.tls.as_ref().map(|t| t.metrics().clone()),
                },
            ))
            .merge(
                admin_router(storage.clone()).layer(axum::middleware::from_fn_with_state(
                    edge_metrics.clone(),
                    same_origin_only,
                )),
            );
        let router = match &config.auth {
            Some(gate) => router.layer(axum::middleware::from_fn_with_state(
                gate.clone(),
                crate::access::check,
            )),
            None => router,
        };
        let fut = query::http::serve_with(
            http,
            router,
            edges.http,
            edge_metrics,
            config.tls.clone(),
            stopped(&stop),
        );
        tasks.push((
            "http",
            tokio::spawn(async move {
                if let Err(e) = fut.await {
                    error!(error = %e, "HTTP server failed");
                }
            }),
        ));
        if let Some(pg) = pg {
            let fut = query::pg::serve(
                pg,
                engine,
                config.auth.clone(),
                config.tls.clone(),
                stopped(&stop),
            );
            tasks.push((
                "postgres",
                tokio::spawn(async move {
                    if let Err(e) = fut.await {
                        error!(error = %e, "PostgreSQL server failed");
                    }
                }),
            ));
        }

        if config.tls.is_some() || config.auth.is_some() {
            tasks.push((
                "reload",
                reload_on_sighup(config.tls.clone(), config.auth.clone(), stop.subscribe())?,
            ));
        }
        let (st, every, mut rx) = (storage.clone(), config.flush_interval, stop.subscribe());
        // A full head wakes the flush task ahead of its timer.
        let full = Arc::new(tokio::sync::Notify::new());
        let wake = full.clone();
        if storage
            .set_on_full(Box::new(move || wake.notify_one()))
            .is_err()
        {
            warn!("the storage already had a full-head hook; flushes follow the timer only");
        }
        tasks.push((
            "flush",
            tokio::spawn(async move {
                let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
                loop {
                    tokio::select! {
                        () = full.notified() => {
                            info!("the head is full (--head-max-samples): flushing ahead of the timer");
                            // The next timed flush is a whole interval away.
                            tick.reset();
                        }
                        _ = tick.tick() => {}
                        _ = rx.changed() => return,
                    }
                    let st = st.clone();
                    match tokio::task::spawn_blocking(move || maintain(&st)).await {
                        // Storage logs a failure once per cause and counts each one.
                        Ok(Err(e)) => tracing::debug!(error = %e, "flush failed"),
                        Err(e) => error!(error = %e, "flush task panicked"),
                        Ok(Ok(())) => {}
                    }
                }
            }),
        ));
        // Free memory back to the OS between flushes too: glibc keeps what
        // ingest frees (decoded batches, a sealed chunk's re-encoding, grown
        // chunk buffers) in the middle of its heaps, where only `malloc_trim`
        // reaches it (70 MiB of a 1,000-GPU backfill's 261 MiB). jemalloc
        // decays its dirty pages on a 10 s clock by default; this does the
        // same.
        let mut rx = stop.subscribe();
        tasks.push((
            "trim",
            tokio::spawn(async move {
                let mut tick =
                    tokio::time::interval_at(tokio::time::Instant::now() + TRIM_EVERY, TRIM_EVERY);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = rx.changed() => return,
                    }
                    let started = std::time::Instant::now();
                    if tokio::task::spawn_blocking(storage::malloc::release_free_memory)
                        .await
                        .is_err()
                    {
                        return;
                    }
                    tracing::debug!(
                        elapsed_us = started.elapsed().as_micros() as u64,
                        "free memory handed back to the OS"
                    );
                }
            }),
        ));
        info!(grpc = %grpc_addr, http = %http_addr, postgres = ?pg_addr, flight = ?flight_addr, "serving");
        Ok(Self {
            grpc_addr,
            http_addr,
            pg_addr,
            storage,
            cluster,
            stop,
            tasks,
            health,
        })
    }

    /// Stops accepting, ends open streams and requests (waiting at most 10 s
    /// per server), then flushes the head so that a restart answers for it.
    pub(crate) async fn shutdown(self) -> anyhow::Result<()> {
        info!("shutting down");
        self.stop.send_replace(true);
        for (name, task) in self.tasks {
            if tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .is_err()
            {
                warn!(task = name, "did not stop within 10 s; abandoning it");
            }
        }
        let health = self.health;
        tokio::task::spawn_blocking(move || health.stop()).await?;
        let st = self.storage.clone();
        match tokio::task::spawn_blocking(move || st.flush()).await? {
            Ok(Some(s)) => info!(samples = s.samples, "final flush done"),
            Ok(None) => info!("final flush: nothing to write"),
            Err(e) => return Err(e).context("final flush"),
        }
        Ok(())
    }
}
