//! Hierarchical rollups: count, sum, min, max, first and last per
//! (level, group, window), for levels gpu → host → rack → row → cluster and
//! tiers 1 min → 1 h → 1 d.
//!
//! # Where it sits
//!
//! Nothing is folded on the append path. The head keeps only its Gorilla
//! chunks; a flush folds the frozen chunks, in time order, into per-series
//! 1-minute records at gpu level (the finest group, [`fold_minutes`]), on the
//! thread that writes the rollup file while another writes the segment, and
//! merges them to every coarser tier and level ([`DeltaTables`]) for the file
//! ([`file`], `docs/format/rollup.md`). A query folds the part still in memory
//! the same way. Until December 2026 every accepted sample was folded into its
//! series' minute records in the head: 72 bytes a minute and series, about
//! half the server's memory at a 10 s interval (`docs/BENCHMARKS.md`). Keeping
//! 15 deltas (3 tiers × 5 levels) per sample, the brief's first idea, would
//! cost 15 hash lookups per sample; since every aggregate is mergeable, folding
//! the minutes and merging them gives the same result.
//!
//! # Invariant
//!
//! At every instant, `merge(rollup files) + merge(memory) == fold(raw samples
//! stored)`, where the memory part (head plus a flush in progress) covers
//! exactly the samples that are not yet in a rollup file. A flush writes the
//! rollup file of the frozen head *before* its segment; each rollup file
//! records the WAL cut of its flush, and WAL replay feeds the rollups only
//! from WAL segments at or after the newest rollup file's cut (see
//! `replay_wal` in `db.rs`). A crash between the two files thus neither loses
//! nor double-counts a sample. Files written by
//! [`crate::Storage::import_rollups`] hold pre-aggregated history with no raw
//! samples behind it (cut 0); with them the invariant reads
//! `… == imported records + fold(raw samples stored)` (docs/format/rollup.md).
//! Raw retention does not change the rollups: "raw samples stored" there
//! means every sample accepted, whether its segment is still there or not.
//!
//! # Gpu-level minutes and the raw cut
//!
//! Rollup files (version 4 on) hold the gpu-level 1-minute records only of the
//! raw samples before the store's *raw cut* ([`file::RollupFile::raw_cut`]):
//! those of later samples are folded from the raw data when a query asks for
//! them, so that the most numerous records (one per series and minute, about
//! the size of the 6 samples they summarise at a 10 s interval) are not
//! stored twice. Retention moves the cut forward, writing those records
//! first, before it drops raw data; a flush writes them only for late samples
//! before the cut. The head still folds every sample into minute records:
//! they are what a flush merges into the coarser tiers and levels.
//!
//! # Merging, ties, NaN
//!
//! `count` and `sum` add; `min`/`max` use `f64::min`/`f64::max`, which ignore
//! NaN unless every value is NaN. `first` is the value with the smallest
//! timestamp, `last` the one with the largest; when two series have a sample
//! at the same timestamp, `first` takes the smaller value and `last` the
//! larger one (`f64::total_cmp`), so that the result does not depend on the
//! order of merging (shards, files, levels). A series itself never has two
//! samples at one timestamp.
//!
//! # Groups
//!
//! The group of a series at gpu level is `(metric, cluster, row, rack, host,
//! gpu)` from `__name__` and the labels `cluster`, `row`, `rack`, `Hostname`
//! (or `hostname` when `Hostname` is absent) and `gpu`; a missing label is the
//! empty string. Coarser levels blank the fields below them.
//!
//! # Known gaps
//!
//! - Appends refuse samples before the raw cut (counted as too old), since
//!   the raw data a repeat would be checked against may be gone; WAL replay
//!   refuses them too, so that a repeat refused before a crash is not
//!   counted after it ([`crate::Storage::raw_cut`]). The cut stays at or
//!   before the raw retention's cutoff, rounded down to a minute.
//! - Rollup files are merged per finished compaction window and the expired
//!   ones rewritten into one "archive" file by retention; the archive is
//!   rewritten whole each time (see [`crate::Storage::enforce_retention`]).

pub(crate) mod file;
#[cfg(test)]
pub(crate) mod tests;

