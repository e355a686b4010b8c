//! Scoring of `gpulse-bench health`: the engine's incidents against the
//! injected faults, per incident and per GPU (`shared/research/fleet-health.md`
//! §3.1). Pure functions over plain records, so that the rules can be tested
//! on hand-built cases.
//!
//! Rules (also printed with the results and written to the JSON):
//! - **Expected kinds.** Each fault kind has a fixed set of detector kinds
//!   that count as detecting it ([`EXPECTED`]).
//! - **Window.** A fault's window runs from its onset (the time of its start
//!   tick) to its end plus the grace window, both ends included; a fault with
//!   no end lasts to the end of the run.
//! - **Match.** An incident (one engine event, other kinds of its group joined
//!   to it) matches a fault when it is on the fault's GPU and one of its
//!   signals (the kind that opened it, or a kind that joined it later, each at
//!   the virtual time the engine reported it) is of an expected kind and falls
//!   in the window. The fault is detected by its earliest matching signal;
//!   further incidents matching it are duplicates (alert noise, not false
//!   positives).
//! - **Exclusions**, counted, not scored: *not shown*, a fault the metrics
//!   never showed (`shown_ticks` 0), or for the kinds that need time to see
//!   (thermal throttle, straggler, clock degraded) showed for less than
//!   [`SLOW_KINDS_MIN_SHOWN_MS`]; *masked*, an undetected fault whose GPU
//!   already had an open incident with an expected kind at its onset (one
//!   event per GPU and kind: the detector cannot open it again). Incidents
//!   matching only excluded faults are neither true nor false positives.
//! - **False positive:** an incident matching no fault at all.
//! - **Time to detect:** detection time minus the time of the fault's first
//!   shown tick (its onset when it has none).

use std::collections::HashMap;

use health::{Kind, Severity};
use serde::Serialize;

/// Least time the metrics must show a thermal throttle, straggler or
/// degraded clock for it to be scored: their detectors need a persistence
/// of 5-10 s (docs/HEALTH.md), and a fault shown for less is a blip.
pub(crate) const SLOW_KINDS_MIN_SHOWN_MS: i64 = 30_000;

/// Fault kinds scored against [`SLOW_KINDS_MIN_SHOWN_MS`].
const SLOW_KINDS: [&str; 3] = ["thermal_throttle", "straggler", "clock_degraded"];

/// A detector kind that counts as detecting a fault; for XIDs, the number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Expect {
    pub(crate) kind: Kind,
    pub(crate) xid: Option<u32>,
}

impl Expect {
    const fn of(kind: Kind) -> Self {
        Expect { kind, xid: None }
    }

    const fn xid(xid: u32) -> Self {
        Expect {
            kind: Kind::Xid,
            xid: Some(xid),
        }
    }

    fn matches(self, kind: Kind, xid: Option<u32>) -> bool {
        self.kind == kind && (self.xid.is_none() || self.xid == xid)
    }

    /// `xid 79`, `ecc`, ...
    pub(crate) fn name(self) -> String {
        match self.xid {
            Some(x) => format!("{} {x}", self.kind),
            None => self.kind.to_string(),
        }
    }
}

/// Name of the harness's own fault: a host's agent stops delivering for a
/// while, then its spool delivers everything at once.
pub(crate) const AGENT_SILENT: &str = "agent_silent";

/// Which detector kinds detect which fault kind (fault kinds by their
/// ground-truth names), in the order of the output.
pub(crate) const EXPECTED: &[(&str, &[Expect])] = &[
    ("thermal_throttle", &[Expect::of(Kind::ThermalThrottle)]),
    ("straggler", &[Expect::of(Kind::Straggler)]),
    ("clock_degraded", &[Expect::of(Kind::ClockDegraded)]),
    (
        "xid79_fallen_off_bus",
        &[Expect::xid(79), Expect::of(Kind::TelemetryGap)],
    ),
    (
        "xid48_double_bit_ecc",
        &[
            Expect::xid(48),
            Expect::of(Kind::Ecc),
            Expect::of(Kind::RowRemap),
        ],
    ),
    (
        "row_remap_growth",
        &[Expect::of(Kind::RowRemap), Expect::of(Kind::Ecc)],
    ),
    ("zombie", &[Expect::of(Kind::Zombie)]),
    ("driver_drift", &[Expect::of(Kind::Drift)]),
    (AGENT_SILENT, &[Expect::of(Kind::TelemetryGap)]),
];

