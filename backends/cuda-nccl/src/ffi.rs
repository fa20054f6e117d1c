//! Every `unsafe` line of the crate: the calls into the CUDA driver and
//! NCCL through cudarc's `sys` bindings (loaded with `dlopen` at first use),
//! the handle newtypes that own what they create, and the one
//! `unsafe impl Send + Sync` of the NCCL communicator.
//!
//! With cudarc's `dynamic-loading`, a `sys` call panics when its library or
//! its symbol is missing, and a failed load is retried (and panics again) on
//! the next call. So nothing here is called before [`library_present`] and
//! [`missing_symbols`] said yes: the probe and `connect` check both first,
//! and the engine exists only after a successful `connect`.

use std::ffi::{c_int, c_void, CStr};
use std::ptr::{self, NonNull};
use std::sync::Arc;

use cudarc::driver::{result as cu, sys as cusys, CudaContext, DriverError};
use cudarc::nccl::sys as nc;

use crate::error::{NcclCall, NcclFailure};

pub(crate) use nc::{ncclDataType_t as NcclType, ncclRedOp_t as NcclOp};

/// The two libraries the backend loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lib {
    /// `libcuda.so` (the NVIDIA driver).
    Driver,
    /// `libnccl.so`.
    Nccl,
}

/// `true` when cudarc can `dlopen` the library under one of the names it
/// tries. Never panics.
pub(crate) fn library_present(lib: Lib) -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on cudarc's list of
    // names and drops what it opened; it calls nothing in the library.
    unsafe {
        match lib {
            Lib::Driver => cusys::is_culib_present(),
            Lib::Nccl => nc::is_culib_present(),
        }
    }
}

/// The symbols of `names` that the library lacks (after
/// [`library_present`] said yes). Never panics.
pub(crate) fn missing_symbols(lib: Lib, names: &[&str]) -> Vec<String> {
    // SAFETY: the library is present (checked by the caller), so `culib`
    // opens it without panicking; `get` only looks the name up.
    unsafe {
        let l = match lib {
            Lib::Driver => cusys::culib(),
            Lib::Nccl => nc::culib(),
        };
        names
            .iter()
            .filter(|n| l.get::<unsafe extern "C" fn()>(n.as_bytes()).is_err())
            .map(|n| n.to_string())
            .collect()
    }
}

/// Driver symbols the probe calls.
pub(crate) const DRIVER_PROBE_SYMBOLS: &[&str] =
    &["cuInit", "cuDeviceGetCount", "cuDriverGetVersion"];

/// Driver symbols a communicator calls.
pub(crate) const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuCtxGetCurrent",
    "cuCtxSynchronize",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
];

/// NCCL symbols a communicator calls (all present since NCCL 2.18).
pub(crate) const NCCL_SYMBOLS: &[&str] = &[
    "ncclGetVersion",
    "ncclGetUniqueId",
    "ncclCommInitRankConfig",
    "ncclCommGetAsyncError",
    "ncclCommAbort",
    "ncclCommFinalize",
    "ncclCommDestroy",
    "ncclCommSplit",
    "ncclCommCount",
    "ncclCommUserRank",
    "ncclGetErrorString",
    "ncclGetLastError",
    "ncclAllReduce",
    "ncclReduce",
    "ncclBroadcast",
    "ncclAllGather",
    "ncclReduceScatter",
    "ncclSend",
    "ncclRecv",
    "ncclGroupStart",
    "ncclGroupEnd",
];

/// `cuInit(0)` and the number of devices. Call only after the driver
/// library and [`DRIVER_PROBE_SYMBOLS`] were found.
pub(crate) fn driver_init_and_count() -> Result<usize, cusys::CUresult> {
    cu::init().map_err(|e| e.0)?;
    cu::device::get_count()
        .map(|n| n.max(0) as usize)
        .map_err(|e| e.0)
}

/// The driver's CUDA version (`13000` for 13.0). After
/// [`driver_init_and_count`] succeeded.
pub(crate) fn driver_version() -> Option<i32> {
    let mut v: c_int = 0;
    // SAFETY: the symbol was checked; `v` is a valid out-pointer.
    let r = unsafe { cusys::cuDriverGetVersion(&mut v) };
    (r == cusys::CUresult::CUDA_SUCCESS).then_some(v)
}

