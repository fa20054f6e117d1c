//! The vendor side: the `extern "C"` functions behind a plugin table, built
//! for one backend by [`export_plugin!`](crate::export_plugin).
//!
//! Vendors do not use this module directly; the macro does. Every function
//! here runs its body inside [`catch_unwind`](std::panic::catch_unwind) (via
//! `convert::guard`), so a panicking backend becomes
//! [`ACCEL_ERR_PANICKED`] with the message
//! `plugin panicked in <function>: <payload>`, never an unwind into the host.
#![allow(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Backend, CasOutcome, Communicator, ConnectContext, Error, ErrorKind, ProbeContext, Result,
    Store,
};

use crate::abi::*;
use crate::convert::{self, guard, write_sink, Origin, Slot, VecSink};

/// What [`export_plugin!`](crate::export_plugin) generates for a vendor: the
/// backend singleton and the plugin's version. Not meant to be implemented
/// by hand.
#[doc(hidden)]
pub trait Exported: 'static {
    /// The vendor crate's version (`CARGO_PKG_VERSION` where the macro
    /// expands).
    const PLUGIN_VERSION: &'static str;

    /// The backend, built on first use. May panic (a panicking constructor);
    /// every caller runs inside the panic guard.
    fn backend() -> &'static dyn Backend;
}

/// The plugin table for `P`, as a constant for the vendor's `static`.
#[doc(hidden)]
pub const fn table<P: Exported>() -> AccelPluginV1 {
    AccelPluginV1 {
        struct_size: min_size::PLUGIN,
        abi_major: ACCEL_PLUGIN_ABI_MAJOR,
        abi_minor: ACCEL_PLUGIN_ABI_MINOR,
        comm: &COMM_V1,
        last_error: Some(last_error),
        plugin_version: Some(plugin_version::<P>),
        name: Some(name::<P>),
        priority: Some(priority::<P>),
        device_kind: Some(device_kind::<P>),
        probe: Some(probe::<P>),
        connect: Some(connect::<P>),
    }
}

const COMM_V1: AccelCommV1 = AccelCommV1 {
    struct_size: min_size::COMM,
    backend_name: Some(comm_backend_name),
    rank: Some(comm_rank),
    world_size: Some(comm_world_size),
    device: Some(comm_device),
    timeout: Some(comm_timeout),
    capabilities: Some(comm_capabilities),
    all_reduce: Some(comm_all_reduce),
    reduce: Some(comm_reduce),
    broadcast: Some(comm_broadcast),
    all_gather: Some(comm_all_gather),
    gather: Some(comm_gather),
    scatter: Some(comm_scatter),
    reduce_scatter: Some(comm_reduce_scatter),
    all_to_all: Some(comm_all_to_all),
    send: Some(comm_send),
    recv: Some(comm_recv),
    barrier: Some(comm_barrier),
    split: Some(comm_split),
    abort: Some(comm_abort),
    destroy: Some(comm_destroy),
};

fn null_arg(function: &str, what: &str) -> Error {
    Error::invalid_argument(function, format!("the host passed a null {what}"))
}

fn too_small(function: &str, what: &str, size: usize, min: usize) -> Error {
    Error::invalid_argument(
        function,
        format!("the host's {what} is {size} bytes, ABI 1.0 needs at least {min}"),
    )
    .with_fix("the host speaks an older, incompatible ABI: upgrade the host")
}

// ---------------------------------------------------------------------------
// Backend functions

unsafe extern "C" fn last_error() -> *const AccelError {
    // Reading a thread-local cannot panic (`Slot::get` uses `try_with` and
    // `try_borrow`).
    Slot::Plugin.get()
}

unsafe extern "C" fn plugin_version<P: Exported>(out: AccelSink) -> AccelStatus {
    guard(Slot::Plugin, "plugin_version", || {
        // SAFETY: `out` is valid for this call (ABI contract).
        unsafe { write_sink(out, P::PLUGIN_VERSION.as_bytes()) };
        Ok(())
    })
}

unsafe extern "C" fn name<P: Exported>(out: AccelSink) -> AccelStatus {
    guard(Slot::Plugin, "name", || {
        // SAFETY: `out` is valid for this call (ABI contract).
        unsafe { write_sink(out, P::backend().name().as_bytes()) };
        Ok(())
    })
}

