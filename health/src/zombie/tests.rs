//! Zombie detector tests: hand-built poll sequences with the default config
//! (energy frozen 60 s → critical; readings frozen 10 min → warning; busy but
//! idle 60 s → warning; 3 polls at least; clear after 2 min without a holding
//! rule), then the real H100 recordings in `shared/data/real`, healthy and
//! with faults spliced in. Expected values are worked out by hand.

use super::*;
use crate::real_data::{B1, T13, load, skip};

fn det() -> ZombieDetector {
    ZombieDetector::new(ZombieConfig::default())
}

fn obs(d: &mut ZombieDetector, poll: &Poll) -> Vec<Transition> {
    let mut out = Vec::new();
    d.observe(poll, &mut out);
    out
}

/// Feeds `polls`; returns each transition with the sample time of the poll
/// that caused it.
fn feed(d: &mut ZombieDetector, polls: impl IntoIterator<Item = Poll>) -> Vec<(i64, Transition)> {
    let mut seen = Vec::new();
    for p in polls {
        for t in obs(d, &p) {
            seen.push((p.ts_ms, t));
        }
    }
    seen
}

fn opened(t: &[Transition]) -> &Finding {
    match t {
        [Transition::Opened(f)] => f,
        other => panic!("expected one Opened, got {other:?}"),
    }
}

fn cleared(t: &[Transition]) -> &Clearing {
    match t {
        [Transition::Cleared(c)] => c,
        other => panic!("expected one Cleared, got {other:?}"),
    }
}

/// A live GPU at second `s` (1 Hz): power and temperature wander, the SM
/// clock is pinned; the caller sets the energy counter.
fn live(s: i64) -> Poll {
    Poll::new(s * 1_000)
        .with(Field::PowerUsage, 100.0 + (s % 7) as f64)
        .with(Field::GpuTemp, 40.0 + (s % 3) as f64)
        .with(Field::SmClock, 1_980.0)
}

/// Energy at second `s` of a GPU drawing 100 W (100,000 mJ per second) from
/// 1,000,000 mJ at 0 s, frozen at its value of second `freeze` onwards.
fn energy_frozen_from(s: i64, freeze: i64) -> f64 {
    1_000_000.0 + s.min(freeze) as f64 * 100_000.0
}

#[test]
fn frozen_energy_opens_critical_a_minute_after_its_last_change_and_clears() {
    let mut d = det();
    // The counter moves until 10 s (2,000,000 mJ), then repeats it: 10 s is
    // the last fresh reading, 11 s the first repeat (onset), 10 s + 60 s =
    // 70 s the detection; 61 polls (10 s..=70 s).
    let poll = |s| live(s).with(Field::TotalEnergyConsumption, energy_frozen_from(s, 10));
    assert_eq!(feed(&mut d, (0..=69).map(poll)), vec![]);
    let t = obs(&mut d, &poll(70));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Zombie,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 11_000,
            detected_ts_ms: 70_000,
            action: ACTION_ENERGY_FROZEN,
            // Power at 70 s: 100 + 70 % 7 = 100 W.
            evidence: "energy counter stuck at 2000000 mJ for 1.0 min (61 polls since \
                       10000 ms) while power reads 100 W"
                .to_string(),
        }
    );
    assert_eq!(feed(&mut d, (71..=100).map(poll)), vec![], "stays open");

    // From 101 s the counter moves again; the last holding poll was 100 s,
    // so the event clears at 100 s + 2 min = 220 s.
    let moving = |s: i64| live(s).with(Field::TotalEnergyConsumption, 2_000_000.0 + s as f64);
    assert_eq!(feed(&mut d, (101..=219).map(moving)), vec![]);
    let t = obs(&mut d, &moving(220));
    assert_eq!(
        cleared(&t),
        &Clearing {
            key: EventKey::of(Kind::Zombie),
            cleared_ts_ms: 220_000,
            evidence: "no zombie rule held for 2.0 min (last at 100000 ms)".to_string(),
        }
    );
}

#[test]
fn clearing_needs_a_poll_that_carries_the_signals() {
    let mut d = det();
    // Frozen from 0 s: opens at 60 s. The counter moves at 61 s and 62 s,
    // then the polls carry only power and temperature (too few fields for
    // any rule) until 300 s: no evidence, so no clearing at 60 s + 2 min =
    // 180 s. The first poll with the counter again (301 s) clears.
    let energy = |s: i64| if s <= 60 { 5e9 } else { 5e9 + s as f64 * 1e5 };
    let polls = (0..=300).map(|s| {
        let p = Poll::new(s * 1_000)
            .with(Field::PowerUsage, 100.0 + (s % 7) as f64)
            .with(Field::GpuTemp, 40.0);
        if s <= 62 {
            p.with(Field::TotalEnergyConsumption, energy(s))
        } else {
            p
        }
    });
    let seen = feed(&mut d, polls);
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert!(
        matches!(&seen[0], (60_000, Transition::Opened(_))),
        "{seen:?}"
    );
    let t = obs(
        &mut d,
        &Poll::new(301_000).with(Field::TotalEnergyConsumption, energy(301)),
    );
    assert_eq!(
        cleared(&t).evidence,
        "no zombie rule held for 4.0 min (last at 60000 ms)"
    );
}

