//! The multi-process harness: host a store, start the ranks through the
//! launch library (`accel-launch`: one process per rank, or one mpirun),
//! bound the whole run, collect rank 0's results, and print the matrix.
//!
//! A world may span several "machines" ([`RunSpec::with_machines`]): one
//! `accel_launch::Machines` coordinator per machine, all in this process on
//! loopback, machine 0 hosting the store, each starting its share of the
//! ranks, exactly as `accel launch --num-machines M` on M machines does.

use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use accel_launch::{
    HostedStore, LocalGroup, Machines, MachinesConfig, MpirunGroup, ProcessGroup, Program,
    Supervision,
};

use crate::{Outcome, ScenarioResult};

/// How the harness starts the ranks of a world.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Launcher {
    /// One process per rank, started by the harness with RANK, WORLD_SIZE
    /// and the rest of the environment contract.
    #[default]
    Direct,
    /// One `mpirun -n N` job (the `mpi` backend): MPI numbers the ranks and
    /// sets its own variables.
    Mpirun,
}

/// One world to run: a backend at a world size.
#[derive(Debug, Clone)]
pub struct RunSpec {
    /// Backend name (ACCEL_BACKEND).
    pub backend: String,
    /// Number of ranks.
    pub world_size: usize,
    /// The worker binary.
    pub worker: PathBuf,
    /// Plugin to load (ACCEL_PLUGIN_PATH).
    pub plugin: Option<PathBuf>,
    /// Only scenarios whose name contains this.
    pub filter: Option<String>,
    /// ACCEL_TIMEOUT for the world communicator.
    pub timeout: Duration,
    /// Hard bound on the whole world; workers are killed after it.
    pub hard_timeout: Duration,
    /// PROPTEST_CASES.
    pub cases: Option<u32>,
    /// Replay seed (64 hex digits).
    pub seed: Option<String>,
    /// How the ranks are started.
    pub launcher: Launcher,
    /// Machines the ranks are spread over, each with its own coordinator
    /// ([`RunSpec::with_machines`]); 1: one coordinator hosts the store.
    pub machines: usize,
}

impl RunSpec {
    /// A spec with default bounds (30 s per call, 300 s per world).
    pub fn new(backend: &str, world_size: usize, worker: PathBuf) -> RunSpec {
        RunSpec {
            backend: backend.to_string(),
            world_size,
            worker,
            plugin: None,
            filter: None,
            timeout: Duration::from_secs(30),
            hard_timeout: Duration::from_secs(300),
            cases: None,
            seed: None,
            launcher: Launcher::Direct,
            machines: 1,
        }
    }

    /// Builder: spread the ranks over `machines` "machines" (the world size
    /// divides by it), one `accel_launch::Machines` coordinator each, in
    /// this process on loopback: machine 0 hosts the store on a free port,
    /// the others join it, and every attempt begins with the machines'
    /// join, as under `accel launch --num-machines`. Direct launch only.
    pub fn with_machines(mut self, machines: usize) -> RunSpec {
        self.machines = machines;
        self
    }

    /// Builder: start the ranks with `launcher`.
    pub fn with_launcher(mut self, launcher: Launcher) -> RunSpec {
        self.launcher = launcher;
        self
    }

    /// Builder: load `plugin`.
    pub fn with_plugin(mut self, plugin: Option<PathBuf>) -> RunSpec {
        self.plugin = plugin;
        self
    }

    /// Builder: run only matching scenarios.
    pub fn with_filter(mut self, filter: Option<String>) -> RunSpec {
        self.filter = filter;
        self
    }

    /// The matrix column label: `backend@N`, or `backend@MxN` for N ranks
    /// on each of M machines.
    pub fn label(&self) -> String {
        match self.machines {
            0 | 1 => format!("{}@{}", self.backend, self.world_size),
            m => format!("{}@{m}x{}", self.backend, self.world_size / m),
        }
    }
}

/// The outcome of one world.
#[derive(Debug, Clone, serde::Serialize)]
pub struct WorldReport {
    /// Column label.
    pub label: String,
    /// Agreed per-scenario results (empty when the world failed to run).
    pub results: Vec<ScenarioResult>,
    /// Why the world as a whole failed (crash, hang, setup error), if it did.
    pub error: Option<String>,
    /// The seed the world used.
    pub seed: Option<String>,
    /// Wall time of the world.
    pub millis: u64,
}

