//! A `tch::nn::VarStore` as the training loop's [`Parameters`].

use std::collections::HashSet;
use std::sync::Arc;

use accel::train::{GradKernels, ParamMut, ParamRef, Parameters};
use accel_api::{Buf, BufMut, Error, Result};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::ffi;
use crate::kernels::TchKernels;

/// The trainable variables of a [`VarStore`], in name order, seen by
/// accel's training loop as [`Parameters`]: values and gradients are viewed
/// in place (no copies) for gradient averaging, checkpoints and the
/// broadcast that makes every rank start equal: host views for CPU
/// tensors, device views (with [`TchKernels`]) for CUDA tensors.
///
/// Prepare it with [`Accelerator::prepare_model`](accel::Accelerator::prepare_model);
/// the prepared model derefs to this, which derefs to the `VarStore`.
///
/// # Requires
/// Every trainable variable is a contiguous floating-point tensor (f16,
/// bf16, f32, f64) on the CPU or a CUDA device; [`TchModel::new`] checks
/// it. accel's reference optimizers and [`AdamW`](crate::AdamW) need f32
/// CPU variables; [`TchOptimizer`](crate::TchOptimizer) takes any.
/// Non-trainable variables (batch-norm statistics, say) are neither averaged
/// nor checkpointed by this adapter.
///
/// # Gradients
/// Before each visit every parameter gets a defined, contiguous gradient
/// (zeros where autograd has not produced one yet, or where an optimizer's
/// `zero_grad` set it to none), so the views always exist. Zeroing through
/// the training loop fills the gradients with 0 in place.
#[derive(Debug)]
pub struct TchModel {
    vs: VarStore,
    /// Trainable variables sorted by name: the same order on every rank.
    params: Vec<(String, Tensor)>,
}

