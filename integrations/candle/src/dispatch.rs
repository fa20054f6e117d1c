//! Big-model inference for candle on the CPU: Accelerate's
//! `load_checkpoint_and_dispatch` on [`accel_offload`], with the model
//! built from a [`VarBuilder`] whose tensors come from the plan.
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
//! Execution on the CPU (a plan that names an accelerator is refused), and
//! the planned dtype of a disk tensor its stored one. A forward pass must
//! not read an offloaded tensor outside its block (candle would index an
//! empty storage and panic) nor keep a view of it beyond the block.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use accel_offload::dispatched::Dispatch;
use accel_offload::exec::{ExecStats, LayerSpec, Resident};
use accel_offload::layout::{Layout, NodeId};
use accel_offload::plan::{self, MaxMemory, PlanOptions, Reserve, Target};
use accel_offload::safetensors::{Checkpoint, SafetensorsFile, TensorEntry};
use accel_offload::store::DiskStore;
use candle_core::{CpuStorage, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;

use crate::candle_err;
use crate::model::{replace_storage, storage_len};

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

/// What loading did.
#[derive(Debug, Clone, Default)]
pub struct DispatchReport {
    /// Tensors of the checkpoint.
    pub tensors: usize,
    /// Bytes read into resident tensors.
    pub resident_bytes: u64,
    /// Bytes served from the checkpoint's shards in place.
    pub disk_bytes: u64,
    /// Planning and loading time.
    pub elapsed: Duration,
}

/// A checkpoint dispatched over a device map (see the [module docs](self)).
///
/// Its plan, device map, layout, blocks and report are those of the
/// [`Dispatch`] it derefs to.
pub struct Dispatched {
    dispatch: Dispatch<DispatchReport>,
    tensors: Arc<HashMap<String, Tensor>>,
}

impl std::ops::Deref for Dispatched {
    type Target = Dispatch<DispatchReport>;
    fn deref(&self) -> &Dispatch<DispatchReport> {
        &self.dispatch
    }
}

impl std::fmt::Debug for Dispatched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("dispatch", &self.dispatch)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn invalid(msg: String) -> Error {
    Error::invalid_argument("load_checkpoint_and_dispatch", msg)
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

/// A tensor of `e`'s values, read with positioned reads.
fn read_tensor(f: &SafetensorsFile, e: &TensorEntry) -> Result<Tensor> {
    let mut s = storage_for(&e.name, &e.meta)?;
    if e.len > 0 {
        f.read_into(e, storage_bytes(&mut s))?;
    }
    tensor_of(s, &e.meta.shape)
}

/// A tensor of `e`'s shape and dtype whose storage is empty.
fn placeholder(e: &TensorEntry) -> Result<Tensor> {
    let empty = TensorMeta {
        dtype: e.meta.dtype,
        shape: vec![0],
    };
    // Full-size for one moment (candle checks the length), then emptied.
    let t = tensor_of(storage_for(&e.name, &e.meta)?, &e.meta.shape)?;
    replace_storage(&t, storage_for(&e.name, &empty)?)?;
    Ok(t)
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
/// [`ErrorKind::Unsupported`] for a plan that names an accelerator or
/// converts a disk tensor; I/O and corruption errors naming the file.
pub fn load_checkpoint_and_dispatch(
    checkpoint: &Path,
    blocks: &[&str],
    opts: &DispatchOptions,
) -> Result<Dispatched> {
    let start = Instant::now();
    let ck = Checkpoint::open(checkpoint)?;
    let layout = Layout::from_checkpoint(&ck, &[])?;
    let unbounded = opts.max_memory.is_none();
    let popts = PlanOptions {
        max_memory: Some(opts.max_memory.clone().unwrap_or(MaxMemory {
            devices: vec![(Target::Cpu, Some(u64::MAX / 4))],
        })),
        no_split: opts.no_split.clone(),
        reserve: if unbounded {
            Reserve::None
        } else {
            Reserve::default()
        },
        ..PlanOptions::default()
    };
    let plan = plan::plan(&layout, &popts)?;
    if let Some(d) = plan.devices.iter().find(|d| d.device.is_accelerator()) {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "load_checkpoint_and_dispatch: the plan puts weights on {}; accel-candle dispatches on the CPU only",
                d.device
            ),
        )
        .with_fix("give max_memory budgets for cpu and disk only"));
    }
    let on_disk = |id: NodeId| plan.device_of(id) == Some(&Target::Disk);

    let mut report = DispatchReport::default();
    let mut tensors = HashMap::new();
    let mut disk: Option<DiskStore> = None;
    for path in &ck.shards {
        let f = SafetensorsFile::open(path)?;
        let mut in_place = false;
        for e in f.entries() {
            let id = layout.id(&e.name).ok_or_else(|| {
                Error::internal(
                    "dispatch",
                    format!("`{}` is not in the checkpoint's layout", e.name),
                )
            })?;
            report.tensors += 1;
            if on_disk(id) {
                if plan.dtype_of(id).is_some_and(|d| d != e.meta.dtype) {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        format!("dispatch: tensor `{}` would be converted on disk", e.name),
                    ));
                }
                in_place = true;
                report.disk_bytes += e.len;
                tensors.insert(e.name.clone(), placeholder(e)?);
            } else {
                report.resident_bytes += e.len;
                tensors.insert(e.name.clone(), read_tensor(&f, e)?);
            }
        }
        if in_place {
            if disk.is_none() {
                // Tensors are only served in place: the store's temporary
                // folder stays empty.
                disk = Some(DiskStore::open_temp("accel-candle-dispatch")?);
            }
            disk.as_ref().expect("opened above").add_file(path)?;
        }
    }

    let mut specs = Vec::with_capacity(blocks.len());
    for b in blocks {
        let mut names = layout.tensors_under(b).ok_or_else(|| {
            invalid(format!(
                "block `{b}` is no module of {}",
                checkpoint.display()
            ))
        })?;
        names.retain(|n| layout.id(n).is_some_and(on_disk));
        specs.push(LayerSpec {
            name: b.to_string(),
            tensors: names,
        });
    }
    let mut outside: Vec<&String> = tensors
        .keys()
        .filter(|n| layout.id(n).is_some_and(on_disk))
        .filter(|n| !specs.iter().any(|s| s.tensors.contains(n)))
        .collect();
    if !outside.is_empty() {
        outside.sort();
        return Err(invalid(format!(
            "the plan puts {} tensor(s) on disk that no block covers, e.g. {:?}",
            outside.len(),
            &outside[..outside.len().min(5)]
        ))
        .with_fix("name the module holding them as a block, or give the CPU more memory"));
    }
    report.elapsed = start.elapsed();
    let dispatched = Dispatched {
        dispatch: Dispatch::new(layout, plan, disk, report).with_blocks(specs, opts.lookahead),
        tensors: Arc::new(tensors),
    };
    let r = dispatched.report();
    tracing::info!(
        resident = r.resident_bytes,
        disk = r.disk_bytes,
        elapsed_ms = r.elapsed.as_millis() as u64,
        "dispatched"
    );
    Ok(dispatched)
}

