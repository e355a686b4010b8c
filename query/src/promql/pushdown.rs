//! Aggregations evaluated where the data is (issue #19): in a cluster, an
//! aggregation whose result merges from partial results is evaluated by
//! every node over the shards it is asked to read, and only those partial
//! results travel, not the raw samples.
//!
//! # What is pushed down
//!
//! `sum`, `count`, `min`, `max`, `avg`, `group`, and `topk`/`bottomk` with a
//! number literal for `k`, with or without `by`/`without`, over an expression
//! that maps each series on its own: one
//! selector (instant, or a range inside a range function), optionally under
//! functions of one series (`rate`, `*_over_time`, `abs`, `clamp`, ...),
//! unary minus, and arithmetic or comparison with number literals. No `@`
//! modifier and no subquery. `avg` travels as `sum` and `count` and is
//! divided here; `topk` is each node's `topk`, of which the same `topk` is
//! taken here.
//!
//! A range query whose whole expression is such a series-wise expression
//! (a dashboard's `DCGM_FI_DEV_GPU_TEMP{gpu=~".*"}`, `x * 1000000`,
//! `rate(x[5m])`) is pushed down too, at steps of 10 s or more: each owner
//! evaluates it over its shards and sends each series' point at each step
//! (one per step, where the raw read sent every sample of the range and
//! its lookback), and the series are only put in label order here. Every
//! other expression reads raw samples, as before.
//!
//! The series of one shard (a rack, or a host without one) are all on each
//! of the shard's owners, and the read plan asks exactly one owner per
//! shard, so each series counts once. That holds only within one epoch of
//! the shard map: when the samples the aggregation reads span an epoch
//! change, a series may be split between two owners, and the query reads
//! raw samples instead. Series that differ only in their metric name share
//! a shard, so a function that drops the name finds the same duplicate
//! label sets it would on one node.
//!
//! # Exactness
//!
//! `count`, `min`, `max` and `group` are exact, and so is `topk`: ties
//! between equal values go to the series first in series-key order, here as
//! on one node, whose input is in that order. `sum` adds the nodes'
//! partial sums, so its floating-point rounding can differ in the last bits
//! from one node adding every series in turn; `avg` is that sum over the
//! count, where Prometheus keeps a running mean (again the last bits).

use std::collections::HashMap;
use std::sync::Arc;

use promql_parser::parser::value::ValueType;
use promql_parser::parser::{AggregateExpr, Expr, VectorSelector};

use super::eval::{Evaluator, offset_ms};
use super::value::{Elem, Val, Vector};
use super::{LabelSet, PromEngine, PromError, Series};
use crate::cluster::Source;
use crate::cluster::wire::{PartialRow, PromqlRequest};

type Result<T> = std::result::Result<T, PromError>;

/// Functions of one series whose value at a step depends on that series
/// alone (and on number literals among their arguments).
const SERIES_FUNCTIONS: &[&str] = &[
    "abs",
    "ceil",
    "floor",
    "exp",
    "sqrt",
    "ln",
    "log2",
    "log10",
    "sgn",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "cos",
    "cosh",
    "sin",
    "sinh",
    "tan",
    "tanh",
    "deg",
    "rad",
    "round",
    "clamp",
    "clamp_min",
    "clamp_max",
    "timestamp",
    "rate",
    "increase",
    "delta",
    "irate",
    "idelta",
    "deriv",
    "changes",
    "resets",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "sum_over_time",
    "count_over_time",
    "last_over_time",
    "stddev_over_time",
    "stdvar_over_time",
    "present_over_time",
    "predict_linear",
    "quantile_over_time",
];

