//! Iterable loaders in `prepare`: sharded (every rank reads the stream) and
//! dispatched (the main process reads and sends), on threads as ranks.

use accel::train::*;
use accel::ErrorKind;

mod common;
use common::{ranks, single, Data};

/// `0..len`, the length known or not; `only_main` streams nothing on other
/// ranks, so a run that does not dispatch would see no data there.
#[derive(Clone)]
struct Stream {
    len: usize,
    known: bool,
    empty: bool,
}

impl IterableDataset for Stream {
    type Item = u64;
    fn iter(&self, epoch: u64) -> Box<dyn Iterator<Item = u64> + Send> {
        let n = if self.empty { 0 } else { self.len as u64 };
        Box::new((0..n).map(move |i| i + 1000 * epoch))
    }
    fn len(&self) -> Option<usize> {
        self.known.then_some(self.len)
    }
}

/// Two epochs: what gather_for_metrics returns, the batch counts, the
/// end flags, the reported length.
fn run(world: usize, len: usize, bs: usize, dispatch: bool, split: bool, drop_last: bool) {
    let out = ranks(world, move |acc| {
        let acc = acc
            .with_training(TrainConfig {
                dispatch_batches: Some(dispatch),
                split_batches: split,
                ..TrainConfig::default()
            })
            .unwrap();
        let data = Stream {
            len,
            known: true,
            empty: dispatch && acc.rank() != 0,
        };
        let mut l = acc
            .prepare_iterable_loader(IterableLoader::new(data, bs).drop_last(drop_last))
            .unwrap();
        assert_eq!(l.is_dispatching(), dispatch);
        let mut epochs = Vec::new();
        for e in 0..2u64 {
            let (mut seen, mut count, mut ends) = (Vec::new(), 0, Vec::new());
            while let Some(b) = l.next_batch().unwrap() {
                assert_eq!(b.epoch, e);
                seen.extend(acc.gather_for_metrics(&b.items, &b).unwrap());
                count += 1;
                ends.push(b.end_of_dataloader);
            }
            epochs.push((seen, count, ends));
        }
        (epochs, l.len())
    });
    let global = if split { bs } else { bs * world };
    let kept = if drop_last {
        len / global * global
    } else {
        len
    };
    for (rank, (epochs, reported)) in out.iter().enumerate() {
        for (e, (seen, count, ends)) in epochs.iter().enumerate() {
            let want: Vec<u64> = (0..kept as u64).map(|i| i + 1000 * e as u64).collect();
            let what = format!("world {world} len {len} bs {bs} dispatch {dispatch} split {split} drop_last {drop_last} rank {rank} epoch {e}");
            assert_eq!(seen, &want, "{what}");
            assert_eq!(
                Some(*count),
                *reported,
                "{what}: len() agrees with what it yields"
            );
            if *count > 0 {
                assert_eq!(ends.iter().filter(|x| **x).count(), 1, "{what}");
                assert!(ends.last().unwrap(), "{what}");
            }
        }
    }
}

#[test]
fn sharded_and_dispatched_streams_give_every_sample_once_per_epoch() {
    for (world, len, bs, split, drop_last) in [
        (2, 11, 2, false, false),
        (2, 12, 2, false, true),
        (3, 10, 2, false, false),
        (3, 7, 3, true, false),
        (2, 1, 2, false, false),
        (2, 0, 2, false, false),
    ] {
        for dispatch in [false, true] {
            run(world, len, bs, dispatch, split, drop_last);
        }
    }
}

#[test]
fn one_process_keeps_the_short_last_batch_of_a_stream() {
    let acc = single();
    let mut l = acc
        .prepare_iterable_loader(IterableLoader::new(
            Stream {
                len: 22,
                known: false,
                empty: false,
            },
            3,
        ))
        .unwrap();
    assert_eq!(l.len(), None, "an unknown length stays unknown");
    let mut last = None;
    while let Some(b) = l.next_batch().unwrap() {
        last = Some(b);
    }
    let last = last.unwrap();
    assert_eq!(
        (last.items, last.remainder, last.end_of_dataloader),
        (vec![21], 0, true)
    );
    // A long stream, and an exact resume on one process.
    let dir = tempfile::tempdir().unwrap();
    let data = Stream {
        len: 20_000,
        known: true,
        empty: false,
    };
    let acc = single();
    let mut l = acc
        .prepare_iterable_loader(IterableLoader::new(data.clone(), 1))
        .unwrap();
    for _ in 0..3 {
        l.next_batch().unwrap().unwrap();
    }
    acc.save_state(dir.path(), &[&l]).unwrap();
    let rest: Vec<u64> = std::iter::from_fn(|| l.next_batch().unwrap())
        .flat_map(|b| b.items)
        .collect();
    assert_eq!(rest, (3..20_000).collect::<Vec<u64>>());
    let fresh = single();
    let mut m = fresh
        .prepare_iterable_loader(IterableLoader::new(data, 1))
        .unwrap();
    fresh.load_state(dir.path(), &mut [&mut m]).unwrap();
    assert_eq!(m.next_batch().unwrap().unwrap().items, vec![3]);
}

#[test]
fn a_stream_position_resumes_exactly_in_both_modes() {
    for dispatch in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let config = TrainConfig {
            dispatch_batches: Some(dispatch),
            ..TrainConfig::default()
        };
        let data = Stream {
            len: 13,
            known: true,
            empty: false,
        };
        let (root, c, d) = (dir.path().to_path_buf(), config.clone(), data.clone());
        let first = ranks(2, move |acc| {
            let acc = acc.with_training(c.clone()).unwrap();
            let mut l = acc
                .prepare_iterable_loader(IterableLoader::new(d.clone(), 2))
                .unwrap();
            for _ in 0..2 {
                l.next_batch().unwrap().unwrap();
            }
            acc.save_state(&root, &[&l]).unwrap();
            let rest: Vec<Vec<u64>> =
                std::iter::from_fn(|| l.next_batch().unwrap().map(|b| b.items)).collect();
            rest
        });
        let root = dir.path().to_path_buf();
        let resumed = ranks(2, move |acc| {
            let acc = acc.with_training(config.clone()).unwrap();
            let mut l = acc
                .prepare_iterable_loader(IterableLoader::new(data.clone(), 2))
                .unwrap();
            acc.load_state(&root, &mut [&mut l]).unwrap();
            let rest: Vec<Vec<u64>> =
                std::iter::from_fn(|| l.next_batch().unwrap().map(|b| b.items)).collect();
            rest
        });
        assert_eq!(first[0].len(), 2, "13 items, 4 per step: 4 steps, 2 left");
        assert_eq!(resumed, first, "dispatch {dispatch}");
    }
}

#[test]
fn refused_configurations_say_why() {
    let e = ranks(2, |acc| {
        let acc = acc
            .with_training(TrainConfig {
                split_batches: true,
                ..TrainConfig::default()
            })
            .unwrap();
        let e = acc
            .prepare_iterable_loader(IterableLoader::new(
                Stream {
                    len: 4,
                    known: true,
                    empty: false,
                },
                1,
            ))
            .unwrap_err();
        acc.wait_for_everyone().unwrap();
        e.kind().clone()
    });
    assert!(e.iter().all(|k| *k == ErrorKind::InvalidArgument));
    let acc = single()
        .with_training(TrainConfig {
            dispatch_batches: Some(true),
            ..TrainConfig::default()
        })
        .unwrap();
    let e = acc
        .prepare_loader(DataLoader::new(Data { len: 4, d: 1 }, 2))
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig);
    assert!(e.to_string().contains("IterableLoader"), "{e}");
}
