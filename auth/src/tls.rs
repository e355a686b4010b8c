//! TLS for every listener, from PEM files, reloaded on SIGHUP.
//!
//! One certificate and key serve the gRPC, HTTP, PostgreSQL and Flight
//! listeners. With a client CA (`--tls-client-ca`), the gRPC ingest listener
//! requires a client certificate signed by it (mTLS): the node then takes
//! the agent's identity from that certificate ([`certificate_names`]).
//!
//! Handshakes run off the accept loop, each within [`HANDSHAKE_TIMEOUT`]; a
//! failed one (plaintext to a TLS port, no or a bad client certificate, a
//! client that does not trust the node) closes that connection only and is
//! counted per listener in `gpulse_tls_handshake_failures_total`.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::ServerConfig;
pub use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{PrivateKeyDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// Longest a client may take over its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The PEM files of `--tls-cert`, `--tls-key` and `--tls-client-ca`.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The node's certificate chain, leaf first.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA certificates that sign agents' client certificates.
    pub client_ca: Option<PathBuf>,
}

/// The listeners, each with its protocols (ALPN) and client authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    /// Agent streams: HTTP/2; client certificates required with a client CA.
    Grpc,
    /// HTTP/1.1 and HTTP/2.
    Http,
    /// Negotiated inside the protocol (`SSLRequest`).
    Postgres,
    /// Node-to-node reads: HTTP/2.
    Flight,
}

impl Listener {
    const ALL: [Listener; 4] = [
        Listener::Grpc,
        Listener::Http,
        Listener::Postgres,
        Listener::Flight,
    ];

    fn name(self) -> &'static str {
        match self {
            Listener::Grpc => "grpc",
            Listener::Http => "http",
            Listener::Postgres => "postgres",
            Listener::Flight => "flight",
        }
    }
}

/// Handshakes that failed, per listener.
#[derive(Debug, Default)]
pub struct TlsMetrics {
    failures: [AtomicU64; 4],
    reloads_failed: AtomicU64,
}

impl TlsMetrics {
    pub fn failures(&self, l: Listener) -> u64 {
        self.failures[l as usize].load(Relaxed)
    }

    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let name = "gpulse_tls_handshake_failures_total";
        let _ = writeln!(
            out,
            "# HELP {name} TLS handshakes that failed or timed out: plaintext to a TLS port, a missing or untrusted client certificate, a client that does not trust the node.\n# TYPE {name} counter"
        );
        for l in Listener::ALL {
            let _ = writeln!(
                out,
                "{name}{{listener=\"{}\"}} {}",
                l.name(),
                self.failures(l)
            );
        }
        let name = "gpulse_tls_reload_failures_total";
        let _ = writeln!(
            out,
            "# HELP {name} SIGHUP reloads of the TLS files that failed (the previous ones stay in use).\n# TYPE {name} counter\n{name} {}",
            self.reloads_failed.load(Relaxed)
        );
    }
}

/// The node's TLS configurations, one per [`Listener`], swapped whole by
/// [`ServerTls::reload`].
#[derive(Debug)]
pub struct ServerTls {
    files: TlsFiles,
    configs: RwLock<[Arc<ServerConfig>; 4]>,
    metrics: Arc<TlsMetrics>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {}: no PEM certificate in it",
            path.display()
        ));
    }
    Ok(certs)
}

