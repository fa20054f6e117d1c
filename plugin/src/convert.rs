//! Conversions between accel-api values and their [`abi`](crate::abi)
//! shapes, used by both sides of the boundary: error records and the
//! thread-local last-error slots, sinks, buffers, capabilities, durations,
//! and the panic guard every exported function runs in.
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::Duration;

use accel_api::{
    Buf, BufMut, Capabilities, DType, Device, DeviceBuf, DeviceBufMut, DeviceKind, Error,
    ErrorKind, HostBuf, HostBufMut, MismatchEntry, Op, ReduceOp, Result,
};

use crate::abi::*;

// ---------------------------------------------------------------------------
// Durations

/// A duration as saturating nanoseconds.
pub(crate) fn duration_to_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Nanoseconds as a duration.
pub(crate) fn ns_to_duration(ns: u64) -> Duration {
    Duration::from_nanos(ns)
}

// ---------------------------------------------------------------------------
// Status codes

/// The status code of an error kind (and a note for kinds this ABI version
/// has no code for).
pub(crate) fn status_of(kind: &ErrorKind) -> (AccelStatus, Option<&'static str>) {
    let s = match kind {
        ErrorKind::Unavailable => ACCEL_ERR_UNAVAILABLE,
        ErrorKind::Unsupported => ACCEL_ERR_UNSUPPORTED,
        ErrorKind::InvalidConfig => ACCEL_ERR_INVALID_CONFIG,
        ErrorKind::InvalidArgument => ACCEL_ERR_INVALID_ARGUMENT,
        ErrorKind::Timeout { .. } => ACCEL_ERR_TIMEOUT,
        ErrorKind::PeerLost { .. } => ACCEL_ERR_PEER_LOST,
        ErrorKind::Mismatch { .. } => ACCEL_ERR_MISMATCH,
        ErrorKind::Plugin { .. } => ACCEL_ERR_PLUGIN,
        ErrorKind::Io => ACCEL_ERR_IO,
        ErrorKind::Backend => ACCEL_ERR_BACKEND,
        ErrorKind::Poisoned => ACCEL_ERR_POISONED,
        ErrorKind::Unauthorized => ACCEL_ERR_UNAUTHORIZED,
        ErrorKind::Aborted => ACCEL_ERR_ABORTED,
        ErrorKind::Corrupt => ACCEL_ERR_CORRUPT,
        other => return (ACCEL_ERR_BACKEND, Some(other.name())),
    };
    (s, None)
}

// ---------------------------------------------------------------------------
// Error records

/// An owned error in ABI shape: the [`AccelError`] view points into the
/// strings held next to it. Boxed, so the view's address is stable.
pub(crate) struct ErrorRecord {
    view: AccelError,
    _strings: Vec<String>,
    _rows: Vec<AccelMismatchRow>,
}

impl ErrorRecord {
    /// The record of `err`.
    pub(crate) fn of(err: &Error) -> Box<ErrorRecord> {
        let (status, note) = status_of(err.kind());
        let message = match note {
            Some(kind) => format!("[{kind}] {}", err.message()),
            None => err.message().to_string(),
        };
        let mut source = None;
        if let Some(mut s) = std::error::Error::source(err) {
            let mut text = s.to_string();
            while let Some(next) = s.source() {
                text.push_str(": ");
                text.push_str(&next.to_string());
                s = next;
            }
            source = Some(text);
        }
        let (peer, timeout_ns, path, symbol, table) = match err.kind() {
            ErrorKind::PeerLost { peer } => (*peer, 0, None, None, Vec::new()),
            ErrorKind::Timeout { after } => (None, duration_to_ns(*after), None, None, Vec::new()),
            ErrorKind::Plugin { path, symbol } => (
                None,
                0,
                Some(path.to_string_lossy().into_owned()),
                symbol.clone(),
                Vec::new(),
            ),
            ErrorKind::Mismatch { table } => (None, 0, None, None, table.clone()),
            _ => (None, 0, None, None, Vec::new()),
        };
        Self::build(Fields {
            status,
            message,
            op: err.op().map(str::to_string),
            backend: err.backend().map(str::to_string),
            fix: err.fix().map(str::to_string),
            source,
            rank: err.rank(),
            peer,
            timeout_ns,
            path,
            symbol,
            table,
        })
    }

