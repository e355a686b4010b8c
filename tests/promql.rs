//! Differential PromQL: one data set loaded into a real Prometheus 2.42
//! (`promtool tsdb create-blocks-from openmetrics`) and into gpulse
//! (`gpulse import`); every expression is run against both HTTP APIs,
//! instant and range, and the answers must agree: the same series label
//! sets, the same timestamps, values within 1e-9 relative (NaN equals NaN).
//!
//! Skipped, with a message, only where `/usr/bin/prometheus` is missing
//! (`.ci/run` installs it).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::support::Node;

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";
/// First sample, Unix seconds (2023-11-14T22:13:20Z).
const T0: i64 = 1_700_000_000;
/// One hour of samples at a 15 s interval, with millisecond jitter.
const STEPS: i64 = 240;

/// xorshift64*: a fixed data set on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct DataSeries {
    metric: String,
    labels: Vec<(String, String)>,
    samples: Vec<(i64, f64)>,
}

/// 2 hosts x 4 GPUs with dcgm-exporter <= 4.8.2 labels (`Hostname`, `UUID`)
/// and 1 host x 2 GPUs with >= 4.8.3 labels (`hostname`, `uuid`), whose GPU 1
/// stops reporting after 40 minutes. Gauges, an energy counter with a reset,
/// a classic histogram and a per-host info series.
fn data_set() -> Vec<DataSeries> {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut out = Vec::new();
    let gpus: Vec<(&str, u32, bool)> = (0..4)
        .map(|g| ("h1", g, false))
        .chain((0..4).map(|g| ("h2", g, false)))
        .chain((0..2).map(|g| ("h3", g, true)))
        .collect();
    let times: Vec<i64> = {
        let mut r = Rng(7);
        (0..STEPS)
            .map(|i| (T0 + i * 15) * 1000 + (r.next() % 400) as i64)
            .collect()
    };
    let metrics = [
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    ];
    for metric in metrics {
        for &(host, gpu, new_labels) in &gpus {
            let (host_label, uuid_label) = if new_labels {
                ("hostname", "uuid")
            } else {
                ("Hostname", "UUID")
            };
            let mut labels = vec![
                ("gpu".to_string(), gpu.to_string()),
                (uuid_label.to_string(), format!("GPU-{host}-{gpu:04}")),
                ("device".to_string(), format!("nvidia{gpu}")),
                (
                    "modelName".to_string(),
                    if host == "h2" {
                        "NVIDIA A100-SXM4-80GB".to_string()
                    } else {
                        "NVIDIA H100 80GB HBM3".to_string()
                    },
                ),
                (host_label.to_string(), host.to_string()),
                ("instance".to_string(), format!("{host}:9400")),
                ("job".to_string(), "dcgm".to_string()),
            ];
            labels.sort();
            let stop = if host == "h3" && gpu == 1 {
                160
            } else {
                STEPS as usize
            };
            let mut samples = Vec::with_capacity(stop);
            let mut level = rng.unit();
            let mut energy = 1.0e6 * rng.unit();
            for (i, &t) in times.iter().take(stop).enumerate() {
                level = (level + (rng.unit() - 0.5) * 0.2).clamp(0.0, 1.0);
                let v = match metric {
                    "DCGM_FI_DEV_GPU_UTIL" => (level * 100.0).round(),
                    "DCGM_FI_DEV_FB_USED" => (level * 80_000.0).round(),
                    "DCGM_FI_DEV_FB_FREE" => (81_559.0 - level * 80_000.0).round(),
                    "DCGM_FI_DEV_GPU_TEMP" => (35.0 + level * 45.0).round(),
                    "DCGM_FI_DEV_POWER_USAGE" => 60.0 + level * 600.0 + rng.unit(),
                    "DCGM_FI_DEV_SM_CLOCK" => (1_980.0 - (level * 4.0).floor() * 100.0).round(),
                    "DCGM_FI_DEV_MEM_CLOCK" => 2_619.0,
                    "DCGM_FI_PROF_GR_ENGINE_ACTIVE" => level,
                    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" => level * level,
                    _ => {
                        // mJ: power x 15 s; one GPU's counter resets (driver reload).
                        if host == "h1" && gpu == 2 && i == 120 {
                            energy = 12_345.0;
                        } else {
                            energy += (60.0 + level * 600.0) * 15_000.0;
                        }
                        energy.round()
                    }
                };
                samples.push((t, v));
            }
            out.push(DataSeries {
                metric: metric.to_string(),
                labels,
                samples,
            });
        }
    }
    // A classic histogram per host: cumulative bucket counters.
    let bounds = ["0.005", "0.01", "0.05", "0.1", "0.5", "1", "+Inf"];
    for host in ["h1", "h2"] {
        let mut counts = [0.0f64; 7];
        let mut per_bucket: Vec<Vec<(i64, f64)>> = vec![Vec::new(); 7];
        for &t in &times {
            for _ in 0..(1 + rng.next() % 20) {
                let x = rng.unit().powi(3) * 1.5;
                for (b, bound) in bounds.iter().enumerate() {
                    let le: f64 = if *bound == "+Inf" {
                        f64::INFINITY
                    } else {
                        bound.parse().unwrap()
                    };
                    if x <= le {
                        counts[b] += 1.0;
                    }
                }
            }
            for (bucket, &c) in per_bucket.iter_mut().zip(&counts) {
                bucket.push((t, c));
            }
        }
        for (b, samples) in per_bucket.into_iter().enumerate() {
            let mut labels = vec![
                ("Hostname".to_string(), host.to_string()),
                ("le".to_string(), bounds[b].to_string()),
            ];
            labels.sort();
            out.push(DataSeries {
                metric: "gpulse_test_latency_seconds_bucket".into(),
                labels,
                samples,
            });
        }
    }
    for (host, rack) in [("h1", "r1"), ("h2", "r2")] {
        out.push(DataSeries {
            metric: "gpulse_node_info".into(),
            labels: vec![
                ("Hostname".to_string(), host.to_string()),
                ("rack".to_string(), rack.to_string()),
            ],
            samples: times.iter().map(|&t| (t, 1.0)).collect(),
        });
    }
    out
}

