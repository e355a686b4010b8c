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

/// `tests/data/h200` (see its README): what `gpulse-agent --record` wrote on
/// a real H200 under a known load, with `nvidia-smi` read beside it.
fn h200_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/h200"))
}

/// The H200 trace's rows of `file` (a CSV with a header) as maps of column
/// name to cell, read with the `csv` crate alone.
fn h200_table(file: &str) -> Vec<HashMap<String, String>> {
    let mut r = csv::Reader::from_path(h200_dir().join(file)).unwrap();
    let header = r.headers().unwrap().clone();
    r.records()
        .map(|row| {
            let row = row.unwrap();
            header
                .iter()
                .map(str::to_owned)
                .zip(row.iter().map(str::to_owned))
                .collect()
        })
        .collect()
}

/// The agent's record of a real H200 replays whole, and what it read agrees
/// with `nvidia-smi`'s readings of the same seconds and with the load that
/// ran (the phases file): the record's units are dcgm-exporter's.
#[test]
fn the_h200_record_replays_and_agrees_with_nvidia_smi_and_the_load() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("trace.csv");
    let packed = std::fs::read(h200_dir().join("trace.csv.zst")).unwrap();
    std::fs::write(&path, zstd::decode_all(&packed[..]).unwrap()).unwrap();
    let mut s = ReplaySource::open(&ReplayConfig::new(&path)).unwrap();
    let inv = s.inventory().to_vec();
    assert_eq!(inv.len(), 1);
    assert_eq!(inv[0].model_name, "NVIDIA H200");
    assert_eq!(inv[0].uuid, "GPU-96f83dad-fa89-397a-6766-ab4796b05e39");
    assert_eq!(inv[0].driver_version, "580.159.04");
    let polls = drain(&mut s);
    assert_eq!(polls.len(), 108);
    let get = |p: &(i64, Vec<Reading>), m: Metric| {
        p.1.iter()
            .find(|r| r.metric == m && r.label.is_none())
            .map(|r| r.value)
    };
    // 45 fields a poll; GPM (DCGM_FI_PROF_*, 10 of them) from the second on.
    assert_eq!(polls[0].1.len(), 35);
    assert!(polls[1..].iter().all(|p| p.1.len() == 45));

    // nvidia-smi, read within 10 ms of each poll.
    let smi = h200_table("nvidia-smi.csv");
    assert!(smi.len() >= 100);
    let mut compared = 0;
    for row in &smi {
        let t: i64 = row["timestamp_ms"].parse().unwrap();
        let Some(p) = polls.iter().find(|p| (p.0 - t).abs() <= 10) else {
            continue;
        };
        let smi_v = |c: &str| row[c].parse::<f64>().unwrap();
        let agent_v = |m| get(p, m).unwrap();
        // Both read NVML's one-second power average; nvidia-smi prints 10 mW.
        let dp = agent_v(Metric::PowerUsage) - smi_v("power.draw");
        assert!(dp.abs() <= 0.05, "power at {t}: {dp} W");
        for (m, c) in [
            (Metric::GpuTemp, "temperature.gpu"),
            (Metric::SmClock, "clocks.sm"),
            (Metric::MemClock, "clocks.mem"),
            (Metric::GpuUtil, "utilization.gpu"),
            (Metric::MemCopyUtil, "utilization.memory"),
        ] {
            assert_eq!(agent_v(m), smi_v(c), "{c} at {t}");
        }
        // MiB: DCGM floors, nvidia-smi rounds.
        for (m, c) in [
            (Metric::FbUsed, "memory.used"),
            (Metric::FbFree, "memory.free"),
            (Metric::FbReserved, "memory.reserved"),
        ] {
            assert!((agent_v(m) - smi_v(c)).abs() <= 1.0, "{c} at {t}");
        }
        compared += 1;
    }
    assert!(compared >= 100, "{compared} polls compared");

    // The energy counter (mJ) advances by the integral of power (W).
    let (first, last) = (&polls[0], &polls[polls.len() - 1]);
    let energy_j = (get(last, Metric::TotalEnergyConsumption).unwrap()
        - get(first, Metric::TotalEnergyConsumption).unwrap())
        / 1000.0;
    let integral_j: f64 = polls
        .windows(2)
        .map(|w| {
            let dt = (w[1].0 - w[0].0) as f64 / 1000.0;
            dt * (get(&w[0], Metric::PowerUsage).unwrap() + get(&w[1], Metric::PowerUsage).unwrap())
                / 2.0
        })
        .sum();
    assert!(
        (energy_j / integral_j - 1.0).abs() < 0.01,
        "{energy_j} J vs {integral_j} J"
    );

    // The load: from 3 s into each phase (GPM reports the last second).
    let phases = h200_table("phases.csv");
    assert_eq!(phases.len(), 5);
    for ph in &phases {
        let start: i64 = ph["start_ms"].parse().unwrap();
        let end: i64 = ph["end_ms"].parse().unwrap();
        let inside: Vec<_> = polls
            .iter()
            .filter(|p| p.0 >= start + 3000 && p.0 <= end)
            .collect();
        assert!(
            inside.len() >= 10,
            "{}: {} polls",
            ph["phase"],
            inside.len()
        );
        for p in inside {
            let v = |m| get(p, m).unwrap();
            let (gr, tensor, dram) = (
                v(Metric::GrEngineActive),
                v(Metric::PipeTensorActive),
                v(Metric::DramActive),
            );
            let gib = v(Metric::FbUsed) / 1024.0;
            let what = format!(
                "{} at {}: gr {gr} tensor {tensor} dram {dram} fb {gib} GiB",
                ph["phase"], p.0
            );
            match ph["phase"].as_str() {
                "matmul_bf16" => {
                    assert!(gr > 0.9 && tensor > 0.5, "{what}");
                    // 700 W board: the SW power cap holds clocks down.
                    assert_eq!(v(Metric::ClockThrottleReasons), 4.0, "{what}");
                }
                "hbm_copy" => assert!(gr > 0.9 && tensor == 0.0 && dram > 0.5, "{what}"),
                "hold_100gib" => assert!(gr < 0.01 && gib >= 100.0, "{what}"),
                "idle" | "idle_after" => assert!(gr < 0.01 && gib < 10.0, "{what}"),
                other => panic!("unknown phase {other}"),
            }
        }
    }
}