/// Run one world. Never hangs: workers are killed after `hard_timeout`.
pub fn run_world(spec: &RunSpec) -> WorldReport {
    let start = Instant::now();
    let mut report = WorldReport {
        label: spec.label(),
        results: Vec::new(),
        error: None,
        seed: None,
        millis: 0,
    };
    match run_world_inner(spec) {
        Ok((results, seed)) => {
            report.results = results;
            report.seed = seed;
        }
        Err(e) => report.error = Some(e),
    }
    report.millis = start.elapsed().as_millis() as u64;
    report
}

fn run_world_inner(spec: &RunSpec) -> Result<(Vec<ScenarioResult>, Option<String>), String> {
    let tok = accel_launch::store::random_hex(16).map_err(|e| e.to_string())?;
    let dir = std::env::temp_dir().join(format!(
        "accel-conformance-{}-{}",
        std::process::id(),
        tok.get(..8).unwrap_or("x")
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let out = dir.join("results.json");
    if spec.machines > 1 {
        run_machines(spec, &dir, &tok, &out)?;
    } else {
        run_one(spec, &dir, &tok, &out)?;
    }
    let text =
        std::fs::read_to_string(&out).map_err(|e| format!("reading {}: {e}", out.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", out.display()))?;
    let results: Vec<ScenarioResult> = serde_json::from_value(v["results"].clone())
        .map_err(|e| format!("parsing {}: {e}", out.display()))?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok((results, v["seed"].as_str().map(str::to_string)))
}

/// The processes of one machine of `spec`'s world (`local` ranks): one
/// per rank, or one mpirun for them all. Rank 0 writes the results to
/// `out`.
fn world_group(spec: &RunSpec, local: usize, out: &Path) -> Box<dyn ProcessGroup> {
    use accel_launch::mpirun::{detect_flavor, MpirunSpec};
    let program = Program {
        path: spec.worker.clone(),
        argv0: spec.worker.clone().into_os_string(),
        args: Vec::new(),
    };
    let extra_env = worker_options(spec, out);
    // Only the plugin asked for (the harness's own environment may name
    // others), and no debug mode.
    let remove_env: Vec<String> = vec!["ACCEL_PLUGIN_PATH".into(), "ACCEL_DEBUG".into()];
    match spec.launcher {
        Launcher::Direct => Box::new(LocalGroup {
            program,
            local_world_size: local,
            extra_env,
            remove_env,
            die_with_parent: false,
        }),
        Launcher::Mpirun => {
            let launcher = MpirunSpec::new(local, &spec.worker).launcher;
            let flavor = detect_flavor(&launcher);
            let mut g = MpirunGroup::new(program, launcher, flavor, local);
            g.echo = false;
            g.extra_env = extra_env;
            g.remove_env = remove_env;
            g.extra_env
                .push(("OMPI_MCA_mpi_yield_when_idle".into(), "1".into()));
            Box::new(g)
        }
    }
}

/// What every worker of `spec`'s world shares (one machine's view).
fn world_env(spec: &RunSpec) -> accel::WorkerEnv {
    accel::WorkerEnv {
        world_size: Some(spec.world_size),
        local_world_size: Some(spec.world_size),
        group_rank: Some(0),
        group_world_size: Some(1),
        run_id: Some(format!("{}-{}", spec.backend, spec.world_size)),
        timeout: Some(spec.timeout),
        backend: Some(vec![spec.backend.clone()]),
        debug: Some(false),
        launcher: Some("accel".into()),
        ..accel::WorkerEnv::default()
    }
}

/// The supervision of a world: each rank's output in `dir`, the whole
/// world bounded by the hard timeout, nothing on the terminal.
fn world_supervision(spec: &RunSpec, dir: &Path) -> Supervision {
    Supervision {
        tee: Some(dir.to_path_buf()),
        wall_limit: Some(spec.hard_timeout),
        grace: Duration::from_secs(5),
        echo: false,
        forward_signals: false,
        ..Supervision::default()
    }
}

/// One machine: this process hosts the store ([`accel_launch::HostedStore`]).
fn run_one(spec: &RunSpec, dir: &Path, tok: &str, out: &Path) -> Result<(), String> {
    let mut group = world_group(spec, spec.world_size, out);
    let mut coord = HostedStore::new("127.0.0.1", 0, false, tok, world_env(spec));
    coord.scratch = dir.to_path_buf();
    coord.echo = false;
    let sup = world_supervision(spec, dir);
    let ran = accel_launch::run(&mut *group, &mut coord, &sup, &spec.label())
        .map_err(|e| format!("starting the world: {e}"))?;
    match ran.code {
        0 => Ok(()),
        _ => Err(world_failure(spec, dir, &ran, &*group)),
    }
}

/// Several machines on loopback, one [`Machines`] coordinator and one
/// group of `world_size / machines` ranks each, every machine on a thread
/// of its own: machine 0 hosts the store on a free port, the others join
/// it. Each machine's summary must say it was machine `k` of them all.
fn run_machines(spec: &RunSpec, dir: &Path, tok: &str, out: &Path) -> Result<(), String> {
    let m = spec.machines;
    if spec.launcher != Launcher::Direct || !spec.world_size.is_multiple_of(m) {
        return Err(format!(
            "{}: a world over {m} machines needs the direct launcher and a world size that \
             divides by the machines",
            spec.label()
        ));
    }
    let per = spec.world_size / m;
    let base = accel::WorkerEnv {
        local_world_size: Some(per),
        group_world_size: Some(m),
        ..world_env(spec)
    };
    let config = |machine_rank: usize, main_port: u16| MachinesConfig {
        machine_rank,
        nproc: per,
        num_machines: m,
        min_machines: m,
        join_window: Duration::from_secs(1),
        join_timeout: spec.timeout,
        timeout: spec.timeout,
        main_addr: "127.0.0.1".into(),
        main_port,
        run_id: base.run_id.clone(),
        max_restarts: 0,
        base: base.clone(),
        scratch: dir.join(format!("machine-{machine_rank}")),
        auto_rank: false,
        etcd: None,
    };
    let join = |k: usize, port: u16| {
        Machines::join(config(k, port), tok).map_err(|e| format!("machine {k}: {e}"))
    };
    let first = join(0, 0)?;
    let port = first.port();
    let mut coords = vec![first];
    for k in 1..m {
        coords.push(join(k, port)?);
    }
    let sup = Supervision {
        // The ranks that lost a machine's ranks say so themselves (as
        // `accel launch` on several machines).
        peer_drain: Some(Duration::from_secs(2)),
        ..world_supervision(spec, dir)
    };
    let ended: Vec<Result<(), String>> = std::thread::scope(|s| {
        let machines: Vec<_> = coords
            .into_iter()
            .enumerate()
            .map(|(k, mut coord)| {
                let sup = &sup;
                s.spawn(move || {
                    let mut group = world_group(spec, per, out);
                    let label = format!("{} machine {k}", spec.label());
                    let ran = accel_launch::run(&mut *group, &mut coord, sup, &label)
                        .map_err(|e| format!("machine {k}: starting the world: {e}"))?;
                    if ran.code != 0 {
                        return Err(world_failure(spec, dir, &ran, &*group));
                    }
                    let s = &ran.summary;
                    if (s.machine_rank, s.num_machines, s.world_size) != (k, m, spec.world_size) {
                        return Err(format!(
                            "machine {k} ran as machine {} of {} in a world of {} ranks",
                            s.machine_rank, s.num_machines, s.world_size
                        ));
                    }
                    Ok(())
                })
            })
            .collect();
        machines
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a machine's thread panicked".into()))
            })
            .collect()
    });
    ended.into_iter().collect()
}

/// Why a world that ran failed: the root cause and its rank's last lines,
/// the ranks' last lines after the hard timeout, or what the group said.
fn world_failure(
    spec: &RunSpec,
    dir: &Path,
    ran: &accel_launch::RunOutcome,
    group: &dyn ProcessGroup,
) -> String {
    match (&ran.root, &ran.why) {
        (Some(f), _) => format!(
            "{}: {}",
            f.headline(),
            tail(&dir.join(format!("rank-{}.log", f.rank)), 15)
        ),
        (None, Some(w)) if w.starts_with("wall limit") => {
            let logs: Vec<String> = (0..spec.world_size)
                .map(|r| format!("rank {r}: {}", tail(&dir.join(format!("rank-{r}.log")), 5)))
                .collect();
            format!(
                "world did not finish within {:?}; {}",
                spec.hard_timeout,
                logs.join(" | ")
            )
        }
        (None, w) => format!(
            "{} failed ({}): {}",
            group.kind(),
            w.as_deref().unwrap_or("exit code "),
            group.explain().join(" / ")
        ),
    }
}

/// The options every worker gets, whatever starts it (rank 0 writes the
/// results to `out`).
fn worker_options(spec: &RunSpec, out: &Path) -> Vec<(String, String)> {
    let mut v = vec![(
        "ACCEL_CONFORMANCE_OUT".to_string(),
        out.to_string_lossy().into_owned(),
    )];
    if let Some(p) = &spec.plugin {
        v.push(("ACCEL_PLUGIN_PATH".into(), p.to_string_lossy().into_owned()));
    }
    if let Some(f) = &spec.filter {
        v.push(("ACCEL_CONFORMANCE_FILTER".into(), f.clone()));
    }
    if let Some(c) = spec.cases {
        v.push(("PROPTEST_CASES".into(), c.to_string()));
    }
    if let Some(s) = &spec.seed {
        v.push(("ACCEL_CONFORMANCE_SEED".into(), s.clone()));
    }
    v
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join(" / ")
}

/// A scenario expected to fail on a backend (wgpu's `FailureCase`): the
/// matrix shows `xfail`; if it starts passing, the run fails so the entry
/// gets removed.
#[derive(Debug, Clone, Copy)]
pub struct KnownFailure {
    /// Backend name.
    pub backend: &'static str,
    /// Scenario name.
    pub scenario: &'static str,
    /// Why, with a link or issue.
    pub reason: &'static str,
}

/// The known failures. Empty: every backend passes everything it declares.
pub const KNOWN_FAILURES: &[KnownFailure] = &[];

/// The matrix of several worlds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Matrix {
    /// One entry per column.
    pub worlds: Vec<WorldReport>,
}

/// Counts over the whole matrix.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    /// Cells that passed.
    pub passed: usize,
    /// Cells that failed (including known failures that now pass, and
    /// worlds that crashed).
    pub failed: usize,
    /// Cells skipped for an undeclared capability.
    pub skipped: usize,
    /// Known failures that failed as expected.
    pub xfailed: usize,
}

