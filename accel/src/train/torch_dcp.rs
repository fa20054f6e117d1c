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
use accel_sharding::placement::chunk;
use accel_sharding::{temp_path_for, write_file_synced, CheckpointWriter};
use serde::{Deserialize, Serialize};

use super::adapters::{Parameters, Tensor};
use super::checkpoint::decode_tensors;
use super::safetensors_file::{encode_stored, read_safetensors, stored_params, ReadModel, Stored};
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
        const OP: &str = "save_model_sharded";
        let dir = dir.as_ref();
        let mut writer = None;
        let created = if self.is_main_process() {
            CheckpointWriter::create(dir).map(|w| writer = Some(w.without_manifest()))
        } else {
            Ok(())
        };
        self.agree(OP, created)?;
        let (rank, world) = (self.rank(), self.world_size());
        let written = encode_rank_shard(model, rank, world).and_then(|bytes| {
            let temp = temp_path_for(dir)?;
            write_file_synced(&temp.join(shard_file_name(rank)), &bytes)
        });
        self.agree(OP, written)?;
        let committed = match writer.take() {
            Some(w) => w.commit_replacing().map(|_| ()),
            None => Ok(()),
        };
        self.agree(OP, committed)?;
        Ok(dir.to_path_buf())
    }
}

/// Rank `rank`'s file: its chunk of dimension 0 of every parameter (a
/// scalar on rank 0 alone), with the offsets in the header.
fn encode_rank_shard<P: Parameters + ?Sized>(
    model: &P,
    rank: usize,
    world: usize,
) -> Result<Vec<u8>> {
    let mut mine: BTreeMap<String, Stored> = BTreeMap::new();
    let mut info: BTreeMap<String, Offsets> = BTreeMap::new();
    for (name, t) in stored_params(model)? {
        let Some(&rows) = t.shape.first() else {
            if rank == 0 {
                info.insert(
                    name.clone(),
                    Offsets {
                        saved_offsets: Vec::new(),
                    },
                );
                mine.insert(name, t);
            }
            continue;
        };
        let range = chunk(rows, world, rank);
        if range.is_empty() {
            continue;
        }
        let row_bytes = t.bytes.len() / rows.max(1);
        let mut shape = t.shape.clone();
        shape[0] = range.len();
        let mut offsets = vec![0; shape.len()];
        offsets[0] = range.start;
        let bytes = t.bytes[range.start * row_bytes..range.end * row_bytes].to_vec();
        info.insert(
            name.clone(),
            Offsets {
                saved_offsets: offsets,
            },
        );
        mine.insert(
            name,
            Stored {
                shape,
                dtype: t.dtype,
                bytes,
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
    encode_stored(&mine, Some(meta))
}

fn corrupt(msg: String) -> Error {
    Error::new(ErrorKind::Corrupt, msg).with_op("load_model")
}

/// What a folder without accel's files may hold instead: torch's sharded
/// Hugging Face layout (`Some`), torch's pickled `.metadata` (an error
/// naming the writer to use), or nothing torch wrote (`None`).
pub(super) fn read_if_torch(dir: &Path) -> Result<Option<ReadModel>> {
    let pickled = dir.join(".metadata");
    if pickled.exists() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "{} is torch.distributed.checkpoint's own metadata, a pickle, which accel \
                 never reads",
                pickled.display()
            ),
        )
        .with_op("load_model")
        .with_fix(
            "save with torch.distributed.checkpoint.HuggingFaceStorageWriter(path, \
             save_distributed=True) instead (or consolidate to model.safetensors), then load \
             that folder",
        ));
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(None);
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
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
    let total: usize = shape.iter().product();
    let mut data = vec![0f32; total];
    let mut seen = vec![false; total];
    let mut covered = 0usize;
    let strides: Vec<usize> = (0..rank).map(|d| shape[d + 1..].iter().product()).collect();
    for (off, t) in &parts {
        // Row by row of the last dimension: the row's place in the chunk,
        // then in the whole tensor.
        let inner = if rank == 0 { 1 } else { t.shape[rank - 1] };
        let rows = t.data.len().checked_div(inner).unwrap_or(0);
        for row in 0..rows {
            let mut rest = row;
            let mut at = if rank == 0 { 0 } else { off[rank - 1] };
            for d in (0..rank.saturating_sub(1)).rev() {
                let i = rest % t.shape[d];
                rest /= t.shape[d];
                at += (off[d] + i) * strides[d];
            }
            for j in 0..inner {
                let k = at + j;
                if seen[k] {
                    return Err(corrupt(format!(
                        "{}: two chunks of tensor {name:?} hold element {k}",
                        dir.display()
                    )));
                }
                seen[k] = true;
                data[k] = t.data[row * inner + j];
            }
            covered += inner;
        }
    }
    if covered != total {
        return Err(corrupt(format!(
            "{}: the chunks of tensor {name:?} cover {covered} of its {total} elements (shape \
             {shape:?}): a rank's file is missing",
            dir.display()
        )));
    }
    Ok(Tensor { shape, data })
}
