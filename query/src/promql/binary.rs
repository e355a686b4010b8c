//! Binary operators: scalar/scalar, vector/scalar and vector/vector
//! (one-to-one, `group_left`/`group_right` matching), set operators and
//! comparisons.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use promql_parser::parser::{BinaryExpr, Expr, LabelModifier, VectorMatchCardinality};

use super::eval::{Evaluator, Keep, Operand, unsupported};
use super::value::{Elem, METRIC_NAME, NameDropper, Val, Vector, display, get, key_of, set_label};
use super::{LabelSet, PromError};

type Result<T> = std::result::Result<T, PromError>;

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

impl Evaluator<'_> {
    pub(super) fn eval_binary(&self, b: &BinaryExpr) -> Result<Val> {
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
            (Val::Vector(l), Val::Scalar(r)) => {
                let mut names = NameDropper::default();
                Ok(Val::Vector(
                    l.into_iter()
                        .zip(r)
                        .map(|(v, s)| vector_scalar(&op, v, s, false, return_bool, &mut names))
                        .collect::<Result<_>>()?,
                ))
            }
            (Val::Scalar(l), Val::Vector(r)) => {
                let mut names = NameDropper::default();
                Ok(Val::Vector(
                    r.into_iter()
                        .zip(l)
                        .map(|(v, s)| vector_scalar(&op, v, s, true, return_bool, &mut names))
                        .collect::<Result<_>>()?,
                ))
            }
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
                let mut m = Matching::new(&op, &card, on, &names, return_bool);
                let mut out = Vec::with_capacity(l.len());
                for (lv, rv) in l.into_iter().zip(r) {
                    out.push(if is_set_op(&op) {
                        m.set_op(lv, rv)
                    } else {
                        m.vector_binop(lv, rv)?
                    });
                }
                Ok(Val::Vector(out))
            }
            _ => Err(PromError::BadData(
                "binary operations are not defined on strings".into(),
            )),
        }
    }
}

fn vector_scalar(
    op: &str,
    v: Vector,
    s: f64,
    swap: bool,
    return_bool: bool,
    names: &mut NameDropper,
) -> Result<Vector> {
    let mut out = Vec::with_capacity(v.len());
    for e in v {
        if let Some(value) = scalar_elem(op, e.v, s, swap, return_bool)? {
            let labels = if drops_name(op) || return_bool {
                names.drop_name(&e.labels)
            } else {
                e.labels
            };
            out.push(Elem { labels, v: value });
        }
    }
    Ok(out)
}

/// One element `v` against the scalar `s` (on the left with `swap`): its
/// value, or `None` where a comparison drops it.
fn scalar_elem(op: &str, v: f64, s: f64, swap: bool, return_bool: bool) -> Result<Option<f64>> {
    let (lv, rv) = if swap { (s, v) } else { (v, s) };
    let (mut value, mut keep) = elem_binop(op, lv, rv)?;
    if is_comparison(op) && swap {
        value = rv;
    }
    if return_bool {
        value = if keep { 1.0 } else { 0.0 };
        keep = true;
    }
    Ok(keep.then_some(value))
}

impl Evaluator<'_> {
    /// `x op literal` or `literal op x` series by series where `x` is an
    /// [`Operand`] (a dashboard's `DCGM_FI_DEV_SM_CLOCK * 1000000`): each
    /// series' points mapped as [`vector_scalar`] maps each step's
    /// elements, in the same order. `None` for every other binary
    /// expression.
    pub(super) fn scalar_operand(&self, b: &BinaryExpr) -> Result<Option<Operand>> {
        let op = b.op.to_string();
        let modified = b.modifier.as_ref().is_some_and(|m| {
            m.matching.is_some() || m.fill_values.lhs.is_some() || m.fill_values.rhs.is_some()
        });
        if is_set_op(&op) || modified {
            return Ok(None);
        }
        let literal = |e: &Expr| match super::functions::unwrap_parens(e) {
            Expr::NumberLiteral(n) => Some(n.val),
            _ => None,
        };
        let (x, s, swap) = match (literal(&b.lhs), literal(&b.rhs)) {
            (None, Some(s)) => (&b.lhs, s, false),
            (Some(s), None) => (&b.rhs, s, true),
            _ => return Ok(None),
        };
        let return_bool = b.return_bool();
        let drop = drops_name(&op) || return_bool;
        // A selector whose names go is read without them: the same label
        // sets as dropping the name from each named one (below, a no-op for
        // them), without making the named one first and copying every label
        // string of it again (15 % of a dashboard panel's
        // `DCGM_FI_DEV_SM_CLOCK * 1000000` over 1,000 GPUs, callgrind).
        let keep = if drop { Keep::Unnamed } else { Keep::Named };
        let operand = self.operand_as(x, keep)?;
        Ok(match operand {
            Some(Operand::Series(series)) => {
                let mut names = NameDropper::default();
                let mut out = Vec::with_capacity(series.len());
                for (labels, points) in series {
                    let mut mapped = Vec::with_capacity(points.len());
                    for (i, v) in points {
                        if let Some(v) = scalar_elem(&op, v, s, swap, return_bool)? {
                            mapped.push((i, v));
                        }
                    }
                    let labels = if drop {
                        names.drop_name(&labels)
                    } else {
                        labels
                    };
                    out.push((labels, mapped));
                }
                Some(Operand::Series(out))
            }
            Some(Operand::Steps(steps)) => {
                let mut names = NameDropper::default();
                Some(Operand::Steps(
                    steps
                        .into_iter()
                        .map(|v| vector_scalar(&op, v, s, swap, return_bool, &mut names))
                        .collect::<Result<_>>()?,
                ))
            }
            None => None,
        })
    }
}

