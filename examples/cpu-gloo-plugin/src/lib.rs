//! cpu-gloo as an out-of-tree plugin: the same engine, loaded through
//! `ACCEL_PLUGIN_PATH` and the versioned C ABI. It registers as
//! `cpu-gloo-plugin` (one below cpu-gloo's priority) so that a binary with
//! cpu-gloo compiled in can load it too; its communicators still report
//! `cpu-gloo` in errors, since that is the engine that ran.
#![deny(unsafe_code)]

use accel_api::{Backend, Communicator, ConnectContext, DeviceKind, Probe, ProbeContext, Result};
use accel_backend_cpu_gloo::CpuGlooBackend;

/// The registered name.
pub const NAME: &str = "cpu-gloo-plugin";

/// cpu-gloo under another name.
#[derive(Debug, Default, Clone, Copy)]
pub struct CpuGlooPlugin;

accel_plugin::export_plugin!(CpuGlooPlugin);

impl Backend for CpuGlooPlugin {
    fn name(&self) -> &str {
        NAME
    }

    fn priority(&self) -> i32 {
        CpuGlooBackend::new().priority() - 1
    }

    fn device_kind(&self) -> DeviceKind {
        CpuGlooBackend::new().device_kind()
    }

    fn probe(&self, ctx: &ProbeContext) -> Probe {
        CpuGlooBackend::new().probe(ctx)
    }

    fn connect(&self, ctx: ConnectContext) -> Result<Box<dyn Communicator>> {
        CpuGlooBackend::new().connect(ctx)
    }
}
