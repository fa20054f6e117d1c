//! Placement: entries in tree order onto devices in fill order, splitting
//! what does not fit, with tied groups kept together and the largest
//! remaining layer's size kept free (Accelerate's `infer_auto_device_map`).

use std::ops::Range;

use accel_api::{Error, ErrorKind, Result};

use super::sizes::Sizes;
use super::types::{PlanOptions, Target};
use crate::layout::{Layout, NodeId, NodeKind};
use crate::util::format_bytes;

/// Where the entries went, and what each device holds.
#[derive(Debug)]
pub(super) struct Placement {
    /// `(entry, device index)` in placement order.
    pub placed: Vec<(NodeId, usize)>,
    /// Bytes placed per device.
    pub used: Vec<u64>,
    /// Bytes kept free for the largest layer per device, when last filled.
    pub reserved: Vec<u64>,
    /// Per device: why the planner moved past it while it was empty.
    pub empty: Vec<Option<Passed>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum St {
    Inside,
    Pending,
    Split,
    Placed,
}

/// Place the entries of `layout` on `budgets` (see the module docs of
/// [`plan`](super::plan)).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when an entry fits on no device (naming it,
/// its size and the budgets).
pub(super) fn place(
    layout: &Layout,
    s: &Sizes,
    budgets: &[(Target, Option<u64>)],
    reserve_on: &[bool],
    opts: &PlanOptions,
) -> Result<Placement> {
    let n = layout.len();
    let ndev = budgets.len();
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
    push_rev(&mut stack, layout.node(0).children());
    for &c in &stack {
        state[c as usize] = St::Pending;
    }
    let layers_in = |e: NodeId| -> Range<usize> {
        let lo = s.layers.partition_point(|&l| l < e);
        let hi = s.layers.partition_point(|&l| l < layout.node(e).end());
        lo..hi
    };
    let mut largest = LargestLayer::new(s);

    let mut used = vec![0u64; ndev];
    let mut reserved = vec![0u64; ndev];
    let mut empty: Vec<Option<Passed>> = vec![None; ndev];
    let mut placed: Vec<(NodeId, usize)> = vec![];
    let mut cur = 0usize;

    let enclosing_entry = |state: &[St], t: NodeId| -> Option<NodeId> {
        let mut x = Some(t);
        while let Some(i) = x {
            match state[i as usize] {
                St::Pending => return Some(i),
                St::Placed | St::Split => return None,
                St::Inside => x = layout.node(i).parent(),
            }
        }
        None
    };

    while let Some(e) = stack.pop() {
        match state[e as usize] {
            St::Placed | St::Inside => continue,
            St::Split => {
                // A tied partner split earlier: its entries take its place.
                push_rev(
                    &mut stack,
                    layout
                        .node(e)
                        .children()
                        .filter(|&c| state[c as usize] != St::Placed),
                );
                continue;
            }
            St::Pending => {}
        }
        let es = e as usize;
        let lr = layers_in(e);
        largest.take(lr.clone());
        let size_e = s.size[es];
        let partners = tied_partners(layout, &tied_of, e);
        let (with_ties, tied_entries) =
            size_with_ties(s, size_e, &partners, |p| enclosing_entry(&state, p));
        let Some((_, max)) = budgets.get(cur) else {
            let name = display_name(layout.node(e).name());
            return Err(no_fit_error(budgets, &used, &reserved, name, with_ties));
        };
        let max = *max;
        let reserve = if reserve_on[cur] { largest.size } else { 0 };
        let limit = max.map(|m| m.saturating_sub(reserve));
        let fits = |need: u64| !matches!(limit, Some(l) if used[cur] + need > l);
        reserved[cur] = reserve;
        if fits(with_ties) {
            used[cur] += with_ties;
            state[es] = St::Placed;
            placed.push((e, cur));
            for te in tied_entries {
                largest.remaining.mask(layers_in(te), 1);
                state[te as usize] = St::Placed;
                placed.push((te, cur));
            }
            continue;
        }
        let put_back =
            |state: &mut Vec<St>, stack: &mut Vec<NodeId>, largest: &mut LargestLayer| {
                state[es] = St::Pending;
                stack.push(e);
                largest.remaining.mask(lr.clone(), -1);
            };
        if !tied_entries.is_empty() && fits(size_e) {
            let splittable = tied_entries
                .iter()
                .copied()
                .find(|&te| s.has_module_child[te as usize] && !s.no_split[te as usize]);
            if let Some(te) = splittable {
                state[te as usize] = St::Split;
                for c in layout.node(te).children() {
                    state[c as usize] = St::Pending;
                }
                put_back(&mut state, &mut stack, &mut largest);
                largest.recompute();
                continue;
            }
        }
        let too_big = limit.is_some_and(|l| used[cur] + size_e >= l);
        if too_big && s.has_module_child[es] && !s.no_split[es] {
            state[es] = St::Split;
            largest.remaining.mask(lr.clone(), -1);
            let first = stack.len();
            push_rev(&mut stack, layout.node(e).children());
            for &c in &stack[first..] {
                state[c as usize] = St::Pending;
            }
            largest.recompute();
            continue;
        }
        if used[cur] == 0 && budgets[cur].0 != Target::Disk {
            if let Some(m) = max {
                // As Accelerate: again while the device stays empty (a
                // module without tensors leaves it so), and nothing when
                // the budget is below the reservation.
                let limit = m.checked_sub(largest.size.max(with_ties));
                if let Some(limit) = limit.filter(|_| opts.fallback_allocation) {
                    if let Some(x) = find_fallback(layout, s, &state, &stack, &tied_of, limit) {
                        put_back(&mut state, &mut stack, &mut largest);
                        stack.pop();
                        bring_forward(layout, &mut state, &mut stack, x);
                        stack.push(e);
                        stack.push(x);
                        state[x as usize] = St::Pending;
                        continue;
                    }
                }
                let first = largest.remaining.first_max();
                empty[cur] = Some(Passed {
                    entry: e,
                    need: with_ties,
                    reserve,
                    largest: first.map(|k| display_name(layout.node(s.layers[k]).name()).into()),
                });
            }
        }
        cur += 1;
        put_back(&mut state, &mut stack, &mut largest);
    }
    Ok(Placement {
        placed,
        used,
        reserved,
        empty,
    })
}

/// The largest remaining layer, tracked as Accelerate does. A layer leaves
/// `remaining` when the entry holding it is taken, and comes back if that
/// entry is put back or split. Accelerate's `max_layer_names`: the layers
/// of the largest size at the last recomputation (`tracked`), each consumed
/// for good when an entry holding it is taken; `size` is recomputed when
/// none is left.
struct LargestLayer {
    remaining: MaskedMax,
    tracked: Vec<usize>,
    consumed: Vec<bool>,
    /// The size the reservations keep free.
    size: u64,
    /// Tracked layers not consumed yet.
    left: usize,
}

impl LargestLayer {
    fn new(s: &Sizes) -> LargestLayer {
        let mut l = LargestLayer {
            remaining: MaskedMax::new(s.layers.iter().map(|&l| s.size[l as usize]).collect()),
            tracked: vec![],
            consumed: vec![],
            size: 0,
            left: 0,
        };
        l.recompute();
        l
    }

