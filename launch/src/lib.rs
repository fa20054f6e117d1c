//! # accel-launch: process groups under one supervisor
//!
//! The library behind `accel launch`, the conformance harness and
//! `accel bench`: every way accel starts the processes of a run goes
//! through it.
//!
//! * [`group::ProcessGroup`]: how an attempt's processes are started,
//!   signalled and blamed, with three implementations, one file each:
//!   [`group::LocalGroup`] (one process per local rank),
//!   [`group::MpirunGroup`] (one `mpirun`/`mpiexec` for every rank) and
//!   [`group::ThreadsGroup`] (one process whose rank threads are the
//!   machine's ranks: the threads process model, ADR 0015).
//! * [`supervise::run_attempt`]: one supervisor for both: output pumping
//!   with `[rank N]` prefixes, `--tee` files, the rank filter, hang
//!   detection, fail-fast (SIGTERM, SIGKILL after the grace period), signal
//!   forwarding, a wall limit; [`supervise::run`]: one restart loop, the
//!   root-cause block, the summary and the `--json` record.
//! * [`coordinate::Coordinator`]: where the store is and how an attempt
//!   went across machines, one file per implementation under
//!   `coordinate/`: [`coordinate::HostedStore`] for one machine or one
//!   mpirun, [`coordinate::Machines`] for several machines' launchers (the
//!   join, heartbeats and machine loss, elastic rounds), so that the CLI,
//!   the conformance harness and `accel bench` run any of them.
//! * [`running`]: the record a running launcher keeps of itself (pid, run,
//!   dump folder), which `accel dump` reads to reach it.
//! * [`mpirun`]: the mpirun command builder and the readers of mpirun's
//!   output. It formats text only: nothing here links MPI.
//! * The worker environment itself is [`accel_api::worker::WorkerEnv`]
//!   (the worker protocol, below this crate: it does not depend on the
//!   `accel` facade).
//!
//! Unsafe code lives in [`ffi`] only (one `pre_exec` for the parent-death
//! signal).
#![deny(unsafe_code)]

pub mod coordinate;
mod event;
#[allow(unsafe_code)]
pub mod ffi;
pub mod group;
pub mod guard;
pub mod leftovers;
pub mod mpirun;
pub mod output;
pub mod program;
pub mod report;
pub mod running;
pub mod store;
pub mod supervise;

pub use accel_api::worker::{self as worker_env, WorkerEnv};
pub use coordinate::{Coordinator, EtcdRendezvous, HostedStore, Machines, MachinesConfig};
pub use group::{Attempt, Ended, LocalGroup, MpirunGroup, ProcessGroup, Program, ThreadsGroup};
pub use supervise::{run, run_attempt, RunOutcome, Supervision};

/// The most processes one machine starts (`-n`): each costs the launcher
/// three threads and two pipes, and far more would exhaust the kernel's
/// memory maps and kill the launcher. More is an error naming the limit.
pub const MAX_LOCAL_PROCESSES: usize = 1024;
