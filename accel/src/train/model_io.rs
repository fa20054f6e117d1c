//! `save_model` / `load_model`: a model's weights in the Hugging Face
//! layout, readable by `safetensors`, `transformers` and accel at any world
//! size.
//!
//! # Layout
//! A model of at most `max_shard_size` bytes is one file,
//! `model.safetensors`. A larger one is cut, in parameter order, into
//! `model-00001-of-0000N.safetensors`, ... (a new shard starts when the next
//! tensor would pass the limit; a tensor larger than the limit gets a shard
//! of its own) plus `model.safetensors.index.json`:
//!
//! ```json
//! {"metadata": {"total_size": 1234}, "weight_map": {"w": "model-00001-of-00002.safetensors", ...}}
//! ```
//!
//! `total_size` is the sum of the tensors' bytes. Each file's header carries
//! `{"format": "pt"}` as `transformers` writes it, plus [`DIGEST_KEY`]: the
//! SHA-256 of the file's data section, which the index's metadata also
//! records per shard; [`load_model`](crate::Accelerator::load_model)
//! checks both when present. Tensors are `f32`, 1-D
//! (the [`Parameters`] view is flat), named as the model names them.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use accel_api::{files, Error, ErrorKind, Result};
use accel_sharding::{sha256_hex, CheckpointWriter};
use serde::{Deserialize, Serialize};