#[test]
fn the_same_freeze_at_10_hz_fires_at_the_same_sample_time() {
    let mut d = det();
    // 100 W = 100 mJ per ms; frozen from 10.0 s (2,000,000 mJ). First repeat
    // at 10.1 s, detection at 70.0 s after 601 polls (10.0 s..=70.0 s).
    let poll = |ts: i64| {
        Poll::new(ts).with(Field::PowerUsage, 100.0).with(
            Field::TotalEnergyConsumption,
            1_000_000.0 + ts.min(10_000) as f64 * 100.0,
        )
    };
    let seen = feed(&mut d, (0..=800).map(|i| poll(i * 100)));
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let (at, Transition::Opened(f)) = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!(
        (*at, f.severity, f.onset_ts_ms, f.detected_ts_ms),
        (70_000, Severity::Critical, 10_100, 70_000)
    );
    assert!(f.evidence.contains("(601 polls since 10000 ms)"), "{f:?}");
}

#[test]
fn a_freeze_shorter_than_a_minute_is_normal() {
    let mut d = det();
    // 10 Hz; the counter refreshes every other poll (as in the real
    // recordings, only slower), and stops from 10.0 s to 69.9 s: 59.9 s, 600
    // polls. It moves again at 70.0 s.
    let energy = |ts: i64| {
        let refreshed = ts - ts % 200;
        if (10_000..70_000).contains(&ts) {
            10_000.0 * 120.0
        } else {
            refreshed as f64 * 120.0
        }
    };
    let polls = (0..=2_000).map(|i| {
        let ts = i * 100;
        Poll::new(ts)
            .with(Field::PowerUsage, 120.0)
            .with(Field::GpuTemp, 35.0)
            .with(Field::TotalEnergyConsumption, energy(ts))
    });
    assert_eq!(feed(&mut d, polls), vec![]);
}

#[test]
fn a_counter_that_never_paused_warns_at_its_second_repeat_then_goes_critical() {
    let mut d = det();
    // 1 Hz; the counter moves at every poll for 200 s (past the 120 s of
    // learning), then stops at its 200 s value: 200 s is the last fresh
    // reading, 201 s the first repeat (onset). The GPU never paused, so the
    // quick hold is its 2 s floor: a warning at 202 s, 3 polls. Critical at
    // 200 s + 60 s = 260 s.
    let poll = |s| live(s).with(Field::TotalEnergyConsumption, energy_frozen_from(s, 200));
    assert_eq!(feed(&mut d, (0..=201).map(poll)), vec![]);
    let t = obs(&mut d, &poll(202));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Zombie,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 201_000,
            detected_ts_ms: 202_000,
            action: ACTION_ENERGY_STOPPED,
            // 1,000,000 + 200 × 100,000 mJ; power at 202 s: 100 + 202 % 7 = 106 W.
            evidence: "energy counter stuck at 21000000 mJ for 2.0 s (3 polls since \
                       200000 ms) while power reads 106 W; its longest pause before was 0.0 s"
                .to_string(),
        }
    );
    assert_eq!(feed(&mut d, (203..=259).map(poll)), vec![]);
    match obs(&mut d, &poll(260)).as_slice() {
        [Transition::Escalated(e)] => {
            assert_eq!(
                (e.severity, e.ts_ms, e.action),
                (Severity::Critical, 260_000, ACTION_ENERGY_FROZEN)
            );
        }
        other => panic!("expected Escalated, got {other:?}"),
    }
}

#[test]
fn a_counter_that_pauses_is_judged_against_its_own_longest_pause() {
    let mut d = det();
    // 1 Hz. The counter holds each value for 4 s (5 polls) and moves in
    // steps, from 0 s to 300 s: its longest pause is 4 s, so its quick hold
    // is 12 s. At 300 s it stops: nothing until 312 s (13 polls, from 300 s).
    let energy = |s: i64| 1e9 + (s.min(300) / 5) as f64 * 500_000.0;
    let poll = |s| live(s).with(Field::TotalEnergyConsumption, energy(s));
    assert_eq!(feed(&mut d, (0..=311).map(poll)), vec![]);
    let t = obs(&mut d, &poll(312));
    let f = opened(&t);
    assert_eq!(
        (f.severity, f.onset_ts_ms, f.detected_ts_ms, f.action),
        (Severity::Warning, 301_000, 312_000, ACTION_ENERGY_STOPPED)
    );
    assert!(
        f.evidence.ends_with("its longest pause before was 4.0 s"),
        "{}",
        f.evidence
    );
}

#[test]
fn a_pause_that_warned_and_ended_is_normal_from_then_on() {
    let mut d = det();
    // 1 Hz, a counter that never paused, until a driver stall: at 200-205 s
    // it shows its 199 s value, a 6 s pause from 199 s. A quick warning at
    // 201 s (2 s from 199 s). It moves again at 206 s, short of the minute,
    // so 6 s is now a normal pause: the clearing comes 2 min after the last
    // holding poll (205 s), at 325 s. A second stall at 400-405 s is then no
    // evidence (the quick hold is 18 s).
    let stalled = |s: i64| (200..=205).contains(&s) || (400..=405).contains(&s);
    let mut value = 1e9;
    let mut polls = Vec::new();
    for s in 0..=600 {
        if !stalled(s) {
            value += 100_000.0;
        }
        polls.push(live(s).with(Field::TotalEnergyConsumption, value));
    }
    let seen = feed(&mut d, polls);
    let at: Vec<(i64, &str)> = seen
        .iter()
        .map(|(ts, t)| {
            let what = match t {
                Transition::Opened(_) => "opened",
                Transition::Escalated(_) => "escalated",
                Transition::Cleared(_) => "cleared",
            };
            (*ts, what)
        })
        .collect();
    assert_eq!(at, vec![(201_000, "opened"), (325_000, "cleared")]);
}

