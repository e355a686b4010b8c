//! Admission: the one policy that every entry of samples applies before
//! anything reaches [`crate::Storage`] — gRPC ingest (`ingest`), Prometheus
//! remote write (`ingest::remote_write`), `gpulse import` and `gpulse agent
//! --replay`.
//!
//! - **Time window** ([`SampleWindow`]): a sample older than `now − max_age`
//!   (the raw retention, `--retention`, on a server), before the Unix epoch
//!   ([`MIN_TIMESTAMP_MS`]), or more than `max_future` ahead of the wall
//!   clock (`--max-future`, default [`DEFAULT_MAX_FUTURE`]) is refused. A
//!   sample past the retention would be deleted at the next upkeep; a
//!   future-dated one would pin its segment against retention for as long as
//!   it is in the future; one before 1970 (`-2^63` included) is what no GPU
//!   poll can produce and what rollup windows cannot represent.
//! - **Labels** ([`LabelLimits`]): at most `max_labels` labels per series
//!   (metric name excluded, topology labels included), each name and value
//!   (and the metric name) at most `max_label_bytes` bytes, no empty label
//!   name and no NUL byte (PostgreSQL text cannot carry one). Invalid UTF-8
//!   never gets this far: protobuf `string` fields refuse it at decoding.
//! - **Producer ids** ([`check_agent_id`]): an agent id is at most
//!   `max_label_bytes` bytes of printable characters (no control character,
//!   no NUL); it names the producer whose sequence numbers storage keeps.
//!
//! Every refusal carries a [`Reason`], counted per reason by the entry in
//! [`RejectCounters`] and exported as `…_rejected_total{reason="…"}`.
//! This module only decides; what a refused sample does to its request
//! (the whole gRPC batch is rejected, remote write answers 400) is the
//! entry's choice.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// No sample before the Unix epoch (1970-01-01T00:00:00Z) is admitted.
pub const MIN_TIMESTAMP_MS: i64 = 0;

/// Default of [`SampleWindow::max_future`]: 10 minutes, as Grafana Mimir's
/// `-validation.create-grace-period`. Agents stamp polls with their own
/// clock; NTP keeps it within milliseconds, so 10 minutes only refuses a
/// broken clock or a poisoned sample.
pub const DEFAULT_MAX_FUTURE: Duration = Duration::from_secs(10 * 60);

/// Why a sample, a series or a stream was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Older than the window (retention, or before 1970).
    TooOld,
    /// More than `max_future` ahead of the wall clock.
    TooFarInFuture,
    /// More labels than `max_labels`.
    TooManyLabels,
    /// A name or value longer than `max_label_bytes`.
    LabelTooLong,
    /// An empty label name, a NUL byte, invalid UTF-8, no metric name.
    InvalidLabel,
    /// An agent id that is too long or holds a control character.
    BadAgentId,
}

impl Reason {
    pub const ALL: [Reason; 6] = [
        Reason::TooOld,
        Reason::TooFarInFuture,
        Reason::TooManyLabels,
        Reason::LabelTooLong,
        Reason::InvalidLabel,
        Reason::BadAgentId,
    ];

    /// The `reason` label value of the metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::TooOld => "too_old",
            Reason::TooFarInFuture => "too_far_in_future",
            Reason::TooManyLabels => "too_many_labels",
            Reason::LabelTooLong => "label_too_long",
            Reason::InvalidLabel => "invalid_label",
            Reason::BadAgentId => "bad_agent_id",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// A refusal: its reason and a message for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub message: String,
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Rejection {}

fn reject(reason: Reason, message: String) -> Rejection {
    Rejection { reason, message }
}

/// Which sample timestamps are admitted, relative to the wall clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleWindow {
    /// Oldest admitted age; a server sets its raw retention (`--retention`,
    /// default 7 d). `None`: no bound but [`MIN_TIMESTAMP_MS`] (the library
    /// default, and `gpulse import`, which loads history into a directory).
    pub max_age: Option<Duration>,
    /// How far ahead of the wall clock a sample may be. Default
    /// [`DEFAULT_MAX_FUTURE`] (10 min).
    pub max_future: Duration,
}

impl Default for SampleWindow {
    fn default() -> Self {
        Self {
            max_age: None,
            max_future: DEFAULT_MAX_FUTURE,
        }
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl SampleWindow {
    /// The inclusive bounds at the wall-clock time `now_ms`.
    pub fn bounds(&self, now_ms: i64) -> Bounds {
        let oldest = self
            .max_age
            .map_or(MIN_TIMESTAMP_MS, |a| now_ms.saturating_sub(ms(a)));
        Bounds {
            min_ms: oldest.max(MIN_TIMESTAMP_MS),
            max_ms: now_ms.saturating_add(ms(self.max_future)),
        }
    }

    /// The bounds now, by the system clock.
    pub fn bounds_now(&self) -> Bounds {
        self.bounds(now_ms())
    }
}

/// The wall clock in ms since the Unix epoch (0 if the clock is before it).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, ms)
}

/// Inclusive timestamp bounds, from [`SampleWindow::bounds`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub min_ms: i64,
    pub max_ms: i64,
}

