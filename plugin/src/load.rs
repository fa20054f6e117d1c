//! The host side: `dlopen` a plugin, check its table, and wrap it in types
//! implementing [`Backend`] and [`Communicator`] that forward through the C
//! tables. Also the host's [`Store`] as an [`AccelStoreV1`] vtable.
//!
//! Loading never panics and never unloads: the library handle is leaked
//! right after `dlopen` succeeds, whatever happens next, because code or
//! thread-local destructors of a Rust cdylib may still be referenced.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use accel_api::kit::{Engine, EngineInfo, Group};
use accel_api::{
    Backend, Buf, BufMut, Capabilities, CasOutcome, Communicator, ConnectContext, Device,
    DeviceKind, Error, ErrorKind, Probe, ProbeContext, ReduceOp, Result, Store,
};

use crate::abi::*;
use crate::convert::{self, guard, write_sink, Origin, Slot, VecSink};

/// Load the plugin at `path` and return its backend.
///
/// The library is opened with `RTLD_NOW | RTLD_LOCAL` (unresolved symbols
/// fail here, not later) and never unloaded.
///
/// # Errors
/// Always [`ErrorKind::Plugin`] naming `path` (and the symbol involved),
/// with a message saying what to do: the file is missing, a directory or
/// another non-regular file (a FIFO, a device); it
/// is not a loadable shared object (with the loader's own words); it does
/// not export [`ENTRY_SYMBOL`]; it was built for another ABI major; its
/// table is smaller than ABI 1.0 or null; or one of its first calls
/// (name, version, priority, device kind) failed.
pub fn load_plugin(path: impl AsRef<Path>) -> Result<Arc<dyn Backend>> {
    let b: Arc<dyn Backend> = PluginBackend::load(path.as_ref())?;
    Ok(b)
}

fn plugin_error(path: &Path, symbol: Option<&str>, message: String, fix: &str) -> Error {
    Error::new(
        ErrorKind::Plugin {
            path: path.to_path_buf(),
            symbol: symbol.map(str::to_string),
        },
        message,
    )
    .with_op("load plugin")
    .with_fix(fix)
}

/// What stays known about a loaded library for the process's lifetime.
struct Lib {
    path: PathBuf,
    table: AccelPluginV1,
    comm: AccelCommV1,
    abi_minor: u32,
    name: String,
}

// SAFETY: `Lib` holds copies of the plugin's tables (function pointers and a
// pointer to its static communicator table) and owned strings. The library
// is never unloaded, so the pointers stay valid; the ABI requires every
// function to be callable from any thread.
unsafe impl Send for Lib {}
// SAFETY: as for `Send`; nothing in `Lib` is mutated after loading.
unsafe impl Sync for Lib {}

impl Lib {
    /// The error of a failed call to `function`, read from the plugin's
    /// last-error record on this thread.
    fn error(&self, function: &str, status: AccelStatus) -> Error {
        let record = match self.table.last_error {
            // SAFETY: a function of the loaded, never-unloaded plugin.
            Some(f) => unsafe { f() },
            None => std::ptr::null(),
        };
        // SAFETY: the record stays valid until our next call into the
        // plugin on this thread; `decode_error` copies it out.
        let e = unsafe {
            convert::decode_error(
                status,
                record,
                Origin {
                    path: Some(&self.path),
                    function,
                },
            )
        };
        if self.name.is_empty() {
            e
        } else {
            e.with_backend(self.name.clone())
        }
    }

    fn check(&self, function: &str, status: AccelStatus) -> Result<()> {
        if status == ACCEL_OK {
            Ok(())
        } else {
            Err(self.error(function, status))
        }
    }

    /// `f`, or an error saying the plugin's table lacks it.
    fn func<F>(&self, f: Option<F>, function: &str) -> Result<F> {
        f.ok_or_else(|| {
            plugin_error(
                &self.path,
                Some(function),
                format!("the plugin's table has no `{function}` function (null entry)"),
                "rebuild the plugin with accel_plugin::export_plugin!",
            )
        })
    }

    /// Call a function that writes text to a sink.
    fn text(
        &self,
        f: Option<unsafe extern "C" fn(AccelSink) -> AccelStatus>,
        function: &str,
    ) -> Result<String> {
        let f = self.func(f, function)?;
        let mut out = VecSink::default();
        // SAFETY: a function of the loaded plugin; the sink outlives the call.
        let status = unsafe { f(out.sink()) };
        self.check(function, status)?;
        Ok(out.into_string())
    }
}

/// A backend loaded from a plugin: implements [`Backend`] by forwarding
/// through the plugin's C table.
pub struct PluginBackend {
    lib: Arc<Lib>,
    version: String,
    priority: i32,
    device_kind: DeviceKind,
}

impl fmt::Debug for PluginBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginBackend")
            .field("name", &self.lib.name)
            .field("path", &self.lib.path)
            .field("version", &self.version)
            .field("abi", &self.abi_version())
            .finish_non_exhaustive()
    }
}

