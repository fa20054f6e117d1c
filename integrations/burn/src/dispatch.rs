//! Big-model inference for burn: Accelerate's `load_checkpoint_and_dispatch`
//! on accel-offload's dispatch pipeline ([`accel_offload::dispatch`]). This
//! module is burn's side of the pipeline (its [`Framework`]: the module's
//! float parameters, named by their record paths).
//!
//! [`load_checkpoint_and_dispatch`] takes a burn [`Module`] (built with
//! `init`, its parameters still lazy: nothing allocated), a safetensors
//! checkpoint (one file, shards or a folder) whose names are the module's
//! record paths (`layers.0.weight`: what `burn-store`'s safetensors store
//! and [`BurnModel`](crate::BurnModel)'s `save_model` write), the blocks
//! the forward pass steps through and budgets, and
//!
//! 1. builds the layout from the module itself: its submodules in the
//!    order the module visits them (its fields' order), their classes
//!    (the struct names, for `no_split`), each parameter's shape without
//!    initialising it, the dtypes of the checkpoint's entries;
//! 2. plans a device map (Accelerate's `infer_auto_device_map` policy) and
//!    reads every tensor once into its place: resident ones into the
//!    module's parameters, on the module's device; `cpu`-planned ones into
//!    a [`HostStore`] when the budgets name an accelerator; `disk` ones
//!    served from the checkpoint's own shard in place ([`DiskStore`]);
//! 3. leaves each offloaded parameter an empty tensor (no element) of its
//!    rank and dtype.
//!
//! [`Dispatched::run`] steps through the blocks: a block's record (its
//! offloaded tensors, read on a background thread `lookahead` blocks
//! ahead) is loaded into the module before the block runs, as burn's own
//! loading does (`Param::transform_for_load`: the parameter's device, grad
//! requirement and load mapper), and released after it.
//!
//! ```no_run
//! use accel_burn::dispatch::{load_checkpoint_and_dispatch, DispatchOptions};
//! use accel_offload::plan::MaxMemory;
//! use burn::module::Module;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::tensor::{activation::relu, Device, Tensor};
//!
//! #[derive(Module, Debug)]
//! struct Net {
//!     layers: Vec<Linear>,
//! }
//!
//! let device = Device::default();
//! let net = Net {
//!     layers: (0..4).map(|_| LinearConfig::new(512, 512).init(&device)).collect(),
//! };
//! let blocks: Vec<String> = (0..4).map(|i| format!("layers.{i}")).collect();
//! let opts = DispatchOptions {
//!     max_memory: Some(MaxMemory::parse("cpu=2MiB,disk")?),
//!     ..DispatchOptions::default()
//! };
//! let d = load_checkpoint_and_dispatch(net, "model.safetensors".as_ref(), &blocks, &opts)?;
//! let mut h = Some(Tensor::<2>::zeros([1, 512], &device));
//! d.run(|i, _block, net| {
//!     h = Some(relu(net.layers[i].forward(h.take().expect("set"))));
//!     Ok(())
//! })?;
//! # Ok::<(), accel_api::Error>(())
//! ```
//!
//! # Devices
//! Blocks run on the module's device (that of its first float parameter),
//! and every device of the plan but `disk` stands for it: with `cpu` and
//! `disk` budgets the `cpu` part stays resident there; budgets that name
//! one accelerator (`cuda:0=8GiB,cpu=32GiB,disk`) keep that part resident
//! there and the `cpu` part in the host store. A plan naming two
//! accelerators is refused.
//!
//! # Requires
//! Every float parameter of the module is in the checkpoint under its
//! record path with its shape, as f32, f64, f16 or bf16 (a parameter takes
//! the checkpoint's dtype, or [`DispatchOptions::dtype`]). Int and bool
//! parameters are not dispatched: they keep the module's values. A
//! forward pass reads an offloaded parameter only inside its block (the
//! empty tensor fails burn's shape checks elsewhere); clones of the module
//! kept beyond the block keep its tensors alive.
//!
//! [`HostStore`]: accel_offload::store::HostStore
//! [`DiskStore`]: accel_offload::store::DiskStore

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use accel_api::{Error, ErrorKind, Result, TensorMeta};
use accel_offload::dispatch::{self as shared, load_and_dispatch, Dispatch, Framework};
use accel_offload::exec::ExecStats;
use accel_offload::layout::{Layout, LayoutJson, ModuleJson, TensorJson, LAYOUT_FORMAT};
use accel_offload::plan::Target;
use accel_offload::safetensors::Checkpoint;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor, TensorData};

pub use accel_offload::dispatch::{DispatchOptions, DispatchReport};

const OP: &str = "load_checkpoint_and_dispatch";

