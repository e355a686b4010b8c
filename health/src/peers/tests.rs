//! The peer rules through the engine: 8 GPUs of one host, 1 Hz polls.

use crate::engine::{Change, Engine, GpuSlot};
use crate::{Field, GpuId, HealthConfig, Kind};

const T0: i64 = 1_700_000_000_000;

/// What one GPU reports in one poll.
#[derive(Debug, Clone, Copy)]
struct Reading {
    util: f64,
    activity: f64,
    power: f64,
    clock: f64,
    reasons: f64,
}

const BUSY: Reading = Reading {
    util: 100.0,
    activity: 0.80,
    power: 600.0,
    clock: 1980.0,
    reasons: 0.0,
};

const IDLE: Reading = Reading {
    util: 0.0,
    activity: 0.0,
    power: 70.0,
    clock: 345.0,
    reasons: 1.0,
};

struct Host {
    engine: Engine,
    slots: Vec<GpuSlot>,
    changes: Vec<Change>,
    second: i64,
}

impl Host {
    fn new(gpus: u32) -> Self {
        let mut engine = Engine::new(HealthConfig::default()).unwrap();
        let slots = (0..gpus)
            .map(|g| engine.gpu(GpuId::new(format!("GPU-{g}"), "node-1", g)))
            .collect();
        Host {
            engine,
            slots,
            changes: Vec::new(),
            second: 0,
        }
    }

    /// One second: every GPU's poll from `reading(gpu)`, then a tick.
    fn poll(&mut self, reading: impl Fn(usize) -> Reading) {
        let ts = T0 + self.second * 1000;
        for (g, &slot) in self.slots.iter().enumerate() {
            let r = reading(g);
            // A little texture so that no two GPUs, and no two seconds, are
            // identical (readings that repeat bit for bit are frozen).
            let wobble = 1.0
                + (g as f64 - 3.5) * 0.002
                + ((self.second * 7 + g as i64 * 3) % 5) as f64 * 0.0005;
            for (f, v) in [
                (Field::GpuUtil, r.util),
                (Field::ProfSmActive, r.activity * wobble),
                (Field::PowerUsage, r.power * wobble),
                (Field::SmClock, r.clock),
                (Field::ClockThrottleReasons, r.reasons),
            ] {
                self.engine.sample(slot, f, ts, v, &mut self.changes);
            }
        }
        self.engine.finish_before(ts + 1, &mut self.changes);
        self.engine.tick(ts, &mut self.changes);
        self.second += 1;
    }

    fn run(&mut self, seconds: i64, reading: impl Fn(usize) -> Reading + Copy) {
        for _ in 0..seconds {
            self.poll(reading);
        }
    }

    /// (kind, GPU index, opened?, sample second) of every change so far.
    fn log(&self) -> Vec<(Kind, u32, bool, i64)> {
        self.changes
            .iter()
            .map(|c| {
                let e = c.event();
                let at = match c {
                    Change::Cleared(e) => e.cleared_ts_ms.unwrap(),
                    _ => e.detected_ts_ms,
                };
                (
                    e.kind,
                    e.gpu.gpu,
                    matches!(c, Change::Opened(_)),
                    (at - T0) / 1000,
                )
            })
            .collect()
    }
}

fn slower(r: Reading, by: f64) -> Reading {
    Reading {
        activity: r.activity * (1.0 - by),
        power: r.power * (1.0 - by),
        ..r
    }
}