impl PluginBackend {
    /// Load the plugin at `path`; see [`load_plugin`].
    ///
    /// # Errors
    /// As [`load_plugin`].
    pub fn load(path: &Path) -> Result<Arc<PluginBackend>> {
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => {
                return Err(plugin_error(
                    path,
                    None,
                    "is a directory, not a shared object".into(),
                    "name the plugin's .so file, or put the directory on ACCEL_PLUGIN_PATH to load every .so in it",
                ))
            }
            Ok(m) if !m.is_file() => {
                // A FIFO would block the loader's open; a device never ends.
                let why = accel_api::files::check_regular(path, "file")
                    .err()
                    .map_or_else(|| "not a regular file".to_string(), |e| e.message().to_string());
                return Err(plugin_error(
                    path,
                    None,
                    why,
                    "name the plugin's .so file itself (accel loads only regular files)",
                ));
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(plugin_error(
                    path,
                    None,
                    "no such file".into(),
                    "check the path (and ACCEL_PLUGIN_PATH); build the plugin first with `cargo build` if it is yours",
                ))
            }
            Err(e) => {
                return Err(plugin_error(
                    path,
                    None,
                    format!("cannot read the file: {e}"),
                    "check the file's permissions",
                ))
            }
        }
        let entry = open(path)?;
        // SAFETY: `entry` is the plugin's `accel_plugin_entry_v1`, whose type
        // the ABI fixes; it returns a pointer to a static table or null.
        let table = unsafe { entry() };
        if table.is_null() {
            return Err(plugin_error(
                path,
                Some(ENTRY_SYMBOL),
                format!("{ENTRY_SYMBOL} returned a null table: the plugin could not initialise"),
                "look for the plugin's own diagnostics on stderr, or ask its vendor",
            ));
        }
        // SAFETY: a non-null table returned by the entry symbol, valid for the
        // process's lifetime (the library is never unloaded).
        unsafe { PluginBackend::from_table(path, table) }
    }

    /// Wrap a plugin table that is already in memory (the entry symbol was
    /// resolved by other means, or the table is built in-process).
    ///
    /// # Errors
    /// As [`load_plugin`] for the table checks and the first calls.
    ///
    /// # Safety
    /// `table` is non-null and points to a plugin table that is readable for
    /// its `struct_size`, follows this ABI, and stays valid (with every
    /// function and string it refers to) for the rest of the process.
    pub unsafe fn from_table(
        path: &Path,
        table: *const AccelPluginV1,
    ) -> Result<Arc<PluginBackend>> {
        let bad =
            |symbol: Option<&str>, msg: String, fix: &str| plugin_error(path, symbol, msg, fix);
        // Read the size alone first: everything else depends on it.
        // SAFETY: `table` is readable for at least its `struct_size` field.
        let size = unsafe { std::ptr::addr_of!((*table).struct_size).read() };
        if size < min_size::HEADER {
            return Err(bad(
                Some(ENTRY_SYMBOL),
                format!(
                    "its table is {size} bytes, too small to even hold the ABI header ({} bytes)",
                    min_size::HEADER
                ),
                "the file is corrupt or not an accel plugin: rebuild it with accel_plugin::export_plugin!",
            ));
        }
        // SAFETY: the header fits in `size` bytes (checked above).
        let header = unsafe { (table as *const AccelPluginHeader).read() };
        if header.abi_major != ACCEL_PLUGIN_ABI_MAJOR {
            return Err(bad(
                Some(ENTRY_SYMBOL),
                format!(
                    "it was built for plugin ABI {}.{}, but this host needs ABI major {ACCEL_PLUGIN_ABI_MAJOR} (it speaks {ACCEL_PLUGIN_ABI_MAJOR}.{ACCEL_PLUGIN_ABI_MINOR})",
                    header.abi_major, header.abi_minor
                ),
                "rebuild the plugin against an accel-plugin release of ABI major 1, or run it with a host of its major",
            ));
        }
        if size < min_size::PLUGIN {
            return Err(bad(
                Some(ENTRY_SYMBOL),
                format!(
                    "its table is {size} bytes, smaller than the {} bytes of ABI 1.0",
                    min_size::PLUGIN
                ),
                "the plugin is corrupt or hand-written with a short table: rebuild it with accel_plugin::export_plugin!",
            ));
        }
        // SAFETY: the 1.0 layout fits in `size` bytes (checked above); a
        // newer minor only appends fields we do not read.
        let t = unsafe { table.read() };
        if t.comm.is_null() {
            return Err(bad(
                Some("comm"),
                "its communicator table is null".into(),
                "rebuild the plugin with accel_plugin::export_plugin!",
            ));
        }
        // SAFETY: a non-null pointer to the plugin's static communicator table.
        let comm_size = unsafe { std::ptr::addr_of!((*t.comm).struct_size).read() };
        if comm_size < min_size::COMM {
            return Err(bad(
                Some("comm"),
                format!(
                    "its communicator table is {comm_size} bytes, smaller than the {} bytes of ABI 1.0",
                    min_size::COMM
                ),
                "rebuild the plugin with accel_plugin::export_plugin!",
            ));
        }
        // SAFETY: the 1.0 layout fits (checked above).
        let comm = unsafe { t.comm.read() };
        let mut lib = Lib {
            path: path.to_path_buf(),
            table: t,
            comm,
            abi_minor: header.abi_minor,
            name: String::new(),
        };
        let name = lib.text(t.name, "name")?;
        if name.is_empty() {
            return Err(bad(
                Some("name"),
                "its backend name is empty".into(),
                "give the backend a unique lower-case name",
            ));
        }
        lib.name = name;
        let version = lib.text(t.plugin_version, "plugin_version")?;
        let mut priority = 0i32;
        let f = lib.func(t.priority, "priority")?;
        // SAFETY: a function of the loaded plugin writing one i32.
        lib.check("priority", unsafe { f(&mut priority) })?;
        let mut kind = 0u32;
        let f = lib.func(t.device_kind, "device_kind")?;
        // SAFETY: a function of the loaded plugin writing one u32.
        lib.check("device_kind", unsafe { f(&mut kind) })?;
        let device_kind = DeviceKind::from_code(kind).ok_or_else(|| {
            bad(
                Some("device_kind"),
                format!("its device kind code {kind} is unknown to this host"),
                "upgrade the host, or rebuild the plugin against this host's accel-api",
            )
        })?;
        Ok(Arc::new(PluginBackend {
            lib: Arc::new(lib),
            version,
            priority,
            device_kind,
        }))
    }

    /// The shared object this backend was loaded from.
    pub fn path(&self) -> &Path {
        &self.lib.path
    }

    /// The plugin's own version (its crate version).
    pub fn plugin_version(&self) -> &str {
        &self.version
    }

    /// The ABI version the plugin was built with: `(major, minor)`.
    pub fn abi_version(&self) -> (u32, u32) {
        (ACCEL_PLUGIN_ABI_MAJOR, self.lib.abi_minor)
    }

    fn try_probe(&self, ctx: &ProbeContext) -> Result<Probe> {
        let f = self.lib.func(self.lib.table.probe, "probe")?;
        let c = AccelProbeContext {
            struct_size: min_size::PROBE_CONTEXT_1_1,
            world_size: ctx.world_size,
            local_world_size: ctx.local_world_size,
            mpi_launched: u32::from(ctx.mpi_launched),
            ranks_in_process: ctx.ranks_in_process,
        };
        let mut out = AccelProbeResult::unset();
        let mut reason = VecSink::default();
        let mut version = VecSink::default();
        // SAFETY: a function of the loaded plugin; every pointer and sink
        // outlives the call.
        let status = unsafe { f(&c, &mut out, reason.sink(), version.sink()) };
        self.lib.check("probe", status)?;
        let engine_version = (out.has_engine_version != 0).then(|| version.into_string());
        Ok(if out.available != 0 {
            Probe::available(out.device_count, engine_version)
        } else {
            let reason = if reason.written() {
                reason.into_string()
            } else {
                "the plugin gave no reason".to_string()
            };
            Probe {
                engine_version,
                ..Probe::unavailable(format!("{reason} (plugin {})", self.lib.path.display()))
            }
        })
    }
}

