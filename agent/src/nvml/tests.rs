//! [`NvmlSource`] driven by a scripted fake device. Expected values are
//! written out by hand from the scripted inputs.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::sys_exports::field_id as fi;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber, span};

use super::*;
use crate::source::MigInstance;

/// What a fake GPU answers. `None` / an absent key: `NotSupported`.
#[derive(Debug, Clone, Default)]
struct Script {
    lost: bool,
    uuid: String,
    sm_mhz: Option<u32>,
    mem_mhz: Option<u32>,
    temp_c: Option<u32>,
    power_mw: Option<u32>,
    energy_mj: Option<u64>,
    replays: Option<u32>,
    util: Option<Utilization>,
    enc_pct: Option<u32>,
    dec_pct: Option<u32>,
    memory: Option<MemoryBytes>,
    nvlink: Option<NvlinkThroughput>,
    reasons: Option<u64>,
    fields: HashMap<u32, SampleValue>,
    gpm_supported: bool,
    /// GPM value per (GPU instance, metric), as GPM reports it.
    gpm: HashMap<(Option<u32>, GpmMetric), f64>,
    mig: Vec<MigInstance>,
    mig_memory: HashMap<u32, MemoryBytes>,
}

/// Every field present, with small distinct values.
fn full_script(uuid: &str) -> Script {
    Script {
        uuid: uuid.into(),
        sm_mhz: Some(1980),
        mem_mhz: Some(2619),
        temp_c: Some(55),
        power_mw: Some(312_456),
        energy_mj: Some(123_456_789),
        replays: Some(3),
        util: Some(Utilization {
            gpu_pct: 87,
            memory_pct: 31,
        }),
        enc_pct: Some(0),
        dec_pct: Some(0),
        memory: Some(MemoryBytes {
            free: 1_073_741_824,            // 1024 MiB
            used: 42_949_672_960 + 524_288, // 40960 MiB + 0.5 MiB
            reserved: 596_639_744,          // 569 MiB
        }),
        nvlink: Some(NvlinkThroughput {
            tx_kib: 1000,
            rx_kib: 2345,
        }),
        reasons: Some(0x24),
        fields: FIELDS
            .iter()
            .map(|(id, _)| (*id, SampleValue::U64(u64::from(*id) * 10)))
            .collect(),
        ..Script::default()
    }
}

type Shared = Arc<Mutex<Script>>;

struct FakeDevice {
    script: Shared,
    /// GPU instances that already took their first GPM sample.
    gpm_primed: HashSet<Option<u32>>,
}

impl FakeDevice {
    fn get<T>(&self, f: impl FnOnce(&Script) -> Option<T>) -> DeviceResult<T> {
        let s = self.script.lock().unwrap();
        if s.lost {
            return Err(DeviceError::GpuLost);
        }
        f(&s).ok_or(DeviceError::NotSupported)
    }
}

