//! Fault injection for the simulated fleet, and its ground truth.
//!
//! Faults come from two places, both deterministic:
//! - [`FaultConfig::scheduled`]: explicit faults at fixed ticks (tests, scenarios);
//! - [`FaultConfig::random_per_gpu_hour`]: a seeded random schedule. Every GPU
//!   has its own fault stream (seed × GPU index), independent of the stream
//!   that drives its healthy readings, so turning faults on never changes the
//!   readings of a GPU that has none. Random faults on a GPU never overlap;
//!   the next one is drawn when the previous one starts, so it is known a tick
//!   ahead (a zombie needs the tick before it starts).
//!
//! A tick is one `sample` call (tick 0 is the first). A fault is active for
//! the ticks `start_tick..end_tick`; `end_tick: None` means it lasts until the
//! end of the run (XID 79 and XID 48 need a reset or a reboot to clear).
//!
//! What each fault does to the readings (the constants are in [`super`]):
//!
//! | kind | effect |
//! | --- | --- |
//! | thermal throttle | cooling fails: temperature climbs 3 °C/s above the healthy model, capped at `SLOWDOWN_TEMP_C + 3`; at or above `SLOWDOWN_TEMP_C` the SM clock is cut to at most `THROTTLED_SM_CLOCK_MHZ`, dynamic power halves, and the clock-event reasons show HW slowdown + HW thermal. After the fault the excess heat decays with a 20 s time constant |
//! | straggler | utilization × 0.6 (so power, activity ratios and temperature follow) and the SM clock capped at `STRAGGLER_SM_CLOCK_MHZ` while busy; clock-event reason SW power cap |
//! | XID 79 | fallen off the bus: from its tick on the GPU reports only `DCGM_FI_DEV_XID_ERRORS = 79`. This is what dcgm-exporter shows: DCGM learns XID 79 from the kernel log (NVML cannot report it), every NVML-backed field fails with GPU_IS_LOST and dcgm-exporter skips blank fields. The GPU stays in the inventory |
//! | XID 48 | double-bit ECC error: `XID_ERRORS` becomes 48 (a last-value gauge, so it stays) and `UNCORRECTABLE_REMAPPED_ROWS` grows by one |
//! | row-remap growth | one more correctable remapped row every 30 s of simulated time (the first at the start tick), each with XID 63 (row-remap recording event) |
//! | zombie | keeps reporting, but every reading repeats, bit for bit, the GPU's readings of the tick before the fault (of tick 0 if it starts at 0), counters included |
//!
//! Faults compose: XID 79 hides everything else; a zombie freezes whatever
//! the GPU showed before it.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::catalog::Metric;
use crate::source::Reading;

/// A kind of injected fault. See the module docs for the effect of each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    ThermalThrottle,
    Straggler,
    Xid79FallenOffBus,
    Xid48DoubleBitEcc,
    RowRemapGrowth,
    Zombie,
}

impl FaultKind {
    pub const ALL: [FaultKind; 6] = [
        FaultKind::ThermalThrottle,
        FaultKind::Straggler,
        FaultKind::Xid79FallenOffBus,
        FaultKind::Xid48DoubleBitEcc,
        FaultKind::RowRemapGrowth,
        FaultKind::Zombie,
    ];

    /// The XID the fault raises, if any.
    pub fn xid(self) -> Option<u32> {
        match self {
            FaultKind::Xid79FallenOffBus => Some(79),
            FaultKind::Xid48DoubleBitEcc => Some(48),
            FaultKind::RowRemapGrowth => Some(63),
            _ => None,
        }
    }

    /// Whether the fault lasts until the end of the run, whatever its duration.
    pub fn is_permanent(self) -> bool {
        matches!(
            self,
            FaultKind::Xid79FallenOffBus | FaultKind::Xid48DoubleBitEcc
        )
    }

