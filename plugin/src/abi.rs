//! The accel plugin C ABI, version 1.1: the one thing a plugin and a host
//! agree on.
//!
//! Everything in this module is `#[repr(C)]` data or `extern "C"` function
//! pointer types. No Rust type with an unspecified layout (`String`, `Vec`,
//! `Result`, `dyn Trait`, `&str`, enums with data) ever crosses the boundary,
//! so a plugin built with another rustc — or written in C or C++ — can be
//! loaded by any host speaking the same major version.
//!
//! # Entry point
//!
//! A plugin is a shared object exporting one C symbol, [`ENTRY_SYMBOL`]:
//!
//! ```c
//! const AccelPluginV1 *accel_plugin_entry_v1(void);
//! ```
//!
//! It returns a pointer to a table ([`AccelPluginV1`]) that lives as long as
//! the process (a `static`). The host calls it once per load, right after
//! `dlopen`.
//!
//! # Versioning
//!
//! * Every table and every struct that may grow starts with
//!   `struct_size: usize`, the size in bytes of the struct *as the writer
//!   compiled it*. The plugin table then carries `abi_major` and `abi_minor`.
//! * **Major** ([`ACCEL_PLUGIN_ABI_MAJOR`]) changes only when an existing field
//!   changes meaning or place. A host loads only plugins of its own major; the
//!   entry symbol carries the major in its name (`_v1`) so that a future
//!   major can be exported side by side.
//! * **Minor** ([`ACCEL_PLUGIN_ABI_MINOR`]) grows when fields are *appended*.
//!   Fields are never removed, reordered or retyped within a major. A reader
//!   uses only the fields it knows and checks `struct_size` before reading a
//!   field added after 1.0, so a newer plugin works with an older host and
//!   an older plugin with a newer host. A `struct_size` smaller than the 1.0
//!   layout is an error.
//!
//! # Calling convention
//!
//! * Every function returns an [`AccelStatus`]: [`ACCEL_OK`] (0) or one code
//!   per [`accel_api::ErrorKind`] family (`ACCEL_ERR_*`), plus
//!   [`ACCEL_ERR_PANICKED`] when the implementation panicked (the panic was
//!   caught at the boundary; it never unwinds into the caller).
//! * After a non-zero status, the caller reads the details on the **same
//!   thread** through the table's `last_error` accessor, which returns an
//!   [`AccelError`] owned by the callee. It stays valid until the next call
//!   into the same side on the same thread; copy what you need.
//! * Outputs of fixed size go through out-pointers the caller provides.
//!   Outputs of variable size (names, reasons, store values) go through an
//!   [`AccelSink`] the **receiving** side provides: the callee calls
//!   `sink.write` zero or more times, each call appending bytes.
//! * Strings are UTF-8 `ptr + len` ([`AccelStr`]), not NUL-terminated. A null
//!   `ptr` means "absent" where a field is optional.
//! * Element types, reductions, device kinds and operations cross as the
//!   stable numbers of [`DType::code`](accel_api::DType::code),
//!   [`ReduceOp::code`](accel_api::ReduceOp::code),
//!   [`DeviceKind::code`](accel_api::DeviceKind::code) and
//!   [`Op::bit`](accel_api::Op::bit). Sets of them cross as `u32` bit sets
//!   (`1 << code`, or `Op::bit()`); unknown bits are ignored by the reader.
//! * Durations cross as `u64` nanoseconds, saturating ([`u64::MAX`] ≈ 584
//!   years, "no bound").
//! * Optional integers use [`ACCEL_NONE`] (`usize::MAX`) for "absent".
//!
//! # Lifetimes and threads
//!
//! * A communicator handle ([`AccelComm`]) is created by `connect` or
//!   `split` and destroyed exactly once by the table's `destroy`. Handles are
//!   thread-safe: every function but `destroy` may be called from several
//!   threads at once (the Rust [`Communicator`](accel_api::Communicator) is
//!   `Send + Sync`).
//! * Buffers ([`AccelBuf`]) are borrowed for the duration of one call.
//!   Read-only arguments (`send`) must not be written; a call's buffers must
//!   not overlap each other.
//! * The host's store ([`AccelStoreV1`]) is handed to `connect`; the plugin
//!   copies the vtable and owns one reference to `ctx`, which it gives back
//!   with `release` exactly once (also when `connect` fails). It may keep the
//!   store for the communicator's lifetime (engines rendezvous again in
//!   `split`).
//! * A loaded library is never unloaded.
#![allow(unsafe_code)]

