//! What `save_model` writes and `load_model` accepts (issues 32 and 29):
//! each file's data digest, bounded reads of regular files inside the
//! folder only, Hugging Face's shard grouping.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel::ErrorKind;

mod common;
use common::{single, Linear};
#[path = "../../test-support/special_files.rs"]
mod special_files;
use special_files::{mkfifo, timed};

fn model(v: f32) -> Linear {
    let mut m = Linear::new(5);
    m.w.iter_mut().for_each(|x| *x = v);
    m.b[0] = v;
    m
}

fn load_err(dir: &Path) -> accel::Error {
    let mut m = model(0.0);
    match single().load_model(&mut m, dir) {
        Ok(()) => panic!("{} loaded: {:?}", dir.display(), m.flat()),
        Err(e) => e,
    }
}

fn flip_last_byte(path: &Path) {
    let mut bytes = fs::read(path).unwrap();
    *bytes.last_mut().unwrap() ^= 0x01;
    fs::write(path, bytes).unwrap();
}

#[test]
fn a_flipped_data_byte_is_refused_naming_the_file() {
    // One file (the digest in its header) and shards (in the header and in
    // the index).
    for (limit, file) in [
        (1u64 << 20, "model.safetensors"),
        (12, "model-00002-of-00002.safetensors"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        single().save_model(&model(1.5), &dir, limit).unwrap();
        let mut m = model(0.0);
        single().load_model(&mut m, &dir).unwrap();
        assert_eq!(m.flat(), model(1.5).flat());
        flip_last_byte(&dir.join(file));
        let e = load_err(&dir);
        assert_eq!(e.kind(), &ErrorKind::Corrupt, "{e}");
        let msg = e.to_string();
        assert!(msg.contains(file) && msg.contains("SHA-256"), "{msg}");
    }
}

#[test]
fn a_shard_from_another_save_is_refused_by_the_index() {
    // Same names, same sizes, other values: each file is intact on its own,
    // but the folder would be a mix of two saves.
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    single().save_model(&model(1.0), &a, 12).unwrap();
    single().save_model(&model(2.0), &b, 12).unwrap();
    let shard = "model-00001-of-00002.safetensors";
    fs::copy(b.join(shard), a.join(shard)).unwrap();
    let msg = load_err(&a).to_string();
    assert!(msg.contains(shard) && msg.contains("the index"), "{msg}");
}

#[test]
fn files_written_elsewhere_without_a_digest_still_load() {
    // transformers' files carry no digest: the check is skipped, not failed.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    single().save_model(&model(0.5), &dir, 1 << 20).unwrap();
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    assert!(header["__metadata__"][accel::train::DIGEST_KEY].is_string());
    header["__metadata__"]
        .as_object_mut()
        .unwrap()
        .remove(accel::train::DIGEST_KEY);
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().div_ceil(8) * 8, b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    fs::write(&path, out).unwrap();
    let mut m = model(0.0);
    single().load_model(&mut m, &dir).unwrap();
    assert_eq!(m.flat(), model(0.5).flat());
}

// ------------------------------------------------- bounded reads (issue 32)

/// A folder saved sharded (two shards), for the cases to spoil.
fn sharded(root: &Path) -> PathBuf {
    let dir = root.join("m");
    single().save_model(&model(1.0), &dir, 12).unwrap();
    dir
}

fn rewrite_index(dir: &Path, shard: &str, to: &str) {
    let p = dir.join("model.safetensors.index.json");
    let text = fs::read_to_string(&p).unwrap().replace(shard, to);
    fs::write(p, text).unwrap();
}

/// `f` (which times its own call) must fail within 1 s naming `name`.
fn refused_within_1s(
    what: &str,
    name: &str,
    f: impl FnOnce() -> (accel::Result<()>, Duration) + Send + 'static,
) {
    let ((r, took), _) = timed(f);
    let e = r.expect_err(what);
    println!("{what}: {e}");
    assert!(took < Duration::from_secs(1), "{what}: took {took:?}");
    assert!(e.to_string().contains(name), "{what}: {e}");
}

/// Load `dir` with `load_model`, which must fail within 1 s naming `name`.
fn load_refused(dir: PathBuf, name: &str, what: &str) {
    refused_within_1s(what, name, move || {
        let acc = single();
        let mut m = model(0.0);
        let start = Instant::now();
        (acc.load_model(&mut m, &dir), start.elapsed())
    });
}

#[test]
fn a_fifo_shard_is_refused_at_once_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    // One file.
    let one = tmp.path().join("one");
    fs::create_dir(&one).unwrap();
    if !mkfifo(&one.join("model.safetensors")) {
        return;
    }
    load_refused(one, "model.safetensors", "a FIFO model.safetensors");
    // A shard the index names.
    let dir = sharded(tmp.path());
    let shard = dir.join("model-00002-of-00002.safetensors");
    fs::remove_file(&shard).unwrap();
    assert!(mkfifo(&shard));
    load_refused(dir, "model-00002-of-00002.safetensors", "a FIFO shard");
}

