//! Accelerate parity and rough edges of the training loop (issue 19), and
//! checkpoint hardening (issue 22, item 13): one process on `single`,
//! threads as ranks on cpu-gloo, each under a hard deadline.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use accel::train::*;
use accel::{Accelerator, ErrorKind, ReduceOp};

mod common;
use common::{ranks, run_python, single, Data, Linear};

// ------------------------------------------------------------------ helpers

/// Rewrite the manifest of `dir` after its files were edited (what a
/// careful tamperer does, so the checksums alone do not catch it).
fn reseal(dir: &Path) {
    fn walk(base: &Path, d: &Path, out: &mut Vec<String>) {
        for e in fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(base, &p, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut names = Vec::new();
    walk(dir, dir, &mut names);
    let mut w = accel_sharding::CheckpointWriter::create(dir.with_extension("resealed")).unwrap();
    for n in names.iter().filter(|n| n.as_str() != "manifest.json") {
        w.write(n, &fs::read(dir.join(n)).unwrap()).unwrap();
    }
    w.commit().unwrap();
    fs::remove_dir_all(dir).unwrap();
    fs::rename(dir.with_extension("resealed"), dir).unwrap();
}

fn params(m: &impl Parameters) -> Vec<f32> {
    let mut v = Vec::new();
    m.visit_params(&mut |p| v.extend_from_slice(p.value_f32().unwrap()));
    v
}

// ------------------------------------------------------------------ sharding bugs

#[test]
fn split_between_processes_pads_with_the_last_element_of_the_input() {
    let shares = ranks(3, |acc| {
        let items: Vec<i32> = (0..7).collect();
        let mut map = BTreeMap::new();
        map.insert("prompt", items.clone());
        map.insert("id", items.iter().map(|i| i * 10).collect());
        let split = acc.split_between_processes_map(&map, true).unwrap();
        map.insert("short", vec![1]);
        let err = acc.split_between_processes_map(&map, false).unwrap_err();
        acc.wait_for_everyone().unwrap();
        (
            acc.split_between_processes_padded(&items),
            acc.split_between_processes(&items).to_vec(),
            split,
            err.kind().clone(),
        )
    });
    assert_eq!(shares[1].0, vec![3, 4, 6], "Accelerate's [3, 4, 6]");
    assert_eq!(shares[2].0, vec![5, 6, 6]);
    assert_eq!(shares[1].1, vec![3, 4]);
    assert_eq!(shares[1].2["prompt"], vec![3, 4, 6]);
    assert_eq!(
        shares[1].2["id"],
        vec![30, 40, 60],
        "every value split alike"
    );
    assert!(shares.iter().all(|s| s.3 == ErrorKind::InvalidArgument));
}

#[test]
fn one_process_loader_keeps_the_short_last_batch_and_reads_each_sample_once() {
    let acc = single();
    let mut loader = acc
        .prepare_loader(DataLoader::new(Data { len: 22, d: 1 }, 3))
        .unwrap();
    let mut seen = Vec::new();
    let mut last = None;
    while let Some(b) = loader.next_batch() {
        let ids: Vec<i64> = b.indices.iter().map(|&i| i as i64).collect();
        seen.extend(acc.gather_for_metrics(&ids, &b).unwrap());
        last = Some(b);
    }
    let last = last.unwrap();
    assert_eq!(last.indices, vec![21], "Accelerate's last batch is [21]");
    assert_eq!(last.remainder, 0);
    assert_eq!(seen, (0..22).collect::<Vec<i64>>());
}

// ------------------------------------------------------------------ rough edges

#[test]
fn a_live_rng_guard_blocks_nothing_and_rng_users_fail_at_once() {
    let acc = single();
    acc.set_seed(3, false);
    let dir = tempfile::tempdir().unwrap();
    let model = acc.prepare_model(Linear::new(2)).unwrap();
    let mut guard = acc.rng().unwrap();
    let first = guard.next_u64();
    // Training methods that used to wait for the guard forever.
    let decision = acc.accumulate_step(false);
    let _ = acc.training_config();
    // One accumulation step (the default): every batch synchronises.
    assert!(decision.sync_gradients);
    assert_eq!(acc.sync_gradients(), decision.sync_gradients);
    acc.set_trigger();
    assert!(acc.check_trigger().unwrap());
    // Methods that need the generator say so at once.
    let e = acc.rng().unwrap_err();
    assert!(e.to_string().contains("drop"), "{e}");
    let e = acc.save_state(dir.path(), &[&model]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(acc.synchronize_rng_states().is_err());
    drop(guard);
    // The guard's draws are kept.
    acc.set_seed(3, false);
    let mut g = acc.rng().unwrap();
    assert_eq!(g.next_u64(), first);
    let second = g.next_u64();
    drop(g);
    acc.set_seed(3, false);
    let mut g = acc.rng().unwrap();
    g.next_u64();
    drop(g);
    assert_eq!(acc.rng().unwrap().next_u64(), second);
    acc.save_state(dir.path(), &[&model]).unwrap();
}

#[test]
fn step_counters_and_flags_gather_and_reduce_on_two_ranks() {
    let out = ranks(2, |acc| {
        let r = acc.rank() as u64;
        let big = u64::MAX - 10 + r; // past i64::MAX
        let steps = [r + 1, big];
        let gathered = acc.gather(&steps).unwrap();
        let max = acc.reduce(&steps, "max").unwrap();
        let min = acc.reduce(&steps, "min").unwrap();
        let sum = acc.reduce(&[r + 1, 1u64 << 40], "sum").unwrap();
        let mean = acc.reduce(&[r + 2], "mean").unwrap();
        let overflow = acc.reduce(&[big], "sum").unwrap_err();
        let small = acc.reduce(&[u32::MAX - 2 + r as u32], "max").unwrap();
        let u32_overflow = acc.reduce(&[u32::MAX], "sum").unwrap_err();
        let counts = acc.gather(&[acc.rank(), 7usize]).unwrap();
        let prod = acc.reduce(&[r as usize + 2], "prod").unwrap();
        let any = acc.reduce(&[acc.rank() == 1, false], "max").unwrap();
        let all = acc.reduce(&[acc.rank() == 1, true], "min").unwrap();
        let flags = acc.gather(&[acc.rank() == 0]).unwrap();
        let bool_mean = acc.reduce(&[true], "mean").is_err();
        let mut b = [r * 5 + 1];
        acc.broadcast(&mut b, 1).unwrap();
        let mut v = vec![r as u32 + 1];
        acc.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let ids: Vec<u64> = vec![r; acc.rank() + 1];
        let batch = Batch {
            items: vec![(); ids.len()],
            indices: vec![0; ids.len()],
            epoch: 0,
            index: 0,
            end_of_dataloader: false,
            remainder: 0,
        };
        let metrics = acc.gather_for_metrics(&ids, &batch).unwrap();
        (
            gathered,
            max,
            min,
            sum,
            mean,
            overflow.kind().clone(),
            small,
            u32_overflow.kind().clone(),
            counts,
            prod,
            any,
            all,
            flags,
            bool_mean,
            b,
            v,
            metrics,
        )
    });
    for o in &out {
        assert_eq!(o.0, vec![1, u64::MAX - 10, 2, u64::MAX - 9]);
        assert_eq!(o.1, vec![2, u64::MAX - 9]);
        assert_eq!(o.2, vec![1, u64::MAX - 10]);
        assert_eq!(o.3, vec![3, 1u64 << 41]);
        assert_eq!(o.4, vec![2], "mean of 2 and 3 truncates");
        assert_eq!(o.5, ErrorKind::InvalidArgument, "a u64 sum past u64::MAX");
        assert_eq!(o.6, vec![u32::MAX - 1]);
        assert_eq!(o.7, ErrorKind::InvalidArgument);
        assert_eq!(o.8, vec![0, 7, 1, 7]);
        assert_eq!(o.9, vec![6]);
        assert_eq!(o.10, vec![true, false]);
        assert_eq!(o.11, vec![false, true]);
        assert_eq!(o.12, vec![true, false]);
        assert!(o.13, "mean of bool is an error");
        assert_eq!(o.14, [6]);
        assert_eq!(o.15, vec![3]);
        assert_eq!(o.16, vec![0, 1, 1]);
    }
}

#[test]
fn print_takes_anything_displayable() {
    let acc = single();
    acc.print("a plain string");
    acc.print(format!("a String {}", 1));
    acc.print(format_args!("format_args {}", 2));
    acc.print(3.5f64);
}

fn duplicated_lines(path: &Path) -> Vec<String> {
    let text = fs::read_to_string(path).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    text.lines()
        .filter(|l| l.starts_with("* ") || l.starts_with("| ["))
        .filter(|l| !seen.insert(l.to_string()))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_readme_and_the_adr_index_list_nothing_twice() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for doc in ["README.md", "docs/adr/README.md"] {
        let dup = duplicated_lines(&root.join(doc));
        assert!(dup.is_empty(), "{doc} lists these lines twice: {dup:?}");
    }
    // The ADR index has one row per ADR number.
    let index = fs::read_to_string(root.join("docs/adr/README.md")).unwrap();
    let mut numbers: Vec<&str> = index
        .lines()
        .filter_map(|l| l.strip_prefix("| ["))
        .map(|l| &l[..4])
        .collect();
    let n = numbers.len();
    numbers.dedup();
    assert_eq!(numbers.len(), n, "{index}");
}

#[test]
fn the_guide_example_is_the_compiled_example() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let guide = fs::read_to_string(root.join("docs/training.md")).unwrap();
    let start = guide
        .find("```rust\n")
        .expect("the guide has a rust example")
        + 8;
    let end = start + guide[start..].find("```").unwrap();
    let example = fs::read_to_string(root.join("accel/examples/training_guide.rs")).unwrap();
    assert_eq!(
        guide[start..end].trim(),
        example.trim(),
        "docs/training.md's complete example must be accel/examples/training_guide.rs, which CI compiles"
    );
}

// ------------------------------------------------------------------ save_model

#[test]
fn save_model_on_two_ranks_loads_on_three_and_on_one() {
    let dir = tempfile::tempdir().unwrap();
    let sharded = dir.path().join("sharded");
    let single_file = dir.path().join("single");
    let (s1, s2) = (sharded.clone(), single_file.clone());
    let saved = ranks(2, move |acc| {
        let mut m = Linear::new(5);
        m.w[acc.rank()] += 1.0; // differs before prepare: rank 0's wins
        let m = acc.prepare_model(m).unwrap();
        // 5 + 1 floats: a 12-byte limit gives w (20 bytes) and b their own shards.
        acc.save_model(&*m, &s1, 12).unwrap();
        acc.save_model(&*m, &s2, DEFAULT_MAX_SHARD_SIZE).unwrap();
        params(&*m)
    });
    assert_eq!(saved[0], saved[1]);
    let want = saved[0].clone();
    let names: Vec<String> = {
        let mut v: Vec<String> = fs::read_dir(&sharded)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        names,
        vec![
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let index: serde_json::Value =
        serde_json::from_slice(&fs::read(sharded.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(index["metadata"]["total_size"], 24);
    assert_eq!(index["weight_map"]["w"], "model-00001-of-00002.safetensors");
    assert_eq!(index["weight_map"]["b"], "model-00002-of-00002.safetensors");
    assert!(single_file.join("model.safetensors").exists());
    assert_eq!(fs::read_dir(&single_file).unwrap().count(), 1);
    assert_eq!(
        fs::read_dir(dir.path()).unwrap().count(),
        2,
        "no temporary directory is left"
    );

    let (s1, s2) = (sharded.clone(), single_file.clone());
    let loaded = ranks(3, move |acc| {
        let mut a = Linear::new(5);
        acc.load_model(&mut a, &s1).unwrap();
        let mut b = Linear::new(5);
        acc.load_model(&mut b, &s2).unwrap();
        let mut wrong = Linear::new(4);
        let e = acc.load_model(&mut wrong, &s1).unwrap_err();
        (params(&a), params(&b), e.kind().clone())
    });
    for (a, b, e) in &loaded {
        assert_eq!((a, b), (&want, &want));
        assert_eq!(e, &ErrorKind::Corrupt, "a parameter of another length");
    }
    let acc = single();
    let mut one = acc.prepare_model(Linear::new(5)).unwrap();
    acc.load_model(&mut *one, &sharded).unwrap();
    assert_eq!(params(&*one), want);

    // Python's safetensors reads the folder, and the index matches the files.
    let Some(py) = accel_test_support::python::venv_tb_python("safetensors") else {
        return;
    };
    let script = r#"
import hashlib, json, sys, os
from safetensors import safe_open
d = sys.argv[1]
index = json.load(open(os.path.join(d, "model.safetensors.index.json")))
files = sorted(set(index["weight_map"].values()))
assert files == sorted(f for f in os.listdir(d) if f.endswith(".safetensors")), files
total, out = 0, {}
for f in files:
    raw = open(os.path.join(d, f), "rb").read()
    data = raw[8 + int.from_bytes(raw[:8], "little"):]
    digest = hashlib.sha256(data).hexdigest()
    assert index["metadata"]["accel_data_sha256"][f] == digest, (f, index)
    with safe_open(os.path.join(d, f), framework="numpy") as st:
        assert st.metadata() == {"format": "pt", "accel_data_sha256": digest}, st.metadata()
        for k in st.keys():
            assert index["weight_map"][k] == f, (k, f)
            t = st.get_tensor(k)
            total += t.nbytes
            out[k] = [float(x) for x in t.reshape(-1)]
assert total == index["metadata"]["total_size"], (total, index)
with safe_open(os.path.join(sys.argv[2], "model.safetensors"), framework="numpy") as st:
    assert [float(x) for x in st.get_tensor("w")] == out["w"]
print(json.dumps(out["w"] + out["b"]))
"#;
    let got: Vec<f32> =
        serde_json::from_str(&run_python(&py, script, &[&sharded, &single_file])).unwrap();
    assert_eq!(got, want);
}

#[test]
fn weights_and_optimizer_state_load_at_another_world_size_and_load_state_reshards_loaders() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let prepare = |acc: &Accelerator| {
        let model = acc.prepare_model(Linear::new(3)).unwrap();
        let opt = acc
            .prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))
            .unwrap();
        let loader = acc
            .prepare_loader(DataLoader::new(Data { len: 16, d: 3 }, 2))
            .unwrap();
        (model, opt, loader)
    };
    let r = root.clone();
    let saved = ranks(2, move |acc| {
        let (mut model, mut opt, mut loader) = prepare(&acc);
        for _ in 0..2 {
            let b = loader.next_batch().unwrap();
            acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                .unwrap();
            opt.step(&mut model).unwrap();
            opt.zero_grad(&mut model);
        }
        acc.save_state(&r, &[&model, &opt, &loader]).unwrap();
        (params(&*model), opt.state_dict())
    });
    let r = root.clone();
    let want = saved[0].clone();
    let loaded = ranks(3, move |acc| {
        let (mut model, mut opt, mut loader) = prepare(&acc);
        let full = acc
            .load_state(&r, &mut [&mut model, &mut opt, &mut loader])
            .map(|_| loader.sampler_state());
        let with_loader = acc
            .load_weights(&r, &mut [&mut model, &mut loader])
            .unwrap_err();
        acc.load_weights(&r, &mut [&mut model, &mut opt]).unwrap();
        (
            params(&*model),
            opt.state_dict(),
            opt.steps_taken(),
            full,
            with_loader,
            acc.save_iteration(),
        )
    });
    for (p, o, steps, full, with_loader, next) in loaded {
        assert_eq!(p, want.0);
        assert_eq!(o, want.1, "momentum buffers and step counts");
        assert_eq!(steps, 2);
        // 2 steps of 2 ranks x 2 samples read: the 3 ranks go on at 8.
        let full = full.unwrap();
        assert_eq!((full.epoch, full.epoch_offset), (0, 8));
        assert_eq!(full.num_processes, 3);
        assert_eq!(with_loader.kind(), &ErrorKind::InvalidArgument);
        assert!(
            with_loader.to_string().contains("loader_0"),
            "{with_loader}"
        );
        assert_eq!(next, 1, "the numbering continues after checkpoint_0");
    }
    // And on one process.
    let acc = single();
    let mut model = acc.prepare_model(Linear::new(3)).unwrap();
    acc.load_weights(&root, &mut [&mut model]).unwrap();
    assert_eq!(params(&*model), want.0);
}

/// An elastic restart (ADR 0026): saved by 3 ranks in the middle of an
/// epoch, resumed by 2, every sample of the epoch trained on exactly once;
/// the surviving ranks continue their RNG streams, and the optimizer state
/// carries over.
#[test]
fn load_state_at_a_smaller_world_reads_every_sample_of_the_epoch_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    // 54 samples: 3 steps of 3 x 2 before the save, 9 steps of 2 x 2 after.
    let loader = |acc: &accel::Accelerator| {
        acc.prepare_loader(DataLoader::new(Data { len: 54, d: 3 }, 2).shuffle(7))
            .unwrap()
    };
    let r = root.clone();
    let before = ranks(3, move |acc| {
        acc.set_seed(3, true);
        let mut model = acc.prepare_model(Linear::new(3)).unwrap();
        let mut opt = acc
            .prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))
            .unwrap();
        let mut loader = loader(&acc);
        let mut seen = Vec::new();
        for _ in 0..3 {
            let b = loader.next_batch().unwrap();
            seen.extend(b.indices.clone());
            acc.backward(&mut model, |m, s| m.grad(&b.items, s))
                .unwrap();
            opt.step(&mut model).unwrap();
            opt.zero_grad(&mut model);
        }
        acc.save_state(&r, &[&model, &opt, &loader]).unwrap();
        let next = acc.rng().unwrap().next_u64();
        (seen, next, params(&*model), opt.state_dict())
    });
    let r = root.clone();
    let after = ranks(2, move |acc| {
        let mut model = acc.prepare_model(Linear::new(3)).unwrap();
        let mut opt = acc
            .prepare_optimizer(Sgd::new(0.1).with_momentum(0.9))
            .unwrap();
        let mut loader = loader(&acc);
        acc.load_state(&r, &mut [&mut model, &mut opt, &mut loader])
            .unwrap();
        let loaded = (params(&*model), opt.state_dict());
        let next = acc.rng().unwrap().next_u64();
        let mut seen = Vec::new();
        while let Some(b) = loader.next_batch() {
            seen.extend(b.indices.clone());
        }
        (seen, next, loaded, loader.epoch())
    });
    let mut all: Vec<usize> = before.iter().flat_map(|b| b.0.clone()).collect();
    all.extend(after.iter().flat_map(|a| a.0.clone()));
    all.sort_unstable();
    assert_eq!(all, (0..54).collect::<Vec<_>>(), "every sample once");
    for (r, a) in after.iter().enumerate() {
        assert_eq!(a.1, before[r].1, "rank {r} continues its RNG stream");
        assert_eq!(a.2, (before[0].2.clone(), before[0].3.clone()));
        assert_eq!(a.3, 1, "the epoch ended");
        assert_eq!(a.0.len(), 18, "9 steps of 2 samples on rank {r}");
    }
}

