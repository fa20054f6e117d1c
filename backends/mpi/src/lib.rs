//! # accel-backend-mpi: accel on MPI, with the timeouts MPI lacks
//!
//! The `mpi` backend drives the system's MPI library (Open MPI, or MPICH
//! and its derivatives) through rsmpi's `mpi-sys` bindings
//! (`mpi = { version = "0.8", default-features = false }`: no libffi).
//! Programs run under `mpirun -n N`, `mpiexec`, `srun`, or
//! `accel launch --backend mpi` (whose command line the launch library,
//! `accel-launch`, builds: launching links no MPI).
//!
//! ## Building
//!
//! `mpi-sys` finds MPI with `mpicc -show` (or pkg-config) and generates
//! its bindings with bindgen, which needs libclang. On Debian/Ubuntu:
//! `apt-get install libopenmpi-dev openmpi-bin libclang-dev` (what
//! `make setup` installs).
//!
//! ## Probe and connect
//!
//! * **Probe** (cheap, no `MPI_Init`): available when an MPI launcher
//!   started the process (`OMPI_COMM_WORLD_RANK`, `PMIX_RANK`, `PMI_RANK`,
//!   `PMI_SIZE` or `MV2_COMM_WORLD_RANK` is set, or
//!   [`ProbeContext::mpi_launched`]); priority [`PRIORITY_MPI`], above
//!   cpu-gloo. Otherwise unavailable, saying so. The engine version is
//!   `MPI_Get_library_version`.
//! * **Connect** initializes MPI once per process (`MPI_Init_thread`
//!   asking for `MPI_THREAD_MULTIPLE`, which the blocking path needs; a
//!   program that initialized MPI itself keeps its initialization, and its
//!   thread level is read with `MPI_Query_thread`), registers
//!   `MPI_Finalize` to run at process exit,
//!   and checks MPI's view of the world against the [`ConnectContext`]: a
//!   binary started by the *other* implementation's launcher (Open MPI
//!   binary under MPICH's mpiexec, say) sees N one-rank jobs, which is an
//!   [`ErrorKind::InvalidConfig`] naming both numbers. Each connect then
//!   duplicates `MPI_COMM_WORLD` (`MPI_Comm_idup`, bounded by the
//!   timeout), so communicators never share message matching.
//!
//! ## What is supported
//!
//! Every operation, element type and reduction on host memory:
//!
//! | operation | MPI call, above the staging size (blocking) | up to it (non-blocking, polled) |
//! |---|---|---|
//! | all_reduce, reduce | `MPI_Allreduce`, `MPI_Reduce` (in place at the root) | `MPI_Iallreduce`, `MPI_Ireduce` |
//! | broadcast | `MPI_Bcast` | `MPI_Ibcast` |
//! | all_gather, gather, scatter | `MPI_Allgather`, `MPI_Gather`, `MPI_Scatter` | `MPI_Iallgather`, `MPI_Igather`, `MPI_Iscatter` |
//! | reduce_scatter | `MPI_Reduce_scatter_block` | `MPI_Ireduce_scatter_block` |
//! | all_to_all | `MPI_Alltoall` | `MPI_Ialltoall` |
//! | send | a 16-byte header message (byte count, element type), then `MPI_Send` | the header, then `MPI_Isend`; sends to self go through an in-process mailbox (buffered) |
//! | recv | `MPI_Improbe` + `MPI_Imrecv` at every size: the header first, then the payload only when its element type and size are the buffer's; otherwise the payload is dropped and the call fails with `InvalidArgument` naming both, the buffer untouched (MPI carries no element type: the header does, as cpu-gloo's) | |
//! | barrier | | `MPI_Ibarrier` (no buffer) |
//! | split | | `(color, key)` exchanged with a timed all-gather whatever its size, then `MPI_Comm_split` |
//!
//! `avg` is a sum followed by a division on the host (integers truncate
//! toward zero). MPI has no 16-bit float types: f16 and bf16 move as
//! opaque 16-bit units, and reduce in f32 (widened, reduced by MPI, divided
//! for `avg`, rounded back once), which is at least as accurate as a
//! reduction in the 16-bit type. Integer sums and products wrap as MPI's
//! C arithmetic does. Element counts per rank are limited to `2^31 - 1`
//! (MPI's `int` counts); tags to `MPI_TAG_UB` (2^31 - 1 in Open MPI).
//!
//! ## Timeouts MPI does not have
//!
//! MPI cannot cancel a collective, so what a timeout does depends on which
//! of two paths an operation takes (ADR 0017; the staging size is
//! `ACCEL_MPI_STAGING_BYTES`, default 8 KiB, compared with the operation's
//! largest buffer):
//!
//! * **Up to the staging size, and every barrier, receive and `split`
//!   exchange: non-blocking, and a timeout returns.** The operation runs
//!   on memory the communicator owns (copied in and out), started
//!   non-blocking (`MPI_I*`) and polled with `MPI_Test` (spinning briefly,
//!   then yielding, then sleeping 200 µs between polls) until it completes
//!   or [`Communicator::timeout`] passes. Then the call fails with
//!   [`ErrorKind::Timeout`] naming the operation, the communicator is
//!   poisoned, the pending request and its memory are leaked, and the
//!   process (and the rest of the MPI job) carries on: the program decides.
//!   A receive that times out before a message arrived leaves nothing
//!   pending.
//! * **Above it: the blocking MPI call, in place, under a watchdog.** The
//!   blocking collectives (`coll/tuned` in Open MPI) are 1.5–7× faster
//!   than the non-blocking ones (`coll/libnbc`), and zero-copy. Each
//!   communicator has a watchdog; when a call outlives the timeout, it
//!   prints the same `Timeout` text with how long the call has been
//!   blocked, writes it to
//!   [`ACCEL_ERROR_FILE`](accel_api::worker::keys::ACCEL_ERROR_FILE) (which
//!   `accel launch` shows in its root-cause block), and ends the job with
//!   `MPI_Abort` (exit code 124; mpirun then names the rank). It cannot return: the calling
//!   thread is inside MPI, and MPI cannot cancel the call.
//!
//! The blocking path needs `MPI_THREAD_MULTIPLE` (a blocking call holds no
//! lock, so a call waiting for a late rank never stops other threads' MPI
//! calls). When MPI grants less (a program that initialized MPI itself at
//! a lower level, or a library built without thread support), or with
//! `ACCEL_MPI_BLOCKING=0`, every operation is non-blocking and polled, as
//! before ADR 0017: large operations then run on the caller's memory and
//! their timeout aborts the job too (printed, `MPI_Abort` with 124).
//! The engine's `blocking_collectives` and `threading_level` say which
//! applies.
//!
//! A rank that dies takes the job down: Open MPI's mpirun kills the others
//! and prints which rank exited and how.
//!
//! A rank that *ends* early (returns, exits with 0, drops its
//! communicator) is invisible to MPI: it waits in `MPI_Finalize` while the
//! others wait for it. Each rank of a world communicator therefore keeps a
//! progress record in the run's store (collectives entered, whether it
//! ended, a beat every 250 ms; ADR 0021), and a call that waits reads its
//! peers' records about every 200 ms: a peer that ended before entering
//! the collective fails the call with `PeerLost` naming it (non-blocking
//! path; when its process exited, the error file names it and this process
//! ends the MPI job at its exit) or ends the job at once from the watchdog
//! (blocking path). At a timeout the records name the ranks that had not
//! entered the call, or whose process froze, in the message and in the
//! error record, instead of the rank that waited. Without a shared store
//! (bare `mpirun`) the timeouts apply.
//!
//! Calls on one communicator take turns (a mutex); the non-blocking calls
//! of the process are serialised by a second lock.
//! [`Communicator::abort`] poisons the communicator but cannot interrupt a
//! call in flight (`abort_interrupts` is `false`).
//!
//! ## Environment
//!
//! | variable | effect |
//! |---|---|
//! | `ACCEL_MPI_STAGING_BYTES` | largest buffer whose operation runs non-blocking on owned memory, so that its timeout returns (default 8192; `0`: every collective with a buffer runs blocking) |
//! | `ACCEL_MPI_BLOCKING` | `1` (default): operations above the staging size call the blocking MPI function under the watchdog; `0`: every operation non-blocking and polled (slower; large ones still abort the job on timeout) |
//! | `ACCEL_MPI_STARTED` | how a call started without waiting (`Communicator::start`) waits on the group's worker thread: `poll` (default): `MPI_I*` polled with `MPI_Test` and growing pauses, leaving the cores to the caller's compute; `block`: the blocking call under the watchdog (faster algorithms, but Open MPI spins a core while it waits) |
//!
//! [`ErrorKind::InvalidConfig`]: accel_api::ErrorKind::InvalidConfig
//! [`ErrorKind::Timeout`]: accel_api::ErrorKind::Timeout
//! [`Communicator::timeout`]: accel_api::Communicator::timeout
//! [`Communicator::abort`]: accel_api::Communicator::abort
//! [`ProbeContext::mpi_launched`]: accel_api::ProbeContext::mpi_launched
#![warn(missing_docs)]
#![deny(unsafe_code)]

