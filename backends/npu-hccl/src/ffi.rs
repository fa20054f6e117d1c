//! Every call into `libascendcl.so` and `libhccl.so`, and every `unsafe`
//! block of the crate.
//!
//! The libraries are opened at run time with `libloading` (AscendCL with
//! `RTLD_GLOBAL` first, because HCCL resolves runtime symbols from it) and
//! never closed: a [`Runtime`] lives in the process-wide cache of the probe
//! for the rest of the process. Each function the backend calls is resolved
//! once into a table of function pointers typed after the public headers
//! (`acl/acl_rt.h`, `acl/acl.h`, `hccl/hccl.h`, `hccl/hccl_types.h`); a
//! missing symbol is an error naming it, so an old CANN is "unavailable",
//! not a crash.
//!
//! Handles are newtypes whose `Drop` releases them ([`Stream`], [`Comm`],
//! [`DevMem`]), except after a failure that may leave the device still
//! working on them (a timeout, an asynchronous HCCL error): then they are
//! leaked on purpose, because destroying a communicator or freeing memory
//! under a running kernel can hang or corrupt the process.
//!
//! Device addresses reach the libraries only as [`DevPtr`]s, built from a
//! [`DeviceBuf`]/[`DeviceBufMut`] (whose `unsafe` constructor vouched for
//! the address) or from a [`DevMem`] this module allocated; every wrapper
//! checks that the region is large enough for the element count it passes.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use accel_api::{DType, Device, DeviceBuf, DeviceBufMut};
use libloading::os::unix::{Library as UnixLibrary, RTLD_GLOBAL, RTLD_LOCAL, RTLD_NOW};
use libloading::Library;

use crate::error::HcclError;

/// Size of `HcclRootInfo` (`HCCL_ROOT_INFO_BYTES` in `hccl_types.h`).
pub(crate) const ROOT_INFO_BYTES: usize = 4108;
/// `ACL_ERROR_REPEAT_INITIALIZE`: `aclInit` was already called in this
/// process (by accel or by a framework such as torch_npu); not a failure.
pub(crate) const ACL_ERROR_REPEAT_INITIALIZE: c_int = 100002;
const ACL_STREAM_STATUS_COMPLETE: c_int = 0;
const ACL_MEM_MALLOC_HUGE_FIRST: c_int = 0;
const ACL_MEMCPY_HOST_TO_DEVICE: c_int = 1;
const ACL_MEMCPY_DEVICE_TO_HOST: c_int = 2;
const ACL_MEMCPY_DEVICE_TO_DEVICE: c_int = 3;

type Handle = *mut c_void;

/// A handle the libraries made (device memory, a stream, a communicator),
/// owned by the type that holds it, which frees it once, in `Drop`. It
/// prints as `Raw`, never its address.
struct Raw(Handle);

// SAFETY: AscendCL and HCCL handles are not tied to the thread that made
// them: memory, streams and communicators may be used and freed from any
// thread bound to their device, and the group serialises every call on
// them. The holders' `&self` methods only pass the handle to the libraries
// (writes to device memory go through the runtime's copy functions).
unsafe impl Send for Raw {}
// SAFETY: as for `Send`.
unsafe impl Sync for Raw {}

/// What a drop can do about a failed free or destroy: say so.
fn warn_on_failure(rc: c_int, what: &str) {
    if rc != 0 {
        tracing::warn!(rc, "{what}");
    }
}

impl std::fmt::Debug for Raw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Raw")
    }
}

/// A table of C functions resolved from one library by name.
macro_rules! table {
    ($name:ident { $($field:ident = $sym:literal : fn($($arg:ty),*) -> $ret:ty;)* }) => {
        #[derive(Clone, Copy)]
        struct $name {
            $($field: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl $name {
            /// Every symbol of the table, in order.
            const SYMBOLS: &'static [&'static str] = &[$($sym),*];

            fn resolve(lib: &Library, path: &Path) -> Result<$name, HcclError> {
                Ok($name {
                    $($field: {
                        // SAFETY: the pointer type is the symbol's C
                        // prototype from the public CANN headers, and the
                        // library outlives the table (never unloaded).
                        let sym = unsafe {
                            lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                                concat!($sym, "\0").as_bytes(),
                            )
                        };
                        *sym.map_err(|e| HcclError::Symbol {
                            library: path.display().to_string(),
                            symbol: $sym,
                            detail: e.to_string(),
                        })?
                    },)*
                })
            }
        }
    };
}