#[test]
fn no_quick_hold_before_two_minutes_of_history() {
    let mut d = det();
    // The counter stops at 100 s, after 100 s of history: only the full
    // minute holds (critical at 160 s), even though the freeze runs on past
    // 120 s of history.
    let poll = |s| live(s).with(Field::TotalEnergyConsumption, energy_frozen_from(s, 100));
    assert_eq!(feed(&mut d, (0..=159).map(poll)), vec![]);
    let t = obs(&mut d, &poll(160));
    let f = opened(&t);
    assert_eq!(
        (f.severity, f.detected_ts_ms, f.action),
        (Severity::Critical, 160_000, ACTION_ENERGY_FROZEN)
    );
}

#[test]
fn busy_but_idle_after_a_consistent_history_warns_within_two_polls() {
    let mut d = det();
    // 1 Hz: busy and working (SM_ACTIVE 0.6) for 300 s, then GPU_UTIL 100 %
    // with SM_ACTIVE 0 from 300 s: onset 300 s, 3 polls and 2 s by 302 s.
    let poll = |s: i64| {
        live(s)
            .with(Field::TotalEnergyConsumption, 1e9 + s as f64 * 1e5)
            .with(Field::GpuUtil, 100.0)
            .with(Field::ProfSmActive, if s >= 300 { 0.0 } else { 0.6 })
    };
    assert_eq!(feed(&mut d, (0..=301).map(poll)), vec![]);
    let t = obs(&mut d, &poll(302));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Zombie,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 300_000,
            detected_ts_ms: 302_000,
            action: ACTION_BUSY_IDLE,
            evidence: "gpu util 100 % but sm / engine activity 0 for 2.0 s (3 polls); its \
                       longest such run before was 0.0 s"
                .to_string(),
        }
    );
}

#[test]
fn idle_gpu_with_repeating_readings_and_advancing_energy_is_not_a_zombie() {
    let mut d = det();
    // Worse than the idle recording b1: 20 min at 10 Hz with power,
    // temperature and SM clock never changing, GPU_UTIL and SM_ACTIVE 0; the
    // energy counter (120 W) refreshes every other poll.
    let polls = (0..=12_000).map(|i| {
        let ts = i * 100;
        Poll::new(ts)
            .with(Field::PowerUsage, 120.0)
            .with(Field::GpuTemp, 35.0)
            .with(Field::SmClock, 1_980.0)
            .with(
                Field::TotalEnergyConsumption,
                1e9 + (ts / 200) as f64 * 24_000.0,
            )
            .with(Field::GpuUtil, 0.0)
            .with(Field::ProfSmActive, 0.0)
    });
    assert_eq!(feed(&mut d, polls), vec![]);
}

#[test]
fn exporter_caching_at_30_s_is_not_a_freeze() {
    let mut d = det();
    // dcgm-exporter refreshes every 30 s, Prometheus scrapes every 15 s:
    // every reading shows twice, 15 s apart, for an hour.
    let polls = (0..240).map(|i| {
        let ts = i * 15_000;
        let k = (ts / 30_000) as f64;
        Poll::new(ts)
            .with(Field::PowerUsage, 300.0 + k)
            .with(Field::GpuTemp, 60.0 + k % 5.0)
            .with(Field::SmClock, 1_980.0)
            .with(Field::TotalEnergyConsumption, 5e9 + k * 9e6)
            .with(Field::GpuUtil, 100.0)
            .with(Field::ProfSmActive, 0.6)
    });
    assert_eq!(feed(&mut d, polls), vec![]);
}

#[test]
fn a_counter_reset_re_baselines() {
    // 1 Hz. The counter moves until 10 s (2,000,000 mJ), stays there 40 s,
    // drops to 1,000 mJ at 51 s (driver reload) and stays there until 110 s.
    // Since 10 s it has not gone past 2,000,000 for 100 s, but each value
    // held less than 60 s: 10-50 s is 40 s, 51-110 s is 59 s.
    let energy = |s: i64, until: i64| match s {
        ..=50 => energy_frozen_from(s, 10),
        _ if s <= until => 1_000.0,
        _ => 1_000.0 + (s - until) as f64 * 100_000.0,
    };
    let mut d = det();
    let polls = (0..=300).map(|s| live(s).with(Field::TotalEnergyConsumption, energy(s, 110)));
    assert_eq!(feed(&mut d, polls), vec![]);

    // The same reset, with the new value held until 111 s: 60 s from the
    // reset poll (51 s), which is what the freeze is measured from; the
    // first repeat (52 s) is the onset.
    let mut d = det();
    let polls = (0..=111).map(|s| live(s).with(Field::TotalEnergyConsumption, energy(s, 111)));
    let seen = feed(&mut d, polls);
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let (_, Transition::Opened(f)) = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!(
        (f.severity, f.onset_ts_ms, f.detected_ts_ms),
        (Severity::Critical, 52_000, 111_000)
    );
    assert!(f.evidence.contains("stuck at 1000 mJ"), "{f:?}");
}

