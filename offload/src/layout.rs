//! The model layout: an ordered module tree with its tensors, plus
//! tied-parameter groups.
//!
//! # JSON format (`accel-layout/1`)
//!
//! ```json
//! {
//!   "format": "accel-layout/1",
//!   "root": {
//!     "name": "", "class": "LlamaForCausalLM",
//!     "params":  [],
//!     "buffers": [],
//!     "children": [
//!       { "name": "model", "class": "LlamaModel", "params": [], "buffers": [],
//!         "children": [
//!           { "name": "embed_tokens", "class": "Embedding",
//!             "params": [ { "name": "weight", "dtype": "bf16", "shape": [32000, 4096] } ] }
//!         ] },
//!       { "name": "lm_head", "class": "Linear",
//!         "params": [ { "name": "weight", "dtype": "bf16", "shape": [32000, 4096] } ] }
//!     ]
//!   },
//!   "tied": [ ["model.embed_tokens.weight", "lm_head.weight"] ]
//! }
//! ```
//!
//! * `name` is the local name (the attribute name); full names are the
//!   dotted path from the root, whose own name is `""`.
//! * `class` is optional (`null` or absent when unknown, as for layouts built
//!   from a checkpoint). `params`, `buffers` and `children` are optional and
//!   keep definition order. `dtype` is one of `f16 bf16 f32 f64 i8 u8 i32
//!   i64` (torch spellings such as `float16`/`bfloat16` are accepted too).
//! * A buffer may say `"persistent": false` (rotary `inv_freq`, masks): it
//!   is in no checkpoint and is never loaded, but it takes memory on its
//!   device, so the planner counts it as Accelerate does.
//! * `tied` lists groups of full tensor names sharing one storage. The first
//!   member in tree order owns the storage (for a layout built from a
//!   checkpoint: the first member the checkpoint stores); the others are
//!   aliases, never stored twice. The planner counts the group's bytes once,
//!   on its first member in tree order (Accelerate counts them the same way,
//!   because `named_parameters()` drops later duplicates).
//! * Every tensor's size, and their sum, must fit in 64 bits (checked).
//!
//! In tree order, a module's entries come as: its own parameters, its child
//! modules, its own buffers (Accelerate's order for the root).

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::Path;
use std::sync::OnceLock;

use hashbrown::{DefaultHashBuilder, HashTable};

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};

use crate::safetensors::Checkpoint;

mod json;
mod parse;

use crate::util::natural_cmp;
pub use json::{LayoutJson, ModuleJson, TensorJson, LAYOUT_FORMAT};
use json::{RawDoc, RawModule, Str, TensorIn};

/// Index of a node in [`Layout::nodes`] (tree preorder).
pub type NodeId = u32;

/// What a node is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// A module (has children, no data of its own).
    Module,
    /// A parameter tensor.
    Param,
    /// A buffer tensor.
    Buffer,
}

/// "None" in the compact per-node records.
const NONE: u32 = u32::MAX;

/// One node's facts, stored compactly: names and shapes live in shared
/// buffers of the [`Layout`], children are the preorder sibling chain
/// (`id + 1`, then each child's `end`), so building a layout of a million
/// nodes makes a handful of allocations, not millions.
#[derive(Debug, Clone, Copy)]
struct Rec {
    /// Full name: `names[name_start..name_start + name_len]`.
    name_start: usize,
    name_len: u32,
    alias_of: u32,
    /// Index into `classes`.
    class: u32,
    /// Shape: `shapes[shape_start..shape_start + ndim]` (tensors only).
    shape_start: u32,
    ndim: u32,
    kind: NodeKind,
    /// The element type (tensors only; `F32` for modules, never read).
    dtype: DType,
    persistent: bool,
}

/// One module or tensor of the tree: a view into its [`Layout`] (cheap to
/// copy; see [`Layout::node`]).
#[derive(Clone, Copy)]
pub struct Node<'a> {
    l: &'a Layout,
    id: NodeId,
}

impl std::fmt::Debug for Node<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("id", &self.id)
            .field("name", &self.name())
            .field("class", &self.class())
            .field("kind", &self.kind())
            .field("meta", &self.meta())
            .field("parent", &self.parent())
            .field("end", &self.end())
            .field("alias_of", &self.alias_of())
            .field("persistent", &self.persistent())
            .finish()
    }
}

