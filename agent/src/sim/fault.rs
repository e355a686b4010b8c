//! Fault injection for the simulated fleet, and its ground truth.
//!
//! Faults come from three places, all deterministic:
//! - [`FaultConfig::scheduled`]: explicit faults at fixed ticks (tests, scenarios);
//! - [`FaultConfig::random_per_gpu_hour`]: a seeded random schedule. Every GPU
//!   has its own fault stream (seed × GPU index), independent of the stream
//!   that drives its healthy readings, so turning faults on never changes the
//!   readings of a GPU that has none. Random faults on a GPU never overlap;
//!   the next one is drawn when the previous one starts, so it is known a tick
//!   ahead (a zombie needs the tick before it starts);
//! - [`FaultConfig::drift_node_probability`]: with that probability (a
//!   node-level seeded draw) the whole node runs another driver.
//!
//! A fault's grade (its [`FaultEvent::magnitude`] or [`FaultEvent::variant`])
//! is drawn when the fault is planned: from the random schedule's stream for
//! a random fault, from a stream of its own (seed × GPU index) for a
//! scheduled one, in the order of [`FaultConfig::scheduled`].
//!
//! A tick is one `sample` call (tick 0 is the first). A fault is active for
//! the ticks `start_tick..end_tick`; `end_tick: None` means it lasts until the
//! end of the run (XID 79 and XID 48 need a reset or a reboot to clear;
//! driver drift is how the node was installed).
//!
//! What each fault does to the readings (the constants are here and in [`super`]):
//!
//! | kind | effect |
//! | --- | --- |
//! | thermal throttle | cooling fails: temperature climbs above the healthy model at a rate drawn uniformly from [`THERMAL_RISE_C_PER_S`] (0.5-5 °C/s), capped at `SLOWDOWN_TEMP_C + 3`; on the way the boost clock falls as on any hot GPU, and at or above `SLOWDOWN_TEMP_C` the SM clock is cut to at most `THROTTLED_SM_CLOCK_MHZ`, dynamic power halves, and the clock-event reasons show HW slowdown + HW thermal. After the fault the excess heat decays with a 20 s time constant. A slow fault may end before it reaches the threshold (then `shown_ticks` is 0) |
//! | straggler | a slowdown `s` drawn uniformly from [`STRAGGLER_SLOWDOWN`] (5-30 %): while the GPU is busy, its utilization, every activity ratio (GR engine, SM active, SM occupancy, tensor / FP pipes, DRAM) and the dynamic part of its power are × (1 - s); temperature follows the lower power; the SM clock is not cut and no clock-event reason is set |
//! | clock degraded | a cut `s` drawn uniformly from [`CLOCK_DEGRADED_CUT`] (10-35 %): while the GPU is busy its SM clock is × (1 - s), rounded to 15 MHz, with no clock-event reason, and the dynamic part of its power × (1 - s/2); activity is unchanged |
//! | XID 79 | fallen off the bus: from its tick on the GPU reports only `DCGM_FI_DEV_XID_ERRORS = 79`. This is what dcgm-exporter shows: DCGM learns XID 79 from the kernel log (NVML cannot report it), every NVML-backed field fails with GPU_IS_LOST and dcgm-exporter skips blank fields. The GPU stays in the inventory |
//! | XID 48 | double-bit ECC error: `XID_ERRORS` becomes 48 (a last-value gauge, so it stays), `UNCORRECTABLE_REMAPPED_ROWS` grows by one and `ROW_REMAP_PENDING` becomes 1 (the remap applies at the next GPU reset, which the simulated GPU never gets) |
//! | row-remap growth | one more correctable remapped row every 30 s of simulated time (the first at the start tick), each with XID 63 ("Row Remapper: New row marked for remapping, reset gpu to activate"); `ROW_REMAP_PENDING` is 1 from the first row until the fault ends, which stands for the GPU reset that applies the remaps (the rows stay counted) |
//! | zombie, variant `frozen` (50 %) | keeps reporting, but every reading repeats, bit for bit, the GPU's readings of the tick before the fault (of tick 0 if it starts at 0), counters included |
//! | zombie, variant `hung` (50 %) | readings keep moving but no work is done: `GPU_UTIL` stays at the last busy value before the fault (100 if the GPU was idle), every activity ratio is noise below 0.005, power is idle power plus noise (so temperature relaxes toward idle), energy keeps integrating that power, the SM clock stays at the busy boost clock, memory used stays where it was |
//! | driver drift, variant `driver` | from tick 0 and for the whole run, every GPU of the node reports driver [`DRIFTED_DRIVER_VERSION`] instead of `550.54.15` (node-level, [`FaultConfig::drift_node_probability`]); readings unchanged |
//! | driver drift, variant `vbios` | a [`ScheduledFault`] of kind `DriverDrift`: that GPU reports VBIOS [`DRIFTED_VBIOS_VERSION`] from tick 0 (its `start_tick` and `duration_ticks` are ignored); readings unchanged |
//!
//! Faults compose: XID 79 hides everything else; a frozen zombie freezes
//! whatever the GPU showed before it; a hung zombie overrides a straggler's
//! and a degraded clock's effects.
//!
//! Ground truth ([`FaultEvent`]) records, besides the window, when the
//! metrics show the fault: `shown_tick` (first such tick) and `shown_ticks`
//! (how many), kept up to date while the fault is active. A tick shows
//! - thermal throttle: when the temperature is at or above `SLOWDOWN_TEMP_C`;
//! - straggler: when the GPU is busy in a synchronous job phase of its node
//!   (its peers do the same work; in an independent or idle phase a
//!   straggler cannot be told from its peers);
//! - clock degraded: when the GPU is busy (its clock is cut);
//! - zombie: every tick;
//! - XID 79: every tick (the GPU is gone); XID 48: every tick its XID gauge reads 48;
//! - row-remap growth: the ticks where a row is added;
//! - driver drift: tick 0 only (`shown_ticks` 1): it is in the inventory from the start.
//!
//! A fault hidden by another (anything but XID 79 on a lost GPU, anything
//! but the zombie on a frozen one, a straggler or a degraded clock on a hung
//! one) does not show.

