use gpulse_proto::prometheus::{Label as PromLabel, Sample, TimeSeries};
use prost::Message;

use storage::admission::SampleWindow;

use super::*;

#[test]
fn series_keys_keep_label_names_as_sent() {
    let l = |n: &str, v: &str| (n.to_string(), v.to_string());
    let limits = LabelLimits::default();
    let key = series_key(
        vec![
            l("Hostname", "a"),
            l("__name__", "DCGM_FI_DEV_GPU_TEMP"),
            l("hostname", "b"),
            l("UUID", "GPU-1"),
            l("empty", ""),
        ],
        &limits,
    )
    .unwrap();
    assert_eq!(key.metric(), "DCGM_FI_DEV_GPU_TEMP");
    assert_eq!(key.get("Hostname"), Some("a"));
    assert_eq!(key.get("hostname"), Some("b"));
    assert_eq!(key.get("UUID"), Some("GPU-1"));
    assert_eq!(key.get("empty"), None, "an empty value is an absent label");

    assert!(
        series_key(vec![l("gpu", "0")], &limits)
            .unwrap_err()
            .1
            .contains("no __name__")
    );
    assert!(
        series_key(vec![l("__name__", "a"), l("__name__", "b")], &limits)
            .unwrap_err()
            .1
            .contains("more than once")
    );
    assert!(
        series_key(
            vec![l("__name__", "a"), l("gpu", "0"), l("gpu", "1")],
            &limits
        )
        .unwrap_err()
        .1
        .contains("more than once")
    );
}

/// A series to write: labels and samples.
type TestSeries = (Vec<(String, String)>, Vec<(i64, f64)>);