    /// The record of a panic of `who` caught in `function`.
    pub(crate) fn panic(
        who: &str,
        function: &str,
        payload: &(dyn std::any::Any + Send),
    ) -> Box<ErrorRecord> {
        let text = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic payload that is not text".to_string());
        Self::build(Fields {
            status: ACCEL_ERR_PANICKED,
            message: format!("{who} panicked in {function}: {text}"),
            op: Some(function.to_string()),
            symbol: Some(function.to_string()),
            fix: Some("this is a bug in the plugin: report it to its vendor".to_string()),
            ..Fields::default()
        })
    }

    fn build(f: Fields) -> Box<ErrorRecord> {
        // Strings are moved into the record first; views are taken from the
        // moved strings (their heap buffers do not move with the Vec).
        let mut strings = Vec::new();
        let mut keep = |s: Option<String>| -> Option<usize> {
            s.map(|s| {
                strings.push(s);
                strings.len() - 1
            })
        };
        let message = keep(Some(f.message));
        let op = keep(f.op);
        let backend = keep(f.backend);
        let fix = keep(f.fix);
        let source = keep(f.source);
        let path = keep(f.path);
        let symbol = keep(f.symbol);
        let calls: Vec<(usize, Option<usize>)> = f
            .table
            .into_iter()
            .map(|r| (r.rank, keep(r.call)))
            .collect();
        let view_of = |i: Option<usize>| AccelStr::opt(i.map(|i| strings[i].as_str()));
        let rows: Vec<AccelMismatchRow> = calls
            .iter()
            .map(|(rank, call)| AccelMismatchRow {
                rank: *rank,
                call: view_of(*call),
            })
            .collect();
        let view = AccelError {
            struct_size: min_size::ERROR,
            status: f.status,
            message: view_of(message),
            op: view_of(op),
            backend: view_of(backend),
            fix: view_of(fix),
            source: view_of(source),
            rank: f.rank.unwrap_or(ACCEL_NONE),
            peer: f.peer.unwrap_or(ACCEL_NONE),
            timeout_ns: f.timeout_ns,
            plugin_path: view_of(path),
            plugin_symbol: view_of(symbol),
            mismatch: if rows.is_empty() {
                std::ptr::null()
            } else {
                rows.as_ptr()
            },
            mismatch_len: rows.len(),
        };
        Box::new(ErrorRecord {
            view,
            _strings: strings,
            _rows: rows,
        })
    }

    /// The view (valid while `self` lives).
    pub(crate) fn view(&self) -> &AccelError {
        &self.view
    }
}

#[derive(Default)]
struct Fields {
    status: AccelStatus,
    message: String,
    op: Option<String>,
    backend: Option<String>,
    fix: Option<String>,
    source: Option<String>,
    rank: Option<usize>,
    peer: Option<usize>,
    timeout_ns: u64,
    path: Option<String>,
    symbol: Option<String>,
    table: Vec<MismatchEntry>,
}

/// Which thread-local slot a side writes its failures to. The plugin side
/// and the host's store callbacks use different slots so that both can live
/// in one process (in-process tests, or a host that is itself a plugin).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Slot {
    /// Failures of exported plugin functions.
    Plugin,
    /// Failures of the host's store callbacks.
    HostStore,
}

thread_local! {
    static PLUGIN_LAST: RefCell<Option<Box<ErrorRecord>>> = const { RefCell::new(None) };
    static HOST_STORE_LAST: RefCell<Option<Box<ErrorRecord>>> = const { RefCell::new(None) };
}