table!(Acl {
    init = "aclInit": fn(*const c_char) -> c_int;
    set_device = "aclrtSetDevice": fn(i32) -> c_int;
    device_count = "aclrtGetDeviceCount": fn(*mut u32) -> c_int;
    version = "aclrtGetVersion": fn(*mut i32, *mut i32, *mut i32) -> c_int;
    create_stream = "aclrtCreateStream": fn(*mut Handle) -> c_int;
    destroy_stream = "aclrtDestroyStream": fn(Handle) -> c_int;
    stream_query = "aclrtStreamQuery": fn(Handle, *mut c_int) -> c_int;
    malloc = "aclrtMalloc": fn(*mut Handle, usize, c_int) -> c_int;
    free = "aclrtFree": fn(Handle) -> c_int;
    memcpy = "aclrtMemcpy": fn(Handle, usize, *const c_void, usize, c_int) -> c_int;
    recent_err_msg = "aclGetRecentErrMsg": fn() -> *const c_char;
});

table!(Hccl {
    get_root_info = "HcclGetRootInfo": fn(*mut u8) -> c_int;
    comm_init_root_info = "HcclCommInitRootInfo": fn(u32, *const u8, u32, *mut Handle) -> c_int;
    comm_destroy = "HcclCommDestroy": fn(Handle) -> c_int;
    all_reduce = "HcclAllReduce": fn(Handle, Handle, u64, c_int, c_int, Handle, Handle) -> c_int;
    broadcast = "HcclBroadcast": fn(Handle, u64, c_int, u32, Handle, Handle) -> c_int;
    all_gather = "HcclAllGather": fn(Handle, Handle, u64, c_int, Handle, Handle) -> c_int;
    reduce_scatter = "HcclReduceScatter": fn(Handle, Handle, u64, c_int, c_int, Handle, Handle) -> c_int;
    reduce = "HcclReduce": fn(Handle, Handle, u64, c_int, c_int, u32, Handle, Handle) -> c_int;
    scatter = "HcclScatter": fn(Handle, Handle, u64, c_int, u32, Handle, Handle) -> c_int;
    all_to_all = "HcclAlltoAll": fn(*const c_void, u64, c_int, *const c_void, u64, c_int, Handle, Handle) -> c_int;
    send = "HcclSend": fn(Handle, u64, c_int, u32, Handle, Handle) -> c_int;
    recv = "HcclRecv": fn(Handle, u64, c_int, u32, Handle, Handle) -> c_int;
    barrier = "HcclBarrier": fn(Handle, Handle) -> c_int;
    async_error = "HcclGetCommAsyncError": fn(Handle, *mut c_int) -> c_int;
    error_string = "HcclGetErrorString": fn(c_int) -> *const c_char;
});

/// The AscendCL symbols the backend resolves, for docs and tests.
pub(crate) fn acl_symbols() -> &'static [&'static str] {
    Acl::SYMBOLS
}

/// The HCCL symbols the backend resolves, for docs and tests.
pub(crate) fn hccl_symbols() -> &'static [&'static str] {
    Hccl::SYMBOLS
}

/// Open the shared object at `path` (a path or a bare name for the
/// dynamic loader's search), `RTLD_NOW`, global when `global`.
pub(crate) fn open_library(path: &Path, global: bool) -> Result<Library, String> {
    let flags = RTLD_NOW | if global { RTLD_GLOBAL } else { RTLD_LOCAL };
    // SAFETY: opening runs the library's initialisers. The libraries opened
    // here are AscendCL and HCCL (or stand-ins with the same C interface),
    // whose initialisers only set up their own state; nothing in this
    // process depends on the symbols they export except through the tables
    // above.
    unsafe { UnixLibrary::open(Some(path), flags) }
        .map(Library::from)
        .map_err(|e| e.to_string())
}

