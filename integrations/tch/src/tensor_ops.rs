//! Collectives and metrics on `tch::Tensor`s: the Accelerator's `gather`,
//! `gather_for_metrics`, `reduce`, `pad_across_processes`, all-reduce and
//! broadcast, for tensors of every element type accel carries.

use accel::train::Batch;
use accel::{Accelerator, BufMut, CollectivesExt, Element, ReduceOp};
use accel_api::{DType, Error, Result};
use tch::{Device, Tensor};

use crate::ffi;

/// Run `$body` with `$t` bound to the Rust element type of `$dtype`
/// ([`accel_api::with_dtype!`]); `Unsupported` naming `$op` otherwise.
macro_rules! with_element {
    ($dtype:expr, $op:expr, $t:ident => $body:expr) => {
        accel_api::with_dtype!($dtype, $t => $body, else Err(Error::new(
            accel_api::ErrorKind::Unsupported,
            format!("{}: no tensor kind for {}", $op, $dtype),
        )))
    };
}

/// A CPU, contiguous version of `t` (the tensor itself when it already is;
/// a copy otherwise) and the device to return results to.
fn host_copy(t: &Tensor) -> (Tensor, Device) {
    let device = t.device();
    let host = if device == Device::Cpu {
        t.contiguous()
    } else {
        t.to_device(Device::Cpu).contiguous()
    };
    (host, device)
}

fn dtype(t: &Tensor, op: &str) -> Result<DType> {
    ffi::dtype_of(t.kind()).ok_or_else(|| {
        Error::new(
            accel_api::ErrorKind::Unsupported,
            format!(
                "{op}: tensors of kind {:?} have no accel element type",
                t.kind()
            ),
        )
    })
}

/// A tensor of `shape` holding `data`, on `device`.
fn tensor_from<T: Element>(data: &[T], shape: &[i64], device: Device) -> Result<Tensor> {
    let kind = ffi::kind_of(T::DTYPE).expect("every accel dtype has a kind");
    let bytes: &[u8] = bytemuck::cast_slice(data);
    let t = Tensor::f_from_data_size(bytes, shape, kind).map_err(|e| {
        Error::new(
            accel_api::ErrorKind::Backend,
            format!("making a tensor: {e}"),
        )
    })?;
    Ok(if device == Device::Cpu {
        t
    } else {
        t.to_device(device)
    })
}

/// Tensor versions of the [`Accelerator`]'s collectives and metrics.
///
/// # Behavior
/// CPU tensors travel through zero-copy views of their memory (a
/// non-contiguous tensor is made contiguous first, which copies). CUDA
/// tensors go to the backend as device views when it takes device memory
/// ([`all_reduce_tensor`](Self::all_reduce_tensor),
/// [`broadcast_tensor`](Self::broadcast_tensor)), and through a host copy for
/// the gathers, which are built from host collectives. Results keep the
/// input's kind and device. Every method is collective.
pub trait TensorCollectives {
    /// All-reduce `t` in place with `op`.
    ///
    /// # Errors
    /// The communicator's; [`InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// for a non-contiguous tensor.
    fn all_reduce_tensor(&self, t: &mut Tensor, op: ReduceOp) -> Result<()>;

    /// Broadcast `t` from `root` into every rank's `t`, in place.
    ///
    /// # Errors
    /// As [`all_reduce_tensor`](Self::all_reduce_tensor).
    fn broadcast_tensor(&self, t: &mut Tensor, root: usize) -> Result<()>;

    /// Every rank's `t` concatenated along dimension 0, in rank order
    /// (Accelerate's `gather`); the first dimension may differ across ranks,
    /// the others must agree. A 0-d tensor gathers as one row.
    ///
    /// # Errors
    /// The communicator's; [`Mismatch`](accel_api::ErrorKind::Mismatch)-like
    /// invalid-argument errors when the trailing dimensions differ.
    fn gather_tensor(&self, t: &Tensor) -> Result<Tensor>;

    /// [`gather_tensor`](Self::gather_tensor) without the samples the loader
    /// duplicated to even out the last batch (Accelerate's
    /// `gather_for_metrics`): one row of `t` per sample of `batch`.
    ///
    /// # Errors
    /// As [`gather_tensor`](Self::gather_tensor).
    fn gather_tensor_for_metrics<I>(&self, t: &Tensor, batch: &Batch<I>) -> Result<Tensor>;

    /// `t` reduced across ranks by name: `sum`, `mean`, `max`, `min`, `prod`.
    ///
    /// # Errors
    /// An unknown reduction name is an error, never a silent sum.
    fn reduce_tensor(&self, t: &Tensor, reduction: &str) -> Result<Tensor>;

