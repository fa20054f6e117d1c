//! Tensor parallelism for candle (issue 39): Megatron's column- and
//! row-parallel linear layers, each cut from the full weight of a one-rank
//! model by the rank's place in its tensor-parallel group (the mesh's `tp`
//! group), with the collectives of the forward pass where Megatron puts
//! them. Inference only so far: the backward's collectives are not there.
//!
//! A column-parallel layer holds `out / tp` rows of the weight (and of the
//! bias): its output is this rank's slice of the features, all-gathered
//! when asked. A row-parallel layer holds `in / tp` columns and takes the
//! matching slice of its input: the partial products are all-reduced, then
//! the (whole) bias is added. A column-parallel layer followed by a
//! row-parallel one (attention's heads, an MLP's hidden units) needs one
//! all-reduce and no gather.

use std::sync::Arc;

use accel_api::{Communicator, CommunicatorExt, Error, ErrorKind, ReduceOp, Result};
use candle_core::{Tensor, D};

fn candle(e: candle_core::Error) -> Error {
    Error::new(ErrorKind::Backend, format!("candle: {e}"))
}

/// This rank's chunk of `n` over `group` (`n` must divide evenly).
fn chunk(n: usize, group: &dyn Communicator, what: &str) -> Result<(usize, usize)> {
    let tp = group.world_size();
    if !n.is_multiple_of(tp) {
        return Err(Error::invalid_argument(
            "tensor parallel",
            format!(
                "{what} has {n} features, which {tp} tensor-parallel ranks cannot split evenly"
            ),
        )
        .with_fix("choose a tp size that divides the layer's features"));
    }
    let per = n / tp;
    Ok((group.rank() * per, per))
}

/// The sum of `t` over `group`, in place of `t`.
fn all_reduce_sum(t: &Tensor, group: &dyn Communicator) -> Result<Tensor> {
    let shape = t.shape().clone();
    let mut v: Vec<f32> = t.flatten_all().and_then(|f| f.to_vec1()).map_err(candle)?;
    group
        .all_reduce_slice(&mut v, ReduceOp::Sum)
        .map_err(|e| e.with_op("row-parallel linear: all_reduce"))?;
    Tensor::from_vec(v, shape, t.device()).map_err(candle)
}

/// `out / tp` output features of a linear layer.
#[derive(Clone)]
pub struct ColumnParallelLinear {
    weight: Tensor,
    bias: Option<Tensor>,
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
    /// forward (else each rank keeps its slice, for a row-parallel layer).
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
        let (start, len) = chunk(
            weight.dim(0).map_err(candle)?,
            &*group,
            "a column-parallel layer",
        )?;
        let weight = weight
            .narrow(0, start, len)
            .and_then(|w| w.contiguous())
            .map_err(candle)?;
        let bias = bias
            .map(|b| b.narrow(0, start, len).and_then(|b| b.contiguous()))
            .transpose()
            .map_err(candle)?;
        Ok(ColumnParallelLinear {
            weight,
            bias,
            group,
            gather_output,
        })
    }

    /// `x · Wᵀ + b` for this rank's features (all of them, gathered, with
    /// `gather_output`). Collective with `gather_output`.
    ///
    /// # Errors
    /// candle's; the all-gather's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = candle_nn::Module::forward(
            &candle_nn::Linear::new(self.weight.clone(), self.bias.clone()),
            x,
        )
        .map_err(candle)?;
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
    weight: Tensor,
    bias: Option<Tensor>,
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
        let (start, len) = chunk(
            weight.dim(1).map_err(candle)?,
            &*group,
            "a row-parallel layer",
        )?;
        let weight = weight
            .narrow(1, start, len)
            .and_then(|w| w.contiguous())
            .map_err(candle)?;
        Ok(RowParallelLinear {
            weight,
            bias: bias.cloned(),
            group,
        })
    }

    /// `Σ_ranks x_r · W_rᵀ + b`, `x_r` this rank's slice of the input
    /// features (a column-parallel layer's output). Collective.
    ///
    /// # Errors
    /// candle's; the all-reduce's.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let partial =
            candle_nn::Module::forward(&candle_nn::Linear::new(self.weight.clone(), None), x)
                .map_err(candle)?;
        let y = if self.group.world_size() == 1 {
            partial
        } else {
            all_reduce_sum(&partial, &*self.group)?
        };
        match &self.bias {
            Some(b) => y.broadcast_add(b).map_err(candle),
            None => Ok(y),
        }
    }
}