impl Matrix {
    fn known(backend_label: &str, scenario: &str) -> Option<&'static KnownFailure> {
        let backend = backend_label.split('@').next().unwrap_or(backend_label);
        KNOWN_FAILURES
            .iter()
            .find(|k| k.backend == backend && k.scenario == scenario)
    }

    /// Run `specs` one world after another ([`run_world`]: each under its
    /// hard bound), printing each world's label, wall time and error, if
    /// any, on stderr.
    pub fn run(specs: &[RunSpec]) -> Matrix {
        Matrix::run_jobs(specs, 1)
    }

    /// [`Matrix::run`] with up to `jobs` worlds at a time (at least one).
    /// Worlds share nothing (each has its own store, directory and
    /// processes) and most of a world's time is waiting (process start,
    /// connection set-up, the failure scenarios' deliberate timeouts), so
    /// two or three at once finish the matrix sooner even on two cores. The
    /// worlds keep the order of `specs`; the stderr lines come as each world
    /// ends.
    pub fn run_jobs(specs: &[RunSpec], jobs: usize) -> Matrix {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Mutex, PoisonError};
        let next = AtomicUsize::new(0);
        let done: Vec<Mutex<Option<WorldReport>>> =
            specs.iter().map(|_| Mutex::new(None)).collect();
        let lane = || loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(spec) = specs.get(i) else { break };
            let w = run_world(spec);
            eprintln!(
                "{}: {} ms{}",
                w.label,
                w.millis,
                w.error
                    .as_deref()
                    .map(|e| format!(" ERROR {e}"))
                    .unwrap_or_default()
            );
            *done[i].lock().unwrap_or_else(PoisonError::into_inner) = Some(w);
        };
        std::thread::scope(|s| {
            for _ in 1..jobs.clamp(1, specs.len().max(1)) {
                s.spawn(lane);
            }
            lane();
        });
        // A lane that panicked has ended the scope with its panic, so every
        // slot is filled here.
        Matrix {
            worlds: done
                .into_iter()
                .map(|slot| {
                    slot.into_inner()
                        .unwrap_or_else(PoisonError::into_inner)
                        .expect("every world ran")
                })
                .collect(),
        }
    }

    /// Count the cells.
    pub fn summary(&self) -> Summary {
        let mut s = Summary::default();
        for w in &self.worlds {
            if w.error.is_some() {
                s.failed += 1;
                continue;
            }
            for r in &w.results {
                match (&r.outcome, Matrix::known(&w.label, &r.name)) {
                    (Outcome::Pass, None) => s.passed += 1,
                    (Outcome::Pass, Some(_)) => s.failed += 1,
                    (Outcome::Fail(_), Some(_)) => s.xfailed += 1,
                    (Outcome::Fail(_), None) => s.failed += 1,
                    (Outcome::Skip(_), _) => s.skipped += 1,
                }
            }
        }
        s
    }

    /// The matrix as text: rows are scenarios, columns worlds; then every
    /// failure's detail and the summary line `N passed, N failed, N skipped`.
    pub fn render(&self) -> String {
        let mut names: Vec<String> = Vec::new();
        for w in &self.worlds {
            for r in &w.results {
                if !names.contains(&r.name) {
                    names.push(r.name.clone());
                }
            }
        }
        let width = names.iter().map(String::len).max().unwrap_or(8).max(8);
        let cols: Vec<usize> = self.worlds.iter().map(|w| w.label.len().max(6)).collect();
        let mut out = String::new();
        let _ = write!(out, "{:width$}", "scenario");
        for (w, c) in self.worlds.iter().zip(&cols) {
            let _ = write!(out, "  {:>c$}", w.label);
        }
        out.push('\n');
        for name in &names {
            let _ = write!(out, "{name:width$}");
            for (w, c) in self.worlds.iter().zip(&cols) {
                let cell = match w.results.iter().find(|r| &r.name == name) {
                    None if w.error.is_some() => "CRASH".to_string(),
                    None => "-".to_string(),
                    Some(r) => match (&r.outcome, Matrix::known(&w.label, name)) {
                        (Outcome::Fail(_), Some(_)) => "xfail".into(),
                        (Outcome::Pass, Some(_)) => "XPASS".into(),
                        (Outcome::Skip(_), _) => "skip".into(),
                        (o, _) => o.cell(),
                    },
                };
                let _ = write!(out, "  {cell:>c$}");
            }
            out.push('\n');
        }
        let mut skips: Vec<String> = Vec::new();
        for w in &self.worlds {
            if let Some(e) = &w.error {
                let _ = writeln!(out, "\n{}: world failed: {e}", w.label);
            }
            for r in &w.results {
                match (&r.outcome, Matrix::known(&w.label, &r.name)) {
                    (Outcome::Fail(m), None) => {
                        let _ = writeln!(out, "\n{} {}: FAIL: {m}", w.label, r.name);
                    }
                    (Outcome::Pass, Some(k)) => {
                        let _ = writeln!(out, "\n{} {}: XPASS: known failure ({}) now passes; remove it from KNOWN_FAILURES", w.label, r.name, k.reason);
                    }
                    (Outcome::Skip(reason), _) => {
                        let line = format!("{} {}: skipped: {reason}", w.label, r.name);
                        skips.push(line);
                    }
                    _ => {}
                }
            }
        }
        if !skips.is_empty() {
            out.push('\n');
            for s in skips {
                let _ = writeln!(out, "{s}");
            }
        }
        let s = self.summary();
        let _ = writeln!(
            out,
            "\nconformance: {} passed, {} failed, {} skipped",
            s.passed, s.failed, s.skipped
        );
        if s.xfailed > 0 {
            let _ = writeln!(out, "({} known failures failed as expected)", s.xfailed);
        }
        out
    }
}

