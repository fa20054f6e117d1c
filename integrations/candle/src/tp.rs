//! Tensor parallelism for candle (issue 39): Megatron's column- and
//! row-parallel linear layers, each cut from the full weight of a one-rank
//! model by the rank's place in its tensor-parallel group (the mesh's `tp`
//! group), with the collectives where Megatron puts them, forward and
//! backward.
//!
//! A column-parallel layer holds `out / tp` rows of the weight (and of the
//! bias): its output is this rank's slice of the features, all-gathered
//! when asked (inference). A row-parallel layer holds `in / tp` columns and
//! takes the matching slice of its input: the partial products are
//! all-reduced, then the (whole) bias is added. A column-parallel layer
//! followed by a row-parallel one (attention's heads, an MLP's hidden
//! units) needs one all-reduce forward and one backward, and no gather.
//!
//! Training: the shards are `Var`s (`vars()`), and the collectives are
//! candle ops with a backward, Megatron's `f` and `g`: the column-parallel
//! layer's input passes unchanged forward and has its gradient summed over
//! the group backward ([`copy_to_tp`]); the row-parallel layer's output is
//! summed forward and its gradient passes unchanged backward
//! ([`reduce_from_tp`]).
//!
//! Sequence parallelism (Megatron's): between the tensor-parallel blocks,
//! norms and dropout run on `seq / tp` rows each ([`scatter_to_sp`]); a
//! block is entered with [`gather_from_sp`] and left with a row-parallel
//! layer's [`forward_sequence_parallel`](RowParallelLinear::forward_sequence_parallel)
//! (a reduce-scatter in place of the all-reduce): the same traffic, and
//! the activations outside the blocks are split too.
//!
//! A language model's head and loss: [`VocabParallelEmbedding`] holds
//! `vocab / tp` rows of the table, and [`vocab_parallel_cross_entropy`]
//! takes this rank's columns of the logits: the loss of the whole
//! vocabulary with no rank ever holding all the logits.

use std::sync::Arc;

use accel::CollectivesExt;
use accel_api::{Communicator, CommunicatorExt, Error, ErrorKind, ReduceOp, Result};
use accel_sharding::placement::Placement;
use accel_sharding::tp_plan::even_split;
pub use accel_sharding::tp_plan::{ModuleKind, Planned, TpPlan, TpStyle};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var, D};

fn candle(e: candle_core::Error) -> Error {
    Error::new(ErrorKind::Backend, format!("candle: {e}"))
}

/// This rank's chunk of `n` over `group` (`n` must divide evenly).
fn chunk(n: usize, group: &dyn Communicator, what: &str) -> Result<(usize, usize)> {
    even_split(n, group.world_size(), group.rank(), what)
}

/// The f32 elements of a contiguous tensor's storage.
fn elements<'a>(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<&'a [f32]> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("tensor-parallel collectives take f32 tensors");
    };
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("tensor-parallel collectives take contiguous tensors");
    };
    Ok(&data[a..b])
}

/// Megatron's `f`: `x` unchanged forward, its gradient summed over
/// `group` backward (the input of a column-parallel layer).
///
/// # Errors
/// candle's (an f32 tensor is needed).
pub fn copy_to_tp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    apply(x, group, Kind::Copy)
}

/// Megatron's `g`: `x` summed over `group` forward, its gradient unchanged
/// backward (the output of a row-parallel layer). Collective.
///
/// # Errors
/// candle's (an f32 tensor is needed); the all-reduce's.
pub fn reduce_from_tp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    apply(x, group, Kind::Reduce)
}

/// For u32 `ids` (below 2^24: the test runs in f32): 1.0 where an id is
/// in `start..end` and 0.0 elsewhere, and the ids less `start` (0 outside).
fn in_range(ids: &Tensor, start: f64, end: f64) -> candle_core::Result<(Tensor, Tensor)> {
    let f = ids.to_dtype(candle_core::DType::F32)?;
    let mine = f
        .ge(start)?
        .mul(&f.lt(end)?)?
        .to_dtype(candle_core::DType::F32)?;
    let local = ((&f - start)? * &mine)?.to_dtype(candle_core::DType::U32)?;
    Ok((mine, local))
}