/// Text behind a C string pointer the libraries return (or `None`).
fn text(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the libraries return NUL-terminated strings that stay valid
    // at least until the next call on this thread; the text is copied out.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// The loaded libraries and their function tables.
pub(crate) struct Runtime {
    acl: Acl,
    hccl: Hccl,
    acl_path: PathBuf,
    hccl_path: PathBuf,
    init: OnceLock<Result<(), HcclError>>,
    // Kept so that the function pointers stay valid; a runtime is never
    // dropped (the probe caches it for the life of the process).
    _libs: (Library, Library),
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("acl", &self.acl_path)
            .field("hccl", &self.hccl_path)
            .finish_non_exhaustive()
    }
}

thread_local! {
    /// The device this thread last bound, per runtime (by address).
    static BOUND: RefCell<Vec<(usize, i32)>> = const { RefCell::new(Vec::new()) };
}

impl Runtime {
    /// Resolve every symbol of both libraries.
    pub(crate) fn new(
        acl_lib: Library,
        acl_path: PathBuf,
        hccl_lib: Library,
        hccl_path: PathBuf,
    ) -> Result<Runtime, HcclError> {
        let acl = Acl::resolve(&acl_lib, &acl_path)?;
        let hccl = Hccl::resolve(&hccl_lib, &hccl_path)?;
        Ok(Runtime {
            acl,
            hccl,
            acl_path,
            hccl_path,
            init: OnceLock::new(),
            _libs: (acl_lib, hccl_lib),
        })
    }

    /// Where AscendCL was loaded from.
    pub(crate) fn acl_path(&self) -> &Path {
        &self.acl_path
    }

    /// Where HCCL was loaded from.
    pub(crate) fn hccl_path(&self) -> &Path {
        &self.hccl_path
    }

    fn acl_message(&self) -> Option<String> {
        // SAFETY: `aclGetRecentErrMsg` takes nothing and returns a string
        // owned by AscendCL (or NULL).
        text(unsafe { (self.acl.recent_err_msg)() })
    }

