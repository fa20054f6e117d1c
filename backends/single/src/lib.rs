//! The built-in `single` backend: a group of exactly one process.
//!
//! Every collective is exact by construction (identity or copy), so this is
//! the embedded default for one-process runs and the first column of the
//! conformance matrix. It is available only when the run has one process.
#![forbid(unsafe_code)]

mod engine;

use accel_api::{
    Backend, Communicator, ConnectContext, DeviceKind, Error, ErrorKind, Probe, ProbeContext,
    Result, PRIORITY_FALLBACK,
};

pub use engine::{communicator, communicator_named, SingleCommunicator, SingleEngine};

/// The registered name.
pub const NAME: &str = "single";

/// The `single` backend.
#[derive(Debug, Default, Clone, Copy)]
pub struct SingleBackend;

impl Backend for SingleBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn priority(&self) -> i32 {
        PRIORITY_FALLBACK
    }

    fn device_kind(&self) -> DeviceKind {
        DeviceKind::Cpu
    }

    fn probe(&self, ctx: &ProbeContext) -> Probe {
        if ctx.world_size == 1 {
            Probe::available(1, Some(env!("CARGO_PKG_VERSION").to_string()))
        } else {
            Probe::unavailable(format!(
                "the single backend runs one process only, this run has {}",
                ctx.world_size
            ))
        }
    }

    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>> {
        connect_named(NAME, ctx).map(|c| Box::new(c) as Box<dyn Communicator>)
    }
}

/// Connect a one-rank group reporting `name` as its backend (what
/// [`Backend::connect`] does with [`NAME`]); plugins that reuse this engine
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
    Ok(communicator_named(name, ctx.device, ctx.timeout))
}

accel_api::submit_backend!(|| Box::new(SingleBackend));
