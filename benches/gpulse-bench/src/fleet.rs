//! The data a benchmark loads: the simulated fleet with a virtual clock, or
//! a recorded long-format CSV (the real DCGM recordings), cut into hosts
//! that each produce polls in time order.
//!
//! Both protocols load the same polls: the agent protocol sends a host's
//! series definitions once and then ids, remote-write sends each sample with
//! its whole label set. A series' labels are the same in both: what an agent
//! sends plus what ingest attaches per stream (`Hostname` and the topology).

use std::collections::HashMap;
use std::io::BufRead;
use std::path::Path;

use agent::GpuSource;
use agent::catalog::Metric;
use agent::sim::{SimConfig, SimulatedSource};
use agent::source::SeriesLabel;
use anyhow::{Context, bail};

/// GPUs per simulated host, as on a DGX/HGX node.
pub(crate) const GPUS_PER_HOST: u32 = 8;
/// Simulated hosts per rack and racks per row.
pub(crate) const HOSTS_PER_RACK: u64 = 4;
pub(crate) const RACKS_PER_ROW: u64 = 8;
pub(crate) const CLUSTER: &str = "bench";

/// The names the query set refers to (the first host, GPU and rack).
pub(crate) fn host_name(h: u64) -> String {
    format!("host-{h:05}")
}
pub(crate) fn rack_name(h: u64) -> String {
    format!("rack-{:03}", h / HOSTS_PER_RACK)
}
pub(crate) fn row_name(h: u64) -> String {
    format!("row-{:02}", h / (HOSTS_PER_RACK * RACKS_PER_ROW))
}

/// The seed of host `h`'s simulator in a fleet seeded with `seed` (the load
/// generator's and `gpulse-bench health`'s fleets are the same hosts).
pub(crate) fn host_seed(seed: u64, h: u64) -> u64 {
    seed.wrapping_mul(1_000_003) ^ h
}

/// One host of the load: its identity, and its series as they appear.
#[derive(Debug, Clone)]
pub(crate) struct HostSpec {
    pub(crate) name: String,
    pub(crate) cluster: String,
    pub(crate) row: String,
    pub(crate) rack: String,
}

impl HostSpec {
    /// The labels ingest attaches to every series of the host's stream.
    pub(crate) fn stream_labels(&self) -> [(&'static str, &str); 4] {
        [
            ("Hostname", &self.name),
            ("cluster", &self.cluster),
            ("row", &self.row),
            ("rack", &self.rack),
        ]
    }
}

/// A series as the agent defines it: metric name plus its own labels
/// (without the stream labels of [`HostSpec`]).
#[derive(Debug, Clone)]
pub(crate) struct SeriesSpec {
    pub(crate) metric: String,
    pub(crate) labels: Vec<(String, String)>,
}

/// A host's polls, in time order.
pub(crate) trait HostFeed: Send {
    fn host(&self) -> &HostSpec;
    /// The series seen so far; [`Self::next_poll`] only appends to it.
    fn series(&self) -> &[SeriesSpec];
    /// The next poll's timestamp, with `(series index, value)` in `out`
    /// (cleared first); `None` when the host is done.
    fn next_poll(&mut self, out: &mut Vec<(u32, f64)>) -> Option<i64>;
    /// Polls left, for progress and totals.
    fn polls_left(&self) -> u64;
}

/// The simulated fleet: `gpus` GPUs in hosts of 8, 4 hosts a rack, 8 racks a
/// row, polled every `interval_ms` over `[end_ms - span, end_ms)` by a virtual
/// clock (the load runs as fast as it can, not in real time).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SimFleet {
    pub(crate) gpus: u32,
    pub(crate) interval_ms: i64,
    pub(crate) polls: u64,
    pub(crate) end_ms: i64,
    pub(crate) seed: u64,
}

impl SimFleet {
    pub(crate) fn hosts(&self) -> u64 {
        u64::from(self.gpus.div_ceil(GPUS_PER_HOST))
    }

    pub(crate) fn start_ms(&self) -> i64 {
        self.end_ms - self.polls as i64 * self.interval_ms
    }

    pub(crate) fn feeds(&self) -> Vec<Box<dyn HostFeed>> {
        (0..self.hosts())
            .map(|h| {
                let gpus = (self.gpus - h as u32 * GPUS_PER_HOST).min(GPUS_PER_HOST);
                let mut config = SimConfig::new(host_seed(self.seed, h), gpus);
                config.interval_ms = self.interval_ms as u64;
                Box::new(SimHost {
                    host: HostSpec {
                        name: host_name(h),
                        cluster: CLUSTER.into(),
                        row: row_name(h),
                        rack: rack_name(h),
                    },
                    sim: SimulatedSource::new(config),
                    ids: HashMap::new(),
                    series: Vec::new(),
                    readings: Vec::new(),
                    next_ts: self.start_ms(),
                    interval_ms: self.interval_ms,
                    left: self.polls,
                    jitter: 0x2545_f491_4f6c_dd1d ^ h.wrapping_mul(0x9e37_79b9),
                }) as Box<dyn HostFeed>
            })
            .collect()
    }
}

