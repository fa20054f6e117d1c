//! Every `unsafe` line of the crate: the declarations of the C++ shim
//! (`shim/gloo_shim.h`), the handle newtypes that own its objects, and the
//! store callbacks Gloo calls back into.
//!
//! The shim catches every C++ exception and returns a status code with a
//! message, so no unwinding crosses the boundary in either direction: the
//! Rust callbacks catch panics too.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::time::Duration;

use crate::error::{Caught, GlooError};

/// Size of the message buffer handed to the shim.
const ERR_CAP: usize = 2048;

#[repr(C)]
struct RawDevice {
    _opaque: [u8; 0],
}

#[repr(C)]
struct RawContext {
    _opaque: [u8; 0],
}

type SetFn = unsafe extern "C" fn(*mut c_void, *const c_char, usize, *const u8, usize) -> c_int;
type GetFn = unsafe extern "C" fn(*mut c_void, *const c_char, usize, *mut c_void) -> c_int;
type WaitFn =
    unsafe extern "C" fn(*mut c_void, *const *const c_char, *const usize, usize, i64) -> c_int;

#[repr(C)]
struct StoreVtable {
    user: *mut c_void,
    set: SetFn,
    get: GetFn,
    wait: WaitFn,
}

extern "C" {
    fn accel_gloo_bytes_assign(sink: *mut c_void, data: *const u8, len: usize) -> c_int;
    fn accel_gloo_version() -> *const c_char;
    fn accel_gloo_device_new(
        hostname: *const c_char,
        iface: *const c_char,
        out: *mut *mut RawDevice,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_device_free(dev: *mut RawDevice);
    fn accel_gloo_device_describe(dev: *const RawDevice, buf: *mut c_char, cap: usize) -> c_int;
    fn accel_gloo_context_new(
        dev: *mut RawDevice,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        store: *const StoreVtable,
        out: *mut *mut RawContext,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_context_free(ctx: *mut RawContext);
    fn accel_gloo_context_self_name(
        ctx: *const RawContext,
        peer: c_int,
        which: c_int,
        buf: *mut c_char,
        cap: usize,
    ) -> usize;
    fn accel_gloo_context_close(ctx: *mut RawContext);
    fn accel_gloo_allreduce(
        ctx: *mut RawContext,
        buf: *mut c_void,
        count: usize,
        dtype: c_int,
        op: c_int,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_reduce(
        ctx: *mut RawContext,
        buf: *mut c_void,
        count: usize,
        dtype: c_int,
        op: c_int,
        root: c_int,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_reduce_scatter(
        ctx: *mut RawContext,
        input: *const c_void,
        out: *mut c_void,
        count: usize,
        dtype: c_int,
        op: c_int,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_broadcast(
        ctx: *mut RawContext,
        buf: *mut c_void,
        nbytes: usize,
        root: c_int,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_allgather(
        ctx: *mut RawContext,
        input: *const c_void,
        in_bytes: usize,
        out: *mut c_void,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_gather(
        ctx: *mut RawContext,
        input: *const c_void,
        in_bytes: usize,
        out: *mut c_void,
        root: c_int,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_scatter(
        ctx: *mut RawContext,
        input: *const c_void,
        out: *mut c_void,
        out_bytes: usize,
        root: c_int,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_alltoall(
        ctx: *mut RawContext,
        input: *const c_void,
        out: *mut c_void,
        nbytes: usize,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_barrier(
        ctx: *mut RawContext,
        tag: u32,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_send(
        ctx: *mut RawContext,
        buf: *const c_void,
        nbytes: usize,
        dst: c_int,
        slot: u64,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
    fn accel_gloo_recv(
        ctx: *mut RawContext,
        buf: *mut c_void,
        nbytes: usize,
        src: c_int,
        slot: u64,
        timeout_ms: i64,
        err: *mut c_char,
        err_cap: usize,
    ) -> c_int;
}

/// A shim call's message buffer (on the stack: no allocation per call)
/// plus the conversion of its status code.
struct Status {
    buf: [u8; ERR_CAP],
}

impl Status {
    fn new() -> Status {
        Status {
            buf: [0u8; ERR_CAP],
        }
    }

    fn ptr(&mut self) -> *mut c_char {
        self.buf.as_mut_ptr().cast()
    }

    fn result(self, code: c_int) -> Result<(), GlooError> {
        let caught = match code {
            0 => return Ok(()),
            1 => Caught::Io,
            2 => Caught::Gloo,
            3 => Caught::Enforce,
            4 => Caught::Std,
            6 => Caught::Store,
            7 => Caught::Arg,
            _ => Caught::Unknown,
        };
        let msg = CStr::from_bytes_until_nul(&self.buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| String::from_utf8_lossy(&self.buf).into_owned());
        Err(GlooError::new(caught, msg))
    }
}

fn timeout_ms(t: Duration) -> i64 {
    // Gloo takes whole milliseconds and refuses 0: round up.
    let ms = t.as_millis().max(1);
    i64::try_from(ms).unwrap_or(i64::MAX)
}

fn c_int_of(v: usize, what: &str) -> Result<c_int, GlooError> {
    c_int::try_from(v)
        .map_err(|_| GlooError::new(Caught::Arg, format!("{what} {v} does not fit a C int")))
}

fn cstring(s: &str, what: &str) -> Result<CString, GlooError> {
    CString::new(s)
        .map_err(|_| GlooError::new(Caught::Arg, format!("{what} `{s}` contains a NUL byte")))
}

/// Gloo's version, `major.minor.patch`.
pub(crate) fn version() -> String {
    // SAFETY: the shim returns a pointer to a static NUL-terminated string
    // literal that lives for the whole program.
    unsafe { CStr::from_ptr(accel_gloo_version()) }
        .to_string_lossy()
        .into_owned()
}

/// A Gloo TCP device: a listening address plus Gloo's event-loop thread.
/// Shared (through `Arc`) by a world communicator and its splits.
#[derive(Debug)]
pub(crate) struct Device(NonNull<RawDevice>);

// SAFETY: a Gloo device is used by many contexts on many threads in Gloo's
// own design (ProcessGroupGloo shares one between groups); its mutable
// state is guarded by its own locks and the event loop's. The handle itself
// is only freed in Drop, which needs unique ownership.
unsafe impl Send for Device {}
// SAFETY: see above; every method taking `&self` is safe to call
// concurrently (context creation and description only).
unsafe impl Sync for Device {}

impl Device {
    /// A device bound to `hostname`, or to interface `iface` when it is not
    /// empty; both empty: Gloo's default (this machine's host name).
    pub(crate) fn new(hostname: &str, iface: &str) -> Result<Device, GlooError> {
        let host = cstring(hostname, "host name")?;
        let iface = cstring(iface, "interface name")?;
        let mut out: *mut RawDevice = ptr::null_mut();
        let mut st = Status::new();
        // SAFETY: both strings are valid NUL-terminated C strings that outlive
        // the call; `out` is a valid pointer to write the handle to; the
        // message buffer is ERR_CAP bytes long as passed.
        let code = unsafe {
            accel_gloo_device_new(host.as_ptr(), iface.as_ptr(), &mut out, st.ptr(), ERR_CAP)
        };
        st.result(code)?;
        NonNull::new(out)
            .map(Device)
            .ok_or_else(|| GlooError::new(Caught::Unknown, "the shim returned no device"))
    }

    /// Gloo's description of the device (address, interface).
    pub(crate) fn describe(&self) -> String {
        let mut st = Status::new();
        // SAFETY: the handle is live (owned by self); the buffer is ERR_CAP
        // bytes long as passed and the shim NUL-terminates what it writes.
        let code = unsafe { accel_gloo_device_describe(self.0.as_ptr(), st.ptr(), ERR_CAP) };
        // On success the description sits where an error message would.
        let text = CStr::from_bytes_until_nul(&st.buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default();
        if code == 0 {
            text
        } else {
            format!("(no description: {text})")
        }
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: the handle came from accel_gloo_device_new and is freed
        // exactly once, here. Contexts hold their own reference to the
        // underlying Gloo device, so freeing the handle first is allowed.
        unsafe { accel_gloo_device_free(self.0.as_ptr()) }
    }
}

/// The rendezvous store Gloo bootstraps from, as seen by the callbacks.
/// Implementations remember their own detailed error and return `Err(())`.
pub(crate) trait RendezvousStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<(), ()>;
    fn get(&self, key: &str) -> Result<Vec<u8>, ()>;
    /// `timeout`: the bound Gloo asked for, if any.
    fn wait(&self, keys: &[String], timeout: Option<Duration>) -> Result<(), ()>;
}

/// # Safety
/// `user` must point to a live `&dyn RendezvousStore`.
unsafe fn store_of<'a>(user: *mut c_void) -> &'a dyn RendezvousStore {
    // SAFETY: guaranteed by the caller (the vtable built in Context::connect
    // points `user` at a `&dyn RendezvousStore` that outlives the connect).
    unsafe { *(user as *const &dyn RendezvousStore) }
}

/// # Safety
/// `ptr` must point to `len` readable bytes (or be anything when `len` is 0).
unsafe fn key_of(ptr: *const c_char, len: usize) -> String {
    if len == 0 || ptr.is_null() {
        return String::new();
    }
    // SAFETY: guaranteed by the caller.
    let bytes = unsafe { std::slice::from_raw_parts(ptr.cast::<u8>(), len) };
    String::from_utf8_lossy(bytes).into_owned()
}

unsafe extern "C" fn store_set_cb(
    user: *mut c_void,
    key: *const c_char,
    key_len: usize,
    value: *const u8,
    value_len: usize,
) -> c_int {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the shim passes the `user` of our vtable and a key of
        // `key_len` bytes that lives for the duration of the call.
        let (store, key) = unsafe { (store_of(user), key_of(key, key_len)) };
        let value: &[u8] = if value_len == 0 || value.is_null() {
            &[]
        } else {
            // SAFETY: the shim passes a std::vector's data and size, alive
            // for the duration of the call.
            unsafe { std::slice::from_raw_parts(value, value_len) }
        };
        store.set(&key, value)
    }));
    if matches!(r, Ok(Ok(()))) {
        0
    } else {
        1
    }
}

unsafe extern "C" fn store_get_cb(
    user: *mut c_void,
    key: *const c_char,
    key_len: usize,
    sink: *mut c_void,
) -> c_int {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in store_set_cb.
        let (store, key) = unsafe { (store_of(user), key_of(key, key_len)) };
        let value = store.get(&key)?;
        // SAFETY: `sink` is the shim's std::vector<char> for this call;
        // `value` is a live slice of `value.len()` bytes.
        let rc = unsafe { accel_gloo_bytes_assign(sink, value.as_ptr(), value.len()) };
        if rc == 0 {
            Ok(())
        } else {
            Err(())
        }
    }));
    if matches!(r, Ok(Ok(()))) {
        0
    } else {
        1
    }
}

unsafe extern "C" fn store_wait_cb(
    user: *mut c_void,
    keys: *const *const c_char,
    key_lens: *const usize,
    n_keys: usize,
    timeout_ms: i64,
) -> c_int {
    let r = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: as in store_set_cb.
        let store = unsafe { store_of(user) };
        let mut names = Vec::with_capacity(n_keys);
        for i in 0..n_keys {
            // SAFETY: the shim passes two arrays of `n_keys` entries (key
            // pointers and lengths) alive for the duration of the call.
            let name = unsafe { key_of(*keys.add(i), *key_lens.add(i)) };
            names.push(name);
        }
        let timeout = u64::try_from(timeout_ms).ok().map(Duration::from_millis);
        store.wait(&names, timeout)
    }));
    if matches!(r, Ok(Ok(()))) {
        0
    } else {
        1
    }
}

/// Reduction element types Gloo can combine (codes of `accel_api::DType`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct DTypeCode(pub(crate) c_int);

/// Gloo's native reductions (codes of `accel_api::ReduceOp`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpCode(pub(crate) c_int);

/// A connected full-mesh Gloo context.
///
/// Not `Sync`: Gloo contexts take one operation at a time, so every call
/// takes `&mut self` and communicators keep the context behind a `Mutex`.
#[derive(Debug)]
pub(crate) struct Context {
    raw: NonNull<RawContext>,
    closed: bool,
}

// SAFETY: a Gloo context may be used from any thread as long as calls are
// not concurrent, which `&mut self` on every operation guarantees.
unsafe impl Send for Context {}

impl Context {
    /// Rendezvous through `store` and connect to every other rank. Blocks
    /// until connected, or until a store call or a connection timed out.
    pub(crate) fn connect(
        device: &Device,
        rank: usize,
        size: usize,
        timeout: Duration,
        store: &dyn RendezvousStore,
    ) -> Result<Context, GlooError> {
        let rank = c_int_of(rank, "rank")?;
        let size = c_int_of(size, "world size")?;
        let user: *const &dyn RendezvousStore = &store;
        let vtable = StoreVtable {
            user: user as *mut c_void,
            set: store_set_cb,
            get: store_get_cb,
            wait: store_wait_cb,
        };
        let mut out: *mut RawContext = ptr::null_mut();
        let mut st = Status::new();
        // SAFETY: the device handle is live; `vtable` and the `&dyn` it
        // points to live on this stack frame for the whole (blocking) call,
        // and the shim does not keep them after returning; `out` is a valid
        // pointer to write the handle to; the message buffer is ERR_CAP bytes.
        let code = unsafe {
            accel_gloo_context_new(
                device.0.as_ptr(),
                rank,
                size,
                timeout_ms(timeout),
                &vtable,
                &mut out,
                st.ptr(),
                ERR_CAP,
            )
        };
        st.result(code)?;
        NonNull::new(out)
            .map(|raw| Context { raw, closed: false })
            .ok_or_else(|| GlooError::new(Caught::Unknown, "the shim returned no context"))
    }

    /// The names `peer`'s Gloo may print for its connection to this rank
    /// in error messages: the local address of this rank's socket, and the
    /// listening address this rank advertised for the pair (Gloo prints the
    /// latter when it accepted before its own connect call). Empty strings
    /// when unknown.
    pub(crate) fn self_names(&self, peer: usize) -> [String; 2] {
        [self.self_name(peer, 0), self.self_name(peer, 1)]
    }

    fn self_name(&self, peer: usize, which: c_int) -> String {
        let Ok(peer) = c_int::try_from(peer) else {
            return String::new();
        };
        let mut buf = vec![0u8; 256];
        // SAFETY: the handle is live; the buffer holds `buf.len()` bytes as
        // passed and the shim NUL-terminates within it.
        unsafe {
            accel_gloo_context_self_name(
                self.raw.as_ptr(),
                peer,
                which,
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Close every connection, so that peers notice this rank is gone. The
    /// context must not run operations afterwards (callers poison first).
    pub(crate) fn close(&mut self) {
        if !self.closed {
            // SAFETY: the handle is live and no operation runs (`&mut self`).
            unsafe { accel_gloo_context_close(self.raw.as_ptr()) };
            self.closed = true;
        }
    }

    fn check_open(&self) -> Result<(), GlooError> {
        if self.closed {
            Err(GlooError::new(Caught::Arg, "the Gloo context was closed"))
        } else {
            Ok(())
        }
    }

    /// Run `call` to completion (or its timeout): the shim function it
    /// names, after checking that the context is open, that the root or
    /// peer fits a C int and that the buffers have the sizes Gloo expects.
    pub(crate) fn run(&mut self, call: Call<'_>, timeout: Duration) -> Result<(), GlooError> {
        self.check_open()?;
        let rank = call.checked_rank()?;
        let (x, ms) = (self.raw.as_ptr(), timeout_ms(timeout));
        let mut st = Status::new();
        let e = st.ptr();
        let rd = |b: &[u8]| b.as_ptr().cast::<c_void>();
        let wr = |b: &mut [u8]| b.as_mut_ptr().cast::<c_void>();
        // SAFETY: for every arm: the context handle is live and runs one
        // operation at a time (`&mut self`); the message buffer is ERR_CAP
        // bytes. Every buffer is borrowed for the whole call, which waits
        // for the operation to complete (Gloo never touches one afterwards:
        // unbound buffers are destroyed inside the call); read-only inputs
        // are shared borrows, outputs exclusive ones, so they do not
        // overlap. Sizes: a reduction's `count` elements of its type fill
        // its buffer exactly (checked by the communicator; a reduce-scatter's
        // fill its output, and its input was checked by `checked_rank` to
        // hold `size` outputs); broadcast,
        // send and receive pass their buffer's length; the gathers,
        // scatters and all-to-all were checked by `checked_rank` (`out` or
        // the root's input holds `size` chunks). A missing output or input
        // is null only off the root, and the shim refuses a null one on
        // the root.
        let code = unsafe {
            match call {
                Call::AllReduce(b, n, t, op, tag) => {
                    accel_gloo_allreduce(x, wr(b), n, t.0, op.0, tag, ms, e, ERR_CAP)
                }
                Call::Reduce(b, n, t, op, _, tag) => {
                    accel_gloo_reduce(x, wr(b), n, t.0, op.0, rank, tag, ms, e, ERR_CAP)
                }
                Call::ReduceScatter(i, o, n, t, op, _, tag) => {
                    accel_gloo_reduce_scatter(x, rd(i), wr(o), n, t.0, op.0, tag, ms, e, ERR_CAP)
                }
                Call::Broadcast(b, _, tag) => {
                    accel_gloo_broadcast(x, wr(b), b.len(), rank, tag, ms, e, ERR_CAP)
                }
                Call::AllGather(i, o, _, tag) => {
                    accel_gloo_allgather(x, rd(i), i.len(), wr(o), tag, ms, e, ERR_CAP)
                }
                Call::Gather(i, o, _, _, tag) => {
                    let o = o.map_or(ptr::null_mut(), wr);
                    accel_gloo_gather(x, rd(i), i.len(), o, rank, tag, ms, e, ERR_CAP)
                }
                Call::Scatter(i, o, _, _, tag) => {
                    let i = i.map_or(ptr::null(), rd);
                    accel_gloo_scatter(x, i, wr(o), o.len(), rank, tag, ms, e, ERR_CAP)
                }
                Call::AllToAll(i, o, tag) => {
                    accel_gloo_alltoall(x, rd(i), wr(o), o.len(), tag, ms, e, ERR_CAP)
                }
                Call::Barrier(tag) => accel_gloo_barrier(x, tag, ms, e, ERR_CAP),
                Call::Send(b, _, slot) => {
                    accel_gloo_send(x, rd(b), b.len(), rank, slot, ms, e, ERR_CAP)
                }
                Call::Recv(b, _, slot) => {
                    accel_gloo_recv(x, wr(b), b.len(), rank, slot, ms, e, ERR_CAP)
                }
            }
        };
        st.result(code)
    }
}

/// One Gloo operation with its buffers, for [`Context::run`]. `tag` pairs a
/// collective with the peers' same call; `slot` (< 2^56) a send with its
/// receive. Peers (`dst`, `src`) are never this rank.
#[derive(Debug)]
pub(crate) enum Call<'a> {
    /// `(buf, count, dtype, op, tag)`: in-place all-reduce of the `count`
    /// elements of `dtype` that fill `buf`.
    AllReduce(&'a mut [u8], usize, DTypeCode, OpCode, u32),
    /// `(buf, count, dtype, op, root, tag)`: in-place reduce to `root`.
    Reduce(&'a mut [u8], usize, DTypeCode, OpCode, usize, u32),
    /// `(input, out, count, dtype, op, size, tag)`: ring reduce-scatter;
    /// `out` holds the `count` elements of `dtype` of this rank's chunk,
    /// `input.len()` must be `out.len() * size`.
    ReduceScatter(&'a [u8], &'a mut [u8], usize, DTypeCode, OpCode, usize, u32),
    /// `(buf, root, tag)`: in-place broadcast of the bytes of `buf`.
    Broadcast(&'a mut [u8], usize, u32),
    /// `(input, out, size, tag)`: all-gather; `out.len()` must be
    /// `input.len() * size`.
    AllGather(&'a [u8], &'a mut [u8], usize, u32),
    /// `(input, out, size, root, tag)`: gather to `root`; `out` is `Some`
    /// with `input.len() * size` bytes on the root.
    Gather(&'a [u8], Option<&'a mut [u8]>, usize, usize, u32),
    /// `(input, out, size, root, tag)`: scatter from `root`; `input` is
    /// `Some` with `out.len() * size` bytes on the root.
    Scatter(Option<&'a [u8]>, &'a mut [u8], usize, usize, u32),
    /// `(input, out, tag)`: all-to-all of equal byte chunks; both buffers
    /// have the same length.
    AllToAll(&'a [u8], &'a mut [u8], u32),
    /// `(tag)`: barrier.
    Barrier(u32),
    /// `(buf, dst, slot)`: send the bytes of `buf`.
    Send(&'a [u8], usize, u64),
    /// `(buf, src, slot)`: receive exactly `buf.len()` bytes.
    Recv(&'a mut [u8], usize, u64),
}

impl Call<'_> {
    /// The root or peer as a C int (0 when the call has none), once the
    /// buffers are checked to have the sizes Gloo expects.
    fn checked_rank(&self) -> Result<c_int, GlooError> {
        let (rank, what) = match self {
            Call::Reduce(.., root, _)
            | Call::Broadcast(_, root, _)
            | Call::Gather(.., root, _)
            | Call::Scatter(.., root, _) => (*root, "root"),
            Call::Send(_, dst, _) => (*dst, "destination"),
            Call::Recv(_, src, _) => (*src, "source"),
            _ => (0, "rank"),
        };
        let rank = c_int_of(rank, what)?;
        let (fits, op) = match self {
            Call::AllGather(i, o, size, _) => {
                (i.len().checked_mul(*size) == Some(o.len()), "all_gather")
            }
            Call::Gather(i, Some(o), size, ..) => {
                (i.len().checked_mul(*size) == Some(o.len()), "gather")
            }
            Call::Scatter(Some(i), o, size, ..) => {
                (o.len().checked_mul(*size) == Some(i.len()), "scatter")
            }
            Call::ReduceScatter(i, o, .., size, _) => (
                o.len().checked_mul(*size) == Some(i.len()),
                "reduce_scatter",
            ),
            Call::AllToAll(i, o, _) => (i.len() == o.len(), "all_to_all"),
            _ => (true, ""),
        };
        if fits {
            Ok(rank)
        } else {
            Err(GlooError::new(Caught::Arg, format!("{op} buffer sizes")))
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: the handle came from accel_gloo_context_new and is freed
        // exactly once, here; no operation can be running (`&mut self`).
        unsafe { accel_gloo_context_free(self.raw.as_ptr()) }
    }
}
