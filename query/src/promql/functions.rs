//! PromQL functions, ported from Prometheus 2.42's `promql/functions.go`.

use std::sync::Arc;

use promql_parser::parser::{Call, Expr};

use super::aggregate::quantile;
use super::eval::{Evaluator, Keep, SelectedPoints, unsupported};
use super::value::{
    Elem, LabelSetIds, METRIC_NAME, NameDropper, RangeInput, RawSeries, Val, Vector,
    check_unique_steps, drop_name, get, set_label, valid_label_name,
};
use super::{LabelSet, PromError};

type Result<T> = std::result::Result<T, PromError>;

pub(super) fn unwrap_parens(e: &Expr) -> &Expr {
    match e {
        Expr::Paren(p) => unwrap_parens(&p.expr),
        other => other,
    }
}

fn scalar_arg(ev: &Evaluator<'_>, e: &Expr) -> Result<Vec<f64>> {
    match ev.eval(e)? {
        Val::Scalar(v) => Ok(v),
        _ => Err(PromError::BadData(format!(
            "expected a scalar argument, got {e}"
        ))),
    }
}

fn vector_arg(ev: &Evaluator<'_>, e: &Expr) -> Result<Vec<Vector>> {
    match ev.eval(e)? {
        Val::Vector(v) => Ok(v),
        _ => Err(PromError::BadData(format!(
            "expected an instant vector argument, got {e}"
        ))),
    }
}

fn string_arg(e: &Expr) -> Result<String> {
    match unwrap_parens(e) {
        Expr::StringLiteral(s) => Ok(s.val.clone()),
        other => Err(PromError::BadData(format!(
            "expected a string literal argument, got {other}"
        ))),
    }
}

fn arg(args: &[Box<Expr>], i: usize, name: &str) -> Result<Expr> {
    args.get(i)
        .map(|b| (**b).clone())
        .ok_or_else(|| PromError::BadData(format!("missing argument {} of {name}()", i + 1)))
}

/// Applies `f` to every element, dropping the metric name.
fn map_values(v: Vec<Vector>, f: impl Fn(f64, usize) -> f64) -> Vec<Vector> {
    let mut names = NameDropper::default();
    v.into_iter()
        .enumerate()
        .map(|(i, vec)| {
            vec.into_iter()
                .map(|e| Elem {
                    labels: names.drop_name(&e.labels),
                    v: f(e.v, i),
                })
                .collect()
        })
        .collect()
}

fn checked(v: Vec<Vector>) -> Result<Val> {
    check_unique_steps(&v, &mut LabelSetIds::default())?;
    Ok(Val::Vector(v))
}

fn math_fn(name: &str) -> Option<fn(f64) -> f64> {
    let f: fn(f64) -> f64 = match name {
        "abs" => f64::abs,
        "ceil" => f64::ceil,
        "floor" => f64::floor,
        "exp" => f64::exp,
        "sqrt" => f64::sqrt,
        "ln" => f64::ln,
        "log2" => f64::log2,
        "log10" => f64::log10,
        "sgn" => |v: f64| {
            if v < 0.0 {
                -1.0
            } else if v > 0.0 {
                1.0
            } else {
                v
            }
        },
        "acos" => f64::acos,
        "acosh" => f64::acosh,
        "asin" => f64::asin,
        "asinh" => f64::asinh,
        "atan" => f64::atan,
        "atanh" => f64::atanh,
        "cos" => f64::cos,
        "cosh" => f64::cosh,
        "sin" => f64::sin,
        "sinh" => f64::sinh,
        "tan" => f64::tan,
        "tanh" => f64::tanh,
        "deg" => |v: f64| v * 180.0 / std::f64::consts::PI,
        "rad" => |v: f64| v * std::f64::consts::PI / 180.0,
        _ => return None,
    };
    Some(f)
}

/// Days since 1970-01-01 to (year, month 1-12, day 1-31).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = (if mp < 10 { mp + 3 } else { mp - 9 }) as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

fn date_part(name: &str, v: f64) -> f64 {
    let secs = v as i64;
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let month_days = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    match name {
        "minute" => ((sod / 60) % 60) as f64,
        "hour" => (sod / 3600) as f64,
        "day_of_month" => d as f64,
        "day_of_week" => (days + 4).rem_euclid(7) as f64,
        "day_of_year" => {
            let before: i64 = month_days[..(m - 1) as usize].iter().sum();
            (before + d as i64 + i64::from(m > 2 && is_leap(y))) as f64
        }
        "days_in_month" => (month_days[(m - 1) as usize] + i64::from(m == 2 && is_leap(y))) as f64,
        "month" => m as f64,
        _ => y as f64,
    }
}

