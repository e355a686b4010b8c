//! `thermal_throttle` and `power_throttle`: clocks cut by temperature or by
//! hardware power protection, from the clock-event reason bits and the
//! throttle-time counters (spec §5.3, research §2.3).
//!
//! Signals, per poll:
//! - `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS`, the instantaneous reason bitmask
//!   (NVML `nvmlClocksEventReason*`): SW thermal 0x20, HW thermal 0x40 and HW
//!   slowdown 0x08 are thermal evidence; HW power brake 0x80 is power
//!   evidence. HW slowdown 0x08 ("≥2× clock cut"; NVML: high temperature,
//!   external power brake, or power draw too high with fast-trigger
//!   protection) counts as thermal when the same poll shows any thermal sign
//!   and as power otherwise, power being the cause left once temperature is
//!   ruled out.
//! - Cumulative throttle time in **ns** (spec §2 and §5.3; the agent's
//!   catalog says the same): `THERMAL_VIOLATION` and
//!   `CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN_NS` (thermal, software level),
//!   `CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN_NS` (thermal, hardware level),
//!   `CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN_NS` (power). An interval
//!   counts as throttled when a counter grew by at least
//!   [`ThrottleConfig::min_counter_fraction`] (10 %) of the time since its
//!   previous reading. Counters integrate between polls, so they catch a
//!   throttle that flaps faster than the poll rate; bits alone cannot.
//!
//! Not faults, never read to fire: SW power cap 0x04 and its counters
//! (`POWER_VIOLATION`, `CLOCKS_EVENT_REASON_SW_POWER_CAP_NS`, the same NVML
//! field): capping at the power limit is normal operation, and NVSentinel
//! suppresses DCGM's power-throttle verdict as a "non-actionable flap"
//! (research §2.3). Idle 0x01, application clocks 0x02, sync boost 0x10 and
//! display clocks 0x100 are not faults either.
//!
//! Persistence: a poll is *informative* for a kind when it carries the
//! bitmask or a counter delta of that kind; polls that carry neither are
//! skipped (no evidence either way). An event opens when a run of consecutive
//! throttled informative polls has at least [`ThrottleConfig::min_polls`] (3)
//! polls *and* spans at least [`ThrottleConfig::min_hold_ms`] (10 s) from its
//! first to its latest poll, so a one-poll blip or a short burst never pages
//! at any poll rate (10 Hz to one poll per 30 s). Onset is the run's first
//! poll. The event clears at the first clean informative poll at least
//! [`ThrottleConfig::clear_after_ms`] (30 s; research §2.3 "no new violation
//! ns for 30 s") after the last throttled poll.
//!
//! Severity: software-level thermal evidence (SW thermal bit, thermal
//! violation or SW thermal counters) is a Warning, as in DCGM's thermal health
//! watch; any hardware-level evidence in the run (HW thermal, HW slowdown, HW
//! power brake) is Critical: the clock cut is ≥2× and NVSentinel cordons on
//! HW thermal slowdown. An open Warning escalates when hardware evidence
//! arrives. Power throttle evidence is hardware-only, so it is Critical.

use std::fmt::Write as _;

use crate::counter::{CounterStep, CounterTrack};
use crate::{
    Clearing, ConfigError, Detector, Escalation, EventKey, Field, Finding, Kind, Poll, PollClock,
    Severity, Transition, fmt_duration,
};

/// Clock-event reason bits (NVML `nvmlClocksEventReason*`, spec §5.3).
pub mod reason {
    /// GPU idle: not a fault.
    pub const GPU_IDLE: u64 = 0x001;
    /// Application clocks setting: not a fault.
    pub const APPLICATIONS_CLOCKS_SETTING: u64 = 0x002;
    /// SW power cap: normal at the power limit, not a fault.
    pub const SW_POWER_CAP: u64 = 0x004;
    /// HW slowdown (≥2× clock cut): temperature, power brake or fast trigger.
    pub const HW_SLOWDOWN: u64 = 0x008;
    /// Sync boost: not a fault.
    pub const SYNC_BOOST: u64 = 0x010;
    /// SW thermal slowdown.
    pub const SW_THERMAL: u64 = 0x020;
    /// HW thermal slowdown.
    pub const HW_THERMAL: u64 = 0x040;
    /// HW power brake slowdown (external power brake assertion).
    pub const HW_POWER_BRAKE: u64 = 0x080;
    /// Display clock setting: not a fault.
    pub const DISPLAY_CLOCK_SETTING: u64 = 0x100;

