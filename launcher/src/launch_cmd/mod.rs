//! `accel launch`: start N workers on this machine (and join M machines),
//! host the rendezvous store, prefix their output, stop the group when one
//! fails and say why, restart on request.
//!
//! | module | does |
//! |---|---|
//! | [`options`] | flags, environment and config layers → [`options::Settings`] |
//! | [`config`] | the TOML config file (read, check, render) |
//! | [`accelerate_config`] | Accelerate's YAML config file (`--config_file`), mapped or refused key by key |
//! | [`machines`] | how several machines' launchers agree on a run |
//! | [`mpi`] | `--backend mpi`: the machines mpirun runs on |
//! | [`process_model`] | `--backend xla`: one process, its ranks as threads |
//! | [`default_backend`] | the default backend when no backend is named (mpi for programs that link MPI, where an MPI launcher exists) |
//!
//! Starting, supervising and restarting the processes is the launch
//! library's ([`accel_launch`]): a [`LocalGroup`] of workers here, an
//! [`accel_launch::MpirunGroup`] under `--backend mpi`, both under one
//! supervisor and one restart loop.
//!
//! # Environment contract
//!
//! Every worker gets, on top of the launcher's environment: `RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`,
//! `GROUP_WORLD_SIZE`, `ROLE_RANK`, `ROLE_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`, `ACCEL_LAUNCHER=accel`, `ACCEL_STORE_URL=tcp://addr:port`,
//! `ACCEL_RUN_ID`, `ACCEL_RUN_TOKEN`, `ACCEL_TIMEOUT`, `ACCEL_DEBUG` (0/1),
//! `ACCEL_RESTART_COUNT`, `ACCEL_ERROR_FILE`, `ACCEL_BACKEND` (when chosen),
//! `ACCEL_MIXED_PRECISION`, `ACCEL_SHARDING` and
//! `ACCEL_GRADIENT_ACCUMULATION_STEPS` (when set; the first and last also as
//! Accelerate's `ACCELERATE_*`),
//! and torchrun's `TORCHELASTIC_RUN_ID`, `TORCHELASTIC_RESTART_COUNT`,
//! `TORCHELASTIC_MAX_RESTARTS`, `TORCHELASTIC_ERROR_FILE`. A unit test feeds
//! them to `accel::ProcessState::from_vars`, the runtime's own reader.
//! They are written from one [`accel::WorkerEnv`].
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
pub mod config;
pub mod default_backend;
pub mod machines;
pub mod mpi;
pub mod options;
pub mod process_model;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::Duration;

use accel::worker_env::WorkerEnv;
use accel_api::{Error, ErrorKind, Result, Store};
use accel_launch::output::{print_stdout, say};
use accel_launch::report::{self, Exit, Failure, Status};
use accel_launch::supervise::{Event, LocalOutcome, Settled, LAST_SIGNAL};
use accel_launch::{
    program, store, Attempt, Coordinator, HostedStore, LocalGroup, ProcessGroup, Supervision,
    ThreadsGroup,
};
use accel_rendezvous::{TcpStore, TcpStoreServer, TorchStoreServer};

use machines::{Global, Registration, Watcher};
use options::{Options, Settings};

/// Arguments of `accel launch`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Examples:\n  accel launch -n 4 -- ./train --epochs 3\n  \
                  accel launch -n 4 --backend xla -- ./train   # one process, 4 rank threads (accel::run)\n  \
                  accel launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --token-file ~/.accel-token -n 8 -- ./train\n\n\
                  Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, \
                  MASTER_PORT and the ACCEL_* variables (store URL and token, run id, timeout, backend, debug, \
                  restart count, error file)."
)]
pub struct LaunchArgs {
    #[command(flatten)]
    options: Options,