/// The one selector of `e` and the longest range before an evaluation time
/// it reads (a range selector's range, else the lookback), if `e` maps each
/// series on its own (see the module docs).
fn series_wise(e: &Expr, lookback_ms: i64) -> Option<(&VectorSelector, i64)> {
    match e {
        Expr::Paren(p) => series_wise(&p.expr, lookback_ms),
        Expr::Unary(u) => series_wise(&u.expr, lookback_ms),
        Expr::VectorSelector(vs) if vs.at.is_none() => Some((vs, lookback_ms)),
        Expr::MatrixSelector(ms) if ms.vs.at.is_none() => Some((&ms.vs, super::eval::ms(ms.range))),
        Expr::Binary(b) => match (is_number(&b.lhs), is_number(&b.rhs)) {
            (true, false) => series_wise(&b.rhs, lookback_ms),
            (false, true) => series_wise(&b.lhs, lookback_ms),
            _ => None,
        },
        Expr::Call(c) if SERIES_FUNCTIONS.contains(&c.func.name) => {
            let mut data = None;
            for a in &c.args.args {
                if is_number(a) {
                    continue;
                }
                if data.is_some() {
                    return None;
                }
                data = Some(series_wise(a, lookback_ms)?);
            }
            data
        }
        _ => None,
    }
}

/// Below this step a range query's series-wise expression reads raw
/// samples: its points would come close to the samples they are computed
/// from (DCGM fields are polled every 10 s by default), and the raw read
/// sends each sample once where the points would be sent at every step.
const MIN_SERIES_STEP_MS: i64 = 10_000;

/// Whether a node evaluates `e` for a series-wise pushdown: an instant
/// vector that maps each series on its own.
fn series_expr(e: &Expr, lookback_ms: i64) -> bool {
    e.value_type() == ValueType::Vector && series_wise(e, lookback_ms).is_some()
}

/// Whether `a` and `b` are the same expression, the order of a selector's
/// label matchers aside: an expression's text lists them sorted by name
/// (`x{instance=~".*", gpu=~".*"}` prints as `x{gpu=~".*",instance=~".*"}`).
fn same_expr(a: &Expr, b: &Expr) -> bool {
    let (mut a, mut b) = (a.clone(), b.clone());
    sort_matchers(&mut a);
    sort_matchers(&mut b);
    a == b
}

fn sort_matchers(e: &mut Expr) {
    let sort = |vs: &mut VectorSelector| {
        vs.matchers.matchers.sort_by(|x, y| {
            (&x.name, &x.value, x.op.to_string()).cmp(&(&y.name, &y.value, y.op.to_string()))
        });
    };
    match e {
        Expr::VectorSelector(vs) => sort(vs),
        Expr::MatrixSelector(ms) => sort(&mut ms.vs),
        Expr::Paren(p) => sort_matchers(&mut p.expr),
        Expr::Unary(u) => sort_matchers(&mut u.expr),
        Expr::Subquery(q) => sort_matchers(&mut q.expr),
        Expr::Binary(b) => {
            sort_matchers(&mut b.lhs);
            sort_matchers(&mut b.rhs);
        }
        Expr::Aggregate(a) => {
            sort_matchers(&mut a.expr);
            if let Some(p) = &mut a.param {
                sort_matchers(p);
            }
        }
        Expr::Call(c) => c.args.args.iter_mut().for_each(|a| sort_matchers(a)),
        Expr::NumberLiteral(_) | Expr::StringLiteral(_) | Expr::Extension(_) => {}
    }
}

fn is_number(e: &Expr) -> bool {
    number(e).is_some()
}

/// The value of a number literal, in parentheses or negated.
fn number(e: &Expr) -> Option<f64> {
    match e {
        Expr::NumberLiteral(n) => Some(n.val),
        Expr::Paren(p) => number(&p.expr),
        Expr::Unary(u) => number(&u.expr).map(|v| -v),
        _ => None,
    }
}

/// How the partial results of an operator merge.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Merge {
    Sum,
    Count,
    Min,
    Max,
    Avg,
    Group,
    /// `topk` (`top`) or `bottomk` of `k`.
    Top {
        top: bool,
        k: f64,
    },
    /// No aggregation: each row is one series of the answer.
    Series,
}

