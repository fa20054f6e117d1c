//! Device-map planning under memory budgets, with Accelerate's
//! `infer_auto_device_map` policy.
//!
//! # Policy (what [`plan`] does)
//! * Sizes: a tensor costs `numel × dtype size`; with a dtype override,
//!   floating-point tensors cost `numel × min(override, own)` and integer
//!   tensors keep their own size; a per-tensor override wins. A tied group
//!   costs its bytes once, on its first member in tree order (as
//!   `named_parameters()` counts it in Accelerate), whichever member a
//!   checkpoint stores; the other members cost nothing.
//! * Modules are taken in tree order, starting from the root's entries
//!   (parameters, child modules, buffers). Devices are filled in order:
//!   accelerators in the order given, then `cpu`, then `disk` (unbounded).
//! * An entry that fits on the current device (together with the entries
//!   holding its tied partners) is placed there. One that does not fit is
//!   split into its own tensors and child modules, unless it has no child
//!   modules or may not be split (`no_split` class or name pattern); an entry
//!   that cannot be split moves the cursor to the next device, and earlier
//!   devices are never revisited.
//! * When an entry fits alone but not with its tied partners, the first
//!   splittable partner module, taking partners in sorted-name order as
//!   Accelerate's `find_tied_parameters` does, is split and the entry tried
//!   again.
//! * With [`PlanOptions::fallback_allocation`], a device (not disk) that
//!   would be left empty gets the first module further on that fits in its
//!   budget minus the larger of the reserved layer and the entry that did
//!   not fit (splitting modules to find one), as Accelerate's
//!   `fallback_allocation`. A device passed over while empty reports the
//!   bytes the entry needed ([`DevicePlan::min_needed`]) and why
//!   ([`DevicePlan::empty_reason`]), e.g. because of the reservation.
//! * The size of the largest remaining *layer* (a module with no child
//!   modules, or a no-split module) is kept free on the main devices — the
//!   first accelerator and `cpu`, exactly as Accelerate does — so an
//!   offloaded layer can be brought in; [`Reserve::EveryAccelerator`]
//!   reserves it on every accelerator instead.
//! * Same-device siblings are merged in the result: a module whose every
//!   entry went to one device appears once.
//! * `balanced` / `balanced_low_0` first shrink the accelerator budgets
//!   as Accelerate's `get_balanced_memory` does (its leaves are modules
//!   holding tensors none of whose children hold any), then run the same
//!   policy.
//!
//! Deliberate differences from Accelerate: `disk` is used only when the
//! spec lists it (Accelerate always appends it), so a model that does not
//! fit is an error naming the entry instead of a silent disk offload; an
//! explicit disk budget (`disk=100GB`) is honoured (Accelerate ignores it;
//! here it is a real limit, the free space of the offload folder), and the
//! error then says to raise it or write plain `disk`;
//! buffers of a split module stay in the map (Accelerate drops them from
//! the split); the result is validated before it is returned.
//!
//! # Cost
//! Sizes and subtree ranges are computed once (O(n)); the remaining layers
//! sit in an ordered set, so the whole plan is O(n log n) in the number of
//! tensors (times the tree depth for tied-partner lookups).

use std::collections::HashMap;
use std::fmt;

use accel_api::{DType, Error, ErrorKind, Result};
use serde::Serialize;

use crate::layout::{Layout, NodeId, NodeKind};
use crate::util::{format_bytes, glob_match, parse_size};

/// Where an entry is placed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// An accelerator, named as given (`cuda:0`, `xla:1`, `npu:0`, `mps`).
    Accelerator(String),
    /// Host RAM.
    Cpu,
    /// The disk offload store.
    Disk,
}

impl Target {
    /// Parse `cuda:0`, `0` (= `cuda:0`, as Accelerate's integer keys),
    /// `cpu`, `disk`, `mps`, `xla:N`, `npu:N`, ...
    pub fn parse(s: &str) -> Option<Target> {
        let s = s.trim();
        match s {
            "cpu" => Some(Target::Cpu),
            "disk" => Some(Target::Disk),
            "" => None,
            _ if s.bytes().all(|b| b.is_ascii_digit()) => {
                Some(Target::Accelerator(format!("cuda:{s}")))
            }
            _ => {
                let ok = s
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b':' || b == b'_');
                ok.then(|| Target::Accelerator(s.to_string()))
            }
        }
    }

    /// `true` for accelerators.
    pub fn is_accelerator(&self) -> bool {
        matches!(self, Target::Accelerator(_))
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Accelerator(n) => f.write_str(n),
            Target::Cpu => f.write_str("cpu"),
            Target::Disk => f.write_str("disk"),
        }
    }
}