/// The matrix's CPU columns for `worker`, in the matrix's order:
/// `single@1`, `vendor-single@1` (the vendor plugin example), with
/// cpu-gloo compiled in `cpu-gloo@1-4` and `cpu-gloo-plugin@1-4`, and with
/// mpi compiled in `mpi@1-4` under `mpirun` (left out, with a line on
/// stderr, where `mpirun` does not run; outside CI only, see
/// [`mpirun_available`]). Builds the two plugins with
/// [`build_cdylibs`] into `target_dir`.
///
/// # Errors
/// A plugin that does not build.
pub fn cpu_columns(
    worker: &Path,
    workspace: &Path,
    target_dir: &Path,
) -> Result<Vec<RunSpec>, String> {
    let mut packages = vec!["accel-vendor-plugin"];
    if cfg!(feature = "cpu-gloo") {
        packages.push("accel-cpu-gloo-plugin");
    }
    let built = build_cdylibs(workspace, target_dir, &packages)?;
    let find = |stem: &str| {
        built
            .iter()
            .find(|p| {
                p.file_name()
                    .and_then(|f| f.to_str())
                    .is_some_and(|f| f.contains(stem))
            })
            .cloned()
            .ok_or_else(|| format!("no {stem} plugin was built"))
    };
    let worker = worker.to_path_buf();
    let mut specs = vec![RunSpec::new("single", 1, worker.clone())];
    specs.push(
        RunSpec::new("vendor-single", 1, worker.clone())
            .with_plugin(Some(find("accel_vendor_plugin")?)),
    );
    if cfg!(feature = "cpu-gloo") {
        let gloo_plugin = find("accel_cpu_gloo_plugin")?;
        for n in 1..=4 {
            specs.push(RunSpec::new("cpu-gloo", n, worker.clone()));
        }
        for n in 1..=4 {
            specs.push(
                RunSpec::new("cpu-gloo-plugin", n, worker.clone())
                    .with_plugin(Some(gloo_plugin.clone())),
            );
        }
    }
    if cfg!(feature = "mpi") {
        if mpirun_available() {
            for n in 1..=4 {
                specs.push(RunSpec::new("mpi", n, worker.clone()).with_launcher(Launcher::Mpirun));
            }
        } else {
            eprintln!("mpi columns skipped: mpirun not found (make setup installs Open MPI)");
        }
    }
    Ok(specs)
}

