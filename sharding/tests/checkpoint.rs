//! Atomic checkpoint directories, manifests and automatic naming.

use std::fs;

use accel_api::ErrorKind;
use accel_sharding::{
    parse_checkpoint_name, read_manifest, read_verified, verify_checkpoint, write_file_synced,
    CheckpointDir, CheckpointWriter, FileEntry, MANIFEST_FILE,
};

fn save(dir: &std::path::Path) {
    let mut w = CheckpointWriter::create(dir).unwrap();
    w.write("model.safetensors", &[7u8; 1000]).unwrap();
    w.write_json("sampler.json", &serde_json::json!({"epoch": 2}))
        .unwrap();
    // Another rank writing straight into the temporary directory.
    let shared = accel_sharding::temp_path_for(dir).unwrap();
    assert_eq!(shared, w.temp_path());
    write_file_synced(&shared.join("rng/rank_1.json"), b"{}").unwrap();
    let m = w.commit().unwrap();
    assert_eq!(
        m.files.keys().cloned().collect::<Vec<_>>(),
        vec!["model.safetensors", "rng/rank_1.json", "sampler.json"]
    );
}

#[test]
fn a_committed_checkpoint_verifies_and_leaves_no_temporary() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    save(&dir);
    let m = verify_checkpoint(&dir).unwrap();
    assert_eq!(m.files["model.safetensors"].size, 1000);
    assert_eq!(read_verified(&dir, &m, "rng/rank_1.json").unwrap(), b"{}");
    let names: Vec<_> = fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec!["ckpt"]);
    // Saving again over it needs an explicit replace.
    let mut w = CheckpointWriter::create(&dir).unwrap();
    w.write("a", b"new").unwrap();
    assert_eq!(w.commit().unwrap_err().kind(), &ErrorKind::InvalidArgument);
    let mut w = CheckpointWriter::create(&dir).unwrap();
    w.write("a", b"new").unwrap();
    w.commit_replacing().unwrap();
    assert_eq!(verify_checkpoint(&dir).unwrap().files.len(), 1);
    assert_eq!(fs::read_dir(root.path()).unwrap().count(), 1);
}

#[test]
fn an_uncommitted_writer_leaves_nothing() {
    let root = tempfile::tempdir().unwrap();
    {
        let mut w = CheckpointWriter::create(root.path().join("c")).unwrap();
        w.write("x", b"1").unwrap();
    }
    assert_eq!(fs::read_dir(root.path()).unwrap().count(), 0);
}

#[test]
fn truncated_corrupted_or_missing_files_are_named() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("c");
    save(&dir);
    let model = dir.join("model.safetensors");

    fs::write(&model, [7u8; 999]).unwrap();
    let err = verify_checkpoint(&dir).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::Corrupt);
    assert!(
        err.to_string().contains("model.safetensors") && err.to_string().contains("truncated"),
        "{err}"
    );

    let mut bytes = vec![7u8; 1000];
    bytes[500] = 8;
    fs::write(&model, &bytes).unwrap();
    let err = verify_checkpoint(&dir).unwrap_err();
    assert!(
        err.to_string().contains("model.safetensors") && err.to_string().contains("corrupted"),
        "{err}"
    );
    let m = read_manifest(&dir).unwrap();
    assert_eq!(
        read_verified(&dir, &m, "model.safetensors")
            .unwrap_err()
            .kind(),
        &ErrorKind::Corrupt
    );
    assert_eq!(
        read_verified(&dir, &m, "sampler.json").unwrap(),
        fs::read(dir.join("sampler.json")).unwrap()
    );

    fs::remove_file(&model).unwrap();
    let err = verify_checkpoint(&dir).unwrap_err();
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
    let err = verify_checkpoint(&dir).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::Corrupt);
    assert!(err.to_string().contains(MANIFEST_FILE), "{err}");
}

