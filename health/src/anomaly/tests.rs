//! `anomaly` on hand-built sequences and on the real recordings.

use super::*;
use crate::real_data::{B1, T13, load, skip};

const T0: i64 = 1_700_000_000_000;

/// A healthy GPU's temperature for a steady load: 28 °C + 0.07 °C/W, reached
/// through a 20 s first-order lag, plus a small wobble.
struct Gpu {
    temp: f64,
    second: i64,
}

impl Gpu {
    fn new() -> Self {
        Gpu {
            temp: 33.0,
            second: 0,
        }
    }

    /// One 1 Hz poll at `power` W, `extra` °C above the healthy model.
    fn poll(&mut self, d: &mut AnomalyDetector, power: f64, extra: f64) -> Vec<Transition> {
        let target = 28.0 + 0.07 * power;
        self.temp += (target - self.temp) / 20.0;
        let wobble = ((self.second * 7919) % 13) as f64 / 13.0 - 0.5;
        let p = Poll::new(T0 + self.second * 1000)
            .with(Field::PowerUsage, power)
            .with(Field::GpuTemp, (self.temp + extra + wobble).round());
        self.second += 1;
        let mut out = Vec::new();
        d.observe(&p, &mut out);
        out
    }

    /// `seconds` of a job that alternates busy (600 W) and idle (70 W)
    /// every 5 minutes; `extra(second)` °C on top of the healthy model.
    fn work(
        &mut self,
        d: &mut AnomalyDetector,
        seconds: i64,
        extra: impl Fn(i64) -> f64,
    ) -> Vec<Transition> {
        let mut all = Vec::new();
        for _ in 0..seconds {
            let power = if (self.second / 300) % 2 == 0 {
                600.0
            } else {
                70.0
            };
            let e = extra(self.second);
            all.extend(self.poll(d, power, e));
        }
        all
    }
}

fn detector() -> AnomalyDetector {
    AnomalyDetector::new(AnomalyConfig::default())
}

#[test]
fn healthy_load_changes_and_a_warmer_room_do_not_fire() {
    let mut d = detector();
    let mut g = Gpu::new();
    // 4 hours of busy and idle, the room 6 °C warmer for an hour in the middle.
    let out = g.work(&mut d, 4 * 3600, |s| {
        if (7200..10800).contains(&s) { 6.0 } else { 0.0 }
    });
    assert!(out.is_empty(), "{out:?}");
    // And a slow drift of +12 °C over 4 hours (dust): learned, not fired.
    let out = g.work(&mut d, 4 * 3600, |s| {
        12.0 * (s - 4 * 3600) as f64 / (4.0 * 3600.0)
    });
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn a_cooling_failure_fires_within_its_hold_and_clears_after_the_repair() {
    let mut d = detector();
    let mut g = Gpu::new();
    assert!(g.work(&mut d, 3600, |_| 0.0).is_empty());
    // The fan fails at 3600 s: +0.5 °C/s up to +25 °C.
    let out = g.work(&mut d, 600, |s| ((s - 3600) as f64 * 0.5).min(25.0));
    assert_eq!(out.len(), 1, "{out:?}");
    let Transition::Opened(f) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!((f.kind, f.severity), (Kind::Anomaly, Severity::Warning));
    // +10 °C is reached at about 3620 s; then 60 s of hold.
    let onset = (f.onset_ts_ms - T0) / 1000;
    let detected = (f.detected_ts_ms - T0) / 1000;
    assert!((3615..=3630).contains(&onset), "{onset}");
    assert!((3675..=3695).contains(&detected), "{detected}");
    assert!(f.evidence.starts_with("temperature "), "{}", f.evidence);
    // Repaired at 4200 s: clears 5 min after the residual fell under 5 °C.
    let out = g.work(&mut d, 900, |_| 0.0);
    assert_eq!(out.len(), 1, "{out:?}");
    let Transition::Cleared(c) = &out[0] else {
        panic!("{out:?}")
    };
    let cleared = (c.cleared_ts_ms - T0) / 1000;
    assert!((4490..=4540).contains(&cleared), "{cleared}");
}

#[test]
fn hot_while_idle_fires_and_hot_while_busy_does_not() {
    // Idle for an hour, then hot at 70 W: 55 °C where 33 °C is usual.
    let mut d = detector();
    let mut g = Gpu::new();
    for _ in 0..3600 {
        assert!(g.poll(&mut d, 70.0, 0.0).is_empty());
    }
    let mut fired = Vec::new();
    for _ in 0..120 {
        fired.extend(g.poll(&mut d, 70.0, 22.0));
    }
    assert_eq!(fired.len(), 1, "{fired:?}");
    // 70 °C while busy at 600 W is what this GPU always does: nothing.
    let mut d = detector();
    let mut g = Gpu::new();
    let out = g.work(&mut d, 7200, |_| 0.0);
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn nothing_fires_before_the_warm_up_and_missing_fields_are_no_evidence() {
    let mut d = detector();
    let mut g = Gpu::new();
    let out = g.work(&mut d, 170, |_| 40.0);
    assert!(out.is_empty(), "{out:?}");
    let mut out = Vec::new();
    d.observe(
        &Poll::new(T0 + 10_000_000).with(Field::GpuTemp, 99.0),
        &mut out,
    );
    assert!(out.is_empty());
}

#[test]
fn config_is_validated() {
    assert!(AnomalyConfig::default().validate().is_ok());
    let bad = AnomalyConfig {
        memory_ms: 1,
        ..AnomalyConfig::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "anomaly.memory_ms");
}

/// Feeds one GPU's polls; returns the transitions.
fn replay(polls: &[Poll]) -> Vec<Transition> {
    let mut d = detector();
    let mut out = Vec::new();
    for p in polls {
        d.observe(p, &mut out);
    }
    out
}

#[test]
fn the_real_recordings_fire_nothing_and_a_spliced_heat_ramp_fires() {
    for name in [T13, B1] {
        if skip(name) {
            continue;
        }
        let gpus = load(name).unwrap();
        for (g, polls) in gpus.iter().enumerate() {
            let tenth: Vec<Poll> = polls.iter().skip(3).step_by(10).cloned().collect();
            for (rate, p) in [("10 Hz", polls.clone()), ("1 Hz", tenth)] {
                let out = replay(&p);
                assert!(out.is_empty(), "{name} GPU {g} at {rate}: {out:?}");
            }
        }
    }
    if skip(T13) {
        return;
    }
    // A cooling failure in t13's steady phase: +0.5 °C/s from 200 s on.
    let gpus = load(T13).unwrap();
    let t0 = gpus[0][0].ts_ms;
    let from = t0 + 200_000;
    for (g, polls) in gpus.iter().enumerate() {
        let mut hot = polls.clone();
        for p in hot.iter_mut().filter(|p| p.ts_ms >= from) {
            if let Some(t) = p.get(Field::GpuTemp) {
                let extra = ((p.ts_ms - from) as f64 / 2000.0).min(30.0);
                p.set(Field::GpuTemp, t + extra);
            }
        }
        let out = replay(&hot);
        assert_eq!(out.len(), 1, "GPU {g}: {out:?}");
        let Transition::Opened(f) = &out[0] else {
            panic!("GPU {g}: {out:?}")
        };
        let after = f.detected_ts_ms - from;
        assert!((60_000..=100_000).contains(&after), "GPU {g}: {after} ms");
    }
}
