//! Training configuration, seeding and RNG, coordinated early stopping.

use accel_api::{CommunicatorExt, Error, ReduceOp, Result};

use super::applied::{NotApplied, Source, STRICT_ENV};
use super::rng::Rng;
use super::shared::{held, TrainConfig, TrainShared};
use crate::{Accelerator, CollectivesExt};

/// Exclusive use of the accelerator's [`Rng`]; see [`Accelerator::rng`].
///
/// The guard holds the generator itself, not a lock: while it lives, every
/// other training method works as usual; the few that need the generator
/// ([`save_state`](Accelerator::save_state),
/// [`load_state`](Accelerator::load_state),
/// [`synchronize_rng_states`](Accelerator::synchronize_rng_states), a
/// second [`rng`](Accelerator::rng)) fail at once with an error saying to
/// drop it, and [`set_seed`](Accelerator::set_seed) replaces it. Dropping the
/// guard gives the generator back.
pub struct RngGuard<'a> {
    shared: &'a TrainShared,
    rng: Option<Rng>,
    generation: u64,
}

impl std::fmt::Debug for RngGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.rng.fmt(f)
    }
}

impl std::ops::Deref for RngGuard<'_> {
    type Target = Rng;
    fn deref(&self) -> &Rng {
        self.rng
            .as_ref()
            .expect("the guard holds the generator until dropped")
    }
}

impl std::ops::DerefMut for RngGuard<'_> {
    fn deref_mut(&mut self) -> &mut Rng {
        self.rng
            .as_mut()
            .expect("the guard holds the generator until dropped")
    }
}

impl Drop for RngGuard<'_> {
    fn drop(&mut self) {
        let mut slot = self.shared.rng_slot();
        if slot.generation == self.generation && slot.rng.is_none() {
            slot.rng = self.rng.take();
        }
    }
}

impl TrainShared {
    /// Report `n`: once per setting, a warning on rank 0's console and log
    /// (`crate::notice`) naming the setting, where it came from and why; the trackers' `config.json`
    /// then records the value that applied. Under strict mode an error
    /// instead, on every rank alike (each rank finds the same).
    pub(crate) fn not_applied(&self, rank: usize, n: NotApplied<'_>) -> Result<()> {
        let mut st = self.lock();
        let (env, launch) = match n.key {
            "mixed_precision" => (super::MIXED_PRECISION_ENV, "--mixed-precision"),
            _ => (crate::zero::SHARDING_ENV, "--sharding"),
        };
        let source = match n.key {
            "mixed_precision" => st.applied.mixed_precision,
            _ => st.applied.sharding,
        };
        let setting = match source {
            Source::Env => format!("{env}={} (accel launch {launch})", n.value),
            _ => format!("TrainConfig::{} = {}", n.key, n.value),
        };
        if st.applied.strict {
            return Err(Error::new(
                accel_api::ErrorKind::InvalidConfig,
                format!("{setting} does not apply: {}", n.reason),
            )
            .with_rank(rank)
            .with_fix(format!(
                "{}; or allow it with a warning: unset {STRICT_ENV} / TrainConfig::strict",
                n.fix
            )));
        }
        if st.applied.notices.iter().any(|(k, _)| *k == n.key) {
            return Ok(());
        }
        let line = format!(
            "{setting} does not apply: {}; training runs as with {} = {} ({})",
            n.reason, n.key, n.instead, n.fix
        );
        st.applied.notices.push((n.key, line.clone()));
        let config = st.applied.tracker_config.as_mut().and_then(|c| {
            let obj = c.as_object_mut()?;
            if obj.contains_key(n.key) {
                obj.insert(n.key.into(), n.instead.into());
            }
            let not = obj
                .entry("not_applied")
                .or_insert_with(|| serde_json::json!({}));
            if let Some(not) = not.as_object_mut() {
                not.insert(n.key.into(), line.clone().into());
            }
            Some(c.clone())
        });
        drop(st);
        if rank == 0 {
            crate::notice::warn(Some(rank), &line);
            if let Some(config) = config {
                for t in self.trackers().iter_mut() {
                    if let Err(e) = t.store_init_configuration(&config) {
                        tracing::warn!("tracker {}: {e}", t.name());
                    }
                }
            }
        }
        Ok(())
    }

    /// Mixed precision is set but `model` computes in f32 only.
    pub(crate) fn check_mixed_precision(
        &self,
        rank: usize,
        model: &dyn super::Parameters,
    ) -> Result<()> {
        let mode = self.lock().amp.mode;
        if mode == super::MixedPrecision::No || model.uses_mixed_precision() {
            return Ok(());
        }
        let reason = if mode == super::MixedPrecision::Fp16 {
            "the prepared model computes in f32 (no autocast, no f16 values or gradients), so only the loss \
             scaler runs"
        } else {
            "the prepared model computes in f32 (no autocast, no bf16 values or gradients)"
        };
        self.not_applied(
            rank,
            NotApplied {
                key: "mixed_precision",
                value: mode.name().into(),
                instead: "no",
                reason,
                fix: "run the forward pass under the framework's autocast (accel-tch's \
                      autocast_forward) or keep half-precision values, or set it to no",
            },
        )
    }

