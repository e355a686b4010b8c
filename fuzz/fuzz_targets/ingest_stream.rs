//! The ingest service's handling of agent streams, with no network: a few
//! streams, one after the other, of hellos, batches, backlogs, protobuf
//! decoded from raw bytes and flushes between messages, through
//! `IngestService::run_messages` (the per-stream state machine of the gRPC
//! `Stream` call) over a real storage in a tempdir.
//!
//! Checks: no panic; every reply answers its batch's seq; a batch is acked
//! as a duplicate exactly when its (agent, epoch) already stored that seq
//! or a later one; each acked batch's accepted count is what the ordering
//! rule gives (first write wins, 10 min out-of-order window); and at the
//! end, after a flush and a reopen, storage holds exactly the samples of
//! the acked batches, bit for bit, and nothing of the rejected ones.
#![no_main]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use gpulse_proto::v1::{
    AgentMessage, Backlog, Batch, Hello, Label as PLabel, OwnerBacklog, SeriesDef, Topology,
    agent_message, ingest_reply,
};
use ingest::{IngestConfig, IngestService};
use libfuzzer_sys::arbitrary::{Result as AResult, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use storage::{Label, SeriesKey, Storage, StorageConfig};

const OOO_WINDOW_MS: i64 = 600_000;

const WORDS: [&str; 10] = [
    "",
    "gpu",
    "0",
    "Hostname",
    "__name__",
    "DCGM_FI_DEV_GPU_TEMP",
    "a\0b",
    "é\u{202e}",
    "rack-1",
    "1bad name",
];

fn word(u: &mut Unstructured<'_>) -> AResult<String> {
    Ok(match u.arbitrary::<u8>()? % 8 {
        0 => u.arbitrary::<String>()?,
        1 => "x".repeat(usize::from(u.arbitrary::<u16>()? % 700)),
        _ => WORDS[usize::from(u.arbitrary::<u8>()?) % WORDS.len()].to_owned(),
    })
}

enum Item {
    Msg(AgentMessage),
    Flush,
}

fn hello(u: &mut Unstructured<'_>) -> AResult<Hello> {
    Ok(Hello {
        agent_id: ["agent-a", "agent-b"][usize::from(u.arbitrary::<bool>()?)].to_owned()
            + &if u.ratio(1, 8)? {
                word(u)?
            } else {
                String::new()
            },
        host: if u.ratio(1, 4)? {
            word(u)?
        } else {
            "host-1".to_owned()
        },
        topology: if u.arbitrary()? {
            Some(Topology {
                cluster: word(u)?,
                row: word(u)?,
                rack: word(u)?,
            })
        } else {
            None
        },
        gpus: Vec::new(),
        agent_version: String::new(),
    })
}

fn batch(u: &mut Unstructured<'_>, now_ms: i64) -> AResult<Batch> {
    let mut new_series = Vec::new();
    for _ in 0..u.arbitrary::<u8>()? % 4 {
        let mut labels = Vec::new();
        for _ in 0..u.arbitrary::<u8>()? % 3 {
            labels.push(PLabel {
                name: if u.arbitrary()? {
                    "gpu".to_owned()
                } else {
                    word(u)?
                },
                value: word(u)?,
            });
        }
        new_series.push(SeriesDef {
            id: u32::from(u.arbitrary::<u8>()? % 6),
            metric: if u.ratio(3, 4)? {
                "DCGM_FI_DEV_GPU_TEMP".to_owned()
            } else {
                word(u)?
            },
            labels,
        });
    }
    let n = usize::from(u.arbitrary::<u8>()? % 16);
    let (mut ids, mut ts, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        ids.push(u32::from(u.arbitrary::<u8>()? % 6));
        ts.push(match u.arbitrary::<u8>()? % 8 {
            0 => u.arbitrary::<i64>()?,
            1 => now_ms.saturating_add(i64::from(u.arbitrary::<i32>()?) * 1000),
            2..=4 => now_ms + i64::from(u.arbitrary::<i16>()?) * 1000,
            _ => now_ms + i64::from(u.arbitrary::<i8>()?),
        });
        vs.push(f64::from_bits(if u.arbitrary()? {
            u.arbitrary::<u64>()?
        } else {
            u64::from(u.arbitrary::<u8>()?)
        }));
    }
    // Now and then, columns of different lengths.
    if u.ratio(1, 16)? {
        ts.pop();
    }
    Ok(Batch {
        seq: u64::from(u.arbitrary::<u8>()? % 8),
        new_series,
        series_ids: ids,
        timestamps_ms: ts,
        values: vs,
        epoch: u64::from(u.arbitrary::<u8>()? % 3),
    })
}

fn streams(u: &mut Unstructured<'_>, now_ms: i64) -> AResult<Vec<Vec<Item>>> {
    let mut streams = Vec::new();
    for _ in 0..1 + u.arbitrary::<u8>()? % 3 {
        let mut items = Vec::new();
        if u.ratio(15, 16)? {
            items.push(Item::Msg(AgentMessage {
                msg: Some(agent_message::Msg::Hello(hello(u)?)),
            }));
        }
        for _ in 0..u.arbitrary::<u8>()? % 12 {
            let msg = match u.arbitrary::<u8>()? % 16 {
                0 => Some(agent_message::Msg::Hello(hello(u)?)),
                1 => Some(agent_message::Msg::Backlog(Backlog {
                    owners: vec![OwnerBacklog {
                        node_id: word(u)?,
                        batches: u.arbitrary()?,
                    }],
                })),
                2 => None,
                3 => {
                    items.push(Item::Flush);
                    continue;
                }
                4 => {
                    let len = usize::from(u.arbitrary::<u8>()?);
                    match AgentMessage::decode(u.bytes(len.min(u.len()))?) {
                        Ok(m) => m.msg,
                        Err(_) => continue,
                    }
                }
                _ => Some(agent_message::Msg::Batch(batch(u, now_ms)?)),
            };
            items.push(Item::Msg(AgentMessage { msg }));
        }
        streams.push(items);
    }
    Ok(streams)
}

/// The key the service gives a series: the definition's labels, then the
/// stream's (Hostname and topology).
fn key_of(hello: &Hello, def: &SeriesDef) -> Option<SeriesKey> {
    let topo = hello.topology.clone().unwrap_or_default();
    let mut labels: Vec<Label> = def
        .labels
        .iter()
        .map(|l| Label::new(&l.name, &l.value))
        .collect();
    for (name, value) in [
        ("Hostname", &hello.host),
        ("cluster", &topo.cluster),
        ("row", &topo.row),
        ("rack", &topo.rack),
    ] {
        labels.push(Label::new(name, value.clone()));
    }
    SeriesKey::new(&def.metric, labels).ok()
}

#[derive(Default)]
struct Model {
    samples: HashMap<SeriesKey, BTreeMap<i64, u64>>,
    /// Highest seq stored per producer (agent id, epoch).
    hwm: HashMap<(String, u64), u64>,
}

impl Model {
    fn is_duplicate(&self, agent: &str, b: &Batch) -> bool {
        // A producer's mark starts at 0 (it numbers batches from 1), so a
        // seq 0 with an epoch is a duplicate from the start.
        let hwm = self
            .hwm
            .get(&(agent.to_owned(), b.epoch))
            .copied()
            .unwrap_or(0);
        b.epoch != 0 && b.seq <= hwm
    }

    fn store(&mut self, agent: &str, keys: &HashMap<u32, SeriesKey>, b: &Batch) -> u32 {
        if b.epoch != 0 {
            self.hwm.insert((agent.to_owned(), b.epoch), b.seq);
        }
        let mut accepted = 0;
        for ((id, &t), v) in b.series_ids.iter().zip(&b.timestamps_ms).zip(&b.values) {
            let m = self.samples.entry(keys[id].clone()).or_default();
            if m.contains_key(&t) {
                continue;
            }
            if let Some((&last, _)) = m.last_key_value()
                && last.saturating_sub(t) > OOO_WINDOW_MS
            {
                continue;
            }
            m.insert(t, v.to_bits());
            accepted += 1;
        }
        accepted
    }

    fn check(&self, storage: &Storage, when: &str) {
        let mut got: HashMap<SeriesKey, BTreeMap<i64, u64>> = HashMap::new();
        for s in storage.select(&[], i64::MIN, i64::MAX) {
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            s.read_into(i64::MIN, i64::MAX, &mut ts, &mut vs)
                .unwrap_or_else(|e| panic!("{when}: {} does not read: {e}", s.key));
            let m = got.entry((*s.key).clone()).or_default();
            for (t, v) in ts.into_iter().zip(vs) {
                assert!(
                    m.insert(t, v.to_bits()).is_none(),
                    "{when}: {} holds {t} twice",
                    s.key
                );
            }
        }
        got.retain(|_, m| !m.is_empty());
        let want: HashMap<_, _> = self.samples.iter().filter(|(_, m)| !m.is_empty()).collect();
        for (k, m) in &want {
            assert_eq!(got.get(*k), Some(*m), "{when}: the samples of {k}");
        }
        assert_eq!(
            got.len(),
            want.len(),
            "{when}: storage holds series no acked batch wrote"
        );
    }
}

fn tempdir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).expect("tempdir")
    } else {
        tempfile::tempdir().expect("tempdir")
    }
}

