//! Issue #5's query targets on a simulated fleet history, with the commands
//! and results in docs/BENCHMARKS.md ("Rollups and SQL").
//!
//!   cargo bench --profile perf --bench rollup_queries
//!
//! Builds (or reuses, when its `COMPLETE` marker matches the parameters) a
//! history in `$GPULSE_BENCH_DIR` (default `/tmp/gpulse-bench/history`):
//!
//! - 10,000 GPUs (8 per host, 4 hosts per rack, 10 racks per row, one
//!   cluster; the shape of `storage/benches/append.rs`), 20 dcgm-exporter
//!   metrics: 200,000 series;
//! - rollups imported through `Storage::import_rollups`, one import (one
//!   rollup file) per metric, every level: day records for 365 days, hour
//!   records for the last 30 days, minute records for the 3 hours before the
//!   raw hour, each as if folded from 1 Hz samples (hours are merged from
//!   their minutes, days from their hours where both exist);
//! - raw samples for the last hour every 10 s, every series, appended through
//!   `Storage::append` (one 200,000-sample batch per poll, as ingest does)
//!   and flushed once at the end: 72 M samples. Their rollups come from the
//!   append path. 1 Hz (720 M samples) was tried: each flush of the 200,000
//!   series' rollups took minutes on the 2-core VM (see BENCHMARKS.md).
//!
//! Then it times each target query `GPULSE_BENCH_REPS` times (default 20;
//! scans `GPULSE_BENCH_SCAN_REPS`, default 3) through `Storage` directly and
//! through `QueryEngine::sql`, and prints median and p95. The SQL over the
//! `rollup_1h`/`rollup_1d` tables is reported as unavailable when the build
//! has no such tables. Other shapes: `GPULSE_BENCH_GPUS`,
//! `GPULSE_BENCH_RAW_INTERVAL_S`, `GPULSE_BENCH_FLUSH_S`,
//! `GPULSE_BENCH_MINUTE_HOURS`. `GPULSE_BENCH_QUERIES` (e.g. `1,3`) times
//! only those of the four queries (1 rack temperature per hour, 2 fleet power
//! per day, 3 one GPU's raw hour, 4 the full scan), for profiling one.

// A benchmark reports to stdout.
#![allow(clippy::print_stdout)]

use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use arrow::array::{Array, Float64Array, Int64Array};
use query::{QueryEngine, QueryError, ResultLimits};
use storage::{
    Label, Matcher, RecordFields, RollupFilter, RollupGroup, RollupLevel, RollupRecord, RollupTier,
    SeriesKey, SeriesRef, Storage, StorageConfig,
};

/// End of the history: 2026-11-30T00:00:00Z. Raw samples cover the hour before.
const T_END: i64 = 1_795_996_800_000;
const HOUR: i64 = 3_600_000;
const DAY: i64 = 86_400_000;
const T_RAW: i64 = T_END - HOUR;
const DAY_DAYS: i64 = 365;
const HOUR_DAYS: i64 = 30;

/// (name, low, high, resolution): plausible dcgm-exporter ranges on an H100.
const METRICS: [(&str, f64, f64, f64); 20] = [
    ("DCGM_FI_DEV_GPU_TEMP", 30.0, 85.0, 1.0),
    ("DCGM_FI_DEV_MEMORY_TEMP", 30.0, 95.0, 1.0),
    ("DCGM_FI_DEV_POWER_USAGE", 60.0, 700.0, 0.001),
    ("DCGM_FI_DEV_GPU_UTIL", 0.0, 100.0, 1.0),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", 0.0, 100.0, 1.0),
    ("DCGM_FI_DEV_ENC_UTIL", 0.0, 100.0, 1.0),
    ("DCGM_FI_DEV_DEC_UTIL", 0.0, 100.0, 1.0),
    ("DCGM_FI_DEV_SM_CLOCK", 345.0, 1980.0, 15.0),
    ("DCGM_FI_DEV_MEM_CLOCK", 1593.0, 2619.0, 1.0),
    ("DCGM_FI_DEV_FB_USED", 0.0, 81559.0, 1.0),
    ("DCGM_FI_DEV_FB_FREE", 0.0, 81559.0, 1.0),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 0.0, 10.0, 1.0),
    ("DCGM_FI_DEV_XID_ERRORS", 0.0, 1.0, 1.0),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 0.0, 900000.0, 1.0),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.0, 1.0, 0.000001),
    ("DCGM_FI_PROF_SM_ACTIVE", 0.0, 1.0, 0.000001),
    ("DCGM_FI_PROF_SM_OCCUPANCY", 0.0, 1.0, 0.000001),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 0.0, 1.0, 0.000001),
    ("DCGM_FI_PROF_DRAM_ACTIVE", 0.0, 1.0, 0.000001),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", 0.0, 2.5e10, 1.0),
];
const TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
const POWER: &str = "DCGM_FI_DEV_POWER_USAGE";

