//! A simulated node of H100 GPUs: deterministic from a seed, and shaped like
//! real DCGM telemetry (see `shared/data/real`).
//!
//! Per GPU: utilization moves in plateaus (a job phase holds for tens of
//! seconds to minutes, then jumps); power follows utilization; temperature
//! follows power with a first-order lag; energy is a monotonic counter in mJ
//! (the integral of power); memory used steps when a job phase changes; error
//! counters are mostly zero and grow rarely. Values carry NVML's precision:
//! integer percent, MHz and degrees, milliwatt power reported in W.
//!
//! Output depends only on the seed, the GPU index and the number of `sample`
//! calls, never on the wall clock, so a test can replay exactly what an agent
//! sent.
//!
//! Faults (thermal throttling, a straggler, XID 79, XID 48, row-remap growth,
//! zombies) are injected on a seeded or explicit schedule set by
//! [`FaultConfig`] (default: none), and every injected fault is recorded in a
//! [`GroundTruth`] log; see [`fault`] for what each one does.
//!
//! Cost: one ChaCha8 stream per GPU and no allocation per reading (`sample`
//! reserves `out` once per call); a poll of 10,000 GPUs x 24 metrics takes
//! about 1 ms on one core (`cargo bench -p agent --bench sim`).

pub mod fault;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::catalog::Metric;
use crate::source::{GpuInfo, GpuSource, Reading, SourceError};

use fault::FaultState;
pub use fault::{
    FaultConfig, FaultEvent, FaultKind, GroundTruth, GroundTruthFormat, ScheduledFault,
    write_ground_truth,
};

/// Framebuffer of an H100 80GB HBM3 as NVML reports it, MiB.
const FB_TOTAL_MIB: f64 = 81559.0;
const FB_RESERVED_MIB: f64 = 569.0;
const IDLE_POWER_W: f64 = 70.0;
const MAX_POWER_W: f64 = 700.0;

/// GPU temperature at and above which the simulated GPU slows down, °C: the
/// red threshold of NVIDIA's dcgm-exporter dashboard (spec §3.1). Real
/// thresholds are per SKU (NVML `TEMPERATURE_THRESHOLD_SLOWDOWN`). The
/// healthy model stays below 82 °C, so only a thermal fault reaches it.
pub const SLOWDOWN_TEMP_C: f64 = 87.0;
/// Most SM clock of a GPU in thermal slowdown, MHz: HW slowdown cuts the
/// clock at least in half (spec §5.3), 1980 -> 990.
pub const THROTTLED_SM_CLOCK_MHZ: f64 = 990.0;
/// Most SM clock of a busy straggler, MHz (stuck at a low power cap).
pub const STRAGGLER_SM_CLOCK_MHZ: f64 = 1410.0;
/// A straggler's utilization, relative to its healthy self.
const STRAGGLER_UTIL_FACTOR: f64 = 0.6;

/// Clock-event reason bits (`nvmlClocksEventReason*`, spec §5.3), as
/// [`SimulatedSource::clock_event_reasons`] reports them.
pub const CLOCK_EVENT_GPU_IDLE: u64 = 0x001;
pub const CLOCK_EVENT_SW_POWER_CAP: u64 = 0x004;
pub const CLOCK_EVENT_HW_SLOWDOWN: u64 = 0x008;
pub const CLOCK_EVENT_HW_THERMAL: u64 = 0x040;

/// Configuration of a [`SimulatedSource`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Seed; the same seed gives the same readings.
    pub seed: u64,
    /// Number of GPUs on the node.
    pub gpus: u32,
    /// Nominal time between samples, used to integrate energy and to turn
    /// fault rates and durations into ticks. Default 1 s.
    pub interval_ms: u64,
    /// Faults to inject. Default: none.
    pub faults: FaultConfig,
}

impl SimConfig {
    pub fn new(seed: u64, gpus: u32) -> Self {
        Self {
            seed,
            gpus,
            interval_ms: 1000,
            faults: FaultConfig::default(),
        }
    }
}

#[derive(Debug)]
struct SimGpu {
    rng: ChaCha8Rng,
    /// Target utilization of the current plateau, %.
    util_target: f64,
    /// Samples left in the current plateau.
    hold: u32,
    fb_used_mib: f64,
    temp_c: f64,
    energy_mj: u64,
    pcie_replays: u64,
    nvlink_kib: u64,
    /// Clock-event reason bits of the last sample.
    clock_events: u64,
    /// Time spent clock-limited by temperature and by the power cap, ns.
    thermal_ns: u64,
    power_cap_ns: u64,
    /// `None` for a GPU that can never have a fault (the common case).
    faults: Option<Box<FaultState>>,
}

