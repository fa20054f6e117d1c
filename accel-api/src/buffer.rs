//! Typed buffer views. Collectives take these instead of generics so that
//! [`Communicator`](crate::Communicator) stays object-safe and can cross the
//! plugin boundary.

use std::marker::PhantomData;

use crate::{DType, Device, Element, Error, ErrorKind, Result};

/// A read-only view of host memory holding `len()` elements of `dtype()`.
///
/// Build it from any `&[T]` with `T: Element` (`HostBuf::from(&v[..])`) or
/// from raw bytes with [`HostBuf::from_bytes`].
#[derive(Debug, Clone, Copy)]
pub struct HostBuf<'a> {
    dtype: DType,
    bytes: &'a [u8],
}

/// A mutable view of host memory holding `len()` elements of `dtype()`.
#[derive(Debug)]
pub struct HostBufMut<'a> {
    dtype: DType,
    bytes: &'a mut [u8],
}

fn check_bytes(dtype: DType, ptr: *const u8, len: usize) -> Result<()> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{len} bytes is not a whole number of {dtype} elements ({} bytes each)",
                dtype.size()
            ),
        ));
    }
    if !(ptr as usize).is_multiple_of(dtype.size()) {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("byte buffer is not aligned for {dtype}"),
        )
        .with_fix("allocate the buffer as a slice of the element type"));
    }
    Ok(())
}

fn dtype_error(expected: DType, found: DType) -> Error {
    Error::new(
        ErrorKind::InvalidArgument,
        format!("buffer holds {found} elements, but {expected} was asked for"),
    )
}

/// The accessors [`HostBuf`] and [`HostBufMut`] share.
macro_rules! host_accessors {
    () => {
        /// Element type.
        pub fn dtype(&self) -> DType {
            self.dtype
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.bytes.len() / self.dtype.size()
        }

        /// `true` when the view holds no element.
        pub fn is_empty(&self) -> bool {
            self.bytes.is_empty()
        }
    };
}

impl<'a> HostBuf<'a> {
    /// View `bytes` as elements of `dtype`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when the length is not a multiple of the
    /// element size or the address is not aligned for `dtype`.
    pub fn from_bytes(dtype: DType, bytes: &'a [u8]) -> Result<HostBuf<'a>> {
        check_bytes(dtype, bytes.as_ptr(), bytes.len())?;
        Ok(HostBuf { dtype, bytes })
    }

    host_accessors!();

    /// The raw bytes (native endianness).
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Typed access.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `T` is not the view's element type.
    pub fn as_slice<T: Element>(&self) -> Result<&'a [T]> {
        if T::DTYPE != self.dtype {
            return Err(dtype_error(T::DTYPE, self.dtype));
        }
        Ok(bytemuck::cast_slice(self.bytes))
    }

    /// The sub-view of elements `start..start + len`.
    ///
    /// # Panics
    /// When the range is out of bounds (a caller bug, like slice indexing).
    pub fn slice(&self, start: usize, len: usize) -> HostBuf<'a> {
        let s = self.dtype.size();
        HostBuf {
            dtype: self.dtype,
            bytes: &self.bytes[start * s..(start + len) * s],
        }
    }
}

impl<'a> HostBufMut<'a> {
    /// View `bytes` as elements of `dtype`.
    ///
    /// # Errors
    /// As [`HostBuf::from_bytes`].
    pub fn from_bytes(dtype: DType, bytes: &'a mut [u8]) -> Result<HostBufMut<'a>> {
        check_bytes(dtype, bytes.as_ptr(), bytes.len())?;
        Ok(HostBufMut { dtype, bytes })
    }

    host_accessors!();

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes
    }

