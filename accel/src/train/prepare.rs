//! `prepare`: the wrappers around models, optimizers, schedulers and loaders.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use accel_api::{Communicator, Result, Wrapper};
use accel_sharding::{LoaderConfig, SamplerState, ShardedLoader};

use super::adapters::{DataLoader, Dataset, Optimizer, Parameters, Scheduler};
use super::grads::Staging;
use super::{Kind, TrainShared};
use crate::Accelerator;

/// What [`Accelerator::prepare`] accepts: a raw object (wrapped) or an
/// already prepared wrapper `W` (returned unchanged).
///
/// Implemented for every [`Parameters`] (→ [`PreparedModel`]), every
/// [`Optimizer`] (→ [`PreparedOptimizer`]), every [`Scheduler`]
/// (→ [`PreparedScheduler`]), every [`DataLoader`] (→ [`PreparedLoader`]),
/// and for each wrapper itself.
pub trait Prepare<W> {
    /// Wrap `self` for `acc`, or return it when it already is `W`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a loader the world cannot shard (batch size 0, `split_batches`
    /// with a batch size the world size does not divide);
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig),
    /// under strict mode only, for a model that does not compute in the
    /// mixed precision set ([`Parameters::uses_mixed_precision`]).
    fn prepare_with(self, acc: &Accelerator) -> Result<W>;
}

impl Accelerator {
    /// Prepare a model, optimizer, scheduler or loader for distributed
    /// training (Accelerate's `prepare`). Preparing a wrapper returns it
    /// unchanged. The output type picks the kind; the typed
    /// [`prepare_model`](Self::prepare_model) and friends need no annotation.
    ///
    /// # Errors
    /// As [`Prepare::prepare_with`].
    pub fn prepare<W, T: Prepare<W>>(&self, value: T) -> Result<W> {
        value.prepare_with(self)
    }

    /// [`prepare`](Self::prepare) for a model.
    ///
    /// # Errors
    /// As [`Prepare::prepare_with`].
    pub fn prepare_model<M: Parameters>(
        &self,
        model: impl Prepare<PreparedModel<M>>,
    ) -> Result<PreparedModel<M>> {
        model.prepare_with(self)
    }

    /// [`prepare`](Self::prepare) for an optimizer.
    ///
    /// # Errors
    /// As [`Prepare::prepare_with`].
    pub fn prepare_optimizer<O: Optimizer>(
        &self,
        optimizer: impl Prepare<PreparedOptimizer<O>>,
    ) -> Result<PreparedOptimizer<O>> {
        optimizer.prepare_with(self)
    }

    /// [`prepare`](Self::prepare) for a scheduler.
    ///
    /// As a torch scheduler, which sets its optimizer's rate when it is
    /// built, the schedule's current rate ([`Scheduler::lr`], for a
    /// warm-up its first rate) is what the optimizer steps with from its
    /// first step: the `n`-th prepared scheduler hands it to the `n`-th
    /// [`PreparedOptimizer`] (in prepare order), which applies it before
    /// its first step unless the scheduler stepped first. An optimizer
    /// restored from a checkpoint keeps its restored rate. To pair another
    /// way, or to drive a [`ZeroOptimizer`](crate::zero::ZeroOptimizer),
    /// use [`prepare_scheduler_for`](Self::prepare_scheduler_for).
    ///
    /// # Errors
    /// As [`Prepare::prepare_with`].
    pub fn prepare_scheduler<S: Scheduler>(
        &self,
        scheduler: impl Prepare<PreparedScheduler<S>>,
    ) -> Result<PreparedScheduler<S>> {
        scheduler.prepare_with(self)
    }

