//! Batch-sampler sharding: which batches of a global batch sequence a rank
//! reads.
//!
//! The input is any sequence of batches of sample indices (a fixed-size
//! batcher over a sampler, or a variable-size "bucketing" batcher). Every rank
//! runs the same deterministic function over the same sequence and keeps its
//! own part, so no communication is needed.
//!
//! # Semantics (Accelerate's `BatchSamplerShard`, observable behaviour)
//!
//! Without `split_batches`, batches are dealt round-robin: global batch `i`
//! goes to rank `i % N`, and a *round* is `N` consecutive batches.
//!
//! - Complete rounds of full batches are yielded as they arrive.
//! - The final round (fewer than `N` batches, or ending with a short batch):
//!   - `drop_last`: discarded, even its full batches, so every rank ends with
//!     the same number of equally sized batches;
//!   - `even_batches`: the short batch is topped up and missing batches are
//!     created, with samples taken cyclically from the start of the epoch's
//!     sample order (for variable-size batches: whole batches taken cyclically
//!     from the start of the batch sequence), so every rank gets one more
//!     batch;
//!   - otherwise: ranks that have a batch in the final round get it as is;
//!     the others get nothing.
//!
//! With `split_batches`, every global batch of `batch_size` samples is cut
//! into `N` contiguous pieces of `batch_size / N` and rank `r` gets piece `r`.
//! A short final batch is dropped (`drop_last`), topped up cyclically from the
//! start (`even_batches`), or cut as far as it goes (ranks past its end get
//! nothing).

use std::collections::VecDeque;

use accel_api::{Error, Result};
use serde::{Deserialize, Serialize};

/// How a batch sequence is split across processes.
///
/// # Requires
/// `num_processes >= 1` and `process_index < num_processes`; checked by
/// [`ShardOptions::new`] and by every function taking options.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardOptions {
    /// World size `N`.
    pub num_processes: usize,
    /// This rank.
    pub process_index: usize,
    /// Cut each global batch into `N` pieces instead of dealing whole batches.
    pub split_batches: bool,
    /// Top up the final round so every rank gets the same number of batches.
    pub even_batches: bool,
}

impl ShardOptions {
    /// Options for rank `process_index` of `num_processes`, with Accelerate's
    /// defaults (`split_batches = false`, `even_batches = true`).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument) when `num_processes == 0` or
    /// `process_index >= num_processes`.
    pub fn new(num_processes: usize, process_index: usize) -> Result<ShardOptions> {
        let o = ShardOptions {
            num_processes,
            process_index,
            split_batches: false,
            even_batches: true,
        };
        o.validate()?;
        Ok(o)
    }

    /// The same options with `split_batches` set.
    pub fn split_batches(mut self, yes: bool) -> ShardOptions {
        self.split_batches = yes;
        self
    }

    /// The same options with `even_batches` set.
    pub fn even_batches(mut self, yes: bool) -> ShardOptions {
        self.even_batches = yes;
        self
    }

    /// The same options for another rank.
    pub fn for_rank(mut self, process_index: usize) -> ShardOptions {
        self.process_index = process_index;
        self
    }

    /// Check the rank against the world size.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument) naming the bad value.
    pub fn validate(&self) -> Result<()> {
        if self.num_processes == 0 {
            return Err(Error::invalid_argument(
                "shard",
                "num_processes is 0: a process group has at least one process",
            ));
        }
        if self.process_index >= self.num_processes {
            return Err(Error::invalid_argument(
                "shard",
                format!(
                    "process_index {} is out of range for {} processes",
                    self.process_index, self.num_processes
                ),
            ));
        }
        Ok(())
    }
}

/// What is known about the global batch sequence before reading it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct BatchLayout {
    /// The nominal batch size, or `None` for a variable-size batcher. Only
    /// the final batch may be shorter than a nominal size; a short batch in
    /// the middle of the sequence is passed through as if it were full.
    pub batch_size: Option<usize>,
    /// The source drops incomplete data (PyTorch's `drop_last`): a short
    /// final batch, and without `split_batches` the whole incomplete final
    /// round, are discarded.
    pub drop_last: bool,
}

impl BatchLayout {
    /// Fixed-size batches of `batch_size`.
    pub fn fixed(batch_size: usize, drop_last: bool) -> BatchLayout {
        BatchLayout {
            batch_size: Some(batch_size),
            drop_last,
        }
    }

    /// Variable-size batches.
    pub fn variable(drop_last: bool) -> BatchLayout {
        BatchLayout {
            batch_size: None,
            drop_last,
        }
    }
}

