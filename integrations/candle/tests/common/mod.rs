//! Shared by the integration tests.

use accel_test_support::ranks;

#[allow(unused_imports)]
pub use ranks::two_ranks;

/// Deterministic values in [-0.5, 0.5) from `seed` (xorshift).
#[allow(dead_code)]
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 1000) as f32 / 1000.0 - 0.5
        })
        .collect()
}
