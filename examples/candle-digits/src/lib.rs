//! accel + candle on real data: an MLP classifies the 8x8 handwritten
//! digits of the UCI/scikit-learn data set (1,797 images, 10 classes),
//! trained data-parallel on N ranks with gradient accumulation, evaluated
//! with `gather_for_metrics`, checkpointed and resumed exactly. The same
//! data, split and schedule as `examples/tch-digits`, in candle.
//!
//! The data file is `sklearn/datasets/data/digits.csv.gz` from the
//! scikit-learn wheel (`ACCEL_DIGITS_CSV`, default
//! `.accel-cache/tch/data/digits.csv.gz`; `scripts/digits_data.sh` fetches
//! it alone, `make tch-setup` does too).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use accel::train::{
    DataLoader, Dataset, LinearSchedule, MixedPrecision, Optimizer, Parameters, Scheduler,
    StateDict, Stateful, TrainConfig,
};
use accel::{Accelerator, Error, ErrorKind, Result};
use accel_candle::{
    compute_dtype, compute_var_builder, init_uniform, AdamW, CandleModel, CandleOptimizer,
};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::optim::ParamsAdamW;
use candle_nn::{Linear, Module, VarBuilder, VarMap};

/// Pixels per image.
pub const FEATURES: usize = 64;
/// Classes.
pub const CLASSES: usize = 10;

/// The digits data set: pixel values 0..=16 scaled to [0, 1], and labels.
#[derive(Debug)]
pub struct Digits {
    /// `len * FEATURES` pixels, row-major.
    pub pixels: Vec<f32>,
    /// One label per image.
    pub labels: Vec<u32>,
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
                .with_fix("run scripts/digits_data.sh (or make tch-setup), or pass --data")
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
            let values = line
                .split(',')
                .map(|v| v.trim().parse::<f32>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|e| bad(format!("not a number ({e})")))?;
            let [px @ .., label] = values.as_slice() else {
                return Err(bad("empty line".into()));
            };
            if px.len() != FEATURES {
                return Err(bad(format!(
                    "{} values, expected {}",
                    values.len(),
                    FEATURES + 1
                )));
            }
            if !(0.0..CLASSES as f32).contains(label) || label.fract() != 0.0 {
                return Err(bad(format!("label {label} is not a digit")));
            }
            pixels.extend(px.iter().map(|v| v / 16.0));
            labels.push(*label as u32);
        }
        Ok(Digits { pixels, labels })
    }

    /// `$ACCEL_DIGITS_CSV`, else the cache folder under the repository.
    pub fn default_path() -> PathBuf {
        std::env::var_os("ACCEL_DIGITS_CSV")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../../.accel-cache/tch/data/digits.csv.gz")
            })
    }

    /// tch-digits' split: every fifth image held out (360), the rest train
    /// (1,437).
    pub fn split(self: &Arc<Self>) -> (Split, Split) {
        let (test, train): (Vec<usize>, Vec<usize>) = (0..self.len()).partition(|i| i % 5 == 0);
        let split = |indices| Split {
            data: self.clone(),
            indices,
        };
        (split(train), split(test))
    }
}

/// A subset of the images, as a map-style [`Dataset`] of positions in it.
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

    /// The batch of `items` as an `[n, 64]` f32 tensor and `[n]` u32 labels.
    ///
    /// # Errors
    /// candle's, as [`ErrorKind::Backend`].
    pub fn collate(&self, items: &[usize]) -> Result<(Tensor, Tensor)> {
        let mut x = Vec::with_capacity(items.len() * FEATURES);
        let mut y = Vec::with_capacity(items.len());
        for &i in items {
            let j = self.indices[i];
            x.extend_from_slice(&self.data.pixels[j * FEATURES..(j + 1) * FEATURES]);
            y.push(self.data.labels[j]);
        }
        let x = Tensor::from_vec(x, (items.len(), FEATURES), &Device::Cpu).map_err(candle)?;
        let y = Tensor::from_vec(y, items.len(), &Device::Cpu).map_err(candle)?;
        Ok((x, y))
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

fn candle(e: candle_core::Error) -> Error {
    Error::new(ErrorKind::Backend, format!("candle: {e}"))
}

/// The classifier: 64 → hidden → hidden → 10 with ReLU.
#[derive(Debug)]
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    /// Build the layers in `varmap` (names `fc1.weight`, ... as tch-digits').
    ///
    /// # Errors
    /// candle's.
    pub fn new(varmap: &VarMap, hidden: usize) -> Result<Mlp> {
        Mlp::from_vb(
            &VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu),
            hidden,
        )
    }

    /// The layers on the tensors of `vb` (compute copies under mixed
    /// precision: [`accel_candle::compute_var_builder`]).
    ///
    /// # Errors
    /// candle's.
    pub fn from_vb(vb: &VarBuilder<'_>, hidden: usize) -> Result<Mlp> {
        Ok(Mlp {
            fc1: candle_nn::linear(FEATURES, hidden, vb.pp("fc1")).map_err(candle)?,
            fc2: candle_nn::linear(hidden, hidden, vb.pp("fc2")).map_err(candle)?,
            fc3: candle_nn::linear(hidden, CLASSES, vb.pp("fc3")).map_err(candle)?,
        })
    }

    /// The logits of `x`.
    ///
    /// # Errors
    /// candle's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(x).and_then(|h| h.relu()).map_err(candle)?;
        let h = self
            .fc2
            .forward(&h)
            .and_then(|h| h.relu())
            .map_err(candle)?;
        self.fc3.forward(&h).map_err(candle)
    }
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
    model.visit_params(&mut |p| out.extend_from_slice(p.value_f32().expect("f32 CPU variables")));
    out
}

