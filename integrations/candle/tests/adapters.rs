//! The adapters on one process (the `single` backend): host views alias the
//! `Var`s, a gradient is copied once from candle to accel and never back,
//! the prepared candle-nn optimizers give what candle-nn's own loop gives,
//! accumulation, clipping, and weights that candle's `VarBuilder` reads
//! back with their shapes and dtypes.

use accel::train::{Optimizer, Parameters, TrainConfig};
use accel::{Accelerator, DType as AccelDType};
use accel_candle::{init_uniform, AdamW, CandleModel, CandleOptimizer};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor, Var};
use candle_nn::optim::ParamsAdamW;
use candle_nn::{Linear, Module, VarBuilder, VarMap};

fn acc() -> Accelerator {
    // No launcher variables: one process, the exact `single` backend.
    Accelerator::new().expect("a one-process accelerator")
}

/// `a` (4 → 8, tanh) then `b` (8 → 1), seeded.
struct Net {
    a: Linear,
    b: Linear,
}

impl Net {
    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.a.forward(x).unwrap().tanh().unwrap();
        self.b.forward(&h).unwrap()
    }
}

fn build(dtype: DType, seed: u64) -> (VarMap, Net) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, dtype, &Device::Cpu);
    let net = Net {
        a: candle_nn::linear(4, 8, vb.pp("a")).unwrap(),
        b: candle_nn::linear(8, 1, vb.pp("b")).unwrap(),
    };
    init_uniform(&varmap, seed).unwrap();
    (varmap, net)
}

fn batch(n: usize, offset: usize) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..n * 4)
        .map(|i| (((i + offset * 4) * 37 % 19) as f32 - 9.0) / 9.0)
        .collect();
    let y: Vec<f32> = (0..n).map(|i| ((i + offset) % 3) as f32 - 1.0).collect();
    (
        Tensor::from_vec(x, (n, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (n, 1), &Device::Cpu).unwrap(),
    )
}

fn mse(net: &Net, x: &Tensor, y: &Tensor) -> Tensor {
    (net.forward(x) - y)
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
}

/// The address of a contiguous f32 CPU tensor's first element.
fn addr(t: &Tensor) -> usize {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(CpuStorage::F32(v)) => v[l.start_offset()..].as_ptr() as usize,
        _ => panic!("an f32 CPU tensor"),
    }
}

/// candle's view of the gradient of `name`, flattened.
fn grad_values(model: &CandleModel, name: &str) -> Vec<f32> {
    model
        .grad(name)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The 2-norm of `v`, summed in f64.
fn l2_norm(v: &[f32]) -> f64 {
    v.iter().map(|g| f64::from(*g).powi(2)).sum::<f64>().sqrt()
}

fn values(model: &CandleModel) -> Vec<f32> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.extend_from_slice(p.value_f32().unwrap()));
    out
}