impl<'a> Node<'a> {
    fn rec(&self) -> &'a Rec {
        &self.l.recs[self.id as usize]
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// Full dotted name (`""` for the root).
    pub fn name(&self) -> &'a str {
        let r = self.rec();
        &self.l.names[r.name_start..r.name_start + r.name_len as usize]
    }

    /// The last component of the name (the attribute name; `""` for the
    /// root).
    pub fn local_name(&self) -> &'a str {
        let n = self.name();
        n.rsplit('.').next().unwrap_or("")
    }

    /// Class name of a module, when known.
    pub fn class(&self) -> Option<&'a str> {
        let c = self.rec().class;
        (c != NONE).then(|| &*self.l.classes[c as usize])
    }

    /// Module, parameter or buffer.
    pub fn kind(&self) -> NodeKind {
        self.rec().kind
    }

    /// `true` for parameters and buffers.
    pub fn is_tensor(&self) -> bool {
        self.rec().kind != NodeKind::Module
    }

    /// Element type (tensors only).
    pub fn dtype(&self) -> Option<DType> {
        self.is_tensor().then_some(self.rec().dtype)
    }

    /// Shape (tensors only).
    pub fn shape(&self) -> Option<&'a [usize]> {
        let r = self.rec();
        let s = r.shape_start as usize;
        self.is_tensor()
            .then(|| &self.l.shapes[s..s + r.ndim as usize])
    }

    /// Element type and shape (tensors only; a copy).
    pub fn meta(&self) -> Option<TensorMeta> {
        Some(TensorMeta {
            dtype: self.dtype()?,
            shape: self.shape()?.to_vec(),
        })
    }

    /// Bytes of the tensor (tensors only; the layout checked that they fit
    /// in 64 bits).
    pub fn bytes(&self) -> Option<u64> {
        let r = self.rec();
        self.is_tensor()
            .then(|| shape_bytes(r.dtype, self.shape().unwrap_or(&[])).unwrap_or(u64::MAX))
    }

    /// Parent module (`None` for the root).
    pub fn parent(&self) -> Option<NodeId> {
        let p = self.l.parents[self.id as usize];
        (p != NONE).then_some(p)
    }

    /// Entries in tree order: parameters, child modules, buffers.
    pub fn children(&self) -> Children<'a> {
        Children {
            l: self.l,
            next: self.id + 1,
            end: self.end(),
        }
    }

    /// One past the last node of this subtree (preorder range `id..end`).
    pub fn end(&self) -> NodeId {
        self.l.ends[self.id as usize]
    }

    /// For a tied alias, the owner of the storage.
    pub fn alias_of(&self) -> Option<NodeId> {
        let a = self.rec().alias_of;
        (a != NONE).then_some(a)
    }

    /// `false` for a non-persistent buffer: counted in module sizes (as
    /// Accelerate does) but not in any checkpoint (the model computes it).
    pub fn persistent(&self) -> bool {
        self.rec().persistent
    }
}

/// The children of a node, in tree order (see [`Node::children`]).
#[derive(Clone, Debug)]
pub struct Children<'a> {
    l: &'a Layout,
    next: NodeId,
    end: NodeId,
}

impl Iterator for Children<'_> {
    type Item = NodeId;
    fn next(&mut self) -> Option<NodeId> {
        if self.next >= self.end {
            return None;
        }
        let c = self.next;
        self.next = self.l.ends[c as usize];
        Some(c)
    }
}

/// An ordered module tree (see the [module docs](self) for the JSON format).
#[derive(Clone)]
pub struct Layout {
    recs: Vec<Rec>,
    /// Per node: its parent (`NONE` for the root) and the end of its
    /// subtree (kept apart from `recs`: the planner's passes read only
    /// these).
    parents: Vec<NodeId>,
    ends: Vec<NodeId>,
    /// Every full name, one after the other in tree order.
    names: String,
    /// Every tensor's dimensions, one after the other.
    shapes: Vec<usize>,
    /// Class names, each once.
    classes: Vec<Box<str>>,
    /// (hash, node id) by full name, built on the first lookup (planning
    /// never needs it).
    by_name: OnceLock<HashTable<(u64, NodeId)>>,
    hasher: DefaultHashBuilder,
    tied: Vec<Vec<NodeId>>,
    order_inferred: bool,
    /// While building: a local name was empty or held a `.`, or the
    /// tensors' bytes overflowed 64 bits in all (aliases included); the
    /// exact checks then run, else they are known to pass.
    suspect_names: bool,
    total_overflow: bool,
    /// While building: the running total of every tensor's bytes.
    total: u64,
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layout")
            .field("nodes", &self.recs.len())
            .field("tied", &self.tied.len())
            .field("order_inferred", &self.order_inferred)
            .finish()
    }
}

