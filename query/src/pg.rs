//! The PostgreSQL wire protocol over the [`QueryEngine`].
//!
//! `psql`, Grafana's PostgreSQL data source and other PostgreSQL clients
//! connect here and run SQL on the same DataFusion context as
//! `POST /api/v1/sql`. The protocol (simple and extended query, text and
//! binary results) and the `pg_catalog` schema come from `datafusion-postgres`
//! (built on `pgwire`); this module adds what gpulse needs around it:
//!
//! - read-only: a hook runs the guard of [`crate::readonly`], the same as
//!   HTTP's, on the plan of each statement: anything that would write (DDL,
//!   `SELECT … INTO`, DML, `COPY`, SQL `PREPARE`, a `SET` of the shared
//!   settings) is refused with SQLSTATE 25006. The `SET`s that only touch
//!   the connection, transaction and cursor statements pass.
//! - result limits: each result's rows and encoded bytes are counted as they
//!   are sent; past [`ResultLimits`] the query stops with SQLSTATE 54000.
//! - errors carry a PostgreSQL SQLSTATE: 42601 for syntax errors, 42703 for
//!   an unknown column, 42P01 for an unknown table, 42000 for other planning
//!   errors, 0A000 for what DataFusion does not support, XX000 for failures
//!   while running. The connection stays usable after any of them.
//!
//! - cluster mode: a result that lacks a shard (see [`crate::cluster`]) is
//!   preceded by one NoticeResponse per warning (severity WARNING, SQLSTATE
//!   01000); psql prints them as `WARNING:  partial result: ...`.
//!
//! - TLS: with `--tls-cert`, offered through `SSLRequest` and then
//!   required (a plaintext startup gets FATAL 28000).
//! - authentication: with a token file (`--auth-file`), the password is a
//!   gpulse token with the read scope, any user name (cleartext password
//!   exchange, inside TLS when TLS is on). Without one, any user name and
//!   database name are accepted.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::common::ParamValues;
use datafusion::error::DataFusionError;
use datafusion::logical_expr::LogicalPlan;
use datafusion::prelude::SessionContext;
use datafusion::sql::sqlparser::ast::Statement;
use datafusion::sql::sqlparser::parser::ParserError;
use datafusion_postgres::auth::AuthManager;
use datafusion_postgres::datafusion_pg_catalog::pg_catalog::setup_pg_catalog;
use datafusion_postgres::hooks::HookClient;
use datafusion_postgres::hooks::cursor::CursorStatementHook;
use datafusion_postgres::hooks::set_show::SetShowHook;
use datafusion_postgres::hooks::transactions::TransactionStatementHook;
use datafusion_postgres::pgwire;
use datafusion_postgres::{DfSessionService, QueryHook};
use futures::{Sink, SinkExt, StreamExt};
use pgwire::api::Type;
use pgwire::api::auth::StartupHandler;
use pgwire::api::auth::noop::NoopStartupHandler;
use pgwire::api::cancel::{CancelHandler, DefaultCancelHandler};
use pgwire::api::portal::Format;
use pgwire::api::portal::Portal;
use pgwire::api::query::{ExtendedQueryHandler, SimpleQueryHandler};
use pgwire::api::results::{FieldInfo, QueryResponse, Response};
use pgwire::api::stmt::QueryParser;
use pgwire::api::store::PortalStore;
use pgwire::api::{
    ClientInfo, ClientPortalStore, ConnectionManager, ErrorHandler, PgWireServerHandlers,
};
use pgwire::error::{ErrorInfo, PgWireError, PgWireResult};
use pgwire::messages::PgWireBackendMessage;
use pgwire::messages::response::NoticeResponse;
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tracing::{debug, warn};

use crate::limits::{Deadline, QueryGuard, Slot};
use crate::readonly::{self, ReadOnlyMetrics, Refusal};
use crate::{LimitCounter, LimitExceeded, QueryEngine, ResultLimits};