// ------------------------------------------------------------------ checkpoints (issue 22)

#[test]
fn a_corrupted_manifest_is_reported_as_itself() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let model = acc.prepare_model(Linear::new(2)).unwrap();
    let ckpt = acc.save_state(dir.path(), &[&model]).unwrap();
    let path = ckpt.join("manifest.json");
    let text = fs::read_to_string(&path).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let sum = m["files"]["model_0.json"]["sha256"].as_str().unwrap();
    let flipped = format!(
        "{}{}",
        if sum.starts_with('a') { 'b' } else { 'a' },
        &sum[1..]
    );
    fs::write(&path, text.replace(sum, &flipped)).unwrap();
    let mut model = acc.prepare_model(Linear::new(2)).unwrap();
    let e = acc.load_state(dir.path(), &mut [&mut model]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Corrupt);
    let msg = e.to_string();
    assert!(msg.contains("manifest.json"), "{msg}");
    assert!(!msg.contains("model_0.json"), "{msg}");
}

#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one_when_asked() {
    let acc = single();
    let dir = tempfile::tempdir().unwrap();
    let mut model = acc.prepare_model(Linear::new(2)).unwrap();
    acc.save_state(dir.path(), &[&model]).unwrap();
    let before = params(&*model);
    model.w[0] = 42.0;
    let newest = acc.save_state(dir.path(), &[&model]).unwrap();
    fs::write(newest.join("model_0.safetensors"), b"garbage").unwrap();

    let fresh = single();
    let mut m = fresh.prepare_model(Linear::new(2)).unwrap();
    let e = fresh.load_state(dir.path(), &mut [&mut m]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Corrupt);
    assert!(e.to_string().contains("load_latest_intact"), "{e}");
    let loaded = fresh.load_latest_intact(dir.path(), &mut [&mut m]).unwrap();
    assert_eq!(loaded, dir.path().join("checkpoint_0"));
    assert_eq!(params(&*m), before);
    assert_eq!(
        fresh.save_state(dir.path(), &[&m]).unwrap(),
        dir.path().join("checkpoint_2"),
        "the next save does not collide with the damaged checkpoint_1"
    );
    // Nothing intact: an error listing every checkpoint.
    for n in 0..3 {
        fs::remove_file(dir.path().join(format!("checkpoint_{n}/manifest.json"))).unwrap();
    }
    let e = fresh
        .load_latest_intact(dir.path(), &mut [&mut m])
        .unwrap_err();
    assert!(e.to_string().contains("checkpoint_0"), "{e}");
}

