//! PromQL over rollup tiers: `sum_over_time`, `count_over_time`,
//! `avg_over_time`, `min_over_time` and `max_over_time` of a selector over
//! `[1h]` (or `[1d]`), evaluated at times on the tier's window boundaries
//! (an instant query at a whole hour, a range query whose start and step
//! are whole hours), are answered from the gpu-level 1-hour (1-day) rollup
//! records instead of the raw samples: exactly where raw data exists, and
//! with a warning where it has expired.
//!
//! PromQL's window at `t` is `[t - 1h, t]` (closed, as in Prometheus 2.42);
//! the record's is `[t - 1h, t)`. They hold the same samples when no sample
//! lies on `t`, which the records tell: a record whose `first` timestamp is
//! its window's start has one there. The tier asks that of every window of
//! the query and the one after it (a sample on a boundary between two
//! reference times would count in both raw windows).
//!
//! The raw cut (`storage::Storage::raw_cut`) splits a query's windows in
//! two. Those that start at or after it have every raw sample; they are
//! answered from the tier, with the raw path's result, when for the whole
//! query:
//!
//! - every reference time is a window boundary (offset included, no `@`);
//! - this node answers alone (not a cluster);
//! - reading the raw samples costs more than reading the tier: the groups
//!   of the rollup blocks it decodes and the head series it visits
//!   (`Storage::rollup_read_cost`), against the selected series' samples
//!   (a few hours of one rack read faster raw; thirty days do not);
//! - each selected series is alone in its gpu-level group (metric, cluster,
//!   row, rack, host, gpu) among all the series of its metric with samples
//!   in those windows, so that the group's record is the series';
//! - no record of theirs has a sample on a window boundary, nor a NaN (a
//!   staleness marker, which the raw path drops, is a NaN).
//!
//! Windows that start before the raw cut have lost raw samples to retention
//! (the cut is the minute after the newest dropped one). When every matcher
//! of the selector is on `__name__` or a label the groups keep (`cluster`,
//! `row`, `rack`, `Hostname`, `gpu`), they are answered from the records of
//! the groups it matches, as the tier has them: windows `[t - 1h, t)`, one
//! series per GPU, which carries the labels of its series in the later
//! windows if it has one there and the group's labels otherwise. A record
//! holding a NaN gives no point. The answer then carries a note (shown as a
//! warning by the HTTP API, `Answer::notes`) that says where raw data ends.
//! Otherwise the raw path runs, and the note says that its answer misses
//! the expired samples.
//!
//! Where the live windows' conditions fail, the raw path runs, as before.
//! Tier answers are the raw path's, up to the rounding of sums: records add plainly, the raw path with Kahan
//! compensation (the differential test allows 1e-12 relative). Imported
//! rollup history (`Storage::import_rollups`) over windows that also have
//! raw data is counted by the tier and not by the raw path; imports are
//! meant for history before the raw data. Each answer from a tier counts
//! in `gpulse_promql_rollup_tier_answers_total`.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use promql_parser::parser::Expr;
use storage::{
    Label, Matcher, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier, SeriesKey,
    Storage,
};

use super::eval::{Evaluator, ms, offset_ms};
use super::value::{Elem, Vector, drop_name};
use super::{LabelSet, PromError, labels_of};

type Result<T> = std::result::Result<T, PromError>;

/// The functions a tier answers: each is a function of count, sum, min and max.
const FUNCTIONS: [&str; 5] = [
    "sum_over_time",
    "count_over_time",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
];

/// The labels a gpu-level group keeps, as a series carries them.
const GROUP_LABELS: [&str; 5] = ["cluster", "row", "rack", "Hostname", "gpu"];

