//! The steps of [`load_and_dispatch`]: match, tie, plan, place, load,
//! check (the [module docs](super) say what each does).

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use accel_api::{DType, Error, OffloadStore, Result, TensorMeta};

use super::{Dispatch, DispatchOptions, DispatchReport, Dispatched, Framework};
use crate::exec::LayerSpec;
use crate::layout::{Layout, NodeId};
use crate::plan::{self, MaxMemory, Plan, PlanOptions, Reserve, Target};
use crate::safetensors::{Checkpoint, SafetensorsFile, TensorEntry};
use crate::store::{DiskStore, HostStore};

const OP: &str = "load_checkpoint_and_dispatch";

/// Where a tensor lives between forward passes.
#[derive(Debug, Clone)]
enum Place<D> {
    /// In the model's tensor, on this device, all the time.
    Resident(D),
    /// In the host store; materialised on the execution device per block.
    Host,
    /// In the disk store; materialised on the execution device per block.
    Disk,
}

/// Plan a device map for the model and load `checkpoint` into it through
/// `framework` (the steps of the [module docs](super)). `layout` gives the
/// model's layout (from the framework's modules, or from the opened
/// checkpoint); `blocks` are the modules [`Dispatched::run`] steps
/// through, in forward order.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument) naming the tensor when one of the layout
/// is missing from the checkpoint or has another shape, for a block that
/// is no module of the layout, and for planning failures (a budget too
/// small: the planner's message); [`Framework::device`]'s errors for a
/// planned device the framework lacks; the framework's errors; I/O and
/// corruption errors naming the file; `layout`'s errors.
pub fn load_and_dispatch<F: Framework, B: AsRef<str>>(
    mut framework: F,
    layout: impl FnOnce(&Checkpoint) -> Result<Layout>,
    checkpoint: &Path,
    blocks: &[B],
    opts: &DispatchOptions,
) -> Result<Dispatched<F>> {
    let start = Instant::now();
    let ck = Checkpoint::open(checkpoint)?;
    let layout = layout(&ck)?;
    let owner_of_entry = match_entries(&layout, &ck, checkpoint)?;
    let plan = plan_for(&layout, opts)?;
    let (device, places) = place(&framework, &layout, &plan)?;
    let (host, disk) = (HostStore::new(), open_disk(&places, opts)?);
    let mut report = DispatchReport::default();
    let mut offloaded: Vec<(String, TensorMeta)> = vec![];
    let read = Read {
        layout: &layout,
        plan: &plan,
        places: &places,
        owner_of_entry: &owner_of_entry,
    };
    for path in &ck.shards {
        let f = SafetensorsFile::open(path)?;
        read.shard(
            &f,
            &mut framework,
            (&host, disk.as_ref()),
            &mut report,
            &mut offloaded,
        )?;
    }
    // Tied aliases share their owner's storage (resident) or its meta.
    for group in layout.tied() {
        let owner = layout.node(group[0]).name();
        for &a in &group[1..] {
            let alias = layout.node(a).name();
            match &places[&a] {
                Place::Resident(_) => framework.tie(alias, owner)?,
                _ => {
                    if let Some((_, m)) = offloaded.iter().find(|(n, _)| n == owner) {
                        offloaded.push((alias.to_string(), m.clone()));
                    }
                }
            }
        }
    }
    for (name, meta) in &offloaded {
        framework.offload(name, meta, &device)?;
    }
    let specs = block_specs(&layout, &places, blocks)?;
    let mut outside: Vec<String> = offloaded
        .into_iter()
        .map(|(n, _)| n)
        .filter(|n| !specs.iter().any(|s| s.tensors.contains(n)))
        .collect();
    outside.sort();
    report.outside_blocks = outside;
    report.elapsed = start.elapsed();
    let r = &report;
    tracing::info!(
        resident = r.resident_bytes,
        host = r.host_bytes,
        disk = r.disk_bytes,
        disk_in_place = r.disk_in_place_bytes,
        elapsed_ms = r.elapsed.as_millis() as u64,
        "dispatched"
    );
    let dispatch = Dispatch {
        layout,
        plan,
        host,
        disk,
        blocks: specs,
        lookahead: opts.lookahead,
        report,
    };
    Ok(Dispatched::new(dispatch, framework, device))
}

