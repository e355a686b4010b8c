//! The evaluator: every node is evaluated for all steps of the query at
//! once (one storage read per selector), as Prometheus's `rangeEval` does.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use promql_parser::label::MatchOp;
use promql_parser::parser::value::ValueType;
use promql_parser::parser::{
    AtModifier, Expr, MatrixSelector, Offset, SubqueryExpr, VectorSelector,
};
use storage::Matcher;

use super::functions::RangeValue;
use super::value::{
    Elem, LabelSetIds, METRIC_NAME, NameDropper, RangeInput, RawSeries, Val, Vector, check_unique,
    check_unique_steps,
};
use super::{LabelSet, PromEngine, PromError, PromValue, Sample, Series, is_stale_nan, labels_of};

type Result<T> = std::result::Result<T, PromError>;

/// A series' label set and its (step index, value) points.
pub(super) type SelectedPoints = (Arc<LabelSet>, Vec<(u32, f64)>);

/// A matrix selector's series before they are read
/// ([`Evaluator::matrix_selection`]).
pub(super) struct MatrixSelection {
    /// The selector's range and modifiers; no series.
    pub(super) input: RangeInput,
    pub(super) series: Vec<crate::cluster::ClusterSeries>,
    /// The span `[min_ts, max_ts]` to read.
    pub(super) window: (i64, i64),
    /// The samples the series may hold in all.
    pub(super) work: usize,
}

/// Reads `s`'s samples in `window` into `ts` and `vs` (cleared first),
/// without staleness markers unless `keep_stale`; checks the deadline
/// first, so that a long selection still stops between series.
fn read_series(
    deadline: crate::limits::Deadline,
    s: &crate::cluster::ClusterSeries,
    (min_ts, max_ts): (i64, i64),
    keep_stale: bool,
    ts: &mut Vec<i64>,
    vs: &mut Vec<f64>,
) -> Result<()> {
    deadline.check().map_err(PromError::Refused)?;
    ts.clear();
    vs.clear();
    s.read_into(min_ts, max_ts, ts, vs)
        .map_err(|e| PromError::Internal(format!("reading {}: {e}", s.key)))?;
    if !keep_stale && vs.iter().any(|&v| is_stale_nan(v)) {
        let mut kept = 0;
        for i in 0..vs.len() {
            if !is_stale_nan(vs[i]) {
                (ts[kept], vs[kept]) = (ts[i], vs[i]);
                kept += 1;
            }
        }
        ts.truncate(kept);
        vs.truncate(kept);
    }
    Ok(())
}

/// A selector's points for one series at reference times `refs`: the
/// newest sample within `lookback` of each (staleness markers end a
/// series; see [`step_points`]).
fn series_step_points(
    ts: &[i64],
    vs: &[f64],
    refs: &[i64],
    ascending: bool,
    lookback: i64,
    sample_time: bool,
) -> Vec<(u32, f64)> {
    // Ascending steps: only those whose lookback window can hold one of
    // the series' samples.
    let (reach, room) = match (ts.first(), ts.last()) {
        (Some(&first), Some(&last)) if ascending => {
            let reach = super::value::steps_reaching(refs, |r| r, lookback, (first, last));
            (reach.clone(), reach.len())
        }
        _ => (0..refs.len(), 0),
    };
    // A point for each step reached, at most: one allocation, where
    // growing by pushes reallocated six times a series (5 % of a
    // dashboard panel's `avg` over 1,000 GPUs, callgrind).
    let mut points = Vec::with_capacity(room);
    let steps = (reach.start, &refs[reach]);
    if sample_time {
        step_points::<true>(ts, vs, steps, ascending, lookback, &mut points);
    } else {
        step_points::<false>(ts, vs, steps, ascending, lookback, &mut points);
    }
    shrink_if_sparse(&mut points);
    points
}

/// Prometheus's default `evaluation_interval`, the step of a subquery
/// written without one (`x[1h:]`).
const DEFAULT_SUBQUERY_STEP_MS: i64 = 60_000;

/// Most steps of one subquery's inner evaluation.
const MAX_SUBQUERY_STEPS: i64 = 1_000_000;

/// An instant vector as [`Evaluator::operand`] made it.
pub(super) enum Operand {
    /// Series by series, in the order a vector of each step holds them.
    /// Two series have one label set only where a selector's source gave
    /// them (a vector of a step would hold both too).
    Series(Vec<SelectedPoints>),
    /// A vector per step.
    Steps(Vec<Vector>),
}

