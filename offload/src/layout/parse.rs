//! Reading a layout file: [`Layout::from_json_file`] and its fast path, one
//! pass over the JSON text that pushes nodes as it meets them, with no
//! intermediate tree and no allocation per node.
//!
//! The fast reader takes the documents every known producer writes (this
//! crate's [`LayoutJson`] and `tools/export_layout.py`): no escapes in
//! strings, no keys other than the format's, a module's `name` before its
//! `params` and `children`, `params` before `children` (`buffers` and
//! `class` may come anywhere). Anything else, valid or not, it hands back
//! untouched, and the file is read again through serde and the tree path,
//! which accepts any key order and words every error; so the fast reader
//! only ever changes how fast a layout loads, never which layouts load or
//! what they hold.

use super::*;

impl Layout {
    /// Read a layout JSON file.
    ///
    /// # Errors
    /// As [`Layout::from_json`], naming the file; [`ErrorKind::Io`] when it
    /// cannot be read; [`ErrorKind::InvalidArgument`] when it is not a
    /// regular file (a FIFO would block forever) or not a layout.
    pub fn from_json_file(path: &Path) -> Result<Layout> {
        let file = crate::util::open_regular(path, "layout")?;
        let len = file.metadata().map_or(0, |m| m.len());
        // A large file is mapped, every page at once: no copy of the text
        // and no page fault per 4 KiB of it. A small one is read.
        let (map, read);
        let text: &[u8] = if len >= 1 << 20 {
            map = crate::mmap::map_with(&file, path, true)?;
            &map
        } else {
            read = accel_api::files::read_at_most(file, len, path, "layout")?;
            &read
        };
        let named = |e: Error| {
            Error::new(
                e.kind().clone(),
                format!("{}: {}", path.display(), e.message()),
            )
        };
        // One UTF-8 check of the whole text instead of one per string. A
        // text that fails it goes to serde, as does anything the fast
        // reader leaves: serde skips the values of unknown keys without
        // checking them, as `from_json` on the same bytes does.
        if let Ok(utf8) = std::str::from_utf8(text) {
            if let Some(l) = Fast::read(utf8) {
                return Ok(l);
            }
        }
        let doc: RawDoc<'_> = serde_json::from_slice(text).map_err(|e| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: not a layout file: {e}", path.display()),
            )
        })?;
        Self::from_raw(doc).map_err(named)
    }
}

/// The fast reader alone: the layout of `text`, or `None` when it leaves
/// `text` to the tree path.
#[cfg(test)]
pub(super) fn read_fast(text: &str) -> Option<Layout> {
    Fast::read(text)
}

/// Modules nested deeper than this go to the tree path (serde_json's own
/// limit is 128 levels of arrays and objects, two per module).
const MAX_DEPTH: usize = 60;

/// The keys of the format.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Key {
    Format,
    Root,
    Tied,
    Name,
    Class,
    Params,
    Buffers,
    Children,
    Dtype,
    Shape,
    Persistent,
}

/// The fast reader. Every method returns `None` for "not taken here".
struct Fast<'t> {
    s: &'t [u8],
    text: &'t str,
    i: usize,
    l: Layout,
    classes: ClassIds,
    /// The current tensor's shape.
    shape: Vec<usize>,
}