    /// The name used in ground-truth files.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::ThermalThrottle => "thermal_throttle",
            FaultKind::Straggler => "straggler",
            FaultKind::Xid79FallenOffBus => "xid79_fallen_off_bus",
            FaultKind::Xid48DoubleBitEcc => "xid48_double_bit_ecc",
            FaultKind::RowRemapGrowth => "row_remap_growth",
            FaultKind::Zombie => "zombie",
        }
    }

    /// Weight in the random mix, and the duration range in seconds of
    /// simulated time (ignored for permanent kinds).
    fn random_mix(self) -> (u32, std::ops::Range<u64>) {
        match self {
            FaultKind::ThermalThrottle => (30, 120..600),
            FaultKind::Straggler => (25, 300..1800),
            FaultKind::RowRemapGrowth => (20, 300..1200),
            FaultKind::Zombie => (15, 120..900),
            FaultKind::Xid48DoubleBitEcc => (6, 1..2),
            FaultKind::Xid79FallenOffBus => (4, 1..2),
        }
    }
}

/// One explicit fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledFault {
    /// Index of the GPU in the inventory.
    pub gpu: u32,
    pub kind: FaultKind,
    /// First tick (0-based count of `sample` calls) the fault affects.
    pub start_tick: u64,
    /// Ticks it lasts; `None`: until the end of the run. Ignored (always
    /// `None`) for the permanent kinds, XID 79 and XID 48.
    pub duration_ticks: Option<u64>,
}

/// Which faults a [`super::SimulatedSource`] injects. Default: none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Explicit faults, in addition to the random ones.
    pub scheduled: Vec<ScheduledFault>,
    /// Mean random faults per GPU per hour of simulated time (ticks ×
    /// `interval_ms`). Default 0: no random faults. The kinds are drawn with
    /// weights thermal 30, straggler 25, row-remap growth 20, zombie 15,
    /// XID 48 6, XID 79 4; durations 2-10 min (thermal), 5-30 min
    /// (straggler), 5-20 min (row remap), 2-15 min (zombie).
    pub random_per_gpu_hour: f64,
}

impl FaultConfig {
    /// The mix behind `gpulse agent --sim-faults`: one random fault per GPU
    /// per hour, so that an 8-GPU node shows one every ~7 minutes. That is
    /// far above real fleets (Llama 3: ~1 interruption per 3 h on 16,384
    /// GPUs), on purpose: a short run exercises every kind.
    pub fn typical() -> Self {
        Self {
            scheduled: Vec::new(),
            random_per_gpu_hour: 1.0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty() && self.random_per_gpu_hour <= 0.0
    }
}

/// One injected fault, as ground truth for scoring health detection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FaultEvent {
    /// Index of the GPU in the inventory (the `gpu` label).
    pub gpu: u32,
    pub uuid: String,
    pub kind: FaultKind,
    /// XID the fault raises (79, 48, 63), if any.
    pub xid: Option<u32>,
    /// First affected tick.
    pub start_tick: u64,
    /// First tick no longer affected; `None`: lasts until the end of the run.
    pub end_tick: Option<u64>,
    /// Wall-clock time of `start_tick`'s poll, if whoever ran the source
    /// recorded it (see [`FaultEvent::stamp`]); the simulator never reads the clock.
    pub start_ts_ms: Option<i64>,
    /// Wall-clock time of `end_tick`'s poll, if that poll happened and was recorded.
    pub end_ts_ms: Option<i64>,
}

impl FaultEvent {
    /// Fills the timestamps from `ts_of_tick` (the poll time of a tick, or
    /// `None` for a tick that was not polled).
    pub fn stamp(&mut self, ts_of_tick: impl Fn(u64) -> Option<i64>) {
        self.start_ts_ms = ts_of_tick(self.start_tick);
        self.end_ts_ms = self.end_tick.and_then(&ts_of_tick);
    }
}

/// The faults a simulator has injected so far, in the order they started
/// (by tick, then GPU index). Cheap to clone; clones share the log, so a
/// handle taken before the source is handed to the agent sees every fault.
#[derive(Debug, Clone, Default)]
pub struct GroundTruth(Arc<Mutex<Vec<FaultEvent>>>);