use std::io::Write;
use std::ops::RangeInclusive;
use std::path::Path;
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;

use crate::catalog::Metric;
use crate::source::{GpuInfo, Reading};

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
    ClockDegraded,
    DriverDrift,
}

/// Slowdown of a straggler (fraction of its healthy work), drawn uniformly.
pub const STRAGGLER_SLOWDOWN: RangeInclusive<f64> = 0.05..=0.30;
/// Cut of a degraded SM clock (fraction of the healthy clock), drawn uniformly.
pub const CLOCK_DEGRADED_CUT: RangeInclusive<f64> = 0.10..=0.35;
/// Temperature rise of a GPU whose cooling failed, °C per second, drawn uniformly.
pub const THERMAL_RISE_C_PER_S: RangeInclusive<f64> = 0.5..=5.0;
/// Zombie variants ([`FaultEvent::variant`]), drawn 50/50.
pub const ZOMBIE_FROZEN: &str = "frozen";
pub const ZOMBIE_HUNG: &str = "hung";
/// Driver-drift variants: the whole node's driver, or one GPU's VBIOS.
pub const DRIFT_DRIVER: &str = "driver";
pub const DRIFT_VBIOS: &str = "vbios";
/// Driver version of a node with driver drift (the others run `550.54.15`).
pub const DRIFTED_DRIVER_VERSION: &str = "535.129.03";
/// VBIOS version of a GPU with VBIOS drift (the others run `96.00.89.00.01`).
pub const DRIFTED_VBIOS_VERSION: &str = "96.00.74.00.1C";

