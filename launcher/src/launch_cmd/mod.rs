//! `accel launch`: start N workers on this machine (and join M machines),
//! host the rendezvous store, prefix their output, stop the group when one
//! fails and say why, restart on request.
//!
//! Flags → settings → (process group, coordinator) → [`accel_launch::run`]:
//!
//! | module | does |
//! |---|---|
//! | [`options`] | the flags ([`options::Options`]) and the environment's layer, the parsers of their values |
//! | [`config`] | the TOML config file (read, check, render) |
//! | [`accelerate_config`] | Accelerate's YAML config file (`--config_file`), mapped or refused key by key |
//! | [`settings`] | the layers (flags, environment, config file) resolved over the defaults → [`settings::Settings`] |
//! | `flags` | words that are no flag of `accel launch` (torchrun's and Accelerate's it does not take, near misses) |
//! | `args` | [`LaunchArgs`], the program it names, the `--json` summary |
//! | `shared` | what both launch paths derive from the settings: the supervision, the workers' shared environment |
//! | `local` | the launcher's own process groups: the group and the coordinator ([`accel_launch::HostedStore`] on one machine, [`accel_launch::Machines`] on several) |
//! | [`mpi`] | `--backend mpi`: the machines mpirun runs on |
//! | [`process_model`] | `--backend xla`: one process, its ranks as threads |
//! | [`default_backend`] | the default backend when no backend is named (mpi for programs that link MPI, where an MPI launcher exists) |
//!
//! [`launch`] only routes: mpirun (`--backend mpi`, or the default for a
//! program that links MPI) or the local path. Starting, supervising and
//! restarting the processes, and coordinating several machines (their
//! join, heartbeats, a lost machine, elastic rounds), is the launch
//! library's ([`accel_launch`]: `group/`, `supervise/`, `coordinate/`).
//!
//! # Environment contract
//!
//! Every worker gets, on top of the launcher's environment: `RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `GROUP_WORLD_SIZE`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `ACCEL_LAUNCHER=accel`, `ACCEL_STORE_URL=tcp://addr:port`,
//! `ACCEL_RUN_ID`, `ACCEL_RUN_TOKEN`, `ACCEL_TIMEOUT`, `ACCEL_DEBUG` (0/1),
//! `ACCEL_RESTART_COUNT`, `ACCEL_ERROR_FILE`, `ACCEL_DUMP_DIR` (where
//! flight-recorder dumps go: `--dump-dir`, else `dumps` under the logs, else
//! the run's default), `ACCEL_BACKEND` (when chosen),
//! `ACCEL_MIXED_PRECISION`, `ACCEL_SHARDING` and
//! `ACCEL_GRADIENT_ACCUMULATION_STEPS` (when set; the first and last also as
//! Accelerate's `ACCELERATE_*`),
//! and torchrun's `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`,
//! `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_ERROR_FILE`. A unit test feeds
//! them to `accel::ProcessState::from_vars`, the runtime's own reader.
//! They are written from one [`accel_api::worker::WorkerEnv`].
//!
//! # Decisions
//!
//! * `-n` / `--nproc-per-node` counts processes **per machine** (torchrun);
//!   `--num-processes` / `--num_processes` counts **all machines together**
//!   (Accelerate), and must divide by `--num-machines`; giving both is an
//!   error. Every machine runs the same number: the world size a machine
//!   claims is `-n × --num-machines`, and machine 0 refuses a machine whose
//!   claim differs from its own. At most
//!   [`MAX_LOCAL_PROCESSES`](accel_launch::MAX_LOCAL_PROCESSES) per machine.
//! * The token: `--token-file FILE` or `ACCEL_RUN_TOKEN` keep it out of
//!   `ps`; `--token` on the command line works but warns.
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
//! * Flight-recorder dumps: SIGUSR1 to the launcher (`accel dump`) is
//!   passed on to every rank that catches it (under mpirun, to mpirun, which
//!   passes it on); after a rank fails having dumped, the other ranks are
//!   asked to dump too (at most 1 s) before SIGTERM; the root-cause block
//!   names the dump folder. The launcher keeps a record of itself
//!   (`launcher.json` in its scratch folder) for `accel dump`.
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
//! * `--backend xla` (or `ACCEL_PROCESS_MODEL=threads`) starts **one
//!   process per machine** whose `-n` ranks are threads
//!   ([`accel_launch::ThreadsGroup`]; docs/adr/0015-process-model.md): it
//!   gets its first rank's contract plus `ACCEL_PROCESS_MODEL=threads`, and
//!   the program's `accel::run` starts the rank threads. Output keeps the
//!   `[rank N]` prefixes for lines the ranks print with
//!   `accel::rank_println!` (plain prints show under the first rank), the
//!   root-cause block names the rank thread that failed first (its error
//!   file), restarts restart the process. Process workers get
//!   `ACCEL_PROCESS_MODEL=processes`.
//! * With no backend named, a program that can use MPI (an ELF that links
//!   `libmpi.so`), on one machine with at least 2 processes, where an MPI
//!   launcher of the same family exists, takes the `--backend mpi` path by
//!   default, saying so in the banner (`accel: backend mpi (default):
//!   ...`); otherwise the local launch, quietly (the reason at `--log
//!   info`). Rules in [`default_backend`] (ADR 0017).
//! * Only a run of a single process inherits the terminal's stdin; with
//!   several, stdin is /dev/null.
//! * Workers run in their own process groups, so stopping one also stops
//!   what it started. When an attempt ends, successful or not, whatever the
//!   ranks started and left running is killed: each rank's process group,
//!   and every process of the launcher's session that inherited the
//!   attempt's `ACCEL_ERROR_FILE` (the ranks mpirun starts sit in groups of
//!   their own). A child that started its own session (`setsid`) is the
//!   program's, and outlives the run. If the launcher itself is SIGKILLed,
//!   the kernel sends each worker SIGKILL and mpirun SIGTERM (which stops
//!   its ranks): `PR_SET_PDEATHSIG`, set by the launch library's `ffi`
//!   module.