#[derive(Debug, Clone, PartialEq)]
struct Params {
    dir: PathBuf,
    gpus: u64,
    raw_interval_s: i64,
    flush_every_s: i64,
    minute_hours: i64,
    reps: usize,
    scan_reps: usize,
    /// Which of the four queries to time (`GPULSE_BENCH_QUERIES`).
    queries: [bool; 4],
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> anyhow::Result<T> {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .map_err(|_| anyhow::anyhow!("{name}={v:?} does not parse")),
        Err(_) => Ok(default),
    }
}

/// `1,3` as `[true, false, true, false]`.
fn queries_of(list: &str) -> anyhow::Result<[bool; 4]> {
    let mut on = [false; 4];
    for q in list.split(',') {
        match q.trim().parse::<usize>() {
            Ok(n @ 1..=4) => on[n - 1] = true,
            _ => bail!("GPULSE_BENCH_QUERIES={list:?}: a comma-separated list of 1 to 4"),
        }
    }
    Ok(on)
}

impl Params {
    fn from_env() -> anyhow::Result<Self> {
        let p = Self {
            dir: env_or(
                "GPULSE_BENCH_DIR",
                PathBuf::from("/tmp/gpulse-bench/history"),
            )?,
            gpus: env_or("GPULSE_BENCH_GPUS", 10_000)?,
            raw_interval_s: env_or("GPULSE_BENCH_RAW_INTERVAL_S", 10)?,
            flush_every_s: env_or("GPULSE_BENCH_FLUSH_S", 3600)?,
            minute_hours: env_or("GPULSE_BENCH_MINUTE_HOURS", 3)?,
            reps: env_or("GPULSE_BENCH_REPS", 20)?,
            scan_reps: env_or("GPULSE_BENCH_SCAN_REPS", 3)?,
            queries: queries_of(&env_or("GPULSE_BENCH_QUERIES", "1,2,3,4".to_string())?)?,
        };
        if p.gpus == 0 || !p.gpus.is_multiple_of(8) {
            bail!("GPULSE_BENCH_GPUS must be a positive multiple of 8");
        }
        if !(1..=3600).contains(&p.raw_interval_s)
            || !(1..=3600).contains(&p.flush_every_s)
            || !(0..=23).contains(&p.minute_hours)
        {
            bail!(
                "GPULSE_BENCH_RAW_INTERVAL_S and GPULSE_BENCH_FLUSH_S must be 1..=3600, GPULSE_BENCH_MINUTE_HOURS 0..=23"
            );
        }
        if p.reps == 0 || p.scan_reps == 0 {
            bail!("repetitions must be at least 1");
        }
        Ok(p)
    }

    /// What the history on disk was built with (the `COMPLETE` marker).
    fn marker(&self) -> String {
        format!(
            "gpus={} metrics={} raw_interval_s={} flush_every_s={} minute_hours={} day_days={DAY_DAYS} hour_days={HOUR_DAYS} t_end={T_END} v1\n",
            self.gpus,
            METRICS.len(),
            self.raw_interval_s,
            self.flush_every_s,
            self.minute_hours
        )
    }
}