/// A shard of `t` along `dim` as a trainable `Var`.
fn shard(t: &Tensor, dim: usize, start: usize, len: usize) -> Result<Var> {
    t.narrow(dim, start, len)
        .and_then(|s| s.contiguous())
        .and_then(|s| Var::from_tensor(&s))
        .map_err(candle)
}

/// `out / tp` output features of a linear layer.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    weight: Var,
    bias: Option<Var>,
    group: Arc<dyn Communicator>,
    gather_output: bool,
}

impl std::fmt::Debug for ColumnParallelLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ColumnParallelLinear")
            .field("weight", &self.weight.shape())
            .field("gather_output", &self.gather_output)
            .finish_non_exhaustive()
    }
}

impl ColumnParallelLinear {
    /// This rank's rows of `weight` (`[out, in]`, as `candle_nn::Linear`)
    /// and of `bias`; `gather_output`: all-gather the features after the
    /// forward (inference; else each rank keeps its slice, for a
    /// row-parallel layer).
    ///
    /// # Errors
    /// `InvalidArgument` when `out` does not split evenly over the group;
    /// candle's.
    pub fn from_full(
        weight: &Tensor,
        bias: Option<&Tensor>,
        group: Arc<dyn Communicator>,
        gather_output: bool,
    ) -> Result<ColumnParallelLinear> {
        let out = weight.dim(0).map_err(candle)?;
        let (start, len) = chunk(out, &*group, "a column-parallel layer")?;
        Ok(ColumnParallelLinear {
            weight: shard(weight, 0, start, len)?,
            bias: bias.map(|b| shard(b, 0, start, len)).transpose()?,
            group,
            gather_output,
        })
    }

    /// This rank's trainable shards: the weight's rows, then the bias's.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    /// `x · Wᵀ + b` for this rank's features (all of them, gathered, with
    /// `gather_output`); backward, `x`'s gradient is summed over the
    /// group. Collective with `gather_output`.
    ///
    /// # Errors
    /// candle's; the all-gather's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = copy_to_tp(x, &self.group)?;
        self.local_forward(&x)
    }

    /// [`forward`](Self::forward) entering from a sequence-parallel region
    /// (Megatron's sequence parallelism): `x` is this rank's rows of
    /// dimension 0 (the sequence), all-gathered first ([`gather_from_sp`],
    /// whose backward reduce-scatters `x`'s gradient). Collective.
    ///
    /// # Errors
    /// candle's; the all-gather's.
    pub fn forward_sequence_parallel(&self, x: &Tensor) -> Result<Tensor> {
        let x = gather_from_sp(x, &self.group)?;
        self.local_forward(&x)
    }

    fn local_forward(&self, x: &Tensor) -> Result<Tensor> {
        let linear = candle_nn::Linear::new(
            self.weight.as_tensor().clone(),
            self.bias.as_ref().map(|b| b.as_tensor().clone()),
        );
        let y = candle_nn::Module::forward(&linear, x).map_err(candle)?;
        if !self.gather_output || self.group.world_size() == 1 {
            return Ok(y);
        }
        let dims = y.dims().to_vec();
        let mine: Vec<f32> = y.flatten_all().and_then(|f| f.to_vec1()).map_err(candle)?;
        let all = self
            .group
            .all_gather_vec(&mine)
            .map_err(|e| e.with_op("column-parallel linear: all_gather"))?;
        let parts: Vec<Tensor> = all
            .chunks(mine.len())
            .map(|c| Tensor::from_slice(c, dims.as_slice(), y.device()))
            .collect::<candle_core::Result<_>>()
            .map_err(candle)?;
        Tensor::cat(&parts, D::Minus1).map_err(candle)
    }
}

/// `in / tp` input features of a linear layer.
#[derive(Clone)]
pub struct RowParallelLinear {
    weight: Var,
    bias: Option<Var>,
    group: Arc<dyn Communicator>,
}

