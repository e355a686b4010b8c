//! What travels between nodes: the `DoGet` ticket (a select request) and the
//! Arrow schema of the answer.
//!
//! The ticket is JSON, versioned:
//!
//! ```json
//! {"v":1,"matchers":[{"name":"__name__","op":"=","value":"DCGM_FI_DEV_GPU_TEMP"}],
//!  "min_ts":1764496800000,"max_ts":1764500400000,"shards":[{"rack":"r7"},{"host":"h3"}]}
//! ```
//!
//! `op` is `=`, `!=`, `=~` or `!~` (regexes fully anchored, as in PromQL);
//! times are inclusive Unix milliseconds; `shards` restricts the answer to
//! series whose shard ([`super::shard_of`]) is listed. An optional
//! `"labels_only":true` asks for the series without their samples (empty
//! lists), for the label endpoints.
//!
//! The answer is a stream of record batches with one row per series (or per
//! piece of a long series: a series continues in the next rows, in time
//! order), so that labels travel once and samples as contiguous arrays:
//!
//! | column | type | |
//! | --- | --- | --- |
//! | `metric` | `Utf8` | the metric name |
//! | `labels` | `Map<Utf8, Utf8>` | the other labels, sorted by name |
//! | `ts` | `List<Int64>` | sample times, Unix ms, increasing |
//! | `value` | `List<Float64>` | sample values, bit-exact (NaN payloads too) |
//!
//! A ticket with a `rollups` object asks for rollup records instead:
//! `"rollups":{"tier":"1m","level":"row","filter":{"metric":"x","rack":"r7"}}`
//! (the filter's fields are those of [`storage::RollupFilter`], all
//! optional). `min_ts` and `max_ts` then bound the windows' *starts*, and
//! `matchers` is empty. The node answers the records of the listed shards
//! only: at gpu and host level as stored, at rack, row and cluster level
//! merged from its host-level records of those shards (its partial
//! aggregate of them). One row per group and window:
//!
//! | column | type |
//! | --- | --- |
//! | `metric`, `cluster`, `row`, `rack`, `host`, `gpu` | `Utf8` (empty below the level) |
//! | `window_start`, `first_ts`, `last_ts` | `Int64` (Unix ms) |
//! | `count` | `UInt64` |
//! | `sum`, `min`, `max`, `first`, `last` | `Float64` |
//!
//! A ticket with a `promql` object asks for aggregations evaluated by the
//! node over the series of the listed shards:
//! `"promql":{"queries":["sum by (rack) (rate(x[5m]))"],"start":…,"end":…,"step":15000,"lookback_ms":300000}`
//! (`step` 0 for one evaluation at `start` = `end`; at most 4 queries and
//! 11,000 steps). The answer has the series schema above, one row per result
//! series (or piece of one), its `metric` the index of its query in
//! `queries` (`"0"`, `"1"`, ...) and `labels` its label set (`__name__`
//! included where the result keeps it); `ts` are evaluation times.
//! The asking node merges the nodes' results ([`crate::promql`]'s pushdown).
//!
//! A ticket with a `sql` string asks the node to run that statement (a
//! read-only `SELECT`, at most 64 KiB) over a `samples` table of the listed
//! shards alone, and answers its result in the statement's own schema: the
//! partial results of an aggregate the asking node merges
//! ([`crate::sql_pushdown`]). `matchers` is empty then.
//!
//! A ticket with `"health":"events"` asks for the node's health events of
//! the listed shards (an event's shard is its GPU's rack, or its host), in
//! the schema of the `health_events` table
//! ([`crate::health_events::health_events_schema`]); `"health":"states"`
//! for each of those GPUs' state
//! ([`crate::health_events::states_schema`]). `matchers` is empty then,
//! and `min_ts` = `max_ts` is the asking node's clock (a GPU without a poll
//! for a minute before it is `unknown`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, OnceLock};

use arrow::array::{
    Array, ArrayRef, AsArray, Float64Array, Float64Builder, Int64Array, Int64Builder, ListArray,
    MapBuilder, RecordBatch, StringArray, StringBuilder, UInt64Builder,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Float64Type, Int64Type, Schema, SchemaRef, UInt64Type};
use cluster::ShardKey;
use serde::{Deserialize, Serialize};
use storage::{
    Label, Matcher, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier, SeriesKey,
    Sym,
};