impl FaultKind {
    pub const ALL: [FaultKind; 8] = [
        FaultKind::ThermalThrottle,
        FaultKind::Straggler,
        FaultKind::Xid79FallenOffBus,
        FaultKind::Xid48DoubleBitEcc,
        FaultKind::RowRemapGrowth,
        FaultKind::Zombie,
        FaultKind::ClockDegraded,
        FaultKind::DriverDrift,
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
            FaultKind::Xid79FallenOffBus | FaultKind::Xid48DoubleBitEcc | FaultKind::DriverDrift
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
            FaultKind::ClockDegraded => "clock_degraded",
            FaultKind::DriverDrift => "driver_drift",
        }
    }

    /// Weight in the random mix, and the duration range in seconds of
    /// simulated time (ignored for permanent kinds). Driver drift is never
    /// drawn per GPU-hour: it is how a node was installed.
    fn random_mix(self) -> (u32, std::ops::Range<u64>) {
        match self {
            FaultKind::ThermalThrottle => (25, 120..600),
            FaultKind::Straggler => (20, 300..1800),
            FaultKind::ClockDegraded => (10, 300..1800),
            FaultKind::RowRemapGrowth => (15, 300..1200),
            FaultKind::Zombie => (15, 120..900),
            FaultKind::Xid48DoubleBitEcc => (6, 1..2),
            FaultKind::Xid79FallenOffBus => (4, 1..2),
            FaultKind::DriverDrift => (0, 1..2),
        }
    }

    /// Draws the grade of a fault of this kind: its magnitude and variant.
    fn draw_grade(self, rng: &mut ChaCha8Rng) -> (Option<f64>, Option<&'static str>) {
        // Four decimals: what the ground-truth file shows is what was applied.
        let mut uniform = |r: RangeInclusive<f64>| {
            let v: f64 = rng.random_range(r.clone());
            Some(((v * 1e4).round() / 1e4).clamp(*r.start(), *r.end()))
        };
        match self {
            FaultKind::ThermalThrottle => (uniform(THERMAL_RISE_C_PER_S), None),
            FaultKind::Straggler => (uniform(STRAGGLER_SLOWDOWN), None),
            FaultKind::ClockDegraded => (uniform(CLOCK_DEGRADED_CUT), None),
            FaultKind::Zombie => (
                None,
                Some(if rng.random_bool(0.5) {
                    ZOMBIE_FROZEN
                } else {
                    ZOMBIE_HUNG
                }),
            ),
            _ => (None, None),
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
    /// Ignored (always 0) for driver drift.
    pub start_tick: u64,
    /// Ticks it lasts; `None`: until the end of the run. Ignored (always
    /// `None`) for the permanent kinds, XID 79, XID 48 and driver drift.
    pub duration_ticks: Option<u64>,
}

/// Which faults a [`super::SimulatedSource`] injects. Default: none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FaultConfig {
    /// Explicit faults, in addition to the random ones.
    pub scheduled: Vec<ScheduledFault>,
    /// Mean random faults per GPU per hour of simulated time (ticks ×
    /// `interval_ms`). Default 0: no random faults. The kinds are drawn with
    /// weights thermal 25, straggler 20, row-remap growth 15, zombie 15,
    /// clock degraded 10, XID 48 6, XID 79 4 (never driver drift); durations
    /// 2-10 min (thermal), 5-30 min (straggler, clock degraded), 5-20 min
    /// (row remap), 2-15 min (zombie).
    pub random_per_gpu_hour: f64,
    /// Probability that the whole node runs another driver
    /// ([`DRIFTED_DRIVER_VERSION`]), drawn once from a node-level seeded
    /// stream. Default 0.
    pub drift_node_probability: f64,
}

