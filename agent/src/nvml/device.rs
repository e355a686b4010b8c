//! The seam between [`NvmlSource`](super::NvmlSource) and NVML: one trait
//! method per query the source makes, so that tests drive the source with a
//! scripted device and the real implementation ([`super::real`]) is the only
//! code that touches `nvml-wrapper`.
//!
//! Methods return NVML's raw units (mW, bytes, mJ, percent, KiB); the source
//! converts to dcgm-exporter units and drops sentinel values, so both happen
//! in code the tests exercise.

use std::sync::Arc;
use std::time::Duration;

use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;

use crate::source::MigInstance;

/// Why one NVML query gave no value.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DeviceError {
    /// The GPU, its mode (ECC off, MIG on) or the driver lacks the field.
    /// Permanent for this GPU: logged once, then skipped quietly.
    #[error("not supported by this GPU or driver")]
    NotSupported,
    /// The agent lacks the privilege; treated like [`DeviceError::NotSupported`].
    #[error("insufficient permission")]
    NoPermission,
    /// The GPU fell off the bus or is otherwise inaccessible.
    #[error("GPU is lost (fallen off the bus or inaccessible)")]
    GpuLost,
    /// Nothing to report yet (GPM needs two samples); not an error.
    #[error("no data yet")]
    NoData,
    /// Any other NVML failure; counted, logged once per GPU and field.
    #[error("NVML: {0}")]
    Nvml(Arc<NvmlError>),
}

impl DeviceError {
    /// `NotSupported` or `NoPermission`: the field will not appear on this GPU.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, DeviceError::NotSupported | DeviceError::NoPermission)
    }
}

impl From<NvmlError> for DeviceError {
    fn from(e: NvmlError) -> Self {
        match e {
            // A symbol the installed driver does not export is a missing feature.
            NvmlError::NotSupported
            | NvmlError::FunctionNotFound
            | NvmlError::FailedToLoadSymbol(_) => DeviceError::NotSupported,
            NvmlError::NoPermission => DeviceError::NoPermission,
            NvmlError::GpuLost => DeviceError::GpuLost,
            NvmlError::NoData => DeviceError::NoData,
            other => DeviceError::Nvml(Arc::new(other)),
        }
    }
}

pub type DeviceResult<T> = Result<T, DeviceError>;

/// Clock domains the source reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockDomain {
    Sm,
    Memory,
}

/// `nvmlDeviceGetUtilizationRates`, percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Utilization {
    pub gpu_pct: u32,
    pub memory_pct: u32,
}

/// `nvmlDeviceGetMemoryInfo_v2`, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MemoryBytes {
    pub free: u64,
    pub used: u64,
    pub reserved: u64,
}

/// Cumulative NVLink data throughput summed over all links, KiB
/// (`NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_{TX,RX}` with `scopeId = UINT_MAX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NvlinkThroughput {
    pub tx_kib: u64,
    pub rx_kib: u64,
}

/// The GPM (Hopper+) metrics the source asks for. Ratios come back in
/// percent (0-100); PCIe rates in MiB/s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GpmMetric {
    GraphicsUtil,
    SmUtil,
    SmOccupancy,
    AnyTensorUtil,
    DramBwUtil,
    Fp64Util,
    Fp32Util,
    Fp16Util,
    PcieTxMibPerSec,
    PcieRxMibPerSec,
}

/// One physical GPU as NVML sees it.
///
/// Contract: every method is one NVML query (or one batched query) and may
/// block for as long as NVML does; none caches values. Errors distinguish
/// what the source must treat differently (see [`DeviceError`]).
pub trait NvmlDevice: Send {
    // Inventory, read once when the source opens.
    fn uuid(&self) -> DeviceResult<String>;
    fn name(&self) -> DeviceResult<String>;
    fn serial(&self) -> DeviceResult<String>;
    fn vbios_version(&self) -> DeviceResult<String>;
    fn inforom_image_version(&self) -> DeviceResult<String>;
    fn pci_bus_id(&self) -> DeviceResult<String>;
    /// Current MIG mode.
    fn mig_enabled(&self) -> DeviceResult<bool>;
    /// The GPU instances of a MIG-enabled GPU.
    fn mig_instances(&self) -> DeviceResult<Vec<MigInstance>>;
    /// Whether the GPM API works on this GPU (Hopper and newer).
    fn gpm_supported(&self) -> DeviceResult<bool>;

