//! Sharding a stream of unknown length (Accelerate's `IterableDatasetShard`).
//!
//! Every rank reads the same stream. Items are buffered into global steps of
//! `batch_size * N` items (`batch_size` with `split_batches`), and rank `r`
//! keeps the `r`-th contiguous slice of each step. The last, partial step is
//! dropped with `drop_last`; otherwise it is completed with items taken
//! cyclically from the first step of the stream, so every rank keeps a full
//! slice.

use accel_api::{Error, Result};

/// One rank's slice of one global step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IterableChunk<T> {
    /// The items this rank keeps (`batch_size`, or `batch_size / N` with
    /// `split_batches`).
    pub items: Vec<T>,
    /// Real items in the whole global step when it was completed with
    /// repeated items, 0 when it holds no repeats; pass it to
    /// [`gather_for_metrics`](crate::gather_for_metrics).
    pub remainder: usize,
    /// No step follows this one.
    pub end_of_dataloader: bool,
}

/// Shard `items` for rank `process_index` of `num_processes`.
///
/// # Requires
/// Every rank must see the same stream in the same order.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
/// for a zero batch size, a rank out of range, or `split_batches` with a
/// batch size the world size does not divide.
pub fn shard_iterable<I>(
    items: I,
    batch_size: usize,
    drop_last: bool,
    num_processes: usize,
    process_index: usize,
    split_batches: bool,
) -> Result<IterableShard<I::IntoIter>>
where
    I: IntoIterator,
    I::Item: Clone,
{
    crate::ShardOptions::new(num_processes, process_index)?;
    if batch_size == 0 {
        return Err(Error::invalid_argument("shard_iterable", "batch_size is 0"));
    }
    if split_batches && !batch_size.is_multiple_of(num_processes) {
        return Err(Error::invalid_argument(
            "shard_iterable",
            format!(
                "split_batches: batch size {batch_size} is not a round multiple of the number of processes {num_processes}"
            ),
        ));
    }
    let (global, per) = if split_batches {
        (batch_size, batch_size / num_processes)
    } else {
        (batch_size * num_processes, batch_size)
    };
    Ok(IterableShard {
        inner: items.into_iter(),
        global,
        per,
        rank: process_index,
        drop_last,
        first: Vec::new(),
        prefetched: None,
        done: false,
    })
}

/// How many chunks [`shard_iterable`] yields to every rank for a stream of
/// `dataset_len` items (when the stream's length is known): one per global
/// step of `batch_size * num_processes` items (`batch_size` with
/// `split_batches`), the partial last step counted unless `drop_last`.
///
/// # Behavior
/// Agrees with iterating [`shard_iterable`] over exactly `dataset_len`
/// items, for every rank (each rank gets one chunk per step). A zero batch
/// size or world size counts as no chunk.
pub fn iterable_len(
    dataset_len: usize,
    batch_size: usize,
    drop_last: bool,
    num_processes: usize,
    split_batches: bool,
) -> usize {
    let global = if split_batches {
        batch_size
    } else {
        batch_size.saturating_mul(num_processes)
    };
    if global == 0 {
        return 0;
    }
    dataset_len / global + usize::from(!drop_last && !dataset_len.is_multiple_of(global))
}

/// Iterator returned by [`shard_iterable`].
pub struct IterableShard<I: Iterator> {
    inner: I,
    global: usize,
    per: usize,
    rank: usize,
    drop_last: bool,
    first: Vec<I::Item>,
    prefetched: Option<Vec<I::Item>>,
    done: bool,
}

impl<I: Iterator> std::fmt::Debug for IterableShard<I> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IterableShard")
            .field("global", &self.global)
            .field("per", &self.per)
            .field("rank", &self.rank)
            .field("drop_last", &self.drop_last)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl<I> IterableShard<I>
where
    I: Iterator,
    I::Item: Clone,
{
    fn read_step(&mut self) -> Vec<I::Item> {
        self.inner.by_ref().take(self.global).collect()
    }

    fn slice(&self, step: &[I::Item]) -> Vec<I::Item> {
        step[self.rank * self.per..(self.rank + 1) * self.per].to_vec()
    }
}

impl<I> Iterator for IterableShard<I>
where
    I: Iterator,
    I::Item: Clone,
{
    type Item = IterableChunk<I::Item>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let mut step = match self.prefetched.take() {
            Some(s) => s,
            None => self.read_step(),
        };
        if step.is_empty() {
            self.done = true;
            return None;
        }
        if step.len() < self.global {
            self.done = true;
            if self.drop_last {
                return None;
            }
            let real = step.len();
            let source = if self.first.is_empty() {
                step.clone()
            } else {
                std::mem::take(&mut self.first)
            };
            let mut j = 0;
            while step.len() < self.global {
                step.push(source[j % source.len()].clone());
                j += 1;
            }
            return Some(IterableChunk {
                items: self.slice(&step),
                remainder: real,
                end_of_dataloader: true,
            });
        }
        if self.first.is_empty() && !self.drop_last {
            self.first = step.clone();
        }
        let next = self.read_step();
        let end = next.is_empty() || (next.len() < self.global && self.drop_last);
        if end {
            self.done = true;
        } else {
            self.prefetched = Some(next);
        }
        Some(IterableChunk {
            items: self.slice(&step),
            remainder: 0,
            end_of_dataloader: end,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_length_agrees_with_what_every_rank_yields() {
        for n in 1..=4 {
            for bs in 1..=4 {
                for split in [false, true] {
                    if split && bs % n != 0 {
                        continue;
                    }
                    for drop_last in [false, true] {
                        for len in 0..=25 {
                            let want = iterable_len(len, bs, drop_last, n, split);
                            for r in 0..n {
                                let got = shard_iterable(0..len, bs, drop_last, n, r, split)
                                    .unwrap()
                                    .count();
                                assert_eq!(got, want, "len {len} bs {bs} n {n} rank {r} split {split} drop_last {drop_last}");
                            }
                        }
                    }
                }
            }
        }
    }
}