    /// `t` padded with `pad_value` along `dim` to the largest size across
    /// ranks (at the start with `pad_first`), so that it can be gathered.
    ///
    /// # Errors
    /// As the Accelerator's `pad_across_processes`.
    fn pad_tensor_across_processes(
        &self,
        t: &Tensor,
        dim: usize,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor>;
}

fn check_trailing(acc: &Accelerator, shape: &[i64]) -> Result<()> {
    let tail: Vec<i64> = shape.iter().skip(1).copied().collect();
    let all = acc.comm().gather_object(&tail)?;
    if let Some((r, other)) = all.iter().enumerate().find(|(_, s)| **s != tail) {
        return Err(Error::invalid_argument(
            "gather_tensor",
            format!(
                "rank {} has trailing dimensions {tail:?}, rank {r} has {other:?}; only dimension 0 may differ",
                acc.rank()
            ),
        )
        .with_fix("pad_tensor_across_processes first, or reshape to agree"));
    }
    Ok(())
}

fn gather_rows(acc: &Accelerator, t: &Tensor, keep: Option<(bool, usize)>) -> Result<Tensor> {
    const OP: &str = "gather_tensor";
    let (host, device) = host_copy(t);
    let mut shape = host.size();
    if shape.is_empty() {
        shape.push(1);
    }
    check_trailing(acc, &shape)?;
    let row: i64 = shape[1..].iter().product();
    let dt = dtype(&host, OP)?;
    with_element!(dt, OP, T => {
        let data = ffi::host_slice::<T>(&host)?;
        let all = match keep {
            None => acc.gather_varsize(data)?,
            Some((end_of_dataloader, remainder)) => {
                let batch = Batch::<()> {
                    items: Vec::new(),
                    indices: Vec::new(),
                    epoch: 0,
                    index: 0,
                    end_of_dataloader,
                    remainder,
                };
                acc.gather_for_metrics_rows(data, row.max(1) as usize, &batch)?
            }
        };
        let rows = if row == 0 { 0 } else { all.len() as i64 / row };
        let mut out_shape = shape.clone();
        out_shape[0] = rows;
        tensor_from(&all, &out_shape, device)
    })
}

/// A writable view of `t`: of its device memory on CUDA, of its host
/// memory otherwise.
pub(crate) fn view_mut(t: &mut Tensor) -> Result<BufMut<'_>> {
    Ok(if let Device::Cuda(_) = t.device() {
        BufMut::Device(ffi::device_view_mut(t)?)
    } else {
        BufMut::Host(ffi::host_view_mut(t)?)
    })
}

impl TensorCollectives for Accelerator {
    fn all_reduce_tensor(&self, t: &mut Tensor, op: ReduceOp) -> Result<()> {
        self.comm().all_reduce(view_mut(t)?, op)
    }

    fn broadcast_tensor(&self, t: &mut Tensor, root: usize) -> Result<()> {
        self.comm().broadcast(view_mut(t)?, root)
    }

    fn gather_tensor(&self, t: &Tensor) -> Result<Tensor> {
        gather_rows(self, t, None)
    }

    fn gather_tensor_for_metrics<I>(&self, t: &Tensor, batch: &Batch<I>) -> Result<Tensor> {
        gather_rows(self, t, Some((batch.end_of_dataloader, batch.remainder)))
    }

    fn reduce_tensor(&self, t: &Tensor, reduction: &str) -> Result<Tensor> {
        const OP: &str = "reduce_tensor";
        let (host, device) = host_copy(t);
        let dt = dtype(&host, OP)?;
        with_element!(dt, OP, T => {
            let data = ffi::host_slice::<T>(&host)?;
            let out = self.reduce(data, reduction)?;
            tensor_from(&out, &host.size(), device)
        })
    }

    fn pad_tensor_across_processes(
        &self,
        t: &Tensor,
        dim: usize,
        pad_value: f64,
        pad_first: bool,
    ) -> Result<Tensor> {
        const OP: &str = "pad_tensor_across_processes";
        let (host, device) = host_copy(t);
        let dt = dtype(&host, OP)?;
        let shape: Vec<usize> = host.size().iter().map(|&d| d as usize).collect();
        with_element!(dt, OP, T => {
            let data = ffi::host_slice::<T>(&host)?;
            // The pad value in the tensor's own type, as libtorch casts it.
            let pad_t = Tensor::from(pad_value).to_kind(host.kind());
            let pad: T = ffi::host_slice::<T>(&pad_t)?[0];
            let (out, out_shape) = self.pad_across_processes(data, &shape, dim, pad, pad_first)?;
            let out_shape: Vec<i64> = out_shape.iter().map(|&d| d as i64).collect();
            tensor_from(&out, &out_shape, device)
        })
    }
}
