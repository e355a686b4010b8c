//! The rollup tables `rollup_1m`, `rollup_1h` and `rollup_1d`, and the table
//! function `rollup(start, end, step)` that picks one of them.
//!
//! One row per (level, group, window) of [`Storage::select_rollups`]:
//!
//! | column | type | |
//! | --- | --- | --- |
//! | `ts` | `TIMESTAMP(ms, UTC)` | start of the window |
//! | `level` | text | `gpu`, `host`, `rack`, `row` or `cluster` |
//! | `metric`, `cluster`, `row`, `rack`, `host`, `gpu` | text | the group; NULL below its level (and for a missing label) |
//! | `count` | bigint | samples in the window |
//! | `sum`, `min`, `max`, `first`, `last`, `avg` | double | of those samples; `first`/`last` by timestamp |
//!
//! A table holds every level, so a query names the one it wants
//! (`WHERE level = 'rack'`); rows of different levels count the same samples
//! again. `avg` is `sum / count` of the window: to average over several
//! windows, divide sums of `sum` by sums of `count` rather than averaging
//! `avg`.
//!
//! Pushdown: `level = …` and `level IN (…)`, equality on `metric` and the
//! topology columns, and time bounds on `ts` select the (tier, level) blocks,
//! groups and windows that storage reads; nothing else is decoded. `EXPLAIN`
//! shows what was pushed in the `RollupScanExec` line. Storage applies the
//! level and group filters exactly (a non-empty string compared with `=`),
//! so DataFusion does not test them again; time bounds it applies again
//! (`Inexact`), since a window *overlapping* a bound is read but its `ts`
//! (the window start) may lie outside it.
//!
//! `rollup(start, end, step)` returns the same columns plus `tier` (`1m`,
//! `1h` or `1d`): the rows of windows that start in `[start, end)` from the
//! coarsest tier whose windows are no longer than `step` and whose retention
//! still covers `start`. When no such tier covers `start`, it falls back to
//! the finest tier that does (coarser than asked, which `tier` shows), and
//! when none does, to the one kept longest. `start` and `end` are timestamps
//! (literals, strings in RFC 3339, or constant expressions such as
//! `now() - interval '30 days'`); `step` is an interval or a string such as
//! `'1h'`, `'15m'`, `'1 day'`.
//!
//! In cluster mode ([`RollupTable::in_cluster`]) a scan reads the whole
//! cluster's rollups when it is planned, one level at a time, through
//! [`ClusterReader::rollups`]: gpu and host groups from one replica of their
//! shard, rack, row and cluster groups merged from each node's aggregate of
//! the shards it was asked for. Shards no replica could serve, and a window
//! split by a membership change, are warnings of the query.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, Float64Array, Int64Array, RecordBatch, RecordBatchOptions, TimestampMillisecondArray,
};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef, TimeUnit};
use async_trait::async_trait;
use datafusion::catalog::{Session, TableFunctionImpl, TableProvider};
use datafusion::common::tree_node::TreeNodeRecursion;
use datafusion::common::{ScalarValue, plan_err};
use datafusion::error::Result;
use datafusion::execution::{SendableRecordBatchStream, TaskContext};
use datafusion::logical_expr::expr::InList;
use datafusion::logical_expr::simplify::SimplifyContext;
use datafusion::logical_expr::{
    BinaryExpr, Expr, Operator, TableProviderFilterPushDown, TableType,
};
use datafusion::optimizer::simplify_expressions::ExprSimplifier;
use datafusion::physical_expr::{EquivalenceProperties, Partitioning, PhysicalExpr};
use datafusion::physical_plan::execution_plan::{Boundedness, EmissionType};
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::{DisplayAs, DisplayFormatType, ExecutionPlan, PlanProperties};
use storage::{
    RecordFields, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier, Storage,
};

use crate::cluster::ClusterReader;
use crate::pushdown::{TimeRange, column_of, comparisons, literal_of, string_of};

/// Rows per record batch produced by a scan.
const BATCH_ROWS: usize = 8192;

/// The columns of every rollup table, in order.
const COLUMNS: [&str; 15] = [
    "ts", "level", "metric", "cluster", "row", "rack", "host", "gpu", "count", "sum", "min", "max",
    "first", "last", "avg",
];

