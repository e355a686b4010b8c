//! gpulse fleet health: streaming, per-GPU fault detectors.
//!
//! Where it sits: the [`engine::Engine`] keeps one [`GpuHealth`] per GPU,
//! keyed by [`GpuId`], assembles each GPU's polls from the samples `serve`
//! stores (`src/health.rs` in the binary) and feeds them in timestamp order.
//! Each detector turns the polls into [`Transition`]s: an event opens, gets
//! worse, or clears; the engine keeps the book of events, and [`log`] keeps
//! them on disk. The crate opens no sockets and knows no other gpulse crate:
//! it is the rule book, not the plumbing.
//!
//! Per-GPU detectors: [`Kind::Xid`] ([`xid`]), [`Kind::Ecc`] and
//! [`Kind::RowRemap`] ([`ecc`]), [`Kind::ThermalThrottle`] and
//! [`Kind::PowerThrottle`] ([`throttle`]), [`Kind::Zombie`] ([`zombie`]).
//! Kinds that compare GPUs, evaluated by [`engine::Engine::tick`]:
//! [`Kind::TelemetryGap`] (all GPUs of a host), [`Kind::Straggler`] and
//! [`Kind::ClockDegraded`] (busy peers of a host, [`peers`]), [`Kind::Drift`]
//! (the fleet's inventory, [`drift`]); and [`Kind::Anomaly`] ([`anomaly`]),
//! a per-GPU model of temperature for the load. Every rule, threshold and
//! source is written down in `docs/HEALTH.md`.
//!
//! Guarantees:
//! - Bounded state: no detector grows with the length of the stream; all of a
//!   GPU's detectors together fit in [`STATE_BUDGET_BYTES`] (tested).
//! - Per GPU and kind (and XID number, for XIDs) at most one event is open; a
//!   [`Transition::Escalated`] or [`Transition::Cleared`] always refers to an
//!   open event, and escalation only ever raises the severity or hardens the
//!   action.
//! - Time is the poll's `ts_ms` (sample time), never the wall clock, so replays
//!   and simulations give the same events as live data.

pub mod anomaly;
mod counter;
pub mod drift;
pub mod ecc;
pub mod engine;
pub mod log;
pub mod peers;
pub mod throttle;
mod window;
pub mod xid;
pub mod zombie;

#[cfg(test)]
mod real_data;
#[cfg(test)]
mod tests;

use std::fmt;

pub use anomaly::{AnomalyConfig, AnomalyDetector};
pub use drift::{DriftConfig, Inventory};
pub use ecc::{EccDetector, RowRemapConfig, RowRemapDetector};
pub use peers::PeerConfig;
pub use throttle::{ThrottleConfig, ThrottleDetector};
pub use xid::{XidConfig, XidDetector};
pub use zombie::{ZombieConfig, ZombieDetector};

/// How much state all detectors of one GPU may hold together, heap included.
pub const STATE_BUDGET_BYTES: usize = 4096;

/// How urgent an event is. Ordered: `Info < Warning < Critical`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Severity {
    /// Worth recording; nobody needs to act.
    Info,
    /// Degraded or job-level: act during working hours.
    Warning,
    /// The GPU (or its job) is broken or about to be: act now.
    Critical,
}

impl Severity {
    /// The fixed lowercase name used in APIs and output.
    pub const fn as_str(self) -> &'static str {
        match self {
            Severity::Info => "info",
            Severity::Warning => "warning",
            Severity::Critical => "critical",
        }
    }

    /// The severity [`Severity::as_str`] names.
    pub fn from_name(name: &str) -> Option<Severity> {
        [Severity::Info, Severity::Warning, Severity::Critical]
            .into_iter()
            .find(|s| s.as_str() == name)
    }
}

