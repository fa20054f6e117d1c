//! Rendezvous stores implementing [`accel_api::Store`].
//!
//! | store | use |
//! |---|---|
//! | [`MemoryStore`] | one process (threads as ranks, tests) |
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod memory;

pub use memory::MemoryStore;