/// A pushdown of one aggregation: the queries the nodes evaluate and the
/// time range of the samples they read.
#[derive(Debug)]
pub(crate) struct Plan {
    merge: Merge,
    /// `by` (true) or `without`, and the labels.
    grouping: (bool, Vec<String>),
    pub(crate) request: PromqlRequest,
    pub(crate) matchers: Vec<storage::Matcher>,
    pub(crate) data_min: i64,
    pub(crate) data_max: i64,
}

/// The pushdown of `a` at `steps`, if it can be pushed down (see the
/// module docs).
fn plan(a: &AggregateExpr, steps: &[i64], lookback_ms: i64) -> Result<Option<Plan>> {
    let k = a.param.as_deref().and_then(number);
    let merge = match (a.op.to_string().as_str(), k) {
        ("sum", _) => Merge::Sum,
        ("count", _) => Merge::Count,
        ("min", _) => Merge::Min,
        ("max", _) => Merge::Max,
        ("avg", _) => Merge::Avg,
        ("group", _) => Merge::Group,
        ("topk", Some(k)) => Merge::Top { top: true, k },
        ("bottomk", Some(k)) => Merge::Top { top: false, k },
        _ => return Ok(None),
    };
    if a.param.is_some() && !matches!(merge, Merge::Top { .. }) {
        return Ok(None);
    }
    let Some(selector) = series_wise(&a.expr, lookback_ms) else {
        return Ok(None);
    };
    if steps.is_empty() {
        return Ok(None);
    }
    // The text of the aggregation starts with its operator; `avg` travels
    // as `sum` and `count` of the same expression.
    let text = Expr::Aggregate(a.clone()).to_string();
    let op = a.op.to_string();
    let Some(rest) = text.strip_prefix(op.as_str()) else {
        return Ok(None);
    };
    let queries: Vec<String> = match merge {
        Merge::Avg => vec![format!("sum{rest}"), format!("count{rest}")],
        _ => vec![text.clone()],
    };
    // The peers parse the text: it must say what `a` says.
    for q in &queries {
        match super::parse_shared(q).as_deref() {
            Ok(Expr::Aggregate(back))
                if same_expr(&back.expr, &a.expr)
                    && back.modifier == a.modifier
                    && back.param == a.param => {}
            _ => return Ok(None),
        }
    }
    let grouping = match &a.modifier {
        None => (true, Vec::new()),
        Some(promql_parser::parser::LabelModifier::Include(l)) => (true, l.labels.clone()),
        Some(promql_parser::parser::LabelModifier::Exclude(l)) => (false, l.labels.clone()),
    };
    plan_of(merge, grouping, queries, selector, steps, lookback_ms).map(Some)
}

/// The pushdown of the series-wise expression `e` at `steps`, if it can be
/// pushed down (see the module docs).
fn plan_series(e: &Expr, steps: &[i64], lookback_ms: i64) -> Result<Option<Plan>> {
    if e.value_type() != ValueType::Vector {
        return Ok(None);
    }
    let Some(selector) = series_wise(e, lookback_ms) else {
        return Ok(None);
    };
    if steps.is_empty() {
        return Ok(None);
    }
    // The peers parse the text: it must say what `e` says.
    let text = e.to_string();
    if !super::parse_shared(&text).is_ok_and(|back| same_expr(&back, e)) {
        return Ok(None);
    }
    plan_of(
        Merge::Series,
        (true, Vec::new()),
        vec![text],
        selector,
        steps,
        lookback_ms,
    )
    .map(Some)
}

