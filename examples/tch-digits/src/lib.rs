//! accel + tch on real data: an MLP classifies the 8x8 handwritten digits
//! of the UCI/scikit-learn data set (1,797 images, 10 classes), trained
//! data-parallel on N ranks with gradient accumulation, evaluated with
//! `gather_for_metrics`, checkpointed and resumed exactly.
//!
//! The data file is `sklearn/datasets/data/digits.csv.gz` from the
//! scikit-learn wheel; `scripts/tch_setup.sh` extracts it and exports its
//! path as `ACCEL_DIGITS_CSV`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use accel::train::{
    DataLoader, Dataset, LinearSchedule, MixedPrecision, Optimizer, Parameters, Scheduler,
    StateDict, Stateful, TrainConfig,
};
use accel::{Accelerator, Error, ErrorKind, Result};
use accel_tch::{autocast_forward, set_seed, AdamW, TchModel, TchOptimizer, TensorCollectives};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Pixels per image.
pub const FEATURES: usize = 64;
/// Classes.
pub const CLASSES: i64 = 10;

/// The digits data set: pixel values 0..=16 scaled to [0, 1], and labels.
#[derive(Debug)]
pub struct Digits {
    /// `len * FEATURES` pixels, row-major.
    pub pixels: Vec<f32>,
    /// One label per image.
    pub labels: Vec<i64>,
}

impl Digits {
    /// Number of images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// `true` when there is no image.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Read scikit-learn's `digits.csv.gz` (65 integers a line: 64 pixels,
    /// then the label).
    ///
    /// # Errors
    /// [`ErrorKind::Io`] when the file cannot be read, [`ErrorKind::Corrupt`]
    /// naming the line when one does not parse.
    pub fn load(path: &Path) -> Result<Digits> {
        let file = std::fs::File::open(path).map_err(|e| {
            Error::io(format!("opening {}", path.display()), e)
                .with_fix("run `make tch-setup` (scripts/tch_setup.sh) and source .accel-cache/tch/env.sh, or pass --data")
        })?;
        let reader = BufReader::new(flate2::read::GzDecoder::new(file));
        let (mut pixels, mut labels) = (Vec::new(), Vec::new());
        for (n, line) in reader.lines().enumerate() {
            let line = line.map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |why: String| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!("{} line {}: {why}", path.display(), n + 1),
                )
            };
            let values: Vec<f32> = line
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| bad(format!("not a number ({e})")))?;
            if values.len() != FEATURES + 1 {
                return Err(bad(format!(
                    "{} values, expected {}",
                    values.len(),
                    FEATURES + 1
                )));
            }
            let label = values[FEATURES];
            if !(0.0..CLASSES as f32).contains(&label) || label.fract() != 0.0 {
                return Err(bad(format!("label {label} is not a digit")));
            }
            pixels.extend(values[..FEATURES].iter().map(|v| v / 16.0));
            labels.push(label as i64);
        }
        Ok(Digits { pixels, labels })
    }

    /// The default location: `$ACCEL_DIGITS_CSV`, else the set-up script's
    /// cache folder under the repository.
    pub fn default_path() -> PathBuf {
        std::env::var_os("ACCEL_DIGITS_CSV")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../.accel-cache/tch/data/digits.csv.gz")
            })
    }

    /// A deterministic split: every fifth image is held out for evaluation
    /// (360 images), the rest train (1,437).
    pub fn split(self: &Arc<Self>) -> (Split, Split) {
        let (test, train): (Vec<usize>, Vec<usize>) = (0..self.len()).partition(|i| i % 5 == 0);
        (
            Split {
                data: self.clone(),
                indices: train,
            },
            Split {
                data: self.clone(),
                indices: test,
            },
        )
    }
}

/// A subset of the images, as a map-style [`Dataset`] of indices into it.
#[derive(Clone, Debug)]
pub struct Split {
    data: Arc<Digits>,
    indices: Vec<usize>,
}

impl Split {
    /// The first `n` images of the split.
    pub fn truncate(mut self, n: usize) -> Split {
        self.indices.truncate(n);
        self
    }

    /// The batch of `items` (positions in this split) as an `[n, 64]` f32
    /// tensor and an `[n]` i64 label tensor.
    pub fn collate(&self, items: &[usize]) -> (Tensor, Tensor) {
        let mut x = Vec::with_capacity(items.len() * FEATURES);
        let mut y = Vec::with_capacity(items.len());
        for &i in items {
            let j = self.indices[i];
            x.extend_from_slice(&self.data.pixels[j * FEATURES..(j + 1) * FEATURES]);
            y.push(self.data.labels[j]);
        }
        (
            Tensor::from_slice(&x).view([items.len() as i64, FEATURES as i64]),
            Tensor::from_slice(&y),
        )
    }
}