use std::ffi::c_void;

/// The major version of this ABI. A host loads only plugins of its major.
pub const ACCEL_PLUGIN_ABI_MAJOR: u32 = 1;

/// The minor version of this ABI: the number of append-only revisions made
/// to major 1. 1.1: [`AccelProbeContext::ranks_in_process`].
pub const ACCEL_PLUGIN_ABI_MINOR: u32 = 1;

/// The name of the symbol a plugin exports (type [`AccelPluginEntryV1`]).
pub const ENTRY_SYMBOL: &str = "accel_plugin_entry_v1";

/// The type of the entry symbol: returns the plugin table, or null when the
/// plugin cannot initialise at all.
pub type AccelPluginEntryV1 = unsafe extern "C" fn() -> *const AccelPluginV1;

/// The status every ABI function returns: [`ACCEL_OK`] or an `ACCEL_ERR_*`
/// code.
pub type AccelStatus = i32;

/// Success.
pub const ACCEL_OK: AccelStatus = 0;
/// [`ErrorKind::Unavailable`](accel_api::ErrorKind::Unavailable).
pub const ACCEL_ERR_UNAVAILABLE: AccelStatus = 1;
/// [`ErrorKind::Unsupported`](accel_api::ErrorKind::Unsupported).
pub const ACCEL_ERR_UNSUPPORTED: AccelStatus = 2;
/// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig).
pub const ACCEL_ERR_INVALID_CONFIG: AccelStatus = 3;
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument).
pub const ACCEL_ERR_INVALID_ARGUMENT: AccelStatus = 4;
/// [`ErrorKind::Timeout`](accel_api::ErrorKind::Timeout); the bound is in
/// [`AccelError::timeout_ns`].
pub const ACCEL_ERR_TIMEOUT: AccelStatus = 5;
/// [`ErrorKind::PeerLost`](accel_api::ErrorKind::PeerLost); the lost rank is
/// in [`AccelError::peer`].
pub const ACCEL_ERR_PEER_LOST: AccelStatus = 6;
/// [`ErrorKind::Mismatch`](accel_api::ErrorKind::Mismatch); the per-rank
/// table is in [`AccelError::mismatch`].
pub const ACCEL_ERR_MISMATCH: AccelStatus = 7;
/// [`ErrorKind::Plugin`](accel_api::ErrorKind::Plugin); path and symbol in
/// [`AccelError::plugin_path`] and [`AccelError::plugin_symbol`].
pub const ACCEL_ERR_PLUGIN: AccelStatus = 8;
/// [`ErrorKind::Io`](accel_api::ErrorKind::Io).
pub const ACCEL_ERR_IO: AccelStatus = 9;
/// [`ErrorKind::Backend`](accel_api::ErrorKind::Backend), and any kind this
/// ABI version has no code for (the message then starts with the kind's
/// name).
pub const ACCEL_ERR_BACKEND: AccelStatus = 10;
/// [`ErrorKind::Poisoned`](accel_api::ErrorKind::Poisoned).
pub const ACCEL_ERR_POISONED: AccelStatus = 11;
/// [`ErrorKind::Unauthorized`](accel_api::ErrorKind::Unauthorized).
pub const ACCEL_ERR_UNAUTHORIZED: AccelStatus = 12;
/// [`ErrorKind::Aborted`](accel_api::ErrorKind::Aborted).
pub const ACCEL_ERR_ABORTED: AccelStatus = 13;
/// [`ErrorKind::Corrupt`](accel_api::ErrorKind::Corrupt).
pub const ACCEL_ERR_CORRUPT: AccelStatus = 14;
/// The implementation panicked; the panic was caught at the boundary. The
/// message reads `plugin panicked in <function>: <payload>` and
/// [`AccelError::plugin_symbol`] names the function. The host reports it as
/// [`ErrorKind::Plugin`](accel_api::ErrorKind::Plugin) with the library path.
pub const ACCEL_ERR_PANICKED: AccelStatus = 15;

