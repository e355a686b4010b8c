//! The NVML source: reads the node's real GPUs through `nvml-wrapper`.
//!
//! NVML is loaded at run time (`libnvidia-ml.so.1`); [`NvmlSource::open`]
//! fails cleanly where it is absent, and the agent falls back to the
//! simulated source. A field a GPU does not support is skipped and logged
//! once per GPU, never reported as a sentinel value.
//!
//! Covered: the NVML fields of the dcgm-exporter default set except NVLink
//! bandwidth (needs `scopeId = UINT_MAX`, which the wrapper's field API does
//! not expose), XID events and the Hopper GPM `DCGM_FI_PROF_*` ratios; issue
//! #4 adds those.

use std::collections::HashSet;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_MEMORY_TEMP, NVML_FI_DEV_REMAPPED_COR, NVML_FI_DEV_REMAPPED_FAILURE,
    NVML_FI_DEV_REMAPPED_UNC,
};
use tracing::{info, warn};

use crate::catalog::Metric;
use crate::source::{GpuInfo, GpuSource, Reading, SourceError};

const MIB: f64 = 1024.0 * 1024.0;

/// Field-value metrics: (NVML field id, metric).
const FIELDS: [(u32, Metric); 4] = [
    (NVML_FI_DEV_MEMORY_TEMP, Metric::MemoryTemp),
    (NVML_FI_DEV_REMAPPED_COR, Metric::CorrectableRemappedRows),
    (NVML_FI_DEV_REMAPPED_UNC, Metric::UncorrectableRemappedRows),
    (NVML_FI_DEV_REMAPPED_FAILURE, Metric::RowRemapFailure),
];

/// The NVML source.
#[derive(Debug)]
pub struct NvmlSource {
    nvml: Nvml,
    inventory: Vec<GpuInfo>,
    /// (gpu, metric) pairs already reported as unsupported.
    unsupported: HashSet<(u32, Metric)>,
}

impl NvmlSource {
    /// Loads NVML and reads the inventory.
    ///
    /// # Errors
    /// The NVML error when the library or driver is missing, or no GPU answers.
    pub fn open() -> Result<Self, NvmlError> {
        let nvml = Nvml::init()?;
        let driver = nvml.sys_driver_version()?;
        let mut inventory = Vec::new();
        for index in 0..nvml.device_count()? {
            let d = nvml.device_by_index(index)?;
            let opt = |r: Result<String, NvmlError>| r.unwrap_or_default();
            inventory.push(GpuInfo {
                index,
                uuid: d.uuid()?,
                pci_bus_id: d.pci_info().map(|p| p.bus_id).unwrap_or_default(),
                model_name: opt(d.name()),
                driver_version: driver.clone(),
                serial: opt(d.serial()),
                vbios_version: opt(d.vbios_version()),
            });
        }
        info!(gpus = inventory.len(), driver = %driver, "NVML loaded");
        Ok(Self {
            nvml,
            inventory,
            unsupported: HashSet::new(),
        })
    }

    /// Records a per-field failure; logs it the first time per GPU and field.
    fn skip(&mut self, gpu: u32, metric: Metric, e: &NvmlError) {
        if self.unsupported.insert((gpu, metric)) {
            warn!(gpu, metric = metric.name(), error = %e, "field not available; skipping it");
        }
    }
}

impl GpuSource for NvmlSource {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.inventory
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        let mut failed: Vec<(u32, Metric, NvmlError)> = Vec::new();
        for gpu in 0..self.inventory.len() as u32 {
            let d = match self.nvml.device_by_index(gpu) {
                Ok(d) => d,
                Err(e) => {
                    // A GPU that fell off the bus: keep sampling the others.
                    warn!(gpu, error = %e, "device unavailable");
                    continue;
                }
            };
            let mut put = |metric: Metric, r: Result<f64, NvmlError>| match r {
                Ok(value) => out.push(Reading { gpu, metric, value }),
                Err(e) => failed.push((gpu, metric, e)),
            };
            put(Metric::SmClock, d.clock_info(Clock::SM).map(f64::from));
            put(Metric::MemClock, d.clock_info(Clock::Memory).map(f64::from));
            put(
                Metric::GpuTemp,
                d.temperature(TemperatureSensor::Gpu).map(f64::from),
            );
            put(
                Metric::PowerUsage,
                d.power_usage().map(|mw| mw as f64 / 1000.0),
            );
            put(
                Metric::TotalEnergyConsumption,
                d.total_energy_consumption().map(|mj| mj as f64),
            );
            put(
                Metric::PcieReplayCounter,
                d.pcie_replay_counter().map(f64::from),
            );
            match d.utilization_rates() {
                Ok(u) => {
                    put(Metric::GpuUtil, Ok(u.gpu as f64));
                    put(Metric::MemCopyUtil, Ok(u.memory as f64));
                }
                Err(e) => {
                    put(Metric::GpuUtil, Err(e.clone_kind()));
                    put(Metric::MemCopyUtil, Err(e));
                }
            }
            put(
                Metric::EncUtil,
                d.encoder_utilization().map(|u| u.utilization as f64),
            );
            put(
                Metric::DecUtil,
                d.decoder_utilization().map(|u| u.utilization as f64),
            );
            match d.memory_info() {
                Ok(m) => {
                    put(Metric::FbFree, Ok((m.free as f64 / MIB).floor()));
                    put(Metric::FbUsed, Ok((m.used as f64 / MIB).floor()));
                    put(Metric::FbReserved, Ok((m.reserved as f64 / MIB).floor()));
                }
                Err(e) => put(Metric::FbUsed, Err(e)),
            }
            let ids: Vec<FieldId> = FIELDS.iter().map(|(id, _)| FieldId(*id)).collect();
            match d.field_values_for(&ids) {
                Ok(values) => {
                    for ((_, metric), v) in FIELDS.iter().zip(values) {
                        put(*metric, v.and_then(|s| s.value).map(sample_f64));
                    }
                }
                Err(e) => put(Metric::MemoryTemp, Err(e)),
            }
        }
        for (gpu, metric, e) in failed {
            self.skip(gpu, metric, &e);
        }
        Ok(())
    }
}

fn sample_f64(v: SampleValue) -> f64 {
    match v {
        SampleValue::F64(x) => x,
        SampleValue::U32(x) => x as f64,
        SampleValue::U64(x) => x as f64,
        SampleValue::I64(x) => x as f64,
    }
}

/// `NvmlError` is not `Clone`; this keeps the kind for the log line.
trait CloneKind {
    fn clone_kind(&self) -> NvmlError;
}

impl CloneKind for NvmlError {
    fn clone_kind(&self) -> NvmlError {
        match self {
            NvmlError::NotSupported => NvmlError::NotSupported,
            NvmlError::NoPermission => NvmlError::NoPermission,
            NvmlError::GpuLost => NvmlError::GpuLost,
            _ => NvmlError::Unknown,
        }
    }
}