    /// The raw bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes
    }

    /// Consume the view, keeping the full lifetime of the bytes.
    pub fn into_bytes(self) -> &'a mut [u8] {
        self.bytes
    }

    /// A read-only view of the same memory.
    pub fn as_buf(&self) -> HostBuf<'_> {
        HostBuf {
            dtype: self.dtype,
            bytes: self.bytes,
        }
    }

    /// A shorter-lived mutable view of the same memory.
    pub fn reborrow(&mut self) -> HostBufMut<'_> {
        HostBufMut {
            dtype: self.dtype,
            bytes: self.bytes,
        }
    }

    /// Typed mutable access.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `T` is not the view's element type.
    pub fn as_mut_slice<T: Element>(&mut self) -> Result<&mut [T]> {
        if T::DTYPE != self.dtype {
            return Err(dtype_error(T::DTYPE, self.dtype));
        }
        Ok(bytemuck::cast_slice_mut(self.bytes))
    }

    /// Typed read access.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `T` is not the view's element type.
    pub fn as_slice<T: Element>(&self) -> Result<&[T]> {
        if T::DTYPE != self.dtype {
            return Err(dtype_error(T::DTYPE, self.dtype));
        }
        Ok(bytemuck::cast_slice(self.bytes))
    }
    /// Divide every element by `n` in place: the second half of
    /// [`ReduceOp::Avg`](crate::ReduceOp::Avg) for engines without a native
    /// average (sum, then divide). Integers truncate toward zero; f16 and
    /// bf16 are divided in f32 and rounded once; f32 and f64 round as the
    /// type rounds. Every backend uses this, so averages agree everywhere.
    ///
    /// # Panics
    /// When `n` is 0 (a group has at least one rank).
    pub fn divide_by(&mut self, n: usize) {
        self.divide(None, n);
    }

    /// Set every element to `src`'s element divided by `n`, in one pass:
    /// the same values as copying `src` in, then [`divide_by`](Self::divide_by).
    ///
    /// # Panics
    /// When `n` is 0, or `src` is not as long as this view or not aligned
    /// to its element type.
    pub fn assign_divided(&mut self, src: &[u8], n: usize) {
        assert_eq!(
            src.len(),
            self.bytes.len(),
            "assign_divided: lengths differ"
        );
        self.divide(Some(src), n);
    }

    fn divide(&mut self, src: Option<&[u8]>, n: usize) {
        assert!(n > 0, "divide_by(0)");
        fn each<T: Element>(b: &mut [u8], src: Option<&[u8]>, f: impl Fn(T) -> T) {
            let out = bytemuck::cast_slice_mut::<u8, T>(b);
            match src {
                None => out.iter_mut().for_each(|x| *x = f(*x)),
                Some(src) => out
                    .iter_mut()
                    .zip(bytemuck::cast_slice::<u8, T>(src))
                    .for_each(|(x, y)| *x = f(*y)),
            }
        }
        let b = &mut *self.bytes;
        match self.dtype {
            crate::DType::F16 => each(b, src, |x: half::f16| {
                half::f16::from_f32(x.to_f32() / n as f32)
            }),
            crate::DType::BF16 => each(b, src, |x: half::bf16| {
                half::bf16::from_f32(x.to_f32() / n as f32)
            }),
            crate::DType::F32 => each(b, src, |x: f32| x / n as f32),
            crate::DType::F64 => each(b, src, |x: f64| x / n as f64),
            crate::DType::I8 => each(b, src, |x: i8| (i64::from(x) / n as i64) as i8),
            crate::DType::U8 => each(b, src, |x: u8| (u64::from(x) / n as u64) as u8),
            crate::DType::I32 => each(b, src, |x: i32| (i64::from(x) / n as i64) as i32),
            crate::DType::I64 => each(b, src, |x: i64| x / n as i64),
        }
    }
}

impl<'a, T: Element> From<&'a [T]> for HostBuf<'a> {
    fn from(v: &'a [T]) -> Self {
        HostBuf {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice(v),
        }
    }
}

impl<'a, T: Element> From<&'a mut [T]> for HostBufMut<'a> {
    fn from(v: &'a mut [T]) -> Self {
        HostBufMut {
            dtype: T::DTYPE,
            bytes: bytemuck::cast_slice_mut(v),
        }
    }
}

