//! The multi-process harness: host a store, start one worker per rank with
//! the environment contract, bound the whole run, collect rank 0's results,
//! and print the matrix.

use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Outcome, ScenarioResult};

/// How the harness starts the ranks of a world.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Launcher {
    /// One process per rank, started by the harness with RANK, WORLD_SIZE
    /// and the rest of the environment contract.
    #[default]
    Direct,
    /// One `mpirun -n N` job (the `mpi` backend): MPI numbers the ranks and
    /// sets its own variables. Needs the `mpi` feature.
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
        }
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

    /// The matrix column label: `backend@N` (`+plugin` for plugins).
    pub fn label(&self) -> String {
        format!("{}@{}", self.backend, self.world_size)
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

fn token() -> String {
    let mut buf = [0u8; 16];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = f.read_exact(&mut buf);
    }
    let t: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    format!("{t}{:x}", std::process::id())
}

fn run_world_inner(spec: &RunSpec) -> Result<(Vec<ScenarioResult>, Option<String>), String> {
    let tok = token();
    let server = accel_rendezvous::TcpStoreServer::bind_loopback(0, Some(tok.clone()))
        .map_err(|e| format!("hosting the store: {e}"))?;
    let addr = server.local_addr();
    let dir = std::env::temp_dir().join(format!(
        "accel-conformance-{}-{}",
        std::process::id(),
        tok.get(..8).unwrap_or("x")
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let out = dir.join("results.json");
    let run_id = format!("{}-{}", spec.backend, spec.world_size);
    let mut children: Vec<(usize, Child, PathBuf)> = Vec::new();
    if spec.launcher == Launcher::Mpirun {
        let log = dir.join("mpirun.log");
        let logf =
            std::fs::File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
        let mut cmd = mpirun(spec)?;
        // The ranks inherit mpirun's environment; MPI sets their ranks.
        for v in [
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "ACCEL_LAUNCHER",
        ] {
            cmd.env_remove(v);
        }
        cmd.env("MASTER_ADDR", addr.ip().to_string())
            .env("MASTER_PORT", addr.port().to_string())
            .env("ACCEL_STORE_URL", format!("tcp://{addr}"))
            .env("ACCEL_RUN_TOKEN", &tok)
            .env("ACCEL_RUN_ID", &run_id)
            .env("ACCEL_BACKEND", &spec.backend)
            .env("ACCEL_TIMEOUT", format!("{}ms", spec.timeout.as_millis()))
            .env("ACCEL_CONFORMANCE_OUT", &out)
            .env("OMPI_MCA_mpi_yield_when_idle", "1")
            .env_remove("ACCEL_DEBUG")
            .stdin(Stdio::null())
            .stdout(logf.try_clone().map_err(|e| e.to_string())?)
            .stderr(logf);
        worker_options(spec, &mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting mpirun for {}: {e}", spec.worker.display()))?;
        children.push((0, child, log));
    }
    for rank in (0..spec.world_size).filter(|_| spec.launcher == Launcher::Direct) {
        let log = dir.join(format!("rank{rank}.log"));
        let logf =
            std::fs::File::create(&log).map_err(|e| format!("creating {}: {e}", log.display()))?;
        let mut cmd = Command::new(&spec.worker);
        cmd.env("RANK", rank.to_string())
            .env("WORLD_SIZE", spec.world_size.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", spec.world_size.to_string())
            .env("GROUP_RANK", "0")
            .env("MASTER_ADDR", addr.ip().to_string())
            .env("MASTER_PORT", addr.port().to_string())
            .env("ACCEL_STORE_URL", format!("tcp://{addr}"))
            .env("ACCEL_RUN_TOKEN", &tok)
            .env("ACCEL_RUN_ID", &run_id)
            .env("ACCEL_LAUNCHER", "accel")
            .env("ACCEL_BACKEND", &spec.backend)
            .env("ACCEL_TIMEOUT", format!("{}ms", spec.timeout.as_millis()))
            .env_remove("ACCEL_DEBUG")
            .stdin(Stdio::null())
            .stdout(logf.try_clone().map_err(|e| e.to_string())?)
            .stderr(logf);
        if rank == 0 {
            cmd.env("ACCEL_CONFORMANCE_OUT", &out);
        }
        worker_options(spec, &mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting {}: {e}", spec.worker.display()))?;
        children.push((rank, child, log));
    }
    let deadline = Instant::now() + spec.hard_timeout;
    let mut failure: Option<String> = None;
    let mut running: Vec<bool> = vec![true; children.len()];
    while running.iter().any(|r| *r) {
        for (i, (rank, child, log)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    running[i] = false;
                    if !status.success() && failure.is_none() {
                        failure = Some(format!(
                            "rank {rank} exited with {status}: {}",
                            tail(log, 15)
                        ));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failure.get_or_insert(format!("waiting for rank {rank}: {e}"));
                }
            }
        }
        if failure.is_some() || Instant::now() > deadline {
            if failure.is_none() {
                let hung: Vec<String> = children
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| running[*i])
                    .map(|(_, (r, _, log))| format!("rank {r}: {}", tail(log, 5)))
                    .collect();
                failure = Some(format!(
                    "world did not finish within {:?}; still running: {}",
                    spec.hard_timeout,
                    hung.join(" | ")
                ));
            }
            if spec.launcher == Launcher::Mpirun {
                // SIGTERM first: mpirun forwards it and reaps its ranks;
                // SIGKILL would leave them running.
                for (_, child, _) in children.iter_mut() {
                    let _ = Command::new("kill")
                        .args(["-TERM", &child.id().to_string()])
                        .status();
                    let end = Instant::now() + Duration::from_secs(5);
                    while Instant::now() < end && matches!(child.try_wait(), Ok(None)) {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            }
            for (_, child, _) in children.iter_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    server.shutdown();
    if let Some(f) = failure {
        return Err(f);
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

/// The options every worker gets, whatever starts it.
fn worker_options(spec: &RunSpec, cmd: &mut Command) {
    match &spec.plugin {
        Some(p) => cmd.env("ACCEL_PLUGIN_PATH", p),
        None => cmd.env_remove("ACCEL_PLUGIN_PATH"),
    };
    if let Some(f) = &spec.filter {
        cmd.env("ACCEL_CONFORMANCE_FILTER", f);
    }
    if let Some(c) = spec.cases {
        cmd.env("PROPTEST_CASES", c.to_string());
    }
    if let Some(s) = &spec.seed {
        cmd.env("ACCEL_CONFORMANCE_SEED", s);
    }
}

/// `mpirun -n N <worker>` with the flags this machine needs (the same
/// builder `accel launch --backend mpi` uses).
#[cfg(feature = "mpi")]
fn mpirun(spec: &RunSpec) -> Result<Command, String> {
    let mpi = accel_backend_mpi::MpirunSpec::new(spec.world_size, &spec.worker).tag_output(true);
    Ok(accel_backend_mpi::mpirun_command(&mpi))
}

#[cfg(not(feature = "mpi"))]
fn mpirun(_spec: &RunSpec) -> Result<Command, String> {
    Err("Launcher::Mpirun needs accel-conformance built with the `mpi` feature".into())
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
