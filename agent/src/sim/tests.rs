use super::*;
const N: usize = Metric::ALL.len();

fn run(seed: u64, gpus: u32, ticks: usize) -> Vec<Vec<Reading>> {
    let mut s = SimulatedSource::new(SimConfig::new(seed, gpus));
    (0..ticks)
        .map(|_| {
            let mut v = Vec::new();
            s.sample(&mut v).unwrap();
            v
        })
        .collect()
}

fn series(ticks: &[Vec<Reading>], gpu: u32, m: Metric) -> Vec<f64> {
    ticks
        .iter()
        .map(|t| {
            t.iter()
                .find(|r| r.gpu == gpu && r.metric == m)
                .unwrap()
                .value
        })
        .collect()
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
    let t = run(42, 2, 1200);
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
        assert!(power.iter().all(|&p| (60.0..=710.0).contains(&p)));
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
        // Both idle and busy phases occur in 20 minutes.
        assert!(util.contains(&0.0) && util.iter().any(|&u| u > 50.0));
        let temp = series(&t, gpu, Metric::GpuTemp);
        assert!(temp.windows(2).all(|w| (w[1] - w[0]).abs() <= 20.0));
        let fb_used = series(&t, gpu, Metric::FbUsed);
        let fb_free = series(&t, gpu, Metric::FbFree);
        for (u, f) in fb_used.iter().zip(&fb_free) {
            assert_eq!(u + f + FB_RESERVED_MIB, FB_TOTAL_MIB);
        }
        assert!(series(&t, gpu, Metric::XidErrors).iter().all(|&x| x == 0.0));
    }
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

fn of_gpu(tick: &[Reading], gpu: u32) -> Vec<Reading> {
    tick.iter().filter(|r| r.gpu == gpu).copied().collect()
}

fn value(tick: &[Reading], gpu: u32, m: Metric) -> f64 {
    tick.iter()
        .find(|r| r.gpu == gpu && r.metric == m)
        .unwrap_or_else(|| panic!("no {m:?} for GPU {gpu}"))
        .value
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
            assert!(value(tick, gpu, Metric::GpuTemp) < SLOWDOWN_TEMP_C);
        }
    }
}

#[test]
fn xid79_at_tick_10_on_gpu_2() {
    let config = with_faults(
        5,
        4,
        vec![ScheduledFault {
            gpu: 2,
            kind: FaultKind::Xid79FallenOffBus,
            start_tick: 10,
            duration_ticks: Some(3), // ignored: XID 79 is permanent
        }],
    );
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
        }]
    );
}

#[test]
fn xid48_sets_the_gauge_and_an_uncorrectable_row() {
    let config = with_faults(
        6,
        2,
        vec![ScheduledFault {
            gpu: 0,
            kind: FaultKind::Xid48DoubleBitEcc,
            start_tick: 5,
            duration_ticks: None,
        }],
    );
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
        // The double-bit error shows in the ECC counters too.
        assert_eq!(value(tick, 0, Metric::EccDbeVolTotal), rows, "tick {k}");
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
}

#[test]
fn row_remap_growth_one_row_per_30_s_with_xid_63() {
    let mut config = with_faults(
        7,
        1,
        vec![ScheduledFault {
            gpu: 0,
            kind: FaultKind::RowRemapGrowth,
            start_tick: 0,
            duration_ticks: Some(100),
        }],
    );
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
    }
    let e = s.ground_truth().events();
    assert_eq!((e[0].start_tick, e[0].end_tick), (0, Some(100)));
}

