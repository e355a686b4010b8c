//! The agent's delivery guarantee, end to end: a real `gpulse agent` streams
//! over real gRPC, through a TCP proxy the test controls, to a real `gpulse
//! serve`. Meanwhile `serve` is SIGKILLed and restarted 5 times, the network
//! is cut for 30 s (a blackhole: connections stay open and carry nothing),
//! and the agent itself is restarted during the outage. Afterwards storage
//! holds exactly the samples the agent produced (its `--record` file): none
//! missing, none twice, every value bit for bit.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arrow::array::AsArray;
use arrow::datatypes::{Float64Type, TimestampMillisecondType};
use rand::{Rng, SeedableRng};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::support::Node;

/// A TCP proxy to a target that may move, with a switch that blackholes
/// every connection, open or new, until it is switched back.
struct Proxy {
    addr: SocketAddr,
    target: Arc<Mutex<SocketAddr>>,
    up: watch::Sender<bool>,
    _rt: tokio::runtime::Runtime,
}

impl Proxy {
    fn start(target: SocketAddr) -> Proxy {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
        let addr = listener.local_addr().unwrap();
        let target = Arc::new(Mutex::new(target));
        let (up, _) = watch::channel(true);
        let (t, u) = (target.clone(), up.clone());
        rt.spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (t, mut u) = (*t.lock().unwrap(), u.subscribe());
                tokio::spawn(async move {
                    // Blackholed: hold the connection open, forward nothing,
                    // and close it when the network comes back.
                    let up = *u.borrow_and_update();
                    if !up {
                        until(&mut u, true).await;
                        return;
                    }
                    let Ok(mut server) = TcpStream::connect(t).await else {
                        return;
                    };
                    let mut client = client;
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = until(&mut u, false) => until(&mut u, true).await,
                    }
                });
            }
        });
        Proxy {
            addr,
            target,
            up,
            _rt: rt,
        }
    }

    fn retarget(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
    }

    fn cut(&self) {
        self.up.send_replace(false);
    }

    fn restore(&self) {
        self.up.send_replace(true);
    }
}

/// Waits until the switch reads `want`.
async fn until(u: &mut watch::Receiver<bool>, want: bool) {
    let _ = u.wait_for(|up| *up == want).await.map(|_| ());
}

fn grpc_addr(node: &Node) -> SocketAddr {
    node.grpc_url.trim_start_matches("grpc://").parse().unwrap()
}

/// A `gpulse agent` process; its stdout is collected by a thread.
struct Agent {
    child: Child,
    metrics_url: String,
    stdout: Arc<Mutex<Vec<String>>>,
}

impl Agent {
    fn start(proxy: SocketAddr, dir: &Path, drain: &str) -> Agent {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_gpulse"))
            .args(["agent", "--simulate", "--gpus", "2", "--seed", "3"])
            .args([
                "--interval",
                "50ms",
                "--host",
                "dl-host",
                "--agent-id",
                "dl-agent",
            ])
            .args(["--ingest", &format!("grpc://{proxy}")])
            .arg("--spool-dir")
            .arg(dir.join("spool"))
            // Two seconds of samples in memory; an outage spills to the spool.
            .args(["--buffer-samples", "2000"])
            .arg("--record")
            .arg(dir.join("produced.csv"))
            .args(["--metrics-listen", "127.0.0.1:0", "--drain-timeout", drain])
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn gpulse agent");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("agent printed nothing").unwrap();
        let metrics_url = first
            .split_whitespace()
            .find(|w| w.starts_with("http://"))
            .unwrap_or_else(|| panic!("no metrics URL in {first:?}"))
            .to_string();
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let out = stdout.clone();
        std::thread::spawn(move || {
            for l in lines.map_while(Result::ok) {
                out.lock().unwrap().push(l);
            }
        });
        Agent {
            child,
            metrics_url,
            stdout,
        }
    }

