//! Gradient-accumulation cadence: what to do after each batch.
//!
//! A pure state machine. The runtime asks it, once per batch, whether to
//! all-reduce gradients, step the optimizer and the scheduler, and by what to
//! divide the loss. It holds a single counter, which is part of a checkpoint.
//!
//! # Semantics (Accelerate's `accumulate` / `GradientState`)
//! - With `k` accumulation steps the counter advances once per batch and
//!   gradients are synchronised when it reaches a multiple of `k`;
//! - at the end of the loader (with `sync_with_dataloader`, the default) the
//!   gradients are synchronised whatever the counter says, and the counter
//!   restarts at 0, so every epoch starts a fresh accumulation group;
//! - the optimizer steps, and gradients are zeroed, only on a synchronising
//!   batch;
//! - the scheduler steps `num_processes` times per optimizer step (each
//!   optimizer step consumed `num_processes` loader batches), once with
//!   `split_batches`, and once per batch when it is not tied to the optimizer;
//! - `sync_each_batch` all-reduces on every batch (less memory, more traffic)
//!   without changing when the optimizer steps.

use accel_api::{Error, Result};
use serde::{Deserialize, Serialize};

/// The cadence parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccumulationConfig {
    /// `k`, batches per optimizer step; at least 1.
    pub steps: usize,
    /// Synchronise at the end of the loader even inside a group.
    pub sync_with_dataloader: bool,
    /// All-reduce on every batch, not only on synchronising ones.
    pub sync_each_batch: bool,
    /// World size.
    pub num_processes: usize,
    /// Batches are split across ranks (the scheduler then steps once per
    /// optimizer step).
    pub split_batches: bool,
    /// The scheduler is tied to the optimizer (Accelerate's
    /// `step_scheduler_with_optimizer`, default on).
    pub step_scheduler_with_optimizer: bool,
}

impl AccumulationConfig {
    /// `k` accumulation steps on `num_processes` ranks, Accelerate defaults
    /// otherwise.
    pub fn new(steps: usize, num_processes: usize) -> AccumulationConfig {
        AccumulationConfig {
            steps,
            sync_with_dataloader: true,
            sync_each_batch: false,
            num_processes,
            split_batches: false,
            step_scheduler_with_optimizer: true,
        }
    }
}

/// What to do for one batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StepDecision {
    /// Gradients are complete after this batch (Accelerate's
    /// `sync_gradients`).
    pub sync_gradients: bool,
    /// Gradients are all-reduced after this batch's backward pass
    /// (`sync_gradients`, or every batch with `sync_each_batch` on more than
    /// one rank); otherwise backward runs under `no_sync`.
    pub all_reduce: bool,
    /// The optimizer steps after this batch.
    pub optimizer_step: bool,
    /// Gradients are zeroed after the optimizer step.
    pub zero_grad: bool,
    /// How many times the scheduler steps after this batch.
    pub scheduler_steps: usize,
    /// Divide the loss by this before backward (`k`, as Accelerate does,
    /// also for a short final group).
    pub loss_divisor: usize,
}

/// The checkpointable part of a [`GradientAccumulator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccumulatorState {
    /// Batches since the last synchronisation point (Accelerate's `step`).
    pub step: usize,
}

/// The accumulation state machine.
#[derive(Clone, Debug)]
pub struct GradientAccumulator {
    config: AccumulationConfig,
    step: usize,
}

impl GradientAccumulator {
    /// A state machine at the start of a group.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// when `steps` or `num_processes` is 0.
    pub fn new(config: AccumulationConfig) -> Result<GradientAccumulator> {
        if config.steps == 0 {
            return Err(Error::invalid_argument(
                "accumulate",
                "gradient_accumulation_steps is 0; use 1 to step on every batch",
            ));
        }
        if config.num_processes == 0 {
            return Err(Error::invalid_argument("accumulate", "num_processes is 0"));
        }
        Ok(GradientAccumulator { config, step: 0 })
    }

    /// The configuration.
    pub fn config(&self) -> &AccumulationConfig {
        &self.config
    }

    /// Decide for the next batch; `end_of_dataloader` says it is the last
    /// batch of its loader.
    pub fn next_batch(&mut self, end_of_dataloader: bool) -> StepDecision {
        let c = &self.config;
        let sync = if c.sync_with_dataloader && end_of_dataloader {
            self.step = 0;
            true
        } else {
            self.step += 1;
            self.step.is_multiple_of(c.steps)
        };
        let scheduler_steps = if !c.step_scheduler_with_optimizer {
            1
        } else if !sync {
            0
        } else if c.split_batches {
            1
        } else {
            c.num_processes
        };
        StepDecision {
            sync_gradients: sync,
            all_reduce: sync || (c.sync_each_batch && c.num_processes > 1),
            optimizer_step: sync,
            zero_grad: sync,
            scheduler_steps,
            loss_divisor: c.steps,
        }
    }

    /// The counter, for a checkpoint.
    pub fn state(&self) -> AccumulatorState {
        AccumulatorState { step: self.step }
    }

    /// Restore the counter from a checkpoint.
    pub fn load_state(&mut self, state: AccumulatorState) {
        self.step = state.step;
    }
}

/// Pair every item of `items` with its [`StepDecision`], detecting the end
/// of the loader by looking one item ahead.
pub fn accumulate<I: Iterator>(items: I, acc: &mut GradientAccumulator) -> Accumulate<'_, I> {
    Accumulate {
        items: items.peekable(),
        acc,
    }
}

/// Iterator returned by [`accumulate`].
pub struct Accumulate<'a, I: Iterator> {
    items: std::iter::Peekable<I>,
    acc: &'a mut GradientAccumulator,
}

impl<I: Iterator> std::fmt::Debug for Accumulate<'_, I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Accumulate")
            .field("acc", &self.acc)
            .finish_non_exhaustive()
    }
}

impl<I: Iterator> Iterator for Accumulate<'_, I> {
    type Item = (I::Item, StepDecision);

    fn next(&mut self) -> Option<Self::Item> {
        let item = self.items.next()?;
        let end = self.items.peek().is_none();
        Some((item, self.acc.next_batch(end)))
    }
}
