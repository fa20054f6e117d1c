//! The digits demos' training loop, whatever engine holds the model:
//! sharded data, gradient accumulation, clipping, a learning-rate
//! schedule, checkpoints every `save_every` steps, exact resume, a stop at
//! `stop_after` as if killed, and the held-out accuracy after every epoch
//! counted with `gather_for_metrics`. The engine brings the model, its
//! optimizer, and a [`DigitsEngine`]: the forward and backward pass of a
//! batch and the classification of held-out images.

use std::time::Instant;

use accel::train::{
    Batch, DataLoader, Optimizer, Parameters, PreparedModel, PreparedOptimizer, Scheduler,
};
use accel::zero::UnitGate;
use accel::{Accelerator, Result};

use crate::digits::Digits;
use crate::run::{self, flat_params, Report, RunOptions, Steps};

/// Held-out images classified right, and images counted, across ranks.
pub type Hits = (u64, usize);

/// What an engine does in [`train_digits`].
pub trait DigitsEngine<M> {
    /// Run `images` through the model, backward from their mean loss
    /// times `scale` (the gradients land in `model`'s): the loss, unscaled.
    ///
    /// # Errors
    /// The engine's.
    fn loss_backward(&mut self, model: &mut M, scale: f32, images: Digits) -> Result<f64>;

    /// As [`loss_backward`](Self::loss_backward), telling `gate` each
    /// module's gradients as the backward finishes them (`reduce_grads`
    /// after each module, in backward order), so that their all-reduce
    /// overlaps the rest of the backward
    /// ([`Accelerator::backward_overlapped`]). The default runs
    /// `loss_backward` and reports every gradient at its end.
    ///
    /// # Errors
    /// The engine's; the gate's.
    fn loss_backward_gated(
        &mut self,
        model: &mut M,
        scale: f32,
        images: Digits,
        gate: &mut dyn UnitGate,
    ) -> Result<f64>
    where
        M: Parameters,
    {
        let loss = self.loss_backward(model, scale, images)?;
        gate.reduce_grads(model, "")?;
        Ok(loss)
    }

    /// Classify the held-out `images` of `batch` and gather the outcomes
    /// with `gather_for_metrics` (or its tensor form).
    ///
    /// # Errors
    /// The engine's; the communicator's.
    fn gathered_hits(&mut self, images: Digits, batch: &Batch<usize>) -> Result<Hits>;
}

