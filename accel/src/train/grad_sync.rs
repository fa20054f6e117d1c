//! Gradient accumulation and bucketed gradient averaging.

use accel_api::{Error, ReduceOp, Result};
use accel_sharding::StepDecision;

use super::adapters::Parameters;
use super::amp::MixedPrecision;
use super::grads::{self, BucketPlan, Reduce};
use super::overlap::OverlapGate;
use super::prepare::{Batch, PreparedModel};
use crate::watch::Phase;
use crate::zero::{NoGate, UnitGate};
use crate::Accelerator;

impl<M: Parameters> PreparedModel<M> {
    /// Average the gradients across ranks now, whatever the accumulation
    /// cadence says (what DDP does after `backward` outside `no_sync`).
    /// Collective.
    ///
    /// # Behavior
    /// The gradient views are grouped by (device, dtype), in visiting order
    /// within a group, into buckets of at most `bucket_cap_bytes`
    /// ([`TrainConfig`](super::TrainConfig)); as in DDP a gradient is never
    /// split across buckets, so one larger than the cap gets a bucket of
    /// its own. A bucket of one gradient is all-reduced in the gradient's
    /// own memory (no copy); a bucket of several goes through one bucket
    /// buffer on their device (host staging for host views, memory from the
    /// model's [`GradKernels`](super::GradKernels) for device views), never
    /// through the host for device memory. Gradients travel in their own
    /// dtype, or as bf16/f16 with
    /// [`TrainConfig::gradient_compression`](super::TrainConfig::gradient_compression)
    /// (f32 host gradients only). The average is the engine's `Avg` where
    /// declared, else a sum divided by the world size. On one rank nothing
    /// is communicated.
    ///
    /// # Errors
    /// The communicator's (timeout, lost peer, ...);
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for an integer gradient;
    /// [`ErrorKind::Unsupported`](accel_api::ErrorKind::Unsupported) for
    /// device gradients of a model without kernels when they need a bucket
    /// buffer or a division.
    pub fn all_reduce_gradients(&mut self) -> Result<()> {
        let world = self.comm.world_size();
        self.syncs += 1;
        if world == 1 {
            self.last_buckets = 0;
            return Ok(());
        }
        let (plan, how) = self.sync_plan()?;
        let report = grads::all_reduce_gradients(
            &*self.comm,
            &mut self.model,
            &plan,
            &mut self.staging,
            how,
            None,
        )?;
        self.last_buckets = report.buckets;
        self.last_in_place = report.in_place;
        self.last_early = 0;
        Ok(())
    }

