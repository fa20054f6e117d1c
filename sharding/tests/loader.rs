//! ShardedLoader, accumulation, dispatcher and sampler behaviour.

use accel_api::ErrorKind;
use accel_sharding::{
    accumulate, check_concat_shapes, dispatch_slice, permutation, AccumulationConfig,
    AccumulatorState, GradientAccumulator, LoaderConfig, SamplerState, SeedableSampler,
    ShardedLoader,
};

#[test]
fn end_of_dataloader_is_set_on_the_last_batch_of_every_epoch() {
    let mut l = ShardedLoader::new(LoaderConfig::new(16, 4, 1), 0).unwrap();
    for epoch in 0..2 {
        let flags: Vec<bool> = l.epoch_iter().map(|b| b.end_of_dataloader).collect();
        assert_eq!(flags, vec![false, false, false, true], "epoch {epoch}");
        assert!(l.end_of_dataloader());
    }
    assert_eq!(l.epoch(), 2);
}

#[test]
fn skip_first_batches_skips_within_the_epoch_only() {
    let mut l = ShardedLoader::new(LoaderConfig::new(16, 4, 1), 0).unwrap();
    assert_eq!(l.skip_first_batches(2), 2);
    let rest: Vec<Vec<usize>> = l.epoch_iter().map(|b| b.indices).collect();
    assert_eq!(rest, vec![vec![8, 9, 10, 11], vec![12, 13, 14, 15]]);
    // The next epoch is whole again.
    assert_eq!(l.epoch_iter().count(), 4);
    assert_eq!(l.skip_first_batches(10), 4);
    assert_eq!(l.epoch_iter().count(), 0);
    assert_eq!(l.epoch(), 3);
}

#[test]
fn a_state_saved_after_the_last_batch_resumes_at_the_next_epoch() {
    let config = LoaderConfig {
        shuffle: true,
        seed: 9,
        ..LoaderConfig::new(10, 3, 2)
    };
    let mut l = ShardedLoader::new(config.clone(), 1).unwrap();
    let _ = l.epoch_iter().count();
    let s = l.state();
    assert_eq!((s.epoch, s.batches_consumed), (1, 0));
    let mut r = ShardedLoader::from_state(config, 1, &s).unwrap();
    assert_eq!(r.epoch_iter().next().unwrap().epoch, 1);
}

#[test]
fn a_stopped_iterator_keeps_its_position() {
    let mut l = ShardedLoader::new(LoaderConfig::new(12, 2, 2), 0).unwrap();
    let first: Vec<_> = l.epoch_iter().take(1).map(|b| b.indices).collect();
    let rest: Vec<_> = l.epoch_iter().map(|b| b.indices).collect();
    assert_eq!(first, vec![vec![0, 1]]);
    assert_eq!(rest, vec![vec![4, 5], vec![8, 9]]);
}

#[test]
fn load_state_refuses_a_different_layout() {
    let config = LoaderConfig::new(20, 4, 2);
    let l = ShardedLoader::new(config.clone(), 0).unwrap();
    let state = l.state();
    let mut other = ShardedLoader::new(LoaderConfig::new(20, 4, 4), 0).unwrap();
    let err = other.load_state(&state).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::InvalidConfig);
    assert!(err.to_string().contains("num_processes"), "{err}");

    let mut bad = state.clone();
    bad.batches_consumed = 99;
    let err = ShardedLoader::from_state(config.clone(), 0, &bad).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::Corrupt);
    assert_eq!(
        SamplerState::from_json(b"{").unwrap_err().kind(),
        &ErrorKind::Corrupt
    );
}

#[test]
fn loader_rejects_bad_configurations() {
    assert!(ShardedLoader::new(LoaderConfig::new(10, 2, 2), 2).is_err());
    assert!(ShardedLoader::new(LoaderConfig::new(10, 0, 2), 0).is_err());
    let split = LoaderConfig {
        split_batches: true,
        ..LoaderConfig::new(10, 3, 2)
    };
    assert_eq!(
        ShardedLoader::new(split, 0).unwrap_err().kind(),
        &ErrorKind::InvalidArgument
    );
}

#[test]
fn every_rank_sees_the_same_shuffle() {
    let config = LoaderConfig {
        shuffle: true,
        seed: 1234,
        ..LoaderConfig::new(50, 5, 2)
    };
    let mut a = ShardedLoader::new(config.clone(), 0).unwrap();
    let mut b = ShardedLoader::new(config, 1).unwrap();
    let mut all: Vec<usize> = a
        .epoch_iter()
        .chain(b.epoch_iter())
        .flat_map(|x| x.indices)
        .collect();
    all.sort_unstable();
    assert_eq!(all, (0..50).collect::<Vec<_>>());
}