#[test]
fn a_ten_percent_straggler_fires_on_it_alone_then_clears() {
    let mut h = Host::new(8);
    h.run(60, |_| BUSY);
    assert!(h.changes.is_empty(), "{:?}", h.log());
    // GPU 5 slows down by 10 % at second 60.
    h.run(60, |g| if g == 5 { slower(BUSY, 0.10) } else { BUSY });
    let log = h.log();
    assert_eq!(log.len(), 1, "{log:?}");
    let (kind, gpu, opened, at) = log[0];
    assert_eq!((kind, gpu, opened), (Kind::Straggler, 5, true));
    // By hand: the 1 s means (power 600 -> 540 W is no 15 % step, so no
    // restart) are 10 % × (1 - e^-k) short k polls in: 6.3 % at second 60
    // (the run begins, weight 2.1), 8.6 % at 61 (2.9 s of credit), then 3 s a
    // second: the 8 s hold is earned at 63, and the 6 s minimum run ends at
    // 66.
    let e = h.changes[0].event();
    assert_eq!((e.onset_ts_ms - T0) / 1000, 60, "{e:?}");
    assert_eq!(at, 66);
    assert!(
        e.evidence.contains("busy peers on node-1"),
        "{}",
        e.evidence
    );
    // Back in line: clears 30 s after the last second it was behind.
    h.run(60, |_| BUSY);
    let log = h.log();
    assert_eq!(log.len(), 2, "{log:?}");
    let (kind, gpu, opened, at) = log[1];
    assert_eq!((kind, gpu, opened), (Kind::Straggler, 5, false));
    assert!((150..=155).contains(&at), "{at}");
}

#[test]
fn small_differences_and_short_dips_do_not_fire() {
    let mut h = Host::new(8);
    // 2 % below its peers for good, and another GPU 20 % below for 3 s.
    h.run(120, |g| match g {
        2 => slower(BUSY, 0.02),
        _ => BUSY,
    });
    let mut dip = Host::new(8);
    dip.run(30, |_| BUSY);
    dip.run(3, |g| if g == 4 { slower(BUSY, 0.20) } else { BUSY });
    dip.run(30, |_| BUSY);
    assert!(h.changes.is_empty(), "{:?}", h.log());
    assert!(dip.changes.is_empty(), "{:?}", dip.log());
}

#[test]
fn a_gpu_that_starts_the_next_phase_late_is_no_straggler() {
    // The job's next phase draws more: 420 -> 600 W. GPU 3 runs 2 % below
    // its peers all along (within the 3 % deficit) and starts the phase 5
    // polls after them, so it is 30 % short at seconds 60-64. By hand:
    // - that earns the 8 s hold by 63, but the 6 s minimum run would end at
    //   66, and at 65 its 585 W is a step of more than 15 % over its 1 s
    //   mean (~412 W), which restarts the mean: 2 % short, no longer
    //   holding;
    // - without the minimum run it would fire at 63; without the restart
    //   its mean would trail 13 % at 65 and 6.5 % at 66, and fire there.
    let phase1 = Reading {
        util: 70.0,
        activity: 0.56,
        power: 420.0,
        ..BUSY
    };
    let mut h = Host::new(8);
    h.run(60, |g| if g == 3 { slower(phase1, 0.02) } else { phase1 });
    h.run(5, |g| if g == 3 { slower(phase1, 0.02) } else { BUSY });
    h.run(60, |g| if g == 3 { slower(BUSY, 0.02) } else { BUSY });
    assert!(h.changes.is_empty(), "{:?}", h.log());
    // The same lag on a GPU that is 10 % slow from that phase on is a
    // straggler: its run, begun at 60, still holds after the restart at
    // 65 (10 % short), and fires when the minimum run ends at 66.
    let mut h = Host::new(8);
    h.run(60, |g| if g == 3 { slower(phase1, 0.02) } else { phase1 });
    h.run(5, |g| if g == 3 { slower(phase1, 0.02) } else { BUSY });
    h.run(60, |g| if g == 3 { slower(BUSY, 0.10) } else { BUSY });
    let log = h.log();
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0], (Kind::Straggler, 3, true, 66));
}