/// "Absent" for optional `usize` fields (ranks, peers).
pub const ACCEL_NONE: usize = usize::MAX;

/// [`AccelBuf::memory`]: host memory at [`AccelBuf::host_ptr`].
pub const ACCEL_MEMORY_HOST: u32 = 1;
/// [`AccelBuf::memory`]: device memory at [`AccelBuf::device_addr`].
pub const ACCEL_MEMORY_DEVICE: u32 = 2;

/// `compare_set` outcome: the value was swapped.
pub const ACCEL_CAS_SWAPPED: u32 = 0;
/// `compare_set` outcome: not swapped; the current value went to the sink.
pub const ACCEL_CAS_CURRENT: u32 = 1;
/// `compare_set` outcome: not swapped; the key is absent.
pub const ACCEL_CAS_ABSENT: u32 = 2;

/// Borrowed UTF-8 text: `len` bytes at `ptr`, no terminating NUL. A null
/// `ptr` is "absent" (and `len` is then 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelStr {
    /// First byte, or null for "absent".
    pub ptr: *const u8,
    /// Number of bytes.
    pub len: usize,
}

/// Borrowed bytes: `len` bytes at `ptr` (null allowed when `len` is 0).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelBytes {
    /// First byte.
    pub ptr: *const u8,
    /// Number of bytes.
    pub len: usize,
}

/// A byte sink the receiving side of a call provides for a variable-size
/// result. The callee calls `write(ctx, ptr, len)` zero or more times; each
/// call appends `len` bytes. `write` never fails and must not unwind.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelSink {
    /// The receiver's state, passed back to `write`.
    pub ctx: *mut c_void,
    /// Append bytes.
    pub write: Option<unsafe extern "C" fn(ctx: *mut c_void, ptr: *const u8, len: usize)>,
}

/// One row of a mismatch table ([`accel_api::MismatchEntry`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelMismatchRow {
    /// The rank the row describes.
    pub rank: usize,
    /// What it called; absent (null) when it never reported.
    pub call: AccelStr,
}

/// The details of the last failure on this thread, as returned by the
/// `last_error` accessors. Owned by the side that failed; valid until its
/// next call on this thread.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelError {
    /// Size of this struct as the writer compiled it.
    pub struct_size: usize,
    /// The status code of the failure.
    pub status: AccelStatus,
    /// The human message, without context prefix.
    pub message: AccelStr,
    /// The operation (`all_reduce`, `connect`, ...), or absent.
    pub op: AccelStr,
    /// The backend name, or absent.
    pub backend: AccelStr,
    /// The suggested fix, or absent.
    pub fix: AccelStr,
    /// The underlying cause rendered to text, or absent.
    pub source: AccelStr,
    /// The rank that observed the error, or [`ACCEL_NONE`].
    pub rank: usize,
    /// [`ACCEL_ERR_PEER_LOST`]: the lost rank, or [`ACCEL_NONE`].
    pub peer: usize,
    /// [`ACCEL_ERR_TIMEOUT`]: the bound that was exceeded, in nanoseconds.
    pub timeout_ns: u64,
    /// [`ACCEL_ERR_PLUGIN`]: the shared object involved, or absent.
    pub plugin_path: AccelStr,
    /// [`ACCEL_ERR_PLUGIN`], [`ACCEL_ERR_PANICKED`]: the symbol or function
    /// involved, or absent.
    pub plugin_symbol: AccelStr,
    /// [`ACCEL_ERR_MISMATCH`]: `mismatch_len` rows (null when 0).
    pub mismatch: *const AccelMismatchRow,
    /// Number of rows at `mismatch`.
    pub mismatch_len: usize,
}

