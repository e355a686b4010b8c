//! `zombie`: a GPU that keeps reporting but does no work (research §2.6).
//!
//! Telemetry alone cannot see a GPU that computes counters but runs no
//! kernels; it can see readings that stopped being fresh, and readings that
//! contradict each other. Three rules, one event per GPU. Every duration is
//! sample time (the polls' `ts_ms`), never a poll count, so the same defaults
//! hold at 10 Hz and at one poll per 30 s; [`ZombieConfig::min_polls`] (3)
//! only makes sure polls keep arriving during the evidence.
//!
//! 1. **Energy counter frozen** ([`Severity::Critical`]).
//!    `DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION` (mJ since driver load) is the
//!    integral of power, and a powered GPU draws at least its idle power
//!    (~70 W on an H100, 120 W with a model loaded in the real b1 trace), so
//!    in a minute it must grow by some 4,000,000 mJ. The rule holds when the
//!    counter carries one value over ≥ 3 polls spanning
//!    [`ZombieConfig::energy_freeze_ms`] (60 s) from the first poll that
//!    showed the value. Short freezes are normal: the counter refreshes more
//!    slowly than 10 Hz, and the longest freeze in the real 10 Hz recordings
//!    is 4.9 s (b1, across a poll stall; 0.8 s in t13). dcgm-exporter
//!    refreshes every field only every 30 s by default while Prometheus may
//!    scrape every 15 s, so a value legitimately repeats for up to ~30 s;
//!    60 s is twice that and 12× the recorded maximum. The readings are
//!    stale (DCGM or the exporter serves a cached snapshot) or the GPU is
//!    wedged: either way nothing it reports can be trusted, so Critical,
//!    drain. A value that changes, up or down, restarts the run: a decrease
//!    is a driver reload (counter reset), which re-baselines.
//! 2. **Readings frozen** ([`Severity::Warning`]). Power, temperature, SM
//!    clock and energy, of which the polls carry at least 3, all
//!    bit-identical over ≥ 3 polls spanning
//!    [`ZombieConfig::readings_freeze_ms`] (10 min). With the energy counter
//!    carried, rule 1 holds long before (a frozen set includes a frozen
//!    counter), so this rule is the fallback for a GPU whose energy is not
//!    exported. Without the counter the evidence is weak: an idle GPU holds
//!    power and temperature bit-identical for up to 53 s at 10 Hz and 80 s
//!    at 1 Hz in the real b1 trace (85 % of its consecutive power readings
//!    repeat), and its SM clock sits at a fixed idle value. Hence the long
//!    hold and a Warning (check DCGM / the exporter), not a page.
//! 3. **Busy but no work** ([`Severity::Warning`]). `DCGM_FI_DEV_GPU_UTIL`
//!    ("% of time one or more kernels was executing") ≥
//!    [`ZombieConfig::busy_util_pct`] (50 %) while every carried activity
//!    ratio, `DCGM_FI_PROF_SM_ACTIVE` and `DCGM_FI_PROF_GR_ENGINE_ACTIVE`, is
//!    ≤ [`ZombieConfig::idle_activity_max`] (0.005), over ≥ 3 such polls
//!    spanning [`ZombieConfig::busy_idle_ms`] (60 s). A kernel "runs" but no
//!    SM holds a warp: a wedged GPU or channel, or broken profiling
//!    counters. 0.005 is below one SM's share of an H100 (1/132 = 0.0076),
//!    so a kernel that keeps a single block resident is work, not a zombie.
//!    The readings are live and the job may recover, so a Warning. A poll
//!    that shows work (an activity ratio above the limit) or an idle GPU
//!    (`GPU_UTIL` 0) ends the run; polls with 0 < `GPU_UTIL` < 50 % and no
//!    activity (the training trace t13 dips to 32-49 % for a few polls)
//!    neither extend nor end it. In t13, `GPU_UTIL` ≥ 50 % with `SM_ACTIVE`
//!    ≤ 0.005 happens on 1 poll of 25,440; in b1 `GPU_UTIL` never reaches
//!    50 %.
//!
//! **Quick holds** (rules 1 and 3). The fixed holds are set by the worst
//! source a GPU may be read through, the exporter's 30 s cache; a GPU read
//! fresh from NVML shows far less. So each GPU learns its own normal: the
//! longest run of the rule's evidence that ended before the full hold. Once
//! the GPU has reported the rule's fields for
//! [`ZombieConfig::quick_learn_ms`] (2 min), a run
//! [`ZombieConfig::quick_factor`] (3) times that long, and at least
//! [`ZombieConfig::quick_min_ms`] (2 s), holds early: rule 1 as a
//! [`Severity::Warning`] ("energy stopped", escalated when the full minute
//! holds), rule 3 as its usual warning. At 1 Hz from NVML, where the counter
//! never repeats in either real recording, that is the second repeated poll.
//! A quick run that ends short of the full hold is learned too, so a GPU
//! whose driver stalls now and then warns once, not at every stall.
//!
//! A missing field is no evidence: a poll that does not carry a rule's fields
//! neither extends nor ends its run. Rule 1 needs the counter; rule 3
//! `GPU_UTIL` and an activity ratio; rule 2 needs 3 of its 4 fields and
//! compares them with the values the run has seen: a field that joins later
//! must stay put from then on, and a poll that can compare fewer than 3 (one
//! went missing as another joined) is no evidence either. Energy values below
//! 0 or at or above 2^53 (DCGM's blank sentinels are ~9.2·10^18) are treated
//! as missing.
//!
//! Opening: when any rule holds, with the worst holding rule's severity and
//! action; onset is the earliest onset among the holding rules: for rules 1
//! and 2 the first poll that repeated the frozen value (the hold is measured
//! from the poll before it, the last one whose value was fresh), for rule 3
//! the first busy-but-idle poll. Detection is the poll at which the hold is
//! met. An open Warning escalates when rule 1 starts to hold.
//!
//! Clearing: at the first poll that carries a rule's fields, while no rule
//! holds, at least [`ZombieConfig::clear_after_ms`] (2 min) after the last
//! poll at which a rule held. Twice the 60 s holds, so a counter that moves
//! only once a minute or so keeps its event open instead of flapping closed
//! and open.

