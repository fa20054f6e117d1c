//! `save_model` / `load_model`: a model's weights in the Hugging Face
//! layout, readable by `safetensors`, `transformers` and accel at any world
//! size.
//!
//! # Layout
//! Tensors are grouped into files as huggingface_hub's
//! `split_torch_state_dict_into_shards` groups them ([`shard_plan`]): in
//! parameter order, a new file when the next tensor would take the open
//! one past `max_shard_size`, and a tensor larger than the limit in a file
//! of its own (placed before the open file, which keeps filling). One group
//! is one plain file, `model.safetensors`, even when its one tensor is
//! larger than the limit; more are `model-00001-of-0000N.safetensors`, ...
//! plus `model.safetensors.index.json`:
//!
//! ```json
//! {"metadata": {"total_size": 1234}, "weight_map": {"w": "model-00001-of-00002.safetensors", ...}}
//! ```
//!
//! `total_size` is the sum of the tensors' bytes as stored. Each file's header carries
//! `{"format": "pt"}` as `transformers` writes it, plus [`DIGEST_KEY`]: the
//! SHA-256 of the file's data section, which the index's metadata also
//! records per shard; [`load_model`](crate::Accelerator::load_model)
//! checks both when present. Tensors are named as the model names them; a
//! model that gives [`Parameters::param_shape`] (accel-tch's and
//! accel-candle's adapters, ZeRO's consolidated
//! [`FullParameters`](crate::zero::FullParameters)) gets each tensor in
//! that shape, others 1-D (the [`Parameters`] view is flat), every tensor
//! in its values' own element type (f16, bf16, f32, f64).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use accel_api::{files, Error, ErrorKind, Result};
use accel_sharding::{sha256_hex, CheckpointWriter};
use serde::{Deserialize, Serialize};

use super::adapters::{Parameters, Tensor};
use super::checkpoint::decode_tensors;
use super::safetensors_file::{
    corrupt, encode_stored, encode_values, file_dtype, read_safetensors, stored_params, ReadModel,
    Stored,
};
use crate::Accelerator;

/// The single-file name.
pub const SAFE_WEIGHTS_NAME: &str = "model.safetensors";
/// The index of a sharded model.
pub const SAFE_WEIGHTS_INDEX_NAME: &str = "model.safetensors.index.json";
/// `transformers`' default `max_shard_size` for `save_pretrained`: 5 GB
/// (decimal, as it counts).
pub const DEFAULT_MAX_SHARD_SIZE: u64 = 5_000_000_000;

/// `model.safetensors.index.json`.
#[derive(Debug, Serialize, Deserialize)]
struct Index {
    metadata: IndexMeta,
    weight_map: BTreeMap<String, String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct IndexMeta {
    total_size: u64,
    /// Each shard's [`DIGEST_KEY`] (accel's own key; other readers ignore it).
    #[serde(
        default,
        rename = "accel_data_sha256",
        skip_serializing_if = "Option::is_none"
    )]
    digests: Option<BTreeMap<String, String>>,
}

/// The header metadata key (and index metadata key) under which
/// `save_model` records the SHA-256 of a file's data section: every byte
/// after the header. `transformers` and `safetensors` ignore it.
pub const DIGEST_KEY: &str = "accel_data_sha256";

/// The bytes after a safetensors header (the caller checked the header).
fn data_section(bytes: &[u8]) -> &[u8] {
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    &bytes[8 + n as usize..]
}

/// One file with `{"format": "pt"}` and its data digest in the header;
/// also returns the digest.
fn encode_shard(tensors: &BTreeMap<String, Stored>) -> Result<(Vec<u8>, String)> {
    let meta = |digest: Option<&str>| {
        let mut m = HashMap::from([("format".to_string(), "pt".to_string())]);
        if let Some(d) = digest {
            m.insert(DIGEST_KEY.to_string(), d.to_string());
        }
        Some(m)
    };
    // The data section does not depend on the header's metadata.
    let plain = encode_stored(tensors, meta(None))?;
    let digest = sha256_hex(data_section(&plain));
    drop(plain);
    Ok((encode_stored(tensors, meta(Some(&digest)))?, digest))
}

