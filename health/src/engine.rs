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
//! Events are kept in memory: every open one, and the newest
//! [`Engine::MAX_CLOSED`] closed ones. Whoever persists them
//! ([`Engine::restore`] at start) gets every change as a [`Change`].

use std::collections::{HashMap, VecDeque};

use crate::{
    ConfigError, Detector, EventKey, Field, GpuHealth, GpuId, HealthConfig, Kind, Poll, Severity,
    Transition,
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
}

/// See the module docs.
#[derive(Debug)]
pub struct Engine {
    config: HealthConfig,
    gpus: Vec<Gpu>,
    by_uuid: HashMap<String, GpuSlot>,
    /// Open events by GPU and key: their id.
    open: HashMap<(GpuSlot, EventKey), u64>,
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
}

impl Engine {
    /// Closed events kept in memory (the newest); the log keeps all.
    pub const MAX_CLOSED: usize = 100_000;

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
            restored: HashMap::new(),
            events: Default::default(),
            closed: VecDeque::new(),
            next_id: 1,
            counters: EngineCounters::default(),
            scratch: Vec::new(),
        })
    }

    /// The slot of the GPU with `id.uuid`, registering it if it is new. A
    /// known GPU whose placement changed (moved host or rack) takes the
    /// new placement; its detectors keep their state.
    pub fn gpu(&mut self, id: GpuId) -> GpuSlot {
        if let Some(&slot) = self.by_uuid.get(&id.uuid) {
            let gpu = &mut self.gpus[slot as usize];
            if gpu.id != id {
                gpu.id = id;
            }
            return slot;
        }
        let slot = self.gpus.len() as GpuSlot;
        self.by_uuid.insert(id.uuid.clone(), slot);
        self.gpus.push(Gpu {
            id,
            health: GpuHealth::new(&self.config),
            pending: None,
            last_poll_ms: None,
        });
        slot
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

    /// Completes every poll in progress.
    pub fn finish_all(&mut self, out: &mut Vec<Change>) {
        self.finish_before(i64::MAX, out);
    }

    fn feed(&mut self, slot: GpuSlot, poll: Poll, out: &mut Vec<Change>) {
        let gpu = &mut self.gpus[slot as usize];
        gpu.last_poll_ms = Some(poll.ts_ms);
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
                out.push(Change::Opened(e.clone()));
                self.events.insert(id, e);
            }
            Transition::Escalated(x) => {
                let Some(&id) = self.open.get(&(slot, key)) else {
                    return;
                };
                let e = self.events.get_mut(&id).expect("BUG: open events are kept");
                e.severity = e.severity.max(x.severity);
                e.action = x.action.to_string();
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

    /// The open events.
    pub fn active(&self) -> impl Iterator<Item = &Event> {
        self.open.values().map(|id| &self.events[id])
    }

    /// Each GPU's state: `Unknown` when its newest poll is more than
    /// `stale_ms` older than `now_ms`, else by its worst open event.
    pub fn states(&self, now_ms: i64, stale_ms: i64) -> Vec<(&GpuId, GpuState)> {
        let mut worst: Vec<Option<Severity>> = vec![None; self.gpus.len()];
        for (&(slot, _), id) in &self.open {
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
        GpuHealth::new(&self.config).state_bytes()
    }
}

#[cfg(test)]
mod tests;
