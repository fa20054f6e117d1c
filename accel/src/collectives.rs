//! Collectives built on top of any [`Communicator`], the same for every
//! backend: variable-size gather, padding across processes, serde objects,
//! and named reductions.

use accel_api::{Communicator, CommunicatorExt, Element, Error, ErrorKind, ReduceOp, Result};
use serde::{de::DeserializeOwned, Serialize};

/// Runtime-level collectives, provided for every [`Communicator`].
pub trait CollectivesExt: Communicator {
    /// Gather slices of different lengths from every rank, in rank order, on
    /// every rank. Costs two all-gathers (lengths, then data padded to the
    /// longest).
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    fn all_gather_varsize<T: Element>(&self, data: &[T]) -> Result<Vec<Vec<T>>> {
        let lens = self.all_gather_vec(&[data.len() as i64])?;
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut padded = data.to_vec();
        padded.resize(max, T::zeroed());
        let all = self.all_gather_vec(&padded)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &n)| all[r * max..r * max + n as usize].to_vec())
            .collect())
    }

    /// Pad a row-major tensor of `shape` along `dim` to the largest size of
    /// that dimension across ranks, filling with `pad_value` at the end (or
    /// at the start when `pad_first`). Returns the padded data and shape.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `dim` is out of range, when
    /// `data.len()` disagrees with `shape`, or when ranks disagree on the
    /// number of dimensions or on any other dimension; communication errors.
    fn pad_across_processes<T: Element>(
        &self,
        data: &[T],
        shape: &[usize],
        dim: usize,
        pad_value: T,
        pad_first: bool,
    ) -> Result<(Vec<T>, Vec<usize>)> {
        let bad =
            |m: String| Error::invalid_argument("pad_across_processes", m).with_rank(self.rank());
        if dim >= shape.len() {
            return Err(bad(format!(
                "dim {dim} is out of range for shape {shape:?}"
            )));
        }
        if shape.iter().product::<usize>() != data.len() {
            return Err(bad(format!(
                "shape {shape:?} does not hold {} elements",
                data.len()
            )));
        }
        let ndims = self.all_gather_vec(&[shape.len() as i64])?;
        if ndims.iter().any(|&n| n as usize != shape.len()) {
            return Err(bad(format!(
                "ranks disagree on the number of dimensions: {ndims:?}"
            )));
        }
        let shapes = self.all_gather_vec(&shape.iter().map(|&d| d as i64).collect::<Vec<_>>())?;
        let n = shape.len();
        let mut max = 0usize;
        for r in 0..self.world_size() {
            let s = &shapes[r * n..(r + 1) * n];
            for (d, (&a, &b)) in s.iter().zip(shape).enumerate() {
                if d != dim && a as usize != b {
                    return Err(bad(format!(
                        "rank {r} has shape {s:?}, this rank {shape:?}: only dim {dim} may differ"
                    )));
                }
            }
            max = max.max(s[dim] as usize);
        }
        let outer: usize = shape[..dim].iter().product();
        let inner: usize = shape[dim + 1..].iter().product();
        let (old, pad) = (shape[dim] * inner, (max - shape[dim]) * inner);
        let mut out = Vec::with_capacity(outer * max * inner);
        for o in 0..outer {
            let block = &data[o * old..(o + 1) * old];
            if pad_first {
                out.extend(std::iter::repeat_n(pad_value, pad));
                out.extend_from_slice(block);
            } else {
                out.extend_from_slice(block);
                out.extend(std::iter::repeat_n(pad_value, pad));
            }
        }
        let mut new_shape = shape.to_vec();
        new_shape[dim] = max;
        Ok((out, new_shape))
    }

    /// Gather one serde value from every rank, in rank order, on every rank
    /// (serialised as JSON, so nested maps, enums and strings travel).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when the value does not serialise;
    /// [`ErrorKind::Corrupt`] when a peer's bytes do not decode as `T`
    /// (ranks passed different types); communication errors.
    fn gather_object<T: Serialize + DeserializeOwned>(&self, value: &T) -> Result<Vec<T>> {
        let bytes = to_bytes(value, "gather_object")?;
        self.all_gather_varsize(&bytes)?
            .iter()
            .enumerate()
            .map(|(r, b)| from_bytes(b, r, "gather_object"))
            .collect()
    }

    /// Send one serde value from `root` to every rank. `value` must be `Some`
    /// on `root` and is ignored elsewhere.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `root` passes `None`; as
    /// [`gather_object`](Self::gather_object) otherwise.
    fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: Option<&T>,
        root: usize,
    ) -> Result<T> {
        let mut bytes = if self.rank() == root {
            let v = value.ok_or_else(|| {
                Error::invalid_argument("broadcast_object", "the root must pass a value")
                    .with_rank(self.rank())
            })?;
            to_bytes(v, "broadcast_object")?
        } else {
            Vec::new()
        };
        let mut len = [bytes.len() as i64];
        self.broadcast_slice(&mut len, root)?;
        bytes.resize(len[0] as usize, 0);
        self.broadcast_slice(&mut bytes, root)?;
        from_bytes(&bytes, root, "broadcast_object")
    }

    /// All-reduce by name: `sum`, `mean`/`avg`, `max`, `min`, `prod`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for any other name (never a silent
    /// sum); communication errors.
    fn reduce_named<T: Element>(&self, data: &mut [T], reduction: &str) -> Result<()> {
        let op: ReduceOp = reduction
            .parse()
            .map_err(|e: Error| e.with_op("reduce").with_rank(self.rank()))?;
        self.all_reduce_slice(data, op)
    }
}

