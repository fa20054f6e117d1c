//! A candle-nn [`VarMap`] as the training loop's [`Parameters`].

use std::cell::RefCell;

use accel::train::{ParamMut, ParamRef, Parameters};
use accel_api::{Buf, BufMut, Error, ErrorKind, Result};
use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, InplaceOp1, Layout, Storage, Tensor, Var};
use candle_nn::VarMap;

use crate::candle_err;

/// One trainable variable and the gradient buffer accel views.
#[derive(Debug)]
pub(crate) struct Param {
    pub(crate) name: String,
    pub(crate) var: Var,
    /// Same shape, dtype and device as `var`, contiguous, its own storage:
    /// the gradient accel averages, clips and the optimizer reads.
    pub(crate) grad: Tensor,
}

/// The variables of a candle-nn [`VarMap`], in name order, seen by accel's
/// training loop as [`Parameters`].
///
/// # Views and copies
/// Values are host views of the variables' own CPU storage: read through
/// candle's storage lock, written in place through a candle in-place op
/// (no copy either way; the broadcast at `prepare_model`, `load_state` and
/// accel's optimizers write straight into the `Var`s).
///
/// candle's autograd returns each backward pass's gradients as new tensors
/// in a [`GradStore`]; accel needs one gradient buffer per variable that
/// stays put across an accumulation group. So each variable has a
/// gradient tensor of its own (its shape and dtype), and
/// [`backward`](Self::backward) / [`add_grads`](Self::add_grads) add
/// candle's gradient into it: **one copy from candle to accel** per
/// variable and backward pass (an add, which is also the accumulation).
/// accel averages, unscales and clips that buffer in place, and a
/// [`CandleOptimizer`](crate::CandleOptimizer) hands the same tensors to
/// candle-nn's optimizer in a `GradStore` (**no copy from accel to
/// candle**: the tensors share storage). [`grad_bytes_copied`](Self::grad_bytes_copied)
/// counts the copies; `tests/adapters.rs` checks both numbers.
///
/// # ZeRO
/// The model frees and restores its memory as
/// [`accel::zero::ZeroOptimizer`] asks: at stage 3 a released variable's
/// storage (and its gradient buffer's) is swapped for an empty one, and a
/// gathered one gets zero-filled storage of its full size back, which the
/// optimizer fills with the gathered values; at stage 2 a gradient buffer
/// is freed after its reduce-scatter and comes back zero-filled when the
/// next backward adds into it. The `Var`s keep their identity, shape and
/// dtype throughout (only the storage behind them changes), so layers built
/// on them and the graph of a forward pass still refer to them. A released
/// variable's views are empty; **run a module only while its unit is
/// gathered** ([`UnitGate::gather`](accel::zero::UnitGate::gather) before
/// its forward and before its backward): candle reading a released
/// variable panics (its storage is shorter than its shape). See
/// [`resident_numel`](Self::resident_numel).
///
/// # Requires
/// Every variable is a contiguous f16, bf16, f32 or f64 tensor on the CPU;
/// [`CandleModel::new`] checks it (CUDA variables are not supported yet:
/// they would need device views and kernels, as accel-tch has).
pub struct CandleModel {
    varmap: VarMap,
    pub(crate) params: Vec<Param>,
    grad_bytes_copied: u64,
}

impl std::fmt::Debug for CandleModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CandleModel")
            .field(
                "params",
                &self.params.iter().map(|p| &p.name).collect::<Vec<_>>(),
            )
            .field("grad_bytes_copied", &self.grad_bytes_copied)
            .finish_non_exhaustive()
    }
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F64)
}

impl CandleModel {
    /// Adopt the variables of `varmap` (build the model through a
    /// `VarBuilder::from_varmap` first). The `VarMap` is shared, not
    /// copied: its variables are the ones trained.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the variable when one is not a
    /// contiguous float tensor on the CPU, or when the map is empty.
    pub fn new(varmap: &VarMap) -> Result<CandleModel> {
        let mut vars: Vec<(String, Var)> = varmap
            .data()
            .lock()
            .map_err(|_| {
                Error::invalid_argument("CandleModel::new", "the VarMap's lock is poisoned")
            })?
            .iter()
            .map(|(n, v)| (n.clone(), v.clone()))
            .collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        if vars.is_empty() {
            return Err(
                Error::invalid_argument("CandleModel::new", "the VarMap has no variable").with_fix(
                    "build the model's layers with VarBuilder::from_varmap before wrapping the map",
                ),
            );
        }
        let mut params = Vec::with_capacity(vars.len());
        for (name, var) in vars {
            let t = var.as_tensor();
            if !is_float(t.dtype()) || !t.device().is_cpu() || !t.is_contiguous() {
                return Err(Error::invalid_argument(
                    "CandleModel::new",
                    format!(
                        "variable {name:?} is {:?} on {:?}{}; accel-candle trains contiguous f16, bf16, f32 or f64 CPU variables",
                        t.dtype(),
                        t.device().location(),
                        if t.is_contiguous() { "" } else { ", not contiguous" }
                    ),
                )
                .with_fix("create the VarMap's variables on Device::Cpu with a float dtype"));
            }
            let grad = Tensor::zeros(t.shape(), t.dtype(), &Device::Cpu).map_err(candle_err)?;
            params.push(Param { name, var, grad });
        }
        Ok(CandleModel {
            varmap: varmap.clone(),
            params,
            grad_bytes_copied: 0,
        })
    }

