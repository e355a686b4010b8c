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
//!
//! In cluster mode the table holds the whole cluster's events: each shard's
//! (a rack's, or a rackless host's) are read from one of its owners, the
//! nodes that evaluate its GPUs, over Flight (see
//! [`ClusterReader::health_events`]). Each owner evaluates the shard on its
//! own, so replicas hold equivalent events under their own ids: the `id` of
//! an event read from the node at index `n` of the cluster file is
//! `n · 2^48 + its id there`.

use std::sync::Arc;

use arrow::array::{
    Array, ArrayRef, AsArray, Int64Array, RecordBatch, StringArray, TimestampMillisecondArray,
};
use arrow::datatypes::{DataType, Field, Int64Type, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use cluster::ShardKey;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::DataFusionError;
use datafusion::datasource::MemTable;
use datafusion::logical_expr::{Expr, TableType};
use datafusion::physical_plan::ExecutionPlan;
use health::engine::{Event, GpuState};
use health::{GpuId, Kind, Severity};

use crate::cluster::ClusterReader;

/// Where the table reads its events: the node's health engine.
pub trait HealthSource: Send + Sync + std::fmt::Debug {
    /// The events the engine holds, by id.
    fn events(&self) -> Vec<Event>;

    /// Every GPU the engine knows, with its state at `now_ms`.
    fn states(&self, now_ms: i64) -> Vec<(GpuId, GpuState)>;
}

/// The shard a GPU's data, and so its events, belong to.
pub fn shard_of_gpu(gpu: &GpuId) -> ShardKey {
    ShardKey::of(gpu.rack.as_deref().unwrap_or(""), &gpu.host)
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

fn opt(s: &Option<String>) -> &str {
    s.as_deref().unwrap_or("")
}

fn known(s: &str) -> Option<String> {
    (!s.is_empty()).then(|| s.to_owned())
}

/// `events` as one batch of [`health_events_schema`].
///
/// # Errors
/// None in practice: the columns are built to the schema.
pub fn events_batch(events: &[Event]) -> Result<RecordBatch, arrow::error::ArrowError> {
    let text = |f: &dyn Fn(&Event) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(events.iter().map(f)))
    };
    let ts = |f: &dyn Fn(&Event) -> Option<i64>| -> ArrayRef {
        Arc::new(TimestampMillisecondArray::from_iter(events.iter().map(f)).with_timezone("UTC"))
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
    RecordBatch::try_new(health_events_schema(), cols)
}

/// A column of `batch` by name, as the type the schema says.
fn column<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a ArrayRef, String> {
    batch
        .column_by_name(name)
        .ok_or_else(|| format!("no column {name:?}"))
}

fn strings<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a StringArray, String> {
    column(batch, name)?
        .as_string_opt::<i32>()
        .ok_or_else(|| format!("column {name:?} is not text"))
}

fn int64s<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a Int64Array, String> {
    column(batch, name)?
        .as_primitive_opt::<Int64Type>()
        .ok_or_else(|| format!("column {name:?} is not a 64-bit integer"))
}

fn millis<'a>(batch: &'a RecordBatch, name: &str) -> Result<&'a TimestampMillisecondArray, String> {
    column(batch, name)?
        .as_primitive_opt::<arrow::datatypes::TimestampMillisecondType>()
        .ok_or_else(|| format!("column {name:?} is not a millisecond timestamp"))
}

/// The value of row `i` of a non-null text column.
fn text_at<'a>(a: &'a StringArray, name: &str, i: usize) -> Result<&'a str, String> {
    if a.is_null(i) {
        return Err(format!("column {name:?} is null at row {i}"));
    }
    Ok(a.value(i))
}

fn gpu_id(
    uuid: &str,
    host: &str,
    gpu: &str,
    rack: &str,
    row: &str,
    cluster: &str,
) -> Result<GpuId, String> {
    Ok(GpuId {
        uuid: uuid.to_owned(),
        host: host.to_owned(),
        gpu: gpu
            .parse()
            .map_err(|_| format!("GPU index {gpu:?} is not a number"))?,
        rack: known(rack),
        row: known(row),
        cluster: known(cluster),
    })
}

