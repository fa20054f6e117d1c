//! Big-model inference for tch models: Accelerate's
//! `load_checkpoint_and_dispatch` on accel-offload's dispatch pipeline
//! ([`accel_offload::dispatch`]). This module is tch's side of the
//! pipeline (its [`Framework`]: the `VarStore`'s variables) and the
//! model's layout ([`ModelSpec`], [`layout_json`]).
//!
//! [`load_checkpoint_and_dispatch`] takes a model built in a
//! [`VarStore`], a [`ModelSpec`] (the model's modules in the order it
//! defines them, and the blocks its forward runs through), a safetensors
//! checkpoint (one file or shards) and budgets, and
//!
//! 1. builds the model's layout in the model's own module order (not the
//!    alphabetical order of tensor names) and plans a device map with
//!    accel-offload's planner (Accelerate's `infer_auto_device_map` policy,
//!    `no_split` classes, tied groups);
//! 2. reads every tensor of the checkpoint once into its planned place:
//!    resident tensors straight into the model's variables (on the
//!    execution device), `cpu`-offloaded ones into a [`HostStore`] when the
//!    execution device is an accelerator, `disk` ones into a [`DiskStore`]
//!    that serves the checkpoint's own shards in place (zero-copy, memory
//!    mapped) unless the planned dtype differs (then converted copies go
//!    into the offload folder);
//! 3. leaves every offloaded variable as an empty placeholder.
//!
//! [`Dispatched::run`] then steps through the blocks: before a block's
//! forward its offloaded weights are materialised into the model's
//! variables, after it they are released (the variables point at empty
//! placeholders again), and a background thread reads the next block
//! meanwhile ([`accel_offload::exec::run_layers`], `lookahead` blocks
//! ahead). Tied weights are materialised once per run and shared.
//!
//! ```no_run
//! use accel_offload::plan::MaxMemory;
//! use accel_tch::dispatch::{load_checkpoint_and_dispatch, DispatchOptions, ModelSpec};
//! use tch::nn::{self, Module};
//!
//! let vs = nn::VarStore::new(tch::Device::Cpu);
//! let layers: Vec<nn::Linear> = (0..4)
//!     .map(|i| nn::linear(vs.root() / "layers" / i, 512, 512, Default::default()))
//!     .collect();
//! let mut spec = ModelSpec::new();
//! for i in 0..4 {
//!     spec = spec.block(&format!("layers.{i}"), Some("Linear"));
//! }
//! let opts = DispatchOptions {
//!     max_memory: Some(MaxMemory::parse("cpu=2MiB,disk")?),
//!     ..DispatchOptions::default()
//! };
//! let d = load_checkpoint_and_dispatch(&vs, &spec, "model.safetensors".as_ref(), &opts)?;
//! let mut h = Some(tch::Tensor::zeros([1, 512], tch::kind::FLOAT_CPU));
//! d.run(|i, _block| {
//!     h = Some(layers[i].forward(&h.take().expect("set")).relu());
//!     Ok(())
//! })?;
//! # Ok::<(), accel_api::Error>(())
//! ```
//!
//! # How weights reach the model
//! tch layers hold shallow handles of the `VarStore`'s variables, so
//! `set_data` on a variable changes what every handle sees: materialising
//! is a pointer swap on the compute thread, the copy itself happens on the
//! prefetch thread. Disk tensors are copied with positioned reads
//! ([`DiskStore::read_into`]), not through the mapping, so the pages of the
//! checkpoint never stay resident in the process: resident memory is the
//! resident weights plus the blocks in flight.
//!
//! # Requires
//! Every variable of the `VarStore` is in the checkpoint (or a tied alias
//! of one that is), with the same shape, on the CPU, of a kind accel has an
//! element type for. The forward passes run under `no_grad` and must not
//! keep handles of an offloaded weight beyond its block (a kept handle sees
//! the empty placeholder after the block).
//!
//! [`HostStore`]: accel_offload::store::HostStore
//! [`DiskStore`]: accel_offload::store::DiskStore
//! [`DiskStore::read_into`]: accel_offload::store::DiskStore::read_into

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use accel_offload::dispatch::{self as shared, load_and_dispatch, Dispatch, Framework};
use accel_offload::exec::ExecStats;
use accel_offload::layout::{Layout, LayoutJson, ModuleJson, TensorJson, LAYOUT_FORMAT};
use accel_offload::plan::Target;
use accel_offload::util::natural_cmp;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::ffi;