#[test]
fn a_missing_counter_is_no_evidence_either_way() {
    // 15 min of polls that carry only power and temperature, both constant,
    // after one energy reading: nothing to judge by.
    let mut d = det();
    let mut polls = vec![live(0).with(Field::TotalEnergyConsumption, 5e9)];
    polls.extend((1..=900).map(|s| {
        Poll::new(s * 1_000)
            .with(Field::PowerUsage, 120.0)
            .with(Field::GpuTemp, 35.0)
    }));
    assert_eq!(feed(&mut d, polls), vec![]);

    // A freeze from 0 s with the counter missing from 31 s to 89 s: the gap
    // neither fires (at 60 s nothing happens) nor breaks the run; the
    // reading at 90 s shows the same value, so the counter did not move for
    // 90 s.
    let mut d = det();
    let polls = (0..=90).map(|s| {
        let p = live(s);
        if (31..90).contains(&s) {
            p
        } else {
            p.with(Field::TotalEnergyConsumption, 5e9)
        }
    });
    let seen = feed(&mut d, polls);
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let (at, Transition::Opened(f)) = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!((*at, f.onset_ts_ms), (90_000, 1_000));
    assert!(
        f.evidence
            .starts_with("energy counter stuck at 5000000000 mJ for 1.5 min (32 polls since 0 ms)"),
        "{f:?}"
    );
}

#[test]
fn a_single_poll_after_a_long_gap_does_not_fire() {
    let mut d = det();
    let p = |ts| Poll::new(ts).with(Field::TotalEnergyConsumption, 5e9);
    assert_eq!(obs(&mut d, &p(0)), vec![]);
    // 5 min later, the same value: 2 polls, fewer than 3.
    assert_eq!(obs(&mut d, &p(300_000)), vec![]);
    // A third poll confirms it: 301 s since the last fresh reading.
    let t = obs(&mut d, &p(301_000));
    let f = opened(&t);
    assert_eq!((f.onset_ts_ms, f.detected_ts_ms), (300_000, 301_000));
}

#[test]
fn frozen_readings_without_energy_warn_after_ten_minutes_then_escalate_and_clear() {
    let mut d = det();
    let frozen = |s: i64| {
        Poll::new(s * 1_000)
            .with(Field::PowerUsage, 312.5)
            .with(Field::GpuTemp, 61.0)
            .with(Field::SmClock, 1_755.0)
    };
    // 0 s is the last fresh reading, 1 s the first repeat, 600 s the hold.
    assert_eq!(feed(&mut d, (0..=599).map(frozen)), vec![]);
    let t = obs(&mut d, &frozen(600));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Zombie,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 1_000,
            detected_ts_ms: 600_000,
            action: ACTION_READINGS_FROZEN,
            evidence: "readings unchanged for 10.0 min (601 polls since 0 ms): power 312.5 W, \
                       gpu temp 61 C, sm clock 1755 MHz"
                .to_string(),
        }
    );
    // The energy counter appears at 700 s, frozen too: the readings run goes
    // on (it joins the set), and the counter's own hold is met at 760 s.
    let with_energy = |s| frozen(s).with(Field::TotalEnergyConsumption, 7e9);
    assert_eq!(feed(&mut d, (601..=699).map(frozen)), vec![]);
    assert_eq!(feed(&mut d, (700..=759).map(with_energy)), vec![]);
    let t = obs(&mut d, &with_energy(760));
    assert_eq!(
        t,
        vec![Transition::Escalated(Escalation {
            key: EventKey::of(Kind::Zombie),
            severity: Severity::Critical,
            ts_ms: 760_000,
            action: ACTION_ENERGY_FROZEN,
            evidence: "energy counter stuck at 7000000000 mJ for 1.0 min (61 polls since \
                       700000 ms) while power reads 312.5 W; readings unchanged for 12.7 min \
                       (761 polls since 0 ms): energy 7000000000 mJ, power 312.5 W, gpu temp \
                       61 C, sm clock 1755 MHz"
                .to_string(),
        })]
    );
    // Everything moves from 800 s; the last holding poll is 799 s, so it
    // clears at 919 s.
    assert_eq!(feed(&mut d, (761..=799).map(with_energy)), vec![]);
    let moving = |s: i64| live(s).with(Field::TotalEnergyConsumption, 7e9 + s as f64 * 1e5);
    assert_eq!(feed(&mut d, (800..=918).map(moving)), vec![]);
    let t = obs(&mut d, &moving(919));
    assert_eq!(cleared(&t).cleared_ts_ms, 919_000);
}