/// The SQL name of a tier's table.
pub fn table_name(tier: RollupTier) -> &'static str {
    match tier {
        RollupTier::Minute => "rollup_1m",
        RollupTier::Hour => "rollup_1h",
        RollupTier::Day => "rollup_1d",
    }
}

fn schema(with_tier: bool) -> SchemaRef {
    let mut fields: Vec<Field> = COLUMNS
        .iter()
        .map(|&name| match name {
            "ts" => Field::new(
                name,
                DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into())),
                false,
            ),
            "level" => Field::new(name, DataType::Utf8, false),
            "metric" | "cluster" | "row" | "rack" | "host" | "gpu" => {
                Field::new(name, DataType::Utf8, true)
            }
            "count" => Field::new(name, DataType::Int64, false),
            _ => Field::new(name, DataType::Float64, false),
        })
        .collect();
    if with_tier {
        fields.push(Field::new("tier", DataType::Utf8, false));
    }
    Arc::new(Schema::new(fields))
}

/// A rollup table: every level of one tier, optionally limited to the
/// windows that start in a fixed range (the tables `rollup(…)` returns).
#[derive(Debug)]
pub struct RollupTable {
    storage: Arc<Storage>,
    tier: RollupTier,
    /// Windows whose start lies outside this range are not rows of the table.
    window_starts: TimeRange,
    /// Whether the table has the `tier` column (`rollup(…)`).
    with_tier: bool,
    schema: SchemaRef,
    /// In cluster mode: the reader of the cluster's rollups.
    cluster: Option<ClusterReader>,
}

impl RollupTable {
    /// The table `rollup_1m`, `rollup_1h` or `rollup_1d`.
    pub fn new(storage: Arc<Storage>, tier: RollupTier) -> Self {
        Self {
            storage,
            tier,
            window_starts: TimeRange::default(),
            with_tier: false,
            schema: schema(false),
            cluster: None,
        }
    }

    /// In cluster mode: scans read the whole cluster's rollups through
    /// `reader` ([`ClusterReader::rollups`]) and report what they lack as
    /// warnings of the query.
    pub fn in_cluster(self, reader: Option<ClusterReader>) -> Self {
        Self {
            cluster: reader,
            ..self
        }
    }
}

/// What a scan's filters allow storage to skip.
#[derive(Debug, Clone, PartialEq)]
struct Pushdown {
    /// Levels that may match, indexed like [`RollupLevel::ALL`].
    levels: [bool; 5],
    filter: RollupFilter,
    time: TimeRange,
    /// Two filters contradict each other (`metric = 'a' AND metric = 'b'`):
    /// no row can match.
    none: bool,
}

impl Default for Pushdown {
    fn default() -> Self {
        Self {
            levels: [true; 5],
            filter: RollupFilter::default(),
            time: TimeRange::default(),
            none: false,
        }
    }
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
        if let Some(allowed) = level_set(e) {
            self.keep_levels(allowed);
            return true;
        }
        let (cmps, mut all) = comparisons(e);
        for c in cmps {
            all &= self.absorb_cmp(c.column, c.op, c.literal);
        }
        all
    }

    fn absorb_cmp(&mut self, column: &str, op: Operator, lit: &ScalarValue) -> bool {
        if column == "ts" {
            return self.time.absorb(op, lit);
        }
        let (Operator::Eq, Some(value)) = (op, string_of(lit)) else {
            return false;
        };
        let field = match column {
            "level" => {
                self.keep_levels(one_level(value));
                return true;
            }
            "metric" => &mut self.filter.metric,
            "cluster" => &mut self.filter.cluster,
            "row" => &mut self.filter.row,
            "rack" => &mut self.filter.rack,
            "host" => &mut self.filter.host,
            "gpu" => &mut self.filter.gpu,
            _ => return false,
        };
        match field {
            Some(had) if had != value => self.none = true,
            _ => *field = Some(value.to_string()),
        }
        true
    }

    fn keep_levels(&mut self, allowed: [bool; 5]) {
        for (l, a) in self.levels.iter_mut().zip(allowed) {
            *l &= a;
        }
    }

    /// The levels to read: those allowed, minus those where a filter on a
    /// field blanked at that level (`host = 'x'` at rack level) can't match.
    fn levels(&self) -> Vec<RollupLevel> {
        if self.none {
            return Vec::new();
        }
        let f = &self.filter;
        RollupLevel::ALL
            .into_iter()
            .filter(|&l| self.levels[l as usize])
            .filter(|&l| {
                let below = |field: &Option<String>, kept_from: RollupLevel| {
                    field.is_some() && l > kept_from
                };
                !(below(&f.row, RollupLevel::Row)
                    || below(&f.rack, RollupLevel::Rack)
                    || below(&f.host, RollupLevel::Host)
                    || below(&f.gpu, RollupLevel::Gpu))
            })
            .collect()
    }

    /// The pushdown as `EXPLAIN` shows it.
    fn display(&self, time: &TimeRange) -> String {
        let levels: Vec<&str> = self.levels().into_iter().map(RollupLevel::name).collect();
        let mut s = format!("levels=[{}]", levels.join(", "));
        let f = &self.filter;
        for (name, v) in [
            ("metric", &f.metric),
            ("cluster", &f.cluster),
            ("row", &f.row),
            ("rack", &f.rack),
            ("host", &f.host),
            ("gpu", &f.gpu),
        ] {
            if let Some(v) = v {
                s.push_str(&format!(", {name}={v}"));
            }
        }
        s.push_str(&format!(", ts={}", time.display()));
        s
    }
}

