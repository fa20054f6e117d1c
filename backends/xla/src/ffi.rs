//! The PJRT C API: `#[repr(C)]` declarations written by hand from the
//! vendored `third_party/pjrt/pjrt_c_api.h` (PJRT API 0.81, Apache-2.0, its
//! license beside it), and safe handles over them. Every `unsafe` block of
//! the crate is here.
//!
//! Only the structs and functions the backend calls are declared. PJRT is
//! forward compatible by `struct_size`: every argument struct starts with its
//! size, a newer plugin reads only the fields an older caller declared, and
//! the function table only grows at its end. So the table is declared up to
//! the last entry used ([`Api`]) and a plugin whose table is shorter is
//! refused when it is loaded.

use std::ffi::{c_char, c_int, c_void};
use std::mem::size_of;
use std::path::Path;
use std::ptr::{self, NonNull};

use crate::error::XlaError;

/// `PJRT_API_MAJOR` of the vendored header: a plugin with another major
/// version has an incompatible table.
pub(crate) const API_MAJOR: i32 = 0;

/// The plugin's entry point, `const PJRT_Api* GetPjrtApi(void)`.
const ENTRY: &[u8] = b"GetPjrtApi\0";

/// `PJRT_Buffer_Type` values of the element types accel carries.
pub(crate) mod buffer_type {
    pub(crate) const S8: i32 = 2;
    pub(crate) const S32: i32 = 4;
    pub(crate) const S64: i32 = 5;
    pub(crate) const U8: i32 = 6;
    pub(crate) const F16: i32 = 10;
    pub(crate) const F32: i32 = 11;
    pub(crate) const F64: i32 = 12;
    pub(crate) const BF16: i32 = 13;
}

/// `PJRT_NamedValue_kInt64`.
const NAMED_VALUE_INT64: c_int = 1;
/// `PJRT_NamedValue_kInt64List`.
const NAMED_VALUE_INT64_LIST: c_int = 2;
/// `PJRT_HostBufferSemantics_kImmutableOnlyDuringCall`: the plugin copies
/// the host data before `BufferFromHostBuffer` returns.
const IMMUTABLE_ONLY_DURING_CALL: c_int = 0;

/// Opaque PJRT objects, only ever handled through pointers.
macro_rules! opaque {
    ($($name:ident),*) => {$(
        #[repr(C)]
        pub(crate) struct $name {
            _opaque: [u8; 0],
        }
    )*};
}
opaque!(
    RawError,
    RawClient,
    RawDevice,
    RawExecutable,
    RawBuffer,
    RawEvent
);

/// A pointer to a PJRT object (a client, device, executable or buffer),
/// never null. It prints as its type, never its address.
struct Handle<T>(NonNull<T>);

// SAFETY: `T` is one of this module's opaque PJRT types (the handle is
// private here), and PJRT's objects are thread-safe: the C API allows
// concurrent calls on one client, its devices, executables and buffers from
// several threads. The types holding a handle own it (or borrow it from an
// owner that outlives them) and destroy it once, in `Drop`.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as for `Send`: shared use only passes the pointer to PJRT.
unsafe impl<T> Sync for Handle<T> {}

impl<T> Handle<T> {
    /// `None` for a null pointer.
    fn new(p: *mut T) -> Option<Handle<T>> {
        NonNull::new(p).map(Handle)
    }

    fn as_ptr(&self) -> *mut T {
        self.0.as_ptr()
    }
}

impl<T> Clone for Handle<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Handle<T> {}

impl<T> std::fmt::Debug for Handle<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = std::any::type_name::<T>();
        write!(f, "{}", name.rsplit("::").next().unwrap_or(name))
    }
}

type Call<A> = Option<unsafe extern "C" fn(*mut A) -> *mut RawError>;
type VoidCall<A> = Option<unsafe extern "C" fn(*mut A)>;
/// A table entry the backend never calls (only its size matters).
type Unused = Option<unsafe extern "C" fn()>;

#[repr(C)]
struct ApiVersion {
    struct_size: usize,
    extension_start: *mut c_void,
    major_version: c_int,
    minor_version: c_int,
}