impl Serialize for Target {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Per-device budgets, in fill order (accelerators, cpu, disk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaxMemory {
    /// (device, budget in bytes; `None` = unbounded, only for disk).
    pub devices: Vec<(Target, Option<u64>)>,
}

impl MaxMemory {
    /// Parse `"cuda:0=40GiB,cuda:1=40GiB,cpu=200GiB,disk"`. Units: GiB, GB,
    /// MiB, MB, KiB, KB, bytes (or none). `disk` may have no size
    /// (unbounded); every other device needs one.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the bad item.
    pub fn parse(spec: &str) -> Result<MaxMemory> {
        let bad = |item: &str, why: &str| {
            Error::invalid_config("--max-memory", item, why)
                .with_fix("write e.g. cuda:0=40GiB,cuda:1=40GiB,cpu=200GiB,disk")
        };
        let mut acc = vec![];
        let mut cpu = None;
        let mut disk = None;
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (dev, size) = match item.split_once('=') {
                Some((d, s)) => (d.trim(), Some(s.trim())),
                None => (item, None),
            };
            let t = Target::parse(dev).ok_or_else(|| bad(item, "unknown device"))?;
            let bytes = match size {
                Some(s) => Some(
                    parse_size(s)
                        .ok_or_else(|| bad(item, "bad size (units: GiB GB MiB MB KiB KB bytes)"))?,
                ),
                None if t == Target::Disk => None,
                None => return Err(bad(item, "needs a size, e.g. =40GiB")),
            };
            let dup = match &t {
                Target::Cpu => cpu.replace(bytes).is_some(),
                Target::Disk => disk.replace(bytes).is_some(),
                Target::Accelerator(_) => {
                    let d = acc.iter().any(|(a, _)| a == &t);
                    acc.push((t.clone(), bytes));
                    d
                }
            };
            if dup {
                return Err(bad(item, "device listed twice"));
            }
        }
        let mut devices = acc;
        if let Some(b) = cpu {
            devices.push((Target::Cpu, b));
        }
        if let Some(b) = disk {
            devices.push((Target::Disk, b));
        }
        if devices.is_empty() {
            return Err(bad(spec, "no device"));
        }
        Ok(MaxMemory { devices })
    }
}

/// How accelerator budgets are derived from [`MaxMemory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Strategy {
    /// Fill devices in order (`device_map="sequential"` / `"auto"`).
    #[default]
    Sequential,
    /// Even share per accelerator (`"balanced"`).
    Balanced,
    /// Even share, keeping the first accelerator as empty as possible
    /// (`"balanced_low_0"`, for generation outputs).
    #[value(name = "balanced-low-0", alias = "balanced_low_0")]
    BalancedLow0,
}

/// Where the largest layer's size is kept free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Reserve {
    /// The first accelerator and cpu (Accelerate's `main_devices`).
    #[default]
    MainDevices,
    /// Every accelerator and cpu.
    EveryAccelerator,
    /// Nowhere (no offload expected).
    None,
}

/// Planner inputs besides the layout.
#[derive(Debug, Clone, Default)]
pub struct PlanOptions {
    /// Budgets.
    pub max_memory: Option<MaxMemory>,
    /// Class names or full-name glob patterns (`*` matches anything) of
    /// modules that must stay on one device.
    pub no_split: Vec<String>,
    /// Cast floating-point tensors to this dtype (only ever narrowing).
    pub dtype: Option<DType>,
    /// Per-tensor dtypes (full names), winning over `dtype`.
    pub special_dtypes: HashMap<String, DType>,
    /// Budget derivation.
    pub strategy: Strategy,
    /// Largest-layer reservation.
    pub reserve: Reserve,
    /// Accelerate's `fallback_allocation`: when the reservation would leave
    /// a device (other than disk) empty, look further along the model for
    /// the first module that fits (splitting modules to find one) and
    /// place it there before moving on.
    pub fallback_allocation: bool,
}

/// One device's line of the plan.
#[derive(Debug, Clone, Serialize)]
pub struct DevicePlan {
    /// The device.
    pub device: Target,
    /// The budget given (`None` = unbounded).
    pub max: Option<u64>,
    /// The budget the planner used (after balancing).
    pub budget: Option<u64>,
    /// Bytes placed.
    pub used: u64,
    /// Bytes kept free for the largest layer.
    pub reserved: u64,
    /// Tensors placed (aliases included).
    pub tensors: usize,
    /// Entries of the merged device map placed here.
    pub entries: usize,
    /// For a device with a budget that the planner passed over while it was
    /// still empty: the bytes the entry that did not fit would have needed
    /// there, reservation included (Accelerate's "minimum assignment
    /// memory").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_needed: Option<u64>,
    /// Why such a device ended empty, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub empty_reason: Option<String>,
}

/// A validated device map.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Per device, in fill order.
    pub devices: Vec<DevicePlan>,
    /// The merged map: module or tensor name → device index, tree order.
    pub map: Vec<(String, usize)>,
    /// The merged map by node id (what `map` names).
    pub(crate) entries: Vec<(NodeId, usize)>,
    /// Per node: device index (`u16::MAX` for modules).
    pub(crate) node_device: Vec<u16>,
    /// Per node: the dtype the tensor is loaded as.
    pub(crate) node_dtype: Vec<Option<DType>>,
}

impl Plan {
    /// The device of tensor `id`.
    pub fn device_of(&self, id: NodeId) -> Option<&Target> {
        let d = *self.node_device.get(id as usize)?;
        (d != u16::MAX).then(|| &self.devices[d as usize].device)
    }

    /// The device index of tensor `id`.
    pub fn device_index(&self, id: NodeId) -> Option<usize> {
        let d = *self.node_device.get(id as usize)?;
        (d != u16::MAX).then_some(d as usize)
    }

    /// The dtype tensor `id` is loaded as (after overrides).
    pub fn dtype_of(&self, id: NodeId) -> Option<DType> {
        self.node_dtype.get(id as usize).copied().flatten()
    }

    /// The merged map, serialising as `{"name": "device", ...}` with its
    /// keys in module (tree) order; the root's entry is `""`, as in
    /// Accelerate.
    pub fn device_map(&self) -> DeviceMap<'_> {
        DeviceMap(self)
    }
}