/// The expected detector kinds of a fault kind (empty for an unknown kind:
/// then nothing can detect it and it is reported as missed).
pub(crate) fn expected(kind: &str) -> &'static [Expect] {
    EXPECTED
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or(&[], |(_, e)| e)
}

/// One injected fault (ground truth), on the virtual clock.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TruthFault {
    /// The GPU, as a fleet-wide index (host × 8 + GPU).
    pub(crate) gpu: u32,
    /// Ground-truth name of the kind (`FaultKind::as_str`, or [`AGENT_SILENT`]).
    pub(crate) kind: &'static str,
    /// Time of the first affected tick.
    pub(crate) onset_ms: i64,
    /// Time of the first tick no longer affected; `None`: to the end of the run.
    pub(crate) end_ms: Option<i64>,
    /// Time of the first tick the metrics showed it.
    pub(crate) shown_ms: Option<i64>,
    /// How long the metrics showed it (shown ticks × interval).
    pub(crate) shown_for_ms: i64,
    /// The simulator's variant and magnitude of the fault, where it has them.
    pub(crate) variant: Option<&'static str>,
    pub(crate) magnitude: Option<f64>,
}

impl TruthFault {
    /// Whether the fault is scored (see the module docs): shown at all, and
    /// for the slow kinds long enough.
    pub(crate) fn shown_enough(&self) -> bool {
        if self.shown_ms.is_none() || self.shown_for_ms <= 0 {
            return false;
        }
        !SLOW_KINDS.contains(&self.kind) || self.shown_for_ms >= SLOW_KINDS_MIN_SHOWN_MS
    }
}

/// A detector kind as it appeared in an incident: the kind that opened it,
/// or one that joined it, at the virtual time the engine reported it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Signal {
    pub(crate) kind: Kind,
    pub(crate) xid: Option<u32>,
    pub(crate) at_ms: i64,
}

/// One engine event (incident) as the harness saw it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Incident {
    /// Fleet-wide GPU index.
    pub(crate) gpu: u32,
    /// The kind that opened it (the event's `kind`).
    pub(crate) kind: Kind,
    pub(crate) xid: Option<u32>,
    /// The highest severity it reached.
    pub(crate) severity: Severity,
    /// When it cleared (virtual time); `None` if open at the end of the run.
    pub(crate) cleared_ms: Option<i64>,
    /// The opening signal first, then those that joined, in time order.
    pub(crate) signals: Vec<Signal>,
    /// The evidence at opening (shortened), for the examples.
    pub(crate) evidence: String,
}

impl Incident {
    pub(crate) fn opened_ms(&self) -> i64 {
        self.signals.first().map_or(i64::MIN, |s| s.at_ms)
    }

    /// The kinds this incident carried, once each.
    fn carries(&self, e: &[Expect]) -> bool {
        self.signals
            .iter()
            .any(|s| e.iter().any(|x| x.matches(s.kind, s.xid)))
    }

    /// `xid 79` for XID events, else the kind.
    pub(crate) fn kind_name(&self) -> String {
        match self.xid {
            Some(x) if self.kind == Kind::Xid => format!("xid {x}"),
            _ => self.kind.to_string(),
        }
    }
}

/// What became of a fault.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum FaultOutcome {
    /// Detected at `at_ms`; `ttd_ms` from its first shown tick; `duplicates`
    /// further incidents matched it.
    Detected {
        at_ms: i64,
        ttd_ms: i64,
        duplicates: u32,
    },
    Missed,
    NotShown,
    Masked,
}

/// What became of an incident.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum IncidentOutcome {
    /// It matched at least one scored fault.
    Matched,
    /// It matched only faults that are not scored.
    OnExcluded,
    /// It matched no fault.
    False,
}

/// The outcome of every fault and every incident, in input order.
#[derive(Debug, Clone)]
pub(crate) struct Scored {
    pub(crate) faults: Vec<FaultOutcome>,
    pub(crate) incidents: Vec<IncidentOutcome>,
    /// For each incident, the kinds of the scored faults it matched.
    pub(crate) matched_kinds: Vec<Vec<&'static str>>,
}