/// Topology of GPU `g`: (host, gpu on host, rack, row).
fn topo(g: u64) -> (u64, u64, u64, u64) {
    let host = g / 8;
    (host, g % 8, host / 4, host / 40)
}

fn hostname(host: u64) -> String {
    format!("gpu-node-{host:05}")
}

fn group(g: u64, metric: &str) -> RollupGroup {
    let (host, gpu, rack, row) = topo(g);
    RollupGroup {
        metric: metric.to_string(),
        cluster: "prod-1".into(),
        row: format!("row-{row:02}"),
        rack: format!("rack-{rack:03}"),
        host: hostname(host),
        gpu: gpu.to_string(),
    }
}

/// A dcgm-exporter label set, with the topology labels the ingest adds.
fn key(g: u64, metric: &str) -> SeriesKey {
    let (host, gpu, rack, row) = topo(g);
    SeriesKey::new(
        metric,
        vec![
            Label::new("gpu", gpu.to_string()),
            Label::new(
                "UUID",
                format!("GPU-{host:08x}-{gpu:04x}-4c22-9d1e-5a0f3b2c{gpu:04x}"),
            ),
            Label::new("pci_bus_id", format!("00000000:{:02X}:00.0", 0x18 + gpu)),
            Label::new("device", format!("nvidia{gpu}")),
            Label::new("modelName", "NVIDIA H100 80GB HBM3"),
            Label::new("Hostname", hostname(host)),
            Label::new("DCGM_FI_DRIVER_VERSION", "550.54.15"),
            Label::new("cluster", "prod-1"),
            Label::new("row", format!("row-{row:02}")),
            Label::new("rack", format!("rack-{rack:03}")),
        ],
    )
    .expect("valid key")
}

/// splitmix64: a stateless, seeded source of randomness.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn unit(x: u64) -> f64 {
    (mix(x) >> 11) as f64 / (1u64 << 53) as f64
}

fn quantize(v: f64, lo: f64, hi: f64, res: f64) -> f64 {
    ((v.clamp(lo, hi) / res).round() * res).clamp(lo, hi)
}

/// Series id for the generator: GPU and metric index.
fn sid(g: u64, m: usize) -> u64 {
    g * 64 + m as u64
}

/// The record of one window of series `s`, as if folded from 1 Hz samples.
fn gen_record(s: u64, m: usize, tier: RollupTier, ws: i64) -> RollupRecord {
    let (_, lo, hi, res) = METRICS[m];
    let span = hi - lo;
    let base = lo + span * (0.2 + 0.6 * unit(s));
    let seed = s ^ (ws as u64).rotate_left(17) ^ (tier as u64) << 60;
    let mean = (base + span * 0.2 * (unit(seed) - 0.5)).clamp(lo, hi);
    let min = quantize(mean - span * 0.1 * unit(seed + 1), lo, hi, res).min(mean);
    let max = quantize(mean + span * 0.1 * unit(seed + 2), lo, hi, res).max(mean);
    let pick = |k: u64| quantize(min + (max - min) * unit(seed + k), min, max, res);
    let count = (tier.window_ms() / 1000) as u64;
    RollupRecord {
        window_start_ms: ws,
        count,
        sum: mean * count as f64,
        min,
        max,
        first: pick(3),
        first_ts_ms: ws,
        last: pick(4),
        last_ts_ms: ws + tier.window_ms() - 1000,
    }
}

fn merge_all(ws: i64, parts: &[RollupRecord]) -> RollupRecord {
    let mut r = parts[0];
    for p in &parts[1..] {
        r.merge(p);
    }
    r.window_start_ms = ws;
    r
}

