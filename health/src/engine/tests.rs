use super::*;

fn gpu(uuid: &str, host: &str, index: u32) -> GpuId {
    GpuId {
        rack: Some("r1".into()),
        ..GpuId::new(uuid, host, index)
    }
}

fn engine() -> Engine {
    Engine::new(HealthConfig::default()).unwrap()
}

/// Feeds one whole poll of `fields` at `ts_ms`.
fn poll(e: &mut Engine, slot: GpuSlot, ts_ms: i64, fields: &[(Field, f64)]) -> Vec<Change> {
    let mut out = Vec::new();
    for &(f, v) in fields {
        e.sample(slot, f, ts_ms, v, &mut out);
    }
    out
}

#[test]
fn samples_of_one_timestamp_make_one_poll_and_late_ones_are_counted() {
    let mut e = engine();
    let a = e.gpu(gpu("GPU-a", "h1", 0));
    let b = e.gpu(gpu("GPU-b", "h1", 1));
    assert_eq!((a, b), (0, 1));
    assert_eq!(e.gpu(gpu("GPU-a", "h1", 0)), a, "same UUID, same slot");
    let mut out = Vec::new();
    e.sample(a, Field::GpuTemp, 1000, 40.0, &mut out);
    e.sample(a, Field::SmClock, 1000, 1400.0, &mut out);
    e.sample(b, Field::GpuTemp, 1000, 41.0, &mut out);
    assert_eq!(
        e.counters().polls,
        0,
        "a poll completes only when a later one starts"
    );
    e.sample(a, Field::GpuTemp, 2000, 40.0, &mut out);
    assert_eq!(e.counters().polls, 1);
    // Older than a's poll in progress (2000), and older than its last poll.
    e.sample(a, Field::GpuTemp, 1500, 40.0, &mut out);
    e.sample(a, Field::GpuTemp, 1000, 40.0, &mut out);
    assert_eq!(e.counters().late_samples, 2);
    e.finish_before(2000, &mut out);
    assert_eq!(
        e.counters().polls,
        2,
        "b's poll at 1000 is done, a's at 2000 not"
    );
    e.finish_all(&mut out);
    assert_eq!(e.counters().polls, 3);
    assert!(out.is_empty(), "healthy readings change nothing");
    // After the poll at 2000 was fed, a sample at 2000 is late too.
    e.sample(a, Field::GpuTemp, 2000, 40.0, &mut out);
    assert_eq!(e.counters().late_samples, 3);
}

#[test]
fn an_xid_opens_one_event_with_its_gpu_and_clears_after_an_hour_of_quiet() {
    let mut e = engine();
    let a = e.gpu(gpu("GPU-a", "h1", 3));
    let quiet = [(Field::XidErrors, 0.0), (Field::GpuTemp, 50.0)];
    assert!(poll(&mut e, a, 1_000, &quiet).is_empty());
    assert!(poll(&mut e, a, 2_000, &[(Field::XidErrors, 48.0)]).is_empty());
    // The poll at 2000 completes when the one at 3000 starts.
    let out = poll(&mut e, a, 3_000, &[(Field::XidErrors, 48.0)]);
    assert_eq!(out.len(), 1, "{out:?}");
    let Change::Opened(ev) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(
        (ev.id, ev.kind, ev.severity, ev.xid),
        (1, Kind::Xid, Severity::Critical, Some(48))
    );
    assert_eq!(
        (ev.onset_ts_ms, ev.detected_ts_ms, ev.cleared_ts_ms),
        (2_000, 2_000, None)
    );
    assert_eq!(ev.gpu, gpu("GPU-a", "h1", 3));
    assert!(
        !ev.action.is_empty() && ev.evidence.contains("48"),
        "{ev:?}"
    );
    assert_eq!(e.active().count(), 1);
    assert_eq!(
        e.states(3_000, 60_000),
        vec![(&gpu("GPU-a", "h1", 3), GpuState::Critical)]
    );
    // The gauge keeps showing 48: no new event. An hour after the XID, the
    // first poll at or past 2000 + 3,600,000 clears it.
    let mut t = 3_000;
    let mut changes = Vec::new();
    while t <= 3_602_000 {
        t += 1_000;
        changes.extend(poll(&mut e, a, t, &[(Field::XidErrors, 48.0)]));
    }
    assert_eq!(changes.len(), 1, "{changes:?}");
    let Change::Cleared(ev) = &changes[0] else {
        panic!("{changes:?}")
    };
    assert_eq!((ev.id, ev.cleared_ts_ms), (1, Some(3_602_000)));
    assert_eq!(e.active().count(), 0);
    assert_eq!(e.events().count(), 1, "the closed event is kept");
    assert_eq!(e.states(t, 60_000)[0].1, GpuState::Ok);
    assert_eq!(e.states(t + 60_001, 60_000)[0].1, GpuState::Unknown);
}