impl NvmlDevice for FakeDevice {
    fn uuid(&self) -> DeviceResult<String> {
        self.get(|s| Some(s.uuid.clone()))
    }
    fn name(&self) -> DeviceResult<String> {
        self.get(|_| Some("NVIDIA H100 80GB HBM3".into()))
    }
    fn serial(&self) -> DeviceResult<String> {
        self.get(|_| Some("1650923012345".into()))
    }
    fn vbios_version(&self) -> DeviceResult<String> {
        self.get(|_| Some("96.00.89.00.01".into()))
    }
    fn inforom_image_version(&self) -> DeviceResult<String> {
        self.get(|_| Some("G520.0200.00.05".into()))
    }
    fn pci_bus_id(&self) -> DeviceResult<String> {
        self.get(|_| Some("00000000:18:00.0".into()))
    }
    fn mig_enabled(&self) -> DeviceResult<bool> {
        self.get(|s| Some(!s.mig.is_empty()))
    }
    fn mig_instances(&self) -> DeviceResult<Vec<MigInstance>> {
        self.get(|s| Some(s.mig.clone()))
    }
    fn gpm_supported(&self) -> DeviceResult<bool> {
        self.get(|s| Some(s.gpm_supported))
    }
    fn clock_mhz(&self, clock: ClockDomain) -> DeviceResult<u32> {
        self.get(|s| match clock {
            ClockDomain::Sm => s.sm_mhz,
            ClockDomain::Memory => s.mem_mhz,
        })
    }
    fn gpu_temp_c(&self) -> DeviceResult<u32> {
        self.get(|s| s.temp_c)
    }
    fn power_mw(&self) -> DeviceResult<u32> {
        self.get(|s| s.power_mw)
    }
    fn energy_mj(&self) -> DeviceResult<u64> {
        self.get(|s| s.energy_mj)
    }
    fn pcie_replays(&self) -> DeviceResult<u32> {
        self.get(|s| s.replays)
    }
    fn utilization(&self) -> DeviceResult<Utilization> {
        self.get(|s| s.util)
    }
    fn encoder_util_pct(&self) -> DeviceResult<u32> {
        self.get(|s| s.enc_pct)
    }
    fn decoder_util_pct(&self) -> DeviceResult<u32> {
        self.get(|s| s.dec_pct)
    }
    fn memory(&self) -> DeviceResult<MemoryBytes> {
        self.get(|s| s.memory)
    }
    fn clocks_event_reasons(&self) -> DeviceResult<u64> {
        self.get(|s| s.reasons)
    }
    fn field_values(&self, ids: &[u32]) -> DeviceResult<Vec<DeviceResult<SampleValue>>> {
        self.get(|s| {
            Some(
                ids.iter()
                    .map(|id| s.fields.get(id).cloned().ok_or(DeviceError::NotSupported))
                    .collect(),
            )
        })
    }
    fn nvlink_throughput(&self) -> DeviceResult<NvlinkThroughput> {
        self.get(|s| s.nvlink)
    }
    fn mig_memory(&self, gpu_instance_id: u32) -> DeviceResult<MemoryBytes> {
        self.get(|s| s.mig_memory.get(&gpu_instance_id).copied())
    }
    fn gpm(
        &mut self,
        gpu_instance: Option<u32>,
        metrics: &[GpmMetric],
    ) -> DeviceResult<Vec<DeviceResult<f64>>> {
        self.get(|s| Some(s.gpm_supported)).and_then(|ok| {
            if ok {
                Ok(())
            } else {
                Err(DeviceError::NotSupported)
            }
        })?;
        if self.gpm_primed.insert(gpu_instance) {
            return Err(DeviceError::NoData);
        }
        self.get(|s| {
            Some(
                metrics
                    .iter()
                    .map(|m| {
                        s.gpm
                            .get(&(gpu_instance, *m))
                            .copied()
                            .ok_or(DeviceError::NotSupported)
                    })
                    .collect(),
            )
        })
    }
}

struct FakeXid {
    rx: mpsc::Receiver<XidEvent>,
}

impl XidEvents for FakeXid {
    fn wait(&mut self, timeout: Duration) -> DeviceResult<Option<XidEvent>> {
        match self.rx.recv_timeout(timeout) {
            Ok(e) => Ok(Some(e)),
            Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                std::thread::sleep(timeout);
                Ok(None)
            }
        }
    }
}

struct FakeBackend {
    scripts: Vec<Shared>,
    /// `None`: event sets unsupported.
    xid: Option<mpsc::Receiver<XidEvent>>,
}

impl NvmlBackend for FakeBackend {
    fn driver_version(&self) -> DeviceResult<String> {
        Ok("550.54.15".into())
    }
    fn cuda_driver_version(&self) -> DeviceResult<i32> {
        Ok(12040)
    }
    fn devices(&mut self) -> DeviceResult<Vec<Box<dyn NvmlDevice>>> {
        Ok(self
            .scripts
            .iter()
            .map(|s| {
                Box::new(FakeDevice {
                    script: s.clone(),
                    gpm_primed: HashSet::new(),
                }) as Box<dyn NvmlDevice>
            })
            .collect())
    }
    fn xid_events(&mut self) -> DeviceResult<XidSubscription> {
        let rx = self.xid.take().ok_or(DeviceError::NotSupported)?;
        Ok(XidSubscription {
            events: Box::new(FakeXid { rx }),
            registered: self.scripts.iter().map(|_| Ok(())).collect(),
        })
    }
}

fn open(scripts: &[Shared], xid: Option<mpsc::Receiver<XidEvent>>) -> NvmlSource {
    NvmlSource::with_backend(Box::new(FakeBackend {
        scripts: scripts.to_vec(),
        xid,
    }))
    .unwrap()
}

fn shared(s: Script) -> Shared {
    Arc::new(Mutex::new(s))
}

