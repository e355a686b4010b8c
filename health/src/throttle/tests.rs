//! Throttle detector tests on hand-built poll sequences (default config:
//! 3 polls and 10 s to open, 30 s quiet to clear, counters count at >= 10 %
//! of the interval). Expected values are worked out by hand.

use super::*;

fn det() -> ThrottleDetector {
    ThrottleDetector::new(ThrottleConfig::default())
}

fn obs(d: &mut ThrottleDetector, poll: Poll) -> Vec<Transition> {
    let mut out = Vec::new();
    d.observe(&poll, &mut out);
    out
}

fn mask(ts_ms: i64, bits: u64) -> Poll {
    Poll::new(ts_ms).with(Field::ClockThrottleReasons, bits as f64)
}

fn opened(t: &[Transition]) -> &Finding {
    match t {
        [Transition::Opened(f)] => f,
        other => panic!("expected one Opened, got {other:?}"),
    }
}

const THERMAL_CRITICAL: &str =
    "drain the GPU and check its cooling: hardware thermal slowdown cuts clocks by 2x or more";
const THERMAL_WARNING: &str =
    "check cooling (inlet temperature, fans, airflow); the GPU runs at reduced clocks";

#[test]
fn hw_thermal_bits_open_critical_after_three_polls_and_ten_seconds() {
    let mut d = det();
    let hot = |ts| {
        mask(ts, 0x48)
            .with(Field::GpuTemp, 92.0)
            .with(Field::SmClock, 990.0)
    };
    assert_eq!(obs(&mut d, hot(0)), vec![]);
    assert_eq!(obs(&mut d, hot(5_000)), vec![], "2 polls, 5 s");
    let t = obs(&mut d, hot(10_000));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::ThermalThrottle,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 0,
            detected_ts_ms: 10_000,
            action: THERMAL_CRITICAL,
            evidence: "throttled for 3 polls over 10.0 s; clock events 0x48 \
                       (hw_slowdown, hw_thermal); gpu temp 92 C; sm clock 990 MHz"
                .to_string(),
        }
    );
    // Still throttled: the event stays open, nothing new.
    assert_eq!(obs(&mut d, hot(15_000)), vec![]);
}

#[test]
fn at_one_second_polls_it_takes_ten_seconds() {
    let mut d = det();
    for k in 0..10 {
        assert_eq!(obs(&mut d, mask(k * 1_000, 0x40)), vec![], "poll at {k} s");
    }
    let t = obs(&mut d, mask(10_000, 0x40));
    let f = opened(&t);
    assert_eq!((f.onset_ts_ms, f.detected_ts_ms), (0, 10_000));
    assert_eq!(f.severity, Severity::Critical);
}

#[test]
fn at_thirty_second_polls_it_takes_three_polls() {
    let mut d = det();
    assert_eq!(obs(&mut d, mask(0, 0x40)), vec![]);
    assert_eq!(obs(&mut d, mask(30_000, 0x40)), vec![], "2 polls < 3");
    let t = obs(&mut d, mask(60_000, 0x40));
    assert_eq!(opened(&t).detected_ts_ms, 60_000);
}

#[test]
fn one_poll_blip_does_not_fire() {
    let mut d = det();
    for k in 0..60 {
        let bits = if k == 5 { 0x48 } else { 0x0 };
        assert_eq!(obs(&mut d, mask(k * 1_000, bits)), vec![], "poll at {k} s");
    }
}

#[test]
fn short_bursts_do_not_fire() {
    // 5 s of HW thermal at 10 Hz: 51 polls, but under 10 s.
    let mut d = det();
    for k in 0..=50 {
        assert_eq!(obs(&mut d, mask(k * 100, 0x40)), vec![]);
    }
    for k in 51..=400 {
        assert_eq!(obs(&mut d, mask(k * 100, 0x0)), vec![]);
    }
    // Two 9 s bursts separated by one clean poll: each run starts over.
    let mut d = det();
    for k in 0..=9 {
        assert_eq!(obs(&mut d, mask(k * 1_000, 0x40)), vec![]);
    }
    assert_eq!(obs(&mut d, mask(10_000, 0x0)), vec![]);
    for k in 11..=20 {
        assert_eq!(obs(&mut d, mask(k * 1_000, 0x40)), vec![], "poll at {k} s");
    }
}

#[test]
fn sw_thermal_warns_then_hw_thermal_escalates() {
    let mut d = det();
    assert_eq!(obs(&mut d, mask(0, 0x20)), vec![]);
    assert_eq!(obs(&mut d, mask(5_000, 0x20)), vec![]);
    let t = obs(&mut d, mask(10_000, 0x20));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(f.action, THERMAL_WARNING);
    assert_eq!(
        f.evidence,
        "throttled for 3 polls over 10.0 s; clock events 0x20 (sw_thermal)"
    );
    let t = obs(&mut d, mask(15_000, 0x60));
    assert_eq!(
        t,
        vec![Transition::Escalated(Escalation {
            key: EventKey::of(Kind::ThermalThrottle),
            severity: Severity::Critical,
            ts_ms: 15_000,
            action: THERMAL_CRITICAL,
            evidence: "hardware slowdown: clock events 0x60 (sw_thermal, hw_thermal)".to_string(),
        })]
    );
    assert_eq!(obs(&mut d, mask(20_000, 0x60)), vec![], "already critical");
}

