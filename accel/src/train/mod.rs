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
mod checkpoint;
mod control;
mod grad_sync;
mod grads;
mod iterable;
mod metrics;
mod model_io;
pub(crate) mod optim;
mod prepare;
mod rng;
mod trackers;

use std::sync::{Arc, Mutex, MutexGuard};

use accel_api::{Error, Result};
use accel_sharding::{AccumulationConfig, GradientAccumulator, StepDecision};

pub use adapters::{
    try_visit_params, try_visit_params_mut, DataLoader, Dataset, Optimizer, ParamMut, ParamRef,
    Parameters, Scheduler, StateDict, Stateful, Tensor,
};
pub use amp::{GradScaler, GradScalerConfig, MixedPrecision, MIXED_PRECISION_ENV};
pub use checkpoint::{Checkpointed, SharedStateful, CHECKPOINT_STATE_FILE};
pub use control::{RngGuard, STRICT_ENV};
pub use grads::{host_from_f32, host_to_f32, zero_grads, DeviceScratch, GradKernels, GradStats};
pub use iterable::{IterableDataset, IterableLoader, PreparedIterableLoader};
pub use model_io::{
    parse_shard_size, shard_plan, MaxShardSize, DEFAULT_MAX_SHARD_SIZE, DIGEST_KEY,
    SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
};
pub use optim::{ConstantSchedule, LinearSchedule, Sgd};
pub use prepare::{
    Batch, Prepare, PreparedLoader, PreparedModel, PreparedOptimizer, PreparedScheduler,
    ScheduledOptimizer,
};
pub use rng::Rng;
pub use trackers::{JsonlTracker, TensorBoardTracker, Tracker, TRACKER_NAMES};

/// The per-batch decision of the accumulation cadence (re-exported from
/// `accel-sharding`).
pub use accel_sharding::StepDecision as Step;
pub use accel_sharding::{LoaderConfig, SamplerState};

/// DDP's default gradient bucket size: 25 MiB.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// How the training loop behaves; set once, before anything is prepared,
/// with [`Accelerator::with_training`](crate::Accelerator::with_training).
///
/// Every field has Accelerate's default.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    /// `k`: batches per optimizer step (Accelerate's
    /// `gradient_accumulation_steps`); at least 1.
    pub gradient_accumulation_steps: usize,
    /// Synchronise and step at the end of the loader even inside an
    /// accumulation group (default `true`).
    pub sync_with_dataloader: bool,
    /// All-reduce gradients on every batch, not only on synchronising ones
    /// (less memory, more traffic; default `false`).
    pub sync_each_batch: bool,
    /// Each loader batch is the global batch, cut into one piece per rank
    /// (default `false`: each rank reads whole batches).
    pub split_batches: bool,
    /// Top up the last round so every rank reads the same number of batches
    /// (default `true`).
    pub even_batches: bool,
    /// The main process reads every step and sends each rank its slice
    /// (Accelerate's `dispatch_batches`). `None` (the default) means what
    /// Accelerate does: dispatch for iterable loaders
    /// ([`IterableLoader`]), not for map-style ones. Map-style loaders
    /// read by index on every rank; `Some(true)` is refused for them.
    #[serde(default)]
    pub dispatch_batches: Option<bool>,
    /// The scheduler steps with the optimizer (`num_processes` times per
    /// optimizer step, once with `split_batches`); otherwise once per batch
    /// (default `true`).
    pub step_scheduler_with_optimizer: bool,
    /// Gradient all-reduce bucket size in bytes (default 25 MiB, as DDP).
    pub bucket_cap_bytes: usize,
    /// Keep at most this many automatically named checkpoints (default: all).
    pub total_limit: Option<usize>,
    /// Mixed precision (Accelerate's `mixed_precision`). `None` (the
    /// default) takes what `accel launch --mixed-precision` set
    /// ([`MIXED_PRECISION_ENV`]), else [`MixedPrecision::No`]. In fp16 the
    /// loss scale handed to [`Accelerator::backward`](crate::Accelerator::backward)
    /// includes the [`GradScaler`]'s scale, gradients are unscaled before
    /// clipping and stepping, and a step with an infinite or NaN gradient
    /// on any rank is skipped on every rank.
    #[serde(default)]
    pub mixed_precision: Option<MixedPrecision>,
    /// The fp16 loss scaler's settings (torch's `GradScaler` defaults).
    #[serde(default)]
    pub grad_scaler: GradScalerConfig,
    /// Communicate f32 host gradients as `bf16` (or `f16`) and average in
    /// f32 (DDP's bf16 compression hook): half the traffic, gradients
    /// rounded to 8 significant bits. `None` (default): in their own dtype.
    #[serde(default)]
    pub gradient_compression: Option<accel_api::DType>,
    /// ZeRO sharding ([`crate::zero`]; DeepSpeed's stage, FSDP's
    /// `sharding_strategy`). `None` (the default) takes
    /// [`SHARDING_ENV`](crate::zero::SHARDING_ENV), else
    /// [`Stage::None`](crate::zero::Stage::None). Used by
    /// [`Accelerator::prepare_zero`](crate::Accelerator::prepare_zero).
    #[serde(default)]
    pub sharding: Option<crate::zero::Stage>,
    /// A `mixed_precision` or `sharding` setting the program cannot use (a
    /// model that computes in f32 only; a model no
    /// [`prepare_zero`](crate::Accelerator::prepare_zero) shards) is an
    /// error instead of a warning on rank 0 (default `false`; also
    /// [`STRICT_ENV`]`=1`). See
    /// [`settings_not_applied`](crate::Accelerator::settings_not_applied).
    #[serde(default)]
    pub strict: bool,
}