impl Backend for PluginBackend {
    fn name(&self) -> &str {
        &self.lib.name
    }

    fn priority(&self) -> i32 {
        self.priority
    }

    fn device_kind(&self) -> DeviceKind {
        self.device_kind
    }

    /// Forwards to the plugin. A failure or panic inside the plugin is
    /// reported as unavailable, with the reason and the plugin's path.
    fn probe(&self, ctx: &ProbeContext) -> Probe {
        self.try_probe(ctx).unwrap_or_else(|e| {
            let mut reason = format!("{} (plugin {}", e.message(), self.lib.path.display());
            if let Some(fix) = e.fix() {
                reason.push_str("; ");
                reason.push_str(fix);
            }
            reason.push(')');
            Probe::unavailable(reason)
        })
    }

    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>> {
        let f = self.lib.func(self.lib.table.connect, "connect")?;
        let store = store_vtable(ctx.store.clone());
        let c = AccelConnectContext {
            struct_size: min_size::CONNECT_CONTEXT,
            rank: ctx.rank,
            world_size: ctx.world_size,
            local_rank: ctx.local_rank,
            local_world_size: ctx.local_world_size,
            device_kind: ctx.device.kind.code(),
            device_index: ctx.device.index,
            timeout_ns: convert::duration_to_ns(ctx.timeout),
            run_id: AccelStr::new(&ctx.run_id),
            store: &store,
        };
        let mut handle: *mut AccelComm = std::ptr::null_mut();
        // SAFETY: a function of the loaded plugin; the context, the store
        // vtable and `handle` outlive the call; the plugin takes over the
        // store reference in `store.ctx`.
        let status = unsafe { f(&c, &mut handle) };
        self.lib
            .check("connect", status)
            .map_err(|e| e.with_rank(ctx.rank))?;
        if handle.is_null() {
            return Err(plugin_error(
                &self.lib.path,
                Some("connect"),
                "connect reported success but returned no communicator".into(),
                "this is a bug in the plugin: report it to its vendor",
            ));
        }
        // SAFETY: a fresh handle from the plugin's `connect`, ours to destroy.
        let engine = unsafe { PluginEngine::wrap(self.lib.clone(), handle) }?;
        Ok(Box::new(Group::new(engine)))
    }
}