unsafe extern "C" fn priority<P: Exported>(out: *mut i32) -> AccelStatus {
    guard(Slot::Plugin, "priority", || {
        // SAFETY: `out` is null or a writable i32 (ABI contract).
        unsafe { put("priority", out, P::backend().priority()) }
    })
}

unsafe extern "C" fn device_kind<P: Exported>(out: *mut u32) -> AccelStatus {
    guard(Slot::Plugin, "device_kind", || {
        // SAFETY: `out` is null or a writable u32 (ABI contract).
        unsafe { put("device_kind", out, P::backend().device_kind().code()) }
    })
}

unsafe extern "C" fn probe<P: Exported>(
    ctx: *const AccelProbeContext,
    out: *mut AccelProbeResult,
    reason: AccelSink,
    engine_version: AccelSink,
) -> AccelStatus {
    guard(Slot::Plugin, "probe", || {
        if ctx.is_null() || out.is_null() {
            return Err(null_arg("probe", "context or result"));
        }
        // SAFETY: `ctx` is non-null and readable for its `struct_size`;
        // read the size alone first.
        let size = unsafe { std::ptr::addr_of!((*ctx).struct_size).read() };
        if size < min_size::PROBE_CONTEXT {
            return Err(too_small(
                "probe",
                "probe context",
                size,
                min_size::PROBE_CONTEXT,
            ));
        }
        // SAFETY: as above; `out` is non-null and writable for its size.
        let out_size = unsafe { std::ptr::addr_of!((*out).struct_size).read() };
        if out_size < min_size::PROBE_RESULT {
            return Err(too_small(
                "probe",
                "probe result",
                out_size,
                min_size::PROBE_RESULT,
            ));
        }
        // SAFETY: the 1.0 fields are readable (checked above); each read
        // stays inside them.
        let (world_size, local_world_size, mpi_launched) = unsafe {
            (
                std::ptr::addr_of!((*ctx).world_size).read(),
                std::ptr::addr_of!((*ctx).local_world_size).read(),
                std::ptr::addr_of!((*ctx).mpi_launched).read(),
            )
        };
        // A 1.0 host's context ends before the 1.1 field.
        let ranks_in_process = if size >= min_size::PROBE_CONTEXT_1_1 {
            // SAFETY: `struct_size` covers the 1.1 field.
            unsafe { std::ptr::addr_of!((*ctx).ranks_in_process).read() }
        } else {
            1
        };
        let probe = P::backend().probe(&ProbeContext {
            world_size,
            local_world_size,
            mpi_launched: mpi_launched != 0,
            ranks_in_process,
        });
        if let Some(r) = probe.reason() {
            // SAFETY: `reason` is valid for this call (ABI contract).
            unsafe { write_sink(reason, r.as_bytes()) };
        }
        if let Some(v) = &probe.engine_version {
            // SAFETY: `engine_version` is valid for this call.
            unsafe { write_sink(engine_version, v.as_bytes()) };
        }
        // SAFETY: `out` is writable for the 1.0 layout (checked above); we
        // write the 1.0 fields only, leaving `struct_size` as the host set it.
        unsafe {
            (*out).available = u32::from(probe.is_available());
            (*out).has_engine_version = u32::from(probe.engine_version.is_some());
            (*out).device_count = probe.device_count;
        }
        Ok(())
    })
}