fn prom_request(series: &[TestSeries]) -> Vec<u8> {
    gpulse_proto::prometheus::WriteRequest {
        timeseries: series
            .iter()
            .map(|(labels, samples)| TimeSeries {
                labels: labels
                    .iter()
                    .map(|(n, v)| PromLabel {
                        name: n.clone(),
                        value: v.clone(),
                    })
                    .collect(),
                samples: samples
                    .iter()
                    .map(|&(timestamp, value)| Sample { value, timestamp })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
    .encode_to_vec()
}

proptest::proptest! {
    /// The zero-copy reader takes every body prost takes and decodes it as
    /// prost does, labels and samples bit for bit.
    #[test]
    fn the_raw_reader_agrees_with_prost(
        series in proptest::collection::vec((
            proptest::collection::vec(("[a-zA-Z_]{0,6}", "[a-z0-9é]{0,5}"), 0..5),
            proptest::collection::vec((proptest::num::i64::ANY, proptest::num::f64::ANY), 0..4),
        ), 0..6),
        cut in proptest::option::of(0usize..400),
        flip in proptest::option::of((0usize..400, 0u8..8)),
    ) {
        let mut body = prom_request(&series);
        if let Some(c) = cut { body.truncate(c.min(body.len())); }
        if let Some((i, bit)) = flip && i < body.len() { body[i] ^= 1 << bit; }
        let prost = gpulse_proto::prometheus::WriteRequest::decode(body.as_slice());
        let mut raw = wire::RawWrite::default();
        let ours = raw.read(&body);
        match prost {
            // Refused by prost: the reader may still take it when only a
            // field it skips (exemplars, metadata) is malformed.
            Err(_) => {}
            Ok(req) => {
                proptest::prop_assert!(ours.is_ok(), "{ours:?}");
                proptest::prop_assert_eq!(req.timeseries.len(), raw.series.len());
                for (p, r) in req.timeseries.iter().zip(&raw.series) {
                    let labels = wire::labels(&raw.label_bytes[r.labels.clone()]).unwrap();
                    let want: Vec<(String, String)> =
                        p.labels.iter().map(|l| (l.name.clone(), l.value.clone())).collect();
                    proptest::prop_assert_eq!(labels, want);
                    let got: Vec<(i64, u64)> = raw.timestamps[r.samples.clone()]
                        .iter()
                        .zip(&raw.values[r.samples.clone()])
                        .map(|(&t, v)| (t, v.to_bits()))
                        .collect();
                    let want: Vec<(i64, u64)> =
                        p.samples.iter().map(|s| (s.timestamp, s.value.to_bits())).collect();
                    proptest::prop_assert_eq!(got, want);
                    proptest::prop_assert_eq!(r.histograms, !p.histograms.is_empty());
                }
            }
        }
    }
}

#[test]
fn cached_label_sets_are_exact_and_bad_labels_are_refused_cached_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(storage::StorageConfig::new(dir.path())).unwrap());
    let remote = Remote {
        storage: storage.clone(),
        config: RemoteWriteConfig::default(),
        metrics: Arc::default(),
        cache: SeriesCache::default(),
        cluster: None,
        forward_tls: None,
    };
    let l = |n: &str, v: &str| (n.to_string(), v.to_string());
    let write = |series: &[TestSeries]| {
        let body = snap::raw::Encoder::new()
            .compress_vec(&prom_request(series))
            .unwrap();
        write_blocking(&remote, &body, false)
    };
    let a = vec![l("__name__", "m"), l("gpu", "0")];
    let b = vec![l("__name__", "m"), l("gpu", "1")];
    // The same labels in another order are the same series, cached twice.
    let a2 = vec![l("gpu", "0"), l("__name__", "m")];
    write(&[(a.clone(), vec![(1, 1.0)]), (b.clone(), vec![(1, 10.0)])]).unwrap();
    write(&[
        (a.clone(), vec![(2, 2.0)]),
        (a2, vec![(3, 3.0)]),
        (b.clone(), vec![(2, 20.0)]),
    ])
    .unwrap();
    assert_eq!(remote.cache.map.lock().unwrap().refs.len(), 3);
    let read = |gpu: &str| {
        let mut all = Vec::new();
        for s in storage.select(&[storage::Matcher::equal("gpu", gpu)], i64::MIN, i64::MAX) {
            let (mut ts, mut values) = (Vec::new(), Vec::new());
            s.read_into(i64::MIN, i64::MAX, &mut ts, &mut values)
                .unwrap();
            all.extend(ts.into_iter().zip(values));
        }
        all
    };
    assert_eq!(read("0"), vec![(1, 1.0), (2, 2.0), (3, 3.0)]);
    assert_eq!(read("1"), vec![(1, 10.0), (2, 20.0)]);
    // A bad label set is refused every time: it never enters the cache.
    let dup = vec![l("__name__", "m"), l("gpu", "0"), l("gpu", "0")];
    for _ in 0..2 {
        let e = write(&[(dup.clone(), vec![(9, 9.0)])]).unwrap_err();
        assert_eq!(e.0, StatusCode::BAD_REQUEST);
        assert!(e.1.contains("more than once"), "{}", e.1);
    }
    assert_eq!(
        read("0").len(),
        3,
        "nothing of the refused request is stored"
    );
}

fn test_remote(limits: WriteLimits) -> (tempfile::TempDir, Remote) {
    let dir = tempfile::tempdir().unwrap();
    let storage = Arc::new(Storage::open(storage::StorageConfig::new(dir.path())).unwrap());
    let remote = Remote {
        storage,
        config: RemoteWriteConfig {
            limits,
            ..RemoteWriteConfig::default()
        },
        metrics: Arc::default(),
        cache: SeriesCache::default(),
        cluster: None,
        forward_tls: None,
    };
    (dir, remote)
}

fn write_series(remote: &Remote, series: &[TestSeries]) -> Result<(), HttpError> {
    let body = snap::raw::Encoder::new()
        .compress_vec(&prom_request(series))
        .unwrap();
    write_blocking(remote, &body, false)
}

/// Every stored (ts, value) of metric `m`, in time order.
fn stored(remote: &Remote, m: &str) -> Vec<(i64, f64)> {
    let mut all = Vec::new();
    for s in remote.storage.select(
        &[storage::Matcher::equal("__name__", m)],
        i64::MIN,
        i64::MAX,
    ) {
        let (mut ts, mut values) = (Vec::new(), Vec::new());
        s.read_into(i64::MIN, i64::MAX, &mut ts, &mut values)
            .unwrap();
        all.extend(ts.into_iter().zip(values));
    }
    all.sort_by_key(|p| p.0);
    all
}

/// Issue #14: one sample at -2^63 was accepted (204) and wedged every
/// later flush. Samples outside the window are refused with 400, counted
/// by reason, and the rest of the request is stored.
#[test]
fn samples_outside_the_window_are_refused_and_the_rest_stored() {
    use storage::admission::Reason;
    let (_dir, remote) = test_remote(WriteLimits {
        window: SampleWindow {
            max_age: Some(std::time::Duration::from_secs(3600)),
            max_future: std::time::Duration::from_secs(600),
        },
        ..WriteLimits::default()
    });
    let now = storage::admission::now_ms();
    let l = |n: &str, v: &str| (n.to_string(), v.to_string());
    let good = vec![l("__name__", "good")];
    let mixed = vec![l("__name__", "mixed"), l("gpu", "0")];
    let e = write_series(
        &remote,
        &[
            (good.clone(), vec![(now - 1000, 1.0), (now, 2.0)]),
            (
                mixed.clone(),
                vec![
                    (i64::MIN, 3.0),
                    (now - 2 * 3_600_000, 4.0),
                    (now + 60_000, 5.0),
                    (now + 3_600_000, 6.0),
                    (i64::MAX, 7.0),
                ],
            ),
        ],
    )
    .unwrap_err();
    assert_eq!(e.0, StatusCode::BAD_REQUEST);
    assert!(e.1.contains("4 of 7 samples"), "{}", e.1);
    assert!(
        e.1.contains(&i64::MIN.to_string()),
        "names the first: {}",
        e.1
    );
    assert!(e.1.contains("mixed"), "names the series: {}", e.1);
    assert!(e.1.contains("the others are stored"), "{}", e.1);
    let c = &remote.metrics.samples_rejected;
    assert_eq!(c.get(Reason::TooOld), 2);
    assert_eq!(c.get(Reason::TooFarInFuture), 2);
    assert_eq!(stored(&remote, "good"), vec![(now - 1000, 1.0), (now, 2.0)]);
    assert_eq!(stored(&remote, "mixed"), vec![(now + 60_000, 5.0)]);
    // A series whose every sample is refused is not even created.
    write_series(&remote, &[(vec![l("__name__", "never")], vec![(-1, 1.0)])]).unwrap_err();
    assert!(
        remote
            .storage
            .select(
                &[storage::Matcher::equal("__name__", "never")],
                i64::MIN,
                i64::MAX
            )
            .is_empty()
    );
    // Flush works afterwards: nothing poisonous reached storage.
    remote.storage.flush().unwrap();
    write_series(&remote, &[(good, vec![(now + 1, 9.0)])]).unwrap();
    assert_eq!(stored(&remote, "good").len(), 3);
}

/// The window's edges: limit − 1, limit and limit + 1 on both sides, with
/// a fixed window far from the wall clock's drift (bounds are taken per
/// request, so allow the clock to move by a second between them).
#[test]
fn window_edges() {
    let (_dir, remote) = test_remote(WriteLimits {
        window: SampleWindow {
            max_age: Some(std::time::Duration::from_secs(3600)),
            max_future: std::time::Duration::from_secs(600),
        },
        ..WriteLimits::default()
    });
    let l = |n: &str| vec![("__name__".to_string(), n.to_string())];
    let now = storage::admission::now_ms();
    // 5 s of slack for the clock moving between here and the request.
    let (oldest, newest) = (now - 3_600_000, now + 600_000);
    assert!(write_series(&remote, &[(l("a"), vec![(oldest + 5000, 1.0)])]).is_ok());
    assert!(write_series(&remote, &[(l("b"), vec![(oldest - 5000, 1.0)])]).is_err());
    assert!(write_series(&remote, &[(l("c"), vec![(newest - 5000, 1.0)])]).is_ok());
    assert!(write_series(&remote, &[(l("d"), vec![(newest + 5000, 1.0)])]).is_err());
}

#[test]
fn label_limits_are_those_of_grpc_ingest_at_each_edge() {
    use storage::admission::Reason;
    let limits = LabelLimits {
        max_labels: 4,
        max_label_bytes: 16,
    };
    let (_dir, remote) = test_remote(WriteLimits {
        labels: limits,
        ..WriteLimits::default()
    });
    let l = |n: &str, v: &str| (n.to_string(), v.to_string());
    // Labels besides __name__: 3, 4 (the limit) and 5.
    for (k, ok) in [(3, true), (4, true), (5, false)] {
        let mut labels = vec![l("__name__", &format!("count{k}"))];
        labels.extend((0..k).map(|i| l(&format!("l{i}"), "v")));
        let r = write_series(&remote, &[(labels, vec![(1000, 1.0)])]);
        assert_eq!(r.is_ok(), ok, "{k} labels: {r:?}");
        if let Err(e) = r {
            assert_eq!(e.0, StatusCode::BAD_REQUEST);
            assert!(e.1.contains("5 labels, over the limit of 4"), "{}", e.1);
        }
    }
    // Name, value and metric name of 15, 16 (the limit) and 17 bytes.
    for (n, ok) in [(15, true), (16, true), (17, false)] {
        let x = "x".repeat(n);
        for labels in [
            vec![l("__name__", "m"), l(&x, "v")],
            vec![l("__name__", "m"), l("name", &x)],
            vec![l("__name__", &x)],
        ] {
            let r = write_series(&remote, &[(labels.clone(), vec![(1000 + n as i64, 1.0)])]);
            assert_eq!(r.is_ok(), ok, "{labels:?}: {r:?}");
            if let Err(e) = r {
                assert!(e.1.contains("over the limit of 16"), "{}", e.1);
            }
        }
    }
    // NUL and empty names are refused; nothing of such a request is stored.
    for labels in [
        vec![l("__name__", "nul"), l("a", "x\0y")],
        vec![l("__name__", "nul"), l("", "v")],
        vec![l("__name__", "nul\0")],
    ] {
        let e = write_series(
            &remote,
            &[
                (labels.clone(), vec![(1000, 1.0)]),
                (vec![l("__name__", "nul_ok")], vec![(1000, 1.0)]),
            ],
        )
        .unwrap_err();
        assert_eq!(e.0, StatusCode::BAD_REQUEST, "{labels:?}");
    }
    assert!(stored(&remote, "nul_ok").is_empty());
    let c = &remote.metrics.samples_rejected;
    assert_eq!(c.get(Reason::TooManyLabels), 1);
    assert_eq!(c.get(Reason::LabelTooLong), 3);
    assert_eq!(c.get(Reason::InvalidLabel), 6);
    // Invalid UTF-8 in a label value: refused by the label decoder.
    let mut raw = prom_request(&[(vec![l("__name__", "m"), l("a", "zz")], vec![(5, 1.0)])]);
    let at = raw.windows(2).position(|w| w == b"zz").unwrap();
    raw[at] = 0xff;
    let body = snap::raw::Encoder::new().compress_vec(&raw).unwrap();
    let e = write_blocking(&remote, &body, false).unwrap_err();
    assert_eq!(e.0, StatusCode::BAD_REQUEST);
    assert!(e.1.contains("UTF-8"), "{}", e.1);
    // After all that, the node still stores.
    write_series(&remote, &[(vec![l("__name__", "after")], vec![(7, 7.0)])]).unwrap();
    assert_eq!(stored(&remote, "after"), vec![(7, 7.0)]);
}

#[test]
fn writes_need_the_protobuf_content_type() {
    use axum::http::{HeaderMap, HeaderValue};
    let h = |pairs: &[(&'static str, &'static str)]| {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_static(v));
        }
        m
    };
    let ok = [
        h(&[("content-type", "application/x-protobuf")]),
        h(&[
            ("content-type", "application/x-protobuf"),
            ("content-encoding", "snappy"),
        ]),
        h(&[(
            "content-type",
            "Application/X-Protobuf; proto=prometheus.WriteRequest",
        )]),
    ];
    for m in ok {
        assert!(check_media(&m).is_ok(), "{m:?}");
    }
    let refused = [
        h(&[]),
        h(&[("content-type", "text/plain")]),
        h(&[("content-type", "application/x-www-form-urlencoded")]),
        h(&[("content-type", "multipart/form-data; boundary=x")]),
        h(&[(
            "content-type",
            "application/x-protobuf;proto=io.prometheus.write.v2.Request",
        )]),
        h(&[
            ("content-type", "application/x-protobuf"),
            ("content-encoding", "gzip"),
        ]),
    ];
    for m in refused {
        let e = check_media(&m).unwrap_err();
        assert_eq!(e.0, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{m:?}");
    }
}

#[test]
fn bodies_over_the_limit_are_413_and_broken_ones_400() {
    let (_dir, mut remote) = test_remote(WriteLimits::default());
    remote.config.max_request_bytes = 1 << 20;
    // A snappy header that claims 2^32 - 1 bytes, and nothing after it.
    let e = write_blocking(&remote, &[0xff, 0xff, 0xff, 0xff, 0x0f], false).unwrap_err();
    assert_eq!(e.0, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(e.1.contains("4294967295"), "{}", e.1);
    let e = write_blocking(
        &remote,
        b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff",
        false,
    )
    .unwrap_err();
    assert_eq!(e.0, StatusCode::BAD_REQUEST);
    // Snappy, but not a WriteRequest.
    let body = snap::raw::Encoder::new().compress_vec(b"\xff\xff").unwrap();
    let e = write_blocking(&remote, &body, false).unwrap_err();
    assert_eq!(e.0, StatusCode::BAD_REQUEST);
    assert!(e.1.contains("prometheus.WriteRequest"), "{}", e.1);
}
