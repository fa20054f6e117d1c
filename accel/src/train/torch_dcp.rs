//! torch's distributed-checkpoint Hugging Face layout, both ways:
//! `HuggingFaceStorageWriter(path, save_distributed=True)` writes one
//! safetensors file per rank (`shard-00001-model-00001-of-00001.safetensors`,
//! ...) whose header's `DCP_SHARDING_INFO` gives each tensor's offsets in
//! the whole tensor; `HuggingFaceStorageReader` reads every
//! `*.safetensors` of the folder and assembles the chunks.
//!
//! [`save_model_sharded`](crate::Accelerator::save_model_sharded) writes it
//! (each rank its rows of every tensor, dim 0 chunked as torch's FSDP2
//! shards), and [`load_model`](crate::Accelerator::load_model) reads it at
//! any world size (the whole tensors, assembled and checked: every element
//! covered once). torch's own `.metadata` (a pickle) is never read: a
//! folder that has one is refused, naming the writer to use.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use accel_api::{files, Error, ErrorKind, Result};
use std::ops::Range;

use accel_sharding::placement::{chunk, intersect};
use accel_sharding::{temp_path_for, write_file_synced, CheckpointWriter};
use serde::{Deserialize, Serialize};

use super::adapters::{Parameters, Tensor};
use super::checkpoint::decode_tensors;
use super::safetensors_file::{
    corrupt, encode_stored, file_dtype, read_safetensors, stored_params, ReadModel, Stored,
};
use crate::Accelerator;

/// The header key of a shard's offsets (torch's `CUSTOM_METADATA_KEY`).
pub const DCP_SHARDING_INFO: &str = "DCP_SHARDING_INFO";
/// The header key of the layout's version (torch's `DCP_VERSION`).
const DCP_VERSION: &str = "DCP_VERSION";

/// One tensor's entry in [`DCP_SHARDING_INFO`].
#[derive(Debug, Serialize, Deserialize)]
struct Offsets {
    saved_offsets: Vec<usize>,
}

/// The file rank `rank` writes (torch's `_gen_file_name` with one file per
/// rank).
pub fn shard_file_name(rank: usize) -> String {
    format!("shard-{:05}-model-00001-of-00001.safetensors", rank + 1)
}

/// One rank's chunk of a tensor, for [`save_shards`](crate::Accelerator::save_shards):
/// where it sits in the whole tensor and its values.
#[derive(Clone, Debug, PartialEq)]
pub struct ShardChunk {
    /// The tensor's name in the files.
    pub name: String,
    /// The chunk's first index along each dimension of the whole tensor.
    pub offsets: Vec<usize>,
    /// The chunk's shape (as many dimensions as `offsets`).
    pub shape: Vec<usize>,
    /// The values' element type (F16, BF16, F32 or F64).
    pub dtype: accel_api::DType,
    /// The values, row-major, little-endian, `shape`'s product of them.
    pub bytes: Vec<u8>,
}

impl Accelerator {
    /// Save `model`'s weights as torch's distributed checkpoint writes them
    /// with `HuggingFaceStorageWriter(dir, save_distributed=True)`: every
    /// rank writes one safetensors file holding its rows of every tensor
    /// (dimension 0 split in `world_size` chunks as torch's FSDP2 shards
    /// it), its header giving the chunk's offsets under
    /// `DCP_SHARDING_INFO`. torch's `HuggingFaceStorageReader` loads the
    /// folder at any layout, and so does [`load_model`](Self::load_model).
    /// Written as atomically as [`save_model`](Self::save_model): a
    /// temporary folder, every file fsynced, then swapped with `dir`.
    /// Collective; the folder must be one that every rank reaches.
    ///
    /// # Errors
    /// As [`save_model`](Self::save_model); a failure on any rank fails
    /// every rank.
    pub fn save_model_sharded<P: Parameters + ?Sized>(
        &self,
        model: &P,
        dir: impl AsRef<Path>,
    ) -> Result<std::path::PathBuf> {
        let chunks = rank_chunks(model, self.rank(), self.world_size());
        self.write_shards("save_model_sharded", chunks, dir.as_ref())
    }