pub(super) fn call(ev: &Evaluator<'_>, c: &Call) -> Result<Val> {
    let name = c.func.name;
    let args = &c.args.args;
    let n = ev.steps.len();
    if let Some(f) = math_fn(name) {
        let v = vector_arg(ev, &arg(args, 0, name)?)?;
        return checked(map_values(v, |x, _| f(x)));
    }
    if is_range_function(name) {
        return range_function(ev, name, args);
    }
    match name {
        "time" => Ok(Val::Scalar(
            ev.steps.iter().map(|&t| t as f64 / 1000.0).collect(),
        )),
        "vector" => {
            let s = scalar_arg(ev, &arg(args, 0, name)?)?;
            Ok(Val::Vector(
                s.into_iter()
                    .map(|v| {
                        vec![Elem {
                            labels: Arc::new(Vec::new()),
                            v,
                        }]
                    })
                    .collect(),
            ))
        }
        "scalar" => {
            let v = vector_arg(ev, &arg(args, 0, name)?)?;
            Ok(Val::Scalar(
                v.into_iter()
                    .map(|v| if v.len() == 1 { v[0].v } else { f64::NAN })
                    .collect(),
            ))
        }
        "timestamp" => {
            let a = arg(args, 0, name)?;
            let v = match unwrap_parens(&a) {
                Expr::VectorSelector(vs) => ev.eval_selector(vs, true)?,
                _ => {
                    let steps = ev.steps.clone();
                    map_values(vector_arg(ev, &a)?, |_, i| steps[i] as f64 / 1000.0)
                }
            };
            checked(map_values(v, |x, _| x))
        }
        "minute" | "hour" | "day_of_month" | "day_of_week" | "day_of_year" | "days_in_month"
        | "month" | "year" => {
            let v = match args.first() {
                Some(a) => vector_arg(ev, a)?,
                None => ev
                    .steps
                    .iter()
                    .map(|&t| {
                        vec![Elem {
                            labels: Arc::new(Vec::new()),
                            v: t as f64 / 1000.0,
                        }]
                    })
                    .collect(),
            };
            checked(map_values(v, |x, _| date_part(name, x)))
        }
        "round" => {
            let v = vector_arg(ev, &arg(args, 0, name)?)?;
            let to = match args.get(1) {
                Some(a) => scalar_arg(ev, a)?,
                None => vec![1.0; n],
            };
            checked(map_values(v, |x, i| {
                let inv = 1.0 / to[i];
                (x * inv + 0.5).floor() / inv
            }))
        }
        "clamp" => {
            let v = vector_arg(ev, &arg(args, 0, name)?)?;
            let lo = scalar_arg(ev, &arg(args, 1, name)?)?;
            let hi = scalar_arg(ev, &arg(args, 2, name)?)?;
            let v: Vec<Vector> = v
                .into_iter()
                .enumerate()
                .map(|(i, vec)| if hi[i] < lo[i] { Vec::new() } else { vec })
                .collect();
            checked(map_values(v, |x, i| go_max(lo[i], go_min(hi[i], x))))
        }
        "clamp_min" | "clamp_max" => {
            let v = vector_arg(ev, &arg(args, 0, name)?)?;
            let b = scalar_arg(ev, &arg(args, 1, name)?)?;
            let min = name == "clamp_min";
            checked(map_values(v, |x, i| {
                if min {
                    go_max(b[i], x)
                } else {
                    go_min(b[i], x)
                }
            }))
        }
        "sort" | "sort_desc" => {
            let mut v = vector_arg(ev, &arg(args, 0, name)?)?;
            let desc = name == "sort_desc";
            for vec in &mut v {
                vec.sort_by(|a, b| match (a.v.is_nan(), b.v.is_nan()) {
                    (true, true) => std::cmp::Ordering::Equal,
                    (true, false) => std::cmp::Ordering::Greater,
                    (false, true) => std::cmp::Ordering::Less,
                    _ => {
                        let o = a.v.partial_cmp(&b.v).unwrap_or(std::cmp::Ordering::Equal);
                        if desc { o.reverse() } else { o }
                    }
                });
            }
            Ok(Val::Vector(v))
        }
        "label_replace" => {
            let v = vector_arg(ev, &arg(args, 0, name)?)?;
            let dst = string_arg(&arg(args, 1, name)?)?;
            let repl = string_arg(&arg(args, 2, name)?)?;
            let src = string_arg(&arg(args, 3, name)?)?;
            let re_src = string_arg(&arg(args, 4, name)?)?;
            let re = regex::Regex::new(&format!("^(?:{re_src})$")).map_err(|e| {
                PromError::Execution(format!(
                    "invalid regular expression in label_replace(): {re_src}: {e}"
                ))
            })?;
            if !valid_label_name(&dst) {
                return Err(PromError::Execution(format!(
                    "invalid destination label name in label_replace(): {dst}"
                )));
            }
            let out = v
                .into_iter()
                .map(|vec| {
                    vec.into_iter()
                        .map(|e| {
                            let val = get(&e.labels, &src).unwrap_or("");
                            let Some(caps) = re.captures(val) else {
                                return e;
                            };
                            let mut res = String::new();
                            caps.expand(&repl, &mut res);
                            let mut l = (*e.labels).clone();
                            set_label(&mut l, &dst, &res);
                            Elem {
                                labels: Arc::new(l),
                                v: e.v,
                            }
                        })
                        .collect()
                })
                .collect();
            checked(out)
        }
        "label_join" => {
            let v = vector_arg(ev, &arg(args, 0, name)?)?;
            let dst = string_arg(&arg(args, 1, name)?)?;
            let sep = string_arg(&arg(args, 2, name)?)?;
            let srcs = args[3.min(args.len())..]
                .iter()
                .map(|a| string_arg(a))
                .collect::<Result<Vec<_>>>()?;
            if !valid_label_name(&dst) {
                return Err(PromError::Execution(format!(
                    "invalid destination label name in label_join(): {dst}"
                )));
            }
            let out = v
                .into_iter()
                .map(|vec| {
                    vec.into_iter()
                        .map(|e| {
                            let joined = srcs
                                .iter()
                                .map(|s| get(&e.labels, s).unwrap_or(""))
                                .collect::<Vec<_>>()
                                .join(&sep);
                            let mut l = (*e.labels).clone();
                            set_label(&mut l, &dst, &joined);
                            Elem {
                                labels: Arc::new(l),
                                v: e.v,
                            }
                        })
                        .collect()
                })
                .collect();
            checked(out)
        }
        "histogram_quantile" => {
            let q = scalar_arg(ev, &arg(args, 0, name)?)?;
            let v = vector_arg(ev, &arg(args, 1, name)?)?;
            checked(
                v.into_iter()
                    .enumerate()
                    .map(|(i, vec)| histogram_quantile(q[i], vec))
                    .collect(),
            )
        }
        "absent" => {
            let a = arg(args, 0, name)?;
            let v = vector_arg(ev, &a)?;
            let labels = Arc::new(absent_labels(&a));
            Ok(Val::Vector(
                v.into_iter()
                    .map(|vec| {
                        if vec.is_empty() {
                            vec![Elem {
                                labels: labels.clone(),
                                v: 1.0,
                            }]
                        } else {
                            Vec::new()
                        }
                    })
                    .collect(),
            ))
        }
        "absent_over_time" => {
            let a = arg(args, 0, name)?;
            let input = ev.range_input(&a)?;
            let labels = Arc::new(absent_labels(&a));
            Ok(Val::Vector(
                ev.steps
                    .iter()
                    .map(|&t| {
                        let reference = input.reference(t);
                        let present = input.series.iter().any(|s| {
                            let (lo, hi) = input.window(s, reference);
                            hi > lo
                        });
                        if present {
                            Vec::new()
                        } else {
                            vec![Elem {
                                labels: labels.clone(),
                                v: 1.0,
                            }]
                        }
                    })
                    .collect(),
            ))
        }
        other => Err(unsupported(&format!("function {other}()"))),
    }
}

