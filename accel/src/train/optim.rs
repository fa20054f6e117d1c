//! Reference implementations of the adapter traits: SGD with momentum and
//! two schedules. Enough for host-side models and for tests; frameworks
//! bring their own.

use std::collections::BTreeMap;

use accel_api::{Error, ErrorKind, Result};

use super::adapters::{Optimizer, Parameters, Scheduler, StateDict};
use super::grads::host_to_f32;

/// Stochastic gradient descent with optional momentum and weight decay
/// (PyTorch's `SGD`: `b = momentum * b + (g + wd * w)`, `w -= lr * b`).
#[derive(Clone, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 for plain SGD).
    pub momentum: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Optimizer steps taken.
    pub steps: u64,
    buffers: BTreeMap<String, Vec<f32>>,
}

/// What [`Sgd`] and the sharded [`crate::zero::ShardedSgd`] share besides
/// their update: the constructor, the builders, and the settings part of
/// their state (`lr`, `momentum`, `weight_decay`, `steps`). The type needs
/// those four public fields and a `buffers` field with a `Default`.
macro_rules! sgd_settings {
    ($T:ident) => {
        impl $T {
            /// Plain SGD at `lr`.
            pub fn new(lr: f64) -> $T {
                $T {
                    lr,
                    momentum: 0.0,
                    weight_decay: 0.0,
                    steps: 0,
                    buffers: Default::default(),
                }
            }

            /// The same optimizer with `momentum`.
            pub fn with_momentum(mut self, momentum: f32) -> $T {
                self.momentum = momentum;
                self
            }

            /// The same optimizer with `weight_decay`.
            pub fn with_weight_decay(mut self, weight_decay: f32) -> $T {
                self.weight_decay = weight_decay;
                self
            }

            /// A state holding the settings, for the buffers to be added.
            fn settings_state(&self) -> $crate::train::StateDict {
                let mut s = $crate::train::StateDict::default();
                s.put("lr", &self.lr);
                s.put("momentum", &self.momentum);
                s.put("weight_decay", &self.weight_decay);
                s.put("steps", &self.steps);
                s
            }

            /// Restore the settings from `state`; the buffers are cleared,
            /// for the caller to restore.
            fn load_settings(&mut self, state: &$crate::train::StateDict) -> accel_api::Result<()> {
                self.lr = state.get("lr")?;
                self.momentum = state.get("momentum")?;
                self.weight_decay = state.get("weight_decay")?;
                self.steps = state.get("steps")?;
                self.buffers.clear();
                Ok(())
            }
        }
    };
}
pub(crate) use sgd_settings;

sgd_settings!(Sgd);

/// PyTorch's SGD update of `value` from `grad` (the same length) with
/// weight decay `wd`; with `momentum = Some((factor, buffer, first))` the
/// buffer (starting as the first gradient when `first`) is stepped
/// instead. Shared by [`Sgd`] and the sharded [`crate::zero::ShardedSgd`],
/// which must give the same values.
pub(crate) fn sgd_update(
    value: &mut [f32],
    grad: &[f32],
    lr: f32,
    wd: f32,
    momentum: Option<(f32, &mut [f32], bool)>,
) {
    match momentum {
        None => {
            for (w, g) in value.iter_mut().zip(grad) {
                *w -= lr * (*g + wd * *w);
            }
        }
        Some((mom, buf, first)) => {
            for ((w, g), b) in value.iter_mut().zip(grad).zip(buf.iter_mut()) {
                let d = *g + wd * *w;
                *b = if first { d } else { mom * *b + d };
                *w -= lr * *b;
            }
        }
    }
}

impl Optimizer for Sgd {
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the parameter when its values
    /// are not `f32` host memory, its gradient is on a device, or the
    /// lengths differ. Gradients of any float type are read in f32.
    fn step(&mut self, params: &mut dyn Parameters) -> Result<()> {
        let lr = self.lr as f32;
        let (mom, wd) = (self.momentum, self.weight_decay);
        let buffers = &mut self.buffers;
        super::adapters::try_visit_params_mut(params, |_, mut p| {
            let name = p.name;
            let (value, grad) = p.host_f32_value()?;
            let grad = host_to_f32(grad)?;
            if grad.len() != value.len() {
                return Err(Error::invalid_argument(
                    "optimizer step",
                    format!("parameter {name:?} has a gradient of another length"),
                ));
            }
            if mom == 0.0 {
                sgd_update(value, &grad, lr, wd, None);
                return Ok(());
            }
            let first = !buffers.contains_key(name);
            let b = buffers
                .entry(name.to_string())
                .or_insert_with(|| vec![0.0; value.len()]);
            sgd_update(value, &grad, lr, wd, Some((mom, b, first)));
            Ok(())
        })?;
        self.steps += 1;
        Ok(())
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_dict(&self) -> StateDict {
        let mut s = self.settings_state();
        for (name, b) in &self.buffers {
            s.put_tensor(format!("momentum_buffer.{name}"), b.clone());
        }
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.load_settings(state)?;
        for (name, t) in &state.tensors {
            let Some(p) = name.strip_prefix("momentum_buffer.") else {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!("unexpected SGD state tensor {name:?}"),
                ));
            };
            self.buffers.insert(p.to_string(), t.data.clone());
        }
        Ok(())
    }
}

