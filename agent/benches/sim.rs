//! Cost of one poll of a large simulated fleet: `SimulatedSource::sample` for
//! 10,000 GPUs x every catalog metric, healthy and with the typical fault mix
//! (graded faults, ground truth kept live). The 10,000 GPUs form one
//! simulated node: one job stream and one ambient stream for all of them,
//! which costs the same per GPU as 1,250 nodes of 8.
//! Throughput is in readings; the load-test target is well under 100 ms per
//! 10k-GPU poll on one core (>= 2.4 M readings/s).
//!
//!   cargo bench -p agent --bench sim

use std::hint::black_box;

use agent::GpuSource;
use agent::catalog::Metric;
use agent::sim::{FaultConfig, SimConfig, SimulatedSource};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const GPUS: u32 = 10_000;

fn sample(c: &mut Criterion) {
    let mut g = c.benchmark_group("sim_sample");
    g.throughput(Throughput::Elements(GPUS as u64 * Metric::ALL.len() as u64));
    g.sample_size(20);
    for (name, faults) in [
        ("10k_gpus_healthy", FaultConfig::default()),
        ("10k_gpus_typical_faults", FaultConfig::typical()),
    ] {
        let mut config = SimConfig::new(7, GPUS);
        config.faults = faults;
        let mut sim = SimulatedSource::new(config);
        let mut out = Vec::with_capacity(GPUS as usize * Metric::ALL.len());
        g.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                sim.sample(&mut out).expect("the simulator does not fail");
                black_box(out.len())
            })
        });
    }
    // Construction is paid once per load-test process, but keep it visible.
    g.throughput(Throughput::Elements(GPUS as u64));
    g.bench_function("10k_gpus_new", |b| {
        b.iter_batched(
            || SimConfig::new(7, GPUS),
            |c| black_box(SimulatedSource::new(c)),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, sample);
criterion_main!(benches);