/// A plan that sends `queries` (over the selector `vs`, which reads
/// `range_ms` before each step) to the owners, to be evaluated at `steps`
/// (not empty).
fn plan_of(
    merge: Merge,
    grouping: (bool, Vec<String>),
    queries: Vec<String>,
    (vs, range_ms): (&VectorSelector, i64),
    steps: &[i64],
    lookback_ms: i64,
) -> Result<Plan> {
    let (first, last) = (steps[0], steps[steps.len() - 1]);
    let off = offset_ms(&vs.offset);
    let step = if steps.len() > 1 {
        steps[1] - steps[0]
    } else {
        0
    };
    Ok(Plan {
        merge,
        grouping,
        request: PromqlRequest {
            queries,
            start: first,
            end: last,
            step,
            lookback_ms,
        },
        matchers: Evaluator::matchers(vs)?,
        data_min: first.saturating_sub(off).saturating_sub(range_ms),
        data_max: last.saturating_sub(off),
    })
}

impl Evaluator<'_> {
    /// `a` evaluated by pushdown, if this engine reads a cluster and `a`
    /// can be pushed down there; `None` to evaluate it here from raw
    /// samples.
    pub(super) fn pushdown(&self, a: &AggregateExpr) -> Result<Option<Val>> {
        let Source::Cluster(reader) = &self.engine.source else {
            return Ok(None);
        };
        let Some(plan) = plan(a, &self.steps, self.engine.limits.lookback_ms)? else {
            return Ok(None);
        };
        let Some((rows, warnings)) = reader.promql_partials_blocking(&plan, self.deadline)? else {
            return Ok(None);
        };
        crate::cluster::add_warnings(&mut self.warnings.borrow_mut(), warnings);
        let points: usize = rows.iter().map(|r| r.ts.len()).sum();
        self.account(points)?;
        Ok(Some(Val::Vector(match plan.merge {
            Merge::Top { top, k } => merge_top(top, k, &plan.grouping, &self.steps, rows)?,
            how => merge(how, &self.steps, rows)?,
        })))
    }

    /// A range query's series-wise expression `e` evaluated by pushdown, if
    /// this engine reads a cluster, `e` can be pushed down there and the
    /// step is long enough: the answer's series in label order. `None` to
    /// evaluate it here from raw samples.
    pub(super) fn pushdown_series(&self, e: &Expr) -> Result<Option<Vec<Series>>> {
        let Source::Cluster(reader) = &self.engine.source else {
            return Ok(None);
        };
        if self.steps.len() > 1 && self.steps[1] - self.steps[0] < MIN_SERIES_STEP_MS {
            return Ok(None);
        }
        let Some(plan) = plan_series(e, &self.steps, self.engine.limits.lookback_ms)? else {
            return Ok(None);
        };
        let Some((rows, warnings)) = reader.promql_partials_blocking(&plan, self.deadline)? else {
            return Ok(None);
        };
        if !warnings.is_empty() {
            // A shard no owner evaluated: down, or a node of an earlier
            // version, which evaluates aggregations only. The raw read
            // gets what the owners still serve, and says what is missing.
            return Ok(None);
        }
        let points: usize = rows.iter().map(|r| r.ts.len()).sum();
        self.account(points)?;
        // `None`: two nodes answered one label set, and only a raw read
        // tells whether they meet at a step (an error) or not.
        series_of(&self.steps, rows)
    }
}

/// The nodes' rows of a series-wise pushdown as the answer's series, in
/// label order; `None` if two rows have one label set.
///
/// # Errors
/// A point at a time that is none of `steps`.
fn series_of(steps: &[i64], rows: Vec<PartialRow>) -> Result<Option<Vec<Series>>> {
    let (first, last) = (steps[0], steps[steps.len() - 1]);
    let step = if steps.len() > 1 { steps[1] - first } else { 1 };
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        if let Some(t) = row
            .ts
            .iter()
            .find(|&&t| t < first || t > last || (t - first) % step != 0)
        {
            return Err(PromError::Internal(format!(
                "a node's series has a point at {t}, which is no step of the query"
            )));
        }
        out.push(Series {
            labels: Arc::new(row.labels),
            points: row.ts.into_iter().zip(row.values).collect(),
        });
    }
    out.sort_by(|a, b| a.labels.cmp(&b.labels));
    if out.windows(2).any(|w| w[0].labels == w[1].labels) {
        return Ok(None);
    }
    Ok(Some(out))
}

