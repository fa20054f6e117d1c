//! `accel`: the command-line front of accel.
#![forbid(unsafe_code)]

/// `print!` to stdout; a closed stdout (`accel env --json | head`) ends the
/// process quietly with exit code 0 instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!($($arg)*))
    };
}

/// `println!` with [`out!`]'s handling of a closed stdout.
macro_rules! outln {
    () => { $crate::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => {
        $crate::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

mod bench;
mod checkpoint_cmd;
mod config_cmd;
mod dump_cmd;
mod elastic_worker;
mod env_cmd;
mod flight_worker;
mod launch_cmd;
mod plan_cmd;
mod probe_cmd;
mod test_cmd;
mod top_cmd;
mod trace_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Run one program on one process or many, on any collective engine.
#[derive(Debug, Parser)]
#[command(name = "accel", version, about, long_about = None)]
struct Cli {
    /// Log level filter for accel's own logs (also RUST_LOG / ACCEL_LOG).
    #[arg(long, global = true, env = "ACCEL_LOG", default_value = "warn")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start N workers on this machine (and join M machines), with the
    /// environment every accel or torchrun program reads.
    Launch(launch_cmd::LaunchArgs),
    /// Write a launch config file from flags, or interactively.
    Config(config_cmd::ConfigArgs),
    /// Inspect or verify a checkpoint folder save_state wrote.
    Checkpoint(checkpoint_cmd::CheckpointArgs),
    /// Show the probe table, the process state, versions, devices and plugins.
    Env(env_cmd::EnvArgs),
    /// Time a collective over a range of sizes on N local ranks
    /// (nccl-tests-style table).
    Bench(bench::BenchArgs),
    /// One rank of `accel bench` (started by it through `accel launch`).
    #[command(hide = true, name = "bench-worker")]
    BenchWorker(bench::worker::WorkerArgs),
    /// Worker-side check of a launch: read the process state, connect to the
    /// store, run a store barrier, print one JSON line (tests, benchmarks).
    #[command(hide = true, name = "probe-worker")]
    ProbeWorker(probe_cmd::ProbeArgs),
    /// A small training run that resumes at any world size and logs the
    /// samples of every step (elastic launches' tests and demo).
    #[command(hide = true, name = "elastic-worker")]
    ElasticWorker(elastic_worker::ElasticWorkerArgs),
    /// A job that hangs on purpose, for `accel trace` (tests, docs).
    #[command(hide = true, name = "flight-worker")]
    FlightWorker(flight_worker::FlightWorkerArgs),
    /// The single-threaded parent of mpirun under `accel launch --backend
    /// mpi` (accel_launch::guard).
    #[command(hide = true, name = "mpirun-guard")]
    MpirunGuard {
        /// mpirun and its arguments.
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Merge the flight-recorder dumps of a run: per group, the first
    /// collective where the ranks part ways; the ranks inside a collective;
    /// a Chrome / Perfetto timeline.
    Trace(trace_cmd::TraceArgs),
    /// Ask a running `accel launch` on this machine to make every rank dump
    /// its flight recorder (the job goes on).
    Dump(dump_cmd::DumpArgs),
    /// Run the conformance suite on backends and plugins at several world
    /// sizes and print the matrix.
    Test(test_cmd::TestArgs),
    /// Plan a device map for a model under per-device memory budgets.
    Plan(plan_cmd::PlanArgs),
    /// Model size, largest layer and training-memory estimate per dtype.
    EstimateMemory(plan_cmd::EstimateArgs),
    /// What every rank of a running job is doing (section, step, phase, collective, straggler score).
    Top(top_cmd::TopArgs),
}

/// Write to stdout; on a broken pipe (the reader went away), exit 0: the
/// reader has what it wanted.
pub(crate) fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // Help and version go to stdout: a closed pipe is fine there.
            let code = e.exit_code();
            if e.use_stderr() {
                let _ = e.print();
            } else {
                out!("{}", e.render());
            }
            return ExitCode::from(u8::try_from(code).unwrap_or(2));
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&cli.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let result = match cli.command {
        Command::Launch(args) => launch_cmd::run(args),
        Command::Config(args) => config_cmd::run(args),
        Command::Checkpoint(args) => checkpoint_cmd::run(args),
        Command::Env(args) => env_cmd::run(args),
        Command::ProbeWorker(args) => probe_cmd::run(args),
        Command::ElasticWorker(args) => elastic_worker::run(args),
        Command::FlightWorker(args) => flight_worker::run(args),
        Command::Test(args) => test_cmd::run(args),
        Command::Trace(args) => trace_cmd::run(args),
        Command::Dump(args) => dump_cmd::run(args),
        Command::MpirunGuard { command } => {
            let code = accel_launch::guard::run(&command[0], &command[1..]);
            Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)))
        }
        Command::Plan(args) => plan_cmd::plan(&args).map(|out| {
            out!("{out}");
            ExitCode::SUCCESS
        }),
        Command::EstimateMemory(args) => plan_cmd::estimate_memory(&args).map(|out| {
            out!("{out}");
            ExitCode::SUCCESS
        }),
        Command::Bench(args) => bench::run(args),
        Command::BenchWorker(args) => bench::worker::run(args),
        Command::Top(args) => top_cmd::run(args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("accel: error: {e}");
            ExitCode::from(exit_code_for(&e))
        }
    }
}

/// 2 for configuration mistakes (fix the command line or environment), 1 otherwise.
fn exit_code_for(e: &accel_api::Error) -> u8 {
    match e.kind() {
        accel_api::ErrorKind::InvalidConfig | accel_api::ErrorKind::InvalidArgument => 2,
        _ => 1,
    }
}