/// Registers `pg_catalog` (tables and functions) in `ctx`, under the
/// default catalog where `samples` lives.
pub(crate) fn setup_catalog(ctx: &SessionContext) {
    let catalog = ctx
        .state()
        .config()
        .options()
        .catalog
        .default_catalog
        .clone();
    setup_pg_catalog(ctx, &catalog, Arc::new(AuthManager::default()))
        .expect("BUG: the default catalog exists in a fresh context");
}

/// Serves the PostgreSQL protocol on `listener` until `shutdown` resolves.
/// Then it stops accepting and closes open connections: a PostgreSQL
/// connection is a session that may stay idle for hours, and a query cut
/// short changes nothing (all are read-only).
///
/// # Errors
/// None at present; the `Result` mirrors [`crate::http::serve`].
pub async fn serve(
    listener: TcpListener,
    engine: QueryEngine,
    auth: Option<Arc<auth::Gate>>,
    tls: Option<Arc<auth::tls::ServerTls>>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let registry = Arc::new(ConnectionManager::new());
    // Connections run on the query runtime: statements are parsed and planned
    // there, on threads with room for deep trees, apart from ingest.
    let runtime = engine.guard().handle();
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((socket, peer)) => {
                    // Handlers of its own: a context whose memory pool is this
                    // connection's (it runs one statement at a time).
                    let handlers = Arc::new(Handlers::new(&engine, registry.clone(), auth.clone(), tls.is_some()));
                    // The files in force when the connection came.
                    let acceptor = tls.as_ref().map(|t| t.acceptor(auth::tls::Listener::Postgres));
                    connections.spawn_on(async move {
                        if let Err(e) = pgwire::tokio::process_socket(socket, acceptor, handlers).await {
                            debug!(%peer, error = %e, "PostgreSQL connection ended with an error");
                        }
                    }, &runtime);
                }
                Err(e) => {
                    // E.g. out of file descriptors: wait instead of spinning.
                    warn!(error = %e, "accepting a PostgreSQL connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
    Ok(())
}

/// The pgwire handlers of one connection.
struct Handlers {
    service: Arc<LimitedService>,
    startup: Arc<Startup>,
    cancel: Arc<DefaultCancelHandler>,
}

impl Handlers {
    fn new(
        engine: &QueryEngine,
        connections: Arc<ConnectionManager>,
        auth: Option<Arc<auth::Gate>>,
        tls: bool,
    ) -> Self {
        let hooks: Vec<Arc<dyn QueryHook>> = vec![
            Arc::new(ReadOnlyHook {
                metrics: engine.readonly_metrics().clone(),
            }),
            Arc::new(CursorStatementHook),
            Arc::new(SetShowHook),
            Arc::new(TransactionStatementHook),
        ];
        let context = Arc::new(engine.guard().session(engine.context()));
        let inner = DfSessionService::new_with_hooks(context, hooks);
        let parser = Arc::new(LimitedParser {
            inner: inner.query_parser(),
            guard: engine.guard().clone(),
        });
        Self {
            service: Arc::new(LimitedService {
                inner,
                parser,
                limits: engine.limits(),
                guard: engine.guard().clone(),
            }),
            startup: Arc::new(Startup {
                open: Open {
                    connections: connections.clone(),
                },
                auth,
                tls,
                pending: std::sync::Mutex::new(None),
            }),
            cancel: Arc::new(DefaultCancelHandler::new(connections)),
        }
    }
}

impl PgWireServerHandlers for Handlers {
    fn simple_query_handler(&self) -> Arc<impl SimpleQueryHandler> {
        self.service.clone()
    }

    fn extended_query_handler(&self) -> Arc<impl ExtendedQueryHandler> {
        self.service.clone()
    }

    fn startup_handler(&self) -> Arc<impl StartupHandler> {
        self.startup.clone()
    }

    fn error_handler(&self) -> Arc<impl ErrorHandler> {
        Arc::new(SqlStateErrors {
            guard: self.service.guard.clone(),
        })
    }

    fn cancel_handler(&self) -> Arc<impl CancelHandler> {
        self.cancel.clone()
    }
}

/// Registers the connection so that a cancel request (Ctrl-C in psql) can
/// find it; accepts every client.
struct Open {
    connections: Arc<ConnectionManager>,
}

impl NoopStartupHandler for Open {
    fn connection_manager(&self) -> Option<Arc<ConnectionManager>> {
        Some(self.connections.clone())
    }
}

/// With a token file (`--auth-file`), asks for a password and takes a token
/// with the read scope (any user name), then goes on as [`Open`]; without
/// one, is [`Open`]. A refusal is FATAL 28P01 and closes the connection.
struct Startup {
    open: Open,
    auth: Option<Arc<auth::Gate>>,
    /// TLS is offered, and then required: a plaintext startup is refused.
    tls: bool,
    /// The client's startup message while its password is awaited.
    pending: std::sync::Mutex<Option<pgwire::messages::startup::Startup>>,
}

#[async_trait]
impl StartupHandler for Startup {
    async fn on_startup<C>(
        &self,
        client: &mut C,
        message: pgwire::messages::PgWireFrontendMessage,
    ) -> PgWireResult<()>
    where
        C: ClientInfo + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        use pgwire::messages::PgWireFrontendMessage as Message;
        if self.tls && !client.is_secure() && matches!(message, Message::Startup(_)) {
            return Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                "FATAL".into(),
                "28000".into(),
                "this node takes TLS connections only: connect with sslmode=require or verify-full"
                    .into(),
            ))));
        }
        let Some(gate) = &self.auth else {
            return self.open.on_startup(client, message).await;
        };
        match message {
            Message::Startup(mut startup) => {
                pgwire::api::auth::protocol_negotiation(client, &startup).await?;
                // Replayed after the password as the version now agreed, so
                // that it is not negotiated twice.
                let (major, minor) = client.protocol_version().version_number();
                startup.protocol_number_major = major;
                startup.protocol_number_minor = minor;
                client.set_state(pgwire::api::PgWireConnectionState::AuthenticationInProgress);
                *self.pending.lock().unwrap_or_else(|e| e.into_inner()) = Some(startup);
                client
                    .send(PgWireBackendMessage::Authentication(
                        pgwire::messages::startup::Authentication::CleartextPassword,
                    ))
                    .await?;
                Ok(())
            }
            Message::PasswordMessageFamily(password) => {
                let password = password.into_password()?;
                let denial = if password.password.is_empty() {
                    Some(auth::Denial::Missing)
                } else {
                    gate.tokens()
                        .authorize(&password.password, auth::Scope::Read)
                        .err()
                };
                let startup = self
                    .pending
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .take();
                match (denial, startup) {
                    (None, Some(startup)) => {
                        self.open
                            .on_startup(client, Message::Startup(startup))
                            .await
                    }
                    (Some(d), _) => {
                        gate.refused(auth::Surface::Postgres, &d);
                        let message = match d {
                            auth::Denial::Missing => {
                                "password authentication failed: give a gpulse token with the read scope as the password".to_owned()
                            }
                            d => format!("password authentication failed: {d}"),
                        };
                        Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                            "FATAL".into(),
                            "28P01".into(),
                            message,
                        ))))
                    }
                    (None, None) => Err(PgWireError::UserError(Box::new(ErrorInfo::new(
                        "FATAL".into(),
                        "08P01".into(),
                        "a password message before the startup message".into(),
                    )))),
                }
            }
            _ => Ok(()),
        }
    }
}