#[test]
fn files_of_other_writers_are_checked_against_what_they_wrote() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("ckpt");
    let mut w = CheckpointWriter::create(&dir).unwrap();
    let temp = w.temp_path().to_path_buf();
    write_file_synced(&temp.join("rank_1/a.json"), b"same").unwrap();
    write_file_synced(&temp.join("rank_1/b.json"), b"short").unwrap();
    write_file_synced(&temp.join("rank_1/c.json"), b"other").unwrap();
    let expected: std::collections::BTreeMap<String, FileEntry> = [
        ("rank_1/a.json", FileEntry::of(b"same")),
        ("rank_1/b.json", FileEntry::of(b"longer")),
        ("rank_1/c.json", FileEntry::of(b"thing")),
        ("rank_1/d.json", FileEntry::of(b"elsewhere")),
        ("../e.json", FileEntry::of(b"")),
    ]
    .into_iter()
    .map(|(n, e)| (n.to_string(), e))
    .collect();
    let bad = w.check_files(&expected).unwrap();
    assert_eq!(
        bad,
        [
            ("../e.json", "not a valid file name"),
            ("rank_1/b.json", "5 bytes, 6 written"),
            ("rank_1/c.json", "another SHA-256 than written"),
            ("rank_1/d.json", "missing"),
        ]
        .map(|(n, w)| (n.to_string(), w.to_string()))
    );
    // The files found as written go into the manifest with their entries.
    let m = w.commit().unwrap();
    assert_eq!(m.files["rank_1/a.json"], FileEntry::of(b"same"));
    assert_eq!(m.files.len(), 3);
    verify_checkpoint(&dir).unwrap();
}

#[test]
fn bad_names_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let mut w = CheckpointWriter::create(root.path().join("c")).unwrap();
    for bad in ["../x", "/abs", MANIFEST_FILE, ""] {
        assert_eq!(
            w.write(bad, b"").unwrap_err().kind(),
            &ErrorKind::InvalidArgument,
            "{bad}"
        );
    }
}

#[test]
fn numbering_and_pruning_go_by_number() {
    assert_eq!(parse_checkpoint_name("checkpoint_10"), Some(10));
    for bad in [
        "checkpoint_",
        "checkpoint_1a",
        "checkpoint_-1",
        "ckpt_1",
        ".checkpoint_3.partial",
    ] {
        assert_eq!(parse_checkpoint_name(bad), None, "{bad}");
    }
    let root = tempfile::tempdir().unwrap();
    let dirs = CheckpointDir::new(root.path().join("checkpoints"), Some(2));
    assert_eq!(dirs.next_iteration().unwrap(), 0);
    for n in [9, 10, 2, 11] {
        let mut w = dirs.begin(n).unwrap();
        w.write("n", n.to_string().as_bytes()).unwrap();
        w.commit().unwrap();
    }
    fs::create_dir_all(root.path().join("checkpoints/.checkpoint_12.partial")).unwrap();
    fs::write(
        root.path().join("checkpoints/checkpoint_99"),
        b"a file, not a checkpoint",
    )
    .unwrap();
    let numbers: Vec<u64> = dirs.list().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(numbers, vec![2, 9, 10, 11]);
    assert_eq!(dirs.latest().unwrap().unwrap().0, 11);
    assert_eq!(dirs.next_iteration().unwrap(), 12);
    let removed = dirs.prune().unwrap();
    assert_eq!(removed, vec![dirs.path_of(2), dirs.path_of(9)]);
    let numbers: Vec<u64> = dirs.list().unwrap().into_iter().map(|(n, _)| n).collect();
    assert_eq!(numbers, vec![10, 11]);
    assert_eq!(
        dirs.begin(11).unwrap_err().kind(),
        &ErrorKind::InvalidArgument
    );
    // A fresh handle (a resumed run) continues the numbering.
    assert_eq!(
        CheckpointDir::new(dirs.root(), None)
            .next_iteration()
            .unwrap(),
        12
    );
}