/// The levels `e` allows, if it is a condition on `level` alone:
/// `level = 'x'`, `level IN (…)`, or an OR of those (DataFusion turns short
/// IN lists into ORs). Unknown level names allow nothing.
fn level_set(e: &Expr) -> Option<[bool; 5]> {
    match e {
        Expr::InList(InList {
            expr,
            list,
            negated: false,
        }) if column_of(expr) == Some("level") => {
            let mut allowed = [false; 5];
            for item in list {
                let name = literal_of(item).and_then(string_of)?;
                for (a, b) in allowed.iter_mut().zip(one_level(name)) {
                    *a |= b;
                }
            }
            Some(allowed)
        }
        Expr::BinaryExpr(BinaryExpr { left, op, right }) if *op == Operator::Or => {
            let (l, r) = (level_set(left)?, level_set(right)?);
            Some(std::array::from_fn(|i| l[i] || r[i]))
        }
        Expr::BinaryExpr(BinaryExpr { left, op, right }) if *op == Operator::Eq => {
            let name = match (column_of(left), column_of(right)) {
                (Some("level"), _) => literal_of(right).and_then(string_of)?,
                (_, Some("level")) => literal_of(left).and_then(string_of)?,
                _ => return None,
            };
            Some(one_level(name))
        }
        _ => None,
    }
}

/// Whether storage selects exactly the rows `e` (a filter [`Pushdown`]
/// absorbs) keeps, so that DataFusion need not test it again: conditions on
/// `level` (each level is read apart), and equalities of a group column with
/// a non-empty string (storage matches the group's field; an empty field is
/// NULL in SQL, which no `=` keeps); and bounds on `ts` by a whole
/// millisecond (storage reads the windows that overlap the range, and the
/// scan keeps those whose start lies in it: [`RollupBatches`]).
fn is_exact(e: &Expr) -> bool {
    if level_set(e).is_some() {
        return true;
    }
    let (cmps, all) = comparisons(e);
    all && cmps.iter().all(|c| match c.column {
        "ts" => TimeRange::is_exact(c.op, c.literal),
        "level" | "metric" | "cluster" | "row" | "rack" | "host" | "gpu" => {
            c.op == Operator::Eq && string_of(c.literal).is_some_and(|v| !v.is_empty())
        }
        _ => false,
    })
}

fn one_level(name: &str) -> [bool; 5] {
    let mut allowed = [false; 5];
    if let Some(l) = RollupLevel::by_name(name) {
        allowed[l as usize] = true;
    }
    allowed
}