impl Default for TrainConfig {
    fn default() -> TrainConfig {
        TrainConfig {
            gradient_accumulation_steps: 1,
            sync_with_dataloader: true,
            sync_each_batch: false,
            split_batches: false,
            even_batches: true,
            dispatch_batches: None,
            step_scheduler_with_optimizer: true,
            bucket_cap_bytes: DEFAULT_BUCKET_CAP_BYTES,
            total_limit: None,
            mixed_precision: None,
            grad_scaler: GradScalerConfig::default(),
            gradient_compression: None,
            sharding: None,
            strict: false,
        }
    }
}

impl TrainConfig {
    fn accumulation(&self, num_processes: usize) -> AccumulationConfig {
        AccumulationConfig {
            steps: self.gradient_accumulation_steps,
            sync_with_dataloader: self.sync_with_dataloader,
            sync_each_batch: self.sync_each_batch,
            num_processes,
            split_batches: self.split_batches,
            step_scheduler_with_optimizer: self.step_scheduler_with_optimizer,
        }
    }
}

/// Which kind of object a prepared wrapper holds; names its checkpoint key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Model,
    Optimizer,
    Scheduler,
    Loader,
}

impl Kind {
    fn index(self) -> usize {
        self as usize
    }
    pub(crate) fn prefix(self) -> &'static str {
        match self {
            Kind::Model => "model",
            Kind::Optimizer => "optimizer",
            Kind::Scheduler => "scheduler",
            Kind::Loader => "loader",
        }
    }
}

/// Training state shared by the [`Accelerator`](crate::Accelerator) and the
/// wrappers it prepared (Accelerate's `GradientState` plus the checkpoint
/// counter, RNG, trigger and registered objects).
pub(crate) struct TrainShared {
    world_size: usize,
    inner: Mutex<TrainState>,
    /// Kept apart from `inner` so a live `RngGuard` blocks nothing else.
    rng: Mutex<control::RngSlot>,
    /// Experiment trackers (main process only).
    trackers: Mutex<Vec<Box<dyn trackers::Tracker>>>,
}

pub(crate) struct TrainState {
    pub(crate) config: TrainConfig,
    pub(crate) accumulator: GradientAccumulator,
    /// The decision for the batch in flight; `None` before the first
    /// `accumulate` (then every batch synchronises).
    pub(crate) decision: Option<StepDecision>,
    /// Number of the next automatically named checkpoint.
    pub(crate) iteration: u64,
    pub(crate) trigger: bool,
    pub(crate) prepared: [usize; 4],
    pub(crate) registered: Vec<SharedStateful>,
    /// Mixed precision and the fp16 loss scaler.
    pub(crate) amp: amp::AmpState,
    /// The sharding stage resolved against the environment.
    pub(crate) sharding: crate::zero::Stage,
    /// The first rate of scheduler `n`, for optimizer `n`'s first step
    /// (see `Accelerator::prepare_scheduler`).
    pub(crate) initial_lr: std::collections::BTreeMap<usize, f64>,
    /// Where the settings came from and which did not apply.
    pub(crate) applied: control::Applied,
}

impl std::fmt::Debug for TrainShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainShared")
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