    /// The buckets of this model's gradients and how they travel.
    fn sync_plan(&self) -> Result<(BucketPlan, Reduce)> {
        let (cap, first, compress) = {
            let st = self.shared.lock();
            let c = &st.config;
            (
                c.bucket_cap_bytes,
                c.first_bucket_cap_bytes,
                c.gradient_compression,
            )
        };
        let plan = BucketPlan::new(&self.model, cap, first.min(cap))?;
        let how = Reduce {
            world: self.comm.world_size(),
            native_avg: self.comm.capabilities().reduce_ops.contains(&ReduceOp::Avg),
            compress,
        };
        Ok((plan, how))
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
        // A step begins: its section (ACCEL_TIMEOUT_STEP) and phase clock.
        self.watch().begin_step(end_of_dataloader);
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
    /// the loss by the accumulation steps, also in a short final group),
    /// times the fp16 loss scaler's scale in fp16; it must *add* the
    /// gradients of `loss * scale` to the gradient buffers. Afterwards,
    /// when the decision's `all_reduce` is set, the gradients are averaged
    /// across ranks ([`PreparedModel::all_reduce_gradients`]); inside an
    /// accumulation group they are left local (DDP's `no_sync`), and always
    /// for a model given to [`prepare_zero`](Self::prepare_zero). Returns
    /// `f`'s result. Collective when it synchronises.
    ///
    /// # Errors
    /// The communicator's.
    pub fn backward<M: Parameters, R>(
        &self,
        model: &mut PreparedModel<M>,
        f: impl FnOnce(&mut M, f32) -> R,
    ) -> Result<R> {
        let shared = super::shared(self);
        let d = shared.decision();
        let loss_scale = shared.lock().amp.loss_scale();
        let out = {
            let _p = self.phase_guard(Phase::Backward);
            f(
                &mut model.model,
                (loss_scale / d.loss_divisor.max(1) as f64) as f32,
            )
        };
        if d.all_reduce && !model.sharded {
            let _p = self.phase_guard(Phase::Sync);
            model.all_reduce_gradients()?;
        }
        Ok(out)
    }

    /// [`backward`](Self::backward) with the gradient synchronisation
    /// overlapping the backward pass (torch DDP's reducer): `f` gets the
    /// model, the loss scale and a [`UnitGate`] whose `reduce_grads(model,
    /// module)` it calls after each module's backward, in backward order
    /// (the calls a module-wise backward already makes for ZeRO stage 3,
    /// e.g. `loss_and_grad_units(batch, scale, gate)`). Each gradient bucket
    /// starts its all-reduce on the communicator's worker as soon as its
    /// gradients are final, while `f` goes on; after `f` the rest start,
    /// every bucket is waited for and the averages are copied back. A
    /// bucket of one parameter waits for the end of `f` and is reduced in
    /// place, as [`backward`](Self::backward) does (started, it would be
    /// copied in and out; ADR 0033).
    /// Returns `f`'s result. Collective when the batch synchronises.
    ///
    /// # Behavior
    /// The buckets are [`backward`](Self::backward)'s (DDP's order:
    /// reverse visiting order, [`TrainConfig::first_bucket_cap_bytes`] then
    /// [`TrainConfig::bucket_cap_bytes`](super::TrainConfig::bucket_cap_bytes))
    /// and the results are bit-identical to it. They start in bucket order
    /// on every rank, whatever order the modules report in. Inside an
    /// accumulation group, on one rank, with
    /// [`TrainConfig::overlap_grad_sync`] off, or for a model given to
    /// [`prepare_zero`](Self::prepare_zero) (whose ZeRO optimizer is the
    /// gate to pass), the gate does nothing and `backward`'s
    /// synchronisation applies. Buckets the engine cannot reduce natively
    /// (device memory, a 16-bit type it only moves) are reduced after `f`.
    ///
    /// # Errors
    /// The communicator's, from the buckets' handles; a gate error is
    /// returned from `reduce_grads` too.
    ///
    /// [`TrainConfig::first_bucket_cap_bytes`]: super::TrainConfig::first_bucket_cap_bytes
    /// [`TrainConfig::overlap_grad_sync`]: super::TrainConfig::overlap_grad_sync
    pub fn backward_overlapped<M: Parameters, R>(
        &self,
        model: &mut PreparedModel<M>,
        f: impl FnOnce(&mut M, f32, &mut dyn UnitGate) -> R,
    ) -> Result<R> {
        let shared = super::shared(self);
        let d = shared.decision();
        let (loss_scale, overlap) = {
            let st = shared.lock();
            (st.amp.loss_scale(), st.config.overlap_grad_sync)
        };
        let scale = (loss_scale / d.loss_divisor.max(1) as f64) as f32;
        let sync = d.all_reduce && !model.sharded;
        if !sync || !overlap || model.comm.world_size() == 1 {
            let out = {
                let _p = self.phase_guard(Phase::Backward);
                f(&mut model.model, scale, &mut NoGate)
            };
            if sync {
                let _p = self.phase_guard(Phase::Sync);
                model.all_reduce_gradients()?;
            }
            return Ok(out);
        }
        model.syncs += 1;
        let (plan, how) = model.sync_plan()?;
        let mut pool = std::mem::take(&mut model.pool);
        let mut gate = OverlapGate::new(model.comm.clone(), &model.model, &plan, how, &mut pool);
        let out = {
            let _p = self.phase_guard(Phase::Backward);
            f(&mut model.model, scale, &mut gate)
        };
        // What the backward did not hide of the gradients' all-reduce.
        let report = {
            let _p = self.phase_guard(Phase::Sync);
            gate.finish(&mut model.model, &mut model.staging)
        };
        model.pool = pool;
        let (report, early) = report?;
        model.last_buckets = report.buckets;
        model.last_in_place = report.in_place;
        model.last_early = early;
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

impl Accelerator {
    /// The mixed-precision mode in force ([`TrainConfig::mixed_precision`](super::TrainConfig::mixed_precision)
    /// resolved against `accel launch --mixed-precision`).
    pub fn mixed_precision(&self) -> MixedPrecision {
        super::shared(self).lock().amp.mode
    }

    /// The fp16 loss scaler's state (`None` outside fp16).
    pub fn grad_scaler(&self) -> Option<super::GradScaler> {
        super::shared(self).lock().amp.scaler
    }

    /// Whether the last optimizer step was skipped because some rank's
    /// gradients were infinite or NaN (Accelerate's
    /// `optimizer_step_was_skipped`). The same on every rank.
    pub fn optimizer_step_was_skipped(&self) -> bool {
        super::shared(self).lock().amp.skipped
    }

    /// Divide the gradients by the fp16 loss scale now (Accelerate's
    /// `unscale_gradients`), once per optimizer step: later calls, and the
    /// optimizer step, do not divide again. Returns whether any rank found
    /// an infinite or NaN gradient (then the step will be skipped on every
    /// rank). Does nothing outside fp16. Collective in fp16 on more than
    /// one rank.
    ///
    /// # Errors
    /// The communicator's; device gradients without kernels.
    pub fn unscale_gradients<M: Parameters>(&self, model: &mut PreparedModel<M>) -> Result<bool> {
        super::shared(self).unscale_once(&**self.comm(), &mut model.model)
    }

    /// Clip the gradients to a total `norm_type`-norm of at most
    /// `max_norm` and return the total norm before clipping (torch's
    /// `clip_grad_norm_`, Accelerate's `clip_grad_norm_`). `norm_type` is
    /// 1, 2, any positive number, or `f64::INFINITY` (the largest
    /// magnitude).
    ///
    /// # Behavior
    /// In fp16 the gradients are unscaled first (once per step). The norm
    /// is computed over this rank's gradients: call it on synchronising
    /// batches ([`sync_gradients`](Self::sync_gradients)), where the
    /// gradients were averaged and are identical on every rank, so every
    /// rank gets the same norm and clips alike. The gradients are scaled by
    /// `max_norm / (norm + 1e-6)` when that is below 1. An infinite or NaN
    /// norm leaves the gradients as they are (in fp16 the step is then
    /// skipped); the norm is returned either way.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a `max_norm` or `norm_type` that is not a positive number; the
    /// communicator's (fp16 agreement); device gradients without kernels.
    pub fn clip_grad_norm<M: Parameters>(
        &self,
        model: &mut PreparedModel<M>,
        max_norm: f64,
        norm_type: f64,
    ) -> Result<f64> {
        let valid = max_norm > 0.0 && max_norm.is_finite() && norm_type > 0.0;
        if !valid {
            return Err(Error::invalid_argument(
                "clip_grad_norm",
                format!("max_norm {max_norm} and norm_type {norm_type}: both must be positive (norm_type may be infinite)"),
            )
            .with_fix("e.g. clip_grad_norm(&mut model, 1.0, 2.0)"));
        }
        super::shared(self).unscale_once(&**self.comm(), &mut model.model)?;
        let total = grads::total_norm(&model.model, norm_type)?;
        let coef = max_norm / (total + 1e-6);
        if total.is_finite() && coef < 1.0 {
            grads::scale_all(&mut model.model, coef, "clip_grad_norm")?;
        }
        Ok(total)
    }

    /// Clamp every gradient element into `[-clip_value, clip_value]`
    /// (torch's `clip_grad_value_`), after unscaling in fp16.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a negative or NaN `clip_value`; as
    /// [`clip_grad_norm`](Self::clip_grad_norm) otherwise.
    pub fn clip_grad_value<M: Parameters>(
        &self,
        model: &mut PreparedModel<M>,
        clip_value: f64,
    ) -> Result<()> {
        if clip_value.is_nan() || clip_value < 0.0 {
            return Err(Error::invalid_argument(
                "clip_grad_value",
                format!("clip_value {clip_value} must be a number at least 0"),
            ));
        }
        super::shared(self).unscale_once(&**self.comm(), &mut model.model)?;
        grads::clamp_all(&mut model.model, clip_value)
    }
}
