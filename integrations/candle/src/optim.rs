//! candle-nn optimizers as the training loop's [`Optimizer`].

use accel::train::{Optimizer, Parameters, StateDict};
use accel_api::{Error, ErrorKind, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use candle_nn::optim::{Optimizer as CandleOpt, ParamsAdamW};

use crate::{candle_err, CandleModel};

/// What a candle optimizer saves in checkpoints beyond the learning rate
/// and the step count: its per-variable state, where it can reach it.
pub trait OptimizerState {
    /// Whether a resume from [`state`](Self::state) continues exactly.
    const EXACT_RESUME: bool;

    /// Tensors (by `state_key.var_name`) and values to checkpoint, for
    /// variables `names` in the optimizer's order. Nothing by default: an
    /// optimizer with no state, or none it lets us reach.
    fn state(&self, names: &[String], out: &mut StateDict) -> Result<()> {
        let _ = (names, out);
        Ok(())
    }

    /// Restore what [`state`](Self::state) saved (nothing by default).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when a tensor is missing or has another size.
    fn load(&mut self, names: &[String], state: &StateDict) -> Result<()> {
        let _ = (names, state);
        Ok(())
    }
}

/// candle-nn's SGD keeps no state: a resume is exact.
impl OptimizerState for candle_nn::SGD {
    const EXACT_RESUME: bool = true;
}

/// candle-nn's AdamW keeps its moments in private fields: they are not
/// saved, and a resumed run starts them from zero (use [`AdamW`] for an
/// exact resume).
impl OptimizerState for candle_nn::AdamW {
    const EXACT_RESUME: bool = false;
}

/// A candle-nn optimizer ([`candle_nn::AdamW`], [`candle_nn::SGD`], this
/// crate's [`AdamW`], or any other `candle_nn::Optimizer`) as the training
/// loop's [`Optimizer`]. Prepared with
/// [`Accelerator::prepare_optimizer`](accel::Accelerator::prepare_optimizer)
/// it steps and zeroes gradients only on synchronising batches, skips the
/// steps the fp16 loss scaler skips on every rank, and a prepared scheduler
/// sets its learning rate.
///
/// # Behavior
/// `step` hands the model's gradient buffers (averaged, unscaled and
/// clipped by accel in place) to candle-nn's `step` in a [`GradStore`]
/// whose tensors share the buffers' storage: no copy.
///
/// # Checkpoints
/// The learning rate, the step count and the inner optimizer's
/// [`OptimizerState`].
#[derive(Debug)]
pub struct CandleOptimizer<O> {
    inner: O,
    vars: Vec<(String, Var, Tensor)>,
    steps: u64,
}

impl<O: CandleOpt + OptimizerState> CandleOptimizer<O> {
    /// Build `O` with `config` over `model`'s variables (in the training
    /// loop's order), stepping on `model`'s gradient buffers.
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] with candle's message when `O::new` fails.
    pub fn new(model: &CandleModel, config: O::Config) -> Result<CandleOptimizer<O>> {
        let vars: Vec<Var> = model.params.iter().map(|p| p.var.clone()).collect();
        let inner = O::new(vars, config).map_err(candle_err)?;
        Ok(CandleOptimizer {
            inner,
            vars: model
                .params
                .iter()
                .map(|p| (p.name.clone(), p.var.clone(), p.grad.clone()))
                .collect(),
            steps: 0,
        })
    }

    /// The candle-nn optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// The candle-nn optimizer, mutably.
    pub fn inner_mut(&mut self) -> &mut O {
        &mut self.inner
    }

    /// Optimizer steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    fn names(&self) -> Vec<String> {
        self.vars.iter().map(|v| v.0.clone()).collect()
    }
}

impl<O: CandleOpt + OptimizerState> Optimizer for CandleOptimizer<O> {
    fn step(&mut self, _params: &mut dyn Parameters) -> Result<()> {
        let mut grads = GradStore::default();
        for (_, var, grad) in &self.vars {
            grads.insert(var.as_tensor(), grad.clone());
        }
        self.inner.step(&grads).map_err(candle_err)?;
        self.steps += 1;
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.inner.learning_rate()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_learning_rate(lr);
    }

