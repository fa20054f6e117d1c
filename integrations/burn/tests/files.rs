//! Files on one process: `save_model` in the Hugging Face layout that
//! burn's own safetensors store loads back and Python's safetensors reads
//! with the record paths, shapes and dtypes; `save_state` / `load_state`
//! resuming a prepared model and burn AdamW exactly.

use std::path::PathBuf;

use accel::train::{Optimizer, Parameters, PreparedModel, PreparedOptimizer, TrainConfig};
use accel::Accelerator;
use accel_burn::{BurnModel, BurnOptimizer};
use burn::module::{Module, Param};
use burn::nn::Linear;
use burn::optim::{AdamW, AdamWConfig};
use burn::tensor::{DType, Device, Tensor, TensorData};
use burn_store::{ModuleSnapshot, SafetensorsStore};

use accel_test_support::python;

fn acc() -> Accelerator {
    Accelerator::new().expect("a one-process accelerator")
}

/// A linear layer and an f64 parameter in a list (burn's NdArray
/// backend has f32 and f64 floats, no f16 or bf16).
#[derive(Module, Debug)]
struct Net {
    fc: Linear,
    scales: Vec<Param<Tensor<1>>>,
}

fn device() -> Device {
    Device::default().autodiff()
}

fn build(seed: u32) -> Net {
    let d = device();
    let mut k = seed;
    let mut next = || {
        k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        ((k >> 8) % 2000) as f32 / 2000.0 - 0.5
    };
    let w: Vec<f32> = (0..3 * 2).map(|_| next()).collect();
    let b: Vec<f32> = (0..2).map(|_| next()).collect();
    let s: Vec<f64> = (0..5).map(|_| f64::from(next())).collect();
    Net {
        fc: Linear {
            weight: Param::from_data(TensorData::new(w, [3, 2]), &d),
            bias: Some(Param::from_data(TensorData::new(b, [2]), &d)),
        },
        scales: vec![Param::from_tensor(Tensor::from_data(
            TensorData::new(s, [5]),
            (&d, DType::F64),
        ))],
    }
}

/// Every parameter's values as f32, in visiting order.
fn values(model: &dyn Parameters) -> Vec<f32> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| {
        let h = match p.value {
            accel::Buf::Host(h) => h,
            accel::Buf::Device(_) => panic!("host values"),
        };
        out.extend_from_slice(&accel::train::host_to_f32(h).unwrap());
    });
    out
}

fn python() -> Option<PathBuf> {
    python::venv_tb_python("safetensors, numpy")
}

#[test]
fn save_model_is_read_back_by_burn_store_and_python_safetensors() {
    let acc = acc();
    let dir = tempfile::tempdir().unwrap();
    let model = BurnModel::new(build(1)).unwrap();
    let names: Vec<&str> = model.names().collect();
    assert_eq!(names, ["fc.weight", "fc.bias", "scales.0"]);
    acc.save_model(&model, dir.path(), accel::train::DEFAULT_MAX_SHARD_SIZE)
        .unwrap();
    let file = dir.path().join("model.safetensors");

    // burn's own store fills a module of the same structure.
    let mut other = build(2);
    let mut store = SafetensorsStore::from_file(&file);
    let applied = other.load_from(&mut store).unwrap();
    assert!(applied.errors.is_empty(), "{:?}", applied.errors);
    assert!(applied.missing.is_empty(), "{:?}", applied.missing);
    assert!(applied.unused.is_empty(), "{:?}", applied.unused);
    assert_eq!(applied.applied.len(), 3);
    assert_eq!(values(&BurnModel::new(other).unwrap()), values(&model));

    // Python's safetensors: the names, shapes and dtypes.
    let Some(py) = python() else { return };
    let script = "import sys\nfrom safetensors.numpy import load_file\n\
        t = load_file(sys.argv[1])\n\
        for k in sorted(t): print(k, list(t[k].shape), t[k].dtype, float(t[k].astype('float64').sum()))\n";
    let out = python::run_python(&py, script, &[&file]);
    let lines: Vec<&str> = out.lines().collect();
    let sum = |name: &str| -> f64 {
        let mut s = 0.0f64;
        model.visit_params(&mut |p| {
            if p.name == name {
                let accel::Buf::Host(h) = p.value else {
                    panic!("host values")
                };
                s = accel::train::host_to_f32(h)
                    .unwrap()
                    .iter()
                    .map(|&v| f64::from(v))
                    .sum();
            }
        });
        s
    };
    let want = [
        ("fc.bias", "[2] float32"),
        ("fc.weight", "[3, 2] float32"),
        ("scales.0", "[5] float64"),
    ];
    assert_eq!(lines.len(), want.len(), "{out}");
    for (line, (name, shape_dtype)) in lines.iter().zip(want) {
        assert!(
            line.starts_with(&format!("{name} {shape_dtype} ")),
            "{line}"
        );
        let got: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((got - sum(name)).abs() < 1e-5, "{line}: {}", sum(name));
    }
}

fn batch(offset: usize) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (0..4 * 3)
        .map(|i| (((i + offset * 3) * 37 % 19) as f32 - 9.0) / 9.0)
        .collect();
    let y: Vec<f32> = (0..4 * 2)
        .map(|i| ((i + offset) % 3) as f32 - 1.0)
        .collect();
    let d = device();
    (
        Tensor::from_data(TensorData::new(x, [4, 3]), &d),
        Tensor::from_data(TensorData::new(y, [4, 2]), &d),
    )
}

fn loss(net: &Net, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    let s = net.scales[0].val().cast(DType::F32).sum();
    (net.fc.forward(x) - y).powi_scalar(2).mean() + s.powi_scalar(2)
}

#[test]
fn save_state_and_load_state_resume_model_and_adamw_exactly() {
    let acc = acc().with_training(TrainConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut model = acc
        .prepare_model(BurnModel::new(build(3)).unwrap())
        .unwrap();
    let mut opt = acc
        .prepare_optimizer(BurnOptimizer::new(AdamWConfig::new().build(), 0.05))
        .unwrap();
    let step = |model: &mut PreparedModel<BurnModel<Net>>,
                opt: &mut PreparedOptimizer<BurnOptimizer<AdamW>>,
                s: usize| {
        let (x, y) = batch(s);
        acc.accumulate_step(false);
        acc.backward(model, |m, scale| {
            let l = loss(m.module(), x, y);
            m.backward(l.mul_scalar(scale))
        })
        .unwrap()
        .unwrap();
        opt.step(model).unwrap();
        opt.zero_grad(model);
    };
    step(&mut model, &mut opt, 0);
    step(&mut model, &mut opt, 1);
    let saved = acc.save_state(dir.path(), &[&model, &opt]).unwrap();
    step(&mut model, &mut opt, 2);
    step(&mut model, &mut opt, 3);
    let straight = values(&*model);
    // Scribble, then resume from the checkpoint.
    model.visit_params_mut(&mut |mut p| {
        if let Ok((v, _)) = p.f32_mut() {
            v.fill(1.0);
        }
    });
    opt.set_lr(0.5);
    acc.load_state(&saved, &mut [&mut model, &mut opt]).unwrap();
    assert_eq!(opt.lr(), 0.05);
    step(&mut model, &mut opt, 2);
    step(&mut model, &mut opt, 3);
    assert_eq!(values(&*model), straight);
}
