use super::*;
use agent::sim::FaultKind;

fn spec(gpus: u32, minutes: u64) -> RunSpec {
    RunSpec {
        faulty: true,
        gpus,
        ticks: minutes * 60,
        interval_ms: 1000,
        seed: 1001,
        fault_rate: 0.0,
        drift_node_probability: 0.0,
        agent_silences: 0.0,
        threads: 2,
        scheduled: Vec::new(),
        silences: Vec::new(),
        progress: false,
    }
}

fn scheduled(gpu: u32, kind: FaultKind, start_tick: u64) -> ScheduledFault {
    ScheduledFault {
        gpu,
        kind,
        start_tick,
        duration_ticks: None,
    }
}

#[test]
fn end_to_end_xid_faults_and_an_agent_silence_are_detected() {
    // 64 GPUs (8 hosts) over 20 virtual minutes; an XID 79 on host 1,
    // an XID 48 on host 5, and host 6's agent silent for 2 minutes.
    let mut faulty = spec(64, 20);
    faulty.scheduled = vec![
        (1, scheduled(3, FaultKind::Xid79FallenOffBus, 300)),
        (5, scheduled(6, FaultKind::Xid48DoubleBitEcc, 400)),
    ];
    faulty.silences = vec![(6, 500, 120)];
    let f = simulate(&faulty);
    assert_eq!(f.gpu_polls, 64 * 1200);
    let kinds: Vec<&str> = f.truth.iter().map(|t| t.kind).collect();
    assert_eq!(kinds.iter().filter(|k| **k == AGENT_SILENT).count(), 8);
    assert!(kinds.contains(&"xid79_fallen_off_bus"), "{kinds:?}");
    assert!(kinds.contains(&"xid48_double_bit_ecc"), "{kinds:?}");

    let clean = simulate(&RunSpec {
        faulty: false,
        ..spec(64, 20)
    });
    assert!(clean.truth.is_empty());
    assert!(
        clean.incidents.is_empty(),
        "the clean run keeps only a tally"
    );

    let r = report(
        &faulty,
        HealthMode::Both,
        20.0 / 60.0,
        300_000,
        Some(&f),
        Some(&clean),
    );
    let fr = r.faulty.as_ref().unwrap();
    let row = |k: &str| fr.fault_kinds.iter().find(|r| r.kind == k).unwrap();
    for k in ["xid79_fallen_off_bus", "xid48_double_bit_ecc"] {
        let row = row(k);
        assert_eq!((row.injected, row.scored, row.detected), (1, 1, 1), "{k}");
        // The XID detector fires on the first poll that shows it.
        assert!(
            row.ttd_polls.unwrap().max <= 2.0,
            "{k}: {:?}",
            row.ttd_polls
        );
    }
    let silent = row(AGENT_SILENT);
    assert_eq!((silent.scored, silent.detected), (8, 8));
    // The other hosts go on reporting, so a host's silence is seen once it
    // is more than 8 s behind the fleet's median: onset at the first missed
    // poll (1 s after the last one), detected 9 s after the last one.
    let t = silent.ttd_s.unwrap();
    assert!(t.p50 == 8.0 && t.max == 8.0, "{t:?}");
    let text = render(&r);
    assert!(text.contains("xid79_fallen_off_bus"), "{text}");
    assert!(text.contains("goals:"), "{text}");

    // The JSON has everything, under stable keys.
    let v: serde_json::Value = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
    assert_eq!(v["kind"], "health");
    for key in [
        "config",
        "rules",
        "faulty",
        "clean",
        "derived_precision",
        "goals",
        "notes",
    ] {
        assert!(!v[key].is_null(), "missing {key}");
    }
    assert_eq!(v["config"]["seed"], 1001);
    assert_eq!(v["config"]["held_out_seed"], true);
    assert_eq!(v["rules"]["expected"]["xid79_fallen_off_bus"][0], "xid 79");
    let fk = v["faulty"]["fault_kinds"].as_array().unwrap();
    let xid79 = fk
        .iter()
        .find(|r| r["kind"] == "xid79_fallen_off_bus")
        .unwrap();
    for key in [
        "injected",
        "scored",
        "not_shown",
        "masked",
        "detected",
        "recall",
        "precision",
        "ttd_s",
        "ttd_polls",
    ] {
        assert!(xid79.get(key).is_some(), "fault kind row lacks {key}");
    }
    assert_eq!(xid79["recall"], 1.0);
    assert!(xid79["ttd_s"]["p95"].is_number());
    for key in [
        "base_rate_per_gpu_hour",
        "recall",
        "precision",
        "detector_kinds",
        "run",
    ] {
        assert!(v["faulty"].get(key).is_some(), "faulty lacks {key}");
    }
    for key in [
        "healthy_gpu_hours",
        "false_alerts_per_healthy_gpu_hour",
        "critical_per_100k_gpu_hours",
        "critical_per_100k_gpu_hours_bound95",
        "by_kind",
    ] {
        assert!(v["clean"].get(key).is_some(), "clean lacks {key}");
    }
    assert!(v["clean"]["run"]["gpu_polls_per_s"].as_f64().unwrap() > 0.0);
    // The slowest detections, per kind, slowest first: here every detection
    // (fewer than 20 of each kind), each with its time to detect.
    let slowest = v["faulty"]["slowest"].as_array().unwrap();
    let ttd = |kind: &str| -> Vec<f64> {
        slowest
            .iter()
            .filter(|e| e["kind"] == kind)
            .map(|e| e["ttd_s"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(slowest.len(), 10, "{slowest:?}");
    assert_eq!(ttd(AGENT_SILENT), vec![8.0; 8]);
    for k in ["xid79_fallen_off_bus", "xid48_double_bit_ecc"] {
        let t = ttd(k);
        assert!(t.len() == 1 && t[0] <= 2.0, "{k}: {t:?}");
    }
    assert!(slowest.iter().all(|e| e["outcome"] == "detected"));
}

#[test]
fn a_lost_gpu_is_one_incident_not_also_a_false_positive() {
    // XID 79 on one GPU: whatever else fires on it joins the lost-GPU
    // incident, and no xid/telemetry_gap incident is left unmatched.
    let mut s = spec(16, 10);
    s.scheduled = vec![(0, scheduled(2, FaultKind::Xid79FallenOffBus, 60))];
    let out = simulate(&s);
    let sc = score::score(&out.truth, &out.incidents, 300_000, s.end_ms());
    for (inc, o) in out.incidents.iter().zip(&sc.incidents) {
        if matches!(inc.kind, Kind::Xid | Kind::TelemetryGap) {
            assert_eq!(*o, IncidentOutcome::Matched, "{inc:?}");
        }
    }
    let on_gpu: Vec<&Incident> = out
        .incidents
        .iter()
        .filter(|i| i.gpu == 2 && i.kind == Kind::Xid)
        .collect();
    assert_eq!(on_gpu.len(), 1, "{on_gpu:?}");
    assert_eq!(on_gpu[0].xid, Some(79));
    assert_eq!(on_gpu[0].severity, Severity::Critical);
    assert_eq!(on_gpu[0].opened_ms(), s.ts(60));
}

#[test]
fn random_agent_silences_fit_in_the_run_and_are_reproducible() {
    let mut s = spec(8 * 400, 60);
    s.agent_silences = 40.0;
    let all: Vec<(u64, (u64, u64))> = (0..s.hosts())
        .filter_map(|h| silence_of(&s, h).map(|x| (h, x)))
        .collect();
    // About 40 of 400 hosts.
    assert!((20..=60).contains(&all.len()), "{}", all.len());
    for &(_, (start, n)) in &all {
        assert!(start >= 120, "after 2 minutes of warm-up: {start}");
        assert!((60..=600).contains(&n), "1-10 minutes: {n}");
        assert!(start + n + 60 <= s.ticks, "delivered within the run");
    }
    let again: Vec<_> = (0..s.hosts()).filter_map(|h| silence_of(&s, h)).collect();
    assert_eq!(again, all.iter().map(|x| x.1).collect::<Vec<_>>());
    // None in the clean run, none in a run too short to hold one.
    assert!((0..s.hosts()).all(|h| {
        silence_of(
            &RunSpec {
                faulty: false,
                ..s.clone()
            },
            h,
        )
        .is_none()
    }));
    let short = RunSpec {
        ticks: 200,
        ..s.clone()
    };
    assert!((0..s.hosts()).all(|h| silence_of(&short, h).is_none()));
}

#[test]
fn shards_keep_hosts_whole_and_big_enough_for_drift() {
    let check = |s: &RunSpec| {
        let shards = s.shards();
        assert_eq!(shards[0].start, 0);
        assert_eq!(shards.last().unwrap().end, s.hosts());
        for w in shards.windows(2) {
            assert_eq!(w[0].end, w[1].start);
        }
        shards
    };
    let mut s = spec(1000, 1);
    s.threads = 16;
    // 125 hosts: 7 shards of at least 16 hosts keep 7 threads busy.
    let shards = check(&s);
    assert_eq!(shards.len(), 7);
    assert!(
        shards
            .iter()
            .all(|r| r.end - r.start >= MIN_HOSTS_PER_SHARD)
    );
    s.threads = 2;
    // Two threads: 4 shards of about 32 hosts, taken in turn.
    assert_eq!(check(&s).len(), 4);
    // A small fleet is one shard.
    s.gpus = 20;
    assert_eq!(check(&s), vec![0..3]);
    // 10,000 GPUs: 40 engines of 31-32 hosts, whatever the threads.
    s.gpus = 10_000;
    s.threads = 1;
    let shards = check(&s);
    assert_eq!(shards.len(), 40);
    assert!(
        shards
            .iter()
            .all(|r| (31..=32).contains(&(r.end - r.start)))
    );
}

#[test]
fn every_engine_field_has_a_metric_of_the_simulator() {
    // The table the harness feeds by: the fields the detectors read that
    // the agent emits, by metric name.
    let t = field_table();
    let mapped: Vec<Field> = t.iter().flatten().copied().collect();
    for f in [
        Field::XidErrors,
        Field::EccDbeVolTotal,
        Field::UncorrectableRemappedRows,
        Field::ClockThrottleReasons,
        Field::TotalEnergyConsumption,
        Field::GpuTemp,
        Field::SmClock,
        Field::PowerUsage,
        Field::GpuUtil,
    ] {
        assert!(mapped.contains(&f), "{f:?}");
    }
    assert_eq!(t[Metric::FbUsed as u8 as usize], None);
}