#[async_trait]
impl TableProvider for RollupTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> Result<Vec<TableProviderFilterPushDown>> {
        Ok(filters
            .iter()
            .map(|f| {
                if !Pushdown::default().absorb(f) {
                    TableProviderFilterPushDown::Unsupported
                } else if is_exact(f) {
                    TableProviderFilterPushDown::Exact
                } else {
                    TableProviderFilterPushDown::Inexact
                }
            })
            .collect())
    }

    async fn scan(
        &self,
        _state: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        _limit: Option<usize>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let pushdown = Pushdown::from_filters(filters);
        let cols: Vec<usize> = match projection {
            Some(p) => p.clone(),
            None => (0..self.schema.fields().len()).collect(),
        };
        let schema = Arc::new(self.schema.project(&cols)?);
        let mut time = pushdown.time;
        time.min_ts = time.min_ts.max(self.window_starts.min_ts);
        time.max_ts = time.max_ts.min(self.window_starts.max_ts);
        let fetched = match &self.cluster {
            None => None,
            Some(reader) => {
                let mut levels = Vec::new();
                let mut warnings = Vec::new();
                for level in pushdown.levels() {
                    let got = reader
                        .rollups(self.tier, level, &pushdown.filter, time.min_ts, time.max_ts)
                        .await
                        .map_err(|e| datafusion::error::DataFusionError::External(Box::new(e)))?;
                    crate::cluster::add_warnings(&mut warnings, got.warnings);
                    levels.push((level, got.groups));
                }
                crate::cluster::report_sql_warnings(warnings)
                    .map_err(crate::cluster::refuse_unseen)?;
                Some(Arc::new(levels))
            }
        };
        let properties = PlanProperties::new(
            EquivalenceProperties::new(schema.clone()),
            Partitioning::UnknownPartitioning(1),
            EmissionType::Incremental,
            Boundedness::Bounded,
        );
        Ok(Arc::new(RollupScanExec {
            storage: self.storage.clone(),
            tier: self.tier,
            with_tier: self.with_tier,
            pushdown,
            time,
            cols,
            schema,
            properties: Arc::new(properties),
            fetched,
        }))
    }
}

/// The rollups of every level a cluster scan reads, fetched when it is planned.
type Fetched = Arc<Vec<(RollupLevel, Vec<(RollupGroup, Vec<RollupRecord>)>)>>;

/// Reads one tier's rollups from storage, one level after the other.
#[derive(Debug)]
pub struct RollupScanExec {
    storage: Arc<Storage>,
    tier: RollupTier,
    with_tier: bool,
    pushdown: Pushdown,
    /// The time range asked of storage: the table's `window_starts`
    /// narrowed by the filters on `ts`.
    time: TimeRange,
    cols: Vec<usize>,
    schema: SchemaRef,
    properties: Arc<PlanProperties>,
    /// Cluster mode: the levels' rollups, read from the cluster at planning.
    fetched: Option<Fetched>,
}

impl DisplayAs for RollupScanExec {
    fn fmt_as(&self, _t: DisplayFormatType, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let names: Vec<&str> = self
            .cols
            .iter()
            .map(|&i| COLUMNS.get(i).copied().unwrap_or("tier"))
            .collect();
        write!(
            f,
            "RollupScanExec: table={}, {}, projection=[{}]",
            table_name(self.tier),
            self.pushdown.display(&self.time),
            names.join(", ")
        )
    }
}

impl ExecutionPlan for RollupScanExec {
    fn name(&self) -> &str {
        "RollupScanExec"
    }

    fn properties(&self) -> &Arc<PlanProperties> {
        &self.properties
    }

    fn children(&self) -> Vec<&Arc<dyn ExecutionPlan>> {
        Vec::new()
    }

    fn apply_expressions(
        &self,
        _f: &mut dyn FnMut(&Arc<dyn PhysicalExpr>) -> Result<TreeNodeRecursion>,
    ) -> Result<TreeNodeRecursion> {
        Ok(TreeNodeRecursion::Continue)
    }

    fn with_new_children(
        self: Arc<Self>,
        _children: Vec<Arc<dyn ExecutionPlan>>,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        Ok(self)
    }

