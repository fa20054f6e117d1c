//! Collectives on the world group, over every [`Scalar`]: all-reduce,
//! gathers (equal and differing lengths), broadcast, reduction by name,
//! padding across ranks, and aborting the group.

use accel_api::{CommunicatorExt, Element, Error, ReduceOp, Result};

use super::Accelerator;
use crate::{CollectivesExt, Scalar};

impl Accelerator {
    /// All-reduce a slice in place. Takes every [`Scalar`]: the engines'
    /// element types, and `u32`, `u64`, `usize`, `bool` reduced exactly
    /// (see [`Scalar`]). Collective.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`](accel_api::Communicator::all_reduce), and as [`Scalar::all_reduce`]
    /// (an overflowing integer sum is `InvalidArgument`, `mean` of `bool`
    /// `Unsupported`).
    pub fn all_reduce<T: Scalar>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        T::all_reduce(&*self.comm, data, op).map_err(|e| e.with_rank(self.rank()))
    }

    /// Gather equal-size slices from every rank, in rank order, on every
    /// rank. Takes every [`Scalar`]. Collective.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`](accel_api::Communicator::all_gather).
    pub fn gather<T: Scalar>(&self, data: &[T]) -> Result<Vec<T>> {
        Ok(T::from_wire(self.comm.all_gather_vec(&T::to_wire(data))?))
    }

    /// Broadcast a slice from `root` in place. Takes every [`Scalar`].
    /// Collective.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`](accel_api::Communicator::broadcast).
    pub fn broadcast<T: Scalar>(&self, data: &mut [T], root: usize) -> Result<()> {
        T::broadcast(&*self.comm, data, root)
    }

    /// Abort the group with `reason`: every later collective fails.
    pub fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }

    /// Gather every rank's `data` (lengths may differ), concatenated in rank
    /// order, on every rank. Collective.
    ///
    /// # Errors
    /// The communicator's.
    pub fn gather_varsize<T: Scalar>(&self, data: &[T]) -> Result<Vec<T>> {
        Ok(T::from_wire(
            self.comm().all_gather_varsize(&T::to_wire(data))?.concat(),
        ))
    }

    /// Reduce `data` across ranks by name and return the result on every
    /// rank: `sum`, `mean` (or `avg`), `max`, `min` (and `prod`). Takes
    /// every [`Scalar`], so `u64` step counters and `bool` flags reduce too.
    /// Over the data-parallel ranks, as Accelerate's (the world without
    /// tensor or context parallelism). Collective.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for any other name: an unknown reduction is an error, never a silent
    /// sum; the communicator's.
    pub fn reduce<T: Scalar>(&self, data: &[T], reduction: &str) -> Result<Vec<T>> {
        let op: ReduceOp = reduction
            .parse()
            .map_err(|e: Error| e.with_op("reduce").with_rank(self.rank()))?;
        let mut out = data.to_vec();
        match self.data_parallel()? {
            super::DataParallel::World => self.all_reduce(&mut out, op)?,
            super::DataParallel::Group(dp) => {
                T::all_reduce(&*dp, &mut out, op).map_err(|e| e.with_rank(self.rank()))?
            }
            super::DataParallel::Alone => {}
        }
        Ok(out)
    }

    /// Pad a row-major tensor along `dim` to the largest size across ranks
    /// (at the end, or at the start with `pad_first`), so it can be
    /// gathered. Returns the padded data and shape. Collective.
    ///
    /// # Errors
    /// As [`CollectivesExt::pad_across_processes`].
    pub fn pad_across_processes<T: Element>(
        &self,
        data: &[T],
        shape: &[usize],
        dim: usize,
        pad_value: T,
        pad_first: bool,
    ) -> Result<(Vec<T>, Vec<usize>)> {
        self.comm()
            .pad_across_processes(data, shape, dim, pad_value, pad_first)
    }
}