/// The earliest signal of `inc` that detects `f` within `[from, to]`.
fn earliest_match(inc: &Incident, f: &TruthFault, from: i64, to: i64) -> Option<i64> {
    let e = expected(f.kind);
    inc.signals
        .iter()
        .filter(|s| s.at_ms >= from && s.at_ms <= to && e.iter().any(|x| x.matches(s.kind, s.xid)))
        .map(|s| s.at_ms)
        .min()
}

/// Scores `incidents` against `faults` (see the module docs). `run_end_ms`
/// ends the faults that have no end; `grace_ms` follows each fault's end.
pub(crate) fn score(
    faults: &[TruthFault],
    incidents: &[Incident],
    grace_ms: i64,
    run_end_ms: i64,
) -> Scored {
    let mut by_gpu: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, inc) in incidents.iter().enumerate() {
        by_gpu.entry(inc.gpu).or_default().push(i);
    }
    let mut inc_out = vec![IncidentOutcome::False; incidents.len()];
    let mut matched_kinds: Vec<Vec<&'static str>> = vec![Vec::new(); incidents.len()];
    let mut fault_out = Vec::with_capacity(faults.len());
    for f in faults {
        let from = f.onset_ms;
        let to = f
            .end_ms
            .unwrap_or(run_end_ms)
            .max(from)
            .saturating_add(grace_ms);
        let mine = by_gpu.get(&f.gpu).map_or(&[][..], |v| v.as_slice());
        let scored = f.shown_enough();
        let mut first: Option<i64> = None;
        let mut matching = 0u32;
        for &i in mine {
            let Some(at) = earliest_match(&incidents[i], f, from, to) else {
                continue;
            };
            matching += 1;
            first = Some(first.map_or(at, |t: i64| t.min(at)));
            if scored {
                inc_out[i] = IncidentOutcome::Matched;
                if !matched_kinds[i].contains(&f.kind) {
                    matched_kinds[i].push(f.kind);
                }
            } else if inc_out[i] == IncidentOutcome::False {
                inc_out[i] = IncidentOutcome::OnExcluded;
            }
        }
        let outcome = if !scored {
            FaultOutcome::NotShown
        } else if let Some(at) = first {
            FaultOutcome::Detected {
                at_ms: at,
                ttd_ms: at - f.shown_ms.unwrap_or(f.onset_ms),
                duplicates: matching - 1,
            }
        } else {
            // Already alerting with an expected kind when the fault began?
            let e = expected(f.kind);
            let masked = mine.iter().any(|&i| {
                let inc = &incidents[i];
                inc.opened_ms() < from
                    && inc.cleared_ms.is_none_or(|c| c >= from)
                    && inc
                        .signals
                        .iter()
                        .any(|s| s.at_ms < from && e.iter().any(|x| x.matches(s.kind, s.xid)))
            });
            if masked {
                FaultOutcome::Masked
            } else {
                FaultOutcome::Missed
            }
        };
        fault_out.push(outcome);
    }
    // Incidents that masked a fault are not false positives of it: they were
    // counted against whatever they matched (or not) on their own.
    Scored {
        faults: fault_out,
        incidents: inc_out,
        matched_kinds,
    }
}

/// p50, p95 and max of a distribution (nearest rank).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Spread {
    pub(crate) p50: f64,
    pub(crate) p95: f64,
    pub(crate) max: f64,
}

impl Spread {
    pub(crate) fn of(values: &mut [f64]) -> Option<Spread> {
        if values.is_empty() {
            return None;
        }
        values.sort_by(f64::total_cmp);
        let p = |q: f64| crate::queries::percentile(values, q);
        Some(Spread {
            p50: p(0.5),
            p95: p(0.95),
            max: values[values.len() - 1],
        })
    }
}

/// Wilson score interval (95 %) of `k` successes in `n`.
pub(crate) fn wilson(k: u64, n: u64) -> Option<[f64; 2]> {
    if n == 0 {
        return None;
    }
    let z = 1.959_963_984_540_054_f64;
    let (n, p) = (n as f64, k as f64 / n as f64);
    let d = 1.0 + z * z / n;
    let c = (p + z * z / (2.0 * n)) / d;
    let h = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / d;
    Some([(c - h).max(0.0), (c + h).min(1.0)])
}