impl std::fmt::Debug for RowParallelLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowParallelLinear")
            .field("weight", &self.weight.shape())
            .finish_non_exhaustive()
    }
}

impl RowParallelLinear {
    /// This rank's columns of `weight` (`[out, in]`); `bias` whole (added
    /// once, after the sum).
    ///
    /// # Errors
    /// `InvalidArgument` when `in` does not split evenly over the group;
    /// candle's.
    pub fn from_full(
        weight: &Tensor,
        bias: Option<&Tensor>,
        group: Arc<dyn Communicator>,
    ) -> Result<RowParallelLinear> {
        let inp = weight.dim(1).map_err(candle)?;
        let (start, len) = chunk(inp, &*group, "a row-parallel layer")?;
        Ok(RowParallelLinear {
            weight: shard(weight, 1, start, len)?,
            bias: bias
                .map(|b| Var::from_tensor(b).map_err(candle))
                .transpose()?,
            group,
        })
    }

    /// This rank's trainable parts: the weight's columns, then the (whole,
    /// replicated) bias.
    pub fn vars(&self) -> Vec<Var> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }

    /// `Σ_ranks x_r · W_rᵀ + b`, `x_r` this rank's slice of the input
    /// features (a column-parallel layer's output). Collective.
    ///
    /// # Errors
    /// candle's; the all-reduce's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, false)
    }

    /// [`forward`](Self::forward) leaving a sequence-parallel region
    /// (Megatron's sequence parallelism): the partial products are
    /// reduce-scattered along dimension 0 (the sequence) instead of
    /// all-reduced, each rank keeping its rows of the sum
    /// ([`reduce_scatter_to_sp`]), then the bias is added. Collective.
    ///
    /// # Errors
    /// candle's; the reduce-scatter's (the sequence must split evenly).
    pub fn forward_sequence_parallel(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, true)
    }

    fn forward_with(&self, x: &Tensor, sequence_parallel: bool) -> Result<Tensor> {
        let linear = candle_nn::Linear::new(self.weight.as_tensor().clone(), None);
        let partial = candle_nn::Module::forward(&linear, x).map_err(candle)?;
        let y = if sequence_parallel {
            reduce_scatter_to_sp(&partial, &self.group)?
        } else {
            reduce_from_tp(&partial, &self.group)?
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b.as_tensor()).map_err(candle),
            None => Ok(y),
        }
    }
}

/// Megatron's collectives over a group as candle ops, each with its
/// backward: `f` and `g` around the tensor-parallel blocks, and the
/// sequence-parallel transitions along dimension 0 (the sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `f`: unchanged; backward: all-reduce.
    Copy,
    /// `g`: all-reduce; backward: unchanged.
    Reduce,
    /// Keep this rank's rows; backward: all-gather the rows.
    Scatter,
    /// All-gather the rows; backward: reduce-scatter the rows.
    Gather,
    /// Reduce-scatter the rows; backward: all-gather the rows.
    ReduceScatter,
}

#[derive(Clone)]
struct Collective {
    group: Arc<dyn Communicator>,
    kind: Kind,
}

impl Collective {
    fn run(&self, v: &[f32], shape: &Shape) -> candle_core::Result<(Vec<f32>, Shape)> {
        let (n, r) = (self.group.world_size(), self.group.rank());
        let msg =
            |e: Error| candle_core::Error::Msg(format!("tensor-parallel {:?}: {e}", self.kind));
        let mut dims = shape.dims().to_vec();
        let rows = dims.first().copied().unwrap_or(1);
        let splits = matches!(self.kind, Kind::Scatter | Kind::ReduceScatter);
        if splits && (dims.is_empty() || !rows.is_multiple_of(n)) {
            candle_core::bail!(
                "sequence parallel: {rows} rows do not split over {n} tensor-parallel ranks"
            );
        }
        let out = match self.kind {
            Kind::Copy => v.to_vec(),
            Kind::Reduce => {
                let mut v = v.to_vec();
                self.group
                    .all_reduce_slice(&mut v, ReduceOp::Sum)
                    .map_err(msg)?;
                v
            }
            Kind::Scatter => {
                let per = v.len() / n;
                dims[0] = rows / n;
                v[r * per..(r + 1) * per].to_vec()
            }
            Kind::Gather => {
                if dims.is_empty() {
                    candle_core::bail!("sequence parallel: a tensor needs a sequence dimension");
                }
                dims[0] = rows * n;
                self.group.all_gather_vec(v).map_err(msg)?
            }
            Kind::ReduceScatter => {
                dims[0] = rows / n;
                self.group
                    .reduce_scatter_vec(v, ReduceOp::Sum)
                    .map_err(msg)?
            }
        };
        Ok((out, Shape::from(dims)))
    }
}

