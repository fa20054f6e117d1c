//! Big-model inference for tch models: Accelerate's
//! `load_checkpoint_and_dispatch` on [`accel_offload`].
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

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use accel_api::{DType, Error, ErrorKind, OffloadStore, Result, TensorMeta};
use accel_offload::dispatched::Dispatch;
use accel_offload::exec::{ExecStats, LayerSpec, Resident};
use accel_offload::layout::{Layout, LayoutJson, ModuleJson, NodeId, TensorJson, LAYOUT_FORMAT};
use accel_offload::plan::{self, MaxMemory, PlanOptions, Reserve, Target};
use accel_offload::safetensors::{Checkpoint, SafetensorsFile, TensorEntry};
use accel_offload::store::{DiskStore, HostStore};
use accel_offload::util::natural_cmp;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::ffi;

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

/// Options of [`load_checkpoint_and_dispatch`] (Accelerate's arguments of
/// the same names).
#[derive(Debug, Clone)]
pub struct DispatchOptions {
    /// Budgets (`cuda:0=40GiB,cpu=20MiB,disk`); `None` puts everything on
    /// the CPU, unbounded (no offload).
    pub max_memory: Option<MaxMemory>,
    /// Class names or full-name globs of modules kept on one device.
    pub no_split: Vec<String>,
    /// Cast floating-point weights to this dtype (narrowing only).
    pub dtype: Option<DType>,
    /// Where converted disk tensors are written; without it a folder under
    /// the system's temporary directory, removed when the [`Dispatched`] is
    /// dropped. Unneeded when disk tensors keep the checkpoint's dtype
    /// (they are served from the checkpoint in place).
    pub offload_dir: Option<PathBuf>,
    /// Blocks read ahead by the prefetch thread (0: read each block on the
    /// compute thread just before it runs).
    pub lookahead: usize,
    /// Accelerate's `fallback_allocation`.
    pub fallback_allocation: bool,
}

impl Default for DispatchOptions {
    fn default() -> Self {
        DispatchOptions {
            max_memory: None,
            no_split: vec![],
            dtype: None,
            offload_dir: None,
            lookahead: 1,
            fallback_allocation: false,
        }
    }
}

/// Where a tensor lives between forward passes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// In the model's variable, on this device, all the time.
    Resident(Device),
    /// In the host store; materialised on the execution device per block.
    Host,
    /// In the disk store; materialised on the execution device per block.
    Disk,
}

/// What loading did.
#[derive(Debug, Clone, Default)]
pub struct DispatchReport {
    /// Tensors read from the checkpoint.
    pub tensors: usize,
    /// Bytes kept resident in the model's variables.
    pub resident_bytes: u64,
    /// Bytes in the host store.
    pub host_bytes: u64,
    /// Bytes served by the disk store.
    pub disk_bytes: u64,
    /// Of `disk_bytes`, those served from the checkpoint in place
    /// (zero-copy) rather than written to the offload folder.
    pub disk_in_place_bytes: u64,
    /// Checkpoint tensors that are no variable of the model (skipped).
    pub unexpected: Vec<String>,
    /// Offloaded tensors that no block covers: [`Dispatched::run`] never
    /// materialises them.
    pub outside_blocks: Vec<String>,
    /// Planning and loading time.
    pub elapsed: Duration,
}

/// A tch model dispatched over a device map (see the [module docs](self)).
///
/// Its plan, device map, layout, offload folder, blocks and report are
/// those of the [`Dispatch`] it derefs to.
pub struct Dispatched {
    dispatch: Dispatch<DispatchReport>,
    exec_device: Device,
    /// Shallow handles of every variable, by full name.
    vars: HashMap<String, Tensor>,
    /// Per tensor node: where its storage owner lives.
    places: HashMap<NodeId, Place>,
    /// Per offloaded variable: the kind it is materialised as.
    kinds: HashMap<String, Kind>,
    host: HostStore,
}

impl std::fmt::Debug for Dispatched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("exec_device", &self.exec_device)
            .field("variables", &self.vars.len())
            .field("dispatch", &self.dispatch)
            .finish()
    }
}

