//! `ecc` and `row_remap`: GPU memory errors and their repair, by DCGM's
//! health thresholds (spec §5.4; DCGM `modules/health/DcgmHealthWatch.cpp`
//! `MonitorMem`, `common/DcgmGPUHardwareLimits.h`; research §2.2).
//!
//! Both detectors watch *levels* (a counter or flag at or over a limit) and
//! *growth* (increases of a cumulative counter within a window). A counter
//! that goes down was reset (driver reload, GPU reset) and is re-baselined: a
//! decrease is never negative growth. The first value a detector sees is the
//! baseline: a GPU that arrives with 5 remapped rows has not just grown them.
//!
//! One event per GPU and kind. It opens when any condition holds, with that
//! condition's severity and action (the worst one if several start together),
//! escalates when a worse condition starts, and clears at the first poll at
//! which no condition holds. Level conditions stop holding when the level
//! drops (the GPU was reset or repaired); growth conditions stop when their
//! window no longer holds enough growth, so the window doubles as the quiet
//! period. Severity never goes down while the event is open.

use std::fmt::Write as _;

use crate::counter::{CounterStep, CounterTrack};
use crate::window::Window;
use crate::{
    Clearing, ConfigError, Detector, Escalation, EventKey, Field, Finding, Kind, Poll, PollClock,
    Severity, Transition, fmt_duration,
};

/// Retired pages (SBE + DBE) at which DCGM health fails the GPU
/// (`DCGM_LIMIT_MAX_RETIRED_PAGES`).
pub const MAX_RETIRED_PAGES: f64 = 63.0;
/// DBE-retired pages above which new DBE retirements fail the GPU
/// (`DCGM_LIMIT_MAX_RETIRED_PAGES_SOFT_LIMIT`).
pub const RETIRED_PAGES_DBE_SOFT_LIMIT: f64 = 15.0;
/// Over the soft limit, more than this many new DBE retirements...
pub const MAX_NEW_DBE_RETIREMENTS: f64 = 1.0;
/// ...within this window (one week, as in DCGM `MonitorMem`), ms.
pub const DBE_RETIREMENT_WINDOW_MS: i64 = 604_800_000;
/// New volatile SBEs at which DCGM health warns (`DCGM_LIMIT_MAX_SBE_RATE`,
/// which DCGM itself calls a placeholder "until a real one is determined")...
pub const SBE_RATE_LIMIT: f64 = 10.0;
/// ...within this window (DCGM's default health window, one minute), ms.
pub const SBE_RATE_WINDOW_MS: i64 = 60_000;
/// Uncorrectable remapped rows at which DCGM health warns that the "GPU is in
/// a bad state" (`UNCORRECTABLE_ROW_REMAP_LIMIT`).
pub const UNCORRECTABLE_ROW_REMAP_LIMIT: f64 = 512.0;

/// Action: volatile DBEs (NVSentinel maps DCGM's verdict to RESET_GPU).
pub const ACTION_DBE: &str =
    "drain the GPU and reset it (uncorrectable ECC errors since driver load)";
/// Action: retirement limits reached (NVSentinel: RUN_FIELDDIAG).
pub const ACTION_FIELD_DIAG: &str =
    "drain the GPU and run field diagnostics (memory repair exhausted; RMA candidate)";
/// Action: pages pending retirement; they retire at the next reset.
pub const ACTION_PENDING_RETIREMENT: &str =
    "reset the GPU when its jobs allow, so the pending page retirement takes effect";
/// Action: a high single-bit error rate (DCGM warns; no immediate action).
pub const ACTION_SBE_RATE: &str =
    "watch the GPU: high single-bit ECC error rate; run diagnostics if it persists";
/// Action: a row remap pending (NVSentinel: RESET_GPU).
pub const ACTION_REMAP_PENDING: &str =
    "reset the GPU when its jobs allow, to apply the pending row remap";