/// A buffer argument: host memory or a device address, with its element
/// count, element type and device. Borrowed for one call.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelBuf {
    /// [`ACCEL_MEMORY_HOST`] or [`ACCEL_MEMORY_DEVICE`].
    pub memory: u32,
    /// [`DType::code`](accel_api::DType::code) of the elements.
    pub dtype: u32,
    /// Number of elements (not bytes).
    pub len: usize,
    /// Host memory: the first byte, aligned for `dtype`, `len * size`
    /// bytes long (may be null when `len` is 0). Null for device memory.
    pub host_ptr: *mut u8,
    /// Device memory: the device address of the first element.
    pub device_addr: u64,
    /// [`DeviceKind::code`](accel_api::DeviceKind::code) of the memory's
    /// device (CPU for host memory).
    pub device_kind: u32,
    /// Ordinal of the device among those of its kind.
    pub device_index: u32,
    /// Device memory: the engine stream the buffer is ordered on (0 =
    /// default).
    pub stream: u64,
}

/// The shape of the run, for `probe` ([`accel_api::ProbeContext`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelProbeContext {
    /// Size of this struct as the host compiled it.
    pub struct_size: usize,
    /// Number of processes in the run.
    pub world_size: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// 1 when an MPI launcher started the process, else 0.
    pub mpi_launched: u32,
    /// ABI 1.1: how many of the run's ranks this process hosts (as
    /// threads); 1 when each rank is a process. A plugin reads it only when
    /// `struct_size` covers it (a 1.0 host's context does not: 1).
    pub ranks_in_process: usize,
}

/// The outcome of `probe` ([`accel_api::Probe`]); the host sets
/// `struct_size`, the plugin fills the rest. The reason and the engine
/// version go to the sinks passed alongside.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelProbeResult {
    /// Size of this struct as the host compiled it.
    pub struct_size: usize,
    /// 1 when available; 0 when not (the reason went to the reason sink).
    pub available: u32,
    /// 1 when the engine version went to the version sink.
    pub has_engine_version: u32,
    /// Devices of the backend's kind visible to this process.
    pub device_count: usize,
}

/// Everything `connect` needs ([`accel_api::ConnectContext`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelConnectContext {
    /// Size of this struct as the host compiled it.
    pub struct_size: usize,
    /// This process's rank.
    pub rank: usize,
    /// Number of processes.
    pub world_size: usize,
    /// Rank among the processes on this machine.
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// [`DeviceKind::code`](accel_api::DeviceKind::code) of the device.
    pub device_kind: u32,
    /// Ordinal of the device.
    pub device_index: u32,
    /// The bound for every blocking call, in nanoseconds.
    pub timeout_ns: u64,
    /// Identifier shared by all ranks of the run.
    pub run_id: AccelStr,
    /// The host's rendezvous store. The plugin copies it and takes over one
    /// reference to its `ctx` (see [`AccelStoreV1::release`]).
    pub store: *const AccelStoreV1,
}

/// What a communicator accepts ([`accel_api::Capabilities`]), as bit sets.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelCapabilities {
    /// Size of this struct as the host compiled it.
    pub struct_size: usize,
    /// Union of [`Op::bit`](accel_api::Op::bit).
    pub ops: u32,
    /// `1 << DType::code()` for each data-movement element type.
    pub dtypes: u32,
    /// `1 << DType::code()` for each reduction element type.
    pub reduce_dtypes: u32,
    /// `1 << ReduceOp::code()` for each reduction.
    pub reduce_ops: u32,
    /// `1 << DeviceKind::code()` for each device kind whose memory is taken.
    pub device_kinds: u32,
    /// 1 when `abort` interrupts an operation in flight.
    pub abort_interrupts: u32,
}