use std::fmt::Write as _;

use crate::{
    Clearing, ConfigError, Detector, Escalation, EventKey, Field, Finding, Kind, Poll, PollClock,
    Severity, Transition, fmt_duration,
};

/// Action: the energy counter stopped (rule 1).
pub const ACTION_ENERGY_FROZEN: &str = "drain the GPU: its energy counter stopped, so its \
     readings are stale or it is wedged; restart DCGM / dcgm-exporter on the host, and reset \
     the GPU if the counter stays frozen";
/// Action: the energy counter stopped for longer than this GPU's counter
/// ever paused before, short of rule 1's minute (rule 1's quick hold).
pub const ACTION_ENERGY_STOPPED: &str = "watch the GPU: its energy counter stopped, longer \
     than it ever paused before; if it stays stopped for a minute this becomes critical (drain)";
/// Action: all readings frozen, no energy counter to confirm (rule 2).
pub const ACTION_READINGS_FROZEN: &str = "check DCGM / dcgm-exporter on the host: the GPU's \
     power, temperature and clock readings stopped changing; drain the GPU if they stay frozen \
     after a restart of the exporter";
/// Action: reports kernels running, its SMs do nothing (rule 3).
pub const ACTION_BUSY_IDLE: &str = "check the job on this GPU: it reports kernels running but \
     its SMs hold no warps (hung job, wedged GPU, or broken profiling counters); restart the \
     job, and drain the GPU if it happens again";

/// Energy readings at or above this are not a counter value (DCGM's blank
/// sentinels are ~9.2e18) and are treated as missing; it is also where an
/// f64 stops holding every integer, which bit-identity relies on.
const MAX_ENERGY_MJ: f64 = 9_007_199_254_740_992.0;