    /// Config file: accel's TOML (write one with `accel config`), or
    /// Accelerate's YAML/JSON (`accelerate config` writes one) when its name
    /// ends in .yaml, .yml or .json; flags override it.
    #[arg(long, env = "ACCEL_CONFIG_FILE", value_name = "FILE",
          aliases = ["config_file", "config-file"])]
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

    /// torchrun's: run PROGRAM as it is, even a `.py` file (otherwise a
    /// `.py` PROGRAM runs under `python3`, the first on PATH).
    #[arg(long, aliases = ["no_python"], conflicts_with_all = ["module", "run_path"])]
    no_python: bool,

    /// torchrun's -m: PROGRAM is a Python module, run as `python3 -m PROGRAM`.
    #[arg(short = 'm', long, conflicts_with = "run_path")]
    module: bool,

    /// torchrun's --run-path: PROGRAM is a Python file, run as `python3 PROGRAM`
    /// whatever its name.
    #[arg(long, aliases = ["run_path"])]
    run_path: bool,

    /// torchrun's --rdzv-backend: `c10d` or `static`, both meaning that
    /// machine 0 hosts the rendezvous at --rdzv-endpoint (accel's store).
    #[arg(long = "rdzv-backend", aliases = ["rdzv_backend"], value_name = "c10d|static",
          value_parser = ["c10d", "static"])]
    rdzv_backend: Option<String>,

    /// torchrun's --rdzv-endpoint `HOST[:PORT]`: where machine 0 hosts the
    /// store (--main-process-ip / --main-process-port).
    #[arg(long = "rdzv-endpoint", aliases = ["rdzv_endpoint"], value_name = "HOST[:PORT]")]
    rdzv_endpoint: Option<String>,

    /// torchrun's --monitor-interval: accepted for compatibility; accel
    /// watches its workers continuously, so it changes nothing.
    #[arg(long = "monitor-interval", aliases = ["monitor_interval"], value_name = "SECS", hide = true)]
    monitor_interval: Option<f64>,

    /// Show the workers' stdout on stderr (`accel bench`).
    #[arg(skip)]
    pub workers_stdout_to_stderr: bool,

    /// The program to run and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<OsString>,
}

impl LaunchArgs {
    /// Arguments for `program args...` with `options`, as `accel bench`
    /// builds them.
    pub fn new(options: Options, command: Vec<OsString>) -> LaunchArgs {
        LaunchArgs {
            options,
            config: None,
            mpi_hosts: None,
            hostfile: None,
            json: false,
            standalone: false,
            no_python: false,
            module: false,
            run_path: false,
            rdzv_backend: None,
            rdzv_endpoint: None,
            monitor_interval: None,
            workers_stdout_to_stderr: false,
            command,
        }
    }
}

fn layered(args: &LaunchArgs) -> Result<Settings> {
    let (file, extra_env) = match &args.config {
        Some(p) if accelerate_config::is_accelerate_config(p) => {
            let c = accelerate_config::read(p)?;
            (c.options, c.env)
        }
        Some(p) => (config::read(p)?, Vec::new()),
        None => (Options::default(), Vec::new()),
    };
    let env = Options::from_env(|k| std::env::var(k).ok())?;
    let mut o = args.options.clone().overlay(env).overlay(file);
    if let Some(ep) = &args.rdzv_endpoint {
        let (host, port) = split_endpoint(ep)?;
        if o.main_process_ip.as_deref().is_some_and(|h| h != host) {
            return Err(Error::invalid_config(
                "--rdzv-endpoint",
                ep,
                "contradicts --main-process-ip (--master-addr); give one of them",
            ));
        }
        o.main_process_ip = Some(host.to_string());
        if let Some(p) = port {
            if o.main_process_port.is_some_and(|q| q != p) {
                return Err(Error::invalid_config(
                    "--rdzv-endpoint",
                    ep,
                    "contradicts --main-process-port (--master-port); give one of them",
                ));
            }
            o.main_process_port = Some(p);
        }
    }
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
    if args.options.token.is_some() {
        say(
            "warning: --token on the command line is visible to every user of this machine \
             (`ps`); use --token-file FILE or the ACCEL_RUN_TOKEN variable instead",
        );
    }
    let mut s = Settings::resolve(o)?;
    s.extra_env = extra_env;
    Ok(s)
}

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

