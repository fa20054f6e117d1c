//! A sharded map-style loader with an exact, serialisable position.
//!
//! [`ShardedLoader`] ties together the [`SeedableSampler`], fixed-size
//! batching and [`shard_batches`] for one rank, and keeps a cursor `(epoch,
//! batches consumed)`. [`ShardedLoader::state`] captures the cursor as a
//! [`SamplerState`]; a loader restored from it continues with exactly the
//! batches that had not been read, in the same order, including when the
//! run stopped in a later epoch (Accelerate issue 2016: a loader resumed with
//! `skip_first_batches` replays epoch 0's order).

use accel_api::{Error, ErrorKind, Result};
use serde::{Deserialize, Serialize};

use crate::sampler::{batch_indices, SeedableSampler};
use crate::shard::{shard_batches, shard_len, validate, BatchLayout, ShardOptions};

/// Everything that decides which samples each rank reads, identical on
/// every rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderConfig {
    /// Number of samples in the dataset.
    pub dataset_len: usize,
    /// The batch size the user gave the loader: per process, or the global
    /// batch that is split when `split_batches` is set.
    pub batch_size: usize,
    /// Drop incomplete data at the end of an epoch instead of topping up.
    pub drop_last: bool,
    /// Shuffle with [`permutation`](crate::permutation)`(seed, epoch)`.
    pub shuffle: bool,
    /// Seed of the shuffle, shared by all ranks.
    pub seed: u64,
    /// World size.
    pub num_processes: usize,
    /// See [`ShardOptions::split_batches`].
    pub split_batches: bool,
    /// See [`ShardOptions::even_batches`].
    pub even_batches: bool,
}

impl LoaderConfig {
    /// A sequential (unshuffled) configuration with Accelerate's defaults
    /// (`drop_last = false`, `split_batches = false`, `even_batches = true`).
    pub fn new(dataset_len: usize, batch_size: usize, num_processes: usize) -> LoaderConfig {
        LoaderConfig {
            dataset_len,
            batch_size,
            drop_last: false,
            shuffle: false,
            seed: 0,
            num_processes,
            split_batches: false,
            even_batches: true,
        }
    }

    /// The batch layout the batcher produces.
    pub fn layout(&self) -> BatchLayout {
        BatchLayout::fixed(self.batch_size, self.drop_last)
    }

    /// The sharding options for `rank`.
    pub fn shard_options(&self, rank: usize) -> ShardOptions {
        ShardOptions {
            num_processes: self.num_processes,
            process_index: rank,
            split_batches: self.split_batches,
            even_batches: self.even_batches,
        }
    }

    /// Samples consumed by all ranks together in one step: `batch_size` with
    /// `split_batches`, `batch_size * num_processes` otherwise.
    pub fn total_batch_size(&self) -> usize {
        if self.split_batches {
            self.batch_size
        } else {
            self.batch_size * self.num_processes
        }
    }

    /// Real (non-duplicate) samples in the last gathered step of an epoch
    /// when that step contains duplicates; 0 when it holds none.
    ///
    /// # Behavior
    /// Equals Accelerate's `remainder` (`dataset_len % total_batch_size`)
    /// with `even_batches`, without `drop_last` and on more than one process.
    /// With one process nothing is topped up (see
    /// [`is_sharded`](Self::is_sharded)), so it is 0 there. Without `even_batches`
    /// or with `drop_last` no sample is ever duplicated, so it is 0 there
    /// (Accelerate still reports the modulo without `even_batches`, which
    /// truncates a full last step on the ranks that finish early).
    pub fn remainder(&self) -> usize {
        if self.drop_last || !self.even_batches || !self.is_sharded() {
            0
        } else {
            self.dataset_len % self.total_batch_size()
        }
    }

    /// `false` with one process: the loader is not sharded at all, as in
    /// Accelerate's `prepare_data_loader`, so the last batch of an epoch
    /// stays short and no sample is read twice (the batch-sampler shard
    /// itself would top it up under `even_batches`).
    pub fn is_sharded(&self) -> bool {
        self.num_processes > 1
    }

    /// Check the configuration for `rank`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] as [`validate`].
    pub fn validate(&self, rank: usize) -> Result<()> {
        validate(&self.layout(), &self.shard_options(rank))
    }
}

