//! # accel-backend-cuda-nccl: accel on NVIDIA NCCL
//!
//! The `cuda-nccl` backend drives [NCCL] through [cudarc]'s `nccl` and
//! `driver` bindings with `dynamic-loading`: `libcuda.so` and `libnccl.so`
//! are opened at run time, so the crate builds and its probe runs on a
//! machine with no CUDA at all (the probe then says why it is unavailable).
//!
//! ## Probe
//!
//! Never panics. In order: is `libcuda.so` loadable (and has the symbols the
//! probe calls), does `cuInit` succeed, how many devices are visible (after
//! `CUDA_VISIBLE_DEVICES`), the driver's CUDA version, is `libnccl.so`
//! loadable with every symbol the backend calls, NCCL's version. The
//! first "no" is the reason `accel env` prints; the version column reads
//! `NCCL 2.28.3, CUDA driver 13.0, CUDA_VISIBLE_DEVICES=0`.
//!
//! **`libnccl.so` vs `libnccl.so.2`.** cudarc opens `libnccl.so`; the NCCL
//! wheels on PyPI (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`) ship only
//! `libnccl.so.2`, and the loader reads `LD_LIBRARY_PATH` at process start
//! only. Start the program with a folder holding a `libnccl.so` link on
//! `LD_LIBRARY_PATH`: `scripts/nccl_libdir.sh` prints one (it links the
//! `libnccl.so.2` it finds, from `ACCEL_NCCL_LIB`, the `nvidia.nccl` Python
//! package or the loader cache, into `~/.cache/accel/nccl-link`),
//! [`prepare_link_dir`] does the same from Rust (for a launcher, before it
//! starts workers), and the probe's reason names the library it found when
//! only the `.2` name exists.
//!
//! ## Testing without a GPU
//!
//! `tests/probe_stub.rs` runs the probe in child processes against no
//! driver and stub libraries; `tests/fake_device.rs` runs the whole engine
//! (and the shared conformance suite at world size 1) against a fake
//! host-memory driver and a fake one-rank NCCL built from `tests/fake/*.c`,
//! and two ranks as threads over a threaded fake NCCL.
//! Both are glue tests: they show that the backend calls the libraries as
//! intended and handles their answers, never that it works on a GPU.
//! `tests/gpu.rs` is the real thing; it skips without a GPU unless
//! `ACCEL_REQUIRE_GPU=1`, and `scripts/gpu_check.sh` runs it on a lent
//! machine.
//!
//! ## Connect
//!
//! Rank 0 makes the 128-byte NCCL unique id and publishes it in accel's
//! [`Store`](accel_api::Store) under `cuda-nccl/<n>/id` (`n` counts this
//! rank's connects on that store); the other ranks read it, every rank
//! passes a store barrier (so a missing rank is named by count within the
//! timeout instead of hanging in NCCL's bootstrap), then
//! `ncclCommInitRankConfig` runs in **non-blocking** mode and is polled
//! until ready or the timeout, after which it is aborted. Each communicator
//! owns one CUDA stream (non-blocking) on the device's primary context.
//!
//! ## What is supported
//!
//! | operation | element types | how |
//! |---|---|---|
//! | all_reduce, reduce, reduce_scatter | all eight (bf16 too) | `ncclAllReduce`, `ncclReduce`, `ncclReduceScatter` with sum, prod, min, max and NCCL's native `ncclAvg` |
//! | broadcast, all_gather | all eight | `ncclBroadcast`, `ncclAllGather` |
//! | gather, scatter, all_to_all | all eight | `ncclSend`/`ncclRecv` inside one `ncclGroupStart`/`ncclGroupEnd` |
//! | send, recv | all eight | a 16-byte header (bytes, dtype, tag) then the payload, so a receive of the wrong size, type or tag is an `InvalidArgument` error (the message is drained and dropped) instead of a hang; NCCL delivers in order, so tags must match in order; device sends to self go through a device mailbox |
//! | barrier | - | a one-element all-reduce and a stream sync (NCCL has no barrier) |
//! | split | - | `ncclCommSplit` (non-blocking, polled) |
//!
//! Device views ([`accel_api::DeviceBuf`]) come from a framework adapter,
//! from [`cudarc_view`]/[`cudarc_view_mut`] (cudarc slices) or from
//! [`DeviceBuffer`] (memory this crate allocates), and must be on the
//! communicator's device; the communicator's stream waits (an event) for the work queued
//! on the view's stream before the call, and the call returns once the
//! result is complete. **Host buffers** are supported by staging: they are
//! copied into device memory the communicator keeps (grown on demand),
//! reduced there, and copied back: correct, but it adds two copies over
//! PCIe per call. `Avg` on floating point types is NCCL's (each
//! contribution multiplied by `1/n`, then summed), which can round
//! differently from sum-then-divide in the last place.
//!
//! ## Failures
//!
//! NCCL hangs where Gloo returns, so nothing here waits on NCCL or CUDA
//! unboundedly: each call polls `ncclCommGetAsyncError` and
//! `cuStreamQuery` until the call's deadline ([`Communicator::timeout`]).
//! On a timeout, an NCCL error (a remote error becomes
//! [`ErrorKind::PeerLost`]) or [`Communicator::abort`] the communicator is
//! aborted with `ncclCommAbort`, the error is fatal (the group poisons
//! itself), and the rank publishes the cause under
//! `cuda-nccl/<n>/fault/<rank>`: a peer that times out afterwards names
//! this rank as the first failure. Messages read
//! `[cuda-nccl rank 1] all_reduce: timed out after 30s: the NCCL all_reduce
//! (1024 f32) on cuda:1 did not complete; the NCCL communicator was
//! aborted; rank 0 failed first: ...`.
//!
//! ## Threads
//!
//! cudarc's safe `Comm` is `!Send`/`!Sync`; this crate drives NCCL through
//! cudarc's `sys` layer with its own handle (`ffi::Comm`), which is
//! `Send + Sync` by an `unsafe impl` justified in `ffi.rs`: NCCL allows a
//! communicator on any thread when calls do not overlap (the group's call
//! lock serialises them and the engine binds the device's context first);
//! only `ncclCommGetAsyncError`/`ncclCommAbort` run outside it.
//! (docs/adr/0013-cuda-nccl.md.)
//!
//! [NCCL]: https://developer.nvidia.com/nccl
//! [cudarc]: https://crates.io/crates/cudarc
//! [`Communicator::timeout`]: accel_api::Communicator::timeout
//! [`Communicator::abort`]: accel_api::Communicator::abort
//! [`ErrorKind::PeerLost`]: accel_api::ErrorKind::PeerLost
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod buffer;
mod engine;
mod error;
// The FFI boundary: cudarc `sys` calls, owned handles, the Send/Sync impls.
#[allow(unsafe_code)]
mod ffi;
mod name;
mod probe;

