//! Oracles: simple, obviously correct versions of the semantics, for tests
//! and for the conformance suite.
//!
//! Each function computes the answer for all ranks at once from the whole
//! input, with no streaming and no state, straight from the rules written in
//! the [crate docs](crate). They are slow (they materialise everything) and
//! meant only to be compared against.

use crate::accumulate::StepDecision;

/// Sequential batches of `batch_size` over `0..len` (PyTorch
/// `BatchSampler(range(len))`).
pub fn global_batches(len: usize, batch_size: usize, drop_last: bool) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < len {
        let end = (start + batch_size).min(len);
        if end - start == batch_size || !drop_last {
            out.push((start..end).collect());
        }
        start = end;
    }
    out
}

/// What every rank gets from `batches`: element `r` is rank `r`'s batches.
///
/// `batch_size` is the nominal size (`None` for variable-size batches);
/// only the last batch may be shorter than it.
pub fn shard_all(
    batches: &[Vec<usize>],
    batch_size: Option<usize>,
    drop_last: bool,
    num_processes: usize,
    split_batches: bool,
    even_batches: bool,
) -> Vec<Vec<Vec<usize>>> {
    let n = num_processes;
    let mut ranks: Vec<Vec<Vec<usize>>> = vec![Vec::new(); n];
    let samples: Vec<usize> = batches.concat();
    let cyclic = |k: usize, from: usize| -> Vec<usize> {
        (from..from + k)
            .map(|j| samples[j % samples.len()])
            .collect()
    };
    let short = |b: &Vec<usize>| batch_size.is_some_and(|s| b.len() < s);

    if split_batches {
        let bs = batch_size.expect("split needs a batch size");
        let per = bs / n;
        for b in batches {
            let mut b = b.clone();
            if short(&b) {
                if drop_last {
                    continue;
                }
                if even_batches {
                    let fill = cyclic(bs - b.len(), 0);
                    b.extend(fill);
                }
            }
            for (r, rank) in ranks.iter_mut().enumerate() {
                let piece: Vec<usize> = b.iter().copied().skip(r * per).take(per).collect();
                if !piece.is_empty() {
                    rank.push(piece);
                }
            }
        }
        return ranks;
    }

    let mut list: Vec<Vec<usize>> = batches.to_vec();
    if drop_last {
        list.truncate(list.len() / n * n);
        if list.last().is_some_and(short) {
            list.truncate(list.len() - n);
        }
    } else if even_batches && !list.is_empty() {
        match batch_size {
            Some(bs) => {
                let mut used = 0;
                let last = list.len() - 1;
                if short(&list[last]) {
                    used = bs - list[last].len();
                    let fill = cyclic(used, 0);
                    list[last].extend(fill);
                }
                while !list.len().is_multiple_of(n) {
                    list.push(cyclic(bs, used));
                    used += bs;
                }
            }
            None => {
                let mut j = 0;
                while !list.len().is_multiple_of(n) {
                    list.push(batches[j % batches.len()].clone());
                    j += 1;
                }
            }
        }
    }
    for (i, b) in list.into_iter().enumerate() {
        ranks[i % n].push(b);
    }
    ranks
}

/// What every rank's *loader* reads: [`shard_all`] on more than one
/// process; on one process the plain global batches, since a one-process
/// loader is not sharded (Accelerate's `prepare_data_loader`), so nothing
/// is topped up.
pub fn loader_all(
    len: usize,
    batch_size: usize,
    drop_last: bool,
    num_processes: usize,
    split_batches: bool,
    even_batches: bool,
) -> Vec<Vec<Vec<usize>>> {
    let global = global_batches(len, batch_size, drop_last);
    if num_processes == 1 {
        return vec![global];
    }
    shard_all(
        &global,
        Some(batch_size),
        drop_last,
        num_processes,
        split_batches,
        even_batches,
    )
}

/// The samples `gather_for_metrics` must return over a whole epoch, in order:
/// the dataset order `0..len` without the samples that `drop_last` discards.
pub fn metrics_order(
    len: usize,
    batch_size: usize,
    drop_last: bool,
    num_processes: usize,
    split_batches: bool,
) -> Vec<usize> {
    if !drop_last {
        return (0..len).collect();
    }
    let full = len / batch_size;
    let kept = if split_batches {
        full
    } else {
        full / num_processes * num_processes
    };
    (0..kept * batch_size).collect()
}

/// The cadence for one loader of `num_batches` batches, from a fresh
/// accumulator with the default options: sync on every `k`-th batch and on
/// the last one; the scheduler steps `num_processes` times per sync (once
/// with `split_batches`).
pub fn accumulation(
    k: usize,
    num_batches: usize,
    num_processes: usize,
    split_batches: bool,
    sync_each_batch: bool,
) -> Vec<StepDecision> {
    (1..=num_batches)
        .map(|i| {
            let sync = i % k == 0 || i == num_batches;
            StepDecision {
                sync_gradients: sync,
                all_reduce: sync || (sync_each_batch && num_processes > 1),
                optimizer_step: sync,
                zero_grad: sync,
                scheduler_steps: match (sync, split_batches) {
                    (false, _) => 0,
                    (true, true) => 1,
                    (true, false) => num_processes,
                },
                loss_divisor: k,
            }
        })
        .collect()
}
