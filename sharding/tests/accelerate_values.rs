//! The values Accelerate 1.15 gives where it is consistent, and where accel
//! used to differ: `split_between_processes` padding and the one-process
//! loader.

use accel_sharding::{split_share, LoaderConfig, ShardedLoader};

/// Accelerate's `split_between_processes(inputs, apply_padding=True)` on a
/// list, written from its algorithm: contiguous shares, the first
/// `len % n` one longer, each padded with `inputs[-1]` to the longest.
fn accelerate_padded(len: usize, n: usize, rank: usize) -> Vec<usize> {
    let inputs: Vec<usize> = (0..len).collect();
    let (per, extra) = (len / n, len % n);
    let start = rank * per + rank.min(extra);
    let end = start + per + usize::from(rank < extra);
    let mut result = inputs[start.min(len)..end.min(len)].to_vec();
    if let Some(&last) = inputs.last() {
        while result.len() < per + usize::from(extra > 0) {
            result.push(last);
        }
    }
    result
}

#[test]
fn split_with_padding_repeats_the_last_element_of_the_whole_input() {
    let items: Vec<usize> = (0..7).collect();
    assert_eq!(split_share(&items, 3, 1, true), vec![3, 4, 6]);
    for len in 0..=11 {
        let items: Vec<usize> = (0..len).collect();
        for n in 1..=4 {
            for rank in 0..n {
                assert_eq!(
                    split_share(&items, n, rank, true),
                    accelerate_padded(len, n, rank),
                    "{len} items on {n} processes, rank {rank}"
                );
            }
        }
    }
}

#[test]
fn one_process_leaves_the_loader_unsharded_so_the_last_batch_stays_short() {
    let batches = ShardedLoader::new(LoaderConfig::new(22, 3, 1), 0)
        .unwrap()
        .epoch_batches(0);
    assert_eq!(batches.last().unwrap(), &vec![21]);
    for len in 0..=31 {
        for bs in 1..=4 {
            for (split, drop_last) in [(false, false), (true, false), (false, true)] {
                let config = LoaderConfig {
                    split_batches: split,
                    drop_last,
                    ..LoaderConfig::new(len, bs, 1)
                };
                let mut l = ShardedLoader::new(config.clone(), 0).unwrap();
                // torch's DataLoader(range(len), batch_size=bs, drop_last=...)
                let want: Vec<Vec<usize>> = (0..len)
                    .collect::<Vec<_>>()
                    .chunks(bs)
                    .filter(|c| !drop_last || c.len() == bs)
                    .map(<[usize]>::to_vec)
                    .collect();
                let got: Vec<_> = l.epoch_iter().collect();
                let what = format!("len {len} batch {bs} split {split} drop_last {drop_last}");
                assert_eq!(
                    got.iter().map(|b| b.indices.clone()).collect::<Vec<_>>(),
                    want,
                    "{what}"
                );
                assert_eq!(l.len(), want.len(), "{what}");
                assert_eq!(config.remainder(), 0, "{what}: nothing is duplicated");
                let ends: Vec<bool> = got.iter().map(|b| b.end_of_dataloader).collect();
                let mut want_ends = vec![false; want.len()];
                if let Some(e) = want_ends.last_mut() {
                    *e = true;
                }
                assert_eq!(ends, want_ends, "{what}");
            }
        }
    }
}
