//! Gradient accumulation and bucketed gradient averaging.

use accel_api::{CommunicatorExt, ReduceOp, Result};
use accel_sharding::StepDecision;

use super::adapters::Parameters;
use super::prepare::{Batch, PreparedModel};
use crate::Accelerator;

impl<M: Parameters> PreparedModel<M> {
    /// Average the gradients across ranks now, whatever the accumulation
    /// cadence says (what DDP does after `backward` outside `no_sync`).
    /// Collective.
    ///
    /// # Behavior
    /// Gradients are copied into one flat buffer in visiting order and
    /// all-reduced in buckets of at most `bucket_cap_bytes`
    /// ([`TrainConfig`](super::TrainConfig)); as in DDP a parameter is never
    /// split across buckets, so one larger than the cap gets a bucket of its
    /// own. The average is the engine's `Avg` where declared, else a sum
    /// divided by the world size. On one rank nothing is communicated.
    ///
    /// # Errors
    /// The communicator's (timeout, lost peer, ...).
    pub fn all_reduce_gradients(&mut self) -> Result<()> {
        let world = self.comm.world_size();
        self.syncs += 1;
        if world == 1 {
            self.last_buckets = 0;
            return Ok(());
        }
        let cap = (self.shared.lock().config.bucket_cap_bytes / 4).max(1);
        let mut sizes = Vec::new();
        let flat = &mut self.flat;
        flat.clear();
        self.model.visit_params(&mut |p| {
            flat.extend_from_slice(p.grad);
            sizes.push(p.grad.len());
        });
        let native_avg = self.comm.capabilities().reduce_ops.contains(&ReduceOp::Avg);
        let op = if native_avg {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        };
        let mut buckets = 0;
        let (mut start, mut len) = (0usize, 0usize);
        let mut flush = |start: usize, len: usize, flat: &mut [f32]| -> Result<()> {
            buckets += 1;
            self.comm
                .all_reduce_slice(&mut flat[start..start + len], op)
        };
        for s in sizes {
            if len > 0 && len + s > cap {
                flush(start, len, flat)?;
                start += len;
                len = 0;
            }
            len += s;
        }
        if len > 0 {
            flush(start, len, flat)?;
        }
        if !native_avg {
            let inv = 1.0 / world as f32;
            flat.iter_mut().for_each(|g| *g *= inv);
        }
        self.last_buckets = buckets;
        let mut off = 0;
        self.model.visit_params_mut(&mut |p| {
            let n = p.grad.len();
            p.grad.copy_from_slice(&flat[off..off + n]);
            off += n;
        });
        Ok(())
    }
}

impl Accelerator {
    /// Advance the accumulation cadence for `batch` and return what to do
    /// with it (Accelerate's `accumulate` context): gradients synchronise on
    /// every `k`-th batch and on the last batch of the loader; the optimizer
    /// steps and zeroes gradients only then; the scheduler steps
    /// `num_processes` times per optimizer step (once with `split_batches`).
    ///
    /// The decision stays in force for [`backward`](Self::backward),
    /// [`PreparedOptimizer::step`](super::PreparedOptimizer::step) and
    /// [`PreparedScheduler::step`](super::PreparedScheduler::step) until the
    /// next call. A loop that never calls it synchronises on every batch.
    pub fn accumulate<T>(&self, batch: &Batch<T>) -> StepDecision {
        self.accumulate_step(batch.end_of_dataloader)
    }

    /// [`accumulate`](Self::accumulate) for a loop that does not use a
    /// [`PreparedLoader`](super::PreparedLoader): `end_of_dataloader` says
    /// this batch is the last of its loader.
    pub fn accumulate_step(&self, end_of_dataloader: bool) -> StepDecision {
        let mut st = super::shared(self).lock();
        let d = st.accumulator.next_batch(end_of_dataloader);
        st.decision = Some(d);
        d
    }

    /// Whether the current batch synchronises gradients (Accelerate's
    /// `sync_gradients`).
    pub fn sync_gradients(&self) -> bool {
        super::shared(self).decision().sync_gradients
    }

    /// `k`, the configured accumulation steps.
    pub fn gradient_accumulation_steps(&self) -> usize {
        super::shared(self)
            .lock()
            .config
            .gradient_accumulation_steps
    }

    /// Run the backward pass `f` and then synchronise gradients as the
    /// current batch's decision says (Accelerate's `backward`).
    ///
    /// # Behavior
    /// `f` gets the model and the loss scale, `1 / k` (Accelerate divides
    /// the loss by the accumulation steps, also in a short final group); it
    /// must *add* its scaled gradients to the gradient buffers. Afterwards,
    /// when the decision's `all_reduce` is set, the gradients are averaged
    /// across ranks ([`PreparedModel::all_reduce_gradients`]); inside an
    /// accumulation group they are left local (DDP's `no_sync`). Returns
    /// `f`'s result. Collective when it synchronises.
    ///
    /// # Errors
    /// The communicator's.
    pub fn backward<M: Parameters, R>(
        &self,
        model: &mut PreparedModel<M>,
        f: impl FnOnce(&mut M, f32) -> R,
    ) -> Result<R> {
        let d = super::shared(self).decision();
        let out = f(&mut model.model, 1.0 / d.loss_divisor.max(1) as f32);
        if d.all_reduce {
            model.all_reduce_gradients()?;
        }
        Ok(out)
    }

    /// Run `f` on the model with gradient synchronisation off: nothing is
    /// all-reduced, whatever the cadence says (DDP's `no_sync`).
    pub fn no_sync<M: Parameters, R>(
        &self,
        model: &mut PreparedModel<M>,
        f: impl FnOnce(&mut M) -> R,
    ) -> R {
        f(&mut model.model)
    }
}
