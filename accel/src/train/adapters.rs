//! The adapter traits a framework implements to plug into the training loop.

use std::collections::BTreeMap;

use accel_api::{Error, ErrorKind, Result};
use serde::{de::DeserializeOwned, Serialize};

/// One parameter seen read-only: its name, values and gradient.
#[derive(Debug, Clone, Copy)]
pub struct ParamRef<'a> {
    /// Unique, stable name (the checkpoint key of the tensor).
    pub name: &'a str,
    /// The values, flattened row-major.
    pub value: &'a [f32],
    /// The gradient buffer, same length as `value`.
    pub grad: &'a [f32],
}

/// One parameter seen mutably: its name, values and gradient.
#[derive(Debug)]
pub struct ParamMut<'a> {
    /// Unique, stable name (the checkpoint key of the tensor).
    pub name: &'a str,
    /// The values, flattened row-major.
    pub value: &'a mut [f32],
    /// The gradient buffer, same length as `value`.
    pub grad: &'a mut [f32],
}

/// A model as the training loop sees it: named `f32` parameters, each with a
/// gradient buffer of the same length, on the host.
///
/// # Requires
/// * Both visitors visit the same parameters in the same order, and that
///   order is identical on every rank (it decides the gradient buckets).
/// * Names are unique; they are the tensor names in checkpoints.
/// * `grad.len() == value.len()` for every parameter.
///
/// The framework computes gradients itself (autograd or by hand) into the
/// gradient buffers; accel averages them across ranks
/// ([`PreparedModel`](super::PreparedModel)), and the [`Optimizer`] reads
/// them.
pub trait Parameters {
    /// Call `f` once per parameter, in order.
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>));

    /// Call `f` once per parameter, in order, with mutable access.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>));

    /// Total number of parameter elements.
    fn num_params(&self) -> usize {
        let mut n = 0;
        self.visit_params(&mut |p| n += p.value.len());
        n
    }
}

/// One optimizer update over [`Parameters`].
///
/// # Behavior
/// [`step`](Self::step) reads the (already averaged) gradients and updates
/// the values; [`zero_grad`](Self::zero_grad) clears the gradients (the
/// default fills them with 0). The learning rate is read and set by the
/// [`PreparedScheduler`](super::PreparedScheduler). Optimizer state
/// (momentum buffers, step counts) goes into checkpoints through
/// [`state_dict`](Self::state_dict) / [`load_state_dict`](Self::load_state_dict);
/// the defaults save nothing, which is right only for stateless optimizers.
pub trait Optimizer {
    /// Update `params` from their gradients.
    ///
    /// # Errors
    /// The optimizer's own (e.g. a gradient of the wrong length).
    fn step(&mut self, params: &mut dyn Parameters) -> Result<()>;

    /// Clear the gradients.
    fn zero_grad(&mut self, params: &mut dyn Parameters) {
        params.visit_params_mut(&mut |p| p.grad.fill(0.0));
    }

    /// The learning rate in use.
    fn lr(&self) -> f64;

    /// Replace the learning rate (called by the scheduler).
    fn set_lr(&mut self, lr: f64);

    /// The state to checkpoint.
    fn state_dict(&self) -> StateDict {
        StateDict::default()
    }

    /// Restore a state from [`state_dict`](Self::state_dict).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the state does not fit.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

/// A learning-rate schedule.
///
/// # Behavior
/// [`step`](Self::step) advances the schedule by one; [`lr`](Self::lr) is
/// the rate after the steps so far. How often `step` runs per optimizer step
/// is the [`PreparedScheduler`](super::PreparedScheduler)'s business
/// (Accelerate's rule: `num_processes` times per optimizer step unless
/// `split_batches`).
pub trait Scheduler {
    /// Advance by one step.
    fn step(&mut self);

    /// The current learning rate.
    fn lr(&self) -> f64;

    /// The state to checkpoint (default: nothing).
    fn state_dict(&self) -> StateDict {
        StateDict::default()
    }

    /// Restore a state from [`state_dict`](Self::state_dict).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the state does not fit.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        let _ = state;
        Ok(())
    }
}

/// A map-style dataset: `len` samples, read by index.
///
/// # Requires
/// Every rank sees the same dataset (same length, same sample at each
/// index): sharding works on indices only.
pub trait Dataset {
    /// One sample.
    type Item;