/// `PJRT_Api`, up to `PJRT_Buffer_ToHostBuffer` (the last entry used).
#[repr(C)]
pub(crate) struct Api {
    struct_size: usize,
    extension_start: *mut c_void,
    version: ApiVersion,
    error_destroy: VoidCall<ErrorDestroyArgs>,
    error_message: VoidCall<ErrorMessageArgs>,
    error_get_code: Call<ErrorGetCodeArgs>,
    plugin_initialize: Call<PluginInitializeArgs>,
    plugin_attributes: Call<PluginAttributesArgs>,
    event_destroy: Call<EventArgs>,
    _event_is_ready: Unused,
    _event_error: Unused,
    event_await: Call<EventArgs>,
    _event_on_ready: Unused,
    client_create: Call<ClientCreateArgs>,
    client_destroy: Call<ClientDestroyArgs>,
    client_platform_name: Call<ClientStringArgs>,
    _client_process_index: Unused,
    client_platform_version: Call<ClientStringArgs>,
    _client_devices: Unused,
    client_addressable_devices: Call<DevicesArgs>,
    _client_lookup_device: Unused,
    _client_lookup_addressable_device: Unused,
    _client_addressable_memories: Unused,
    client_compile: Call<CompileArgs>,
    _client_default_device_assignment: Unused,
    client_buffer_from_host_buffer: Call<FromHostArgs>,
    /// DeviceDescription (6), Device (6), Memory (5), Executable (10).
    _descriptions_devices_memories_executables: [Unused; 27],
    loaded_executable_destroy: Call<ExecutableDestroyArgs>,
    _loaded_executable_get_executable: Unused,
    loaded_executable_addressable_devices: Call<DevicesArgs>,
    _loaded_executable_delete: Unused,
    _loaded_executable_is_deleted: Unused,
    loaded_executable_execute: Call<ExecuteArgs>,
    _executable_deserialize_and_load: Unused,
    _loaded_executable_fingerprint: Unused,
    buffer_destroy: Call<BufferDestroyArgs>,
    /// ElementType .. CopyToDevice (11 entries).
    _buffer_queries: [Unused; 11],
    buffer_to_host_buffer: Call<ToHostArgs>,
}

#[repr(C)]
struct ErrorDestroyArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    error: *mut RawError,
}

#[repr(C)]
struct ErrorMessageArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    error: *const RawError,
    message: *const c_char,
    message_size: usize,
}

#[repr(C)]
struct ErrorGetCodeArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    error: *const RawError,
    code: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
union NamedValueUnion {
    string_value: *const c_char,
    int64_value: i64,
    int64_array_value: *const i64,
    float_value: f32,
    bool_value: bool,
}

#[repr(C)]
struct NamedValue {
    struct_size: usize,
    extension_start: *mut c_void,
    name: *const c_char,
    name_size: usize,
    kind: c_int,
    value: NamedValueUnion,
    value_size: usize,
}

#[repr(C)]
struct PluginInitializeArgs {
    struct_size: usize,
    extension_start: *mut c_void,
}

#[repr(C)]
struct PluginAttributesArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    attributes: *const NamedValue,
    num_attributes: usize,
}

#[repr(C)]
struct EventArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    event: *mut RawEvent,
}

#[repr(C)]
struct ClientCreateArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    create_options: *const NamedValue,
    num_options: usize,
    kv_get_callback: *mut c_void,
    kv_get_user_arg: *mut c_void,
    kv_put_callback: *mut c_void,
    kv_put_user_arg: *mut c_void,
    client: *mut RawClient,
    kv_try_get_callback: *mut c_void,
    kv_try_get_user_arg: *mut c_void,
}

#[repr(C)]
struct ClientDestroyArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    client: *mut RawClient,
}

/// `PJRT_Client_PlatformName_Args` and `PJRT_Client_PlatformVersion_Args`
/// (the same layout).
#[repr(C)]
struct ClientStringArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    client: *mut RawClient,
    value: *const c_char,
    value_size: usize,
}

/// `PJRT_Client_AddressableDevices_Args` and
/// `PJRT_LoadedExecutable_AddressableDevices_Args` (the same layout: the
/// owner is a client or an executable).
#[repr(C)]
struct DevicesArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    owner: *mut c_void,
    devices: *const *mut RawDevice,
    num_devices: usize,
}

#[repr(C)]
struct Program {
    struct_size: usize,
    extension_start: *mut c_void,
    code: *mut c_char,
    code_size: usize,
    format: *const c_char,
    format_size: usize,
}