/// The simulated source. See the module docs.
#[derive(Debug)]
pub struct SimulatedSource {
    config: SimConfig,
    inventory: Vec<GpuInfo>,
    gpus: Vec<SimGpu>,
    /// `sample` calls so far: the tick of the next sample.
    tick: u64,
    truth: GroundTruth,
}

/// SplitMix64 finaliser: spreads seed and GPU index into independent streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimulatedSource {
    /// # Panics
    /// If a scheduled fault names a GPU the configuration does not have.
    pub fn new(config: SimConfig) -> Self {
        if let Some(f) = config
            .faults
            .scheduled
            .iter()
            .find(|f| f.gpu >= config.gpus)
        {
            panic!(
                "scheduled fault {f:?} is for GPU {}, but the simulator has {} GPUs",
                f.gpu, config.gpus
            );
        }
        let mut inventory = Vec::with_capacity(config.gpus as usize);
        let mut gpus = Vec::with_capacity(config.gpus as usize);
        for i in 0..config.gpus {
            let stream = mix(config.seed ^ mix(i as u64 + 1));
            let mut rng = ChaCha8Rng::seed_from_u64(stream);
            let u: u128 = rng.random();
            inventory.push(GpuInfo {
                index: i,
                uuid: format!(
                    "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                    (u >> 96) as u32,
                    (u >> 80) as u16,
                    (u >> 64) as u16,
                    (u >> 48) as u16,
                    u as u64 & 0xffff_ffff_ffff
                ),
                pci_bus_id: {
                    // Past bus 0xFF (load tests with thousands of GPUs) the
                    // count carries into the PCI domain instead of overflowing.
                    let bus =
                        [0x18u32, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb][i as usize % 8] + i / 8;
                    format!("{:08X}:{:02X}:00.0", bus >> 8, bus & 0xff)
                },
                model_name: "NVIDIA H100 80GB HBM3".into(),
                driver_version: "550.54.15".into(),
                serial: format!("{}", 1_650_923_000_000u64 + (stream % 1_000_000)),
                vbios_version: "96.00.89.00.01".into(),
                ..GpuInfo::default()
            });
            let energy_mj = rng.random_range(100_000_000_000u64..300_000_000_000);
            gpus.push(SimGpu {
                rng,
                util_target: 0.0,
                hold: 0,
                fb_used_mib: 3.0,
                temp_c: 30.0,
                energy_mj,
                pcie_replays: 0,
                nvlink_kib: 0,
                clock_events: 0,
                thermal_ns: 0,
                power_cap_ns: 0,
                faults: FaultState::new(&config.faults, i, stream, config.interval_ms),
            });
        }
        Self {
            config,
            inventory,
            gpus,
            tick: 0,
            truth: GroundTruth::default(),
        }
    }

    /// A handle on the log of injected faults; it keeps filling as the
    /// source is sampled, also after the source is handed to an agent.
    pub fn ground_truth(&self) -> GroundTruth {
        self.truth.clone()
    }

    /// `sample` calls so far (the tick the next sample will have).
    pub fn tick(&self) -> u64 {
        self.tick
    }

    /// The clock-event (throttle) reason bits of `gpu` at the last sample
    /// (`CLOCK_EVENT_*`); `None` for an unknown GPU. The catalog has no
    /// metric for them yet; this is where one would read them.
    pub fn clock_event_reasons(&self, gpu: u32) -> Option<u64> {
        self.gpus.get(gpu as usize).map(|g| g.clock_events)
    }
}

