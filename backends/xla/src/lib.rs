//! # accel-backend-xla: accel on XLA through the PJRT C API
//!
//! The `xla` backend drives an XLA [PJRT] plugin: a shared object with one
//! entry point, `GetPjrtApi`, that compiles and runs XLA programs on its
//! devices. CPU plugins ship on PyPI; `make pjrt-setup`
//! (`scripts/fetch_pjrt_plugin.sh`) puts one (`lammps-jax-pjrt-cpu`
//! 0.11.2, PJRT API 0.115) into `.accel-cache/pjrt/`. Nothing is linked at
//! build time: without a plugin the crate builds, and the backend probes
//! unavailable with the reason.
//!
//! ## Ranks as threads
//!
//! XLA runs a collective as one program over all the devices of a process
//! (the CPU plugin has no multi-process collectives; TPU hosts drive their
//! chips from one process). So this backend's ranks are threads of one
//! process, one rank per thread and per device (docs/adr/0012). Each rank
//! thread connects ([`BACKEND`]) with its rank; the threads of one run find each
//! other through the store (rank 0 publishes a token naming this process)
//! and an in-process meeting point. Every collective is a *round*: each
//! rank deposits its input, the last to arrive runs the compiled program
//! over all inputs (replica `i` is rank `i`), and each takes its output.
//! Every wait is bounded by the timeout: a rank thread that never arrives
//! makes the others fail with [`ErrorKind::Timeout`] naming it and the
//! operation; ranks in different processes fail `connect` with
//! [`ErrorKind::InvalidConfig`] naming both processes.
//!
//! Programs get their rank threads from accel's facade: `accel launch
//! --backend xla -n N -- prog` starts one process whose `accel::run`
//! starts N rank threads, and `accel::Threads::new(N)` runs a closure on N
//! rank threads of the caller (docs/adr/0015).
//!
//! ## What is supported
//!
//! | operation | how |
//! |---|---|
//! | all_reduce, reduce | `stablehlo.all_reduce` with add / multiply / minimum / maximum; avg = sum, then the group divides (integers truncate) |
//! | reduce_scatter | `stablehlo.reduce_scatter` |
//! | all_gather, gather | `stablehlo.all_gather` |
//! | all_to_all | `stablehlo.all_to_all` |
//! | broadcast | `stablehlo.all_gather`, then the root's block (exact bytes) |
//! | scatter | `stablehlo.all_to_all` (non-roots send zeros), then the block from the root |
//! | send, recv | an in-process mailbox between the rank threads (ordered per source, destination and tag) |
//! | barrier | a meeting without a program |
//! | split | `(color, key)` collected at a meeting; one new meeting per color |
//!
//! Every element type (f16, bf16, f32, f64, i8, u8, i32, i64) for every
//! operation, on host memory: inputs are copied to PJRT buffers and
//! outputs back. XLA device buffers are not taken (yet). Programs are
//! compiled once per (program, element type, length, group size) and
//! cached for the life of the process. Integer sums and products wrap
//! (XLA's semantics).
//!
//! ## The boundary
//!
//! All `unsafe` is in the private `ffi` module: `#[repr(C)]` structs
//! written from the vendored `third_party/pjrt/pjrt_c_api.h` (PJRT API 0.81,
//! Apache-2.0; forward compatible with newer plugins through `struct_size`)
//! and handles whose `Drop` destroys the PJRT object. The library is never
//! unloaded. PJRT failures come back as `PJRT_Error` values, read and
//! turned into the private error type, then into [`accel_api::Error`].
//!
//! ## Environment
//!
//! | variable | meaning |
//! |---|---|
//! | `ACCEL_PJRT_PLUGIN` | the plugin file (otherwise the search order of the `runtime` module: `ACCEL_PJRT_CACHE`, then `.accel-cache/pjrt/` above the current directory or the executable) |
//! | `ACCEL_PJRT_CPU_DEVICES` | devices of the CPU client (default 8): the most ranks of one run |
//! | [`ACCEL_PROCESS_MODEL`](accel_api::worker::keys::ACCEL_PROCESS_MODEL)`=threads` | set by the launcher when a run's ranks are threads (docs/adr/0015); without it (or a probe context with more than one rank in this process, as `accel::Threads` passes) the probe is unavailable for runs of more than one rank |
//! | `TF_CPP_MIN_LOG_LEVEL=1` | silences the CPU plugin's start-up line on stderr (`cpu_device_count set via create_options`) |
//!
//! ## Measuring
//!
//! `accel bench --backend xla -n N` (one process of N rank threads under
//! `accel launch`, ADR 0015) times any collective like every other
//! backend; `examples/bench_all_reduce.rs` times all_reduce on N rank
//! threads without the launcher. docs/benchmarks.md has the numbers.
//!
//! [PJRT]: https://openxla.org/xla/pjrt
//! [`ErrorKind::Timeout`]: accel_api::ErrorKind::Timeout
//! [`ErrorKind::InvalidConfig`]: accel_api::ErrorKind::InvalidConfig
#![deny(unsafe_code)]
#![warn(missing_docs)]

mod engine;
mod error;
// All FFI calls into the PJRT plugin live here, one `// SAFETY:` note per block.
#[allow(unsafe_code)]
mod ffi;
mod meet;
mod name;
mod probe;
mod programs;
mod runtime;

