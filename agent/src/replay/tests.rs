use std::io::Write;
use std::path::PathBuf;

use super::*;

fn write_csv(dir: &tempfile::TempDir, name: &str, body: &str) -> PathBuf {
    let path = dir.path().join(name);
    let mut f = File::create(&path).unwrap();
    f.write_all(body.as_bytes()).unwrap();
    path
}

/// Every poll of `s`: (timestamp, readings).
fn drain(s: &mut ReplaySource) -> Vec<(i64, Vec<Reading>)> {
    let mut polls = Vec::new();
    while let Some(ts) = s.next_timestamp_ms() {
        let mut r = Vec::new();
        s.sample(&mut r).unwrap();
        polls.push((ts, r));
    }
    let mut after = Vec::new();
    s.sample(&mut after).unwrap();
    assert!(after.is_empty(), "nothing after the end");
    polls
}

fn reading(gpu: u32, metric: Metric, value: f64) -> Reading {
    Reading::new(gpu, metric, value)
}

#[test]
fn round_trip_of_a_small_file() {
    let dir = tempfile::tempdir().unwrap();
    // GPU 1 appears first; the inventory is still in GPU-index order.
    let g0 = "gpu=0;UUID=GPU-aaaa;pci_bus_id=00000000:18:00.0;modelName=NVIDIA H100 80GB HBM3;DCGM_FI_DRIVER_VERSION=550.54.15;Hostname=node7";
    let g1 = "gpu=1;UUID=GPU-bbbb;pci_bus_id=00000000:2A:00.0;modelName=NVIDIA H100 80GB HBM3;DCGM_FI_DRIVER_VERSION=550.54.15;Hostname=node7";
    let body = format!(
        "labels,timestamp_ms,value\n\
         metric=DCGM_FI_DEV_GPU_TEMP;{g1},1775000000000,41\n\
         metric=DCGM_FI_DEV_GPU_TEMP;{g0},1775000000000,40\n\
         metric=DCGM_FI_DEV_POWER_USAGE;{g0},1775000000000,71.25\n\
         metric=DCGM_FI_DEV_NOT_A_FIELD;{g0},1775000000000,0.5\n\
         metric=DCGM_FI_DEV_GPU_TEMP;{g0},1775000001003,42\n\
         metric=temp_c;{g1},1775000001003,43\n\
         metric=host_mem_used_mb;Hostname=node7,1775000001003,1234\n\
         metric=DCGM_FI_DEV_GPU_TEMP;{g0},not-a-number,1\n\
         metric=DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION;{g1},1775000002000,123456789012\n\
         metric=DCGM_FI_DEV_NOT_A_FIELD;{g1},1775000002000,0.25\n"
    );
    let path = write_csv(&dir, "r.csv", &body);
    let mut s = ReplaySource::open(&ReplayConfig::new(&path)).unwrap();
    let inv = s.inventory().to_vec();
    assert_eq!(inv.len(), 2);
    assert_eq!(
        inv[0],
        GpuInfo {
            index: 0,
            uuid: "GPU-aaaa".into(),
            pci_bus_id: "00000000:18:00.0".into(),
            model_name: "NVIDIA H100 80GB HBM3".into(),
            driver_version: "550.54.15".into(),
            ..GpuInfo::default()
        }
    );
    assert_eq!((inv[1].index, inv[1].uuid.as_str()), (1, "GPU-bbbb"));
    assert_eq!(s.host(), Some("node7"));

    assert_eq!(
        drain(&mut s),
        vec![
            (
                1_775_000_000_000,
                vec![
                    reading(1, Metric::GpuTemp, 41.0),
                    reading(0, Metric::GpuTemp, 40.0),
                    reading(0, Metric::PowerUsage, 71.25),
                ]
            ),
            (
                1_775_000_001_003,
                vec![
                    reading(0, Metric::GpuTemp, 42.0),
                    reading(1, Metric::GpuTemp, 43.0),
                ]
            ),
            (
                1_775_000_002_000,
                vec![reading(
                    1,
                    Metric::TotalEnergyConsumption,
                    123_456_789_012.0
                )]
            ),
        ]
    );
    let st = s.stats();
    assert_eq!((st.rows, st.readings, st.polls), (10, 6, 3));
    assert_eq!(
        st.unknown_metrics,
        BTreeMap::from([("DCGM_FI_DEV_NOT_A_FIELD".to_string(), 2)])
    );
    assert_eq!((st.no_gpu, st.bad_rows, st.other_host), (1, 1, 0));
    assert_eq!(s.error(), None);
}