impl Slot {
    fn with<R>(self, f: impl FnOnce(&RefCell<Option<Box<ErrorRecord>>>) -> R) -> Option<R> {
        match self {
            Slot::Plugin => PLUGIN_LAST.try_with(f).ok(),
            Slot::HostStore => HOST_STORE_LAST.try_with(f).ok(),
        }
    }

    /// Who is speaking, for panic messages.
    fn who(self) -> &'static str {
        match self {
            Slot::Plugin => "plugin",
            Slot::HostStore => "host store",
        }
    }

    /// Keep `record` as the last error of this thread; returns its status.
    pub(crate) fn set(self, record: Box<ErrorRecord>) -> AccelStatus {
        let status = record.view.status;
        // `try_with` + `try_borrow_mut`: never panic, even during thread
        // teardown or (impossible here) re-entrance.
        self.with(|cell| {
            if let Ok(mut slot) = cell.try_borrow_mut() {
                *slot = Some(record);
            }
        });
        status
    }

    /// The last error of this thread (null when none). Valid until the next
    /// `set` on this thread.
    pub(crate) fn get(self) -> *const AccelError {
        self.with(|cell| match cell.try_borrow() {
            Ok(slot) => slot
                .as_ref()
                .map_or(std::ptr::null(), |r| r.view() as *const AccelError),
            Err(_) => std::ptr::null(),
        })
        .unwrap_or(std::ptr::null())
    }
}

/// Run `f` as the body of the exported function `function`: a returned
/// error goes to `slot` with its status, a panic is caught and reported as
/// [`ACCEL_ERR_PANICKED`]. Never unwinds.
pub(crate) fn guard(slot: Slot, function: &str, f: impl FnOnce() -> Result<()>) -> AccelStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => ACCEL_OK,
        Ok(Err(e)) => slot.set(ErrorRecord::of(&e)),
        Err(payload) => {
            // Building the record allocates and formats; guard that too so a
            // second panic (out of memory aside) cannot escape.
            match catch_unwind(AssertUnwindSafe(|| {
                ErrorRecord::panic(slot.who(), function, &*payload)
            })) {
                Ok(record) => slot.set(record),
                Err(_) => ACCEL_ERR_PANICKED,
            }
        }
    }
}

/// Where a decoded error came from, to fill in what the record cannot know.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Origin<'a> {
    /// The library, when the callee is a plugin (`None`: the host's store).
    pub path: Option<&'a Path>,
    /// The function that was called.
    pub function: &'a str,
}

