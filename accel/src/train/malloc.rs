//! `ACCEL_MALLOC`: glibc keeps the memory a training loop frees (ADR 0038).

use accel_api::{Error, Result};

/// The environment variable: `cache` (the default) or `system`.
pub(crate) const VARIABLE: &str = "ACCEL_MALLOC";

/// Unless `ACCEL_MALLOC=system`, have glibc keep freed memory
/// ([`accel_signals::keep_freed_memory`], once per process).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
/// naming the variable for a value other than `cache` or `system`.
pub(crate) fn apply_from_env() -> Result<()> {
    let value = std::env::var(VARIABLE).unwrap_or_default();
    match value.trim() {
        "" | "cache" => {
            accel_signals::keep_freed_memory();
            Ok(())
        }
        "system" => Ok(()),
        _ => Err(Error::invalid_config(
            VARIABLE,
            &value,
            "expected cache (keep freed memory, the default) or system (glibc's own settings)",
        )
        .with_fix("set ACCEL_MALLOC=cache or ACCEL_MALLOC=system, or unset it")),
    }
}