#[test]
fn a_restored_open_event_continues_when_seen_again_and_clears_when_not() {
    let seen = Event {
        id: 7,
        gpu: gpu("GPU-a", "h1", 0),
        kind: Kind::Xid,
        severity: Severity::Critical,
        xid: Some(48),
        onset_ts_ms: 500,
        detected_ts_ms: 500,
        cleared_ts_ms: None,
        action: "reset the GPU".into(),
        evidence: "XID 48".into(),
    };
    let gone = Event {
        id: 9,
        gpu: gpu("GPU-b", "h1", 1),
        xid: Some(13),
        severity: Severity::Warning,
        ..seen.clone()
    };
    let closed = Event {
        id: 8,
        cleared_ts_ms: Some(900),
        ..gone.clone()
    };
    let mut e = engine();
    e.restore([seen.clone(), closed.clone(), gone.clone()]);
    assert_eq!(e.active().count(), 2);
    let a = e.gpu(gpu("GPU-a", "h1", 0));
    let b = e.gpu(gpu("GPU-b", "h1", 1));
    // a's gauge still shows 48 after the restart: the detector opens it
    // again, which continues event 7.
    let mut out = Vec::new();
    for t in (10_000..=20_000).step_by(1_000) {
        out.extend(poll(&mut e, a, t, &[(Field::XidErrors, 48.0)]));
        out.extend(poll(&mut e, b, t, &[(Field::XidErrors, 0.0)]));
    }
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(e.active().map(|ev| ev.id).collect::<Vec<_>>().len(), 2);
    // b never shows XID 13 again: event 9 clears ten minutes (of b's polls)
    // after b's first poll since the restart, at 10,000.
    let mut t = 20_000;
    while t < 10_000 + Engine::RESTORED_GRACE_MS + 1_000 {
        t += 1_000;
        out.extend(poll(&mut e, a, t, &[(Field::XidErrors, 48.0)]));
        out.extend(poll(&mut e, b, t, &[(Field::XidErrors, 0.0)]));
    }
    assert_eq!(out.len(), 1, "{out:?}");
    let Change::Cleared(ev) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(ev.id, 9);
    // b's poll at 610,000 completed when the one at 611,000 started.
    assert_eq!(ev.cleared_ts_ms, Some(10_000 + Engine::RESTORED_GRACE_MS));
    let active: Vec<u64> = e.active().map(|ev| ev.id).collect();
    assert_eq!(active, vec![7]);
    let seven = e.events().find(|ev| ev.id == 7).unwrap();
    assert_eq!(seven.onset_ts_ms, 500, "the first onset is kept");
    // New events take ids after the restored ones.
    let c = e.gpu(gpu("GPU-c", "h2", 0));
    poll(&mut e, c, t, &[(Field::XidErrors, 79.0)]);
    let out = poll(&mut e, c, t + 1_000, &[(Field::XidErrors, 79.0)]);
    assert!(
        matches!(&out[..], [Change::Opened(ev)] if ev.id == 10),
        "{out:?}"
    );
}

