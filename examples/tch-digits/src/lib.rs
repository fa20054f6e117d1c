//! accel + tch on real data: an MLP classifies the 8x8 handwritten digits
//! of the UCI/scikit-learn data set (1,797 images, 10 classes), trained
//! data-parallel on N ranks with gradient accumulation, evaluated with
//! `gather_for_metrics`, checkpointed and resumed exactly.
//!
//! The data file is `sklearn/datasets/data/digits.csv.gz` from the
//! scikit-learn wheel; `scripts/tch_setup.sh` extracts it and exports its
//! path as `ACCEL_DIGITS_CSV`.

use std::path::PathBuf;

pub mod plain;

use accel::train::{Batch, Optimizer, Parameters, StateDict};
use accel::zero::UnitGate;
use accel::{Accelerator, Result};
pub use accel_example_kit::digits::{Digits, Split, FEATURES};
pub use accel_example_kit::run::{checksum, flat_params, Report};
use accel_example_kit::run::{Demo, DemoOptions};
use accel_example_kit::train::{train_digits, DigitsEngine, Hits};
use accel_tch::{autocast_forward, set_seed, AdamW, TchModel, TchOptimizer, TensorCollectives};
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Classes.
pub const CLASSES: i64 = accel_example_kit::digits::CLASSES as i64;

/// `images` as an `[n, 64]` f32 tensor and an `[n]` i64 label tensor.
pub fn collate(images: &Digits) -> (Tensor, Tensor) {
    let y: Vec<i64> = images.labels.iter().map(|&l| i64::from(l)).collect();
    (
        Tensor::from_slice(&images.pixels).view([images.len() as i64, FEATURES as i64]),
        Tensor::from_slice(&y),
    )
}

/// The classifier: 64 → hidden → hidden → 10 with ReLU, in `vs`.
pub fn mlp(vs: &nn::Path<'_>, hidden: i64) -> nn::Sequential {
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

/// Which optimizer trains the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// [`accel_tch::AdamW`]: state in checkpoints, exact resume.
    #[default]
    AdamW,
    /// libtorch's SGD through [`accel_tch::TchOptimizer`] (stateless, so a
    /// resume is exact too).
    TorchSgd,
}

/// tch-digits' own settings.
#[derive(Clone, Debug, PartialEq)]
pub struct Own {
    /// Where the trackers write (`<dir>/tch-digits/metrics.jsonl` and a
    /// TensorBoard event file); `None`: no trackers.
    pub log_dir: Option<PathBuf>,
}

impl Default for Own {
    fn default() -> Own {
        let log_dir = Some(PathBuf::from("target/tch-digits/runs"));
        Own { log_dir }
    }
}

impl Demo for Own {
    const NAME: &'static str = "tch-digits";
}

/// The demo's settings (the `tch-digits` binary's flags).
pub type Options = DemoOptions<OptimizerChoice, Own>;

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
    let o = &opts.run;
    acc.set_training_config(o.train_config())?;
    // The same seed on every rank: identical initial weights (prepare also
    // broadcasts rank 0's) and the same data order.
    set_seed(acc, o.seed, false);
    let mut say = |m: String| {
        if acc.is_main_process() {
            log(&m)
        }
    };
    say(format!("mixed precision {}", acc.mixed_precision()));
    if let Some(dir) = &opts.own.log_dir {
        let config: std::collections::BTreeMap<&str, f64> = [
            ("world_size", acc.world_size() as f64),
            ("epochs", o.epochs as f64),
            ("batch_size", o.batch_size as f64),
            ("accumulation", o.accumulation as f64),
            ("lr", o.lr),
            ("hidden", o.hidden as f64),
            ("seed", o.seed as f64),
        ]
        .into();
        acc.init_trackers("tch-digits", dir, &["jsonl", "tensorboard"], &config)?;
        say(format!(
            "logging loss and accuracy to {} (tensorboard --logdir {})",
            dir.join("tch-digits").display(),
            dir.display()
        ));
    }
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let mut engine = Engine {
        acc,
        net: mlp(&vs.root(), o.hidden as i64),
    };
    let optimizer = match opts.optimizer {
        OptimizerChoice::AdamW => AnyOptimizer::AdamW(AdamW::new(o.lr)),
        OptimizerChoice::TorchSgd => {
            AnyOptimizer::Torch(TchOptimizer::new(&vs, nn::Sgd::default(), o.lr)?)
        }
    };
    let model = TchModel::new(vs)?;
    let (report, _) = train_digits(acc, o, model, optimizer, &mut engine, &mut say)?;
    Ok(report)
}

/// tch's part of the loop: the network, whose variables the model holds.
struct Engine<'a> {
    acc: &'a Accelerator,
    net: nn::Sequential,
}

impl Engine<'_> {
    /// The loss of `images` (bf16/fp16 under autocast, logits back in f32
    /// for the loss).
    fn loss(&self, images: &Digits) -> Result<Tensor> {
        let (x, y) = collate(images);
        let logits = autocast_forward(self.acc, tch::Device::Cpu, || self.net.forward(&x))?;
        Ok(logits.cross_entropy_for_logits(&y))
    }
}

impl DigitsEngine<TchModel> for Engine<'_> {
    fn loss_backward(&mut self, _: &mut TchModel, scale: f32, images: Digits) -> Result<f64> {
        let loss = self.loss(&images)?;
        (&loss * f64::from(scale)).backward();
        Ok(loss.double_value(&[]))
    }

    /// libtorch's backward with a hook on each parameter's gradient
    /// accumulator ([`TchModel::backward_reporting`]): `gate` hears of
    /// each parameter as soon as autograd has finished it, in f32 and
    /// under autocast alike (the parameters stay f32).
    fn loss_backward_gated(
        &mut self,
        model: &mut TchModel,
        scale: f32,
        images: Digits,
        gate: &mut dyn UnitGate,
    ) -> Result<f64> {
        let loss = self.loss(&images)?;
        model.backward_reporting(&(&loss * f64::from(scale)), gate)?;
        Ok(loss.double_value(&[]))
    }

    fn gathered_hits(&mut self, images: Digits, batch: &Batch<usize>) -> Result<Hits> {
        let (x, y) = collate(&images);
        let pred = tch::no_grad(|| self.net.forward(&x).argmax(-1, false));
        let hits = pred.eq_tensor(&y).to_kind(Kind::Int64);
        let all = self.acc.gather_tensor_for_metrics(&hits, batch)?;
        let correct = all.sum(Kind::Int64).int64_value(&[]);
        Ok((correct as u64, all.size()[0] as usize))
    }
}
