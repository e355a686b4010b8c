//! The engine: turns a stream of samples (which GPU, which field, when,
//! what value) into polls, feeds each poll to its GPU's detectors
//! ([`GpuHealth`]), and keeps the book of events those detectors open,
//! escalate and clear.
//!
//! Samples of one poll share a timestamp, and they arrive field by field,
//! in batches that may hold several polls or part of one. A GPU's poll is
//! complete when a sample with a later timestamp arrives for that GPU, or
//! when the caller says no more can come ([`Engine::finish_before`],
//! [`Engine::finish_all`]). A sample older than the GPU's poll in progress
//! is late (data from a spool, a re-send) and is counted, not used: the
//! detectors see each GPU's polls once, in time order.
//!
//! One failure often fires several detectors: an XID 48 (double-bit ECC)
//! also shows as volatile DBEs and a new uncorrectable remapped row. Events
//! of one GPU whose kinds belong to one [`Incident`] group are one event
//! (one incident): the first opens it and names its kind, the others join
//! it (their evidence appended, the severity the highest), and it clears
//! when the last of them has cleared.
//!
//! Events are kept in memory: every open one, and the newest
//! [`Engine::MAX_CLOSED`] closed ones. Whoever persists them
//! ([`Engine::restore`] at start) gets every change as a [`Change`].

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;

use crate::peers::{PeerChange, PeerSignals, Scratch};
use crate::{
    ConfigError, Detector, EventKey, Field, GpuHealth, GpuId, HealthConfig, Inventory, Kind, Poll,
    Severity, Transition,
};

/// A GPU's place in the engine, from [`Engine::gpu`].
pub type GpuSlot = u32;

/// One event: a row of the `health_events` table.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Unique within the engine's book, increasing with detection.
    pub id: u64,
    pub gpu: GpuId,
    pub kind: Kind,
    pub severity: Severity,
    /// The XID number, for XID events.
    pub xid: Option<u32>,
    /// When the evidence starts (sample time, ms).
    pub onset_ts_ms: i64,
    /// Sample time of the poll at which the rule fired.
    pub detected_ts_ms: i64,
    /// Sample time at which it cleared; `None` while active.
    pub cleared_ts_ms: Option<i64>,
    /// What an operator should do (the latest, after escalations).
    pub action: String,
    /// The values that fired it, and what changed since, human readable.
    pub evidence: String,
}

impl Event {
    /// True while the event has not cleared.
    pub fn is_active(&self) -> bool {
        self.cleared_ts_ms.is_none()
    }

    fn key(&self) -> EventKey {
        EventKey {
            kind: self.kind,
            xid: self.xid,
        }
    }
}

/// What happened to an event; the event as it is after the change.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    Opened(Event),
    Escalated(Event),
    Cleared(Event),
}

impl Change {
    /// The event after the change.
    pub fn event(&self) -> &Event {
        match self {
            Change::Opened(e) | Change::Escalated(e) | Change::Cleared(e) => e,
        }
    }
}

/// A GPU's health at a glance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuState {
    /// Polls arrive and no event is open.
    Ok,
    /// The worst open event is a warning (or info).
    Warning,
    /// A critical event is open.
    Critical,
    /// No poll within the staleness limit (see [`Engine::states`]).
    Unknown,
}

impl GpuState {
    /// `ok`, `warning`, `critical` or `unknown`.
    pub const fn as_str(self) -> &'static str {
        match self {
            GpuState::Ok => "ok",
            GpuState::Warning => "warning",
            GpuState::Critical => "critical",
            GpuState::Unknown => "unknown",
        }
    }

    /// The state [`GpuState::as_str`] names.
    pub fn from_name(name: &str) -> Option<GpuState> {
        [
            GpuState::Ok,
            GpuState::Warning,
            GpuState::Critical,
            GpuState::Unknown,
        ]
        .into_iter()
        .find(|s| s.as_str() == name)
    }
}