#[repr(C)]
struct CompileArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    client: *mut RawClient,
    program: *const Program,
    compile_options: *const c_char,
    compile_options_size: usize,
    executable: *mut RawExecutable,
}

#[repr(C)]
struct FromHostArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    client: *mut RawClient,
    data: *const c_void,
    kind: c_int,
    dims: *const i64,
    num_dims: usize,
    byte_strides: *const i64,
    num_byte_strides: usize,
    host_buffer_semantics: c_int,
    device: *mut RawDevice,
    memory: *mut c_void,
    device_layout: *mut c_void,
    done_with_host_buffer: *mut RawEvent,
    buffer: *mut RawBuffer,
}

#[repr(C)]
struct ExecuteOptions {
    struct_size: usize,
    extension_start: *mut c_void,
    send_callbacks: *mut c_void,
    recv_callbacks: *mut c_void,
    num_send_ops: usize,
    num_recv_ops: usize,
    launch_id: c_int,
    non_donatable_input_indices: *const i64,
    num_non_donatable_input_indices: usize,
    context: *mut c_void,
    call_location: *const c_char,
    num_tasks: usize,
    task_ids: *mut c_int,
    incarnation_ids: *mut i64,
}

#[repr(C)]
struct ExecuteArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    executable: *mut RawExecutable,
    options: *mut ExecuteOptions,
    argument_lists: *const *const *mut RawBuffer,
    num_devices: usize,
    num_args: usize,
    output_lists: *const *mut *mut RawBuffer,
    device_complete_events: *mut *mut RawEvent,
    execute_device: *mut RawDevice,
}

#[repr(C)]
struct ToHostArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    src: *mut RawBuffer,
    host_layout: *mut c_void,
    dst: *mut c_void,
    dst_size: usize,
    event: *mut RawEvent,
}

#[repr(C)]
struct BufferDestroyArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    buffer: *mut RawBuffer,
}

#[repr(C)]
struct ExecutableDestroyArgs {
    struct_size: usize,
    extension_start: *mut c_void,
    executable: *mut RawExecutable,
}

/// A zeroed argument struct with its `struct_size` set. Every argument
/// struct here is plain data (integers, raw pointers, optional function
/// pointers) for which all-zero is a valid value (null, 0, `None`).
fn args<T>() -> T {
    // SAFETY: only instantiated with the `#[repr(C)]` argument structs of
    // this module, whose fields are integers, raw pointers, `Option` of
    // function pointers and a union of those: all-zero bytes are a valid
    // value of each.
    let mut a: T = unsafe { std::mem::zeroed() };
    // SAFETY: every argument struct starts with `size_t struct_size`
    // (checked by `struct_size_comes_first`), so the first `usize` of `a`
    // is that field.
    unsafe { ptr::write((&raw mut a).cast::<usize>(), size_of::<T>()) };
    a
}

/// A loaded plugin: its function table, valid for the rest of the process
/// (the library is never unloaded).
#[derive(Clone, Copy)]
pub(crate) struct Plugin {
    api: &'static Api,
}

// SAFETY: the table is immutable after `GetPjrtApi` returned it, and the
// PJRT C API's functions may be called from any thread.
unsafe impl Send for Plugin {}
// SAFETY: as for `Send`: shared references only read the immutable table.
unsafe impl Sync for Plugin {}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (major, minor) = self.version();
        write!(f, "Plugin(PJRT API {major}.{minor})")
    }
}

/// A required function pointer, or an error naming it.
fn need<F: Copy>(f: Option<F>, name: &str) -> Result<F, XlaError> {
    f.ok_or_else(|| XlaError::Incompatible(format!("the plugin's table has no {name}")))
}

