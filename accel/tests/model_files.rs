//! What `save_model` writes and `load_model` accepts (issues 32 and 29):
//! each file's data digest, bounded reads of regular files inside the
//! folder only, Hugging Face's shard grouping.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use accel::ErrorKind;

mod common;
use accel_test_support::special_files;
use common::{single, Linear};
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

// ------------------------------------ Hugging Face's shard grouping (issue 29)

/// A model of named 1-D parameters of the given lengths.
struct Named(Vec<(String, Vec<f32>, Vec<f32>)>);

impl Named {
    fn new(lens: &[usize]) -> Named {
        Named(
            lens.iter()
                .enumerate()
                .map(|(i, &n)| (format!("t{i:02}"), vec![i as f32; n], vec![0.0; n]))
                .collect(),
        )
    }
}

impl accel::train::Parameters for Named {
    fn visit_params(&self, f: &mut dyn FnMut(accel::train::ParamRef<'_>)) {
        for (n, v, g) in &self.0 {
            f(accel::train::ParamRef::host(n, v, g));
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(accel::train::ParamMut<'_>)) {
        for (n, v, g) in &mut self.0 {
            f(accel::train::ParamMut::host(n, v, g));
        }
    }
}

/// One grouping case: element counts, bytes per element, the limit (bytes,
/// or a size string huggingface_hub parses).
#[derive(serde::Serialize)]
struct Case {
    numel: Vec<usize>,
    elem: u64,
    limit: serde_json::Value,
}

/// 40 cases from a fixed seed (1 to 40 tensors, f32 and bf16 sizes,
/// limits low enough that most cases hold tensors larger than the limit)
/// and four by hand.
fn cases() -> Vec<Case> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    (0..40)
        .map(|c| {
            let n = 1 + (c * 13 % 40) as usize;
            let numel: Vec<usize> = (0..n)
                .map(|_| {
                    if next(5) == 0 {
                        100 + next(200) as usize
                    } else {
                        1 + next(40) as usize
                    }
                })
                .collect();
            let elem = if c % 2 == 0 { 4 } else { 2 };
            let biggest = *numel.iter().max().unwrap() as u64 * elem;
            let bytes = 8 + next(biggest);
            // Every fourth limit as a decimal size string.
            let limit = if c % 4 == 1 {
                serde_json::json!(format!("{}KB", bytes as f64 / 1000.0))
            } else {
                serde_json::json!(bytes)
            };
            Case { numel, elem, limit }
        })
        .chain(
            [
                // One oversized tensor: a plain model.safetensors, as HF writes.
                (vec![300], 4, serde_json::json!(100)),
                (vec![300], 2, serde_json::json!("0.1KB")),
                // Everything fits: one file.
                (vec![10, 20, 30], 4, serde_json::json!("5GB")),
                (vec![10, 300, 5], 4, serde_json::json!(100)),
            ]
            .map(|(numel, elem, limit)| Case { numel, elem, limit }),
        )
        .collect()
}

/// A Python with torch and huggingface_hub: `ACCEL_TORCH_PYTHON`, else the
/// torch venv `make torch-venv` makes. `None` prints why (under CI it fails).
fn python_with_hub() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    common::python_from(
        common::torch_python_candidates(&root),
        "import torch, huggingface_hub",
        "`make torch-venv` makes one",
    )
}

const HUB_SCRIPT: &str = r#"
import json, sys, torch
from huggingface_hub import split_torch_state_dict_into_shards
out = []
for case in json.load(sys.stdin):
    dtype = torch.float32 if case["elem"] == 4 else torch.bfloat16
    sd = {f"t{i:02}": torch.empty(n, dtype=dtype) for i, n in enumerate(case["numel"])}
    split = split_torch_state_dict_into_shards(sd, max_shard_size=case["limit"])
    out.append({
        "files": [[f, names] for f, names in split.filename_to_tensors.items()],
        "total_size": split.metadata["total_size"],
        "is_sharded": split.is_sharded,
    })
print(json.dumps(out))
"#;

#[test]
fn shard_grouping_matches_huggingface_hub() {
    let Some(py) = python_with_hub() else {
        return;
    };
    let cases = cases();
    let mut child = std::process::Command::new(&py)
        .args(["-c", HUB_SCRIPT])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    serde_json::to_writer(child.stdin.take().unwrap(), &cases).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "python failed");
    let hub: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    let (mut oversized_cases, mut single_oversized) = (0, 0);
    for (c, (case, want)) in cases.iter().zip(&hub).enumerate() {
        let limit = match &case.limit {
            serde_json::Value::String(s) => accel::train::parse_shard_size(s).unwrap(),
            v => v.as_u64().unwrap(),
        };
        let sizes: Vec<(String, u64)> = case
            .numel
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("t{i:02}"), n as u64 * case.elem))
            .collect();
        let total: u64 = sizes.iter().map(|(_, s)| s).sum();
        let plan = accel::train::shard_plan(&sizes, limit);
        let got = serde_json::json!(plan
            .iter()
            .map(|(f, n)| serde_json::json!([f, n]))
            .collect::<Vec<_>>());
        assert_eq!(
            got, want["files"],
            "case {c}: limit {limit}, sizes {sizes:?}"
        );
        assert_eq!(total, want["total_size"].as_u64().unwrap(), "case {c}");
        let oversized = sizes.iter().any(|(_, s)| *s > limit);
        oversized_cases += usize::from(oversized);
        single_oversized += usize::from(oversized && plan.len() == 1);

        // f32 cases: what save_model writes is what save_pretrained would.
        if case.elem != 4 {
            continue;
        }
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        let m = Named::new(&case.numel);
        match &case.limit {
            serde_json::Value::String(s) => single().save_model(&m, &dir, s.as_str()),
            v => single().save_model(&m, &dir, v.as_u64().unwrap()),
        }
        .unwrap();
        let mut files: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        let mut want_files: Vec<String> = plan.iter().map(|(f, _)| f.clone()).collect();
        if want["is_sharded"].as_bool().unwrap() {
            want_files.push("model.safetensors.index.json".into());
            let index: serde_json::Value = serde_json::from_slice(
                &fs::read(dir.join("model.safetensors.index.json")).unwrap(),
            )
            .unwrap();
            assert_eq!(
                index["metadata"]["total_size"], want["total_size"],
                "case {c}"
            );
            for pair in want["files"].as_array().unwrap() {
                for name in pair[1].as_array().unwrap() {
                    assert_eq!(
                        index["weight_map"][name.as_str().unwrap()],
                        pair[0],
                        "case {c}"
                    );
                }
            }
        }
        want_files.sort();
        assert_eq!(files, want_files, "case {c}");
        let mut back = Named::new(&case.numel);
        back.0.iter_mut().for_each(|(_, v, _)| v.fill(-1.0));
        single().load_model(&mut back, &dir).unwrap();
        assert!(back.0.iter().zip(&m.0).all(|(a, b)| a.1 == b.1), "case {c}");
    }
    println!("{} cases, {oversized_cases} with a tensor over the limit, {single_oversized} of them one file", cases.len());
    assert!(
        oversized_cases >= 20,
        "only {oversized_cases} cases exercise oversized tensors"
    );
}