/// The MPI launcher the mpi columns use (`ACCEL_MPIRUN`, else `mpirun`)
/// answers `--version` (Open MPI or MPICH installed).
///
/// # Panics
/// When it does not run under make test or CI (`ACCEL_TEST_STRICT` or
/// `CI` set): both run `make setup`, which installs Open MPI, and a
/// missing column is not a pass.
pub fn mpirun_available() -> bool {
    let ok = accel_launch::mpirun::available();
    let strict = std::env::var_os("CI").is_some()
        || std::env::var("ACCEL_TEST_STRICT").is_ok_and(|v| !v.is_empty() && v != "0");
    assert!(
        ok || !strict,
        "mpirun not found, but make test and CI run `make setup`, which installs Open MPI"
    );
    ok
}

/// Build workspace cdylib packages and return their `.so` paths, using the
/// same cargo and target directory as the calling test (`target_dir`).
/// Bounded by 600 s.
pub fn build_cdylibs(
    workspace: &Path,
    target_dir: &Path,
    packages: &[&str],
) -> Result<Vec<PathBuf>, String> {
    let args: Vec<&str> = packages.iter().flat_map(|p| ["-p", *p]).collect();
    Ok(cargo_build(workspace, target_dir, &args)?
        .into_iter()
        .filter(|f| f.extension().is_some_and(|e| e == "so"))
        .collect())
}