impl Plugin {
    /// Load the shared object at `path`, fetch its `GetPjrtApi` table, check
    /// its version and size, and initialise the plugin. The library stays
    /// loaded for the rest of the process.
    ///
    /// # Errors
    /// [`XlaError::Load`] when the file is missing or not a loadable shared
    /// object, [`XlaError::Symbol`] without `GetPjrtApi`,
    /// [`XlaError::Incompatible`] for an incompatible table, [`XlaError::Pjrt`]
    /// when initialisation fails.
    pub(crate) fn load(path: &Path) -> Result<Plugin, XlaError> {
        // SAFETY: loading runs the library's initialisers. The path is what
        // the user configured as a PJRT plugin; PJRT plugins have no
        // initialisers with preconditions on the loading process. A file
        // that is not a shared object fails here with dlopen's message.
        let lib =
            unsafe { libloading::Library::new(path) }.map_err(|e| XlaError::Load(e.to_string()))?;
        // SAFETY: `GetPjrtApi` is declared by the PJRT C API as
        // `const PJRT_Api* GetPjrtApi(void)`, the type given here.
        let entry = unsafe { lib.get::<unsafe extern "C" fn() -> *const Api>(ENTRY) }
            .map_err(|e| XlaError::Symbol(e.to_string()))?;
        // SAFETY: the entry point takes no arguments and returns a pointer
        // to a table owned by the library.
        let table = unsafe { entry() };
        // Never unloaded: the table, and every object the plugin creates,
        // point into the library (rustc and tree-sitter do the same).
        std::mem::forget(lib);
        if table.is_null() {
            return Err(XlaError::Incompatible(
                "GetPjrtApi returned no table".into(),
            ));
        }
        // SAFETY: the first field of every PJRT_Api is `size_t struct_size`;
        // reading it is valid for any table version.
        let size = unsafe { ptr::read(table.cast::<usize>()) };
        if size < size_of::<Api>() {
            return Err(XlaError::Incompatible(format!(
                "its function table has {size} bytes, this backend needs {} (PJRT API 0.81 or newer)",
                size_of::<Api>()
            )));
        }
        // SAFETY: the table is at least as large as `Api` (checked above),
        // and it lives as long as the library, which is never unloaded.
        let api: &'static Api = unsafe { &*table };
        let plugin = Plugin { api };
        let (major, minor) = plugin.version();
        if major != API_MAJOR {
            return Err(XlaError::Incompatible(format!(
                "it implements PJRT API {major}.{minor}, this backend speaks major version {API_MAJOR}"
            )));
        }
        let mut a: PluginInitializeArgs = args();
        plugin.call(
            plugin.api.plugin_initialize,
            "PJRT_Plugin_Initialize",
            &mut a,
        )?;
        Ok(plugin)
    }

    /// The plugin's PJRT API version (major, minor).
    pub(crate) fn version(&self) -> (i32, i32) {
        (
            self.api.version.major_version,
            self.api.version.minor_version,
        )
    }

    /// Call one table entry, turning a returned `PJRT_Error` into
    /// [`XlaError::Pjrt`].
    fn call<A>(&self, f: Call<A>, name: &str, a: &mut A) -> Result<(), XlaError> {
        let f = need(f, name)?;
        // SAFETY: `f` comes from the plugin's table at the slot declared
        // for `name`, whose C signature is `PJRT_Error* name(A* args)`;
        // `a` is a valid, initialised `A` with its `struct_size` set.
        let err = unsafe { f(a) };
        match NonNull::new(err) {
            None => Ok(()),
            Some(e) => Err(self.take_error(e, name)),
        }
    }

    /// Read and destroy a `PJRT_Error`.
    fn take_error(&self, e: NonNull<RawError>, during: &str) -> XlaError {
        let mut m: ErrorMessageArgs = args();
        m.error = e.as_ptr();
        let mut message = String::from("(no message)");
        if let Some(f) = self.api.error_message {
            // SAFETY: `PJRT_Error_Message` reads the live error `e` and
            // sets a pointer/length pair into memory owned by the error.
            unsafe { f(&mut m) };
            if !m.message.is_null() {
                // SAFETY: the plugin promises `message_size` readable bytes
                // at `message`, valid until the error is destroyed (below).
                let bytes =
                    unsafe { std::slice::from_raw_parts(m.message.cast::<u8>(), m.message_size) };
                message = String::from_utf8_lossy(bytes).into_owned();
            }
        }
        let mut c: ErrorGetCodeArgs = args();
        c.error = e.as_ptr();
        let code = match self.api.error_get_code {
            // SAFETY: `PJRT_Error_GetCode` reads the live error `e`.
            Some(f) if unsafe { f(&mut c) }.is_null() => c.code,
            _ => 2, // PJRT_Error_Code_UNKNOWN
        };
        let mut d: ErrorDestroyArgs = args();
        d.error = e.as_ptr();
        if let Some(f) = self.api.error_destroy {
            // SAFETY: destroys `e`, which is not used again.
            unsafe { f(&mut d) };
        }
        XlaError::Pjrt {
            during: during.to_string(),
            code,
            message,
        }
    }