/// [`Plan::device_map`]: a JSON object whose keys keep module order
/// (`h.2` before `h.10`, embeddings before layers), not sorted order.
#[derive(Debug, Clone, Copy)]
pub struct DeviceMap<'a>(&'a Plan);

impl Serialize for DeviceMap<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.map.len()))?;
        for (n, d) in &self.0.map {
            m.serialize_entry(n, &self.0.devices[*d].device)?;
        }
        m.end()
    }
}

/// Per-node planning facts computed once.
pub(crate) struct Sizes {
    pub size: Vec<u64>,
    pub dtype: Vec<Option<DType>>,
    /// Owned (non-alias) tensors in the subtree.
    pub owned: Vec<u32>,
    pub has_module_child: Vec<bool>,
    /// A child module holding at least one owned tensor (Accelerate's
    /// `get_balanced_memory` sees only such modules).
    pub has_tensor_module_child: Vec<bool>,
    pub no_split: Vec<bool>,
    /// Layer ids in tree order.
    pub layers: Vec<NodeId>,
}

pub(crate) fn compute_sizes(layout: &Layout, opts: &PlanOptions) -> Sizes {
    let nodes = layout.nodes();
    let n = nodes.len();
    let mut size = vec![0u64; n];
    let mut dtype = vec![None; n];
    let mut owned = vec![0u32; n];
    let mut has_module_child = vec![false; n];
    let mut has_tensor_module_child = vec![false; n];
    let mut no_split = vec![false; n];
    // A tied group's bytes are counted on its first member in tree order,
    // as `named_parameters()` (which drops later duplicates) counts them in
    // Accelerate, whichever member the checkpoint stores.
    let mut free = vec![false; n];
    for g in layout.tied() {
        let first = g.iter().copied().min().unwrap_or(0);
        for &m in g {
            free[m as usize] = m != first;
        }
    }
    // Parents and ends copied into compact arrays on the one pass over the
    // nodes, so the later passes do not stream the whole node array again.
    let mut parent = vec![0u32; n];
    let mut end = vec![0u32; n];
    let patterns: Vec<(&str, bool)> = opts
        .no_split
        .iter()
        .map(|p| (p.as_str(), p.contains('*')))
        .collect();
    for (i, node) in nodes.iter().enumerate() {
        parent[i] = node.parent.unwrap_or(0);
        end[i] = node.end;
        if let Some(meta) = &node.meta {
            let own = meta.dtype;
            let d = if let Some(&s) = opts.special_dtypes.get(&node.name) {
                s
            } else if let Some(o) = opts
                .dtype
                .filter(|o| own.is_float() && o.is_float() && o.size() <= own.size())
            {
                o
            } else {
                own
            };
            dtype[i] = Some(d);
            if !free[i] {
                // The layout checked that the tensor's own size fits in 64
                // bits; a per-tensor override may widen it, so saturate.
                size[i] = crate::layout::checked_bytes(meta)
                    .map(|b| b / own.size() as u64)
                    .and_then(|numel| numel.checked_mul(d.size() as u64))
                    .unwrap_or(u64::MAX);
                owned[i] = 1;
            }
        } else if !patterns.is_empty() {
            no_split[i] = patterns.iter().any(|&(p, star)| {
                node.class.as_deref() == Some(p)
                    || (!node.name.is_empty()
                        && if star {
                            glob_match(p, &node.name)
                        } else {
                            node.name == p
                        })
            });
        }
    }
    for i in (1..n).rev() {
        let p = parent[i] as usize;
        size[p] = size[p].saturating_add(size[i]);
        owned[p] += owned[i];
        if dtype[i].is_none() {
            has_module_child[p] = true;
            if owned[i] > 0 {
                has_tensor_module_child[p] = true;
            }
        }
    }
    // Layers: descend from the root's entries through splittable modules.
    let mut layers = vec![];
    let mut i = 0usize;
    while i < n {
        let is_layer = if i == 0 {
            false
        } else if dtype[i].is_none() {
            !has_module_child[i] || no_split[i]
        } else {
            parent[i] == 0
        };
        if is_layer {
            layers.push(i as NodeId);
            i = end[i] as usize;
        } else {
            i += 1;
        }
    }
    Sizes {
        size,
        dtype,
        owned,
        has_module_child,
        has_tensor_module_child,
        no_split,
        layers,
    }
}

