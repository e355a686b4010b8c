//! A simulated node (host) of H100 GPUs: deterministic from a seed, and
//! shaped like real DCGM telemetry (see `shared/data/real`: an 8x H100 node
//! training in lockstep, where the GPUs' power agrees within a few percent
//! and their activity ratios within one).
//!
//! **Jobs.** A node-level job stream (its own ChaCha8 stream from the seed,
//! independent of the GPUs' streams) draws job phases of
//! [`PHASE_SECONDS`] (30 s to 10 min) of simulated time, at least
//! `MAX_SKEW_TICKS + 1` ticks:
//! - [`NodePhase::Synchronous`] (70 %): one job over every GPU of the node.
//!   They share its target utilization ([`SYNC_UTIL_PCT`], 75-100 %), its
//!   memory footprint and its workload profile (power per unit of load, and
//!   how GR engine, SM, tensor and DRAM activity scale with it);
//! - [`NodePhase::Independent`] (15 %): each GPU its own work (e.g.
//!   inference), in plateaus of 30 s to 5 min drawn from its own stream:
//!   idle (30 %) or busy at 60-100 %, each with its own profile, and bursty:
//!   the load swings ±15 % from tick to tick ([`INDEPENDENT_JITTER`]);
//! - [`NodePhase::Idle`] (15 %): nothing runs, memory is released.
//!
//! Each GPU starts each phase (so ends the previous one) 0 to
//! [`MAX_SKEW_TICKS`] ticks after the node, drawn per GPU and boundary, so
//! job start and stop and idle <-> busy transitions are not quite
//! simultaneous.
//!
//! **Per GPU.** In a synchronous job, the job's target swings ±3 % from
//! tick to tick, the same for all its GPUs ([`SYNC_COMMON_JITTER`]); each
//! GPU's utilization is that ± 2 points of noise, rounded, and the load
//! behind its activity and power that ± 1 %. Each activity ratio adds noise
//! below 0.005. Power is `silicon × (70 W + 630 W × load ×
//! profile) ± 3 W`, at most 700 W, where `silicon` is a stable per-GPU
//! factor within ±2 % ([`SILICON_SPREAD`]). Temperature relaxes (20 s time
//! constant) toward `22.5 °C + cooling + 0.075 °C/W × power`, where
//! `cooling` is a stable per-GPU offset of 0-3 °C (its place in the
//! airflow), plus the node's ambient offset. The SM clock of a busy GPU is
//! the boost clock, 1980 MHz less 15 MHz per °C above 75 °C, at least
//! 1755 MHz ([`boost_clock_mhz`]), so peers at similar temperatures clock
//! alike; an idle GPU clocks at 345 MHz. Energy is a monotonic counter in
//! mJ (the integral of power); memory used steps with the phase; error
//! counters are mostly zero and grow rarely. Values carry NVML's precision:
//! integer percent, MHz and degrees, milliwatt power reported in W.
//!
//! **Ambient.** A node-level ambient offset (its own stream) warms every GPU
//! of the node together: warming episodes of [`AMBIENT_WARMING_C`] (+3 to
//! +6 °C) lasting 5-20 min, a raised-cosine up and back, about one an hour
//! (exponential gaps). A healthy GPU at 700 W, with the warmest cooling
//! offset and the largest ambient offset, stays at or below
//! [`HEALTHY_MAX_TEMP_C`] (84 °C), 3 °C below [`SLOWDOWN_TEMP_C`]: healthy
//! GPUs never set a thermal clock-event reason.
//!
//! Output depends only on the seed, the GPU index and the number of `sample`
//! calls, never on the wall clock, so a test can replay exactly what an agent
//! sent.
//!
//! Faults (thermal throttling at graded rates, graded stragglers, degraded
//! clocks, XID 79, XID 48, row-remap growth, frozen and hung zombies, driver
//! drift) are injected on a seeded or explicit schedule set by
//! [`FaultConfig`] (default: none), and every injected fault is recorded in a
//! [`GroundTruth`] log, with when the metrics show it; see [`fault`] for what
//! each one does. Faults change values, never the random draws of a GPU's
//! healthy stream nor of the node's streams, so a GPU with a fault stays
//! aligned with its fault-free twin.
//!
//! Cost: one ChaCha8 stream per GPU (plus two per node) and no allocation
//! per reading (`sample` reserves `out` once per call); a poll of 10,000
//! GPUs x 53 metrics takes about 1.5-3 ms healthy and 6 ms with the typical
//! fault mix on one core of a busy 2-core VM (`cargo bench -p agent --bench sim`).

pub mod fault;

