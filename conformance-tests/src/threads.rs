//! The suite with ranks as threads of one process, over any
//! [`Backend`](accel_api::Backend) that can connect several ranks in one
//! process (single, cpu-gloo over loopback, xla): what a backend's own
//! `#[test]` calls, in one line (object_store's `integration` pattern).

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use accel_api::{Backend, ConnectContext, Device, Error, ErrorKind, Result, Store, StoreExt};
use accel_rendezvous::{MemoryStore, PrefixStore};

use crate::{run_all, Ctx, Outcome, ScenarioResult, Seed};

/// The world communicator's timeout unless `ACCEL_TIMEOUT` says otherwise
/// (the multi-process harness's default too).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// The hard bound on one world, whatever the backend does: a rank thread
/// that outlives it fails the run instead of hanging the test.
const HARD_TIMEOUT: Duration = Duration::from_secs(300);

/// Run every scenario (or those whose name contains `filter`) on `world`
/// ranks, each a thread of this process that connects through `backend`
/// over one in-memory store, and return the agreed results (every rank
/// agrees on each verdict through the store, as in the multi-process run).
///
/// `PROPTEST_CASES` sets the property depth (default 16),
/// `ACCEL_CONFORMANCE_SEED` replays a seed, `ACCEL_TIMEOUT` the world
/// communicator's timeout (default 30 s). The whole world is bounded by
/// 300 s.
///
/// # Errors
/// A rank that could not connect (the backend's error), a rank thread
/// that panicked outside a scenario or ranks that disagree on the results
/// ([`ErrorKind::Internal`]), or a world that outlived the hard bound
/// ([`ErrorKind::Timeout`]; its threads are left behind).
pub fn run_in_process(
    backend: Arc<dyn Backend>,
    world: usize,
    filter: Option<&str>,
) -> Result<Vec<ScenarioResult>> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let seed = std::env::var("ACCEL_CONFORMANCE_SEED")
        .ok()
        .and_then(|s| Seed::parse(&s))
        .unwrap_or_else(Seed::fresh);
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let timeout = match std::env::var("ACCEL_TIMEOUT") {
        Ok(v) => accel::state::parse_duration("ACCEL_TIMEOUT", &v)?,
        Err(_) => DEFAULT_TIMEOUT,
    };
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let device = match backend.device_kind() {
            accel_api::DeviceKind::Cpu => Device::CPU,
            kind => Device::new(kind, rank as u32),
        };
        let (backend, store, tx) = (backend.clone(), store.clone(), tx.clone());
        let filter = filter.map(str::to_string);
        let body = move || -> Result<Vec<ScenarioResult>> {
            let comm = backend.connect(
                ConnectContext::local(
                    rank,
                    world,
                    timeout,
                    Arc::new(PrefixStore::new(store.clone(), "world")),
                )
                .with_device(device)
                .with_run_id("conformance-threads"),
            )?;
            let ctx = Ctx {
                comm: Arc::from(comm),
                backend,
                store: store.clone(),
                local_rank: rank,
                local_world_size: world,
                device,
                cases,
                seed,
            };
            let results = run_all(&ctx, filter.as_deref());
            // Nobody drops its communicator before everyone is done.
            store.barrier("finished", world, timeout + Duration::from_secs(30))?;
            Ok(results)
        };
        std::thread::Builder::new()
            .name(format!("rank {rank}"))
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
                    .unwrap_or_else(|p| {
                        Err(Error::internal(
                            "conformance",
                            format!("rank thread {rank} panicked: {}", crate::panic_text(&p)),
                        ))
                    });
                let _ = tx.send((rank, out));
            })
            .map_err(|e| Error::io("spawning a rank thread", e))?;
    }
    drop(tx);
    let deadline = Instant::now() + HARD_TIMEOUT;
    let mut per_rank: Vec<Option<Vec<ScenarioResult>>> = vec![None; world];
    for _ in 0..world {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, out)) => per_rank[rank] = Some(out?),
            Err(_) => {
                let missing: Vec<String> = (0..world)
                    .filter(|&r| per_rank[r].is_none())
                    .map(|r| r.to_string())
                    .collect();
                return Err(Error::timeout(
                    "conformance",
                    HARD_TIMEOUT,
                    format!(
                        "rank thread(s) {} of {} did not finish",
                        missing.join(", "),
                        backend.name()
                    ),
                ));
            }
        }
    }
    let verdicts = |rs: &[ScenarioResult]| -> Vec<(String, Outcome)> {
        rs.iter()
            .map(|r| (r.name.clone(), r.outcome.clone()))
            .collect()
    };
    let mut ranks = per_rank.into_iter().flatten();
    let first = ranks.next().unwrap_or_default();
    for (i, other) in ranks.enumerate() {
        if verdicts(&other) != verdicts(&first) {
            return Err(Error::new(
                ErrorKind::Internal,
                format!("rank {} agreed on other verdicts than rank 0", i + 1),
            )
            .with_op("conformance"));
        }
    }
    Ok(first)
}

/// Run the suite in process at each world size of `worlds` (scenarios
/// matching `filter`), print one line per scenario and world (skips with
/// their reasons), and panic listing every failure. A skip never counts as
/// a pass: the summary line counts them apart.
///
/// # Panics
/// When a scenario fails, a rank cannot connect, or nothing matched
/// `filter`.
pub fn assert_conformance(backend: Arc<dyn Backend>, worlds: &[usize], filter: Option<&str>) {
    let name = backend.name().to_string();
    let (mut passed, mut skipped, mut failures) = (0usize, 0usize, Vec::new());
    for &n in worlds {
        let results = match run_in_process(backend.clone(), n, filter) {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{name}@{n}: {e}"));
                continue;
            }
        };
        assert!(
            !results.is_empty(),
            "no scenario matches {filter:?} for {name}@{n}"
        );
        for r in results {
            match &r.outcome {
                Outcome::Pass => passed += 1,
                Outcome::Skip(why) => {
                    skipped += 1;
                    println!("{name}@{n} {}: skipped: {why}", r.name);
                }
                Outcome::Fail(m) => failures.push(format!("{name}@{n} {}: {m}", r.name)),
            }
        }
    }
    println!(
        "conformance ({name}, ranks as threads): {passed} passed, {} failed, {skipped} skipped",
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
