//! Storage as a state machine, against a model of what it acknowledged.
//!
//! The input is a sequence of operations on a fresh `Storage` (in a tempdir
//! on /dev/shm where there is one): append a batch to a few series
//! (timestamps near anchors that include the ends of the storable range and
//! beyond, values as arbitrary bit patterns, NaN payloads included), flush,
//! compact, enforce retention, one round of upkeep, close and reopen. The
//! model is one map per series from timestamp to value bits, filled by the
//! documented ordering rule (storage/src/head.rs): a sample is stored if no
//! sample with its timestamp is, and if it is at most the out-of-order
//! window behind the series' newest stored sample; the first write wins. A
//! batch with a timestamp outside `MIN_TS_MS..=MAX_TS_MS` is refused whole.
//!
//! Checks: the accepted count of every append is the model's; no flush,
//! compaction or reopen fails; after each reopen and at the end, every
//! series reads back exactly the model, bit for bit. Retention may drop
//! samples older than its cutoff (a segment at a time, so some stay): those
//! are not required, and appends below the highest cutoff so far are left
//! out of batches (whether they are duplicates depends on which segments
//! retention happened to drop).
#![no_main]

use std::collections::BTreeMap;
use std::time::Duration;

use libfuzzer_sys::arbitrary::{Result as AResult, Unstructured};
use libfuzzer_sys::fuzz_target;
use storage::{Error, Label, Matcher, SeriesKey, SeriesRef, Storage, StorageConfig};

const SERIES: usize = 3;
const OOO_WINDOW_MS: i64 = 600_000;
const RETENTION: Duration = Duration::from_secs(86_400);
const ANCHORS: [i64; 8] = [
    0,
    1_700_000_000_000,
    storage::MIN_TS_MS,
    storage::MAX_TS_MS,
    storage::MIN_TS_MS - 1,
    storage::MAX_TS_MS + 1,
    i64::MIN,
    i64::MAX,
];

#[derive(Debug)]
enum Op {
    Append(Vec<(usize, i64, u64)>),
    Flush,
    Compact,
    Retention(i64),
    Upkeep(i64, usize),
    Reopen,
}

fn ts(u: &mut Unstructured<'_>) -> AResult<i64> {
    let anchor = ANCHORS[usize::from(u.arbitrary::<u8>()?) % ANCHORS.len()];
    // Mostly small steps (ms to minutes), so that samples land near each
    // other: in order, duplicates, inside and past the out-of-order window.
    let delta = match u.arbitrary::<u8>()? % 4 {
        0 => i64::from(u.arbitrary::<i8>()?),
        1 => i64::from(u.arbitrary::<i16>()?) * 1000,
        2 => i64::from(u.arbitrary::<i16>()?) * 60_000,
        _ => i64::from(u.arbitrary::<i32>()?),
    };
    Ok(anchor.saturating_add(delta))
}

fn value_bits(u: &mut Unstructured<'_>) -> AResult<u64> {
    Ok(match u.arbitrary::<u8>()? % 4 {
        0 => u.arbitrary::<u64>()?,
        1 => (u.arbitrary::<u8>()? as f64).to_bits(),
        2 => [
            f64::NAN.to_bits(),
            0x7ff0_0000_0000_0002, // Prometheus's stale marker
            0xfff8_dead_beef_0001, // a negative NaN with a payload
            f64::INFINITY.to_bits(),
            f64::NEG_INFINITY.to_bits(),
            (-0.0f64).to_bits(),
        ][usize::from(u.arbitrary::<u8>()?) % 6],
        _ => 42.0f64.to_bits(),
    })
}

fn ops(u: &mut Unstructured<'_>) -> AResult<Vec<Op>> {
    let mut ops = Vec::new();
    while !u.is_empty() && ops.len() < 64 {
        let op = match u.arbitrary::<u8>()? % 10 {
            0..=4 => {
                let n = usize::from(u.arbitrary::<u8>()? % 32) + 1;
                let mut batch = Vec::with_capacity(n);
                for _ in 0..n {
                    let s = usize::from(u.arbitrary::<u8>()?) % SERIES;
                    batch.push((s, ts(u)?, value_bits(u)?));
                }
                Op::Append(batch)
            }
            5 => Op::Flush,
            6 => Op::Compact,
            7 => Op::Retention(ts(u)?),
            8 => Op::Upkeep(ts(u)?, usize::from(u.arbitrary::<u8>()? % 3)),
            _ => Op::Reopen,
        };
        ops.push(op);
    }
    Ok(ops)
}

fn key(i: usize) -> SeriesKey {
    SeriesKey::new(
        "DCGM_FI_DEV_POWER_USAGE",
        vec![Label::new("fuzz", "1"), Label::new("gpu", i.to_string())],
    )
    .expect("valid key")
}

struct Model {
    samples: [BTreeMap<i64, u64>; SERIES],
    /// Retention may have dropped samples below this.
    expired_below: i64,
}

impl Model {
    /// Applies one batch as storage must; returns how many it accepts.
    fn append(&mut self, batch: &[(usize, i64, u64)]) -> u32 {
        let mut accepted = 0;
        for &(s, t, bits) in batch {
            let m = &mut self.samples[s];
            if m.contains_key(&t) {
                continue;
            }
            if let Some((&last, _)) = m.last_key_value()
                && last.saturating_sub(t) > OOO_WINDOW_MS
            {
                continue;
            }
            m.insert(t, bits);
            accepted += 1;
        }
        accepted
    }

