//! Aggregation operators (`sum`, `avg`, `min`, `max`, `count`, `group`,
//! `stddev`, `stdvar`, `quantile`, `topk`, `bottomk`, `count_values`) and
//! their grouping.

use std::collections::HashMap;
use std::sync::Arc;

use promql_parser::parser::{AggregateExpr, LabelModifier};

use super::eval::{Evaluator, unsupported};
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

pub(super) fn top_k(top: bool, v: Vector, k: f64, by: bool, names: &[String]) -> Vector {
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
