//! Property tests against the oracles in `accel_sharding::reference`.

use std::collections::BTreeSet;

use accel_sharding::reference::{self, global_batches, metrics_order};
use accel_sharding::{
    accumulate, dispatch_slice, dispatch_steps, gather_for_metrics, remainder_for_batches,
    shard_batches, shard_iterable, shard_len, AccumulationConfig, BatchLayout, GradientAccumulator,
    LoaderConfig, SamplerState, ShardOptions, ShardedLoader,
};
use proptest::prelude::*;

/// (len, batch size, world size, split, even, drop_last); with split the
/// batch size is a multiple of the world size.
fn setup() -> impl Strategy<Value = (usize, usize, usize, bool, bool, bool)> {
    (
        0usize..70,
        1usize..6,
        1usize..5,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(len, b, n, split, even, drop)| {
            let bs = if split { b * n } else { b };
            (len, bs, n, split, even, drop)
        })
}

fn all_ranks(
    len: usize,
    bs: usize,
    n: usize,
    split: bool,
    even: bool,
    drop: bool,
) -> Vec<Vec<Vec<usize>>> {
    (0..n)
        .map(|r| {
            let opts = ShardOptions::new(n, r)
                .unwrap()
                .split_batches(split)
                .even_batches(even);
            shard_batches(
                global_batches(len, bs, drop),
                BatchLayout::fixed(bs, drop),
                opts,
            )
            .unwrap()
            .collect()
        })
        .collect()
}

