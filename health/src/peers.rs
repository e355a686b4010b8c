//! `straggler` and `clock_degraded`: a GPU compared with its peers.
//!
//! A GPU that is 10 % slower than the seven others of its synchronous job
//! breaks no threshold of its own, yet the whole job waits for it (research
//! §2.4, ByteDance Minder: similarity to peers plus continuity). So these
//! two kinds are not per-GPU detectors: the engine keeps a few smoothed
//! signals per GPU ([`PeerSignals`]) and, at each [`crate::engine::Engine::tick`],
//! compares every busy GPU that has a new poll with the other busy GPUs of
//! its host.
//!
//! Signals, each an exponentially weighted mean over sample time with time
//! constant [`PeerConfig::smoothing_ms`] (1 s), so 1 Hz and 10 Hz polls
//! weigh the same span. The means restart from a poll whose power differs
//! from the mean by more than [`PeerConfig::restart_step`] (15 %: a job's
//! start, its next phase), so that a GPU that starts a phase a poll or two
//! after its peers does not trail them for seconds:
//! - activity: `DCGM_FI_PROF_SM_ACTIVE`, else `DCGM_FI_PROF_GR_ENGINE_ACTIVE`,
//!   else `DCGM_FI_DEV_GPU_UTIL` / 100;
//! - power, `DCGM_FI_DEV_POWER_USAGE`, W; SM clock, `DCGM_FI_DEV_SM_CLOCK`, MHz.
//!
//! A host's peer group is its GPUs whose newest poll is at most 3 poll
//! intervals (3 s at least) older than the host's newest, and *busy*
//! (utilisation ≥ [`PeerConfig::busy_util_pct`], 30 %, in every poll for the
//! last [`PeerConfig::settle_ms`], 1 s: two polls at 1 Hz), and whose power
//! and activity move (a frozen picture is a `zombie`'s, not work). GPUs with
//! an open `lost` incident (zombie, silent, fallen off the bus) are left out
//! too. It is compared only with at least [`PeerConfig::min_peers`] (3)
//! other busy GPUs, and only when those
//! run in step: they draw power within [`PeerConfig::max_peer_spread`] (5 %)
//! of their median, all of them (3 to 6 peers) or all but one in six beyond
//! the first (7 to 12 peers: all but one). GPUs of one synchronous job draw
//! nearly the same power (the real 8-way tensor-parallel trace t13: within
//! 2.5 % over 5 s in its steady phase); GPUs running unrelated work do not,
//! and then nobody can say who is slow. A rule's run lasts only while the
//! peers stay in step at every comparison of the GPU: unrelated bursty work
//! falls in step by chance for a moment, a job stays in step. (A spread
//! statistic such as the median absolute deviation is not enough: four of
//! eight unrelated GPUs that happen to draw alike make it small.)
//!
//! Rules, each against the median of the *other* busy GPUs:
//! - **straggler** (warning): activity and power both at least
//!   [`PeerConfig::straggler_deficit`] (3 %) below the peers, and activity
//!   not more than half below (a GPU that does nothing at all while it reports
//!   busy is a `zombie`, not a straggler). Both, because in t13 one healthy
//!   GPU runs 13 % below its peers' SM activity all through the steady phase
//!   (its rank does other work) while its power stays within 2.5 %: neither
//!   signal alone separates a slow GPU from a different one.
//! - **clock_degraded** (warning): SM clock at least
//!   [`PeerConfig::clock_deficit`] (8 %) below the peers' while the GPU shows
//!   no thermal or hardware slowdown reason (those are `thermal_throttle` and
//!   `power_throttle`'s), and the peers' clocks are in step likewise.
//!
//! **Evidence.** A rule fires once its run has earned [`PeerConfig::hold_ms`]
//! (8 s) of credit and has lasted [`PeerConfig::min_hold_ms`] (6 s) of the
//! GPU's sample time; onset is the poll that began the run. Each evaluation
//! at which the rule holds earns its time weighted by the shortfall over the
//! rule's deficit (a 9 % straggler earns 3 s a second, capped at
//! [`PeerConfig::max_weight`], 3), and each at which it does not hold costs
//! its time unweighted; credit never exceeds the hold. So a clear shortfall
//! fires after the minimum run and a marginal one after the full hold, and
//! one noisy poll in a run costs its own time twice rather than starting over
//! (at 1 Hz, real SM activity misses a 10 % straggler in about one poll of
//! four). The minimum run is longer than the lag of a healthy GPU that
//! starts its job's next phase a few polls after its peers. With fewer than
//! [`PeerConfig::weighted_min_peers`] (5) other GPUs of the host busy,
//! settled or not, the straggler's evidence is unweighted and counts only
//! once the peers have been in step for [`PeerConfig::in_step_ms`] (4 s):
//! unrelated work on part of a host falls in step by chance far more often
//! than on seven GPUs. (Counting the GPUs that are busy but not yet settled
//! keeps a job's start, where peers start a poll or three apart, on the
//! weighted rule.) It clears after
//! [`PeerConfig::clear_after_ms`] (30 s) of evaluations at which it did not
//! hold, or after [`PeerConfig::unjudged_clear_ms`] (2 min) in which the GPU
//! could not be compared (its job ended, its peers went quiet).
//!
//! Only the host is a peer group today: samples carry no job label, and a
//! job's GPUs on other hosts are not comparable without one.