    fn state_dict(&self) -> StateDict {
        let mut s = StateDict::default();
        s.put("lr", &self.lr());
        s.put("steps", &self.steps);
        if let Err(e) = self.inner.state(&self.names(), &mut s) {
            tracing::error!("accel-candle: optimizer state not saved: {e}");
        }
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.set_lr(state.get("lr")?);
        self.steps = state.get("steps")?;
        if !O::EXACT_RESUME {
            tracing::warn!(
                "accel-candle: {} keeps its state private; resumed, it starts that state afresh (use accel_candle::AdamW for an exact resume)",
                std::any::type_name::<O>()
            );
        }
        let names = self.names();
        self.inner.load(&names, state)
    }
}

/// AdamW (decoupled weight decay) on candle tensors, computed exactly as
/// [`candle_nn::AdamW`] computes it (the same operations in the same
/// order: bit-identical updates), with its moments reachable so that they
/// go into checkpoints and a resume is exact.
#[derive(Debug)]
pub struct AdamW {
    vars: Vec<(Var, Var, Var)>,
    step_t: usize,
    params: ParamsAdamW,
}

impl AdamW {
    /// The hyper-parameters.
    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    /// Optimizer steps taken.
    pub fn step_t(&self) -> usize {
        self.step_t
    }
}

impl CandleOpt for AdamW {
    type Config = ParamsAdamW;

    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<AdamW> {
        let vars = vars
            .into_iter()
            .filter(|v| v.dtype().is_float())
            .map(|v| {
                let m = Var::zeros(v.shape(), v.dtype(), v.device())?;
                let s = Var::zeros(v.shape(), v.dtype(), v.device())?;
                Ok((v, m, s))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(AdamW {
            vars,
            step_t: 0,
            params,
        })
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr;
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let p = &self.params;
        let (lr, beta1, beta2) = (p.lr, p.beta1, p.beta2);
        let lr_lambda = lr * p.weight_decay;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for (theta, m, v) in &self.vars {
            let Some(g) = grads.get(theta) else { continue };
            let next_m = ((m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
            let next_v = ((v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
            let m_hat = (&next_m * scale_m)?;
            let v_hat = (&next_v * scale_v)?;
            let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
            let adjusted = (m_hat / (v_hat.sqrt()? + p.eps)?)?;
            let next_theta = (next_theta - (adjusted * lr)?)?;
            m.set(&next_m)?;
            v.set(&next_v)?;
            theta.set(&next_theta)?;
        }
        Ok(())
    }
}

fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(candle_err)
}

impl OptimizerState for AdamW {
    const EXACT_RESUME: bool = true;

    fn state(&self, names: &[String], out: &mut StateDict) -> Result<()> {
        out.put("adamw_step_t", &self.step_t);
        for (name, (_, m, v)) in names.iter().zip(&self.vars) {
            out.put_tensor(format!("exp_avg.{name}"), to_f32(m.as_tensor())?);
            out.put_tensor(format!("exp_avg_sq.{name}"), to_f32(v.as_tensor())?);
        }
        Ok(())
    }

    fn load(&mut self, names: &[String], state: &StateDict) -> Result<()> {
        self.step_t = state.get("adamw_step_t")?;
        for (name, (_, m, v)) in names.iter().zip(&self.vars) {
            for (key, var) in [
                (format!("exp_avg.{name}"), m),
                (format!("exp_avg_sq.{name}"), v),
            ] {
                let t = state.tensor(&key)?;
                if t.data.len() != var.elem_count() {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!(
                            "AdamW state {key:?} has {} values, the variable {}",
                            t.data.len(),
                            var.elem_count()
                        ),
                    ));
                }
                let src = Tensor::from_slice(&t.data, var.shape(), var.device())
                    .and_then(|s| s.to_dtype(var.dtype()))
                    .map_err(candle_err)?;
                var.set(&src).map_err(candle_err)?;
            }
        }
        Ok(())
    }
}
