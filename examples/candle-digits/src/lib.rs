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

use std::path::PathBuf;

pub mod plain;

use accel::train::{Batch, Optimizer, Parameters, StateDict};
use accel::zero::UnitGate;
use accel::{Accelerator, Error, ErrorKind, Result};
use accel_candle::{
    compute_dtype, compute_var_builder, init_uniform, sequential_loss_and_grad, AdamW, CandleModel,
    CandleOptimizer, Link,
};
pub use accel_example_kit::digits::{Digits, Split, CLASSES, FEATURES};
pub use accel_example_kit::run::{checksum, flat_params, Report};
use accel_example_kit::run::{Demo, DemoOptions};
use accel_example_kit::train::{train_digits, DigitsEngine, Hits};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::optim::ParamsAdamW;
use candle_nn::{Linear, Module, VarBuilder, VarMap};

/// `images` as an `[n, 64]` f32 tensor and `[n]` u32 labels.
///
/// # Errors
/// candle's, as [`ErrorKind::Backend`].
pub fn collate(images: Digits) -> Result<(Tensor, Tensor)> {
    let n = images.len();
    let x = Tensor::from_vec(images.pixels, (n, FEATURES), &Device::Cpu).map_err(candle)?;
    let y = Tensor::from_vec(images.labels, n, &Device::Cpu).map_err(candle)?;
    Ok((x, y))
}

pub(crate) fn candle(e: candle_core::Error) -> Error {
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

/// Which optimizer trains the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OptimizerChoice {
    /// [`accel_candle::AdamW`] (candle-nn's AdamW, moments in checkpoints:
    /// exact resume).
    #[default]
    AdamW,
    /// [`candle_nn::AdamW`] itself (its moments restart from zero on a
    /// resume).
    CandleAdamW,
    /// [`candle_nn::SGD`] (stateless: exact resume).
    Sgd,
}

/// candle-digits' own settings.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Own {
    /// Write the final weights here with `save_model` (Hugging Face layout).
    pub save_model: Option<PathBuf>,
}

impl Demo for Own {
    const NAME: &'static str = "candle-digits";
}

/// The demo's settings (the `candle-digits` binary's flags).
pub type Options = DemoOptions<OptimizerChoice, Own>;

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
    let o = &opts.run;
    acc.set_training_config(o.train_config())?;
    acc.set_seed(o.seed, false);
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
    let varmap = VarMap::new();
    let net = Mlp::new(&varmap, o.hidden)?;
    // candle cannot seed its CPU generator: seeded weights, the same on
    // every rank and in every run with this seed.
    init_uniform(&varmap, o.seed)?;
    let model = CandleModel::new(&varmap)?;
    let optimizer = match opts.optimizer {
        OptimizerChoice::AdamW => AnyOptimizer::AdamW(CandleOptimizer::new(&model, adamw(o.lr))?),
        OptimizerChoice::CandleAdamW => {
            AnyOptimizer::CandleAdamW(CandleOptimizer::new(&model, adamw(o.lr))?)
        }
        OptimizerChoice::Sgd => AnyOptimizer::Sgd(CandleOptimizer::new(&model, o.lr)?),
    };
    let mut engine = Engine {
        acc,
        net,
        varmap,
        dtype,
        hidden: o.hidden,
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

/// candle's part of the loop: the network on the f32 weights, and the
/// compute copies under mixed precision.
struct Engine<'a> {
    acc: &'a Accelerator,
    net: Mlp,
    varmap: VarMap,
    dtype: DType,
    hidden: usize,
}

impl DigitsEngine<CandleModel> for Engine<'_> {
    /// In f32, module by module ([`sequential_loss_and_grad`]), each
    /// module's gradients told to `gate` as soon as they are final; in
    /// bf16/f16, on compute copies, reported at the end.
    fn loss_backward_gated(
        &mut self,
        model: &mut CandleModel,
        scale: f32,
        b: Digits,
        gate: &mut dyn UnitGate,
    ) -> Result<f64> {
        if self.dtype != DType::F32 {
            let loss = self.loss_backward(model, scale, b)?;
            gate.reduce_grads(model, "")?;
            return Ok(loss);
        }
        let (x, y) = collate(b)?;
        let net = &self.net;
        let relu = |l: &Linear, x: &Tensor| l.forward(x).and_then(|h| h.relu());
        let links = [
            Link {
                module: "fc1",
                forward: &|x| relu(&net.fc1, x),
            },
            Link {
                module: "fc2",
                forward: &|x| relu(&net.fc2, x),
            },
            Link {
                module: "fc3",
                forward: &|x| net.fc3.forward(x),
            },
        ];
        let loss = |logits: &Tensor| candle_nn::loss::cross_entropy(logits, &y);
        sequential_loss_and_grad(model, gate, &x, &links, &loss, scale).map(f64::from)
    }

    fn loss_backward(&mut self, model: &mut CandleModel, scale: f32, b: Digits) -> Result<f64> {
        let (x, y) = collate(b)?;
        let logits = if self.dtype == DType::F32 {
            self.net.forward(&x)?
        } else {
            // Layers on this step's compute copies of the f32 weights.
            let vb = compute_var_builder(&self.varmap, self.dtype);
            let copies = Mlp::from_vb(&vb, self.hidden)?;
            let x = x.to_dtype(self.dtype).map_err(candle)?;
            copies.forward(&x)?.to_dtype(DType::F32).map_err(candle)?
        };
        let loss = candle_nn::loss::cross_entropy(&logits, &y).map_err(candle)?;
        model.backward(&(&loss * f64::from(scale)).map_err(candle)?)?;
        loss.to_scalar::<f32>().map(f64::from).map_err(candle)
    }

    fn gathered_hits(&mut self, images: Digits, batch: &Batch<usize>) -> Result<Hits> {
        let (x, y) = collate(images)?;
        let pred = self.net.forward(&x)?.argmax(D::Minus1).map_err(candle)?;
        let hits: Vec<u8> = pred.eq(&y).and_then(|h| h.to_vec1()).map_err(candle)?;
        let all = self.acc.gather_for_metrics(&hits, batch)?;
        Ok((all.iter().map(|&h| u64::from(h)).sum(), all.len()))
    }
}

pub(crate) fn adamw(lr: f64) -> ParamsAdamW {
    ParamsAdamW {
        lr,
        ..ParamsAdamW::default()
    }
}