/// Each tensor's element type as a (checked) file stores it.
fn dtypes_of(bytes: &[u8]) -> BTreeMap<String, safetensors::Dtype> {
    let Ok((_, meta)) = safetensors::SafeTensors::read_metadata(bytes) else {
        return BTreeMap::new(); // decoding reports it
    };
    let mut out = BTreeMap::new();
    for (name, info) in meta.tensors() {
        out.insert(name, info.dtype);
    }
    out
}

/// Check a file's data against the digest in its own header and, for a
/// shard, the one the index records. Files without one (written by other
/// programs) pass.
fn check_digest(path: &Path, bytes: &[u8], indexed: Option<&str>) -> Result<()> {
    let Ok((_, meta)) = safetensors::SafeTensors::read_metadata(bytes) else {
        return Ok(()); // decoding reports it
    };
    let own = meta.metadata().as_ref().and_then(|m| m.get(DIGEST_KEY));
    if own.is_none() && indexed.is_none() {
        return Ok(());
    }
    let got = sha256_hex(data_section(bytes));
    for (want, whose) in [
        (own.map(String::as_str), "its header"),
        (indexed, "the index"),
    ] {
        if let Some(want) = want {
            if want != got {
                return Err(corrupt(format!(
                    "{} is damaged or altered: its data hashes to SHA-256 {got}, {whose} records {want} ({DIGEST_KEY})",
                    path.display()
                ))
                .with_fix("restore the folder from a good copy, or save the model again"));
            }
        }
    }
    Ok(())
}

fn shard_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// How `save_model` groups tensors into files, by huggingface_hub's rule
/// (`split_torch_state_dict_into_shards`, which `save_pretrained` and
/// Accelerate's `save_model` use): `sizes` are `(name, stored bytes)` in
/// parameter order. A tensor larger than `max_shard_size` gets a file of its
/// own, placed before the file that was open, which keeps filling; otherwise
/// a tensor that would take the open file past the limit closes it. One
/// group is the single file [`SAFE_WEIGHTS_NAME`] (no index), more are
/// `model-00001-of-0000N.safetensors`, ... Returns `(file, tensor names)`
/// in file order; nothing for no tensors.
pub fn shard_plan(sizes: &[(String, u64)], max_shard_size: u64) -> Vec<(String, Vec<String>)> {
    let mut groups: Vec<Vec<String>> = Vec::new();
    let mut open: Vec<String> = Vec::new();
    let mut open_bytes = 0u64;
    for (name, size) in sizes {
        if *size > max_shard_size {
            groups.push(vec![name.clone()]);
            continue;
        }
        if open_bytes + size > max_shard_size {
            groups.push(std::mem::take(&mut open));
            open_bytes = 0;
        }
        open.push(name.clone());
        open_bytes += size;
    }
    if !open.is_empty() {
        groups.push(open);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, g)| {
            let file = if n == 1 {
                SAFE_WEIGHTS_NAME.to_string()
            } else {
                shard_name(i, n)
            };
            (file, g)
        })
        .collect()
}

/// A `max_shard_size`: a byte count, or a size string as huggingface_hub
/// and `transformers` take it. Implemented for the integer types, `&str`
/// and `String`.
pub trait MaxShardSize {
    /// The limit in bytes.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a negative count or a string
    /// [`parse_shard_size`] refuses.
    fn shard_bytes(&self) -> Result<u64>;
}

macro_rules! shard_size_int {
    ($($t:ty),*) => {$(
        impl MaxShardSize for $t {
            fn shard_bytes(&self) -> Result<u64> {
                u64::try_from(*self).map_err(|_| {
                    Error::invalid_argument(
                        "save_model",
                        format!("max_shard_size {self} is not a byte count"),
                    )
                })
            }
        }
    )*};
}
shard_size_int!(u64, u32, usize, i32, i64);