mod engine;
mod error;
// Every raw MPI call lives here, behind handle newtypes.
#[allow(unsafe_code)]
mod ffi;
mod name;
mod probe;
mod progress;
mod registry;
mod watchdog;

use std::sync::Arc;
use std::time::Instant;

use accel_api::kit::{StaticBackend, PRIORITY_MPI};
use accel_api::{ConnectContext, DeviceKind, Error, ErrorKind, Result};

// The crate's face is its record and its name (ADR 0034); its own tests
// reach the rest through `__test`.
pub use name::NAME;

use engine::{poll, timed_out, MpiCommunicator, MpiEngine, Shared, Waited, DEFAULT_STAGING_BYTES};

/// The `mpi` backend.
pub const BACKEND: StaticBackend =
    StaticBackend::new(NAME, PRIORITY_MPI, DeviceKind::Cpu, probe::probe, |ctx| {
        Ok(Box::new(connect(ctx)?))
    });

/// A two-way setting: `on` (or unset, or empty) is `true`, `off` is
/// `false`, anything else an error naming the variable with `fix`.
fn switch_from_env(key: &str, on: &str, off: &str, fix: &str) -> Result<bool> {
    match std::env::var(key) {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            t if t.is_empty() || t == on => Ok(true),
            t if t == off => Ok(false),
            _ => Err(Error::invalid_config(key, &v, fix).with_backend(NAME)),
        },
    }
}

