//! The planner's inputs and result: devices, budgets, options, the plan
//! and its device map.

use std::collections::HashMap;
use std::fmt;

use accel_api::{DType, Error, Result};
use serde::Serialize;

use crate::layout::NodeId;
use crate::util::parse_size;

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
    /// (device, budget in bytes; `None` = unbounded, only for disk). The
    /// planner fills them in [`in_fill_order`](Self::in_fill_order); a
    /// disk budget is recorded but does not limit placement (as in
    /// Accelerate).
    pub devices: Vec<(Target, Option<u64>)>,
}

impl MaxMemory {
    /// Parse `"cuda:0=40GiB,cuda:1=40GiB,cpu=200GiB,disk"`. Units: GiB, GB,
    /// MiB, MB, KiB, KB, bytes (or none). `disk` may have no size
    /// (unbounded); every other device needs one.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig) naming the bad item.
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
        Ok(MaxMemory { devices }.in_fill_order())
    }

    /// The devices in the order Accelerate's `get_max_memory` fills them,
    /// whatever order the keys were given in: accelerators by kind, then
    /// by number (`cuda:0` before `cuda:1` before `cuda:10`), then `cpu`,
    /// then `disk`. The first accelerator of this order is the main one
    /// that keeps the largest layer's size free.
    pub fn in_fill_order(mut self) -> MaxMemory {
        fn rank(t: &Target) -> (u8, &str, u64) {
            match t {
                Target::Accelerator(n) => {
                    let (kind, index) = n.rsplit_once(':').unwrap_or((n, ""));
                    (0, kind, index.parse().unwrap_or(0))
                }
                Target::Cpu => (1, "", 0),
                Target::Disk => (2, "", 0),
            }
        }
        self.devices.sort_by(|a, b| rank(&a.0).cmp(&rank(&b.0)));
        self
    }
}

/// How accelerator budgets are derived from [`MaxMemory`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// Fill devices in order (`device_map="sequential"` / `"auto"`).
    #[default]
    Sequential,
    /// Even share per accelerator (`"balanced"`).
    Balanced,
    /// Even share, keeping the first accelerator as empty as possible
    /// (`"balanced_low_0"`, for generation outputs).
    BalancedLow0,
}

/// Where the largest layer's size is kept free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
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
pub struct DeviceMap<'a>(pub(super) &'a Plan);

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
