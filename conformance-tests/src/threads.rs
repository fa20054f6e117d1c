//! The suite with ranks as threads of one process, over any
//! [`accel_api::Backend`] that can connect several ranks in one
//! process (single, cpu-gloo over loopback, xla): what a backend's own
//! `#[test]` calls, in one line (object_store's `integration` pattern).
//! The rank threads are accel's in-process entry, [`accel::Threads`]: each
//! rank has its own state and `Accelerator`, and every rank's communicator
//! lives until all ranks are done.

use std::sync::{mpsc, Arc, Mutex};
use std::time::Instant;

use accel_api::{Backend, Device, Error, ErrorKind, Result};

use crate::harness::{RunSpec, WorldReport};
use crate::{all_scenarios, run_all, Ctx, Outcome, ScenarioResult, Seed};

/// Run every scenario (or those whose name contains `filter`) on `world`
/// ranks, each a thread of this process that connects through `backend`
/// over one in-memory store, and return the agreed results (every rank
/// agrees on each verdict through the store, as in the multi-process run).
///
/// The bounds are [`RunSpec::new`]'s (30 s per call, 300 s per world);
/// `PROPTEST_CASES` sets the property depth (default 16),
/// `ACCEL_CONFORMANCE_SEED` replays a seed, `ACCEL_TIMEOUT` the world
/// communicator's timeout. [`run_spec_in_process`] takes them all from a
/// [`RunSpec`].
///
/// # Errors
/// As [`run_spec_in_process`].
pub fn run_in_process(
    backend: Arc<dyn Backend>,
    world: usize,
    filter: Option<&str>,
) -> Result<Vec<ScenarioResult>> {
    let mut spec = RunSpec::new(backend.name(), world, Default::default())
        .with_filter(filter.map(str::to_string));
    if let Ok(v) = std::env::var("ACCEL_TIMEOUT") {
        spec.timeout = accel::state::parse_duration("ACCEL_TIMEOUT", &v)?;
    }
    spec.cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok());
    spec.seed = std::env::var("ACCEL_CONFORMANCE_SEED").ok();
    run_spec_in_process(backend, &spec).map(|(results, _)| results)
}

/// One world of the matrix with ranks as threads (`accel test` does this
/// for backends whose process model is ranks as threads, like xla): the
/// same report as [`run_world`](crate::harness::run_world) gives for a
/// world of processes.
pub fn run_world_in_process(backend: Arc<dyn Backend>, spec: &RunSpec) -> WorldReport {
    let start = Instant::now();
    let (results, seed, error) = match run_spec_in_process(backend, spec) {
        Ok((r, seed)) => (r, Some(seed.hex()), None),
        Err(e) => (Vec::new(), None, Some(e.to_string())),
    };
    WorldReport {
        label: spec.label(),
        results,
        error,
        seed,
        millis: start.elapsed().as_millis() as u64,
    }
}

