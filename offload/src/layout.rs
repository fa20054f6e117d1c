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
use std::sync::{Arc, OnceLock};

use hashbrown::{DefaultHashBuilder, HashTable};

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use serde::{Deserialize, Serialize};

use crate::safetensors::Checkpoint;

mod parse;
use crate::util::natural_cmp;

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

/// One module or tensor of the tree.
#[derive(Debug, Clone)]
pub struct Node {
    /// Full dotted name (`""` for the root).
    pub name: String,
    /// Class name of a module, when known (shared between modules of one
    /// class).
    pub class: Option<Arc<str>>,
    /// Module, parameter or buffer.
    pub kind: NodeKind,
    /// Element type and shape (tensors only).
    pub meta: Option<TensorMeta>,
    /// Parent module (`None` for the root).
    pub parent: Option<NodeId>,
    /// Entries in tree order: parameters, child modules, buffers.
    pub children: Vec<NodeId>,
    /// One past the last node of this subtree (preorder range `id..end`).
    pub end: NodeId,
    /// For a tied alias, the owner of the storage.
    pub alias_of: Option<NodeId>,
    /// `false` for a non-persistent buffer: counted in module sizes (as
    /// Accelerate does) but not in any checkpoint (the model computes it).
    pub persistent: bool,
}

impl Node {
    /// `true` for parameters and buffers.
    pub fn is_tensor(&self) -> bool {
        self.kind != NodeKind::Module
    }
}

/// An ordered module tree (see the [module docs](self) for the JSON format).
#[derive(Clone)]
pub struct Layout {
    nodes: Vec<Node>,
    /// (hash, node id) by full name, built on the first lookup (planning
    /// never needs it); the names live only in `nodes`.
    by_name: OnceLock<HashTable<(u64, NodeId)>>,
    hasher: DefaultHashBuilder,
    tied: Vec<Vec<NodeId>>,
    order_inferred: bool,
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Layout")
            .field("nodes", &self.nodes.len())
            .field("tied", &self.tied.len())
            .field("order_inferred", &self.order_inferred)
            .finish()
    }
}

/// JSON form of one tensor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TensorJson {
    /// Local name.
    pub name: String,
    /// Element type.
    #[serde(with = "dtype_serde")]
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// `false` for a non-persistent buffer (absent from checkpoints);
    /// written only when `false`.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub persistent: bool,
}

fn yes() -> bool {
    true
}

fn is_true(b: &bool) -> bool {
    *b
}

/// JSON form of one module.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ModuleJson {
    /// Local name (`""` for the root).
    #[serde(default)]
    pub name: String,
    /// Class name, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
    /// Own parameters in definition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub params: Vec<TensorJson>,
    /// Own buffers in definition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub buffers: Vec<TensorJson>,
    /// Child modules in definition order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<ModuleJson>,
}

/// JSON form of a whole layout.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayoutJson {
    /// Always `accel-layout/1`.
    pub format: String,
    /// The root module.
    pub root: ModuleJson,
    /// Tied groups of full tensor names.
    #[serde(default)]
    pub tied: Vec<Vec<String>>,
}

/// The format tag written and accepted.
pub const LAYOUT_FORMAT: &str = "accel-layout/1";

/// A string borrowed from the JSON text when it has no escapes.
#[derive(Default)]
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Str<'de>, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A dtype read without allocating.
struct RawDType(DType);

impl<'de> Deserialize<'de> for RawDType {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = RawDType;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a dtype name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawDType, E> {
                // The canonical names without allocating; anything else
                // (torch spellings) through `DType::from_str`.
                if let Some(&d) = DType::ALL.iter().find(|d| d.name() == v) {
                    return Ok(RawDType(d));
                }
                v.strip_prefix("torch.")
                    .unwrap_or(v)
                    .parse::<DType>()
                    .map(RawDType)
                    .map_err(|e| E::custom(e.to_string()))
            }
        }
        d.deserialize_str(V)
    }
}