/// The groups of kinds that one failure fires together, merged into one
/// incident per GPU (research §3.1: score per incident).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Incident {
    /// Memory: ECC-related XIDs (48 double-bit error, 63/64 row-remap
    /// recording and failure, 92 high single-bit rate, 94/95 contained and
    /// uncontained ECC), `ecc`, `row_remap`.
    Memory,
    /// The GPU is lost: XID 79 (fallen off the bus), and the silence or
    /// frozen readings that follow (`telemetry_gap`, `zombie`).
    Lost,
    /// Slowed down: `thermal_throttle`, `power_throttle`, what a throttle
    /// causes (`clock_degraded`, `straggler`), and what causes a thermal
    /// one (`anomaly`: hot for its load, a cooling failure).
    Slowdown,
}

impl Incident {
    /// The group of an event, `None` for one that stands alone (other XIDs,
    /// drift).
    pub fn of(key: EventKey) -> Option<Incident> {
        match (key.kind, key.xid) {
            (Kind::Xid, Some(48 | 63 | 64 | 92 | 94 | 95)) | (Kind::Ecc | Kind::RowRemap, _) => {
                Some(Incident::Memory)
            }
            (Kind::Xid, Some(79)) | (Kind::TelemetryGap | Kind::Zombie, _) => Some(Incident::Lost),
            (
                Kind::ThermalThrottle
                | Kind::PowerThrottle
                | Kind::ClockDegraded
                | Kind::Straggler
                | Kind::Anomaly,
                _,
            ) => Some(Incident::Slowdown),
            _ => None,
        }
    }
}

/// Counters of the engine's input.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Polls fed to detectors.
    pub polls: u64,
    /// Samples older than their GPU's poll in progress, not used.
    pub late_samples: u64,
}

#[derive(Debug)]
struct Gpu {
    id: GpuId,
    health: GpuHealth,
    /// The poll being assembled.
    pending: Option<Poll>,
    /// Sample time of the newest poll fed to the detectors.
    last_poll_ms: Option<i64>,
    /// The GPU's poll interval, smoothed; 0 until two polls were fed.
    interval_ms: i64,
    /// An open `telemetry_gap`: (onset, detected at), wall clock.
    gap: Option<(i64, i64)>,
    /// A tick saw the GPU's data fresh: it reports live, so its silence
    /// means something. Data that is always old when it arrives (a
    /// backfill, `gpulse import`) is never live and never a gap.
    live: bool,
    /// Index of its host in [`Engine::hosts`].
    host: u32,
    /// Static attributes, once told ([`Engine::set_inventory`]).
    inventory: Option<Box<Inventory>>,
}

/// See the module docs.
#[derive(Debug)]
pub struct Engine {
    config: HealthConfig,
    gpus: Vec<Gpu>,
    by_uuid: HashMap<String, GpuSlot>,
    /// Open detector events by GPU and key: the id of the event (incident)
    /// they are part of. Several keys may share an id.
    open: HashMap<(GpuSlot, EventKey), u64>,
    /// Open keys per open event id.
    members: HashMap<u64, u32>,
    /// Open events restored from a log, which a detector has not opened
    /// again since: they clear after [`Engine::RESTORED_GRACE_MS`] of
    /// polls without the detector seeing it.
    restored: HashMap<(GpuSlot, EventKey), i64>,
    /// Every event in memory, by id (open ones and recent closed ones).
    events: std::collections::BTreeMap<u64, Event>,
    /// Closed ids, oldest first, for the bound on closed events.
    closed: VecDeque<u64>,
    next_id: u64,
    counters: EngineCounters,
    scratch: Vec<Transition>,
    /// The GPUs of each host, by host index (the peer groups).
    hosts: Vec<(String, Vec<GpuSlot>)>,
    /// Smoothed signals and rule runs of the peer comparison, by slot.
    peers: Vec<PeerSignals>,
    peer_scratch: Scratch,
    /// The live GPUs' newest sample times, for the fleet's median.
    newest_scratch: Vec<i64>,
    host_index: HashMap<String, u32>,
    /// An inventory changed since the last drift check.
    inventory_changed: bool,
    /// `now_ms` of the last drift check.
    drift_checked_ms: Option<i64>,
}

