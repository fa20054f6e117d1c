//! safetensors files: header parsing with validation, memory-mapped
//! tensor access, writing, and sharded checkpoints
//! (`model.safetensors.index.json`).
//!
//! Format: 8 bytes little-endian header length `N`, `N` bytes of JSON
//! (`{"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, "__metadata__": {..}}`),
//! then the data; offsets are relative to the start of the data.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

use accel_api::{DType, Error, ErrorKind, Result, TensorMeta};
use memmap2::Mmap;

use accel_api::durable::write_atomic;

/// Upper bound on a header, as in the reference implementation (100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// The safetensors spelling of `d`.
pub fn dtype_to_st(d: DType) -> &'static str {
    match d {
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::I8 => "I8",
        DType::U8 => "U8",
        DType::I32 => "I32",
        DType::I64 => "I64",
        _ => "UNKNOWN",
    }
}

/// The [`DType`] of a safetensors spelling; `None` for types accel does
/// not carry (BOOL, I16, F8_*, ...).
pub fn dtype_from_st(s: &str) -> Option<DType> {
    Some(match s {
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F32" => DType::F32,
        "F64" => DType::F64,
        "I8" => DType::I8,
        "U8" => DType::U8,
        "I32" => DType::I32,
        "I64" => DType::I64,
        _ => return None,
    })
}

/// One tensor in a safetensors file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// Full dotted name.
    pub name: String,
    /// Element type and shape.
    pub meta: TensorMeta,
    /// Byte offset of the data from the start of the file.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
}

fn corrupt(path: &Path, msg: impl std::fmt::Display) -> Error {
    Error::new(ErrorKind::Corrupt, format!("{}: {msg}", path.display()))
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// Parse and validate a header. `file_len` is the size of the whole file.
/// Entries come back in data order.
pub fn parse_header(path: &Path, header: &[u8], file_len: u64) -> Result<Vec<TensorEntry>> {
    let data_start = 8 + header.len() as u64;
    let data_len = file_len.checked_sub(data_start).ok_or_else(|| {
        corrupt(
            path,
            format!(
                "truncated: header of {} bytes but file is {file_len} bytes",
                header.len()
            ),
        )
    })?;
    let raw: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header)
        .map_err(|e| corrupt(path, format!("header is not valid safetensors JSON: {e}")))?;
    let mut out = Vec::with_capacity(raw.len());
    for (name, v) in raw {
        if name == "__metadata__" {
            continue;
        }
        let e: RawEntry = serde_json::from_value(v)
            .map_err(|e| corrupt(path, format!("tensor `{name}`: bad header entry: {e}")))?;
        let dtype = dtype_from_st(&e.dtype).ok_or_else(|| {
            Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{}: tensor `{name}` has dtype {} which accel-offload does not carry",
                    path.display(),
                    e.dtype
                ),
            )
        })?;
        let numel = e.shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let want = numel.and_then(|n| n.checked_mul(dtype.size() as u64));
        let [b, end] = e.data_offsets;
        let Some(want) = want else {
            return Err(corrupt(
                path,
                format!("tensor `{name}`: shape {:?} overflows", e.shape),
            ));
        };
        if end < b || end - b != want {
            return Err(corrupt(
                path,
                format!(
                    "tensor `{name}`: header lies about its size: data_offsets [{b}, {end}] hold {} bytes but {} {:?} needs {want}",
                    end.saturating_sub(b),
                    e.dtype,
                    e.shape
                ),
            ));
        }
        if end > data_len {
            return Err(corrupt(
                path,
                format!("tensor `{name}`: truncated: data ends at byte {end} but the file holds {data_len} bytes of data"),
            ));
        }
        out.push(TensorEntry {
            name,
            meta: TensorMeta {
                dtype,
                shape: e.shape.iter().map(|&d| d as usize).collect(),
            },
            start: data_start + b,
            len: want,
        });
    }
    out.sort_by_key(|e| e.start);
    // Empty tensors occupy no bytes: compare each non-empty tensor with the
    // previous non-empty one, wherever empty ones sort between them.
    let mut prev: Option<&TensorEntry> = None;
    for e in out.iter().filter(|e| e.len > 0) {
        if let Some(p) = prev {
            if p.start + p.len > e.start {
                return Err(corrupt(
                    path,
                    format!("tensors `{}` and `{}` overlap", p.name, e.name),
                ));
            }
        }
        prev = Some(e);
    }
    Ok(out)
}