struct SimHost {
    host: HostSpec,
    sim: SimulatedSource,
    ids: HashMap<(u32, Metric, Option<SeriesLabel>), u32>,
    series: Vec<SeriesSpec>,
    readings: Vec<agent::Reading>,
    next_ts: i64,
    interval_ms: i64,
    left: u64,
    jitter: u64,
}

impl SimHost {
    fn id(&mut self, r: &agent::Reading) -> u32 {
        let key = (r.gpu, r.metric, r.label);
        if let Some(&id) = self.ids.get(&key) {
            return id;
        }
        let g = &self.sim.inventory()[r.gpu as usize];
        // dcgm-exporter's GPU labels, as the agent's shipper sends them.
        let mut labels = vec![
            ("gpu".to_string(), r.gpu.to_string()),
            ("UUID".into(), g.uuid.clone()),
            ("pci_bus_id".into(), g.pci_bus_id.clone()),
            ("device".into(), format!("nvidia{}", r.gpu)),
            ("modelName".into(), g.model_name.clone()),
            ("DCGM_FI_DRIVER_VERSION".into(), g.driver_version.clone()),
        ];
        match r.label {
            None => {}
            Some(SeriesLabel::Xid(x)) => labels.push(("xid".into(), x.to_string())),
            Some(SeriesLabel::GpuInstance(i)) => labels.push(("GPU_I_ID".into(), i.to_string())),
        }
        let id = self.series.len() as u32;
        self.series.push(SeriesSpec {
            metric: r.metric.name().to_string(),
            labels,
        });
        self.ids.insert(key, id);
        id
    }
}

impl HostFeed for SimHost {
    fn host(&self) -> &HostSpec {
        &self.host
    }

    fn series(&self) -> &[SeriesSpec] {
        &self.series
    }

    fn next_poll(&mut self, out: &mut Vec<(u32, f64)>) -> Option<i64> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        out.clear();
        let mut readings = std::mem::take(&mut self.readings);
        readings.clear();
        // The simulator never fails; a poll it could not take is sent empty.
        let _ = self.sim.sample(&mut readings);
        for r in &readings {
            let id = self.id(r);
            out.push((id, r.value));
        }
        self.readings = readings;
        // A few ms of jitter around the nominal poll time, as a real agent has.
        self.jitter ^= self.jitter << 13;
        self.jitter ^= self.jitter >> 7;
        self.jitter ^= self.jitter << 17;
        let ts = self.next_ts + (self.jitter % 7) as i64;
        self.next_ts += self.interval_ms;
        Some(ts)
    }

    fn polls_left(&self) -> u64 {
        self.left
    }
}

/// A recorded long-format CSV (`labels,timestamp_ms,value`; labels
/// `metric=…;k=v;…`), one host per value of the `source` label (or of `host`
/// when there is none). Each host's timestamps are shifted so that its last
/// poll lands at `end_ms`, as if it had just been recorded: the peers'
/// retention and out-of-bounds checks then treat it like live data.
pub(crate) fn recorded(path: &Path, end_ms: i64) -> anyhow::Result<Vec<Box<dyn HostFeed>>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut hosts: Vec<RecordedHost> = Vec::new();
    let mut host_ix: HashMap<String, usize> = HashMap::new();
    let mut series_ix: HashMap<String, (usize, u32)> = HashMap::new();
    let mut rows: Vec<Vec<(i64, u32, f64)>> = Vec::new();
    for (n, line) in std::io::BufReader::new(file).lines().enumerate() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        if n == 0 && line.starts_with("labels,") {
            continue;
        }
        let mut f = line.rsplitn(3, ',');
        let (Some(value), Some(ts), Some(labels)) = (f.next(), f.next(), f.next()) else {
            bail!(
                "{}:{}: expected labels,timestamp_ms,value",
                path.display(),
                n + 1
            );
        };
        let ts: i64 = ts
            .parse()
            .with_context(|| format!("{}:{}: bad timestamp {ts:?}", path.display(), n + 1))?;
        let value: f64 = value
            .parse()
            .with_context(|| format!("{}:{}: bad value {value:?}", path.display(), n + 1))?;
        let (h, s) = match series_ix.get(labels) {
            Some(&ix) => ix,
            None => {
                let mut metric = None;
                let mut pairs = Vec::new();
                for kv in labels.split(';') {
                    let Some((k, v)) = kv.split_once('=') else {
                        bail!("{}:{}: label {kv:?} is not k=v", path.display(), n + 1);
                    };
                    if k == "metric" {
                        metric = Some(v.to_string());
                    } else {
                        pairs.push((k.to_string(), v.to_string()));
                    }
                }
                let Some(metric) = metric else {
                    bail!("{}:{}: no metric= label", path.display(), n + 1);
                };
                let source = pairs
                    .iter()
                    .find(|(k, _)| k == "source")
                    .or_else(|| pairs.iter().find(|(k, _)| k == "host"))
                    .map(|(_, v)| v.clone())
                    .unwrap_or_else(|| "recorded".into());
                let h = *host_ix.entry(source.clone()).or_insert_with(|| {
                    hosts.push(RecordedHost {
                        host: HostSpec {
                            name: source,
                            cluster: CLUSTER.into(),
                            row: "row-rec".into(),
                            rack: "rack-rec".into(),
                        },
                        series: Vec::new(),
                        polls: Vec::new(),
                        next: 0,
                    });
                    rows.push(Vec::new());
                    hosts.len() - 1
                });
                let s = hosts[h].series.len() as u32;
                hosts[h].series.push(SeriesSpec {
                    metric,
                    labels: pairs,
                });
                series_ix.insert(labels.to_string(), (h, s));
                (h, s)
            }
        };
        rows[h].push((ts, s, value));
    }
    if hosts.is_empty() {
        bail!("{} holds no samples", path.display());
    }
    for (host, mut rows) in hosts.iter_mut().zip(rows) {
        // Stable: a series' samples keep their order within one timestamp.
        rows.sort_by_key(|r| r.0);
        let shift = end_ms - rows.last().map_or(end_ms, |r| r.0) - 1;
        for (ts, s, v) in rows {
            let ts = ts + shift;
            match host.polls.last_mut() {
                Some((t, p)) if *t == ts => p.push((s, v)),
                _ => host.polls.push((ts, vec![(s, v)])),
            }
        }
    }
    Ok(hosts
        .into_iter()
        .map(|h| Box::new(h) as Box<dyn HostFeed>)
        .collect())
}