/// Gather step by step in rank order, trimming the last step.
fn gathered(shards: &[Vec<Vec<usize>>], remainder: usize) -> Vec<usize> {
    let steps = shards.iter().map(Vec::len).max().unwrap_or(0);
    let mut out = Vec::new();
    for s in 0..steps {
        let step: Vec<usize> = shards
            .iter()
            .filter_map(|r| r.get(s))
            .flatten()
            .copied()
            .collect();
        out.extend(gather_for_metrics(step, s + 1 == steps, remainder));
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn streaming_shards_equal_the_reference((len, bs, n, split, even, drop) in setup()) {
        let got = all_ranks(len, bs, n, split, even, drop);
        let want = reference::shard_all(&global_batches(len, bs, drop), Some(bs), drop, n, split, even);
        prop_assert_eq!(&got, &want);
        for (r, shard) in got.iter().enumerate() {
            let opts = ShardOptions::new(n, r).unwrap().split_batches(split).even_batches(even);
            prop_assert_eq!(shard_len(len, BatchLayout::fixed(bs, drop), opts).unwrap(), shard.len());
        }
    }

    #[test]
    fn union_over_ranks_covers_exactly_the_kept_samples((len, bs, n, split, even, drop) in setup()) {
        let got = all_ranks(len, bs, n, split, even, drop);
        let union: BTreeSet<usize> = got.iter().flatten().flatten().copied().collect();
        let want: BTreeSet<usize> = metrics_order(len, bs, drop, n, split).into_iter().collect();
        prop_assert_eq!(union, want);
    }

    #[test]
    fn even_batches_give_every_rank_the_same_count_and_size((len, bs, n, split, drop) in
        setup().prop_map(|(l, b, n, s, _, d)| (l, b, n, s, d))) {
        let got = all_ranks(len, bs, n, split, true, drop);
        let per = if split { bs / n } else { bs };
        for shard in &got {
            prop_assert_eq!(shard.len(), got[0].len());
            prop_assert!(shard.iter().all(|b| b.len() == per));
        }
    }

    #[test]
    fn gather_for_metrics_returns_the_dataset_once_in_order((len, bs, n, split, even, drop) in setup()) {
        // What the loader hands out (with one process it does not shard, so
        // nothing is topped up and the remainder is 0).
        let config = LoaderConfig { drop_last: drop, split_batches: split, even_batches: even, ..LoaderConfig::new(len, bs, n) };
        let got: Vec<Vec<Vec<usize>>> = (0..n)
            .map(|r| ShardedLoader::new(config.clone(), r).unwrap().epoch_batches(0))
            .collect();
        prop_assert_eq!(gathered(&got, config.remainder()), metrics_order(len, bs, drop, n, split));
    }

    #[test]
    fn variable_batches_equal_the_reference(
        lens in proptest::collection::vec(1usize..5, 0..14),
        n in 1usize..5,
        even in any::<bool>(),
        drop in any::<bool>(),
    ) {
        let mut next = 0;
        let batches: Vec<Vec<usize>> = lens.iter().map(|&l| { next += l; (next - l..next).collect() }).collect();
        let got: Vec<Vec<Vec<usize>>> = (0..n).map(|r| {
            let opts = ShardOptions::new(n, r).unwrap().even_batches(even);
            shard_batches(batches.clone(), BatchLayout::variable(drop), opts).unwrap().collect()
        }).collect();
        prop_assert_eq!(&got, &reference::shard_all(&batches, None, drop, n, false, even));
        if even {
            prop_assert!(got.iter().all(|s| s.len() == got[0].len()));
        }
        // Exact trimming also for variable sizes.
        let rem = remainder_for_batches(&lens, BatchLayout::variable(drop), ShardOptions::new(n, 0).unwrap().even_batches(even));
        let kept = if drop { batches.len() / n * n } else { batches.len() };
        let want: Vec<usize> = batches[..kept].concat();
        prop_assert_eq!(gathered(&got, rem), want);
    }

    #[test]
    fn accumulation_cadence_equals_the_reference(
        k in 1usize..6, batches in 0usize..30, n in 1usize..5, split in any::<bool>(), each in any::<bool>(), epochs in 1usize..3,
    ) {
        let mut config = AccumulationConfig::new(k, n);
        config.split_batches = split;
        config.sync_each_batch = each;
        let mut acc = GradientAccumulator::new(config).unwrap();
        for _ in 0..epochs {
            let got: Vec<_> = accumulate(0..batches, &mut acc).map(|(_, d)| d).collect();
            prop_assert_eq!(got, reference::accumulation(k, batches, n, split, each));
        }
    }

    #[test]
    fn resume_at_a_random_batch_yields_the_rest_exactly(
        (len, bs, n, split, even, drop) in setup(),
        seed in any::<u64>(),
        stop_epoch in 0u64..3,
        stop_frac in 0.0f64..1.0,
    ) {
        let config = LoaderConfig {
            drop_last: drop, shuffle: true, seed, split_batches: split, even_batches: even,
            ..LoaderConfig::new(len, bs, n)
        };
        for rank in 0..n {
            // Uninterrupted: epochs 0..=stop_epoch + 1.
            let mut full = ShardedLoader::new(config.clone(), rank).unwrap();
            let mut reference = Vec::new();
            for _ in 0..=stop_epoch + 1 {
                reference.extend(full.epoch_iter().map(|b| (b.epoch, b.indices)));
            }
            // Interrupted at a random batch of stop_epoch.
            let mut first = ShardedLoader::new(config.clone(), rank).unwrap();
            let mut seen = Vec::new();
            for _ in 0..stop_epoch {
                seen.extend(first.epoch_iter().map(|b| (b.epoch, b.indices)));
            }
            let stop = (first.len() as f64 * stop_frac) as usize;
            seen.extend(first.epoch_iter().take(stop).map(|b| (b.epoch, b.indices)));
            let saved = first.state().to_json();
            std::mem::drop(first);
            let state = SamplerState::from_json(&saved).unwrap();
            let mut other = config.clone();
            other.seed = seed.wrapping_add(1); // the state's seed wins
            let mut resumed = ShardedLoader::from_state(other, rank, &state).unwrap();
            while seen.len() < reference.len() {
                let before = seen.len();
                seen.extend(resumed.epoch_iter().map(|b| (b.epoch, b.indices)));
                if seen.len() == before && resumed.is_empty() && resumed.epoch() > stop_epoch + 1 {
                    break;
                }
            }
            prop_assert_eq!(seen, reference);
        }
    }

    #[test]
    fn iterable_shards_rebuild_the_stream(
        len in 0usize..60, b in 1usize..5, n in 1usize..5, split in any::<bool>(), drop in any::<bool>(),
    ) {
        let bs = if split { b * n } else { b };
        let chunks: Vec<Vec<_>> = (0..n)
            .map(|r| shard_iterable(0..len, bs, drop, n, r, split).unwrap().collect())
            .collect();
        let steps = chunks[0].len();
        let global = if split { bs } else { bs * n };
        let mut out = Vec::new();
        for s in 0..steps {
            prop_assert!(chunks.iter().all(|c| c.len() == steps));
            let c0 = &chunks[0][s];
            prop_assert_eq!(c0.end_of_dataloader, s + 1 == steps);
            let step: Vec<usize> = chunks.iter().flat_map(|c| c[s].items.clone()).collect();
            prop_assert_eq!(step.len(), global);
            out.extend(gather_for_metrics(step, c0.end_of_dataloader, c0.remainder));
        }
        let kept = if drop { len / global * global } else { len };
        prop_assert_eq!(out, (0..kept).collect::<Vec<_>>());
    }

    #[test]
    fn dispatcher_slices_rebuild_the_dataset(
        len in 1usize..60, b in 1usize..5, n in 1usize..5, split in any::<bool>(), drop in any::<bool>(),
    ) {
        let bs = if split { b * n } else { b };
        let steps = dispatch_steps(&global_batches(len, bs, drop), n, split, drop);
        let mut out = Vec::new();
        for (i, g) in steps.iter().enumerate() {
            let last = i + 1 == steps.len();
            let parts: Vec<Vec<usize>> = (0..n).map(|r| dispatch_slice(g, &steps[0], n, r, last, drop).unwrap()).collect();
            prop_assert!(parts.iter().all(|p| p.len() == parts[0].len()));
            out.extend(gather_for_metrics(parts.concat(), last, g.len()));
        }
        prop_assert_eq!(&out, &steps.concat());
        if !drop {
            prop_assert_eq!(out, (0..len).collect::<Vec<_>>());
        }
    }
}
