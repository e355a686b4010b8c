//! Aggregation operators (`sum`, `avg`, `min`, `max`, `count`, `group`,
//! `stddev`, `stdvar`, `quantile`, `topk`, `bottomk`, `count_values`) and
//! their grouping.

use std::collections::HashMap;
use std::sync::Arc;

use promql_parser::parser::{AggregateExpr, Expr, LabelModifier};

use super::eval::{Evaluator, Keep, KeyedPoint, Operand, SelectedPoints, unsupported};
use super::value::{
    Elem, METRIC_NAME, Val, Vector, format_value, key_of, set_label, valid_label_name,
};
use super::{LabelSet, PromError};

type Result<T> = std::result::Result<T, PromError>;

impl Evaluator<'_> {
    pub(super) fn eval_aggregate(&self, a: &AggregateExpr) -> Result<Val> {
        if let Some(v) = self.pushdown(a)? {
            return Ok(v);
        }
        let op = a.op.to_string();
        let (by, names) = match &a.modifier {
            None => (true, Vec::new()),
            Some(LabelModifier::Include(l)) => (true, l.labels.clone()),
            Some(LabelModifier::Exclude(l)) => (false, l.labels.clone()),
        };
        // The operators that fold each group's values one at a time take
        // their operand series by series where it can be made that way.
        let folding = Op::parse(&op).filter(|o| *o != Op::Quantile);
        let mut bare = &*a.expr;
        while let Expr::Paren(p) = bare {
            bare = &p.expr;
        }
        // Straight over a selector on one node, each series is read with
        // only the labels of its group: the keys differ, so the label sets
        // need no check for duplicates.
        let group = Keep::Group { by, names: &names };
        let local = self.engine.is_local();
        if let ("topk" | "bottomk", Expr::VectorSelector(vs), true) = (op.as_str(), bare, local)
            && let Some(points) = self.newest_points(vs)?
        {
            let k = match a.param.as_deref().map(|p| self.eval(p)).transpose()? {
                Some(Val::Scalar(k)) => k.first().copied().unwrap_or(f64::NAN),
                _ => {
                    return Err(PromError::BadData(format!(
                        "expected a scalar parameter in aggregation {op}"
                    )));
                }
            };
            return Ok(Val::Vector(vec![top_k_of_keys(
                op == "topk",
                points,
                k,
                group,
            )]));
        }
        if let Some(fold) = folding {
            let mut out = self.folds_of(&op, bare, &[fold], by, &names)?;
            return Ok(Val::Vector(out.pop().expect("one fold, one result")));
        }
        let input = match self.eval(&a.expr)? {
            Val::Vector(v) => v,
            _ => {
                return Err(PromError::BadData(format!(
                    "expected an instant vector in aggregation {op}"
                )));
            }
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
            "quantile" => {
                let q = scalar_param("quantile")?;
                let mut grouping = Grouping::new(by, names);
                Ok(Val::Vector(
                    input
                        .iter()
                        .zip(q)
                        .map(|(v, q)| aggregate(Op::Quantile, v, &mut grouping, Some(q)))
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

    /// Folding aggregations of one operand with one grouping, the operand
    /// read once (a pushed-down `avg` is a `sum` and a `count` of the same
    /// expression: each node evaluates both). `None` unless every one of
    /// `aggs` folds (`sum`, `avg`, `min`, `max`, `count`, `group`, `stddev`,
    /// `stdvar`), takes no parameter, and has the first one's operand and
    /// grouping.
    pub(super) fn eval_folds(&self, aggs: &[&AggregateExpr]) -> Result<Option<Vec<Vec<Vector>>>> {
        let Some(first) = aggs.first() else {
            return Ok(None);
        };
        let mut folds = Vec::with_capacity(aggs.len());
        for a in aggs {
            match Op::parse(&a.op.to_string()) {
                Some(op)
                    if op != Op::Quantile
                        && a.param.is_none()
                        && a.modifier == first.modifier
                        && a.expr == first.expr =>
                {
                    folds.push(op)
                }
                _ => return Ok(None),
            }
        }
        let (by, names) = match &first.modifier {
            None => (true, Vec::new()),
            Some(LabelModifier::Include(l)) => (true, l.labels.clone()),
            Some(LabelModifier::Exclude(l)) => (false, l.labels.clone()),
        };
        let mut bare = &*first.expr;
        while let Expr::Paren(p) = bare {
            bare = &p.expr;
        }
        self.folds_of(&first.op.to_string(), bare, &folds, by, &names)
            .map(Some)
    }

    /// Each of `folds` over the operand `bare` (parentheses removed), per
    /// step, grouped `by` (or without) `names`; `op` names the aggregation
    /// in errors.
    fn folds_of(
        &self,
        op: &str,
        bare: &Expr,
        folds: &[Op],
        by: bool,
        names: &[String],
    ) -> Result<Vec<Vec<Vector>>> {
        // Straight over a selector on one node, each series is read with
        // only the labels of its group: the keys differ, so the label sets
        // need no check for duplicates.
        let group = Keep::Group { by, names };
        let local = self.engine.is_local();
        let mut projected = false;
        let operand = match bare {
            Expr::VectorSelector(vs) if local => {
                projected = true;
                Some(Operand::Series(self.selector_points(vs, false, group)?))
            }
            // The same over a range function of a matrix selector of one
            // metric (`sum by (host) (rate(energy[5m]))`): the series'
            // label sets are distinct without their name, as the function
            // gives them.
            Expr::Call(c) if local && groups_of_one_metric(c) => {
                projected = true;
                let name = c.func.name;
                Some(
                    match super::functions::range_series(self, name, &c.args.args, Some(group))? {
                        super::functions::RangeValue::Steps(v) => Operand::Steps(v),
                        super::functions::RangeValue::Series(s) => Operand::Series(s),
                    },
                )
            }
            _ => self.operand(bare)?,
        };
        let mut out = Vec::with_capacity(folds.len());
        let input = match operand {
            Some(Operand::Series(series)) => {
                for &fold in folds {
                    let mut grouping = Grouping::new(by, names.to_vec());
                    match aggregate_series(fold, &series, self.steps.len(), &mut grouping) {
                        Some(v) => out.push(v),
                        None => break,
                    }
                }
                if out.len() == folds.len() {
                    return Ok(out);
                }
                if projected {
                    super::functions::into_steps_unchecked(self, series)
                } else {
                    super::functions::into_steps(self, series)?
                }
            }
            Some(Operand::Steps(v)) => v,
            None => match self.eval(bare)? {
                Val::Vector(v) => v,
                _ => {
                    return Err(PromError::BadData(format!(
                        "expected an instant vector in aggregation {op}"
                    )));
                }
            },
        };
        for &fold in &folds[out.len()..] {
            let mut grouping = Grouping::new(by, names.to_vec());
            out.push(
                input
                    .iter()
                    .map(|v| aggregate(fold, v, &mut grouping, None))
                    .collect(),
            );
        }
        Ok(out)
    }
}

/// Whether an aggregation's groups can be read straight from the series of
/// range function call `c`: its range argument is a matrix selector of one
/// metric name (so its series differ in their other labels, which the
/// function keeps). A group's `__name__` is then the function's to drop
/// (all but `last_over_time` do), as from a whole label set.
fn groups_of_one_metric(c: &promql_parser::parser::Call) -> bool {
    let name = c.func.name;
    if !super::functions::is_range_function(name) {
        return false;
    }
    let mut arg = match super::functions::range_arg(name, &c.args.args) {
        Some(a) => a,
        None => return false,
    };
    while let Expr::Paren(p) = arg {
        arg = &p.expr;
    }
    let Expr::MatrixSelector(sel) = arg else {
        return false;
    };
    let named = |m: &promql_parser::label::Matcher| {
        m.name == METRIC_NAME && matches!(m.op, promql_parser::label::MatchOp::Equal)
    };
    sel.vs.name.is_some() || sel.vs.matchers.matchers.iter().any(named)
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
    of_series: HashMap<usize, (Arc<LabelSet>, usize), foldhash::fast::RandomState>,
    ids: HashMap<String, usize, foldhash::fast::RandomState>,
    labels: Vec<Arc<LabelSet>>,
    /// Per group id, its position in the step being aggregated (`usize::MAX`: none).
    slots: Vec<usize>,
}

impl Grouping {
    fn new(by: bool, names: Vec<String>) -> Self {
        Self {
            by,
            names,
            of_series: HashMap::default(),
            ids: HashMap::default(),
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

/// The aggregations that fold each group's values one at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Sum,
    Avg,
    Min,
    Max,
    Count,
    Group,
    Stddev,
    Stdvar,
    Quantile,
}

impl Op {
    fn parse(op: &str) -> Option<Self> {
        Some(match op {
            "sum" => Self::Sum,
            "avg" => Self::Avg,
            "min" => Self::Min,
            "max" => Self::Max,
            "count" => Self::Count,
            "group" => Self::Group,
            "stddev" => Self::Stddev,
            "stdvar" => Self::Stdvar,
            "quantile" => Self::Quantile,
            _ => return None,
        })
    }
}

/// One group's running value at one step, as Prometheus 2.42's
/// `aggregation` keeps it (the values of `quantile` are kept apart).
#[derive(Debug, Clone, Copy)]
struct Acc {
    value: f64,
    mean: f64,
    /// 0 for a group without a value yet.
    count: f64,
}

impl Acc {
    const EMPTY: Self = Self {
        value: 0.0,
        mean: 0.0,
        count: 0.0,
    };

    fn new(op: Op, s: f64) -> Self {
        Self {
            value: if matches!(op, Op::Stddev | Op::Stdvar) {
                0.0
            } else {
                s
            },
            mean: s,
            count: 1.0,
        }
    }

    fn add(&mut self, op: Op, s: f64) {
        match op {
            Op::Sum => self.value += s,
            Op::Avg => {
                self.count += 1.0;
                if self.mean.is_infinite() {
                    if s.is_infinite() && (self.mean > 0.0) == (s > 0.0) {
                        return;
                    }
                    if !s.is_infinite() && !s.is_nan() {
                        return;
                    }
                }
                self.mean += s / self.count - self.mean / self.count;
            }
            Op::Max if self.value < s || self.value.is_nan() => self.value = s,
            Op::Min if self.value > s || self.value.is_nan() => self.value = s,
            Op::Count | Op::Group => self.count += 1.0,
            Op::Stddev | Op::Stdvar => {
                self.count += 1.0;
                let delta = s - self.mean;
                self.mean += delta / self.count;
                self.value += delta * (s - self.mean);
            }
            _ => {}
        }
    }

    /// The group's value (`quantile`'s is made from its values apart).
    fn finish(&self, op: Op) -> f64 {
        match op {
            Op::Avg => self.mean,
            Op::Count => self.count,
            Op::Group => 1.0,
            Op::Stdvar => self.value / self.count,
            Op::Stddev => (self.value / self.count).sqrt(),
            _ => self.value,
        }
    }
}

#[derive(Debug)]
struct Group {
    id: usize,
    acc: Acc,
    values: Vec<f64>,
}

fn aggregate(op: Op, v: &Vector, grouping: &mut Grouping, q: Option<f64>) -> Vector {
    let mut groups: Vec<Group> = Vec::new();
    for e in v {
        let id = grouping.id(&e.labels);
        let s = e.v;
        match grouping.slots[id] {
            usize::MAX => {
                grouping.slots[id] = groups.len();
                groups.push(Group {
                    id,
                    acc: Acc::new(op, s),
                    values: if op == Op::Quantile {
                        vec![s]
                    } else {
                        Vec::new()
                    },
                });
            }
            i => {
                let g = &mut groups[i];
                if op == Op::Quantile {
                    g.values.push(s);
                } else {
                    g.acc.add(op, s);
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
                Op::Quantile => quantile(q.unwrap_or(f64::NAN), &mut g.values),
                _ => g.acc.finish(op),
            };
            Elem {
                labels: grouping.labels[g.id].clone(),
                v,
            }
        })
        .collect()
}

/// Most running values (steps × groups) [`aggregate_series`] holds at once.
const MAX_SERIES_MAJOR_CELLS: usize = 1 << 22;

/// [`aggregate`] at every step, from the input series by series: each
/// series' group is found once, and its points fold into the running value
/// of their step and group. Every step's groups and the order in which
/// their values fold are those of [`aggregate`] over that step's vector
/// (the series' order), so the answer is the same to the bit. `None` where
/// the running values would pass [`MAX_SERIES_MAJOR_CELLS`].
fn aggregate_series(
    op: Op,
    series: &[SelectedPoints],
    steps: usize,
    grouping: &mut Grouping,
) -> Option<Vec<Vector>> {
    let ids: Vec<usize> = series.iter().map(|(l, _)| grouping.id(l)).collect();
    let n = grouping.labels.len();
    if n.saturating_mul(steps) > MAX_SERIES_MAJOR_CELLS {
        return None;
    }
    let mut cells = vec![Acc::EMPTY; n * steps];
    // Each step's groups in the order their first value came.
    let mut order: Vec<Vec<u32>> = vec![Vec::new(); steps];
    for ((_, points), &g) in series.iter().zip(&ids) {
        for &(i, v) in points {
            let cell = &mut cells[i as usize * n + g];
            if cell.count == 0.0 {
                *cell = Acc::new(op, v);
                order[i as usize].push(g as u32);
            } else {
                cell.add(op, v);
            }
        }
    }
    Some(
        order
            .into_iter()
            .enumerate()
            .map(|(i, groups)| {
                groups
                    .into_iter()
                    .map(|g| Elem {
                        labels: grouping.labels[g as usize].clone(),
                        v: cells[i * n + g as usize].finish(op),
                    })
                    .collect()
            })
            .collect(),
    )
}

pub(super) fn top_k(top: bool, v: Vector, k: f64, by: bool, names: &[String]) -> Vector {
    top_k_by(
        top,
        v,
        k,
        |e| key_of(&group_labels(&e.labels, by, names)),
        |e| e.v,
    )
}

/// [`top_k`] of an instant selector's series, given by their keys in key
/// order: the same groups, order and ties, but only the `k` kept per group
/// get their label sets. Making every series' set (every label string
/// copied) and dropping all but ten was four fifths of `topk(10, x)` over
/// 1,000 GPUs (callgrind of the server).
fn top_k_of_keys(top: bool, points: Vec<KeyedPoint>, k: f64, group: Keep<'_>) -> Vector {
    top_k_by(
        top,
        points,
        k,
        |(key, _)| key_of(&group.labels(key)),
        |p| p.1,
    )
    .into_iter()
    .map(|(key, v)| Elem {
        labels: Arc::new(super::labels_of(&key)),
        v,
    })
    .collect()
}

/// The `k` first of each group by [`ranked`] order, groups in the order
/// their first item comes, ties in the items' order: `group` names an
/// item's group, `value` gives its value.
fn top_k_by<T>(
    top: bool,
    items: Vec<T>,
    k: f64,
    group: impl Fn(&T) -> String,
    value: impl Fn(&T) -> f64,
) -> Vec<T> {
    let k = if k.is_nan() { 0 } else { k as i64 };
    if k < 1 {
        return Vec::new();
    }
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut groups: Vec<Vec<T>> = Vec::new();
    for item in items {
        let i = *index.entry(group(&item)).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[i].push(item);
    }
    let mut out = Vec::new();
    for mut g in groups {
        g.sort_by(|a, b| ranked(top, value(a), value(b)));
        g.truncate(k.min(g.len() as i64) as usize);
        out.extend(g);
    }
    out
}

/// The order of `topk` (`top`) or `bottomk`: NaN after every number.
fn ranked(top: bool, a: f64, b: f64) -> std::cmp::Ordering {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => std::cmp::Ordering::Equal,
        (true, false) => std::cmp::Ordering::Greater,
        (false, true) => std::cmp::Ordering::Less,
        _ => {
            let o = a.partial_cmp(&b).unwrap_or(std::cmp::Ordering::Equal);
            if top { o.reverse() } else { o }
        }
    }
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
