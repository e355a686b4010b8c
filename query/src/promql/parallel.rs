//! Work on many series at once, split across cores: the reads of a
//! selector and the range functions over them. Each series is independent,
//! so the answer is the same as one core's, in the same order.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Below this many samples of work a query stays on its own thread. Waking
/// the pool costs tens of microseconds and its idle threads spin (yielding)
/// before they sleep, taking a core from the server's other threads: at
/// 16,384, one rack's raw hours (22,000 samples) and one GPU's hour as JSON
/// (19,000 points) spent a fifth of the server's time in the scheduler
/// (`perf`, 2 cores), more than the split saved.
pub(super) const MIN_PARALLEL_SAMPLES: usize = 65_536;

/// The pool the PromQL evaluator splits its work on: one thread per core,
/// named `gpulse-scan-N`, started on first use.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: OnceLock<Option<rayon::ThreadPool>> = OnceLock::new();
    POOL.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        if threads < 2 {
            return None;
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("gpulse-scan-{i}"))
            .build()
            .inspect_err(|e| {
                tracing::warn!(error = %e, "cannot start the PromQL scan threads; queries run on one core");
            })
            .ok()
    })
    .as_ref()
}

/// `f` of every item, in order; across the pool's threads when `work` (in
/// samples) is worth it.
pub(super) fn map<T, U, F>(items: &[T], work: usize, f: F) -> Vec<U>
where
    T: Sync,
    U: Send,
    F: Fn(&T) -> U + Sync + Send,
{
    match pool() {
        Some(pool) if work >= MIN_PARALLEL_SAMPLES && items.len() > 1 => {
            pool.install(|| items.par_iter().map(&f).collect())
        }
        _ => items.iter().map(f).collect(),
    }
}

/// [`map`] of items taken by value: each is dropped where it is used, on
/// the pool's threads, rather than all at once by the caller after (freeing
/// a query's samples took a third of its thread's time).
pub(super) fn map_owned<T, U, F>(items: Vec<T>, work: usize, f: F) -> Vec<U>
where
    T: Send,
    U: Send,
    F: Fn(T) -> U + Sync + Send,
{
    match pool() {
        Some(pool) if work >= MIN_PARALLEL_SAMPLES && items.len() > 1 => {
            pool.install(|| items.into_par_iter().map(&f).collect())
        }
        _ => items.into_iter().map(f).collect(),
    }
}

/// [`map`] with a scratch value per thread, made by `init` and handed to
/// `f` with each item: buffers that one item fills and the next reuses.
pub(super) fn map_init<T, U, S, I, F>(items: &[T], work: usize, init: I, f: F) -> Vec<U>
where
    T: Sync,
    U: Send,
    I: Fn() -> S + Sync + Send,
    F: Fn(&mut S, &T) -> U + Sync + Send,
{
    match pool() {
        Some(pool) if work >= MIN_PARALLEL_SAMPLES && items.len() > 1 => {
            pool.install(|| items.par_iter().map_init(&init, &f).collect())
        }
        _ => {
            let mut scratch = init();
            items.iter().map(|x| f(&mut scratch, x)).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_keep_the_order_of_the_items_with_or_without_the_pool() {
        let items: Vec<u64> = (0..10_000).collect();
        let square = |x: &u64| x * x;
        let expected: Vec<u64> = (0..10_000u64).map(|x| x * x).collect();
        assert_eq!(map(&items, MIN_PARALLEL_SAMPLES, square), expected);
        assert_eq!(map(&items, 0, square), expected);
        let owned = |x: u64| x * x;
        assert_eq!(
            map_owned(items.clone(), MIN_PARALLEL_SAMPLES, owned),
            expected
        );
        assert_eq!(map_owned(items.clone(), 0, owned), expected);
        // A scratch vector that keeps what earlier items left in it only
        // within one thread: each answer must not depend on it.
        let scratch = |buf: &mut Vec<u64>, x: &u64| {
            buf.clear();
            buf.extend([*x, *x]);
            buf.iter().product::<u64>()
        };
        assert_eq!(
            map_init(&items, MIN_PARALLEL_SAMPLES, Vec::new, scratch),
            expected
        );
        assert_eq!(map_init(&items, 0, Vec::new, scratch), expected);
    }
}
