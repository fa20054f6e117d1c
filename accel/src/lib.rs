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
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod accelerator;
mod collectives;
mod debug;
#[cfg(doctest)]
mod doc_examples;
pub mod env_check;
pub mod flight;
#[cfg(test)]
mod layering;
mod lifeline;
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
pub mod worker_env;
pub mod zero;

pub use accel_api::*;
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

/// Reference every enabled backend crate so the linker keeps their
/// `inventory` registrations (an unreferenced crate can be dropped).
pub(crate) fn link_backends() {
    use std::hint::black_box;
    // Function pointers, not constants: a constant can be inlined without
    // keeping the crate's object code (and its registration) in the link.
    black_box(accel_backend_single::connect_named as fn(_, _) -> _);
    #[cfg(feature = "cpu-gloo")]
    black_box(accel_backend_cpu_gloo::connect as fn(_) -> _);
    #[cfg(feature = "mpi")]
    black_box(accel_backend_mpi::connect as fn(_) -> _);
    #[cfg(feature = "npu-hccl")]
    black_box(accel_backend_npu_hccl::backend as fn() -> _);
    #[cfg(feature = "xla")]
    black_box(accel_backend_xla::connect as fn(_) -> _);
    #[cfg(feature = "cuda-nccl")]
    black_box(accel_backend_cuda_nccl::connect as fn(_) -> _);
}
