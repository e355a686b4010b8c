use std::time::Duration;

use super::*;

/// `1+1+…+1` with `n` terms.
fn chain(n: usize) -> String {
    vec!["1"; n].join("+")
}

fn guard(max_length: usize, max_depth: usize) -> QueryGuard {
    QueryGuard::new(QueryLimits {
        max_length,
        max_depth,
        ..QueryLimits::default()
    })
}

#[test]
fn query_length_is_checked_at_the_limit() {
    let g = guard(100, 256);
    assert_eq!(g.check_length(&"x".repeat(99)), Ok(()));
    assert_eq!(g.check_length(&"x".repeat(100)), Ok(()));
    assert_eq!(
        g.check_length(&"x".repeat(101)),
        Err(Refusal::TooLong {
            len: 101,
            limit: 100
        })
    );
    assert_eq!(g.metrics().too_long.load(Relaxed), 1);
}

#[test]
fn sql_depth_counts_the_query_and_each_nested_expression() {
    // `SELECT 1+…+1` (n terms): the query, n-1 left-nested additions and the
    // innermost literal make n+1 levels.
    let g = guard(1 << 20, 10);
    assert_eq!(g.check_sql(&format!("SELECT {}", chain(8))), Ok(()));
    assert_eq!(g.check_sql(&format!("SELECT {}", chain(9))), Ok(()));
    assert_eq!(
        g.check_sql(&format!("SELECT {}", chain(10))),
        Err(Refusal::TooDeep { limit: 10 })
    );
    // A subquery is a level: 7 terms (8 levels) inside one more query.
    assert_eq!(
        g.check_sql(&format!("SELECT * FROM (SELECT {}) AS t", chain(8))),
        Ok(())
    );
    assert_eq!(
        g.check_sql(&format!("SELECT * FROM (SELECT {}) AS t", chain(9))),
        Err(Refusal::TooDeep { limit: 10 })
    );
    // Every statement of a string counts, and EXPLAIN looks inside.
    assert_eq!(
        g.check_sql(&format!("SELECT 1; SELECT {}", chain(10))),
        Err(Refusal::TooDeep { limit: 10 })
    );
    assert_eq!(
        g.check_sql(&format!("EXPLAIN SELECT {}", chain(10))),
        Err(Refusal::TooDeep { limit: 10 })
    );
    assert_eq!(g.metrics().too_deep.load(Relaxed), 4);
}

#[test]
fn a_wide_query_is_not_deep() {
    // 2,000 terms side by side: wide, two levels.
    let g = guard(1 << 20, 10);
    let list = vec!["'h'"; 2000].join(", ");
    assert_eq!(
        g.check_sql(&format!(
            "SELECT count(*) FROM samples WHERE host IN ({list})"
        )),
        Ok(())
    );
}

#[test]
fn sql_that_does_not_parse_is_left_to_datafusion() {
    let g = guard(1 << 20, 10);
    assert_eq!(g.check_sql("SELEC 1"), Ok(()));
}

#[test]
fn promql_depth_counts_every_node_on_the_deepest_path() {
    let parse = |q: &str| promql_parser::parser::parse(q).unwrap();
    assert_eq!(promql_depth(&parse("up")), 1);
    assert_eq!(promql_depth(&parse(&chain(5))), 5);
    // sum( rate( x[5m] ) ): aggregate, call, matrix selector.
    assert_eq!(promql_depth(&parse("sum(rate(x[5m]))")), 3);
    // The parameter of topk is a child too: topk((((3))), x).
    assert_eq!(promql_depth(&parse("topk((((3))), x)")), 5);
    let g = guard(1 << 20, 10);
    assert_eq!(g.check_promql(&parse(&chain(10))), Ok(()));
    assert_eq!(
        g.check_promql(&parse(&chain(11))),
        Err(Refusal::TooDeep { limit: 10 })
    );
}

#[test]
fn deep_queries_are_refused_on_a_small_stack() {
    // 3,000 terms once overflowed a runtime thread. The checks themselves
    // must stay within a 256 KiB stack: parse, bounded walk, drop.
    let sql = format!("SELECT {}", chain(3000));
    let promql = chain(3000);
    let out = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            let g = QueryGuard::default();
            (g.check_sql(&sql), g.check_length(&promql))
        })
        .unwrap()
        .join()
        .unwrap();
    assert_eq!(out.0, Err(Refusal::TooDeep { limit: 256 }));
    assert_eq!(out.1, Ok(()));
}