/// Accelerate's `get_balanced_memory`: shrink accelerator budgets so the
/// model spreads evenly.
fn balanced_budgets(
    layout: &Layout,
    s: &Sizes,
    devices: &mut [(Target, Option<u64>)],
    opts: &PlanOptions,
) {
    let low_zero_req = opts.strategy == Strategy::BalancedLow0;
    let accs: Vec<usize> = devices
        .iter()
        .enumerate()
        .filter(|(_, (t, b))| t.is_accelerator() && b.unwrap_or(0) > 0)
        .map(|(i, _)| i)
        .collect();
    let num = accs.len();
    if num == 0 {
        return;
    }
    let low_zero = low_zero_req && num > 1;
    let total = s.size[0];
    let mut per = total / (if low_zero { num - 1 } else { num }) as u64;
    // Buffer: largest of the first module of each no-split class/pattern,
    // and the mean size of leaf modules: modules holding tensors none of
    // whose child modules holds any (Accelerate looks only at modules that
    // own tensors, so a tensor-less child such as an activation does not
    // stop its parent from being a leaf).
    let mut first: HashMap<&str, u64> = HashMap::new();
    let mut leaf_sum = 0u128;
    let mut leaf_n = 0u64;
    for (i, node) in layout.nodes().iter().enumerate().skip(1) {
        if node.kind != NodeKind::Module || s.owned[i] == 0 {
            continue;
        }
        if s.no_split[i] {
            for p in &opts.no_split {
                if node.class.as_deref() == Some(p.as_str()) || glob_match(p, &node.name) {
                    first.entry(p.as_str()).or_insert(s.size[i]);
                }
            }
        }
        if !s.has_tensor_module_child[i] {
            leaf_sum += u128::from(s.size[i]);
            leaf_n += 1;
        }
    }
    let buf = first.values().copied().max().unwrap_or(0);
    let mean = (leaf_sum / u128::from(leaf_n.max(1))) as u64;
    per += buf.max(mean) * 5 / 4;
    for (k, &i) in accs.iter().enumerate() {
        if k + 1 == num {
            break;
        }
        let cur = devices[i].1.unwrap_or(0);
        let want = if low_zero && k == 0 { cur } else { per };
        devices[i].1 = Some(want.min(cur));
    }
    if low_zero {
        let rest: u64 = accs[1..].iter().map(|&i| devices[i].1.unwrap_or(0)).sum();
        let min_zero = total.saturating_sub(rest);
        let i0 = accs[0];
        devices[i0].1 = Some(min_zero.min(devices[i0].1.unwrap_or(0)));
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum St {
    Inside,
    Pending,
    Split,
    Placed,
}

/// Plan `layout` under `opts` (see the [module docs](self) for the policy).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when no `max_memory` is given or an entry
/// fits on no device (naming it, its size and the budgets);
/// [`ErrorKind::Internal`] if validation of the result fails (a planner bug,
/// reported instead of returning a wrong map).
pub fn plan(layout: &Layout, opts: &PlanOptions) -> Result<Plan> {
    let mm = opts.max_memory.clone().ok_or_else(|| {
        Error::new(ErrorKind::InvalidConfig, "no max_memory given")
            .with_fix("pass --max-memory cuda:0=40GiB,cpu=100GiB,disk")
    })?;
    let s = compute_sizes(layout, opts);
    let mut budgets = mm.devices.clone();
    if opts.strategy != Strategy::Sequential {
        balanced_budgets(layout, &s, &mut budgets, opts);
    }
    let nodes = layout.nodes();
    let n = nodes.len();
    let ndev = budgets.len();
    let first_acc = budgets.iter().position(|(t, _)| t.is_accelerator());
    let reserve_on: Vec<bool> = budgets
        .iter()
        .enumerate()
        .map(|(i, (t, _))| match opts.reserve {
            Reserve::None => false,
            Reserve::MainDevices => *t == Target::Cpu || Some(i) == first_acc,
            Reserve::EveryAccelerator => *t == Target::Cpu || t.is_accelerator(),
        })
        .collect();

    // Tied tensors in tree order, with their group.
    let mut tied_of: Vec<(NodeId, usize)> = layout
        .tied()
        .iter()
        .enumerate()
        .flat_map(|(g, ids)| ids.iter().map(move |&i| (i, g)))
        .collect();
    tied_of.sort_unstable();

    let mut state = vec![St::Inside; n];
    let mut stack: Vec<NodeId> = vec![];
    state[0] = St::Split;
    for &c in nodes[0].children.iter().rev() {
        state[c as usize] = St::Pending;
        stack.push(c);
    }
    let layers_in = |e: NodeId| -> std::ops::Range<usize> {
        let lo = s.layers.partition_point(|&l| l < e);
        let hi = s.layers.partition_point(|&l| l < nodes[e as usize].end);
        lo..hi
    };
    // The remaining layers: a layer leaves when the entry holding it is
    // taken (and comes back if that entry is put back or split).
    let mut remaining = MaskedMax::new(s.layers.iter().map(|&l| s.size[l as usize]).collect());
    // Accelerate's `max_layer_names`: the layers of the largest size at the
    // last recomputation, each consumed (for good) when an entry holding it
    // is taken; the size is recomputed when none is left.
    let mut tracked: Vec<usize> = vec![];
    let mut consumed: Vec<bool> = vec![];
    let recompute = |remaining: &MaskedMax,
                     tracked: &mut Vec<usize>,
                     consumed: &mut Vec<bool>|
     -> (u64, usize) {
        tracked.clear();
        let max = remaining.max();
        if max > 0 {
            remaining.each_equal(max, &mut |k| tracked.push(k));
        }
        consumed.clear();
        consumed.resize(tracked.len(), false);
        (max, tracked.len())
    };
    let (mut tracked_size, mut tracked_left) = recompute(&remaining, &mut tracked, &mut consumed);

    let mut used = vec![0u64; ndev];
    let mut reserved = vec![0u64; ndev];
    let mut fallback_tried = vec![false; ndev];
    let mut empty: Vec<Option<Passed>> = vec![None; ndev];
    let mut placed: Vec<(NodeId, usize)> = vec![];
    let mut cur = 0usize;

    let enclosing_entry = |state: &[St], t: NodeId| -> Option<NodeId> {
        let mut x = Some(t);
        while let Some(i) = x {
            match state[i as usize] {
                St::Pending => return Some(i),
                St::Placed | St::Split => return None,
                St::Inside => x = nodes[i as usize].parent,
            }
        }
        None
    };

    while let Some(e) = stack.pop() {
        match state[e as usize] {
            St::Placed | St::Inside => continue,
            St::Split => {
                // A tied partner split earlier: its entries take its place.
                for &c in nodes[e as usize].children.iter().rev() {
                    if state[c as usize] != St::Placed {
                        stack.push(c);
                    }
                }
                continue;
            }
            St::Pending => {}
        }
        let es = e as usize;
        let lr = layers_in(e);
        remaining.mask(lr.clone(), 1);
        let t0 = tracked.partition_point(|&k| k < lr.start);
        let t1 = tracked.partition_point(|&k| k < lr.end);
        for c in &mut consumed[t0..t1] {
            if !*c {
                *c = true;
                tracked_left -= 1;
            }
        }
        if tracked_left == 0 {
            (tracked_size, tracked_left) = recompute(&remaining, &mut tracked, &mut consumed);
        }
        let size_e = s.size[es];
        let end = nodes[es].end;
        // Tied partners outside `e`, and the pending entries holding them.
        let mut partners: Vec<NodeId> = vec![];
        let lo = tied_of.partition_point(|&(t, _)| t < e);
        let hi = tied_of.partition_point(|&(t, _)| t < end);
        let mut groups: Vec<usize> = tied_of[lo..hi].iter().map(|&(_, g)| g).collect();
        groups.sort_unstable();
        groups.dedup();
        for g in groups {
            for &m in &layout.tied()[g] {
                if m < e || m >= end {
                    partners.push(m);
                }
            }
        }
        // Accelerate's tied groups are sorted by name, so the modules
        // holding the partners are tried (and split) in that order.
        partners.sort_by(|&a, &b| nodes[a as usize].name.cmp(&nodes[b as usize].name));
        let (with_ties, tied_entries) =
            size_with_ties(&s, size_e, &partners, |p| enclosing_entry(&state, p));
        let Some((_, max)) = budgets.get(cur) else {
            let list: Vec<String> = budgets
                .iter()
                .zip(used.iter().zip(&reserved))
                .map(|((t, b), (u, r))| {
                    let kept = if *r > 0 {
                        format!(" ({} kept free for the largest layer)", format_bytes(*r))
                    } else {
                        String::new()
                    };
                    format!(
                        "{t}: {} of {}{kept}",
                        format_bytes(*u),
                        b.map_or("unbounded".into(), format_bytes)
                    )
                })
                .collect();
            let fix = match budgets.iter().find(|(t, _)| *t == Target::Disk) {
                Some((_, Some(b))) => format!(
                    "raise --max-memory: disk is limited to {} here (write plain `disk` for an unbounded disk), or allow splitting (fewer --no-split)",
                    format_bytes(*b)
                ),
                _ => "raise --max-memory, add `disk`, or allow splitting (fewer --no-split)".into(),
            };
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "`{}` ({}) fits on no device; budgets used: {}",
                    display_name(&nodes[es].name),
                    format_bytes(with_ties),
                    list.join(", ")
                ),
            )
            .with_fix(fix));
        };
        let max = *max;
        let reserve = if reserve_on[cur] { tracked_size } else { 0 };
        let limit = max.map(|m| m.saturating_sub(reserve));
        let fits = |need: u64| !matches!(limit, Some(l) if used[cur] + need > l);
        reserved[cur] = reserve;
        if fits(with_ties) {
            used[cur] += with_ties;
            state[es] = St::Placed;
            placed.push((e, cur));
            for te in tied_entries {
                remaining.mask(layers_in(te), 1);
                state[te as usize] = St::Placed;
                placed.push((te, cur));
            }
            continue;
        }
        let put_back = |state: &mut Vec<St>, stack: &mut Vec<NodeId>, remaining: &mut MaskedMax| {
            state[es] = St::Pending;
            stack.push(e);
            remaining.mask(lr.clone(), -1);
        };
        if !tied_entries.is_empty() && fits(size_e) {
            let splittable = tied_entries
                .iter()
                .copied()
                .find(|&te| s.has_module_child[te as usize] && !s.no_split[te as usize]);
            if let Some(te) = splittable {
                state[te as usize] = St::Split;
                for &c in &nodes[te as usize].children {
                    state[c as usize] = St::Pending;
                }
                put_back(&mut state, &mut stack, &mut remaining);
                (tracked_size, tracked_left) = recompute(&remaining, &mut tracked, &mut consumed);
                continue;
            }
        }
        let too_big = limit.is_some_and(|l| used[cur] + size_e >= l);
        if too_big && s.has_module_child[es] && !s.no_split[es] {
            state[es] = St::Split;
            remaining.mask(lr.clone(), -1);
            for &c in nodes[es].children.iter().rev() {
                state[c as usize] = St::Pending;
                stack.push(c);
            }
            (tracked_size, tracked_left) = recompute(&remaining, &mut tracked, &mut consumed);
            continue;
        }
        if used[cur] == 0 && budgets[cur].0 != Target::Disk {
            if let Some(m) = max {
                if opts.fallback_allocation && !fallback_tried[cur] {
                    fallback_tried[cur] = true;
                    let limit = m.saturating_sub(tracked_size.max(with_ties));
                    if let Some(x) = find_fallback(layout, &s, &state, &stack, &tied_of, limit) {
                        put_back(&mut state, &mut stack, &mut remaining);
                        stack.pop();
                        bring_forward(nodes, &mut state, &mut stack, x);
                        stack.push(e);
                        stack.push(x);
                        state[x as usize] = St::Pending;
                        continue;
                    }
                }
                let largest = remaining
                    .first_max()
                    .map(|k| display_name(&nodes[s.layers[k] as usize].name).to_string());
                empty[cur] = Some(Passed {
                    entry: e,
                    need: with_ties,
                    reserve,
                    largest,
                });
            }
        }
        cur += 1;
        put_back(&mut state, &mut stack, &mut remaining);
    }

    // Per-tensor devices and the merged map.
    let mut node_device = vec![u16::MAX; n];
    for &(e, d) in &placed {
        for (i, nd) in node_device
            .iter_mut()
            .enumerate()
            .take(nodes[e as usize].end as usize)
            .skip(e as usize)
        {
            if s.dtype[i].is_some() {
                *nd = d as u16;
            }
        }
    }
    let entries = merged_map(layout, &placed);
    let map: Vec<(String, usize)> = entries
        .iter()
        .map(|&(i, d)| (nodes[i as usize].name.clone(), d))
        .collect();
    let mut devices: Vec<DevicePlan> = budgets
        .iter()
        .zip(&mm.devices)
        .enumerate()
        .map(|(i, ((t, b), (_, m)))| DevicePlan {
            device: t.clone(),
            max: *m,
            budget: *b,
            used: used[i],
            reserved: reserved[i].min(b.unwrap_or(0)),
            tensors: 0,
            entries: 0,
            min_needed: None,
            empty_reason: None,
        })
        .collect();
    for (d, info) in devices.iter_mut().zip(&empty) {
        let (
            Some(Passed {
                entry: e,
                need,
                reserve,
                largest,
            }),
            Some(budget),
        ) = (info, d.budget)
        else {
            continue;
        };
        if d.used > 0 {
            continue;
        }
        let name = display_name(&nodes[*e as usize].name);
        d.min_needed = Some(need.saturating_add(*reserve));
        d.empty_reason = Some(if *reserve > 0 && *need <= budget {
            format!(
                "empty because {} is kept free for the largest layer{}: the next entry `{name}` ({}) fits in {} only without that reservation; give it at least {}, or pass --fallback-allocation to place a smaller module here",
                format_bytes(*reserve),
                largest.as_ref().map_or(String::new(), |l| format!(" (`{l}`)")),
                format_bytes(*need),
                format_bytes(budget),
                format_bytes(need.saturating_add(*reserve)),
            )
        } else {
            format!(
                "empty: the next entry `{name}` ({}) does not fit in {}{} and cannot be split further",
                format_bytes(*need),
                format_bytes(budget),
                if *reserve > 0 {
                    format!(" minus {} kept free for the largest layer", format_bytes(*reserve))
                } else {
                    String::new()
                },
            )
        });
    }
    for (i, &d) in node_device.iter().enumerate() {
        if d != u16::MAX && s.dtype[i].is_some() {
            devices[d as usize].tensors += 1;
        }
    }
    for (_, d) in &map {
        devices[*d].entries += 1;
    }
    let plan = Plan {
        devices,
        map,
        entries,
        node_device,
        node_dtype: s.dtype.clone(),
    };
    validate(layout, &s, &plan)?;
    Ok(plan)
}