/// Which optimizer trains the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// [`accel_candle::AdamW`] (candle-nn's AdamW, moments in checkpoints:
    /// exact resume).
    AdamW,
    /// [`candle_nn::AdamW`] itself (its moments restart from zero on a
    /// resume).
    CandleAdamW,
    /// [`candle_nn::SGD`] (stateless: exact resume).
    Sgd,
}

/// The demo's settings (the `candle-digits` binary's flags).
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
    pub hidden: usize,
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
    /// Skip the evaluation passes.
    pub no_eval: bool,
    /// Clip the gradients' total 2-norm to this on every optimizer step.
    pub max_grad_norm: Option<f64>,
    /// Write the final weights here with `save_model` (Hugging Face layout).
    pub save_model: Option<PathBuf>,
    /// Mixed precision (`--mixed-precision no|bf16|fp16`): the forward pass
    /// on bf16/f16 copies of the f32 weights; `None` takes what `accel
    /// launch --mixed-precision` set.
    pub mixed_precision: Option<MixedPrecision>,
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
            checkpoint_dir: PathBuf::from("target/candle-digits/checkpoints"),
            resume: false,
            stop_after: None,
            no_eval: false,
            max_grad_norm: None,
            save_model: None,
            mixed_precision: None,
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
    /// Held-out accuracy after the last epoch (NaN when no evaluation ran).
    pub accuracy: f64,
    /// Held-out images the last evaluation gathered (360; 0 with `no_eval`).
    pub eval_samples: usize,
    /// Mean training loss of the last optimizer step, across ranks.
    pub last_loss: f64,
    /// The run stopped at `stop_after`.
    pub stopped: bool,
    /// Mean wall time of an optimizer step, in seconds.
    pub step_time: f64,
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

/// An optimizer the loop can hold any way.
#[derive(Debug)]
enum AnyOptimizer {
    AdamW(CandleOptimizer<AdamW>),
    CandleAdamW(CandleOptimizer<candle_nn::AdamW>),
    Sgd(CandleOptimizer<candle_nn::SGD>),
}

macro_rules! each {
    ($self:expr, $o:ident => $e:expr) => {
        match $self {
            AnyOptimizer::AdamW($o) => $e,
            AnyOptimizer::CandleAdamW($o) => $e,
            AnyOptimizer::Sgd($o) => $e,
        }
    };
}

impl Optimizer for AnyOptimizer {
    fn step(&mut self, params: &mut dyn Parameters) -> Result<()> {
        each!(self, o => o.step(params))
    }
    fn lr(&self) -> f64 {
        each!(self, o => o.lr())
    }
    fn set_lr(&mut self, lr: f64) {
        each!(self, o => o.set_lr(lr))
    }
    fn state_dict(&self) -> StateDict {
        each!(self, o => o.state_dict())
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        each!(self, o => o.load_state_dict(state))
    }
}

