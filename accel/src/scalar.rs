//! [`Scalar`]: the value types the accelerator's gathers and reductions
//! take, a superset of the engines' [`Element`] types.
//!
//! See [`Scalar`] for how the extra types travel and reduce.

use std::borrow::Cow;

use accel_api::{Communicator, CommunicatorExt, Element, Error, ErrorKind, ReduceOp, Result};

mod sealed {
    pub trait Sealed {}
}

/// A value type [`Accelerator::all_reduce`](crate::Accelerator::all_reduce),
/// [`gather`](crate::Accelerator::gather),
/// [`broadcast`](crate::Accelerator::broadcast),
/// [`reduce`](crate::Accelerator::reduce) and the metrics gathers take:
/// every [`Element`] type, plus `u32`, `u64`, `usize` and `bool`.
///
/// Engines move `f16`, `bf16`, `f32`, `f64`, `i8`, `u8`, `i32` and `i64`.
/// Training loops also count in `u32`, `u64` and `usize` (steps, samples)
/// and flag with `bool`; those travel as an element type and are reduced
/// exactly:
///
/// | type | gather / broadcast | `sum`, `mean` | `max`, `min` | `prod` |
/// |---|---|---|---|---|
/// | `u32`, `u64`, `usize` | bit-exact as `i64` | exact (32-bit halves summed as `i64`), overflow is an error | exact (order-preserving map to `i64`) | exact (gathered, multiplied with overflow check) |
/// | `bool` | as `u8` | `sum` is *any* (logical or, as torch.distributed does for `bool`), `mean` is an error | *any* / *all* | *all* (logical and) |
///
/// `mean` of integers truncates toward zero, as [`ReduceOp::Avg`] does.
///
/// Sealed: the set is part of the facade's contract.
pub trait Scalar: Copy + std::fmt::Debug + Send + Sync + 'static + sealed::Sealed {
    /// The element type the values travel as.
    type Wire: Element;

    /// The values as wire elements, losslessly.
    fn to_wire(values: &[Self]) -> Cow<'_, [Self::Wire]>;

    /// Values back from wire elements made by [`to_wire`](Self::to_wire).
    fn from_wire(wire: Vec<Self::Wire>) -> Vec<Self>;

    /// All-reduce `data` in place across `comm`.
    ///
    /// # Errors
    /// The communicator's; [`ErrorKind::InvalidArgument`] when the exact
    /// result does not fit the type (a `u32` sum past `u32::MAX`);
    /// [`ErrorKind::Unsupported`] for an operation with no meaning for it
    /// (`mean` of `bool`).
    fn all_reduce(comm: &dyn Communicator, data: &mut [Self], op: ReduceOp) -> Result<()>;

    /// Broadcast `data` from `root` in place.
    ///
    /// # Errors
    /// The communicator's.
    fn broadcast(comm: &dyn Communicator, data: &mut [Self], root: usize) -> Result<()> {
        let mut wire = Self::to_wire(data).into_owned();
        comm.broadcast_slice(&mut wire, root)?;
        data.copy_from_slice(&Self::from_wire(wire));
        Ok(())
    }
}

macro_rules! native {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Scalar for $t {
            type Wire = $t;
            fn to_wire(values: &[$t]) -> Cow<'_, [$t]> {
                Cow::Borrowed(values)
            }
            fn from_wire(wire: Vec<$t>) -> Vec<$t> {
                wire
            }
            fn all_reduce(comm: &dyn Communicator, data: &mut [$t], op: ReduceOp) -> Result<()> {
                comm.all_reduce_slice(data, op)
            }
            fn broadcast(comm: &dyn Communicator, data: &mut [$t], root: usize) -> Result<()> {
                comm.broadcast_slice(data, root)
            }
        }
    )*};
}

native!(half::f16, half::bf16, f32, f64, i8, u8, i32, i64);

fn unsupported(op: ReduceOp, ty: &str) -> Error {
    Error::new(
        ErrorKind::Unsupported,
        format!("reduction {op} is not defined for {ty}"),
    )
    .with_op("all_reduce")
}