#[cfg(unix)]
fn open(path: &Path) -> Result<AccelPluginEntryV1> {
    use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
    // SAFETY: loading a library runs its initialisers; that is the point of
    // a plugin, and the user asked for this file. RTLD_NOW makes missing
    // dependencies fail here instead of at a later call.
    let lib = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| cannot_load(path, e, " (`ldd` lists them)"))?;
    // SAFETY: the symbol, if present, has the type the ABI fixes for it.
    let entry = unsafe { lib.get::<AccelPluginEntryV1>(ENTRY_SYMBOL.as_bytes()) }.map(|s| *s);
    // Never unload, even when the symbol is missing: initialisers ran and may
    // have registered things (thread-local destructors, atexit handlers) that
    // point into the library.
    std::mem::forget(lib);
    entry.map_err(|e| missing_entry(path, e))
}

#[cfg(not(unix))]
fn open(path: &Path) -> Result<AccelPluginEntryV1> {
    // SAFETY: as in the unix version: running the library's initialisers is
    // what loading a plugin means.
    let lib = unsafe { libloading::Library::new(path) }.map_err(|e| cannot_load(path, e, ""))?;
    // SAFETY: the symbol, if present, has the type the ABI fixes for it.
    let entry = unsafe { lib.get::<AccelPluginEntryV1>(ENTRY_SYMBOL.as_bytes()) }.map(|s| *s);
    std::mem::forget(lib);
    entry.map_err(|e| missing_entry(path, e))
}

/// `path` is not a shared object this process can load; `ldd` is what the
/// fix names on unix.
fn cannot_load(path: &Path, e: libloading::Error, ldd: &str) -> Error {
    plugin_error(
        path,
        None,
        format!("cannot load it as a shared object: {e}"),
        &format!("check that it is a cdylib built for this platform (crate-type = [\"cdylib\"]) and that the libraries it needs are found{ldd}"),
    )
}

fn missing_entry(path: &Path, e: libloading::Error) -> Error {
    plugin_error(
        path,
        Some(ENTRY_SYMBOL),
        format!("it does not export `{ENTRY_SYMBOL}`, so it is not an accel plugin of ABI major {ACCEL_PLUGIN_ABI_MAJOR} ({e})"),
        "a plugin adds `accel_plugin::export_plugin!(MyBackend);` to a crate built with crate-type = [\"cdylib\"]; take non-plugin libraries off ACCEL_PLUGIN_PATH",
    )
}

// ---------------------------------------------------------------------------
// Communicator

/// The engine of a communicator living in a plugin: every call forwards
/// through the plugin's communicator table. Constant properties are read
/// once. The host wraps it in a [`Group`], so that every argument is
/// checked on this side of the boundary, before the plugin is called.
struct PluginEngine {
    lib: Arc<Lib>,
    handle: *mut AccelComm,
    info: EngineInfo,
}

// SAFETY: the ABI requires communicator handles to be thread-safe (they are
// a Rust `Box<dyn Communicator>`, `Send + Sync`, on the plugin side); the
// handle is destroyed only in `Drop`, when no call can be in flight.
unsafe impl Send for PluginEngine {}
// SAFETY: as for `Send`.
unsafe impl Sync for PluginEngine {}

impl fmt::Debug for PluginEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PluginEngine")
            .field("plugin", &self.lib.path)
            .finish_non_exhaustive()
    }
}

impl Drop for PluginEngine {
    fn drop(&mut self) {
        if let Some(destroy) = self.lib.comm.destroy {
            // SAFETY: we own the handle and destroy it once; `&mut self`
            // means no call is in flight. A failure has nowhere to go.
            let _ = unsafe { destroy(self.handle) };
        }
    }
}