/// Whether no two of `series` have one label set.
fn distinct_labels(series: &[SelectedPoints]) -> bool {
    let mut seen = std::collections::HashSet::with_capacity_and_hasher(
        series.len(),
        foldhash::fast::RandomState::default(),
    );
    series.iter().all(|(labels, _)| seen.insert(&**labels))
}

pub(super) struct Evaluator<'a> {
    pub(super) engine: &'a PromEngine,
    /// Start and end of the whole query, for `@ start()` and `@ end()`.
    query_start: i64,
    query_end: i64,
    pub(super) steps: Vec<i64>,
    samples: Rc<Cell<usize>>,
    /// Warnings of the cluster reads (shards missing), shared with subqueries.
    pub(super) warnings: Rc<RefCell<Vec<String>>>,
    /// Notes on how the answer was made (see [`super::Answer::notes`]).
    notes: Rc<RefCell<Vec<String>>>,
    /// When the query must stop (`--query-timeout`), checked at every node.
    pub(super) deadline: crate::limits::Deadline,
}

/// Gives back the room of a series' points reserved for every step reached
/// where most steps found none (a series with gaps), so that an answer
/// holds about what it uses.
pub(super) fn shrink_if_sparse<T>(points: &mut Vec<T>) {
    if points.len() < points.capacity() / 2 {
        points.shrink_to_fit();
    }
}

/// A series' point at each of `steps` (the index of the first, and their
/// reference times) that finds a sample within `lookback` at or before it,
/// staleness markers ending the series: the sample's value, or with
/// `SAMPLE_TIME` its time in seconds (`timestamp()`). Each step moves on
/// from where the one before left the series' position where `ascending`,
/// and searches anew otherwise. A loop of its own, made twice: a dashboard
/// panel's steps cost 94 instructions each in the selector's closure, the
/// time's division made at every step whichever was wanted (callgrind).
fn step_points<const SAMPLE_TIME: bool>(
    ts: &[i64],
    vs: &[f64],
    (first, steps): (usize, &[i64]),
    ascending: bool,
    lookback: i64,
    points: &mut Vec<(u32, f64)>,
) {
    assert_eq!(
        ts.len(),
        vs.len(),
        "BUG: a series' times and values differ in number"
    );
    let (mut idx, mut moved) = (0, 0);
    for (i, &r) in (first..).zip(steps) {
        idx = if ascending {
            super::value::partition_from(ts, idx, &mut moved, |t| t <= r)
        } else {
            ts.partition_point(|&t| t <= r)
        };
        let Some(at) = idx.checked_sub(1) else {
            continue;
        };
        let (t, v) = (ts[at], vs[at]);
        if t < r - lookback || is_stale_nan(v) {
            continue;
        }
        points.push((i as u32, if SAMPLE_TIME { t as f64 / 1000.0 } else { v }));
    }
}

/// A series' key and one of its values.
pub(super) type KeyedPoint = (storage::KeyArc, f64);

/// A series' key and its newest sample.
type KeyedNewest = (storage::KeyArc, storage::Newest);

/// Which labels a read gives each series.
#[derive(Debug, Clone, Copy)]
pub(super) enum Keep<'a> {
    /// All of them, `__name__` too.
    Named,
    /// All but `__name__` (for a function that drops it).
    Unnamed,
    /// Only those an aggregation's groups are made of: the `by` names, or
    /// all but the `without` names and `__name__`. For an aggregation on
    /// one node straight over a selector, or over a range function of a
    /// one-metric matrix selector, whose series' keys differ (so no
    /// duplicate check needs their whole label sets): the strings of the
    /// other labels are then never copied.
    Group { by: bool, names: &'a [String] },
}

impl Keep<'_> {
    pub(super) fn labels(self, key: &storage::SeriesKey) -> LabelSet {
        let (by, names) = match self {
            Self::Named => return labels_of(key),
            Self::Unnamed => return super::unnamed_labels_of(key),
            Self::Group { by, names } => (by, names),
        };
        let listed = |n: &str| names.iter().any(|x| x == n);
        // A key's labels are sorted by name, each name once.
        let mut out: LabelSet = key
            .labels()
            .iter()
            .filter(|l| listed(&l.name) == by)
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect();
        if by && listed(METRIC_NAME) {
            let at = out.partition_point(|(n, _)| n.as_str() < METRIC_NAME);
            out.insert(at, super::name_label(key.metric()));
        }
        out
    }
}