/// What the supervisor watches, from the settings.
///
/// # Errors
/// The directory of torchrun's stream logs cannot be created.
fn supervision(s: &Settings, args: &LaunchArgs) -> Result<Supervision> {
    Ok(Supervision {
        ranks: s.ranks.clone(),
        tee: s.tee.clone(),
        streams: s
            .stream_logs
            .as_ref()
            .map(|l| stream_logs(l, s.run_id.as_deref()))
            .transpose()?,
        grace: s.grace,
        hang_timeout: s.hang_timeout,
        wall_limit: None,
        echo: true,
        forward_signals: true,
        stdout_to_stderr: args.workers_stdout_to_stderr,
    })
}

/// torchrun's log layout: a new run directory `RUN_ID_XXXXXXXX` (run id
/// `none` when not given, as torchrun's --rdzv-id) in `base`, or in a new
/// `torchelastic_XXXXXXXX` under the temporary directory, said on stderr.
fn stream_logs(
    (base, tee, redirects): &(Option<PathBuf>, options::StdStreams, options::StdStreams),
    run_id: Option<&str>,
) -> Result<accel_launch::output::StreamLogs> {
    let base = match base {
        Some(b) => b.clone(),
        None => std::env::temp_dir().join(format!("torchelastic_{}", store::random_hex(4)?)),
    };
    let dir = base.join(format!(
        "{}_{}",
        run_id.unwrap_or("none"),
        store::random_hex(4)?
    ));
    std::fs::create_dir_all(&dir).map_err(|e| {
        Error::io(
            format!("cannot create the log directory {}", dir.display()),
            e,
        )
        .with_fix("pass --log-dir a directory you can write to")
    })?;
    say(&format!("log directory set to: {}", dir.display()));
    Ok(accel_launch::output::StreamLogs {
        dir,
        tee: tee.clone(),
        redirects: redirects.clone(),
    })
}

/// The environment every worker of the run shares (store fields and the
/// restart count are added per attempt).
fn base_env(s: &Settings, run_id: &str) -> WorkerEnv {
    WorkerEnv {
        world_size: Some(s.world_size_claim()),
        local_world_size: Some(s.nproc),
        group_rank: Some(s.machine_rank),
        group_world_size: Some(s.num_machines),
        run_id: Some(run_id.to_string()),
        timeout: Some(s.timeout),
        backend: s.backend.clone(),
        debug: Some(s.debug),
        mixed_precision: s.mixed_precision,
        sharding: s.sharding,
        gradient_accumulation_steps: s.gradient_accumulation_steps,
        launcher: Some("accel".into()),
        // Lets the runtime tie the worker's life to this process.
        launcher_pid: Some(std::process::id()),
        // Process workers say so, against an inherited ACCEL_PROCESS_MODEL;
        // the threads group writes its own.
        process_model: Some(accel::ProcessModel::Processes),
        ..WorkerEnv::default()
    }
}

fn scratch_dir() -> Result<PathBuf> {
    Ok(std::env::temp_dir().join(format!(
        "accel-{}-{}",
        std::process::id(),
        store::random_hex(4)?
    )))
}

/// torchrun's OMP_NUM_THREADS policy: with several workers on a machine and
/// no OMP_NUM_THREADS of the user's, each worker gets 1, so that N workers
/// do not each start a thread per core.
fn omp_policy(nproc: usize) -> Vec<(String, String)> {
    if nproc > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        tracing::info!("OMP_NUM_THREADS=1 for each worker (torchrun's default; set it to choose)");
        vec![("OMP_NUM_THREADS".into(), "1".into())]
    } else {
        Vec::new()
    }
}

/// torchrun's `HOST[:PORT]` (IPv6 in brackets).
fn split_endpoint(ep: &str) -> Result<(&str, Option<u16>)> {
    let bad = |why: &str| Error::invalid_config("--rdzv-endpoint", ep, why.to_string());
    let (host, port) = match ep.strip_prefix('[') {
        Some(v6) => {
            let (h, rest) = v6.split_once(']').ok_or_else(|| bad("unclosed `[`"))?;
            (h, rest.strip_prefix(':'))
        }
        None if ep.matches(':').count() > 1 => (ep, None),
        None => match ep.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (ep, None),
        },
    };
    if host.is_empty() {
        return Err(bad("the host is missing"));
    }
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("the port is not in 1-65535"))
        })
        .transpose()?;
    Ok((host, port))
}