/// Read just the header of a safetensors file (no mapping).
pub fn read_header(path: &Path) -> Result<Vec<TensorEntry>> {
    use std::io::Read;
    let mut f = crate::util::open_regular(path, "checkpoint shard")?;
    let file_len = f
        .metadata()
        .map_err(|e| Error::io(format!("stat {}", path.display()), e))?
        .len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| {
        corrupt(
            path,
            format!("truncated: {file_len} bytes, no header length"),
        )
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n + 8 > file_len {
        return Err(corrupt(
            path,
            format!("truncated or not safetensors: header length {n} but file is {file_len} bytes"),
        ));
    }
    let mut h = vec![0u8; n as usize];
    f.read_exact(&mut h)
        .map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    parse_header(path, &h, file_len)
}

/// A memory-mapped safetensors file: zero-copy access to its tensors.
#[derive(Debug)]
pub struct SafetensorsFile {
    path: PathBuf,
    /// Kept open for [`SafetensorsFile::read_into`].
    file: std::fs::File,
    map: Mmap,
    entries: Vec<TensorEntry>,
    by_name: HashMap<String, usize>,
}

impl SafetensorsFile {
    /// Map and validate `path`.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] for a truncated file or a header that lies
    /// about sizes (naming file and tensor); [`ErrorKind::Io`].
    pub fn open(path: &Path) -> Result<SafetensorsFile> {
        Self::open_with(path, false)
    }

    /// [`SafetensorsFile::open`], reading the whole file in at map time
    /// when `populate` is set (for loaders that scan every byte).
    pub fn open_with(path: &Path, populate: bool) -> Result<SafetensorsFile> {
        let f = crate::util::open_regular(path, "checkpoint shard")?;
        let map = crate::mmap::map_with(&f, path, populate)?;
        let file_len = map.len() as u64;
        if file_len < 8 {
            return Err(corrupt(
                path,
                format!("truncated: {file_len} bytes, no header length"),
            ));
        }
        let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
        if n > MAX_HEADER || n + 8 > file_len {
            return Err(corrupt(
                path,
                format!(
                    "truncated or not safetensors: header length {n} but file is {file_len} bytes"
                ),
            ));
        }
        let entries = parse_header(path, &map[8..8 + n as usize], file_len)?;
        let by_name = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        Ok(SafetensorsFile {
            path: path.to_path_buf(),
            file: f,
            map,
            entries,
            by_name,
        })
    }

    /// Hint the kernel that the file will be read front to back.
    pub fn advise_sequential(&self) {
        let _ = self.map.advise(memmap2::Advice::Sequential);
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensors in data order.
    pub fn entries(&self) -> &[TensorEntry] {
        &self.entries
    }

    /// The entry for `name`.
    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }

    /// The bytes of `e` (an entry of this file).
    pub fn data(&self, e: &TensorEntry) -> &[u8] {
        &self.map[e.start as usize..(e.start + e.len) as usize]
    }

    /// Copy the bytes of `e` (an entry of this file) into `out` with
    /// positioned reads (`pread`), not through the mapping: the copy is the
    /// only memory the bytes take, and no page of the mapping becomes
    /// resident in this process (what a loader wants when the resident set
    /// must stay under a budget).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] when `out` is not `e.len` bytes long;
    /// [`ErrorKind::Io`] naming the file and tensor when the read fails or
    /// the file has shrunk.
    pub fn read_into(&self, e: &TensorEntry, out: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        if out.len() as u64 != e.len {
            return Err(Error::invalid_argument(
                "SafetensorsFile::read_into",
                format!(
                    "{}: tensor `{}` is {} bytes but the buffer has {}",
                    self.path.display(),
                    e.name,
                    e.len,
                    out.len()
                ),
            ));
        }
        self.file.read_exact_at(out, e.start).map_err(|err| {
            Error::io(
                format!("read `{}` from {}", e.name, self.path.display()),
                err,
            )
        })
    }

    /// The bytes of `name`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming file and tensor when absent.
    pub fn tensor(&self, name: &str) -> Result<(&TensorEntry, &[u8])> {
        let e = self.entry(name).ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidArgument,
                format!("{}: no tensor `{name}`", self.path.display()),
            )
        })?;
        Ok((e, self.data(e)))
    }
}

/// Write a safetensors file atomically with `tensors` in the given order.
pub fn write_file<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (&'a str, &'a TensorMeta, &'a [u8])>,
) -> Result<()> {
    let tensors: Vec<_> = tensors.into_iter().collect();
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (name, meta, data) in &tensors {
        if data.len() != meta.byte_len() {
            return Err(Error::invalid_argument(
                "safetensors write",
                format!(
                    "tensor `{name}`: {} bytes given, {:?} {:?} needs {}",
                    data.len(),
                    meta.dtype,
                    meta.shape,
                    meta.byte_len()
                ),
            ));
        }
        header.insert(
            (*name).to_string(),
            serde_json::json!({
                "dtype": dtype_to_st(meta.dtype),
                "shape": meta.shape,
                "data_offsets": [off, off + data.len() as u64],
            }),
        );
        off += data.len() as u64;
    }
    let mut h = serde_json::to_vec(&header).expect("json");
    let pad = (8 - h.len() % 8) % 8;
    h.resize(h.len() + pad, b' ');
    write_atomic(path, |w| {
        w.write_all(&(h.len() as u64).to_le_bytes())?;
        w.write_all(&h)?;
        for (_, _, d) in &tensors {
            w.write_all(d)?;
        }
        Ok(())
    })
}

