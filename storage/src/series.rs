//! Series identity: a metric name plus a label set sorted by name (the
//! Prometheus data model), and the label matchers used to select series.

use std::collections::HashSet;

/// The sets of series keys, names and label sets: hashed with foldhash's
/// seeded quality hasher (label strings come from clients; SipHash of a
/// key's dozen strings was 30 % of opening a 200,000-series history).
pub(crate) type KeyHasher = foldhash::quality::RandomState;
type Set<T> = HashSet<T, KeyHasher>;
use std::fmt;
use std::hash::Hash;
use std::sync::Arc;

use crate::postings::Postings;
pub use crate::sym::Sym;

/// A test of a series key besides the matchers, applied before a series
/// is read ([`crate::Storage::select_where`]).
pub type KeepSeries<'a> = &'a (dyn Fn(&SeriesKey) -> bool + 'a);

/// The reserved label name that matchers use for the metric name.
pub const METRIC_NAME_LABEL: &str = "__name__";

/// One label pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label {
    pub name: Sym,
    pub value: Sym,
}

impl Label {
    pub fn new(name: impl Into<Sym>, value: impl Into<Sym>) -> Self {
        Self {
            name: name.into(),
            value: value.into(),
        }
    }
}

/// Why a series key was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSeries {
    #[error("metric name is empty")]
    EmptyMetric,
    #[error("label name is empty")]
    EmptyLabelName,
    #[error("label name {0:?} is reserved")]
    ReservedLabel(String),
    #[error("label {0:?} appears more than once")]
    DuplicateLabel(String),
}

/// A series: metric name and labels sorted by name, with unique names.
///
/// Both halves are shared: a clone costs two reference counts, and a
/// [`KeyParts`] gives the series of one GPU (same labels, another metric) one
/// label set and every series of a metric one name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeriesKey {
    /// Thin pointers (`Arc<String>`, not `Arc<str>`, and [`LabelSet`]): a
    /// key is 16 bytes and its [`KeyArc`] 24, which glibc serves from
    /// 32-byte chunks (a key of fat pointers in a `std::sync::Arc` took 48).
    metric: Arc<String>,
    labels: LabelSet,
}

/// A shared series key, as the head, the segments and the key set hold
/// it: a [`triomphe::Arc`], whose count is one word (no weak count).
pub type KeyArc = triomphe::Arc<SeriesKey>;

/// A key's labels, sorted by name: shared by the keys of one GPU, behind a
/// thin pointer (the length is in the allocation). Compares, orders and
/// hashes as its slice, as `Arc<[Label]>` did.
#[derive(Clone)]
pub(crate) struct LabelSet(triomphe::ThinArc<(), Label>);

impl LabelSet {
    fn new<I: ExactSizeIterator<Item = Label>>(labels: I) -> Self {
        Self(triomphe::ThinArc::from_header_and_iter((), labels))
    }

    /// Holders of this set, this one included.
    fn holders(&self) -> usize {
        triomphe::ThinArc::strong_count(&self.0)
    }

    /// Whether both are one set.
    #[cfg(test)]
    pub(crate) fn ptr_eq(&self, other: &Self) -> bool {
        self.0.ptr() == other.0.ptr()
    }
}

impl std::ops::Deref for LabelSet {
    type Target = [Label];

    fn deref(&self) -> &[Label] {
        &self.0.slice
    }
}

impl PartialEq for LabelSet {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl Eq for LabelSet {}

impl PartialOrd for LabelSet {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for LabelSet {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (**self).cmp(&**other)
    }
}

impl Hash for LabelSet {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (**self).hash(state);
    }
}

impl fmt::Debug for LabelSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl SeriesKey {
    /// Builds a key; sorts the labels and drops labels with an empty value
    /// (Prometheus treats an empty value as an absent label).
    ///
    /// # Errors
    /// An empty metric or label name, the reserved `__name__`, or a label name
    /// given twice.
    pub fn new(metric: impl Into<String>, labels: Vec<Label>) -> Result<Self, InvalidSeries> {
        let metric = metric.into();
        if metric.is_empty() {
            return Err(InvalidSeries::EmptyMetric);
        }
        Ok(Self {
            metric: Arc::new(metric),
            labels: Self::label_set(labels)?,
        })
    }

