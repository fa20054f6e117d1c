//! Reading a layout file: [`Layout::from_json_file`] and its fast path, one
//! pass over the JSON text that pushes nodes as it meets them, with no
//! intermediate tree.
//!
//! It relies on the key order every known producer writes (this crate's
//! [`LayoutJson`] and `tools/export_layout.py`): a module's `name` before
//! its `params` and `children`, `params` before `children` (`buffers` and
//! `class` may come anywhere). A document in another order is valid JSON
//! all the same; the parser then reports [`OUT_OF_ORDER`] and the caller
//! reads the file again through the tree path.

use std::fmt;

use serde::de::{DeserializeSeed, Error as _, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::*;

impl Layout {
    /// Read a layout JSON file.
    ///
    /// # Errors
    /// As [`Layout::from_json`], naming the file; [`ErrorKind::Io`] when it
    /// cannot be read; [`ErrorKind::InvalidArgument`] when it is not a
    /// regular file (a FIFO would block forever) or not a layout.
    pub fn from_json_file(path: &Path) -> Result<Layout> {
        let text = crate::util::read_regular(path, "layout")?;
        let named = |e: Error| {
            Error::new(
                e.kind().clone(),
                format!("{}: {}", path.display(), e.message()),
            )
        };
        let not_layout = |e: serde_json::Error| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: not a layout file: {e}", path.display()),
            )
        };
        // Fast path: straight into nodes.
        // About 50 bytes of JSON per node in practice.
        let mut l = Layout::empty(text.len() / 48, false);
        let mut b = Builder::new(&mut l);
        // One UTF-8 check of the whole text instead of one per string.
        let Ok(utf8) = std::str::from_utf8(&text) else {
            return Err(named(Error::new(
                ErrorKind::InvalidArgument,
                "not a layout file: not UTF-8 text",
            )));
        };
        let mut de = serde_json::Deserializer::from_str(utf8);
        let res = serde::de::DeserializeSeed::deserialize(DocSeed(&mut b), &mut de)
            .and_then(|()| de.end());
        match res {
            Ok(()) => {
                let (format, tied) = (
                    b.format.take().unwrap_or_default(),
                    std::mem::take(&mut b.tied),
                );
                if format != LAYOUT_FORMAT {
                    return Err(named(Error::new(
                        ErrorKind::InvalidArgument,
                        format!("layout format `{format}`, expected `{LAYOUT_FORMAT}`"),
                    )));
                }
                l.finish(&tied, &Default::default()).map_err(named)?;
                Ok(l)
            }
            Err(_) if b.err.is_some() => Err(named(b.err.take().expect("layout error"))),
            Err(e) if e.to_string().starts_with(OUT_OF_ORDER) => {
                // Valid JSON in another key order: the tree path.
                let doc: RawDoc<'_> = serde_json::from_slice(&text).map_err(not_layout)?;
                Self::from_raw(doc).map_err(named)
            }
            Err(e) => Err(not_layout(e)),
        }
    }
}

/// Error text meaning "valid, but not in the streaming key order".
pub(super) const OUT_OF_ORDER: &str = "accel-layout: keys out of streaming order";

pub(super) struct Builder<'l> {
    pub(super) l: &'l mut Layout,
    classes: HashMap<Box<str>, Arc<str>>,
    /// A layout error (as opposed to a JSON one) met while parsing.
    pub(super) err: Option<Error>,
    pub(super) format: Option<String>,
    pub(super) tied: Vec<Vec<String>>,
}

impl<'l> Builder<'l> {
    pub(super) fn new(l: &'l mut Layout) -> Self {
        Builder {
            l,
            classes: HashMap::new(),
            err: None,
            format: None,
            tied: vec![],
        }
    }

    fn intern(&mut self, c: &str) -> Arc<str> {
        if let Some(a) = self.classes.get(c) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(c);
        self.classes.insert(Box::from(c), a.clone());
        a
    }

    fn fail<E: serde::de::Error>(&mut self, e: Error) -> E {
        self.err = Some(e);
        E::custom("layout error")
    }

    /// Push a module whose name is filled in when its object ends (the
    /// visitor keeps the name as its children's prefix until then, so it is
    /// allocated once).
    fn push_module<E: serde::de::Error>(
        &mut self,
        class: Option<Arc<str>>,
        parent: Option<NodeId>,
    ) -> Result<NodeId, E> {
        self.l
            .push_with(String::new(), class, NodeKind::Module, None, parent, 0)
            .map_err(|e| self.fail(e))
    }
}

/// The whole document.
pub(super) struct DocSeed<'b, 'l>(pub(super) &'b mut Builder<'l>);