use crate::{ConfigError, Field, Finding, Kind, Poll, Severity};

/// Clock-event reasons that belong to the throttle detectors (spec §5.3):
/// SW thermal 0x20, HW slowdown 0x08, HW thermal 0x40, HW power brake 0x80.
const THROTTLE_BITS: u64 = 0x08 | 0x20 | 0x40 | 0x80;

/// Tunables of the peer comparison (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct PeerConfig {
    /// Time constant of the smoothed signals, ms.
    pub smoothing_ms: i64,
    /// A poll whose power differs from the smoothed power by more than this
    /// fraction restarts the smoothed signals from it.
    pub restart_step: f64,
    /// Utilisation at and above which a GPU is busy, %.
    pub busy_util_pct: f64,
    /// How long a GPU must have been busy to be compared, ms.
    pub settle_ms: i64,
    /// With fewer than `weighted_min_peers`, how long the peers must have
    /// been in step before a straggler's evidence counts, ms.
    pub in_step_ms: i64,
    /// Fewest other busy GPUs for weighted straggler evidence counted while
    /// the peers settle in step (see the module docs).
    pub weighted_min_peers: usize,
    /// Fewest other busy GPUs to compare with.
    pub min_peers: usize,
    /// Band around the peers' median power (and SM clock) that all peers
    /// but one must be within, for them to count as one job in step.
    pub max_peer_spread: f64,
    /// Shortfall of activity and of power that makes a straggler (fraction).
    pub straggler_deficit: f64,
    /// Shortfall of SM clock that makes a degraded clock (fraction).
    pub clock_deficit: f64,
    /// How long a rule must hold before it fires, ms of sample time, at a
    /// shortfall of once the rule's deficit.
    pub hold_ms: i64,
    /// Most weight of one evaluation's evidence: a shortfall `k` times the
    /// rule's deficit counts `k` times its time toward the hold, up to this.
    pub max_weight: f64,
    /// Least time a run must have lasted to fire, whatever its weight, ms:
    /// longer than the lag of a healthy GPU that starts its job's next
    /// phase a few polls after its peers.
    pub min_hold_ms: i64,
    /// How long a rule must not hold before its event clears, ms.
    pub clear_after_ms: i64,
    /// How long a GPU may go uncompared before its event clears, ms.
    pub unjudged_clear_ms: i64,
}