impl GroundTruth {
    /// A copy of the events so far.
    pub fn events(&self) -> Vec<FaultEvent> {
        self.lock().clone()
    }

    fn push(&self, e: FaultEvent) {
        self.lock().push(e);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<FaultEvent>> {
        // A panic while holding the lock cannot leave the Vec half-pushed.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// File format of a ground-truth export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroundTruthFormat {
    /// One JSON object per line; absent values are `null`.
    JsonLines,
    /// Header `gpu,uuid,kind,xid,start_tick,end_tick,start_ts_ms,end_ts_ms`;
    /// absent values are empty fields.
    Csv,
}

impl GroundTruthFormat {
    /// CSV for a `.csv` file name, JSON Lines otherwise.
    pub fn for_path(path: &Path) -> Self {
        match path.extension().and_then(|e| e.to_str()) {
            Some(e) if e.eq_ignore_ascii_case("csv") => GroundTruthFormat::Csv,
            _ => GroundTruthFormat::JsonLines,
        }
    }
}

/// Writes `events` to `w` in `format`.
///
/// # Errors
/// Those of `w`.
pub fn write_ground_truth(
    events: &[FaultEvent],
    format: GroundTruthFormat,
    mut w: impl Write,
) -> std::io::Result<()> {
    match format {
        GroundTruthFormat::JsonLines => {
            for e in events {
                serde_json::to_writer(&mut w, e)?;
                w.write_all(b"\n")?;
            }
        }
        GroundTruthFormat::Csv => {
            let mut c = csv::Writer::from_writer(&mut w);
            // Written by hand so that an empty export still has its header.
            c.write_record([
                "gpu",
                "uuid",
                "kind",
                "xid",
                "start_tick",
                "end_tick",
                "start_ts_ms",
                "end_ts_ms",
            ])?;
            let opt = |v: Option<String>| v.unwrap_or_default();
            for e in events {
                c.write_record([
                    e.gpu.to_string(),
                    e.uuid.clone(),
                    e.kind.as_str().to_string(),
                    opt(e.xid.map(|x| x.to_string())),
                    e.start_tick.to_string(),
                    opt(e.end_tick.map(|x| x.to_string())),
                    opt(e.start_ts_ms.map(|x| x.to_string())),
                    opt(e.end_ts_ms.map(|x| x.to_string())),
                ])?;
            }
            c.flush()?;
        }
    }
    w.flush()
}

/// A fault on one GPU, with its window in ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Planned {
    kind: FaultKind,
    start: u64,
    end: Option<u64>,
}

impl Planned {
    fn new(kind: FaultKind, start: u64, duration: Option<u64>) -> Self {
        let end = if kind.is_permanent() {
            None
        } else {
            duration.map(|d| start.saturating_add(d.max(1)))
        };
        Self { kind, start, end }
    }
}

/// The seeded random fault schedule of one GPU.
#[derive(Debug)]
struct RandomFaults {
    rng: ChaCha8Rng,
    /// Probability of a fault starting in a tick.
    per_tick: f64,
    interval_ms: u64,
}

impl RandomFaults {
    /// The next fault, starting after `after` (a tick).
    fn draw(&mut self, after: u64) -> Planned {
        // Exponential gaps: a Poisson process at `per_tick` faults per tick.
        let u = 1.0 - self.rng.random::<f64>(); // (0, 1]
        let gap = (-u.ln() / self.per_tick).ceil().clamp(1.0, 1e15) as u64;
        let total: u32 = FaultKind::ALL.iter().map(|k| k.random_mix().0).sum();
        let mut pick = self.rng.random_range(0..total);
        let mut kind = FaultKind::ThermalThrottle;
        for k in FaultKind::ALL {
            let w = k.random_mix().0;
            if pick < w {
                kind = k;
                break;
            }
            pick -= w;
        }
        let secs = self.rng.random_range(kind.random_mix().1);
        let ticks = (secs * 1000 / self.interval_ms.max(1)).max(1);
        Planned::new(kind, after.saturating_add(gap), Some(ticks))
    }
}

/// Temperature rise of a GPU whose cooling failed, °C per second.
const THERMAL_RISE_C_PER_S: f64 = 3.0;
/// Most heat a cooling fault adds over the healthy model, °C.
const THERMAL_MAX_EXCESS_C: f64 = 70.0;
/// Time constant of the cool-down after a cooling fault, s.
const THERMAL_DECAY_S: f64 = 20.0;
/// Simulated seconds between two remapped rows during row-remap growth.
const REMAP_EVERY_S: u64 = 30;

/// The fault state of one GPU; only GPUs that can have faults carry one.
#[derive(Debug)]
pub(super) struct FaultState {
    random: Option<RandomFaults>,
    next_random: Option<Planned>,
    /// Explicit faults not started yet, latest first (the next is popped off the end).
    scheduled: Vec<Planned>,
    active: Vec<Planned>,
    remap_every_ticks: u64,
    /// Heat above the healthy temperature model, °C.
    pub(super) excess_c: f64,
    /// Whether the last tick's temperature was at or above the slowdown threshold.
    pub(super) throttled: bool,
    /// Last XID (a last-value gauge, as dcgm-exporter's).
    pub(super) xid: u32,
    pub(super) uncorrectable_rows: u64,
    pub(super) correctable_rows: u64,
    lost: bool,
    /// A zombie's readings, repeated while it lasts.
    frozen: Vec<Reading>,
}

impl FaultState {
    /// The state of GPU `gpu`, or `None` when `config` can never give it a fault.
    pub(super) fn new(
        config: &FaultConfig,
        gpu: u32,
        stream: u64,
        interval_ms: u64,
    ) -> Option<Box<Self>> {
        let mut scheduled: Vec<Planned> = config
            .scheduled
            .iter()
            .filter(|f| f.gpu == gpu)
            .map(|f| Planned::new(f.kind, f.start_tick, f.duration_ticks))
            .collect();
        let per_tick = config.random_per_gpu_hour * interval_ms as f64 / 3_600_000.0;
        if scheduled.is_empty() && per_tick <= 0.0 {
            return None;
        }
        // Latest first, so that the next one to start is at the end.
        scheduled.sort_by_key(|p| std::cmp::Reverse(p.start));
        let mut random = (per_tick > 0.0).then(|| RandomFaults {
            rng: ChaCha8Rng::seed_from_u64(super::mix(stream ^ 0xfa17_5eed_0000_0001)),
            per_tick: per_tick.min(1.0),
            interval_ms,
        });
        // The first random fault may start at tick 0: draw as if "after" tick -1.
        let next_random = random.as_mut().map(|r| {
            let mut p = r.draw(0);
            p.start -= 1;
            p.end = p.end.map(|e| e - 1);
            p
        });
        Some(Box::new(Self {
            random,
            next_random,
            scheduled,
            active: Vec::new(),
            remap_every_ticks: (REMAP_EVERY_S * 1000 / interval_ms.max(1)).max(1),
            excess_c: 0.0,
            throttled: false,
            xid: 0,
            uncorrectable_rows: 0,
            correctable_rows: 0,
            lost: false,
            frozen: Vec::new(),
        }))
    }