/// The ticket format's version; a node refuses others.
pub(crate) const TICKET_VERSION: u32 = 1;

/// Most samples in one row: a longer series continues in the next row.
pub(crate) const ROW_SAMPLES: usize = 32 * 1024;
/// A batch is cut once it holds this many samples...
pub(crate) const BATCH_SAMPLES: usize = 64 * 1024;
/// ... or this many rows (series).
pub(crate) const BATCH_ROWS: usize = 4096;

/// One label matcher of a ticket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WireMatcher {
    pub name: String,
    pub op: String,
    pub value: String,
}

/// One shard of a ticket: exactly one of the two is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WireShard {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rack: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// The rollup part of a ticket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireRollups {
    tier: String,
    level: String,
    #[serde(default)]
    filter: WireFilter,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireFilter {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    metric: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cluster: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    row: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rack: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gpu: Option<String>,
}

/// A decoded rollup request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RollupRequest {
    pub tier: RollupTier,
    pub level: RollupLevel,
    pub filter: RollupFilter,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireTicket {
    v: u32,
    matchers: Vec<WireMatcher>,
    min_ts: i64,
    max_ts: i64,
    shards: Vec<WireShard>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    labels_only: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rollups: Option<WireRollups>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    health: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    promql: Option<PromqlRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sql: Option<String>,
}

/// Longest SQL text a ticket may carry.
const MAX_SQL_BYTES: usize = 64 * 1024;

/// Most queries one PromQL ticket may carry.
const MAX_PROMQL_QUERIES: usize = 4;

/// The PromQL part of a ticket: aggregations for the node to evaluate over
/// the series of the listed shards only (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct PromqlRequest {
    /// Each an aggregation, such as `sum by (rack) (rate(x[5m]))`.
    pub queries: Vec<String>,
    /// Evaluation times: `start`, `start + step`, ... up to `end`; one
    /// (`start` = `end`) when `step` is 0.
    pub start: i64,
    pub end: i64,
    pub step: i64,
    /// The asking node's lookback delta.
    pub lookback_ms: i64,
}

impl PromqlRequest {
    /// What is wrong with the request, if anything.
    fn check(&self) -> Result<(), String> {
        if self.queries.is_empty() || self.queries.len() > MAX_PROMQL_QUERIES {
            return Err(format!(
                "a PromQL ticket carries 1 to {MAX_PROMQL_QUERIES} queries, not {}",
                self.queries.len()
            ));
        }
        if self.step < 0 || self.start > self.end || (self.step == 0 && self.start != self.end) {
            return Err(format!(
                "bad PromQL evaluation times: start {}, end {}, step {}",
                self.start, self.end, self.step
            ));
        }
        let steps = if self.step == 0 {
            1
        } else {
            (self.end - self.start) / self.step + 1
        };
        if steps > crate::promql::MAX_POINTS_PER_SERIES {
            return Err(format!(
                "a PromQL ticket evaluates at most {} steps, not {steps}",
                crate::promql::MAX_POINTS_PER_SERIES
            ));
        }
        if self.lookback_ms <= 0 {
            return Err(format!("bad lookback delta {} ms", self.lookback_ms));
        }
        Ok(())
    }
}

/// What a health ticket asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HealthPart {
    /// The events, open and closed.
    Events,
    /// Each GPU's state.
    States,
}

impl HealthPart {
    fn name(self) -> &'static str {
        match self {
            HealthPart::Events => "events",
            HealthPart::States => "states",
        }
    }
}

/// A decoded select request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SelectRequest {
    pub matchers: Vec<Matcher>,
    pub min_ts: i64,
    pub max_ts: i64,
    pub shards: BTreeSet<ShardKey>,
    /// Series without samples.
    pub labels_only: bool,
    /// Rollup records instead of series (`min_ts`/`max_ts` bound window starts).
    pub rollups: Option<RollupRequest>,
    /// Health events or GPU states instead of series (`min_ts` is the clock).
    pub health: Option<HealthPart>,
    /// Partial aggregations instead of series.
    pub promql: Option<PromqlRequest>,
    /// A SQL statement over `samples` of the listed shards, its result
    /// instead of series (an aggregate's partial results).
    pub sql: Option<String>,
}