impl fmt::Display for Severity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Every detector kind of the health engine. The names from [`Kind::as_str`]
/// are a public contract (alerts, UI, benchmark tables), so the enum lists the
/// kinds still to be built too; see the crate docs for which exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// An XID error reported by the driver.
    Xid,
    /// ECC errors and page retirement (pre-Ampere memory repair).
    Ecc,
    /// HBM row remapping (Ampere and newer memory repair).
    RowRemap,
    /// Clocks cut for temperature.
    ThermalThrottle,
    /// Clocks cut by hardware power protection (not the normal SW power cap).
    PowerThrottle,
    /// Clocks below peers without a throttle reason.
    ClockDegraded,
    /// One GPU slowing a synchronous job.
    Straggler,
    /// Reports healthy but does no work.
    Zombie,
    /// Polls stopped arriving.
    TelemetryGap,
    /// Driver / VBIOS / firmware differs from the fleet.
    Drift,
    /// Unsupervised outlier.
    Anomaly,
}

impl Kind {
    /// All kinds, in declaration order.
    pub const ALL: [Kind; 11] = [
        Kind::Xid,
        Kind::Ecc,
        Kind::RowRemap,
        Kind::ThermalThrottle,
        Kind::PowerThrottle,
        Kind::ClockDegraded,
        Kind::Straggler,
        Kind::Zombie,
        Kind::TelemetryGap,
        Kind::Drift,
        Kind::Anomaly,
    ];

    /// The fixed snake_case name (a public contract: do not rename).
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::Xid => "xid",
            Kind::Ecc => "ecc",
            Kind::RowRemap => "row_remap",
            Kind::ThermalThrottle => "thermal_throttle",
            Kind::PowerThrottle => "power_throttle",
            Kind::ClockDegraded => "clock_degraded",
            Kind::Straggler => "straggler",
            Kind::Zombie => "zombie",
            Kind::TelemetryGap => "telemetry_gap",
            Kind::Drift => "drift",
            Kind::Anomaly => "anomaly",
        }
    }

    /// The kind named `name` (exact, as written by [`Kind::as_str`]).
    pub fn from_name(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.as_str() == name)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which GPU a stream of polls belongs to. The UUID identifies it; the rest
/// places it (host → GPU index, and where known rack, row and cluster) so
/// events can be rolled up physically.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuId {
    /// NVML UUID, e.g. `GPU-5b4c...`.
    pub uuid: String,
    /// Host name of the node.
    pub host: String,
    /// GPU index within the host (NVML index, dcgm-exporter's `gpu` label).
    pub gpu: u32,
    /// Rack, where the inventory knows it.
    pub rack: Option<String>,
    /// Row of racks, where known.
    pub row: Option<String>,
    /// Cluster, where known.
    pub cluster: Option<String>,
}

impl GpuId {
    /// A GPU with no physical placement beyond its host.
    pub fn new(uuid: impl Into<String>, host: impl Into<String>, gpu: u32) -> Self {
        GpuId {
            uuid: uuid.into(),
            host: host.into(),
            gpu,
            rack: None,
            row: None,
            cluster: None,
        }
    }
}

