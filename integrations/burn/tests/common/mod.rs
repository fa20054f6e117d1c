//! Shared by the integration tests.

use accel_test_support::ranks;

pub use ranks::two_ranks;