impl<'t> Fast<'t> {
    /// The layout of `text`, or `None` when it is not in the fast reader's
    /// form or not a valid layout.
    fn read(text: &'t str) -> Option<Layout> {
        // About 50 bytes of JSON per node in practice.
        let mut l = Layout::empty(text.len() / 48, false);
        l.names.reserve(text.len());
        l.shapes.reserve(text.len() / 48);
        let mut f = Fast {
            s: text.as_bytes(),
            text,
            i: 0,
            l,
            classes: ClassIds::new(),
            shape: vec![],
        };
        let tied = f.doc()?;
        f.l.finish(&tied, &Default::default()).ok()?;
        Some(f.l)
    }

    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.s.get(self.i) {
            self.i += 1;
        }
    }

    /// The next byte after whitespace, not consumed.
    #[inline]
    fn peek(&mut self) -> Option<u8> {
        self.ws();
        self.s.get(self.i).copied()
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// `,` then more, or `close` then done: `Some(true)` for more.
    #[inline]
    fn more(&mut self, close: u8) -> Option<bool> {
        match self.peek()? {
            b',' => {
                self.i += 1;
                Some(true)
            }
            c if c == close => {
                self.i += 1;
                Some(false)
            }
            _ => None,
        }
    }

    /// Open `open`; `Some(true)` when the list or object is not empty.
    #[inline]
    fn open(&mut self, open: u8, close: u8) -> Option<bool> {
        self.eat(open)?;
        if self.peek()? == close {
            self.i += 1;
            return Some(false);
        }
        Some(true)
    }

    /// A string without escapes.
    #[inline]
    fn string(&mut self) -> Option<&'t str> {
        self.eat(b'"')?;
        let start = self.i;
        let n = self.s[start..]
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
        if self.s[start + n] != b'"' {
            return None;
        }
        self.i = start + n + 1;
        self.text.get(start..start + n)
    }

    /// A key of the format and its `:` (`None` for any other key, or one
    /// written with escapes).
    #[inline]
    fn key(&mut self) -> Option<Key> {
        self.eat(b'"')?;
        let rest = &self.s[self.i..];
        let (key, len) = match *rest.first()? {
            b'n' if rest.starts_with(b"name\"") => (Key::Name, 5),
            b'c' if rest.starts_with(b"class\"") => (Key::Class, 6),
            b'c' if rest.starts_with(b"children\"") => (Key::Children, 9),
            b'p' if rest.starts_with(b"params\"") => (Key::Params, 7),
            b'p' if rest.starts_with(b"persistent\"") => (Key::Persistent, 11),
            b'b' if rest.starts_with(b"buffers\"") => (Key::Buffers, 8),
            b'd' if rest.starts_with(b"dtype\"") => (Key::Dtype, 6),
            b's' if rest.starts_with(b"shape\"") => (Key::Shape, 6),
            b'f' if rest.starts_with(b"format\"") => (Key::Format, 7),
            b'r' if rest.starts_with(b"root\"") => (Key::Root, 5),
            b't' if rest.starts_with(b"tied\"") => (Key::Tied, 5),
            _ => return None,
        };
        self.i += len;
        self.eat(b':')?;
        Some(key)
    }

    #[inline]
    fn literal(&mut self, word: &[u8]) -> Option<()> {
        self.ws();
        let end = self.i + word.len();
        (self.s.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// A non-negative integer as JSON writes it (no leading zeros).
    #[inline]
    fn number(&mut self) -> Option<usize> {
        self.ws();
        let first = *self.s.get(self.i)?;
        if !first.is_ascii_digit() {
            return None;
        }
        self.i += 1;
        let mut v = usize::from(first - b'0');
        if first == b'0' {
            // A following digit fails where a `,` or `]` is expected.
            return Some(0);
        }
        while let Some(&d) = self.s.get(self.i).filter(|d| d.is_ascii_digit()) {
            v = v.checked_mul(10)?.checked_add(usize::from(d - b'0'))?;
            self.i += 1;
        }
        Some(v)
    }

    /// The whole document; its tied groups.
    fn doc(&mut self) -> Option<Vec<Vec<String>>> {
        let (mut format, mut root, mut tied) = (None, false, None);
        if self.open(b'{', b'}')? {
            loop {
                match self.key()? {
                    Key::Format if format.is_none() => format = Some(self.string()?),
                    Key::Root if !root => {
                        root = true;
                        self.module(None, 0)?;
                    }
                    Key::Tied if tied.is_none() => tied = Some(self.tied()?),
                    _ => return None,
                }
                if !self.more(b'}')? {
                    break;
                }
            }
        }
        self.ws();
        let done = self.i == self.s.len() && root && format? == LAYOUT_FORMAT;
        done.then(|| tied.unwrap_or_default())
    }

    fn tied(&mut self) -> Option<Vec<Vec<String>>> {
        let mut groups = vec![];
        if self.open(b'[', b']')? {
            loop {
                let mut g = vec![];
                if self.open(b'[', b']')? {
                    loop {
                        g.push(self.string()?.to_string());
                        if !self.more(b']')? {
                            break;
                        }
                    }
                }
                groups.push(g);
                if !self.more(b']')? {
                    break;
                }
            }
        }
        Some(groups)
    }

    /// A module object under `parent` (`None` for the root); its id.
    fn module(&mut self, parent: Option<NodeId>, depth: usize) -> Option<NodeId> {
        if depth > MAX_DEPTH {
            return None;
        }
        let mut id: Option<NodeId> = None;
        let mut class: Option<u32> = None;
        let (mut named, mut classed, mut params, mut children) = (false, false, false, false);
        let mut buffers: Option<usize> = None;
        // The root's name never enters full names, so it may come late.
        let ensure = |f: &mut Self, id: &mut Option<NodeId>, class: &mut Option<u32>| match *id {
            Some(i) => Some(i),
            None if parent.is_none() => {
                let i = f.l.push_module(None, "", class.take()).ok()?;
                *id = Some(i);
                Some(i)
            }
            None => None,
        };
        if self.open(b'{', b'}')? {
            loop {
                match self.key()? {
                    Key::Name if !named => {
                        named = true;
                        let n = self.string()?;
                        if parent.is_some() {
                            id = Some(self.l.push_module(parent, n, class.take()).ok()?);
                        }
                    }
                    Key::Class if !classed => {
                        classed = true;
                        let c = if self.peek()? == b'n' {
                            self.literal(b"null")?;
                            None
                        } else {
                            let c = self.string()?;
                            Some(self.l.intern(&mut self.classes, c))
                        };
                        match id {
                            Some(i) => self.l.recs[i as usize].class = c.unwrap_or(NONE),
                            None => class = c,
                        }
                    }
                    Key::Params if !params && !children => {
                        params = true;
                        let i = ensure(self, &mut id, &mut class)?;
                        self.tensors(Some((i, NodeKind::Param)))?;
                    }
                    Key::Children if !children => {
                        children = true;
                        let i = ensure(self, &mut id, &mut class)?;
                        if self.open(b'[', b']')? {
                            loop {
                                self.module(Some(i), depth + 1)?;
                                if !self.more(b']')? {
                                    break;
                                }
                            }
                        }
                    }
                    Key::Buffers if buffers.is_none() => {
                        ensure(self, &mut id, &mut class)?;
                        // Checked now, pushed after the children.
                        buffers = Some(self.i);
                        self.tensors(None)?;
                    }
                    _ => return None,
                }
                if !self.more(b'}')? {
                    break;
                }
            }
        }
        let i = ensure(self, &mut id, &mut class)?;
        if let Some(at) = buffers {
            let resume = std::mem::replace(&mut self.i, at);
            self.tensors(Some((i, NodeKind::Buffer)))?;
            self.i = resume;
        }
        self.l.close(i);
        Some(i)
    }

    /// A list of tensors, pushed under `to` (or only checked).
    fn tensors(&mut self, to: Option<(NodeId, NodeKind)>) -> Option<()> {
        if !self.open(b'[', b']')? {
            return Some(());
        }
        loop {
            let (mut name, mut dtype, mut shape, mut persistent) = (None, None, false, None);
            if self.open(b'{', b'}')? {
                loop {
                    match self.key()? {
                        Key::Name if name.is_none() => name = Some(self.string()?),
                        Key::Dtype if dtype.is_none() => dtype = Some(dtype_named(self.string()?)?),
                        Key::Shape if !shape => {
                            shape = true;
                            self.shape.clear();
                            if self.open(b'[', b']')? {
                                loop {
                                    let d = self.number()?;
                                    self.shape.push(d);
                                    if !self.more(b']')? {
                                        break;
                                    }
                                }
                            }
                        }
                        Key::Persistent if persistent.is_none() => {
                            persistent = Some(if self.peek()? == b't' {
                                self.literal(b"true")?;
                                true
                            } else {
                                self.literal(b"false")?;
                                false
                            });
                        }
                        _ => return None,
                    }
                    if !self.more(b'}')? {
                        break;
                    }
                }
            }
            let (name, dtype) = (name?, dtype?);
            if !shape {
                return None;
            }
            if let Some((parent, kind)) = to {
                let t = TensorIn {
                    dtype,
                    shape: &self.shape,
                    persistent: persistent.unwrap_or(true),
                };
                self.l.push_tensor(parent, name, kind, t).ok()?;
            }
            if !self.more(b']')? {
                return Some(());
            }
        }
    }
}

/// A dtype by name, as the tree path reads it ([`RawDType`]).
pub(super) fn dtype_named(v: &str) -> Option<DType> {
    // The canonical names (`DType::name`) at once; others as `FromStr`.
    Some(match v.as_bytes() {
        b"bf16" => DType::BF16,
        b"f16" => DType::F16,
        b"f32" => DType::F32,
        b"f64" => DType::F64,
        b"i8" => DType::I8,
        b"u8" => DType::U8,
        b"i32" => DType::I32,
        b"i64" => DType::I64,
        _ => return v.strip_prefix("torch.").unwrap_or(v).parse().ok(),
    })
}
