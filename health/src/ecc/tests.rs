//! ECC and row-remap detector tests on hand-built poll sequences. Expected
//! values are worked out by hand from the thresholds in the module docs; the
//! 12-bucket window arithmetic is spelled out where it decides the outcome.

use super::*;

fn obs(d: &mut impl Detector, poll: Poll) -> Vec<Transition> {
    let mut out = Vec::new();
    d.observe(&poll, &mut out);
    out
}

fn p(ts_ms: i64) -> Poll {
    Poll::new(ts_ms)
}

fn opened(t: &[Transition]) -> &Finding {
    match t {
        [Transition::Opened(f)] => f,
        other => panic!("expected one Opened, got {other:?}"),
    }
}

fn cleared_at(t: &[Transition], kind: Kind) -> i64 {
    match t {
        [Transition::Cleared(c)] if c.key == EventKey::of(kind) => c.cleared_ts_ms,
        other => panic!("expected one Cleared of {kind}, got {other:?}"),
    }
}

// ---- ecc ----

#[test]
fn volatile_dbe_opens_critical_and_clears_after_reset() {
    let mut d = EccDetector::new();
    let healthy = |ts| {
        p(ts)
            .with(Field::EccDbeVolTotal, 0.0)
            .with(Field::EccSbeVolTotal, 0.0)
    };
    assert_eq!(obs(&mut d, healthy(0)), vec![]);
    let t = obs(
        &mut d,
        p(1_000)
            .with(Field::EccDbeVolTotal, 1.0)
            .with(Field::EccSbeVolTotal, 0.0),
    );
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Ecc,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 1_000,
            detected_ts_ms: 1_000,
            action: "drain the GPU and reset it (uncorrectable ECC errors since driver load)",
            evidence: "volatile DBE count 1 (DCGM fails at > 0)".to_string(),
        }
    );
    assert_eq!(
        obs(&mut d, p(2_000).with(Field::EccDbeVolTotal, 2.0)),
        vec![]
    );
    // A poll without the field is no evidence of recovery.
    assert_eq!(obs(&mut d, p(3_000)), vec![]);
    // GPU reset: the volatile counter restarts at 0.
    let t = obs(&mut d, healthy(4_000));
    assert_eq!(
        t,
        vec![Transition::Cleared(Clearing {
            key: EventKey::of(Kind::Ecc),
            cleared_ts_ms: 4_000,
            evidence: "no condition holds: volatile DBE 0, new SBEs in window 0".to_string(),
        })]
    );
}

#[test]
fn volatile_dbe_present_at_the_first_poll_fires() {
    let mut d = EccDetector::new();
    let t = obs(&mut d, p(7_000).with(Field::EccDbeVolTotal, 3.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!((f.onset_ts_ms, f.detected_ts_ms), (7_000, 7_000));
}

#[test]
fn sbe_rate_fires_at_ten_per_minute_and_clears_when_it_leaves_the_window() {
    let mut d = EccDetector::new();
    let sbe = |ts, v| p(ts).with(Field::EccSbeVolTotal, v);
    assert_eq!(obs(&mut d, sbe(0, 100.0)), vec![], "baseline");
    assert_eq!(obs(&mut d, sbe(10_000, 105.0)), vec![], "+5 (bucket 2)");
    assert_eq!(obs(&mut d, sbe(20_000, 109.0)), vec![], "+4: 9 < 10");
    let t = obs(&mut d, sbe(30_000, 110.0));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Ecc,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 10_000,
            detected_ts_ms: 30_000,
            action: "watch the GPU: high single-bit ECC error rate; run diagnostics if it persists",
            evidence: "10 new volatile SBEs within 1.0 min (DCGM limit 10)".to_string(),
        }
    );
    // 5 s buckets: at 65 s (bucket 13) the +5 of bucket 2 is still in.
    assert_eq!(obs(&mut d, sbe(65_000, 110.0)), vec![]);
    // At 70 s (bucket 14) it is out: 4 + 1 = 5 < 10.
    assert_eq!(
        cleared_at(&obs(&mut d, sbe(70_000, 110.0)), Kind::Ecc),
        70_000
    );
}

