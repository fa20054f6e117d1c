//! torch's TCPStore protocol, both sides, behind accel's [`Store`](accel_api::Store):
//! [`TorchStore`] joins a store that torchrun's agent, a torch rank 0 or
//! `torch.distributed.TCPStore(is_master=True)` hosts; [`TorchStoreServer`]
//! hosts one that torch programs join unchanged (`init_process_group` with
//! `env://`). The wire format is in [`wire`]'s documentation; how torch
//! clients are admitted without accel's token is ADR 0019.

mod client;
mod server;
pub(crate) mod wire;

#[cfg(test)]
mod tests;

pub use client::TorchStore;
pub use server::{TorchServerLimits, TorchStoreServer};
