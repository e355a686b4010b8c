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