/// The largest of a fixed list of sizes, where ranges of the list can be
/// masked out (and back in) in O(log n): a segment tree whose node holds
/// the maximum of its unmasked range, with range masks kept as counts on
/// the covering nodes (no push-down needed).
#[derive(Debug)]
struct MaskedMax {
    /// Leaves from `base`; `max[1]` is the root.
    base: usize,
    max: Vec<u64>,
    mask: Vec<u32>,
    leaf: Vec<u64>,
}

impl MaskedMax {
    fn new(leaf: Vec<u64>) -> Self {
        let base = leaf.len().next_power_of_two().max(1);
        let mut max = vec![0u64; 2 * base];
        max[base..base + leaf.len()].copy_from_slice(&leaf);
        for i in (1..base).rev() {
            max[i] = max[2 * i].max(max[2 * i + 1]);
        }
        MaskedMax {
            base,
            max,
            mask: vec![0; 2 * base],
            leaf,
        }
    }

    fn pull(&mut self, i: usize) {
        self.max[i] = if self.mask[i] > 0 {
            0
        } else if i >= self.base {
            self.leaf.get(i - self.base).copied().unwrap_or(0)
        } else {
            self.max[2 * i].max(self.max[2 * i + 1])
        };
    }

    /// Add `d` (+1 or -1) to the mask of every element of `r`.
    fn mask(&mut self, r: std::ops::Range<usize>, d: i32) {
        if r.is_empty() {
            return;
        }
        self.update(1, 0, self.base, &r, d);
    }

