//! # accel-candle: accel for candle
//!
//! Distributed data-parallel training for [candle](candle_core) programs:
//! prepare a candle-nn [`VarMap`](candle_nn::VarMap) model, a candle-nn
//! optimizer and a loader with accel's [`Accelerator`](accel::Accelerator),
//! and the same program runs on one process or many, on any backend accel
//! has (cpu-gloo, MPI, ...).
//!
//! | piece | what it does |
//! |---|---|
//! | [`CandleModel`] | a `VarMap`'s variables as the training loop's `Parameters`: values as host views of the `Var`s' own storage, one gradient buffer per variable that candle's backward adds into (1 copy in, 0 out) |
//! | [`CandleOptimizer`] | candle-nn's `AdamW`, `SGD` (any `candle_nn::Optimizer`) stepping on the averaged buffers, only on synchronising batches |
//! | [`AdamW`] | candle-nn's AdamW, bit for bit, with its moments in checkpoints (exact resume) |
//! | [`init_uniform`] | seeded initial weights (candle cannot seed its CPU generator) |
//! | [`compute_var_builder`], [`compute_dtype`] | mixed precision: the layers built on bf16/f16 compute copies of the f32 master `Var`s (differentiable casts: the gradients land on the masters) |
//! | [`sequential_loss_and_grad`] | ZeRO stages 1-3 ([`accel::zero`]): a chain of modules run module by module through the sharding optimizer's gate; `CandleModel` frees and restores its `Var`s' storage as stage 3 releases and gathers them |
//! | [`load_checkpoint_and_dispatch`] | big-model inference on accel-offload: a `VarBuilder` over the planned tensors (resident, or served from the checkpoint on disk), each block's storage filled just before it runs, the next one prefetched ([`dispatch`]) |
//!
//! Gradient accumulation, `clip_grad_norm` / `clip_grad_value`, the fp16
//! loss scaler (its scale is in the loss scale the backward closure gets;
//! a step is skipped on every rank when any rank overflowed) and
//! checkpoints are accel's own (the training loop
//! works on the views). `save_model` / `load_model` write and read the
//! Hugging Face layout with each tensor in its variable's shape and dtype,
//! which candle's `VarBuilder::from_mmaped_safetensors` reads back.
//!
//! ```no_run
//! use accel::train::*;
//! use accel_candle::{CandleModel, CandleOptimizer};
//! use candle_core::{DType, Device, Tensor};
//! use candle_nn::{Module, VarBuilder, VarMap};
//!
//! let acc = accel::Accelerator::new()?.with_training(TrainConfig {
//!     gradient_accumulation_steps: 2,
//!     ..TrainConfig::default()
//! })?;
//! let varmap = VarMap::new();
//! let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! let net = candle_nn::linear(64, 10, vb.pp("fc"))?; // candle's errors convert
//! accel_candle::init_uniform(&varmap, 42)?;
//! let model = CandleModel::new(&varmap)?;
//! let opt = CandleOptimizer::<candle_nn::SGD>::new(&model, 0.1)?;
//! let mut model = acc.prepare_model(model)?;
//! let mut opt = acc.prepare_optimizer(opt)?;
//! # let (x, y) = (Tensor::zeros((8, 64), DType::F32, &Device::Cpu)?, Tensor::zeros(8, DType::U32, &Device::Cpu)?);
//! // for each batch (x, y) of a prepared loader:
//! acc.accumulate_step(false);
//! acc.backward(&mut model, |m, scale| {
//!     let loss = candle_nn::loss::cross_entropy(&net.forward(&x)?, &y)?;
//!     m.backward(&(loss * f64::from(scale))?)
//! })??;
//! opt.step(&mut model)?;
//! opt.zero_grad(&mut model);
//! # Ok::<(), accel::Error>(())
//! ```
//!
//! ## Building
//! Pure Rust on the CPU (candle-core, candle-nn 0.11): a member of the
//! default workspace (docs/adr/0023-candle-workspace.md). The `cuda`
//! feature forwards to candle's own; CUDA variables are not trained yet.

/// docs/candle.md's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/candle.md")]
pub struct DocsCandleMd;

mod amp;
pub mod dispatch;
mod model;
mod optim;
pub mod tp;
pub mod zero;

pub use amp::{compute_dtype, compute_var_builder};
pub use dispatch::{load_checkpoint_and_dispatch, DispatchOptions, Dispatched};
pub use model::CandleModel;
pub use optim::{AdamW, CandleOptimizer, OptimizerState};
pub use zero::{sequential_loss_and_grad, Link};

use accel_api::{Error, Result};

/// candle's error as accel's, with candle's message (the `From` impl that
/// this crate turns on in accel-api, by name for `map_err`).
pub(crate) fn candle_err(e: candle_core::Error) -> Error {
    Error::from(e)
}

/// Give every variable of `varmap` seeded values, in name order: uniform in
/// `±1/sqrt(fan_in)` (PyTorch's default for linear layers), where `fan_in`
/// is the product of a variable's dimensions after the first (its length
/// for a 1-D variable). candle cannot seed its CPU generator, so
/// candle-nn's own initialisation differs from run to run; call this after
/// building the model for runs that must start equal (a 1-process run and
/// an N-rank one, a run and its resumed twin). Every rank gets the same
/// values.
///
/// # Errors
/// [`ErrorKind::Backend`](accel_api::ErrorKind::Backend) with candle's message when a variable cannot be
/// set.
pub fn init_uniform(varmap: &candle_nn::VarMap, seed: u64) -> Result<()> {
    let mut vars: Vec<(String, candle_core::Var)> = varmap
        .data()
        .lock()
        .map_err(|_| Error::invalid_argument("init_uniform", "the VarMap's lock is poisoned"))?
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    let mut rng = accel::train::Rng::seed_from_u64(seed);
    for (_, var) in vars {
        let dims = var.dims();
        let fan_in: usize = if dims.len() > 1 {
            dims[1..].iter().product()
        } else {
            dims.iter().product()
        };
        let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
        let values: Vec<f32> = (0..var.elem_count())
            .map(|_| (2.0 * rng.uniform() - 1.0) * bound)
            .collect();
        let t = candle_core::Tensor::from_vec(values, var.shape(), var.device())
            .and_then(|t| t.to_dtype(var.dtype()))
            .map_err(candle_err)?;
        var.set(&t).map_err(candle_err)?;
    }
    Ok(())
}
