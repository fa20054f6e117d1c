//! Iterable (streaming) loaders in `prepare`: every rank reads the stream
//! and keeps its slice (Accelerate's `IterableDatasetShard`), or the main
//! process reads it and sends every rank its slice (Accelerate's
//! `DataLoaderDispatcher`, `dispatch_batches`), both on top of
//! `accel-sharding`'s [`shard_iterable`] and [`dispatch_slice`].

use std::sync::Arc;

use accel_api::{Communicator, Error, ErrorKind, Result, Wrapper};
use accel_sharding::{dispatch_slice, iterable_len, shard_iterable, IterableShard};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use super::adapters::StateDict;
use super::checkpoint::Checkpointed;
use super::prepare::{Batch, Prepare};
use super::{Kind, TrainShared};
use crate::{Accelerator, CollectivesExt};

/// A stream of samples of possibly unknown length (PyTorch's
/// `IterableDataset`).
///
/// # Requires
/// Without `dispatch_batches`, every rank must produce the same stream for
/// the same epoch (sharding keeps positions, not contents). With it, only
/// the main process calls [`iter`](Self::iter).
pub trait IterableDataset {
    /// One sample.
    type Item;

    /// The stream of `epoch`, from its start.
    fn iter(&self, epoch: u64) -> Box<dyn Iterator<Item = Self::Item> + Send>;

    /// The number of samples, when known; the prepared loader then reports
    /// its length (default: unknown).
    fn len(&self) -> Option<usize> {
        None
    }

    /// `Some(true)` when the length is known to be 0.
    fn is_empty(&self) -> Option<bool> {
        self.len().map(|l| l == 0)
    }
}

/// An unprepared iterable loader: a stream and how to batch it. Preparing
/// it ([`Accelerator::prepare_iterable_loader`]) shards or dispatches it as
/// [`TrainConfig::dispatch_batches`](super::TrainConfig::dispatch_batches)
/// says.
#[derive(Clone, Debug)]
pub struct IterableLoader<D> {
    /// The stream.
    pub dataset: D,
    /// Samples per batch: per process, or of the global batch with
    /// [`TrainConfig::split_batches`](super::TrainConfig::split_batches).
    pub batch_size: usize,
    /// Drop the incomplete last step instead of completing it with samples
    /// from the start of the stream.
    pub drop_last: bool,
}

impl<D> IterableLoader<D> {
    /// Batches of `batch_size`, keeping the last step.
    pub fn new(dataset: D, batch_size: usize) -> IterableLoader<D> {
        IterableLoader {
            dataset,
            batch_size,
            drop_last: false,
        }
    }

    /// Set `drop_last`.
    pub fn drop_last(mut self, yes: bool) -> IterableLoader<D> {
        self.drop_last = yes;
        self
    }
}

type Stream<T> = Box<dyn Iterator<Item = (usize, T)> + Send>;

enum Live<T> {
    /// One process: plain batches, the last one short (as Accelerate leaves
    /// a one-process loader unsharded).
    Plain {
        stream: Stream<T>,
        /// The batch read ahead to know whether the current one is the last.
        ahead: Option<Vec<(usize, T)>>,
    },
    Shard(IterableShard<Stream<T>>),
    Dispatch {
        /// The main process's stream (`None` elsewhere).
        stream: Option<Stream<T>>,
        /// The main process's first global step, the padding source.
        first: Vec<(usize, T)>,
        /// The step read ahead to know whether the current one is the last.
        ahead: Option<Vec<(usize, T)>>,
    },
}

/// What the main process sends each step in dispatch mode.
#[derive(Serialize, Deserialize)]
struct Step<T> {
    /// The global step (empty: the epoch is over).
    items: Vec<(usize, T)>,
    /// No step follows.
    last: bool,
    /// The first step of the epoch, sent with a last step that needs
    /// padding.
    first: Vec<(usize, T)>,
}