fn openmetrics(data: &[DataSeries]) -> String {
    let mut s = String::new();
    for d in data {
        let labels: Vec<String> = d
            .labels
            .iter()
            .map(|(n, v)| format!("{n}=\"{v}\""))
            .collect();
        for &(t, v) in &d.samples {
            let _ = writeln!(
                s,
                "{}{{{}}} {} {}.{:03}",
                d.metric,
                labels.join(","),
                v,
                t / 1000,
                t % 1000
            );
        }
    }
    s.push_str("# EOF\n");
    s
}

fn long_csv(data: &[DataSeries]) -> String {
    let mut s = String::from("labels,timestamp_ms,value\n");
    for d in data {
        let mut field = format!("metric={}", d.metric);
        for (n, v) in &d.labels {
            let _ = write!(field, ";{n}={v}");
        }
        let field = format!("\"{}\"", field.replace('"', "\"\""));
        for &(t, v) in &d.samples {
            let _ = writeln!(s, "{field},{t},{v}");
        }
    }
    s
}

struct Prometheus {
    child: Child,
    url: String,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

fn start_prometheus(dir: &Path, input: &Path) -> Prometheus {
    let data = dir.join("prom-data");
    let out = Command::new(PROMTOOL)
        .args(["tsdb", "create-blocks-from", "openmetrics"])
        .arg(input)
        .arg(&data)
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        "global:\n  scrape_interval: 15s\n  evaluation_interval: 1m\n",
    )
    .unwrap();
    let port = super::support::listen_ports(1)[0];
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new(PROMETHEUS)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", data.display()))
        .arg("--storage.tsdb.retention.time=36500d")
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn prometheus");
    let p = Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let started = Instant::now();
    loop {
        if let Ok(r) = agent().get(&format!("{}/-/ready", p.url)).call()
            && r.status() == 200
        {
            return p;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "prometheus not ready; see {}",
            dir.join("prometheus.log").display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn get(base: &str, path: &str, params: &[(&str, String)]) -> (u16, Value) {
    let mut req = agent().get(&format!("{base}{path}"));
    for (k, v) in params {
        req = req.query(*k, v);
    }
    let mut resp = req
        .call()
        .unwrap_or_else(|e| panic!("GET {base}{path}: {e}"));
    let status = resp.status().as_u16();
    let body = resp.body_mut().read_to_string().expect("body");
    let json = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("GET {base}{path} {params:?}: bad JSON {body:?}: {e}"));
    (status, json)
}

fn post_form(base: &str, path: &str, form: &[(&str, &str)]) -> (u16, Value) {
    let mut resp = agent()
        .post(&format!("{base}{path}"))
        .send_form(form.iter().copied())
        .expect("POST");
    let status = resp.status().as_u16();
    let body = resp.body_mut().read_to_string().expect("body");
    (status, serde_json::from_str(&body).expect("JSON"))
}

fn value(v: &Value) -> f64 {
    match v.as_str().expect("value string") {
        "NaN" => f64::NAN,
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        s => s.parse().unwrap_or_else(|e| panic!("value {s:?}: {e}")),
    }
}

fn ts(v: &Value) -> i64 {
    (v.as_f64().expect("timestamp") * 1000.0).round() as i64
}

fn same(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= 1e-9 * a.abs().max(b.abs())
}

type Points = Vec<(i64, f64)>;

/// A result as `labels -> points`, or a scalar/string under the key `""`.
fn normalize(data: &Value) -> (String, BTreeMap<String, Points>) {
    let kind = data["resultType"].as_str().expect("resultType").to_string();
    let mut out = BTreeMap::new();
    let result = &data["result"];
    match kind.as_str() {
        "scalar" | "string" => {
            let p = result.as_array().expect("point");
            let v = if kind == "scalar" { value(&p[1]) } else { 0.0 };
            out.insert(String::new(), vec![(ts(&p[0]), v)]);
        }
        _ => {
            for s in result.as_array().expect("result array") {
                let labels: BTreeMap<String, String> =
                    serde_json::from_value(s["metric"].clone()).expect("metric");
                let key = format!("{labels:?}");
                let points: Points = match s.get("value") {
                    Some(p) => vec![(ts(&p[0]), value(&p[1]))],
                    None => s["values"]
                        .as_array()
                        .expect("values")
                        .iter()
                        .map(|p| (ts(&p[0]), value(&p[1])))
                        .collect(),
                };
                assert!(
                    out.insert(key.clone(), points).is_none(),
                    "duplicate series {key}"
                );
            }
        }
    }
    (kind, out)
}

/// Compares one request's answers; returns a description of the first
/// difference.
fn compare(what: &str, prom: &(u16, Value), ours: &(u16, Value)) -> Result<usize, String> {
    if prom.0 != 200 {
        // Both must fail the same way.
        if ours.0 != prom.0 || ours.1["errorType"] != prom.1["errorType"] {
            return Err(format!(
                "{what}: prometheus failed {} {}, gpulse answered {} {}",
                prom.0, prom.1, ours.0, ours.1
            ));
        }
        return Ok(0);
    }
    if ours.0 != 200 {
        return Err(format!("{what}: gpulse failed {} {}", ours.0, ours.1));
    }
    let (pk, pm) = normalize(&prom.1["data"]);
    let (ok, om) = normalize(&ours.1["data"]);
    if pk != ok {
        return Err(format!("{what}: resultType {pk} vs {ok}"));
    }
    let pkeys: Vec<_> = pm.keys().collect();
    let okeys: Vec<_> = om.keys().collect();
    if pkeys != okeys {
        return Err(format!(
            "{what}: series differ\n  prometheus: {pkeys:?}\n  gpulse:     {okeys:?}"
        ));
    }
    let mut points = 0;
    for (k, pp) in &pm {
        let op = &om[k];
        if pp.len() != op.len() {
            return Err(format!(
                "{what}: {k}: {} points vs {}\n  prometheus: {pp:?}\n  gpulse:     {op:?}",
                pp.len(),
                op.len()
            ));
        }
        for (a, b) in pp.iter().zip(op) {
            if a.0 != b.0 || !same(a.1, b.1) {
                return Err(format!("{what}: {k}: prometheus {a:?}, gpulse {b:?}"));
            }
        }
        points += pp.len();
    }
    Ok(points)
}

/// The expressions: every panel and variable query of the dcgm-exporter
/// dashboards (spec §3.1 and §3.2, template variables substituted), then
/// the rest of the supported language.
fn expressions() -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let panels_31 = [
        r#"DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"}"#,
        r#"avg(DCGM_FI_DEV_GPU_TEMP{instance=~"$instance", gpu=~"$gpu"})"#,
        r#"DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"}"#,
        r#"sum(DCGM_FI_DEV_POWER_USAGE{instance=~"$instance", gpu=~"$gpu"})"#,
        r#"DCGM_FI_DEV_SM_CLOCK{instance=~"$instance", gpu=~"$gpu"} * 1000000"#,
        r#"DCGM_FI_DEV_GPU_UTIL{instance=~"$instance", gpu=~"$gpu"}"#,
        r#"DCGM_FI_DEV_FB_USED{instance=~"$instance", gpu=~"$gpu"}"#,
        r#"DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{instance=~"$instance", gpu=~"$gpu"}"#,
    ];
    // Grafana substitutes "All" with a regex of every value, or `.*`.
    for (instance, gpu) in [(".*", ".*"), ("h1:9400|h3:9400", "1|3")] {
        for p in panels_31 {
            out.push(p.replace("$instance", instance).replace("$gpu", gpu));
        }
    }
    let panels_32 = [
        r#"max(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)"#,
        r#"avg(DCGM_FI_DEV_GPU_TEMP{Hostname=~"$Hostname", gpu=~"$gpu"})"#,
        r#"max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, uuid)"#,
        r#"sum(max(DCGM_FI_DEV_POWER_USAGE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (gpu))"#,
        r#"max(DCGM_FI_DEV_SM_CLOCK{Hostname=~"$Hostname", gpu=~"$gpu"} * 1000000) by (Hostname, UUID, gpu)"#,
        r#"max(DCGM_FI_PROF_GR_ENGINE_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)"#,
        r#"max(DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)"#,
        r#"max(DCGM_FI_DEV_FB_USED{Hostname=~"$Hostname", gpu=~"$gpu"}) by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)"#,
    ];
    for (host, gpu) in [("h1|h2", ".*"), ("h2", "0|2")] {
        for p in panels_32 {
            out.push(p.replace("$Hostname", host).replace("$gpu", gpu));
        }
    }
    let rest = [
        // Selectors, matchers, label casing as stored.
        "DCGM_FI_DEV_GPU_TEMP",
        r#"DCGM_FI_DEV_GPU_TEMP{gpu="1"}"#,
        r#"DCGM_FI_DEV_GPU_TEMP{gpu!="1", Hostname!=""}"#,
        r#"DCGM_FI_DEV_GPU_TEMP{gpu!~"1|3", Hostname="h1"}"#,
        r#"{__name__=~"DCGM_FI_DEV_FB_.*", gpu="0"}"#,
        r#"{__name__!~"DCGM.*", Hostname="h2"}"#,
        r#"DCGM_FI_DEV_GPU_TEMP{hostname="h3"}"#,
        r#"DCGM_FI_DEV_GPU_TEMP{uuid=~"GPU-h3.*"}"#,
        r#"DCGM_FI_DEV_GPU_TEMP{UUID=~"GPU-h1.*"}"#,
        "DCGM_FI_DEV_GPU_UTIL offset 5m",
        // Arithmetic and comparison.
        "DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 100",
        "DCGM_FI_DEV_FB_USED / on(Hostname, hostname, gpu) DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_FB_USED / ignoring(modelName, device) DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_POWER_USAGE > 300",
        "DCGM_FI_DEV_POWER_USAGE > bool 300",
        "300 < DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_TEMP * 9 / 5 + 32",
        "-DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE % 7 - DCGM_FI_DEV_POWER_USAGE ^ 0.5",
        "DCGM_FI_DEV_SM_CLOCK / DCGM_FI_DEV_MEM_CLOCK",
        "DCGM_FI_DEV_GPU_TEMP == bool DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_GPU_UTIL * on(Hostname) group_left(rack) gpulse_node_info",
        "gpulse_node_info * on(Hostname) group_right DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_GPU_UTIL and on(Hostname, hostname, gpu) DCGM_FI_DEV_GPU_TEMP > 60",
        r#"DCGM_FI_DEV_GPU_UTIL unless on(gpu) DCGM_FI_DEV_GPU_TEMP{gpu="2"}"#,
        r#"DCGM_FI_DEV_GPU_UTIL{Hostname="h1"} or DCGM_FI_DEV_GPU_TEMP"#,
        // Aggregations.
        "sum by (Hostname) (DCGM_FI_DEV_POWER_USAGE)",
        "sum without (gpu, UUID, uuid, device) (DCGM_FI_DEV_POWER_USAGE)",
        "avg by (modelName) (DCGM_FI_DEV_GPU_UTIL)",
        "min by (Hostname, hostname) (DCGM_FI_DEV_GPU_TEMP)",
        "max without (gpu) (DCGM_FI_DEV_GPU_TEMP)",
        "count by (hostname) (DCGM_FI_DEV_GPU_TEMP)",
        "count(DCGM_FI_DEV_GPU_TEMP > 50)",
        "topk(3, DCGM_FI_DEV_POWER_USAGE)",
        "bottomk by (Hostname) (2, DCGM_FI_DEV_POWER_USAGE)",
        "quantile(0.9, DCGM_FI_DEV_GPU_UTIL)",
        "quantile by (Hostname) (0.5, DCGM_FI_DEV_POWER_USAGE)",
        "stddev(DCGM_FI_DEV_POWER_USAGE)",
        "stdvar by (Hostname) (DCGM_FI_DEV_POWER_USAGE)",
        r#"count_values("temp", DCGM_FI_DEV_GPU_TEMP)"#,
        "group by (Hostname, modelName) (DCGM_FI_DEV_GPU_TEMP)",
        // Range functions.
        "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m])",
        "increase(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[10m])",
        "irate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[1m])",
        "resets(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[30m])",
        "sum by (Hostname) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m])) / 1000",
        "rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m] offset 10m)",
        "delta(DCGM_FI_DEV_GPU_TEMP[5m])",
        "idelta(DCGM_FI_DEV_GPU_TEMP[2m])",
        "deriv(DCGM_FI_DEV_POWER_USAGE[10m])",
        "predict_linear(DCGM_FI_DEV_FB_USED[15m], 3600)",
        "avg_over_time(DCGM_FI_DEV_GPU_UTIL[5m])",
        "min_over_time(DCGM_FI_DEV_GPU_TEMP[10m])",
        "max_over_time(DCGM_FI_DEV_POWER_USAGE[10m])",
        "sum_over_time(DCGM_FI_DEV_POWER_USAGE[3m])",
        "count_over_time(DCGM_FI_DEV_POWER_USAGE[2m])",
        "last_over_time(DCGM_FI_DEV_GPU_TEMP[1m])",
        "quantile_over_time(0.95, DCGM_FI_DEV_POWER_USAGE[10m])",
        "stddev_over_time(DCGM_FI_DEV_POWER_USAGE[10m])",
        "changes(DCGM_FI_DEV_SM_CLOCK[10m])",
        "max_over_time(rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[2m])[10m:1m])",
        // Histograms.
        "histogram_quantile(0.9, sum by (le, Hostname) (rate(gpulse_test_latency_seconds_bucket[5m])))",
        "histogram_quantile(0.5, gpulse_test_latency_seconds_bucket)",
        "histogram_quantile(0.99, sum by (le) (increase(gpulse_test_latency_seconds_bucket[10m])))",
        // Functions.
        "abs(DCGM_FI_DEV_GPU_TEMP - 60)",
        "ceil(DCGM_FI_DEV_POWER_USAGE) - floor(DCGM_FI_DEV_POWER_USAGE)",
        "round(DCGM_FI_DEV_POWER_USAGE, 5)",
        "round(DCGM_FI_DEV_POWER_USAGE)",
        "clamp(DCGM_FI_DEV_GPU_UTIL, 20, 80)",
        "clamp_min(DCGM_FI_DEV_GPU_UTIL, 50)",
        "clamp_max(DCGM_FI_DEV_GPU_UTIL, 50)",
        r#"label_replace(DCGM_FI_DEV_GPU_TEMP, "host_short", "$1", "Hostname", "h(.*)")"#,
        r#"label_replace(DCGM_FI_DEV_GPU_TEMP{hostname="h3"}, "Hostname", "$1", "hostname", "(.*)")"#,
        r#"label_join(DCGM_FI_DEV_GPU_TEMP{Hostname="h1"}, "id", "-", "Hostname", "gpu")"#,
        "time()",
        "vector(1)",
        "scalar(sum(DCGM_FI_DEV_POWER_USAGE))",
        "DCGM_FI_DEV_GPU_TEMP - scalar(avg(DCGM_FI_DEV_GPU_TEMP))",
        "timestamp(DCGM_FI_DEV_GPU_TEMP)",
        "sort_desc(DCGM_FI_DEV_POWER_USAGE)",
        r#"absent(DCGM_FI_DEV_GPU_TEMP{gpu="9", Hostname="h1"})"#,
        "absent(DCGM_FI_DEV_GPU_TEMP)",
        r#"absent_over_time(DCGM_FI_DEV_GPU_TEMP{gpu="7", Hostname="h1"}[5m])"#,
        r#"absent_over_time(DCGM_FI_DEV_GPU_TEMP{hostname="h3", gpu="1"}[2m])"#,
        "sqrt(DCGM_FI_DEV_POWER_USAGE) + ln(DCGM_FI_DEV_POWER_USAGE)",
        "hour(timestamp(DCGM_FI_DEV_GPU_TEMP))",
        // Errors: both refuse the same way.
        "DCGM_FI_DEV_GPU_TEMP + on(Hostname) DCGM_FI_DEV_POWER_USAGE",
        "sum((",
    ];
    out.extend(rest.iter().map(|s| s.to_string()));
    out
}

fn secs(ms: i64) -> String {
    format!("{}.{:03}", ms / 1000, ms % 1000)
}

#[test]
fn promql_answers_equal_prometheus() {
    if !Path::new(PROMETHEUS).exists() || !Path::new(PROMTOOL).exists() {
        eprintln!(
            "SKIPPED promql_answers_equal_prometheus: {PROMETHEUS} or {PROMTOOL} is missing (apt-get install prometheus)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = data_set();
    let om = dir.path().join("data.om");
    std::fs::write(&om, openmetrics(&data)).unwrap();
    let csv = dir.path().join("data.csv");
    std::fs::write(&csv, long_csv(&data)).unwrap();

    let prom = start_prometheus(dir.path(), &om);
    let gp_dir = dir.path().join("gpulse-data");
    let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .arg("import")
        .arg("--data-dir")
        .arg(&gp_dir)
        .arg(&csv)
        .output()
        .expect("gpulse import");
    assert!(
        out.status.success(),
        "import failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node = Node::start(&gp_dir);
    let ours = node.http_url.clone();

    // The data is in both, sample for sample: every raw sample as a range
    // vector at the end of the hour.
    let samples: usize = data.iter().map(|d| d.samples.len()).sum();
    let raw = [
        ("query", r#"{__name__=~".+"}[2h]"#.to_string()),
        ("time", (T0 + 3600).to_string()),
    ];
    let (a, b) = (
        get(&prom.url, "/api/v1/query", &raw),
        get(&ours, "/api/v1/query", &raw),
    );
    assert_eq!(
        compare("raw samples", &a, &b),
        Ok(samples),
        "both hold the whole data set"
    );

    let instants = [
        (T0 + 1800) * 1000 + 500,
        (T0 + 3600) * 1000,
        (T0 + 3700) * 1000,
        (T0 + 4000) * 1000,
        (T0 + 2500) * 1000 + 123,
    ];
    let ranges = [
        ((T0 + 300) * 1000, (T0 + 3600) * 1000, "60"),
        ((T0 + 601) * 1000 + 500, (T0 + 3900) * 1000, "37"),
        ((T0 + 2000) * 1000, (T0 + 2600) * 1000, "15s"),
    ];
    let exprs = expressions();
    let mut failures = Vec::new();
    let (mut requests, mut points) = (0usize, 0usize);
    for e in &exprs {
        for &t in &instants {
            let params = [("query", e.clone()), ("time", secs(t))];
            let a = get(&prom.url, "/api/v1/query", &params);
            let b = get(&ours, "/api/v1/query", &params);
            requests += 1;
            match compare(&format!("instant {e} @ {}", secs(t)), &a, &b) {
                Ok(n) => points += n,
                Err(m) => failures.push(m),
            }
        }
        for &(start, end, step) in &ranges {
            let params = [
                ("query", e.clone()),
                ("start", secs(start)),
                ("end", secs(end)),
                ("step", step.to_string()),
            ];
            let a = get(&prom.url, "/api/v1/query_range", &params);
            let b = get(&ours, "/api/v1/query_range", &params);
            requests += 1;
            match compare(&format!("range {e} [{start},{end},{step}]"), &a, &b) {
                Ok(n) => points += n,
                Err(m) => failures.push(m),
            }
        }
    }

    // Grafana's variable queries: label_values(metric, label) through
    // /api/v1/label/<name>/values and /api/v1/series, and the label names.
    let (start, end) = (secs(T0 * 1000 - 60_000), secs((T0 + 4000) * 1000));
    let metadata_calls: Vec<(&str, Vec<(&str, String)>)> = vec![
        (
            "/api/v1/label/instance/values",
            vec![("match[]", "DCGM_FI_DEV_GPU_TEMP".into())],
        ),
        (
            "/api/v1/label/gpu/values",
            vec![("match[]", "DCGM_FI_DEV_GPU_TEMP".into())],
        ),
        (
            "/api/v1/label/Hostname/values",
            vec![("match[]", "DCGM_FI_DEV_FB_FREE".into())],
        ),
        (
            "/api/v1/label/hostname/values",
            vec![("match[]", "DCGM_FI_DEV_FB_FREE".into())],
        ),
        (
            "/api/v1/label/gpu/values",
            vec![(
                "match[]",
                r#"DCGM_FI_DEV_FB_FREE{Hostname=~"h1|h2"}"#.into(),
            )],
        ),
        ("/api/v1/label/__name__/values", vec![]),
        ("/api/v1/label/UUID/values", vec![]),
        ("/api/v1/labels", vec![]),
        (
            "/api/v1/labels",
            vec![("match[]", r#"{hostname="h3"}"#.into())],
        ),
        (
            "/api/v1/series",
            vec![("match[]", "DCGM_FI_DEV_GPU_TEMP".into())],
        ),
        (
            "/api/v1/series",
            vec![
                ("match[]", r#"DCGM_FI_DEV_FB_FREE{Hostname=~"h2"}"#.into()),
                ("match[]", r#"gpulse_node_info"#.into()),
            ],
        ),
    ];
    for (path, mut params) in metadata_calls {
        params.push(("start", start.clone()));
        params.push(("end", end.clone()));
        let (sa, a) = get(&prom.url, path, &params);
        let (sb, b) = get(&ours, path, &params);
        requests += 1;
        let set = |v: &Value| -> BTreeSet<String> {
            v["data"]
                .as_array()
                .unwrap_or_else(|| panic!("{path}: {v}"))
                .iter()
                .map(|x| x.to_string())
                .collect()
        };
        if sa != 200 || sb != 200 || set(&a) != set(&b) {
            failures.push(format!(
                "{path} {params:?}:\n  prometheus {sa} {a}\n  gpulse     {sb} {b}"
            ));
        }
    }
    // series without match[] is refused by both.
    let (sa, a) = get(&prom.url, "/api/v1/series", &[]);
    let (sb, b) = get(&ours, "/api/v1/series", &[]);
    assert_eq!((sa, &a["errorType"]), (sb, &b["errorType"]), "{a} vs {b}");

    // POST with a form body, as Grafana sends it.
    let q = "sum by (Hostname) (DCGM_FI_DEV_POWER_USAGE)";
    let t = secs((T0 + 1800) * 1000);
    let a = post_form(&prom.url, "/api/v1/query", &[("query", q), ("time", &t)]);
    let b = post_form(&ours, "/api/v1/query", &[("query", q), ("time", &t)]);
    if let Err(m) = compare("POST instant", &a, &b) {
        failures.push(m);
    }
    let (s, e) = (secs((T0 + 600) * 1000), secs((T0 + 1200) * 1000));
    let form = [
        ("query", q),
        ("start", s.as_str()),
        ("end", e.as_str()),
        ("step", "1m"),
    ];
    let a = post_form(&prom.url, "/api/v1/query_range", &form);
    let b = post_form(&ours, "/api/v1/query_range", &form);
    if let Err(m) = compare("POST range", &a, &b) {
        failures.push(m);
    }
    // RFC 3339 times.
    let params = [
        ("query", "avg(DCGM_FI_DEV_GPU_TEMP)".to_string()),
        ("time", "2023-11-14T22:43:20.250Z".to_string()),
    ];
    if let Err(m) = compare(
        "RFC 3339",
        &get(&prom.url, "/api/v1/query", &params),
        &get(&ours, "/api/v1/query", &params),
    ) {
        failures.push(m);
    }
    let (s, v) = get(&ours, "/api/v1/status/buildinfo", &[]);
    assert_eq!(s, 200);
    assert!(
        v["data"]["version"].as_str().unwrap().starts_with("2."),
        "{v}"
    );

    eprintln!(
        "differential PromQL: {} expressions, {requests} requests, {points} points compared, {} differences",
        exprs.len(),
        failures.len()
    );
    assert!(exprs.len() >= 60);
    assert!(points > 10_000, "too few points compared: {points}");
    assert!(
        failures.is_empty(),
        "{} differences:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The API's own contract, without Prometheus: exact JSON shapes, label
/// names as stored (`Hostname` and `hostname`, `UUID` and `uuid` side by
/// side), and the status and `errorType` of each kind of bad request.
#[test]
fn prometheus_api_shapes_and_errors() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("data.csv");
    std::fs::write(
        &csv,
        "labels,timestamp_ms,value\n\
         metric=m;Hostname=h1;UUID=GPU-1;hostname=x;uuid=u,1700000000000,NaN\n\
         metric=m;Hostname=h1;UUID=GPU-1;hostname=x;uuid=u,1700000000500,1e21\n",
    )
    .unwrap();
    let gp_dir = dir.path().join("gpulse-data");
    let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .arg("import")
        .arg("--data-dir")
        .arg(&gp_dir)
        .arg(&csv)
        .output()
        .expect("gpulse import");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node = Node::start(&gp_dir);
    let url = node.http_url.clone();
    let raw = |path: &str| {
        let mut r = agent().get(&format!("{url}{path}")).call().expect("GET");
        (
            r.status().as_u16(),
            r.body_mut().read_to_string().expect("body"),
        )
    };

    assert_eq!(
        raw("/api/v1/query?query=m&time=1700000000.4"),
        (
            200,
            r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{"Hostname":"h1","UUID":"GPU-1","__name__":"m","hostname":"x","uuid":"u"},"value":[1700000000.400,"NaN"]}]}}"#
                .to_string()
        )
    );
    assert_eq!(
        raw("/api/v1/query_range?query=max(m)%20by%20(uuid,%20Hostname)&start=1700000000&end=1700000001&step=0.5"),
        (
            200,
            r#"{"status":"success","data":{"resultType":"matrix","result":[{"metric":{"Hostname":"h1","uuid":"u"},"values":[[1700000000,"NaN"],[1700000000.500,"1000000000000000000000"],[1700000001,"1000000000000000000000"]]}]}}"#
                .to_string()
        )
    );
    assert_eq!(
        raw("/api/v1/query?query=1%2B1&time=2023-11-14T22:13:20Z"),
        (
            200,
            r#"{"status":"success","data":{"resultType":"scalar","result":[1700000000,"2"]}}"#
                .to_string()
        )
    );
    assert_eq!(
        raw("/api/v1/label/uuid/values?match[]=m"),
        (200, r#"{"status":"success","data":["u"]}"#.to_string())
    );
    assert_eq!(
        raw("/api/v1/labels"),
        (
            200,
            r#"{"status":"success","data":["Hostname","UUID","__name__","hostname","uuid"]}"#
                .to_string()
        )
    );
    assert_eq!(
        raw("/api/v1/metadata"),
        (200, r#"{"status":"success","data":{}}"#.to_string())
    );
    let (s, body) = raw("/api/v1/status/buildinfo");
    assert_eq!(s, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"]["version"], "2.42.0", "{body}");

    for (path, status, kind) in [
        ("/api/v1/query?query=sum((", 400, "bad_data"),
        ("/api/v1/query?query=m&time=yesterday", 400, "bad_data"),
        ("/api/v1/query", 400, "bad_data"),
        ("/api/v1/query?query=limitk(1,m)", 422, "execution"),
        (
            "/api/v1/query_range?query=m&start=10&end=20&step=0",
            400,
            "bad_data",
        ),
        (
            "/api/v1/query_range?query=m&start=20&end=10&step=1",
            400,
            "bad_data",
        ),
        (
            "/api/v1/query_range?query=m&start=0&end=100000&step=1",
            400,
            "bad_data",
        ),
        (
            "/api/v1/query_range?query=m[1m]&start=0&end=10&step=1",
            400,
            "bad_data",
        ),
        (
            "/api/v1/query_range?query=m&start=0&end=10",
            400,
            "bad_data",
        ),
        ("/api/v1/series", 400, "bad_data"),
        ("/api/v1/series?match[]=sum(m)", 400, "bad_data"),
        ("/api/v1/label/1bad/values", 400, "bad_data"),
    ] {
        let (s, body) = raw(path);
        let v: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {body}: {e}"));
        assert_eq!(s, status, "{path}: {body}");
        assert_eq!(v["status"], "error", "{path}: {body}");
        assert_eq!(v["errorType"], kind, "{path}: {body}");
        assert!(
            v["error"].as_str().is_some_and(|e| !e.is_empty()),
            "{path}: {body}"
        );
    }
}
