//! The TCP store: [`TcpStoreServer`] hosted by the launcher (or rank 0),
//! [`TcpStore`] in every rank.

mod client;
mod conn;
mod handshake;
mod server;
mod wire;

#[cfg(test)]
mod tests;

pub use client::TcpStore;
pub use conn::ServerLimits;
pub use server::TcpStoreServer;