/// A read-only view of device memory: address, element count, element
/// type, device and the stream (or queue) the memory is ordered on.
///
/// The view borrows whatever owns the memory (a tch tensor, a cudarc slice,
/// a PJRT buffer) for `'a`, so it cannot outlive it:
///
/// ```compile_fail,E0597
/// use accel_api::{DType, Device, DeviceBuf, DeviceKind};
/// let view;
/// {
///     // Stands for a device allocation: a tensor, a cudarc slice, ...
///     let owner = vec![0f32; 4];
///     // SAFETY (of the example): pretend `owner` is 4 f32 on cuda:0.
///     view = unsafe { DeviceBuf::from_raw(&owner, 0x1000, 4, DType::F32, Device::new(DeviceKind::Cuda, 0), 0) };
/// } // `owner` is dropped here while `view` still borrows it: does not compile
/// assert_eq!(view.len(), 4);
/// ```
///
/// Views are built by the adapter that owns the allocation (a framework
/// integration or the backend itself), through [`DeviceBuf::from_raw`],
/// which is `unsafe` because nothing here can check that the address is
/// real. A backend dereferences the address only on the device it was
/// connected to and only during the call; it declares the device kinds it
/// accepts in [`Capabilities::device_kinds`](crate::Capabilities::device_kinds),
/// and a communicator whose engine takes only host memory returns
/// [`ErrorKind::Unsupported`] for every device view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuf<'a> {
    raw: RawDevice,
    _owner: PhantomData<&'a ()>,
}

/// A writable view of device memory; like [`DeviceBuf`], but borrowing
/// its owner mutably, so that no other view of the memory exists while an
/// engine writes into it.
///
/// ```compile_fail,E0499
/// use accel_api::{DType, Device, DeviceBufMut, DeviceKind};
/// let mut owner = vec![0f32; 4];
/// // SAFETY (of the example): pretend `owner` is 4 f32 on cuda:0.
/// let view = unsafe { DeviceBufMut::from_raw(&mut owner, 0x1000, 4, DType::F32, Device::new(DeviceKind::Cuda, 0), 0) };
/// owner.push(1.0); // the owner cannot change while the view lives: does not compile
/// assert_eq!(view.len(), 4);
/// ```
#[derive(Debug, PartialEq, Eq)]
pub struct DeviceBufMut<'a> {
    raw: RawDevice,
    _owner: PhantomData<&'a mut ()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RawDevice {
    addr: u64,
    len: usize,
    dtype: DType,
    device: Device,
    stream: u64,
}

macro_rules! device_accessors {
    () => {
        /// Device address of the first element.
        pub fn addr(&self) -> u64 {
            self.raw.addr
        }

        /// Number of elements.
        pub fn len(&self) -> usize {
            self.raw.len
        }

        /// `true` when the view holds no element.
        pub fn is_empty(&self) -> bool {
            self.raw.len == 0
        }

        /// Element type.
        pub fn dtype(&self) -> DType {
            self.raw.dtype
        }

        /// The device holding the memory.
        pub fn device(&self) -> Device {
            self.raw.device
        }

        /// Engine stream (CUDA stream, ACL stream, ...) the memory is
        /// ordered on; 0 is the engine's default stream.
        pub fn stream(&self) -> u64 {
            self.raw.stream
        }

        /// Size in bytes.
        pub fn size_bytes(&self) -> usize {
            self.raw.len * self.raw.dtype.size()
        }
    };
}

impl<'a> DeviceBuf<'a> {
    /// A view of `len` elements of `dtype` at device address `addr` on
    /// `device`, ordered on `stream`, borrowing `owner` (the object that
    /// owns the allocation) for the view's lifetime.
    ///
    /// # Safety
    /// `addr` must point to at least `len * dtype.size()` bytes of memory on
    /// `device` that `owner` keeps alive and does not write while the view
    /// exists, and `stream` must be a stream of that device (or 0).
    ///
    /// ```
    /// use accel_api::{Buf, DType, Device, DeviceBuf, DeviceKind};
    /// let owner = vec![0f32; 4];
    /// // SAFETY (of the example): the view is only inspected, never dereferenced.
    /// let view = unsafe {
    ///     DeviceBuf::from_raw(&owner, 0x1000, 4, DType::F32, Device::new(DeviceKind::Cuda, 0), 0)
    /// };
    /// assert_eq!(Buf::from(view).len(), 4);
    /// ```
    #[allow(unsafe_code)] // a constructor that only stores its arguments
    pub unsafe fn from_raw<O: ?Sized>(
        owner: &'a O,
        addr: u64,
        len: usize,
        dtype: DType,
        device: Device,
        stream: u64,
    ) -> DeviceBuf<'a> {
        let _ = owner;
        DeviceBuf {
            raw: RawDevice {
                addr,
                len,
                dtype,
                device,
                stream,
            },
            _owner: PhantomData,
        }
    }

    device_accessors!();
}