/// The imported records of one GPU's metric: (day, hour, minute) records.
fn history_of(p: &Params, g: u64, m: usize) -> [Vec<RollupRecord>; 3] {
    let s = sid(g, m);
    let minute_from = T_RAW - p.minute_hours * HOUR;
    let hour_from = T_END - HOUR_DAYS * DAY;
    let minutes: Vec<RollupRecord> = (minute_from..T_RAW)
        .step_by(60_000)
        .map(|ws| gen_record(s, m, RollupTier::Minute, ws))
        .collect();
    let hours: Vec<RollupRecord> = (hour_from..T_RAW)
        .step_by(HOUR as usize)
        .map(|ws| {
            if ws >= minute_from {
                let i = ((ws - minute_from) / 60_000) as usize;
                merge_all(ws, &minutes[i..i + 60])
            } else {
                gen_record(s, m, RollupTier::Hour, ws)
            }
        })
        .collect();
    let days: Vec<RollupRecord> = (T_END - DAY_DAYS * DAY..T_END)
        .step_by(DAY as usize)
        .map(|ws| {
            if ws >= hour_from {
                let i = ((ws - hour_from) / HOUR) as usize;
                merge_all(ws, &hours[i..(i + 24).min(hours.len())])
            } else {
                gen_record(s, m, RollupTier::Day, ws)
            }
        })
        .collect();
    [days, hours, minutes]
}

fn config(p: &Params) -> StorageConfig {
    let mut cfg = StorageConfig::new(&p.dir);
    // Nothing in the history expires or is too old for the head while it is built.
    cfg.retention = None;
    cfg
}

fn build(p: &Params) -> anyhow::Result<()> {
    let started = Instant::now();
    if p.dir.exists() {
        std::fs::remove_dir_all(&p.dir).with_context(|| format!("clearing {}", p.dir.display()))?;
    }
    std::fs::create_dir_all(&p.dir)?;
    let st = Storage::open(config(p))?;
    println!(
        "building the history in {}: {} GPUs x {} metrics",
        p.dir.display(),
        p.gpus,
        METRICS.len()
    );
    let mut imported = (0u64, 0u64, 0u64);
    for (m, (name, ..)) in METRICS.iter().enumerate() {
        let t = Instant::now();
        let items = (0..p.gpus).flat_map(|g| {
            let grp = group(g, name);
            let [d, h, mi] = history_of(p, g, m);
            [
                (RollupTier::Day, grp.clone(), d),
                (RollupTier::Hour, grp.clone(), h),
                (RollupTier::Minute, grp, mi),
            ]
        });
        let s = st.import_rollups(items)?;
        imported.0 += s.gpu_records;
        imported.1 += s.records;
        imported.2 += s.bytes;
        println!(
            "  import {:2}/{} {name}: {} gpu-level records, {} over all levels, {:.0} MB, {:.1} s",
            m + 1,
            METRICS.len(),
            s.gpu_records,
            s.records,
            s.bytes as f64 / 1e6,
            t.elapsed().as_secs_f64()
        );
    }
    println!(
        "imported {} gpu-level records ({} over all levels, {:.2} GB) in {:.0} s",
        imported.0,
        imported.1,
        imported.2 as f64 / 1e9,
        started.elapsed().as_secs_f64()
    );

    // Raw: the last hour, every series, one batch per poll.
    let t = Instant::now();
    let mut refs: Vec<SeriesRef> = Vec::new();
    let mut state: Vec<f64> = Vec::new();
    let mut metric_of: Vec<usize> = Vec::new();
    for g in 0..p.gpus {
        for (m, (name, lo, hi, res)) in METRICS.iter().enumerate() {
            refs.push(st.series_ref(key(g, name))?);
            state.push(quantize(
                lo + (hi - lo) * (0.2 + 0.6 * unit(sid(g, m))),
                *lo,
                *hi,
                *res,
            ));
            metric_of.push(m);
        }
    }
    println!(
        "  {} series created in {:.1} s",
        refs.len(),
        t.elapsed().as_secs_f64()
    );
    let n = refs.len();
    let mut vals = vec![0.0; n];
    let mut appended = 0u64;
    let t = Instant::now();
    for (k, sec) in (0..3600).step_by(p.raw_interval_s as usize).enumerate() {
        let ts = T_RAW + sec * 1000;
        for (i, v) in vals.iter_mut().enumerate() {
            let (_, lo, hi, res) = METRICS[metric_of[i]];
            // A random walk at the sensor's resolution; most polls repeat.
            let r = mix((i as u64) << 20 ^ k as u64);
            let step = match r % 8 {
                0 => -1.0,
                1 => 1.0,
                _ => 0.0,
            } * ((hi - lo) * 0.002).max(res);
            state[i] = quantize(state[i] + step, lo, hi, res);
            *v = state[i];
        }
        let out = st.append(&refs, &vec![ts; n], &vals)?;
        appended += out.accepted as u64;
        let done_s = sec + p.raw_interval_s;
        if done_s % 600 < p.raw_interval_s {
            println!(
                "  raw: {done_s} s of 3600 appended, {:.1} M samples, {:.2} M samples/s (flushes included)",
                appended as f64 / 1e6,
                appended as f64 / 1e6 / t.elapsed().as_secs_f64()
            );
        }
        if done_s % p.flush_every_s < p.raw_interval_s {
            let tf = Instant::now();
            st.flush()?;
            println!("  flush: {:.1} s", tf.elapsed().as_secs_f64());
        }
    }
    st.flush()?;
    let stats = st.stats();
    println!(
        "raw: {} samples in {} segments ({:.2} B/sample), {:.0} s; rollup files: {}; total build {:.0} s",
        stats.segment_samples,
        stats.segments,
        stats.segment_bytes as f64 / stats.segment_samples.max(1) as f64,
        t.elapsed().as_secs_f64(),
        st.rollup_files(),
        started.elapsed().as_secs_f64()
    );
    drop(st);
    std::fs::write(p.dir.join("COMPLETE"), p.marker())?;
    Ok(())
}