use std::ops::{Range, RangeInclusive};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::catalog::Metric;
use crate::source::{GpuInfo, GpuSource, Reading, SourceError};

pub use fault::{
    FaultConfig, FaultEvent, FaultKind, GroundTruth, GroundTruthFormat, ScheduledFault,
    write_ground_truth,
};
use fault::{FaultState, Observed};

/// Framebuffer of an H100 80GB HBM3 as NVML reports it, MiB.
const FB_TOTAL_MIB: f64 = 81559.0;
const FB_RESERVED_MIB: f64 = 569.0;
/// Memory used with no job, MiB.
const IDLE_FB_MIB: f64 = 3.0;
const IDLE_POWER_W: f64 = 70.0;
/// Board power limit: no reading exceeds it.
const MAX_POWER_W: f64 = 700.0;
/// Power noise per reading, ± W.
const POWER_NOISE_W: f64 = 3.0;
/// A GPU's stable power factor ("silicon lottery") lies within 1 ± this.
pub const SILICON_SPREAD: f64 = 0.02;
/// Utilization noise per reading, ± percentage points.
const UTIL_NOISE_PCT: f64 = 2.0;
/// Relative noise of the load behind activity ratios and power, ±.
const LOAD_NOISE: f64 = 0.01;
/// Load swing shared by every GPU of a synchronous job, per tick, ± (the
/// job's own rhythm: its GPUs move together).
pub const SYNC_COMMON_JITTER: f64 = 0.03;
/// Load swing of a GPU's own (independent) work per tick, ± relative:
/// inference traffic is bursty, so unrelated GPUs never look like a job in step.
pub const INDEPENDENT_JITTER: f64 = 0.15;
/// Additive noise of an activity ratio, `0..this`.
const RATIO_NOISE: f64 = 0.005;

/// Temperature model: `TEMP_BASE_C + cooling + TEMP_C_PER_W × power`, with
/// `cooling` in `0..COOLING_SPREAD_C`, plus the ambient offset.
const TEMP_BASE_C: f64 = 22.5;
const TEMP_C_PER_W: f64 = 0.075;
const COOLING_SPREAD_C: f64 = 3.0;
/// Time constant of the temperature's lag behind power, s.
const TEMP_LAG_S: f64 = 20.0;

/// GPU temperature at and above which the simulated GPU slows down, °C: the
/// red threshold of NVIDIA's dcgm-exporter dashboard (spec §3.1). Real
/// thresholds are per SKU (NVML `TEMPERATURE_THRESHOLD_SLOWDOWN`). The
/// healthy model stays at or below [`HEALTHY_MAX_TEMP_C`], so only a thermal
/// fault reaches it.
pub const SLOWDOWN_TEMP_C: f64 = 87.0;
/// Warming of a node's ambient air during an episode, °C (drawn uniformly).
pub const AMBIENT_WARMING_C: RangeInclusive<f64> = 3.0..=6.0;
/// Length of a warming episode, s of simulated time (drawn uniformly).
const AMBIENT_EPISODE_S: Range<f64> = 300.0..1200.0;
/// Mean time between the end of one warming episode and the next, s.
const AMBIENT_MEAN_GAP_S: f64 = 3600.0;
/// Hottest a healthy GPU gets, °C: 700 W, the warmest cooling offset and
/// the largest ambient offset (84 °C, 3 °C below [`SLOWDOWN_TEMP_C`]).
pub const HEALTHY_MAX_TEMP_C: f64 =
    TEMP_BASE_C + COOLING_SPREAD_C + TEMP_C_PER_W * MAX_POWER_W + *AMBIENT_WARMING_C.end();

/// Boost SM clock of a busy GPU at or below [`BOOST_DROP_FROM_C`], MHz.
pub const BOOST_SM_CLOCK_MHZ: f64 = 1980.0;
/// Temperature above which the boost clock falls, °C.
pub const BOOST_DROP_FROM_C: f64 = 75.0;
/// Boost lost per °C above [`BOOST_DROP_FROM_C`], MHz (one clock step).
pub const BOOST_STEP_MHZ: f64 = 15.0;
/// Lowest boost clock of a healthy busy GPU, MHz.
pub const BOOST_FLOOR_MHZ: f64 = 1755.0;
/// SM clock of an idle GPU, MHz.
pub const IDLE_SM_CLOCK_MHZ: f64 = 345.0;
/// Most SM clock of a GPU in thermal slowdown, MHz: HW slowdown cuts the
/// clock at least in half (spec §5.3), 1980 -> 990.
pub const THROTTLED_SM_CLOCK_MHZ: f64 = 990.0;