    /// The plugin's attributes that are integers or integer lists, as
    /// `(name, values)` (`xla_version`, `stablehlo_current_version`, ...).
    pub(crate) fn int_attributes(&self) -> Vec<(String, Vec<i64>)> {
        let mut a: PluginAttributesArgs = args();
        if self
            .call(self.api.plugin_attributes, "PJRT_Plugin_Attributes", &mut a)
            .is_err()
            || a.attributes.is_null()
        {
            return Vec::new();
        }
        // SAFETY: the plugin returned `num_attributes` named values at
        // `attributes`, owned by the plugin and valid for its lifetime.
        let attrs = unsafe { std::slice::from_raw_parts(a.attributes, a.num_attributes) };
        let mut out = Vec::new();
        for v in attrs {
            if v.name.is_null() {
                continue;
            }
            // SAFETY: `name_size` bytes at `name`, owned by the plugin.
            let name = unsafe { std::slice::from_raw_parts(v.name.cast::<u8>(), v.name_size) };
            let name = String::from_utf8_lossy(name).into_owned();
            let values = match v.kind {
                // SAFETY: the kind says the union holds `int64_value`.
                NAMED_VALUE_INT64 => vec![unsafe { v.value.int64_value }],
                NAMED_VALUE_INT64_LIST => {
                    // SAFETY: the kind says the union holds a pointer to
                    // `value_size` integers owned by the plugin.
                    let p = unsafe { v.value.int64_array_value };
                    if p.is_null() {
                        continue;
                    }
                    // SAFETY: as above.
                    unsafe { std::slice::from_raw_parts(p, v.value_size) }.to_vec()
                }
                _ => continue,
            };
            out.push((name, values));
        }
        out
    }
}

/// A PJRT client: the plugin's view of its devices.
pub(crate) struct Client {
    plugin: Plugin,
    raw: Handle<RawClient>,
    devices: Vec<DevicePtr>,
}

/// A device of a client (owned by the client).
type DevicePtr = Handle<RawDevice>;

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("devices", &self.devices.len())
            .finish_non_exhaustive()
    }
}

impl Client {
    /// Create a client; `cpu_device_count` is passed as the create option
    /// of that name (CPU plugins; other plugins ignore unknown options or
    /// say so in the error).
    ///
    /// # Errors
    /// [`XlaError::Pjrt`] when the plugin refuses.
    pub(crate) fn create(plugin: Plugin, cpu_device_count: i64) -> Result<Client, XlaError> {
        let name = "cpu_device_count";
        let mut opt: NamedValue = args();
        opt.name = name.as_ptr().cast();
        opt.name_size = name.len();
        opt.kind = NAMED_VALUE_INT64;
        opt.value = NamedValueUnion {
            int64_value: cpu_device_count,
        };
        opt.value_size = 1;
        let mut a: ClientCreateArgs = args();
        a.create_options = &opt;
        a.num_options = 1;
        plugin.call(plugin.api.client_create, "PJRT_Client_Create", &mut a)?;
        let raw = Handle::new(a.client)
            .ok_or_else(|| XlaError::Broken("PJRT_Client_Create returned no client".into()))?;
        let mut client = Client {
            plugin,
            raw,
            devices: Vec::new(),
        };
        client.devices = client.list_devices(
            plugin.api.client_addressable_devices,
            "PJRT_Client_AddressableDevices",
            raw.as_ptr().cast(),
        )?;
        Ok(client)
    }

    fn list_devices(
        &self,
        f: Call<DevicesArgs>,
        name: &str,
        owner: *mut c_void,
    ) -> Result<Vec<DevicePtr>, XlaError> {
        let mut a: DevicesArgs = args();
        a.owner = owner;
        self.plugin.call(f, name, &mut a)?;
        if a.devices.is_null() {
            return Ok(Vec::new());
        }
        // SAFETY: the plugin returned `num_devices` device pointers at
        // `devices`, owned by the client or executable `owner`.
        let list = unsafe { std::slice::from_raw_parts(a.devices, a.num_devices) };
        Ok(list.iter().filter_map(|&d| Handle::new(d)).collect())
    }