unsafe extern "C" fn connect<P: Exported>(
    ctx: *const AccelConnectContext,
    out: *mut *mut AccelComm,
) -> AccelStatus {
    guard(Slot::Plugin, "connect", || {
        if ctx.is_null() || out.is_null() {
            return Err(null_arg("connect", "context or output pointer"));
        }
        // SAFETY: `out` is non-null and writable; null it first so that a
        // failure never leaves garbage there.
        unsafe { out.write(std::ptr::null_mut()) };
        // SAFETY: `ctx` is non-null and readable for its `struct_size`.
        let size = unsafe { std::ptr::addr_of!((*ctx).struct_size).read() };
        if size < min_size::CONNECT_CONTEXT {
            return Err(too_small(
                "connect",
                "connect context",
                size,
                min_size::CONNECT_CONTEXT,
            ));
        }
        // SAFETY: the 1.0 layout is readable (checked above).
        let c = unsafe { ctx.read() };
        // Take over the store reference first, so that it is released on
        // every path below (errors and panics included).
        // SAFETY: `c.store` is null or the host's vtable, valid for this call.
        let store = unsafe { ForeignStore::adopt(c.store) }?;
        // SAFETY: `run_id` points to text valid for this call.
        let run_id = unsafe { c.run_id.read() }
            .map(|s| s.into_owned())
            .unwrap_or_default();
        // The host wraps this communicator in its own group, which checks
        // every collective across ranks (ADR 0016): a group in here checks
        // only its first one (which compares the setting).
        let comm = accel_api::CallCheck::scoped(accel_api::CallCheck::Off, || {
            P::backend().connect(ConnectContext {
                rank: c.rank,
                world_size: c.world_size,
                local_rank: c.local_rank,
                local_world_size: c.local_world_size,
                device: convert::device("connect", c.device_kind, c.device_index)?,
                timeout: convert::ns_to_duration(c.timeout_ns),
                store: Arc::new(store),
                run_id,
            })
        })?;
        // SAFETY: `out` is non-null and writable (checked above).
        unsafe { out.write(ExportedComm::into_handle(comm)) };
        Ok(())
    })
}

// ---------------------------------------------------------------------------
// Communicator functions

/// What an [`AccelComm`] handle points to. Boxed twice so that the handle
/// is a thin pointer.
struct ExportedComm {
    comm: Box<dyn Communicator>,
}

impl ExportedComm {
    fn into_handle(comm: Box<dyn Communicator>) -> *mut AccelComm {
        Box::into_raw(Box::new(ExportedComm { comm })) as *mut AccelComm
    }

    /// The communicator behind `h`.
    ///
    /// # Safety
    /// `h` is null or a handle made by `into_handle` and not destroyed.
    unsafe fn get<'a>(h: *const AccelComm, function: &str) -> Result<&'a dyn Communicator> {
        if h.is_null() {
            return Err(null_arg(function, "communicator handle"));
        }
        // SAFETY: a live handle points to an `ExportedComm` (caller's
        // guarantee); it is only freed by `destroy`, which the host calls
        // once no other call is in flight.
        Ok(unsafe { &*(h as *const ExportedComm) }.comm.as_ref())
    }
}

/// Define an exported communicator function: `$body` runs with `c` bound to
/// the communicator, inside the panic guard.
macro_rules! comm_fn {
    ($fn_name:ident, $op:literal, ($($arg:ident: $ty:ty),*), |$c:ident| $body:block) => {
        unsafe extern "C" fn $fn_name(h: *const AccelComm $(, $arg: $ty)*) -> AccelStatus {
            guard(Slot::Plugin, $op, || {
                // SAFETY: `h` is a live handle (ABI contract).
                let $c = unsafe { ExportedComm::get(h, $op) }?;
                $body
            })
        }
    };
}

/// Write `v` to the out-pointer `out`, or fail on null.
///
/// # Safety
/// `out` is null or writable.
unsafe fn put<T>(function: &str, out: *mut T, v: T) -> Result<()> {
    if out.is_null() {
        return Err(null_arg(function, "output pointer"));
    }
    // SAFETY: non-null and writable (caller's guarantee).
    unsafe { out.write(v) };
    Ok(())
}

comm_fn!(comm_backend_name, "backend_name", (out: AccelSink), |c| {
    // SAFETY: `out` is valid for this call.
    unsafe { write_sink(out, c.backend_name().as_bytes()) };
    Ok(())
});

comm_fn!(comm_rank, "rank", (out: *mut usize), |c| {
    // SAFETY: `out` is null or writable (ABI contract).
    unsafe { put("rank", out, c.rank()) }
});

comm_fn!(comm_world_size, "world_size", (out: *mut usize), |c| {
    // SAFETY: `out` is null or writable (ABI contract).
    unsafe { put("world_size", out, c.world_size()) }
});