    fn acl_check(&self, call: &'static str, rc: c_int) -> Result<(), HcclError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(HcclError::acl(call, rc, self.acl_message()))
        }
    }

    fn hccl_check(&self, call: &'static str, rc: c_int) -> Result<(), HcclError> {
        if rc == 0 {
            Ok(())
        } else {
            Err(HcclError::hccl(call, rc, self.hccl_text(rc)))
        }
    }

    /// HCCL's description of `code`.
    pub(crate) fn hccl_text(&self, code: i32) -> Option<String> {
        // SAFETY: `HcclGetErrorString` maps any code to a static string.
        text(unsafe { (self.hccl.error_string)(code) })
    }

    /// `aclInit(NULL)`, once per runtime; "already initialised" is success.
    pub(crate) fn init(&self) -> Result<(), HcclError> {
        self.init
            .get_or_init(|| {
                // SAFETY: NULL asks for the default configuration.
                let rc = unsafe { (self.acl.init)(std::ptr::null()) };
                if rc == ACL_ERROR_REPEAT_INITIALIZE {
                    Ok(())
                } else {
                    self.acl_check("aclInit", rc)
                }
            })
            .clone()
    }

    /// `aclrtGetDeviceCount`: devices visible to the process (AscendCL
    /// already applies `ASCEND_RT_VISIBLE_DEVICES`).
    pub(crate) fn device_count(&self) -> Result<u32, HcclError> {
        let mut n = 0u32;
        // SAFETY: `n` is a valid out-pointer for the call.
        let rc = unsafe { (self.acl.device_count)(&mut n) };
        self.acl_check("aclrtGetDeviceCount", rc)?;
        Ok(n)
    }

    /// AscendCL's interface version, `major.minor.patch`.
    pub(crate) fn version(&self) -> Option<String> {
        let (mut a, mut b, mut c) = (0i32, 0i32, 0i32);
        // SAFETY: three valid out-pointers.
        let rc = unsafe { (self.acl.version)(&mut a, &mut b, &mut c) };
        (rc == 0).then(|| format!("{a}.{b}.{c}"))
    }

    /// `aclrtSetDevice(device)` in the calling thread, unless this thread
    /// already did for this runtime (AscendCL's device context is per
    /// thread; every engine call goes through here first).
    pub(crate) fn bind(&self, device: i32) -> Result<(), HcclError> {
        let me = self as *const Runtime as usize;
        let bound = BOUND.with(|b| b.borrow().iter().any(|&(r, d)| r == me && d == device));
        if bound {
            return Ok(());
        }
        // SAFETY: plain integer argument; AscendCL checks the id.
        let rc = unsafe { (self.acl.set_device)(device) };
        self.acl_check("aclrtSetDevice", rc)?;
        BOUND.with(|b| {
            let mut b = b.borrow_mut();
            b.retain(|&(r, _)| r != me);
            b.push((me, device));
        });
        Ok(())
    }

    /// `true` when every task on the stream `raw` finished (`raw` is the
    /// stream of a device view, ordered on the view's device).
    pub(crate) fn stream_done(&self, raw: u64) -> Result<bool, HcclError> {
        let mut status: c_int = -1;
        // SAFETY: `raw` is a stream of this device per the contract of the
        // view's `unsafe` constructor; `status` is a valid out-pointer.
        let rc = unsafe { (self.acl.stream_query)(raw as usize as Handle, &mut status) };
        self.acl_check("aclrtStreamQuery", rc)?;
        Ok(status == ACL_STREAM_STATUS_COMPLETE)
    }

    /// Copy host bytes into device memory.
    pub(crate) fn h2d(&self, dst: DevPtr, src: &[u8]) -> Result<(), HcclError> {
        if src.is_empty() {
            return Ok(());
        }
        dst.fits(src.len(), "aclrtMemcpy destination")?;
        // SAFETY: `dst` holds at least `src.len()` bytes (checked above),
        // `src` is a live host slice.
        let rc = unsafe {
            (self.acl.memcpy)(
                dst.raw(),
                dst.bytes,
                src.as_ptr().cast(),
                src.len(),
                ACL_MEMCPY_HOST_TO_DEVICE,
            )
        };
        self.acl_check("aclrtMemcpy", rc)
    }

    /// Copy device memory into host bytes.
    pub(crate) fn d2h(&self, dst: &mut [u8], src: DevPtr) -> Result<(), HcclError> {
        if dst.is_empty() {
            return Ok(());
        }
        src.fits(dst.len(), "aclrtMemcpy source")?;
        // SAFETY: `src` holds at least `dst.len()` bytes (checked above),
        // `dst` is a live, exclusively borrowed host slice.
        let rc = unsafe {
            (self.acl.memcpy)(
                dst.as_mut_ptr().cast(),
                dst.len(),
                src.raw(),
                dst.len(),
                ACL_MEMCPY_DEVICE_TO_HOST,
            )
        };
        self.acl_check("aclrtMemcpy", rc)
    }

    /// Copy `bytes` bytes between device regions.
    pub(crate) fn d2d(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), HcclError> {
        if bytes == 0 {
            return Ok(());
        }
        dst.fits(bytes, "aclrtMemcpy destination")?;
        src.fits(bytes, "aclrtMemcpy source")?;
        // SAFETY: both regions hold at least `bytes` bytes (checked above).
        let rc = unsafe {
            (self.acl.memcpy)(
                dst.raw(),
                dst.bytes,
                src.raw(),
                bytes,
                ACL_MEMCPY_DEVICE_TO_DEVICE,
            )
        };
        self.acl_check("aclrtMemcpy", rc)
    }
}

/// A device region handed to the libraries: an address and its size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DevPtr {
    addr: u64,
    bytes: usize,
}

impl DevPtr {
    /// The region of a read-only device view.
    pub(crate) fn of(view: &DeviceBuf<'_>) -> DevPtr {
        DevPtr {
            addr: view.addr(),
            bytes: view.size_bytes(),
        }
    }

    /// The region of a writable device view.
    pub(crate) fn of_mut(view: &DeviceBufMut<'_>) -> DevPtr {
        DevPtr {
            addr: view.addr(),
            bytes: view.size_bytes(),
        }
    }