/// A left and a right label set, and the label set of their result.
type MatchedPair = (Arc<LabelSet>, Arc<LabelSet>, Arc<LabelSet>);

/// Vector matching of one binary operation, over all its steps. A series
/// keeps one shared label set from step to step, so its matching signature
/// (as a small id) and each pair's result label set are made the first
/// time the sets (the same allocations) meet, and looked up after: a step
/// costs a lookup per element, not strings and label sets. Each set met is
/// held, so that its address is not reused meanwhile.
struct Matching<'a> {
    op: &'a str,
    on: bool,
    names: &'a [String],
    return_bool: bool,
    one_to_one: bool,
    one_to_many: bool,
    /// `group_left`/`group_right` labels taken from the "one" side.
    include: Vec<String>,
    sig_of_set: HashMap<usize, (Arc<LabelSet>, usize)>,
    sig_ids: HashMap<String, usize>,
    /// Per pair of sets (by address): the pair, held, and their result.
    results: HashMap<(usize, usize), MatchedPair>,
}

impl<'a> Matching<'a> {
    fn new(
        op: &'a str,
        card: &VectorMatchCardinality,
        on: bool,
        names: &'a [String],
        return_bool: bool,
    ) -> Self {
        let (one_to_many, include) = match card {
            VectorMatchCardinality::OneToMany(l) => (true, l.labels.clone()),
            VectorMatchCardinality::ManyToOne(l) => (false, l.labels.clone()),
            _ => (false, Vec::new()),
        };
        Self {
            op,
            on,
            names,
            return_bool,
            one_to_one: matches!(card, VectorMatchCardinality::OneToOne),
            one_to_many,
            include,
            sig_of_set: HashMap::new(),
            sig_ids: HashMap::new(),
            results: HashMap::new(),
        }
    }

    /// The id of `labels`' matching signature (equal signatures, equal ids).
    fn signature(&mut self, labels: &Arc<LabelSet>) -> usize {
        let addr = Arc::as_ptr(labels) as usize;
        if let Some(&(_, id)) = self.sig_of_set.get(&addr) {
            return id;
        }
        let next = self.sig_ids.len();
        let sig = signature(labels, self.on, self.names);
        let id = *self.sig_ids.entry(sig).or_insert(next);
        self.sig_of_set.insert(addr, (labels.clone(), id));
        id
    }

    fn set_op(&mut self, lhs: Vector, rhs: Vector) -> Vector {
        match self.op {
            "and" | "unless" => {
                let keep_matched = self.op == "and";
                let r: HashSet<usize> = rhs.iter().map(|e| self.signature(&e.labels)).collect();
                lhs.into_iter()
                    .filter(|e| r.contains(&self.signature(&e.labels)) == keep_matched)
                    .collect()
            }
            _ => {
                let l: HashSet<usize> = lhs.iter().map(|e| self.signature(&e.labels)).collect();
                let mut out = lhs;
                out.extend(
                    rhs.into_iter()
                        .filter(|e| !l.contains(&self.signature(&e.labels))),
                );
                out
            }
        }
    }

    /// `resultMetric`: the label set of the result of `l` (the "many" side)
    /// matched with `r`.
    fn result_labels(&mut self, l: &Arc<LabelSet>, r: &Arc<LabelSet>) -> Arc<LabelSet> {
        let key = (Arc::as_ptr(l) as usize, Arc::as_ptr(r) as usize);
        if let Some((_, _, m)) = self.results.get(&key) {
            return m.clone();
        }
        let mut m: LabelSet = (**l).clone();
        if drops_name(self.op) {
            m.retain(|(n, _)| n != METRIC_NAME);
        }
        if self.one_to_one {
            if self.on {
                m.retain(|(n, _)| self.names.iter().any(|x| x == n));
            } else {
                m.retain(|(n, _)| !self.names.iter().any(|x| x == n));
            }
        }
        for ln in &self.include {
            let v = get(r, ln).unwrap_or("").to_string();
            set_label(&mut m, ln, &v);
        }
        if self.return_bool {
            m.retain(|(n, _)| n != METRIC_NAME);
        }
        let m = Arc::new(m);
        self.results.insert(key, (l.clone(), r.clone(), m.clone()));
        m
    }

    /// `VectorBinop`: one-to-one, many-to-one (`group_left`) or one-to-many
    /// (`group_right`) matching, as Prometheus does it.
    fn vector_binop(&mut self, lhs: Vector, rhs: Vector) -> Result<Vector> {
        let one_to_many = self.one_to_many;
        let (lhs, rhs) = if one_to_many { (rhs, lhs) } else { (lhs, rhs) };
        let mut right: HashMap<usize, Elem> = HashMap::with_capacity(rhs.len());
        for e in rhs {
            let sig = self.signature(&e.labels);
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
        let mut matched: HashMap<usize, HashSet<String>> = HashMap::new();
        let mut out = Vec::new();
        for l in lhs {
            let sig = self.signature(&l.labels);
            let Some(r) = right.get(&sig) else { continue };
            let (vl, vr) = if one_to_many { (r.v, l.v) } else { (l.v, r.v) };
            let (mut value, keep) = elem_binop(self.op, vl, vr)?;
            if self.return_bool {
                value = if keep { 1.0 } else { 0.0 };
            } else if !keep {
                continue;
            }
            let m = self.result_labels(&l.labels, &r.labels);
            let seen = matched.get_mut(&sig);
            if self.one_to_one {
                if seen.is_some() {
                    return Err(PromError::Execution(
                        "multiple matches for labels: many-to-one matching must be explicit (group_left/group_right)".into(),
                    ));
                }
                matched.insert(sig, HashSet::new());
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
                labels: m,
                v: value,
            });
        }
        Ok(out)
    }
}