impl PluginEngine {
    /// Take ownership of `handle` and read its constant properties. On
    /// failure the handle is destroyed.
    ///
    /// # Safety
    /// `handle` is a live handle from this plugin that nobody else owns.
    unsafe fn wrap(lib: Arc<Lib>, handle: *mut AccelComm) -> Result<PluginEngine> {
        // Built first so that `Drop` destroys the handle on every error path.
        let mut c = PluginEngine {
            lib,
            handle,
            info: EngineInfo {
                backend: String::new(),
                rank: 0,
                world_size: 0,
                device: Device::CPU,
                timeout: Duration::ZERO,
                capabilities: Capabilities::none(),
            },
        };
        let t = c.lib.comm;
        let f = c.lib.func(t.backend_name, "backend_name")?;
        let mut name = VecSink::default();
        // SAFETY: a live handle; the sink outlives the call.
        c.call("backend_name", unsafe { f(handle, name.sink()) })?;
        c.info.backend = name.into_string();
        let f = c.lib.func(t.rank, "rank")?;
        let mut rank = 0usize;
        // SAFETY: a live handle; `rank` outlives the call.
        c.call("rank", unsafe { f(handle, &mut rank) })?;
        let f = c.lib.func(t.world_size, "world_size")?;
        let mut world = 0usize;
        // SAFETY: a live handle; `world` outlives the call.
        c.call("world_size", unsafe { f(handle, &mut world) })?;
        let f = c.lib.func(t.device, "device")?;
        let (mut kind, mut index) = (0u32, 0u32);
        // SAFETY: a live handle; both outputs outlive the call.
        c.call("device", unsafe { f(handle, &mut kind, &mut index) })?;
        let f = c.lib.func(t.timeout, "timeout")?;
        let mut ns = 0u64;
        // SAFETY: a live handle; `ns` outlives the call.
        c.call("timeout", unsafe { f(handle, &mut ns) })?;
        let f = c.lib.func(t.capabilities, "capabilities")?;
        let mut caps = AccelCapabilities {
            struct_size: min_size::CAPABILITIES,
            ops: 0,
            dtypes: 0,
            reduce_dtypes: 0,
            reduce_ops: 0,
            device_kinds: 0,
            abort_interrupts: 0,
        };
        // SAFETY: a live handle; `caps` outlives the call.
        c.call("capabilities", unsafe { f(handle, &mut caps) })?;
        c.info.rank = rank;
        c.info.world_size = world;
        c.info.device = convert::device("device", kind, index).map_err(|e| c.context(e))?;
        c.info.timeout = convert::ns_to_duration(ns);
        c.info.capabilities = convert::caps_from_abi(&caps);
        Ok(c)
    }

    fn context(&self, e: Error) -> Error {
        let e = if self.info.backend.is_empty() {
            e.with_backend(self.lib.name.clone())
        } else {
            e.with_backend(self.info.backend.clone())
        };
        if self.info.world_size > 0 {
            e.with_rank(self.info.rank)
        } else {
            e
        }
    }

    fn call(&self, function: &str, status: AccelStatus) -> Result<()> {
        self.lib
            .check(function, status)
            .map_err(|e| self.context(e))
    }

    fn func<F>(&self, f: Option<F>, function: &str) -> Result<F> {
        self.lib.func(f, function).map_err(|e| self.context(e))
    }
}

impl Engine for PluginEngine {
    /// The plugin's own runtime computes averages (on device memory too).
    const NATIVE_AVG: bool = true;

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn all_reduce(&self, mut buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let f = self.func(self.lib.comm.all_reduce, "all_reduce")?;
        let b = convert::buf_mut_to_abi(&mut buf);
        // SAFETY: a live handle; `b` describes memory borrowed for the call.
        self.call("all_reduce", unsafe { f(self.handle, &b, op.code()) })
    }

    fn reduce(&self, mut buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        let f = self.func(self.lib.comm.reduce, "reduce")?;
        let b = convert::buf_mut_to_abi(&mut buf);
        // SAFETY: a live handle; `b` describes memory borrowed for the call.
        self.call("reduce", unsafe { f(self.handle, &b, op.code(), root) })
    }

    fn broadcast(&self, mut buf: BufMut<'_>, root: usize) -> Result<()> {
        let f = self.func(self.lib.comm.broadcast, "broadcast")?;
        let b = convert::buf_mut_to_abi(&mut buf);
        // SAFETY: a live handle; `b` describes memory borrowed for the call.
        self.call("broadcast", unsafe { f(self.handle, &b, root) })
    }

    fn all_gather(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let f = self.func(self.lib.comm.all_gather, "all_gather")?;
        let (s, r) = convert::send_recv_to_abi(&send, &mut recv);
        // SAFETY: a live handle; both describe memory borrowed for the call
        // (and cannot overlap: one is borrowed mutably).
        self.call("all_gather", unsafe { f(self.handle, &s, &r) })
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let f = self.func(self.lib.comm.gather, "gather")?;
        let s = convert::buf_to_abi(&send);
        let mut recv = recv;
        let r = recv.as_mut().map(convert::buf_mut_to_abi);
        let rp = convert::ptr_or_null(&r);
        // SAFETY: a live handle; the buffers describe memory borrowed for the
        // call; a null `recv` means none.
        self.call("gather", unsafe { f(self.handle, &s, rp, root) })
    }

