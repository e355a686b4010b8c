//! Issue #14, the door and the network edges, against the real binary over
//! real sockets: samples outside the time window and series past the label
//! limits are refused on both protocols (and the node goes on ingesting,
//! flushing and answering), slow and idle HTTP clients are cut off, remote
//! write and admin routes cannot be triggered by a cross-origin web page,
//! and gRPC streams have a hello deadline and a node-wide limit.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use gpulse_proto::prometheus::{Label as PromLabel, Sample, TimeSeries, WriteRequest};
use gpulse_proto::v1::{AgentMessage, Batch, Hello, Label, SeriesDef, agent_message, ingest_reply};
use prost::Message;

use crate::support::{Node, PROTOBUF, http, now_ms, open_stream, post};

/// A snappy-compressed remote-write body of one series `name` (plus
/// `labels`) with `samples`.
fn write_body(name: &str, labels: &[(&str, &str)], samples: &[(i64, f64)]) -> Vec<u8> {
    let mut l = vec![PromLabel {
        name: "__name__".into(),
        value: name.into(),
    }];
    l.extend(labels.iter().map(|(n, v)| PromLabel {
        name: (*n).into(),
        value: (*v).into(),
    }));
    let req = WriteRequest {
        timeseries: vec![TimeSeries {
            labels: l,
            samples: samples
                .iter()
                .map(|&(timestamp, value)| Sample { value, timestamp })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    };
    snap::raw::Encoder::new()
        .compress_vec(&req.encode_to_vec())
        .unwrap()
}

/// The value of the metric line that starts with `line` (name and labels).
fn metric(node: &Node, line: &str) -> u64 {
    let mut resp = http()
        .get(&format!("{}/metrics", node.http_url))
        .call()
        .unwrap();
    let text = resp.body_mut().read_to_string().unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no metric {line} in:\n{text}"))
}

/// Every (ts, value) of metric `m`, over SQL.
fn stored(node: &Node, m: &str) -> Vec<(i64, f64)> {
    node.sql(&format!(
        "SELECT CAST(ts AS BIGINT) AS t, value FROM samples WHERE metric = '{m}' ORDER BY t"
    ))
    .into_iter()
    .map(|r| (r[0].as_i64().unwrap(), r[1].as_f64().unwrap()))
    .collect()
}

fn flush(node: &Node) {
    let (status, body) = post(node, "/api/v1/admin/flush", &[], b"");
    assert_eq!(status, 200, "flush: {body}");
}

/// Issue #14: one remote-write sample at -2^63 was answered 204 and wedged
/// every later flush. Now: 400 naming it, counted, and the node goes on.
#[test]
fn poison_timestamps_are_refused_at_both_doors_and_the_node_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    // The support node runs with --retention 36500d; 1 h here, to test it.
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &["--retention", "1h", "--max-future", "10m"],
    );
    let now = now_ms();
    for (ts, reason) in [
        (i64::MIN, "too_old"),
        (-1, "too_old"),
        (now - 2 * 3_600_000, "too_old"),
        (now + 3_600_000, "too_far_in_future"),
        (i64::MAX, "too_far_in_future"),
    ] {
        let (status, body) = post(
            &node,
            "/api/v1/write",
            PROTOBUF,
            &write_body("poison", &[], &[(ts, 1.0)]),
        );
        assert_eq!(status, 400, "ts {ts}: {body}");
        assert!(body.contains(&ts.to_string()), "names the sample: {body}");
        assert!(body.contains(if reason == "too_old" {
            "too old"
        } else {
            "future"
        }));
        flush(&node);
    }
    assert_eq!(
        metric(
            &node,
            "gpulse_remote_write_samples_rejected_total{reason=\"too_old\"}"
        ),
        3
    );
    assert_eq!(
        metric(
            &node,
            "gpulse_remote_write_samples_rejected_total{reason=\"too_far_in_future\"}"
        ),
        2
    );
    // Good samples next to bad ones are stored; the answer is still 400.
    let (status, body) = post(
        &node,
        "/api/v1/write",
        PROTOBUF,
        &write_body(
            "good",
            &[],
            &[(now - 1000, 1.0), (i64::MIN, 9.0), (now, 2.0)],
        ),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("1 of 3 samples"), "{body}");
    flush(&node);
    assert_eq!(stored(&node, "good"), vec![(now - 1000, 1.0), (now, 2.0)]);
    assert!(stored(&node, "poison").is_empty());

    // gRPC: a batch with one sample outside is rejected whole, the next is acked.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (tx, mut replies) = open_stream(&node.grpc_url, hello("edge-agent", "edge-host")).await;
        let mut next = async || replies.message().await.unwrap().unwrap().reply.unwrap();
        let def = series_def(0, "grpc_m", 1);
        tx.send(batch(
            1,
            vec![def.clone()],
            vec![(now, 1.0), (now + 3_600_000, 2.0)],
        ))
        .await
        .unwrap();
        match next().await {
            ingest_reply::Reply::Reject(r) => {
                assert_eq!(r.seq, 1);
                assert!(r.message.contains("too far in the future"), "{}", r.message);
            }
            other => panic!("{other:?}"),
        }
        tx.send(batch(2, vec![def], vec![(now, 3.0)]))
            .await
            .unwrap();
        match next().await {
            ingest_reply::Reply::Ack(a) => assert_eq!((a.seq, a.accepted), (2, 1)),
            other => panic!("{other:?}"),
        }
    });
    assert_eq!(
        metric(
            &node,
            "gpulse_ingest_samples_rejected_total{reason=\"too_far_in_future\"}"
        ),
        2
    );
    flush(&node);
    assert_eq!(stored(&node, "grpc_m"), vec![(now, 3.0)]);
    node.stop();
}