/// Rebuild the error of a failed call from its status and (possibly null)
/// record.
///
/// # Safety
/// `record` is null or points to an [`AccelError`] whose `struct_size`
/// bytes are readable and whose strings and rows are valid, as the ABI
/// promises until the next call into the same side on this thread.
pub(crate) unsafe fn decode_error(
    status: AccelStatus,
    record: *const AccelError,
    origin: Origin<'_>,
) -> Error {
    let plugin_kind = |symbol: Option<String>| match origin.path {
        Some(path) => ErrorKind::Plugin {
            path: path.to_path_buf(),
            symbol,
        },
        None => ErrorKind::Backend,
    };
    let generic = |msg: String| {
        Error::new(plugin_kind(Some(origin.function.to_string())), msg).with_op(origin.function)
    };
    if record.is_null() {
        return generic(format!(
            "{} failed with status {status} but left no error record",
            origin.function
        ));
    }
    // SAFETY: the caller guarantees `record` is readable for its
    // `struct_size`; read the size field alone first.
    let size = unsafe { std::ptr::addr_of!((*record).struct_size).read() };
    if size < min_size::ERROR {
        return generic(format!(
            "{} failed with status {status}; its error record is {size} bytes, ABI 1.0 needs {}",
            origin.function,
            min_size::ERROR
        ));
    }
    // SAFETY: at least the 1.0 layout is readable (checked above).
    let r = unsafe { record.read() };
    // SAFETY: the strings of a record are valid while it is (caller's
    // guarantee); `into_owned` copies them out before we return.
    let text = |s: AccelStr| unsafe { s.read() }.map(|c| c.into_owned());
    let message = text(r.message).unwrap_or_default();
    let opt_usize = |v: usize| (v != ACCEL_NONE).then_some(v);
    let kind = match r.status {
        ACCEL_ERR_UNAVAILABLE => ErrorKind::Unavailable,
        ACCEL_ERR_UNSUPPORTED => ErrorKind::Unsupported,
        ACCEL_ERR_INVALID_CONFIG => ErrorKind::InvalidConfig,
        ACCEL_ERR_INVALID_ARGUMENT => ErrorKind::InvalidArgument,
        ACCEL_ERR_TIMEOUT => ErrorKind::Timeout {
            after: ns_to_duration(r.timeout_ns),
        },
        ACCEL_ERR_PEER_LOST => ErrorKind::PeerLost {
            peer: opt_usize(r.peer),
        },
        ACCEL_ERR_MISMATCH => {
            let mut table = Vec::with_capacity(r.mismatch_len);
            if !r.mismatch.is_null() {
                // SAFETY: `mismatch_len` rows are readable at `mismatch`
                // while the record is valid.
                let rows = unsafe { std::slice::from_raw_parts(r.mismatch, r.mismatch_len) };
                for row in rows {
                    table.push(MismatchEntry {
                        rank: row.rank,
                        call: text(row.call),
                    });
                }
            }
            ErrorKind::Mismatch { table }
        }
        ACCEL_ERR_PLUGIN => match text(r.plugin_path) {
            Some(path) => ErrorKind::Plugin {
                path: PathBuf::from(path),
                symbol: text(r.plugin_symbol),
            },
            None => plugin_kind(text(r.plugin_symbol)),
        },
        ACCEL_ERR_PANICKED => {
            plugin_kind(text(r.plugin_symbol).or_else(|| Some(origin.function.to_string())))
        }
        ACCEL_ERR_IO => ErrorKind::Io,
        ACCEL_ERR_BACKEND => ErrorKind::Backend,
        ACCEL_ERR_POISONED => ErrorKind::Poisoned,
        ACCEL_ERR_UNAUTHORIZED => ErrorKind::Unauthorized,
        ACCEL_ERR_ABORTED => ErrorKind::Aborted,
        ACCEL_ERR_CORRUPT => ErrorKind::Corrupt,
        other => {
            return generic(format!(
                "{} failed with status {other}, which ABI {ACCEL_PLUGIN_ABI_MAJOR}.{ACCEL_PLUGIN_ABI_MINOR} does not know: {message}",
                origin.function
            ))
        }
    };
    let mut e = Error::new(kind, message);
    if let Some(rank) = opt_usize(r.rank) {
        e = e.with_rank(rank);
    }
    if let Some(op) = text(r.op) {
        e = e.with_op(op);
    }
    if let Some(b) = text(r.backend) {
        e = e.with_backend(b);
    }
    if let Some(fix) = text(r.fix) {
        e = e.with_fix(fix);
    }
    if let Some(src) = text(r.source) {
        e = e.with_source(RemoteSource(src));
    }
    e
}

/// The cause of an error that crossed the boundary, rendered to text.
#[derive(Debug)]
pub(crate) struct RemoteSource(String);

impl std::fmt::Display for RemoteSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RemoteSource {}

// ---------------------------------------------------------------------------
// Sinks

/// A receiver for variable-size results: pass [`VecSink::sink`] to a call,
/// read the bytes afterwards.
#[derive(Debug, Default)]
pub(crate) struct VecSink {
    bytes: Vec<u8>,
    written: bool,
}

unsafe extern "C" fn vec_sink_write(ctx: *mut c_void, ptr: *const u8, len: usize) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `VecSink` that `VecSink::sink` borrowed
        // mutably; it outlives the call the sink was passed to, and nothing
        // else touches it meanwhile.
        let sink = unsafe { &mut *(ctx as *mut VecSink) };
        sink.written = true;
        if len > 0 && !ptr.is_null() {
            // SAFETY: the writer passes `len` readable bytes at `ptr`.
            sink.bytes
                .extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
        }
    }));
}