use std::cmp::Ordering;
use std::collections::BTreeMap;
use std::sync::Arc;

use crate::series::{KeyHasher, SeriesKey};

/// A rollup window length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RollupTier {
    Minute,
    Hour,
    Day,
}

impl RollupTier {
    pub const ALL: [RollupTier; 3] = [Self::Minute, Self::Hour, Self::Day];

    /// Length of a window in milliseconds.
    pub fn window_ms(self) -> i64 {
        match self {
            Self::Minute => 60_000,
            Self::Hour => 3_600_000,
            Self::Day => 86_400_000,
        }
    }

    /// Start of the window that holds `ts_ms` (windows are aligned to the
    /// epoch, UTC). Saturates at `i64::MIN` for the first partial window.
    pub fn window_start(self, ts_ms: i64) -> i64 {
        ts_ms.saturating_sub(ts_ms.rem_euclid(self.window_ms()))
    }

    /// The tier's name where people and peers see it: `1m`, `1h`, `1d` (the
    /// `tier` column of the SQL tables, the cluster's rollup tickets).
    pub fn label(self) -> &'static str {
        match self {
            Self::Minute => "1m",
            Self::Hour => "1h",
            Self::Day => "1d",
        }
    }

    /// The tier named `label` ([`Self::label`]).
    pub fn by_label(label: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.label() == label)
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    pub(crate) fn from_index(i: u8) -> Option<Self> {
        Self::ALL.get(i as usize).copied()
    }
}

/// A level of the topology hierarchy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RollupLevel {
    Gpu,
    Host,
    Rack,
    Row,
    Cluster,
}

impl RollupLevel {
    pub const ALL: [RollupLevel; 5] = [Self::Gpu, Self::Host, Self::Rack, Self::Row, Self::Cluster];

    /// The level's name where people and peers see it: `gpu`, `host`,
    /// `rack`, `row`, `cluster` (the `level` column of the SQL tables, the
    /// cluster's rollup tickets).
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Host => "host",
            Self::Rack => "rack",
            Self::Row => "row",
            Self::Cluster => "cluster",
        }
    }

    /// The level named `name` ([`Self::name`]).
    pub fn by_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.name() == name)
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    pub(crate) fn from_index(i: u8) -> Option<Self> {
        Self::ALL.get(i as usize).copied()
    }
}

/// The key of a rollup group; fields below the group's level are "".
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RollupGroup {
    pub metric: String,
    pub cluster: String,
    pub row: String,
    pub rack: String,
    pub host: String,
    pub gpu: String,
}

impl RollupGroup {
    /// The gpu-level group of a series (see the module docs for the labels).
    pub fn of_series(key: &SeriesKey) -> Self {
        GroupRef::of_series(key).to_group()
    }

    /// This group projected to a coarser (or the same) level.
    pub fn at_level(&self, level: RollupLevel) -> Self {
        let keep = |l: RollupLevel, s: &String| {
            if level <= l { s.clone() } else { String::new() }
        };
        Self {
            metric: self.metric.clone(),
            cluster: self.cluster.clone(),
            row: keep(RollupLevel::Row, &self.row),
            rack: keep(RollupLevel::Rack, &self.rack),
            host: keep(RollupLevel::Host, &self.host),
            gpu: keep(RollupLevel::Gpu, &self.gpu),
        }
    }

    /// Whether this group is its own projection to `level` (`*self ==
    /// self.at_level(level)`): every field below the level is empty. Without
    /// building the projection, for the checks of every group of a file.
    pub fn is_at_level(&self, level: RollupLevel) -> bool {
        self.as_ref().is_at_level(level)
    }

    /// The group's fields, borrowed.
    pub(crate) fn as_ref(&self) -> GroupRef<'_> {
        GroupRef {
            metric: &self.metric,
            cluster: &self.cluster,
            row: &self.row,
            rack: &self.rack,
            host: &self.host,
            gpu: &self.gpu,
        }
    }
}

