//! The fixed query set of `gpulse-bench query`: five questions a GPU-fleet
//! dashboard asks, each as PromQL (for every system that speaks it) and as
//! SQL over raw samples and over rollups (gpulse only).
//!
//! Every query is anchored at the end of the loaded data (`at_ms`), not at
//! the wall clock, so that a run answers the same question however long the
//! load took. A range query's start and end are whole steps (multiples of
//! `step` since the epoch), as Grafana sends them.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::Value;

/// Where the data lives: the query set picks its host, GPU and rack.
#[derive(Debug, Clone)]
pub(crate) struct Anchor {
    pub(crate) at_ms: i64,
    pub(crate) host: String,
    pub(crate) gpu: String,
    pub(crate) rack: String,
}

/// A PromQL query as the HTTP API takes it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Prom {
    Instant {
        query: String,
        at_ms: i64,
    },
    Range {
        query: String,
        start_ms: i64,
        end_ms: i64,
        step_s: u64,
    },
    /// A dashboard refresh: each panel's query, one after another.
    Dashboard {
        panels: Vec<Prom>,
    },
}

/// One question of the set.
#[derive(Debug, Clone)]
pub(crate) struct QuerySpec {
    pub(crate) name: &'static str,
    pub(crate) what: &'static str,
    pub(crate) promql: Prom,
    pub(crate) sql_raw: Option<String>,
    pub(crate) sql_rollup: Option<String>,
}

const HOUR_MS: i64 = 3_600_000;

/// A range query from `start_ms` to `end_ms`, both moved back to whole
/// steps, as Grafana sends them.
fn range(query: String, start_ms: i64, end_ms: i64, step_s: u64) -> Prom {
    let whole = |ms: i64| ms - ms.rem_euclid(step_s as i64 * 1000);
    Prom::Range {
        query,
        start_ms: whole(start_ms),
        end_ms: whole(end_ms),
        step_s,
    }
}

fn ts(ms: i64) -> String {
    format!("to_timestamp_millis({ms})")
}

