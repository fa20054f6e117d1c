//! Shared by the integration tests.

#[path = "../../../../test-support/ranks.rs"]
mod ranks;

pub use ranks::two_ranks;