/// The dcgm-exporter fields the detectors read (release <= 4.8.x names, as
/// the agent emits them: `agent/src/catalog.rs`; units in
/// `shared/spec/gpu-domain.md` §2). A [`Poll`] holds one value per field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Field {
    /// Value of the last XID error (a last-value gauge, 0 = none yet).
    XidErrors,
    /// Volatile single-bit ECC errors since driver load (counter).
    EccSbeVolTotal,
    /// Volatile double-bit ECC errors since driver load (counter).
    EccDbeVolTotal,
    /// Pages retired for single-bit errors (counter, persistent).
    RetiredSbe,
    /// Pages retired for double-bit errors (counter, persistent).
    RetiredDbe,
    /// Pages pending retirement (count; retirement happens at the next reset).
    RetiredPending,
    /// Row remap pending, applied at the next GPU reset (0/1).
    RowRemapPending,
    /// Row remapping failed (0/1; XID 64).
    RowRemapFailure,
    /// Rows remapped for correctable errors (counter, persistent).
    CorrectableRemappedRows,
    /// Rows remapped for uncorrectable errors (counter, persistent).
    UncorrectableRemappedRows,
    /// Clock-event (throttle) reason bitmask, DCGM field 112.
    ClockThrottleReasons,
    /// Time clocks were held down by the SW power cap, ns (counter).
    PowerViolation,
    /// Time clocks were held down for temperature, ns (counter).
    ThermalViolation,
    /// Time in SW power capping, ns (counter; the same NVML field as
    /// `PowerViolation`).
    ClocksEventSwPowerCapNs,
    /// Time in SW thermal slowdown, ns (counter).
    ClocksEventSwThermSlowdownNs,
    /// Time in HW thermal slowdown, ns (counter).
    ClocksEventHwThermSlowdownNs,
    /// Time in HW power-brake slowdown, ns (counter).
    ClocksEventHwPowerBrakeSlowdownNs,
    /// GPU temperature, °C (evidence, and a frozen reading for `zombie`).
    GpuTemp,
    /// SM clock, MHz (evidence, and a frozen reading for `zombie`).
    SmClock,
    /// Power draw, W (evidence, and a frozen reading for `zombie`).
    PowerUsage,
    /// Energy consumed since the driver loaded, mJ (counter; resets on driver
    /// reload). A powered GPU always consumes energy, so it must advance.
    TotalEnergyConsumption,
    /// Share of time one or more kernels was executing, % (0-100).
    GpuUtil,
    /// Share of cycles an SM had at least one warp resident, averaged over
    /// all SMs, ratio 0-1 (profiling; Hopper+ via GPM, or DCGM's DCP module).
    ProfSmActive,
    /// Share of time the graphics / compute engine was active, ratio 0-1
    /// (profiling; in dcgm-exporter's default set).
    ProfGrEngineActive,
}

impl Field {
    /// Number of fields; the size of a [`Poll`]'s value array.
    pub const COUNT: usize = 24;

    /// All fields, in declaration order (`Field::ALL[f as usize] == f`).
    pub const ALL: [Field; Field::COUNT] = [
        Field::XidErrors,
        Field::EccSbeVolTotal,
        Field::EccDbeVolTotal,
        Field::RetiredSbe,
        Field::RetiredDbe,
        Field::RetiredPending,
        Field::RowRemapPending,
        Field::RowRemapFailure,
        Field::CorrectableRemappedRows,
        Field::UncorrectableRemappedRows,
        Field::ClockThrottleReasons,
        Field::PowerViolation,
        Field::ThermalViolation,
        Field::ClocksEventSwPowerCapNs,
        Field::ClocksEventSwThermSlowdownNs,
        Field::ClocksEventHwThermSlowdownNs,
        Field::ClocksEventHwPowerBrakeSlowdownNs,
        Field::GpuTemp,
        Field::SmClock,
        Field::PowerUsage,
        Field::TotalEnergyConsumption,
        Field::GpuUtil,
        Field::ProfSmActive,
        Field::ProfGrEngineActive,
    ];

    /// The dcgm-exporter metric name.
    pub const fn name(self) -> &'static str {
        match self {
            Field::XidErrors => "DCGM_FI_DEV_XID_ERRORS",
            Field::EccSbeVolTotal => "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
            Field::EccDbeVolTotal => "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
            Field::RetiredSbe => "DCGM_FI_DEV_RETIRED_SBE",
            Field::RetiredDbe => "DCGM_FI_DEV_RETIRED_DBE",
            Field::RetiredPending => "DCGM_FI_DEV_RETIRED_PENDING",
            Field::RowRemapPending => "DCGM_FI_DEV_ROW_REMAP_PENDING",
            Field::RowRemapFailure => "DCGM_FI_DEV_ROW_REMAP_FAILURE",
            Field::CorrectableRemappedRows => "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
            Field::UncorrectableRemappedRows => "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
            Field::ClockThrottleReasons => "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
            Field::PowerViolation => "DCGM_FI_DEV_POWER_VIOLATION",
            Field::ThermalViolation => "DCGM_FI_DEV_THERMAL_VIOLATION",
            Field::ClocksEventSwPowerCapNs => "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP_NS",
            Field::ClocksEventSwThermSlowdownNs => {
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_SW_THERM_SLOWDOWN_NS"
            }
            Field::ClocksEventHwThermSlowdownNs => {
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_THERM_SLOWDOWN_NS"
            }
            Field::ClocksEventHwPowerBrakeSlowdownNs => {
                "DCGM_FI_DEV_CLOCKS_EVENT_REASON_HW_POWER_BRAKE_SLOWDOWN_NS"
            }
            Field::GpuTemp => "DCGM_FI_DEV_GPU_TEMP",
            Field::SmClock => "DCGM_FI_DEV_SM_CLOCK",
            Field::PowerUsage => "DCGM_FI_DEV_POWER_USAGE",
            Field::TotalEnergyConsumption => "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
            Field::GpuUtil => "DCGM_FI_DEV_GPU_UTIL",
            Field::ProfSmActive => "DCGM_FI_PROF_SM_ACTIVE",
            Field::ProfGrEngineActive => "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        }
    }

