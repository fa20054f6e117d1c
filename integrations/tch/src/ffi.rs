//! Every `unsafe` operation of the crate: views of libtorch tensor memory,
//! and the C++ shim (autocast switches, gradient-accumulator hooks, the
//! tensor-parallel autograd functions).
//!
//! # The contract of a view
//! A view borrows the [`Tensor`] handle it was made from and points at the
//! tensor's storage, which libtorch owns and keeps alive at least as long as
//! the handle. Like any use of a libtorch data pointer, a view is only sound
//! while nothing *else* writes that storage: no in-place op through another
//! handle (a `shallow_clone`, a `VarStore` entry, an optimizer) on another
//! thread, and no call into libtorch that mutates it, while the view lives.
//! The crate's own uses hold views only for the duration of one collective
//! or one visitor call, on the thread that owns the model.
//!
//! # Gradient hooks
//! `GradHooks` (crate-private) arms a post hook on the gradient accumulator
//! of each of a model's parameters (torch DDP's `Reducer` registers the
//! same), so that a backward pass reports each parameter as soon as its
//! gradient is final. On the CPU, libtorch runs a backward on the thread
//! that calls it, so a hook runs inside `backward()`, between two autograd
//! nodes: the receiver is called there, synchronously (`GradHooks`'
//! documentation says why that is sound). [`grad_post_hooks`] counts the
//! hooks on a tensor's accumulator (none outlives its backward).

use accel_api::{
    DType, Device, DeviceBuf, DeviceBufMut, DeviceKind, Element, Error, ErrorKind, Result,
};
use accel_api::{HostBuf, HostBufMut};
use tch::{Kind, Tensor};

mod grad_hooks;
mod tp;
pub use grad_hooks::grad_post_hooks;
pub(crate) use grad_hooks::{grad_to_none, GradHooks};
pub(crate) use tp::{apply as tp_apply, TpCollective};

/// The accel element type of a libtorch kind, if collectives can carry it.
pub fn dtype_of(kind: Kind) -> Option<DType> {
    Some(match kind {
        Kind::Half => DType::F16,
        Kind::BFloat16 => DType::BF16,
        Kind::Float => DType::F32,
        Kind::Double => DType::F64,
        Kind::Int8 => DType::I8,
        Kind::Uint8 => DType::U8,
        Kind::Int => DType::I32,
        Kind::Int64 => DType::I64,
        _ => return None,
    })
}

/// The libtorch kind of an accel element type.
pub fn kind_of(dtype: DType) -> Option<Kind> {
    Some(match dtype {
        DType::F16 => Kind::Half,
        DType::BF16 => Kind::BFloat16,
        DType::F32 => Kind::Float,
        DType::F64 => Kind::Double,
        DType::I8 => Kind::Int8,
        DType::U8 => Kind::Uint8,
        DType::I32 => Kind::Int,
        DType::I64 => Kind::Int64,
        _ => return None,
    })
}

/// The accel element type of `t`, which must be contiguous.
fn contiguous_dtype(t: &Tensor, op: &str) -> Result<DType> {
    if !t.is_contiguous() {
        return Err(Error::invalid_argument(
            op,
            format!("the tensor (shape {:?}) is not contiguous", t.size()),
        )
        .with_fix("call .contiguous() first (it copies)"));
    }
    dtype_of(t.kind()).ok_or_else(|| unsupported_kind(op, t.kind()))
}

fn unsupported_kind(op: &str, kind: Kind) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!("{op}: tensors of kind {kind:?} have no accel element type"),
    )
    .with_fix("convert with .to_kind(..) to f16, bf16, f32, f64, i8, u8, i32 or i64")
}

/// Checks shared by the host views; returns the element type and byte length.
fn check_host(t: &Tensor, op: &str) -> Result<(DType, usize)> {
    if !t.defined() {
        return Err(Error::invalid_argument(op, "the tensor is undefined"));
    }
    if t.device() != tch::Device::Cpu {
        return Err(Error::invalid_argument(
            op,
            format!(
                "the tensor is on {:?}, a host view needs a CPU tensor",
                t.device()
            ),
        )
        .with_fix("use device_view for CUDA tensors, or .to_device(tch::Device::Cpu)"));
    }
    let dtype = contiguous_dtype(t, op)?;
    Ok((dtype, t.numel() * dtype.size()))
}