/// The host's rendezvous store ([`accel_api::Store`]) as a vtable of
/// callbacks, so that a plugin's engine bootstraps through the same store as
/// every other rank.
///
/// Every callback takes `ctx` first, returns an [`AccelStatus`] and, after a
/// failure, leaves the details for `last_error(ctx)` on the calling thread.
/// Callbacks are thread-safe and never unwind. Timeouts are nanoseconds.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelStoreV1 {
    /// Size of this struct as the host compiled it.
    pub struct_size: usize,
    /// The host's store.
    pub ctx: *mut c_void,
    /// Give back the reference to `ctx`; called exactly once by the plugin.
    pub release: Option<unsafe extern "C" fn(ctx: *mut c_void)>,
    /// Details of the last failed callback on this thread.
    pub last_error: Option<unsafe extern "C" fn(ctx: *mut c_void) -> *const AccelError>,
    /// [`Store::set`](accel_api::Store::set).
    pub set: Option<
        unsafe extern "C" fn(ctx: *mut c_void, key: AccelStr, value: AccelBytes) -> AccelStatus,
    >,
    /// [`Store::get`](accel_api::Store::get): the value goes to `value`.
    pub get: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: AccelStr,
            timeout_ns: u64,
            value: AccelSink,
        ) -> AccelStatus,
    >,
    /// [`Store::try_get`](accel_api::Store::try_get): `*found` is 1 and the
    /// value went to `value`, or 0.
    pub try_get: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: AccelStr,
            found: *mut u32,
            value: AccelSink,
        ) -> AccelStatus,
    >,
    /// [`Store::add`](accel_api::Store::add): the new value goes to `*out`.
    pub add: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: AccelStr,
            delta: i64,
            out: *mut i64,
        ) -> AccelStatus,
    >,
    /// [`Store::compare_set`](accel_api::Store::compare_set): `expected` null
    /// means "absent". `*outcome` is an `ACCEL_CAS_*` code; with
    /// [`ACCEL_CAS_CURRENT`] the current value went to `current`.
    pub compare_set: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            key: AccelStr,
            expected: *const AccelBytes,
            desired: AccelBytes,
            outcome: *mut u32,
            current: AccelSink,
        ) -> AccelStatus,
    >,
    /// [`Store::wait`](accel_api::Store::wait) on `n_keys` keys at `keys`.
    pub wait: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            keys: *const AccelStr,
            n_keys: usize,
            timeout_ns: u64,
        ) -> AccelStatus,
    >,
    /// [`Store::delete`](accel_api::Store::delete): `*existed` is 1 or 0.
    pub delete: Option<
        unsafe extern "C" fn(ctx: *mut c_void, key: AccelStr, existed: *mut u32) -> AccelStatus,
    >,
    /// [`Store::describe`](accel_api::Store::describe), to `out`.
    pub describe: Option<unsafe extern "C" fn(ctx: *mut c_void, out: AccelSink) -> AccelStatus>,
}

/// An opaque communicator handle owned by the plugin.
#[repr(C)]
#[derive(Debug)]
pub struct AccelComm {
    _private: [u8; 0],
}