fuzz_target!(|data: &[u8]| {
    let now_ms = storage::admission::now_ms();
    let Ok(streams) = streams(&mut Unstructured::new(data), now_ms) else {
        return;
    };
    let dir = tempdir();
    let mut config = StorageConfig::new(dir.path());
    config.ooo_window = Duration::from_millis(OOO_WINDOW_MS as u64);
    config.series_idle = Duration::ZERO;
    let storage = Arc::new(Storage::open(config.clone()).expect("open storage"));
    let service = IngestService::new(storage.clone(), IngestConfig::default());
    let mut model = Model::default();
    for items in streams {
        let msgs: Vec<Option<AgentMessage>> = items
            .iter()
            .map(|i| match i {
                Item::Msg(m) => Some(m.clone()),
                Item::Flush => None,
            })
            .collect();
        let fed = items.into_iter().filter_map(|i| match i {
            Item::Msg(m) => Some(m),
            Item::Flush => {
                storage.flush().expect("flush");
                None
            }
        });
        let (replies, _end) = service.run_messages(fed);
        let mut msgs = msgs.into_iter().flatten();
        let Some(AgentMessage {
            msg: Some(agent_message::Msg::Hello(hello)),
        }) = msgs.next()
        else {
            assert!(replies.is_empty(), "replies on a stream without a hello");
            continue;
        };
        let batches = msgs.filter_map(|m| match m.msg {
            Some(agent_message::Msg::Batch(b)) => Some(b),
            _ => None,
        });
        let mut keys: HashMap<u32, SeriesKey> = HashMap::new();
        for (b, reply) in batches.zip(&replies) {
            match &reply.reply {
                Some(ingest_reply::Reply::Ack(ack)) => {
                    assert_eq!(ack.seq, b.seq, "an ack answers its batch");
                    for def in &b.new_series {
                        let k = key_of(&hello, def).expect("an acked definition makes a key");
                        keys.insert(def.id, k);
                    }
                    let dup = model.is_duplicate(&hello.agent_id, &b);
                    assert_eq!(
                        ack.duplicate, dup,
                        "duplicate flag of seq {} epoch {}",
                        b.seq, b.epoch
                    );
                    if !dup {
                        let expected = model.store(&hello.agent_id, &keys, &b);
                        assert_eq!(ack.accepted, expected, "accepted samples of {b:?}");
                        assert_eq!(ack.dropped as usize, b.series_ids.len() - expected as usize);
                    }
                }
                Some(ingest_reply::Reply::Reject(r)) => assert_eq!(r.seq, b.seq),
                None => panic!("an empty reply"),
            }
        }
    }
    model.check(&storage, "after the streams");
    storage.flush().expect("the last flush");
    drop(service);
    let storage = Arc::try_unwrap(storage).unwrap_or_else(|_| panic!("storage still shared"));
    drop(storage);
    let storage = Storage::open(config).expect("reopen");
    model.check(&storage, "after a flush and a reopen");
});