    /// Save the chunks each rank holds (a tensor-parallel rank's parts of
    /// its layers, cut by a plan: `accel_candle::tp::shard_chunk`) in
    /// torch's distributed-checkpoint layout, as
    /// [`save_model_sharded`](Self::save_model_sharded) writes it: one file
    /// per rank that has chunks, each chunk's offsets in its header. A
    /// tensor replicated over ranks is given by one of them only.
    /// [`load_model`](Self::load_model) (and torch's reader) assemble the
    /// whole tensors, and refuse a folder whose chunks overlap or leave a
    /// hole. Collective.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming a chunk whose shape, offsets
    /// and bytes disagree, or whose element type is not floating point; as
    /// [`save_model`](Self::save_model).
    pub fn save_shards(
        &self,
        chunks: Vec<ShardChunk>,
        dir: impl AsRef<Path>,
    ) -> Result<std::path::PathBuf> {
        self.write_shards("save_shards", Ok(chunks), dir.as_ref())
    }

    pub(crate) fn write_shards(
        &self,
        op: &str,
        chunks: Result<Vec<ShardChunk>>,
        dir: &Path,
    ) -> Result<std::path::PathBuf> {
        let mut writer = None;
        let created = if self.is_main_process() {
            CheckpointWriter::create(dir).map(|w| writer = Some(w.without_manifest()))
        } else {
            Ok(())
        };
        self.agree(op, created)?;
        let rank = self.rank();
        let written = chunks
            .and_then(|c| encode_chunks(op, c))
            .and_then(|bytes| match bytes {
                Some(bytes) => {
                    let temp = temp_path_for(dir)?;
                    write_file_synced(&temp.join(shard_file_name(rank)), &bytes)
                }
                None => Ok(()),
            });
        self.agree(op, written)?;
        let committed = match writer.take() {
            Some(w) => w.commit_replacing().map(|_| ()),
            None => Ok(()),
        };
        self.agree(op, committed)?;
        Ok(dir.to_path_buf())
    }
}

/// Rank `rank`'s chunks: dimension 0 of every parameter in `world`
/// chunks (a scalar on rank 0 alone).
fn rank_chunks<P: Parameters + ?Sized>(
    model: &P,
    rank: usize,
    world: usize,
) -> Result<Vec<ShardChunk>> {
    Ok(stored_params(model)?
        .into_iter()
        .filter_map(|(name, t)| {
            row_chunk(name, &t.shape, dtype_of(t.dtype), &t.bytes, (rank, world))
        })
        .collect())
}

/// Rank `rank`'s rows of the whole tensor `name` (`shape`, `bytes` of
/// `dtype`): dimension 0 in `world` chunks as torch's FSDP2 shards it, a
/// scalar on rank 0 alone; `None` where the rank holds no row.
pub(crate) fn row_chunk(
    name: String,
    shape: &[usize],
    dtype: accel_api::DType,
    bytes: &[u8],
    (rank, world): (usize, usize),
) -> Option<ShardChunk> {
    let Some(&rows) = shape.first() else {
        return (rank == 0).then(|| ShardChunk {
            name,
            offsets: Vec::new(),
            shape: Vec::new(),
            dtype,
            bytes: bytes.to_vec(),
        });
    };
    let range = chunk(rows, world, rank);
    if range.is_empty() {
        return None;
    }
    let row_bytes = bytes.len() / rows.max(1);
    let mut part = shape.to_vec();
    part[0] = range.len();
    let mut offsets = vec![0; part.len()];
    offsets[0] = range.start;
    Some(ShardChunk {
        name,
        offsets,
        shape: part,
        dtype,
        bytes: bytes[range.start * row_bytes..range.end * row_bytes].to_vec(),
    })
}

fn dtype_of(d: safetensors::Dtype) -> accel_api::DType {
    use safetensors::Dtype;
    match d {
        Dtype::F16 => accel_api::DType::F16,
        Dtype::BF16 => accel_api::DType::BF16,
        Dtype::F64 => accel_api::DType::F64,
        _ => accel_api::DType::F32,
    }
}