/// Run `cargo build ARGS` on `workspace` into `target_dir` (tests pass
/// their own target directory, so nothing is built twice) and return every
/// file cargo reports producing: libraries and executables. Bounded by
/// 600 s; cargo's own error output on failure.
pub fn cargo_build(
    workspace: &Path,
    target_dir: &Path,
    args: &[&str],
) -> Result<Vec<PathBuf>, String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.arg("build")
        .arg("--manifest-path")
        .arg(workspace.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--message-format=json-render-diagnostics")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| format!("running cargo: {e}"))?;
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = so.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = se.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(st) = child.try_wait().map_err(|e| e.to_string())? {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "cargo build {} took more than 600 s",
                args.join(" ")
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = t_out.join().unwrap_or_default();
    let stderr = t_err.join().unwrap_or_default();
    if !status.success() {
        return Err(format!("cargo build {} failed: {stderr}", args.join(" ")));
    }
    let mut found = Vec::new();
    for line in stdout.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["reason"] != "compiler-artifact" {
            continue;
        }
        if let Some(exe) = v["executable"].as_str() {
            found.push(PathBuf::from(exe));
        }
        if let Some(files) = v["filenames"].as_array() {
            found.extend(files.iter().filter_map(|f| f.as_str()).map(PathBuf::from));
        }
    }
    Ok(found)
}