    fn execute(
        &self,
        _partition: usize,
        _context: Arc<TaskContext>,
    ) -> Result<SendableRecordBatchStream> {
        let iter = RollupBatches {
            storage: self.storage.clone(),
            tier: self.tier,
            tier_label: self.with_tier.then(|| self.tier.label()),
            filter: self.pushdown.filter.clone(),
            time: self.time,
            levels: self.pushdown.levels().into_iter(),
            level: RollupLevel::Gpu,
            groups: Vec::new().into_iter(),
            current: None,
            cols: self.cols.clone(),
            schema: self.schema.clone(),
            fetched: self.fetched.clone(),
        };
        Ok(Box::pin(RecordBatchStreamAdapter::new(
            self.schema.clone(),
            futures::stream::iter(iter),
        )))
    }
}

/// Reads a level from storage when the previous one is used up, and cuts its
/// rows into batches of [`BATCH_ROWS`].
struct RollupBatches {
    storage: Arc<Storage>,
    tier: RollupTier,
    tier_label: Option<&'static str>,
    filter: RollupFilter,
    /// The windows this scan emits, by their start: the table's
    /// `window_starts` narrowed by the filters on `ts`.
    time: TimeRange,
    levels: std::vec::IntoIter<RollupLevel>,
    /// The level `groups` belong to.
    level: RollupLevel,
    groups: std::vec::IntoIter<(RollupGroup, Vec<RollupRecord>)>,
    /// The group being emitted, its records, and the range of them still to
    /// emit (those whose window starts in `time`).
    current: Option<(RollupGroup, Vec<RollupRecord>, std::ops::Range<usize>)>,
    cols: Vec<usize>,
    schema: SchemaRef,
    /// Cluster mode: where levels come from instead of `storage`.
    fetched: Option<Fetched>,
}

/// A column of a batch being built. The numeric columns have no nulls, so
/// they are plain vectors that become arrays without a null buffer: Arrow's
/// builders set a validity bit a value (92 instructions a row of the 30-day
/// rack query went to them, callgrind).
enum Builder {
    Ts(Vec<i64>),
    Text(TextRuns),
    Count(Vec<i64>),
    Float(Vec<f64>),
}

impl RollupBatches {
    /// The next records of this scan (at most `max`, one group's, in window
    /// order) with their level and group, reading the next level from
    /// storage when needed.
    fn next_records(&mut self, max: usize) -> Option<(RollupLevel, &RollupGroup, &[RollupRecord])> {
        loop {
            if let Some((_, _, range)) = &self.current
                && !range.is_empty()
            {
                let (g, records, range) = self.current.as_mut().expect("BUG: checked above");
                let take = range.start..range.end.min(range.start + max);
                range.start = take.end;
                return Some((self.level, g, &records[take]));
            }
            if let Some((g, records)) = self.groups.next() {
                let (lo, hi) = (self.time.min_ts, self.time.max_ts);
                let from = records.partition_point(|r| r.window_start_ms < lo);
                let to = records.partition_point(|r| r.window_start_ms <= hi);
                self.current = Some((g, records, from..to.max(from)));
                continue;
            }
            let level = self.levels.next()?;
            self.level = level;
            self.groups = match &self.fetched {
                Some(f) => f
                    .iter()
                    .find(|(l, _)| *l == level)
                    .map(|(_, groups)| groups.clone())
                    .unwrap_or_default(),
                None => self.storage.select_rollup_fields(
                    self.tier,
                    level,
                    &self.filter,
                    (self.time.min_ts, self.time.max_ts),
                    fields_of(&self.cols),
                ),
            }
            .into_iter();
        }
    }
}

/// A text column built a run of equal values at a time (a group's field, a
/// level's name): the value's bytes are doubled into place rather than
/// copied once a row.
struct TextRuns {
    values: Vec<u8>,
    /// Where each row's value ends (the first row's starts at 0).
    ends: Vec<usize>,
    nulls: arrow::array::NullBufferBuilder,
}

impl Default for TextRuns {
    fn default() -> Self {
        Self {
            values: Vec::new(),
            ends: Vec::with_capacity(BATCH_ROWS),
            nulls: arrow::array::NullBufferBuilder::new(BATCH_ROWS),
        }
    }
}