/// Action: uncorrectable errors remapped rows.
pub const ACTION_UNCORRECTABLE: &str =
    "drain the GPU and reset it (uncorrectable memory errors); report hardware if it recurs";
/// Action: row remapping failed (NVSentinel: RUN_FIELDDIAG).
pub const ACTION_REMAP_FAILURE: &str =
    "drain the GPU and run field diagnostics (row remapping failed; RMA candidate)";
/// Action: the uncorrectable-row level limit.
pub const ACTION_REMAP_LIMIT: &str =
    "report hardware: uncorrectable remapped rows at DCGM's limit (GPU in a bad state)";
/// Action: correctable rows keep being remapped.
pub const ACTION_CORRECTABLE_GROWTH: &str =
    "watch the GPU: memory is degrading (rows remapped repeatedly); schedule diagnostics";

/// A flag or level that holds while its value passes a test; remembers since
/// when. A missing reading keeps the last known value.
#[derive(Debug, Clone, Copy, Default)]
struct Level {
    value: Option<f64>,
    since_ts_ms: Option<i64>,
}

impl Level {
    fn update(&mut self, value: Option<f64>, ts_ms: i64, holds: impl Fn(f64) -> bool) {
        let Some(v) = value.filter(|v| *v >= 0.0) else {
            return;
        };
        self.value = Some(v);
        if holds(v) {
            self.since_ts_ms.get_or_insert(ts_ms);
        } else {
            self.since_ts_ms = None;
        }
    }
}

/// Feeds a counter and adds its growth (not resets, not the baseline) to a
/// window.
fn track_growth(counter: &mut CounterTrack, window: &mut Window, value: Option<f64>, ts_ms: i64) {
    if let Some(CounterStep::Delta { by, .. }) = counter.step(value, ts_ms) {
        window.add(ts_ms, by);
    }
}

/// The worst condition now holding: its severity and action, and the
/// earliest onset among all holding conditions.
#[derive(Debug, Clone, Copy)]
struct Worst {
    severity: Severity,
    action: &'static str,
    onset_ts_ms: i64,
}