#[test]
fn peers_that_start_a_job_a_few_polls_late_count_toward_a_big_group() {
    // The job starts on GPUs 0 and 4 at second 0, 1 and 5 at 1, 2 and 6 at
    // 2, 3 and 7 at 3; GPU 0 is 20 % slow. By hand: at second 2 four GPUs
    // have been busy for the 1 s settling time, so GPU 0 is compared with 3
    // peers, while 6 GPUs are busy: a big group, so the evidence is
    // weighted from then on (the 8 s hold earned by 5), the peers are in
    // step from then (4 s: ready at 6), and the 6 s minimum run ends at 8.
    // Counting only the settled peers, the run would begin at 3, with 5.
    let mut h = Host::new(8);
    for second in 0..20 {
        h.poll(|g| {
            if second < (g % 4) as i64 {
                IDLE
            } else if g == 0 {
                slower(BUSY, 0.20)
            } else {
                BUSY
            }
        });
    }
    assert_eq!(h.log(), vec![(Kind::Straggler, 0, true, 8)]);
}

#[test]
fn only_activity_or_only_power_lower_is_not_a_straggler() {
    // t13's rank that runs 13 % below its peers' SM activity at the same
    // power, and a GPU that draws less power for the same work.
    let mut h = Host::new(8);
    h.run(120, |g| match g {
        0 => Reading {
            activity: BUSY.activity * 0.87,
            ..BUSY
        },
        1 => Reading {
            power: BUSY.power * 0.9,
            ..BUSY
        },
        _ => BUSY,
    });
    assert!(h.changes.is_empty(), "{:?}", h.log());
}

#[test]
fn unrelated_work_on_one_host_is_not_compared() {
    // Eight independent jobs at different loads: no majority to lag behind.
    let mut h = Host::new(8);
    h.run(120, |g| Reading {
        util: 60.0 + 5.0 * g as f64,
        activity: 0.5 + 0.05 * g as f64,
        power: 380.0 + 40.0 * g as f64,
        ..BUSY
    });
    assert!(h.changes.is_empty(), "{:?}", h.log());
}

#[test]
fn a_gpu_doing_nothing_while_busy_is_no_straggler_and_idle_hosts_are_not_judged() {
    let mut h = Host::new(8);
    h.run(120, |g| {
        if g == 3 {
            Reading {
                activity: 0.0,
                power: 90.0,
                ..BUSY
            }
        } else {
            BUSY
        }
    });
    let idle = IDLE;
    h.run(120, |g| {
        if g == 6 {
            Reading {
                power: 60.0,
                ..idle
            }
        } else {
            idle
        }
    });
    assert!(
        h.log().iter().all(|&(k, ..)| k != Kind::Straggler),
        "{:?}",
        h.log()
    );
}

#[test]
fn too_few_busy_peers_are_not_judged_and_an_open_event_clears_when_the_job_ends() {
    // Three busy GPUs: each has only 2 peers (< 3).
    let mut h = Host::new(3);
    h.run(60, |g| if g == 0 { slower(BUSY, 0.2) } else { BUSY });
    assert!(h.changes.is_empty(), "{:?}", h.log());

    let mut h = Host::new(8);
    h.run(30, |g| if g == 7 { slower(BUSY, 0.2) } else { BUSY });
    assert_eq!(h.log().len(), 1, "{:?}", h.log());
    // The job ends: nothing to compare with; cleared after 2 minutes.
    let idle = IDLE;
    h.run(200, |_| idle);
    let log = h.log();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!((log[1].0, log[1].2), (Kind::Straggler, false));
    assert!((148..=152).contains(&log[1].3), "{log:?}");
    assert!(h.changes[1].event().evidence.contains("not comparable"));
}