/// One batch handed out by a [`ShardedLoader`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoaderBatch {
    /// Sample indices for this rank.
    pub indices: Vec<usize>,
    /// The epoch the batch belongs to.
    pub epoch: u64,
    /// Position of the batch among this rank's batches of the epoch.
    pub index: usize,
    /// This is the last batch of the epoch for this rank (Accelerate's
    /// `end_of_dataloader`): accumulation syncs here and
    /// gather-for-metrics trims here.
    pub end_of_dataloader: bool,
}

/// The serialisable position of a [`ShardedLoader`]: where a resumed run
/// continues.
///
/// # Behavior
/// `(epoch, batches_consumed)` names the next batch to read. After the last
/// batch of an epoch is handed out the position is already `(epoch + 1, 0)`,
/// so a state saved at the end of an epoch resumes at the start of the next.
/// The remaining fields pin the configuration: restoring into a loader whose
/// data layout differs is refused. The state is per rank; with
/// `even_batches` or `drop_last` it is identical on every rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// Format version, currently 1.
    pub version: u32,
    /// Epoch of the next batch.
    pub epoch: u64,
    /// The shuffle seed in use (restored into the loader).
    pub seed: u64,
    /// Batches of `epoch` this rank has already read.
    pub batches_consumed: usize,
    /// Dataset length the position refers to.
    pub dataset_len: usize,
    /// Batch size the position refers to.
    pub batch_size: usize,
    /// World size the position refers to.
    pub num_processes: usize,
    /// `drop_last` in force.
    pub drop_last: bool,
    /// `shuffle` in force.
    pub shuffle: bool,
    /// `split_batches` in force.
    pub split_batches: bool,
    /// `even_batches` in force.
    pub even_batches: bool,
    /// Samples of `epoch`'s order read before the world size changed
    /// (0 unless the run was resumed at another world size inside this
    /// epoch): `batches_consumed` counts from there. See
    /// [`SamplerState::resharded`].
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch_offset: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl SamplerState {
    /// Samples of the current epoch that every rank together has read:
    /// the offset plus the full steps consumed since.
    ///
    /// # Behavior
    /// Exact while the epoch is not over: the ranks read in lock-step, and
    /// every step before the last one of an epoch is a full global batch
    /// (a position taken after the last step has already rolled over to
    /// the next epoch). Rank 0 reads the first batch of every step, so its
    /// state is the one to ask.
    pub fn samples_consumed(&self) -> usize {
        let total = if self.split_batches {
            self.batch_size
        } else {
            self.batch_size * self.num_processes
        };
        (self.epoch_offset + self.batches_consumed * total).min(self.dataset_len)
    }

    /// This position (rank 0's, taken at `num_processes` ranks) for a run
    /// of `num_processes` ranks: the same epoch, continuing at the first
    /// sample not read yet, so that no sample of the epoch is skipped or
    /// read twice (within the limits of [`samples_consumed`](Self::samples_consumed);
    /// the end of the epoch is topped up or dropped as at any world size).
    pub fn resharded(&self, num_processes: usize) -> SamplerState {
        SamplerState {
            epoch_offset: self.samples_consumed(),
            batches_consumed: 0,
            num_processes,
            ..self.clone()
        }
    }

    /// The samples left in the epoch after the offset.
    fn epoch_len(&self) -> usize {
        self.dataset_len.saturating_sub(self.epoch_offset)
    }

    /// The state as JSON bytes.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec_pretty(self).expect("SamplerState serialises")
    }

    /// Parse a state written by [`to_json`](Self::to_json).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when the bytes are not a valid state.
    pub fn from_json(bytes: &[u8]) -> Result<SamplerState> {
        serde_json::from_slice(bytes).map_err(|e| {
            Error::new(
                ErrorKind::Corrupt,
                format!("sampler state is not valid: {e}"),
            )
        })
    }
}