fn hello(agent_id: &str, host: &str) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Hello(Hello {
            agent_id: agent_id.into(),
            host: host.into(),
            ..Default::default()
        })),
    }
}

/// A series definition with `labels` labels `l0..`.
fn series_def(id: u32, metric: &str, labels: usize) -> SeriesDef {
    SeriesDef {
        id,
        metric: metric.into(),
        labels: (0..labels)
            .map(|i| Label {
                name: format!("l{i}"),
                value: "v".into(),
            })
            .collect(),
    }
}

/// A batch of samples of series `new_series[0]`'s id (or 0).
fn batch(seq: u64, new_series: Vec<SeriesDef>, samples: Vec<(i64, f64)>) -> AgentMessage {
    let id = new_series.first().map_or(0, |d| d.id);
    AgentMessage {
        msg: Some(agent_message::Msg::Batch(Batch {
            seq,
            series_ids: vec![id; samples.len()],
            timestamps_ms: samples.iter().map(|s| s.0).collect(),
            values: samples.iter().map(|s| s.1).collect(),
            new_series,
            epoch: 0,
        })),
    }
}

/// One set of label limits for both protocols, at limit − 1, limit and
/// limit + 1: `--max-labels 6` (a gRPC stream adds 4: Hostname, cluster,
/// row, rack) and `--max-label-bytes 16`.
#[test]
fn label_limits_are_the_same_on_both_protocols() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &["--max-labels", "6", "--max-label-bytes", "16"],
    );
    let now = now_ms();
    // Remote write: 5, 6 and 7 labels besides __name__.
    for (k, want) in [(5, 204), (6, 204), (7, 400)] {
        let names: Vec<String> = (0..k).map(|i| format!("l{i}")).collect();
        let labels: Vec<(&str, &str)> = names.iter().map(|n| (n.as_str(), "v")).collect();
        let (status, body) = post(
            &node,
            "/api/v1/write",
            PROTOBUF,
            &write_body(&format!("rw{k}"), &labels, &[(now, 1.0)]),
        );
        assert_eq!(status, want, "{k} labels: {body}");
    }
    // Values of 15, 16 and 17 bytes; a NUL byte; an empty name.
    for (n, want) in [(15, 204), (16, 204), (17, 400)] {
        let v = "x".repeat(n);
        let (status, body) = post(
            &node,
            "/api/v1/write",
            PROTOBUF,
            &write_body("rwlen", &[("gpu", v.as_str())], &[(now, 1.0)]),
        );
        assert_eq!(status, want, "{n} bytes: {body}");
    }
    for labels in [[("gpu", "a\0b")], [("", "v")]] {
        let (status, _) = post(
            &node,
            "/api/v1/write",
            PROTOBUF,
            &write_body("rwbad", &labels, &[(now, 1.0)]),
        );
        assert_eq!(status, 400, "{labels:?}");
    }
    // gRPC: 1, 2 and 3 labels of the definition plus the stream's 4.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let (tx, mut replies) = open_stream(&node.grpc_url, hello("lim", "h")).await;
        let mut next = async || replies.message().await.unwrap().unwrap().reply.unwrap();
        for (k, ok) in [(1usize, true), (2, true), (3, false)] {
            let id = k as u32;
            tx.send(batch(
                id.into(),
                vec![series_def(id, "g", k)],
                vec![(now, 1.0)],
            ))
            .await
            .unwrap();
            match (next().await, ok) {
                (ingest_reply::Reply::Ack(_), true) => {}
                (ingest_reply::Reply::Reject(r), false) => {
                    assert!(
                        r.message.contains("7 labels, over the limit of 6"),
                        "{}",
                        r.message
                    )
                }
                (other, _) => panic!("{k} labels: {other:?}"),
            }
        }
        for (n, ok) in [(15usize, true), (16, true), (17, false)] {
            let mut d = series_def(10 + n as u32, "g", 0);
            d.labels.push(Label {
                name: "gpu".into(),
                value: "y".repeat(n),
            });
            tx.send(batch(10 + n as u64, vec![d], vec![(now, 1.0)]))
                .await
                .unwrap();
            let r = next().await;
            assert_eq!(matches!(r, ingest_reply::Reply::Ack(_)), ok, "{n}: {r:?}");
        }
        let mut d = series_def(40, "g", 0);
        d.labels.push(Label {
            name: "gpu".into(),
            value: "a\0b".into(),
        });
        tx.send(batch(40, vec![d], vec![(now, 1.0)])).await.unwrap();
        assert!(matches!(next().await, ingest_reply::Reply::Reject(_)));
        // agent_id: 16 bytes are fine, 17 close the stream; so does a control character.
        for (id, ok) in [
            ("a".repeat(16), true),
            ("a".repeat(17), false),
            ("a\u{7}".into(), false),
        ] {
            let (tx, mut replies) = open_stream(&node.grpc_url, hello(&id, "h2")).await;
            // The stream may be closed already (a bad hello).
            let _ = tx
                .send(batch(1, vec![series_def(0, "idm", 0)], vec![(now, 1.0)]))
                .await;
            match (replies.message().await, ok) {
                (Ok(Some(_)), true) => {}
                (Err(s), false) => {
                    assert_eq!(s.code(), tonic::Code::InvalidArgument);
                    assert!(s.message().contains("agent_id"), "{}", s.message());
                }
                (other, _) => panic!("agent_id {id:?}: {other:?}"),
            }
        }
    });
    assert_eq!(
        metric(
            &node,
            "gpulse_remote_write_samples_rejected_total{reason=\"too_many_labels\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &node,
            "gpulse_ingest_samples_rejected_total{reason=\"too_many_labels\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &node,
            "gpulse_ingest_samples_rejected_total{reason=\"label_too_long\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &node,
            "gpulse_ingest_streams_refused_total{reason=\"bad_hello\"}"
        ),
        2
    );
    // Still ingesting and answering.
    flush(&node);
    assert_eq!(stored(&node, "rw6").len(), 1);
    assert!(stored(&node, "rw7").is_empty());
    assert_eq!(stored(&node, "g").len(), 4);
    node.stop();
}