#[test]
fn a_tampered_loader_epoch_is_an_error_on_every_rank_not_a_desync() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let r = root.clone();
    ranks(2, move |acc| {
        let mut loader = acc
            .prepare_loader(DataLoader::new(Data { len: 20, d: 1 }, 2))
            .unwrap();
        loader.next_batch().unwrap();
        acc.save_state(&r, &[&loader]).unwrap();
    });
    let ckpt = root.join("checkpoint_0");
    let file = ckpt.join("loader_0/rank_1.json");
    let mut v: serde_json::Value = serde_json::from_slice(&fs::read(&file).unwrap()).unwrap();
    v["sampler"]["epoch"] = serde_json::json!(3);
    fs::write(&file, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    reseal(&ckpt);
    let r = root.clone();
    let errors = ranks(2, move |acc| {
        let mut loader = acc
            .prepare_loader(DataLoader::new(Data { len: 20, d: 1 }, 2))
            .unwrap();
        acc.load_state(&r, &mut [&mut loader]).unwrap_err()
    });
    for e in errors {
        assert_eq!(e.kind(), &ErrorKind::Corrupt, "{e}");
        let m = e.to_string();
        assert!(m.contains("rank 1") && m.contains("epoch"), "{m}");
    }
}

// ------------------------------------------------------------------ trackers