impl GpuSource for SimulatedSource {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.inventory
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        let dt_s = self.config.interval_ms as f64 / 1000.0;
        let tick = self.tick;
        self.tick += 1;
        out.reserve(self.gpus.len() * Metric::ALL.len());
        let base = out.len();
        for (i, g) in self.gpus.iter_mut().enumerate() {
            let gpu = i as u32;
            let mut faults = g.faults.as_deref_mut();
            if let Some(f) = faults.as_deref_mut() {
                f.begin_tick(tick, gpu, &self.inventory[i].uuid, &self.truth);
            }
            let straggler = faults
                .as_deref()
                .is_some_and(|f| f.is_active(FaultKind::Straggler));
            let was_throttled = faults.as_deref().is_some_and(|f| f.throttled);
            let rng = &mut g.rng;
            if g.hold == 0 {
                // A new job phase: idle (30 %) or busy at 60-100 %.
                let busy = rng.random_bool(0.7);
                g.util_target = if busy {
                    rng.random_range(60.0..100.0)
                } else {
                    0.0
                };
                g.hold = rng.random_range(30..300);
                g.fb_used_mib = if busy {
                    (rng.random_range(20_000..78_000) / 512 * 512) as f64
                } else {
                    3.0
                };
            }
            g.hold -= 1;

            let mut util = if g.util_target == 0.0 {
                0.0
            } else {
                (g.util_target + rng.random_range(-3.0..3.0))
                    .clamp(0.0, 100.0)
                    .round()
            };
            // Faults change values, never the random draws, so the GPU's
            // stream stays aligned with its fault-free twin.
            if straggler {
                util = (util * STRAGGLER_UTIL_FACTOR).round();
            }
            let mut dynamic_w = (MAX_POWER_W - IDLE_POWER_W) * util / 100.0;
            if was_throttled {
                dynamic_w *= 0.5;
            }
            let power_mw =
                ((IDLE_POWER_W + dynamic_w + rng.random_range(-4.0..4.0)) * 1000.0).round();
            let power_w = power_mw / 1000.0;
            // Temperature relaxes toward a power-dependent target: ~20 s time constant.
            let temp_target = 28.0 + power_w * 0.075;
            g.temp_c += (temp_target - g.temp_c) * (dt_s / 20.0).min(1.0);
            let mut temp = g.temp_c.round();
            if let Some(f) = faults.as_deref_mut() {
                f.step_heat(dt_s);
                if f.excess_c > 0.0 {
                    // Hardware slowdown holds the temperature a little above the threshold.
                    temp = (g.temp_c + f.excess_c).round().min(SLOWDOWN_TEMP_C + 3.0);
                }
            }
            let throttled = temp >= SLOWDOWN_TEMP_C;
            g.energy_mj += (power_mw * dt_s) as u64;
            if rng.random_bool(0.0005) {
                g.pcie_replays += 1;
            }
            let active = util / 100.0;
            g.nvlink_kib += (active * rng.random_range(0.0..4.0e6) * dt_s) as u64;
            let mut sm_clock = if util > 0.0 {
                if temp > 80.0 { 1755.0 } else { 1980.0 }
            } else {
                345.0
            };
            let mut clock_events = 0;
            if util == 0.0 {
                clock_events |= CLOCK_EVENT_GPU_IDLE;
            }
            if throttled {
                sm_clock = f64::min(sm_clock, THROTTLED_SM_CLOCK_MHZ);
                clock_events |= CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_THERMAL;
            }
            if straggler && util > 0.0 {
                sm_clock = f64::min(sm_clock, STRAGGLER_SM_CLOCK_MHZ);
                clock_events |= CLOCK_EVENT_SW_POWER_CAP;
            }
            g.clock_events = clock_events;
            let (xid, uncorrectable_rows, correctable_rows) = match faults {
                Some(f) => {
                    f.throttled = throttled;
                    (
                        f.xid as f64,
                        f.uncorrectable_rows as f64,
                        f.correctable_rows as f64,
                    )
                }
                None => (0.0, 0.0, 0.0),
            };
            let ratio = |rng: &mut ChaCha8Rng, scale: f64| {
                ((active * scale + rng.random_range(0.0..0.02)).clamp(0.0, 1.0) * 1e6).round() / 1e6
            };
            let gr = ratio(rng, 0.98);
            let tensor = ratio(rng, 0.55);
            let dram = ratio(rng, 0.35);
            let pcie_tx =
                (rng.random_range(0.5e6..2.0e6) + active * rng.random_range(0.0..5.0e7)).round();
            let pcie_rx =
                (rng.random_range(0.5e6..2.0e6) + active * rng.random_range(0.0..5.0e7)).round();

            let mut push = |metric: Metric, value: f64| out.push(Reading::new(gpu, metric, value));
            push(Metric::SmClock, sm_clock);
            push(Metric::MemClock, 2619.0);
            push(Metric::MemoryTemp, temp + 4.0);
            push(Metric::GpuTemp, temp);
            push(Metric::PowerUsage, power_w);
            push(Metric::TotalEnergyConsumption, g.energy_mj as f64);
            push(Metric::PcieReplayCounter, g.pcie_replays as f64);
            push(Metric::GpuUtil, util);
            push(Metric::MemCopyUtil, (util * 0.4).round());
            push(Metric::EncUtil, 0.0);
            push(Metric::DecUtil, 0.0);
            push(Metric::XidErrors, xid);
            push(
                Metric::FbFree,
                FB_TOTAL_MIB - FB_RESERVED_MIB - g.fb_used_mib,
            );
            push(Metric::FbUsed, g.fb_used_mib);
            push(Metric::FbReserved, FB_RESERVED_MIB);
            push(Metric::NvlinkBandwidthTotal, g.nvlink_kib as f64);
            push(Metric::UncorrectableRemappedRows, uncorrectable_rows);
            push(Metric::CorrectableRemappedRows, correctable_rows);
            push(Metric::RowRemapFailure, 0.0);
            push(Metric::GrEngineActive, gr);
            push(Metric::PipeTensorActive, tensor);
            push(Metric::DramActive, dram);
            push(Metric::PcieTxBytes, pcie_tx);
            push(Metric::PcieRxBytes, pcie_rx);
            // The throttle counters integrate the reasons the clock was limited.
            let dt_ns = (dt_s * 1e9) as u64;
            if throttled {
                g.thermal_ns += dt_ns;
            }
            if clock_events & CLOCK_EVENT_SW_POWER_CAP != 0 {
                g.power_cap_ns += dt_ns;
            }
            push(Metric::ClockThrottleReasons, clock_events as f64);
            push(Metric::PowerViolation, g.power_cap_ns as f64);
            push(Metric::ThermalViolation, g.thermal_ns as f64);
            push(Metric::SyncBoostViolation, 0.0);
            push(Metric::BoardLimitViolation, 0.0);
            push(Metric::LowUtilViolation, 0.0);
            push(Metric::ReliabilityViolation, 0.0);
            push(Metric::ClocksEventSwPowerCapNs, g.power_cap_ns as f64);
            push(Metric::ClocksEventSyncBoostNs, 0.0);
            push(Metric::ClocksEventSwThermSlowdownNs, 0.0);
            push(Metric::ClocksEventHwThermSlowdownNs, g.thermal_ns as f64);
            push(Metric::ClocksEventHwPowerBrakeSlowdownNs, 0.0);
            // Each remapped row comes from an ECC error: correctable rows
            // from single-bit errors, uncorrectable ones from double-bit.
            push(Metric::EccSbeVolTotal, correctable_rows);
            push(Metric::EccDbeVolTotal, uncorrectable_rows);
            push(Metric::EccSbeAggTotal, correctable_rows);
            push(Metric::EccDbeAggTotal, uncorrectable_rows);
            push(Metric::RetiredSbe, 0.0);
            push(Metric::RetiredDbe, 0.0);
            push(Metric::RetiredPending, 0.0);
            push(Metric::RowRemapPending, 0.0);
            push(Metric::NvlinkCrcFlitErrorCountTotal, 0.0);
            push(Metric::NvlinkCrcDataErrorCountTotal, 0.0);
            push(Metric::NvlinkReplayErrorCountTotal, 0.0);
            push(Metric::NvlinkRecoveryErrorCountTotal, 0.0);
            push(Metric::SmActive, gr * 0.95);
            push(Metric::SmOccupancy, gr * 0.5);
            push(Metric::PipeFp64Active, 0.0);
            push(Metric::PipeFp32Active, tensor * 0.3);
            push(Metric::PipeFp16Active, tensor * 0.2);
        }
        // Faults that replace a GPU's readings (XID 79, zombie) are applied
        // in a second pass, so that they cover every metric pushed above.
        // Every GPU pushed the same number; the pass compacts in place.
        if !self.config.faults.is_empty() && !self.gpus.is_empty() {
            let per_gpu = (out.len() - base) / self.gpus.len();
            let mut write = base;
            for (i, g) in self.gpus.iter_mut().enumerate() {
                let read = base + i * per_gpu;
                write = match g.faults.as_deref_mut() {
                    Some(f) => f.end_tick(tick, i as u32, out, read..read + per_gpu, write),
                    None => {
                        out.copy_within(read..read + per_gpu, write);
                        write + per_gpu
                    }
                };
            }
            out.truncate(write);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
