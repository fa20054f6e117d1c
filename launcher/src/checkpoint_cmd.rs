//! `accel checkpoint inspect|verify DIR`, `accel checkpoint consolidate SRC
//! DST` (whole weights from per-rank shards: `accel::train::consolidate_model`):
//! what an accel checkpoint folder
//! (`save_state`'s `checkpoint_N`, or a folder of them: the newest) holds,
//! and whether every file matches its manifest; and the same for a folder
//! in torch's per-rank distributed-checkpoint layout
//! (`HuggingFaceStorageWriter(save_distributed=True)`, `save_model_sharded`):
//! its files, each tensor's chunks and their offsets, the world size it was
//! saved at, and whether the chunks cover every tensor exactly once.
//!
//! `inspect` reads `accelerator.json` (the iteration, the world size it was
//! saved at, the objects) and the header of every safetensors file (its
//! tensors' names, element types and shapes: the format's 8-byte length and
//! JSON header, no tensor data read). `verify` checks the manifest's own
//! checksum and every file's size and SHA-256 (`accel_sharding::verify_checkpoint`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use accel_api::{Error, ErrorKind, Result};
use accel_offload::util::format_bytes;
use accel_sharding::{read_manifest, verify_checkpoint, CheckpointDir};
use serde::Serialize;

