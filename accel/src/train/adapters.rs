//! The adapter traits a framework implements to plug into the training loop.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use accel_api::{Buf, BufMut, DType, Device, Element, Error, ErrorKind, HostBuf, Result};
use serde::{de::DeserializeOwned, Serialize};

use super::kernels::{no_kernels, GradKernels};

/// One parameter seen read-only: its name, values and gradient, as views of
/// the framework's own memory (host or device, any element type).
#[derive(Debug, Clone, Copy)]
pub struct ParamRef<'a> {
    /// Unique, stable name (the checkpoint key of the tensor).
    pub name: &'a str,
    /// The values, flattened row-major.
    pub value: Buf<'a>,
    /// The gradient, flattened row-major, same length as `value` (its
    /// element type may differ: f32 master weights with f16 gradients).
    pub grad: Buf<'a>,
}

/// One parameter seen mutably: its name, values and gradient views.
#[derive(Debug)]
pub struct ParamMut<'a> {
    /// Unique, stable name (the checkpoint key of the tensor).
    pub name: &'a str,
    /// The values, flattened row-major.
    pub value: BufMut<'a>,
    /// The gradient, same length as `value`.
    pub grad: BufMut<'a>,
}

fn not_host_f32(op: &str, name: &str, what: &str, dtype: DType, device: Device) -> Error {
    Error::invalid_argument(
        op,
        format!(
            "the {what} of parameter {name:?} is {dtype} on {device}; this needs f32 host memory"
        ),
    )
    .with_fix(
        "use an optimizer of the framework that owns the tensors (or keep f32 host master weights)",
    )
}

impl<'a> ParamRef<'a> {
    /// A parameter whose values and gradient are host slices.
    pub fn host<T: Element, G: Element>(name: &'a str, value: &'a [T], grad: &'a [G]) -> Self {
        ParamRef {
            name,
            value: Buf::from(value),
            grad: Buf::from(grad),
        }
    }

    /// The values as an `f32` host slice.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the parameter when the values
    /// are not `f32` host memory.
    pub fn value_f32(&self) -> Result<&'a [f32]> {
        match self.value {
            Buf::Host(h) if h.dtype() == DType::F32 => h.as_slice::<f32>(),
            v => Err(not_host_f32(
                "ParamRef::value_f32",
                self.name,
                "value",
                v.dtype(),
                v.device(),
            )),
        }
    }

    /// The gradient as an `f32` host slice.
    ///
    /// # Errors
    /// As [`value_f32`](Self::value_f32), for the gradient.
    pub fn grad_f32(&self) -> Result<&'a [f32]> {
        match self.grad {
            Buf::Host(h) if h.dtype() == DType::F32 => h.as_slice::<f32>(),
            g => Err(not_host_f32(
                "ParamRef::grad_f32",
                self.name,
                "gradient",
                g.dtype(),
                g.device(),
            )),
        }
    }
}

impl<'a> ParamMut<'a> {
    /// A parameter whose values and gradient are host slices.
    pub fn host<T: Element, G: Element>(
        name: &'a str,
        value: &'a mut [T],
        grad: &'a mut [G],
    ) -> Self {
        ParamMut {
            name,
            value: BufMut::from(value),
            grad: BufMut::from(grad),
        }
    }

    /// The values as an `f32` host slice, with the gradient as it is
    /// (a host view of any float type: read it with
    /// [`host_to_f32`](super::host_to_f32)).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the parameter when the values
    /// are not `f32` host memory or the gradient is on a device.
    pub fn host_f32_value(&mut self) -> Result<(&mut [f32], HostBuf<'_>)> {
        let name = self.name;
        let grad = match &self.grad {
            BufMut::Host(h) => h.as_buf(),
            BufMut::Device(d) => {
                return Err(not_host_f32(
                    "optimizer step",
                    name,
                    "gradient",
                    d.dtype(),
                    d.device(),
                ))
            }
        };
        let (dt, dev) = (self.value.dtype(), self.value.device());
        match &mut self.value {
            BufMut::Host(h) if dt == DType::F32 => Ok((h.as_mut_slice::<f32>()?, grad)),
            _ => Err(not_host_f32("optimizer step", name, "value", dt, dev)),
        }
    }

    /// Values and gradient as `f32` host slices.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the parameter when either is
    /// not `f32` host memory.
    pub fn f32_mut(&mut self) -> Result<(&mut [f32], &mut [f32])> {
        let name = self.name;
        let op = "ParamMut::f32_mut";
        let (vt, vd) = (self.value.dtype(), self.value.device());
        let (gt, gd) = (self.grad.dtype(), self.grad.device());
        let v = match &mut self.value {
            BufMut::Host(h) if vt == DType::F32 => h.as_mut_slice::<f32>()?,
            _ => return Err(not_host_f32(op, name, "value", vt, vd)),
        };
        let g = match &mut self.grad {
            BufMut::Host(h) if gt == DType::F32 => h.as_mut_slice::<f32>()?,
            _ => return Err(not_host_f32(op, name, "gradient", gt, gd)),
        };
        Ok((v, g))
    }
}

