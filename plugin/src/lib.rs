//! # accel-plugin: out-of-tree backends as `dlopen` plugins
//!
//! A vendor ships an accel backend as a shared library (a Rust `cdylib`);
//! the runtime finds it on `ACCEL_PLUGIN_PATH`, loads it, and uses it like
//! any compiled-in backend. This crate is both halves of that boundary:
//!
//! * **vendor side**: [`export_plugin!`], one line that turns a safe
//!   [`accel_api::Backend`] implementation into a plugin;
//! * **host side**: [`load_plugin`], [`load_plugin_paths`] and
//!   [`load_plugins_from_env`], which return backends implementing the same
//!   [`Backend`](accel_api::Backend) and
//!   [`Communicator`](accel_api::Communicator) traits as in-tree ones;
//! * **the contract between them**: the versioned C ABI in [`abi`].
//!
//! It is its own crate so that `accel-api` and the `accel` facade stay
//! `#![forbid(unsafe_code)]` (docs/adr/0002-plugin-abi-crate.md). Here,
//! `unsafe` code is denied crate-wide and allowed only in the FFI modules:
//! [`abi`] (the `#[repr(C)]` types), `convert` (shared conversions), `export`
//! (vendor side) and `load` (host side). Every `unsafe` block carries a
//! `// SAFETY:` comment.
//!
//! ## The rules of the boundary
//!
//! 1. **Only C types cross.** Tables of `extern "C"` function pointers,
//!    `#[repr(C)]` structs, integers, and `ptr + len` pairs. No `String`,
//!    `Vec`, `Result`, `&str`, `dyn Trait` or Rust enum crosses it, so the
//!    plugin and the host may be built by different compilers (bevy dropped
//!    its dylib plugins for breaking this rule). Element types, reductions,
//!    device kinds and operations cross as the stable codes of
//!    [`DType::code`](accel_api::DType::code),
//!    [`ReduceOp::code`](accel_api::ReduceOp::code),
//!    [`DeviceKind::code`](accel_api::DeviceKind::code) and
//!    [`Op::bit`](accel_api::Op::bit).
//! 2. **Versioned entry, versioned tables.** One symbol,
//!    `accel_plugin_entry_v1`, returns the plugin table. Every table starts
//!    with `struct_size`, then `abi_major`, `abi_minor`. The host refuses
//!    another major, accepts any minor (it reads only the fields it knows)
//!    and refuses a table smaller than the 1.0 layout.
//! 3. **Append-only.** Within a major, fields are only ever added at the end
//!    of a struct, and readers check `struct_size` before touching a field
//!    newer than 1.0.
//! 4. **Errors are status codes plus a record.** Each function returns 0 or
//!    one code per [`ErrorKind`](accel_api::ErrorKind) family; the details
//!    (message, rank, op, backend, fix, lost peer, timeout, mismatch table)
//!    come from a thread-local last-error accessor, so errors cross with
//!    their kind and text intact.
//! 5. **No unwinding across.** Every exported function runs inside
//!    [`std::panic::catch_unwind`]; a panic becomes the status
//!    [`ACCEL_ERR_PANICKED`](abi::ACCEL_ERR_PANICKED) and the message
//!    `plugin panicked in <function>: <payload>`. The host reports it as an
//!    [`ErrorKind::Plugin`](accel_api::ErrorKind::Plugin) error naming the
//!    library; a panicking `probe` makes the backend *unavailable* with that
//!    reason. (This needs the plugin built with the default
//!    `panic = "unwind"`; with `panic = "abort"` a panic ends the process.)
//! 6. **Never unloaded.** A library stays mapped until the process exits,
//!    even when loading it failed after `dlopen`, because its initialisers
//!    may have registered code (thread-local destructors) that would dangle.
//! 7. **Loading never takes the process down.** A missing file, a file that
//!    is not a shared object, a missing entry symbol, a wrong major, a short
//!    or null table: each is an [`ErrorKind::Plugin`](accel_api::ErrorKind::Plugin)
//!    error with the path, the symbol and what to do, and
//!    [`load_plugin_paths`] reports it and goes on with the next file.
//!
//! ## Writing a plugin (vendor how-to)
//!
//! 1. A library crate built as a `cdylib`:
//!
//!    ```toml
//!    [package]
//!    name = "my-accel-backend"
//!    version = "0.1.0"
//!    edition = "2021"
//!
//!    [lib]
//!    crate-type = ["cdylib"]
//!
//!    [dependencies]
//!    accel-api = "0.1"
//!    accel-plugin = "0.1"
//!    ```
//!
//! 2. A safe [`Backend`](accel_api::Backend) implementation (its `connect`
//!    may rendezvous through `ctx.store`, which is the host's store), and one
//!    line:
//!
//!    ```ignore
//!    accel_plugin::export_plugin!(MyBackend::default());
//!    ```
//!
//!    The argument is any expression producing the backend; it is evaluated
//!    once, on first use.
//!
//! 3. Build and run:
//!
//!    ```text
//!    cargo build --release
//!    ACCEL_PLUGIN_PATH=target/release/libmy_accel_backend.so accel env
//!    ACCEL_PLUGIN_PATH=/opt/vendor/plugins ACCEL_BACKEND=my-backend accel launch ...
//!    ```
//!
//!    `ACCEL_PLUGIN_PATH` lists files or directories (every `.so` directly
//!    inside, sorted), separated by `:`.
//!
//! `examples/vendor-plugin` in the accel repository is a complete plugin.
//! A vendor crate may `#![deny(unsafe_code)]`: the macro allows the one
//! `#[no_mangle]` it needs locally (it cannot under `forbid`).
//!
//! ## Loading plugins (host how-to)
//!
//! ```no_run
//! for report in accel_plugin::load_plugins_from_env() {
//!     eprintln!("{report}");
//!     if let Some(backend) = report.backend() {
//!         // register `backend` next to the compiled-in backends
//!         # let _ = backend;
//!     }
//! }
//! ```
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod abi;
mod convert;
#[doc(hidden)]
pub mod export;
mod load;
mod path;
#[cfg(test)]
mod store_tests;

