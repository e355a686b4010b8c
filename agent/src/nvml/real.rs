//! [`NvmlBackend`] over `nvml-wrapper` 0.13, with raw `nvml-wrapper-sys`
//! calls for the two things the wrapper does not expose: field values with a
//! scope id (NVLink throughput over all links) and a MIG device's GPU-instance
//! id.
//!
//! The `Nvml` handle is leaked on open (`&'static Nvml`) so that devices, GPM
//! samples and the event set, which all borrow it, can live in the source and
//! in the XID thread. NVML then stays loaded until the process exits; the
//! agent opens it once.

use std::collections::HashMap;
use std::mem;
use std::time::Duration;

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::struct_wrappers::device::FieldValueSample;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::sys_exports::field_id::{
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
};
use nvml_wrapper::{Device, EventSet, GpmSample, Nvml};
use nvml_wrapper_sys::bindings::nvmlFieldValue_t;

use super::device::{
    ClockDomain, DeviceError, DeviceResult, GpmMetric, MemoryBytes, NvlinkThroughput, NvmlBackend,
    NvmlDevice, Utilization, XidEvent, XidEvents, XidSubscription,
};
use crate::source::MigInstance;

/// `scopeId` that asks a per-link NVLink field for the sum over all links.
const ALL_LINKS: u32 = u32::MAX;

/// NVML, loaded.
#[derive(Debug)]
pub(crate) struct RealBackend {
    nvml: &'static Nvml,
}

impl RealBackend {
    pub(crate) fn init() -> Result<Self, NvmlError> {
        let nvml: &'static Nvml = Box::leak(Box::new(Nvml::init()?));
        Ok(Self { nvml })
    }
}

impl NvmlBackend for RealBackend {
    fn driver_version(&self) -> DeviceResult<String> {
        Ok(self.nvml.sys_driver_version()?)
    }

    fn cuda_driver_version(&self) -> DeviceResult<i32> {
        Ok(self.nvml.sys_cuda_driver_version()?)
    }

    fn devices(&mut self) -> DeviceResult<Vec<Box<dyn NvmlDevice>>> {
        let mut out: Vec<Box<dyn NvmlDevice>> = Vec::new();
        for index in 0..self.nvml.device_count()? {
            let device = self.nvml.device_by_index(index)?;
            out.push(Box::new(RealDevice {
                nvml: self.nvml,
                device,
                gpm_prev: HashMap::new(),
            }));
        }
        Ok(out)
    }

    fn xid_events(&mut self) -> DeviceResult<XidSubscription> {
        let set = self.nvml.create_event_set()?;
        let registered = (0..self.nvml.device_count()?)
            .map(|index| {
                let device = self.nvml.device_by_index(index)?;
                if !device
                    .supported_event_types()?
                    .contains(EventTypes::CRITICAL_XID_ERROR)
                {
                    return Err(DeviceError::NotSupported);
                }
                register_xid(self.nvml, &device, &set)
            })
            .collect();
        Ok(XidSubscription {
            events: Box::new(RealXidEvents { set }),
            registered,
        })
    }
}

/// `nvmlDeviceRegisterEvents` for XIDs. Raw, because on failure
/// `Device::register_events` releases the whole set, dropping the GPUs
/// registered before.
fn register_xid(nvml: &Nvml, device: &Device<'_>, set: &EventSet<'_>) -> DeviceResult<()> {
    let sym = nvml_sym(nvml.lib().nvmlDeviceRegisterEvents.as_ref())?;
    // SAFETY: device and set handles come from this NVML instance and stay
    // alive for the call; NVML only reads them.
    nvml_try(unsafe {
        sym(
            device.handle(),
            EventTypes::CRITICAL_XID_ERROR.bits(),
            set.handle(),
        )
    })?;
    Ok(())
}

/// One GPU.
struct RealDevice {
    nvml: &'static Nvml,
    device: Device<'static>,
    /// The previous GPM sample per GPU instance (`None`: whole GPU).
    gpm_prev: HashMap<Option<u32>, GpmSample<'static>>,
}