impl FaultConfig {
    /// The mix behind `gpulse agent --sim-faults`: one random fault per GPU
    /// per hour, so that an 8-GPU node shows one every ~7 minutes, and one
    /// node in 50 on another driver. That is far above real fleets (Llama 3:
    /// ~1 interruption per 3 h on 16,384 GPUs), on purpose: a short run
    /// exercises every kind.
    pub fn typical() -> Self {
        Self {
            scheduled: Vec::new(),
            random_per_gpu_hour: 1.0,
            drift_node_probability: 0.02,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.scheduled.is_empty()
            && self.random_per_gpu_hour <= 0.0
            && self.drift_node_probability <= 0.0
    }
}

/// One injected fault, as ground truth for scoring health detection.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
    /// The fault's grade: the slowdown fraction of a straggler, the clock
    /// cut of a degraded clock, the rise in °C/s of a thermal fault; `None`
    /// for the other kinds.
    pub magnitude: Option<f64>,
    /// `frozen` or `hung` for a zombie, `driver` or `vbios` for driver
    /// drift; `None` for the other kinds.
    pub variant: Option<&'static str>,
    /// First tick at which the metrics show the fault (see the module docs);
    /// `None` while they have not.
    pub shown_tick: Option<u64>,
    /// Ticks at which the metrics showed the fault so far.
    pub shown_ticks: u64,
}

impl FaultEvent {
    /// Fills the timestamps from `ts_of_tick` (the poll time of a tick, or
    /// `None` for a tick that was not polled).
    pub fn stamp(&mut self, ts_of_tick: impl Fn(u64) -> Option<i64>) {
        self.start_ts_ms = ts_of_tick(self.start_tick);
        self.end_ts_ms = self.end_tick.and_then(&ts_of_tick);
    }
}

/// The faults a simulator has injected so far. Cheap to clone; clones share
/// the log, so a handle taken before the source is handed to the agent sees
/// every fault, and the `shown_*` fields of active faults as they grow.
#[derive(Debug, Clone, Default)]
pub struct GroundTruth(Arc<Mutex<Vec<FaultEvent>>>);

impl GroundTruth {
    /// An up-to-date copy of the events so far, in the order they started
    /// (by tick, then GPU index).
    pub fn events(&self) -> Vec<FaultEvent> {
        let mut v = self.lock().clone();
        // Stable: a GPU's faults of one tick stay in the order they started.
        v.sort_by_key(|e| (e.start_tick, e.gpu));
        v
    }

    /// Appends `e`; returns its index in the log.
    fn push(&self, e: FaultEvent) -> usize {
        let mut log = self.lock();
        log.push(e);
        log.len() - 1
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
    /// Header `gpu,uuid,kind,xid,start_tick,end_tick,start_ts_ms,end_ts_ms,
    /// magnitude,variant,shown_tick,shown_ticks`; absent values are empty fields.
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

/// The CSV header of a ground-truth export.
const CSV_HEADER: [&str; 12] = [
    "gpu",
    "uuid",
    "kind",
    "xid",
    "start_tick",
    "end_tick",
    "start_ts_ms",
    "end_ts_ms",
    "magnitude",
    "variant",
    "shown_tick",
    "shown_ticks",
];

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
            c.write_record(CSV_HEADER)?;
            fn opt<T: ToString>(v: Option<T>) -> String {
                v.map(|x| x.to_string()).unwrap_or_default()
            }
            for e in events {
                c.write_record([
                    e.gpu.to_string(),
                    e.uuid.clone(),
                    e.kind.as_str().to_string(),
                    opt(e.xid),
                    e.start_tick.to_string(),
                    opt(e.end_tick),
                    opt(e.start_ts_ms),
                    opt(e.end_ts_ms),
                    opt(e.magnitude),
                    opt(e.variant),
                    opt(e.shown_tick),
                    e.shown_ticks.to_string(),
                ])?;
            }
            c.flush()?;
        }
    }
    w.flush()
}