    /// The field a dcgm-exporter metric name denotes, if a detector reads it.
    /// Also accepts `DCGM_FI_DEV_CLOCKS_EVENT_REASONS`, the newer name of
    /// DCGM field 112 (spec §5.3).
    pub fn from_name(name: &str) -> Option<Field> {
        if name == "DCGM_FI_DEV_CLOCKS_EVENT_REASONS" {
            return Some(Field::ClockThrottleReasons);
        }
        Field::ALL.into_iter().find(|f| f.name() == name)
    }
}

// `Poll::present` has one bit per field.
const _: () = assert!(Field::COUNT <= u32::BITS as usize);

/// One GPU's poll: the sample time and the value of each [`Field`] it carried.
///
/// Compact and allocation-free: a fixed array plus a presence bitmask. A field
/// the poll did not carry is `None`, never 0 (a missing ECC counter is not a
/// zero ECC counter). Non-finite values (NaN, ±inf) are stored as missing.
#[derive(Debug, Clone, PartialEq)]
pub struct Poll {
    /// Sample time, ms since the Unix epoch.
    pub ts_ms: i64,
    values: [f64; Field::COUNT],
    /// Bit `f as usize` set = `values[f]` is present.
    present: u32,
}

impl Poll {
    /// A poll at `ts_ms` carrying no fields yet.
    pub fn new(ts_ms: i64) -> Self {
        Poll {
            ts_ms,
            values: [0.0; Field::COUNT],
            present: 0,
        }
    }

    /// The value of `field`, or `None` if the poll did not carry it.
    pub fn get(&self, field: Field) -> Option<f64> {
        let i = field as usize;
        (self.present & (1 << i) != 0).then_some(self.values[i])
    }

    /// Sets `field` to `value`; a non-finite value makes the field missing.
    pub fn set(&mut self, field: Field, value: f64) {
        let i = field as usize;
        if value.is_finite() {
            self.values[i] = value;
            self.present |= 1 << i;
        } else {
            self.present &= !(1 << i);
        }
    }

    /// Builder form of [`Poll::set`].
    pub fn with(mut self, field: Field, value: f64) -> Self {
        self.set(field, value);
        self
    }

    /// Sets the field named `name` (a dcgm-exporter metric name); returns
    /// false, changing nothing, for names no detector reads.
    pub fn set_by_name(&mut self, name: &str, value: f64) -> bool {
        match Field::from_name(name) {
            Some(field) => {
                self.set(field, value);
                true
            }
            None => false,
        }
    }

    /// Marks `field` as missing.
    pub fn clear(&mut self, field: Field) {
        self.present &= !(1 << field as usize);
    }
}

/// Identifies an event within one GPU: its kind and, for XID events, the XID
/// number (each XID is its own event). Other kinds have one event at a time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventKey {
    /// The detector kind.
    pub kind: Kind,
    /// The XID number, for [`Kind::Xid`] events only.
    pub xid: Option<u32>,
}