    /// Number of devices this process can address.
    pub(crate) fn device_count(&self) -> usize {
        self.devices.len()
    }

    fn string(&self, f: Call<ClientStringArgs>, name: &str) -> String {
        let mut a: ClientStringArgs = args();
        a.client = self.raw.as_ptr();
        if self.plugin.call(f, name, &mut a).is_err() || a.value.is_null() {
            return String::new();
        }
        // SAFETY: `value_size` bytes at `value`, owned by the client.
        let bytes = unsafe { std::slice::from_raw_parts(a.value.cast::<u8>(), a.value_size) };
        String::from_utf8_lossy(bytes).into_owned()
    }

    /// The platform name (`cpu`, `cuda`, `tpu`).
    pub(crate) fn platform_name(&self) -> String {
        self.string(
            self.plugin.api.client_platform_name,
            "PJRT_Client_PlatformName",
        )
    }

    /// The platform version string.
    pub(crate) fn platform_version(&self) -> String {
        self.string(
            self.plugin.api.client_platform_version,
            "PJRT_Client_PlatformVersion",
        )
    }

    /// Compile a StableHLO module (MLIR text) for `replicas` replicas, one
    /// partition each.
    ///
    /// # Errors
    /// [`XlaError::Pjrt`] for a program the plugin rejects (bad MLIR, more
    /// replicas than devices).
    pub(crate) fn compile(&self, mlir: &str, replicas: usize) -> Result<Executable, XlaError> {
        let replicas = u8::try_from(replicas)
            .ok()
            .filter(|&r| (1..0x80).contains(&r))
            .ok_or_else(|| XlaError::Broken(format!("{replicas} replicas (at most 127)")))?;
        // CompileOptionsProto { executable_build_options (3) {
        //   num_replicas (4): replicas, num_partitions (5): 1 } }, as
        // protobuf wire bytes (a one-byte varint for replicas < 128).
        let options = [0x1a, 0x04, 0x20, replicas, 0x28, 0x01];
        let format = "mlir";
        let mut code = mlir.as_bytes().to_vec();
        let mut p: Program = args();
        p.code = code.as_mut_ptr().cast();
        p.code_size = code.len();
        p.format = format.as_ptr().cast();
        p.format_size = format.len();
        let mut a: CompileArgs = args();
        a.client = self.raw.as_ptr();
        a.program = &p;
        a.compile_options = options.as_ptr().cast();
        a.compile_options_size = options.len();
        self.plugin.call(
            self.plugin.api.client_compile,
            "PJRT_Client_Compile",
            &mut a,
        )?;
        let raw = Handle::new(a.executable)
            .ok_or_else(|| XlaError::Broken("PJRT_Client_Compile returned nothing".into()))?;
        let mut exe = Executable {
            plugin: self.plugin,
            raw,
            devices: Vec::new(),
        };
        exe.devices = self.list_devices(
            self.plugin.api.loaded_executable_addressable_devices,
            "PJRT_LoadedExecutable_AddressableDevices",
            raw.as_ptr().cast(),
        )?;
        if exe.devices.len() != usize::from(replicas) {
            return Err(XlaError::Broken(format!(
                "the executable runs on {} devices, {replicas} replicas were asked for",
                exe.devices.len()
            )));
        }
        Ok(exe)
    }

    /// Copy `data` (elements of PJRT type `kind`, `len` of them) to a new
    /// buffer on `device`.
    fn upload(
        &self,
        data: &[u8],
        kind: c_int,
        len: usize,
        device: DevicePtr,
    ) -> Result<Buffer, XlaError> {
        let dims = [i64::try_from(len).unwrap_or(i64::MAX)];
        let mut a: FromHostArgs = args();
        a.client = self.raw.as_ptr();
        a.data = data.as_ptr().cast();
        a.kind = kind;
        a.dims = dims.as_ptr();
        a.num_dims = 1;
        a.host_buffer_semantics = IMMUTABLE_ONLY_DURING_CALL;
        a.device = device.as_ptr();
        self.plugin.call(
            self.plugin.api.client_buffer_from_host_buffer,
            "PJRT_Client_BufferFromHostBuffer",
            &mut a,
        )?;
        let buffer = Handle::new(a.buffer).map(|raw| Buffer {
            plugin: self.plugin,
            raw,
        });
        self.plugin.finish_event(a.done_with_host_buffer)?;
        buffer.ok_or_else(|| XlaError::Broken("BufferFromHostBuffer returned nothing".into()))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let mut a: ClientDestroyArgs = args();
        a.client = self.raw.as_ptr();
        // A failure to destroy cannot be reported from drop.
        let _ = self.plugin.call(
            self.plugin.api.client_destroy,
            "PJRT_Client_Destroy",
            &mut a,
        );
    }
}