/// The plugin table: what [`ENTRY_SYMBOL`] returns. One backend per plugin.
///
/// The first three fields are the same in every major version and are read
/// before anything else.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelPluginV1 {
    /// Size of this struct as the plugin compiled it.
    pub struct_size: usize,
    /// Must equal the host's [`ACCEL_PLUGIN_ABI_MAJOR`].
    pub abi_major: u32,
    /// The plugin's [`ACCEL_PLUGIN_ABI_MINOR`]; newer than the host's is fine.
    pub abi_minor: u32,
    /// The communicator table (static, never null).
    pub comm: *const AccelCommV1,
    /// Details of the last failed call into this plugin on this thread.
    pub last_error: Option<unsafe extern "C" fn() -> *const AccelError>,
    /// The plugin's own version (its crate version), to `out`.
    pub plugin_version: Option<unsafe extern "C" fn(out: AccelSink) -> AccelStatus>,
    /// [`Backend::name`](accel_api::Backend::name), to `out`.
    pub name: Option<unsafe extern "C" fn(out: AccelSink) -> AccelStatus>,
    /// [`Backend::priority`](accel_api::Backend::priority).
    pub priority: Option<unsafe extern "C" fn(out: *mut i32) -> AccelStatus>,
    /// [`Backend::device_kind`](accel_api::Backend::device_kind), as a code.
    pub device_kind: Option<unsafe extern "C" fn(out: *mut u32) -> AccelStatus>,
    /// [`Backend::probe`](accel_api::Backend::probe).
    pub probe: Option<
        unsafe extern "C" fn(
            ctx: *const AccelProbeContext,
            out: *mut AccelProbeResult,
            reason: AccelSink,
            engine_version: AccelSink,
        ) -> AccelStatus,
    >,
    /// [`Backend::connect`](accel_api::Backend::connect): the new handle goes
    /// to `*out`.
    pub connect: Option<
        unsafe extern "C" fn(
            ctx: *const AccelConnectContext,
            out: *mut *mut AccelComm,
        ) -> AccelStatus,
    >,
}

/// The first fields of every plugin table, whatever its major.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelPluginHeader {
    /// Size of the whole table as the plugin compiled it.
    pub struct_size: usize,
    /// The table's major version.
    pub abi_major: u32,
    /// The table's minor version.
    pub abi_minor: u32,
}

/// Shorthand for the type of a communicator function taking one buffer.
type CommFn<A> = Option<unsafe extern "C" fn(comm: *const AccelComm, A) -> AccelStatus>;