/// NCCL's version code (`22803` for 2.28.3). After `libnccl.so` and
/// `ncclGetVersion` were found.
pub(crate) fn nccl_version() -> Option<i32> {
    let mut v: c_int = 0;
    // SAFETY: the symbol was checked; `v` is a valid out-pointer.
    let r = unsafe { nc::ncclGetVersion(&mut v) };
    (r == nc::ncclResult_t::ncclSuccess).then_some(v)
}

/// NCCL's text for a result code.
pub(crate) fn nccl_error_string(r: nc::ncclResult_t) -> String {
    // SAFETY: NCCL returns a pointer to a static NUL-terminated string (or
    // null, handled).
    unsafe {
        let p = nc::ncclGetErrorString(r);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

/// A fresh 128-byte NCCL unique id (works without a GPU).
pub(crate) fn unique_id() -> Result<[u8; 128], NcclFailure> {
    let mut id = nc::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid out-pointer to an ncclUniqueId.
    let r = unsafe { nc::ncclGetUniqueId(&mut id) };
    check(NcclCall::GetUniqueId, r, None)?;
    Ok(id.internal.map(|c| c as u8))
}

/// `NCCL_VERSION(2, 30, 0)`: the layout of cudarc's `ncclConfig_t`.
const CONFIG_LAYOUT_VERSION: u32 = 2 * 10000 + 30 * 100;

/// A non-blocking communicator configuration, filled like
/// `NCCL_CONFIG_INITIALIZER` (every field undefined) with `blocking = 0`.
/// NCCL copies `min(size, its own sizeof)` bytes, so an older library reads
/// the prefix it knows.
fn nonblocking_config() -> nc::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_LAYOUT_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

fn check(
    call: NcclCall,
    r: nc::ncclResult_t,
    comm: Option<nc::ncclComm_t>,
) -> Result<Progress, NcclFailure> {
    match r {
        nc::ncclResult_t::ncclSuccess => Ok(Progress::Done),
        nc::ncclResult_t::ncclInProgress => Ok(Progress::InProgress),
        other => Err(NcclFailure::Nccl {
            call,
            code: other as u32,
            text: nccl_error_string(other),
            last: comm.map(last_error).unwrap_or_default(),
        }),
    }
}

fn last_error(comm: nc::ncclComm_t) -> String {
    // SAFETY: `comm` is a live communicator (or null, which NCCL accepts
    // and answers with the thread's last error); the string is NCCL's.
    unsafe {
        let p = nc::ncclGetLastError(comm);
        if p.is_null() {
            String::new()
        } else {
            CStr::from_ptr(p).to_string_lossy().trim().to_string()
        }
    }
}

/// Whether an NCCL call on a non-blocking communicator has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    Done,
    InProgress,
}

/// An NCCL communicator (non-blocking mode). `Drop` finalizes and destroys
/// it, or aborts it when it failed or [`Comm::abort`] was called.
#[derive(Debug)]
pub(crate) struct Comm {
    raw: NonNull<nc::ncclComm>,
    /// Set once aborted: the handle is freed and must not be used again.
    dead: std::sync::atomic::AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls
// on it do not overlap (NCCL's rule) and the device's context is current:
// the engine holds the group's call lock around every call and binds the
// context first. `ncclCommGetAsyncError` and `ncclCommAbort` are the calls
// NCCL documents as safe from another thread, and `Sync` use goes through
// only those two outside the lock.
unsafe impl Send for Comm {}
// SAFETY: see `Send` above.
unsafe impl Sync for Comm {}

impl Comm {
    /// Start `ncclCommInitRankConfig` in non-blocking mode; poll
    /// [`Comm::async_error`] until it is done.
    pub(crate) fn init_rank(
        world: usize,
        id: &[u8; 128],
        rank: usize,
    ) -> Result<Comm, NcclFailure> {
        let mut uid = nc::ncclUniqueId { internal: [0; 128] };
        for (d, s) in uid.internal.iter_mut().zip(id) {
            *d = *s as _;
        }
        let mut cfg = nonblocking_config();
        let mut raw: nc::ncclComm_t = ptr::null_mut();
        // SAFETY: out-pointer and config are valid for the call; NCCL
        // copies the config.
        let r = unsafe {
            nc::ncclCommInitRankConfig(&mut raw, world as c_int, uid, rank as c_int, &mut cfg)
        };
        let p = check(NcclCall::CommInitRank, r, None);
        let comm = NonNull::new(raw).map(|raw| Comm {
            raw,
            dead: false.into(),
        });
        match (p, comm) {
            (Ok(_), Some(c)) => Ok(c),
            (Ok(_), None) => Err(NcclFailure::Nccl {
                call: NcclCall::CommInitRank,
                code: 0,
                text: "NCCL returned no communicator".into(),
                last: last_error(ptr::null_mut()),
            }),
            (Err(e), Some(c)) => {
                c.abort();
                Err(e)
            }
            (Err(e), None) => Err(e),
        }
    }

    fn ptr(&self) -> nc::ncclComm_t {
        self.raw.as_ptr()
    }

    /// `true` once aborted.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// `ncclCommGetAsyncError`: done, still in progress, or the failure.
    pub(crate) fn async_error(&self) -> Result<Progress, NcclFailure> {
        if self.is_dead() {
            return Err(NcclFailure::Aborted);
        }
        let mut st = nc::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator (not aborted), valid out-pointer.
        let r = unsafe { nc::ncclCommGetAsyncError(self.ptr(), &mut st) };
        check(NcclCall::CommGetAsyncError, r, Some(self.ptr()))?;
        check(NcclCall::Async, st, Some(self.ptr()))
    }

    /// `ncclCommAbort`, once; later calls do nothing.
    pub(crate) fn abort(&self) {
        if self.dead.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        // SAFETY: the communicator is live (the swap above makes this the
        // only abort); NCCL frees it and stops its kernels and threads.
        let _ = unsafe { nc::ncclCommAbort(self.ptr()) };
    }

    /// Number of ranks and this rank, as NCCL sees them.
    pub(crate) fn count_and_rank(&self) -> Result<(usize, usize), NcclFailure> {
        let (mut n, mut r): (c_int, c_int) = (0, 0);
        // SAFETY: live communicator, valid out-pointers.
        let a = unsafe { nc::ncclCommCount(self.ptr(), &mut n) };
        check(NcclCall::CommCount, a, Some(self.ptr()))?;
        // SAFETY: as above.
        let b = unsafe { nc::ncclCommUserRank(self.ptr(), &mut r) };
        check(NcclCall::CommCount, b, Some(self.ptr()))?;
        Ok((n.max(0) as usize, r.max(0) as usize))
    }

    /// Start `ncclCommSplit` (non-blocking): `color` `None` opts out.
    pub(crate) fn split(
        &self,
        color: Option<c_int>,
        key: c_int,
    ) -> Result<Option<Comm>, NcclFailure> {
        const NOCOLOR: c_int = -1;
        let mut cfg = nonblocking_config();
        let mut raw: nc::ncclComm_t = ptr::null_mut();
        // SAFETY: live parent communicator; out-pointer and config valid for
        // the call.
        let r = unsafe {
            nc::ncclCommSplit(
                self.ptr(),
                color.unwrap_or(NOCOLOR),
                key,
                &mut raw,
                &mut cfg,
            )
        };
        check(NcclCall::CommSplit, r, Some(self.ptr()))?;
        Ok(NonNull::new(raw).map(|raw| Comm {
            raw,
            dead: false.into(),
        }))
    }

    /// Enqueue one collective or point-to-point call on `stream`.
    pub(crate) fn enqueue(&self, call: &Call, stream: Stream) -> Result<Progress, NcclFailure> {
        if self.is_dead() {
            return Err(NcclFailure::Aborted);
        }
        let (c, s) = (self.ptr(), stream.0 as nc::cudaStream_t);
        let vp = |a: u64| a as usize as *mut c_void;
        let cp = |a: u64| a as usize as *const c_void;
        // SAFETY: the engine built `call` from checked views: every address
        // points to at least `count` elements of `ty` on this
        // communicator's device, valid until the stream finished (the engine
        // waits for it before returning); `c` is live and `s` is a stream of
        // the same context.
        let (which, r) = unsafe {
            match *call {
                Call::AllReduce(i, o, n, t, op) => (
                    NcclCall::AllReduce,
                    nc::ncclAllReduce(cp(i), vp(o), n, t, op, c, s),
                ),
                Call::Reduce(i, o, n, t, op, root) => (
                    NcclCall::Reduce,
                    nc::ncclReduce(cp(i), vp(o), n, t, op, root as c_int, c, s),
                ),
                Call::Broadcast(b, n, t, root) => (
                    NcclCall::Broadcast,
                    nc::ncclBroadcast(cp(b), vp(b), n, t, root as c_int, c, s),
                ),
                Call::AllGather(i, o, n, t) => (
                    NcclCall::AllGather,
                    nc::ncclAllGather(cp(i), vp(o), n, t, c, s),
                ),
                Call::ReduceScatter(i, o, n, t, op) => (
                    NcclCall::ReduceScatter,
                    nc::ncclReduceScatter(cp(i), vp(o), n, t, op, c, s),
                ),
                Call::Send(b, n, t, peer) => (
                    NcclCall::Send,
                    nc::ncclSend(cp(b), n, t, peer as c_int, c, s),
                ),
                Call::Recv(b, n, t, peer) => (
                    NcclCall::Recv,
                    nc::ncclRecv(vp(b), n, t, peer as c_int, c, s),
                ),
            }
        };
        check(which, r, Some(c))
    }

    /// `ncclGroupStart`.
    pub(crate) fn group_start(&self) -> Result<(), NcclFailure> {
        // SAFETY: no argument; pairs with `group_end` on this thread.
        let r = unsafe { nc::ncclGroupStart() };
        check(NcclCall::GroupStart, r, Some(self.ptr())).map(|_| ())
    }

    /// `ncclGroupEnd`: launches the grouped calls.
    pub(crate) fn group_end(&self) -> Result<Progress, NcclFailure> {
        // SAFETY: no argument; closes the group opened on this thread.
        let r = unsafe { nc::ncclGroupEnd() };
        check(NcclCall::GroupEnd, r, Some(self.ptr()))
    }

    /// Start `ncclCommFinalize` (flushes outstanding work, non-blocking).
    fn finalize(&self) -> Result<Progress, NcclFailure> {
        // SAFETY: live communicator.
        let r = unsafe { nc::ncclCommFinalize(self.ptr()) };
        check(NcclCall::CommFinalize, r, Some(self.ptr()))
    }

    /// Finalize within `budget`, then destroy; abort instead when that
    /// fails or runs out of time. Never blocks past `budget` (plus NCCL's
    /// own abort).
    pub(crate) fn close(&self, budget: std::time::Duration) {
        if self.is_dead() {
            return;
        }
        let mut ok = self.finalize().is_ok();
        if ok {
            let pause = accel_api::kit::Backoff::sleep(std::time::Duration::from_micros(200));
            let finished = accel_api::kit::Deadline::after(budget).poll(&pause, || {
                self.async_error()
                    .map(|p| (p == Progress::Done).then_some(()))
            });
            ok = !matches!(finished, Err(accel_api::kit::Polled::Failed(_)));
        }
        if ok && matches!(self.async_error(), Ok(Progress::Done)) {
            self.dead.store(true, std::sync::atomic::Ordering::SeqCst);
            // SAFETY: finalized, live, and marked dead so it is not used again.
            let _ = unsafe { nc::ncclCommDestroy(self.ptr()) };
        } else {
            self.abort();
        }
    }
}

impl Drop for Comm {
    /// A communicator the engine did not [`close`](Comm::close) is aborted.
    fn drop(&mut self) {
        self.abort();
    }
}

/// One NCCL call on device addresses, built by the engine from checked
/// views: send and receive addresses (one buffer for broadcast and
/// point-to-point), element count and type, then the reduction, root or
/// peer.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Call {
    /// `ncclAllReduce(send, recv, count, type, op)`.
    AllReduce(u64, u64, usize, NcclType, NcclOp),
    /// `ncclReduce(send, recv, count, type, op, root)`.
    Reduce(u64, u64, usize, NcclType, NcclOp, usize),
    /// `ncclBroadcast(buf, count, type, root)`, in place.
    Broadcast(u64, usize, NcclType, usize),
    /// `ncclAllGather(send, recv, count, type)`.
    AllGather(u64, u64, usize, NcclType),
    /// `ncclReduceScatter(send, recv, count, type, op)`.
    ReduceScatter(u64, u64, usize, NcclType, NcclOp),
    /// `ncclSend(buf, count, type, peer)`.
    Send(u64, usize, NcclType, usize),
    /// `ncclRecv(buf, count, type, peer)`.
    Recv(u64, usize, NcclType, usize),
}

/// A raw CUDA stream handle (null: the legacy default stream).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stream(cusys::CUstream);

// SAFETY: a CUstream is an opaque handle that CUDA lets any thread use.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

impl Stream {
    /// The stream a device view names (0: the legacy default stream).
    pub(crate) fn from_view(raw: u64) -> Stream {
        Stream(raw as usize as cusys::CUstream)
    }

    /// The handle as a device view carries it.
    pub(crate) fn as_view(self) -> u64 {
        self.0 as usize as u64
    }
}

/// A stream the engine owns (`cuStreamCreate`, non-blocking), destroyed on
/// drop.
#[derive(Debug)]
pub(crate) struct OwnedStream {
    stream: Stream,
    ctx: Arc<CudaContext>,
}

impl OwnedStream {
    /// A new non-blocking stream on `ctx` (bound to this thread).
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<OwnedStream, DriverError> {
        ctx.bind_to_thread()?;
        let s = cu::stream::create(cu::stream::StreamKind::NonBlocking)?;
        Ok(OwnedStream {
            stream: Stream(s),
            ctx: ctx.clone(),
        })
    }

    pub(crate) fn raw(&self) -> Stream {
        self.stream
    }

    /// `cuStreamQuery`: `Ok(true)` when all work finished.
    pub(crate) fn is_idle(&self) -> Result<bool, cusys::CUresult> {
        // SAFETY: the stream is live (owned by self).
        let r = unsafe { cusys::cuStreamQuery(self.stream.0) };
        match r {
            cusys::CUresult::CUDA_SUCCESS => Ok(true),
            cusys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(e),
        }
    }

    /// Make this stream wait for the work queued so far on `other`.
    pub(crate) fn wait_for(&self, other: Stream) -> Result<(), DriverError> {
        let ev = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        // SAFETY: `ev` is a fresh event; `other` is a stream of this context
        // (the view's contract) or the legacy default stream; the event is
        // destroyed after the wait is queued, which CUDA allows.
        unsafe {
            let r = cu::event::record(ev, other.0).and_then(|()| {
                cu::stream::wait_event(
                    self.stream.0,
                    ev,
                    cusys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            });
            let _ = cu::event::destroy(ev);
            r
        }
    }

    /// Queue a host-to-device copy of `src` to `dst` (pageable memory: the
    /// call returns once `src` was read).
    pub(crate) fn upload(&self, dst: u64, src: &[u8]) -> Result<(), DriverError> {
        // SAFETY: `dst` points to at least `src.len()` bytes of device memory
        // the engine owns or was handed by a checked view.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.0) }
    }

    /// Queue a device-to-host copy into `dst`; read `dst` only after the
    /// stream is idle.
    pub(crate) fn download(&self, dst: &mut [u8], src: u64) -> Result<(), DriverError> {
        // SAFETY: `src` points to at least `dst.len()` bytes of device memory
        // (as for `upload`); `dst` is borrowed until the caller waited for
        // the stream.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.0) }
    }

    /// Queue a device-to-device copy of `bytes` bytes.
    pub(crate) fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), DriverError> {
        // SAFETY: both addresses point to at least `bytes` bytes of device
        // memory on this context (checked views or engine allocations).
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream.0) }
    }
}

