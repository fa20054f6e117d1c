//! Big-model inference for accel.
#![deny(unsafe_code)]
#![warn(missing_docs)]

pub mod layout;
mod mmap;
pub mod plan;
pub mod safetensors;
pub mod util;