#[test]
fn a_low_clock_without_a_reason_is_clock_degraded_and_with_one_it_is_not() {
    let mut h = Host::new(8);
    h.run(30, |_| BUSY);
    // GPU 1: 1700 MHz (-14 %) and no reason; GPU 2: 990 MHz with HW
    // slowdown + HW thermal (the throttle detector's case).
    h.run(30, |g| match g {
        1 => Reading {
            clock: 1700.0,
            power: 560.0,
            ..BUSY
        },
        2 => Reading {
            clock: 990.0,
            reasons: (0x08 | 0x40) as f64,
            ..BUSY
        },
        _ => BUSY,
    });
    // GPU 2 is thermal_throttle's, and only its.
    let log = h.log();
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(
        (log[0].0, log[0].1, log[0].2),
        (Kind::ClockDegraded, 1, true)
    );
    assert_eq!(
        (log[1].0, log[1].1, log[1].2),
        (Kind::ThermalThrottle, 2, true)
    );
    // By hand: the 1 s mean of the clock is 1980 - 280 × (1 - e^-k) MHz k
    // polls in, 8.9 % short at second 30 (the run begins), then 12.2, 13.4,
    // 13.9 % ...: weights 1.5, 1.7, 1.7, 1.8, 1.8 earn the 8 s hold at 35,
    // and the 6 s minimum run ends at 36.
    assert_eq!(log[0].3, 36, "{log:?}");
    let e = h.changes[0].event();
    assert!(
        e.evidence.starts_with("SM clock 17") && e.evidence.contains("MHz vs 1980 MHz"),
        "{}",
        e.evidence
    );
}

#[test]
fn straggler_and_clock_on_one_gpu_are_one_incident() {
    let mut h = Host::new(8);
    h.run(30, |_| BUSY);
    h.run(30, |g| {
        if g == 4 {
            Reading {
                clock: 1600.0,
                ..slower(BUSY, 0.15)
            }
        } else {
            BUSY
        }
    });
    let opened = h
        .changes
        .iter()
        .filter(|c| matches!(c, Change::Opened(_)))
        .count();
    assert_eq!(opened, 1, "{:?}", h.log());
    let active: Vec<_> = h.engine.active().collect();
    assert_eq!(active.len(), 1);
    assert!(
        active[0].evidence.contains("with "),
        "{}",
        active[0].evidence
    );
}

#[test]
fn ten_hz_polls_weigh_the_same_time_span() {
    // The same 10 % straggler at 10 Hz: detected within the same seconds.
    let mut engine = Engine::new(HealthConfig::default()).unwrap();
    let slots: Vec<GpuSlot> = (0..8)
        .map(|g| engine.gpu(GpuId::new(format!("GPU-{g}"), "node-1", g)))
        .collect();
    let mut out = Vec::new();
    for tenth in 0..1200i64 {
        let ts = T0 + tenth * 100;
        for (g, &slot) in slots.iter().enumerate() {
            let r = if g == 5 && tenth >= 600 {
                slower(BUSY, 0.10)
            } else {
                BUSY
            };
            let wobble = 1.0 + ((tenth * 7 + g as i64 * 3) % 5) as f64 * 0.0005;
            for (f, v) in [
                (Field::GpuUtil, r.util),
                (Field::ProfSmActive, r.activity * wobble),
                (Field::PowerUsage, r.power * wobble),
            ] {
                engine.sample(slot, f, ts, v, &mut out);
            }
        }
        engine.finish_before(ts + 1, &mut out);
        engine.tick(ts, &mut out);
    }
    assert_eq!(out.len(), 1, "{out:?}");
    let e = out[0].event();
    assert_eq!((e.kind, e.gpu.gpu), (Kind::Straggler, 5));
    // By hand: the mean is 10 % × (1 - e^-t) short t s in; it passes 3 % at
    // 0.36 s (0.3 s with the texture's ±0.2 %), so the run begins at the
    // poll of 60.3 or 60.4 s and, its credit earned 3 s a second from 62.3 s
    // on, fires when its 6 s minimum ends.
    let onset = e.onset_ts_ms - T0;
    assert!((60_300..=60_400).contains(&onset), "{onset}");
    assert_eq!(e.detected_ts_ms - T0, onset + 6_000);
}

// ---------------------------------------------------------------------------
// The real 8-way tensor-parallel training run t13 (10 Hz), healthy and with
// a straggler spliced in: one GPU's SM activity and power scaled down from
// 100 s into the steady phase to the end. Its peers are the other 7 GPUs of
// the node, with their real noise: one of them runs 13 % below the others'
// SM activity all along, and power differs by up to 2.5 % between GPUs.

use crate::Poll;
use crate::real_data::{B1, T13, load, skip};