    /// dcgm-exporter's label for each bit (spec §5.3), low bit first.
    pub const LABELS: [(u64, &str); 9] = [
        (GPU_IDLE, "gpu_idle"),
        (APPLICATIONS_CLOCKS_SETTING, "clocks_setting"),
        (SW_POWER_CAP, "power_cap"),
        (HW_SLOWDOWN, "hw_slowdown"),
        (SYNC_BOOST, "sync_boost"),
        (SW_THERMAL, "sw_thermal"),
        (HW_THERMAL, "hw_thermal"),
        (HW_POWER_BRAKE, "hw_power_brake"),
        (DISPLAY_CLOCK_SETTING, "display_clocks"),
    ];
}

/// Action for a software-level thermal throttle.
pub const ACTION_THERMAL_WARNING: &str =
    "check cooling (inlet temperature, fans, airflow); the GPU runs at reduced clocks";
/// Action for a hardware thermal slowdown.
pub const ACTION_THERMAL_CRITICAL: &str =
    "drain the GPU and check its cooling: hardware thermal slowdown cuts clocks by 2x or more";
/// Action for a hardware power slowdown.
pub const ACTION_POWER_CRITICAL: &str = "drain the GPU and check the node's power delivery \
     (PSU, power brake): hardware slowdown cuts clocks by 2x or more";

/// Tunables of [`ThrottleDetector`]. Defaults are documented in `docs/HEALTH.md`.
#[derive(Debug, Clone, PartialEq)]
pub struct ThrottleConfig {
    /// Throttled polls in a row before an event opens. Default 3.
    pub min_polls: u32,
    /// Time from the run's first to its latest throttled poll before an event
    /// opens, ms. Default 10 000.
    pub min_hold_ms: i64,
    /// Throttle-free time after which an open event clears, ms. Default
    /// 30 000 (research §2.3).
    pub clear_after_ms: i64,
    /// Share of a poll interval a throttle-time counter must grow by for the
    /// interval to count as throttled. Default 0.1.
    pub min_counter_fraction: f64,
}

impl Default for ThrottleConfig {
    fn default() -> Self {
        ThrottleConfig {
            min_polls: 3,
            min_hold_ms: 10_000,
            clear_after_ms: 30_000,
            min_counter_fraction: 0.1,
        }
    }
}

impl ThrottleConfig {
    /// Checks every value.
    ///
    /// # Errors
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason| Err(ConfigError { field, reason });
        if self.min_polls < 2 {
            return err(
                "throttle.min_polls",
                "must be >= 2 (1 would page on a blip)",
            );
        }
        if self.min_hold_ms < 0 {
            return err("throttle.min_hold_ms", "must be >= 0");
        }
        if self.clear_after_ms <= 0 {
            return err("throttle.clear_after_ms", "must be > 0");
        }
        if !(self.min_counter_fraction > 0.0 && self.min_counter_fraction <= 1.0) {
            return err("throttle.min_counter_fraction", "must be in (0, 1]");
        }
        Ok(())
    }
}

/// One poll's evidence for one kind.
#[derive(Debug, Clone, Copy, Default)]
struct Evidence {
    /// The poll says something about this kind (bitmask or counter delta).
    informative: bool,
    /// Software-level throttle seen.
    sw: bool,
    /// Hardware-level throttle seen.
    hw: bool,
}

/// Share of the interval each throttle counter grew by (None: no delta).
#[derive(Debug, Clone, Copy, Default)]
struct Fractions {
    thermal_violation: Option<(f64, i64)>,
    sw_therm: Option<(f64, i64)>,
    hw_therm: Option<(f64, i64)>,
    hw_brake: Option<(f64, i64)>,
}

/// Persistence state of one kind.
#[derive(Debug, Clone, Copy, Default)]
struct Track {
    run_start_ts_ms: Option<i64>,
    run_polls: u32,
    run_hw: bool,
    last_throttled_ts_ms: Option<i64>,
    open: Option<Severity>,
}

