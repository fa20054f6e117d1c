//! Dropping the duplicated tail in gather-for-metrics.
//!
//! With `even_batches`, the last step of an epoch is topped up with samples
//! from the start, so gathering every rank's predictions of that step
//! (concatenated in rank order) returns some samples twice. In every sharding
//! mode of this crate the real samples of that step come first, so trimming
//! the gathered items to the number of real ones recovers the dataset exactly
//! once, in order.

use crate::shard::{BatchLayout, ShardOptions};

/// Trim the gathered items of one step.
///
/// # Behavior
/// `gathered` is the concatenation, in rank order, of what every rank
/// contributed for the step. When `end_of_dataloader` is set and `remainder`
/// is non-zero, only the first `remainder` items are kept; otherwise
/// everything is returned (Accelerate's `gather_for_metrics` with a known
/// `remainder`). `remainder` comes from
/// [`LoaderConfig::remainder`](crate::LoaderConfig::remainder),
/// [`remainder_for_batches`], a dispatcher step or an
/// [`IterableChunk`](crate::IterableChunk).
pub fn gather_for_metrics<T>(
    mut gathered: Vec<T>,
    end_of_dataloader: bool,
    remainder: usize,
) -> Vec<T> {
    if end_of_dataloader && remainder > 0 {
        gathered.truncate(remainder);
    }
    gathered
}

/// The real samples in the last gathered step of a batch sequence whose
/// batch lengths are `batch_lens`, when that step contains top-up duplicates;
/// 0 otherwise.
///
/// # Behavior
/// Works for variable-size batches too (where Accelerate has no remainder
/// and leaves the duplicates in). Without `even_batches`, or with
/// `drop_last`, nothing is duplicated and the answer is 0. The rank in
/// `opts` is ignored.
pub fn remainder_for_batches(
    batch_lens: &[usize],
    layout: BatchLayout,
    opts: ShardOptions,
) -> usize {
    if layout.drop_last || !opts.even_batches || batch_lens.is_empty() {
        return 0;
    }
    let short = |len: usize| layout.batch_size.is_some_and(|b| len < b);
    let last = batch_lens[batch_lens.len() - 1];
    if opts.split_batches {
        return if short(last) { last } else { 0 };
    }
    let n = opts.num_processes.max(1);
    let start = (batch_lens.len() - 1) / n * n;
    let round = &batch_lens[start..];
    if round.len() < n || short(last) {
        round.iter().sum()
    } else {
        0
    }
}