#[test]
fn closed_events_are_bounded_and_open_ones_kept() {
    let mut e = engine();
    let old = Event {
        id: 1,
        gpu: gpu("GPU-a", "h1", 0),
        kind: Kind::Ecc,
        severity: Severity::Warning,
        xid: None,
        onset_ts_ms: 0,
        detected_ts_ms: 0,
        cleared_ts_ms: Some(1),
        action: String::new(),
        evidence: String::new(),
    };
    let open = Event {
        id: 2,
        cleared_ts_ms: None,
        ..old.clone()
    };
    let n = Engine::MAX_CLOSED as u64 + 5;
    e.restore(std::iter::once(open).chain((0..n).map(|i| Event {
        id: 3 + i,
        ..old.clone()
    })));
    assert_eq!(e.events().count(), Engine::MAX_CLOSED + 1);
    assert!(e.events().any(|ev| ev.id == 2), "the open one stays");
    assert!(
        !e.events().any(|ev| ev.id == 3),
        "the oldest closed ones go"
    );
}

#[test]
fn state_per_gpu_is_bounded() {
    let e = engine();
    assert!(e.state_bytes_per_gpu() <= crate::STATE_BUDGET_BYTES);
}

#[test]
fn one_failure_seen_by_three_detectors_is_one_incident_until_the_last_clears() {
    let mut e = engine();
    let a = e.gpu(gpu("GPU-a", "h1", 0));
    let b = e.gpu(gpu("GPU-b", "h1", 1));
    let fields = |xid: f64, dbe: f64, rows: f64| {
        vec![
            (Field::XidErrors, xid),
            (Field::EccDbeVolTotal, dbe),
            (Field::UncorrectableRemappedRows, rows),
        ]
    };
    poll(&mut e, a, 1_000, &fields(0.0, 0.0, 0.0));
    poll(&mut e, a, 2_000, &fields(48.0, 1.0, 1.0));
    // An XID 13 on another GPU stays its own event.
    poll(&mut e, b, 2_000, &[(Field::XidErrors, 13.0)]);
    let mut out = poll(&mut e, a, 3_000, &fields(48.0, 1.0, 1.0));
    out.extend(poll(&mut e, b, 3_000, &[(Field::XidErrors, 13.0)]));
    let opened: Vec<(u64, Kind)> = out
        .iter()
        .filter_map(|c| match c {
            Change::Opened(ev) => Some((ev.id, ev.kind)),
            _ => None,
        })
        .collect();
    assert_eq!(opened, vec![(1, Kind::Xid), (2, Kind::Xid)], "{out:?}");
    let joined = out
        .iter()
        .filter(|c| matches!(c, Change::Escalated(ev) if ev.id == 1))
        .count();
    assert_eq!(joined, 2, "ecc and row_remap join event 1: {out:?}");
    let one = e.active().find(|ev| ev.id == 1).unwrap().clone();
    assert_eq!(
        (one.kind, one.severity, one.xid),
        (Kind::Xid, Severity::Critical, Some(48))
    );
    assert!(
        one.evidence.contains("with ecc") && one.evidence.contains("with row_remap"),
        "{}",
        one.evidence
    );
    assert_eq!(e.active().count(), 2);
    // An hour and a bit later the XID and the new-row window have passed,
    // but the volatile DBE count still shows 1: the incident stays open.
    let mut out = Vec::new();
    let mut t = 3_000;
    while t < 2_000 + 2 * 3_600_000 {
        t += 10_000;
        out.extend(poll(&mut e, a, t, &fields(48.0, 1.0, 1.0)));
    }
    assert!(
        !out.iter()
            .any(|c| matches!(c, Change::Cleared(ev) if ev.id == 1)),
        "{out:?}"
    );
    assert!(e.active().any(|ev| ev.id == 1));
    let ev = e.events().find(|ev| ev.id == 1).unwrap();
    assert!(ev.evidence.contains("xid cleared"), "{}", ev.evidence);
    // A GPU reset zeroes the volatile count: the last signal clears, and
    // with it the incident, once.
    t += 10_000;
    poll(&mut e, a, t, &fields(48.0, 0.0, 1.0));
    let out = poll(&mut e, a, t + 10_000, &fields(48.0, 0.0, 1.0));
    let cleared: Vec<u64> = out
        .iter()
        .filter_map(|c| match c {
            Change::Cleared(ev) => Some(ev.id),
            _ => None,
        })
        .collect();
    assert_eq!(cleared, vec![1], "{out:?}");
    assert!(!e.active().any(|ev| ev.id == 1));
}