use accel_api::kit::{Group, StaticBackend, PRIORITY_XLA};
use accel_api::{ConnectContext, DeviceKind, Error, ErrorKind, Result};

// The crate's face (ADR 0034): the record, the name and the plugin's
// description for diagnostics. Its own tests and examples reach the rest
// through `__test`.
pub use name::NAME;

use engine::{XlaCommunicator, XlaEngine};
use error::XlaError;
use runtime::Runtime;

/// The `xla` backend. Its device kind is the host's: the communicator
/// takes CPU buffers and copies them to the plugin's devices.
pub const BACKEND: StaticBackend =
    StaticBackend::new(NAME, PRIORITY_XLA, DeviceKind::Cpu, probe::probe, |ctx| {
        Ok(Box::new(connect(ctx)?))
    });

/// The plugin, API version and devices the probe sees, or why there is
/// none (for diagnostics and benchmarks).
///
/// # Errors
/// [`ErrorKind::Unavailable`] naming what failed: no plugin file, not a
/// PJRT plugin, initialisation or client creation refused.
pub fn describe_plugin() -> Result<String> {
    Runtime::get()
        .map(|rt| rt.describe())
        .map_err(|e| Error::from(e).with_backend(NAME))
}

/// Connect this rank thread's communicator (what [`BACKEND`] does,
/// with the concrete type). Every rank of the run calls it from its own
/// thread of this process, with the same store and world size.
///
/// # Errors
/// [`ErrorKind::Unavailable`] without a usable plugin;
/// [`ErrorKind::InvalidConfig`] for a rank outside the world, more ranks
/// than devices, or ranks in another process; [`ErrorKind::Timeout`]
/// naming the ranks that did not connect in time.
fn connect(ctx: ConnectContext) -> Result<XlaCommunicator> {
    let rank = ctx.rank;
    let fail = |e: XlaError| {
        Error::from(e)
            .with_op("connect")
            .with_backend(NAME)
            .with_rank(rank)
    };
    if ctx.world_size == 0 || rank >= ctx.world_size {
        return Err(fail(XlaError::Config {
            what: format!("rank {rank} is not in a world of {} ranks", ctx.world_size),
            fix: "set RANK below WORLD_SIZE".into(),
        }));
    }
    let rt = Runtime::get().map_err(fail)?;
    if ctx.world_size > rt.device_count() {
        return Err(fail(XlaError::Config {
            what: format!(
                "{} ranks, but the PJRT client has {} devices",
                ctx.world_size,
                rt.device_count()
            ),
            fix: format!(
                "set ACCEL_PJRT_CPU_DEVICES={} (at most 127) or run fewer ranks",
                ctx.world_size
            ),
        }));
    }
    let store_err = |e: Error| e.with_op("connect").with_backend(NAME).with_rank(rank);
    // A fresh meeting per connect: a process may connect more than once.
    let generation = ctx
        .store
        .add(&format!("xla/connects/{rank}"), 1)
        .map_err(store_err)?;
    let key = format!("xla/{generation}/meet");
    let (token, meeting) = if rank == 0 {
        let token = meet::new_token();
        let m = meet::open(&token, ctx.world_size);
        ctx.store.set(&key, token.as_bytes()).map_err(store_err)?;
        (token, m)
    } else {
        let token = match ctx.store.get(&key, ctx.timeout) {
            Ok(t) => String::from_utf8_lossy(&t).into_owned(),
            Err(e) if matches!(e.kind(), ErrorKind::Timeout { .. }) => {
                return Err(fail(XlaError::Timeout {
                    after: ctx.timeout,
                    what: format!("connect: rank 0 did not connect within {:?}", ctx.timeout),
                }))
            }
            Err(e) => return Err(store_err(e)),
        };
        let here = std::process::id();
        match meet::token_pid(&token) {
            Some(pid) if pid == here => {}
            other => {
                return Err(fail(XlaError::Config {
                    what: format!(
                        "xla runs ranks as threads of one process: rank 0 runs in process {}, rank {rank} in process {here}",
                        other.map_or_else(|| "?".to_string(), |p| p.to_string())
                    ),
                    fix: "start the run with `accel launch --backend xla` (one process, one thread per rank), or pick a multi-process backend such as cpu-gloo".into(),
                }))
            }
        }
        let m = meet::find(&token).ok_or_else(|| {
            fail(XlaError::Broken(format!(
                "rank 0's meeting {token} is gone (it failed to connect)"
            )))
        })?;
        (token, m)
    };
    let engine = XlaEngine::new(rt, meeting, rank, ctx.device, ctx.timeout, 0);
    let joined = engine.gather_up("connect");
    meet::close(&token);
    joined.map_err(fail)?;
    Ok(Group::new(engine))
}

accel_api::kit::submit_backend!(|| Box::new(BACKEND));

/// Not API: what this crate's own tests and examples reach beyond its face.
#[doc(hidden)]
pub mod __test {
    pub use crate::engine::{capabilities, XlaCommunicator, XlaEngine};
    pub use crate::probe::PROCESS_MODEL_VAR;
    pub use crate::runtime::{DEFAULT_CPU_DEVICES, PLUGIN_FILE};

    /// This rank thread's communicator with its concrete type.
    pub fn connect(ctx: accel_api::ConnectContext) -> accel_api::Result<XlaCommunicator> {
        crate::connect(ctx)
    }
}