impl EventKey {
    /// The key of a non-XID event.
    pub const fn of(kind: Kind) -> Self {
        EventKey { kind, xid: None }
    }

    /// The key of the event for XID `xid`.
    pub const fn xid(xid: u32) -> Self {
        EventKey {
            kind: Kind::Xid,
            xid: Some(xid),
        }
    }
}

/// A newly opened event.
#[derive(Debug, Clone, PartialEq)]
pub struct Finding {
    /// The detector kind.
    pub kind: Kind,
    /// Severity at opening.
    pub severity: Severity,
    /// The XID number, for XID events.
    pub xid: Option<u32>,
    /// When the evidence starts: the sample time of the first poll showing it.
    pub onset_ts_ms: i64,
    /// Sample time of the poll at which the rule fired (>= `onset_ts_ms`).
    pub detected_ts_ms: i64,
    /// What an operator should do.
    pub action: &'static str,
    /// The values that fired the rule, human readable.
    pub evidence: String,
}

impl Finding {
    /// The key later transitions of this event carry.
    pub fn key(&self) -> EventKey {
        EventKey {
            kind: self.kind,
            xid: self.xid,
        }
    }
}

/// An open event got worse: a higher severity, or (same severity) a harder
/// action such as "drain and report" after repeats.
#[derive(Debug, Clone, PartialEq)]
pub struct Escalation {
    /// The open event.
    pub key: EventKey,
    /// The new severity (>= the previous one).
    pub severity: Severity,
    /// Sample time of the poll that escalated it.
    pub ts_ms: i64,
    /// The new recommended action.
    pub action: &'static str,
    /// What made it worse, human readable.
    pub evidence: String,
}

/// An open event cleared.
#[derive(Debug, Clone, PartialEq)]
pub struct Clearing {
    /// The event that cleared.
    pub key: EventKey,
    /// Sample time of the poll at which the clearing rule held.
    pub cleared_ts_ms: i64,
    /// Why it cleared, human readable.
    pub evidence: String,
}

/// What a detector emits.
#[derive(Debug, Clone, PartialEq)]
pub enum Transition {
    /// An event opened.
    Opened(Finding),
    /// An open event got worse.
    Escalated(Escalation),
    /// An open event cleared.
    Cleared(Clearing),
}

impl Transition {
    /// The event this transition belongs to.
    pub fn key(&self) -> EventKey {
        match self {
            Transition::Opened(f) => f.key(),
            Transition::Escalated(e) => e.key,
            Transition::Cleared(c) => c.key,
        }
    }

    /// The sample time the transition happened at.
    pub fn ts_ms(&self) -> i64 {
        match self {
            Transition::Opened(f) => f.detected_ts_ms,
            Transition::Escalated(e) => e.ts_ms,
            Transition::Cleared(c) => c.cleared_ts_ms,
        }
    }
}

/// Per-GPU streaming state of one or more detector kinds.
///
/// Contract:
/// - `observe` is fed one GPU's polls in increasing `ts_ms`. A poll whose
///   `ts_ms` is not after the last one accepted is ignored entirely (no
///   transitions, no state change): the ingest path may deliver duplicates.
/// - It appends to `out` and never removes from it. It allocates only the
///   evidence strings of the transitions it emits.
/// - State is bounded: [`Detector::state_bytes`] does not grow with the
///   stream.
/// - A missing field is no evidence either way: it neither fires nor clears.
pub trait Detector: fmt::Debug + Send {
    /// The kinds this detector emits.
    fn kinds(&self) -> &'static [Kind];

    /// Feeds one poll; appends the transitions it causes to `out`.
    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>);

    /// Bytes of state this detector holds, heap included. The default is the
    /// inline size, right for detectors that own no heap memory (all of the
    /// current ones); one that does must add it.
    fn state_bytes(&self) -> usize {
        std::mem::size_of_val(self)
    }
}