#[test]
fn several_hosts_need_a_filter() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_csv(
        &dir,
        "h.csv",
        "labels,timestamp_ms,value\n\
         metric=DCGM_FI_DEV_GPU_TEMP;gpu=0;Hostname=a,1000,40\n\
         metric=DCGM_FI_DEV_GPU_TEMP;gpu=0;Hostname=b,1000,50\n\
         metric=DCGM_FI_DEV_GPU_TEMP;gpu=1;Hostname=b,1000,51\n\
         metric=DCGM_FI_DEV_GPU_TEMP;gpu=0;Hostname=a,2000,41\n",
    );
    let err = ReplaySource::open(&ReplayConfig::new(&path)).unwrap_err();
    assert!(
        matches!(&err, ReplayError::SeveralHosts { hosts, .. } if hosts.len() == 2),
        "{err}"
    );
    let mut config = ReplayConfig::new(&path);
    config.host = Some("b".into());
    let mut s = ReplaySource::open(&config).unwrap();
    assert_eq!(s.inventory().len(), 2);
    assert_eq!(
        drain(&mut s),
        vec![(
            1000,
            vec![
                reading(0, Metric::GpuTemp, 50.0),
                reading(1, Metric::GpuTemp, 51.0)
            ]
        )]
    );
    assert_eq!(s.stats().other_host, 2);
    assert_eq!(s.host(), Some("b"));
    config.host = Some("c".into());
    assert!(matches!(
        ReplaySource::open(&config),
        Err(ReplayError::NoGpus { .. })
    ));
}

#[test]
fn wrong_header_and_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_csv(&dir, "x.csv", "timestamp,gpu,power_w\n1,0,70\n");
    let err = ReplaySource::open(&ReplayConfig::new(&path)).unwrap_err();
    assert!(err.to_string().contains("expected the header"), "{err}");
    let err = ReplaySource::open(&ReplayConfig::new(dir.path().join("nope.csv"))).unwrap_err();
    assert!(matches!(err, ReplayError::Open { .. }), "{err}");
}

/// `shared/data/real` seen from this crate (never copied into the repo).
fn real_data_dir() -> PathBuf {
    std::env::var_os("GPULSE_REAL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shared/data/real"
            ))
        })
}