impl MaxShardSize for &str {
    fn shard_bytes(&self) -> Result<u64> {
        parse_shard_size(self)
    }
}

impl MaxShardSize for String {
    fn shard_bytes(&self) -> Result<u64> {
        parse_shard_size(self)
    }
}

/// Parse a shard size as huggingface_hub's `parse_size_to_int` does, plus
/// the binary units `transformers` accepts: digits alone are bytes; a
/// number (decimals allowed) followed by `KB`, `MB`, `GB` or `TB` counts
/// powers of 1000 (`"5GB"` is 5 000 000 000), by `KiB`, `MiB`, `GiB` or `TiB`
/// powers of 1024 (`"5GiB"` is 5 368 709 120); units in any case, spaces
/// around the number allowed; a fractional result is truncated, as Python's
/// `int()` does.
///
/// # Errors
/// [`ErrorKind::InvalidArgument`] naming the string for any other unit
/// (`"5B"`, `"5G"`), a number that does not parse, is negative or not
/// finite, or a result beyond `u64`.
pub fn parse_shard_size(s: &str) -> Result<u64> {
    let bad = |why: &str| {
        Error::invalid_argument("save_model", format!("max_shard_size {s:?}: {why}")).with_fix(
            "pass a byte count or a size such as \"5GB\" (powers of 1000) or \"5GiB\" (powers of 1024), units KB/MB/GB/TB or KiB/MiB/GiB/TiB",
        )
    };
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t.parse().map_err(|_| bad("too large"));
    }
    let lower = t.to_ascii_lowercase();
    const UNITS: [(&str, f64); 8] = [
        ("kib", 1024.0),
        ("mib", 1_048_576.0),
        ("gib", 1_073_741_824.0),
        ("tib", 1_099_511_627_776.0),
        ("kb", 1e3),
        ("mb", 1e6),
        ("gb", 1e9),
        ("tb", 1e12),
    ];
    let Some((num, mult)) = UNITS
        .iter()
        .find_map(|(u, m)| lower.strip_suffix(u).map(|n| (n, *m)))
    else {
        return Err(bad(
            "the unit is not one of KB, MB, GB, TB, KiB, MiB, GiB, TiB",
        ));
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| bad("the number before the unit does not parse"))?;
    let bytes = v * mult;
    if !bytes.is_finite() || bytes < 0.0 {
        return Err(bad("not a finite, non-negative size"));
    }
    if bytes >= u64::MAX as f64 {
        return Err(bad("too large"));
    }
    Ok(bytes as u64)
}

impl Accelerator {
    /// Write `model`'s weights into `dir` in the Hugging Face layout,
    /// grouped as `save_pretrained` groups them ([`shard_plan`]):
    /// `model.safetensors` when they form one group, else
    /// `model-00001-of-0000N.safetensors`, ... plus
    /// `model.safetensors.index.json` with `metadata.total_size` (the
    /// tensors' bytes as stored) and the `weight_map` (Accelerate's
    /// `save_model`). `max_shard_size` is a byte count or a size string
    /// (`"5GB"`, `"5GiB"`: [`parse_shard_size`]); pass
    /// [`DEFAULT_MAX_SHARD_SIZE`] for `transformers`' default. Pass the
    /// unwrapped model: `&*prepared` or `prepared.inner()`. Tensors are
    /// named as the model names its parameters, in the values' own element
    /// type, in the model's own shape when it gives
    /// [`Parameters::param_shape`](super::Parameters::param_shape) and 1-D
    /// otherwise; each header
    /// carries `{"format": "pt"}` and the file's data digest
    /// ([`DIGEST_KEY`], also in the index per shard). Returns `dir`.
    /// Collective.
    ///
    /// # Behavior
    /// Only the main process writes. The folder is assembled in a hidden
    /// temporary directory next to `dir`, every file fsynced, then swapped
    /// with an existing `dir` ([`accel_sharding::swap`]: one atomic
    /// exchange where the file system has it, else two renames that the
    /// next load or save completes after a kill), so a process killed at
    /// any instant leaves the old weights or the new ones, never neither
    /// and never a mix. Weights saved by any number of processes load at
    /// any other with [`load_model`](Self::load_model).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] for a `max_shard_size` of 0 or one
    /// that does not parse, or a duplicate parameter name; [`ErrorKind::Io`] naming the path. A
    /// failure on the main process fails every rank.
    pub fn save_model<P: Parameters + ?Sized>(
        &self,
        model: &P,
        dir: impl AsRef<Path>,
        max_shard_size: impl MaxShardSize,
    ) -> Result<PathBuf> {
        const OP: &str = "save_model";
        let dir = dir.as_ref();
        let written = if self.is_main_process() {
            max_shard_size
                .shard_bytes()
                .and_then(|max| write_model(model, dir, max))
        } else {
            Ok(())
        };
        self.agree(OP, written)?;
        Ok(dir.to_path_buf())
    }