impl Default for PeerConfig {
    fn default() -> Self {
        PeerConfig {
            smoothing_ms: 1_000,
            restart_step: 0.15,
            busy_util_pct: 30.0,
            settle_ms: 1_000,
            in_step_ms: 4_000,
            weighted_min_peers: 5,
            min_peers: 3,
            max_peer_spread: 0.05,
            straggler_deficit: 0.03,
            clock_deficit: 0.08,
            hold_ms: 8_000,
            max_weight: 3.0,
            min_hold_ms: 6_000,
            clear_after_ms: 30_000,
            unjudged_clear_ms: 120_000,
        }
    }
}

impl PeerConfig {
    /// # Errors
    /// The first value out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason| Err(ConfigError { field, reason });
        if self.smoothing_ms <= 0 {
            return err("peers.smoothing_ms", "must be positive");
        }
        if !(self.busy_util_pct > 0.0 && self.busy_util_pct <= 100.0) {
            return err("peers.busy_util_pct", "must be in (0, 100]");
        }
        if self.min_peers < 2 {
            return err(
                "peers.min_peers",
                "must be at least 2 (a median of one is no majority)",
            );
        }
        for (field, v) in [
            ("peers.max_peer_spread", self.max_peer_spread),
            ("peers.straggler_deficit", self.straggler_deficit),
            ("peers.clock_deficit", self.clock_deficit),
            ("peers.restart_step", self.restart_step),
        ] {
            if !(v > 0.0 && v < 0.5) {
                return err(field, "must be in (0, 0.5)");
            }
        }
        if !(1.0..=100.0).contains(&self.max_weight) {
            return err("peers.max_weight", "must be in [1, 100]");
        }
        if self.hold_ms < 0
            || self.min_hold_ms < 0
            || self.in_step_ms < 0
            || self.settle_ms < 0
            || self.clear_after_ms <= 0
            || self.unjudged_clear_ms <= 0
        {
            return err(
                "peers.hold_ms",
                "hold must be >= 0 and clearing times positive",
            );
        }
        Ok(())
    }
}

/// One rule's run on one GPU.
#[derive(Debug, Clone, Copy, Default)]
struct RuleState {
    /// Sample time of the first evaluation of the current run that held.
    holding_since: Option<i64>,
    /// Time the rule held in the current run, less the time it did not
    /// (never below 0; the run ends at 0), ms.
    credit_ms: i64,
    /// The event is open.
    open: bool,
    /// Sample time of the last evaluation at which the rule held.
    last_held: i64,
    /// Sample time of the last evaluation at all (held or not).
    last_judged: i64,
}

/// What the engine keeps per GPU for the peer comparison.
#[derive(Debug, Clone, Copy, Default)]
pub struct PeerSignals {
    activity: f32,
    power: f32,
    clock: f32,
    /// Which of activity, power, clock have a value (bits 0-2).
    have: u8,
    /// A poll arrived since the last evaluation.
    fresh: bool,
    /// Clock-event reasons of the newest poll.
    reasons: u32,
    /// Sample time of the newest poll.
    ts_ms: i64,
    /// Sample time of the first poll of the current busy run, if busy.
    busy_since: Option<i64>,
    /// A digest of the newest raw power and activity, how many polls in a
    /// row repeated it, and since when.
    raw: u32,
    repeats: u8,
    changed_ts: i64,
    /// Sample time since which every comparison found the peers' power in
    /// step.
    in_step_since: Option<i64>,
    straggler: RuleState,
    clock_rule: RuleState,
}

const ACT: u8 = 1;
const POWER: u8 = 2;
const CLOCK: u8 = 4;