impl Bounds {
    /// Whether `ts_ms` is admitted; the fast path of [`Self::check`].
    #[inline]
    pub fn admits(&self, ts_ms: i64) -> bool {
        (self.min_ms..=self.max_ms).contains(&ts_ms)
    }

    /// The reason `ts_ms` is refused, if it is.
    #[inline]
    pub fn reason(&self, ts_ms: i64) -> Option<Reason> {
        if ts_ms < self.min_ms {
            Some(Reason::TooOld)
        } else if ts_ms > self.max_ms {
            Some(Reason::TooFarInFuture)
        } else {
            None
        }
    }

    /// # Errors
    /// A [`Rejection`] that names the timestamp and the bound it passes.
    pub fn check(&self, ts_ms: i64) -> Result<(), Rejection> {
        match self.reason(ts_ms) {
            None => Ok(()),
            Some(Reason::TooOld) => Err(reject(
                Reason::TooOld,
                format!(
                    "timestamp {ts_ms} ms is too old: the oldest accepted is {} ms \
                     (the retention, --retention, and never before 1970)",
                    self.min_ms
                ),
            )),
            Some(r) => Err(reject(
                r,
                format!(
                    "timestamp {ts_ms} ms is too far in the future: the newest accepted is {} ms \
                     (now + --max-future)",
                    self.max_ms
                ),
            )),
        }
    }
}

/// Limits on the labels of one series, the same for every entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LabelLimits {
    /// Labels per series, metric name excluded, topology labels included.
    /// Default 32 (`--max-labels`).
    pub max_labels: usize,
    /// Bytes in one label name or value, and in a metric name. Default 512
    /// (`--max-label-bytes`).
    pub max_label_bytes: usize,
}

impl Default for LabelLimits {
    fn default() -> Self {
        Self {
            max_labels: 32,
            max_label_bytes: 512,
        }
    }
}

impl LabelLimits {
    /// Checks a label count.
    ///
    /// # Errors
    /// [`Reason::TooManyLabels`] past `max_labels`.
    pub fn check_count(&self, n: usize) -> Result<(), Rejection> {
        if n > self.max_labels {
            return Err(reject(
                Reason::TooManyLabels,
                format!("{n} labels, over the limit of {}", self.max_labels),
            ));
        }
        Ok(())
    }

    /// Checks a label name (or the metric name, `what` = "metric name").
    ///
    /// # Errors
    /// Empty, too long, or holding a NUL byte.
    pub fn check_name(&self, what: &str, name: &str) -> Result<(), Rejection> {
        if name.is_empty() {
            return Err(reject(Reason::InvalidLabel, format!("{what} is empty")));
        }
        self.check_text(what, name)
    }

    /// Checks a label value (empty is fine: it means "no such label").
    ///
    /// # Errors
    /// Too long, or holding a NUL byte.
    pub fn check_value(&self, name: &str, value: &str) -> Result<(), Rejection> {
        self.check_text(&format!("the value of label {:?}", clip(name)), value)
    }

    fn check_text(&self, what: &str, s: &str) -> Result<(), Rejection> {
        if s.len() > self.max_label_bytes {
            return Err(reject(
                Reason::LabelTooLong,
                format!(
                    "{what} is {} bytes, over the limit of {} (it starts {:?})",
                    s.len(),
                    self.max_label_bytes,
                    clip(s)
                ),
            ));
        }
        if s.contains('\0') {
            return Err(reject(
                Reason::InvalidLabel,
                format!("{what} holds a NUL byte ({:?})", clip(s)),
            ));
        }
        Ok(())
    }

    /// Checks a whole series: the count of `labels`, the metric name and
    /// every label name and value.
    ///
    /// # Errors
    /// The first limit the series passes.
    pub fn check_series<'a>(
        &self,
        metric: &str,
        labels: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
    ) -> Result<(), Rejection> {
        self.check_count(labels.len())?;
        self.check_name("the metric name", metric)?;
        for (name, value) in labels {
            self.check_name("a label name", name)?;
            self.check_value(name, value)?;
        }
        Ok(())
    }
}

/// Checks an agent id (gRPC hello): at most `max_bytes` bytes, no control
/// character. An empty id is allowed (a stream without exactly-once).
///
/// # Errors
/// [`Reason::BadAgentId`].
pub fn check_agent_id(id: &str, max_bytes: usize) -> Result<(), Rejection> {
    if id.len() > max_bytes {
        return Err(reject(
            Reason::BadAgentId,
            format!(
                "agent_id is {} bytes, over the limit of {max_bytes} (--max-label-bytes)",
                id.len()
            ),
        ));
    }
    if let Some(c) = id.chars().find(|c| c.is_control()) {
        return Err(reject(
            Reason::BadAgentId,
            format!(
                "agent_id {:?} holds the control character U+{:04X}",
                clip(id),
                u32::from(c)
            ),
        ));
    }
    Ok(())
}

