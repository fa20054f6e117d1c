//! What `save_model` writes and `load_model` accepts (issues 32 and 29):
//! each file's data digest, bounded reads of regular files inside the
//! folder only, Hugging Face's shard grouping.

use std::fs;
use std::path::Path;

use accel::ErrorKind;

mod common;
use common::{single, Linear};

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
