//! `xid`: NVIDIA XID errors, classified by NVIDIA's XID catalog.
//!
//! Signal: `DCGM_FI_DEV_XID_ERRORS`, a *last-value gauge*: it holds the most
//! recent XID number and never resets until the exporter restarts, so two
//! identical XIDs in a row are indistinguishable from one (spec §4 #1). We
//! therefore count an *occurrence* when the gauge changes to a non-zero value,
//! and when the first value a detector sees is non-zero (an XID happened at or
//! before that poll). A change to 0 (exporter restart) is no occurrence.
//!
//! Rule (spec §5.1, research §2.1): look the code up in [`CATALOG`], NVIDIA's
//! XID catalog as encoded by NVSentinel
//! (`distros/kubernetes/nvsentinel/charts/gpu-health-monitor/xiderrorsmapping.csv`,
//! read at commit `6f8b0fcf`; catalog: docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html).
//! - Catalog bucket IGNORE (19 codes, e.g. 43, 63, 92), WORKFLOW_XID_45 (45:
//!   preemptive cleanup after an earlier error, which carries its own XID) and
//!   "follow the linked Xid" (154): no event. Research §2.1 allows "info/no
//!   page"; we emit nothing, so ignored codes cost no event lifecycle. XID 63
//!   (row-remap/page-retirement recording) is the `row_remap`/`ecc`
//!   detectors' business.
//! - NONFATAL codes otherwise (RESTART_APP, CHECK_UVM; e.g. 13, 31, 94):
//!   [`Severity::Warning`], restart the application (a job-level error).
//! - FATAL codes (e.g. 48, 64, 74, 79, 95, 119, 120, 140): [`Severity::Critical`],
//!   the bucket's action (reset GPU, reboot node, drain and report, ...).
//! - Codes not in the catalog (newer drivers): Warning, investigate.
//!
//! Repeats (NVSentinel health-events-analyzer defaults, research §2.1):
//! occurrences of one XID less than [`XidConfig::burst_gap_ms`] (3 min) apart
//! form one *burst* (NVIDIA Fleet Intelligence's definition, spec §5.1). A
//! non-fatal XID's 2nd burst within 24 h escalates to Critical, drain and
//! report (NVSentinel: XID 31 twice in 24 h on one GPU → run diagnostics; we
//! apply it to every non-fatal code). A fatal XID's 5th burst within 24 h
//! hardens the action to drain and report (NVSentinel: fatal XID ≥ 5× in 24 h
//! → contact support).
//!
//! Clearing: an XID event clears at the first poll at least
//! [`XidConfig::clear_after_ms`] (1 h) after that XID's last occurrence. This
//! is "no new evidence for an hour", not "repaired": the gauge cannot show a
//! repair. The 24 h burst memory survives clearing, so a recurrence reopens
//! the event already escalated.
//!
//! State: at most [`MAX_OPEN`] open XID events and [`MAX_BURSTS`] remembered
//! bursts per GPU. Opening a 17th event clears the one quiet the longest;
//! a 33rd burst within 24 h forgets the oldest (repeat counts may then be low).

use std::fmt::Write as _;

use crate::{Clearing, Detector, Escalation, EventKey, Field, Finding, Kind, Poll, PollClock};
use crate::{ConfigError, Severity, Transition, fmt_duration};

/// NVIDIA's "Resolution Bucket (Immediate Action)" of an XID, as named in the
/// catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bucket {
    /// UNEXPECTED_ERR_REPORT_ISSUE (63 codes, all FATAL).
    ReportIssue,
    /// RESTART_APP (48 codes, all NONFATAL).
    RestartApp,
    /// IGNORE (19 codes, all NONFATAL).
    Ignore,
    /// RESET_GPU (15 codes, all FATAL).
    ResetGpu,
    /// WORKFLOW_NVLINK5_ERR (144-150).
    WorkflowNvlink5,
    /// RESTART_BM: bare-metal restart (79, 160).
    RestartBm,
    /// WORKFLOW_XID_48: double-bit ECC error.
    WorkflowXid48,
    /// WORKFLOW_XID_45: preemptive cleanup, follows another error.
    WorkflowXid45,
    /// WORKFLOW_NVLINK_ERR (74).
    WorkflowNvlink,
    /// UPDATE_SWFW (78).
    UpdateSwFw,
    /// RESTART_VM (151).
    RestartVm,
    /// "Follow guidance as it applies to another Xid" (154).
    FollowLinkedXid,
    /// CHECK_UVM (159).
    CheckUvm,
    /// CHECK_MECHANICALS (54).
    CheckMechanicals,
}

