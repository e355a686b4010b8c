//! The metrics the agent emits: dcgm-exporter's default set (release <= 4.8.x
//! names, `etc/default-counters.csv`) restricted to what NVML can provide.
//! See `shared/spec/gpu-domain.md` §1.2 and §2 for each field's NVML source.
//!
//! Beyond the default set, the NVML-only rows dcgm-exporter ships commented
//! out (spec §1.3, §2, §5.3): clock throttle reasons as a bitmask, the
//! per-reason throttle time counters (`*_VIOLATION`, `CLOCKS_EVENT_REASON_*_NS`),
//! ECC totals, retired pages, row-remap pending, NVLink error totals and the
//! optional `DCGM_FI_PROF_*` GPM ratios; plus one metric of our own,
//! `gpulse_xid_errors_total` (a cumulative count per XID number; dcgm-exporter's
//! `DCGM_EXP_XID_ERRORS_COUNT` is a windowed count instead).
//!
//! The clock-event bitmask uses the pre-rename name
//! `DCGM_FI_DEV_CLOCK_THROTTLE_REASONS` (DCGM field 112, since renamed
//! `DCGM_FI_DEV_CLOCKS_EVENT_REASONS`): the name existing dashboards query.
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
    ClockThrottleReasons,
    PowerViolation,
    ThermalViolation,
    SyncBoostViolation,
    BoardLimitViolation,
    LowUtilViolation,
    ReliabilityViolation,
    ClocksEventSwPowerCapNs,
    ClocksEventSyncBoostNs,
    ClocksEventSwThermSlowdownNs,
    ClocksEventHwThermSlowdownNs,
    ClocksEventHwPowerBrakeSlowdownNs,
    EccSbeVolTotal,
    EccDbeVolTotal,
    EccSbeAggTotal,
    EccDbeAggTotal,
    RetiredSbe,
    RetiredDbe,
    RetiredPending,
    RowRemapPending,
    NvlinkCrcFlitErrorCountTotal,
    NvlinkCrcDataErrorCountTotal,
    NvlinkReplayErrorCountTotal,
    NvlinkRecoveryErrorCountTotal,
    SmActive,
    SmOccupancy,
    PipeFp64Active,
    PipeFp32Active,
    PipeFp16Active,
    // Labelled metrics (`Metric::LABELED`) come last, after every member of `ALL`.
    XidErrorsTotal,
}

impl Metric {
    /// The per-GPU metrics: a source that supports them all emits each once
    /// per GPU per poll, without a [`SeriesLabel`](crate::source::SeriesLabel)
    /// (the simulated source does). In emission order.
    ///
    /// A real GPU may lack some of them (skipped, never a sentinel), and MIG
    /// instances add labelled copies of a few; see [`crate::nvml`].
    pub const ALL: [Metric; 53] = [
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
        Metric::ClockThrottleReasons,
        Metric::PowerViolation,
        Metric::ThermalViolation,
        Metric::SyncBoostViolation,
        Metric::BoardLimitViolation,
        Metric::LowUtilViolation,
        Metric::ReliabilityViolation,
        Metric::ClocksEventSwPowerCapNs,
        Metric::ClocksEventSyncBoostNs,
        Metric::ClocksEventSwThermSlowdownNs,
        Metric::ClocksEventHwThermSlowdownNs,
        Metric::ClocksEventHwPowerBrakeSlowdownNs,
        Metric::EccSbeVolTotal,
        Metric::EccDbeVolTotal,
        Metric::EccSbeAggTotal,
        Metric::EccDbeAggTotal,
        Metric::RetiredSbe,
        Metric::RetiredDbe,
        Metric::RetiredPending,
        Metric::RowRemapPending,
        Metric::NvlinkCrcFlitErrorCountTotal,
        Metric::NvlinkCrcDataErrorCountTotal,
        Metric::NvlinkReplayErrorCountTotal,
        Metric::NvlinkRecoveryErrorCountTotal,
        Metric::SmActive,
        Metric::SmOccupancy,
        Metric::PipeFp64Active,
        Metric::PipeFp32Active,
        Metric::PipeFp16Active,
    ];

    /// Metrics only ever emitted with a [`SeriesLabel`](crate::source::SeriesLabel),
    /// as many series per GPU as label values seen, so not part of [`Metric::ALL`]:
    /// `XidErrorsTotal` (label `Xid`) appears once a GPU has had an XID.
    pub const LABELED: [Metric; 1] = [Metric::XidErrorsTotal];

