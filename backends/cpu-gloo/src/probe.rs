//! The probe: the backend is available wherever its private Gloo shim
//! (ADR 0018) opens; the probe reports the engine version, or the loader's
//! error.

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

/// Available for any run shape (one CPU "device", any number of ranks)
/// when the private Gloo shim opens; unavailable with the loader's reason
/// (a missing or moved `libaccel_gloo_private.so`, `ACCEL_GLOO_SHIM_LIB`)
/// when it does not.
pub fn probe(_ctx: &ProbeContext) -> Probe {
    let v = ffi::version();
    // The shim's loader answers the version call with its error text.
    if v.starts_with("cpu-gloo ") {
        return Probe::unavailable(v);
    }
    Probe::available(1, Some(engine_version()))
}
