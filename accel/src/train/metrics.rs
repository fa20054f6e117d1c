//! Metrics across ranks: gather, gather-for-metrics, reduce, padding.

use accel_api::{Element, Error, ReduceOp, Result};
use serde::{de::DeserializeOwned, Serialize};

use super::prepare::Batch;
use crate::{Accelerator, CollectivesExt, Scalar};

impl Accelerator {
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

    /// Gather per-sample values for a metric and drop the samples that
    /// `even_batches` duplicated at the end of the epoch, so an epoch's
    /// gathers hold every sample exactly once, in order (Accelerate's
    /// `gather_for_metrics`). One element of `data` per sample of `batch`.
    /// Collective.
    ///
    /// # Behavior
    /// On the last batch of the epoch (`batch.end_of_dataloader`) the
    /// gathered values are cut to `batch.remainder` when that is non-zero;
    /// otherwise everything is returned.
    ///
    /// # Errors
    /// The communicator's.
    pub fn gather_for_metrics<T: Scalar, I>(&self, data: &[T], batch: &Batch<I>) -> Result<Vec<T>> {
        self.gather_for_metrics_rows(data, 1, batch)
    }

    /// [`gather_for_metrics`](Self::gather_for_metrics) for samples of
    /// `row_len` elements each (`data.len() == row_len * samples`).
    ///
    /// # Errors
    /// The communicator's.
    pub fn gather_for_metrics_rows<T: Scalar, I>(
        &self,
        data: &[T],
        row_len: usize,
        batch: &Batch<I>,
    ) -> Result<Vec<T>> {
        let all = self.gather_varsize(data)?;
        Ok(accel_sharding::gather_for_metrics(
            all,
            batch.end_of_dataloader,
            batch.remainder * row_len,
        ))
    }

    /// [`gather_for_metrics`](Self::gather_for_metrics) for serde values
    /// (labels, strings, structs), one per sample. Collective.
    ///
    /// # Errors
    /// As [`CollectivesExt::gather_object`].
    pub fn gather_objects_for_metrics<T: Serialize + DeserializeOwned + Clone, I>(
        &self,
        items: &[T],
        batch: &Batch<I>,
    ) -> Result<Vec<T>> {
        let all: Vec<T> = self
            .comm()
            .gather_object(&items.to_vec())?
            .into_iter()
            .flatten()
            .collect();
        Ok(accel_sharding::gather_for_metrics(
            all,
            batch.end_of_dataloader,
            batch.remainder,
        ))
    }

    /// Reduce `data` across ranks by name and return the result on every
    /// rank: `sum`, `mean` (or `avg`), `max`, `min` (and `prod`). Takes
    /// every [`Scalar`], so `u64` step counters and `bool` flags reduce too.
    /// Collective.
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
        self.all_reduce(&mut out, op)?;
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