/// The communicator table: one function per
/// [`Communicator`](accel_api::Communicator) method, each taking the handle
/// first.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AccelCommV1 {
    /// Size of this struct as the plugin compiled it.
    pub struct_size: usize,
    /// [`Communicator::backend_name`](accel_api::Communicator::backend_name), to `out`.
    pub backend_name: CommFn<AccelSink>,
    /// [`Communicator::rank`](accel_api::Communicator::rank).
    pub rank: CommFn<*mut usize>,
    /// [`Communicator::world_size`](accel_api::Communicator::world_size).
    pub world_size: CommFn<*mut usize>,
    /// [`Communicator::device`](accel_api::Communicator::device): kind code
    /// and ordinal.
    pub device: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            kind: *mut u32,
            index: *mut u32,
        ) -> AccelStatus,
    >,
    /// [`Communicator::timeout`](accel_api::Communicator::timeout), in ns.
    pub timeout: CommFn<*mut u64>,
    /// [`Communicator::capabilities`](accel_api::Communicator::capabilities);
    /// the caller sets `struct_size`.
    pub capabilities: CommFn<*mut AccelCapabilities>,
    /// [`Communicator::all_reduce`](accel_api::Communicator::all_reduce).
    pub all_reduce: Option<
        unsafe extern "C" fn(comm: *const AccelComm, buf: *const AccelBuf, op: u32) -> AccelStatus,
    >,
    /// [`Communicator::reduce`](accel_api::Communicator::reduce).
    pub reduce: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            buf: *const AccelBuf,
            op: u32,
            root: usize,
        ) -> AccelStatus,
    >,
    /// [`Communicator::broadcast`](accel_api::Communicator::broadcast).
    pub broadcast: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            buf: *const AccelBuf,
            root: usize,
        ) -> AccelStatus,
    >,
    /// [`Communicator::all_gather`](accel_api::Communicator::all_gather).
    pub all_gather: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            send: *const AccelBuf,
            recv: *const AccelBuf,
        ) -> AccelStatus,
    >,
    /// [`Communicator::gather`](accel_api::Communicator::gather); `recv` may
    /// be null (not the root).
    pub gather: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            send: *const AccelBuf,
            recv: *const AccelBuf,
            root: usize,
        ) -> AccelStatus,
    >,
    /// [`Communicator::scatter`](accel_api::Communicator::scatter); `send`
    /// may be null (not the root).
    pub scatter: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            send: *const AccelBuf,
            recv: *const AccelBuf,
            root: usize,
        ) -> AccelStatus,
    >,
    /// [`Communicator::reduce_scatter`](accel_api::Communicator::reduce_scatter).
    pub reduce_scatter: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            send: *const AccelBuf,
            recv: *const AccelBuf,
            op: u32,
        ) -> AccelStatus,
    >,
    /// [`Communicator::all_to_all`](accel_api::Communicator::all_to_all).
    pub all_to_all: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            send: *const AccelBuf,
            recv: *const AccelBuf,
        ) -> AccelStatus,
    >,
    /// [`Communicator::send`](accel_api::Communicator::send).
    pub send: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            buf: *const AccelBuf,
            dst: usize,
            tag: u32,
        ) -> AccelStatus,
    >,
    /// [`Communicator::recv`](accel_api::Communicator::recv).
    pub recv: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            buf: *const AccelBuf,
            src: usize,
            tag: u32,
        ) -> AccelStatus,
    >,
    /// [`Communicator::barrier`](accel_api::Communicator::barrier).
    pub barrier: Option<unsafe extern "C" fn(comm: *const AccelComm) -> AccelStatus>,
    /// [`Communicator::split`](accel_api::Communicator::split): `has_color`
    /// 0 means `None`. The new handle goes to `*out`, null when this rank
    /// passed no color.
    pub split: Option<
        unsafe extern "C" fn(
            comm: *const AccelComm,
            has_color: u32,
            color: u32,
            key: u32,
            out: *mut *mut AccelComm,
        ) -> AccelStatus,
    >,
    /// [`Communicator::abort`](accel_api::Communicator::abort).
    pub abort: CommFn<AccelStr>,
    /// Destroy the handle (drops the communicator). Called exactly once.
    pub destroy: Option<unsafe extern "C" fn(comm: *mut AccelComm) -> AccelStatus>,
}

// SAFETY: a plugin table holds only function pointers, plain integers and a
// pointer to the immutable, 'static communicator table; nothing in it is
// ever written after construction, so sharing it between threads is sound
// (this is what lets a plugin put it in a `static`).
unsafe impl Sync for AccelPluginV1 {}
// SAFETY: as for `Sync` above: immutable function pointers and a pointer to
// immutable 'static data.
unsafe impl Send for AccelPluginV1 {}
// SAFETY: the communicator table holds only function pointers.
unsafe impl Sync for AccelCommV1 {}
// SAFETY: the communicator table holds only function pointers.
unsafe impl Send for AccelCommV1 {}

/// The size of the 1.0 layout of each struct: the minimum `struct_size` a
/// reader accepts.
pub mod min_size {
    use super::*;