    /// Size in bytes.
    pub(crate) fn bytes(self) -> usize {
        self.bytes
    }

    fn fits(self, bytes: usize, what: &str) -> Result<(), HcclError> {
        if bytes <= self.bytes {
            Ok(())
        } else {
            Err(HcclError::Internal {
                detail: format!(
                    "{what} needs {bytes} bytes, the region holds {}",
                    self.bytes
                ),
            })
        }
    }

    fn raw(self) -> Handle {
        self.addr as usize as Handle
    }
}

/// Device memory allocated by the backend (staging copies of host buffers,
/// scratch space); freed on drop unless `leak` was raised.
#[derive(Debug)]
pub(crate) struct DevMem {
    rt: Arc<Runtime>,
    ptr: Raw,
    bytes: usize,
    leak: Arc<AtomicBool>,
}

impl DevMem {
    /// `bytes` bytes of device memory on the calling thread's device
    /// (nothing is allocated for 0 bytes). When `leak` is raised before the
    /// drop, the memory is not freed (the device may still write it).
    pub(crate) fn alloc(
        rt: &Arc<Runtime>,
        bytes: usize,
        leak: &Arc<AtomicBool>,
    ) -> Result<DevMem, HcclError> {
        let mut ptr: Handle = std::ptr::null_mut();
        if bytes > 0 {
            // SAFETY: `ptr` is a valid out-pointer; the size is non-zero.
            let rc = unsafe { (rt.acl.malloc)(&mut ptr, bytes, ACL_MEM_MALLOC_HUGE_FIRST) };
            rt.acl_check("aclrtMalloc", rc)?;
        }
        Ok(DevMem {
            rt: rt.clone(),
            ptr: Raw(ptr),
            bytes,
            leak: leak.clone(),
        })
    }

    /// The whole region.
    pub(crate) fn ptr(&self) -> DevPtr {
        DevPtr {
            addr: self.ptr.0 as usize as u64,
            bytes: self.bytes,
        }
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        if !self.ptr.0.is_null() && !self.leak.load(Ordering::SeqCst) {
            // SAFETY: `ptr` came from `aclrtMalloc` and is freed once; no
            // task uses it any more (the stream finished, or `leak` would be
            // set).
            let rc = unsafe { (self.rt.acl.free)(self.ptr.0) };
            warn_on_failure(rc, "aclrtFree failed; the memory is lost");
        }
    }
}

/// Device memory owned by the caller: `len` elements of `dtype` on one NPU,
/// freed on drop. Made by [`NpuEngine::alloc`](crate::NpuEngine::alloc);
/// its views borrow it, so they cannot outlive it.
#[derive(Debug)]
pub struct NpuBuffer {
    mem: DevMem,
    len: usize,
    dtype: DType,
    device: Device,
}

impl NpuBuffer {
    /// Wrap `mem`, which holds at least `len` elements of `dtype` on
    /// `device`.
    pub(crate) fn new(
        mem: DevMem,
        len: usize,
        dtype: DType,
        device: Device,
    ) -> Result<NpuBuffer, HcclError> {
        mem.ptr().fits(len * dtype.size(), "device buffer")?;
        Ok(NpuBuffer {
            mem,
            len,
            dtype,
            device,
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The NPU holding the memory.
    pub fn device(&self) -> Device {
        self.device
    }

    pub(crate) fn region(&self) -> DevPtr {
        self.mem.ptr()
    }

    /// A read-only view for collectives (ordered on the default stream:
    /// the backend waits for its own stream before returning).
    pub fn view(&self) -> DeviceBuf<'_> {
        // SAFETY: `self.mem` holds `len` elements of `dtype` on `device`
        // (checked in `new`) and lives as long as the borrow of `self`.
        unsafe {
            DeviceBuf::from_raw(
                self,
                self.mem.ptr().addr,
                self.len,
                self.dtype,
                self.device,
                0,
            )
        }
    }

    /// A writable view for collectives.
    pub fn view_mut(&mut self) -> DeviceBufMut<'_> {
        let (addr, len, dtype, device) = (self.mem.ptr().addr, self.len, self.dtype, self.device);
        // SAFETY: as in `view`; the mutable borrow of `self` keeps every
        // other view away while this one lives.
        unsafe { DeviceBufMut::from_raw(self, addr, len, dtype, device, 0) }
    }
}

/// An AscendCL stream, destroyed on drop unless leaked.
pub(crate) struct Stream {
    rt: Arc<Runtime>,
    raw: Raw,
    leak: AtomicBool,
}

impl Stream {
    /// A new stream on the calling thread's device.
    pub(crate) fn new(rt: &Arc<Runtime>) -> Result<Stream, HcclError> {
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        let rc = unsafe { (rt.acl.create_stream)(&mut raw) };
        rt.acl_check("aclrtCreateStream", rc)?;
        Ok(Stream {
            rt: rt.clone(),
            raw: Raw(raw),
            leak: AtomicBool::new(false),
        })
    }