#[tokio::test]
async fn slots_bound_concurrency_and_a_waiter_times_out() {
    let g = Arc::new(QueryGuard::new(QueryLimits {
        max_concurrent: 2,
        timeout: Duration::from_millis(300),
        ..QueryLimits::default()
    }));
    let a = g.slot(g.deadline()).await.unwrap();
    let b = g.slot(g.deadline()).await.unwrap();
    assert_eq!(g.metrics().running.load(Relaxed), 2);
    let third = g.slot(g.deadline()).await;
    assert_eq!(
        third.unwrap_err(),
        Refusal::Timeout {
            limit: Duration::from_millis(300),
            waited: true
        }
    );
    drop(a);
    let c = g.slot(g.deadline()).await.unwrap();
    assert_eq!(g.metrics().running.load(Relaxed), 2);
    drop((b, c));
    assert_eq!(g.metrics().running.load(Relaxed), 0);
    assert_eq!(g.metrics().waiting.load(Relaxed), 0);
    assert_eq!(g.metrics().timeout.load(Relaxed), 1);
}

#[tokio::test]
async fn a_query_past_its_deadline_is_stopped_and_frees_its_slot() {
    let g = Arc::new(QueryGuard::new(QueryLimits {
        max_concurrent: 1,
        timeout: Duration::from_millis(200),
        ..QueryLimits::default()
    }));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let started = Instant::now();
    let r = g
        .spawn(async move {
            // Never finishes by itself; dropping it drops `tx`.
            let _tx = tx;
            std::future::pending::<()>().await
        })
        .await;
    assert!(matches!(r, Err(Refusal::Timeout { waited: false, .. })));
    assert!(started.elapsed() < Duration::from_secs(5));
    // The task was dropped on the query runtime: its sender is gone.
    assert!(rx.await.is_err());
    // And its slot is free again.
    assert_eq!(g.spawn(async { 7 }).await, Ok(7));
}

#[tokio::test]
async fn query_threads_have_a_large_stack() {
    let g = QueryGuard::default();
    // Recursion that needs about 16 MiB: far past a default 2 MiB thread.
    fn deep(n: u32) -> u64 {
        let pad = std::hint::black_box([n as u8; 1024]);
        if n == 0 {
            0
        } else {
            deep(n - 1) + u64::from(pad[1] == n as u8)
        }
    }
    let got = g.spawn_blocking(|_| deep(16_000)).await;
    assert_eq!(got, Ok(16_000));
}

#[tokio::test]
async fn a_session_refuses_a_query_past_its_memory_limit() {
    let g = QueryGuard::new(QueryLimits {
        memory_limit: 4 << 20,
        ..QueryLimits::default()
    });
    let ctx = g.session(&SessionContext::new());
    // 2 M distinct keys in no order (7919 is invertible modulo the prime
    // 2,000,003, so no two v < 2,000,003 collide) need a hash table far
    // over 4 MiB; so does sorting 2 M rows.
    for q in [
        "SELECT count(DISTINCT v * 7919 % 2000003) AS n FROM generate_series(1, 2000000) AS t(v)",
        "SELECT v FROM generate_series(1, 2000000) AS t(v) ORDER BY v % 1000 DESC",
    ] {
        let e = ctx.sql(q).await.unwrap().collect().await.unwrap_err();
        assert!(is_memory_exhausted(&e), "{q}: {e}");
        let r = g.memory_refusal(&e).unwrap();
        assert_eq!(r.sqlstate(), "53200");
        assert!(r.to_string().contains("--query-memory-limit"), "{r}");
    }
    assert_eq!(g.metrics().memory.load(Relaxed), 2);
    // The same query within a larger pool runs.
    let g = QueryGuard::default();
    let ctx = g.session(&SessionContext::new());
    let batches = ctx
        .sql("SELECT count(DISTINCT v * 7919 % 2000003) AS n FROM generate_series(1, 2000000) AS t(v)")
        .await
        .unwrap()
        .collect()
        .await
        .unwrap();
    let n = batches[0]
        .column(0)
        .as_any()
        .downcast_ref::<arrow::array::Int64Array>()
        .unwrap()
        .value(0);
    assert_eq!(n, 2_000_000);
}