pub use accel_offload::dispatch::{DispatchOptions, DispatchReport};

/// A module of the model, named by its full dotted path, with its class
/// when known (for `no_split`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModuleDecl {
    /// Full dotted name (`encoder.layer.0`).
    pub name: String,
    /// Class name (`BertLayer`), matched by [`DispatchOptions::no_split`].
    pub class: Option<String>,
}

/// What dispatch needs to know about a tch model besides its variables
/// (a `VarStore` keeps names but neither module order nor classes).
///
/// * `modules`: modules in definition order (preorder: a parent before its
///   children, siblings as the model defines them). A variable belongs to
///   the longest declared module its name starts with and sorts by that
///   module's position; variables under no declared module come last, in
///   natural name order (`layer.2` before `layer.10`). Declaring the blocks
///   is usually enough; declare finer modules where their order matters to
///   the planner.
/// * `blocks`: the modules [`Dispatched::run`] steps through, in forward
///   order. Offloaded weights are materialised a block at a time.
/// * `tied`: groups of variable names sharing one storage. The member
///   first in module order owns it (the planner counts it there); the
///   checkpoint needs only one member, whichever it kept (checkpoints store
///   tied weights once), and every member is loaded as a view of it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelSpec {
    /// Modules in definition order.
    pub modules: Vec<ModuleDecl>,
    /// Blocks in forward order.
    pub blocks: Vec<String>,
    /// Tied groups of full variable names.
    pub tied: Vec<Vec<String>>,
}

impl ModelSpec {
    /// An empty spec.
    pub fn new() -> ModelSpec {
        ModelSpec::default()
    }

    /// Declare module `name` (of class `class`), after those declared so far.
    pub fn module(mut self, name: &str, class: Option<&str>) -> ModelSpec {
        self.modules.push(ModuleDecl {
            name: name.to_string(),
            class: class.map(str::to_string),
        });
        self
    }

    /// Declare block `name` (of class `class`): a module, and the next step
    /// of [`Dispatched::run`].
    pub fn block(mut self, name: &str, class: Option<&str>) -> ModelSpec {
        if !self.modules.iter().any(|m| m.name == name) {
            self = self.module(name, class);
        }
        self.blocks.push(name.to_string());
        self
    }

    /// Declare variables sharing one storage.
    pub fn tie(mut self, names: &[&str]) -> ModelSpec {
        self.tied
            .push(names.iter().map(|s| s.to_string()).collect());
        self
    }
}

/// A tch model dispatched over a device map (see the [module docs](self)).
///
/// Its plan, device map, layout, offload folder, blocks and report are
/// those of the [`Dispatch`] it derefs to.
pub struct Dispatched(shared::Dispatched<Vars>);

impl std::fmt::Debug for Dispatched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("exec_device", self.0.device())
            .field("variables", &self.0.framework().0.len())
            .field("dispatch", self.0.dispatch())
            .finish()
    }
}

impl std::ops::Deref for Dispatched {
    type Target = Dispatch;
    fn deref(&self) -> &Dispatch {
        &self.0
    }
}

fn invalid(op: &str, msg: String) -> Error {
    Error::invalid_argument(op, msg)
}

fn tch_err(op: &str, e: tch::TchError) -> Error {
    Error::new(ErrorKind::Internal, format!("{op}: libtorch: {e}"))
}

fn kind_for(op: &str, name: &str, dtype: DType) -> Result<Kind> {
    ffi::kind_of(dtype).ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!("{op}: tensor `{name}` is {dtype}, which libtorch has no kind for here"),
        )
    })
}