comm_fn!(comm_device, "device", (kind: *mut u32, index: *mut u32), |c| {
    let d = c.device();
    // SAFETY: both are null or writable (ABI contract).
    unsafe {
        put("device", kind, d.kind.code())?;
        put("device", index, d.index)
    }
});

comm_fn!(comm_timeout, "timeout", (out: *mut u64), |c| {
    // SAFETY: `out` is null or writable (ABI contract).
    unsafe { put("timeout", out, convert::duration_to_ns(c.timeout())) }
});

comm_fn!(comm_capabilities, "capabilities", (out: *mut AccelCapabilities), |c| {
    if out.is_null() {
        return Err(null_arg("capabilities", "output pointer"));
    }
    // SAFETY: non-null; readable for its `struct_size` (ABI contract).
    let size = unsafe { std::ptr::addr_of!((*out).struct_size).read() };
    if size < min_size::CAPABILITIES {
        return Err(too_small("capabilities", "capabilities struct", size, min_size::CAPABILITIES));
    }
    let mut caps = convert::caps_to_abi(c.capabilities());
    caps.struct_size = size;
    // SAFETY: writable for the 1.0 layout (checked above); `struct_size` is
    // written back unchanged.
    unsafe { out.write(caps) };
    Ok(())
});

comm_fn!(comm_all_reduce, "all_reduce", (buf: *const AccelBuf, op: u32), |c| {
    // SAFETY: `buf` describes memory the host lent us for this call.
    let buf = unsafe { convert::buf_mut_from_abi("all_reduce", "the", buf) }?;
    c.all_reduce(buf, convert::reduce_op("all_reduce", op)?)
});

comm_fn!(comm_reduce, "reduce", (buf: *const AccelBuf, op: u32, root: usize), |c| {
    // SAFETY: `buf` describes memory the host lent us for this call.
    let buf = unsafe { convert::buf_mut_from_abi("reduce", "the", buf) }?;
    c.reduce(buf, convert::reduce_op("reduce", op)?, root)
});

comm_fn!(comm_broadcast, "broadcast", (buf: *const AccelBuf, root: usize), |c| {
    // SAFETY: `buf` describes memory the host lent us for this call.
    let buf = unsafe { convert::buf_mut_from_abi("broadcast", "the", buf) }?;
    c.broadcast(buf, root)
});

comm_fn!(comm_all_gather, "all_gather", (send: *const AccelBuf, recv: *const AccelBuf), |c| {
    // SAFETY: both describe non-overlapping memory lent for this call.
    let (send, recv) = unsafe { convert::send_recv_from_abi("all_gather", send, recv) }?;
    c.all_gather(send, recv)
});

comm_fn!(
    comm_gather,
    "gather",
    (send: *const AccelBuf, recv: *const AccelBuf, root: usize),
    |c| {
        // SAFETY: both describe non-overlapping memory lent for this call;
        // `recv` may be null ("no receive buffer").
        let (send, recv) = unsafe {
            (
                convert::buf_from_abi("gather", "send", send)?,
                convert::opt_buf_mut_from_abi("gather", "recv", recv)?,
            )
        };
        c.gather(send, recv, root)
    }
);

comm_fn!(
    comm_scatter,
    "scatter",
    (send: *const AccelBuf, recv: *const AccelBuf, root: usize),
    |c| {
        // SAFETY: both describe non-overlapping memory lent for this call;
        // `send` may be null ("no send buffer").
        let (send, recv) = unsafe {
            (
                convert::opt_buf_from_abi("scatter", "send", send)?,
                convert::buf_mut_from_abi("scatter", "recv", recv)?,
            )
        };
        c.scatter(send, recv, root)
    }
);

comm_fn!(
    comm_reduce_scatter,
    "reduce_scatter",
    (send: *const AccelBuf, recv: *const AccelBuf, op: u32),
    |c| {
        // SAFETY: both describe non-overlapping memory lent for this call.
        let (send, recv) = unsafe { convert::send_recv_from_abi("reduce_scatter", send, recv) }?;
        c.reduce_scatter(send, recv, convert::reduce_op("reduce_scatter", op)?)
    }
);