fn join(prefix: &str, local: &str) -> String {
    if prefix.is_empty() {
        local.to_string()
    } else {
        let mut s = String::with_capacity(prefix.len() + 1 + local.len());
        s.push_str(prefix);
        s.push('.');
        s.push_str(local);
        s
    }
}

/// Bytes of a tensor of `meta`, or `None` when the element count or the
/// byte count does not fit in 64 bits (a layout must never be planned with a
/// wrapped-around size).
pub fn checked_bytes(meta: &TensorMeta) -> Option<u64> {
    shape_bytes(meta.dtype, &meta.shape)
}

/// [`checked_bytes`] of `dtype` and `shape`.
fn shape_bytes(dtype: DType, shape: &[usize]) -> Option<u64> {
    shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(u64::try_from(d).ok()?))?
        .checked_mul(dtype.size() as u64)
}

/// Where siblings go when the model's own order is unknown (a layout built
/// from a checkpoint, whose names say nothing about definition order):
/// embeddings first, then an encoder, then everything else in natural
/// order, then final norms, then output heads, the order nearly every
/// Hugging Face model defines them in.
fn inferred_rank(local: &str) -> u8 {
    match local {
        "embed_tokens" | "wte" | "word_embeddings" | "tok_embeddings" | "embed_in" | "shared"
        | "embeddings" | "embedding" => 0,
        "wpe"
        | "embed_positions"
        | "position_embeddings"
        | "token_type_embeddings"
        | "rotary_emb"
        | "emb_ln"
        | "embed_layer_norm" => 1,
        "encoder" => 2,
        "norm" | "ln_f" | "final_layer_norm" | "final_layernorm" | "norm_f" | "final_norm"
        | "ln_out" => 4,
        "lm_head" | "head" | "classifier" | "cls" | "score" | "qa_outputs" | "embed_out" => 5,
        _ => 3,
    }
}

/// `true` when `local` is `k` written in decimal (a module list's entry).
fn is_index(local: &str, k: usize) -> bool {
    let b = local.as_bytes();
    if b.is_empty() || (b[0] == b'0' && b.len() > 1) {
        return false;
    }
    let mut v = 0usize;
    for &d in b {
        if !d.is_ascii_digit() {
            return false;
        }
        v = match v
            .checked_mul(10)
            .and_then(|v| v.checked_add(usize::from(d - b'0')))
        {
            Some(v) => v,
            None => return false,
        };
    }
    v == k
}

/// Class names to their index in [`Layout`]'s list, while building.
type ClassIds = hashbrown::HashMap<Box<str>, u32>;

impl Layout {
    /// Build from a [`LayoutJson`] document.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a wrong format tag, duplicate
    /// names, a tensor whose size does not fit in 64 bits, or tied names
    /// that are not tensors of the tree.
    pub fn from_json(doc: &LayoutJson) -> Result<Layout> {
        Self::from_raw(RawDoc {
            format: Str(Cow::Borrowed(&doc.format)),
            root: RawModule::of(&doc.root),
            tied: doc.tied.clone(),
        })
    }