    fn update(&mut self, i: usize, lo: usize, hi: usize, r: &std::ops::Range<usize>, d: i32) {
        if r.end <= lo || hi <= r.start {
            return;
        }
        if r.start <= lo && hi <= r.end {
            self.mask[i] = self.mask[i].saturating_add_signed(d);
        } else {
            let mid = (lo + hi) / 2;
            self.update(2 * i, lo, mid, r, d);
            self.update(2 * i + 1, mid, hi, r, d);
        }
        self.pull(i);
    }

    /// The largest unmasked value (0 when none).
    fn max(&self) -> u64 {
        self.max[1]
    }

    /// Every unmasked element equal to `v` (> 0), in order.
    fn each_equal(&self, v: u64, f: &mut dyn FnMut(usize)) {
        fn go(t: &MaskedMax, i: usize, v: u64, f: &mut dyn FnMut(usize)) {
            if t.max[i] != v {
                return;
            }
            if i >= t.base {
                f(i - t.base);
            } else {
                go(t, 2 * i, v, f);
                go(t, 2 * i + 1, v, f);
            }
        }
        go(self, 1, v, f);
    }

    /// The first unmasked element of the largest value.
    fn first_max(&self) -> Option<usize> {
        let v = self.max();
        let mut i = 1;
        if v == 0 {
            return None;
        }
        while i < self.base {
            i = if self.max[2 * i] == v {
                2 * i
            } else {
                2 * i + 1
            };
        }
        (self.max[i] == v).then(|| i - self.base)
    }
}