/// A read-only view of a contiguous CPU tensor's elements, without a copy.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for an undefined, non-CPU or
/// non-contiguous tensor; [`ErrorKind::Unsupported`] for a kind accel has no
/// element type for (bool, complex, ...).
pub fn host_view<'a>(t: &'a Tensor) -> Result<HostBuf<'a>> {
    let (dtype, len) = check_host(t, "host_view")?;
    if len == 0 {
        // An empty byte slice's address is 1: borrow one aligned for
        // every element type (a freed ZeRO-3 parameter is empty).
        return HostBuf::from_bytes(dtype, bytemuck::cast_slice::<u64, u8>(&[]));
    }
    let ptr = t.data_ptr() as *const u8;
    // SAFETY: `t` is a defined, contiguous CPU tensor, so `data_ptr()` (which
    // includes the storage offset) points at `numel * element_size` = `len`
    // initialised bytes of one allocation that libtorch keeps alive while the
    // handle `t`, borrowed for 'a, exists. `len > 0`, so the pointer is not
    // null. No writes happen through other handles while the view lives (the
    // module contract above).
    let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
    HostBuf::from_bytes(dtype, bytes)
}

/// A mutable view of a contiguous CPU tensor's elements, without a copy:
/// what a collective writes lands in the tensor.
///
/// # Errors
/// As [`host_view`].
pub fn host_view_mut<'a>(t: &'a mut Tensor) -> Result<HostBufMut<'a>> {
    let (dtype, len) = check_host(t, "host_view_mut")?;
    if len == 0 {
        // As in `host_view`.
        return HostBufMut::from_bytes(dtype, bytemuck::cast_slice_mut::<u64, u8>(&mut []));
    }
    let ptr = t.data_ptr() as *mut u8;
    // SAFETY: as in `host_view`; the handle is borrowed mutably for 'a, so no
    // other view made through this crate from `t` coexists with this one, and
    // by the module contract nothing else reads or writes the storage while
    // the view lives.
    let bytes = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
    HostBufMut::from_bytes(dtype, bytes)
}

/// [`host_view`] as a typed slice.
///
/// # Errors
/// As [`host_view`], and [`ErrorKind::InvalidArgument`] when `T` is not the
/// tensor's element type.
pub fn host_slice<T: Element>(t: &Tensor) -> Result<&[T]> {
    host_view(t)?.as_slice::<T>()
}

/// [`host_view_mut`] as a typed slice.
///
/// # Errors
/// As [`host_slice`].
pub fn host_slice_mut<T: Element>(t: &mut Tensor) -> Result<&mut [T]> {
    let view = host_view_mut(t)?;
    let dtype = view.dtype();
    if dtype != T::DTYPE {
        return Err(Error::invalid_argument(
            "host_slice_mut",
            format!("the tensor holds {dtype} elements, not {}", T::DTYPE),
        ));
    }
    Ok(bytemuck::cast_slice_mut(view.into_bytes()))
}

/// A device view of a contiguous CUDA tensor (address, length, dtype,
/// device, stream) for the device backends (NCCL and the like).
///
/// # Behavior
/// The stream is 0, the default stream: tch offers no stream API, so
/// libtorch's kernels on tensors made through tch run on the default stream
/// and a collective ordered on it sees their results. Nothing is copied or
/// synchronised.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for an undefined, non-CUDA or
/// non-contiguous tensor; [`ErrorKind::Unsupported`] for a kind accel has no
/// element type for.
pub fn device_view(t: &Tensor) -> Result<DeviceBuf<'_>> {
    let (addr, len, dtype, device) = device_parts(t, "device_view")?;
    // SAFETY: `t` is a defined, contiguous CUDA tensor (checked by
    // `device_parts`), so `data_ptr()` addresses `numel()` elements of
    // `dtype` on `device`; the view borrows the handle for its lifetime, so
    // the storage stays alive, and the caller holds it shared, so nothing
    // writes it through this handle meanwhile. Stream 0: see above.
    Ok(unsafe { DeviceBuf::from_raw(t, addr, len, dtype, device, 0) })
}