    /// A label set as a key holds it: empty values dropped, sorted by name,
    /// each name checked ([`Self::new`] without the metric).
    ///
    /// # Errors
    /// As [`Self::new`], for the labels.
    pub(crate) fn label_set(labels: Vec<Label>) -> Result<LabelSet, InvalidSeries> {
        let mut labels: Vec<Label> = labels.into_iter().filter(|l| !l.value.is_empty()).collect();
        labels.sort();
        for (i, l) in labels.iter().enumerate() {
            if l.name.is_empty() {
                return Err(InvalidSeries::EmptyLabelName);
            }
            if l.name == METRIC_NAME_LABEL {
                return Err(InvalidSeries::ReservedLabel(l.name.to_string()));
            }
            if i > 0 && labels[i - 1].name == l.name {
                return Err(InvalidSeries::DuplicateLabel(l.name.to_string()));
            }
        }
        Ok(LabelSet::new(labels.into_iter()))
    }

    /// A key of checked parts: `metric` is not empty and `labels` came
    /// from [`Self::label_set`].
    pub(crate) fn from_parts(metric: Arc<String>, labels: LabelSet) -> Self {
        debug_assert!(!metric.is_empty());
        Self { metric, labels }
    }

    /// The shared metric name and label set.
    #[cfg(test)]
    pub(crate) fn parts(&self) -> (&Arc<String>, &LabelSet) {
        (&self.metric, &self.labels)
    }

    pub fn metric(&self) -> &str {
        self.metric.as_str()
    }

    /// Labels sorted by name, metric name excluded.
    pub fn labels(&self) -> &[Label] {
        &self.labels
    }

    /// Value of a label; `__name__` gives the metric name.
    pub fn get(&self, name: &str) -> Option<&str> {
        if name == METRIC_NAME_LABEL {
            return Some(self.metric.as_str());
        }
        self.labels
            .binary_search_by(|l| l.name.as_str().cmp(name))
            .ok()
            .map(|i| self.labels[i].value.as_str())
    }
}

/// One copy of each metric name and label set, shared by the keys given to
/// [`Self::share`]: the series of one GPU differ only in the metric, so a
/// key then owns no strings of its own. The label sets share their strings
/// too: every set repeats the label names, and most values (a model, a
/// driver version, a GPU index, a host's name for its GPUs) are in many
/// sets (about 20 bytes a series with dcgm-exporter's labels). The key set
/// ([`SharedKeys`]) keeps one for the keys of the head and open segments.
#[derive(Debug, Default)]
pub(crate) struct KeyParts {
    names: Set<Arc<String>>,
    label_sets: Set<LabelSet>,
    /// The names and values of the label sets.
    strings: Set<Sym>,
}

impl KeyParts {
    /// Points `key` at this set's copies of its name and labels, adding
    /// them if the set has none.
    pub(crate) fn share(&mut self, key: &mut SeriesKey) {
        key.metric = shared(&mut self.names, &key.metric);
        key.labels = match self.label_sets.get(&key.labels) {
            Some(set) => set.clone(),
            None => {
                let strings = &mut self.strings;
                let set = LabelSet::new(key.labels.iter().map(|l| Label {
                    name: shared(strings, &l.name),
                    value: shared(strings, &l.value),
                }));
                self.label_sets.insert(set.clone());
                set
            }
        };
    }

    /// Drops what no key uses any more (held by the set alone).
    pub(crate) fn sweep(&mut self) {
        self.names.retain(|n| Arc::strong_count(n) > 1);
        self.label_sets.retain(|l| l.holders() > 1);
        self.strings.retain(|s| s.holders() > 1);
        self.names.shrink_to_fit();
        self.label_sets.shrink_to_fit();
        self.strings.shrink_to_fit();
    }
}

/// One copy of each series key for a whole storage: the head and every
/// open segment point at it. Without it each segment held its own copy of
/// every key it lists (about 100 bytes a series and a segment), and a node
/// keeps a compaction window's flushes open (60 at a 2-minute flush over
/// 2 hours), so the keys of 1,000 GPUs' 53,000 series took 300 MB.
#[derive(Debug, Default)]
pub struct SharedKeys {
    inner: std::sync::Mutex<SharedInner>,
}

#[derive(Debug, Default)]
struct SharedInner {
    keys: Set<KeyArc>,
    parts: KeyParts,
}

impl SharedKeys {
    /// The shared copy of `key`, added (its name and labels shared too) if
    /// there is none.
    pub(crate) fn share(&self, key: SeriesKey) -> KeyArc {
        let mut inner = self.lock();
        inner.share(key)
    }

    /// [`Self::share`] for many keys under one lock.
    pub(crate) fn share_all(&self, keys: Vec<SeriesKey>) -> Vec<KeyArc> {
        let mut inner = self.lock();
        keys.into_iter().map(|k| inner.share(k)).collect()
    }

