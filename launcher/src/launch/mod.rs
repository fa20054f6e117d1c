//! `accel launch`: start N workers on this machine (and join M machines),
//! host the rendezvous store, prefix their output, stop the group when one
//! fails and say why, restart on request.
//!
//! | module | does |
//! |---|---|
//! | [`options`] | flags, environment and config layers → [`options::Settings`] |
//! | [`config`] | the TOML config file (read, check, render) |
//! | [`program`] | find the program before spawning anything |
//! | [`store`] | bind and host the store on machine 0 |
//! | [`machines`] | how several machines' launchers agree on a run |
//! | [`spawn`] | the workers' environment contract, process groups |
//! | [`output`] | whole-line `[rank N]` prefixing, `--tee`, stderr tails |
//! | [`supervise`] | one attempt: watch, stop on failure, forward signals, hangs |
//! | [`report`] | root-cause block, summary, `--json` |
//! | [`mpi`] | `--backend mpi`: delegate to the system's mpirun (feature `mpi`) |
//!
//! # Environment contract
//!
//! Every worker gets, on top of the launcher's environment: `RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `GROUP_WORLD_SIZE`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `ACCEL_LAUNCHER=accel`, `ACCEL_STORE_URL=tcp://addr:port`,
//! `ACCEL_RUN_ID`, `ACCEL_RUN_TOKEN`, `ACCEL_TIMEOUT`, `ACCEL_DEBUG` (0/1),
//! `ACCEL_RESTART_COUNT`, `ACCEL_ERROR_FILE`, `ACCEL_BACKEND` (when chosen),
//! and torchrun's `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`,
//! `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_ERROR_FILE`. A unit test feeds
//! them to `accel::ProcessState::from_vars`, the runtime's own reader.
//!
//! # Decisions
//!
//! * `-n` counts processes **per machine** (torchrun's `--nproc-per-node`);
//!   Accelerate's `--num_processes` counts all machines together. Every
//!   machine must run the same number: the world size a machine claims is
//!   `-n × --num-machines`, and machine 0 refuses a machine whose claim
//!   differs from its own.
//! * Precedence: flags, then `ACCEL_RUN_TOKEN` / `ACCEL_TIMEOUT` /
//!   `ACCEL_BACKEND` / `ACCEL_DEBUG`, then the config file (only with
//!   `--config` or `ACCEL_CONFIG_FILE`; no file is read implicitly), then
//!   the defaults.
//! * One machine: the store binds 127.0.0.1 with a generated token; an
//!   explicit `--main-process-port` that is busy falls back to a free port
//!   with a notice. Several machines: the given address and port exactly
//!   (default port 29500; 0 refused), a busy port is an error naming it, and
//!   a token is required.
//! * Hangs: the runtime bounds every blocking call by `ACCEL_TIMEOUT`
//!   (`--timeout`), so a collective that never completes becomes an error
//!   exit naming the peer, which the launcher reports like any failure. The
//!   launcher does not guess from silence by default (a quiet training
//!   step is not a hang); `--hang-timeout DUR` opts in to reporting workers
//!   that print nothing for DUR as hung (exit code 124, all hung ranks
//!   named).
//! * Restarts restart the whole group. On one machine each attempt gets a
//!   fresh store (and port), so no key of a failed attempt survives. Across
//!   machines the store is machine 0's for the whole run: launcher keys are
//!   per attempt, and worker keys of a failed attempt stay; the runtime's
//!   `Accelerator` scopes its keys by run id and `ACCEL_RESTART_COUNT`
//!   (`accel/{run_id}/{restart}/...`), so they cannot collide. Machine 0's
//!   `--max-restarts` rules every machine. A Ctrl-C on any machine stops
//!   the run everywhere, without restarts.
//! * Exit codes: the root-cause worker's code, 128 + signal when a signal
//!   killed it, 124 for a hang, 128 + signal when the launcher itself was
//!   interrupted, 127 / 126 for a program that is missing / not executable
//!   (checked before anything starts), 2 for configuration mistakes.
//! * `--backend mpi` (cargo feature `mpi`, on by default) hands the ranks
//!   to the system's `mpirun` / `mpiexec` (`ACCEL_MPIRUN` overrides it):
//!   `-n × --num-machines` ranks, numbered by MPI, with the store, token,
//!   run id, timeout, restart count and error file in their environment
//!   (not `RANK` & co., which MPI sets). Output keeps the `[rank N]`
//!   prefixes, rank filter and `--tee`; mpirun's own lines show as
//!   `[mpirun] ...` and feed the root-cause block. The exit code is
//!   mpirun's; signals reach mpirun as SIGTERM (SIGKILL after the grace
//!   period); restarts rerun mpirun. On several machines only machine 0
//!   launches, with `--mpi-hosts` or `--hostfile`; other machine ranks are
//!   refused with a message saying so. Details in [`mpi`].
//! * Only a run of a single process inherits the terminal's stdin; with
//!   several, stdin is /dev/null.
//! * Workers run in their own process groups, so stopping one also stops
//!   what it started; the launcher cannot make the kernel kill them if the
//!   launcher itself is SIGKILLed (that needs `PR_SET_PDEATHSIG` in
//!   `pre_exec`, which is unsafe code, forbidden in this crate).

