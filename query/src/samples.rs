//! The `samples` table: every raw sample as one row, over [`Storage`].
//!
//! Columns: `ts TIMESTAMP(ms, UTC)`, `metric`, the topology and dcgm-exporter
//! labels as columns (`cluster, row, rack, host, gpu, uuid, pci_bus_id,
//! device, model_name, driver_version`), any other labels as a JSON object in
//! `labels`, and `value DOUBLE`.
//!
//! Pushdown: time bounds on `ts` and equality on label columns are used to
//! pick series and chunks before anything is decoded (reported as `Inexact`,
//! so DataFusion still applies them row by row). Scans are lazy: a partition
//! decodes one series at a time as its stream is polled.
//!
//! In cluster mode the scan selects from every node ([`crate::cluster`]) with
//! the pushed filters; samples of peers arrive decoded, this node's are
//! decoded as above. Shards no replica could serve become warnings of the
//! query ([`crate::QueryResult::warnings`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use arrow::array::{
    ArrayRef, Float64Builder, RecordBatch, RecordBatchOptions, StringBuilder,
    TimestampMillisecondBuilder,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{DataFusionError, ScalarValue};
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::{Expr, Operator, TableProviderFilterPushDown, TableType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use storage::{Matcher, SeriesKey, Storage};

use crate::cluster::{ClusterSeries, Source};
use crate::pushdown::{TimeRange, comparisons, string_of};

/// Rows per record batch produced by a scan.
const BATCH_ROWS: usize = 8192;

/// A column of `samples` and where its value comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Col {
    Ts,
    Metric,
    /// A label column: the label names it reads, in order of preference
    /// (dcgm-exporter changed `Hostname` to `hostname` in 4.8.3).
    Label(&'static str, &'static [&'static str]),
    Labels,
    Value,
}

const COLUMNS: [Col; 14] = [
    Col::Ts,
    Col::Metric,
    Col::Label("cluster", &["cluster"]),
    Col::Label("row", &["row"]),
    Col::Label("rack", &["rack"]),
    Col::Label("host", &["Hostname", "hostname"]),
    Col::Label("gpu", &["gpu"]),
    Col::Label("uuid", &["UUID", "uuid"]),
    Col::Label("pci_bus_id", &["pci_bus_id"]),
    Col::Label("device", &["device"]),
    Col::Label("model_name", &["modelName"]),
    Col::Label("driver_version", &["DCGM_FI_DRIVER_VERSION"]),
    Col::Labels,
    Col::Value,
];

impl Col {
    fn name(self) -> &'static str {
        match self {
            Col::Ts => "ts",
            Col::Metric => "metric",
            Col::Label(name, _) => name,
            Col::Labels => "labels",
            Col::Value => "value",
        }
    }

    /// The value of a label column for one series.
    fn label_value(self, key: &SeriesKey) -> Option<&str> {
        match self {
            Col::Metric => Some(key.metric()),
            Col::Label(_, sources) => sources.iter().find_map(|s| key.get(s)),
            _ => None,
        }
    }

    fn by_name(name: &str) -> Option<Col> {
        COLUMNS.iter().copied().find(|c| c.name() == name)
    }
}

/// Labels that have no column of their own, as a JSON object; `None` if none.
fn other_labels(key: &SeriesKey) -> Option<String> {
    let mapped = |n: &str| {
        COLUMNS.iter().any(|c| match c {
            Col::Label(_, sources) => sources.contains(&n),
            _ => false,
        })
    };
    let rest: BTreeMap<&str, &str> = key
        .labels()
        .iter()
        .filter(|l| !mapped(&l.name))
        .map(|l| (l.name.as_str(), l.value.as_str()))
        .collect();
    (!rest.is_empty()).then(|| serde_json::to_string(&rest).expect("BUG: string map serializes"))
}

pub(crate) fn samples_schema() -> SchemaRef {
    let fields: Vec<Field> = COLUMNS
        .iter()
        .map(|c| match c {
            Col::Ts => Field::new(
                "ts",
                DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                false,
            ),
            Col::Metric => Field::new("metric", DataType::Utf8, false),
            Col::Value => Field::new("value", DataType::Float64, false),
            c => Field::new(c.name(), DataType::Utf8, true),
        })
        .collect();
    Arc::new(Schema::new(fields))
}

/// The `samples` table provider.
#[derive(Debug)]
pub struct SamplesTable {
    source: Source,
    schema: SchemaRef,
}

impl SamplesTable {
    pub fn new(storage: Arc<Storage>) -> Self {
        Self::over(Source::Local(storage))
    }

    pub(crate) fn over(source: Source) -> Self {
        Self {
            source,
            schema: samples_schema(),
        }
    }
}

/// Most storage selections one scan makes (see [`Pushdown::matcher_sets`]).
const MAX_MATCHER_SETS: usize = 4;

/// What a scan's filters allow it to skip.
#[derive(Debug, Clone, Default, PartialEq)]
struct Pushdown {
    time: TimeRange,
    /// Label column = value.
    equal: Vec<(Col, String)>,
}

/// The matchers and inclusive time bounds a scan of `samples` under
/// `filters` would select series with (for planning which shards to read).
pub(crate) fn scan_bounds(filters: &[Expr]) -> (Vec<Matcher>, i64, i64) {
    let p = Pushdown::from_filters(filters);
    (p.matchers(), p.time.min_ts, p.time.max_ts)
}

impl Pushdown {
    fn from_filters(filters: &[Expr]) -> Self {
        let mut p = Self::default();
        for f in filters {
            p.absorb(f);
        }
        p
    }

    /// Narrows the pushdown by `e`; true if all of `e` was understood.
    fn absorb(&mut self, e: &Expr) -> bool {
        let (cmps, mut all) = comparisons(e);
        for c in cmps {
            all &= Col::by_name(c.column).is_some_and(|col| self.absorb_cmp(col, c.op, c.literal));
        }
        all
    }

    fn absorb_cmp(&mut self, col: Col, op: Operator, lit: &ScalarValue) -> bool {
        match col {
            Col::Ts => self.time.absorb(op, lit),
            Col::Metric | Col::Label(..) if op == Operator::Eq => match string_of(lit) {
                Some(s) => {
                    self.equal.push((col, s.to_string()));
                    true
                }
                None => false,
            },
            _ => false,
        }
    }

    /// Storage matchers for the columns that map to exactly one label.
    fn matchers(&self) -> Vec<Matcher> {
        self.equal
            .iter()
            .filter_map(|(col, v)| match col {
                Col::Metric => Some(Matcher::equal("__name__", v.clone())),
                Col::Label(_, [only]) => Some(Matcher::equal(*only, v.clone())),
                _ => None,
            })
            .collect()
    }

    /// [`Self::matchers`] and the columns that may be one of several labels
    /// (`host` is `Hostname` or `hostname`) too: one set of matchers per
    /// combination of their names, each answered from the postings, where
    /// leaving them out selected, say, GPU 3 of every host to keep one. At
    /// most [`MAX_MATCHER_SETS`] sets; a column that would make more is left
    /// to [`Self::accepts`].
    fn matcher_sets(&self) -> Vec<Vec<Matcher>> {
        let mut sets = vec![Vec::new()];
        for (col, v) in &self.equal {
            let names: &[&str] = match col {
                Col::Metric => &["__name__"],
                Col::Label(_, names) => names,
                _ => continue,
            };
            if names.is_empty() || sets.len() * names.len() > MAX_MATCHER_SETS {
                continue;
            }
            sets = sets
                .into_iter()
                .flat_map(|set| {
                    names.iter().map(move |name| {
                        let mut set = set.clone();
                        set.push(Matcher::equal(*name, v.clone()));
                        set
                    })
                })
                .collect();
        }
        sets
    }

    fn accepts(&self, key: &SeriesKey) -> bool {
        self.equal
            .iter()
            .all(|(col, v)| col.label_value(key) == Some(v.as_str()))
    }
}

#[async_trait]
impl TableProvider for SamplesTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> datafusion::error::Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| {
                if Pushdown::default().absorb(f) {
                    TableProviderFilterPushDown::Inexact
                } else {
                    TableProviderFilterPushDown::Unsupported
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        _limit: Option<usize>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        let pushdown = Pushdown::from_filters(filters);
        let cols: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..COLUMNS.len()).collect(),
        };
        let schema = Arc::new(self.schema.project(&cols)?);
        let sets = pushdown.matcher_sets();
        let mut series: Vec<ClusterSeries> = Vec::new();
        let mut warnings = Vec::new();
        for matchers in &sets {
            let selection = self
                .source
                .select(matchers, pushdown.time.min_ts, pushdown.time.max_ts)
                .await
                .map_err(|e| DataFusionError::External(Box::new(e)))?;
            warnings.extend(selection.warnings);
            series.extend(
                selection
                    .series
                    .into_iter()
                    .filter(|s| pushdown.accepts(&s.key)),
            );
        }
        if sets.len() > 1 {
            // A series with both names (`Hostname` and `hostname` equal)
            // is in two selections.
            series.sort_by(|a, b| a.key.cmp(&b.key));
            series.dedup_by(|a, b| a.key == b.key);
            warnings.sort();
            warnings.dedup();
        }
        crate::cluster::report_sql_warnings(warnings).map_err(crate::cluster::refuse_unseen)?;

        // Spread series over the session's partitions, balancing by sample count.
        let n = state
            .config()
            .target_partitions()
            .max(1)
            .min(series.len().max(1));
        let mut parts: Vec<Vec<ClusterSeries>> = vec![Vec::new(); n];
        let mut load = vec![0usize; n];
        let mut by_size = series;
        by_size.sort_by_key(|s| std::cmp::Reverse(s.max_samples()));
        for s in by_size {
            let i = (0..n).min_by_key(|&i| load[i]).expect("BUG: n >= 1");
            load[i] += s.max_samples();
            parts[i].push(s);
        }
        let n_series: usize = parts.iter().map(Vec::len).sum();
        let partitions: Vec<Arc<dyn PartitionStream>> = parts
            .into_iter()
            .map(|series| {
                Arc::new(SamplesPartition {
                    schema: schema.clone(),
                    cols: cols.iter().map(|&i| COLUMNS[i]).collect(),
                    series: Arc::new(series),
                    min_ts: pushdown.time.min_ts,
                    max_ts: pushdown.time.max_ts,
                }) as Arc<dyn PartitionStream>
            })
            .collect();
        let inner = StreamingTableExec::try_new(schema, partitions, None, [], false, None)?;
        let mut pushed: Vec<String> = pushdown
            .equal
            .iter()
            .map(|(c, v)| format!("{}={v}", c.name()))
            .collect();
        pushed.push(format!("ts={}", pushdown.time.display()));
        Ok(Arc::new(SamplesScanExec {
            properties: Arc::clone(inner.properties()),
            inner: Arc::new(inner),
            display: format!(
                "SamplesScanExec: {}, series={n_series}, samples<={}, projection=[{}]",
                pushed.join(", "),
                load.iter().sum::<usize>(),
                cols.iter()
                    .map(|&i| COLUMNS[i].name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }))
    }
}

/// The scan of `samples`: what storage was asked for (the pushed filters)
/// and what it selected, over the streams that decode it. `EXPLAIN` shows
/// the first line.
#[derive(Debug)]
struct SamplesScanExec {
    inner: Arc<StreamingTableExec>,
    properties: Arc<PlanProperties>,
    display: String,
}

impl DisplayAs for SamplesScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(&self.display)
    }
}