    /// `postings` with each label name and value replaced by the set's copy
    /// (added if it has none): a segment's lists name the strings of its
    /// keys, which the keys already share, and each open segment held its
    /// own copy of every GPU's UUID, host name and the like.
    pub(crate) fn share_postings(&self, postings: Postings) -> Postings {
        let mut inner = self.lock();
        let strings = &mut inner.parts.strings;
        postings
            .into_iter()
            .map(|(name, values)| {
                let values = values
                    .into_iter()
                    .map(|(value, ids)| (shared(strings, &value), ids))
                    .collect();
                (shared(strings, &name), values)
            })
            .collect()
    }

    /// Drops the keys no head series or open segment uses any more (held
    /// by the set alone), then the names, label sets and label strings no
    /// key uses.
    pub(crate) fn sweep(&self) {
        let mut inner = self.lock();
        inner.keys.retain(|k| KeyArc::strong_count(k) > 1);
        inner.keys.shrink_to_fit();
        inner.parts.sweep();
    }

    /// Keys, names and label sets held.
    pub fn len(&self) -> (usize, usize, usize) {
        let inner = self.lock();
        let (names, label_sets) = (inner.parts.names.len(), inner.parts.label_sets.len());
        (inner.keys.len(), names, label_sets)
    }

    pub fn is_empty(&self) -> bool {
        self.len().0 == 0
    }

    /// Label names and values held.
    #[cfg(test)]
    fn strings(&self) -> usize {
        self.lock().parts.strings.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SharedInner> {
        // The set is consistent between any two statements: a panic while
        // it was held leaves nothing half-done.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl SharedInner {
    fn share(&mut self, mut key: SeriesKey) -> KeyArc {
        if let Some(k) = self.keys.get(&key) {
            return k.clone();
        }
        self.parts.share(&mut key);
        let key = KeyArc::new(key);
        self.keys.insert(key.clone());
        key
    }
}

/// The set's copy of `x` (a shared pointer: a clone is a count), added if
/// the set has none.
fn shared<T: Clone + Eq + Hash>(set: &mut Set<T>, x: &T) -> T {
    match set.get(x) {
        Some(copy) => copy.clone(),
        None => {
            set.insert(x.clone());
            x.clone()
        }
    }
}

impl fmt::Display for SeriesKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{{", self.metric)?;
        for (i, l) in self.labels.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={:?}", l.name, l.value)?;
        }
        f.write_str("}")
    }
}

/// A regular expression anchored at both ends, as Prometheus matchers are:
/// `gpu=~"1|2"` matches `1` and `2`, not `12`. As in Prometheus 3 and
/// VictoriaMetrics, `.` matches a newline too, so `.*` matches every value
/// (Prometheus 2 compiled without the `s` flag).
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    /// `None` for `.*`, which Grafana sends for a variable at "All": every
    /// value matches, the empty one (an absent label) too, so nothing is
    /// compiled, no label looked up and no automaton run.
    re: Option<regex::Regex>,
}

impl Pattern {
    /// # Errors
    /// The pattern is not a valid regular expression.
    pub fn new(source: &str) -> Result<Self, regex::Error> {
        Ok(Self {
            source: source.to_string(),
            re: match source {
                ".*" => None,
                _ => Some(regex::Regex::new(&format!("^(?s:{source})$"))?),
            },
        })
    }

    pub fn is_match(&self, s: &str) -> bool {
        self.re.as_ref().is_none_or(|re| re.is_match(s))
    }

    /// Whether every string matches (the pattern is `.*`).
    pub fn matches_everything(&self) -> bool {
        self.re.is_none()
    }

    /// The pattern as written, without the anchors.
    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Eq for Pattern {}

/// Selects series by one label (`__name__` for the metric name). An absent
/// label has the value "", as in Prometheus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Matcher {
    Equal { name: String, value: String },
    NotEqual { name: String, value: String },
    Regex { name: String, pattern: Pattern },
    NotRegex { name: String, pattern: Pattern },
}

impl Matcher {
    pub fn equal(name: impl Into<String>, value: impl Into<String>) -> Self {
        Self::Equal {
            name: name.into(),
            value: value.into(),
        }
    }

    pub fn not_equal(name: impl Into<String>, value: impl Into<String>) -> Self {
        Self::NotEqual {
            name: name.into(),
            value: value.into(),
        }
    }

    /// `name =~ pattern`, fully anchored.
    ///
    /// # Errors
    /// The pattern is not a valid regular expression.
    pub fn regex(name: impl Into<String>, pattern: &str) -> Result<Self, regex::Error> {
        Ok(Self::Regex {
            name: name.into(),
            pattern: Pattern::new(pattern)?,
        })
    }