impl Drop for OwnedStream {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the stream is owned and no longer used.
            let _ = unsafe { cu::stream::destroy(self.stream.0) };
        }
    }
}

/// Device memory the backend allocates (`cuMemAlloc`), freed on drop.
#[derive(Debug)]
pub(crate) struct DeviceMem {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMem {
    /// `bytes` bytes (at least 1) on `ctx`'s device.
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceMem, DriverError> {
        ctx.bind_to_thread()?;
        // SAFETY: plain allocation on the bound context.
        let ptr = unsafe { cu::malloc_sync(bytes.max(1)) }?;
        Ok(DeviceMem {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `alloc`, freed once; every use of it was
            // on a stream the engine waited for.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

/// What a view of device memory shows: `len` elements of `dtype` on
/// `device`, ordered on `stream` (0: the legacy default stream).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) dtype: accel_api::DType,
    pub(crate) len: usize,
    pub(crate) device: accel_api::Device,
    pub(crate) stream: u64,
}

/// The views below are safe functions: their bound is checked in every
/// build (a caller's bug panics here instead of viewing past `mem`).
fn fits(mem: &DeviceMem, s: Shape) {
    let bytes = s.len.checked_mul(s.dtype.size());
    assert!(
        bytes.is_some_and(|b| b <= mem.bytes),
        "a view of {} {} elements over {} bytes of device memory",
        s.len,
        s.dtype,
        mem.bytes
    );
}

/// A read-only device view of `mem` as `s` says.
pub(crate) fn view(mem: &DeviceMem, s: Shape) -> accel_api::DeviceBuf<'_> {
    fits(mem, s);
    // SAFETY: `mem` owns at least `len * dtype.size()` bytes on `device`
    // and is borrowed for the view's lifetime.
    unsafe { accel_api::DeviceBuf::from_raw(mem, mem.ptr, s.len, s.dtype, s.device, s.stream) }
}

/// A writable device view, borrowing `mem` mutably.
pub(crate) fn view_mut(mem: &mut DeviceMem, s: Shape) -> accel_api::DeviceBufMut<'_> {
    fits(mem, s);
    let ptr = mem.ptr;
    // SAFETY: as for `view`; the mutable borrow excludes other views.
    unsafe { accel_api::DeviceBufMut::from_raw(mem, ptr, s.len, s.dtype, s.device, s.stream) }
}

/// A read-only view of a cudarc slice, on the slice's stream.
pub(crate) fn cudarc_view<T: accel_api::Element>(
    s: &cudarc::driver::CudaSlice<T>,
) -> accel_api::DeviceBuf<'_> {
    use cudarc::driver::DevicePtr;
    let stream = s.stream().cu_stream() as usize as u64;
    let device = accel_api::Device::new(accel_api::DeviceKind::Cuda, s.ordinal() as u32);
    // The guard records cudarc's read event now; the collective that uses
    // the view is ordered after the slice's stream and finishes before the
    // call returns, so later writes on that stream cannot overtake it.
    let (addr, _guard) = s.device_ptr(s.stream());
    // SAFETY: the slice owns `s.len()` elements of `T` on `device`, and the
    // view borrows it, so the memory outlives the view and is not written
    // through another path while the view is used.
    unsafe { accel_api::DeviceBuf::from_raw(s, addr, s.len(), T::DTYPE, device, stream) }
}

/// A writable view of a cudarc slice, on the slice's stream.
pub(crate) fn cudarc_view_mut<T: accel_api::Element>(
    s: &mut cudarc::driver::CudaSlice<T>,
) -> accel_api::DeviceBufMut<'_> {
    use cudarc::driver::DevicePtrMut;
    let stream_arc = s.stream().clone();
    let stream = stream_arc.cu_stream() as usize as u64;
    let device = accel_api::Device::new(accel_api::DeviceKind::Cuda, s.ordinal() as u32);
    let len = s.len();
    let addr = {
        // As in `cudarc_view`, for cudarc's write event.
        let (addr, _guard) = s.device_ptr_mut(&stream_arc);
        addr
    };
    // SAFETY: as in `cudarc_view`; the mutable borrow of the slice excludes
    // every other view of it while this one lives.
    unsafe { accel_api::DeviceBufMut::from_raw(s, addr, len, T::DTYPE, device, stream) }
}
