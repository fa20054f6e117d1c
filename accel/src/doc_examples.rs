//! The README's and docs/'s examples, compiled as doctests (`cargo test -p
//! accel --doc`). docs/training.md's complete example is
//! `examples/training_guide.rs` (built by `cargo test`, and compared with the
//! page by `tests/parity.rs`); docs/candle.md's and docs/inference.md's are
//! accel-candle's and accel-tch's doctests.

/// README.md.
#[doc = include_str!("../../README.md")]
pub struct Readme;

/// docs/zero.md.
#[doc = include_str!("../../docs/zero.md")]
pub struct Zero;

/// docs/torch.md.
#[doc = include_str!("../../docs/torch.md")]
pub struct Torch;
