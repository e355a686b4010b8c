//! Who may read, write and administer a gpulse node.
//!
//! A client presents a bearer token (`Authorization: Bearer <token>` on HTTP
//! and gRPC, the password on PostgreSQL). The node keeps no token, only its
//! SHA-256 in the token file (`--auth-file`), each with a name and a set of
//! [`Scope`]s:
//!
//! ```toml
//! [[token]]
//! name = "grafana"
//! scopes = ["read"]
//! sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! ```
//!
//! Tokens are 256 random bits ([`new_token`]), so a plain SHA-256 is the right
//! hash: there is nothing to guess that a slow, salted password hash would
//! protect. The presented token's hash is compared with every entry in
//! constant time ([`subtle`]), without stopping at the first match.
//!
//! Every refusal is counted per surface and reason ([`AuthMetrics`]) and
//! answered with a message that says what to send, never with the token.

use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// What a token allows. A token may hold several; none implies another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Queries of every kind: SQL, PromQL, remote read, the fleet UI's and
    /// the health API's data, `/metrics`, node-to-node reads.
    Read,
    /// Samples in: agent streams (gRPC), remote write, forwarded writes.
    Write,
    /// `/api/v1/admin/*`.
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 3] = [Scope::Read, Scope::Write, Scope::Admin];

    pub fn name(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Write => "write",
            Scope::Admin => "admin",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }

    /// Parses `read`, `write` or `admin`.
    ///
    /// # Errors
    /// Any other word, with the words it takes.
    pub fn parse(s: &str) -> Result<Self, String> {
        Scope::ALL
            .into_iter()
            .find(|x| x.name() == s)
            .ok_or_else(|| format!("unknown scope {s:?}: use read, write or admin"))
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of [`Scope`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Scopes(u8);

impl Scopes {
    pub fn of(scopes: &[Scope]) -> Self {
        Scopes(scopes.iter().fold(0, |a, s| a | s.bit()))
    }

    pub fn contains(self, s: Scope) -> bool {
        self.0 & s.bit() != 0
    }

    pub fn names(self) -> Vec<&'static str> {
        Scope::ALL
            .into_iter()
            .filter(|s| self.contains(*s))
            .map(Scope::name)
            .collect()
    }
}

/// Where a request came in, for the counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    Http,
    Grpc,
    Flight,
    Postgres,
}

impl Surface {
    const ALL: [Surface; 4] = [
        Surface::Http,
        Surface::Grpc,
        Surface::Flight,
        Surface::Postgres,
    ];

    fn name(self) -> &'static str {
        match self {
            Surface::Http => "http",
            Surface::Grpc => "grpc",
            Surface::Flight => "flight",
            Surface::Postgres => "postgres",
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// No credentials, or not in a form this surface takes.
    Missing,
    /// A token that no entry of the token file matches.
    Invalid,
    /// A known token without the scope the request needs.
    Scope { token: String, need: Scope },
}

impl Denial {
    const REASONS: [&'static str; 3] = ["missing", "invalid", "scope"];

    fn index(&self) -> usize {
        match self {
            Denial::Missing => 0,
            Denial::Invalid => 1,
            Denial::Scope { .. } => 2,
        }
    }

    /// True when the client is not authenticated at all (HTTP 401, gRPC
    /// UNAUTHENTICATED); false when it is, but may not do this (403,
    /// PERMISSION_DENIED).
    pub fn unauthenticated(&self) -> bool {
        !matches!(self, Denial::Scope { .. })
    }

    /// The gRPC status of this refusal.
    pub fn status(&self) -> tonic::Status {
        if self.unauthenticated() {
            tonic::Status::unauthenticated(self.to_string())
        } else {
            tonic::Status::permission_denied(self.to_string())
        }
    }
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::Missing => f.write_str(
                "authentication required: send \"Authorization: Bearer <token>\" \
                 (tokens are made with `gpulse token create`)",
            ),
            Denial::Invalid => f.write_str("invalid token: it matches none of this node's tokens"),
            Denial::Scope { token, need } => {
                write!(
                    f,
                    "token {token:?} lacks the {need} scope this request needs"
                )
            }
        }
    }
}

/// Refusals per surface and reason, for `/metrics`.
#[derive(Debug, Default)]
pub struct AuthMetrics {
    refused: [[AtomicU64; 3]; 4],
}

impl AuthMetrics {
    /// Counts one refusal.
    pub fn refused(&self, surface: Surface, denial: &Denial) {
        self.refused[surface as usize][denial.index()].fetch_add(1, Relaxed);
    }

