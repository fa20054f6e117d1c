//! The shim's own reduction kernels (gloo_shim.cc, `elementwise`), which
//! replaced Gloo's `int`-counted ones so that they vectorize: integer sums
//! and products wrap (two's complement) in every width, min and max and
//! float sums are exact, at lengths around the vector widths and Gloo's
//! ring chunking (odd tails included).

mod common;

use std::time::Duration;

use accel_api::{CommunicatorExt, ReduceOp};

const SHORT: Duration = Duration::from_secs(5);
const DEADLINE: Duration = Duration::from_secs(60);
const LENS: [usize; 6] = [1, 3, 17, 1000, 4099, 70_001];

/// Rank `r`'s value at index `i`: near the top of the range, so sums and
/// products overflow.
fn v(r: usize, i: usize) -> i64 {
    (r as i64 + 1) * 7919 + (i as i64 % 251) - 125
}

#[test]
fn integer_sums_and_products_wrap_and_min_max_are_exact() {
    for world in [2usize, 3] {
        let out = common::run_ranks(world, SHORT, DEADLINE, move |rank, c| {
            let mut bad = Vec::new();
            for len in LENS {
                let idx = 0..len;
                let i8s: Vec<i8> = idx
                    .clone()
                    .map(|i| (i8::MAX as i64 - v(rank, i) % 50) as i8)
                    .collect();
                let got = c.all_reduce_vec(&i8s, ReduceOp::Sum).unwrap();
                let want: Vec<i8> = idx
                    .clone()
                    .map(|i| {
                        (0..world).fold(0i8, |a, r| {
                            a.wrapping_add((i8::MAX as i64 - v(r, i) % 50) as i8)
                        })
                    })
                    .collect();
                if got != want {
                    bad.push(format!("i8 sum, {len}"));
                }

                let u8s: Vec<u8> = idx.clone().map(|i| (v(rank, i) % 256) as u8).collect();
                let got = c.all_reduce_vec(&u8s, ReduceOp::Prod).unwrap();
                let want: Vec<u8> = idx
                    .clone()
                    .map(|i| (0..world).fold(1u8, |a, r| a.wrapping_mul((v(r, i) % 256) as u8)))
                    .collect();
                if got != want {
                    bad.push(format!("u8 product, {len}"));
                }

                let i32s: Vec<i32> = idx.clone().map(|i| i32::MAX - v(rank, i) as i32).collect();
                let got = c.all_reduce_vec(&i32s, ReduceOp::Sum).unwrap();
                let want: Vec<i32> = idx
                    .clone()
                    .map(|i| {
                        (0..world).fold(0i32, |a, r| a.wrapping_add(i32::MAX - v(r, i) as i32))
                    })
                    .collect();
                if got != want {
                    bad.push(format!("i32 sum, {len}"));
                }
                let got = c.all_reduce_vec(&i32s, ReduceOp::Min).unwrap();
                let want: Vec<i32> = idx
                    .clone()
                    .map(|i| (0..world).map(|r| i32::MAX - v(r, i) as i32).min().unwrap())
                    .collect();
                if got != want {
                    bad.push(format!("i32 min, {len}"));
                }

                let i64s: Vec<i64> = idx.clone().map(|i| i64::MAX / 3 + v(rank, i)).collect();
                let got = c.all_reduce_vec(&i64s, ReduceOp::Prod).unwrap();
                let want: Vec<i64> = idx
                    .clone()
                    .map(|i| (0..world).fold(1i64, |a, r| a.wrapping_mul(i64::MAX / 3 + v(r, i))))
                    .collect();
                if got != want {
                    bad.push(format!("i64 product, {len}"));
                }

                // Small integers: every partial sum is exact in f32.
                let f32s: Vec<f32> = idx.clone().map(|i| v(rank, i) as f32).collect();
                let got = c.all_reduce_vec(&f32s, ReduceOp::Sum).unwrap();
                let want: Vec<f32> = idx
                    .clone()
                    .map(|i| (0..world).map(|r| v(r, i)).sum::<i64>() as f32)
                    .collect();
                if got != want {
                    bad.push(format!("f32 sum, {len}"));
                }

                let f64s: Vec<f64> = idx.clone().map(|i| v(rank, i) as f64 * 0.5).collect();
                let got = c.all_reduce_vec(&f64s, ReduceOp::Max).unwrap();
                let want: Vec<f64> = idx
                    .clone()
                    .map(|i| (0..world).map(|r| v(r, i)).max().unwrap() as f64 * 0.5)
                    .collect();
                if got != want {
                    bad.push(format!("f64 max, {len}"));
                }
            }
            bad
        });
        for (rank, bad) in out.into_iter().enumerate() {
            assert!(bad.is_empty(), "world {world}, rank {rank}: wrong {bad:?}");
        }
    }
}