    /// Sharding is set but `op` steps a model that no ZeroOptimizer
    /// shards.
    pub(crate) fn check_sharding(&self, rank: usize, op: &str) -> Result<()> {
        let stage = self.lock().sharding;
        if stage == crate::zero::Stage::None {
            return Ok(());
        }
        let reason = format!(
            "{op} steps a model that Accelerator::prepare_zero did not shard, so every rank \
             keeps the whole optimizer state, gradients and parameters"
        );
        self.not_applied(
            rank,
            NotApplied {
                key: "sharding",
                value: stage.as_str().into(),
                instead: "none",
                reason: &reason,
                fix: "step the model with a ZeroOptimizer (Accelerator::prepare_zero and \
                      zero_step), or set it to none",
            },
        )
    }
}

impl Accelerator {
    /// The settings this run found it cannot use, one line each (naming
    /// the setting, where it came from and why), in the order found: a
    /// mixed precision the prepared model does not compute in (found by
    /// [`prepare`](Self::prepare)), a sharding stage for a model no
    /// [`prepare_zero`](Self::prepare_zero) shards (found at its first
    /// optimizer step). Rank 0 also says each on its stderr
    /// (`accel: warning: ...`, with or without a `tracing` subscriber) and
    /// logs it as a `tracing` warning; under
    /// [`TrainConfig::strict`] or `ACCEL_STRICT=1` each is an error
    /// instead.
    pub fn settings_not_applied(&self) -> Vec<String> {
        let st = super::shared(self).lock();
        st.applied.notices.iter().map(|(_, l)| l.clone()).collect()
    }

    /// Set the training-loop configuration (builder form of
    /// [`set_training_config`](Self::set_training_config)).
    ///
    /// # Errors
    /// As [`set_training_config`](Self::set_training_config).
    pub fn with_training(self, config: TrainConfig) -> Result<Accelerator> {
        self.set_training_config(config)?;
        Ok(self)
    }

    /// Set the training-loop configuration. Call it before preparing
    /// loaders (they read `split_batches` / `even_batches` when prepared);
    /// it restarts the accumulation cadence. Accumulation steps left at 1
    /// take the launcher's `ACCEL_GRADIENT_ACCUMULATION_STEPS` when set.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for 0 accumulation steps or a 0-byte bucket;
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
    /// naming `ACCEL_GRADIENT_ACCUMULATION_STEPS` for a malformed value.
    pub fn set_training_config(&self, config: TrainConfig) -> Result<()> {
        super::shared(self).set_config(config)
    }

    /// The training-loop configuration in force, with
    /// `mixed_precision` and `sharding` resolved (what the program set,
    /// else what `accel launch` set, else the default) and `strict` true
    /// under `ACCEL_STRICT=1`: what the trackers should record.
    pub fn training_config(&self) -> TrainConfig {
        let st = super::shared(self).lock();
        TrainConfig {
            mixed_precision: Some(st.amp.mode),
            sharding: Some(st.sharding),
            strict: st.applied.strict,
            ..st.config.clone()
        }
    }

    /// Seed this process's [`Rng`] (Accelerate's `set_seed`): with `seed`
    /// on every rank, or with `seed + rank` when `device_specific` (so
    /// ranks draw different dropout masks or noise). Not collective.
    pub fn set_seed(&self, seed: u64, device_specific: bool) {
        let s = if device_specific {
            seed.wrapping_add(self.rank() as u64)
        } else {
            seed
        };
        super::shared(self).replace_rng(Rng::seed_from_u64(s));
    }

    /// This process's random generator (seeded by
    /// [`set_seed`](Self::set_seed), saved per rank by
    /// [`save_state`](Self::save_state)), handed out until the guard is
    /// dropped. See [`RngGuard`] for what works while it lives.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// at once when another guard is still alive (it would otherwise wait
    /// for itself forever).
    pub fn rng(&self) -> Result<RngGuard<'_>> {
        let shared = super::shared(self);
        let mut slot = shared.rng_slot();
        let rng = slot.rng.take().ok_or_else(|| held("rng"))?;
        Ok(RngGuard {
            shared,
            rng: Some(rng),
            generation: slot.generation,
        })
    }

    /// Give every rank the RNG state of rank 0 (Accelerate's
    /// `synchronize_rng_states`). Collective.
    ///
    /// # Errors
    /// The communicator's; on every rank, when rank 0's generator is held
    /// by a live [`RngGuard`].
    pub fn synchronize_rng_states(&self) -> Result<()> {
        let shared = super::shared(self);
        let mine = if self.is_main_process() {
            shared
                .rng_state("synchronize_rng_states")
                .map(|r| r.state())
        } else {
            Ok([0; 4])
        };
        let mine = self.agree("synchronize_rng_states", mine)?;
        let root = self.comm().broadcast_object(Some(&mine), 0)?;
        shared.replace_rng(Rng::from_state(root));
        Ok(())
    }

    /// Raise this rank's trigger (e.g. its loss went NaN, or it reached a
    /// target); [`check_trigger`](Self::check_trigger) tells every rank.
    /// Not collective.
    pub fn set_trigger(&self) {
        super::shared(self).lock().trigger = true;
    }

    /// `true` on every rank when any rank raised its trigger since the last
    /// check; resets the triggers. Use it to stop all ranks at the same step
    /// (Accelerate's `check_trigger`). Collective.
    ///
    /// # Errors
    /// The communicator's.
    pub fn check_trigger(&self) -> Result<bool> {
        let mine = if super::shared(self).lock().trigger {
            1.0f32
        } else {
            0.0
        };
        let mut flag = [mine];
        self.comm().all_reduce_slice(&mut flag, ReduceOp::Sum)?;
        if flag[0] > 0.0 {
            super::shared(self).lock().trigger = false;
            return Ok(true);
        }
        Ok(false)
    }
}