fn poll(src: &mut NvmlSource) -> Vec<Reading> {
    let mut v = Vec::new();
    src.sample(&mut v).unwrap();
    v
}

fn value(rs: &[Reading], gpu: u32, metric: Metric, label: Option<SeriesLabel>) -> Option<f64> {
    let mut hits = rs
        .iter()
        .filter(|r| r.gpu == gpu && r.metric == metric && r.label == label);
    let v = hits.next().map(|r| r.value);
    assert!(hits.next().is_none(), "{metric:?} twice for gpu {gpu}");
    v
}

/// Captures the message of every event logged on this thread.
/// Held by a test while it captures logs (see its use).
static LOG_CAPTURE: Mutex<()> = Mutex::new(());

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<(Level, String)>>>);

struct MessageVisitor(String);

impl Visit for MessageVisitor {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Capture {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }
    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}
    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}
    fn event(&self, e: &Event<'_>) {
        let mut v = MessageVisitor(String::new());
        e.record(&mut v);
        self.0.lock().unwrap().push((*e.metadata().level(), v.0));
    }
    fn enter(&self, _: &span::Id) {}
    fn exit(&self, _: &span::Id) {}
}

#[test]
fn converts_to_dcgm_exporter_units() {
    let mut s = full_script("GPU-a");
    s.fields.insert(
        fi::NVML_FI_DEV_PERF_POLICY_POWER,
        SampleValue::U64(5_000_000),
    );
    s.fields
        .insert(fi::NVML_FI_DEV_ECC_DBE_VOL_TOTAL, SampleValue::U64(2));
    s.fields
        .insert(fi::NVML_FI_DEV_REMAPPED_PENDING, SampleValue::U32(1));
    let mut src = open(&[shared(s)], None);
    let r = poll(&mut src);
    let v = |m| value(&r, 0, m, None);
    assert_eq!(v(Metric::PowerUsage), Some(312.456));
    assert_eq!(v(Metric::TotalEnergyConsumption), Some(123_456_789.0));
    assert_eq!(v(Metric::FbFree), Some(1024.0));
    assert_eq!(v(Metric::FbUsed), Some(40960.0));
    assert_eq!(v(Metric::FbReserved), Some(569.0));
    assert_eq!(v(Metric::SmClock), Some(1980.0));
    assert_eq!(v(Metric::GpuUtil), Some(87.0));
    assert_eq!(v(Metric::MemCopyUtil), Some(31.0));
    assert_eq!(v(Metric::NvlinkBandwidthTotal), Some(3345.0));
    assert_eq!(v(Metric::ClockThrottleReasons), Some(36.0));
    // Perf-policy field 74 feeds both names DCGM gives it.
    assert_eq!(v(Metric::PowerViolation), Some(5_000_000.0));
    assert_eq!(v(Metric::ClocksEventSwPowerCapNs), Some(5_000_000.0));
    assert_eq!(v(Metric::EccDbeVolTotal), Some(2.0));
    assert_eq!(v(Metric::RowRemapPending), Some(1.0));
    // Field 38 scripted as 38 * 10.
    assert_eq!(v(Metric::NvlinkCrcFlitErrorCountTotal), Some(380.0));
    let inv = &src.inventory()[0];
    assert_eq!(inv.uuid, "GPU-a");
    assert_eq!(inv.cuda_driver_version, "12.4");
    assert_eq!(inv.inforom_image_version, "G520.0200.00.05");
    assert_eq!(inv.mig_enabled, Some(false));
    // No GPM (pre-Hopper script) and no XID watch: the rest of ALL, once each.
    let prof = [
        Metric::GrEngineActive,
        Metric::PipeTensorActive,
        Metric::DramActive,
        Metric::PcieTxBytes,
        Metric::PcieRxBytes,
        Metric::SmActive,
        Metric::SmOccupancy,
        Metric::PipeFp64Active,
        Metric::PipeFp32Active,
        Metric::PipeFp16Active,
    ];
    assert_eq!(r.len(), Metric::ALL.len() - prof.len() - 1);
    assert!(
        r.iter()
            .all(|x| !prof.contains(&x.metric) && x.label.is_none())
    );
}

