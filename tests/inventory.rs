//! The `gpus` inventory table, fed by the agents' hellos: it answers "which
//! hosts run a driver that differs from the fleet majority" in one query,
//! and survives a restart.

use gpulse_proto::v1::{AgentMessage, GpuInfo, Hello, Topology, agent_message, ingest_reply};
use serde_json::Value;

use crate::support::{Node, open_stream};

/// Sends one hello and one empty batch for `host`, and waits for the ack.
async fn announce(url: &str, host: &str, rack: &str, driver: &str) {
    let gpus = (0..2)
        .map(|i| GpuInfo {
            index: i,
            uuid: format!("GPU-{host}-{i}"),
            model_name: "NVIDIA H100 80GB HBM3".into(),
            driver_version: driver.into(),
            serial: format!("{host}{i}"),
            vbios_version: "96.00.89.00.01".into(),
            mig_mode: 1,
            ..Default::default()
        })
        .collect();
    let hello = Hello {
        agent_id: host.into(),
        host: host.into(),
        topology: Some(Topology {
            cluster: "c1".into(),
            row: "row-a".into(),
            rack: rack.into(),
        }),
        gpus,
        agent_version: "test".into(),
    };
    let hello = AgentMessage {
        msg: Some(agent_message::Msg::Hello(hello)),
    };
    let (tx, mut replies) = open_stream(url, hello).await;
    tx.send(AgentMessage {
        msg: Some(agent_message::Msg::Batch(Default::default())),
    })
    .await
    .unwrap();
    let r = replies.message().await.unwrap().unwrap().reply.unwrap();
    assert!(matches!(r, ingest_reply::Reply::Ack(_)), "{r:?}");
}

const MAJORITY: &str = "WITH m AS (SELECT driver_version FROM gpus GROUP BY driver_version \
                        ORDER BY count(*) DESC LIMIT 1) \
                        SELECT DISTINCT host FROM gpus \
                        WHERE driver_version <> (SELECT driver_version FROM m) ORDER BY host";

#[test]
fn gpus_table_finds_the_odd_driver_and_survives_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let node = Node::start(&data);
    let url = node.grpc_url.clone();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    tokio::runtime::Runtime::new().unwrap().block_on(async {
        for (host, rack, driver) in [
            ("node-a", "r1", "550.54.15"),
            ("node-b", "r1", "550.54.15"),
            ("node-c", "r2", "550.54.15"),
            ("node-d", "r2", "535.161.08"),
        ] {
            announce(&url, host, rack, driver).await;
        }
    });
    let odd = node.sql(MAJORITY);
    assert_eq!(odd, vec![vec![Value::from("node-d")]]);

    let rows = node.sql(
        "SELECT host, gpu, uuid, rack, serial, mig_mode, \
         CAST(first_seen AS BIGINT), CAST(last_seen AS BIGINT) FROM gpus ORDER BY host, gpu",
    );
    assert_eq!(rows.len(), 8);
    assert_eq!(rows[7][0], "node-d");
    assert_eq!(rows[7][1], "1");
    assert_eq!(rows[7][2], "GPU-node-d-1");
    assert_eq!(rows[7][3], "r2");
    assert_eq!(rows[7][4], "node-d1");
    assert_eq!(rows[7][5], "disabled");
    for r in &rows {
        let (first, last) = (r[6].as_i64().unwrap(), r[7].as_i64().unwrap());
        assert!(before <= first && first <= last, "{r:?}");
    }

    node.stop();
    let node = Node::start(&data);
    assert_eq!(node.sql(MAJORITY), vec![vec![Value::from("node-d")]]);
    assert_eq!(
        node.sql("SELECT count(*) FROM gpus"),
        vec![vec![Value::from(8)]]
    );
    node.stop();
}
