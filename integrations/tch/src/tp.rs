//! Tensor parallelism for tch (issue 39): Megatron's column- and
//! row-parallel linear layers, the vocab-parallel embedding and cross
//! entropy, each cut from the full weight of a one-rank model by the rank's
//! place in its tensor-parallel group (the mesh's `tp` group), with the
//! collectives where Megatron puts them, forward and backward.
//!
//! The collectives are libtorch autograd functions (a C++
//! `torch::autograd::Function` in the crate's shim whose sums run through
//! accel's communicator): [`copy_to_tp`] is Megatron's `f` (forward
//! unchanged, backward the gradient summed over the group: a
//! column-parallel layer's input), [`reduce_from_tp`] its `g` (forward
//! summed, backward unchanged: a row-parallel layer's output). A
//! column-parallel layer followed by a row-parallel one (attention's heads,
//! an MLP's hidden units) costs one all-reduce forward and one backward.
//!
//! The shards are variables of the `VarStore` path they are made in, so a
//! [`TchModel`](crate::TchModel) over that store trains them (and ZeRO
//! shards them over the mesh's `dp` group). The sums in a backward run on
//! the thread that calls `backward()` (libtorch's CPU engine); a failed sum
//! makes libtorch's backward fail with accel's message (use
//! `f_backward` to get it as an error). The names and semantics are
//! `accel_candle::tp`'s (candle's column-parallel layer can also gather
//! its output for inference). The collectives in a backward are not
//! recorded by autograd: a double backward (`create_graph`) through them is
//! not supported, as in Megatron's own.
//!
//! Sequence parallelism (Megatron's), as in candle: between the
//! tensor-parallel blocks, norms and dropout run on `seq / tp` rows each
//! ([`scatter_to_sp`]); a block is entered with [`gather_from_sp`] (a
//! column-parallel layer's [`forward_sequence_parallel`](ColumnParallelLinear::forward_sequence_parallel))
//! and left with a row-parallel layer's
//! [`forward_sequence_parallel`](RowParallelLinear::forward_sequence_parallel)
//! (a reduce-scatter in place of the all-reduce). A replicated parameter
//! used on the rows (a norm's scale, the row-parallel bias) gets a partial
//! gradient on each rank: sum them over the group with
//! [`sum_partial_grads`] before the optimizer step, as Megatron does.
//!
//! A tensor-parallel plan (transformers' `tp_plan` vocabulary,
//! [`TpPlan`]) builds the layers ([`PlannedLinear`]), cuts a full
//! checkpoint's tensor to a rank's part ([`cut_by_plan`]), gathers the
//! whole tensor back for a save ([`whole_by_plan`]), and writes and reads
//! a rank's parts in torch's per-rank checkpoint layout ([`shard_chunk`]
//! with `Accelerator::save_shards`, [`load_by_plan`] at any tensor-parallel
//! size).

use std::sync::Arc;

use accel::CollectivesExt;
use accel_api::{Communicator, Error, ErrorKind, ReduceOp, Result};
use accel_sharding::placement::Placement;
use accel_sharding::tp_plan::even_split;
pub use accel_sharding::tp_plan::{ModuleKind, Planned, TpPlan, TpStyle};
use tch::{nn, Kind, Tensor};

use crate::ffi::{tp_apply, TpCollective};

/// Megatron's `f`: `x` unchanged forward, its gradient summed over
/// `group` backward (the input of a column-parallel layer).
///
/// # Errors
/// libtorch's, when the function cannot be applied.
pub fn copy_to_tp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    tp_apply(x, group, TpCollective::CopyToTp)
}

/// Megatron's `g`: `x` summed over `group` forward, its gradient unchanged
/// backward (the output of a row-parallel layer). Collective.
///
/// # Errors
/// The all-reduce's (a CPU or CUDA tensor of a kind accel carries).
pub fn reduce_from_tp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    tp_apply(x, group, TpCollective::ReduceFromTp)
}

/// Into a sequence-parallel region: a replicated `x` becomes this rank's
/// `1/tp` of its rows (dimension 0, the sequence); backward, the rows'
/// gradients are put back together with an all-gather.
///
/// # Errors
/// A first dimension that `tp` does not divide.
pub fn scatter_to_sp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    tp_apply(x, group, TpCollective::ScatterToSp)
}