impl CustomOp1 for Collective {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "tp-copy",
            Kind::Reduce => "tp-reduce",
            Kind::Scatter => "sp-scatter",
            Kind::Gather => "sp-gather",
            Kind::ReduceScatter => "sp-reduce-scatter",
        }
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (v, shape) = self.run(elements(storage, layout)?, layout.shape())?;
        Ok((CpuStorage::F32(v), shape))
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let kind = match self.kind {
            Kind::Reduce => return Ok(Some(grad.clone())),
            Kind::Copy => Kind::Reduce,
            Kind::Scatter | Kind::ReduceScatter => Kind::Gather,
            Kind::Gather => Kind::ReduceScatter,
        };
        let back = Collective {
            group: self.group.clone(),
            kind,
        };
        grad.contiguous()?.apply_op1_no_bwd(&back).map(Some)
    }
}

fn apply(x: &Tensor, group: &Arc<dyn Communicator>, kind: Kind) -> Result<Tensor> {
    if group.world_size() == 1 {
        return Ok(x.clone());
    }
    let op = Collective {
        group: group.clone(),
        kind,
    };
    x.contiguous().and_then(|x| x.apply_op1(op)).map_err(candle)
}

/// Enter a sequence-parallel region from a replicated tensor: this rank's
/// rows of dimension 0 (the sequence), split evenly; the gradient is
/// all-gathered backward. Collective backward.
///
/// # Errors
/// candle's (an f32 tensor whose rows split evenly over the group).
pub fn scatter_to_sp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    apply(x, group, Kind::Scatter)
}

/// Leave a sequence-parallel region into a tensor-parallel one (before a
/// column-parallel layer): every rank's rows all-gathered along dimension
/// 0; the gradient is reduce-scattered backward (each rank keeps its
/// rows of the sum). Collective.
///
/// # Errors
/// candle's (an f32 tensor); the all-gather's.
pub fn gather_from_sp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    apply(x, group, Kind::Gather)
}

/// Leave a tensor-parallel region into a sequence-parallel one (after a
/// row-parallel layer's partial products): summed over the group and
/// scattered along dimension 0, each rank keeping its rows; the gradient
/// is all-gathered backward. Collective.
///
/// # Errors
/// candle's (an f32 tensor whose rows split evenly); the reduce-scatter's.
pub fn reduce_scatter_to_sp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    apply(x, group, Kind::ReduceScatter)
}

/// `vocab / tp` rows of an embedding table (Megatron's vocab-parallel
/// embedding): a rank looks up the ids in its range, zeros elsewhere, and
/// the rows are summed over the group, so every rank gets every id's row
/// while holding a part of the table.
#[derive(Clone)]
pub struct VocabParallelEmbedding {
    table: Var,
    start: usize,
    hidden: usize,
    group: Arc<dyn Communicator>,
}

impl std::fmt::Debug for VocabParallelEmbedding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VocabParallelEmbedding")
            .field("table", &self.table.shape())
            .field("start", &self.start)
            .finish_non_exhaustive()
    }
}

impl VocabParallelEmbedding {
    /// This rank's rows of `table` (`[vocab, hidden]`).
    ///
    /// # Errors
    /// `InvalidArgument` when the vocabulary does not split evenly over the
    /// group; candle's.
    pub fn from_full(
        table: &Tensor,
        group: Arc<dyn Communicator>,
    ) -> Result<VocabParallelEmbedding> {
        let (vocab, hidden) = table.dims2().map_err(candle)?;
        let (start, len) = chunk(vocab, &*group, "a vocab-parallel embedding")?;
        Ok(VocabParallelEmbedding {
            table: shard(table, 0, start, len)?,
            start,
            hidden,
            group,
        })
    }