impl ExecutionPlan for SamplesScanExec {
    fn name(&self) -> &str {
        "SamplesScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        Vec::new()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(
            &Arc<dyn datafusion::physical_expr::PhysicalExpr>,
        ) -> datafusion::error::Result<TreeNodeRecursion>,
    ) -> datafusion::error::Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> datafusion::error::Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(
        &self,
        partition: usize,
        context: Arc<TaskContext>,
    ) -> datafusion::error::Result<SendableRecordBatchStream> {
        self.inner.execute(partition, context)
    }
}

#[derive(Debug)]
struct SamplesPartition {
    schema: SchemaRef,
    cols: Vec<Col>,
    series: Arc<Vec<ClusterSeries>>,
    min_ts: i64,
    max_ts: i64,
}

impl PartitionStream for SamplesPartition {
    fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let iter = BatchIter {
            schema: self.schema.clone(),
            cols: self.cols.clone(),
            series: self.series.clone(),
            next: 0,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            ts: Vec::new(),
            values: Vec::new(),
            pos: 0,
            failed: false,
        };
        Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            futures::stream::iter(iter),
        ))
    }
}

/// Decodes one series at a time and appends its rows to Arrow builders,
/// cutting a record batch every [`BATCH_ROWS`] rows.
struct BatchIter {
    schema: SchemaRef,
    cols: Vec<Col>,
    series: Arc<Vec<ClusterSeries>>,
    /// Next series to decode.
    next: usize,
    min_ts: i64,
    max_ts: i64,
    /// Decoded samples of series `next - 1`, consumed from `pos`.
    ts: Vec<i64>,
    values: Vec<f64>,
    pos: usize,
    failed: bool,
}

