//! `accel flight-worker` (hidden): the hangs `accel trace` reads, made on
//! purpose (the flight recorder's tests and docs/debugging.md's example).
//! Every scenario all-reduces 4 `f32`s per step through
//! `accel::Accelerator::new()` (the backend of `--backend` /
//! `ACCEL_BACKEND`) and prints `ready` once the ranks are connected (the
//! SIGUSR1 handler is installed by then).
//!
//! * `skip`: rank `--rank` skips the all-reduce of step `--at`, as a
//!   rank that took another branch, and computes for `--stall` before its
//!   next step: the others time out waiting for it.
//! * `crossed`: ranks 0 and 1 make two sub-groups, A and B, of the two of
//!   them; rank 0 all-reduces on A then B, rank 1 on B then A: each waits
//!   for the other. The other ranks wait at a world barrier.
//! * `steady`: `--steps` healthy steps, `--step-ms` apart (a job to dump
//!   while it runs).
//!
//! A failed collective ends the rank with a panic (the panic hook writes
//! the error file and a dump).

use std::process::ExitCode;
use std::time::Duration;

use accel_api::{Communicator, CommunicatorExt, ReduceOp, Result};

/// What the worker does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// One rank skips one all-reduce.
    Skip,
    /// Two ranks call two sub-groups in opposite orders.
    Crossed,
    /// A healthy job.
    Steady,
}

/// Arguments of `accel flight-worker`.
#[derive(Debug, clap::Args)]
pub struct FlightWorkerArgs {
    /// The scenario.
    #[arg(long, value_enum)]
    scenario: Scenario,
    /// `skip`: the rank that skips.
    #[arg(long, default_value_t = 2)]
    rank: usize,
    /// `skip`: the step whose all-reduce it skips.
    #[arg(long, default_value_t = 3)]
    at: usize,
    /// Steps (all-reduces) in all.
    #[arg(long, default_value_t = 6)]
    steps: usize,
    /// Time between steps, in milliseconds.
    #[arg(long, default_value_t = 0)]
    step_ms: u64,
    /// `skip`: how long the skipping rank computes in its other branch.
    #[arg(long, default_value_t = 60)]
    stall_s: u64,
}

fn step(comm: &dyn Communicator, i: usize) -> Result<()> {
    let mut v = [i as f32; 4];
    comm.all_reduce_slice(&mut v, ReduceOp::Sum)
}

/// Run the worker.
///
/// # Errors
/// Connecting; a failed collective panics instead (so that the panic hook
/// reports it and dumps).
pub fn run(a: FlightWorkerArgs) -> Result<ExitCode> {
    let acc = accel::Accelerator::new()?;
    let comm = acc.comm().clone();
    let rank = acc.rank();
    let pause = || std::thread::sleep(Duration::from_millis(a.step_ms));
    // One collective first, so that `ready` means every rank is connected.
    step(&*comm, 0).expect("the first all-reduce");
    accel::rank_println!("ready");
    match a.scenario {
        Scenario::Steady => {
            for i in 1..a.steps {
                step(&*comm, i).expect("all-reduce");
                accel::rank_println!("step {i}");
                pause();
            }
        }
        Scenario::Skip => {
            for i in 1..a.steps {
                if rank == a.rank && i == a.at {
                    // The other branch: no all-reduce, a long computation.
                    std::thread::sleep(Duration::from_secs(a.stall_s));
                    continue;
                }
                step(&*comm, i).unwrap_or_else(|e| panic!("step {i}: {e}"));
                pause();
            }
        }
        Scenario::Crossed => {
            let color = (rank < 2).then_some(1);
            let a_group = comm.split(color, rank as u32).expect("split A");
            let b_group = comm.split(color, rank as u32).expect("split B");
            match (a_group, b_group) {
                (Some(ga), Some(gb)) => {
                    let (first, second) = if rank == 0 { (ga, gb) } else { (gb, ga) };
                    step(&*first, 1).unwrap_or_else(|e| panic!("first sub-group: {e}"));
                    step(&*second, 2).unwrap_or_else(|e| panic!("second sub-group: {e}"));
                }
                _ => comm
                    .barrier()
                    .unwrap_or_else(|e| panic!("world barrier: {e}")),
            }
        }
    }
    accel::rank_println!("done");
    Ok(ExitCode::SUCCESS)
}
