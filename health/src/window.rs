//! A sliding sum over time in a fixed number of buckets: "how many new SBEs
//! in the last minute", "how many DBE page retirements in the last week".
//!
//! Fixed size whatever the poll rate (10 Hz or one poll per 30 s), which is
//! what keeps per-GPU state bounded. The price is bucket granularity: the
//! window `span_ms` is cut into [`BUCKETS`] buckets of `width = span_ms / 12`,
//! and an amount added at `t` counts at `now` iff
//! `floor(now / width) - floor(t / width) < 12`. So an amount stays in the sum
//! for between 11/12 and 12/12 of the span, depending on where in its bucket
//! it landed. Thresholds are documented against the span.

/// Buckets per window.
pub(crate) const BUCKETS: usize = 12;

#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    width_ms: i64,
    /// Bucket number (`floor(ts / width)`) each slot currently holds.
    ids: [i64; BUCKETS],
    sums: [f64; BUCKETS],
    /// Sample time of the first amount added to each slot's bucket.
    first_ts: [i64; BUCKETS],
}

impl Window {
    /// A window over `span_ms` (at least 12 ms; shorter is treated as 12).
    pub(crate) fn new(span_ms: i64) -> Self {
        Window {
            width_ms: (span_ms / BUCKETS as i64).max(1),
            ids: [i64::MIN; BUCKETS],
            sums: [0.0; BUCKETS],
            first_ts: [0; BUCKETS],
        }
    }

    fn bucket(&self, ts_ms: i64) -> i64 {
        ts_ms.div_euclid(self.width_ms)
    }

    fn live(&self, slot: usize, now_bucket: i64) -> bool {
        let id = self.ids[slot];
        id != i64::MIN && id <= now_bucket && now_bucket - id < BUCKETS as i64
    }

    /// Adds `amount` at `ts_ms`. Callers pass non-decreasing `ts_ms`.
    pub(crate) fn add(&mut self, ts_ms: i64, amount: f64) {
        if amount <= 0.0 {
            return;
        }
        let b = self.bucket(ts_ms);
        let slot = b.rem_euclid(BUCKETS as i64) as usize;
        if self.ids[slot] != b {
            self.ids[slot] = b;
            self.sums[slot] = 0.0;
            self.first_ts[slot] = ts_ms;
        }
        self.sums[slot] += amount;
    }

    /// The sum of the amounts still in the window at `now_ms`.
    pub(crate) fn sum(&self, now_ms: i64) -> f64 {
        let nb = self.bucket(now_ms);
        (0..BUCKETS)
            .filter(|&s| self.live(s, nb))
            .map(|s| self.sums[s])
            // Not `.sum()`: an empty float sum is -0.0, which prints as "-0".
            .fold(0.0, |a, b| a + b)
    }

    /// Sample time of the earliest amount still in the window at `now_ms`.
    pub(crate) fn onset(&self, now_ms: i64) -> Option<i64> {
        let nb = self.bucket(now_ms);
        (0..BUCKETS)
            .filter(|&s| self.live(s, nb) && self.sums[s] > 0.0)
            .map(|s| self.first_ts[s])
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_leave_after_twelve_buckets() {
        // 60 s span: 5 s buckets.
        let mut w = Window::new(60_000);
        w.add(2_000, 3.0); // bucket 0
        w.add(7_000, 4.0); // bucket 1
        assert_eq!(w.sum(7_000), 7.0);
        assert_eq!(w.onset(7_000), Some(2_000));
        // Bucket 11: 11 - 0 < 12, both still in.
        assert_eq!(w.sum(59_999), 7.0);
        // Bucket 12: bucket 0 is out, bucket 1 still in.
        assert_eq!(w.sum(60_000), 4.0);
        assert_eq!(w.onset(60_000), Some(7_000));
        // Bucket 13: everything out.
        assert_eq!(w.sum(65_000), 0.0);
        assert_eq!(w.onset(65_000), None);
    }

    #[test]
    fn a_reused_slot_forgets_its_old_bucket() {
        let mut w = Window::new(60_000);
        w.add(0, 5.0); // bucket 0, slot 0
        w.add(60_000, 1.0); // bucket 12, slot 0 again
        assert_eq!(w.sum(60_000), 1.0);
        assert_eq!(w.onset(60_000), Some(60_000));
    }
}
