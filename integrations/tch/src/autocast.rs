//! The forward pass under libtorch's autocast, as Accelerate's `autocast`
//! context and `convert_outputs_to_fp32`.

use accel::train::MixedPrecision;
use accel::Accelerator;
use accel_api::Result;
use tch::{Kind, Tensor};

use crate::ffi;

/// Ends an autocast region even when the closure panics.
struct Region(Option<ffi::AutocastPrev>);

impl Drop for Region {
    fn drop(&mut self) {
        if let Some(prev) = self.0.take() {
            ffi::autocast_exit(prev);
        }
    }
}

/// Run `f` under libtorch's autocast for `device` in `mode`: bf16 or f16
/// ops where libtorch's autocast lists them (matmuls, linear layers,
/// convolutions), f32 elsewhere; `MixedPrecision::No` runs `f` as it is.
///
/// # Behavior
/// libtorch supports autocast on the CPU in bf16 (and f16 in recent
/// versions) and on CUDA in both; the parameters stay in their own dtype
/// (f32 master weights) and their gradients too. Regions nest; the
/// previous state is restored on return, and on a panic in `f`.
///
/// # Errors
/// [`ErrorKind::Unsupported`](accel_api::ErrorKind::Unsupported) for a
/// device other than the CPU or CUDA;
/// [`ErrorKind::Backend`](accel_api::ErrorKind::Backend) when libtorch
/// refuses.
pub fn autocast_with<T>(
    mode: MixedPrecision,
    device: tch::Device,
    f: impl FnOnce() -> T,
) -> Result<T> {
    let half = match mode {
        MixedPrecision::No => return Ok(f()),
        MixedPrecision::Bf16 => false,
        MixedPrecision::Fp16 => true,
    };
    let cuda = match device {
        tch::Device::Cpu => false,
        tch::Device::Cuda(_) => true,
        other => {
            return Err(accel_api::Error::new(
                accel_api::ErrorKind::Unsupported,
                format!("autocast on {other:?}: libtorch autocasts on the CPU and CUDA"),
            ))
        }
    };
    let _region = Region(Some(ffi::autocast_enter(cuda, half)?));
    Ok(f())
}

/// The forward pass `f` under autocast in the accelerator's
/// [`mixed_precision`](Accelerator::mixed_precision) mode, with a
/// floating-point output returned in f32 (Accelerate's
/// `convert_outputs_to_fp32`), so that the loss is computed in f32.
///
/// # Errors
/// As [`autocast_with`].
pub fn autocast_forward(
    acc: &Accelerator,
    device: tch::Device,
    f: impl FnOnce() -> Tensor,
) -> Result<Tensor> {
    let out = autocast_with(acc.mixed_precision(), device, f)?;
    Ok(match out.kind() {
        Kind::Half | Kind::BFloat16 => out.to_kind(Kind::Float),
        _ => out,
    })
}

/// Whether libtorch's CPU (or CUDA) autocast is on now.
pub fn autocast_enabled(cuda: bool) -> bool {
    ffi::autocast_enabled(cuda)
}
