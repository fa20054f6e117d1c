//! [`ShardOptimizer`], an elementwise optimizer stepping one rank's slice
//! of a unit, and [`ShardedSgd`].

use accel_api::{Error, ErrorKind, Result};

use crate::train::StateDict;

/// An elementwise optimizer that can update one rank's slice of a unit.
///
/// Elementwise optimizers (SGD, Adam, ...) give the same values on a slice
/// as on the whole parameter, which is what makes sharding them exact.
pub trait ShardOptimizer: Send {
    /// Update `params` from `grads` (the same length: this rank's slice of
    /// unit `unit`, padding included; padding gradients are 0).
    ///
    /// # Errors
    /// The optimizer's own.
    fn step_shard(&mut self, unit: usize, params: &mut [f32], grads: &[f32]) -> Result<()>;

    /// Called once after every unit was stepped.
    fn finish_step(&mut self);

    /// The learning rate in use.
    fn lr(&self) -> f64;

    /// Replace the learning rate.
    fn set_lr(&mut self, lr: f64);

    /// Elements of optimizer state this rank holds.
    fn state_numel(&self) -> usize;

    /// This rank's optimizer state.
    fn state_dict(&self) -> StateDict;

    /// Restore what [`state_dict`](Self::state_dict) returned.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for a state this optimizer did not write.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;

    /// Check the state just loaded against the lengths of this rank's
    /// slices, one per unit (what [`step_shard`](Self::step_shard) will
    /// be given), so that a checkpoint of another layout fails at load
    /// rather than at the next step. The default accepts any state.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the unit, the state entry and both
    /// lengths.
    fn check_shards(&self, lens: &[usize]) -> Result<()> {
        let _ = lens;
        Ok(())
    }
}

/// [`Sgd`](crate::train::Sgd)'s update (PyTorch's `SGD`) on shards, with
/// momentum buffers for this rank's slices only.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardedSgd {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 for plain SGD).
    pub momentum: f32,
    /// L2 penalty added to the gradient.
    pub weight_decay: f32,
    /// Optimizer steps taken.
    pub steps: u64,
    buffers: Vec<Option<Vec<f32>>>,
}

crate::train::optim::sgd_settings!(ShardedSgd);

impl ShardOptimizer for ShardedSgd {
    fn step_shard(&mut self, unit: usize, params: &mut [f32], grads: &[f32]) -> Result<()> {
        let bad = |what: String| {
            Err(Error::invalid_argument(
                "sharded optimizer step",
                format!("unit {unit}: {what}"),
            ))
        };
        if params.len() != grads.len() {
            return bad(format!(
                "{} parameters, {} gradients",
                params.len(),
                grads.len()
            ));
        }
        let (lr, mom, wd) = (self.lr as f32, self.momentum, self.weight_decay);
        if mom == 0.0 {
            crate::train::optim::sgd_update(params, grads, lr, wd, None);
            return Ok(());
        }
        if self.buffers.len() <= unit {
            self.buffers.resize(unit + 1, None);
        }
        let first = self.buffers[unit].is_none();
        let b = self.buffers[unit].get_or_insert_with(|| vec![0.0; params.len()]);
        if b.len() != params.len() {
            return bad(format!(
                "the momentum buffer holds {} elements, this rank's slice {}",
                b.len(),
                params.len()
            ));
        }
        crate::train::optim::sgd_update(params, grads, lr, wd, Some((mom, b, first)));
        Ok(())
    }

    fn finish_step(&mut self) {
        self.steps += 1;
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn state_numel(&self) -> usize {
        self.buffers.iter().flatten().map(Vec::len).sum()
    }

    fn state_dict(&self) -> StateDict {
        let mut s = self.settings_state();
        for (u, b) in self.buffers.iter().enumerate() {
            if let Some(b) = b {
                s.put_tensor(format!("momentum_buffer.unit{u}"), b.clone());
            }
        }
        s
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.load_settings(state)?;
        for (name, t) in &state.tensors {
            let unit = name
                .strip_prefix("momentum_buffer.unit")
                .and_then(|u| u.parse::<usize>().ok())
                .filter(|u| *u < 1 << 20)
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::Corrupt,
                        format!("unexpected sharded SGD state tensor {name:?}"),
                    )
                })?;
            if self.buffers.len() <= unit {
                self.buffers.resize(unit + 1, None);
            }
            self.buffers[unit] = Some(t.data.clone());
        }
        Ok(())
    }

    fn check_shards(&self, lens: &[usize]) -> Result<()> {
        for (u, b) in self.buffers.iter().enumerate() {
            let Some(b) = b else { continue };
            let want = lens.get(u).copied();
            if want != Some(b.len()) {
                let slice = want.map_or("this run has no such unit".to_string(), |n| {
                    format!("this rank's slice of unit {u} has {n}")
                });
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "sharded SGD state `momentum_buffer.unit{u}` holds {} elements; {slice}",
                        b.len()
                    ),
                )
                .with_fix("resume from a checkpoint written by this model, stage and world size"));
            }
        }
        Ok(())
    }
}
