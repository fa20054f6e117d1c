//! The arguments of `accel launch` ([`LaunchArgs`]) and what both of its
//! paths (the launcher's own process groups in `local.rs`, mpirun in
//! `mpi.rs`) make of them alone: the program, the `--json` summary. What
//! they derive from the settings is `shared.rs`.

use std::ffi::OsString;
use std::path::PathBuf;

use accel_launch::output::print_stdout;
use accel_launch::program;

use super::options::Options;

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
    pub(super) options: Options,

    /// Config file: accel's TOML (write one with `accel config`), or
    /// Accelerate's YAML/JSON (`accelerate config` writes one) when its name
    /// ends in .yaml, .yml or .json; flags override it.
    #[arg(long, env = "ACCEL_CONFIG_FILE", value_name = "FILE",
          aliases = ["config_file", "config-file"])]
    pub(super) config: Option<PathBuf>,

    /// --backend mpi on several machines: the machines mpirun starts ranks
    /// on, `host[:slots],...` (slots default to -n).
    #[arg(long, env = "ACCEL_MPI_HOSTS", value_name = "HOSTS")]
    pub(super) mpi_hosts: Option<String>,

    /// --backend mpi on several machines: a hostfile in mpirun's format
    /// (instead of --mpi-hosts).
    #[arg(long, env = "ACCEL_MPI_HOSTFILE", value_name = "FILE")]
    pub(super) hostfile: Option<PathBuf>,

    /// Print a JSON summary of the run on stdout when it ends.
    #[arg(long)]
    pub(super) json: bool,

    /// torchrun's --standalone: one machine, a free port (the default).
    #[arg(long)]
    pub(super) standalone: bool,

    /// torchrun's: run PROGRAM as it is, even a `.py` file (otherwise a
    /// `.py` PROGRAM runs under `python3`, the first on PATH).
    #[arg(long, aliases = ["no_python"], conflicts_with_all = ["module", "run_path"])]
    pub(super) no_python: bool,

    /// torchrun's -m: PROGRAM is a Python module, run as `python3 -m PROGRAM`.
    #[arg(short = 'm', long, conflicts_with = "run_path")]
    pub(super) module: bool,

    /// torchrun's --run-path: PROGRAM is a Python file, run as `python3 PROGRAM`
    /// whatever its name.
    #[arg(long, aliases = ["run_path"])]
    pub(super) run_path: bool,

    /// torchrun's --rdzv-backend: `c10d` or `static` (machine 0 hosts the
    /// rendezvous at --rdzv-endpoint, accel's store), or `etcd` (the
    /// rendezvous on an etcd cluster, --rdzv-endpoint naming its members:
    /// any machine may die; `etcd-v2`, torch's other name, means the same).
    #[arg(long = "rdzv-backend", aliases = ["rdzv_backend"], value_name = "c10d|static|etcd",
          value_parser = ["c10d", "static", "etcd", "etcd-v2"])]
    pub(super) rdzv_backend: Option<String>,

    /// torchrun's --rdzv-endpoint: `HOST[:PORT]` where machine 0 hosts the
    /// store (--main-process-ip / --main-process-port); under
    /// `--rdzv-backend etcd`, the etcd members `HOST:PORT,HOST:PORT,...`.
    #[arg(long = "rdzv-endpoint", aliases = ["rdzv_endpoint"], value_name = "HOST[:PORT]")]
    pub(super) rdzv_endpoint: Option<String>,

    /// torchrun's --rdzv-conf, under `--rdzv-backend etcd`: how to reach
    /// the cluster, `KEY=VALUE,...` with `cacert` (or `ca`), `cert`, `key`
    /// (PEM files: TLS), `user` and `password_file` (authentication).
    #[arg(long = "rdzv-conf", aliases = ["rdzv_conf"], value_name = "KEY=VALUE,...")]
    pub(super) rdzv_conf: Option<String>,

    /// torchrun's --monitor-interval: accepted for compatibility; accel
    /// watches its workers continuously, so it changes nothing.
    #[arg(long = "monitor-interval", aliases = ["monitor_interval"], value_name = "SECS", hide = true)]
    pub(super) monitor_interval: Option<f64>,

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
    pub(super) command: Vec<OsString>,
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
            rdzv_conf: None,
            monitor_interval: None,
            workers_stdout_to_stderr: false,
            command,
        }
    }
}

/// The command to start, torchrun's way: a `.py` file (or with -m a module,
/// with --run-path any file) under `python3`, unless --no-python.
pub(super) fn python_command(args: &LaunchArgs) -> Vec<OsString> {
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
pub(super) fn resolve_program(args: &LaunchArgs) -> std::result::Result<accel_launch::Program, u8> {
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
pub(super) fn finish(args: &LaunchArgs, out: &accel_launch::RunOutcome) -> u8 {
    if args.json {
        print_stdout(&serde_json::to_string(&out.summary).unwrap_or_default());
    }
    out.code
}
