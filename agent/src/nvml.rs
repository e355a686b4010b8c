//! The NVML source: reads the node's real GPUs.
//!
//! Every NVML call sits behind [`NvmlDevice`] / [`NvmlBackend`]
//! ([`device`]); the implementation over `nvml-wrapper` is private
//! (`real.rs`) and tests drive [`NvmlSource`] with a scripted device.
//! NVML is loaded at run time (`libnvidia-ml.so.1`); [`NvmlSource::open`]
//! fails cleanly where it is absent, and the agent falls back to the
//! simulated source.
//!
//! # What each poll reads (spec §1.2, §1.3, §2, §5)
//! * Every `DCGM_FI_DEV_*` metric of [`Metric::ALL`], converted to the
//!   dcgm-exporter unit: power mW → W, framebuffer bytes → MiB (floored, as
//!   DCGM does), energy in mJ, clocks in MHz, utilization in %, NVLink
//!   bandwidth as the cumulative KiB sum of TX and RX data over all links,
//!   throttle times in ns. NVLink error totals are NVML's `*_COUNT_TOTAL`
//!   fields, already summed over links as DCGM does.
//! * `DCGM_FI_PROF_*` from GPM, on GPUs where `nvmlGpmQueryDeviceSupport`
//!   says yes (Hopper and newer): ratios are GPM percent ÷ 100, PCIe rates GPM
//!   MiB/s × 1 048 576. GPM reports over the interval between two samples, so
//!   the first poll has none. Older GPUs have no `DCGM_FI_PROF_*` at all
//!   (DCGM gets them from its proprietary profiling module, which an
//!   NVML-only agent cannot use); this is logged once per GPU.
//! * XIDs: a dedicated thread waits on an NVML event set registered for
//!   `CRITICAL_XID_ERROR` on every GPU. Each poll reports, per watched GPU,
//!   `DCGM_FI_DEV_XID_ERRORS` = the last XID seen (0 before any, as
//!   dcgm-exporter shows) and one `gpulse_xid_errors_total` series per XID
//!   number seen, labelled [`SeriesLabel::Xid`]. XIDs raised before the agent
//!   started are not seen (NVML delivers only events after registration), and
//!   NVML does not deliver some (79, 119, 120 per NVIDIA/DCGM#162; DCGM tails
//!   `/dev/kmsg` for those, which this source does not do yet).
//! * MIG: for each GPU instance present at open, the framebuffer
//!   (`DCGM_FI_DEV_FB_*`) and the GPM `DCGM_FI_PROF_*` ratios of that
//!   instance, labelled [`SeriesLabel::GpuInstance`] (the `GPU_I_ID`; the
//!   `GPU_I_PROFILE` name is in [`GpuInfo::mig_instances`]). The GPU-level
//!   series are still reported. A MIG reconfiguration needs an agent restart
//!   to be seen.
//!
//! # Failures
//! A field a GPU does not support (or that needs privileges the agent lacks)
//! is skipped and logged once per GPU and field, never reported as a sentinel
//! value: NVML's "not available" integers (all ones) and non-finite floats
//! are dropped the same way. Other NVML failures are counted in
//! [`NvmlStats::errors`] and logged once per GPU and field. A GPU that falls
//! off the bus (`GpuLost`) is logged as an error once; its device readings are
//! omitted from then on (its XID series stay, since they are the evidence) and
//! the other GPUs are sampled as usual. A lost GPU is probed with one call per
//! poll and reported again if it answers.
//!
//! Not covered: `DCGM_FI_DEV_VGPU_LICENSE_STATUS` (vGPU entities), the
//! `/dev/kmsg` XID reader, per-link NVLink series, and `DCGM_FI_PROF_*` before
//! Hopper (see above).

pub mod device;
mod real;
#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::sys_exports::field_id as fi;
use tracing::{error, info, warn};

