//! From a placement to the [`Plan`]: per-tensor devices, the merged map,
//! each device's line and why an empty device is empty.

use super::budget::Budgets;
use super::place::{display_name, Passed, Placement};
use super::sizes::Sizes;
use super::types::{DevicePlan, Plan};
use crate::layout::{Layout, NodeId};
use crate::util::format_bytes;

/// The plan of `placement` (not yet validated).
pub(super) fn assemble(
    layout: &Layout,
    s: &Sizes,
    budgets: &Budgets,
    placement: Placement,
) -> Plan {
    let Placement {
        placed,
        used,
        reserved,
        empty,
    } = placement;
    let n = layout.len();
    // Per-tensor devices and the merged map.
    let mut node_device = vec![u16::MAX; n];
    for &(e, d) in &placed {
        for (i, nd) in node_device
            .iter_mut()
            .enumerate()
            .take(layout.node(e).end() as usize)
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
        .map(|&(i, d)| (layout.node(i).name().to_string(), d))
        .collect();
    let mut devices: Vec<DevicePlan> = budgets
        .devices
        .iter()
        .zip(&budgets.max_memory.devices)
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
        let name = display_name(layout.node(*e).name());
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
    Plan {
        devices,
        map,
        entries,
        node_device,
        node_dtype: s.dtype.clone(),
    }
}

/// Merge placed entries: a module whose entries all share one device (and
/// that holds more than one entry, or is an entry itself) is listed once.
fn merged_map(layout: &Layout, placed: &[(NodeId, usize)]) -> Vec<(NodeId, usize)> {
    let mut sorted: Vec<(NodeId, usize)> = placed.to_vec();
    sorted.sort_unstable();
    let mut out = vec![];
    // Recursive descent over the tree, examining the entries in each range.
    fn go(
        layout: &Layout,
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
        for c in layout.node(id).children() {
            let end = layout.node(c).end();
            let lo = entries.partition_point(|&(e, _)| e < c);
            let hi = entries.partition_point(|&(e, _)| e < end);
            go(layout, c, &entries[lo..hi], out);
        }
    }
    go(layout, 0, &sorted, &mut out);
    out.sort_unstable();
    out
}