struct RecordedHost {
    host: HostSpec,
    series: Vec<SeriesSpec>,
    polls: Vec<(i64, Vec<(u32, f64)>)>,
    next: usize,
}

impl HostFeed for RecordedHost {
    fn host(&self) -> &HostSpec {
        &self.host
    }

    fn series(&self) -> &[SeriesSpec] {
        &self.series
    }

    fn next_poll(&mut self, out: &mut Vec<(u32, f64)>) -> Option<i64> {
        let (ts, p) = self.polls.get(self.next)?;
        self.next += 1;
        out.clear();
        out.extend_from_slice(p);
        Some(*ts)
    }

    fn polls_left(&self) -> u64 {
        (self.polls.len() - self.next) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_hosts_have_the_fleet_layout_and_poll_on_the_grid() {
        let fleet = SimFleet {
            gpus: 20,
            interval_ms: 10_000,
            polls: 3,
            end_ms: 1_000_000_000,
            seed: 7,
        };
        let mut feeds = fleet.feeds();
        assert_eq!(feeds.len(), 3, "20 GPUs in hosts of 8");
        assert_eq!(feeds[0].host().name, "host-00000");
        assert_eq!(feeds[0].host().rack, "rack-000");
        let mut out = Vec::new();
        let mut ts = Vec::new();
        while let Some(t) = feeds[2].next_poll(&mut out) {
            ts.push(t);
            // The last host has the 4 GPUs left over.
            let gpus: std::collections::BTreeSet<&str> = out
                .iter()
                .map(|&(s, _)| feeds[2].series()[s as usize].labels[0].1.as_str())
                .collect();
            assert_eq!(gpus.len(), 4);
        }
        assert_eq!(ts.len(), 3);
        for (k, t) in ts.iter().enumerate() {
            let nominal = 1_000_000_000 - 30_000 + k as i64 * 10_000;
            assert!((nominal..nominal + 7).contains(t), "{t} vs {nominal}");
        }
        assert_eq!(feeds[2].polls_left(), 0);
    }

    #[test]
    fn recorded_csv_is_cut_into_hosts_and_shifted_to_end_at_the_given_time() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("r.csv");
        std::fs::write(
            &path,
            "labels,timestamp_ms,value\n\
             metric=power_w;source=a;gpu=0,1000,100.5\n\
             metric=power_w;source=a;gpu=1,1000,99\n\
             metric=power_w;source=b;gpu=0,5000,7\n\
             metric=power_w;source=a;gpu=0,1100,101\n",
        )
        .unwrap();
        let mut feeds = recorded(&path, 10_000).unwrap();
        assert_eq!(feeds.len(), 2);
        assert_eq!(feeds[0].host().name, "a");
        let mut out = Vec::new();
        assert_eq!(feeds[0].next_poll(&mut out), Some(10_000 - 1 - 100));
        assert_eq!(out, vec![(0, 100.5), (1, 99.0)]);
        assert_eq!(feeds[0].next_poll(&mut out), Some(9_999));
        assert_eq!(out, vec![(0, 101.0)]);
        assert_eq!(feeds[0].next_poll(&mut out), None);
        assert_eq!(feeds[1].next_poll(&mut out), Some(9_999));
        assert_eq!(feeds[0].series()[1].metric, "power_w");
        assert_eq!(
            feeds[0].series()[1].labels,
            vec![("source".into(), "a".into()), ("gpu".into(), "1".into())]
        );
        std::fs::write(&path, "labels,timestamp_ms,value\nsource=a,1,2\n").unwrap();
        let e = recorded(&path, 0).err().unwrap().to_string();
        assert!(e.contains("no metric= label"), "{e}");
    }
}
