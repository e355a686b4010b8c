//! The metrics the agent emits: dcgm-exporter's default set (release <= 4.8.x
//! names, `etc/default-counters.csv`) restricted to what NVML can provide.
//! See `shared/spec/gpu-domain.md` §1.2 and §2 for each field's NVML source.
//!
//! Left out: `DCGM_FI_DEV_VGPU_LICENSE_STATUS` (vGPU entities only) and
//! `DCGM_FI_DRIVER_VERSION`, which is a label, not a series.

/// Prometheus metric type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Gauge,
    Counter,
}

/// One dcgm-exporter metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Metric {
    SmClock,
    MemClock,
    MemoryTemp,
    GpuTemp,
    PowerUsage,
    TotalEnergyConsumption,
    PcieReplayCounter,
    GpuUtil,
    MemCopyUtil,
    EncUtil,
    DecUtil,
    XidErrors,
    FbFree,
    FbUsed,
    FbReserved,
    NvlinkBandwidthTotal,
    UncorrectableRemappedRows,
    CorrectableRemappedRows,
    RowRemapFailure,
    GrEngineActive,
    PipeTensorActive,
    DramActive,
    PcieTxBytes,
    PcieRxBytes,
}

impl Metric {
    /// Every metric, in emission order.
    pub const ALL: [Metric; 24] = [
        Metric::SmClock,
        Metric::MemClock,
        Metric::MemoryTemp,
        Metric::GpuTemp,
        Metric::PowerUsage,
        Metric::TotalEnergyConsumption,
        Metric::PcieReplayCounter,
        Metric::GpuUtil,
        Metric::MemCopyUtil,
        Metric::EncUtil,
        Metric::DecUtil,
        Metric::XidErrors,
        Metric::FbFree,
        Metric::FbUsed,
        Metric::FbReserved,
        Metric::NvlinkBandwidthTotal,
        Metric::UncorrectableRemappedRows,
        Metric::CorrectableRemappedRows,
        Metric::RowRemapFailure,
        Metric::GrEngineActive,
        Metric::PipeTensorActive,
        Metric::DramActive,
        Metric::PcieTxBytes,
        Metric::PcieRxBytes,
    ];

    /// dcgm-exporter metric name.
    pub fn name(self) -> &'static str {
        self.info().0
    }

    pub fn kind(self) -> Kind {
        self.info().1
    }

    /// dcgm-exporter help text (with the unit).
    pub fn help(self) -> &'static str {
        self.info().2
    }

    fn info(self) -> (&'static str, Kind, &'static str) {
        use Kind::*;
        match self {
            Metric::SmClock => (
                "DCGM_FI_DEV_SM_CLOCK",
                Gauge,
                "SM clock frequency (in MHz).",
            ),
            Metric::MemClock => (
                "DCGM_FI_DEV_MEM_CLOCK",
                Gauge,
                "Memory clock frequency (in MHz).",
            ),
            Metric::MemoryTemp => (
                "DCGM_FI_DEV_MEMORY_TEMP",
                Gauge,
                "Memory temperature (in C).",
            ),
            Metric::GpuTemp => ("DCGM_FI_DEV_GPU_TEMP", Gauge, "GPU temperature (in C)."),
            Metric::PowerUsage => ("DCGM_FI_DEV_POWER_USAGE", Gauge, "Power draw (in W)."),
            Metric::TotalEnergyConsumption => (
                "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                Counter,
                "Total energy consumption since boot (in mJ).",
            ),
            Metric::PcieReplayCounter => (
                "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                Counter,
                "Total number of PCIe retries.",
            ),
            Metric::GpuUtil => ("DCGM_FI_DEV_GPU_UTIL", Gauge, "GPU utilization (in %)."),
            Metric::MemCopyUtil => (
                "DCGM_FI_DEV_MEM_COPY_UTIL",
                Gauge,
                "Memory utilization (in %).",
            ),
            Metric::EncUtil => ("DCGM_FI_DEV_ENC_UTIL", Gauge, "Encoder utilization (in %)."),
            Metric::DecUtil => ("DCGM_FI_DEV_DEC_UTIL", Gauge, "Decoder utilization (in %)."),
            Metric::XidErrors => (
                "DCGM_FI_DEV_XID_ERRORS",
                Gauge,
                "Value of the last XID error encountered.",
            ),
            Metric::FbFree => (
                "DCGM_FI_DEV_FB_FREE",
                Gauge,
                "Framebuffer memory free (in MiB).",
            ),
            Metric::FbUsed => (
                "DCGM_FI_DEV_FB_USED",
                Gauge,
                "Framebuffer memory used (in MiB).",
            ),
            Metric::FbReserved => (
                "DCGM_FI_DEV_FB_RESERVED",
                Gauge,
                "Framebuffer memory reserved (in MiB).",
            ),
            Metric::NvlinkBandwidthTotal => (
                "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                Counter,
                "Total number of NVLink bandwidth counters for all lanes.",
            ),
            Metric::UncorrectableRemappedRows => (
                "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                Counter,
                "Number of remapped rows for uncorrectable errors",
            ),
            Metric::CorrectableRemappedRows => (
                "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
                Counter,
                "Number of remapped rows for correctable errors",
            ),
            Metric::RowRemapFailure => (
                "DCGM_FI_DEV_ROW_REMAP_FAILURE",
                Gauge,
                "Whether remapping of rows has failed",
            ),
            Metric::GrEngineActive => (
                "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
                Gauge,
                "Ratio of time the graphics engine is active.",
            ),
            Metric::PipeTensorActive => (
                "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
                Gauge,
                "Ratio of cycles the tensor (HMMA) pipe is active.",
            ),
            Metric::DramActive => (
                "DCGM_FI_PROF_DRAM_ACTIVE",
                Gauge,
                "Ratio of cycles the device memory interface is active sending or receiving data.",
            ),
            Metric::PcieTxBytes => (
                "DCGM_FI_PROF_PCIE_TX_BYTES",
                Gauge,
                "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
            ),
            Metric::PcieRxBytes => (
                "DCGM_FI_PROF_PCIE_RX_BYTES",
                Gauge,
                "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_dcgm_prefixed() {
        let mut names: Vec<&str> = Metric::ALL.iter().map(|m| m.name()).collect();
        assert!(names.iter().all(|n| n.starts_with("DCGM_FI_")));
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Metric::ALL.len());
        // ALL lists the enum in declaration order, each variant once.
        for (i, m) in Metric::ALL.iter().enumerate() {
            assert_eq!(*m as usize, i);
        }
    }
}