/// Picks the worst of `(severity, action, onset)` candidates given in
/// priority order (the first of the highest severity wins).
fn worst(conds: impl IntoIterator<Item = (Severity, &'static str, Option<i64>)>) -> Option<Worst> {
    let mut w: Option<Worst> = None;
    for (severity, action, onset) in conds {
        let Some(onset) = onset else { continue };
        match &mut w {
            None => {
                w = Some(Worst {
                    severity,
                    action,
                    onset_ts_ms: onset,
                })
            }
            Some(w) => {
                if severity > w.severity {
                    w.severity = severity;
                    w.action = action;
                }
                w.onset_ts_ms = w.onset_ts_ms.min(onset);
            }
        }
    }
    w
}

/// Open / escalate / clear for a detector with one event at a time.
#[derive(Debug, Clone, Copy, Default)]
struct EventState {
    open: Option<Severity>,
}

impl EventState {
    /// `active` describes the holding conditions, `values` the current
    /// readings (for the clearing evidence); both run only when emitting.
    fn step(
        &mut self,
        kind: Kind,
        ts_ms: i64,
        now: Option<Worst>,
        active: impl FnOnce() -> String,
        values: impl FnOnce() -> String,
        out: &mut Vec<Transition>,
    ) {
        match (self.open, now) {
            (None, Some(w)) => {
                self.open = Some(w.severity);
                out.push(Transition::Opened(Finding {
                    kind,
                    severity: w.severity,
                    xid: None,
                    onset_ts_ms: w.onset_ts_ms,
                    detected_ts_ms: ts_ms,
                    action: w.action,
                    evidence: active(),
                }));
            }
            (Some(open), Some(w)) if w.severity > open => {
                self.open = Some(w.severity);
                out.push(Transition::Escalated(Escalation {
                    key: EventKey::of(kind),
                    severity: w.severity,
                    ts_ms,
                    action: w.action,
                    evidence: active(),
                }));
            }
            (Some(_), None) => {
                self.open = None;
                out.push(Transition::Cleared(Clearing {
                    key: EventKey::of(kind),
                    cleared_ts_ms: ts_ms,
                    evidence: format!("no condition holds: {}", values()),
                }));
            }
            _ => {}
        }
    }
}

/// Writes `label value` for a known value, skipping unknown ones.
fn push_value(s: &mut String, label: &str, value: Option<f64>) {
    if let Some(v) = value {
        if !s.is_empty() {
            s.push_str(", ");
        }
        let _ = write!(s, "{label} {v}");
    }
}

/// Detects `ecc` events: volatile double-bit errors, the single-bit error
/// rate and page retirement (pre-Ampere memory repair), per DCGM health.
///
/// | Condition | Severity | Source |
/// |---|---|---|
/// | volatile DBE count > 0 | Critical | DCGM FAIL `DCGM_FR_VOLATILE_DBE_DETECTED` |
/// | retired pages SBE + DBE ≥ 63 | Critical | DCGM FAIL `DCGM_LIMIT_MAX_RETIRED_PAGES` |
/// | DBE-retired pages > 15 and > 1 new in a week | Critical | DCGM FAIL (soft limit) |
/// | pages pending retirement > 0 | Warning | DCGM WARN |
/// | ≥ 10 new volatile SBEs within 60 s | Warning | DCGM WARN `DCGM_LIMIT_MAX_SBE_RATE` |
///
/// The DBE level condition also covers DBE growth: a count that grew is > 0.
/// It holds until the volatile count drops to 0, which happens when the GPU
/// is reset, i.e. when the recommended action was taken.
#[derive(Debug, Clone)]
pub struct EccDetector {
    clock: PollClock,
    dbe_volatile: Level,
    sbe_volatile: CounterTrack,
    sbe_window: Window,
    retired_sbe: Option<f64>,
    retired_dbe: Level,
    retired_dbe_counter: CounterTrack,
    dbe_retirements: Window,
    pages_limit_since_ts_ms: Option<i64>,
    pending: Level,
    event: EventState,
}

impl Default for EccDetector {
    fn default() -> Self {
        Self::new()
    }
}

impl EccDetector {
    /// A detector that has seen no poll. Its thresholds are DCGM's constants.
    pub fn new() -> Self {
        EccDetector {
            clock: PollClock::default(),
            dbe_volatile: Level::default(),
            sbe_volatile: CounterTrack::default(),
            sbe_window: Window::new(SBE_RATE_WINDOW_MS),
            retired_sbe: None,
            retired_dbe: Level::default(),
            retired_dbe_counter: CounterTrack::default(),
            dbe_retirements: Window::new(DBE_RETIREMENT_WINDOW_MS),
            pages_limit_since_ts_ms: None,
            pending: Level::default(),
            event: EventState::default(),
        }
    }

    fn update(&mut self, poll: &Poll) {
        let ts = poll.ts_ms;
        self.dbe_volatile
            .update(poll.get(Field::EccDbeVolTotal), ts, |v| v > 0.0);
        track_growth(
            &mut self.sbe_volatile,
            &mut self.sbe_window,
            poll.get(Field::EccSbeVolTotal),
            ts,
        );
        self.pending
            .update(poll.get(Field::RetiredPending), ts, |v| v > 0.0);
        let retired_dbe = poll.get(Field::RetiredDbe);
        self.retired_dbe
            .update(retired_dbe, ts, |v| v > RETIRED_PAGES_DBE_SOFT_LIMIT);
        track_growth(
            &mut self.retired_dbe_counter,
            &mut self.dbe_retirements,
            retired_dbe,
            ts,
        );
        if let Some(v) = poll.get(Field::RetiredSbe).filter(|v| *v >= 0.0) {
            self.retired_sbe = Some(v);
        }
        // DCGM checks the total only when both counts are known.
        let total = self
            .retired_sbe
            .zip(self.retired_dbe.value)
            .map(|(s, d)| s + d);
        match total {
            Some(t) if t >= MAX_RETIRED_PAGES => {
                self.pages_limit_since_ts_ms.get_or_insert(ts);
            }
            Some(_) => self.pages_limit_since_ts_ms = None,
            None => {}
        }
    }

    /// `(severity, action, onset if holding)` per condition, in priority order.
    fn conditions(&self, ts: i64) -> [(Severity, &'static str, Option<i64>); 5] {
        let dbe_rate = (self.retired_dbe.since_ts_ms.is_some()
            && self.dbe_retirements.sum(ts) > MAX_NEW_DBE_RETIREMENTS)
            .then(|| self.dbe_retirements.onset(ts))
            .flatten();
        let sbe_rate = (self.sbe_window.sum(ts) >= SBE_RATE_LIMIT)
            .then(|| self.sbe_window.onset(ts))
            .flatten();
        [
            (
                Severity::Critical,
                ACTION_DBE,
                self.dbe_volatile.since_ts_ms,
            ),
            (
                Severity::Critical,
                ACTION_FIELD_DIAG,
                self.pages_limit_since_ts_ms,
            ),
            (Severity::Critical, ACTION_FIELD_DIAG, dbe_rate),
            (
                Severity::Warning,
                ACTION_PENDING_RETIREMENT,
                self.pending.since_ts_ms,
            ),
            (Severity::Warning, ACTION_SBE_RATE, sbe_rate),
        ]
    }

    fn active_text(&self, ts: i64) -> String {
        let [dbe, limit, rate, pending, sbe] = self.conditions(ts).map(|c| c.2.is_some());
        let mut parts: Vec<String> = Vec::new();
        if dbe {
            parts.push(format!(
                "volatile DBE count {} (DCGM fails at > 0)",
                self.dbe_volatile.value.unwrap_or(0.0)
            ));
        }
        if limit {
            let (s, d) = (
                self.retired_sbe.unwrap_or(0.0),
                self.retired_dbe.value.unwrap_or(0.0),
            );
            parts.push(format!(
                "retired pages {s} SBE + {d} DBE = {} (DCGM limit {MAX_RETIRED_PAGES})",
                s + d
            ));
        }
        if rate {
            parts.push(format!(
                "{} DBE-retired pages (> {RETIRED_PAGES_DBE_SOFT_LIMIT}) and {} new within {} \
                 (> {MAX_NEW_DBE_RETIREMENTS})",
                self.retired_dbe.value.unwrap_or(0.0),
                self.dbe_retirements.sum(ts),
                fmt_duration(DBE_RETIREMENT_WINDOW_MS),
            ));
        }
        if pending {
            parts.push(format!(
                "{} pages pending retirement",
                self.pending.value.unwrap_or(0.0)
            ));
        }
        if sbe {
            parts.push(format!(
                "{} new volatile SBEs within {} (DCGM limit {SBE_RATE_LIMIT})",
                self.sbe_window.sum(ts),
                fmt_duration(SBE_RATE_WINDOW_MS),
            ));
        }
        parts.join("; ")
    }

    fn values_text(&self, ts: i64) -> String {
        let mut s = String::new();
        push_value(&mut s, "volatile DBE", self.dbe_volatile.value);
        push_value(&mut s, "new SBEs in window", Some(self.sbe_window.sum(ts)));
        push_value(&mut s, "retired SBE", self.retired_sbe);
        push_value(&mut s, "retired DBE", self.retired_dbe.value);
        push_value(&mut s, "pending", self.pending.value);
        s
    }
}

impl Detector for EccDetector {
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::Ecc]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        let ts = poll.ts_ms;
        if !self.clock.accept(ts) {
            return;
        }
        self.update(poll);
        let now = worst(self.conditions(ts));
        let mut event = self.event;
        event.step(
            Kind::Ecc,
            ts,
            now,
            || self.active_text(ts),
            || self.values_text(ts),
            out,
        );
        self.event = event;
    }
}