    /// Track the layers of the largest remaining size anew.
    fn recompute(&mut self) {
        self.tracked.clear();
        let max = self.remaining.max();
        if max > 0 {
            let tracked = &mut self.tracked;
            self.remaining.each_equal(max, &mut |k| tracked.push(k));
        }
        self.consumed.clear();
        self.consumed.resize(self.tracked.len(), false);
        (self.size, self.left) = (max, self.tracked.len());
    }

    /// An entry holding the layers `lr` (indices into the layer list) is
    /// taken up: they leave, and the tracked ones among them are consumed.
    fn take(&mut self, lr: Range<usize>) {
        self.remaining.mask(lr.clone(), 1);
        let t0 = self.tracked.partition_point(|&k| k < lr.start);
        let t1 = self.tracked.partition_point(|&k| k < lr.end);
        for c in &mut self.consumed[t0..t1] {
            if !*c {
                *c = true;
                self.left -= 1;
            }
        }
        if self.left == 0 {
            self.recompute();
        }
    }
}

/// The tied partners of the tensors under entry `e` that lie outside it,
/// in name order (Accelerate's tied groups are sorted by name, so the
/// modules holding the partners are tried, and split, in that order).
fn tied_partners(layout: &Layout, tied_of: &[(NodeId, usize)], e: NodeId) -> Vec<NodeId> {
    let end = layout.node(e).end();
    let lo = tied_of.partition_point(|&(t, _)| t < e);
    let hi = tied_of.partition_point(|&(t, _)| t < end);
    let mut groups: Vec<usize> = tied_of[lo..hi].iter().map(|&(_, g)| g).collect();
    groups.sort_unstable();
    groups.dedup();
    let mut partners: Vec<NodeId> = vec![];
    for g in groups {
        for &m in &layout.tied()[g] {
            if m < e || m >= end {
                partners.push(m);
            }
        }
    }
    partners.sort_by(|&a, &b| layout.node(a).name().cmp(layout.node(b).name()));
    partners
}

/// The error for an entry (`name`, `need` bytes with its tied partners)
/// that fits on no device: what each device holds, and how to fix it.
fn no_fit_error(
    budgets: &[(Target, Option<u64>)],
    used: &[u64],
    reserved: &[u64],
    name: &str,
    need: u64,
) -> Error {
    let list: Vec<String> = budgets
        .iter()
        .zip(used.iter().zip(reserved))
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
    let fix = "raise --max-memory, add `disk`, or allow splitting (fewer --no-split)";
    Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "`{name}` ({}) fits on no device; budgets used: {}",
            format_bytes(need),
            list.join(", ")
        ),
    )
    .with_fix(fix)
}