impl RealDevice {
    /// `nvmlDeviceGetFieldValues` with explicit scope ids, which
    /// `Device::field_values_for` does not take.
    fn scoped_field_values(&self, ids: &[(u32, u32)]) -> DeviceResult<Vec<DeviceResult<u64>>> {
        let sym = nvml_sym(self.nvml.lib().nvmlDeviceGetFieldValues.as_ref())?;
        let mut values: Vec<nvmlFieldValue_t> = ids
            .iter()
            .map(|&(field, scope)| {
                // SAFETY: nvmlFieldValue_t is a plain C struct (integers and a
                // union of integers/double); all-zero is a valid value.
                let mut v: nvmlFieldValue_t = unsafe { mem::zeroed() };
                v.fieldId = field;
                v.scopeId = scope;
                v
            })
            .collect();
        // SAFETY: the handle comes from this NVML instance and outlives the
        // call; `values` holds `ids.len()` initialised entries that NVML
        // writes in place.
        nvml_try(unsafe {
            sym(
                self.device.handle(),
                values.len() as i32,
                values.as_mut_ptr(),
            )
        })?;
        Ok(values
            .into_iter()
            .map(|v| match FieldValueSample::try_from(v)?.value? {
                SampleValue::U64(x) => Ok(x),
                SampleValue::U32(x) => Ok(u64::from(x)),
                SampleValue::I64(x) if x >= 0 => Ok(x as u64),
                _ => Err(DeviceError::NotSupported),
            })
            .collect())
    }

    fn gpu_instance_id(&self, mig: &Device<'static>) -> DeviceResult<u32> {
        let sym = nvml_sym(self.nvml.lib().nvmlDeviceGetGpuInstanceId.as_ref())?;
        let mut id: u32 = 0;
        // SAFETY: `mig` is a live MIG device handle of this NVML instance; `id`
        // is a valid out pointer for the call.
        nvml_try(unsafe { sym(mig.handle(), &mut id) })?;
        Ok(id)
    }
}

fn memory_bytes(d: &Device<'_>) -> DeviceResult<MemoryBytes> {
    let m = d.memory_info()?;
    Ok(MemoryBytes {
        free: m.free,
        used: m.used,
        reserved: m.reserved,
    })
}

fn gpm_id(m: GpmMetric) -> GpmMetricId {
    match m {
        GpmMetric::GraphicsUtil => GpmMetricId::GraphicsUtil,
        GpmMetric::SmUtil => GpmMetricId::SmUtil,
        GpmMetric::SmOccupancy => GpmMetricId::SmOccupancy,
        GpmMetric::AnyTensorUtil => GpmMetricId::AnyTensorUtil,
        GpmMetric::DramBwUtil => GpmMetricId::DramBwUtil,
        GpmMetric::Fp64Util => GpmMetricId::Fp64Util,
        GpmMetric::Fp32Util => GpmMetricId::Fp32Util,
        GpmMetric::Fp16Util => GpmMetricId::Fp16Util,
        GpmMetric::PcieTxMibPerSec => GpmMetricId::PcieTxPerSec,
        GpmMetric::PcieRxMibPerSec => GpmMetricId::PcieRxPerSec,
    }
}

impl NvmlDevice for RealDevice {
    fn uuid(&self) -> DeviceResult<String> {
        Ok(self.device.uuid()?)
    }

    fn name(&self) -> DeviceResult<String> {
        Ok(self.device.name()?)
    }

    fn serial(&self) -> DeviceResult<String> {
        Ok(self.device.serial()?)
    }

    fn vbios_version(&self) -> DeviceResult<String> {
        Ok(self.device.vbios_version()?)
    }

    fn inforom_image_version(&self) -> DeviceResult<String> {
        Ok(self.device.info_rom_image_version()?)
    }

    fn pci_bus_id(&self) -> DeviceResult<String> {
        Ok(self.device.pci_info()?.bus_id)
    }

    fn mig_enabled(&self) -> DeviceResult<bool> {
        Ok(self.device.mig_mode()?.current == 1)
    }

    fn mig_instances(&self) -> DeviceResult<Vec<MigInstance>> {
        let mut out = Vec::new();
        for i in 0..self.device.mig_device_count()? {
            let mig = match self.device.mig_device_by_index(i) {
                Ok(m) => m,
                // Unpopulated slots answer NotFound.
                Err(NvmlError::NotFound | NvmlError::InvalidArg) => continue,
                Err(e) => return Err(e.into()),
            };
            let gpu_instance_id = self.gpu_instance_id(&mig)?;
            // A MIG device's name ends with its profile: "NVIDIA H100 80GB HBM3 MIG 1g.10gb".
            let name = mig.name()?;
            let profile = name
                .rsplit_once("MIG ")
                .map(|(_, p)| p.trim().to_string())
                .unwrap_or(name);
            out.push(MigInstance {
                gpu_instance_id,
                profile,
            });
        }
        Ok(out)
    }

    fn gpm_supported(&self) -> DeviceResult<bool> {
        Ok(self.device.gpm_support()?)
    }