    /// The variable map (shared with the caller's).
    pub fn var_map(&self) -> &VarMap {
        &self.varmap
    }

    /// The variables with their names, in the order the training loop
    /// visits them.
    pub fn named_vars(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.params.iter().map(|p| (p.name.as_str(), &p.var))
    }

    /// The gradient buffer of variable `name` (what accel averages and the
    /// optimizer reads), a tensor of the variable's shape and dtype.
    pub fn grad(&self, name: &str) -> Option<&Tensor> {
        self.params.iter().find(|p| p.name == name).map(|p| &p.grad)
    }

    /// The gradient buffers as a candle [`GradStore`] keyed by the
    /// variables: the tensors share storage with the buffers (no copy).
    pub fn grad_store(&self) -> GradStore {
        let mut g = GradStore::default();
        for p in &self.params {
            g.insert(p.var.as_tensor(), p.grad.clone());
        }
        g
    }

    /// Run candle's backward pass on `loss` and add the gradients into the
    /// buffers (what the closure given to
    /// [`Accelerator::backward`](accel::Accelerator::backward) calls, with
    /// the loss already multiplied by the scale it gets).
    ///
    /// # Errors
    /// [`ErrorKind::Backend`] with candle's message when the backward pass
    /// fails; as [`add_grads`](Self::add_grads).
    pub fn backward(&mut self, loss: &Tensor) -> Result<()> {
        let grads = loss.backward().map_err(candle_err)?;
        self.add_grads(&grads)
    }

    /// Add the gradients of `grads` (from `loss.backward()`) into the
    /// buffers; variables without a gradient in `grads` keep theirs.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming the variable when its gradient
    /// has another shape; [`ErrorKind::Backend`] for candle's errors.
    pub fn add_grads(&mut self, grads: &GradStore) -> Result<()> {
        for p in &self.params {
            let Some(g) = grads.get(p.var.as_tensor()) else {
                continue;
            };
            if g.dims() != p.grad.dims() {
                return Err(Error::invalid_argument(
                    "CandleModel::add_grads",
                    format!(
                        "the gradient of {:?} has shape {:?}, the variable {:?}",
                        p.name,
                        g.dims(),
                        p.grad.dims()
                    ),
                ));
            }
            let g = g
                .to_dtype(p.grad.dtype())
                .and_then(|g| g.contiguous())
                .map_err(candle_err)?;
            let (src, src_layout) = g.storage_and_layout();
            let Storage::Cpu(src) = &*src else {
                return Err(Error::new(
                    ErrorKind::Unsupported,
                    format!("the gradient of {:?} is not in CPU memory", p.name),
                ));
            };
            let (start, end) = src_layout
                .contiguous_offsets()
                .expect("made contiguous above");
            // A buffer freed by ZeRO stage 2 comes back zero-filled.
            resize_storage(&p.grad, p.grad.elem_count())?;
            let mut bad = None;
            with_storage_mut(&p.grad, &mut |dst, layout| {
                if let Err(e) = add_into(dst, layout, src, start, end) {
                    bad = Some(e);
                }
            })?;
            if let Some(e) = bad {
                return Err(e.with_op(format!("add_grads: {:?}", p.name)));
            }
            self.grad_bytes_copied += (p.grad.elem_count() * p.grad.dtype().size_in_bytes()) as u64;
        }
        Ok(())
    }

    /// Elements of variable values and gradient buffers the model holds
    /// now: everything for an unsharded model, 0 for a ZeRO-3 model whose
    /// units are all released.
    pub fn resident_numel(&self) -> usize {
        self.params
            .iter()
            .map(|p| held(p.var.as_tensor()) + held(&p.grad))
            .sum()
    }

    fn param_index(&self, op: &str, name: &str) -> Result<usize> {
        self.params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| Error::invalid_argument(op, format!("no variable {name:?}")))
    }

    /// Bytes of gradient copied from candle's tensors into the buffers so
    /// far (one gradient's size per variable and backward pass).
    pub fn grad_bytes_copied(&self) -> u64 {
        self.grad_bytes_copied
    }

    /// Bytes of one full set of gradients.
    pub fn grad_bytes(&self) -> u64 {
        self.params
            .iter()
            .map(|p| (p.grad.elem_count() * p.grad.dtype().size_in_bytes()) as u64)
            .sum()
    }
}