impl Dataset for Split {
    type Item = usize;
    fn len(&self) -> usize {
        self.indices.len()
    }
    fn get(&self, index: usize) -> usize {
        index
    }
}

/// The classifier: 64 → hidden → hidden → 10 with ReLU, in `vs`.
pub fn mlp(vs: &nn::Path<'_>, hidden: i64) -> impl Module {
    nn::seq()
        .add(nn::linear(
            vs / "fc1",
            FEATURES as i64,
            hidden,
            Default::default(),
        ))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "fc2", hidden, hidden, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "fc3", hidden, CLASSES, Default::default()))
}

/// FNV-1a over the parameters' bytes: equal checksums mean bit-identical
/// parameters.
pub fn checksum(values: &[f32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in values.iter().flat_map(|v| v.to_le_bytes()) {
        h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Every parameter value in visiting order.
pub fn flat_params(model: &impl Parameters) -> Vec<f32> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| {
        out.extend_from_slice(
            p.value_f32()
                .expect("the demo's variables are f32 CPU tensors"),
        )
    });
    out
}

/// Which optimizer trains the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// [`accel_tch::AdamW`]: state in checkpoints, exact resume.
    AdamW,
    /// libtorch's SGD through [`accel_tch::TchOptimizer`] (stateless, so a
    /// resume is exact too).
    TorchSgd,
}

/// The demo's settings (the `tch-digits` binary's flags).
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    /// The digits.csv.gz file.
    pub data: PathBuf,
    /// Epochs over the training split.
    pub epochs: u64,
    /// Use only the first N training images (all when `None`).
    pub train_len: Option<usize>,
    /// Images per batch per rank.
    pub batch_size: usize,
    /// Gradient accumulation steps.
    pub accumulation: usize,
    /// Peak learning rate (linear decay to 0, 5% warm-up).
    pub lr: f64,
    /// Hidden width.
    pub hidden: i64,
    /// Seed of the initial weights and the data order.
    pub seed: u64,
    /// Optimizer.
    pub optimizer: OptimizerChoice,
    /// Shuffle the training data every epoch.
    pub shuffle: bool,
    /// Save a checkpoint every this many optimizer steps (0: never).
    pub save_every: u64,
    /// Checkpoints kept.
    pub keep: usize,
    /// Folder of `checkpoint_N` directories.
    pub checkpoint_dir: PathBuf,
    /// Continue from the newest checkpoint in `checkpoint_dir`.
    pub resume: bool,
    /// Exit, without saving, right after this optimizer step.
    pub stop_after: Option<u64>,
    /// Skip the evaluation passes (for benchmarks and tests).
    pub no_eval: bool,
    /// Where the trackers write (`<dir>/tch-digits/metrics.jsonl` and a
    /// TensorBoard event file); `None`: no trackers.
    pub log_dir: Option<PathBuf>,
    /// Mixed precision (`--mixed-precision no|bf16|fp16`); `None` takes
    /// what `accel launch --mixed-precision` set.
    pub mixed_precision: Option<MixedPrecision>,
    /// Clip the gradients' total 2-norm to this on every optimizer step.
    pub max_grad_norm: Option<f64>,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            data: Digits::default_path(),
            epochs: 10,
            train_len: None,
            batch_size: 16,
            accumulation: 2,
            lr: 0.01,
            hidden: 64,
            seed: 42,
            optimizer: OptimizerChoice::AdamW,
            shuffle: true,
            save_every: 20,
            keep: 2,
            checkpoint_dir: PathBuf::from("target/tch-digits/checkpoints"),
            resume: false,
            stop_after: None,
            no_eval: false,
            log_dir: Some(PathBuf::from("target/tch-digits/runs")),
            mixed_precision: None,
            max_grad_norm: None,
        }
    }
}

/// What a run ends with.
#[derive(Clone, Debug, PartialEq)]
pub struct Report {
    /// Optimizer steps in total (including those before a resume).
    pub steps: u64,
    /// Final parameter values, in visiting order.
    pub params: Vec<f32>,
    /// [`checksum`] of `params`.
    pub checksum: String,
    /// Accuracy on the held-out images after the last epoch (NaN when no
    /// evaluation ran: check `eval_samples`).
    pub accuracy: f64,
    /// Held-out images the last evaluation gathered (all 360; 0 with
    /// `no_eval`).
    pub eval_samples: usize,
    /// Mean training loss of the last optimizer step, across ranks.
    pub last_loss: f64,
    /// The run stopped at `stop_after`.
    pub stopped: bool,
    /// Mean wall time of an optimizer step, and the share of it spent in
    /// the gradient all-reduce, in seconds.
    pub step_time: f64,
    /// Seconds per optimizer step spent averaging gradients.
    pub sync_time: f64,
}

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