impl<'a> DeviceBufMut<'a> {
    /// A writable view of `len` elements of `dtype` at device address
    /// `addr` on `device`, ordered on `stream`, borrowing `owner` mutably
    /// for the view's lifetime.
    ///
    /// # Safety
    /// As [`DeviceBuf::from_raw`], and no other view of the memory may be
    /// used while this one exists.
    #[allow(unsafe_code)] // a constructor that only stores its arguments
    pub unsafe fn from_raw<O: ?Sized>(
        owner: &'a mut O,
        addr: u64,
        len: usize,
        dtype: DType,
        device: Device,
        stream: u64,
    ) -> DeviceBufMut<'a> {
        let _ = owner;
        DeviceBufMut {
            raw: RawDevice {
                addr,
                len,
                dtype,
                device,
                stream,
            },
            _owner: PhantomData,
        }
    }

    device_accessors!();

    /// A shorter-lived writable view of the same memory.
    pub fn reborrow(&mut self) -> DeviceBufMut<'_> {
        DeviceBufMut {
            raw: self.raw,
            _owner: PhantomData,
        }
    }

    /// A read-only view of the same memory.
    pub fn as_buf(&self) -> DeviceBuf<'_> {
        DeviceBuf {
            raw: self.raw,
            _owner: PhantomData,
        }
    }
}

/// A read-only buffer argument: host or device memory.
#[derive(Debug, Clone, Copy)]
pub enum Buf<'a> {
    /// Host memory.
    Host(HostBuf<'a>),
    /// Device memory.
    Device(DeviceBuf<'a>),
}

/// A writable buffer argument: host or device memory.
#[derive(Debug)]
pub enum BufMut<'a> {
    /// Host memory.
    Host(HostBufMut<'a>),
    /// Device memory.
    Device(DeviceBufMut<'a>),
}

impl<'a> Buf<'a> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Buf::Host(h) => h.dtype(),
            Buf::Device(d) => d.dtype(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Buf::Host(h) => h.len(),
            Buf::Device(d) => d.len(),
        }
    }

    /// `true` when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory is.
    pub fn device(&self) -> Device {
        match self {
            Buf::Host(_) => Device::CPU,
            Buf::Device(d) => d.device(),
        }
    }

    /// The host view, if this is host memory.
    pub fn host(&self) -> Option<HostBuf<'a>> {
        match self {
            Buf::Host(h) => Some(*h),
            Buf::Device(_) => None,
        }
    }
}

impl<'a> BufMut<'a> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            BufMut::Host(h) => h.dtype(),
            BufMut::Device(d) => d.dtype(),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            BufMut::Host(h) => h.len(),
            BufMut::Device(d) => d.len(),
        }
    }

    /// `true` when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory is.
    pub fn device(&self) -> Device {
        match self {
            BufMut::Host(_) => Device::CPU,
            BufMut::Device(d) => d.device(),
        }
    }

    /// A shorter-lived view of the same memory.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::Host(h) => BufMut::Host(h.reborrow()),
            BufMut::Device(d) => BufMut::Device(d.reborrow()),
        }
    }

    /// A read-only view of the same memory.
    pub fn as_buf(&self) -> Buf<'_> {
        match self {
            BufMut::Host(h) => Buf::Host(h.as_buf()),
            BufMut::Device(d) => Buf::Device(d.as_buf()),
        }
    }

    /// The host view, if this is host memory.
    pub fn into_host(self) -> Option<HostBufMut<'a>> {
        match self {
            BufMut::Host(h) => Some(h),
            BufMut::Device(_) => None,
        }
    }
}