#[test]
fn sbe_trickle_below_the_rate_stays_quiet() {
    let mut d = EccDetector::new();
    // +5 SBEs per minute for an hour: each minute's window holds only 5.
    for k in 0..=60 {
        let poll = p(k * 60_000).with(Field::EccSbeVolTotal, 5.0 * k as f64);
        assert_eq!(obs(&mut d, poll), vec![], "minute {k}");
    }
}

#[test]
fn sbe_counter_reset_is_not_growth() {
    let mut d = EccDetector::new();
    let sbe = |ts, v| p(ts).with(Field::EccSbeVolTotal, v);
    assert_eq!(obs(&mut d, sbe(0, 1_000.0)), vec![]);
    // Driver reload: 1000 -> 3 is a reset (DCGM would count |diff| = 997).
    assert_eq!(obs(&mut d, sbe(1_000, 3.0)), vec![]);
    assert_eq!(obs(&mut d, sbe(2_000, 8.0)), vec![], "+5");
    assert_eq!(obs(&mut d, sbe(3_000, 12.0)), vec![], "+4: 9 < 10");
}

#[test]
fn pending_retirement_warns_then_dbe_escalates_then_reset_clears() {
    let mut d = EccDetector::new();
    let t = obs(&mut d, p(0).with(Field::RetiredPending, 1.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(f.onset_ts_ms, 0);
    assert_eq!(
        f.action,
        "reset the GPU when its jobs allow, so the pending page retirement takes effect"
    );
    assert_eq!(f.evidence, "1 pages pending retirement");
    let t = obs(
        &mut d,
        p(1_000)
            .with(Field::RetiredPending, 1.0)
            .with(Field::EccDbeVolTotal, 1.0),
    );
    assert_eq!(
        t,
        vec![Transition::Escalated(Escalation {
            key: EventKey::of(Kind::Ecc),
            severity: Severity::Critical,
            ts_ms: 1_000,
            action: "drain the GPU and reset it (uncorrectable ECC errors since driver load)",
            evidence: "volatile DBE count 1 (DCGM fails at > 0); 1 pages pending retirement"
                .to_string(),
        })]
    );
    let reset = p(2_000)
        .with(Field::RetiredPending, 0.0)
        .with(Field::EccDbeVolTotal, 0.0);
    assert_eq!(cleared_at(&obs(&mut d, reset), Kind::Ecc), 2_000);
}

#[test]
fn retired_pages_fail_at_63() {
    let mut d = EccDetector::new();
    let pages = |ts, sbe, dbe| {
        p(ts)
            .with(Field::RetiredSbe, sbe)
            .with(Field::RetiredDbe, dbe)
    };
    // 62 pages: below the limit; 22 DBE pages > 15 but no new ones.
    assert_eq!(obs(&mut d, pages(0, 40.0, 22.0)), vec![]);
    // 63: the limit. One new DBE page is not "> 1 in a week".
    let t = obs(&mut d, pages(1_000, 40.0, 23.0));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::Ecc,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 1_000,
            detected_ts_ms: 1_000,
            action: "drain the GPU and run field diagnostics (memory repair exhausted; \
                     RMA candidate)",
            evidence: "retired pages 40 SBE + 23 DBE = 63 (DCGM limit 63)".to_string(),
        }
    );
}