    /// One metric from the agent's /metrics.
    fn metric(&self, name: &str) -> u64 {
        let body = ureq::get(&self.metrics_url)
            .call()
            .expect("GET /metrics")
            .body_mut()
            .read_to_string()
            .unwrap();
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} not in /metrics"))
    }

    /// SIGTERM; waits for a clean exit and returns what it printed.
    fn stop(mut self) -> Vec<String> {
        let pid = self.child.id().to_string();
        assert!(
            Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success()
        );
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                assert!(status.success(), "agent exited with {status}");
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "agent did not stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(100));
        self.stdout.lock().unwrap().clone()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (metric, gpu, ts) -> value bits, from the agent's record file.
fn produced(path: &Path) -> Vec<((String, String, i64), u64)> {
    let text = std::fs::read_to_string(path).unwrap();
    // The first line is the header `labels,timestamp_ms,value`.
    text.lines()
        .skip(1)
        .map(|line| {
            let mut f = line.rsplitn(3, ',');
            let value: f64 = f.next().unwrap().parse().unwrap();
            let ts: i64 = f.next().unwrap().parse().unwrap();
            let labels: HashMap<&str, &str> = f
                .next()
                .unwrap()
                .split(';')
                .map(|kv| kv.split_once('=').unwrap())
                .collect();
            (
                (labels["metric"].to_string(), labels["gpu"].to_string(), ts),
                value.to_bits(),
            )
        })
        .collect()
}

#[test]
fn agent_delivers_exactly_once_through_crashes_outage_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    // Frequent flushes: the WAL that holds the de-duplication marks is
    // truncated again and again while batches are re-sent.
    let mut node = Node::start_with(&data, "2s");
    let proxy = Proxy::start(grpc_addr(&node));
    let agent = Agent::start(proxy.addr, dir.path(), "2s");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xde11_7e57);

    for _ in 0..5 {
        std::thread::sleep(Duration::from_millis(rng.random_range(500..1500)));
        node.kill9();
        node = Node::start_with(&data, "2s");
        proxy.retarget(grpc_addr(&node));
    }
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        agent.metric("gpulse_agent_reconnects_total") >= 5,
        "each kill breaks the stream"
    );

    // A 30 s outage; the agent is restarted 10 s into it.
    proxy.cut();
    let cut_at = Instant::now();
    std::thread::sleep(Duration::from_secs(10));
    let spooled = agent.metric("gpulse_agent_spool_bytes");
    assert!(
        spooled > 0,
        "10 s of outage must overflow 2,000 samples of memory into the spool"
    );
    let out = agent.stop();
    assert!(
        out.iter()
            .any(|l| l.contains("unacked batches kept in the spool")),
        "the stopped agent should report what it spooled: {out:?}"
    );
    let agent = Agent::start(proxy.addr, dir.path(), "30s");
    std::thread::sleep(Duration::from_secs(30).saturating_sub(cut_at.elapsed()));
    proxy.restore();

    // Everything spooled and buffered drains.
    let started = Instant::now();
    while agent.metric("gpulse_agent_spool_batches") + agent.metric("gpulse_agent_buffer_batches")
        > 2
    {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the backlog did not drain"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(agent.metric("gpulse_agent_samples_dropped_total"), 0);
    let out = agent.stop();
    assert!(
        !out.iter().any(|l| l.contains("unacked")),
        "the agent stopped with batches unacked: {out:?}"
    );

    let want = produced(&dir.path().join("produced.csv"));
    assert!(want.len() > 20_000, "only {} samples produced", want.len());
    let mut got: HashMap<(String, String, i64), u64> = HashMap::new();
    // The agent's samples; not the node's own health series about them
    // (the outage above is a telemetry gap).
    for b in node.sql_arrow(
        "SELECT metric, gpu, ts, value FROM samples \
         WHERE host = 'dl-host' AND metric NOT LIKE 'gpulse_health%'",
    ) {
        let (m, g) = (
            b.column(0).as_string::<i32>(),
            b.column(1).as_string::<i32>(),
        );
        let ts = b.column(2).as_primitive::<TimestampMillisecondType>();
        let v = b.column(3).as_primitive::<Float64Type>();
        for r in 0..b.num_rows() {
            let key = (m.value(r).to_string(), g.value(r).to_string(), ts.value(r));
            let prev = got.insert(key.clone(), v.value(r).to_bits());
            assert!(prev.is_none(), "{key:?} stored twice");
        }
    }
    let mut missing = 0;
    for (key, bits) in &want {
        match got.get(key) {
            Some(b) => assert_eq!(b, bits, "{key:?}: value differs"),
            None => missing += 1,
        }
    }
    assert_eq!(
        missing,
        0,
        "{missing} of {} produced samples are missing",
        want.len()
    );
    assert_eq!(
        got.len(),
        want.len(),
        "storage holds samples the agent never produced"
    );
    node.stop();
}
