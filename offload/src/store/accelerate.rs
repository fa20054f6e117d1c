use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use accel_api::{DType, Error, ErrorKind, OffloadStore, Result, TensorMeta};
use memmap2::Mmap;

use crate::arena::Arena;
use crate::safetensors::SafetensorsFile;
use accel_api::durable::write_atomic;

/// numpy's spelling of `d` in Accelerate's `index.json` (bf16 is written
/// `bfloat16` and its bytes stored as int16, which numpy lacks).
fn np_name(d: DType) -> &'static str {
    match d {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::I32 => "int32",
        DType::I64 => "int64",
        _ => "unknown",
    }
}

fn from_np(s: &str) -> Option<DType> {
    Some(match s.trim_start_matches("torch.") {
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        "float32" => DType::F32,
        "float64" => DType::F64,
        "int8" => DType::I8,
        "uint8" => DType::U8,
        "int32" => DType::I32,
        "int64" => DType::I64,
        _ => return None,
    })
}

/// One `index.json` entry, as Accelerate writes it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct IndexEntry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    #[serde(default)]
    shape: Vec<usize>,
    /// Entries pointing into an existing safetensors file instead of a
    /// `.dat` file (Accelerate's `OffloadedWeightsLoader` accepts these).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    safetensors_file: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    weight_name: Option<String>,
}

#[derive(Debug)]
enum Data {
    Dat {
        path: PathBuf,
        map: OnceLock<Mmap>,
    },
    St {
        file: OnceLock<Arc<SafetensorsFile>>,
        path: PathBuf,
        weight: String,
    },
}

#[derive(Debug)]
struct Slot {
    meta: TensorMeta,
    entry: IndexEntry,
    data: Data,
}

/// The file a `safetensors_file` entry names: a plain name inside the
/// folder, or an absolute path (what `transformers` writes: the checkpoint
/// shard in its cache). Either way a regular file; a relative name that
/// leaves the folder (`../x`) is refused.
fn safetensors_path(dir: &Path, name: &str) -> Result<PathBuf> {
    if Path::new(name).is_absolute() {
        accel_api::files::check_regular(Path::new(name), "offloaded safetensors file")?;
        return Ok(PathBuf::from(name));
    }
    accel_api::files::resolve_inside(dir, name, "offloaded safetensors file")
}

/// Read/write compatibility with Accelerate's offload folder
/// (`offload_state_dict` / `OffloadedWeightsLoader`): an `index.json`
/// mapping each name to `{"dtype": "<numpy name>", "shape": [...]}` and one
/// raw little-endian file `<name>.dat` per tensor (a 0-d tensor is stored
/// as one element; bf16 is indexed as `bfloat16` and stored as int16 bytes).
/// Entries of the form `{"safetensors_file": ..., "weight_name": ...}` are
/// served from that file.
///
/// Files are mapped lazily on first `get` and checked against the index
/// (a wrong size is [`ErrorKind::Corrupt`] naming file and tensor). `put`
/// writes the `.dat` file atomically; the index is rewritten (atomically)
/// by [`AccelerateFolder::flush`] and on drop, not on every `put`, so
/// writing n tensors costs O(n), not O(n²).
#[derive(Debug)]
pub struct AccelerateFolder {
    dir: PathBuf,
    slots: Arena<Slot>,
    index: RwLock<BTreeMap<String, usize>>,
    dirty: Mutex<bool>,
}

