//! Budgets: the devices and their limits in fill order (balanced
//! strategies shrink the accelerators'), and where the largest layer is
//! kept free.

use std::collections::HashMap;

use accel_api::{Error, ErrorKind, Result};

use super::sizes::Sizes;
use super::types::{MaxMemory, PlanOptions, Reserve, Strategy, Target};
use crate::layout::{Layout, NodeKind};
use crate::util::glob_match;

/// The devices to fill, in order, with their budgets (`None`:
/// unbounded, as disk always is), and whether each keeps the largest
/// layer's size free.
#[derive(Debug)]
pub(super) struct Budgets {
    /// What the caller gave.
    pub max_memory: MaxMemory,
    /// The budgets in force (balanced strategies lower the accelerators').
    pub devices: Vec<(Target, Option<u64>)>,
    /// Per device: the largest remaining layer's size is kept free there.
    pub reserve_on: Vec<bool>,
}

/// The `max_memory` of `opts`.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when there is none.
pub(super) fn max_memory(opts: &PlanOptions) -> Result<MaxMemory> {
    opts.max_memory
        .clone()
        .map(MaxMemory::in_fill_order)
        .ok_or_else(|| {
            Error::new(ErrorKind::InvalidConfig, "no max_memory given")
                .with_fix("pass --max-memory cuda:0=40GiB,cpu=100GiB,disk")
        })
}

/// The budgets of a plan of `layout` under `opts` within `max_memory`.
pub(super) fn budgets(
    layout: &Layout,
    s: &Sizes,
    max_memory: MaxMemory,
    opts: &PlanOptions,
) -> Budgets {
    // Disk takes whatever is left, whatever its budget says (Accelerate
    // ignores a disk budget too).
    let mut budgets: Vec<(Target, Option<u64>)> = max_memory
        .devices
        .iter()
        .map(|(t, b)| (t.clone(), if *t == Target::Disk { None } else { *b }))
        .collect();
    if opts.strategy != Strategy::Sequential {
        balanced_budgets(layout, s, &mut budgets, opts);
    }
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
    Budgets {
        max_memory,
        devices: budgets,
        reserve_on,
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
    for (i, node) in layout.nodes().enumerate().skip(1) {
        if node.kind() != NodeKind::Module || !s.owned[i] {
            continue;
        }
        if s.no_split[i] {
            for p in &opts.no_split {
                if node.class() == Some(p.as_str()) || glob_match(p, node.name()) {
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
