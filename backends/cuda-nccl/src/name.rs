//! The registered name, in a leaf module: the engine, its errors and the
//! crate root all name it.

/// The registered name.
pub const NAME: &str = "cuda-nccl";
