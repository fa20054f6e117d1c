//! The probe: Gloo is linked into the binary, so the backend is available
//! wherever the binary starts; the probe reports the engine version.

use accel_api::{Probe, ProbeContext};

use crate::ffi;

/// The Debian package version of `libgloo-dev` the crate was built against
/// (empty when dpkg did not know it at build time).
pub const PACKAGE_VERSION: &str = env!("ACCEL_GLOO_PACKAGE_VERSION");

/// Gloo's version as the probe reports it: `gloo 0.5.0 (libgloo-dev
/// 0.0~git20220518.5b14351-3)`.
pub fn engine_version() -> String {
    let v = ffi::version();
    if PACKAGE_VERSION.is_empty() {
        format!("gloo {v}")
    } else {
        format!("gloo {v} (libgloo-dev {PACKAGE_VERSION})")
    }
}

/// Available for any run shape: one CPU "device", any number of ranks.
/// Is Gloo usable here? (It is whenever the crate built: the library is linked.)
pub fn probe(_ctx: &ProbeContext) -> Probe {
    Probe::available(1, Some(engine_version()))
}
