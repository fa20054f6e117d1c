//! ZeRO stages 0-3 on a burn model, 2 ranks as threads over cpu-gloo, each
//! run under a hard bound (tests/common): a chain of three burn `Linear`
//! layers with tanh and cross-entropy, 2 micro-batches of accumulation per
//! step, trained through the accelerator's ZeRO entry points
//! (`prepare_zero`, the layers run one by one with the optimizer as the
//! gate, `zero_step`) with burn's SGD with momentum as the shard
//! optimizer. Every stage ends on the parameters of the unsharded
//! data-parallel run (`prepare_optimizer` with the same burn SGD, one burn
//! backward) within `1e-5 × (1 + |x|)`. Between steps a stage-3 model holds
//! no values or gradients in accel's copies and a stage-2 model no
//! gradients.

mod common;

use accel::train::{Parameters, TrainConfig};
use accel::zero::{Stage, UnitGate, WrapPolicy};
use accel::Accelerator;
use accel_burn::{BurnModel, BurnOptimizer};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsParams, Sgd, SgdConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

use common::two_ranks;

const IN: usize = 6;
const CLASSES: usize = 3;
const BS: usize = 4;
const K: usize = 2;
const STEPS: usize = 3;
const LR: f64 = 0.1;

#[derive(Module, Debug)]
struct Chain {
    a: Linear,
    b: Linear,
    c: Linear,
}

fn device() -> Device {
    Device::default().autodiff()
}

fn build() -> BurnModel<Chain> {
    let d = device();
    let mut model = BurnModel::new(Chain {
        a: LinearConfig::new(IN, 12).init(&d),
        b: LinearConfig::new(12, 8).init(&d),
        c: LinearConfig::new(8, CLASSES).init(&d),
    })
    .unwrap();
    model.init_uniform(7);
    model
}

fn sgd() -> BurnOptimizer<Sgd> {
    let momentum = MomentumConfig {
        momentum: 0.9,
        dampening: 0.0,
        nesterov: false,
    };
    BurnOptimizer::new(SgdConfig::new().with_momentum(Some(momentum)).build(), LR)
}

/// Micro-batch `j` of step `s` on `rank` of 2: inputs and class labels.
fn batch(s: usize, j: usize, rank: usize) -> (Tensor<2>, Tensor<1, Int>) {
    let start = ((s * K + j) * 2 + rank) * BS;
    let x: Vec<f32> = (start..start + BS)
        .flat_map(|i| (0..IN).map(move |f| (((i * 7 + f * 13) % 19) as f32 - 9.0) / 9.0))
        .collect();
    let y: Vec<i64> = (start..start + BS)
        .map(|i| ((i * 5) % CLASSES) as i64)
        .collect();
    let d = device();
    (
        Tensor::from_data(TensorData::new(x, [BS, IN]), &d),
        Tensor::from_data(TensorData::new(y, [BS]), &d),
    )
}

fn ce(logits: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&device())
        .forward(logits, y)
}

fn named_values(model: &dyn Parameters) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.push((p.name.to_string(), p.value_f32().unwrap().to_vec())));
    out
}

fn resident(model: &dyn Parameters) -> (usize, usize) {
    let (mut v, mut g) = (0, 0);
    model.visit_params(&mut |p| {
        v += p.value.len();
        g += p.grad.len();
    });
    (v, g)
}

fn config(stage: Stage) -> TrainConfig {
    TrainConfig {
        gradient_accumulation_steps: K,
        sharding: Some(stage),
        ..TrainConfig::default()
    }
}

/// Unsharded data parallelism: one burn backward, the averaged gradients
/// all-reduced by `backward`, burn's SGD with momentum.
fn unsharded(acc: &Accelerator) -> accel::Result<Vec<(String, Vec<f32>)>> {
    acc.set_training_config(config(Stage::None))?;
    let mut model = acc.prepare_model(build())?;
    let mut opt = acc.prepare_optimizer(sgd())?;
    for s in 0..STEPS {
        for j in 0..K {
            acc.accumulate_step(false);
            let (x, y) = batch(s, j, acc.rank());
            acc.backward(&mut model, |m, scale| {
                let net = m.module();
                let logits = net.c.forward(net.b.forward(net.a.forward(x).tanh()).tanh());
                m.backward(ce(logits, y).mul_scalar(scale))
            })??;
            opt.step(&mut model)?;
            opt.zero_grad(&mut model);
        }
    }
    Ok(named_values(&*model))
}