/// The events of a batch of [`health_events_schema`] (a peer's answer).
///
/// # Errors
/// What is wrong with the batch: a missing or mistyped column, a null where
/// none may be, an unknown kind or severity.
pub(crate) fn events_from_batch(batch: &RecordBatch) -> Result<Vec<Event>, String> {
    let id = int64s(batch, "id")?;
    let kind = strings(batch, "kind")?;
    let severity = strings(batch, "severity")?;
    let cluster = strings(batch, "cluster")?;
    let row = strings(batch, "row")?;
    let rack = strings(batch, "rack")?;
    let host = strings(batch, "host")?;
    let gpu = strings(batch, "gpu")?;
    let uuid = strings(batch, "uuid")?;
    let xid = int64s(batch, "xid")?;
    let onset = millis(batch, "onset_at")?;
    let detected = millis(batch, "detected_at")?;
    let cleared = millis(batch, "cleared_at")?;
    let action = strings(batch, "action")?;
    let evidence = strings(batch, "evidence")?;
    let mut out = Vec::with_capacity(batch.num_rows());
    for i in 0..batch.num_rows() {
        let k = text_at(kind, "kind", i)?;
        let s = text_at(severity, "severity", i)?;
        if id.is_null(i) || onset.is_null(i) || detected.is_null(i) {
            return Err(format!("a null id or time at row {i}"));
        }
        out.push(Event {
            id: id.value(i) as u64,
            gpu: gpu_id(
                text_at(uuid, "uuid", i)?,
                text_at(host, "host", i)?,
                text_at(gpu, "gpu", i)?,
                text_at(rack, "rack", i)?,
                text_at(row, "row", i)?,
                text_at(cluster, "cluster", i)?,
            )?,
            kind: Kind::from_name(k).ok_or_else(|| format!("unknown kind {k:?}"))?,
            severity: Severity::from_name(s).ok_or_else(|| format!("unknown severity {s:?}"))?,
            xid: if xid.is_null(i) {
                None
            } else {
                Some(
                    u32::try_from(xid.value(i))
                        .map_err(|_| format!("XID {} out of range", xid.value(i)))?,
                )
            },
            onset_ts_ms: onset.value(i),
            detected_ts_ms: detected.value(i),
            cleared_ts_ms: (!cleared.is_null(i)).then(|| cleared.value(i)),
            action: text_at(action, "action", i)?.to_owned(),
            evidence: text_at(evidence, "evidence", i)?.to_owned(),
        });
    }
    Ok(out)
}

/// The schema of a GPU-states answer: one row per GPU.
pub fn states_schema() -> SchemaRef {
    Arc::new(Schema::new(
        ["uuid", "host", "gpu", "rack", "row", "cluster", "state"]
            .into_iter()
            .map(|n| Field::new(n, DataType::Utf8, false))
            .collect::<Vec<_>>(),
    ))
}

/// `states` as one batch of [`states_schema`].
///
/// # Errors
/// None in practice: the columns are built to the schema.
pub fn states_batch(states: &[(GpuId, GpuState)]) -> Result<RecordBatch, arrow::error::ArrowError> {
    let text = |f: &dyn Fn(&(GpuId, GpuState)) -> &str| -> ArrayRef {
        Arc::new(StringArray::from_iter_values(states.iter().map(f)))
    };
    let gpu: Vec<String> = states.iter().map(|(g, _)| g.gpu.to_string()).collect();
    RecordBatch::try_new(
        states_schema(),
        vec![
            text(&|(g, _)| &g.uuid),
            text(&|(g, _)| &g.host),
            Arc::new(StringArray::from_iter_values(gpu.iter())),
            text(&|(g, _)| opt(&g.rack)),
            text(&|(g, _)| opt(&g.row)),
            text(&|(g, _)| opt(&g.cluster)),
            text(&|(_, s)| s.as_str()),
        ],
    )
}

/// The GPU states of a batch of [`states_schema`] (a peer's answer).
///
/// # Errors
/// A missing or mistyped column, a null, an unknown state.
pub(crate) fn states_from_batch(batch: &RecordBatch) -> Result<Vec<(GpuId, GpuState)>, String> {
    let cols = ["uuid", "host", "gpu", "rack", "row", "cluster", "state"]
        .map(|n| strings(batch, n).map(|a| (n, a)));
    let mut arrays = Vec::with_capacity(cols.len());
    for c in cols {
        arrays.push(c?);
    }
    let mut out = Vec::with_capacity(batch.num_rows());
    for i in 0..batch.num_rows() {
        let mut v = [""; 7];
        for (slot, (name, a)) in v.iter_mut().zip(&arrays) {
            *slot = text_at(a, name, i)?;
        }
        let [uuid, host, gpu, rack, row, cluster, state] = v;
        out.push((
            gpu_id(uuid, host, gpu, rack, row, cluster)?,
            GpuState::from_name(state).ok_or_else(|| format!("unknown GPU state {state:?}"))?,
        ));
    }
    Ok(out)
}

/// See the module docs.
#[derive(Debug)]
pub struct HealthEventsTable {
    source: Arc<dyn HealthSource>,
    schema: SchemaRef,
    /// In cluster mode: events are read from one owner of each shard.
    cluster: Option<ClusterReader>,
}