/// At most 40 bytes of `s`, cut at a character boundary, for messages.
fn clip(s: &str) -> &str {
    let mut end = s.len().min(40);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Refusals per [`Reason`], for `/metrics`.
#[derive(Debug, Default)]
pub struct RejectCounters {
    counts: [AtomicU64; Reason::ALL.len()],
}

impl RejectCounters {
    pub fn add(&self, reason: Reason, n: u64) {
        self.counts[reason.index()].fetch_add(n, Relaxed);
    }

    pub fn get(&self, reason: Reason) -> u64 {
        self.counts[reason.index()].load(Relaxed)
    }

    /// Appends `name{reason="…"}` for every reason, in the Prometheus text
    /// format.
    pub fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        for r in Reason::ALL {
            let _ = writeln!(out, "{name}{{reason=\"{}\"}} {}", r.as_str(), self.get(r));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: i64 = 60_000;

    #[test]
    fn window_bounds_at_limit_minus_one_limit_and_plus_one() {
        let now = 1_800_000_000_000;
        let w = SampleWindow {
            max_age: Some(Duration::from_secs(3600)),
            max_future: Duration::from_secs(600),
        };
        let b = w.bounds(now);
        let oldest = now - 3_600_000;
        let newest = now + 600_000;
        assert_eq!((b.min_ms, b.max_ms), (oldest, newest));
        assert_eq!(b.reason(oldest - 1), Some(Reason::TooOld));
        assert_eq!(b.reason(oldest), None);
        assert_eq!(b.reason(oldest + 1), None);
        assert_eq!(b.reason(newest - 1), None);
        assert_eq!(b.reason(newest), None);
        assert_eq!(b.reason(newest + 1), Some(Reason::TooFarInFuture));
        let e = b.check(newest + 1).unwrap_err();
        assert!(e.message.contains(&(newest + 1).to_string()), "{e}");
        assert!(b.check(oldest - 1).unwrap_err().message.contains("too old"));
    }

    #[test]
    fn poison_timestamps_are_refused_with_or_without_retention() {
        let now = 1_800_000_000_000;
        for w in [
            SampleWindow::default(),
            SampleWindow {
                max_age: Some(Duration::from_secs(u64::MAX)),
                max_future: Duration::from_secs(u64::MAX),
            },
        ] {
            let b = w.bounds(now);
            assert_eq!(b.reason(i64::MIN), Some(Reason::TooOld));
            assert_eq!(b.reason(-1), Some(Reason::TooOld));
            assert_eq!(b.reason(0), None, "the epoch itself is admitted");
            assert_eq!(b.reason(now), None);
        }
        let b = SampleWindow::default().bounds(now);
        assert_eq!(b.reason(i64::MAX), Some(Reason::TooFarInFuture));
        assert_eq!(b.max_ms, now + 10 * MIN);
    }

    #[test]
    fn label_count_and_length_at_the_limits() {
        let l = LabelLimits {
            max_labels: 3,
            max_label_bytes: 8,
        };
        assert!(l.check_count(2).is_ok());
        assert!(l.check_count(3).is_ok());
        assert_eq!(l.check_count(4).unwrap_err().reason, Reason::TooManyLabels);
        for (n, ok) in [(7, true), (8, true), (9, false)] {
            let s = "x".repeat(n);
            assert_eq!(l.check_name("a label name", &s).is_ok(), ok, "name of {n}");
            assert_eq!(l.check_value("n", &s).is_ok(), ok, "value of {n}");
            let r = l.check_series(&s, [("a", "b")].into_iter());
            assert_eq!(r.is_ok(), ok, "metric of {n}");
            if !ok {
                assert_eq!(r.unwrap_err().reason, Reason::LabelTooLong);
            }
        }
        let e = l.check_series("m", [("", "v")].into_iter()).unwrap_err();
        assert_eq!(e.reason, Reason::InvalidLabel);
        let e = l.check_series("m", [("a", "v\0")].into_iter()).unwrap_err();
        assert_eq!(e.reason, Reason::InvalidLabel);
        assert!(e.message.contains("NUL"), "{e}");
        assert!(l.check_series("", [].into_iter()).is_err());
        assert!(l.check_series("m", [("a", "")].into_iter()).is_ok());
    }

    #[test]
    fn agent_ids() {
        assert!(check_agent_id("", 4).is_ok());
        assert!(check_agent_id("abc", 4).is_ok());
        assert!(check_agent_id("abcd", 4).is_ok());
        assert_eq!(
            check_agent_id("abcde", 4).unwrap_err().reason,
            Reason::BadAgentId
        );
        assert!(check_agent_id("a\0", 4).is_err());
        assert!(check_agent_id("a\nb", 4).is_err());
        assert!(check_agent_id("nodé-1", 16).is_ok());
    }

    #[test]
    fn counters_render_every_reason() {
        let c = RejectCounters::default();
        c.add(Reason::TooOld, 3);
        c.add(Reason::TooFarInFuture, 1);
        let mut out = String::new();
        c.render(&mut out, "x_total", "help");
        assert!(out.contains("x_total{reason=\"too_old\"} 3\n"), "{out}");
        assert!(out.contains("x_total{reason=\"too_far_in_future\"} 1\n"));
        assert!(out.contains("x_total{reason=\"bad_agent_id\"} 0\n"));
    }
}
