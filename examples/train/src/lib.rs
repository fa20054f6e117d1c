//! accel's training demo as a library: a small MLP with hand-derived
//! gradients, a deterministic synthetic regression dataset, and the
//! training loop the `train` binary runs. The conformance suite reuses the
//! model and dataset for its equivalence scenario.
//!
//! Everything is pure Rust on the host: the point is the distributed
//! machinery (sharded data, gradient accumulation and averaging, metrics
//! with `gather_for_metrics`, exact-resume checkpoints), not the model.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use accel::train::{
    DataLoader, Dataset, LinearSchedule, ParamMut, ParamRef, Parameters, Sgd, StateDict, Stateful,
    TrainConfig,
};
use accel::{Accelerator, Result};

/// Input features per sample.
pub const FEATURES: usize = 8;

/// One sample: features and target.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// Inputs in `[-1, 1)`.
    pub x: [f32; FEATURES],
    /// Target.
    pub y: f32,
}

/// SplitMix64 finaliser: a fixed hash, so the dataset is the same on every
/// rank, platform and run.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn unit(seed: u64, a: u64, b: u64) -> f32 {
    let h = mix(seed ^ mix(a.wrapping_mul(0x1000_0000_01b3) ^ mix(b)));
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A deterministic regression dataset: sample `i` is a pure function of
/// `(seed, i)`. The target is a smooth non-linear function of the inputs
/// plus a little noise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Synthetic {
    /// Number of samples.
    pub len: usize,
    /// Which draw of the data (training and evaluation sets use different
    /// seeds).
    pub seed: u64,
}

impl Dataset for Synthetic {
    type Item = Sample;
    fn len(&self) -> usize {
        self.len
    }
    fn get(&self, i: usize) -> Sample {
        let mut x = [0.0f32; FEATURES];
        for (j, v) in x.iter_mut().enumerate() {
            *v = unit(self.seed, i as u64, j as u64);
        }
        let lin: f32 = x
            .iter()
            .enumerate()
            .map(|(j, v)| v * (j as f32 - 3.5) / 4.0)
            .sum();
        let y = lin.sin() + 0.5 * x[0] * x[1] + 0.05 * unit(self.seed, i as u64, 99);
        Sample { x, y }
    }
}

/// `FEATURES → hidden (tanh) → 1` with gradient buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    /// Hidden width.
    pub hidden: usize,
    /// Values: `fc1.weight` (hidden × FEATURES), `fc1.bias`, `fc2.weight`,
    /// `fc2.bias`.
    pub values: [Vec<f32>; 4],
    /// Gradients, same shapes.
    pub grads: [Vec<f32>; 4],
}

const NAMES: [&str; 4] = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"];

impl Mlp {
    /// A model with deterministic small initial weights from `seed`.
    pub fn new(hidden: usize, seed: u64) -> Mlp {
        let scale1 = 1.0 / (FEATURES as f32).sqrt();
        let scale2 = 1.0 / (hidden as f32).sqrt();
        let w1 = (0..hidden * FEATURES)
            .map(|i| unit(seed, 1, i as u64) * scale1)
            .collect();
        let w2 = (0..hidden)
            .map(|i| unit(seed, 2, i as u64) * scale2)
            .collect();
        let values = [w1, vec![0.0; hidden], w2, vec![0.0; 1]];
        let grads = values.clone().map(|v| vec![0.0; v.len()]);
        Mlp {
            hidden,
            values,
            grads,
        }
    }

    fn hidden_act(&self, x: &[f32; FEATURES]) -> Vec<f32> {
        let [w1, b1, _, _] = &self.values;
        (0..self.hidden)
            .map(|k| {
                let z: f32 = b1[k]
                    + w1[k * FEATURES..(k + 1) * FEATURES]
                        .iter()
                        .zip(x)
                        .map(|(w, v)| w * v)
                        .sum::<f32>();
                z.tanh()
            })
            .collect()
    }

    /// The prediction for one input.
    pub fn forward(&self, x: &[f32; FEATURES]) -> f32 {
        let h = self.hidden_act(x);
        self.values[3][0]
            + h.iter()
                .zip(&self.values[2])
                .map(|(a, w)| a * w)
                .sum::<f32>()
    }

    /// Mean squared error over `batch`; adds `scale ×` its gradient to the
    /// gradient buffers (hand-derived backpropagation). Returns the
    /// unscaled mean loss.
    pub fn loss_and_grad(&mut self, batch: &[Sample], scale: f32) -> f32 {
        if batch.is_empty() {
            return 0.0;
        }
        let n = batch.len() as f32;
        let mut loss = 0.0;
        for s in batch {
            let h = self.hidden_act(&s.x);
            let pred = self.values[3][0]
                + h.iter()
                    .zip(&self.values[2])
                    .map(|(a, w)| a * w)
                    .sum::<f32>();
            let e = pred - s.y;
            loss += e * e / n;
            let dy = scale * 2.0 * e / n;
            let [g1, gb1, g2, gb2] = &mut self.grads;
            gb2[0] += dy;
            for k in 0..self.hidden {
                g2[k] += dy * h[k];
                let dz = dy * self.values[2][k] * (1.0 - h[k] * h[k]);
                gb1[k] += dz;
                for (g, v) in g1[k * FEATURES..(k + 1) * FEATURES].iter_mut().zip(&s.x) {
                    *g += dz * v;
                }
            }
        }
        loss
    }

