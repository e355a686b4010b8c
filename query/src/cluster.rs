//! Cluster-wide reads (issue #8): any node answers for the whole cluster.
//!
//! Each node serves its storage to its peers over Arrow Flight
//! ([`serve_flight`], [`FlightNode`]; the ticket and schema are in
//! `cluster/wire.rs`). A [`ClusterReader`] answers a select (label matchers
//! and a time range) for the cluster: it plans one replica per shard and
//! epoch of the range with [`::cluster::ShardMap::plan_read`] (this
//! node first, then by rendezvous rank, skipping peers the poller marks
//! down), reads its own shards from storage and the others' over Flight in
//! parallel, re-plans the shards of a node that fails onto the next replica,
//! and merges: a series that two nodes return (two epochs' owners) becomes
//! one, with each timestamp once.
//!
//! A shard that no replica could serve is not dropped silently: the answer
//! carries a warning that names it and its owners, with why each was not
//! read. The front ends show these warnings: `warnings` in Prometheus API
//! answers, `X-Gpulse-Partial: true` and a `warnings` field over HTTP SQL, a
//! NoticeResponse over PostgreSQL; a remote read fails instead (its protocol
//! has no warnings). When a reachable peer runs with another cluster file,
//! every cluster query is refused ([`ClusterError::Refused`]).
//!
//! Which shards exist comes from [`ClusterState::known_keys`]: the shards this
//! node has seen and those its peers report. Series of this node whose shard
//! is not known are read too (see [`local_shard_keys`] to seed the state at
//! start). Series are assigned to shards by [`shard_of`].

mod flight;
mod reader;
pub(crate) mod wire;