    /// The count for one surface and reason (`missing`, `invalid`, `scope`).
    pub fn count(&self, surface: Surface, reason: &str) -> u64 {
        Denial::REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.refused[surface as usize][i].load(Relaxed))
    }

    /// Appends `gpulse_auth_refused_total` in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let name = "gpulse_auth_refused_total";
        let _ = writeln!(
            out,
            "# HELP {name} Requests refused for their credentials: missing, invalid, or without the scope needed.\n# TYPE {name} counter"
        );
        for surface in Surface::ALL {
            for (i, reason) in Denial::REASONS.iter().enumerate() {
                let v = self.refused[surface as usize][i].load(Relaxed);
                let _ = writeln!(
                    out,
                    "{name}{{surface=\"{}\",reason=\"{reason}\"}} {v}",
                    surface.name()
                );
            }
        }
    }
}

/// Errors of a token file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    name: String,
    scopes: Vec<String>,
    sha256: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    token: Vec<FileEntry>,
}

struct Entry {
    name: String,
    sha256: [u8; 32],
    scopes: Scopes,
}

/// The tokens a node accepts, by hash.
pub struct Tokens {
    entries: Vec<Entry>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.entries.iter().map(|e| (&e.name, e.scopes.names())))
            .finish()
    }
}

impl Tokens {
    /// Reads a token file.
    ///
    /// # Errors
    /// The file cannot be read, or [`Tokens::parse`] refuses it.
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text)
            .map_err(|e| LoadError::Invalid(format!("token file {}: {e}", path.display())))
    }

    /// Parses the TOML of a token file.
    ///
    /// # Errors
    /// Not TOML of that shape; a hash that is not 64 hex digits; an unknown
    /// or missing scope; two entries of one name or one hash; no entry at
    /// all (every request would be refused).
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut entries: Vec<Entry> = Vec::with_capacity(file.token.len());
        for t in file.token {
            let mut sha256 = [0u8; 32];
            hex::decode_to_slice(t.sha256.trim(), &mut sha256).map_err(|_| {
                format!(
                    "token {:?}: sha256 must be 64 hex digits (the hash, never the token)",
                    t.name
                )
            })?;
            if t.scopes.is_empty() {
                return Err(format!(
                    "token {:?}: no scopes (give read, write and/or admin)",
                    t.name
                ));
            }
            let scopes = t
                .scopes
                .iter()
                .map(|s| Scope::parse(s))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("token {:?}: {e}", t.name))?;
            if entries.iter().any(|e| e.name == t.name) {
                return Err(format!("two tokens named {:?}", t.name));
            }
            if entries.iter().any(|e| e.sha256 == sha256) {
                return Err(format!(
                    "token {:?} has the hash of an earlier token",
                    t.name
                ));
            }
            entries.push(Entry {
                name: t.name,
                sha256,
                scopes: Scopes::of(&scopes),
            });
        }
        if entries.is_empty() {
            return Err("no [[token]] entries: every request would be refused".into());
        }
        Ok(Self { entries })
    }

    /// The name and scopes of the entry `token` matches. Every entry is
    /// compared, in constant time, whatever matches.
    pub fn verify(&self, token: &str) -> Option<(&str, Scopes)> {
        let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut found = None;
        for e in &self.entries {
            if bool::from(e.sha256.ct_eq(&digest)) {
                found = Some(e);
            }
        }
        found.map(|e| (e.name.as_str(), e.scopes))
    }

    /// Whether `token` is known and holds `need`: the token's name, or why not.
    ///
    /// # Errors
    /// [`Denial::Invalid`] or [`Denial::Scope`].
    pub fn authorize(&self, token: &str, need: Scope) -> Result<&str, Denial> {
        match self.verify(token) {
            None => Err(Denial::Invalid),
            Some((name, scopes)) if scopes.contains(need) => Ok(name),
            Some((name, _)) => Err(Denial::Scope {
                token: name.to_owned(),
                need,
            }),
        }
    }
}

/// The bearer token of an `Authorization` header value: `Bearer <token>`,
/// or `Basic` with the token as the password (any user name), which is
/// what Grafana's and psql-style clients offer.
pub fn presented(authorization: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(authorization).ok()?.trim();
    let (scheme, rest) = text.split_once(' ')?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return (!rest.is_empty()).then(|| rest.to_owned());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        use base64::Engine as _;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        let pair = String::from_utf8(decoded).ok()?;
        let (_, password) = pair.split_once(':')?;
        return (!password.is_empty()).then(|| password.to_owned());
    }
    None
}