/// A device the planner moved past while it was still empty.
#[derive(Debug, Clone)]
struct Passed {
    /// The entry that did not fit.
    entry: NodeId,
    /// Its size with its tied partners.
    need: u64,
    /// What was kept free for the largest layer.
    reserve: u64,
    /// The largest remaining layer's name.
    largest: Option<String>,
}

/// The size of an entry of `size_e` bytes together with the entries that
/// hold its tied `partners` (found by `unit_of`), and those entries in
/// partner order, each once.
fn size_with_ties(
    s: &Sizes,
    size_e: u64,
    partners: &[NodeId],
    unit_of: impl Fn(NodeId) -> Option<NodeId>,
) -> (u64, Vec<NodeId>) {
    let mut with_ties = size_e;
    let mut units: Vec<NodeId> = vec![];
    for &p in partners {
        if let Some(u) = unit_of(p) {
            with_ties = with_ties.saturating_add(s.size[u as usize] - s.size[p as usize]);
            if !units.contains(&u) {
                units.push(u);
            }
        }
    }
    (with_ties, units)
}

/// Accelerate's `fallback_allocate`: the first module, in the order the
/// planner will treat them (the stack's top first, descending into
/// splittable modules that are too big), whose size with its tied partners
/// is at most `limit`.
fn find_fallback(
    layout: &Layout,
    s: &Sizes,
    state: &[St],
    stack: &[NodeId],
    tied_of: &[(NodeId, usize)],
    limit: u64,
) -> Option<NodeId> {
    let nodes = layout.nodes();
    let mut todo: Vec<NodeId> = vec![];
    for &x in stack {
        match state[x as usize] {
            St::Pending => todo.push(x),
            St::Split => todo.extend(
                nodes[x as usize]
                    .children
                    .iter()
                    .copied()
                    .filter(|&c| state[c as usize] == St::Pending),
            ),
            St::Placed | St::Inside => {}
        }
    }
    // `todo` is a stack too: its last element is treated first.
    let contains = |a: NodeId, x: NodeId| a <= x && x < nodes[a as usize].end;
    while let Some(x) = todo.pop() {
        let end = nodes[x as usize].end;
        let lo = tied_of.partition_point(|&(t, _)| t < x);
        let hi = tied_of.partition_point(|&(t, _)| t < end);
        let mut partners: Vec<NodeId> = vec![];
        for &(_, g) in &tied_of[lo..hi] {
            for &m in &layout.tied()[g] {
                if !contains(x, m) && !partners.contains(&m) {
                    partners.push(m);
                }
            }
        }
        partners.sort_by(|&a, &b| nodes[a as usize].name.cmp(&nodes[b as usize].name));
        // The unit holding a partner: its pending entry, or, inside the
        // entry that holds `x` too, the sibling subtree it would be once
        // that entry is split down to `x`.
        let unit_of = |p: NodeId| -> Option<NodeId> {
            let mut u = p;
            loop {
                match state[u as usize] {
                    St::Placed | St::Split => return None,
                    St::Pending if !contains(u, x) => return Some(u),
                    _ => {}
                }
                let parent = nodes[u as usize].parent?;
                if contains(parent, x) && state[parent as usize] != St::Split {
                    // `parent` is an ancestor of `x` that will be split.
                    return Some(u);
                }
                u = parent;
            }
        };
        let (need, _) = size_with_ties(s, s.size[x as usize], &partners, unit_of);
        if need <= limit {
            return Some(x);
        }
        let n = &nodes[x as usize];
        if n.kind == NodeKind::Module && s.has_module_child[x as usize] && !s.no_split[x as usize] {
            todo.extend(n.children.iter().rev());
        }
    }
    None
}

/// Make `x` (found by [`find_fallback`]) an entry of its own: the pending
/// entry holding it, and every module between them, is split in place on
/// the stack, `x` left out (the caller pushes it on top).
fn bring_forward(
    nodes: &[crate::layout::Node],
    state: &mut [St],
    stack: &mut Vec<NodeId>,
    x: NodeId,
) {
    let contains = |a: NodeId, x: NodeId| a <= x && x < nodes[a as usize].end;
    let Some(pos) = stack
        .iter()
        .rposition(|&y| state[y as usize] != St::Placed && contains(y, x))
    else {
        return;
    };
    let mut top = stack[pos];
    if state[top as usize] == St::Split {
        // A tied partner split earlier: find its pending child holding `x`.
        let Some(&c) = nodes[top as usize]
            .children
            .iter()
            .find(|&&c| state[c as usize] == St::Pending && contains(c, x))
        else {
            return;
        };
        // Expand the split module in place so `c` is an entry of the stack.
        let kids: Vec<NodeId> = nodes[top as usize]
            .children
            .iter()
            .copied()
            .filter(|&k| state[k as usize] != St::Placed)
            .collect();
        stack.splice(pos..=pos, kids.into_iter().rev());
        top = c;
    }
    let Some(pos) = stack.iter().rposition(|&y| y == top) else {
        return;
    };
    fn expand(
        nodes: &[crate::layout::Node],
        state: &mut [St],
        a: NodeId,
        x: NodeId,
        out: &mut Vec<NodeId>,
    ) {
        if a == x {
            return;
        }
        state[a as usize] = St::Split;
        for &c in &nodes[a as usize].children {
            if c == x {
                continue;
            }
            if c < x && x < nodes[c as usize].end {
                expand(nodes, state, c, x, out);
            } else {
                state[c as usize] = St::Pending;
                out.push(c);
            }
        }
    }
    let mut forward = vec![];
    expand(nodes, state, top, x, &mut forward);
    stack.splice(pos..=pos, forward.into_iter().rev());
}