/// One rank's file of `chunks`, the offsets in its header; `None` for no
/// chunk (the rank writes no file).
fn encode_chunks(op: &str, chunks: Vec<ShardChunk>) -> Result<Option<Vec<u8>>> {
    if chunks.is_empty() {
        return Ok(None);
    }
    let mut mine: BTreeMap<String, Stored> = BTreeMap::new();
    let mut info: BTreeMap<String, Offsets> = BTreeMap::new();
    for c in chunks {
        let bad = |why: String| Error::invalid_argument(op, format!("chunk {:?}: {why}", c.name));
        let Some(dtype) = file_dtype(c.dtype) else {
            return Err(bad(format!("{} is not a floating-point type", c.dtype)));
        };
        let n: usize = c.shape.iter().product();
        if c.offsets.len() != c.shape.len() || n * c.dtype.size() != c.bytes.len() {
            return Err(bad(format!(
                "offsets {:?}, shape {:?} and {} bytes of {} disagree",
                c.offsets,
                c.shape,
                c.bytes.len(),
                c.dtype
            )));
        }
        info.insert(
            c.name.clone(),
            Offsets {
                saved_offsets: c.offsets,
            },
        );
        mine.insert(
            c.name,
            Stored {
                shape: c.shape,
                dtype,
                bytes: c.bytes,
            },
        );
    }
    let meta = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        (DCP_VERSION.to_string(), "1.0".to_string()),
        (
            DCP_SHARDING_INFO.to_string(),
            serde_json::to_string(&info).expect("offsets serialise"),
        ),
    ]);
    encode_stored(&mine, Some(meta)).map(Some)
}

/// What a folder without accel's files may hold instead: torch's sharded
/// Hugging Face layout (`Some`), torch's pickled `.metadata` (an error
/// naming the writer to use), or nothing torch wrote (`None`).
pub(super) fn read_if_torch(dir: &Path) -> Result<Option<ReadModel>> {
    refuse_pickled(dir, "load_model")?;
    let Ok(names) = safetensors_names(dir) else {
        return Ok(None);
    };
    if names.is_empty() {
        return Ok(None);
    }
    let mut chunks: BTreeMap<String, Vec<(Vec<usize>, Tensor)>> = BTreeMap::new();
    let mut dtypes = BTreeMap::new();
    for name in &names {
        let (path, f) = files::open_inside(dir, name, "shard")?;
        let bytes = read_safetensors(&path, f)?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| corrupt(format!("{}: not safetensors: {e}", path.display())))?;
        let Some(raw) = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get(DCP_SHARDING_INFO))
        else {
            // Not torch's sharded layout: leave the folder to the caller.
            return Ok(None);
        };
        let info: BTreeMap<String, Offsets> = serde_json::from_str(raw).map_err(|e| {
            corrupt(format!(
                "{}: malformed {DCP_SHARDING_INFO}: {e}",
                path.display()
            ))
        })?;
        for (n, info) in meta.tensors() {
            dtypes.insert(n, info.dtype);
        }
        for (n, t) in decode_tensors(&bytes, &path)? {
            let off = info
                .get(&n)
                .map(|o| o.saved_offsets.clone())
                .ok_or_else(|| {
                    corrupt(format!(
                        "{}: tensor {n:?} has no entry in {DCP_SHARDING_INFO}",
                        path.display()
                    ))
                })?;
            if off.len() != t.shape.len() {
                return Err(corrupt(format!(
                    "{}: tensor {n:?} has {} dimensions but {} offsets",
                    path.display(),
                    t.shape.len(),
                    off.len()
                )));
            }
            chunks.entry(n).or_default().push((off, t));
        }
    }
    let mut out = BTreeMap::new();
    for (n, parts) in chunks {
        out.insert(n.clone(), assemble(&n, parts, dir)?);
    }
    Ok(Some((out, dtypes)))
}

