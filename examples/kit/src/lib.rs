//! What the example programs share, so that each one holds only what is
//! its own (its engine's tensors, model and optimizers):
//!
//! * [`digits`]: the 8x8 digits data set, its split and its batches, for
//!   `examples/candle-digits` and `examples/tch-digits`;
//! * [`run`]: the optimizer-step counter that checkpoints carry, the
//!   parameter checksum, resume-or-start-fresh, the digits demos' common
//!   settings and their final report;
//! * [`train`]: the digits demos' training loop, over any engine;
//! * [`cli`]: reading the flags of the demos' hand-written command lines;
//! * [`plain`]: the same training without accel, for the integrations'
//!   benchmark.
//!
//! It depends on `accel` and nothing of tch or candle, so the main
//! workspace (candle-digits, train) and the libtorch one (tch-digits,
//! `integrations/Cargo.toml`) both build it as a path dependency.

#![forbid(unsafe_code)]

pub mod cli;
pub mod digits;
pub mod plain;
pub mod run;
pub mod train;