    fn clock_mhz(&self, clock: ClockDomain) -> DeviceResult<u32> {
        let c = match clock {
            ClockDomain::Sm => Clock::SM,
            ClockDomain::Memory => Clock::Memory,
        };
        Ok(self.device.clock_info(c)?)
    }

    fn gpu_temp_c(&self) -> DeviceResult<u32> {
        Ok(self.device.temperature(TemperatureSensor::Gpu)?)
    }

    fn power_mw(&self) -> DeviceResult<u32> {
        Ok(self.device.power_usage()?)
    }

    fn energy_mj(&self) -> DeviceResult<u64> {
        Ok(self.device.total_energy_consumption()?)
    }

    fn pcie_replays(&self) -> DeviceResult<u32> {
        Ok(self.device.pcie_replay_counter()?)
    }

    fn utilization(&self) -> DeviceResult<Utilization> {
        let u = self.device.utilization_rates()?;
        Ok(Utilization {
            gpu_pct: u.gpu,
            memory_pct: u.memory,
        })
    }

    fn encoder_util_pct(&self) -> DeviceResult<u32> {
        Ok(self.device.encoder_utilization()?.utilization)
    }

    fn decoder_util_pct(&self) -> DeviceResult<u32> {
        Ok(self.device.decoder_utilization()?.utilization)
    }

    fn memory(&self) -> DeviceResult<MemoryBytes> {
        memory_bytes(&self.device)
    }

    fn clocks_event_reasons(&self) -> DeviceResult<u64> {
        Ok(self.device.current_throttle_reasons()?.bits())
    }

    fn field_values(&self, ids: &[u32]) -> DeviceResult<Vec<DeviceResult<SampleValue>>> {
        // The wrapper translates ids whose numbers moved in newer drivers
        // (CLOCKS_EVENT_REASON_*), so scope-0 fields go through it.
        let ids: Vec<FieldId> = ids.iter().map(|&id| FieldId(id)).collect();
        Ok(self
            .device
            .field_values_for(&ids)?
            .into_iter()
            .map(|r| Ok(r?.value?))
            .collect())
    }

    fn nvlink_throughput(&self) -> DeviceResult<NvlinkThroughput> {
        let v = self.scoped_field_values(&[
            (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
            (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        ])?;
        let mut v = v.into_iter();
        let (Some(tx), Some(rx)) = (v.next(), v.next()) else {
            return Err(DeviceError::NotSupported);
        };
        Ok(NvlinkThroughput {
            tx_kib: tx?,
            rx_kib: rx?,
        })
    }

    fn mig_memory(&self, gpu_instance_id: u32) -> DeviceResult<MemoryBytes> {
        // At most 7 MIG devices: finding the one each poll is cheaper than
        // keeping handles that a MIG reconfiguration would invalidate.
        for i in 0..self.device.mig_device_count()? {
            if let Ok(m) = self.device.mig_device_by_index(i)
                && self.gpu_instance_id(&m)? == gpu_instance_id
            {
                return memory_bytes(&m);
            }
        }
        Err(DeviceError::NotSupported)
    }

    fn gpm(
        &mut self,
        gpu_instance: Option<u32>,
        metrics: &[GpmMetric],
    ) -> DeviceResult<Vec<DeviceResult<f64>>> {
        let sample = match gpu_instance {
            None => self.device.gpm_sample()?,
            Some(gi) => self.device.gpm_mig_sample(gi)?,
        };
        let Some(prev) = self.gpm_prev.insert(gpu_instance, sample) else {
            return Err(DeviceError::NoData);
        };
        let now = &self.gpm_prev[&gpu_instance];
        let ids: Vec<GpmMetricId> = metrics.iter().map(|&m| gpm_id(m)).collect();
        Ok(gpm_metrics_get(self.nvml, &prev, now, &ids)?
            .into_iter()
            .map(|r| Ok(r?.value))
            .collect())
    }
}

/// The XID event set.
struct RealXidEvents {
    set: EventSet<'static>,
}

impl XidEvents for RealXidEvents {
    fn wait(&mut self, timeout: Duration) -> DeviceResult<Option<XidEvent>> {
        let ms = timeout.as_millis().min(u32::MAX as u128) as u32;
        match self.set.wait(ms) {
            Ok(e) => {
                let Some(XidError::Value(xid)) = e.event_data else {
                    // Unknown XID (999) or another event type: nothing to count.
                    return Ok(None);
                };
                let gpu = e.device.index()?;
                Ok(Some(XidEvent { gpu, xid }))
            }
            Err(NvmlError::Timeout) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }
}