/// The labels of `absent()`'s answer (`createLabelsForAbsentFunction`): the
/// selector's equality matchers, except `__name__` and names matched twice.
fn absent_labels(e: &Expr) -> LabelSet {
    let vs = match unwrap_parens(e) {
        Expr::VectorSelector(vs) => vs,
        Expr::MatrixSelector(ms) => &ms.vs,
        _ => return Vec::new(),
    };
    let mut labels: LabelSet = Vec::new();
    let mut dropped: Vec<&str> = Vec::new();
    for m in &vs.matchers.matchers {
        if m.name == METRIC_NAME {
            continue;
        }
        let eq = matches!(m.op, promql_parser::label::MatchOp::Equal);
        if eq && !labels.iter().any(|(n, _)| *n == m.name) {
            set_label(&mut labels, &m.name, &m.value);
        } else {
            dropped.push(&m.name);
        }
    }
    labels.retain(|(n, _)| !dropped.contains(&n.as_str()));
    labels
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    upper: f64,
    count: f64,
}

/// `bucketQuantile` of Prometheus 2.42 (classic `le` buckets).
fn bucket_quantile(q: f64, mut buckets: Vec<Bucket>) -> f64 {
    if q < 0.0 {
        return f64::NEG_INFINITY;
    }
    if q > 1.0 {
        return f64::INFINITY;
    }
    buckets.sort_by(|a, b| {
        a.upper
            .partial_cmp(&b.upper)
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    match buckets.last() {
        Some(b) if b.upper == f64::INFINITY => {}
        _ => return f64::NAN,
    }
    // coalesceBuckets
    let mut merged: Vec<Bucket> = Vec::with_capacity(buckets.len());
    for b in buckets {
        match merged.last_mut() {
            Some(last) if last.upper == b.upper => last.count += b.count,
            _ => merged.push(b),
        }
    }
    // ensureMonotonic
    let mut max = f64::NEG_INFINITY;
    for b in &mut merged {
        if b.count > max {
            max = b.count;
        } else if b.count < max {
            b.count = max;
        }
    }
    if merged.len() < 2 {
        return f64::NAN;
    }
    let observations = merged[merged.len() - 1].count;
    if observations == 0.0 {
        return f64::NAN;
    }
    let mut rank = q * observations;
    let n = merged.len() - 1;
    let b = merged[..n].partition_point(|x| x.count < rank);
    if b == n {
        return merged[n - 1].upper;
    }
    if b == 0 && merged[0].upper <= 0.0 {
        return merged[0].upper;
    }
    let mut start = 0.0;
    let end = merged[b].upper;
    let mut count = merged[b].count;
    if b > 0 {
        start = merged[b - 1].upper;
        count -= merged[b - 1].count;
        rank -= merged[b - 1].count;
    }
    start + (end - start) * (rank / count)
}

fn histogram_quantile(q: f64, v: Vector) -> Vector {
    let mut index: std::collections::HashMap<String, usize> = Default::default();
    let mut groups: Vec<(Arc<LabelSet>, Vec<Bucket>)> = Vec::new();
    for e in v {
        let Some(upper) = get(&e.labels, "le").and_then(|s| s.trim().parse::<f64>().ok()) else {
            continue;
        };
        let key: LabelSet = e
            .labels
            .iter()
            .filter(|(n, _)| n != "le")
            .cloned()
            .collect();
        let k = super::value::key_of(&key);
        let i = *index.entry(k).or_insert_with(|| {
            let out: LabelSet = key.into_iter().filter(|(n, _)| n != METRIC_NAME).collect();
            groups.push((Arc::new(out), Vec::new()));
            groups.len() - 1
        });
        groups[i].1.push(Bucket { upper, count: e.v });
    }
    groups
        .into_iter()
        .map(|(labels, b)| Elem {
            labels,
            v: bucket_quantile(q, b),
        })
        .collect()
}

/// Neumaier's compensated summation step (`kahanSumInc`).
fn kahan_inc(inc: f64, sum: f64, c: f64) -> (f64, f64) {
    let t = sum + inc;
    let c = if sum.abs() >= inc.abs() {
        c + ((sum - t) + inc)
    } else {
        c + ((inc - t) + sum)
    };
    (t, c)
}

/// `linearRegression`: slope and intercept at `intercept_ms`.
fn linear_regression(ts: &[i64], vs: &[f64], intercept_ms: i64) -> (f64, f64) {
    let (mut n, mut sx, mut cx, mut sy, mut cy) = (0.0, 0.0, 0.0, 0.0, 0.0);
    let (mut sxy, mut cxy, mut sx2, mut cx2) = (0.0, 0.0, 0.0, 0.0);
    let init_y = vs[0];
    let mut const_y = true;
    for (i, (&t, &v)) in ts.iter().zip(vs).enumerate() {
        if const_y && i > 0 && v != init_y {
            const_y = false;
        }
        n += 1.0;
        let x = (t - intercept_ms) as f64 / 1e3;
        (sx, cx) = kahan_inc(x, sx, cx);
        (sy, cy) = kahan_inc(v, sy, cy);
        (sxy, cxy) = kahan_inc(x * v, sxy, cxy);
        (sx2, cx2) = kahan_inc(x * x, sx2, cx2);
    }
    if const_y {
        if init_y.is_infinite() {
            return (f64::NAN, f64::NAN);
        }
        return (0.0, init_y);
    }
    let (sx, sy, sxy, sx2) = (sx + cx, sy + cy, sxy + cxy, sx2 + cx2);
    let cov = sxy - sx * sy / n;
    let var = sx2 - sx * sx / n;
    let slope = cov / var;
    (slope, sy / n - slope * sx / n)
}

/// `extrapolatedRate` of Prometheus 2.42 (`rate`, `increase`, `delta`).
/// `w.may_fall` false says that no value of the window is below the one
/// before it, so that a counter's resets need not be looked for.
///
/// Prometheus makes seven divisions a window, five in one chain (seconds
/// from milliseconds, the average interval before the threshold's
/// comparisons, the factor, the rate). The comparisons are made here on
/// milliseconds multiplied out ([`clear_extrapolation`]), leaving three
/// divisions in the chain, and Prometheus's steps are taken in full only
/// where a comparison is too close to call that way: the answer is
/// Prometheus's to the bit either way.
fn extrapolated_rate(
    w: &RawWindow<'_>,
    range_start: i64,
    range_end: i64,
    is_counter: bool,
    is_rate: bool,
) -> Option<f64> {
    let (ts, vs) = (w.ts, w.vs);
    if ts.len() < 2 {
        return None;
    }
    let last = vs.len() - 1;
    let mut result = vs[last] - vs[0];
    if is_counter && w.may_fall {
        let mut prev = vs[0];
        for &cur in &vs[1..] {
            if cur < prev {
                result += prev;
            }
            prev = cur;
        }
    }
    let shape = WindowShape {
        to_start: ts[0] - range_start,
        to_end: range_end - ts[last],
        sampled: ts[last] - ts[0],
        intervals: last,
    };
    let first = is_counter.then_some(vs[0]);
    let factor = clear_extrapolation(&shape, first, result)
        .unwrap_or_else(|| prometheus_extrapolation(&shape, first, result));
    let v = result * factor;
    Some(if is_rate {
        v / ((range_end - range_start) as f64 / 1000.0)
    } else {
        v
    })
}

/// Where a window's samples lie in it, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct WindowShape {
    /// From the range's start to the first sample.
    to_start: i64,
    /// From the last sample to the range's end.
    to_end: i64,
    /// From the first sample to the last (above zero).
    sampled: i64,
    /// Samples less one (at least one).
    intervals: usize,
}

/// How much closer than the margin of doubt two sides of a comparison must
/// be for [`clear_extrapolation`] to leave it to Prometheus's steps: each
/// side is within a few roundings (about 1e-16 each) of its exact value.
const TOO_CLOSE: f64 = 1e-12;

/// Whether `a < b`, from their values rounded a few times; `None` where
/// they are too close to tell.
fn clearly_less(a: f64, b: f64) -> Option<bool> {
    let doubt = TOO_CLOSE * a.abs().max(b.abs());
    if a < b - doubt {
        Some(true)
    } else if a > b + doubt {
        Some(false)
    } else {
        None
    }
}

/// What [`prometheus_extrapolation`] returns, to the bit, with its
/// comparisons made on milliseconds multiplied out: `x / 1000 < (s / 1000 /
/// n) * 1.1` as `x * n < s * 1.1`; the sums and the quotient are then
/// Prometheus's own. `first`: the counter's first value (`None` for
/// `delta`), with `result` its rise. `None` where a comparison is too close
/// to call this way, or where the counter's zero may lie within the window
/// (the start is then moved to it).
fn clear_extrapolation(shape: &WindowShape, first: Option<f64>, result: f64) -> Option<f64> {
    if shape.sampled <= 0 || shape.to_start < 0 || shape.to_end < 0 {
        return None;
    }
    let sampled_ms = shape.sampled as f64;
    if let Some(v0) = first
        && result > 0.0
        && v0 >= 0.0
        // Prometheus moves the start to the zero where `sampled * (v0 /
        // result) < to_start`; here it must clearly not.
        && !clearly_less(shape.to_start as f64 * result, sampled_ms * v0)?
    {
        return None;
    }
    let n = shape.intervals as f64;
    let threshold = sampled_ms * 1.1;
    let reaches_start = clearly_less(shape.to_start as f64 * n, threshold)?;
    let reaches_end = clearly_less(shape.to_end as f64 * n, threshold)?;
    Some(extension(
        sampled_ms / 1000.0,
        shape.intervals,
        reaches_start.then(|| shape.to_start as f64 / 1000.0),
        reaches_end.then(|| shape.to_end as f64 / 1000.0),
    ))
}

/// The factor `extrapolatedRate` multiplies a window's rise by (before a
/// rate's division by the range), by Prometheus's own steps: the sampled
/// interval extended to the range's ends where samples reach close enough to
/// them (half an average interval otherwise), a counter's start no further
/// back than its zero, over the sampled interval.
fn prometheus_extrapolation(shape: &WindowShape, first: Option<f64>, result: f64) -> f64 {
    let sampled = shape.sampled as f64 / 1000.0;
    let avg_between = sampled / shape.intervals as f64;
    let mut to_start = shape.to_start as f64 / 1000.0;
    let to_end = shape.to_end as f64 / 1000.0;
    if let Some(v0) = first
        && result > 0.0
        && v0 >= 0.0
    {
        let to_zero = sampled * (v0 / result);
        if to_zero < to_start {
            to_start = to_zero;
        }
    }
    let threshold = avg_between * 1.1;
    extension(
        sampled,
        shape.intervals,
        (to_start < threshold).then_some(to_start),
        (to_end < threshold).then_some(to_end),
    )
}

/// The sampled interval (in seconds) extended at each end by the time to
/// the range's end where the samples reach close enough to it (`Some`), by
/// half an average interval otherwise, over the sampled interval: the sums
/// and the quotient of `extrapolatedRate`, in its order.
fn extension(sampled: f64, intervals: usize, start: Option<f64>, end: Option<f64>) -> f64 {
    let half_between = || sampled / intervals as f64 / 2.0;
    let mut interval = sampled;
    interval += start.unwrap_or_else(half_between);
    interval += end.unwrap_or_else(half_between);
    interval / sampled
}

/// `instantValue` (`irate`, `idelta`).
pub(super) fn instant_value(ts: &[i64], vs: &[f64], is_rate: bool) -> Option<f64> {
    let n = ts.len();
    if n < 2 {
        return None;
    }
    let (lt, lv, pt, pv) = (ts[n - 1], vs[n - 1], ts[n - 2], vs[n - 2]);
    let mut result = if is_rate && lv < pv { lv } else { lv - pv };
    let interval = lt - pt;
    if interval == 0 {
        return None;
    }
    if is_rate {
        result /= interval as f64 / 1000.0;
    }
    Some(result)
}

/// Whether `name` is a function of a range vector ([`range_series`]).
pub(super) fn is_range_function(name: &str) -> bool {
    RangeFn::of(name).is_some()
}

/// A function of a range vector, known from its name once per query rather
/// than matched by name at every window of every series.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RangeFn {
    Rate,
    Increase,
    Delta,
    Irate,
    Idelta,
    Deriv,
    Changes,
    Resets,
    Avg,
    Min,
    Max,
    Sum,
    Count,
    Last,
    Stddev,
    Stdvar,
    Present,
    PredictLinear,
    Quantile,
}

