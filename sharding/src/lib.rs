//! Data sharding and training-loop state machines for accel.
//!
//! Everything here works on sample indices and batches of indices, never on
//! tensors, so any framework can use it, and every function is pure or a
//! small serialisable state machine: the runtime (`accel`'s `Accelerator`)
//! does the communication, this crate decides what each rank reads and when
//! it steps.
//!
//! | piece | what it does |
//! |---|---|
//! | [`shard_batches`] | Accelerate's `BatchSamplerShard`: round-robin batches, `even_batches`, `split_batches`, `drop_last`, variable-size batches |
//! | [`shard_iterable`] | Accelerate's `IterableDatasetShard` for streams of unknown length |
//! | [`dispatch_slice`], [`dispatch_steps`], [`check_concat_shapes`] | dispatcher mode: what each rank keeps of the batch the main process read |
//! | [`SeedableSampler`], [`permutation`] | data order from `(seed, epoch)`, identical on every rank and stable across platforms and releases |
//! | [`ShardedLoader`], [`SamplerState`] | one rank's loader with an exact, serialisable position: `skip_first_batches`, mid-epoch resume, `end_of_dataloader`, `remainder` |
//! | [`split_share`], [`split_map`] | `split_between_processes`: each rank's contiguous share of a list or of a map of lists, with Accelerate's padding |
//! | [`gather_for_metrics`], [`remainder_for_batches`] | drop the duplicated tail of the last gathered step |
//! | [`GradientAccumulator`], [`accumulate()`] | accumulation cadence: all-reduce, optimizer, zero-grad and scheduler decisions per batch |
//! | [`placement`](mod@placement) | how a tensor lies on a device mesh (replicated, sharded along a dimension, partial) and what each rank holds; box intersections for resharding |
//! | [`ShardPlan`], [`WrapPolicy`], [`Stage`] | parameter sharding (ZeRO): units of parameters padded to a multiple of the world size, each rank's slice of them |
//! | [`CheckpointWriter`], [`CheckpointDir`], [`verify_checkpoint`] | atomic checkpoint directories with a checksummed manifest, `checkpoint_N` naming, pruning by number |
//! | [`swap`], [`recover_swap`] | replacing a folder so that a kill at any instant leaves the old or the new one (one `RENAME_EXCHANGE`, or two renames with recovery) |
//! | [`reference`](mod@reference) | obviously-correct oracles for all of the above, for tests and the conformance suite |
//!
//! # Where accel differs from Accelerate, and why
//! - **Shuffle order.** The permutation comes from a ChaCha8 generator and a
//!   Fisher–Yates shuffle implemented in this crate ([`rng`]), keyed by the
//!   seed with the epoch as stream id, not from PyTorch's generator seeded
//!   with `seed + epoch`: the order must not depend on a framework or a crate
//!   version, and `(seed, epoch)` pairs must not collide.
//! - **Lengths.** [`shard_len`] is exact; Accelerate's `len()` over-counts
//!   with `split_batches` without `even_batches` when the short last batch
//!   does not reach every rank.
//! - **Remainder.** [`LoaderConfig::remainder`] is 0 whenever no sample is
//!   duplicated: without `even_batches`, with `drop_last`, or on one process
//!   (the loader is then not sharded at all, as in Accelerate). Accelerate
//!   reports -1 ("nothing to trim") with `drop_last`, and `len %
//!   total_batch_size` without `even_batches`, which truncates a full last
//!   step on ranks that finish early. After `skip_first_batches` Accelerate
//!   reports -1 and its `gather_for_metrics` keeps the duplicated tail;
//!   accel's remainder stays exact. For variable-size batches
//!   [`remainder_for_batches`] gives the exact count where Accelerate has
//!   none and keeps the duplicates.
//! - **Iterable `split_batches` with batch size 1 on several processes.**
//!   Accelerate yields nothing; accel refuses it ([`shard_iterable`] checks
//!   that the world size divides the batch size).
//! - **`split_between_processes`** ([`split_share`]) pads with the last
//!   element of the whole input, as Accelerate does; on an empty input it
//!   gives empty shares, and a slice of tuples splits like any slice
//!   (Accelerate raises in both cases).
//! - **Resume.** [`SamplerState`] carries the epoch and seed, so a run that
//!   stopped in epoch 3 resumes in epoch 3's order (Accelerate issue 2016),
//!   and a state saved after the last batch of an epoch resumes at the start
//!   of the next one.
//! - **Iterable streams.** Each [`IterableChunk`] says how many items of its
//!   step are real, so gather-for-metrics is exact on streams too (Accelerate
//!   has no remainder for them).
//! - **Checkpoint pruning** happens after the new checkpoint is durable
//!   ([`CheckpointDir::prune`]); Accelerate prunes before writing, so a crash
//!   mid-save can leave fewer checkpoints than the limit.
//! - **Malformed input.** A short batch in the middle of a fixed-size
//!   sequence is passed through as if full, where Accelerate silently drops
//!   that whole round.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accumulate;
pub mod checkpoint;
pub mod dispatch;
pub mod iterable;
pub mod loader;
pub mod metrics;
pub mod params;
pub mod placement;
pub mod reference;
pub mod rng;
pub mod sampler;
pub mod shard;
pub mod split;
pub mod swap;
pub mod tp_plan;

pub use accumulate::{
    accumulate, AccumulationConfig, AccumulatorState, GradientAccumulator, StepDecision,
};
pub use checkpoint::{
    parse_checkpoint_name, read_manifest, read_verified, sha256_hex, temp_path_for,
    verify_checkpoint, write_file_synced, CheckpointDir, CheckpointWriter, FileEntry, Manifest,
    MANIFEST_FILE,
};
pub use dispatch::{check_concat_shapes, dispatch_slice, dispatch_steps};
pub use iterable::{iterable_len, shard_iterable, IterableChunk, IterableShard};
pub use loader::{
    check_rank_states, EpochIter, LoaderBatch, LoaderConfig, SamplerState, ShardedLoader,
};
pub use metrics::{gather_for_metrics, remainder_for_batches};
pub use params::{ShardPlan, Slot, Stage, Unit, WrapPolicy, SHARDING_ENV};
pub use rng::{permutation, ChaCha8};
pub use sampler::{batch_indices, SeedableSampler};
pub use shard::{
    shard_batches, shard_len, shard_len_variable, BatchLayout, BatchShard, ShardOptions,
};
pub use split::{split_map, split_range, split_share};
pub use swap::recover_swap;
#[doc(hidden)]
pub use swap::{set_one_step_swap, set_swap_hook, SwapStep};
