//! Authentication with the real binary: tokens made by `gpulse token create`,
//! refused and accepted on HTTP, gRPC and PostgreSQL (with the real `psql`),
//! each refusal counted; the real agent and a real Prometheus (2.42, the
//! Debian package) scraping, remote-writing and remote-reading with tokens;
//! and `serve` refusing non-loopback addresses without `--insecure`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpulse_proto::prometheus::{Label, Sample, TimeSeries, WriteRequest};
use gpulse_proto::v1::{AgentMessage, Batch, Hello, SeriesDef, agent_message, ingest_reply};
use prost::Message;
use serde_json::Value;

use crate::support::{Node, http, now_ms};

/// Tokens of each scope, and the file that lets them in.
struct Tokens {
    file: PathBuf,
    read: String,
    write: String,
    admin: String,
}

/// `gpulse token create --name NAME --scope SCOPE --auth-file FILE`: the token.
pub(crate) fn create(file: &Path, name: &str, scope: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args([
            "token",
            "create",
            "--name",
            name,
            "--scope",
            scope,
            "--auth-file",
        ])
        .arg(file)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let token = String::from_utf8(out.stdout).unwrap().trim().to_owned();
    assert!(token.starts_with("gpulse_"), "{token:?}");
    token
}

fn tokens(dir: &Path) -> Tokens {
    let file = dir.join("tokens.toml");
    let t = Tokens {
        read: create(&file, "reader", "read"),
        write: create(&file, "writer", "write"),
        admin: create(&file, "ops", "admin"),
        file,
    };
    let text = std::fs::read_to_string(&t.file).unwrap();
    for token in [&t.read, &t.write, &t.admin] {
        assert!(!text.contains(token.as_str()), "a token in the file");
    }
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&t.file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the token file is the owner's only");
    t
}

fn token_file(dir: &Path, name: &str, token: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{token}\n")).unwrap();
    path
}

/// One HTTP request: (status, WWW-Authenticate, body).
fn call(
    node: &Node,
    method: &str,
    path: &str,
    authorization: Option<&str>,
) -> (u16, Option<String>, String) {
    let url = format!("{}{path}", node.http_url);
    let agent = http();
    let result = match method {
        "GET" => {
            let mut r = agent.get(&url);
            if let Some(a) = authorization {
                r = r.header("authorization", a);
            }
            r.call()
        }
        _ => {
            let mut r = agent.post(&url).header("content-type", "application/json");
            if let Some(a) = authorization {
                r = r.header("authorization", a);
            }
            r.send(&b""[..])
        }
    };
    let mut resp = result.unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let challenge = resp
        .headers()
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.body_mut().read_to_string().unwrap_or_default();
    (resp.status().as_u16(), challenge, body)
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// `gpulse_auth_refused_total` by (surface, reason), from `/metrics`.
fn refused(node: &Node, t: &Tokens, surface: &str, reason: &str) -> u64 {
    let (status, _, body) = call(node, "GET", "/metrics", Some(&bearer(&t.read)));
    assert_eq!(status, 200);
    let line = format!("gpulse_auth_refused_total{{surface=\"{surface}\",reason=\"{reason}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&line))
        .unwrap_or_else(|| panic!("no {line} in /metrics"))
        .parse()
        .unwrap()
}

/// Opens an agent stream with `authorization` and sends one batch of `n`
/// samples: the gRPC code it ends with, or `Ok` after the ack.
fn stream(grpc_url: &str, authorization: Option<&str>, n: u32) -> Result<(), tonic::Code> {
    let endpoint =
        tonic::transport::Endpoint::from_shared(grpc_url.replace("grpc://", "http://")).unwrap();
    stream_to(endpoint, "sec-host", authorization, n).map_err(|(code, _)| code)
}

/// As [`stream`], on `endpoint` (TLS or not), speaking for `host`: the code
/// and message it ends with (a failed connection is `UNAVAILABLE`).
fn stream_to(
    endpoint: tonic::transport::Endpoint,
    host: &str,
    authorization: Option<&str>,
    n: u32,
) -> Result<(), (tonic::Code, String)> {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let channel = endpoint
            .connect()
            .await
            .map_err(|e| (tonic::Code::Unavailable, format!("{e:?}")))?;
        let mut client = gpulse_proto::v1::ingest_client::IngestClient::new(channel);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tx.send(AgentMessage {
            msg: Some(agent_message::Msg::Hello(Hello {
                agent_id: host.into(),
                host: host.into(),
                ..Default::default()
            })),
        })
        .await
        .unwrap();
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        if let Some(a) = authorization {
            request
                .metadata_mut()
                .insert("authorization", a.parse().unwrap());
        }
        let status = |s: tonic::Status| (s.code(), s.message().to_owned());
        let mut replies = client.stream(request).await.map_err(status)?.into_inner();
        let now = now_ms();
        let batch = Batch {
            seq: 1,
            new_series: vec![SeriesDef {
                id: 0,
                metric: "sec_probe_grpc".into(),
                labels: vec![],
            }],
            series_ids: vec![0; n as usize],
            timestamps_ms: (0..n).map(|i| now - 60_000 + i64::from(i) * 1000).collect(),
            values: (0..n).map(f64::from).collect(),
            ..Default::default()
        };
        // The stream may already be refused: then the send fails, and the
        // reply says why.
        let _ = tx
            .send(AgentMessage {
                msg: Some(agent_message::Msg::Batch(batch)),
            })
            .await;
        match replies.message().await {
            Ok(Some(r)) => match r.reply.unwrap() {
                ingest_reply::Reply::Ack(a) => {
                    assert_eq!((a.seq, a.accepted), (1, n));
                    Ok(())
                }
                other => panic!("{other:?}"),
            },
            Ok(None) => panic!("stream ended without an ack"),
            Err(s) => Err(status(s)),
        }
    })
}