/// Runs `f` `reps` times; returns (median, p95) in ms and the last result.
fn time<T>(reps: usize, mut f: impl FnMut() -> T) -> (f64, f64, T) {
    let mut ms = Vec::with_capacity(reps);
    let mut last = None;
    for _ in 0..reps {
        let t = Instant::now();
        let out = black_box(f());
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        last = Some(out);
    }
    ms.sort_by(f64::total_cmp);
    let p95 = ms[((reps as f64 * 0.95).ceil() as usize).clamp(1, reps) - 1];
    (ms[reps / 2], p95, last.expect("reps >= 1"))
}

fn report(what: &str, target: &str, (median, p95): (f64, f64), detail: &str) {
    println!("| {what} | {median:.2} | {p95:.2} | {target} | {detail} |");
}

fn ts_literal(ms: i64) -> String {
    format!("to_timestamp_millis({ms})")
}

/// Reports a [`time_sql`] result: its row count, or why the table is not available.
fn report_sql(what: &str, target: &str, timed: Result<(f64, f64, query::QueryResult), String>) {
    match timed {
        Ok((m, p95, out)) => report(what, target, (m, p95), &format!("{} rows", out.num_rows())),
        Err(e) => println!("| {what} | - | - | {target} | not available: {e} |"),
    }
}