/// One row per fault kind: recall, precision and time to detect.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct FaultKindRow {
    pub(crate) kind: &'static str,
    /// Detector kinds that count as detecting it.
    pub(crate) expected: Vec<String>,
    pub(crate) injected: u64,
    /// Scored: shown, and not masked.
    pub(crate) scored: u64,
    pub(crate) not_shown: u64,
    pub(crate) masked: u64,
    pub(crate) detected: u64,
    pub(crate) missed: u64,
    pub(crate) recall: Option<f64>,
    pub(crate) recall_ci95: Option<[f64; 2]>,
    /// Incidents that matched a scored fault of this kind.
    pub(crate) matched_incidents: u64,
    /// Incidents matching no fault that carry one of the expected kinds.
    pub(crate) false_incidents: u64,
    pub(crate) precision: Option<f64>,
    pub(crate) duplicates: u64,
    /// Time to detect, seconds and polls.
    pub(crate) ttd_s: Option<Spread>,
    pub(crate) ttd_polls: Option<Spread>,
    /// Scored and detected faults per simulator variant, where it names them.
    pub(crate) by_variant: Vec<VariantRow>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct VariantRow {
    pub(crate) variant: String,
    pub(crate) scored: u64,
    pub(crate) detected: u64,
}

/// One row per detector kind (the kind that opened the incident).
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct DetectorKindRow {
    pub(crate) kind: String,
    pub(crate) incidents: u64,
    pub(crate) critical: u64,
    pub(crate) matched: u64,
    pub(crate) on_excluded: u64,
    pub(crate) false_positives: u64,
    pub(crate) precision: Option<f64>,
}

fn ratio(k: u64, n: u64) -> Option<f64> {
    (n > 0).then(|| k as f64 / n as f64)
}

/// The fault-kind table: every kind of [`EXPECTED`], then any other kind the
/// ground truth names.
pub(crate) fn fault_rows(
    faults: &[TruthFault],
    incidents: &[Incident],
    s: &Scored,
    interval_ms: i64,
) -> Vec<FaultKindRow> {
    let mut kinds: Vec<&'static str> = EXPECTED.iter().map(|(k, _)| *k).collect();
    for f in faults {
        if !kinds.contains(&f.kind) {
            kinds.push(f.kind);
        }
    }
    kinds
        .into_iter()
        .map(|kind| {
            let mut row = FaultKindRow {
                kind,
                expected: expected(kind).iter().map(|e| e.name()).collect(),
                injected: 0,
                scored: 0,
                not_shown: 0,
                masked: 0,
                detected: 0,
                missed: 0,
                recall: None,
                recall_ci95: None,
                matched_incidents: 0,
                false_incidents: 0,
                precision: None,
                duplicates: 0,
                ttd_s: None,
                ttd_polls: None,
                by_variant: Vec::new(),
            };
            let mut ttd = Vec::new();
            for (f, o) in faults.iter().zip(&s.faults) {
                if f.kind != kind {
                    continue;
                }
                row.injected += 1;
                let detected = match *o {
                    FaultOutcome::Detected {
                        ttd_ms, duplicates, ..
                    } => {
                        row.scored += 1;
                        row.detected += 1;
                        row.duplicates += u64::from(duplicates);
                        ttd.push(ttd_ms as f64 / 1000.0);
                        true
                    }
                    FaultOutcome::Missed => {
                        row.scored += 1;
                        row.missed += 1;
                        false
                    }
                    FaultOutcome::NotShown => {
                        row.not_shown += 1;
                        continue;
                    }
                    FaultOutcome::Masked => {
                        row.masked += 1;
                        continue;
                    }
                };
                if let Some(v) = f.variant {
                    let i = match row.by_variant.iter().position(|r| r.variant == v) {
                        Some(i) => i,
                        None => {
                            row.by_variant.push(VariantRow {
                                variant: v.to_string(),
                                scored: 0,
                                detected: 0,
                            });
                            row.by_variant.len() - 1
                        }
                    };
                    row.by_variant[i].scored += 1;
                    row.by_variant[i].detected += u64::from(detected);
                }
            }
            row.recall = ratio(row.detected, row.scored);
            row.recall_ci95 = wilson(row.detected, row.scored);
            let e = expected(kind);
            for ((inc, o), mk) in incidents.iter().zip(&s.incidents).zip(&s.matched_kinds) {
                match o {
                    IncidentOutcome::Matched if mk.contains(&kind) => row.matched_incidents += 1,
                    IncidentOutcome::False if inc.carries(e) => row.false_incidents += 1,
                    _ => {}
                }
            }
            row.precision = ratio(
                row.matched_incidents,
                row.matched_incidents + row.false_incidents,
            );
            let mut polls: Vec<f64> = ttd
                .iter()
                .map(|s| s * 1000.0 / interval_ms.max(1) as f64)
                .collect();
            row.ttd_s = Spread::of(&mut ttd);
            row.ttd_polls = Spread::of(&mut polls);
            row
        })
        .collect()
}

