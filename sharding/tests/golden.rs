//! Accelerate's data-loader golden cases: 2 processes, dataset lengths
//! 24/21/22/20 (and the tiny 2), every combination of drop_last,
//! split_batches and even_batches, plus variable-size batch samplers.
//!
//! The expected shards are worked out by hand from the rules in the crate
//! docs: batches go round-robin; a final round is dropped with drop_last,
//! topped up cyclically from the first samples with even_batches, or left
//! uneven otherwise; split mode cuts each batch into two halves.

use accel_sharding::reference::global_batches;
use accel_sharding::{shard_batches, shard_len, shard_len_variable, BatchLayout, ShardOptions};

type Shards = Vec<Vec<Vec<usize>>>;

/// Run both ranks and check the batches and the exact lengths.
fn check(len: usize, bs: usize, drop_last: bool, split: bool, even: bool, expected: Shards) {
    let layout = BatchLayout::fixed(bs, drop_last);
    for (rank, want) in expected.iter().enumerate() {
        let opts = ShardOptions::new(2, rank)
            .unwrap()
            .split_batches(split)
            .even_batches(even);
        let got: Vec<Vec<usize>> = shard_batches(global_batches(len, bs, drop_last), layout, opts)
            .unwrap()
            .collect();
        assert_eq!(
            &got, want,
            "len {len} bs {bs} drop_last {drop_last} split {split} even {even} rank {rank}"
        );
        assert_eq!(
            shard_len(len, layout, opts).unwrap(),
            want.len(),
            "shard_len for rank {rank}"
        );
    }
}

/// `[a, a+1, ..., b-1]`
fn r(a: usize, b: usize) -> Vec<usize> {
    (a..b).collect()
}

/// Batches of 3 starting at each of `starts`.
fn threes(starts: &[usize]) -> Vec<Vec<usize>> {
    starts.iter().map(|&s| r(s, s + 3)).collect()
}

/// Batches of 2 starting at each of `starts`.
fn twos(starts: &[usize]) -> Vec<Vec<usize>> {
    starts.iter().map(|&s| r(s, s + 2)).collect()
}

fn with(mut v: Vec<Vec<usize>>, extra: Vec<usize>) -> Vec<Vec<usize>> {
    v.push(extra);
    v
}

// ---- no split, batch size 3: rank 0 takes batches 0, 2, 4, ...; rank 1 takes 1, 3, 5, ...

#[test]
fn no_split_24_is_a_round_multiple() {
    // 8 full batches, 4 full rounds: nothing to top up or drop.
    let e = vec![threes(&[0, 6, 12, 18]), threes(&[3, 9, 15, 21])];
    for drop_last in [false, true] {
        for even in [false, true] {
            check(24, 3, drop_last, false, even, e.clone());
        }
    }
}

#[test]
fn no_split_21_seven_full_batches() {
    // Batch 6 = [18,19,20] is alone in the last round.
    let base = vec![threes(&[0, 6, 12]), threes(&[3, 9, 15])];
    // even: rank 1 gets a fresh batch from the start of the order.
    check(
        21,
        3,
        false,
        false,
        true,
        vec![
            with(base[0].clone(), r(18, 21)),
            with(base[1].clone(), r(0, 3)),
        ],
    );
    // uneven: rank 1 simply has one batch less.
    check(
        21,
        3,
        false,
        false,
        false,
        vec![with(base[0].clone(), r(18, 21)), base[1].clone()],
    );
    // drop_last: the incomplete round goes, though its batch is full.
    check(21, 3, true, false, true, base.clone());
    check(21, 3, true, false, false, base);
}

#[test]
fn no_split_22_short_batch_completes_the_round() {
    // Batches: 7 full + [21]; the last round is [18,19,20] and [21].
    let base = vec![threes(&[0, 6, 12]), threes(&[3, 9, 15])];
    // even: [21] is topped up with the first two samples.
    check(
        22,
        3,
        false,
        false,
        true,
        vec![
            with(base[0].clone(), r(18, 21)),
            with(base[1].clone(), vec![21, 0, 1]),
        ],
    );
    check(
        22,
        3,
        false,
        false,
        false,
        vec![
            with(base[0].clone(), r(18, 21)),
            with(base[1].clone(), vec![21]),
        ],
    );
    // drop_last: [21] is never produced, so [18,19,20] is alone and dropped.
    check(22, 3, true, false, true, base.clone());
    check(22, 3, true, false, false, base);
}

