//! The Arrow Flight service every node runs for its peers: `DoGet` with a
//! select ticket ([`super::wire`]) streams the matching series of the listed
//! shards from the local storage (or their rollup records, or their health
//! events or GPU states from the node's health engine). Every other Flight
//! call is `UNIMPLEMENTED`.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use arrow::array::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use storage::Storage;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::{Request, Response, Status, Streaming};
use tracing::{debug, warn};

use super::reader::local_health;
use super::wire::{self, BatchBuilder, ROW_SAMPLES};
use super::{ClusterMetrics, ShardFilter, shard_rollups};
use crate::health_events::{
    HealthSource, events_batch, health_events_schema, states_batch, states_schema,
};

/// The Flight service over one node's storage.
#[derive(Debug, Clone)]
pub struct FlightNode {
    storage: Arc<Storage>,
    metrics: Arc<ClusterMetrics>,
    /// The node's health engine, for health tickets.
    health: Option<Arc<dyn HealthSource>>,
    /// How long one DoGet may stream (`--query-timeout`).
    timeout: std::time::Duration,
}

impl FlightNode {
    pub fn new(storage: Arc<Storage>, metrics: Arc<ClusterMetrics>) -> Self {
        Self {
            storage,
            metrics,
            health: None,
            timeout: crate::limits::QueryLimits::default().timeout,
        }
    }

    /// Answers health tickets from `source`; without it they are refused.
    pub fn with_health(mut self, source: Arc<dyn HealthSource>) -> Self {
        self.health = Some(source);
        self
    }

    /// The answer to a `sql` ticket: the statement's result over the
    /// `samples` of `shards` alone, in the statement's schema.
    async fn sql_answer(
        &self,
        sql: &str,
        shards: std::collections::BTreeSet<cluster::ShardKey>,
    ) -> Result<Response<BoxStream<'static, Result<FlightData, Status>>>, Status> {
        let filter = super::ShardFilter::only(shards);
        let run = crate::sql_pushdown::run_partial(self.storage.clone(), filter, sql);
        let (schema, batches) = match tokio::time::timeout(self.timeout, run).await {
            Err(_) => {
                return Err(Status::deadline_exceeded(format!(
                    "the SQL ticket ran past {:?}",
                    self.timeout
                )));
            }
            Ok(Err(e)) => {
                warn!(error = %e, "a pushed-down SQL statement failed");
                return Err(Status::failed_precondition(format!(
                    "running the SQL ticket: {e}"
                )));
            }
            Ok(Ok(answer)) => answer,
        };
        let batches = futures::stream::iter(batches.into_iter().map(Ok));
        Ok(Response::new(self.encode(schema, batches)))
    }

    /// `batches` as Flight data in `schema`, their bytes counted as sent.
    fn encode(
        &self,
        schema: arrow::datatypes::SchemaRef,
        batches: impl futures::Stream<Item = Result<RecordBatch, FlightError>> + Send + 'static,
    ) -> BoxStream<'static, Result<FlightData, Status>> {
        let sent = self.metrics.clone();
        FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches)
            .inspect_ok(move |d| {
                let bytes = d.data_header.len() + d.data_body.len();
                sent.flight_bytes_sent.fetch_add(bytes as u64, Relaxed);
            })
            .map_err(Status::from)
            .boxed()
    }

    /// Ends each DoGet with `DEADLINE_EXCEEDED` after `timeout`. A DoGet
    /// takes no query slot: it serves a peer's query, which holds one on
    /// its own node (a slot here too could deadlock two busy nodes).
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The tonic service, for a server of one's own.
    pub fn into_server(self) -> FlightServiceServer<Self> {
        FlightServiceServer::new(self)
    }
}

/// Serves the node's Flight service on `listener` until `shutdown`
/// resolves. Counters go to `metrics` (render them with
/// [`ClusterMetrics::render`]); health tickets are answered from `health`.
///
/// # Errors
/// Transport errors of the gRPC server.
pub async fn serve_flight(
    listener: TcpListener,
    storage: Arc<Storage>,
    metrics: Arc<ClusterMetrics>,
    health: Option<Arc<dyn HealthSource>>,
    timeout: std::time::Duration,
    access: auth::Access,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let mut node = FlightNode::new(storage, metrics).with_timeout(timeout);
    if let Some(h) = health {
        node = node.with_health(h);
    }
    // Peers read with the cluster token: the read scope.
    let router = tonic::transport::Server::builder().add_service(
        tonic::service::interceptor::InterceptedService::new(
            node.into_server(),
            auth::interceptor(access.tokens, auth::Surface::Flight, auth::Scope::Read),
        ),
    );
    match access.tls {
        Some(tls) => {
            router
                .serve_with_incoming_shutdown(
                    tls.incoming(listener, auth::tls::Listener::Flight),
                    shutdown,
                )
                .await
        }
        None => {
            router
                .serve_with_incoming_shutdown(nodelay(listener), shutdown)
                .await
        }
    }
}