    /// Starts and ends the faults of `tick` and applies their step effects
    /// (XIDs, remapped rows). Call before computing the tick's readings.
    pub(super) fn begin_tick(&mut self, tick: u64, gpu: u32, uuid: &str, truth: &GroundTruth) {
        self.active.retain(|p| p.end.is_none_or(|e| e > tick));
        while self.scheduled.last().is_some_and(|p| p.start <= tick) {
            let p = self.scheduled.pop().expect("BUG: checked non-empty");
            self.activate(p, gpu, uuid, truth);
        }
        if let Some(p) = self.next_random.filter(|p| p.start <= tick) {
            self.activate(p, gpu, uuid, truth);
            self.next_random = match (&mut self.random, p.end) {
                (Some(r), Some(end)) if !self.lost => Some(r.draw(end - 1)),
                _ => None,
            };
        }
        if !self.is_active(FaultKind::Zombie) {
            self.frozen.clear();
        }
        for p in &self.active {
            if p.kind == FaultKind::RowRemapGrowth
                && (tick - p.start).is_multiple_of(self.remap_every_ticks)
            {
                self.correctable_rows += 1;
                self.xid = 63;
            }
        }
    }

    fn activate(&mut self, p: Planned, gpu: u32, uuid: &str, truth: &GroundTruth) {
        truth.push(FaultEvent {
            gpu,
            uuid: uuid.to_string(),
            kind: p.kind,
            xid: p.kind.xid(),
            start_tick: p.start,
            end_tick: p.end,
            start_ts_ms: None,
            end_ts_ms: None,
        });
        match p.kind {
            FaultKind::Xid79FallenOffBus => {
                self.lost = true;
                self.xid = 79;
                // Nothing else can happen to a GPU that is gone.
                self.random = None;
                self.next_random = None;
            }
            FaultKind::Xid48DoubleBitEcc => {
                self.xid = 48;
                self.uncorrectable_rows += 1;
                // It needs a reset; no further random faults.
                self.random = None;
            }
            _ => {}
        }
        self.active.push(p);
    }