use super::adapters::{Parameters, Tensor};
use super::checkpoint::{decode_tensors, encode_tensors_with};
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
fn encode_shard(tensors: &BTreeMap<String, Tensor>) -> Result<(Vec<u8>, String)> {
    let meta = |digest: Option<&str>| {
        let mut m = HashMap::from([("format".to_string(), "pt".to_string())]);
        if let Some(d) = digest {
            m.insert(DIGEST_KEY.to_string(), d.to_string());
        }
        Some(m)
    };
    // The data section does not depend on the header's metadata.
    let plain = encode_tensors_with(tensors, meta(None))?;
    let digest = sha256_hex(data_section(&plain));
    drop(plain);
    Ok((encode_tensors_with(tensors, meta(Some(&digest)))?, digest))
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

/// Cut `(name, bytes)` in order into shards of at most `max` bytes.
fn plan_shards(sizes: &[(String, u64)], max: u64) -> Vec<Vec<String>> {
    let mut shards: Vec<Vec<String>> = Vec::new();
    let mut current = u64::MAX; // forces a first shard
    for (name, size) in sizes {
        if shards.is_empty() || (current > 0 && current.saturating_add(*size) > max) {
            shards.push(Vec::new());
            current = 0;
        }
        shards.last_mut().expect("a shard").push(name.clone());
        current += size;
    }
    shards
}

impl Accelerator {
    /// Write `model`'s weights into `dir` in the Hugging Face layout:
    /// `model.safetensors` when the model has at most `max_shard_size`
    /// bytes, else `model-00001-of-0000N.safetensors`, ... cut in parameter
    /// order (a tensor larger than the limit gets a shard of its own) plus
    /// `model.safetensors.index.json` with `metadata.total_size` (the
    /// tensors' bytes) and the `weight_map` (Accelerate's `save_model`; pass
    /// [`DEFAULT_MAX_SHARD_SIZE`] for `transformers`' default). Pass the
    /// unwrapped model: `&*prepared` or `prepared.inner()`. Tensors are
    /// 1-D `f32` named as the model names its parameters; each header
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
    /// [`ErrorKind::InvalidArgument`] for a `max_shard_size` of 0 or a
    /// duplicate parameter name; [`ErrorKind::Io`] naming the path. A
    /// failure on the main process fails every rank.
    pub fn save_model<P: Parameters + ?Sized>(
        &self,
        model: &P,
        dir: impl AsRef<Path>,
        max_shard_size: u64,
    ) -> Result<PathBuf> {
        const OP: &str = "save_model";
        let dir = dir.as_ref();
        let written = if self.is_main_process() {
            write_model(model, dir, max_shard_size)
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
    /// reads the files itself. `f16`, `bf16` and `f64` tensors are
    /// converted to `f32`. A save killed between its two renames (no
    /// `dir`, the old folder at `.dir.old`) is first completed by the main
    /// process, with a warning in the log. Collective.
    ///
    /// # Errors
    /// [`ErrorKind::Corrupt`] naming the file or tensor when a file is not
    /// valid safetensors, the index does not match the shards (a missing
    /// tensor, a wrong `total_size`), or a parameter is missing, has another
    /// length, or the files hold a tensor the model does not have (strict,
    /// as PyTorch's `load_state_dict`), or a file's data does not match the
    /// [`DIGEST_KEY`] recorded in its header or the index;
    /// [`ErrorKind::Io`] when the folder has neither file. A failure on any rank fails every rank.
    pub fn load_model<P: Parameters + ?Sized>(
        &self,
        model: &mut P,
        dir: impl AsRef<Path>,
    ) -> Result<()> {
        const OP: &str = "load_model";
        let dir = dir.as_ref();
        // A save killed between its two renames: finish it once, on the
        // main process, before anyone reads.
        let recovered = if self.is_main_process() {
            super::checkpoint::recover_logged(OP, dir)
        } else {
            Ok(())
        };
        self.agree(OP, recovered)?;
        let tensors = read_model(dir);
        let loaded = tensors.and_then(|t| fill_model(model, t, dir));
        self.agree(OP, loaded)
    }
}

fn write_model<P: Parameters + ?Sized>(model: &P, dir: &Path, max: u64) -> Result<()> {
    const OP: &str = "save_model";
    if max == 0 {
        return Err(Error::invalid_argument(OP, "max_shard_size is 0").with_fix(
            "pass the largest shard in bytes, e.g. accel::train::DEFAULT_MAX_SHARD_SIZE",
        ));
    }
    let mut tensors: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut order: Vec<(String, u64)> = Vec::new();
    let mut dup = None;
    let mut failed = None;
    let k = model.grad_kernels();
    let k = k.as_deref();
    model.visit_params(&mut |p| {
        let data = match super::grads::read_f32(k, p.name, p.value) {
            Ok(d) => d,
            Err(e) => {
                failed.get_or_insert(e);
                return;
            }
        };
        let t = Tensor::from_vec(data);
        if tensors.insert(p.name.to_string(), t).is_some() {
            dup.get_or_insert_with(|| p.name.to_string());
        }
        order.push((p.name.to_string(), 4 * p.value.len() as u64));
    });
    if let Some(e) = failed {
        return Err(e);
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
        tracing::warn!(op = OP, "{what}");
    }
    if total <= max {
        w.write(SAFE_WEIGHTS_NAME, &encode_shard(&tensors)?.0)?;
    } else {
        let shards = plan_shards(&order, max);
        let mut weight_map = BTreeMap::new();
        let mut digests = BTreeMap::new();
        for (i, names) in shards.iter().enumerate() {
            let file = shard_name(i, shards.len());
            let part: BTreeMap<String, Tensor> = names
                .iter()
                .map(|n| {
                    (
                        n.clone(),
                        tensors.remove(n).expect("planned from the same names"),
                    )
                })
                .collect();
            let (bytes, digest) = encode_shard(&part)?;
            w.write(&file, &bytes)?;
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

fn corrupt(msg: String) -> Error {
    Error::new(ErrorKind::Corrupt, msg).with_op("load_model")
}

/// safetensors' own bound on a header (100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// Read the safetensors file `f` (opened from `path`, a regular file),
/// never more than its header declares: the header length, then the
/// header, then exactly the data its offsets cover, which must be the rest
/// of the file.
fn read_safetensors(path: &Path, f: fs::File) -> Result<Vec<u8>> {
    use std::io::Read;
    let len = f
        .metadata()
        .map_err(|e| Error::io(format!("cannot stat {}", path.display()), e))?
        .len();
    let bad = |m: String| corrupt(format!("{}: {m}", path.display()));
    let io = |e| Error::io(format!("cannot read {}", path.display()), e);
    let mut r = f.take(len);
    let mut n = [0u8; 8];
    r.read_exact(&mut n)
        .map_err(|_| bad(format!("{len} bytes, too short for a safetensors header")))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || 8 + n > len {
        return Err(bad(format!(
            "not safetensors: header length {n}, file of {len} bytes"
        )));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    bytes.extend_from_slice(&n.to_le_bytes());
    (&mut r).take(n).read_to_end(&mut bytes).map_err(io)?;
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&bytes[8..])
        .map_err(|e| {
            bad(format!(
                "not safetensors: the header is not a JSON object: {e}"
            ))
        })?;
    let end = header
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(_, v)| v["data_offsets"][1].as_u64())
        .try_fold(0u64, |m, e| e.map(|e| m.max(e)))
        .ok_or_else(|| bad("not safetensors: a tensor without data_offsets".to_string()))?;
    let declared = 8 + n + end;
    if declared != len {
        return Err(bad(format!(
            "holds {len} bytes, its header declares {declared}: truncated or padded"
        )));
    }
    r.read_to_end(&mut bytes).map_err(io)?;
    if bytes.len() as u64 != len {
        return Err(bad(format!(
            "changed while being read ({} of {len} bytes)",
            bytes.len()
        )));
    }
    Ok(bytes)
}

fn read_model(dir: &Path) -> Result<BTreeMap<String, Tensor>> {
    let index_path = dir.join(SAFE_WEIGHTS_INDEX_NAME);
    if !index_path.exists() {
        let path = dir.join(SAFE_WEIGHTS_NAME);
        if !path.exists() {
            return Err(Error::io(
                format!(
                    "{} holds neither {SAFE_WEIGHTS_NAME} nor {SAFE_WEIGHTS_INDEX_NAME}",
                    dir.display()
                ),
                std::io::Error::from(std::io::ErrorKind::NotFound),
            )
            .with_op("load_model")
            .with_fix("pass the folder save_model wrote"));
        }
        let bytes = read_safetensors(&path, files::open_regular(&path, "model file")?)?;
        check_digest(&path, &bytes, None)?;
        return decode_tensors(&bytes, &path);
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
    Ok(out)
}

fn fill_model<P: Parameters + ?Sized>(
    model: &mut P,
    mut tensors: BTreeMap<String, Tensor>,
    dir: &Path,
) -> Result<()> {
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

    #[test]
    fn shards_cut_in_order_and_a_big_tensor_gets_its_own() {
        let sizes: Vec<(String, u64)> = [("a", 4), ("b", 4), ("c", 12), ("d", 4)]
            .iter()
            .map(|(n, s)| (n.to_string(), *s))
            .collect();
        let names = |v: Vec<Vec<String>>| -> Vec<Vec<&'static str>> {
            v.iter()
                .map(|s| {
                    s.iter()
                        .map(|n| match n.as_str() {
                            "a" => "a",
                            "b" => "b",
                            "c" => "c",
                            _ => "d",
                        })
                        .collect()
                })
                .collect()
        };
        assert_eq!(
            names(plan_shards(&sizes, 8)),
            vec![vec!["a", "b"], vec!["c"], vec!["d"]]
        );
        assert_eq!(
            names(plan_shards(&sizes, 100)),
            vec![vec!["a", "b", "c", "d"]]
        );
        assert_eq!(shard_name(0, 3), "model-00001-of-00003.safetensors");
    }
}
