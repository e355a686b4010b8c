//! The sampling loop's schedule and timestamps.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::sync::mpsc;

use super::*;
use crate::catalog::Metric;

/// One GPU, one series; each poll reads the number of polls before it.
#[derive(Debug)]
struct Counting {
    inventory: Vec<GpuInfo>,
    polls: u64,
}

impl GpuSource for Counting {
    fn name(&self) -> &'static str {
        "counting"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.inventory
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        out.push(Reading::new(0, Metric::PowerUsage, self.polls as f64));
        self.polls += 1;
        Ok(())
    }
}

/// Runs the sampling loop for `polls` polls with `sleep` and returns them.
fn sample(
    polls: u64,
    interval: Duration,
    sleep: impl FnMut(Duration) + Send + 'static,
) -> Vec<Poll> {
    let source = Box::new(Counting {
        inventory: vec![GpuInfo::default()],
        polls: 0,
    });
    let (tx, mut rx) = mpsc::channel(polls as usize + 1);
    let counters = Arc::new(AgentMetrics::default());
    let c = counters.clone();
    std::thread::spawn(move || {
        let stop = AtomicBool::new(false);
        sample_loop(source, tx, interval, Some(polls), &stop, &c, sleep);
    })
    .join()
    .unwrap();
    let mut out = Vec::new();
    while let Ok(p) = rx.try_recv() {
        out.push(p);
    }
    assert_eq!(out.len() as u64, polls);
    assert_eq!(counters.polls_dropped.load(Relaxed), 0);
    out
}

/// Each poll read the polls before it (0, 1, 2, ...), and timestamps
/// strictly increase.
fn check_distinct(polls: &[Poll]) {
    for (i, p) in polls.iter().enumerate() {
        assert_eq!(
            p.readings,
            vec![Reading::new(0, Metric::PowerUsage, i as f64)]
        );
    }
    let ts: Vec<i64> = polls.iter().map(|p| p.ts_ms).collect();
    assert!(
        ts.windows(2).all(|w| w[0] < w[1]),
        "two polls share a timestamp, so one series has two values at one ts \
         and storage keeps only the first: {ts:?}"
    );
}

/// The delivery test's failure (issue #14): the sampling thread woke from its
/// sleep more than an interval late, polled, and then polled the next tick,
/// already due, at once, in the same millisecond.
#[test]
fn a_late_wake_up_never_gives_two_polls_one_timestamp() {
    let interval = Duration::from_millis(20);
    let mut calls = 0;
    let polls = sample(8, interval, move |d| {
        calls += 1;
        // The third wait oversleeps by two and a half intervals.
        let late = if calls == 3 {
            interval * 5 / 2
        } else {
            Duration::ZERO
        };
        std::thread::sleep(d + late);
    });
    check_distinct(&polls);
}

/// At an interval under a millisecond, polls would share millisecond
/// timestamps; the loop polls at most once a millisecond instead.
#[test]
fn a_sub_millisecond_interval_still_gives_distinct_timestamps() {
    let polls = sample(10, Duration::from_micros(200), std::thread::sleep);
    check_distinct(&polls);
}

/// Ticks every 20 ms; the poll of tick 3 ends at `elapsed`.
#[test]
fn a_late_poll_skips_the_ticks_already_due() {
    let ms = Duration::from_millis;
    // On time: tick 4 (at 80 ms) is still ahead.
    assert_eq!(next_tick(4, ms(65), ms(20)), 4);
    assert_eq!(next_tick(4, ms(79), ms(20)), 4);
    // Tick 4 is due as the poll ends: polling it now would be a second poll
    // right behind the first, so the next is tick 5 (100 ms).
    assert_eq!(next_tick(4, ms(80), ms(20)), 5);
    // Two and a half intervals late: ticks 4 and 5 are skipped.
    assert_eq!(next_tick(4, ms(110), ms(20)), 6);
    // A tick further ahead stays.
    assert_eq!(next_tick(9, ms(110), ms(20)), 9);
    // Years of ticks do not wrap around.
    assert_eq!(
        next_tick(4, Duration::from_secs(u32::MAX as u64 * 2), ms(20)),
        u32::MAX
    );
}

/// A source that takes 5 ms a poll.
#[derive(Debug)]
struct Slow(Vec<GpuInfo>);

impl GpuSource for Slow {
    fn name(&self) -> &'static str {
        "slow"
    }

    fn inventory(&self) -> &[GpuInfo] {
        &self.0
    }

    fn sample(&mut self, out: &mut Vec<Reading>) -> Result<(), SourceError> {
        std::thread::sleep(Duration::from_millis(5));
        out.push(Reading::new(0, Metric::PowerUsage, 1.0));
        Ok(())
    }
}

/// `gpulse_agent_poll_duration_seconds_total` counts the time in the source.
#[test]
fn the_time_spent_reading_the_source_is_counted() {
    let (tx, _rx) = mpsc::channel(8);
    let counters = AgentMetrics::default();
    let stop = AtomicBool::new(false);
    let source = Box::new(Slow(vec![GpuInfo::default()]));
    sample_loop(
        source,
        tx,
        Duration::from_millis(1),
        Some(4),
        &stop,
        &counters,
        std::thread::sleep,
    );
    assert_eq!(counters.polls.load(Relaxed), 4);
    let nanos = counters.poll_nanos.load(Relaxed);
    // Four sleeps of at least 5 ms; the loop's own work is far under a second.
    assert!((20_000_000..1_000_000_000).contains(&nanos), "{nanos} ns");
}