/// A burn module dispatched over a device map (see the [module docs](self)).
///
/// Its plan, device map, layout, stores, blocks and report are those of
/// the [`Dispatch`] it derefs to.
pub struct Dispatched<M: Module>(shared::Dispatched<Params<M>>);

impl<M: Module> std::ops::Deref for Dispatched<M> {
    type Target = Dispatch;
    fn deref(&self) -> &Dispatch {
        &self.0
    }
}

impl<M: Module> std::fmt::Debug for Dispatched<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("device", self.0.device())
            .field("dispatch", self.0.dispatch())
            .finish_non_exhaustive()
    }
}

/// Plan a device map for `module` and load `checkpoint` into it: the
/// analogue of Accelerate's `load_checkpoint_and_dispatch(model,
/// checkpoint, device_map="auto", max_memory=..., no_split_module_classes=...)`
/// (see the [module docs](self)). `blocks` are the submodules
/// [`Dispatched::run`] steps through, in forward order, by record path
/// (`layers.0`).
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] naming the tensor when a float parameter
/// is missing from the checkpoint or has another shape there; for a block
/// that is no submodule, an offloaded parameter that no block covers
/// (nothing would load it), a plan naming two accelerators, and planning
/// failures (a budget too small: the planner's message);
/// [`ErrorKind::Unsupported`] for a parameter stored in a dtype other than
/// f32, f64, f16 and bf16; I/O and corruption errors naming the file.
pub fn load_checkpoint_and_dispatch<M: Module, B: AsRef<str>>(
    module: M,
    checkpoint: &Path,
    blocks: &[B],
    opts: &DispatchOptions,
) -> Result<Dispatched<M>> {
    let (json, device) = layout_of(&module)?;
    let layout = |ck: &Checkpoint| {
        let mut json = json;
        set_dtypes(&mut json.root, "", &dtypes_of(ck));
        Layout::from_json(&json)
    };
    let params = Params {
        module: Mutex::new(Some(module)),
        pending: Mutex::new(HashMap::new()),
        device,
        accelerator: Mutex::new(None),
    };
    let d = load_and_dispatch(params, layout, checkpoint, blocks, opts)?;
    d.check_blocks_cover()?;
    d.framework().flush()?;
    Ok(Dispatched(d))
}

impl<M: Module> Dispatched<M> {
    /// Run one forward pass: call `step(index, block_name, module)` for
    /// every block in order, with the block's offloaded parameters loaded
    /// into `module` (a clone sharing the tensors), released after it; the
    /// next blocks are read on a background thread meanwhile.
    ///
    /// # Errors
    /// The first error of `step`, of reading a block or of loading it into
    /// the module (the block's parameters are released first).
    pub fn run<S>(&self, mut step: S) -> Result<ExecStats>
    where
        S: FnMut(usize, &str, &M) -> Result<()>,
    {
        let params = self.0.framework();
        let ran = self.0.run(|i, block| {
            params.flush()?;
            let module = params
                .lock_module()?
                .clone()
                .expect("the module is present");
            step(i, block, &module)
        });
        let released = params.flush();
        let stats = ran?;
        released.map(|()| stats)
    }

    /// The module as it is between passes (a clone sharing its tensors):
    /// resident parameters hold their values, offloaded ones no element.
    ///
    /// # Errors
    /// [`ErrorKind::Internal`] when a pass panicked while holding it.
    pub fn module(&self) -> Result<M> {
        Ok(self
            .0
            .framework()
            .lock_module()?
            .clone()
            .expect("the module is present"))
    }

    /// Where blocks run: the module's device.
    pub fn device(&self) -> &Device {
        self.0.device()
    }
}

/// The module's layout (dtypes still unset: the checkpoint's) and its
/// device.
fn layout_of<M: Module>(module: &M) -> Result<(LayoutJson, Device)> {
    let mut v = Collect {
        path: vec![],
        classes: HashMap::new(),
        tensors: vec![],
        device: None,
    };
    module.visit(&mut v);
    let Some(device) = v.device else {
        return Err(Error::invalid_argument(
            OP,
            "the module has no float parameter to dispatch",
        ));
    };
    let mut root = ModuleJson {
        class: v.classes.get("").cloned(),
        ..ModuleJson::default()
    };
    for (path, shape) in v.tensors {
        let (leaf, mods) = path.split_last().expect("a parameter has a name");
        let mut cur = &mut root;
        for (depth, m) in mods.iter().enumerate() {
            let i = match cur.children.iter().position(|c| c.name == *m) {
                Some(i) => i,
                None => {
                    cur.children.push(ModuleJson {
                        name: m.clone(),
                        class: v.classes.get(&mods[..=depth].join(".")).cloned(),
                        ..ModuleJson::default()
                    });
                    cur.children.len() - 1
                }
            };
            cur = &mut cur.children[i];
        }
        cur.params.push(TensorJson {
            name: leaf.clone(),
            dtype: accel_api::DType::F32,
            shape,
            persistent: true,
        });
    }
    let json = LayoutJson {
        format: LAYOUT_FORMAT.to_string(),
        root,
        tied: vec![],
    };
    Ok((json, device))
}