/// Tunables of [`ZombieDetector`]. Defaults are documented in `docs/HEALTH.md`.
#[derive(Debug, Clone, PartialEq)]
pub struct ZombieConfig {
    /// Polls (the first one included) a run needs before a rule holds, so
    /// that a single poll after a long gap never fires. Default 3.
    pub min_polls: u32,
    /// Time the energy counter must stay at one value, from the first poll
    /// that showed it, ms. Default 60 000.
    pub energy_freeze_ms: i64,
    /// Time power, temperature, SM clock and energy (3 of them at least)
    /// must stay bit-identical, ms. Default 600 000.
    pub readings_freeze_ms: i64,
    /// `GPU_UTIL` at or above which the GPU claims to be busy, %. Default 50.
    pub busy_util_pct: f64,
    /// Activity ratio (`SM_ACTIVE`, `GR_ENGINE_ACTIVE`) at or below which
    /// the SMs count as doing nothing. Default 0.005.
    pub idle_activity_max: f64,
    /// Time from the first to the latest busy-but-idle poll, ms. Default
    /// 60 000.
    pub busy_idle_ms: i64,
    /// Time without a holding rule after which an open event clears, ms.
    /// Default 120 000.
    pub clear_after_ms: i64,
    /// Quick holds (rules 1 and 3): how long a GPU must have reported a
    /// rule's fields before a run may be judged against its own normal
    /// runs, ms. Default 120 000.
    pub quick_learn_ms: i64,
    /// Quick holds: a run holds early once it lasts this many times the
    /// longest normal run the GPU has shown (one that ended before the
    /// rule's full hold). Default 3.
    pub quick_factor: i64,
    /// Quick holds: never shorter than this, ms. Default 2 000 (two polls
    /// at 1 Hz).
    pub quick_min_ms: i64,
}

impl Default for ZombieConfig {
    fn default() -> Self {
        ZombieConfig {
            min_polls: 3,
            energy_freeze_ms: 60_000,
            readings_freeze_ms: 600_000,
            busy_util_pct: 50.0,
            idle_activity_max: 0.005,
            busy_idle_ms: 60_000,
            clear_after_ms: 120_000,
            quick_learn_ms: 120_000,
            quick_factor: 3,
            quick_min_ms: 2_000,
        }
    }
}

impl ZombieConfig {
    /// Checks every value.
    ///
    /// # Errors
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason| Err(ConfigError { field, reason });
        if self.min_polls < 2 {
            return err(
                "zombie.min_polls",
                "must be >= 2 (a freeze needs a repeated reading)",
            );
        }
        if self.energy_freeze_ms <= 0 {
            return err("zombie.energy_freeze_ms", "must be > 0");
        }
        if self.readings_freeze_ms <= 0 {
            return err("zombie.readings_freeze_ms", "must be > 0");
        }
        if !(self.busy_util_pct > 0.0 && self.busy_util_pct <= 100.0) {
            return err("zombie.busy_util_pct", "must be in (0, 100]");
        }
        if !(self.idle_activity_max >= 0.0 && self.idle_activity_max < 1.0) {
            return err("zombie.idle_activity_max", "must be in [0, 1)");
        }
        if self.busy_idle_ms <= 0 {
            return err("zombie.busy_idle_ms", "must be > 0");
        }
        if self.clear_after_ms <= 0 {
            return err("zombie.clear_after_ms", "must be > 0");
        }
        if self.quick_learn_ms <= 0 {
            return err("zombie.quick_learn_ms", "must be > 0");
        }
        if self.quick_factor < 1 {
            return err("zombie.quick_factor", "must be >= 1");
        }
        if self.quick_min_ms <= 0 {
            return err("zombie.quick_min_ms", "must be > 0");
        }
        Ok(())
    }
}

/// A run of polls that all show one rule's evidence.
#[derive(Debug, Clone, Copy)]
struct Run {
    /// Sample time the run's duration is measured from.
    from_ts_ms: i64,
    /// First poll that showed the evidence (a repeat, for the freeze rules).
    onset_ts_ms: Option<i64>,
    /// Latest poll of the run.
    last_ts_ms: i64,
    /// Polls in the run, the first one included.
    polls: u32,
}

impl Run {
    /// A run starting at `ts_ms`; `evidence` says whether that poll is itself
    /// evidence (busy-but-idle) or only the baseline a freeze is measured
    /// from.
    fn start(ts_ms: i64, evidence: bool) -> Self {
        Run {
            from_ts_ms: ts_ms,
            onset_ts_ms: evidence.then_some(ts_ms),
            last_ts_ms: ts_ms,
            polls: 1,
        }
    }

