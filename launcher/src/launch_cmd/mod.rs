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
//! | [`elastic`] | `--num-machines MIN:MAX`: rounds of machines, re-formed at every restart |
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
mod args;
pub mod config;
pub mod default_backend;
pub mod elastic;
pub mod machines;
pub mod mpi;
pub mod options;
pub mod process_model;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel::worker_env::WorkerEnv;
use accel_api::{Error, ErrorKind, Result, Store};
use accel_launch::output::say;
use accel_launch::report::{self, Exit, Failure, Status};
use accel_launch::supervise::{Event, LocalOutcome, Settled, LAST_SIGNAL};
use accel_launch::{
    store, Attempt, Coordinator, HostedStore, LocalGroup, ProcessGroup, ThreadsGroup,
};
use accel_rendezvous::{TcpStore, TcpStoreServer, TorchStoreServer};

pub use args::LaunchArgs;

use args::{base_env, finish, resolve_program, scratch_dir, supervision};
use machines::{Global, Liveness, Plan, Registration, Watcher};
use options::{Options, Settings};

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
        if o.num_machines.is_some_and(|m| m.max > 1) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "--standalone runs on one machine, but --num-machines is more than 1",
            ));
        }
        o.num_machines = Some(1.into());
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
    if s.elastic() && mpi::requested(&s) {
        return Err(Error::invalid_config(
            "--num-machines",
            &format!("{}:{}", s.min_machines, s.num_machines),
            "an elastic run re-forms its world at every restart, and mpirun's world is fixed",
        )
        .with_fix("use a fixed --num-machines with --backend mpi, or another backend (cpu-gloo) for an elastic run"));
    }
    if mpi::requested(&s) {
        return mpi::launch(&s, args, None);
    }
    let program = match resolve_program(args) {
        Ok(p) => p,
        Err(code) => return Ok(code),
    };
    if s.backend.is_none() && !s.elastic() {
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
    /// The round (attempt) whose keys this machine uses: its attempt number,
    /// or in an elastic run the round it joined.
    round: u32,
    /// This machine's rank in the round.
    rank: usize,
    /// Machines in the round.
    count: usize,
    /// Rounds this machine missed (it joined late): its attempt number is
    /// `round - lag`.
    lag: u32,
    /// The ids of the last round's machines, in rank order (machine 0).
    members: Vec<String>,
    /// The last round's machines.
    slots: Vec<machines::MachineSlot>,
    /// The heartbeats' own connection to the store.
    beat_store: Arc<dyn Store>,
    liveness: Option<Liveness>,
    plan: Option<Plan>,
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
            id: format!("{host}:{}:{}", std::process::id(), store::random_hex(4)?),
            min_machines: s.min_machines,
        };
        let (server, store, beat_store): (Option<TcpStoreServer>, Arc<dyn Store>, Arc<dyn Store>) =
            if s.machine_rank == 0 {
                let (server, _) = store::host(&s.main_addr, s.main_port, true, token)?;
                let st: Arc<dyn Store> = server.store().clone();
                (Some(server), st.clone(), st)
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
                // Short: a beat must not outlive the lost threshold by much.
                let beat = TcpStore::connect(addr.as_str(), Some(token), machines::SUSPECT)
                    .map_err(|e| e.with_op("machine join"))?;
                (None, Arc::new(c), Arc::new(beat))
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
            round: 0,
            rank: s.machine_rank,
            count: s.num_machines,
            lag: 0,
            members: Vec::new(),
            slots: Vec::new(),
            beat_store,
            liveness: None,
            plan: None,
        })
    }

    /// Where machine 0's store listens (for messages).
    fn store_at(&self) -> String {
        accel::worker_env::tcp_url(&self.s.main_addr, self.s.main_port)
            .trim_start_matches("tcp://")
            .to_string()
    }

    /// `f` as the loss of a silent machine, when `f` speaks of a lost or
    /// late peer and a machine went silent: waits up to
    /// [`machines::SUSPECT`] (and two beats) for the silence to show, as
    /// the ranks of a killed machine's peers fail at once.
    fn attribute(&self, f: &Failure) -> Failure {
        let (Some(live), Some(plan)) = (&self.liveness, &self.plan) else {
            return f.clone();
        };
        if !f.speaks_of_a_peer() {
            return f.clone();
        }
        let deadline = Instant::now() + machines::SUSPECT + 2 * machines::BEAT;
        loop {
            // Cut off, or another machine's cause is already out: no wait.
            if !live.reaches_store() || machines::failure(&*self.beat_store, self.round).is_some() {
                return f.clone();
            }
            let silent = live.silent(machines::SUSPECT);
            if !silent.is_empty() {
                return machines::lost_failure(plan, self.rank, &silent, &self.store_at(), Some(f));
            }
            if Instant::now() > deadline {
                return f.clone();
            }
            std::thread::sleep(machines::BEAT / 2);
        }
    }

    /// `false` once this machine's heartbeat stopped reaching the store:
    /// then nothing waits on the store any more.
    fn reaches_store(&self) -> bool {
        self.liveness.as_ref().is_none_or(Liveness::reaches_store)
    }

    /// The attempt's end on a machine that lost the store (and so the
    /// others): named as this machine losing the others, without waiting
    /// on the store. `None` without a plan (no attempt began).
    fn settle_alone(&self, local: &LocalOutcome) -> Option<Settled> {
        let (live, plan) = (self.liveness.as_ref()?, self.plan.as_ref()?);
        let root = match local {
            LocalOutcome::Interrupted(_) | LocalOutcome::Succeeded => return None,
            LocalOutcome::Remote(f) if matches!(f.exit, Exit::Lost { .. }) => (**f).clone(),
            other => {
                let witness = match other {
                    LocalOutcome::Failed { root: Some(f), .. } | LocalOutcome::Remote(f) => {
                        Some((**f).clone())
                    }
                    _ => None,
                };
                let me = self.rank;
                let silent = vec![(me, live.own_silence())];
                let mut f =
                    machines::lost_failure(plan, me, &silent, &self.store_at(), witness.as_ref());
                if let LocalOutcome::StoreLost(why) = other {
                    let e = f.error.get_or_insert_with(String::new);
                    e.push_str(&format!("\n{why}"));
                }
                f
            }
        };
        Some(Settled {
            status: Status::Failed,
            code: root.exit.launcher_code(),
            root: Some(root),
            interrupted_by: None,
            restartable: false,
        })
    }

    /// Join round `n` (or, elastic and not machine 0, the first open round
    /// from `n + lag` on): `(rank offset, world size)`.
    fn join_round(&mut self, n: u32) -> Result<(usize, usize)> {
        let s = self.s;
        if !s.elastic() {
            let plan = if s.machine_rank == 0 {
                machines::host_join(
                    &*self.store,
                    &self.me,
                    &self.run_id,
                    s.max_restarts,
                    n,
                    s.join_timeout,
                )?
            } else {
                machines::member_join(&*self.store, &self.me, n, s.join_timeout)?
            };
            self.round = n;
            self.take_plan(&plan);
            let off = plan
                .machines
                .get(s.machine_rank)
                .map(|m| m.rank_offset)
                .unwrap_or(s.machine_rank * s.nproc);
            return Ok((off, plan.world_size));
        }
        let bounds = elastic::Bounds {
            min: s.min_machines,
            max: s.num_machines,
            window: s.join_window,
            timeout: s.join_timeout,
        };
        let (round, plan) = if s.machine_rank == 0 {
            let previous = std::mem::take(&mut self.members);
            let plan = elastic::host_round(
                &*self.store,
                &self.me,
                (&self.run_id, s.max_restarts),
                n,
                &previous,
                bounds,
            )?;
            (n, plan)
        } else {
            elastic::member_round(&*self.store, &self.me, n + self.lag, s.join_timeout)?
        };
        self.round = round;
        self.lag = round - n;
        self.take_plan(&plan);
        let slot = plan
            .machines
            .iter()
            .find(|m| m.id == self.me.id)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::Backend,
                    format!("round {round}'s plan does not hold this machine"),
                )
            })?;
        self.rank = slot.machine_rank;
        Ok((slot.rank_offset, plan.world_size))
    }

    fn take_plan(&mut self, plan: &machines::Plan) {
        if self.s.machine_rank != 0 {
            self.run_id = plan.run_id.clone();
            self.max_restarts = plan.max_restarts;
        }
        self.count = plan.machines.len();
        self.members = plan.machines.iter().map(|m| m.id.clone()).collect();
        self.slots = plan.machines.clone();
        self.plan = Some(plan.clone());
    }

    /// The root cause when machines `missing` of an elastic round did not
    /// report the end of their workers within `--timeout`.
    fn silent(&self, missing: &[usize]) -> Failure {
        let k = missing[0];
        let slot = self.slots.get(k);
        let host = slot.map_or_else(|| "?".to_string(), |m| m.host.clone());
        Failure {
            rank: slot.map_or(0, |m| m.rank_offset),
            local_rank: 0,
            machine: k,
            host: host.clone(),
            pid: None,
            exit: Exit::Code { code: 1 },
            error: Some(format!(
                "machine {k} ({host}) did not report the end of its workers within {:?} of this machine's: its launcher froze or was lost (machine(s) {} silent)",
                self.s.timeout,
                missing
                    .iter()
                    .map(|m| m.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            location: None,
            stderr_tail: Vec::new(),
            also_hung: Vec::new(),
            interrupted: false,
        }
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
            machine: self.rank,
            host: self.host.clone(),
            pid: Some(std::process::id()),
            exit: Exit::Signal { signal: sig },
            error: Some(format!(
                "the launcher on machine {} ({}) received {}",
                self.rank,
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
        // Machine 0 hosts a fresh torch endpoint for each attempt (torch
        // expects a new store on a retry) and publishes its port before
        // the join; the others read it after.
        let mut torch_port = if self.s.machine_rank == 0 {
            Some(self.host_torch(n)?)
        } else {
            None
        };
        let (rank_offset, world_size) = self.join_round(n)?;
        if self.s.machine_rank != 0 {
            torch_port = self.joined_torch_port(self.round)?;
        }
        if let Some(l) = self.liveness.take() {
            l.stop();
        }
        self.liveness = self.plan.clone().map(|plan| {
            let (store, tx, me) = (self.beat_store.clone(), tx.clone(), self.rank);
            let at = self.store_at();
            let (attempt, round) = (n, self.round);
            Liveness::start(
                self.beat_store.clone(),
                self.round,
                me,
                self.count,
                self.s.timeout + Duration::from_secs(2),
                Box::new(move |lost| {
                    // This machine's own silence: the store is out of reach,
                    // and so are the others; settle_alone names them.
                    if let Some((k, silent)) = lost.first().filter(|(k, _)| *k == me) {
                        let _ = tx.send(Event::StoreLost {
                            attempt,
                            message: format!(
                                "machine {k}'s heartbeat has not reached the store at {at} for {:.1}s",
                                silent.as_secs_f64()
                            ),
                        });
                        return;
                    }
                    let f = machines::lost_failure(&plan, me, &lost, &at, None);
                    let first = machines::publish_failure(&*store, round, &f).unwrap_or(f);
                    let _ = tx.send(Event::Remote {
                        attempt,
                        failure: Box::new(first),
                    });
                }),
            )
        });
        self.watcher = Some(Watcher::start(
            self.store.clone(),
            self.round,
            self.rank,
            tx.clone(),
        ));
        let mut env = self.base.clone();
        if let Some(port) = torch_port {
            env.master_port = Some(port);
            env.agent_store = Some(true);
        }
        env.run_id = Some(self.run_id.clone());
        env.world_size = Some(world_size);
        env.group_rank = Some(self.rank);
        env.group_world_size = Some(self.count);
        env.restart_count = Some(self.round);
        env.max_restarts = Some(self.max_restarts);
        Ok(Attempt {
            number: self.round,
            env,
            rank_offset,
            error_dir: self.scratch.join(format!("attempt-{n}")),
            host: self.host.clone(),
        })
    }

    fn publish(&self, _n: u32, f: &Failure) {
        let f = self.attribute(f);
        if self.reaches_store() {
            machines::publish_failure(&*self.store, self.round, &f);
        }
    }

    fn settle(&mut self, _n: u32, attempt: &Attempt, local: LocalOutcome) -> Settled {
        if let Some(w) = self.watcher.take() {
            w.stop();
        }
        if !self.reaches_store() || matches!(local, LocalOutcome::StoreLost(_)) {
            if let Some(settled) = self.settle_alone(&local) {
                return settled;
            }
        }
        let (st, me, m, n) = (&*self.store, self.rank, self.count, self.round);
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
                let limit = self.s.elastic().then_some(self.s.timeout);
                match (machines::settle_within(st, n, (me, m), ok, limit), local) {
                    (Global::Missing(missing), _) => {
                        // Everyone agrees on one root cause: the first published.
                        let f = self.silent(&missing);
                        failed(machines::publish_failure(st, n, &f).unwrap_or(f))
                    }
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

    /// In rounds: a machine that joined late has `lag` fewer attempts.
    fn max_restarts(&self) -> u32 {
        self.max_restarts.saturating_sub(self.lag)
    }

    fn end(&mut self, _last: u32) {
        if self.s.machine_rank == 0 && self.s.elastic() {
            // Machines waiting for a round stop.
            let _ = self
                .store
                .set(&elastic::done_key(), b"machine 0's launcher ended the run");
        }
        // Wait for no goodbye of a silent machine, nor of the machine the
        // root cause says was lost (it may have gone silent a moment ago);
        // say none to a store this machine cannot reach.
        let lost = (self.rank == 0)
            .then(|| machines::failure(&*self.store, self.round))
            .flatten()
            .filter(|f| matches!(f.exit, Exit::Lost { .. }))
            .map(|f| f.machine);
        let awaited: Vec<usize> = match &self.liveness {
            Some(l) => {
                let silent = l.silent(machines::SUSPECT);
                (0..self.count)
                    .filter(|k| !silent.iter().any(|(s, _)| s == k) && lost != Some(*k))
                    .collect()
            }
            // No attempt began: no machine joined to say goodbye.
            None => Vec::new(),
        };
        if self.reaches_store() {
            machines::farewell(
                &*self.store,
                self.round,
                self.rank,
                &awaited,
                Duration::from_secs(5),
            );
        }
        if let Some(l) = self.liveness.take() {
            l.stop();
        }
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
        if !self.reaches_store() {
            return None;
        }
        accel_launch::supervise::read_stall(self.store.clone(), attempt)
    }
}