#[test]
fn a_field_that_goes_missing_or_joins_does_not_break_frozen_readings() {
    let mut d = det();
    let frozen = |s: i64| {
        Poll::new(s * 1_000)
            .with(Field::PowerUsage, 312.5)
            .with(Field::GpuTemp, 61.0)
    };
    // Power, temperature and SM clock frozen from 0 s; at 590 s the clock is
    // missing and the energy counter appears (2 fields to compare: neither
    // evidence nor a break, 590 s is not counted); from 591 s all four
    // carried, unchanged. The run from 0 s holds at 600 s with 600 polls.
    let polls = (0..=600).map(|s| match s {
        ..590 => frozen(s).with(Field::SmClock, 1_755.0),
        590 => frozen(s).with(Field::TotalEnergyConsumption, 7e9),
        _ => frozen(s)
            .with(Field::SmClock, 1_755.0)
            .with(Field::TotalEnergyConsumption, 7e9),
    });
    let seen = feed(&mut d, polls);
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let (_, Transition::Opened(f)) = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!(
        (
            f.severity,
            f.onset_ts_ms,
            f.detected_ts_ms,
            f.evidence.as_str()
        ),
        (
            Severity::Warning,
            1_000,
            600_000,
            "readings unchanged for 10.0 min (600 polls since 0 ms): energy 7000000000 mJ, \
             power 312.5 W, gpu temp 61 C, sm clock 1755 MHz"
        )
    );
    // The counter, seen since 590 s, holds on its own at 650 s.
    let t = feed(
        &mut d,
        (601..=650).map(|s| {
            frozen(s)
                .with(Field::SmClock, 1_755.0)
                .with(Field::TotalEnergyConsumption, 7e9)
        }),
    );
    assert!(
        matches!(&t[..], [(650_000, Transition::Escalated(e))] if e.severity == Severity::Critical),
        "{t:?}"
    );
}

#[test]
fn two_frozen_fields_or_one_moving_field_are_not_frozen_readings() {
    // Power and temperature alone (the idle recording holds them for up to
    // 80 s at 1 Hz): 20 min, nothing.
    let mut d = det();
    let polls = (0..=1_200).map(|s| {
        Poll::new(s * 1_000)
            .with(Field::PowerUsage, 120.0)
            .with(Field::GpuTemp, 35.0)
    });
    assert_eq!(feed(&mut d, polls), vec![]);

    // Three fields, the temperature steps from 61 to 62 C at 300 s: the run
    // restarts there (300 s fresh, 301 s first repeat) and holds at 900 s.
    let mut d = det();
    let poll = |s: i64| {
        Poll::new(s * 1_000)
            .with(Field::PowerUsage, 312.5)
            .with(Field::GpuTemp, if s < 300 { 61.0 } else { 62.0 })
            .with(Field::SmClock, 1_755.0)
    };
    assert_eq!(feed(&mut d, (0..=899).map(poll)), vec![]);
    let t = obs(&mut d, &poll(900));
    let f = opened(&t);
    assert_eq!(
        (f.severity, f.onset_ts_ms, f.detected_ts_ms),
        (Severity::Warning, 301_000, 900_000)
    );
}

#[test]
fn busy_without_sm_activity_warns_after_a_minute_and_clears() {
    let mut d = det();
    // 1 Hz, the counter moving (the GPU is alive). GPU_UTIL 100 % with
    // SM_ACTIVE 0 from 0 s, except: 20-24 s GPU_UTIL dips to 35 % (neither
    // evidence nor its absence), 30 s carries no SM_ACTIVE (no evidence).
    // So 61 - 5 - 1 = 55 busy-but-idle polls from 0 s to 60 s.
    let poll = |s: i64| {
        let util = if (20..=24).contains(&s) { 35.0 } else { 100.0 };
        let sm = if s >= 90 { 0.4 } else { 0.0 };
        let p = live(s)
            .with(Field::TotalEnergyConsumption, 1e9 + s as f64 * 1e5)
            .with(Field::GpuUtil, util);
        if s == 30 {
            p
        } else {
            p.with(Field::ProfSmActive, sm)
        }
    };
    assert_eq!(feed(&mut d, (0..=59).map(poll)), vec![]);
    let t = obs(&mut d, &poll(60));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Zombie,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 0,
            detected_ts_ms: 60_000,
            action: ACTION_BUSY_IDLE,
            evidence: "gpu util 100 % but sm / engine activity 0 for 1.0 min (55 polls)"
                .to_string(),
        }
    );
    // The SMs work again from 90 s: last holding poll 89 s, cleared at 209 s.
    assert_eq!(feed(&mut d, (61..=208).map(poll)), vec![]);
    let t = obs(&mut d, &poll(209));
    assert_eq!(cleared(&t).cleared_ts_ms, 209_000);
}

#[test]
fn gr_engine_active_alone_counts_and_engine_activity_is_work() {
    // No SM_ACTIVE, GR_ENGINE_ACTIVE 0 with GPU_UTIL 80 %: fires at 60 s.
    let mut d = det();
    let poll = |s: i64| {
        Poll::new(s * 1_000)
            .with(Field::GpuUtil, 80.0)
            .with(Field::ProfGrEngineActive, 0.0)
    };
    let seen = feed(&mut d, (0..=60).map(poll));
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let (_, Transition::Opened(f)) = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!(
        (f.severity, f.action, f.onset_ts_ms, f.detected_ts_ms),
        (Severity::Warning, ACTION_BUSY_IDLE, 0, 60_000)
    );

    // SM_ACTIVE 0 but the engine 90 % active: the highest ratio counts.
    let mut d = det();
    let polls = (0..=600).map(|s| {
        Poll::new(s * 1_000)
            .with(Field::GpuUtil, 100.0)
            .with(Field::ProfSmActive, 0.0)
            .with(Field::ProfGrEngineActive, 0.9)
    });
    assert_eq!(feed(&mut d, polls), vec![]);
}