/// The query set, documented in docs/BENCHMARKS.md.
pub(crate) fn query_set(a: &Anchor) -> Vec<QuerySpec> {
    let (t, host, gpu, rack) = (a.at_ms, &a.host, &a.gpu, &a.rack);
    vec![
        QuerySpec {
            name: "gpu_last_hour",
            what: "every metric of one GPU over the last hour, raw samples",
            promql: Prom::Instant {
                query: format!("{{Hostname=\"{host}\",gpu=\"{gpu}\"}}[1h]"),
                at_ms: t,
            },
            sql_raw: Some(format!(
                "SELECT metric, ts, value FROM samples WHERE host = '{host}' AND gpu = '{gpu}' \
                 AND ts > {} AND ts <= {} ORDER BY metric, ts",
                ts(t - HOUR_MS),
                ts(t)
            )),
            sql_rollup: None,
        },
        QuerySpec {
            name: "rack_util_1h",
            what: "fleet average GPU utilisation per rack over the last hour",
            promql: Prom::Instant {
                query: "avg by (rack) (avg_over_time(DCGM_FI_DEV_GPU_UTIL[1h]))".into(),
                at_ms: t,
            },
            sql_raw: Some(format!(
                "SELECT rack, avg(value) AS util FROM samples WHERE metric = 'DCGM_FI_DEV_GPU_UTIL' \
                 AND ts > {} AND ts <= {} GROUP BY rack ORDER BY rack",
                ts(t - HOUR_MS),
                ts(t)
            )),
            sql_rollup: Some(format!(
                "SELECT rack, sum(sum) / sum(count) AS util FROM rollup_1m WHERE level = 'rack' \
                 AND metric = 'DCGM_FI_DEV_GPU_UTIL' AND ts >= {} AND ts < {} GROUP BY rack ORDER BY rack",
                ts(t - HOUR_MS),
                ts(t)
            )),
        },
        QuerySpec {
            name: "top10_hottest",
            what: "the 10 hottest GPUs now (latest temperature)",
            promql: Prom::Instant {
                query: "topk(10, DCGM_FI_DEV_GPU_TEMP)".into(),
                at_ms: t,
            },
            sql_raw: Some(format!(
                "SELECT host, gpu, last_value(value ORDER BY ts) AS temp FROM samples \
                 WHERE metric = 'DCGM_FI_DEV_GPU_TEMP' AND ts > {} AND ts <= {} \
                 GROUP BY host, gpu ORDER BY temp DESC LIMIT 10",
                ts(t - 5 * 60_000),
                ts(t)
            )),
            sql_rollup: None,
        },
        QuerySpec {
            name: "host_energy_rate_6h",
            what: "rate() of energy per host over 6 h, at 1-minute steps",
            promql: range(
                "sum by (Hostname) (rate(DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION[5m]))".into(),
                t - 6 * HOUR_MS,
                t,
                60,
            ),
            // Energy used per host and minute, from the counter's rise.
            sql_raw: Some(format!(
                "SELECT host, minute, sum(rise) / 60 AS mj_per_s FROM (\
                 SELECT host, gpu, date_bin(INTERVAL '1 minute', ts) AS minute, max(value) - min(value) AS rise \
                 FROM samples WHERE metric = 'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION' AND ts > {} AND ts <= {} \
                 GROUP BY host, gpu, minute) GROUP BY host, minute ORDER BY host, minute",
                ts(t - 6 * HOUR_MS),
                ts(t)
            )),
            sql_rollup: Some(format!(
                "SELECT host, ts, sum(last - first) / 60 AS mj_per_s FROM rollup_1m \
                 WHERE level = 'gpu' AND metric = 'DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION' \
                 AND ts >= {} AND ts < {} GROUP BY host, ts ORDER BY host, ts",
                ts(t - 6 * HOUR_MS),
                ts(t)
            )),
        },
        QuerySpec {
            name: "rack_power_30d",
            what: "one rack's average GPU power over 30 days at 1-hour resolution",
            promql: range(
                format!("avg(avg_over_time(DCGM_FI_DEV_POWER_USAGE{{rack=\"{rack}\"}}[1h]))"),
                t - 30 * 24 * HOUR_MS,
                t,
                3600,
            ),
            sql_raw: Some(format!(
                "SELECT date_bin(INTERVAL '1 hour', ts) AS hour, avg(value) AS watts FROM samples \
                 WHERE rack = '{rack}' AND metric = 'DCGM_FI_DEV_POWER_USAGE' AND ts > {} AND ts <= {} \
                 GROUP BY hour ORDER BY hour",
                ts(t - 30 * 24 * HOUR_MS),
                ts(t)
            )),
            sql_rollup: Some(format!(
                "SELECT ts AS hour, avg AS watts FROM rollup_1h WHERE level = 'rack' AND rack = '{rack}' \
                 AND metric = 'DCGM_FI_DEV_POWER_USAGE' AND ts >= {} AND ts < {} ORDER BY hour",
                ts(t - 30 * 24 * HOUR_MS),
                ts(t)
            )),
        },
        QuerySpec {
            name: "dashboard_6h",
            what: "a refresh of NVIDIA's dcgm-exporter Grafana dashboard, all instances and GPUs, last 6 h",
            promql: dashboard(t),
            sql_raw: None,
            sql_rollup: None,
        },
    ]
}