comm_fn!(comm_all_to_all, "all_to_all", (send: *const AccelBuf, recv: *const AccelBuf), |c| {
    // SAFETY: both describe non-overlapping memory lent for this call.
    let (send, recv) = unsafe { convert::send_recv_from_abi("all_to_all", send, recv) }?;
    c.all_to_all(send, recv)
});

comm_fn!(comm_send, "send", (buf: *const AccelBuf, dst: usize, tag: u32), |c| {
    // SAFETY: `buf` describes memory lent for this call.
    let buf = unsafe { convert::buf_from_abi("send", "the", buf) }?;
    c.send(buf, dst, tag)
});

comm_fn!(comm_recv, "recv", (buf: *const AccelBuf, src: usize, tag: u32), |c| {
    // SAFETY: `buf` describes memory lent for this call.
    let buf = unsafe { convert::buf_mut_from_abi("recv", "the", buf) }?;
    c.recv(buf, src, tag)
});

comm_fn!(comm_barrier, "barrier", (), |c| { c.barrier() });

comm_fn!(
    comm_split,
    "split",
    (has_color: u32, color: u32, key: u32, out: *mut *mut AccelComm),
    |c| {
        if out.is_null() {
            return Err(null_arg("split", "output pointer"));
        }
        // SAFETY: `out` is non-null and writable; null it first.
        unsafe { out.write(std::ptr::null_mut()) };
        let sub = c.split((has_color != 0).then_some(color), key)?;
        if let Some(sub) = sub {
            // SAFETY: as above.
            unsafe { out.write(ExportedComm::into_handle(sub)) };
        }
        Ok(())
    }
);

comm_fn!(comm_abort, "abort", (reason: AccelStr), |c| {
    // SAFETY: `reason` points to text valid for this call.
    let reason = unsafe { reason.read() }.unwrap_or_default();
    c.abort(&reason);
    Ok(())
});

