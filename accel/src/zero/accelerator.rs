//! The [`Accelerator`](crate::Accelerator)'s ZeRO entry points.

use std::sync::Arc;

use accel_api::{Communicator, Result};
use accel_sharding::{Stage, WrapPolicy};

use super::gate::UnitGate;
use super::optimizer::ShardOptimizer;
use super::step::{StepOptions, StepReport, ZeroOptimizer};
use crate::train::Parameters;

/// The group ZeRO shards over, and the replicas it averages across.
type ZeroGroups = (Arc<dyn Communicator>, Option<Arc<dyn Communicator>>);

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
        let (shards, replicas) = self.zero_groups()?;
        let mut zero = ZeroOptimizer::new(shards, &model.model, self.sharding(), policy, opt)?;
        if let Some(r) = replicas {
            zero = zero.with_replicas(r);
        }
        // Stage 3: the model's own copy is out of date already; free it now.
        zero.release(&mut model.model, "")?;
        model.sharded = true;
        Ok(zero.with_checkpoint_key(format!("zero_{}", model.key)))
    }

    /// The groups ZeRO shards over and averages across, from the
    /// parallelism configuration: the world and none for plain data
    /// parallelism; with hybrid sharding (`dp_replicate` and `dp_shard`
    /// both above 1) or tensor / context parallelism, the mesh's
    /// `dp_shard` group (this rank alone when `dp_shard` is 1) and its
    /// `dp_replicate` group. Collective when the mesh is built.
    fn zero_groups(&self) -> Result<ZeroGroups> {
        let c = self.parallelism_config();
        let hybrid = c.dp_replicate > 1 && c.dp_shard > 1;
        if !hybrid && c.tp * c.cp == 1 {
            return Ok((self.comm().clone(), None));
        }
        let mesh = self.device_mesh()?;
        let shards = if c.dp_shard > 1 {
            mesh.group("dp_shard")?.clone()
        } else {
            // Only this rank holds its (tensor-parallel) part: a group of one.
            let me = u32::try_from(self.rank()).unwrap_or(u32::MAX);
            let alone = self.comm().split(Some(me), 0)?.ok_or_else(|| {
                accel_api::Error::new(
                    accel_api::ErrorKind::Internal,
                    "the split for a ZeRO group of one gave this rank no group",
                )
            })?;
            Arc::from(alone)
        };
        let replicas = if c.dp_replicate > 1 {
            Some(mesh.group("dp_replicate")?.clone())
        } else {
            None
        };
        Ok((shards, replicas))
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