    pub(super) fn is_active(&self, kind: FaultKind) -> bool {
        self.active.iter().any(|p| p.kind == kind)
    }

    /// Writes the GPU's readings for `tick` at `write`: the ones it pushed
    /// (at `pushed`, never before `write`), or what replaces them (XID 79,
    /// zombie); returns where the next GPU's go. Keeps a snapshot for a
    /// zombie that starts at the next tick.
    pub(super) fn end_tick(
        &mut self,
        tick: u64,
        gpu: u32,
        out: &mut [Reading],
        pushed: std::ops::Range<usize>,
        write: usize,
    ) -> usize {
        let zombie = self.is_active(FaultKind::Zombie);
        let len = if self.lost {
            out[write] = Reading::new(gpu, Metric::XidErrors, 79.0);
            1
        } else if zombie && !self.frozen.is_empty() {
            // Never longer than what was pushed: a snapshot is either a full
            // tick or, for a lost GPU, a single reading.
            out[write..write + self.frozen.len()].copy_from_slice(&self.frozen);
            self.frozen.len()
        } else {
            let n = pushed.len();
            out.copy_within(pushed, write);
            n
        };
        let mine = write..write + len;
        if zombie && self.frozen.is_empty() {
            // Started at tick 0: there is no earlier tick to repeat.
            self.frozen.extend_from_slice(&out[mine.clone()]);
        }
        let next = tick + 1;
        let zombie_next = self
            .scheduled
            .iter()
            .rev()
            .take_while(|p| p.start == next)
            .chain(self.next_random.iter().filter(|p| p.start == next))
            .any(|p| p.kind == FaultKind::Zombie);
        if zombie_next && self.frozen.is_empty() {
            self.frozen.extend_from_slice(&out[mine.clone()]);
        }
        mine.end
    }

    /// Advances the excess heat by one tick of `dt_s` seconds.
    pub(super) fn step_heat(&mut self, dt_s: f64) {
        if self.is_active(FaultKind::ThermalThrottle) {
            self.excess_c = (self.excess_c + THERMAL_RISE_C_PER_S * dt_s).min(THERMAL_MAX_EXCESS_C);
        } else if self.excess_c > 0.0 {
            self.excess_c *= (-dt_s / THERMAL_DECAY_S).exp();
            if self.excess_c < 0.05 {
                self.excess_c = 0.0;
            }
        }
    }
}