impl RangeFn {
    fn of(name: &str) -> Option<Self> {
        Some(match name {
            "rate" => Self::Rate,
            "increase" => Self::Increase,
            "delta" => Self::Delta,
            "irate" => Self::Irate,
            "idelta" => Self::Idelta,
            "deriv" => Self::Deriv,
            "changes" => Self::Changes,
            "resets" => Self::Resets,
            "avg_over_time" => Self::Avg,
            "min_over_time" => Self::Min,
            "max_over_time" => Self::Max,
            "sum_over_time" => Self::Sum,
            "count_over_time" => Self::Count,
            "last_over_time" => Self::Last,
            "stddev_over_time" => Self::Stddev,
            "stdvar_over_time" => Self::Stdvar,
            "present_over_time" => Self::Present,
            "predict_linear" => Self::PredictLinear,
            "quantile_over_time" => Self::Quantile,
            _ => return None,
        })
    }
}

/// A range function's value, as its evaluation made it.
pub(super) enum RangeValue {
    /// From a rollup tier: a vector per step, checked.
    Steps(Vec<Vector>),
    /// From raw samples, series by series: each input series' label set
    /// (the name dropped but for `last_over_time`) and its (step index,
    /// value) points. Two series may have one label set here; what uses
    /// this must refuse them where they meet at a step ([`into_steps`]).
    Series(Vec<SelectedPoints>),
}