/// The permutation is part of the checkpoint format: it must never change.
#[test]
fn permutation_is_pinned() {
    assert_eq!(permutation(0, 0, 10), vec![9, 2, 3, 4, 6, 7, 0, 1, 5, 8]);
    assert_eq!(permutation(42, 3, 8), vec![7, 2, 1, 0, 6, 5, 4, 3]);
    let mut s = SeedableSampler::new(10, true, 0);
    assert_eq!(s.indices(), permutation(0, 0, 10));
    s.set_epoch(3);
    assert_eq!(s.indices(), permutation(0, 3, 10));
    assert_eq!(
        SeedableSampler::new(4, false, 0).indices(),
        vec![0, 1, 2, 3]
    );
}

#[test]
fn accumulation_syncs_every_k_and_at_the_end() {
    let mut acc = GradientAccumulator::new(AccumulationConfig::new(4, 2)).unwrap();
    let d: Vec<_> = accumulate(0..10, &mut acc).map(|(_, d)| d).collect();
    let syncs: Vec<usize> = d
        .iter()
        .enumerate()
        .filter(|(_, d)| d.sync_gradients)
        .map(|(i, _)| i + 1)
        .collect();
    assert_eq!(syncs, vec![4, 8, 10]);
    assert!(d
        .iter()
        .all(|d| d.optimizer_step == d.sync_gradients && d.zero_grad == d.sync_gradients));
    assert!(d
        .iter()
        .all(|d| d.all_reduce == d.sync_gradients && d.loss_divisor == 4));
    assert_eq!(d.iter().map(|d| d.scheduler_steps).sum::<usize>(), 6);
}

#[test]
fn accumulation_options() {
    let mut c = AccumulationConfig::new(3, 4);
    c.sync_each_batch = true;
    c.split_batches = true;
    let mut acc = GradientAccumulator::new(c).unwrap();
    let d: Vec<_> = (0..6).map(|i| acc.next_batch(i == 5)).collect();
    assert!(d.iter().all(|d| d.all_reduce));
    assert_eq!(d.iter().filter(|d| d.optimizer_step).count(), 2);
    assert_eq!(d.iter().map(|d| d.scheduler_steps).sum::<usize>(), 2);

    let mut c = AccumulationConfig::new(2, 2);
    c.step_scheduler_with_optimizer = false;
    c.sync_with_dataloader = false;
    let mut acc = GradientAccumulator::new(c).unwrap();
    let d: Vec<_> = (0..3).map(|i| acc.next_batch(i == 2)).collect();
    assert_eq!(
        d.iter().map(|d| d.scheduler_steps).collect::<Vec<_>>(),
        vec![1, 1, 1]
    );
    // Without sync_with_dataloader the end of the loader does not force a step.
    assert_eq!(
        d.iter().map(|d| d.sync_gradients).collect::<Vec<_>>(),
        vec![false, true, false]
    );
    // The counter carries over and is checkpointable.
    assert_eq!(acc.state(), AccumulatorState { step: 3 });
    let mut again = GradientAccumulator::new(c).unwrap();
    again.load_state(acc.state());
    assert!(again.next_batch(false).sync_gradients);

    assert!(GradientAccumulator::new(AccumulationConfig::new(0, 1)).is_err());
}

#[test]
fn dispatcher_pads_the_last_step_from_the_first_batch() {
    // 21 samples, batch 3, 2 ranks: last step is [18, 19, 20].
    let first: Vec<usize> = (0..6).collect();
    let last = [18, 19, 20];
    assert_eq!(
        dispatch_slice(&last, &first, 2, 0, true, false).unwrap(),
        vec![18, 19]
    );
    assert_eq!(
        dispatch_slice(&last, &first, 2, 1, true, false).unwrap(),
        vec![20, 0]
    );
    assert_eq!(
        dispatch_slice(&last, &first, 2, 1, true, true).unwrap(),
        vec![19]
    );
    assert_eq!(
        dispatch_slice(&first, &first, 2, 1, false, false).unwrap(),
        vec![3, 4, 5]
    );
    assert!(dispatch_slice::<usize>(&[], &first, 2, 0, true, false).is_err());
    assert!(dispatch_slice(&first, &first, 2, 2, true, false).is_err());
}

#[test]
fn dispatcher_rejects_unequal_shapes() {
    assert!(check_concat_shapes(&[&[3, 8], &[2, 8], &[1, 8]]).is_ok());
    let err = check_concat_shapes(&[&[3, 8], &[3, 9]]).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::InvalidArgument);
    assert!(
        err.to_string().contains("batch 1 has shape [3, 9]"),
        "{err}"
    );
    assert!(check_concat_shapes(&[&[3, 8], &[3]]).is_err());
}

