//! `accel test`: run the conformance suite on backends and plugins at
//! several world sizes and print the matrix.

use std::path::PathBuf;
use std::process::ExitCode;

use accel::{Origin, Registry};
use accel_api::{Error, ErrorKind, ProbeContext, Result};
use accel_conformance::harness::{run_world, Launcher, Matrix, RunSpec};

/// Arguments of `accel test`.
#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// Backends to test: a name, a comma-separated list, or `all` (every
    /// compiled-in backend and every plugin given with --plugin).
    #[arg(long, default_value = "all")]
    backend: String,
    /// World sizes, comma-separated.
    #[arg(short = 'n', long = "num-processes", value_delimiter = ',', default_values_t = vec![1, 2, 3, 4])]
    sizes: Vec<usize>,
    /// A plugin shared object to load and test (repeatable).
    #[arg(long)]
    plugin: Vec<PathBuf>,
    /// Also write the matrix as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Only scenarios whose name contains this.
    #[arg(long)]
    filter: Option<String>,
    /// Property cases per scenario (PROPTEST_CASES; default 16).
    #[arg(long)]
    cases: Option<u32>,
    /// Replay a run: the seed it printed (64 hex digits).
    #[arg(long)]
    seed: Option<String>,
    /// Bound on every blocking call inside the workers.
    #[arg(long, default_value = "30s")]
    timeout: String,
    /// Hard bound on one world (backend x size); its workers are killed after it.
    #[arg(long, default_value = "300s")]
    world_timeout: String,
    /// The conformance worker binary (default: `accel-conformance-worker`
    /// next to this `accel` binary, or ACCEL_CONFORMANCE_WORKER).
    #[arg(long, env = "ACCEL_CONFORMANCE_WORKER")]
    worker: Option<PathBuf>,
}

fn find_worker(given: Option<PathBuf>) -> Result<PathBuf> {
    let path = match given {
        Some(p) => p,
        None => std::env::current_exe()
            .map_err(|e| Error::io("locating the accel binary", e))?
            .with_file_name("accel-conformance-worker"),
    };
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("conformance worker {} not found", path.display()),
        )
        .with_fix("build it with `cargo build -p accel-conformance` (make build does), or pass --worker PATH"))
    }
}

pub fn run(args: TestArgs) -> Result<ExitCode> {
    let worker = find_worker(args.worker)?;
    let timeout = accel::state::parse_duration("--timeout", &args.timeout)?;
    let world_timeout = accel::state::parse_duration("--world-timeout", &args.world_timeout)?;
    if args.sizes.is_empty() || args.sizes.contains(&0) {
        return Err(Error::invalid_config(
            "--num-processes",
            &format!("{:?}", args.sizes),
            "world sizes must be at least 1",
        ));
    }
    let mut registry = Registry::builtin();
    for p in &args.plugin {
        registry.load_plugins(&p.to_string_lossy());
    }
    if let Some(f) = registry.plugin_failures().first() {
        return Err(Error::new(
            ErrorKind::Plugin {
                path: f.path.clone(),
                symbol: None,
            },
            f.reason.clone(),
        ));
    }
    let wanted: Vec<String> = if args.backend == "all" {
        registry.names()
    } else {
        let names: Vec<String> = args
            .backend
            .split(',')
            .map(|s| s.trim().to_string())
            .collect();
        for n in &names {
            if registry.get(n).is_none() {
                return Err(Error::invalid_config(
                    "--backend",
                    n,
                    "no such backend is compiled in or loaded",
                )
                .with_fix(format!("choose from: {}", registry.names().join(", "))));
            }
        }
        names
    };
    let mut specs = Vec::new();
    let mut threads = Vec::new();
    let mut not_run = Vec::new();
    for name in &wanted {
        let entry = registry.get(name).expect("checked above");
        let plugin = match &entry.origin {
            Origin::Plugin(p) => Some(p.clone()),
            Origin::Builtin => None,
        };
        // xla runs ranks as threads of one process (ADR 0012): its worlds
        // run in this process, and its probe is asked for that model.
        let as_threads = name == "xla";
        if as_threads {
            std::env::set_var("ACCEL_PROCESS_MODEL", "threads");
        }
        for &n in &args.sizes {
            let mpi = name == "mpi";
            let probe = entry.backend.probe(&ProbeContext {
                world_size: n,
                local_world_size: n,
                mpi_launched: mpi,
                ranks_in_process: 1,
            });
            if let Some(reason) = probe.reason() {
                not_run.push(format!("{name}@{n}: not run: {reason}"));
                continue;
            }
            let mut spec = RunSpec::new(name, n, worker.clone())
                .with_plugin(plugin.clone())
                .with_filter(args.filter.clone());
            if mpi {
                spec = spec.with_launcher(Launcher::Mpirun);
            }
            spec.timeout = timeout;
            spec.hard_timeout = world_timeout;
            spec.cases = args.cases;
            spec.seed = args.seed.clone();
            if as_threads {
                threads.push((entry.backend.clone(), spec));
            } else {
                specs.push(spec);
            }
        }
    }
    let mut matrix = Matrix::default();
    for spec in &specs {
        eprintln!("accel test: running {} ...", spec.label());
        let w = run_world(spec);
        eprintln!(
            "accel test: {} done in {:.1} s{}",
            w.label,
            w.millis as f64 / 1000.0,
            w.error
                .as_deref()
                .map(|e| format!(" (world failed: {e})"))
                .unwrap_or_default()
        );
        matrix.worlds.push(w);
    }
    for (backend, spec) in &threads {
        eprintln!(
            "accel test: running {} (ranks as threads) ...",
            spec.label()
        );
        let w = accel_conformance::run_world_in_process(backend.clone(), spec);
        eprintln!(
            "accel test: {} done in {:.1} s",
            w.label,
            w.millis as f64 / 1000.0
        );
        matrix.worlds.push(w);
    }
    out!("{}", matrix.render());
    for line in &not_run {
        outln!("{line}");
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "matrix": matrix,
            "summary": matrix.summary(),
            "not_run": not_run,
        }))
        .expect("matrix serialises");
        std::fs::write(path, text)
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))?;
    }
    let s = matrix.summary();
    Ok(if s.failed == 0 && s.passed > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
