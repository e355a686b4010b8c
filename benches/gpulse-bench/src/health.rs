//! `gpulse-bench health`: scores the fleet-health detectors against the
//! simulator's injected faults.
//!
//! The simulated fleet runs in process on a virtual clock, through the real
//! engine (`health::engine::Engine`), exactly as `serve` feeds it: each tick
//! every host is sampled, each reading becomes a sample of the engine's field
//! of that metric name, then the tick's polls are completed
//! (`finish_before`) and the engine's fleet-wide checks run (`tick`:
//! telemetry gaps, peer comparison, drift). Every event change is recorded;
//! nothing else is kept (readings stream through).
//!
//! Two runs: a *faulty* one (random faults from the simulator, drifted nodes,
//! and the harness's own agent silences) for recall, precision and time to
//! detect, and a *clean* one (no fault at all) for false alerts per healthy
//! GPU-hour. Scoring rules: [`score`].
//!
//! Hosts are cut into shards, each run by its own engine over the whole
//! virtual time; worker threads take the shards one after another. A host's
//! GPUs stay in one engine (they are each other's peers), and a shard holds
//! at least [`MIN_HOSTS_PER_SHARD`] hosts where the fleet has them, so that
//! `drift` (a comparison with the engine's fleet) has a fleet to compare
//! with, and about [`HOSTS_PER_SHARD`]: an engine of a few hundred GPUs stays
//! in the CPU's caches (one of 10,000 GPUs ran at a third of the speed).

pub(crate) mod score;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use agent::GpuSource;
use agent::catalog::Metric;
use agent::sim::{FaultConfig, FaultEvent, ScheduledFault, SimConfig, SimulatedSource};
use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use health::engine::{Change, Engine, GpuSlot};
use health::{Field, GpuId, HealthConfig, Inventory, Kind, Severity};
use serde::Serialize;

use crate::fleet::{GPUS_PER_HOST, host_name, host_seed, rack_name, row_name};
use score::{
    AGENT_SILENT, DetectorKindRow, FaultKindRow, FaultOutcome, Incident, IncidentOutcome, Signal,
    TruthFault,
};

/// Start of the virtual clock, Unix ms (2023-11-14).
pub(crate) const START_MS: i64 = 1_700_000_000_000;
/// Fewest hosts per engine (see the module docs).
pub(crate) const MIN_HOSTS_PER_SHARD: u64 = 16;
/// Hosts per engine, about, in a big fleet.
pub(crate) const HOSTS_PER_SHARD: u64 = 32;
/// Seeds from here on are held out: detectors are not tuned on them.
pub(crate) const FIRST_HELD_OUT_SEED: u64 = 1000;
/// Cluster label of the simulated GPUs.
const CLUSTER: &str = "sim";
/// An agent silence lasts 1 to 10 minutes.
const SILENCE_MS: std::ops::Range<i64> = 60_000..600_001;
/// Examples of missed faults and of false incidents kept for the JSON.
const EXAMPLES: usize = 50;
/// The slowest detections of each fault kind kept for the JSON.
const SLOWEST_PER_KIND: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum HealthMode {
    /// A faulty run (recall, precision, time to detect) and a clean run
    /// (false alerts).
    Both,
    /// Only the faulty run.
    Faulty,
    /// Only the fault-free run.
    Clean,
}

#[derive(Debug, Args)]
pub(crate) struct HealthArgs {
    /// Simulated GPUs (hosts of 8, 4 hosts a rack, 8 racks a row).
    #[arg(long, default_value_t = 1000)]
    pub(crate) gpus: u32,
    /// Virtual hours each run simulates.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) hours: f64,
    /// Seed of the simulated fleet. Seeds below 1000 are the tuning seeds
    /// (detectors may be tuned on them); 1000 and above are held out, for
    /// scoring.
    #[arg(long, default_value_t = 1001)]
    pub(crate) seed: u64,
    /// Random faults per GPU-hour in the faulty run.
    #[arg(long, default_value_t = 0.05)]
    pub(crate) fault_rate: f64,
    /// Probability that a host's driver or firmware drifts from the fleet's
    /// (faulty run).
    #[arg(long, default_value_t = 0.02)]
    pub(crate) drift_node_probability: f64,
    /// Hosts whose agent falls silent for 1-10 minutes and then delivers its
    /// spool at once (faulty run), expected per run.
    #[arg(long, default_value_t = 4.0)]
    pub(crate) agent_silences: f64,
    /// Time between two polls of a GPU.
    #[arg(long, default_value = "1s", value_parser = agent::cmd::parse_duration)]
    pub(crate) interval: Duration,
    /// Time after a fault's end in which an incident still counts for it.
    #[arg(long, default_value = "5m", value_parser = agent::cmd::parse_duration)]
    pub(crate) grace: Duration,
    /// Worker threads. Default: the available cores.
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Which runs: `both`, `faulty` or `clean`.
    #[arg(long, value_enum, default_value = "both")]
    pub(crate) mode: HealthMode,
    /// Write every result as one JSON document to FILE (replaced).
    #[arg(long, value_name = "FILE")]
    pub(crate) json: Option<PathBuf>,
}

/// One run of the fleet.
#[derive(Debug, Clone)]
pub(crate) struct RunSpec {
    pub(crate) faulty: bool,
    pub(crate) gpus: u32,
    pub(crate) ticks: u64,
    pub(crate) interval_ms: i64,
    pub(crate) seed: u64,
    pub(crate) fault_rate: f64,
    pub(crate) drift_node_probability: f64,
    /// Expected hosts with an agent silence.
    pub(crate) agent_silences: f64,
    pub(crate) threads: usize,
    /// Test hook: explicit faults, by host.
    pub(crate) scheduled: Vec<(u64, ScheduledFault)>,
    /// Test hook: explicit agent silences (host, first tick, ticks), used
    /// instead of the random ones when not empty.
    pub(crate) silences: Vec<(u64, u64, u64)>,
    /// Print progress on stderr.
    pub(crate) progress: bool,
}

impl RunSpec {
    fn hosts(&self) -> u64 {
        u64::from(self.gpus.div_ceil(GPUS_PER_HOST))
    }

    fn ts(&self, tick: u64) -> i64 {
        START_MS + tick as i64 * self.interval_ms
    }

    fn end_ms(&self) -> i64 {
        self.ts(self.ticks)
    }

    fn gpu_hours(&self) -> f64 {
        f64::from(self.gpus) * self.ticks as f64 * self.interval_ms as f64 / 3.6e6
    }

    /// Contiguous host ranges, one per engine: enough to keep the threads
    /// busy and none much above [`HOSTS_PER_SHARD`] hosts, but none below
    /// [`MIN_HOSTS_PER_SHARD`] unless the fleet is that small.
    fn shards(&self) -> Vec<std::ops::Range<u64>> {
        let hosts = self.hosts();
        let n = (self.threads.max(1) as u64)
            .min((hosts / MIN_HOSTS_PER_SHARD).max(1))
            .max(hosts.div_ceil(HOSTS_PER_SHARD))
            .clamp(1, hosts.max(1));
        (0..n)
            .map(|i| (hosts * i / n)..(hosts * (i + 1) / n))
            .collect()
    }
}