/// Gives the inventory its driver drift, if any, and records it: the whole
/// node's driver with `config.drift_node_probability` (a draw from a
/// node-level stream of `seed`), and the VBIOS of each GPU with a scheduled
/// [`FaultKind::DriverDrift`].
pub(super) fn apply_drift(
    config: &FaultConfig,
    seed: u64,
    inventory: &mut [GpuInfo],
    truth: &GroundTruth,
) {
    let p = config.drift_node_probability;
    let node = p > 0.0
        && ChaCha8Rng::seed_from_u64(super::mix(seed ^ 0xd71f_7000_0000_0001))
            .random_bool(p.min(1.0));
    for info in inventory.iter_mut() {
        let record = |variant| {
            truth.push(FaultEvent {
                gpu: info.index,
                uuid: info.uuid.clone(),
                kind: FaultKind::DriverDrift,
                xid: None,
                start_tick: 0,
                end_tick: None,
                start_ts_ms: None,
                end_ts_ms: None,
                magnitude: None,
                variant: Some(variant),
                shown_tick: Some(0),
                shown_ticks: 1,
            });
        };
        if node {
            record(DRIFT_DRIVER);
        }
        let vbios = config
            .scheduled
            .iter()
            .any(|f| f.gpu == info.index && f.kind == FaultKind::DriverDrift);
        if vbios {
            record(DRIFT_VBIOS);
        }
        if node {
            info.driver_version = DRIFTED_DRIVER_VERSION.into();
        }
        if vbios {
            info.vbios_version = DRIFTED_VBIOS_VERSION.into();
        }
    }
}

/// A fault on one GPU, with its window in ticks and its grade.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Planned {
    kind: FaultKind,
    start: u64,
    end: Option<u64>,
    magnitude: Option<f64>,
    variant: Option<&'static str>,
}

impl Planned {
    /// A fault of `kind` at `start`; its grade is drawn from `rng`.
    fn new(kind: FaultKind, start: u64, duration: Option<u64>, rng: &mut ChaCha8Rng) -> Self {
        let end = if kind.is_permanent() {
            None
        } else {
            duration.map(|d| start.saturating_add(d.max(1)))
        };
        let (magnitude, variant) = kind.draw_grade(rng);
        Self {
            kind,
            start,
            end,
            magnitude,
            variant,
        }
    }

    fn is_frozen_zombie(&self) -> bool {
        self.kind == FaultKind::Zombie && self.variant == Some(ZOMBIE_FROZEN)
    }
}

/// A started fault: its plan, its event's index in the ground-truth log,
/// and whether the current tick shows it.
#[derive(Debug, Clone, Copy)]
struct Active {
    p: Planned,
    event: usize,
    /// Row-remap growth: a row was added this tick.
    added_row: bool,
    shown: bool,
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
        Planned::new(kind, after.saturating_add(gap), Some(ticks), &mut self.rng)
    }
}

/// Most heat a cooling fault adds over the healthy model, °C.
const THERMAL_MAX_EXCESS_C: f64 = 70.0;
/// Time constant of the cool-down after a cooling fault, s.
const THERMAL_DECAY_S: f64 = 20.0;
/// Simulated seconds between two remapped rows during row-remap growth.
const REMAP_EVERY_S: u64 = 30;

/// What the active faults do to this tick's healthy values (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Effects {
    /// Straggler slowdown: utilization, activity and dynamic power × (1 - this).
    pub(super) slowdown: f64,
    /// Degraded clock: SM clock × (1 - this), dynamic power × (1 - this / 2).
    pub(super) clock_cut: f64,
    /// A hung zombie: the utilization and memory used it is stuck at.
    pub(super) hung: Option<(f64, f64)>,
}

/// What a tick's readings showed, to tell which faults they revealed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Observed {
    /// The reported GPU temperature, °C.
    pub(super) temp_c: f64,
    /// Whether the GPU had work (its healthy self was busy).
    pub(super) busy: bool,
    /// Whether the GPU followed a synchronous job phase of its node.
    pub(super) synchronous: bool,
}

