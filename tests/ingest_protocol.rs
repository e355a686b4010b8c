//! Bad input on the agent stream: a clear error, a reject for the bad batch,
//! and the rest of the stream unharmed.

use gpulse_proto::v1::{AgentMessage, Batch, Hello, Label, SeriesDef, agent_message, ingest_reply};

use crate::support::{Node, open_stream};

fn batch(
    seq: u64,
    new_series: Vec<SeriesDef>,
    ids: Vec<u32>,
    ts: Vec<i64>,
    values: Vec<f64>,
) -> AgentMessage {
    AgentMessage {
        msg: Some(agent_message::Msg::Batch(Batch {
            seq,
            new_series,
            series_ids: ids,
            timestamps_ms: ts,
            values,
            epoch: 0,
        })),
    }
}

fn def(id: u32, metric: &str) -> SeriesDef {
    SeriesDef {
        id,
        metric: metric.into(),
        labels: vec![Label {
            name: "gpu".into(),
            value: "0".into(),
        }],
    }
}

#[test]
fn bad_batches_are_rejected_and_the_stream_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start(&dir.path().join("data"));
    let url = node.grpc_url.clone();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // A stream that does not start with a hello is refused.
        let (_tx, mut replies) = open_stream(&url, batch(1, vec![], vec![], vec![], vec![])).await;
        let err = replies
            .message()
            .await
            .expect_err("no hello must fail the stream");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(err.message().contains("hello"), "{}", err.message());

        let hello = Hello {
            agent_id: "a".into(),
            host: "proto-host".into(),
            ..Default::default()
        };
        let hello = AgentMessage {
            msg: Some(agent_message::Msg::Hello(hello)),
        };
        let (tx, mut replies) = open_stream(&url, hello).await;
        let mut next = async || replies.message().await.unwrap().unwrap().reply.unwrap();

        // Columns of different lengths.
        tx.send(batch(
            1,
            vec![def(0, "m")],
            vec![0, 0],
            vec![1],
            vec![1.0, 2.0],
        ))
        .await
        .unwrap();
        match next().await {
            ingest_reply::Reply::Reject(r) => {
                assert_eq!(r.seq, 1);
                assert!(r.message.contains("differ in length"), "{}", r.message);
            }
            other => panic!("{other:?}"),
        }
        // An undefined series id; nothing of the batch may be stored.
        tx.send(batch(
            2,
            vec![def(0, "m")],
            vec![0, 9],
            vec![1, 1],
            vec![1.0, 2.0],
        ))
        .await
        .unwrap();
        match next().await {
            ingest_reply::Reply::Reject(r) => {
                assert!(r.message.contains("never defined"), "{}", r.message)
            }
            other => panic!("{other:?}"),
        }
        // The reserved label name.
        let mut bad = def(1, "m2");
        bad.labels.push(Label {
            name: "__name__".into(),
            value: "x".into(),
        });
        tx.send(batch(3, vec![bad], vec![1], vec![1], vec![1.0]))
            .await
            .unwrap();
        assert!(matches!(next().await, ingest_reply::Reply::Reject(_)));

        // The stream still works; a duplicate timestamp is acked but not stored twice.
        tx.send(batch(
            4,
            vec![def(0, "m")],
            vec![0, 0, 0],
            vec![10, 20, 20],
            vec![1.0, 2.0, 3.0],
        ))
        .await
        .unwrap();
        match next().await {
            ingest_reply::Reply::Ack(a) => assert_eq!((a.seq, a.accepted, a.dropped), (4, 2, 1)),
            other => panic!("{other:?}"),
        }

        // With an epoch, a re-sent (agent, epoch, seq) is acked as a duplicate
        // and not stored, even though its timestamps are new; the same seq in
        // another epoch is new data.
        let with_epoch = |seq, epoch, ts: i64| {
            let mut m = batch(seq, vec![], vec![0], vec![ts], vec![7.0]);
            if let Some(agent_message::Msg::Batch(b)) = &mut m.msg {
                b.epoch = epoch;
            }
            m
        };
        for (msg, want) in [
            (with_epoch(5, 0xe1, 30), (5, 1, false)),
            (with_epoch(5, 0xe1, 40), (5, 0, true)),
            (with_epoch(5, 0xe2, 50), (5, 1, false)),
        ] {
            tx.send(msg).await.unwrap();
            match next().await {
                ingest_reply::Reply::Ack(a) => assert_eq!((a.seq, a.accepted, a.duplicate), want),
                other => panic!("{other:?}"),
            }
        }
    });
    let rows = node.sql("SELECT metric, host, gpu, value FROM samples ORDER BY ts");
    let want: Vec<Vec<serde_json::Value>> = [1.0, 2.0, 7.0, 7.0]
        .into_iter()
        .map(|v| vec!["m".into(), "proto-host".into(), "0".into(), v.into()])
        .collect();
    assert_eq!(rows, want);
    let (status, body) = node.sql_raw("SELECT no_such_column FROM samples");
    assert_eq!(status, 400);
    assert_eq!(body["status"], "error");
    node.stop();
}