pub mod accelerate_config;
mod args;
mod cluster_env;
pub mod config;
pub mod default_backend;
mod flags;
pub mod kubeflow;
mod local;
pub mod mpi;
pub mod options;
pub mod process_model;
pub mod settings;
mod shared;

use std::process::ExitCode;
use std::sync::atomic::Ordering;

use accel_api::{Error, Result};
use accel_launch::output::say;
use accel_launch::supervise::LAST_SIGNAL;

pub use args::LaunchArgs;

use args::resolve_program;
use settings::Settings;

/// Run `accel launch`.
///
/// # Errors
/// Configuration errors (exit code 2) and failures to host or reach the
/// store; worker failures are not errors but exit codes.
pub fn run(args: LaunchArgs) -> Result<ExitCode> {
    run_code(&args).map(ExitCode::from)
}

/// [`run`], returning the exit code as a number (for `accel bench`).
///
/// # Errors
/// As [`run`].
pub fn run_code(args: &LaunchArgs) -> Result<u8> {
    match launch(args) {
        // An error caused by Ctrl-C (e.g. during the machines' join) exits
        // like an interrupted run.
        Err(e) if LAST_SIGNAL.load(Ordering::SeqCst) != 0 => {
            eprintln!("accel: error: {e}");
            let sig = LAST_SIGNAL.load(Ordering::SeqCst);
            Ok(u8::try_from(128 + sig).unwrap_or(1))
        }
        other => other,
    }
}

/// The router: the settings of `args`, then mpirun (`--backend mpi`, or
/// the default backend for a program that links MPI) or the launcher's own
/// process groups (`local`).
///
/// # Errors
/// As [`run`].
fn launch(args: &LaunchArgs) -> Result<u8> {
    if let Some(e) = args.command.first().and_then(|w| flags::unknown_flag(w)) {
        return Err(e);
    }
    let s = Settings::from_args(args)?;
    mpi::check_host_list(args.mpi_hosts.as_deref())?;
    if s.elastic() && mpi::requested(&s) {
        return Err(Error::invalid_config(
            "--num-machines",
            &format!("{}:{}", s.min_machines, s.num_machines),
            "an elastic run re-forms its world at every restart, and mpirun's world is fixed",
        )
        .with_fix("use a fixed --num-machines with --backend mpi, or another backend (cpu-gloo) for an elastic run"));
    }
    if s.etcd.is_some() && mpi::requested(&s) {
        return Err(Error::invalid_config(
            "--rdzv-backend",
            "etcd",
            "the etcd rendezvous runs one launcher per machine, and --backend mpi starts every \
             rank with one mpirun",
        )
        .with_fix("use another backend (cpu-gloo) with --rdzv-backend etcd, or accel's own rendezvous with --backend mpi"));
    }
    if mpi::requested(&s) {
        return mpi::launch(&s, args, None);
    }
    let program = match resolve_program(args) {
        Ok(p) => p,
        Err(code) => return Ok(code),
    };
    if s.backend.is_none() && !s.elastic() && s.etcd.is_none() {
        let choice = default_backend::choose(&program.path, s.world_size_claim(), s.num_machines);
        if choice.is_mpi() {
            say(&format!("backend mpi (default): {}", choice.reason));
            return mpi::launch(&s, args, Some(&choice));
        }
        tracing::info!(
            "backend: the workers' probe chooses (cpu-gloo on CPUs): {}",
            choice.reason
        );
    }
    local::launch(&s, args, program)
}