    fn extend(&mut self, ts_ms: i64) {
        self.onset_ts_ms.get_or_insert(ts_ms);
        self.last_ts_ms = ts_ms;
        self.polls = self.polls.saturating_add(1);
    }

    fn span_ms(&self) -> i64 {
        self.last_ts_ms - self.from_ts_ms
    }

    /// The onset, if the run is long enough for its rule to hold.
    fn holds(&self, min_polls: u32, min_span_ms: i64) -> Option<i64> {
        (self.polls >= min_polls && self.span_ms() >= min_span_ms)
            .then_some(self.onset_ts_ms)
            .flatten()
    }
}

/// What a GPU's own history says is normal for one rule (1 or 3): since
/// when it has reported the rule's fields, and the longest run it has shown
/// that ended before the rule's full hold.
#[derive(Debug, Clone, Copy, Default)]
struct Normal {
    since_ts_ms: Option<i64>,
    longest_ms: i64,
}

impl Normal {
    fn seen(&mut self, ts_ms: i64) {
        self.since_ts_ms.get_or_insert(ts_ms);
    }

    /// `run` ended; it was normal if it ended before the full hold.
    fn ended(&mut self, run: &Run, full_hold_ms: i64) {
        if run.span_ms() < full_hold_ms {
            self.longest_ms = self.longest_ms.max(run.span_ms());
        }
    }

    /// The quick hold for `run`: none until the GPU has reported the fields
    /// for [`ZombieConfig::quick_learn_ms`] before the run began.
    fn quick_hold_ms(&self, run: &Run, c: &ZombieConfig) -> Option<i64> {
        let since = self.since_ts_ms?;
        (run.from_ts_ms - since >= c.quick_learn_ms).then(|| {
            c.quick_factor
                .saturating_mul(self.longest_ms)
                .max(c.quick_min_ms)
        })
    }
}

/// The fields rule 2 compares, in this order.
const FROZEN_FIELDS: [Field; 4] = [
    Field::TotalEnergyConsumption,
    Field::PowerUsage,
    Field::GpuTemp,
    Field::SmClock,
];

/// Fewest fields of [`FROZEN_FIELDS`] a poll must carry for rule 2.
const MIN_FROZEN_FIELDS: usize = 3;

/// The energy counter's value, if the poll carries a plausible one.
fn energy(poll: &Poll) -> Option<f64> {
    poll.get(Field::TotalEnergyConsumption)
        .filter(|v| (0.0..MAX_ENERGY_MJ).contains(v))
}

/// Detects `zombie` events for one GPU (see the module docs for the rules).
#[derive(Debug, Clone)]
pub struct ZombieDetector {
    config: ZombieConfig,
    clock: PollClock,
    /// Rule 1: the counter's current value and the run of polls showing it.
    energy: Option<(f64, Run)>,
    /// Rule 1: the counter's normal pauses.
    energy_normal: Normal,
    /// Rule 2: the values (as bits) the run has seen, per [`FROZEN_FIELDS`]
    /// (those of its first poll, and fields that joined later), and the run.
    readings: Option<([Option<u64>; 4], Run)>,
    /// Rule 3: the run, and `GPU_UTIL` and the highest activity ratio of its
    /// latest poll.
    busy: Option<(Run, f64, f64)>,
    /// Rule 3: the GPU's normal busy-but-idle runs.
    busy_normal: Normal,
    /// Severity of the open event.
    open: Option<Severity>,
    /// Latest poll at which a rule held.
    last_held_ts_ms: Option<i64>,
}

impl ZombieDetector {
    /// A detector that has seen no poll. `config` should be validated.
    pub fn new(config: ZombieConfig) -> Self {
        debug_assert!(config.validate().is_ok(), "{config:?}");
        ZombieDetector {
            config,
            clock: PollClock::default(),
            energy: None,
            energy_normal: Normal::default(),
            readings: None,
            busy: None,
            busy_normal: Normal::default(),
            open: None,
            last_held_ts_ms: None,
        }
    }

