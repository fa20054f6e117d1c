//! Mixed precision for candle: f32 master weights, compute copies in bf16
//! or f16.

use accel::train::MixedPrecision;
use accel::Accelerator;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{VarBuilder, VarMap};

/// The dtype the forward pass computes in under `acc`'s mixed precision
/// (`TrainConfig::mixed_precision`, or `accel launch --mixed-precision`):
/// bf16 for `bf16`, f16 for `fp16`, f32 otherwise.
pub fn compute_dtype(acc: &Accelerator) -> DType {
    match acc.mixed_precision() {
        MixedPrecision::Bf16 => DType::BF16,
        MixedPrecision::Fp16 => DType::F16,
        _ => DType::F32,
    }
}

/// A candle-nn [`VarBuilder`] whose tensors are compute copies of
/// `varmap`'s variables in `dtype`: each `get` casts the master variable
/// (a differentiable cast, so candle's backward brings the gradients back
/// to the f32 masters, which accel averages and the optimizer updates).
/// Build the model's layers from it on every step (candle-nn layers hold
/// their tensors: a layer built once keeps the copies of that step).
///
/// A name the map does not hold is an error: build the model once with
/// `VarBuilder::from_varmap` (which creates the variables) first.
pub fn compute_var_builder(varmap: &VarMap, dtype: DType) -> VarBuilder<'static> {
    VarBuilder::from_backend(
        Box::new(ComputeCopies {
            varmap: varmap.clone(),
        }),
        dtype,
        Device::Cpu,
    )
}

struct ComputeCopies {
    varmap: VarMap,
}

impl ComputeCopies {
    fn var(&self, name: &str) -> candle_core::Result<Tensor> {
        let data = self
            .varmap
            .data()
            .lock()
            .map_err(|_| candle_core::Error::Msg("the VarMap's lock is poisoned".into()))?;
        match data.get(name) {
            Some(v) => Ok(v.as_tensor().clone()),
            None => candle_core::bail!(
                "accel-candle compute copies: the VarMap has no variable {name:?}; build the model with VarBuilder::from_varmap first"
            ),
        }
    }
}

impl SimpleBackend for ComputeCopies {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.var(name)?;
        if t.shape() != &s {
            candle_core::bail!(
                "accel-candle compute copies: {name:?} has shape {:?}, the layer asks for {s:?}",
                t.shape()
            )
        }
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.var(name)?.to_dtype(dtype)?.to_device(dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.varmap
            .data()
            .lock()
            .is_ok_and(|d| d.contains_key(name))
    }
}