#[test]
fn dbe_retirements_over_the_soft_limit_fail_and_clear_after_a_week() {
    const DAY: i64 = 86_400_000;
    let mut d = EccDetector::new();
    let pages = |ts, dbe| {
        p(ts)
            .with(Field::RetiredSbe, 0.0)
            .with(Field::RetiredDbe, dbe)
    };
    assert_eq!(obs(&mut d, pages(0, 16.0)), vec![], "baseline");
    assert_eq!(obs(&mut d, pages(DAY, 17.0)), vec![], "1 new: not > 1");
    let t = obs(&mut d, pages(2 * DAY, 18.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!((f.onset_ts_ms, f.detected_ts_ms), (DAY, 2 * DAY));
    assert_eq!(
        f.evidence,
        "18 DBE-retired pages (> 15) and 2 new within 168.0 h (> 1)"
    );
    // Buckets of 14 h (50 400 000 ms): day 1 is bucket 1, day 2 bucket 3.
    // Bucket 1 leaves at bucket 13, i.e. at 13 * 50 400 000 = 655 200 000 ms.
    assert_eq!(obs(&mut d, pages(655_199_999, 18.0)), vec![]);
    assert_eq!(
        cleared_at(&obs(&mut d, pages(655_200_000, 18.0)), Kind::Ecc),
        655_200_000
    );
}

#[test]
fn dbe_retirements_under_the_soft_limit_stay_quiet() {
    let mut d = EccDetector::new();
    for (i, dbe) in [10.0, 12.0, 14.0, 15.0].into_iter().enumerate() {
        let poll = p(i as i64 * 3_600_000)
            .with(Field::RetiredSbe, 0.0)
            .with(Field::RetiredDbe, dbe);
        assert_eq!(obs(&mut d, poll), vec![], "{dbe} DBE pages");
    }
}

#[test]
fn healthy_and_empty_polls_stay_quiet() {
    let mut d = EccDetector::new();
    for k in 0..3_600 {
        let poll = p(k * 1_000)
            .with(Field::EccDbeVolTotal, 0.0)
            .with(Field::EccSbeVolTotal, 2.0)
            .with(Field::RetiredSbe, 1.0)
            .with(Field::RetiredDbe, 0.0)
            .with(Field::RetiredPending, 0.0);
        assert_eq!(obs(&mut d, poll), vec![]);
        assert_eq!(obs(&mut d, p(k * 1_000 + 500)), vec![]);
    }
}

// ---- row_remap ----

fn remap() -> RowRemapDetector {
    RowRemapDetector::new(RowRemapConfig::default())
}

#[test]
fn remap_pending_warns_and_clears_after_the_reset() {
    let mut d = remap();
    assert_eq!(obs(&mut d, p(0).with(Field::RowRemapPending, 0.0)), vec![]);
    let t = obs(&mut d, p(1_000).with(Field::RowRemapPending, 1.0));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::RowRemap,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 1_000,
            detected_ts_ms: 1_000,
            action: "reset the GPU when its jobs allow, to apply the pending row remap",
            evidence: "row remap pending (applied at the next GPU reset)".to_string(),
        }
    );
    assert_eq!(
        obs(&mut d, p(2_000).with(Field::RowRemapPending, 1.0)),
        vec![]
    );
    let t = obs(&mut d, p(3_000).with(Field::RowRemapPending, 0.0));
    assert_eq!(
        t,
        vec![Transition::Cleared(Clearing {
            key: EventKey::of(Kind::RowRemap),
            cleared_ts_ms: 3_000,
            evidence: "no condition holds: pending 0, new uncorrectable in window 0, \
                       new correctable in window 0"
                .to_string(),
        })]
    );
}

#[test]
fn remap_failure_is_critical() {
    let mut d = remap();
    assert_eq!(obs(&mut d, p(0).with(Field::RowRemapFailure, 0.0)), vec![]);
    let t = obs(&mut d, p(5_000).with(Field::RowRemapFailure, 1.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Critical);
    assert_eq!(f.onset_ts_ms, 5_000);
    assert_eq!(
        f.action,
        "drain the GPU and run field diagnostics (row remapping failed; RMA candidate)"
    );
}

#[test]
fn uncorrectable_row_growth_is_critical_for_an_hour() {
    let mut d = remap();
    let rows = |ts, unc, pending| {
        p(ts)
            .with(Field::UncorrectableRemappedRows, unc)
            .with(Field::RowRemapPending, pending)
    };
    assert_eq!(obs(&mut d, rows(0, 2.0, 0.0)), vec![], "baseline of 2 rows");
    let t = obs(&mut d, rows(30_000, 3.0, 1.0));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::RowRemap,
            severity: Severity::Critical,
            xid: None,
            onset_ts_ms: 30_000,
            detected_ts_ms: 30_000,
            action: "drain the GPU and reset it (uncorrectable memory errors); \
                     report hardware if it recurs",
            evidence: "1 new uncorrectable remapped rows within 1.0 h (now 3); \
                       row remap pending (applied at the next GPU reset)"
                .to_string(),
        }
    );
    // The reset applies the remap; the growth keeps the event for the window.
    assert_eq!(obs(&mut d, rows(600_000, 3.0, 0.0)), vec![]);
    // 5 min buckets: the row (bucket 0) leaves at bucket 12 = 3 600 000 ms.
    assert_eq!(obs(&mut d, rows(3_599_999, 3.0, 0.0)), vec![]);
    assert_eq!(
        cleared_at(&obs(&mut d, rows(3_600_000, 3.0, 0.0)), Kind::RowRemap),
        3_600_000
    );
}