impl TextRuns {
    /// `n` rows of `v` (NULL for `None`).
    fn push(&mut self, v: Option<&str>, n: usize) {
        let bytes = v.unwrap_or_default().as_bytes();
        let start = self.values.len();
        if !bytes.is_empty() && n > 0 {
            self.values.extend_from_slice(bytes);
            while self.values.len() - start < bytes.len() * n {
                let have = self.values.len() - start;
                let more = have.min(bytes.len() * n - have);
                self.values.extend_from_within(start..start + more);
            }
        }
        self.ends.extend((1..=n).map(|i| start + i * bytes.len()));
        match v {
            Some(_) => self.nulls.append_n_non_nulls(n),
            None => self.nulls.append_n_nulls(n),
        }
    }

    fn finish(mut self) -> Result<arrow::array::StringArray> {
        let too_long = || {
            datafusion::error::DataFusionError::Execution(
                "a batch's text column is over 2 GiB".into(),
            )
        };
        let mut offsets = Vec::with_capacity(self.ends.len() + 1);
        offsets.push(0i32);
        for &e in &self.ends {
            offsets.push(i32::try_from(e).map_err(|_| too_long())?);
        }
        Ok(arrow::array::StringArray::try_new(
            arrow::buffer::OffsetBuffer::new(offsets.into()),
            arrow::buffer::Buffer::from_vec(self.values),
            self.nulls.finish(),
        )?)
    }
}

/// The record fields that the columns `cols` (indexes into the table's
/// schema) show: storage decodes no other.
fn fields_of(cols: &[usize]) -> RecordFields {
    let mut f = RecordFields::NONE;
    for &i in cols {
        if let Col::Float(v) = Col::of(i) {
            match v {
                Value::Sum | Value::Avg => f.sum = true,
                Value::Min => f.min = true,
                Value::Max => f.max = true,
                Value::First => f.first = true,
                Value::Last => f.last = true,
            }
        }
    }
    f
}

/// What a projected column holds, resolved once per batch rather than by
/// name for every row.
#[derive(Clone, Copy)]
enum Col {
    Ts,
    Level,
    Tier,
    /// A group field.
    Group(fn(&RollupGroup) -> &str),
    Count,
    Float(Value),
}

/// A float column of a record.
#[derive(Clone, Copy)]
enum Value {
    Sum,
    Min,
    Max,
    First,
    Last,
    Avg,
}

impl Col {
    fn of(i: usize) -> Self {
        match COLUMNS.get(i).copied() {
            None => Col::Tier,
            Some("ts") => Col::Ts,
            Some("level") => Col::Level,
            Some("count") => Col::Count,
            Some("sum") => Col::Float(Value::Sum),
            Some("min") => Col::Float(Value::Min),
            Some("max") => Col::Float(Value::Max),
            Some("first") => Col::Float(Value::First),
            Some("last") => Col::Float(Value::Last),
            Some("avg") => Col::Float(Value::Avg),
            Some("metric") => Col::Group(|g| &g.metric),
            Some("cluster") => Col::Group(|g| &g.cluster),
            Some("row") => Col::Group(|g| &g.row),
            Some("rack") => Col::Group(|g| &g.rack),
            Some("host") => Col::Group(|g| &g.host),
            Some(_) => Col::Group(|g| &g.gpu),
        }
    }
}