/// The largest of a fixed list of sizes, where ranges of the list can be
/// masked out (and back in) in O(log n): a segment tree whose node holds
/// the maximum of its unmasked range, with range masks kept as counts on
/// the covering nodes (no push-down needed).
#[derive(Debug)]
pub(super) struct MaskedMax {
    /// Leaves from `base`; node 1 is the root.
    base: usize,
    /// The maximum of each inner node (`1..base`); a leaf's is its value
    /// unless masked, so it is not stored.
    max: Vec<u64>,
    /// Range masks on the covering nodes. Entries are disjoint subtrees, so
    /// a count stays tiny; 16 bits keep this array small.
    mask: Vec<u16>,
    leaf: Vec<u64>,
}

impl MaskedMax {
    pub(super) fn new(leaf: Vec<u64>) -> Self {
        let base = leaf.len().next_power_of_two().max(1);
        let mut t = MaskedMax {
            base,
            max: vec![0u64; base],
            mask: vec![0; 2 * base],
            leaf,
        };
        for i in (1..base).rev() {
            t.max[i] = t.value(2 * i).max(t.value(2 * i + 1));
        }
        t
    }

    /// The maximum of node `i`'s unmasked elements.
    fn value(&self, i: usize) -> u64 {
        if i < self.base {
            self.max[i]
        } else if self.mask[i] > 0 {
            0
        } else {
            self.leaf.get(i - self.base).copied().unwrap_or(0)
        }
    }

    pub(super) fn pull(&mut self, i: usize) {
        if i < self.base {
            self.max[i] = if self.mask[i] > 0 {
                0
            } else {
                self.value(2 * i).max(self.value(2 * i + 1))
            };
        }
    }

    /// Add `d` (+1 or -1) to the mask of every element of `r`: on the
    /// nodes covering `r` exactly, bottom-up, then the maxima of their
    /// ancestors (the paths from `r`'s first and last leaf to the root).
    pub(super) fn mask(&mut self, r: std::ops::Range<usize>, d: i16) {
        if r.is_empty() {
            return;
        }
        let (first, last) = (r.start + self.base, r.end - 1 + self.base);
        let (mut lo, mut hi) = (first, last + 1);
        while lo < hi {
            if lo & 1 == 1 {
                self.mask[lo] = self.mask[lo].saturating_add_signed(d);
                self.pull(lo);
                lo += 1;
            }
            if hi & 1 == 1 {
                hi -= 1;
                self.mask[hi] = self.mask[hi].saturating_add_signed(d);
                self.pull(hi);
            }
            lo >>= 1;
            hi >>= 1;
        }
        for leaf in [first, last] {
            let mut i = leaf >> 1;
            while i >= 1 {
                self.pull(i);
                i >>= 1;
            }
        }
    }

    /// The largest unmasked value (0 when none).
    pub(super) fn max(&self) -> u64 {
        self.value(1)
    }