/// An error for a folder in torch's pickled `.metadata` layout, naming the
/// file and the writer to use instead.
fn refuse_pickled(dir: &Path, op: &str) -> Result<()> {
    let pickled = dir.join(".metadata");
    if !pickled.exists() {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::Unsupported,
        format!(
            "{} is torch.distributed.checkpoint's own metadata, a pickle, which accel never \
             reads",
            pickled.display()
        ),
    )
    .with_op(op)
    .with_fix(
        "save with torch.distributed.checkpoint.HuggingFaceStorageWriter(path, \
         save_distributed=True) instead (or consolidate to model.safetensors), then load that \
         folder",
    ))
}

/// The whole tensor `name` from its chunks: the shape is the furthest
/// chunk end per dimension, and every element must be covered once.
fn assemble(name: &str, parts: Vec<(Vec<usize>, Tensor)>, dir: &Path) -> Result<Tensor> {
    let rank = parts[0].1.shape.len();
    let mut shape = vec![0usize; rank];
    for (off, t) in &parts {
        if t.shape.len() != rank {
            return Err(corrupt(format!(
                "{}: the chunks of tensor {name:?} differ in their number of dimensions",
                dir.display()
            )));
        }
        for d in 0..rank {
            shape[d] = shape[d].max(off[d] + t.shape[d]);
        }
    }
    let whole: Vec<Range<usize>> = shape.iter().map(|&n| 0..n).collect();
    fill_region(name, &parts, &whole, dir)
}

/// The box `region` of tensor `name` from the chunks that overlap it:
/// every element of the box covered exactly once, or an error naming the
/// tensor (overlapping chunks, or a hole: a rank's file missing).
fn fill_region(
    name: &str,
    parts: &[(Vec<usize>, Tensor)],
    region: &[Range<usize>],
    dir: &Path,
) -> Result<Tensor> {
    let rank = region.len();
    let shape: Vec<usize> = region.iter().map(|r| r.len()).collect();
    let total: usize = shape.iter().product();
    let mut data = vec![0f32; total];
    let mut seen = vec![false; total];
    let mut covered = 0usize;
    let stride = |dims: &[usize], d: usize| -> usize { dims[d + 1..].iter().product() };
    for (off, t) in parts {
        if off.len() != rank {
            continue;
        }
        if rank == 0 {
            // A scalar: one element, no box.
            if seen[0] {
                return Err(corrupt(format!(
                    "{}: two chunks of tensor {name:?} hold element 0",
                    dir.display()
                )));
            }
            seen[0] = true;
            data[0] = t.data[0];
            covered += 1;
            continue;
        }
        let chunk_box: Vec<Range<usize>> =
            off.iter().zip(&t.shape).map(|(&o, &n)| o..o + n).collect();
        let Some(common) = intersect(&chunk_box, region) else {
            continue;
        };
        // Row by row of the last dimension of the common box.
        let last = rank - 1;
        let run = common[last].len();
        let rows: usize = common[..last].iter().map(|r| r.len()).product();
        for row in 0..rows {
            let (mut src, mut dst) = (
                common[last].start - off[last],
                common[last].start - region[last].start,
            );
            let mut rest = row;
            for d in (0..last).rev() {
                let i = common[d].start + rest % common[d].len();
                rest /= common[d].len();
                src += (i - off[d]) * stride(&t.shape, d);
                dst += (i - region[d].start) * stride(&shape, d);
            }
            for j in 0..run {
                if seen[dst + j] {
                    return Err(corrupt(format!(
                        "{}: two chunks of tensor {name:?} hold element {}",
                        dir.display(),
                        dst + j
                    )));
                }
                seen[dst + j] = true;
                data[dst + j] = t.data[src + j];
            }
            covered += run;
        }
    }
    if covered != total {
        return Err(corrupt(format!(
            "{}: the chunks of tensor {name:?} cover {covered} of the {total} elements asked \
             ({region:?}): a rank's file is missing",
            dir.display()
        )));
    }
    Ok(Tensor { shape, data })
}

