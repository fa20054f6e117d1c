//! accel + burn on real data: an MLP classifies the 8x8 handwritten
//! digits of the UCI/scikit-learn data set (1,797 images, 10 classes),
//! trained data-parallel on N ranks with gradient accumulation, evaluated
//! with `gather_for_metrics`, checkpointed and resumed exactly. The same
//! data, split and schedule as `examples/tch-digits` and
//! `examples/candle-digits`, in burn (its NdArray CPU backend).
//!
//! The data file is `sklearn/datasets/data/digits.csv.gz` from the
//! scikit-learn wheel (`ACCEL_DIGITS_CSV`, default
//! `.accel-cache/tch/data/digits.csv.gz`; `scripts/digits_data.sh` fetches
//! it alone).

use std::cell::RefCell;
use std::path::PathBuf;
use std::rc::Rc;

use accel::train::{Batch, Optimizer, ParamMut, ParamRef, Parameters, StateDict};
use accel::{Accelerator, Result};
use accel_burn::{BurnModel, BurnOptimizer};
pub use accel_example_kit::digits::{Digits, Split, CLASSES, FEATURES};
pub use accel_example_kit::run::{checksum, flat_params, Report};
use accel_example_kit::run::{Demo, DemoOptions};
use accel_example_kit::train::{train_digits, DigitsEngine, Hits};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use burn::tensor::activation::relu;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// burn's device: its default (NdArray on the CPU) with autodiff.
pub fn device() -> Device {
    Device::default().autodiff()
}

/// `images` as an `[n, 64]` f32 tensor and `[n]` integer labels.
pub fn collate(images: Digits) -> (Tensor<2>, Tensor<1, Int>) {
    let n = images.len();
    let d = device();
    let labels: Vec<i64> = images.labels.iter().map(|&l| i64::from(l)).collect();
    (
        Tensor::from_data(TensorData::new(images.pixels, [n, FEATURES]), &d),
        Tensor::from_data(TensorData::new(labels, [n]), &d),
    )
}

/// The classifier: 64 → hidden → hidden → 10 with ReLU (parameters
/// `fc1.weight`, ... as the other digits demos').
#[derive(Module, Debug)]
pub struct Mlp {
    fc1: Linear,
    fc2: Linear,
    fc3: Linear,
}

impl Mlp {
    /// The layers, with burn's (unseeded) initial values.
    pub fn new(hidden: usize) -> Mlp {
        let d = device();
        Mlp {
            fc1: LinearConfig::new(FEATURES, hidden).init(&d),
            fc2: LinearConfig::new(hidden, hidden).init(&d),
            fc3: LinearConfig::new(hidden, CLASSES).init(&d),
        }
    }

    /// The logits of `x`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = relu(self.fc1.forward(x));
        let h = relu(self.fc2.forward(h));
        self.fc3.forward(h)
    }
}

/// Which burn optimizer trains the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// burn's AdamW (its moments in checkpoints: exact resume).
    #[default]
    AdamW,
    /// burn's SGD.
    Sgd,
}

/// burn-digits' own settings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Own {
    /// Write the final weights here with `save_model` (Hugging Face layout).
    pub save_model: Option<PathBuf>,
}

impl Demo for Own {
    const NAME: &'static str = "burn-digits";
}

/// The demo's settings (the `burn-digits` binary's flags).
pub type Options = DemoOptions<OptimizerChoice, Own>;

/// An optimizer the loop can hold either way.
#[derive(Debug)]
enum AnyOptimizer {
    AdamW(BurnOptimizer<AdamW>),
    Sgd(BurnOptimizer<Sgd>),
}

macro_rules! each {
    ($self:expr, $o:ident => $e:expr) => {
        match $self {
            AnyOptimizer::AdamW($o) => $e,
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

/// The model, shared by the training loop (which holds it prepared) and
/// the engine (which classifies the held-out images with its latest
/// values between steps).
#[derive(Debug, Clone)]
pub struct Shared(Rc<RefCell<BurnModel<Mlp>>>);

impl Parameters for Shared {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        self.0.borrow().visit_params(f)
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        self.0.borrow_mut().visit_params_mut(f)
    }
    fn num_params(&self) -> usize {
        self.0.borrow().num_params()
    }
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.0.borrow().param_shape(name)
    }
}

/// Train on `acc`; `log` receives the main process's lines.
///
/// # Errors
/// Anything accel reports: the data file, communication, checkpoint I/O;
/// burn's errors as [`ErrorKind::Backend`](accel::ErrorKind::Backend).
pub fn train(acc: &Accelerator, opts: &Options, mut log: impl FnMut(&str)) -> Result<Report> {
    let o = &opts.run;
    acc.set_training_config(o.train_config())?;
    acc.set_seed(o.seed, false);
    let mut say = |m: String| {
        if acc.is_main_process() {
            log(&m)
        }
    };
    let mut model = BurnModel::new(Mlp::new(o.hidden))?;
    // burn's initialisers are unseeded: seeded weights, the same on every
    // rank and in every run with this seed.
    model.init_uniform(o.seed);
    let optimizer = match opts.optimizer {
        OptimizerChoice::AdamW => AnyOptimizer::AdamW(BurnOptimizer::new(
            AdamWConfig::new()
                .with_weight_decay(0.01)
                .with_epsilon(1e-8)
                .build(),
            o.lr,
        )),
        OptimizerChoice::Sgd => {
            AnyOptimizer::Sgd(BurnOptimizer::new(SgdConfig::new().build(), o.lr))
        }
    };
    let model = Shared(Rc::new(RefCell::new(model)));
    let mut engine = Engine {
        acc,
        model: model.clone(),
    };
    let (report, model) = train_digits(acc, o, model, optimizer, &mut engine, &mut say)?;
    if let (Some(dir), false) = (&opts.own.save_model, report.stopped) {
        acc.save_model(&*model, dir, accel::train::DEFAULT_MAX_SHARD_SIZE)?;
        say(format!(
            "saved the weights to {} (Hugging Face layout)",
            dir.display()
        ));
    }
    Ok(report)
}

/// burn's part of the loop.
struct Engine<'a> {
    acc: &'a Accelerator,
    model: Shared,
}

impl DigitsEngine<Shared> for Engine<'_> {
    fn loss_backward(&mut self, model: &mut Shared, scale: f32, b: Digits) -> Result<f64> {
        let (x, y) = collate(b);
        let mut m = model.0.borrow_mut();
        let logits = m.module().forward(x);
        let loss = CrossEntropyLossConfig::new()
            .init(&device())
            .forward(logits, y);
        let value = loss.to_data().as_slice::<f32>().map(|v| f64::from(v[0]));
        m.backward(loss.mul_scalar(scale))?;
        value.map_err(|e| {
            accel::Error::new(accel::ErrorKind::Backend, format!("burn: the loss: {e:?}"))
        })
    }

    fn gathered_hits(&mut self, images: Digits, batch: &Batch<usize>) -> Result<Hits> {
        let (x, y) = collate(images);
        let pred = self
            .model
            .0
            .borrow_mut()
            .module()
            .forward(x)
            .argmax(1)
            .squeeze_dim::<1>(1);
        let hits: Vec<u8> = pred
            .equal(y)
            .to_data()
            .iter::<bool>()
            .map(u8::from)
            .collect();
        let all = self.acc.gather_for_metrics(&hits, batch)?;
        Ok((all.iter().map(|&h| u64::from(h)).sum(), all.len()))
    }
}