    /// `true` when every task enqueued on the stream finished.
    pub(crate) fn is_done(&self) -> Result<bool, HcclError> {
        self.rt.stream_done(self.raw.0 as usize as u64)
    }

    /// Do not destroy the stream on drop (tasks may still be pending).
    pub(crate) fn leak_on_drop(&self) {
        self.leak.store(true, Ordering::SeqCst);
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.leak.load(Ordering::SeqCst) {
            // SAFETY: the stream came from `aclrtCreateStream`, is idle
            // (every call waited for it) and is destroyed once.
            let rc = unsafe { (self.rt.acl.destroy_stream)(self.raw.0) };
            warn_on_failure(rc, "aclrtDestroyStream failed");
        }
    }
}

/// The bytes of a fresh `HcclRootInfo` (call on the group's first rank,
/// with its device bound).
pub(crate) fn root_info(rt: &Runtime) -> Result<Vec<u8>, HcclError> {
    let mut info = vec![0u8; ROOT_INFO_BYTES];
    // SAFETY: `info` holds the `HCCL_ROOT_INFO_BYTES` bytes of the struct.
    let rc = unsafe { (rt.hccl.get_root_info)(info.as_mut_ptr()) };
    rt.hccl_check("HcclGetRootInfo", rc)?;
    Ok(info)
}

/// An HCCL communicator, destroyed on drop unless leaked.
pub(crate) struct Comm {
    rt: Arc<Runtime>,
    raw: Raw,
    rank: u32,
    ranks: u32,
    leak: AtomicBool,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm(rank {} of {})", self.rank, self.ranks)
    }
}

impl Comm {
    /// `HcclCommInitRootInfo(ranks, root, rank)`: blocks until every rank
    /// joined (bounded by `HCCL_CONNECT_TIMEOUT`).
    pub(crate) fn init(
        rt: &Arc<Runtime>,
        ranks: u32,
        root: &[u8],
        rank: u32,
    ) -> Result<Comm, HcclError> {
        if root.len() != ROOT_INFO_BYTES {
            return Err(HcclError::Corrupt {
                detail: format!(
                    "the HCCL root info holds {} bytes, HCCL writes {ROOT_INFO_BYTES}",
                    root.len()
                ),
            });
        }
        let mut raw: Handle = std::ptr::null_mut();
        // SAFETY: `root` holds a whole `HcclRootInfo` (checked above) and
        // `raw` is a valid out-pointer.
        let rc = unsafe { (rt.hccl.comm_init_root_info)(ranks, root.as_ptr(), rank, &mut raw) };
        rt.hccl_check("HcclCommInitRootInfo", rc)?;
        Ok(Comm {
            rt: rt.clone(),
            raw: Raw(raw),
            rank,
            ranks,
            leak: AtomicBool::new(false),
        })
    }

    /// Do not destroy the communicator on drop (tasks may be pending).
    pub(crate) fn leak_on_drop(&self) {
        self.leak.store(true, Ordering::SeqCst);
    }

