//! The real recordings in `shared/data/real` (H100 at 10 Hz: t13 training,
//! b1 model loaded but idle), read as polls for tests. Never copied into the
//! repository: read from beside it.

use std::path::PathBuf;

use crate::{Field, Poll};

/// `shared/data/real` seen from this crate (never copied into the repo), or
/// `GPULSE_REAL_DATA`, as in `agent/src/replay/tests.rs`.
pub(crate) fn real_data_dir() -> PathBuf {
    std::env::var_os("GPULSE_REAL_DATA")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../../shared/data/real"
            ))
        })
}

pub(crate) const T13: &str = "atharvanihalani__gpu-telemetry-exploration/t13_node0_telemetry.csv";
pub(crate) const B1: &str = "atharvanihalani__gpu-telemetry-exploration/b1_telemetry.csv";

/// Each GPU's polls of a recording (index = GPU), or `None` if the file is
/// absent. Columns, per the data set's README: `timestamp` (s, 3 decimals),
/// `gpu`, `power_w`, `temp_c`, `gpu_util_pct`, `sm_active`, `energy_mj`. It
/// has no SM clock and no GR_ENGINE_ACTIVE. Blank cells stay missing.
pub(crate) fn load(name: &str) -> Option<Vec<Vec<Poll>>> {
    let path = real_data_dir().join(name);
    let text = std::fs::read_to_string(&path).ok()?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next()?.split(',').collect();
    let col = |n: &str| {
        header
            .iter()
            .position(|h| *h == n)
            .unwrap_or_else(|| panic!("{}: no column {n}", path.display()))
    };
    let (ts_col, gpu_col) = (col("timestamp"), col("gpu"));
    let fields = [
        (col("power_w"), Field::PowerUsage),
        (col("temp_c"), Field::GpuTemp),
        (col("gpu_util_pct"), Field::GpuUtil),
        (col("sm_active"), Field::ProfSmActive),
        (col("energy_mj"), Field::TotalEnergyConsumption),
    ];
    let mut gpus: Vec<Vec<Poll>> = Vec::new();
    for line in lines {
        let cells: Vec<&str> = line.split(',').collect();
        assert_eq!(cells.len(), header.len(), "{line}");
        let ts_s: f64 = cells[ts_col].parse().unwrap();
        let gpu: usize = cells[gpu_col].parse().unwrap();
        let mut p = Poll::new((ts_s * 1_000.0).round() as i64);
        for (c, f) in fields {
            if !cells[c].is_empty() {
                p.set(f, cells[c].parse().unwrap());
            }
        }
        if gpus.len() <= gpu {
            gpus.resize(gpu + 1, Vec::new());
        }
        gpus[gpu].push(p);
    }
    Some(gpus)
}

/// True (and says so) when the recording is absent, so the test is skipped.
pub(crate) fn skip(name: &str) -> bool {
    let path = real_data_dir().join(name);
    if path.exists() {
        return false;
    }
    #[allow(clippy::print_stdout)] // the skip note
    {
        println!("skipped: {} is absent", path.display());
    }
    true
}

/// The trace `gpulse-agent --record` wrote on a real H200 under load
/// (`tests/data/h200`, in the repository: idle, bf16 matmul at the 700 W
/// power cap, HBM copy, 100 GiB held, idle), as one GPU's polls at 1 Hz.
/// Rows are `metric=NAME;labels,timestamp_ms,value` after a header; fields
/// the detectors do not read are left out.
pub(crate) fn load_h200() -> Vec<Poll> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/data/h200/trace.csv.zst"
    );
    let packed = std::fs::read(path).unwrap();
    let text = String::from_utf8(zstd::decode_all(&packed[..]).unwrap()).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("labels,timestamp_ms,value"));
    let mut polls: Vec<Poll> = Vec::new();
    for line in lines {
        let mut f = line.rsplitn(3, ',');
        let value: f64 = f.next().unwrap().parse().unwrap();
        let ts_ms: i64 = f.next().unwrap().parse().unwrap();
        let labels = f.next().unwrap();
        let metric = labels
            .split(';')
            .next()
            .unwrap()
            .strip_prefix("metric=")
            .unwrap();
        if polls.last().is_none_or(|p| p.ts_ms != ts_ms) {
            polls.push(Poll::new(ts_ms));
        }
        polls.last_mut().unwrap().set_by_name(metric, value);
    }
    polls
}