/// Reads until the server closes the connection; the time it took, or
/// `None` if it was still open after `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 4096];
    while started.elapsed() < limit {
        match s.read(&mut buf) {
            Ok(0) => return Some(started.elapsed()),
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return Some(started.elapsed()),
        }
    }
    None
}

/// Slowloris: headers sent a byte at a time are cut off at
/// `--http-header-timeout`; headers that arrive within it are served; an
/// idle kept-alive connection is closed after it too.
#[test]
fn slow_and_idle_http_clients_are_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_with_args(&dir.path().join("data"), &["--http-header-timeout", "2s"]);
    let addr = node.http_url.trim_start_matches("http://").to_string();
    // A dribbler: one byte every 100 ms, never done within 2 s.
    let mut slow = TcpStream::connect(&addr).unwrap();
    let request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    let started = Instant::now();
    let mut cut = false;
    for b in request.iter() {
        if slow.write_all(&[*b]).is_err() {
            cut = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if started.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    let took = if cut {
        started.elapsed()
    } else {
        started.elapsed()
            + closed_within(&mut slow, Duration::from_secs(5)).expect("slow client cut off")
    };
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(6),
        "cut after {took:?}"
    );
    // Below the limit: the same headers over 1 s are served.
    let mut ok = TcpStream::connect(&addr).unwrap();
    for chunk in request.chunks(request.len() / 10 + 1) {
        ok.write_all(chunk).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    ok.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 1024];
    let n = ok.read(&mut buf).unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // Kept alive, then idle: closed after about 2 s.
    let idle = closed_within(&mut ok, Duration::from_secs(6)).expect("idle connection closed");
    assert!(idle >= Duration::from_millis(1500), "closed after {idle:?}");
    assert!(metric(&node, "gpulse_http_header_timeouts_total") >= 1);
    // The node is fine.
    assert_eq!(node.sql("SELECT 1 AS one")[0][0].as_i64(), Some(1));
    node.stop();
}