#[test]
fn sentinels_are_dropped_not_reported() {
    let mut s = full_script("GPU-a");
    s.fields
        .insert(fi::NVML_FI_DEV_MEMORY_TEMP, SampleValue::U32(u32::MAX));
    s.fields
        .insert(fi::NVML_FI_DEV_RETIRED_SBE, SampleValue::U64(u64::MAX));
    s.fields
        .insert(fi::NVML_FI_DEV_RETIRED_DBE, SampleValue::F64(f64::NAN));
    s.power_mw = Some(u32::MAX);
    s.temp_c = Some(250);
    let mut src = open(&[shared(s)], None);
    let r = poll(&mut src);
    for m in [
        Metric::MemoryTemp,
        Metric::RetiredSbe,
        Metric::RetiredDbe,
        Metric::PowerUsage,
        Metric::GpuTemp,
    ] {
        assert_eq!(value(&r, 0, m, None), None, "{m:?}");
    }
    assert_eq!(value(&r, 0, Metric::RetiredPending, None), Some(310.0));
    assert_eq!(src.stats().unavailable_fields(), 5);
}

#[test]
fn unsupported_fields_are_skipped_and_logged_once() {
    let mut s = full_script("GPU-a");
    s.enc_pct = None;
    s.fields.remove(&fi::NVML_FI_DEV_MEMORY_TEMP);
    let mut src = open(&[shared(s.clone()), shared(s)], None);
    for _ in 0..3 {
        let r = poll(&mut src);
        for gpu in 0..2 {
            assert_eq!(value(&r, gpu, Metric::EncUtil, None), None);
            assert_eq!(value(&r, gpu, Metric::MemoryTemp, None), None);
            assert_eq!(value(&r, gpu, Metric::DecUtil, None), Some(0.0));
        }
    }
    // Two fields on two GPUs, three polls: four skipped fields. The counter
    // and the warning are one branch (`note_failure`), so the count is the
    // number of log lines; counting captured log lines instead raced with
    // tracing's callsite cache on parallel test threads (CI, d052df4).
    assert_eq!(src.stats().unavailable_fields(), 4);
    assert_eq!(src.stats().errors(), 0);
}

#[test]
fn lost_gpu_is_omitted_and_logged_once_others_continue() {
    let gpus = [shared(full_script("GPU-a")), shared(full_script("GPU-b"))];
    let mut src = open(&gpus, None);
    let before = poll(&mut src);
    let per_gpu = before.iter().filter(|r| r.gpu == 0).count();
    assert_eq!(before.iter().filter(|r| r.gpu == 1).count(), per_gpu);

    gpus[1].lock().unwrap().lost = true;
    let cap = Capture::default();
    // Scoped subscribers on parallel test threads race in tracing's callsite
    // interest cache (one ending can disable the other's callsites): the
    // tests that capture logs take turns, and rebuild the cache inside.
    let _turn = LOG_CAPTURE.lock().unwrap_or_else(|e| e.into_inner());
    tracing::subscriber::with_default(cap.clone(), || {
        tracing::callsite::rebuild_interest_cache();
        for _ in 0..3 {
            let r = poll(&mut src);
            assert_eq!(r.iter().filter(|r| r.gpu == 0).count(), per_gpu);
            assert_eq!(r.iter().filter(|r| r.gpu == 1).count(), 0);
            assert_eq!(value(&r, 0, Metric::PowerUsage, None), Some(312.456));
        }
    });
    let lost_logs: Vec<_> = cap
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, m)| m.contains("GPU is lost"))
        .cloned()
        .collect();
    assert_eq!(lost_logs.len(), 1);
    assert_eq!(lost_logs[0].0, Level::ERROR);
    assert_eq!(src.stats().gpus_lost(), 1);
    assert_eq!(src.stats().errors(), 1);

    // Back on the bus (after a reset): sampled again.
    gpus[1].lock().unwrap().lost = false;
    let r = poll(&mut src);
    assert_eq!(r.iter().filter(|r| r.gpu == 1).count(), per_gpu);
}