/// The command to start, torchrun's way: a `.py` file (or with -m a module,
/// with --run-path any file) under `python3`, unless --no-python.
fn python_command(args: &LaunchArgs) -> Vec<OsString> {
    let python = || OsString::from("python3");
    let first_is_py = args.command[0].to_string_lossy().ends_with(".py");
    if args.no_python {
        args.command.clone()
    } else if args.module {
        [python(), "-m".into()]
            .into_iter()
            .chain(args.command.iter().cloned())
            .collect()
    } else if args.run_path || first_is_py {
        std::iter::once(python())
            .chain(args.command.iter().cloned())
            .collect()
    } else {
        args.command.clone()
    }
}

/// The program, resolved before anything starts; `Err(code)` after saying
/// why.
fn resolve_program(args: &LaunchArgs) -> std::result::Result<accel_launch::Program, u8> {
    let command = python_command(args);
    let argv0 = command[0].clone();
    match program::resolve(&argv0, std::env::var_os("PATH").as_deref()) {
        Ok(path) => Ok(accel_launch::Program {
            path,
            argv0,
            args: command[1..].to_vec(),
        }),
        Err(e) => {
            eprintln!("accel: error: {e}");
            Err(e.exit_code())
        }
    }
}

/// Print the `--json` summary of a run when asked.
fn finish(args: &LaunchArgs, out: &accel_launch::RunOutcome) -> u8 {
    if args.json {
        print_stdout(&serde_json::to_string(&out.summary).unwrap_or_default());
    }
    out.code
}

/// Levenshtein distance, for "did you mean".
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// torchrun's and accelerate launch's flags that `accel launch` does not
/// take, and why (docs/torch.md has the whole table).
const NOT_MAPPED: &[(&str, &str)] = &[
    (
        "rdzv-conf",
        "accel's rendezvous has no such settings; --join-timeout bounds the machines' join",
    ),
    (
        "rdzv-timeout",
        "use --join-timeout for the machines' join and --timeout for every blocking call",
    ),
    (
        "start-method",
        "accel always starts workers as new processes (fork and exec)",
    ),
    (
        "role",
        "accel runs one role; ROLE_RANK and ROLE_WORLD_SIZE equal RANK and WORLD_SIZE",
    ),
    (
        "local-addr",
        "machines are addressed through --master-addr only",
    ),
    (
        "local-ranks-filter",
        "use --ranks to choose whose output is shown",
    ),
    (
        "logs-specs",
        "use --tee DIR (or --log-dir DIR) to write each rank's output to DIR/rank-N.log",
    ),
    ("max-restarts-per-node", "use --max-restarts"),
    (
        "multi-gpu",
        "accel launches one process per -n; devices follow LOCAL_RANK",
    ),
    (
        "cpu",
        "accel launches -n processes on CPU backends already; choose one with --backend",
    ),
    (
        "use-deepspeed",
        "accel has its own ZeRO (--sharding); DeepSpeed is not driven",
    ),
    ("use-fsdp", "use --sharding full (ZeRO stage 3)"),
    (
        "dynamo-backend",
        "torch.compile settings are the program's own",
    ),
];