/// The layout of the model in `vs` as [`ModelSpec`] orders it, in
/// accel-offload's JSON form (write it out for `accel plan --layout`).
/// Trainable variables are parameters, the others buffers.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] for a declared module or block no
/// variable belongs to, or a variable name that is also a module;
/// [`ErrorKind::Unsupported`] for a variable of a kind accel has no element
/// type for.
pub fn layout_json(vs: &VarStore, spec: &ModelSpec) -> Result<LayoutJson> {
    const OP: &str = "layout_json";
    let vars = vs.variables();
    let declared: HashMap<&str, usize> = spec
        .modules
        .iter()
        .enumerate()
        .map(|(i, m)| (m.name.as_str(), i))
        .collect();
    let classes: HashMap<&str, &str> = spec
        .modules
        .iter()
        .filter_map(|m| Some((m.name.as_str(), m.class.as_deref()?)))
        .collect();
    // Rank of a variable: the position of the longest declared module
    // holding it.
    let rank = |name: &str| -> usize {
        let mut best = spec.modules.len();
        let mut end = name.len();
        while let Some(i) = name[..end].rfind('.') {
            end = i;
            if let Some(&r) = declared.get(&name[..end]) {
                best = r;
                break;
            }
        }
        best
    };
    let mut items: Vec<(usize, &String, &Tensor)> =
        vars.iter().map(|(n, t)| (rank(n), n, t)).collect();
    items.sort_by(|a, b| {
        a.0.cmp(&b.0).then_with(|| {
            let (mut x, mut y) = (a.1.split('.'), b.1.split('.'));
            loop {
                match (x.next(), y.next()) {
                    (Some(p), Some(q)) => match natural_cmp(p, q) {
                        std::cmp::Ordering::Equal => continue,
                        o => return o,
                    },
                    (p, q) => return p.is_some().cmp(&q.is_some()),
                }
            }
        })
    });
    for m in spec.modules.iter().map(|m| &m.name).chain(&spec.blocks) {
        let prefix = format!("{m}.");
        if !vars.keys().any(|n| n.starts_with(&prefix)) {
            return Err(invalid(
                OP,
                format!("module `{m}` of the ModelSpec holds no variable of the VarStore"),
            )
            .with_fix(
                "name modules by their full dotted path, as the VarStore's variables are named",
            ));
        }
    }
    let mut root = ModuleJson {
        class: classes.get("").map(|c| c.to_string()),
        ..ModuleJson::default()
    };
    for (_, name, t) in items {
        let dtype = ffi::dtype_of(t.kind()).ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!("{OP}: variable `{name}` is of kind {:?}", t.kind()),
            )
        })?;
        let parts: Vec<&str> = name.split('.').collect();
        let (leaf, path) = parts.split_last().expect("split gives one part");
        let mut cur = &mut root;
        for (depth, p) in path.iter().enumerate() {
            let i = match cur.children.iter().position(|c| c.name == *p) {
                Some(i) => i,
                None => {
                    let full = parts[..=depth].join(".");
                    cur.children.push(ModuleJson {
                        name: p.to_string(),
                        class: classes.get(full.as_str()).map(|c| c.to_string()),
                        ..ModuleJson::default()
                    });
                    cur.children.len() - 1
                }
            };
            cur = &mut cur.children[i];
        }
        let tj = TensorJson {
            name: leaf.to_string(),
            dtype,
            shape: t.size().iter().map(|&d| d as usize).collect(),
            persistent: true,
        };
        if t.requires_grad() {
            cur.params.push(tj);
        } else {
            cur.buffers.push(tj);
        }
    }
    Ok(LayoutJson {
        format: LAYOUT_FORMAT.to_string(),
        root,
        tied: spec.tied.clone(),
    })
}

/// The tch device of a planned accelerator (`cuda:N`, `mps`).
fn tch_device(t: &Target) -> Result<Device> {
    let name = t.to_string();
    let bad = || {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "dispatch: device `{name}` of the plan is not a libtorch device this build runs on"
            ),
        )
        .with_fix("plan with cuda:N, mps, cpu and disk only")
    };
    match t {
        Target::Cpu => Ok(Device::Cpu),
        Target::Disk => Err(bad()),
        Target::Accelerator(a) => {
            if a == "mps" {
                return Ok(Device::Mps);
            }
            let n = a.strip_prefix("cuda:").ok_or_else(bad)?;
            Ok(Device::Cuda(n.parse().map_err(|_| bad())?))
        }
    }
}