/// Out of a sequence-parallel region, before a column-parallel layer:
/// the ranks' rows concatenated in rank order (an all-gather); backward,
/// the gradient is summed over the group and each rank keeps its own rows
/// (a reduce-scatter).
///
/// # Errors
/// The all-gather's.
pub fn gather_from_sp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    tp_apply(x, group, TpCollective::GatherFromSp)
}

/// Into a sequence-parallel region, after a row-parallel layer's partial
/// products: their sum over the group, of which each rank keeps its own
/// rows (a reduce-scatter, in place of `g`'s all-reduce); backward, an
/// all-gather of the rows' gradients.
///
/// # Errors
/// A first dimension that `tp` does not divide; the reduce-scatter's.
pub fn reduce_scatter_to_sp(x: &Tensor, group: &Arc<dyn Communicator>) -> Result<Tensor> {
    tp_apply(x, group, TpCollective::ReduceScatterToSp)
}

/// Sum over `group` the gradients of replicated parameters that were used
/// on this rank's rows only (a norm's scale and shift between
/// sequence-parallel regions, a row-parallel layer's bias under
/// [`RowParallelLinear::forward_sequence_parallel`]): each rank's backward
/// gives a partial gradient, and Megatron all-reduces them over the
/// tensor-parallel group before the optimizer step, so that the replicas
/// stay equal. Parameters without a gradient are skipped. Collective.
///
/// # Errors
/// The all-reduces'.
pub fn sum_partial_grads(params: &[&Tensor], group: &Arc<dyn Communicator>) -> Result<()> {
    for p in params {
        let mut g = p.grad();
        if g.defined() {
            if !g.is_contiguous() {
                let c = g.contiguous();
                g.set_data(&c);
            }
            group.all_reduce(crate::tensor_ops::view_mut(&mut g)?, ReduceOp::Sum)?;
        }
    }
    Ok(())
}

fn torch(op: &str, e: tch::TchError) -> Error {
    Error::new(ErrorKind::Backend, format!("{op}: libtorch: {e}"))
}

/// A trainable variable `name` in `path` holding `len` entries of `t`
/// along `dim` from `start`.
fn shard(
    path: &nn::Path<'_>,
    name: &str,
    t: &Tensor,
    dim: i64,
    start: usize,
    len: usize,
) -> Tensor {
    path.var_copy(name, &t.narrow(dim, start as i64, len as i64))
}

fn dim(t: &Tensor, d: usize, what: &str) -> Result<usize> {
    let size = t.size();
    size.get(d).map(|&n| n as usize).ok_or_else(|| {
        Error::invalid_argument(
            "tensor parallel",
            format!("{what}: the weight has shape {size:?}, which has no dimension {d}"),
        )
    })
}

/// `out / tp` output features of a linear layer.
#[derive(Debug)]
pub struct ColumnParallelLinear {
    /// This rank's rows of the weight, `[out / tp, in]`.
    pub weight: Tensor,
    /// This rank's part of the bias.
    pub bias: Option<Tensor>,
    group: Arc<dyn Communicator>,
}

impl ColumnParallelLinear {
    /// Variables `weight` and `bias` in `path` holding this rank's rows of
    /// `weight` (`[out, in]`, as `nn::Linear`) and of `bias`.
    ///
    /// # Errors
    /// `InvalidArgument` when `out` does not split evenly over the group.
    pub fn from_full(
        path: &nn::Path<'_>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        group: Arc<dyn Communicator>,
    ) -> Result<ColumnParallelLinear> {
        let out = dim(weight, 0, "a column-parallel layer")?;
        let (start, len) = even_split(
            out,
            group.world_size(),
            group.rank(),
            "a column-parallel layer",
        )?;
        Ok(ColumnParallelLinear {
            weight: shard(path, "weight", weight, 0, start, len),
            bias: bias.map(|b| shard(path, "bias", b, 0, start, len)),
            group,
        })
    }

    /// `x · Wᵀ + b` for this rank's output features; backward, `x`'s
    /// gradient is summed over the group.
    ///
    /// # Errors
    /// As [`copy_to_tp`].
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = copy_to_tp(x, &self.group)?;
        Ok(x.linear(&self.weight, self.bias.as_ref()))
    }

    /// [`forward`](Self::forward) entering from a sequence-parallel region
    /// (Megatron's sequence parallelism): `x` is this rank's rows of
    /// dimension 0 (the sequence), all-gathered first ([`gather_from_sp`],
    /// whose backward reduce-scatters `x`'s gradient). Collective.
    ///
    /// # Errors
    /// The all-gather's.
    pub fn forward_sequence_parallel(&self, x: &Tensor) -> Result<Tensor> {
        let x = gather_from_sp(x, &self.group)?;
        Ok(x.linear(&self.weight, self.bias.as_ref()))
    }
}