/// datafusion-postgres' session service with [`ResultLimits`] on every
/// result and the [`QueryLimits`](crate::limits::QueryLimits) on every
/// statement: length and depth before it is planned, a query slot held
/// until its last row is sent, and `--query-timeout` over planning and rows.
struct LimitedService {
    inner: DfSessionService,
    parser: Arc<LimitedParser>,
    limits: ResultLimits,
    guard: Arc<QueryGuard>,
}

impl LimitedService {
    fn limit(&self, response: Response, run: &Arc<Running>) -> Response {
        match response {
            Response::Query(q) => Response::Query(limit_rows(q, self.limits, run.clone())),
            other => other,
        }
    }

    /// Waits for a query slot, then runs `fut` until the deadline.
    async fn guarded<T>(
        &self,
        fut: impl std::future::Future<Output = T>,
    ) -> PgWireResult<(T, Arc<Running>)> {
        let deadline = self.guard.deadline();
        let slot = self
            .guard
            .slot(deadline)
            .await
            .map_err(|r| refusal_error(&r))?;
        let run = Arc::new(Running {
            _slot: slot,
            deadline,
            guard: self.guard.clone(),
        });
        match tokio::time::timeout_at(deadline.instant(), fut).await {
            Ok(out) => Ok((out, run)),
            Err(_elapsed) => Err(run.timed_out()),
        }
    }
}

