//! Detector CPU at fleet scale: one second of 10,000 GPUs at 1 Hz through
//! the engine, as `serve` feeds it: every detector field of every GPU
//! (`Engine::sample`), then `finish_before` and `tick` (telemetry gaps, the
//! peer comparison, drift). The GPUs run as hosts of 8 in step, with a
//! straggler every 100 GPUs, so the peer rules do their full work.
//!
//!   cargo bench -p health --bench engine
//!
//! The budget: detector CPU <= 10 % of ingest CPU at 10,000 GPUs x
//! 53 fields at 1 Hz. docs/BENCHMARKS.md ("Fleet health detection") works
//! the figure out against the measured ingest rate per core.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use health::engine::{Engine, GpuSlot};
use health::{Field, GpuId, HealthConfig, Inventory};

const GPUS: u32 = 10_000;
const T0: i64 = 1_700_000_000_000;

/// Deterministic noise in [-1, 1) (SplitMix64).
fn noise(mut z: u64) -> f64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

struct Fleet {
    engine: Engine,
    slots: Vec<GpuSlot>,
    second: i64,
    energy: Vec<f64>,
}

impl Fleet {
    fn new() -> Self {
        let mut engine = Engine::new(HealthConfig::default()).unwrap();
        let slots: Vec<GpuSlot> = (0..GPUS)
            .map(|g| {
                let id = GpuId {
                    rack: Some(format!("rack-{}", g / 32)),
                    ..GpuId::new(format!("GPU-{g:08}"), format!("host-{:05}", g / 8), g % 8)
                };
                engine.gpu(id)
            })
            .collect();
        for &s in &slots {
            engine.set_inventory(
                s,
                Inventory {
                    model: "NVIDIA H100 80GB HBM3".into(),
                    driver_version: "550.54.15".into(),
                    vbios_version: "96.00.89.00.01".into(),
                    inforom_version: "G520.0200.00.05".into(),
                },
            );
        }
        let mut f = Fleet {
            engine,
            slots,
            second: 0,
            energy: vec![1e11; GPUS as usize],
        };
        // Past the peers' settling time and every detector's first polls.
        for _ in 0..30 {
            f.second();
        }
        f
    }

    /// One second: a poll of every GPU, then the engine's tick.
    fn second(&mut self) -> usize {
        let ts = T0 + self.second * 1000;
        let mut out = Vec::new();
        for (i, &slot) in self.slots.iter().enumerate() {
            let n = noise((self.second as u64) << 20 | i as u64);
            let slow = if i % 100 == 7 { 0.85 } else { 1.0 };
            let power = (600.0 + 5.0 * n) * slow;
            self.energy[i] += power * 1000.0;
            let values = [
                (Field::XidErrors, 0.0),
                (Field::EccSbeVolTotal, 0.0),
                (Field::EccDbeVolTotal, 0.0),
                (Field::RetiredSbe, 0.0),
                (Field::RetiredDbe, 0.0),
                (Field::RetiredPending, 0.0),
                (Field::RowRemapPending, 0.0),
                (Field::RowRemapFailure, 0.0),
                (Field::CorrectableRemappedRows, 0.0),
                (Field::UncorrectableRemappedRows, 0.0),
                (Field::ClockThrottleReasons, 0.0),
                (Field::PowerViolation, 0.0),
                (Field::ThermalViolation, 0.0),
                (Field::ClocksEventSwPowerCapNs, 0.0),
                (Field::ClocksEventSwThermSlowdownNs, 0.0),
                (Field::ClocksEventHwThermSlowdownNs, 0.0),
                (Field::ClocksEventHwPowerBrakeSlowdownNs, 0.0),
                (Field::GpuTemp, (70.0 + 2.0 * n).round()),
                (Field::SmClock, 1980.0),
                (Field::PowerUsage, power),
                (Field::TotalEnergyConsumption, self.energy[i].round()),
                (Field::GpuUtil, 100.0),
                (Field::ProfSmActive, 0.8 * slow + 0.01 * n),
                (Field::ProfGrEngineActive, 0.85 * slow + 0.01 * n),
            ];
            for (f, v) in values {
                self.engine.sample(slot, f, ts, v, &mut out);
            }
        }
        self.engine.finish_before(ts + 1, &mut out);
        self.engine.tick(ts, &mut out);
        self.second += 1;
        out.len()
    }
}

fn engine(c: &mut Criterion) {
    let mut g = c.benchmark_group("health_engine");
    g.throughput(Throughput::Elements(GPUS as u64));
    g.sample_size(20);
    let mut fleet = Fleet::new();
    g.bench_function("10k_gpus_one_second", |b| {
        b.iter(|| black_box(fleet.second()))
    });
    g.finish();
}

criterion_group!(benches, engine);
criterion_main!(benches);