    fn retention(&mut self, now_ms: i64) {
        let cutoff = now_ms.saturating_sub(RETENTION.as_millis() as i64);
        self.expired_below = self.expired_below.max(cutoff);
    }

    fn check(&self, storage: &Storage, when: &str) {
        let fuzz = [Matcher::equal("fuzz", "1")];
        let selected = storage.select(&fuzz, i64::MIN, i64::MAX);
        for (i, model) in self.samples.iter().enumerate() {
            let k = key(i);
            let (mut ts, mut vs) = (Vec::new(), Vec::new());
            if let Some(sel) = selected.iter().find(|s| *s.key == k) {
                sel.read_into(i64::MIN, i64::MAX, &mut ts, &mut vs)
                    .unwrap_or_else(|e| panic!("{when}: series {i} does not read: {e}"));
            }
            assert!(
                ts.windows(2).all(|w| w[0] < w[1]),
                "{when}: series {i} reads out of order or twice: {ts:?}"
            );
            let got: BTreeMap<i64, u64> =
                ts.iter().zip(&vs).map(|(&t, v)| (t, v.to_bits())).collect();
            for (t, bits) in &got {
                if *t < self.expired_below {
                    continue;
                }
                assert_eq!(
                    model.get(t),
                    Some(bits),
                    "{when}: series {i} at {t}: storage holds {bits:#x}, the model {:?}",
                    model.get(t)
                );
            }
            for (t, bits) in model.range(self.expired_below..) {
                assert_eq!(
                    got.get(t),
                    Some(bits),
                    "{when}: series {i} lost the sample at {t} ({bits:#x})"
                );
            }
        }
    }
}

fn config(dir: &std::path::Path) -> StorageConfig {
    let mut c = StorageConfig::new(dir);
    c.ooo_window = Duration::from_millis(OOO_WINDOW_MS as u64);
    c.retention = Some(RETENTION);
    // Idle series leave the head at every other flush: eviction and the
    // ordering rule restored from segments are exercised too.
    c.series_idle = Duration::ZERO;
    c.max_chunk_samples = 8;
    c
}

fn tempdir() -> tempfile::TempDir {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() {
        tempfile::tempdir_in(shm).expect("tempdir")
    } else {
        tempfile::tempdir().expect("tempdir")
    }
}

fn append(
    storage: &Storage,
    refs: &[SeriesRef],
    batch: &[(usize, i64, u64)],
) -> storage::Result<u32> {
    let r: Vec<SeriesRef> = batch.iter().map(|&(s, _, _)| refs[s]).collect();
    let t: Vec<i64> = batch.iter().map(|&(_, t, _)| t).collect();
    let v: Vec<f64> = batch.iter().map(|&(_, _, b)| f64::from_bits(b)).collect();
    storage.append(&r, &t, &v).map(|o| o.accepted)
}

fuzz_target!(|data: &[u8]| {
    let Ok(ops) = ops(&mut Unstructured::new(data)) else {
        return;
    };
    let dir = tempdir();
    let config = config(dir.path());
    let mut storage = Storage::open(config.clone()).expect("open a new storage");
    let keys: Vec<SeriesKey> = (0..SERIES).map(key).collect();
    let mut model = Model {
        samples: Default::default(),
        expired_below: i64::MIN,
    };
    for (n, op) in ops.into_iter().enumerate() {
        match op {
            Op::Append(mut batch) => {
                batch.retain(|&(_, t, _)| t >= model.expired_below);
                let refs = storage.series_refs(keys.clone()).expect("three series fit");
                let out_of_range = batch.iter().any(|&(_, t, _)| !storage::ts_storable(t));
                match append(&storage, &refs, &batch) {
                    Ok(accepted) => {
                        assert!(
                            !out_of_range,
                            "op {n}: a batch with a timestamp out of range was stored"
                        );
                        let expected = model.append(&batch);
                        assert_eq!(accepted, expected, "op {n}: accepted samples of {batch:?}");
                    }
                    Err(Error::BadBatch { .. }) if out_of_range => {}
                    Err(e) => panic!("op {n}: append failed: {e}"),
                }
            }
            Op::Flush => {
                storage
                    .flush()
                    .unwrap_or_else(|e| panic!("op {n}: flush failed: {e}"));
            }
            Op::Compact => {
                storage
                    .compact()
                    .unwrap_or_else(|e| panic!("op {n}: compaction failed: {e}"));
            }
            Op::Retention(now) => {
                storage.enforce_retention(now);
                model.retention(now);
            }
            Op::Upkeep(now, max) => {
                let report = storage.upkeep(now, max);
                model.retention(now);
                if let Err(e) = report.flush {
                    panic!("op {n}: upkeep's flush failed: {e}");
                }
                if let Some(e) = report.compaction_error {
                    panic!("op {n}: upkeep's compaction failed: {e}");
                }
            }
            Op::Reopen => {
                drop(storage);
                storage = Storage::open(config.clone())
                    .unwrap_or_else(|e| panic!("op {n}: reopen failed: {e}"));
                model.check(&storage, &format!("after the reopen of op {n}"));
            }
        }
    }
    model.check(&storage, "at the end");
    drop(storage);
    let storage = Storage::open(config).expect("the last reopen");
    model.check(&storage, "after the last reopen");
});
