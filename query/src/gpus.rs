//! The `gpus` table: one row per GPU of the fleet's inventory
//! ([`storage::Inventory`]), read at scan time.
//!
//! | column | type |
//! | --- | --- |
//! | `cluster`, `row`, `rack`, `host`, `gpu` | text |
//! | `uuid`, `pci_bus_id`, `model_name`, `serial`, `vbios_version`, `driver_version`, `inforom_version`, `cuda_driver_version`, `mig_mode` | text |
//! | `first_seen`, `last_seen` | `TIMESTAMP(ms, UTC)` |

use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch, StringArray, TimestampMillisecondArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::DataFusionError;
use datafusion::datasource::MemTable;
use datafusion::logical_expr::{Expr, TableType};
use datafusion::physical_plan::ExecutionPlan;
use storage::{GpuRecord, Storage};

const TEXT: [&str; 14] = [
    "cluster",
    "row",
    "rack",
    "host",
    "gpu",
    "uuid",
    "pci_bus_id",
    "model_name",
    "serial",
    "vbios_version",
    "driver_version",
    "inforom_version",
    "cuda_driver_version",
    "mig_mode",
];

fn text(r: &GpuRecord, i: usize) -> &str {
    match i {
        0 => &r.cluster,
        1 => &r.row,
        2 => &r.rack,
        3 => &r.host,
        4 => &r.gpu,
        5 => &r.uuid,
        6 => &r.pci_bus_id,
        7 => &r.model_name,
        8 => &r.serial,
        9 => &r.vbios_version,
        10 => &r.driver_version,
        11 => &r.inforom_version,
        12 => &r.cuda_driver_version,
        _ => &r.mig_mode,
    }
}

pub fn gpus_schema() -> SchemaRef {
    let ts = DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()));
    let mut fields: Vec<Field> = TEXT
        .iter()
        .map(|n| Field::new(*n, DataType::Utf8, false))
        .collect();
    fields.push(Field::new("first_seen", ts.clone(), false));
    fields.push(Field::new("last_seen", ts, false));
    Arc::new(Schema::new(fields))
}

/// See the module docs.
#[derive(Debug)]
pub struct GpusTable {
    storage: Arc<Storage>,
    schema: SchemaRef,
    /// In cluster mode: scans warn that only this node's inventory is read.
    local_in_cluster: bool,
}

impl GpusTable {
    pub fn new(storage: Arc<Storage>) -> Self {
        Self {
            storage,
            schema: gpus_schema(),
            local_in_cluster: false,
        }
    }

    /// With `true`, a scan adds a warning to the query's result: the table
    /// lists this node's inventory only.
    pub fn local_in_cluster(self, yes: bool) -> Self {
        Self {
            local_in_cluster: yes,
            ..self
        }
    }

    fn batch(&self) -> Result<RecordBatch, DataFusionError> {
        let gpus = self.storage.inventory().snapshot();
        let mut cols: Vec<ArrayRef> = (0..TEXT.len())
            .map(|i| {
                Arc::new(StringArray::from_iter_values(
                    gpus.iter().map(|g| text(g, i)),
                )) as ArrayRef
            })
            .collect();
        for f in [
            |g: &GpuRecord| g.first_seen_ms,
            |g: &GpuRecord| g.last_seen_ms,
        ] {
            cols.push(Arc::new(
                TimestampMillisecondArray::from_iter_values(gpus.iter().map(f))
                    .with_timezone("UTC"),
            ));
        }
        Ok(RecordBatch::try_new(self.schema.clone(), cols)?)
    }
}

#[async_trait]
impl TableProvider for GpusTable {
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
            crate::cluster::warn_local_only("the gpus table")?;
        }
        // A fleet has thousands of GPUs, not millions: one in-memory batch.
        let mem = MemTable::try_new(self.schema.clone(), vec![vec![self.batch()?]])?;
        mem.scan(state, projection, filters, limit).await
    }
}