/// This rank's part of a parameter under a tensor-parallel plan (`group`
/// is the `tp` group: its size and this rank's place in it), read from a
/// folder of torch's per-rank shards written at any layout: what the
/// frameworks' `load_by_plan` reads, as [`read_tensor_region`] of the box
/// the plan gives this rank.
///
/// # Errors
/// A shape the plan's style cannot split; as [`read_tensor_region`].
pub fn read_planned_part(
    dir: impl AsRef<Path>,
    p: &accel_sharding::tp_plan::Planned<'_>,
    group: &dyn accel_api::Communicator,
) -> Result<Tensor> {
    let b = p.layout(group.world_size())?.local_box(&[group.rank()])?;
    read_tensor_region(dir, p.name, &b)
}

/// The box `region` of tensor `name` (f32) from a folder of torch's
/// per-rank shards (torch's `HuggingFaceStorageWriter` with
/// `save_distributed=True`, [`save_shards`](crate::Accelerator::save_shards),
/// [`save_model_sharded`](crate::Accelerator::save_model_sharded)): what a
/// rank of another layout needs (resharding across meshes: a
/// tensor-parallel part cut by another plan or size). Reads every file's
/// header, and the data of the files that hold a part of the box only.
///
/// # Errors
/// [`ErrorKind::Corrupt`] naming the tensor when the chunks overlap or
/// leave a hole in the box, or a file is malformed; [`ErrorKind::Io`]; a
/// folder of another layout is [`ErrorKind::InvalidArgument`].
pub fn read_tensor_region(
    dir: impl AsRef<Path>,
    name: &str,
    region: &[Range<usize>],
) -> Result<Tensor> {
    let dir = dir.as_ref();
    let mut parts = Vec::new();
    let mut found = false;
    for file in safetensors_names(dir)? {
        let (path, f) = files::open_inside(dir, &file, "shard")?;
        let Some(chunk) = header_chunk(&path, name)? else {
            continue;
        };
        found = true;
        let (off, shape) = chunk;
        let chunk_box: Vec<Range<usize>> =
            off.iter().zip(&shape).map(|(&o, &n)| o..o + n).collect();
        if off.len() == region.len()
            && !region.is_empty()
            && intersect(&chunk_box, region).is_none()
        {
            continue;
        }
        let bytes = read_safetensors(&path, f)?;
        let t = decode_tensors(&bytes, &path)?
            .remove(name)
            .ok_or_else(|| corrupt(format!("{}: tensor {name:?} vanished", path.display())))?;
        parts.push((off, t));
    }
    if !found {
        return Err(Error::invalid_argument(
            "read_tensor_region",
            format!(
                "{} holds no chunk of tensor {name:?} in torch's per-rank layout",
                dir.display()
            ),
        ));
    }
    fill_region(name, &parts, region, dir)
}

/// The `*.safetensors` files of `dir`, sorted.
fn safetensors_names(dir: &Path) -> Result<Vec<String>> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| Error::io(format!("cannot list {}", dir.display()), e))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
    Ok(names)
}

/// `path`'s safetensors header as JSON (its tensors' names, dtypes,
/// shapes and offsets, and `__metadata__`), reading the file's first bytes
/// only, never tensor data.
///
/// # Errors
/// [`ErrorKind::Corrupt`] naming the file when it is shorter than a
/// header, declares a header longer than the file (or than 100 MiB), or
/// the header is not JSON; [`ErrorKind::Io`] when it cannot be read.
pub fn safetensors_header(path: &Path) -> Result<serde_json::Value> {
    use std::io::Read;
    let bad = |m: String| Error::new(ErrorKind::Corrupt, format!("{}: {m}", path.display()));
    let mut f = std::fs::File::open(path)
        .map_err(|e| Error::io(format!("cannot open {}", path.display()), e))?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad("shorter than a safetensors header".into()))?;
    let n = u64::from_le_bytes(n);
    let size = f.metadata().map(|m| m.len()).unwrap_or(0);
    if n > size.saturating_sub(8) || n > 100 << 20 {
        return Err(bad(format!(
            "not safetensors: a header of {n} bytes in a file of {size}"
        )));
    }
    let mut head = vec![0u8; n as usize];
    f.read_exact(&mut head)
        .map_err(|e| Error::io(format!("cannot read the header of {}", path.display()), e))?;
    serde_json::from_slice(&head).map_err(|e| bad(format!("the header is not JSON: {e}")))
}