impl TchModel {
    /// Adopt the trainable variables of `vs` (create the model's layers in it
    /// first).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming the variable when one is not a contiguous floating-point
    /// tensor on the CPU or CUDA, or when there is no trainable variable.
    pub fn new(vs: VarStore) -> Result<TchModel> {
        let mut params: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(_, t)| t.requires_grad())
            .collect();
        params.sort_by(|a, b| a.0.cmp(&b.0));
        if params.is_empty() {
            return Err(Error::invalid_argument(
                "TchModel::new",
                "the VarStore has no trainable variable",
            )
            .with_fix("build the model's layers in the VarStore before wrapping it"));
        }
        for (name, t) in &params {
            let float = matches!(
                t.kind(),
                Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double
            );
            let device = matches!(t.device(), tch::Device::Cpu | tch::Device::Cuda(_));
            if !float || !device || !t.is_contiguous() {
                return Err(Error::invalid_argument(
                    "TchModel::new",
                    format!(
                        "variable {name:?} is {:?} on {:?}{}; the training loop takes contiguous floating-point CPU or CUDA parameters",
                        t.kind(),
                        t.device(),
                        if t.is_contiguous() { "" } else { ", not contiguous" }
                    ),
                )
                .with_fix("create the VarStore on tch::Device::Cpu or Cuda(i) with float variables (vs.float(), vs.bfloat16())"));
            }
        }
        let model = TchModel { vs, params };
        model.define_grads();
        Ok(model)
    }

    /// The variable store (also reachable through `Deref`).
    pub fn var_store(&self) -> &VarStore {
        &self.vs
    }

    /// The variable store, mutably.
    pub fn var_store_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }

    /// Give the `VarStore` back.
    pub fn into_var_store(self) -> VarStore {
        self.vs
    }

    /// The trainable variables, in the order the training loop visits them.
    pub fn named_parameters(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// [`Parameters::visit_params`], except that the gradients of the
    /// parameters named in `freed` (set to none by
    /// [`Zero3TchModel`](crate::Zero3TchModel)'s `release_grad`) are not
    /// allocated again while autograd has not: they are seen empty, which
    /// reads as zeros.
    pub(crate) fn visit_params_keeping_freed(
        &self,
        freed: &HashSet<String>,
        f: &mut dyn FnMut(ParamRef<'_>),
    ) {
        self.define_grads_except(freed);
        for (name, p) in &self.params {
            let g = grad_or_empty(p);
            f(ParamRef {
                name,
                value: view(p),
                grad: view(&g),
            });
        }
    }

    /// [`Parameters::visit_params_mut`] keeping the `freed` gradients
    /// unallocated, as [`visit_params_keeping_freed`](Self::visit_params_keeping_freed).
    pub(crate) fn visit_params_mut_keeping_freed(
        &mut self,
        freed: &HashSet<String>,
        f: &mut dyn FnMut(ParamMut<'_>),
    ) {
        self.define_grads_except(freed);
        for (name, p) in &mut self.params {
            let mut g = grad_or_empty(p);
            f(ParamMut {
                name,
                value: view_mut(p),
                grad: view_mut(&mut g),
            });
        }
    }

    /// Make every parameter's gradient defined and contiguous, but for
    /// those named in `freed` where they have none.
    fn define_grads_except(&self, freed: &HashSet<String>) {
        for (name, p) in &self.params {
            if freed.contains(name) && !p.grad().defined() {
                continue;
            }
            define_grad(p);
        }
    }

    /// Make every parameter's gradient defined and contiguous.
    fn define_grads(&self) {
        for (_, p) in &self.params {
            define_grad(p);
        }
    }
}

impl std::ops::Deref for TchModel {
    type Target = VarStore;
    fn deref(&self) -> &VarStore {
        &self.vs
    }
}

impl std::ops::DerefMut for TchModel {
    fn deref_mut(&mut self) -> &mut VarStore {
        &mut self.vs
    }
}

/// Make `p`'s gradient defined (zeros where it has none) and contiguous.
pub(crate) fn define_grad(p: &Tensor) {
    let mut g = p.grad();
    if !g.defined() {
        // Autograd's accumulation gives the parameter a zero gradient
        // with the parameter's (contiguous) layout.
        tch::with_grad(|| (p.sum(Kind::Float) * 0.0).backward());
    } else if !g.is_contiguous() {
        let c = g.contiguous();
        g.set_data(&c);
    }
}

/// `p`'s gradient, or an empty tensor of its kind where it has none.
fn grad_or_empty(p: &Tensor) -> Tensor {
    let g = p.grad();
    if g.defined() {
        g
    } else {
        Tensor::empty([0], (p.kind(), p.device()))
    }
}

fn view(t: &Tensor) -> Buf<'_> {
    if t.device() == tch::Device::Cpu {
        Buf::Host(ffi::host_view(t).expect("checked in TchModel::new"))
    } else {
        Buf::Device(ffi::device_view(t).expect("checked in TchModel::new"))
    }
}

fn view_mut(t: &mut Tensor) -> BufMut<'_> {
    if t.device() == tch::Device::Cpu {
        BufMut::Host(ffi::host_view_mut(t).expect("checked in TchModel::new"))
    } else {
        BufMut::Device(ffi::device_view_mut(t).expect("checked in TchModel::new"))
    }
}

impl Parameters for TchModel {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        self.define_grads();
        for (name, p) in &self.params {
            let g = p.grad();
            f(ParamRef {
                name,
                value: view(p),
                grad: view(&g),
            });
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        self.define_grads();
        for (name, p) in &mut self.params {
            let mut g = p.grad();
            f(ParamMut {
                name,
                value: view_mut(p),
                grad: view_mut(&mut g),
            });
        }
    }

    fn num_params(&self) -> usize {
        self.params.iter().map(|(_, p)| p.numel()).sum()
    }

    fn grad_kernels(&self) -> Option<Arc<dyn GradKernels>> {
        self.params
            .iter()
            .any(|(_, p)| p.device() != tch::Device::Cpu)
            .then(|| Arc::new(TchKernels) as Arc<dyn GradKernels>)
    }

    /// libtorch autocasts the forward pass (`autocast_forward`).
    fn uses_mixed_precision(&self) -> bool {
        true
    }

    /// The variable's own size, so `save_model` writes each tensor in the
    /// shape (and dtype) PyTorch's `load_state_dict` and `transformers`
    /// expect.
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        let (_, t) = self.params.iter().find(|(n, _)| n == name)?;
        Some(dims(&t.size()))
    }
}

/// A libtorch size as `usize` dimensions.
pub(crate) fn dims(size: &[i64]) -> Vec<usize> {
    size.iter().map(|&d| d.max(0) as usize).collect()
}