    /// Fill `model`'s parameters from a folder written by
    /// [`save_model`](Self::save_model) (or by `transformers`'
    /// `save_pretrained` with safetensors), at any world size: the index and
    /// every shard it names, or the single `model.safetensors`. Every rank
    /// reads the files itself. A model that gives
    /// [`Parameters::param_shape`](super::Parameters::param_shape) gets
    /// each tensor checked against its parameter's shape and element type
    /// (converting is [`load_model_converting`](Self::load_model_converting));
    /// for a model without shapes, `f16`, `bf16`, `f32` and `f64` tensors are
    /// converted to its values' type. A save killed between its two renames (no
    /// `dir`, the old folder at `.dir.old`) is first completed by the main
    /// process, with a warning in the log. Collective.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the file or tensor when a file is not
    /// valid safetensors, the index does not match the shards (a missing
    /// tensor, a wrong `total_size`), or a parameter is missing, has another
    /// length (or another shape or element type than the model's
    /// `param_shape` and values), or the files hold a tensor the model does not have (strict,
    /// as PyTorch's `load_state_dict`), or a file's data does not match the
    /// [`DIGEST_KEY`] recorded in its header or the index;
    /// [`ErrorKind::Io`] when the folder has neither file. A failure on any rank fails every rank.
    pub fn load_model<P: Parameters + ?Sized>(
        &self,
        model: &mut P,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        self.load_model_impl(model, dir.as_ref(), false)
    }

    /// [`load_model`](Self::load_model), converting a tensor stored in
    /// another floating-point type than its parameter's (`f32` weights
    /// into a `bf16` model, say) instead of refusing it. Shapes are still
    /// checked. Collective.
    ///
    /// # Errors
    /// As [`load_model`](Self::load_model), less the element-type check.
    pub fn load_model_converting<P: Parameters + ?Sized>(
        &self,
        model: &mut P,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        self.load_model_impl(model, dir.as_ref(), true)
    }

    /// [`load_model`](Self::load_model) with one reader: the main process
    /// reads and checks the files into its model, then every parameter is
    /// broadcast from it (Accelerate's `broadcast_from_rank0`, FSDP's
    /// `sync_module_states`): one read of the checkpoint instead of one per
    /// rank, and no rank but the main one holds the files' bytes.
    /// Collective.
    ///
    /// # Errors
    /// As [`load_model`](Self::load_model), the main process's for every
    /// rank; a broadcast's.
    pub fn load_model_broadcast<P: Parameters + ?Sized>(
        &self,
        model: &mut P,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        const OP: &str = "load_model_broadcast";
        let dir = dir.as_ref();
        let loaded = if self.is_main_process() {
            super::checkpoint::recover_logged(OP, dir).and_then(|()| {
                read_model(dir).and_then(|(t, dtypes)| fill_model(model, t, &dtypes, dir, false))
            })
        } else {
            Ok(())
        };
        self.agree(OP, loaded)?;
        super::prepare::broadcast_values(self, model, OP)
    }