/// A node's tokens and its refusal counters: one per node, shared by every
/// surface. [`Gate::reload`] swaps the tokens whole (SIGHUP).
#[derive(Debug)]
pub struct Gate {
    tokens: std::sync::RwLock<Arc<Tokens>>,
    /// The token file, for [`Gate::reload`].
    path: Option<std::path::PathBuf>,
    metrics: Arc<AuthMetrics>,
}

impl Gate {
    pub fn new(tokens: Tokens) -> Self {
        Self {
            tokens: std::sync::RwLock::new(Arc::new(tokens)),
            path: None,
            metrics: Arc::default(),
        }
    }

    /// The tokens of the file at `path`, which [`Gate::reload`] reads again.
    ///
    /// # Errors
    /// As [`Tokens::load`].
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        Ok(Self {
            path: Some(path.to_owned()),
            ..Self::new(Tokens::load(path)?)
        })
    }

    /// Reads the token file again: tokens added are let in, tokens removed
    /// are refused from the next request on. A file that does not load
    /// leaves the tokens in force (and says why). Returns how many tokens
    /// are now in force.
    ///
    /// # Errors
    /// As [`Tokens::load`]; a gate made by [`Gate::new`] has no file.
    pub fn reload(&self) -> Result<usize, LoadError> {
        let Some(path) = &self.path else {
            return Err(LoadError::Invalid("no token file to reload".into()));
        };
        let tokens = Tokens::load(path)?;
        let n = tokens.entries.len();
        *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(tokens);
        Ok(n)
    }

    /// The tokens in force.
    pub fn tokens(&self) -> Arc<Tokens> {
        self.tokens
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn metrics(&self) -> &Arc<AuthMetrics> {
        &self.metrics
    }

    /// Checks an `Authorization` header value (`None`: none was sent) for
    /// `need`, counting a refusal on `surface` and logging it (without the
    /// token).
    ///
    /// # Errors
    /// Why the request is refused.
    pub fn check(
        &self,
        surface: Surface,
        authorization: Option<&[u8]>,
        need: Scope,
    ) -> Result<(), Denial> {
        let result = match authorization.and_then(presented) {
            None => Err(Denial::Missing),
            Some(token) => self.tokens().authorize(&token, need).map(|_| ()),
        };
        if let Err(d) = &result {
            self.refused(surface, d);
        }
        result
    }

    /// Counts and logs one refusal decided elsewhere (e.g. a PostgreSQL
    /// password).
    pub fn refused(&self, surface: Surface, denial: &Denial) {
        self.metrics.refused(surface, denial);
        tracing::warn!(surface = surface.name(), reason = %denial, "request refused");
    }
}

/// What a listener asks of its clients: a token (`tokens`) and TLS (`tls`).
/// The default asks nothing: open, plaintext.
#[derive(Debug, Clone, Default)]
pub struct Access {
    pub tokens: Option<Arc<Gate>>,
    pub tls: Option<Arc<tls::ServerTls>>,
}

/// A gRPC interceptor that lets a call through only with a token holding
/// `need` (always, when `gate` is `None`: authentication is off).
pub fn interceptor(
    gate: Option<Arc<Gate>>,
    surface: Surface,
    need: Scope,
) -> impl FnMut(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> + Clone {
    move |request: tonic::Request<()>| {
        let Some(gate) = &gate else {
            return Ok(request);
        };
        let header = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes());
        match gate.check(surface, header, need) {
            Ok(()) => Ok(request),
            Err(d) => Err(d.status()),
        }
    }
}

/// A new token: `gpulse_` and 64 hex digits of the operating system's
/// randomness (256 bits).
///
/// # Panics
/// When the operating system has no randomness to give.
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).expect("the operating system's random source");
    format!("gpulse_{}", hex::encode(bytes))
}

/// The SHA-256 of `token`, in hex, as the token file stores it.
pub fn hash(token: &str) -> String {
    hex::encode(Sha256::digest(token.as_bytes()))
}

/// The token-file entry for `token`.
pub fn entry(name: &str, scopes: Scopes, token: &str) -> String {
    let scopes = scopes
        .names()
        .iter()
        .map(|s| format!("{s:?}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "[[token]]\nname = {name:?}\nscopes = [{scopes}]\nsha256 = \"{}\"\n",
        hash(token)
    )
}

pub mod tls;

#[cfg(test)]
mod tests;