/// `name(arg)` from a rollup tier, or `None` where the raw path must run
/// (see the module docs).
pub(super) fn over_tier(ev: &Evaluator<'_>, name: &str, arg: &Expr) -> Result<Option<Vec<Vector>>> {
    if !FUNCTIONS.contains(&name) {
        return Ok(None);
    }
    let Some(storage) = ev.tier_storage() else {
        return Ok(None);
    };
    let mut arg = arg;
    while let Expr::Paren(p) = arg {
        arg = &p.expr;
    }
    let Expr::MatrixSelector(sel) = arg else {
        return Ok(None);
    };
    if sel.vs.at.is_some() {
        return Ok(None);
    }
    let w = ms(sel.range);
    let Some(tier) = [RollupTier::Hour, RollupTier::Day]
        .into_iter()
        .find(|t| t.window_ms() == w)
    else {
        return Ok(None);
    };
    let off = offset_ms(&sel.vs.offset);
    let refs: Vec<i64> = ev.steps.iter().map(|&t| t - off).collect();
    if refs.is_empty() || refs.iter().any(|&r| r.rem_euclid(w) != 0) {
        return Ok(None);
    }
    let matchers = Evaluator::matchers(&sel.vs)?;
    let raw_cut = storage.raw_cut();
    // Reference times ascend: the first `expired` windows start before
    // the raw cut.
    let expired = refs.partition_point(|&r| r - w < raw_cut);
    let plan = Plan {
        name,
        w,
        tier,
        refs: &refs,
        expired,
    };
    let answer = plan.answer(ev, storage, &matchers)?;
    if expired > 0 {
        let end = chrono::DateTime::from_timestamp_millis(raw_cut)
            .map_or_else(|| raw_cut.to_string(), |t| t.to_rfc3339());
        let what = tier.label();
        ev.note(match answer {
            Some(_) => format!(
                "raw samples before {end} have expired: {name} over the windows before it is answered from the gpu-level {what} rollups (windows [t-{what}, t), one series per GPU)"
            ),
            None => format!(
                "raw samples before {end} have expired: {name} over the windows before it misses them (the {what} rollups answer only selectors on __name__, cluster, row, rack, Hostname and gpu, with the later windows answerable from them)"
            ),
        });
    }
    if answer.is_some() {
        ev.tier_answered();
    }
    Ok(answer)
}

/// One tier-shaped range function: its reference times, the first
/// `expired` of which have windows before the raw cut.
struct Plan<'q> {
    name: &'q str,
    w: i64,
    tier: RollupTier,
    refs: &'q [i64],
    expired: usize,
}