/// A "program" that starts with `-` is a flag `accel launch` does not know
/// (clap hands everything after the first unknown word to the program):
/// say so, with the closest known flag.
fn unknown_flag(word: &std::ffi::OsStr) -> Option<Error> {
    let w = word.to_string_lossy();
    if !w.starts_with('-') || w == "-" {
        return None;
    }
    let name = w.trim_start_matches('-');
    let name = name.split_once('=').map_or(name, |(n, _)| n);
    if let Some((_, why)) = NOT_MAPPED
        .iter()
        .find(|(f, _)| f.replace('_', "-") == name.replace('_', "-"))
    {
        return Some(
            Error::new(
                ErrorKind::InvalidArgument,
                format!("`{w}` (torchrun's or accelerate launch's) has no counterpart in `accel launch`"),
            )
            .with_fix(why.to_string()),
        );
    }
    let cmd = <LaunchArgs as clap::Args>::augment_args(clap::Command::new("launch"));
    let mut known: Vec<String> = Vec::new();
    for a in cmd.get_arguments() {
        if let Some(l) = a.get_long() {
            known.push(l.to_string());
        }
        known.extend(
            a.get_all_aliases()
                .unwrap_or_default()
                .into_iter()
                .map(str::to_string),
        );
    }
    let best = known
        .iter()
        .map(|k| (distance(&name.replace('_', "-"), &k.replace('_', "-")), k))
        .min();
    // Only near misses (a typo), never a flag that merely shares a word.
    let hint = match best {
        Some((d, k)) if d <= 2.min(name.len() / 3) => format!("did you mean `--{k}`? "),
        _ => String::new(),
    };
    Some(
        Error::new(
            ErrorKind::InvalidArgument,
            format!("`{w}` is not a flag of `accel launch`"),
        )
        .with_fix(format!(
            "{hint}see `accel launch --help`; put the program after `--` (a program whose name \
             starts with `-` needs a path, like ./{w})"
        )),
    )
}

fn launch(args: &LaunchArgs) -> Result<u8> {
    if let Some(e) = args.command.first().and_then(|w| unknown_flag(w)) {
        return Err(e);
    }
    let s = layered(args)?;
    mpi::check_host_list(args.mpi_hosts.as_deref())?;
    if mpi::requested(&s) {
        return mpi::launch(&s, args, None);
    }
    let program = match resolve_program(args) {
        Ok(p) => p,
        Err(code) => return Ok(code),
    };
    if s.backend.is_none() {
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
    s.check_rank_filter(s.world_size_claim())?;
    let token = match &s.token {
        Some(t) => t.clone(),
        None => store::random_hex(16)?,
    };
    let mut group: Box<dyn ProcessGroup> =
        match process_model::model(&s, &|k| std::env::var(k).ok())? {
            accel::ProcessModel::Threads => Box::new(ThreadsGroup::new(program, s.nproc)),
            accel::ProcessModel::Processes => Box::new(LocalGroup {
                program,
                local_world_size: s.nproc,
                extra_env: omp_policy(s.nproc)
                    .into_iter()
                    .chain(s.extra_env.iter().cloned())
                    .collect(),
                remove_env: Vec::new(),
                die_with_parent: true,
            }),
        };
    let sup = supervision(&s, args)?;
    let scratch = scratch_dir()?;
    let out = if s.multi_machine() {
        let mut coord = Machines::join(&s, &token, scratch.clone())?;
        accel_launch::run(&mut *group, &mut coord, &sup, "run")
    } else {
        let run_id = match &s.run_id {
            Some(id) => id.clone(),
            None => store::random_hex(6)?,
        };
        let mut coord = HostedStore::new(
            &s.main_addr,
            s.main_port,
            false,
            &token,
            base_env(&s, &run_id),
        );
        coord.max_restarts = s.max_restarts;
        coord.scratch = scratch.clone();
        accel_launch::run(&mut *group, &mut coord, &sup, &format!("run {run_id}"))
    };
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(finish(args, &out?))
}

/// The key under which machine 0 publishes the port of its torch endpoint
/// of attempt `n` (in accel's store, which only the run's token reaches).
fn torch_port_key(n: u32) -> String {
    format!("accel-launch/a{n}/torch-port")
}

/// One of several machines: machine 0 hosts the store for the whole run,
/// the others are its clients; every attempt starts with the machines'
/// join ([`machines`]). Machine 0 also hosts, for each attempt, a fresh
/// torch endpoint on its --main-process-ip and a free port, which torch
/// workers on every machine join (MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE,
/// as torchrun's agent store; torch expects a new store per attempt).
struct Machines<'a> {
    s: &'a Settings,
    me: Registration,
    server: Option<TcpStoreServer>,
    torch: Option<TorchStoreServer>,
    store: Arc<dyn Store>,
    run_id: String,
    max_restarts: u32,
    scratch: PathBuf,
    host: String,
    base: WorkerEnv,
    watcher: Option<Watcher>,
}