/// SplitMix64: the harness's own random draws (agent silences).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unit(state: &mut u64) -> f64 {
    (splitmix(state) >> 11) as f64 / (1u64 << 53) as f64
}

/// Host `h`'s agent silence in the faulty run, `(first tick, ticks)`: with
/// probability `agent_silences / hosts`, 1-10 minutes, starting after 2
/// minutes and ending at least a minute before the end of the run (so its
/// spool is delivered within the run).
fn silence_of(spec: &RunSpec, h: u64) -> Option<(u64, u64)> {
    if !spec.faulty {
        return None;
    }
    if !spec.silences.is_empty() {
        return spec
            .silences
            .iter()
            .find(|s| s.0 == h)
            .map(|&(_, start, n)| (start, n.max(1)));
    }
    let mut st = spec.seed ^ 0x5113_4e7c_e000_0000 ^ h.wrapping_mul(0x2545_f491_4f6c_dd1d);
    let p = (spec.agent_silences / spec.hosts().max(1) as f64).min(1.0);
    if unit(&mut st) >= p {
        return None;
    }
    let iv = spec.interval_ms.max(1);
    let lead = 120_000 / iv;
    let tail = 60_000 / iv;
    let min = (SILENCE_MS.start / iv).max(1) as u64;
    let room = spec.ticks.checked_sub(lead as u64 + tail as u64)?;
    if room < min {
        return None;
    }
    let want =
        SILENCE_MS.start + (unit(&mut st) * (SILENCE_MS.end - SILENCE_MS.start) as f64) as i64;
    let len = ((want / iv).max(1) as u64).min(room);
    let start = lead as u64 + (unit(&mut st) * (room - len + 1) as f64) as u64;
    Some((start, len))
}

/// The engine field of each metric (by name), indexed by `Metric as u8`.
fn field_table() -> [Option<Field>; 256] {
    let mut t = [None; 256];
    for m in Metric::ALL {
        t[m as u8 as usize] = Field::from_name(m.name());
    }
    t
}

fn inventory_of(g: &agent::GpuInfo) -> Inventory {
    Inventory {
        model: g.model_name.clone(),
        driver_version: g.driver_version.clone(),
        vbios_version: g.vbios_version.clone(),
        inforom_version: g.inforom_image_version.clone(),
    }
}

/// A sample held back by a silent agent.
#[derive(Debug, Clone, Copy)]
struct Held {
    ts_ms: i64,
    slot: GpuSlot,
    field: Field,
    value: f64,
}

#[derive(Debug)]
struct HostRun {
    index: u64,
    sim: SimulatedSource,
    truth: agent::sim::GroundTruth,
    slots: Vec<GpuSlot>,
    /// What the engine was told, to notice a changed inventory.
    told: Vec<Inventory>,
    silence: Option<(u64, u64)>,
    held: Vec<Held>,
}

/// Incidents per kind and severity, and per GPU.
#[derive(Debug, Clone, Default)]
pub(crate) struct Tally {
    /// Kind name (`xid 79` for XIDs) → (incidents, critical ones).
    pub(crate) by_kind: BTreeMap<String, (u64, u64)>,
    pub(crate) per_gpu: HashMap<u32, u64>,
    /// The first incidents, with their evidence.
    pub(crate) examples: Vec<Incident>,
}

impl Tally {
    fn add(&mut self, inc: &Incident) {
        let e = self.by_kind.entry(inc.kind_name()).or_default();
        e.0 += 1;
        e.1 += u64::from(inc.severity == Severity::Critical);
        *self.per_gpu.entry(inc.gpu).or_default() += 1;
        if self.examples.len() < EXAMPLES {
            self.examples.push(inc.clone());
        }
    }

    fn merge(&mut self, o: Tally) {
        for (k, (n, c)) in o.by_kind {
            let e = self.by_kind.entry(k).or_default();
            e.0 += n;
            e.1 += c;
        }
        for (g, n) in o.per_gpu {
            *self.per_gpu.entry(g).or_default() += n;
        }
        for x in o.examples {
            if self.examples.len() < EXAMPLES {
                self.examples.push(x);
            }
        }
    }

    fn incidents(&self) -> u64 {
        self.by_kind.values().map(|v| v.0).sum()
    }

    fn critical(&self) -> u64 {
        self.by_kind.values().map(|v| v.1).sum()
    }
}

/// The engine's changes turned into [`Incident`]s.
#[derive(Debug)]
struct Book {
    /// Keep every incident (the faulty run); else only tally them.
    keep: bool,
    uuid_gpu: HashMap<String, u32>,
    /// Open incidents by event id, with how much of their evidence was read.
    open: HashMap<u64, (Incident, usize)>,
    done: Vec<Incident>,
    tally: Tally,
    joined: Vec<(Kind, Option<u32>)>,
}