/// A block's tensor on its way in: the storage the prefetch thread read.
struct Staged(Mutex<Option<CpuStorage>>);

impl Dispatched {
    /// Elements the checkpoint's tensors hold now (resident ones, plus the
    /// offloaded ones of a block in flight).
    pub fn resident_numel(&self) -> usize {
        self.tensors.values().map(held).sum()
    }

    /// A [`VarBuilder`] over the dispatched tensors (in `dtype`: resident
    /// tensors of another dtype are converted; offloaded ones must have
    /// it), to build the model with. Its layers share the tensors'
    /// storage, which [`run`](Self::run) fills block by block.
    pub fn var_builder(&self, dtype: candle_core::DType) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(Tensors(self.tensors.clone())), dtype, Device::Cpu)
    }

    /// Run one forward pass: call `step(index, block_name)` for every block
    /// in order, each with its offloaded tensors filled, emptied after it;
    /// the next block is read on a background thread meanwhile.
    ///
    /// # Errors
    /// The first error of `step` or of reading a block (the tensors of the
    /// block in hand are emptied first).
    pub fn run<F>(&self, mut step: F) -> Result<ExecStats>
    where
        F: FnMut(usize, &str) -> Result<()>,
    {
        let src = self.weight_source(&[]);
        let disk = self.dispatch.disk();
        // On the prefetch thread: new storage, read from the shard.
        let upload = move |name: &str, meta: &TensorMeta, bytes: &[u8]| -> Result<Staged> {
            let mut s = storage_for(name, meta)?;
            match disk {
                Some(d) => d.read_into(name, storage_bytes(&mut s))?,
                None => storage_bytes(&mut s).copy_from_slice(bytes),
            }
            Ok(Staged(Mutex::new(Some(s))))
        };
        let tensors = &self.tensors;
        let compute = |r: &Resident<Staged>| -> Result<()> {
            let mut res = Ok(());
            for (name, _, b) in r.tensors() {
                let s = b
                    .0
                    .lock()
                    .map_err(|_| Error::internal("dispatch", "a staged tensor's lock is poisoned"))?
                    .take();
                res = match (tensors.get(name), s) {
                    (Some(t), Some(s)) => replace_storage(t, s),
                    _ => Err(Error::internal(
                        "dispatch",
                        format!("tensor `{name}` was staged twice or is unknown"),
                    )),
                };
                if res.is_err() {
                    break;
                }
            }
            if res.is_ok() {
                res = step(r.index, &r.name);
            }
            for (name, meta, _) in r.tensors() {
                let empty = TensorMeta {
                    dtype: meta.dtype,
                    shape: vec![0],
                };
                let released = match tensors.get(name) {
                    Some(t) => storage_for(name, &empty).and_then(|s| replace_storage(t, s)),
                    None => Ok(()),
                };
                if res.is_ok() {
                    res = released;
                }
            }
            res
        };
        self.dispatch.run_blocks(&src, upload, compute)
    }
}

fn held(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    match &*s {
        candle_core::Storage::Cpu(c) => storage_len(c),
        _ => 0,
    }
}

/// The dispatched tensors as a candle-nn backend.
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
