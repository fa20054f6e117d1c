//! Deterministic inputs: every rank can compute every other rank's input
//! for a case, so the oracle needs no communication.

use accel_api::{DType, Element, ReduceOp};

/// Run `$body` with `$T` bound to the Rust type of `$dtype`
/// ([`accel_api::with_dtype!`], panicking for a type without one).
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        accel_api::with_dtype!($dtype, $T => $body, else panic!(
            "dtype {} has no Rust type in the conformance suite",
            $dtype
        ))
    };
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The closed range of small integers inputs are drawn from, chosen so that
/// every result is exactly representable in `dtype` for up to 8 ranks
/// (no overflow, no rounding): the oracle can then be exact.
pub fn value_range(dtype: DType, op: Option<ReduceOp>) -> (i64, i64) {
    let unsigned = dtype == DType::U8;
    match op {
        Some(ReduceOp::Prod) => {
            if unsigned {
                (0, 2)
            } else {
                (-2, 2)
            }
        }
        Some(ReduceOp::Sum) | Some(ReduceOp::Avg) => {
            if unsigned {
                (0, 15)
            } else {
                (-15, 15)
            }
        }
        _ => {
            if unsigned {
                (0, 250)
            } else if dtype == DType::I8 {
                (-120, 120)
            } else {
                (-200, 200)
            }
        }
    }
}

/// The input of `rank` for a case: `len` elements from `seed`, in `range`.
pub fn input<T: Element>(seed: u64, rank: usize, len: usize, range: (i64, i64)) -> Vec<T> {
    let span = (range.1 - range.0 + 1) as u64;
    let base = splitmix(seed ^ ((rank as u64 + 1) << 40));
    (0..len)
        .map(|i| {
            let r = splitmix(base ^ i as u64) % span;
            T::from_f64((range.0 + r as i64) as f64)
        })
        .collect()
}

/// Tolerance (relative, with an absolute floor of the same size) for
/// comparing float results whose rounding may legitimately differ by an ulp
/// between engines (averages); zero for integers.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 1e-3,
        DType::BF16 => 8e-3,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        _ => 0.0,
    }
}

/// Compare `got` with `want`; `Err` names the first differing index.
pub fn compare<T: Element>(what: &str, got: &[T], want: &[T], tol: f64) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, expected {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (gf, wf) = (g.to_f64(), w.to_f64());
        let ok = if tol == 0.0 {
            bytemuck::bytes_of(g) == bytemuck::bytes_of(w)
        } else {
            (gf - wf).abs() <= tol * wf.abs().max(1.0)
        };
        if !ok {
            return Err(format!(
                "{what}: element {i} is {g:?}, expected {w:?} (first of {} elements)",
                got.len()
            ));
        }
    }
    Ok(())
}
