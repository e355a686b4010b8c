//! Reading the filters DataFusion offers a table scan: shared by the tables
//! over storage ([`crate::samples`], [`crate::rollups`]).

use datafusion::common::ScalarValue;
use datafusion::logical_expr::{Between, BinaryExpr, Expr, Operator};

/// One comparison a table may use to skip data: `column op literal`, with
/// the operator turned around when the literal was on the left.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Comparison<'a> {
    pub column: &'a str,
    pub op: Operator,
    pub literal: &'a ScalarValue,
}

/// The comparisons in the conjunction `e`, and whether that is all of it
/// (false if some conjunct is something else: an OR, a function call, two
/// columns compared). Narrowing a scan by the comparisons found is correct
/// either way; only when it is all of `e` may the filter count as pushed.
/// `BETWEEN` becomes two comparisons.
pub(crate) fn comparisons(e: &Expr) -> (Vec<Comparison<'_>>, bool) {
    let mut out = Vec::new();
    let all = collect(e, &mut out);
    (out, all)
}

fn collect<'a>(e: &'a Expr, out: &mut Vec<Comparison<'a>>) -> bool {
    match e {
        Expr::BinaryExpr(BinaryExpr { left, op, right }) if *op == Operator::And => {
            // Both sides, even when the left one is not understood.
            let l = collect(left, out);
            let r = collect(right, out);
            l && r
        }
        Expr::BinaryExpr(BinaryExpr { left, op, right }) => {
            match (column_of(left), literal_of(right)) {
                (Some(column), Some(literal)) => {
                    out.push(Comparison {
                        column,
                        op: *op,
                        literal,
                    });
                    true
                }
                _ => match (column_of(right), literal_of(left), op.swap()) {
                    (Some(column), Some(literal), Some(op)) => {
                        out.push(Comparison {
                            column,
                            op,
                            literal,
                        });
                        true
                    }
                    _ => false,
                },
            }
        }
        Expr::Between(Between {
            expr,
            negated: false,
            low,
            high,
        }) => match (column_of(expr), literal_of(low), literal_of(high)) {
            (Some(column), Some(lo), Some(hi)) => {
                out.push(Comparison {
                    column,
                    op: Operator::GtEq,
                    literal: lo,
                });
                out.push(Comparison {
                    column,
                    op: Operator::LtEq,
                    literal: hi,
                });
                true
            }
            _ => false,
        },
        _ => false,
    }
}

/// The column an expression reads, looking through casts (which are
/// monotonic for timestamps and identity-like for strings).
pub(crate) fn column_of(e: &Expr) -> Option<&str> {
    match e {
        Expr::Column(c) => Some(&c.name),
        Expr::Cast(c) => column_of(&c.expr),
        Expr::TryCast(c) => column_of(&c.expr),
        _ => None,
    }
}

pub(crate) fn literal_of(e: &Expr) -> Option<&ScalarValue> {
    match e {
        Expr::Literal(v, _) => Some(v),
        _ => None,
    }
}

/// The text of a string literal.
pub(crate) fn string_of(v: &ScalarValue) -> Option<&str> {
    match v {
        ScalarValue::Utf8(Some(s))
        | ScalarValue::Utf8View(Some(s))
        | ScalarValue::LargeUtf8(Some(s)) => Some(s),
        _ => None,
    }
}

/// A timestamp literal as a millisecond range `[floor, ceil]` that contains it.
pub(crate) fn timestamp_ms_bounds(v: &ScalarValue) -> Option<(i64, i64)> {
    let (raw, per_ms): (i64, i64) = match v {
        ScalarValue::TimestampSecond(Some(s), _) => {
            return Some((s.saturating_mul(1000), s.saturating_mul(1000)));
        }
        ScalarValue::TimestampMillisecond(Some(v), _) => (*v, 1),
        ScalarValue::TimestampMicrosecond(Some(v), _) => (*v, 1_000),
        ScalarValue::TimestampNanosecond(Some(v), _) => (*v, 1_000_000),
        _ => return None,
    };
    Some((
        raw.div_euclid(per_ms),
        raw.div_euclid(per_ms) + i64::from(raw.rem_euclid(per_ms) != 0),
    ))
}

/// A closed millisecond range narrowed by comparisons on a timestamp column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimeRange {
    pub min_ts: i64,
    pub max_ts: i64,
}

impl Default for TimeRange {
    fn default() -> Self {
        Self {
            min_ts: i64::MIN,
            max_ts: i64::MAX,
        }
    }
}

impl TimeRange {
    /// Narrows the range by `ts op literal`; false if not understood.
    pub(crate) fn absorb(&mut self, op: Operator, lit: &ScalarValue) -> bool {
        let Some((lo_ms, hi_ms)) = timestamp_ms_bounds(lit) else {
            return false;
        };
        // A whole millisecond excludes itself from a strict bound.
        let whole = lo_ms == hi_ms;
        match op {
            Operator::Gt if whole => self.min_ts = self.min_ts.max(lo_ms.saturating_add(1)),
            Operator::Lt if whole => self.max_ts = self.max_ts.min(hi_ms.saturating_sub(1)),
            Operator::Gt | Operator::GtEq => self.min_ts = self.min_ts.max(lo_ms),
            Operator::Lt | Operator::LtEq => self.max_ts = self.max_ts.min(hi_ms),
            Operator::Eq => {
                self.min_ts = self.min_ts.max(lo_ms);
                self.max_ts = self.max_ts.min(hi_ms);
            }
            _ => return false,
        }
        true
    }

    /// Whether `ts op literal` selects exactly the whole milliseconds of the
    /// range [`Self::absorb`] narrows to: a comparison with a literal that is
    /// a whole millisecond (a finer one lies between two, and how it compares
    /// with a millisecond column depends on the cast).
    pub(crate) fn is_exact(op: Operator, lit: &ScalarValue) -> bool {
        matches!(
            op,
            Operator::Gt | Operator::GtEq | Operator::Lt | Operator::LtEq | Operator::Eq
        ) && timestamp_ms_bounds(lit).is_some_and(|(lo, hi)| lo == hi)
    }

    /// `[a, b]` as RFC 3339 for plan displays; open ends as `-inf`/`+inf`.
    pub(crate) fn display(&self) -> String {
        let end = |ms: i64, open: &str| {
            if ms == i64::MIN || ms == i64::MAX {
                return open.to_string();
            }
            format_ms(ms)
        };
        format!(
            "[{}, {}]",
            end(self.min_ts, "-inf"),
            end(self.max_ts, "+inf")
        )
    }
}

/// A millisecond timestamp in RFC 3339, UTC (`2026-11-30T10:00:00Z`, with
/// fractional seconds only when there are some).
pub(crate) fn format_ms(ms: i64) -> String {
    match arrow::temporal_conversions::timestamp_ms_to_datetime(ms) {
        Some(t) => t.format("%Y-%m-%dT%H:%M:%S%.fZ").to_string(),
        None => ms.to_string(),
    }
}