impl Bucket {
    /// The catalog's name for the bucket.
    pub const fn as_str(self) -> &'static str {
        match self {
            Bucket::ReportIssue => "UNEXPECTED_ERR_REPORT_ISSUE",
            Bucket::RestartApp => "RESTART_APP",
            Bucket::Ignore => "IGNORE",
            Bucket::ResetGpu => "RESET_GPU",
            Bucket::WorkflowNvlink5 => "WORKFLOW_NVLINK5_ERR",
            Bucket::RestartBm => "RESTART_BM",
            Bucket::WorkflowXid48 => "WORKFLOW_XID_48",
            Bucket::WorkflowXid45 => "WORKFLOW_XID_45",
            Bucket::WorkflowNvlink => "WORKFLOW_NVLINK_ERR",
            Bucket::UpdateSwFw => "UPDATE_SWFW",
            Bucket::RestartVm => "RESTART_VM",
            Bucket::FollowLinkedXid => "FOLLOW_LINKED_XID",
            Bucket::CheckUvm => "CHECK_UVM",
            Bucket::CheckMechanicals => "CHECK_MECHANICALS",
        }
    }

    /// What gpulse recommends for the bucket ([`Action::Ignore`] = no event).
    pub const fn action(self) -> Action {
        match self {
            Bucket::Ignore | Bucket::WorkflowXid45 | Bucket::FollowLinkedXid => Action::Ignore,
            Bucket::RestartApp | Bucket::CheckUvm => Action::RestartApp,
            Bucket::ResetGpu | Bucket::WorkflowXid48 => Action::ResetGpu,
            Bucket::RestartBm | Bucket::RestartVm => Action::RebootNode,
            Bucket::ReportIssue
            | Bucket::WorkflowNvlink
            | Bucket::WorkflowNvlink5
            | Bucket::CheckMechanicals => Action::DrainAndReport,
            Bucket::UpdateSwFw => Action::UpdateSoftware,
        }
    }
}

/// A recommended action, coarser than the catalog's buckets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// No event (catalog IGNORE and the "follow another XID" buckets).
    Ignore,
    /// Job-level error: restart the application; the GPU stays in service.
    RestartApp,
    /// Drain the GPU's work and reset the GPU.
    ResetGpu,
    /// Drain the node and restart it (bare metal or VM).
    RebootNode,
    /// Take the GPU out of service and report a hardware fault.
    DrainAndReport,
    /// Update the driver / vGPU software and firmware.
    UpdateSoftware,
    /// Not in the catalog: look it up.
    Investigate,
}

impl Action {
    /// The action as shown to an operator (also [`Finding::action`]).
    pub const fn as_str(self) -> &'static str {
        match self {
            Action::Ignore => "none (catalog: ignore)",
            Action::RestartApp => "restart the application; the GPU stays in service",
            Action::ResetGpu => "drain the GPU and reset it",
            Action::RebootNode => "drain the node and reboot it",
            Action::DrainAndReport => {
                "drain the GPU and report a hardware fault (run field diagnostics)"
            }
            Action::UpdateSoftware => "update the driver / vGPU software and firmware",
            Action::Investigate => "investigate: XID not in NVIDIA's catalog as gpulse knows it",
        }
    }
}

/// One row of the XID catalog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XidEntry {
    /// The XID number.
    pub code: u32,
    /// The driver's name for it.
    pub name: &'static str,
    /// The catalog's immediate-action bucket.
    pub bucket: Bucket,
    /// The catalog's FATAL flag.
    pub fatal: bool,
}

impl XidEntry {
    /// Severity and action for a single occurrence; `None` = no event.
    pub const fn classify(&self) -> Option<(Severity, Action)> {
        match self.bucket.action() {
            Action::Ignore => None,
            action if self.fatal => Some((Severity::Critical, action)),
            action => Some((Severity::Warning, action)),
        }
    }
}

/// Severity and action for a single occurrence of `code`; `None` = no event.
/// Codes not in the catalog are a warning to investigate.
pub fn classify(code: u32) -> Option<(Severity, Action)> {
    match lookup(code) {
        Some(entry) => entry.classify(),
        None => Some((Severity::Warning, Action::Investigate)),
    }
}