/// Length of a node job phase, s of simulated time (drawn uniformly).
pub const PHASE_SECONDS: Range<f64> = 30.0..600.0;
/// Most ticks a GPU starts a node phase after the node does.
pub const MAX_SKEW_TICKS: u64 = 3;
/// Target utilization of a synchronous job, % (drawn uniformly per phase).
pub const SYNC_UTIL_PCT: Range<f64> = 75.0..100.0;
/// Probabilities of the node phase kinds: synchronous, independent (idle the rest).
const P_SYNCHRONOUS: f64 = 0.70;
const P_INDEPENDENT: f64 = 0.15;
/// A GPU's own plateaus in an independent phase: busy with this probability,
/// at this utilization, %, for this long, s.
const OWN_P_BUSY: f64 = 0.7;
const OWN_UTIL_PCT: Range<f64> = 60.0..100.0;
const OWN_PLATEAU_S: Range<f64> = 30.0..300.0;

/// Clock-event reason bits (`nvmlClocksEventReason*`, spec §5.3), as
/// [`SimulatedSource::clock_event_reasons`] reports them. The simulator
/// never sets `CLOCK_EVENT_SW_POWER_CAP`.
pub const CLOCK_EVENT_GPU_IDLE: u64 = 0x001;
pub const CLOCK_EVENT_SW_POWER_CAP: u64 = 0x004;
pub const CLOCK_EVENT_HW_SLOWDOWN: u64 = 0x008;
pub const CLOCK_EVENT_HW_THERMAL: u64 = 0x040;

/// The boost clock of a busy GPU at `temp_c` (an integer °C), MHz: 1980 less
/// 15 MHz per °C above 75 °C, at least 1755.
pub fn boost_clock_mhz(temp_c: f64) -> f64 {
    (BOOST_SM_CLOCK_MHZ - BOOST_STEP_MHZ * (temp_c - BOOST_DROP_FROM_C).max(0.0))
        .max(BOOST_FLOOR_MHZ)
}

/// Configuration of a [`SimulatedSource`].
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Seed; the same seed gives the same readings.
    pub seed: u64,
    /// Number of GPUs on the node.
    pub gpus: u32,
    /// Nominal time between samples, used to integrate energy and to turn
    /// phase lengths, fault rates and durations into ticks. Default 1 s.
    pub interval_ms: u64,
    /// Faults to inject. Default: none.
    pub faults: FaultConfig,
}

impl SimConfig {
    pub fn new(seed: u64, gpus: u32) -> Self {
        Self {
            seed,
            gpus,
            interval_ms: 1000,
            faults: FaultConfig::default(),
        }
    }
}

/// What the GPUs of a node are doing (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodePhase {
    /// One job over every GPU, in lockstep: peers do the same work.
    Synchronous,
    /// Each GPU its own work, in plateaus of its own.
    Independent,
    /// No job.
    Idle,
}

/// How activity and power scale with load in a workload.
#[derive(Debug, Clone, Copy)]
struct Profile {
    /// Dynamic power at full load, as a fraction of `MAX - IDLE`.
    power: f64,
    /// GR engine activity per unit of load.
    gr: f64,
    /// SM activity per unit of GR engine activity.
    sm: f64,
    /// Tensor pipe activity per unit of load.
    tensor: f64,
    /// DRAM activity per unit of load.
    dram: f64,
}

impl Profile {
    const IDLE: Profile = Profile {
        power: 0.0,
        gr: 0.0,
        sm: 0.0,
        tensor: 0.0,
        dram: 0.0,
    };

    fn draw(rng: &mut ChaCha8Rng) -> Self {
        Profile {
            power: rng.random_range(0.55..1.0),
            gr: rng.random_range(0.85..0.98),
            sm: rng.random_range(0.50..0.97),
            tensor: rng.random_range(0.10..0.60),
            dram: rng.random_range(0.20..0.50),
        }
    }
}

/// Memory used by a job, MiB (in 512 MiB steps).
fn draw_job_fb(rng: &mut ChaCha8Rng) -> f64 {
    (rng.random_range(20_000..78_000) / 512 * 512) as f64
}

/// Simulated seconds as ticks of `interval_ms`, at least `min`.
fn ticks_of(secs: f64, interval_ms: u64, min: u64) -> u64 {
    ((secs * 1000.0 / interval_ms.max(1) as f64).round() as u64).max(min)
}

/// One node job phase.
#[derive(Debug, Clone, Copy)]
struct Phase {
    /// Count of phases drawn before it: tells a GPU it entered a new one.
    id: u64,
    kind: NodePhase,
    /// Target utilization of a synchronous job, %.
    util: f64,
    fb_mib: f64,
    profile: Profile,
}

