//! XID detector and catalog tests. Every expected value is worked out by hand
//! from the rules in the module docs and the catalog rows they cite.

use super::*;

fn det() -> XidDetector {
    XidDetector::new(XidConfig::default())
}

/// Feeds one poll carrying the XID gauge (`None`: the poll lacks the field).
fn feed(d: &mut XidDetector, ts_ms: i64, gauge: Option<f64>) -> Vec<Transition> {
    let mut poll = Poll::new(ts_ms);
    if let Some(v) = gauge {
        poll.set(Field::XidErrors, v);
    }
    let mut out = Vec::new();
    d.observe(&poll, &mut out);
    out
}

fn opened(t: &[Transition]) -> &Finding {
    match t {
        [Transition::Opened(f)] => f,
        other => panic!("expected one Opened, got {other:?}"),
    }
}

const RESTART_APP: &str = "restart the application; the GPU stays in service";
const RESET_GPU: &str = "drain the GPU and reset it";
const REBOOT_NODE: &str = "drain the node and reboot it";
const DRAIN: &str = "drain the GPU and report a hardware fault (run field diagnostics)";

#[test]
fn xid_79_opens_critical_reboot_node_on_gauge_change() {
    let mut d = det();
    assert_eq!(feed(&mut d, 0, Some(0.0)), vec![]);
    let t = feed(&mut d, 1_000, Some(79.0));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Xid,
            severity: Severity::Critical,
            xid: Some(79),
            onset_ts_ms: 1_000,
            detected_ts_ms: 1_000,
            action: REBOOT_NODE,
            evidence: "XID 79 ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS \
                       (catalog RESTART_BM, FATAL); gauge 0 -> 79"
                .to_string(),
        }
    );
    // The gauge keeps its last value: no new occurrence.
    assert_eq!(feed(&mut d, 2_000, Some(79.0)), vec![]);
    assert_eq!(feed(&mut d, 3_000, Some(79.0)), vec![]);
}

#[test]
fn first_non_zero_gauge_value_opens() {
    let mut d = det();
    let t = feed(&mut d, 5_000, Some(48.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!(f.xid, Some(48));
    assert_eq!((f.onset_ts_ms, f.detected_ts_ms), (5_000, 5_000));
    assert_eq!(f.action, RESET_GPU);
    assert_eq!(
        f.evidence,
        "XID 48 ROBUST_CHANNEL_GPU_ECC_DBE (catalog WORKFLOW_XID_48, FATAL); \
         first gauge value seen"
    );
}

#[test]
fn ignored_xids_open_nothing() {
    // 43, 63, 92, 14: catalog IGNORE; 45: WORKFLOW_XID_45; 154: follow the
    // linked XID. Each is a gauge change, none may open an event.
    let mut d = det();
    for (i, xid) in [43.0, 63.0, 92.0, 45.0, 154.0, 14.0, 63.0]
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            feed(&mut d, i as i64 * 1_000, Some(xid)),
            vec![],
            "XID {xid}"
        );
    }
    // The gauge state still moved on: 63 -> 13 is a change and opens 13.
    let t = feed(&mut d, 10_000, Some(13.0));
    assert_eq!(opened(&t).xid, Some(13));
}

#[test]
fn application_xids_are_warnings_to_restart_the_app() {
    let mut d = det();
    for (ts, xid) in [(0, 13), (1_000, 31), (2_000, 94)] {
        let t = feed(&mut d, ts, Some(f64::from(xid)));
        let f = opened(&t);
        assert_eq!(f.xid, Some(xid));
        assert_eq!(f.severity, Severity::Warning, "XID {xid}");
        assert_eq!(f.action, RESTART_APP);
    }
}

#[test]
fn repeat_in_a_new_burst_within_24h_escalates() {
    let mut d = det();
    assert_eq!(
        opened(&feed(&mut d, 0, Some(31.0))).severity,
        Severity::Warning
    );
    assert_eq!(opened(&feed(&mut d, 60_000, Some(13.0))).xid, Some(13));
    // 31 again 240 s after its last occurrence: >= 180 s, a second burst.
    let t = feed(&mut d, 240_000, Some(31.0));
    assert_eq!(
        t,
        vec![Transition::Escalated(Escalation {
            key: EventKey::xid(31),
            severity: Severity::Critical,
            ts_ms: 240_000,
            action: DRAIN,
            evidence: "XID 31 ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT (catalog RESTART_APP, \
                       NONFATAL); gauge 13 -> 31; burst 2 of XID 31 within 24.0 h"
                .to_string(),
        })]
    );
}

#[test]
fn repeat_within_one_burst_does_not_escalate() {
    let mut d = det();
    assert_eq!(opened(&feed(&mut d, 0, Some(31.0))).xid, Some(31));
    assert_eq!(opened(&feed(&mut d, 30_000, Some(13.0))).xid, Some(13));
    // 60 s after the first 31: same burst.
    assert_eq!(feed(&mut d, 60_000, Some(31.0)), vec![]);
    assert_eq!(feed(&mut d, 90_000, Some(13.0)), vec![]);
    // 179.999 s after the *last* 31 (at 60 s): the burst chains on.
    assert_eq!(feed(&mut d, 239_999, Some(31.0)), vec![]);
}