/// Polls until `done` holds for the readings, or fails after 10 s.
fn poll_until(src: &mut NvmlSource, done: impl Fn(&[Reading]) -> bool) -> Vec<Reading> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = poll(src);
        if done(&r) {
            return r;
        }
        assert!(Instant::now() < deadline, "condition not reached: {r:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn xid_events_give_last_value_and_per_xid_counters() {
    let (tx, rx) = mpsc::channel();
    let gpus = [shared(full_script("GPU-a")), shared(full_script("GPU-b"))];
    let mut src = open(&gpus, Some(rx));
    let r = poll(&mut src);
    assert_eq!(value(&r, 0, Metric::XidErrors, None), Some(0.0));
    assert_eq!(value(&r, 1, Metric::XidErrors, None), Some(0.0));
    assert!(r.iter().all(|x| x.metric != Metric::XidErrorsTotal));

    let xid79 = Some(SeriesLabel::Xid(79));
    tx.send(XidEvent { gpu: 1, xid: 79 }).unwrap();
    let r = poll_until(&mut src, |r| {
        value(r, 1, Metric::XidErrorsTotal, xid79).is_some()
    });
    assert_eq!(value(&r, 1, Metric::XidErrors, None), Some(79.0));
    assert_eq!(value(&r, 1, Metric::XidErrorsTotal, xid79), Some(1.0));
    assert_eq!(value(&r, 0, Metric::XidErrors, None), Some(0.0));
    assert!(
        r.iter()
            .all(|x| x.metric != Metric::XidErrorsTotal || x.gpu == 1)
    );

    tx.send(XidEvent { gpu: 1, xid: 79 }).unwrap();
    let r = poll_until(&mut src, |r| {
        value(r, 1, Metric::XidErrorsTotal, xid79) != Some(1.0)
    });
    assert_eq!(value(&r, 1, Metric::XidErrorsTotal, xid79), Some(2.0));

    tx.send(XidEvent { gpu: 1, xid: 13 }).unwrap();
    let xid13 = Some(SeriesLabel::Xid(13));
    let r = poll_until(&mut src, |r| {
        value(r, 1, Metric::XidErrorsTotal, xid13).is_some()
    });
    assert_eq!(value(&r, 1, Metric::XidErrors, None), Some(13.0));
    assert_eq!(value(&r, 1, Metric::XidErrorsTotal, xid13), Some(1.0));
    assert_eq!(value(&r, 1, Metric::XidErrorsTotal, xid79), Some(2.0));
    assert_eq!(src.stats().xid_events(), 3);
}

#[test]
fn mig_instances_get_their_own_series() {
    let mut s = full_script("GPU-a");
    s.mig = vec![
        MigInstance {
            gpu_instance_id: 1,
            profile: "3g.40gb".into(),
        },
        MigInstance {
            gpu_instance_id: 9,
            profile: "1g.10gb".into(),
        },
    ];
    s.mig_memory.insert(
        1,
        MemoryBytes {
            free: 2_097_152,  // 2 MiB
            used: 10_485_760, // 10 MiB
            reserved: 0,
        },
    );
    s.mig_memory.insert(
        9,
        MemoryBytes {
            free: 3_145_728,     // 3 MiB
            used: 1_048_575,     // just under 1 MiB
            reserved: 1_048_576, // 1 MiB
        },
    );
    s.gpm_supported = true;
    for g in GPM.map(|(g, _, _)| g) {
        s.gpm.insert((None, g), 50.0);
        s.gpm.insert((Some(1), g), 42.5);
        s.gpm.insert((Some(9), g), 10.0);
    }
    let mut src = open(&[shared(s)], None);
    let inv = &src.inventory()[0];
    assert_eq!(inv.mig_enabled, Some(true));
    assert_eq!(inv.mig_instances[1].profile, "1g.10gb");

    let gi1 = Some(SeriesLabel::GpuInstance(1));
    let gi9 = Some(SeriesLabel::GpuInstance(9));
    let r = poll(&mut src);
    assert_eq!(value(&r, 0, Metric::FbUsed, gi1), Some(10.0));
    assert_eq!(value(&r, 0, Metric::FbFree, gi1), Some(2.0));
    assert_eq!(value(&r, 0, Metric::FbUsed, gi9), Some(0.0));
    assert_eq!(value(&r, 0, Metric::FbReserved, gi9), Some(1.0));
    assert_eq!(value(&r, 0, Metric::FbUsed, None), Some(40960.0));
    // GPM needs two samples: nothing on the first poll.
    assert_eq!(value(&r, 0, Metric::GrEngineActive, gi1), None);
    assert_eq!(value(&r, 0, Metric::GrEngineActive, None), None);

    let r = poll(&mut src);
    assert_eq!(value(&r, 0, Metric::GrEngineActive, gi1), Some(0.425));
    assert_eq!(value(&r, 0, Metric::PipeTensorActive, gi9), Some(0.1));
    assert_eq!(value(&r, 0, Metric::GrEngineActive, None), Some(0.5));
    // 50 MiB/s.
    assert_eq!(value(&r, 0, Metric::PcieTxBytes, None), Some(52_428_800.0));
    assert_eq!(value(&r, 0, Metric::PcieRxBytes, gi1), Some(44_564_480.0));
    // GPU-level metrics that MIG instances lack stay unlabelled only.
    assert_eq!(value(&r, 0, Metric::PowerUsage, gi1), None);
    assert_eq!(src.stats().unavailable_fields(), 0);
}

