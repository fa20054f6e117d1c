//! Dispatcher mode: the main process reads, every rank gets a slice.
//!
//! The main process reads one global batch per step (`N` loader batches
//! concatenated, or one loader batch with `split_batches`), the communicator
//! broadcasts it, and rank `r` keeps the `r`-th of `N` equal contiguous
//! slices. The communication lives in the runtime; this module gives the
//! pure parts: which items a rank keeps, how loader batches group into
//! steps, and the shape check that makes concatenation safe.

use accel_api::{Error, Result};

/// The items rank `rank` keeps from a broadcast global batch.
///
/// # Behavior
/// Each rank gets `len / N` items. On the last step, when the global batch
/// does not divide evenly and `drop_last` is off, every rank gets one more
/// item and the missing ones are taken cyclically from `first`, the first
/// global batch of the epoch (Accelerate pads from it too), so the real items
/// are a prefix of the concatenated slices. With `drop_last` the items past
/// `N * (len / N)` are not handed out.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
/// for a rank out of range, an empty global batch, or padding needed with
/// an empty `first`.
pub fn dispatch_slice<T: Clone>(
    global: &[T],
    first: &[T],
    num_processes: usize,
    rank: usize,
    is_last: bool,
    drop_last: bool,
) -> Result<Vec<T>> {
    if num_processes == 0 || rank >= num_processes {
        return Err(Error::invalid_argument(
            "dispatch",
            format!("rank {rank} is out of range for {num_processes} processes"),
        ));
    }
    if global.is_empty() {
        return Err(Error::invalid_argument(
            "dispatch",
            "the global batch is empty: the main process read no data for this step",
        ));
    }
    let mut per = global.len() / num_processes;
    let pad = is_last && !drop_last && !global.len().is_multiple_of(num_processes);
    if !pad {
        return Ok(global[rank * per..(rank + 1) * per].to_vec());
    }
    if first.is_empty() {
        return Err(Error::invalid_argument(
            "dispatch",
            "padding the last step needs the first global batch",
        ));
    }
    per += 1;
    let item = |i: usize| -> T {
        if i < global.len() {
            global[i].clone()
        } else {
            first[(i - global.len()) % first.len()].clone()
        }
    };
    Ok((rank * per..(rank + 1) * per).map(item).collect())
}

/// Group loader batches into dispatcher steps.
///
/// # Behavior
/// With `split_batches` every loader batch is one step. Otherwise `N`
/// consecutive loader batches are concatenated into one step; an incomplete
/// final group is kept, unless `drop_last` (then it is dropped, as the
/// loader would have dropped the samples anyway).
pub fn dispatch_steps<T: Clone>(
    batches: &[Vec<T>],
    num_processes: usize,
    split_batches: bool,
    drop_last: bool,
) -> Vec<Vec<T>> {
    let group = if split_batches {
        1
    } else {
        num_processes.max(1)
    };
    batches
        .chunks(group)
        .filter(|c| !drop_last || c.len() == group)
        .map(|c| c.concat())
        .collect()
}

/// Check that batches can be concatenated along their first dimension.
///
/// # Behavior
/// Every shape must have at least one dimension and all must agree on every
/// dimension but the first.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
/// naming the first batch whose shape differs from batch 0, with both shapes
/// and the fix (`split_batches`, or each rank reading its own batches).
pub fn check_concat_shapes(shapes: &[&[usize]]) -> Result<()> {
    let Some(first) = shapes.first() else {
        return Ok(());
    };
    for (i, s) in shapes.iter().enumerate() {
        if s.is_empty() || s.len() != first.len() || s[1..] != first[1..] {
            return Err(Error::invalid_argument(
                "dispatch",
                format!(
                    "batch {i} has shape {s:?} but batch 0 has shape {first:?}: dispatched batches are concatenated along dimension 0 and must agree on every other dimension"
                ),
            )
            .with_fix("pad batches to one shape, set split_batches = true, or turn dispatch_batches off so each rank reads its own batches"));
        }
    }
    Ok(())
}
