//! The evaluator: every node is evaluated for all steps of the query at
//! once (one storage read per selector), as Prometheus's `rangeEval` does.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use promql_parser::label::MatchOp;
use promql_parser::parser::value::ValueType;
use promql_parser::parser::{
    AggregateExpr, AtModifier, BinaryExpr, Expr, LabelModifier, Offset, SubqueryExpr,
    VectorMatchCardinality, VectorSelector,
};
use storage::Matcher;

use super::{LabelSet, PromEngine, PromError, PromValue, Sample, Series, is_stale_nan, labels_of};

type Result<T> = std::result::Result<T, PromError>;

/// Prometheus's default `evaluation_interval`, the step of a subquery
/// written without one (`x[1h:]`).
const DEFAULT_SUBQUERY_STEP_MS: i64 = 60_000;

/// Most steps of one subquery's inner evaluation.
const MAX_SUBQUERY_STEPS: i64 = 1_000_000;

pub(super) const METRIC_NAME: &str = "__name__";

/// One element of an instant vector at one step.
#[derive(Debug, Clone)]
pub(super) struct Elem {
    pub(super) labels: Arc<LabelSet>,
    pub(super) v: f64,
}

pub(super) type Vector = Vec<Elem>;

/// The value of a node for every step of the query.
#[derive(Debug)]
pub(super) enum Val {
    Scalar(Vec<f64>),
    Vector(Vec<Vector>),
    Str(String),
}

/// One series of a range vector: samples in time order, staleness markers
/// removed.
#[derive(Debug)]
pub(super) struct RawSeries {
    pub(super) labels: Arc<LabelSet>,
    pub(super) ts: Vec<i64>,
    pub(super) vs: Vec<f64>,
}

/// A range vector argument (`x[5m]` or a subquery) and how to cut its
/// window at each step: `[reference - range, reference]`, closed.
#[derive(Debug)]
pub(super) struct RangeInput {
    pub(super) series: Vec<RawSeries>,
    pub(super) range_ms: i64,
    pub(super) offset_ms: i64,
    pub(super) at_ms: Option<i64>,
}

impl RangeInput {
    pub(super) fn reference(&self, step_ms: i64) -> i64 {
        self.at_ms.unwrap_or(step_ms) - self.offset_ms
    }

    /// Indices `[lo, hi)` of `s`'s samples in the window ending at `reference`.
    pub(super) fn window(&self, s: &RawSeries, reference: i64) -> (usize, usize) {
        let lo = s.ts.partition_point(|&t| t < reference - self.range_ms);
        let hi = s.ts.partition_point(|&t| t <= reference);
        (lo, hi.max(lo))
    }
}

pub(super) struct Evaluator<'a> {
    engine: &'a PromEngine,
    /// Start and end of the whole query, for `@ start()` and `@ end()`.
    query_start: i64,
    query_end: i64,
    pub(super) steps: Vec<i64>,
    samples: Rc<Cell<usize>>,
    /// Warnings of the cluster reads (shards missing), shared with subqueries.
    warnings: Rc<RefCell<Vec<String>>>,
    /// When the query must stop (`--query-timeout`), checked at every node.
    deadline: crate::limits::Deadline,
}

pub(super) fn unsupported(what: &str) -> PromError {
    PromError::Execution(format!("{what} is not supported by gpulse's PromQL engine"))
}

/// Times and durations are kept within +-2^58 ms (9 million years), so that
/// sums of a few of them cannot overflow.
pub(super) const MAX_ABS_MS: i64 = 1 << 58;

/// A duration in milliseconds, capped at [`MAX_ABS_MS`].
fn ms(d: std::time::Duration) -> i64 {
    d.as_millis().min(MAX_ABS_MS as u128) as i64
}

fn offset_ms(o: &Option<Offset>) -> i64 {
    match o {
        None => 0,
        Some(Offset::Pos(d)) => ms(*d),
        Some(Offset::Neg(d)) => -ms(*d),
    }
}

/// `labels` without `__name__` (shared when there is none).
pub(super) fn drop_name(labels: &Arc<LabelSet>) -> Arc<LabelSet> {
    if labels.iter().any(|(n, _)| n == METRIC_NAME) {
        Arc::new(
            labels
                .iter()
                .filter(|(n, _)| n != METRIC_NAME)
                .cloned()
                .collect(),
        )
    } else {
        labels.clone()
    }
}