/// The eight panels of NVIDIA's dcgm-exporter Grafana dashboard
/// (`grafana/dcgm-exporter-dashboard.json`, shared/spec/gpu-domain.md §3.1),
/// with `$instance` and `$gpu` at "All" (`.*`): range queries over the 6 h
/// before `t` at a 1-minute step (a 6 h range in a panel some 400 pixels
/// wide), except the power-total gauge, an instant query.
fn dashboard(t: i64) -> Prom {
    let sel = r#"{instance=~".*", gpu=~".*"}"#;
    let graph = |q: String| range(q, t - 6 * HOUR_MS, t, 60);
    Prom::Dashboard {
        panels: vec![
            graph(format!("DCGM_FI_DEV_GPU_TEMP{sel}")),
            graph(format!("avg(DCGM_FI_DEV_GPU_TEMP{sel})")),
            graph(format!("DCGM_FI_DEV_POWER_USAGE{sel}")),
            Prom::Instant {
                query: format!("sum(DCGM_FI_DEV_POWER_USAGE{sel})"),
                at_ms: t,
            },
            graph(format!("DCGM_FI_DEV_SM_CLOCK{sel} * 1000000")),
            graph(format!("DCGM_FI_DEV_GPU_UTIL{sel}")),
            graph(format!("DCGM_FI_DEV_FB_USED{sel}")),
            graph(format!("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE{sel}")),
        ],
    }
}

/// A query as sent: the language and where it goes.
#[derive(Debug, Clone)]
pub(crate) enum Request {
    /// To a Prometheus-compatible API at this base URL.
    PromQl { base: String, query: Prom },
    /// To gpulse's `/api/v1/sql` at this base URL.
    Sql { base: String, query: String },
}

/// One answer: how many result series (PromQL) or rows it held, and the
/// time from sending the request to the answer's last byte.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answer {
    pub(crate) results: u64,
    pub(crate) elapsed: Duration,
}

/// Sends `req` once (a dashboard panel after panel) and checks its answer.
///
/// The time stops at the answer's last byte: the client's parse of the JSON,
/// which a browser or Grafana pays the same for every system, is not the
/// server's latency (a 1-hour raw answer of 53 series is 445 KB, and parsing
/// it into a `serde_json::Value` took longer than the server took to send it).
pub(crate) fn send(agent: &ureq::Agent, req: &Request) -> anyhow::Result<Answer> {
    if let Request::PromQl {
        base,
        query: Prom::Dashboard { panels },
    } = req
    {
        let mut total = Answer {
            results: 0,
            elapsed: Duration::ZERO,
        };
        for p in panels {
            let panel = Request::PromQl {
                base: base.clone(),
                query: p.clone(),
            };
            let a = send(agent, &panel)?;
            total.results += a.results;
            total.elapsed += a.elapsed;
        }
        return Ok(total);
    }
    let t0 = Instant::now();
    let (url, resp) = match req {
        Request::PromQl { base, query } => {
            let secs = |ms: i64| format!("{:.3}", ms as f64 / 1000.0);
            let mut params: Vec<(&str, String)> = Vec::new();
            let path = match query {
                Prom::Instant { query, at_ms } => {
                    params.push(("query", query.clone()));
                    params.push(("time", secs(*at_ms)));
                    "/api/v1/query"
                }
                Prom::Range {
                    query,
                    start_ms,
                    end_ms,
                    step_s,
                } => {
                    params.push(("query", query.clone()));
                    params.push(("start", secs(*start_ms)));
                    params.push(("end", secs(*end_ms)));
                    params.push(("step", step_s.to_string()));
                    "/api/v1/query_range"
                }
                Prom::Dashboard { .. } => bail!("a dashboard is sent panel by panel"),
            };
            // VictoriaMetrics caches range results; every repetition must
            // evaluate, so its cache is turned off (others ignore the flag).
            params.push(("nocache", "1".into()));
            let url = format!("{}{path}", base.trim_end_matches('/'));
            let resp = agent.post(&url).send_form(params);
            (url, resp)
        }
        Request::Sql { base, query } => {
            let url = format!("{}/api/v1/sql", base.trim_end_matches('/'));
            let resp = agent
                .post(&url)
                .query("format", "json")
                .header("content-type", "text/plain; charset=utf-8")
                .send(query.as_bytes());
            (url, resp)
        }
    };
    let mut resp = resp.with_context(|| format!("POST {url}"))?;
    let status = resp.status().as_u16();
    // Into a buffer kept from the last answer. Grown from empty for every
    // answer (its pages faulted in again), the client's own reading was a
    // good part of a large answer's time, for every system alike: 3.7 ms
    // for gpu_last_hour's 444 KB from gpulse, which curl read in 1.3 ms.
    thread_local! {
        static BODY: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut body = BODY.take();
    body.clear();
    std::io::Read::read_to_end(
        &mut resp.body_mut().with_config().limit(1 << 30).reader(),
        &mut body,
    )
    .with_context(|| format!("reading the answer of {url}"))?;
    let elapsed = t0.elapsed();
    let parsed = serde_json::from_slice::<Value>(&body);
    BODY.set(body);
    let v: Value = parsed.with_context(|| format!("{url} answered HTTP {status} with no JSON"))?;
    if status != 200 {
        bail!(
            "{url}: HTTP {status}: {}",
            v["error"].as_str().unwrap_or("(no error text)")
        );
    }
    let results = match req {
        Request::PromQl { .. } => {
            if v["status"] != "success" {
                bail!("{url}: status {}", v["status"]);
            }
            match &v["data"]["result"] {
                Value::Array(a) => a.len() as u64,
                _ => 1,
            }
        }
        Request::Sql { .. } => v["row_count"]
            .as_u64()
            .with_context(|| format!("{url}: no row_count in the answer"))?,
    };
    Ok(Answer { results, elapsed })
}

/// Latencies of `reps` runs after one warm-up run.
#[derive(Debug, Clone)]
pub(crate) struct Timing {
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) results: u64,
}