impl Plan<'_> {
    fn answer(
        &self,
        ev: &Evaluator<'_>,
        storage: &Storage,
        matchers: &[Matcher],
    ) -> Result<Option<Vec<Vector>>> {
        let (w, refs) = (self.w, self.refs);
        let live = &refs[self.expired..];
        if self.expired > 0 && !matchers.iter().all(|m| on_group_label(m.name())) {
            return Ok(None);
        }
        // The windows of the live steps, and the one after the last (whose
        // first sample must not be on the last reference time).
        let lo = refs[0] - w;
        let hi = refs[refs.len() - 1] + w - 1;
        let selected = match live.first() {
            Some(&first) => storage.select(matchers, first - w, hi),
            None => Vec::new(),
        };
        if selected.is_empty() && self.expired == 0 {
            return Ok(None);
        }
        let metrics: BTreeSet<&str> = selected.iter().map(|s| s.key.metric()).collect();
        // Raw samples read faster than the tier where they are fewer than
        // the groups the tier would decode and visit (a few hours of a few
        // series), when every window has them.
        if self.expired == 0 {
            let raw: usize = selected.iter().map(|s| s.max_samples()).sum();
            let tier: usize = metrics
                .iter()
                .map(|m| storage.rollup_read_cost(self.tier, RollupLevel::Gpu, Some(m), lo, hi))
                .sum();
            if raw <= tier {
                return Ok(None);
            }
        }
        // Each selected series alone in its group among its metric's series
        // in the live windows.
        // A series in the group of a selected one has its values of the
        // labels a group takes from one label name only (not the host's,
        // `Hostname` or `hostname`): the selector's equalities on those
        // narrow the count. The records are narrowed by all of them, the
        // host's included, as the groups of the selected series and the
        // groups the expired windows match have them.
        let equal = |label: &str| {
            matchers.iter().find_map(|m| match m {
                Matcher::Equal { name, value } if name == label && !value.is_empty() => {
                    Some(value.clone())
                }
                _ => None,
            })
        };
        let narrow: Vec<Matcher> = ["cluster", "row", "rack", "gpu"]
            .into_iter()
            .filter_map(|l| equal(l).map(|v| Matcher::equal(l, v)))
            .collect();
        let mut members: HashMap<RollupGroup, usize> = HashMap::new();
        if let Some(&first) = live.first() {
            for &m in &metrics {
                let mut same_groups = vec![Matcher::equal("__name__", m)];
                same_groups.extend(narrow.iter().cloned());
                for s in storage.select(&same_groups, first - w, hi) {
                    *members.entry(RollupGroup::of_series(&s.key)).or_default() += 1;
                }
            }
        }
        let mut series: HashMap<RollupGroup, Arc<LabelSet>> = HashMap::new();
        for s in &selected {
            let g = RollupGroup::of_series(&s.key);
            if members.get(&g) != Some(&1) {
                return Ok(None);
            }
            series.insert(g, drop_name(&Arc::new(labels_of(&s.key))));
        }
        // The records: of the selected series' metrics for the live windows;
        // of the metric the selector names (or all) for the expired ones.
        let mut filters: Vec<Option<String>> =
            metrics.iter().map(|m| Some(m.to_string())).collect();
        if self.expired > 0 {
            let named = matchers.iter().find_map(|m| match m {
                Matcher::Equal { name, value } if name == "__name__" => Some(value.clone()),
                _ => None,
            });
            if named.as_ref().is_none_or(|n| !metrics.contains(n.as_str())) {
                filters.push(named);
            }
        }
        let mut records: HashMap<RollupGroup, Vec<RollupRecord>> = HashMap::new();
        let mut read = 0usize;
        for metric in filters {
            let filter = RollupFilter {
                metric,
                cluster: equal("cluster"),
                row: equal("row"),
                rack: equal("rack"),
                host: equal("Hostname"),
                gpu: equal("gpu"),
            };
            for (g, rs) in storage.select_rollups(self.tier, RollupLevel::Gpu, &filter, lo, hi) {
                read += rs.len();
                records.insert(g, rs);
            }
        }
        ev.account(read)?;
        if let Some(&first) = live.first() {
            let exact = |r: &RollupRecord| {
                r.window_start_ms < first - w || (r.first_ts_ms != r.window_start_ms && !has_nan(r))
            };
            if !series
                .keys()
                .filter_map(|g| records.get(g))
                .flatten()
                .all(exact)
            {
                return Ok(None);
            }
        }
        // The answering groups, in label order: the records came in hash
        // order, and each step's elements go in label order, as raw
        // evaluation gives them, so that what aggregates them adds in one
        // order every time.
        let mut rows: Vec<(Arc<LabelSet>, bool, &Vec<RollupRecord>)> = Vec::new();
        for (g, rs) in &records {
            let (labels, live) = match series.get(g) {
                Some(l) => (l.clone(), true),
                None if self.expired > 0 => match group_key(g) {
                    Some(k) if matchers.iter().all(|m| m.matches(&k)) => {
                        (drop_name(&Arc::new(labels_of(&k))), false)
                    }
                    _ => continue,
                },
                None => continue,
            };
            rows.push((labels, live, rs));
        }
        rows.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out: Vec<Vector> = vec![Vec::new(); refs.len()];
        let mut produced = 0usize;
        for (labels, live, rs) in rows {
            let steps = if live { 0..refs.len() } else { 0..self.expired };
            for i in steps {
                let Ok(k) = rs.binary_search_by_key(&(refs[i] - w), |x| x.window_start_ms) else {
                    continue;
                };
                let x = &rs[k];
                if has_nan(x) {
                    continue;
                }
                out[i].push(Elem {
                    labels: labels.clone(),
                    v: self.value(x),
                });
                produced += 1;
            }
        }
        ev.account(produced)?;
        Ok(Some(out))
    }

    fn value(&self, x: &RollupRecord) -> f64 {
        match self.name {
            "sum_over_time" => x.sum,
            "count_over_time" => x.count as f64,
            "avg_over_time" => x.sum / x.count as f64,
            "min_over_time" => x.min,
            _ => x.max,
        }
    }
}

fn has_nan(r: &RollupRecord) -> bool {
    r.sum.is_nan() || r.min.is_nan() || r.max.is_nan()
}

/// Whether a matcher on `name` can be tested on a gpu-level group.
fn on_group_label(name: &str) -> bool {
    name == "__name__" || GROUP_LABELS.contains(&name)
}

/// A group as the series key it stands for (empty labels are absent).
fn group_key(g: &RollupGroup) -> Option<SeriesKey> {
    let values = [&g.cluster, &g.row, &g.rack, &g.host, &g.gpu];
    let labels = GROUP_LABELS
        .iter()
        .zip(values)
        .map(|(n, v)| Label::new(*n, v.as_str()))
        .collect();
    SeriesKey::new(g.metric.as_str(), labels).ok()
}

#[cfg(test)]
mod tests;