#[test]
fn sw_power_cap_idle_and_other_benign_reasons_never_fire() {
    let mut d = det();
    let benign = [0x4, 0x5, 0x1, 0x2, 0x10, 0x100, 0x0];
    for k in 0..1_200 {
        // 5 min of SW power cap alone, 5 min of power cap + idle, then the
        // other benign bits in turn; SW power cap the whole second on both
        // counters that report it.
        let bits = match k {
            0..300 => 0x4,
            300..600 => 0x5,
            _ => benign[k as usize % benign.len()],
        };
        let ns = k as f64 * 1e9;
        let poll = mask(k * 1_000, bits)
            .with(Field::PowerViolation, ns)
            .with(Field::ClocksEventSwPowerCapNs, ns);
        assert_eq!(obs(&mut d, poll), vec![], "poll at {k} s");
    }
}

#[test]
fn clears_thirty_seconds_after_the_last_throttled_poll() {
    let mut d = det();
    for ts in [0, 5_000] {
        assert_eq!(obs(&mut d, mask(ts, 0x48)), vec![]);
    }
    assert_eq!(opened(&obs(&mut d, mask(10_000, 0x48))).onset_ts_ms, 0);
    assert_eq!(
        obs(&mut d, mask(15_000, 0x48)),
        vec![],
        "last throttled poll"
    );
    for ts in [20_000, 25_000, 40_000] {
        assert_eq!(obs(&mut d, mask(ts, 0x0)), vec![], "clean at {ts}");
    }
    assert_eq!(
        obs(&mut d, mask(45_000, 0x0)),
        vec![Transition::Cleared(Clearing {
            key: EventKey::of(Kind::ThermalThrottle),
            cleared_ts_ms: 45_000,
            evidence: "no thermal_throttle for 30.0 s (last throttled poll at 15000 ms)"
                .to_string(),
        })]
    );
}

#[test]
fn polls_without_throttle_fields_neither_fire_nor_clear() {
    let mut d = det();
    for ts in [0, 5_000] {
        assert_eq!(obs(&mut d, mask(ts, 0x40)), vec![]);
    }
    assert_eq!(
        opened(&obs(&mut d, mask(10_000, 0x40))).detected_ts_ms,
        10_000
    );
    // A minute of polls that carry only a temperature: no evidence either way.
    for ts in (20_000..=70_000).step_by(10_000) {
        let poll = Poll::new(ts).with(Field::GpuTemp, 70.0);
        assert_eq!(obs(&mut d, poll), vec![], "empty poll at {ts}");
    }
    // The first clean informative poll: 80 s - 10 s >= 30 s.
    let t = obs(&mut d, mask(80_000, 0x0));
    assert!(
        matches!(t.as_slice(), [Transition::Cleared(c)] if c.cleared_ts_ms == 80_000),
        "{t:?}"
    );
}

#[test]
fn hw_power_brake_opens_power_throttle_only() {
    let mut d = det();
    assert_eq!(obs(&mut d, mask(0, 0x88)), vec![]);
    assert_eq!(obs(&mut d, mask(5_000, 0x88)), vec![]);
    let t = obs(&mut d, mask(10_000, 0x88));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::PowerThrottle,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 0,
            detected_ts_ms: 10_000,
            action: "drain the GPU and check the node's power delivery (PSU, power brake): \
                     hardware slowdown cuts clocks by 2x or more",
            evidence: "throttled for 3 polls over 10.0 s; clock events 0x88 \
                       (hw_slowdown, hw_power_brake)"
                .to_string(),
        }
    );
}

#[test]
fn hw_slowdown_alone_counts_as_power() {
    let mut d = det();
    obs(&mut d, mask(0, 0x8));
    obs(&mut d, mask(5_000, 0x8));
    let t = obs(&mut d, mask(10_000, 0x8));
    assert_eq!(opened(&t).kind, Kind::PowerThrottle);
}

#[test]
fn hw_thermal_counter_alone_fires() {
    let mut d = det();
    let hw = |ts: i64, ns: f64| Poll::new(ts).with(Field::ClocksEventHwThermSlowdownNs, ns);
    // The first reading is a baseline: no evidence yet.
    assert_eq!(obs(&mut d, hw(0, 0.0)), vec![]);
    // Throttled the whole second from 1 s on: run starts at 1 s, 10 s later
    // (11 polls) it fires.
    for k in 1..=10 {
        assert_eq!(obs(&mut d, hw(k * 1_000, k as f64 * 1e9)), vec![], "{k} s");
    }
    let t = obs(&mut d, hw(11_000, 11e9));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::ThermalThrottle,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 1_000,
            detected_ts_ms: 11_000,
            action: THERMAL_CRITICAL,
            evidence: "throttled for 11 polls over 10.0 s; hw thermal slowdown 100% of 1.0 s"
                .to_string(),
        }
    );
}