/// A statement that holds a query slot, until its rows are all sent.
struct Running {
    _slot: Slot,
    deadline: Deadline,
    guard: Arc<QueryGuard>,
}

impl Running {
    fn timed_out(&self) -> PgWireError {
        self.guard.count_timeout();
        match self.deadline.check() {
            Err(r) => refusal_error(&r),
            Ok(()) => refusal_error(&crate::limits::Refusal::Timeout {
                limit: self.guard.limits().timeout,
                waited: false,
            }),
        }
    }
}

/// A running statement of `guard`, with its slot taken, for tests of
/// [`limit_rows`].
#[cfg(test)]
async fn running(guard: &Arc<QueryGuard>) -> Arc<Running> {
    let deadline = guard.deadline();
    Arc::new(Running {
        _slot: guard.slot(deadline).await.unwrap(),
        deadline,
        guard: guard.clone(),
    })
}

fn refusal_error(r: &crate::limits::Refusal) -> PgWireError {
    user_error(r.sqlstate(), r.to_string())
}

/// datafusion-postgres' parser of the extended protocol, after the length
/// and depth checks.
struct LimitedParser {
    inner: Arc<<DfSessionService as ExtendedQueryHandler>::QueryParser>,
    guard: Arc<QueryGuard>,
}

#[async_trait]
impl QueryParser for LimitedParser {
    type Statement = <DfSessionService as ExtendedQueryHandler>::Statement;

    async fn parse_sql<C>(
        &self,
        client: &C,
        sql: &str,
        types: &[Option<Type>],
    ) -> PgWireResult<Option<Self::Statement>>
    where
        C: ClientInfo + Unpin + Send + Sync,
    {
        self.guard.check_sql(sql).map_err(|r| refusal_error(&r))?;
        self.inner.parse_sql(client, sql, types).await
    }

    fn get_parameter_types(&self, stmt: &Self::Statement) -> PgWireResult<Vec<Type>> {
        self.inner.get_parameter_types(stmt)
    }

    fn get_result_schema(
        &self,
        stmt: &Self::Statement,
        column_format: Option<&Format>,
    ) -> PgWireResult<Vec<FieldInfo>> {
        self.inner.get_result_schema(stmt, column_format)
    }
}