#[test]
fn rank_states_of_one_moment_agree_and_a_tampered_epoch_is_named() {
    use accel_sharding::check_rank_states;
    for even in [true, false] {
        // 7 batches of 2 on 2 ranks: 4 and 3 batches without even_batches.
        let config = LoaderConfig {
            even_batches: even,
            shuffle: true,
            seed: 3,
            ..LoaderConfig::new(14, 2, 2)
        };
        let mut ls: Vec<ShardedLoader> = (0..2)
            .map(|r| ShardedLoader::new(config.clone(), r).unwrap())
            .collect();
        let check = |ls: &[ShardedLoader]| {
            let states: Vec<SamplerState> = ls.iter().map(ShardedLoader::state).collect();
            check_rank_states(&states).unwrap_or_else(|e| panic!("{states:?}: {e}"));
            let mut tampered = states.clone();
            tampered[1].epoch += 1;
            let e = check_rank_states(&tampered).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::Corrupt);
            assert!(e.to_string().contains("rank 1"), "{e}");
            let mut moved = states.clone();
            moved[0].batches_consumed = (moved[0].batches_consumed + 1) % 3;
            assert!(check_rank_states(&moved).is_err(), "{moved:?}");
        };
        check(&ls);
        // The run: in lock-step, every rank that still has a batch reads one.
        for _epoch in 0..2 {
            let steps = ls.iter().map(ShardedLoader::len).max().unwrap();
            for s in 0..steps {
                for l in &mut ls {
                    if s < l.len() {
                        assert!(l.epoch_iter().next().is_some());
                    }
                }
                check(&ls);
            }
        }
    }
}

/// Read `steps` lock-step steps of the current epoch on every rank.
fn read_steps(loaders: &mut [ShardedLoader], steps: usize, seen: &mut Vec<usize>) {
    for _ in 0..steps {
        for l in loaders.iter_mut() {
            let b = l.epoch_iter().next().expect("a batch");
            seen.extend(b.indices);
        }
    }
}

fn ranks(config: &LoaderConfig, state: Option<&SamplerState>) -> Vec<ShardedLoader> {
    (0..config.num_processes)
        .map(|r| match state {
            Some(s) => ShardedLoader::from_state(config.clone(), r, s).unwrap(),
            None => ShardedLoader::new(config.clone(), r).unwrap(),
        })
        .collect()
}

#[test]
fn a_position_resharded_from_3_to_2_ranks_reads_every_sample_once() {
    let at = |n: usize| LoaderConfig {
        shuffle: true,
        seed: 5,
        ..LoaderConfig::new(96, 4, n)
    };
    // World 3: 8 steps of 12 samples per epoch; stop after 2 steps of
    // epoch 1.
    let mut three = ranks(&at(3), None);
    let mut epoch0 = Vec::new();
    read_steps(&mut three, 8, &mut epoch0);
    let mut epoch1 = Vec::new();
    read_steps(&mut three, 2, &mut epoch1);
    let saved = three[0].state();
    assert_eq!((saved.epoch, saved.samples_consumed()), (1, 24));
    // World 2 continues at sample 24 of epoch 1's order: 72 left, 9 steps.
    let moved = saved.resharded(2);
    assert_eq!((moved.epoch, moved.epoch_offset), (1, 24));
    let mut two = ranks(&at(2), Some(&moved));
    assert_eq!(two[0].len(), 9);
    // And a state taken at world 2 inside that epoch reshards again, to 3.
    read_steps(&mut two, 3, &mut epoch1);
    let again = two[1].state();
    assert_eq!(again.samples_consumed(), 48);
    let json = again.to_json();
    assert_eq!(SamplerState::from_json(&json).unwrap(), again);
    let mut three = ranks(&at(3), Some(&again.resharded(3)));
    while three[0].epoch() == 1 {
        read_steps(&mut three, 1, &mut epoch1);
    }
    for (e, seen) in [(0, &mut epoch0), (1, &mut epoch1)] {
        seen.sort_unstable();
        assert_eq!(*seen, (0..96).collect::<Vec<_>>(), "epoch {e}");
    }
    // The epoch after is whole again, at the new world size.
    assert_eq!(three[0].len(), 8);
    assert_eq!(three[0].state().epoch_offset, 0);
    let mut epoch2 = Vec::new();
    read_steps(&mut three, 8, &mut epoch2);
    epoch2.sort_unstable();
    assert_eq!(epoch2, (0..96).collect::<Vec<_>>());
}

#[test]
fn a_resharded_position_in_the_epochs_order_matches_the_unbroken_order() {
    // The samples after the offset are those the old world would have read
    // next, in the same order: the epoch's permutation does not depend on
    // the world size.
    let config = |n: usize| LoaderConfig {
        shuffle: true,
        seed: 11,
        ..LoaderConfig::new(40, 2, n)
    };
    let mut one = ShardedLoader::new(config(1), 0).unwrap();
    let order: Vec<usize> = one.epoch_iter().flat_map(|b| b.indices).collect();
    let mut four = ranks(&config(4), None);
    let mut seen = Vec::new();
    read_steps(&mut four, 2, &mut seen);
    assert_eq!(seen, order[..16]);
    let two = ranks(&config(2), Some(&four[0].state().resharded(2)));
    let first: Vec<usize> = two
        .into_iter()
        .flat_map(|mut l| l.epoch_iter().next().unwrap().indices)
        .collect();
    assert_eq!(first, order[16..20]);
}