/// One rank's view of a sharded, seedable, resumable map-style loader.
///
/// # Behavior
/// Each epoch: the [`SeedableSampler`] order for the epoch, cut into batches
/// of `batch_size` (PyTorch `BatchSampler`), sharded with
/// [`shard_batches`]. [`epoch_iter`](Self::epoch_iter) hands out the
/// remaining batches of the current epoch and advances the cursor; dropping
/// the iterator early keeps the position, so the next call continues where it
/// stopped.
#[derive(Clone, Debug)]
pub struct ShardedLoader {
    config: LoaderConfig,
    rank: usize,
    epoch: u64,
    consumed: usize,
    len: usize,
    end_of_dataloader: bool,
    cache: Option<(u64, Vec<Vec<usize>>)>,
    /// `(epoch, offset, batches)`: the epoch resumed at another world size
    /// reads its order from `offset`, in `batches` batches for this rank.
    resumed: Option<(u64, usize, usize)>,
}

impl ShardedLoader {
    /// A loader for `rank` at epoch 0, position 0.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `rank` is out of range, the batch
    /// size is 0, or `split_batches` is set with a batch size the world size
    /// does not divide.
    pub fn new(config: LoaderConfig, rank: usize) -> Result<ShardedLoader> {
        config.validate(rank)?;
        let len = shard_len(
            config.dataset_len,
            config.layout(),
            config.shard_options(rank),
        )?;
        Ok(ShardedLoader {
            config,
            rank,
            epoch: 0,
            consumed: 0,
            len,
            end_of_dataloader: false,
            cache: None,
            resumed: None,
        })
    }

    /// A loader restored at `state`.
    ///
    /// # Errors
    /// As [`new`](Self::new) and [`load_state`](Self::load_state).
    pub fn from_state(
        config: LoaderConfig,
        rank: usize,
        state: &SamplerState,
    ) -> Result<ShardedLoader> {
        let mut l = ShardedLoader::new(config, rank)?;
        l.load_state(state)?;
        Ok(l)
    }

    /// The configuration (with the seed of the last loaded state).
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// This loader's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Batches this rank reads per epoch (in the current epoch, when it
    /// was resumed at another world size: the batches of its rest).
    pub fn len(&self) -> usize {
        self.len_of(self.epoch)
    }