/// Wraps a result's row stream so that it ends with an error as soon as the
/// rows sent pass `limits` or the statement's deadline. Rows are counted as
/// they are encoded, so nothing beyond one batch is held. The stream holds
/// the statement's query slot.
fn limit_rows(
    mut response: QueryResponse,
    limits: ResultLimits,
    run: Arc<Running>,
) -> QueryResponse {
    let tag = response.command_tag().to_owned();
    let rows = std::mem::replace(&mut response.data_rows, Box::pin(futures::stream::empty()));
    let counter = LimitCounter::new(limits);
    // Each row is awaited until the deadline at most: a statement such as
    // `count(*)` computes its whole answer before its first row.
    let rows = futures::stream::unfold(Some((rows, counter, run)), |state| async move {
        let (mut rows, mut counter, run) = state?;
        if run.deadline.check().is_err() {
            return Some((Err(run.timed_out()), None));
        }
        let row = match tokio::time::timeout_at(run.deadline.instant(), rows.next()).await {
            Err(_elapsed) => return Some((Err(run.timed_out()), None)),
            Ok(None) => return None,
            Ok(Some(row)) => row,
        };
        let item = row.and_then(|row| match counter.add(1, row.data.len() as u64) {
            Ok(()) => Ok(row),
            Err(e) => Err(limit_error(&e)),
        });
        // After an error the stream ends (and lets go of its slot).
        let next = item.is_ok().then_some((rows, counter, run));
        Some((item, next))
    });
    let mut limited = QueryResponse::new(response.row_schema(), rows);
    limited.set_command_tag(&tag);
    limited
}

/// Sends each warning as a NoticeResponse (severity WARNING, 01000).
async fn send_warnings<C>(client: &mut C, warnings: &[String]) -> PgWireResult<()>
where
    C: Sink<PgWireBackendMessage> + Unpin,
    PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
{
    if warnings.is_empty() {
        return Ok(());
    }
    for w in warnings {
        let notice = ErrorInfo::new("WARNING".to_owned(), "01000".to_owned(), w.clone());
        client
            .feed(PgWireBackendMessage::NoticeResponse(NoticeResponse::from(
                notice,
            )))
            .await?;
    }
    client.flush().await?;
    Ok(())
}

fn limit_error(e: &LimitExceeded) -> PgWireError {
    // 54000: program_limit_exceeded.
    user_error("54000", e.to_string())
}

fn user_error(code: &str, message: String) -> PgWireError {
    PgWireError::UserError(Box::new(ErrorInfo::new(
        "ERROR".to_owned(),
        code.to_owned(),
        message,
    )))
}

#[async_trait]
impl SimpleQueryHandler for LimitedService {
    async fn do_query<C>(&self, client: &mut C, query: &str) -> PgWireResult<Vec<Response>>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        self.guard.check_sql(query).map_err(|r| refusal_error(&r))?;
        // The statements are planned (and their scans run their cluster
        // reads) inside the inner call: their warnings are collected there.
        let ((responses, warnings), run) = self
            .guarded(crate::cluster::collect_sql_warnings(
                <DfSessionService as SimpleQueryHandler>::do_query(&self.inner, client, query),
            ))
            .await?;
        send_warnings(client, &warnings).await?;
        Ok(responses?
            .into_iter()
            .map(|r| self.limit(r, &run))
            .collect())
    }
}

#[async_trait]
impl ExtendedQueryHandler for LimitedService {
    type Statement = <DfSessionService as ExtendedQueryHandler>::Statement;
    type QueryParser = LimitedParser;

    fn query_parser(&self) -> Arc<Self::QueryParser> {
        self.parser.clone()
    }

    async fn do_query<C>(
        &self,
        client: &mut C,
        portal: &Portal<Self::Statement>,
        max_rows: usize,
    ) -> PgWireResult<Response>
    where
        C: ClientInfo + ClientPortalStore + Sink<PgWireBackendMessage> + Unpin + Send + Sync,
        C::PortalStore: PortalStore<Statement = Self::Statement>,
        C::Error: std::fmt::Debug,
        PgWireError: From<<C as Sink<PgWireBackendMessage>>::Error>,
    {
        let ((response, warnings), run) = self
            .guarded(crate::cluster::collect_sql_warnings(
                <DfSessionService as ExtendedQueryHandler>::do_query(
                    &self.inner,
                    client,
                    portal,
                    max_rows,
                ),
            ))
            .await?;
        send_warnings(client, &warnings).await?;
        Ok(self.limit(response?, &run))
    }
}

