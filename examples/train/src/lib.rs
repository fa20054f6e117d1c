//! accel's training demo as a library: a small MLP with hand-derived
//! gradients, a deterministic synthetic regression dataset, and the
//! training loop the `train` binary runs. The model and dataset live in
//! `accel_conformance::fixtures`, which the suite's training scenarios use.
//!
//! Everything is pure Rust on the host: the point is the distributed
//! machinery (sharded data, gradient accumulation and averaging, metrics
//! with `gather_for_metrics`, exact-resume checkpoints), not the model.

use accel::train::{DataLoader, LinearSchedule, Phase, Sgd, TrainConfig};
use accel::{Accelerator, Result};
use accel_example_kit::run::{self, Steps};
use std::path::PathBuf;

use accel_conformance::fixtures::add_noise;
pub use accel_conformance::fixtures::{Mlp, Sample, Synthetic, FEATURES};

pub use accel_example_kit::run::checksum;

/// The demo's settings (the `train` binary's flags).
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// Epochs over the training set.
    pub epochs: u64,
    /// Training samples.
    pub train_len: usize,
    /// Evaluation samples (not a multiple of the global batch on purpose:
    /// `gather_for_metrics` must drop the top-up duplicates).
    pub eval_len: usize,
    /// Samples per batch per rank.
    pub batch_size: usize,
    /// Gradient accumulation steps.
    pub accumulation: usize,
    /// Peak learning rate.
    pub lr: f64,
    /// Hidden width.
    pub hidden: usize,
    /// Seed of the data order, the initial weights and the input noise.
    pub seed: u64,
    /// Standard deviation of the Gaussian input noise (augmentation drawn
    /// from each rank's RNG; 0 turns it off).
    pub noise: f32,
    /// Save a checkpoint every this many optimizer steps (0: never).
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Folder of `checkpoint_N` directories.
    pub checkpoint_dir: PathBuf,
    /// Continue from the newest checkpoint in `checkpoint_dir`.
    pub resume: bool,
    /// Exit, without saving, right after this optimizer step (simulates a
    /// crash).
    pub stop_after: Option<u64>,
    /// Sleep this long after each optimizer step (to leave time for a kill).
    pub step_delay_ms: u64,
    /// Log loss, per-phase times and straggler scores to JSON Lines and
    /// TensorBoard under `<log_dir>/train` (main process).
    pub log_dir: Option<PathBuf>,
    /// Simulate a slow rank: this rank's forward phase takes `slow_ms`
    /// longer ([`Options::slow_at`]: only at that batch).
    pub slow_rank: Option<usize>,
    /// How much longer, in milliseconds.
    pub slow_ms: u64,
    /// Only at this batch of the run (1-based; `None`: every batch).
    pub slow_at: Option<u64>,
    /// Save with `save_state_async` (written in the background).
    pub async_save: bool,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            epochs: 3,
            train_len: 1000,
            eval_len: 203,
            batch_size: 16,
            accumulation: 2,
            lr: 0.05,
            hidden: 16,
            seed: 42,
            noise: 0.01,
            save_every: 5,
            keep: 3,
            checkpoint_dir: PathBuf::from("target/train-demo/checkpoints"),
            resume: false,
            stop_after: None,
            step_delay_ms: 0,
            log_dir: None,
            slow_rank: None,
            slow_ms: 0,
            slow_at: None,
            async_save: false,
        }
    }
}

/// What a run ends with.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Optimizer steps in total (including those before a resume).
    pub steps: u64,
    /// Final parameter values.
    pub params: Vec<f32>,
    /// [`checksum`] of `params`.
    pub checksum: String,
    /// Mean squared error on the evaluation set after the last epoch.
    pub eval_mse: f32,
    /// Samples the last evaluation gathered (exactly `eval_len`).
    pub eval_samples: usize,
    /// The run stopped at `stop_after`.
    pub stopped: bool,
    /// The checkpoint it resumed from.
    pub resumed_from: Option<PathBuf>,
}