/// `in / tp` input features of a linear layer.
#[derive(Debug)]
pub struct RowParallelLinear {
    /// This rank's columns of the weight, `[out, in / tp]`.
    pub weight: Tensor,
    /// The whole bias (added once, after the sum).
    pub bias: Option<Tensor>,
    group: Arc<dyn Communicator>,
}

impl RowParallelLinear {
    /// Variables `weight` and `bias` in `path` holding this rank's columns
    /// of `weight` (`[out, in]`) and the whole `bias`.
    ///
    /// # Errors
    /// `InvalidArgument` when `in` does not split evenly over the group.
    pub fn from_full(
        path: &nn::Path<'_>,
        weight: &Tensor,
        bias: Option<&Tensor>,
        group: Arc<dyn Communicator>,
    ) -> Result<RowParallelLinear> {
        let inp = dim(weight, 1, "a row-parallel layer")?;
        let (start, len) = even_split(
            inp,
            group.world_size(),
            group.rank(),
            "a row-parallel layer",
        )?;
        Ok(RowParallelLinear {
            weight: shard(path, "weight", weight, 1, start, len),
            bias: bias.map(|b| path.var_copy("bias", b)),
            group,
        })
    }

    /// `Σ_ranks x_r · W_rᵀ + b`, `x_r` this rank's slice of the input
    /// features (a column-parallel layer's output). Collective.
    ///
    /// # Errors
    /// The all-reduce's.
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
    /// The reduce-scatter's (the sequence must split evenly).
    pub fn forward_sequence_parallel(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, true)
    }

    fn forward_with(&self, x: &Tensor, sequence_parallel: bool) -> Result<Tensor> {
        let partial = x.linear::<Tensor>(&self.weight, None);
        let y = if sequence_parallel {
            reduce_scatter_to_sp(&partial, &self.group)?
        } else {
            reduce_from_tp(&partial, &self.group)?
        };
        Ok(match &self.bias {
            Some(b) => y + b,
            None => y,
        })
    }
}

/// 1 where an id is in `start..end`, 0 elsewhere (`Int64`), and the ids
/// less `start` where they are (0 elsewhere).
fn in_range(ids: &Tensor, start: i64, end: i64) -> (Tensor, Tensor) {
    let mine = ids.ge(start).logical_and(&ids.lt(end)).to_kind(Kind::Int64);
    let local = (ids - start) * &mine;
    (mine, local)
}

/// `vocab / tp` rows of an embedding table.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    /// This rank's rows of the table, `[vocab / tp, hidden]`.
    pub table: Tensor,
    start: usize,
    group: Arc<dyn Communicator>,
}

impl VocabParallelEmbedding {
    /// A variable `weight` in `path` holding this rank's rows of `table`
    /// (`[vocab, hidden]`).
    ///
    /// # Errors
    /// `InvalidArgument` when the vocabulary does not split evenly over the
    /// group.
    pub fn from_full(
        path: &nn::Path<'_>,
        table: &Tensor,
        group: Arc<dyn Communicator>,
    ) -> Result<VocabParallelEmbedding> {
        let vocab = dim(table, 0, "a vocab-parallel embedding")?;
        let (start, len) = even_split(
            vocab,
            group.world_size(),
            group.rank(),
            "a vocab-parallel embedding",
        )?;
        Ok(VocabParallelEmbedding {
            table: shard(path, "weight", table, 0, start, len),
            start,
            group,
        })
    }

    /// The rows of `ids` (`Int64`, any shape), `[.., hidden]`. Collective.
    ///
    /// # Errors
    /// The all-reduce's.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let rows = self.table.size()[0];
        let start = self.start as i64;
        // Ids of other ranks look up row 0, then are zeroed.
        let (mine, local) = in_range(ids, start, start + rows);
        let looked = Tensor::embedding(&self.table, &local, -1, false, false)
            * mine.unsqueeze(-1).to_kind(self.table.kind());
        reduce_from_tp(&looked, &self.group)
    }
}

