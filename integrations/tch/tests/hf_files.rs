//! What Hugging Face tools read back from a tch model saved by accel
//! (issue 29): `save_model`, `save_state` and ZeRO's consolidated weights
//! keep every variable's shape and dtype; PyTorch loads the folder into
//! the same module with `load_state_dict(strict=True)` and computes the
//! same outputs; bf16 weights round-trip bit for bit through Python's
//! `safetensors`; all-MiniLM-L6-v2 round-trips with every tensor's name,
//! shape, dtype and bytes.
//!
//! The Python checks use the torch venv (`make torch-venv`, which `make
//! test` builds before this workspace's tests) or `$ACCEL_TORCH_PYTHON`;
//! without one they print why and pass, except under CI, where they fail.
//! The MiniLM check needs `make minilm-setup`'s files, likewise.

use std::path::{Path, PathBuf};

use accel::train::{Parameters, TrainConfig};
use accel::zero::{ShardedSgd, Stage, WrapPolicy, ZeroOptimizer};
use accel::Accelerator;
use accel_tch::{TchModel, Zero3TchModel};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

mod common;
use accel_test_support::{python, skips};
use common::det;
use python::{python_with, run_python, torch_python_candidates};

fn acc() -> Accelerator {
    // No launcher variables: one process, the exact `single` backend.
    Accelerator::new().expect("a one-process accelerator")
}

/// PyTorch's `nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))`
/// in tch, its variables named as PyTorch names them (`0.weight`, ...)
/// and set to fixed values, in `kind`.
fn mlp(kind: Kind) -> (TchModel, nn::Sequential) {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let root = vs.root();
    let net = nn::seq()
        .add(nn::linear(&root / "0", 4, 8, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&root / "2", 8, 3, Default::default()));
    if kind == Kind::BFloat16 {
        vs.bfloat16();
    }
    fill(&vs);
    (TchModel::new(vs).expect("a CPU model"), net)
}

/// Every variable of `vs`, in name order, set to fixed values.
fn fill(vs: &nn::VarStore) {
    tch::no_grad(|| {
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|x, y| x.0.cmp(&y.0));
        for (i, (_, mut t)) in vars.into_iter().enumerate() {
            let v: Vec<f32> = (0..t.numel()).map(|j| det(i + 1, j)).collect();
            let src = Tensor::from_slice(&v).view(t.size().as_slice());
            t.copy_(&src.to_kind(t.kind()));
        }
    });
}

/// `(name, size, kind)` of each trainable variable, in name order.
fn layout(m: &TchModel) -> Vec<(String, Vec<i64>, Kind)> {
    let params = m.named_parameters().iter();
    params
        .map(|(n, t)| (n.clone(), t.size(), t.kind()))
        .collect()
}

/// `(name, size, kind)` of each tensor in a safetensors file, in name order.
fn file_layout(path: &Path) -> Vec<(String, Vec<i64>, Kind)> {
    let mut t = Tensor::read_safetensors(path).expect("a safetensors file");
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t.into_iter()
        .map(|(n, t)| (n, t.size(), t.kind()))
        .collect()
}

/// A Python with torch and safetensors, or `None` after printing why
/// (under CI: a failure).
fn python() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    python_with(
        torch_python_candidates(&root),
        &["torch", "safetensors"],
        "`make torch-venv` makes one",
    )
}

#[test]
fn save_model_and_save_state_keep_the_var_stores_shapes_and_dtypes() {
    let dir = tempfile::tempdir().unwrap();
    for kind in [Kind::Float, Kind::BFloat16] {
        let acc = acc().with_training(TrainConfig::default()).unwrap();
        let (model, _) = mlp(kind);
        let want = layout(&model);
        assert_eq!(want[0].1, [8], "0.bias");
        assert_eq!(want[1].1, [8, 4], "0.weight");
        let saved = acc
            .save_model(&model, dir.path().join(format!("{kind:?}")), "5GB")
            .unwrap();
        assert_eq!(
            file_layout(&saved.join("model.safetensors")),
            want,
            "save_model of a {kind:?} model"
        );
        // The exact-resume checkpoint keeps them too.
        let prepared = acc.prepare_model(model).unwrap();
        let ckpt = acc
            .save_state(dir.path().join(format!("state-{kind:?}")), &[&prepared])
            .unwrap();
        assert_eq!(
            file_layout(&ckpt.join("model_0.safetensors")),
            want,
            "save_state of a {kind:?} model"
        );
        // A model of other shapes (same lengths) is refused, naming both.
        let acc = self::acc().with_training(TrainConfig::default()).unwrap();
        let mut other = acc.prepare_model(mlp(kind).0).unwrap();
        // Re-shape `0.weight` to [4, 8] in place: same values, other shape.
        tch::no_grad(|| {
            let (_, w) = &other.named_parameters()[1];
            let mut w = w.shallow_clone();
            let t = w.view([4, 8]).contiguous();
            w.set_data(&t);
        });
        let e = acc
            .load_state(&ckpt, &mut [&mut other])
            .expect_err("a checkpoint of other shapes");
        assert!(
            e.to_string().contains("[8, 4]") && e.to_string().contains("[4, 8]"),
            "{e}"
        );
    }
}