/// Tunables of [`RowRemapDetector`] (the DCGM limits are constants).
#[derive(Debug, Clone, PartialEq)]
pub struct RowRemapConfig {
    /// Correctable remapped rows within `correctable_window_ms` that mean
    /// "memory degrading". Default 3 (research §2.2's example; to be tuned
    /// on real data).
    pub correctable_growth_rows: f64,
    /// Window of the correctable-growth rule, ms. Default 600 000 (10 min).
    pub correctable_window_ms: i64,
    /// How long a new uncorrectable remapped row keeps the event critical,
    /// ms. Default 3 600 000 (1 h, like the XID quiet period).
    pub uncorrectable_window_ms: i64,
}

impl Default for RowRemapConfig {
    fn default() -> Self {
        RowRemapConfig {
            correctable_growth_rows: 3.0,
            correctable_window_ms: 600_000,
            uncorrectable_window_ms: 3_600_000,
        }
    }
}

impl RowRemapConfig {
    /// Checks every value.
    ///
    /// # Errors
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason| Err(ConfigError { field, reason });
        if self.correctable_growth_rows.is_nan() || self.correctable_growth_rows < 1.0 {
            return err("row_remap.correctable_growth_rows", "must be >= 1");
        }
        // The windows are cut into 12 buckets of whole milliseconds.
        if self.correctable_window_ms < 12 {
            return err("row_remap.correctable_window_ms", "must be >= 12 ms");
        }
        if self.uncorrectable_window_ms < 12 {
            return err("row_remap.uncorrectable_window_ms", "must be >= 12 ms");
        }
        Ok(())
    }
}