impl VecSink {
    /// A sink writing into `self`. `self` must outlive the call it is
    /// passed to (it is borrowed for that long by construction at the call
    /// sites).
    pub(crate) fn sink(&mut self) -> AccelSink {
        AccelSink {
            ctx: self as *mut VecSink as *mut c_void,
            write: Some(vec_sink_write),
        }
    }

    /// `true` when the callee wrote, even zero bytes.
    pub(crate) fn written(&self) -> bool {
        self.written
    }

    /// The bytes.
    pub(crate) fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// The bytes as text (lossy UTF-8).
    pub(crate) fn into_string(self) -> String {
        String::from_utf8(self.bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
    }
}

/// Write `bytes` to `sink` (no-op for a sink without a write function).
///
/// # Safety
/// `sink` came from the other side of the boundary and is valid for the
/// duration of the current call.
pub(crate) unsafe fn write_sink(sink: AccelSink, bytes: &[u8]) {
    if let Some(write) = sink.write {
        // SAFETY: the sink's contract: `write(ctx, ptr, len)` with `len`
        // readable bytes; `bytes` outlives the call.
        unsafe { write(sink.ctx, bytes.as_ptr(), bytes.len()) }
    }
}

// ---------------------------------------------------------------------------
// Buffers

/// The ABI shape of a read-only buffer. Borrows `buf`'s memory: the result
/// must not outlive `buf`.
pub(crate) fn buf_to_abi(buf: &Buf<'_>) -> AccelBuf {
    match buf {
        Buf::Host(h) => host_abi(h.dtype(), h.len(), h.bytes().as_ptr() as *mut u8),
        Buf::Device(d) => device_abi(d.addr(), d.len(), d.dtype(), d.device(), d.stream()),
    }
}

/// The ABI shape of a writable buffer. Borrows `buf`'s memory mutably: the
/// result must not outlive the borrow.
pub(crate) fn buf_mut_to_abi(buf: &mut BufMut<'_>) -> AccelBuf {
    match buf {
        BufMut::Host(h) => {
            let (dtype, len) = (h.dtype(), h.len());
            host_abi(dtype, len, h.bytes_mut().as_mut_ptr())
        }
        BufMut::Device(d) => device_abi(d.addr(), d.len(), d.dtype(), d.device(), d.stream()),
    }
}

fn host_abi(dtype: DType, len: usize, ptr: *mut u8) -> AccelBuf {
    AccelBuf {
        memory: ACCEL_MEMORY_HOST,
        dtype: dtype.code(),
        len,
        host_ptr: ptr,
        device_addr: 0,
        device_kind: DeviceKind::Cpu.code(),
        device_index: 0,
        stream: 0,
    }
}

fn device_abi(addr: u64, len: usize, dtype: DType, device: Device, stream: u64) -> AccelBuf {
    AccelBuf {
        memory: ACCEL_MEMORY_DEVICE,
        dtype: dtype.code(),
        len,
        host_ptr: std::ptr::null_mut(),
        device_addr: addr,
        device_kind: device.kind.code(),
        device_index: device.index,
        stream,
    }
}

/// The owner a device view built from an ABI descriptor borrows: the memory
/// belongs to the other side of the boundary, which keeps it alive for the
/// call. A zero-sized box allocates nothing.
fn abi_owner<'a>() -> &'a mut () {
    Box::leak(Box::new(()))
}

/// A non-null pointer aligned for every element type, for empty views.
const EMPTY: std::ptr::NonNull<u8> = std::ptr::NonNull::<u64>::dangling().cast();

fn bad_buf(op: &str, what: &str, why: String) -> Error {
    Error::invalid_argument(op, format!("{what} buffer: {why}"))
}

/// The dtype, device and byte length of an ABI buffer, checked.
fn parts(op: &str, what: &str, b: &AccelBuf) -> Result<(DType, Device, usize)> {
    let dtype = DType::from_code(b.dtype).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "{what} buffer has element type code {}, unknown to this plugin",
                b.dtype
            ),
        )
        .with_op(op)
    })?;
    let kind = DeviceKind::from_code(b.device_kind).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "{what} buffer is on device kind code {}, unknown to this plugin",
                b.device_kind
            ),
        )
        .with_op(op)
    })?;
    let bytes = b.len.checked_mul(dtype.size()).ok_or_else(|| {
        bad_buf(
            op,
            what,
            format!("{} elements of {dtype} overflow the address space", b.len),
        )
    })?;
    Ok((dtype, Device::new(kind, b.device_index), bytes))
}