/// A writable device view of a CUDA tensor's memory, for collectives that
/// write in place (all-reduce, broadcast); as [`device_view`] otherwise.
///
/// # Errors
/// As [`device_view`].
pub fn device_view_mut(t: &mut Tensor) -> Result<DeviceBufMut<'_>> {
    let (addr, len, dtype, device) = device_parts(t, "device_view_mut")?;
    // SAFETY: as in `device_view`; the handle is borrowed mutably for the
    // view's lifetime, so no other view of the memory is made through it
    // while an engine writes.
    Ok(unsafe { DeviceBufMut::from_raw(t, addr, len, dtype, device, 0) })
}

/// Address, element count, dtype and device of a CUDA tensor, checked.
fn device_parts(t: &Tensor, op: &str) -> Result<(u64, usize, DType, Device)> {
    if !t.defined() {
        return Err(Error::invalid_argument(op, "the tensor is undefined"));
    }
    let index = match t.device() {
        tch::Device::Cuda(i) => i,
        other => {
            return Err(Error::invalid_argument(
                op,
                format!("the tensor is on {other:?}, a device view needs a CUDA tensor"),
            )
            .with_fix("use host_view for CPU tensors"))
        }
    };
    let dtype = contiguous_dtype(t, op)?;
    Ok((
        t.data_ptr() as u64,
        t.numel(),
        dtype,
        Device::new(DeviceKind::Cuda, index as u32),
    ))
}

/// The libtorch device of an accel device: CPU or CUDA.
fn tch_device(d: Device) -> Result<tch::Device> {
    match d.kind {
        DeviceKind::Cpu => Ok(tch::Device::Cpu),
        DeviceKind::Cuda => Ok(tch::Device::Cuda(d.index as usize)),
        other => Err(Error::new(
            ErrorKind::Unsupported,
            format!("libtorch (through tch) has no {other} device"),
        )),
    }
}

/// libtorch's kind for `dtype`.
///
/// # Errors
/// [`ErrorKind::Unsupported`] when it has none.
fn blob_kind(dtype: DType) -> Result<Kind> {
    kind_of(dtype).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!("no libtorch kind for {dtype}"),
        )
    })
}

/// A 1-D tensor of `len` elements of `dtype` at `ptr` on `device`, which
/// libtorch neither owns nor frees.
///
/// # Safety
/// `ptr` addresses `len` elements of `dtype` on `device`, valid for as
/// long as the tensor lives; the caller's borrow of them allows what is
/// done through the tensor (reads for a shared one, writes for an
/// exclusive one).
unsafe fn blob(ptr: *const u8, len: usize, dtype: DType, device: tch::Device) -> Result<Tensor> {
    let kind = blob_kind(dtype)?;
    // SAFETY: the caller's guarantee.
    unsafe { Tensor::f_from_blob(ptr, &[len as i64], &[1], kind, device) }
        .map_err(|e| Error::new(ErrorKind::Backend, format!("libtorch from_blob: {e}")))
}

/// A 1-D tensor over the memory of a device view, for the duration of
/// `f` (libtorch does not own or free it).
///
/// # Errors
/// [`ErrorKind::Unsupported`] for a device libtorch does not drive or a
/// dtype it has no kind for; libtorch's own as [`ErrorKind::Backend`].
pub(crate) fn with_device_tensor<T>(buf: DeviceBuf<'_>, f: impl FnOnce(&Tensor) -> T) -> Result<T> {
    let device = tch_device(buf.device())?;
    // SAFETY: by `DeviceBuf`'s contract `addr` points at `len` elements of
    // `dtype` on `device`, kept alive by the owner the view borrows for
    // longer than this call; the tensor lives only inside this call (it is
    // dropped before we return) and, for a shared view, `f` only reads it.
    let t = unsafe { blob(buf.addr() as *const u8, buf.len(), buf.dtype(), device) }?;
    Ok(f(&t))
}