#[test]
fn correctable_rows_three_in_ten_minutes_warn() {
    let mut d = remap();
    let rows = |ts, corr| p(ts).with(Field::CorrectableRemappedRows, corr);
    assert_eq!(obs(&mut d, rows(0, 0.0)), vec![]);
    assert_eq!(obs(&mut d, rows(30_000, 1.0)), vec![]);
    assert_eq!(obs(&mut d, rows(60_000, 2.0)), vec![]);
    let t = obs(&mut d, rows(90_000, 3.0));
    assert_eq!(
        opened(&t),
        &Finding {
            kind: Kind::RowRemap,
            severity: Severity::Warning,
            xid: None,
            onset_ts_ms: 30_000,
            detected_ts_ms: 90_000,
            action: "watch the GPU: memory is degrading (rows remapped repeatedly); \
                     schedule diagnostics",
            evidence: "3 new correctable remapped rows within 10.0 min (threshold 3, now 3)"
                .to_string(),
        }
    );
    // 50 s buckets: rows in buckets 0, 1, 1. Bucket 0 leaves at bucket 12
    // (600 000 ms), leaving 2 < 3.
    assert_eq!(obs(&mut d, rows(599_999, 3.0)), vec![]);
    assert_eq!(
        cleared_at(&obs(&mut d, rows(600_000, 3.0)), Kind::RowRemap),
        600_000
    );
}

#[test]
fn slow_correctable_growth_stays_quiet() {
    let mut d = remap();
    // One row every 5 min: a 10 min window never holds 3.
    for k in 0..=10 {
        let poll = p(k * 300_000).with(Field::CorrectableRemappedRows, k as f64);
        assert_eq!(obs(&mut d, poll), vec![], "row {k}");
    }
}

#[test]
fn row_counter_decrease_is_a_reset_not_growth() {
    let mut d = remap();
    let unc = |ts, v| p(ts).with(Field::UncorrectableRemappedRows, v);
    assert_eq!(obs(&mut d, unc(0, 5.0)), vec![]);
    assert_eq!(
        obs(&mut d, unc(1_000, 3.0)),
        vec![],
        "decrease: re-baseline"
    );
    assert_eq!(obs(&mut d, unc(2_000, 3.0)), vec![]);
    // Growth from the new baseline still counts.
    let t = obs(&mut d, unc(3_000, 4.0));
    assert_eq!(opened(&t).severity, Severity::Critical);
    assert_eq!(opened(&t).onset_ts_ms, 3_000);
}

#[test]
fn uncorrectable_rows_at_the_dcgm_limit_warn_without_growth() {
    let mut d = remap();
    let t = obs(&mut d, p(0).with(Field::UncorrectableRemappedRows, 512.0));
    let f = opened(&t);
    assert_eq!(f.severity, Severity::Warning);
    assert_eq!(
        f.action,
        "report hardware: uncorrectable remapped rows at DCGM's limit (GPU in a bad state)"
    );
    assert_eq!(
        f.evidence,
        "512 uncorrectable remapped rows (DCGM limit 512)"
    );
    let mut d = remap();
    assert_eq!(
        obs(&mut d, p(0).with(Field::UncorrectableRemappedRows, 511.0)),
        vec![]
    );
}

#[test]
fn healthy_row_remap_sequence_stays_quiet() {
    let mut d = remap();
    for k in 0..7_200 {
        let poll = p(k * 500)
            .with(Field::RowRemapPending, 0.0)
            .with(Field::RowRemapFailure, 0.0)
            .with(Field::UncorrectableRemappedRows, 1.0)
            .with(Field::CorrectableRemappedRows, 4.0);
        assert_eq!(obs(&mut d, poll), vec![]);
    }
}

#[test]
fn row_remap_config_validation() {
    assert_eq!(RowRemapConfig::default().validate(), Ok(()));
    let bad = RowRemapConfig {
        correctable_growth_rows: f64::NAN,
        ..RowRemapConfig::default()
    };
    assert_eq!(
        bad.validate().map_err(|e| e.field),
        Err("row_remap.correctable_growth_rows")
    );
}