#[test]
fn event_clears_one_hour_after_the_last_occurrence() {
    let mut d = det();
    assert_eq!(opened(&feed(&mut d, 0, Some(79.0))).xid, Some(79));
    assert_eq!(feed(&mut d, 3_599_999, Some(79.0)), vec![]);
    // A poll without the field still runs the clock.
    assert_eq!(
        feed(&mut d, 3_600_000, None),
        vec![Transition::Cleared(Clearing {
            key: EventKey::xid(79),
            cleared_ts_ms: 3_600_000,
            evidence: "no new XID 79 for 1.0 h (last at 0 ms)".to_string(),
        })]
    );
    assert_eq!(feed(&mut d, 7_200_000, Some(79.0)), vec![]);
}

#[test]
fn recurrence_after_clearing_reopens_escalated() {
    let mut d = det();
    assert_eq!(
        opened(&feed(&mut d, 0, Some(31.0))).severity,
        Severity::Warning
    );
    assert!(matches!(
        feed(&mut d, 3_600_000, None).as_slice(),
        [Transition::Cleared(_)]
    ));
    // Exporter restart resets the gauge; 31 then comes back within 24 h.
    assert_eq!(feed(&mut d, 3_700_000, Some(0.0)), vec![]);
    let t = feed(&mut d, 4_000_000, Some(31.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!(f.action, DRAIN);
    assert_eq!(f.onset_ts_ms, 4_000_000);
}

#[test]
fn recurrence_after_24h_starts_over_as_warning() {
    let mut d = det();
    opened(&feed(&mut d, 0, Some(31.0)));
    assert!(matches!(
        feed(&mut d, 3_600_000, None).as_slice(),
        [Transition::Cleared(_)]
    ));
    assert_eq!(feed(&mut d, 3_700_000, Some(0.0)), vec![]);
    // Exactly 24 h after the first burst: it has left the window.
    let t = feed(&mut d, 86_400_000, Some(31.0));
    assert_eq!(opened(&t).severity, Severity::Warning);
    assert_eq!(opened(&t).action, RESTART_APP);
}

#[test]
fn fatal_xid_fifth_burst_in_24h_hardens_to_drain() {
    let mut d = det();
    assert_eq!(opened(&feed(&mut d, 0, Some(48.0))).action, RESET_GPU);
    // Bursts 2, 3 and 4 (200 s apart, gauge back to 0 in between): already
    // critical, action unchanged, so nothing to emit.
    for k in 1..=3 {
        assert_eq!(feed(&mut d, k * 200_000 - 100_000, Some(0.0)), vec![]);
        assert_eq!(
            feed(&mut d, k * 200_000, Some(48.0)),
            vec![],
            "burst {}",
            k + 1
        );
    }
    assert_eq!(feed(&mut d, 700_000, Some(0.0)), vec![]);
    let t = feed(&mut d, 800_000, Some(48.0));
    assert_eq!(
        t,
        vec![Transition::Escalated(Escalation {
            key: EventKey::xid(48),
            severity: Severity::Critical,
            ts_ms: 800_000,
            action: DRAIN,
            evidence: "XID 48 ROBUST_CHANNEL_GPU_ECC_DBE (catalog WORKFLOW_XID_48, FATAL); \
                       gauge 0 -> 48; burst 5 of XID 48 within 24.0 h"
                .to_string(),
        })]
    );
}

#[test]
fn unknown_xid_is_a_warning_to_investigate() {
    let mut d = det();
    let t = feed(&mut d, 0, Some(200.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(
        f.action,
        "investigate: XID not in NVIDIA's catalog as gpulse knows it"
    );
    assert_eq!(
        f.evidence,
        "XID 200 (not in the catalog); first gauge value seen"
    );
}

#[test]
fn seventeenth_open_event_evicts_the_quietest() {
    // 17 distinct non-ignored codes (14 is IGNORE, so it is skipped).
    let codes = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 15, 16, 17, 18];
    let mut d = det();
    for (i, code) in codes[..16].iter().enumerate() {
        let t = feed(&mut d, i as i64 * 1_000, Some(f64::from(*code)));
        assert_eq!(opened(&t).xid, Some(*code));
    }
    let t = feed(&mut d, 16_000, Some(18.0));
    assert_eq!(t.len(), 2, "{t:?}");
    assert_eq!(
        t[0],
        Transition::Cleared(Clearing {
            key: EventKey::xid(1),
            cleared_ts_ms: 16_000,
            evidence: "evicted: 16 XID events open, XID 1 quiet the longest".to_string(),
        })
    );
    assert_eq!(opened(&t[1..]).xid, Some(18));
}

#[test]
fn stale_duplicate_and_malformed_polls_are_ignored() {
    let mut d = det();
    assert_eq!(feed(&mut d, 10_000, Some(0.0)), vec![]);
    assert_eq!(feed(&mut d, 5_000, Some(79.0)), vec![], "older poll");
    assert_eq!(feed(&mut d, 10_000, Some(79.0)), vec![], "same ts");
    assert_eq!(feed(&mut d, 11_000, Some(79.5)), vec![], "not an integer");
    assert_eq!(feed(&mut d, 12_000, Some(-1.0)), vec![], "negative");
    assert_eq!(feed(&mut d, 13_000, Some(f64::NAN)), vec![], "NaN");
    let t = feed(&mut d, 14_000, Some(79.0));
    assert!(opened(&t).evidence.ends_with("gauge 0 -> 79"), "{t:?}");
}

#[test]
fn catalog_matches_the_counts_in_research_2_1() {
    assert_eq!(CATALOG.len(), 162);
    for (i, e) in CATALOG.iter().enumerate() {
        assert_eq!(e.code as usize, i + 1, "{e:?}");
    }
    let count = |b: Bucket| CATALOG.iter().filter(|e| e.bucket == b).count();
    assert_eq!(CATALOG.iter().filter(|e| e.fatal).count(), 92);
    assert_eq!(count(ReportIssue), 63);
    assert_eq!(count(RestartApp), 48);
    assert_eq!(count(Ignore), 19);
    assert_eq!(count(ResetGpu), 15);
    assert_eq!(count(WorkflowNvlink5), 7);
    assert_eq!(count(RestartBm), 2);
    for b in [
        WorkflowXid45,
        WorkflowXid48,
        WorkflowNvlink,
        CheckMechanicals,
        UpdateSwFw,
        RestartVm,
        CheckUvm,
        FollowLinkedXid,
    ] {
        assert_eq!(count(b), 1, "{b:?}");
    }
}

#[test]
fn catalog_rows_match_spec_5_1() {
    // (code, bucket, fatal) from the table in gpu-domain.md §5.1.
    let rows = [
        (13, RestartApp, false),
        (31, RestartApp, false),
        (43, Ignore, false),
        (45, WorkflowXid45, false),
        (46, ResetGpu, true),
        (48, WorkflowXid48, true),
        (54, CheckMechanicals, true),
        (62, ResetGpu, true),
        (63, Ignore, false),
        (64, ResetGpu, true),
        (74, WorkflowNvlink, true),
        (79, RestartBm, true),
        (92, Ignore, false),
        (94, RestartApp, false),
        (95, ResetGpu, true),
        (109, ResetGpu, true),
        (110, ResetGpu, true),
        (119, ResetGpu, true),
        (120, ResetGpu, true),
        (121, Ignore, false),
        (136, ResetGpu, true),
        (140, ResetGpu, true),
        (143, ResetGpu, true),
        (144, WorkflowNvlink5, true),
        (150, WorkflowNvlink5, true),
        (151, RestartVm, true),
        (154, FollowLinkedXid, false),
        (155, ResetGpu, true),
        (156, ResetGpu, true),
        (158, ResetGpu, true),
        (160, RestartBm, true),
    ];
    for (code, bucket, fatal) in rows {
        let e = lookup(code).expect("in catalog");
        assert_eq!((e.bucket, e.fatal), (bucket, fatal), "XID {code}");
    }
    assert_eq!(lookup(0), None);
    assert_eq!(lookup(163), None);
}

#[test]
fn classification_per_bucket() {
    use Severity::{Critical, Warning};
    assert_eq!(classify(63), None);
    assert_eq!(classify(43), None);
    assert_eq!(classify(45), None);
    assert_eq!(classify(154), None);
    assert_eq!(classify(13), Some((Warning, Action::RestartApp)));
    assert_eq!(classify(159), Some((Warning, Action::RestartApp)));
    assert_eq!(classify(48), Some((Critical, Action::ResetGpu)));
    assert_eq!(classify(79), Some((Critical, Action::RebootNode)));
    assert_eq!(classify(151), Some((Critical, Action::RebootNode)));
    assert_eq!(classify(74), Some((Critical, Action::DrainAndReport)));
    assert_eq!(classify(54), Some((Critical, Action::DrainAndReport)));
    assert_eq!(classify(1), Some((Critical, Action::DrainAndReport)));
    assert_eq!(classify(78), Some((Critical, Action::UpdateSoftware)));
    assert_eq!(classify(163), Some((Warning, Action::Investigate)));
}

#[test]
fn config_validation() {
    assert_eq!(XidConfig::default().validate(), Ok(()));
    let bad = XidConfig {
        escalate_after_bursts: 1,
        ..XidConfig::default()
    };
    assert_eq!(
        bad.validate().map_err(|e| e.field),
        Err("xid.escalate_after_bursts")
    );
    let bad = XidConfig {
        clear_after_ms: 0,
        ..XidConfig::default()
    };
    assert_eq!(
        bad.validate().map_err(|e| e.field),
        Err("xid.clear_after_ms")
    );
}