fn display_name(n: &str) -> &str {
    if n.is_empty() {
        "<root>"
    } else {
        n
    }
}

/// Merge placed entries: a module whose entries all share one device (and
/// that holds more than one entry, or is an entry itself) is listed once.
fn merged_map(layout: &Layout, placed: &[(NodeId, usize)]) -> Vec<(NodeId, usize)> {
    let nodes = layout.nodes();
    let mut sorted: Vec<(NodeId, usize)> = placed.to_vec();
    sorted.sort_unstable();
    let mut out = vec![];
    // Recursive descent over the tree, examining the entries in each range.
    fn go(
        nodes: &[crate::layout::Node],
        id: NodeId,
        entries: &[(NodeId, usize)],
        out: &mut Vec<(NodeId, usize)>,
    ) {
        if entries.is_empty() {
            return;
        }
        let d0 = entries[0].1;
        let uniform = entries.iter().all(|&(_, d)| d == d0);
        if uniform && (entries.len() > 1 || entries[0].0 == id) {
            out.push((id, d0));
            return;
        }
        for &c in &nodes[id as usize].children {
            let end = nodes[c as usize].end;
            let lo = entries.partition_point(|&(e, _)| e < c);
            let hi = entries.partition_point(|&(e, _)| e < end);
            go(nodes, c, &entries[lo..hi], out);
        }
    }
    go(nodes, 0, &sorted, &mut out);
    out.sort_unstable();
    out
}

/// Independent check of a plan: every tensor placed exactly once by the
/// merged map, budgets respected, tied groups together.
fn validate(layout: &Layout, s: &Sizes, plan: &Plan) -> Result<()> {
    let nodes = layout.nodes();
    let bug = |msg: String| {
        Error::internal("plan", format!("device map failed validation: {msg}"))
            .with_fix("this is an accel-offload bug; please report it with the layout")
    };
    let mut seen = vec![u16::MAX; nodes.len()];
    if plan.map.len() != plan.entries.len()
        || plan
            .map
            .iter()
            .zip(&plan.entries)
            .any(|((n, d), &(i, e))| *d != e || nodes.get(i as usize).is_none_or(|x| x.name != *n))
    {
        return Err(bug("the named map and the map by id differ".into()));
    }
    for &(id, d) in &plan.entries {
        let d = &d;
        let id = id as usize;
        for (i, slot) in seen
            .iter_mut()
            .enumerate()
            .take(nodes[id].end as usize)
            .skip(id)
        {
            if s.dtype[i].is_some() {
                if *slot != u16::MAX {
                    return Err(bug(format!("tensor `{}` is placed twice", nodes[i].name)));
                }
                *slot = *d as u16;
            }
        }
    }
    let mut used = vec![0u64; plan.devices.len()];
    for i in 0..nodes.len() {
        // `dtype` is set exactly for tensors (read from the nodes once).
        if s.dtype[i].is_none() {
            continue;
        }
        if seen[i] == u16::MAX {
            return Err(bug(format!("tensor `{}` is not placed", nodes[i].name)));
        }
        if seen[i] != plan.node_device[i] {
            return Err(bug(format!(
                "tensor `{}`: merged map and per-tensor placement disagree",
                nodes[i].name
            )));
        }
        used[seen[i] as usize] += s.size[i];
    }
    for (d, u) in plan.devices.iter().zip(&used) {
        if let Some(b) = d.budget {
            if *u > b {
                return Err(bug(format!(
                    "{} holds {} over its budget {}",
                    d.device,
                    format_bytes(*u),
                    format_bytes(b)
                )));
            }
        }
    }
    for g in layout.tied() {
        let d0 = seen[g[0] as usize];
        for &m in &g[1..] {
            if seen[m as usize] != d0 {
                return Err(bug(format!(
                    "tied tensors `{}` and `{}` are on different devices",
                    nodes[g[0] as usize].name, nodes[m as usize].name
                )));
            }
        }
    }
    Ok(())
}

/// The size of the largest layer (a module without child modules, or a
/// no-split module) and its names, as Accelerate's `get_max_layer_size`.
pub fn largest_layer(layout: &Layout, opts: &PlanOptions) -> (u64, Vec<String>) {
    let s = compute_sizes(layout, opts);
    let max = s
        .layers
        .iter()
        .map(|&l| s.size[l as usize])
        .max()
        .unwrap_or(0);
    let names = s
        .layers
        .iter()
        .filter(|&&l| s.size[l as usize] == max)
        .map(|&l| layout.node(l).name.clone())
        .collect();
    (max, names)
}

/// Total bytes of the layout under `opts` (aliases counted once).
pub fn total_size(layout: &Layout, opts: &PlanOptions) -> u64 {
    compute_sizes(layout, opts).size[0]
}

#[cfg(test)]
mod tests;
