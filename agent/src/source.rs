//! What a GPU source is: something that reports the static inventory of a
//! node's GPUs and samples their counters on demand.

use crate::catalog::Metric;

/// Static attributes of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuInfo {
    /// NVML device index (the dcgm-exporter `gpu` label).
    pub index: u32,
    pub uuid: String,
    pub pci_bus_id: String,
    pub model_name: String,
    pub driver_version: String,
    pub serial: String,
    pub vbios_version: String,
}

/// One sampled value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// Position of the GPU in [`GpuSource::inventory`].
    pub gpu: u32,
    pub metric: Metric,
    /// In the dcgm-exporter unit of `metric`.
    pub value: f64,
}

/// A source failed as a whole (a field that is merely unsupported is skipped,
/// not an error).
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("NVML: {0}")]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
}

/// A node's GPUs.
///
/// `sample` may block (NVML calls do); the agent calls it from its own
/// sampling thread, never from the async runtime.
pub trait GpuSource: Send {
    /// Short name for logs: "nvml", "simulated".
    fn name(&self) -> &'static str;

    /// Every GPU, in index order. Does not change while the source lives.
    fn inventory(&self) -> &[GpuInfo];

    /// Samples every GPU once and appends the readings to `out`. Fields a GPU
    /// does not support are skipped (never reported as a sentinel value).
    ///
    /// # Errors
    /// Only when the whole source failed; the agent logs it and retries.
    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError>;
}
