//! Files named by an index (a checkpoint's `model.safetensors.index.json`,
//! Accelerate's offload `index.json`) are opened only when they are regular
//! files inside the folder the index belongs to (issue 32): a FIFO, a
//! symlink to `/dev/zero` and `../../etc/passwd` end within 1 s with an
//! error naming the file.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use accel_api::{DType, OffloadStore, TensorMeta};
use accel_offload::safetensors::{write_sharded, Checkpoint};
use accel_offload::store::AccelerateFolder;

use accel_test_support::special_files;
use special_files::{mkfifo, timed};

/// `f()` must fail within 1 s naming `name`.
fn refused_within_1s<T: Send + 'static>(
    what: &str,
    name: &str,
    f: impl FnOnce() -> accel_api::Result<T> + Send + 'static,
) {
    let (r, took) = timed(move || f().err().map(|e| e.to_string()));
    let msg = r.unwrap_or_else(|| panic!("{what}: accepted"));
    println!("{what}: {msg}");
    assert!(took < Duration::from_secs(1), "{what}: took {took:?}");
    assert!(msg.contains(name), "{what}: {msg}");
}

/// A checkpoint of three 10-byte tensors in three shards.
fn sharded(root: &Path) -> PathBuf {
    let dir = root.join("ck");
    let m = TensorMeta {
        dtype: DType::U8,
        shape: vec![10],
    };
    let bufs: Vec<Vec<u8>> = (0..3u8).map(|i| vec![i; 10]).collect();
    let names = ["a", "b", "c"];
    let ts: Vec<_> = names
        .iter()
        .zip(&bufs)
        .map(|(n, b)| (*n, &m, &b[..]))
        .collect();
    write_sharded(&dir, &ts, 10).unwrap();
    Checkpoint::open(&dir).unwrap();
    dir
}

const SHARD: &str = "model-00002-of-00003.safetensors";

#[test]
fn a_checkpoint_index_opens_only_regular_files_inside_its_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sharded(tmp.path());
    fs::remove_file(dir.join(SHARD)).unwrap();
    if !mkfifo(&dir.join(SHARD)) {
        return;
    }
    let d = dir.clone();
    refused_within_1s("a FIFO shard", SHARD, move || Checkpoint::open(&d));
    #[cfg(unix)]
    {
        fs::remove_file(dir.join(SHARD)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join(SHARD)).unwrap();
        let d = dir.clone();
        refused_within_1s("/dev/zero", SHARD, move || Checkpoint::open(&d));
    }
    let idx = dir.join("model.safetensors.index.json");
    let text = fs::read_to_string(&idx).unwrap();
    fs::write(&idx, text.replace(SHARD, "../../etc/passwd")).unwrap();
    refused_within_1s("../../etc/passwd", "../../etc/passwd", move || {
        Checkpoint::open(&dir)
    });
}

#[test]
fn an_offload_index_opens_only_regular_files_inside_its_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("offload");
    fs::create_dir(&dir).unwrap();
    // A `.dat` file that is a FIFO: refused when the tensor is read.
    fs::write(
        dir.join("index.json"),
        r#"{"w": {"dtype": "float32", "shape": [2]}}"#,
    )
    .unwrap();
    if !mkfifo(&dir.join("w.dat")) {
        return;
    }
    let d = dir.clone();
    refused_within_1s("a FIFO .dat file", "w.dat", move || {
        let s = AccelerateFolder::open(&d)?;
        let v = s.get("w")?.into_owned();
        Ok(v)
    });
    // A tensor name that walks out of the folder; a safetensors entry
    // naming a file outside.
    for (index, read) in [
        (
            r#"{"../../etc/passwd": {"dtype": "uint8", "shape": [1]}}"#,
            true,
        ),
        (
            r#"{"w": {"safetensors_file": "../../etc/passwd", "weight_name": "w"}}"#,
            false,
        ),
    ] {
        fs::write(dir.join("index.json"), index).unwrap();
        let d = dir.clone();
        refused_within_1s(index, "../../etc/passwd", move || {
            let s = AccelerateFolder::open(&d)?;
            if read {
                s.get("../../etc/passwd")?;
            }
            Ok(())
        });
    }
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink("/dev/zero", dir.join("zero.safetensors")).unwrap();
        fs::write(
            dir.join("index.json"),
            r#"{"w": {"safetensors_file": "zero.safetensors", "weight_name": "w"}}"#,
        )
        .unwrap();
        refused_within_1s(
            "safetensors_file -> /dev/zero",
            "zero.safetensors",
            move || AccelerateFolder::open(&dir),
        );
    }
}
