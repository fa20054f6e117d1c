//! [`GradKernels`]: the arithmetic and copies a framework provides on its
//! device memory, for the gradient views its model hands out.

use accel_api::{Buf, BufMut, DType, Device, DeviceBuf, DeviceBufMut, Error, ErrorKind, Result};

/// What [`GradKernels::stats`] measures over one buffer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GradStats {
    /// `sum |x|^p` over the elements for a finite `p`; `max |x|` for
    /// `p = inf`. Computed in (at least) f64 from the stored values.
    pub norm_part: f64,
    /// Some element is infinite or NaN.
    pub non_finite: bool,
}

/// Scratch device memory a [`GradKernels`] allocated: one gradient bucket.
pub trait DeviceScratch: Send {
    /// A writable view of the whole allocation.
    fn view_mut(&mut self) -> DeviceBufMut<'_>;
}

/// Arithmetic and copies on a framework's device memory, for the gradient
/// views a [`Parameters`](crate::train::Parameters) hands out (return it from
/// [`Parameters::grad_kernels`](crate::train::Parameters::grad_kernels)).
///
/// # Behavior
/// Every method works on floating-point views (f16, bf16, f32, f64) and
/// finishes its work before returning (or orders it on the view's stream
/// so that a following collective on that stream sees the result). Host
/// views never reach [`scale`](Self::scale), [`stats`](Self::stats),
/// [`clamp`](Self::clamp) and [`fill`](Self::fill); [`copy`](Self::copy)
/// gets host memory on one side when the loop stages a device gradient
/// through the host (checkpoints) and device memory on both sides for
/// bucket buffers.
pub trait GradKernels: Send + Sync {
    /// A zero-filled buffer of `len` elements of `dtype` on `device`
    /// (a gradient bucket).
    ///
    /// # Errors
    /// The framework's (out of memory).
    fn alloc(&self, device: Device, dtype: DType, len: usize) -> Result<Box<dyn DeviceScratch>>;

    /// Copy `len` elements from `src[src_offset..]` to `dst[dst_offset..]`
    /// (same dtype).
    ///
    /// # Errors
    /// The framework's.
    fn copy(
        &self,
        src: Buf<'_>,
        src_offset: usize,
        dst: BufMut<'_>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;

    /// Multiply every element by `factor` in place.
    ///
    /// # Errors
    /// The framework's.
    fn scale(&self, buf: DeviceBufMut<'_>, factor: f64) -> Result<()>;

    /// Set every element to `value`.
    ///
    /// # Errors
    /// The framework's.
    fn fill(&self, buf: DeviceBufMut<'_>, value: f64) -> Result<()>;

    /// The norm part and the non-finite flag of `buf` for `norm_type`.
    ///
    /// # Errors
    /// The framework's.
    fn stats(&self, buf: DeviceBuf<'_>, norm_type: f64) -> Result<GradStats>;

    /// Clamp every element into `[-limit, limit]` in place.
    ///
    /// # Errors
    /// The framework's.
    fn clamp(&self, buf: DeviceBufMut<'_>, limit: f64) -> Result<()>;
}

/// The error for a device gradient of a model without kernels.
/// The model's kernels for parameter `name`'s gradient on `device`, or
/// the [`no_kernels`] error when it gives none.
pub(crate) fn need_kernels<'k>(
    k: Option<&'k dyn GradKernels>,
    op: &str,
    name: &str,
    device: Device,
) -> Result<&'k dyn GradKernels> {
    k.ok_or_else(|| no_kernels(op, name, device))
}

pub(crate) fn no_kernels(op: &str, name: &str, device: Device) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!("{op}: the gradient of parameter {name:?} is on {device}, and the model has no device kernels"),
    )
    .with_fix("return the framework's GradKernels from Parameters::grad_kernels")
}