    /// Number of samples.
    fn len(&self) -> usize;

    /// `true` when there is no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sample at `index` (`index < len()`).
    fn get(&self, index: usize) -> Self::Item;
}

/// An unprepared loader: a dataset and how to batch it. Preparing it
/// ([`Accelerator::prepare_loader`](crate::Accelerator::prepare_loader))
/// shards it across ranks.
#[derive(Clone, Debug)]
pub struct DataLoader<D> {
    /// The samples.
    pub dataset: D,
    /// Samples per batch: per process, or of the global batch with
    /// [`TrainConfig::split_batches`](super::TrainConfig::split_batches).
    pub batch_size: usize,
    /// Shuffle every epoch with a permutation of `(seed, epoch)`.
    pub shuffle: bool,
    /// The shuffle seed, the same on every rank.
    pub seed: u64,
    /// Drop the incomplete last round instead of topping it up.
    pub drop_last: bool,
}

impl<D> DataLoader<D> {
    /// Sequential batches of `batch_size`, no shuffle, keep the last batch.
    pub fn new(dataset: D, batch_size: usize) -> DataLoader<D> {
        DataLoader {
            dataset,
            batch_size,
            shuffle: false,
            seed: 0,
            drop_last: false,
        }
    }

    /// Shuffle with `seed`.
    pub fn shuffle(mut self, seed: u64) -> DataLoader<D> {
        self.shuffle = true;
        self.seed = seed;
        self
    }

    /// Set `drop_last`.
    pub fn drop_last(mut self, yes: bool) -> DataLoader<D> {
        self.drop_last = yes;
        self
    }
}

/// A tensor in a [`StateDict`]: `f32` values and a shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dimensions; their product is `data.len()`.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

impl Tensor {
    /// A 1-D tensor.
    pub fn from_vec(data: Vec<f32>) -> Tensor {
        Tensor {
            shape: vec![data.len()],
            data,
        }
    }
}

/// What a checkpointed object saves: tensors (written to safetensors) and
/// everything else as JSON values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StateDict {
    /// Tensors by name.
    pub tensors: BTreeMap<String, Tensor>,
    /// JSON values by name.
    pub values: BTreeMap<String, serde_json::Value>,
}

impl StateDict {
    /// Store a tensor.
    pub fn put_tensor(&mut self, name: impl Into<String>, data: Vec<f32>) {
        self.tensors.insert(name.into(), Tensor::from_vec(data));
    }

    /// Store a serde value.
    ///
    /// # Panics
    /// When `value` cannot be represented as JSON (maps with non-string
    /// keys); a programming error.
    pub fn put<T: Serialize>(&mut self, name: impl Into<String>, value: &T) {
        let v = serde_json::to_value(value).expect("state values serialise to JSON");
        self.values.insert(name.into(), v);
    }

    /// A stored tensor.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the tensor when it is missing.
    pub fn tensor(&self, name: &str) -> Result<&Tensor> {
        self.tensors.get(name).ok_or_else(|| {
            Error::new(
                ErrorKind::Corrupt,
                format!("the saved state has no tensor {name:?}"),
            )
        })
    }

    /// A stored value, decoded.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the key when it is missing or does not
    /// decode as `T`.
    pub fn get<T: DeserializeOwned>(&self, name: &str) -> Result<T> {
        let v = self.values.get(name).ok_or_else(|| {
            Error::new(
                ErrorKind::Corrupt,
                format!("the saved state has no value {name:?}"),
            )
        })?;
        serde_json::from_value(v.clone()).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                format!("the saved value {name:?} does not decode: {e}"),
            )
        })
    }

    /// `true` when nothing is stored.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty() && self.values.is_empty()
    }
}

/// Anything whose state can be saved and restored: what
/// [`Accelerator::register_for_checkpointing`](crate::Accelerator::register_for_checkpointing)
/// takes (Accelerate's "custom objects" with `state_dict` / `load_state_dict`).
pub trait Stateful {
    /// The state to save.
    ///
    /// # Errors
    /// The object's own.
    fn state_dict(&self) -> Result<StateDict>;

    /// Restore a saved state.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the state does not fit.
    fn load_state_dict(&mut self, state: StateDict) -> Result<()>;
}