/// Series-major points as a vector per step, checked for label sets met
/// twice at one step.
pub(super) fn into_steps(ev: &Evaluator<'_>, series: Vec<SelectedPoints>) -> Result<Vec<Vector>> {
    let out = into_steps_unchecked(ev, series);
    check_unique_steps(&out, &mut LabelSetIds::default())?;
    Ok(out)
}

/// [`into_steps`] without the check that no step holds one label set twice,
/// for series that are distinct though their label sets may not be (read
/// with only their group's labels, [`super::eval::Keep::Group`]).
pub(super) fn into_steps_unchecked(ev: &Evaluator<'_>, series: Vec<SelectedPoints>) -> Vec<Vector> {
    let mut out: Vec<Vector> = vec![Vec::new(); ev.steps.len()];
    for (labels, points) in series {
        for (i, v) in points {
            out[i as usize].push(Elem {
                labels: labels.clone(),
                v,
            });
        }
    }
    out
}

fn range_function(ev: &Evaluator<'_>, name: &str, args: &[Box<Expr>]) -> Result<Val> {
    match range_series(ev, name, args, None)? {
        RangeValue::Steps(out) => Ok(Val::Vector(out)),
        RangeValue::Series(series) => Ok(Val::Vector(into_steps(ev, series)?)),
    }
}

/// The range argument of range function `name`.
pub(super) fn range_arg<'e>(name: &str, args: &'e [Box<Expr>]) -> Option<&'e Expr> {
    let at = usize::from(name == "quantile_over_time");
    args.get(at).map(|a| &**a)
}

/// `name(args)` for a range function, series by series where it is
/// evaluated from raw samples. `group`: an aggregation's labels to read
/// its matrix selector's series with instead of all of them (see
/// [`Keep::Group`]), for an aggregation straight over the function; the
/// caller makes sure that those sets need no check for duplicates.
pub(super) fn range_series(
    ev: &Evaluator<'_>,
    name: &str,
    args: &[Box<Expr>],
    group: Option<Keep<'_>>,
) -> Result<RangeValue> {
    let (range_arg, param) = match name {
        "quantile_over_time" => (
            arg(args, 1, name)?,
            Some(scalar_arg(ev, &arg(args, 0, name)?)?),
        ),
        "predict_linear" => (
            arg(args, 0, name)?,
            Some(scalar_arg(ev, &arg(args, 1, name)?)?),
        ),
        _ => (arg(args, 0, name)?, None),
    };
    if let Some(out) = super::tiers::over_tier(ev, name, &range_arg)? {
        check_unique_steps(&out, &mut LabelSetIds::default())?;
        return Ok(RangeValue::Steps(out));
    }
    let Some(f) = RangeFn::of(name) else {
        return Err(unsupported(&format!("{name}() over a range")));
    };
    let keep_name = f == RangeFn::Last;
    let keep = group.unwrap_or(if keep_name {
        Keep::Named
    } else {
        Keep::Unnamed
    });
    let param = param.as_deref();
    let steps = &ev.steps;
    // A matrix selector's series are reduced as they are read.
    if let Some(sel) = ev.matrix_selection(&range_arg)? {
        let input = &sel.input;
        let out = ev.reduce_series(&sel.series, sel.window, sel.work, false, keep, |s| {
            series_points(f, s, input, steps, param, keep_name)
        })?;
        ev.account(out.iter().map(|(_, p)| p.len()).sum())?;
        return Ok(RangeValue::Series(out));
    }
    let mut input = ev.range_input_as(&range_arg, keep)?;
    let work: usize = input.series.iter().map(|s| s.ts.len()).sum();
    let series = std::mem::take(&mut input.series);
    let input = &input;
    // Series by series, across cores: each one's label set and points.
    let per_series = super::parallel::map_owned(series, work, |s| {
        series_points(f, &s, input, steps, param, keep_name)
    });
    ev.account(per_series.iter().map(|(_, p)| p.len()).sum())?;
    Ok(RangeValue::Series(per_series))
}