    /// Rule 1's run; true if the poll carried the counter.
    fn update_energy(&mut self, poll: &Poll) -> bool {
        let Some(v) = energy(poll) else {
            return false;
        };
        self.energy_normal.seen(poll.ts_ms);
        match &mut self.energy {
            Some((value, run)) if value.to_bits() == v.to_bits() => run.extend(poll.ts_ms),
            // First value, growth, or a reset (a decrease): a new baseline.
            old => {
                if let Some((_, run)) = old {
                    self.energy_normal.ended(run, self.config.energy_freeze_ms);
                }
                *old = Some((v, Run::start(poll.ts_ms, false)));
            }
        }
        true
    }

    /// Rule 2's run; true if the poll carried enough of the fields.
    fn update_readings(&mut self, poll: &Poll) -> bool {
        let now: [Option<u64>; 4] = FROZEN_FIELDS.map(|f| {
            if f == Field::TotalEnergyConsumption {
                energy(poll)
            } else {
                poll.get(f)
            }
            .map(f64::to_bits)
        });
        if now.iter().flatten().count() < MIN_FROZEN_FIELDS {
            return false;
        }
        if let Some((snap, run)) = &mut self.readings {
            let mut same = 0;
            let mut changed = false;
            for (s, n) in snap.iter().zip(now) {
                match (s, n) {
                    (Some(s), Some(n)) if *s == n => same += 1,
                    (Some(_), Some(_)) => changed = true,
                    _ => {}
                }
            }
            if !changed {
                // A field the run had not seen yet joins it, and must stay
                // put from now on.
                for (s, n) in snap.iter_mut().zip(now) {
                    if s.is_none() {
                        *s = n;
                    }
                }
                // Fewer than 3 fields to compare (one went missing as
                // another joined): no evidence either way.
                if same >= MIN_FROZEN_FIELDS {
                    run.extend(poll.ts_ms);
                }
                return true;
            }
        }
        self.readings = Some((now, Run::start(poll.ts_ms, false)));
        true
    }

    /// Rule 3's run; true if the poll carried `GPU_UTIL` and an activity
    /// ratio.
    fn update_busy(&mut self, poll: &Poll) -> bool {
        let Some(util) = poll.get(Field::GpuUtil) else {
            return false;
        };
        let activity = [Field::ProfSmActive, Field::ProfGrEngineActive]
            .into_iter()
            .filter_map(|f| poll.get(f))
            .reduce(f64::max);
        let Some(activity) = activity else {
            return false;
        };
        self.busy_normal.seen(poll.ts_ms);
        if activity > self.config.idle_activity_max || util <= 0.0 {
            // The SMs did work, or the GPU says it is idle: consistent.
            if let Some((run, _, _)) = self.busy.take() {
                self.busy_normal.ended(&run, self.config.busy_idle_ms);
            }
        } else if util >= self.config.busy_util_pct {
            match &mut self.busy {
                Some((run, u, a)) => {
                    run.extend(poll.ts_ms);
                    (*u, *a) = (util, activity);
                }
                None => self.busy = Some((Run::start(poll.ts_ms, true), util, activity)),
            }
        }
        // 0 < util < busy_util_pct with no activity: neither evidence nor
        // its absence.
        true
    }