fn build(files: &TlsFiles) -> Result<[Arc<ServerConfig>; 4], String> {
    let certs = read_certs(&files.cert, "--tls-cert")?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| format!("--tls-key {}: {e}", files.key.display()))?;
    let client_verifier = match &files.client_ca {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in read_certs(path, "--tls-client-ca")? {
                roots
                    .add(c)
                    .map_err(|e| format!("--tls-client-ca {}: {e}", path.display()))?;
            }
            Some(
                rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .map_err(|e| format!("--tls-client-ca {}: {e}", path.display()))?,
            )
        }
        None => None,
    };
    let one = |l: Listener| -> Result<Arc<ServerConfig>, String> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match (&client_verifier, l) {
            (Some(v), Listener::Grpc) => builder.with_client_cert_verifier(v.clone()),
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| {
                format!(
                    "--tls-cert {} with --tls-key {}: {e}",
                    files.cert.display(),
                    files.key.display()
                )
            })?;
        config.alpn_protocols = match l {
            Listener::Grpc | Listener::Flight => vec![b"h2".to_vec()],
            Listener::Http => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            Listener::Postgres => vec![b"postgresql".to_vec()],
        };
        Ok(Arc::new(config))
    };
    Ok([
        one(Listener::Grpc)?,
        one(Listener::Http)?,
        one(Listener::Postgres)?,
        one(Listener::Flight)?,
    ])
}

impl ServerTls {
    /// Reads and checks the files.
    ///
    /// # Errors
    /// A file cannot be read or holds no usable certificate or key, or the
    /// key does not match the certificate.
    pub fn load(files: TlsFiles) -> Result<Self, String> {
        let configs = build(&files)?;
        Ok(Self {
            files,
            configs: RwLock::new(configs),
            metrics: Arc::default(),
        })
    }

    /// Reads the files again; new connections use them. On an error the
    /// previous ones stay in use (and the failure is counted).
    ///
    /// # Errors
    /// As [`Self::load`].
    pub fn reload(&self) -> Result<(), String> {
        match build(&self.files) {
            Ok(c) => {
                *self.configs.write().unwrap_or_else(|e| e.into_inner()) = c;
                Ok(())
            }
            Err(e) => {
                self.metrics.reloads_failed.fetch_add(1, Relaxed);
                Err(e)
            }
        }
    }

    /// True when agents must present a client certificate.
    pub fn mutual(&self) -> bool {
        self.files.client_ca.is_some()
    }

    pub fn metrics(&self) -> &Arc<TlsMetrics> {
        &self.metrics
    }

    /// The acceptor for one connection of `listener`, with the files in force.
    pub fn acceptor(&self, listener: Listener) -> TlsAcceptor {
        TlsAcceptor::from(
            self.configs.read().unwrap_or_else(|e| e.into_inner())[listener as usize].clone(),
        )
    }

    /// The handshake of one accepted connection, within [`HANDSHAKE_TIMEOUT`];
    /// a failure is counted and logged at debug.
    ///
    /// # Errors
    /// The handshake failed or timed out.
    pub async fn accept(
        &self,
        listener: Listener,
        stream: TcpStream,
    ) -> io::Result<TlsStream<TcpStream>> {
        let peer = stream.peer_addr().ok();
        let result =
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor(listener).accept(stream))
                .await
            {
                Ok(r) => r,
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "TLS handshake timed out",
                )),
            };
        if let Err(e) = &result {
            self.metrics.failures[listener as usize].fetch_add(1, Relaxed);
            tracing::debug!(listener = listener.name(), ?peer, error = %e, "TLS handshake failed");
        }
        result
    }

    /// The connections of `tcp` after their handshakes, for a tonic server's
    /// `serve_with_incoming`. Handshakes run concurrently, off the accept
    /// loop; failed ones are left out. Ends when the receiver is dropped.
    pub fn incoming(
        self: Arc<Self>,
        tcp: TcpListener,
        listener: Listener,
    ) -> tokio_stream::wrappers::ReceiverStream<io::Result<TlsStream<TcpStream>>> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = tcp.accept() => a,
                    () = tx.closed() => return,
                };
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed; retrying in 50 ms");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (tls, tx) = (self.clone(), tx.clone());
                tokio::spawn(async move {
                    if let Ok(s) = tls.accept(listener, stream).await {
                        let _ = tx.send(Ok(s)).await;
                    }
                });
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}

/// Whether the client certificate `cert` (DER, verified by the handshake)
/// names `name`: a DNS name among its subject alternative names.
pub fn certificate_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(server_name) = ServerName::try_from(name) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|c| c.verify_is_valid_for_subject_name(&server_name).is_ok())
}