/// `psql -c query` with `password` (none: psql never prompts): (success, stdout + stderr).
fn psql(node: &Node, password: Option<&str>, query: &str) -> (bool, String) {
    let url = format!(
        "{}/gpulse?user=grafana",
        node.pg_url.replace("postgres://", "postgresql://")
    );
    let mut cmd = Command::new("psql");
    cmd.arg(url)
        .args(["-X", "-At", "-w", "-c", query])
        .env("PGCONNECT_TIMEOUT", "10")
        .env_remove("PGSERVICE")
        .env_remove("PGPASSWORD");
    if let Some(p) = password {
        cmd.env("PGPASSWORD", p);
    }
    let out = cmd
        .output()
        .expect("psql (Debian: apt-get install postgresql-client)");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn every_surface_refuses_what_its_token_does_not_allow() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens(dir.path());
    let file = t.file.to_str().unwrap().to_owned();
    let node = Node::start_with_args(&dir.path().join("data"), &["--auth-file", &file]);

    // HTTP: (method, path, credentials, status). Counted: 401s as missing or
    // invalid, 403s as scope.
    let basic = |token: &str| {
        // base64 of "grafana:" + token, computed here with coreutils.
        let out = Command::new("base64")
            .args(["-w", "0"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write as _;
                c.stdin
                    .take()
                    .unwrap()
                    .write_all(format!("grafana:{token}").as_bytes())?;
                c.wait_with_output()
            })
            .unwrap();
        format!("Basic {}", String::from_utf8(out.stdout).unwrap())
    };
    let q = "/api/v1/query?query=vector(1)";
    let cases: Vec<(&str, &str, Option<String>, u16)> = vec![
        ("GET", q, None, 401),
        ("GET", q, Some("Bearer gpulse_0000".into()), 401),
        ("GET", q, Some(t.read.clone()), 401), // no scheme
        ("GET", q, Some(bearer(&t.read)), 200),
        ("GET", q, Some(basic(&t.read)), 200),
        ("GET", q, Some(bearer(&t.write)), 403),
        ("GET", "/api/v1/sql?query=SELECT%201", None, 401),
        ("GET", "/api/v1/health", Some(bearer(&t.admin)), 403),
        ("GET", "/api/v1/fleet/layout", None, 401),
        ("GET", "/metrics", None, 401),
        ("POST", "/api/v1/write", Some(bearer(&t.read)), 403),
        ("POST", "/api/v1/read", None, 401),
        ("POST", "/api/v1/admin/flush", Some(bearer(&t.write)), 403),
        ("POST", "/api/v1/admin/flush", Some(bearer(&t.read)), 403),
        ("POST", "/api/v1/admin/flush", None, 401),
        ("POST", "/api/v1/admin/flush", Some(bearer(&t.admin)), 200),
        // Open: liveness, and the UI's page and assets (no data in them).
        ("GET", "/healthz", None, 200),
        ("GET", "/", None, 200),
        ("GET", "/ui/app.js", None, 200),
    ];
    let (mut missing, mut invalid, mut scope) = (0, 0, 0);
    for (method, path, auth, want) in &cases {
        let (status, challenge, body) = call(&node, method, path, auth.as_deref());
        assert_eq!(status, *want, "{method} {path} with {auth:?}: {body}");
        match want {
            401 => {
                assert_eq!(challenge.as_deref(), Some("Bearer realm=\"gpulse\""));
                let v: Value = serde_json::from_str(&body).unwrap();
                assert_eq!(v["errorType"], "unauthorized", "{body}");
                if auth.is_some() && auth.as_deref().unwrap().starts_with("Bearer") {
                    assert!(body.contains("invalid token"), "{body}");
                    invalid += 1;
                } else {
                    assert!(body.contains("Authorization: Bearer"), "{body}");
                    missing += 1;
                }
            }
            403 => {
                assert!(body.contains("lacks the"), "{body}");
                assert!(
                    !body.contains("gpulse_"),
                    "a refusal names no token: {body}"
                );
                scope += 1;
            }
            _ => assert!(challenge.is_none()),
        }
    }

    // gRPC: the agent stream needs the write scope.
    let grpc = node.grpc_url.clone();
    assert_eq!(stream(&grpc, None, 3), Err(tonic::Code::Unauthenticated));
    assert_eq!(
        stream(&grpc, Some("Bearer gpulse_nope"), 3),
        Err(tonic::Code::Unauthenticated)
    );
    assert_eq!(
        stream(&grpc, Some(&bearer(&t.read)), 3),
        Err(tonic::Code::PermissionDenied)
    );
    assert_eq!(stream(&grpc, Some(&bearer(&t.write)), 5), Ok(()));

    // The real agent with its token file: every sample it records is stored.
    let record = dir.path().join("agent.csv");
    let agent = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args(["agent", "--simulate", "--gpus", "2", "--polls", "3"])
        .args([
            "--interval",
            "200ms",
            "--no-spool",
            "--metrics-listen",
            "off",
        ])
        .args(["--host", "sec-agent", "--ingest", &grpc, "--token-file"])
        .arg(token_file(dir.path(), "agent.token", &t.write))
        .arg("--record")
        .arg(&record)
        .output()
        .unwrap();
    assert!(
        agent.status.success(),
        "{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    let recorded = std::fs::read_to_string(&record)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("labels,"))
        .count();
    assert!(recorded > 0);

    // PostgreSQL: the password is a token with the read scope.
    let count = "SELECT count(*) FROM samples WHERE host = 'sec-agent' AND metric NOT LIKE 'gpulse_health%'";
    let (ok, out) = psql(&node, None, count);
    assert!(!ok && out.contains("password"), "{out}");
    let (ok, out) = psql(&node, Some("gpulse_wrong"), count);
    assert!(
        !ok && out.contains("password authentication failed"),
        "{out}"
    );
    let (ok, out) = psql(&node, Some(&t.write), count);
    assert!(!ok && out.contains("lacks the read scope"), "{out}");
    let (ok, out) = psql(&node, Some(&t.read), count);
    assert!(ok, "{out}");
    assert_eq!(out.trim(), recorded.to_string());
    let (ok, out) = psql(
        &node,
        Some(&t.read),
        "SELECT sum(value) FROM samples WHERE metric = 'sec_probe_grpc'",
    );
    assert!(ok, "{out}");
    assert_eq!(out.trim(), "10.0", "0+1+2+3+4 from the one stream let in");

    // `gpulse sql` with a token file; without one it says why.
    let sql = |file: Option<&Path>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_gpulse"));
        c.args([
            "sql",
            "--format",
            "csv",
            "--url",
            &node.http_url,
            "SELECT 7 AS x",
        ]);
        if let Some(f) = file {
            c.arg("--token-file").arg(f);
        }
        c.env_remove("GPULSE_TOKEN_FILE").output().unwrap()
    };
    let out = sql(Some(&token_file(dir.path(), "read.token", &t.read)));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), "x\n7\n");
    let out = sql(None);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP 401"));
    missing += 1;

    // Every refusal above, counted where it happened.
    assert_eq!(refused(&node, &t, "http", "missing"), missing);
    assert_eq!(refused(&node, &t, "http", "invalid"), invalid);
    assert_eq!(refused(&node, &t, "http", "scope"), scope);
    assert_eq!(refused(&node, &t, "grpc", "missing"), 1);
    assert_eq!(refused(&node, &t, "grpc", "invalid"), 1);
    assert_eq!(refused(&node, &t, "grpc", "scope"), 1);
    assert_eq!(refused(&node, &t, "postgres", "invalid"), 1);
    assert_eq!(refused(&node, &t, "postgres", "scope"), 1);

    // SIGHUP reads the token file again: a token added is let in, a token
    // removed is refused, and a file that does not load changes nothing.
    let status_with = |token: &str| call(&node, "GET", q, Some(&bearer(token))).0;
    let hup = || node.signal("HUP");
    let until = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let late = create(&t.file, "late", "read");
    assert_eq!(status_with(&late), 401, "not before SIGHUP");
    hup();
    until("the added token is let in", &|| status_with(&late) == 200);
    let text = std::fs::read_to_string(&t.file).unwrap();
    let without_reader: String = text
        .split("[[token]]")
        .filter(|block| !block.trim().is_empty() && !block.contains("name = \"reader\""))
        .map(|block| format!("[[token]]{block}"))
        .collect();
    assert_eq!(without_reader.matches("[[token]]").count(), 3);
    std::fs::write(&t.file, &without_reader).unwrap();
    hup();
    until("the removed token is refused", &|| {
        status_with(&t.read) == 401
    });
    assert_eq!(status_with(&late), 200);
    std::fs::write(&t.file, "not toml [").unwrap();
    hup();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status_with(&late), 200, "a broken file changes nothing");
    assert_eq!(status_with(&t.read), 401);
    node.stop();
}