/// The parsing form of [`LayoutJson`]: names borrowed from the text, shapes
/// moved into the layout (the fast path of [`Layout::from_json_file`]).
#[derive(Deserialize)]
struct RawDoc<'a> {
    #[serde(borrow)]
    format: Str<'a>,
    #[serde(borrow)]
    root: RawModule<'a>,
    #[serde(default)]
    tied: Vec<Vec<String>>,
}

#[derive(Deserialize, Default)]
struct RawModule<'a> {
    #[serde(default, borrow)]
    name: Str<'a>,
    #[serde(default, borrow)]
    class: Option<Str<'a>>,
    #[serde(default, borrow)]
    params: Vec<RawTensor<'a>>,
    #[serde(default, borrow)]
    buffers: Vec<RawTensor<'a>>,
    #[serde(default, borrow)]
    children: Vec<RawModule<'a>>,
}

#[derive(Deserialize)]
struct RawTensor<'a> {
    #[serde(borrow)]
    name: Str<'a>,
    dtype: RawDType,
    shape: Vec<usize>,
    #[serde(default = "yes")]
    persistent: bool,
}

impl<'a> RawModule<'a> {
    /// A borrowed view of a [`ModuleJson`] (shapes copied).
    fn of(m: &'a ModuleJson) -> RawModule<'a> {
        let t = |t: &'a TensorJson| RawTensor {
            name: Str(Cow::Borrowed(&t.name)),
            dtype: RawDType(t.dtype),
            shape: t.shape.clone(),
            persistent: t.persistent,
        };
        RawModule {
            name: Str(Cow::Borrowed(&m.name)),
            class: m.class.as_deref().map(|c| Str(Cow::Borrowed(c))),
            params: m.params.iter().map(t).collect(),
            buffers: m.buffers.iter().map(t).collect(),
            children: m.children.iter().map(RawModule::of).collect(),
        }
    }
}

mod dtype_serde {
    use accel_api::DType;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(d.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<DType, D::Error> {
        let s = String::deserialize(d)?;
        let t = s.trim_start_matches("torch.");
        t.parse::<DType>()
            .map_err(|e| serde::de::Error::custom(e.to_string()))
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
    meta.shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(u64::try_from(d).ok()?))?
        .checked_mul(meta.dtype.size() as u64)
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
        let mut classes: HashMap<Box<str>, Arc<str>> = HashMap::new();
        fn walk(
            l: &mut Layout,
            classes: &mut HashMap<Box<str>, Arc<str>>,
            m: RawModule<'_>,
            full: String,
            parent: Option<NodeId>,
        ) -> Result<NodeId> {
            let class = m.class.map(|c| match classes.get(&*c.0) {
                Some(a) => a.clone(),
                None => {
                    let a: Arc<str> = Arc::from(&*c.0);
                    classes.insert(Box::from(&*c.0), a.clone());
                    a
                }
            });
            let child_count = m.params.len() + m.children.len() + m.buffers.len();
            let id = l.push_with(
                full.clone(),
                class,
                NodeKind::Module,
                None,
                parent,
                child_count,
            )?;
            for p in m.params {
                let c = l.push_tensor(&full, p, NodeKind::Param, id)?;
                l.nodes[id as usize].children.push(c);
            }
            for c in m.children {
                let name = join(&full, &c.name.0);
                let cid = walk(l, classes, c, name, Some(id))?;
                l.nodes[id as usize].children.push(cid);
            }
            for b in m.buffers {
                let c = l.push_tensor(&full, b, NodeKind::Buffer, id)?;
                l.nodes[id as usize].children.push(c);
            }
            l.nodes[id as usize].end = l.nodes.len() as NodeId;
            Ok(id)
        }
        walk(&mut l, &mut classes, doc.root, String::new(), None)?;
        l.finish(&doc.tied, &Default::default())?;
        Ok(l)
    }

    fn push_tensor(
        &mut self,
        prefix: &str,
        t: RawTensor<'_>,
        kind: NodeKind,
        parent: NodeId,
    ) -> Result<NodeId> {
        let meta = TensorMeta {
            dtype: t.dtype.0,
            shape: t.shape,
        };
        let id = self.push_with(
            join(prefix, &t.name.0),
            None,
            kind,
            Some(meta),
            Some(parent),
            0,
        )?;
        self.nodes[id as usize].persistent = t.persistent;
        Ok(id)
    }