impl Iterator for RollupBatches {
    type Item = Result<RecordBatch>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut builders: Vec<(Col, Builder)> = self
            .cols
            .iter()
            .map(|&i| {
                let col = Col::of(i);
                let b = match col {
                    Col::Ts => Builder::Ts(Vec::with_capacity(BATCH_ROWS)),
                    Col::Count => Builder::Count(Vec::with_capacity(BATCH_ROWS)),
                    Col::Level | Col::Tier | Col::Group(_) => Builder::Text(TextRuns::default()),
                    Col::Float(_) => Builder::Float(Vec::with_capacity(BATCH_ROWS)),
                };
                (col, b)
            })
            .collect();
        let tier_label = self.tier_label.unwrap_or_default();
        let mut rows = 0;
        while rows < BATCH_ROWS {
            let Some((level, g, records)) = self.next_records(BATCH_ROWS - rows) else {
                break;
            };
            // A group's records, column by column.
            for (col, b) in &mut builders {
                match (*col, b) {
                    (Col::Ts, Builder::Ts(b)) => {
                        b.extend(records.iter().map(|r| r.window_start_ms))
                    }
                    (Col::Count, Builder::Count(b)) => b.extend(
                        records
                            .iter()
                            .map(|r| i64::try_from(r.count).unwrap_or(i64::MAX)),
                    ),
                    (Col::Level, Builder::Text(b)) => b.push(Some(level.name()), records.len()),
                    (Col::Tier, Builder::Text(b)) => b.push(Some(tier_label), records.len()),
                    (Col::Group(field), Builder::Text(b)) => {
                        let v = field(g);
                        b.push((!v.is_empty()).then_some(v), records.len())
                    }
                    (Col::Float(v), Builder::Float(b)) => {
                        let rs = records.iter();
                        match v {
                            Value::Sum => b.extend(rs.map(|r| r.sum)),
                            Value::Min => b.extend(rs.map(|r| r.min)),
                            Value::Max => b.extend(rs.map(|r| r.max)),
                            Value::First => b.extend(rs.map(|r| r.first)),
                            Value::Last => b.extend(rs.map(|r| r.last)),
                            Value::Avg => b.extend(rs.map(|r| r.avg())),
                        }
                    }
                    _ => unreachable!("BUG: a column's builder is made for its kind"),
                }
            }
            rows += records.len();
        }
        if rows == 0 {
            return None;
        }
        let arrays: Result<Vec<ArrayRef>> = builders
            .into_iter()
            .map(|(_, b)| -> Result<ArrayRef> {
                Ok(match b {
                    Builder::Ts(v) => Arc::new(
                        TimestampMillisecondArray::new(v.into(), None).with_timezone("UTC"),
                    ),
                    Builder::Text(b) => Arc::new(b.finish()?),
                    Builder::Count(v) => Arc::new(Int64Array::new(v.into(), None)),
                    Builder::Float(v) => Arc::new(Float64Array::new(v.into(), None)),
                })
            })
            .collect();
        let options = RecordBatchOptions::new().with_row_count(Some(rows));
        Some(arrays.and_then(|arrays| {
            RecordBatch::try_new_with_options(self.schema.clone(), arrays, &options)
                .map_err(Into::into)
        }))
    }
}

/// The table function `rollup(start, end, step)` (see the module docs).
#[derive(Debug)]
pub struct RollupFunction {
    storage: Arc<Storage>,
    cluster: Option<ClusterReader>,
}

impl RollupFunction {
    pub fn new(storage: Arc<Storage>) -> Self {
        Self {
            storage,
            cluster: None,
        }
    }

    /// See [`RollupTable::in_cluster`]. The tier is still picked by this
    /// node's retention settings (every node should have the same).
    pub fn in_cluster(self, reader: Option<ClusterReader>) -> Self {
        Self {
            cluster: reader,
            ..self
        }
    }
}

impl TableFunctionImpl for RollupFunction {
    fn call_with_args(
        &self,
        args: datafusion::catalog::TableFunctionArgs,
    ) -> Result<Arc<dyn TableProvider>> {
        let exprs = args.exprs();
        if exprs.len() != 3 {
            return plan_err!(
                "rollup(start, end, step) takes 3 arguments, got {}",
                exprs.len()
            );
        }
        // `now()` in the arguments is the query's start, as everywhere else.
        let context = match args.session().execution_props().query_execution_start_time {
            Some(t) => SimplifyContext::builder().with_query_execution_start_time(Some(t)),
            None => SimplifyContext::builder().with_current_time(),
        }
        .build();
        let now_ms = context
            .query_execution_start_time()
            .expect("BUG: set above")
            .timestamp_millis();
        let simplifier = ExprSimplifier::new(context);
        let mut values = Vec::with_capacity(3);
        for (i, e) in exprs.iter().enumerate() {
            match simplifier.simplify(e.clone())? {
                Expr::Literal(v, _) => values.push(v),
                other => {
                    return plan_err!(
                        "rollup(): argument {} must be a constant, got {other}",
                        i + 1
                    );
                }
            }
        }
        let Some(start) = timestamp_ms(&values[0]) else {
            return plan_err!(
                "rollup(): start must be a timestamp, got {} ({})",
                values[0],
                values[0].data_type()
            );
        };
        let Some(end) = timestamp_ms(&values[1]) else {
            return plan_err!(
                "rollup(): end must be a timestamp, got {} ({})",
                values[1],
                values[1].data_type()
            );
        };
        let Some(step_ms) = step_ms(&values[2]) else {
            return plan_err!(
                "rollup(): step must be a positive interval such as '1h', '15m' or INTERVAL '1 day', got {}",
                values[2]
            );
        };
        if end <= start {
            return plan_err!("rollup(): end must be after start");
        }
        let tier = pick_tier(self.storage.config(), now_ms, start, step_ms);
        Ok(Arc::new(RollupTable {
            storage: self.storage.clone(),
            tier,
            window_starts: TimeRange {
                min_ts: start,
                max_ts: end - 1,
            },
            with_tier: true,
            schema: schema(true),
            cluster: self.cluster.clone(),
        }))
    }
}