    /// `(severity, action, onset if holding)` per rule, in priority order:
    /// rule 1's full hold, rule 1's quick hold, rule 2, rule 3 (full or
    /// quick).
    fn conditions(&self) -> [(Severity, &'static str, Option<i64>); 4] {
        let c = &self.config;
        let quick = |run: &Run, normal: &Normal, full_ms: i64| {
            normal
                .quick_hold_ms(run, c)
                .filter(|&q| q < full_ms)
                .and_then(|q| run.holds(c.min_polls, q))
        };
        [
            (
                Severity::Critical,
                ACTION_ENERGY_FROZEN,
                self.energy
                    .and_then(|(_, r)| r.holds(c.min_polls, c.energy_freeze_ms)),
            ),
            (
                Severity::Warning,
                ACTION_ENERGY_STOPPED,
                self.energy
                    .and_then(|(_, r)| quick(&r, &self.energy_normal, c.energy_freeze_ms)),
            ),
            (
                Severity::Warning,
                ACTION_READINGS_FROZEN,
                self.readings
                    .and_then(|(_, r)| r.holds(c.min_polls, c.readings_freeze_ms)),
            ),
            (
                Severity::Warning,
                ACTION_BUSY_IDLE,
                self.busy.and_then(|(r, _, _)| {
                    r.holds(c.min_polls, c.busy_idle_ms)
                        .or_else(|| quick(&r, &self.busy_normal, c.busy_idle_ms))
                }),
            ),
        ]
    }

    /// The holding rules, human readable.
    fn active_text(&self, poll: &Poll) -> String {
        let [energy, stopped, readings, busy] = self.conditions().map(|c| c.2.is_some());
        let mut parts: Vec<String> = Vec::new();
        if (energy || stopped)
            && let Some((v, run)) = self.energy
        {
            let mut s = format!(
                "energy counter stuck at {v} mJ for {} ({} polls since {} ms)",
                fmt_duration(run.span_ms()),
                run.polls,
                run.from_ts_ms
            );
            if let Some(w) = poll.get(Field::PowerUsage) {
                let _ = write!(s, " while power reads {w} W");
            }
            if !energy {
                let _ = write!(
                    s,
                    "; its longest pause before was {}",
                    fmt_duration(self.energy_normal.longest_ms)
                );
            }
            parts.push(s);
        }
        if readings && let Some((snap, run)) = self.readings {
            let names = ["energy", "power", "gpu temp", "sm clock"];
            let units = ["mJ", "W", "C", "MHz"];
            let values: Vec<String> = snap
                .iter()
                .zip(names.iter().zip(units))
                .filter_map(|(bits, (n, u))| bits.map(|b| format!("{n} {} {u}", f64::from_bits(b))))
                .collect();
            parts.push(format!(
                "readings unchanged for {} ({} polls since {} ms): {}",
                fmt_duration(run.span_ms()),
                run.polls,
                run.from_ts_ms,
                values.join(", ")
            ));
        }
        if busy && let Some((run, util, activity)) = self.busy {
            let mut s = format!(
                "gpu util {util} % but sm / engine activity {activity} for {} ({} polls)",
                fmt_duration(run.span_ms()),
                run.polls
            );
            if run.span_ms() < self.config.busy_idle_ms {
                let _ = write!(
                    s,
                    "; its longest such run before was {}",
                    fmt_duration(self.busy_normal.longest_ms)
                );
            }
            parts.push(s);
        }
        parts.join("; ")
    }
}

impl Detector for ZombieDetector {
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::Zombie]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        let ts = poll.ts_ms;
        if !self.clock.accept(ts) {
            return;
        }
        // All three run, whatever the first ones return.
        let informative = [
            self.update_energy(poll),
            self.update_readings(poll),
            self.update_busy(poll),
        ]
        .contains(&true);

        // The worst holding rule (the first of the highest severity) and the
        // earliest onset among the holding ones.
        let mut worst: Option<(Severity, &'static str, i64)> = None;
        for (severity, action, onset) in self.conditions() {
            let Some(onset) = onset else { continue };
            worst = Some(match worst {
                None => (severity, action, onset),
                Some((s, _, o)) if severity > s => (severity, action, o.min(onset)),
                Some((s, a, o)) => (s, a, o.min(onset)),
            });
        }
        if worst.is_some() {
            self.last_held_ts_ms = Some(ts);
        }
        let key = EventKey::of(Kind::Zombie);
        match (self.open, worst) {
            (None, Some((severity, action, onset))) => {
                self.open = Some(severity);
                out.push(Transition::Opened(Finding {
                    kind: Kind::Zombie,
                    severity,
                    xid: None,
                    onset_ts_ms: onset,
                    detected_ts_ms: ts,
                    action,
                    evidence: self.active_text(poll),
                }));
            }
            (Some(open), Some((severity, action, _))) if severity > open => {
                self.open = Some(severity);
                out.push(Transition::Escalated(Escalation {
                    key,
                    severity,
                    ts_ms: ts,
                    action,
                    evidence: self.active_text(poll),
                }));
            }
            (Some(_), None) if informative => {
                let Some(last) = self.last_held_ts_ms else {
                    return;
                };
                if ts - last >= self.config.clear_after_ms {
                    self.open = None;
                    out.push(Transition::Cleared(Clearing {
                        key,
                        cleared_ts_ms: ts,
                        evidence: format!(
                            "no zombie rule held for {} (last at {last} ms)",
                            fmt_duration(ts - last)
                        ),
                    }));
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests;
