//! An independent check of a finished plan.

use accel_api::{Error, Result};

use super::sizes::Sizes;
use super::types::Plan;
use crate::layout::{Layout, NodeId};
use crate::util::format_bytes;

/// Independent check of a plan: every tensor placed exactly once by the
/// merged map, budgets respected, tied groups together.
pub(super) fn validate(layout: &Layout, s: &Sizes, plan: &Plan) -> Result<()> {
    if quick_check(layout, s, plan) {
        return Ok(());
    }
    // Something is off: the full check finds it and words the error.
    full_check(layout, s, plan)
}

/// `true` when the plan passes every check of [`full_check`], in one pass
/// over the nodes: the entries, in id order, are disjoint subtrees; every
/// tensor lies in one, with its entry's device in the per-tensor
/// placement; no budget is exceeded; tied groups share a device.
fn quick_check(layout: &Layout, s: &Sizes, plan: &Plan) -> bool {
    let n = layout.len();
    let ends = layout.ends();
    if plan.map.len() != plan.entries.len()
        || plan
            .map
            .iter()
            .zip(&plan.entries)
            .any(|((name, d), &(i, e))| *d != e || i as usize >= n || layout.node(i).name() != name)
        || plan.node_device.len() != n
    {
        return false;
    }
    let mut used = vec![0u64; plan.devices.len()];
    let mut at = 0usize;
    for &(id, d) in &plan.entries {
        let (id, end) = (id as usize, ends[id as usize] as usize);
        // Between entries: no tensor.
        if id < at || s.dtype[at..id].iter().any(Option::is_some) {
            return false;
        }
        let Ok(dev) = u16::try_from(d) else {
            return false;
        };
        let Some(u) = used.get_mut(d) else {
            return false;
        };
        for i in id..end {
            if s.dtype[i].is_some() {
                if plan.node_device[i] != dev {
                    return false;
                }
                *u = u.saturating_add(s.size[i]);
            }
        }
        at = end;
    }
    if s.dtype[at..].iter().any(Option::is_some) {
        return false;
    }
    let within = plan
        .devices
        .iter()
        .zip(&used)
        .all(|(d, &u)| d.budget.is_none_or(|b| u <= b));
    within
        && layout.tied().iter().all(|g| {
            let d0 = plan.node_device[g[0] as usize];
            g[1..].iter().all(|&m| plan.node_device[m as usize] == d0)
        })
}

/// Every check, naming what fails.
fn full_check(layout: &Layout, s: &Sizes, plan: &Plan) -> Result<()> {
    let bug = |msg: String| {
        Error::internal("plan", format!("device map failed validation: {msg}"))
            .with_fix("this is an accel-offload bug; please report it with the layout")
    };
    let mut seen = vec![u16::MAX; layout.len()];
    if plan.map.len() != plan.entries.len()
        || plan.map.iter().zip(&plan.entries).any(|((n, d), &(i, e))| {
            *d != e || i as usize >= layout.len() || layout.node(i).name() != n
        })
    {
        return Err(bug("the named map and the map by id differ".into()));
    }
    for &(id, d) in &plan.entries {
        let d = &d;
        let id = id as usize;
        for (i, slot) in seen
            .iter_mut()
            .enumerate()
            .take(layout.node(id as NodeId).end() as usize)
            .skip(id)
        {
            if s.dtype[i].is_some() {
                if *slot != u16::MAX {
                    return Err(bug(format!(
                        "tensor `{}` is placed twice",
                        layout.node(i as NodeId).name()
                    )));
                }
                *slot = *d as u16;
            }
        }
    }
    let mut used = vec![0u64; plan.devices.len()];
    for i in 0..layout.len() {
        // `dtype` is set exactly for tensors (read from the nodes once).
        if s.dtype[i].is_none() {
            continue;
        }
        if seen[i] == u16::MAX {
            return Err(bug(format!(
                "tensor `{}` is not placed",
                layout.node(i as NodeId).name()
            )));
        }
        if seen[i] != plan.node_device[i] {
            return Err(bug(format!(
                "tensor `{}`: merged map and per-tensor placement disagree",
                layout.node(i as NodeId).name()
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
                    layout.node(g[0]).name(),
                    layout.node(m).name()
                )));
            }
        }
    }
    Ok(())
}