/// The real backend on a real GPU: run deliberately on a GPU host.
#[cfg(feature = "nvml-live")]
#[test]
#[ignore = "needs a GPU and libnvidia-ml: cargo test -p agent --features nvml-live -- --ignored"]
fn live_gpu_gives_plausible_readings() {
    let mut src = NvmlSource::open().expect("NVML on this host");
    assert!(!src.inventory().is_empty());
    assert!(src.inventory()[0].uuid.starts_with("GPU-"));
    poll(&mut src);
    std::thread::sleep(Duration::from_millis(1100));
    let r = poll(&mut src);
    let v = |m| value(&r, 0, m, None).unwrap_or_else(|| panic!("{m:?} missing"));
    assert!((1.0..2000.0).contains(&v(Metric::PowerUsage)));
    assert!((1.0..150.0).contains(&v(Metric::GpuTemp)));
    assert!(v(Metric::FbUsed) + v(Metric::FbFree) > 1000.0);
    assert!(v(Metric::SmClock) > 0.0);
    assert_eq!(v(Metric::XidErrors), 0.0);
    assert!(r.iter().all(|x| x.value.is_finite() && x.value >= 0.0));
    assert_eq!(src.stats().errors(), 0);
}

/// The real backend against `nvidia-smi`, which reads the same driver through
/// its own code: identity strings equal, temperature and framebuffer sizes in
/// the same units. Run deliberately on a GPU host (see above).
#[cfg(feature = "nvml-live")]
#[test]
#[ignore = "needs a GPU and libnvidia-ml: cargo test -p agent --features nvml-live -- --ignored"]
#[allow(clippy::print_stdout)] // what was read goes into the run's log
fn live_readings_agree_with_nvidia_smi() {
    let mut src = NvmlSource::open().expect("NVML on this host");
    poll(&mut src);
    std::thread::sleep(Duration::from_millis(1100));
    let r = poll(&mut src);
    let out = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=uuid,pci.bus_id,name,driver_version,temperature.gpu,memory.total,memory.used",
            "--format=csv,noheader,nounits",
        ])
        .output()
        .expect("nvidia-smi runs");
    assert!(out.status.success(), "{out:?}");
    let smi = String::from_utf8(out.stdout).unwrap();
    let mut metrics: Vec<_> = r
        .iter()
        .filter(|x| x.gpu == 0)
        .map(|x| x.metric.name())
        .collect();
    metrics.sort_unstable();
    metrics.dedup();
    println!("GPU 0: {} metrics: {}", metrics.len(), metrics.join(" "));
    let mut seen = 0;
    for line in smi.lines() {
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let gpu = src
            .inventory()
            .iter()
            .find(|g| g.uuid == f[0])
            .unwrap_or_else(|| panic!("nvidia-smi's {} is not in the inventory", f[0]));
        println!("nvidia-smi: {line}\nagent: {gpu:?}");
        assert!(
            gpu.pci_bus_id.eq_ignore_ascii_case(f[1]),
            "{} vs {}",
            gpu.pci_bus_id,
            f[1]
        );
        assert_eq!(gpu.model_name, f[2]);
        assert_eq!(gpu.driver_version, f[3]);
        let v = |m| value(&r, gpu.index, m, None).unwrap_or_else(|| panic!("{m:?} missing"));
        let num = |s: &str| {
            s.parse::<f64>()
                .unwrap_or_else(|_| panic!("{s:?} in {line}"))
        };
        // Read a moment apart: a degree of drift at most.
        assert!((v(Metric::GpuTemp) - num(f[4])).abs() <= 1.0, "{line}");
        // Each part floored to MiB, as DCGM does: the sum is off by 2 MiB at most.
        let total = v(Metric::FbUsed) + v(Metric::FbFree) + v(Metric::FbReserved);
        assert!((total - num(f[5])).abs() <= 2.0, "{total} MiB vs {line}");
        // Nothing else runs on a test host: the used framebuffer is still.
        assert!((v(Metric::FbUsed) - num(f[6])).abs() <= 2.0, "{line}");
        seen += 1;
    }
    assert_eq!(seen, src.inventory().len());
}