    /// This rank's trainable rows.
    pub fn vars(&self) -> Vec<Var> {
        vec![self.table.clone()]
    }

    /// The rows of `ids` (u32, any shape, below 2^24: the range test runs
    /// in f32), `[.., hidden]`. Collective.
    ///
    /// # Errors
    /// candle's; the all-reduce's.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let rows = self.table.dim(0).map_err(candle)?;
        let (start, end) = (self.start as f64, (self.start + rows) as f64);
        let looked = (|| -> candle_core::Result<Tensor> {
            // Ids of other ranks look up row 0, then are zeroed.
            let (mine, local) = in_range(ids, start, end)?;
            let flat = local.flatten_all()?;
            let emb = self.table.as_tensor().index_select(&flat, 0)?;
            let emb = emb.broadcast_mul(&mine.flatten_all()?.unsqueeze(1)?)?;
            let mut shape = ids.dims().to_vec();
            shape.push(self.hidden);
            emb.reshape(shape)
        })()
        .map_err(candle)?;
        reduce_from_tp(&looked, &self.group)
    }
}

/// The mean cross entropy of `logits` against `targets` when each rank of
/// `group` holds the columns `vocab_start..vocab_start + V_local` of the
/// logits (`[n, V_local]`, f32; a column-parallel head's output): Megatron's
/// vocab-parallel cross entropy. The maxima are all-reduced (for a stable
/// softmax), then the sums of the exponentials and each target's logit (on
/// the rank that holds it); no rank holds the whole vocabulary. The
/// gradient each rank gets is its columns of the whole loss's gradient.
/// `targets` are u32 ids below 2^24 (the range test runs in f32).
/// Collective.
///
/// # Errors
/// candle's (shapes, an f32 tensor); the all-reduces'.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let (n, cols) = logits.dims2().map_err(candle)?;
    // A constant shift (no gradient): the largest logit of each row.
    let mut max: Vec<f32> = logits
        .detach()
        .max(D::Minus1)
        .and_then(|m| m.to_vec1())
        .map_err(candle)?;
    if group.world_size() > 1 {
        group.all_reduce_slice(&mut max, ReduceOp::Max)?;
    }
    let (start, end) = (vocab_start as f64, (vocab_start + cols) as f64);
    let (sum_exp, picked) = (|| -> candle_core::Result<(Tensor, Tensor)> {
        let m = Tensor::from_vec(max, (n, 1), logits.device())?;
        let shifted = logits.broadcast_sub(&m)?;
        let sum_exp = shifted.exp()?.sum(D::Minus1)?;
        // Targets of other ranks pick column 0, then are zeroed.
        let (mine, local) = in_range(targets, start, end)?;
        let picked = shifted
            .gather(&local.unsqueeze(1)?.contiguous()?, 1)?
            .squeeze(1)?
            .mul(&mine)?;
        Ok((sum_exp, picked))
    })()
    .map_err(candle)?;
    let sum_exp = reduce_from_tp(&sum_exp, group)?;
    let target = reduce_from_tp(&picked, group)?;
    (|| sum_exp.log()?.sub(&target)?.mean_all())().map_err(candle)
}

/// This rank's part of parameter `param` (the whole tensor `full`, of a
/// `kind` module) under `plan` on `group` (the `tp` group): what a loader
/// keeps of a full checkpoint. torch's chunking: `ceil(n / tp)` each, the
/// last rank's shorter.
///
/// # Errors
/// A shape the plan's style cannot split; candle's.
pub fn cut_by_plan(
    full: &Tensor,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let layout = p.layout(group.world_size())?;
    let b = layout.local_box(&[group.rank()])?;
    let mut t = full.clone();
    for (d, r) in b.iter().enumerate() {
        if r.len() != full.dim(d).map_err(candle)? {
            t = t.narrow(d, r.start, r.len()).map_err(candle)?;
        }
    }
    t.contiguous().map_err(candle)
}