impl Plugin {
    /// Await and destroy an event (no-op for a null event).
    fn finish_event(&self, event: *mut RawEvent) -> Result<(), XlaError> {
        if event.is_null() {
            return Ok(());
        }
        let mut a: EventArgs = args();
        a.event = event;
        let waited = self.call(self.api.event_await, "PJRT_Event_Await", &mut a);
        let mut d: EventArgs = args();
        d.event = event;
        let destroyed = self.call(self.api.event_destroy, "PJRT_Event_Destroy", &mut d);
        waited.and(destroyed)
    }
}

/// A device buffer (destroyed on drop).
struct Buffer {
    plugin: Plugin,
    raw: Handle<RawBuffer>,
}

impl Buffer {
    /// Copy the whole buffer into `dst` (its exact size in bytes).
    fn download(&self, dst: &mut [u8]) -> Result<(), XlaError> {
        let mut a: ToHostArgs = args();
        a.src = self.raw.as_ptr();
        a.dst = dst.as_mut_ptr().cast();
        a.dst_size = dst.len();
        self.plugin.call(
            self.plugin.api.buffer_to_host_buffer,
            "PJRT_Buffer_ToHostBuffer",
            &mut a,
        )?;
        // `dst` stays borrowed until the event completed.
        self.plugin.finish_event(a.event)
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let mut a: BufferDestroyArgs = args();
        a.buffer = self.raw.as_ptr();
        let _ = self.plugin.call(
            self.plugin.api.buffer_destroy,
            "PJRT_Buffer_Destroy",
            &mut a,
        );
    }
}

/// A compiled program loaded on its devices (destroyed on drop).
pub(crate) struct Executable {
    plugin: Plugin,
    raw: Handle<RawExecutable>,
    devices: Vec<DevicePtr>,
}

impl std::fmt::Debug for Executable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executable")
            .field("replicas", &self.devices.len())
            .finish_non_exhaustive()
    }
}

impl Executable {
    /// Run the program once over all its replicas: replica `i` gets
    /// `bufs[i]` (`in_len` elements of PJRT type `kind`, `elem` bytes each),
    /// and its one output (`out_len` elements) is written back into
    /// `bufs[i]`, resized. Reusing the callers' allocations spares a fresh
    /// (page-faulting) allocation per rank and call.
    ///
    /// # Errors
    /// [`XlaError::Pjrt`] from any step; [`XlaError::Broken`] when the
    /// number of inputs is not the number of replicas.
    pub(crate) fn run(
        &self,
        client: &Client,
        bufs: &mut [Vec<u8>],
        kind: c_int,
        elem: usize,
        in_len: usize,
        out_len: usize,
    ) -> Result<(), XlaError> {
        let n = self.devices.len();
        if bufs.len() != n || bufs.iter().any(|i| i.len() != in_len * elem) {
            return Err(XlaError::Broken(format!(
                "{} inputs for {n} replicas, or an input of the wrong size",
                bufs.len()
            )));
        }
        // The plugin copies each input during the call
        // (kImmutableOnlyDuringCall), so `bufs` is free again afterwards.
        let args_bufs = bufs
            .iter()
            .zip(&self.devices)
            .map(|(data, &d)| client.upload(data, kind, in_len, d))
            .collect::<Result<Vec<Buffer>, XlaError>>()?;
        let arg_ptrs: Vec<*mut RawBuffer> = args_bufs.iter().map(|b| b.raw.as_ptr()).collect();
        // One argument per replica: argument_lists[i] points at arg_ptrs[i].
        let arg_lists: Vec<*const *mut RawBuffer> =
            (0..n).map(|i| ptr::addr_of!(arg_ptrs[i])).collect();
        let mut out_ptrs: Vec<*mut RawBuffer> = vec![ptr::null_mut(); n];
        let out_lists: Vec<*mut *mut RawBuffer> =
            (0..n).map(|i| ptr::addr_of_mut!(out_ptrs[i])).collect();
        let mut options: ExecuteOptions = args();
        let mut a: ExecuteArgs = args();
        a.executable = self.raw.as_ptr();
        a.options = &mut options;
        a.argument_lists = arg_lists.as_ptr();
        a.num_devices = n;
        a.num_args = 1;
        a.output_lists = out_lists.as_ptr();
        let ran = self.plugin.call(
            self.plugin.api.loaded_executable_execute,
            "PJRT_LoadedExecutable_Execute",
            &mut a,
        );
        drop(out_lists);
        // Take ownership of every output the plugin produced, even on error.
        let outs: Vec<Option<Buffer>> = out_ptrs
            .iter()
            .map(|&p| {
                Handle::new(p).map(|raw| Buffer {
                    plugin: self.plugin,
                    raw,
                })
            })
            .collect();
        ran?;
        drop(args_bufs);
        for (b, host) in outs.iter().zip(bufs.iter_mut()) {
            let b = b.as_ref().ok_or_else(|| {
                XlaError::Broken("PJRT_LoadedExecutable_Execute left an output empty".into())
            })?;
            host.resize(out_len * elem, 0);
            b.download(host)?;
        }
        Ok(())
    }
}

