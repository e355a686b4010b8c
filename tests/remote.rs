//! Prometheus remote write and remote read against a real `serve`: data goes
//! in by remote write, comes back by remote read in both response types
//! (the streamed one checked frame by frame), and a real Prometheus (the
//! Debian package, 2.42) reads it through `remote_read` and answers PromQL
//! with the values this test computes itself.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpulse_proto::prometheus::{
    ChunkedReadResponse, Label, LabelMatcher, Query, ReadRequest, ReadResponse, Sample, TimeSeries,
    WriteRequest, label_matcher::Type, read_request::ResponseType,
};
use prost::Message;
use serde_json::Value;

use crate::support::Node;

const TEMP: &str = "DCGM_FI_DEV_GPU_TEMP";
const ENERGY: &str = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION";
const STEP_MS: i64 = 15_000;
const N: i64 = 240;
/// Index of the sample where node-a GPU 0's energy counter resets.
const RESET_AT: i64 = 60;

/// A written series: sorted labels (with `__name__`) and samples.
type Series = (BTreeMap<String, String>, Vec<(i64, f64)>);

/// 2 hosts x 2 GPUs x (temperature, energy counter), every 15 s for an hour
/// ending a minute ago. node-b labels its host `hostname`, as dcgm-exporter
/// 4.8.3 and later do; node-a uses `Hostname`.
fn dataset(base: i64) -> Vec<Series> {
    let mut out = Vec::new();
    for (h, (host, host_label)) in [("node-a", "Hostname"), ("node-b", "hostname")]
        .into_iter()
        .enumerate()
    {
        for g in 0..2i64 {
            for metric in [TEMP, ENERGY] {
                let labels: BTreeMap<String, String> = [
                    ("__name__", metric.to_string()),
                    ("gpu", g.to_string()),
                    ("UUID", format!("GPU-{host}-{g}")),
                    (host_label, host.to_string()),
                    ("modelName", "NVIDIA H100 80GB HBM3".to_string()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
                let samples = (0..N)
                    .map(|i| {
                        let v = if metric == TEMP {
                            40.0 + h as f64 * 10.0 + g as f64 + (i % 7) as f64 * 0.5
                        } else if h == 0 && g == 0 && i >= RESET_AT {
                            ((i - RESET_AT) * 1000) as f64
                        } else {
                            (i * 1000 + g * 7) as f64
                        };
                        (base + i * STEP_MS, v)
                    })
                    .collect();
                out.push((labels, samples));
            }
        }
    }
    out
}

fn prom_labels(l: &BTreeMap<String, String>) -> Vec<Label> {
    l.iter()
        .map(|(name, value)| Label {
            name: name.clone(),
            value: value.clone(),
        })
        .collect()
}

/// POSTs a snappy-compressed protobuf; returns status, content type and body.
pub(crate) fn post(node: &Node, path: &str, msg: &[u8], raw: bool) -> (u16, String, Vec<u8>) {
    let body = if raw {
        msg.to_vec()
    } else {
        snap::raw::Encoder::new().compress_vec(msg).unwrap()
    };
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut resp = agent
        .post(&format!("{}{path}", node.http_url))
        .header("content-type", "application/x-protobuf")
        .header("content-encoding", "snappy")
        .header("x-prometheus-remote-write-version", "0.1.0")
        .send(&body[..])
        .expect("HTTP request");
    let ct = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(u64::MAX)
        .read_to_vec()
        .unwrap();
    (resp.status().as_u16(), ct, bytes)
}

fn matcher(t: Type, name: &str, value: &str) -> LabelMatcher {
    LabelMatcher {
        r#type: t as i32,
        name: name.into(),
        value: value.into(),
    }
}

/// What the test expects of one remote-read query: the written series that
/// match, sorted by label set, with their samples in `[start, end]`.
fn expect(
    data: &[Series],
    keep: impl Fn(&BTreeMap<String, String>) -> bool,
    start: i64,
    end: i64,
) -> Vec<Series> {
    let mut out: Vec<Series> = data
        .iter()
        .filter(|(l, _)| keep(l))
        .map(|(l, s)| {
            let s: Vec<_> = s
                .iter()
                .copied()
                .filter(|&(t, _)| t >= start && t <= end)
                .collect();
            (l.clone(), s)
        })
        .filter(|(_, s)| !s.is_empty())
        .collect();
    // Prometheus orders label sets pairwise by (name, value).
    out.sort_by(|a, b| a.0.iter().cmp(b.0.iter()));
    out
}

fn as_series(ts: &TimeSeries) -> Series {
    (
        ts.labels
            .iter()
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect(),
        ts.samples.iter().map(|s| (s.timestamp, s.value)).collect(),
    )
}

#[test]
fn remote_write_then_read_back_by_both_response_types_and_through_prometheus() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let base = (now - 61 * 60_000) / STEP_MS * STEP_MS;
    let data = dataset(base);

    // Remote write: all of it in one request.
    let write = WriteRequest {
        timeseries: data
            .iter()
            .map(|(l, s)| TimeSeries {
                labels: prom_labels(l),
                samples: s
                    .iter()
                    .map(|&(timestamp, value)| Sample { value, timestamp })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let (status, _, body) = post(&node, "/api/v1/write", &write.encode_to_vec(), false);
    assert_eq!(status, 204, "{}", String::from_utf8_lossy(&body));

    // Invalid writes: 400 with a reason; nothing of them is stored.
    for (what, body, raw) in [
        ("not snappy", b"\xffgarbage".to_vec(), true),
        ("not protobuf", b"\xff\xff\xff".to_vec(), false),
        (
            "no __name__",
            WriteRequest {
                timeseries: vec![TimeSeries {
                    labels: vec![Label {
                        name: "gpu".into(),
                        value: "9".into(),
                    }],
                    samples: vec![Sample {
                        value: 1.0,
                        timestamp: base,
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }
            .encode_to_vec(),
            false,
        ),
    ] {
        let (status, _, body) = post(&node, "/api/v1/write", &body, raw);
        assert_eq!(status, 400, "{what}: {}", String::from_utf8_lossy(&body));
        assert!(!body.is_empty(), "{what}: an error says why");
    }

    // Remote read, SAMPLES: two queries in one request, inclusive bounds,
    // every matcher type.
    let (start, end) = (base + 10 * STEP_MS, base + 20 * STEP_MS);
    let queries = vec![
        Query {
            start_timestamp_ms: start,
            end_timestamp_ms: end,
            matchers: vec![
                matcher(Type::Eq, "__name__", TEMP),
                matcher(Type::Re, "UUID", "GPU-node-.-1"),
            ],
            hints: None,
        },
        Query {
            start_timestamp_ms: base,
            end_timestamp_ms: base + N * STEP_MS,
            matchers: vec![
                matcher(Type::Re, "__name__", "DCGM_FI_DEV_.*"),
                matcher(Type::Neq, "gpu", "1"),
                matcher(Type::Nre, "hostname", "node-.*"),
            ],
            hints: None,
        },
    ];
    let want = [
        expect(
            &data,
            |l| l["__name__"] == TEMP && l["gpu"] == "1",
            start,
            end,
        ),
        // gpu 0 of node-a only: node-b's `hostname` matches the negative regex.
        expect(
            &data,
            |l| l["gpu"] == "0" && !l.contains_key("hostname"),
            base,
            base + N * STEP_MS,
        ),
    ];
    assert_eq!((want[0].len(), want[0][0].1.len()), (2, 11));
    assert_eq!(want[1].len(), 2);
    let req = ReadRequest {
        queries: queries.clone(),
        accepted_response_types: vec![ResponseType::Samples as i32],
    };
    let (status, ct, body) = post(&node, "/api/v1/read", &req.encode_to_vec(), false);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(ct, "application/x-protobuf");
    let resp = ReadResponse::decode(&snap::raw::Decoder::new().decompress_vec(&body).unwrap()[..])
        .unwrap();
    assert_eq!(resp.results.len(), 2);
    for (q, w) in resp.results.iter().zip(&want) {
        let got: Vec<Series> = q.timeseries.iter().map(as_series).collect();
        assert_eq!(&got, w);
    }

    // Remote read, STREAMED_XOR_CHUNKS: frames of uvarint length, big-endian
    // CRC32C and one series each, sorted, chunks of at most 120 samples with
    // exact min and max times.
    let req = ReadRequest {
        queries,
        accepted_response_types: vec![
            ResponseType::StreamedXorChunks as i32,
            ResponseType::Samples as i32,
        ],
    };
    let (status, ct, body) = post(&node, "/api/v1/read", &req.encode_to_vec(), false);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(
        ct,
        "application/x-streamed-protobuf; proto=prometheus.ChunkedReadResponse"
    );
    let mut got: [Vec<Series>; 2] = Default::default();
    let mut rest = &body[..];
    while !rest.is_empty() {
        let (len, used) = uvarint(rest);
        let crc = u32::from_be_bytes(rest[used..used + 4].try_into().unwrap());
        let msg = &rest[used + 4..used + 4 + len as usize];
        assert_eq!(crc32c::crc32c(msg), crc, "frame CRC");
        rest = &rest[used + 4 + len as usize..];
        let frame = ChunkedReadResponse::decode(msg).unwrap();
        assert_eq!(frame.chunked_series.len(), 1, "one series per frame");
        let cs = &frame.chunked_series[0];
        let mut samples = Vec::new();
        for c in &cs.chunks {
            let decoded = query::remote_read::xor::decode(&c.data).unwrap();
            assert!(!decoded.is_empty() && decoded.len() <= 120);
            assert_eq!(c.min_time_ms, decoded[0].0);
            assert_eq!(c.max_time_ms, decoded.last().unwrap().0);
            samples.extend(decoded);
        }
        let labels = cs
            .labels
            .iter()
            .map(|l| (l.name.clone(), l.value.clone()))
            .collect();
        got[frame.query_index as usize].push((labels, samples));
    }
    assert_eq!(got, want);

    // Bad reads: an error status with the reason.
    let bad = ReadRequest {
        queries: vec![Query {
            start_timestamp_ms: base,
            end_timestamp_ms: now,
            matchers: vec![matcher(Type::Re, "gpu", "(")],
            hints: None,
        }],
        accepted_response_types: vec![],
    };
    let (status, _, body) = post(&node, "/api/v1/read", &bad.encode_to_vec(), false);
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("invalid regex"));

    // Self-monitoring counted all of it.
    let metrics = ureq::get(&format!("{}/metrics", node.http_url))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    let total: usize = data.iter().map(|(_, s)| s.len()).sum();
    for line in [
        format!("gpulse_remote_write_samples_total {total}"),
        "gpulse_remote_write_requests_total 4".to_string(),
        "gpulse_remote_write_requests_invalid_total 3".to_string(),
        "gpulse_remote_read_requests_total 3".to_string(),
        "gpulse_remote_read_requests_failed_total 1".to_string(),
        format!("gpulse_head_series {}", data.len()),
        "gpulse_sql_query_duration_seconds_count 0".to_string(),
        "gpulse_promql_query_duration_seconds_count 0".to_string(),
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    }

    through_prometheus(&node, &data, base, dir.path());

    // Query latencies: one SQL query that works and one that fails; one
    // PromQL query. (Prometheus above only used remote read.)
    node.sql("SELECT count(*) FROM samples");
    assert_eq!(node.sql_raw("SELECT nope FROM samples").0, 400);
    let status = ureq::get(&format!("{}/api/v1/query", node.http_url))
        .query("query", format!("count({TEMP})"))
        .call()
        .unwrap()
        .status();
    assert_eq!(status, 200);
    let metrics = ureq::get(&format!("{}/metrics", node.http_url))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    for line in [
        "gpulse_sql_query_duration_seconds_count 2",
        "gpulse_sql_queries_failed_total 1",
        "gpulse_promql_query_duration_seconds_count 1",
        "gpulse_promql_queries_failed_total 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in:\n{metrics}");
    }
    node.stop();
}

fn uvarint(b: &[u8]) -> (u64, usize) {
    let mut v = 0;
    for (i, &byte) in b.iter().enumerate() {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return (v, i + 1);
        }
    }
    panic!("truncated uvarint");
}

/// A Prometheus process, killed on drop.
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

fn start_prometheus(gpulse: &str, dir: &Path) -> Option<Prometheus> {
    let bin = Path::new("/usr/bin/prometheus");
    if !bin.exists() {
        assert!(
            std::env::var_os("GPULSE_REQUIRE_PROMETHEUS").is_none(),
            "GPULSE_REQUIRE_PROMETHEUS is set but /usr/bin/prometheus is missing"
        );
        eprintln!(
            "SKIPPED the Prometheus part: /usr/bin/prometheus is missing (apt-get install prometheus)"
        );
        return None;
    }
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  evaluation_interval: 1h\nremote_read:\n  - url: {gpulse}/api/v1/read\n    read_recent: true\n"
        ),
    )
    .unwrap();
    let port = super::support::listen_ports(1)[0];
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let child = Command::new(bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("prom-data").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting prometheus");
    let p = Prometheus {
        child,
        url: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if ureq::get(&format!("{}/-/ready", p.url)).call().is_ok() {
            return Some(p);
        }
        assert!(
            Instant::now() < deadline,
            "prometheus did not become ready; see {}",
            dir.join("prometheus.log").display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A Prometheus API answer as label set -> values ((ts ms, value) pairs).
type PromResult = BTreeMap<BTreeMap<String, String>, Vec<(i64, f64)>>;

fn prom_query(p: &Prometheus, path: &str, params: &[(&str, String)]) -> PromResult {
    let mut req = ureq::get(&format!("{}{path}", p.url));
    for (k, v) in params {
        req = req.query(k, v);
    }
    let body: Value = serde_json::from_str(
        &req.call()
            .unwrap_or_else(|e| panic!("{path} {params:?}: {e}"))
            .body_mut()
            .read_to_string()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(body["status"], "success", "{body}");
    let point = |p: &Value| {
        (
            (p[0].as_f64().unwrap() * 1000.0).round() as i64,
            p[1].as_str().unwrap().parse::<f64>().unwrap(),
        )
    };
    let mut out = PromResult::new();
    for r in body["data"]["result"].as_array().unwrap() {
        let labels = r["metric"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap().to_string()))
            .collect();
        let values = match r.get("values") {
            Some(vs) => vs.as_array().unwrap().iter().map(point).collect(),
            None => vec![point(&r["value"])],
        };
        out.insert(labels, values);
    }
    out
}

fn assert_close(got: &PromResult, want: &PromResult, what: &str) {
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{what}: series"
    );
    for (k, w) in want {
        let g = &got[k];
        assert_eq!(g.len(), w.len(), "{what} {k:?}: points");
        for (a, b) in g.iter().zip(w) {
            assert_eq!(a.0, b.0, "{what} {k:?}: timestamps");
            assert!(
                (a.1 - b.1).abs() <= 1e-9 * a.1.abs().max(b.1.abs()).max(1.0),
                "{what} {k:?}: {} vs {} (want)",
                a.1,
                b.1
            );
        }
    }
}

/// The newest sample at or before `t` within Prometheus's 5-minute lookback.
fn at(s: &[(i64, f64)], t: i64) -> Option<f64> {
    s.iter()
        .rev()
        .find(|&&(ts, _)| ts <= t && ts > t - 300_000)
        .map(|p| p.1)
}

fn without_name(l: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut l = l.clone();
    l.remove("__name__");
    l
}

/// Prometheus 2.42's `extrapolatedRate` for `rate(x[range])` at `t`.
fn prom_rate(s: &[(i64, f64)], t: i64, range_ms: i64) -> Option<f64> {
    let (start, end) = (t - range_ms, t);
    let pts: Vec<(i64, f64)> = s
        .iter()
        .copied()
        .filter(|&(ts, _)| ts >= start && ts <= end)
        .collect();
    if pts.len() < 2 {
        return None;
    }
    let (first, last) = (pts[0], pts[pts.len() - 1]);
    let mut result = last.1 - first.1;
    for w in pts.windows(2) {
        if w[1].1 < w[0].1 {
            result += w[0].1;
        }
    }
    let mut to_start = (first.0 - start) as f64 / 1000.0;
    let to_end = (end - last.0) as f64 / 1000.0;
    let sampled = (last.0 - first.0) as f64 / 1000.0;
    let avg_gap = sampled / (pts.len() - 1) as f64;
    if result > 0.0 && first.1 >= 0.0 {
        to_start = to_start.min(sampled * (first.1 / result));
    }
    let threshold = avg_gap * 1.1;
    let mut interval = sampled;
    interval += if to_start < threshold {
        to_start
    } else {
        avg_gap / 2.0
    };
    interval += if to_end < threshold {
        to_end
    } else {
        avg_gap / 2.0
    };
    Some(result * interval / sampled / (range_ms as f64 / 1000.0))
}

fn through_prometheus(node: &Node, data: &[Series], base: i64, dir: &Path) {
    let Some(p) = start_prometheus(&node.http_url, dir) else {
        return;
    };
    let secs = |ms: i64| format!("{:.3}", ms as f64 / 1000.0);
    let last = base + (N - 1) * STEP_MS;
    let qt = last + 10_000;
    let instant = |q: &str, t: i64| {
        prom_query(
            &p,
            "/api/v1/query",
            &[("query", q.to_string()), ("time", secs(t))],
        )
    };
    let temps: Vec<&Series> = data.iter().filter(|(l, _)| l["__name__"] == TEMP).collect();

    // A plain selector: the newest sample of each series, labels as stored.
    let want: PromResult = temps
        .iter()
        .map(|(l, s)| (l.clone(), vec![(qt, at(s, qt).unwrap())]))
        .collect();
    assert_close(&instant(TEMP, qt), &want, "selector");

    // All four matcher types at once.
    let q = format!(
        "{{__name__=\"{TEMP}\", gpu!=\"0\", UUID=~\"GPU-node-.*\", modelName!~\"A100.*\"}}"
    );
    let want: PromResult = temps
        .iter()
        .filter(|(l, _)| l["gpu"] != "0")
        .map(|(l, s)| (l.clone(), vec![(qt, at(s, qt).unwrap())]))
        .collect();
    assert_eq!(want.len(), 2);
    assert_close(&instant(&q, qt), &want, "matchers");

    // rate over a counter that resets inside the range.
    let t_rate = base + RESET_AT * STEP_MS + 70_000;
    let want: PromResult = data
        .iter()
        .filter(|(l, _)| l["__name__"] == ENERGY && l["gpu"] == "0")
        .map(|(l, s)| {
            (
                without_name(l),
                vec![(t_rate, prom_rate(s, t_rate, 300_000).unwrap())],
            )
        })
        .collect();
    assert_close(
        &instant(&format!("rate({ENERGY}{{gpu=\"0\"}}[5m])"), t_rate),
        &want,
        "rate with a reset",
    );

    // avg by (Hostname): node-b has no `Hostname` (it has `hostname`), so its
    // GPUs form the group with no labels. Nothing is renamed.
    let mut groups: BTreeMap<BTreeMap<String, String>, Vec<f64>> = BTreeMap::new();
    for (l, s) in &temps {
        let key = l
            .get("Hostname")
            .map(|h| [("Hostname".to_string(), h.clone())].into())
            .unwrap_or_default();
        groups.entry(key).or_default().push(at(s, qt).unwrap());
    }
    let want: PromResult = groups
        .into_iter()
        .map(|(k, v)| (k, vec![(qt, v.iter().sum::<f64>() / v.len() as f64)]))
        .collect();
    assert_eq!(want.len(), 2);
    assert_close(
        &instant(&format!("avg by (Hostname) ({TEMP})"), qt),
        &want,
        "avg by (Hostname)",
    );

    // max_over_time, sum and count.
    let want: PromResult = temps
        .iter()
        .map(|(l, s)| {
            let m = s
                .iter()
                .filter(|&&(ts, _)| ts >= qt - 600_000 && ts <= qt)
                .map(|p| p.1)
                .fold(f64::NEG_INFINITY, f64::max);
            (without_name(l), vec![(qt, m)])
        })
        .collect();
    assert_close(
        &instant(&format!("max_over_time({TEMP}[10m])"), qt),
        &want,
        "max_over_time",
    );
    let sum: f64 = temps.iter().map(|(_, s)| at(s, qt).unwrap()).sum();
    let want: PromResult = [(BTreeMap::new(), vec![(qt, sum)])].into();
    assert_close(&instant(&format!("sum({TEMP})"), qt), &want, "sum");
    let want: PromResult = [(BTreeMap::new(), vec![(qt, temps.len() as f64)])].into();
    assert_close(&instant(&format!("count({TEMP})"), qt), &want, "count");

    // A range query: steps aligned to the start, each the newest sample.
    let (start, end, step) = (base + 300_000, base + 1_200_000, 60_000);
    let (l, s) = temps
        .iter()
        .find(|(l, _)| l["gpu"] == "1" && l.get("Hostname").is_some())
        .unwrap();
    let want: PromResult = [(
        l.clone(),
        (start..=end)
            .step_by(step as usize)
            .map(|t| (t, at(s, t).unwrap()))
            .collect(),
    )]
    .into();
    let got = prom_query(
        &p,
        "/api/v1/query_range",
        &[
            ("query", format!("{TEMP}{{gpu=\"1\", Hostname=\"node-a\"}}")),
            ("start", secs(start)),
            ("end", secs(end)),
            ("step", "60".into()),
        ],
    );
    assert_close(&got, &want, "query_range");

    // Series: the label sets, as stored.
    let mut req = ureq::get(&format!("{}/api/v1/series", p.url))
        .query("match[]", TEMP)
        .query("start", secs(base))
        .query("end", secs(qt));
    req = req.query("match[]", format!("{ENERGY}{{gpu=\"1\"}}"));
    let body: Value =
        serde_json::from_str(&req.call().unwrap().body_mut().read_to_string().unwrap()).unwrap();
    let mut got: Vec<BTreeMap<String, String>> = body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| serde_json::from_value(m.clone()).unwrap())
        .collect();
    got.sort();
    let mut want: Vec<BTreeMap<String, String>> = data
        .iter()
        .map(|(l, _)| l.clone())
        .filter(|l| l["__name__"] == TEMP || l["gpu"] == "1")
        .collect();
    want.sort();
    assert_eq!(got, want, "series");
}
