//! `anomaly`: a GPU hot for its load, by its own history.
//!
//! A temperature of 85 °C is normal for a GPU drawing 700 W and alarming for
//! one idling at 70 W; a fixed threshold cannot tell them apart, and each
//! GPU's cooling differs (in the real trace t13 the slope of temperature over
//! power runs from 0.050 to 0.077 °C/W across the 8 GPUs of one node). So
//! each GPU learns its own model, unsupervised and in constant memory:
//!
//! - **Load**: power smoothed with the thermal lag, an exponentially weighted
//!   mean with time constant [`AnomalyConfig::thermal_lag_ms`] (20 s: the
//!   fit of a first-order lag to t13 is best between 10 and 20 s).
//! - **Model**: temperature = a + b · load, fitted by exponentially
//!   forgetting least squares over [`AnomalyConfig::memory_ms`] (1 h of
//!   sample time), with a ridge prior pulling b toward 0.065 °C/W worth
//!   15 min of data spread over ±50 W, so a GPU that has only ever idled
//!   still has a slope.
//! - **Residual**: temperature minus the model's prediction *before* the poll
//!   is learned, and its typical size, an exponentially weighted RMS of past
//!   residuals (10 min), floored at 1 °C.
//!
//! Rule (warning): the residual is at least [`AnomalyConfig::min_excess_c`]
//! (10 °C) and 5 typical residuals, plus 0.015 °C/W for each watt the load
//! is away from the mean load it learned (its slope may be off that much,
//! so far from what it has seen it allows more), for
//! [`AnomalyConfig::hold_ms`] (60 s)
//! more than it is not. The GPU must first have been watched for
//! [`AnomalyConfig::warmup_ms`] (3 min). Polls that fire are not learned,
//! so a failing fan does not teach the model that hot is normal; a slow
//! change (a warmer room over hours) is learned. Onset: the first poll of
//! the run. Clears when the residual stays under half the excess for 5 min.
//!
//! In t13 and b1 (real, 10 Hz and 1 Hz) the largest residual after warm-up
//! is under 10 °C, and nothing fires; a heat ramp spliced into one GPU of
//! t13 fires on it alone (tests). A whole host warming together (its room)
//! moves every GPU by the same few degrees, under the 10 °C floor.

use crate::{
    Clearing, ConfigError, Detector, EventKey, Field, Finding, Kind, Poll, PollClock, Severity,
    Transition,
};

/// Tunables of the anomaly model.
#[derive(Debug, Clone, PartialEq)]
pub struct AnomalyConfig {
    /// Time constant of the load (smoothed power), ms.
    pub thermal_lag_ms: i64,
    /// Time constant of the model's forgetting, ms.
    pub memory_ms: i64,
    /// Time watched before the rule can fire, ms.
    pub warmup_ms: i64,
    /// Least excess over the prediction that fires, °C.
    pub min_excess_c: f64,
    /// Least excess in typical residuals that fires.
    pub min_sigmas: f64,
    /// How long the excess must hold, more than not, ms.
    pub hold_ms: i64,
    /// How long the residual must stay under half the excess to clear, ms.
    pub clear_after_ms: i64,
}

impl Default for AnomalyConfig {
    fn default() -> Self {
        AnomalyConfig {
            thermal_lag_ms: 20_000,
            memory_ms: 3_600_000,
            warmup_ms: 180_000,
            min_excess_c: 10.0,
            min_sigmas: 5.0,
            hold_ms: 60_000,
            clear_after_ms: 300_000,
        }
    }
}

impl AnomalyConfig {
    /// # Errors
    /// The first value out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason| Err(ConfigError { field, reason });
        if self.thermal_lag_ms <= 0 || self.memory_ms <= self.thermal_lag_ms {
            return err(
                "anomaly.memory_ms",
                "thermal lag must be positive and memory longer than it",
            );
        }
        if !(self.min_excess_c > 0.0 && self.min_sigmas > 0.0) {
            return err("anomaly.min_excess_c", "excess and sigmas must be positive");
        }
        if self.warmup_ms < 0 || self.hold_ms < 0 || self.clear_after_ms <= 0 {
            return err("anomaly.hold_ms", "durations must be >= 0 (clearing > 0)");
        }
        Ok(())
    }
}

/// Prior slope of temperature over power, °C/W (H100, t13's middle).
const PRIOR_SLOPE: f64 = 0.065;
/// Weight of the prior, in ms of data, and its assumed load spread, W.
const PRIOR_WEIGHT_MS: f64 = 900_000.0;
const PRIOR_SPREAD_W: f64 = 50.0;
/// How far the slope may be off, °C/W: the real t13's GPUs range over
/// 0.050-0.077, the prior is 0.065.
const SLOPE_DOUBT: f64 = 0.015;
/// Time constant of the typical residual, ms.
const RESIDUAL_MEMORY_MS: f64 = 600_000.0;
/// Floor of the typical residual, °C.
const RESIDUAL_FLOOR_C: f64 = 1.0;

/// See the module docs. 192 bytes, no heap.
#[derive(Debug, Clone)]
pub struct AnomalyDetector {
    config: AnomalyConfig,
    clock: PollClock,
    /// Sample time of the first poll with power and temperature.
    first_ts: Option<i64>,
    last_ts: i64,
    /// Smoothed power, W.
    load: f64,
    /// Forgetting sums: weight (ms), means of load and temperature, and the
    /// centred second moments (load², load × temperature).
    w: f64,
    mean_p: f64,
    mean_t: f64,
    m_pp: f64,
    m_pt: f64,
    /// Mean square of past residuals, °C².
    resid_ms: f64,
    /// Current run of excess: its start, and time held less time not.
    run_since: Option<i64>,
    credit_ms: i64,
    open: bool,
    /// Last poll at which the residual was at least half the excess.
    last_hot: i64,
}