/// The node's warming episodes.
#[derive(Debug)]
struct Ambient {
    rng: ChaCha8Rng,
    interval_ms: u64,
    /// The current or next episode: first tick, length in ticks, peak °C.
    start: u64,
    len: u64,
    peak_c: f64,
}

impl Ambient {
    fn new(seed: u64, interval_ms: u64) -> Self {
        let mut a = Self {
            rng: ChaCha8Rng::seed_from_u64(mix(seed ^ 0xa3b1_e270_0000_0001)),
            interval_ms,
            start: 0,
            len: 0,
            peak_c: 0.0,
        };
        a.draw_next(0);
        a
    }

    /// Draws the episode after a gap from `after`.
    fn draw_next(&mut self, after: u64) {
        let u = 1.0 - self.rng.random::<f64>(); // (0, 1]
        let gap = ticks_of(-u.ln() * AMBIENT_MEAN_GAP_S, self.interval_ms, 1);
        let secs = self.rng.random_range(AMBIENT_EPISODE_S);
        self.len = ticks_of(secs, self.interval_ms, 2);
        self.peak_c = self.rng.random_range(AMBIENT_WARMING_C);
        self.start = after.saturating_add(gap);
    }

    /// The offset at `tick`, °C; ticks come in increasing order.
    fn offset(&mut self, tick: u64) -> f64 {
        while tick >= self.start.saturating_add(self.len) {
            self.draw_next(self.start + self.len);
        }
        if tick < self.start {
            return 0.0;
        }
        let x = (tick - self.start) as f64 / self.len as f64;
        self.peak_c * 0.5 * (1.0 - (std::f64::consts::TAU * x).cos())
    }
}

/// The node: its job phases and its ambient air.
#[derive(Debug)]
struct Node {
    rng: ChaCha8Rng,
    interval_ms: u64,
    /// The phase before `cur`, which a GPU follows until its skew has passed.
    prev: Phase,
    cur: Phase,
    /// The tick the node entered `cur`.
    cur_start: u64,
    /// Ticks left in `cur`, this one included.
    left: u64,
    /// Per GPU, ticks after `cur_start` it enters `cur`.
    skew: Vec<u8>,
    ambient: Ambient,
    /// Ambient offset of the current tick, °C.
    ambient_c: f64,
    /// Load factor of the current tick shared by a synchronous job's GPUs.
    sync_swing: f64,
}

impl Node {
    fn new(seed: u64, gpus: u32, interval_ms: u64) -> Self {
        let mut node = Self {
            rng: ChaCha8Rng::seed_from_u64(mix(seed ^ 0x10b5_7a6e_0000_0001)),
            interval_ms,
            prev: Phase {
                id: 0,
                kind: NodePhase::Idle,
                util: 0.0,
                fb_mib: IDLE_FB_MIB,
                profile: Profile::IDLE,
            },
            cur_start: 0,
            left: 0,
            cur: Phase {
                id: 0,
                kind: NodePhase::Idle,
                util: 0.0,
                fb_mib: IDLE_FB_MIB,
                profile: Profile::IDLE,
            },
            skew: vec![0; gpus as usize],
            ambient: Ambient::new(seed, interval_ms),
            ambient_c: 0.0,
            sync_swing: 1.0,
        };
        node.cur = node.draw_phase(0);
        node.prev = node.cur;
        node
    }

    /// Draws phase `id` and sets `left` to its length. A fixed number of draws.
    fn draw_phase(&mut self, id: u64) -> Phase {
        let rng = &mut self.rng;
        let r: f64 = rng.random();
        let kind = if r < P_SYNCHRONOUS {
            NodePhase::Synchronous
        } else if r < P_SYNCHRONOUS + P_INDEPENDENT {
            NodePhase::Independent
        } else {
            NodePhase::Idle
        };
        let secs = rng.random_range(PHASE_SECONDS);
        self.left = ticks_of(secs, self.interval_ms, MAX_SKEW_TICKS + 1);
        let util = rng.random_range(SYNC_UTIL_PCT);
        let fb_mib = draw_job_fb(rng);
        let profile = Profile::draw(rng);
        Phase {
            id,
            kind,
            util,
            fb_mib,
            profile,
        }
    }