#[cfg(unix)]
#[test]
fn a_shard_linked_to_dev_zero_is_refused_at_once_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sharded(tmp.path());
    let shard = dir.join("model-00001-of-00002.safetensors");
    fs::remove_file(&shard).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &shard).unwrap();
    load_refused(dir, "model-00001-of-00002.safetensors", "/dev/zero");
    let one = tmp.path().join("one");
    fs::create_dir(&one).unwrap();
    std::os::unix::fs::symlink("/dev/zero", one.join("model.safetensors")).unwrap();
    load_refused(one, "model.safetensors", "/dev/zero as the single file");
}

#[test]
fn an_index_naming_a_file_outside_the_folder_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = sharded(tmp.path());
    rewrite_index(&dir, "model-00001-of-00002.safetensors", "../../etc/passwd");
    load_refused(dir, "../../etc/passwd", "an index naming ../../etc/passwd");
    // A symlink out of the folder, even to a valid shard, is refused too;
    // one that stays inside is followed.
    #[cfg(unix)]
    {
        let dir = tmp.path().join("m");
        fs::remove_dir_all(&dir).unwrap();
        let dir = sharded(tmp.path());
        let outside = tmp.path().join("elsewhere.safetensors");
        let shard = dir.join("model-00001-of-00002.safetensors");
        fs::rename(&shard, &outside).unwrap();
        std::os::unix::fs::symlink(&outside, &shard).unwrap();
        load_refused(
            dir.clone(),
            "model-00001-of-00002.safetensors",
            "a symlink out",
        );
        fs::remove_file(&shard).unwrap();
        fs::rename(&outside, dir.join("real")).unwrap();
        std::os::unix::fs::symlink("real", &shard).unwrap();
        let mut m = model(0.0);
        single().load_model(&mut m, &dir).unwrap();
        assert_eq!(m.flat(), model(1.0).flat());
    }
}

#[test]
fn a_file_longer_or_shorter_than_its_header_declares_is_refused() {
    for (cut, what) in [(false, "padded"), (true, "truncated")] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        single().save_model(&model(1.0), &dir, 1 << 20).unwrap();
        let p = dir.join("model.safetensors");
        let mut bytes = fs::read(&p).unwrap();
        if cut {
            bytes.truncate(bytes.len() - 3);
        } else {
            bytes.extend_from_slice(&[0u8; 4096]);
        }
        fs::write(&p, bytes).unwrap();
        let e = load_err(&dir);
        assert_eq!(e.kind(), &ErrorKind::Corrupt, "{what}: {e}");
        assert!(
            e.to_string().contains("model.safetensors") && e.to_string().contains("declares"),
            "{what}: {e}"
        );
    }
}

/// A `save_state_to` checkpoint of one prepared model.
fn checkpoint(root: &Path) -> PathBuf {
    let dir = root.join("ckpt");
    let acc = single();
    let m = acc.prepare_model(model(1.0)).unwrap();
    acc.save_state_to(&dir, &[&m]).unwrap();
    dir
}

/// Load `dir` with `load_state`, which must fail within 1 s naming `name`.
fn state_refused(dir: PathBuf, name: &str, what: &str) {
    refused_within_1s(what, name, move || {
        let acc = single();
        let mut m = acc.prepare_model(model(0.0)).unwrap();
        let start = Instant::now();
        let r = acc.load_state(&dir, &mut [&mut m]).map(|_| ());
        (r, start.elapsed())
    });
}

#[test]
fn load_state_refuses_fifos_devices_and_names_outside_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let file = "model_0.safetensors";
    // A FIFO in place of a listed file.
    let dir = checkpoint(tmp.path());
    fs::remove_file(dir.join(file)).unwrap();
    if !mkfifo(&dir.join(file)) {
        return;
    }
    state_refused(dir.clone(), file, "a FIFO checkpoint file");
    // /dev/zero in place of a listed file.
    #[cfg(unix)]
    {
        fs::remove_file(dir.join(file)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", dir.join(file)).unwrap();
        state_refused(dir.clone(), file, "/dev/zero");
    }
    // A manifest (with a correct digest of its own) naming a file outside.
    fs::remove_dir_all(&dir).unwrap();
    let dir = checkpoint(tmp.path());
    let mpath = dir.join(accel_sharding::MANIFEST_FILE);
    let mut m: accel_sharding::Manifest =
        serde_json::from_slice(&fs::read(&mpath).unwrap()).unwrap();
    let entry = m.files.remove("accelerator.json").unwrap();
    m.files.insert("../../etc/passwd".into(), entry);
    m.digest = Some(m.compute_digest());
    fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    state_refused(
        dir,
        "../../etc/passwd",
        "a manifest naming ../../etc/passwd",
    );
}