impl PeerSignals {
    /// Takes in one poll (in time order).
    pub(crate) fn observe(&mut self, poll: &Poll, config: &PeerConfig) {
        let dt = poll.ts_ms - self.ts_ms;
        if self.have != 0 && dt <= 0 {
            return;
        }
        let activity = poll
            .get(Field::ProfSmActive)
            .or_else(|| poll.get(Field::ProfGrEngineActive))
            .or_else(|| poll.get(Field::GpuUtil).map(|u| u / 100.0));
        if activity.is_none() && poll.get(Field::PowerUsage).is_none() {
            // Nothing to compare (a GPU fallen off the bus reports only its
            // XID): it is not a fresh poll for the peers, and the GPU goes
            // stale among them.
            return;
        }
        // A step in power (a job's start, its next phase) restarts the
        // means, so that a GPU that starts a phase a poll or two after its
        // peers catches up at once rather than trailing them for seconds
        // (and the idle readings before a job say nothing about it).
        let jumped = self.have & POWER != 0
            && poll.get(Field::PowerUsage).is_some_and(|p| {
                (p - self.power as f64).abs() > config.restart_step * self.power as f64
            });
        // Weight of the new value. A gap longer than 5 time constants
        // forgets, and so does a step.
        let w = if self.have == 0 || dt > 5 * config.smoothing_ms || jumped {
            1.0
        } else {
            1.0 - (-(dt as f64) / config.smoothing_ms as f64).exp()
        };
        // Bit-identical readings poll after poll are a frozen source (a
        // zombie, a stale exporter), not work: see `busy`.
        let raw = (
            poll.get(Field::PowerUsage).map(f64::to_bits),
            activity.map(f64::to_bits),
        );
        let raw = raw.0.unwrap_or(u64::MAX) ^ raw.1.unwrap_or(0).rotate_left(17);
        // Folded, not truncated: the low half of a whole number's bits is 0.
        let raw = (raw ^ (raw >> 32)) as u32;
        if self.have != 0 && raw == self.raw {
            self.repeats = self.repeats.saturating_add(1);
        } else {
            self.raw = raw;
            self.repeats = 0;
            self.changed_ts = poll.ts_ms;
        }
        let mut fold = |slot: &mut f32, bit: u8, v: Option<f64>| {
            if let Some(v) = v {
                *slot = if self.have & bit == 0 {
                    v as f32
                } else {
                    (*slot as f64 + w * (v - *slot as f64)) as f32
                };
                self.have |= bit;
            }
        };
        fold(&mut self.activity, ACT, activity);
        fold(&mut self.power, POWER, poll.get(Field::PowerUsage));
        fold(&mut self.clock, CLOCK, poll.get(Field::SmClock));
        if let Some(r) = poll.get(Field::ClockThrottleReasons) {
            self.reasons = r as u32;
        }
        let busy_now = match (poll.get(Field::GpuUtil), activity) {
            (Some(u), _) => u >= config.busy_util_pct,
            (None, Some(a)) => a >= config.busy_util_pct / 100.0,
            (None, None) => self.busy_since.is_some(),
        };
        if !busy_now {
            self.busy_since = None;
        } else if self.busy_since.is_none() {
            self.busy_since = Some(poll.ts_ms);
        }
        self.ts_ms = poll.ts_ms;
        self.fresh = true;
    }

    /// A poll arrived since the last comparison.
    pub(crate) fn is_fresh(&self) -> bool {
        self.fresh
    }

    /// Busy in every poll for the settling time, with readings that move: a
    /// GPU whose power and activity repeat bit for bit over 3 polls and 3 s
    /// reports a frozen picture (a `zombie`), which is neither a peer nor a
    /// straggler.
    fn busy(&self, config: &PeerConfig) -> bool {
        let frozen = self.repeats >= 3 && self.ts_ms - self.changed_ts >= 3_000;
        !frozen
            && self
                .busy_since
                .is_some_and(|since| self.ts_ms - since >= config.settle_ms)
    }
}

/// A peer rule's change on one GPU, for the engine to apply.
#[derive(Debug)]
pub(crate) enum PeerChange {
    Opened(Finding),
    Cleared { kind: Kind, at_ms: i64, why: String },
}

