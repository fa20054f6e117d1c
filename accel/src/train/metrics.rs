//! Metrics across ranks: the gathers that drop the samples `even_batches`
//! duplicated (Accelerate's `gather_for_metrics`). The plain gathers,
//! reductions and padding are the runtime's (`accelerator/collectives.rs`).

use accel_api::Result;
use serde::{de::DeserializeOwned, Serialize};

use super::prepare::Batch;
use crate::accelerator::DataParallel;
use crate::{Accelerator, CollectivesExt, Scalar};

impl Accelerator {
    /// Gather per-sample values for a metric and drop the samples that
    /// `even_batches` duplicated at the end of the epoch, so an epoch's
    /// gathers hold every sample exactly once, in order (Accelerate's
    /// `gather_for_metrics`). One element of `data` per sample of `batch`.
    /// Over the data-parallel ranks (the world without tensor or context
    /// parallelism; [`parallelism_config`](Self::parallelism_config)).
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
        let all = match self.data_parallel()? {
            DataParallel::World => self.gather_varsize(data)?,
            DataParallel::Group(dp) => {
                T::from_wire(dp.all_gather_varsize(&T::to_wire(data))?.concat())
            }
            DataParallel::Alone => data.to_vec(),
        };
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
        let all: Vec<T> = match self.data_parallel()? {
            DataParallel::World => self.comm().gather_object(&items.to_vec())?,
            DataParallel::Group(dp) => dp.gather_object(&items.to_vec())?,
            DataParallel::Alone => vec![items.to_vec()],
        }
        .into_iter()
        .flatten()
        .collect();
        Ok(accel_sharding::gather_for_metrics(
            all,
            batch.end_of_dataloader,
            batch.remainder,
        ))
    }
}
