//! ZeRO for candle: a chain of candle modules run module by module through
//! [`accel::zero`]'s [`UnitGate`], so that stage 3 gathers each module's
//! variables just before it runs and releases them after.
//!
//! [`CandleModel`] frees and restores its variables' storage as the
//! sharding optimizer asks (its `set_param_storage` and `release_grad`).
//! candle's autograd has no per-module hook, so
//! [`sequential_loss_and_grad`] splits the backward pass at the module
//! boundaries: each module after the first takes its input through a leaf
//! variable, and each module's backward is its own `backward()` call,
//! started from the gradient its output's leaf received. That gives the
//! gate its order (gather, backward, reduce the gradients, module by module
//! in reverse) at the cost of one small extra backward root per module.

use accel::zero::UnitGate;
use accel_api::{Error, ErrorKind, Result};
use candle_core::{DType, Tensor, Var};

use crate::{candle_err, CandleModel};

/// One module of a chain: the name of its variables' prefix (`"fc1"` for
/// `fc1.weight`, `fc1.bias`; the gate's unit name) and its forward pass.
///
/// Build the layer inside `forward` from a `VarBuilder` over the model's
/// `VarMap` (or [`compute_var_builder`](crate::compute_var_builder) for
/// mixed precision): at stage 3 its variables hold values only from the
/// gather just before the call.
pub struct Link<'a> {
    /// The module's name: its variables are `module` and `module.*`.
    pub module: &'a str,
    /// Its forward pass.
    pub forward: &'a dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
}

impl std::fmt::Debug for Link<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("module", &self.module)
            .finish_non_exhaustive()
    }
}

/// One micro-batch of a model that is a chain `input → links[0] → … →
/// links[n-1] → loss`, module by module with `gate`'s calls around each
/// (a [`ZeroOptimizer`](accel::zero::ZeroOptimizer), or
/// [`NoGate`](accel::zero::NoGate) unsharded): `gather`, forward,
/// `release` (not for the last module); then, in reverse, `gather`,
/// backward, `reduce_grads`. The gradients of `loss × scale` are added into
/// the model's buffers (pass the scale
/// [`Accelerator::backward`](accel::Accelerator::backward)'s closure gets).
/// Returns the unscaled loss as f32.
///
/// # Errors
/// The gate's; [`ErrorKind::Backend`] with candle's message; an
/// [`ErrorKind::InvalidArgument`] when a module's output got no gradient
/// (the next module does not use its input differentiably) or `links` is
/// empty.
pub fn sequential_loss_and_grad(
    model: &mut CandleModel,
    gate: &mut dyn UnitGate,
    input: &Tensor,
    links: &[Link<'_>],
    loss: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
    scale: f32,
) -> Result<f32> {
    if links.is_empty() {
        return Err(Error::invalid_argument(
            "sequential_loss_and_grad",
            "no module to run",
        ));
    }
    let last = links.len() - 1;
    // Each module's input leaf (none for the first) and output.
    let mut leaves: Vec<Option<Var>> = Vec::with_capacity(links.len());
    let mut outputs: Vec<Tensor> = Vec::with_capacity(links.len());
    let mut x = input.clone();
    for (i, link) in links.iter().enumerate() {
        gate.gather(model, link.module)?;
        let leaf = if i == 0 {
            None
        } else {
            Some(Var::from_tensor(&x.detach()).map_err(candle_err)?)
        };
        let arg = leaf.as_ref().map_or(&x, |v| v.as_tensor());
        let out = (link.forward)(arg).map_err(|e| in_module(link, e))?;
        if i < last {
            gate.release(model, link.module)?;
        }
        leaves.push(leaf);
        outputs.push(out.clone());
        x = out;
    }
    let l = loss(&x).map_err(candle_err)?;
    let mut upstream: Option<Tensor> = None;
    for (i, link) in links.iter().enumerate().rev() {
        gate.gather(model, link.module)?;
        let root = match upstream.take() {
            None => (&l * f64::from(scale)).map_err(candle_err)?,
            Some(g) => (&outputs[i] * &g)
                .and_then(|t| t.sum_all())
                .map_err(candle_err)?,
        };
        let grads = root.backward().map_err(|e| in_module(link, e))?;
        model.add_grads(&grads)?;
        if let Some(leaf) = &leaves[i] {
            // Detached: candle's gradients keep their own graph (back to
            // the later modules' variables), which this module's backward
            // must not walk again.
            let g = grads.get(leaf.as_tensor()).map(Tensor::detach).ok_or_else(|| {
                Error::invalid_argument(
                    "sequential_loss_and_grad",
                    format!(
                        "module {:?} does not use its input differentiably: no gradient reaches the previous module",
                        link.module
                    ),
                )
            })?;
            upstream = Some(g);
        }
        gate.reduce_grads(model, link.module)?;
    }
    l.to_dtype(DType::F32)
        .and_then(|l| l.to_scalar::<f32>())
        .map_err(candle_err)
}

fn in_module(link: &Link<'_>, e: candle_core::Error) -> Error {
    Error::new(
        ErrorKind::Backend,
        format!("candle, module {:?}: {e}", link.module),
    )
}