use std::collections::{BTreeSet, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use ::cluster::ShardRef;
pub use ::cluster::{ClusterState, ShardKey};
pub use flight::{FlightNode, serve_flight};
pub use reader::{ClusterEvents, ClusterReader, ClusterStates, ReaderConfig, RollupSelection};

/// Entry points for the fuzz targets (`fuzz/fuzz_targets/flight_*.rs`): the
/// decoders of what a Flight client or a peer sends. Not an API.
#[doc(hidden)]
pub mod fuzzing {
    /// Decodes a `DoGet` ticket; true if it is accepted.
    pub fn ticket(bytes: &[u8]) -> bool {
        super::wire::decode_ticket(bytes).is_ok()
    }

    /// Reads `bytes` as an Arrow IPC stream of a peer's select answer, as
    /// the reader takes Flight data; true if every batch is accepted.
    pub fn answer(bytes: &[u8]) -> bool {
        let mut decoder = super::wire::AnswerDecoder::default();
        read_stream(bytes, |b| decoder.push(b).is_ok()) && {
            let _ = decoder.finish();
            true
        }
    }

    /// Reads `bytes` as an Arrow IPC stream of a peer's answer to a PromQL
    /// ticket of two queries; true if every batch is accepted.
    pub fn partials_answer(bytes: &[u8]) -> bool {
        let mut rows = Vec::new();
        read_stream(bytes, |b| {
            super::wire::decode_partials(b, 2, &mut rows).is_ok()
        })
    }

    /// Reads `bytes` as an Arrow IPC stream of a peer's health answer
    /// (events or GPU states), as the reader takes it; true if every batch
    /// reads as one or the other.
    pub fn health_answer(bytes: &[u8]) -> bool {
        read_stream(bytes, |b| {
            crate::health_events::events_from_batch(b).is_ok()
                || crate::health_events::states_from_batch(b).is_ok()
        })
    }

    /// Reads the IPC stream `bytes` batch by batch into `take`; true if
    /// Arrow decodes all of it and `take` accepts every batch.
    ///
    /// A node gets a peer's answer as Flight messages, each bounded by the
    /// gRPC message limit before Arrow sees it. A raw IPC stream carries
    /// its own lengths instead, so they are checked against the input
    /// first: Arrow's reader allocates what a length prefix declares. As
    /// the reader does, a panic inside Arrow's decoder is a malformed answer.
    fn read_stream(bytes: &[u8], mut take: impl FnMut(&arrow::array::RecordBatch) -> bool) -> bool {
        if !ipc_lengths_fit(bytes) {
            return false;
        }
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let Ok(mut reader) = arrow_decodes(|| {
                arrow::ipc::reader::StreamReader::try_new(std::io::Cursor::new(bytes), None)
            }) else {
                return false;
            };
            while let Some(batch) = arrow_decodes(|| reader.next()) {
                match batch {
                    Ok(b) if take(&b) => {}
                    _ => return false,
                }
            }
            true
        }))
        .unwrap_or(false)
    }

    /// Installs the panic hook of the Flight fuzz targets: libFuzzer's own
    /// aborts on every panic, even a caught one. Arrow's IPC decoder panics
    /// on some malformed input (arrow-ipc 59.3.2: a schema without a field
    /// list; arrow-buffer, from the decoder: a validity buffer shorter than
    /// its array); the node catches panics of that step
    /// (`ClusterReader::fetch`, `fetch_health`) and so does [`read_stream`],
    /// so those unwind to that catch. Any other panic, in gpulse's decoders
    /// included, still aborts: a crash.
    pub fn let_arrow_decoder_panics_unwind() {
        let abort = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !in_arrow_decoder() {
                abort(info);
            }
        }));
    }

    thread_local! {
        static IN_ARROW: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Runs `f`, a step of Arrow's own IPC decoder, flagged so that
    /// [`in_arrow_decoder`] says so while it runs (also while a panic in it
    /// unwinds).
    fn arrow_decodes<T>(f: impl FnOnce() -> T) -> T {
        struct Flag;
        impl Drop for Flag {
            fn drop(&mut self) {
                IN_ARROW.with(|c| c.set(false));
            }
        }
        IN_ARROW.with(|c| c.set(true));
        let _flag = Flag;
        f()
    }

    /// True inside Arrow's IPC decoder: the node catches a panic there as a
    /// malformed answer (`ClusterReader::fetch`, `fetch_health`), so the
    /// fuzz targets' panic hooks let such a panic unwind to that catch,
    /// wherever in Arrow's crates it was raised. A panic in gpulse's own
    /// decoders is not flagged and stays a crash.
    pub fn in_arrow_decoder() -> bool {
        IN_ARROW.with(std::cell::Cell::get)
    }

    /// Whether every message of the IPC stream `bytes` (continuation
    /// marker, metadata length, metadata, body) declares lengths that lie
    /// within `bytes`.
    fn ipc_lengths_fit(bytes: &[u8]) -> bool {
        let i32_at = |at: usize| {
            bytes
                .get(at..at + 4)
                .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        };
        let mut at = 0usize;
        while at < bytes.len() {
            let Some(mut len) = i32_at(at) else {
                return false;
            };
            at += 4;
            if len == -1 {
                let Some(l) = i32_at(at) else {
                    return false;
                };
                len = l;
                at += 4;
            }
            if len == 0 {
                return true;
            }
            let Ok(len) = usize::try_from(len) else {
                return false;
            };
            let Some(meta) = bytes.get(at..at.saturating_add(len)) else {
                return false;
            };
            let Ok(message) = arrow::ipc::root_as_message(meta) else {
                return false;
            };
            at += len;
            let Ok(body) = usize::try_from(message.bodyLength()) else {
                return false;
            };
            if body > bytes.len() - at {
                return false;
            }
            at += body;
        }
        true
    }
}
use storage::{KeyArc, Label, Matcher, SelectedSeries, SeriesKey, Storage};

/// The shard of a stored series, by the one placement rule
/// ([`ShardKey::of_labels`]).
pub fn shard_of(key: &SeriesKey) -> ShardKey {
    ShardKey::of_labels(|name| key.get(name))
}

/// The shard of a rollup group at gpu or host level.
pub(crate) fn shard_of_group(g: &storage::RollupGroup) -> ShardKey {
    ShardKey::of(&g.rack, &g.host)
}

