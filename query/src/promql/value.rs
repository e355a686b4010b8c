//! The values of evaluation (instant vectors, range inputs), label-set
//! helpers and the formatting of values and label sets.

use std::collections::HashMap;
use std::sync::Arc;

use super::{LabelSet, PromError};

type Result<T> = std::result::Result<T, PromError>;

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
#[derive(Debug, Default)]
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

    /// [`Self::window`] for one series at references that mostly increase
    /// (the steps of a range query): the bounds move forward from where
    /// `at` left them ([`partition_from`]), a step costing about two
    /// comparisons a bound rather than two binary searches; a reference
    /// below the last one searches anew.
    pub(super) fn next_window(
        &self,
        s: &RawSeries,
        reference: i64,
        at: &mut WindowCursor,
    ) -> (usize, usize) {
        let start = reference - self.range_ms;
        let (lo, hi) = match at.last {
            Some(last) if reference >= last => (
                partition_from(&s.ts, at.lo, &mut at.lo_moved, |t| t < start),
                partition_from(&s.ts, at.hi, &mut at.hi_moved, |t| t <= reference),
            ),
            _ => self.window(s, reference),
        };
        (at.last, at.lo, at.hi) = (Some(reference), lo, hi);
        (lo, hi.max(lo))
    }
}

/// Where [`RangeInput::next_window`] left a series: the last reference,
/// the window's bounds then, and how far each moved at that step.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct WindowCursor {
    last: Option<i64>,
    lo: usize,
    hi: usize,
    lo_moved: usize,
    hi_moved: usize,
}

/// The partition point of ascending `ts` under `before` (the number of its
/// first samples for which `before` holds), known to be at least `from`.
/// It is guessed at `from + *moved`, then walked a sample at a time to
/// where it is, and `*moved` becomes how far it is from `from`: samples
/// come at a steady interval, so a range query's step passes about as many
/// as the step before did, and a right guess costs two comparisons where
/// walking from `from` cost one per sample passed (six at a 1 m step over
/// 10 s scrapes). `from` must not be past the point: it is a point found
/// before for a `before` that held for no fewer samples.
#[inline]
pub(super) fn partition_from(
    ts: &[i64],
    from: usize,
    moved: &mut usize,
    before: impl Fn(i64) -> bool,
) -> usize {
    let mut n = from.saturating_add(*moved).min(ts.len());
    while n > from && !before(ts[n - 1]) {
        n -= 1;
    }
    while n < ts.len() && before(ts[n]) {
        n += 1;
    }
    *moved = n - from;
    n
}