impl AccelerateFolder {
    /// Open (or create) the folder `dir`, reading `index.json` if present.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for an unreadable index;
    /// [`ErrorKind::Unsupported`] for a dtype accel does not carry.
    pub fn open(dir: &Path) -> Result<AccelerateFolder> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
        let s = AccelerateFolder {
            dir: dir.to_path_buf(),
            slots: Arena::default(),
            index: RwLock::new(BTreeMap::new()),
            dirty: Mutex::new(false),
        };
        let ip = dir.join("index.json");
        if ip.exists() {
            let text = crate::util::read_regular(&ip, "offload index")?;
            let raw: BTreeMap<String, IndexEntry> = serde_json::from_slice(&text).map_err(|e| {
                Error::new(
                    ErrorKind::Corrupt,
                    format!("{}: not an offload index: {e}", ip.display()),
                )
            })?;
            let mut idx = s.index.write().expect("offload folder lock");
            for (name, entry) in raw {
                let slot = s.slot_for(&name, entry)?;
                idx.insert(name, s.slots.push(slot));
            }
        }
        Ok(s)
    }

    fn slot_for(&self, name: &str, entry: IndexEntry) -> Result<Slot> {
        let unsupported = |d: &str| {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: tensor `{name}` has dtype {d} which accel-offload does not carry",
                    self.dir.display()
                ),
            )
        };
        if let Some(f) = &entry.safetensors_file {
            let path = safetensors_path(&self.dir, f)?;
            let weight = entry
                .weight_name
                .clone()
                .unwrap_or_else(|| name.to_string());
            let file = Arc::new(SafetensorsFile::open(&path)?);
            let (e, _) = file.tensor(&weight)?;
            let mut meta = e.meta.clone();
            if let Some(d) = &entry.dtype {
                let want = from_np(d).ok_or_else(|| unsupported(d))?;
                if want != meta.dtype {
                    return Err(Error::new(
                        ErrorKind::Unsupported,
                        format!(
                            "{}: tensor `{name}` asks for a cast {} -> {d}; re-offload it as {d}",
                            path.display(),
                            meta.dtype
                        ),
                    ));
                }
                meta.dtype = want;
            }
            let cell = OnceLock::new();
            let _ = cell.set(file);
            return Ok(Slot {
                meta,
                entry,
                data: Data::St {
                    file: cell,
                    path,
                    weight,
                },
            });
        }
        let d = entry.dtype.as_deref().unwrap_or("float32");
        let dtype = from_np(d).ok_or_else(|| unsupported(d))?;
        let meta = TensorMeta {
            dtype,
            shape: entry.shape.clone(),
        };
        let path = self.dir.join(format!("{name}.dat"));
        Ok(Slot {
            meta,
            entry,
            data: Data::Dat {
                path,
                map: OnceLock::new(),
            },
        })
    }

    fn slot(&self, name: &str) -> Result<&Slot> {
        let i = self
            .index
            .read()
            .expect("offload folder lock")
            .get(name)
            .copied();
        i.and_then(|i| self.slots.get(i))
            .ok_or_else(|| super::missing(&format!("offload folder {}", self.dir.display()), name))
    }

    /// Write `index.json` atomically if tensors were added since the last
    /// flush. Entries already in the file are kept (as Accelerate's
    /// `save_offload_index` merges).
    pub fn flush(&self) -> Result<()> {
        let mut dirty = self.dirty.lock().expect("offload folder lock");
        if !*dirty {
            return Ok(());
        }
        let idx = self.index.read().expect("offload folder lock");
        let out: BTreeMap<&str, &IndexEntry> = idx
            .iter()
            .filter_map(|(n, &i)| self.slots.get(i).map(|s| (n.as_str(), &s.entry)))
            .collect();
        write_atomic(&self.dir.join("index.json"), |w| {
            serde_json::to_writer_pretty(&mut *w, &out).map_err(std::io::Error::other)?;
            w.write_all(b"\n")
        })?;
        *dirty = false;
        Ok(())
    }
}

impl Drop for AccelerateFolder {
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

impl OffloadStore for AccelerateFolder {
    fn get(&self, name: &str) -> Result<Cow<'_, [u8]>> {
        let slot = self.slot(name)?;
        match &slot.data {
            Data::St { file, path, weight } => {
                let f = file.get().ok_or_else(|| {
                    Error::new(ErrorKind::Io, format!("{}: not mapped", path.display()))
                })?;
                Ok(Cow::Borrowed(f.tensor(weight)?.1))
            }
            Data::Dat { path, map } => {
                if map.get().is_none() {
                    let dat = format!("{name}.dat");
                    let (_, f) = accel_api::files::open_inside(&self.dir, &dat, "offload file")
                        .map_err(|e| {
                            // A file the index lists but the folder lacks.
                            let kind = match e.kind() {
                                ErrorKind::Io => ErrorKind::Corrupt,
                                k => k.clone(),
                            };
                            Error::new(kind, format!("tensor `{name}`: {e}"))
                        })?;
                    let m = crate::mmap::map_readonly(&f, path)?;
                    // A 0-d tensor is stored as one element.
                    let want = slot
                        .meta
                        .checked_numel()
                        .and_then(|n| n.max(1).checked_mul(slot.meta.dtype.size()))
                        .unwrap_or(usize::MAX);
                    if m.len() != want {
                        return Err(Error::new(
                            ErrorKind::Corrupt,
                            format!(
                                "{}: tensor `{name}`: file holds {} bytes but index.json says {} {:?} ({want} bytes){}",
                                path.display(),
                                m.len(),
                                slot.entry.dtype.as_deref().unwrap_or("float32"),
                                slot.meta.shape,
                                if m.len() < want { "; truncated" } else { "" }
                            ),
                        ));
                    }
                    let _ = map.set(m);
                }
                let m = map.get().expect("mapped above");
                // The length was checked against the shape when mapped.
                let len = slot.meta.checked_byte_len().unwrap_or(m.len()).min(m.len());
                Ok(Cow::Borrowed(&m[..len]))
            }
        }
    }

    fn put(&self, name: &str, meta: TensorMeta, data: &[u8]) -> Result<()> {
        super::check_len("offload folder", name, &meta, data)?;
        if name.contains('/') || name.contains('\0') || name.starts_with('.') {
            return Err(Error::invalid_argument(
                "offload folder put",
                format!(
                    "tensor `{name}` cannot be a file name in Accelerate's layout (`<name>.dat`)"
                ),
            ));
        }
        let path = self.dir.join(format!("{name}.dat"));
        write_atomic(&path, |w| {
            if data.is_empty() {
                w.write_all(&vec![0u8; meta.dtype.size()])
            } else {
                w.write_all(data)
            }
        })?;
        let entry = IndexEntry {
            dtype: Some(np_name(meta.dtype).to_string()),
            shape: meta.shape.clone(),
            safetensors_file: None,
            weight_name: None,
        };
        let slot = Slot {
            meta,
            entry,
            data: Data::Dat {
                path,
                map: OnceLock::new(),
            },
        };
        let i = self.slots.push(slot);
        self.index
            .write()
            .expect("offload folder lock")
            .insert(name.to_string(), i);
        *self.dirty.lock().expect("offload folder lock") = true;
        Ok(())
    }