/// The whole parameter `param` (shape `full_shape`, of a `kind` module)
/// from every rank's part `local` (as [`cut_by_plan`] cut it), gathered
/// over `group`: what a saver writes (`save_model`'s whole tensors in the
/// Hugging Face layout). Collective.
///
/// # Errors
/// A shape the plan's style cannot split; candle's; the gather's.
pub fn whole_by_plan(
    local: &Tensor,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let layout = p.layout(group.world_size())?;
    let Placement::Shard { dim } = layout.placements[0] else {
        return Ok(local.clone());
    };
    let flat: Vec<f32> = local
        .to_dtype(candle_core::DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1())
        .map_err(candle)?;
    let parts = group.all_gather_varsize(&flat)?;
    let pieces = parts
        .into_iter()
        .zip(layout.boxes())
        .filter(|(_, b)| b.iter().all(|r| !r.is_empty()))
        .map(|(data, b)| {
            let shape: Vec<usize> = b.iter().map(|r| r.len()).collect();
            Tensor::from_vec(data, shape, local.device())
        })
        .collect::<candle_core::Result<Vec<_>>>()
        .map_err(candle)?;
    Tensor::cat(&pieces, dim)
        .and_then(|t| t.to_dtype(local.dtype()))
        .map_err(candle)
}