/// `changes`, all `telemetry_gap` openings, as (uuid, severity, onset,
/// detected), by uuid.
fn gaps_opened(changes: &[Change]) -> Vec<(String, Severity, i64, i64)> {
    let mut opened: Vec<_> = changes
        .iter()
        .map(|c| match c {
            Change::Opened(ev) => {
                assert_eq!(ev.kind, Kind::TelemetryGap);
                (
                    ev.gpu.uuid.clone(),
                    ev.severity,
                    ev.onset_ts_ms,
                    ev.detected_ts_ms,
                )
            }
            other => panic!("{other:?}"),
        })
        .collect();
    opened.sort_by(|a, b| a.0.cmp(&b.0));
    opened
}

#[test]
fn a_silent_gpu_a_silent_host_and_late_data_are_told_apart() {
    let mut e = engine();
    let h1 = [e.gpu(gpu("GPU-10", "h1", 0)), e.gpu(gpu("GPU-11", "h1", 1))];
    let h2 = [e.gpu(gpu("GPU-20", "h2", 0)), e.gpu(gpu("GPU-21", "h2", 1))];
    let temp = [(Field::GpuTemp, 50.0)];
    let mut out = Vec::new();
    // Everyone polls every second up to 10 s.
    for t in (1_000..=10_000).step_by(1_000) {
        for &s in h1.iter().chain(&h2) {
            out.extend(poll(&mut e, s, t, &temp));
        }
    }
    // A tick sees them all live (fresh at 10 s).
    e.tick(10_500, &mut out);
    // A GPU whose data is backfilled, always old when it arrives, is never
    // live: its silence is no gap.
    let old = e.gpu(gpu("GPU-old", "h3", 0));
    for t in (1_000..=5_000).step_by(1_000) {
        out.extend(poll(&mut e, old, t - 3_600_000, &temp));
    }
    // Then h1's GPU 1 and all of h2 fall silent; h1's GPU 0 goes on.
    for t in (11_000..=45_000).step_by(1_000) {
        out.extend(poll(&mut e, h1[0], t, &temp));
    }
    e.finish_before(45_000, &mut out);
    // 30 s of silence is not yet a gap (the newest poll is at 10 s).
    e.tick(40_000, &mut out);
    assert!(out.is_empty(), "{out:?}");
    e.tick(45_000, &mut out);
    assert_eq!(
        gaps_opened(&out),
        vec![
            ("GPU-11".to_string(), Severity::Critical, 11_000, 45_000),
            ("GPU-20".to_string(), Severity::Warning, 11_000, 45_000),
            ("GPU-21".to_string(), Severity::Warning, 11_000, 45_000),
        ]
    );
    // Once open, a tick opens nothing more.
    out.clear();
    e.tick(50_000, &mut out);
    assert!(out.is_empty(), "{out:?}");
    // h2's agent was cut off: its spool now delivers the polls of the gap.
    for t in (11_000..=50_000).step_by(1_000) {
        out.extend(poll(&mut e, h2[0], t, &temp));
        out.extend(poll(&mut e, h2[1], t, &temp));
    }
    // h1's GPU 1 reports again, at 60 s.
    out.extend(poll(&mut e, h1[1], 60_000, &temp));
    out.extend(poll(&mut e, h1[1], 61_000, &temp));
    let mut cleared: Vec<(String, i64, bool)> = out
        .iter()
        .map(|c| match c {
            Change::Cleared(ev) => (
                ev.gpu.uuid.clone(),
                ev.cleared_ts_ms.unwrap(),
                ev.evidence.contains("late"),
            ),
            other => panic!("{other:?}"),
        })
        .collect();
    cleared.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        cleared,
        vec![
            ("GPU-11".to_string(), 60_000, false),
            ("GPU-20".to_string(), 11_000, true),
            ("GPU-21".to_string(), 11_000, true),
        ]
    );
    assert_eq!(e.active().count(), 0);
}