    /// `HcclGetCommAsyncError`: 0 while the communicator is healthy.
    pub(crate) fn async_error(&self) -> Result<i32, HcclError> {
        let mut code: c_int = 0;
        // SAFETY: live communicator handle, valid out-pointer.
        let rc = unsafe { (self.rt.hccl.async_error)(self.raw.0, &mut code) };
        self.rt.hccl_check("HcclGetCommAsyncError", rc)?;
        Ok(code)
    }

    /// Check that `p` holds `elems` elements of `dt` (`part` of `name`'s
    /// arguments, for the message).
    fn need(
        &self,
        (p, elems): (DevPtr, u64),
        dt: c_int,
        name: &str,
        part: &str,
    ) -> Result<(), HcclError> {
        let size = dtype_size(dt);
        if size == 0 {
            return Err(HcclError::Internal {
                detail: format!("{name} {part}: unknown HcclDataType {dt}"),
            });
        }
        let bytes = elems
            .checked_mul(size as u64)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| HcclError::Internal {
                detail: format!("{elems} elements overflow a byte count"),
            })?;
        if bytes <= p.bytes {
            Ok(())
        } else {
            p.fits(bytes, &format!("{name} {part}"))
        }
    }

    /// Enqueue `call` on `s`, once its regions are checked to hold the
    /// elements HCCL reads and writes.
    pub(crate) fn enqueue(&self, call: Call, s: &Stream) -> Result<(), HcclError> {
        let name = call.name();
        let all = |count: u64| count * u64::from(self.ranks);
        let (first, second) = match call {
            Call::AllGather(i, o, n, _) => (Some(("send", (i, n))), Some(("recv", (o, all(n))))),
            Call::ReduceScatter(i, o, n, ..) => {
                (Some(("send", (i, all(n)))), Some(("recv", (o, n))))
            }
            Call::AllToAll(i, o, n, _) => {
                (Some(("send", (i, all(n)))), Some(("recv", (o, all(n)))))
            }
            Call::Scatter(i, o, n, ..) => {
                (Some(("recv", (o, n))), i.map(|i| ("send", (i, all(n)))))
            }
            Call::AllReduce(b, n, ..)
            | Call::Reduce(b, n, ..)
            | Call::Broadcast(b, n, ..)
            | Call::Send(b, n, ..)
            | Call::Recv(b, n, ..) => (Some(("buffer", (b, n))), None),
            Call::Barrier => (None, None),
        };
        for (part, region) in [first, second].into_iter().flatten() {
            self.need(region, call.dtype(), name, part)?;
        }
        let (h, c, x) = (&self.rt.hccl, self.raw.0, s.raw.0);
        // SAFETY: for every arm: the communicator and the stream are live;
        // each region holds the elements the call reads or writes (checked
        // above: `count` per rank, `ranks * count` for the gathered or
        // scattered side). Off the root, a scatter's send region is not
        // read by HCCL; the receive region stands in for it.
        let rc = unsafe {
            match call {
                Call::AllReduce(b, n, t, op) => (h.all_reduce)(b.raw(), b.raw(), n, t, op, c, x),
                Call::Reduce(b, n, t, op, root) => {
                    (h.reduce)(b.raw(), b.raw(), n, t, op, root, c, x)
                }
                Call::Broadcast(b, n, t, root) => (h.broadcast)(b.raw(), n, t, root, c, x),
                Call::AllGather(i, o, n, t) => (h.all_gather)(i.raw(), o.raw(), n, t, c, x),
                Call::ReduceScatter(i, o, n, t, op) => {
                    (h.reduce_scatter)(i.raw(), o.raw(), n, t, op, c, x)
                }
                Call::Scatter(i, o, n, t, root) => {
                    (h.scatter)(i.unwrap_or(o).raw(), o.raw(), n, t, root, c, x)
                }
                Call::AllToAll(i, o, n, t) => (h.all_to_all)(i.raw(), n, t, o.raw(), n, t, c, x),
                Call::Send(b, n, t, dst) => (h.send)(b.raw(), n, t, dst, c, x),
                Call::Recv(b, n, t, src) => (h.recv)(b.raw(), n, t, src, c, x),
                Call::Barrier => (h.barrier)(c, x),
            }
        };
        self.rt.hccl_check(name, rc)
    }
}

