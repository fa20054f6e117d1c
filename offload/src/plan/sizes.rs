//! Per-node sizes, dtypes and layer facts, computed once per plan.

use accel_api::DType;

use super::types::PlanOptions;
use crate::layout::{Layout, NodeId};
use crate::util::glob_match;

/// Per-node planning facts computed once.
pub(crate) struct Sizes {
    pub size: Vec<u64>,
    pub dtype: Vec<Option<DType>>,
    /// The subtree holds an owned (non-alias) tensor (for a tensor: it is
    /// one).
    pub owned: Vec<bool>,
    pub has_module_child: Vec<bool>,
    /// A child module holding at least one owned tensor (Accelerate's
    /// `get_balanced_memory` sees only such modules).
    pub has_tensor_module_child: Vec<bool>,
    pub no_split: Vec<bool>,
    /// Layer ids in tree order.
    pub layers: Vec<NodeId>,
}

/// The [`Sizes`] of `layout` under `opts` (dtype overrides, no-split
/// modules).
pub(crate) fn compute_sizes(layout: &Layout, opts: &PlanOptions) -> Sizes {
    let n = layout.len();
    let mut size = vec![0u64; n];
    let mut dtype = vec![None; n];
    let mut owned = vec![false; n];
    let mut has_module_child = vec![false; n];
    let mut has_tensor_module_child = vec![false; n];
    let mut no_split = vec![false; n];
    // A tied group's bytes are counted on its first member in tree order,
    // as `named_parameters()` (which drops later duplicates) counts them in
    // Accelerate, whichever member the checkpoint stores.
    let mut free = vec![false; if layout.tied().is_empty() { 0 } else { n }];
    for g in layout.tied() {
        let first = g.iter().copied().min().unwrap_or(0);
        for &m in g {
            free[m as usize] = m != first;
        }
    }
    // The layout's own parent and end arrays: the later passes read them
    // without streaming the whole node records again.
    let (parent, end) = (layout.parents(), layout.ends());
    let patterns: Vec<(&str, bool)> = opts
        .no_split
        .iter()
        .map(|p| (p.as_str(), p.contains('*')))
        .collect();
    // Classes named by a pattern, by class index.
    let class_hit: Vec<bool> = layout
        .class_names()
        .iter()
        .map(|c| patterns.iter().any(|&(p, _)| p == &**c))
        .collect();
    let specials = !opts.special_dtypes.is_empty();
    let widen = |own: DType| match opts.dtype {
        Some(o) if own.is_float() && o.is_float() && o.size() <= own.size() => o,
        _ => own,
    };
    for i in 0..n {
        if let Some((own, bytes)) = layout.tensor_at(i) {
            let special = if specials {
                let name = layout.node(i as NodeId).name();
                opts.special_dtypes.get(name).copied()
            } else {
                None
            };
            let d = special.unwrap_or_else(|| widen(own));
            dtype[i] = Some(d);
            if !free.get(i).copied().unwrap_or(false) {
                // The layout checked that the tensor's own size fits in 64
                // bits; a per-tensor override may widen it, so saturate.
                size[i] = if d == own {
                    bytes
                } else {
                    (bytes / own.size() as u64).saturating_mul(d.size() as u64)
                };
                owned[i] = true;
            }
        } else if !patterns.is_empty() {
            let class_named = layout.class_at(i).is_some_and(|c| class_hit[c as usize]);
            // A plain pattern is a full name: compare only names of its
            // length.
            let len = layout.name_len_at(i);
            no_split[i] = class_named
                || (len > 0
                    && patterns.iter().any(|&(p, star)| {
                        if star {
                            glob_match(p, layout.node(i as NodeId).name())
                        } else {
                            p.len() == len && layout.node(i as NodeId).name() == p
                        }
                    }));
        }
    }
    for i in (1..n).rev() {
        let p = parent[i] as usize;
        size[p] = size[p].saturating_add(size[i]);
        owned[p] |= owned[i];
        if dtype[i].is_none() {
            has_module_child[p] = true;
            if owned[i] {
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