#[test]
fn no_split_20_short_batch_alone_in_its_round() {
    // Batches: 6 full + [18,19]; the last round holds only [18,19].
    let base = vec![threes(&[0, 6, 12]), threes(&[3, 9, 15])];
    // even: [18,19] takes sample 0, then rank 1 gets the next three: 1,2,3.
    check(
        20,
        3,
        false,
        false,
        true,
        vec![
            with(base[0].clone(), vec![18, 19, 0]),
            with(base[1].clone(), r(1, 4)),
        ],
    );
    check(
        20,
        3,
        false,
        false,
        false,
        vec![with(base[0].clone(), vec![18, 19]), base[1].clone()],
    );
    check(20, 3, true, false, true, base.clone());
    check(20, 3, true, false, false, base);
}

#[test]
fn no_split_tiny_dataset_cycles() {
    // 2 samples, 6 needed: the order 0,1 repeats.
    check(
        2,
        3,
        false,
        false,
        true,
        vec![vec![vec![0, 1, 0]], vec![vec![1, 0, 1]]],
    );
    check(2, 3, false, false, false, vec![vec![vec![0, 1]], vec![]]);
    check(2, 3, true, false, true, vec![vec![], vec![]]);
    check(2, 3, true, false, false, vec![vec![], vec![]]);
}

// ---- split, batch size 4: every batch is cut into halves of 2.

#[test]
fn split_24() {
    let e = vec![twos(&[0, 4, 8, 12, 16, 20]), twos(&[2, 6, 10, 14, 18, 22])];
    for drop_last in [false, true] {
        for even in [false, true] {
            check(24, 4, drop_last, true, even, e.clone());
        }
    }
}

#[test]
fn split_22() {
    let base = vec![twos(&[0, 4, 8, 12, 16]), twos(&[2, 6, 10, 14, 18])];
    // Last batch [20,21] topped up to [20,21,0,1].
    check(
        22,
        4,
        false,
        true,
        true,
        vec![
            with(base[0].clone(), r(20, 22)),
            with(base[1].clone(), r(0, 2)),
        ],
    );
    // Uneven: rank 1's half of [20,21] is empty, so it gets nothing.
    check(
        22,
        4,
        false,
        true,
        false,
        vec![with(base[0].clone(), r(20, 22)), base[1].clone()],
    );
    check(22, 4, true, true, true, base.clone());
    check(22, 4, true, true, false, base);
}

#[test]
fn split_21() {
    let base = vec![twos(&[0, 4, 8, 12, 16]), twos(&[2, 6, 10, 14, 18])];
    // [20] becomes [20,0,1,2].
    check(
        21,
        4,
        false,
        true,
        true,
        vec![
            with(base[0].clone(), vec![20, 0]),
            with(base[1].clone(), vec![1, 2]),
        ],
    );
    check(
        21,
        4,
        false,
        true,
        false,
        vec![with(base[0].clone(), vec![20]), base[1].clone()],
    );
    check(21, 4, true, true, true, base.clone());
    check(21, 4, true, true, false, base);
}

#[test]
fn split_20_and_tiny() {
    let e = vec![twos(&[0, 4, 8, 12, 16]), twos(&[2, 6, 10, 14, 18])];
    for drop_last in [false, true] {
        for even in [false, true] {
            check(20, 4, drop_last, true, even, e.clone());
        }
    }
    // [0,1] becomes [0,1,0,1].
    check(
        2,
        4,
        false,
        true,
        true,
        vec![vec![vec![0, 1]], vec![vec![0, 1]]],
    );
    check(2, 4, false, true, false, vec![vec![vec![0, 1]], vec![]]);
    check(2, 4, true, true, true, vec![vec![], vec![]]);
    check(2, 4, true, true, false, vec![vec![], vec![]]);
}