pub(super) fn get<'l>(labels: &'l LabelSet, name: &str) -> Option<&'l str> {
    labels
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
}

/// Sets (or, for an empty value, removes) one label, keeping the order.
pub(super) fn set_label(labels: &mut LabelSet, name: &str, value: &str) {
    match labels.binary_search_by(|(n, _)| n.as_str().cmp(name)) {
        Ok(i) if value.is_empty() => {
            labels.remove(i);
        }
        Ok(i) => labels[i].1 = value.to_string(),
        Err(_) if value.is_empty() => {}
        Err(i) => labels.insert(i, (name.to_string(), value.to_string())),
    }
}

/// A hashable identity of a whole label set.
pub(super) fn key_of(labels: &LabelSet) -> String {
    let mut s = String::new();
    for (n, v) in labels {
        s.push_str(n);
        s.push('\u{ff}');
        s.push_str(v);
        s.push('\u{fe}');
    }
    s
}

/// The matching signature of binary operators: the `on` labels, or all but
/// `__name__` and the `ignoring` labels.
fn signature(labels: &LabelSet, on: bool, names: &[String]) -> String {
    let mut s = String::new();
    for (n, v) in labels {
        let listed = names.iter().any(|x| x == n);
        let take = if on {
            listed
        } else {
            !listed && n != METRIC_NAME
        };
        if take {
            s.push_str(n);
            s.push('\u{ff}');
            s.push_str(v);
            s.push('\u{fe}');
        }
    }
    s
}

pub(super) fn check_unique(v: &Vector) -> Result<()> {
    if v.len() < 2 {
        return Ok(());
    }
    let mut seen = std::collections::HashSet::with_capacity(v.len());
    for e in v {
        if !seen.insert(key_of(&e.labels)) {
            return Err(PromError::Execution(
                "vector cannot contain metrics with the same labelset".into(),
            ));
        }
    }
    Ok(())
}

fn is_comparison(op: &str) -> bool {
    matches!(op, "==" | "!=" | ">" | "<" | ">=" | "<=")
}

fn is_set_op(op: &str) -> bool {
    matches!(op, "and" | "or" | "unless")
}

/// Arithmetic drops the metric name (`shouldDropMetricName`).
fn drops_name(op: &str) -> bool {
    matches!(op, "+" | "-" | "*" | "/" | "%" | "^" | "atan2")
}

/// `vectorElemBinop`: the value and, for comparisons, whether it holds.
fn elem_binop(op: &str, l: f64, r: f64) -> Result<(f64, bool)> {
    Ok(match op {
        "+" => (l + r, true),
        "-" => (l - r, true),
        "*" => (l * r, true),
        "/" => (l / r, true),
        "^" => (l.powf(r), true),
        "%" => (l % r, true),
        "atan2" => (l.atan2(r), true),
        "==" => (l, l == r),
        "!=" => (l, l != r),
        ">" => (l, l > r),
        "<" => (l, l < r),
        ">=" => (l, l >= r),
        "<=" => (l, l <= r),
        other => return Err(unsupported(&format!("operator {other:?}"))),
    })
}

/// Go's `math.Max`: NaN wins.
pub(super) fn go_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// Go's `math.Min`: NaN wins.
pub(super) fn go_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

