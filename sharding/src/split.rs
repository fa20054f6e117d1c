//! `split_between_processes`: each rank's contiguous share of an input
//! (prompts for inference, a list of files, ...), Accelerate's
//! `PartialState.split_between_processes`.
//!
//! # Semantics
//! With `len` items on `N` ranks, rank `r` gets `len / N` items, and the
//! first `len % N` ranks one more, in order, so the shares concatenated in
//! rank order are the input.
//!
//! With padding, every share is topped up to `ceil(len / N)` items with the
//! **last element of the whole input** (Accelerate's rule, from its code and
//! docstring): 7 items on 3 ranks give `[0, 1, 2]`, `[3, 4, 6]`, `[5, 6, 6]`.
//! Gathering the padded shares and dropping the padding recovers the input.
//!
//! Where accel differs from Accelerate: an empty input gives every rank an
//! empty share (Accelerate raises on an empty input with padding), and
//! tuples are not special (a Rust slice of tuples splits like any slice;
//! Accelerate raises on a tuple with padding).

use std::collections::BTreeMap;
use std::ops::Range;

use accel_api::{Error, Result};

/// The index range of rank `rank`'s share of `len` items on `num_processes`
/// ranks: `len / num_processes` each, the first `len % num_processes` ranks
/// one more. An out-of-range rank (or 0 processes) gets an empty range at
/// the end.
pub fn split_range(len: usize, num_processes: usize, rank: usize) -> Range<usize> {
    if num_processes == 0 || rank >= num_processes {
        return len..len;
    }
    let base = len / num_processes;
    let extra = len % num_processes;
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// Rank `rank`'s share of `items`, padded to `ceil(len / num_processes)`
/// items with the last element of `items` when `apply_padding` (see the
/// [module docs](self)).
pub fn split_share<T: Clone>(
    items: &[T],
    num_processes: usize,
    rank: usize,
    apply_padding: bool,
) -> Vec<T> {
    let mut share = items[split_range(items.len(), num_processes, rank)].to_vec();
    if apply_padding {
        if let Some(last) = items.last() {
            share.resize(items.len().div_ceil(num_processes.max(1)), last.clone());
        }
    }
    share
}

/// [`split_share`] for a map of equally long lists (Accelerate's
/// `split_between_processes` on a dict): every value is split alike, so the
/// `i`-th items of all values stay together on one rank.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
/// naming two keys whose lists have different lengths.
pub fn split_map<K: Ord + Clone + std::fmt::Debug, T: Clone>(
    map: &BTreeMap<K, Vec<T>>,
    num_processes: usize,
    rank: usize,
    apply_padding: bool,
) -> Result<BTreeMap<K, Vec<T>>> {
    let mut first: Option<(&K, usize)> = None;
    for (k, v) in map {
        match first {
            None => first = Some((k, v.len())),
            Some((k0, n)) if n != v.len() => {
                return Err(Error::invalid_argument(
                    "split_between_processes",
                    format!(
                        "key {k:?} has {} items but key {k0:?} has {n}: every value of a map is split alike, so all must have the same length",
                        v.len()
                    ),
                )
                .with_fix("give every key the same number of items, or split the lists one by one"))
            }
            Some(_) => {}
        }
    }
    Ok(map
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                split_share(v, num_processes, rank, apply_padding),
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issue_example_pads_with_the_last_element_of_the_input() {
        let items: Vec<u32> = (0..7).collect();
        let shares: Vec<Vec<u32>> = (0..3).map(|r| split_share(&items, 3, r, true)).collect();
        assert_eq!(shares, vec![vec![0, 1, 2], vec![3, 4, 6], vec![5, 6, 6]]);
    }

    #[test]
    fn map_values_split_alike_and_unequal_lengths_are_an_error() {
        let mut m = BTreeMap::new();
        m.insert("a", vec![1, 2, 3]);
        m.insert("b", vec![4, 5, 6]);
        let r1 = split_map(&m, 2, 1, true).unwrap();
        assert_eq!(r1["a"], vec![3, 3]);
        assert_eq!(r1["b"], vec![6, 6]);
        m.insert("c", vec![7]);
        let e = split_map(&m, 2, 0, false).unwrap_err();
        assert!(e.to_string().contains("\"c\""), "{e}");
    }
}