impl AnomalyDetector {
    pub fn new(config: AnomalyConfig) -> Self {
        AnomalyDetector {
            config,
            clock: PollClock::default(),
            first_ts: None,
            last_ts: 0,
            load: 0.0,
            w: 0.0,
            mean_p: 0.0,
            mean_t: 0.0,
            m_pp: 0.0,
            m_pt: 0.0,
            resid_ms: RESIDUAL_FLOOR_C * RESIDUAL_FLOOR_C,
            run_since: None,
            credit_ms: 0,
            open: false,
            last_hot: 0,
        }
    }

    /// The temperature the model expects at `load`, °C.
    fn predict(&self, load: f64) -> f64 {
        let prior = PRIOR_WEIGHT_MS * PRIOR_SPREAD_W * PRIOR_SPREAD_W;
        let slope = (self.m_pt + prior * PRIOR_SLOPE) / (self.m_pp + prior);
        self.mean_t + slope * (load - self.mean_p)
    }

    /// Adds (load, temp) with weight `dt` ms, forgetting older data.
    fn learn(&mut self, load: f64, temp: f64, dt: f64) {
        let keep = (-dt / self.config.memory_ms as f64).exp();
        let w_old = self.w * keep;
        let w = w_old + dt;
        let (dp, dtmp) = (load - self.mean_p, temp - self.mean_t);
        // West's weighted update of mean and co-moments.
        self.mean_p += dt / w * dp;
        self.mean_t += dt / w * dtmp;
        self.m_pp = self.m_pp * keep + w_old * dt / w * dp * dp;
        self.m_pt = self.m_pt * keep + w_old * dt / w * dp * dtmp;
        self.w = w;
    }
}

impl Detector for AnomalyDetector {
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::Anomaly]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        let ts = poll.ts_ms;
        let (Some(power), Some(temp)) = (poll.get(Field::PowerUsage), poll.get(Field::GpuTemp))
        else {
            return;
        };
        if !self.clock.accept(ts) {
            return;
        }
        let Some(first) = self.first_ts else {
            self.first_ts = Some(ts);
            self.last_ts = ts;
            self.load = power;
            self.mean_p = power;
            self.mean_t = temp;
            return;
        };
        // A gap longer than the lag model's reach forgets the load, and
        // counts for one lag in the fit.
        let lag = self.config.thermal_lag_ms as f64;
        let dt = ((ts - self.last_ts) as f64).min(lag);
        self.last_ts = ts;
        self.load += (1.0 - (-dt / lag).exp()) * (power - self.load);
        let expected = self.predict(self.load);
        let residual = temp - expected;
        let typical = self.resid_ms.sqrt().max(RESIDUAL_FLOOR_C);
        // Far from the loads it has seen, the slope is less certain: allow
        // for a slope off by SLOPE_DOUBT (a GPU that idled for an hour, then
        // runs at 650 W, is predicted with the prior's slope).
        let excess = self
            .config
            .min_excess_c
            .max(self.config.min_sigmas * typical)
            + SLOPE_DOUBT * (self.load - self.mean_p).abs();
        let armed = ts - first >= self.config.warmup_ms;
        let hot = armed && residual >= excess;
        if !hot {
            // What fires is not learned; everything else is.
            self.learn(self.load, temp, dt);
            let k = (-dt / RESIDUAL_MEMORY_MS).exp();
            self.resid_ms = k * self.resid_ms + (1.0 - k) * residual * residual;
        }
        let step = dt as i64;
        if hot {
            if self.run_since.is_some() {
                self.credit_ms += step;
            }
            let since = *self.run_since.get_or_insert(ts);
            if !self.open && self.credit_ms >= self.config.hold_ms {
                self.open = true;
                out.push(Transition::Opened(Finding {
                    kind: Kind::Anomaly,
                    severity: Severity::Warning,
                    xid: None,
                    onset_ts_ms: since,
                    detected_ts_ms: ts,
                    action: "the GPU runs hotter than its own history at this load: check its fans, airflow and heat sink before it throttles",
                    evidence: format!(
                        "temperature {temp:.0} °C where {expected:.0} ± {typical:.1} °C is usual at {:.0} W (its own history), for {:.0} s",
                        self.load,
                        (ts - since) as f64 / 1000.0
                    ),
                }));
            }
        } else if self.run_since.is_some() {
            self.credit_ms -= step;
            if self.credit_ms <= 0 {
                self.credit_ms = 0;
                self.run_since = None;
            }
        }
        if residual >= excess / 2.0 {
            self.last_hot = ts;
        }
        if self.open && ts - self.last_hot >= self.config.clear_after_ms {
            self.open = false;
            out.push(Transition::Cleared(Clearing {
                key: EventKey::of(Kind::Anomaly),
                cleared_ts_ms: ts,
                evidence: format!(
                    "temperature within {:.0} °C of its usual for {:.0} s",
                    excess / 2.0,
                    (ts - self.last_hot) as f64 / 1000.0
                ),
            }));
        }
    }
}

#[cfg(test)]
mod tests;
