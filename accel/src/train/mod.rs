//! The training loop: `prepare`, gradient accumulation and synchronisation,
//! metrics, RNG, early stopping and exact-resume checkpoints.
//!
//! accel has no tensors and no autograd of its own; any framework plugs in
//! through four small adapter traits:
//!
//! | trait | what the framework provides |
//! |---|---|
//! | [`Parameters`] | the model: every parameter with its gradient, as views (host or device, any float type), in a fixed order; [`GradKernels`] for device memory |
//! | [`Optimizer`] | one update step over [`Parameters`], a learning rate, optional state |
//! | [`Scheduler`] | one schedule step and the learning rate it gives |
//! | [`Dataset`] | `len` and `get(index)` for a map-style dataset |
//!
//! [`Accelerator::prepare`](crate::Accelerator::prepare) wraps each of them
//! (and a [`DataLoader`]) in a [`Wrapper`](accel_api::Wrapper):
//! [`PreparedModel`] (bucketed gradient all-reduce, DDP's job),
//! [`PreparedOptimizer`] and [`PreparedScheduler`] (step only when the
//! accumulation cadence says so) and [`PreparedLoader`] (sharded, seedable,
//! resumable, from `accel-sharding`). Preparing a prepared object returns it
//! unchanged; `into_inner` gives the original back.
//!
//! A training step reads like Accelerate's:
//!
//! ```no_run
//! use accel::train::*;
//! # struct Lin { w: Vec<f32>, g: Vec<f32> }
//! # impl Parameters for Lin {
//! #   fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) { f(ParamRef::host("w", &self.w, &self.g)) }
//! #   fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) { f(ParamMut::host("w", &mut self.w, &mut self.g)) }
//! # }
//! # struct Data;
//! # impl Dataset for Data { type Item = (f32, f32); fn len(&self) -> usize { 64 } fn get(&self, i: usize) -> (f32, f32) { (i as f32, 2.0 * i as f32) } }
//! let acc = accel::Accelerator::new()?.with_training(TrainConfig {
//!     gradient_accumulation_steps: 2,
//!     ..TrainConfig::default()
//! })?;
//! let mut model = acc.prepare_model(Lin { w: vec![0.0], g: vec![0.0] })?;
//! let mut opt = acc.prepare_optimizer(Sgd::new(0.01))?;
//! let mut sched = acc.prepare_scheduler(LinearSchedule::new(0.01, 0, 100))?;
//! let mut loader = acc.prepare_loader(DataLoader::new(Data, 8).shuffle(42))?;
//! while let Some(batch) = loader.next_batch() {
//!     let step = acc.accumulate(&batch);
//!     let loss = acc.backward(&mut model, |m, scale| {
//!         // hand-derived gradient of the mean squared error, times `scale`
//!         let n = batch.items.len() as f32;
//!         let mut loss = 0.0;
//!         for &(x, y) in &batch.items {
//!             let e = m.w[0] * x - y;
//!             loss += e * e / n;
//!             m.g[0] += scale * 2.0 * e * x / n;
//!         }
//!         loss
//!     })?;
//!     if step.sync_gradients {
//!         acc.clip_grad_norm(&mut model, 1.0, 2.0)?; // the total norm before clipping
//!     }
//!     opt.step(&mut model)?;      // only when step.optimizer_step (skipped in fp16 on overflow)
//!     sched.step(&mut opt);       // num_processes times per optimizer step
//!     opt.zero_grad(&mut model);  // only when step.zero_grad
//!     let mean = acc.reduce(&[loss], "mean")?;
//!     if step.sync_gradients {
//!         acc.print(format_args!("loss {:.4}", mean[0]));
//!     }
//! }
//! acc.save_state("checkpoints", &[&model, &opt, &sched, &loader])?;
//! # Ok::<(), accel::Error>(())
//! ```
//!
//! The semantics are Accelerate's where it is consistent; the differences
//! and the reasons are listed in `docs/training.md` and in the
//! `accel-sharding` crate docs.

mod adapters;
mod amp;
mod applied;
mod checkpoint;
mod control;
mod grad_sync;
mod grads;
mod iterable;
mod kernels;
mod malloc;
mod metrics;
mod model_io;
pub(crate) mod optim;
mod overlap;
mod phases;
mod prepare;
mod rng;
mod safetensors_file;
mod save;
mod shared;
mod stragglers;
mod torch_dcp;
mod tracker;
mod trackers;

/// The phases of a step and their times ([`crate::watch`]).
pub use crate::watch::{Phase, PhaseTimes};
pub use adapters::{
    try_visit_params, try_visit_params_mut, zero_grads, DataLoader, Dataset, Optimizer, ParamMut,
    ParamRef, Parameters, Scheduler, SharedStateful, StateDict, Stateful, Tensor,
};
pub use amp::{GradScaler, GradScalerConfig, MixedPrecision, MIXED_PRECISION_ENV};
pub use applied::STRICT_ENV;
pub use checkpoint::{Checkpointed, CHECKPOINT_STATE_FILE};
pub use control::RngGuard;
pub use grads::{host_from_f32, host_to_f32};
pub use iterable::{IterableDataset, IterableLoader, PreparedIterableLoader};
pub use kernels::{DeviceScratch, GradKernels, GradStats};
#[doc(hidden)]
pub use model_io::model_reads;
pub use model_io::{
    consolidate_model, parse_shard_size, shard_plan, MaxShardSize, DEFAULT_MAX_SHARD_SIZE,
    DIGEST_KEY, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
};
pub use optim::{ConstantSchedule, LinearSchedule, Sgd};
pub use phases::PhaseGuard;
pub use prepare::{
    Batch, Prepare, PreparedLoader, PreparedModel, PreparedOptimizer, PreparedScheduler,
    ScheduledOptimizer,
};
pub use rng::Rng;
pub(crate) use shared::{shared, Kind, TrainShared};
pub use shared::{TrainConfig, DEFAULT_BUCKET_CAP_BYTES, DEFAULT_FIRST_BUCKET_CAP_BYTES};
pub use stragglers::{StragglerReport, DEFAULT_STRAGGLER_EVERY, STRAGGLER_EVERY_ENV};
pub(crate) use torch_dcp::row_chunk;
pub use torch_dcp::{
    dcp_index, read_planned_part, read_tensor_region, safetensors_header, shard_file_name,
    DcpChunk, DcpIndex, ShardChunk, DCP_SHARDING_INFO,
};
pub use tracker::Tracker;
pub use trackers::{JsonlTracker, TensorBoardTracker, TRACKER_NAMES};

/// The per-batch decision of the accumulation cadence (re-exported from
/// `accel-sharding`).
pub use accel_sharding::StepDecision as Step;
pub use accel_sharding::{LoaderConfig, SamplerState};