/// Check that `layout` and `opts` can be combined.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument) for bad options, a zero batch size,
/// `split_batches` without a nominal batch size, or `split_batches` with a
/// batch size that `N` does not divide.
pub fn validate(layout: &BatchLayout, opts: &ShardOptions) -> Result<()> {
    opts.validate()?;
    if layout.batch_size == Some(0) {
        return Err(Error::invalid_argument("shard", "batch_size is 0"));
    }
    if opts.split_batches {
        match layout.batch_size {
            None => {
                return Err(Error::invalid_argument(
                    "shard",
                    "split_batches needs a fixed batch size; the batch sampler has variable-size batches",
                )
                .with_fix("set split_batches = false or use a fixed-size batch sampler"))
            }
            Some(b) if b % opts.num_processes != 0 => {
                return Err(Error::invalid_argument(
                    "shard",
                    format!(
                        "split_batches: batch size {b} is not a round multiple of the number of processes {}",
                        opts.num_processes
                    ),
                )
                .with_fix("choose a batch size divisible by the world size or set split_batches = false"))
            }
            _ => {}
        }
    }
    Ok(())
}

/// Shard a global batch sequence for one rank.
///
/// # Behavior
/// See the [module docs](self). The returned iterator reads `batches` lazily,
/// holding at most one round (`N` batches) plus the first `N` batches of
/// samples for topping up.
///
/// # Errors
/// As [`validate`].
pub fn shard_batches<I>(
    batches: I,
    layout: BatchLayout,
    opts: ShardOptions,
) -> Result<BatchShard<I::IntoIter>>
where
    I: IntoIterator<Item = Vec<usize>>,
{
    validate(&layout, &opts)?;
    Ok(BatchShard {
        inner: batches.into_iter(),
        layout,
        opts,
        head_samples: Vec::new(),
        head_batches: Vec::new(),
        round: Vec::new(),
        held: false,
        finished: false,
        ready: VecDeque::new(),
    })
}

/// Iterator over one rank's batches; built by [`shard_batches`].
#[derive(Debug)]
pub struct BatchShard<I> {
    inner: I,
    layout: BatchLayout,
    opts: ShardOptions,
    /// Samples of the first batches, the cyclic source for topping up.
    head_samples: Vec<usize>,
    /// The first `N` batches, the cyclic source for variable-size padding.
    head_batches: Vec<Vec<usize>>,
    /// Batches of the current round (split mode: at most one held batch).
    round: Vec<Vec<usize>>,
    /// The round (or split batch) is complete but ends short, so it is kept
    /// until we know whether it is the last.
    held: bool,
    finished: bool,
    ready: VecDeque<Vec<usize>>,
}

impl<I: Iterator<Item = Vec<usize>>> BatchShard<I> {
    fn n(&self) -> usize {
        self.opts.num_processes
    }

    fn is_full(&self, b: &[usize]) -> bool {
        self.layout.batch_size.is_none_or(|s| b.len() >= s)
    }

    /// This rank's part of a complete round.
    fn mine(&self, round: Vec<Vec<usize>>) -> Vec<usize> {
        if self.opts.split_batches {
            round.first().map(|b| self.piece(b)).unwrap_or_default()
        } else {
            round
                .into_iter()
                .nth(self.opts.process_index)
                .unwrap_or_default()
        }
    }

    /// Piece `r` of a split batch, clipped to what the batch holds.
    fn piece(&self, b: &[usize]) -> Vec<usize> {
        let per = self.layout.batch_size.unwrap_or(0) / self.n();
        let start = (per * self.opts.process_index).min(b.len());
        let end = (per * (self.opts.process_index + 1)).min(b.len());
        b[start..end].to_vec()
    }

    fn remember_head(&mut self, b: &[usize]) {
        if self.layout.drop_last || !self.opts.even_batches {
            return;
        }
        let want = if self.opts.split_batches { 1 } else { self.n() };
        if self.head_batches.len() < want {
            self.head_samples.extend_from_slice(b);
            if self.layout.batch_size.is_none() {
                self.head_batches.push(b.to_vec());
            } else {
                self.head_batches.push(Vec::new());
            }
        }
    }

    /// `k` samples cyclically from the start, continuing at `*cursor`.
    fn cyclic(&self, cursor: &mut usize, k: usize) -> Vec<usize> {
        let src = &self.head_samples;
        let out = (0..k).map(|j| src[(*cursor + j) % src.len()]).collect();
        *cursor += k;
        out
    }