/// Runs `sql` `reps` times; `None` (with the reason) when the build lacks the table.
fn time_sql(
    rt: &tokio::runtime::Runtime,
    engine: &QueryEngine,
    reps: usize,
    sql: &str,
) -> anyhow::Result<Result<(f64, f64, query::QueryResult), String>> {
    match rt.block_on(engine.sql(sql)) {
        Err(QueryError::BadQuery(e)) => return Ok(Err(e.to_string())),
        Err(e) => return Err(e.into()),
        Ok(_) => {}
    }
    let (median, p95, out) = time(reps, || rt.block_on(engine.sql(sql)));
    Ok(Ok((median, p95, out?)))
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; this harness takes no arguments.
    let p = Params::from_env()?;
    let marker = std::fs::read_to_string(p.dir.join("COMPLETE")).ok();
    if marker.as_deref() == Some(p.marker().as_str()) {
        println!(
            "reusing the history in {} ({})",
            p.dir.display(),
            p.marker().trim()
        );
    } else {
        build(&p)?;
    }
    let t = Instant::now();
    let st = Arc::new(Storage::open(config(&p))?);
    println!(
        "opened in {:.1} s: {} rollup files, {} segments, {} raw samples",
        t.elapsed().as_secs_f64(),
        st.rollup_files(),
        st.stats().segments,
        st.stats().segment_samples
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let engine = QueryEngine::with_limits(
        st.clone(),
        ResultLimits {
            max_rows: u64::MAX,
            max_bytes: u64::MAX,
        },
    );
    rt.block_on(async {
        engine
            .context()
            .sql("SET datafusion.execution.target_partitions = 1")
            .await?
            .collect()
            .await
    })?;
    let racks = p.gpus.div_ceil(32);
    let (reps, scan_reps) = (p.reps, p.scan_reps);
    println!();
    println!("| query | median ms | p95 ms | target | result |");
    println!("| --- | --- | --- | --- | --- |");

    // 1. Average GPU temperature per rack per hour over 30 days.
    if p.queries[0] {
        let from = T_END - HOUR_DAYS * DAY;
        let filter = RollupFilter {
            metric: Some(TEMP.into()),
            ..Default::default()
        };
        let (m, p95, out) = time(reps, || {
            st.select_rollups(
                RollupTier::Hour,
                RollupLevel::Rack,
                &filter,
                from,
                T_END - 1,
            )
        });
        let records: usize = out.iter().map(|(_, r)| r.len()).sum();
        if out.len() as u64 != racks || records as u64 != racks * (HOUR_DAYS * 24) as u64 {
            bail!("query 1 returned {} racks, {records} records", out.len());
        }
        report(
            "temperature per rack per hour, 30 d: `select_rollups`",
            "< 50 ms",
            (m, p95),
            &format!("{} racks x {} hours", out.len(), records / out.len()),
        );
        // What the SQL below reads: the window, count and sum columns only.
        let sum_only = RecordFields {
            sum: true,
            ..RecordFields::NONE
        };
        let (m, p95, out) = time(reps, || {
            st.select_rollup_fields(
                RollupTier::Hour,
                RollupLevel::Rack,
                &filter,
                (from, T_END - 1),
                sum_only,
            )
        });
        let records: usize = out.iter().map(|(_, r)| r.len()).sum();
        if records as u64 != racks * (HOUR_DAYS * 24) as u64 {
            bail!("query 1 (sum only) returned {records} records");
        }
        report(
            "same, the fields an average needs: `select_rollup_fields`",
            "",
            (m, p95),
            &format!("{records} records"),
        );
        let sql = format!(
            "SELECT ts, rack, avg FROM rollup_1h WHERE level = 'rack' AND metric = '{TEMP}' AND ts >= {} AND ts < {}",
            ts_literal(from),
            ts_literal(T_END)
        );
        report_sql(
            "same, SQL on `rollup_1h`",
            "< 50 ms",
            time_sql(&rt, &engine, reps, &sql)?,
        );
    }

    // 2. Cluster-wide power per day over a year.
    if p.queries[1] {
        let filter = RollupFilter {
            metric: Some(POWER.into()),
            ..Default::default()
        };
        let from = T_END - DAY_DAYS * DAY;
        let (m, p95, out) = time(reps, || {
            st.select_rollups(
                RollupTier::Day,
                RollupLevel::Cluster,
                &filter,
                from,
                T_END - 1,
            )
        });
        let records: usize = out.iter().map(|(_, r)| r.len()).sum();
        if records as i64 != DAY_DAYS {
            bail!("query 2 returned {records} records");
        }
        let mean_total_kw =
            out[0].1.iter().map(|r| r.avg()).sum::<f64>() / records as f64 * p.gpus as f64 / 1e3;
        report(
            "cluster power per day, 365 d: `select_rollups`",
            "< 20 ms",
            (m, p95),
            &format!("{records} days, mean fleet power {mean_total_kw:.0} kW"),
        );
        let sql = format!(
            "SELECT ts, avg, sum, count FROM rollup_1d WHERE level = 'cluster' AND metric = '{POWER}' AND ts >= {} AND ts < {}",
            ts_literal(from),
            ts_literal(T_END)
        );
        report_sql(
            "same, SQL on `rollup_1d`",
            "< 20 ms",
            time_sql(&rt, &engine, reps, &sql)?,
        );
    }

    // 3. Raw samples of one GPU for the last hour.
    if p.queries[2] {
        let (host, gpu, ..) = topo(p.gpus / 2 + 3);
        let matchers = [
            Matcher::equal("Hostname", hostname(host)),
            Matcher::equal("gpu", gpu.to_string()),
        ];
        let (m, p95, n) = time(reps, || {
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            for s in st.select(&matchers, T_RAW, T_END - 1) {
                s.read_into(T_RAW, T_END - 1, &mut ts, &mut vs)
                    .expect("segments decode");
            }
            ts.len()
        });
        let want = METRICS.len() as i64 * 3600 / p.raw_interval_s;
        if n as i64 != want {
            bail!("query 3 read {n} samples, expected {want}");
        }
        report(
            "raw samples of one GPU, last hour: `select` + `read_into`",
            "< 10 ms",
            (m, p95),
            &format!("{n} samples"),
        );
        let sql = format!(
            "SELECT ts, metric, value FROM samples WHERE host = '{}' AND gpu = '{gpu}' AND ts >= {} AND ts < {}",
            hostname(host),
            ts_literal(T_RAW),
            ts_literal(T_END)
        );
        let (m, p95, out) = match time_sql(&rt, &engine, reps, &sql)? {
            Ok(r) => r,
            Err(e) => bail!("query 3 SQL: {e}"),
        };
        if out.num_rows() != n {
            bail!("query 3 SQL returned {} rows, expected {n}", out.num_rows());
        }
        report(
            "same, SQL on `samples`",
            "< 10 ms",
            (m, p95),
            &format!("{} rows", out.num_rows()),
        );
    }

    // 4. Full raw scan aggregate, one core.
    if p.queries[3] {
        let (m, p95, (sum, n)) = time(scan_reps, || {
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            let (mut sum, mut n) = (0.0f64, 0u64);
            for s in st.select(&[], i64::MIN, i64::MAX) {
                ts.clear();
                vs.clear();
                s.read_into(i64::MIN, i64::MAX, &mut ts, &mut vs)
                    .expect("segments decode");
                sum += vs.iter().sum::<f64>();
                n += vs.len() as u64;
            }
            (sum, n)
        });
        report(
            "full raw scan, sum + count: `select` + `read_into`, one core",
            ">= 100 M samples/s",
            (m, p95),
            &format!(
                "{n} samples, {:.1} M samples/s (median)",
                n as f64 / m / 1e3
            ),
        );
        let sql = "SELECT sum(value), count(*) FROM samples";
        let (m, p95, out) = match time_sql(&rt, &engine, scan_reps, sql)? {
            Ok(r) => r,
            Err(e) => bail!("query 4 SQL: {e}"),
        };
        let batch = &out.batches[0];
        let sql_sum = batch
            .column(0)
            .as_any()
            .downcast_ref::<Float64Array>()
            .map(|a| a.value(0));
        let sql_n = batch
            .column(1)
            .as_any()
            .downcast_ref::<Int64Array>()
            .map(|a| a.value(0));
        if sql_n != Some(n as i64) || sql_sum.is_none_or(|s| (s - sum).abs() > 1e-9 * sum.abs()) {
            bail!("query 4 SQL: {sql_sum:?}, {sql_n:?} vs storage {sum}, {n}");
        }
        report(
            "same, SQL `SELECT sum(value), count(*) FROM samples`, target_partitions = 1",
            ">= 100 M samples/s",
            (m, p95),
            &format!("{:.1} M samples/s (median)", n as f64 / m / 1e3),
        );
    }

    Ok(())
}