// ---------------------------------- models that give their shapes (issue 28)

/// A 2 x 3 bf16 parameter that reports its shape.
struct Shaped {
    w: Vec<half::bf16>,
    g: Vec<half::bf16>,
    shape: Vec<usize>,
}

impl accel::train::Parameters for Shaped {
    fn visit_params(&self, f: &mut dyn FnMut(accel::train::ParamRef<'_>)) {
        f(accel::train::ParamRef::host("w", &self.w, &self.g));
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(accel::train::ParamMut<'_>)) {
        f(accel::train::ParamMut::host("w", &mut self.w, &mut self.g));
    }
    fn param_shape(&self, name: &str) -> Option<Vec<usize>> {
        (name == "w").then(|| self.shape.clone())
    }
}

#[test]
fn a_model_with_shapes_is_saved_in_its_shape_and_dtype_and_checked_on_load() {
    let acc = accel::Accelerator::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let w: Vec<half::bf16> = (0..6)
        .map(|i| half::bf16::from_f32(0.1 + i as f32))
        .collect();
    let mut m = Shaped {
        w: w.clone(),
        g: vec![half::bf16::ZERO; 6],
        shape: vec![2, 3],
    };
    acc.save_model(&m, dir.path(), 1u64 << 30).unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("w").unwrap();
    assert_eq!(t.shape(), &[2, 3]);
    assert_eq!(t.dtype(), safetensors::Dtype::BF16);
    let raw: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(t.data(), raw.as_slice());
    m.w = vec![half::bf16::ONE; 6];
    acc.load_model(&mut m, dir.path()).unwrap();
    assert_eq!(m.w, w);
    // The same values under another shape are refused, naming both.
    m.shape = vec![3, 2];
    let e = acc.load_model(&mut m, dir.path()).unwrap_err();
    assert!(
        e.to_string().contains("shape [2, 3]") && e.to_string().contains("[3, 2]"),
        "{e}"
    );
    // A shape that does not fit the values is refused on save.
    m.shape = vec![4, 2];
    let e = acc.save_model(&m, dir.path(), 1u64 << 30).unwrap_err();
    assert!(e.to_string().contains("6 values"), "{e}");
}

#[test]
fn save_state_keeps_the_models_shapes_and_dtypes_and_load_state_checks_them() {
    let dir = tempfile::tempdir().unwrap();
    let shaped = |shape: Vec<usize>| Shaped {
        w: (0..6).map(|i| half::bf16::from_f32(i as f32)).collect(),
        g: vec![half::bf16::ZERO; 6],
        shape,
    };
    let acc = accel::Accelerator::new()
        .unwrap()
        .with_training(accel::train::TrainConfig::default())
        .unwrap();
    let model = acc.prepare_model(shaped(vec![2, 3])).unwrap();
    let ckpt = acc.save_state(dir.path(), &[&model]).unwrap();
    let bytes = std::fs::read(ckpt.join("model_0.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("w").unwrap().shape(), &[2, 3]);
    // In the parameter's own type: bf16.
    assert_eq!(st.tensor("w").unwrap().dtype(), safetensors::Dtype::BF16);
    // The same values under another shape are refused, naming both.
    let acc = accel::Accelerator::new()
        .unwrap()
        .with_training(accel::train::TrainConfig::default())
        .unwrap();
    let mut other = acc.prepare_model(shaped(vec![3, 2])).unwrap();
    let e = acc.load_state(&ckpt, &mut [&mut other]).unwrap_err();
    assert_eq!(*e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(
        e.to_string().contains("[2, 3]") && e.to_string().contains("[3, 2]"),
        "{e}"
    );
    // The model of the saved shape loads it.
    let acc = accel::Accelerator::new()
        .unwrap()
        .with_training(accel::train::TrainConfig::default())
        .unwrap();
    let mut same = acc.prepare_model(shaped(vec![2, 3])).unwrap();
    same.w.fill(half::bf16::ONE);
    acc.load_state(&ckpt, &mut [&mut same]).unwrap();
    assert_eq!(same.w, shaped(vec![2, 3]).w);
}

#[test]
fn another_element_type_is_refused_unless_converting() {
    let acc = accel::Accelerator::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    // `w` as f32 in the model's shape; the model holds bf16.
    let values: Vec<f32> = (0..6).map(|i| 0.5 + i as f32).collect();
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &raw).unwrap();
    let bytes = safetensors::serialize([("w", view)], None).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    let mut m = Shaped {
        w: vec![half::bf16::ZERO; 6],
        g: vec![half::bf16::ZERO; 6],
        shape: vec![2, 3],
    };
    let e = acc.load_model(&mut m, dir.path()).unwrap_err();
    assert_eq!(*e.kind(), ErrorKind::Corrupt, "{e}");
    assert!(
        e.to_string().contains("\"w\" is stored as F32")
            && e.to_string().contains("BF16")
            && e.to_string().contains("load_model_converting"),
        "{e}"
    );
    assert!(m.w.iter().all(|v| *v == half::bf16::ZERO), "nothing loaded");
    acc.load_model_converting(&mut m, dir.path()).unwrap();
    let want: Vec<half::bf16> = values.iter().map(|v| half::bf16::from_f32(*v)).collect();
    assert_eq!(m.w, want);
}

/// A bf16 and an f32 parameter, no shapes given.
struct Mixed {
    h: Vec<half::bf16>,
    gh: Vec<half::bf16>,
    f: Vec<f32>,
    gf: Vec<f32>,
}

impl accel::train::Parameters for Mixed {
    fn visit_params(&self, f: &mut dyn FnMut(accel::train::ParamRef<'_>)) {
        f(accel::train::ParamRef::host("h", &self.h, &self.gh));
        f(accel::train::ParamRef::host("f", &self.f, &self.gf));
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(accel::train::ParamMut<'_>)) {
        f(accel::train::ParamMut::host("h", &mut self.h, &mut self.gh));
        f(accel::train::ParamMut::host("f", &mut self.f, &mut self.gf));
    }
}

fn mixed() -> Mixed {
    Mixed {
        h: (0..3)
            .map(|i| half::bf16::from_f32(0.3 + i as f32))
            .collect(),
        gh: vec![half::bf16::ZERO; 3],
        f: vec![0.1, 0.2],
        gf: vec![0.0; 2],
    }
}

#[test]
fn a_model_without_shapes_is_saved_1d_in_each_parameters_own_type() {
    let acc = accel::Accelerator::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let m = mixed();
    acc.save_model(&m, dir.path(), 1u64 << 30).unwrap();
    let bytes = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let h = st.tensor("h").unwrap();
    assert_eq!((h.dtype(), h.shape()), (safetensors::Dtype::BF16, &[3][..]));
    let raw: Vec<u8> = m.h.iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(h.data(), raw.as_slice(), "bf16 values as bf16");
    let f = st.tensor("f").unwrap();
    assert_eq!((f.dtype(), f.shape()), (safetensors::Dtype::F32, &[2][..]));
    let mut back = mixed();
    back.h.fill(half::bf16::ZERO);
    back.f.fill(0.0);
    acc.load_model(&mut back, dir.path()).unwrap();
    assert_eq!((back.h, back.f), (m.h, m.f));
}

#[test]
fn load_state_refuses_another_element_type_as_load_model_does() {
    let dir = tempfile::tempdir().unwrap();
    let acc = || {
        accel::Accelerator::new()
            .unwrap()
            .with_training(accel::train::TrainConfig::default())
            .unwrap()
    };
    let a = acc();
    let saved = a.prepare_model(mixed()).unwrap();
    let ckpt = a.save_state(dir.path(), &[&saved]).unwrap();
    // The same names and lengths, `h` in f32: not loaded, nothing written.
    let b = acc();
    let mut wide = b
        .prepare_model(Named(vec![
            ("h".into(), vec![9.0; 3], vec![0.0; 3]),
            ("f".into(), vec![9.0; 2], vec![0.0; 2]),
        ]))
        .unwrap();
    let e = b.load_state(&ckpt, &mut [&mut wide]).unwrap_err();
    assert_eq!(*e.kind(), ErrorKind::Corrupt, "{e}");
    let text = e.to_string();
    assert!(
        text.contains("parameter \"h\" is stored as bf16 in the checkpoint, the model's is f32")
            && text.contains("load_model_converting"),
        "{text}"
    );
    assert!(wide.0.iter().all(|(_, v, _)| v.iter().all(|x| *x == 9.0)));
    // The saved types load.
    let c = acc();
    let mut same = c.prepare_model(mixed()).unwrap();
    same.h.fill(half::bf16::ZERO);
    c.load_state(&ckpt, &mut [&mut same]).unwrap();
    assert_eq!(same.h, mixed().h);
}
