//! gpulse read path: DataFusion tables over [`storage`] and the HTTP query API.
//!
//! [`QueryEngine`] owns a DataFusion `SessionContext` with the `samples` table
//! ([`samples`]) and the `gpus` inventory ([`gpus`]); [`http::router`] serves `POST /api/v1/sql` on top of it.
//! Queries are read-only: DDL, DML and SET statements are refused.

pub mod gpus;
pub mod http;
pub mod samples;

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use datafusion::error::DataFusionError;
use datafusion::execution::context::SQLOptions;
use datafusion::prelude::{SessionConfig, SessionContext};
use storage::Storage;

/// A SQL query failed. Maps to an HTTP status in [`http`].
#[derive(Debug, thiserror::Error)]
pub enum QueryError {
    /// The query is invalid: parse, plan or type errors (HTTP 400).
    #[error("{0}")]
    BadQuery(DataFusionError),
    /// The query was valid but failed while running (HTTP 500).
    #[error("{0}")]
    Execution(DataFusionError),
}

impl From<DataFusionError> for QueryError {
    fn from(e: DataFusionError) -> Self {
        match e.find_root() {
            DataFusionError::SQL(..)
            | DataFusionError::Plan(_)
            | DataFusionError::SchemaError(..)
            | DataFusionError::NotImplemented(_) => QueryError::BadQuery(e),
            _ => QueryError::Execution(e),
        }
    }
}

/// The result of a query: its schema and batches.
#[derive(Debug, Clone)]
pub struct QueryResult {
    pub schema: SchemaRef,
    pub batches: Vec<RecordBatch>,
}

impl QueryResult {
    pub fn num_rows(&self) -> usize {
        self.batches.iter().map(RecordBatch::num_rows).sum()
    }
}

/// Runs SQL over the tables of one storage.
#[derive(Clone)]
pub struct QueryEngine {
    ctx: Arc<SessionContext>,
}

impl std::fmt::Debug for QueryEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueryEngine")
            .field("session", &self.ctx.session_id())
            .finish()
    }
}

impl QueryEngine {
    pub fn new(storage: Arc<Storage>) -> Self {
        let config = SessionConfig::new().with_information_schema(true);
        let ctx = SessionContext::new_with_config(config);
        ctx.register_table(
            "samples",
            Arc::new(samples::SamplesTable::new(storage.clone())),
        )
        .expect("BUG: registering a table in a fresh context");
        ctx.register_table("gpus", Arc::new(gpus::GpusTable::new(storage)))
            .expect("BUG: registering a table in a fresh context");
        Self { ctx: Arc::new(ctx) }
    }

    /// The DataFusion context, for protocol front ends.
    pub fn context(&self) -> &Arc<SessionContext> {
        &self.ctx
    }

    /// Plans and runs one read-only SQL statement.
    ///
    /// # Errors
    /// [`QueryError::BadQuery`] for invalid SQL or a statement that would
    /// change anything; [`QueryError::Execution`] when running fails.
    pub async fn sql(&self, query: &str) -> Result<QueryResult, QueryError> {
        let options = SQLOptions::new()
            .with_allow_ddl(false)
            .with_allow_dml(false)
            .with_allow_statements(false);
        let df = self.ctx.sql_with_options(query, options).await?;
        let schema: SchemaRef = Arc::new(df.schema().as_arrow().clone());
        let batches = df.collect().await?;
        Ok(QueryResult { schema, batches })
    }
}