pub(super) fn unsupported(what: &str) -> PromError {
    PromError::Execution(format!("{what} is not supported by gpulse's PromQL engine"))
}

/// Times and durations are kept within +-2^58 ms (9 million years), so that
/// sums of a few of them cannot overflow.
pub(super) const MAX_ABS_MS: i64 = 1 << 58;

/// A duration in milliseconds, capped at [`MAX_ABS_MS`].
pub(super) fn ms(d: std::time::Duration) -> i64 {
    d.as_millis().min(MAX_ABS_MS as u128) as i64
}

pub(super) fn offset_ms(o: &Option<Offset>) -> i64 {
    match o {
        None => 0,
        Some(Offset::Pos(d)) => ms(*d),
        Some(Offset::Neg(d)) => -ms(*d),
    }
}

impl<'a> Evaluator<'a> {
    pub(super) fn new(
        engine: &'a PromEngine,
        start: i64,
        end: i64,
        step: i64,
        deadline: crate::limits::Deadline,
    ) -> Result<Self> {
        let steps = if step == 0 {
            vec![start]
        } else {
            let n = (end - start) / step + 1;
            (0..n).map(|i| start + i * step).collect()
        };
        Ok(Self {
            engine,
            query_start: start,
            query_end: end,
            steps,
            samples: Rc::new(Cell::new(0)),
            warnings: Rc::default(),
            notes: Rc::default(),
            deadline,
        })
    }

    /// The warnings of the reads so far.
    pub(super) fn warnings(&self) -> Vec<String> {
        self.warnings.borrow().clone()
    }

    /// This node's storage, when rollup tiers may answer (see [`super::tiers`]).
    pub(super) fn tier_storage(&self) -> Option<&std::sync::Arc<storage::Storage>> {
        self.engine.tier_storage()
    }

    /// The notes on the answer so far.
    pub(super) fn notes(&self) -> Vec<String> {
        self.notes.borrow().clone()
    }

    /// Adds a note to the answer (once).
    pub(super) fn note(&self, note: String) {
        crate::cluster::add_warnings(&mut self.notes.borrow_mut(), [note]);
    }

