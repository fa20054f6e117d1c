//! # accel-burn: accel for burn
//!
//! Distributed data-parallel training for [burn] programs: wrap a
//! burn `Module` and a burn optimizer, prepare them with accel's
//! [`Accelerator`](accel::Accelerator), and the same program runs on one
//! process or many, on any engine accel has (cpu-gloo, MPI, ...), across
//! machines through `accel launch`.
//!
//! | piece | what it does |
//! |---|---|
//! | [`BurnModel`] | a `Module`'s float parameters as the training loop's `Parameters`: named by their record paths, with their shapes and dtypes; burn's `GradientsParams` added into one host buffer per parameter (1 copy in), values written back into the module when accel changed them (1 copy out per step) |
//! | [`BurnOptimizer`] | a burn optimizer (`Sgd`, `Adam`, `AdamW`, ...) stepping on the averaged gradients, only on synchronising batches, with its state in checkpoints (exact resume); also ZeRO's `ShardOptimizer` |
//! | [`load_checkpoint_and_dispatch`] | big-model inference: a module's weights planned over device / host / disk budgets on accel-offload's shared pipeline, each block's offloaded record loaded into the module just before it runs ([`dispatch`]) |
//!
//! Gradient accumulation, `clip_grad_norm` / `clip_grad_value`, the fp16
//! loss scaler and checkpoints are accel's own (the training loop works on
//! the views). `save_model` writes the Hugging Face layout with each
//! tensor under its record path, in its shape and dtype: what burn's
//! `burn-store` safetensors loader reads back.
//!
//! ```no_run
//! use accel::train::*;
//! use accel_burn::{BurnModel, BurnOptimizer};
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Device, Tensor};
//!
//! let acc = accel::Accelerator::new()?.with_training(TrainConfig {
//!     gradient_accumulation_steps: 2,
//!     ..TrainConfig::default()
//! })?;
//! let device = Device::default().autodiff();
//! let net: Linear = LinearConfig::new(64, 10).init(&device);
//! let mut model = acc.prepare_model(BurnModel::new(net)?)?;
//! let mut opt = acc.prepare_optimizer(BurnOptimizer::new(SgdConfig::new().build(), 0.1))?;
//! # let x = Tensor::<2>::zeros([8, 64], &device);
//! // for each batch x of a prepared loader:
//! acc.accumulate_step(false);
//! acc.backward(&mut model, |m, scale| {
//!     let loss = m.module().forward(x.clone()).powi_scalar(2).mean();
//!     m.backward(loss.mul_scalar(scale))
//! })??;
//! opt.step(&mut model)?;
//! opt.zero_grad(&mut model);
//! # Ok::<(), accel::Error>(())
//! ```
//!
//! ## Building
//! Pure Rust on the CPU (burn 0.22 with its NdArray backend, autodiff and
//! optimizers; no wgpu, no CUDA): a member of the default workspace
//! (docs/adr/0035-burn-workspace.md).
#![forbid(unsafe_code)]

/// docs/burn.md's examples, compiled as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../docs/burn.md")]
pub struct DocsBurnMd;

pub mod dispatch;
mod host;
mod model;
mod optim;

pub use dispatch::{load_checkpoint_and_dispatch, Dispatched};
pub use model::BurnModel;
pub use optim::BurnOptimizer;