/// A configuration value out of range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The field, as `struct.field`.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid health config {}: {}", self.field, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// Tunables of all detectors. `Default` gives the documented values
/// (`docs/HEALTH.md`); thresholds taken from DCGM are constants, not knobs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HealthConfig {
    /// XID detector.
    pub xid: XidConfig,
    /// Row-remap detector.
    pub row_remap: RowRemapConfig,
    /// Thermal / power throttle detector.
    pub throttle: ThrottleConfig,
    /// Zombie detector.
    pub zombie: ZombieConfig,
    /// Peer comparison: `straggler`, `clock_degraded`.
    pub peers: PeerConfig,
    /// Inventory comparison: `drift`.
    pub drift: DriftConfig,
    /// Temperature for the load: `anomaly`.
    pub anomaly: AnomalyConfig,
}

impl HealthConfig {
    /// Checks every value; call once at startup.
    ///
    /// # Errors
    /// The first field out of range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.xid.validate()?;
        self.row_remap.validate()?;
        self.throttle.validate()?;
        self.zombie.validate()?;
        self.peers.validate()?;
        self.drift.validate()?;
        self.anomaly.validate()
    }
}

/// All detectors of one GPU: what the engine keeps per [`GpuId`].
#[derive(Debug, Clone)]
pub struct GpuHealth {
    xid: XidDetector,
    ecc: EccDetector,
    row_remap: RowRemapDetector,
    throttle: ThrottleDetector,
    zombie: ZombieDetector,
    anomaly: AnomalyDetector,
}

impl GpuHealth {
    /// Fresh state for a GPU seen for the first time. `config` should have
    /// passed [`HealthConfig::validate`].
    pub fn new(config: &HealthConfig) -> Self {
        GpuHealth {
            xid: XidDetector::new(config.xid.clone()),
            ecc: EccDetector::new(),
            row_remap: RowRemapDetector::new(config.row_remap.clone()),
            throttle: ThrottleDetector::new(config.throttle.clone()),
            zombie: ZombieDetector::new(config.zombie.clone()),
            anomaly: AnomalyDetector::new(config.anomaly.clone()),
        }
    }

    /// Each detector with its state size, for the memory budget.
    pub fn detectors(&self) -> [&dyn Detector; 6] {
        [
            &self.xid,
            &self.ecc,
            &self.row_remap,
            &self.throttle,
            &self.zombie,
            &self.anomaly,
        ]
    }
}

impl Detector for GpuHealth {
    fn kinds(&self) -> &'static [Kind] {
        &[
            Kind::Xid,
            Kind::Ecc,
            Kind::RowRemap,
            Kind::ThermalThrottle,
            Kind::PowerThrottle,
            Kind::Zombie,
            Kind::Anomaly,
        ]
    }

    fn observe(&mut self, poll: &Poll, out: &mut Vec<Transition>) {
        self.xid.observe(poll, out);
        self.ecc.observe(poll, out);
        self.row_remap.observe(poll, out);
        self.throttle.observe(poll, out);
        self.zombie.observe(poll, out);
        self.anomaly.observe(poll, out);
    }

    fn state_bytes(&self) -> usize {
        self.detectors().iter().map(|d| d.state_bytes()).sum()
    }
}

/// Accepts polls in strictly increasing sample time (see [`Detector`]).
#[derive(Debug, Clone, Copy, Default)]
struct PollClock {
    last_ts_ms: Option<i64>,
}

impl PollClock {
    /// True (and remembers `ts_ms`) if the poll is newer than the last one.
    fn accept(&mut self, ts_ms: i64) -> bool {
        if self.last_ts_ms.is_some_and(|last| ts_ms <= last) {
            return false;
        }
        self.last_ts_ms = Some(ts_ms);
        true
    }
}

/// Formats a duration in ms as seconds, minutes or hours for evidence text.
fn fmt_duration(ms: i64) -> String {
    if ms >= 3_600_000 && ms % 60_000 == 0 {
        format!("{:.1} h", ms as f64 / 3_600_000.0)
    } else if ms >= 60_000 && ms % 1_000 == 0 {
        format!("{:.1} min", ms as f64 / 60_000.0)
    } else {
        format!("{:.1} s", ms as f64 / 1_000.0)
    }
}
