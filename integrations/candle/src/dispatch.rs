//! Big-model inference for candle on the CPU: Accelerate's
//! `load_checkpoint_and_dispatch` on accel-offload's dispatch pipeline
//! ([`accel_offload::dispatch`]), with the model built from a
//! [`VarBuilder`] whose tensors come from the plan. This module is
//! candle's side of the pipeline (its [`Framework`]).
//!
//! [`load_checkpoint_and_dispatch`] takes a safetensors checkpoint (one
//! file, shards or a folder), the blocks the forward pass steps through
//! and budgets, and
//!
//! 1. reads the checkpoint's layout (module order inferred from the tensor
//!    names: a checkpoint does not record it, ADR 0010) and plans a device
//!    map with accel-offload's planner (Accelerate's
//!    `infer_auto_device_map` policy, `no_split` classes);
//! 2. reads every tensor planned on the CPU once into a candle tensor, and
//!    serves every tensor planned on `disk` from the checkpoint's own
//!    shard, in place (a [`DiskStore`]), leaving a placeholder for it: a
//!    tensor of its shape and dtype whose storage is empty.
//!
//! [`Dispatched::var_builder`] hands those tensors to the model's
//! constructor (candle-nn layers keep them, sharing their storage), and
//! [`Dispatched::run`] steps through the blocks: before a block's forward
//! its offloaded tensors' storage is filled in place (the layers see the
//! values without being rebuilt), after it the storage is emptied again,
//! and a background thread reads the next block meanwhile
//! ([`accel_offload::exec::run_layers`], `lookahead` blocks ahead). Disk
//! tensors are read with positioned reads into the new storage, not
//! through the mapping.
//!
//! # Requires
//! Execution on the CPU (a plan that names an accelerator is refused). A
//! forward pass must not read an offloaded tensor outside its block
//! (candle would index an empty storage and panic) nor keep a view of it
//! beyond the block.
//!
//! [`DiskStore`]: accel_offload::store::DiskStore

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use accel_offload::dispatch::{self as shared, load_and_dispatch, Dispatch, Framework};
use accel_offload::exec::ExecStats;
use accel_offload::layout::Layout;
use accel_offload::plan::{MaxMemory, Target};
use candle_core::{CpuStorage, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use crate::candle_err;
use crate::model::{replace_storage, storage_len};

pub use accel_offload::dispatch::DispatchReport;

/// Options of [`load_checkpoint_and_dispatch`] (Accelerate's arguments of
/// the same names).
#[derive(Debug, Clone)]
pub struct DispatchOptions {
    /// Budgets (`cpu=20MiB,disk`); `None` keeps everything on the CPU,
    /// unbounded (no offload).
    pub max_memory: Option<MaxMemory>,
    /// Class names or full-name globs of modules kept on one device.
    pub no_split: Vec<String>,
    /// Blocks read ahead by the prefetch thread (0: read each block on the
    /// compute thread just before it runs).
    pub lookahead: usize,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        DispatchOptions {
            max_memory: None,
            no_split: vec![],
            lookahead: 1,
        }
    }
}

/// A checkpoint dispatched over a device map (see the [module docs](self)).
///
/// Its plan, device map, layout, blocks and report are those of the
/// [`Dispatch`] it derefs to.
pub struct Dispatched(shared::Dispatched<Tensors>);

impl std::ops::Deref for Dispatched {
    type Target = Dispatch;
    fn deref(&self) -> &Dispatch {
        &self.0
    }
}

impl std::fmt::Debug for Dispatched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("dispatch", self.0.dispatch())
            .field("tensors", &self.0.framework().0.len())
            .finish()
    }
}

