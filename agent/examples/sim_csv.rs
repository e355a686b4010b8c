//! Prints the demo's simulated fleet as long-format CSV (the format of
//! `gpulse import`), with a virtual clock: one poll per second, all GPUs of a
//! host sharing the poll's timestamp, with a few ms of seeded jitter as a real
//! agent has. Used to measure bytes per sample on the simulated fleet:
//!
//!   cargo run -p agent --example sim_csv -- 20 | gpulse import - --data-dir /tmp/sim
//!   gpulse stats --data-dir /tmp/sim
//!
//! Argument: minutes to simulate (default 20). Fleet: 16 hosts x 8 GPUs.

// A generator that writes its output to stdout.
#![allow(clippy::print_stdout)]

use std::io::{BufWriter, Write};

use agent::GpuSource;
use agent::sim::{SimConfig, SimulatedSource};

const HOSTS: u64 = 16;
const GPUS: u32 = 8;
const START_MS: i64 = 1_775_000_000_000;

fn main() -> std::io::Result<()> {
    let minutes: i64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    let mut out = BufWriter::new(std::io::stdout().lock());
    writeln!(out, "labels,timestamp_ms,value")?;
    let mut hosts: Vec<(String, String, SimulatedSource)> = (0..HOSTS)
        .map(|h| {
            let (row, rack, n) = (h / 8, (h / 4) % 2, h % 4);
            let name = format!("node-r{row}k{rack}-{n:02}");
            let topo = format!("cluster=demo;row=row-{row};rack=rack-{row}-{rack}");
            // The demo's seeds: seed 1, host index h.
            (
                name,
                topo,
                SimulatedSource::new(SimConfig::new(1000 + h, GPUS)),
            )
        })
        .collect();
    let mut jitter: u64 = 0x2545_f491_4f6c_dd1d;
    let mut readings = Vec::new();
    for k in 0..minutes * 60 {
        for (host, topo, sim) in &mut hosts {
            jitter ^= jitter << 13;
            jitter ^= jitter >> 7;
            jitter ^= jitter << 17;
            let ts = START_MS + k * 1000 + (jitter % 7) as i64 - 3;
            readings.clear();
            sim.sample(&mut readings)
                .expect("the simulator does not fail");
            let inv = sim.inventory().to_vec();
            for r in &readings {
                let g = &inv[r.gpu as usize];
                writeln!(
                    out,
                    "metric={};gpu={};UUID={};pci_bus_id={};device=nvidia{};modelName={};DCGM_FI_DRIVER_VERSION={};Hostname={host};{topo},{ts},{}",
                    r.metric.name(),
                    r.gpu,
                    g.uuid,
                    g.pci_bus_id,
                    r.gpu,
                    g.model_name,
                    g.driver_version,
                    r.value
                )?;
            }
        }
    }
    out.flush()
}