/// Megatron's vocab-parallel cross entropy: the mean over rows of the
/// whole vocabulary's cross entropy, from this rank's columns
/// `vocab_start..vocab_start + V_local` of the logits (`[n, V_local]`, a
/// column-parallel head's output) and the `Int64` `targets`. Three sums
/// over the group (each row's largest logit, for a stable softmax; the
/// exponentials; the target's logit, from the rank whose columns hold it),
/// so no rank ever holds all the logits; backward, each rank gets its
/// columns of the whole loss's gradient. Collective.
///
/// # Errors
/// `InvalidArgument` for logits that are not `[n, V_local]`; the
/// all-reduces'.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let &[_, cols] = logits.size().as_slice() else {
        return Err(Error::invalid_argument(
            "vocab_parallel_cross_entropy",
            format!(
                "the logits have shape {:?}; [rows, this rank's vocabulary] is needed",
                logits.size()
            ),
        ));
    };
    // A constant shift (no gradient): the largest logit of each row.
    let mut max = logits
        .detach()
        .f_amax([1i64].as_slice(), false)
        .map_err(|e| torch("vocab_parallel_cross_entropy", e))?
        .contiguous();
    if group.world_size() > 1 {
        group.all_reduce(crate::tensor_ops::view_mut(&mut max)?, ReduceOp::Max)?;
    }
    let shifted = logits - max.unsqueeze(1);
    let sum_exp = shifted.exp().sum_dim_intlist(1, false, None::<Kind>);
    let start = vocab_start as i64;
    // Targets of other ranks pick column 0, then are zeroed.
    let (mine, local) = in_range(targets, start, start + cols);
    let picked =
        shifted.gather(1, &local.unsqueeze(1), false).squeeze_dim(1) * mine.to_kind(logits.kind());
    let sum_exp = reduce_from_tp(&sum_exp, group)?;
    let target = reduce_from_tp(&picked, group)?;
    Ok((sum_exp.log() - target).mean(None::<Kind>))
}

/// This rank's part of a parameter (the whole tensor `full`) under the
/// plan on `group` (the `tp` group): what a loader keeps of a full
/// checkpoint. torch's chunking: `ceil(n / tp)` each, the last rank's
/// shorter.
///
/// # Errors
/// A shape the plan's style cannot split.
pub fn cut_by_plan(
    full: &Tensor,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let b = p.layout(group.world_size())?.local_box(&[group.rank()])?;
    let mut t = full.shallow_clone();
    for (d, r) in b.iter().enumerate() {
        t = t.narrow(d as i64, r.start as i64, r.len() as i64);
    }
    Ok(t.contiguous())
}

/// The whole parameter from every rank's part `local` (as [`cut_by_plan`]
/// cut it), gathered over `group` (as f32 values), in `local`'s kind and on
/// its device: what a saver writes (`save_model`'s whole tensors in the
/// Hugging Face layout). Collective.
///
/// # Errors
/// A shape the plan's style cannot split; the gather's.
pub fn whole_by_plan(
    local: &Tensor,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let layout = p.layout(group.world_size())?;
    let Placement::Shard { dim } = layout.placements[0] else {
        return Ok(local.shallow_clone());
    };
    let flat = Vec::<f32>::try_from(local.flatten(0, -1).to_kind(Kind::Float))
        .map_err(|e| torch("whole_by_plan", e))?;
    let parts = group.all_gather_varsize(&flat)?;
    let pieces: Vec<Tensor> = parts
        .into_iter()
        .zip(layout.boxes())
        .filter(|(_, b)| b.iter().all(|r| !r.is_empty()))
        .map(|(data, b)| {
            let shape: Vec<i64> = b.iter().map(|r| r.len() as i64).collect();
            Tensor::from_slice(&data).reshape(shape)
        })
        .collect();
    Ok(Tensor::cat(&pieces, dim as i64)
        .to_kind(local.kind())
        .to_device(local.device()))
}