#[test]
fn a_gpu_behind_the_fleet_is_silent_in_seconds_and_a_stall_of_everyone_is_not() {
    let mut e = engine();
    // Six hosts of two GPUs at 1 Hz; h5's GPU 0 runs its clock 60 s ahead.
    let slots: Vec<GpuSlot> = (0..12)
        .map(|i| e.gpu(gpu(&format!("GPU-{i:02}"), &format!("h{}", i / 2), i % 2)))
        .collect();
    let skew = |i: usize| if i == 10 { 60_000 } else { 0 };
    let temp = [(Field::GpuTemp, 50.0)];
    let mut out = Vec::new();
    let feed = |e: &mut Engine, out: &mut Vec<Change>, t: i64, who: &dyn Fn(usize) -> bool| {
        for (i, &s) in slots.iter().enumerate() {
            if who(i) {
                out.extend(poll(e, s, t + skew(i), &temp));
            }
        }
    };
    for t in (1_000..=10_000).step_by(1_000) {
        feed(&mut e, &mut out, t, &|_| true);
    }
    e.tick(10_500, &mut out);
    // From 11 s, h0 (GPUs 0 and 1) and h1's GPU 3 fall silent; the rest
    // goes on. The median newest sample is the others' (the skewed clock
    // does not move it); 8 s behind it is not yet silent, 9 s is.
    let on = |i: usize| i > 1 && i != 3;
    for t in (11_000..=18_000).step_by(1_000) {
        feed(&mut e, &mut out, t, &on);
    }
    e.tick(18_500, &mut out);
    assert!(out.is_empty(), "{out:?}");
    feed(&mut e, &mut out, 19_000, &on);
    e.tick(19_500, &mut out);
    for c in &out {
        if let Change::Opened(ev) = c {
            assert!(
                ev.evidence
                    .ends_with("the fleet's median GPU is 9 s ahead of it"),
                "{}",
                ev.evidence
            );
        }
    }
    assert_eq!(
        gaps_opened(&std::mem::take(&mut out)),
        vec![
            ("GPU-00".to_string(), Severity::Warning, 11_000, 19_500),
            ("GPU-01".to_string(), Severity::Warning, 11_000, 19_500),
            ("GPU-03".to_string(), Severity::Critical, 11_000, 19_500),
        ]
    );
    // Now nobody's data arrives (ingest stalled, or this node cut off): at
    // 26 s of silence by the clock, nothing more opens; past 30 s the clock
    // rule speaks for everyone.
    e.tick(45_000, &mut out);
    assert!(out.is_empty(), "{out:?}");
    e.tick(49_100, &mut out);
    let opened = out
        .iter()
        .filter(|c| matches!(c, Change::Opened(ev) if ev.kind == Kind::TelemetryGap))
        .count();
    assert_eq!(opened, 8, "the 8 GPUs of h1-h5 on time: {out:?}");
}