impl HealthEventsTable {
    pub fn new(source: Arc<dyn HealthSource>, cluster: Option<ClusterReader>) -> Self {
        Self {
            source,
            schema: health_events_schema(),
            cluster,
        }
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
        // Open events and the newest 100,000 closed ones (per node): one batch.
        let events = match &self.cluster {
            None => self.source.events(),
            Some(reader) => {
                let got = reader
                    .health_events(&self.source)
                    .await
                    .map_err(|e| DataFusionError::External(Box::new(e)))?;
                crate::cluster::report_sql_warnings(got.warnings)
                    .map_err(crate::cluster::refuse_unseen)?;
                got.events
            }
        };
        let mem = MemTable::try_new(self.schema.clone(), vec![vec![events_batch(&events)?]])?;
        mem.scan(state, projection, filters, limit).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Arrow IPC stream bytes of `batch` (a peer's answer as the fuzz target
    /// and the tests take it).
    fn ipc_bytes(batch: &RecordBatch) -> Vec<u8> {
        let mut out = Vec::new();
        {
            let mut w = arrow::ipc::writer::StreamWriter::try_new(&mut out, &batch.schema())
                .expect("BUG: an in-memory IPC writer");
            w.write(batch).expect("BUG: writing to memory");
            w.finish().expect("BUG: writing to memory");
        }
        out
    }

    fn events() -> Vec<Event> {
        let gpu = |uuid: &str, rack: Option<&str>| GpuId {
            uuid: uuid.into(),
            host: "h<1>".into(),
            gpu: 7,
            rack: rack.map(str::to_owned),
            row: None,
            cluster: Some("c".into()),
        };
        vec![
            Event {
                id: 3,
                gpu: gpu("GPU-a", Some("r1")),
                kind: Kind::Xid,
                severity: Severity::Critical,
                xid: Some(79),
                onset_ts_ms: 1_000,
                detected_ts_ms: 2_000,
                cleared_ts_ms: None,
                action: "drain".into(),
                evidence: "XID 79".into(),
            },
            Event {
                id: 4,
                gpu: gpu("GPU-b", None),
                kind: Kind::Straggler,
                severity: Severity::Warning,
                xid: None,
                onset_ts_ms: -5,
                detected_ts_ms: 0,
                cleared_ts_ms: Some(9_000),
                action: String::new(),
                evidence: "12 % behind".into(),
            },
        ]
    }

    /// What a node sends its peers reads back as it was.
    #[test]
    fn events_and_states_read_back_from_a_peers_batch() {
        let want = events();
        let got = events_from_batch(&events_batch(&want).unwrap()).unwrap();
        assert_eq!(got, want);
        let states = vec![
            (want[0].gpu.clone(), GpuState::Critical),
            (want[1].gpu.clone(), GpuState::Unknown),
        ];
        assert_eq!(
            states_from_batch(&states_batch(&states).unwrap()).unwrap(),
            states
        );
    }

    /// A batch of the wrong shape, or with a bad value, is an error.
    #[test]
    fn a_malformed_answer_is_an_error() {
        let b = events_batch(&events()).unwrap();
        assert!(states_from_batch(&b).is_err(), "events are not states");
        let mut cols = b.columns().to_vec();
        cols[1] = Arc::new(StringArray::from(vec!["xid", "no_such_kind"]));
        let bad = RecordBatch::try_new(b.schema(), cols).unwrap();
        let e = events_from_batch(&bad).unwrap_err();
        assert!(e.contains("no_such_kind"), "{e}");
        let mut cols = b.columns().to_vec();
        cols[7] = Arc::new(StringArray::from(vec!["7", "seven"]));
        let bad = RecordBatch::try_new(b.schema(), cols).unwrap();
        assert!(events_from_batch(&bad).unwrap_err().contains("seven"));
    }

    /// Writes the seeds of the `flight_health` fuzz target:
    /// `GPULSE_WRITE_SEEDS=fuzz/seeds/flight_health cargo test -p query --lib
    /// write_health_seeds -- --ignored`.
    #[test]
    #[ignore = "writes files; run by hand to refresh fuzz seeds"]
    fn write_health_seeds() {
        let dir = std::path::PathBuf::from(std::env::var("GPULSE_WRITE_SEEDS").unwrap());
        std::fs::create_dir_all(&dir).unwrap();
        let e = events();
        let states = vec![(e[0].gpu.clone(), GpuState::Warning)];
        for (name, batch) in [
            ("events", events_batch(&e).unwrap()),
            ("states", states_batch(&states).unwrap()),
        ] {
            std::fs::write(dir.join(name), ipc_bytes(&batch)).unwrap();
        }
    }
}