fn wire_matcher(m: &Matcher) -> WireMatcher {
    let (op, value) = match m {
        Matcher::Equal { value, .. } => ("=", value.clone()),
        Matcher::NotEqual { value, .. } => ("!=", value.clone()),
        Matcher::Regex { pattern, .. } => ("=~", pattern.as_str().to_owned()),
        Matcher::NotRegex { pattern, .. } => ("!~", pattern.as_str().to_owned()),
    };
    WireMatcher {
        name: m.name().to_owned(),
        op: op.to_owned(),
        value,
    }
}

fn wire_shards(shards: &BTreeSet<ShardKey>) -> Vec<WireShard> {
    shards
        .iter()
        .map(|k| match k {
            ShardKey::Rack(r) => WireShard {
                rack: Some(r.clone()),
                host: None,
            },
            ShardKey::Host(h) => WireShard {
                rack: None,
                host: Some(h.clone()),
            },
        })
        .collect()
}

/// The ticket bytes of a select request.
pub(crate) fn encode_ticket(
    matchers: &[Matcher],
    min_ts: i64,
    max_ts: i64,
    shards: &BTreeSet<ShardKey>,
    labels_only: bool,
) -> Vec<u8> {
    let t = WireTicket {
        v: TICKET_VERSION,
        matchers: matchers.iter().map(wire_matcher).collect(),
        min_ts,
        max_ts,
        shards: wire_shards(shards),
        labels_only,
        rollups: None,
        health: None,
        promql: None,
        sql: None,
    };
    serde_json::to_vec(&t).expect("BUG: a ticket of strings and integers serializes")
}

/// The ticket bytes of a health request for `shards`, at `now_ms`.
pub(crate) fn encode_health_ticket(
    part: HealthPart,
    now_ms: i64,
    shards: &BTreeSet<ShardKey>,
) -> Vec<u8> {
    let t = WireTicket {
        v: TICKET_VERSION,
        matchers: Vec::new(),
        min_ts: now_ms,
        max_ts: now_ms,
        shards: wire_shards(shards),
        labels_only: false,
        rollups: None,
        health: Some(part.name().to_owned()),
        promql: None,
        sql: None,
    };
    serde_json::to_vec(&t).expect("BUG: a ticket of strings and integers serializes")
}

/// The ticket bytes of a rollup request for windows starting in
/// `[min_start, max_start]`.
pub(crate) fn encode_rollup_ticket(
    req: &RollupRequest,
    min_start: i64,
    max_start: i64,
    shards: &BTreeSet<ShardKey>,
) -> Vec<u8> {
    let f = &req.filter;
    let t = WireTicket {
        v: TICKET_VERSION,
        matchers: Vec::new(),
        min_ts: min_start,
        max_ts: max_start,
        shards: wire_shards(shards),
        labels_only: false,
        rollups: Some(WireRollups {
            tier: req.tier.label().to_owned(),
            level: req.level.name().to_owned(),
            filter: WireFilter {
                metric: f.metric.clone(),
                cluster: f.cluster.clone(),
                row: f.row.clone(),
                rack: f.rack.clone(),
                host: f.host.clone(),
                gpu: f.gpu.clone(),
            },
        }),
        health: None,
        promql: None,
        sql: None,
    };
    serde_json::to_vec(&t).expect("BUG: a ticket of strings and integers serializes")
}