/// A group's fields as borrowed text: what a rollup file reader tests
/// before it allocates a [`RollupGroup`] for the groups it keeps, and what a
/// flush looks its groups up by. Hashes as the [`RollupGroup`] of the same
/// text does (the same fields, in the same order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GroupRef<'a> {
    pub(crate) metric: &'a str,
    pub(crate) cluster: &'a str,
    pub(crate) row: &'a str,
    pub(crate) rack: &'a str,
    pub(crate) host: &'a str,
    pub(crate) gpu: &'a str,
}

impl<'a> GroupRef<'a> {
    /// [`RollupGroup::of_series`], borrowed from the key.
    pub(crate) fn of_series(key: &'a SeriesKey) -> Self {
        let label = |name: &str| {
            key.labels()
                .iter()
                .find(|l| l.name == name)
                .map(|l| l.value.as_str())
        };
        Self {
            metric: key.metric(),
            cluster: label("cluster").unwrap_or_default(),
            row: label("row").unwrap_or_default(),
            rack: label("rack").unwrap_or_default(),
            host: label("Hostname")
                .or_else(|| label("hostname"))
                .unwrap_or_default(),
            gpu: label("gpu").unwrap_or_default(),
        }
    }

    /// [`RollupGroup::at_level`], borrowed.
    pub(crate) fn at_level(self, level: RollupLevel) -> Self {
        let keep = |l: RollupLevel, s: &'a str| if level <= l { s } else { "" };
        Self {
            row: keep(RollupLevel::Row, self.row),
            rack: keep(RollupLevel::Rack, self.rack),
            host: keep(RollupLevel::Host, self.host),
            gpu: keep(RollupLevel::Gpu, self.gpu),
            ..self
        }
    }

    /// [`RollupGroup::is_at_level`].
    pub(crate) fn is_at_level(&self, level: RollupLevel) -> bool {
        let empty_below = |l: RollupLevel, s: &str| level <= l || s.is_empty();
        empty_below(RollupLevel::Row, self.row)
            && empty_below(RollupLevel::Rack, self.rack)
            && empty_below(RollupLevel::Host, self.host)
            && empty_below(RollupLevel::Gpu, self.gpu)
    }

    pub(crate) fn to_group(self) -> RollupGroup {
        RollupGroup {
            metric: self.metric.to_owned(),
            cluster: self.cluster.to_owned(),
            row: self.row.to_owned(),
            rack: self.rack.to_owned(),
            host: self.host.to_owned(),
            gpu: self.gpu.to_owned(),
        }
    }
}

impl hashbrown::Equivalent<RollupGroup> for GroupRef<'_> {
    fn equivalent(&self, key: &RollupGroup) -> bool {
        *self == key.as_ref()
    }
}

/// Equality filters on a group's fields; `None` matches anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RollupFilter {
    pub metric: Option<String>,
    pub cluster: Option<String>,
    pub row: Option<String>,
    pub rack: Option<String>,
    pub host: Option<String>,
    pub gpu: Option<String>,
}

impl RollupFilter {
    pub fn matches(&self, g: &RollupGroup) -> bool {
        self.matches_ref(&g.as_ref())
    }

    /// [`Self::matches`] on borrowed fields.
    pub(crate) fn matches_ref(&self, g: &GroupRef<'_>) -> bool {
        let ok = |f: &Option<String>, v: &str| f.as_deref().is_none_or(|f| f == v);
        ok(&self.metric, g.metric)
            && ok(&self.cluster, g.cluster)
            && ok(&self.row, g.row)
            && ok(&self.rack, g.rack)
            && ok(&self.host, g.host)
            && ok(&self.gpu, g.gpu)
    }

    /// `self.matches(&g.at_level(level))`, without building the projection:
    /// the fields that `level` blanks compare as "".
    pub(crate) fn matches_at(&self, g: &RollupGroup, level: RollupLevel) -> bool {
        fn kept(level: RollupLevel, field: RollupLevel, v: &str) -> &str {
            if level <= field { v } else { "" }
        }
        let ok = |f: &Option<String>, v: &str| f.as_deref().is_none_or(|f| f == v);
        ok(&self.metric, &g.metric)
            && ok(&self.cluster, &g.cluster)
            && ok(&self.row, kept(level, RollupLevel::Row, &g.row))
            && ok(&self.rack, kept(level, RollupLevel::Rack, &g.rack))
            && ok(&self.host, kept(level, RollupLevel::Host, &g.host))
            && ok(&self.gpu, kept(level, RollupLevel::Gpu, &g.gpu))
    }
}

