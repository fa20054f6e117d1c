//! Training configuration, seeding and RNG, coordinated early stopping.

use accel_api::{CommunicatorExt, ReduceOp, Result};

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

impl Accelerator {
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
    /// it restarts the accumulation cadence.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for 0 accumulation steps or a 0-byte bucket.
    pub fn set_training_config(&self, config: TrainConfig) -> Result<()> {
        super::shared(self).set_config(config)
    }

    /// The training-loop configuration in force.
    pub fn training_config(&self) -> TrainConfig {
        super::shared(self).lock().config.clone()
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