fn shorten(s: &str) -> String {
    let mut end = s.len().min(300);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl Book {
    fn on_change(&mut self, c: Change, now_ms: i64) {
        match c {
            Change::Opened(e) => {
                let gpu = self.uuid_gpu.get(&e.gpu.uuid).copied().unwrap_or(u32::MAX);
                let inc = Incident {
                    gpu,
                    kind: e.kind,
                    xid: e.xid,
                    severity: e.severity,
                    cleared_ms: None,
                    signals: vec![Signal {
                        kind: e.kind,
                        xid: e.xid,
                        at_ms: now_ms,
                    }],
                    evidence: if self.keep || self.tally.examples.len() < EXAMPLES {
                        shorten(&e.evidence)
                    } else {
                        String::new()
                    },
                };
                self.open.insert(e.id, (inc, e.evidence.len()));
            }
            Change::Escalated(e) => {
                if let Some((inc, scanned)) = self.open.get_mut(&e.id) {
                    inc.severity = inc.severity.max(e.severity);
                    self.joined.clear();
                    *scanned = score::joined_kinds(&e.evidence, *scanned, &mut self.joined);
                    for &(kind, xid) in &self.joined {
                        inc.signals.push(Signal {
                            kind,
                            xid,
                            at_ms: now_ms,
                        });
                    }
                }
            }
            Change::Cleared(e) => {
                if let Some((mut inc, _)) = self.open.remove(&e.id) {
                    inc.cleared_ms = Some(now_ms);
                    self.close(inc);
                }
            }
        }
    }

    fn close(&mut self, inc: Incident) {
        self.tally.add(&inc);
        if self.keep {
            self.done.push(inc);
        }
    }

    fn finish(mut self) -> (Vec<Incident>, Tally) {
        let mut open: Vec<(u64, Incident)> =
            self.open.drain().map(|(id, (i, _))| (id, i)).collect();
        open.sort_by_key(|(id, _)| *id);
        for (_, inc) in open {
            self.close(inc);
        }
        (self.done, self.tally)
    }
}

/// What one shard (one engine) produced.
#[derive(Debug, Default)]
struct ShardOutput {
    incidents: Vec<Incident>,
    tally: Tally,
    truth: Vec<TruthFault>,
    uuids: Vec<(u32, String)>,
    polls_fed: u64,
    late_samples: u64,
}

/// The ground truth of one simulator fault, on the virtual clock.
fn truth_of(spec: &RunSpec, first_gpu: u32, e: &FaultEvent) -> TruthFault {
    TruthFault {
        gpu: first_gpu + e.gpu,
        kind: e.kind.as_str(),
        onset_ms: spec.ts(e.start_tick),
        end_ms: e.end_tick.map(|t| spec.ts(t)),
        shown_ms: e.shown_tick.map(|t| spec.ts(t)),
        shown_for_ms: e.shown_ticks as i64 * spec.interval_ms,
        variant: e.variant,
        magnitude: e.magnitude,
    }
}

fn run_shard(spec: &RunSpec, hosts: std::ops::Range<u64>, done: &AtomicU64) -> ShardOutput {
    let mut engine =
        Engine::new(HealthConfig::default()).expect("BUG: the default health config is valid");
    let fields = field_table();
    let mut uuid_gpu = HashMap::new();
    let mut out = ShardOutput::default();
    let mut hs: Vec<HostRun> = Vec::with_capacity((hosts.end - hosts.start) as usize);
    for h in hosts {
        let gpus_here = (spec.gpus - h as u32 * GPUS_PER_HOST).min(GPUS_PER_HOST);
        let mut config = SimConfig::new(host_seed(spec.seed, h), gpus_here);
        config.interval_ms = spec.interval_ms as u64;
        if spec.faulty {
            config.faults = FaultConfig {
                random_per_gpu_hour: spec.fault_rate,
                drift_node_probability: spec.drift_node_probability,
                scheduled: spec
                    .scheduled
                    .iter()
                    .filter(|(host, _)| *host == h)
                    .map(|(_, f)| *f)
                    .collect(),
            };
        }
        let sim = SimulatedSource::new(config);
        let first_gpu = h as u32 * GPUS_PER_HOST;
        let mut slots = Vec::with_capacity(gpus_here as usize);
        let mut told = Vec::with_capacity(gpus_here as usize);
        for g in sim.inventory() {
            let slot = engine.gpu(GpuId {
                uuid: g.uuid.clone(),
                host: host_name(h),
                gpu: g.index,
                rack: Some(rack_name(h)),
                row: Some(row_name(h)),
                cluster: Some(CLUSTER.into()),
            });
            let inv = inventory_of(g);
            engine.set_inventory(slot, inv.clone());
            told.push(inv);
            uuid_gpu.insert(g.uuid.clone(), first_gpu + g.index);
            out.uuids.push((first_gpu + g.index, g.uuid.clone()));
            slots.push(slot);
        }
        hs.push(HostRun {
            index: h,
            truth: sim.ground_truth(),
            sim,
            slots,
            told,
            silence: silence_of(spec, h),
            held: Vec::new(),
        });
    }
    let mut book = Book {
        keep: spec.faulty,
        uuid_gpu,
        open: HashMap::new(),
        done: Vec::new(),
        tally: Tally::default(),
        joined: Vec::new(),
    };
    let gpus_here: u64 = hs.iter().map(|h| h.slots.len() as u64).sum();
    let mut readings: Vec<agent::Reading> = Vec::new();
    let mut changes: Vec<Change> = Vec::new();
    // An agent tells its inventory when it connects; a simulator may change
    // it (a driver update), so it is compared once a virtual minute.
    let inventory_every = (60_000 / spec.interval_ms.max(1)).max(1) as u64;
    let mut unreported = 0u64;
    for k in 0..spec.ticks {
        let now = spec.ts(k);
        for h in &mut hs {
            readings.clear();
            // The simulator never fails; a poll it could not take is empty.
            let _ = h.sim.sample(&mut readings);
            if h.silence.is_some_and(|(s, n)| k >= s && k < s + n) {
                for r in &readings {
                    if r.label.is_none()
                        && let Some(field) = fields[r.metric as u8 as usize]
                    {
                        h.held.push(Held {
                            ts_ms: now,
                            slot: h.slots[r.gpu as usize],
                            field,
                            value: r.value,
                        });
                    }
                }
                continue;
            }
            // Live again: the spool first, late, then this tick's poll.
            for x in h.held.drain(..) {
                engine.sample(x.slot, x.field, x.ts_ms, x.value, &mut changes);
            }
            for r in &readings {
                if r.label.is_none()
                    && let Some(field) = fields[r.metric as u8 as usize]
                {
                    engine.sample(h.slots[r.gpu as usize], field, now, r.value, &mut changes);
                }
            }
        }
        engine.finish_before(now + 1, &mut changes);
        engine.tick(now, &mut changes);
        for c in changes.drain(..) {
            book.on_change(c, now);
        }
        if k > 0 && k % inventory_every == 0 {
            for h in &mut hs {
                for (i, g) in h.sim.inventory().iter().enumerate() {
                    let inv = inventory_of(g);
                    if inv != h.told[i] {
                        engine.set_inventory(h.slots[i], inv.clone());
                        h.told[i] = inv;
                    }
                }
            }
        }
        unreported += gpus_here;
        if k % 16 == 15 {
            done.fetch_add(unreported, Relaxed);
            unreported = 0;
        }
    }
    done.fetch_add(unreported, Relaxed);
    let (incidents, tally) = book.finish();
    out.incidents = incidents;
    out.tally = tally;
    let c = engine.counters();
    out.polls_fed = c.polls;
    out.late_samples = c.late_samples;
    for h in &hs {
        let first_gpu = h.index as u32 * GPUS_PER_HOST;
        for e in h.truth.events() {
            out.truth.push(truth_of(spec, first_gpu, &e));
        }
        if let Some((start, n)) = h.silence {
            for g in 0..h.slots.len() as u32 {
                out.truth.push(TruthFault {
                    gpu: first_gpu + g,
                    kind: AGENT_SILENT,
                    onset_ms: spec.ts(start),
                    end_ms: Some(spec.ts(start + n)),
                    shown_ms: Some(spec.ts(start)),
                    shown_for_ms: n as i64 * spec.interval_ms,
                    variant: None,
                    magnitude: None,
                });
            }
        }
    }
    out
}

/// The merged output of a run.
#[derive(Debug)]
pub(crate) struct RunOutput {
    pub(crate) spec: RunSpec,
    pub(crate) shards: usize,
    pub(crate) threads: usize,
    pub(crate) wall_s: f64,
    pub(crate) gpu_polls: u64,
    pub(crate) polls_fed: u64,
    pub(crate) late_samples: u64,
    /// Sorted by onset, then GPU.
    pub(crate) truth: Vec<TruthFault>,
    /// Faulty run only; sorted by opening time, then GPU.
    pub(crate) incidents: Vec<Incident>,
    pub(crate) tally: Tally,
    /// Fleet-wide GPU index → UUID.
    pub(crate) uuids: Vec<String>,
}

/// Runs the fleet of `spec` (see the module docs).
pub(crate) fn simulate(spec: &RunSpec) -> RunOutput {
    let shards = spec.shards();
    let done = AtomicU64::new(0);
    let total = u64::from(spec.gpus) * spec.ticks;
    let t0 = Instant::now();
    let label = if spec.faulty { "faulty" } else { "clean" };
    let threads = spec.threads.clamp(1, shards.len().max(1));
    let next = AtomicUsize::new(0);
    let mut outputs: Vec<(usize, ShardOutput)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (shards, next, done) = (&shards, &next, &done);
                s.spawn(move || {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Relaxed);
                        let Some(r) = shards.get(i) else {
                            return mine;
                        };
                        mine.push((i, run_shard(spec, r.clone(), done)));
                    }
                })
            })
            .collect();
        let (mut last_t, mut last_n) = (Instant::now(), 0u64);
        while !handles.iter().all(|h| h.is_finished()) {
            std::thread::sleep(Duration::from_millis(100));
            if spec.progress && last_t.elapsed() >= Duration::from_secs(10) {
                let n = done.load(Relaxed);
                let hours =
                    n as f64 / f64::from(spec.gpus.max(1)) * spec.interval_ms as f64 / 3.6e6;
                eprintln!(
                    "bench: health {label} run: {hours:.2} of {:.2} virtual GPU-fleet hours ({:.0} %), {:.2} M GPU-polls/s",
                    spec.ticks as f64 * spec.interval_ms as f64 / 3.6e6,
                    100.0 * n as f64 / total.max(1) as f64,
                    (n - last_n) as f64 / last_t.elapsed().as_secs_f64() / 1e6
                );
                (last_t, last_n) = (Instant::now(), n);
            }
        }
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("BUG: a health bench worker panicked"))
            .collect()
    });
    // Shard order, whichever thread ran them: the examples are reproducible.
    outputs.sort_by_key(|(i, _)| *i);
    let wall_s = t0.elapsed().as_secs_f64();
    let mut r = RunOutput {
        spec: spec.clone(),
        shards: shards.len(),
        threads,
        wall_s,
        gpu_polls: total,
        polls_fed: 0,
        late_samples: 0,
        truth: Vec::new(),
        incidents: Vec::new(),
        tally: Tally::default(),
        uuids: vec![String::new(); spec.gpus as usize],
    };
    for (_, o) in outputs {
        r.polls_fed += o.polls_fed;
        r.late_samples += o.late_samples;
        r.truth.extend(o.truth);
        r.incidents.extend(o.incidents);
        r.tally.merge(o.tally);
        for (g, u) in o.uuids {
            r.uuids[g as usize] = u;
        }
    }
    r.truth.sort_by_key(|t| (t.onset_ms, t.gpu));
    r.incidents.sort_by_key(|i| (i.opened_ms(), i.gpu));
    r
}