/// The offsets of every tensor in a header's [`DCP_SHARDING_INFO`], or
/// `None` when the header has none (not torch's per-rank layout).
fn header_offsets(
    path: &Path,
    header: &serde_json::Value,
) -> Result<Option<BTreeMap<String, Offsets>>> {
    let Some(info) = header["__metadata__"][DCP_SHARDING_INFO].as_str() else {
        return Ok(None);
    };
    serde_json::from_str(info).map(Some).map_err(|e| {
        Error::new(
            ErrorKind::Corrupt,
            format!("{}: malformed {DCP_SHARDING_INFO}: {e}", path.display()),
        )
    })
}

/// A header entry's shape.
fn header_shape(entry: &serde_json::Value) -> Vec<usize> {
    entry["shape"]
        .as_array()
        .map(|s| {
            s.iter()
                .filter_map(|v| v.as_u64().map(|v| v as usize))
                .collect()
        })
        .unwrap_or_default()
}

/// From `path`'s header alone (its first bytes): tensor `name`'s offsets
/// and shape when the file holds a chunk of it.
fn header_chunk(path: &Path, name: &str) -> Result<Option<(Vec<usize>, Vec<usize>)>> {
    let op = |e: Error| e.with_op("read_tensor_region");
    let header = safetensors_header(path).map_err(op)?;
    if !header[name].is_object() {
        return Ok(None);
    }
    let shape = header_shape(&header[name]);
    let bad = |m: String| corrupt(format!("{}: {m}", path.display()));
    let info = header_offsets(path, &header)
        .map_err(op)?
        .ok_or_else(|| bad(format!("no {DCP_SHARDING_INFO} in the header")))?;
    let off = info
        .get(name)
        .map(|o| o.saved_offsets.clone())
        .ok_or_else(|| {
            bad(format!(
                "tensor {name:?} has no entry in {DCP_SHARDING_INFO}"
            ))
        })?;
    Ok(Some((off, shape)))
}

/// A folder in torch's per-rank layout that does not hold what it says.
fn unsound(msg: String) -> Error {
    Error::new(ErrorKind::Corrupt, msg).with_op("checkpoint check")
}

/// One chunk of a folder in torch's per-rank layout, as its file's header
/// gives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DcpChunk {
    /// The tensor's name.
    pub name: String,
    /// The element type as safetensors names it (`F32`, `BF16`, ...).
    pub dtype: String,
    /// The chunk's first index along each dimension of the whole tensor.
    pub offsets: Vec<usize>,
    /// The chunk's shape.
    pub shape: Vec<usize>,
}

/// What a folder in torch's per-rank layout holds, from its files'
/// headers alone (no tensor data read): [`dcp_index`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DcpIndex {
    /// Each file (sorted), its size in bytes and its chunks.
    pub files: Vec<(String, u64, Vec<DcpChunk>)>,
    /// Each tensor's whole shape: the furthest chunk end per dimension.
    pub tensors: BTreeMap<String, Vec<usize>>,
}