/// The state of the schedules here: the steps taken.
fn steps_state(steps: u64) -> StateDict {
    let mut s = StateDict::default();
    s.put("steps", &steps);
    s
}

/// A constant learning rate.
#[derive(Clone, Debug, PartialEq)]
pub struct ConstantSchedule {
    /// The rate.
    pub lr: f64,
    /// Steps taken (only counted).
    pub steps: u64,
}

impl ConstantSchedule {
    /// Always `lr`.
    pub fn new(lr: f64) -> ConstantSchedule {
        ConstantSchedule { lr, steps: 0 }
    }
}

impl Scheduler for ConstantSchedule {
    fn step(&mut self) {
        self.steps += 1;
    }
    fn lr(&self) -> f64 {
        self.lr
    }
    fn state_dict(&self) -> StateDict {
        steps_state(self.steps)
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.steps = state.get("steps")?;
        Ok(())
    }
}

/// Linear warm-up from 0 to `peak` over `warmup` steps, then linear decay to
/// 0 at `total` steps (transformers' `get_linear_schedule_with_warmup`: the
/// rate is `peak * factor(step)`, computed in that order so the values are
/// torch's to the last bit; at step 0 of a warm-up it is 0).
#[derive(Clone, Debug, PartialEq)]
pub struct LinearSchedule {
    /// The rate at the end of the warm-up.
    pub peak: f64,
    /// Warm-up steps.
    pub warmup: u64,
    /// Step at which the rate reaches 0.
    pub total: u64,
    /// Steps taken.
    pub steps: u64,
}

impl LinearSchedule {
    /// A schedule peaking at `peak` after `warmup` steps, 0 at `total`.
    pub fn new(peak: f64, warmup: u64, total: u64) -> LinearSchedule {
        LinearSchedule {
            peak,
            warmup,
            total,
            steps: 0,
        }
    }
}

impl Scheduler for LinearSchedule {
    fn step(&mut self) {
        self.steps += 1;
    }
    fn lr(&self) -> f64 {
        // LambdaLR: base_lr * lr_lambda(step), the factor first.
        let factor = if self.steps < self.warmup {
            self.steps as f64 / self.warmup.max(1) as f64
        } else if self.steps >= self.total {
            0.0
        } else {
            (self.total - self.steps) as f64 / (self.total - self.warmup).max(1) as f64
        };
        self.peak * factor
    }
    fn state_dict(&self) -> StateDict {
        steps_state(self.steps)
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.steps = state.get("steps")?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::{ParamMut, ParamRef};

    struct P {
        w: Vec<f32>,
        g: Vec<f32>,
    }
    impl Parameters for P {
        fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
            f(ParamRef::host("w", &self.w, &self.g))
        }
        fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
            f(ParamMut::host("w", &mut self.w, &mut self.g))
        }
    }

    #[test]
    fn sgd_momentum_matches_pytorch_and_round_trips() {
        let mut p = P {
            w: vec![1.0],
            g: vec![1.0],
        };
        let mut o = Sgd::new(0.1).with_momentum(0.9);
        o.step(&mut p).unwrap(); // b = 1, w = 0.9
        o.step(&mut p).unwrap(); // b = 1.9, w = 0.71
        assert!((p.w[0] - 0.71).abs() < 1e-6, "{}", p.w[0]);
        let mut o2 = Sgd::new(0.0);
        o2.load_state_dict(&o.state_dict()).unwrap();
        assert_eq!(o2, o);
        o.zero_grad(&mut p);
        assert_eq!(p.g, vec![0.0]);
    }

    #[test]
    fn linear_schedule_warms_up_and_decays() {
        let mut s = LinearSchedule::new(1.0, 2, 4);
        let mut lrs = vec![s.lr()];
        for _ in 0..5 {
            s.step();
            lrs.push(s.lr());
        }
        assert_eq!(lrs, vec![0.0, 0.5, 1.0, 0.5, 0.0, 0.0]);
    }
}