/// Where an ABI buffer's memory is, checked by [`read_buf`].
enum Memory {
    /// Host memory: `bytes` bytes at a non-null address ([`EMPTY`] when
    /// there are none).
    Host(*mut u8, usize),
    /// Device memory at the descriptor's `device_addr`.
    Device,
}

/// The descriptor at `b`, its dtype and device, and where its memory is,
/// checked: no null descriptor, known codes, no null host pointer for a
/// non-empty view.
///
/// # Safety
/// `b` is null or points to a valid [`AccelBuf`].
unsafe fn read_buf(
    op: &str,
    what: &str,
    b: *const AccelBuf,
) -> Result<(AccelBuf, DType, Device, Memory)> {
    if b.is_null() {
        return Err(bad_buf(op, what, "null descriptor".into()));
    }
    // SAFETY: `b` is a valid descriptor (caller's guarantee).
    let b = unsafe { b.read() };
    let (dtype, device, bytes) = parts(op, what, &b)?;
    let memory = match b.memory {
        // An empty view gets a non-null pointer aligned for every element
        // type (a plain `&[]` is only 1-aligned, which `from_bytes` rightly
        // refuses for wider types).
        ACCEL_MEMORY_HOST if bytes == 0 => Memory::Host(EMPTY.as_ptr(), 0),
        ACCEL_MEMORY_HOST if b.host_ptr.is_null() => {
            let why = format!("null pointer for {} elements", b.len);
            return Err(bad_buf(op, what, why));
        }
        ACCEL_MEMORY_HOST => Memory::Host(b.host_ptr, bytes),
        ACCEL_MEMORY_DEVICE => Memory::Device,
        m => return Err(bad_buf(op, what, format!("unknown memory code {m}"))),
    };
    Ok((b, dtype, device, memory))
}

/// One body for the read-only and the writable view of an ABI buffer, and
/// for its variant that takes a null descriptor as "no buffer".
macro_rules! view_from_abi {
    (
        $(#[$doc:meta])*
        $name:ident, $opt_name:ident -> $View:ident, $Host:ident, $Device:ident, $slice:path
    ) => {
        $(#[$doc])*
        pub(crate) unsafe fn $name<'a>(op: &str, what: &str, b: *const AccelBuf) -> Result<$View<'a>> {
            // SAFETY: `b` is a valid descriptor (caller's guarantee).
            let (b, dtype, device, memory) = unsafe { read_buf(op, what, b) }?;
            match memory {
                Memory::Host(ptr, bytes) => {
                    // SAFETY: `bytes` bytes at `ptr` that nothing writes
                    // for 'a (a writable view's: writable and exclusively
                    // ours; caller's guarantee), or none at an aligned
                    // non-null pointer, never accessed.
                    let slice = unsafe { $slice(ptr, bytes) };
                    let host = $Host::from_bytes(dtype, slice).map_err(|e| e.with_op(op))?;
                    Ok($View::Host(host))
                }
                // SAFETY: the descriptor's device memory stays valid for 'a
                // and is not written (a writable view's: is exclusively
                // ours) meanwhile (caller's guarantee); the view borrows
                // nothing on this side.
                Memory::Device => Ok($View::Device(unsafe {
                    $Device::from_raw(abi_owner(), b.device_addr, b.len, dtype, device, b.stream)
                })),
            }
        }

        #[doc = concat!("[`", stringify!($name), "`], `None` for a null descriptor (\"no buffer\").")]
        ///
        /// # Safety
        #[doc = concat!("As [`", stringify!($name), "`] when `b` is not null.")]
        pub(crate) unsafe fn $opt_name<'a>(
            op: &str,
            what: &str,
            b: *const AccelBuf,
        ) -> Result<Option<$View<'a>>> {
            if b.is_null() {
                return Ok(None);
            }
            // SAFETY: non-null, and valid as the caller guarantees.
            unsafe { $name(op, what, b) }.map(Some)
        }
    };
}