/// Detects `thermal_throttle` and `power_throttle` for one GPU (see the
/// module docs for the rules).
#[derive(Debug, Clone)]
pub struct ThrottleDetector {
    config: ThrottleConfig,
    clock: PollClock,
    thermal_violation: CounterTrack,
    sw_therm: CounterTrack,
    hw_therm: CounterTrack,
    hw_brake: CounterTrack,
    thermal: Track,
    power: Track,
}

/// The reason bitmask a gauge value denotes: a non-negative integer below
/// 2^53. Anything else is treated as a missing reading.
fn mask_value(v: f64) -> Option<u64> {
    (v >= 0.0 && v.fract() == 0.0 && v < 9_007_199_254_740_992.0).then_some(v as u64)
}

impl ThrottleDetector {
    /// A detector that has seen no poll. `config` should be validated.
    pub fn new(config: ThrottleConfig) -> Self {
        debug_assert!(config.validate().is_ok(), "{config:?}");
        ThrottleDetector {
            config,
            clock: PollClock::default(),
            thermal_violation: CounterTrack::default(),
            sw_therm: CounterTrack::default(),
            hw_therm: CounterTrack::default(),
            hw_brake: CounterTrack::default(),
            thermal: Track::default(),
            power: Track::default(),
        }
    }

    fn fractions(&mut self, poll: &Poll) -> Fractions {
        let ts = poll.ts_ms;
        let frac = |c: &mut CounterTrack, field| match c.step(poll.get(field), ts) {
            Some(CounterStep::Delta { by, elapsed_ms }) => {
                // Counters are in ns, the interval in ms.
                Some((by / (elapsed_ms as f64 * 1e6), elapsed_ms))
            }
            _ => None,
        };
        Fractions {
            thermal_violation: frac(&mut self.thermal_violation, Field::ThermalViolation),
            sw_therm: frac(&mut self.sw_therm, Field::ClocksEventSwThermSlowdownNs),
            hw_therm: frac(&mut self.hw_therm, Field::ClocksEventHwThermSlowdownNs),
            hw_brake: frac(&mut self.hw_brake, Field::ClocksEventHwPowerBrakeSlowdownNs),
        }
    }

    /// Thermal and power evidence of one poll.
    fn evidence(&self, mask: Option<u64>, fr: &Fractions) -> (Evidence, Evidence) {
        let min = self.config.min_counter_fraction;
        let over = |f: Option<(f64, i64)>| f.is_some_and(|(f, _)| f >= min);
        let bit = |b: u64| mask.is_some_and(|m| m & b != 0);

        let thermal_sw = bit(reason::SW_THERMAL) || over(fr.thermal_violation) || over(fr.sw_therm);
        let thermal_hw = bit(reason::HW_THERMAL) || over(fr.hw_therm);
        let slowdown = bit(reason::HW_SLOWDOWN);
        let slowdown_is_thermal = slowdown && (thermal_sw || thermal_hw);
        let thermal = Evidence {
            informative: mask.is_some()
                || fr.thermal_violation.is_some()
                || fr.sw_therm.is_some()
                || fr.hw_therm.is_some(),
            sw: thermal_sw,
            hw: thermal_hw || slowdown_is_thermal,
        };
        let power = Evidence {
            informative: mask.is_some() || fr.hw_brake.is_some(),
            sw: false,
            hw: bit(reason::HW_POWER_BRAKE)
                || over(fr.hw_brake)
                || (slowdown && !slowdown_is_thermal),
        };
        (thermal, power)
    }