/// Train on `acc`; `log` receives the main process's lines.
///
/// # Errors
/// Anything accel reports: the data file, communication, checkpoint I/O;
/// candle's errors as [`ErrorKind::Backend`].
pub fn train(acc: &Accelerator, opts: &Options, mut log: impl FnMut(&str)) -> Result<Report> {
    acc.set_training_config(TrainConfig {
        gradient_accumulation_steps: opts.accumulation,
        total_limit: Some(opts.keep),
        mixed_precision: opts.mixed_precision,
        ..TrainConfig::default()
    })?;
    acc.set_seed(opts.seed, false);
    let dtype = compute_dtype(acc);
    let mut say = |m: String| {
        if acc.is_main_process() {
            log(&m)
        }
    };
    say(format!(
        "mixed precision {} (forward in {dtype:?})",
        acc.mixed_precision()
    ));
    let data = Arc::new(Digits::load(&opts.data)?);
    let (train_split, eval_split) = data.split();
    let train_split = match opts.train_len {
        Some(n) => train_split.truncate(n),
        None => train_split,
    };

    let varmap = VarMap::new();
    let net = Mlp::new(&varmap, opts.hidden)?;
    // candle cannot seed its CPU generator: seeded weights, the same on
    // every rank and in every run with this seed.
    init_uniform(&varmap, opts.seed)?;
    let model = CandleModel::new(&varmap)?;
    let optimizer = match opts.optimizer {
        OptimizerChoice::AdamW => {
            AnyOptimizer::AdamW(CandleOptimizer::new(&model, adamw(opts.lr))?)
        }
        OptimizerChoice::CandleAdamW => {
            AnyOptimizer::CandleAdamW(CandleOptimizer::new(&model, adamw(opts.lr))?)
        }
        OptimizerChoice::Sgd => AnyOptimizer::Sgd(CandleOptimizer::new(&model, opts.lr)?),
    };
    let mut model = acc.prepare_model(model)?;
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
    let (mut step_time, mut timed_steps) = (0.0f64, 0u64);
    let mut step_start = std::time::Instant::now();
    let report = |steps, params: Vec<f32>, accuracy, eval_samples, last_loss, stopped, t| Report {
        steps,
        checksum: checksum(&params),
        params,
        accuracy,
        eval_samples,
        last_loss,
        stopped,
        step_time: t,
    };
    while loader.epoch() < opts.epochs {
        let epoch = loader.epoch();
        while let Some(batch) = loader.next_batch() {
            let step = acc.accumulate(&batch);
            let (x, y) = train_data.collate(&batch.items)?;
            let loss = acc.backward(&mut model, |m, scale| -> Result<f64> {
                let logits = if dtype == DType::F32 {
                    net.forward(&x)?
                } else {
                    // Layers on this step's compute copies of the f32 weights.
                    let copies = Mlp::from_vb(&compute_var_builder(&varmap, dtype), opts.hidden)?;
                    let x = x.to_dtype(dtype).map_err(candle)?;
                    copies.forward(&x)?.to_dtype(DType::F32).map_err(candle)?
                };
                let loss = candle_nn::loss::cross_entropy(&logits, &y).map_err(candle)?;
                m.backward(&(&loss * f64::from(scale)).map_err(candle)?)?;
                loss.to_scalar::<f32>().map(f64::from).map_err(candle)
            })??;
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
            timed_steps += 1;
            let mean = acc.reduce(&[group_loss / f64::from(group_batches)], "mean")?[0];
            last_loss = mean;
            (group_loss, group_batches) = (0.0, 0);
            let steps = {
                let mut p = progress.lock().expect("progress");
                p.steps += 1;
                p.steps
            };
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
                let t = step_time / timed_steps.max(1) as f64;
                return Ok(report(
                    steps,
                    flat_params(&*model),
                    accuracy,
                    eval_samples,
                    last_loss,
                    true,
                    t,
                ));
            }
            step_start = std::time::Instant::now();
        }
        if opts.no_eval {
            continue;
        }
        // Each held-out image counted once: gather_for_metrics drops the
        // loader's top-up duplicates.
        let (mut correct, mut count) = (0u64, 0usize);
        eval.set_epoch(epoch);
        while let Some(b) = eval.next_batch() {
            let (x, y) = eval_data.collate(&b.items)?;
            let pred = net.forward(&x)?.argmax(D::Minus1).map_err(candle)?;
            let hits: Vec<u8> = pred.eq(&y).and_then(|h| h.to_vec1()).map_err(candle)?;
            let all = acc.gather_for_metrics(&hits, &b)?;
            count += all.len();
            correct += all.iter().map(|&h| u64::from(h)).sum::<u64>();
        }
        accuracy = correct as f64 / count.max(1) as f64;
        eval_samples = count;
        say(format!(
            "epoch {epoch} done: accuracy {:.2}% ({correct}/{count} held-out images, gather_for_metrics)",
            100.0 * accuracy
        ));
    }
    acc.end_training()?;
    if let Some(dir) = &opts.save_model {
        acc.save_model(&*model, dir, accel::train::DEFAULT_MAX_SHARD_SIZE)?;
        say(format!(
            "saved the weights to {} (Hugging Face layout)",
            dir.display()
        ));
    }
    let steps = progress.lock().expect("progress").steps;
    let t = step_time / timed_steps.max(1) as f64;
    Ok(report(
        steps,
        flat_params(&*model),
        accuracy,
        eval_samples,
        last_loss,
        false,
        t,
    ))
}

fn adamw(lr: f64) -> ParamsAdamW {
    ParamsAdamW {
        lr,
        ..ParamsAdamW::default()
    }
}