/// The tier `rollup(start, …, step)` reads (see the module docs).
pub fn pick_tier(
    config: &storage::StorageConfig,
    now_ms: i64,
    start_ms: i64,
    step_ms: i64,
) -> RollupTier {
    let covers = |tier: RollupTier| match config.rollup_retention(tier) {
        None => true,
        Some(keep) => {
            let keep_ms = i64::try_from(keep.as_millis()).unwrap_or(i64::MAX);
            start_ms >= now_ms.saturating_sub(keep_ms)
        }
    };
    let fine_enough = |tier: RollupTier| tier.window_ms() <= step_ms;
    if let Some(t) = RollupTier::ALL
        .into_iter()
        .rev()
        .find(|&t| fine_enough(t) && covers(t))
    {
        return t;
    }
    if let Some(t) = RollupTier::ALL.into_iter().find(|&t| covers(t)) {
        return t;
    }
    RollupTier::ALL
        .into_iter()
        .max_by_key(|&t| {
            config
                .rollup_retention(t)
                .map_or(u128::MAX, |d| d.as_millis())
        })
        .expect("BUG: three tiers")
}

/// A timestamp argument in milliseconds: a timestamp, an RFC 3339 string, or
/// an integer of milliseconds since the epoch.
fn timestamp_ms(v: &ScalarValue) -> Option<i64> {
    if let Some((lo, _)) = crate::pushdown::timestamp_ms_bounds(v) {
        return Some(lo);
    }
    match v {
        ScalarValue::Int64(Some(ms)) => Some(*ms),
        v => {
            let s = string_of(v)?;
            arrow::compute::kernels::cast_utils::string_to_timestamp_nanos(s)
                .ok()
                .map(|ns| ns.div_euclid(1_000_000))
        }
    }
}

/// A step argument in milliseconds: an interval, or a duration string.
fn step_ms(v: &ScalarValue) -> Option<i64> {
    let ms = match v {
        ScalarValue::IntervalMonthDayNano(Some(i)) if i.months == 0 => {
            i64::from(i.days) * 86_400_000 + i.nanoseconds / 1_000_000
        }
        ScalarValue::IntervalDayTime(Some(i)) => {
            i64::from(i.days) * 86_400_000 + i64::from(i.milliseconds)
        }
        v => parse_duration_ms(string_of(v)?)?,
    };
    (ms > 0).then_some(ms)
}

/// `'90s'`, `'15m'`, `'1h'`, `'1d'`, `'1w'` (Prometheus style, one unit) or
/// `'15 minutes'`, `'1 hour'`, `'2 days'`.
pub(crate) fn parse_duration_ms(s: &str) -> Option<i64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let n: i64 = s[..split].parse().ok()?;
    let unit_ms: i64 = match s[split..].trim() {
        "ms" | "millisecond" | "milliseconds" => 1,
        "s" | "sec" | "second" | "seconds" => 1_000,
        "m" | "min" | "minute" | "minutes" => 60_000,
        "h" | "hour" | "hours" => 3_600_000,
        "d" | "day" | "days" => 86_400_000,
        "w" | "week" | "weeks" => 7 * 86_400_000,
        _ => return None,
    };
    n.checked_mul(unit_ms)
}

#[cfg(test)]
mod tests;
