//! The [`Accelerator`](crate::Accelerator)'s ZeRO entry points.

use accel_api::Result;
use accel_sharding::{Stage, WrapPolicy};

use super::gate::UnitGate;
use super::optimizer::ShardOptimizer;
use super::step::{StepOptions, StepReport, ZeroOptimizer};
use crate::train::Parameters;

impl crate::Accelerator {
    /// The sharding stage in force: [`TrainConfig::sharding`](crate::train::TrainConfig::sharding),
    /// else [`SHARDING_ENV`](crate::zero::SHARDING_ENV), else [`Stage::None`].
    pub fn sharding(&self) -> Stage {
        crate::train::shared(self).lock().sharding
    }

    /// A [`ZeroOptimizer`] for a prepared model at the configured stage
    /// ([`sharding`](Self::sharding)) over this accelerator's
    /// communicator, units by `policy`. From then on
    /// [`backward`](Self::backward) leaves the model's gradients local:
    /// the optimizer reduces them (stages 0-2 in
    /// [`zero_step`](Self::zero_step), stage 3 in
    /// [`UnitGate::reduce_grads`]). The prepared model's values are the
    /// same on every rank (prepare broadcast them), which stage 3 shards.
    ///
    /// # Errors
    /// As [`ZeroOptimizer::new`].
    pub fn prepare_zero<M: Parameters, O: ShardOptimizer>(
        &self,
        model: &mut crate::train::PreparedModel<M>,
        policy: &WrapPolicy,
        opt: O,
    ) -> Result<ZeroOptimizer<O>> {
        let mut zero = ZeroOptimizer::new(
            self.comm().clone(),
            &model.model,
            self.sharding(),
            policy,
            opt,
        )?;
        // Stage 3: the model's own copy is out of date already; free it now.
        zero.release(&mut model.model, "")?;
        model.sharded = true;
        Ok(zero.with_checkpoint_key(format!("zero_{}", model.key)))
    }

    /// The optimizer step of a sharded run on a batch where the
    /// accumulation cadence steps (Accelerate's `optimizer.step()` under
    /// DeepSpeed): `Ok(None)` inside an accumulation group. In fp16 the
    /// accelerator's loss scaler unscales the gradients, an overflow on
    /// any rank skips the step on every rank
    /// ([`optimizer_step_was_skipped`](Self::optimizer_step_was_skipped))
    /// and the scaler is updated. `max_norm` clips the averaged gradients
    /// first. Collective.
    ///
    /// # Errors
    /// As [`ZeroOptimizer::step_with`].
    pub fn zero_step<M: Parameters, O: ShardOptimizer>(
        &self,
        zero: &mut ZeroOptimizer<O>,
        model: &mut crate::train::PreparedModel<M>,
        max_norm: Option<f32>,
    ) -> Result<Option<StepReport>> {
        let shared = crate::train::shared(self);
        if !shared.decision().optimizer_step {
            return Ok(None);
        }
        let mut scaler = shared.lock().amp.scaler;
        let opts = StepOptions {
            max_norm,
            scaler: scaler.as_mut(),
        };
        let report = zero.step_with(&mut model.model, opts)?;
        let mut st = shared.lock();
        st.amp.scaler = scaler;
        st.amp.unscaled = None;
        st.amp.skipped = report.skipped;
        if report.skipped {
            st.amp.skipped_steps += 1;
        }
        Ok(Some(report))
    }
}