#[test]
fn thermal_violation_counter_is_a_warning() {
    let mut d = det();
    let tv = |ts: i64, ns: f64| Poll::new(ts).with(Field::ThermalViolation, ns);
    assert_eq!(obs(&mut d, tv(0, 0.0)), vec![]);
    // 0.5 s of each 1 s interval: 50 % >= 10 %.
    for k in 1..=10 {
        assert_eq!(obs(&mut d, tv(k * 1_000, k as f64 * 5e8)), vec![]);
    }
    let t = obs(&mut d, tv(11_000, 11.0 * 5e8));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(
        f.evidence,
        "throttled for 11 polls over 10.0 s; thermal violation 50% of 1.0 s"
    );
}

#[test]
fn counter_growth_under_ten_percent_is_not_throttling() {
    let mut d = det();
    for k in 0..=120 {
        // 50 ms of each second: 5 %.
        let poll = Poll::new(k * 1_000).with(Field::ClocksEventHwThermSlowdownNs, k as f64 * 5e7);
        assert_eq!(obs(&mut d, poll), vec![], "{k} s");
    }
}

#[test]
fn flapping_bits_with_counters_count_as_continuous() {
    // The bit is seen on every other poll only, but the counter shows 50 % of
    // every interval throttled: every poll from 1 s on is throttled.
    // Poll 0 is throttled by its bit (the counter's first reading is a
    // baseline), so the run starts at 0 and reaches 10 s at the 11th poll.
    let mut d = det();
    let poll = |k: i64| {
        mask(k * 1_000, if k % 2 == 0 { 0x40 } else { 0x0 })
            .with(Field::ClocksEventHwThermSlowdownNs, k as f64 * 5e8)
    };
    for k in 0..=9 {
        assert_eq!(obs(&mut d, poll(k)), vec![], "{k} s");
    }
    let t = obs(&mut d, poll(10));
    assert_eq!(opened(&t).onset_ts_ms, 0);
    assert_eq!(opened(&t).detected_ts_ms, 10_000);
    // Without the counter the same bits never make a run of 3.
    let mut d = det();
    for k in 0..=60 {
        let bits = if k % 2 == 0 { 0x40 } else { 0x0 };
        assert_eq!(obs(&mut d, mask(k * 1_000, bits)), vec![], "{k} s");
    }
}

#[test]
fn counter_reset_is_not_throttling() {
    let mut d = det();
    let hw = |ts: i64, ns: f64| Poll::new(ts).with(Field::ClocksEventHwThermSlowdownNs, ns);
    assert_eq!(obs(&mut d, hw(0, 5e9)), vec![]);
    // Driver reload: 5e9 -> 0 is a reset, then flat.
    for k in 1..=60 {
        assert_eq!(obs(&mut d, hw(k * 1_000, 0.0)), vec![], "{k} s");
    }
    // A reset must not stretch a run: HW thermal bits at 0 s and 5 s, then a
    // clean bitmask at 10 s while the counter drops 9e10 -> 0. Read as
    // growth, that interval would be throttled and the run would reach
    // 3 polls over 10 s.
    let mut d = det();
    let poll =
        |ts: i64, bits: u64, ns: f64| mask(ts, bits).with(Field::ClocksEventHwThermSlowdownNs, ns);
    assert_eq!(obs(&mut d, poll(0, 0x40, 9e10)), vec![]);
    assert_eq!(obs(&mut d, poll(5_000, 0x40, 9e10)), vec![]);
    assert_eq!(obs(&mut d, poll(10_000, 0x0, 0.0)), vec![]);
    assert_eq!(obs(&mut d, poll(15_000, 0x40, 0.0)), vec![]);
}

#[test]
fn stale_and_duplicate_polls_are_ignored() {
    let mut d = det();
    assert_eq!(obs(&mut d, mask(0, 0x40)), vec![]);
    assert_eq!(obs(&mut d, mask(5_000, 0x40)), vec![]);
    // Replays of old timestamps must not count as more throttled polls.
    assert_eq!(obs(&mut d, mask(5_000, 0x40)), vec![]);
    assert_eq!(obs(&mut d, mask(4_000, 0x40)), vec![]);
    assert_eq!(
        obs(&mut d, mask(9_999, 0x40)),
        vec![],
        "3 polls but 9.999 s"
    );
    assert_eq!(opened(&obs(&mut d, mask(10_000, 0x40))).onset_ts_ms, 0);
}

#[test]
fn throttle_config_validation() {
    assert_eq!(ThrottleConfig::default().validate(), Ok(()));
    let bad = ThrottleConfig {
        min_polls: 1,
        ..ThrottleConfig::default()
    };
    assert_eq!(
        bad.validate().map_err(|e| e.field),
        Err("throttle.min_polls")
    );
    let bad = ThrottleConfig {
        min_counter_fraction: 0.0,
        ..ThrottleConfig::default()
    };
    assert_eq!(
        bad.validate().map_err(|e| e.field),
        Err("throttle.min_counter_fraction")
    );
}