/// [`run_in_process`] with the size, filter, bounds, depth and seed of
/// `spec` (its worker, plugin and launcher are not used); also returns the
/// seed the world used.
///
/// # Errors
/// A rank that could not connect (the backend's error), a rank thread
/// that panicked outside a scenario or ranks that disagree on the results
/// ([`ErrorKind::Internal`]), a seed that does not parse
/// ([`ErrorKind::InvalidConfig`]), or a world that outlived
/// `spec.hard_timeout` ([`ErrorKind::Timeout`]; its threads are left
/// behind).
pub fn run_spec_in_process(
    backend: Arc<dyn Backend>,
    spec: &RunSpec,
) -> Result<(Vec<ScenarioResult>, Seed)> {
    let world = spec.world_size;
    let seed = match &spec.seed {
        Some(s) => Seed::parse(s)
            .ok_or_else(|| Error::invalid_config("seed", s, "not a seed (64 hex digits)"))?,
        None => Seed::fresh(),
    };
    let cases = spec.cases.unwrap_or(16);
    let hard_timeout = spec.hard_timeout;
    // The rank threads are accel's in-process entry's; the world runs on a
    // thread of its own so that a world past its hard limit can be left
    // behind (a scenario that never returns) instead of hanging the caller.
    let threads = accel::Threads::new(world)
        .with_backend(backend.clone())
        .timeout(spec.timeout)
        .debug(false);
    let finished: Arc<Mutex<Vec<bool>>> = Arc::new(Mutex::new(vec![false; world]));
    let (tx, rx) = mpsc::channel();
    let (b, fin, filter) = (backend.clone(), finished.clone(), spec.filter.clone());
    std::thread::Builder::new()
        .name(format!("conformance {}@{world}", backend.name()))
        .spawn(move || {
            let out = threads.run(|acc| {
                let rank = acc.rank();
                let device = match b.device_kind() {
                    accel_api::DeviceKind::Cpu => Device::CPU,
                    kind => Device::new(kind, rank as u32),
                };
                let ctx = Ctx {
                    comm: acc.comm().clone(),
                    backend: b.clone(),
                    store: acc.store().clone(),
                    local_rank: acc.local_rank(),
                    local_world_size: world,
                    device,
                    cases,
                    seed,
                };
                let results = run_all(&ctx, filter.as_deref());
                fin.lock().unwrap_or_else(|p| p.into_inner())[rank] = true;
                Ok(results)
            });
            let _ = tx.send(out);
        })
        .map_err(|e| Error::io("spawning the rank threads' world", e))?;
    let per_rank = match rx.recv_timeout(hard_timeout) {
        Ok(out) => out?,
        Err(_) => {
            let done = finished.lock().unwrap_or_else(|p| p.into_inner());
            let missing: Vec<String> = (0..world)
                .filter(|&r| !done[r])
                .map(|r| r.to_string())
                .collect();
            return Err(Error::timeout(
                "conformance",
                hard_timeout,
                format!(
                    "rank thread(s) {} of {} did not finish",
                    missing.join(", "),
                    backend.name()
                ),
            ));
        }
    };
    let verdicts = |rs: &[ScenarioResult]| -> Vec<(String, Outcome)> {
        rs.iter()
            .map(|r| (r.name.clone(), r.outcome.clone()))
            .collect()
    };
    let mut ranks = per_rank.into_iter();
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
    Ok((first, seed))
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

/// What is wrong with a backend's in-process scenario list: every
/// scenario must be `listed` (run) or `skipped` with a reason, once. One
/// line per problem: the scenarios neither lists nor skips, names that
/// are no scenario, a skip without a reason, a scenario both run and
/// skipped. Empty when the list is complete.
pub fn scenario_list_gaps(listed: &[&str], skipped: &[(&str, &str)]) -> Vec<String> {
    let all: Vec<&str> = all_scenarios().iter().map(|s| s.name).collect();
    let skip_names: Vec<&str> = skipped.iter().map(|(n, _)| *n).collect();
    let mut gaps = Vec::new();
    let missing: Vec<&str> = all
        .iter()
        .copied()
        .filter(|n| !listed.contains(n) && !skip_names.contains(n))
        .collect();
    if !missing.is_empty() {
        gaps.push(format!(
            "neither run nor skipped: {} (list each, or skip it with a reason)",
            missing.join(", ")
        ));
    }
    let unknown: Vec<&str> = listed
        .iter()
        .chain(&skip_names)
        .copied()
        .filter(|n| !all.contains(n))
        .collect();
    if !unknown.is_empty() {
        gaps.push(format!("no such scenario: {}", unknown.join(", ")));
    }
    for (name, why) in skipped {
        if why.trim().is_empty() {
            gaps.push(format!("{name} is skipped without a reason"));
        }
        if listed.contains(name) {
            gaps.push(format!("{name} is both run and skipped"));
        }
    }
    gaps
}

/// Panic, naming `backend` and every gap, when its in-process list
/// (`listed` plus `skipped`) is not every scenario
/// ([`scenario_list_gaps`]); [`conformance_tests!`](crate::conformance_tests)
/// stamps this as a test.
///
/// # Panics
/// When the list has a gap.
pub fn assert_scenario_list(backend: Arc<dyn Backend>, listed: &[&str], skipped: &[(&str, &str)]) {
    let gaps = scenario_list_gaps(listed, skipped);
    assert!(
        gaps.is_empty(),
        "the in-process conformance list of {} is not every scenario:\n{}",
        backend.name(),
        gaps.join("\n")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<&'static str> {
        all_scenarios().iter().map(|s| s.name).collect()
    }

    #[test]
    fn every_scenario_listed_or_skipped_is_complete() {
        let all = names();
        assert_eq!(scenario_list_gaps(&all, &[]), Vec::<String>::new());
        let (skipped, listed) = all.split_at(2);
        let skips: Vec<(&str, &str)> = skipped.iter().map(|n| (*n, "not here")).collect();
        assert_eq!(scenario_list_gaps(listed, &skips), Vec::<String>::new());
    }

    #[test]
    fn the_gaps_name_the_missing_unknown_and_unreasoned() {
        let all = names();
        let listed: Vec<&str> = all[2..].iter().copied().chain(["no_such"]).collect();
        let gaps = scenario_list_gaps(&listed, &[(all[1], " "), (all[3], "why")]);
        let text = gaps.join("\n");
        assert!(
            text.contains(&format!("neither run nor skipped: {} (", all[0])),
            "{text}"
        );
        assert!(text.contains("no such scenario: no_such"), "{text}");
        assert!(
            text.contains(&format!("{} is skipped without a reason", all[1])),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} is both run and skipped", all[3])),
            "{text}"
        );
        assert_eq!(gaps.len(), 4, "{text}");
    }
}
