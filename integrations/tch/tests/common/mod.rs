//! Fixtures shared by accel-tch's tests.
#![allow(dead_code)]

/// A fixed, rank-independent value in `[-1, 1)` for `(a, b)` (no draw from
/// libtorch's global generator, which parallel tests and rank threads share).
pub fn det(a: usize, b: usize) -> f32 {
    let h = (a as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add((b as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
    let h = (h ^ (h >> 29)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((h >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}
