//! The training loop's configuration and the state the accelerator shares
//! with the wrappers it prepared.

use std::sync::{Arc, Mutex, MutexGuard};

use accel_api::{Communicator, CommunicatorExt, Error, ReduceOp, Result};
use accel_sharding::{AccumulationConfig, GradientAccumulator, Stage, StepDecision};

use super::adapters::{Parameters, SharedStateful};
use super::amp::{AmpState, GradScalerConfig, MixedPrecision};
use super::grads;
use super::rng::Rng;
use super::tracker::Tracker;

/// DDP's default gradient bucket size: 25 MiB.
pub const DEFAULT_BUCKET_CAP_BYTES: usize = 25 * 1024 * 1024;

/// Default of [`TrainConfig::first_bucket_cap_bytes`]: 1 MiB, as DDP's.
pub const DEFAULT_FIRST_BUCKET_CAP_BYTES: usize = 1024 * 1024;

/// How the training loop behaves; set once, before anything is prepared,
/// with [`Accelerator::with_training`](crate::Accelerator::with_training).
///
/// Every field has Accelerate's default.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainConfig {
    /// `k`: batches per optimizer step (Accelerate's
    /// `gradient_accumulation_steps`); at least 1. Left at 1, the launcher's
    /// `ACCEL_GRADIENT_ACCUMULATION_STEPS` (`accel launch
    /// --gradient-accumulation-steps`) applies, as Accelerate's
    /// `ACCELERATE_GRADIENT_ACCUMULATION_STEPS` does.
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
    /// ([`IterableLoader`](crate::train::IterableLoader)), not for map-style ones. Map-style loaders
    /// read by index on every rank; `Some(true)` is refused for them.
    #[serde(default)]
    pub dispatch_batches: Option<bool>,
    /// The scheduler steps with the optimizer (`num_processes` times per
    /// optimizer step, once with `split_batches`); otherwise once per batch
    /// (default `true`).
    pub step_scheduler_with_optimizer: bool,
    /// Gradient all-reduce bucket size in bytes (default 25 MiB, as DDP's
    /// `bucket_cap_mb`).
    pub bucket_cap_bytes: usize,
    /// The size of the first bucket of each (device, dtype) group, the one
    /// holding the last parameters, reduced first (default 1 MiB, as DDP's
    /// first bucket), so that communication starts early in the backward;
    /// never more than `bucket_cap_bytes`.
    pub first_bucket_cap_bytes: usize,
    /// Reduce each gradient bucket as soon as the backward pass has
    /// finished its gradients, while the rest of the backward runs, when
    /// the backward reports them ([`Accelerator::backward_overlapped`]);
    /// default `true` (a bucket of one parameter is reduced in place after
    /// the backward either way). `false` reduces every bucket after the
    /// backward (the same buckets and the same results, bit for bit).
    ///
    /// [`Accelerator::backward_overlapped`]: crate::Accelerator::backward_overlapped
    pub overlap_grad_sync: bool,
    /// Keep at most this many automatically named checkpoints (default: all).
    pub total_limit: Option<usize>,
    /// [`save_state`](crate::Accelerator::save_state) saves in the
    /// background, as [`save_state_async`](crate::Accelerator::save_state_async)
    /// does (torchtitan's `async_mode`; default `false`).
    pub async_save: bool,
    /// Mixed precision (Accelerate's `mixed_precision`). `None` (the
    /// default) takes what `accel launch --mixed-precision` set
    /// ([`MIXED_PRECISION_ENV`](crate::train::MIXED_PRECISION_ENV)), else [`MixedPrecision::No`]. In fp16 the
    /// loss scale handed to [`Accelerator::backward`](crate::Accelerator::backward)
    /// includes the [`GradScaler`](crate::train::GradScaler)'s scale, gradients are unscaled before
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
    /// [`Stage::None`](Stage::None). Used by
    /// [`Accelerator::prepare_zero`](crate::Accelerator::prepare_zero).
    #[serde(default)]
    pub sharding: Option<Stage>,
    /// A `mixed_precision` or `sharding` setting the program cannot use (a
    /// model that computes in f32 only; a model no
    /// [`prepare_zero`](crate::Accelerator::prepare_zero) shards) is an
    /// error instead of a warning on rank 0 (default `false`; also
    /// [`STRICT_ENV`](super::STRICT_ENV)`=1`). See
    /// [`settings_not_applied`](crate::Accelerator::settings_not_applied).
    #[serde(default)]
    pub strict: bool,
    /// Optimizer steps between straggler reports: every rank's per-phase
    /// times all-gathered, scored against the median and logged to the
    /// trackers (`phase/<name>_ms`, `straggler/<name>`,
    /// `straggler/<name>_rank`). `None` (the default) takes
    /// [`STRAGGLER_EVERY_ENV`](super::STRAGGLER_EVERY_ENV), else 50; `0`
    /// turns them off. Collective on those steps (through
    /// [`PreparedOptimizer::step`](super::PreparedOptimizer::step)).
    #[serde(default)]
    pub straggler_every: Option<usize>,
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
            first_bucket_cap_bytes: DEFAULT_FIRST_BUCKET_CAP_BYTES,
            overlap_grad_sync: true,
            total_limit: None,
            async_save: false,
            mixed_precision: None,
            grad_scaler: GradScalerConfig::default(),
            gradient_compression: None,
            sharding: None,
            strict: false,
            straggler_every: None,
        }
    }
}