    /// [`prepare_scheduler`](Self::prepare_scheduler) for the optimizer
    /// `optimizer` (a [`PreparedOptimizer`] or a
    /// [`ZeroOptimizer`](crate::zero::ZeroOptimizer)): its learning rate is
    /// set to the schedule's current rate now, as torch's schedulers
    /// (`LambdaLR`, transformers' `get_linear_schedule_with_warmup`) do when
    /// they are built over an optimizer, and no other optimizer gets it.
    ///
    /// # Errors
    /// As [`Prepare::prepare_with`].
    pub fn prepare_scheduler_for<S: Scheduler, T: ScheduledOptimizer + ?Sized>(
        &self,
        optimizer: &mut T,
        scheduler: impl Prepare<PreparedScheduler<S>>,
    ) -> Result<PreparedScheduler<S>> {
        let mut sched = scheduler.prepare_with(self)?;
        sched.by_number = false;
        super::shared(self)
            .lock()
            .initial_lr
            .remove(&key_index(&sched.key));
        optimizer.set_scheduled_lr(sched.scheduler.lr());
        Ok(sched)
    }

    /// [`prepare`](Self::prepare) for a loader.
    ///
    /// # Errors
    /// As [`Prepare::prepare_with`].
    pub fn prepare_loader<D: Dataset>(
        &self,
        loader: impl Prepare<PreparedLoader<D>>,
    ) -> Result<PreparedLoader<D>> {
        loader.prepare_with(self)
    }
}

macro_rules! wrapper_impls {
    ($ty:ident, $bound:ident, $field:ident) => {
        impl<T: $bound> Deref for $ty<T> {
            type Target = T;
            fn deref(&self) -> &T {
                &self.$field
            }
        }
        impl<T: $bound> DerefMut for $ty<T> {
            fn deref_mut(&mut self) -> &mut T {
                &mut self.$field
            }
        }
        impl<T: $bound> Wrapper for $ty<T> {
            type Inner = T;
            fn inner(&self) -> &T {
                &self.$field
            }
            fn inner_mut(&mut self) -> &mut T {
                &mut self.$field
            }
            fn into_inner(self) -> T {
                self.$field
            }
        }
        impl<T: $bound> Prepare<$ty<T>> for $ty<T> {
            fn prepare_with(self, _acc: &Accelerator) -> Result<$ty<T>> {
                Ok(self)
            }
        }
    };
}

/// The same for a prepared loader (field `loader`, over `$inner<D>`), with
/// a read-only `Deref`.
macro_rules! loader_wrapper_impls {
    ($ty:ident, $bound:ident, $inner:ident) => {
        impl<D: $bound> std::ops::Deref for $ty<D> {
            type Target = $inner<D>;
            fn deref(&self) -> &$inner<D> {
                &self.loader
            }
        }
        impl<D: $bound> Wrapper for $ty<D> {
            type Inner = $inner<D>;
            fn inner(&self) -> &$inner<D> {
                &self.loader
            }
            /// Changing the batching of a prepared loader does not re-shard
            /// it; prepare the unwrapped loader again for that.
            fn inner_mut(&mut self) -> &mut $inner<D> {
                &mut self.loader
            }
            fn into_inner(self) -> $inner<D> {
                self.loader
            }
        }
        impl<D: $bound> Prepare<$ty<D>> for $ty<D> {
            fn prepare_with(self, _acc: &Accelerator) -> Result<$ty<D>> {
                Ok(self)
            }
        }
    };
}
pub(crate) use loader_wrapper_impls;

// ---------------------------------------------------------------- model

/// A model prepared for data-parallel training (DDP's job): its gradients
/// are averaged across ranks in buckets when the accumulation cadence says
/// so (see [`Accelerator::backward`]). Derefs to the model.
pub struct PreparedModel<M: Parameters> {
    pub(crate) model: M,
    pub(crate) key: String,
    pub(crate) comm: Arc<dyn Communicator>,
    pub(crate) shared: Arc<TrainShared>,
    pub(crate) staging: Staging,
    /// Bucket buffers of the overlapped synchronisation, kept between steps.
    pub(crate) pool: Vec<accel_api::HostBytes>,
    pub(crate) syncs: u64,
    pub(crate) last_buckets: usize,
    pub(crate) last_in_place: usize,
    /// Buckets the last overlapped synchronisation started before the
    /// backward ended.
    pub(crate) last_early: usize,
    /// A ZeRO optimizer reduces the gradients ([`Accelerator::prepare_zero`]).
    pub(crate) sharded: bool,
}

