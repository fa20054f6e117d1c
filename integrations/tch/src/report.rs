//! A backward pass that reports each parameter's gradient as final while
//! it runs, so that gradient buckets are reduced during the rest of the
//! backward ([`Accelerator::backward_overlapped`](accel::Accelerator::backward_overlapped)).

use accel::train::Parameters;
use accel::zero::UnitGate;
use accel_api::{Error, Result};
use tch::Tensor;

use crate::ffi::GradHooks;
use crate::TchModel;

impl TchModel {
    /// Run `loss.backward()` and tell `gate` each parameter's gradient as
    /// soon as libtorch has finished it: `gate.reduce_grads(self, name)`
    /// with the parameter's exact name (`"fc2.weight"`), once per
    /// parameter the backward reaches, in the order autograd finishes them
    /// (reverse topological: the last layer's first). This is the backward
    /// to run inside [`Accelerator::backward_overlapped`], whose gate then
    /// starts each gradient bucket's all-reduce while the rest of the
    /// backward runs (torch DDP's reducer, which hooks the same place).
    /// Not for a [`ZeroOptimizer`](accel::zero::ZeroOptimizer)'s gate: it
    /// reduces (and at stage 3 frees) a whole unit when told of one of its
    /// parameters, so it needs the module-wise backward that reports a
    /// unit once all of its gradients are final.
    ///
    /// # Behavior
    /// A post hook is armed on each parameter's gradient accumulator (the
    /// `AccumulateGrad` node) for the duration of the call and removed
    /// before it returns, whatever happens. On the CPU libtorch runs the
    /// backward on the calling thread, so `gate` is called synchronously
    /// inside `backward()`; reports that libtorch makes on another thread
    /// (the autograd thread of a CUDA device) are handed to `gate` on this
    /// thread after the backward. Parameters the loss does not depend on
    /// are not reported: the gate takes them as final when the backward
    /// returns, so their bucket and the buckets after it start only then
    /// (torch DDP needs `find_unused_parameters` for them; here they cost
    /// overlap, never correctness: keep them out of the `VarStore`'s
    /// trainable variables where overlap matters). Every gradient is made defined first (zeros where
    /// there was none), so that the gate's visits inside the backward run
    /// no autograd of their own; the values accumulate as `backward()`
    /// would. Works under autocast too: the parameters and their
    /// accumulators stay f32.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming the parameter when one cannot be hooked (frozen after the
    /// model was wrapped), before any backward runs;
    /// [`ErrorKind::Backend`](accel_api::ErrorKind::Backend) when libtorch's
    /// backward fails (a loss that requires no gradient);
    /// otherwise the first error `gate` returned, naming the parameter
    /// whose hook reported it (`gate` is not called again after one; the
    /// backward still completes, so the gradients are whole).
    ///
    /// # Panics
    /// A panic of `gate` is resumed after the backward has returned and
    /// the hooks are removed (it never unwinds through libtorch).
    ///
    /// [`Accelerator::backward_overlapped`]: accel::Accelerator::backward_overlapped
    pub fn backward_reporting(&mut self, loss: &Tensor, gate: &mut dyn UnitGate) -> Result<()> {
        report_backward(self, loss, gate)
    }
}

/// `loss.backward()` reporting `model`'s parameters to `gate`.
fn report_backward(model: &mut TchModel, loss: &Tensor, gate: &mut dyn UnitGate) -> Result<()> {
    // The adapters define every gradient on a visit (a backward of their
    // own where one is missing): do it now, before the hooks are armed.
    model.visit_params(&mut |_| {});
    let (hooks, names) = {
        let vars = model.named_parameters();
        let names: Vec<String> = vars.iter().map(|(n, _)| n.clone()).collect();
        (GradHooks::arm(vars)?, names)
    };
    let mut first: Option<Error> = None;
    let mut seen = vec![false; names.len()];
    hooks.backward(loss, &mut |i| {
        // One report per parameter and backward, whatever libtorch does.
        if first.is_some() || std::mem::replace(&mut seen[i], true) {
            return;
        }
        if let Err(e) = gate.reduce_grads(model, &names[i]) {
            first = Some(e.with_detail(format_args!(
                "reported by the gradient hook of parameter {:?}",
                names[i]
            )));
        }
    })?;
    drop(hooks);
    first.map_or(Ok(()), Err)
}