/// `dst[layout] += src[start..end]`, element types equal.
fn add_into(
    dst: &mut CpuStorage,
    layout: &Layout,
    src: &CpuStorage,
    start: usize,
    end: usize,
) -> Result<()> {
    fn add<T: Copy + std::ops::Add<Output = T>>(d: &mut [T], s: &[T]) {
        for (d, s) in d.iter_mut().zip(s) {
            *d = *d + *s;
        }
    }
    let (ds, de) = layout.contiguous_offsets().ok_or_else(not_contiguous)?;
    match (dst, src) {
        (CpuStorage::F32(d), CpuStorage::F32(s)) => add(&mut d[ds..de], &s[start..end]),
        (CpuStorage::F64(d), CpuStorage::F64(s)) => add(&mut d[ds..de], &s[start..end]),
        (CpuStorage::F16(d), CpuStorage::F16(s)) => add(&mut d[ds..de], &s[start..end]),
        (CpuStorage::BF16(d), CpuStorage::BF16(s)) => add(&mut d[ds..de], &s[start..end]),
        (d, s) => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "gradient of dtype {:?} into a buffer of dtype {:?}",
                    s.dtype(),
                    d.dtype()
                ),
            ))
        }
    }
    Ok(())
}

/// Elements `t`'s storage holds within its layout (its element count, or 0
/// when released).
fn held(t: &Tensor) -> usize {
    let (s, l) = t.storage_and_layout();
    storage_len(cpu(&s))
        .saturating_sub(l.start_offset())
        .min(t.elem_count())
}

/// Give `t` storage for its elements, zero-filled (`numel` its element
/// count; kept as it is when it has them already), or free it
/// (`numel == 0`). The tensor keeps its shape and identity.
fn resize_storage(t: &Tensor, numel: usize) -> Result<()> {
    if numel == 0 && held(t) == 0 || numel != 0 && held(t) == numel {
        return Ok(());
    }
    with_storage_mut(t, &mut |s, layout| {
        let len = if numel == 0 {
            0
        } else {
            layout.start_offset() + numel
        };
        *s = match s {
            CpuStorage::F32(_) => CpuStorage::F32(vec![0.0; len]),
            CpuStorage::F64(_) => CpuStorage::F64(vec![0.0; len]),
            CpuStorage::F16(_) => CpuStorage::F16(vec![half::f16::ZERO; len]),
            CpuStorage::BF16(_) => CpuStorage::BF16(vec![half::bf16::ZERO; len]),
            other => unreachable!("checked in CandleModel::new: {:?}", other.dtype()),
        };
    })
}

fn not_contiguous() -> Error {
    Error::invalid_argument("accel-candle view", "the tensor is not contiguous")
}

/// candle's in-place op hook: the one safe way to reach a tensor's storage
/// mutably. `cpu_fwd` runs under the storage's write lock.
type StorageFn<'f> = dyn FnMut(&mut CpuStorage, &Layout) + 'f;

struct WithStorage<'a, 'f>(RefCell<&'a mut StorageFn<'f>>);

impl InplaceOp1 for WithStorage<'_, '_> {
    fn name(&self) -> &'static str {
        "accel-candle-view"
    }

    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        (self.0.borrow_mut())(storage, layout);
        Ok(())
    }
}

/// Call `f` with `t`'s CPU storage, mutably, under its write lock.
fn with_storage_mut(t: &Tensor, f: &mut dyn FnMut(&mut CpuStorage, &Layout)) -> Result<()> {
    t.inplace_op1(&WithStorage(RefCell::new(f)))
        .map_err(candle_err)
}

/// The view of a tensor's elements: `a..b`, or empty when its storage
/// was released (ZeRO).
fn span(layout: &Layout, held: usize) -> (usize, usize) {
    let (a, b) = layout
        .contiguous_offsets()
        .expect("checked in CandleModel::new");
    if held < b {
        (0, 0)
    } else {
        (a, b)
    }
}

/// Elements of `s` (of the dtypes accel-candle stores).
pub(crate) fn storage_len(s: &CpuStorage) -> usize {
    match s {
        CpuStorage::F32(v) => v.len(),
        CpuStorage::F64(v) => v.len(),
        CpuStorage::F16(v) => v.len(),
        CpuStorage::BF16(v) => v.len(),
        CpuStorage::I64(v) => v.len(),
        CpuStorage::U32(v) => v.len(),
        CpuStorage::U8(v) => v.len(),
        _ => 0,
    }
}