/// `f` over one series' windows at the query's steps: its label set and
/// a point for each step whose window holds samples (and gives a value).
fn series_points(
    f: RangeFn,
    s: &RawSeries,
    input: &RangeInput,
    steps: &[i64],
    param: Option<&[f64]>,
    keep_name: bool,
) -> SelectedPoints {
    let labels = if keep_name {
        s.labels.clone()
    } else {
        drop_name(&s.labels)
    };
    let mut points: Vec<(u32, f64)> = Vec::new();
    let mut at = super::value::WindowCursor::default();
    // For a counter's rate, how many times it fell before each sample:
    // a window without a fall (most of them) skips the search for one.
    let falls = counter_falls(f, &s.vs);
    // Only the steps whose window can hold one of the series' samples.
    let reach = match (s.ts.first(), s.ts.last()) {
        (Some(&first), Some(&last)) => super::value::steps_reaching(
            steps,
            |t| input.reference(t),
            input.range_ms,
            (first, last),
        ),
        _ => return (labels, points),
    };
    // A point for each step reached, at most (see `selector_points`).
    points.reserve_exact(reach.len());
    for (i, &t) in steps.iter().enumerate().take(reach.end).skip(reach.start) {
        let reference = input.reference(t);
        let (lo, hi) = input.next_window(s, reference, &mut at);
        if hi == lo {
            continue;
        }
        let w = RawWindow {
            ts: &s.ts[lo..hi],
            vs: &s.vs[lo..hi],
            may_fall: falls.within(lo, hi),
        };
        let v = range_value(
            f,
            &w,
            reference - input.range_ms,
            reference,
            param.map(|p| p[i]),
            t,
        );
        if let Some(v) = v {
            points.push((i as u32, v));
        }
    }
    super::eval::shrink_if_sparse(&mut points);
    (labels, points)
}

struct RawWindow<'a> {
    ts: &'a [i64],
    vs: &'a [f64],
    /// Whether a value may be below the one before it (false: known not to).
    may_fall: bool,
}

/// For `rate` and `increase`, the number of times a series' values fell
/// before each of its samples; `None` for other functions, and where they
/// never fall (no window then needs to look for a reset).
struct Falls(Option<Vec<u32>>);

fn counter_falls(f: RangeFn, vs: &[f64]) -> Falls {
    if !matches!(f, RangeFn::Rate | RangeFn::Increase) || never_falls(vs) {
        return Falls(None);
    }
    let mut n = 0u32;
    let mut falls = Vec::with_capacity(vs.len());
    falls.push(0);
    for p in vs.windows(2) {
        n += u32::from(p[1] < p[0]);
        falls.push(n);
    }
    Falls(Some(falls))
}

/// Whether every value is at least the one before it (a NaN makes it
/// false; [`counter_falls`] then counts the falls one by one). Checked a
/// block at a time without stopping at the first fall, which the compiler
/// turns into vector compares; stopping early ran a sample at a time, 4 %
/// of a 1,000-series `rate` query (`perf`).
fn never_falls(vs: &[f64]) -> bool {
    const BLOCK: usize = 64;
    let Some(next) = vs.get(1..) else {
        return true;
    };
    vs.chunks(BLOCK)
        .zip(next.chunks(BLOCK))
        .all(|(a, b)| a.iter().zip(b).fold(true, |ok, (x, y)| ok & (y >= x)))
}

impl Falls {
    /// Whether a value of samples `lo..hi` may be below the one before it.
    fn within(&self, lo: usize, hi: usize) -> bool {
        self.0.as_ref().is_some_and(|f| f[hi - 1] != f[lo])
    }
}

fn range_value(
    f: RangeFn,
    w: &RawWindow<'_>,
    range_start: i64,
    range_end: i64,
    param: Option<f64>,
    eval_ms: i64,
) -> Option<f64> {
    let (ts, vs) = (w.ts, w.vs);
    let n = vs.len();
    Some(match f {
        RangeFn::Rate => return extrapolated_rate(w, range_start, range_end, true, true),
        RangeFn::Increase => return extrapolated_rate(w, range_start, range_end, true, false),
        RangeFn::Delta => return extrapolated_rate(w, range_start, range_end, false, false),
        RangeFn::Irate => return instant_value(ts, vs, true),
        RangeFn::Idelta => return instant_value(ts, vs, false),
        RangeFn::Deriv => {
            if n < 2 {
                return None;
            }
            linear_regression(ts, vs, ts[0]).0
        }
        RangeFn::PredictLinear => {
            if n < 2 {
                return None;
            }
            let (slope, intercept) = linear_regression(ts, vs, eval_ms);
            slope * param.unwrap_or(f64::NAN) + intercept
        }
        RangeFn::Changes | RangeFn::Resets => {
            let mut count = 0.0;
            for pair in vs.windows(2) {
                let (prev, cur) = (pair[0], pair[1]);
                let hit = if f == RangeFn::Changes {
                    cur != prev && !(cur.is_nan() && prev.is_nan())
                } else {
                    cur < prev
                };
                if hit {
                    count += 1.0;
                }
            }
            count
        }
        RangeFn::Avg => {
            // The compensated sum over the count, unless the sum overflows:
            // then Prometheus 2.42's running mean, which does not. (2.42
            // keeps the running mean throughout, two divisions a sample;
            // Prometheus 3 divides the sum as here. The two differ in the
            // last bits.)
            let (mut sum, mut c) = (0.0f64, 0.0);
            for &v in vs {
                (sum, c) = kahan_inc(v, sum, c);
            }
            if sum.is_finite() {
                return Some((sum + c) / n as f64);
            }
            let (mut mean, mut count, mut c) = (0.0f64, 0.0, 0.0);
            for &v in vs {
                count += 1.0;
                if mean.is_infinite() {
                    if v.is_infinite() && (mean > 0.0) == (v > 0.0) {
                        continue;
                    }
                    if !v.is_infinite() && !v.is_nan() {
                        continue;
                    }
                }
                (mean, c) = kahan_inc(v / count - mean / count, mean, c);
            }
            if mean.is_infinite() { mean } else { mean + c }
        }
        RangeFn::Sum => {
            let (mut sum, mut c) = (0.0f64, 0.0);
            for &v in vs {
                (sum, c) = kahan_inc(v, sum, c);
            }
            if sum.is_infinite() { sum } else { sum + c }
        }
        RangeFn::Count => n as f64,
        RangeFn::Present => 1.0,
        RangeFn::Last => vs[n - 1],
        RangeFn::Min | RangeFn::Max => {
            let mut m = vs[0];
            for &v in vs {
                let better = if f == RangeFn::Max { v > m } else { v < m };
                if better || m.is_nan() {
                    m = v;
                }
            }
            m
        }
        RangeFn::Stddev | RangeFn::Stdvar => {
            let (mut count, mut mean, mut cmean, mut aux, mut caux) = (0.0, 0.0, 0.0, 0.0, 0.0);
            for &v in vs {
                count += 1.0;
                let delta = v - (mean + cmean);
                (mean, cmean) = kahan_inc(delta / count, mean, cmean);
                (aux, caux) = kahan_inc(delta * (v - (mean + cmean)), aux, caux);
            }
            let var = (aux + caux) / count;
            if f == RangeFn::Stddev {
                var.sqrt()
            } else {
                var
            }
        }
        RangeFn::Quantile => quantile(param.unwrap_or(f64::NAN), &mut vs.to_vec()),
    })
}