/// One group's merged partial results at one step.
#[derive(Debug, Clone, Copy)]
struct Acc {
    /// The merged value of the first query (of `sum` for `avg`).
    v: f64,
    /// `count` for `avg`; NaN until a count arrives.
    count: f64,
    seen: bool,
}

/// Prometheus's `min`/`max`: a NaN gives way to any number.
fn min_max(min: bool, a: f64, b: f64) -> f64 {
    if a.is_nan() || (min && b < a) || (!min && b > a) {
        b
    } else {
        a
    }
}

/// The position of a label set in series-key order (metric name, then the
/// other labels), the order of a selector's series on one node.
fn key_order(labels: &LabelSet) -> (&str, impl Iterator<Item = &(storage::Sym, storage::Sym)>) {
    let name = labels
        .iter()
        .find(|(n, _)| n == super::value::METRIC_NAME)
        .map_or("", |(_, v)| v.as_str());
    (
        name,
        labels
            .iter()
            .filter(|(n, _)| n != super::value::METRIC_NAME),
    )
}

/// Merges the nodes' `topk`/`bottomk` results: at each of `steps`, the same
/// operator over every node's elements, taken in series-key order.
fn merge_top(
    top: bool,
    k: f64,
    (by, names): &(bool, Vec<String>),
    steps: &[i64],
    rows: Vec<PartialRow>,
) -> Result<Vec<Vector>> {
    let index: HashMap<i64, usize> = steps.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let mut per_step: Vec<Vector> = vec![Vec::new(); steps.len()];
    for row in rows {
        let labels = Arc::new(row.labels);
        for (t, v) in row.ts.into_iter().zip(row.values) {
            let Some(&i) = index.get(&t) else {
                return Err(PromError::Internal(format!(
                    "a node's partial result has a point at {t}, which is no step of the query"
                )));
            };
            per_step[i].push(Elem {
                labels: labels.clone(),
                v,
            });
        }
    }
    Ok(per_step
        .into_iter()
        .map(|mut v| {
            v.sort_by(|a, b| {
                let (an, al) = key_order(&a.labels);
                let (bn, bl) = key_order(&b.labels);
                an.cmp(bn).then_with(|| al.cmp(bl))
            });
            super::aggregate::top_k(top, v, k, *by, names)
        })
        .collect())
}

/// Merges the nodes' partial results into the aggregation's value at each
/// of `steps`, groups in label order at each step.
fn merge(how: Merge, steps: &[i64], rows: Vec<PartialRow>) -> Result<Vec<Vector>> {
    let index: HashMap<i64, usize> = steps.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let mut groups: HashMap<LabelSet, Vec<Option<Acc>>> = HashMap::new();
    for row in rows {
        let accs = groups
            .entry(row.labels)
            .or_insert_with(|| vec![None; steps.len()]);
        for (t, v) in row.ts.into_iter().zip(row.values) {
            let Some(&i) = index.get(&t) else {
                return Err(PromError::Internal(format!(
                    "a node's partial result has a point at {t}, which is no step of the query"
                )));
            };
            let acc = accs[i].get_or_insert(Acc {
                v: f64::NAN,
                count: f64::NAN,
                seen: false,
            });
            if how == Merge::Avg && row.query == 1 {
                acc.count = if acc.count.is_nan() { v } else { acc.count + v };
                continue;
            }
            acc.v = if how == Merge::Group {
                1.0
            } else if !acc.seen {
                v
            } else {
                match how {
                    Merge::Sum | Merge::Count | Merge::Avg => acc.v + v,
                    Merge::Min => min_max(true, acc.v, v),
                    Merge::Max => min_max(false, acc.v, v),
                    Merge::Group => 1.0,
                    Merge::Top { .. } | Merge::Series => {
                        unreachable!("BUG: topk merges in merge_top, series in series_of")
                    }
                }
            };
            acc.seen = true;
        }
    }
    let mut sorted: Vec<(LabelSet, Vec<Option<Acc>>)> = groups.into_iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: Vec<Vector> = vec![Vec::new(); steps.len()];
    for (labels, accs) in sorted {
        let labels = Arc::new(labels);
        for (i, acc) in accs.into_iter().enumerate() {
            let Some(acc) = acc.filter(|a| a.seen) else {
                continue;
            };
            let v = match how {
                Merge::Avg => acc.v / acc.count,
                _ => acc.v,
            };
            out[i].push(Elem {
                labels: labels.clone(),
                v,
            });
        }
    }
    Ok(out)
}