/// The checkpoint's dtype of every entry.
fn dtypes_of(ck: &Checkpoint) -> HashMap<&str, accel_api::DType> {
    ck.tensors
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e.meta.dtype))
        .collect()
}

/// Each parameter of `m` (at `prefix`) takes its checkpoint entry's dtype
/// (those absent keep f32: matching reports them missing).
fn set_dtypes(m: &mut ModuleJson, prefix: &str, dtypes: &HashMap<&str, accel_api::DType>) {
    let full = |n: &str| {
        if prefix.is_empty() {
            n.to_string()
        } else {
            format!("{prefix}.{n}")
        }
    };
    for p in &mut m.params {
        if let Some(&d) = dtypes.get(full(&p.name).as_str()) {
            p.dtype = d;
        }
    }
    for c in &mut m.children {
        let at = full(&c.name);
        set_dtypes(c, &at, dtypes);
    }
}

/// Walks the module: float parameters' record paths and lazy shapes,
/// module classes, the first parameter's device.
struct Collect {
    path: Vec<String>,
    classes: HashMap<String, String>,
    tensors: Vec<(Vec<String>, Vec<usize>)>,
    device: Option<Device>,
}

impl ModuleVisitor for Collect {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        // The container is the module holding `name`: its class.
        let class = container_type
            .strip_prefix("Struct:")
            .or_else(|| container_type.strip_prefix("Enum:"));
        if let Some(c) = class {
            self.classes.insert(self.path.join("."), c.to_string());
        }
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        // Lazy: neither reads initialise the parameter.
        if self.device.is_none() {
            self.device = Some(param.lazy_device());
        }
        self.tensors
            .push((self.path.clone(), param.lazy_shape().to_vec()));
    }
}

/// What a parameter holds next: a tensor (flat, reshaped when loaded) or
/// nothing (an empty tensor of the parameter's rank).
struct Next {
    tensor: Option<Tensor<1>>,
    /// The parameter's shape (all zeros for an empty one).
    shape: Vec<usize>,
    dtype: DType,
}

impl Next {
    fn of(tensor: Option<Tensor<1>>, shape: Vec<usize>) -> Next {
        let dtype = tensor.as_ref().map_or(DType::F32, Tensor::dtype);
        Next {
            tensor,
            shape,
            dtype,
        }
    }
}

/// burn's side of dispatch: the module, and the parameters to change in it
/// at the next [`flush`](Params::flush).
struct Params<M> {
    module: Mutex<Option<M>>,
    pending: Mutex<HashMap<String, Next>>,
    device: Device,
    /// The plan's accelerator the device stands for, once seen.
    accelerator: Mutex<Option<Target>>,
}

fn poisoned<T>(_: T) -> Error {
    Error::internal(
        "dispatch",
        "accel-burn's dispatch state is poisoned (a pass panicked)",
    )
}

impl<M: Module> Params<M> {
    fn lock_module(&self) -> Result<MutexGuard<'_, Option<M>>> {
        self.module.lock().map_err(poisoned)
    }

    fn queue(&self, name: &str, next: Next) -> Result<()> {
        self.pending
            .lock()
            .map_err(poisoned)?
            .insert(name.to_string(), next);
        Ok(())
    }

    /// Load the queued tensors into the module (one walk of the module
    /// per block, not one per tensor).
    fn flush(&self) -> Result<()> {
        let mut pending = self.pending.lock().map_err(poisoned)?;
        if pending.is_empty() {
            return Ok(());
        }
        let mut guard = self.lock_module()?;
        let module = guard.take().expect("the module is present");
        let mut apply = Apply {
            path: vec![],
            pending: &mut pending,
            device: &self.device,
            err: None,
        };
        *guard = Some(module.map(&mut apply));
        let err = apply.err;
        let left: Vec<String> = pending.drain().map(|(n, _)| n).collect();
        match err {
            Some(e) => Err(e),
            None if left.is_empty() => Ok(()),
            None => Err(Error::internal(
                "dispatch",
                format!("the module has no float parameters {left:?}"),
            )),
        }
    }
}

/// Loads the queued tensors into the parameters they name.
struct Apply<'a> {
    path: Vec<String>,
    pending: &'a mut HashMap<String, Next>,
    device: &'a Device,
    err: Option<Error>,
}

