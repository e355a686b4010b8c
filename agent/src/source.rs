//! What a GPU source is: something that reports the static inventory of a
//! node's GPUs and samples their counters on demand.

use crate::catalog::Metric;

/// Static attributes of one GPU.
///
/// Every field added after the first release has a `Default`, so sources
/// that do not know it (the simulated one) leave it empty.
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
    /// InfoROM image version (`nvmlDeviceGetInforomImageVersion`); empty when unknown.
    pub inforom_image_version: String,
    /// CUDA version the driver supports, "major.minor" (`nvmlSystemGetCudaDriverVersion`);
    /// empty when unknown.
    pub cuda_driver_version: String,
    /// Whether MIG mode is currently enabled; `None` when the GPU has no MIG support.
    pub mig_enabled: Option<bool>,
    /// The MIG GPU instances present when the source opened (empty without MIG).
    pub mig_instances: Vec<MigInstance>,
}

/// One MIG GPU instance of a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MigInstance {
    /// NVML GPU-instance id: the dcgm-exporter `GPU_I_ID` label.
    pub gpu_instance_id: u32,
    /// Profile name, e.g. `1g.10gb`: the dcgm-exporter `GPU_I_PROFILE` label.
    pub profile: String,
}

/// An extra label that tells apart several series of one (GPU, metric).
///
/// A shipper turns it into series labels:
/// * `Xid(n)` → `xid="<n>"` (on [`Metric::XidErrorsTotal`]);
/// * `GpuInstance(id)` → `GPU_I_ID="<id>"` and `GPU_I_PROFILE="<profile>"`,
///   where the profile is the entry of [`GpuInfo::mig_instances`] with that
///   `gpu_instance_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SeriesLabel {
    Xid(u32),
    GpuInstance(u32),
}

/// One sampled value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reading {
    /// Position of the GPU in [`GpuSource::inventory`].
    pub gpu: u32,
    pub metric: Metric,
    /// In the dcgm-exporter unit of `metric`.
    pub value: f64,
    /// `None` for the one plain series of (gpu, metric); see [`SeriesLabel`].
    pub label: Option<SeriesLabel>,
}

impl Reading {
    /// A reading of the plain (unlabelled) series of `(gpu, metric)`.
    pub fn new(gpu: u32, metric: Metric, value: f64) -> Self {
        Self {
            gpu,
            metric,
            value,
            label: None,
        }
    }
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

    /// Calls to the GPU library that failed so far (`gpulse_agent_nvml_errors_total`).
    fn errors(&self) -> u64 {
        0
    }
}