unsafe extern "C" fn comm_destroy(h: *mut AccelComm) -> AccelStatus {
    guard(Slot::Plugin, "destroy", || {
        if !h.is_null() {
            // SAFETY: `h` was made by `into_handle` and the host destroys it
            // exactly once, with no call in flight (ABI contract).
            drop(unsafe { Box::from_raw(h as *mut ExportedComm) });
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------
// The host's store, seen from the plugin

/// The host's [`Store`] behind an [`AccelStoreV1`] vtable. Owns one
/// reference to the host's store; gives it back on drop.
pub(crate) struct ForeignStore {
    vt: AccelStoreV1,
}

// SAFETY: the ABI requires the host's store callbacks and `ctx` to be
// thread-safe (the host's `Store` is `Send + Sync`); the vtable itself is a
// plain copy.
unsafe impl Send for ForeignStore {}
// SAFETY: as for `Send`.
unsafe impl Sync for ForeignStore {}

impl Drop for ForeignStore {
    fn drop(&mut self) {
        if let Some(release) = self.vt.release {
            // SAFETY: we own one reference to `ctx` and give it back once.
            unsafe { release(self.vt.ctx) }
        }
    }
}

fn store_error(what: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, what).with_op("connect")
}

impl ForeignStore {
    /// Take over the host's store reference.
    ///
    /// # Safety
    /// `vt` is null or points to a store vtable readable for its
    /// `struct_size`.
    pub(crate) unsafe fn adopt(vt: *const AccelStoreV1) -> Result<ForeignStore> {
        if vt.is_null() {
            return Err(store_error("the host passed no store".into()));
        }
        // SAFETY: readable for its `struct_size` (caller's guarantee).
        let size = unsafe { std::ptr::addr_of!((*vt).struct_size).read() };
        if size < min_size::STORE {
            return Err(too_small("connect", "store vtable", size, min_size::STORE));
        }
        // SAFETY: the 1.0 layout is readable (checked above).
        let vt = unsafe { vt.read() };
        Ok(ForeignStore { vt })
    }

    fn check(&self, function: &str, status: AccelStatus) -> Result<()> {
        if status == ACCEL_OK {
            return Ok(());
        }
        let record = match self.vt.last_error {
            // SAFETY: `ctx` is live while we hold our reference.
            Some(f) => unsafe { f(self.vt.ctx) },
            None => std::ptr::null(),
        };
        // SAFETY: the record is valid until the host's next store call on
        // this thread; `decode_error` copies what it needs.
        Err(unsafe {
            convert::decode_error(
                status,
                record,
                Origin {
                    path: None,
                    function,
                },
            )
        })
    }

    fn missing(&self, function: &str) -> Error {
        Error::new(
            ErrorKind::Unsupported,
            format!("the host's store has no `{function}` callback"),
        )
        .with_op(function)
    }
}

fn key_str(key: &str) -> AccelStr {
    AccelStr::new(key)
}

impl Store for ForeignStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let f = self.vt.set.ok_or_else(|| self.missing("store set"))?;
        // SAFETY: live `ctx`; key and value outlive the call.
        let st = unsafe { f(self.vt.ctx, key_str(key), AccelBytes::new(value)) };
        self.check("store set", st)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let f = self.vt.get.ok_or_else(|| self.missing("store get"))?;
        let mut value = VecSink::default();
        // SAFETY: live `ctx`; key and sink outlive the call.
        let st = unsafe {
            f(
                self.vt.ctx,
                key_str(key),
                convert::duration_to_ns(timeout),
                value.sink(),
            )
        };
        self.check("store get", st)?;
        Ok(value.into_bytes())
    }

    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let f = self
            .vt
            .try_get
            .ok_or_else(|| self.missing("store try_get"))?;
        let mut value = VecSink::default();
        let mut found = 0u32;
        // SAFETY: live `ctx`; key, `found` and sink outlive the call.
        let st = unsafe { f(self.vt.ctx, key_str(key), &mut found, value.sink()) };
        self.check("store try_get", st)?;
        Ok((found != 0).then(|| value.into_bytes()))
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let f = self.vt.add.ok_or_else(|| self.missing("store add"))?;
        let mut out = 0i64;
        // SAFETY: live `ctx`; key and `out` outlive the call.
        let st = unsafe { f(self.vt.ctx, key_str(key), delta, &mut out) };
        self.check("store add", st)?;
        Ok(out)
    }

    fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> Result<CasOutcome> {
        let f = self
            .vt
            .compare_set
            .ok_or_else(|| self.missing("store compare_set"))?;
        let expected = expected.map(AccelBytes::new);
        let expected_ptr = expected
            .as_ref()
            .map_or(std::ptr::null(), |e| e as *const AccelBytes);
        let mut outcome = ACCEL_CAS_SWAPPED;
        let mut current = VecSink::default();
        // SAFETY: live `ctx`; every pointer outlives the call.
        let st = unsafe {
            f(
                self.vt.ctx,
                key_str(key),
                expected_ptr,
                AccelBytes::new(new),
                &mut outcome,
                current.sink(),
            )
        };
        self.check("store compare_set", st)?;
        Ok(match outcome {
            ACCEL_CAS_SWAPPED => CasOutcome::Swapped,
            ACCEL_CAS_ABSENT => CasOutcome::Current(None),
            _ => CasOutcome::Current(Some(current.into_bytes())),
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let f = self.vt.wait.ok_or_else(|| self.missing("store wait"))?;
        let views: Vec<AccelStr> = keys.iter().map(|k| key_str(k)).collect();
        // SAFETY: live `ctx`; the key views and their text outlive the call.
        let st = unsafe {
            f(
                self.vt.ctx,
                views.as_ptr(),
                views.len(),
                convert::duration_to_ns(timeout),
            )
        };
        self.check("store wait", st)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        let f = self.vt.delete.ok_or_else(|| self.missing("store delete"))?;
        let mut existed = 0u32;
        // SAFETY: live `ctx`; key and `existed` outlive the call.
        let st = unsafe { f(self.vt.ctx, key_str(key), &mut existed) };
        self.check("store delete", st)?;
        Ok(existed != 0)
    }

    fn describe(&self) -> String {
        let Some(f) = self.vt.describe else {
            return "host store".to_string();
        };
        let mut out = VecSink::default();
        // SAFETY: live `ctx`; the sink outlives the call.
        let st = unsafe { f(self.vt.ctx, out.sink()) };
        match self.check("store describe", st) {
            Ok(()) => out.into_string(),
            Err(e) => format!("host store (describe failed: {e})"),
        }
    }
}