/// Match and tie: every stored tensor of `layout` comes from an entry of
/// `ck` of its shape. Returns the entries read as a tied group's owner
/// (the owner's own, or the first member the checkpoint kept).
fn match_entries(
    layout: &Layout,
    ck: &Checkpoint,
    checkpoint: &Path,
) -> Result<HashMap<String, NodeId>> {
    let in_ck: HashMap<&str, &TensorEntry> = ck
        .tensors
        .iter()
        .flatten()
        .map(|e| (e.name.as_str(), e))
        .collect();
    let mut source: HashMap<NodeId, &str> = HashMap::new();
    for group in layout.tied() {
        let kept = group.iter().map(|&m| layout.node(m).name());
        if let Some(name) = kept.clone().find(|n| in_ck.contains_key(n)) {
            source.insert(group[0], name);
        }
    }
    let mut missing = vec![];
    for id in layout.tensor_ids() {
        let n = layout.node(id);
        if n.alias_of().is_some() {
            continue;
        }
        let Some(e) = in_ck.get(source.get(&id).copied().unwrap_or(n.name())) else {
            missing.push(n.name().to_string());
            continue;
        };
        let shape = n.shape().expect("tensor nodes have a shape");
        if e.meta.shape != shape {
            return Err(Error::invalid_argument(
                OP,
                format!(
                    "tensor `{}` is {shape:?} in the model but {:?} in {}",
                    n.name(),
                    e.meta.shape,
                    checkpoint.display()
                ),
            )
            .with_fix("build the model with this checkpoint's config"));
        }
    }
    if !missing.is_empty() {
        let n = missing.len();
        missing.truncate(5);
        return Err(Error::invalid_argument(
            OP,
            format!(
                "{n} tensor(s) of the model are not in {}, e.g. {missing:?}",
                checkpoint.display()
            ),
        )
        .with_fix("check the checkpoint matches the model, or declare the model's tied weights"));
    }
    Ok(source
        .into_iter()
        .map(|(o, n)| (n.to_string(), o))
        .collect())
}

/// Plan: `opts` as the planner's options (no budget: one unbounded CPU,
/// nothing reserved).
fn plan_for(layout: &Layout, opts: &DispatchOptions) -> Result<Plan> {
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
    plan::plan(layout, &popts)
}

/// Place: the execution device (the plan's first accelerator, else the
/// CPU), and per tensor node where its storage owner lives.
#[allow(clippy::type_complexity)]
fn place<F: Framework>(
    framework: &F,
    layout: &Layout,
    plan: &Plan,
) -> Result<(F::Device, HashMap<NodeId, Place<F::Device>>)> {
    let accelerator = plan.devices.iter().find(|d| d.device.is_accelerator());
    let device = framework.device(accelerator.map_or(&Target::Cpu, |d| &d.device))?;
    let mut places = HashMap::new();
    for id in layout.tensor_ids() {
        let owner = layout.node(id).alias_of().unwrap_or(id);
        let Some(t) = plan.device_of(owner) else {
            let name = layout.node(owner).name();
            return Err(Error::internal(
                OP,
                format!("tensor `{name}` has no device in the plan"),
            ));
        };
        let p = match t {
            Target::Disk => Place::Disk,
            Target::Cpu if accelerator.is_some() => Place::Host,
            t => Place::Resident(framework.device(t)?),
        };
        places.insert(id, p);
    }
    Ok((device, places))
}

/// The disk store, when anything is planned on disk: `opts.offload_dir`,
/// else a temporary folder removed with the store.
fn open_disk<D>(
    places: &HashMap<NodeId, Place<D>>,
    opts: &DispatchOptions,
) -> Result<Option<DiskStore>> {
    if !places.values().any(|p| matches!(p, Place::Disk)) {
        return Ok(None);
    }
    Ok(Some(match &opts.offload_dir {
        Some(d) => DiskStore::open(d)?,
        None => DiskStore::open_temp("accel-dispatch")?,
    }))
}

/// Load: what reading a shard needs to know.
struct Read<'a, D> {
    layout: &'a Layout,
    plan: &'a Plan,
    places: &'a HashMap<NodeId, Place<D>>,
    owner_of_entry: &'a HashMap<String, NodeId>,
}

