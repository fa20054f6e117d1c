//! Sample order for one epoch and fixed-size batching.

use serde::{Deserialize, Serialize};

use crate::rng::permutation;

/// The order in which a map-style dataset of `len` samples is read, identical
/// on every rank.
///
/// # Behavior
/// With `shuffle`, epoch `e` reads [`permutation(seed, e, len)`](permutation);
/// without, it reads `0..len`. The order depends only on `(seed, epoch, len)`,
/// so every rank computes the same order without communicating, and a resumed
/// run recomputes exactly the order it had. Unlike Accelerate's
/// `SeedableRandomSampler`, the epoch does not advance by itself when an
/// iteration ends: [`ShardedLoader`](crate::ShardedLoader) advances it, or the
/// caller uses [`set_epoch`](Self::set_epoch).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeedableSampler {
    /// Number of samples.
    pub len: usize,
    /// Shuffle (otherwise sequential).
    pub shuffle: bool,
    /// The seed shared by all ranks.
    pub seed: u64,
    /// The current epoch.
    pub epoch: u64,
}

impl SeedableSampler {
    /// A sampler over `len` samples at epoch 0.
    pub fn new(len: usize, shuffle: bool, seed: u64) -> SeedableSampler {
        SeedableSampler {
            len,
            shuffle,
            seed,
            epoch: 0,
        }
    }

    /// Select the epoch whose order [`indices`](Self::indices) returns.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The sample order of the current epoch.
    pub fn indices(&self) -> Vec<usize> {
        self.indices_for(self.epoch)
    }

    /// The sample order of `epoch`.
    pub fn indices_for(&self, epoch: u64) -> Vec<usize> {
        if self.shuffle {
            permutation(self.seed, epoch, self.len)
        } else {
            (0..self.len).collect()
        }
    }
}

/// Cut a sample order into batches of `batch_size`, as PyTorch's
/// `BatchSampler` does: the last batch is shorter when `batch_size` does not
/// divide the length, and is left out when `drop_last`.
///
/// # Requires
/// `batch_size > 0` (a zero batch size gives no batches).
pub fn batch_indices(order: &[usize], batch_size: usize, drop_last: bool) -> Vec<Vec<usize>> {
    if batch_size == 0 {
        return Vec::new();
    }
    order
        .chunks(batch_size)
        .filter(|c| !drop_last || c.len() == batch_size)
        .map(<[usize]>::to_vec)
        .collect()
}