enum ColBuilder {
    Ts(TimestampMillisecondBuilder),
    Value(Float64Builder),
    Str(Col, StringBuilder),
}

impl Iterator for BatchIter {
    type Item = datafusion::error::Result<RecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let mut builders: Vec<ColBuilder> = self
            .cols
            .iter()
            .map(|&c| match c {
                Col::Ts => ColBuilder::Ts(
                    TimestampMillisecondBuilder::with_capacity(BATCH_ROWS).with_timezone("UTC"),
                ),
                Col::Value => ColBuilder::Value(Float64Builder::with_capacity(BATCH_ROWS)),
                c => ColBuilder::Str(c, StringBuilder::with_capacity(BATCH_ROWS, BATCH_ROWS * 8)),
            })
            .collect();
        let mut rows = 0;
        while rows < BATCH_ROWS {
            if self.pos >= self.ts.len() {
                if self.next >= self.series.len() {
                    break;
                }
                self.ts.clear();
                self.values.clear();
                self.pos = 0;
                let s = &self.series[self.next];
                self.next += 1;
                if let Err(e) =
                    s.read_into(self.min_ts, self.max_ts, &mut self.ts, &mut self.values)
                {
                    self.failed = true;
                    return Some(Err(DataFusionError::External(Box::new(e))));
                }
                continue;
            }
            let (a, z) = (
                self.pos,
                self.pos + (BATCH_ROWS - rows).min(self.ts.len() - self.pos),
            );
            let key = &self.series[self.next - 1].key;
            for b in &mut builders {
                match b {
                    ColBuilder::Ts(b) => b.append_slice(&self.ts[a..z]),
                    ColBuilder::Value(b) => b.append_slice(&self.values[a..z]),
                    ColBuilder::Str(col, b) => {
                        let owned;
                        let v = if *col == Col::Labels {
                            owned = other_labels(key);
                            owned.as_deref()
                        } else {
                            col.label_value(key)
                        };
                        for _ in a..z {
                            b.append_option(v);
                        }
                    }
                }
            }
            rows += z - a;
            self.pos = z;
        }
        if rows == 0 {
            return None;
        }
        let arrays: Vec<ArrayRef> = builders
            .into_iter()
            .map(|b| -> ArrayRef {
                match b {
                    ColBuilder::Ts(mut b) => Arc::new(b.finish()),
                    ColBuilder::Value(mut b) => Arc::new(b.finish()),
                    ColBuilder::Str(_, mut b) => Arc::new(b.finish()),
                }
            })
            .collect();
        // `count(*)` projects no columns: the row count must be given explicitly.
        let options = RecordBatchOptions::new().with_row_count(Some(rows));
        Some(
            RecordBatch::try_new_with_options(self.schema.clone(), arrays, &options)
                .map_err(Into::into),
        )
    }
}

#[cfg(test)]
mod tests;