impl Drop for Executable {
    fn drop(&mut self) {
        let mut a: ExecutableDestroyArgs = args();
        a.executable = self.raw.as_ptr();
        let _ = self.plugin.call(
            self.plugin.api.loaded_executable_destroy,
            "PJRT_LoadedExecutable_Destroy",
            &mut a,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn struct_size_comes_first() {
        assert_eq!(offset_of!(ClientCreateArgs, struct_size), 0);
        assert_eq!(offset_of!(ExecuteArgs, struct_size), 0);
        assert_eq!(offset_of!(NamedValue, value), 40);
        assert_eq!(size_of::<NamedValue>(), 56);
    }

    /// The index of each used entry in the vendored header's `PJRT_Api`.
    #[test]
    fn table_layout_matches_the_header() {
        let header = include_str!("../third_party/pjrt/pjrt_c_api.h");
        let start = header.find("typedef struct PJRT_Api {").unwrap();
        let fields: Vec<&str> = header[start..]
            .lines()
            .take_while(|l| !l.starts_with('}'))
            .filter_map(|l| l.trim().strip_prefix("_PJRT_API_STRUCT_FIELD("))
            .map(|l| l.trim_end_matches(");"))
            .collect();
        let index = |name: &str| fields.iter().position(|f| *f == name).unwrap();
        let word = size_of::<usize>();
        let base = offset_of!(Api, error_destroy);
        assert_eq!(base, 2 * word + size_of::<ApiVersion>());
        for (name, offset) in [
            ("PJRT_Error_Destroy", offset_of!(Api, error_destroy)),
            ("PJRT_Plugin_Attributes", offset_of!(Api, plugin_attributes)),
            ("PJRT_Event_Await", offset_of!(Api, event_await)),
            ("PJRT_Client_Create", offset_of!(Api, client_create)),
            (
                "PJRT_Client_PlatformVersion",
                offset_of!(Api, client_platform_version),
            ),
            (
                "PJRT_Client_AddressableDevices",
                offset_of!(Api, client_addressable_devices),
            ),
            ("PJRT_Client_Compile", offset_of!(Api, client_compile)),
            (
                "PJRT_Client_BufferFromHostBuffer",
                offset_of!(Api, client_buffer_from_host_buffer),
            ),
            (
                "PJRT_LoadedExecutable_Destroy",
                offset_of!(Api, loaded_executable_destroy),
            ),
            (
                "PJRT_LoadedExecutable_AddressableDevices",
                offset_of!(Api, loaded_executable_addressable_devices),
            ),
            (
                "PJRT_LoadedExecutable_Execute",
                offset_of!(Api, loaded_executable_execute),
            ),
            ("PJRT_Buffer_Destroy", offset_of!(Api, buffer_destroy)),
            (
                "PJRT_Buffer_ToHostBuffer",
                offset_of!(Api, buffer_to_host_buffer),
            ),
        ] {
            assert_eq!(offset, base + index(name) * word, "{name}");
        }
        assert_eq!(
            size_of::<Api>(),
            offset_of!(Api, buffer_to_host_buffer) + word
        );
    }
}