impl<'a> Machines<'a> {
    fn join(s: &'a Settings, token: &str, scratch: PathBuf) -> Result<Machines<'a>> {
        let host = accel_launch::supervise::host_name();
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
        let (server, store): (Option<TcpStoreServer>, Arc<dyn Store>) = if s.machine_rank == 0 {
            let (server, _) = store::host(&s.main_addr, s.main_port, true, token)?;
            let st: Arc<dyn Store> = server.store().clone();
            (Some(server), st)
        } else {
            let addr = accel::worker_env::tcp_url(&s.main_addr, s.main_port);
            let addr = addr.trim_start_matches("tcp://").to_string();
            let c = TcpStore::connect(addr.as_str(), Some(token), s.join_timeout).map_err(|e| {
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
                    .with_fix("pass the same token (--token-file, ACCEL_RUN_TOKEN, or `token` in the config file) on every machine")
                    .with_source(e)
                } else {
                    e.with_op("machine join")
                }
            })?;
            (None, Arc::new(c))
        };
        let run_id = match (s.machine_rank, &s.run_id) {
            (0, Some(id)) => id.clone(),
            (0, None) => store::random_hex(6)?,
            _ => String::new(), // machine 0 decides
        };
        let mut base = base_env(s, &run_id);
        base.master_addr = Some(s.main_addr.clone());
        base.master_port = Some(s.main_port);
        base.store_url = Some(accel::worker_env::tcp_url(&s.main_addr, s.main_port));
        base.token = Some(token.to_string());
        Ok(Machines {
            s,
            me,
            server,
            torch: None,
            store,
            run_id,
            max_restarts: s.max_restarts,
            scratch,
            host,
            base,
            watcher: None,
        })
    }

    /// Machine 0: a fresh torch endpoint for attempt `n`, its port
    /// published before the join.
    fn host_torch(&mut self, n: u32) -> Result<u16> {
        if let Some(old) = self.torch.take() {
            old.shutdown();
        }
        let (t, _) = store::host_torch(&self.s.main_addr, 0, true)?;
        let port = t.local_addr().port();
        self.torch = Some(t);
        self.store
            .set(&torch_port_key(n), port.to_string().as_bytes())?;
        Ok(port)
    }

    /// Another machine, after the join of attempt `n`: the port machine 0
    /// published (`None` from a machine 0 that hosts no torch endpoint, an
    /// older accel).
    fn joined_torch_port(&self, n: u32) -> Result<Option<u16>> {
        Ok(self
            .store
            .try_get(&torch_port_key(n))?
            .and_then(|v| String::from_utf8(v).ok())
            .and_then(|p| p.trim().parse().ok()))
    }

    /// The record a launcher publishes when it is interrupted, so that the
    /// other machines stop too (and do not restart).
    fn interruption(&self, rank_offset: usize, sig: i32) -> Failure {
        Failure {
            rank: rank_offset,
            local_rank: 0,
            machine: self.s.machine_rank,
            host: self.host.clone(),
            pid: Some(std::process::id()),
            exit: Exit::Signal { signal: sig },
            error: Some(format!(
                "the launcher on machine {} ({}) received {}",
                self.s.machine_rank,
                self.host,
                report::signal_name(sig)
            )),
            location: None,
            stderr_tail: Vec::new(),
            also_hung: Vec::new(),
            interrupted: true,
        }
    }
}