/// The steps `[from, to)` whose window `[reference - range, reference]` can
/// hold one of a series' samples, which span `[first, last]`: references
/// must not decrease over `steps` (those of a range query, or one `@`
/// time). A 30-day range over a series of two hours is 3 steps of 721.
pub(super) fn steps_reaching(
    steps: &[i64],
    reference: impl Fn(i64) -> i64,
    range_ms: i64,
    (first, last): (i64, i64),
) -> std::ops::Range<usize> {
    let from = steps.partition_point(|&t| reference(t) < first);
    let to = steps.partition_point(|&t| reference(t) - range_ms <= last);
    from..to.max(from)
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

/// [`drop_name`] over the steps of an evaluation. A series keeps one shared
/// label set over all its steps, so a set met again (the same allocation)
/// gets the one set without its name made the first time: later steps
/// allocate nothing, and [`LabelSetIds`] finds the result by its address.
/// Each set met is held, so that its address is not reused meanwhile.
#[derive(Debug, Default)]
pub(super) struct NameDropper {
    of_set: HashMap<usize, (Arc<LabelSet>, Arc<LabelSet>)>,
}

impl NameDropper {
    pub(super) fn drop_name(&mut self, labels: &Arc<LabelSet>) -> Arc<LabelSet> {
        let addr = Arc::as_ptr(labels) as usize;
        if let Some((_, out)) = self.of_set.get(&addr) {
            return out.clone();
        }
        let out = drop_name(labels);
        self.of_set.insert(addr, (labels.clone(), out.clone()));
        out
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
        Ok(i) => labels[i].1 = value.into(),
        Err(_) if value.is_empty() => {}
        Err(i) => labels.insert(i, (name.into(), value.into())),
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

/// Small ids for label sets, one per distinct set of labels. A series keeps
/// one shared set over all the steps of an evaluation, so a set is found by
/// its address, and keyed by its labels only the first time: a step then
/// costs a lookup per element, not a string key. Each set met is held, so
/// that its address is not reused while the ids live.
#[derive(Debug, Default)]
pub(super) struct LabelSetIds {
    of_set: HashMap<usize, (Arc<LabelSet>, usize), foldhash::fast::RandomState>,
    of_labels: HashMap<Arc<LabelSet>, usize, foldhash::fast::RandomState>,
}

impl LabelSetIds {
    /// The id of `labels`: ids count up from 0 in the order sets are met.
    pub(super) fn id(&mut self, labels: &Arc<LabelSet>) -> usize {
        let addr = Arc::as_ptr(labels) as usize;
        if let Some(&(_, id)) = self.of_set.get(&addr) {
            return id;
        }
        let next = self.of_labels.len();
        let id = *self.of_labels.entry(labels.clone()).or_insert(next);
        self.of_set.insert(addr, (labels.clone(), id));
        id
    }
}

/// [`check_unique`] for every step of an evaluation at once, by the ids of
/// `ids` (which then hold every label set of a step of two or more).
pub(super) fn check_unique_steps(per_step: &[Vector], ids: &mut LabelSetIds) -> Result<()> {
    // The step (1-based) at which each id was last seen.
    let mut seen_at: Vec<usize> = Vec::new();
    for (i, v) in per_step.iter().enumerate() {
        if v.len() < 2 {
            continue;
        }
        for e in v {
            let id = ids.id(&e.labels);
            if id >= seen_at.len() {
                seen_at.resize(id + 1, 0);
            }
            if seen_at[id] == i + 1 {
                return Err(duplicate_labelset());
            }
            seen_at[id] = i + 1;
        }
    }
    Ok(())
}

fn duplicate_labelset() -> PromError {
    PromError::Execution("vector cannot contain metrics with the same labelset".into())
}

pub(super) fn check_unique(v: &Vector) -> Result<()> {
    if v.len() < 2 {
        return Ok(());
    }
    let mut seen = std::collections::HashSet::with_capacity(v.len());
    for e in v {
        if !seen.insert(key_of(&e.labels)) {
            return Err(duplicate_labelset());
        }
    }
    Ok(())
}

pub(super) fn valid_label_name(s: &str) -> bool {
    let mut chars = s.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return false,
    }
    chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(super) fn display(labels: &LabelSet) -> String {
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

/// Go's `strconv.FormatFloat(v, 'f', -1, 64)`, with Prometheus's spelling
/// of the non-finite values.
pub(super) fn format_value(v: f64) -> String {
    let mut s = String::new();
    write_value(&mut s, v);
    s
}

/// [`format_value`] onto `out`.
pub(super) fn write_value(out: &mut String, v: f64) {
    let mut b = Ascii::<64>::new();
    if push_value(&mut b, v) {
        b.flush(out);
    } else {
        use std::fmt::Write;
        let _ = write!(out, "{v}");
    }
}

/// ASCII text built on the stack and moved to a `String` in batches: a
/// JSON point's bytes went through eight appends to the `String`, each with
/// its capacity check and most with a call to `memcpy` (with the digits, a
/// fifth of the instructions of a 1,000-series range query, `callgrind`).
pub(super) struct Ascii<const N: usize> {
    buf: [u8; N],
    len: usize,
}

impl<const N: usize> Ascii<N> {
    pub(super) fn new() -> Self {
        Ascii {
            buf: [0; N],
            len: 0,
        }
    }

    /// Bytes free.
    pub(super) fn room(&self) -> usize {
        N - self.len
    }

    /// Bytes held.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The bytes appended since there were `start`.
    pub(super) fn since(&self, start: usize) -> &[u8] {
        &self.buf[start..self.len]
    }

    #[inline]
    pub(super) fn push(&mut self, b: u8) {
        self.buf[self.len] = b;
        self.len += 1;
    }

    /// Appends `s`: at a call site where `s` is a literal, a copy of known
    /// length.
    #[inline(always)]
    pub(super) fn extend(&mut self, s: &[u8]) {
        self.buf[self.len..self.len + s.len()].copy_from_slice(s);
        self.len += s.len();
    }

    /// Appends `text[..n]`, copying all of `text` (a copy of known length,
    /// no call) and keeping `n` bytes of it; needs `M` bytes of room.
    #[inline(always)]
    pub(super) fn extend_prefix<const M: usize>(&mut self, text: &[u8; M], n: usize) {
        self.buf[self.len..self.len + M].copy_from_slice(text);
        self.len += n;
    }

    /// The decimal digits of `x` (by `itoa`, the fastest found: digits
    /// written here two at a time with checked indexing took 2.5 times
    /// its instructions, `callgrind`; written in place from the last after
    /// counting them, two digits cost 20 instructions against `itoa`'s and
    /// its copy's 50, but the dashboard's power, clock and memory panels
    /// took 2-5 % more).
    #[inline]
    pub(super) fn push_u64(&mut self, x: u64) {
        self.extend(itoa::Buffer::new().format(x).as_bytes());
    }

    /// Moves the text to the end of `out`.
    pub(super) fn flush(&mut self, out: &mut String) {
        out.push_str(std::str::from_utf8(&self.buf[..self.len]).expect("BUG: ASCII only"));
        self.len = 0;
    }
}

/// The longest text [`push_value`] appends: a sign, 15 digits, a point
/// and six zeros after it, with room to spare.
pub(super) const VALUE_MAX: usize = 32;

/// Appends `v` as [`format_value`] writes it when that needs no
/// shortest-digits search: NaN, the infinities, whole values below 10^15
/// (most DCGM fields) and short decimals ([`push_short_decimal`]). Returns
/// false, having appended nothing, for the rest. Needs [`VALUE_MAX`] bytes
/// of room.
pub(super) fn push_value<const N: usize>(b: &mut Ascii<N>, v: f64) -> bool {
    // (`v as i64` truncates; for |v| < 10^15 it is exact, and it is `v`
    // only if `v` is whole: no call into libm for `trunc`.)
    if v.is_nan() {
        b.extend(b"NaN");
    } else if v == f64::INFINITY {
        b.extend(b"+Inf");
    } else if v == f64::NEG_INFINITY {
        b.extend(b"-Inf");
    } else if v.abs() < 1e15 && (v as i64) as f64 == v && !(v == 0.0 && v.is_sign_negative()) {
        let i = v as i64;
        if i < 0 {
            b.push(b'-');
        }
        b.push_u64(i.unsigned_abs());
    } else {
        return push_short_decimal(b, v) || push_shortest(b, v);
    }
    true
}

/// The shortest digits that read back as finite `v`, by `zmij` (a fifth
/// the time of `{}`'s Grisu and the formatter around it, `perf` of a
/// 1,000-series `rate`), where it writes them as `{}` does: in positional
/// notation and not whole (`zmij` switches to an exponent outside about
/// 1e-5..1e16 and writes whole values with `.0`; those go to `{}`), and
/// where no two shortest decimals can be equally near `v`, a tie the two
/// formatters break differently (1903930524158801.25 is `.2` to `zmij`,
/// `.3` to `{}`). A tie needs `v` to be the midpoint of two decimals of at
/// most 17 digits, so its exact decimal has at most 18; that of
/// `odd * 2^-f` has `f + floor(log10 |v|) + 1` (its last digit, the 5 of
/// 5^f, sits f places after the point). A rate or a mean has 40 or more.
fn push_shortest<const N: usize>(b: &mut Ascii<N>, v: f64) -> bool {
    if exact_digits_at_least(v) < 19 {
        return false;
    }
    let mut digits = zmij::Buffer::new();
    let s = digits.format_finite(v).as_bytes();
    if s.len() > VALUE_MAX || s.contains(&b'e') || s.ends_with(b".0") {
        return false;
    }
    b.extend(s);
    true
}

/// A lower bound of the significant digits of the exact decimal of finite,
/// non-whole `v` (see [`push_shortest`]); 0 for whole values.
fn exact_digits_at_least(v: f64) -> i64 {
    let bits = v.to_bits();
    let biased = ((bits >> 52) & 0x7ff) as i64;
    let fraction = bits & ((1 << 52) - 1);
    let (mantissa, exp) = if biased == 0 {
        (fraction, -1074)
    } else {
        (fraction | 1 << 52, biased - 1075)
    };
    if mantissa == 0 {
        return 0;
    }
    // v = odd * 2^-f
    let f = -(exp + i64::from(mantissa.trailing_zeros()));
    if f <= 0 {
        return 0;
    }
    // floor(log10 |v|) >= floor(e2 * log10 2), computed to within one.
    let e2 = exp + 63 - i64::from(mantissa.leading_zeros());
    let log10_floor = (e2 as f64 * std::f64::consts::LOG10_2).floor() as i64 - 1;
    f + log10_floor + 1
}

/// Most fractions the DCGM fields carry have a few decimal digits (power
/// in W to the milliwatt, ratios to a few places). For `v` that is the
/// double nearest to `m / 10^d` for some `d <= 6` and `|m| < 10^15`,
/// appends that decimal and returns true. Its digits are the shortest that
/// read back as `v` (what Go's `'f', -1` and Rust's `{}` write): two
/// decimals of at most 15 significant digits never round to the same
/// double, so no shorter one does, and `m / 10^d` of two exactly
/// representable integers is rounded once, as parsing the decimal is.
///
/// One test, at six places, answers for every `d`: if `v` is the double
/// nearest `m / 10^d`, then `|v| * 10^6` is within a quarter of the integer
/// `M = m * 10^(6-d)` (below 10^15 < 2^50, off by two roundings of at most
/// 2^-53 each), so rounding it gives `M`, and `M / 10^6` is `v` again (the
/// same rational, rounded once); the decimal of `M` with its trailing
/// zeros dropped is that of `m`. A test per `d` from 1 up cost about 200
/// instructions for a value with no short decimal (a rate, a mean), a third
/// of writing it (callgrind of `host_energy_rate_6h`).
fn push_short_decimal<const N: usize>(b: &mut Ascii<N>, v: f64) -> bool {
    const PLACES: usize = 6;
    const SCALE_INT: u64 = 10u64.pow(PLACES as u32);
    const SCALE: f64 = SCALE_INT as f64;
    let a = v.abs();
    if !(1e-6..1e9).contains(&a) {
        return false;
    }
    // `(a * SCALE).round()`: the product is below 10^15 + 1, so its
    // fraction is exact and rounding half away from zero needs no call into
    // libm; it fits `i64`, whose conversions are one instruction each.
    let x = a * SCALE;
    let t = x as i64;
    let m = if x - t as f64 >= 0.5 { t + 1 } else { t };
    if m >= 1_000_000_000_000_000 || m as f64 / SCALE != a {
        return false;
    }
    let m = m as u64;
    let (int, mut frac, mut digits) = (m / SCALE_INT, m % SCALE_INT, PLACES);
    if frac == 0 {
        return false;
    }
    while frac.is_multiple_of(10) {
        frac /= 10;
        digits -= 1;
    }
    if v < 0.0 {
        b.push(b'-');
    }
    b.push_u64(int);
    b.push(b'.');
    for _ in frac.ilog10() as usize + 1..digits {
        b.push(b'0');
    }
    b.push_u64(frac);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(host: &str) -> Arc<LabelSet> {
        Arc::new(vec![("host".into(), host.into())])
    }

    fn elem(labels: &Arc<LabelSet>) -> Elem {
        Elem {
            labels: labels.clone(),
            v: 1.0,
        }
    }

    /// Equal label sets in one step are refused whether they share one
    /// allocation or not; in different steps they are fine.
    #[test]
    fn one_step_holds_each_label_set_once() {
        let (a, b) = (set("a"), set("b"));
        let also_a = set("a");
        let ok = vec![
            vec![elem(&a), elem(&b)],
            vec![elem(&also_a)],
            vec![elem(&a), elem(&b)],
        ];
        check_unique_steps(&ok, &mut LabelSetIds::default()).unwrap();
        let shared = vec![vec![elem(&a)], vec![elem(&b), elem(&a), elem(&a)]];
        assert!(check_unique_steps(&shared, &mut LabelSetIds::default()).is_err());
        let copies = vec![
            vec![elem(&a), elem(&b)],
            vec![elem(&b), elem(&also_a), elem(&a)],
        ];
        assert!(check_unique_steps(&copies, &mut LabelSetIds::default()).is_err());
        for v in [&ok, &shared, &copies] {
            let per_step: Vec<bool> = v.iter().map(|s| check_unique(s).is_ok()).collect();
            assert_eq!(
                check_unique_steps(v, &mut LabelSetIds::default()).is_ok(),
                per_step.iter().all(|&ok| ok),
                "agrees with the check of each step"
            );
        }
    }

    /// Whole values take the integer path; its digits are the float
    /// formatter's (Go's 'f', -1 for these), checked on both sides of the
    /// path's bounds.
    #[test]
    fn whole_values_are_written_as_the_float_formatter_writes_them() {
        let mut x = 1u64;
        let mut cases = vec![
            0.0,
            -0.0,
            1.0,
            -1.0,
            1e15 - 1.0,
            1e15,
            -1e15,
            1e16,
            2e20,
            0.5,
            -2.5,
        ];
        for _ in 0..2000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let mag = 10f64.powi((x >> 59) as i32 + 1);
            cases.push(((x >> 11) as f64 / (1u64 << 53) as f64 * mag).round());
            cases.push(-((x >> 13) as f64));
        }
        for v in cases {
            assert_eq!(format_value(v), format!("{v}"), "{v:e}");
        }
        assert_eq!(format_value(f64::NAN), "NaN");
        assert_eq!(format_value(f64::NEG_INFINITY), "-Inf");
    }

    /// Values with a few decimals take the decimal path; its digits are
    /// the float formatter's: decimals of 1 to 9 places (those past 6 go
    /// to the formatter), sums that are not short decimals, any double
    /// from 1e-8 to 1e18 (with 16 or 17 digits, two shortest decimals can
    /// be equally near, and formatters break that tie differently: the
    /// path must leave those alone), and the bounds of the path.
    #[test]
    fn short_decimals_are_written_as_the_float_formatter_writes_them() {
        let mut x = 7u64;
        let mut cases = vec![
            0.1,
            0.2 + 0.1,
            -0.05,
            1e-6,
            9.999e-7,
            1.5e-6,
            123456.789012,
            999_999_999.5,
            1e9 + 0.5,
            0.000123,
            700.0 / 3.0,
            // Near the path's upper bound, where six places reach 10^15.
            999_999_999.999_999,
            999_999_999.999_999_5,
            999_999_999.000_001,
            0.000_002_5,
            f64::MIN_POSITIVE,
            f64::MAX,
        ];
        for _ in 0..20_000 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let places = (x >> 60) as i32 % 10;
            let int = (x >> 20) % 100_000_000;
            let v = int as f64 / 10f64.powi(places);
            cases.extend([v, -v, v * 3.0 + 0.1]);
            // A decimal of up to six places, not whole, takes the path.
            if places <= 6 && v.fract() != 0.0 {
                assert!(push_short_decimal(&mut Ascii::<64>::new(), -v), "{v}");
            }
            // Any double from 1e-8 to 1e18: the digits of rates and ratios.
            let exp = (x >> 56) as i32 % 26 - 8;
            let mantissa = 1.0 + (x >> 11) as f64 / (1u64 << 53) as f64;
            cases.extend([mantissa * 10f64.powi(exp), -mantissa / 10f64.powi(exp)]);
        }
        cases.extend([
            1e-5,
            0.99999e-5,
            1.0000000000000002e-5,
            9.999999999999998e15,
            1e16 + 2.0,
            1903930524158801.0 + 0.25,
            (1u64 << 49) as f64 - 0.0625,
            (1u64 << 49) as f64 + 0.125,
        ]);
        // Doubles with few binary places just below and above 2^49, where
        // ties between shortest decimals begin.
        for k in 0..20_000u64 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let v = ((1u64 << 53) - 1 - (x >> 12)) as f64 / f64::from(1u32 << (k % 8));
            cases.extend([v, -v]);
        }
        let mut by_zmij = 0;
        for v in cases {
            assert_eq!(format_value(v), format!("{v}"), "{v:e}");
            by_zmij += usize::from(push_shortest(&mut Ascii::<64>::new(), v));
        }
        // The shortest-digits path took most of the random doubles, and
        // left the ties alone.
        assert!(by_zmij > 30_000, "{by_zmij}");
        for tie in [1903930524158801.0 + 0.25, 11861722957775.0 + 0.5625] {
            assert!(exact_digits_at_least(tie) < 19);
            assert!(!push_shortest(&mut Ascii::<64>::new(), tie));
        }
        assert!(exact_digits_at_least(700.0 / 3.0) >= 19);
    }

    /// The name goes, once per set: the same set gets the same result
    /// (one allocation), equal sets apart get equal results.
    #[test]
    fn names_are_dropped_once_per_label_set() {
        let named = |host: &str| {
            Arc::new(vec![
                ("__name__".into(), "m".into()),
                ("host".into(), host.into()),
            ])
        };
        let (a, also_a, unnamed) = (named("a"), named("a"), set("b"));
        let mut d = NameDropper::default();
        let first = d.drop_name(&a);
        assert_eq!(*first, vec![("host".into(), "a".into())]);
        assert!(Arc::ptr_eq(&first, &d.drop_name(&a)));
        let other = d.drop_name(&also_a);
        assert_eq!(other, first);
        assert!(!Arc::ptr_eq(&first, &other));
        assert!(Arc::ptr_eq(&d.drop_name(&unnamed), &unnamed));
    }

    /// Moving the bounds forward gives the windows that two binary
    /// searches give, with gaps, repeated timestamps in the references,
    /// references that go back, and windows before and after the samples.
    #[test]
    fn sliding_windows_are_the_searched_ones() {
        let ts: Vec<i64> = (0..200i64).map(|i| i * 10 + (i / 7) * 35).collect();
        let s = RawSeries {
            labels: set("a"),
            vs: vec![0.0; ts.len()],
            ts,
        };
        for range_ms in [0, 1, 10, 95, 300, 5000] {
            let input = RangeInput {
                series: Vec::new(),
                range_ms,
                offset_ms: 0,
                at_ms: None,
            };
            let mut at = WindowCursor::default();
            let mut reference = -400i64;
            let mut x = 17u64;
            for _ in 0..500 {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                // Forward by 0-40 ms mostly; back by up to 200 ms now and then.
                let step = (x >> 40) as i64 % 41;
                reference += if (x >> 20).is_multiple_of(13) {
                    -5 * step
                } else {
                    step
                };
                assert_eq!(
                    input.next_window(&s, reference, &mut at),
                    input.window(&s, reference),
                    "range {range_ms}, reference {reference}"
                );
            }
            assert!(reference > 3000, "the references passed the samples");
        }
    }

    /// Wherever the guess lands (short of the point, past it, past the
    /// end) and with repeated times, the point is `partition_point`'s.
    #[test]
    fn a_partition_from_a_guess_is_the_searched_one() {
        let ts: Vec<i64> = [0, 0, 5, 10, 10, 10, 20, 31, 40, 40].to_vec();
        for r in -1..=41 {
            let want = ts.partition_point(|&t| t <= r);
            for from in 0..=want {
                for guess in [0, 1, 2, 3, 5, 9, 10, 11, usize::MAX] {
                    let mut moved = guess;
                    let got = partition_from(&ts, from, &mut moved, |t| t <= r);
                    assert_eq!(got, want, "r {r}, from {from}, guess {guess}");
                    assert_eq!(moved, want - from);
                }
            }
        }
        assert_eq!(partition_from(&[], 0, &mut 4, |_| true), 0);
    }

    /// Integers of every length, between other text.
    #[test]
    fn integers_are_written_at_every_length() {
        let mut cases: Vec<u64> = (0..100_000).chain([u64::MAX, u64::MAX - 1]).collect();
        for k in 1..20 {
            let p = 10u64.pow(k);
            cases.extend([p - 1, p, p + 1, p + p / 2, p + p / 10 * 7 + 3]);
        }
        for x in cases {
            let mut b = Ascii::<64>::new();
            b.push(b'<');
            b.push_u64(x);
            b.push(b'>');
            let mut out = String::new();
            b.flush(&mut out);
            assert_eq!(out, format!("<{x}>"));
        }
    }
}
