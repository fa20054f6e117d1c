//! `accel probe-worker` (hidden): what a launched worker sees. It reads the
//! process state the way every accel program does, opens the rendezvous
//! store with the run token, runs a store barrier with every rank, and
//! prints one JSON line. The launcher's tests and the launch-latency
//! benchmark run it as their worker. Under the threads process model
//! (`accel launch --backend xla`) it enters through `accel::run`, and each
//! rank thread prints its line with its rank tag.

use std::process::ExitCode;
use std::time::Instant;

use accel_api::{Result, StoreExt};

/// Arguments of `accel probe-worker`.
#[derive(Debug, clap::Args)]
pub struct ProbeArgs {
    /// Skip the store barrier (only read and print the process state).
    #[arg(long)]
    no_barrier: bool,

    /// Also connect through `accel::Accelerator::new()` (backend chosen by
    /// probe or ACCEL_BACKEND) and all-reduce `rank + 1`.
    #[arg(long)]
    accelerator: bool,

    /// With --accelerator: this rank never enters the all-reduce (it sleeps
    /// for two minutes instead, as a hung rank would; tests timeouts).
    #[arg(long, value_name = "RANK")]
    absent_rank: Option<usize>,

    /// With --accelerator: this rank exits 0 right after connecting while
    /// the others enter the all-reduce (a rank that returns early; tests
    /// the root cause).
    #[arg(long, value_name = "RANK")]
    exit_early_rank: Option<usize>,

    /// With --accelerator: the number of f64 elements all-reduced.
    #[arg(long, value_name = "N", default_value_t = 1)]
    elements: usize,

    /// Panic on this rank after the barrier (tests the error-file path).
    #[arg(long, value_name = "RANK")]
    panic_on_rank: Option<usize>,

    /// Call abort() on this rank after the barrier: a bare abort, with no
    /// message of Rust's (tests the root cause of rank threads).
    #[arg(long, value_name = "RANK", hide = true)]
    abort_on_rank: Option<usize>,

    /// Stay alive this many seconds after printing (tests what happens to
    /// workers when the launcher dies).
    #[arg(long, value_name = "SECS")]
    hold: Option<u64>,

    /// With --accelerator, after printing: make a mismatched all_reduce
    /// (`length`: rank r passes 10 + r elements; `reduction`: sum on rank
    /// 0, max elsewhere; `dtype`: f32 on rank 0, i32 elsewhere; `kind`:
    /// broadcast on rank 0). Tests the call check.
    #[arg(long, value_name = "WHAT")]
    mismatch: Option<Mismatch>,

    /// With --accelerator, after printing: this rank sleeps --stall-secs
    /// while the others enter another all_reduce (tests the stall inspector).
    #[arg(long, value_name = "RANK")]
    stall_rank: Option<usize>,

    /// How long --stall-rank sleeps.
    #[arg(long, value_name = "SECS", default_value_t = 60)]
    stall_secs: u64,
}

/// What `--mismatch` makes the ranks disagree on.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Mismatch {
    Length,
    Reduction,
    Dtype,
    Kind,
}

/// The mismatched call of `--mismatch` on `rank`.
fn mismatched(comm: &dyn accel_api::Communicator, what: Mismatch, rank: usize) -> Result<()> {
    use accel_api::{CommunicatorExt, ReduceOp};
    let first = rank == 0;
    match what {
        Mismatch::Length => comm.all_reduce_slice(&mut vec![1.0f32; 10 + rank], ReduceOp::Sum),
        Mismatch::Reduction => {
            let op = if first { ReduceOp::Sum } else { ReduceOp::Max };
            comm.all_reduce_slice(&mut [1.0f32; 4], op)
        }
        Mismatch::Dtype if first => comm.all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum),
        Mismatch::Dtype => comm.all_reduce_slice(&mut [1i32; 4], ReduceOp::Sum),
        Mismatch::Kind if first => comm.broadcast_slice(&mut [7.0f32; 4], 0),
        Mismatch::Kind => comm.all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum),
    }
}

#[derive(Debug, serde::Serialize)]
struct Seen {
    pid: u32,
    rank: usize,
    world_size: usize,
    local_rank: usize,
    local_world_size: usize,
    node_rank: usize,
    run_id: String,
    store: Option<String>,
    restart_count: u32,
    barrier_ms: Option<f64>,
    backend: Option<String>,
    all_reduce_sum: Option<f64>,
}

pub fn run(args: ProbeArgs) -> Result<ExitCode> {
    accel::install_panic_hook();
    if accel::state::process_state()?.process_model == accel::ProcessModel::Threads {
        // One process of rank threads (`accel launch --backend xla`): each
        // rank thread connects and does what a worker process would.
        accel::run(|acc| rank(&args, Some(acc)))?;
    } else {
        rank(&args, None)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// One rank's part; `acc`: already connected (a rank thread).
fn rank(args: &ProbeArgs, acc: Option<&accel::Accelerator>) -> Result<()> {
    let state = accel::state()?;
    let mut barrier_ms = None;
    if !args.no_barrier && state.store_location()?.is_some() {
        let t = Instant::now();
        // The state's store: rank 0 hosts it when the environment says so.
        let store = state.open_store()?;
        store.barrier(
            &format!("accel-probe/{}", state.restart_count),
            state.world_size,
            state.timeout,
        )?;
        barrier_ms = Some(t.elapsed().as_secs_f64() * 1e3);
    }
    let (mut backend, mut all_reduce_sum) = (None, None);
    let own;
    let mut connected: Option<&accel::Accelerator> = None;
    if args.accelerator {
        let a = match acc {
            Some(a) => a,
            None => {
                own = accel::Accelerator::new()?;
                &own
            }
        };
        if args.exit_early_rank == Some(state.rank) {
            std::process::exit(0);
        }
        if args.absent_rank == Some(state.rank) {
            std::thread::sleep(std::time::Duration::from_secs(120));
            std::process::exit(1);
        }
        let mut v = vec![state.rank as f64 + 1.0; args.elements.max(1)];
        a.all_reduce(&mut v, accel_api::ReduceOp::Sum)?;
        backend = Some(a.backend_name().to_string());
        all_reduce_sum = Some(v[0]);
        connected = Some(a);
    }
    let seen = Seen {
        pid: std::process::id(),
        rank: state.rank,
        world_size: state.world_size,
        local_rank: state.local_rank,
        local_world_size: state.local_world_size,
        node_rank: state.node_rank,
        run_id: state.run_id.clone(),
        store: state.store_location()?,
        restart_count: state.restart_count,
        barrier_ms,
        backend,
        all_reduce_sum,
    };
    let line = serde_json::to_string(&seen).unwrap_or_default();
    if acc.is_some() {
        // A rank thread: the line carries its rank for the launcher.
        accel::rank_println!("{line}");
    } else {
        outln!("{line}");
    }
    if let Some(a) = connected {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        if let Some(what) = args.mismatch {
            mismatched(&**a.comm(), what, state.rank)?;
        }
        match args.stall_rank {
            Some(r) if r == state.rank => {
                std::thread::sleep(std::time::Duration::from_secs(args.stall_secs))
            }
            Some(_) => a.all_reduce(&mut [1.0f32], accel_api::ReduceOp::Sum)?,
            None => {}
        }
    }
    if args.abort_on_rank == Some(state.rank) {
        std::process::abort();
    }
    if args.panic_on_rank == Some(state.rank) {
        panic!("probe-worker: deliberate panic on rank {}", state.rank);
    }
    if let Some(secs) = args.hold {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::thread::sleep(std::time::Duration::from_secs(secs));
    }
    Ok(())
}