impl<M: Parameters> std::fmt::Debug for PreparedModel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedModel")
            .field("key", &self.key)
            .field("params", &self.model.num_params())
            .field("gradient_syncs", &self.syncs)
            .finish_non_exhaustive()
    }
}

wrapper_impls!(PreparedModel, Parameters, model);

/// Copy the main process's parameter values to every rank, one broadcast
/// per parameter in the values' own memory (nothing on one rank).
/// Collective.
///
/// # Errors
/// A broadcast's, naming `op` and the parameter.
pub(super) fn broadcast_values<P: Parameters + ?Sized>(
    acc: &Accelerator,
    model: &mut P,
    op: &str,
) -> Result<()> {
    if acc.world_size() == 1 {
        return Ok(());
    }
    let comm = acc.comm();
    let mut err = None;
    model.visit_params_mut(&mut |p| {
        if err.is_none() && !p.value.is_empty() {
            if let Err(e) = comm.broadcast(p.value, 0) {
                err = Some(e.with_op(format!("{op}: broadcast of {:?}", p.name)));
            }
        }
    });
    err.map_or(Ok(()), Err)
}

impl<M: Parameters> Prepare<PreparedModel<M>> for M {
    /// Wraps the model and, like DDP, copies the main process's parameter
    /// values to every rank (one broadcast per parameter, in the values'
    /// own memory), so all ranks start equal. Collective on more than one
    /// rank. `Unsupported`, before any communication, for a model whose
    /// gradients are device views while it gives no
    /// [`Parameters::grad_kernels`].
    /// A mixed precision the model does not compute in is reported first
    /// ([`Accelerator::settings_not_applied`]; an error under strict mode).
    /// The first model prepared in a process also has glibc keep the memory
    /// the loop frees (large gradients are then reused instead of mapped
    /// and faulted in on every backward; `ACCEL_MALLOC=system` opts out,
    /// any other value is an `InvalidConfig` error; docs/adr/0038).
    fn prepare_with(mut self, acc: &Accelerator) -> Result<PreparedModel<M>> {
        super::malloc::apply_from_env()?;
        super::grads::check_kernels(&self, "prepare_model")?;
        super::shared(acc).check_mixed_precision(acc.rank(), &self)?;
        broadcast_values(acc, &mut self, "prepare_model")?;
        let shared = super::shared(acc).clone();
        Ok(PreparedModel {
            model: self,
            key: shared.next_key(Kind::Model),
            comm: acc.comm().clone(),
            shared,
            staging: Staging::default(),
            syncs: 0,
            pool: Vec::new(),
            last_buckets: 0,
            last_in_place: 0,
            last_early: 0,
            sharded: false,
        })
    }
}

impl<M: Parameters> PreparedModel<M> {
    /// The checkpoint key (`model_0`, `model_1`, ... in prepare order).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How many times gradients were all-reduced (tests and logging: inside
    /// an accumulation group this does not move).
    pub fn gradient_syncs(&self) -> u64 {
        self.syncs
    }

    /// Buckets used by the last gradient all-reduce.
    pub fn last_sync_buckets(&self) -> usize {
        self.last_buckets
    }

    /// Of those, the buckets of one gradient, all-reduced in the
    /// gradient's own memory without a copy.
    pub fn last_sync_in_place(&self) -> usize {
        self.last_in_place
    }

    /// Buckets the last [`backward_overlapped`](crate::Accelerator::backward_overlapped)
    /// started while the backward still ran (0 for a blocking
    /// synchronisation).
    pub fn last_sync_started_early(&self) -> usize {
        self.last_early
    }
}

// ---------------------------------------------------------------- optimizer