    /// Counts a range function answered from a rollup tier.
    pub(super) fn tier_answered(&self) {
        self.engine
            .metrics
            .rollup_tier_answers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Counts `n` more samples held by the query against the limit.
    pub(super) fn account(&self, n: usize) -> Result<()> {
        self.deadline.check().map_err(PromError::Refused)?;
        let total = self.samples.get().saturating_add(n);
        self.samples.set(total);
        if total > self.engine.limits.max_samples {
            return Err(PromError::Execution(format!(
                "query processing would load too many samples into memory in query execution (limit {})",
                self.engine.limits.max_samples
            )));
        }
        Ok(())
    }

    /// An instant query's result.
    pub(super) fn instant(&self, expr: &Expr) -> Result<PromValue> {
        let t = self.steps[0];
        if expr.value_type() == ValueType::Matrix {
            let input = self.range_input(expr)?;
            let mut out = Vec::new();
            let reference = input.reference(t);
            for s in &input.series {
                let (lo, hi) = input.window(s, reference);
                if hi > lo {
                    out.push(Series {
                        labels: s.labels.clone(),
                        points: (lo..hi).map(|i| (s.ts[i], s.vs[i])).collect(),
                    });
                }
            }
            return Ok(PromValue::Matrix(out));
        }
        Ok(match self.eval(expr)? {
            Val::Scalar(v) => PromValue::Scalar { t_ms: t, v: v[0] },
            Val::Str(s) => PromValue::String { t_ms: t, v: s },
            Val::Vector(mut v) => {
                let v = v.pop().unwrap_or_default();
                check_unique(&v)?;
                PromValue::Vector(
                    v.into_iter()
                        .map(|e| Sample {
                            labels: e.labels,
                            t_ms: t,
                            v: e.v,
                        })
                        .collect(),
                )
            }
        })
    }

    /// A range query's result: a matrix sorted by labels.
    pub(super) fn range(&self, expr: &Expr) -> Result<PromValue> {
        match expr.value_type() {
            ValueType::Scalar | ValueType::Vector => {}
            other => {
                return Err(PromError::BadData(format!(
                    "invalid expression type \"{}\" for range query, must be Scalar or instant Vector",
                    match other {
                        ValueType::Matrix => "range vector",
                        ValueType::String => "string",
                        _ => "unknown",
                    }
                )));
            }
        }
        if let Some(series) = self.pushdown_series(expr)? {
            return Ok(PromValue::Matrix(series));
        }
        let mut bare = expr;
        while let Expr::Paren(p) = bare {
            bare = &p.expr;
        }
        if let Expr::VectorSelector(vs) = bare
            && let Some(matrix) = self.selector_matrix(vs)?
        {
            return Ok(PromValue::Matrix(matrix));
        }
        // A vector against a number, series by series: its series are the
        // matrix's unless two have one label set (then the steps' check
        // refuses them where they meet, as below).
        if let Expr::Binary(b) = bare
            && let Some(operand) = self.scalar_operand(b)?
        {
            let per_step = match operand {
                Operand::Series(series) if distinct_labels(&series) => {
                    return Ok(PromValue::Matrix(self.series_matrix(series)));
                }
                Operand::Series(series) => super::functions::into_steps(self, series)?,
                Operand::Steps(per_step) => per_step,
            };
            return Ok(PromValue::Matrix(self.to_matrix(per_step)?));
        }
        match self.eval(expr)? {
            Val::Scalar(v) => Ok(PromValue::Matrix(vec![Series {
                labels: Arc::new(Vec::new()),
                points: self.steps.iter().copied().zip(v).collect(),
            }])),
            Val::Vector(per_step) => Ok(PromValue::Matrix(self.to_matrix(per_step)?)),
            Val::Str(_) => Err(PromError::BadData(
                "invalid expression type \"string\" for range query, must be Scalar or instant Vector"
                    .into(),
            )),
        }
    }

    /// Collects per-step vectors into series, in label order.
    pub(super) fn to_matrix(&self, per_step: Vec<Vector>) -> Result<Vec<Series>> {
        let mut ids = LabelSetIds::default();
        check_unique_steps(&per_step, &mut ids)?;
        // The series of each label set id.
        let mut series_of: Vec<usize> = Vec::new();
        let mut out: Vec<Series> = Vec::new();
        for (i, v) in per_step.into_iter().enumerate() {
            let t = self.steps[i];
            for e in v {
                let id = ids.id(&e.labels);
                if id >= series_of.len() {
                    series_of.resize(id + 1, usize::MAX);
                }
                if series_of[id] == usize::MAX {
                    series_of[id] = out.len();
                    out.push(Series {
                        labels: e.labels.clone(),
                        points: Vec::new(),
                    });
                }
                let at = series_of[id];
                out[at].points.push((t, e.v));
            }
        }
        out.sort_by(|a, b| a.labels.cmp(&b.labels));
        Ok(out)
    }

    pub(super) fn eval(&self, expr: &Expr) -> Result<Val> {
        self.deadline.check().map_err(PromError::Refused)?;
        match expr {
            Expr::NumberLiteral(n) => Ok(Val::Scalar(vec![n.val; self.steps.len()])),
            Expr::StringLiteral(s) => Ok(Val::Str(s.val.clone())),
            Expr::Paren(p) => self.eval(&p.expr),
            Expr::Unary(u) => match self.eval(&u.expr)? {
                Val::Scalar(v) => Ok(Val::Scalar(v.into_iter().map(|x| -x).collect())),
                Val::Vector(vs) => {
                    let mut names = NameDropper::default();
                    Ok(Val::Vector(
                        vs.into_iter()
                            .map(|v| {
                                v.into_iter()
                                    .map(|e| Elem {
                                        labels: names.drop_name(&e.labels),
                                        v: -e.v,
                                    })
                                    .collect()
                            })
                            .collect(),
                    ))
                }
                Val::Str(_) => Err(PromError::BadData(
                    "unary expression only allowed on expressions of type scalar or vector".into(),
                )),
            },
            Expr::VectorSelector(vs) => Ok(Val::Vector(self.eval_selector(vs, false)?)),
            Expr::MatrixSelector(_) | Expr::Subquery(_) => Err(PromError::BadData(
                "a range vector is only allowed as a function argument here".into(),
            )),
            Expr::Binary(b) => self.eval_binary(b),
            Expr::Aggregate(a) => self.eval_aggregate(a),
            Expr::Call(c) => super::functions::call(self, c),
            Expr::Extension(_) => Err(unsupported("this expression")),
        }
    }

    fn at_ms(&self, at: &Option<AtModifier>) -> Option<i64> {
        match at {
            None => None,
            Some(AtModifier::Start) => Some(self.query_start),
            Some(AtModifier::End) => Some(self.query_end),
            Some(AtModifier::At(t)) => Some(match t.duration_since(std::time::UNIX_EPOCH) {
                Ok(d) => ms(d),
                Err(e) => -ms(e.duration()),
            }),
        }
    }

    pub(super) fn matchers(vs: &VectorSelector) -> Result<Vec<Matcher>> {
        if !vs.matchers.or_matchers.is_empty() {
            return Err(unsupported("`or` between label matchers"));
        }
        let mut out = Vec::with_capacity(vs.matchers.matchers.len() + 1);
        if let Some(name) = &vs.name {
            out.push(Matcher::equal(METRIC_NAME, name.as_str()));
        }
        for m in &vs.matchers.matchers {
            let bad = |e: regex::Error| {
                PromError::BadData(format!("invalid regular expression {:?}: {e}", m.value))
            };
            out.push(match &m.op {
                MatchOp::Equal => Matcher::equal(m.name.as_str(), m.value.as_str()),
                MatchOp::NotEqual => Matcher::not_equal(m.name.as_str(), m.value.as_str()),
                MatchOp::Re(_) => Matcher::regex(m.name.as_str(), &m.value).map_err(bad)?,
                MatchOp::NotRe(_) => Matcher::not_regex(m.name.as_str(), &m.value).map_err(bad)?,
            });
        }
        // `label=~".*"` (Grafana's "All") selects nothing away: left out,
        // it costs no label lookup per series.
        out.retain(|m| !m.matches_everything());
        Ok(out)
    }

    /// Reads every matching series' samples in `[min_ts, max_ts]`.
    fn load(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        keep_stale: bool,
        keep: Keep<'_>,
    ) -> Result<Vec<RawSeries>> {
        let (selected, work) = self.select_counted(matchers, min_ts, max_ts)?;
        let deadline = self.deadline;
        let read = |s: &crate::cluster::ClusterSeries| -> Result<Option<RawSeries>> {
            let cap = s.max_samples();
            let (mut ts, mut vs) = (Vec::with_capacity(cap), Vec::with_capacity(cap));
            read_series(deadline, s, (min_ts, max_ts), keep_stale, &mut ts, &mut vs)?;
            if ts.is_empty() {
                return Ok(None);
            }
            Ok(Some(RawSeries {
                labels: Arc::new(keep.labels(&s.key)),
                ts,
                vs,
            }))
        };
        let read = super::parallel::map(&selected, work, read);
        let mut out = Vec::with_capacity(read.len());
        for s in read {
            out.extend(s?);
        }
        Ok(out)
    }

    /// The series matching `matchers` with samples in `[min_ts, max_ts]`,
    /// each counted against the limit before any is read, and the samples
    /// they may hold in all (the work of reading them).
    fn select_counted(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<(Vec<crate::cluster::ClusterSeries>, usize)> {
        let selection = self.engine.select(matchers, min_ts, max_ts)?;
        crate::cluster::add_warnings(&mut self.warnings.borrow_mut(), selection.warnings);
        let selected = selection.series;
        let mut work = 0usize;
        for s in &selected {
            self.account(s.max_samples())?;
            work = work.saturating_add(s.max_samples());
        }
        Ok((selected, work))
    }

    /// `f` of each of `selected` as read over `window` (staleness markers
    /// dropped unless `keep_stale`, labels as `keep` says), in order,
    /// leaving out those without samples there. Each series is read into
    /// buffers its scan thread reuses and reduced before the next: a query
    /// never holds all the samples, and they are still in cache when `f`
    /// reads them.
    pub(super) fn reduce_series<U, F>(
        &self,
        selected: &[crate::cluster::ClusterSeries],
        window: (i64, i64),
        work: usize,
        keep_stale: bool,
        keep: Keep<'_>,
        f: F,
    ) -> Result<Vec<U>>
    where
        U: Send,
        F: Fn(&RawSeries) -> U + Sync + Send,
    {
        let deadline = self.deadline;
        let read = super::parallel::map_init(
            selected,
            work,
            RawSeries::default,
            |raw: &mut RawSeries, s| -> Result<Option<U>> {
                read_series(deadline, s, window, keep_stale, &mut raw.ts, &mut raw.vs)?;
                if raw.ts.is_empty() {
                    return Ok(None);
                }
                raw.labels = Arc::new(keep.labels(&s.key));
                Ok(Some(f(raw)))
            },
        );
        let mut out = Vec::with_capacity(read.len());
        for s in read {
            out.extend(s?);
        }
        Ok(out)
    }

    /// A matrix selector's series, selected and counted but not read, with
    /// the window they are to be read over and its range and modifiers
    /// (the [`RangeInput`] without series): for a range function that
    /// reduces each series to its points as it is read
    /// ([`Self::reduce_series`]). `None` for a subquery.
    pub(super) fn matrix_selection(&self, expr: &Expr) -> Result<Option<MatrixSelection>> {
        match expr {
            Expr::Paren(p) => self.matrix_selection(&p.expr),
            Expr::MatrixSelector(sel) => {
                let vs = &sel.vs;
                let matchers = Self::matchers(vs)?;
                let (input, window) = self.matrix_window(sel);
                let (series, work) = self.select_counted(&matchers, window.0, window.1)?;
                Ok(Some(MatrixSelection {
                    input,
                    series,
                    window,
                    work,
                }))
            }
            _ => Ok(None),
        }
    }

    /// A matrix selector's range and modifiers (a [`RangeInput`] without
    /// series) and the span its windows cover at the query's steps.
    fn matrix_window(&self, sel: &MatrixSelector) -> (RangeInput, (i64, i64)) {
        let vs = &sel.vs;
        let off = offset_ms(&vs.offset);
        let at = self.at_ms(&vs.at);
        let range_ms = ms(sel.range);
        let refs = self.steps.iter().map(|&t| at.unwrap_or(t) - off);
        let lo = refs.clone().min().unwrap_or(0) - range_ms;
        let hi = refs.max().unwrap_or(0);
        let input = RangeInput {
            series: Vec::new(),
            range_ms,
            offset_ms: off,
            at_ms: at,
        };
        (input, (lo, hi))
    }

    /// Each matching series' key and newest sample in `[min_ts, max_ts]`,
    /// sorted by key and counted against the query's limits; `None` where
    /// the source cannot answer that by itself.
    fn newest_by_key(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Option<Vec<KeyedNewest>>> {
        let Some(mut newest) = self.engine.newest(matchers, min_ts, max_ts) else {
            return Ok(None);
        };
        self.account(newest.len())?;
        newest.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Ok(Some(newest))
    }

    /// Each matching series' newest sample in `[min_ts, max_ts]`, staleness
    /// markers included, as [`Self::load`] would end: series sorted by key,
    /// one sample each. `None` where the source cannot answer that by
    /// itself (a cluster reads samples through `select`).
    fn load_newest(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        keep: Keep<'_>,
    ) -> Result<Option<Vec<RawSeries>>> {
        let Some(newest) = self.newest_by_key(matchers, min_ts, max_ts)? else {
            return Ok(None);
        };
        Ok(Some(
            newest
                .into_iter()
                .map(|(key, n)| RawSeries {
                    labels: Arc::new(keep.labels(&key)),
                    ts: vec![n.ts_ms],
                    vs: vec![n.value],
                })
                .collect(),
        ))
    }

    /// An instant query's vector selector as each series' key and newest
    /// sample value, sorted by key, before any label set is made: what
    /// [`Self::selector_points`] gives at the one step (the newest sample
    /// within the lookback, none for a staleness marker). `None` for a
    /// range query, or where storage cannot give newest samples.
    pub(super) fn newest_points(&self, vs: &VectorSelector) -> Result<Option<Vec<KeyedPoint>>> {
        let &[step] = self.steps.as_slice() else {
            return Ok(None);
        };
        let matchers = Self::matchers(vs)?;
        let r = self.at_ms(&vs.at).unwrap_or(step) - offset_ms(&vs.offset);
        let lookback = self.engine.limits.lookback_ms;
        let Some(newest) = self.newest_by_key(&matchers, r - lookback, r)? else {
            return Ok(None);
        };
        Ok(Some(
            newest
                .into_iter()
                .filter(|(_, n)| n.ts_ms >= r - lookback && n.ts_ms <= r && !is_stale_nan(n.value))
                .map(|(key, n)| (key, n.value))
                .collect(),
        ))
    }

    /// An instant vector selector at every step: the newest sample at or
    /// before the reference time and not older than the lookback, unless it
    /// is a staleness marker. With `sample_time`, the value is the sample's
    /// timestamp in seconds (for `timestamp()`).
    pub(super) fn eval_selector(
        &self,
        vs: &VectorSelector,
        sample_time: bool,
    ) -> Result<Vec<Vector>> {
        let mut out: Vec<Vector> = vec![Vec::new(); self.steps.len()];
        for (labels, points) in self.selector_points(vs, sample_time, Keep::Named)? {
            for (i, v) in points {
                out[i as usize].push(Elem {
                    labels: labels.clone(),
                    v,
                });
            }
        }
        Ok(out)
    }

    /// A vector selector's value, series by series: each matching series'
    /// label set and its (step index, value) points, steps ascending.
    pub(super) fn selector_points(
        &self,
        vs: &VectorSelector,
        sample_time: bool,
        keep: Keep<'_>,
    ) -> Result<Vec<SelectedPoints>> {
        let matchers = Self::matchers(vs)?;
        let off = offset_ms(&vs.offset);
        let at = self.at_ms(&vs.at);
        let refs: Vec<i64> = self.steps.iter().map(|&t| at.unwrap_or(t) - off).collect();
        let lookback = self.engine.limits.lookback_ms;
        let lo = refs.iter().copied().min().unwrap_or(0) - lookback;
        let hi = refs.iter().copied().max().unwrap_or(0);
        // One reference time (an instant query, or `@`): each series' newest
        // sample is all that is read.
        let newest = match refs.first() {
            Some(&r) if refs.iter().all(|&x| x == r) => {
                self.load_newest(&matchers, lo, hi, keep)?
            }
            _ => None,
        };
        // The steps of a range query ascend: each series' position then
        // moves forward over its samples instead of a search per step.
        let ascending = refs.is_sorted();
        let points = |ts: &[i64], vs: &[f64]| {
            series_step_points(ts, vs, &refs, ascending, lookback, sample_time)
        };
        let out = match newest {
            Some(series) => {
                let work =
                    series.iter().map(|s| s.ts.len()).sum::<usize>() + series.len() * refs.len();
                super::parallel::map_owned(series, work, |s| (s.labels, points(&s.ts, &s.vs)))
            }
            None => {
                let (selected, work) = self.select_counted(&matchers, lo, hi)?;
                let work = work.saturating_add(selected.len().saturating_mul(refs.len()));
                self.reduce_series(&selected, (lo, hi), work, true, keep, |s| {
                    (s.labels.clone(), points(&s.ts, &s.vs))
                })?
            }
        };
        self.account(out.iter().map(|(_, p)| p.len()).sum())?;
        Ok(out)
    }

    /// A range query of a bare vector selector, the most common dashboard
    /// panel: its series are the matrix's, sorted by labels, without going
    /// through vectors per step. `None` where two series have one label set
    /// (a cluster's answer can), which [`Self::to_matrix`] merges.
    fn selector_matrix(&self, vs: &VectorSelector) -> Result<Option<Vec<Series>>> {
        self.deadline.check().map_err(PromError::Refused)?;
        let mut series = self.selector_points(vs, false, Keep::Named)?;
        series.retain(|(_, points)| !points.is_empty());
        series.sort_by(|a, b| a.0.cmp(&b.0));
        if series.windows(2).any(|w| w[0].0 == w[1].0) {
            return Ok(None);
        }
        Ok(Some(self.series_matrix(series)))
    }

    /// Series with distinct label sets as a matrix: those with points, in
    /// label order, each point at its step's time.
    fn series_matrix(&self, mut series: Vec<SelectedPoints>) -> Vec<Series> {
        series.retain(|(_, points)| !points.is_empty());
        series.sort_by(|a, b| a.0.cmp(&b.0));
        series
            .into_iter()
            .map(|(labels, points)| Series {
                labels,
                points: points
                    .into_iter()
                    .map(|(i, v)| (self.steps[i as usize], v))
                    .collect(),
            })
            .collect()
    }

    /// An instant-vector operand series by series, where it can be made
    /// that way: a vector selector, a range function over raw samples, or
    /// either against a number literal. `None` for every other expression
    /// (evaluate it with [`Self::eval`]).
    pub(super) fn operand(&self, expr: &Expr) -> Result<Option<Operand>> {
        self.operand_as(expr, Keep::Named)
    }

    /// [`Self::operand`], a vector selector's series with the labels `keep`
    /// says (everything else keeps all of its own).
    pub(super) fn operand_as(&self, expr: &Expr, keep: Keep<'_>) -> Result<Option<Operand>> {
        self.deadline.check().map_err(PromError::Refused)?;
        match expr {
            Expr::Paren(p) => self.operand_as(&p.expr, keep),
            Expr::VectorSelector(vs) => Ok(Some(Operand::Series(
                self.selector_points(vs, false, keep)?,
            ))),
            Expr::Binary(b) => self.scalar_operand(b),
            Expr::Call(c) if super::functions::is_range_function(c.func.name) => {
                Ok(Some(
                    match super::functions::range_series(self, c.func.name, &c.args.args, None)? {
                        RangeValue::Steps(v) => Operand::Steps(v),
                        // A label set met twice (two metrics, once their names
                        // are dropped) is refused where the two meet at a step,
                        // as the vector of that step would be.
                        RangeValue::Series(series) if !distinct_labels(&series) => {
                            Operand::Steps(super::functions::into_steps(self, series)?)
                        }
                        RangeValue::Series(series) => Operand::Series(series),
                    },
                ))
            }
            _ => Ok(None),
        }
    }

    /// A range vector argument: a matrix selector or a subquery.
    pub(super) fn range_input(&self, expr: &Expr) -> Result<RangeInput> {
        self.range_input_as(expr, Keep::Named)
    }

    /// [`Self::range_input`]; a matrix selector's series with the labels
    /// `keep` says (a subquery's keep all of theirs).
    pub(super) fn range_input_as(&self, expr: &Expr, keep: Keep<'_>) -> Result<RangeInput> {
        match expr {
            Expr::Paren(p) => self.range_input_as(&p.expr, keep),
            Expr::MatrixSelector(sel) => {
                let matchers = Self::matchers(&sel.vs)?;
                let (mut input, (lo, hi)) = self.matrix_window(sel);
                input.series = self.load(&matchers, lo, hi, false, keep)?;
                Ok(input)
            }
            Expr::Subquery(sq) => self.subquery(sq),
            _ => Err(PromError::BadData(format!(
                "expected a range vector, got {}",
                expr.value_type()
            ))),
        }
    }

    /// Evaluates a subquery's inner expression at its own steps: multiples of
    /// its step from the first one after `start - offset - range`.
    fn subquery(&self, sq: &SubqueryExpr) -> Result<RangeInput> {
        let off = offset_ms(&sq.offset);
        let at = self.at_ms(&sq.at);
        let range_ms = ms(sq.range);
        let step = sq.step.map(ms).unwrap_or(DEFAULT_SUBQUERY_STEP_MS);
        if step <= 0 {
            return Err(PromError::BadData("subquery step must be positive".into()));
        }
        let (first, last) = match at {
            Some(t) => (t, t),
            None => (self.steps[0], *self.steps.last().unwrap_or(&self.steps[0])),
        };
        let lo = first - off - range_ms;
        let mut start = step * (lo / step);
        if start < lo {
            start += step;
        }
        let end = last - off;
        if end < start {
            return Ok(RangeInput {
                series: Vec::new(),
                range_ms,
                offset_ms: off,
                at_ms: at,
            });
        }
        if (end - start) / step > MAX_SUBQUERY_STEPS {
            return Err(PromError::Execution(format!(
                "subquery would be evaluated at more than {MAX_SUBQUERY_STEPS} steps"
            )));
        }
        let inner = Evaluator {
            engine: self.engine,
            query_start: self.query_start,
            query_end: self.query_end,
            steps: (0..=(end - start) / step)
                .map(|i| start + i * step)
                .collect(),
            samples: self.samples.clone(),
            warnings: self.warnings.clone(),
            notes: self.notes.clone(),
            deadline: self.deadline,
        };
        let per_step = match inner.eval(&sq.expr)? {
            Val::Vector(v) => v,
            _ => {
                return Err(PromError::BadData(
                    "subquery is only allowed on vector".into(),
                ));
            }
        };
        let matrix = inner.to_matrix(per_step)?;
        Ok(RangeInput {
            series: matrix
                .into_iter()
                .map(|s| RawSeries {
                    labels: s.labels,
                    ts: s.points.iter().map(|p| p.0).collect(),
                    vs: s.points.iter().map(|p| p.1).collect(),
                })
                .collect(),
            range_ms,
            offset_ms: off,
            at_ms: at,
        })
    }
}
