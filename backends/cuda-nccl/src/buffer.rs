//! [`DeviceBuffer`]: device memory the backend allocates, for programs and
//! tests that have no framework of their own (the GPU check, benchmarks).
//! Framework adapters (accel-tch, cudarc slices) build device views of
//! their own memory instead.

use std::time::Duration;

use accel_api::kit::{Backoff, Deadline, Polled};
use accel_api::{
    DType, Device, DeviceBuf, DeviceBufMut, DeviceKind, Element, Error, ErrorKind, HostBuf,
    HostBufMut, Result,
};

use crate::error::NcclFailure;
use crate::ffi::{self, DeviceMem, OwnedStream};

/// How long a host<->device copy of a [`DeviceBuffer`] may take.
const COPY_BOUND: Duration = Duration::from_secs(120);

/// The pause between two looks at a copy's stream.
const COPY_PAUSE: Backoff = Backoff::sleep(Duration::from_micros(50));

/// `len` elements of `dtype` in device memory on a CUDA device, with the
/// stream its copies are ordered on. Views of it ([`DeviceBuffer::view`],
/// [`DeviceBuffer::view_mut`]) borrow it, so they cannot outlive it.
#[derive(Debug)]
pub struct DeviceBuffer {
    mem: DeviceMem,
    stream: OwnedStream,
    dtype: DType,
    len: usize,
    device: Device,
}

impl DeviceBuffer {
    /// A copy of `data` on `device`.
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`] when CUDA is not usable here (the probe's
    /// reason); [`ErrorKind::InvalidArgument`] for a non-CUDA device or one
    /// out of range; [`ErrorKind::Backend`] when the driver fails.
    pub fn from_slice<T: Element>(device: Device, data: &[T]) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(device, T::DTYPE, data.len())?;
        b.upload(HostBuf::from(data))?;
        Ok(b)
    }

    /// `len` zeroed elements of `dtype` on `device`.
    ///
    /// # Errors
    /// As [`DeviceBuffer::from_slice`].
    pub fn zeros(device: Device, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        let mut b = DeviceBuffer::alloc(device, dtype, len)?;
        let zeros = vec![0u8; len * dtype.size()];
        b.upload(HostBuf::from_bytes(dtype, &zeros)?)?;
        Ok(b)
    }

    fn alloc(device: Device, dtype: DType, len: usize) -> Result<DeviceBuffer> {
        if device.kind != DeviceKind::Cuda {
            return Err(Error::invalid_argument(
                "alloc",
                format!("a DeviceBuffer lives on a cuda device, not {device}"),
            ));
        }
        let report = crate::probe::inspect();
        if let Some(why) = report.unavailable {
            return Err(NcclFailure::Unavailable(why).into());
        }
        if device.index as usize >= report.devices {
            return Err(Error::invalid_argument(
                "alloc",
                format!(
                    "{device} is not among the {} visible CUDA devices",
                    report.devices
                ),
            ));
        }
        let ctx = cudarc::driver::CudaContext::new(device.index as usize)
            .map_err(|e| NcclFailure::driver("cuDevicePrimaryCtxRetain", e))?;
        let stream =
            OwnedStream::new(&ctx).map_err(|e| NcclFailure::driver("cuStreamCreate", e))?;
        let mem = DeviceMem::alloc(&ctx, len * dtype.size())
            .map_err(|e| NcclFailure::driver("cuMemAlloc", e))?;
        Ok(DeviceBuffer {
            mem,
            stream,
            dtype,
            len,
            device,
        })
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device holding the memory.
    pub fn device(&self) -> Device {
        self.device
    }

    /// A read-only view for a collective.
    pub fn view(&self) -> DeviceBuf<'_> {
        ffi::view(&self.mem, self.shape())
    }

    /// A writable view for a collective.
    pub fn view_mut(&mut self) -> DeviceBufMut<'_> {
        let s = self.shape();
        ffi::view_mut(&mut self.mem, s)
    }

    fn shape(&self) -> ffi::Shape {
        ffi::Shape {
            dtype: self.dtype,
            len: self.len,
            device: self.device,
            stream: self.stream.raw().as_view(),
        }
    }

    fn wait(&self, what: &str) -> Result<()> {
        let idle = Deadline::after(COPY_BOUND).poll(&COPY_PAUSE, || {
            self.stream
                .is_idle()
                .map(|idle| idle.then_some(()))
                .map_err(|code| NcclFailure::Driver {
                    call: "cuStreamQuery",
                    code: format!("{code:?}"),
                })
        });
        match idle {
            Ok(()) => Ok(()),
            Err(Polled::Failed(e)) => Err(e.into()),
            Err(Polled::TimedOut) => Err(Error::timeout(
                what,
                COPY_BOUND,
                format!(
                    "copying {} bytes on {} did not finish",
                    self.mem.bytes(),
                    self.device
                ),
            )),
        }
    }

    fn check_len(&self, op: &str, dtype: DType, len: usize) -> Result<()> {
        if dtype != self.dtype || len != self.len {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "the host buffer holds {len} {dtype}, the device buffer {} {}",
                    self.len, self.dtype
                ),
            )
            .with_op(op.to_string()));
        }
        Ok(())
    }

    /// Copy `src` (same dtype and length) into the buffer; returns once done.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] on a dtype or length mismatch; the
    /// driver's failure as [`ErrorKind::Backend`].
    pub fn upload(&mut self, src: HostBuf<'_>) -> Result<()> {
        self.check_len("upload", src.dtype(), src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.stream
            .upload(self.mem.addr(), src.bytes())
            .map_err(|e| NcclFailure::driver("cuMemcpyHtoDAsync", e))?;
        self.wait("upload")
    }

    /// Copy the buffer into `dst` (same dtype and length); returns once done.
    ///
    /// # Errors
    /// As [`DeviceBuffer::upload`].
    pub fn download(&self, mut dst: HostBufMut<'_>) -> Result<()> {
        self.check_len("download", dst.dtype(), dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.stream
            .download(dst.bytes_mut(), self.mem.addr())
            .map_err(|e| NcclFailure::driver("cuMemcpyDtoHAsync", e))?;
        self.wait("download")
    }

    /// The contents as a vector of `T`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `T` is not the buffer's type; as
    /// [`DeviceBuffer::download`].
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let mut out = vec![T::from_f64(0.0); self.len];
        self.download(HostBufMut::from(&mut out[..]))?;
        Ok(out)
    }
}

/// A read-only view of a [cudarc](cudarc::driver::CudaSlice) slice for a
/// collective: its device (the slice's ordinal) and its stream (the
/// communicator's stream waits for the work queued there). Use the cudarc
/// this crate re-exports ([`crate::cudarc`]), so that the types agree.
pub fn cudarc_view<T: Element>(s: &cudarc::driver::CudaSlice<T>) -> DeviceBuf<'_> {
    ffi::cudarc_view(s)
}

/// A writable view of a cudarc slice; see [`cudarc_view`].
pub fn cudarc_view_mut<T: Element>(s: &mut cudarc::driver::CudaSlice<T>) -> DeviceBufMut<'_> {
    ffi::cudarc_view_mut(s)
}

/// A device buffer a started call can own ([`accel_api::StartExt`]): the
/// call gets it back from `wait`.
impl accel_api::OwnedBuf for DeviceBuffer {
    fn buf(&self) -> accel_api::Buf<'_> {
        accel_api::Buf::Device(self.view())
    }

    fn buf_mut(&mut self) -> accel_api::BufMut<'_> {
        accel_api::BufMut::Device(self.view_mut())
    }
}
