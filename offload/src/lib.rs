//! Big-model inference for accel.
#![deny(unsafe_code)]
#![warn(missing_docs)]
mod arena;
pub mod layout;
mod mmap;
pub mod plan;
pub mod safetensors;
pub mod store;
pub mod util;