#[test]
fn drift_opens_at_the_tick_after_an_inventory_and_clears_when_it_matches_again() {
    let mut e = engine();
    let inv = |driver: &str| Inventory {
        model: "NVIDIA H100 80GB HBM3".into(),
        driver_version: driver.into(),
        vbios_version: "96.00.89.00.01".into(),
        inforom_version: String::new(),
    };
    let slots: Vec<GpuSlot> = (0..6)
        .map(|i| e.gpu(gpu(&format!("GPU-{i}"), &format!("h{}", i / 2), i % 2)))
        .collect();
    for (i, &s) in slots.iter().enumerate() {
        e.set_inventory(s, inv(if i == 4 { "535.129.03" } else { "550.54.15" }));
    }
    let mut out = Vec::new();
    e.tick(10_000, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    let Change::Opened(ev) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(
        (ev.kind, ev.severity, ev.gpu.uuid.as_str()),
        (Kind::Drift, Severity::Warning, "GPU-4")
    );
    assert_eq!((ev.onset_ts_ms, ev.detected_ts_ms), (10_000, 10_000));
    assert_eq!(
        ev.evidence,
        "driver 535.129.03, while 5 of 6 GPUs of the fleet run 550.54.15"
    );
    // Telling the same again, and the minute's re-check, change nothing.
    e.set_inventory(slots[4], inv("535.129.03"));
    e.tick(11_000, &mut out);
    e.tick(80_000, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    // The host is upgraded: cleared at the next tick.
    e.set_inventory(slots[4], inv("550.54.15"));
    e.tick(81_000, &mut out);
    assert_eq!(out.len(), 2, "{out:?}");
    let Change::Cleared(ev) = &out[1] else {
        panic!("{out:?}")
    };
    assert_eq!((ev.kind, ev.cleared_ts_ms), (Kind::Drift, Some(81_000)));
    assert_eq!(e.active().count(), 0);
}

#[test]
fn a_gpu_moved_to_another_host_changes_peer_group() {
    let mut e = engine();
    let a = e.gpu(gpu("GPU-a", "h1", 0));
    let _b = e.gpu(gpu("GPU-b", "h1", 1));
    assert_eq!(e.gpu(gpu("GPU-a", "h2", 0)), a);
    let groups: Vec<(&str, &[GpuSlot])> = e
        .hosts
        .iter()
        .map(|(h, s)| (h.as_str(), s.as_slice()))
        .collect();
    assert_eq!(groups, vec![("h1", &[1][..]), ("h2", &[0][..])]);
}

#[test]
fn a_drift_event_read_back_from_the_log_goes_on_while_it_drifts_and_clears_when_fixed() {
    let inv = |driver: &str| Inventory {
        model: "H100".into(),
        driver_version: driver.into(),
        vbios_version: String::new(),
        inforom_version: String::new(),
    };
    let mut e = engine();
    let slots: Vec<GpuSlot> = (0..4)
        .map(|i| e.gpu(gpu(&format!("GPU-{i}"), "h1", i)))
        .collect();
    for (i, &s) in slots.iter().enumerate() {
        e.set_inventory(s, inv(if i == 0 { "535" } else { "550" }));
    }
    let mut out = Vec::new();
    e.tick(1_000, &mut out);
    assert_eq!(out.len(), 1, "{out:?}");
    // A restart: the open event is read back; the inventory comes again.
    let events: Vec<Event> = e.events().cloned().collect();
    let mut e = engine();
    e.restore(events);
    let slots: Vec<GpuSlot> = (0..4)
        .map(|i| e.gpu(gpu(&format!("GPU-{i}"), "h1", i)))
        .collect();
    for (i, &s) in slots.iter().enumerate() {
        e.set_inventory(s, inv(if i == 0 { "535" } else { "550" }));
    }
    let mut out = Vec::new();
    e.tick(2_000, &mut out);
    // Polls for longer than the restored grace: still one open drift event.
    for t in 0..=Engine::RESTORED_GRACE_MS / 60_000 + 1 {
        let ts = 3_000 + t * 60_000;
        out.extend(poll(&mut e, slots[0], ts, &[(Field::GpuTemp, 40.0)]));
        e.tick(ts, &mut out);
    }
    let active: Vec<&Event> = e.active().collect();
    assert_eq!(active.len(), 1, "{out:?}");
    assert_eq!(
        (active[0].kind, active[0].gpu.uuid.as_str()),
        (Kind::Drift, "GPU-0")
    );
    assert!(
        out.iter().all(|c| !matches!(c, Change::Cleared(_))),
        "{out:?}"
    );
    // Upgraded: it clears at the next tick.
    e.set_inventory(slots[0], inv("550"));
    let mut out = Vec::new();
    e.tick(664_000, &mut out);
    assert!(
        matches!(&out[..], [Change::Cleared(ev)] if ev.kind == Kind::Drift),
        "{out:?}"
    );
}