/// Zero-filled CPU storage of `meta`'s dtype and length.
fn storage_for(name: &str, meta: &TensorMeta) -> Result<CpuStorage> {
    let n: usize = meta.shape.iter().product();
    Ok(match meta.dtype {
        DType::F32 => CpuStorage::F32(vec![0.0; n]),
        DType::F64 => CpuStorage::F64(vec![0.0; n]),
        DType::F16 => CpuStorage::F16(vec![half::f16::ZERO; n]),
        DType::BF16 => CpuStorage::BF16(vec![half::bf16::ZERO; n]),
        DType::I64 => CpuStorage::I64(vec![0; n]),
        DType::U8 => CpuStorage::U8(vec![0; n]),
        other => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                "dispatch: tensor `{name}` is {other}, which candle has no CPU storage for here"
            ),
            ))
        }
    })
}

/// The bytes of `s`, to read a tensor into.
fn storage_bytes(s: &mut CpuStorage) -> &mut [u8] {
    match s {
        CpuStorage::F32(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F64(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::F16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::BF16(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::I64(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::U32(v) => bytemuck::cast_slice_mut(v),
        CpuStorage::U8(v) => v,
        _ => unreachable!("storage_for makes only these"),
    }
}

fn tensor_of(storage: CpuStorage, shape: &[usize]) -> Result<Tensor> {
    let t = match storage {
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        CpuStorage::F64(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        CpuStorage::I64(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        CpuStorage::U32(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        CpuStorage::U8(v) => Tensor::from_vec(v, shape, &Device::Cpu),
        _ => unreachable!("storage_for makes only these"),
    };
    t.map_err(candle_err)
}

/// Plan a device map for the checkpoint and load it: the analogue of
/// Accelerate's `load_checkpoint_and_dispatch(model, checkpoint,
/// device_map="auto", max_memory=..., no_split_module_classes=...)` (see
/// the [module docs](self)). `blocks` are the modules the forward pass
/// steps through with [`Dispatched::run`], in order (`encoder.layer.0`).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for a block that is no module of the
/// checkpoint, a disk tensor that no block covers (nothing would fill
/// it), and planning failures (a budget too small: the planner's message);
/// [`ErrorKind::Unsupported`] for a plan that names an accelerator; I/O
/// and corruption errors naming the file.
pub fn load_checkpoint_and_dispatch(
    checkpoint: &Path,
    blocks: &[&str],
    opts: &DispatchOptions,
) -> Result<Dispatched> {
    let opts = shared::DispatchOptions {
        max_memory: opts.max_memory.clone(),
        no_split: opts.no_split.clone(),
        lookahead: opts.lookahead,
        ..shared::DispatchOptions::default()
    };
    let layout = |ck: &_| Layout::from_checkpoint(ck, &[]);
    let d = load_and_dispatch(Tensors::default(), layout, checkpoint, blocks, &opts)?;
    d.check_blocks_cover()?;
    Ok(Dispatched(d))
}

/// A block's tensor on its way in: the storage the prefetch thread read
/// (taken when installed), and its shape.
struct Staged(Mutex<Option<CpuStorage>>, Vec<usize>);

impl Framework for Tensors {
    type Device = ();
    type Tensor = Staged;

    fn device(&self, target: &Target) -> Result<()> {
        if target.is_accelerator() {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "load_checkpoint_and_dispatch: the plan puts weights on {target}; accel-candle dispatches on the CPU only"
                ),
            )
            .with_fix("give max_memory budgets for cpu and disk only"));
        }
        Ok(())
    }

    fn materialise(
        name: &str,
        meta: &TensorMeta,
        _: &(),
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Staged> {
        let mut s = storage_for(name, meta)?;
        fill(storage_bytes(&mut s))?;
        Ok(Staged(Mutex::new(Some(s)), meta.shape.clone()))
    }

    fn keep(&mut self, name: &str, t: Staged) -> Result<()> {
        let s =
            t.0.into_inner()
                .ok()
                .flatten()
                .expect("a new staged tensor");
        let t = tensor_of(s, &t.1)?;
        Arc::make_mut(&mut self.0).insert(name.to_string(), t);
        Ok(())
    }

    fn tie(&mut self, alias: &str, owner: &str) -> Result<()> {
        let t = self.find(owner).map_err(candle_err)?.clone();
        Arc::make_mut(&mut self.0).insert(alias.to_string(), t);
        Ok(())
    }

    /// A tensor of `meta`'s shape and dtype whose storage is empty.
    fn offload(&mut self, name: &str, meta: &TensorMeta, _: &()) -> Result<()> {
        // Full-size for one moment (candle checks the length), then emptied.
        let t = tensor_of(storage_for(name, meta)?, &meta.shape)?;
        Arc::make_mut(&mut self.0).insert(name.to_string(), t);
        self.release(name, meta, &())
    }

    fn install(&self, name: &str, t: &Staged) -> Result<()> {
        let s =
            t.0.lock()
                .map_err(|_| Error::internal("dispatch", "a staged tensor's lock is poisoned"))?
                .take();
        match (self.0.get(name), s) {
            (Some(t), Some(s)) => replace_storage(t, s),
            _ => Err(Error::internal(
                "dispatch",
                format!("tensor `{name}` was staged twice or is unknown"),
            )),
        }
    }

    fn release(&self, name: &str, meta: &TensorMeta, _: &()) -> Result<()> {
        let empty = TensorMeta {
            dtype: meta.dtype,
            shape: vec![0],
        };
        match self.0.get(name) {
            Some(t) => replace_storage(t, storage_for(name, &empty)?),
            None => Ok(()),
        }
    }
}

impl Dispatched {
    /// Elements the checkpoint's tensors hold now (resident ones, plus the
    /// offloaded ones of a block in flight).
    pub fn resident_numel(&self) -> usize {
        self.0.framework().0.values().map(held).sum()
    }

    /// A [`VarBuilder`] over the dispatched tensors (in `dtype`: resident
    /// tensors of another dtype are converted; offloaded ones must have
    /// it), to build the model with. Its layers share the tensors'
    /// storage, which [`run`](Self::run) fills block by block.
    pub fn var_builder(&self, dtype: candle_core::DType) -> VarBuilder<'static> {
        let tensors = Tensors(self.0.framework().0.clone());
        VarBuilder::from_backend(Box::new(tensors), dtype, Device::Cpu)
    }

    /// Run one forward pass: call `step(index, block_name)` for every block
    /// in order, each with its offloaded tensors filled, emptied after it;
    /// the next block is read on a background thread meanwhile.
    ///
    /// # Errors
    /// The first error of `step` or of reading a block (the tensors of the
    /// block in hand are emptied first).
    pub fn run<F>(&self, step: F) -> Result<ExecStats>
    where
        F: FnMut(usize, &str) -> Result<()>,
    {
        self.0.run(step)
    }
}

fn held(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(c) => storage_len(c),
        _ => 0,
    }
}

/// The dispatched tensors: the model's side of dispatch, and a candle-nn
/// backend.
#[derive(Default)]
struct Tensors(Arc<HashMap<String, Tensor>>);

impl Tensors {
    fn find(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.0.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "accel-candle dispatch: the checkpoint has no tensor {name:?}"
            ))
        })
    }

    fn cast(t: &Tensor, name: &str, dtype: candle_core::DType) -> candle_core::Result<Tensor> {
        if t.dtype() == dtype {
            return Ok(t.clone());
        }
        if held(t) < t.elem_count() {
            candle_core::bail!(
                "accel-candle dispatch: offloaded tensor {name:?} is {:?}; build the model in that dtype",
                t.dtype()
            )
        }
        t.to_dtype(dtype)
    }
}

impl SimpleBackend for Tensors {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: candle_core::DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = self.find(name)?;
        if t.shape() != &s {
            candle_core::bail!(
                "accel-candle dispatch: {name:?} has shape {:?} in the checkpoint, the layer asks for {s:?}",
                t.shape()
            )
        }
        Self::cast(t, name, dtype)
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: candle_core::DType,
        _: &Device,
    ) -> candle_core::Result<Tensor> {
        Self::cast(self.find(name)?, name, dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}