/// The fault state of one GPU; only GPUs that can have faults carry one.
#[derive(Debug)]
pub(super) struct FaultState {
    random: Option<RandomFaults>,
    next_random: Option<Planned>,
    /// Explicit faults not started yet, latest first (the next is popped off the end).
    scheduled: Vec<Planned>,
    active: Vec<Active>,
    remap_every_ticks: u64,
    /// This tick's effects on the healthy values.
    pub(super) fx: Effects,
    /// Heat above the healthy temperature model, °C.
    pub(super) excess_c: f64,
    /// Whether the last tick's temperature was at or above the slowdown threshold.
    pub(super) throttled: bool,
    /// Last XID (a last-value gauge, as dcgm-exporter's).
    pub(super) xid: u32,
    pub(super) uncorrectable_rows: u64,
    pub(super) correctable_rows: u64,
    /// A remapped row waits for a GPU reset (`ROW_REMAP_PENDING`).
    pub(super) remap_pending: bool,
    lost: bool,
    /// Utilization and memory used the GPU last reported while not hung.
    last_util: f64,
    last_fb_mib: f64,
    /// A frozen zombie's readings, repeated while it lasts.
    frozen: Vec<Reading>,
}

impl FaultState {
    /// The state of GPU `gpu`, or `None` when `config` can never give it a
    /// fault that changes readings.
    pub(super) fn new(
        config: &FaultConfig,
        gpu: u32,
        stream: u64,
        interval_ms: u64,
    ) -> Option<Box<Self>> {
        // The grades of scheduled faults come from a stream of their own,
        // drawn in the order of the configuration.
        let mut grades = ChaCha8Rng::seed_from_u64(super::mix(stream ^ 0xfa17_5eed_0000_0002));
        let mut scheduled: Vec<Planned> = config
            .scheduled
            .iter()
            .filter(|f| f.gpu == gpu && f.kind != FaultKind::DriverDrift)
            .map(|f| Planned::new(f.kind, f.start_tick, f.duration_ticks, &mut grades))
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
            fx: Effects::default(),
            excess_c: 0.0,
            throttled: false,
            xid: 0,
            uncorrectable_rows: 0,
            correctable_rows: 0,
            remap_pending: false,
            lost: false,
            last_util: 0.0,
            last_fb_mib: 0.0,
            frozen: Vec::new(),
        }))
    }

    /// Starts and ends the faults of `tick`, applies their step effects
    /// (XIDs, remapped rows) and sets [`Self::fx`]. Call before computing
    /// the tick's readings.
    pub(super) fn begin_tick(&mut self, tick: u64, gpu: u32, uuid: &str, truth: &GroundTruth) {
        let mut reset = false;
        self.active.retain(|a| {
            let on = a.p.end.is_none_or(|e| e > tick);
            reset |= !on && a.p.kind == FaultKind::RowRemapGrowth;
            on
        });
        // The end of row-remap growth is the GPU reset that applies the
        // remaps; after a double-bit error the GPU is never reset.
        if reset && self.uncorrectable_rows == 0 {
            self.remap_pending = false;
        }
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
        if !self.active.iter().any(|a| a.p.is_frozen_zombie()) {
            self.frozen.clear();
        }
        let mut fx = Effects::default();
        for a in &mut self.active {
            a.added_row = false;
            match a.p.kind {
                FaultKind::RowRemapGrowth
                    if (tick - a.p.start).is_multiple_of(self.remap_every_ticks) =>
                {
                    self.correctable_rows += 1;
                    self.remap_pending = true;
                    self.xid = 63;
                    a.added_row = true;
                }
                FaultKind::Straggler => {
                    fx.slowdown = fx.slowdown.max(a.p.magnitude.unwrap_or(0.0));
                }
                FaultKind::ClockDegraded => {
                    fx.clock_cut = fx.clock_cut.max(a.p.magnitude.unwrap_or(0.0));
                }
                FaultKind::Zombie if a.p.variant == Some(ZOMBIE_HUNG) => {
                    // Stuck where it was when it hung: `last_*` stop moving
                    // while it is hung.
                    let util = if self.last_util > 0.0 {
                        self.last_util
                    } else {
                        100.0
                    };
                    fx.hung = Some((util, self.last_fb_mib));
                }
                _ => {}
            }
        }
        self.fx = fx;
    }

    fn activate(&mut self, p: Planned, gpu: u32, uuid: &str, truth: &GroundTruth) {
        let event = truth.push(FaultEvent {
            gpu,
            uuid: uuid.to_string(),
            kind: p.kind,
            xid: p.kind.xid(),
            start_tick: p.start,
            end_tick: p.end,
            start_ts_ms: None,
            end_ts_ms: None,
            magnitude: p.magnitude,
            variant: p.variant,
            shown_tick: None,
            shown_ticks: 0,
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
                self.remap_pending = true;
                // It needs a reset; no further random faults.
                self.random = None;
            }
            _ => {}
        }
        self.active.push(Active {
            p,
            event,
            added_row: false,
            shown: false,
        });
    }

    /// The rise rate of the active cooling fault, °C/s (the fastest if several).
    fn heat_rate(&self) -> Option<f64> {
        self.active
            .iter()
            .filter(|a| a.p.kind == FaultKind::ThermalThrottle)
            .map(|a| a.p.magnitude.unwrap_or(*THERMAL_RISE_C_PER_S.end()))
            .reduce(f64::max)
    }

    /// Advances the excess heat by one tick of `dt_s` seconds.
    pub(super) fn step_heat(&mut self, dt_s: f64) {
        if let Some(rate) = self.heat_rate() {
            self.excess_c = (self.excess_c + rate * dt_s).min(THERMAL_MAX_EXCESS_C);
        } else if self.excess_c > 0.0 {
            self.excess_c *= (-dt_s / THERMAL_DECAY_S).exp();
            if self.excess_c < 0.05 {
                self.excess_c = 0.0;
            }
        }
    }

    /// Notes the tick's reported values and which active faults they show,
    /// and brings their ground truth up to date.
    pub(super) fn observe(
        &mut self,
        tick: u64,
        util: f64,
        fb_mib: f64,
        seen: Observed,
        truth: &GroundTruth,
    ) {
        if self.fx.hung.is_none() {
            self.last_util = util;
            self.last_fb_mib = fb_mib;
        }
        let frozen = self.active.iter().any(|a| a.p.is_frozen_zombie());
        let hung = self.fx.hung.is_some();
        let mut any = false;
        for a in &mut self.active {
            a.shown = match a.p.kind {
                FaultKind::Xid79FallenOffBus => true,
                _ if self.lost => false,
                FaultKind::Zombie => true,
                _ if frozen => false,
                FaultKind::ThermalThrottle => seen.temp_c >= super::SLOWDOWN_TEMP_C,
                FaultKind::Straggler => !hung && seen.busy && seen.synchronous,
                FaultKind::ClockDegraded => !hung && seen.busy,
                FaultKind::Xid48DoubleBitEcc => self.xid == 48,
                FaultKind::RowRemapGrowth => a.added_row,
                FaultKind::DriverDrift => false,
            };
            any |= a.shown;
        }
        if any {
            let mut log = truth.lock();
            for a in self.active.iter().filter(|a| a.shown) {
                let e = &mut log[a.event];
                e.shown_tick.get_or_insert(tick);
                e.shown_ticks += 1;
            }
        }
    }

    /// Writes the GPU's readings for `tick` at `write`: the ones it pushed
    /// (at `pushed`, never before `write`), or what replaces them (XID 79,
    /// frozen zombie); returns where the next GPU's go. Keeps a snapshot for
    /// a frozen zombie that starts at the next tick.
    pub(super) fn end_tick(
        &mut self,
        tick: u64,
        gpu: u32,
        out: &mut [Reading],
        pushed: std::ops::Range<usize>,
        write: usize,
    ) -> usize {
        let zombie = self.active.iter().any(|a| a.p.is_frozen_zombie());
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
            if pushed.start != write {
                out.copy_within(pushed, write);
            }
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
            .any(Planned::is_frozen_zombie);
        if zombie_next && self.frozen.is_empty() {
            self.frozen.extend_from_slice(&out[mine.clone()]);
        }
        mine.end
    }
}