/// The detector-kind table (by the kind that opened each incident; XIDs by
/// number), in [`Kind::ALL`] order.
pub(crate) fn detector_rows(incidents: &[Incident], s: &Scored) -> Vec<DetectorKindRow> {
    let mut rows: Vec<DetectorKindRow> = Vec::new();
    for (inc, o) in incidents.iter().zip(&s.incidents) {
        let name = inc.kind_name();
        let i = match rows.iter().position(|r| r.kind == name) {
            Some(i) => i,
            None => {
                rows.push(DetectorKindRow {
                    kind: name,
                    ..Default::default()
                });
                rows.len() - 1
            }
        };
        let r = &mut rows[i];
        r.incidents += 1;
        r.critical += u64::from(inc.severity == Severity::Critical);
        match o {
            IncidentOutcome::Matched => r.matched += 1,
            IncidentOutcome::OnExcluded => r.on_excluded += 1,
            IncidentOutcome::False => r.false_positives += 1,
        }
    }
    for r in &mut rows {
        r.precision = ratio(r.matched, r.matched + r.false_positives);
    }
    let order = |name: &str| {
        let kind = name.split(' ').next().unwrap_or(name);
        let k = Kind::from_name(kind).map_or(usize::MAX, |k| k as usize);
        let xid: u32 = name
            .split(' ')
            .nth(1)
            .and_then(|x| x.parse().ok())
            .unwrap_or(0);
        (k, xid)
    };
    rows.sort_by_key(|r| order(&r.kind));
    rows
}