    fn scatter(&self, send: Option<Buf<'_>>, mut recv: BufMut<'_>, root: usize) -> Result<()> {
        let f = self.func(self.lib.comm.scatter, "scatter")?;
        let s = send.as_ref().map(convert::buf_to_abi);
        let sp = convert::ptr_or_null(&s);
        let r = convert::buf_mut_to_abi(&mut recv);
        // SAFETY: a live handle; the buffers describe memory borrowed for the
        // call; a null `send` means none.
        self.call("scatter", unsafe { f(self.handle, sp, &r, root) })
    }

    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let f = self.func(self.lib.comm.reduce_scatter, "reduce_scatter")?;
        let (s, r) = convert::send_recv_to_abi(&send, &mut recv);
        // SAFETY: a live handle; both describe memory borrowed for the call.
        self.call("reduce_scatter", unsafe {
            f(self.handle, &s, &r, op.code())
        })
    }

    fn all_to_all(&self, send: Buf<'_>, mut recv: BufMut<'_>) -> Result<()> {
        let f = self.func(self.lib.comm.all_to_all, "all_to_all")?;
        let (s, r) = convert::send_recv_to_abi(&send, &mut recv);
        // SAFETY: a live handle; both describe memory borrowed for the call.
        self.call("all_to_all", unsafe { f(self.handle, &s, &r) })
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let f = self.func(self.lib.comm.send, "send")?;
        let b = convert::buf_to_abi(&buf);
        // SAFETY: a live handle; `b` describes memory borrowed for the call.
        self.call("send", unsafe { f(self.handle, &b, dst, tag) })
    }

    fn recv(&self, mut buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let f = self.func(self.lib.comm.recv, "recv")?;
        let b = convert::buf_mut_to_abi(&mut buf);
        // SAFETY: a live handle; `b` describes memory borrowed for the call.
        self.call("recv", unsafe { f(self.handle, &b, src, tag) })
    }

    fn barrier(&self) -> Result<()> {
        let f = self.func(self.lib.comm.barrier, "barrier")?;
        // SAFETY: a live handle.
        self.call("barrier", unsafe { f(self.handle) })
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<PluginEngine>> {
        let f = self.func(self.lib.comm.split, "split")?;
        let mut out: *mut AccelComm = std::ptr::null_mut();
        // SAFETY: a live handle; `out` outlives the call.
        let status = unsafe {
            f(
                self.handle,
                u32::from(color.is_some()),
                color.unwrap_or(0),
                key,
                &mut out,
            )
        };
        self.call("split", status)?;
        if out.is_null() {
            return Ok(None);
        }
        // SAFETY: a fresh handle from the plugin's `split`, ours to destroy.
        let sub = unsafe { PluginEngine::wrap(self.lib.clone(), out) }?;
        Ok(Some(sub))
    }

    fn abort(&self, reason: &str) {
        if let Some(f) = self.lib.comm.abort {
            // SAFETY: a live handle; `reason` outlives the call. `abort`
            // never fails by contract; a failure has nowhere to go.
            let _ = unsafe { f(self.handle, AccelStr::new(reason)) };
        }
    }
}

// ---------------------------------------------------------------------------
// The host's store as a vtable

/// The vtable for `store`; its `ctx` owns one reference that the plugin
/// gives back through `release`.
fn store_vtable(store: Arc<dyn Store>) -> AccelStoreV1 {
    AccelStoreV1 {
        struct_size: min_size::STORE,
        ctx: Box::into_raw(Box::new(store)) as *mut c_void,
        release: Some(store_release),
        last_error: Some(store_last_error),
        set: Some(store_set),
        get: Some(store_get),
        try_get: Some(store_try_get),
        add: Some(store_add),
        compare_set: Some(store_compare_set),
        wait: Some(store_wait),
        delete: Some(store_delete),
        describe: Some(store_describe),
    }
}

/// `store` as a plugin sees it: through the host's vtable and back as the
/// plugin side's store (`store_tests.rs`, in one process).
#[cfg(test)]
pub(crate) fn across_the_abi(store: Arc<dyn Store>) -> Arc<dyn Store> {
    let vt = store_vtable(store);
    // SAFETY: `vt` is a complete 1.0 store vtable, live for this call; the
    // plugin side's store takes over its one reference.
    let foreign = unsafe { crate::export::ForeignStore::adopt(&vt) };
    Arc::new(foreign.expect("a complete store vtable"))
}

/// The store behind `ctx`.
///
/// # Safety
/// `ctx` was made by [`store_vtable`] and not yet released.
unsafe fn host_store<'a>(ctx: *mut c_void) -> &'a Arc<dyn Store> {
    // SAFETY: `ctx` is a live `Box<Arc<dyn Store>>` (caller's guarantee).
    unsafe { &*(ctx as *const Arc<dyn Store>) }
}

/// Read a key passed by the plugin.
///
/// # Safety
/// `key` points to text valid for the current call.
unsafe fn key_of(function: &str, key: AccelStr) -> Result<String> {
    // SAFETY: valid for the current call (caller's guarantee).
    unsafe { key.read() }
        .map(|k| k.into_owned())
        .ok_or_else(|| Error::invalid_argument(function, "the plugin passed a null key"))
}

unsafe extern "C" fn store_release(ctx: *mut c_void) {
    let _ = std::panic::catch_unwind(|| {
        if !ctx.is_null() {
            // SAFETY: the plugin gives back the reference `store_vtable`
            // created, exactly once (ABI contract).
            drop(unsafe { Box::from_raw(ctx as *mut Arc<dyn Store>) });
        }
    });
}

unsafe extern "C" fn store_last_error(_ctx: *mut c_void) -> *const AccelError {
    Slot::HostStore.get()
}

unsafe extern "C" fn store_set(ctx: *mut c_void, key: AccelStr, value: AccelBytes) -> AccelStatus {
    guard(Slot::HostStore, "store set", || {
        // SAFETY: a live `ctx`; key and value are valid for this call.
        let (store, key, value) =
            unsafe { (host_store(ctx), key_of("store set", key)?, value.read()) };
        store.set(&key, value)
    })
}