/// Name of the shard index file Hugging Face writes.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A checkpoint: one safetensors file, or shards listed by
/// `model.safetensors.index.json`. Only headers are read when opening.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    /// Shard paths, in the order tensors are read.
    pub shards: Vec<PathBuf>,
    /// Per shard, its tensors in data order.
    pub tensors: Vec<Vec<TensorEntry>>,
}

#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Open `path`: a `.safetensors` file, a shard index JSON file, or a
    /// directory holding `model.safetensors.index.json`, `model.safetensors`
    /// or otherwise every `*.safetensors` file (sorted by name).
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] when a shard is truncated or lies, when the
    /// index names a tensor its shard lacks, or a tensor appears twice.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let meta = std::fs::metadata(path)
            .map_err(|e| Error::io(format!("checkpoint {}", path.display()), e))?;
        if meta.is_dir() {
            let idx = path.join(INDEX_FILE);
            if idx.exists() {
                return Self::from_index(&idx);
            }
            let single = path.join("model.safetensors");
            if single.exists() {
                return Self::from_files(vec![single]);
            }
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(format!("list {}", path.display()), e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "{}: no {INDEX_FILE} and no .safetensors files",
                        path.display()
                    ),
                ));
            }
            return Self::from_files(files);
        }
        if path.extension().is_some_and(|x| x == "json") {
            return Self::from_index(path);
        }
        Self::from_files(vec![path.to_path_buf()])
    }

    fn from_files(files: Vec<PathBuf>) -> Result<Checkpoint> {
        let tensors = files
            .iter()
            .map(|f| read_header(f))
            .collect::<Result<Vec<_>>>()?;
        let ck = Checkpoint {
            shards: files,
            tensors,
        };
        ck.check_unique()?;
        Ok(ck)
    }

    fn from_index(idx: &Path) -> Result<Checkpoint> {
        let text = crate::util::read_regular(idx, "shard index")?;
        let index: IndexFile = serde_json::from_slice(&text)
            .map_err(|e| corrupt(idx, format!("not a shard index: {e}")))?;
        let dir = idx.parent().unwrap_or(Path::new("."));
        let mut shard_names: Vec<&String> = index.weight_map.values().collect();
        shard_names.sort();
        shard_names.dedup();
        // Names read from a file: only regular files inside its folder.
        let files: Vec<PathBuf> = shard_names
            .iter()
            .map(|s| accel_api::files::resolve_inside(dir, s, "checkpoint shard"))
            .collect::<Result<_>>()?;
        let ck = Self::from_files(files)?;
        let mut where_: HashMap<&str, usize> = HashMap::new();
        for (si, ts) in ck.tensors.iter().enumerate() {
            for t in ts {
                where_.insert(&t.name, si);
            }
        }
        for (name, shard) in &index.weight_map {
            let want = dir.join(shard);
            match where_.get(name.as_str()) {
                Some(&si) if ck.shards[si] == want => {}
                _ => {
                    return Err(corrupt(
                        &want,
                        format!(
                            "tensor `{name}` is listed in {} but missing from this shard",
                            idx.display()
                        ),
                    ))
                }
            }
        }
        Ok(ck)
    }

    fn check_unique(&self) -> Result<()> {
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (si, ts) in self.tensors.iter().enumerate() {
            for t in ts {
                if let Some(prev) = seen.insert(&t.name, si) {
                    return Err(corrupt(
                        &self.shards[si],
                        format!(
                            "tensor `{}` also appears in {}",
                            t.name,
                            self.shards[prev].display()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Every tensor as (name, meta), shard by shard in data order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &TensorMeta)> {
        self.tensors
            .iter()
            .flatten()
            .map(|t| (t.name.as_str(), &t.meta))
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.iter().map(Vec::len).sum()
    }

    /// `true` when the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().flatten().map(|t| t.len).sum()
    }
}

/// Write `tensors` as a sharded checkpoint in `dir`: shards of at most
/// `shard_bytes` (a tensor larger than that gets a shard of its own), named
/// `model-00001-of-0000N.safetensors`, plus `model.safetensors.index.json`.
pub fn write_sharded<'a>(
    dir: &Path,
    tensors: &[(&'a str, &'a TensorMeta, &'a [u8])],
    shard_bytes: u64,
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("create {}", dir.display()), e))?;
    let mut groups: Vec<Vec<usize>> = vec![];
    let mut cur = 0u64;
    for (i, (_, _, d)) in tensors.iter().enumerate() {
        if groups.is_empty() || (cur + d.len() as u64 > shard_bytes && cur > 0) {
            groups.push(vec![]);
            cur = 0;
        }
        groups.last_mut().expect("group").push(i);
        cur += d.len() as u64;
    }
    let n = groups.len();
    let mut weight_map = serde_json::Map::new();
    let mut paths = vec![];
    let mut total = 0u64;
    for (gi, g) in groups.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:05}.safetensors", gi + 1, n);
        let p = dir.join(&fname);
        write_file(&p, g.iter().map(|&i| tensors[i]))?;
        for &i in g {
            weight_map.insert(
                tensors[i].0.to_string(),
                serde_json::Value::String(fname.clone()),
            );
            total += tensors[i].2.len() as u64;
        }
        paths.push(p);
    }
    let idx = serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    write_atomic(&dir.join(INDEX_FILE), |w| {
        serde_json::to_writer_pretty(w, &idx).map_err(std::io::Error::other)
    })?;
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(d: DType, s: &[usize]) -> TensorMeta {
        TensorMeta {
            dtype: d,
            shape: s.to_vec(),
        }
    }

    #[test]
    fn round_trip_and_zero_copy() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.safetensors");
        let m1 = meta(DType::F32, &[2, 3]);
        let m2 = meta(DType::BF16, &[4]);
        let a: Vec<u8> = (0..24).collect();
        let b: Vec<u8> = (100..108).collect();
        write_file(&p, [("x.w", &m1, &a[..]), ("y", &m2, &b[..])]).unwrap();
        let f = SafetensorsFile::open(&p).unwrap();
        let (e, data) = f.tensor("y").unwrap();
        assert_eq!(e.meta, m2);
        assert_eq!(data, &b[..]);
        assert_eq!(f.tensor("x.w").unwrap().1, &a[..]);
        let err = f.tensor("nope").unwrap_err();
        assert_eq!(err.kind(), &ErrorKind::InvalidArgument);
        assert!(
            err.to_string().contains("nope") && err.to_string().contains("a.safetensors"),
            "{err}"
        );
    }

    #[test]
    fn truncated_and_lying_files_are_corrupt_naming_file_and_tensor() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("t.safetensors");
        let m = meta(DType::F32, &[16]);
        let data = [7u8; 64];
        write_file(&p, [("layer.weight", &m, &data[..])]).unwrap();
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() - 10]).unwrap();
        let err = SafetensorsFile::open(&p).unwrap_err();
        assert_eq!(err.kind(), &ErrorKind::Corrupt);
        let s = err.to_string();
        assert!(
            s.contains("t.safetensors") && s.contains("layer.weight") && s.contains("truncated"),
            "{s}"
        );
        assert_eq!(read_header(&p).unwrap_err().kind(), &ErrorKind::Corrupt);

        // A header claiming [16] f32 in 32 bytes.
        let lie = br#"{"layer.weight":{"dtype":"F32","shape":[16],"data_offsets":[0,32]}}"#;
        let mut bytes = (lie.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(lie);
        bytes.extend_from_slice(&[0u8; 32]);
        std::fs::write(&p, &bytes).unwrap();
        let s = SafetensorsFile::open(&p).unwrap_err().to_string();
        assert!(s.contains("layer.weight") && s.contains("lies"), "{s}");

        // Header length beyond the file.
        std::fs::write(&p, 1000u64.to_le_bytes()).unwrap();
        let s = SafetensorsFile::open(&p).unwrap_err().to_string();
        assert!(
            s.contains("t.safetensors") && s.contains("header length 1000"),
            "{s}"
        );
    }

    #[test]
    fn sharded_checkpoint_with_index() {
        let d = tempfile::tempdir().unwrap();
        let m = meta(DType::U8, &[10]);
        let bufs: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 10]).collect();
        let names: Vec<String> = (0..5).map(|i| format!("t{i}")).collect();
        let ts: Vec<_> = names
            .iter()
            .zip(&bufs)
            .map(|(n, b)| (n.as_str(), &m, &b[..]))
            .collect();
        let paths = write_sharded(d.path(), &ts, 25).unwrap();
        assert_eq!(paths.len(), 3);
        let ck = Checkpoint::open(d.path()).unwrap();
        assert_eq!(ck.len(), 5);
        assert_eq!(ck.total_bytes(), 50);
        // An index that names a tensor the shard lacks.
        let idx = d.path().join(INDEX_FILE);
        let mut v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
        v["weight_map"]["ghost"] = "model-00001-of-00003.safetensors".into();
        std::fs::write(&idx, serde_json::to_vec(&v).unwrap()).unwrap();
        let s = Checkpoint::open(d.path()).unwrap_err().to_string();
        assert!(
            s.contains("ghost") && s.contains("model-00001-of-00003"),
            "{s}"
        );
    }
}
