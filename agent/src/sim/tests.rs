use super::fault::{
    CLOCK_DEGRADED_CUT, DRIFTED_DRIVER_VERSION, DRIFTED_VBIOS_VERSION, STRAGGLER_SLOWDOWN,
    THERMAL_RISE_C_PER_S,
};
use super::*;
const N: usize = Metric::ALL.len();
const THERMAL_BITS: u64 = CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_THERMAL;

fn run(seed: u64, gpus: u32, ticks: usize) -> Vec<Vec<Reading>> {
    run_with(SimConfig::new(seed, gpus), ticks).0
}

fn series(ticks: &[Vec<Reading>], gpu: u32, m: Metric) -> Vec<f64> {
    ticks.iter().map(|t| value(t, gpu, m)).collect()
}

#[test]
fn deterministic_per_seed() {
    assert_eq!(run(7, 4, 50), run(7, 4, 50));
    assert_ne!(run(7, 4, 50), run(8, 4, 50));
    let a = SimulatedSource::new(SimConfig::new(7, 2));
    let b = SimulatedSource::new(SimConfig::new(7, 2));
    assert_eq!(a.inventory(), b.inventory());
    assert_ne!(a.inventory()[0].uuid, a.inventory()[1].uuid);
}

#[test]
fn every_metric_for_every_gpu_every_tick() {
    let t = run(1, 3, 2);
    assert_eq!(t[0].len(), 3 * Metric::ALL.len());
}

#[test]
fn physically_plausible() {
    // Two simulated hours: several node phases.
    let t = run(42, 2, 7200);
    for gpu in 0..2 {
        let energy = series(&t, gpu, Metric::TotalEnergyConsumption);
        assert!(
            energy.windows(2).all(|w| w[1] > w[0]),
            "energy is strictly monotonic"
        );
        let power = series(&t, gpu, Metric::PowerUsage);
        // Energy rises by the integral of power (1 s steps), to the mJ.
        let rise = energy[energy.len() - 1] - energy[0];
        let integral: f64 = power[1..].iter().map(|p| p * 1000.0).sum();
        assert!(
            (rise - integral).abs() <= power.len() as f64,
            "{rise} vs {integral}"
        );
        assert!(power.iter().all(|&p| (60.0..=700.0).contains(&p)));
        let util = series(&t, gpu, Metric::GpuUtil);
        assert!(
            util.iter()
                .all(|&u| u.fract() == 0.0 && (0.0..=100.0).contains(&u))
        );
        // Plateaus: most consecutive readings stay within a few percent.
        let small_steps = util
            .windows(2)
            .filter(|w| (w[1] - w[0]).abs() <= 6.0)
            .count();
        assert!(small_steps as f64 > 0.95 * util.len() as f64);
        // Both idle and busy phases occur.
        assert!(util.contains(&0.0) && util.iter().any(|&u| u > 50.0));
        let temp = series(&t, gpu, Metric::GpuTemp);
        assert!(temp.windows(2).all(|w| (w[1] - w[0]).abs() <= 20.0));
        let fb_used = series(&t, gpu, Metric::FbUsed);
        let fb_free = series(&t, gpu, Metric::FbFree);
        for (u, f) in fb_used.iter().zip(&fb_free) {
            assert_eq!(u + f + FB_RESERVED_MIB, FB_TOTAL_MIB);
        }
        assert!(series(&t, gpu, Metric::XidErrors).iter().all(|&x| x == 0.0));
        // The SM clock is the idle clock or a 15 MHz step of the boost range.
        for (k, tick) in t.iter().enumerate() {
            let clock = value(tick, gpu, Metric::SmClock);
            let temp = value(tick, gpu, Metric::GpuTemp);
            if value(tick, gpu, Metric::GpuUtil) == 0.0 {
                assert_eq!(clock, 345.0, "tick {k}");
            } else {
                let expect = (1980.0 - 15.0 * (temp - 75.0).max(0.0)).max(1755.0);
                assert_eq!(clock, expect, "tick {k}: {temp} °C");
            }
        }
    }
}

/// Samples `s` for `ticks` ticks, handing each tick's readings and the
/// source to `f`.
fn stream(
    s: &mut SimulatedSource,
    ticks: usize,
    mut f: impl FnMut(usize, &[Reading], &SimulatedSource),
) {
    let mut v = Vec::new();
    for k in 0..ticks {
        v.clear();
        s.sample(&mut v).unwrap();
        f(k, &v, s);
    }
}

