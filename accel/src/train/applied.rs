//! Where the mixed-precision and sharding settings came from and which of
//! them did not apply (`ACCEL_STRICT` makes those errors): the record that
//! `TrainShared` keeps and `control` reports from.

use accel_api::{Error, Result};

/// The variable that makes settings a program cannot use errors instead
/// of warnings (as [`TrainConfig::strict`](super::TrainConfig::strict)): `1`, `true` or `yes`.
pub const STRICT_ENV: &str = "ACCEL_STRICT";

/// [`STRICT_ENV`] read from the process environment; `false` when unset
/// or empty.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
/// naming the variable for another value.
pub(crate) fn strict_from_env() -> Result<bool> {
    let v = std::env::var(STRICT_ENV).unwrap_or_default();
    match v.trim().to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "no" => Ok(false),
        "1" | "true" | "yes" => Ok(true),
        _ => Err(Error::invalid_config(STRICT_ENV, &v, "expected 1 or 0")
            .with_fix("set ACCEL_STRICT=1 to make ignored settings errors, or unset it")),
    }
}

/// [`Source::Env`] when `var` is set to a non-empty value.
pub(crate) fn env_source(var: &str) -> Source {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Source::Env,
        _ => Source::Default,
    }
}

/// Where a mixed-precision or sharding setting came from, for the
/// message that says it does not apply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Source {
    /// Nobody set it.
    #[default]
    Default,
    /// The program's [`TrainConfig`](super::TrainConfig).
    Config,
    /// The environment `accel launch` sets.
    Env,
}

/// What the accelerator knows about which settings applied.
#[derive(Debug, Default)]
pub(crate) struct Applied {
    pub(crate) mixed_precision: Source,
    pub(crate) sharding: Source,
    /// [`TrainConfig::strict`](super::TrainConfig::strict) or [`STRICT_ENV`].
    pub(crate) strict: bool,
    /// One line per setting found not to apply, in order.
    pub(crate) notices: Vec<(&'static str, String)>,
    /// The configuration the trackers were given (main process), updated
    /// with what did not apply.
    pub(crate) tracker_config: Option<serde_json::Value>,
}

/// A setting the program cannot use: its key in [`TrainConfig`](super::TrainConfig), the
/// value that did not apply, the value that applies instead, and why.
pub(crate) struct NotApplied<'a> {
    pub(crate) key: &'static str,
    pub(crate) value: String,
    pub(crate) instead: &'static str,
    pub(crate) reason: &'a str,
    pub(crate) fix: &'a str,
}