/// The files and chunks of `dir` when it is in torch's per-rank layout
/// (every `*.safetensors` header carries [`DCP_SHARDING_INFO`]), `None`
/// when it is not; only the headers are read. [`DcpIndex::check`] then
/// says whether the chunks cover every tensor.
///
/// # Errors
/// [`ErrorKind::Unsupported`] for torch's pickled `.metadata` layout
/// (naming the writer to use); [`ErrorKind::Corrupt`] naming a file whose
/// header is malformed or lacks a tensor's offsets; [`ErrorKind::Io`].
pub fn dcp_index(dir: impl AsRef<Path>) -> Result<Option<DcpIndex>> {
    let dir = dir.as_ref();
    refuse_pickled(dir, "accel checkpoint")?;
    let names = safetensors_names(dir)?;
    if names.is_empty() {
        return Ok(None);
    }
    let mut index = DcpIndex {
        files: Vec::new(),
        tensors: BTreeMap::new(),
    };
    for file in names {
        let (path, f) = files::open_inside(dir, &file, "shard")?;
        let size = f.metadata().map(|m| m.len()).unwrap_or(0);
        let op = |e: Error| e.with_op("checkpoint check");
        let header = safetensors_header(&path).map_err(op)?;
        let Some(info) = header_offsets(&path, &header).map_err(op)? else {
            return Ok(None);
        };
        let mut chunks = Vec::new();
        let entries = header.as_object().into_iter().flatten();
        for (name, entry) in entries.filter(|(k, _)| *k != "__metadata__") {
            let offsets = info
                .get(name)
                .map(|o| o.saved_offsets.clone())
                .ok_or_else(|| {
                    unsound(format!(
                        "{}: tensor {name:?} has no entry in {DCP_SHARDING_INFO}",
                        path.display()
                    ))
                })?;
            let shape = header_shape(entry);
            if offsets.len() != shape.len() {
                return Err(unsound(format!(
                    "{}: tensor {name:?} has {} dimensions but {} offsets",
                    path.display(),
                    shape.len(),
                    offsets.len()
                )));
            }
            let whole = index
                .tensors
                .entry(name.clone())
                .or_insert_with(|| vec![0; shape.len()]);
            for (w, (o, n)) in whole.iter_mut().zip(offsets.iter().zip(&shape)) {
                *w = (*w).max(o + n);
            }
            chunks.push(DcpChunk {
                name: name.clone(),
                dtype: entry["dtype"].as_str().unwrap_or("?").to_string(),
                offsets,
                shape,
            });
        }
        index.files.push((file, size, chunks));
    }
    Ok(Some(index))
}

impl DcpIndex {
    /// The number of files: the world size the folder was saved at when
    /// every rank wrote one.
    pub fn world_size(&self) -> usize {
        self.files.len()
    }

    /// Check that every element of every tensor is held by exactly one
    /// chunk, and that a tensor's chunks agree on their element type and
    /// number of dimensions.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the tensor (and the files) whose chunks
    /// overlap, leave a hole (a rank's file missing) or disagree.
    pub fn check(&self) -> Result<()> {
        let mut by_tensor: BTreeMap<&str, Vec<(&str, &DcpChunk)>> = BTreeMap::new();
        for (file, _, chunks) in &self.files {
            for c in chunks {
                by_tensor.entry(&c.name).or_default().push((file, c));
            }
        }
        for (name, parts) in by_tensor {
            let whole = &self.tensors[name];
            let (f0, c0) = parts[0];
            for (f, c) in &parts[1..] {
                if c.dtype != c0.dtype || c.shape.len() != c0.shape.len() {
                    return Err(unsound(format!(
                        "tensor {name:?}: its chunk in {f} is {} of {} dimensions, in {f0} {} of {}",
                        c.dtype,
                        c.shape.len(),
                        c0.dtype,
                        c0.shape.len()
                    )));
                }
            }
            let boxes: Vec<Vec<Range<usize>>> = parts
                .iter()
                .map(|(_, c)| {
                    c.offsets
                        .iter()
                        .zip(&c.shape)
                        .map(|(&o, &n)| o..o + n)
                        .collect()
                })
                .collect();
            for i in 0..parts.len() {
                for j in i + 1..parts.len() {
                    let overlap = if whole.is_empty() {
                        Some(Vec::new())
                    } else {
                        intersect(&boxes[i], &boxes[j]).filter(|b| b.iter().all(|r| !r.is_empty()))
                    };
                    if overlap.is_some() {
                        return Err(unsound(format!(
                            "tensor {name:?}: the chunks in {} and {} overlap",
                            parts[i].0, parts[j].0
                        )));
                    }
                }
            }
            let held: usize = parts
                .iter()
                .map(|(_, c)| c.shape.iter().product::<usize>())
                .sum();
            let total: usize = whole.iter().product();
            if held != total {
                return Err(unsound(format!(
                    "tensor {name:?} {whole:?}: its chunks hold {held} of its {total} elements: a \
                     rank's file is missing"
                )));
            }
        }
        Ok(())
    }
}