impl<'a> From<HostBuf<'a>> for Buf<'a> {
    fn from(h: HostBuf<'a>) -> Self {
        Buf::Host(h)
    }
}

impl<'a> From<HostBufMut<'a>> for BufMut<'a> {
    fn from(h: HostBufMut<'a>) -> Self {
        BufMut::Host(h)
    }
}

impl<'a, T: Element> From<&'a [T]> for Buf<'a> {
    fn from(v: &'a [T]) -> Self {
        Buf::Host(v.into())
    }
}

impl<'a, T: Element> From<&'a mut [T]> for BufMut<'a> {
    fn from(v: &'a mut [T]) -> Self {
        BufMut::Host(v.into())
    }
}

impl<'a, T: Element> From<&'a Vec<T>> for Buf<'a> {
    fn from(v: &'a Vec<T>) -> Self {
        Buf::Host(v.as_slice().into())
    }
}

impl<'a, T: Element> From<&'a mut Vec<T>> for BufMut<'a> {
    fn from(v: &'a mut Vec<T>) -> Self {
        BufMut::Host(v.as_mut_slice().into())
    }
}

impl<'a> From<DeviceBuf<'a>> for Buf<'a> {
    fn from(d: DeviceBuf<'a>) -> Self {
        Buf::Device(d)
    }
}

impl<'a> From<DeviceBufMut<'a>> for BufMut<'a> {
    fn from(d: DeviceBufMut<'a>) -> Self {
        BufMut::Device(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_views_keep_dtype_and_length() {
        let mut v = vec![1.0f32, 2.0, 3.0];
        let b = BufMut::from(&mut v);
        assert_eq!(b.dtype(), DType::F32);
        assert_eq!(b.len(), 3);
        let mut h = b.into_host().unwrap();
        h.as_mut_slice::<f32>().unwrap()[1] = 5.0;
        assert!(h.as_mut_slice::<i32>().is_err());
        assert_eq!(v, vec![1.0, 5.0, 3.0]);
    }

    #[test]
    fn assign_divided_is_a_copy_then_divide_by() {
        let src: Vec<f32> = (0..37).map(|i| i as f32 * 0.7 - 9.1).collect();
        let mut copied = src.clone();
        HostBufMut::from(&mut copied[..]).divide_by(3);
        let mut out = vec![0f32; 37];
        HostBufMut::from(&mut out[..]).assign_divided(bytemuck::cast_slice(&src), 3);
        assert_eq!(out, copied);
        let src = [-7i32, 7, 5];
        let mut out = [0i32; 3];
        HostBufMut::from(&mut out[..]).assign_divided(bytemuck::cast_slice(&src), 2);
        assert_eq!(out, [-3, 3, 2]);
    }

    #[test]
    fn divide_by_truncates_integers_and_rounds_floats_once() {
        let mut i = vec![-7i32, 7, 5];
        HostBufMut::from(&mut i[..]).divide_by(2);
        assert_eq!(i, vec![-3, 3, 2]);
        let mut u = vec![255u8, 1];
        HostBufMut::from(&mut u[..]).divide_by(4);
        assert_eq!(u, vec![63, 0]);
        let mut h = [half::f16::from_f32(1.0), half::f16::from_f32(-3.0)];
        HostBufMut::from(&mut h[..]).divide_by(3);
        assert_eq!(h[0], half::f16::from_f32(1.0 / 3.0));
        assert_eq!(h[1], half::f16::from_f32(-1.0));
        let mut f = [1.0f64];
        HostBufMut::from(&mut f[..]).divide_by(4);
        assert_eq!(f, [0.25]);
    }

    #[test]
    fn from_bytes_rejects_ragged_length() {
        let bytes = [0u8; 6];
        let err = HostBuf::from_bytes(DType::F32, &bytes[..6]).unwrap_err();
        assert!(err.to_string().contains("6 bytes"), "{err}");
        let v = [0u32; 2];
        let ok = HostBuf::from_bytes(DType::F32, bytemuck::cast_slice(&v)).unwrap();
        assert_eq!(ok.len(), 2);
        assert_eq!(ok.slice(1, 1).len(), 1);
    }
}