/// A model as the training loop sees it: named parameters, each with a
/// gradient, as views of the framework's memory (host or device, any float
/// element type).
///
/// # Requires
/// * Both visitors visit the same parameters in the same order, and that
///   order is identical on every rank (it decides the gradient buckets).
/// * Names are unique; they are the tensor names in checkpoints.
/// * `grad.len() == value.len()` for every parameter.
/// * Gradients are floating point (f16, bf16, f32, f64).
/// * Device views come with [`grad_kernels`](Self::grad_kernels): the
///   training loop cannot touch device memory itself.
///
/// The framework computes gradients itself (autograd or by hand) into the
/// gradient buffers; accel averages them across ranks
/// ([`PreparedModel`](super::PreparedModel)) in buckets grouped by
/// (device, dtype), unscales and clips them, and the [`Optimizer`] reads
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

    /// The device kernels for this model's device memory (copying into
    /// and out of bucket buffers, scaling, norms, clamping); `None` (the
    /// default) for a model whose views are all host memory.
    fn grad_kernels(&self) -> Option<Arc<dyn GradKernels>> {
        None
    }

    /// Whether the forward pass computes in the accelerator's mixed
    /// precision: under the framework's autocast (accel-tch's models say
    /// `true`: their forward runs under `autocast_forward`) or on bf16 or
    /// f16 values or gradients (half-precision compute copies). When bf16
    /// or fp16 is set and this is `false`,
    /// [`Accelerator::prepare`](crate::Accelerator::prepare) warns on rank
    /// 0 that the setting does not apply (an error under
    /// [`TrainConfig::strict`](super::TrainConfig::strict)). The default:
    /// whether some parameter's values or gradients are bf16 or f16.
    fn uses_mixed_precision(&self) -> bool {
        let half = |t: DType| matches!(t, DType::BF16 | DType::F16);
        let mut any = false;
        self.visit_params(&mut |p| {
            any |= half(p.value.dtype()) || half(p.grad.dtype());
        });
        any
    }

    /// The shape of parameter `name` as the framework holds it, or `None`
    /// (the default). A model that gives its shapes gets
    /// [`save_model`](crate::Accelerator::save_model) files in its own
    /// layout: each tensor with this shape and its values' own element type
    /// (f16, bf16, f32, f64), so the framework's loaders read them back as
    /// they were; and [`load_model`](crate::Accelerator::load_model) refuses
    /// a file tensor of another shape (a 1-D one of the right length
    /// passes). Without shapes, tensors are stored 1-D in `f32`.
    ///
    /// # Requires
    /// The product of the shape is the parameter's length.
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        let _ = name;
        None
    }

    /// Give parameter `name` storage for `numel` values and gradients
    /// (zero-filled where it grows), or free both with `numel == 0`. ZeRO
    /// stage 3 ([`crate::zero::Stage::Full`]) calls it to release a unit's
    /// parameters after use and to restore them before the next gather.
    ///
    /// The default keeps the storage as it is, which gives the same
    /// results without the memory saving; a model implements it to have
    /// its parameters sharded for real.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a name the model does not have.
    fn set_param_storage(&mut self, name: &str, numel: usize) -> Result<()> {
        let _ = (name, numel);
        Ok(())
    }

    /// Free parameter `name`'s gradient storage: ZeRO stage 2 calls it
    /// once the unit's gradients are reduce-scattered (and zeroed). A model
    /// that frees must give the gradient storage back itself, zero-filled,
    /// when its backward next writes it, as autograd allocates `.grad`; an
    /// empty gradient reads as zeros. The default keeps the storage: the
    /// same results without the saving.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a name the model does not have.
    fn release_grad(&mut self, name: &str) -> Result<()> {
        let _ = name;
        Ok(())
    }
}

/// Visit `model`'s parameters in order, with their index, until `f` fails;
/// returns the first error (`f` is not called for the rest).
///
/// # Errors
/// `f`'s first.
pub fn try_visit_params(
    model: &dyn Parameters,
    mut f: impl FnMut(usize, ParamRef<'_>) -> Result<()>,
) -> Result<()> {
    let (mut i, mut out) = (0, Ok(()));
    model.visit_params(&mut |p| {
        if out.is_ok() {
            out = f(i, p);
        }
        i += 1;
    });
    out
}

/// [`try_visit_params`] with mutable access.
///
/// # Errors
/// `f`'s first.
pub fn try_visit_params_mut(
    model: &mut dyn Parameters,
    mut f: impl FnMut(usize, ParamMut<'_>) -> Result<()>,
) -> Result<()> {
    let (mut i, mut out) = (0, Ok(()));
    model.visit_params_mut(&mut |p| {
        if out.is_ok() {
            out = f(i, p);
        }
        i += 1;
    });
    out
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
        zero_grads(params);
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
    /// Tensors written in a narrower type than `f32` ([`DType::BF16`] or
    /// [`DType::F16`]: a half-precision parameter, whose values `tensors`
    /// holds widened, losslessly); the others are written as `f32`. Filled
    /// on load from the types the file holds.
    pub stored_as: BTreeMap<String, DType>,
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

/// A registered custom object (see
/// [`Accelerator::register_for_checkpointing`](crate::Accelerator::register_for_checkpointing)).
pub type SharedStateful = Arc<Mutex<dyn Stateful + Send>>;

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

/// Set every gradient to zero (the default
/// [`Optimizer::zero_grad`](Optimizer::zero_grad)).
///
/// # Panics
/// When a device gradient has no kernels: a model that hands out device
/// views without [`Parameters::grad_kernels`] breaks the trait's contract
/// (`Accelerator::prepare` refuses such a model with `Unsupported`).
pub fn zero_grads(model: &mut dyn Parameters) {
    let k = model.grad_kernels();
    let mut failed = None;
    model.visit_params_mut(&mut |p| match p.grad {
        BufMut::Host(mut h) => h.bytes_mut().fill(0),
        BufMut::Device(d) => {
            let r = match &k {
                Some(k) => k.fill(d, 0.0),
                None => Err(no_kernels("zero_grad", p.name, d.device())),
            };
            if let Err(e) = r {
                failed.get_or_insert(e);
            }
        }
    });
    if let Some(e) = failed {
        panic!("zero_grad: {e}");
    }
}