    fn contains(&self, name: &str) -> bool {
        self.index
            .read()
            .expect("offload folder lock")
            .contains_key(name)
    }

    fn keys(&self) -> Vec<String> {
        self.index
            .read()
            .expect("offload folder lock")
            .keys()
            .cloned()
            .collect()
    }

    fn meta(&self, name: &str) -> Result<TensorMeta> {
        Ok(self.slot(name)?.meta.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_folder_written_the_way_accelerate_writes_it() {
        let d = tempfile::tempdir().unwrap();
        // What offload_state_dict writes for a bf16 weight, an f32 bias and
        // a 0-d int64 counter.
        std::fs::write(
            d.path().join("index.json"),
            r#"{
  "h.0.w": {"dtype": "bfloat16", "shape": [2, 2]},
  "h.0.b": {"dtype": "float32", "shape": [3]},
  "steps": {"dtype": "int64", "shape": []}
}"#,
        )
        .unwrap();
        let w: Vec<u8> = half::bf16::from_f32(1.5).to_le_bytes().repeat(4);
        std::fs::write(d.path().join("h.0.w.dat"), &w).unwrap();
        let b: Vec<u8> = [1.0f32, 2.0, 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        std::fs::write(d.path().join("h.0.b.dat"), &b).unwrap();
        std::fs::write(d.path().join("steps.dat"), 7i64.to_le_bytes()).unwrap();
        let s = AccelerateFolder::open(d.path()).unwrap();
        assert_eq!(
            s.meta("h.0.w").unwrap(),
            TensorMeta {
                dtype: DType::BF16,
                shape: vec![2, 2]
            }
        );
        assert_eq!(s.get("h.0.w").unwrap().as_ref(), &w[..]);
        assert_eq!(s.get("h.0.b").unwrap().as_ref(), &b[..]);
        assert_eq!(s.get("steps").unwrap().as_ref(), &7i64.to_le_bytes());
        // Truncated .dat file.
        std::fs::write(d.path().join("h.0.b.dat"), &b[..8]).unwrap();
        let s = AccelerateFolder::open(d.path()).unwrap();
        let e = s.get("h.0.b").unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Corrupt);
        let m = e.to_string();
        assert!(
            m.contains("h.0.b.dat") && m.contains("`h.0.b`") && m.contains("truncated"),
            "{m}"
        );
        // Missing .dat file.
        std::fs::remove_file(d.path().join("steps.dat")).unwrap();
        let m = s.get("steps").unwrap_err().to_string();
        assert!(m.contains("steps.dat") && m.contains("`steps`"), "{m}");
    }

    #[test]
    fn writes_a_folder_accelerate_can_read() {
        let d = tempfile::tempdir().unwrap();
        {
            let s = AccelerateFolder::open(d.path()).unwrap();
            super::super::conformance::check(&s);
        }
        let idx: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join("index.json")).unwrap()).unwrap();
        assert_eq!(
            idx["layers.0.w"],
            serde_json::json!({"dtype": "float32", "shape": [2, 2]})
        );
        assert_eq!(
            std::fs::read(d.path().join("layers.0.w.dat")).unwrap(),
            (100..116).collect::<Vec<u8>>()
        );
        let s = AccelerateFolder::open(d.path()).unwrap();
        s.put(
            "e",
            TensorMeta {
                dtype: DType::BF16,
                shape: vec![1],
            },
            &[1, 2],
        )
        .unwrap();
        s.flush().unwrap();
        let idx: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.path().join("index.json")).unwrap()).unwrap();
        assert_eq!(idx["e"]["dtype"], "bfloat16");
        assert_eq!(idx["layers.0.w"]["shape"], serde_json::json!([2, 2]));
    }

    #[test]
    fn safetensors_entries_are_served_in_place() {
        let d = tempfile::tempdir().unwrap();
        let m = TensorMeta {
            dtype: DType::F32,
            shape: vec![2],
        };
        crate::safetensors::write_file(
            &d.path().join("model.safetensors"),
            [("orig.w", &m, &[5u8; 8][..])],
        )
        .unwrap();
        std::fs::write(
            d.path().join("index.json"),
            r#"{"a.w": {"safetensors_file": "model.safetensors", "weight_name": "orig.w", "dtype": "float32"}}"#,
        )
        .unwrap();
        let s = AccelerateFolder::open(d.path()).unwrap();
        assert_eq!(s.get("a.w").unwrap().as_ref(), &[5u8; 8]);
        assert_eq!(s.meta("a.w").unwrap(), m);
    }
}
