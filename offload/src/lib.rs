//! Big-model inference for accel.
#![deny(unsafe_code)]
#![warn(missing_docs)]
mod arena;
pub mod cli;
mod convert;
pub mod exec;
pub mod layout;
pub mod load;
mod mmap;
pub mod plan;
pub mod safetensors;
pub mod store;
pub mod synth;
pub mod util;