/// Replays the real t13 recording, turned into a long CSV by the data set's
/// own `to_long_csv.py`, and checks every reading against the original wide
/// file, read here independently.
#[test]
#[allow(clippy::print_stdout)] // the skip note
fn replays_a_real_recording() {
    let dir = real_data_dir();
    let wide = dir.join("atharvanihalani__gpu-telemetry-exploration/t13_node0_telemetry.csv");
    if !wide.exists() {
        println!("skipped: {} is absent", wide.display());
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let long = tmp.path().join("t13.csv");
    let status = std::process::Command::new("python3")
        .arg(dir.join("to_long_csv.py"))
        .arg("ath_t13_node0")
        .stdout(File::create(&long).unwrap())
        .status();
    match status {
        Ok(s) if s.success() => {}
        other => {
            println!("skipped: python3 to_long_csv.py did not run: {other:?}");
            return;
        }
    }

    // Expected readings, straight from the wide file.
    let mut wide_csv = csv::Reader::from_path(&wide).unwrap();
    let header = wide_csv.headers().unwrap().clone();
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    let (ts_col, gpu_col) = (col("timestamp"), col("gpu"));
    let mut expected: Vec<(i64, u32, Metric, f64)> = Vec::new();
    let mut skipped_cells = 0u64;
    for rec in wide_csv.records() {
        let rec = rec.unwrap();
        let ts = (rec[ts_col].parse::<f64>().unwrap() * 1000.0).round() as i64;
        let gpu: u32 = rec[gpu_col].parse().unwrap();
        // to_long_csv.py's column order; the catalog has 13 of the 16.
        for name in [
            "power_w",
            "temp_c",
            "mem_used_mib",
            "mem_total_mib",
            "gpu_util_pct",
            "mem_util_pct",
            "sm_active",
            "tensor_active",
            "dram_active",
            "fp16_active",
            "pcie_tx_bytes_s",
            "pcie_rx_bytes_s",
            "nvlink_tx_bytes_s",
            "nvlink_rx_bytes_s",
            "throttle_reasons",
            "energy_mj",
        ] {
            let v = rec[col(name)].trim();
            if v.is_empty() {
                continue;
            }
            match ALIASES.iter().find(|(a, _)| *a == name) {
                Some((_, m)) => expected.push((ts, gpu, *m, v.parse().unwrap())),
                None => skipped_cells += 1,
            }
        }
    }

    let mut s = ReplaySource::open(&ReplayConfig::new(&long)).unwrap();
    let inv = s.inventory().to_vec();
    assert_eq!(inv.len(), 8);
    for (pos, g) in inv.iter().enumerate() {
        assert_eq!(g.index, pos as u32);
        assert_eq!(
            g.model_name, "NVIDIA_H100_80GB_HBM3",
            "sanitised by to_long_csv.py"
        );
    }
    let polls = drain(&mut s);
    let got: Vec<(i64, u32, Metric, f64)> = polls
        .iter()
        .flat_map(|(ts, rs)| rs.iter().map(move |r| (*ts, r.gpu, r.metric, r.value)))
        .collect();
    assert_eq!(got.len(), expected.len());
    assert!(got == expected, "every reading and timestamp as recorded");
    // One poll per timestamp: the 8 GPUs of a 10 Hz poll share it.
    assert!(polls.windows(2).all(|w| w[0].0 != w[1].0));
    assert_eq!(polls.len() as u64, s.stats().polls);
    assert!(
        (3000..=3300).contains(&polls.len()),
        "{} polls in 320 s at 10 Hz",
        polls.len()
    );
    assert_eq!(s.stats().unknown_metric_rows(), skipped_cells);
    assert_eq!(
        s.stats()
            .unknown_metrics
            .keys()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        ["mem_total_mib", "nvlink_rx_bytes_s", "nvlink_tx_bytes_s"]
    );
}

/// Issue #14: replay never sends a poll the nodes' window refuses. Recorded
/// timestamps before 1970 or past `max_future` are skipped and counted; the
/// poll at exactly `now + max_future` (give or take the test's own run
/// time) and the ones inside go out.
#[test]
fn recorded_polls_outside_the_window_are_skipped_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let g0 = "gpu=0;UUID=GPU-aaaa;Hostname=node7";
    let now = now_ms();
    let hour = 3_600_000;
    let rows = [-1000, now - hour, now, now + 5 * hour, now + 6 * hour];
    let mut body = String::from("labels,timestamp_ms,value\n");
    for ts in rows {
        body.push_str(&format!("metric=DCGM_FI_DEV_GPU_TEMP;{g0},{ts},40\n"));
        body.push_str(&format!("metric=DCGM_FI_DEV_POWER_USAGE;{g0},{ts},300\n"));
    }
    let path = write_csv(&dir, "w.csv", &body);
    let source = ReplaySource::open(&ReplayConfig::new(&path)).unwrap();
    let (tx, mut rx) = mpsc::channel(16);
    let options = ReplayOptions {
        speed: ReplaySpeed::Max,
        timestamps: ReplayTimestamps::Recorded,
        max_future: Duration::from_secs(3600),
    };
    let polls = AtomicU64::new(0);
    let source = replay_loop(source, tx, options, None, &AtomicBool::new(false), &polls);
    let mut sent = Vec::new();
    while let Ok(p) = rx.try_recv() {
        sent.push(p.ts_ms);
    }
    assert_eq!(sent, vec![now - hour, now]);
    assert_eq!(polls.load(Relaxed), 2);
    assert_eq!(source.stats().too_old, 2, "one poll of two readings");
    assert_eq!(
        source.stats().too_far_in_future,
        4,
        "two polls of two readings"
    );
}

/// At `max` speed, shifted timestamps would run ahead of the clock; the
/// replay waits so that no poll is more than `max_future` ahead.
#[test]
fn shifted_polls_wait_for_the_window() {
    let dir = tempfile::tempdir().unwrap();
    let g0 = "gpu=0;UUID=GPU-aaaa;Hostname=node7";
    let mut body = String::from("labels,timestamp_ms,value\n");
    // 0 s, 1 s and 1.6 s after the first: with max_future = 1 s the third
    // poll is due 0.6 s after the first is sent.
    for ts in [1_700_000_000_000i64, 1_700_000_001_000, 1_700_000_001_600] {
        body.push_str(&format!("metric=DCGM_FI_DEV_GPU_TEMP;{g0},{ts},40\n"));
    }
    let path = write_csv(&dir, "s.csv", &body);
    let source = ReplaySource::open(&ReplayConfig::new(&path)).unwrap();
    let (tx, mut rx) = mpsc::channel(16);
    let options = ReplayOptions {
        speed: ReplaySpeed::Max,
        timestamps: ReplayTimestamps::Shift,
        max_future: Duration::from_secs(1),
    };
    let started = Instant::now();
    let polls = AtomicU64::new(0);
    let source = replay_loop(source, tx, options, None, &AtomicBool::new(false), &polls);
    let took = started.elapsed();
    let mut sent = Vec::new();
    while let Ok(p) = rx.try_recv() {
        sent.push(p.ts_ms);
        assert!(
            p.ts_ms - now_ms() <= 1000,
            "a poll {} ms ahead",
            p.ts_ms - now_ms()
        );
    }
    assert_eq!(sent.len(), 3);
    assert_eq!(sent[2] - sent[0], 1600, "spacing kept");
    assert!(took >= Duration::from_millis(550), "waited only {took:?}");
    assert_eq!(source.stats().too_far_in_future, 0);
}