/// The fields of its [`RollupRecord`]s that a rollup query needs besides the
/// window start and the count, which every read decodes. A rollup file stores
/// each field as its own column, so a read skips the columns it is not asked
/// for; in the records it returns, the values of those fields are NaN and
/// their timestamps the window's start. The first read of a file's block
/// decodes (and checks) every field whatever it is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordFields {
    pub sum: bool,
    pub min: bool,
    pub max: bool,
    /// `first` and `first_ts_ms`.
    pub first: bool,
    /// `last` and `last_ts_ms`.
    pub last: bool,
}

impl RecordFields {
    /// Every field.
    pub const ALL: Self = Self {
        sum: true,
        min: true,
        max: true,
        first: true,
        last: true,
    };
    /// None beyond the window and the count.
    pub const NONE: Self = Self {
        sum: false,
        min: false,
        max: false,
        first: false,
        last: false,
    };

    /// Whether both timestamp offset columns are needed (`last_ts_ms` is
    /// stored as a span after `first_ts_ms`).
    pub(crate) fn times(self) -> bool {
        self.first || self.last
    }
}

/// The aggregate of one group over one window. Mergeable (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RollupRecord {
    pub window_start_ms: i64,
    pub count: u64,
    pub sum: f64,
    pub min: f64,
    pub max: f64,
    pub first: f64,
    pub first_ts_ms: i64,
    pub last: f64,
    pub last_ts_ms: i64,
}

impl RollupRecord {
    /// The record of one sample.
    pub fn of_sample(window_start_ms: i64, ts_ms: i64, value: f64) -> Self {
        Self {
            window_start_ms,
            count: 1,
            sum: value,
            min: value,
            max: value,
            first: value,
            first_ts_ms: ts_ms,
            last: value,
            last_ts_ms: ts_ms,
        }
    }

    /// Mean of the window's samples.
    pub fn avg(&self) -> f64 {
        self.sum / self.count as f64
    }

    /// Folds one sample in.
    pub fn add(&mut self, ts_ms: i64, value: f64) {
        self.merge(&Self::of_sample(self.window_start_ms, ts_ms, value));
    }

    /// Merges another record of the same window (the window is not checked).
    pub fn merge(&mut self, o: &Self) {
        self.count += o.count;
        self.sum += o.sum;
        self.min = self.min.min(o.min);
        self.max = self.max.max(o.max);
        if o.first_ts_ms
            .cmp(&self.first_ts_ms)
            .then(o.first.total_cmp(&self.first))
            .is_lt()
        {
            self.first = o.first;
            self.first_ts_ms = o.first_ts_ms;
        }
        if o.last_ts_ms
            .cmp(&self.last_ts_ms)
            .then(o.last.total_cmp(&self.last))
            .is_gt()
        {
            self.last = o.last;
            self.last_ts_ms = o.last_ts_ms;
        }
    }

    /// This record with its window start moved to the coarser `tier`'s window.
    fn in_tier(mut self, tier: RollupTier) -> Self {
        self.window_start_ms = tier.window_start(self.window_start_ms);
        self
    }
}

/// Folds samples in time order, one per timestamp, into gpu-level 1-minute
/// records, and passes each to `f` in window order. The rollups of the head
/// and of raw segments are both folded this way, at a flush or a query, so
/// a record sums its samples in time order wherever it came from.
pub(crate) fn fold_minutes(ts_ms: &[i64], values: &[f64], mut f: impl FnMut(RollupRecord)) {
    let mut current: Option<RollupRecord> = None;
    for (&t, &v) in ts_ms.iter().zip(values) {
        let ws = RollupTier::Minute.window_start(t);
        match &mut current {
            // In time order: `first` stays, the sample is `last`.
            Some(c) if c.window_start_ms == ws => {
                c.count += 1;
                c.sum += v;
                c.min = c.min.min(v);
                c.max = c.max.max(v);
                c.last = v;
                c.last_ts_ms = t;
            }
            _ => {
                if let Some(done) = current.replace(RollupRecord::of_sample(ws, t, v)) {
                    f(done);
                }
            }
        }
    }
    if let Some(done) = current {
        f(done);
    }
}