/// Runs a recording's polls (index = GPU), in time order across GPUs, through
/// an engine with a tick after each poll time; returns the changes.
fn replay(gpus: &[Vec<Poll>]) -> Vec<Change> {
    let mut engine = Engine::new(HealthConfig::default()).unwrap();
    let slots: Vec<GpuSlot> = (0..gpus.len())
        .map(|g| engine.gpu(GpuId::new(format!("GPU-{g}"), "node0", g as u32)))
        .collect();
    let mut all: Vec<(i64, usize, &Poll)> = gpus
        .iter()
        .enumerate()
        .flat_map(|(g, polls)| polls.iter().map(move |p| (p.ts_ms, g, p)))
        .collect();
    all.sort_by_key(|&(ts, g, _)| (ts, g));
    let mut out = Vec::new();
    let mut i = 0;
    while i < all.len() {
        let ts = all[i].0;
        while i < all.len() && all[i].0 == ts {
            let (_, g, p) = all[i];
            for f in crate::Field::ALL {
                if let Some(v) = p.get(f) {
                    engine.sample(slots[g], f, ts, v, &mut out);
                }
            }
            i += 1;
        }
        engine.finish_before(ts + 1, &mut out);
        engine.tick(ts, &mut out);
    }
    engine.finish_all(&mut out);
    out
}

/// Every 10th poll from `offset`: a 1 Hz scrape of the 10 Hz recording.
fn at_1hz(gpus: &[Vec<Poll>], offset: usize) -> Vec<Vec<Poll>> {
    gpus.iter()
        .map(|p| p.iter().skip(offset).step_by(10).cloned().collect())
        .collect()
}

/// `gpu`'s SM activity and power times `1 - by` from `from_ms` on.
fn splice_straggler(gpus: &[Vec<Poll>], gpu: usize, by: f64, from_ms: i64) -> Vec<Vec<Poll>> {
    let mut out = gpus.to_vec();
    for p in out[gpu].iter_mut().filter(|p| p.ts_ms >= from_ms) {
        for f in [Field::ProfSmActive, Field::PowerUsage] {
            if let Some(v) = p.get(f) {
                p.set(f, v * (1.0 - by));
            }
        }
    }
    out
}

/// Replays `polls` with a straggler spliced into `gpu`: when the straggler
/// opened on it, if it did. Nothing else may open: no event on another GPU,
/// and nothing but the straggler (`what` names the case in the message).
fn straggler_detected(polls: &[Vec<Poll>], gpu: usize, what: &str) -> Option<i64> {
    let opened: Vec<_> = replay(polls)
        .into_iter()
        .filter_map(|c| match c {
            Change::Opened(e) => Some(e),
            _ => None,
        })
        .collect();
    assert!(
        opened
            .iter()
            .all(|e| e.gpu.gpu as usize == gpu && e.kind == Kind::Straggler),
        "{what} on GPU {gpu}: {opened:?}"
    );
    opened.first().map(|e| e.detected_ts_ms)
}

#[test]
fn the_real_recordings_raise_no_peer_event() {
    for name in [T13, B1] {
        if skip(name) {
            continue;
        }
        let gpus = load(name).unwrap();
        for (rate, polls) in [("10 Hz", gpus.clone()), ("1 Hz", at_1hz(&gpus, 3))] {
            let peer: Vec<_> = replay(&polls)
                .into_iter()
                .filter(|c| matches!(c.event().kind, Kind::Straggler | Kind::ClockDegraded))
                .collect();
            assert!(peer.is_empty(), "{name} at {rate}: {peer:?}");
        }
    }
}

