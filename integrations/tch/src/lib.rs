//! # accel-tch: accel for tch (libtorch)
//!
//! Distributed data-parallel training for [`tch`] programs: prepare a
//! `VarStore` model, a libtorch optimizer and a loader with accel's
//! [`Accelerator`](accel::Accelerator), and the same program runs on one
//! process or many, on any backend accel has (cpu-gloo, MPI, ...).
//!
//! | piece | what it does |
//! |---|---|
//! | [`TchModel`] | a `VarStore`'s trainable variables as the training loop's `Parameters`: values and gradients viewed in place (host views for CPU tensors, device views for CUDA ones), averaged in buckets on synchronising batches; [`TchModel::backward_reporting`] reports each gradient as autograd finishes it, so that its bucket is reduced while the backward goes on |
//! | [`Zero3TchModel`] | a [`TchModel`] whose parameters ZeRO stage 3 (`accel::zero`, `Stage::Full`) frees between a unit's uses (`set_param_storage` swaps each tensor's data for an empty one), and whose gradients stage 2 frees once reduce-scattered (`release_grad` sets them to none) |
//! | [`TchKernels`] | the training loop's arithmetic and bucket copies on device tensors |
//! | [`autocast_forward`], [`autocast_with`] | the forward pass under libtorch's autocast (bf16 on the CPU; bf16/f16 on CUDA), outputs in f32 |
//! | [`TchOptimizer`] | a `tch::nn::Optimizer` that steps only on synchronising batches and takes its learning rate from a prepared scheduler |
//! | [`AdamW`] | an AdamW whose moments go into checkpoints (exact resume) |
//! | [`TensorCollectives`] | `gather`, `gather_for_metrics`, `reduce`, `pad_across_processes`, all-reduce and broadcast on tensors |
//! | [`set_seed`], [`set_threads_per_rank`] | seed accel and libtorch together; share the cores between local ranks |
//! | [`tp`] | tensor parallelism: column- and row-parallel linear layers, the vocab-parallel embedding and cross entropy, sequence parallelism, layers and checkpoints by a `tp_plan`; Megatron's collectives as libtorch autograd functions |
//! | [`dispatch`] | big-model inference: [`load_checkpoint_and_dispatch`] plans a device map for a `VarStore` model, loads a safetensors checkpoint into it (device, host store, disk store) and runs offloaded blocks with prefetch |
//! | [`ffi`] | zero-copy host views of CPU tensors, device views of CUDA tensors; the C++ shim (autocast switches, gradient-accumulator hooks, a gradient set to none, the tensor-parallel autograd functions); the crate's only unsafe code |
//!
//! Checkpoints go through the Accelerator's `save_state` / `load_state`: a
//! prepared [`TchModel`] saves its variables, [`AdamW`] its moments, in
//! safetensors.
//!
//! ```no_run
//! use accel::train::*;
//! use accel_tch::{TchModel, TchOptimizer, set_seed};
//! use tch::nn::{self, Module};
//!
//! let acc = accel::Accelerator::new()?.with_training(TrainConfig {
//!     gradient_accumulation_steps: 2,
//!     ..TrainConfig::default()
//! })?;
//! set_seed(&acc, 42, false);
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let net = nn::linear(vs.root() / "fc", 64, 10, Default::default());
//! let opt = TchOptimizer::new(&vs, nn::Sgd::default(), 0.1)?;
//! let mut model = acc.prepare_model(TchModel::new(vs)?)?;
//! let mut opt = acc.prepare_optimizer(opt)?;
//! # let (x, y) = (tch::Tensor::zeros([8, 64], tch::kind::FLOAT_CPU), tch::Tensor::zeros([8], tch::kind::INT64_CPU));
//! // for each batch (x, y) of a prepared loader:
//! acc.accumulate_step(false);
//! acc.backward(&mut model, |_, scale| {
//!     let loss = net.forward(&x).cross_entropy_for_logits(&y);
//!     (&loss * scale as f64).backward();
//! })?;
//! opt.step(&mut model)?;
//! opt.zero_grad(&mut model);
//! # Ok::<(), accel::Error>(())
//! ```
//!
//! ## Building
//! tch needs libtorch 2.13.0; `make tch-setup` (scripts/tch_setup.sh)
//! fetches it. Binaries carry an rpath to it (build.rs), so they run without
//! `LD_LIBRARY_PATH`. This crate lives outside the default workspace so that
//! the rest of accel never needs libtorch (docs/adr/0004).

#![deny(unsafe_code)]

mod autocast;
pub mod dispatch;
#[allow(unsafe_code)]
pub mod ffi;
mod kernels;
mod model;
mod optim;
mod report;
mod seed;
mod tensor_ops;
pub mod tp;
mod zero;

pub use autocast::{autocast_enabled, autocast_forward, autocast_with};
pub use dispatch::{load_checkpoint_and_dispatch, DispatchOptions, Dispatched, ModelSpec};
pub use kernels::TchKernels;
pub use model::TchModel;
pub use optim::{AdamW, TchOptimizer};
pub use seed::{set_seed, set_threads_per_rank};
pub use tensor_ops::TensorCollectives;
pub use zero::Zero3TchModel;

/// docs/inference.md's example, compiled as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/inference.md")]
pub struct DocsInferenceMd;

/// tch's error as accel's: [`ErrorKind::Backend`](accel::ErrorKind::Backend)
/// with libtorch's message, the original as the
/// [`source`](std::error::Error::source). The orphan rule forbids
/// `From<tch::TchError> for accel::Error` outside accel-api, and accel-api
/// does not depend on tch, whose build needs libtorch (docs/adr/0030): use
/// [`TchResultExt::accel`] or `.map_err(accel_tch::tch_error)` before `?`.
pub fn tch_error(e: tch::TchError) -> accel::Error {
    accel::Error::new(accel::ErrorKind::Backend, format!("libtorch: {e}")).with_source(e)
}

/// `?` for tch's fallible calls (`f_*` methods, `VarStore::load`) in code
/// that returns accel's errors.
///
/// ```no_run
/// use accel_tch::TchResultExt;
/// fn scaled(x: &tch::Tensor) -> accel::Result<tch::Tensor> {
///     Ok(x.f_mul_scalar(2.0).accel()?)
/// }
/// ```
pub trait TchResultExt<T> {
    /// The value, or tch's error as accel's ([`tch_error`]).
    ///
    /// # Errors
    /// [`ErrorKind::Backend`](accel::ErrorKind::Backend) with libtorch's
    /// message when `self` is tch's error.
    fn accel(self) -> accel::Result<T>;
}

impl<T> TchResultExt<T> for std::result::Result<T, tch::TchError> {
    fn accel(self) -> accel::Result<T> {
        self.map_err(tch_error)
    }
}