impl TrainShared {
    /// Defaults for a world of `world_size` ranks.
    pub(crate) fn new(world_size: usize) -> TrainShared {
        let config = TrainConfig::default();
        let accumulator = GradientAccumulator::new(config.accumulation(world_size.max(1)))
            .expect("the default accumulation config is valid");
        let sharding = crate::zero::Stage::from_env()
            .unwrap_or_else(|e| {
                tracing::warn!("{e}; training without sharding");
                None
            })
            .unwrap_or_default();
        let mode = MixedPrecision::from_env().unwrap_or_else(|e| {
            tracing::warn!("{e}; training without mixed precision");
            MixedPrecision::No
        });
        let strict = control::strict_from_env().unwrap_or_else(|e| {
            tracing::warn!("{e}; ignored settings are warnings");
            false
        });
        let applied = control::Applied {
            mixed_precision: control::env_source(MIXED_PRECISION_ENV),
            sharding: control::env_source(crate::zero::SHARDING_ENV),
            strict,
            ..control::Applied::default()
        };
        TrainShared {
            world_size: world_size.max(1),
            inner: Mutex::new(TrainState {
                config,
                accumulator,
                decision: None,
                iteration: 0,
                trigger: false,
                prepared: [0; 4],
                registered: Vec::new(),
                amp: amp::AmpState::new(mode, GradScalerConfig::default()),
                sharding,
                initial_lr: std::collections::BTreeMap::new(),
                applied,
            }),
            rng: Mutex::new(control::RngSlot::new()),
            trackers: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, TrainState> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn trackers(&self) -> MutexGuard<'_, Vec<Box<dyn trackers::Tracker>>> {
        self.trackers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_config(&self, config: TrainConfig) -> Result<()> {
        let accumulator = GradientAccumulator::new(config.accumulation(self.world_size))?;
        if config.bucket_cap_bytes == 0 {
            return Err(Error::invalid_argument(
                "with_training",
                "bucket_cap_bytes is 0; use at least 4 (one f32)",
            ));
        }
        config.grad_scaler.check()?;
        if let Some(c) = config.gradient_compression {
            if !matches!(c, accel_api::DType::BF16 | accel_api::DType::F16) {
                return Err(Error::invalid_config(
                    "gradient_compression",
                    c.name(),
                    "gradients are communicated compressed as bf16 or f16 only",
                )
                .with_fix("use Some(DType::BF16), Some(DType::F16) or None"));
            }
        }
        let mode = match config.mixed_precision {
            Some(m) => m,
            None => MixedPrecision::from_env()?,
        };
        let sharding = match config.sharding {
            Some(s) => s,
            None => crate::zero::Stage::from_env()?.unwrap_or_default(),
        };
        let strict = config.strict || control::strict_from_env()?;
        let source = |set: bool, env: &str| {
            if set {
                control::Source::Config
            } else {
                control::env_source(env)
            }
        };
        let mp_source = source(config.mixed_precision.is_some(), MIXED_PRECISION_ENV);
        let sharding_source = source(config.sharding.is_some(), crate::zero::SHARDING_ENV);
        let mut st = self.lock();
        st.applied.mixed_precision = mp_source;
        st.applied.sharding = sharding_source;
        st.applied.strict = strict;
        st.sharding = sharding;
        if st.amp.mode != mode || st.amp.scaler.map(|s| s.config) != Some(config.grad_scaler) {
            st.amp = amp::AmpState::new(mode, config.grad_scaler);
        }
        st.config = config;
        st.accumulator = accumulator;
        st.decision = None;
        Ok(())
    }

    /// The decision in force: the last `accumulate` result, or "synchronise"
    /// when the loop never called it.
    pub(crate) fn decision(&self) -> StepDecision {
        let st = self.lock();
        st.decision.unwrap_or_else(|| {
            let c = &st.config;
            StepDecision {
                sync_gradients: true,
                all_reduce: true,
                optimizer_step: true,
                zero_grad: true,
                scheduler_steps: if !c.step_scheduler_with_optimizer || c.split_batches {
                    1
                } else {
                    self.world_size
                },
                loss_divisor: c.gradient_accumulation_steps,
            }
        })
    }

    /// A fresh checkpoint key for a newly prepared object of `kind`.
    pub(crate) fn next_key(&self, kind: Kind) -> String {
        let mut st = self.lock();
        let n = st.prepared[kind.index()];
        st.prepared[kind.index()] += 1;
        format!("{}_{n}", kind.prefix())
    }
}

pub(crate) fn shared(acc: &crate::Accelerator) -> &Arc<TrainShared> {
    acc.train_shared()
}