/// This rank's part `local` of a parameter under the plan, as a chunk for
/// [`Accelerator::save_shards`](accel::Accelerator::save_shards): its
/// offsets in the whole tensor, its values in their own element type (f16,
/// bf16, f32, f64; a CUDA tensor is copied to the host). `None` for a
/// replicated parameter on every rank of `group` but its first (one copy
/// is written).
///
/// # Errors
/// A shape the plan's style cannot split, or a `local` of another shape
/// than the plan gives this rank; a kind accel has no element type for.
pub fn shard_chunk(
    local: &Tensor,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Option<accel::train::ShardChunk>> {
    let layout = p.layout(group.world_size())?;
    if layout.placements[0] == Placement::Replicate && group.rank() != 0 {
        return Ok(None);
    }
    let b = layout.local_box(&[group.rank()])?;
    let shape: Vec<usize> = b.iter().map(|r| r.len()).collect();
    let dims: Vec<usize> = local.size().iter().map(|&d| d.max(0) as usize).collect();
    if dims != shape {
        return Err(Error::invalid_argument(
            "shard_chunk",
            format!(
                "{}: this rank holds {dims:?}, but the plan gives it {shape:?} of {:?}",
                p.name, p.shape
            ),
        ));
    }
    if !matches!(
        local.kind(),
        Kind::Half | Kind::BFloat16 | Kind::Float | Kind::Double
    ) {
        return Err(Error::invalid_argument(
            "shard_chunk",
            format!(
                "{} is {:?}; weights are floating point",
                p.name,
                local.kind()
            ),
        ));
    }
    let host = local.to_device(tch::Device::Cpu).contiguous();
    let view = crate::ffi::host_view(&host)?;
    Ok(Some(accel::train::ShardChunk {
        name: p.name.to_string(),
        offsets: b.iter().map(|r| r.start).collect(),
        shape,
        dtype: view.dtype(),
        bytes: view.bytes().to_vec(),
    }))
}

/// This rank's part of a parameter under the plan on `group`, read from a
/// folder of torch's per-rank shards written at any layout
/// ([`Accelerator::save_shards`](accel::Accelerator::save_shards) at
/// another tensor-parallel size, torch's own writer): only the chunks that
/// overlap this rank's box are read. An f32 CPU tensor.
///
/// # Errors
/// As [`read_planned_part`](accel::train::read_planned_part) (a shape the
/// plan's style cannot split; overlapping chunks, a hole, a malformed
/// file).
pub fn load_by_plan(
    dir: &std::path::Path,
    p: &Planned<'_>,
    group: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let t = accel::train::read_planned_part(dir, p, &**group)?;
    let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
    Ok(Tensor::from_slice(&t.data).reshape(shape))
}

/// A linear layer built by a tensor-parallel plan from the full weights of
/// a one-rank model: column-parallel where the plan says `colwise` (and
/// its variants), row-parallel for `rowwise`, whole for `replicate` and
/// for a module the plan does not name. How a model is split is then data
/// (a model's `base_model_tp_plan`), not code.
#[derive(Debug)]
pub enum PlannedLinear {
    /// `colwise`: this rank's output features.
    Column(ColumnParallelLinear),
    /// `rowwise`: this rank's input features, the outputs summed.
    Row(RowParallelLinear),
    /// `replicate`: the whole layer on every rank.
    Whole {
        /// `[out, in]`.
        weight: Tensor,
        /// `[out]`.
        bias: Option<Tensor>,
    },
}

impl PlannedLinear {
    /// Module `module`'s layer (`weight` `[out, in]`, its `bias`) as
    /// variables of `path`, split by `plan`'s style for `{module}.weight`
    /// over `group` (the `tp` group).
    ///
    /// # Errors
    /// `InvalidArgument` when the split features do not divide evenly over
    /// the group.
    pub fn from_full(
        path: &nn::Path<'_>,
        module: &str,
        weight: &Tensor,
        bias: Option<&Tensor>,
        plan: &TpPlan,
        group: Arc<dyn Communicator>,
    ) -> Result<PlannedLinear> {
        Ok(match plan.style(&format!("{module}.weight")) {
            TpStyle::Colwise => {
                PlannedLinear::Column(ColumnParallelLinear::from_full(path, weight, bias, group)?)
            }
            TpStyle::Rowwise => {
                PlannedLinear::Row(RowParallelLinear::from_full(path, weight, bias, group)?)
            }
            TpStyle::Replicate => PlannedLinear::Whole {
                weight: path.var_copy("weight", weight),
                bias: bias.map(|b| path.var_copy("bias", b)),
            },
        })
    }

    /// The layer's forward: a column-parallel layer gives this rank's
    /// features, a row-parallel one takes them and gives the summed whole
    /// (collective), a whole layer `x · Wᵀ + b`.
    ///
    /// # Errors
    /// The collectives'.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            PlannedLinear::Column(c) => c.forward(x),
            PlannedLinear::Row(r) => r.forward(x),
            PlannedLinear::Whole { weight, bias } => Ok(x.linear(weight, bias.as_ref())),
        }
    }
}
