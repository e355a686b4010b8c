use super::*;

fn event(id: u64) -> Event {
    Event {
        id,
        gpu: GpuId {
            uuid: format!("GPU-{id}"),
            host: "node-7".into(),
            gpu: 3,
            rack: Some("r2".into()),
            row: None,
            cluster: Some("west".into()),
        },
        kind: Kind::RowRemap,
        severity: Severity::Warning,
        xid: None,
        onset_ts_ms: -5,
        detected_ts_ms: 1_700_000_000_123,
        cleared_ts_ms: None,
        action: "reset the GPU".into(),
        evidence: "pending=1, 'ü' and \"quotes\"".into(),
    }
}

#[test]
fn events_come_back_as_written_and_the_last_record_of_an_id_wins() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("health/events.log");
    let (mut log, rec) = EventLog::open(&path).unwrap();
    assert_eq!(rec, Recovered::default());
    let a = event(1);
    let mut b = Event {
        kind: Kind::Xid,
        xid: Some(79),
        severity: Severity::Critical,
        ..event(2)
    };
    log.append(&a).unwrap();
    log.append(&b).unwrap();
    b.cleared_ts_ms = Some(1_700_000_100_000);
    b.evidence.push_str("; cleared");
    log.append(&b).unwrap();
    log.sync().unwrap();
    drop(log);
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..8], b"GPHEALTH");
    assert_eq!(&bytes[8..16], &[1, 0, 0, 0, 0, 0, 0, 0]);
    let (log, rec) = EventLog::open(&path).unwrap();
    assert_eq!(rec.records, 3);
    assert_eq!(rec.dropped_bytes, 0);
    assert_eq!(rec.events, vec![a, b]);
    assert_eq!(log.records(), 3);
}

#[test]
fn a_torn_or_damaged_tail_is_cut_and_the_rest_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.log");
    let (mut log, _) = EventLog::open(&path).unwrap();
    log.append(&event(1)).unwrap();
    log.sync().unwrap();
    let good = std::fs::metadata(&path).unwrap().len();
    log.append(&event(2)).unwrap();
    log.sync().unwrap();
    drop(log);
    let full = std::fs::read(&path).unwrap();
    // Every cut inside the second record, and a flipped bit in its payload.
    for cut in [good + 1, good + 7, good + 8, full.len() as u64 - 1] {
        std::fs::write(&path, &full[..cut as usize]).unwrap();
        let (_, rec) = EventLog::open(&path).unwrap();
        assert_eq!(rec.events, vec![event(1)], "cut at {cut}");
        assert_eq!(rec.dropped_bytes, cut - good, "cut at {cut}");
        assert_eq!(
            std::fs::metadata(&path).unwrap().len(),
            good,
            "the tail is cut"
        );
    }
    let mut flipped = full.clone();
    *flipped.last_mut().unwrap() ^= 0x10;
    std::fs::write(&path, &flipped).unwrap();
    let (mut log, rec) = EventLog::open(&path).unwrap();
    assert_eq!(rec.events, vec![event(1)]);
    assert_eq!(rec.dropped_bytes, full.len() as u64 - good);
    // Appends go on after the cut.
    log.append(&event(3)).unwrap();
    log.sync().unwrap();
    drop(log);
    let (_, rec) = EventLog::open(&path).unwrap();
    assert_eq!(rec.events, vec![event(1), event(3)]);
}

#[test]
fn another_file_or_version_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.log");
    std::fs::write(&path, b"not a log at all, longer than a header").unwrap();
    let e = EventLog::open(&path).unwrap_err();
    assert!(e.to_string().contains("GPHEALTH"), "{e}");
    let mut v2 = b"GPHEALTH".to_vec();
    v2.extend_from_slice(&[2, 0, 0, 0, 0, 0, 0, 0]);
    std::fs::write(&path, &v2).unwrap();
    let e = EventLog::open(&path).unwrap_err();
    assert!(e.to_string().contains("version 2"), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), v2, "left as it was");
}

#[test]
fn rewrite_keeps_one_record_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.log");
    let (mut log, _) = EventLog::open(&path).unwrap();
    let mut e = event(1);
    for i in 0..10 {
        e.evidence = format!("change {i}");
        log.append(&e).unwrap();
    }
    log.rewrite([&e, &event(2)]).unwrap();
    assert_eq!(log.records(), 2);
    log.append(&event(3)).unwrap();
    log.sync().unwrap();
    drop(log);
    let (_, rec) = EventLog::open(&path).unwrap();
    assert_eq!(rec.records, 3);
    assert_eq!(rec.events, vec![e, event(2), event(3)]);
}