/// One HCCL call for [`Comm::enqueue`]: its regions (send, receive; one
/// for the calls in place), element count (per rank for the gathers and
/// scatters, per pair of ranks for all-to-all), `HcclDataType`, and
/// reduction, root or peer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    /// `HcclAllReduce(buf, buf, count, dtype, op)`, in place.
    AllReduce(DevPtr, u64, c_int, c_int),
    /// `HcclReduce(buf, buf, count, dtype, op, root)`, in place.
    Reduce(DevPtr, u64, c_int, c_int, u32),
    /// `HcclBroadcast(buf, count, dtype, root)`.
    Broadcast(DevPtr, u64, c_int, u32),
    /// `HcclAllGather(send, recv, count, dtype)`.
    AllGather(DevPtr, DevPtr, u64, c_int),
    /// `HcclReduceScatter(send, recv, count, dtype, op)`.
    ReduceScatter(DevPtr, DevPtr, u64, c_int, c_int),
    /// `HcclScatter(send, recv, count, dtype, root)`: `send` is `Some`
    /// exactly on the root.
    Scatter(Option<DevPtr>, DevPtr, u64, c_int, u32),
    /// `HcclAlltoAll(send, recv, count, dtype)`.
    AllToAll(DevPtr, DevPtr, u64, c_int),
    /// `HcclSend(buf, count, dtype, dst)`.
    Send(DevPtr, u64, c_int, u32),
    /// `HcclRecv(buf, count, dtype, src)`.
    Recv(DevPtr, u64, c_int, u32),
    /// `HcclBarrier`.
    Barrier,
}

impl Call {
    /// The HCCL function's name.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Call::AllReduce(..) => "HcclAllReduce",
            Call::Reduce(..) => "HcclReduce",
            Call::Broadcast(..) => "HcclBroadcast",
            Call::AllGather(..) => "HcclAllGather",
            Call::ReduceScatter(..) => "HcclReduceScatter",
            Call::Scatter(..) => "HcclScatter",
            Call::AllToAll(..) => "HcclAlltoAll",
            Call::Send(..) => "HcclSend",
            Call::Recv(..) => "HcclRecv",
            Call::Barrier => "HcclBarrier",
        }
    }

    fn dtype(&self) -> c_int {
        match *self {
            Call::AllGather(_, _, _, t)
            | Call::ReduceScatter(_, _, _, t, _)
            | Call::Scatter(_, _, _, t, _)
            | Call::AllToAll(_, _, _, t) => t,
            Call::AllReduce(_, _, t, _)
            | Call::Reduce(_, _, t, ..)
            | Call::Broadcast(_, _, t, _)
            | Call::Send(_, _, t, _)
            | Call::Recv(_, _, t, _) => t,
            Call::Barrier => 0,
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if !self.leak.load(Ordering::SeqCst) {
            // SAFETY: the handle came from `HcclCommInitRootInfo`, no task
            // is pending on it (every call waited), and it is destroyed once.
            let rc = unsafe { (self.rt.hccl.comm_destroy)(self.raw.0) };
            warn_on_failure(rc, "HcclCommDestroy failed");
        }
    }
}

/// `HcclDataType` codes (`hccl_types.h`) of accel's element types.
#[allow(dead_code)] // the whole mapping, though data movement only uses INT8
pub(crate) mod dtype {
    pub(crate) const INT8: i32 = 0;
    pub(crate) const INT32: i32 = 2;
    pub(crate) const FP16: i32 = 3;
    pub(crate) const FP32: i32 = 4;
    pub(crate) const INT64: i32 = 5;
    pub(crate) const UINT8: i32 = 7;
    pub(crate) const FP64: i32 = 10;
    pub(crate) const BFP16: i32 = 11;
}

/// Bytes per element of an `HcclDataType` code (0 for an unknown code).
pub(crate) fn dtype_size(dt: c_int) -> usize {
    match dt {
        0 | 7 => 1,
        1 | 3 | 8 | 11 => 2,
        2 | 4 | 9 => 4,
        5 | 6 | 10 => 8,
        _ => 0,
    }
}
