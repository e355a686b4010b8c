//! The `health_events` table: one row per event of the node's health
//! engine (`health::engine`), open or closed, read at scan time.
//!
//! | column | type |
//! | --- | --- |
//! | `id` | `BIGINT` |
//! | `kind` (`xid`, `ecc`, `row_remap`, `thermal_throttle`, …), `severity` (`info`, `warning`, `critical`) | text |
//! | `cluster`, `row`, `rack`, `host`, `gpu`, `uuid` | text (`cluster`, `row`, `rack` empty where unknown) |
//! | `xid` | `BIGINT`, NULL unless an XID event |
//! | `onset_at` (when the evidence starts), `detected_at` | `TIMESTAMP(ms, UTC)` |
//! | `cleared_at` | `TIMESTAMP(ms, UTC)`, NULL while active |
//! | `action`, `evidence` | text |

use std::sync::Arc;

use arrow::array::{ArrayRef, Int64Array, RecordBatch, StringArray, TimestampMillisecondArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::DataFusionError;
use datafusion::datasource::MemTable;
use datafusion::logical_expr::{Expr, TableType};
use datafusion::physical_plan::ExecutionPlan;
use health::engine::Event;

/// Where the table reads its events: the node's health engine.
pub trait HealthSource: Send + Sync + std::fmt::Debug {
    /// The events the engine holds, by id.
    fn events(&self) -> Vec<Event>;
}

const TEXT_BEFORE_XID: [&str; 8] = [
    "kind", "severity", "cluster", "row", "rack", "host", "gpu", "uuid",
];

pub fn health_events_schema() -> SchemaRef {
    let ts = DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()));
    let mut fields = vec![Field::new("id", DataType::Int64, false)];
    fields.extend(
        TEXT_BEFORE_XID
            .iter()
            .map(|n| Field::new(*n, DataType::Utf8, false)),
    );
    fields.push(Field::new("xid", DataType::Int64, true));
    fields.push(Field::new("onset_at", ts.clone(), false));
    fields.push(Field::new("detected_at", ts.clone(), false));
    fields.push(Field::new("cleared_at", ts, true));
    fields.push(Field::new("action", DataType::Utf8, false));
    fields.push(Field::new("evidence", DataType::Utf8, false));
    Arc::new(Schema::new(fields))
}

/// See the module docs.
#[derive(Debug)]
pub struct HealthEventsTable {
    source: Arc<dyn HealthSource>,
    schema: SchemaRef,
    /// In cluster mode: scans warn that only this node's events are read.
    local_in_cluster: bool,
}

impl HealthEventsTable {
    pub fn new(source: Arc<dyn HealthSource>, local_in_cluster: bool) -> Self {
        Self {
            source,
            schema: health_events_schema(),
            local_in_cluster,
        }
    }

    fn batch(&self) -> Result<RecordBatch, DataFusionError> {
        fn opt(s: &Option<String>) -> &str {
            s.as_deref().unwrap_or("")
        }
        let events = self.source.events();
        let text = |f: &dyn Fn(&Event) -> &str| -> ArrayRef {
            Arc::new(StringArray::from_iter_values(events.iter().map(f)))
        };
        let ts = |f: &dyn Fn(&Event) -> Option<i64>| -> ArrayRef {
            Arc::new(
                TimestampMillisecondArray::from_iter(events.iter().map(f)).with_timezone("UTC"),
            )
        };
        let gpu: Vec<String> = events.iter().map(|e| e.gpu.gpu.to_string()).collect();
        let cols: Vec<ArrayRef> = vec![
            Arc::new(Int64Array::from_iter_values(
                events.iter().map(|e| e.id as i64),
            )),
            text(&|e| e.kind.as_str()),
            text(&|e| e.severity.as_str()),
            text(&|e| opt(&e.gpu.cluster)),
            text(&|e| opt(&e.gpu.row)),
            text(&|e| opt(&e.gpu.rack)),
            text(&|e| &e.gpu.host),
            Arc::new(StringArray::from_iter_values(gpu.iter())),
            text(&|e| &e.gpu.uuid),
            Arc::new(Int64Array::from_iter(
                events.iter().map(|e| e.xid.map(i64::from)),
            )),
            ts(&|e| Some(e.onset_ts_ms)),
            ts(&|e| Some(e.detected_ts_ms)),
            ts(&|e| e.cleared_ts_ms),
            text(&|e| &e.action),
            text(&|e| &e.evidence),
        ];
        Ok(RecordBatch::try_new(self.schema.clone(), cols)?)
    }
}

#[async_trait]
impl TableProvider for HealthEventsTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>, DataFusionError> {
        if self.local_in_cluster {
            crate::cluster::warn_local_only("the health_events table")?;
        }
        // Open events and the newest 100,000 closed ones: one batch.
        let mem = MemTable::try_new(self.schema.clone(), vec![vec![self.batch()?]])?;
        mem.scan(state, projection, filters, limit).await
    }
}