#[test]
fn a_straggler_spliced_into_the_real_training_run_is_found_on_its_gpu() {
    if skip(T13) {
        return;
    }
    let gpus = load(T13).unwrap();
    let t0 = gpus[0][0].ts_ms;
    // The steady phase runs from 44.7 s to 314.7 s.
    let from = t0 + 145_000;
    let mut missed = Vec::new();
    let mut ttd: Vec<(f64, &str, i64)> = Vec::new();
    for by in [0.10, 0.20, 0.30] {
        for gpu in 0..gpus.len() {
            let spliced = splice_straggler(&gpus, gpu, by, from);
            for (rate, polls) in [("10 Hz", spliced.clone()), ("1 Hz", at_1hz(&spliced, 3))] {
                match straggler_detected(&polls, gpu, &format!("{by} at {rate}")) {
                    Some(at) => ttd.push((by, rate, at - from)),
                    None => missed.push(format!("{by} on GPU {gpu} at {rate}")),
                }
            }
        }
    }
    assert!(missed.is_empty(), "{missed:#?}");
    // Time to detect, worst case per grade and rate. The peers' real noise
    // makes 1 Hz slower than the simulator's p95 goal of 10 s for the
    // smallest grade; recorded in docs/HEALTH.md.
    let worst = |by: f64, rate: &str| {
        ttd.iter()
            .filter(|t| t.0 == by && t.1 == rate)
            .map(|t| t.2)
            .max()
            .unwrap()
    };
    // Measured: 7.1, 6.1, 6.1 s at 10 Hz; 11.9, 6.9, 6.9 s at 1 Hz.
    for (by, rate, limit_ms) in [
        (0.10, "10 Hz", 8_000),
        (0.20, "10 Hz", 7_000),
        (0.30, "10 Hz", 7_000),
        (0.10, "1 Hz", 15_000),
        (0.20, "1 Hz", 8_000),
        (0.30, "1 Hz", 8_000),
    ] {
        let w = worst(by, rate);
        assert!(w <= limit_ms, "{by} at {rate}: {w} ms > {limit_ms} ms");
    }
}

#[test]
fn a_straggler_present_when_the_real_training_job_starts_is_found_within_10_s() {
    if skip(T13) {
        return;
    }
    let gpus = load(T13).unwrap();
    let t0 = gpus[0][0].ts_ms;
    let mut found = Vec::new();
    for by in [0.10, 0.20, 0.30] {
        for gpu in 0..gpus.len() {
            // Slow from the recording's first poll: the job starts on it
            // (warm-up at 16 s) with the fault already there.
            let spliced = splice_straggler(&gpus, gpu, by, t0);
            for (rate, polls) in [("10 Hz", spliced.clone()), ("1 Hz", at_1hz(&spliced, 3))] {
                // The job's start on this GPU: its first busy poll.
                let start = polls[gpu]
                    .iter()
                    .find(|p| p.get(Field::GpuUtil).is_some_and(|u| u >= 30.0))
                    .unwrap()
                    .ts_ms;
                match straggler_detected(&polls, gpu, &format!("{by} at {rate}")) {
                    Some(at) => found.push((by, rate, gpu, at - start)),
                    None => panic!("{by} on GPU {gpu} at {rate}: missed"),
                }
            }
        }
    }
    // Within 10 s of the job's start, but for the smallest grade at 1 Hz,
    // where the real SM activity's noise (0.1 to 0.55 from one poll to the
    // next) leaves a 10 % shortfall marginal for some seconds.
    for &(by, rate, gpu, ttd) in &found {
        let limit = if by < 0.15 && rate == "1 Hz" {
            15_000
        } else {
            10_000
        };
        assert!(ttd <= limit, "{by} on GPU {gpu} at {rate}: {ttd} ms");
    }
}