/// Parses ticket bytes.
///
/// # Errors
/// What is wrong with them: not JSON of the documented shape, another
/// version, an unknown operator, a bad regex, a shard with both or neither
/// of rack and host.
pub(crate) fn decode_ticket(bytes: &[u8]) -> Result<SelectRequest, String> {
    let t: WireTicket = serde_json::from_slice(bytes)
        .map_err(|e| format!("the ticket is not a select request: {e}"))?;
    if t.v != TICKET_VERSION {
        return Err(format!(
            "ticket version {} is not supported (this node speaks version {TICKET_VERSION}); \
             run the same gpulse release on every node",
            t.v
        ));
    }
    let mut matchers = Vec::with_capacity(t.matchers.len());
    for m in t.matchers {
        let bad_re = |e: regex::Error| {
            format!(
                "matcher {}{}{:?}: invalid regex: {e}",
                m.name, m.op, m.value
            )
        };
        matchers.push(match m.op.as_str() {
            "=" => Matcher::equal(&m.name, &m.value),
            "!=" => Matcher::not_equal(&m.name, &m.value),
            "=~" => Matcher::regex(&m.name, &m.value).map_err(bad_re)?,
            "!~" => Matcher::not_regex(&m.name, &m.value).map_err(bad_re)?,
            other => {
                return Err(format!(
                    "matcher on {:?}: unknown operator {other:?}",
                    m.name
                ));
            }
        });
    }
    let mut shards = BTreeSet::new();
    for s in t.shards {
        shards.insert(match (s.rack, s.host) {
            (Some(r), None) if !r.is_empty() => ShardKey::Rack(r),
            (None, Some(h)) => ShardKey::Host(h),
            (r, h) => {
                return Err(format!(
                    "a shard needs exactly one of a non-empty rack or a host, got rack {r:?} and host {h:?}"
                ));
            }
        });
    }
    let rollups = match t.rollups {
        None => None,
        Some(r) => {
            let tier = RollupTier::by_label(&r.tier)
                .ok_or_else(|| format!("unknown rollup tier {:?}: 1m, 1h or 1d", r.tier))?;
            let level = RollupLevel::by_name(&r.level).ok_or_else(|| {
                format!(
                    "unknown rollup level {:?}: gpu, host, rack, row or cluster",
                    r.level
                )
            })?;
            let f = r.filter;
            Some(RollupRequest {
                tier,
                level,
                filter: RollupFilter {
                    metric: f.metric,
                    cluster: f.cluster,
                    row: f.row,
                    rack: f.rack,
                    host: f.host,
                    gpu: f.gpu,
                },
            })
        }
    };
    let health = match t.health.as_deref() {
        None => None,
        Some("events") => Some(HealthPart::Events),
        Some("states") => Some(HealthPart::States),
        Some(other) => {
            return Err(format!(
                "unknown health request {other:?}: events or states"
            ));
        }
    };
    if [
        health.is_some(),
        rollups.is_some(),
        t.promql.is_some(),
        t.sql.is_some(),
    ]
    .into_iter()
    .filter(|&b| b)
    .count()
        > 1
    {
        return Err("a ticket asks for one of rollups, health, PromQL and SQL, not several".into());
    }
    if let Some(sql) = &t.sql
        && sql.len() > MAX_SQL_BYTES
    {
        return Err(format!(
            "the ticket's SQL is {} bytes, over the limit of {MAX_SQL_BYTES}",
            sql.len()
        ));
    }
    if let Some(p) = &t.promql {
        p.check()?;
    }
    Ok(SelectRequest {
        matchers,
        min_ts: t.min_ts,
        max_ts: t.max_ts,
        shards,
        labels_only: t.labels_only,
        rollups,
        health,
        promql: t.promql,
        sql: t.sql,
    })
}

/// The ticket bytes of a PromQL request over `shards`.
pub(crate) fn encode_promql_ticket(req: &PromqlRequest, shards: &BTreeSet<ShardKey>) -> Vec<u8> {
    let t = WireTicket {
        v: TICKET_VERSION,
        matchers: Vec::new(),
        min_ts: req.start,
        max_ts: req.end,
        shards: wire_shards(shards),
        labels_only: false,
        rollups: None,
        health: None,
        promql: Some(req.clone()),
        sql: None,
    };
    serde_json::to_vec(&t).expect("BUG: a ticket of strings and integers serializes")
}

/// The ticket bytes of a SQL statement to run over the `samples` of
/// `shards` (see the module docs).
pub(crate) fn encode_sql_ticket(sql: &str, shards: &BTreeSet<ShardKey>) -> Vec<u8> {
    let t = WireTicket {
        v: TICKET_VERSION,
        matchers: Vec::new(),
        min_ts: i64::MIN,
        max_ts: i64::MAX,
        shards: wire_shards(shards),
        labels_only: false,
        rollups: None,
        health: None,
        promql: None,
        sql: Some(sql.to_owned()),
    };
    serde_json::to_vec(&t).expect("BUG: a ticket of strings and integers serializes")
}