pub mod config;
pub mod machines;
pub mod mpi;
pub mod options;
pub mod output;
pub mod program;
pub mod report;
pub mod spawn;
pub mod store;
pub mod supervise;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{Error, ErrorKind, Result, Store};
use accel_rendezvous::{TcpStore, TcpStoreServer};

use machines::{Global, Registration, Watcher};
use options::{Options, Settings};
use output::{print_stdout, say};
use report::{AttemptReport, Exit, Failure, Status, Summary};
use spawn::RunEnv;
use supervise::{run_attempt, AttemptSpec, Event, LocalOutcome, LAST_SIGNAL};

/// Arguments of `accel launch`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  accel launch -n 4 -- ./train --epochs 3\n  \
                  accel launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --token $TOKEN -n 8 -- ./train\n\n\
                  Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, \
                  MASTER_PORT and the ACCEL_* variables (store URL and token, run id, timeout, backend, debug, \
                  restart count, error file)."
)]
pub struct LaunchArgs {
    #[command(flatten)]
    options: Options,

    /// TOML config file (write one with `accel config`); flags override it.
    #[arg(long, env = "ACCEL_CONFIG_FILE", value_name = "FILE")]
    config: Option<PathBuf>,

    /// --backend mpi on several machines: the machines mpirun starts ranks
    /// on, `host[:slots],...` (slots default to -n).
    #[arg(long, env = "ACCEL_MPI_HOSTS", value_name = "HOSTS")]
    mpi_hosts: Option<String>,

    /// --backend mpi on several machines: a hostfile in mpirun's format
    /// (instead of --mpi-hosts).
    #[arg(long, env = "ACCEL_MPI_HOSTFILE", value_name = "FILE")]
    hostfile: Option<PathBuf>,

    /// Print a JSON summary of the run on stdout when it ends.
    #[arg(long)]
    json: bool,

    /// torchrun's --standalone: one machine, a free port (the default).
    #[arg(long)]
    standalone: bool,

    /// The program to run and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<OsString>,
}

/// What one machine needs to reach the store and agree with the others.
enum Coordination {
    /// One machine: a fresh store per attempt, nothing to agree on.
    Single,
    /// Machine 0 of several: hosts the store for the whole run.
    Host {
        server: TcpStoreServer,
        store: Arc<dyn Store>,
    },
    /// Another machine: a client of machine 0's store.
    Member { store: Arc<dyn Store> },
}

impl Coordination {
    fn store(&self) -> Option<&Arc<dyn Store>> {
        match self {
            Coordination::Single => None,
            Coordination::Host { store, .. } | Coordination::Member { store } => Some(store),
        }
    }
}

fn host_name() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into())
}

fn install_signals(tx: Sender<Event>) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| Error::io("cannot install the signal handlers", e))?;
    std::thread::Builder::new()
        .name("accel-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                LAST_SIGNAL.store(sig, Ordering::SeqCst);
                if tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| Error::io("cannot start the signal thread", e))?;
    Ok(())
}