/// The median of sorted `v` without one element equal to `x` (which `v`
/// holds); `v` must have at least 2 elements.
fn median_without(v: &[f32], x: f32) -> f64 {
    let i = v.partition_point(|&y| y.total_cmp(&x).is_lt());
    debug_assert!(i < v.len() && v[i] == x);
    // The k-th element of `v` with index `i` taken out.
    let at = |k: usize| if k < i { v[k] } else { v[k + 1] } as f64;
    let m = v.len() - 1;
    if m % 2 == 1 {
        at(m / 2)
    } else {
        (at(m / 2 - 1) + at(m / 2)) / 2.0
    }
}

/// Whether the elements of sorted `v` other than one equal to `me` are in
/// step: within `band` (a fraction) of `median`, all of them but one in
/// six beyond the first (3 to 6 peers: all; 7 to 12: all but one).
fn in_step(v: &[f32], me: f32, median: f64, band: f64) -> bool {
    let (lo, hi) = (median * (1.0 - band), median * (1.0 + band));
    let from = v.partition_point(|&x| (x as f64) < lo);
    let to = v.partition_point(|&x| (x as f64) <= hi);
    let mine = (lo..=hi).contains(&(me as f64)) as usize;
    let others_within = (to - from) - mine;
    let others = v.len() - 1;
    others_within + (others - 1) / 6 >= others
}

/// What a rule found at one evaluation: whether it held, and the figures
/// for the evidence (formatted only when an event opens).
#[derive(Debug, Clone, Copy)]
struct Verdict {
    holds: bool,
    /// How much the evaluation's time counts toward the hold: the
    /// shortfall over the rule's deficit, in `[1, max_weight]`.
    weight: f64,
    /// The GPU's value and the peers' median, per signal compared.
    figures: [(f64, f64); 2],
    peers: usize,
}

impl Verdict {
    fn evidence(&self, kind: Kind, host: &str) -> String {
        let d = |(mine, med): (f64, f64)| -100.0 * (1.0 - mine / med);
        let [a, b] = self.figures;
        match kind {
            Kind::Straggler => format!(
                "SM activity {:.3} vs {:.3} and power {:.0} W vs {:.0} W, the median of {} busy peers on {host} ({:+.1} %, {:+.1} %)",
                a.0,
                a.1,
                b.0,
                b.1,
                self.peers,
                d(a),
                d(b)
            ),
            _ => format!(
                "SM clock {:.0} MHz vs {:.0} MHz, the median of {} busy peers on {host} ({:+.1} %), no thermal or hardware slowdown reason",
                a.0,
                a.1,
                self.peers,
                d(a)
            ),
        }
    }
}

/// One host's GPUs, for [`evaluate_host`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostGroup<'a> {
    /// The host's name, for evidence.
    pub(crate) name: &'a str,
    /// Its GPUs' slots (indexes into the signals).
    pub(crate) slots: &'a [u32],
    /// Its poll interval, ms (0 when unknown).
    pub(crate) interval_ms: i64,
}