fn overflow(op: ReduceOp, ty: &str) -> Error {
    Error::invalid_argument(
        "all_reduce",
        format!("the {op} across ranks does not fit in {ty}"),
    )
    .with_fix("reduce a wider type (u64, or f64)")
}

/// The exact reduction of unsigned values across ranks, as `u128` (so a
/// caller can check it fits its own type).
fn reduce_unsigned(comm: &dyn Communicator, data: &[u64], op: ReduceOp) -> Result<Vec<u128>> {
    const FLIP: u64 = 1 << 63;
    let n = data.len();
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            // Halves of 32 bits summed as i64 are exact for up to 2^31 ranks.
            let mut wire: Vec<i64> = data
                .iter()
                .map(|&x| (x & 0xFFFF_FFFF) as i64)
                .chain(data.iter().map(|&x| (x >> 32) as i64))
                .collect();
            comm.all_reduce_slice(&mut wire, ReduceOp::Sum)?;
            let world = comm.world_size() as u128;
            Ok((0..n)
                .map(|i| {
                    let total = ((wire[n + i] as u128) << 32) + wire[i] as u128;
                    if op == ReduceOp::Avg {
                        total / world
                    } else {
                        total
                    }
                })
                .collect())
        }
        ReduceOp::Max | ReduceOp::Min => {
            // x ^ 2^63 as i64 preserves the order of u64.
            let mut wire: Vec<i64> = data.iter().map(|&x| (x ^ FLIP) as i64).collect();
            comm.all_reduce_slice(&mut wire, op)?;
            Ok(wire.iter().map(|&w| ((w as u64) ^ FLIP) as u128).collect())
        }
        ReduceOp::Prod => {
            let wire: Vec<i64> = data.iter().map(|&x| x as i64).collect();
            let all = comm.all_gather_vec(&wire)?;
            let mut out = vec![1u128; n];
            for chunk in all.chunks(n.max(1)) {
                for (o, &w) in out.iter_mut().zip(chunk) {
                    // Saturate past u64: the caller reports the overflow.
                    *o = o
                        .saturating_mul(w as u64 as u128)
                        .min(u128::from(u64::MAX) + 1);
                }
            }
            Ok(out)
        }
        other => Err(unsupported(other, "unsigned integers")),
    }
}

macro_rules! unsigned {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Scalar for $t {
            type Wire = i64;
            fn to_wire(values: &[$t]) -> Cow<'_, [i64]> {
                Cow::Owned(values.iter().map(|&x| x as u64 as i64).collect())
            }
            fn from_wire(wire: Vec<i64>) -> Vec<$t> {
                wire.into_iter().map(|w| w as u64 as $t).collect()
            }
            fn all_reduce(comm: &dyn Communicator, data: &mut [$t], op: ReduceOp) -> Result<()> {
                let wide: Vec<u64> = data.iter().map(|&x| x as u64).collect();
                let out = reduce_unsigned(comm, &wide, op)?;
                for (d, v) in data.iter_mut().zip(out) {
                    *d = <$t>::try_from(v).map_err(|_| overflow(op, stringify!($t)))?;
                }
                Ok(())
            }
        }
    )*};
}

unsigned!(u32, u64, usize);

impl sealed::Sealed for bool {}
impl Scalar for bool {
    type Wire = u8;
    fn to_wire(values: &[bool]) -> Cow<'_, [u8]> {
        Cow::Owned(values.iter().map(|&b| u8::from(b)).collect())
    }
    fn from_wire(wire: Vec<u8>) -> Vec<bool> {
        wire.into_iter().map(|w| w != 0).collect()
    }
    fn all_reduce(comm: &dyn Communicator, data: &mut [bool], op: ReduceOp) -> Result<()> {
        let engine_op = match op {
            ReduceOp::Sum | ReduceOp::Max => ReduceOp::Max,
            ReduceOp::Prod | ReduceOp::Min => ReduceOp::Min,
            other => return Err(unsupported(other, "bool")),
        };
        let mut wire = Self::to_wire(data).into_owned();
        comm.all_reduce_slice(&mut wire, engine_op)?;
        data.copy_from_slice(&Self::from_wire(wire));
        Ok(())
    }
}