unsafe extern "C" fn store_get(
    ctx: *mut c_void,
    key: AccelStr,
    timeout_ns: u64,
    value: AccelSink,
) -> AccelStatus {
    guard(Slot::HostStore, "store get", || {
        // SAFETY: a live `ctx`; the key is valid for this call.
        let (store, key) = unsafe { (host_store(ctx), key_of("store get", key)?) };
        let v = store.get(&key, convert::ns_to_duration(timeout_ns))?;
        // SAFETY: the plugin's sink is valid for this call.
        unsafe { write_sink(value, &v) };
        Ok(())
    })
}

/// An [`ErrorKind::InvalidArgument`] error of `op` saying `message` when
/// the output pointer `p` is null.
fn non_null<T>(op: &str, p: *mut T, message: &str) -> Result<()> {
    if p.is_null() {
        return Err(Error::invalid_argument(op, message));
    }
    Ok(())
}

unsafe extern "C" fn store_try_get(
    ctx: *mut c_void,
    key: AccelStr,
    found: *mut u32,
    value: AccelSink,
) -> AccelStatus {
    guard(Slot::HostStore, "store try_get", || {
        non_null("store try_get", found, "null `found` pointer")?;
        // SAFETY: a live `ctx`; the key is valid for this call.
        let (store, key) = unsafe { (host_store(ctx), key_of("store try_get", key)?) };
        let v = store.try_get(&key)?;
        // SAFETY: `found` is non-null and writable; the sink is valid.
        unsafe {
            found.write(u32::from(v.is_some()));
            if let Some(v) = v {
                write_sink(value, &v);
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn store_add(
    ctx: *mut c_void,
    key: AccelStr,
    delta: i64,
    out: *mut i64,
) -> AccelStatus {
    guard(Slot::HostStore, "store add", || {
        non_null("store add", out, "null output pointer")?;
        // SAFETY: a live `ctx`; the key is valid for this call.
        let (store, key) = unsafe { (host_store(ctx), key_of("store add", key)?) };
        let v = store.add(&key, delta)?;
        // SAFETY: non-null and writable.
        unsafe { out.write(v) };
        Ok(())
    })
}

unsafe extern "C" fn store_compare_set(
    ctx: *mut c_void,
    key: AccelStr,
    expected: *const AccelBytes,
    desired: AccelBytes,
    outcome: *mut u32,
    current: AccelSink,
) -> AccelStatus {
    guard(Slot::HostStore, "store compare_set", || {
        non_null("store compare_set", outcome, "null outcome pointer")?;
        // SAFETY: a live `ctx`; key, `expected` (null or valid) and
        // `desired` are valid for this call.
        let (store, key, expected, desired) = unsafe {
            (
                host_store(ctx),
                key_of("store compare_set", key)?,
                if expected.is_null() {
                    None
                } else {
                    Some(expected.read().read())
                },
                desired.read(),
            )
        };
        let r = store.compare_set(&key, expected, desired)?;
        // SAFETY: `outcome` is non-null and writable; the sink is valid.
        unsafe {
            match r {
                CasOutcome::Swapped => outcome.write(ACCEL_CAS_SWAPPED),
                CasOutcome::Current(None) => outcome.write(ACCEL_CAS_ABSENT),
                CasOutcome::Current(Some(v)) => {
                    outcome.write(ACCEL_CAS_CURRENT);
                    write_sink(current, &v);
                }
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn store_wait(
    ctx: *mut c_void,
    keys: *const AccelStr,
    n_keys: usize,
    timeout_ns: u64,
) -> AccelStatus {
    guard(Slot::HostStore, "store wait", || {
        if keys.is_null() && n_keys > 0 {
            return Err(Error::invalid_argument("store wait", "null key array"));
        }
        let views: &[AccelStr] = if n_keys == 0 {
            &[]
        } else {
            // SAFETY: `n_keys` key views at `keys`, valid for this call.
            unsafe { std::slice::from_raw_parts(keys, n_keys) }
        };
        let mut owned = Vec::with_capacity(views.len());
        for k in views {
            // SAFETY: each key's text is valid for this call.
            owned.push(unsafe { key_of("store wait", *k) }?);
        }
        let refs: Vec<&str> = owned.iter().map(String::as_str).collect();
        // SAFETY: a live `ctx`.
        let store = unsafe { host_store(ctx) };
        store.wait(&refs, convert::ns_to_duration(timeout_ns))
    })
}

unsafe extern "C" fn store_delete(
    ctx: *mut c_void,
    key: AccelStr,
    existed: *mut u32,
) -> AccelStatus {
    guard(Slot::HostStore, "store delete", || {
        non_null("store delete", existed, "null output pointer")?;
        // SAFETY: a live `ctx`; the key is valid for this call.
        let (store, key) = unsafe { (host_store(ctx), key_of("store delete", key)?) };
        let e = store.delete(&key)?;
        // SAFETY: non-null and writable.
        unsafe { existed.write(u32::from(e)) };
        Ok(())
    })
}

unsafe extern "C" fn store_describe(ctx: *mut c_void, out: AccelSink) -> AccelStatus {
    guard(Slot::HostStore, "store describe", || {
        // SAFETY: a live `ctx`.
        let d = unsafe { host_store(ctx) }.describe();
        // SAFETY: the plugin's sink is valid for this call.
        unsafe { write_sink(out, d.as_bytes()) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    //! Both halves in one process, without `dlopen`: the exported table of
    //! the `single` backend wrapped by the host side.
    use super::*;
    use crate::export::{table, Exported};
    use accel_api::CommunicatorExt;

    struct InProcess;

    impl Exported for InProcess {
        const PLUGIN_VERSION: &'static str = "9.9.9";

        fn backend() -> &'static dyn Backend {
            static B: accel_api::kit::StaticBackend = accel_backend_single::BACKEND;
            &B
        }
    }

    static TABLE: AccelPluginV1 = table::<InProcess>();

    fn backend() -> Arc<PluginBackend> {
        // SAFETY: a static table built by `export::table`, valid forever.
        unsafe { PluginBackend::from_table(Path::new("<in-process>"), &TABLE) }.unwrap()
    }

    /// A plugin whose probe says which `ranks_in_process` it saw.
    struct Echo;

    impl Exported for Echo {
        const PLUGIN_VERSION: &'static str = "1.1.0";

        fn backend() -> &'static dyn Backend {
            static B: accel_api::kit::StaticBackend = accel_api::kit::StaticBackend::new(
                "echo",
                0,
                DeviceKind::Cpu,
                |ctx| Probe::unavailable(format!("ranks_in_process={}", ctx.ranks_in_process)),
                |_| Err(Error::unsupported("connect", "a probe-only test plugin")),
            );
            &B
        }
    }

    #[test]
    fn the_probe_context_carries_ranks_in_process_and_a_1_0_host_means_one() {
        static ECHO: AccelPluginV1 = table::<Echo>();
        // SAFETY: a static table built by `export::table`, valid forever.
        let b = unsafe { PluginBackend::from_table(Path::new("<echo>"), &ECHO) }.unwrap();
        let ctx = ProbeContext {
            ranks_in_process: 4,
            ..ProbeContext::single_process()
        };
        let reason = b.probe(&ctx).reason().unwrap().to_string();
        assert!(reason.contains("ranks_in_process=4"), "{reason}");

        // A 1.0 host's context ends before the field: the plugin reads 1,
        // never the bytes past `struct_size`.
        let c = AccelProbeContext {
            struct_size: min_size::PROBE_CONTEXT,
            world_size: 1,
            local_world_size: 1,
            mpi_launched: 0,
            ranks_in_process: 9,
        };
        let mut out = AccelProbeResult::unset();
        let mut reason = VecSink::default();
        let mut version = VecSink::default();
        let f = ECHO.probe.unwrap();
        // SAFETY: the exported probe; every pointer and sink outlives the call.
        let status = unsafe { f(&c, &mut out, reason.sink(), version.sink()) };
        assert_eq!(status, ACCEL_OK);
        assert_eq!(reason.into_string(), "ranks_in_process=1");
    }

    #[test]
    fn a_newer_minor_with_a_longer_table_loads() {
        /// A table from a future 1.x: the 1.0 fields, then fields we do
        /// not know.
        #[repr(C)]
        struct Future {
            v1: AccelPluginV1,
            appended: [usize; 4],
        }
        let mut v1 = table::<InProcess>();
        v1.struct_size = std::mem::size_of::<Future>();
        v1.abi_minor = ACCEL_PLUGIN_ABI_MINOR + 5;
        let future = Box::leak(Box::new(Future {
            v1,
            appended: [usize::MAX; 4],
        }));
        assert_eq!(future.appended.len(), 4);
        // SAFETY: a leaked table following the ABI, valid forever.
        let b = unsafe {
            PluginBackend::from_table(Path::new("<future>"), &future.v1 as *const AccelPluginV1)
        }
        .unwrap();
        assert_eq!(b.abi_version(), (1, ACCEL_PLUGIN_ABI_MINOR + 5));
        assert!(b.probe(&ProbeContext::single_process()).is_available());
    }

    #[test]
    fn exported_table_round_trips_in_process() {
        let b = backend();
        assert_eq!(
            (b.name(), b.plugin_version(), b.abi_version()),
            ("single", "9.9.9", (1, ACCEL_PLUGIN_ABI_MINOR))
        );
        let c = b
            .connect(ConnectContext {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                device: Device::CPU,
                timeout: Duration::from_millis(50),
                store: Arc::new(accel_rendezvous::MemoryStore::new()),
                run_id: "r".into(),
            })
            .unwrap();
        assert_eq!(c.all_gather_vec(&[1u8, 2]).unwrap(), vec![1, 2]);
        let e = c.gather_vec(&[1u8], 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "[single rank 0] gather: root 3 is not a rank of this group (world size 1)"
        );
        let e = c
            .scatter(None, BufMut::from(&mut [0i32][..]), 0)
            .unwrap_err();
        assert!(
            e.to_string().contains("the root must pass a send buffer"),
            "{e}"
        );
    }
}