/// The 1-minute records of a flush, folded from its frozen chunks: per
/// series, its gpu-level group and its minute records. Groups may repeat.
pub(crate) type RollupDelta = Vec<(Arc<RollupGroup>, Vec<RollupRecord>)>;

/// Records of one (tier, level): group -> window start -> record.
pub(crate) type Table = BTreeMap<RollupGroup, BTreeMap<i64, RollupRecord>>;

/// All 15 (tier, level) tables, indexed `[tier][level]`.
pub(crate) type Tables = [[Table; 5]; 3];

pub(crate) fn empty_tables() -> Tables {
    Default::default()
}

/// A (tier, level) table as a flush builds it, only to be encoded: groups in
/// order, each with its records in window order, one per window.
/// A group is shared by its tables in the three tiers (a flush of 200,000
/// series cloned 400,000 of them, six strings each).
pub(crate) type RunTable = Vec<(Arc<RollupGroup>, Vec<RollupRecord>)>;

/// All 15 (tier, level) run tables, indexed `[tier][level]`.
pub(crate) type RunTables = [[RunTable; 5]; 3];

/// A table a rollup file is encoded from: its groups in order, each with its
/// records in window order.
pub(crate) trait TableView {
    fn groups(
        &self,
    ) -> impl Iterator<Item = (&RollupGroup, impl ExactSizeIterator<Item = &RollupRecord>)>;
}

impl TableView for Table {
    fn groups(
        &self,
    ) -> impl Iterator<Item = (&RollupGroup, impl ExactSizeIterator<Item = &RollupRecord>)> {
        self.iter().map(|(g, w)| (g, w.values()))
    }
}

impl TableView for RunTable {
    fn groups(
        &self,
    ) -> impl Iterator<Item = (&RollupGroup, impl ExactSizeIterator<Item = &RollupRecord>)> {
        self.iter().map(|(g, w)| (&**g, w.iter()))
    }
}

#[cfg(test)]
fn merge_into(windows: &mut BTreeMap<i64, RollupRecord>, r: RollupRecord) {
    windows
        .entry(r.window_start_ms)
        .and_modify(|m| m.merge(&r))
        .or_insert(r);
}

/// Merges `minutes` (gpu-level, 1-minute records of `group`) into every tier
/// and level of `tables`. One group lookup per (tier, level) and series: the
/// flush's way before [`delta_tables`], kept as the tests' reference.
#[cfg(test)]
pub(crate) fn add_to_tables(tables: &mut Tables, group: &RollupGroup, minutes: &[RollupRecord]) {
    if minutes.is_empty() {
        return;
    }
    for level in RollupLevel::ALL {
        let g = group.at_level(level);
        for tier in RollupTier::ALL {
            let table = &mut tables[tier.index()][level.index()];
            let windows = match table.get_mut(&g) {
                Some(w) => w,
                None => table.entry(g.clone()).or_default(),
            };
            for r in minutes {
                merge_into(windows, r.in_tier(tier));
            }
        }
    }
}

/// Builds the tables of a delta, level by level, through [`DeltaTables`].
/// Same tables as [`add_to_tables`] for every series (checked by a test
/// against it), except that the gpu-level 1-minute table holds only the
/// windows before `gpu_minutes_below`.
#[cfg(test)]
pub(crate) fn delta_tables(delta: &RollupDelta, gpu_minutes_below: i64) -> RunTables {
    let mut b = DeltaTables::new(gpu_minutes_below);
    for (g, minutes) in delta {
        b.add((**g).as_ref(), minutes);
    }
    b.finish()
}