#[test]
fn thermal_throttle_heats_and_cuts_the_clock() {
    // GPU 1 loses its cooling at tick 10 for 60 ticks (1 s each).
    let config = with_faults(
        11,
        2,
        vec![ScheduledFault {
            gpu: 1,
            kind: FaultKind::ThermalThrottle,
            start_tick: 10,
            duration_ticks: Some(60),
        }],
    );
    let mut s = SimulatedSource::new(config);
    let (healthy, _) = run_with(SimConfig::new(11, 2), 200);
    let mut busy_in_window = 0;
    let mut throttled_ticks = 0u64;
    for (k, base) in healthy.iter().enumerate() {
        let mut tick = Vec::new();
        s.sample(&mut tick).unwrap();
        let reasons = s.clock_event_reasons(1).unwrap();
        let (temp, clock) = (
            value(&tick, 1, Metric::GpuTemp),
            value(&tick, 1, Metric::SmClock),
        );
        if k < 10 {
            assert_eq!(tick, *base, "tick {k}: identical before the fault");
        } else if (40..70).contains(&k) {
            // 3 °C/s for 30 s: hot enough from any healthy temperature (>= 28 °C).
            assert!((87.0..=90.0).contains(&temp), "tick {k}: {temp} °C");
            assert!(clock <= 990.0, "tick {k}: {clock} MHz");
            assert_eq!(reasons & 0x48, 0x48, "tick {k}: HW slowdown + HW thermal");
            assert_eq!(
                value(&tick, 1, Metric::ClockThrottleReasons) as u64 & 0x48,
                0x48,
                "tick {k}: the bitmask metric shows it"
            );
            assert!(
                value(&tick, 1, Metric::PowerUsage) <= value(base, 1, Metric::PowerUsage) + 8.0
            );
            if value(base, 1, Metric::SmClock) > 990.0 {
                busy_in_window += 1;
            }
        } else if k >= 130 {
            // 60 s after the fault the excess heat is below 4 °C: no more throttling.
            assert!(temp < 87.0, "tick {k}: {temp} °C");
            assert_eq!(reasons & 0x48, 0, "tick {k}");
            assert!(clock == 345.0 || clock >= 1755.0, "tick {k}: {clock} MHz");
        }
        assert_eq!(of_gpu(&tick, 0), of_gpu(base, 0), "GPU 0 is untouched");
        if reasons & 0x48 == 0x48 {
            throttled_ticks += 1;
        }
        if k == 199 {
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
}

#[test]
fn straggler_lags_its_healthy_self() {
    let config = with_faults(
        12,
        4,
        vec![ScheduledFault {
            gpu: 3,
            kind: FaultKind::Straggler,
            start_tick: 0,
            duration_ticks: Some(600),
        }],
    );
    let (t, s) = run_with(config, 700);
    let (healthy, _) = run_with(SimConfig::new(12, 4), 700);
    let mut busy = 0;
    for (k, (tick, base)) in t.iter().zip(&healthy).enumerate() {
        let (util, base_util) = (
            value(tick, 3, Metric::GpuUtil),
            value(base, 3, Metric::GpuUtil),
        );
        if k < 600 {
            assert!(
                util <= base_util * 0.6 + 0.5,
                "tick {k}: {util} vs {base_util}"
            );
            if base_util > 0.0 {
                busy += 1;
                assert!(value(tick, 3, Metric::SmClock) <= 1410.0, "tick {k}");
            }
        } else {
            // Same random stream: the workload is the healthy one again.
            assert_eq!(util, base_util, "tick {k}");
        }
    }
    assert!(busy > 100, "the GPU must be busy for the lag to show");
    assert_eq!(s.ground_truth().events()[0].end_tick, Some(600));
    assert_eq!(
        s.clock_event_reasons(3).unwrap() & CLOCK_EVENT_SW_POWER_CAP,
        0,
        "no power cap after the fault"
    );
}

#[test]
fn zombie_repeats_the_tick_before_it() {
    let config = with_faults(
        13,
        2,
        vec![ScheduledFault {
            gpu: 1,
            kind: FaultKind::Zombie,
            start_tick: 20,
            duration_ticks: Some(30),
        }],
    );
    let (t, _) = run_with(config, 60);
    let (healthy, _) = run_with(SimConfig::new(13, 2), 60);
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
}

#[test]
fn zombie_from_tick_0_freezes_tick_0() {
    let config = with_faults(
        14,
        1,
        vec![ScheduledFault {
            gpu: 0,
            kind: FaultKind::Zombie,
            start_tick: 0,
            duration_ticks: None,
        }],
    );
    let (t, _) = run_with(config, 10);
    assert!(t.iter().all(|tick| *tick == t[0]));
    assert_eq!(t[0].len(), N);
}

#[test]
#[should_panic(expected = "simulator has 2 GPUs")]
fn scheduled_fault_on_a_missing_gpu_panics() {
    SimulatedSource::new(with_faults(
        1,
        2,
        vec![ScheduledFault {
            gpu: 2,
            kind: FaultKind::Zombie,
            start_tick: 0,
            duration_ticks: None,
        }],
    ));
}

/// Checks one ground-truth event against the readings, independently of how
/// the simulator applied it.
fn check_event(t: &[Vec<Reading>], e: &FaultEvent) {
    let end = e.end_tick.unwrap_or(t.len() as u64).min(t.len() as u64) as usize;
    let start = e.start_tick as usize;
    let window = &t[start..end];
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
            if start > 0 && of_gpu(&t[start - 1], e.gpu).len() == N {
                assert_eq!(
                    rows,
                    value(&t[start - 1], e.gpu, Metric::UncorrectableRemappedRows) + 1.0
                );
            }
        }
        FaultKind::Zombie if start > 0 => {
            let before = of_gpu(&t[start - 1], e.gpu);
            for tick in window {
                assert_eq!(of_gpu(tick, e.gpu), before, "{e:?}");
            }
        }
        FaultKind::ThermalThrottle if end - start > 30 => {
            // After 30 s of 3 °C/s the GPU is in slowdown.
            let tick = &t[start + 30];
            if of_gpu(tick, e.gpu).len() == N {
                assert!(value(tick, e.gpu, Metric::GpuTemp) >= 87.0, "{e:?}");
                assert!(value(tick, e.gpu, Metric::SmClock) <= 990.0, "{e:?}");
            }
        }
        FaultKind::RowRemapGrowth if of_gpu(&t[start], e.gpu).len() == N => {
            assert_eq!(value(&t[start], e.gpu, Metric::XidErrors), 63.0, "{e:?}");
        }
        _ => {}
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
    // In start order; a GPU's random faults never overlap.
    assert!(
        events
            .windows(2)
            .all(|w| (w[0].start_tick, w[0].gpu) <= (w[1].start_tick, w[1].gpu))
    );
    for gpu in 0..16 {
        let mine: Vec<_> = events.iter().filter(|e| e.gpu == gpu).collect();
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
        check_event(&a, e);
    }
    let (_, other) = run_with(typical(22), 7200);
    assert_ne!(events, other.ground_truth().events());
    // GPUs without a fault read exactly as without fault injection.
    let (healthy, _) = run_with(SimConfig::new(21, 16), 7200);
    for gpu in (0..16).filter(|g| !events.iter().any(|e| e.gpu == *g)) {
        for (x, y) in a.iter().zip(&healthy) {
            assert_eq!(of_gpu(x, gpu), of_gpu(y, gpu));
        }
    }
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
        },
        FaultEvent {
            gpu: 0,
            uuid: "GPU-b".into(),
            kind: FaultKind::ThermalThrottle,
            xid: None,
            start_tick: 12,
            end_tick: Some(72),
            start_ts_ms: None,
            end_ts_ms: None,
        },
    ];
    let mut jsonl = Vec::new();
    write_ground_truth(&events, GroundTruthFormat::JsonLines, &mut jsonl).unwrap();
    assert_eq!(
        String::from_utf8(jsonl).unwrap(),
        concat!(
            r#"{"gpu":2,"uuid":"GPU-a","kind":"xid79_fallen_off_bus","xid":79,"start_tick":10,"end_tick":null,"start_ts_ms":1775000010000,"end_ts_ms":null}"#,
            "\n",
            r#"{"gpu":0,"uuid":"GPU-b","kind":"thermal_throttle","xid":null,"start_tick":12,"end_tick":72,"start_ts_ms":null,"end_ts_ms":null}"#,
            "\n"
        )
    );
    let mut csv = Vec::new();
    write_ground_truth(&events, GroundTruthFormat::Csv, &mut csv).unwrap();
    assert_eq!(
        String::from_utf8(csv).unwrap(),
        "gpu,uuid,kind,xid,start_tick,end_tick,start_ts_ms,end_ts_ms\n\
         2,GPU-a,xid79_fallen_off_bus,79,10,,1775000010000,\n\
         0,GPU-b,thermal_throttle,,12,72,,\n"
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