#[test]
fn trackers_write_json_lines_and_tensorboard_events_on_the_main_process() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().to_path_buf();
    let l = logs.clone();
    ranks(2, move |acc| {
        let config = serde_json::json!({"lr": 0.1, "epochs": 3});
        let e = acc
            .init_trackers("run", &l, &["wandb"], &config)
            .unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
        acc.init_trackers("run", &l, &["all"], &config).unwrap();
        for step in 0..5u64 {
            let loss = 1.0 / (step as f64 + 1.0) + acc.rank() as f64;
            acc.log(&[("loss", loss), ("accuracy", step as f64 * 0.25)], step)
                .unwrap();
        }
        acc.log(&[("loss", f64::NAN)], 5).unwrap();
        assert_eq!(
            acc.trackers().len(),
            if acc.is_main_process() { 2 } else { 0 }
        );
        acc.end_training().unwrap();
        acc.wait_for_everyone().unwrap();
    });
    let run = logs.join("run");
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(run.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["epochs"], 3);
    let lines: Vec<serde_json::Value> = fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 6, "the main process only");
    assert_eq!(lines[2]["step"], 2);
    assert_eq!(lines[2]["values"]["loss"], 1.0 / 3.0);
    assert_eq!(lines[2]["values"]["accuracy"], 0.5);
    assert!(lines[5]["values"]["loss"].is_null(), "NaN is null");
    let events: Vec<PathBuf> = fs::read_dir(&run)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(events.len(), 1);

    // Read the scalars back with TensorBoard's own event reader.
    let Some(got) = accel_test_support::python::tensorboard_scalars(&run) else {
        return;
    };
    let loss: Vec<(u64, Option<f64>)> = (0..5)
        .map(|s| (s, Some((1.0 / (s as f64 + 1.0)) as f32 as f64)))
        .chain([(5, None)])
        .collect();
    assert_eq!(got["loss"], loss);
    let acc: Vec<(u64, Option<f64>)> = (0..5).map(|s| (s, Some(s as f64 * 0.25))).collect();
    assert_eq!(got["accuracy"], acc);
}