/// A streaming loader prepared for distributed training: one batch per rank
/// per global step of `batch_size * world_size` samples (`batch_size` with
/// `split_batches`), either sliced by every rank from the stream it reads
/// itself or sent by the main process (`dispatch_batches`). Derefs to the
/// [`IterableLoader`]; checkpoints its position.
///
/// # Behavior
/// The last, partial step is dropped with `drop_last`; otherwise it is
/// completed with samples from the start of the epoch's stream, and its
/// batches carry `remainder` (the real samples of the step), so
/// [`gather_for_metrics`](Accelerator::gather_for_metrics) returns every
/// sample once. In dispatch mode a partial last step is cut into `N` equal
/// slices of `ceil(len / N)` samples (Accelerate's dispatcher), so its
/// batches can be shorter than `batch_size`. [`Batch::indices`] are
/// positions in the epoch's stream.
pub struct PreparedIterableLoader<D: IterableDataset> {
    loader: IterableLoader<D>,
    key: String,
    comm: Arc<dyn Communicator>,
    dispatch: bool,
    split_batches: bool,
    epoch: u64,
    /// Steps of `epoch` already handed out.
    steps: usize,
    live: Option<Live<D::Item>>,
    /// The last batch of the epoch was handed out; the next call says so.
    ended: bool,
}

impl<D: IterableDataset> std::fmt::Debug for PreparedIterableLoader<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedIterableLoader")
            .field("key", &self.key)
            .field("dispatch", &self.dispatch)
            .field("epoch", &self.epoch)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

super::prepare::loader_wrapper_impls!(PreparedIterableLoader, IterableDataset, IterableLoader);

impl<D: IterableDataset> Prepare<PreparedIterableLoader<D>> for IterableLoader<D> {
    fn prepare_with(self, acc: &Accelerator) -> Result<PreparedIterableLoader<D>> {
        let shared: Arc<TrainShared> = super::shared(acc).clone();
        let (split_batches, dispatch) = {
            let st = shared.lock();
            (
                st.config.split_batches,
                st.config.dispatch_batches.unwrap_or(true),
            )
        };
        let n = acc.world_size();
        // The same checks as the sharding crate, at prepare time.
        shard_iterable(
            std::iter::empty::<()>(),
            self.batch_size,
            self.drop_last,
            n,
            acc.rank(),
            split_batches,
        )
        .map_err(|e| e.with_op("prepare").with_rank(acc.rank()))?;
        Ok(PreparedIterableLoader {
            loader: self,
            key: shared.next_key(Kind::Loader),
            comm: acc.comm().clone(),
            dispatch: dispatch && n > 1,
            split_batches,
            epoch: 0,
            steps: 0,
            live: None,
            ended: false,
        })
    }
}

impl Accelerator {
    /// [`prepare`](Self::prepare) for an iterable loader: sharded, or
    /// dispatched from the main process when
    /// [`TrainConfig::dispatch_batches`](super::TrainConfig::dispatch_batches)
    /// is `Some(true)` or `None` (Accelerate's default for iterable
    /// datasets). Not collective.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a batch size of 0, or
    /// `split_batches` with a batch size the world size does not divide
    /// (Accelerate silently yields nothing for batch size 1 on several
    /// processes).
    pub fn prepare_iterable_loader<D: IterableDataset>(
        &self,
        loader: impl Prepare<PreparedIterableLoader<D>>,
    ) -> Result<PreparedIterableLoader<D>> {
        loader.prepare_with(self)
    }
}