/// The schema of a `DoGet` answer.
pub(crate) fn schema() -> SchemaRef {
    static SCHEMA: OnceLock<SchemaRef> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            // The map type exactly as `MapBuilder` makes it.
            let labels = labels_builder().finish();
            Arc::new(Schema::new(vec![
                Field::new("metric", DataType::Utf8, false),
                Field::new("labels", labels.data_type().clone(), false),
                Field::new(
                    "ts",
                    DataType::List(Arc::new(Field::new_list_field(DataType::Int64, false))),
                    false,
                ),
                Field::new(
                    "value",
                    DataType::List(Arc::new(Field::new_list_field(DataType::Float64, false))),
                    false,
                ),
            ]))
        })
        .clone()
}

fn labels_builder() -> MapBuilder<StringBuilder, StringBuilder> {
    MapBuilder::new(None, StringBuilder::new(), StringBuilder::new())
}

/// Builds answer batches row by row.
pub(crate) struct BatchBuilder {
    metric: StringBuilder,
    labels: MapBuilder<StringBuilder, StringBuilder>,
    ts: Vec<i64>,
    values: Vec<f64>,
    /// Row ends in `ts`/`values`.
    offsets: Vec<i32>,
}

impl BatchBuilder {
    pub(crate) fn new() -> Self {
        Self {
            metric: StringBuilder::new(),
            labels: labels_builder(),
            ts: Vec::new(),
            values: Vec::new(),
            offsets: vec![0],
        }
    }

    pub(crate) fn rows(&self) -> usize {
        self.offsets.len() - 1
    }

    pub(crate) fn samples(&self) -> usize {
        self.ts.len()
    }

    /// Whether the batch should be sent before more rows are added.
    pub(crate) fn full(&self) -> bool {
        self.samples() >= BATCH_SAMPLES || self.rows() >= BATCH_ROWS
    }

    /// Adds one row: `key` with up to [`ROW_SAMPLES`] samples.
    pub(crate) fn push(&mut self, key: &SeriesKey, ts: &[i64], values: &[f64]) {
        let labels = key
            .labels()
            .iter()
            .map(|l| (l.name.as_str(), l.value.as_str()));
        self.push_labels(key.metric(), labels, ts, values);
    }

    /// Adds one row of `metric` (the query's index in a PromQL answer) and
    /// `labels` (sorted by name) with up to [`ROW_SAMPLES`] samples.
    pub(crate) fn push_labels<'a>(
        &mut self,
        metric: &str,
        labels: impl IntoIterator<Item = (&'a str, &'a str)>,
        ts: &[i64],
        values: &[f64],
    ) {
        debug_assert_eq!(ts.len(), values.len());
        self.metric.append_value(metric);
        for (name, value) in labels {
            self.labels.keys().append_value(name);
            self.labels.values().append_value(value);
        }
        self.labels
            .append(true)
            .expect("BUG: keys and values are appended in pairs");
        self.ts.extend_from_slice(ts);
        self.values.extend_from_slice(values);
        self.offsets.push(
            i32::try_from(self.ts.len()).expect("BUG: a batch holds far fewer than 2^31 samples"),
        );
    }

    /// The batch so far; the builder starts over.
    pub(crate) fn finish(&mut self) -> RecordBatch {
        let offsets = OffsetBuffer::new(std::mem::replace(&mut self.offsets, vec![0]).into());
        let ts = Int64Array::from(std::mem::take(&mut self.ts));
        let values = Float64Array::from(std::mem::take(&mut self.values));
        let columns: Vec<ArrayRef> = vec![
            Arc::new(self.metric.finish()),
            Arc::new(self.labels.finish()),
            Arc::new(ListArray::new(
                Arc::new(Field::new_list_field(DataType::Int64, false)),
                offsets.clone(),
                Arc::new(ts),
                None,
            )),
            Arc::new(ListArray::new(
                Arc::new(Field::new_list_field(DataType::Float64, false)),
                offsets,
                Arc::new(values),
                None,
            )),
        ];
        RecordBatch::try_new(schema(), columns).expect("BUG: columns built to the schema")
    }
}

/// One series of an answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FetchedSeries {
    pub ts: Vec<i64>,
    pub values: Vec<f64>,
}

/// Collects the series of an answer from its batches, checking everything
/// a peer could get wrong.
#[derive(Debug, Default)]
pub(crate) struct AnswerDecoder {
    series: BTreeMap<SeriesKey, FetchedSeries>,
    samples: usize,
}