    /// Moves to the next phase when the current one is over; sets the ambient offset.
    fn begin_tick(&mut self, tick: u64) {
        if self.left == 0 {
            self.prev = self.cur;
            self.cur = self.draw_phase(self.prev.id + 1);
            self.cur_start = tick;
            for s in &mut self.skew {
                *s = self.rng.random_range(0..=MAX_SKEW_TICKS as u8);
            }
        }
        self.left -= 1;
        self.sync_swing = 1.0
            + self
                .rng
                .random_range(-SYNC_COMMON_JITTER..SYNC_COMMON_JITTER);
        self.ambient_c = self.ambient.offset(tick);
    }

    /// The phase GPU `gpu` follows at `tick`. A phase lasts longer than the
    /// largest skew, so a GPU is never more than one phase behind.
    fn phase_of(&self, gpu: usize, tick: u64) -> &Phase {
        if tick >= self.cur_start + self.skew[gpu] as u64 {
            &self.cur
        } else {
            &self.prev
        }
    }
}

#[derive(Debug)]
struct SimGpu {
    rng: ChaCha8Rng,
    /// Stable power factor, within 1 ± `SILICON_SPREAD`.
    silicon: f64,
    /// Stable temperature offset of its place in the airflow, °C.
    cooling_c: f64,
    /// The node phase it followed at the last sample.
    phase_id: u64,
    phase: NodePhase,
    /// In an independent phase: its own plateau's target utilization (%),
    /// profile, memory used, and samples left.
    util_target: f64,
    profile: Profile,
    fb_used_mib: f64,
    hold: u64,
    temp_c: f64,
    energy_mj: u64,
    pcie_replays: u64,
    nvlink_kib: u64,
    /// Clock-event reason bits of the last sample.
    clock_events: u64,
    /// Time spent clock-limited by temperature, ns.
    thermal_ns: u64,
    /// `None` for a GPU that can never have a fault (the common case).
    faults: Option<Box<FaultState>>,
}

/// The simulated source. See the module docs.
#[derive(Debug)]
pub struct SimulatedSource {
    config: SimConfig,
    inventory: Vec<GpuInfo>,
    gpus: Vec<SimGpu>,
    node: Node,
    /// Whether any GPU carries a fault state (then `sample` makes a second pass).
    any_faults: bool,
    /// `sample` calls so far: the tick of the next sample.
    tick: u64,
    truth: GroundTruth,
}

/// SplitMix64 finaliser: spreads seed and GPU index into independent streams.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl SimulatedSource {
    /// # Panics
    /// If a scheduled fault names a GPU the configuration does not have.
    pub fn new(config: SimConfig) -> Self {
        if let Some(f) = config
            .faults
            .scheduled
            .iter()
            .find(|f| f.gpu >= config.gpus)
        {
            panic!(
                "scheduled fault {f:?} is for GPU {}, but the simulator has {} GPUs",
                f.gpu, config.gpus
            );
        }
        let mut inventory = Vec::with_capacity(config.gpus as usize);
        let mut gpus = Vec::with_capacity(config.gpus as usize);
        for i in 0..config.gpus {
            let stream = mix(config.seed ^ mix(i as u64 + 1));
            let mut rng = ChaCha8Rng::seed_from_u64(stream);
            let u: u128 = rng.random();
            inventory.push(GpuInfo {
                index: i,
                uuid: format!(
                    "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                    (u >> 96) as u32,
                    (u >> 80) as u16,
                    (u >> 64) as u16,
                    (u >> 48) as u16,
                    u as u64 & 0xffff_ffff_ffff
                ),
                pci_bus_id: {
                    // Past bus 0xFF (load tests with thousands of GPUs) the
                    // count carries into the PCI domain instead of overflowing.
                    let bus =
                        [0x18u32, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb][i as usize % 8] + i / 8;
                    format!("{:08X}:{:02X}:00.0", bus >> 8, bus & 0xff)
                },
                model_name: "NVIDIA H100 80GB HBM3".into(),
                driver_version: "550.54.15".into(),
                serial: format!("{}", 1_650_923_000_000u64 + (stream % 1_000_000)),
                vbios_version: "96.00.89.00.01".into(),
                ..GpuInfo::default()
            });
            let energy_mj = rng.random_range(100_000_000_000u64..300_000_000_000);
            let silicon = 1.0 + rng.random_range(-SILICON_SPREAD..SILICON_SPREAD);
            let cooling_c = rng.random_range(0.0..COOLING_SPREAD_C);
            gpus.push(SimGpu {
                rng,
                silicon,
                cooling_c,
                phase_id: u64::MAX,
                phase: NodePhase::Idle,
                util_target: 0.0,
                profile: Profile::IDLE,
                fb_used_mib: IDLE_FB_MIB,
                hold: 0,
                // Where an idle GPU settles.
                temp_c: TEMP_BASE_C + cooling_c + TEMP_C_PER_W * IDLE_POWER_W * silicon,
                energy_mj,
                pcie_replays: 0,
                nvlink_kib: 0,
                clock_events: 0,
                thermal_ns: 0,
                faults: FaultState::new(&config.faults, i, stream, config.interval_ms),
            });
        }
        let truth = GroundTruth::default();
        fault::apply_drift(&config.faults, config.seed, &mut inventory, &truth);
        Self {
            node: Node::new(config.seed, config.gpus, config.interval_ms),
            any_faults: gpus.iter().any(|g| g.faults.is_some()),
            config,
            inventory,
            gpus,
            tick: 0,
            truth,
        }
    }

    /// A handle on the log of injected faults; it keeps filling as the
    /// source is sampled, also after the source is handed to an agent.
    pub fn ground_truth(&self) -> GroundTruth {
        self.truth.clone()
    }

    /// `sample` calls so far (the tick the next sample will have).
    pub fn tick(&self) -> u64 {
        self.tick
    }

    /// The clock-event (throttle) reason bits of `gpu` at the last sample
    /// (`CLOCK_EVENT_*`); `None` for an unknown GPU. The catalog has no
    /// metric for them yet; this is where one would read them.
    pub fn clock_event_reasons(&self, gpu: u32) -> Option<u64> {
        self.gpus.get(gpu as usize).map(|g| g.clock_events)
    }

    /// The node's job phase at the last sample (before the first: the
    /// first phase). A GPU may follow it a few ticks late: see [`Self::gpu_phase`].
    pub fn node_phase(&self) -> NodePhase {
        self.node.cur.kind
    }

    /// The node phase `gpu` followed at the last sample (its own start skew
    /// included); `None` for an unknown GPU or before the first sample.
    pub fn gpu_phase(&self, gpu: u32) -> Option<NodePhase> {
        self.gpus
            .get(gpu as usize)
            .filter(|g| g.phase_id != u64::MAX)
            .map(|g| g.phase)
    }

    /// The node's ambient temperature offset at the last sample, °C.
    pub fn ambient_offset_c(&self) -> f64 {
        self.node.ambient_c
    }
}