/// Go's `math.Max`: NaN wins.
fn go_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

/// Go's `math.Min`: NaN wins.
fn go_min(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.min(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The blockwise check agrees with a pairwise one on every prefix of
    /// rising values with one fall or one NaN placed across the blocks.
    #[test]
    fn never_falls_agrees_with_a_pairwise_check() {
        let pairwise = |vs: &[f64]| vs.windows(2).all(|p| p[1] >= p[0]);
        let rising: Vec<f64> = (0..200).map(|i| f64::from(i / 2)).collect();
        for len in 0..rising.len() {
            assert!(never_falls(&rising[..len]), "len {len}");
            for at in 0..len {
                for odd in [-1.0, f64::NAN] {
                    let mut vs = rising[..len].to_vec();
                    vs[at] = odd;
                    assert_eq!(never_falls(&vs), pairwise(&vs), "len {len} at {at} {odd}");
                }
            }
        }
        assert!(!never_falls(&[1.0, f64::NAN]) && !never_falls(&[f64::NAN, 1.0]));
    }

    /// A window that `counter_falls` says holds no fall gives the rate and
    /// increase of the full search for resets, over every window of
    /// counters with resets, repeated values and NaNs.
    #[test]
    fn windows_without_a_fall_skip_the_search_and_agree_with_it() {
        let mut x = 5u64;
        let mut vs = Vec::new();
        let mut v = 100.0;
        for i in 0..400 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            match (x >> 58, i % 50) {
                (0, _) => v = (x >> 40) as f64 / 1e6,
                (1, _) => {}
                (_, 7) => v = f64::NAN,
                _ => {
                    v = if v.is_nan() {
                        1.0
                    } else {
                        v + (x >> 44) as f64 / 1e3
                    }
                }
            }
            vs.push(v);
        }
        let ts: Vec<i64> = (0..vs.len() as i64).map(|i| i * 10_000).collect();
        let falls = counter_falls(RangeFn::Rate, &vs);
        assert!(falls.0.is_some());
        assert!(counter_falls(RangeFn::Delta, &vs).0.is_none());
        let rising = counter_falls(RangeFn::Increase, &[1.0, 1.0, 2.0, 5.0]);
        assert!(rising.0.is_none());
        assert!(!rising.within(0, 4) && !rising.within(1, 3));
        let mut skipped = 0;
        for lo in 0..vs.len() {
            for hi in (lo + 1..=vs.len()).step_by(7) {
                let may_fall = falls.within(lo, hi);
                let window = |may_fall| RawWindow {
                    ts: &ts[lo..hi],
                    vs: &vs[lo..hi],
                    may_fall,
                };
                let full = window(true);
                let fast = window(may_fall);
                // Where the counter falls inside, the search must run.
                let falls_inside = vs[lo..hi].windows(2).any(|p| p[1] < p[0]);
                assert_eq!(may_fall, falls_inside, "window {lo}..{hi}");
                skipped += usize::from(!may_fall);
                for is_rate in [true, false] {
                    let start = ts[lo] - 5_000;
                    let end = ts[hi - 1] + 3_000;
                    let rate = |w: &RawWindow<'_>| extrapolated_rate(w, start, end, true, is_rate);
                    let (a, b) = (rate(&full), rate(&fast));
                    assert_eq!(
                        a.map(f64::to_bits),
                        b.map(f64::to_bits),
                        "window {lo}..{hi}"
                    );
                }
            }
        }
        assert!(skipped > 1000, "{skipped} windows without a fall");
    }

    /// The window's rate by Prometheus's steps alone (a division at a
    /// time, as `extrapolatedRate` has them).
    fn by_prometheus_steps(
        w: &RawWindow<'_>,
        start: i64,
        end: i64,
        is_counter: bool,
        is_rate: bool,
    ) -> Option<f64> {
        let (ts, vs) = (w.ts, w.vs);
        if ts.len() < 2 {
            return None;
        }
        let mut result = vs[vs.len() - 1] - vs[0];
        if is_counter {
            for p in vs.windows(2) {
                if p[1] < p[0] {
                    result += p[0];
                }
            }
        }
        let mut to_start = (ts[0] - start) as f64 / 1000.0;
        let to_end = (end - ts[ts.len() - 1]) as f64 / 1000.0;
        let sampled = (ts[ts.len() - 1] - ts[0]) as f64 / 1000.0;
        let avg = sampled / (ts.len() - 1) as f64;
        if is_counter && result > 0.0 && vs[0] >= 0.0 {
            to_start = to_start.min(sampled * (vs[0] / result));
        }
        let threshold = avg * 1.1;
        let mut interval = sampled;
        interval += if to_start < threshold {
            to_start
        } else {
            avg / 2.0
        };
        interval += if to_end < threshold {
            to_end
        } else {
            avg / 2.0
        };
        let mut v = result * (interval / sampled);
        if is_rate {
            v /= (end - start) as f64 / 1000.0;
        }
        Some(v)
    }

    fn assert_same_bits(got: Option<f64>, want: Option<f64>, what: &str) {
        assert_eq!(got.map(f64::to_bits), want.map(f64::to_bits), "{what}");
    }

    /// Comparisons made on milliseconds multiplied out decide as
    /// Prometheus's divisions do, and the answers are Prometheus's to the bit:
    /// a counter at 10 s (some sample times off by a few ms, one reset, a
    /// start near zero) at a 60 s step over 5 m windows, for rate,
    /// increase and delta.
    #[test]
    fn rates_without_the_divisions_decide_as_prometheus_does() {
        // Two samples in 29 missing, so that some windows start or end far
        // from a sample and some hold fewer.
        let kept = |i: &i32| i % 29 != 11 && i % 29 != 12;
        let all_ts: Vec<i64> = (0..400)
            .map(|i| 10_000 * i64::from(i) + if i % 37 == 0 { 3 } else { 0 })
            .collect();
        let all_vs: Vec<f64> = (0..400)
            .map(|i| {
                if i < 250 {
                    0.5 + 7.25 * f64::from(i)
                } else {
                    3.0 * f64::from(i - 250)
                }
            })
            .collect();
        let (ts, vs): (Vec<i64>, Vec<f64>) = (0..400)
            .filter(kept)
            .map(|i| (all_ts[i as usize], all_vs[i as usize]))
            .unzip();
        for range in [300_000, 21_000, 33_000] {
            for (counter, is_rate) in [(true, true), (true, false), (false, false)] {
                for step in (range..4_000_000).step_by(7_001) {
                    let lo = ts.partition_point(|&t| t < step - range);
                    let hi = ts.partition_point(|&t| t <= step);
                    let w = RawWindow {
                        ts: &ts[lo..hi],
                        vs: &vs[lo..hi],
                        may_fall: true,
                    };
                    assert_same_bits(
                        extrapolated_rate(&w, step - range, step, counter, is_rate),
                        by_prometheus_steps(&w, step - range, step, counter, is_rate),
                        &format!("{range} ms at {step}"),
                    );
                }
            }
        }
        // Two windows alike but for the count of samples between the same
        // first and last: 20 s from the range's start is beyond 1.1 average
        // intervals of 10 s, not of 20 s, so the second extends further.
        let dense: Vec<i64> = (2..=30).map(|i| 10_000 * i).collect();
        let sparse: Vec<i64> = (1..=15).map(|i| 20_000 * i).collect();
        let mut answers = Vec::new();
        for times in [&dense, &sparse] {
            let values: Vec<f64> = times.iter().map(|&t| t as f64).collect();
            let w = RawWindow {
                ts: times,
                vs: &values,
                may_fall: false,
            };
            answers.push(extrapolated_rate(&w, 0, 300_000, false, false).unwrap());
        }
        // The rise 280,000 over 280 s, extended by 5 s (half of 10 s) or by
        // the 20 s to the start, to 285 s or 300 s.
        assert!(
            (answers[0] - 280_000.0 * 285.0 / 280.0).abs() < 1e-6,
            "{answers:?}"
        );
        assert!(
            (answers[1] - 280_000.0 * 300.0 / 280.0).abs() < 1e-6,
            "{answers:?}"
        );
        // By hand: 31 samples, 10 s to 310 s, of a counter rising 7.25 a
        // sample from 7.75 (its zero lies 10.7 s before the first, beyond
        // the window's start); the window [9.5 s, 310 s] reaches 0.5 s
        // before them: the rise 217.5 over 300 s, extended by 0.5 s, per
        // 300.5 s.
        let w = RawWindow {
            ts: &all_ts[1..32],
            vs: &all_vs[1..32],
            may_fall: false,
        };
        let got = extrapolated_rate(&w, 9_500, 310_000, true, true);
        let want = 217.5 * (300.5 / 300.0) / 300.5;
        assert!((got.unwrap() - want).abs() < 1e-12, "{got:?} vs {want}");
    }

    /// Where a sample lies 1.1 average intervals from an end, give or take
    /// a rounding, the product of milliseconds and Prometheus's quotients
    /// can fall on either side: 1.1 s from the start with samples 1 s
    /// apart is beyond the threshold to Prometheus (1.1 / 1000 against
    /// (3 / 1000 / 3) * 1.1) though 1,100 * 3 is below 3,000 * 1.1. Such a
    /// window is left to Prometheus's steps, which then decide.
    #[test]
    fn a_comparison_too_close_to_call_is_left_to_prometheus() {
        // A counter of subnormal values, its zero about 0.1 s before its
        // first sample: their products with whole milliseconds are exact
        // (multiples of the smallest subnormal), so the margin still holds.
        let ts: Vec<i64> = (0..40).map(|i| 1_000 + 10_000 * i).collect();
        let vs: Vec<f64> = (0..40).map(|i| f64::from(100 * i + 1) * 1e-320).collect();
        for start in [0, 900, 1_000] {
            let w = RawWindow {
                ts: &ts[..],
                vs: &vs[..],
                may_fall: false,
            };
            let end = ts[ts.len() - 1] + 900;
            for is_rate in [true, false] {
                assert_same_bits(
                    extrapolated_rate(&w, start, end, true, is_rate),
                    by_prometheus_steps(&w, start, end, true, is_rate),
                    &format!("subnormal counter from {start} ms"),
                );
            }
        }
        for (to_start, sampled, intervals) in
            [(1_100, 3_000, 3), (12_067, 76_790, 7), (3_094, 30_940, 11)]
        {
            let ts: Vec<i64> = (0..=intervals)
                .map(|i| to_start + sampled * i / intervals)
                .collect();
            let vs: Vec<f64> = (0..=intervals).map(|i| 1000.0 + 5.0 * i as f64).collect();
            let w = RawWindow {
                ts: &ts,
                vs: &vs,
                may_fall: false,
            };
            let end = ts[ts.len() - 1] + 500;
            for is_rate in [true, false] {
                let got = extrapolated_rate(&w, 0, end, true, is_rate);
                let want = by_prometheus_steps(&w, 0, end, true, is_rate);
                assert_same_bits(got, want, &format!("{to_start} ms before {sampled} ms"));
            }
        }
    }
}