use crate::catalog::Metric;
use crate::source::{GpuInfo, GpuSource, Reading, SeriesLabel, SourceError};
pub use device::{
    ClockDomain, DeviceError, DeviceResult, GpmMetric, MemoryBytes, NvlinkThroughput, NvmlBackend,
    NvmlDevice, Utilization, XidEvent, XidEvents, XidSubscription,
};

const MIB: f64 = 1024.0 * 1024.0;

/// How long the XID thread blocks per wait; bounds how long dropping the
/// source takes.
const XID_WAIT: Duration = Duration::from_millis(200);

/// Field-value metrics: NVML field id (driver-R12 numbering; the wrapper
/// translates for newer drivers) and the metrics it feeds. Perf-policy
/// counters 74 and 76 are also DCGM's `CLOCKS_EVENT_REASON_*_NS` 1420/1421.
const FIELDS: [(u32, &[Metric]); 25] = [
    (fi::NVML_FI_DEV_MEMORY_TEMP, &[Metric::MemoryTemp]),
    (
        fi::NVML_FI_DEV_REMAPPED_COR,
        &[Metric::CorrectableRemappedRows],
    ),
    (
        fi::NVML_FI_DEV_REMAPPED_UNC,
        &[Metric::UncorrectableRemappedRows],
    ),
    (fi::NVML_FI_DEV_REMAPPED_FAILURE, &[Metric::RowRemapFailure]),
    (fi::NVML_FI_DEV_REMAPPED_PENDING, &[Metric::RowRemapPending]),
    (fi::NVML_FI_DEV_ECC_SBE_VOL_TOTAL, &[Metric::EccSbeVolTotal]),
    (fi::NVML_FI_DEV_ECC_DBE_VOL_TOTAL, &[Metric::EccDbeVolTotal]),
    (fi::NVML_FI_DEV_ECC_SBE_AGG_TOTAL, &[Metric::EccSbeAggTotal]),
    (fi::NVML_FI_DEV_ECC_DBE_AGG_TOTAL, &[Metric::EccDbeAggTotal]),
    (fi::NVML_FI_DEV_RETIRED_SBE, &[Metric::RetiredSbe]),
    (fi::NVML_FI_DEV_RETIRED_DBE, &[Metric::RetiredDbe]),
    (fi::NVML_FI_DEV_RETIRED_PENDING, &[Metric::RetiredPending]),
    (
        fi::NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL,
        &[Metric::NvlinkCrcFlitErrorCountTotal],
    ),
    (
        fi::NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL,
        &[Metric::NvlinkCrcDataErrorCountTotal],
    ),
    (
        fi::NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL,
        &[Metric::NvlinkReplayErrorCountTotal],
    ),
    (
        fi::NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL,
        &[Metric::NvlinkRecoveryErrorCountTotal],
    ),
    (
        fi::NVML_FI_DEV_PERF_POLICY_POWER,
        &[Metric::PowerViolation, Metric::ClocksEventSwPowerCapNs],
    ),
    (
        fi::NVML_FI_DEV_PERF_POLICY_THERMAL,
        &[Metric::ThermalViolation],
    ),
    (
        fi::NVML_FI_DEV_PERF_POLICY_SYNC_BOOST,
        &[Metric::SyncBoostViolation, Metric::ClocksEventSyncBoostNs],
    ),
    (
        fi::NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
        &[Metric::BoardLimitViolation],
    ),
    (
        fi::NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION,
        &[Metric::LowUtilViolation],
    ),
    (
        fi::NVML_FI_DEV_PERF_POLICY_RELIABILITY,
        &[Metric::ReliabilityViolation],
    ),
    (
        fi::NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN,
        &[Metric::ClocksEventSwThermSlowdownNs],
    ),
    (
        fi::NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN,
        &[Metric::ClocksEventHwThermSlowdownNs],
    ),
    (
        fi::NVML_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN,
        &[Metric::ClocksEventHwPowerBrakeSlowdownNs],
    ),
];