impl TrainConfig {
    /// Accelerate's DDP communication hook by its names
    /// (`DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...)`,
    /// `DDPCommunicationHookType`): `comm_hook` `no`, `fp16` or `bf16`
    /// sets [`gradient_compression`](Self::gradient_compression) (buckets
    /// reduced in the 16-bit type, averaged back in f32, overlapped like
    /// any other bucket); `comm_wrapper` is `no` (Accelerate applies it
    /// around PowerSGD).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
    /// naming the value: an unknown name; `power_sgd` and
    /// `batched_power_sgd` (not supported yet: use `fp16` or `bf16`); a
    /// `comm_wrapper` other than `no` (it only wraps PowerSGD, which
    /// accel does not have: refused rather than ignored).
    pub fn with_ddp_comm_hook(
        mut self,
        comm_hook: &str,
        comm_wrapper: &str,
    ) -> Result<TrainConfig> {
        let norm = |s: &str| s.trim().to_ascii_lowercase().replace('-', "_");
        self.gradient_compression = match norm(comm_hook).as_str() {
            "no" | "" => None,
            "fp16" => Some(accel_api::DType::F16),
            "bf16" => Some(accel_api::DType::BF16),
            "power_sgd" | "batched_power_sgd" => {
                return Err(Error::invalid_config(
                    "comm_hook",
                    comm_hook,
                    "PowerSGD is not supported yet; use fp16 or bf16 compression",
                ))
            }
            _ => {
                return Err(Error::invalid_config(
                    "comm_hook",
                    comm_hook,
                    "Accelerate's DDPCommunicationHookType is no, fp16, bf16, power_sgd or batched_power_sgd",
                ))
            }
        };
        match norm(comm_wrapper).as_str() {
            "no" | "" => Ok(self),
            "fp16" | "bf16" => Err(Error::invalid_config(
                "comm_wrapper",
                comm_wrapper,
                "a comm_wrapper wraps a PowerSGD hook, which accel does not have; use comm_hook fp16 or bf16",
            )),
            _ => Err(Error::invalid_config(
                "comm_wrapper",
                comm_wrapper,
                "Accelerate's comm_wrapper is no, fp16 or bf16",
            )),
        }
    }

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

/// The launcher's gradient accumulation steps
/// (`ACCEL_GRADIENT_ACCUMULATION_STEPS`); `None` when unset or empty.
fn accumulation_steps_from_env() -> Result<Option<usize>> {
    let key = accel_api::worker::keys::ACCEL_GRADIENT_ACCUMULATION_STEPS;
    match std::env::var(key) {
        Ok(v) if !v.trim().is_empty() => {
            crate::worker_env::parse_accumulation_steps(key, &v).map(Some)
        }
        _ => Ok(None),
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
    rng: Mutex<RngSlot>,
    /// Experiment trackers (main process only).
    trackers: Mutex<Vec<Box<dyn Tracker>>>,
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
    pub(crate) amp: AmpState,
    /// The sharding stage resolved against the environment.
    pub(crate) sharding: Stage,
    /// The first rate of scheduler `n`, for optimizer `n`'s first step
    /// (see `Accelerator::prepare_scheduler`).
    pub(crate) initial_lr: std::collections::BTreeMap<usize, f64>,
    /// Where the settings came from and which did not apply.
    pub(crate) applied: super::applied::Applied,
    /// Optimizer steps between straggler reports (0: none).
    pub(crate) straggler_every: usize,
    /// The last straggler report.
    pub(crate) straggler_report: Option<super::stragglers::StragglerReport>,
    /// The background save in flight (`save_state_async`).
    pub(crate) pending_save: Option<PendingSave>,
    /// The communicator background saves commit over.
    pub(crate) save_comm: Option<std::sync::Arc<dyn accel_api::Communicator>>,
}

impl std::fmt::Debug for TrainShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainShared")
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

impl TrainShared {
    /// Defaults for `rank` of a world of `world_size` ranks. A malformed
    /// training variable is said (rank 0) and left out: `Accelerator::new`
    /// refuses them first, so only an accelerator made otherwise gets here.
    pub(crate) fn new(rank: usize, world_size: usize) -> TrainShared {
        let say = |line: String| crate::notice::warn(Some(rank), &line);
        let mut config = TrainConfig::default();
        match accumulation_steps_from_env() {
            Ok(Some(k)) => config.gradient_accumulation_steps = k,
            Ok(None) => {}
            Err(e) => say(format!("{e}; training without gradient accumulation")),
        }
        let accumulator = GradientAccumulator::new(config.accumulation(world_size.max(1)))
            .expect("the default accumulation config is valid");
        let sharding = Stage::from_env()
            .unwrap_or_else(|e| {
                say(format!("{e}; training without sharding"));
                None
            })
            .unwrap_or_default();
        let mode = MixedPrecision::from_env().unwrap_or_else(|e| {
            say(format!("{e}; training without mixed precision"));
            MixedPrecision::No
        });
        let strict = super::applied::strict_from_env().unwrap_or_else(|e| {
            say(format!("{e}; ignored settings are warnings"));
            false
        });
        let straggler_every = super::stragglers::straggler_every_from_env().unwrap_or_else(|e| {
            say(format!(
                "{e}; straggler reports every {} steps",
                super::stragglers::DEFAULT_STRAGGLER_EVERY
            ));
            super::stragglers::DEFAULT_STRAGGLER_EVERY
        });
        let applied = super::applied::Applied {
            mixed_precision: super::applied::env_source(super::MIXED_PRECISION_ENV),
            sharding: super::applied::env_source(crate::zero::SHARDING_ENV),
            strict,
            ..super::applied::Applied::default()
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
                amp: AmpState::new(mode, GradScalerConfig::default()),
                sharding,
                initial_lr: std::collections::BTreeMap::new(),
                applied,
                straggler_every,
                straggler_report: None,
                pending_save: None,
                save_comm: None,
            }),
            rng: Mutex::new(RngSlot::new()),
            trackers: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, TrainState> {
        // A panic while holding the lock leaves plain data behind; keep going.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn trackers(&self) -> MutexGuard<'_, Vec<Box<dyn Tracker>>> {
        self.trackers.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn set_config(&self, mut config: TrainConfig) -> Result<()> {
        if config.gradient_accumulation_steps == 1 {
            if let Some(k) = accumulation_steps_from_env()? {
                config.gradient_accumulation_steps = k;
            }
        }
        let accumulator = GradientAccumulator::new(config.accumulation(self.world_size))?;
        if config.bucket_cap_bytes == 0 || config.first_bucket_cap_bytes == 0 {
            return Err(Error::invalid_argument(
                "with_training",
                format!(
                    "bucket_cap_bytes {} and first_bucket_cap_bytes {}: use at least 4 (one f32) for both",
                    config.bucket_cap_bytes, config.first_bucket_cap_bytes
                ),
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
            None => Stage::from_env()?.unwrap_or_default(),
        };
        let strict = config.strict || super::applied::strict_from_env()?;
        let straggler_every = match config.straggler_every {
            Some(k) => k,
            None => super::stragglers::straggler_every_from_env()?,
        };
        let source = |set: bool, env: &str| {
            if set {
                super::applied::Source::Config
            } else {
                super::applied::env_source(env)
            }
        };
        let mp_source = source(config.mixed_precision.is_some(), super::MIXED_PRECISION_ENV);
        let sharding_source = source(config.sharding.is_some(), crate::zero::SHARDING_ENV);
        let mut st = self.lock();
        st.applied.mixed_precision = mp_source;
        st.applied.sharding = sharding_source;
        st.applied.strict = strict;
        st.sharding = sharding;
        st.straggler_every = straggler_every;
        if st.amp.mode != mode || st.amp.scaler.map(|s| s.config) != Some(config.grad_scaler) {
            st.amp = AmpState::new(mode, config.grad_scaler);
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

    /// Unscale the gradients once per optimizer step in fp16 and agree on the
    /// overflow flag across ranks; `false` without a loss scaler.
    pub(crate) fn unscale_once(
        &self,
        comm: &dyn Communicator,
        model: &mut dyn Parameters,
    ) -> Result<bool> {
        let (scaler, done) = {
            let st = self.lock();
            (st.amp.scaler, st.amp.unscaled)
        };
        let Some(scaler) = scaler else {
            return Ok(false);
        };
        if let Some(found) = done {
            return Ok(found);
        }
        let scale = scaler.scale;
        // torch multiplies by the f32 reciprocal, also for f64 gradients.
        let local = grads::scale_and_check(model, f64::from(scaler.inv_scale()))?;
        // Agreed across ranks, whatever the gradients' synchronisation did.
        // f32 Sum: the one reduction every backend declares (as check_trigger).
        let mut flag = [if local { 1.0f32 } else { 0.0 }];
        if comm.world_size() > 1 {
            comm.all_reduce_slice(&mut flag, ReduceOp::Sum)?;
        }
        let found = flag[0] > 0.0;
        if found {
            tracing::debug!(
                scale,
                local_overflow = local,
                "fp16: gradients overflowed; the step will be skipped"
            );
        }
        self.lock().amp.unscaled = Some(found);
        Ok(found)
    }

    /// A fresh checkpoint key for a newly prepared object of `kind`.
    pub(crate) fn next_key(&self, kind: Kind) -> String {
        let mut st = self.lock();
        let n = st.prepared[kind.index()];
        st.prepared[kind.index()] += 1;
        format!("{}_{n}", kind.prefix())
    }
}

/// The training state of `acc`, made on first use.
pub(crate) fn shared(acc: &crate::Accelerator) -> &Arc<TrainShared> {
    acc.extension(|| Arc::new(TrainShared::new(acc.rank(), acc.world_size())))
}

/// Where the accelerator keeps its [`Rng`]: out of the slot while an
/// [`RngGuard`] has it, so no lock is held while the guard lives.
#[derive(Debug)]
pub(crate) struct RngSlot {
    pub(super) rng: Option<Rng>,
    /// Bumped whenever the generator is replaced (set_seed, load_state,
    /// synchronize_rng_states), so a guard taken before does not put a
    /// stale generator back.
    pub(super) generation: u64,
}

impl RngSlot {
    pub(crate) fn new() -> RngSlot {
        RngSlot {
            rng: Some(Rng::seed_from_u64(0)),
            generation: 0,
        }
    }
}

pub(super) fn held(op: &str) -> Error {
    Error::invalid_argument(
        op,
        "the accelerator's RNG is held by a guard from acc.rng() that is still alive",
    )
    .with_fix(
        "drop the guard (let it go out of scope) before calling this; take it again afterwards",
    )
}

impl TrainShared {
    pub(super) fn rng_slot(&self) -> std::sync::MutexGuard<'_, RngSlot> {
        self.rng.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the generator, or an immediate error while a guard has it.
    pub(crate) fn rng_state(&self, op: &str) -> Result<Rng> {
        self.rng_slot().rng.clone().ok_or_else(|| held(op))
    }

    /// Replace the generator (even while a guard has it: the guard's copy is
    /// then dropped, the new one wins).
    pub(crate) fn replace_rng(&self, rng: Rng) {
        let mut slot = self.rng_slot();
        slot.rng = Some(rng);
        slot.generation += 1;
    }
}

/// A save running on a thread of its own.
pub(crate) struct PendingSave {
    path: std::path::PathBuf,
    thread: Option<std::thread::JoinHandle<accel_api::Result<std::path::PathBuf>>>,
}

impl PendingSave {
    /// The save of `path` running on `thread`.
    pub(crate) fn new(
        path: std::path::PathBuf,
        thread: std::thread::JoinHandle<accel_api::Result<std::path::PathBuf>>,
    ) -> PendingSave {
        PendingSave {
            path,
            thread: Some(thread),
        }
    }

    /// Wait for it: the committed folder, or why not.
    pub(crate) fn join(mut self) -> accel_api::Result<std::path::PathBuf> {
        let t = self.thread.take().expect("joined once");
        t.join().unwrap_or_else(|_| {
            Err(accel_api::Error::new(
                accel_api::ErrorKind::Internal,
                format!("the background save of {} panicked", self.path.display()),
            ))
        })
    }
}

impl Drop for PendingSave {
    /// The process does not end with a write in flight: wait for it, and
    /// say if it failed (nobody asked for its result).
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => crate::notice::warn(
                    None,
                    &format!(
                        "the background save of {} failed, and nobody waited for it: {e}",
                        self.path.display()
                    ),
                ),
                Err(_) => crate::notice::warn(
                    None,
                    &format!("the background save of {} panicked", self.path.display()),
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::TrainConfig;
    use accel_api::{DType, ErrorKind};

    #[test]
    fn accelerates_comm_hook_names_set_the_compression_or_are_refused() {
        let c = |h, w| TrainConfig::default().with_ddp_comm_hook(h, w);
        assert_eq!(c("no", "no").unwrap().gradient_compression, None);
        assert_eq!(
            c("fp16", "no").unwrap().gradient_compression,
            Some(DType::F16)
        );
        assert_eq!(
            c("BF16", "NO").unwrap().gradient_compression,
            Some(DType::BF16)
        );
        for (h, w, says) in [
            ("power_sgd", "no", "PowerSGD is not supported yet"),
            ("batched_power_sgd", "bf16", "PowerSGD is not supported yet"),
            ("fp8", "no", "no, fp16, bf16"),
            ("fp16", "bf16", "wraps a PowerSGD hook"),
            ("no", "int8", "comm_wrapper is no, fp16 or bf16"),
        ] {
            let e = c(h, w).unwrap_err();
            assert!(matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
            assert!(e.to_string().contains(says), "{h}/{w}: {e}");
        }
    }
}