/// `ACCEL_MPI_BLOCKING`: `1` (the default) or `0`.
fn blocking_from_env() -> Result<bool> {
    switch_from_env(
        "ACCEL_MPI_BLOCKING",
        "1",
        "0",
        "must be 1 (blocking collectives above ACCEL_MPI_STAGING_BYTES, the default) or 0 (every operation non-blocking, polled)",
    )
}

/// `ACCEL_MPI_STARTED`: `true` (`poll`, the default) or `false` (`block`).
fn started_poll_from_env() -> Result<bool> {
    switch_from_env(
        "ACCEL_MPI_STARTED",
        "poll",
        "block",
        "must be poll (started calls polled with pauses, the default) or block (the blocking MPI call on the worker thread)",
    )
}

fn staging_from_env() -> Result<usize> {
    match std::env::var("ACCEL_MPI_STAGING_BYTES") {
        Err(_) => Ok(DEFAULT_STAGING_BYTES),
        Ok(v) => v.trim().parse::<usize>().map_err(|_| {
            Error::invalid_config("ACCEL_MPI_STAGING_BYTES", &v, "not a number of bytes")
                .with_backend(NAME)
        }),
    }
}

/// Connect the world communicator of this rank (what [`BACKEND`] does,
/// with the concrete type).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a rank outside the world, a non-CPU
/// device, or an MPI world that contradicts the context (the binary was
/// started by another MPI's launcher, or not by one at all with several
/// ranks); [`ErrorKind::Backend`] when `MPI_Init` fails;
/// [`ErrorKind::Timeout`] when the other ranks did not connect in time.
fn connect(ctx: ConnectContext) -> Result<MpiCommunicator> {
    let fail = |kind: ErrorKind, msg: String| {
        Error::new(kind, msg)
            .with_op("connect")
            .with_backend(NAME)
            .with_rank(ctx.rank)
    };
    ctx.check(NAME, DeviceKind::Cpu)?;
    let staging = staging_from_env()?;
    let blocking = blocking_from_env()?;
    let started_poll = started_poll_from_env()?;
    let init = ffi::init().map_err(|e| {
        fail(ErrorKind::Backend, format!("MPI_Init_thread failed: {e}"))
            .with_fix("start the program with the mpirun of the MPI it was built against")
    })?;
    if init.world_size != ctx.world_size || init.world_rank != ctx.rank {
        return Err(fail(
            ErrorKind::InvalidConfig,
            format!(
                "MPI says this is rank {} of {}, but the environment says rank {} of {}: the program was started by another MPI implementation's launcher than the one it was built against ({}), or not by an MPI launcher",
                init.world_rank, init.world_size, ctx.rank, ctx.world_size, init.library
            ),
        )
        .with_fix(format!(
            "start it with the mpirun of {} (`mpirun --version` names the implementation)",
            init.library
        )));
    }
    let shared = Arc::new(Shared {
        library: init.library.clone(),
        tag_ub: init.tag_ub,
        staging,
        threading: ffi::threading_name(init.threading),
        initialized_here: init.initialized_here,
        // Blocking calls hold no lock only under MPI_THREAD_MULTIPLE;
        // below it a blocking call on one communicator could stop every
        // other thread's MPI calls, so everything stays non-blocking.
        blocking: blocking && ffi::is_multiple(init.threading),
        started_poll,
        world_rank: init.world_rank,
    });
    let start = Instant::now();
    let req = ffi::Comm::world()
        .idup()
        .map_err(|e| fail(ErrorKind::Backend, format!("MPI_Comm_idup failed: {e}")))?;
    let comm = match poll(req, start, ctx.timeout) {
        Ok(done) => done.into_comm().ok_or_else(|| {
            fail(
                ErrorKind::Backend,
                "MPI_Comm_idup completed without a communicator".into(),
            )
        })?,
        Err(Waited::Failed(e)) => {
            return Err(fail(
                ErrorKind::Backend,
                format!("MPI_Comm_idup failed: {e}"),
            ))
        }
        // `poll` has no check that stops it.
        Err(Waited::Stopped(_, e)) => return Err(e),
        Err(Waited::TimedOut(req)) => {
            return Err(timed_out(
                req,
                ctx.rank,
                "connect",
                ctx.timeout,
                ctx.world_size,
                &[],
            ))
        }
    };
    // A fresh prefix per connect on this store (a process may connect more
    // than once), for the progress records (see `progress`).
    // A run that names no store (plain mpirun, srun) keeps no records: MPI
    // bootstraps without one, and the timeouts still apply (ADR 0021).
    let record = match ctx.store.add(&format!("mpi/connects/{}", ctx.rank), 1) {
        Ok(generation) => Some(progress::Progress::start(
            ctx.store.clone(),
            format!("mpi/{generation}"),
            ctx.rank,
            ctx.world_size,
        )),
        Err(_) => None,
    };
    let info = accel_api::kit::EngineInfo::world(NAME, &ctx, engine::capabilities());
    Ok(accel_api::kit::Group::new(MpiEngine::new(
        comm, info, shared, record,
    )))
}

accel_api::kit::submit_backend!(|| Box::new(BACKEND));

/// Not API: what this crate's own tests reach beyond the record (the
/// engine's concrete types, its version, the staging default).
#[doc(hidden)]
pub mod __test {
    pub use crate::engine::{capabilities, MpiCommunicator, MpiEngine, DEFAULT_STAGING_BYTES};
    pub use crate::probe::{engine_version, launched_by_mpi, LAUNCHER_VARIABLES};

    /// The world communicator with its concrete type.
    pub fn connect(ctx: accel_api::ConnectContext) -> accel_api::Result<MpiCommunicator> {
        crate::connect(ctx)
    }
}