/// `gpulse serve` with `args`: its exit status and output when it exits, or
/// `None` once it prints `gpulse ready` (it is then stopped).
fn serve_outcome(dir: &Path, args: &[&str]) -> Option<(bool, String)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .arg("serve")
        .arg("--data-dir")
        .arg(dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let ready = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .any(|l| l.starts_with("gpulse ready"));
    if ready {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let _ = child.wait();
        return None;
    }
    let out = child.wait_with_output().unwrap();
    Some((
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

#[test]
fn serve_needs_insecure_beyond_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let beyond = [
        "--grpc-listen",
        "127.0.0.1:0",
        "--http-listen",
        "0.0.0.0:0",
        "--pg-listen",
        "off",
    ];
    let (ok, err) = serve_outcome(&data, &beyond).expect("serve must refuse to start");
    assert!(!ok);
    assert!(
        err.contains("refusing to listen beyond loopback (HTTP on 0.0.0.0:0)")
            && err.contains("--insecure"),
        "{err}"
    );
    let mut insecure = beyond.to_vec();
    insecure.push("--insecure");
    assert_eq!(serve_outcome(&data, &insecure), None, "--insecure starts");
    // Loopback needs nothing.
    assert_eq!(
        serve_outcome(
            &data,
            &[
                "--grpc-listen",
                "127.0.0.1:0",
                "--http-listen",
                "127.0.0.1:0",
                "--pg-listen",
                "off"
            ]
        ),
        None
    );
    // TLS and tokens together open the network; either alone does not.
    let pki = dir.path().join("pki");
    make_certs(&pki, &["ca"]);
    make_certs(&pki, &["server", "node", "DNS:localhost,IP:127.0.0.1"]);
    let t = tokens(dir.path());
    let (cert, key, file) = (
        pki.join("node.pem").display().to_string(),
        pki.join("node.key").display().to_string(),
        t.file.display().to_string(),
    );
    let tls = ["--tls-cert", cert.as_str(), "--tls-key", key.as_str()];
    let tokens_flag = ["--auth-file", file.as_str()];
    let (ok, err) = serve_outcome(&data, &[&beyond[..], &tls[..]].concat()).expect("TLS alone");
    assert!(!ok && err.contains("without tokens (--auth-file)"), "{err}");
    let (ok, err) =
        serve_outcome(&data, &[&beyond[..], &tokens_flag[..]].concat()).expect("tokens alone");
    assert!(
        !ok && err.contains("without TLS (--tls-cert, --tls-key)"),
        "{err}"
    );
    assert_eq!(
        serve_outcome(&data, &[&beyond[..], &tls[..], &tokens_flag[..]].concat()),
        None,
        "TLS and tokens: starts"
    );
    // A bad token file stops the start, with the reason.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[token]]\nname = \"x\"\nscopes = [\"read\"]\ntoken = \"gpulse_1\"\n",
    )
    .unwrap();
    let (ok, err) = serve_outcome(
        &data,
        &[
            "--http-listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--pg-listen",
            "off",
            "--auth-file",
            bad.to_str().unwrap(),
        ],
    )
    .expect("serve must refuse the file");
    assert!(!ok && err.contains("unknown field"), "{err}");
}

/// A real Prometheus scrapes `/metrics` with a read token, remote-writes
/// what it scraped with a write token, and remote-reads with a read token,
/// all over TLS (`tls_config` with the test CA).
#[test]
fn prometheus_scrapes_writes_and_reads_with_tokens_over_tls() {
    let bin = Path::new("/usr/bin/prometheus");
    if !bin.exists() {
        assert!(
            std::env::var_os("GPULSE_REQUIRE_PROMETHEUS").is_none(),
            "GPULSE_REQUIRE_PROMETHEUS is set but /usr/bin/prometheus is missing"
        );
        eprintln!("SKIPPED: /usr/bin/prometheus is missing (apt-get install prometheus)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let t = tokens(dir.path());
    let pki = dir.path().join("pki");
    make_certs(&pki, &["ca"]);
    make_certs(&pki, &["server", "node", "DNS:localhost,IP:127.0.0.1"]);
    let ca = pki.join("ca.pem");
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &[
            "--auth-file",
            t.file.to_str().unwrap(),
            "--tls-cert",
            pki.join("node.pem").to_str().unwrap(),
            "--tls-key",
            pki.join("node.key").to_str().unwrap(),
        ],
    );
    // Data only gpulse has, for the remote read: written with the write token.
    let now = now_ms();
    let samples: Vec<(i64, f64)> = (0..10)
        .map(|i| (now - 120_000 + i * 10_000, 1.5 * i as f64))
        .collect();
    let body = WriteRequest {
        timeseries: vec![TimeSeries {
            labels: vec![Label {
                name: "__name__".into(),
                value: "sec_probe_remote".into(),
            }],
            samples: samples
                .iter()
                .map(|&(timestamp, value)| Sample { value, timestamp })
                .collect(),
            ..Default::default()
        }],
        ..Default::default()
    }
    .encode_to_vec();
    let (status, answer) = remote_write_https(&node, &ca, &t.write, &body);
    assert_eq!(status, 204, "{answer}");

    let (read, write) = (
        token_file(dir.path(), "read.token", &t.read),
        token_file(dir.path(), "write.token", &t.write),
    );
    let target = node.http_url.trim_start_matches("https://");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1h\n\
             scrape_configs:\n  - job_name: gpulse\n    scheme: https\n    static_configs:\n      - targets: ['{target}']\n    \
             authorization:\n      credentials_file: {read}\n    tls_config:\n      ca_file: {ca}\n\
             remote_write:\n  - url: {url}/api/v1/write\n    authorization:\n      credentials_file: {write}\n    \
             tls_config:\n      ca_file: {ca}\n    queue_config:\n      batch_send_deadline: 1s\n\
             remote_read:\n  - url: {url}/api/v1/read\n    read_recent: true\n    authorization:\n      credentials_file: {read}\n    \
             tls_config:\n      ca_file: {ca}\n",
            ca = ca.display(),
            url = node.http_url,
            read = read.display(),
            write = write.display(),
        ),
    )
    .unwrap();
    let port = crate::support::listen_ports(1)[0];
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let mut prom = Command::new(bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path().join("prom").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("starting prometheus");
    let prom_url = format!("http://127.0.0.1:{port}");

    // `up` is 1 only for a scrape that was let in; gpulse has it only by
    // Prometheus's remote write.
    let up = "/api/v1/query?query=up%7Bjob%3D%22gpulse%22%7D";
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (status, body) = curl(&format!("{}{up}", node.http_url), &ca, Some(&t.read));
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        if v["data"]["result"][0]["value"][1] == "1" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no up{{job=\"gpulse\"}} = 1 written by Prometheus: {body}; see {}",
            dir.path().join("prometheus.log").display()
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // Prometheus answers for data only gpulse holds: its remote read got in.
    let at = samples.last().unwrap().0;
    let mut resp = http()
        .get(&format!("{prom_url}/api/v1/query"))
        .query("query", "sec_probe_remote")
        .query("time", format!("{:.3}", at as f64 / 1000.0))
        .call()
        .unwrap();
    let v: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
    assert_eq!(v["data"]["result"][0]["value"][1], "13.5", "{v}");

    for surface in ["http"] {
        for reason in ["missing", "invalid", "scope"] {
            let series =
                format!("gpulse_auth_refused_total{{surface=\"{surface}\",reason=\"{reason}\"}}");
            assert_eq!(https_metric(&node, &ca, &t.read, &series), 0, "{reason}");
        }
    }
    let _ = prom.kill();
    let _ = prom.wait();
    node.stop();
}

/// SQL over HTTPS with a token, trusting `ca`: (whether the answer says it
/// is partial, the rows).
fn sql_with(node: &Node, ca: &Path, token: &str, query: &str) -> (bool, Vec<Value>) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "30", "-D", "-", "--cacert"])
        .arg(ca)
        .args(["-H", &format!("authorization: Bearer {token}")])
        .args(["-H", "content-type: text/plain", "--data-binary", query])
        .arg(format!("{}/api/v1/sql", node.http_url))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("{text}"));
    // HTTP/2 by ALPN, or HTTP/1.1.
    let status_line = head.lines().next().unwrap_or_default();
    assert!(
        status_line.ends_with(" 200") || status_line.contains(" 200 "),
        "{text}"
    );
    let partial = head.to_ascii_lowercase().contains("x-gpulse-partial");
    let body: Value = serde_json::from_str(body).unwrap();
    (
        partial,
        body["rows"].as_array().cloned().unwrap_or_default(),
    )
}

