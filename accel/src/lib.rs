//! # accel
//!
//! Run one training or inference program unchanged on one process or many,
//! on CPU clusters, CUDA GPUs, XLA devices and Ascend NPUs. accel puts real
//! collective engines (Gloo, MPI, NCCL, PJRT, HCCL) behind the traits of
//! [`accel_api`] and owns everything around them: process discovery,
//! backend registry and probing, rendezvous, and execution control.
//!
//! ```no_run
//! let acc = accel::Accelerator::new()?;          // reads RANK/WORLD_SIZE/... once
//! let mut grads = vec![1.0f32; 4];
//! acc.all_reduce(&mut grads, accel::ReduceOp::Avg)?;
//! acc.print(format_args!("rank {} of {} done", acc.rank(), acc.world_size()));
//! # Ok::<(), accel::Error>(())
//! ```
//!
//! ## Map
//! * [`state()`] / [`ProcessState`]: who this process is, from the launcher's
//!   environment (accel launch, torchrun, OpenMPI, MPICH, MVAPICH, Slurm).
//! * [`Registry`]: compiled-in backends (one cargo feature each), plugins
//!   from `ACCEL_PLUGIN_PATH`, the probe table and `ACCEL_BACKEND`.
//! * [`Accelerator`]: the connected runtime and execution control.
//! * [`train`]: the training loop: `prepare` (map-style and streaming
//!   loaders, sharded or dispatched), gradient accumulation and bucketed
//!   gradient averaging, `gather_for_metrics`, RNG, triggers, exact-resume
//!   checkpoints (`save_state` / `load_state`), `save_model` in the Hugging
//!   Face layout, and trackers (JSON Lines, TensorBoard).
//! * [`Scalar`]: what gathers and reductions take: the engines' element
//!   types plus `u32`, `u64`, `usize` and `bool`, reduced exactly.
//! * [`install_panic_hook`]: root-cause reports for the launcher.
//! * [`run`] / [`Threads`]: ranks as threads of one process (the threads
//!   process model of `accel launch --backend xla`, and Accelerate's
//!   `notebook_launcher` / `debug_launcher`); on a rank thread, [`state()`]
//!   is that rank's.
//! * [`stall`]: the stall inspector: a timed-out collective names the ranks
//!   that never arrived and what they last entered.
//! * The contracts of [`accel_api`] by name ([`Communicator`], [`Store`],
//!   buffer views, [`DType`], [`ReduceOp`], [`Device`], [`Error`],
//!   [`Capabilities`], [`Layer`], [`Wrapper`], [`OffloadStore`], [`Backend`]
//!   and its probe, ...), the handles of work in flight ([`StartExt`],
//!   [`Work`], [`Pending`], [`OwnedBuf`], [`HostBytes`]; the started call
//!   itself in [`work`]), and [`worker`], the launcher-worker protocol.
//! * [`flight`]: flight-recorder dumps.
//! * [`watch`]: what a rank is doing now (section, step, phase times,
//!   straggler score), section timeouts, and the status files `accel top`
//!   reads.
//! * [`kit`]: for engine authors only (`Engine`, `Group`, the poll loop,
//!   `StaticBackend`, ...); never at this root (ADR 0034).
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod accelerator;
mod collectives;
mod debug;
#[cfg(doctest)]
mod doc_examples;
pub mod env_check;
#[cfg(test)]
mod face;
pub mod flight;
#[cfg(test)]
mod layering;
mod lifeline;
pub mod mesh;
mod no_store;
mod notice;
mod panic_hook;
mod rank_output;
mod registry;
mod scalar;
pub mod stall;
pub mod state;
mod store_plan;
pub mod threads;
pub mod train;
pub mod watch;
pub mod worker_env;
pub mod zero;

// accel-api's user contracts, by name: the root is the user's face, and a
// name added here is added to `face.rs`'s list too. The engine kit is
// reached only as `accel::kit` (docs/adr/0034-user-face-and-kit.md).
pub use accel_api::{
    bf16, f16, with_dtype, with_float, Availability, Backend, Buf, BufMut, CallCheck, CallInfo,
    Capabilities, CasOutcome, Communicator, CommunicatorExt, ConnectContext, DType, Device,
    DeviceBuf, DeviceBufMut, DeviceKind, Element, Error, ErrorKind, HostBuf, HostBufMut, Layer,
    Layered, MismatchEntry, OffloadStore, Op, Probe, ProbeContext, ReduceOp, Result, Store,
    StoreExt, TensorMeta, Wrapper,
};
// Work in flight (ADR 0033): the handles a program holds.
pub use accel_api::{kit, work, worker};
pub use accel_api::{HostBytes, OwnedBuf, Pending, StartExt, Work};
pub use accelerator::Accelerator;
pub use collectives::CollectivesExt;
pub use debug::{debug_communicator, DebugCommunicator, DebugLayer};
pub use lifeline::tie_to_launcher;
pub use panic_hook::{install_panic_hook, write_error_file, ErrorRecord};
pub use registry::{Entry, Origin, PluginFailure, ProbeRow, Registry, KNOWN_BACKENDS};
pub use scalar::Scalar;
pub use state::{state, thread_rank, LaunchSource, ProcessState};
pub use threads::{run, Threads};
pub use worker_env::{ProcessModel, WorkerEnv};

/// The stores, re-exported for programs that host or open one themselves.
pub use accel_rendezvous as rendezvous;

/// The cuda-nccl backend's own API (device buffers it allocates, the probe
/// report, the `libnccl.so` link folder), for programs and tools that
/// need more than the [`Communicator`] (`accel bench` on device memory).
#[cfg(feature = "cuda-nccl")]
pub use accel_backend_cuda_nccl as cuda_nccl;

/// Reference every enabled backend crate's registration record so the
/// linker keeps their `inventory` registrations (an unreferenced crate can
/// be dropped).
pub(crate) fn link_backends() {
    use accel_api::Backend;
    use std::hint::black_box;
    // Each record as a trait object: its vtable or its function pointers
    // live in the backend crate's object code, which a constant alone
    // would not keep in the link.
    black_box(&accel_backend_single::BACKEND as &dyn Backend);
    #[cfg(feature = "cpu-gloo")]
    black_box(&accel_backend_cpu_gloo::BACKEND as &dyn Backend);
    #[cfg(feature = "mpi")]
    black_box(&accel_backend_mpi::BACKEND as &dyn Backend);
    #[cfg(feature = "npu-hccl")]
    black_box(&accel_backend_npu_hccl::BACKEND as &dyn Backend);
    #[cfg(feature = "xla")]
    black_box(&accel_backend_xla::BACKEND as &dyn Backend);
    #[cfg(feature = "cuda-nccl")]
    black_box(&accel_backend_cuda_nccl::BACKEND as &dyn Backend);
}