    fn empty(capacity: usize, order_inferred: bool) -> Layout {
        Layout {
            nodes: Vec::with_capacity(capacity),
            by_name: OnceLock::new(),
            hasher: DefaultHashBuilder::default(),
            tied: vec![],
            order_inferred,
        }
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
            full: String,
            parent: Option<NodeId>,
        ) -> Result<NodeId> {
            let id = l.push(full.clone(), None, NodeKind::Module, None, parent)?;
            let mut ts = std::mem::take(&mut arena[b].tensors);
            ts.sort_by(|a, c| natural_cmp(&a.0, &c.0));
            let mut ms = std::mem::take(&mut arena[b].mods);
            ms.sort_by(|a, c| {
                inferred_rank(&a.0)
                    .cmp(&inferred_rank(&c.0))
                    .then_with(|| natural_cmp(&a.0, &c.0))
            });
            for (n, m) in ts {
                let c = l.push(join(&full, &n), None, NodeKind::Param, Some(m), Some(id))?;
                l.nodes[id as usize].children.push(c);
            }
            for (n, c) in ms {
                let cid = emit(l, arena, c, join(&full, &n), Some(id))?;
                l.nodes[id as usize].children.push(cid);
            }
            l.nodes[id as usize].end = l.nodes.len() as NodeId;
            Ok(id)
        }
        emit(&mut l, &mut arena, 0, String::new(), None)?;
        l.finish(tied, &absent)?;
        Ok(l)
    }

    fn push(
        &mut self,
        name: String,
        class: Option<Arc<str>>,
        kind: NodeKind,
        meta: Option<TensorMeta>,
        parent: Option<NodeId>,
    ) -> Result<NodeId> {
        self.push_with(name, class, kind, meta, parent, 0)
    }

    fn push_with(
        &mut self,
        name: String,
        class: Option<Arc<str>>,
        kind: NodeKind,
        meta: Option<TensorMeta>,
        parent: Option<NodeId>,
        child_capacity: usize,
    ) -> Result<NodeId> {
        let id = self.nodes.len() as NodeId;
        if let Some(m) = &meta {
            if checked_bytes(m).is_none() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "tensor `{name}`: {} {:?} holds more than 2^64 bytes",
                        m.dtype.name(),
                        m.shape
                    ),
                )
                .with_fix("check the shape; no real tensor is that large"));
            }
        }
        self.nodes.push(Node {
            name,
            class,
            kind,
            meta,
            parent,
            children: Vec::with_capacity(child_capacity),
            end: id + 1,
            alias_of: None,
            persistent: true,
        });
        Ok(id)
    }

    fn index(&self) -> &HashTable<(u64, NodeId)> {
        self.by_name.get_or_init(|| {
            let mut t = HashTable::with_capacity(self.nodes.len());
            for (i, n) in self.nodes.iter().enumerate() {
                let h = self.hasher.hash_one(n.name.as_str());
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
        for (i, n) in self.nodes.iter().enumerate() {
            for (k, want) in names.iter().enumerate() {
                if n.name.len() == want.len() && n.name == *want {
                    out[k] = Some(i as NodeId);
                }
            }
        }
        out
    }

    /// Full names are unique when no local name is empty or holds a dot
    /// (PyTorch forbids both) and siblings differ.
    fn check_siblings(&self) -> Result<()> {
        let dup = |name: &str| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("`{name}` is both a module and a tensor, or appears twice"),
            )
        };
        let mut locals: Vec<&str> = vec![];
        for n in &self.nodes {
            if n.kind != NodeKind::Module || n.children.is_empty() {
                continue;
            }
            let skip = if n.name.is_empty() {
                0
            } else {
                n.name.len() + 1
            };
            locals.clear();
            for &c in &n.children {
                let full = &self.nodes[c as usize].name;
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
                        return Err(dup(&self.nodes[n.children[k] as usize].name));
                    }
                }
            } else {
                locals.sort_unstable();
                if let Some(w) = locals.windows(2).find(|w| w[0] == w[1]) {
                    return Err(dup(&join(&n.name, w[0])));
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
        let mut total = 0u64;
        for n in &self.nodes {
            if let (Some(m), None) = (&n.meta, n.alias_of) {
                total = checked_bytes(m)
                    .and_then(|b| total.checked_add(b))
                    .ok_or_else(|| {
                        Error::new(
                            ErrorKind::InvalidArgument,
                            format!(
                                "the layout's tensors hold more than 2^64 bytes in all (at `{}`)",
                                n.name
                            ),
                        )
                        .with_fix("check the shapes; no real model is that large")
                    })?;
            }
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
        let mut found = self.ids_of(&all).into_iter();
        for g in tied {
            let mut ids = Vec::with_capacity(g.len());
            for n in g {
                let id = found
                    .next()
                    .flatten()
                    .filter(|&i| self.nodes[i as usize].is_tensor())
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
                if seen.insert(i, self.tied.len()).is_some() {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "tensor `{}` is in two tied groups; merge them",
                            self.nodes[i as usize].name
                        ),
                    ));
                }
            }
            if let Some(k) = ids
                .iter()
                .position(|&i| !absent.contains(&self.nodes[i as usize].name))
            {
                let o = ids.remove(k);
                ids.insert(0, o);
            }
            let owner = ids[0];
            let om = self.nodes[owner as usize].meta.clone();
            for &i in &ids[1..] {
                if self.nodes[i as usize].meta.as_ref().map(TensorMeta::numel)
                    != om.as_ref().map(TensorMeta::numel)
                {
                    return Err(Error::new(
                        ErrorKind::InvalidArgument,
                        format!(
                            "tied tensors `{}` and `{}` have different sizes",
                            self.nodes[owner as usize].name, self.nodes[i as usize].name
                        ),
                    ));
                }
                self.nodes[i as usize].alias_of = Some(owner);
            }
            self.tied.push(ids);
        }
        Ok(())
    }

    /// Every node, in tree preorder (`nodes()[0]` is the root).
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// The id of the module or tensor named `name`.
    pub fn id(&self, name: &str) -> Option<NodeId> {
        let h = self.hasher.hash_one(name);
        self.index()
            .find(h, |&(hh, i)| hh == h && self.nodes[i as usize].name == name)
            .map(|&(_, i)| i)
    }

    /// Tied groups: the owner of the storage first, then its aliases in
    /// tree order.
    pub fn tied(&self) -> &[Vec<NodeId>] {
        &self.tied
    }

    /// Tensor ids in tree order.
    pub fn tensor_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.nodes
            .iter()
            .enumerate()
            .filter(|(_, n)| n.is_tensor())
            .map(|(i, _)| i as NodeId)
    }

    /// Number of tensors (aliases included).
    pub fn tensor_count(&self) -> usize {
        self.nodes.iter().filter(|n| n.is_tensor()).count()
    }

    /// Names of the tensors under `name` (a module or a tensor), tree order.
    pub fn tensors_under(&self, name: &str) -> Option<Vec<String>> {
        let id = self.id(name)?;
        let n = &self.nodes[id as usize];
        Some(
            self.nodes[id as usize..n.end as usize]
                .iter()
                .filter(|n| n.is_tensor())
                .map(|n| n.name.clone())
                .collect(),
        )
    }

    /// Back to the JSON form.
    pub fn to_json(&self) -> LayoutJson {
        fn build(l: &Layout, id: NodeId) -> ModuleJson {
            let n = &l.nodes[id as usize];
            let local = n.name.rsplit('.').next().unwrap_or("").to_string();
            let mut m = ModuleJson {
                name: local,
                class: n.class.as_deref().map(str::to_string),
                ..Default::default()
            };
            for &c in &n.children {
                let cn = &l.nodes[c as usize];
                let tj = || {
                    let meta = cn.meta.as_ref().expect("tensor meta");
                    TensorJson {
                        name: cn.name.rsplit('.').next().unwrap_or("").to_string(),
                        dtype: meta.dtype,
                        shape: meta.shape.clone(),
                        persistent: cn.persistent,
                    }
                };
                match cn.kind {
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
                .map(|g| {
                    g.iter()
                        .map(|&i| self.nodes[i as usize].name.clone())
                        .collect()
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests;