/// Run the demo on `acc`; `log` receives the main process's lines.
///
/// # Errors
/// Anything accel reports: communication, checkpoint I/O, corruption.
pub fn train(acc: &Accelerator, opts: &Options, mut log: impl FnMut(&str)) -> Result<Report> {
    acc.set_training_config(TrainConfig {
        gradient_accumulation_steps: opts.accumulation,
        total_limit: Some(opts.keep),
        ..TrainConfig::default()
    })?;
    acc.set_seed(opts.seed, true);
    let mut say = |m: String| {
        if acc.is_main_process() {
            log(&m)
        }
    };
    let mut model = acc.prepare_model(Mlp::new(opts.hidden, opts.seed))?;
    let mut opt = acc.prepare_optimizer(Sgd::new(opts.lr).with_momentum(0.9))?;
    let mut loader = acc.prepare_loader(
        DataLoader::new(
            Synthetic {
                len: opts.train_len,
                seed: opts.seed,
            },
            opts.batch_size,
        )
        .shuffle(opts.seed),
    )?;
    let mut eval = acc.prepare_loader(DataLoader::new(
        Synthetic {
            len: opts.eval_len,
            seed: opts.seed + 1,
        },
        opts.batch_size,
    ))?;
    let steps_per_epoch = loader.len().div_ceil(opts.accumulation) as u64;
    let total = steps_per_epoch * opts.epochs * acc.world_size() as u64;
    let mut sched = acc.prepare_scheduler(LinearSchedule::new(opts.lr, total / 10, total))?;
    let progress = Steps::register(acc);
    acc.set_total_steps(steps_per_epoch * opts.epochs);
    if let Some(dir) = &opts.log_dir {
        let config = serde_json::json!({"lr": opts.lr, "batch_size": opts.batch_size});
        acc.init_trackers("train", dir, &["jsonl", "tensorboard"], &config)?;
    }
    let mut batches = 0u64;

    // A fresh run owns its checkpoint folder.
    let resumed_from = run::resume_or_start_fresh(
        acc,
        opts.resume,
        &opts.checkpoint_dir,
        &mut [&mut model, &mut opt, &mut sched, &mut loader, &mut eval],
        &mut say,
    )?;
    if let Some(dir) = &resumed_from {
        say(run::resumed_line(dir, &progress, &loader));
    }

    let mut eval_mse = f32::NAN;
    let mut eval_samples = 0;
    let (mut group_loss, mut group_batches) = (0.0f32, 0u32);
    while loader.epoch() < opts.epochs {
        let epoch = loader.epoch();
        while let Some(batch) = loader.next_batch() {
            let step = acc.accumulate(&batch);
            batches += 1;
            let items = acc.phase(Phase::Data, || -> Result<_> {
                let mut items = batch.items.clone();
                if opts.noise > 0.0 {
                    let mut rng = acc.rng()?;
                    add_noise(&mut items, opts.noise, &mut rng);
                }
                Ok(items)
            })?;
            // The model's forward and backward are one pass (backward's
            // closure); a slow rank is simulated in a forward phase.
            if opts.slow_rank == Some(acc.rank()) && opts.slow_at.is_none_or(|b| b == batches) {
                acc.phase(Phase::Forward, || {
                    std::thread::sleep(std::time::Duration::from_millis(opts.slow_ms))
                });
            }
            let loss = acc.backward(&mut model, |m, scale| m.loss_and_grad(&items, scale))?;
            opt.step(&mut model)?;
            sched.step(&mut opt);
            opt.zero_grad(&mut model);
            group_loss += loss;
            group_batches += 1;
            if !step.optimizer_step {
                continue;
            }
            let mean = acc.reduce(&[group_loss / group_batches as f32], "mean")?[0];
            (group_loss, group_batches) = (0.0, 0);
            let steps = progress.advance();
            acc.log(&[("loss", f64::from(mean)), ("lr", opt.lr)], steps)?;
            say(format!(
                "step {steps:>3}  epoch {epoch}  loss {mean:.6}  lr {:.5}",
                opt.lr
            ));
            if opts.save_every > 0 && steps.is_multiple_of(opts.save_every) {
                let objects: [&dyn accel::train::Checkpointed; 5] =
                    [&model, &opt, &sched, &loader, &eval];
                if opts.async_save {
                    let dir = acc.save_state_async(&opts.checkpoint_dir, &objects)?;
                    say(format!("saving {} in the background", dir.display()));
                } else {
                    let dir = acc.save_state(&opts.checkpoint_dir, &objects)?;
                    say(format!("saved {}", dir.display()));
                }
            }
            if opts.stop_after == Some(steps) {
                acc.wait_for_save()?;
                say(run::stopping_line(steps));
                return Ok(Report {
                    steps,
                    params: model.flat_values(),
                    checksum: checksum(&model.flat_values()),
                    eval_mse,
                    eval_samples,
                    stopped: true,
                    resumed_from,
                });
            }
            if opts.step_delay_ms > 0 {
                std::thread::sleep(std::time::Duration::from_millis(opts.step_delay_ms));
            }
        }
        // Evaluation: every rank predicts its shard, gather_for_metrics
        // returns each sample exactly once.
        let (mut sum, mut count) = (0.0f64, 0usize);
        eval.set_epoch(epoch);
        while let Some(b) = eval.next_batch() {
            let all = acc.gather_for_metrics(&model.squared_errors(&b.items), &b)?;
            count += all.len();
            sum += all.iter().map(|&e| f64::from(e)).sum::<f64>();
        }
        eval_mse = (sum / count.max(1) as f64) as f32;
        eval_samples = count;
        say(format!(
            "epoch {epoch} done: eval mse {eval_mse:.6} over {count} samples (gather_for_metrics)"
        ));
    }
    let steps = progress.get();
    let params = model.flat_values();
    acc.end_training()?;
    Ok(Report {
        steps,
        checksum: checksum(&params),
        params,
        eval_mse,
        eval_samples,
        stopped: false,
        resumed_from,
    })
}
