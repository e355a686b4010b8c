//! Deltas of cumulative counters (ECC totals, remapped rows, throttle ns).
//!
//! Counters only go up, except when the driver reloads or the GPU resets (the
//! volatile ECC and throttle-time counters restart at 0). A decrease is
//! therefore a reset: we re-baseline on the new value and report no growth,
//! rather than negative growth or a huge wrap-around. The growth that
//! happened between the last poll before the reset and the reset itself is
//! lost; DCGM's health watch does the same (it takes the absolute difference).

/// What one new counter value means relative to the previous one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum CounterStep {
    /// The first value seen: a baseline, not growth.
    Baseline,
    /// The value went down: a counter reset. Re-baselined, not growth.
    Reset,
    /// Growth (>= 0) since the previous value, over `elapsed_ms` (> 0).
    Delta { by: f64, elapsed_ms: i64 },
}

/// The last value of one counter and when it was seen.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CounterTrack {
    last: Option<(f64, i64)>,
}

impl CounterTrack {
    /// Feeds the counter's value at `ts_ms`. `None` (field missing, or a
    /// negative value, which no counter can hold) leaves the baseline alone,
    /// so the next delta spans the gap. Callers pass increasing `ts_ms`.
    pub(crate) fn step(&mut self, value: Option<f64>, ts_ms: i64) -> Option<CounterStep> {
        let value = value.filter(|v| *v >= 0.0)?;
        let prev = self.last.replace((value, ts_ms));
        Some(match prev {
            None => CounterStep::Baseline,
            Some((before, _)) if value < before => CounterStep::Reset,
            Some((before, before_ts)) => CounterStep::Delta {
                by: value - before,
                elapsed_ms: (ts_ms - before_ts).max(1),
            },
        })
    }

    /// The last value fed, if any.
    pub(crate) fn value(&self) -> Option<f64> {
        self.last.map(|(v, _)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn baseline_growth_reset_and_gap() {
        let mut c = CounterTrack::default();
        assert_eq!(c.step(None, 0), None);
        assert_eq!(c.step(Some(10.0), 1_000), Some(CounterStep::Baseline));
        assert_eq!(
            c.step(Some(15.0), 3_000),
            Some(CounterStep::Delta {
                by: 5.0,
                elapsed_ms: 2_000
            })
        );
        // Missing: no step, baseline kept, so the next delta spans 3 s -> 9 s.
        assert_eq!(c.step(None, 6_000), None);
        assert_eq!(
            c.step(Some(15.0), 9_000),
            Some(CounterStep::Delta {
                by: 0.0,
                elapsed_ms: 6_000
            })
        );
        // Driver reload: 15 -> 2 is a reset, then growth from 2.
        assert_eq!(c.step(Some(2.0), 10_000), Some(CounterStep::Reset));
        assert_eq!(
            c.step(Some(3.0), 11_000),
            Some(CounterStep::Delta {
                by: 1.0,
                elapsed_ms: 1_000
            })
        );
        assert_eq!(c.step(Some(-1.0), 12_000), None);
        assert_eq!(c.value(), Some(3.0));
    }
}