impl AnswerDecoder {
    pub(crate) fn samples(&self) -> usize {
        self.samples
    }

    /// Adds one batch.
    ///
    /// # Errors
    /// The batch does not have the answer schema, holds nulls, rows whose
    /// time and value lists differ in length, an invalid series key, or
    /// times that do not increase within a series.
    pub(crate) fn push(&mut self, batch: &RecordBatch) -> Result<(), String> {
        let c = SeriesColumns::of(batch)?;
        for row in 0..batch.num_rows() {
            let row_labels: Vec<Label> = c
                .labels(row)
                .map(|(name, value)| Label::new(name, value))
                .collect();
            let key = SeriesKey::new(c.metric.value(row), row_labels)
                .map_err(|e| format!("row {row}: invalid series: {e}"))?;
            let (row_ts, row_values) = c.points(row).map_err(|e| format!("{e} ({key})"))?;
            let s = self.series.entry(key).or_insert_with(|| FetchedSeries {
                ts: Vec::new(),
                values: Vec::new(),
            });
            let mut last = s.ts.last().copied();
            for &t in row_ts {
                if last.is_some_and(|l| t <= l) {
                    return Err(format!(
                        "row {row}: sample times do not increase ({} then {t})",
                        last.unwrap_or_default()
                    ));
                }
                last = Some(t);
            }
            s.ts.extend_from_slice(row_ts);
            s.values.extend_from_slice(row_values);
            self.samples += row_ts.len();
        }
        Ok(())
    }

    pub(crate) fn finish(self) -> BTreeMap<SeriesKey, FetchedSeries> {
        self.series
    }
}

/// The columns of a batch of the series schema ([`schema`]), checked for
/// the schema and for nulls, by row.
struct SeriesColumns<'a> {
    metric: &'a StringArray,
    keys: &'a StringArray,
    values: &'a StringArray,
    label_offsets: &'a [i32],
    ts: &'a [i64],
    ts_offsets: &'a [i32],
    samples: &'a [f64],
    sample_offsets: &'a [i32],
}

impl<'a> SeriesColumns<'a> {
    fn of(batch: &'a RecordBatch) -> Result<Self, String> {
        if batch.schema().fields() != schema().fields() {
            return Err(format!(
                "the answer's schema is {:?}, not the gpulse series schema",
                batch.schema()
            ));
        }
        let metric: &StringArray = batch.column(0).as_string();
        let labels = batch.column(1).as_map();
        let ts_list = batch.column(2).as_list::<i32>();
        let value_list = batch.column(3).as_list::<i32>();
        let ts = ts_list.values().as_primitive::<Int64Type>();
        let samples = value_list.values().as_primitive::<Float64Type>();
        let (keys, values) = (
            labels.keys().as_string::<i32>(),
            labels.values().as_string::<i32>(),
        );
        let nulls = [
            metric.null_count(),
            labels.null_count(),
            ts_list.null_count(),
            value_list.null_count(),
            ts.null_count(),
            samples.null_count(),
            keys.null_count(),
            values.null_count(),
        ];
        if nulls.iter().any(|&n| n > 0) {
            return Err("the answer holds nulls".into());
        }
        Ok(Self {
            metric,
            keys,
            values,
            label_offsets: labels.value_offsets(),
            ts: ts.values(),
            ts_offsets: ts_list.value_offsets(),
            samples: samples.values(),
            sample_offsets: value_list.value_offsets(),
        })
    }

    /// Row `row`'s labels, as sent.
    fn labels(&self, row: usize) -> impl Iterator<Item = (&'a str, &'a str)> + use<'a> {
        let (keys, values) = (self.keys, self.values);
        let (a, z) = (
            self.label_offsets[row] as usize,
            self.label_offsets[row + 1] as usize,
        );
        (a..z).map(move |i| (keys.value(i), values.value(i)))
    }

    /// Row `row`'s times and values.
    ///
    /// # Errors
    /// The two lists differ in length.
    fn points(&self, row: usize) -> Result<(&'a [i64], &'a [f64]), String> {
        let (ta, tz) = (
            self.ts_offsets[row] as usize,
            self.ts_offsets[row + 1] as usize,
        );
        let (va, vz) = (
            self.sample_offsets[row] as usize,
            self.sample_offsets[row + 1] as usize,
        );
        if tz - ta != vz - va {
            return Err(format!(
                "row {row}: {} times but {} values",
                tz - ta,
                vz - va
            ));
        }
        Ok((&self.ts[ta..tz], &self.samples[va..vz]))
    }
}