/// Three nodes with TLS (agents' certificates required on gRPC) and
/// tokens: peers reach each other with their certificates and the cluster
/// token (status polls, forwarded remote writes, Flight reads), and every
/// node answers for every sample.
#[test]
fn a_tls_cluster_with_tokens_forwards_and_reads_between_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens(dir.path());
    let cluster_token = create(&t.file, "peers", "read,write");
    let peers = token_file(dir.path(), "peers.token", &cluster_token);
    let pki = dir.path().join("pki");
    make_certs(&pki, &["ca"]);
    make_certs(&pki, &["server", "node", "DNS:localhost,IP:127.0.0.1"]);
    let (ca, cert, key) = (
        pki.join("ca.pem"),
        pki.join("node.pem"),
        pki.join("node.key"),
    );
    let ports = crate::support::listen_ports(9);
    let mut text = "replication_factor = 2\n".to_owned();
    for (i, id) in ["a", "b", "c"].iter().enumerate() {
        text += &format!(
            "\n[[node]]\nid = \"{id}\"\ngrpc = \"127.0.0.1:{}\"\nhttp = \"127.0.0.1:{}\"\nflight = \"127.0.0.1:{}\"\n",
            ports[3 * i],
            ports[3 * i + 1],
            ports[3 * i + 2]
        );
    }
    let file = dir.path().join("cluster.toml");
    std::fs::write(&file, text).unwrap();
    let path = |p: &Path| p.to_str().unwrap().to_owned();
    let nodes: Vec<Node> = ["a", "b", "c"]
        .iter()
        .map(|id| {
            Node::start_with_args(
                &dir.path().join(id),
                &[
                    "--cluster",
                    &path(&file),
                    "--node-id",
                    id,
                    "--auth-file",
                    &path(&t.file),
                    "--cluster-token-file",
                    &path(&peers),
                    "--tls-cert",
                    &path(&cert),
                    "--tls-key",
                    &path(&key),
                    "--tls-client-ca",
                    &path(&ca),
                    "--tls-ca",
                    &path(&ca),
                ],
            )
        })
        .collect();
    assert!(nodes.iter().all(|n| n.http_url.starts_with("https://")));
    // Until every node has heard from its peers (through TLS and the
    // token), answers say they are partial.
    let deadline = Instant::now() + Duration::from_secs(20);
    while nodes
        .iter()
        .any(|n| sql_with(n, &ca, &t.read, "SELECT count(*) FROM samples").0)
    {
        assert!(
            Instant::now() < deadline,
            "the nodes never heard from each other"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    let w = crate::cluster::write_request(0, 20);
    let (n, sum): (u64, f64) = w
        .timeseries
        .iter()
        .flat_map(|s| &s.samples)
        .fold((0, 0.0), |(n, s), x| (n + 1, s + x.value));
    let (status, answer) = remote_write_https(&nodes[0], &ca, &t.write, &w.encode_to_vec());
    assert_eq!(status, 204, "every owner took its part: {answer}");
    for (i, node) in nodes.iter().enumerate() {
        let (partial, rows) = sql_with(
            node,
            &ca,
            &t.read,
            "SELECT count(*), sum(value) FROM samples",
        );
        assert!(!partial, "node {i}");
        assert_eq!(rows[0][0].as_u64(), Some(n), "node {i}");
        let got = rows[0][1].as_f64().unwrap();
        assert!((got - sum).abs() < 1e-6 * sum, "node {i}: {got} vs {sum}");
    }

    // `gpulse cluster status` over TLS, with a certificate and a token,
    // sees every node up.
    let out = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args([
            "cluster",
            "status",
            "--interval",
            "200ms",
            "--json",
            "--cluster",
        ])
        .arg(&file)
        .arg("--token-file")
        .arg(&peers)
        .arg("--tls-ca")
        .arg(&ca)
        .arg("--tls-cert")
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(lines.len(), 3);
    assert!(
        lines
            .iter()
            .all(|l| l["up"] == true && l["same_file"] == true),
        "{lines:?}"
    );
    // None of it was refused.
    for node in &nodes {
        for surface in ["http", "grpc", "flight"] {
            for reason in ["missing", "invalid", "scope"] {
                let series = format!(
                    "gpulse_auth_refused_total{{surface=\"{surface}\",reason=\"{reason}\"}}"
                );
                assert_eq!(https_metric(node, &ca, &t.read, &series), 0, "{series}");
            }
        }
        for listener in ["grpc", "http", "flight"] {
            let series = format!("gpulse_tls_handshake_failures_total{{listener=\"{listener}\"}}");
            assert_eq!(https_metric(node, &ca, &t.read, &series), 0, "{series}");
        }
    }
    for node in nodes {
        node.stop();
    }
}

/// `deploy/tls/make-certs.sh DIR ARGS...`: the certificates of a test fleet.
fn make_certs(dir: &Path, args: &[&str]) {
    let out = Command::new("sh")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/deploy/tls/make-certs.sh"
        ))
        .arg(dir)
        .args(args)
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "make-certs.sh {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `curl` over HTTPS trusting `ca`, with a token: (HTTP status, body);
/// status 0 when no HTTP answer came.
fn curl(url: &str, ca: &Path, token: Option<&str>) -> (u16, String) {
    let mut c = Command::new("curl");
    c.args([
        "-sS",
        "--max-time",
        "20",
        "-w",
        "\n%{http_code}",
        "--cacert",
    ])
    .arg(ca);
    if let Some(t) = token {
        c.args(["-H", &format!("Authorization: Bearer {t}")]);
    }
    let out = c.arg(url).output().expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// A remote write of `request` (protobuf) over HTTPS with curl: (status, body).
fn remote_write_https(node: &Node, ca: &Path, token: &str, request: &[u8]) -> (u16, String) {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        snap::raw::Encoder::new().compress_vec(request).unwrap(),
    )
    .unwrap();
    let out = Command::new("curl")
        .args(["-sS", "-w", "\n%{http_code}", "--cacert"])
        .arg(ca)
        .args(["-H", "content-type: application/x-protobuf"])
        .args(["-H", "content-encoding: snappy"])
        .args(["-H", "x-prometheus-remote-write-version: 0.1.0"])
        .args(["-H", &format!("authorization: Bearer {token}")])
        .arg("--data-binary")
        .arg(format!("@{}", file.path().display()))
        .arg(format!("{}/api/v1/write", node.http_url))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// One line of `/metrics` over HTTPS (the full name with its labels).
fn https_metric(node: &Node, ca: &Path, token: &str, series: &str) -> u64 {
    let (status, body) = curl(&format!("{}/metrics", node.http_url), ca, Some(token));
    assert_eq!(status, 200, "{body}");
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{series} ")))
        .unwrap_or_else(|| panic!("no {series} in /metrics"))
        .parse()
        .unwrap()
}

/// The serial number of the certificate `addr` presents.
fn served_serial(addr: &str) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {addr} -servername localhost </dev/null 2>/dev/null | openssl x509 -noout -serial"
        ))
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// TLS on every listener with the real binary: agents need a certificate
/// from the node's client CA and speak only for the host it names; HTTPS
/// with curl, PostgreSQL with `sslmode=verify-full`; plaintext is refused;
/// SIGHUP loads a new certificate.
#[test]
fn tls_on_every_listener_and_agents_speak_only_for_their_certificates() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let dir = tempfile::tempdir().unwrap();
    let (pki, other) = (dir.path().join("pki"), dir.path().join("other"));
    make_certs(&pki, &["ca"]);
    make_certs(&pki, &["server", "node", "DNS:localhost,IP:127.0.0.1"]);
    make_certs(&pki, &["client", "host-a"]);
    make_certs(&pki, &["expired-client", "host-x"]);
    make_certs(&other, &["ca", "another CA"]);
    make_certs(&other, &["client", "host-a"]);
    let pem = |d: &Path, n: &str| d.join(format!("{n}.pem"));
    let key = |d: &Path, n: &str| d.join(format!("{n}.key"));
    let ca = pem(&pki, "ca");
    let t = tokens(dir.path());
    let node = Node::start_with_args(
        &dir.path().join("data"),
        &[
            "--auth-file",
            t.file.to_str().unwrap(),
            "--tls-cert",
            pem(&pki, "node").to_str().unwrap(),
            "--tls-key",
            key(&pki, "node").to_str().unwrap(),
            "--tls-client-ca",
            ca.to_str().unwrap(),
        ],
    );
    assert!(node.grpc_url.starts_with("grpcs://"), "{}", node.grpc_url);
    assert!(node.http_url.starts_with("https://"), "{}", node.http_url);
    let addr = node.grpc_url.trim_start_matches("grpcs://").to_owned();
    let endpoint = |identity: Option<(&Path, &Path)>, name: &str| {
        let read = |p: &Path| std::fs::read(p).unwrap();
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read(&ca)))
            .domain_name(name);
        if let Some((c, k)) = identity {
            tls = tls.identity(Identity::from_pem(read(c), read(k)));
        }
        Endpoint::from_shared(format!("https://{addr}"))
            .unwrap()
            .tls_config(tls)
            .unwrap()
    };
    let w = bearer(&t.write);
    let (a_pem, a_key) = (pem(&pki, "host-a"), key(&pki, "host-a"));
    let failures = || {
        https_metric(
            &node,
            &ca,
            &t.read,
            "gpulse_tls_handshake_failures_total{listener=\"grpc\"}",
        )
    };

    // Refused in the handshake, each counted.
    let (o_pem, o_key, x_pem, x_key) = (
        pem(&other, "host-a"),
        key(&other, "host-a"),
        pem(&pki, "host-x"),
        key(&pki, "host-x"),
    );
    let cases = [
        ("no client certificate", endpoint(None, "localhost")),
        (
            "a certificate from another CA",
            endpoint(Some((&o_pem, &o_key)), "localhost"),
        ),
        (
            "an expired certificate",
            endpoint(Some((&x_pem, &x_key)), "localhost"),
        ),
        (
            "the node's certificate under another name",
            endpoint(Some((&a_pem, &a_key)), "wrong.example"),
        ),
        (
            "plaintext to the TLS port",
            Endpoint::from_shared(format!("http://{addr}")).unwrap(),
        ),
    ];
    for (what, ep) in cases {
        let before = failures();
        let r = stream_to(ep, "host-a", Some(&w), 3);
        assert!(r.is_err(), "{what}: {r:?}");
        let deadline = Instant::now() + Duration::from_secs(10);
        while failures() == before {
            assert!(Instant::now() < deadline, "{what}: not counted");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    // host-a's certificate cannot speak for host-b, and can for host-a.
    let (code, message) = stream_to(
        endpoint(Some((&a_pem, &a_key)), "localhost"),
        "host-b",
        Some(&w),
        3,
    )
    .unwrap_err();
    assert_eq!(code, tonic::Code::PermissionDenied, "{message}");
    assert!(message.contains("certificate does not name"), "{message}");
    assert_eq!(
        https_metric(
            &node,
            &ca,
            &t.read,
            "gpulse_ingest_streams_refused_total{reason=\"identity\"}"
        ),
        1
    );
    assert_eq!(
        stream_to(
            endpoint(Some((&a_pem, &a_key)), "localhost"),
            "host-a",
            Some(&w),
            4
        ),
        Ok(())
    );

    // The real agent over mTLS.
    let record = dir.path().join("agent.csv");
    let agent = Command::new(env!("CARGO_BIN_EXE_gpulse"))
        .args(["agent", "--simulate", "--gpus", "2", "--polls", "3"])
        .args([
            "--interval",
            "200ms",
            "--no-spool",
            "--metrics-listen",
            "off",
        ])
        .args(["--host", "host-a", "--ingest", &node.grpc_url, "--tls-ca"])
        .arg(&ca)
        .arg("--tls-cert")
        .arg(&a_pem)
        .arg("--tls-key")
        .arg(&a_key)
        .arg("--token-file")
        .arg(token_file(dir.path(), "agent.token", &t.write))
        .arg("--record")
        .arg(&record)
        .output()
        .unwrap();
    assert!(
        agent.status.success(),
        "{}",
        String::from_utf8_lossy(&agent.stderr)
    );
    let recorded = std::fs::read_to_string(&record)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("labels,"))
        .count();

    // HTTPS with curl and a token; plaintext HTTP to the TLS port gets nothing.
    let q = format!("{}/api/v1/query?query=vector(7)", node.http_url);
    let (status, body) = curl(&q, &ca, Some(&t.read));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"7\""), "{body}");
    let (status, _) = curl(&q.replace("https://", "http://"), &ca, Some(&t.read));
    assert_eq!(status, 0, "plaintext HTTP to the TLS port");
    assert!(
        https_metric(
            &node,
            &ca,
            &t.read,
            "gpulse_tls_handshake_failures_total{listener=\"http\"}"
        ) >= 1
    );

    // PostgreSQL: verify-full with the password; plaintext refused.
    let port = node.pg_url.rsplit(':').next().unwrap().to_owned();
    let psql = |sslmode: &str| {
        let out = Command::new("psql")
            .arg(format!(
                "host=localhost port={port} dbname=gpulse user=grafana sslmode={sslmode} sslrootcert={}",
                ca.display()
            ))
            .args([
                "-X",
                "-At",
                "-w",
                "-c",
                "SELECT count(*) FROM samples WHERE host = 'host-a' AND metric NOT LIKE 'gpulse_health%'",
            ])
            .env("PGPASSWORD", &t.read)
            .env("PGCONNECT_TIMEOUT", "10")
            .output()
            .unwrap();
        (
            out.status.success(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (ok, out) = psql("verify-full");
    assert!(ok, "{out}");
    assert_eq!(
        out.trim(),
        (recorded + 4).to_string(),
        "the agent's and the probe's"
    );
    let (ok, out) = psql("disable");
    assert!(!ok && out.contains("TLS connections only"), "{out}");

    // SIGHUP: a new certificate for new connections.
    let http_addr = node.http_url.trim_start_matches("https://").to_owned();
    let before = served_serial(&http_addr);
    assert!(before.starts_with("serial="), "{before:?}");
    make_certs(&pki, &["server", "node2", "DNS:localhost,IP:127.0.0.1"]);
    std::fs::copy(pem(&pki, "node2"), pem(&pki, "node")).unwrap();
    std::fs::copy(key(&pki, "node2"), key(&pki, "node")).unwrap();
    node.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(10);
    while served_serial(&http_addr) == before {
        assert!(
            Instant::now() < deadline,
            "the new certificate was not served"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (status, _) = curl(&q, &ca, Some(&t.read));
    assert_eq!(status, 200, "answers with the new certificate");
    node.stop();
}

/// A hostile label corpus goes in by remote write and comes back exactly as
/// written from SQL (JSON and CSV), PromQL, the label API and psql, with
/// nothing interpreted; a NUL is refused with the reason. (The web UI shows
/// a host named as markup as text: `tests/ui/hostile.test.mjs`.)
#[test]
fn hostile_labels_come_back_as_written_on_every_surface() {
    let dir = tempfile::tempdir().unwrap();
    let node = Node::start_with_args(&dir.path().join("data"), &["--max-label-bytes", "70000"]);
    let big: String = format!("<b>&amp;\"'{}", "x".repeat(64 * 1024));
    let corpus: Vec<(&str, String)> = vec![
        ("Hostname", "<script>alert(\"x\")</script>'".into()),
        ("gpu", "0\"; DROP TABLE samples; --".into()),
        ("rack", "a\tb\nc\\d,e;f".into()),
        ("UUID", big.clone()),
        (
            "note",
            "{\"json\":\"injection\"}\u{2028}é中 $1 %s {{x}}".into(),
        ),
    ];
    let mut labels = vec![Label {
        name: "__name__".into(),
        value: "hostile_corpus".into(),
    }];
    labels.extend(corpus.iter().map(|(n, v)| Label {
        name: (*n).into(),
        value: v.clone(),
    }));
    let ts = now_ms() - 60_000;
    let request = |labels: Vec<Label>| {
        snap::raw::Encoder::new()
            .compress_vec(
                &WriteRequest {
                    timeseries: vec![TimeSeries {
                        labels,
                        samples: vec![Sample {
                            value: 42.5,
                            timestamp: ts,
                        }],
                        ..Default::default()
                    }],
                    ..Default::default()
                }
                .encode_to_vec(),
            )
            .unwrap()
    };
    let headers = [
        ("content-type", "application/x-protobuf"),
        ("content-encoding", "snappy"),
        ("x-prometheus-remote-write-version", "0.1.0"),
    ];
    let (status, body) =
        crate::support::post(&node, "/api/v1/write", &headers, &request(labels.clone()));
    assert_eq!(status, 204, "{body}");
    // A NUL cannot be stored (PostgreSQL text cannot carry one): refused, saying so.
    let nul = vec![
        Label {
            name: "__name__".into(),
            value: "hostile_nul".into(),
        },
        Label {
            name: "rack".into(),
            value: "r\0k".into(),
        },
    ];
    let (status, body) = crate::support::post(&node, "/api/v1/write", &headers, &request(nul));
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("NUL"), "{body}");

    let want = |name: &str| corpus.iter().find(|(n, _)| *n == name).unwrap().1.clone();
    let columns =
        "SELECT host, gpu, rack, uuid, labels, value FROM samples WHERE metric = 'hostile_corpus'";
    let check_row = |row: &[String], surface: &str| {
        assert_eq!(row[0], want("Hostname"), "{surface}: host");
        assert_eq!(row[1], want("gpu"), "{surface}: gpu");
        assert_eq!(row[2], want("rack"), "{surface}: rack");
        assert_eq!(row[3].len(), big.len(), "{surface}: uuid length");
        assert_eq!(row[3], big, "{surface}: uuid");
        let rest: Value = serde_json::from_str(&row[4]).unwrap();
        assert_eq!(
            rest,
            serde_json::json!({"note": want("note")}),
            "{surface}: labels"
        );
        assert_eq!(row[5], "42.5", "{surface}: value");
    };

    // SQL, JSON.
    let rows = node.sql(columns);
    assert_eq!(rows.len(), 1);
    let row: Vec<String> = rows[0]
        .iter()
        .map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect();
    check_row(&row, "SQL JSON");

    // SQL, CSV.
    let mut resp = http()
        .post(&format!("{}/api/v1/sql", node.http_url))
        .query("format", "csv")
        .header("content-type", "text/plain")
        .send(columns.as_bytes())
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp
        .body_mut()
        .with_config()
        .limit(16 << 20)
        .read_to_string()
        .unwrap();
    let mut reader = csv::Reader::from_reader(text.as_bytes());
    let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    assert_eq!(records.len(), 1, "{text:.200}");
    check_row(
        &records[0].iter().map(str::to_owned).collect::<Vec<_>>(),
        "SQL CSV",
    );

    // psql, CSV output.
    let url = format!(
        "{}/gpulse",
        node.pg_url.replace("postgres://", "postgresql://")
    );
    let out = Command::new("psql")
        .arg(url)
        .args(["-X", "--csv", "-t", "-c", columns])
        .env("PGCONNECT_TIMEOUT", "10")
        .output()
        .expect("psql");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .from_reader(&out.stdout[..]);
    let records: Vec<csv::StringRecord> = reader.records().map(Result::unwrap).collect();
    assert_eq!(records.len(), 1);
    check_row(
        &records[0].iter().map(str::to_owned).collect::<Vec<_>>(),
        "psql",
    );

    // PromQL: the labels as written, every one.
    let mut resp = http()
        .get(&format!("{}/api/v1/query", node.http_url))
        .query("query", "hostile_corpus")
        .query("time", format!("{:.3}", (ts + 1000) as f64 / 1000.0))
        .call()
        .unwrap();
    let v: Value = serde_json::from_str(
        &resp
            .body_mut()
            .with_config()
            .limit(16 << 20)
            .read_to_string()
            .unwrap(),
    )
    .unwrap();
    let metric = &v["data"]["result"][0]["metric"];
    for l in &labels {
        assert_eq!(metric[&l.name], l.value.as_str(), "PromQL label {}", l.name);
    }
    assert_eq!(metric.as_object().unwrap().len(), labels.len());

    // The label-values API.
    let mut resp = http()
        .get(&format!("{}/api/v1/label/Hostname/values", node.http_url))
        .call()
        .unwrap();
    let v: Value = serde_json::from_str(&resp.body_mut().read_to_string().unwrap()).unwrap();
    assert!(
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|x| *x == want("Hostname").as_str()),
        "{v}"
    );
    node.stop();
}