/// The listener's connections, each with `TCP_NODELAY` (as the TLS path
/// sets it): an answer's last small segment must not wait for the peer's
/// delayed ACK, 40 ms on Linux, which every cluster query paid.
fn nodelay(
    listener: TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    TcpListenerStream::new(listener).map_ok(|s| {
        let _ = s.set_nodelay(true);
        s
    })
}

fn unimplemented(call: &str) -> Status {
    Status::unimplemented(format!(
        "gpulse nodes answer only DoGet with a select ticket, not {call}"
    ))
}

/// Reads the selected series of `req` into batches and sends them into
/// `tx`; runs on a blocking thread. Stops when the receiver is gone.
fn produce(
    storage: &Arc<Storage>,
    health: Option<&dyn HealthSource>,
    req: &wire::SelectRequest,
    metrics: &ClusterMetrics,
    deadline: crate::limits::Deadline,
    tx: &mpsc::Sender<Result<RecordBatch, FlightError>>,
) {
    if let Some(part) = req.health {
        let batch = match health {
            None => Err(FlightError::Tonic(Box::new(Status::failed_precondition(
                "this node runs no health engine",
            )))),
            Some(source) => {
                let a = local_health(source, part, req.min_ts, |k| req.shards.contains(k));
                match part {
                    wire::HealthPart::Events => events_batch(&a.events),
                    wire::HealthPart::States => states_batch(&a.states),
                }
                .map_err(FlightError::Arrow)
            }
        };
        let _ = tx.blocking_send(batch);
        return;
    }
    if let Some(p) = &req.promql {
        let filter = super::ShardFilter::only(req.shards.clone());
        let rows = match crate::promql::pushdown_partials(storage, filter, p, deadline) {
            Ok(rows) => rows,
            Err(e) => {
                warn!(error = %e, "a pushed-down PromQL evaluation failed");
                let _ = tx.blocking_send(Err(FlightError::Tonic(Box::new(
                    Status::failed_precondition(format!("evaluating the PromQL ticket: {e}")),
                ))));
                return;
            }
        };
        let mut b = BatchBuilder::new();
        for r in &rows {
            let labels = r.labels.iter().map(|(n, v)| (n.as_str(), v.as_str()));
            let query = r.query.to_string();
            for (t, v) in r.ts.chunks(ROW_SAMPLES).zip(r.values.chunks(ROW_SAMPLES)) {
                b.push_labels(&query, labels.clone(), t, v);
                if b.full() && tx.blocking_send(Ok(b.finish())).is_err() {
                    return;
                }
            }
        }
        if b.rows() > 0 {
            let _ = tx.blocking_send(Ok(b.finish()));
        }
        return;
    }
    if let Some(r) = &req.rollups {
        let map = shard_rollups(storage, r, req.min_ts, req.max_ts, |k| {
            req.shards.contains(k)
        });
        for b in wire::rollup_batches(&map) {
            if tx.blocking_send(Ok(b)).is_err() {
                return;
            }
        }
        return;
    }
    let filter = ShardFilter::only(req.shards.clone());
    let selected = filter.select_series(storage, &req.matchers, req.min_ts, req.max_ts);
    let mut b = BatchBuilder::new();
    let (mut ts, mut values) = (Vec::new(), Vec::new());
    let (mut series, mut samples) = (0u64, 0u64);
    for s in selected {
        ts.clear();
        values.clear();
        if req.labels_only {
            series += 1;
            b.push(&s.key, &[], &[]);
            if b.full() && tx.blocking_send(Ok(b.finish())).is_err() {
                return;
            }
            continue;
        }
        if let Err(e) = s.read_into(req.min_ts, req.max_ts, &mut ts, &mut values) {
            metrics.flight_read_errors.fetch_add(1, Relaxed);
            warn!(series = %s.key, error = %e, "a Flight select failed reading storage");
            let _ = tx.blocking_send(Err(FlightError::Tonic(Box::new(Status::internal(
                format!("reading {}: {e}", s.key),
            )))));
            return;
        }
        if ts.is_empty() {
            continue;
        }
        series += 1;
        samples += ts.len() as u64;
        for (t, v) in ts.chunks(ROW_SAMPLES).zip(values.chunks(ROW_SAMPLES)) {
            b.push(&s.key, t, v);
            if b.full() && tx.blocking_send(Ok(b.finish())).is_err() {
                return;
            }
        }
    }
    if b.rows() > 0 && tx.blocking_send(Ok(b.finish())).is_err() {
        return;
    }
    metrics.flight_series_sent.fetch_add(series, Relaxed);
    metrics.flight_samples_sent.fetch_add(samples, Relaxed);
}