impl<D: IterableDataset> PreparedIterableLoader<D>
where
    D::Item: Clone + Serialize + DeserializeOwned + Send + 'static,
{
    fn world(&self) -> usize {
        self.comm.world_size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Samples per global step.
    fn global(&self) -> usize {
        if self.split_batches {
            self.loader.batch_size
        } else {
            self.loader.batch_size * self.world()
        }
    }

    fn stream(&self) -> Stream<D::Item> {
        Box::new(self.loader.dataset.iter(self.epoch).enumerate())
    }

    fn start_epoch(&mut self) -> Result<Live<D::Item>> {
        if self.world() == 1 {
            let mut stream = self.stream();
            let bs = self.loader.batch_size;
            stream.by_ref().take(self.steps * bs).for_each(drop);
            return Ok(Live::Plain {
                stream,
                ahead: None,
            });
        }
        if !self.dispatch {
            let mut shard = shard_iterable(
                self.stream(),
                self.loader.batch_size,
                self.loader.drop_last,
                self.world(),
                self.rank(),
                self.split_batches,
            )?;
            for _ in 0..self.steps {
                let _ = shard.next();
            }
            return Ok(Live::Shard(shard));
        }
        if self.rank() != 0 {
            return Ok(Live::Dispatch {
                stream: None,
                first: Vec::new(),
                ahead: None,
            });
        }
        let global = self.global();
        let mut stream = self.stream();
        let first: Vec<_> = stream.by_ref().take(global).collect();
        // Skip what a restored position already read (the first step is
        // kept: it pads the last one).
        let skipped = self.steps.saturating_sub(1) * global;
        stream.by_ref().take(skipped).for_each(drop);
        let ahead = if self.steps == 0 {
            Some(first.clone())
        } else {
            None
        };
        Ok(Live::Dispatch {
            stream: Some(stream),
            first,
            ahead,
        })
    }

    /// The next batch of the current epoch, `Ok(None)` once the epoch is
    /// over (the following call starts the next epoch). Collective in
    /// dispatch mode (the main process sends every step).
    ///
    /// # Errors
    /// The communicator's in dispatch mode (items travel as JSON from the
    /// main process); [`ErrorKind::Corrupt`] when a peer's items do not
    /// decode.
    pub fn next_batch(&mut self) -> Result<Option<Batch<D::Item>>> {
        if self.ended {
            self.ended = false;
            return Ok(None);
        }
        if self.live.is_none() {
            self.live = Some(self.start_epoch()?);
        }
        let (global, world, rank, drop_last) = (
            self.global(),
            self.world(),
            self.rank(),
            self.loader.drop_last,
        );
        let index = self.steps;
        let bs = self.loader.batch_size;
        let next = match self.live.as_mut().expect("started") {
            Live::Plain { stream, ahead } => {
                let cur: Vec<_> = ahead
                    .take()
                    .unwrap_or_else(|| stream.by_ref().take(bs).collect());
                if cur.is_empty() || (cur.len() < bs && drop_last) {
                    None
                } else {
                    // Read the next batch ahead to know whether this is the last.
                    let following: Vec<_> = stream.by_ref().take(bs).collect();
                    let end = following.is_empty() || (following.len() < bs && drop_last);
                    *ahead = Some(following);
                    let (indices, items) = cur.into_iter().unzip();
                    Some((items, indices, end, 0))
                }
            }
            Live::Shard(shard) => shard.next().map(|c| {
                let (indices, items) = c.items.into_iter().unzip();
                (items, indices, c.end_of_dataloader, c.remainder)
            }),
            Live::Dispatch {
                stream,
                first,
                ahead,
            } => {
                let step = match stream {
                    Some(s) => {
                        let mut cur = ahead
                            .take()
                            .unwrap_or_else(|| s.by_ref().take(global).collect());
                        if cur.len() < global && drop_last {
                            cur.clear();
                        }
                        let following: Vec<_> = if cur.is_empty() {
                            Vec::new()
                        } else {
                            s.by_ref().take(global).collect()
                        };
                        let last = following.is_empty() || (following.len() < global && drop_last);
                        *ahead = Some(following);
                        let pad = last && !cur.len().is_multiple_of(world);
                        let step = Step {
                            first: if pad { first.clone() } else { Vec::new() },
                            items: cur,
                            last,
                        };
                        self.comm.broadcast_object(Some(&step), 0)?
                    }
                    None => self.comm.broadcast_object::<Step<D::Item>>(None, 0)?,
                };
                if step.items.is_empty() {
                    None
                } else {
                    let real = step.items.len();
                    let padded = step.last && !drop_last && !real.is_multiple_of(world);
                    let mine = dispatch_slice(
                        &step.items,
                        &step.first,
                        world,
                        rank,
                        step.last,
                        drop_last,
                    )?;
                    let (indices, items) = mine.into_iter().unzip();
                    Some((items, indices, step.last, if padded { real } else { 0 }))
                }
            }
        };
        let Some((items, indices, end, remainder)) = next else {
            self.close_epoch();
            return Ok(None);
        };
        if end {
            self.close_epoch();
            self.ended = true;
        } else {
            self.steps += 1;
        }
        Ok(Some(Batch {
            items,
            indices,
            epoch: if end { self.epoch - 1 } else { self.epoch },
            index,
            end_of_dataloader: end,
            remainder,
        }))
    }

    fn close_epoch(&mut self) {
        self.epoch += 1;
        self.steps = 0;
        self.live = None;
    }
}

impl<D: IterableDataset> PreparedIterableLoader<D> {
    /// Batches each rank reads per epoch, when the dataset knows its
    /// length (consistent with what [`next_batch`](Self::next_batch)
    /// yields); `None` otherwise.
    pub fn len(&self) -> Option<usize> {
        let n = self.comm.world_size();
        self.loader.dataset.len().map(|l| {
            iterable_len(
                l,
                self.loader.batch_size,
                self.loader.drop_last,
                n,
                self.split_batches,
            )
        })
    }

    /// `Some(true)` when the dataset has a length and an epoch has no
    /// batch.
    pub fn is_empty(&self) -> Option<bool> {
        self.len().map(|l| l == 0)
    }

    /// The epoch of the next batch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Jump to the start of `epoch`.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.steps = 0;
        self.live = None;
        self.ended = false;
    }

    /// `true` when the main process reads and sends every step.
    pub fn is_dispatching(&self) -> bool {
        self.dispatch
    }

    /// The checkpoint key.
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// The saved position of an iterable loader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct StreamState {
    epoch: u64,
    steps: usize,
    batch_size: usize,
    drop_last: bool,
    num_processes: usize,
    split_batches: bool,
}

