//! The adapters on one process (the `single` backend): record paths,
//! shapes and dtypes; one gradient copy from burn per backward and one
//! value copy back per step; prepared burn optimizers giving what burn's
//! own loop gives, bit for bit; accumulation; exact resume.

use accel::train::{Optimizer, Parameters, TrainConfig};
use accel::Accelerator;
use accel_burn::{BurnModel, BurnOptimizer};
use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, GradientsParams, SgdConfig};
use burn::tensor::{DType, Device, Tensor, TensorData};

fn acc() -> Accelerator {
    // No launcher variables: one process, the exact `single` backend.
    Accelerator::new().expect("a one-process accelerator")
}

/// `a` (4 → 8, tanh) then `b` (8 → 1).
#[derive(Module, Debug)]
struct Net {
    a: Linear,
    b: Linear,
}

impl Net {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.b.forward(self.a.forward(x).tanh())
    }
}

fn device() -> Device {
    Device::default().autodiff()
}

fn build() -> Net {
    let d = device();
    Net {
        a: LinearConfig::new(4, 8).init(&d),
        b: LinearConfig::new(8, 1).init(&d),
    }
}

fn batch(n: usize, offset: usize) -> (Tensor<2>, Tensor<2>) {
    let x: Vec<f32> = (0..n * 4)
        .map(|i| (((i + offset * 4) * 37 % 19) as f32 - 9.0) / 9.0)
        .collect();
    let y: Vec<f32> = (0..n).map(|i| ((i + offset) % 3) as f32 - 1.0).collect();
    let d = device();
    (
        Tensor::from_data(TensorData::new(x, [n, 4]), &d),
        Tensor::from_data(TensorData::new(y, [n, 1]), &d),
    )
}

fn mse(net: &Net, x: Tensor<2>, y: Tensor<2>) -> Tensor<1> {
    (net.forward(x) - y).powi_scalar(2).mean()
}

/// Every parameter's values, flattened in visiting order.
fn values(model: &dyn Parameters) -> Vec<f32> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.extend_from_slice(p.value_f32().unwrap()));
    out
}

/// A module's parameters read back from burn, in visiting order.
fn module_values(net: &Net) -> Vec<f32> {
    values(&BurnModel::new(net.clone()).unwrap())
}

#[test]
fn names_are_record_paths_with_shapes_and_dtypes() {
    let model = BurnModel::new(build()).unwrap();
    let names: Vec<&str> = model.names().collect();
    assert_eq!(names, ["a.weight", "a.bias", "b.weight", "b.bias"]);
    // burn's Linear stores its weight as (in, out).
    assert_eq!(model.param_shape("a.weight"), Some(vec![4, 8]));
    assert_eq!(model.param_shape("b.bias"), Some(vec![1]));
    assert_eq!(model.param_dtype("a.weight"), Some(DType::F32));
    assert_eq!(model.num_params(), 4 * 8 + 8 + 8 + 1);
    let mut grads = 0;
    model.visit_params(&mut |p| grads += p.grad.len());
    assert_eq!(grads, model.num_params());
}

#[test]
fn a_gradient_is_copied_once_in_and_values_once_out_per_step() {
    let net = build();
    let (x, y) = batch(6, 0);
    // burn's own gradients.
    let loss = mse(&net, x.clone(), y.clone());
    let grads = GradientsParams::from_grads(loss.backward(), &net);
    let want: Vec<f32> = [
        grads.get::<2>(net.a.weight.id).unwrap(),
        grads.get::<2>(net.b.weight.id).unwrap(),
    ]
    .iter()
    .flat_map(|t| t.to_data().try_to_vec::<f32>().unwrap())
    .collect();

    let mut model = BurnModel::new(net).unwrap();
    let loss = mse(model.module(), x, y);
    model.backward(loss).unwrap();
    let n = model.num_params() as u64;
    assert_eq!(
        model.bytes_copied(),
        [4 * n, 0],
        "one f32 copy in per parameter"
    );
    let mut got = Vec::new();
    model.visit_params(&mut |p| {
        if p.name.ends_with("weight") {
            got.extend_from_slice(p.grad_f32().unwrap());
        }
    });
    assert_eq!(got, want, "the buffers hold burn's gradients");

    let mut opt = BurnOptimizer::new(SgdConfig::new().build(), 0.5);
    opt.step(&mut model).unwrap();
    let stepped = values(&model);
    assert_eq!(model.bytes_copied(), [4 * n, 0], "nothing written back yet");
    let net = model.module().clone();
    assert_eq!(model.bytes_copied(), [4 * n, 4 * n], "one f32 copy out");
    assert_eq!(
        module_values(&net),
        stepped,
        "the module has the new values"
    );
    model.module();
    assert_eq!(model.bytes_copied(), [4 * n, 4 * n], "written once");
}