#[test]
fn busy_gpus_that_work_and_idle_gpus_are_not_zombies() {
    /// `(GPU_UTIL, SM_ACTIVE)` at second `s`.
    type Load = fn(i64) -> (f64, f64);
    let cases: [(&str, Load); 4] = [
        ("training", |_| (100.0, 0.45)),
        // One block resident on one of an H100's 132 SMs: 1/132 > 0.005.
        ("one SM busy", |_| (100.0, 0.0076)),
        ("idle", |_| (0.0, 0.0)),
        // Busy-but-idle, but the GPU reports GPU_UTIL 0 every 50 s, which
        // ends the run: at most 49 s.
        ("idle every 50 s", |s| {
            (if s % 50 == 0 { 0.0 } else { 100.0 }, 0.0)
        }),
    ];
    for (name, f) in cases {
        let mut d = det();
        let polls = (0..=600).map(|s| {
            let (util, sm) = f(s);
            Poll::new(s * 1_000)
                .with(Field::GpuUtil, util)
                .with(Field::ProfSmActive, sm)
        });
        assert_eq!(feed(&mut d, polls), vec![], "{name}");
    }
}

#[test]
fn replayed_polls_are_ignored() {
    let mut d = det();
    let p = |ts: i64, e: f64| Poll::new(ts).with(Field::TotalEnergyConsumption, e);
    let mut seen = feed(&mut d, (0..=30).map(|s| p(s * 1_000, 5e9)));
    // A re-sent older poll with another value must not restart the freeze.
    seen.extend(feed(&mut d, [p(29_500, 4e9), p(30_000, 6e9)]));
    seen.extend(feed(&mut d, (31..=60).map(|s| p(s * 1_000, 5e9))));
    assert_eq!(seen.len(), 1, "{seen:#?}");
    let (at, Transition::Opened(f)) = &seen[0] else {
        panic!("{seen:?}")
    };
    assert_eq!((*at, f.onset_ts_ms), (60_000, 1_000));
}

#[test]
fn config_validation_names_the_field() {
    assert_eq!(ZombieConfig::default().validate(), Ok(()));
    type Breaker = fn(&mut ZombieConfig);
    let bad: [(Breaker, &str); 7] = [
        (|c| c.min_polls = 1, "zombie.min_polls"),
        (|c| c.energy_freeze_ms = 0, "zombie.energy_freeze_ms"),
        (|c| c.readings_freeze_ms = -1, "zombie.readings_freeze_ms"),
        (|c| c.busy_util_pct = 0.0, "zombie.busy_util_pct"),
        (|c| c.idle_activity_max = 1.0, "zombie.idle_activity_max"),
        (|c| c.busy_idle_ms = 0, "zombie.busy_idle_ms"),
        (|c| c.clear_after_ms = 0, "zombie.clear_after_ms"),
    ];
    for (break_it, field) in bad {
        let mut c = ZombieConfig::default();
        break_it(&mut c);
        assert_eq!(c.validate().map_err(|e| e.field), Err(field));
    }
    let c = ZombieConfig {
        idle_activity_max: f64::NAN,
        ..ZombieConfig::default()
    };
    assert_eq!(
        c.validate().map_err(|e| e.field),
        Err("zombie.idle_activity_max")
    );
}

// ---------------------------------------------------------------------------
// The real recordings (shared/data/real, H100 at 10 Hz): t13 training, b1
// model loaded but idle.

/// The 10 Hz stream, and the 1 Hz streams (every 10th poll, at each of the
/// 10 offsets).
fn rates(polls: &[Poll]) -> Vec<(String, Vec<Poll>)> {
    let mut out = vec![("10 Hz".to_string(), polls.to_vec())];
    for off in 0..10 {
        let sub = polls.iter().skip(off).step_by(10).cloned().collect();
        out.push((format!("1 Hz offset {off}"), sub));
    }
    out
}

/// The longest time one key stays the same over consecutive polls that carry
/// it, from the first to the last poll showing it, ms.
fn longest_run<K: PartialEq>(polls: &[Poll], key: impl Fn(&Poll) -> Option<K>) -> i64 {
    let mut best = 0;
    let mut cur: Option<(K, i64)> = None;
    for p in polls {
        let Some(k) = key(p) else { continue };
        match &cur {
            Some((c, from)) if *c == k => best = best.max(p.ts_ms - from),
            _ => cur = Some((k, p.ts_ms)),
        }
    }
    best
}

fn energy_key(p: &Poll) -> Option<u64> {
    p.get(Field::TotalEnergyConsumption).map(f64::to_bits)
}

fn power_temp_key(p: &Poll) -> Option<(u64, u64)> {
    Some((
        p.get(Field::PowerUsage)?.to_bits(),
        p.get(Field::GpuTemp)?.to_bits(),
    ))
}