/// An optimizer that steps, and zeroes gradients, only on synchronising
/// batches (Accelerate's `AcceleratedOptimizer`). Derefs to the optimizer.
pub struct PreparedOptimizer<O: Optimizer> {
    pub(crate) optimizer: O,
    pub(crate) key: String,
    pub(crate) shared: Arc<TrainShared>,
    pub(crate) comm: Arc<dyn Communicator>,
    pub(crate) steps: u64,
    /// The last synchronising step was skipped (fp16 overflow).
    pub(crate) skipped: bool,
    /// `n` of `optimizer_n`: the scheduler of the same number gives it
    /// its first rate.
    pub(crate) index: usize,
    /// The rank's clock: the optimizer phase, straggler reports.
    pub(crate) watch: Arc<crate::watch::Watch>,
    /// Synchronising steps seen (stepped or skipped): when to report.
    pub(crate) sync_steps: u64,
}

impl<O: Optimizer> std::fmt::Debug for PreparedOptimizer<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedOptimizer")
            .field("key", &self.key)
            .field("lr", &self.optimizer.lr())
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

wrapper_impls!(PreparedOptimizer, Optimizer, optimizer);

impl<O: Optimizer> Prepare<PreparedOptimizer<O>> for O {
    fn prepare_with(self, acc: &Accelerator) -> Result<PreparedOptimizer<O>> {
        let shared = super::shared(acc).clone();
        let key = shared.next_key(Kind::Optimizer);
        Ok(PreparedOptimizer {
            optimizer: self,
            index: key_index(&key),
            key,
            shared,
            comm: acc.comm().clone(),
            steps: 0,
            skipped: false,
            watch: acc.watch().clone(),
            sync_steps: 0,
        })
    }
}

impl<O: Optimizer> PreparedOptimizer<O> {
    /// Step the optimizer over `model`'s averaged gradients, if the current
    /// batch synchronises; returns whether it stepped.
    ///
    /// # Behavior
    /// In fp16 the gradients are unscaled first (unless
    /// [`clip_grad_norm`](Accelerator::clip_grad_norm) or
    /// [`unscale_gradients`](Accelerator::unscale_gradients) did it this
    /// step) and the ranks agree whether any gradient is infinite or NaN;
    /// if so the step is skipped on every rank, the loss scale backs off
    /// and [`step_was_skipped`](Self::step_was_skipped) is `true`
    /// (torch's `GradScaler.step` + `update`). Collective in fp16 on more
    /// than one rank.
    ///
    /// # Errors
    /// The optimizer's; the communicator's (fp16 agreement);
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
    /// under strict mode when a sharding stage is set but `model` is not
    /// sharded by [`prepare_zero`](Accelerator::prepare_zero) (otherwise a
    /// warning, see [`Accelerator::settings_not_applied`]).
    pub fn step<M: Parameters>(&mut self, model: &mut PreparedModel<M>) -> Result<bool> {
        if !self.shared.decision().optimizer_step {
            return Ok(false);
        }
        let stepped = {
            let watch = self.watch.clone();
            let _p = super::PhaseGuard::new(&watch, crate::watch::Phase::Optimizer);
            self.step_now(model)?
        };
        self.sync_steps += 1;
        self.watch.optimizer_stepped();
        // The first optimizer reports (every rank steps it alike).
        if self.index == 0 {
            super::phases::report_phases(&self.shared, &*self.comm, &self.watch, self.sync_steps)?;
        }
        Ok(stepped)
    }

    fn step_now<M: Parameters>(&mut self, model: &mut PreparedModel<M>) -> Result<bool> {
        if !model.sharded {
            self.shared
                .check_sharding(self.comm.rank(), "PreparedOptimizer::step")?;
        }
        let initial = self.shared.lock().initial_lr.remove(&self.index);
        if let Some(lr) = initial.filter(|_| self.steps == 0) {
            // The paired scheduler's first rate (see `prepare_scheduler`).
            self.optimizer.set_lr(lr);
        }
        let found_inf = self.shared.unscale_once(&*self.comm, &mut model.model)?;
        {
            let mut st = self.shared.lock();
            let amp = &mut st.amp;
            if let Some(scaler) = amp.scaler.as_mut() {
                scaler.update(found_inf);
            }
            amp.unscaled = None;
            amp.skipped = found_inf;
            if found_inf {
                amp.skipped_steps += 1;
            }
        }
        self.skipped = found_inf;
        if found_inf {
            return Ok(false);
        }
        self.optimizer.step(&mut model.model)?;
        self.steps += 1;
        Ok(true)
    }

