//! A `tch::nn::VarStore` as the training loop's [`Parameters`].

use accel::train::{ParamMut, ParamRef, Parameters};
use accel_api::{Error, Result};
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::ffi;

/// The trainable variables of a [`VarStore`], in name order, seen by
/// accel's training loop as [`Parameters`]: values and gradients are viewed
/// in place (no copies) for gradient averaging, checkpoints and the
/// broadcast that makes every rank start equal.
///
/// Prepare it with [`Accelerator::prepare_model`](accel::Accelerator::prepare_model);
/// the prepared model derefs to this, which derefs to the `VarStore`.
///
/// # Requires
/// Every trainable variable is a contiguous `f32` CPU tensor (the training
/// loop's parameters are `f32` host buffers); [`TchModel::new`] checks it.
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
    /// naming the variable when one is not a contiguous `f32` CPU tensor, or
    /// when there is no trainable variable.
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
            if t.kind() != Kind::Float || t.device() != tch::Device::Cpu || !t.is_contiguous() {
                return Err(Error::invalid_argument(
                    "TchModel::new",
                    format!(
                        "variable {name:?} is {:?} on {:?}{}; the training loop takes contiguous f32 CPU parameters",
                        t.kind(),
                        t.device(),
                        if t.is_contiguous() { "" } else { ", not contiguous" }
                    ),
                )
                .with_fix("create the VarStore on tch::Device::Cpu with f32 variables (vs.float())"));
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

    /// Make every parameter's gradient defined and contiguous.
    fn define_grads(&self) {
        for (_, p) in &self.params {
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

impl Parameters for TchModel {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        self.define_grads();
        for (name, p) in &self.params {
            let g = p.grad();
            let value = ffi::host_slice::<f32>(p).expect("checked in TchModel::new");
            let grad = ffi::host_slice::<f32>(&g).expect("define_grads made it a host f32 view");
            f(ParamRef { name, value, grad });
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        self.define_grads();
        for (name, p) in &mut self.params {
            let mut g = p.grad();
            let value = ffi::host_slice_mut::<f32>(p).expect("checked in TchModel::new");
            let grad =
                ffi::host_slice_mut::<f32>(&mut g).expect("define_grads made it a host f32 view");
            f(ParamMut { name, value, grad });
        }
    }

    fn num_params(&self) -> usize {
        self.params.iter().map(|(_, p)| p.numel()).sum()
    }
}