/// How a GPM value becomes the dcgm-exporter unit.
#[derive(Debug, Clone, Copy)]
enum GpmUnit {
    /// Percent → ratio 0-1.
    Percent,
    /// MiB/s → bytes/s.
    MibPerSec,
}

impl GpmUnit {
    fn convert(self, x: f64) -> f64 {
        match self {
            GpmUnit::Percent => x / 100.0,
            GpmUnit::MibPerSec => x * MIB,
        }
    }
}

/// GPM metrics: (what GPM reports, metric, unit of the GPM value).
const GPM: [(GpmMetric, Metric, GpmUnit); 10] = [
    (
        GpmMetric::GraphicsUtil,
        Metric::GrEngineActive,
        GpmUnit::Percent,
    ),
    (
        GpmMetric::AnyTensorUtil,
        Metric::PipeTensorActive,
        GpmUnit::Percent,
    ),
    (GpmMetric::DramBwUtil, Metric::DramActive, GpmUnit::Percent),
    (
        GpmMetric::PcieTxMibPerSec,
        Metric::PcieTxBytes,
        GpmUnit::MibPerSec,
    ),
    (
        GpmMetric::PcieRxMibPerSec,
        Metric::PcieRxBytes,
        GpmUnit::MibPerSec,
    ),
    (GpmMetric::SmUtil, Metric::SmActive, GpmUnit::Percent),
    (
        GpmMetric::SmOccupancy,
        Metric::SmOccupancy,
        GpmUnit::Percent,
    ),
    (
        GpmMetric::Fp64Util,
        Metric::PipeFp64Active,
        GpmUnit::Percent,
    ),
    (
        GpmMetric::Fp32Util,
        Metric::PipeFp32Active,
        GpmUnit::Percent,
    ),
    (
        GpmMetric::Fp16Util,
        Metric::PipeFp16Active,
        GpmUnit::Percent,
    ),
];

/// Counters of an NVML source, for the agent's own `/metrics`. Shared with
/// the XID thread; read them through [`NvmlSource::stats`].
#[derive(Debug, Default)]
pub struct NvmlStats {
    errors: AtomicU64,
    unavailable_fields: AtomicU64,
    gpus_lost: AtomicU64,
    xid_events: AtomicU64,
}

impl NvmlStats {
    /// NVML calls that failed for a reason other than "not supported" or "no
    /// permission" (including a GPU becoming lost and failed XID waits).
    /// Suggested exposition: `gpulse_agent_nvml_errors_total`.
    pub fn errors(&self) -> u64 {
        self.errors.load(Relaxed)
    }

    /// Distinct (GPU, instance, metric) fields found unsupported or not permitted.
    pub fn unavailable_fields(&self) -> u64 {
        self.unavailable_fields.load(Relaxed)
    }

    /// Times a GPU was found lost (fallen off the bus).
    pub fn gpus_lost(&self) -> u64 {
        self.gpus_lost.load(Relaxed)
    }

    /// XID events received.
    pub fn xid_events(&self) -> u64 {
        self.xid_events.load(Relaxed)
    }
}