pub(crate) fn time(agent: &ureq::Agent, req: &Request, reps: usize) -> anyhow::Result<Timing> {
    let results = send(agent, req)?.results;
    let mut ms = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let a = send(agent, req)?;
        ms.push(a.elapsed.as_secs_f64() * 1000.0);
        let n = a.results;
        if n != results {
            bail!("the answer changed between runs: {results} then {n} results");
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(Timing {
        p50_ms: percentile(&ms, 0.50),
        p99_ms: percentile(&ms, 0.99),
        results,
    })
}

/// The nearest-rank percentile of sorted values.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn http_agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(300)))
        .build()
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&[3.0], 0.99), 3.0);
        assert_eq!(percentile(&[1.0, 2.0, 3.0], 0.5), 2.0);
        assert!(percentile(&[], 0.5).is_nan());
    }

    #[test]
    fn the_set_names_the_anchor() {
        let a = Anchor {
            at_ms: 7_200_000 + 90_500,
            host: "host-00000".into(),
            gpu: "0".into(),
            rack: "rack-000".into(),
        };
        let set = query_set(&a);
        assert_eq!(set.len(), 6);
        let raw = set[0].sql_raw.as_deref().unwrap();
        assert!(raw.contains("to_timestamp_millis(3690500)"), "{raw}");
        assert!(
            matches!(&set[4].promql, Prom::Range { step_s: 3600, query, .. } if query.contains("rack-000"))
        );
        // Range queries on whole steps: 2 h 1 min 30.5 s, back to 2 h 1 min
        // (1-minute steps) and 2 h (1-hour steps).
        assert!(matches!(
            &set[3].promql,
            Prom::Range {
                start_ms: -14_340_000,
                end_ms: 7_260_000,
                ..
            }
        ));
        assert!(matches!(
            &set[4].promql,
            Prom::Range {
                start_ms: -2_584_800_000,
                end_ms: 7_200_000,
                ..
            }
        ));
        // The dashboard: eight panels, the fourth an instant query at the
        // anchor, the others 6 h ranges on whole minutes.
        let Prom::Dashboard { panels } = &set[5].promql else {
            panic!("{:?}", set[5].promql);
        };
        assert_eq!(panels.len(), 8);
        assert!(
            matches!(&panels[3], Prom::Instant { at_ms: 7_290_500, query } if query.starts_with("sum("))
        );
        for p in panels.iter().filter(|p| !matches!(p, Prom::Instant { .. })) {
            assert!(
                matches!(
                    p,
                    Prom::Range {
                        start_ms: -14_340_000,
                        end_ms: 7_260_000,
                        step_s: 60,
                        ..
                    }
                ),
                "{p:?}"
            );
        }
    }
}