    /// Every unmasked element equal to `v` (> 0), in order.
    pub(super) fn each_equal(&self, v: u64, f: &mut dyn FnMut(usize)) {
        fn go(t: &MaskedMax, i: usize, v: u64, f: &mut dyn FnMut(usize)) {
            if t.value(i) != v {
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
    pub(super) fn first_max(&self) -> Option<usize> {
        let v = self.max();
        let mut i = 1;
        if v == 0 {
            return None;
        }
        while i < self.base {
            i = if self.value(2 * i) == v {
                2 * i
            } else {
                2 * i + 1
            };
        }
        (self.value(i) == v).then(|| i - self.base)
    }
}

/// A device the planner moved past while it was still empty.
#[derive(Debug, Clone)]
pub(super) struct Passed {
    /// The entry that did not fit.
    pub entry: NodeId,
    /// Its size with its tied partners.
    pub need: u64,
    /// What was kept free for the largest layer.
    pub reserve: u64,
    /// The largest remaining layer's name.
    pub largest: Option<String>,
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
    let mut todo: Vec<NodeId> = vec![];
    for &x in stack {
        match state[x as usize] {
            St::Pending => todo.push(x),
            St::Split => todo.extend(
                layout
                    .node(x)
                    .children()
                    .filter(|&c| state[c as usize] == St::Pending),
            ),
            St::Placed | St::Inside => {}
        }
    }
    // `todo` is a stack too: its last element is treated first.
    let contains = |a: NodeId, x: NodeId| a <= x && x < layout.node(a).end();
    while let Some(x) = todo.pop() {
        let end = layout.node(x).end();
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
        partners.sort_by(|&a, &b| layout.node(a).name().cmp(layout.node(b).name()));
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
                let parent = layout.node(u).parent()?;
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
        let n = layout.node(x);
        if n.kind() == NodeKind::Module && s.has_module_child[x as usize] && !s.no_split[x as usize]
        {
            push_rev(&mut todo, n.children());
        }
    }
    None
}

/// Make `x` (found by [`find_fallback`]) an entry of its own: the pending
/// entry holding it, and every module between them, is split in place on
/// the stack, `x` left out (the caller pushes it on top).
fn bring_forward(layout: &Layout, state: &mut [St], stack: &mut Vec<NodeId>, x: NodeId) {
    let contains = |a: NodeId, x: NodeId| a <= x && x < layout.node(a).end();
    let Some(pos) = stack
        .iter()
        .rposition(|&y| state[y as usize] != St::Placed && contains(y, x))
    else {
        return;
    };
    let mut top = stack[pos];
    if state[top as usize] == St::Split {
        // A tied partner split earlier: find its pending child holding `x`.
        let Some(c) = layout
            .node(top)
            .children()
            .find(|&c| state[c as usize] == St::Pending && contains(c, x))
        else {
            return;
        };
        // Expand the split module in place so `c` is an entry of the stack.
        let kids: Vec<NodeId> = layout
            .node(top)
            .children()
            .filter(|&k| state[k as usize] != St::Placed)
            .collect();
        stack.splice(pos..=pos, kids.into_iter().rev());
        top = c;
    }
    let Some(pos) = stack.iter().rposition(|&y| y == top) else {
        return;
    };
    fn expand(layout: &Layout, state: &mut [St], a: NodeId, x: NodeId, out: &mut Vec<NodeId>) {
        if a == x {
            return;
        }
        state[a as usize] = St::Split;
        for c in layout.node(a).children() {
            if c == x {
                continue;
            }
            if c < x && x < layout.node(c).end() {
                expand(layout, state, c, x, out);
            } else {
                state[c as usize] = St::Pending;
                out.push(c);
            }
        }
    }
    let mut forward = vec![];
    expand(layout, state, top, x, &mut forward);
    stack.splice(pos..=pos, forward.into_iter().rev());
}

/// `n`, or `<root>` for the root's empty name.
pub(super) fn display_name(n: &str) -> &str {
    if n.is_empty() {
        "<root>"
    } else {
        n
    }
}

/// Push `items` onto `stack` so that the first of them is on top.
fn push_rev(stack: &mut Vec<NodeId>, items: impl Iterator<Item = NodeId>) {
    let first = stack.len();
    stack.extend(items);
    stack[first..].reverse();
}