    /// What this rank gets from the final (incomplete) round.
    fn finish(&mut self) -> Option<Vec<usize>> {
        let round = std::mem::take(&mut self.round);
        if round.is_empty() || self.layout.drop_last {
            return None;
        }
        let r = self.opts.process_index;
        if self.opts.split_batches {
            let mut b = round.into_iter().next().unwrap_or_default();
            if self.opts.even_batches {
                let need = self.layout.batch_size.unwrap_or(0).saturating_sub(b.len());
                let mut cursor = 0;
                b.extend(self.cyclic(&mut cursor, need));
            }
            let p = self.piece(&b);
            return (!p.is_empty()).then_some(p);
        }
        if !self.opts.even_batches {
            return round.into_iter().nth(r);
        }
        let mut round = round;
        match self.layout.batch_size {
            Some(bs) => {
                let mut cursor = 0;
                if let Some(last) = round.last_mut() {
                    let need = bs.saturating_sub(last.len());
                    let fill = self.cyclic(&mut cursor, need);
                    last.extend(fill);
                }
                while round.len() < self.n() {
                    let b = self.cyclic(&mut cursor, bs);
                    round.push(b);
                }
            }
            None => {
                let mut j = 0;
                while round.len() < self.n() {
                    round.push(self.head_batches[j % self.head_batches.len()].clone());
                    j += 1;
                }
            }
        }
        round.into_iter().nth(r)
    }
}

impl<I: Iterator<Item = Vec<usize>>> Iterator for BatchShard<I> {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        loop {
            if let Some(o) = self.ready.pop_front() {
                return Some(o);
            }
            if self.finished {
                return None;
            }
            let Some(b) = self.inner.next() else {
                self.finished = true;
                if let Some(t) = self.finish() {
                    self.ready.push_back(t);
                }
                continue;
            };
            self.remember_head(&b);
            if self.held {
                // The held round was not the last one after all: release it.
                self.held = false;
                let round = std::mem::take(&mut self.round);
                let mine = self.mine(round);
                self.ready.push_back(mine);
            }
            let full = self.is_full(&b);
            self.round.push(b);
            let round_len = if self.opts.split_batches { 1 } else { self.n() };
            if self.round.len() == round_len {
                if full {
                    let round = std::mem::take(&mut self.round);
                    let mine = self.mine(round);
                    self.ready.push_back(mine);
                } else {
                    self.held = true;
                }
            }
        }
    }
}

/// How many batches rank `opts.process_index` gets when a fixed-size batcher
/// of `layout.batch_size` runs over `num_samples` samples.
///
/// # Behavior
/// Exact for every combination of flags (it agrees with iterating
/// [`shard_batches`]); in particular with `split_batches` and without
/// `even_batches`, a rank past the end of a short final batch is not counted
/// (Accelerate's `len()` counts it).
///
/// # Errors
/// As [`validate`], and [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
/// for a variable-size layout (use [`shard_len_variable`]).
pub fn shard_len(num_samples: usize, layout: BatchLayout, opts: ShardOptions) -> Result<usize> {
    validate(&layout, &opts)?;
    let Some(bs) = layout.batch_size else {
        return Err(Error::invalid_argument(
            "shard_len",
            "the layout has variable-size batches; use shard_len_variable with the number of batches",
        ));
    };
    let n = opts.num_processes;
    let r = opts.process_index;
    let full = num_samples / bs;
    let partial = if layout.drop_last {
        0
    } else {
        num_samples % bs
    };
    let total = full + usize::from(partial > 0);
    Ok(if opts.split_batches {
        let per = bs / n;
        if layout.drop_last || opts.even_batches {
            total
        } else {
            full + usize::from(partial > r * per)
        }
    } else if layout.drop_last {
        full / n
    } else if opts.even_batches {
        total.div_ceil(n)
    } else {
        total / n + usize::from(r < total % n)
    })
}

/// How many batches rank `opts.process_index` gets from a variable-size
/// sequence of `num_batches` batches (no `split_batches`).
///
/// # Errors
/// As [`validate`].
pub fn shard_len_variable(
    num_batches: usize,
    drop_last: bool,
    opts: ShardOptions,
) -> Result<usize> {
    validate(&BatchLayout::variable(drop_last), &opts)?;
    let n = opts.num_processes;
    Ok(if drop_last {
        num_batches / n
    } else if opts.even_batches {
        num_batches.div_ceil(n)
    } else {
        num_batches / n + usize::from(opts.process_index < num_batches % n)
    })
}