    fn load_model_impl<P: Parameters + ?Sized>(
        &self,
        model: &mut P,
        dir: &Path,
        convert: bool,
    ) -> Result<()> {
        const OP: &str = "load_model";
        // A save killed between its two renames: finish it once, on the
        // main process, before anyone reads.
        let recovered = if self.is_main_process() {
            super::checkpoint::recover_logged(OP, dir)
        } else {
            Ok(())
        };
        self.agree(OP, recovered)?;
        let tensors = read_model(dir);
        let loaded = tensors.and_then(|(t, dtypes)| fill_model(model, t, &dtypes, dir, convert));
        self.agree(OP, loaded)
    }
}

fn write_model<P: Parameters + ?Sized>(model: &P, dir: &Path, max: u64) -> Result<()> {
    write_stored(stored_params(model)?, dir, max)
}

/// Write `params` (in order) as `save_model` does.
fn write_stored(params: Vec<(String, Stored)>, dir: &Path, max: u64) -> Result<()> {
    const OP: &str = "save_model";
    if max == 0 {
        return Err(Error::invalid_argument(OP, "max_shard_size is 0").with_fix(
            "pass the largest shard in bytes, e.g. accel::train::DEFAULT_MAX_SHARD_SIZE",
        ));
    }
    let mut tensors: BTreeMap<String, Stored> = BTreeMap::new();
    let mut order: Vec<(String, u64)> = Vec::new();
    let mut dup = None;
    for (name, t) in params {
        order.push((name.clone(), t.bytes.len() as u64));
        if tensors.insert(name.clone(), t).is_some() {
            dup.get_or_insert(name);
        }
    }
    if let Some(name) = dup {
        return Err(Error::invalid_argument(
            OP,
            format!("the model has two parameters named {name:?}"),
        )
        .with_fix("give every parameter a unique name: names are the tensor names in the files"));
    }
    let total: u64 = order.iter().map(|(_, s)| s).sum();
    let mut w = CheckpointWriter::create(dir)?.without_manifest();
    if let Some(what) = w.recovered() {
        crate::notice::warn(Some(0), &format!("{OP}: {what}"));
    }
    let shards = shard_plan(&order, max);
    if shards.len() <= 1 {
        w.write(SAFE_WEIGHTS_NAME, &encode_shard(&tensors)?.0)?;
    } else {
        let mut weight_map = BTreeMap::new();
        let mut digests = BTreeMap::new();
        for (file, names) in &shards {
            let part: BTreeMap<String, Stored> = names
                .iter()
                .map(|n| {
                    (
                        n.clone(),
                        tensors.remove(n).expect("planned from the same names"),
                    )
                })
                .collect();
            let (bytes, digest) = encode_shard(&part)?;
            w.write(file, &bytes)?;
            digests.insert(file.clone(), digest);
            for n in names {
                weight_map.insert(n.clone(), file.clone());
            }
        }
        let index = Index {
            metadata: IndexMeta {
                total_size: total,
                digests: Some(digests),
            },
            weight_map,
        };
        w.write_json(SAFE_WEIGHTS_INDEX_NAME, &index)?;
    }
    w.commit_replacing()?;
    Ok(())
}

/// Consolidate the model weights in `src` (any layout `load_model`
/// reads: accel's or `transformers`' `model.safetensors` and index, or
/// torch's per-rank distributed-checkpoint shards) into `dst` in
/// `save_model`'s layout: whole tensors, in their stored element types
/// (F32, F16, BF16; F64 is refused), files of at most `max_shard_size` bytes, written
/// atomically. Reads every file of `src` once; needs no process group.
///
/// # Errors
/// As [`load_model`](crate::Accelerator::load_model) for `src` (a missing
/// or corrupt file, overlapping or missing chunks); as
/// [`save_model`](crate::Accelerator::save_model) for `dst`.
pub fn consolidate_model(
    src: impl AsRef<Path>,
    dst: impl AsRef<Path>,
    max_shard_size: impl MaxShardSize,
) -> Result<()> {
    let (tensors, dtypes) = read_model(src.as_ref())?;
    let mut params = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        let dtype = dtypes
            .get(&name)
            .copied()
            .unwrap_or(safetensors::Dtype::F32);
        if dtype == safetensors::Dtype::F64 {
            // Read through f32: it would not come out as it went in.
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "tensor {name:?} in {} is F64, which consolidation would round to f32",
                    src.as_ref().display()
                ),
            )
            .with_op("consolidate_model")
            .with_fix("consolidate F64 weights with torch, or keep them sharded"));
        }
        let bytes = encode_values(&t.data, dtype);
        params.push((
            name,
            Stored {
                shape: t.shape,
                dtype,
                bytes,
            },
        ));
    }
    write_stored(params, dst.as_ref(), max_shard_size.shard_bytes()?)
}

