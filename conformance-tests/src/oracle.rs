//! The oracle: a plain single-process implementation of each collective's
//! expected result, computed from every rank's input.

use accel_api::{Element, ReduceOp};

/// Element-wise reduction of `inputs` (one vector per rank) with `op`.
/// Averages of integers truncate toward zero (the documented semantics).
pub fn reduce<T: Element>(inputs: &[Vec<T>], op: ReduceOp, is_float: bool) -> Vec<T> {
    let n = inputs.len();
    let len = inputs[0].len();
    (0..len)
        .map(|i| {
            let vals = inputs.iter().map(|v| v[i].to_f64());
            let r = match op {
                ReduceOp::Sum => vals.sum::<f64>(),
                ReduceOp::Prod => vals.product::<f64>(),
                ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
                ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
                ReduceOp::Avg => {
                    let s = vals.sum::<f64>();
                    if is_float {
                        s / n as f64
                    } else {
                        (s / n as f64).trunc()
                    }
                }
                _ => unreachable!("unknown reduce op"),
            };
            T::from_f64(r)
        })
        .collect()
}

/// Rank-major concatenation.
pub fn concat<T: Element>(inputs: &[Vec<T>]) -> Vec<T> {
    inputs.iter().flatten().copied().collect()
}

/// Chunk `i` of `v` split into `n` equal chunks.
pub fn chunk<T: Element>(v: &[T], n: usize, i: usize) -> Vec<T> {
    let c = v.len() / n;
    v[i * c..(i + 1) * c].to_vec()
}

/// What rank `me` receives in an all-to-all: chunk `me` of every rank, in
/// rank order.
pub fn all_to_all<T: Element>(inputs: &[Vec<T>], me: usize) -> Vec<T> {
    let n = inputs.len();
    inputs.iter().flat_map(|v| chunk(v, n, me)).collect()
}
