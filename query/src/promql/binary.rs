//! Binary operators: scalar/scalar, vector/scalar and vector/vector
//! (one-to-one, `group_left`/`group_right` matching), set operators and
//! comparisons.

use std::collections::HashMap;
use std::sync::Arc;

use promql_parser::parser::{BinaryExpr, LabelModifier, VectorMatchCardinality};

use super::eval::{Evaluator, unsupported};
use super::value::{Elem, METRIC_NAME, Val, Vector, display, drop_name, get, key_of, set_label};
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