/// What each NVML call of a poll costs on this host (wall time, mean of 20),
/// and the CPU the XID thread takes while the source only waits: where a
/// poll's time goes (docs/BENCHMARKS.md, "On a real GPU"). Prints a table;
/// asserts only that the calls answer.
#[cfg(feature = "nvml-live")]
#[test]
#[ignore = "needs a GPU and libnvidia-ml: cargo test -p agent --features nvml-live -- --ignored"]
#[allow(clippy::print_stdout)] // the table is the result
fn live_cost_of_each_call() {
    /// utime + stime of this process, in clock ticks (/proc/self/stat).
    fn cpu_ticks() -> u64 {
        let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        let f: Vec<&str> = after.split(' ').collect();
        f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
    }
    let mut src = NvmlSource::open().expect("NVML on this host");
    let idle0 = cpu_ticks();
    std::thread::sleep(Duration::from_secs(5));
    println!(
        "process CPU while idle for 5 s (XID thread waiting): {} ticks",
        cpu_ticks() - idle0
    );
    const N: u32 = 20;
    macro_rules! cost {
        ($name:expr, $call:expr) => {{
            let t = Instant::now();
            let mut ok = 0;
            for _ in 0..N {
                ok += u32::from($call.is_ok());
            }
            println!(
                "{:<28} {:>9.3} ms  ({ok}/{N} answered)",
                $name,
                t.elapsed().as_secs_f64() * 1e3 / f64::from(N)
            );
        }};
    }
    let ids: Vec<u32> = FIELDS.iter().map(|(id, _)| *id).collect();
    let gpm: Vec<GpmMetric> = GPM.iter().map(|(g, _, _)| *g).collect();
    let d = src.devices[0].as_mut();
    cost!("clock_mhz(Sm)", d.clock_mhz(ClockDomain::Sm));
    cost!("clock_mhz(Memory)", d.clock_mhz(ClockDomain::Memory));
    cost!("gpu_temp_c", d.gpu_temp_c());
    cost!("power_mw", d.power_mw());
    cost!("energy_mj", d.energy_mj());
    cost!("pcie_replays", d.pcie_replays());
    cost!("utilization", d.utilization());
    cost!("encoder_util_pct", d.encoder_util_pct());
    cost!("decoder_util_pct", d.decoder_util_pct());
    cost!("memory", d.memory());
    cost!("nvlink_throughput", d.nvlink_throughput());
    cost!("clocks_event_reasons", d.clocks_event_reasons());
    cost!(
        format!("field_values({} ids)", ids.len()),
        d.field_values(&ids)
    );
    for id in &ids {
        cost!(format!("  field {id}"), d.field_values(&[*id]));
    }
    // Energy as a field value instead of nvmlDeviceGetTotalEnergyConsumption.
    let energy = fi::NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION;
    cost!("  field 83 (energy)", d.field_values(&[energy]));
    let mut with_energy = ids.clone();
    with_energy.push(energy);
    cost!(
        format!("field_values({} ids)", with_energy.len()),
        d.field_values(&with_energy)
    );
    let by_call = d.energy_mj().unwrap();
    let by_field = d.field_values(&[energy]).unwrap().remove(0);
    println!("energy: {by_call} mJ by call, {by_field:?} by field");
    // GPM reports over the time between two samples: 10 ms apart, not timed.
    let (mut took, mut ok) = (Duration::ZERO, 0);
    for _ in 0..N {
        std::thread::sleep(Duration::from_millis(10));
        let t = Instant::now();
        ok += u32::from(d.gpm(None, &gpm).is_ok());
        took += t.elapsed();
    }
    println!(
        "{:<28} {:>9.3} ms  ({ok}/{N} answered)",
        format!("gpm({} metrics)", gpm.len()),
        took.as_secs_f64() * 1e3 / f64::from(N)
    );
    let t = Instant::now();
    let c0 = cpu_ticks();
    for _ in 0..N {
        poll(&mut src);
    }
    println!(
        "{:<28} {:>9.3} ms wall, {} CPU ticks for {N}",
        "whole poll (sample)",
        t.elapsed().as_secs_f64() * 1e3 / f64::from(N),
        cpu_ticks() - c0
    );
    assert_eq!(src.stats().errors(), 0);
}
