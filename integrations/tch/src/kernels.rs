//! [`GradKernels`] on libtorch: the training loop's arithmetic and bucket
//! copies on CUDA (or any libtorch device) tensors, through tensors made
//! over the views' memory.

use accel::train::{DeviceScratch, GradKernels, GradStats};
use accel_api::{Buf, BufMut, DType, Device, DeviceBuf, DeviceBufMut, Error, ErrorKind, Result};
use tch::Tensor;

use crate::ffi;

/// The device kernels of a [`TchModel`](crate::TchModel) whose variables
/// live on a device (returned by its `grad_kernels`): libtorch ops on the
/// views' memory, on the default stream, which the device backends order
/// their collectives on.
#[derive(Debug, Default, Clone, Copy)]
pub struct TchKernels;

fn backend(op: &str, e: tch::TchError) -> Error {
    Error::new(ErrorKind::Backend, format!("libtorch {op}: {e}"))
}

/// A libtorch tensor as bucket memory.
#[derive(Debug)]
struct Scratch(Tensor);

impl DeviceScratch for Scratch {
    fn view_mut(&mut self) -> DeviceBufMut<'_> {
        ffi::device_view_mut(&mut self.0).expect("allocated as a contiguous CUDA tensor")
    }
}

fn tensor_of<T>(buf: Buf<'_>, f: impl FnOnce(&Tensor) -> T) -> Result<T> {
    match buf {
        Buf::Host(h) => ffi::with_host_tensor(h, f),
        Buf::Device(d) => ffi::with_device_tensor(d, f),
    }
}

fn tensor_of_mut<T>(buf: BufMut<'_>, f: impl FnOnce(&mut Tensor) -> T) -> Result<T> {
    match buf {
        BufMut::Host(mut h) => ffi::with_host_tensor_mut(&mut h, f),
        BufMut::Device(d) => ffi::with_device_tensor_mut(d, f),
    }
}

impl GradKernels for TchKernels {
    fn alloc(&self, device: Device, dtype: DType, len: usize) -> Result<Box<dyn DeviceScratch>> {
        let kind = ffi::kind_of(dtype).ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!("no libtorch kind for {dtype}"),
            )
        })?;
        let dev = match device.kind {
            accel_api::DeviceKind::Cuda => tch::Device::Cuda(device.index as usize),
            other => {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("TchKernels allocates bucket buffers on CUDA devices, not {other}"),
                ))
            }
        };
        let t = Tensor::f_zeros([len as i64], (kind, dev)).map_err(|e| backend("zeros", e))?;
        Ok(Box::new(Scratch(t)))
    }

    fn copy(
        &self,
        src: Buf<'_>,
        src_offset: usize,
        dst: BufMut<'_>,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let done = tensor_of(src, |s| {
            tensor_of_mut(dst, |d| -> std::result::Result<(), tch::TchError> {
                let from = s.f_narrow(0, src_offset as i64, len as i64)?;
                let mut to = d.f_narrow(0, dst_offset as i64, len as i64)?;
                to.f_copy_(&from)?;
                Ok(())
            })
        })?;
        done?.map_err(|e| backend("copy", e))
    }

    fn scale(&self, buf: DeviceBufMut<'_>, factor: f64) -> Result<()> {
        ffi::with_device_tensor_mut(buf, |t| t.f_mul_scalar_(factor).map(drop))?
            .map_err(|e| backend("mul_", e))
    }

    fn fill(&self, buf: DeviceBufMut<'_>, value: f64) -> Result<()> {
        ffi::with_device_tensor_mut(buf, |t| t.f_fill_(value).map(drop))?
            .map_err(|e| backend("fill_", e))
    }

    fn stats(&self, buf: DeviceBuf<'_>, norm_type: f64) -> Result<GradStats> {
        ffi::with_device_tensor(buf, |t| -> std::result::Result<GradStats, tch::TchError> {
            let x = t.f_to_kind(tch::Kind::Double)?;
            let finite = x.f_isfinite()?.f_all()?.f_int64_value(&[])? == 1;
            let a = x.f_abs()?;
            let part = if norm_type.is_infinite() {
                a.f_max()?.f_double_value(&[])?
            } else {
                a.f_pow_tensor_scalar(norm_type)?
                    .f_sum(tch::Kind::Double)?
                    .f_double_value(&[])?
            };
            Ok(GradStats {
                norm_part: part,
                non_finite: !finite,
            })
        })?
        .map_err(|e| backend("norm", e))
    }

    fn clamp(&self, buf: DeviceBufMut<'_>, limit: f64) -> Result<()> {
        ffi::with_device_tensor_mut(buf, |t| t.f_clamp_(-limit, limit).map(drop))?
            .map_err(|e| backend("clamp_", e))
    }
}