    /// Whether the last synchronising [`step`](Self::step) was skipped
    /// because some rank's fp16 gradients overflowed (torch's
    /// `step_was_skipped`).
    pub fn step_was_skipped(&self) -> bool {
        self.skipped
    }

    /// Zero `model`'s gradients, if the current batch synchronises (inside an
    /// accumulation group they must survive); returns whether it did.
    pub fn zero_grad<M: Parameters>(&mut self, model: &mut PreparedModel<M>) -> bool {
        if !self.shared.decision().zero_grad {
            return false;
        }
        self.optimizer.zero_grad(&mut model.model);
        self.shared.lock().amp.unscaled = None;
        true
    }

    /// Optimizer steps taken through this wrapper.
    pub fn steps_taken(&self) -> u64 {
        self.steps
    }

    /// The checkpoint key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

// ---------------------------------------------------------------- scheduler

/// A scheduler that steps `num_processes` times per optimizer step (once
/// with `split_batches`, once per batch when not tied to the optimizer),
/// as Accelerate's `AcceleratedScheduler`. Derefs to the scheduler.
pub struct PreparedScheduler<S: Scheduler> {
    pub(crate) scheduler: S,
    pub(crate) key: String,
    pub(crate) shared: Arc<TrainShared>,
    /// Hands its first rate to the optimizer of the same number
    /// (`prepare_scheduler`), not to one given (`prepare_scheduler_for`).
    pub(crate) by_number: bool,
}

impl<S: Scheduler> std::fmt::Debug for PreparedScheduler<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedScheduler")
            .field("key", &self.key)
            .field("lr", &self.scheduler.lr())
            .finish_non_exhaustive()
    }
}

wrapper_impls!(PreparedScheduler, Scheduler, scheduler);

impl<S: Scheduler> Prepare<PreparedScheduler<S>> for S {
    /// Also records the schedule's current rate for the optimizer of the
    /// same number (see [`Accelerator::prepare_scheduler`]).
    fn prepare_with(self, acc: &Accelerator) -> Result<PreparedScheduler<S>> {
        let shared = super::shared(acc).clone();
        let key = shared.next_key(Kind::Scheduler);
        shared.lock().initial_lr.insert(key_index(&key), self.lr());
        Ok(PreparedScheduler {
            scheduler: self,
            key,
            shared,
            by_number: true,
        })
    }
}