/// One row of a PromQL answer: part of a result series of query `query`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PartialRow {
    pub query: usize,
    pub labels: crate::promql::LabelSet,
    pub ts: Vec<i64>,
    pub values: Vec<f64>,
}

/// The rows of one batch of a PromQL answer to a ticket of `queries`
/// queries, appended to `out`; returns how many points they hold.
///
/// # Errors
/// The batch does not have the answer schema, holds nulls, a query index
/// out of range, labels not sorted by name or repeated, rows whose time and
/// value lists differ in length, or times that do not increase.
pub(crate) fn decode_partials(
    batch: &RecordBatch,
    queries: usize,
    out: &mut Vec<PartialRow>,
) -> Result<usize, String> {
    let c = SeriesColumns::of(batch)?;
    let mut points = 0;
    // Label names, and most values, repeat from row to row (every series of
    // a host has its `Hostname`): each string becomes one shared symbol per
    // batch, not an allocation per row (9 % of the asking node's CPU for a
    // dashboard's selector panel, `perf`).
    let mut syms: std::collections::HashMap<&str, Sym, foldhash::fast::RandomState> =
        Default::default();
    let mut sym = |s| syms.entry(s).or_insert_with(|| Sym::from(s)).clone();
    for row in 0..batch.num_rows() {
        let metric = c.metric;
        let query = metric
            .value(row)
            .parse::<usize>()
            .ok()
            .filter(|&q| q < queries)
            .ok_or_else(|| {
                format!(
                    "row {row}: {:?} names none of the ticket's {queries} queries",
                    metric.value(row)
                )
            })?;
        let row_labels: crate::promql::LabelSet =
            c.labels(row).map(|(n, v)| (sym(n), sym(v))).collect();
        if row_labels.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(format!("row {row}: labels not sorted by name, or repeated"));
        }
        let (row_ts, row_values) = c.points(row)?;
        if row_ts.windows(2).any(|w| w[0] >= w[1]) {
            return Err(format!("row {row}: times do not increase"));
        }
        points += row_ts.len();
        out.push(PartialRow {
            query,
            labels: row_labels,
            ts: row_ts.to_vec(),
            values: row_values.to_vec(),
        });
    }
    Ok(points)
}

/// Rows per rollup answer batch.
pub(crate) const ROLLUP_BATCH_ROWS: usize = 8192;

const GROUP_FIELDS: [&str; 6] = ["metric", "cluster", "row", "rack", "host", "gpu"];

/// The schema of a rollup answer.
pub(crate) fn rollup_schema() -> SchemaRef {
    static SCHEMA: OnceLock<SchemaRef> = OnceLock::new();
    SCHEMA
        .get_or_init(|| {
            let mut fields: Vec<Field> = GROUP_FIELDS
                .iter()
                .map(|n| Field::new(*n, DataType::Utf8, false))
                .collect();
            fields.extend([
                Field::new("window_start", DataType::Int64, false),
                Field::new("count", DataType::UInt64, false),
                Field::new("sum", DataType::Float64, false),
                Field::new("min", DataType::Float64, false),
                Field::new("max", DataType::Float64, false),
                Field::new("first", DataType::Float64, false),
                Field::new("first_ts", DataType::Int64, false),
                Field::new("last", DataType::Float64, false),
                Field::new("last_ts", DataType::Int64, false),
            ]);
            Arc::new(Schema::new(fields))
        })
        .clone()
}

/// Rollup records by group and window start: what a node answers, and
/// what the asking node merges the answers into.
pub(crate) type RollupMap = BTreeMap<RollupGroup, BTreeMap<i64, RollupRecord>>;

/// Merges one record into `map`.
pub(crate) fn merge_record(map: &mut RollupMap, g: &RollupGroup, r: &RollupRecord) {
    let windows = match map.get_mut(g) {
        Some(w) => w,
        None => map.entry(g.clone()).or_default(),
    };
    windows
        .entry(r.window_start_ms)
        .and_modify(|m| m.merge(r))
        .or_insert(*r);
}