// ---- The report ----

#[derive(Debug, Clone, Serialize)]
pub(crate) struct ReportConfig {
    pub(crate) gpus: u32,
    pub(crate) hosts: u64,
    pub(crate) hours: f64,
    pub(crate) interval_ms: i64,
    pub(crate) seed: u64,
    pub(crate) held_out_seed: bool,
    pub(crate) fault_rate_per_gpu_hour: f64,
    pub(crate) drift_node_probability: f64,
    pub(crate) agent_silences: f64,
    pub(crate) grace_ms: i64,
    pub(crate) threads: usize,
    pub(crate) mode: HealthMode,
    pub(crate) start_ms: i64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Rules {
    pub(crate) grace_ms: i64,
    pub(crate) matching: &'static str,
    pub(crate) exclusion: String,
    pub(crate) time_to_detect: &'static str,
    pub(crate) precision: &'static str,
    pub(crate) false_alerts: &'static str,
    pub(crate) agent_silent: &'static str,
    pub(crate) peer_groups: String,
    /// Fault kind → detector kinds that detect it.
    pub(crate) expected: BTreeMap<&'static str, Vec<String>>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct RunStats {
    pub(crate) gpus: u32,
    pub(crate) ticks: u64,
    pub(crate) gpu_hours: f64,
    pub(crate) gpu_polls: u64,
    pub(crate) polls_fed: u64,
    pub(crate) late_samples: u64,
    pub(crate) wall_s: f64,
    pub(crate) threads: usize,
    /// Engines (shards of hosts).
    pub(crate) engines: usize,
    pub(crate) gpu_polls_per_s: f64,
    pub(crate) gpu_polls_per_s_per_thread: f64,
}

impl RunStats {
    fn of(r: &RunOutput) -> Self {
        let per_s = r.gpu_polls as f64 / r.wall_s.max(1e-9);
        RunStats {
            gpus: r.spec.gpus,
            ticks: r.spec.ticks,
            gpu_hours: r.spec.gpu_hours(),
            gpu_polls: r.gpu_polls,
            polls_fed: r.polls_fed,
            late_samples: r.late_samples,
            wall_s: r.wall_s,
            threads: r.threads,
            engines: r.shards,
            gpu_polls_per_s: per_s,
            gpu_polls_per_s_per_thread: per_s / r.threads.max(1) as f64,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct FaultExample {
    pub(crate) kind: &'static str,
    pub(crate) outcome: &'static str,
    pub(crate) uuid: String,
    pub(crate) host: String,
    pub(crate) gpu: u32,
    /// Seconds since the start of the run.
    pub(crate) onset_s: f64,
    pub(crate) end_s: Option<f64>,
    /// Seconds since the start of the run of the first tick that showed it.
    pub(crate) shown_s: Option<f64>,
    pub(crate) shown_for_s: f64,
    /// Time to detect, s (detected faults only).
    pub(crate) ttd_s: Option<f64>,
    pub(crate) variant: Option<&'static str>,
    pub(crate) magnitude: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct IncidentExample {
    pub(crate) kind: String,
    pub(crate) joined: Vec<String>,
    pub(crate) severity: &'static str,
    pub(crate) uuid: String,
    pub(crate) host: String,
    pub(crate) gpu: u32,
    pub(crate) opened_s: f64,
    pub(crate) cleared_s: Option<f64>,
    pub(crate) evidence: String,
    /// The injected faults on the same GPU, host and time (s), so that a
    /// false incident can be told from the side effect of a real fault.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) faults_nearby: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct FaultyReport {
    pub(crate) run: RunStats,
    /// Faults injected (simulator and harness) per GPU-hour.
    pub(crate) base_rate_per_gpu_hour: f64,
    pub(crate) faults_injected: u64,
    pub(crate) faults_by_simulator: u64,
    pub(crate) faults_by_harness: u64,
    pub(crate) faults_scored: u64,
    pub(crate) faults_detected: u64,
    pub(crate) recall: Option<f64>,
    pub(crate) incidents: u64,
    pub(crate) incidents_matched: u64,
    pub(crate) incidents_on_excluded: u64,
    pub(crate) incidents_false: u64,
    pub(crate) precision: Option<f64>,
    pub(crate) fault_kinds: Vec<FaultKindRow>,
    pub(crate) detector_kinds: Vec<DetectorKindRow>,
    pub(crate) missed: Vec<FaultExample>,
    /// The slowest detections of each fault kind, slowest first.
    pub(crate) slowest: Vec<FaultExample>,
    pub(crate) false_incidents: Vec<IncidentExample>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct CleanKindRow {
    pub(crate) kind: String,
    pub(crate) incidents: u64,
    pub(crate) critical: u64,
    pub(crate) per_healthy_gpu_hour: f64,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct CleanReport {
    pub(crate) run: RunStats,
    pub(crate) healthy_gpu_hours: f64,
    pub(crate) false_alerts: u64,
    pub(crate) false_alerts_per_healthy_gpu_hour: f64,
    /// 95 % upper bound (rule of three when there are none).
    pub(crate) false_alerts_per_healthy_gpu_hour_bound95: f64,
    pub(crate) critical_false_alerts: u64,
    pub(crate) critical_per_100k_gpu_hours: f64,
    pub(crate) critical_per_100k_gpu_hours_bound95: f64,
    pub(crate) by_kind: Vec<CleanKindRow>,
    /// The GPU with the most false alerts, and how many.
    pub(crate) worst_gpu: Option<(String, u64)>,
    pub(crate) examples: Vec<IncidentExample>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct DerivedPrecision {
    pub(crate) faults_per_gpu_hour: f64,
    /// With the measured false-alert rate.
    pub(crate) precision: Option<f64>,
    /// With the 95 % upper bound of the false-alert rate (rule of three when
    /// the clean run had none): what the run can vouch for.
    pub(crate) precision_at_fp_bound95: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Goal {
    pub(crate) goal: String,
    pub(crate) value: String,
    /// `None`: not measured, or the run is too small to tell.
    pub(crate) met: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct HealthReport {
    pub(crate) kind: &'static str,
    pub(crate) config: ReportConfig,
    pub(crate) rules: Rules,
    pub(crate) faulty: Option<FaultyReport>,
    pub(crate) clean: Option<CleanReport>,
    /// Precision at production base rates, from the faulty run's recall and
    /// the clean run's false alerts (research §3.2).
    pub(crate) derived_precision: Vec<DerivedPrecision>,
    pub(crate) goals: Vec<Goal>,
    pub(crate) notes: Vec<String>,
}

fn rules(spec: &RunSpec, grace_ms: i64) -> Rules {
    Rules {
        grace_ms,
        matching: "per incident and per GPU (UUID): an incident matches a fault when one of its signals (the kind that opened it, or a kind that joined it later, at the virtual time the engine reported it) is of an expected kind and falls in [fault onset, fault end + grace], both included; a fault without an end lasts to the end of the run; a fault is detected by its earliest matching signal; further matching incidents are duplicates, not false positives",
        exclusion: format!(
            "not scored, counted: 'not shown' = the metrics never showed the fault (shown_ticks 0), or a thermal_throttle, straggler or clock_degraded showed for less than {} s; 'masked' = undetected while an incident with an expected kind was already open on its GPU at its onset; incidents that match only excluded faults are not false positives",
            score::SLOW_KINDS_MIN_SHOWN_MS / 1000
        ),
        time_to_detect: "detection time (virtual clock at which the engine reported the matching signal) minus the time of the fault's first shown tick (its onset if it has none); in polls: divided by the poll interval",
        precision: "incidents matching a scored fault / (those + incidents matching no fault); per fault kind: the incidents matching a fault of that kind, against unmatched incidents carrying one of its expected kinds; per detector kind: by the kind that opened the incident",
        false_alerts: "every incident of the fault-free run, per healthy GPU-hour (GPUs x virtual hours); critical = reached critical severity",
        agent_silent: "harness fault: a host's polls are held back for 1-10 min, then delivered at once (late, as an agent's spool does), then live again; one ground-truth entry per GPU of the host, shown throughout",
        peer_groups: format!(
            "one engine per shard of hosts (about {HOSTS_PER_SHARD}, at least {MIN_HOSTS_PER_SHARD} where the fleet has them): peers are the GPUs of a host, the fleet for drift is the shard ({} shard(s) in this run)",
            spec.shards().len()
        ),
        expected: score::EXPECTED
            .iter()
            .map(|(k, e)| (*k, e.iter().map(|x| x.name()).collect()))
            .collect(),
    }
}

fn example_of(r: &RunOutput, inc: &Incident) -> IncidentExample {
    let secs = |t: i64| (t - START_MS) as f64 / 1000.0;
    IncidentExample {
        kind: inc.kind_name(),
        joined: inc.signals[1..]
            .iter()
            .map(|s| match s.xid {
                Some(x) => format!("{} {x}", s.kind),
                None => s.kind.to_string(),
            })
            .collect(),
        severity: inc.severity.as_str(),
        uuid: r.uuids.get(inc.gpu as usize).cloned().unwrap_or_default(),
        host: host_name(u64::from(inc.gpu / GPUS_PER_HOST)),
        gpu: inc.gpu % GPUS_PER_HOST,
        opened_s: secs(inc.opened_ms()),
        cleared_s: inc.cleared_ms.map(secs),
        evidence: inc.evidence.clone(),
        faults_nearby: r
            .truth
            .iter()
            .filter(|t| t.gpu / GPUS_PER_HOST == inc.gpu / GPUS_PER_HOST)
            .map(|t| {
                format!(
                    "{} on GPU {} from {:.0} s to {}",
                    t.kind,
                    t.gpu % GPUS_PER_HOST,
                    secs(t.onset_ms),
                    t.end_ms
                        .map_or("the end".into(), |e| format!("{:.0} s", secs(e)))
                )
            })
            .collect(),
    }
}

fn faulty_report(r: &RunOutput, grace_ms: i64) -> FaultyReport {
    let s = score::score(&r.truth, &r.incidents, grace_ms, r.spec.end_ms());
    let fault_kinds = score::fault_rows(&r.truth, &r.incidents, &s, r.spec.interval_ms);
    let detector_kinds = score::detector_rows(&r.incidents, &s);
    let count = |o: IncidentOutcome| s.incidents.iter().filter(|x| **x == o).count() as u64;
    let (matched, on_excl, false_) = (
        count(IncidentOutcome::Matched),
        count(IncidentOutcome::OnExcluded),
        count(IncidentOutcome::False),
    );
    let scored: u64 = fault_kinds.iter().map(|k| k.scored).sum();
    let detected: u64 = fault_kinds.iter().map(|k| k.detected).sum();
    let harness = r.truth.iter().filter(|t| t.kind == AGENT_SILENT).count() as u64;
    let secs = |t: i64| (t - START_MS) as f64 / 1000.0;
    let example = |t: &TruthFault, o: &FaultOutcome| FaultExample {
        kind: t.kind,
        outcome: match o {
            FaultOutcome::Missed => "missed",
            FaultOutcome::NotShown => "not_shown",
            FaultOutcome::Masked => "masked",
            FaultOutcome::Detected { .. } => "detected",
        },
        uuid: r.uuids.get(t.gpu as usize).cloned().unwrap_or_default(),
        host: host_name(u64::from(t.gpu / GPUS_PER_HOST)),
        gpu: t.gpu % GPUS_PER_HOST,
        onset_s: secs(t.onset_ms),
        end_s: t.end_ms.map(secs),
        shown_s: t.shown_ms.map(secs),
        shown_for_s: t.shown_for_ms as f64 / 1000.0,
        ttd_s: match o {
            FaultOutcome::Detected { ttd_ms, .. } => Some(*ttd_ms as f64 / 1000.0),
            _ => None,
        },
        variant: t.variant,
        magnitude: t.magnitude,
    };
    let missed = r
        .truth
        .iter()
        .zip(&s.faults)
        .filter(|(_, o)| !matches!(o, FaultOutcome::Detected { .. }))
        .take(EXAMPLES)
        .map(|(t, o)| example(t, o))
        .collect();
    // The slowest detections of each kind, slowest first: what holds back
    // the p95.
    let mut by_ttd: Vec<(&str, i64, usize)> = s
        .faults
        .iter()
        .enumerate()
        .filter_map(|(i, o)| match o {
            FaultOutcome::Detected { ttd_ms, .. } => Some((r.truth[i].kind, -*ttd_ms, i)),
            _ => None,
        })
        .collect();
    by_ttd.sort_unstable();
    let mut slowest = Vec::new();
    for run in by_ttd.chunk_by(|a, b| a.0 == b.0) {
        slowest.extend(
            run.iter()
                .take(SLOWEST_PER_KIND)
                .map(|&(_, _, i)| example(&r.truth[i], &s.faults[i])),
        );
    }
    let false_incidents = r
        .incidents
        .iter()
        .zip(&s.incidents)
        .filter(|(_, o)| **o == IncidentOutcome::False)
        .take(EXAMPLES)
        .map(|(i, _)| example_of(r, i))
        .collect();
    let gpu_hours = r.spec.gpu_hours();
    FaultyReport {
        run: RunStats::of(r),
        base_rate_per_gpu_hour: r.truth.len() as f64 / gpu_hours.max(1e-12),
        faults_injected: r.truth.len() as u64,
        faults_by_simulator: r.truth.len() as u64 - harness,
        faults_by_harness: harness,
        faults_scored: scored,
        faults_detected: detected,
        recall: (scored > 0).then(|| detected as f64 / scored as f64),
        incidents: r.incidents.len() as u64,
        incidents_matched: matched,
        incidents_on_excluded: on_excl,
        incidents_false: false_,
        precision: (matched + false_ > 0).then(|| matched as f64 / (matched + false_) as f64),
        fault_kinds,
        detector_kinds,
        missed,
        slowest,
        false_incidents,
    }
}

fn clean_report(r: &RunOutput) -> CleanReport {
    let gh = r.spec.gpu_hours().max(1e-12);
    let n = r.tally.incidents();
    let crit = r.tally.critical();
    // Rule of three: no event in N GPU-hours bounds the rate at 3/N (95 %).
    let bound = |k: u64| if k == 0 { 3.0 / gh } else { k as f64 / gh };
    let mut by_kind: Vec<CleanKindRow> = r
        .tally
        .by_kind
        .iter()
        .map(|(k, &(n, c))| CleanKindRow {
            kind: k.clone(),
            incidents: n,
            critical: c,
            per_healthy_gpu_hour: n as f64 / gh,
        })
        .collect();
    by_kind.sort_by_key(|r| kind_order(&r.kind));
    let worst_gpu = r
        .tally
        .per_gpu
        .iter()
        .max_by_key(|(g, n)| (**n, std::cmp::Reverse(**g)))
        .map(|(g, n)| (r.uuids.get(*g as usize).cloned().unwrap_or_default(), *n));
    CleanReport {
        run: RunStats::of(r),
        healthy_gpu_hours: gh,
        false_alerts: n,
        false_alerts_per_healthy_gpu_hour: n as f64 / gh,
        false_alerts_per_healthy_gpu_hour_bound95: bound(n),
        critical_false_alerts: crit,
        critical_per_100k_gpu_hours: crit as f64 / gh * 1e5,
        critical_per_100k_gpu_hours_bound95: bound(crit) * 1e5,
        by_kind,
        worst_gpu,
        examples: r.tally.examples.iter().map(|i| example_of(r, i)).collect(),
    }
}

/// Sort key of a detector-kind name (`xid 79`, `ecc`, ...): [`Kind::ALL`]
/// order, XIDs by number.
pub(crate) fn kind_order(name: &str) -> (usize, u32) {
    let mut it = name.split(' ');
    let k = it
        .next()
        .and_then(Kind::from_name)
        .map_or(usize::MAX, |k| k as usize);
    (k, it.next().and_then(|x| x.parse().ok()).unwrap_or(0))
}

/// The goals of the issue, checked against the results.
fn goals(f: Option<&FaultyReport>, c: Option<&CleanReport>) -> Vec<Goal> {
    let mut out = Vec::new();
    let fmt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.3}"));
    if let Some(f) = f {
        for row in &f.fault_kinds {
            if row.injected == 0 {
                continue;
            }
            out.push(Goal {
                goal: format!("{}: precision >= 0.95 and recall >= 0.95", row.kind),
                value: format!(
                    "precision {}, recall {} ({} of {})",
                    fmt(row.precision),
                    fmt(row.recall),
                    row.detected,
                    row.scored
                ),
                met: match (row.precision, row.recall) {
                    (Some(p), Some(r)) => Some(p >= 0.95 && r >= 0.95),
                    (None, Some(r)) => Some(r >= 0.95),
                    _ => None,
                },
            });
            let within_polls = matches!(
                row.kind,
                "xid79_fallen_off_bus" | "xid48_double_bit_ecc" | "zombie"
            );
            let (goal, met) = if within_polls {
                (
                    format!("{}: detected within 2 polls (p95)", row.kind),
                    row.ttd_polls.map(|t| t.p95 <= 2.0),
                )
            } else {
                (
                    format!("{}: time to detect p95 <= 10 s", row.kind),
                    row.ttd_s.map(|t| t.p95 <= 10.0),
                )
            };
            out.push(Goal {
                goal,
                value: match (row.ttd_s, row.ttd_polls) {
                    (Some(s), Some(p)) => format!("p95 {:.1} s = {:.1} polls", s.p95, p.p95),
                    _ => "-".into(),
                },
                met,
            });
        }
    }
    if let Some(c) = c {
        let big = c.healthy_gpu_hours >= 300_000.0;
        out.push(Goal {
            goal:
                "false critical alerts <= 1 per 100,000 healthy GPU-hours, on >= 300,000 GPU-hours"
                    .into(),
            value: format!(
                "{} in {:.0} GPU-hours = {:.2} per 100k (95 % bound {:.2})",
                c.critical_false_alerts,
                c.healthy_gpu_hours,
                c.critical_per_100k_gpu_hours,
                c.critical_per_100k_gpu_hours_bound95
            ),
            met: if c.critical_per_100k_gpu_hours > 1.0 {
                Some(false)
            } else if big {
                Some(c.critical_per_100k_gpu_hours_bound95 <= 1.0 || c.critical_false_alerts <= 3)
            } else {
                None
            },
        });
    }
    out
}

/// Runs what `args` asks and builds the report.
pub(crate) fn bench(a: &HealthArgs) -> anyhow::Result<HealthReport> {
    if a.gpus == 0 {
        bail!("--gpus must be at least 1");
    }
    if !(a.hours.is_finite() && a.hours > 0.0) {
        bail!("--hours must be greater than zero");
    }
    if !(a.fault_rate.is_finite() && a.fault_rate >= 0.0) {
        bail!("--fault-rate must be 0 or more");
    }
    if !(0.0..=1.0).contains(&a.drift_node_probability) {
        bail!("--drift-node-probability must be in [0, 1]");
    }
    if !(a.agent_silences.is_finite() && a.agent_silences >= 0.0) {
        bail!("--agent-silences must be 0 or more");
    }
    let interval_ms = i64::try_from(a.interval.as_millis())
        .ok()
        .filter(|&v| v >= 1)
        .context("--interval must be at least 1 ms")?;
    let ticks = (a.hours * 3.6e6 / interval_ms as f64).round().max(1.0) as u64;
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let grace_ms = a.grace.as_millis() as i64;
    let base = RunSpec {
        faulty: false,
        gpus: a.gpus,
        ticks,
        interval_ms,
        seed: a.seed,
        fault_rate: a.fault_rate,
        drift_node_probability: a.drift_node_probability,
        agent_silences: a.agent_silences,
        threads,
        scheduled: Vec::new(),
        silences: Vec::new(),
        progress: true,
    };
    let faulty = matches!(a.mode, HealthMode::Both | HealthMode::Faulty).then(|| {
        eprintln!(
            "bench: health faulty run: {} GPUs x {} h, seed {}, {} faults per GPU-hour",
            a.gpus, a.hours, a.seed, a.fault_rate
        );
        simulate(&RunSpec {
            faulty: true,
            ..base.clone()
        })
    });
    let clean = matches!(a.mode, HealthMode::Both | HealthMode::Clean).then(|| {
        eprintln!(
            "bench: health clean run: {} GPUs x {} h, seed {}, no faults",
            a.gpus, a.hours, a.seed
        );
        simulate(&base)
    });
    Ok(report(
        &base,
        a.mode,
        a.hours,
        grace_ms,
        faulty.as_ref(),
        clean.as_ref(),
    ))
}

pub(crate) fn report(
    base: &RunSpec,
    mode: HealthMode,
    hours: f64,
    grace_ms: i64,
    faulty: Option<&RunOutput>,
    clean: Option<&RunOutput>,
) -> HealthReport {
    let f = faulty.map(|r| faulty_report(r, grace_ms));
    let c = clean.map(clean_report);
    let mut derived = Vec::new();
    if let (Some(f), Some(c)) = (&f, &c)
        && let Some(recall) = f.recall
    {
        let fp = c.false_alerts_per_healthy_gpu_hour;
        let bound = c.false_alerts_per_healthy_gpu_hour_bound95;
        for lambda in [2e-5, 1e-4, f.base_rate_per_gpu_hour] {
            let tp = recall * lambda;
            let p = |fp: f64| (tp + fp > 0.0).then(|| tp / (tp + fp));
            derived.push(DerivedPrecision {
                faults_per_gpu_hour: lambda,
                precision: p(fp),
                precision_at_fp_bound95: p(bound),
            });
        }
    }
    let mut notes = vec![
        "expected detector kinds per fault kind: see rules.expected; the engine merges one failure's signals into one incident (memory: xid 48/63/64/92/94/95, ecc, row_remap; lost: xid 79, telemetry_gap, zombie; slowdown: thermal/power throttle, clock_degraded, straggler)".to_string(),
        format!(
            "false alerts come from the fault-free run, recall, precision and time to detect from the faulty run; base rate of the faulty run: {}",
            f.as_ref()
                .map_or("-".into(), |f| format!("{:.4} faults per GPU-hour", f.base_rate_per_gpu_hour))
        ),
    ];
    if base.seed < FIRST_HELD_OUT_SEED {
        notes.push(format!(
            "seed {} is a tuning seed (< {FIRST_HELD_OUT_SEED}): these figures are not a held-out score",
            base.seed
        ));
    }
    let goals = goals(f.as_ref(), c.as_ref());
    HealthReport {
        kind: "health",
        config: ReportConfig {
            gpus: base.gpus,
            hosts: base.hosts(),
            hours,
            interval_ms: base.interval_ms,
            seed: base.seed,
            held_out_seed: base.seed >= FIRST_HELD_OUT_SEED,
            fault_rate_per_gpu_hour: base.fault_rate,
            drift_node_probability: base.drift_node_probability,
            agent_silences: base.agent_silences,
            grace_ms,
            threads: base.threads,
            mode,
            start_ms: START_MS,
        },
        rules: rules(base, grace_ms),
        faulty: f,
        clean: c,
        derived_precision: derived,
        goals,
        notes,
    }
}

// ---- Text output ----

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

/// The report as text: the fault-kind table, the detector-kind table, a
/// summary and the goals.
pub(crate) fn render(r: &HealthReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let c = &r.config;
    let _ = writeln!(
        s,
        "gpulse-bench health: {} GPUs ({} hosts) x {} h at {} ms, seed {} ({}), grace {} s",
        c.gpus,
        c.hosts,
        c.hours,
        c.interval_ms,
        c.seed,
        if c.held_out_seed {
            "held out"
        } else {
            "TUNING seed"
        },
        c.grace_ms / 1000
    );
    if let Some(f) = &r.faulty {
        let _ = writeln!(
            s,
            "\nfaulty run: {:.0} GPU-hours, {} faults injected ({} by the simulator at {} per GPU-hour plus {} drift probability per host, {} agent_silent GPU entries); base rate {:.4} per GPU-hour",
            f.run.gpu_hours,
            f.faults_injected,
            f.faults_by_simulator,
            c.fault_rate_per_gpu_hour,
            c.drift_node_probability,
            f.faults_by_harness,
            f.base_rate_per_gpu_hour
        );
        let _ = writeln!(
            s,
            "{:<22} {:>8} {:>6} {:>9} {:>6} {:>8} {:>6} {:>9} {:>9}  {:>22} {:>9} {:>4}",
            "fault kind",
            "injected",
            "scored",
            "not-shown",
            "masked",
            "detected",
            "recall",
            "precision",
            "false-inc",
            "TTD p50/p95/max s",
            "p95 polls",
            "dup"
        );
        for k in &f.fault_kinds {
            let ttd = k.ttd_s.map_or_else(
                || "-".into(),
                |t| format!("{:.1}/{:.1}/{:.1}", t.p50, t.p95, t.max),
            );
            let _ = writeln!(
                s,
                "{:<22} {:>8} {:>6} {:>9} {:>6} {:>8} {:>6} {:>9} {:>9}  {:>22} {:>9} {:>4}",
                k.kind,
                k.injected,
                k.scored,
                k.not_shown,
                k.masked,
                k.detected,
                opt(k.recall, 3),
                opt(k.precision, 3),
                k.false_incidents,
                ttd,
                opt(k.ttd_polls.map(|t| t.p95), 1),
                k.duplicates
            );
        }
        let _ = writeln!(
            s,
            "overall: recall {} ({} of {} scored), precision {} ({} matched, {} false, {} on excluded faults of {} incidents)",
            opt(f.recall, 3),
            f.faults_detected,
            f.faults_scored,
            opt(f.precision, 3),
            f.incidents_matched,
            f.incidents_false,
            f.incidents_on_excluded,
            f.incidents
        );
    }
    // Detector kinds: faulty-run precision beside the clean run's false alerts.
    let mut names: Vec<String> = Vec::new();
    if let Some(f) = &r.faulty {
        names.extend(f.detector_kinds.iter().map(|d| d.kind.clone()));
    }
    if let Some(c) = &r.clean {
        names.extend(c.by_kind.iter().map(|d| d.kind.clone()));
    }
    names.sort_by_key(|n| kind_order(n));
    names.dedup();
    if !names.is_empty() {
        let _ = writeln!(
            s,
            "\n{:<18} {:>9} {:>8} {:>7} {:>7} {:>6} {:>9}   {:>11} {:>9} {:>18}",
            "detector kind",
            "incidents",
            "critical",
            "matched",
            "on-excl",
            "false",
            "precision",
            "clean: inc.",
            "critical",
            "per healthy GPU-h"
        );
        for n in &names {
            let d = r
                .faulty
                .as_ref()
                .and_then(|f| f.detector_kinds.iter().find(|d| &d.kind == n));
            let cl = r
                .clean
                .as_ref()
                .and_then(|c| c.by_kind.iter().find(|d| &d.kind == n));
            let u = |v: Option<u64>| v.map_or_else(|| "-".into(), |v| v.to_string());
            let _ = writeln!(
                s,
                "{:<18} {:>9} {:>8} {:>7} {:>7} {:>6} {:>9}   {:>11} {:>9} {:>18}",
                n,
                u(d.map(|d| d.incidents)),
                u(d.map(|d| d.critical)),
                u(d.map(|d| d.matched)),
                u(d.map(|d| d.on_excluded)),
                u(d.map(|d| d.false_positives)),
                opt(d.and_then(|d| d.precision), 3),
                u(cl.map(|c| c.incidents)),
                u(cl.map(|c| c.critical)),
                cl.map_or_else(|| "-".into(), |c| format!("{:.2e}", c.per_healthy_gpu_hour)),
            );
        }
    }
    if let Some(cr) = &r.clean {
        let _ = writeln!(
            s,
            "\nclean run: {:.0} healthy GPU-hours, {} false alerts = {:.2e} per GPU-hour (95 % bound {:.2e}); {} critical = {:.2} per 100,000 GPU-hours (95 % bound {:.2}){}",
            cr.healthy_gpu_hours,
            cr.false_alerts,
            cr.false_alerts_per_healthy_gpu_hour,
            cr.false_alerts_per_healthy_gpu_hour_bound95,
            cr.critical_false_alerts,
            cr.critical_per_100k_gpu_hours,
            cr.critical_per_100k_gpu_hours_bound95,
            cr.worst_gpu
                .as_ref()
                .map_or_else(String::new, |(u, n)| format!("; worst GPU {u} with {n}"))
        );
    }
    if !r.derived_precision.is_empty() {
        let parts: Vec<String> = r
            .derived_precision
            .iter()
            .map(|d| {
                format!(
                    "{:.0e}: {} (>= {})",
                    d.faults_per_gpu_hour,
                    opt(d.precision, 4),
                    opt(d.precision_at_fp_bound95, 4)
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "precision at base rates (faults per GPU-hour; >= with the 95 % bound of the false-alert rate): {}",
            parts.join(", ")
        );
    }
    for (name, run) in [
        ("faulty", r.faulty.as_ref().map(|f| &f.run)),
        ("clean", r.clean.as_ref().map(|c| &c.run)),
    ] {
        if let Some(run) = run {
            let _ = writeln!(
                s,
                "throughput ({name}): {:.2} M GPU-polls/s on {} thread(s), {} engine(s) = {:.2} M per thread ({} GPU-polls in {:.1} s; {} late samples)",
                run.gpu_polls_per_s / 1e6,
                run.threads,
                run.engines,
                run.gpu_polls_per_s_per_thread / 1e6,
                run.gpu_polls,
                run.wall_s,
                run.late_samples
            );
        }
    }
    let _ = writeln!(
        s,
        "\nrules: grace {} s after a fault's end; {}",
        r.rules.grace_ms / 1000,
        r.rules.exclusion
    );
    let exp: Vec<String> = r
        .rules
        .expected
        .iter()
        .map(|(k, v)| format!("{k} -> {}", v.join("|")))
        .collect();
    let _ = writeln!(s, "expected: {}", exp.join("; "));
    for n in &r.notes[1..] {
        let _ = writeln!(s, "note: {n}");
    }
    if !r.goals.is_empty() {
        let _ = writeln!(s, "\ngoals:");
        for g in &r.goals {
            let mark = match g.met {
                Some(true) => "met    ",
                Some(false) => "NOT met",
                None => "n/a    ",
            };
            let _ = writeln!(s, "  {mark} {} ({})", g.goal, g.value);
        }
    }
    s
}

/// `gpulse-bench health`.
pub(crate) fn run(a: &HealthArgs) -> anyhow::Result<()> {
    let r = bench(a)?;
    print!("{}", render(&r));
    if let Some(path) = &a.json {
        let f =
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
        serde_json::to_writer_pretty(std::io::BufWriter::new(f), &r)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