view_from_abi!(
    /// A read-only buffer view of an ABI buffer.
    ///
    /// # Safety
    /// `b` points to a valid [`AccelBuf`]; for host memory, `host_ptr` points
    /// to `len * dtype size` readable bytes that nothing writes for `'a`.
    buf_from_abi, opt_buf_from_abi -> Buf, HostBuf, DeviceBuf, std::slice::from_raw_parts
);

view_from_abi!(
    /// A writable buffer view of an ABI buffer.
    ///
    /// # Safety
    /// As [`buf_from_abi`], and for host memory the bytes are writable and not
    /// accessed through any other pointer for `'a`.
    buf_mut_from_abi, opt_buf_mut_from_abi -> BufMut, HostBufMut, DeviceBufMut, std::slice::from_raw_parts_mut
);

/// The views of an operation's ABI `send` and `recv` buffers.
///
/// # Safety
/// As [`buf_from_abi`] for `send` and [`buf_mut_from_abi`] for `recv`,
/// which do not overlap.
pub(crate) unsafe fn send_recv_from_abi<'a>(
    op: &str,
    send: *const AccelBuf,
    recv: *const AccelBuf,
) -> Result<(Buf<'a>, BufMut<'a>)> {
    // SAFETY: the caller's guarantees.
    unsafe {
        Ok((
            buf_from_abi(op, "send", send)?,
            buf_mut_from_abi(op, "recv", recv)?,
        ))
    }
}

/// The ABI descriptors of an operation's `send` and `recv` buffers.
pub(crate) fn send_recv_to_abi(send: &Buf<'_>, recv: &mut BufMut<'_>) -> (AccelBuf, AccelBuf) {
    (buf_to_abi(send), buf_mut_to_abi(recv))
}

/// The address of `b`, null for none (the ABI's "no buffer").
pub(crate) fn ptr_or_null(b: &Option<AccelBuf>) -> *const AccelBuf {
    b.as_ref()
        .map_or(std::ptr::null(), |b| b as *const AccelBuf)
}

// ---------------------------------------------------------------------------
// Capabilities, reductions, devices

/// The ABI shape of capabilities.
pub(crate) fn caps_to_abi(c: &Capabilities) -> AccelCapabilities {
    AccelCapabilities {
        struct_size: min_size::CAPABILITIES,
        ops: c.ops.iter().fold(0, |acc, op| acc | op.bit()),
        dtypes: bits(c.dtypes.iter().map(|d| d.code())),
        reduce_dtypes: bits(c.reduce_dtypes.iter().map(|d| d.code())),
        reduce_ops: bits(c.reduce_ops.iter().map(|r| r.code())),
        device_kinds: bits(c.device_kinds.iter().map(|k| k.code())),
        abort_interrupts: u32::from(c.abort_interrupts),
    }
}