/// Both healthy recordings, at 10 Hz and at 1 Hz (all offsets), raise no
/// zombie event, also in the worst case for the frozen-readings rule (energy
/// dropped, so that rule carries the verdict, and an SM clock pinned at one
/// value, as an idle clock is). The margins the thresholds keep over the
/// data are checked here too, as documented in `docs/HEALTH.md`.
#[test]
fn real_recordings_raise_no_zombie_event() {
    // (file, longest energy freeze, longest power+temp run at 10 Hz and at
    // 1 Hz, all GPUs), in ms, measured on the recordings.
    let expected = [(T13, 829, 3_403, 5_004), (B1, 4_856, 52_844, 80_067)];
    for (name, freeze, pt_10hz, pt_1hz) in expected {
        if skip(name) {
            continue;
        }
        let gpus = load(name).unwrap();
        assert_eq!(gpus.len(), 8, "{name}");
        let mut measured = (0, 0, 0);
        for (gpu, polls) in gpus.iter().enumerate() {
            for (rate, polls) in rates(polls) {
                let mut d = det();
                assert_eq!(
                    feed(&mut d, polls.iter().cloned()),
                    vec![],
                    "{name} GPU {gpu} {rate}"
                );

                let mut d = det();
                let worst = polls.iter().map(|p| {
                    let mut p = p.clone().with(Field::SmClock, 1_980.0);
                    p.clear(Field::TotalEnergyConsumption);
                    p
                });
                assert_eq!(
                    feed(&mut d, worst),
                    vec![],
                    "{name} GPU {gpu} {rate}, no energy"
                );

                let pt = longest_run(&polls, power_temp_key);
                if rate == "10 Hz" {
                    measured.0 = measured.0.max(longest_run(&polls, energy_key));
                    measured.1 = measured.1.max(pt);
                } else {
                    measured.2 = measured.2.max(pt);
                }
            }
        }
        assert_eq!(
            measured,
            (freeze, pt_10hz, pt_1hz),
            "{name}: the documented figures"
        );
    }
}

/// One spliced fault in t13 (training): from `SPLICE_AFTER_MS` after the
/// recording starts, GPU `SPLICED_GPU`'s polls are changed by `fault`.
/// Returns one [`Spliced`] per rate (10 Hz, 1 Hz at offset 0).
fn spliced_t13(fault: impl Fn(&mut Poll, &Poll)) -> Option<Vec<Spliced>> {
    let mut gpus = load(T13)?;
    let splice_ts = gpus[0][0].ts_ms + SPLICE_AFTER_MS;
    let polls = &mut gpus[SPLICED_GPU];
    let first = polls.iter().position(|p| p.ts_ms >= splice_ts).unwrap();
    let before = polls[first - 1].clone();
    for p in &mut polls[first..] {
        fault(p, &before);
    }
    let mut out = Vec::new();
    for step in [1, 10] {
        let mut per_gpu = Vec::new();
        for polls in &gpus {
            let mut d = det();
            let mut seen = Vec::new();
            for p in polls.iter().step_by(step) {
                d.observe(p, &mut seen);
            }
            per_gpu.push(seen);
        }
        let fed = gpus[SPLICED_GPU].iter().step_by(step).cloned().collect();
        out.push(Spliced {
            splice_ts,
            fed,
            per_gpu,
        });
    }
    Some(out)
}

/// One rate's replay of a spliced recording.
struct Spliced {
    /// Sample time the fault starts at.
    splice_ts: i64,
    /// The spliced GPU's polls as fed at this rate.
    fed: Vec<Poll>,
    /// Every GPU's transitions.
    per_gpu: Vec<Vec<Transition>>,
}

/// 150 s into t13 is mid-way through its steady phase (44.7-314.7 s).
const SPLICE_AFTER_MS: i64 = 150_000;
const SPLICED_GPU: usize = 3;

/// The spliced GPU's transitions; no other GPU has any.
fn only_spliced_gpu<'a>(per_gpu: &'a [Vec<Transition>], rate: &str) -> &'a [Transition] {
    for (gpu, t) in per_gpu.iter().enumerate() {
        if gpu != SPLICED_GPU {
            assert_eq!(t, &vec![], "GPU {gpu} {rate}");
        }
    }
    &per_gpu[SPLICED_GPU]
}

/// The quick hold a GPU earns from its polls before `splice_ts`: three times
/// the longest run of `evidence` polls that ended before the splice (from its
/// `from` poll to its last), at least 2 s. `evidence` says whether a poll
/// continues the run (`Some(true)`), ends it (`Some(false)`) or neither
/// (`None`); `from_prev` says whether a run is measured from the poll before
/// its first (a freeze, from the last fresh value) or from its first.
fn expected_quick_hold(
    fed: &[Poll],
    splice_ts: i64,
    from_prev: bool,
    evidence: impl Fn(&Poll, &Poll) -> Option<bool>,
) -> i64 {
    let before: Vec<&Poll> = fed.iter().filter(|p| p.ts_ms < splice_ts).collect();
    let (mut longest, mut run): (i64, Option<(i64, i64)>) = (0, None);
    for w in before.windows(2) {
        match (evidence(w[0], w[1]), &mut run) {
            (Some(true), Some((_, last))) => *last = w[1].ts_ms,
            (Some(true), None) => {
                let from = if from_prev { w[0].ts_ms } else { w[1].ts_ms };
                run = Some((from, w[1].ts_ms));
            }
            (Some(false), Some((from, last))) => {
                longest = longest.max(*last - *from);
                run = None;
            }
            _ => {}
        }
    }
    (3 * longest).max(2_000)
}