/// The read-only guard ([`crate::readonly`]) in front of datafusion-postgres,
/// in both the simple and the extended protocol; lets everything else
/// through to the next hooks.
///
/// Simple protocol: the statement is planned from its text, as
/// datafusion-postgres will plan it, and the plan is checked. Extended
/// protocol: the same check at Parse, so that a write fails early, and the
/// prepared plan itself at Execute (that plan is what runs).
struct ReadOnlyHook {
    metrics: Arc<ReadOnlyMetrics>,
}

impl ReadOnlyHook {
    fn refuse(&self, refusal: &Refusal) -> PgWireError {
        self.metrics.pg_refused.fetch_add(1, Relaxed);
        debug!(what = %refusal.what, "read-only: statement refused");
        user_error(readonly::SQLSTATE, refusal.to_string())
    }

    async fn check(&self, statement: &Statement, ctx: &SessionContext) -> Option<PgWireError> {
        readonly::check_pg_statement(ctx, statement)
            .await
            .err()
            .map(|r| self.refuse(&r))
    }
}

#[async_trait]
impl QueryHook for ReadOnlyHook {
    async fn handle_simple_query(
        &self,
        statement: &Statement,
        session_context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        self.check(statement, session_context).await.map(Err)
    }

    async fn handle_extended_parse_query(
        &self,
        statement: &Statement,
        session_context: &SessionContext,
        _client: &(dyn ClientInfo + Send + Sync),
    ) -> Option<PgWireResult<LogicalPlan>> {
        self.check(statement, session_context).await.map(Err)
    }

    async fn handle_extended_query(
        &self,
        _statement: &Statement,
        logical_plan: &LogicalPlan,
        _params: &ParamValues,
        _session_context: &SessionContext,
        _client: &mut dyn HookClient,
    ) -> Option<PgWireResult<Response>> {
        // The statement passed the check at Parse (statements the later
        // hooks answer themselves, connection SETs and cursors, were
        // decided there and carry a placeholder plan); this is the plan
        // that runs.
        readonly::check(logical_plan)
            .err()
            .map(|r| Err(self.refuse(&r)))
    }
}

/// Gives DataFusion and parser errors a PostgreSQL SQLSTATE and the same
/// message as the HTTP API; other errors keep pgwire's mapping.
struct SqlStateErrors {
    guard: Arc<QueryGuard>,
}

impl ErrorHandler for SqlStateErrors {
    fn on_error<C>(&self, _client: &C, error: &mut PgWireError)
    where
        C: ClientInfo,
    {
        // A query past its memory pool: 53200, counted as over HTTP.
        if let PgWireError::ApiError(e) = error
            && let Some(e) = e.downcast_ref::<DataFusionError>()
            && let Some(r) = self.guard.memory_refusal(e)
        {
            *error = refusal_error(&r);
            return;
        }
        with_sqlstate(error);
    }
}

fn with_sqlstate(error: &mut PgWireError) {
    if let Some((code, message)) = sqlstate(error) {
        debug!(code, %message, "query failed");
        *error = user_error(code, message);
    }
}

fn sqlstate(error: &PgWireError) -> Option<(&'static str, String)> {
    let PgWireError::ApiError(e) = error else {
        return None;
    };
    if let Some(p) = e.downcast_ref::<ParserError>() {
        return Some(("42601", p.to_string()));
    }
    let e = e.downcast_ref::<DataFusionError>()?;
    let code = match e.find_root() {
        DataFusionError::SQL(..) => "42601",
        DataFusionError::SchemaError(s, _) => match s.as_ref() {
            datafusion::common::SchemaError::FieldNotFound { .. } => "42703",
            _ => "42000",
        },
        DataFusionError::Plan(m) if m.contains("not found") && m.contains("table") => "42P01",
        DataFusionError::Plan(_) => "42000",
        DataFusionError::NotImplemented(_) => "0A000",
        _ => "XX000",
    };
    // The same text as over HTTP (QueryError shows the DataFusion error as is).
    Some((code, e.to_string()))
}

#[cfg(test)]
mod tests;