/// The batches of a rollup answer.
pub(crate) fn rollup_batches(map: &RollupMap) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    let rows: Vec<(&RollupGroup, &RollupRecord)> = map
        .iter()
        .flat_map(|(g, w)| w.values().map(move |r| (g, r)))
        .collect();
    for chunk in rows.chunks(ROLLUP_BATCH_ROWS) {
        let mut text: Vec<StringBuilder> = (0..GROUP_FIELDS.len())
            .map(|_| StringBuilder::new())
            .collect();
        let (mut window, mut first_ts, mut last_ts) = (
            Int64Builder::new(),
            Int64Builder::new(),
            Int64Builder::new(),
        );
        let mut count = UInt64Builder::new();
        let mut f: Vec<Float64Builder> = (0..5).map(|_| Float64Builder::new()).collect();
        for (g, r) in chunk {
            for (b, v) in text
                .iter_mut()
                .zip([&g.metric, &g.cluster, &g.row, &g.rack, &g.host, &g.gpu])
            {
                b.append_value(v);
            }
            window.append_value(r.window_start_ms);
            count.append_value(r.count);
            for (b, v) in f.iter_mut().zip([r.sum, r.min, r.max, r.first, r.last]) {
                b.append_value(v);
            }
            first_ts.append_value(r.first_ts_ms);
            last_ts.append_value(r.last_ts_ms);
        }
        let mut cols: Vec<ArrayRef> = text
            .into_iter()
            .map(|mut b| Arc::new(b.finish()) as ArrayRef)
            .collect();
        let mut f = f.into_iter().map(|mut b| Arc::new(b.finish()) as ArrayRef);
        let mut next_f = || f.next().expect("BUG: five float columns");
        cols.push(Arc::new(window.finish()));
        cols.push(Arc::new(count.finish()));
        cols.push(next_f()); // sum
        cols.push(next_f()); // min
        cols.push(next_f()); // max
        cols.push(next_f()); // first
        cols.push(Arc::new(first_ts.finish()));
        cols.push(next_f()); // last
        cols.push(Arc::new(last_ts.finish()));
        out.push(
            RecordBatch::try_new(rollup_schema(), cols).expect("BUG: columns built to the schema"),
        );
    }
    out
}

/// Merges a rollup answer batch into `map`.
///
/// # Errors
/// The batch does not have the rollup schema or holds nulls.
pub(crate) fn merge_rollup_batch(map: &mut RollupMap, batch: &RecordBatch) -> Result<(), String> {
    if batch.schema().fields() != rollup_schema().fields() {
        return Err(format!(
            "the answer's schema is {:?}, not the gpulse rollup schema",
            batch.schema()
        ));
    }
    if batch.columns().iter().any(|c| c.null_count() > 0) {
        return Err("the answer holds nulls".into());
    }
    let text: Vec<&StringArray> = (0..GROUP_FIELDS.len())
        .map(|i| batch.column(i).as_string::<i32>())
        .collect();
    let int = |i: usize| batch.column(i).as_primitive::<Int64Type>();
    let float = |i: usize| batch.column(i).as_primitive::<Float64Type>();
    let (window, first_ts, last_ts) = (int(6), int(12), int(14));
    let count = batch.column(7).as_primitive::<UInt64Type>();
    let (sum, min, max, first, last) = (float(8), float(9), float(10), float(11), float(13));
    for row in 0..batch.num_rows() {
        let g = RollupGroup {
            metric: text[0].value(row).to_owned(),
            cluster: text[1].value(row).to_owned(),
            row: text[2].value(row).to_owned(),
            rack: text[3].value(row).to_owned(),
            host: text[4].value(row).to_owned(),
            gpu: text[5].value(row).to_owned(),
        };
        let r = RollupRecord {
            window_start_ms: window.value(row),
            count: count.value(row),
            sum: sum.value(row),
            min: min.value(row),
            max: max.value(row),
            first: first.value(row),
            first_ts_ms: first_ts.value(row),
            last: last.value(row),
            last_ts_ms: last_ts.value(row),
        };
        if r.count == 0 {
            return Err(format!("row {row}: a rollup record of no samples"));
        }
        merge_record(map, &g, &r);
    }
    Ok(())
}