    /// `name !~ pattern`, fully anchored.
    ///
    /// # Errors
    /// The pattern is not a valid regular expression.
    pub fn not_regex(name: impl Into<String>, pattern: &str) -> Result<Self, regex::Error> {
        Ok(Self::NotRegex {
            name: name.into(),
            pattern: Pattern::new(pattern)?,
        })
    }

    /// The label this matcher looks at.
    pub fn name(&self) -> &str {
        match self {
            Self::Equal { name, .. }
            | Self::NotEqual { name, .. }
            | Self::Regex { name, .. }
            | Self::NotRegex { name, .. } => name,
        }
    }

    /// Whether every series matches: `name=~".*"`. A selector may leave
    /// such a matcher out.
    pub fn matches_everything(&self) -> bool {
        matches!(self, Self::Regex { pattern, .. } if pattern.matches_everything())
    }

    pub fn matches(&self, key: &SeriesKey) -> bool {
        if self.matches_everything() {
            return true;
        }
        let v = key.get(self.name()).unwrap_or("");
        match self {
            Self::Equal { value, .. } => v == value,
            Self::NotEqual { value, .. } => v != value,
            Self::Regex { pattern, .. } => pattern.is_match(v),
            Self::NotRegex { pattern, .. } => !pattern.is_match(v),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SeriesKey {
        SeriesKey::new(
            "DCGM_FI_DEV_GPU_TEMP",
            vec![
                Label::new("gpu", "3"),
                Label::new("Hostname", "h1"),
                Label::new("pod", ""),
            ],
        )
        .unwrap()
    }

    /// Equal keys given apart come back as one copy; a key no one else
    /// holds leaves at the sweep, and with it a name and label set no other
    /// key uses.
    #[test]
    fn shared_keys_hold_one_copy_while_someone_uses_it() {
        let keys = SharedKeys::default();
        // Built afresh each time: a clone would share the test's strings.
        let other =
            || SeriesKey::new("DCGM_FI_DEV_POWER_USAGE", vec![Label::new("gpu", "4")]).unwrap();
        let a = keys.share(key());
        let b = keys.share_all(vec![key(), other()]);
        assert!(KeyArc::ptr_eq(&a, &b[0]));
        assert_eq!((*b[0]).clone(), key());
        assert_eq!(*b[1], other());
        assert_eq!(keys.len(), (2, 2, 2));
        keys.sweep();
        assert_eq!(keys.len(), (2, 2, 2), "both keys are held");
        drop(b);
        keys.sweep();
        assert_eq!(keys.len(), (1, 1, 1), "`other` is held by the set alone");
        drop(a);
        keys.sweep();
        assert!(keys.is_empty());
        assert_eq!(keys.len(), (0, 0, 0));
    }

    /// Label sets that differ share the names and values they have in
    /// common: one copy of each string while a set holds it.
    #[test]
    fn label_sets_share_their_strings() {
        let keys = SharedKeys::default();
        let gpu = |i: &str| {
            let labels = vec![Label::new("gpu", i), Label::new("Hostname", "h1")];
            SeriesKey::new("DCGM_FI_DEV_GPU_TEMP", labels).unwrap()
        };
        let (a, b) = (keys.share(gpu("0")), keys.share(gpu("1")));
        assert_eq!(keys.len(), (2, 1, 2));
        let at = |k: &SeriesKey, i: usize| {
            let l = &k.labels()[i];
            (l.name.as_ptr(), l.value.as_ptr())
        };
        // Sorted: Hostname, then gpu.
        assert_eq!(at(&a, 0), at(&b, 0), "one Hostname=h1");
        assert_eq!(at(&a, 1).0, at(&b, 1).0, "one name `gpu`");
        assert_ne!(at(&a, 1).1, at(&b, 1).1);
        assert_eq!((a.get("gpu"), b.get("gpu")), (Some("0"), Some("1")));
        assert_eq!(keys.strings(), 5, "Hostname, h1, gpu, 0 and 1");
        drop(b);
        keys.sweep();
        assert_eq!(keys.strings(), 4, "`1` went with its set");
        drop(a);
        keys.sweep();
        assert_eq!((keys.len(), keys.strings()), ((0, 0, 0), 0));
    }

    /// A segment's postings take the keys' copies of their strings, and
    /// add the ones no key has (`__name__` and the metric names); the
    /// sweep keeps them while the postings hold them.
    #[test]
    fn postings_share_the_strings_of_the_keys() {
        let keys = SharedKeys::default();
        let labels = vec![Label::new("gpu", "0"), Label::new("Hostname", "h1")];
        let key = keys.share(SeriesKey::new("temp", labels).unwrap());
        assert_eq!(keys.strings(), 4);
        let mut p = Postings::default();
        crate::postings::add(&mut p, "__name__", "temp", 0);
        crate::postings::add(&mut p, "gpu", "0", 0);
        crate::postings::add(&mut p, "Hostname", "h1", 0);
        let p = keys.share_postings(p);
        assert_eq!(keys.strings(), 6, "__name__ and temp added");
        let (name, values) = p.get_key_value("gpu").unwrap();
        let (value, ids) = values.get_key_value("0").unwrap();
        assert!(ids.iter().eq([0]));
        let label = &key.labels()[1];
        assert_eq!(
            (name.as_ptr(), value.as_ptr()),
            (label.name.as_ptr(), label.value.as_ptr())
        );
        drop(key);
        keys.sweep();
        assert_eq!(keys.strings(), 6, "the postings hold all six");
        drop(p);
        keys.sweep();
        assert_eq!(keys.strings(), 0);
    }

    #[test]
    fn labels_are_sorted_and_empty_values_dropped() {
        let k = key();
        let names: Vec<&str> = k.labels().iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, ["Hostname", "gpu"]);
        assert_eq!(k.get("gpu"), Some("3"));
        assert_eq!(k.get("__name__"), Some("DCGM_FI_DEV_GPU_TEMP"));
        assert_eq!(k.get("pod"), None);
        assert_eq!(
            k.to_string(),
            r#"DCGM_FI_DEV_GPU_TEMP{Hostname="h1",gpu="3"}"#
        );
    }

    #[test]
    fn invalid_keys() {
        assert_eq!(SeriesKey::new("", vec![]), Err(InvalidSeries::EmptyMetric));
        assert_eq!(
            SeriesKey::new("m", vec![Label::new("a", "1"), Label::new("a", "2")]),
            Err(InvalidSeries::DuplicateLabel("a".into()))
        );
        assert_eq!(
            SeriesKey::new("m", vec![Label::new("__name__", "x")]),
            Err(InvalidSeries::ReservedLabel("__name__".into()))
        );
        assert_eq!(
            SeriesKey::new("m", vec![Label::new("", "x")]),
            Err(InvalidSeries::EmptyLabelName)
        );
    }

    #[test]
    fn matchers_treat_absent_as_empty() {
        let k = key();
        assert!(Matcher::equal("gpu", "3").matches(&k));
        assert!(!Matcher::equal("gpu", "4").matches(&k));
        assert!(Matcher::equal("pod", "").matches(&k));
        assert!(Matcher::not_equal("pod", "x").matches(&k));
        assert!(!Matcher::not_equal("__name__", "DCGM_FI_DEV_GPU_TEMP").matches(&k));
    }

    #[test]
    fn regex_matchers_are_fully_anchored() {
        let k = key();
        assert!(Matcher::regex("gpu", "3|4").unwrap().matches(&k));
        assert!(!Matcher::regex("gpu", "").unwrap().matches(&k));
        assert!(
            !Matcher::regex("Hostname", "h").unwrap().matches(&k),
            "h must not match h1"
        );
        assert!(Matcher::regex("Hostname", "h.*").unwrap().matches(&k));
        assert!(
            Matcher::regex("pod", ".*").unwrap().matches(&k),
            "absent label is \"\""
        );
        assert!(
            Matcher::not_regex("__name__", ".*POWER.*")
                .unwrap()
                .matches(&k)
        );
        assert!(!Matcher::not_regex("gpu", "[0-9]").unwrap().matches(&k));
        assert!(Matcher::regex("gpu", "(").is_err());
    }

    #[test]
    fn dot_star_matches_every_value_newlines_too() {
        let odd =
            SeriesKey::new("m", vec![Label::new("a", "x\ny"), Label::new("b", "\n")]).unwrap();
        for name in ["a", "b", "absent", "__name__"] {
            let all = Matcher::regex(name, ".*").unwrap();
            assert!(all.matches_everything());
            assert!(all.matches(&odd), "{name}");
            assert!(!Matcher::not_regex(name, ".*").unwrap().matches(&odd));
        }
        // The fast path is the automaton's answer: `.` takes a newline.
        assert!(Matcher::regex("a", "x.y").unwrap().matches(&odd));
        assert!(Matcher::regex("b", ".").unwrap().matches(&odd));
        assert!(!Matcher::regex("a", ".+").unwrap().matches_everything());
        assert!(!Matcher::regex("a", ".*x").unwrap().matches_everything());
    }
}