impl Coordinator for Machines<'_> {
    fn begin(&mut self, n: u32, tx: &Sender<Event>) -> Result<Attempt> {
        let s = self.s;
        let torch_port;
        let (rank_offset, world_size) = if s.machine_rank == 0 {
            torch_port = Some(self.host_torch(n)?);
            let plan = machines::host_join(
                &*self.store,
                &self.me,
                &self.run_id,
                s.max_restarts,
                n,
                s.join_timeout,
            )?;
            (0, plan.world_size)
        } else {
            let plan = machines::member_join(&*self.store, &self.me, n, s.join_timeout)?;
            torch_port = self.joined_torch_port(n)?;
            self.run_id = plan.run_id.clone();
            self.max_restarts = plan.max_restarts;
            let off = plan
                .machines
                .get(s.machine_rank)
                .map(|m| m.rank_offset)
                .unwrap_or(s.machine_rank * s.nproc);
            (off, plan.world_size)
        };
        self.watcher = Some(Watcher::start(
            self.store.clone(),
            n,
            s.machine_rank,
            tx.clone(),
        ));
        let mut env = self.base.clone();
        if let Some(port) = torch_port {
            env.master_port = Some(port);
            env.agent_store = Some(true);
        }
        env.run_id = Some(self.run_id.clone());
        env.world_size = Some(world_size);
        env.restart_count = Some(n);
        env.max_restarts = Some(self.max_restarts);
        Ok(Attempt {
            number: n,
            env,
            rank_offset,
            error_dir: self.scratch.join(format!("attempt-{n}")),
            host: self.host.clone(),
        })
    }

    fn publish(&self, n: u32, f: &Failure) {
        machines::publish_failure(&*self.store, n, f);
    }

    fn settle(&mut self, n: u32, attempt: &Attempt, local: LocalOutcome) -> Settled {
        if let Some(w) = self.watcher.take() {
            w.stop();
        }
        let (st, me, m) = (&*self.store, self.s.machine_rank, self.s.num_machines);
        let failed = |root: Failure| Settled {
            status: Status::Failed,
            code: root.exit.launcher_code(),
            root: Some(root),
            interrupted_by: None,
            restartable: true,
        };
        let lost = |why: String| Settled {
            status: Status::Failed,
            root: None,
            code: 1,
            interrupted_by: Some(format!("lost store: {why}")),
            restartable: false,
        };
        match local {
            LocalOutcome::Interrupted(sig) => {
                let f = self.interruption(attempt.rank_offset, sig);
                machines::publish_failure(st, n, &f);
                let _ = machines::settle(st, n, me, m, false);
                Settled::alone(LocalOutcome::Interrupted(sig))
            }
            LocalOutcome::StoreLost(why) => lost(why),
            local => {
                let ok = matches!(local, LocalOutcome::Succeeded);
                match (machines::settle(st, n, me, m, ok), local) {
                    (Global::Succeeded, _) => Settled::alone(LocalOutcome::Succeeded),
                    (Global::Failed(f), _) if f.interrupted => {
                        say(&format!(
                            "the run was stopped on machine {} ({})",
                            f.machine,
                            f.error.as_deref().unwrap_or("interrupted")
                        ));
                        let sig = LAST_SIGNAL.load(Ordering::SeqCst);
                        Settled {
                            status: Status::Interrupted,
                            code: if sig != 0 {
                                u8::try_from(128 + sig).unwrap_or(1)
                            } else {
                                f.exit.launcher_code()
                            },
                            root: Some(*f),
                            interrupted_by: Some("another machine's launcher".into()),
                            restartable: false,
                        }
                    }
                    (Global::Failed(f), _) => failed(*f),
                    (
                        Global::StoreLost(why),
                        LocalOutcome::Failed { root: Some(f), .. } | LocalOutcome::Remote(f),
                    ) => {
                        say(&format!("lost the store on machine 0: {why}"));
                        Settled {
                            restartable: false,
                            ..failed(*f)
                        }
                    }
                    (Global::StoreLost(why), _) => {
                        // Waiting for the other machines was cut short by a signal.
                        let sig = LAST_SIGNAL.load(Ordering::SeqCst);
                        if sig != 0 {
                            Settled::alone(LocalOutcome::Interrupted(sig))
                        } else {
                            lost(why)
                        }
                    }
                }
            }
        }
    }

    fn max_restarts(&self) -> u32 {
        self.max_restarts
    }

    fn end(&mut self, last: u32) {
        machines::farewell(
            &*self.store,
            last,
            self.s.machine_rank,
            self.s.num_machines,
            Duration::from_secs(5),
        );
        if let Some(server) = self.server.take() {
            server.shutdown();
        }
        if let Some(t) = self.torch.take() {
            t.shutdown();
        }
    }

    fn store_url(&self) -> String {
        accel::worker_env::tcp_url(&self.s.main_addr, self.s.main_port)
    }

    fn stall(&self, attempt: &Attempt) -> Option<report::Stall> {
        accel_launch::supervise::read_stall(self.store.clone(), attempt)
    }
}