/// Why [`NvmlSource::open`] failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The library or driver is missing.
    #[error("loading NVML: {0}")]
    Load(#[from] NvmlError),
    /// NVML loaded but the GPUs could not be listed.
    #[error("listing GPUs: {0}")]
    Devices(#[source] DeviceError),
}

#[derive(Debug, Default)]
struct GpuState {
    lost: bool,
    /// GPM works on this GPU.
    gpm: bool,
    /// XID events are registered for this GPU.
    xid_watched: bool,
    last_xid: u64,
    /// Events per XID number.
    xid_counts: BTreeMap<u32, u64>,
}

#[derive(Debug)]
struct XidThread {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

/// The NVML source. See the module docs.
pub struct NvmlSource {
    devices: Vec<Box<dyn NvmlDevice>>,
    inventory: Vec<GpuInfo>,
    state: Vec<GpuState>,
    /// (gpu, GPU instance, metric) already logged as skipped.
    reported: HashSet<(u32, Option<u32>, Metric)>,
    stats: Arc<NvmlStats>,
    xid_rx: Option<mpsc::Receiver<XidEvent>>,
    xid_thread: Option<XidThread>,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource")
            .field("inventory", &self.inventory)
            .field("state", &self.state)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl NvmlSource {
    /// Loads NVML, reads the inventory and starts the XID thread.
    ///
    /// # Errors
    /// When the library or driver is missing, or NVML cannot list the GPUs.
    /// A GPU that fails to answer is kept (lost) rather than failing the open.
    pub fn open() -> Result<Self, OpenError> {
        Self::with_backend(Box::new(real::RealBackend::init()?))
    }

    /// Opens a source over any backend (tests use a scripted one).
    ///
    /// # Errors
    /// When the backend cannot list its GPUs.
    pub fn with_backend(mut backend: Box<dyn NvmlBackend>) -> Result<Self, OpenError> {
        let devices = backend.devices().map_err(OpenError::Devices)?;
        let driver = backend.driver_version().unwrap_or_default();
        let cuda = backend
            .cuda_driver_version()
            .map(|v| format!("{}.{}", v / 1000, v % 1000 / 10))
            .unwrap_or_default();
        let stats = Arc::new(NvmlStats::default());
        let mut inventory = Vec::with_capacity(devices.len());
        let mut state = Vec::with_capacity(devices.len());
        for (index, d) in devices.iter().enumerate() {
            let index = index as u32;
            let mut lost = false;
            let mut text = |r: DeviceResult<String>| match r {
                Ok(s) => s,
                Err(e) => {
                    lost |= matches!(e, DeviceError::GpuLost);
                    String::new()
                }
            };
            let mut info = GpuInfo {
                index,
                uuid: text(d.uuid()),
                pci_bus_id: text(d.pci_bus_id()),
                model_name: text(d.name()),
                driver_version: driver.clone(),
                serial: text(d.serial()),
                vbios_version: text(d.vbios_version()),
                inforom_image_version: text(d.inforom_image_version()),
                cuda_driver_version: cuda.clone(),
                mig_enabled: d.mig_enabled().ok(),
                mig_instances: Vec::new(),
            };
            if info.mig_enabled == Some(true) {
                match d.mig_instances() {
                    Ok(m) => info.mig_instances = m,
                    Err(e) => warn!(gpu = index, error = %e, "cannot list MIG instances"),
                }
            }
            let gpm = match d.gpm_supported() {
                Ok(true) => true,
                Ok(false) | Err(_) => {
                    info!(
                        gpu = index,
                        "GPM not supported (before Hopper): no DCGM_FI_PROF_* metrics"
                    );
                    false
                }
            };
            if lost {
                stats.gpus_lost.fetch_add(1, Relaxed);
                stats.errors.fetch_add(1, Relaxed);
                error!(
                    gpu = index,
                    "GPU is lost (fallen off the bus); its readings are omitted"
                );
            }
            inventory.push(info);
            state.push(GpuState {
                lost,
                gpm,
                ..GpuState::default()
            });
        }

        let (xid_rx, xid_thread) = match backend.xid_events() {
            Ok(sub) => {
                for (gpu, r) in sub.registered.iter().enumerate() {
                    match r {
                        Ok(()) => {
                            if let Some(s) = state.get_mut(gpu) {
                                s.xid_watched = true;
                            }
                        }
                        Err(e) => warn!(gpu, error = %e, "XID events not available for this GPU"),
                    }
                }
                let (tx, rx) = mpsc::channel();
                let stop = Arc::new(AtomicBool::new(false));
                let handle = {
                    let (stop, stats) = (stop.clone(), stats.clone());
                    std::thread::Builder::new()
                        .name("gpulse-nvml-xid".into())
                        .spawn(move || xid_loop(sub.events, tx, &stop, &stats))
                        .expect("BUG: cannot spawn the XID thread")
                };
                (
                    Some(rx),
                    Some(XidThread {
                        stop,
                        handle: Some(handle),
                    }),
                )
            }
            Err(e) => {
                warn!(error = %e, "NVML event sets not available: no XID metrics");
                (None, None)
            }
        };
        info!(gpus = inventory.len(), driver = %driver, cuda = %cuda, "NVML loaded");
        Ok(Self {
            devices,
            inventory,
            state,
            reported: HashSet::new(),
            stats,
            xid_rx,
            xid_thread,
        })
    }

    /// The source's counters; the handle stays valid after the source moves
    /// to the sampling thread.
    pub fn stats(&self) -> Arc<NvmlStats> {
        self.stats.clone()
    }

    /// Folds XID events received since the last poll into the per-GPU state.
    fn drain_xids(&mut self) {
        let Some(rx) = &self.xid_rx else { return };
        while let Ok(e) = rx.try_recv() {
            let Some(s) = self.state.get_mut(e.gpu as usize) else {
                continue;
            };
            s.last_xid = e.xid;
            *s.xid_counts
                .entry(u32::try_from(e.xid).unwrap_or(u32::MAX))
                .or_default() += 1;
        }
    }

    /// Logs and counts one failed field (once per GPU, instance and metric).
    fn note_failure(&mut self, gpu: u32, instance: Option<u32>, metric: Metric, e: &DeviceError) {
        match e {
            DeviceError::NoData | DeviceError::GpuLost => {}
            DeviceError::NotSupported | DeviceError::NoPermission => {
                if self.reported.insert((gpu, instance, metric)) {
                    self.stats.unavailable_fields.fetch_add(1, Relaxed);
                    warn!(gpu, gpu_instance = instance, metric = metric.name(), error = %e, "field not available; skipping it");
                }
            }
            DeviceError::Nvml(_) => {
                self.stats.errors.fetch_add(1, Relaxed);
                if self.reported.insert((gpu, instance, metric)) {
                    warn!(gpu, gpu_instance = instance, metric = metric.name(), error = %e, "NVML query failed; skipping the field");
                }
            }
        }
    }
}

impl Drop for NvmlSource {
    fn drop(&mut self) {
        if let Some(t) = &mut self.xid_thread {
            t.stop.store(true, Relaxed);
            if let Some(h) = t.handle.take() {
                let _ = h.join();
            }
        }
    }
}

/// Waits for XID events and forwards them until `stop` is set or the source
/// is gone.
fn xid_loop(
    mut events: Box<dyn XidEvents>,
    tx: mpsc::Sender<XidEvent>,
    stop: &AtomicBool,
    stats: &NvmlStats,
) {
    let mut failures: u64 = 0;
    while !stop.load(Relaxed) {
        match events.wait(XID_WAIT) {
            Ok(Some(e)) => {
                stats.xid_events.fetch_add(1, Relaxed);
                warn!(gpu = e.gpu, xid = e.xid, "XID error");
                if tx.send(e).is_err() {
                    return;
                }
            }
            Ok(None) => {}
            Err(e) => {
                stats.errors.fetch_add(1, Relaxed);
                failures += 1;
                // 1st, 2nd, 4th, 8th... failure: a broken event set must not flood the log.
                if failures.is_power_of_two() {
                    warn!(error = %e, failures, "waiting for XID events failed");
                }
                std::thread::sleep(XID_WAIT);
            }
        }
    }
}

/// Collects one GPU's readings; stops recording once the GPU is lost.
struct Collector {
    gpu: u32,
    readings: Vec<Reading>,
    failures: Vec<(Option<u32>, Metric, DeviceError)>,
    lost: bool,
}

impl Collector {
    fn put(&mut self, metric: Metric, r: DeviceResult<f64>) {
        self.put_labeled(None, metric, r);
    }

    fn put_labeled(&mut self, instance: Option<u32>, metric: Metric, r: DeviceResult<f64>) {
        if self.lost {
            return;
        }
        match r {
            Ok(value) => self.readings.push(Reading {
                gpu: self.gpu,
                metric,
                value,
                label: instance.map(SeriesLabel::GpuInstance),
            }),
            Err(DeviceError::GpuLost) => self.lost = true,
            Err(e) => self.failures.push((instance, metric, e)),
        }
    }

    /// Framebuffer bytes → MiB (floored, like DCGM).
    fn put_memory(&mut self, instance: Option<u32>, r: DeviceResult<MemoryBytes>) {
        let mib = |b: u64| (b as f64 / MIB).floor();
        match r {
            Ok(m) => {
                self.put_labeled(instance, Metric::FbFree, Ok(mib(m.free)));
                self.put_labeled(instance, Metric::FbUsed, Ok(mib(m.used)));
                self.put_labeled(instance, Metric::FbReserved, Ok(mib(m.reserved)));
            }
            Err(e) => {
                for m in [Metric::FbFree, Metric::FbUsed, Metric::FbReserved] {
                    self.put_labeled(instance, m, Err(e.clone()));
                }
            }
        }
    }

    fn put_gpm(&mut self, instance: Option<u32>, r: DeviceResult<Vec<DeviceResult<f64>>>) {
        match r {
            Ok(values) => {
                for ((_, metric, unit), v) in GPM.iter().zip(values) {
                    let v = v.and_then(|x| {
                        if x.is_finite() && x >= 0.0 {
                            Ok(unit.convert(x))
                        } else {
                            Err(DeviceError::NoData)
                        }
                    });
                    self.put_labeled(instance, *metric, v);
                }
            }
            Err(e) => {
                for (_, metric, _) in GPM {
                    self.put_labeled(instance, metric, Err(e.clone()));
                }
            }
        }
    }
}

/// A 32-bit NVML reading; all ones is NVML's "not available".
fn u32_value(r: DeviceResult<u32>) -> DeviceResult<f64> {
    match r? {
        u32::MAX => Err(DeviceError::NotSupported),
        v => Ok(f64::from(v)),
    }
}

/// A 64-bit NVML reading; all ones is NVML's "not available".
fn u64_value(r: DeviceResult<u64>) -> DeviceResult<f64> {
    match r? {
        u64::MAX => Err(DeviceError::NotSupported),
        v => Ok(v as f64),
    }
}

/// A field value, with NVML's "not available" encodings dropped.
fn field_value(v: SampleValue) -> DeviceResult<f64> {
    match v {
        SampleValue::U32(x) => u32_value(Ok(x)),
        SampleValue::U64(x) => u64_value(Ok(x)),
        SampleValue::I64(x) if (0..i64::MAX).contains(&x) => Ok(x as f64),
        SampleValue::F64(x) if x.is_finite() => Ok(x),
        _ => Err(DeviceError::NotSupported),
    }
}

fn sample_device(d: &mut dyn NvmlDevice, st: &GpuState, info: &GpuInfo, c: &mut Collector) {
    c.put(Metric::SmClock, u32_value(d.clock_mhz(ClockDomain::Sm)));
    if c.lost {
        return;
    }
    c.put(
        Metric::MemClock,
        u32_value(d.clock_mhz(ClockDomain::Memory)),
    );
    // DCGM discards GPU temperatures above 200 C as bogus.
    let temp = u32_value(d.gpu_temp_c()).and_then(|t| {
        if t <= 200.0 {
            Ok(t)
        } else {
            Err(DeviceError::NotSupported)
        }
    });
    c.put(Metric::GpuTemp, temp);
    c.put(
        Metric::PowerUsage,
        u32_value(d.power_mw()).map(|mw| mw / 1000.0),
    );
    c.put(Metric::TotalEnergyConsumption, u64_value(d.energy_mj()));
    c.put(Metric::PcieReplayCounter, u32_value(d.pcie_replays()));
    match d.utilization() {
        Ok(u) => {
            c.put(Metric::GpuUtil, u32_value(Ok(u.gpu_pct)));
            c.put(Metric::MemCopyUtil, u32_value(Ok(u.memory_pct)));
        }
        Err(e) => {
            c.put(Metric::GpuUtil, Err(e.clone()));
            c.put(Metric::MemCopyUtil, Err(e));
        }
    }
    c.put(Metric::EncUtil, u32_value(d.encoder_util_pct()));
    c.put(Metric::DecUtil, u32_value(d.decoder_util_pct()));
    c.put_memory(None, d.memory());
    match d.nvlink_throughput() {
        Ok(t) => {
            let sum = u64_value(Ok(t.tx_kib)).and_then(|tx| Ok(tx + u64_value(Ok(t.rx_kib))?));
            c.put(Metric::NvlinkBandwidthTotal, sum);
        }
        Err(e) => c.put(Metric::NvlinkBandwidthTotal, Err(e)),
    }
    c.put(
        Metric::ClockThrottleReasons,
        u64_value(d.clocks_event_reasons()),
    );
    let ids: Vec<u32> = FIELDS.iter().map(|(id, _)| *id).collect();
    match d.field_values(&ids) {
        Ok(values) => {
            for ((_, metrics), v) in FIELDS.iter().zip(values) {
                let v = v.and_then(field_value);
                for m in *metrics {
                    c.put(*m, v.clone());
                }
            }
        }
        Err(e) => {
            for (_, metrics) in FIELDS {
                for m in metrics {
                    c.put(*m, Err(e.clone()));
                }
            }
        }
    }
    if st.gpm {
        c.put_gpm(None, d.gpm(None, &GPM.map(|(g, _, _)| g)));
    }
    for mig in &info.mig_instances {
        let gi = Some(mig.gpu_instance_id);
        c.put_memory(gi, d.mig_memory(mig.gpu_instance_id));
        if st.gpm {
            c.put_gpm(gi, d.gpm(gi, &GPM.map(|(g, _, _)| g)));
        }
    }
}

impl GpuSource for NvmlSource {
    fn errors(&self) -> u64 {
        self.stats.errors()
    }

    fn name(&self) -> &'static str {
        "nvml"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.inventory
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        self.drain_xids();
        let mut failures = Vec::new();
        for gpu in 0..self.devices.len() {
            let mut c = Collector {
                gpu: gpu as u32,
                readings: Vec::new(),
                failures: Vec::new(),
                lost: false,
            };
            sample_device(
                self.devices[gpu].as_mut(),
                &self.state[gpu],
                &self.inventory[gpu],
                &mut c,
            );
            let st = &mut self.state[gpu];
            match (st.lost, c.lost) {
                (false, true) => {
                    st.lost = true;
                    self.stats.gpus_lost.fetch_add(1, Relaxed);
                    self.stats.errors.fetch_add(1, Relaxed);
                    error!(gpu, uuid = %self.inventory[gpu].uuid, "GPU is lost (fallen off the bus); its readings are omitted");
                }
                (true, false) => {
                    st.lost = false;
                    info!(gpu, uuid = %self.inventory[gpu].uuid, "lost GPU answers again");
                }
                _ => {}
            }
            if !c.lost {
                out.append(&mut c.readings);
                failures.extend(
                    c.failures
                        .into_iter()
                        .map(|(i, m, e)| (gpu as u32, i, m, e)),
                );
            }
            if st.xid_watched {
                out.push(Reading::new(
                    gpu as u32,
                    Metric::XidErrors,
                    st.last_xid as f64,
                ));
                for (&xid, &n) in &st.xid_counts {
                    out.push(Reading {
                        gpu: gpu as u32,
                        metric: Metric::XidErrorsTotal,
                        value: n as f64,
                        label: Some(SeriesLabel::Xid(xid)),
                    });
                }
            }
        }
        for (gpu, instance, metric, e) in failures {
            self.note_failure(gpu, instance, metric, &e);
        }
        Ok(())
    }
}