/// Detects `row_remap` events: HBM row remapping (Ampere and newer).
///
/// | Condition | Severity | Source |
/// |---|---|---|
/// | row remap failure flag = 1 | Critical | DCGM FAIL (XID 64), NVSentinel RUN_FIELDDIAG |
/// | uncorrectable remapped rows grew within 1 h | Critical | research §2.2 ("any uncorrectable → critical") |
/// | row remap pending = 1 | Warning | NVSentinel RESET_GPU (applied at the next reset) |
/// | uncorrectable remapped rows ≥ 512 | Warning | DCGM WARN `UNCORRECTABLE_ROW_REMAP_LIMIT` |
/// | ≥ 3 correctable rows remapped within 10 min | Warning | research §2.2 (SuperBench's gray failure) |
#[derive(Debug, Clone)]
pub struct RowRemapDetector {
    config: RowRemapConfig,
    clock: PollClock,
    failure: Level,
    pending: Level,
    uncorrectable: Level,
    uncorrectable_counter: CounterTrack,
    uncorrectable_growth: Window,
    correctable_counter: CounterTrack,
    correctable_growth: Window,
    event: EventState,
}

impl RowRemapDetector {
    /// A detector that has seen no poll. `config` should be validated.
    pub fn new(config: RowRemapConfig) -> Self {
        debug_assert!(config.validate().is_ok(), "{config:?}");
        RowRemapDetector {
            clock: PollClock::default(),
            failure: Level::default(),
            pending: Level::default(),
            uncorrectable: Level::default(),
            uncorrectable_counter: CounterTrack::default(),
            uncorrectable_growth: Window::new(config.uncorrectable_window_ms),
            correctable_counter: CounterTrack::default(),
            correctable_growth: Window::new(config.correctable_window_ms),
            event: EventState::default(),
            config,
        }
    }