pub use load::{load_plugin, PluginBackend};
pub use path::{
    load_plugin_paths, load_plugins_from_env, PluginOutcome, PluginReport, PLUGIN_PATH_ENV,
};

#[doc(hidden)]
pub mod __private {
    pub use accel_api::Backend;
}

/// Export a backend as an accel plugin: generates the
/// `accel_plugin_entry_v1` symbol and the static plugin table.
///
/// Use it once, at the top level of a `cdylib` crate, with an expression
/// that builds the backend (any type implementing
/// [`accel_api::Backend`]):
///
/// ```ignore
/// accel_plugin::export_plugin!(accel_backend_single::BACKEND);
/// ```
///
/// The expression is evaluated once, the first time the host calls into the
/// plugin, inside the panic guard (a panicking constructor is reported like
/// any other panic). The plugin's version in load reports is the exporting
/// crate's `CARGO_PKG_VERSION`.
#[macro_export]
macro_rules! export_plugin {
    ($make:expr $(,)?) => {
        const _: () = {
            struct __AccelPlugin;

            impl $crate::export::Exported for __AccelPlugin {
                const PLUGIN_VERSION: &'static str = ::core::env!("CARGO_PKG_VERSION");

                fn backend() -> &'static dyn $crate::__private::Backend {
                    // A name no user item has: `$make` may name a `BACKEND`.
                    static __ACCEL_BACKEND: ::std::sync::OnceLock<
                        ::std::boxed::Box<dyn $crate::__private::Backend>,
                    > = ::std::sync::OnceLock::new();
                    &**__ACCEL_BACKEND.get_or_init(|| ::std::boxed::Box::new($make))
                }
            }

            static __ACCEL_PLUGIN_TABLE: $crate::abi::AccelPluginV1 =
                $crate::export::table::<__AccelPlugin>();

            /// The accel plugin entry point (ABI major 1).
            #[allow(unsafe_code)]
            #[no_mangle]
            pub extern "C" fn accel_plugin_entry_v1() -> *const $crate::abi::AccelPluginV1 {
                // Returns the address of a static: cannot panic.
                &__ACCEL_PLUGIN_TABLE
            }
        };
    };
}