/// As [`with_device_tensor`] for a writable view: `f` may write the tensor.
///
/// # Errors
/// As [`with_device_tensor`].
pub(crate) fn with_device_tensor_mut<T>(
    buf: DeviceBufMut<'_>,
    f: impl FnOnce(&mut Tensor) -> T,
) -> Result<T> {
    let device = tch_device(buf.device())?;
    // SAFETY: as in `with_device_tensor`; the view is borrowed mutably, so no
    // other view of the memory is in use while `f` writes through the tensor.
    let mut t = unsafe { blob(buf.addr() as *const u8, buf.len(), buf.dtype(), device) }?;
    Ok(f(&mut t))
}

/// A 1-D tensor over a host view's memory, for the duration of `f`.
///
/// # Errors
/// [`ErrorKind::Unsupported`] for a dtype libtorch has no kind for.
pub(crate) fn with_host_tensor_mut<T>(
    buf: &mut HostBufMut<'_>,
    f: impl FnOnce(&mut Tensor) -> T,
) -> Result<T> {
    let (len, dtype) = (buf.len(), buf.dtype());
    let ptr = buf.bytes_mut().as_mut_ptr();
    // SAFETY: `ptr` addresses `len` elements of `dtype` borrowed mutably
    // from `buf` for this call; the tensor is dropped before we return.
    let mut t = unsafe { blob(ptr, len, dtype, tch::Device::Cpu) }?;
    Ok(f(&mut t))
}

/// As [`with_host_tensor_mut`], read-only.
///
/// # Errors
/// As [`with_host_tensor_mut`].
pub(crate) fn with_host_tensor<T>(buf: HostBuf<'_>, f: impl FnOnce(&Tensor) -> T) -> Result<T> {
    // SAFETY: `bytes` is borrowed for this call and holds `len` elements of
    // `dtype`; `f` only reads the tensor, which is dropped before we return.
    let t = unsafe {
        blob(
            buf.bytes().as_ptr(),
            buf.len(),
            buf.dtype(),
            tch::Device::Cpu,
        )
    }?;
    Ok(f(&t))
}

extern "C" {
    fn accel_tch_autocast_enter(
        cuda: i32,
        half: i32,
        prev_enabled: *mut i32,
        prev_dtype: *mut i32,
    ) -> i32;
    fn accel_tch_autocast_exit(cuda: i32, prev_enabled: i32, prev_dtype: i32) -> i32;
    fn accel_tch_autocast_enabled(cuda: i32) -> i32;
}

/// The state to restore when an autocast region ends.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AutocastPrev {
    cuda: i32,
    enabled: i32,
    dtype: i32,
}

/// Turn on libtorch's autocast for the CPU or CUDA with bf16 or f16.
///
/// # Errors
/// [`ErrorKind::Backend`] when libtorch refuses.
pub(crate) fn autocast_enter(cuda: bool, half: bool) -> Result<AutocastPrev> {
    let (mut enabled, mut dtype) = (0i32, 0i32);
    // SAFETY: the shim only reads its integer arguments and writes the two
    // out-pointers, which point at live locals; it catches every C++
    // exception.
    let rc = unsafe {
        accel_tch_autocast_enter(i32::from(cuda), i32::from(half), &mut enabled, &mut dtype)
    };
    if rc != 0 {
        return Err(Error::new(
            ErrorKind::Backend,
            "libtorch refused to enable autocast",
        ));
    }
    Ok(AutocastPrev {
        cuda: i32::from(cuda),
        enabled,
        dtype,
    })
}

/// End an autocast region begun by [`autocast_enter`].
pub(crate) fn autocast_exit(prev: AutocastPrev) {
    // SAFETY: plain integers in; the shim catches every C++ exception.
    let rc = unsafe { accel_tch_autocast_exit(prev.cuda, prev.enabled, prev.dtype) };
    if rc != 0 {
        tracing_warn("libtorch failed to restore the autocast state");
    }
}

/// Whether libtorch's autocast is on for the CPU (or CUDA).
pub fn autocast_enabled(cuda: bool) -> bool {
    // SAFETY: a plain integer in; the shim catches every C++ exception.
    unsafe { accel_tch_autocast_enabled(i32::from(cuda)) == 1 }
}

fn tracing_warn(msg: &str) {
    eprintln!("accel-tch: {msg}");
}
