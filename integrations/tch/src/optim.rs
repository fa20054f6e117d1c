//! Optimizers for the training loop: libtorch's own (`tch::nn::Optimizer`)
//! and an AdamW whose state goes into checkpoints.

use std::collections::BTreeMap;

use accel::train::{Optimizer, Parameters, StateDict};
use accel_api::{Error, ErrorKind, Result};
use tch::nn::{OptimizerConfig, VarStore};

/// A `tch::nn::Optimizer` (SGD, Adam, AdamW, RMSprop of libtorch) as the
/// training loop's [`Optimizer`]. Prepared with
/// [`Accelerator::prepare_optimizer`](accel::Accelerator::prepare_optimizer)
/// it steps and zeroes gradients only on synchronising batches, and a
/// prepared scheduler sets its learning rate.
///
/// # Behavior
/// `step` runs libtorch's step over the variables of the `VarStore` the
/// optimizer was built from (the same storage the prepared model views), so
/// it sees the averaged gradients. `zero_grad` fills the gradients with 0 in
/// place (libtorch's own `zero_grad` sets them to none, which the training
/// loop's gradient views cannot follow).
///
/// # Checkpoints
/// The learning rate and the step count are saved. libtorch's optimizer
/// state (momentum buffers, Adam moments) is not reachable through tch's C
/// API, so a resumed stateful libtorch optimizer starts them from zero: a
/// resume is exact only for plain SGD. Use [`AdamW`] (or the facade's
/// [`Sgd`](accel::train::Sgd) with momentum) for an exact resume.
#[derive(Debug)]
pub struct TchOptimizer {
    inner: tch::nn::Optimizer,
    lr: f64,
    steps: u64,
}

impl TchOptimizer {
    /// Build `config` (e.g. `tch::nn::Sgd::default()`, `tch::nn::Adam::default()`)
    /// over the trainable variables of `vs` at learning rate `lr`.
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] with libtorch's message when it refuses.
    pub fn new<C: OptimizerConfig>(vs: &VarStore, config: C, lr: f64) -> Result<TchOptimizer> {
        let inner = config.build(vs, lr).map_err(|e| {
            Error::new(
                ErrorKind::Backend,
                format!("building the libtorch optimizer: {e}"),
            )
        })?;
        Ok(TchOptimizer::from_optimizer(inner, lr))
    }

    /// Adopt an optimizer built at learning rate `lr`.
    pub fn from_optimizer(inner: tch::nn::Optimizer, lr: f64) -> TchOptimizer {
        TchOptimizer {
            inner,
            lr,
            steps: 0,
        }
    }

    /// The libtorch optimizer (to set momentum or weight decay).
    pub fn inner_mut(&mut self) -> &mut tch::nn::Optimizer {
        &mut self.inner
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }
}

impl Optimizer for TchOptimizer {
    /// # Panics
    /// When libtorch's step fails (tch's `Optimizer::step` unwraps).
    fn step(&mut self, _params: &mut dyn Parameters) -> Result<()> {
        self.inner.step();
        self.steps += 1;
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
        self.lr = lr;
    }

    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        s.put("lr", &self.lr);
        s.put("steps", &self.steps);
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.set_lr(state.get("lr")?);
        self.steps = state.get("steps")?;
        Ok(())
    }
}

/// AdamW (PyTorch's `torch.optim.AdamW`, decoupled weight decay) over the
/// training loop's parameter views, with its moments in checkpoints, so a
/// resumed run continues exactly.
///
/// Works on the gradient views of any [`Parameters`] (for a
/// [`TchModel`](crate::TchModel), the tensors' own memory); the update is
/// `w -= lr * wd * w`, then Adam's bias-corrected step.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// Coefficients of the running averages of the gradient and its square.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Optimizer steps taken.
    pub steps: u64,
    exp_avg: BTreeMap<String, Vec<f32>>,
    exp_avg_sq: BTreeMap<String, Vec<f32>>,
}