#[test]
fn split_needs_a_divisible_batch_size() {
    let opts = ShardOptions::new(2, 0).unwrap().split_batches(true);
    let err = shard_batches(
        global_batches(21, 3, false),
        BatchLayout::fixed(3, false),
        opts,
    )
    .unwrap_err();
    assert!(err.to_string().contains("round multiple"), "{err}");
    let err = shard_batches(vec![vec![0, 1]], BatchLayout::variable(false), opts).unwrap_err();
    assert!(err.to_string().contains("split_batches"), "{err}");
}

// ---- variable-size batch samplers

fn var_shards(batches: &[Vec<usize>], n: usize, even: bool, drop_last: bool) -> Shards {
    (0..n)
        .map(|rank| {
            let opts = ShardOptions::new(n, rank).unwrap().even_batches(even);
            let got: Vec<_> =
                shard_batches(batches.to_vec(), BatchLayout::variable(drop_last), opts)
                    .unwrap()
                    .collect();
            assert_eq!(
                shard_len_variable(batches.len(), drop_last, opts).unwrap(),
                got.len()
            );
            got
        })
        .collect()
}

#[test]
fn variable_batches_uneven() {
    let b = vec![
        vec![0, 1, 2],
        vec![3, 4],
        vec![5, 6, 7, 8],
        vec![9, 10, 11],
        vec![12, 13],
    ];
    assert_eq!(
        var_shards(&b, 2, false, false),
        vec![
            vec![vec![0, 1, 2], vec![5, 6, 7, 8], vec![12, 13]],
            vec![vec![3, 4], vec![9, 10, 11]]
        ]
    );
}

#[test]
fn variable_batches_even_pads_with_whole_batches_from_the_start() {
    let four = vec![vec![0, 1, 2], vec![3, 4], vec![5, 6, 7, 8], vec![9, 10, 11]];
    assert_eq!(
        var_shards(&four, 2, true, false),
        vec![
            vec![vec![0, 1, 2], vec![5, 6, 7, 8]],
            vec![vec![3, 4], vec![9, 10, 11]]
        ]
    );
    let five = with(four.clone(), vec![12, 13]);
    assert_eq!(
        var_shards(&five, 2, true, false),
        vec![
            vec![vec![0, 1, 2], vec![5, 6, 7, 8], vec![12, 13]],
            vec![vec![3, 4], vec![9, 10, 11], vec![0, 1, 2]]
        ]
    );
    // One batch for two and for three ranks: it is repeated.
    assert_eq!(
        var_shards(&[vec![0, 1, 2]], 2, true, false),
        vec![vec![vec![0, 1, 2]]; 2]
    );
    assert_eq!(
        var_shards(&[vec![0, 1, 2]], 3, true, false),
        vec![vec![vec![0, 1, 2]]; 3]
    );
    // drop_last discards the incomplete round.
    assert_eq!(
        var_shards(&five, 2, true, true),
        vec![
            vec![vec![0, 1, 2], vec![5, 6, 7, 8]],
            vec![vec![3, 4], vec![9, 10, 11]]
        ]
    );
}

#[test]
fn variable_batches_three_ranks() {
    let six = vec![
        vec![0],
        vec![1, 2],
        vec![3, 4, 5],
        vec![6],
        vec![7, 8],
        vec![9, 10, 11],
    ];
    assert_eq!(
        var_shards(&six, 3, true, false),
        vec![
            vec![vec![0], vec![6]],
            vec![vec![1, 2], vec![7, 8]],
            vec![vec![3, 4, 5], vec![9, 10, 11]]
        ]
    );
    let seven = with(six, vec![12, 13]);
    // Padding continues with batch 0 then batch 1 of the sequence.
    assert_eq!(
        var_shards(&seven, 3, true, false),
        vec![
            vec![vec![0], vec![6], vec![12, 13]],
            vec![vec![1, 2], vec![7, 8], vec![0]],
            vec![vec![3, 4, 5], vec![9, 10, 11], vec![1, 2]]
        ]
    );
}