    fn update(&mut self, poll: &Poll) {
        let ts = poll.ts_ms;
        self.failure
            .update(poll.get(Field::RowRemapFailure), ts, |v| v > 0.0);
        self.pending
            .update(poll.get(Field::RowRemapPending), ts, |v| v > 0.0);
        let unc = poll.get(Field::UncorrectableRemappedRows);
        self.uncorrectable
            .update(unc, ts, |v| v >= UNCORRECTABLE_ROW_REMAP_LIMIT);
        track_growth(
            &mut self.uncorrectable_counter,
            &mut self.uncorrectable_growth,
            unc,
            ts,
        );
        track_growth(
            &mut self.correctable_counter,
            &mut self.correctable_growth,
            poll.get(Field::CorrectableRemappedRows),
            ts,
        );
    }

    fn conditions(&self, ts: i64) -> [(Severity, &'static str, Option<i64>); 5] {
        let unc_growth = self.uncorrectable_growth.onset(ts);
        let corr_growth = (self.correctable_growth.sum(ts) >= self.config.correctable_growth_rows)
            .then(|| self.correctable_growth.onset(ts))
            .flatten();
        [
            (
                Severity::Critical,
                ACTION_REMAP_FAILURE,
                self.failure.since_ts_ms,
            ),
            (Severity::Critical, ACTION_UNCORRECTABLE, unc_growth),
            (
                Severity::Warning,
                ACTION_REMAP_PENDING,
                self.pending.since_ts_ms,
            ),
            (
                Severity::Warning,
                ACTION_REMAP_LIMIT,
                self.uncorrectable.since_ts_ms,
            ),
            (Severity::Warning, ACTION_CORRECTABLE_GROWTH, corr_growth),
        ]
    }

    fn active_text(&self, ts: i64) -> String {
        let [failure, unc, pending, limit, corr] = self.conditions(ts).map(|c| c.2.is_some());
        let mut parts: Vec<String> = Vec::new();
        if failure {
            parts.push("row remap failure flag set (DCGM fails)".to_string());
        }
        if unc {
            parts.push(format!(
                "{} new uncorrectable remapped rows within {} (now {})",
                self.uncorrectable_growth.sum(ts),
                fmt_duration(self.config.uncorrectable_window_ms),
                self.uncorrectable.value.unwrap_or(0.0),
            ));
        }
        if pending {
            parts.push("row remap pending (applied at the next GPU reset)".to_string());
        }
        if limit {
            parts.push(format!(
                "{} uncorrectable remapped rows (DCGM limit {UNCORRECTABLE_ROW_REMAP_LIMIT})",
                self.uncorrectable.value.unwrap_or(0.0)
            ));
        }
        if corr {
            parts.push(format!(
                "{} new correctable remapped rows within {} (threshold {}, now {})",
                self.correctable_growth.sum(ts),
                fmt_duration(self.config.correctable_window_ms),
                self.config.correctable_growth_rows,
                self.correctable_counter.value().unwrap_or(0.0),
            ));
        }
        parts.join("; ")
    }

    fn values_text(&self, ts: i64) -> String {
        let mut s = String::new();
        push_value(&mut s, "failure", self.failure.value);
        push_value(&mut s, "pending", self.pending.value);
        push_value(&mut s, "uncorrectable rows", self.uncorrectable.value);
        push_value(
            &mut s,
            "new uncorrectable in window",
            Some(self.uncorrectable_growth.sum(ts)),
        );
        push_value(
            &mut s,
            "new correctable in window",
            Some(self.correctable_growth.sum(ts)),
        );
        s
    }
}

impl Detector for RowRemapDetector {
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::RowRemap]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        let ts = poll.ts_ms;
        if !self.clock.accept(ts) {
            return;
        }
        self.update(poll);
        let now = worst(self.conditions(ts));
        let mut event = self.event;
        event.step(
            Kind::RowRemap,
            ts,
            now,
            || self.active_text(ts),
            || self.values_text(ts),
            out,
        );
        self.event = event;
    }
}

#[cfg(test)]
mod tests;