/// An optimizer the loop can hold either way.
enum AnyOptimizer {
    AdamW(AdamW),
    Torch(TchOptimizer),
}

impl Optimizer for AnyOptimizer {
    fn step(&mut self, params: &mut dyn Parameters) -> Result<()> {
        match self {
            AnyOptimizer::AdamW(o) => o.step(params),
            AnyOptimizer::Torch(o) => o.step(params),
        }
    }
    fn lr(&self) -> f64 {
        match self {
            AnyOptimizer::AdamW(o) => o.lr(),
            AnyOptimizer::Torch(o) => o.lr(),
        }
    }
    fn set_lr(&mut self, lr: f64) {
        match self {
            AnyOptimizer::AdamW(o) => o.set_lr(lr),
            AnyOptimizer::Torch(o) => o.set_lr(lr),
        }
    }
    fn state_dict(&self) -> StateDict {
        match self {
            AnyOptimizer::AdamW(o) => o.state_dict(),
            AnyOptimizer::Torch(o) => o.state_dict(),
        }
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        match self {
            AnyOptimizer::AdamW(o) => o.load_state_dict(state),
            AnyOptimizer::Torch(o) => o.load_state_dict(state),
        }
    }
}

/// Train on `acc`; `log` receives the main process's lines.
///
/// # Errors
/// Anything accel reports: the data file, communication, checkpoint I/O.
pub fn train(acc: &Accelerator, opts: &Options, mut log: impl FnMut(&str)) -> Result<Report> {
    acc.set_training_config(TrainConfig {
        gradient_accumulation_steps: opts.accumulation,
        total_limit: Some(opts.keep),
        mixed_precision: opts.mixed_precision,
        ..TrainConfig::default()
    })?;
    // The same seed on every rank: identical initial weights (prepare also
    // broadcasts rank 0's) and the same data order.
    set_seed(acc, opts.seed, false);
    let mut say = |m: String| {
        if acc.is_main_process() {
            log(&m)
        }
    };
    say(format!("mixed precision {}", acc.mixed_precision()));
    if let Some(dir) = &opts.log_dir {
        let config: std::collections::BTreeMap<&str, f64> = [
            ("world_size", acc.world_size() as f64),
            ("epochs", opts.epochs as f64),
            ("batch_size", opts.batch_size as f64),
            ("accumulation", opts.accumulation as f64),
            ("lr", opts.lr),
            ("hidden", opts.hidden as f64),
            ("seed", opts.seed as f64),
        ]
        .into();
        acc.init_trackers("tch-digits", dir, &["jsonl", "tensorboard"], &config)?;
        say(format!(
            "logging loss and accuracy to {} (tensorboard --logdir {})",
            dir.join("tch-digits").display(),
            dir.display()
        ));
    }
    let data = Arc::new(Digits::load(&opts.data)?);
    let (train_split, eval_split) = data.split();
    let train_split = match opts.train_len {
        Some(n) => train_split.truncate(n),
        None => train_split,
    };

    let vs = nn::VarStore::new(tch::Device::Cpu);
    let net = mlp(&vs.root(), opts.hidden);
    let optimizer = match opts.optimizer {
        OptimizerChoice::AdamW => AnyOptimizer::AdamW(AdamW::new(opts.lr)),
        OptimizerChoice::TorchSgd => {
            AnyOptimizer::Torch(TchOptimizer::new(&vs, nn::Sgd::default(), opts.lr)?)
        }
    };
    let mut model = acc.prepare_model(TchModel::new(vs)?)?;
    let mut opt = acc.prepare_optimizer(optimizer)?;
    let train_data = train_split.clone();
    let mut base = DataLoader::new(train_split, opts.batch_size);
    if opts.shuffle {
        base = base.shuffle(opts.seed);
    }
    let mut loader = acc.prepare_loader(base)?;
    let eval_data = eval_split.clone();
    let mut eval = acc.prepare_loader(DataLoader::new(eval_split, opts.batch_size))?;
    let steps_per_epoch = loader.len().div_ceil(opts.accumulation) as u64;
    let total = steps_per_epoch * opts.epochs * acc.world_size() as u64;
    let mut sched = acc.prepare_scheduler(LinearSchedule::new(opts.lr, total / 20, total))?;
    // Start at the schedule's first rate, as a PyTorch scheduler does when
    // it is built. Otherwise the first optimizer step would use `opts.lr`
    // without accumulation, but the schedule's rate with it: the prepared
    // scheduler also hands its rate to the optimizer on batches where it
    // does not step.
    opt.set_lr(sched.lr());
    let progress = Arc::new(Mutex::new(Progress::default()));
    acc.register_for_checkpointing(progress.clone());

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
            }
            None => say(format!(
                "no checkpoint in {}: starting fresh",
                opts.checkpoint_dir.display()
            )),
        }
    } else if acc.is_main_process() && opts.checkpoint_dir.exists() {
        std::fs::remove_dir_all(&opts.checkpoint_dir)
            .map_err(|e| Error::io(format!("removing {}", opts.checkpoint_dir.display()), e))?;
    }
    acc.wait_for_everyone()?;

    let (mut accuracy, mut eval_samples, mut last_loss) = (f64::NAN, 0, f64::NAN);
    let (mut group_loss, mut group_batches) = (0.0f64, 0u32);
    let (mut step_time, mut sync_time, mut timed_steps) = (0.0f64, 0.0f64, 0u64);
    let mut step_start = std::time::Instant::now();
    let mut sync_acc = 0.0f64;
    while loader.epoch() < opts.epochs {
        let epoch = loader.epoch();
        while let Some(batch) = loader.next_batch() {
            let step = acc.accumulate(&batch);
            let (x, y) = train_data.collate(&batch.items);
            let mut sync_start = None;
            let loss = acc.backward(&mut model, |_, scale| -> Result<f64> {
                // bf16/fp16 under autocast, logits back in f32 for the loss.
                let logits = autocast_forward(acc, tch::Device::Cpu, || net.forward(&x))?;
                let loss = logits.cross_entropy_for_logits(&y);
                (&loss * f64::from(scale)).backward();
                sync_start = Some(std::time::Instant::now());
                Ok(loss.double_value(&[]))
            })??;
            if step.all_reduce {
                sync_acc += sync_start.map_or(0.0, |t| t.elapsed().as_secs_f64());
            }
            if let (Some(max), true) = (opts.max_grad_norm, step.sync_gradients) {
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
            step_time += step_start.elapsed().as_secs_f64();
            sync_time += sync_acc;
            timed_steps += 1;
            sync_acc = 0.0;
            let mean = acc.reduce(&[group_loss / f64::from(group_batches)], "mean")?[0];
            last_loss = mean;
            (group_loss, group_batches) = (0.0, 0);
            let steps = {
                let mut p = progress.lock().expect("progress");
                p.steps += 1;
                p.steps
            };
            acc.log(&[("loss", mean), ("lr", opt.lr())], steps)?;
            if steps % 10 == 0 || steps == 1 {
                say(format!(
                    "step {steps:>4}  epoch {epoch}  loss {mean:.4}  lr {:.5}",
                    opt.lr()
                ));
            }
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
                acc.end_training()?;
                let params = flat_params(&*model);
                return Ok(Report {
                    steps,
                    checksum: checksum(&params),
                    params,
                    accuracy,
                    eval_samples,
                    last_loss,
                    stopped: true,
                    step_time: step_time / timed_steps.max(1) as f64,
                    sync_time: sync_time / timed_steps.max(1) as f64,
                });
            }
            step_start = std::time::Instant::now();
        }
        if opts.no_eval {
            continue;
        }
        // Every rank classifies its shard; gather_for_metrics returns each
        // held-out image exactly once (the loader's top-up duplicates are
        // dropped).
        let (mut correct, mut count) = (0i64, 0usize);
        eval.set_epoch(epoch);
        while let Some(b) = eval.next_batch() {
            let (x, y) = eval_data.collate(&b.items);
            let pred = tch::no_grad(|| net.forward(&x).argmax(-1, false));
            let hits = pred.eq_tensor(&y).to_kind(Kind::Int64);
            let all = acc.gather_tensor_for_metrics(&hits, &b)?;
            count += all.size()[0] as usize;
            correct += all.sum(Kind::Int64).int64_value(&[]);
        }
        accuracy = correct as f64 / count.max(1) as f64;
        eval_samples = count;
        let steps = progress.lock().expect("progress").steps;
        acc.log(&[("accuracy", accuracy)], steps)?;
        say(format!(
            "epoch {epoch} done: accuracy {:.2}% ({correct}/{count} held-out images, gather_for_metrics)",
            100.0 * accuracy
        ));
    }
    acc.end_training()?;
    let steps = progress.lock().expect("progress").steps;
    let params = flat_params(&*model);
    Ok(Report {
        steps,
        checksum: checksum(&params),
        params,
        accuracy,
        eval_samples,
        last_loss,
        stopped: false,
        step_time: step_time / timed_steps.max(1) as f64,
        sync_time: sync_time / timed_steps.max(1) as f64,
    })
}
