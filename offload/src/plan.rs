//! Device-map planning under memory budgets, with Accelerate's
//! `infer_auto_device_map` policy.
//!
//! # Policy (what [`plan`] does)
//! * Sizes: a tensor costs `numel × dtype size`; with a dtype override,
//!   floating-point tensors cost `numel × min(override, own)` and integer
//!   tensors keep their own size; a per-tensor override wins. Tied aliases
//!   cost nothing (the first member of a group owns the storage).
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
//!   splittable partner module is split and the entry tried again.
//! * The size of the largest remaining *layer* (a module with no child
//!   modules, or a no-split module) is kept free on the main devices — the
//!   first accelerator and `cpu`, exactly as Accelerate does — so an
//!   offloaded layer can be brought in; [`Reserve::EveryAccelerator`]
//!   reserves it on every accelerator instead.
//! * Same-device siblings are merged in the result: a module whose every
//!   entry went to one device appears once.
//! * `balanced` / `balanced_low_0` first shrink the accelerator budgets
//!   as Accelerate's `get_balanced_memory` does, then run the same policy.
//!
//! Deliberate differences from Accelerate: `disk` is used only when the
//! spec lists it (Accelerate always appends it), so a model that does not
//! fit is an error naming the entry instead of a silent disk offload;
//! buffers of a split module stay in the map (Accelerate drops them from
//! the split); the result is validated before it is returned.
//!
//! # Cost
//! Sizes and subtree ranges are computed once (O(n)); the remaining layers
//! sit in an ordered set, so the whole plan is O(n log n) in the number of
//! tensors (times the tree depth for tied-partner lookups).

use std::collections::{BTreeSet, HashMap};
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
}

/// A validated device map.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Per device, in fill order.
    pub devices: Vec<DevicePlan>,
    /// The merged map: module or tensor name → device index, tree order.
    pub map: Vec<(String, usize)>,
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

    /// The merged map as JSON: `{"name": "device", ...}` in tree order
    /// (the root's entry is `""`, as in Accelerate).
    pub fn map_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        for (n, d) in &self.map {
            m.insert(
                n.clone(),
                serde_json::Value::String(self.devices[*d].device.to_string()),
            );
        }
        serde_json::Value::Object(m)
    }
}