/// Plan a device map for the model in `vs` and load `checkpoint` into it:
/// the analogue of Accelerate's `load_checkpoint_and_dispatch(model,
/// checkpoint, device_map="auto", max_memory=..., no_split_module_classes=...)`
/// (see the [module docs](self)).
///
/// `checkpoint` is a `.safetensors` file, a shard index
/// (`model.safetensors.index.json`) or a folder holding either.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] naming the tensor when a variable is
/// missing from the checkpoint or has another shape, for a block that is no
/// module, and for planning failures (a budget too small: the planner's
/// message); [`ErrorKind::Unsupported`] for a planned device libtorch does
/// not have here; I/O and corruption errors naming the file.
pub fn load_checkpoint_and_dispatch(
    vs: &VarStore,
    spec: &ModelSpec,
    checkpoint: &Path,
    opts: &DispatchOptions,
) -> Result<Dispatched> {
    let _guard = tch::no_grad_guard();
    let json = layout_json(vs, spec)?;
    let layout = |_: &_| Layout::from_json(&json);
    let vars = Vars(vs.variables());
    load_and_dispatch(vars, layout, checkpoint, &spec.blocks, opts).map(Dispatched)
}

/// The `VarStore`'s variables by full name (shallow handles): tch's side
/// of dispatch.
struct Vars(HashMap<String, Tensor>);

/// A tensor made on the prefetch thread (a tch tensor is not `Sync`).
struct Staged(Mutex<Tensor>);

impl Vars {
    fn set(&self, name: &str, data: &Tensor) -> Result<()> {
        let mut v = self
            .0
            .get(name)
            .ok_or_else(|| invalid("dispatch", format!("no variable `{name}` in the VarStore")))?
            .shallow_clone();
        v.f_set_data(data)
            .map_err(|e| tch_err(&format!("dispatch: set `{name}`"), e))
    }
}

impl Framework for Vars {
    type Device = Device;
    type Tensor = Staged;

    fn device(&self, target: &Target) -> Result<Device> {
        tch_device(target)
    }

    /// A CPU tensor filled in place, then moved to `device`.
    fn materialise(
        name: &str,
        meta: &TensorMeta,
        device: &Device,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
    ) -> Result<Staged> {
        let kind = kind_for("dispatch", name, meta.dtype)?;
        let shape: Vec<i64> = meta.shape.iter().map(|&d| d as i64).collect();
        let mut t = Tensor::f_empty(shape.as_slice(), (kind, Device::Cpu))
            .map_err(|e| tch_err("dispatch", e))?;
        fill(ffi::host_view_mut(&mut t)?.into_bytes())?;
        if *device != Device::Cpu {
            t = t.f_to_device(*device).map_err(|e| tch_err("dispatch", e))?;
        }
        Ok(Staged(Mutex::new(t)))
    }

    fn keep(&mut self, name: &str, t: Staged) -> Result<()> {
        let t =
            t.0.into_inner()
                .map_err(|_| Error::internal("dispatch", "a new tensor's lock is poisoned"))?;
        self.set(name, &t)
    }

    fn tie(&mut self, alias: &str, owner: &str) -> Result<()> {
        let o = self.0.get(owner).map(Tensor::shallow_clone);
        let o = o.ok_or_else(|| invalid("dispatch", format!("no variable `{owner}`")))?;
        self.set(alias, &o)
    }

    fn offload(&mut self, name: &str, meta: &TensorMeta, device: &Device) -> Result<()> {
        self.release(name, meta, device)
    }

    /// A pointer swap: every handle of the variable sees `t`.
    fn install(&self, name: &str, t: &Staged) -> Result<()> {
        let t =
            t.0.lock()
                .map_err(|_| Error::internal("dispatch", "a staged tensor's lock is poisoned"))?;
        self.set(name, &t)
    }

    fn release(&self, name: &str, meta: &TensorMeta, device: &Device) -> Result<()> {
        let kind = kind_for("dispatch", name, meta.dtype)?;
        let empty = Tensor::f_empty([0i64].as_slice(), (kind, *device))
            .map_err(|e| tch_err("dispatch", e))?;
        self.set(name, &empty)
    }
}

impl Dispatched {
    /// Where blocks run: the first accelerator of the plan, else the CPU.
    pub fn execution_device(&self) -> Device {
        *self.0.device()
    }

    /// Run one forward pass: call `step(index, block_name)` for every block
    /// in order, each with its offloaded weights materialised in the
    /// model's variables, released after it; the next block is read on a
    /// background thread meanwhile. Runs under `no_grad`.
    ///
    /// # Errors
    /// The first error of `step` or of reading a block (the weights of the
    /// block in hand are released first).
    pub fn run<F>(&self, step: F) -> Result<ExecStats>
    where
        F: FnMut(usize, &str) -> Result<()>,
    {
        let _guard = tch::no_grad_guard();
        self.0.run(step)
    }
}