    /// `true` when an epoch has no batch for this rank.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn len_of(&self, epoch: u64) -> usize {
        match self.resumed {
            Some((e, _, n)) if e == epoch => n,
            _ => self.len,
        }
    }

    fn offset_of(&self, epoch: u64) -> usize {
        match self.resumed {
            Some((e, o, _)) if e == epoch => o,
            _ => 0,
        }
    }

    /// The epoch of the next batch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches of the current epoch already read.
    pub fn batches_consumed(&self) -> usize {
        self.consumed
    }

    /// Whether the batch handed out last was the last of its epoch. Reset
    /// when the next batch is handed out.
    pub fn end_of_dataloader(&self) -> bool {
        self.end_of_dataloader
    }

    /// See [`LoaderConfig::remainder`].
    pub fn remainder(&self) -> usize {
        self.config.remainder()
    }

    /// Jump to the start of `epoch` (PyTorch's `set_epoch`).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.consumed = 0;
        self.end_of_dataloader = false;
        if self.resumed.take().is_some() {
            self.cache = None;
        }
    }

    /// Skip the next `n` batches of the current epoch (Accelerate's
    /// `skip_first_batches` on a fresh epoch). Never crosses into the next
    /// epoch; returns how many were skipped.
    pub fn skip_first_batches(&mut self, n: usize) -> usize {
        let k = n.min(self.len() - self.consumed);
        self.consumed += k;
        k
    }

    /// This rank's batches of `epoch`, from its start.
    pub fn epoch_batches(&self, epoch: u64) -> Vec<Vec<usize>> {
        let sampler = SeedableSampler {
            len: self.config.dataset_len,
            shuffle: self.config.shuffle,
            seed: self.config.seed,
            epoch,
        };
        let order = sampler.indices();
        let order = &order[self.offset_of(epoch).min(order.len())..];
        let global = batch_indices(order, self.config.batch_size, self.config.drop_last);
        if !self.config.is_sharded() {
            return global;
        }
        shard_batches(
            global,
            self.config.layout(),
            self.config.shard_options(self.rank),
        )
        .map(Iterator::collect)
        .unwrap_or_default()
    }

    /// The current position.
    pub fn state(&self) -> SamplerState {
        SamplerState {
            version: 1,
            epoch: self.epoch,
            seed: self.config.seed,
            batches_consumed: self.consumed,
            dataset_len: self.config.dataset_len,
            batch_size: self.config.batch_size,
            num_processes: self.config.num_processes,
            drop_last: self.config.drop_last,
            shuffle: self.config.shuffle,
            split_batches: self.config.split_batches,
            even_batches: self.config.even_batches,
            epoch_offset: self.offset_of(self.epoch),
        }
    }

    /// Move to `state`: the next batch handed out is the one that followed
    /// when the state was taken. The state's seed replaces the configured
    /// one.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the field when the state was taken
    /// with a different dataset length, batch size, world size or flag;
    /// [`ErrorKind::Corrupt`] for an unknown version or a position past the
    /// end of the epoch.
    pub fn load_state(&mut self, state: &SamplerState) -> Result<()> {
        if state.version != 1 {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "sampler state version {} is not supported (expected 1)",
                    state.version
                ),
            ));
        }
        let c = &self.config;
        // (field, saved, now)
        let field = |name, saved: &dyn std::fmt::Display, now: &dyn std::fmt::Display| {
            (name, saved.to_string(), now.to_string())
        };
        let checks: [(&str, String, String); 7] = [
            field("dataset_len", &state.dataset_len, &c.dataset_len),
            field("batch_size", &state.batch_size, &c.batch_size),
            field("num_processes", &state.num_processes, &c.num_processes),
            field("drop_last", &state.drop_last, &c.drop_last),
            field("shuffle", &state.shuffle, &c.shuffle),
            field("split_batches", &state.split_batches, &c.split_batches),
            field("even_batches", &state.even_batches, &c.even_batches),
        ];
        for (field, saved, now) in checks {
            if saved != now {
                return Err(Error::invalid_config(
                    field,
                    &now,
                    format!("the sampler state was saved with {field} = {saved}; an exact resume needs the same data layout"),
                ));
            }
        }
        let resumed = (state.epoch_offset > 0)
            .then(|| {
                shard_len(
                    state.epoch_len(),
                    self.config.layout(),
                    self.config.shard_options(self.rank),
                )
                .map(|n| (state.epoch, state.epoch_offset, n))
            })
            .transpose()?;
        let len = resumed.map_or(self.len, |r| r.2);
        if state.batches_consumed > len || state.epoch_offset > state.dataset_len {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "sampler state says {} batches consumed after {} samples but an epoch has {} batches for rank {}",
                    state.batches_consumed, state.epoch_offset, len, self.rank
                ),
            ));
        }
        if self.config.seed != state.seed || resumed != self.resumed {
            self.config.seed = state.seed;
            self.cache = None;
        }
        self.resumed = resumed;
        self.epoch = state.epoch;
        self.consumed = state.batches_consumed;
        self.end_of_dataloader = false;
        Ok(())
    }

    /// Iterate over the rest of the current epoch.
    pub fn epoch_iter(&mut self) -> EpochIter<'_> {
        let epoch = self.epoch;
        EpochIter {
            loader: self,
            epoch,
        }
    }

    fn batch_at(&mut self, epoch: u64, index: usize) -> Vec<usize> {
        if self.cache.as_ref().map(|(e, _)| *e) != Some(epoch) {
            self.cache = Some((epoch, self.epoch_batches(epoch)));
        }
        self.cache
            .as_ref()
            .map(|(_, b)| b[index].clone())
            .unwrap_or_default()
    }
}

/// The remaining batches of one epoch; see [`ShardedLoader::epoch_iter`].
#[derive(Debug)]
pub struct EpochIter<'a> {
    loader: &'a mut ShardedLoader,
    epoch: u64,
}