#[test]
fn the_median_without_one_and_in_step_by_hand() {
    use super::{in_step, median_without};
    let v = [1.0f32, 2.0, 3.0, 4.0, 10.0];
    // Without 10: 1 2 3 4 -> 2.5; without 1: 2 3 4 10 -> 3.5; without 3: 1 2 4 10 -> 3.
    assert_eq!(median_without(&v, 10.0), 2.5);
    assert_eq!(median_without(&v, 1.0), 3.5);
    assert_eq!(median_without(&v, 3.0), 3.0);
    // Without one of two equal values, the other stays.
    assert_eq!(median_without(&[5.0, 5.0, 7.0], 5.0), 6.0);
    // Peers 100, 101, 102, 99 (median 100.5), the GPU at 80: in step at 5 %.
    let mut p = [80.0f32, 99.0, 100.0, 101.0, 102.0];
    p.sort_unstable_by(f32::total_cmp);
    assert!(in_step(&p, 80.0, 100.5, 0.05));
    // One of four peers at 90 (10 % off): 3 to 6 peers must all agree.
    let mut q = [80.0f32, 90.0, 100.0, 101.0, 102.0];
    q.sort_unstable_by(f32::total_cmp);
    assert!(!in_step(&q, 80.0, 100.5, 0.05));
    // Seven peers may have one outlier, not two.
    let mut r = [80.0f32, 90.0, 100.0, 100.0, 101.0, 101.0, 102.0, 99.0];
    r.sort_unstable_by(f32::total_cmp);
    assert!(in_step(&r, 80.0, 100.0, 0.05));
    let mut t = [80.0f32, 90.0, 90.0, 100.0, 101.0, 101.0, 102.0, 99.0];
    t.sort_unstable_by(f32::total_cmp);
    assert!(!in_step(&t, 80.0, 100.0, 0.05));
}

#[test]
fn a_frozen_gpu_is_no_straggler_when_its_peers_speed_up() {
    // A zombie repeats its readings from second 60, bit for bit, while its
    // peers go from 600 W to 680 W: 12 % "behind", but not slow.
    let mut h = Host::new(8);
    h.run(60, |_| BUSY);
    for _ in 0..120 {
        let ts = T0 + h.second * 1000;
        for (g, &slot) in h.slots.iter().enumerate() {
            let r = if g == 3 {
                BUSY
            } else {
                Reading {
                    power: 680.0,
                    activity: 0.9,
                    ..BUSY
                }
            };
            // The frozen GPU's values carry no per-second texture either.
            let wobble = if g == 3 {
                1.0
            } else {
                1.0 + (h.second % 3) as f64 * 0.001
            };
            for (f, v) in [
                (Field::GpuUtil, r.util),
                (Field::ProfSmActive, r.activity * wobble),
                (Field::PowerUsage, r.power * wobble),
                (Field::SmClock, r.clock),
            ] {
                h.engine.sample(slot, f, ts, v, &mut h.changes);
            }
        }
        h.engine.finish_before(ts + 1, &mut h.changes);
        h.engine.tick(ts, &mut h.changes);
        h.second += 1;
    }
    assert!(
        h.log().iter().all(|&(k, ..)| k != Kind::Straggler),
        "{:?}",
        h.log()
    );
}

#[test]
fn whole_watt_power_and_no_profiling_fields_still_count_as_moving_readings() {
    // A source with integer watts and no SM activity (activity falls back to
    // GPU_UTIL / 100 = 1.0): the readings change every second, so the GPUs
    // are compared, and GPU 6's low clock is found.
    let mut engine = Engine::new(HealthConfig::default()).unwrap();
    let slots: Vec<GpuSlot> = (0..8)
        .map(|g| engine.gpu(GpuId::new(format!("GPU-{g}"), "node-1", g)))
        .collect();
    let mut out = Vec::new();
    for second in 0..40i64 {
        let ts = T0 + second * 1000;
        for (g, &slot) in slots.iter().enumerate() {
            let power = 600 + (second * 7 + g as i64 * 3) % 5;
            let clock = if g == 6 && second >= 20 {
                1700.0
            } else {
                1980.0
            };
            for (f, v) in [
                (Field::GpuUtil, 100.0),
                (Field::PowerUsage, power as f64),
                (Field::SmClock, clock),
            ] {
                engine.sample(slot, f, ts, v, &mut out);
            }
        }
        engine.finish_before(ts + 1, &mut out);
        engine.tick(ts, &mut out);
    }
    let opened: Vec<(Kind, u32)> = out
        .iter()
        .filter(|c| matches!(c, Change::Opened(_)))
        .map(|c| (c.event().kind, c.event().gpu.gpu))
        .collect();
    assert_eq!(opened, vec![(Kind::ClockDegraded, 6)]);
}