use std::sync::Arc;
use std::time::Instant;

use accel_api::kit::{Group, StaticBackend, PRIORITY_CUDA};
use accel_api::{ConnectContext, DeviceKind, Error, ErrorKind, Result, StoreExt};

pub use buffer::{cudarc_view, cudarc_view_mut, DeviceBuffer};
/// The cudarc this backend is built on (`=0.19.10`): name its types
/// through this path so that [`cudarc_view`] accepts your slices.
pub use cudarc;
pub use name::NAME;
pub use probe::{candidate_dirs, inspect, prepare_link_dir, ProbeReport};

// The crate's face (ADR 0034): the record, the name, device memory and
// views (above), the probe's report and the link folder. Its own tests and
// examples reach the communicator's concrete type through `__test`.
use engine::{NcclCommunicator, NcclEngine, Shared};
use error::NcclFailure;

/// The `cuda-nccl` backend: its registration record.
pub const BACKEND: StaticBackend =
    StaticBackend::new(NAME, PRIORITY_CUDA, DeviceKind::Cuda, probe::probe, |ctx| {
        Ok(Box::new(connect(ctx)?))
    });

/// Connect the world communicator of this rank (what [`BACKEND`]'s
/// `connect` does, with the concrete type).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] for a rank outside the world or a device
/// that is not a visible CUDA device; [`ErrorKind::Unavailable`] with the
/// probe's reason; [`ErrorKind::Timeout`] when peers did not join (naming
/// how many did) or NCCL's initialisation did not finish;
/// [`ErrorKind::Backend`] for NCCL's refusals (two ranks on one GPU).
fn connect(ctx: ConnectContext) -> Result<NcclCommunicator> {
    ctx.check(NAME, DeviceKind::Cuda)?;
    let fail = |e: Error| e.with_op("connect").with_backend(NAME).with_rank(ctx.rank);
    let report = probe::inspect();
    if let Some(why) = &report.unavailable {
        return Err(fail(Error::from(NcclFailure::Unavailable(why.clone()))));
    }
    let index = ctx.device.index as usize;
    if index >= report.devices {
        return Err(fail(
            Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "{} is not among the {} visible CUDA devices",
                    ctx.device, report.devices
                ),
            )
            .with_fix("start at most one rank per visible GPU (CUDA_VISIBLE_DEVICES)"),
        ));
    }
    let start = Instant::now();
    let cuda = cudarc::driver::CudaContext::new(index).map_err(|e| {
        fail(Error::from(NcclFailure::driver(
            "cuDevicePrimaryCtxRetain",
            e,
        )))
    })?;
    let generation = ctx
        .store
        .add(&format!("{NAME}/connects/{}", ctx.rank), 1)
        .map_err(fail)?;
    let prefix = format!("{NAME}/{generation}");
    let id_key = format!("{prefix}/id");
    let id: [u8; 128] = if ctx.rank == 0 {
        let id = ffi::unique_id().map_err(|e| fail(e.into()))?;
        ctx.store.set(&id_key, &id).map_err(fail)?;
        id
    } else {
        let v = ctx.store.get(&id_key, ctx.timeout).map_err(|e| {
            fail(e)
                .with_fix("rank 0 publishes the NCCL id: check that it started and reached connect")
        })?;
        v.as_slice().try_into().map_err(|_| {
            fail(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "store key {id_key} holds {} bytes, not a 128-byte NCCL id",
                    v.len()
                ),
            ))
        })?
    };
    let left = ctx.timeout.saturating_sub(start.elapsed());
    ctx.store
        .barrier(&format!("{prefix}/joined"), ctx.world_size, left)
        .map_err(fail)?;
    let shared = Arc::new(Shared {
        ctx: cuda,
        store: ctx.store.clone(),
    });
    let engine = NcclEngine::init(
        shared,
        prefix,
        ctx.rank,
        ctx.world_size,
        ctx.device,
        ctx.timeout,
        start + ctx.timeout,
        &id,
    )
    .map_err(|e| fail(e.into()))?;
    Ok(Group::new(engine))
}

accel_api::kit::submit_backend!(|| Box::new(BACKEND));

/// Not API: what this crate's own tests and examples reach beyond its face.
#[doc(hidden)]
pub mod __test {
    pub use crate::engine::{capabilities, NcclCommunicator, NcclEngine};

    /// The world communicator with its concrete type.
    pub fn connect(ctx: accel_api::ConnectContext) -> accel_api::Result<NcclCommunicator> {
        crate::connect(ctx)
    }

    /// The NCCL symbols the backend calls; the probe finds every one
    /// before using the library.
    pub fn required_nccl_symbols() -> &'static [&'static str] {
        crate::ffi::NCCL_SYMBOLS
    }

    /// The CUDA driver symbols a communicator calls; the probe finds every
    /// one before using the driver.
    pub fn required_driver_symbols() -> &'static [&'static str] {
        crate::ffi::DRIVER_SYMBOLS
    }
}
