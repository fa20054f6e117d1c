//! The shared-seed property runner and verdict agreement.

use std::cell::Cell;
use std::fmt::Debug;
use std::time::Duration;

use accel_api::Store;
use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

use crate::{Ctx, Outcome};

/// Agree on a verdict with the other ranks through the store: each rank
/// publishes its own under `prefix/<rank>`, waits for all, and every rank
/// returns the same answer: `Ok` only if every rank passed, otherwise the
/// failures of every rank that failed (and the ranks that never reported).
///
/// # Errors
/// The combined failure text.
pub fn agree(
    store: &dyn Store,
    prefix: &str,
    rank: usize,
    world: usize,
    verdict: Result<(), String>,
    timeout: Duration,
) -> Result<(), String> {
    let mine = match &verdict {
        Ok(()) => "ok".to_string(),
        Err(m) => format!("fail:{m}"),
    };
    if let Err(e) = store.set(&format!("{prefix}/{rank}"), mine.as_bytes()) {
        return Err(format!("rank {rank} could not publish its verdict: {e}"));
    }
    let keys: Vec<String> = (0..world).map(|r| format!("{prefix}/{r}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let waited = store.wait(&refs, timeout);
    // Group identical failure texts: "ranks 0, 1: <msg>".
    let mut failures: Vec<(Vec<usize>, String)> = Vec::new();
    for (r, k) in keys.iter().enumerate() {
        let msg = match store.try_get(k) {
            Ok(Some(v)) => match String::from_utf8_lossy(&v).strip_prefix("fail:") {
                Some(m) => m.to_string(),
                None => continue,
            },
            _ => format!("no verdict within {timeout:?}"),
        };
        match failures.iter_mut().find(|(_, m)| *m == msg) {
            Some((ranks, _)) => ranks.push(r),
            None => failures.push((vec![r], msg)),
        }
    }
    if failures.is_empty() && waited.is_ok() {
        return Ok(());
    }
    Err(failures
        .iter()
        .map(|(ranks, m)| {
            let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            let who = if ranks.len() == 1 { "rank" } else { "ranks" };
            format!("{who} {}: {m}", list.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; "))
}

/// Run a property on every rank with the shared seed; see the crate docs.
pub(crate) fn property<S>(
    ctx: &Ctx,
    name: &str,
    strategy: S,
    test: impl Fn(&S::Value) -> Result<(), String>,
) -> Outcome
where
    S: Strategy,
    S::Value: Debug,
{
    let seed = ctx.seed.derive(name);
    let config = Config {
        cases: ctx.cases,
        failure_persistence: None,
        // Shrinking must take the same path on every rank: bound it by
        // iterations only, never by wall time.
        max_shrink_iters: 200,
        max_shrink_time: 0,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &seed.0));
    let case_no = Cell::new(0u64);
    let wait = ctx.comm.timeout() + Duration::from_secs(30);
    let result = runner.run(&strategy, |value| {
        let n = case_no.get();
        case_no.set(n + 1);
        let local = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| test(&value))) {
            Ok(v) => v,
            Err(p) => Err(format!("panicked: {}", panic_text(&p))),
        };
        agree(
            &*ctx.store,
            &format!("prop/{name}/{n}"),
            ctx.rank(),
            ctx.world_size(),
            local,
            wait,
        )
        .map_err(TestCaseError::fail)
    });
    match result {
        Ok(()) => Outcome::Pass,
        Err(TestError::Fail(reason, value)) => Outcome::Fail(format!(
            "minimal failing case {value:?}: {reason} (after {} cases; replay with ACCEL_CONFORMANCE_SEED={} PROPTEST_CASES={})",
            case_no.get(),
            ctx.seed.hex(),
            ctx.cases
        )),
        Err(TestError::Abort(reason)) => Outcome::Fail(format!("property aborted: {reason}")),
    }
}

/// The message of a caught panic.
pub(crate) fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agreement_fails_for_everyone_when_one_rank_fails() {
        let store = std::sync::Arc::new(accel_rendezvous::MemoryStore::new());
        let hs: Vec<_> = (0..3)
            .map(|r| {
                let store = store.clone();
                std::thread::spawn(move || {
                    let v = if r == 1 {
                        Err("bad sum".to_string())
                    } else {
                        Ok(())
                    };
                    agree(&*store, "x", r, 3, v, Duration::from_secs(5))
                })
            })
            .collect();
        for h in hs {
            let e = h.join().unwrap().unwrap_err();
            assert!(e.contains("rank 1: bad sum"), "{e}");
        }
        let e = agree(&*store, "y", 0, 2, Ok(()), Duration::from_millis(50)).unwrap_err();
        assert!(e.contains("rank 1: no verdict"), "{e}");
    }
}