impl ModuleMapper for Apply<'_> {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let name = self.path.join(".");
        let Some(next) = self.pending.remove(&name) else {
            return param;
        };
        let Ok(dims) = <[usize; D]>::try_from(next.shape.as_slice()) else {
            self.err.get_or_insert(Error::internal(
                "dispatch",
                format!(
                    "parameter `{name}` has rank {D}, the checkpoint's tensor {:?}",
                    next.shape
                ),
            ));
            return param;
        };
        let tensor = match next.tensor {
            Some(t) => t.reshape(dims),
            None => Tensor::<D>::empty(dims, (self.device, next.dtype)),
        };
        let id = param.id;
        param.transform_for_load(tensor, id)
    }
}

/// burn's element type for a dispatched float tensor.
fn burn_dtype(name: &str, dtype: accel_api::DType) -> Result<DType> {
    Ok(match dtype {
        accel_api::DType::F32 => DType::F32,
        accel_api::DType::F64 => DType::F64,
        accel_api::DType::F16 => DType::F16,
        accel_api::DType::BF16 => DType::BF16,
        other => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{OP}: tensor `{name}` is {other}; accel-burn dispatches f32, f64, f16 and bf16 parameters"
                ),
            ))
        }
    })
}

/// A block's tensor on its way in, flat (taken when installed), and its
/// shape.
struct Staged(Mutex<Option<Tensor<1>>>, Vec<usize>);

impl<M: Module> Framework for Params<M> {
    type Device = Device;
    type Tensor = Staged;

    /// The module's device, for `cpu` and the plan's one accelerator.
    fn device(&self, target: &Target) -> Result<Device> {
        if target.is_accelerator() {
            let mut seen = self.accelerator.lock().map_err(poisoned)?;
            match &*seen {
                Some(a) if a != target => {
                    return Err(Error::invalid_argument(
                        OP,
                        format!(
                            "the plan names {a} and {target}; accel-burn dispatches onto one device, the module's"
                        ),
                    )
                    .with_fix("give max_memory one accelerator, cpu and disk"))
                }
                _ => *seen = Some(target.clone()),
            }
        }
        Ok(self.device.clone())
    }

    /// Host memory of the dtype (aligned), filled, then a tensor on
    /// `device`.
    fn materialise(
        name: &str,
        meta: &TensorMeta,
        device: &Device,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Staged> {
        let n: usize = meta.shape.iter().product();
        let dtype = burn_dtype(name, meta.dtype)?;
        let mut data = match dtype {
            DType::F64 => TensorData::zeros::<f64, _>([n]),
            DType::F16 => TensorData::zeros::<half::f16, _>([n]),
            DType::BF16 => TensorData::zeros::<half::bf16, _>([n]),
            _ => TensorData::zeros::<f32, _>([n]),
        };
        TensorData::with_bytes_mut([&mut data], |mut b| fill(&mut b[0][..]))?;
        let t = Tensor::<1>::from_data(data, (device, dtype));
        Ok(Staged(Mutex::new(Some(t)), meta.shape.clone()))
    }

    fn keep(&mut self, name: &str, t: Staged) -> Result<()> {
        let tensor = t.0.into_inner().map_err(poisoned)?;
        self.queue(name, Next::of(tensor, t.1))
    }

    fn tie(&mut self, alias: &str, owner: &str) -> Result<()> {
        let next = {
            let pending = self.pending.lock().map_err(poisoned)?;
            let o = pending.get(owner).ok_or_else(|| {
                Error::internal("dispatch", format!("tie of `{alias}` to unknown `{owner}`"))
            })?;
            Next {
                tensor: o.tensor.clone(),
                shape: o.shape.clone(),
                dtype: o.dtype,
            }
        };
        self.queue(alias, next)
    }

    fn offload(&mut self, name: &str, meta: &TensorMeta, device: &Device) -> Result<()> {
        self.release(name, meta, device)
    }

    fn install(&self, name: &str, t: &Staged) -> Result<()> {
        let tensor = t.0.lock().map_err(poisoned)?.take();
        if tensor.is_none() {
            return Err(Error::internal(
                "dispatch",
                format!("tensor `{name}` was installed twice"),
            ));
        }
        self.queue(name, Next::of(tensor, t.1.clone()))
    }

    fn release(&self, name: &str, meta: &TensorMeta, _: &Device) -> Result<()> {
        let dtype = burn_dtype(name, meta.dtype)?;
        self.queue(
            name,
            Next {
                tensor: None,
                shape: vec![0; meta.shape.len()],
                dtype,
            },
        )
    }
}
