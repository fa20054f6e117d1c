//! Running a closure on N rank threads of this process, each with its own
//! xla communicator, and skipping (with the reason) without a plugin.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use accel_api::{ConnectContext, Result, Store};
use accel_backend_xla::__test::XlaCommunicator;
use accel_rendezvous::MemoryStore;

/// `true` when a PJRT plugin is there. Without one the test is skipped
/// (`accel_test_support::skips::skip`: a failure under make test and CI,
/// whose set-up fetches the plugin) and this returns `false`.
pub fn plugin_or_skip(test: &str) -> bool {
    match accel_backend_xla::describe_plugin() {
        Ok(_) => true,
        Err(e) => {
            accel_test_support::skips::skip(&format!(
                "{test}: no PJRT plugin (run `make pjrt-setup`): {e}"
            ));
            false
        }
    }
}

/// The context of `rank` in a run of `world` ranks on `store`.
pub fn ctx(
    store: &Arc<MemoryStore>,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> ConnectContext {
    ConnectContext::local(rank, world, timeout, store.clone() as Arc<dyn Store>)
        .with_run_id("xla-test")
}

/// Run `f(rank, communicator)` on `world` rank threads, each connecting its
/// own communicator; results in rank order.
pub fn on_ranks<T: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, &XlaCommunicator) -> T + Sync,
) -> Vec<Result<T>> {
    let store = Arc::new(MemoryStore::new());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let store = &store;
                let f = &f;
                s.spawn(move || {
                    let c = accel_backend_xla::__test::connect(ctx(store, rank, world, timeout))?;
                    Ok(f(rank, &c))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank thread panicked"))
            .collect()
    })
}