#[tonic::async_trait]
impl FlightService for FlightNode {
    type HandshakeStream = BoxStream<'static, Result<HandshakeResponse, Status>>;
    type ListFlightsStream = BoxStream<'static, Result<FlightInfo, Status>>;
    type DoGetStream = BoxStream<'static, Result<FlightData, Status>>;
    type DoPutStream = BoxStream<'static, Result<PutResult, Status>>;
    type DoActionStream = BoxStream<'static, Result<arrow_flight::Result, Status>>;
    type ListActionsStream = BoxStream<'static, Result<ActionType, Status>>;
    type DoExchangeStream = BoxStream<'static, Result<FlightData, Status>>;

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        self.metrics.flight_requests.fetch_add(1, Relaxed);
        let peer = request.remote_addr();
        let req = match wire::decode_ticket(&request.into_inner().ticket) {
            Ok(r) => r,
            Err(e) => {
                self.metrics.flight_bad_tickets.fetch_add(1, Relaxed);
                warn!(?peer, error = %e, "refused a Flight ticket");
                return Err(Status::invalid_argument(e));
            }
        };
        debug!(
            ?peer,
            shards = req.shards.len(),
            min = req.min_ts,
            max = req.max_ts,
            "flight select"
        );
        if let Some(sql) = &req.sql {
            return self.sql_answer(sql, req.shards.clone()).await;
        }
        // Decoding blocks: a blocking thread fills a small queue of batches,
        // so that a slow reader holds back the producer.
        let schema = match (&req.rollups, req.health) {
            (Some(_), _) => wire::rollup_schema(),
            (None, Some(wire::HealthPart::Events)) => health_events_schema(),
            (None, Some(wire::HealthPart::States)) => states_schema(),
            (None, None) => wire::schema(),
        };
        let (tx, rx) = mpsc::channel(4);
        let (storage, metrics) = (self.storage.clone(), self.metrics.clone());
        let health = self.health.clone();
        // Past the deadline the stream ends with an error, never silently
        // (a peer must not take a cut answer for a whole one); the producer
        // stops at its next send, or a PromQL evaluation at its deadline.
        let deadline = crate::limits::Deadline::after(self.timeout);
        tokio::task::spawn_blocking(move || {
            produce(&storage, health.as_deref(), &req, &metrics, deadline, &tx);
        });
        let batches =
            futures::stream::unfold(Some(ReceiverStream::new(rx)), move |rx| async move {
                let mut rx = rx?;
                let timed_out = || {
                    let r = deadline
                        .check()
                        .err()
                        .unwrap_or(crate::limits::Refusal::Timeout {
                            limit: deadline.limit(),
                            waited: false,
                        });
                    FlightError::Tonic(Box::new(Status::deadline_exceeded(r.to_string())))
                };
                if deadline.check().is_err() {
                    return Some((Err(timed_out()), None));
                }
                match tokio::time::timeout_at(deadline.instant(), rx.next()).await {
                    Err(_elapsed) => Some((Err(timed_out()), None)),
                    Ok(None) => None,
                    Ok(Some(item)) => Some((item, Some(rx))),
                }
            });
        Ok(Response::new(self.encode(schema, batches)))
    }

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        Err(unimplemented("Handshake"))
    }

    async fn list_flights(
        &self,
        _: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        Err(unimplemented("ListFlights"))
    }

    async fn get_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(unimplemented("GetFlightInfo"))
    }

    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(unimplemented("PollFlightInfo"))
    }

    async fn get_schema(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(unimplemented("GetSchema"))
    }

    async fn do_put(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        Err(unimplemented("DoPut"))
    }

    async fn do_exchange(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        Err(unimplemented("DoExchange"))
    }

    async fn do_action(
        &self,
        _: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        Err(unimplemented("DoAction"))
    }

    async fn list_actions(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        Err(unimplemented("ListActions"))
    }
}