/// What a web page on another origin can send without a CORS preflight
/// (a form, or `fetch` with a simple content type) never writes or flushes.
#[test]
fn cross_origin_simple_requests_cannot_write_or_flush() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let now = now_ms();
    let body = write_body("csrf", &[], &[(now, 1.0)]);
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let (status, msg) = post(&node, "/api/v1/write", &[("content-type", ct)], &body);
        assert_eq!(status, 415, "{ct}: {msg}");
        assert!(msg.contains("application/x-protobuf"), "{msg}");
    }
    let (status, _) = post(&node, "/api/v1/write", &[], &body);
    assert_eq!(status, 415, "no content type");
    assert_eq!(
        metric(
            &node,
            "gpulse_remote_write_requests_unsupported_media_total"
        ),
        4
    );
    let (status, msg) = post(&node, "/api/v1/write", PROTOBUF, &body);
    assert_eq!(status, 204, "{msg}");

    let host = node.http_url.trim_start_matches("http://").to_string();
    let same = format!("http://{host}");
    let refused: [&[(&str, &str)]; 5] = [
        &[("origin", "http://evil.example")],
        &[("origin", "null")],
        &[("sec-fetch-site", "cross-site")],
        &[("content-type", "application/x-www-form-urlencoded")],
        &[("content-type", "text/plain")],
    ];
    for h in refused {
        let (status, msg) = post(&node, "/api/v1/admin/flush", h, b"x=1");
        assert!(status == 403 || status == 415, "{h:?}: {status} {msg}");
    }
    assert_eq!(metric(&node, "gpulse_http_admin_refused_total"), 5);
    let (status, msg) = post(&node, "/api/v1/admin/flush", &[("origin", &same)], b"");
    assert_eq!(status, 200, "{msg}");
    flush(&node);
    assert_eq!(stored(&node, "csrf"), vec![(now, 1.0)]);
    node.stop();
}

/// gRPC: a stream that sends no hello is closed at `--grpc-hello-timeout`
/// with DEADLINE_EXCEEDED; `--grpc-max-streams 2` admits 1 and 2 streams
/// and refuses a third with RESOURCE_EXHAUSTED until one closes.
#[test]
fn grpc_hello_deadline_and_stream_limit() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &["--grpc-hello-timeout", "1s", "--grpc-max-streams", "2"],
    );
    let url = node.grpc_url.replace("grpc://", "http://");
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let mut client = gpulse_proto::v1::ingest_client::IngestClient::connect(url.clone())
            .await
            .unwrap();
        let (_silent_tx, rx) = tokio::sync::mpsc::channel::<AgentMessage>(1);
        let started = Instant::now();
        let mut replies = client
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let e = replies.message().await.expect_err("no hello: closed");
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(900) && took < Duration::from_secs(5),
            "{took:?}"
        );

        // Streams 1 and 2 (the limit) are served; a third is refused.
        let now = now_ms();
        let (a, mut ra) = open_stream(&node.grpc_url, hello("s1", "h1")).await;
        let (b, mut rb) = open_stream(&node.grpc_url, hello("s2", "h2")).await;
        for (tx, r) in [(&a, &mut ra), (&b, &mut rb)] {
            tx.send(batch(1, vec![series_def(0, "sm", 0)], vec![(now, 1.0)]))
                .await
                .unwrap();
            assert!(matches!(
                r.message().await.unwrap().unwrap().reply.unwrap(),
                ingest_reply::Reply::Ack(_)
            ));
        }
        let mut third = gpulse_proto::v1::ingest_client::IngestClient::connect(url.clone())
            .await
            .unwrap();
        let (tx3, rx3) = tokio::sync::mpsc::channel(1);
        tx3.send(hello("s3", "h3")).await.unwrap();
        let e = third
            .stream(tokio_stream::wrappers::ReceiverStream::new(rx3))
            .await
            .expect_err("a third stream is refused");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        // One closes: a new one is served again.
        drop(a);
        assert!(ra.message().await.unwrap().is_none());
        let (c, mut rc) = open_stream(&node.grpc_url, hello("s3", "h3")).await;
        c.send(batch(1, vec![series_def(0, "sm", 0)], vec![(now, 1.0)]))
            .await
            .unwrap();
        assert!(matches!(
            rc.message().await.unwrap().unwrap().reply.unwrap(),
            ingest_reply::Reply::Ack(_)
        ));
        drop((b, c));
    });
    assert_eq!(
        metric(
            &node,
            "gpulse_ingest_streams_refused_total{reason=\"hello_timeout\"}"
        ),
        1
    );
    assert_eq!(
        metric(
            &node,
            "gpulse_ingest_streams_refused_total{reason=\"too_many_streams\"}"
        ),
        1
    );
    node.stop();
}