    fn from_raw(doc: RawDoc<'_>) -> Result<Layout> {
        if doc.format.0 != LAYOUT_FORMAT {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "layout format `{}`, expected `{LAYOUT_FORMAT}`",
                    doc.format.0
                ),
            ));
        }
        fn count(m: &RawModule<'_>) -> usize {
            1 + m.params.len() + m.buffers.len() + m.children.iter().map(count).sum::<usize>()
        }
        let mut l = Layout::empty(count(&doc.root), false);
        let mut classes = ClassIds::new();
        fn walk(
            l: &mut Layout,
            classes: &mut ClassIds,
            m: &RawModule<'_>,
            parent: Option<NodeId>,
        ) -> Result<NodeId> {
            let class = m.class.as_ref().map(|c| l.intern(classes, &c.0));
            // The root's own name never enters full names.
            let local = if parent.is_some() { &*m.name.0 } else { "" };
            let id = l.push_module(parent, local, class)?;
            for p in &m.params {
                l.push_tensor(id, &p.name.0, NodeKind::Param, p.input())?;
            }
            for c in &m.children {
                walk(l, classes, c, Some(id))?;
            }
            for b in &m.buffers {
                l.push_tensor(id, &b.name.0, NodeKind::Buffer, b.input())?;
            }
            l.close(id);
            Ok(id)
        }
        walk(&mut l, &mut classes, &doc.root, None)?;
        l.finish(&doc.tied, &Default::default())?;
        Ok(l)
    }

    fn empty(capacity: usize, order_inferred: bool) -> Layout {
        Layout {
            recs: Vec::with_capacity(capacity),
            parents: Vec::with_capacity(capacity),
            ends: Vec::with_capacity(capacity),
            names: String::new(),
            shapes: vec![],
            classes: vec![],
            by_name: OnceLock::new(),
            hasher: DefaultHashBuilder::default(),
            tied: vec![],
            order_inferred,
            suspect_names: false,
            total_overflow: false,
            total: 0,
        }
    }

    /// The index of class name `c`, added on first sight.
    fn intern(&mut self, ids: &mut ClassIds, c: &str) -> u32 {
        // A model has a handful of classes: a scan beats hashing.
        if self.classes.len() <= 16 {
            if let Some(i) = self.classes.iter().position(|k| **k == *c) {
                return i as u32;
            }
        } else if let Some(&i) = ids.get(c) {
            return i;
        }
        let i = self.classes.len() as u32;
        self.classes.push(c.into());
        ids.insert(c.into(), i);
        i
    }

    /// Push a node named `local` under `parent` (the root: `None`, `""`);
    /// its subtree ends at the next node until [`Layout::close`].
    fn push_node(
        &mut self,
        parent: Option<NodeId>,
        local: &str,
        kind: NodeKind,
        class: Option<u32>,
        tensor: Option<TensorIn<'_>>,
    ) -> Result<NodeId> {
        let too_large = || {
            Error::new(
                ErrorKind::InvalidArgument,
                "the layout is too large (over 2^32 nodes, name bytes or dimensions)",
            )
        };
        let id = u32::try_from(self.recs.len())
            .ok()
            .filter(|&i| i != NONE)
            .ok_or_else(too_large)?;
        let name_start = self.names.len();
        if parent.is_some() && (local.is_empty() || local.bytes().any(|b| b == b'.')) {
            self.suspect_names = true;
        }
        if let Some(p) = parent {
            let pr = self.recs[p as usize];
            if pr.name_len > 0 {
                self.names
                    .extend_from_within(pr.name_start..pr.name_start + pr.name_len as usize);
                self.names.push('.');
            }
        }
        self.names.push_str(local);
        let name_len = u32::try_from(self.names.len() - name_start).map_err(|_| too_large())?;
        let shape_start = u32::try_from(self.shapes.len()).map_err(|_| too_large())?;
        let (dtype, ndim, persistent) = match tensor {
            Some(t) => {
                let Some(bytes) = shape_bytes(t.dtype, t.shape) else {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "tensor `{}`: {} {:?} holds more than 2^64 bytes",
                            &self.names[name_start..],
                            t.dtype.name(),
                            t.shape
                        ),
                    )
                    .with_fix("check the shape; no real tensor is that large"));
                };
                match self.total.checked_add(bytes) {
                    Some(t) => self.total = t,
                    None => self.total_overflow = true,
                }
                self.shapes.extend_from_slice(t.shape);
                let ndim = u32::try_from(t.shape.len()).map_err(|_| too_large())?;
                (t.dtype, ndim, t.persistent)
            }
            None => (DType::F32, 0, true),
        };
        self.parents.push(parent.unwrap_or(NONE));
        self.ends.push(id + 1);
        self.recs.push(Rec {
            name_start,
            name_len,
            alias_of: NONE,
            class: class.unwrap_or(NONE),
            shape_start,
            ndim,
            kind,
            dtype,
            persistent,
        });
        Ok(id)
    }

    fn push_module(
        &mut self,
        parent: Option<NodeId>,
        local: &str,
        class: Option<u32>,
    ) -> Result<NodeId> {
        self.push_node(parent, local, NodeKind::Module, class, None)
    }

    fn push_tensor(
        &mut self,
        parent: NodeId,
        local: &str,
        kind: NodeKind,
        t: TensorIn<'_>,
    ) -> Result<NodeId> {
        self.push_node(Some(parent), local, kind, None, Some(t))
    }

    /// The subtree of module `id` ends here.
    fn close(&mut self, id: NodeId) {
        self.ends[id as usize] = self.recs.len() as NodeId;
    }

    /// `true` when the module order was inferred from tensor names (a
    /// layout built from a checkpoint) rather than given by the model.
    pub fn order_inferred(&self) -> bool {
        self.order_inferred
    }

    /// Build from a checkpoint's headers: the tree from the dotted names,
    /// class names unknown, every tensor a parameter, and the module order
    /// inferred (see [`Layout::from_tensors`]).
    pub fn from_checkpoint(ck: &Checkpoint, tied: &[Vec<String>]) -> Result<Layout> {
        Self::from_tensors(ck.iter().map(|(n, m)| (n.to_string(), m.clone())), tied)
    }

    /// Build from (full name, meta) pairs as [`Layout::from_checkpoint`] does.
    /// A tied-group member absent from `tensors` is added as an alias with
    /// its owner's meta (checkpoints store tied weights once).
    ///
    /// Names carry no definition order, so siblings are ordered by a rule
    /// that matches how models are written: a module's own tensors first,
    /// then its child modules with embeddings first, an encoder next, the
    /// rest in natural order (`layers.2` before `layers.10`), final norms
    /// and then output heads (`lm_head`) last. [`Layout::order_inferred`]
    /// says so; a layout from `tools/export_layout.py` has the real order.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a name that is both a module and a
    /// tensor or appears twice, a tensor whose size does not fit in 64 bits,
    /// or a tied group none of whose members is given.
    pub fn from_tensors(
        tensors: impl IntoIterator<Item = (String, TensorMeta)>,
        tied: &[Vec<String>],
    ) -> Result<Layout> {
        #[derive(Default)]
        struct B {
            tensors: Vec<(String, TensorMeta)>,
            mods: Vec<(String, usize)>,
            idx: HashMap<String, usize>,
        }
        let mut arena: Vec<B> = vec![B::default()];
        let mut metas: HashMap<String, TensorMeta> = HashMap::new();
        let mut absent: std::collections::HashSet<String> = Default::default();
        let insert = |arena: &mut Vec<B>, name: &str, meta: TensorMeta| {
            let mut cur = 0usize;
            let mut parts = name.split('.').peekable();
            while let Some(p) = parts.next() {
                if parts.peek().is_none() {
                    arena[cur].tensors.push((p.to_string(), meta));
                    break;
                }
                cur = match arena[cur].idx.get(p) {
                    Some(&c) => c,
                    None => {
                        let c = arena.len();
                        arena.push(B::default());
                        arena[cur].idx.insert(p.to_string(), c);
                        arena[cur].mods.push((p.to_string(), c));
                        c
                    }
                };
            }
        };
        for (name, meta) in tensors {
            if metas.insert(name.clone(), meta.clone()).is_some() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("tensor `{name}` appears twice"),
                ));
            }
            insert(&mut arena, &name, meta);
        }
        for g in tied {
            let Some(owner) = g.iter().find_map(|n| metas.get(n).cloned()) else {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("tied group {g:?}: none of its tensors is in the checkpoint"),
                ));
            };
            for n in g {
                if !metas.contains_key(n) {
                    absent.insert(n.clone());
                    metas.insert(n.clone(), owner.clone());
                    insert(&mut arena, n, owner.clone());
                }
            }
        }
        let mut l = Layout::empty(metas.len() * 3 / 2 + 1, true);
        fn emit(
            l: &mut Layout,
            arena: &mut Vec<B>,
            b: usize,
            local: &str,
            parent: Option<NodeId>,
        ) -> Result<NodeId> {
            let id = l.push_module(parent, local, None)?;
            let mut ts = std::mem::take(&mut arena[b].tensors);
            ts.sort_by(|a, c| natural_cmp(&a.0, &c.0));
            let mut ms = std::mem::take(&mut arena[b].mods);
            ms.sort_by(|a, c| {
                inferred_rank(&a.0)
                    .cmp(&inferred_rank(&c.0))
                    .then_with(|| natural_cmp(&a.0, &c.0))
            });
            for (n, m) in &ts {
                let t = TensorIn {
                    dtype: m.dtype,
                    shape: &m.shape,
                    persistent: true,
                };
                l.push_tensor(id, n, NodeKind::Param, t)?;
            }
            for (n, c) in ms {
                emit(l, arena, c, &n, Some(id))?;
            }
            l.close(id);
            Ok(id)
        }
        emit(&mut l, &mut arena, 0, "", None)?;
        l.finish(tied, &absent)?;
        Ok(l)
    }

    fn index(&self) -> &HashTable<(u64, NodeId)> {
        self.by_name.get_or_init(|| {
            let mut t = HashTable::with_capacity(self.recs.len());
            for (i, n) in self.nodes().enumerate() {
                let h = self.hasher.hash_one(n.name());
                // Names are unique (checked by `check_siblings`).
                t.insert_unique(h, (h, i as NodeId), |&(hh, _)| hh);
            }
            t
        })
    }

    /// Ids of `names`, without building the name index when it is not
    /// there yet (one pass over the nodes instead).
    fn ids_of(&self, names: &[&str]) -> Vec<Option<NodeId>> {
        if self.by_name.get().is_some() || names.len() > 64 {
            return names.iter().map(|n| self.id(n)).collect();
        }
        let mut out = vec![None; names.len()];
        for (i, n) in self.nodes().enumerate() {
            let name = n.name();
            for (k, want) in names.iter().enumerate() {
                if name.len() == want.len() && name == *want {
                    out[k] = Some(i as NodeId);
                }
            }
        }
        out
    }

    /// `true` when [`Layout::check_siblings`] is known to pass: no local
    /// name was suspect when pushed and no two siblings share a name.
    fn siblings_ok(&self) -> bool {
        if self.suspect_names {
            return false;
        }
        let mut locals: Vec<&str> = vec![];
        let mut seen: hashbrown::HashSet<&str> = Default::default();
        for (id, &end) in self.ends.iter().enumerate() {
            let id = id as NodeId;
            // No children, or one (its subtree ends where the parent's
            // does): nothing to compare.
            if end == id + 1
                || self.ends[id as usize + 1] == end
                || self.recs[id as usize].kind != NodeKind::Module
            {
                continue;
            }
            let skip = self.recs[id as usize].name_len as usize;
            let skip = if skip == 0 { 0 } else { skip + 1 };
            locals.clear();
            locals.extend(
                self.node(id)
                    .children()
                    .map(|c| &self.node(c).name()[skip..]),
            );
            if locals.len() <= 8 {
                for (k, a) in locals.iter().enumerate() {
                    if locals[..k].contains(a) {
                        return false;
                    }
                }
            } else if !locals.iter().enumerate().all(|(k, l)| is_index(l, k)) {
                // Not `0`, `1`, ... in order (a module list): hash them.
                seen.clear();
                if !locals.iter().all(|a| seen.insert(a)) {
                    return false;
                }
            }
        }
        true
    }

    /// Full names are unique when no local name is empty or holds a dot
    /// (PyTorch forbids both) and siblings differ.
    fn check_siblings(&self) -> Result<()> {
        if self.siblings_ok() {
            return Ok(());
        }
        let dup = |name: &str| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("`{name}` is both a module and a tensor, or appears twice"),
            )
        };
        let mut locals: Vec<&str> = vec![];
        for n in self.nodes() {
            if n.kind() != NodeKind::Module || n.end() == n.id() + 1 {
                continue;
            }
            let name = n.name();
            let skip = if name.is_empty() { 0 } else { name.len() + 1 };
            locals.clear();
            for c in n.children() {
                let full = self.node(c).name();
                let local = &full[skip..];
                if local.is_empty() || local.contains('.') {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!("`{full}`: a module, parameter or buffer name must be non-empty and hold no `.`"),
                    ));
                }
                locals.push(local);
            }
            if locals.len() <= 8 {
                for (k, a) in locals.iter().enumerate() {
                    if locals[..k].contains(a) {
                        let c = n.children().nth(k).expect("child");
                        return Err(dup(self.node(c).name()));
                    }
                }
            } else {
                locals.sort_unstable();
                if let Some(w) = locals.windows(2).find(|w| w[0] == w[1]) {
                    return Err(dup(&join(name, w[0])));
                }
            }
        }
        Ok(())
    }

    /// Checks and tied groups, once the tree is built.
    fn finish(
        &mut self,
        tied: &[Vec<String>],
        absent: &std::collections::HashSet<String>,
    ) -> Result<()> {
        self.check_siblings()?;
        self.set_tied(tied, absent)?;
        self.check_total()
    }

    /// The whole layout's bytes must fit in 64 bits too (every size sum the
    /// planner takes is then exact).
    fn check_total(&self) -> Result<()> {
        if !self.total_overflow {
            // Every tensor's bytes fit in 64 bits in all, so the owners' do.
            return Ok(());
        }
        let mut total = 0u64;
        for n in self.nodes() {
            if !n.is_tensor() || n.alias_of().is_some() {
                continue;
            }
            total = n
                .bytes()
                .and_then(|b| total.checked_add(b))
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "the layout's tensors hold more than 2^64 bytes in all (at `{}`)",
                            n.name()
                        ),
                    )
                    .with_fix("check the shapes; no real model is that large")
                })?;
        }
        Ok(())
    }

    /// Record tied groups; the owner is the first member in tree order that
    /// is not in `absent` (tensors added as aliases because the checkpoint
    /// stores them once).
    fn set_tied(
        &mut self,
        tied: &[Vec<String>],
        absent: &std::collections::HashSet<String>,
    ) -> Result<()> {
        let mut seen: HashMap<NodeId, usize> = HashMap::new();
        let all: Vec<&str> = tied.iter().flatten().map(String::as_str).collect();
        let found = self.ids_of(&all);
        let mut found = found.into_iter();
        let mut groups = vec![];
        for g in tied {
            let mut ids = Vec::with_capacity(g.len());
            for n in g {
                let id = found
                    .next()
                    .flatten()
                    .filter(|&i| self.node(i).is_tensor())
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidArgument,
                            format!("tied name `{n}` is not a tensor of the layout"),
                        )
                    })?;
                ids.push(id);
            }
            ids.sort_unstable();
            ids.dedup();
            if ids.len() < 2 {
                continue;
            }
            for &i in &ids {
                if seen.insert(i, groups.len()).is_some() {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "tensor `{}` is in two tied groups; merge them",
                            self.node(i).name()
                        ),
                    ));
                }
            }
            if let Some(k) = ids
                .iter()
                .position(|&i| !absent.contains(self.node(i).name()))
            {
                let o = ids.remove(k);
                ids.insert(0, o);
            }
            let owner = ids[0];
            let numel = |i: NodeId| {
                self.node(i)
                    .shape()
                    .map(|s| s.iter().try_fold(1usize, |a, &d| a.checked_mul(d)))
            };
            for &i in &ids[1..] {
                if numel(i) != numel(owner) {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "tied tensors `{}` and `{}` have different sizes",
                            self.node(owner).name(),
                            self.node(i).name()
                        ),
                    ));
                }
            }
            groups.push(ids);
        }
        for ids in &groups {
            for &i in &ids[1..] {
                self.recs[i as usize].alias_of = ids[0];
            }
        }
        self.tied = groups;
        Ok(())
    }

    /// Per node, its parent (`u32::MAX` for the root), for the planner's
    /// passes over every node.
    pub(crate) fn parents(&self) -> &[NodeId] {
        &self.parents
    }

    /// Element type and bytes of node `i`, when it is a tensor (the
    /// planner's pass over every node, without a [`Node`] view).
    #[inline]
    pub(crate) fn tensor_at(&self, i: usize) -> Option<(DType, u64)> {
        let r = &self.recs[i];
        if r.kind == NodeKind::Module {
            return None;
        }
        let s = r.shape_start as usize;
        let shape = &self.shapes[s..s + r.ndim as usize];
        // Checked when the node was pushed.
        Some((r.dtype, shape_bytes(r.dtype, shape).unwrap_or(u64::MAX)))
    }

    /// The length of node `i`'s full name.
    #[inline]
    pub(crate) fn name_len_at(&self, i: usize) -> usize {
        self.recs[i].name_len as usize
    }

    /// The class index of node `i` ([`Layout::class_names`]).
    #[inline]
    pub(crate) fn class_at(&self, i: usize) -> Option<u32> {
        let c = self.recs[i].class;
        (c != NONE).then_some(c)
    }

    /// Every class name, each once.
    pub(crate) fn class_names(&self) -> &[Box<str>] {
        &self.classes
    }

    /// Per node, the end of its subtree ([`Node::end`]).
    pub(crate) fn ends(&self) -> &[NodeId] {
        &self.ends
    }

    /// Number of nodes (modules and tensors).
    pub fn len(&self) -> usize {
        self.recs.len()
    }

    /// `true` for a layout without nodes (never: every layout has a root).
    pub fn is_empty(&self) -> bool {
        self.recs.is_empty()
    }

    /// Every node, in tree preorder (the first is the root).
    pub fn nodes(&self) -> impl DoubleEndedIterator<Item = Node<'_>> + ExactSizeIterator + '_ {
        (0..self.recs.len() as NodeId).map(move |id| Node { l: self, id })
    }

    /// The node `id`.
    ///
    /// # Panics
    /// When `id` is not a node of this layout.
    pub fn node(&self, id: NodeId) -> Node<'_> {
        assert!((id as usize) < self.recs.len(), "node {id} out of range");
        Node { l: self, id }
    }

    /// The id of the module or tensor named `name`.
    pub fn id(&self, name: &str) -> Option<NodeId> {
        let h = self.hasher.hash_one(name);
        self.index()
            .find(h, |&(hh, i)| hh == h && self.node(i).name() == name)
            .map(|&(_, i)| i)
    }

    /// Tied groups: the owner of the storage first, then its aliases in
    /// tree order.
    pub fn tied(&self) -> &[Vec<NodeId>] {
        &self.tied
    }

    /// Tensor ids in tree order.
    pub fn tensor_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.recs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.kind != NodeKind::Module)
            .map(|(i, _)| i as NodeId)
    }

    /// Number of tensors (aliases included).
    pub fn tensor_count(&self) -> usize {
        self.recs
            .iter()
            .filter(|r| r.kind != NodeKind::Module)
            .count()
    }

    /// Names of the tensors under `name` (a module or a tensor), tree order.
    pub fn tensors_under(&self, name: &str) -> Option<Vec<String>> {
        let id = self.id(name)?;
        let end = self.node(id).end();
        Some(
            (id..end)
                .map(|i| self.node(i))
                .filter(|n| n.is_tensor())
                .map(|n| n.name().to_string())
                .collect(),
        )
    }

    /// Back to the JSON form.
    pub fn to_json(&self) -> LayoutJson {
        fn build(l: &Layout, id: NodeId) -> ModuleJson {
            let n = l.node(id);
            let mut m = ModuleJson {
                name: n.local_name().to_string(),
                class: n.class().map(str::to_string),
                ..Default::default()
            };
            for c in n.children() {
                let cn = l.node(c);
                let tj = || TensorJson {
                    name: cn.local_name().to_string(),
                    dtype: cn.dtype().expect("tensor dtype"),
                    shape: cn.shape().expect("tensor shape").to_vec(),
                    persistent: cn.persistent(),
                };
                match cn.kind() {
                    NodeKind::Module => m.children.push(build(l, c)),
                    NodeKind::Param => m.params.push(tj()),
                    NodeKind::Buffer => m.buffers.push(tj()),
                }
            }
            m
        }
        LayoutJson {
            format: LAYOUT_FORMAT.to_string(),
            root: build(self, 0),
            tied: self
                .tied
                .iter()
                .map(|g| g.iter().map(|&i| self.node(i).name().to_string()).collect())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