/// Prometheus's `quantile` over a set of values (sorted here).
pub(super) fn quantile(q: f64, values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    if q < 0.0 {
        return f64::NEG_INFINITY;
    }
    if q > 1.0 {
        return f64::INFINITY;
    }
    // Go's sort of vectorByValueHeap: NaN sorts first.
    values.sort_by(|a, b| match (a.is_nan(), b.is_nan()) {
        (true, true) => std::cmp::Ordering::Equal,
        (true, false) => std::cmp::Ordering::Less,
        (false, true) => std::cmp::Ordering::Greater,
        _ => a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal),
    });
    let n = values.len() as f64;
    let rank = q * (n - 1.0);
    let lower = rank.floor().max(0.0);
    let upper = (lower + 1.0).min(n - 1.0);
    let weight = rank - rank.floor();
    values[lower as usize] * (1.0 - weight) + values[upper as usize] * weight
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
            deadline,
        })
    }

    /// The warnings of the reads so far.
    pub(super) fn warnings(&self) -> Vec<String> {
        self.warnings.borrow().clone()
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
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut out: Vec<Series> = Vec::new();
        for (i, v) in per_step.into_iter().enumerate() {
            check_unique(&v)?;
            let t = self.steps[i];
            for e in v {
                let k = key_of(&e.labels);
                let at = *index.entry(k).or_insert_with(|| {
                    out.push(Series {
                        labels: e.labels.clone(),
                        points: Vec::new(),
                    });
                    out.len() - 1
                });
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
                Val::Vector(vs) => Ok(Val::Vector(
                    vs.into_iter()
                        .map(|v| {
                            v.into_iter()
                                .map(|e| Elem {
                                    labels: drop_name(&e.labels),
                                    v: -e.v,
                                })
                                .collect()
                        })
                        .collect(),
                )),
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
        Ok(out)
    }

    /// Reads every matching series' samples in `[min_ts, max_ts]`.
    fn load(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
        keep_stale: bool,
    ) -> Result<Vec<RawSeries>> {
        let selection = self.engine.select(matchers, min_ts, max_ts)?;
        crate::cluster::add_warnings(&mut self.warnings.borrow_mut(), selection.warnings);
        let selected = selection.series;
        let mut out = Vec::with_capacity(selected.len());
        for s in selected {
            self.account(s.max_samples())?;
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            s.read_into(min_ts, max_ts, &mut ts, &mut vs)
                .map_err(|e| PromError::Internal(format!("reading {}: {e}", s.key)))?;
            if !keep_stale && vs.iter().any(|&v| is_stale_nan(v)) {
                (ts, vs) = ts
                    .iter()
                    .zip(&vs)
                    .filter(|(_, v)| !is_stale_nan(**v))
                    .map(|(t, v)| (*t, *v))
                    .unzip();
            }
            if ts.is_empty() {
                continue;
            }
            out.push(RawSeries {
                labels: Arc::new(labels_of(&s.key)),
                ts,
                vs,
            });
        }
        Ok(out)
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
        let matchers = Self::matchers(vs)?;
        let off = offset_ms(&vs.offset);
        let at = self.at_ms(&vs.at);
        let refs: Vec<i64> = self.steps.iter().map(|&t| at.unwrap_or(t) - off).collect();
        let lookback = self.engine.limits.lookback_ms;
        let lo = refs.iter().copied().min().unwrap_or(0) - lookback;
        let hi = refs.iter().copied().max().unwrap_or(0);
        let series = self.load(&matchers, lo, hi, true)?;
        let mut out: Vec<Vector> = vec![Vec::new(); self.steps.len()];
        let mut produced = 0usize;
        for s in &series {
            for (i, &r) in refs.iter().enumerate() {
                let idx = s.ts.partition_point(|&t| t <= r);
                if idx == 0 {
                    continue;
                }
                let (t, v) = (s.ts[idx - 1], s.vs[idx - 1]);
                if t < r - lookback || is_stale_nan(v) {
                    continue;
                }
                produced += 1;
                out[i].push(Elem {
                    labels: s.labels.clone(),
                    v: if sample_time { t as f64 / 1000.0 } else { v },
                });
            }
        }
        self.account(produced)?;
        Ok(out)
    }

    /// A range vector argument: a matrix selector or a subquery.
    pub(super) fn range_input(&self, expr: &Expr) -> Result<RangeInput> {
        match expr {
            Expr::Paren(p) => self.range_input(&p.expr),
            Expr::MatrixSelector(sel) => {
                let vs = &sel.vs;
                let matchers = Self::matchers(vs)?;
                let off = offset_ms(&vs.offset);
                let at = self.at_ms(&vs.at);
                let range_ms = ms(sel.range);
                let refs = self.steps.iter().map(|&t| at.unwrap_or(t) - off);
                let lo = refs.clone().min().unwrap_or(0) - range_ms;
                let hi = refs.max().unwrap_or(0);
                Ok(RangeInput {
                    series: self.load(&matchers, lo, hi, false)?,
                    range_ms,
                    offset_ms: off,
                    at_ms: at,
                })
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

    fn eval_binary(&self, b: &BinaryExpr) -> Result<Val> {
        let op = b.op.to_string();
        let return_bool = b.return_bool();
        if let Some(m) = &b.modifier
            && (m.fill_values.lhs.is_some() || m.fill_values.rhs.is_some())
        {
            return Err(unsupported("fill() in binary operations"));
        }
        let lhs = self.eval(&b.lhs)?;
        let rhs = self.eval(&b.rhs)?;
        match (lhs, rhs) {
            (Val::Scalar(l), Val::Scalar(r)) => {
                let mut out = Vec::with_capacity(l.len());
                for (a, c) in l.into_iter().zip(r) {
                    let (v, keep) = elem_binop(&op, a, c)?;
                    out.push(if is_comparison(&op) {
                        if keep { 1.0 } else { 0.0 }
                    } else {
                        v
                    });
                }
                Ok(Val::Scalar(out))
            }
            (Val::Vector(l), Val::Scalar(r)) => Ok(Val::Vector(
                l.into_iter()
                    .zip(r)
                    .map(|(v, s)| vector_scalar(&op, v, s, false, return_bool))
                    .collect::<Result<_>>()?,
            )),
            (Val::Scalar(l), Val::Vector(r)) => Ok(Val::Vector(
                r.into_iter()
                    .zip(l)
                    .map(|(v, s)| vector_scalar(&op, v, s, true, return_bool))
                    .collect::<Result<_>>()?,
            )),
            (Val::Vector(l), Val::Vector(r)) => {
                let (card, matching) = match &b.modifier {
                    Some(m) => (m.card.clone(), m.matching.clone()),
                    None => (VectorMatchCardinality::OneToOne, None),
                };
                let (on, names) = match &matching {
                    Some(LabelModifier::Include(l)) => (true, l.labels.clone()),
                    Some(LabelModifier::Exclude(l)) => (false, l.labels.clone()),
                    None => (false, Vec::new()),
                };
                let mut out = Vec::with_capacity(l.len());
                for (lv, rv) in l.into_iter().zip(r) {
                    out.push(if is_set_op(&op) {
                        set_op(&op, lv, rv, on, &names)
                    } else {
                        vector_binop(&op, lv, rv, &card, on, &names, return_bool)?
                    });
                }
                Ok(Val::Vector(out))
            }
            _ => Err(PromError::BadData(
                "binary operations are not defined on strings".into(),
            )),
        }
    }

    fn eval_aggregate(&self, a: &AggregateExpr) -> Result<Val> {
        let op = a.op.to_string();
        let input = match self.eval(&a.expr)? {
            Val::Vector(v) => v,
            _ => {
                return Err(PromError::BadData(format!(
                    "expected an instant vector in aggregation {op}"
                )));
            }
        };
        let (by, names) = match &a.modifier {
            None => (true, Vec::new()),
            Some(LabelModifier::Include(l)) => (true, l.labels.clone()),
            Some(LabelModifier::Exclude(l)) => (false, l.labels.clone()),
        };
        let scalar_param = |name: &str| -> Result<Vec<f64>> {
            match a.param.as_deref().map(|p| self.eval(p)).transpose()? {
                Some(Val::Scalar(v)) => Ok(v),
                _ => Err(PromError::BadData(format!(
                    "expected a scalar parameter in aggregation {name}"
                ))),
            }
        };
        match op.as_str() {
            "sum" | "avg" | "min" | "max" | "count" | "group" | "stddev" | "stdvar" => {
                let mut grouping = Grouping::new(by, names);
                Ok(Val::Vector(
                    input
                        .iter()
                        .map(|v| aggregate(&op, v, &mut grouping, None))
                        .collect(),
                ))
            }
            "quantile" => {
                let q = scalar_param("quantile")?;
                let mut grouping = Grouping::new(by, names);
                Ok(Val::Vector(
                    input
                        .iter()
                        .zip(q)
                        .map(|(v, q)| aggregate(&op, v, &mut grouping, Some(q)))
                        .collect(),
                ))
            }
            "topk" | "bottomk" => {
                let k = scalar_param(&op)?;
                Ok(Val::Vector(
                    input
                        .into_iter()
                        .zip(k)
                        .map(|(v, k)| top_k(op == "topk", v, k, by, &names))
                        .collect(),
                ))
            }
            "count_values" => {
                let label = match a.param.as_deref().map(|p| self.eval(p)).transpose()? {
                    Some(Val::Str(s)) => s,
                    _ => {
                        return Err(PromError::BadData(
                            "expected a string parameter in aggregation count_values".into(),
                        ));
                    }
                };
                if !valid_label_name(&label) {
                    return Err(PromError::Execution(format!(
                        "invalid label name {label:?}"
                    )));
                }
                Ok(Val::Vector(
                    input
                        .into_iter()
                        .map(|v| count_values(v, &label, by, &names))
                        .collect(),
                ))
            }
            other => Err(unsupported(&format!("aggregation {other}"))),
        }
    }
}

pub(super) fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn vector_scalar(op: &str, v: Vector, s: f64, swap: bool, return_bool: bool) -> Result<Vector> {
    let mut out = Vec::with_capacity(v.len());
    for e in v {
        let (lv, rv) = if swap { (s, e.v) } else { (e.v, s) };
        let (mut value, mut keep) = elem_binop(op, lv, rv)?;
        if is_comparison(op) && swap {
            value = rv;
        }
        if return_bool {
            value = if keep { 1.0 } else { 0.0 };
            keep = true;
        }
        if keep {
            let labels = if drops_name(op) || return_bool {
                drop_name(&e.labels)
            } else {
                e.labels
            };
            out.push(Elem { labels, v: value });
        }
    }
    Ok(out)
}

fn set_op(op: &str, lhs: Vector, rhs: Vector, on: bool, names: &[String]) -> Vector {
    match op {
        "and" => {
            let r: std::collections::HashSet<String> = rhs
                .iter()
                .map(|e| signature(&e.labels, on, names))
                .collect();
            lhs.into_iter()
                .filter(|e| r.contains(&signature(&e.labels, on, names)))
                .collect()
        }
        "unless" => {
            let r: std::collections::HashSet<String> = rhs
                .iter()
                .map(|e| signature(&e.labels, on, names))
                .collect();
            lhs.into_iter()
                .filter(|e| !r.contains(&signature(&e.labels, on, names)))
                .collect()
        }
        _ => {
            let l: std::collections::HashSet<String> = lhs
                .iter()
                .map(|e| signature(&e.labels, on, names))
                .collect();
            let mut out = lhs;
            out.extend(
                rhs.into_iter()
                    .filter(|e| !l.contains(&signature(&e.labels, on, names))),
            );
            out
        }
    }
}

fn display(labels: &LabelSet) -> String {
    let mut s = String::from("{");
    for (i, (n, v)) in labels.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!("{n}={v:?}"));
    }
    s.push('}');
    s
}

/// `VectorBinop`: one-to-one, many-to-one (`group_left`) or one-to-many
/// (`group_right`) matching, as Prometheus does it.
fn vector_binop(
    op: &str,
    lhs: Vector,
    rhs: Vector,
    card: &VectorMatchCardinality,
    on: bool,
    names: &[String],
    return_bool: bool,
) -> Result<Vector> {
    let (one_to_many, include): (bool, Vec<String>) = match card {
        VectorMatchCardinality::OneToMany(l) => (true, l.labels.clone()),
        VectorMatchCardinality::ManyToOne(l) => (false, l.labels.clone()),
        _ => (false, Vec::new()),
    };
    let one_to_one = matches!(card, VectorMatchCardinality::OneToOne);
    let (lhs, rhs) = if one_to_many { (rhs, lhs) } else { (lhs, rhs) };
    let mut right: HashMap<String, Elem> = HashMap::with_capacity(rhs.len());
    for e in rhs {
        let sig = signature(&e.labels, on, names);
        if let Some(dup) = right.get(&sig) {
            let side = if one_to_many { "left" } else { "right" };
            return Err(PromError::Execution(format!(
                "found duplicate series for the match group on the {side} hand-side of the operation: [{}, {}];many-to-many matching not allowed: matching labels must be unique on one side",
                display(&e.labels),
                display(&dup.labels)
            )));
        }
        right.insert(sig, e);
    }
    let mut matched: HashMap<String, std::collections::HashSet<String>> = HashMap::new();
    let mut out = Vec::new();
    for l in lhs {
        let sig = signature(&l.labels, on, names);
        let Some(r) = right.get(&sig) else { continue };
        let (vl, vr) = if one_to_many { (r.v, l.v) } else { (l.v, r.v) };
        let (mut value, keep) = elem_binop(op, vl, vr)?;
        if return_bool {
            value = if keep { 1.0 } else { 0.0 };
        } else if !keep {
            continue;
        }
        // resultMetric
        let mut m: LabelSet = (*l.labels).clone();
        if drops_name(op) {
            m.retain(|(n, _)| n != METRIC_NAME);
        }
        if one_to_one {
            if on {
                m.retain(|(n, _)| names.iter().any(|x| x == n));
            } else {
                m.retain(|(n, _)| !names.iter().any(|x| x == n));
            }
        }
        for ln in &include {
            let v = get(&r.labels, ln).unwrap_or("").to_string();
            set_label(&mut m, ln, &v);
        }
        if return_bool {
            m.retain(|(n, _)| n != METRIC_NAME);
        }
        let seen = matched.get_mut(&sig);
        if one_to_one {
            if seen.is_some() {
                return Err(PromError::Execution(
                    "multiple matches for labels: many-to-one matching must be explicit (group_left/group_right)".into(),
                ));
            }
            matched.insert(sig, Default::default());
        } else {
            let k = key_of(&m);
            match seen {
                Some(set) => {
                    if !set.insert(k) {
                        return Err(PromError::Execution(
                            "multiple matches for labels: grouping labels must ensure unique matches"
                                .into(),
                        ));
                    }
                }
                None => {
                    matched.insert(sig, [k].into_iter().collect());
                }
            }
        }
        out.push(Elem {
            labels: Arc::new(m),
            v: value,
        });
    }
    Ok(out)
}

/// The output labels of an aggregation group.
fn group_labels(labels: &LabelSet, by: bool, names: &[String]) -> LabelSet {
    labels
        .iter()
        .filter(|(n, _)| {
            let listed = names.iter().any(|x| x == n);
            if by {
                listed
            } else {
                !listed && n != METRIC_NAME
            }
        })
        .cloned()
        .collect()
}

/// The aggregation groups of one aggregation, for all its steps: each input
/// series' group is found once (by the address of its shared label set, kept
/// alive here so that the address cannot be reused), not once per step.
#[derive(Debug)]
struct Grouping {
    by: bool,
    names: Vec<String>,
    of_series: HashMap<usize, (Arc<LabelSet>, usize)>,
    ids: HashMap<String, usize>,
    labels: Vec<Arc<LabelSet>>,
    /// Per group id, its position in the step being aggregated (`usize::MAX`: none).
    slots: Vec<usize>,
}

impl Grouping {
    fn new(by: bool, names: Vec<String>) -> Self {
        Self {
            by,
            names,
            of_series: HashMap::new(),
            ids: HashMap::new(),
            labels: Vec::new(),
            slots: Vec::new(),
        }
    }

    fn id(&mut self, labels: &Arc<LabelSet>) -> usize {
        let addr = Arc::as_ptr(labels) as usize;
        if let Some(&(_, id)) = self.of_series.get(&addr) {
            return id;
        }
        let gl = group_labels(labels, self.by, &self.names);
        let next = self.labels.len();
        let id = *self.ids.entry(key_of(&gl)).or_insert(next);
        if id == next {
            self.labels.push(Arc::new(gl));
            self.slots.push(usize::MAX);
        }
        self.of_series.insert(addr, (labels.clone(), id));
        id
    }
}

#[derive(Debug)]
struct Group {
    id: usize,
    value: f64,
    mean: f64,
    count: f64,
    values: Vec<f64>,
}

fn aggregate(op: &str, v: &Vector, grouping: &mut Grouping, q: Option<f64>) -> Vector {
    let mut groups: Vec<Group> = Vec::new();
    for e in v {
        let id = grouping.id(&e.labels);
        let s = e.v;
        match grouping.slots[id] {
            usize::MAX => {
                grouping.slots[id] = groups.len();
                groups.push(Group {
                    id,
                    value: if matches!(op, "stddev" | "stdvar") {
                        0.0
                    } else {
                        s
                    },
                    mean: s,
                    count: 1.0,
                    values: if op == "quantile" {
                        vec![s]
                    } else {
                        Vec::new()
                    },
                });
            }
            i => {
                let g = &mut groups[i];
                match op {
                    "sum" => g.value += s,
                    "avg" => {
                        g.count += 1.0;
                        if g.mean.is_infinite() {
                            if s.is_infinite() && (g.mean > 0.0) == (s > 0.0) {
                                continue;
                            }
                            if !s.is_infinite() && !s.is_nan() {
                                continue;
                            }
                        }
                        g.mean += s / g.count - g.mean / g.count;
                    }
                    "max" if g.value < s || g.value.is_nan() => g.value = s,
                    "min" if g.value > s || g.value.is_nan() => g.value = s,
                    "count" | "group" => g.count += 1.0,
                    "stddev" | "stdvar" => {
                        g.count += 1.0;
                        let delta = s - g.mean;
                        g.mean += delta / g.count;
                        g.value += delta * (s - g.mean);
                    }
                    "quantile" => g.values.push(s),
                    _ => {}
                }
            }
        }
    }
    for g in &groups {
        grouping.slots[g.id] = usize::MAX;
    }
    groups
        .into_iter()
        .map(|mut g| {
            let v = match op {
                "avg" => g.mean,
                "count" => g.count,
                "group" => 1.0,
                "stdvar" => g.value / g.count,
                "stddev" => (g.value / g.count).sqrt(),
                "quantile" => quantile(q.unwrap_or(f64::NAN), &mut g.values),
                _ => g.value,
            };
            Elem {
                labels: grouping.labels[g.id].clone(),
                v,
            }
        })
        .collect()
}

fn top_k(top: bool, v: Vector, k: f64, by: bool, names: &[String]) -> Vector {
    let k = if k.is_nan() { 0 } else { k as i64 };
    if k < 1 {
        return Vec::new();
    }
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut groups: Vec<Vec<Elem>> = Vec::new();
    for e in v {
        let k = key_of(&group_labels(&e.labels, by, names));
        let i = *index.entry(k).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[i].push(e);
    }
    let mut out = Vec::new();
    for mut g in groups {
        // topk: NaN is the smallest value; bottomk: NaN is the largest.
        g.sort_by(|a, b| match (a.v.is_nan(), b.v.is_nan()) {
            (true, true) => std::cmp::Ordering::Equal,
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => {
                let o = a.v.partial_cmp(&b.v).unwrap_or(std::cmp::Ordering::Equal);
                if top { o.reverse() } else { o }
            }
        });
        g.truncate(k.min(g.len() as i64) as usize);
        out.extend(g);
    }
    out
}

fn count_values(v: Vector, label: &str, by: bool, names: &[String]) -> Vector {
    let mut names = names.to_vec();
    if by {
        names.push(label.to_string());
    }
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut groups: Vec<(LabelSet, f64)> = Vec::new();
    for e in v {
        let mut l = (*e.labels).clone();
        set_label(&mut l, label, &format_value(e.v));
        let gl = group_labels(&l, by, &names);
        let k = key_of(&gl);
        match index.get(&k) {
            Some(&i) => groups[i].1 += 1.0,
            None => {
                index.insert(k, groups.len());
                groups.push((gl, 1.0));
            }
        }
    }
    groups
        .into_iter()
        .map(|(l, c)| Elem {
            labels: Arc::new(l),
            v: c,
        })
        .collect()
}

/// Go's `strconv.FormatFloat(v, 'f', -1, 64)`, with Prometheus's spelling
/// of the non-finite values.
pub(super) fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v == f64::INFINITY {
        "+Inf".into()
    } else if v == f64::NEG_INFINITY {
        "-Inf".into()
    } else {
        format!("{v}")
    }
}