/// This node's rollup records of the shards `keep` accepts, at `req.level`,
/// for windows starting in `[min_start, max_start]`: as stored at gpu and
/// host level, merged from the host level above it (a host belongs to one
/// shard; a rack, row or cluster group of this node may mix shards that
/// other nodes also hold).
pub(crate) fn shard_rollups(
    storage: &Storage,
    req: &wire::RollupRequest,
    min_start: i64,
    max_start: i64,
    keep: impl Fn(&ShardKey) -> bool,
) -> wire::RollupMap {
    use storage::RollupLevel;
    let read = req.level.min(RollupLevel::Host);
    let mut out = wire::RollupMap::new();
    if min_start > max_start {
        return out;
    }
    for (g, records) in storage.select_rollups(req.tier, read, &req.filter, min_start, max_start) {
        if !keep(&shard_of_group(&g)) {
            continue;
        }
        let target = g.at_level(req.level);
        for r in records
            .iter()
            .filter(|r| (min_start..=max_start).contains(&r.window_start_ms))
        {
            wire::merge_record(&mut out, &target, r);
        }
    }
    out
}

/// The shards of every series in `storage`, for
/// [`ClusterState::note_key`] at start: what this node held before it
/// restarted is then known before its agents reconnect.
pub fn local_shard_keys(storage: &Storage) -> BTreeSet<ShardKey> {
    storage
        .select(&[], i64::MIN, i64::MAX)
        .iter()
        .map(|s| shard_of(&s.key))
        .collect()
}

/// Whether a series of shard `key` could match all of `matchers`: false
/// only when a matcher on `rack` (or, for a host without a rack, on
/// `Hostname`) rules out every series of the shard.
pub(crate) fn shard_may_match(key: &ShardKey, matchers: &[Matcher]) -> bool {
    let (labels, names): (Vec<Label>, &[&str]) = match key {
        ShardKey::Rack(r) => (vec![Label::new("rack", r.as_str())], &["rack"]),
        ShardKey::Host(h) => (
            vec![Label::new("Hostname", h.as_str())],
            &["rack", "Hostname"],
        ),
    };
    let Ok(probe) = SeriesKey::new("probe", labels) else {
        return true;
    };
    matchers
        .iter()
        .filter(|m| names.contains(&m.name()))
        .all(|m| m.matches(&probe))
}

/// Why a cluster read gave no answer at all.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    /// The cluster is not in a state to answer: a peer runs with another
    /// cluster file (HTTP 503).
    #[error("{0}")]
    Refused(String),
    /// Something on this node failed (HTTP 500).
    #[error("{0}")]
    Internal(String),
    /// The select received more samples from peers than
    /// [`ReaderConfig::max_peer_samples`] allows (HTTP 422).
    #[error("{0}")]
    TooLarge(crate::LimitExceeded),
}

/// One part of a series: from this node's storage (decoded when read) or
/// fetched from a peer.
#[derive(Debug, Clone)]
enum Part {
    Local(SelectedSeries),
    Fetched(Arc<wire::FetchedSeries>),
}

impl Part {
    fn read_into(
        &self,
        min_ts: i64,
        max_ts: i64,
        ts: &mut Vec<i64>,
        values: &mut Vec<f64>,
    ) -> storage::Result<()> {
        match self {
            Part::Local(s) => s.read_into(min_ts, max_ts, ts, values),
            Part::Fetched(f) => {
                let lo = f.ts.partition_point(|&t| t < min_ts);
                let hi = f.ts.partition_point(|&t| t <= max_ts).max(lo);
                ts.extend_from_slice(&f.ts[lo..hi]);
                values.extend_from_slice(&f.values[lo..hi]);
                Ok(())
            }
        }
    }

    fn max_samples(&self) -> usize {
        match self {
            Part::Local(s) => s.max_samples(),
            Part::Fetched(f) => f.ts.len(),
        }
    }
}

/// One series of a select: from this node's storage, from peers, or both
/// (merged when read).
#[derive(Debug, Clone)]
pub struct ClusterSeries {
    pub key: KeyArc,
    parts: Vec<Part>,
}