impl AdamW {
    /// PyTorch's defaults (betas 0.9, 0.999; eps 1e-8; weight decay 0.01) at
    /// `lr`.
    pub fn new(lr: f64) -> AdamW {
        AdamW {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            steps: 0,
            exp_avg: BTreeMap::new(),
            exp_avg_sq: BTreeMap::new(),
        }
    }

    /// The same optimizer with `weight_decay`.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> AdamW {
        self.weight_decay = weight_decay;
        self
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, params: &mut dyn Parameters) -> Result<()> {
        self.steps += 1;
        let t = self.steps as i32;
        let (b1, b2) = self.betas;
        let bc1 = 1.0 - b1.powi(t);
        let bc2 = 1.0 - b2.powi(t);
        let step_size = (self.lr / bc1) as f32;
        let bc2_sqrt = bc2.sqrt() as f32;
        let decay = (1.0 - self.lr * self.weight_decay) as f32;
        let (b1, b2, eps) = (b1 as f32, b2 as f32, self.eps as f32);
        let (exp_avg, exp_avg_sq) = (&mut self.exp_avg, &mut self.exp_avg_sq);
        let mut bad = None;
        params.visit_params_mut(&mut |mut p| {
            if bad.is_some() {
                return;
            }
            let name = p.name;
            let (value, grad) = match p.host_f32_value() {
                Ok(v) => v,
                Err(e) => {
                    bad = Some(e);
                    return;
                }
            };
            let grad = match accel::train::host_to_f32(grad) {
                Ok(g) => g,
                Err(e) => {
                    bad = Some(e);
                    return;
                }
            };
            if grad.len() != value.len() {
                bad = Some(Error::invalid_argument(
                    "AdamW step",
                    format!("parameter {name:?} has a gradient of another length"),
                ));
                return;
            }
            let n = value.len();
            let m = exp_avg
                .entry(name.to_string())
                .or_insert_with(|| vec![0.0; n]);
            let v = exp_avg_sq
                .entry(name.to_string())
                .or_insert_with(|| vec![0.0; n]);
            // Zipped slices, no index checks: the compiler vectorizes the
            // loop (each element's arithmetic, and so its result, as before).
            let moments = m.iter_mut().zip(v.iter_mut());
            for ((w, &g), (m, v)) in value.iter_mut().zip(grad.iter()).zip(moments) {
                *m = b1 * *m + (1.0 - b1) * g;
                *v = b2 * *v + (1.0 - b2) * g * g;
                let decayed = *w * decay;
                *w = decayed - step_size * *m / (v.sqrt() / bc2_sqrt + eps);
            }
        });
        if let Some(e) = bad {
            return Err(e);
        }
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        s.put("lr", &self.lr);
        s.put("betas", &[self.betas.0, self.betas.1]);
        s.put("eps", &self.eps);
        s.put("weight_decay", &self.weight_decay);
        s.put("steps", &self.steps);
        for (name, m) in &self.exp_avg {
            s.put_tensor(format!("exp_avg.{name}"), m.clone());
        }
        for (name, v) in &self.exp_avg_sq {
            s.put_tensor(format!("exp_avg_sq.{name}"), v.clone());
        }
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.lr = state.get("lr")?;
        let betas: [f64; 2] = state.get("betas")?;
        self.betas = (betas[0], betas[1]);
        self.eps = state.get("eps")?;
        self.weight_decay = state.get("weight_decay")?;
        self.steps = state.get("steps")?;
        self.exp_avg.clear();
        self.exp_avg_sq.clear();
        for (name, t) in &state.tensors {
            if let Some(p) = name.strip_prefix("exp_avg_sq.") {
                self.exp_avg_sq.insert(p.to_string(), t.data.clone());
            } else if let Some(p) = name.strip_prefix("exp_avg.") {
                self.exp_avg.insert(p.to_string(), t.data.clone());
            } else {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("unexpected AdamW state tensor {name:?}"),
                ));
            }
        }
        Ok(())
    }
}