    /// [`AccelPluginV1`] as of ABI 1.0.
    pub const PLUGIN: usize = std::mem::size_of::<AccelPluginV1>();
    /// [`AccelCommV1`] as of ABI 1.0.
    pub const COMM: usize = std::mem::size_of::<AccelCommV1>();
    /// [`AccelError`] as of ABI 1.0.
    pub const ERROR: usize = std::mem::size_of::<AccelError>();
    /// [`AccelStoreV1`] as of ABI 1.0.
    pub const STORE: usize = std::mem::size_of::<AccelStoreV1>();
    /// [`AccelProbeContext`] as of ABI 1.0 (up to `mpi_launched`, with
    /// its padding).
    pub const PROBE_CONTEXT: usize = std::mem::offset_of!(AccelProbeContext, ranks_in_process);
    /// [`AccelProbeContext`] as of ABI 1.1 (with `ranks_in_process`).
    pub const PROBE_CONTEXT_1_1: usize = std::mem::size_of::<AccelProbeContext>();
    /// [`AccelProbeResult`] as of ABI 1.0.
    pub const PROBE_RESULT: usize = std::mem::size_of::<AccelProbeResult>();
    /// [`AccelConnectContext`] as of ABI 1.0.
    pub const CONNECT_CONTEXT: usize = std::mem::size_of::<AccelConnectContext>();
    /// [`AccelCapabilities`] as of ABI 1.0.
    pub const CAPABILITIES: usize = std::mem::size_of::<AccelCapabilities>();
    /// [`AccelPluginHeader`], common to every major.
    pub const HEADER: usize = std::mem::size_of::<AccelPluginHeader>();
}

impl AccelProbeResult {
    /// What a host passes: its size set, nothing else.
    pub fn unset() -> AccelProbeResult {
        AccelProbeResult {
            struct_size: min_size::PROBE_RESULT,
            available: 0,
            has_engine_version: 0,
            device_count: 0,
        }
    }
}

impl AccelStr {
    /// The absent string.
    pub const NONE: AccelStr = AccelStr {
        ptr: std::ptr::null(),
        len: 0,
    };

    /// Borrow `s` (the caller keeps `s` alive while the view is used).
    pub fn new(s: &str) -> AccelStr {
        AccelStr {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// Borrow `s`, or absent.
    pub fn opt(s: Option<&str>) -> AccelStr {
        s.map_or(AccelStr::NONE, AccelStr::new)
    }

    /// Read the text (lossy UTF-8); `None` when absent.
    ///
    /// # Safety
    /// When `ptr` is not null it must point to `len` readable bytes that
    /// stay valid and unchanged for `'a`.
    pub unsafe fn read<'a>(self) -> Option<std::borrow::Cow<'a, str>> {
        if self.ptr.is_null() {
            return None;
        }
        // SAFETY: the caller guarantees `len` readable bytes at `ptr` for 'a.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        Some(String::from_utf8_lossy(bytes))
    }
}

impl AccelBytes {
    /// Borrow `b` (the caller keeps `b` alive while the view is used).
    pub fn new(b: &[u8]) -> AccelBytes {
        AccelBytes {
            ptr: b.as_ptr(),
            len: b.len(),
        }
    }

    /// Read the bytes.
    ///
    /// # Safety
    /// When `len` is not 0, `ptr` must point to `len` readable bytes that
    /// stay valid and unchanged for `'a`.
    pub unsafe fn read<'a>(self) -> &'a [u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the caller guarantees `len` readable bytes at `ptr` for 'a.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// `1 << code` for each item, ignoring codes beyond 31.
pub fn bits(codes: impl IntoIterator<Item = u32>) -> u32 {
    codes
        .into_iter()
        .filter(|c| *c < 32)
        .fold(0, |acc, c| acc | (1 << c))
}

/// The codes set in `bits`.
pub fn codes(bits: u32) -> impl Iterator<Item = u32> {
    (0..32).filter(move |c| bits & (1 << c) != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_is_a_prefix_of_the_table() {
        assert_eq!(
            std::mem::offset_of!(AccelPluginV1, abi_major),
            std::mem::offset_of!(AccelPluginHeader, abi_major)
        );
        assert_eq!(
            std::mem::offset_of!(AccelPluginV1, abi_minor),
            std::mem::offset_of!(AccelPluginHeader, abi_minor)
        );
        const { assert!(min_size::PLUGIN > min_size::HEADER) };
    }

    #[test]
    fn bit_sets_round_trip() {
        let b = bits([1, 3, 8, 40]);
        assert_eq!(codes(b).collect::<Vec<_>>(), vec![1, 3, 8]);
    }
}