/// The tables of a flush, built one series at a time, so that a flush never
/// holds every series' minute records at once (72 bytes a minute: 3.5 times
/// the head it empties at a 10 s poll). Each series' minutes, in window
/// order, one per window, are folded at once into its gpu-level group's
/// hour and day records (and the minutes before `gpu_minutes_below`: a
/// flush writes none after the raw cut) and merged into its host-level
/// group's minutes; the rack, row and cluster levels merge the level below
/// at [`Self::finish`], one pass per pair of groups. A tier's windows are
/// runs of minutes, merged in order.
#[derive(Debug)]
pub(crate) struct DeltaTables {
    gpu_minutes_below: i64,
    /// Gpu-level group -> its records in each tier, window order.
    gpus: hashbrown::HashMap<RollupGroup, [Vec<RollupRecord>; 3], KeyHasher>,
    /// Host-level group -> its minute records, window order.
    hosts: GroupMinutes,
}

/// Group -> its minute records, window order. Groups hash with foldhash
/// (SipHash of their label strings showed in a flush's profile) and are
/// looked up by their borrowed text ([`GroupRef`]): a flush allocates a
/// group's strings once per group, not twice per series.
type GroupMinutes = hashbrown::HashMap<RollupGroup, Vec<RollupRecord>, KeyHasher>;

impl DeltaTables {
    pub(crate) fn new(gpu_minutes_below: i64) -> Self {
        Self {
            gpu_minutes_below,
            gpus: hashbrown::HashMap::default(),
            hosts: GroupMinutes::default(),
        }
    }

    /// Whether no records were added.
    pub(crate) fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Adds the minute records of one series of gpu-level `group`: in
    /// window order, one per window (as [`fold_minutes`] makes them).
    pub(crate) fn add(&mut self, group: GroupRef<'_>, minutes: &[RollupRecord]) {
        if minutes.is_empty() {
            return;
        }
        debug_assert!(minutes.is_sorted_by(|a, b| a.window_start_ms < b.window_start_ms));
        let n = minutes.partition_point(|r| r.window_start_ms < self.gpu_minutes_below);
        let runs: [Vec<RollupRecord>; 3] = RollupTier::ALL.map(|tier| match tier {
            RollupTier::Minute => minutes[..n].to_vec(),
            _ => in_tier_windows(minutes, tier),
        });
        match self.gpus.get_mut(&group) {
            Some(have) => {
                for (have, new) in have.iter_mut().zip(runs) {
                    merge_windows_into(have, &new);
                }
            }
            None => {
                self.gpus.insert(group.to_group(), runs);
            }
        }
        merge_into_parent(&mut self.hosts, group.at_level(RollupLevel::Host), minutes);
    }

    pub(crate) fn finish(self) -> RunTables {
        let mut tables = RunTables::default();
        let mut gpus: Vec<(Arc<RollupGroup>, [Vec<RollupRecord>; 3])> = self
            .gpus
            .into_iter()
            .map(|(g, runs)| (Arc::new(g), runs))
            .collect();
        gpus.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        for tier in RollupTier::ALL {
            tables[tier.index()][RollupLevel::Gpu.index()] = gpus
                .iter_mut()
                .filter_map(|(g, runs)| {
                    let run = std::mem::take(&mut runs[tier.index()]);
                    (!run.is_empty()).then(|| (g.clone(), run))
                })
                .collect();
        }
        drop(gpus);
        let mut below = self.hosts;
        for level in [
            RollupLevel::Host,
            RollupLevel::Rack,
            RollupLevel::Row,
            RollupLevel::Cluster,
        ] {
            // The level above first: this level's minutes then move into
            // its tables instead of being copied.
            let mut next = GroupMinutes::default();
            if let Some(up) = RollupLevel::ALL.get(level.index() + 1) {
                for (g, minutes) in &below {
                    merge_into_parent(&mut next, g.as_ref().at_level(*up), minutes);
                }
            }
            add_level(&mut tables, (level, i64::MAX), below);
            below = next;
        }
        tables
    }
}

/// Minute records (window order, one per window) merged into the windows of
/// `tier`, in order.
fn in_tier_windows(minutes: &[RollupRecord], tier: RollupTier) -> Vec<RollupRecord> {
    let mut windows: Vec<RollupRecord> = Vec::with_capacity(match tier {
        RollupTier::Minute => minutes.len(),
        _ => 2,
    });
    for r in minutes {
        let r = r.in_tier(tier);
        match windows.last_mut() {
            Some(m) if m.window_start_ms == r.window_start_ms => m.merge(&r),
            _ => windows.push(r),
        }
    }
    windows
}