    /// All parameter values, flattened in visiting order.
    pub fn flat_values(&self) -> Vec<f32> {
        self.values.concat()
    }
}

impl Parameters for Mlp {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for (i, name) in NAMES.iter().enumerate() {
            f(ParamRef {
                name,
                value: &self.values[i],
                grad: &self.grads[i],
            });
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        let (values, grads) = (&mut self.values, &mut self.grads);
        for ((name, value), grad) in NAMES.iter().zip(values.iter_mut()).zip(grads.iter_mut()) {
            f(ParamMut { name, value, grad });
        }
    }
}

/// FNV-1a 64 over the little-endian bytes of `values`: the checksum the
/// demo prints so two runs can be compared bit for bit.
pub fn checksum(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in values.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

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

/// Progress the loop keeps across a resume, registered for checkpointing.
#[derive(Debug, Default)]
struct Progress {
    steps: u64,
}

impl Stateful for Progress {
    fn state_dict(&self) -> Result<StateDict> {
        let mut s = StateDict::default();
        s.put("steps", &self.steps);
        Ok(s)
    }
    fn load_state_dict(&mut self, state: StateDict) -> Result<()> {
        self.steps = state.get("steps")?;
        Ok(())
    }
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
    let progress = Arc::new(Mutex::new(Progress::default()));
    acc.register_for_checkpointing(progress.clone());

    let mut resumed_from = None;
    if opts.resume {
        match acc.latest_checkpoint(&opts.checkpoint_dir)? {
            Some(_) => {
                let dir = acc.load_state(
                    &opts.checkpoint_dir,
                    &mut [&mut model, &mut opt, &mut sched, &mut loader, &mut eval],
                )?;
                say(format!(
                    "resumed from {} at step {} (epoch {}, batch {})",
                    dir.display(),
                    progress.lock().expect("progress").steps,
                    loader.epoch(),
                    loader.sampler_state().batches_consumed
                ));
                resumed_from = Some(dir);
            }
            None => say(format!(
                "no checkpoint in {}: starting fresh",
                opts.checkpoint_dir.display()
            )),
        }
    } else if acc.is_main_process() && opts.checkpoint_dir.exists() {
        // A fresh run owns its checkpoint folder.
        std::fs::remove_dir_all(&opts.checkpoint_dir).map_err(|e| {
            accel::Error::io(format!("removing {}", opts.checkpoint_dir.display()), e)
        })?;
    }
    acc.wait_for_everyone()?;

    let mut eval_mse = f32::NAN;
    let mut eval_samples = 0;
    let (mut group_loss, mut group_batches) = (0.0f32, 0u32);
    while loader.epoch() < opts.epochs {
        let epoch = loader.epoch();
        while let Some(batch) = loader.next_batch() {
            let step = acc.accumulate(&batch);
            let mut items = batch.items.clone();
            if opts.noise > 0.0 {
                let mut rng = acc.rng()?;
                for s in &mut items {
                    for v in &mut s.x {
                        *v += opts.noise * rng.normal();
                    }
                }
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
            let steps = {
                let mut p = progress.lock().expect("progress");
                p.steps += 1;
                p.steps
            };
            say(format!(
                "step {steps:>3}  epoch {epoch}  loss {mean:.6}  lr {:.5}",
                opt.lr
            ));
            if opts.save_every > 0 && steps.is_multiple_of(opts.save_every) {
                let dir = acc.save_state(
                    &opts.checkpoint_dir,
                    &[&model, &opt, &sched, &loader, &eval],
                )?;
                say(format!("saved {}", dir.display()));
            }
            if opts.stop_after == Some(steps) {
                say(format!(
                    "stopping after step {steps} without saving (as if killed); rerun with --resume"
                ));
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
            let errs: Vec<f32> = b
                .items
                .iter()
                .map(|s| (model.forward(&s.x) - s.y).powi(2))
                .collect();
            let all = acc.gather_for_metrics(&errs, &b)?;
            count += all.len();
            sum += all.iter().map(|&e| f64::from(e)).sum::<f64>();
        }
        eval_mse = (sum / count.max(1) as f64) as f32;
        eval_samples = count;
        say(format!(
            "epoch {epoch} done: eval mse {eval_mse:.6} over {count} samples (gather_for_metrics)"
        ));
    }
    let steps = progress.lock().expect("progress").steps;
    let params = model.flat_values();
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