impl<D: IterableDataset> Checkpointed for PreparedIterableLoader<D> {
    fn checkpoint_key(&self) -> String {
        self.key.clone()
    }
    fn per_rank(&self) -> bool {
        true
    }
    fn checkpoint_state(&self) -> Result<StateDict> {
        let mut s = StateDict::default();
        s.put(
            "stream",
            &StreamState {
                epoch: self.epoch,
                steps: self.steps,
                batch_size: self.loader.batch_size,
                drop_last: self.loader.drop_last,
                num_processes: self.comm.world_size(),
                split_batches: self.split_batches,
            },
        );
        Ok(s)
    }
    fn restore_checkpoint_state(&mut self, state: StateDict) -> Result<()> {
        let st: StreamState = state.get("stream")?;
        let now = (
            self.loader.batch_size,
            self.loader.drop_last,
            self.comm.world_size(),
            self.split_batches,
        );
        if (
            st.batch_size,
            st.drop_last,
            st.num_processes,
            st.split_batches,
        ) != now
        {
            return Err(Error::invalid_config(
                "loader",
                &format!("{now:?}"),
                format!(
                    "the stream position was saved with (batch_size, drop_last, num_processes, split_batches) = {:?}; an exact resume needs the same",
                    (st.batch_size, st.drop_last, st.num_processes, st.split_batches)
                ),
            ));
        }
        self.epoch = st.epoch;
        self.steps = st.steps;
        self.live = None;
        self.ended = false;
        Ok(())
    }
    fn check_rank_states(&self, states: &[StateDict]) -> Result<()> {
        let all = states
            .iter()
            .map(|s| s.get::<StreamState>("stream"))
            .collect::<Result<Vec<_>>>()?;
        if let Some((r, s)) = all.iter().enumerate().find(|(_, s)| **s != all[0]) {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!(
                    "the ranks' stream positions disagree: rank 0 is at epoch {} after {} steps, rank {r} at epoch {} after {} steps; every rank reads one batch per step",
                    all[0].epoch, all[0].steps, s.epoch, s.steps
                ),
            )
            .with_fix("restore every rank's loader file from the same checkpoint, or load an older intact checkpoint"));
        }
        Ok(())
    }
}