/// The kinds that joined an incident, from its evidence past byte `from`:
/// the engine appends `; with <kind>: <evidence>` for each (`XID <n> ...`
/// for an XID). Returns the new scan position.
pub(crate) fn joined_kinds(
    evidence: &str,
    from: usize,
    out: &mut Vec<(Kind, Option<u32>)>,
) -> usize {
    const MARK: &str = "; with ";
    let from = if from <= evidence.len() && evidence.is_char_boundary(from) {
        from
    } else {
        0
    };
    let mut rest = &evidence[from..];
    while let Some(p) = rest.find(MARK) {
        rest = &rest[p + MARK.len()..];
        let Some(colon) = rest.find(": ") else {
            break;
        };
        if let Some(kind) = Kind::from_name(&rest[..colon]) {
            let after = &rest[colon + 2..];
            let xid = if kind == Kind::Xid {
                after
                    .strip_prefix("XID ")
                    .map(|s| s.split(|c: char| !c.is_ascii_digit()).next().unwrap_or(""))
                    .and_then(|d| d.parse().ok())
            } else {
                None
            };
            out.push((kind, xid));
        }
    }
    evidence.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    fn fault(gpu: u32, kind: &'static str, onset: i64, end: Option<i64>) -> TruthFault {
        TruthFault {
            gpu,
            kind,
            onset_ms: onset,
            end_ms: end,
            shown_ms: Some(onset),
            shown_for_ms: end.map_or(3_600_000, |e| e - onset),
            variant: None,
            magnitude: None,
        }
    }

    fn incident(gpu: u32, kind: Kind, xid: Option<u32>, at: i64) -> Incident {
        Incident {
            gpu,
            kind,
            xid,
            severity: Severity::Critical,
            cleared_ms: None,
            signals: vec![Signal {
                kind,
                xid,
                at_ms: at,
            }],
            evidence: String::new(),
        }
    }

    #[test]
    fn four_faults_three_detected_one_false_positive() {
        // Four faults on four GPUs; incidents on three of them in their
        // windows and one on a fifth, healthy GPU.
        let faults = vec![
            fault(0, "xid79_fallen_off_bus", 10 * MIN, None),
            fault(1, "xid48_double_bit_ecc", 20 * MIN, None),
            fault(2, "thermal_throttle", 30 * MIN, Some(35 * MIN)),
            fault(3, "zombie", 40 * MIN, Some(45 * MIN)),
        ];
        let incidents = vec![
            incident(0, Kind::Xid, Some(79), 10 * MIN),
            incident(1, Kind::Ecc, None, 20 * MIN + 2_000),
            incident(2, Kind::ThermalThrottle, None, 30 * MIN + 12_000),
            incident(9, Kind::Zombie, None, 41 * MIN),
        ];
        let s = score(&faults, &incidents, 5 * MIN, 60 * MIN);
        assert_eq!(
            s.faults,
            vec![
                FaultOutcome::Detected {
                    at_ms: 10 * MIN,
                    ttd_ms: 0,
                    duplicates: 0
                },
                FaultOutcome::Detected {
                    at_ms: 20 * MIN + 2_000,
                    ttd_ms: 2_000,
                    duplicates: 0
                },
                FaultOutcome::Detected {
                    at_ms: 30 * MIN + 12_000,
                    ttd_ms: 12_000,
                    duplicates: 0
                },
                FaultOutcome::Missed,
            ]
        );
        use IncidentOutcome::*;
        assert_eq!(s.incidents, vec![Matched, Matched, Matched, False]);
        let matched = s.incidents.iter().filter(|o| **o == Matched).count() as f64;
        let detected = s
            .faults
            .iter()
            .filter(|o| matches!(o, FaultOutcome::Detected { .. }))
            .count() as f64;
        assert_eq!(matched / incidents.len() as f64, 0.75, "precision");
        assert_eq!(detected / faults.len() as f64, 0.75, "recall");

        let rows = fault_rows(&faults, &incidents, &s, 1000);
        let row = |k: &str| rows.iter().find(|r| r.kind == k).unwrap();
        assert_eq!(row("zombie").recall, Some(0.0));
        assert_eq!(row("zombie").false_incidents, 1);
        assert_eq!(row("zombie").precision, Some(0.0));
        assert_eq!(row("thermal_throttle").recall, Some(1.0));
        assert_eq!(row("thermal_throttle").precision, Some(1.0));
        let t = row("thermal_throttle").ttd_s.unwrap();
        assert_eq!((t.p50, t.p95, t.max), (12.0, 12.0, 12.0));
        assert_eq!(row("thermal_throttle").ttd_polls.unwrap().max, 12.0);
        assert_eq!(row("straggler").injected, 0);
        assert_eq!(row("straggler").recall, None);

        let det = detector_rows(&incidents, &s);
        let names: Vec<&str> = det.iter().map(|r| r.kind.as_str()).collect();
        assert_eq!(names, ["xid 79", "ecc", "thermal_throttle", "zombie"]);
        assert_eq!(det[3].false_positives, 1);
        assert_eq!(det[3].precision, Some(0.0));
        assert_eq!(det[0].precision, Some(1.0));
    }

    #[test]
    fn ttd_percentiles_over_several_faults() {
        // Five thermal faults detected after 2, 4, 6, 8 and 30 s, at 1 Hz:
        // p50 6 s, p95 and max 30 s (nearest rank), 30 polls.
        let mut faults = Vec::new();
        let mut incidents = Vec::new();
        for (g, d) in [2, 4, 6, 8, 30].into_iter().enumerate() {
            faults.push(fault(g as u32, "thermal_throttle", MIN, Some(10 * MIN)));
            incidents.push(incident(
                g as u32,
                Kind::ThermalThrottle,
                None,
                MIN + d * 1000,
            ));
        }
        let s = score(&faults, &incidents, 0, 60 * MIN);
        let rows = fault_rows(&faults, &incidents, &s, 1000);
        let r = rows.iter().find(|r| r.kind == "thermal_throttle").unwrap();
        let t = r.ttd_s.unwrap();
        assert_eq!((t.p50, t.p95, t.max), (6.0, 30.0, 30.0));
        assert_eq!(r.ttd_polls.unwrap().p50, 6.0);
        // At a 2 s interval the same times are half as many polls.
        let rows = fault_rows(&faults, &incidents, &s, 2000);
        let r = rows.iter().find(|r| r.kind == "thermal_throttle").unwrap();
        assert_eq!(r.ttd_polls.unwrap().p50, 3.0);
    }

    #[test]
    fn grace_window_edge_is_inclusive() {
        let grace = 5 * MIN;
        let faults = vec![fault(0, "thermal_throttle", MIN, Some(5 * MIN))];
        let at = |t| vec![incident(0, Kind::ThermalThrottle, None, t)];
        let edge = 5 * MIN + grace;
        let s = score(&faults, &at(edge), grace, 60 * MIN);
        assert!(matches!(s.faults[0], FaultOutcome::Detected { .. }));
        assert_eq!(s.incidents, vec![IncidentOutcome::Matched]);
        let s = score(&faults, &at(edge + 1), grace, 60 * MIN);
        assert_eq!(s.faults[0], FaultOutcome::Missed);
        assert_eq!(s.incidents, vec![IncidentOutcome::False]);
        // Before the onset does not match either: an incident that cleared
        // before the onset leaves the fault missed; one still open masks it.
        let mut before = at(MIN - 1);
        before[0].cleared_ms = Some(MIN - 1);
        let s = score(&faults, &before, grace, 60 * MIN);
        assert_eq!(s.faults[0], FaultOutcome::Missed);
        assert_eq!(s.incidents, vec![IncidentOutcome::False]);
        let s = score(&faults, &at(MIN - 1), grace, 60 * MIN);
        assert_eq!(s.faults[0], FaultOutcome::Masked);
        // A fault without an end lasts to the end of the run.
        let faults = vec![fault(0, "xid48_double_bit_ecc", MIN, None)];
        let s = score(
            &faults,
            &[incident(0, Kind::RowRemap, None, 59 * MIN)],
            0,
            60 * MIN,
        );
        assert!(matches!(s.faults[0], FaultOutcome::Detected { .. }));
    }

    #[test]
    fn wrong_gpu_wrong_kind_or_wrong_xid_does_not_match() {
        let faults = vec![fault(0, "xid79_fallen_off_bus", MIN, None)];
        for inc in [
            incident(1, Kind::Xid, Some(79), MIN),
            incident(0, Kind::Xid, Some(48), MIN),
            incident(0, Kind::ThermalThrottle, None, MIN),
        ] {
            let s = score(&faults, &[inc], 0, 60 * MIN);
            assert_eq!(s.faults[0], FaultOutcome::Missed);
            assert_eq!(s.incidents[0], IncidentOutcome::False);
        }
        // The other expected kind (a GPU gone silent) does match.
        let s = score(
            &faults,
            &[incident(0, Kind::TelemetryGap, None, MIN + 30_000)],
            0,
            60 * MIN,
        );
        assert!(matches!(s.faults[0], FaultOutcome::Detected { .. }));
    }

    #[test]
    fn a_kind_that_joined_an_incident_later_matches_at_its_own_time() {
        // A thermal incident opened before the straggler fault; straggler
        // joined it 8 s after the straggler's onset.
        let mut inc = incident(0, Kind::ThermalThrottle, None, MIN);
        inc.signals.push(Signal {
            kind: Kind::Straggler,
            xid: None,
            at_ms: 3 * MIN + 8_000,
        });
        let faults = vec![
            fault(0, "thermal_throttle", MIN - 10_000, Some(2 * MIN)),
            fault(0, "straggler", 3 * MIN, Some(10 * MIN)),
        ];
        let s = score(&faults, &[inc], 0, 60 * MIN);
        assert!(matches!(
            s.faults[0],
            FaultOutcome::Detected { ttd_ms: 10_000, .. }
        ));
        assert!(matches!(
            s.faults[1],
            FaultOutcome::Detected { ttd_ms: 8_000, .. }
        ));
        assert_eq!(
            s.matched_kinds[0],
            vec!["thermal_throttle", "straggler"],
            "one incident, two faults"
        );
    }

    #[test]
    fn exclusion_rule_not_shown_and_short_slow_faults() {
        let mut never = fault(0, "xid48_double_bit_ecc", MIN, None);
        never.shown_ms = None;
        never.shown_for_ms = 0;
        // A straggler whose GPU was busy for only 29 s of it: not scored;
        // 30 s: scored.
        let mut short = fault(1, "straggler", MIN, Some(20 * MIN));
        short.shown_for_ms = 29_000;
        let mut enough = fault(2, "straggler", MIN, Some(20 * MIN));
        enough.shown_for_ms = 30_000;
        // An XID shown for one tick is scored: the rule is for the slow kinds.
        let mut one_tick = fault(3, "xid79_fallen_off_bus", MIN, None);
        one_tick.shown_for_ms = 1_000;
        assert!(!never.shown_enough());
        assert!(!short.shown_enough());
        assert!(enough.shown_enough());
        assert!(one_tick.shown_enough());

        let faults = vec![never, short, enough, one_tick];
        // An incident on the excluded straggler is not a false positive.
        let incidents = vec![incident(1, Kind::Straggler, None, MIN + 20_000)];
        let s = score(&faults, &incidents, 0, 60 * MIN);
        assert_eq!(s.faults[0], FaultOutcome::NotShown);
        assert_eq!(s.faults[1], FaultOutcome::NotShown);
        assert_eq!(s.faults[2], FaultOutcome::Missed);
        assert_eq!(s.incidents, vec![IncidentOutcome::OnExcluded]);
        let rows = fault_rows(&faults, &incidents, &s, 1000);
        let st = rows.iter().find(|r| r.kind == "straggler").unwrap();
        assert_eq!((st.injected, st.not_shown, st.scored), (2, 1, 1));
        assert_eq!(st.recall, Some(0.0));
        assert_eq!(st.precision, None, "no incident counts for or against it");
        let det = detector_rows(&incidents, &s);
        assert_eq!((det[0].on_excluded, det[0].false_positives), (1, 0));
    }

    #[test]
    fn duplicates_and_masking() {
        // Two incidents in one fault's window: detected once, one duplicate,
        // neither a false positive.
        let faults = vec![fault(0, "thermal_throttle", MIN, Some(10 * MIN))];
        let incidents = vec![
            incident(0, Kind::ThermalThrottle, None, MIN + 11_000),
            incident(0, Kind::ThermalThrottle, None, 5 * MIN),
        ];
        let s = score(&faults, &incidents, 0, 60 * MIN);
        assert_eq!(
            s.faults[0],
            FaultOutcome::Detected {
                at_ms: MIN + 11_000,
                ttd_ms: 11_000,
                duplicates: 1
            }
        );
        assert_eq!(s.incidents, vec![IncidentOutcome::Matched; 2]);

        // A second thermal fault while the first's incident is still open
        // (its decay tail) cannot open a new event: masked, not missed.
        let faults = vec![
            fault(0, "thermal_throttle", MIN, Some(3 * MIN)),
            fault(0, "thermal_throttle", 3 * MIN + 10_000, Some(6 * MIN)),
        ];
        let mut inc = incident(0, Kind::ThermalThrottle, None, MIN + 11_000);
        inc.cleared_ms = Some(7 * MIN);
        let s = score(&faults, &[inc.clone()], 0, 60 * MIN);
        assert!(matches!(s.faults[0], FaultOutcome::Detected { .. }));
        assert_eq!(s.faults[1], FaultOutcome::Masked);
        // Once that incident cleared before the second onset, it is missed.
        inc.cleared_ms = Some(3 * MIN);
        let s = score(&faults, &[inc], 0, 60 * MIN);
        assert_eq!(s.faults[1], FaultOutcome::Missed);
    }

    #[test]
    fn joined_kinds_are_read_from_the_evidence() {
        let ev = "XID 48 DBE (catalog RESET_GPU, FATAL); first gauge value seen; \
                  with ecc: volatile DBE 1; with row_remap: uncorrectable rows 0 -> 1; \
                  then XID 48 burst 2; with xid: XID 64 ROW_REMAP_FAILURE";
        let mut out = Vec::new();
        let end = joined_kinds(ev, 0, &mut out);
        assert_eq!(end, ev.len());
        assert_eq!(
            out,
            vec![
                (Kind::Ecc, None),
                (Kind::RowRemap, None),
                (Kind::Xid, Some(64))
            ]
        );
        // From a later position only what was appended since.
        out.clear();
        let first = ev.find("; with row_remap").unwrap();
        joined_kinds(ev, first, &mut out);
        assert_eq!(out.len(), 2);
        // Text that merely contains "with" is not a kind.
        out.clear();
        joined_kinds("cooling; with luck: fine", 0, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn wilson_interval() {
        let [lo, hi] = wilson(95, 100).unwrap();
        assert!(
            (lo - 0.8882).abs() < 1e-3 && (hi - 0.9785).abs() < 1e-3,
            "{lo} {hi}"
        );
        assert_eq!(wilson(0, 0), None);
        let [lo, hi] = wilson(3, 3).unwrap();
        assert!(lo > 0.43 && lo < 0.44 && hi > 0.9999);
    }
}