/// A zombie spliced into t13: from 150 s on, GPU 3 repeats its last reading
/// (energy counter, power, temperature, utilisation, SM activity; as the
/// simulator's zombie does). On GPU 3 only: a warning once the counter has
/// stood still for three times its longest pause of the recording so far
/// (at least 2 s: at 1 Hz, where it never paused, the second repeated poll),
/// escalated to critical 60 s after the last fresh reading, within 62 s of
/// the splice, at 10 Hz and at 1 Hz. Onset = first poll that repeats the
/// counter.
#[test]
fn real_t13_with_a_spliced_freeze_fires_on_that_gpu_only() {
    if skip(T13) {
        return;
    }
    let runs = spliced_t13(|p, before| {
        let ts = p.ts_ms;
        *p = before.clone();
        p.ts_ms = ts;
    })
    .unwrap();
    for (run, rate) in runs.into_iter().zip(["10 Hz", "1 Hz"]) {
        let Spliced {
            splice_ts,
            fed,
            per_gpu,
        } = run;
        let (f, e) = match only_spliced_gpu(&per_gpu, rate) {
            [Transition::Opened(f), Transition::Escalated(e)] => (f.clone(), e.clone()),
            other => panic!("{rate}: expected Opened then Escalated, got {other:?}"),
        };
        assert_eq!(
            (f.kind, f.severity, f.action),
            (Kind::Zombie, Severity::Warning, ACTION_ENERGY_STOPPED),
            "{rate}"
        );
        assert_eq!(
            (e.severity, e.action),
            (Severity::Critical, ACTION_ENERGY_FROZEN),
            "{rate}"
        );
        // The evidence starts at the first fed poll that repeats the
        // previous fed poll's counter; the poll before it is the last fresh.
        let mut i = fed
            .windows(2)
            .position(|w| w[1].ts_ms >= splice_ts && energy_key(&w[0]) == energy_key(&w[1]))
            .unwrap();
        let onset = fed[i + 1].ts_ms;
        // A normal repeat may already have started the run before the splice.
        while i > 0 && energy_key(&fed[i - 1]) == energy_key(&fed[i]) {
            i -= 1;
        }
        let fresh = fed[i].ts_ms;
        assert!(onset >= splice_ts, "{rate}: {onset} < {splice_ts}");
        assert_eq!(f.onset_ts_ms, onset, "{rate}");
        let quick = expected_quick_hold(&fed, splice_ts, true, |a, b| {
            Some(energy_key(a) == energy_key(b))
        });
        if rate == "1 Hz" {
            assert_eq!(quick, 2_000, "at 1 Hz the counter never paused");
        }
        let warned = f.detected_ts_ms - fresh;
        assert!(
            (quick..quick + 1_200).contains(&warned),
            "{rate}: warned {warned} ms after the last fresh reading, quick hold {quick} ms"
        );
        let held = e.ts_ms - fresh;
        assert!((60_000..61_200).contains(&held), "{rate}: {held} ms");
        let ttd = e.ts_ms - splice_ts;
        assert!(ttd <= 62_000, "{rate}: critical {ttd} ms after the splice");
    }
}

/// Busy but no work spliced into t13: from 150 s on, GPU 3 keeps its
/// recorded GPU_UTIL (≥ 90 % in the steady phase, with dips to 32-49 %)
/// while SM_ACTIVE reads 0 wherever it was recorded. Warning, on GPU 3
/// only; onset = first busy-but-idle poll; detected once the run is three
/// times the longest such run of the recording so far (at least 2 s), within
/// 5 s of the splice, at 10 Hz and at 1 Hz.
#[test]
fn real_t13_with_spliced_busy_but_idle_fires_on_that_gpu_only() {
    if skip(T13) {
        return;
    }
    let runs = spliced_t13(|p, _| {
        if p.get(Field::ProfSmActive).is_some() {
            p.set(Field::ProfSmActive, 0.0);
        }
    })
    .unwrap();
    for (run, rate) in runs.into_iter().zip(["10 Hz", "1 Hz"]) {
        let Spliced {
            splice_ts,
            fed,
            per_gpu,
        } = run;
        let f = match only_spliced_gpu(&per_gpu, rate) {
            [Transition::Opened(f)] => f.clone(),
            other => panic!("{rate}: expected one Opened, got {other:?}"),
        };
        assert_eq!(
            (f.kind, f.severity, f.action),
            (Kind::Zombie, Severity::Warning, ACTION_BUSY_IDLE),
            "{rate}"
        );
        let busy_idle = |p: &Poll| {
            p.get(Field::ProfSmActive).is_some()
                && p.get(Field::ProfSmActive).is_some_and(|a| a <= 0.005)
                && p.get(Field::GpuUtil).is_some_and(|u| u >= 50.0)
        };
        let onset = fed
            .iter()
            .find(|p| p.ts_ms >= splice_ts && busy_idle(p))
            .unwrap()
            .ts_ms;
        assert_eq!(f.onset_ts_ms, onset, "{rate}");
        let quick = expected_quick_hold(&fed, splice_ts, false, |_, b| {
            let (util, sm) = (b.get(Field::GpuUtil)?, b.get(Field::ProfSmActive)?);
            if sm > 0.005 || util <= 0.0 {
                Some(false)
            } else {
                (util >= 50.0).then_some(true)
            }
        });
        // The first busy-but-idle poll at least `quick` after the onset,
        // with 3 such polls (the onset's included) by then.
        let due = fed
            .iter()
            .filter(|p| p.ts_ms >= onset && busy_idle(p))
            .enumerate()
            .find(|(n, p)| *n >= 2 && p.ts_ms - onset >= quick)
            .unwrap()
            .1
            .ts_ms;
        assert_eq!(f.detected_ts_ms, due, "{rate}: quick hold {quick} ms");
        let ttd = f.detected_ts_ms - splice_ts;
        assert!(ttd <= 5_000, "{rate}: detected {ttd} ms after the splice");
    }
}