    // Per-poll queries.
    fn clock_mhz(&self, clock: ClockDomain) -> DeviceResult<u32>;
    fn gpu_temp_c(&self) -> DeviceResult<u32>;
    fn power_mw(&self) -> DeviceResult<u32>;
    /// Energy since the driver was loaded, mJ.
    fn energy_mj(&self) -> DeviceResult<u64>;
    fn pcie_replays(&self) -> DeviceResult<u32>;
    fn utilization(&self) -> DeviceResult<Utilization>;
    fn encoder_util_pct(&self) -> DeviceResult<u32>;
    fn decoder_util_pct(&self) -> DeviceResult<u32>;
    fn memory(&self) -> DeviceResult<MemoryBytes>;
    /// `nvmlDeviceGetCurrentClocksEventReasons` bitmask (spec §5.3).
    fn clocks_event_reasons(&self) -> DeviceResult<u64>;
    /// `nvmlDeviceGetFieldValues` for `ids` (scope 0): one result per id, in order.
    fn field_values(&self, ids: &[u32]) -> DeviceResult<Vec<DeviceResult<SampleValue>>>;
    fn nvlink_throughput(&self) -> DeviceResult<NvlinkThroughput>;
    /// Framebuffer of one MIG GPU instance.
    fn mig_memory(&self, gpu_instance_id: u32) -> DeviceResult<MemoryBytes>;
    /// GPM metrics over the time since the previous call with the same
    /// `gpu_instance` (`None`: the whole GPU). The first call only takes a
    /// sample and returns `Err(NoData)`.
    fn gpm(
        &mut self,
        gpu_instance: Option<u32>,
        metrics: &[GpmMetric],
    ) -> DeviceResult<Vec<DeviceResult<f64>>>;
}

/// One XID event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEvent {
    /// NVML index of the GPU that raised it.
    pub gpu: u32,
    pub xid: u64,
}

/// A stream of XID events (an NVML event set registered for
/// `nvmlEventTypeXidCriticalError`). Owned by the source's XID thread.
pub trait XidEvents: Send {
    /// Blocks up to `timeout` for the next event; `Ok(None)` on timeout.
    fn wait(&mut self, timeout: Duration) -> DeviceResult<Option<XidEvent>>;
}

/// The XID stream plus which GPUs it covers.
pub struct XidSubscription {
    pub events: Box<dyn XidEvents>,
    /// Per GPU index: whether registering that GPU for XID events worked.
    pub registered: Vec<DeviceResult<()>>,
}

impl std::fmt::Debug for XidSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XidSubscription")
            .field("registered", &self.registered)
            .finish_non_exhaustive()
    }
}

/// NVML as a whole.
pub trait NvmlBackend: Send {
    fn driver_version(&self) -> DeviceResult<String>;
    /// `nvmlSystemGetCudaDriverVersion`, e.g. 12040 for CUDA 12.4.
    fn cuda_driver_version(&self) -> DeviceResult<i32>;
    /// Every GPU, in NVML index order. Called once, when the source opens.
    ///
    /// # Errors
    /// When NVML cannot count or open the GPUs at all.
    fn devices(&mut self) -> DeviceResult<Vec<Box<dyn NvmlDevice>>>;
    /// Registers every GPU for XID events. Called once, when the source opens.
    ///
    /// # Errors
    /// When no event set can be created (e.g. not Linux).
    fn xid_events(&mut self) -> DeviceResult<XidSubscription>;
}