/// Files each group's minute records (in window order, one per window)
/// under `level` in every tier, in the 1-minute tier only those of windows
/// before `minutes_below`; the level's tables must be empty. The groups are
/// sorted once; each table is their runs, in that order.
fn add_level(
    tables: &mut RunTables,
    (level, minutes_below): (RollupLevel, i64),
    groups: impl IntoIterator<Item = (RollupGroup, Vec<RollupRecord>)>,
) {
    let mut groups: Vec<_> = groups
        .into_iter()
        .filter(|(_, minutes)| !minutes.is_empty())
        .map(|(g, minutes)| (Arc::new(g), minutes))
        .collect();
    groups.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for tier in [RollupTier::Hour, RollupTier::Day] {
        let table = &mut tables[tier.index()][level.index()];
        debug_assert!(table.is_empty());
        *table = groups
            .iter()
            .map(|(g, minutes)| (g.clone(), in_tier_windows(minutes, tier)))
            .collect();
    }
    // The minutes themselves, those before the cut (a prefix: window order).
    let table = &mut tables[RollupTier::Minute.index()][level.index()];
    debug_assert!(table.is_empty());
    *table = groups
        .into_iter()
        .filter_map(|(g, mut minutes)| {
            minutes.truncate(minutes.partition_point(|r| r.window_start_ms < minutes_below));
            (!minutes.is_empty()).then_some((g, minutes))
        })
        .collect();
}

/// Adds a group's minute records to its parent's in `parents`.
fn merge_into_parent(parents: &mut GroupMinutes, parent: GroupRef<'_>, minutes: &[RollupRecord]) {
    match parents.get_mut(&parent) {
        Some(have) => merge_windows_into(have, minutes),
        None => {
            parents.insert(parent.to_group(), minutes.to_vec());
        }
    }
}

/// [`merge_windows`] into `a`, in place where both have the same windows
/// (the GPUs of one host, polled together, mostly do).
fn merge_windows_into(a: &mut Vec<RollupRecord>, b: &[RollupRecord]) {
    let same = a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.window_start_ms == y.window_start_ms);
    if same {
        for (x, y) in a.iter_mut().zip(b) {
            x.merge(y);
        }
    } else {
        *a = merge_windows(a, b);
    }
}