impl From<SelectedSeries> for ClusterSeries {
    fn from(s: SelectedSeries) -> Self {
        Self {
            key: s.key.clone(),
            parts: vec![Part::Local(s)],
        }
    }
}

impl ClusterSeries {
    /// Appends the samples in `[min_ts, max_ts]` to `ts` and `values` in
    /// time order, each timestamp once (where parts overlap, the first part
    /// that has it wins: this node's own data, then the peers' in node order).
    ///
    /// # Errors
    /// A local chunk that fails its checksum or does not decode.
    pub fn read_into(
        &self,
        min_ts: i64,
        max_ts: i64,
        ts: &mut Vec<i64>,
        values: &mut Vec<f64>,
    ) -> storage::Result<()> {
        if let [one] = self.parts.as_slice() {
            return one.read_into(min_ts, max_ts, ts, values);
        }
        let (mut acc_t, mut acc_v) = (Vec::new(), Vec::new());
        let (mut t, mut v) = (Vec::new(), Vec::new());
        for p in &self.parts {
            t.clear();
            v.clear();
            p.read_into(min_ts, max_ts, &mut t, &mut v)?;
            (acc_t, acc_v) = merge_first_wins(&acc_t, &acc_v, &t, &v);
        }
        ts.extend_from_slice(&acc_t);
        values.extend_from_slice(&acc_v);
        Ok(())
    }

    /// Upper bound of the samples of the series (before de-duplication).
    pub fn max_samples(&self) -> usize {
        self.parts.iter().map(Part::max_samples).sum()
    }
}

/// Merges two time-ordered sample lists; a timestamp in both keeps `a`'s value.
fn merge_first_wins(at: &[i64], av: &[f64], bt: &[i64], bv: &[f64]) -> (Vec<i64>, Vec<f64>) {
    let mut t = Vec::with_capacity(at.len() + bt.len());
    let mut v = Vec::with_capacity(at.len() + bt.len());
    let (mut i, mut j) = (0, 0);
    while i < at.len() || j < bt.len() {
        let take_a = j >= bt.len() || (i < at.len() && at[i] <= bt[j]);
        if take_a {
            if j < bt.len() && bt[j] == at[i] {
                j += 1;
            }
            t.push(at[i]);
            v.push(av[i]);
            i += 1;
        } else {
            t.push(bt[j]);
            v.push(bv[j]);
            j += 1;
        }
    }
    (t, v)
}

/// The answer of a select: series sorted by key, and what it lacks.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    pub series: Vec<ClusterSeries>,
    /// Why the answer may be incomplete; empty when it is complete.
    pub warnings: Vec<String>,
}

/// Where the query engines read series: this node's storage alone, or the
/// whole cluster.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    Local(Arc<Storage>),
    Cluster(ClusterReader),
    /// This node's storage, only the series of the shards `ShardFilter`
    /// admits: where a PromQL aggregation pushed down to this node reads.
    Shards(Arc<Storage>, ShardFilter),
}

/// The shards one node reads for a cluster query: those assigned to it, and,
/// when `unknown_too` is set, every shard not in it (shards no node reported,
/// which only a local read finds). Storage tests each series against it
/// before reading the series ([`Storage::select_where`]): a node holds about
/// twice the shards it is asked to read (replication factor 2), and need not
/// gather the others' chunks. The test looks the shard up without copying
/// its name: a `ShardKey` allocated per series made it 15 % of a peer's CPU
/// for a pushed-down `count` (`perf`, 2026-12-07).
#[derive(Debug, Clone)]
pub(crate) struct ShardFilter {
    assigned: Option<Arc<ShardSet>>,
    unknown_too: Option<Arc<ShardSet>>,
}