impl Engine {
    /// Closed events kept in memory (the newest); the log keeps all.
    pub const MAX_CLOSED: usize = 100_000;

    /// The shortest silence by the clock that is a `telemetry_gap` (see
    /// [`Engine::tick`]).
    pub const GAP_MIN_MS: i64 = 30_000;

    /// The shortest silence behind the rest of the fleet that is a
    /// `telemetry_gap` (see [`Engine::tick`]).
    pub const GAP_BEHIND_MS: i64 = 8_000;

    /// Fewest live GPUs for the fleet's median to judge a silence.
    pub const GAP_MIN_FLEET: usize = 4;

    /// How long (sample time of the GPU's polls) an event restored as open
    /// stays open unless its detector opens it again.
    pub const RESTORED_GRACE_MS: i64 = 10 * 60_000;

    /// An engine with no GPUs and no events.
    ///
    /// # Errors
    /// A configuration value out of range.
    pub fn new(config: HealthConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Engine {
            config,
            gpus: Vec::new(),
            by_uuid: HashMap::new(),
            open: HashMap::new(),
            members: HashMap::new(),
            restored: HashMap::new(),
            events: Default::default(),
            closed: VecDeque::new(),
            next_id: 1,
            counters: EngineCounters::default(),
            scratch: Vec::new(),
            hosts: Vec::new(),
            peers: Vec::new(),
            peer_scratch: Scratch::default(),
            newest_scratch: Vec::new(),
            host_index: HashMap::new(),
            inventory_changed: false,
            drift_checked_ms: None,
        })
    }

    /// The slot of the GPU with `id.uuid`, registering it if it is new. A
    /// known GPU whose placement changed (moved host or rack) takes the
    /// new placement; its detectors keep their state.
    pub fn gpu(&mut self, id: GpuId) -> GpuSlot {
        if let Some(&slot) = self.by_uuid.get(&id.uuid) {
            let gpu = &self.gpus[slot as usize];
            if gpu.id != id {
                if gpu.id.host != id.host {
                    let old = gpu.host as usize;
                    self.hosts[old].1.retain(|&s| s != slot);
                    let host = self.host_of(&id.host);
                    self.hosts[host as usize].1.push(slot);
                    self.gpus[slot as usize].host = host;
                }
                self.gpus[slot as usize].id = id;
            }
            return slot;
        }
        let slot = self.gpus.len() as GpuSlot;
        self.by_uuid.insert(id.uuid.clone(), slot);
        let host = self.host_of(&id.host);
        self.hosts[host as usize].1.push(slot);
        self.peers.push(PeerSignals::default());
        self.gpus.push(Gpu {
            id,
            health: GpuHealth::new(&self.config),
            pending: None,
            last_poll_ms: None,
            interval_ms: 0,
            gap: None,
            live: false,
            host,
            inventory: None,
        });
        slot
    }

    /// The index of `host` in [`Engine::hosts`], added if new.
    fn host_of(&mut self, host: &str) -> u32 {
        if let Some(&i) = self.host_index.get(host) {
            return i;
        }
        let i = self.hosts.len() as u32;
        self.hosts.push((host.to_string(), Vec::new()));
        self.host_index.insert(host.to_string(), i);
        i
    }

    /// Tells the engine a GPU's static attributes (from its agent's hello,
    /// the `gpus` table); `drift` compares them with the fleet's at the next
    /// [`Engine::tick`]. Telling the same inventory again changes nothing.
    pub fn set_inventory(&mut self, slot: GpuSlot, inventory: Inventory) {
        let gpu = &mut self.gpus[slot as usize];
        if gpu.inventory.as_deref() != Some(&inventory) {
            gpu.inventory = Some(Box::new(inventory));
            self.inventory_changed = true;
        }
    }

    /// The slot of the GPU with this UUID, if the engine knows it.
    pub fn find(&self, uuid: &str) -> Option<GpuSlot> {
        self.by_uuid.get(uuid).copied()
    }

    /// The GPU in `slot`.
    ///
    /// # Panics
    /// If `slot` did not come from [`Engine::gpu`].
    pub fn gpu_id(&self, slot: GpuSlot) -> &GpuId {
        &self.gpus[slot as usize].id
    }

    /// Number of GPUs registered.
    pub fn num_gpus(&self) -> usize {
        self.gpus.len()
    }

    /// One sample of `field` of the GPU in `slot`. Completes the GPU's poll
    /// in progress when `ts_ms` is later; appends what that poll changed to
    /// `out`.
    pub fn sample(
        &mut self,
        slot: GpuSlot,
        field: Field,
        ts_ms: i64,
        value: f64,
        out: &mut Vec<Change>,
    ) {
        let gpu = &mut self.gpus[slot as usize];
        match &mut gpu.pending {
            Some(p) if p.ts_ms == ts_ms => p.set(field, value),
            Some(p) if p.ts_ms > ts_ms => self.counters.late_samples += 1,
            _ if gpu.last_poll_ms.is_some_and(|last| ts_ms <= last) => {
                self.counters.late_samples += 1;
            }
            pending => {
                let done = pending.replace(Poll::new(ts_ms).with(field, value));
                if let Some(poll) = done {
                    self.feed(slot, poll, out);
                }
            }
        }
    }

    /// Completes every poll in progress older than `ts_ms` (sample time):
    /// their GPUs' next samples cannot belong to them any more.
    pub fn finish_before(&mut self, ts_ms: i64, out: &mut Vec<Change>) {
        for slot in 0..self.gpus.len() as GpuSlot {
            let gpu = &mut self.gpus[slot as usize];
            if gpu.pending.as_ref().is_some_and(|p| p.ts_ms < ts_ms) {
                let poll = gpu.pending.take().expect("BUG: checked above");
                self.feed(slot, poll, out);
            }
        }
    }

    /// Looks for GPUs that went silent, at `now_ms` (the wall clock in
    /// `serve`, the virtual clock in a simulation). A GPU is silent when its
    /// newest sample is older than [`Engine::GAP_MIN_MS`] or 5 of its poll
    /// intervals, whichever is longer; or when it is [`Engine::GAP_BEHIND_MS`]
    /// (or 5 intervals) behind the median newest sample of the live GPUs (at
    /// least [`Engine::GAP_MIN_FLEET`] of them), taken no later than
    /// `now_ms`. The second rule finds a silence in seconds while the rest of
    /// the fleet reports, and stays quiet when everybody's data stops at once
    /// (ingest stalled, or this node cut off), which the first rule then
    /// judges; the median is not moved by a few agents whose clocks run
    /// ahead. A silent GPU whose host's other GPUs
    /// report is a GPU gone (critical: XID 79, fallen off the bus, and the
    /// like); when no GPU of the host reports, the agent or its network is
    /// (warning: its spool may still deliver). The event clears at the next
    /// poll fed, and says whether that poll is from the gap (late data from a
    /// spool) or new. Only a GPU that a tick once saw fresh (its newest
    /// sample within the limit) can be silent: backfilled data is not.
    pub fn tick(&mut self, now_ms: i64, out: &mut Vec<Change>) {
        let limit = |g: &Gpu| Self::GAP_MIN_MS.max(5 * g.interval_ms);
        let behind = |g: &Gpu| Self::GAP_BEHIND_MS.max(5 * g.interval_ms);
        let newest = |g: &Gpu| g.pending.as_ref().map(|p| p.ts_ms).or(g.last_poll_ms);
        for g in &mut self.gpus {
            if !g.live && newest(g).is_some_and(|t| now_ms - t <= limit(g)) {
                g.live = true;
            }
        }
        let times = &mut self.newest_scratch;
        times.clear();
        times.extend(self.gpus.iter().filter(|g| g.live).filter_map(newest));
        let fleet = (times.len() >= Self::GAP_MIN_FLEET).then(|| {
            let mid = times.len() / 2;
            (*times.select_nth_unstable(mid).1).min(now_ms)
        });
        let silent_since = |g: &Gpu| -> Option<i64> {
            let newest = newest(g)?;
            let by_clock = now_ms - newest > limit(g);
            let by_fleet = fleet.is_some_and(|f| f - newest > behind(g));
            (g.live && (by_clock || by_fleet)).then_some(newest)
        };
        // (silent, all) GPUs per host index.
        let mut hosts: Vec<(u32, u32)> = vec![(0, 0); self.hosts.len()];
        for g in &self.gpus {
            let h = &mut hosts[g.host as usize];
            h.1 += 1;
            if silent_since(g).is_some() {
                h.0 += 1;
            }
        }
        let mut opened = Vec::new();
        for (slot, g) in self.gpus.iter().enumerate() {
            let Some(newest) = silent_since(g) else {
                continue;
            };
            if g.gap.is_some() {
                continue;
            }
            let (silent, total) = hosts[g.host as usize];
            let whole_host = silent == total;
            let interval = g.interval_ms.max(1);
            let onset = newest + interval;
            let (severity, action) = if whole_host {
                (
                    Severity::Warning,
                    "check the node's agent and its network: no GPU of this host reports (its spool may still deliver the data)",
                )
            } else {
                (
                    Severity::Critical,
                    "this GPU stopped reporting while the others of its host go on: check it (XID 79, fallen off the bus?) and drain it",
                )
            };
            let mut evidence = format!(
                "no poll for {} s (every {:.1} s before); {silent} of {total} GPUs of {} silent",
                (now_ms - newest) / 1000,
                interval as f64 / 1000.0,
                g.id.host
            );
            if let Some(f) = fleet {
                let _ = write!(
                    evidence,
                    "; the fleet's median GPU is {} s ahead of it",
                    (f - newest) / 1000
                );
            }
            opened.push((
                slot as GpuSlot,
                crate::Finding {
                    kind: Kind::TelemetryGap,
                    severity,
                    xid: None,
                    onset_ts_ms: onset,
                    detected_ts_ms: now_ms,
                    action,
                    evidence,
                },
            ));
        }
        for (slot, f) in opened {
            self.gpus[slot as usize].gap = Some((f.onset_ts_ms, now_ms));
            self.apply(slot, Transition::Opened(f), out);
        }
        self.compare_peers(out);
        self.check_drift(now_ms, out);
    }

    /// How often `drift` is checked without an inventory change.
    pub const DRIFT_RECHECK_MS: i64 = 60_000;

    /// `straggler` and `clock_degraded`: each host's busy GPUs with a new
    /// poll against their busy peers (see [`crate::peers`]).
    fn compare_peers(&mut self, out: &mut Vec<Change>) {
        let mut changes = Vec::new();
        // A GPU that is lost (zombie, silent, fallen off the bus) is nobody's
        // peer and no straggler: its readings, frozen or stale, are not its
        // work. The `lost` incident speaks for it.
        let mut lost: Vec<GpuSlot> = self
            .open
            .keys()
            .filter(|(_, k)| Incident::of(*k) == Some(Incident::Lost))
            .map(|&(s, _)| s)
            .collect();
        lost.sort_unstable();
        for (host, slots) in &self.hosts {
            if !slots.iter().any(|&s| self.peers[s as usize].is_fresh()) {
                continue;
            }
            let interval = slots
                .iter()
                .map(|&s| self.gpus[s as usize].interval_ms)
                .max()
                .unwrap_or(0);
            crate::peers::evaluate_host(
                &mut self.peers,
                crate::peers::HostGroup {
                    name: host,
                    slots,
                    interval_ms: interval,
                },
                |s| lost.binary_search(&s).is_ok(),
                &self.config.peers,
                &mut self.peer_scratch,
                &mut changes,
            );
        }
        for (slot, c) in changes {
            match c {
                PeerChange::Opened(f) => self.apply(slot, Transition::Opened(f), out),
                PeerChange::Cleared { kind, at_ms, why } => {
                    self.close(slot, EventKey::of(kind), at_ms, &why, out);
                }
            }
        }
    }

    /// `drift`: every GPU's inventory against the fleet's majorities, after
    /// a change and every [`Engine::DRIFT_RECHECK_MS`].
    fn check_drift(&mut self, now_ms: i64, out: &mut Vec<Change>) {
        let due = self.inventory_changed
            || self
                .drift_checked_ms
                .is_some_and(|t| now_ms - t >= Self::DRIFT_RECHECK_MS);
        if !due {
            return;
        }
        self.inventory_changed = false;
        self.drift_checked_ms = Some(now_ms);
        let list: Vec<Option<&Inventory>> =
            self.gpus.iter().map(|g| g.inventory.as_deref()).collect();
        let verdicts = crate::drift::judge(&list, &self.config.drift);
        let key = EventKey::of(Kind::Drift);
        for (slot, verdict) in verdicts.into_iter().enumerate() {
            let slot = slot as GpuSlot;
            let open = self.open.contains_key(&(slot, key));
            // An event read back from the log is opened again, so that it
            // goes on instead of expiring.
            let restored = self.restored.contains_key(&(slot, key));
            match verdict {
                Some(evidence) if !open || restored => {
                    let f = crate::Finding {
                        kind: Kind::Drift,
                        severity: Severity::Warning,
                        xid: None,
                        onset_ts_ms: now_ms,
                        detected_ts_ms: now_ms,
                        action: "bring this GPU's host to the fleet's driver and firmware (or the fleet to its version); until then keep it out of multi-host jobs",
                        evidence,
                    };
                    self.apply(slot, Transition::Opened(f), out);
                }
                None if open && self.gpus[slot as usize].inventory.is_some() => {
                    self.close(
                        slot,
                        key,
                        now_ms,
                        "its driver and firmware match the fleet's majority again",
                        out,
                    );
                }
                _ => {}
            }
        }
    }

    /// Completes every poll in progress.
    pub fn finish_all(&mut self, out: &mut Vec<Change>) {
        self.finish_before(i64::MAX, out);
    }

    fn feed(&mut self, slot: GpuSlot, poll: Poll, out: &mut Vec<Change>) {
        let gpu = &mut self.gpus[slot as usize];
        if let Some(last) = gpu.last_poll_ms {
            // A gap must not teach the GPU a long interval: a spacing counts
            // for at most 4 times the interval known so far.
            let spacing = poll.ts_ms - last;
            gpu.interval_ms = if gpu.interval_ms == 0 {
                spacing
            } else {
                (3 * gpu.interval_ms + spacing.min(4 * gpu.interval_ms)) / 4
            };
        }
        gpu.last_poll_ms = Some(poll.ts_ms);
        if let Some((_, detected)) = gpu.gap.take() {
            let why = if poll.ts_ms < detected {
                "its polls of the gap arrived late (from a spool): delivery was interrupted, not the GPU"
            } else {
                "it reports again"
            };
            self.close(slot, EventKey::of(Kind::TelemetryGap), poll.ts_ms, why, out);
        }
        self.peers[slot as usize].observe(&poll, &self.config.peers);
        let gpu = &mut self.gpus[slot as usize];
        self.counters.polls += 1;
        let mut transitions = std::mem::take(&mut self.scratch);
        gpu.health.observe(&poll, &mut transitions);
        for t in transitions.drain(..) {
            self.apply(slot, t, out);
        }
        self.scratch = transitions;
        self.expire_restored(slot, poll.ts_ms, out);
    }

    fn apply(&mut self, slot: GpuSlot, t: Transition, out: &mut Vec<Change>) {
        let key = t.key();
        match t {
            Transition::Opened(f) => {
                if let Some(&id) = self.open.get(&(slot, key)) {
                    // Restored from the log, and now seen again: the same
                    // event goes on, with its first onset.
                    self.restored.remove(&(slot, key));
                    let e = self.events.get_mut(&id).expect("BUG: open events are kept");
                    if f.severity > e.severity {
                        e.severity = f.severity;
                        e.action = f.action.to_string();
                        e.evidence = f.evidence;
                        out.push(Change::Escalated(e.clone()));
                    }
                    return;
                }
                if let Some(id) = self.incident_of(slot, key) {
                    // Another signal of a failure already open on this GPU.
                    self.open.insert((slot, key), id);
                    *self.members.entry(id).or_default() += 1;
                    let e = self.events.get_mut(&id).expect("BUG: open events are kept");
                    e.evidence = format!("{}; with {}: {}", e.evidence, f.kind, f.evidence);
                    if f.severity > e.severity {
                        e.severity = f.severity;
                        e.action = f.action.to_string();
                    }
                    out.push(Change::Escalated(e.clone()));
                    return;
                }
                let id = self.next_id;
                self.next_id += 1;
                let e = Event {
                    id,
                    gpu: self.gpus[slot as usize].id.clone(),
                    kind: f.kind,
                    severity: f.severity,
                    xid: f.xid,
                    onset_ts_ms: f.onset_ts_ms,
                    detected_ts_ms: f.detected_ts_ms,
                    cleared_ts_ms: None,
                    action: f.action.to_string(),
                    evidence: f.evidence,
                };
                self.open.insert((slot, key), id);
                self.members.insert(id, 1);
                out.push(Change::Opened(e.clone()));
                self.events.insert(id, e);
            }
            Transition::Escalated(x) => {
                let Some(&id) = self.open.get(&(slot, key)) else {
                    return;
                };
                let e = self.events.get_mut(&id).expect("BUG: open events are kept");
                if x.severity >= e.severity {
                    e.action = x.action.to_string();
                }
                e.severity = e.severity.max(x.severity);
                e.evidence = format!("{}; then {}", e.evidence, x.evidence);
                out.push(Change::Escalated(e.clone()));
            }
            Transition::Cleared(c) => {
                self.close(slot, key, c.cleared_ts_ms, &c.evidence, out);
            }
        }
    }

    fn close(
        &mut self,
        slot: GpuSlot,
        key: EventKey,
        at_ms: i64,
        why: &str,
        out: &mut Vec<Change>,
    ) {
        let Some(id) = self.open.remove(&(slot, key)) else {
            return;
        };
        self.restored.remove(&(slot, key));
        let e = self.events.get_mut(&id).expect("BUG: open events are kept");
        let left = self.members.get_mut(&id).map_or(0, |n| {
            *n = n.saturating_sub(1);
            *n
        });
        if left > 0 {
            // Other signals of the incident are still there.
            e.evidence = format!("{}; {} cleared: {why}", e.evidence, key.kind);
            return;
        }
        self.members.remove(&id);
        e.cleared_ts_ms = Some(at_ms);
        e.evidence = format!("{}; cleared: {why}", e.evidence);
        out.push(Change::Cleared(e.clone()));
        self.closed.push_back(id);
        while self.closed.len() > Self::MAX_CLOSED {
            if let Some(old) = self.closed.pop_front() {
                self.events.remove(&old);
            }
        }
    }

    /// The open event on the GPU in `slot` that an event of `key` joins: one
    /// of the same incident group.
    fn incident_of(&self, slot: GpuSlot, key: EventKey) -> Option<u64> {
        let group = Incident::of(key)?;
        self.open
            .iter()
            .filter(|((s, k), _)| *s == slot && Incident::of(*k) == Some(group))
            .map(|(_, &id)| id)
            .min()
    }

    /// Clears the GPU's restored events that its detectors did not open
    /// again within the grace period of polls.
    fn expire_restored(&mut self, slot: GpuSlot, ts_ms: i64, out: &mut Vec<Change>) {
        if self.restored.is_empty() {
            return;
        }
        let due: Vec<EventKey> = self
            .restored
            .iter_mut()
            .filter(|((s, _), _)| *s == slot)
            .filter_map(|((_, key), since)| {
                // The first poll after the restart starts the grace period.
                if *since == i64::MIN {
                    *since = ts_ms;
                }
                (ts_ms - *since >= Self::RESTORED_GRACE_MS).then_some(*key)
            })
            .collect();
        for key in due {
            self.close(
                slot,
                key,
                ts_ms,
                "not seen again by its detector after a restart",
                out,
            );
        }
    }

    /// Puts events read back from a log into the book, before any sample.
    /// Open ones stay open: a detector that opens the same event again
    /// continues it, and one that does not clears it after
    /// [`Engine::RESTORED_GRACE_MS`] of the GPU's polls.
    pub fn restore(&mut self, events: impl IntoIterator<Item = Event>) {
        for e in events {
            let slot = self.gpu(e.gpu.clone());
            self.next_id = self.next_id.max(e.id + 1);
            if e.is_active() {
                self.open.insert((slot, e.key()), e.id);
                self.members.insert(e.id, 1);
                self.restored.insert((slot, e.key()), i64::MIN);
            } else {
                self.closed.push_back(e.id);
            }
            self.events.insert(e.id, e);
        }
        while self.closed.len() > Self::MAX_CLOSED {
            if let Some(old) = self.closed.pop_front() {
                self.events.remove(&old);
            }
        }
    }

    /// The events in memory, by id: every open one and the newest closed.
    pub fn events(&self) -> impl Iterator<Item = &Event> {
        self.events.values()
    }

    /// The open events (incidents), by id.
    pub fn active(&self) -> impl Iterator<Item = &Event> {
        self.members.keys().map(|id| &self.events[id])
    }

    /// Each GPU's state: `Unknown` when its newest poll is more than
    /// `stale_ms` older than `now_ms`, else by its worst open event.
    pub fn states(&self, now_ms: i64, stale_ms: i64) -> Vec<(&GpuId, GpuState)> {
        let mut worst: Vec<Option<Severity>> = vec![None; self.gpus.len()];
        for (&(slot, _), id) in &self.open {
            // (A merged incident is counted once per member; same result.)
            let s = self.events[id].severity;
            let w = &mut worst[slot as usize];
            *w = Some(w.map_or(s, |w| w.max(s)));
        }
        self.gpus
            .iter()
            .zip(worst)
            .map(|(g, w)| {
                let newest = g.pending.as_ref().map(|p| p.ts_ms).or(g.last_poll_ms);
                let state = match (newest, w) {
                    (None, _) => GpuState::Unknown,
                    (Some(t), _) if now_ms - t > stale_ms => GpuState::Unknown,
                    (_, Some(Severity::Critical)) => GpuState::Critical,
                    (_, Some(_)) => GpuState::Warning,
                    (_, None) => GpuState::Ok,
                };
                (&g.id, state)
            })
            .collect()
    }

    /// What the engine has taken in.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// Bytes of detector state per GPU (the same for every GPU).
    pub fn state_bytes_per_gpu(&self) -> usize {
        GpuHealth::new(&self.config).state_bytes() + std::mem::size_of::<PeerSignals>()
    }
}

#[cfg(test)]
mod tests;