/// Compares the GPUs of one host, less those `excluded` (lost GPUs:
/// neither peers nor judged). Appends changes as `(slot, change)`.
/// `scratch` is reused across calls.
///
/// Each signal of the host's busy GPUs is sorted once; a GPU's peers'
/// median, and whether they are in step, come from that order without the
/// GPU.
pub(crate) fn evaluate_host(
    signals: &mut [PeerSignals],
    group: HostGroup<'_>,
    excluded: impl Fn(u32) -> bool,
    config: &PeerConfig,
    scratch: &mut Scratch,
    out: &mut Vec<(u32, PeerChange)>,
) {
    let HostGroup {
        name: host,
        slots,
        interval_ms,
    } = group;
    if !slots.iter().any(|&s| signals[s as usize].fresh) {
        return;
    }
    let newest = slots
        .iter()
        .map(|&s| signals[s as usize].ts_ms)
        .max()
        .unwrap_or(0);
    let stale_ms = (3 * interval_ms).max(3_000);
    let Scratch {
        busy,
        power,
        activity,
        clock,
    } = scratch;
    // The busy GPUs that can be compared, and their signals in order.
    busy.clear();
    busy.extend(slots.iter().copied().filter(|&s| {
        if excluded(s) {
            return false;
        }
        let s = &signals[s as usize];
        newest - s.ts_ms <= stale_ms && s.busy(config) && s.have & (ACT | POWER) == ACT | POWER
    }));
    let compared = busy.len() > config.min_peers;
    // GPUs busy now, settled or not: at a job's start, its peers that
    // started a few polls later count toward a big group already.
    let starting = slots
        .iter()
        .filter(|&&s| {
            let g = &signals[s as usize];
            !excluded(s) && newest - g.ts_ms <= stale_ms && g.busy_since.is_some()
        })
        .count();
    let all_clocks = busy.iter().all(|&j| signals[j as usize].have & CLOCK != 0);
    if compared {
        let gather = |out: &mut Vec<f32>, f: fn(&PeerSignals) -> f32| {
            out.clear();
            out.extend(busy.iter().map(|&j| f(&signals[j as usize])));
        };
        gather(power, |s| s.power);
        gather(activity, |s| s.activity);
        power.sort_unstable_by(f32::total_cmp);
        activity.sort_unstable_by(f32::total_cmp);
        if all_clocks {
            gather(clock, |s| s.clock);
            clock.sort_unstable_by(f32::total_cmp);
        }
    }
    let n_peers = busy.len().saturating_sub(1);
    for &slot in slots {
        let me = signals[slot as usize];
        if !me.fresh {
            continue;
        }
        let judged = compared && busy.contains(&slot);
        let mut straggler = None;
        let mut clock_verdict = None;
        let mut in_step_since = None;
        if judged {
            let power_med = median_without(power, me.power);
            let act_med = median_without(activity, me.activity);
            let together =
                power_med > 0.0 && in_step(power, me.power, power_med, config.max_peer_spread);
            if together {
                in_step_since = Some(me.in_step_since.unwrap_or(me.ts_ms));
            }
            // With many peers, the evidence counts, weighted, from the first
            // comparison in step (a run ends when the peers fall out of
            // step, so its minimum length is an in-step wait too). Fewer
            // peers fall in step by chance more often (unrelated work on
            // half a host), so for them it counts only once they have been
            // in step for a while, unweighted.
            let many = starting.saturating_sub(1) >= config.weighted_min_peers;
            if in_step_since.is_some_and(|t| many || me.ts_ms - t >= config.in_step_ms) {
                let d_power = 1.0 - me.power as f64 / power_med;
                let d_act = if act_med > 0.0 {
                    1.0 - me.activity as f64 / act_med
                } else {
                    0.0
                };
                straggler = Some(Verdict {
                    holds: d_power >= config.straggler_deficit
                        && d_act >= config.straggler_deficit
                        && d_act <= 0.5,
                    weight: if many {
                        weight(d_power.min(d_act), config.straggler_deficit, config)
                    } else {
                        1.0
                    },
                    figures: [(me.activity as f64, act_med), (me.power as f64, power_med)],
                    peers: n_peers,
                });
            }
        }
        if judged && all_clocks {
            let clock_med = median_without(clock, me.clock);
            if clock_med > 0.0 && in_step(clock, me.clock, clock_med, config.max_peer_spread) {
                let d = 1.0 - me.clock as f64 / clock_med;
                let throttled = u64::from(me.reasons) & THROTTLE_BITS != 0;
                clock_verdict = Some(Verdict {
                    holds: d >= config.clock_deficit && !throttled,
                    weight: weight(d, config.clock_deficit, config),
                    figures: [(me.clock as f64, clock_med), (0.0, 0.0)],
                    peers: n_peers,
                });
            }
        }
        let s = &mut signals[slot as usize];
        s.fresh = false;
        s.in_step_since = in_step_since;
        let ts = s.ts_ms;
        for (kind, verdict) in [
            (Kind::Straggler, straggler),
            (Kind::ClockDegraded, clock_verdict),
        ] {
            let rule = match kind {
                Kind::Straggler => &mut s.straggler,
                _ => &mut s.clock_rule,
            };
            if let Some(c) = step(rule, kind, ts, verdict, host, config) {
                out.push((slot, c));
            }
        }
    }
}