impl<'de> DeserializeSeed<'de> for DocSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for DocSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an accel-layout/1 document")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut root = false;
        while let Some(k) = map.next_key::<Str<'de>>()? {
            match &*k.0 {
                "format" => self.0.format = Some(map.next_value::<Str<'de>>()?.0.into_owned()),
                "root" if !root => {
                    root = true;
                    map.next_value_seed(ModuleSeed {
                        b: &mut *self.0,
                        prefix: "",
                        parent: None,
                    })?;
                }
                "root" => return Err(A::Error::duplicate_field("root")),
                "tied" => self.0.tied = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        if !root {
            return Err(A::Error::missing_field("root"));
        }
        if self.0.format.is_none() {
            return Err(A::Error::missing_field("format"));
        }
        Ok(())
    }
}

/// One module; its value is the module's node id.
struct ModuleSeed<'b, 'l> {
    b: &'b mut Builder<'l>,
    /// The parent's full name.
    prefix: &'b str,
    parent: Option<NodeId>,
}

impl<'de> DeserializeSeed<'de> for ModuleSeed<'_, '_> {
    type Value = NodeId;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<NodeId, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ModuleSeed<'_, '_> {
    type Value = NodeId;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a module object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<NodeId, A::Error> {
        let b = self.b;
        let mut id: Option<NodeId> = None;
        let mut full = String::new();
        let mut class: Option<Arc<str>> = None;
        let mut buffers: Vec<RawTensor<'de>> = vec![];
        let mut children_seen = false;
        // The root's name never enters full names, so it may come late.
        macro_rules! ensure {
            () => {
                match id {
                    Some(i) => i,
                    None if self.parent.is_none() => {
                        let i = b.push_module(class.take(), None)?;
                        id = Some(i);
                        i
                    }
                    None => return Err(A::Error::custom(OUT_OF_ORDER)),
                }
            };
        }
        while let Some(k) = map.next_key::<Str<'de>>()? {
            match &*k.0 {
                "name" => {
                    let n = map.next_value::<Str<'de>>()?;
                    if self.parent.is_some() {
                        if id.is_some() {
                            return Err(A::Error::custom(OUT_OF_ORDER));
                        }
                        full = join(self.prefix, &n.0);
                        id = Some(b.push_module(class.take(), self.parent)?);
                    }
                }
                "class" => {
                    let c = map
                        .next_value::<Option<Str<'de>>>()?
                        .map(|c| b.intern(&c.0));
                    match id {
                        Some(i) => b.l.nodes[i as usize].class = c,
                        None => class = c,
                    }
                }
                "params" => {
                    let i = ensure!();
                    if children_seen {
                        return Err(A::Error::custom(OUT_OF_ORDER));
                    }
                    map.next_value_seed(TensorsSeed {
                        b: &mut *b,
                        prefix: &full,
                        parent: i,
                    })?;
                }
                "children" => {
                    let i = ensure!();
                    children_seen = true;
                    map.next_value_seed(ChildrenSeed {
                        b: &mut *b,
                        prefix: &full,
                        parent: i,
                    })?;
                }
                "buffers" => {
                    ensure!();
                    buffers.extend(map.next_value::<Vec<RawTensor<'de>>>()?);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let i = match id {
            Some(i) => i,
            None if self.parent.is_none() => b.push_module(class.take(), None)?,
            None => return Err(A::Error::custom(OUT_OF_ORDER)),
        };
        for t in buffers {
            let c =
                b.l.push_tensor(&full, t, NodeKind::Buffer, i)
                    .map_err(|e| b.fail::<A::Error>(e))?;
            b.l.nodes[i as usize].children.push(c);
        }
        let end = b.l.nodes.len() as NodeId;
        let node = &mut b.l.nodes[i as usize];
        node.end = end;
        node.name = full;
        Ok(i)
    }
}

/// A module's `params` list.
struct TensorsSeed<'b, 'l> {
    b: &'b mut Builder<'l>,
    prefix: &'b str,
    parent: NodeId,
}

impl<'de> DeserializeSeed<'de> for TensorsSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for TensorsSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of tensors")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(t) = seq.next_element::<RawTensor<'de>>()? {
            let c = self
                .b
                .l
                .push_tensor(self.prefix, t, NodeKind::Param, self.parent)
                .map_err(|e| self.b.fail::<A::Error>(e))?;
            self.b.l.nodes[self.parent as usize].children.push(c);
        }
        Ok(())
    }
}

/// A module's `children` list.
struct ChildrenSeed<'b, 'l> {
    b: &'b mut Builder<'l>,
    prefix: &'b str,
    parent: NodeId,
}

impl<'de> DeserializeSeed<'de> for ChildrenSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for ChildrenSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of modules")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(c) = seq.next_element_seed(ModuleSeed {
            b: &mut *self.b,
            prefix: self.prefix,
            parent: Some(self.parent),
        })? {
            self.b.l.nodes[self.parent as usize].children.push(c);
        }
        Ok(())
    }
}