    /// dcgm-exporter metric name (`gpulse_*` for the agent's own additions).
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
            Metric::ClockThrottleReasons => (
                "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                Gauge,
                "Current clock throttle reasons (bitmask of DCGM_CLOCKS_THROTTLE_REASON_*).",
            ),
            Metric::PowerViolation => (
                "DCGM_FI_DEV_POWER_VIOLATION",
                Counter,
                "Throttling duration due to power constraints (in ns).",
            ),
            Metric::ThermalViolation => (
                "DCGM_FI_DEV_THERMAL_VIOLATION",
                Counter,
                "Throttling duration due to thermal constraints (in ns).",
            ),
            Metric::SyncBoostViolation => (
                "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
                Counter,
                "Throttling duration due to sync-boost constraints (in ns).",
            ),
            Metric::BoardLimitViolation => (
                "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
                Counter,
                "Throttling duration due to board limit constraints (in ns).",
            ),
            Metric::LowUtilViolation => (
                "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
                Counter,
                "Throttling duration due to low utilization (in ns).",
            ),
            Metric::ReliabilityViolation => (
                "DCGM_FI_DEV_RELIABILITY_VIOLATION",
                Counter,
                "Throttling duration due to reliability constraints (in ns).",
            ),
            Metric::ClocksEventSwPowerCapNs => (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP_NS",
                Counter,
                "Throttling to not exceed currently set power limits (in ns).",
            ),
            Metric::ClocksEventSyncBoostNs => (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SYNC_BOOST_NS",
                Counter,
                "Throttling to match minimum possible clock across Sync Boost Group (in ns).",
            ),
            Metric::ClocksEventSwThermSlowdownNs => (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN_NS",
                Counter,
                "Throttling to ensure GPU and memory temperatures stay below their max operating temperatures (in ns).",
            ),
            Metric::ClocksEventHwThermSlowdownNs => (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN_NS",
                Counter,
                "Throttling due to temperature being too high, reducing core clocks by a factor of 2 or more (in ns).",
            ),
            Metric::ClocksEventHwPowerBrakeSlowdownNs => (
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN_NS",
                Counter,
                "Throttling due to external power brake assertion trigger, reducing core clocks by a factor of 2 or more (in ns).",
            ),
            Metric::EccSbeVolTotal => (
                "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                Counter,
                "Total number of single-bit volatile ECC errors.",
            ),
            Metric::EccDbeVolTotal => (
                "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                Counter,
                "Total number of double-bit volatile ECC errors.",
            ),
            Metric::EccSbeAggTotal => (
                "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
                Counter,
                "Total number of single-bit persistent ECC errors.",
            ),
            Metric::EccDbeAggTotal => (
                "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
                Counter,
                "Total number of double-bit persistent ECC errors.",
            ),
            Metric::RetiredSbe => (
                "DCGM_FI_DEV_RETIRED_SBE",
                Counter,
                "Total number of retired pages due to single-bit errors.",
            ),
            Metric::RetiredDbe => (
                "DCGM_FI_DEV_RETIRED_DBE",
                Counter,
                "Total number of retired pages due to double-bit errors.",
            ),
            Metric::RetiredPending => (
                "DCGM_FI_DEV_RETIRED_PENDING",
                Counter,
                "Total number of pages pending retirement.",
            ),
            Metric::RowRemapPending => (
                "DCGM_FI_DEV_ROW_REMAP_PENDING",
                Gauge,
                "Whether remapping of rows is pending (applied at the next GPU reset)",
            ),
            Metric::NvlinkCrcFlitErrorCountTotal => (
                "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
                Counter,
                "Total number of NVLink flow-control CRC errors.",
            ),
            Metric::NvlinkCrcDataErrorCountTotal => (
                "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
                Counter,
                "Total number of NVLink data CRC errors.",
            ),
            Metric::NvlinkReplayErrorCountTotal => (
                "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
                Counter,
                "Total number of NVLink retries.",
            ),
            Metric::NvlinkRecoveryErrorCountTotal => (
                "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
                Counter,
                "Total number of NVLink recovery errors.",
            ),
            Metric::SmActive => (
                "DCGM_FI_PROF_SM_ACTIVE",
                Gauge,
                "The ratio of cycles an SM has at least 1 warp assigned.",
            ),
            Metric::SmOccupancy => (
                "DCGM_FI_PROF_SM_OCCUPANCY",
                Gauge,
                "The ratio of number of warps resident on an SM.",
            ),
            Metric::PipeFp64Active => (
                "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
                Gauge,
                "Ratio of cycles the fp64 pipes are active.",
            ),
            Metric::PipeFp32Active => (
                "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
                Gauge,
                "Ratio of cycles the fp32 pipes are active.",
            ),
            Metric::PipeFp16Active => (
                "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
                Gauge,
                "Ratio of cycles the fp16 pipes are active.",
            ),
            Metric::XidErrorsTotal => (
                "gpulse_xid_errors_total",
                Counter,
                "Number of XID errors of each XID number (label xid) seen since the agent started.",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_dcgm_prefixed() {
        assert!(Metric::ALL.iter().all(|m| m.name().starts_with("DCGM_FI_")));
        assert!(
            Metric::LABELED
                .iter()
                .all(|m| m.name().starts_with("gpulse_"))
        );
        let mut names: Vec<&str> = Metric::ALL
            .iter()
            .chain(&Metric::LABELED)
            .map(|m| m.name())
            .collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Metric::ALL.len() + Metric::LABELED.len());
        // ALL then LABELED list the enum in declaration order, each variant once.
        for (i, m) in Metric::ALL.iter().chain(&Metric::LABELED).enumerate() {
            assert_eq!(*m as usize, i);
        }
    }

    #[test]
    fn counters_and_units_of_the_new_rows() {
        // Spot checks against spec §1.3 / §5.3, written out by hand.
        assert_eq!(Metric::PowerViolation.kind(), Kind::Counter);
        assert!(Metric::PowerViolation.help().contains("(in ns)"));
        assert_eq!(Metric::ClockThrottleReasons.kind(), Kind::Gauge);
        assert_eq!(
            Metric::EccDbeVolTotal.name(),
            "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
        );
        assert_eq!(Metric::XidErrorsTotal.kind(), Kind::Counter);
    }
}