#[test]
fn zero_consolidated_weights_keep_the_shapes_at_every_stage() {
    let acc = acc();
    let dir = tempfile::tempdir().unwrap();
    for (stage, free) in [
        (Stage::Optimizer, false),
        (Stage::Full, false),
        (Stage::Full, true),
    ] {
        let (model, _) = mlp(Kind::Float);
        let want = layout(&model);
        let values: Vec<Tensor> = model
            .named_parameters()
            .iter()
            .map(|(_, t)| t.detach().copy())
            .collect();
        let model: Box<dyn Parameters> = if free {
            Box::new(Zero3TchModel::new(model))
        } else {
            Box::new(model)
        };
        let mut zero = ZeroOptimizer::new(
            acc.comm().clone(),
            &*model,
            stage,
            &WrapPolicy::Depth(1),
            ShardedSgd::new(0.1),
        )
        .unwrap();
        let full = zero.full_parameters(&*model).unwrap();
        let what = format!("stage {stage}, freeing {free}");
        let saved = acc
            .save_model(&full, dir.path().join(what.replace([' ', ','], "_")), "5GB")
            .unwrap();
        let file = saved.join("model.safetensors");
        assert_eq!(file_layout(&file), want, "{what}");
        let mut back = Tensor::read_safetensors(&file).unwrap();
        back.sort_by(|a, b| a.0.cmp(&b.0));
        for ((name, t), v) in back.iter().zip(&values) {
            assert!(t.equal(v), "{what}: {name}");
        }
    }
}

const TORCH_LOAD: &str = r#"
import sys, torch
from safetensors.torch import load_file, save_file
torch.set_num_threads(1)
folder, io = sys.argv[1], sys.argv[2]
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
net.load_state_dict(load_file(f"{folder}/model.safetensors"), strict=True)
x = load_file(f"{io}/x.safetensors")["x"]
with torch.no_grad():
    save_file({"y": net(x)}, f"{io}/y.safetensors")
"#;

#[test]
fn a_saved_mlp_loads_into_torch_strictly_and_gives_the_same_outputs() {
    let Some(py) = python() else { return };
    tch::set_num_threads(1);
    let acc = acc();
    let dir = tempfile::tempdir().unwrap();
    let (model, net) = mlp(Kind::Float);
    let saved = acc
        .save_model(&model, dir.path().join("mlp"), "5GB")
        .unwrap();
    let x: Vec<f32> = (0..5 * 4).map(|j| 2.0 * det(99, j)).collect();
    let x = Tensor::from_slice(&x).view([5, 4]);
    Tensor::write_safetensors(&[("x", &x)], dir.path().join("x.safetensors")).unwrap();
    run_python(&py, TORCH_LOAD, &[&saved, dir.path()]);
    let y = Tensor::read_safetensors(dir.path().join("y.safetensors")).unwrap();
    let want = tch::no_grad(|| net.forward(&x));
    assert_eq!(y[0].1.size(), [5, 3]);
    let diff = f64::try_from((&y[0].1 - &want).abs().max()).unwrap();
    let scale = f64::try_from(want.abs().max()).unwrap();
    // The same libtorch build on both sides, but the two processes may take
    // different GEMM paths (alignment, CPU features): a few ulps of the
    // outputs' magnitude, where a wrong or transposed weight is off by
    // whole units.
    let bound = 4.0 * f64::from(f32::EPSILON) * scale.max(1.0);
    assert!(
        diff <= bound,
        "torch's outputs differ from tch's by {diff} (more than {bound})"
    );
    assert!(f64::try_from(want.abs().sum(Kind::Float)).unwrap() > 0.1);
}

const BF16_ROUND_TRIP: &str = r#"
import json, sys, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1], sys.argv[2]
sd = load_file(f"{src}/model.safetensors")
out = {}
for name, t in sorted(sd.items()):
    assert t.dtype == torch.bfloat16, (name, t.dtype)
    out[name] = {"shape": list(t.shape), "bits": t.view(torch.int16).flatten().tolist()}
save_file({k: v.clone() for k, v in sd.items()}, f"{dst}/model.safetensors", metadata={"format": "pt"})
print(json.dumps(out))
"#;