/// The catalog row for `code`.
pub fn lookup(code: u32) -> Option<&'static XidEntry> {
    let i = usize::try_from(code.checked_sub(1)?).ok()?;
    CATALOG.get(i)
}

const FATAL: bool = true;
const NONFATAL: bool = false;

const fn x(code: u32, name: &'static str, bucket: Bucket, fatal: bool) -> XidEntry {
    XidEntry {
        code,
        name,
        bucket,
        fatal,
    }
}

use Bucket::{
    CheckMechanicals, CheckUvm, FollowLinkedXid, Ignore, ReportIssue, ResetGpu, RestartApp,
    RestartBm, RestartVm, UpdateSwFw, WorkflowNvlink, WorkflowNvlink5, WorkflowXid45,
    WorkflowXid48,
};

/// NVIDIA's XID catalog, XIDs 1-162 in order (`CATALOG[i].code == i + 1`):
/// 162 codes, 92 FATAL and 70 NONFATAL. Transcribed from NVSentinel's
/// `xiderrorsmapping.csv` (see the module docs), which encodes
/// docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html; counts match
/// research §2.1. Names are the driver's; 162 has none in the source.
pub static CATALOG: [XidEntry; 162] = [
    x(
        1,
        "ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD",
        ReportIssue,
        FATAL,
    ),
    x(2, "ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD", ReportIssue, FATAL),
    x(
        3,
        "ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD",
        ReportIssue,
        FATAL,
    ),
    x(
        4,
        "ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY",
        ReportIssue,
        FATAL,
    ),
    x(
        5,
        "ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW",
        ReportIssue,
        FATAL,
    ),
    x(6, "ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR", ReportIssue, FATAL),
    x(7, "ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR", ReportIssue, FATAL),
    x(
        8,
        "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT",
        RestartApp,
        NONFATAL,
    ),
    x(9, "ROBUST_CHANNEL_GR_ERROR_INSTANCE", ReportIssue, FATAL),
    x(
        10,
        "ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP",
        ReportIssue,
        FATAL,
    ),
    x(
        11,
        "ROBUST_CHANNEL_GR_ERROR_MISSING_HW",
        RestartApp,
        NONFATAL,
    ),
    x(12, "ROBUST_CHANNEL_GR_ERROR_SW_METHOD", ReportIssue, FATAL),
    x(
        13,
        "ROBUST_CHANNEL_GR_EXCEPTION / ROBUST_CHANNEL_GR_ERROR_SW_NOTIFY",
        RestartApp,
        NONFATAL,
    ),
    x(14, "ROBUST_CHANNEL_FAKE_ERROR", Ignore, NONFATAL),
    x(15, "ROBUST_CHANNEL_SCANLINE_TIMEOUT", ReportIssue, FATAL),
    x(
        16,
        "ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT",
        ReportIssue,
        FATAL,
    ),
    x(17, "ROBUST_CHANNEL_PARAMETER_ERROR", ReportIssue, FATAL),
    x(
        18,
        "ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR",
        ReportIssue,
        FATAL,
    ),
    x(
        19,
        "ROBUST_CHANNEL_DISP_MISSED_NOTIFIER",
        ReportIssue,
        FATAL,
    ),
    x(
        20,
        "ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD",
        ReportIssue,
        FATAL,
    ),
    x(21, "ROBUST_CHANNEL_ME_ERROR_SW_METHOD", ReportIssue, FATAL),
    x(22, "ROBUST_CHANNEL_VP_ERROR_SW_METHOD", ReportIssue, FATAL),
    x(23, "ROBUST_CHANNEL_RC_LOGGING_ENABLED", ReportIssue, FATAL),
    x(
        24,
        "ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT",
        ReportIssue,
        FATAL,
    ),
    x(25, "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", RestartApp, NONFATAL),
    x(
        26,
        "ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT",
        ReportIssue,
        FATAL,
    ),
    x(27, "ROBUST_CHANNEL_VP_ERROR", ReportIssue, FATAL),
    x(28, "ROBUST_CHANNEL_VP2_ERROR", ReportIssue, FATAL),
    x(29, "ROBUST_CHANNEL_BSP_ERROR", ReportIssue, FATAL),
    x(30, "ROBUST_CHANNEL_BAD_ADDR_ACCESS", ReportIssue, FATAL),
    x(
        31,
        "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT",
        RestartApp,
        NONFATAL,
    ),
    x(32, "ROBUST_CHANNEL_PBDMA_ERROR", RestartApp, NONFATAL),
    x(33, "ROBUST_CHANNEL_SEC_ERROR", ReportIssue, FATAL),
    x(34, "ROBUST_CHANNEL_MSVLD_ERROR", ReportIssue, FATAL),
    x(35, "ROBUST_CHANNEL_MSPDEC_ERROR", ReportIssue, FATAL),
    x(36, "ROBUST_CHANNEL_MSPPP_ERROR", ReportIssue, FATAL),
    x(
        37,
        "ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD",
        Ignore,
        NONFATAL,
    ),
    x(
        38,
        "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT",
        Ignore,
        NONFATAL,
    ),
    x(39, "ROBUST_CHANNEL_CE0_ERROR", RestartApp, NONFATAL),
    x(40, "ROBUST_CHANNEL_CE1_ERROR", RestartApp, NONFATAL),
    x(41, "ROBUST_CHANNEL_CE2_ERROR", RestartApp, NONFATAL),
    x(42, "ROBUST_CHANNEL_VIC_ERROR", ReportIssue, FATAL),
    x(
        43,
        "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR",
        Ignore,
        NONFATAL,
    ),
    x(44, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", Ignore, NONFATAL),
    x(
        45,
        "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL",
        WorkflowXid45,
        NONFATAL,
    ),
    x(46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", ResetGpu, FATAL),
    x(47, "ROBUST_CHANNEL_NVENC0_ERROR", ReportIssue, FATAL),
    x(48, "ROBUST_CHANNEL_GPU_ECC_DBE", WorkflowXid48, FATAL),
    x(
        49,
        "SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY",
        ReportIssue,
        FATAL,
    ),
    x(
        50,
        "SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR",
        ReportIssue,
        FATAL,
    ),
    x(51, "SILENT_RUNNING_STRESS_TEST_FAILURE", ReportIssue, FATAL),
    x(
        52,
        "SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE",
        ReportIssue,
        FATAL,
    ),
    x(
        53,
        "SILENT_RUNNING_TEMP_REDUCED_CLOCKING",
        ReportIssue,
        FATAL,
    ),
    x(
        54,
        "SILENT_RUNNING_PWR_REDUCED_CLOCKING",
        CheckMechanicals,
        FATAL,
    ),
    x(
        55,
        "SILENT_RUNNING_TEMPERATURE_READ_ERROR",
        ReportIssue,
        FATAL,
    ),
    x(56, "DISPLAY_CHANNEL_EXCEPTION", ReportIssue, FATAL),
    x(57, "FB_LINK_TRAINING_FAILURE_ERROR", ReportIssue, FATAL),
    x(58, "FB_MEMORY_ERROR", ReportIssue, FATAL),
    x(59, "PMU_ERROR", ReportIssue, FATAL),
    x(60, "ROBUST_CHANNEL_SEC2_ERROR", RestartApp, NONFATAL),
    x(61, "PMU_BREAKPOINT", ReportIssue, FATAL),
    x(62, "PMU_HALT_ERROR", ResetGpu, FATAL),
    x(63, "INFOROM_DRAM_RETIREMENT_EVENT", Ignore, NONFATAL),
    x(64, "INFOROM_DRAM_RETIREMENT_FAILURE", ResetGpu, FATAL),
    x(65, "ROBUST_CHANNEL_NVENC1_ERROR", ReportIssue, FATAL),
    x(
        66,
        "ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION",
        Ignore,
        NONFATAL,
    ),
    x(
        67,
        "ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION",
        Ignore,
        NONFATAL,
    ),
    x(68, "ROBUST_CHANNEL_NVDEC0_ERROR", RestartApp, NONFATAL),
    x(69, "ROBUST_CHANNEL_GR_CLASS_ERROR", RestartApp, NONFATAL),
    x(70, "ROBUST_CHANNEL_CE3_ERROR", RestartApp, NONFATAL),
    x(71, "ROBUST_CHANNEL_CE4_ERROR", RestartApp, NONFATAL),
    x(72, "ROBUST_CHANNEL_CE5_ERROR", RestartApp, NONFATAL),
    x(73, "ROBUST_CHANNEL_NVENC2_ERROR", ReportIssue, FATAL),
    x(74, "NVLINK_ERROR", WorkflowNvlink, FATAL),
    x(75, "ROBUST_CHANNEL_CE6_ERROR", RestartApp, NONFATAL),
    x(76, "ROBUST_CHANNEL_CE7_ERROR", RestartApp, NONFATAL),
    x(77, "ROBUST_CHANNEL_CE8_ERROR", RestartApp, NONFATAL),
    x(78, "VGPU_START_ERROR", UpdateSwFw, FATAL),
    x(
        79,
        "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS",
        RestartBm,
        FATAL,
    ),
    x(80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", RestartApp, NONFATAL),
    x(81, "ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR", ReportIssue, FATAL),
    x(82, "ROBUST_CHANNEL_NVJPG0_ERROR", RestartApp, NONFATAL),
    x(83, "ROBUST_CHANNEL_NVDEC1_ERROR", RestartApp, NONFATAL),
    x(84, "ROBUST_CHANNEL_NVDEC2_ERROR", RestartApp, NONFATAL),
    x(85, "ROBUST_CHANNEL_CE9_ERROR", RestartApp, NONFATAL),
    x(86, "ROBUST_CHANNEL_OFA0_ERROR", RestartApp, NONFATAL),
    x(87, "NVTELEMETRY_DRIVER_REPORT", ReportIssue, FATAL),
    x(88, "ROBUST_CHANNEL_NVDEC3_ERROR", RestartApp, NONFATAL),
    x(89, "ROBUST_CHANNEL_NVDEC4_ERROR", RestartApp, NONFATAL),
    x(90, "LTC_ERROR", ReportIssue, FATAL),
    x(91, "RESERVED_XID", ReportIssue, FATAL),
    x(92, "EXCESSIVE_SBE_INTERRUPTS", Ignore, NONFATAL),
    x(93, "INFOROM_ERASE_LIMIT_EXCEEDED", Ignore, NONFATAL),
    x(94, "ROBUST_CHANNEL_CONTAINED_ERROR", RestartApp, NONFATAL),
    x(95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", ResetGpu, FATAL),
    x(96, "ROBUST_CHANNEL_NVDEC5_ERROR", RestartApp, NONFATAL),
    x(97, "ROBUST_CHANNEL_NVDEC6_ERROR", RestartApp, NONFATAL),
    x(98, "ROBUST_CHANNEL_NVDEC7_ERROR", RestartApp, NONFATAL),
    x(99, "ROBUST_CHANNEL_NVJPG1_ERROR", RestartApp, NONFATAL),
    x(100, "ROBUST_CHANNEL_NVJPG2_ERROR", RestartApp, NONFATAL),
    x(101, "ROBUST_CHANNEL_NVJPG3_ERROR", RestartApp, NONFATAL),
    x(102, "ROBUST_CHANNEL_NVJPG4_ERROR", RestartApp, NONFATAL),
    x(103, "ROBUST_CHANNEL_NVJPG5_ERROR", RestartApp, NONFATAL),
    x(104, "ROBUST_CHANNEL_NVJPG6_ERROR", RestartApp, NONFATAL),
    x(105, "ROBUST_CHANNEL_NVJPG7_ERROR", RestartApp, NONFATAL),
    x(106, "SMBPBI_TEST_MESSAGE", Ignore, NONFATAL),
    x(107, "SMBPBI_TEST_MESSAGE_SILENT", Ignore, NONFATAL),
    x(108, "DESTINATION_FLA_TRANSLATION_ERROR", ReportIssue, FATAL),
    x(109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", ResetGpu, FATAL),
    x(110, "SEC_FAULT_ERROR", ResetGpu, FATAL),
    x(111, "BUNDLE_ERROR_EVENT", ReportIssue, FATAL),
    x(112, "DISP_SUPERVISOR_ERROR", ReportIssue, FATAL),
    x(113, "DP_LT_FAILURE", ReportIssue, FATAL),
    x(114, "HEAD_RG_UNDERFLOW", ReportIssue, FATAL),
    x(115, "CORE_CHANNEL_REGS", ReportIssue, FATAL),
    x(116, "WINDOW_CHANNEL_REGS", ReportIssue, FATAL),
    x(117, "CURSOR_CHANNEL_REGS", ReportIssue, FATAL),
    x(118, "HEAD_REGS", ReportIssue, FATAL),
    x(119, "GSP_RPC_TIMEOUT", ResetGpu, FATAL),
    x(120, "GSP_ERROR", ResetGpu, FATAL),
    x(121, "C2C_ERROR", Ignore, NONFATAL),
    x(122, "SPI_PMU_RPC_READ_FAIL", ReportIssue, FATAL),
    x(123, "SPI_PMU_RPC_WRITE_FAIL", ReportIssue, FATAL),
    x(124, "SPI_PMU_RPC_ERASE_FAIL", ReportIssue, FATAL),
    x(125, "INFOROM_FS_ERROR", ReportIssue, FATAL),
    x(126, "ROBUST_CHANNEL_CE10_ERROR", RestartApp, NONFATAL),
    x(127, "ROBUST_CHANNEL_CE11_ERROR", RestartApp, NONFATAL),
    x(128, "ROBUST_CHANNEL_CE12_ERROR", RestartApp, NONFATAL),
    x(129, "ROBUST_CHANNEL_CE13_ERROR", RestartApp, NONFATAL),
    x(130, "ROBUST_CHANNEL_CE14_ERROR", RestartApp, NONFATAL),
    x(131, "ROBUST_CHANNEL_CE15_ERROR", RestartApp, NONFATAL),
    x(132, "ROBUST_CHANNEL_CE16_ERROR", RestartApp, NONFATAL),
    x(133, "ROBUST_CHANNEL_CE17_ERROR", RestartApp, NONFATAL),
    x(134, "ROBUST_CHANNEL_CE18_ERROR", RestartApp, NONFATAL),
    x(135, "ROBUST_CHANNEL_CE19_ERROR", RestartApp, NONFATAL),
    x(136, "ALI_TRAINING_FAIL", ResetGpu, FATAL),
    x(137, "NVLINK_FLA_PRIV_ERR", Ignore, NONFATAL),
    x(138, "ROBUST_CHANNEL_DLA_ERROR", ReportIssue, FATAL),
    x(139, "ROBUST_CHANNEL_OFA1_ERROR", RestartApp, NONFATAL),
    x(140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", ResetGpu, FATAL),
    x(141, "ROBUST_CHANNEL_FAST_PATH_ERROR", Ignore, NONFATAL),
    x(142, "ROBUST_CHANNEL_NVENC3_ERROR", ReportIssue, FATAL),
    x(143, "GPU_INIT_ERROR", ResetGpu, FATAL),
    x(144, "NVLINK_SAW_ERROR", WorkflowNvlink5, FATAL),
    x(145, "NVLINK_RLW_ERROR", WorkflowNvlink5, FATAL),
    x(146, "NVLINK_TLW_ERROR", WorkflowNvlink5, FATAL),
    x(147, "NVLINK_TREX_ERROR", WorkflowNvlink5, FATAL),
    x(148, "NVLINK_NVLPW_CTRL_ERROR", WorkflowNvlink5, FATAL),
    x(149, "NVLINK_NETIR_ERROR", WorkflowNvlink5, FATAL),
    x(150, "NVLINK_MSE_ERROR", WorkflowNvlink5, FATAL),
    x(151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", RestartVm, FATAL),
    x(152, "ROBUST_CHANNEL_DLA_SMMU_ERROR", Ignore, NONFATAL),
    x(153, "ROBUST_CHANNEL_DLA_TIMEOUT", Ignore, NONFATAL),
    x(
        154,
        "GPU_RECOVERY_ACTION_CHANGED",
        FollowLinkedXid,
        NONFATAL,
    ),
    x(155, "NVLINK_SW_DEFINED_ERROR", ResetGpu, FATAL),
    x(156, "RESOURCE_RETIREMENT_EVENT", ResetGpu, FATAL),
    x(157, "RESOURCE_RETIREMENT_FAILURE", Ignore, NONFATAL),
    x(158, "GPU_FATAL_TIMEOUT", ResetGpu, FATAL),
    x(159, "ROBUST_CHANNEL_CHI_NON_DATA_ERROR", CheckUvm, NONFATAL),
    x(160, "CHANNEL_RETIREMENT_EVENT", RestartBm, FATAL),
    x(161, "CHANNEL_RETIREMENT_FAILURE", Ignore, NONFATAL),
    x(162, "(unnamed)", ResetGpu, FATAL),
];

/// Open XID events one GPU can hold (see the module docs for overflow).
pub const MAX_OPEN: usize = 16;
/// Bursts one GPU remembers for the 24 h repeat rule.
pub const MAX_BURSTS: usize = 32;

/// Tunables of [`XidDetector`]. Defaults are documented in `docs/HEALTH.md`.
#[derive(Debug, Clone, PartialEq)]
pub struct XidConfig {
    /// An XID event clears this long after the XID's last occurrence, ms.
    /// Default 3 600 000 (1 h; our choice, see the module docs).
    pub clear_after_ms: i64,
    /// Occurrences of one XID closer than this are one burst, ms. Default
    /// 180 000 (3 min: NVIDIA Fleet Intelligence, NVSentinel burst window).
    pub burst_gap_ms: i64,
    /// Window of the repeat rules, ms. Default 86 400 000 (24 h, NVSentinel).
    pub repeat_window_ms: i64,
    /// Bursts of a non-fatal XID within the window that escalate it to
    /// Critical, drain and report. Default 2 (NVSentinel, XID 31 rule).
    pub escalate_after_bursts: u32,
    /// Bursts of a fatal XID within the window that harden its action to
    /// drain and report. Default 5 (NVSentinel fatal-repeat rule).
    pub drain_after_bursts: u32,
}

impl Default for XidConfig {
    fn default() -> Self {
        XidConfig {
            clear_after_ms: 3_600_000,
            burst_gap_ms: 180_000,
            repeat_window_ms: 86_400_000,
            escalate_after_bursts: 2,
            drain_after_bursts: 5,
        }
    }
}

impl XidConfig {
    /// Checks every value.
    ///
    /// # Errors
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, reason| Err(ConfigError { field, reason });
        if self.clear_after_ms <= 0 {
            return err("xid.clear_after_ms", "must be > 0");
        }
        if self.burst_gap_ms < 0 {
            return err("xid.burst_gap_ms", "must be >= 0");
        }
        if self.repeat_window_ms <= self.burst_gap_ms {
            return err("xid.repeat_window_ms", "must be > burst_gap_ms");
        }
        if self.escalate_after_bursts < 2 {
            return err(
                "xid.escalate_after_bursts",
                "must be >= 2 (1 is the first burst)",
            );
        }
        if self.drain_after_bursts < 2 {
            return err(
                "xid.drain_after_bursts",
                "must be >= 2 (1 is the first burst)",
            );
        }
        Ok(())
    }
}

/// One open XID event.
#[derive(Debug, Clone, Copy)]
struct OpenXid {
    xid: u32,
    severity: Severity,
    action: Action,
    last_ts_ms: i64,
}

/// A run of occurrences of one XID with gaps below `burst_gap_ms`.
#[derive(Debug, Clone, Copy)]
struct Burst {
    xid: u32,
    last_ts_ms: i64,
}

/// Detects XID events for one GPU (see the module docs for the rules).
#[derive(Debug, Clone)]
pub struct XidDetector {
    config: XidConfig,
    clock: PollClock,
    /// Last gauge value seen (`None` before the first).
    last_value: Option<u32>,
    open: [Option<OpenXid>; MAX_OPEN],
    bursts: [Option<Burst>; MAX_BURSTS],
}

impl XidDetector {
    /// A detector that has seen no poll. `config` should be validated.
    pub fn new(config: XidConfig) -> Self {
        debug_assert!(config.validate().is_ok(), "{config:?}");
        XidDetector {
            config,
            clock: PollClock::default(),
            last_value: None,
            open: [None; MAX_OPEN],
            bursts: [None; MAX_BURSTS],
        }
    }

    /// Records an occurrence of `xid` at `ts` and returns how many bursts of
    /// it fall in the repeat window, this one included.
    fn record_burst(&mut self, xid: u32, ts: i64) -> u32 {
        let latest = self
            .bursts
            .iter_mut()
            .flatten()
            .filter(|b| b.xid == xid)
            .max_by_key(|b| b.last_ts_ms);
        match latest {
            Some(b) if ts - b.last_ts_ms < self.config.burst_gap_ms => b.last_ts_ms = ts,
            _ => {
                // Free slot, else forget the oldest burst.
                let slot = match self.bursts.iter().position(Option::is_none) {
                    Some(i) => i,
                    None => (0..MAX_BURSTS)
                        .min_by_key(|&i| self.bursts[i].map_or(i64::MIN, |b| b.last_ts_ms))
                        .expect("BUG: MAX_BURSTS > 0"),
                };
                self.bursts[slot] = Some(Burst {
                    xid,
                    last_ts_ms: ts,
                });
            }
        }
        let window = self.config.repeat_window_ms;
        self.bursts
            .iter()
            .flatten()
            .filter(|b| b.xid == xid && ts - b.last_ts_ms < window)
            .count() as u32
    }

    fn occurrence(&mut self, xid: u32, prev: Option<u32>, ts: i64, out: &mut Vec<Transition>) {
        let Some((base_severity, base_action)) = classify(xid) else {
            return;
        };
        let bursts = self.record_burst(xid, ts);
        let (severity, action) = match base_severity {
            Severity::Critical if bursts >= self.config.drain_after_bursts => {
                (Severity::Critical, Action::DrainAndReport)
            }
            Severity::Critical => (base_severity, base_action),
            _ if bursts >= self.config.escalate_after_bursts => {
                (Severity::Critical, Action::DrainAndReport)
            }
            _ => (base_severity, base_action),
        };
        let window_ms = self.config.repeat_window_ms;
        if let Some(open) = self.open.iter_mut().flatten().find(|o| o.xid == xid) {
            open.last_ts_ms = ts;
            let harder = (severity, action == Action::DrainAndReport)
                > (open.severity, open.action == Action::DrainAndReport);
            if harder {
                open.severity = severity;
                open.action = action;
                out.push(Transition::Escalated(Escalation {
                    key: EventKey::xid(xid),
                    severity,
                    ts_ms: ts,
                    action: action.as_str(),
                    evidence: evidence(xid, prev, bursts, window_ms),
                }));
            }
            return;
        }
        let slot = match self.open.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                // Full: clear the event quiet the longest to make room.
                let i = (0..MAX_OPEN)
                    .min_by_key(|&i| self.open[i].map_or(i64::MIN, |o| o.last_ts_ms))
                    .expect("BUG: MAX_OPEN > 0");
                let evicted = self.open[i].take().expect("BUG: all slots are full");
                out.push(Transition::Cleared(Clearing {
                    key: EventKey::xid(evicted.xid),
                    cleared_ts_ms: ts,
                    evidence: format!(
                        "evicted: {MAX_OPEN} XID events open, XID {} quiet the longest",
                        evicted.xid
                    ),
                }));
                i
            }
        };
        self.open[slot] = Some(OpenXid {
            xid,
            severity,
            action,
            last_ts_ms: ts,
        });
        out.push(Transition::Opened(Finding {
            kind: Kind::Xid,
            severity,
            xid: Some(xid),
            onset_ts_ms: ts,
            detected_ts_ms: ts,
            action: action.as_str(),
            evidence: evidence(xid, prev, bursts, window_ms),
        }));
    }
}

/// Evidence text of an occurrence: the catalog row, the gauge change and the
/// burst count.
fn evidence(xid: u32, prev: Option<u32>, bursts: u32, window_ms: i64) -> String {
    let mut s = format!("XID {xid}");
    match lookup(xid) {
        Some(e) => {
            let fatal = if e.fatal { "FATAL" } else { "NONFATAL" };
            let _ = write!(s, " {} (catalog {}, {fatal})", e.name, e.bucket.as_str());
        }
        None => s.push_str(" (not in the catalog)"),
    }
    match prev {
        None => s.push_str("; first gauge value seen"),
        Some(p) => {
            let _ = write!(s, "; gauge {p} -> {xid}");
        }
    }
    if bursts > 1 {
        let _ = write!(
            s,
            "; burst {bursts} of XID {xid} within {}",
            fmt_duration(window_ms)
        );
    }
    s
}

/// The XID number a gauge value denotes: a non-negative integer that fits
/// `u32`. Anything else is treated as a missing reading.
fn xid_value(v: f64) -> Option<u32> {
    (v >= 0.0 && v.fract() == 0.0 && v <= f64::from(u32::MAX)).then_some(v as u32)
}

impl Detector for XidDetector {
    fn kinds(&self) -> &'static [Kind] {
        &[Kind::Xid]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        let ts = poll.ts_ms;
        if !self.clock.accept(ts) {
            return;
        }
        if let Some(value) = poll.get(Field::XidErrors).and_then(xid_value) {
            let prev = self.last_value.replace(value);
            if value != 0 && prev != Some(value) {
                self.occurrence(value, prev, ts, out);
            }
        }
        let quiet = self.config.clear_after_ms;
        for slot in &mut self.open {
            if let Some(o) = *slot
                && ts - o.last_ts_ms >= quiet
            {
                *slot = None;
                out.push(Transition::Cleared(Clearing {
                    key: EventKey::xid(o.xid),
                    cleared_ts_ms: ts,
                    evidence: format!(
                        "no new XID {} for {} (last at {} ms)",
                        o.xid,
                        fmt_duration(ts - o.last_ts_ms),
                        o.last_ts_ms
                    ),
                }));
            }
        }
    }
}

#[cfg(test)]
mod tests;