/// Arguments of `accel checkpoint`.
#[derive(Debug, clap::Args)]
pub struct CheckpointArgs {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, clap::Subcommand)]
enum What {
    /// The checkpoint's iteration, world size, objects, files and tensors
    /// (for torch's per-rank layout: files, chunks and their offsets).
    Inspect {
        /// A `checkpoint_N` folder, a folder of them (the newest), or a
        /// folder in torch's per-rank layout.
        dir: PathBuf,
        /// Print JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Check the manifest and every file's size and checksum (for torch's
    /// per-rank layout: that the chunks cover every tensor exactly once);
    /// exit 1 naming the first file or tensor that does not.
    Verify {
        /// A `checkpoint_N` folder, a folder of them (the newest), or a
        /// folder in torch's per-rank layout.
        dir: PathBuf,
    },
    /// Whole model weights from per-rank shards (torch's distributed
    /// checkpoint with HuggingFaceStorageWriter, or save_model_sharded's),
    /// or from a model folder: `model.safetensors` (and an index when
    /// larger than --max-shard-size) in DST.
    Consolidate {
        /// The folder of shards (or of a model).
        src: PathBuf,
        /// The folder to write (replaced atomically).
        dst: PathBuf,
        /// The largest file, bytes or a size such as 5GB.
        #[arg(long, default_value = "5GB")]
        max_shard_size: String,
    },
}

/// One tensor of a safetensors file (in torch's per-rank layout, a chunk
/// of one, with its offsets in the whole tensor).
#[derive(Debug, Serialize, PartialEq)]
struct Tensor {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    offsets: Option<Vec<u64>>,
}

/// One file of the checkpoint.
#[derive(Debug, Serialize)]
struct File {
    name: String,
    bytes: u64,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tensors: Vec<Tensor>,
}

/// What `inspect` says.
#[derive(Debug, Serialize)]
struct Inspection {
    format: &'static str,
    dir: PathBuf,
    iteration: Option<u64>,
    world_size: Option<u64>,
    objects: Vec<String>,
    files: Vec<File>,
}

/// Run `accel checkpoint`.
///
/// # Errors
/// A folder that is not a checkpoint (naming it); a file that does not
/// match the manifest (`verify`); unreadable files.
pub fn run(args: CheckpointArgs) -> Result<ExitCode> {
    match args.what {
        What::Inspect { dir, json } => {
            let i = match torch_layout(&dir)? {
                Some(index) => inspect_torch(&dir, &index),
                None => inspect(&resolve(&dir)?)?,
            };
            if json {
                outln!("{}", serde_json::to_string_pretty(&i).expect("json"));
            } else {
                out!("{}", table(&i));
            }
        }
        What::Verify { dir } => {
            if let Some(index) = torch_layout(&dir)? {
                index.check()?;
                let bytes: u64 = index.files.iter().map(|f| f.1).sum();
                outln!(
                    "{}: torch's per-rank layout, {} files, {}, {} tensors, every element held \
                     by exactly one chunk",
                    dir.display(),
                    index.files.len(),
                    format_bytes(bytes),
                    index.tensors.len()
                );
                return Ok(ExitCode::SUCCESS);
            }
            let dir = resolve(&dir)?;
            let m = verify_checkpoint(&dir)?;
            let bytes: u64 = m.files.values().map(|f| f.size).sum();
            outln!(
                "{}: {} files, {}, every size and checksum matches the manifest",
                dir.display(),
                m.files.len(),
                format_bytes(bytes)
            );
        }
        What::Consolidate {
            src,
            dst,
            max_shard_size,
        } => {
            accel::train::consolidate_model(&src, &dst, max_shard_size.as_str())?;
            outln!(
                "{} -> {}: whole weights written",
                src.display(),
                dst.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `dir`'s files and chunks when it is in torch's per-rank layout (and
/// not an accel checkpoint).
fn torch_layout(dir: &Path) -> Result<Option<accel::train::DcpIndex>> {
    if dir.join(accel_sharding::MANIFEST_FILE).exists() || !dir.is_dir() {
        return Ok(None);
    }
    accel::train::dcp_index(dir)
}

fn inspect_torch(dir: &Path, index: &accel::train::DcpIndex) -> Inspection {
    let u = |v: &[usize]| v.iter().map(|&n| n as u64).collect();
    Inspection {
        format: "torch-dcp",
        dir: dir.to_path_buf(),
        iteration: None,
        world_size: Some(index.world_size() as u64),
        objects: vec!["model".into()],
        files: index
            .files
            .iter()
            .map(|(name, bytes, chunks)| File {
                name: name.clone(),
                bytes: *bytes,
                tensors: chunks
                    .iter()
                    .map(|c| Tensor {
                        name: c.name.clone(),
                        dtype: c.dtype.clone(),
                        shape: u(&c.shape),
                        offsets: Some(u(&c.offsets)),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// `dir` itself when it has a manifest, else its newest `checkpoint_N`.
fn resolve(dir: &Path) -> Result<PathBuf> {
    if dir.join(accel_sharding::MANIFEST_FILE).exists() {
        return Ok(dir.to_path_buf());
    }
    match CheckpointDir::new(dir, None).latest()? {
        Some((_, p)) => Ok(p),
        None => Err(Error::new(
            ErrorKind::InvalidArgument,
            format!(
                "{} is not an accel checkpoint (no {}), holds no checkpoint_N folder, and is not \
                 in torch's per-rank layout (no safetensors file with {})",
                dir.display(),
                accel_sharding::MANIFEST_FILE,
                accel::train::DCP_SHARDING_INFO
            ),
        )
        .with_op("accel checkpoint")
        .with_fix(
            "pass a folder save_state wrote (checkpoint_N), the folder it saves into, or a \
             folder of per-rank shards (save_model_sharded, torch's HuggingFaceStorageWriter)",
        )),
    }
}

fn inspect(dir: &Path) -> Result<Inspection> {
    let manifest = read_manifest(dir)?;
    let meta: serde_json::Value = std::fs::read(dir.join("accelerator.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(serde_json::Value::Null);
    let mut files = Vec::new();
    for (name, entry) in &manifest.files {
        let tensors = if name.ends_with(".safetensors") {
            header_tensors(&dir.join(name))?
        } else {
            Vec::new()
        };
        files.push(File {
            name: name.clone(),
            bytes: entry.size,
            tensors,
        });
    }
    Ok(Inspection {
        format: "accel",
        dir: dir.to_path_buf(),
        iteration: meta["iteration"].as_u64(),
        world_size: meta["world_size"].as_u64(),
        objects: meta["objects"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|o| o.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        files,
    })
}

/// The tensors a safetensors file's header lists, in name order.
fn header_tensors(path: &Path) -> Result<Vec<Tensor>> {
    let header =
        accel::train::safetensors_header(path).map_err(|e| e.with_op("accel checkpoint"))?;
    let map: BTreeMap<String, serde_json::Value> = match header {
        serde_json::Value::Object(m) => m.into_iter().collect(),
        _ => {
            return Err(Error::new(
                ErrorKind::Corrupt,
                format!("{}: the header is not a JSON object", path.display()),
            )
            .with_op("accel checkpoint"))
        }
    };
    Ok(map
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(name, v)| Tensor {
            name,
            dtype: v["dtype"].as_str().unwrap_or("?").to_string(),
            shape: v["shape"]
                .as_array()
                .map(|s| s.iter().filter_map(serde_json::Value::as_u64).collect())
                .unwrap_or_default(),
            offsets: None,
        })
        .collect())
}

fn table(i: &Inspection) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let total: u64 = i.files.iter().map(|f| f.bytes).sum();
    let _ = writeln!(
        s,
        "{} ({}): iteration {}, saved at world size {}, {} files, {}",
        i.dir.display(),
        match i.format {
            "accel" => "accel checkpoint",
            _ => "torch's per-rank distributed-checkpoint layout",
        },
        i.iteration.map_or("-".into(), |n| n.to_string()),
        i.world_size.map_or("?".into(), |n| n.to_string()),
        i.files.len(),
        format_bytes(total)
    );
    let _ = writeln!(s, "objects: {}", i.objects.join(", "));
    for f in &i.files {
        let _ = writeln!(s, "{:>12}  {}", format_bytes(f.bytes), f.name);
        for t in &f.tensors {
            let at = t
                .offsets
                .as_ref()
                .map_or(String::new(), |o| format!(" at {o:?}"));
            let _ = writeln!(s, "{:>12}    {} {} {:?}{at}", "", t.name, t.dtype, t.shape);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_read_and_bad_ones_named() {
        let d = tempfile::tempdir().unwrap();
        let header = br#"{"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"__metadata__":{"a":"b"}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&[0u8; 24]);
        let p = d.path().join("m.safetensors");
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(
            header_tensors(&p).unwrap(),
            vec![Tensor {
                name: "w".into(),
                dtype: "F32".into(),
                shape: vec![2, 3],
                offsets: None,
            }]
        );
        std::fs::write(&p, 1_000_000u64.to_le_bytes()).unwrap();
        let e = header_tensors(&p).unwrap_err().to_string();
        assert!(e.contains("m.safetensors") && e.contains("header"), "{e}");
        assert!(resolve(d.path())
            .unwrap_err()
            .to_string()
            .contains("not an accel checkpoint"));
    }
}