/// Evaluates the queries of `req` over the series of `storage` that `filter`
/// admits: a node's part of a pushdown (for a peer's ticket, or for the
/// asking node's own shards). One row per result series and query.
///
/// # Errors
/// As the evaluation of the queries.
pub(crate) fn partials(
    storage: &Arc<storage::Storage>,
    filter: crate::cluster::ShardFilter,
    req: &PromqlRequest,
    deadline: crate::limits::Deadline,
) -> Result<Vec<PartialRow>> {
    let limits = super::PromLimits {
        lookback_ms: req.lookback_ms,
        ..super::PromLimits::default()
    };
    let mut engine = PromEngine::with_limits(storage.clone(), limits);
    engine.source = Source::Shards(storage.clone(), filter);
    let mut exprs = Vec::with_capacity(req.queries.len());
    for text in &req.queries {
        let expr = super::parse_shared(text)?;
        if !matches!(*expr, Expr::Aggregate(_)) && !series_expr(&expr, req.lookback_ms) {
            return Err(PromError::BadData(format!(
                "a pushed-down query must be an aggregation or an expression of one \
                 series at a time, not {text:?}"
            )));
        }
        exprs.push(expr);
    }
    let mut out = Vec::new();
    let mut push = |ev: &Evaluator<'_>, query: usize, per_step: Vec<Vector>| -> Result<()> {
        for s in ev.to_matrix(per_step)? {
            let (ts, values) = s.points.into_iter().unzip();
            out.push(PartialRow {
                query,
                labels: Arc::unwrap_or_clone(s.labels),
                ts,
                values,
            });
        }
        Ok(())
    };
    // A pushed-down `avg` is a `sum` and a `count` of one expression: its
    // series are read and evaluated once for both.
    let aggs: Option<Vec<&AggregateExpr>> = exprs
        .iter()
        .map(|e| match &**e {
            Expr::Aggregate(a) => Some(a),
            _ => None,
        })
        .collect();
    if let Some(aggs) = aggs.filter(|a| a.len() > 1) {
        let ev = Evaluator::new(&engine, req.start, req.end, req.step, deadline)?;
        if let Some(results) = ev.eval_folds(&aggs)? {
            for (query, per_step) in results.into_iter().enumerate() {
                push(&ev, query, per_step)?;
            }
            return Ok(out);
        }
    }
    for (query, (text, expr)) in req.queries.iter().zip(&exprs).enumerate() {
        let ev = Evaluator::new(&engine, req.start, req.end, req.step, deadline)?;
        let Val::Vector(per_step) = ev.eval(expr)? else {
            return Err(PromError::BadData(format!(
                "{text:?} is not an instant vector"
            )));
        };
        push(&ev, query, per_step)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(q: &str) -> Option<Plan> {
        let Expr::Aggregate(a) = promql_parser::parser::parse(q).unwrap() else {
            panic!("{q} is no aggregation")
        };
        plan(&a, &[1_000_000, 1_060_000], 300_000).unwrap()
    }

    #[test]
    fn which_aggregations_are_pushed_down() {
        for q in [
            "sum(DCGM_FI_DEV_POWER_USAGE)",
            "sum by (rack) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m]))",
            "avg without (gpu) (DCGM_FI_DEV_GPU_TEMP{rack=~\"r1.*\"} offset 1h)",
            "max by (Hostname) (clamp_max(DCGM_FI_DEV_GPU_UTIL / 100, 1))",
            "count(DCGM_FI_DEV_GPU_TEMP > 80)",
            "min(quantile_over_time(0.9, DCGM_FI_DEV_GPU_TEMP[10m]))",
            "group by (rack) (-DCGM_FI_DEV_GPU_TEMP)",
            "topk(3, DCGM_FI_DEV_GPU_TEMP)",
            "bottomk by (rack) (2, rate(x[5m]))",
            // Matchers out of name order (the text sorts them).
            "avg(DCGM_FI_DEV_GPU_TEMP{instance=~\"h.*\", gpu=~\"1\"})",
        ] {
            assert!(planned(q).is_some(), "{q} is pushed down");
        }
        for q in [
            "topk(scalar(k), DCGM_FI_DEV_GPU_TEMP)",
            "quantile(0.9, DCGM_FI_DEV_GPU_TEMP)",
            "stddev(DCGM_FI_DEV_GPU_TEMP)",
            "sum(DCGM_FI_DEV_GPU_TEMP @ 100)",
            "sum(a + b)",
            "sum(sum by (rack) (a))",
            "sum(rate(a[5m:1m]))",
            "sum(label_replace(a, \"x\", \"$1\", \"y\", \"(.*)\"))",
            "sum(absent(a))",
            "count(vector(1))",
        ] {
            assert!(planned(q).is_none(), "{q} is not pushed down");
        }
    }

    #[test]
    fn which_series_expressions_are_pushed_down() {
        let planned = |q: &str| {
            let e = promql_parser::parser::parse(q).unwrap();
            plan_series(&e, &[1_000_000, 1_060_000], 300_000).unwrap()
        };
        for q in [
            "DCGM_FI_DEV_GPU_TEMP{instance=~\".*\", gpu=~\".*\"}",
            "DCGM_FI_DEV_SM_CLOCK{instance=~\"h.*\", gpu=\"1\"} * 1000000",
            "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m] offset 1h)",
            "clamp_max(DCGM_FI_DEV_GPU_UTIL / 100, 1)",
            "(-x > 3)",
        ] {
            let p = planned(q).unwrap_or_else(|| panic!("{q} is pushed down"));
            assert_eq!(p.merge, Merge::Series, "{q}");
            assert_eq!(p.request.queries.len(), 1, "{q}");
        }
        for q in [
            "x[5m]",
            "sum(x)",
            "a + b",
            "x @ 100",
            "rate(x[5m:1m])",
            "label_replace(x, \"y\", \"$1\", \"z\", \"(.*)\")",
            "absent(x)",
            "vector(1)",
            "scalar(x)",
            "3",
        ] {
            assert!(planned(q).is_none(), "{q} is not pushed down");
        }
        let p = planned("rate(x[10m] offset 1h)").unwrap();
        assert_eq!(p.request.queries, ["rate(x[10m] offset 1h)"]);
        assert_eq!(
            (p.data_min, p.data_max),
            (1_000_000 - 3_600_000 - 600_000, 1_060_000 - 3_600_000)
        );
    }

    #[test]
    fn series_rows_come_out_in_label_order_and_checked() {
        let row = |g: &str, ts: &[i64]| PartialRow {
            query: 0,
            labels: vec![("gpu".into(), g.into())],
            ts: ts.to_vec(),
            values: ts.iter().map(|&t| t as f64 / 10.0).collect(),
        };
        let steps = [10, 20, 30];
        let got = series_of(&steps, vec![row("2", &[20, 30]), row("0", &[10])])
            .unwrap()
            .unwrap();
        let got: Vec<(String, Vec<(i64, f64)>)> = got
            .iter()
            .map(|s| (s.labels[0].1.to_string(), s.points.clone()))
            .collect();
        assert_eq!(
            got,
            [
                ("0".to_owned(), vec![(10, 1.0)]),
                ("2".to_owned(), vec![(20, 2.0), (30, 3.0)])
            ]
        );
        // One label set from two nodes: read raw instead.
        assert!(
            series_of(&steps, vec![row("1", &[10]), row("1", &[20])])
                .unwrap()
                .is_none()
        );
        // A point off the steps is a bad answer.
        for bad in [5, 15, 40] {
            assert!(series_of(&steps, vec![row("1", &[bad])]).is_err(), "{bad}");
        }
    }

    #[test]
    fn avg_travels_as_sum_and_count_and_the_data_range_covers_range_and_offset() {
        let p = planned("avg by (rack) (rate(x[10m] offset 1h))").unwrap();
        assert_eq!(
            p.request.queries,
            [
                "sum by (rack) (rate(x[10m] offset 1h))",
                "count by (rack) (rate(x[10m] offset 1h))"
            ]
        );
        assert_eq!(
            (p.request.start, p.request.end, p.request.step),
            (1_000_000, 1_060_000, 60_000)
        );
        assert_eq!(p.data_min, 1_000_000 - 3_600_000 - 600_000);
        assert_eq!(p.data_max, 1_060_000 - 3_600_000);
        let p = planned("sum(x)").unwrap();
        assert_eq!((p.data_min, p.data_max), (1_000_000 - 300_000, 1_060_000));
    }

    #[test]
    fn partial_results_merge_as_the_operator_does() {
        let steps = [10, 20];
        let row = |query: usize, g: &str, ts: &[i64], values: &[f64]| PartialRow {
            query,
            labels: vec![("rack".into(), g.into())],
            ts: ts.to_vec(),
            values: values.to_vec(),
        };
        let rows = || {
            vec![
                row(0, "a", &[10, 20], &[1.0, f64::NAN]),
                row(0, "a", &[20], &[5.0]),
                row(0, "b", &[20], &[2.0]),
                row(0, "a", &[10], &[3.0]),
            ]
        };
        let values = |how: Merge, rows: Vec<PartialRow>| -> Vec<Vec<(String, f64)>> {
            merge(how, &steps, rows)
                .unwrap()
                .into_iter()
                .map(|v| {
                    v.into_iter()
                        .map(|e| (e.labels[0].1.to_string(), e.v))
                        .collect()
                })
                .collect()
        };
        let (a, b) = ("a".to_owned(), "b".to_owned());
        assert_eq!(
            values(Merge::Min, rows()),
            [
                vec![(a.clone(), 1.0)],
                vec![(a.clone(), 5.0), (b.clone(), 2.0)]
            ]
        );
        assert_eq!(
            values(Merge::Max, rows()),
            [
                vec![(a.clone(), 3.0)],
                vec![(a.clone(), 5.0), (b.clone(), 2.0)]
            ]
        );
        let sum = values(Merge::Sum, rows());
        assert_eq!(sum[0], [(a.clone(), 4.0)]);
        assert!(sum[1][0].1.is_nan() && sum[1][1] == (b.clone(), 2.0));
        assert_eq!(
            values(Merge::Group, rows())[1],
            [(a.clone(), 1.0), (b.clone(), 1.0)]
        );
        let avg = vec![
            row(0, "a", &[10], &[6.0]),
            row(1, "a", &[10], &[2.0]),
            row(0, "a", &[10], &[3.0]),
            row(1, "a", &[10], &[1.0]),
        ];
        assert_eq!(values(Merge::Avg, avg), [vec![(a, 3.0)], vec![]]);
        assert!(merge(Merge::Sum, &steps, vec![row(0, "a", &[15], &[1.0])]).is_err());
    }
}