#[test]
fn views_alias_the_vars_and_a_gradient_is_copied_once_in_and_never_out() {
    let (varmap, net) = build(DType::F32, 1);
    let mut model = CandleModel::new(&varmap).unwrap();
    let mut names = Vec::new();
    let mut view_addrs = Vec::new();
    model.visit_params(&mut |p| {
        assert_eq!(p.value.len(), p.grad.len());
        assert!(p.grad_f32().unwrap().iter().all(|&g| g == 0.0));
        names.push(p.name.to_string());
        view_addrs.push((
            p.value_f32().unwrap().as_ptr() as usize,
            p.grad_f32().unwrap().as_ptr() as usize,
        ));
    });
    assert_eq!(names, ["a.bias", "a.weight", "b.bias", "b.weight"]);
    assert_eq!(model.num_params(), 8 + 32 + 1 + 8);
    assert!(model.grad_kernels().is_none(), "CPU tensors are host views");
    // The value views are the Vars' own storage: same address, and a write
    // through the mutable view is what candle reads.
    for ((name, var), (v, g)) in model.named_vars().zip(&view_addrs) {
        assert_eq!(addr(var.as_tensor()), *v, "{name}: value view is the Var");
        assert_eq!(addr(model.grad(name).unwrap()), *g, "{name}: grad buffer");
    }
    model.visit_params_mut(&mut |mut p| {
        if p.name == "b.bias" {
            p.f32_mut().unwrap().0[0] = 42.0;
        }
    });
    let b_bias = varmap.data().lock().unwrap()["b.bias"].clone();
    assert_eq!(b_bias.as_tensor().to_vec1::<f32>().unwrap(), vec![42.0]);

    // candle -> accel: one copy of each gradient per backward pass.
    let (x, y) = batch(6, 0);
    assert_eq!(model.grad_bytes(), 4 * 49);
    model.backward(&mse(&net, &x, &y)).unwrap();
    assert_eq!(model.grad_bytes_copied(), model.grad_bytes());
    let first: Vec<f32> = grad_values(&model, "a.weight");
    assert!(first.iter().any(|&g| g != 0.0));
    // A second backward adds (accumulates) into the same buffers.
    model.backward(&mse(&net, &x, &y)).unwrap();
    assert_eq!(model.grad_bytes_copied(), 2 * model.grad_bytes());
    let twice: Vec<f32> = grad_values(&model, "a.weight");
    for (a, b) in first.iter().zip(&twice) {
        assert!((2.0 * a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} {b}");
    }
    // accel -> candle: the GradStore candle-nn's optimizer reads holds the
    // buffers themselves (same address, no copy).
    let store = model.grad_store();
    for ((name, var), (_, g)) in model.named_vars().zip(&view_addrs) {
        assert_eq!(addr(store.get(var.as_tensor()).unwrap()), *g, "{name}");
    }
    let mut opt = CandleOptimizer::<candle_nn::SGD>::new(&model, 0.1).unwrap();
    opt.step(&mut model).unwrap();
    assert_eq!(model.grad_bytes_copied(), 2 * model.grad_bytes());
    assert_eq!(values(&model).len(), 49);
}

#[test]
fn bf16_vars_are_bf16_host_views_and_bad_maps_are_refused() {
    let (varmap, _net) = build(DType::BF16, 2);
    let model = CandleModel::new(&varmap).unwrap();
    model.visit_params(&mut |p| {
        assert_eq!(p.value.dtype(), AccelDType::BF16);
        assert_eq!(p.grad.dtype(), AccelDType::BF16);
    });
    let e = CandleModel::new(&VarMap::new()).unwrap_err();
    assert!(e.to_string().contains("no variable"), "{e}");
    let ints = VarMap::new();
    ints.data().lock().unwrap().insert(
        "steps".into(),
        Var::zeros(3, DType::U32, &Device::Cpu).unwrap(),
    );
    let e = CandleModel::new(&ints).unwrap_err();
    assert!(e.to_string().contains("\"steps\""), "{e}");
}

/// `steps` steps of candle-nn's own loop (`opt.backward_step(&loss)`) on a
/// model seeded like the prepared one.
fn plain_candle<O: candle_nn::Optimizer>(config: O::Config, steps: usize) -> Vec<f32> {
    let (varmap, net) = build(DType::F32, 3);
    let model = CandleModel::new(&varmap).unwrap();
    let vars: Vec<Var> = model.named_vars().map(|(_, v)| v.clone()).collect();
    let mut opt = O::new(vars, config).unwrap();
    for s in 0..steps {
        let (x, y) = batch(8, s);
        opt.backward_step(&mse(&net, &x, &y)).unwrap();
    }
    values(&model)
}

/// The same through accel's prepared wrappers.
fn prepared<O: candle_nn::Optimizer + accel_candle::OptimizerState>(
    config: O::Config,
    steps: usize,
) -> Vec<f32> {
    let acc = acc().with_training(TrainConfig::default()).unwrap();
    let (varmap, net) = build(DType::F32, 3);
    let model = CandleModel::new(&varmap).unwrap();
    let opt = CandleOptimizer::<O>::new(&model, config).unwrap();
    let mut model = acc.prepare_model(model).unwrap();
    let mut opt = acc.prepare_optimizer(opt).unwrap();
    for s in 0..steps {
        let (x, y) = batch(8, s);
        acc.accumulate_step(false);
        acc.backward(&mut model, |m, scale| {
            m.backward(&(mse(&net, &x, &y) * f64::from(scale)).unwrap())
        })
        .unwrap()
        .unwrap();
        assert!(opt.step(&mut model).unwrap());
        opt.zero_grad(&mut model);
    }
    values(&model)
}

#[test]
fn prepared_candle_optimizers_match_candle_nn_loops_bit_for_bit() {
    let adamw = ParamsAdamW {
        lr: 0.01,
        ..ParamsAdamW::default()
    };
    assert_eq!(
        plain_candle::<candle_nn::SGD>(0.1, 4),
        prepared::<candle_nn::SGD>(0.1, 4)
    );
    let reference = plain_candle::<candle_nn::AdamW>(adamw.clone(), 4);
    assert_eq!(reference, prepared::<candle_nn::AdamW>(adamw.clone(), 4));
    // This crate's AdamW is candle-nn's, with its moments reachable.
    assert_eq!(reference, plain_candle::<AdamW>(adamw.clone(), 4));
    assert_eq!(reference, prepared::<AdamW>(adamw, 4));
}

#[test]
fn accumulating_two_half_batches_equals_one_full_batch() {
    let run = |k: usize| {
        let acc = acc()
            .with_training(TrainConfig {
                gradient_accumulation_steps: k,
                ..TrainConfig::default()
            })
            .unwrap();
        let (varmap, net) = build(DType::F32, 4);
        let model = CandleModel::new(&varmap).unwrap();
        let opt = CandleOptimizer::<candle_nn::SGD>::new(&model, 0.2).unwrap();
        let mut model = acc.prepare_model(model).unwrap();
        let mut opt = acc.prepare_optimizer(opt).unwrap();
        let mut stepped = 0;
        for s in 0..3 {
            let (x, y) = batch(8, s);
            for part in 0..k {
                let n = 8 / k;
                let (x, y) = (
                    x.narrow(0, part * n, n).unwrap(),
                    y.narrow(0, part * n, n).unwrap(),
                );
                acc.accumulate_step(false);
                acc.backward(&mut model, |m, scale| {
                    m.backward(&(mse(&net, &x, &y) * f64::from(scale)).unwrap())
                })
                .unwrap()
                .unwrap();
                stepped += usize::from(opt.step(&mut model).unwrap());
                opt.zero_grad(&mut model);
            }
        }
        assert_eq!(stepped, 3, "one optimizer step per accumulation group");
        values(&model)
    };
    let (one, two) = (run(1), run(2));
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-6 * a.abs().max(1.0), "{a} vs {b}");
    }
}