impl ShardFilter {
    /// The shards `assigned` and, with `unknown_too`, every shard not in it.
    pub(crate) fn new(
        assigned: Option<BTreeSet<ShardKey>>,
        unknown_too: Option<BTreeSet<ShardKey>>,
    ) -> Self {
        Self {
            assigned: assigned.map(|a| Arc::new(ShardSet::of(&a))),
            unknown_too: unknown_too.map(|k| Arc::new(ShardSet::of(&k))),
        }
    }

    /// Exactly the shards `assigned`: what a peer reads for a ticket.
    pub(crate) fn only(assigned: BTreeSet<ShardKey>) -> Self {
        Self::new(Some(assigned), None)
    }

    /// Whether the filter admits the shard of the series `key`.
    pub(crate) fn admits(&self, key: &SeriesKey) -> bool {
        let shard = ShardRef::of_labels(|name| key.get(name));
        self.assigned.as_ref().is_some_and(|a| a.contains(shard))
            || self
                .unknown_too
                .as_ref()
                .is_some_and(|k| !k.contains(shard))
    }

    fn select(
        &self,
        storage: &Storage,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Selection {
        Selection {
            series: self
                .select_series(storage, matchers, min_ts, max_ts)
                .into_iter()
                .map(ClusterSeries::from)
                .collect(),
            warnings: Vec::new(),
        }
    }

    /// The series of the shards admitted that match `matchers`.
    pub(crate) fn select_series(
        &self,
        storage: &Storage,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Vec<SelectedSeries> {
        storage.select_where(matchers, min_ts, max_ts, &|key| self.admits(key))
    }
}

/// A set of shards that a series' borrowed [`ShardRef`] is looked up in.
#[derive(Debug, Default)]
struct ShardSet {
    racks: HashSet<String>,
    hosts: HashSet<String>,
}

impl ShardSet {
    fn of(keys: &BTreeSet<ShardKey>) -> Self {
        let mut set = Self::default();
        for k in keys {
            match k {
                ShardKey::Rack(r) => set.racks.insert(r.clone()),
                ShardKey::Host(h) => set.hosts.insert(h.clone()),
            };
        }
        set
    }

    fn contains(&self, shard: ShardRef<'_>) -> bool {
        match shard {
            ShardRef::Rack(r) => self.racks.contains(r),
            ShardRef::Host(h) => self.hosts.contains(h),
        }
    }
}

impl Source {
    /// Selects series. In local mode this is `Storage::select`, nothing more.
    pub(crate) async fn select(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, ClusterError> {
        match self {
            Source::Local(storage) => Ok(local_selection(storage, matchers, min_ts, max_ts)),
            Source::Cluster(r) => r.select(matchers, min_ts, max_ts).await,
            Source::Shards(storage, f) => Ok(f.select(storage, matchers, min_ts, max_ts)),
        }
    }

    /// [`Self::select`] for code that runs on a blocking thread (never on an
    /// async worker).
    pub(crate) fn select_blocking(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, ClusterError> {
        match self {
            Source::Local(storage) => Ok(local_selection(storage, matchers, min_ts, max_ts)),
            Source::Cluster(r) => r.select_blocking(matchers, min_ts, max_ts, false),
            Source::Shards(storage, f) => Ok(f.select(storage, matchers, min_ts, max_ts)),
        }
    }

    /// Each matching series' newest sample in `[min_ts, max_ts]`
    /// ([`Storage::newest`]) on a single node; `None` in a cluster, whose
    /// readers then select and read the samples.
    pub(crate) fn newest_blocking(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Option<Vec<(KeyArc, storage::Newest)>> {
        match self {
            Source::Local(storage) => Some(storage.newest(matchers, min_ts, max_ts)),
            Source::Cluster(_) => None,
            Source::Shards(storage, f) => {
                Some(storage.newest_where(matchers, min_ts, max_ts, &|key| f.admits(key)))
            }
        }
    }

    /// [`Self::select_blocking`] for label sets only: the samples of the
    /// series it returns must not be read (peers send none).
    pub(crate) fn series_blocking(
        &self,
        matchers: &[Matcher],
        min_ts: i64,
        max_ts: i64,
    ) -> Result<Selection, ClusterError> {
        match self {
            Source::Local(storage) => Ok(local_selection(storage, matchers, min_ts, max_ts)),
            Source::Cluster(r) => r.select_blocking(matchers, min_ts, max_ts, true),
            Source::Shards(storage, f) => Ok(f.select(storage, matchers, min_ts, max_ts)),
        }
    }
}

fn local_selection(storage: &Storage, matchers: &[Matcher], min_ts: i64, max_ts: i64) -> Selection {
    Selection {
        series: storage
            .select(matchers, min_ts, max_ts)
            .into_iter()
            .map(ClusterSeries::from)
            .collect(),
        warnings: Vec::new(),
    }
}

/// Adds `new` to `all`, skipping repeats, keeping the order.
pub(crate) fn add_warnings(all: &mut Vec<String>, new: impl IntoIterator<Item = String>) {
    for w in new {
        if !all.contains(&w) {
            all.push(w);
        }
    }
}

tokio::task_local! {
    /// The warnings of the SQL statement being planned in this task.
    static SQL_WARNINGS: Arc<Mutex<Vec<String>>>;
}

/// Runs `f` (the planning and running of SQL) collecting the warnings that
/// table scans report with [`report_sql_warnings`].
pub(crate) async fn collect_sql_warnings<F: Future>(f: F) -> (F::Output, Vec<String>) {
    let cell = Arc::new(Mutex::new(Vec::new()));
    let out = SQL_WARNINGS.scope(cell.clone(), f).await;
    let warnings = std::mem::take(&mut *cell.lock().unwrap_or_else(|e| e.into_inner()));
    (out, warnings)
}

/// Hands a scan's warnings to the statement's collector.
///
/// # Errors
/// No collector is in scope: the caller must fail the query rather than
/// return a partial answer nobody would see.
pub(crate) fn report_sql_warnings(warnings: Vec<String>) -> Result<(), Vec<String>> {
    if warnings.is_empty() {
        return Ok(());
    }
    match SQL_WARNINGS.try_with(|cell| {
        let mut all = cell.lock().unwrap_or_else(|e| e.into_inner());
        add_warnings(&mut all, warnings.iter().cloned());
    }) {
        Ok(()) => Ok(()),
        Err(_) => Err(warnings),
    }
}

/// For tables that read this node alone in cluster mode: reports that the
/// result holds only this node's data.
///
/// # Errors
/// As [`report_sql_warnings`], as a DataFusion error.
pub(crate) fn warn_local_only(table: &str) -> datafusion::error::Result<()> {
    report_sql_warnings(vec![format!(
        "partial result: {table} holds only this node's data; it is not read cluster-wide"
    )])
    .map_err(refuse_unseen)
}

/// The error of a scan whose warnings no one would see.
pub(crate) fn refuse_unseen(warnings: Vec<String>) -> datafusion::error::DataFusionError {
    datafusion::error::DataFusionError::Execution(format!(
        "refusing a partial result that could not be reported: {}",
        warnings.join("; ")
    ))
}

/// Counters of the cluster read path, for `/metrics`: the Flight server's
/// (what peers asked of this node) and the reader's (what this node asked).
#[derive(Debug, Default)]
pub struct ClusterMetrics {
    /// `DoGet` calls received.
    pub flight_requests: AtomicU64,
    /// `DoGet` calls refused for a ticket that does not parse.
    pub flight_bad_tickets: AtomicU64,
    /// `DoGet` calls that failed reading local storage.
    pub flight_read_errors: AtomicU64,
    pub flight_series_sent: AtomicU64,
    pub flight_samples_sent: AtomicU64,
    /// Cluster selects run by this node.
    pub selects: AtomicU64,
    /// Selects refused (a peer with another cluster file).
    pub selects_refused: AtomicU64,
    /// Selects answered with at least one shard missing.
    pub selects_partial: AtomicU64,
    /// Selects planned again because the peers' status, asked alongside
    /// their first round, changed what they were planned from.
    pub selects_replanned: AtomicU64,
    /// Flight reads of peers.
    pub peer_reads: AtomicU64,
    /// Peer reads that failed (unreachable, error, timeout, bad answer);
    /// their shards were re-planned onto other replicas.
    pub peer_read_failures: AtomicU64,
    /// Peer answers refused as malformed (counted in failures too).
    pub peer_bad_answers: AtomicU64,
    pub peer_series_received: AtomicU64,
    pub peer_samples_received: AtomicU64,
    /// Bytes of Flight answers sent to peers (their Arrow IPC messages).
    pub flight_bytes_sent: AtomicU64,
    /// PromQL aggregations this node evaluated where the data is: partial
    /// results from each owner, merged here.
    pub promql_pushdowns: AtomicU64,
    /// SQL aggregates evaluated where the data is, likewise.
    pub sql_pushdowns: AtomicU64,
    /// Points of partial PromQL results, and rows of partial SQL results,
    /// received from peers.
    pub peer_partial_points_received: AtomicU64,
}

impl ClusterMetrics {
    /// Appends the counters in the Prometheus text format.
    pub fn render(&self, out: &mut String) {
        let counters: [(&str, &str, &AtomicU64); 18] = [
            (
                "gpulse_flight_requests_total",
                "Flight DoGet calls received from peers.",
                &self.flight_requests,
            ),
            (
                "gpulse_flight_bad_tickets_total",
                "Flight DoGet calls refused for a bad ticket.",
                &self.flight_bad_tickets,
            ),
            (
                "gpulse_flight_read_errors_total",
                "Flight DoGet calls that failed reading local storage.",
                &self.flight_read_errors,
            ),
            (
                "gpulse_flight_series_sent_total",
                "Series sent to peers over Flight.",
                &self.flight_series_sent,
            ),
            (
                "gpulse_flight_samples_sent_total",
                "Samples sent to peers over Flight.",
                &self.flight_samples_sent,
            ),
            (
                "gpulse_cluster_selects_total",
                "Cluster-wide selects run by this node.",
                &self.selects,
            ),
            (
                "gpulse_cluster_selects_refused_total",
                "Cluster selects refused because a peer runs with another cluster file.",
                &self.selects_refused,
            ),
            (
                "gpulse_cluster_selects_partial_total",
                "Cluster selects answered with a shard missing (and a warning).",
                &self.selects_partial,
            ),
            (
                "gpulse_cluster_selects_replanned_total",
                "Cluster selects planned again: the peers' status, asked during the read, had changed.",
                &self.selects_replanned,
            ),
            (
                "gpulse_cluster_peer_reads_total",
                "Flight reads of peers.",
                &self.peer_reads,
            ),
            (
                "gpulse_cluster_peer_read_failures_total",
                "Flight reads of peers that failed; their shards were re-planned.",
                &self.peer_read_failures,
            ),
            (
                "gpulse_cluster_peer_bad_answers_total",
                "Flight answers of peers refused as malformed.",
                &self.peer_bad_answers,
            ),
            (
                "gpulse_cluster_peer_series_received_total",
                "Series received from peers.",
                &self.peer_series_received,
            ),
            (
                "gpulse_cluster_peer_samples_received_total",
                "Samples received from peers.",
                &self.peer_samples_received,
            ),
            (
                "gpulse_flight_bytes_sent_total",
                "Bytes of Flight answers sent to peers (Arrow IPC messages).",
                &self.flight_bytes_sent,
            ),
            (
                "gpulse_cluster_promql_pushdowns_total",
                "PromQL aggregations evaluated on the owners of the data and merged here.",
                &self.promql_pushdowns,
            ),
            (
                "gpulse_cluster_sql_pushdowns_total",
                "SQL aggregates evaluated on the owners of the data and merged here.",
                &self.sql_pushdowns,
            ),
            (
                "gpulse_cluster_peer_partial_points_received_total",
                "Points of partial PromQL results and rows of partial SQL results received from peers.",
                &self.peer_partial_points_received,
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Relaxed)
            );
        }
    }
}

#[cfg(test)]
mod tests;
