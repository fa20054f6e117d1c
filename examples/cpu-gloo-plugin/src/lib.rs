//! cpu-gloo as an out-of-tree plugin: the same engine, loaded through
//! `ACCEL_PLUGIN_PATH` and the versioned C ABI. It registers as
//! `cpu-gloo-plugin` (one below cpu-gloo's priority) so that a binary with
//! cpu-gloo compiled in can load it too; its communicators still report
//! `cpu-gloo` in errors, since that is the engine that ran.
#![deny(unsafe_code)]

use accel_api::kit::{StaticBackend, PRIORITY_CPU};
use accel_api::{Backend, DeviceKind};

/// The registered name.
pub const NAME: &str = "cpu-gloo-plugin";

/// cpu-gloo under another name, one below its priority.
pub const BACKEND: StaticBackend = StaticBackend::new(
    NAME,
    PRIORITY_CPU - 1,
    DeviceKind::Cpu,
    |ctx| accel_backend_cpu_gloo::BACKEND.probe(ctx),
    |ctx| accel_backend_cpu_gloo::BACKEND.connect(ctx),
);

accel_plugin::export_plugin!(BACKEND);