/// Weight of a shortfall `d` against a rule's `deficit`: `d / deficit`
/// within `[1, max_weight]`.
fn weight(d: f64, deficit: f64, config: &PeerConfig) -> f64 {
    (d / deficit).clamp(1.0, config.max_weight)
}

/// Buffers [`evaluate_host`] reuses, so that a tick allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    busy: Vec<u32>,
    power: Vec<f32>,
    activity: Vec<f32>,
    clock: Vec<f32>,
}

/// Advances one rule by one evaluation at `ts`: `verdict` is `None` when the
/// GPU could not be judged.
fn step(
    rule: &mut RuleState,
    kind: Kind,
    ts: i64,
    verdict: Option<Verdict>,
    host: &str,
    config: &PeerConfig,
) -> Option<PeerChange> {
    match verdict {
        Some(v) if v.holds => {
            if rule.holding_since.is_some() {
                let dt = (ts - rule.last_judged).min(config.hold_ms);
                rule.credit_ms =
                    (rule.credit_ms + (dt as f64 * v.weight) as i64).min(config.hold_ms);
            }
            rule.last_judged = ts;
            rule.last_held = ts;
            let since = *rule.holding_since.get_or_insert(ts);
            if !rule.open && rule.credit_ms >= config.hold_ms && ts - since >= config.min_hold_ms {
                rule.open = true;
                let action = match kind {
                    Kind::Straggler => {
                        "this GPU holds back its host's job: check its power cap, PCIe and NVLink links and cooling; move the job off it if it persists"
                    }
                    _ => {
                        "its SM clock stays below its busy peers' with no throttle reason: check application clocks and power limits (nvidia-smi -q -d CLOCK,POWER); reset the GPU if it persists"
                    }
                };
                return Some(PeerChange::Opened(Finding {
                    kind,
                    severity: Severity::Warning,
                    xid: None,
                    onset_ts_ms: since,
                    detected_ts_ms: ts,
                    action,
                    evidence: format!(
                        "{}, for {:.0} s",
                        v.evidence(kind, host),
                        (ts - since) as f64 / 1000.0
                    ),
                }));
            }
            None
        }
        Some(_) => {
            if rule.holding_since.is_some() {
                rule.credit_ms -= (ts - rule.last_judged).min(config.hold_ms);
                if rule.credit_ms <= 0 {
                    rule.credit_ms = 0;
                    rule.holding_since = None;
                }
            }
            rule.last_judged = ts;
            (rule.open && ts - rule.last_held >= config.clear_after_ms).then(|| {
                rule.open = false;
                PeerChange::Cleared {
                    kind,
                    at_ms: ts,
                    why: format!(
                        "back in line with its peers for {:.0} s",
                        (ts - rule.last_held) as f64 / 1000.0
                    ),
                }
            })
        }
        None => {
            rule.holding_since = None;
            rule.credit_ms = 0;
            let since = rule.last_judged.max(rule.last_held);
            (rule.open && ts - since >= config.unjudged_clear_ms).then(|| {
                rule.open = false;
                PeerChange::Cleared {
                    kind,
                    at_ms: ts,
                    why: format!(
                        "not comparable with busy peers for {:.0} s (idle, or its job ended)",
                        (ts - since) as f64 / 1000.0
                    ),
                }
            })
        }
    }
}

#[cfg(test)]
mod tests;