impl std::ops::Deref for Dispatched {
    type Target = Dispatch<DispatchReport>;
    fn deref(&self) -> &Dispatch<DispatchReport> {
        &self.dispatch
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

/// A fresh CPU tensor holding the bytes of `e`, read with positioned reads.
fn read_tensor(f: &SafetensorsFile, e: &TensorEntry) -> Result<Tensor> {
    let kind = kind_for("dispatch", &e.name, e.meta.dtype)?;
    let shape: Vec<i64> = e.meta.shape.iter().map(|&d| d as i64).collect();
    let mut t = Tensor::f_empty(shape.as_slice(), (kind, Device::Cpu))
        .map_err(|err| tch_err("dispatch", err))?;
    if e.len > 0 {
        f.read_into(e, ffi::host_view_mut(&mut t)?.into_bytes())?;
    }
    Ok(t)
}

fn set_var(vars: &HashMap<String, Tensor>, name: &str, data: &Tensor) -> Result<()> {
    let mut v = vars
        .get(name)
        .ok_or_else(|| invalid("dispatch", format!("no variable `{name}` in the VarStore")))?
        .shallow_clone();
    v.f_set_data(data)
        .map_err(|e| tch_err(&format!("dispatch: set `{name}`"), e))
}

fn placeholder(kind: Kind, device: Device) -> Result<Tensor> {
    Tensor::f_empty([0i64].as_slice(), (kind, device)).map_err(|e| tch_err("dispatch", e))
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
    const OP: &str = "load_checkpoint_and_dispatch";
    let start = Instant::now();
    let _guard = tch::no_grad_guard();
    let layout = Layout::from_json(&layout_json(vs, spec)?)?;
    let ck = Checkpoint::open(checkpoint)?;

    // Every stored variable must come from the checkpoint, shaped alike.
    let mut in_ck: HashMap<&str, &TensorEntry> = HashMap::new();
    for shard in &ck.tensors {
        for e in shard {
            in_ck.insert(e.name.as_str(), e);
        }
    }
    // A tied group's storage comes from its owner's entry, or else from the
    // first member the checkpoint has (a checkpoint that kept the later copy
    // of a tie): that entry is read as the owner.
    let mut source: HashMap<NodeId, &str> = HashMap::new();
    for group in layout.tied() {
        if let Some(&m) = group
            .iter()
            .find(|&&m| in_ck.contains_key(layout.node(m).name()))
        {
            source.insert(group[0], layout.node(m).name());
        }
    }
    let owner_of_entry: HashMap<&str, NodeId> = source.iter().map(|(&o, &n)| (n, o)).collect();
    let mut missing = vec![];
    for id in layout.tensor_ids() {
        let n = layout.node(id);
        if n.alias_of().is_some() {
            continue;
        }
        let stored = source.get(&id).copied().unwrap_or(n.name());
        match in_ck.get(stored) {
            None => missing.push(n.name().to_string()),
            Some(e) => {
                let shape = n.shape().expect("tensor nodes have a shape");
                if e.meta.shape != shape {
                    return Err(invalid(
                        OP,
                        format!(
                            "variable `{}` is {:?} in the model but {:?} in {}",
                            n.name(),
                            shape,
                            e.meta.shape,
                            checkpoint.display()
                        ),
                    )
                    .with_fix("build the model with this checkpoint's config"));
                }
            }
        }
    }
    if !missing.is_empty() {
        let n = missing.len();
        missing.truncate(5);
        return Err(invalid(
            OP,
            format!(
                "{n} variable(s) of the model are not in {}, e.g. {missing:?}",
                checkpoint.display()
            ),
        )
        .with_fix(
            "check the checkpoint matches the model, or declare tied copies in ModelSpec::tie",
        ));
    }

    let unbounded = opts.max_memory.is_none();
    let popts = PlanOptions {
        max_memory: Some(opts.max_memory.clone().unwrap_or(MaxMemory {
            devices: vec![(Target::Cpu, Some(u64::MAX / 4))],
        })),
        no_split: opts.no_split.clone(),
        dtype: opts.dtype,
        reserve: if unbounded {
            Reserve::None
        } else {
            Reserve::default()
        },
        fallback_allocation: opts.fallback_allocation,
        ..PlanOptions::default()
    };
    let plan = plan::plan(&layout, &popts)?;
    let exec_device = match plan.devices.iter().find(|d| d.device.is_accelerator()) {
        Some(d) => tch_device(&d.device)?,
        None => Device::Cpu,
    };

    // Where each storage owner goes.
    let mut places: HashMap<NodeId, Place> = HashMap::new();
    for id in layout.tensor_ids() {
        let owner = layout.node(id).alias_of().unwrap_or(id);
        let Some(t) = plan.device_of(owner) else {
            return Err(Error::internal(
                OP,
                format!(
                    "tensor `{}` has no device in the plan",
                    layout.node(owner).name()
                ),
            ));
        };
        let p = match t {
            Target::Disk => Place::Disk,
            Target::Cpu if exec_device != Device::Cpu => Place::Host,
            t => Place::Resident(tch_device(t)?),
        };
        places.insert(id, p);
    }

    let vars = vs.variables();
    let mut report = DispatchReport::default();
    let needs_disk = places.values().any(|p| *p == Place::Disk);
    let disk = if needs_disk {
        Some(match &opts.offload_dir {
            Some(d) => DiskStore::open(d)?,
            // Removed with its contents when the Dispatched is dropped.
            None => DiskStore::open_temp("accel-dispatch")?,
        })
    } else {
        None
    };
    let host = HostStore::new();
    let mut kinds: HashMap<String, Kind> = HashMap::new();

    for path in &ck.shards {
        let f = SafetensorsFile::open(path)?;
        // The storage owner an entry is read as, and its planned dtype.
        let plan_dtype = |e: &TensorEntry| -> Option<(NodeId, DType)> {
            let id = match owner_of_entry.get(e.name.as_str()) {
                Some(&owner) => owner,
                None => {
                    let id = layout.id(&e.name)?;
                    let n = layout.node(id);
                    if !n.is_tensor() || n.alias_of().is_some() {
                        return None;
                    }
                    id
                }
            };
            Some((id, plan.dtype_of(id).unwrap_or(e.meta.dtype)))
        };
        // In place only under the owner's own name (stores look owners up).
        let servable = |e: &TensorEntry, id: NodeId, to: DType| {
            places[&id] == Place::Disk && to == e.meta.dtype && layout.node(id).name() == e.name
        };
        // Disk tensors keeping their dtype are served from the shard itself;
        // add it before any converted copy so that those win.
        let in_place = f
            .entries()
            .iter()
            .any(|e| plan_dtype(e).is_some_and(|(id, to)| servable(e, id, to)));
        if in_place {
            disk.as_ref()
                .expect("a disk store when disk tensors exist")
                .add_file(path)?;
        }
        for e in f.entries() {
            let Some((id, to)) = plan_dtype(e) else {
                if layout.id(&e.name).is_none() {
                    report.unexpected.push(e.name.clone());
                }
                continue;
            };
            report.tensors += 1;
            // The owner's name (the entry's own unless it is a tie's later copy).
            let name = layout.node(id).name();
            let kind = kind_for(OP, name, to)?;
            let place = places[&id];
            if servable(e, id, to) {
                report.disk_bytes += e.len;
                report.disk_in_place_bytes += e.len;
                kinds.insert(name.to_string(), kind);
                continue;
            }
            let mut t = read_tensor(&f, e)?;
            if to != e.meta.dtype {
                t = t.f_to_kind(kind).map_err(|err| tch_err(OP, err))?;
            }
            let meta = TensorMeta {
                dtype: to,
                shape: e.meta.shape.clone(),
            };
            let bytes = meta.byte_len() as u64;
            match place {
                Place::Resident(dev) => {
                    if dev != Device::Cpu {
                        t = t.f_to_device(dev).map_err(|err| tch_err(OP, err))?;
                    }
                    set_var(&vars, name, &t)?;
                    report.resident_bytes += bytes;
                }
                Place::Host => {
                    host.put(name, meta, ffi::host_view(&t)?.bytes())?;
                    report.host_bytes += bytes;
                    kinds.insert(name.to_string(), kind);
                }
                Place::Disk => {
                    disk.as_ref()
                        .expect("a disk store when disk tensors exist")
                        .put(name, meta, ffi::host_view(&t)?.bytes())?;
                    report.disk_bytes += bytes;
                    kinds.insert(name.to_string(), kind);
                }
            }
        }
    }

    // Tied aliases share their owner's storage (resident) or its kind
    // (offloaded); offloaded variables drop what they held.
    for group in layout.tied() {
        let owner = layout.node(group[0]).name();
        for &a in &group[1..] {
            let alias = layout.node(a).name();
            match places[&a] {
                Place::Resident(_) => {
                    let o = vars[owner].shallow_clone();
                    set_var(&vars, alias, &o)?;
                }
                _ => {
                    if let Some(&k) = kinds.get(owner) {
                        kinds.insert(alias.to_string(), k);
                    }
                }
            }
        }
    }
    for (name, &k) in &kinds {
        set_var(&vars, name, &placeholder(k, exec_device)?)?;
    }

    // Blocks: the offloaded tensors each one materialises.
    let mut covered: HashSet<&str> = HashSet::new();
    let mut blocks = vec![];
    for b in &spec.blocks {
        let mut tensors = layout
            .tensors_under(b)
            .ok_or_else(|| invalid(OP, format!("block `{b}` is no module of the model")))?;
        tensors.retain(|t| {
            layout
                .id(t)
                .is_some_and(|id| !matches!(places[&id], Place::Resident(_)))
        });
        blocks.push(LayerSpec {
            name: b.clone(),
            tensors,
        });
    }
    for b in &blocks {
        covered.extend(b.tensors.iter().map(String::as_str));
    }
    let mut outside: Vec<String> = kinds
        .keys()
        .filter(|k| !covered.contains(k.as_str()))
        .cloned()
        .collect();
    outside.sort();
    report.outside_blocks = outside;
    report.elapsed = start.elapsed();
    let dispatched = Dispatched {
        dispatch: Dispatch::new(layout, plan, disk, report).with_blocks(blocks, opts.lookahead),
        exec_device,
        vars,
        places,
        kinds,
        host,
    };
    let r = dispatched.report();
    tracing::info!(
        resident = r.resident_bytes,
        host = r.host_bytes,
        disk = r.disk_bytes,
        disk_in_place = r.disk_in_place_bytes,
        elapsed_ms = r.elapsed.as_millis() as u64,
        "dispatched"
    );
    Ok(dispatched)
}

/// A block's offloaded weights on their way to the execution device.
struct Staged(Mutex<Tensor>);

impl Dispatched {
    /// Where blocks run: the first accelerator of the plan, else the CPU.
    pub fn execution_device(&self) -> Device {
        self.exec_device
    }

    /// Run one forward pass: call `step(index, block_name)` for every block
    /// in order, each with its offloaded weights materialised in the
    /// model's variables, released after it; the next block is read on a
    /// background thread meanwhile. Runs under `no_grad`.
    ///
    /// # Errors
    /// The first error of `step` or of reading a block (the weights of the
    /// block in hand are released first).
    pub fn run<F>(&self, mut step: F) -> Result<ExecStats>
    where
        F: FnMut(usize, &str) -> Result<()>,
    {
        let _guard = tch::no_grad_guard();
        let src = self.weight_source(&[(Target::Cpu, &self.host)]);
        let (layout, places, disk, exec_device) = (
            self.layout(),
            &self.places,
            self.dispatch.disk(),
            self.exec_device,
        );
        // On the prefetch thread: a fresh tensor on the execution device.
        let upload = move |name: &str, meta: &TensorMeta, bytes: &[u8]| -> Result<Staged> {
            let id = layout
                .id(name)
                .ok_or_else(|| invalid("dispatch", format!("no tensor `{name}`")))?;
            let owner = layout.node(layout.node(id).alias_of().unwrap_or(id)).name();
            let kind = kind_for("dispatch", name, meta.dtype)?;
            let shape: Vec<i64> = meta.shape.iter().map(|&d| d as i64).collect();
            let mut t = Tensor::f_empty(shape.as_slice(), (kind, Device::Cpu))
                .map_err(|e| tch_err("dispatch", e))?;
            let out = ffi::host_view_mut(&mut t)?.into_bytes();
            match (places.get(&id), disk) {
                (Some(Place::Disk), Some(d)) => d.read_into(owner, out)?,
                _ => out.copy_from_slice(bytes),
            }
            if exec_device != Device::Cpu {
                t = t
                    .f_to_device(exec_device)
                    .map_err(|e| tch_err("dispatch", e))?;
            }
            Ok(Staged(Mutex::new(t)))
        };
        let vars = &self.vars;
        let kinds = &self.kinds;
        let compute = |r: &Resident<Staged>| -> Result<()> {
            let mut res = Ok(());
            for (name, _, b) in r.tensors() {
                let t = b.0.lock().map_err(|_| {
                    Error::internal("dispatch", "a staged tensor's lock is poisoned")
                })?;
                res = set_var(vars, name, &t);
                if res.is_err() {
                    break;
                }
            }
            if res.is_ok() {
                res = step(r.index, &r.name);
            }
            for (name, _, _) in r.tensors() {
                let k = kinds.get(name).copied().unwrap_or(Kind::Float);
                let released = placeholder(k, exec_device).and_then(|p| set_var(vars, name, &p));
                if res.is_ok() {
                    res = released;
                }
            }
            res
        };
        self.dispatch.run_blocks(&src, upload, compute)
    }
}