impl GpuSource for SimulatedSource {
    fn name(&self) -> &'static str {
        "simulated"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.inventory
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        let interval_ms = self.config.interval_ms;
        let dt_s = interval_ms as f64 / 1000.0;
        let tick = self.tick;
        self.tick += 1;
        self.node.begin_tick(tick);
        let node = &self.node;
        out.reserve(self.gpus.len() * Metric::ALL.len());
        let base = out.len();
        for (i, g) in self.gpus.iter_mut().enumerate() {
            let gpu = i as u32;
            let mut faults = g.faults.as_deref_mut();
            if let Some(f) = faults.as_deref_mut() {
                f.begin_tick(tick, gpu, &self.inventory[i].uuid, &self.truth);
            }
            let fx = faults.as_deref().map(|f| f.fx).unwrap_or_default();
            let was_throttled = faults.as_deref().is_some_and(|f| f.throttled);
            let phase = node.phase_of(i, tick);
            if g.phase_id != phase.id {
                g.phase_id = phase.id;
                g.phase = phase.kind;
                g.hold = 0;
            }
            let rng = &mut g.rng;
            let (target, fb_job, profile) = match phase.kind {
                NodePhase::Synchronous => (phase.util, phase.fb_mib, phase.profile),
                NodePhase::Idle => (0.0, IDLE_FB_MIB, Profile::IDLE),
                NodePhase::Independent => {
                    if g.hold == 0 {
                        // A new plateau of its own: idle or busy.
                        let busy = rng.random_bool(OWN_P_BUSY);
                        g.util_target = if busy {
                            rng.random_range(OWN_UTIL_PCT)
                        } else {
                            0.0
                        };
                        g.hold = ticks_of(rng.random_range(OWN_PLATEAU_S), interval_ms, 1);
                        g.fb_used_mib = if busy { draw_job_fb(rng) } else { IDLE_FB_MIB };
                        g.profile = Profile::draw(rng);
                    }
                    g.hold -= 1;
                    (g.util_target, g.fb_used_mib, g.profile)
                }
            };
            let busy = target > 0.0;
            // The healthy values.
            let (mut util, mut load) = if busy {
                let n = rng.random_range(-1.0..1.0);
                if phase.kind == NodePhase::Synchronous {
                    let target = (target * node.sync_swing).min(100.0);
                    (
                        (target + UTIL_NOISE_PCT * n).clamp(0.0, 100.0).round(),
                        (target / 100.0 * (1.0 + LOAD_NOISE * n)).min(1.0),
                    )
                } else {
                    let target = (target * (1.0 + INDEPENDENT_JITTER * n)).min(100.0);
                    (target.round(), target / 100.0)
                }
            } else {
                (0.0, 0.0)
            };
            let mut dynamic_w = (MAX_POWER_W - IDLE_POWER_W) * load * profile.power;
            let mut fb_used = fb_job;
            // Faults change values, never the random draws, so the GPU's
            // stream stays aligned with its fault-free twin.
            let mut activity = 1.0;
            let mut clock_cut = 0.0;
            if let Some((stuck_util, stuck_fb)) = fx.hung {
                util = stuck_util;
                fb_used = stuck_fb;
                load = 0.0;
                dynamic_w = 0.0;
            } else if busy {
                if fx.slowdown > 0.0 {
                    activity = 1.0 - fx.slowdown;
                    util = (util * activity).round();
                    dynamic_w *= activity;
                }
                if fx.clock_cut > 0.0 {
                    clock_cut = fx.clock_cut;
                    dynamic_w *= 1.0 - fx.clock_cut / 2.0;
                }
            }
            if was_throttled {
                dynamic_w *= 0.5;
            }
            let power_mw = ((g.silicon * (IDLE_POWER_W + dynamic_w)
                + rng.random_range(-POWER_NOISE_W..POWER_NOISE_W))
            .min(MAX_POWER_W)
                * 1000.0)
                .round();
            let power_w = power_mw / 1000.0;
            // Temperature relaxes toward a power-dependent target.
            let temp_target = TEMP_BASE_C + g.cooling_c + power_w * TEMP_C_PER_W;
            g.temp_c += (temp_target - g.temp_c) * (dt_s / TEMP_LAG_S).min(1.0);
            let mut temp = (g.temp_c + node.ambient_c).round();
            if let Some(f) = faults.as_deref_mut() {
                f.step_heat(dt_s);
                if f.excess_c > 0.0 {
                    // Hardware slowdown holds the temperature a little above the threshold.
                    temp = (g.temp_c + node.ambient_c + f.excess_c)
                        .round()
                        .min(SLOWDOWN_TEMP_C + 3.0);
                }
            }
            let throttled = temp >= SLOWDOWN_TEMP_C;
            g.energy_mj += (power_mw * dt_s) as u64;
            if rng.random_bool(0.0005) {
                g.pcie_replays += 1;
            }
            let runs = busy || fx.hung.is_some();
            g.nvlink_kib += (load * activity * rng.random_range(0.0..4.0e6) * dt_s) as u64;
            let mut sm_clock = if runs {
                boost_clock_mhz(temp)
            } else {
                IDLE_SM_CLOCK_MHZ
            };
            if clock_cut > 0.0 {
                sm_clock = (sm_clock * (1.0 - clock_cut) / BOOST_STEP_MHZ).round() * BOOST_STEP_MHZ;
            }
            let mut clock_events = 0;
            if !runs {
                clock_events |= CLOCK_EVENT_GPU_IDLE;
            }
            if throttled {
                sm_clock = f64::min(sm_clock, THROTTLED_SM_CLOCK_MHZ);
                clock_events |= CLOCK_EVENT_HW_SLOWDOWN | CLOCK_EVENT_HW_THERMAL;
            }
            g.clock_events = clock_events;
            let (xid, uncorrectable_rows, correctable_rows, remap_pending) = match faults {
                Some(f) => {
                    f.throttled = throttled;
                    f.observe(
                        tick,
                        util,
                        fb_used,
                        Observed {
                            temp_c: temp,
                            busy,
                            synchronous: phase.kind == NodePhase::Synchronous,
                        },
                        &self.truth,
                    );
                    (
                        f.xid as f64,
                        f.uncorrectable_rows as f64,
                        f.correctable_rows as f64,
                        f64::from(u8::from(f.remap_pending)),
                    )
                }
                None => (0.0, 0.0, 0.0, 0.0),
            };
            let round6 = |v: f64| (v * 1e6).round() / 1e6;
            let mut ratio = |scale: f64| {
                round6(
                    (load * scale + rng.random_range(0.0..RATIO_NOISE)).clamp(0.0, 1.0) * activity,
                )
            };
            let gr = ratio(profile.gr);
            let tensor = ratio(profile.tensor);
            let dram = ratio(profile.dram);
            let sm_active = round6(gr * profile.sm);
            let busy_io = load * activity;
            let pcie_tx =
                (rng.random_range(0.5e6..2.0e6) + busy_io * rng.random_range(0.0..5.0e7)).round();
            let pcie_rx =
                (rng.random_range(0.5e6..2.0e6) + busy_io * rng.random_range(0.0..5.0e7)).round();

            let mut push = |metric: Metric, value: f64| out.push(Reading::new(gpu, metric, value));
            push(Metric::SmClock, sm_clock);
            push(Metric::MemClock, 2619.0);
            push(Metric::MemoryTemp, temp + 4.0);
            push(Metric::GpuTemp, temp);
            push(Metric::PowerUsage, power_w);
            push(Metric::TotalEnergyConsumption, g.energy_mj as f64);
            push(Metric::PcieReplayCounter, g.pcie_replays as f64);
            push(Metric::GpuUtil, util);
            push(Metric::MemCopyUtil, (dram * 125.0).min(100.0).round());
            push(Metric::EncUtil, 0.0);
            push(Metric::DecUtil, 0.0);
            push(Metric::XidErrors, xid);
            push(Metric::FbFree, FB_TOTAL_MIB - FB_RESERVED_MIB - fb_used);
            push(Metric::FbUsed, fb_used);
            push(Metric::FbReserved, FB_RESERVED_MIB);
            push(Metric::NvlinkBandwidthTotal, g.nvlink_kib as f64);
            push(Metric::UncorrectableRemappedRows, uncorrectable_rows);
            push(Metric::CorrectableRemappedRows, correctable_rows);
            push(Metric::RowRemapFailure, 0.0);
            push(Metric::GrEngineActive, gr);
            push(Metric::PipeTensorActive, tensor);
            push(Metric::DramActive, dram);
            push(Metric::PcieTxBytes, pcie_tx);
            push(Metric::PcieRxBytes, pcie_rx);
            // The throttle counters integrate the reasons the clock was limited.
            if throttled {
                g.thermal_ns += (dt_s * 1e9) as u64;
            }
            push(Metric::ClockThrottleReasons, clock_events as f64);
            push(Metric::PowerViolation, 0.0);
            push(Metric::ThermalViolation, g.thermal_ns as f64);
            push(Metric::SyncBoostViolation, 0.0);
            push(Metric::BoardLimitViolation, 0.0);
            push(Metric::LowUtilViolation, 0.0);
            push(Metric::ReliabilityViolation, 0.0);
            push(Metric::ClocksEventSwPowerCapNs, 0.0);
            push(Metric::ClocksEventSyncBoostNs, 0.0);
            push(Metric::ClocksEventSwThermSlowdownNs, 0.0);
            push(Metric::ClocksEventHwThermSlowdownNs, g.thermal_ns as f64);
            push(Metric::ClocksEventHwPowerBrakeSlowdownNs, 0.0);
            // Each remapped row comes from an ECC error: correctable rows
            // from single-bit errors, uncorrectable ones from double-bit.
            push(Metric::EccSbeVolTotal, correctable_rows);
            push(Metric::EccDbeVolTotal, uncorrectable_rows);
            push(Metric::EccSbeAggTotal, correctable_rows);
            push(Metric::EccDbeAggTotal, uncorrectable_rows);
            push(Metric::RetiredSbe, 0.0);
            push(Metric::RetiredDbe, 0.0);
            push(Metric::RetiredPending, 0.0);
            push(Metric::RowRemapPending, remap_pending);
            push(Metric::NvlinkCrcFlitErrorCountTotal, 0.0);
            push(Metric::NvlinkCrcDataErrorCountTotal, 0.0);
            push(Metric::NvlinkReplayErrorCountTotal, 0.0);
            push(Metric::NvlinkRecoveryErrorCountTotal, 0.0);
            push(Metric::SmActive, sm_active);
            push(Metric::SmOccupancy, round6(sm_active * 0.55));
            push(Metric::PipeFp64Active, 0.0);
            push(Metric::PipeFp32Active, round6(tensor * 0.3));
            push(Metric::PipeFp16Active, round6(tensor * 0.2));
        }
        // Faults that replace a GPU's readings (XID 79, frozen zombie) are
        // applied in a second pass, so that they cover every metric pushed
        // above. Every GPU pushed the same number; the pass compacts in place.
        if self.any_faults {
            let per_gpu = (out.len() - base) / self.gpus.len();
            let mut write = base;
            for (i, g) in self.gpus.iter_mut().enumerate() {
                let read = base + i * per_gpu;
                write = match g.faults.as_deref_mut() {
                    Some(f) => f.end_tick(tick, i as u32, out, read..read + per_gpu, write),
                    None => {
                        if read != write {
                            out.copy_within(read..read + per_gpu, write);
                        }
                        write + per_gpu
                    }
                };
            }
            out.truncate(write);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