/// This rank's part `local` of parameter `param` (shape `full_shape`, of
/// a `kind` module) under `plan`, as a chunk for
/// [`Accelerator::save_shards`](accel::Accelerator::save_shards): its
/// offsets in the whole tensor, its values in their own element type
/// (f16, bf16, f32, f64). `None` for a replicated parameter on every rank
/// of `group` but its first (one copy is written).
///
/// # Errors
/// A shape the plan's style cannot split, or a `local` of another shape
/// than the plan gives this rank; another element type; candle's.
pub fn shard_chunk(
    local: &Tensor,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Option<accel::train::ShardChunk>> {
    use candle_core::DType;
    let (param, full_shape) = (p.name, p.shape);
    let layout = p.layout(group.world_size())?;
    if layout.placements[0] == Placement::Replicate && group.rank() != 0 {
        return Ok(None);
    }
    let b = layout.local_box(&[group.rank()])?;
    let shape: Vec<usize> = b.iter().map(|r| r.len()).collect();
    if local.dims() != shape.as_slice() {
        return Err(Error::invalid_argument(
            "shard_chunk",
            format!(
                "{param}: this rank holds {:?}, but the plan gives it {shape:?} of {full_shape:?}",
                local.dims()
            ),
        ));
    }
    let flat = local.flatten_all().map_err(candle)?;
    let (dtype, bytes) = match local.dtype() {
        DType::F32 => (
            accel_api::DType::F32,
            le(flat.to_vec1::<f32>(), |v| v.to_le_bytes().to_vec())?,
        ),
        DType::F64 => (
            accel_api::DType::F64,
            le(flat.to_vec1::<f64>(), |v| v.to_le_bytes().to_vec())?,
        ),
        DType::BF16 => (
            accel_api::DType::BF16,
            le(flat.to_vec1::<half::bf16>(), |v| v.to_le_bytes().to_vec())?,
        ),
        DType::F16 => (
            accel_api::DType::F16,
            le(flat.to_vec1::<half::f16>(), |v| v.to_le_bytes().to_vec())?,
        ),
        other => {
            return Err(Error::invalid_argument(
                "shard_chunk",
                format!("{param} is {other:?}; weights are floating point"),
            ))
        }
    };
    Ok(Some(accel::train::ShardChunk {
        name: param.to_string(),
        offsets: b.iter().map(|r| r.start).collect(),
        shape,
        dtype,
        bytes,
    }))
}

/// Values' little-endian bytes, one value at a time.
fn le<T>(values: candle_core::Result<Vec<T>>, f: impl Fn(&T) -> Vec<u8>) -> Result<Vec<u8>> {
    Ok(values.map_err(candle)?.iter().flat_map(f).collect())
}

/// This rank's part of parameter `param` (shape `full_shape`, of a `kind`
/// module) under `plan` on `group`, read from a folder of torch's per-rank
/// shards written at any layout ([`Accelerator::save_shards`](accel::Accelerator::save_shards)
/// at another tensor-parallel size, torch's own writer): the chunks that
/// overlap this rank's box are read, the others' data is not. f32.
///
/// # Errors
/// As [`read_planned_part`](accel::train::read_planned_part) (a shape the
/// plan's style cannot split; overlapping chunks, a hole, a malformed
/// file); candle's.
pub fn load_by_plan(
    dir: &std::path::Path,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let t = accel::train::read_planned_part(dir, p, &**group)?;
    Tensor::from_vec(t.data, t.shape, &candle_core::Device::Cpu).map_err(candle)
}

/// A linear layer built by a tensor-parallel plan from the full weights of
/// a one-rank model: column-parallel where the plan says `colwise` (and
/// `colwise_rep`, `local_colwise`), row-parallel for `rowwise` (and its
/// variants), whole for `replicate` and for a module the plan does not name.
/// How a model is split is then data (a model's `base_model_tp_plan`), not
/// code: a column-parallel layer keeps its slice of the features, for the
/// row-parallel layer after it.
#[derive(Clone, Debug)]
pub enum PlannedLinear {
    /// `colwise`: this rank's output features.
    Column(ColumnParallelLinear),
    /// `rowwise`: this rank's input features, the outputs summed.
    Row(RowParallelLinear),
    /// `replicate`: the whole layer on every rank.
    Whole {
        /// `[out, in]`.
        weight: Var,
        /// `[out]`.
        bias: Option<Var>,
    },
}

impl PlannedLinear {
    /// Module `module`'s layer (`weight` `[out, in]` as
    /// `candle_nn::Linear`, its `bias`), split by `plan`'s style for
    /// `{module}.weight` over `group` (the `tp` group).
    ///
    /// # Errors
    /// `InvalidArgument` when the split features do not divide evenly over
    /// the group; candle's.
    pub fn from_full(
        module: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        plan: &TpPlan,
        group: Arc<dyn Communicator>,
    ) -> Result<PlannedLinear> {
        Ok(match plan.style(&format!("{module}.weight")) {
            TpStyle::Colwise => {
                PlannedLinear::Column(ColumnParallelLinear::from_full(weight, bias, group, false)?)
            }
            TpStyle::Rowwise => {
                PlannedLinear::Row(RowParallelLinear::from_full(weight, bias, group)?)
            }
            TpStyle::Replicate => PlannedLinear::Whole {
                weight: Var::from_tensor(weight).map_err(candle)?,
                bias: bias.map(Var::from_tensor).transpose().map_err(candle)?,
            },
        })
    }

    /// This rank's trainable tensors: the weight (or its shard), then the
    /// bias.
    pub fn vars(&self) -> Vec<Var> {
        match self {
            PlannedLinear::Column(c) => c.vars(),
            PlannedLinear::Row(r) => r.vars(),
            PlannedLinear::Whole { weight, bias } => std::iter::once(weight.clone())
                .chain(bias.clone())
                .collect(),
        }
    }

    /// The layer's forward: a column-parallel layer gives this rank's
    /// features, a row-parallel one takes them and gives the summed whole
    /// (collective), a whole layer `x · Wᵀ + b`.
    ///
    /// # Errors
    /// candle's; the collectives'.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            PlannedLinear::Column(c) => c.forward(x),
            PlannedLinear::Row(r) => r.forward(x),
            PlannedLinear::Whole { weight, bias } => {
                let y = x
                    .broadcast_matmul(&weight.as_tensor().t().map_err(candle)?)
                    .map_err(candle)?;
                match bias {
                    Some(b) => y.broadcast_add(b.as_tensor()).map_err(candle),
                    None => Ok(y),
                }
            }
        }
    }
}