/// `n` of a checkpoint key `kind_n`.
fn key_index(key: &str) -> usize {
    key.rsplit('_')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// An optimizer a [`PreparedScheduler`] drives: a [`PreparedOptimizer`]
/// or a [`ZeroOptimizer`](crate::zero::ZeroOptimizer).
pub trait ScheduledOptimizer {
    /// Replace the learning rate with the schedule's.
    fn set_scheduled_lr(&mut self, lr: f64);

    /// Whether this optimizer's last step was skipped for an fp16
    /// overflow; `None` when the accelerator's
    /// [`optimizer_step_was_skipped`](Accelerator::optimizer_step_was_skipped)
    /// says it (the ZeRO step records it there).
    fn last_step_skipped(&self) -> Option<bool> {
        None
    }
}

impl<O: Optimizer> ScheduledOptimizer for PreparedOptimizer<O> {
    fn set_scheduled_lr(&mut self, lr: f64) {
        self.optimizer.set_lr(lr);
        // The schedule moved first: its first rate is out of date.
        self.shared.lock().initial_lr.remove(&self.index);
    }
    fn last_step_skipped(&self) -> Option<bool> {
        Some(self.skipped)
    }
}

impl<O: crate::zero::ShardOptimizer> ScheduledOptimizer for crate::zero::ZeroOptimizer<O> {
    fn set_scheduled_lr(&mut self, lr: f64) {
        self.optimizer_mut().set_lr(lr);
    }
}

impl<S: Scheduler> PreparedScheduler<S> {
    /// Step the schedule as many times as the current batch's decision says
    /// and, if it stepped, give `optimizer` (a [`PreparedOptimizer`] or a
    /// [`ZeroOptimizer`](crate::zero::ZeroOptimizer)) the resulting
    /// learning rate; returns the number of steps. Inside an accumulation
    /// group (no step) the optimizer's rate is left alone, so the first
    /// optimizer step uses the schedule's first rate whatever the
    /// accumulation setting (as PyTorch: the rate is set when the scheduler
    /// is built, then changes only when `scheduler.step()` runs). After an
    /// optimizer step skipped for an fp16 overflow the schedule does not
    /// move (as Accelerate's `AcceleratedScheduler`).
    pub fn step<T: ScheduledOptimizer + ?Sized>(&mut self, optimizer: &mut T) -> usize {
        let d = self.shared.decision();
        let skipped = optimizer
            .last_step_skipped()
            .unwrap_or_else(|| self.shared.lock().amp.skipped);
        if d.optimizer_step && skipped {
            return 0;
        }
        let n = d.scheduler_steps;
        for _ in 0..n {
            self.scheduler.step();
        }
        if n > 0 {
            optimizer.set_scheduled_lr(self.scheduler.lr());
        }
        n
    }

    /// The checkpoint key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// After a restore: the rate the paired optimizer's first step takes
    /// (see [`Accelerator::prepare_scheduler`]) is the restored schedule's,
    /// not the one noted when this scheduler was prepared. A checkpoint
    /// taken inside the first accumulation group, after the schedule moved
    /// (`step_scheduler_with_optimizer = false`), resumes on the same rates.
    pub(crate) fn note_restored_rate(&self) {
        if !self.by_number {
            return; // `prepare_scheduler_for`: the optimizer's state has it
        }
        let lr = self.scheduler.lr();
        self.shared
            .lock()
            .initial_lr
            .insert(key_index(&self.key), lr);
    }
}

// ---------------------------------------------------------------- loader

/// One batch from a [`PreparedLoader`].
#[derive(Clone, Debug, PartialEq)]
pub struct Batch<T> {
    /// The samples, in order.
    pub items: Vec<T>,
    /// Their dataset indices.
    pub indices: Vec<usize>,
    /// The epoch.
    pub epoch: u64,
    /// Position among this rank's batches of the epoch.
    pub index: usize,
    /// Last batch of the epoch (Accelerate's `end_of_dataloader`).
    pub end_of_dataloader: bool,
    /// Real samples in the last gathered step when it holds top-up
    /// duplicates (0 otherwise); what `gather_for_metrics` keeps.
    pub remainder: usize,
}

/// A loader sharded across ranks with an exact, checkpointable position
/// (`accel-sharding`'s [`ShardedLoader`] over a [`Dataset`]). Derefs to the
/// [`DataLoader`].
pub struct PreparedLoader<D: Dataset> {
    pub(crate) loader: DataLoader<D>,
    pub(crate) key: String,
    pub(crate) sharded: ShardedLoader,
    /// The epoch the pull in progress belongs to.
    pub(crate) pulling: Option<u64>,
}

impl<D: Dataset> std::fmt::Debug for PreparedLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedLoader")
            .field("key", &self.key)
            .field("sharded", &self.sharded)
            .finish_non_exhaustive()
    }
}

loader_wrapper_impls!(PreparedLoader, Dataset, DataLoader);