/// Model folders read so far by this process (for tests of one reader).
static MODEL_READS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many model folders this process has read (`load_model` reads one
/// per rank, `load_model_broadcast` one per job). For tests.
#[doc(hidden)]
pub fn model_reads() -> usize {
    MODEL_READS.load(std::sync::atomic::Ordering::SeqCst)
}

fn read_model(dir: &Path) -> Result<ReadModel> {
    MODEL_READS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let index_path = dir.join(SAFE_WEIGHTS_INDEX_NAME);
    if !index_path.exists() {
        let path = dir.join(SAFE_WEIGHTS_NAME);
        if !path.exists() {
            // torch's distributed checkpoint (its Hugging Face layout).
            if let Some(read) = super::torch_dcp::read_if_torch(dir)? {
                return Ok(read);
            }
            return Err(Error::io(
                format!(
                    "{} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME} nor \
                     per-rank shards of torch's distributed checkpoint",
                    dir.display()
                ),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )
            .with_op("load_model")
            .with_fix("pass the folder save_model (or save_model_sharded, or torch's HuggingFaceStorageWriter) wrote"));
        }
        let bytes = read_safetensors(&path, files::open_regular(&path, "model file")?)?;
        check_digest(&path, &bytes, None)?;
        return Ok((decode_tensors(&bytes, &path)?, dtypes_of(&bytes)));
    }
    let index_bytes = files::read_regular(&index_path, "model index")?;
    let index: Index = serde_json::from_slice(&index_bytes).map_err(|e| {
        corrupt(format!(
            "{} is not a valid index: {e}",
            index_path.display()
        ))
    })?;
    let mut files: Vec<&String> = index.weight_map.values().collect();
    files.sort();
    files.dedup();
    let mut out = BTreeMap::new();
    let mut dtypes = BTreeMap::new();
    let mut total = 0u64;
    for file in files {
        // A name read from the index: a regular file inside the folder.
        let (path, f) = files::open_inside(dir, file, "shard").map_err(|e| {
            let m = format!("{} names {file:?}: {}", index_path.display(), e.message());
            let out = Error::new(e.kind().clone(), m).with_op("load_model");
            match e.fix() {
                Some(fix) => out.with_fix(fix),
                None => out,
            }
        })?;
        let bytes = read_safetensors(&path, f)?;
        let indexed = index.metadata.digests.as_ref().and_then(|d| d.get(file));
        check_digest(&path, &bytes, indexed.map(String::as_str))?;
        let tensors = decode_tensors(&bytes, &path)?;
        dtypes.extend(dtypes_of(&bytes));
        // Stored bytes, whatever the dtype (decode_tensors checked the file).
        if let Ok(st) = safetensors::SafeTensors::deserialize(&bytes) {
            total += st
                .tensors()
                .iter()
                .map(|(_, v)| v.data().len() as u64)
                .sum::<u64>();
        }
        for (name, t) in tensors {
            match index.weight_map.get(&name) {
                Some(f) if f == file => {}
                _ => {
                    return Err(corrupt(format!(
                        "{} holds tensor {name:?}, which the index does not map to it",
                        path.display()
                    )))
                }
            }
            out.insert(name, t);
        }
    }
    for name in index.weight_map.keys() {
        if !out.contains_key(name) {
            return Err(corrupt(format!(
                "{} maps {name:?} to {}, which does not hold it",
                index_path.display(),
                index.weight_map[name]
            )));
        }
    }
    if total != index.metadata.total_size {
        return Err(corrupt(format!(
            "{} says total_size {} but its shards hold {total} bytes",
            index_path.display(),
            index.metadata.total_size
        )));
    }
    Ok((out, dtypes))
}

fn fill_model<P: Parameters + ?Sized>(
    model: &mut P,
    mut tensors: BTreeMap<String, Tensor>,
    stored: &BTreeMap<String, safetensors::Dtype>,
    dir: &Path,
    convert: bool,
) -> Result<()> {
    // A model that gives its shapes gets them checked (a flat tensor of
    // the right length, as a model without shapes saves, passes too), and
    // its element types unless converting.
    let mut own = BTreeMap::new();
    model.visit_params(&mut |p| {
        if let Some(t) = file_dtype(p.value.dtype()) {
            own.insert(p.name.to_string(), t);
        }
    });
    for (name, t) in &tensors {
        if let Some(shape) = model.param_shape(name) {
            if t.shape != shape && t.shape.len() > 1 {
                return Err(corrupt(format!(
                    "{}: tensor {name:?} has shape {:?}, the model's parameter {shape:?}",
                    dir.display(),
                    t.shape
                )));
            }
            let (want, got) = (own.get(name), stored.get(name));
            if let (false, Some(want), Some(got)) = (convert, want, got) {
                if want != got {
                    return Err(corrupt(format!(
                        "{}: tensor {name:?} is stored as {got:?}, the model's parameter is {want:?}",
                        dir.display()
                    ))
                    .with_fix("load with Accelerator::load_model_converting to convert it, or save the model in the parameter's type"));
                }
            }
        }
    }
    let mut err = None;
    let k = model.grad_kernels();
    let k = k.as_deref();
    model.visit_params_mut(&mut |p| {
        if err.is_some() {
            return;
        }
        match tensors.remove(p.name) {
            None => {
                err = Some(corrupt(format!(
                    "{} has no tensor {:?}",
                    dir.display(),
                    p.name
                )))
            }
            Some(t) if t.data.len() != p.value.len() => {
                err = Some(corrupt(format!(
                    "{}: tensor {:?} has {} values, the model's parameter {}",
                    dir.display(),
                    p.name,
                    t.data.len(),
                    p.value.len()
                )))
            }
            Some(t) => {
                if let Err(e) = super::grads::write_f32(k, p.name, p.value, &t.data) {
                    err = Some(e);
                }
            }
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    if let Some(extra) = tensors.keys().next() {
        return Err(corrupt(format!(
            "{} holds tensor {extra:?}, which the model does not have ({} unexpected in all)",
            dir.display(),
            tensors.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `shard_plan` on `(name, bytes)` cases, as `[[names of file 1], ...]`.
    fn plan(sizes: &[(&str, u64)], max: u64) -> Vec<Vec<String>> {
        let sizes: Vec<(String, u64)> = sizes.iter().map(|(n, s)| (n.to_string(), *s)).collect();
        shard_plan(&sizes, max)
            .into_iter()
            .map(|(_, g)| g)
            .collect()
    }

    fn names(groups: &[&[&str]]) -> Vec<Vec<String>> {
        groups
            .iter()
            .map(|g| g.iter().map(|n| n.to_string()).collect())
            .collect()
    }

    // Cases derived by hand from huggingface_hub's
    // split_state_dict_into_shards_factory (read, not copied): an oversized
    // tensor is appended as its own shard at once, the open shard keeps
    // filling and is appended when it closes or at the end.
    #[test]
    fn an_oversized_tensor_gets_its_own_shard_and_the_open_one_keeps_filling() {
        let sizes = [("a", 4), ("b", 4), ("c", 12), ("d", 4)];
        // c is oversized: its shard comes first, then {a, b}, then {d}.
        assert_eq!(plan(&sizes, 8), names(&[&["c"], &["a", "b"], &["d"]]));
        // At exactly the limit c is not oversized: it closes {a, b}.
        assert_eq!(plan(&sizes, 12), names(&[&["a", "b"], &["c"], &["d"]]));
        assert_eq!(plan(&sizes, 11), names(&[&["c"], &["a", "b"], &["d"]]));
        // The open shard keeps filling after an oversized tensor.
        assert_eq!(
            plan(&[("a", 4), ("c", 12), ("b", 4)], 8),
            names(&[&["c"], &["a", "b"]])
        );
        // huggingface_hub's docstring example: 10 GB, [6, 6, 2, 6, 2, 2].
        let doc = [
            ("t0", 6),
            ("t1", 6),
            ("t2", 2),
            ("t3", 6),
            ("t4", 2),
            ("t5", 2),
        ];
        assert_eq!(
            plan(&doc, 10),
            names(&[&["t0"], &["t1", "t2"], &["t3", "t4", "t5"]])
        );
        // Two oversized in a row, between fitting ones.
        let big = [("a", 3), ("B", 20), ("C", 30), ("d", 3), ("e", 5)];
        assert_eq!(plan(&big, 8), names(&[&["B"], &["C"], &["a", "d"], &["e"]]));
        // Exactly the limit fits; one byte more does not.
        assert_eq!(plan(&[("a", 8), ("b", 1)], 8), names(&[&["a"], &["b"]]));
        assert_eq!(plan(&[("a", 9), ("b", 1)], 8), names(&[&["a"], &["b"]]));
        assert_eq!(plan(&[("a", 4), ("b", 4)], 8), names(&[&["a", "b"]]));
        // Empty tensors never close a shard.
        assert_eq!(
            plan(&[("a", 8), ("z", 0), ("b", 1)], 8),
            names(&[&["a", "z"], &["b"]])
        );
    }

    #[test]
    fn one_group_is_the_plain_single_file_even_when_oversized() {
        let one = shard_plan(&[("w".to_string(), 100)], 8);
        assert_eq!(
            one,
            vec![("model.safetensors".to_string(), vec!["w".to_string()])]
        );
        let files: Vec<String> = shard_plan(&[("a".to_string(), 4), ("b".to_string(), 100)], 8)
            .into_iter()
            .map(|(f, _)| f)
            .collect();
        assert_eq!(
            files,
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors"
            ]
        );
        assert!(shard_plan(&[], 8).is_empty());
    }

    // Values as huggingface_hub's parse_size_to_int gives them (decimal
    // units, float values truncated by int()), plus transformers' binary
    // units.
    #[test]
    fn shard_sizes_parse_as_huggingface_hub_parses_them() {
        for (s, want) in [
            ("5GB", 5_000_000_000u64),
            ("5gb", 5_000_000_000),
            (" 5 GB ", 5_000_000_000),
            ("10GB", 10_000_000_000),
            ("1.5GB", 1_500_000_000),
            ("0.1GB", 100_000_000),
            ("100MB", 100_000_000),
            ("64KB", 64_000),
            ("2TB", 2_000_000_000_000),
            ("5GiB", 5 << 30),
            ("5gib", 5 << 30),
            ("1.5GiB", 3 << 29),
            ("512MiB", 512 << 20),
            ("64KiB", 64 << 10),
            ("1TiB", 1 << 40),
            ("12345", 12345),
            ("1e3KB", 1_000_000),
            ("2.9999999KB", 2999),
        ] {
            assert_eq!(parse_shard_size(s).unwrap(), want, "{s}");
        }
        for s in [
            "5B", "5 bytes", "5G", "GB", "-1GB", "nanGB", "infGB", "5XB", "", "1e30TB",
        ] {
            let e = parse_shard_size(s).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{s}");
            assert!(e.to_string().contains(&format!("{s:?}")), "{e}");
        }
        assert_eq!("5GB".shard_bytes().unwrap(), 5_000_000_000);
        assert_eq!(7u64.shard_bytes().unwrap(), 7);
        assert!((-1i64).shard_bytes().is_err());
        assert_eq!(shard_name(0, 3), "model-00001-of-00003.safetensors");
    }
}
