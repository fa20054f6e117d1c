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
//!   (parameters, child modules, buffers). Devices are filled in
//!   Accelerate's order, whatever order the keys were given in:
//!   accelerators by number (`cuda:0`, `cuda:1`, ...), then `cpu`, then
//!   `disk`, which is unbounded even when given a budget (Accelerate
//!   ignores a disk budget; the plan keeps it as the device's `max`).
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
//!   `fallback_allocation`: again while the device stays empty (the module
//!   found may hold no tensors, as an `act_fn`), and never when that budget
//!   is below the reservation. A device passed over while empty reports the
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
//! fit is an error naming the entry instead of a silent disk offload;
//! buffers of a split module stay in the map (Accelerate drops them from
//! the split); the result is validated before it is returned.
//!
//! # Cost
//! Sizes and subtree ranges are computed once (O(n)); the remaining layers
//! sit in an ordered set, so the whole plan is O(n log n) in the number of
//! tensors (times the tree depth for tied-partner lookups).

mod assemble;
mod budget;
mod place;
mod sizes;
mod types;
mod validate;

use accel_api::Result;

use crate::layout::Layout;

pub(crate) use sizes::compute_sizes;
pub use types::{DeviceMap, DevicePlan, MaxMemory, Plan, PlanOptions, Reserve, Strategy, Target};

/// Plan `layout` under `opts` (see the [module docs](self) for the policy).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig) when no `max_memory` is given or an entry
/// fits on no device (naming it, its size and the budgets);
/// [`ErrorKind::Internal`](accel_api::ErrorKind::Internal) if validation of the result fails (a planner bug,
/// reported instead of returning a wrong map).
pub fn plan(layout: &Layout, opts: &PlanOptions) -> Result<Plan> {
    let max_memory = budget::max_memory(opts)?;
    let s = compute_sizes(layout, opts);
    let budgets = budget::budgets(layout, &s, max_memory, opts);
    let placement = place::place(layout, &s, &budgets.devices, &budgets.reserve_on, opts)?;
    let plan = assemble::assemble(layout, &s, &budgets, placement);
    validate::validate(layout, &s, &plan)?;
    Ok(plan)
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
        .map(|&l| layout.node(l).name().to_string())
        .collect();
    (max, names)
}

/// Total bytes of the layout under `opts` (aliases counted once).
pub fn total_size(layout: &Layout, opts: &PlanOptions) -> u64 {
    compute_sizes(layout, opts).size[0]
}

#[cfg(test)]
mod tests;
