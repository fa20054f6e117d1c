//! ZeRO stage 3 on a tch model: a [`TchModel`] whose parameters
//! [`accel::zero`] can free between uses.

use std::collections::HashSet;
use std::sync::Arc;

use accel::train::{GradKernels, ParamMut, ParamRef, Parameters};
use accel_api::{Error, Result};
use tch::Tensor;

use crate::TchModel;

/// A [`TchModel`] that implements [`Parameters::set_param_storage`] and
/// [`Parameters::release_grad`], so that a stage-2 [`ZeroOptimizer`](accel::zero::ZeroOptimizer)
/// frees each gradient once it is reduce-scattered (set to none, as
/// torch's `zero_grad(set_to_none=True)`), and a stage-3 one holds only
/// this rank's shard between a unit's uses: a released parameter's data
/// and gradient are swapped (`set_data`) for empty tensors, and a gathered
/// one gets zero-filled tensors of its shape back, which the optimizer then
/// fills. Everything else is the wrapped model's.
///
/// # Autograd
/// The variables keep their identity (only their data is swapped), so the
/// graph of a forward pass still refers to them: gather every unit a
/// backward needs before calling it ([`UnitGate::gather`](accel::zero::UnitGate::gather)),
/// as the gate's order asks, and the saved weights are the gathered
/// values again.
#[derive(Debug)]
pub struct Zero3TchModel {
    inner: TchModel,
    shapes: Vec<Vec<i64>>,
    /// The parameters whose gradient `release_grad` set to none (seen
    /// empty until autograd or a gather allocates it again).
    freed: HashSet<String>,
}

impl Zero3TchModel {
    /// Wrap `model`, noting every parameter's shape.
    pub fn new(model: TchModel) -> Zero3TchModel {
        let shapes = model
            .named_parameters()
            .iter()
            .map(|(_, t)| t.size())
            .collect();
        Zero3TchModel {
            inner: model,
            shapes,
            freed: HashSet::new(),
        }
    }

    /// The wrapped model.
    pub fn model(&self) -> &TchModel {
        &self.inner
    }

    /// Give the wrapped model back (released parameters stay empty).
    pub fn into_inner(self) -> TchModel {
        self.inner
    }

    /// Elements of parameter data the model holds now (0 for a model
    /// whose units are all released).
    pub fn resident_numel(&self) -> usize {
        let params = self.inner.named_parameters().iter();
        params.map(|(_, t)| t.numel()).sum()
    }
}

impl Parameters for Zero3TchModel {
    /// A gradient freed by [`release_grad`](Parameters::release_grad) is
    /// seen empty (it reads as zeros) rather than allocated again.
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        self.inner.visit_params_keeping_freed(&self.freed, f)
    }

    /// As [`visit_params`](Parameters::visit_params): a freed gradient is
    /// seen empty.
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        let freed = std::mem::take(&mut self.freed);
        self.inner.visit_params_mut_keeping_freed(&freed, f);
        self.freed = freed;
    }

    fn num_params(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.iter().product::<i64>().max(0) as usize)
            .sum()
    }

    fn grad_kernels(&self) -> Option<Arc<dyn GradKernels>> {
        self.inner.grad_kernels()
    }

    fn uses_mixed_precision(&self) -> bool {
        self.inner.uses_mixed_precision()
    }

    /// The shape noted at wrapping, released or not (a released parameter
    /// holds an empty tensor, but the consolidated weights have this shape).
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        let params = self.inner.named_parameters();
        let i = params.iter().position(|(n, _)| n == name)?;
        Some(crate::model::dims(&self.shapes[i]))
    }

    /// `numel == 0`: the data and gradient become empty tensors.
    /// Otherwise `numel` must be the parameter's element count: both
    /// become zero-filled tensors of its shape (dtype and device kept).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a name the model does not have or another element count.
    fn set_param_storage(&mut self, name: &str, numel: usize) -> Result<()> {
        let params = self.inner.named_parameters();
        let i = params.iter().position(|(n, _)| n == name).ok_or_else(|| {
            Error::invalid_argument("set_param_storage", format!("no parameter {name:?}"))
        })?;
        let shape = &self.shapes[i];
        let full: i64 = shape.iter().product();
        if numel != 0 && numel as i64 != full {
            return Err(Error::invalid_argument(
                "set_param_storage",
                format!("parameter {name:?} of shape {shape:?} cannot hold {numel} elements"),
            ));
        }
        let p = &params[i].1;
        let options = (p.kind(), p.device());
        let fresh = || {
            if numel == 0 {
                Tensor::empty([0], options)
            } else {
                Tensor::zeros(shape.as_slice(), options)
            }
        };
        // Handles to the same tensors: `set_data` swaps what they hold.
        let mut value = p.shallow_clone();
        let mut grad = p.grad();
        tch::no_grad(|| {
            value.set_data(&fresh());
            if grad.defined() {
                grad.set_data(&fresh());
            }
        });
        if numel != 0 && !grad.defined() {
            // A gathered unit starts with zero gradients, also where the
            // gradient was set to none (by `release_grad`, or an
            // optimizer's `zero_grad`).
            crate::model::define_grad(p);
            self.freed.remove(name);
        }
        Ok(())
    }

    /// ZeRO stage 2: the gradient is set to none (torch's
    /// `zero_grad(set_to_none=True)`), so its storage is freed until the
    /// next backward, where autograd allocates it again.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a name the model does not have; libtorch's.
    fn release_grad(&mut self, name: &str) -> Result<()> {
        let params = self.inner.named_parameters();
        let (_, p) = params.iter().find(|(n, _)| n == name).ok_or_else(|| {
            Error::invalid_argument("release_grad", format!("no parameter {name:?}"))
        })?;
        crate::ffi::grad_to_none(p)?;
        self.freed.insert(name.to_string());
        Ok(())
    }
}