impl Iterator for EpochIter<'_> {
    type Item = LoaderBatch;

    fn next(&mut self) -> Option<LoaderBatch> {
        let l = &mut *self.loader;
        if l.epoch != self.epoch {
            return None;
        }
        let len = l.len_of(self.epoch);
        if l.consumed >= len {
            // Only an epoch with no batch (or a position restored at its
            // end) gets here: close it.
            l.epoch += 1;
            l.consumed = 0;
            return None;
        }
        let index = l.consumed;
        let indices = l.batch_at(self.epoch, index);
        let last = index + 1 == len;
        l.end_of_dataloader = last;
        if last {
            l.epoch += 1;
            l.consumed = 0;
        } else {
            l.consumed += 1;
        }
        Some(LoaderBatch {
            indices,
            epoch: self.epoch,
            index,
            end_of_dataloader: last,
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = if self.loader.epoch == self.epoch {
            self.loader.len_of(self.epoch) - self.loader.consumed
        } else {
            0
        };
        (n, Some(n))
    }
}

/// Check that the loader positions of all ranks, as saved in one
/// checkpoint, describe one moment of one run (element `r` is rank `r`'s
/// state).
///
/// # Behavior
/// Every rank must have the same data layout and seed, the world size must
/// be the number of states, and the positions must agree: ranks read their
/// batches in lock-step, so after normalising "batch 0 of epoch `e`" to "the
/// end of epoch `e - 1`", every rank is in the same epoch, and the ranks
/// that have not read all their batches of it have read the same number
/// (without `even_batches` a rank with fewer batches may already be done).
/// Ranks without any batch are not compared on position.
///
/// # Errors
/// [`ErrorKind::Corrupt`] naming the two ranks and what differs (a state
/// file edited or copied from another checkpoint would otherwise
/// desynchronise the ranks until the timeout).
pub fn check_rank_states(states: &[SamplerState]) -> Result<()> {
    let bad = |m: String| {
        Err(Error::new(ErrorKind::Corrupt, m)
            .with_op("load_state")
            .with_fix("restore every rank's loader file from the same checkpoint, or load an older intact checkpoint"))
    };
    let Some(first) = states.first() else {
        return Ok(());
    };
    for (r, s) in states.iter().enumerate() {
        let same_layout = SamplerState {
            epoch: first.epoch,
            batches_consumed: first.batches_consumed,
            ..s.clone()
        } == *first;
        if !same_layout {
            return bad(format!(
                "the loader state of rank {r} was saved with another data layout or seed than rank 0's: {s:?} vs {first:?}"
            ));
        }
    }
    if first.num_processes != states.len() {
        return bad(format!(
            "the loader states say {} processes but {} ranks saved one",
            first.num_processes,
            states.len()
        ));
    }
    let config = LoaderConfig {
        dataset_len: first.dataset_len,
        batch_size: first.batch_size,
        drop_last: first.drop_last,
        shuffle: first.shuffle,
        seed: first.seed,
        num_processes: first.num_processes,
        split_batches: first.split_batches,
        even_batches: first.even_batches,
    };
    // (rank, epoch, consumed, len) after normalisation.
    let mut pos = Vec::new();
    for (r, s) in states.iter().enumerate() {
        let len = shard_len(s.epoch_len(), config.layout(), config.shard_options(r))?;
        if len == 0 {
            continue;
        }
        if s.batches_consumed > len {
            return bad(format!(
                "rank {r}'s loader state says {} batches consumed but an epoch has {len} for it",
                s.batches_consumed
            ));
        }
        let (e, c) = if s.batches_consumed == 0 && s.epoch > 0 {
            (s.epoch - 1, len)
        } else {
            (s.epoch, s.batches_consumed)
        };
        pos.push((r, e, c, len));
    }
    let Some(&(r0, e0, _, _)) = pos.first() else {
        return Ok(());
    };
    let describe = |r: usize| {
        let s = &states[r];
        format!(
            "rank {r} is at epoch {} after {} batches",
            s.epoch, s.batches_consumed
        )
    };
    for &(r, e, _, _) in &pos {
        if e != e0 {
            return bad(format!(
                "the ranks' loader states disagree on the epoch: {}, {}",
                describe(r0),
                describe(r)
            ));
        }
    }
    let mid: Vec<_> = pos.iter().filter(|p| p.2 < p.3).collect();
    if let Some(&&(rm, _, s, _)) = mid.first() {
        for &&(r, _, c, _) in &mid {
            if c != s {
                return bad(format!(
                    "the ranks' loader states disagree on the position: {}, {}",
                    describe(rm),
                    describe(r)
                ));
            }
        }
        for &(r, _, c, len) in &pos {
            if c == len && len > s {
                return bad(format!(
                    "the ranks' loader states disagree on the position: {}, {}",
                    describe(rm),
                    describe(r)
                ));
            }
        }
    }
    Ok(())
}