impl<D: Dataset> Prepare<PreparedLoader<D>> for DataLoader<D> {
    fn prepare_with(self, acc: &Accelerator) -> Result<PreparedLoader<D>> {
        let shared = super::shared(acc).clone();
        let (split_batches, even_batches, dispatch) = {
            let st = shared.lock();
            (
                st.config.split_batches,
                st.config.even_batches,
                st.config.dispatch_batches,
            )
        };
        if dispatch == Some(true) {
            return Err(accel_api::Error::invalid_config(
                "dispatch_batches",
                "true",
                "a map-style DataLoader is read by index on every rank; dispatching applies to iterable loaders",
            )
            .with_fix("wrap the data in an IterableDataset and prepare an IterableLoader, or leave dispatch_batches at None"));
        }
        let config = LoaderConfig {
            dataset_len: self.dataset.len(),
            batch_size: self.batch_size,
            drop_last: self.drop_last,
            shuffle: self.shuffle,
            seed: self.seed,
            // Over the data-parallel ranks: the ranks of one tensor-parallel
            // block read the same batches.
            num_processes: acc.data_parallel_place().1,
            split_batches,
            even_batches,
        };
        let sharded = ShardedLoader::new(config, acc.data_parallel_place().0)
            .map_err(|e| e.with_rank(acc.rank()))?;
        Ok(PreparedLoader {
            loader: self,
            key: shared.next_key(Kind::Loader),
            sharded,
            pulling: None,
        })
    }
}

impl<D: Dataset> PreparedLoader<D> {
    /// The next batch of the current epoch, or `None` once the epoch is
    /// over (the following call starts the next epoch).
    ///
    /// # Behavior
    /// Pull-style, so the loop body may borrow the loader (to checkpoint
    /// it) between batches. The position advances as batches are handed
    /// out; a state taken after the last batch of an epoch resumes at the
    /// start of the next one.
    pub fn next_batch(&mut self) -> Option<Batch<D::Item>> {
        let epoch = *self.pulling.get_or_insert(self.sharded.epoch());
        if self.sharded.epoch() != epoch {
            self.pulling = None;
            return None;
        }
        let Some(b) = self.sharded.epoch_iter().next() else {
            self.pulling = None;
            return None;
        };
        let items = b
            .indices
            .iter()
            .map(|&i| self.loader.dataset.get(i))
            .collect();
        Some(Batch {
            items,
            indices: b.indices,
            epoch: b.epoch,
            index: b.index,
            end_of_dataloader: b.end_of_dataloader,
            remainder: self.sharded.remainder(),
        })
    }

    /// The rest of the current epoch as an iterator (borrows the loader).
    pub fn iter(&mut self) -> impl Iterator<Item = Batch<D::Item>> + '_ {
        std::iter::from_fn(move || self.next_batch())
    }

    /// Batches this rank reads per epoch.
    pub fn len(&self) -> usize {
        self.sharded.len()
    }

    /// `true` when an epoch has no batch for this rank.
    pub fn is_empty(&self) -> bool {
        self.sharded.is_empty()
    }

    /// The epoch of the next batch.
    pub fn epoch(&self) -> u64 {
        self.sharded.epoch()
    }

    /// Jump to the start of `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.sharded.set_epoch(epoch);
        self.pulling = None;
    }

    /// Skip the next `n` batches of the current epoch (Accelerate's
    /// `skip_first_batches`); returns how many were skipped.
    pub fn skip_first_batches(&mut self, n: usize) -> usize {
        self.sharded.skip_first_batches(n)
    }

    /// Whether the last batch handed out ended its epoch.
    pub fn end_of_dataloader(&self) -> bool {
        self.sharded.end_of_dataloader()
    }

    /// Real samples in the last gathered step when it holds duplicates.
    pub fn remainder(&self) -> usize {
        self.sharded.remainder()
    }

    /// The exact position, for checkpoints.
    pub fn sampler_state(&self) -> SamplerState {
        self.sharded.state()
    }

    /// Move to a saved position.
    ///
    /// # Errors
    /// As [`ShardedLoader::load_state`]: a state taken with another data
    /// layout or world size is refused, naming the field.
    pub fn load_sampler_state(&mut self, state: &SamplerState) -> Result<()> {
        self.sharded.load_state(state)?;
        self.pulling = None;
        Ok(())
    }

    /// The sharding configuration in force.
    pub fn config(&self) -> &LoaderConfig {
        self.sharded.config()
    }

    /// The checkpoint key.
    pub fn key(&self) -> &str {
        &self.key
    }
}
