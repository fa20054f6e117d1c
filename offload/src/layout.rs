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
//! * `tied` lists groups of full tensor names sharing one storage. The first
//!   member in tree order owns the bytes (for a layout built from a
//!   checkpoint: the first member the checkpoint stores); the others are aliases that cost
//!   nothing and are never stored twice (Accelerate counts them the same way,
//!   because `named_parameters()` drops duplicates).
//!
//! In tree order, a module's entries come as: its own parameters, its child
//! modules, its own buffers (Accelerate's order for the root).

use std::collections::HashMap;
use std::path::Path;

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use serde::{Deserialize, Serialize};

use crate::safetensors::Checkpoint;
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
    /// Class name of a module, when known.
    pub class: Option<String>,
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
}

impl Node {
    /// `true` for parameters and buffers.
    pub fn is_tensor(&self) -> bool {
        self.kind != NodeKind::Module
    }
}

/// An ordered module tree (see the [module docs](self) for the JSON format).
#[derive(Debug, Clone)]
pub struct Layout {
    nodes: Vec<Node>,
    by_name: HashMap<String, NodeId>,
    tied: Vec<Vec<NodeId>>,
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
        format!("{prefix}.{local}")
    }
}

impl Layout {
    /// Build from a [`LayoutJson`] document.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a wrong format tag, duplicate
    /// names, or tied names that are not tensors of the tree.
    pub fn from_json(doc: &LayoutJson) -> Result<Layout> {
        if doc.format != LAYOUT_FORMAT {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("layout format `{}`, expected `{LAYOUT_FORMAT}`", doc.format),
            ));
        }
        let mut l = Layout {
            nodes: vec![],
            by_name: HashMap::new(),
            tied: vec![],
        };
        fn walk(
            l: &mut Layout,
            m: &ModuleJson,
            full: String,
            parent: Option<NodeId>,
        ) -> Result<NodeId> {
            let id = l.push(
                full.clone(),
                m.class.clone(),
                NodeKind::Module,
                None,
                parent,
            )?;
            for p in &m.params {
                let meta = TensorMeta {
                    dtype: p.dtype,
                    shape: p.shape.clone(),
                };
                let c = l.push(
                    join(&full, &p.name),
                    None,
                    NodeKind::Param,
                    Some(meta),
                    Some(id),
                )?;
                l.nodes[id as usize].children.push(c);
            }
            for c in &m.children {
                let cid = walk(l, c, join(&full, &c.name), Some(id))?;
                l.nodes[id as usize].children.push(cid);
            }
            for b in &m.buffers {
                let meta = TensorMeta {
                    dtype: b.dtype,
                    shape: b.shape.clone(),
                };
                let c = l.push(
                    join(&full, &b.name),
                    None,
                    NodeKind::Buffer,
                    Some(meta),
                    Some(id),
                )?;
                l.nodes[id as usize].children.push(c);
            }
            l.nodes[id as usize].end = l.nodes.len() as NodeId;
            Ok(id)
        }
        walk(&mut l, &doc.root, String::new(), None)?;
        l.set_tied(&doc.tied, &Default::default())?;
        Ok(l)
    }

    /// Read a layout JSON file.
    pub fn from_json_file(path: &Path) -> Result<Layout> {
        let text =
            std::fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        let doc: LayoutJson = serde_json::from_slice(&text).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: not a layout file: {e}", path.display()),
            )
        })?;
        Self::from_json(&doc).map_err(|e| {
            Error::new(
                e.kind().clone(),
                format!("{}: {}", path.display(), e.message()),
            )
        })
    }

    /// Build from a checkpoint's headers: the tree from the dotted names,
    /// siblings in natural order (`layers.2` before `layers.10`, tensors
    /// before child modules), class names unknown, every tensor a parameter.
    pub fn from_checkpoint(ck: &Checkpoint, tied: &[Vec<String>]) -> Result<Layout> {
        Self::from_tensors(ck.iter().map(|(n, m)| (n.to_string(), m.clone())), tied)
    }

    /// Build from (full name, meta) pairs as [`Layout::from_checkpoint`] does.
    /// A tied-group member absent from `tensors` is added as an alias with
    /// its owner's meta (checkpoints store tied weights once).
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
        let mut l = Layout {
            nodes: Vec::with_capacity(metas.len() * 3 / 2 + 1),
            by_name: HashMap::new(),
            tied: vec![],
        };
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
            ms.sort_by(|a, c| natural_cmp(&a.0, &c.0));
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
        l.set_tied(tied, &absent)?;
        Ok(l)
    }

    fn push(
        &mut self,
        name: String,
        class: Option<String>,
        kind: NodeKind,
        meta: Option<TensorMeta>,
        parent: Option<NodeId>,
    ) -> Result<NodeId> {
        let id = self.nodes.len() as NodeId;
        if self.by_name.insert(name.clone(), id).is_some() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("`{name}` is both a module and a tensor, or appears twice"),
            ));
        }
        self.nodes.push(Node {
            name,
            class,
            kind,
            meta,
            parent,
            children: vec![],
            end: id + 1,
            alias_of: None,
        });
        Ok(id)
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
        for g in tied {
            let mut ids = Vec::with_capacity(g.len());
            for n in g {
                let id = self
                    .id(n)
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
        self.by_name.get(name).copied()
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
                class: n.class.clone(),
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
mod tests {
    use super::*;

    fn m(shape: &[usize]) -> TensorMeta {
        TensorMeta {
            dtype: DType::F32,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn tree_from_names_orders_numbers_numerically() {
        let names = [
            "model.layers.10.w",
            "model.layers.2.w",
            "lm_head.weight",
            "model.embed.weight",
            "model.layers.2.b",
        ];
        let l = Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[2]))), &[]).unwrap();
        let order: Vec<&str> = l.nodes().iter().map(|n| n.name.as_str()).collect();
        assert_eq!(
            order,
            [
                "",
                "lm_head",
                "lm_head.weight",
                "model",
                "model.embed",
                "model.embed.weight",
                "model.layers",
                "model.layers.2",
                "model.layers.2.b",
                "model.layers.2.w",
                "model.layers.10",
                "model.layers.10.w"
            ]
        );
        let layers = l.id("model.layers").unwrap();
        assert_eq!(l.node(layers).end as usize, l.nodes().len());
        assert_eq!(l.tensors_under("model.layers").unwrap().len(), 3);
    }

    #[test]
    fn tied_alias_added_when_checkpoint_stores_it_once() {
        let names = ["embed.weight", "body.w"];
        let tied = vec![vec!["embed.weight".to_string(), "head.weight".to_string()]];
        let l =
            Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[4, 2]))), &tied).unwrap();
        let head = l.id("head.weight").unwrap();
        let embed = l.id("embed.weight").unwrap();
        assert_eq!(l.node(head).alias_of, Some(embed));
        // The stored member owns the storage even when it sorts later.
        let names = ["z.weight", "body.w"];
        let tied = vec![vec!["z.weight".to_string(), "a.weight".to_string()]];
        let l2 =
            Layout::from_tensors(names.iter().map(|n| (n.to_string(), m(&[4, 2]))), &tied).unwrap();
        assert_eq!(
            l2.node(l2.id("a.weight").unwrap()).alias_of,
            l2.id("z.weight")
        );
        assert_eq!(l.tied(), &[vec![embed, head]]);
    }

    #[test]
    fn json_round_trip_and_errors() {
        let text = r#"{"format":"accel-layout/1","root":{"name":"","class":"Net","children":[
            {"name":"a","class":"Linear","params":[{"name":"weight","dtype":"float16","shape":[3,3]}],
             "buffers":[{"name":"scale","dtype":"f32","shape":[]}]},
            {"name":"b","class":"Linear","params":[{"name":"weight","dtype":"f16","shape":[3,3]}]}]},
            "tied":[["a.weight","b.weight"]]}"#;
        let doc: LayoutJson = serde_json::from_str(text).unwrap();
        let l = Layout::from_json(&doc).unwrap();
        assert_eq!(l.node(l.id("a").unwrap()).class.as_deref(), Some("Linear"));
        assert_eq!(l.node(l.id("a.scale").unwrap()).kind, NodeKind::Buffer);
        assert_eq!(l.tied().len(), 1);
        let back = Layout::from_json(&l.to_json()).unwrap();
        assert_eq!(back.nodes().len(), l.nodes().len());
        let mut bad = doc.clone();
        bad.tied = vec![vec!["a.weight".into(), "nope".into()]];
        assert!(Layout::from_json(&bad)
            .unwrap_err()
            .to_string()
            .contains("nope"));
        assert!(Layout::from_tensors(
            [("a".to_string(), m(&[1])), ("a.b".to_string(), m(&[1]))],
            &[]
        )
        .is_err());
    }
}