/// Capabilities from their ABI shape; bits this side does not know are
/// dropped (declaring less is always allowed).
pub(crate) fn caps_from_abi(a: &AccelCapabilities) -> Capabilities {
    let mut c = Capabilities::none();
    c.ops = Op::ALL
        .into_iter()
        .filter(|op| a.ops & op.bit() != 0)
        .collect();
    c.dtypes = codes(a.dtypes).filter_map(DType::from_code).collect();
    c.reduce_dtypes = codes(a.reduce_dtypes)
        .filter_map(DType::from_code)
        .collect();
    c.reduce_ops = codes(a.reduce_ops)
        .filter_map(ReduceOp::from_code)
        .collect();
    c.device_kinds = codes(a.device_kinds)
        .filter_map(DeviceKind::from_code)
        .collect();
    c.abort_interrupts = a.abort_interrupts != 0;
    c
}

/// A reduction from its code.
pub(crate) fn reduce_op(op: &str, code: u32) -> Result<ReduceOp> {
    ReduceOp::from_code(code).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!("reduction code {code} is unknown to this plugin"),
        )
        .with_op(op)
    })
}

/// A device from its kind code and ordinal.
pub(crate) fn device(op: &str, kind: u32, index: u32) -> Result<Device> {
    let kind = DeviceKind::from_code(kind).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!("device kind code {kind} is unknown"),
        )
        .with_op(op)
    })?;
    Ok(Device::new(kind, index))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(e: &Error) -> Error {
        let rec = ErrorRecord::of(e);
        // SAFETY: the record is alive for the whole call.
        unsafe {
            decode_error(
                rec.view().status,
                rec.view(),
                Origin {
                    path: Some(Path::new("/p.so")),
                    function: "f",
                },
            )
        }
    }

    #[test]
    fn errors_round_trip_with_kind_and_context() {
        let e = Error::timeout("all_reduce", Duration::from_millis(1500), "peer 3 silent")
            .with_backend("x")
            .with_rank(2)
            .with_fix("raise it");
        let d = round_trip(&e);
        assert_eq!(d.to_string(), e.to_string());
        assert_eq!(d.kind(), e.kind());

        let e = Error::new(ErrorKind::PeerLost { peer: Some(4) }, "gone");
        assert_eq!(round_trip(&e).kind(), e.kind());
        let e = Error::new(ErrorKind::PeerLost { peer: None }, "gone");
        assert_eq!(round_trip(&e).kind(), e.kind());

        let e = Error::new(
            ErrorKind::Mismatch {
                table: vec![
                    MismatchEntry {
                        rank: 0,
                        call: Some("#1 barrier".into()),
                    },
                    MismatchEntry {
                        rank: 1,
                        call: None,
                    },
                ],
            },
            "ranks disagree",
        );
        let d = round_trip(&e);
        assert_eq!(d.kind(), e.kind());
        assert_eq!(d.to_string(), e.to_string());

        let e = Error::io(
            "reading x",
            std::io::Error::new(std::io::ErrorKind::NotFound, "nope"),
        );
        let d = round_trip(&e);
        assert_eq!(d.kind(), &ErrorKind::Io);
        assert_eq!(std::error::Error::source(&d).unwrap().to_string(), "nope");
    }

    #[test]
    fn guard_turns_panics_into_records() {
        let status = guard(Slot::Plugin, "probe", || panic!("boom {}", 7));
        assert_eq!(status, ACCEL_ERR_PANICKED);
        let rec = Slot::Plugin.get();
        // SAFETY: the slot's record is valid until the next `set` on this
        // thread.
        let e = unsafe {
            decode_error(
                status,
                rec,
                Origin {
                    path: Some(Path::new("/x/p.so")),
                    function: "probe",
                },
            )
        };
        assert!(
            e.to_string().contains("plugin panicked in probe: boom 7"),
            "{e}"
        );
        assert!(matches!(e.kind(), ErrorKind::Plugin { path, symbol }
            if path == Path::new("/x/p.so") && symbol.as_deref() == Some("probe")));
    }

    #[test]
    fn capabilities_round_trip() {
        let c = Capabilities::all_host().with_reduce_dtypes([DType::F32, DType::I64]);
        assert_eq!(caps_from_abi(&caps_to_abi(&c)), c);
    }
}