fn spread(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(f64::MIN, f64::max);
    let min = v.iter().copied().fold(f64::MAX, f64::min);
    max - min
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

#[test]
fn peers_in_a_synchronous_phase_agree() {
    let mut checked = 0;
    for seed in [5, 6] {
        let mut s = SimulatedSource::new(SimConfig::new(seed, 8));
        let mut since = 0; // ticks every GPU has been in the same synchronous phase
        stream(&mut s, 3600, |k, tick, s| {
            let all_sync = (0..8).all(|g| s.gpu_phase(g) == Some(NodePhase::Synchronous))
                && s.gpus.iter().all(|g| g.phase_id == s.gpus[0].phase_id);
            since = if all_sync { since + 1 } else { 0 };
            if since < 4 {
                return;
            }
            let of = |m| (0..8).map(|g| value(tick, g, m)).collect::<Vec<_>>();
            let power = of(Metric::PowerUsage);
            let sm = of(Metric::SmActive);
            let util = of(Metric::GpuUtil);
            let clock = of(Metric::SmClock);
            // Silicon ±2 %, load ±1 %, noise ±3 W.
            assert!(spread(&power) <= 0.08 * mean(&power), "tick {k}: {power:?}");
            assert!(spread(&sm) <= 0.04 * mean(&sm), "tick {k}: {sm:?}");
            assert!(spread(&util) <= 4.0, "tick {k}: {util:?}");
            assert!(util.iter().all(|&u| u >= 72.0), "tick {k}: {util:?}");
            // Once temperatures have settled (20 s time constant): cooling
            // offsets within 3 °C and power within ~6 %, so at most ~6 °C and
            // 6 clock steps apart (a degraded clock loses at least 10 %).
            if since >= 120 {
                assert!(spread(&clock) <= 90.0, "tick {k}: {clock:?}");
            }
            checked += 1;
        });
    }
    assert!(checked > 1000, "{checked} synchronous ticks checked");
}

#[test]
fn long_runs_show_every_phase_and_healthy_gpus_stay_cool() {
    for seed in 1..=3 {
        let mut s = SimulatedSource::new(SimConfig::new(seed, 8));
        let mut phases = std::collections::HashSet::new();
        let mut node_changes = 0;
        let mut last = None;
        let mut last_busy = [None; 8];
        let (mut to_busy, mut to_idle) = (0, 0);
        let mut switch_ticks: Vec<Vec<usize>> = vec![Vec::new(); 8];
        let mut last_id = [u64::MAX; 8];
        let mut independent_disagree = false;
        let mut max_temp = f64::MIN;
        // Six simulated hours.
        stream(&mut s, 6 * 3600, |k, tick, s| {
            let phase = s.node_phase();
            phases.insert(phase);
            if last.is_some_and(|p| p != phase) {
                node_changes += 1;
            }
            last = Some(phase);
            for gpu in 0..8u32 {
                let g = gpu as usize;
                let temp = value(tick, gpu, Metric::GpuTemp);
                max_temp = max_temp.max(temp);
                assert!(
                    temp <= SLOWDOWN_TEMP_C - 3.0,
                    "seed {seed} tick {k}: {temp}"
                );
                let reasons = s.clock_event_reasons(gpu).unwrap();
                assert_eq!(reasons & THERMAL_BITS, 0, "seed {seed} tick {k}");
                assert_eq!(
                    value(tick, gpu, Metric::ClockThrottleReasons) as u64 & !CLOCK_EVENT_GPU_IDLE,
                    0
                );
                assert_eq!(value(tick, gpu, Metric::ThermalViolation), 0.0);
                let busy = value(tick, gpu, Metric::GpuUtil) > 0.0;
                match last_busy[g] {
                    Some(false) if busy => to_busy += 1,
                    Some(true) if !busy => to_idle += 1,
                    _ => {}
                }
                last_busy[g] = Some(busy);
                let id = s.gpus[g].phase_id;
                if id != last_id[g] {
                    switch_ticks[g].push(k);
                    last_id[g] = id;
                }
            }
            if s.gpu_phase(0) == Some(NodePhase::Independent)
                && (0..8).all(|g| s.gpu_phase(g) == Some(NodePhase::Independent))
            {
                let util: Vec<f64> = (0..8).map(|g| value(tick, g, Metric::GpuUtil)).collect();
                independent_disagree |= spread(&util) > 20.0;
            }
        });
        assert_eq!(phases.len(), 3, "seed {seed}: {phases:?}");
        assert!(node_changes >= 10, "seed {seed}: {node_changes}");
        assert!(
            to_busy >= 8 && to_idle >= 8,
            "seed {seed}: {to_busy} {to_idle}"
        );
        assert!(independent_disagree, "seed {seed}: independent GPUs differ");
        assert!(
            max_temp > 60.0,
            "seed {seed}: the run gets warm ({max_temp})"
        );
        // Every GPU enters every node phase, 0-3 ticks after the first one does.
        // (The last boundary may fall in the last ticks, some GPUs not there yet.)
        let n = switch_ticks.iter().map(Vec::len).min().unwrap();
        let mut skewed = 0;
        for p in 1..n {
            let at: Vec<f64> = switch_ticks.iter().map(|v| v[p] as f64).collect();
            assert!(spread(&at) <= 3.0, "seed {seed}: phase {p} at {at:?}");
            if spread(&at) > 0.0 {
                skewed += 1;
            }
        }
        assert!(skewed * 2 > n, "seed {seed}: most boundaries are skewed");
    }
}

#[test]
fn ambient_warming_moves_every_gpu_together() {
    let mut warm = SimulatedSource::new(SimConfig::new(31, 8));
    let mut flat = SimulatedSource::new(SimConfig::new(31, 8));
    // The twin without warming episodes.
    flat.node.ambient.start = u64::MAX;
    let (mut a, mut b) = (Vec::new(), Vec::new());
    let mut peak = 0.0f64;
    let mut warmed_ticks = 0;
    for k in 0..4 * 3600 {
        a.clear();
        b.clear();
        warm.sample(&mut a).unwrap();
        flat.sample(&mut b).unwrap();
        let offset = warm.ambient_offset_c();
        assert_eq!(flat.ambient_offset_c(), 0.0);
        assert!((0.0..=6.0).contains(&offset));
        peak = peak.max(offset);
        if offset >= 2.0 {
            warmed_ticks += 1;
        }
        for gpu in 0..8 {
            let rise = value(&a, gpu, Metric::GpuTemp) - value(&b, gpu, Metric::GpuTemp);
            assert!(
                (rise - offset).abs() <= 1.0,
                "tick {k} GPU {gpu}: {rise} °C vs ambient {offset}"
            );
            // Nothing but temperature (and the clock that follows it) moves.
            for m in [Metric::PowerUsage, Metric::GpuUtil, Metric::SmActive] {
                assert_eq!(value(&a, gpu, m), value(&b, gpu, m));
            }
        }
    }
    assert!(peak >= 3.0, "a warming episode of 3-6 °C happened: {peak}");
    assert!(warmed_ticks >= 100, "{warmed_ticks}");
}

// ---- faults ----

fn run_with(config: SimConfig, ticks: usize) -> (Vec<Vec<Reading>>, SimulatedSource) {
    let mut s = SimulatedSource::new(config);
    let t = (0..ticks)
        .map(|_| {
            let mut v = Vec::new();
            s.sample(&mut v).unwrap();
            v
        })
        .collect();
    (t, s)
}

fn with_faults(seed: u64, gpus: u32, scheduled: Vec<ScheduledFault>) -> SimConfig {
    let mut c = SimConfig::new(seed, gpus);
    c.faults.scheduled = scheduled;
    c
}

fn one_fault(
    seed: u64,
    gpus: u32,
    gpu: u32,
    kind: FaultKind,
    start_tick: u64,
    duration_ticks: Option<u64>,
) -> SimConfig {
    with_faults(
        seed,
        gpus,
        vec![ScheduledFault {
            gpu,
            kind,
            start_tick,
            duration_ticks,
        }],
    )
}

fn of_gpu(tick: &[Reading], gpu: u32) -> Vec<Reading> {
    tick.iter().filter(|r| r.gpu == gpu).copied().collect()
}

fn value(tick: &[Reading], gpu: u32, m: Metric) -> f64 {
    tick.iter()
        .find(|r| r.gpu == gpu && r.metric == m)
        .unwrap_or_else(|| panic!("no {m:?} for GPU {gpu}"))
        .value
}

/// The first seed from `from` whose scheduled zombie (GPU `gpu`, tick
/// `start`) is of `variant`.
fn zombie_seed(from: u64, gpus: u32, gpu: u32, start: u64, variant: &str) -> u64 {
    (from..from + 64)
        .find(|&seed| {
            let (_, s) = run_with(
                one_fault(seed, gpus, gpu, FaultKind::Zombie, start, Some(1)),
                start as usize + 1,
            );
            s.ground_truth().events()[0].variant == Some(variant)
        })
        .expect("a seed of each variant")
}

#[test]
fn no_faults_by_default() {
    assert!(SimConfig::new(1, 1).faults.is_empty());
    let (t, s) = run_with(SimConfig::new(3, 4), 300);
    assert!(s.ground_truth().events().is_empty());
    for tick in &t {
        for gpu in 0..4 {
            assert_eq!(value(tick, gpu, Metric::XidErrors), 0.0);
            assert_eq!(value(tick, gpu, Metric::UncorrectableRemappedRows), 0.0);
            assert_eq!(value(tick, gpu, Metric::CorrectableRemappedRows), 0.0);
            assert_eq!(value(tick, gpu, Metric::RowRemapPending), 0.0);
            assert!(value(tick, gpu, Metric::GpuTemp) < SLOWDOWN_TEMP_C);
        }
    }
    assert!(
        s.inventory()
            .iter()
            .all(|g| g.driver_version == "550.54.15")
    );
}

#[test]
fn xid79_at_tick_10_on_gpu_2() {
    // duration ignored: XID 79 is permanent.
    let config = one_fault(5, 4, 2, FaultKind::Xid79FallenOffBus, 10, Some(3));
    let (t, s) = run_with(config, 20);
    let (healthy, _) = run_with(SimConfig::new(5, 4), 20);
    for (k, tick) in t.iter().enumerate() {
        let g2 = of_gpu(tick, 2);
        if k < 10 {
            assert_eq!(g2.len(), N, "tick {k}");
            assert_eq!(value(tick, 2, Metric::XidErrors), 0.0);
        } else {
            // Only the XID gauge, from the kernel log, as dcgm-exporter shows it.
            assert_eq!(
                g2,
                vec![Reading::new(2, Metric::XidErrors, 79.0)],
                "tick {k}"
            );
        }
        // The other GPUs are untouched.
        for gpu in [0, 1, 3] {
            assert_eq!(of_gpu(tick, gpu), of_gpu(&healthy[k], gpu));
        }
    }
    assert_eq!(
        s.ground_truth().events(),
        vec![FaultEvent {
            gpu: 2,
            uuid: s.inventory()[2].uuid.clone(),
            kind: FaultKind::Xid79FallenOffBus,
            xid: Some(79),
            start_tick: 10,
            end_tick: None,
            start_ts_ms: None,
            end_ts_ms: None,
            magnitude: None,
            variant: None,
            shown_tick: Some(10),
            shown_ticks: 10,
        }]
    );
}

#[test]
fn xid48_sets_the_gauge_and_an_uncorrectable_row() {
    let config = one_fault(6, 2, 0, FaultKind::Xid48DoubleBitEcc, 5, None);
    let (t, s) = run_with(config, 40);
    for (k, tick) in t.iter().enumerate() {
        assert_eq!(of_gpu(tick, 0).len(), N, "the GPU keeps reporting");
        let (xid, rows) = if k < 5 { (0.0, 0.0) } else { (48.0, 1.0) };
        assert_eq!(value(tick, 0, Metric::XidErrors), xid, "tick {k}");
        assert_eq!(
            value(tick, 0, Metric::UncorrectableRemappedRows),
            rows,
            "tick {k}"
        );
        // The double-bit error shows in the ECC counters too, and its row
        // waits for a reset that never comes.
        assert_eq!(value(tick, 0, Metric::EccDbeVolTotal), rows, "tick {k}");
        assert_eq!(value(tick, 0, Metric::RowRemapPending), rows, "tick {k}");
        assert_eq!(value(tick, 0, Metric::EccDbeAggTotal), rows, "tick {k}");
        assert_eq!(value(tick, 1, Metric::XidErrors), 0.0);
    }
    let e = s.ground_truth().events();
    assert_eq!(e.len(), 1);
    assert_eq!(
        (
            e[0].gpu,
            e[0].kind,
            e[0].xid,
            e[0].start_tick,
            e[0].end_tick
        ),
        (0, FaultKind::Xid48DoubleBitEcc, Some(48), 5, None)
    );
    // Shown every tick the gauge reads 48: ticks 5..40.
    assert_eq!((e[0].shown_tick, e[0].shown_ticks), (Some(5), 35));
}

#[test]
fn row_remap_growth_one_row_per_30_s_with_xid_63_pending_until_the_reset() {
    let mut config = one_fault(7, 1, 0, FaultKind::RowRemapGrowth, 0, Some(100));
    config.interval_ms = 1000;
    let (t, s) = run_with(config, 130);
    for (k, tick) in t.iter().enumerate() {
        // Rows remapped at ticks 0, 30, 60 and 90; none after the fault ends at 100.
        let rows = match k {
            0..30 => 1.0,
            30..60 => 2.0,
            60..90 => 3.0,
            _ => 4.0,
        };
        assert_eq!(
            value(tick, 0, Metric::CorrectableRemappedRows),
            rows,
            "tick {k}"
        );
        assert_eq!(value(tick, 0, Metric::XidErrors), 63.0);
        assert_eq!(value(tick, 0, Metric::UncorrectableRemappedRows), 0.0);
        // Pending from the first row until the fault ends at 100 (the reset
        // that applies the remaps).
        let pending = if k < 100 { 1.0 } else { 0.0 };
        assert_eq!(value(tick, 0, Metric::RowRemapPending), pending, "tick {k}");
    }
    let e = s.ground_truth().events();
    assert_eq!((e[0].start_tick, e[0].end_tick), (0, Some(100)));
    // Shown at the four ticks a row was added.
    assert_eq!((e[0].shown_tick, e[0].shown_ticks), (Some(0), 4));
    assert_eq!((e[0].magnitude, e[0].variant), (None, None));
}

#[test]
fn thermal_throttle_heats_and_cuts_the_clock() {
    // GPU 1 loses its cooling at tick 10 for 200 ticks (1 s each), on a
    // seed where it works for most of that time.
    let (seed, healthy) = (11..60)
        .map(|seed| (seed, run(seed, 2, 400)))
        .find(|(_, t)| {
            t[80..210]
                .iter()
                .filter(|t| value(t, 1, Metric::GpuUtil) > 0.0)
                .count()
                > 100
        })
        .expect("a busy GPU 1");
    let config = one_fault(seed, 2, 1, FaultKind::ThermalThrottle, 10, Some(200));
    let mut s = SimulatedSource::new(config);
    let truth = s.ground_truth();
    let mut busy_in_window = 0;
    let mut throttled_ticks = 0u64;
    let mut hot_from = None;
    for (k, base) in healthy.iter().enumerate() {
        let mut tick = Vec::new();
        s.sample(&mut tick).unwrap();
        let reasons = s.clock_event_reasons(1).unwrap();
        let (temp, clock) = (
            value(&tick, 1, Metric::GpuTemp),
            value(&tick, 1, Metric::SmClock),
        );
        if k == 10 {
            let rate = truth.events()[0].magnitude.unwrap();
            assert!(THERMAL_RISE_C_PER_S.contains(&rate), "{rate}");
            // From at least 27.4 °C (idle), 62 °C of excess heat reach the threshold.
            hot_from = Some(10 + (62.0 / rate).ceil() as usize);
        }
        if k < 10 {
            assert_eq!(tick, *base, "tick {k}: identical before the fault");
        } else if hot_from.is_some_and(|h| (h..210).contains(&k)) {
            assert!((87.0..=90.0).contains(&temp), "tick {k}: {temp} °C");
            assert!(clock <= 990.0, "tick {k}: {clock} MHz");
            assert_eq!(reasons & 0x48, 0x48, "tick {k}: HW slowdown + HW thermal");
            assert_eq!(
                value(&tick, 1, Metric::ClockThrottleReasons) as u64 & 0x48,
                0x48,
                "tick {k}: the bitmask metric shows it"
            );
            assert!(
                value(&tick, 1, Metric::PowerUsage) <= value(base, 1, Metric::PowerUsage) + 0.001
            );
            if value(base, 1, Metric::SmClock) > 990.0 {
                busy_in_window += 1;
            }
        } else if k >= 290 {
            // 80 s after the fault the excess heat is below 3 °C: no more throttling.
            assert!(temp < 87.0, "tick {k}: {temp} °C");
            assert_eq!(reasons & 0x48, 0, "tick {k}");
            assert!(clock == 345.0 || clock >= 1755.0, "tick {k}: {clock} MHz");
        }
        assert_eq!(of_gpu(&tick, 0), of_gpu(base, 0), "GPU 0 is untouched");
        if reasons & 0x48 == 0x48 {
            throttled_ticks += 1;
        }
        if k == 399 {
            // The counter integrates the throttled ticks, 1 s each.
            let ns = value(&tick, 1, Metric::ThermalViolation);
            assert!(throttled_ticks >= 30);
            assert_eq!(ns, throttled_ticks as f64 * 1e9);
            assert_eq!(ns, value(&tick, 1, Metric::ClocksEventHwThermSlowdownNs));
            assert_eq!(value(&tick, 0, Metric::ThermalViolation), 0.0);
        }
    }
    assert!(
        busy_in_window > 0,
        "the window must contain busy ticks, or the clock check proves nothing"
    );
    // Shown while the temperature was at or above the threshold during the
    // fault (the cool-down after it is not the fault's).
    let e = &truth.events()[0];
    assert!(e.shown_tick.is_some_and(|t| t >= 10));
    assert!(e.shown_ticks > 0 && e.shown_ticks <= 200 && e.shown_ticks <= throttled_ticks);
}

#[test]
fn thermal_faults_rise_at_their_own_rates() {
    // Eight GPUs lose their cooling at tick 100; each heats at its own rate.
    let scheduled = (0..8)
        .map(|gpu| ScheduledFault {
            gpu,
            kind: FaultKind::ThermalThrottle,
            start_tick: 100,
            duration_ticks: Some(300),
        })
        .collect();
    let (t, s) = run_with(with_faults(17, 8, scheduled), 400);
    let (healthy, _) = run_with(SimConfig::new(17, 8), 400);
    let events = s.ground_truth().events();
    let rates: Vec<f64> = events.iter().map(|e| e.magnitude.unwrap()).collect();
    assert!(
        rates.iter().all(|r| THERMAL_RISE_C_PER_S.contains(r)),
        "{rates:?}"
    );
    assert!(spread(&rates) > 1.0, "the rates differ: {rates:?}");
    for e in &events {
        let rate = e.magnitude.unwrap();
        let mut hot = 0;
        for k in 100..400 {
            let excess =
                value(&t[k], e.gpu, Metric::GpuTemp) - value(&healthy[k], e.gpu, Metric::GpuTemp);
            let temp = value(&t[k], e.gpu, Metric::GpuTemp);
            if hot == 0 && temp < SLOWDOWN_TEMP_C {
                // Before the slowdown the power is the healthy one, so the
                // excess is exactly the rise so far (both temperatures rounded).
                let rise = rate * (k - 99) as f64;
                assert!(
                    (excess - rise).abs() <= 1.0,
                    "{e:?} tick {k}: {excess} vs {rise}"
                );
            } else if temp >= SLOWDOWN_TEMP_C {
                hot += 1;
            }
        }
        assert_eq!(e.shown_ticks, hot, "{e:?}");
    }
}

#[test]
fn straggler_lags_its_healthy_self_by_its_magnitude() {
    let config = one_fault(12, 4, 3, FaultKind::Straggler, 0, Some(600));
    let (t, s) = run_with(config, 700);
    let (healthy, hs) = run_with(SimConfig::new(12, 4), 700);
    let e = &s.ground_truth().events()[0];
    let slow = e.magnitude.unwrap();
    assert!(STRAGGLER_SLOWDOWN.contains(&slow), "{slow}");
    let keep = 1.0 - slow;
    let mut busy = 0;
    for (k, (tick, base)) in t.iter().zip(&healthy).enumerate() {
        let v = |m| value(tick, 3, m);
        let b = |m| value(base, 3, m);
        if k < 600 {
            if b(Metric::GpuUtil) > 0.0 {
                busy += 1;
                assert_eq!(
                    v(Metric::GpuUtil),
                    (b(Metric::GpuUtil) * keep).round(),
                    "tick {k}"
                );
                for m in [
                    Metric::GrEngineActive,
                    Metric::PipeTensorActive,
                    Metric::DramActive,
                ] {
                    assert!((v(m) - b(m) * keep).abs() <= 1e-6, "tick {k} {m:?}");
                }
                for m in [Metric::SmActive, Metric::PipeFp16Active] {
                    assert!((v(m) - b(m) * keep).abs() <= 3e-6, "tick {k} {m:?}");
                }
                // The dynamic part of power (over ~70 W idle, ±2 % silicon,
                // ±3 W noise shared with the twin) shrinks by the same factor.
                let (p, bp) = (v(Metric::PowerUsage), b(Metric::PowerUsage));
                if bp < 700.0 {
                    let drop = bp - p;
                    assert!(
                        (drop - slow * (bp - 70.0)).abs() <= slow * 4.5 + 0.002,
                        "tick {k}: {p} W vs {bp} W"
                    );
                }
                // Clock not cut (cooler, so if anything higher), no reasons.
                assert!(v(Metric::SmClock) >= b(Metric::SmClock), "tick {k}");
                assert_eq!(v(Metric::ClockThrottleReasons), 0.0, "tick {k}");
            } else {
                // Idle: nothing to slow down (temperature and energy may
                // still differ from the busy stretch before).
                for m in [Metric::GpuUtil, Metric::PowerUsage, Metric::SmActive] {
                    assert_eq!(v(m), b(m), "tick {k}: idle");
                }
            }
        } else {
            // Same random stream: the workload is the healthy one again.
            assert_eq!(v(Metric::GpuUtil), b(Metric::GpuUtil), "tick {k}");
            assert_eq!(v(Metric::PowerUsage), b(Metric::PowerUsage), "tick {k}");
        }
        for gpu in 0..3 {
            assert_eq!(of_gpu(tick, gpu), of_gpu(base, gpu));
        }
    }
    assert!(busy > 100, "the GPU must be busy for the lag to show");
    assert_eq!(e.end_tick, Some(600));
    assert_eq!(hs.clock_event_reasons(3), s.clock_event_reasons(3));
}

#[test]
fn straggler_shows_only_in_synchronous_busy_phases() {
    // Find, on a healthy run, stretches where GPU 0 is idle and where it is
    // in a synchronous job; put a straggler on each.
    let ticks = 4 * 3600;
    let mut phase = Vec::new();
    let mut s = SimulatedSource::new(SimConfig::new(23, 4));
    let mut busy = Vec::new();
    stream(&mut s, ticks, |_, tick, s| {
        phase.push(s.gpu_phase(0).unwrap());
        busy.push(value(tick, 0, Metric::GpuUtil) > 0.0);
    });
    let find = |p: NodePhase| {
        (0..ticks - 40)
            .find(|&k| phase[k..k + 40].iter().all(|&q| q == p))
            .unwrap_or_else(|| panic!("no 40 ticks of {p:?}"))
    };
    let idle = find(NodePhase::Idle);
    let sync = find(NodePhase::Synchronous);
    // A stretch over a phase boundary too, synchronous or not.
    let mixed = (1..ticks - 100)
        .find(|&k| phase[k] != phase[k - 1] && k > 50)
        .unwrap()
        - 20;
    for (start, len) in [(idle, 40), (sync, 40), (mixed, 80)] {
        let config = one_fault(23, 4, 0, FaultKind::Straggler, start as u64, Some(len));
        let (_, s) = run_with(config, start + len as usize + 5);
        let e = &s.ground_truth().events()[0];
        let shown: Vec<usize> = (start..start + len as usize)
            .filter(|&k| busy[k] && phase[k] == NodePhase::Synchronous)
            .collect();
        assert_eq!(e.shown_ticks, shown.len() as u64, "{e:?}");
        assert_eq!(e.shown_tick, shown.first().map(|&k| k as u64), "{e:?}");
        if start == idle {
            assert_eq!((e.shown_tick, e.shown_ticks), (None, 0));
        }
        if start == sync {
            assert_eq!((e.shown_tick, e.shown_ticks), (Some(sync as u64), 40));
        }
    }
}

#[test]
fn clock_degraded_cuts_the_clock_with_no_reason() {
    let config = one_fault(19, 2, 1, FaultKind::ClockDegraded, 30, Some(600));
    let (t, s) = run_with(config, 700);
    let (healthy, _) = run_with(SimConfig::new(19, 2), 700);
    let e = &s.ground_truth().events()[0];
    let cut = e.magnitude.unwrap();
    assert!(CLOCK_DEGRADED_CUT.contains(&cut), "{cut}");
    let mut busy = 0;
    for (k, (tick, base)) in t.iter().zip(&healthy).enumerate().take(630).skip(30) {
        let v = |m| value(tick, 1, m);
        let b = |m| value(base, 1, m);
        if b(Metric::GpuUtil) == 0.0 {
            assert_eq!(v(Metric::SmClock), 345.0);
            continue;
        }
        busy += 1;
        // The twin may be up to a few °C warmer (more power): its boost
        // clock a few steps lower.
        let steps = (b(Metric::GpuTemp) - v(Metric::GpuTemp)).abs();
        let expect = b(Metric::SmClock) * (1.0 - cut);
        assert!(
            (v(Metric::SmClock) - expect).abs() <= 7.5 + 15.0 * steps,
            "tick {k}: {} vs {expect}",
            v(Metric::SmClock)
        );
        assert_eq!(v(Metric::SmClock) % 15.0, 0.0);
        let own_boost = (1980.0 - 15.0 * (v(Metric::GpuTemp) - 75.0).max(0.0)).max(1755.0);
        assert!((v(Metric::SmClock) - own_boost * (1.0 - cut)).abs() <= 7.5);
        assert_eq!(v(Metric::ClockThrottleReasons), 0.0, "tick {k}");
        // Activity is unchanged; dynamic power falls by cut / 2.
        for m in [Metric::GpuUtil, Metric::SmActive, Metric::GrEngineActive] {
            assert_eq!(v(m), b(m), "tick {k} {m:?}");
        }
        let (p, bp) = (v(Metric::PowerUsage), b(Metric::PowerUsage));
        if bp < 700.0 {
            let half = cut / 2.0;
            assert!(
                ((bp - p) - half * (bp - 70.0)).abs() <= half * 4.5 + 0.002,
                "tick {k}: {p} vs {bp}"
            );
        }
    }
    assert!(busy > 100);
    assert_eq!(e.shown_ticks, busy);
}

#[test]
fn frozen_zombie_repeats_the_tick_before_it() {
    let seed = zombie_seed(13, 2, 1, 20, "frozen");
    let config = one_fault(seed, 2, 1, FaultKind::Zombie, 20, Some(30));
    let (t, s) = run_with(config, 60);
    let (healthy, _) = run_with(SimConfig::new(seed, 2), 60);
    let before = of_gpu(&t[19], 1);
    assert_eq!(before, of_gpu(&healthy[19], 1));
    for (k, tick) in t.iter().enumerate().take(50).skip(20) {
        // Bit for bit, counters included.
        let now = of_gpu(tick, 1);
        assert_eq!(now.len(), N);
        for (a, b) in now.iter().zip(&before) {
            assert_eq!(
                (a.metric, a.value.to_bits()),
                (b.metric, b.value.to_bits()),
                "tick {k}"
            );
        }
    }
    // Afterwards the energy counter moves again, and is past where it froze.
    let e_after = value(&t[50], 1, Metric::TotalEnergyConsumption);
    assert!(e_after > value(&t[19], 1, Metric::TotalEnergyConsumption));
    assert_eq!(
        e_after,
        value(&healthy[50], 1, Metric::TotalEnergyConsumption)
    );
    let e = &s.ground_truth().events()[0];
    assert_eq!(
        (e.variant, e.shown_tick, e.shown_ticks),
        (Some("frozen"), Some(20), 30)
    );
}

#[test]
fn frozen_zombie_from_tick_0_freezes_tick_0() {
    let seed = zombie_seed(14, 1, 0, 0, "frozen");
    let config = one_fault(seed, 1, 0, FaultKind::Zombie, 0, None);
    let (t, s) = run_with(config, 10);
    assert!(t.iter().all(|tick| *tick == t[0]));
    assert_eq!(t[0].len(), N);
    assert_eq!(s.ground_truth().events()[0].shown_ticks, 10);
}

#[test]
fn hung_zombie_keeps_moving_but_does_no_work() {
    // A hung zombie on a GPU that was working hard just before.
    let (seed, start) = (40..200)
        .find_map(|seed| {
            let t = run(seed, 2, 400);
            let start = (100..300).find(|&k| value(&t[k - 1], 1, Metric::PowerUsage) > 300.0)?;
            let (_, s) = run_with(
                one_fault(seed, 2, 1, FaultKind::Zombie, start as u64, Some(1)),
                start + 1,
            );
            (s.ground_truth().events()[0].variant == Some("hung")).then_some((seed, start))
        })
        .expect("a hung zombie on a busy GPU");
    let config = one_fault(seed, 2, 1, FaultKind::Zombie, start as u64, Some(120));
    let (t, s) = run_with(config, start + 200);
    let (healthy, _) = run_with(SimConfig::new(seed, 2), start + 200);
    let before = &t[start - 1];
    let stuck_util = value(before, 1, Metric::GpuUtil);
    assert!(stuck_util > 0.0);
    let stuck_fb = value(before, 1, Metric::FbUsed);
    let window = &t[start..start + 120];
    let v = |m| series(window, 1, m);
    assert!(v(Metric::GpuUtil).iter().all(|&u| u == stuck_util));
    assert!(v(Metric::FbUsed).iter().all(|&f| f == stuck_fb));
    for m in [
        Metric::GrEngineActive,
        Metric::SmActive,
        Metric::SmOccupancy,
        Metric::PipeTensorActive,
        Metric::PipeFp16Active,
        Metric::PipeFp32Active,
        Metric::DramActive,
    ] {
        assert!(v(m).iter().all(|&x| (0.0..=0.01).contains(&x)), "{m:?}");
    }
    let power = v(Metric::PowerUsage);
    assert!(
        power.iter().all(|&p| (65.0..=75.0).contains(&p)),
        "{power:?}"
    );
    assert!(spread(&power) > 0.5, "power keeps moving");
    // Temperature follows the power down from where the work left it.
    let temp = v(Metric::GpuTemp);
    assert!(temp[temp.len() - 1] <= temp[0] - 5.0, "{temp:?}");
    let energy = v(Metric::TotalEnergyConsumption);
    assert!(energy.windows(2).all(|w| w[1] > w[0]));
    for (tick, temp) in window.iter().zip(&temp) {
        let expect = (1980.0 - 15.0 * (temp - 75.0).max(0.0)).max(1755.0);
        assert_eq!(value(tick, 1, Metric::SmClock), expect, "busy boost clock");
        assert_eq!(value(tick, 1, Metric::ClockThrottleReasons), 0.0);
    }
    // GPU 0 is untouched; GPU 1 works again afterwards.
    for (x, y) in t.iter().zip(&healthy) {
        assert_eq!(of_gpu(x, 0), of_gpu(y, 0));
    }
    for k in start + 120..start + 200 {
        assert_eq!(
            value(&t[k], 1, Metric::GpuUtil),
            value(&healthy[k], 1, Metric::GpuUtil)
        );
    }
    let e = &s.ground_truth().events()[0];
    assert_eq!(
        (e.variant, e.shown_tick, e.shown_ticks),
        (Some("hung"), Some(start as u64), 120)
    );
}

#[test]
fn zombie_variants_are_drawn_half_and_half() {
    let mut c = SimConfig::new(3, 64);
    c.faults.scheduled = (0..64)
        .map(|gpu| ScheduledFault {
            gpu,
            kind: FaultKind::Zombie,
            start_tick: 0,
            duration_ticks: None,
        })
        .collect();
    let (_, s) = run_with(c, 1);
    let hung = s
        .ground_truth()
        .events()
        .iter()
        .filter(|e| e.variant == Some("hung"))
        .count();
    assert!((16..=48).contains(&hung), "{hung} of 64");
}

#[test]
fn driver_drift_is_in_the_inventory_and_the_ground_truth_from_the_start() {
    let mut c = one_fault(8, 4, 2, FaultKind::DriverDrift, 50, Some(10));
    c.faults.drift_node_probability = 1.0;
    let s = SimulatedSource::new(c.clone());
    let plain = SimulatedSource::new(SimConfig::new(8, 4));
    for (g, p) in s.inventory().iter().zip(plain.inventory()) {
        assert_eq!(g.driver_version, DRIFTED_DRIVER_VERSION);
        assert_ne!(p.driver_version, DRIFTED_DRIVER_VERSION);
        if g.index == 2 {
            assert_eq!(g.vbios_version, DRIFTED_VBIOS_VERSION);
            assert_ne!(p.vbios_version, DRIFTED_VBIOS_VERSION);
        } else {
            assert_eq!(g.vbios_version, p.vbios_version);
        }
        assert_eq!(g.uuid, p.uuid);
    }
    // Recorded before the first sample, at tick 0, shown once.
    let events = s.ground_truth().events();
    assert_eq!(events.len(), 5);
    for e in &events {
        assert_eq!(e.kind, FaultKind::DriverDrift);
        assert_eq!((e.start_tick, e.end_tick), (0, None));
        assert_eq!((e.shown_tick, e.shown_ticks), (Some(0), 1));
        assert_eq!(e.uuid, s.inventory()[e.gpu as usize].uuid);
    }
    let vbios: Vec<u32> = events
        .iter()
        .filter(|e| e.variant == Some("vbios"))
        .map(|e| e.gpu)
        .collect();
    assert_eq!(vbios, vec![2]);
    // The readings are those of the node without drift.
    let (t, s) = run_with(c, 100);
    assert_eq!(t, run(8, 4, 100));
    assert_eq!(s.ground_truth().events(), events);
    // A node drifts with the configured probability.
    let drifted = (0..200)
        .filter(|&seed| {
            let mut c = SimConfig::new(seed, 1);
            c.faults.drift_node_probability = 0.25;
            SimulatedSource::new(c).inventory()[0].driver_version == DRIFTED_DRIVER_VERSION
        })
        .count();
    assert!((25..=75).contains(&drifted), "{drifted} of 200");
}

#[test]
fn ground_truth_is_live() {
    let mut s = SimulatedSource::new(one_fault(2, 1, 0, FaultKind::Zombie, 5, Some(10)));
    let truth = s.ground_truth();
    let mut v = Vec::new();
    for k in 0..20u64 {
        s.sample(&mut v).unwrap();
        let e = truth.events();
        if k < 5 {
            assert!(e.is_empty());
        } else {
            assert_eq!(e[0].shown_ticks, (k - 4).min(10), "tick {k}");
        }
    }
}

#[test]
#[should_panic(expected = "simulator has 2 GPUs")]
fn scheduled_fault_on_a_missing_gpu_panics() {
    SimulatedSource::new(one_fault(1, 2, 2, FaultKind::Zombie, 0, None));
}

/// Checks one ground-truth event against the readings, independently of how
/// the simulator applied it.
fn check_event(t: &[Vec<Reading>], e: &FaultEvent) {
    let end = e.end_tick.unwrap_or(t.len() as u64).min(t.len() as u64) as usize;
    let start = e.start_tick as usize;
    let window = &t[start..end];
    let whole = |tick: &Vec<Reading>| of_gpu(tick, e.gpu).len() == N;
    match e.kind {
        FaultKind::Xid79FallenOffBus => {
            for tick in &t[start..] {
                assert_eq!(of_gpu(tick, e.gpu).len(), 1, "{e:?}");
                assert_eq!(value(tick, e.gpu, Metric::XidErrors), 79.0);
            }
        }
        FaultKind::Xid48DoubleBitEcc => {
            let rows = value(&t[start], e.gpu, Metric::UncorrectableRemappedRows);
            assert!(rows >= 1.0, "{e:?}");
            if start > 0 && whole(&t[start - 1]) {
                assert_eq!(
                    rows,
                    value(&t[start - 1], e.gpu, Metric::UncorrectableRemappedRows) + 1.0
                );
            }
        }
        FaultKind::Zombie if e.variant == Some("frozen") && start > 0 => {
            let before = of_gpu(&t[start - 1], e.gpu);
            for tick in window {
                assert_eq!(of_gpu(tick, e.gpu), before, "{e:?}");
            }
        }
        FaultKind::Zombie => {
            assert_eq!(e.variant, Some("hung"));
            for tick in window.iter().filter(|t| whole(t)) {
                assert!(value(tick, e.gpu, Metric::GpuUtil) > 0.0, "{e:?}");
                assert!(value(tick, e.gpu, Metric::SmActive) <= 0.01, "{e:?}");
                assert!(value(tick, e.gpu, Metric::PowerUsage) <= 75.0, "{e:?}");
            }
        }
        FaultKind::ThermalThrottle => {
            let rate = e.magnitude.unwrap();
            assert!(THERMAL_RISE_C_PER_S.contains(&rate));
            // After 62 °C of excess heat the GPU is in slowdown.
            let hot = start + (62.0 / rate).ceil() as usize;
            if hot < end && whole(&t[hot]) {
                assert!(value(&t[hot], e.gpu, Metric::GpuTemp) >= 87.0, "{e:?}");
                assert!(value(&t[hot], e.gpu, Metric::SmClock) <= 990.0, "{e:?}");
            }
        }
        FaultKind::Straggler => {
            assert!(STRAGGLER_SLOWDOWN.contains(&e.magnitude.unwrap()), "{e:?}");
        }
        FaultKind::ClockDegraded => {
            let cut = e.magnitude.unwrap();
            assert!(CLOCK_DEGRADED_CUT.contains(&cut), "{e:?}");
            for tick in window.iter().filter(|t| whole(t)) {
                if value(tick, e.gpu, Metric::GpuUtil) > 0.0
                    && value(tick, e.gpu, Metric::GpuTemp) < 87.0
                {
                    let clock = value(tick, e.gpu, Metric::SmClock);
                    assert!(clock <= 1980.0 * (1.0 - cut) + 7.5, "{e:?}: {clock}");
                }
            }
        }
        FaultKind::RowRemapGrowth if whole(&t[start]) => {
            assert_eq!(value(&t[start], e.gpu, Metric::XidErrors), 63.0, "{e:?}");
        }
        _ => {}
    }
    if !matches!(
        e.kind,
        FaultKind::ThermalThrottle | FaultKind::Straggler | FaultKind::ClockDegraded
    ) {
        assert_eq!(e.magnitude, None, "{e:?}");
    }
}

#[test]
fn typical_faults_are_seeded_and_match_their_ground_truth() {
    let typical = |seed| {
        let mut c = SimConfig::new(seed, 16);
        c.faults = FaultConfig::typical();
        c
    };
    // Two simulated hours of 16 GPUs at one fault per GPU-hour: ~32 faults.
    let (a, sa) = run_with(typical(21), 7200);
    let (b, sb) = run_with(typical(21), 7200);
    assert!(a == b, "same seed, same readings");
    let events = sa.ground_truth().events();
    assert_eq!(events, sb.ground_truth().events());
    assert!(
        (10..=80).contains(&events.len()),
        "{} faults in 32 GPU-hours at 1/GPU-hour",
        events.len()
    );
    let kinds: std::collections::HashSet<_> = events.iter().map(|e| e.kind).collect();
    assert!(kinds.len() >= 4, "{kinds:?}");
    // Random faults are never driver drift; the node's drift is at tick 0.
    let drift = |e: &&FaultEvent| e.kind == FaultKind::DriverDrift;
    assert!(
        events
            .iter()
            .filter(drift)
            .all(|e| e.variant == Some("driver") && e.start_tick == 0)
    );
    // In start order; a GPU's random faults never overlap.
    assert!(
        events
            .windows(2)
            .all(|w| (w[0].start_tick, w[0].gpu) <= (w[1].start_tick, w[1].gpu))
    );
    for gpu in 0..16 {
        let mine: Vec<_> = events
            .iter()
            .filter(|e| e.gpu == gpu && !drift(e))
            .collect();
        for w in mine.windows(2) {
            assert!(
                w[0].end_tick.is_some_and(|end| end <= w[1].start_tick),
                "{w:?}"
            );
        }
    }
    for e in &events {
        assert_eq!(e.uuid, sa.inventory()[e.gpu as usize].uuid);
        assert_eq!(e.xid, e.kind.xid());
        assert!(e.shown_ticks == 0 || e.shown_tick.is_some_and(|t| t >= e.start_tick));
        check_event(&a, e);
    }
    let (_, other) = run_with(typical(22), 7200);
    assert_ne!(events, other.ground_truth().events());
    // GPUs without a fault read exactly as without fault injection.
    let (healthy, _) = run_with(SimConfig::new(21, 16), 7200);
    for gpu in (0..16).filter(|g| !events.iter().any(|e| e.gpu == *g && !drift(&e))) {
        for (x, y) in a.iter().zip(&healthy) {
            assert_eq!(of_gpu(x, gpu), of_gpu(y, gpu));
        }
    }
}

#[test]
fn random_grades_stay_in_their_ranges_and_differ() {
    let mut c = SimConfig::new(4, 64);
    c.faults.random_per_gpu_hour = 4.0;
    let (_, s) = run_with(c, 3600);
    let events = s.ground_truth().events();
    for (kind, range) in [
        (FaultKind::Straggler, STRAGGLER_SLOWDOWN),
        (FaultKind::ClockDegraded, CLOCK_DEGRADED_CUT),
        (FaultKind::ThermalThrottle, THERMAL_RISE_C_PER_S),
    ] {
        let m: Vec<f64> = events
            .iter()
            .filter(|e| e.kind == kind)
            .map(|e| e.magnitude.unwrap())
            .collect();
        assert!(m.len() >= 5, "{kind:?}: {m:?}");
        assert!(m.iter().all(|x| range.contains(x)), "{kind:?}: {m:?}");
        assert!(
            spread(&m) > 0.3 * (range.end() - range.start()),
            "{kind:?}: graded, {m:?}"
        );
    }
    let variants: std::collections::HashSet<_> = events
        .iter()
        .filter(|e| e.kind == FaultKind::Zombie)
        .map(|e| e.variant.unwrap())
        .collect();
    assert_eq!(variants.len(), 2, "{variants:?}");
}

#[test]
fn ten_thousand_gpus_give_ten_thousand_times_24_readings() {
    let mut s = SimulatedSource::new(SimConfig::new(9, 10_000));
    let mut out = Vec::new();
    for k in 0..3 {
        out.clear();
        s.sample(&mut out).unwrap();
        assert_eq!(out.len(), 10_000 * N, "tick {k}");
        // Each GPU once per metric, in GPU order.
        for (j, r) in out.iter().enumerate() {
            assert_eq!(r.gpu as usize, j / N);
            assert_eq!(r.metric, Metric::ALL[j % N]);
        }
    }
    let uuids: std::collections::HashSet<_> = s.inventory().iter().map(|g| &g.uuid).collect();
    assert_eq!(uuids.len(), 10_000);
}

#[test]
fn ground_truth_files() {
    let events = vec![
        FaultEvent {
            gpu: 2,
            uuid: "GPU-a".into(),
            kind: FaultKind::Xid79FallenOffBus,
            xid: Some(79),
            start_tick: 10,
            end_tick: None,
            start_ts_ms: Some(1_775_000_010_000),
            end_ts_ms: None,
            magnitude: None,
            variant: None,
            shown_tick: Some(10),
            shown_ticks: 3,
        },
        FaultEvent {
            gpu: 0,
            uuid: "GPU-b".into(),
            kind: FaultKind::Straggler,
            xid: None,
            start_tick: 12,
            end_tick: Some(72),
            start_ts_ms: None,
            end_ts_ms: None,
            magnitude: Some(0.125),
            variant: None,
            shown_tick: None,
            shown_ticks: 0,
        },
        FaultEvent {
            gpu: 1,
            uuid: "GPU-c".into(),
            kind: FaultKind::Zombie,
            xid: None,
            start_tick: 20,
            end_tick: Some(30),
            start_ts_ms: None,
            end_ts_ms: None,
            magnitude: None,
            variant: Some("hung"),
            shown_tick: Some(20),
            shown_ticks: 10,
        },
    ];
    let mut jsonl = Vec::new();
    write_ground_truth(&events, GroundTruthFormat::JsonLines, &mut jsonl).unwrap();
    assert_eq!(
        String::from_utf8(jsonl).unwrap(),
        concat!(
            r#"{"gpu":2,"uuid":"GPU-a","kind":"xid79_fallen_off_bus","xid":79,"start_tick":10,"end_tick":null,"start_ts_ms":1775000010000,"end_ts_ms":null,"magnitude":null,"variant":null,"shown_tick":10,"shown_ticks":3}"#,
            "\n",
            r#"{"gpu":0,"uuid":"GPU-b","kind":"straggler","xid":null,"start_tick":12,"end_tick":72,"start_ts_ms":null,"end_ts_ms":null,"magnitude":0.125,"variant":null,"shown_tick":null,"shown_ticks":0}"#,
            "\n",
            r#"{"gpu":1,"uuid":"GPU-c","kind":"zombie","xid":null,"start_tick":20,"end_tick":30,"start_ts_ms":null,"end_ts_ms":null,"magnitude":null,"variant":"hung","shown_tick":20,"shown_ticks":10}"#,
            "\n"
        )
    );
    let mut csv = Vec::new();
    write_ground_truth(&events, GroundTruthFormat::Csv, &mut csv).unwrap();
    assert_eq!(
        String::from_utf8(csv).unwrap(),
        "gpu,uuid,kind,xid,start_tick,end_tick,start_ts_ms,end_ts_ms,magnitude,variant,shown_tick,shown_ticks\n\
         2,GPU-a,xid79_fallen_off_bus,79,10,,1775000010000,,,,10,3\n\
         0,GPU-b,straggler,,12,72,,,0.125,,,0\n\
         1,GPU-c,zombie,,20,30,,,,hung,20,10\n"
    );
    let mut empty = Vec::new();
    write_ground_truth(&[], GroundTruthFormat::Csv, &mut empty).unwrap();
    assert_eq!(empty.iter().filter(|&&b| b == b'\n').count(), 1);
    assert_eq!(
        GroundTruthFormat::for_path(std::path::Path::new("x/truth.CSV")),
        GroundTruthFormat::Csv
    );
    assert_eq!(
        GroundTruthFormat::for_path(std::path::Path::new("truth.jsonl")),
        GroundTruthFormat::JsonLines
    );
    // Stamping maps ticks to poll times; an end that was never polled stays empty.
    let mut e = events[1].clone();
    e.stamp(|t| (t < 50).then_some(1000 + t as i64));
    assert_eq!((e.start_ts_ms, e.end_ts_ms), (Some(1012), None));
}