    /// Advances one kind's persistence state and emits its transitions.
    fn step(
        config: &ThrottleConfig,
        track: &mut Track,
        kind: Kind,
        ev: Evidence,
        ts: i64,
        describe: impl Fn() -> String,
        out: &mut Vec<Transition>,
    ) {
        if !ev.informative {
            return;
        }
        if !(ev.sw || ev.hw) {
            // A clean poll ends the run; the event clears once quiet long enough.
            track.run_start_ts_ms = None;
            track.run_polls = 0;
            track.run_hw = false;
            if track.open.is_some()
                && let Some(last) = track.last_throttled_ts_ms
                && ts - last >= config.clear_after_ms
            {
                track.open = None;
                out.push(Transition::Cleared(Clearing {
                    key: EventKey::of(kind),
                    cleared_ts_ms: ts,
                    evidence: format!(
                        "no {kind} for {} (last throttled poll at {last} ms)",
                        fmt_duration(ts - last)
                    ),
                }));
            }
            return;
        }
        let start = *track.run_start_ts_ms.get_or_insert(ts);
        track.run_polls += 1;
        track.run_hw |= ev.hw;
        track.last_throttled_ts_ms = Some(ts);
        let action = |severity| match (kind, severity) {
            (Kind::PowerThrottle, _) => ACTION_POWER_CRITICAL,
            (_, Severity::Critical) => ACTION_THERMAL_CRITICAL,
            _ => ACTION_THERMAL_WARNING,
        };
        match track.open {
            None if track.run_polls >= config.min_polls && ts - start >= config.min_hold_ms => {
                let severity = if track.run_hw {
                    Severity::Critical
                } else {
                    Severity::Warning
                };
                track.open = Some(severity);
                out.push(Transition::Opened(Finding {
                    kind,
                    severity,
                    xid: None,
                    onset_ts_ms: start,
                    detected_ts_ms: ts,
                    action: action(severity),
                    evidence: format!(
                        "throttled for {} polls over {}; {}",
                        track.run_polls,
                        fmt_duration(ts - start),
                        describe()
                    ),
                }));
            }
            Some(Severity::Warning) if ev.hw => {
                track.open = Some(Severity::Critical);
                out.push(Transition::Escalated(Escalation {
                    key: EventKey::of(kind),
                    severity: Severity::Critical,
                    ts_ms: ts,
                    action: action(Severity::Critical),
                    evidence: format!("hardware slowdown: {}", describe()),
                }));
            }
            _ => {}
        }
    }
}

/// Human-readable evidence of one poll for `kind`.
fn describe(kind: Kind, mask: Option<u64>, fr: &Fractions, poll: &Poll) -> String {
    let mut parts: Vec<String> = Vec::new();
    if let Some(m) = mask {
        let names: Vec<&str> = reason::LABELS
            .iter()
            .filter(|(b, _)| m & b != 0)
            .map(|(_, n)| *n)
            .collect();
        let mut s = format!("clock events {m:#x}");
        if !names.is_empty() {
            let _ = write!(s, " ({})", names.join(", "));
        }
        parts.push(s);
    }
    let counters: &[(&str, Option<(f64, i64)>)] = match kind {
        Kind::PowerThrottle => &[("hw power brake slowdown", fr.hw_brake)],
        _ => &[
            ("thermal violation", fr.thermal_violation),
            ("sw thermal slowdown", fr.sw_therm),
            ("hw thermal slowdown", fr.hw_therm),
        ],
    };
    for (name, f) in counters {
        if let Some((f, elapsed_ms)) = f
            && *f > 0.0
        {
            parts.push(format!(
                "{name} {:.0}% of {}",
                f.min(1.0) * 100.0,
                fmt_duration(*elapsed_ms)
            ));
        }
    }
    if let Some(t) = poll.get(Field::GpuTemp) {
        parts.push(format!("gpu temp {t} C"));
    }
    if let Some(c) = poll.get(Field::SmClock) {
        parts.push(format!("sm clock {c} MHz"));
    }
    if let Some(w) = poll.get(Field::PowerUsage) {
        parts.push(format!("power {w} W"));
    }
    parts.join("; ")
}

impl Detector for ThrottleDetector {
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::ThermalThrottle, Kind::PowerThrottle]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        let ts = poll.ts_ms;
        if !self.clock.accept(ts) {
            return;
        }
        let mask = poll.get(Field::ClockThrottleReasons).and_then(mask_value);
        let fr = self.fractions(poll);
        let (thermal, power) = self.evidence(mask, &fr);
        Self::step(
            &self.config,
            &mut self.thermal,
            Kind::ThermalThrottle,
            thermal,
            ts,
            || describe(Kind::ThermalThrottle, mask, &fr, poll),
            out,
        );
        Self::step(
            &self.config,
            &mut self.power,
            Kind::PowerThrottle,
            power,
            ts,
            || describe(Kind::PowerThrottle, mask, &fr, poll),
            out,
        );
    }
}

#[cfg(test)]
mod tests;