/// Per-node planning facts computed once.
pub(crate) struct Sizes {
    pub size: Vec<u64>,
    pub dtype: Vec<Option<DType>>,
    /// Owned (non-alias) tensors in the subtree.
    pub owned: Vec<u32>,
    pub has_module_child: Vec<bool>,
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
    let mut no_split = vec![false; n];
    for (i, node) in nodes.iter().enumerate() {
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
            if node.alias_of.is_none() {
                size[i] = (meta.numel() * d.size()) as u64;
                owned[i] = 1;
            }
        } else if !opts.no_split.is_empty() {
            no_split[i] = opts.no_split.iter().any(|p| {
                node.class.as_deref() == Some(p.as_str())
                    || (!node.name.is_empty() && glob_match(p, &node.name))
            });
        }
    }
    for i in (1..n).rev() {
        let p = nodes[i].parent.expect("non-root has a parent") as usize;
        size[p] += size[i];
        owned[p] += owned[i];
        if nodes[i].kind == NodeKind::Module {
            has_module_child[p] = true;
        }
    }
    // Layers: descend from the root's entries through splittable modules.
    let mut layers = vec![];
    let mut i = 0usize;
    while i < n {
        let node = &nodes[i];
        let is_layer = if i == 0 {
            false
        } else if node.kind == NodeKind::Module {
            !has_module_child[i] || no_split[i]
        } else {
            node.parent == Some(0)
        };
        if is_layer {
            layers.push(i as NodeId);
            i = node.end as usize;
        } else {
            i += 1;
        }
    }
    Sizes {
        size,
        dtype,
        owned,
        has_module_child,
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
    // and the mean size of leaf modules (modules holding tensors but no
    // child module).
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
        if !s.has_module_child[i] {
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
/// [`ErrorKind::Backend`] if validation of the result fails (a planner bug,
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
    let mut remaining: BTreeSet<(u64, NodeId)> =
        s.layers.iter().map(|&l| (s.size[l as usize], l)).collect();
    let mut stamp = vec![0u32; s.layers.len()];
    let mut gen = 0u32;
    let layer_pos = |l: NodeId| s.layers.binary_search(&l).expect("layer");
    let recompute = |remaining: &BTreeSet<(u64, NodeId)>,
                     stamp: &mut Vec<u32>,
                     gen: &mut u32|
     -> (u64, usize) {
        *gen += 1;
        let Some(&(max, _)) = remaining.last() else {
            return (0, 0);
        };
        let mut cnt = 0;
        for &(_, l) in remaining.range((max, 0)..) {
            stamp[layer_pos(l)] = *gen;
            cnt += 1;
        }
        (max, cnt)
    };
    let (mut tracked_size, mut tracked_left) = recompute(&remaining, &mut stamp, &mut gen);

    let mut used = vec![0u64; ndev];
    let mut reserved = vec![0u64; ndev];
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
        for k in lr.clone() {
            let l = s.layers[k];
            remaining.remove(&(s.size[l as usize], l));
            if stamp[k] == gen {
                stamp[k] = 0;
                tracked_left -= 1;
            }
        }
        if tracked_left == 0 {
            (tracked_size, tracked_left) = recompute(&remaining, &mut stamp, &mut gen);
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
        let mut with_ties = size_e;
        let mut tied_entries: Vec<NodeId> = vec![];
        for &p in &partners {
            if let Some(te) = enclosing_entry(&state, p) {
                with_ties += s.size[te as usize] - s.size[p as usize];
                if !tied_entries.contains(&te) {
                    tied_entries.push(te);
                }
            }
        }
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
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "`{}` ({}) fits on no device; budgets used: {}",
                    display_name(&nodes[es].name),
                    format_bytes(with_ties),
                    list.join(", ")
                ),
            )
            .with_fix("raise --max-memory, add `disk`, or allow splitting (fewer --no-split)"));
        };
        let reserve = if reserve_on[cur] { tracked_size } else { 0 };
        let limit = max.map(|m| m.saturating_sub(reserve));
        let fits = |need: u64| !matches!(limit, Some(l) if used[cur] + need > l);
        reserved[cur] = reserve;
        if fits(with_ties) {
            used[cur] += with_ties;
            state[es] = St::Placed;
            placed.push((e, cur));
            for te in tied_entries {
                for k in layers_in(te) {
                    let l = s.layers[k];
                    remaining.remove(&(s.size[l as usize], l));
                }
                state[te as usize] = St::Placed;
                placed.push((te, cur));
            }
            continue;
        }
        let put_back = |state: &mut Vec<St>,
                        stack: &mut Vec<NodeId>,
                        remaining: &mut BTreeSet<(u64, NodeId)>| {
            state[es] = St::Pending;
            stack.push(e);
            for k in lr.clone() {
                let l = s.layers[k];
                remaining.insert((s.size[l as usize], l));
            }
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
                (tracked_size, tracked_left) = recompute(&remaining, &mut stamp, &mut gen);
                continue;
            }
        }
        let too_big = limit.is_some_and(|l| used[cur] + size_e >= l);
        if too_big && s.has_module_child[es] && !s.no_split[es] {
            state[es] = St::Split;
            for k in lr.clone() {
                let l = s.layers[k];
                remaining.insert((s.size[l as usize], l));
            }
            for &c in nodes[es].children.iter().rev() {
                state[c as usize] = St::Pending;
                stack.push(c);
            }
            (tracked_size, tracked_left) = recompute(&remaining, &mut stamp, &mut gen);
            continue;
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
            if nodes[i].is_tensor() {
                *nd = d as u16;
            }
        }
    }
    let map = merged_map(layout, &placed);
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
        })
        .collect();
    for (i, &d) in node_device.iter().enumerate() {
        if d != u16::MAX && nodes[i].is_tensor() {
            devices[d as usize].tensors += 1;
        }
    }
    for (_, d) in &map {
        devices[*d].entries += 1;
    }
    let plan = Plan {
        devices,
        map,
        node_device,
        node_dtype: s.dtype.clone(),
    };
    validate(layout, &s, &plan)?;
    Ok(plan)
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
fn merged_map(layout: &Layout, placed: &[(NodeId, usize)]) -> Vec<(String, usize)> {
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
    out.into_iter()
        .map(|(i, d)| (nodes[i as usize].name.clone(), d))
        .collect()
}

/// Independent check of a plan: every tensor placed exactly once by the
/// merged map, budgets respected, tied groups together.
fn validate(layout: &Layout, s: &Sizes, plan: &Plan) -> Result<()> {
    let nodes = layout.nodes();
    let bug = |msg: String| {
        Error::new(
            ErrorKind::Backend,
            format!("device map failed validation: {msg}"),
        )
        .with_op("plan")
        .with_fix("this is an accel-offload bug; please report it with the layout")
    };
    let mut seen = vec![u16::MAX; nodes.len()];
    for (name, d) in &plan.map {
        let id = layout
            .id(name)
            .ok_or_else(|| bug(format!("map entry `{name}` is not in the layout")))?
            as usize;
        for (i, slot) in seen
            .iter_mut()
            .enumerate()
            .take(nodes[id].end as usize)
            .skip(id)
        {
            if nodes[i].is_tensor() {
                if *slot != u16::MAX {
                    return Err(bug(format!("tensor `{}` is placed twice", nodes[i].name)));
                }
                *slot = *d as u16;
            }
        }
    }
    let mut used = vec![0u64; plan.devices.len()];
    for (i, node) in nodes.iter().enumerate() {
        if !node.is_tensor() {
            continue;
        }
        if seen[i] == u16::MAX {
            return Err(bug(format!("tensor `{}` is not placed", node.name)));
        }
        if seen[i] != plan.node_device[i] {
            return Err(bug(format!(
                "tensor `{}`: merged map and per-tensor placement disagree",
                node.name
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
