//! The built-in `single` backend: a group of exactly one process.
//!
//! Every collective is exact by construction (identity or copy), so this is
//! the embedded default for one-process runs and the first column of the
//! conformance matrix. It is available only when the run has one process.
#![forbid(unsafe_code)]

mod engine;
mod name;

use accel_api::kit::{StaticBackend, PRIORITY_FALLBACK};
use accel_api::{ConnectContext, DeviceKind, Error, ErrorKind, Probe, ProbeContext, Result};

// What a program or a plugin may call: the record, the name, the probe,
// a one-rank group (`communicator`, `connect_named`) and its type. The
// engine stays private.
pub use engine::{communicator, SingleCommunicator};
pub use name::NAME;

/// The `single` backend.
pub const BACKEND: StaticBackend =
    StaticBackend::new(NAME, PRIORITY_FALLBACK, DeviceKind::Cpu, probe, |ctx| {
        Ok(Box::new(connect_named(NAME, ctx)?))
    });

/// Available exactly when the run has one process (what [`BACKEND`]
/// probes; plugins that reuse this engine probe with it).
pub fn probe(ctx: &ProbeContext) -> Probe {
    if ctx.world_size == 1 {
        Probe::available(1, Some(env!("CARGO_PKG_VERSION").to_string()))
    } else {
        Probe::unavailable(format!(
            "the single backend runs one process only, this run has {}",
            ctx.world_size
        ))
    }
}

/// Connect a one-rank group reporting `name` as its backend (what
/// [`BACKEND`] does with [`NAME`]); plugins that reuse this engine
/// call it with their own name.
///
/// # Errors
/// [`ErrorKind::Unavailable`] unless the context is rank 0 of 1.
pub fn connect_named(name: &'static str, ctx: ConnectContext) -> Result<SingleCommunicator> {
    if ctx.world_size != 1 || ctx.rank != 0 {
        return Err(Error::new(
            ErrorKind::Unavailable,
            format!(
                "the single backend runs one process only (rank {} of {})",
                ctx.rank, ctx.world_size
            ),
        )
        .with_backend(name)
        .with_op("connect")
        .with_fix("enable a multi-process backend such as cpu-gloo, or run one process"));
    }
    Ok(engine::communicator_named(name, ctx.device, ctx.timeout))
}

accel_api::kit::submit_backend!(|| Box::new(BACKEND));