/// `steps` steps of burn's own loop (its `ModuleOptimizer`).
fn plain_burn(opt: impl Into<burn::optim::ModuleOptimizer>, lr: f64, steps: usize) -> Vec<f32> {
    let mut opt = opt.into();
    let mut net = build_seeded();
    for s in 0..steps {
        let (x, y) = batch(6, s);
        let loss = mse(&net, x, y);
        let grads = GradientsParams::from_grads(loss.backward(), &net);
        net = opt.step(lr, net, grads);
    }
    module_values(&net)
}

/// The same steps through accel's prepared model and optimizer.
fn prepared<O: burn::optim::Optimizer>(opt: O, lr: f64, steps: usize) -> Vec<f32> {
    let acc = acc();
    let mut model = acc
        .prepare_model(BurnModel::new(build_seeded()).unwrap())
        .unwrap();
    let mut opt = acc.prepare_optimizer(BurnOptimizer::new(opt, lr)).unwrap();
    for s in 0..steps {
        let (x, y) = batch(6, s);
        acc.backward(&mut model, |m, scale| {
            let loss = mse(m.module(), x, y);
            m.backward(loss.mul_scalar(scale))
        })
        .unwrap()
        .unwrap();
        opt.step(&mut model).unwrap();
        opt.zero_grad(&mut model);
    }
    values(&*model)
}

/// The same initial values every call (burn's default initialisation is
/// random): a fixed pattern written through the adapter.
fn build_seeded() -> Net {
    let mut model = BurnModel::new(build()).unwrap();
    let mut k = 0u32;
    model.visit_params_mut(&mut |mut p| {
        let (v, _) = p.f32_mut().unwrap();
        for x in v {
            k = k.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            *x = ((k >> 8) % 2000) as f32 / 2000.0 - 0.5;
        }
    });
    model.into_module()
}

#[test]
fn prepared_burn_optimizers_match_burns_own_loop_bit_for_bit() {
    let sgd = SgdConfig::new();
    assert_eq!(
        prepared(sgd.build(), 0.1, 4),
        plain_burn(sgd.build(), 0.1, 4)
    );
    let adamw = AdamWConfig::new().with_weight_decay(0.01);
    assert_eq!(
        prepared(adamw.build(), 0.01, 4),
        plain_burn(adamw.build(), 0.01, 4)
    );
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
        let mut model = acc
            .prepare_model(BurnModel::new(build_seeded()).unwrap())
            .unwrap();
        let mut opt = acc
            .prepare_optimizer(BurnOptimizer::new(SgdConfig::new().build(), 0.1))
            .unwrap();
        for part in 0..k {
            let (x, y) = batch(8 / k, part * (8 / k));
            acc.accumulate_step(part + 1 == k);
            acc.backward(&mut model, |m, scale| {
                let loss = mse(m.module(), x, y);
                m.backward(loss.mul_scalar(scale))
            })
            .unwrap()
            .unwrap();
            opt.step(&mut model).unwrap();
            opt.zero_grad(&mut model);
        }
        values(&*model)
    };
    let (one, two) = (run(1), run(2));
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}

#[test]
fn burn_optimizer_state_resumes_exactly() {
    let lr = 0.01;
    let make = || BurnOptimizer::new(AdamWConfig::new().build(), lr);
    // Four steps straight.
    let mut model = BurnModel::new(build_seeded()).unwrap();
    let mut opt = make();
    let step = |model: &mut BurnModel<Net>, opt: &mut BurnOptimizer<_>, s: usize| {
        let (x, y) = batch(6, s);
        let loss = mse(model.module(), x, y);
        model.backward(loss).unwrap();
        opt.step(model).unwrap();
        opt.zero_grad(model);
    };
    for s in 0..4 {
        step(&mut model, &mut opt, s);
    }
    let straight = values(&model);
    // Two steps, the state through a StateDict, two more.
    let mut model = BurnModel::new(build_seeded()).unwrap();
    let mut opt = make();
    for s in 0..2 {
        step(&mut model, &mut opt, s);
    }
    let saved = opt.state_dict();
    let mut opt = make();
    opt.load_state_dict(&saved).unwrap();
    assert_eq!(opt.steps(), 2);
    for s in 2..4 {
        step(&mut model, &mut opt, s);
    }
    assert_eq!(values(&model), straight);
}