/// Train `model` with `optimizer` on the digits data set as `o` says,
/// through `engine`; `say` receives the main process's lines. Loss,
/// learning rate and accuracy also go to the accelerator's trackers, when
/// there are some. Ends training; the report, and the model.
///
/// # Errors
/// Anything accel reports: the data file, communication, checkpoint I/O;
/// the engine's.
pub fn train_digits<M: Parameters, O: Optimizer>(
    acc: &Accelerator,
    o: &RunOptions,
    model: M,
    optimizer: O,
    engine: &mut impl DigitsEngine<M>,
    say: &mut dyn FnMut(String),
) -> Result<(Report, PreparedModel<M>)> {
    let progress = Steps::register(acc);
    let data = std::sync::Arc::new(Digits::load(&o.data)?);
    let (train_split, eval_split) = data.split();
    let train_split = train_split.truncate_to(o.train_len);
    let mut model = acc.prepare_model(model)?;
    let mut opt: PreparedOptimizer<O> = acc.prepare_optimizer(optimizer)?;
    let train_data = train_split.clone();
    let mut base = DataLoader::new(train_split, o.batch_size);
    if o.shuffle {
        base = base.shuffle(o.seed);
    }
    let mut loader = acc.prepare_loader(base)?;
    let eval_data = eval_split.clone();
    let mut eval = acc.prepare_loader(DataLoader::new(eval_split, o.batch_size))?;
    let mut sched = acc.prepare_scheduler(o.schedule(loader.len(), acc.world_size()))?;
    // Start at the schedule's first rate, as a PyTorch scheduler does when
    // it is built. Otherwise the first optimizer step would use `o.lr`
    // without accumulation, but the schedule's rate with it: the prepared
    // scheduler also hands its rate to the optimizer on batches where it
    // does not step.
    opt.set_lr(sched.lr());

    let resumed = run::resume_or_start_fresh(
        acc,
        o.resume,
        &o.checkpoint_dir,
        &mut [&mut model, &mut opt, &mut sched, &mut loader, &mut eval],
        say,
    )?;
    if let Some(dir) = resumed {
        say(run::resumed_line(&dir, &progress, &loader));
    }

    let mut tally = Tally {
        accuracy: f64::NAN,
        last_loss: f64::NAN,
        ..Tally::default()
    };
    let (mut group_loss, mut group_batches) = (0.0f64, 0u32);
    let mut step_start = Instant::now();
    let mut sync_acc = 0.0f64;
    while loader.epoch() < o.epochs {
        let epoch = loader.epoch();
        while let Some(batch) = loader.next_batch() {
            let step = acc.accumulate(&batch);
            let mut sync_start = None;
            let loss = acc.backward_overlapped(&mut model, |m, scale, gate| {
                let images = train_data.batch(&batch.items);
                let loss = engine.loss_backward_gated(m, scale, images, gate);
                // What follows is the part of the gradient all-reduce the
                // backward did not hide.
                sync_start = Some(Instant::now());
                loss
            })??;
            if step.all_reduce {
                sync_acc += sync_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
                tally.early_syncs += u64::from(model.last_sync_started_early() > 0);
            }
            if let (Some(max), true) = (o.max_grad_norm, step.sync_gradients) {
                acc.clip_grad_norm(&mut model, max, 2.0)?;
            }
            opt.step(&mut model)?;
            sched.step(&mut opt);
            opt.zero_grad(&mut model);
            group_loss += loss;
            group_batches += 1;
            if !step.optimizer_step {
                continue;
            }
            tally.step_time += step_start.elapsed().as_secs_f64();
            tally.sync_time += sync_acc;
            tally.timed_steps += 1;
            sync_acc = 0.0;
            let mean = acc.reduce(&[group_loss / f64::from(group_batches)], "mean")?[0];
            tally.last_loss = mean;
            (group_loss, group_batches) = (0.0, 0);
            let steps = progress.advance();
            acc.log(&[("loss", mean), ("lr", opt.lr())], steps)?;
            if steps.is_multiple_of(10) || steps == 1 {
                say(run::step_line(steps, epoch, mean, opt.lr()));
            }
            if o.save_every > 0 && steps.is_multiple_of(o.save_every) {
                let dir =
                    acc.save_state(&o.checkpoint_dir, &[&model, &opt, &sched, &loader, &eval])?;
                say(format!("saved {}", dir.display()));
            }
            if o.stop_after == Some(steps) {
                say(run::stopping_line(steps));
                acc.end_training()?;
                return Ok((tally.report(&model, steps, true), model));
            }
            step_start = Instant::now();
        }
        if o.no_eval {
            continue;
        }
        // Every rank classifies its shard; gather_for_metrics returns each
        // held-out image exactly once (the loader's top-up duplicates are
        // dropped).
        let (mut correct, mut count) = (0u64, 0usize);
        eval.set_epoch(epoch);
        while let Some(b) = eval.next_batch() {
            let (c, n) = engine.gathered_hits(eval_data.batch(&b.items), &b)?;
            correct += c;
            count += n;
        }
        tally.accuracy = correct as f64 / count.max(1) as f64;
        tally.eval_samples = count;
        acc.log(&[("accuracy", tally.accuracy)], progress.get())?;
        say(run::accuracy_line(epoch, correct, count));
    }
    acc.end_training()?;
    Ok((tally.report(&model, progress.get(), false), model))
}

/// What the loop measures on the way, for its [`Report`].
#[derive(Debug, Default)]
struct Tally {
    accuracy: f64,
    eval_samples: usize,
    last_loss: f64,
    step_time: f64,
    sync_time: f64,
    timed_steps: u64,
    early_syncs: u64,
}

impl Tally {
    fn report<M: Parameters>(&self, model: &PreparedModel<M>, steps: u64, stopped: bool) -> Report {
        let per_step = |t: f64| t / self.timed_steps.max(1) as f64;
        let params = flat_params(&**model);
        Report {
            steps,
            checksum: run::checksum(&params),
            params,
            accuracy: self.accuracy,
            eval_samples: self.eval_samples,
            last_loss: self.last_loss,
            stopped,
            step_time: per_step(self.step_time),
            sync_time: per_step(self.sync_time),
            early_syncs: self.early_syncs,
        }
    }
}