impl<C: Communicator + ?Sized> CollectivesExt for C {}

fn to_bytes<T: Serialize>(v: &T, op: &str) -> Result<Vec<u8>> {
    serde_json::to_vec(v)
        .map_err(|e| Error::invalid_argument(op, format!("value does not serialise: {e}")))
}

fn from_bytes<T: DeserializeOwned>(b: &[u8], rank: usize, op: &str) -> Result<T> {
    serde_json::from_slice(b).map_err(|e| {
        Error::new(
            ErrorKind::Corrupt,
            format!("the value from rank {rank} does not decode: {e}"),
        )
        .with_op(op.to_string())
        .with_fix("pass values of the same type on every rank")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_backend_single::SingleCommunicator;
    use std::collections::BTreeMap;
    use std::time::Duration;

    fn comm() -> SingleCommunicator {
        accel_backend_single::communicator(accel_api::Device::CPU, Duration::from_secs(1))
    }

    #[test]
    fn varsize_and_objects_on_one_rank() {
        let c = comm();
        assert_eq!(
            c.all_gather_varsize(&[1u8, 2, 3]).unwrap(),
            vec![vec![1, 2, 3]]
        );
        let v: BTreeMap<String, Vec<Option<i32>>> = [("a".to_string(), vec![Some(1), None])].into();
        assert_eq!(c.gather_object(&v).unwrap(), vec![v.clone()]);
        assert_eq!(c.broadcast_object(Some(&v), 0).unwrap(), v);
        assert!(c.broadcast_object::<i32>(None, 0).is_err());
    }

    #[test]
    fn pad_checks_arguments() {
        let c = comm();
        let (d, s) = c
            .pad_across_processes(&[1i32, 2, 3, 4], &[2, 2], 1, 0, false)
            .unwrap();
        assert_eq!((d, s), (vec![1, 2, 3, 4], vec![2, 2]));
        assert!(c.pad_across_processes(&[1i32], &[2], 0, 0, false).is_err());
        assert!(c.pad_across_processes(&[1i32], &[1], 1, 0, false).is_err());
    }

    #[test]
    fn unknown_reduction_is_an_error_not_a_sum() {
        let c = comm();
        let e = c.reduce_named(&mut [1.0f32], "median").unwrap_err();
        assert!(e.to_string().contains("median"), "{e}");
        c.reduce_named(&mut [1.0f32], "mean").unwrap();
    }
}