/// The layers one by one through `gate`: each gathered for its forward
/// and released; one burn backward; then in reverse order each gathered,
/// its gradients added and reduced.
fn gated(
    model: &mut BurnModel<Chain>,
    gate: &mut dyn UnitGate,
    x: Tensor<2>,
    y: Tensor<1, Int>,
    scale: f32,
) -> accel::Result<f32> {
    gate.gather(model, "a")?;
    let na = model.module().clone();
    let h = na.a.forward(x).tanh();
    gate.release(model, "a")?;
    gate.gather(model, "b")?;
    let nb = model.module().clone();
    let h = nb.b.forward(h).tanh();
    gate.release(model, "b")?;
    gate.gather(model, "c")?;
    let nc = model.module().clone();
    let loss = ce(nc.c.forward(h), y);
    let value = loss.to_data().as_slice::<f32>().unwrap()[0];
    let mut grads = loss.mul_scalar(scale).backward();
    let gc = GradientsParams::from_module(&mut grads, &nc.c);
    let gb = GradientsParams::from_module(&mut grads, &nb.b);
    let ga = GradientsParams::from_module(&mut grads, &na.a);
    model.add_module_grads(&gc, "c")?;
    gate.reduce_grads(model, "c")?;
    for (g, name) in [(gb, "b"), (ga, "a")] {
        gate.gather(model, name)?;
        model.add_module_grads(&g, name)?;
        gate.reduce_grads(model, name)?;
    }
    Ok(value)
}

/// The same training at ZeRO `stage`.
fn sharded(acc: &Accelerator, stage: Stage) -> accel::Result<Vec<(String, Vec<f32>)>> {
    acc.set_training_config(config(stage))?;
    let mut model = acc.prepare_model(build())?;
    let mut zero = acc.prepare_zero(&mut model, &WrapPolicy::Depth(1), sgd())?;
    let mut stepped = 0;
    for s in 0..STEPS {
        for j in 0..K {
            acc.accumulate_step(false);
            let (x, y) = batch(s, j, acc.rank());
            acc.backward(&mut model, |m, scale| gated(m, &mut zero, x, y, scale))??;
            if acc.zero_step(&mut zero, &mut model, None)?.is_some() {
                stepped += 1;
                model.visit_params_mut(&mut |mut p| p.f32_mut().unwrap().1.fill(0.0));
                let (v, g) = resident(&*model);
                match stage {
                    Stage::Full => assert_eq!((v, g), (0, 0), "stage 3 after step {s}"),
                    Stage::Gradients => assert_eq!(g, 0, "stage 2 after step {s}"),
                    _ => {}
                }
            }
        }
    }
    assert_eq!(stepped, STEPS, "zero_step stepped {stepped} times");
    Ok(zero.full_parameters(&*model)?.params)
}

#[test]
fn zero_stages_0_to_3_with_burn_sgd_equal_the_unsharded_run_on_2_ranks() {
    let want = two_ranks(unsharded);
    assert_eq!(want[0], want[1], "the unsharded ranks differ");
    let want = &want[0];
    for stage in [Stage::None, Stage::Optimizer, Stage::Gradients, Stage::Full] {
        let got = two_ranks(move |acc| sharded(acc, stage));
        assert_eq!(
            got[0], got[1],
            "stage {stage}: the ranks' parameters differ"
        );
        let got = &got[0];
        assert_eq!(got.len(), want.len(), "stage {stage}: parameter count");
        for ((gn, gv), (wn, wv)) in got.iter().zip(want) {
            assert_eq!(gn, wn, "stage {stage}: parameter order");
            for (i, (x, w)) in gv.iter().zip(wv).enumerate() {
                assert!(
                    (x - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "stage {stage}: {gn}[{i}] is {x}, unsharded {w}"
                );
            }
        }
    }
}