fn layered(args: &LaunchArgs) -> Result<Settings> {
    let file = match &args.config {
        Some(p) => config::read(p)?,
        None => Options::default(),
    };
    let env = Options::from_env(|k| std::env::var(k).ok())?;
    let mut o = args.options.clone().overlay(env).overlay(file);
    if args.standalone {
        if o.num_machines.is_some_and(|m| m > 1) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "--standalone runs on one machine, but --num-machines is more than 1",
            ));
        }
        o.num_machines = Some(1);
        o.machine_rank = Some(0);
    }
    Settings::resolve(o)
}

/// Run `accel launch`.
///
/// # Errors
/// Configuration errors (exit code 2) and failures to host or reach the
/// store; worker failures are not errors but exit codes.
pub fn run(args: LaunchArgs) -> Result<ExitCode> {
    match launch(args) {
        // An error caused by Ctrl-C (e.g. during the machines' join) exits
        // like an interrupted run.
        Err(e) if LAST_SIGNAL.load(Ordering::SeqCst) != 0 => {
            eprintln!("accel: error: {e}");
            let sig = LAST_SIGNAL.load(Ordering::SeqCst);
            Ok(ExitCode::from(u8::try_from(128 + sig).unwrap_or(1)))
        }
        other => other,
    }
}

fn launch(args: LaunchArgs) -> Result<ExitCode> {
    let t0 = Instant::now();
    let s = layered(&args)?;
    if mpi::requested(&s) {
        return mpi::launch(&s, &args);
    }
    let argv0 = args.command[0].clone();
    let program = match program::resolve(&argv0, std::env::var_os("PATH").as_deref()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("accel: error: {e}");
            return Ok(ExitCode::from(e.exit_code()));
        }
    };
    let host = host_name();
    let (tx, rx) = channel::<Event>();
    install_signals(tx.clone())?;

    // The token: given, or generated for a run on one machine.
    let token = match &s.token {
        Some(t) => t.clone(),
        None => store::random_hex(16)?,
    };
    let me = Registration {
        machine_rank: s.machine_rank,
        nproc: s.nproc,
        num_machines: s.num_machines,
        world_size: s.world_size_claim(),
        run_id: s.run_id.clone(),
        host: host.clone(),
        pid: std::process::id(),
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let coord = if !s.multi_machine() {
        Coordination::Single
    } else if s.machine_rank == 0 {
        let (server, _) = store::host(&s.main_addr, s.main_port, true, &token)?;
        let store: Arc<dyn Store> = server.store().clone();
        Coordination::Host { server, store }
    } else {
        let addr = if s.main_addr.contains(':') && !s.main_addr.starts_with('[') {
            format!("[{}]:{}", s.main_addr, s.main_port) // IPv6
        } else {
            format!("{}:{}", s.main_addr, s.main_port)
        };
        let c = TcpStore::connect(addr.as_str(), Some(&token), s.join_timeout).map_err(|e| {
            if matches!(e.kind(), ErrorKind::Unauthorized) {
                Error::new(
                    ErrorKind::Unauthorized,
                    format!(
                        "machine {} cannot join the run: machine 0's store at {addr} refused \
                         this machine's token",
                        s.machine_rank
                    ),
                )
                .with_op("machine join")
                .with_fix("pass the same --token (or ACCEL_RUN_TOKEN, or `token` in the config file) on every machine")
                .with_source(e)
            } else {
                e.with_op("machine join")
            }
        })?;
        Coordination::Member { store: Arc::new(c) }
    };
    let mut run_id = match (&coord, &s.run_id) {
        (Coordination::Member { .. }, _) => String::new(), // machine 0 decides
        (_, Some(id)) => id.clone(),
        (_, None) => store::random_hex(6)?,
    };
    let scratch = std::env::temp_dir().join(format!(
        "accel-{}-{}",
        std::process::id(),
        store::random_hex(4)?
    ));

    let mut reports: Vec<AttemptReport> = Vec::new();
    let mut attempt: u32 = 0;
    let mut max_restarts = s.max_restarts;
    let mut world_size = s.world_size_claim();
    let mut store_url = String::new();
    let code: u8 = loop {
        if let Some(sig) = Some(LAST_SIGNAL.load(Ordering::SeqCst)).filter(|&x| x != 0) {
            break u8::try_from(128 + sig).unwrap_or(1);
        }
        let a0 = Instant::now();
        // Where the store is, and (several machines) what was agreed.
        let mut single_server: Option<TcpStoreServer> = None;
        let (rank_offset, master_port) = match &coord {
            Coordination::Single => {
                // A fresh store per attempt: no key of a failed attempt can
                // confuse the next one.
                let (server, notice) = store::host(&s.main_addr, s.main_port, false, &token)?;
                if let Some(n) = notice.filter(|_| attempt == 0) {
                    say(&n);
                }
                let port = server.local_addr().port();
                single_server = Some(server);
                (0, port)
            }
            Coordination::Host { store, .. } => {
                let plan = machines::host_join(
                    &**store,
                    &me,
                    &run_id,
                    s.max_restarts,
                    attempt,
                    s.join_timeout,
                )?;
                world_size = plan.world_size;
                (0, s.main_port)
            }
            Coordination::Member { store } => {
                let plan = machines::member_join(&**store, &me, attempt, s.join_timeout)?;
                run_id = plan.run_id.clone();
                world_size = plan.world_size;
                max_restarts = plan.max_restarts;
                let off = plan
                    .machines
                    .get(s.machine_rank)
                    .map(|m| m.rank_offset)
                    .unwrap_or(s.machine_rank * s.nproc);
                (off, s.main_port)
            }
        };
        let env = RunEnv {
            world_size,
            local_world_size: s.nproc,
            rank_offset,
            machine_rank: s.machine_rank,
            num_machines: s.num_machines,
            master_addr: s.main_addr.clone(),
            master_port,
            token: Some(token.clone()),
            run_id: run_id.clone(),
            timeout: s.timeout,
            backend: s.backend.clone(),
            debug: s.debug,
            restart_count: attempt,
            max_restarts,
            error_dir: scratch.join(format!("attempt-{attempt}")),
        };
        store_url = env.store_url();
        let spec = AttemptSpec {
            program: &program,
            argv0: &argv0,
            args: &args.command[1..],
            env: &env,
            host: &host,
            ranks: s.ranks.as_ref(),
            tee: s.tee.as_deref(),
            grace: s.grace,
            hang_timeout: s.hang_timeout,
        };
        let watcher = coord
            .store()
            .map(|st| Watcher::start(st.clone(), attempt, s.machine_rank, tx.clone()));
        let shared = coord.store().cloned();
        let mut publish = |f: &Failure| {
            if let Some(st) = &shared {
                machines::publish_failure(&**st, attempt, f);
            }
        };
        let result = run_attempt(&spec, attempt, &tx, &rx, t0, &mut publish);
        if let Some(w) = watcher {
            w.stop();
        }
        let result = result?;
        drop(single_server);

        // The outcome of the attempt across machines.
        let (status, root, interrupted_by) = match (&coord, result.outcome) {
            (_, LocalOutcome::Interrupted(sig)) => {
                if let Some(st) = coord.store() {
                    let f = interruption(&env, &host, sig);
                    machines::publish_failure(&**st, attempt, &f);
                    let _ = machines::settle(&**st, attempt, s.machine_rank, s.num_machines, false);
                }
                (Status::Interrupted, None, Some(report::signal_name(sig)))
            }
            (Coordination::Single, LocalOutcome::Succeeded) => (Status::Succeeded, None, None),
            (Coordination::Single, LocalOutcome::Failed(f)) => (Status::Failed, Some(*f), None),
            (Coordination::Single, other) => {
                // Remote failures and a lost store cannot happen on one machine.
                (Status::Failed, None, Some(format!("{other:?}")))
            }
            (_, LocalOutcome::StoreLost(m)) => {
                (Status::Failed, None, Some(format!("lost store: {m}")))
            }
            (_, local) => {
                let st = coord.store().map(Arc::clone);
                let ok = matches!(local, LocalOutcome::Succeeded);
                let g = match &st {
                    Some(st) => {
                        machines::settle(&**st, attempt, s.machine_rank, s.num_machines, ok)
                    }
                    None => Global::StoreLost("no store".into()),
                };
                match (g, local) {
                    (Global::Succeeded, _) => (Status::Succeeded, None, None),
                    (Global::Failed(f), _) => {
                        if f.interrupted {
                            (
                                Status::Interrupted,
                                Some(*f),
                                Some("another machine's launcher".into()),
                            )
                        } else {
                            (Status::Failed, Some(*f), None)
                        }
                    }
                    (Global::StoreLost(m), LocalOutcome::Failed(f) | LocalOutcome::Remote(f)) => {
                        say(&format!("lost the store on machine 0: {m}"));
                        (Status::Failed, Some(*f), None)
                    }
                    (Global::StoreLost(m), _) => {
                        (Status::Failed, None, Some(format!("lost store: {m}")))
                    }
                }
            }
        };
        // Waiting for the other machines was cut short by a signal.
        let (status, interrupted_by) = match status {
            Status::Failed if root.is_none() && LAST_SIGNAL.load(Ordering::SeqCst) != 0 => (
                Status::Interrupted,
                Some(report::signal_name(LAST_SIGNAL.load(Ordering::SeqCst))),
            ),
            other => (other, interrupted_by),
        };
        let report = AttemptReport {
            attempt,
            status: status.clone(),
            duration_s: a0.elapsed().as_secs_f64(),
            root_cause: root.clone(),
            workers: result.workers,
            killed: result.killed,
            interrupted_by: interrupted_by.clone(),
        };
        reports.push(report);
        match status {
            Status::Succeeded => break 0,
            Status::Interrupted => {
                let sig = LAST_SIGNAL.load(Ordering::SeqCst);
                if let Some(f) = &root {
                    say(&format!(
                        "the run was stopped on machine {} ({})",
                        f.machine,
                        f.error.as_deref().unwrap_or("interrupted")
                    ));
                }
                break if sig != 0 {
                    u8::try_from(128 + sig).unwrap_or(1)
                } else {
                    root.map(|f| f.exit.launcher_code()).unwrap_or(130)
                };
            }
            Status::Failed => {
                let code = match &root {
                    Some(f) => {
                        f.print(attempt);
                        f.exit.launcher_code()
                    }
                    None => {
                        say(&format!(
                            "attempt {attempt} failed: {}",
                            interrupted_by.as_deref().unwrap_or("unknown cause")
                        ));
                        1
                    }
                };
                let store_lost = root.is_none();
                if attempt < max_restarts && !store_lost {
                    attempt += 1;
                    say(&format!(
                        "restarting the group: restart {attempt} of {} (ACCEL_RESTART_COUNT={attempt})",
                        max_restarts
                    ));
                    continue;
                }
                break code;
            }
        }
    };

    if let Some(st) = coord.store() {
        let last = reports.last().map(|r| r.attempt).unwrap_or(0);
        machines::farewell(
            &**st,
            last,
            s.machine_rank,
            s.num_machines,
            Duration::from_secs(5),
        );
    }
    if let Coordination::Host { server, .. } = &coord {
        server.shutdown();
    }
    let _ = std::fs::remove_dir_all(&scratch);

    let failed = code != 0;
    if reports.len() > 1 || failed {
        let mut lines = vec![format!(
            "run {run_id}: {} attempt(s), exit code {code}",
            reports.len()
        )];
        lines.extend(reports.iter().map(|r| format!("  {}", r.line())));
        output::say_block(&lines);
    }
    if args.json {
        let summary = Summary {
            run_id,
            machine_rank: s.machine_rank,
            num_machines: s.num_machines,
            world_size,
            store: store_url,
            exit_code: code,
            attempts: reports,
            wall_s: t0.elapsed().as_secs_f64(),
        };
        print_stdout(&serde_json::to_string(&summary).unwrap_or_default());
    }
    Ok(ExitCode::from(code))
}

/// The record a launcher publishes when it is interrupted, so that the
/// other machines stop too (and do not restart).
fn interruption(env: &RunEnv, host: &str, sig: i32) -> Failure {
    Failure {
        rank: env.rank_offset,
        local_rank: 0,
        machine: env.machine_rank,
        host: host.to_string(),
        pid: std::process::id(),
        exit: Exit::Signal { signal: sig },
        error: Some(format!(
            "the launcher on machine {} ({host}) received {}",
            env.machine_rank,
            report::signal_name(sig)
        )),
        location: None,
        stderr_tail: Vec::new(),
        also_hung: Vec::new(),
        interrupted: true,
    }
}
