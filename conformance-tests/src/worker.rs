//! One rank of a conformance run, as a library: what the
//! `accel-conformance-worker` binary runs ([`main`]), and what a
//! framework's own test binary runs with its scenarios
//! ([`main_with`], e.g. accel-candle's with a candle model's). Started by
//! the harness (or `accel launch`, `mpirun`, `srun`) with the usual
//! environment contract; selects the backend named by ACCEL_BACKEND
//! (plugins from ACCEL_PLUGIN_PATH), runs the scenarios, and rank 0 writes
//! the agreed results as JSON to ACCEL_CONFORMANCE_OUT (or stdout).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use accel::{ProcessState, Registry};
use accel_api::{ConnectContext, Store, StoreExt};
use accel_rendezvous::PrefixStore;

use crate::{all_scenarios, run_scenarios, Ctx, Scenario, Seed};

/// The environment variable the harness sets for every worker it starts
/// (where rank 0 writes the results): a test binary that doubles as its
/// own worker tells the two roles apart by it.
pub const OUT_ENV: &str = "ACCEL_CONFORMANCE_OUT";

/// The worker over the whole library ([`all_scenarios`]).
pub fn main() -> ExitCode {
    main_with(&all_scenarios())
}

/// The worker over `scenarios`: install accel's panic hook, run this
/// rank, and exit 0, or 2 after printing the error.
pub fn main_with(scenarios: &[Scenario]) -> ExitCode {
    accel::install_panic_hook();
    match run(scenarios) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("accel-conformance-worker: {e}");
            ExitCode::from(2)
        }
    }
}

fn run(scenarios: &[Scenario]) -> accel_api::Result<()> {
    let state = Arc::new(ProcessState::from_env()?);
    let registry = Registry::from_env();
    let (backend, device) = registry.select_for(&state)?;
    let root = state.open_store()?;
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(
        root,
        format!("conformance/{}", state.run_id),
    ));

    let seed = if state.rank == 0 {
        let seed = std::env::var("ACCEL_CONFORMANCE_SEED")
            .ok()
            .and_then(|s| Seed::parse(&s))
            .unwrap_or_else(Seed::fresh);
        store.set("seed", seed.hex().as_bytes())?;
        seed
    } else {
        let hex = store.get_string("seed", state.timeout)?;
        Seed::parse(&hex).ok_or_else(|| {
            accel_api::Error::new(
                accel_api::ErrorKind::Corrupt,
                format!("store key `seed` holds {hex:?}"),
            )
        })?
    };
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);

    let comm = backend.connect(ConnectContext {
        rank: state.rank,
        world_size: state.world_size,
        local_rank: state.local_rank,
        local_world_size: state.local_world_size,
        device,
        timeout: state.timeout,
        store: Arc::new(PrefixStore::new(store.clone(), "world")),
        run_id: state.run_id.clone(),
    })?;
    let ctx = Ctx {
        comm: Arc::from(comm),
        backend,
        store: store.clone(),
        local_rank: state.local_rank,
        local_world_size: state.local_world_size,
        device,
        cases,
        seed,
    };
    let filter = std::env::var("ACCEL_CONFORMANCE_FILTER")
        .ok()
        .filter(|f| !f.is_empty());
    let results = run_scenarios(&ctx, scenarios, filter.as_deref());
    // Nobody leaves (closing its sockets) before everyone is done.
    store.barrier(
        "finished",
        state.world_size,
        state.timeout + Duration::from_secs(30),
    )?;
    if state.rank == 0 {
        let json = serde_json::json!({ "seed": seed.hex(), "cases": cases, "results": results });
        let text = serde_json::to_string_pretty(&json).expect("results serialise");
        match std::env::var_os(OUT_ENV) {
            Some(path) => {
                let tmp = std::path::PathBuf::from(format!("{}.tmp", path.to_string_lossy()));
                std::fs::write(&tmp, text)
                    .map_err(|e| accel_api::Error::io("writing results", e))?;
                std::fs::rename(&tmp, &path)
                    .map_err(|e| accel_api::Error::io("writing results", e))?;
            }
            None => println!("{text}"),
        }
    }
    Ok(())
}

/// A framework's conformance test binary (`harness = false`), whole: as a
/// worker (under [`OUT_ENV`]) it runs `M`'s model scenarios on one rank;
/// as a test it answers libtest's `--list` and name filters for its one
/// test `{framework}_conformance_matrix`, runs the scenarios on every CPU
/// column of the matrix ([`harness::cpu_columns`](crate::harness::cpu_columns))
/// with itself as the worker, prints the matrix, and fails on any failure
/// or any column that did not run every scenario. `workspace` is the
/// repository root, `target` the cargo target folder.
pub fn framework_main<M: crate::ScenarioModel>(
    framework: &str,
    workspace: &std::path::Path,
    target: &std::path::Path,
) -> ExitCode {
    let scenarios = crate::model_scenarios::<M>();
    if std::env::var_os(OUT_ENV).is_some() {
        return main_with(&scenarios); // one rank
    }
    let name = format!("{framework}_conformance_matrix");
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("{name}: test");
        return ExitCode::SUCCESS;
    }
    // `cargo test -p accel-candle zero` runs every test binary with the
    // filter `zero`: one that is not part of the name skips it.
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
        println!("{name}: filtered out");
        return ExitCode::SUCCESS;
    }
    let me = std::env::current_exe().expect("the test binary's path");
    let specs =
        crate::harness::cpu_columns(&me, workspace, target).unwrap_or_else(|e| panic!("{e}"));
    let matrix = crate::harness::Matrix::run_jobs(&specs, 3);
    println!("{}", matrix.render());
    let s = matrix.summary();
    let names = scenarios.len();
    let ok = s.failed == 0 && s.passed > 0;
    // Every column ran every scenario (a world that did not run would
    // count nothing, neither pass nor failure).
    let complete = matrix.worlds.iter().all(|w| w.results.len() == names);
    if !ok || !complete {
        eprintln!(
            "{framework} conformance: {} failed, {} passed; every column ran all {names} scenarios: {complete}",
            s.failed, s.passed
        );
        return ExitCode::FAILURE;
    }
    println!(
        "{framework} conformance: {} passed, {} skipped over {} columns",
        s.passed,
        s.skipped,
        specs.len()
    );
    ExitCode::SUCCESS
}