/// Put `new` in place of `t`'s storage (same dtype; a length of 0 empties
/// it, the element count fills it), under the storage's lock: the tensor
/// keeps its shape and identity, and every tensor sharing its storage
/// sees the change.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for another dtype or a length that is
/// neither 0 nor the tensor's element count.
pub(crate) fn replace_storage(t: &Tensor, new: CpuStorage) -> Result<()> {
    let n = storage_len(&new);
    if new.dtype() != t.dtype() || (n != 0 && n != t.layout().start_offset() + t.elem_count()) {
        return Err(Error::invalid_argument(
            "accel-candle storage swap",
            format!(
                "{:?} storage of {n} elements for a {:?} tensor of shape {:?}",
                new.dtype(),
                t.dtype(),
                t.dims()
            ),
        ));
    }
    let mut new = Some(new);
    with_storage_mut(t, &mut |s, _| {
        if let Some(n) = new.take() {
            *s = n;
        }
    })
}

fn host_buf<'a>(s: &'a CpuStorage, layout: &Layout) -> Buf<'a> {
    let (a, b) = span(layout, storage_len(s));
    match s {
        CpuStorage::F32(v) => Buf::from(&v[a..b]),
        CpuStorage::F64(v) => Buf::from(&v[a..b]),
        CpuStorage::F16(v) => Buf::from(&v[a..b]),
        CpuStorage::BF16(v) => Buf::from(&v[a..b]),
        other => unreachable!("checked in CandleModel::new: {:?}", other.dtype()),
    }
}

fn host_buf_mut<'a>(s: &'a mut CpuStorage, layout: &Layout) -> BufMut<'a> {
    let (a, b) = span(layout, storage_len(s));
    match s {
        CpuStorage::F32(v) => BufMut::from(&mut v[a..b]),
        CpuStorage::F64(v) => BufMut::from(&mut v[a..b]),
        CpuStorage::F16(v) => BufMut::from(&mut v[a..b]),
        CpuStorage::BF16(v) => BufMut::from(&mut v[a..b]),
        other => unreachable!("checked in CandleModel::new: {:?}", other.dtype()),
    }
}

fn cpu(s: &Storage) -> &CpuStorage {
    match s {
        Storage::Cpu(c) => c,
        _ => unreachable!("checked in CandleModel::new: CPU variables only"),
    }
}

impl Parameters for CandleModel {
    fn visit_params(&self, f: &mut dyn FnMut(ParamRef<'_>)) {
        for p in &self.params {
            let (value, vl) = p.var.storage_and_layout();
            let (grad, gl) = p.grad.storage_and_layout();
            f(ParamRef {
                name: &p.name,
                value: host_buf(cpu(&value), vl),
                grad: host_buf(cpu(&grad), gl),
            });
        }
    }

    fn visit_params_mut(&mut self, f: &mut dyn FnMut(ParamMut<'_>)) {
        for p in &self.params {
            let name = p.name.as_str();
            let grad = &p.grad;
            let done = with_storage_mut(p.var.as_tensor(), &mut |value, vl| {
                let inner = with_storage_mut(grad, &mut |g, gl| {
                    f(ParamMut {
                        name,
                        value: host_buf_mut(value, vl),
                        grad: host_buf_mut(g, gl),
                    })
                });
                inner.expect("the gradient buffer is a contiguous CPU tensor of its own");
            });
            done.expect("checked in CandleModel::new: contiguous CPU variables");
        }
    }

    fn num_params(&self) -> usize {
        self.params.iter().map(|p| p.grad.elem_count()).sum()
    }

    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        let p = self.params.iter().find(|p| p.name == name)?;
        Some(p.var.dims().to_vec())
    }

    /// `numel == 0`: the variable's storage and its gradient buffer's
    /// become empty (ZeRO stage 3 released its unit). Otherwise `numel`
    /// must be the variable's element count: both get zero-filled storage
    /// of that size back (kept where they have it), which the gather then
    /// fills.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a name the model does not have or
    /// another element count.
    fn set_param_storage(&mut self, name: &str, numel: usize) -> Result<()> {
        let i = self.param_index("set_param_storage", name)?;
        let p = &self.params[i];
        if numel != 0 && numel != p.grad.elem_count() {
            return Err(Error::invalid_argument(
                "set_param_storage",
                format!(
                    "variable {name:?} of shape {:?} cannot hold {numel} elements",
                    p.var.dims()
                ),
            ));
        }
        resize_storage(p.var.as_tensor(), numel)?;
        resize_storage(&p.grad, numel)
    }

    /// Free the gradient buffer of `name` (ZeRO stage 2, after its
    /// reduce-scatter); [`add_grads`](CandleModel::add_grads) gives it
    /// back zero-filled.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a name the model does not have.
    fn release_grad(&mut self, name: &str) -> Result<()> {
        let i = self.param_index("release_grad", name)?;
        resize_storage(&self.params[i].grad, 0)
    }
}