#[test]
fn clip_grad_norm_and_value_act_on_the_gradient_buffers() {
    let acc = acc().with_training(TrainConfig::default()).unwrap();
    let (varmap, net) = build(DType::F32, 5);
    let mut model = acc
        .prepare_model(CandleModel::new(&varmap).unwrap())
        .unwrap();
    let (x, y) = batch(8, 0);
    let grads = |m: &CandleModel| {
        let mut g = Vec::new();
        m.visit_params(&mut |p| g.extend_from_slice(p.grad_f32().unwrap()));
        g
    };
    acc.accumulate_step(false);
    acc.backward(&mut model, |m, s| {
        m.backward(&(mse(&net, &x, &y) * f64::from(s)).unwrap())
    })
    .unwrap()
    .unwrap();
    let before = grads(&model);
    let norm = l2_norm(&before);
    let max = norm / 4.0;
    let total = acc.clip_grad_norm(&mut model, max, 2.0).unwrap();
    assert!((total - norm).abs() <= 1e-6 * norm, "{total} vs {norm}");
    let after = grads(&model);
    let clipped = l2_norm(&after);
    assert!(
        (clipped - max).abs() <= 1e-4 * max,
        "clipped to {clipped}, wanted {max}"
    );
    // candle's view of the buffer is the clipped one.
    let w: Vec<f32> = grad_values(&model, "a.weight");
    assert!(after.windows(w.len()).any(|s| s == w.as_slice()));
    let cap = after.iter().map(|g| g.abs()).fold(0.0f32, f32::max) / 2.0;
    acc.clip_grad_value(&mut model, f64::from(cap)).unwrap();
    let capped = grads(&model);
    assert!(capped.iter().all(|g| g.abs() <= cap));
    assert!(capped.iter().any(|g| g.abs() == cap));
}