/// Two runs of records in window order, one per window, as one such run.
fn merge_windows(a: &[RollupRecord], b: &[RollupRecord]) -> Vec<RollupRecord> {
    let mut out = Vec::with_capacity(a.len().max(b.len()));
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].window_start_ms.cmp(&b[j].window_start_ms) {
            Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            Ordering::Equal => {
                let mut m = a[i];
                m.merge(&b[j]);
                out.push(m);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// A group's records in a query: appended in the order they come, adjacent
/// records of one window merged; `sorted` until a record comes before the
/// last one, after which [`Query::finish`] sorts and merges them.
#[derive(Debug, Default)]
struct Windows {
    records: Vec<RollupRecord>,
    sorted: bool,
}

impl Windows {
    fn push(&mut self, r: RollupRecord) {
        match self.records.last_mut() {
            Some(last) if last.window_start_ms == r.window_start_ms => last.merge(&r),
            Some(last) => {
                self.sorted &= last.window_start_ms < r.window_start_ms;
                self.records.push(r);
            }
            None => {
                self.sorted = true;
                self.records.push(r);
            }
        }
    }

    /// The records in window order, one per window. Records of one window
    /// are merged in the order they came, as before they were sorted.
    fn into_sorted(mut self) -> Vec<RollupRecord> {
        if !self.sorted {
            self.records.sort_by_key(|r| r.window_start_ms);
            self.records.dedup_by(|later, earlier| {
                let same = later.window_start_ms == earlier.window_start_ms;
                if same {
                    earlier.merge(later);
                }
                same
            });
        }
        self.records
    }
}

/// A query in progress: one (tier, level), a filter and a time range.
#[derive(Debug)]
pub(crate) struct Query<'a> {
    pub(crate) tier: RollupTier,
    pub(crate) level: RollupLevel,
    pub(crate) filter: &'a RollupFilter,
    pub(crate) min_ts: i64,
    pub(crate) max_ts: i64,
    /// Group -> its records. Records come run by run in window order (a
    /// file's records group by group, memory's series by series), so a
    /// group's are mostly appended: a B-tree of windows per group cost half
    /// of a 225,000-record query.
    out: BTreeMap<RollupGroup, Windows>,
    /// The group of the records added last, and those records: the table is
    /// looked up once per run of a group rather than once per record (string
    /// comparisons down a B-tree).
    run_group: Option<RollupGroup>,
    run: Windows,
}

impl<'a> Query<'a> {
    pub(crate) fn new(
        tier: RollupTier,
        level: RollupLevel,
        filter: &'a RollupFilter,
        min_ts: i64,
        max_ts: i64,
    ) -> Self {
        Self {
            tier,
            level,
            filter,
            min_ts,
            max_ts,
            out: BTreeMap::new(),
            run_group: None,
            run: Windows::default(),
        }
    }

    /// Merges the current run of records into the table.
    fn end_run(&mut self) {
        if let Some(g) = self.run_group.take() {
            let run = std::mem::take(&mut self.run);
            let w = self.out.entry(g).or_default();
            if w.records.is_empty() {
                *w = run;
            } else {
                for r in run.records {
                    w.push(r);
                }
                w.sorted &= run.sorted;
            }
        }
    }

    /// Adds gpu-level minute records of one series (from memory).
    pub(crate) fn add_minutes<'r>(
        &mut self,
        group: &RollupGroup,
        minutes: impl IntoIterator<Item = &'r RollupRecord>,
    ) {
        // Filter before projecting: most series of a filtered query fail it,
        // and a projection clones six strings.
        if !self.filter.matches_at(group, self.level) {
            return;
        }
        let tier = self.tier;
        let (min_ts, max_ts) = (self.min_ts, self.max_ts);
        let overlaps = |ws: i64| ws <= max_ts && ws.saturating_add(tier.window_ms() - 1) >= min_ts;
        let mut picked = minutes
            .into_iter()
            .map(|r| r.in_tier(tier))
            .filter(|r| overlaps(r.window_start_ms))
            .peekable();
        if picked.peek().is_none() {
            return;
        }
        self.end_run();
        let w = self.out.entry(group.at_level(self.level)).or_default();
        for r in picked {
            w.push(r);
        }
    }

    /// Adds a group's records, already in this query's tier and level and in
    /// window order (a file block's), those whose window overlaps the range.
    /// A group's first run is kept as it is, not copied.
    pub(crate) fn add_records(&mut self, group: &RollupGroup, mut records: Vec<RollupRecord>) {
        let (min_ts, max_ts, w) = (self.min_ts, self.max_ts, self.tier.window_ms());
        let to = records.partition_point(|r| r.window_start_ms <= max_ts);
        records.truncate(to);
        let from = records.partition_point(|r| r.window_start_ms.saturating_add(w - 1) < min_ts);
        if from == records.len() {
            return;
        }
        records.drain(..from);
        if self.run_group.as_ref() != Some(group) {
            self.end_run();
            self.run_group = Some(group.clone());
        }
        if self.run.records.is_empty() {
            self.run = Windows {
                records,
                sorted: true,
            };
        } else {
            for r in records {
                self.run.push(r);
            }
        }
    }

    /// Adds a record already in this query's tier and level (from a file).
    pub(crate) fn add_record(&mut self, group: &RollupGroup, r: RollupRecord) {
        if self.run_group.as_ref() != Some(group) {
            self.end_run();
            self.run_group = Some(group.clone());
        }
        self.run.push(r);
    }

    pub(crate) fn finish(mut self) -> Vec<(RollupGroup, Vec<RollupRecord>)> {
        self.end_run();
        self.out
            .into_iter()
            .map(|(g, w)| (g, w.into_sorted()))
            .collect()
    }
}
