//! An independent check of a finished plan.

use accel_api::{Error, Result};

use super::sizes::Sizes;
use super::types::Plan;
use crate::layout::{Layout, NodeId};
use crate::util::format_bytes;

/// Independent check of a plan: every tensor placed exactly once by the
/// merged map, budgets respected, tied groups together.
pub(super) fn validate(layout: &Layout, s: &Sizes, plan: &Plan) -> Result<()> {
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
