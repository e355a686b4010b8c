//! Issue #14, series churn, through [`Storage`]: idle series leave the head
//! at a flush, so `max_series` counts live series only; their samples stay
//! readable from segments; a stale ref is refused without storing anything;
//! a series that comes back keeps its duplicate check; WAL replay (with its
//! checkpoint) brings everything back once.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use crate::db::{Storage, StorageConfig};
use crate::series::{Label, SeriesKey};
use crate::{Error, SeriesRef};

const N: usize = 50;
const T0: i64 = 1_700_000_000_000;

fn key(generation: &str, i: usize) -> SeriesKey {
    SeriesKey::new(
        "temp",
        vec![
            Label::new("gen", generation),
            Label::new("gpu", i.to_string()),
        ],
    )
    .unwrap()
}

/// Everything storage answers, by series, in time order.
fn everything(st: &Storage) -> BTreeMap<SeriesKey, Vec<(i64, f64)>> {
    st.select(&[], i64::MIN, i64::MAX)
        .into_iter()
        .map(|s| {
            let (mut t, mut v) = (Vec::new(), Vec::new());
            s.read_into(i64::MIN, i64::MAX, &mut t, &mut v).unwrap();
            (s.key.as_ref().clone(), t.into_iter().zip(v).collect())
        })
        .collect()
}

/// Appends `n` samples per series at 1 s spacing from `t0`; records them in `model`.
fn fill(
    st: &Storage,
    generation: &str,
    refs: &[SeriesRef],
    t0: i64,
    n: i64,
    model: &mut BTreeMap<SeriesKey, Vec<(i64, f64)>>,
) {
    let (mut rs, mut ts, mut vs) = (Vec::new(), Vec::new(), Vec::new());
    for (i, &r) in refs.iter().enumerate() {
        for k in 0..n {
            let (t, v) = (t0 + k * 1000, (i as i64 * 1000 + k) as f64 / 8.0);
            rs.push(r);
            ts.push(t);
            vs.push(v);
            model.entry(key(generation, i)).or_default().push((t, v));
        }
    }
    let out = st.append(&rs, &ts, &vs).unwrap();
    assert_eq!(out.accepted as usize, rs.len());
}

#[test]
fn issue_14_idle_series_leave_the_head_and_the_limit_counts_live_ones() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = StorageConfig::new(dir.path());
    cfg.max_series = N;
    cfg.series_idle = std::time::Duration::ZERO;
    let st = Storage::open(cfg.clone()).unwrap();
    let mut model = BTreeMap::new();

    // Generation "old": the limit exactly, with samples.
    let old = st
        .series_refs((0..N).map(|i| key("old", i)).collect())
        .unwrap();
    fill(&st, "old", &old, T0, 5, &mut model);
    assert!(matches!(
        st.series_ref(key("new", 0)),
        Err(Error::SeriesLimit { limit: N })
    ));
    // Flush 1 writes their samples; flush 2 finds them idle.
    st.flush().unwrap().unwrap();
    assert_eq!(st.metrics().series_evicted.load(Relaxed), 0);
    assert_eq!(st.flush().unwrap(), None, "nothing new to write");
    assert_eq!(st.metrics().series_evicted.load(Relaxed), N as u64);
    assert_eq!(st.stats().head_series, 0);

    // A stale ref stores nothing and says so.
    let e = st.append(&[old[3]], &[T0 + 60_000], &[1.0]).unwrap_err();
    assert!(matches!(e, Error::SeriesEvicted { series_ref } if series_ref == old[3].0));
    assert!(e.is_retryable());

    // Generation "new": the limit again (limit - 1, limit, limit + 1).
    let mut new = st
        .series_refs((0..N - 1).map(|i| key("new", i)).collect())
        .unwrap();
    new.push(st.series_ref(key("new", N - 1)).unwrap());
    assert!(matches!(
        st.series_ref(key("new", N)),
        Err(Error::SeriesLimit { limit: N })
    ));
    assert!(
        new.iter().all(|r| old.iter().all(|o| o.0 < r.0)),
        "refs are never reused"
    );
    fill(&st, "new", &new, T0, 3, &mut model);
    // The old samples are read from segments, the new from the head.
    assert_eq!(everything(&st), model);

    // "new" goes idle too; an old series comes back under a fresh ref and
    // its order check is restored from the segments: a re-sent sample is a
    // duplicate, a new one is stored.
    st.flush().unwrap().unwrap();
    assert_eq!(st.flush().unwrap(), None);
    assert_eq!(st.stats().head_series, 0);
    let back = st.series_ref(key("old", 3)).unwrap();
    assert!(back.0 > new[N - 1].0);
    let out = st
        .append(&[back, back], &[T0 + 2000, T0 + 10_000], &[-1.0, 42.0])
        .unwrap();
    assert_eq!((out.accepted, out.duplicates), (1, 1));
    model
        .get_mut(&key("old", 3))
        .unwrap()
        .push((T0 + 10_000, 42.0));
    assert_eq!(everything(&st), model);

    // A crash (no flush): the WAL, from the last cut's checkpoint on,
    // brings back the one live series and nothing twice; the idle ones
    // the checkpoint still names are not put back in the head.
    drop(st);
    let st = Storage::open(cfg.clone()).unwrap();
    assert_eq!(st.stats().head_series, 1);
    assert_eq!(everything(&st), model);
    // And the same after a flush and another restart.
    st.flush().unwrap().unwrap();
    drop(st);
    let st = Storage::open(cfg).unwrap();
    assert_eq!(everything(&st), model);
}