#[test]
fn save_model_writes_shapes_and_dtypes_that_var_builder_reads_back() {
    let acc = acc();
    for dtype in [DType::F32, DType::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let (varmap, _net) = build(dtype, 6);
        let mut model = CandleModel::new(&varmap).unwrap();
        acc.save_model(&model, dir.path(), accel::train::DEFAULT_MAX_SHARD_SIZE)
            .unwrap();
        let file = dir.path().join("model.safetensors");
        // SAFETY: (a test) the file was just written and nothing changes it.
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&[&file], dtype, &Device::Cpu) }.unwrap();
        for (name, var) in model.named_vars() {
            let t = vb.get(var.dims(), name).unwrap();
            assert_eq!(t.dtype(), dtype);
            let same = t.eq(var.as_tensor()).unwrap().flatten_all().unwrap();
            assert!(
                same.to_vec1::<u8>().unwrap().iter().all(|&e| e == 1),
                "{name}"
            );
        }
        // The file keeps each variable's dtype and shape.
        let raw = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
        assert_eq!(raw["a.weight"].dims(), &[8, 4]);
        assert_eq!(raw["a.weight"].dtype(), dtype);
        // load_model restores scribbled variables exactly.
        let saved = values_any(&model);
        for (_, var) in model.named_vars() {
            var.set(&var.ones_like().unwrap()).unwrap();
        }
        acc.load_model(&mut model, dir.path()).unwrap();
        assert_eq!(values_any(&model), saved);
    }
    // Sharded: several files and the index; VarBuilder takes the files.
    let dir = tempfile::tempdir().unwrap();
    let (varmap, _net) = build(DType::F32, 7);
    let model = CandleModel::new(&varmap).unwrap();
    acc.save_model(&model, dir.path(), 64u64).unwrap();
    let mut shards: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    shards.sort();
    assert!(shards.len() > 1, "{shards:?}");
    assert!(dir.path().join("model.safetensors.index.json").is_file());
    // SAFETY: (a test) the files were just written and nothing changes them.
    let vb =
        unsafe { VarBuilder::from_mmaped_safetensors(&shards, DType::F32, &Device::Cpu) }.unwrap();
    let w = vb.get((1, 8), "b.weight").unwrap();
    let var = varmap.data().lock().unwrap()["b.weight"].clone();
    assert_eq!(
        w.to_vec2::<f32>().unwrap(),
        var.as_tensor().to_vec2::<f32>().unwrap()
    );
}

#[test]
fn load_model_refuses_a_tensor_of_another_shape() {
    let acc = acc();
    let dir = tempfile::tempdir().unwrap();
    let t = Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
    let mut tensors = std::collections::HashMap::new();
    tensors.insert("a.weight".to_string(), t);
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    let (varmap, _net) = build(DType::F32, 8);
    let mut model = CandleModel::new(&varmap).unwrap();
    let e = acc.load_model(&mut model, dir.path()).unwrap_err();
    assert!(e.to_string().contains("shape [4, 8]"), "{e}");
}

/// Every value as f32 whatever the dtype.
fn values_any(model: &CandleModel) -> Vec<f32> {
    let mut out = Vec::new();
    for (_, var) in model.named_vars() {
        let t = var.as_tensor().to_dtype(DType::F32).unwrap();
        out.extend(t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    }
    out
}

#[test]
fn checkpoints_restore_the_vars_and_adamw_moments_exactly() {
    let acc = acc().with_training(TrainConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (varmap, net) = build(DType::F32, 9);
    let model = CandleModel::new(&varmap).unwrap();
    let opt = CandleOptimizer::<AdamW>::new(
        &model,
        ParamsAdamW {
            lr: 0.05,
            ..ParamsAdamW::default()
        },
    )
    .unwrap();
    let mut model = acc.prepare_model(model).unwrap();
    let mut opt = acc.prepare_optimizer(opt).unwrap();
    let (x, y) = batch(4, 1);
    let step = |model: &mut accel::train::PreparedModel<CandleModel>,
                opt: &mut accel::train::PreparedOptimizer<CandleOptimizer<AdamW>>| {
        acc.accumulate_step(false);
        acc.backward(model, |m, s| {
            m.backward(&(mse(&net, &x, &y) * f64::from(s)).unwrap())
        })
        .unwrap()
        .unwrap();
        opt.step(model).unwrap();
        opt.zero_grad(model);
    };
    step(&mut model, &mut opt);
    let saved = acc.save_state(dir.path(), &[&model, &opt]).unwrap();
    step(&mut model, &mut opt);
    let after_two = values(&model);
    for (_, var) in model.named_vars() {
        var.set(&var.ones_like().unwrap()).unwrap();
    }
    opt.set_lr(0.5);
    acc.load_state(&saved, &mut [&mut model, &mut opt]).unwrap();
    assert_eq!(opt.lr(), 0.05);
    step(&mut model, &mut opt);
    assert_eq!(values(&model), after_two);
}