impl<D> Read<'_, D> {
    /// The storage owner `e` is read as, and its planned dtype; `None` for
    /// an entry the model has no stored tensor for.
    fn owner(&self, e: &TensorEntry) -> Option<(NodeId, DType)> {
        let id = match self.owner_of_entry.get(&e.name) {
            Some(&owner) => owner,
            None => {
                let id = self.layout.id(&e.name)?;
                let n = self.layout.node(id);
                if !n.is_tensor() || n.alias_of().is_some() {
                    return None;
                }
                id
            }
        };
        Some((id, self.plan.dtype_of(id).unwrap_or(e.meta.dtype)))
    }

    /// A disk tensor that keeps its dtype, stored under the owner's own
    /// name (stores look owners up), is served from the shard in place.
    fn in_place(&self, e: &TensorEntry, id: NodeId, to: DType) -> bool {
        matches!(self.places[&id], Place::Disk)
            && to == e.meta.dtype
            && self.layout.node(id).name() == e.name
    }

    /// Read every entry of `f` into its place; offloaded owners join
    /// `offloaded`.
    fn shard<F: Framework<Device = D>>(
        &self,
        f: &SafetensorsFile,
        framework: &mut F,
        (host, disk): (&HostStore, Option<&DiskStore>),
        report: &mut DispatchReport,
        offloaded: &mut Vec<(String, TensorMeta)>,
    ) -> Result<()> {
        let disk = || disk.expect("a disk store when disk tensors exist");
        // Add the shard before any converted copy, so that those win.
        let entries = f.entries();
        if entries.iter().any(|e| {
            self.owner(e)
                .is_some_and(|(id, to)| self.in_place(e, id, to))
        }) {
            disk().add_file(f.path())?;
        }
        for e in entries {
            let Some((id, to)) = self.owner(e) else {
                if self.layout.id(&e.name).is_none() {
                    report.unexpected.push(e.name.clone());
                }
                continue;
            };
            report.tensors += 1;
            // The owner's name (the entry's own unless it is a tie's later copy).
            let name = self.layout.node(id).name();
            let meta = TensorMeta {
                dtype: to,
                shape: e.meta.shape.clone(),
            };
            let bytes = meta.byte_len() as u64;
            if self.in_place(e, id, to) {
                report.disk_bytes += e.len;
                report.disk_in_place_bytes += e.len;
                offloaded.push((name.to_string(), meta));
                continue;
            }
            match &self.places[&id] {
                Place::Resident(dev) => {
                    let t = if to == e.meta.dtype {
                        F::materialise(name, &meta, dev, &mut |out| read_into(f, e, out))?
                    } else {
                        let data = read(f, e, to)?;
                        F::materialise(name, &meta, dev, &mut |out| {
                            out.copy_from_slice(&data);
                            Ok(())
                        })?
                    };
                    framework.keep(name, t)?;
                    report.resident_bytes += bytes;
                    continue;
                }
                Place::Host => {
                    host.put(name, meta.clone(), &read(f, e, to)?)?;
                    report.host_bytes += bytes;
                }
                Place::Disk => {
                    disk().put(name, meta.clone(), &read(f, e, to)?)?;
                    report.disk_bytes += bytes;
                }
            }
            offloaded.push((name.to_string(), meta));
        }
        Ok(())
    }
}

/// `e`'s bytes into `out`, with positioned reads.
fn read_into(f: &SafetensorsFile, e: &TensorEntry, out: &mut [u8]) -> Result<()> {
    if e.len > 0 {
        f.read_into(e, out)?;
    }
    Ok(())
}

/// `e`'s bytes as `to`, with positioned reads.
fn read(f: &SafetensorsFile, e: &TensorEntry, to: DType) -> Result<Vec<u8>> {
    let mut data = vec![0u8; e.len as usize];
    read_into(f, e, &mut data)?;
    Ok(crate::convert::convert(e.meta.dtype, to, &data)?.unwrap_or(data))
}

/// Check: the offloaded tensors each block materialises.
fn block_specs<D, B: AsRef<str>>(
    layout: &Layout,
    places: &HashMap<NodeId, Place<D>>,
    blocks: &[B],
) -> Result<Vec<LayerSpec>> {
    blocks
        .iter()
        .map(|b| {
            let b = b.as_ref();
            let mut tensors = layout.tensors_under(b).ok_or_else(|| {
                Error::invalid_argument(OP, format!("block `{b}` is no module of the model"))
            })?;
            tensors.retain(|t| {
                layout
                    .id(t)
                    .is_some_and(|id| !matches!(places[&id], Place::Resident(_)))
            });
            Ok(LayerSpec {
                name: b.to_string(),
                tensors,
            })
        })
        .collect()
}