#[test]
fn bf16_weights_round_trip_bit_exact_through_pythons_safetensors() {
    let Some(py) = python() else { return };
    let acc = acc();
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = mlp(Kind::BFloat16);
    // Edge values in the first weight: ±0, subnormals, the largest finite,
    // infinities, and bf16 values f16 cannot hold.
    let edges: [u16; 8] = [
        0x0000, 0x8000, 0x0001, 0x807f, 0x7f7f, 0x7f80, 0xff80, 0x3f81,
    ];
    tch::no_grad(|| {
        let (_, b) = &model.named_parameters()[0];
        let e: Vec<half::bf16> = edges.iter().map(|&b| half::bf16::from_bits(b)).collect();
        let bits: Vec<i16> = e.iter().map(|v| v.to_bits() as i16).collect();
        let t = Tensor::from_slice(&bits).view_dtype(Kind::BFloat16);
        b.shallow_clone().copy_(&t);
    });
    let bits = |m: &TchModel| -> Vec<(String, Vec<i16>)> {
        let params = m.named_parameters().iter();
        params
            .map(|(n, t)| {
                let i = t.detach().view_dtype(Kind::Int16).flatten(0, -1);
                (n.clone(), Vec::<i16>::try_from(&i).unwrap())
            })
            .collect()
    };
    let want = bits(&model);
    let saved = acc
        .save_model(&model, dir.path().join("ours"), "5GB")
        .unwrap();
    let theirs = dir.path().join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    let read: serde_json::Value =
        serde_json::from_str(&run_python(&py, BF16_ROUND_TRIP, &[&saved, &theirs])).unwrap();
    for ((name, b), (_, shape, _)) in want.iter().zip(layout(&model)) {
        let got = &read[name];
        let got_bits: Vec<i16> = serde_json::from_value(got["bits"].clone()).unwrap();
        assert_eq!(&got_bits, b, "{name} as Python reads it");
        let got_shape: Vec<i64> = serde_json::from_value(got["shape"].clone()).unwrap();
        assert_eq!(got_shape, shape, "{name}");
    }
    // Python's file back into a zeroed bf16 model: the same bits.
    let (mut back, _) = mlp(Kind::BFloat16);
    tch::no_grad(|| {
        for (_, t) in back.named_parameters() {
            let _ = t.shallow_clone().zero_();
        }
    });
    acc.load_model(&mut back, &theirs).unwrap();
    assert_eq!(bits(&back), want, "bits after Python's round trip");
    assert_eq!(layout(&back), layout(&model));
}

/// `make minilm-setup`'s model folder (`$ACCEL_MINILM_DIR` first).
fn minilm_dir() -> Option<PathBuf> {
    let dir = std::env::var_os("ACCEL_MINILM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.accel-cache/minilm/model")
        });
    skips::dir_holding(
        dir,
        "model.safetensors",
        "all-MiniLM-L6-v2",
        "`make minilm-setup`",
    )
}

/// A VarStore holding `tensors` as trainable variables of the same names
/// (a dotted name becomes nested paths, as PyTorch modules name them).
fn var_store_of(tensors: &[(String, Tensor)]) -> nn::VarStore {
    let vs = nn::VarStore::new(Device::Cpu);
    for (name, t) in tensors {
        let mut parts: Vec<&str> = name.split('.').collect();
        let leaf = parts.pop().unwrap();
        let path = parts.iter().fold(vs.root(), |p, s| p / *s);
        let _ = path.var_copy(leaf, t);
    }
    vs
}

#[test]
fn minilm_round_trips_with_every_name_shape_dtype_and_byte() {
    let Some(dir) = minilm_dir() else { return };
    // libtorch's OpenMP workers spin between the copies: most of the time
    // on a loaded machine.
    tch::set_num_threads(1);
    let acc = acc();
    let out = tempfile::tempdir().unwrap();
    let mut original = Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    original.sort_by(|a, b| a.0.cmp(&b.0));
    // The weights; `embeddings.position_ids` is an int64 buffer (the
    // positions 0..512), not a parameter: neither trained nor saved.
    let (weights, buffers): (Vec<_>, Vec<_>) = original
        .into_iter()
        .partition(|(_, t)| t.is_floating_point());
    assert_eq!(weights.len(), 103, "MiniLM's weight tensors");
    let buffers: Vec<&str> = buffers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(buffers, ["embeddings.position_ids"]);
    // Loaded as the framework holds it, saved by accel.
    let model = TchModel::new(var_store_of(&weights)).unwrap();
    let saved = acc
        .save_model(&model, out.path().join("saved"), "5GB")
        .unwrap();
    let mut back = Tensor::read_safetensors(saved.join("model.safetensors")).unwrap();
    back.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(back.len(), weights.len());
    for ((name, got), (want_name, want)) in back.iter().zip(&weights) {
        assert_eq!(name, want_name);
        assert_eq!(got.size(), want.size(), "{name}");
        assert_eq!(got.kind(), want.kind(), "{name}");
        assert!(got.equal(want), "{name}: the bytes differ");
    }
    // And back through accel's loader into a zeroed model of the same
    // variables: every value as the original's.
    let zeros: Vec<(String, Tensor)> = weights
        .iter()
        .map(|(n, t)| (n.clone(), t.zeros_like()))
        .collect();
    let mut reloaded = TchModel::new(var_store_of(&zeros)).unwrap();
    acc.load_model(&mut reloaded, &saved).unwrap();
    for ((name, got), (_, want)) in reloaded.named_parameters().iter().zip(&weights) {
        assert!(got.equal(want), "{name} after load_model");
    }
}
