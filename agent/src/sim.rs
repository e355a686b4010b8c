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

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::catalog::Metric;
use crate::source::{GpuInfo, GpuSource, Reading, SourceError};

/// Framebuffer of an H100 80GB HBM3 as NVML reports it, MiB.
const FB_TOTAL_MIB: f64 = 81559.0;
const FB_RESERVED_MIB: f64 = 569.0;
const IDLE_POWER_W: f64 = 70.0;
const MAX_POWER_W: f64 = 700.0;

/// Configuration of a [`SimulatedSource`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Seed; the same seed gives the same readings.
    pub seed: u64,
    /// Number of GPUs on the node.
    pub gpus: u32,
    /// Nominal time between samples, used to integrate energy. Default 1 s.
    pub interval_ms: u64,
}

impl SimConfig {
    pub fn new(seed: u64, gpus: u32) -> Self {
        Self {
            seed,
            gpus,
            interval_ms: 1000,
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
}

/// The simulated source. See the module docs.
#[derive(Debug)]
pub struct SimulatedSource {
    config: SimConfig,
    inventory: Vec<GpuInfo>,
    gpus: Vec<SimGpu>,
}

/// SplitMix64 finaliser: spreads seed and GPU index into independent streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimulatedSource {
    pub fn new(config: SimConfig) -> Self {
        let mut inventory = Vec::new();
        let mut gpus = Vec::new();
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
                pci_bus_id: format!(
                    "00000000:{:02X}:00.0",
                    [0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb][i as usize % 8]
                        + (i / 8) as u8
                ),
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
            });
        }
        Self {
            config,
            inventory,
            gpus,
        }
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
        for (i, g) in self.gpus.iter_mut().enumerate() {
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

            let util = if g.util_target == 0.0 {
                0.0
            } else {
                (g.util_target + rng.random_range(-3.0..3.0))
                    .clamp(0.0, 100.0)
                    .round()
            };
            let power_mw = ((IDLE_POWER_W
                + (MAX_POWER_W - IDLE_POWER_W) * util / 100.0
                + rng.random_range(-4.0..4.0))
                * 1000.0)
                .round();
            let power_w = power_mw / 1000.0;
            // Temperature relaxes toward a power-dependent target: ~20 s time constant.
            let temp_target = 28.0 + power_w * 0.075;
            g.temp_c += (temp_target - g.temp_c) * (dt_s / 20.0).min(1.0);
            let temp = g.temp_c.round();
            g.energy_mj += (power_mw * dt_s) as u64;
            if rng.random_bool(0.0005) {
                g.pcie_replays += 1;
            }
            let active = util / 100.0;
            g.nvlink_kib += (active * rng.random_range(0.0..4.0e6) * dt_s) as u64;
            let sm_clock = if util > 0.0 {
                if temp > 80.0 { 1755.0 } else { 1980.0 }
            } else {
                345.0
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

            let gpu = i as u32;
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
            push(Metric::XidErrors, 0.0);
            push(
                Metric::FbFree,
                FB_TOTAL_MIB - FB_RESERVED_MIB - g.fb_used_mib,
            );
            push(Metric::FbUsed, g.fb_used_mib);
            push(Metric::FbReserved, FB_RESERVED_MIB);
            push(Metric::NvlinkBandwidthTotal, g.nvlink_kib as f64);
            push(Metric::UncorrectableRemappedRows, 0.0);
            push(Metric::CorrectableRemappedRows, 0.0);
            push(Metric::RowRemapFailure, 0.0);
            push(Metric::GrEngineActive, gr);
            push(Metric::PipeTensorActive, tensor);
            push(Metric::DramActive, dram);
            push(Metric::PcieTxBytes, pcie_tx);
            push(Metric::PcieRxBytes, pcie_rx);
            push(Metric::ClockThrottleReasons, (util == 0.0) as u8 as f64);
            push(Metric::PowerViolation, 0.0);
            push(Metric::ThermalViolation, 0.0);
            push(Metric::SyncBoostViolation, 0.0);
            push(Metric::BoardLimitViolation, 0.0);
            push(Metric::LowUtilViolation, 0.0);
            push(Metric::ReliabilityViolation, 0.0);
            push(Metric::ClocksEventSwPowerCapNs, 0.0);
            push(Metric::ClocksEventSyncBoostNs, 0.0);
            push(Metric::ClocksEventSwThermSlowdownNs, 0.0);
            push(Metric::ClocksEventHwThermSlowdownNs, 0.0);
            push(Metric::ClocksEventHwPowerBrakeSlowdownNs, 0.0);
            push(Metric::EccSbeVolTotal, 0.0);
            push(Metric::EccDbeVolTotal, 0.0);
            push(Metric::EccSbeAggTotal, 0.0);
            push(Metric::EccDbeAggTotal, 0.0);
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(seed: u64, gpus: u32, ticks: usize) -> Vec<Vec<Reading>> {
        let mut s = SimulatedSource::new(SimConfig::new(seed, gpus));
        (0..ticks)
            .map(|_| {
                let mut v = Vec::new();
                s.sample(&mut v).unwrap();
                v
            })
            .collect()
    }

    fn series(ticks: &[Vec<Reading>], gpu: u32, m: Metric) -> Vec<f64> {
        ticks
            .iter()
            .map(|t| {
                t.iter()
                    .find(|r| r.gpu == gpu && r.metric == m)
                    .unwrap()
                    .value
            })
            .collect()
    }

    #[test]
    fn deterministic_per_seed() {
        assert_eq!(run(7, 4, 50), run(7, 4, 50));
        assert_ne!(run(7, 4, 50), run(8, 4, 50));
        let a = SimulatedSource::new(SimConfig::new(7, 2));
        let b = SimulatedSource::new(SimConfig::new(7, 2));
        assert_eq!(a.inventory(), b.inventory());
        assert_ne!(a.inventory()[0].uuid, a.inventory()[1].uuid);
    }

    #[test]
    fn every_metric_for_every_gpu_every_tick() {
        let t = run(1, 3, 2);
        assert_eq!(t[0].len(), 3 * Metric::ALL.len());
    }

    #[test]
    fn physically_plausible() {
        let t = run(42, 2, 1200);
        for gpu in 0..2 {
            let energy = series(&t, gpu, Metric::TotalEnergyConsumption);
            assert!(
                energy.windows(2).all(|w| w[1] > w[0]),
                "energy is strictly monotonic"
            );
            let power = series(&t, gpu, Metric::PowerUsage);
            // Energy rises by the integral of power (1 s steps), to the mJ.
            let rise = energy[energy.len() - 1] - energy[0];
            let integral: f64 = power[1..].iter().map(|p| p * 1000.0).sum();
            assert!(
                (rise - integral).abs() <= power.len() as f64,
                "{rise} vs {integral}"
            );
            assert!(power.iter().all(|&p| (60.0..=710.0).contains(&p)));
            let util = series(&t, gpu, Metric::GpuUtil);
            assert!(
                util.iter()
                    .all(|&u| u.fract() == 0.0 && (0.0..=100.0).contains(&u))
            );
            // Plateaus: most consecutive readings stay within a few percent.
            let small_steps = util
                .windows(2)
                .filter(|w| (w[1] - w[0]).abs() <= 6.0)
                .count();
            assert!(small_steps as f64 > 0.95 * util.len() as f64);
            // Both idle and busy phases occur in 20 minutes.
            assert!(util.contains(&0.0) && util.iter().any(|&u| u > 50.0));
            let temp = series(&t, gpu, Metric::GpuTemp);
            assert!(temp.windows(2).all(|w| (w[1] - w[0]).abs() <= 20.0));
            let fb_used = series(&t, gpu, Metric::FbUsed);
            let fb_free = series(&t, gpu, Metric::FbFree);
            for (u, f) in fb_used.iter().zip(&fb_free) {
                assert_eq!(u + f + FB_RESERVED_MIB, FB_TOTAL_MIB);
            }
            assert!(series(&t, gpu, Metric::XidErrors).iter().all(|&x| x == 0.0));
        }
    }
}
