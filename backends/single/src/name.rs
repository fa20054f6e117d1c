//! The registered name, in a leaf module: the engine, its errors and the
//! crate root all name it.

/// The registered name (what `ACCEL_BACKEND` takes).
pub const NAME: &str = "single";
