//! ZeRO (`accel::zero`) on a tch model with CPU tensors: stages
//! `optimizer`, `gradients` and `full`, 2 ranks as threads over cpu-gloo,
//! with 1 and 2 micro-batches of local accumulation, give the parameters of
//! one process stepping [`accel::train::Sgd`] on the global batch, within
//! `1e-5 × (1 + |x|)` per element (f32 sums in another order).
//!
//! The model is [`TchModel`], the crate's `Parameters` adapter. Stage 3
//! drives it module by module through the optimizer's `UnitGate` around
//! libtorch's autograd: gather and release around each layer's forward,
//! gather every layer before the one `backward()` (the graph refers to the
//! variables, whose data a gather puts back), then `reduce_grads` per
//! layer. `TchModel` keeps the default `set_param_storage` (the storage
//! stays: the same results without the memory saving); [`Zero3TchModel`]
//! frees it, and holds no parameter data between steps.

use accel::train::{Optimizer, Parameters, Sgd};
use accel::zero::{ShardedSgd, Stage, UnitGate, WrapPolicy, ZeroOptimizer};
use accel::Accelerator;
use accel_tch::{TchModel, Zero3TchModel};
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

mod common;
use accel_test_support::ranks;
use common::det;
use ranks::two_ranks;

const IN: usize = 4;
const HIDDEN: usize = 8;
const BS: usize = 3;
const STEPS: usize = 3;
const LR: f64 = 0.1;
const MOMENTUM: f32 = 0.9;
const TOL: f32 = 1e-5;

/// `a` (IN → HIDDEN, tanh) then `b` (HIDDEN → 1), with fixed weights (no
/// draw from libtorch's global generator, which the rank threads share).
struct Net {
    a: nn::Linear,
    b: nn::Linear,
}

fn build() -> (TchModel, Net) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Net {
        a: nn::linear(
            vs.root() / "a",
            IN as i64,
            HIDDEN as i64,
            Default::default(),
        ),
        b: nn::linear(vs.root() / "b", HIDDEN as i64, 1, Default::default()),
    };
    tch::no_grad(|| {
        let mut vars: Vec<_> = vs.variables().into_iter().collect();
        vars.sort_by(|x, y| x.0.cmp(&y.0));
        for (i, (_, mut t)) in vars.into_iter().enumerate() {
            let n = t.numel();
            let v: Vec<f32> = (0..n).map(|j| 0.5 * det(i + 1, j)).collect();
            let src = Tensor::from_slice(&v).view(t.size().as_slice());
            t.copy_(&src);
        }
    });
    (TchModel::new(vs).expect("a CPU f32 model"), net)
}

/// Samples `range` of the data set: inputs (`len × IN`) and targets.
fn samples(range: std::ops::Range<usize>) -> (Tensor, Tensor) {
    let len = range.len() as i64;
    let x: Vec<f32> = range
        .clone()
        .flat_map(|i| (0..IN).map(move |j| det(1000 + i, j)))
        .collect();
    let y: Vec<f32> = range.map(|i| (det(2000 + i, 0) * 2.0).sin()).collect();
    (
        Tensor::from_slice(&x).view([len, IN as i64]),
        Tensor::from_slice(&y).view([len, 1]),
    )
}

fn mse(out: &Tensor, y: &Tensor) -> Tensor {
    (out - y).pow_tensor_scalar(2).mean(Kind::Float)
}

fn values(model: &dyn Parameters) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.push((p.name.to_string(), p.value_f32().unwrap().to_vec())));
    out
}

fn zero_grads(model: &mut dyn Parameters) {
    model.visit_params_mut(&mut |mut p| p.f32_mut().unwrap().1.fill(0.0));
}

fn resident(model: &dyn Parameters) -> usize {
    let mut n = 0;
    model.visit_params(&mut |p| n += p.value.len() + p.grad.len());
    n
}

/// One rank's run: `STEPS` sharded steps of `k` micro-batches each, on a
/// [`Zero3TchModel`] when `free`.
fn sharded(
    acc: &Accelerator,
    stage: Stage,
    k: usize,
    free: bool,
) -> accel::Result<Vec<(String, Vec<f32>)>> {
    let (n, rank) = (acc.world_size(), acc.rank());
    let (model, net) = build();
    let mut model: Box<dyn Parameters> = if free {
        Box::new(Zero3TchModel::new(model))
    } else {
        Box::new(model)
    };
    let model = model.as_mut();
    let sgd = ShardedSgd::new(LR).with_momentum(MOMENTUM);
    let mut zero = ZeroOptimizer::new(
        acc.comm().clone(),
        &*model,
        stage,
        &WrapPolicy::Depth(1),
        sgd,
    )?;
    let global = n * k * BS;
    for s in 0..STEPS {
        for j in 0..k {
            let start = s * global + (j * n + rank) * BS;
            let (x, y) = samples(start..start + BS);
            // Unit by unit; every gate call does nothing below stage 3.
            zero.gather(model, "a")?;
            let h = net.a.forward(&x).tanh();
            zero.release(model, "a")?;
            zero.gather(model, "b")?;
            let loss = mse(&net.b.forward(&h), &y) / k as f64;
            // Released too, although its backward comes next: autograd
            // saved `b.weight` (for the gradient of `h`), and a freeing
            // model must have it back before the backward.
            zero.release(model, "b")?;
            zero.gather(model, "b")?;
            zero.gather(model, "a")?;
            loss.backward();
            zero.reduce_grads(model, "b")?;
            zero.reduce_grads(model, "a")?;
        }
        zero.step(model)?;
        zero_grads(model);
        if free {
            assert_eq!(resident(model), 0, "rank {rank}: released after step {s}");
        }
    }
    assert_eq!(
        zero.state_numel(),
        zero.plan().shard_numel(),
        "rank {rank}: momentum for this rank's shard only"
    );
    Ok(zero.full_parameters(model)?.params)
}

/// One process on the global batches.
fn reference(n: usize, k: usize) -> Vec<(String, Vec<f32>)> {
    let (mut model, net) = build();
    let mut sgd = Sgd::new(LR).with_momentum(MOMENTUM);
    let global = n * k * BS;
    for s in 0..STEPS {
        let (x, y) = samples(s * global..(s + 1) * global);
        let h = net.a.forward(&x).tanh();
        mse(&net.b.forward(&h), &y).backward();
        sgd.step(&mut model).unwrap();
        zero_grads(&mut model);
    }
    values(&model)
}

fn assert_close(what: &str, got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for ((gn, g), (wn, w)) in got.iter().zip(want) {
        assert_eq!(gn, wn, "{what}");
        assert_eq!(g.len(), w.len(), "{what}: {gn}");
        for (i, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= TOL * (1.0 + b.abs()),
                "{what}: {gn}[{i}] is {a}, one process gives {b}"
            );
        }
    }
}

#[test]
fn zero_stages_on_tch_give_the_parameters_of_one_process() {
    tch::set_num_threads(1);
    let start = values(&build().0);
    let runs = [
        (Stage::Optimizer, false),
        (Stage::Gradients, false),
        (Stage::Full, false),
        (Stage::Full, true),
    ];
    for (stage, free) in runs {
        for k in [1, 2] {
            let ranks = two_ranks(move |acc| sharded(acc, stage, k, free));
            let want = reference(2, k);
            // The test can fail: training moved the parameters.
            let moved = want
                .iter()
                .zip(&start)
                .any(|((_, w), (_, s))| w.iter().zip(s).any(|(a, b)| (a - b).abs() > 1e-3));
            assert!(moved, "the reference run did not train");
            for (r, got) in ranks.iter().enumerate() {
                assert_close(
                    &format!("stage {stage}, {k} micro-batches, rank {r}"),
                    got,
                    &want,
                );
            }
        }
    }
}

#[test]
fn zero3_tch_model_frees_and_restores_its_tensors() {
    let (model, _net) = build();
    let before = values(&model);
    let mut m = Zero3TchModel::new(model);
    let numel = m.num_params();
    assert_eq!(m.resident_numel(), numel);
    m.set_param_storage("a.weight", 0).unwrap();
    assert_eq!(m.resident_numel(), numel - IN * HIDDEN);
    assert_eq!(m.num_params(), numel, "the full count stays");
    assert_eq!(
        resident(&m),
        2 * (numel - IN * HIDDEN),
        "gradient freed too"
    );
    m.set_param_storage("a.weight", IN * HIDDEN).unwrap();
    let back = values(&m);
    assert_eq!(back[1].0, "a.weight");
    assert!(back[1].1.iter().all(|&v| v == 0.0), "zero-filled");
    assert_eq!(back[0], before[0], "other parameters untouched");
    let e = m.set_param_storage("a.weight", 3).unwrap_err();
    assert!(e.to_string().contains("cannot hold 3"), "{e}");
    assert!(m.set_param_storage("c.weight", 0).is_err());
    // Stage 2: a released gradient is set to none and seen empty (it is
    // not allocated again by a visit), the other gradients stay whole.
    m.release_grad("b.weight").unwrap();
    assert_eq!(
        resident(&m),
        2 * numel - HIDDEN,
        "b.weight's gradient freed"
    );
    let mut grads = Vec::new();
    m.visit_params_mut(&mut |p| grads.push((p.name.to_string(), p.grad.len())));
    assert!(grads.contains(&("b.weight".to_string(), 0)), "{grads:?}");
    assert_eq!(
        resident(&m),
        2 * numel - HIDDEN,
        "a visit does not allocate it"
    );
    // A gather gives a gradient set to none back, zero-filled (stage 3
    // after stage 2's release, or after an optimizer's zero_grad).
    m.set_param_storage("b.weight", 0).unwrap();
    m.set_param_storage("b.weight", HIDDEN).unwrap();
    assert_eq!(
        resident(&m),
        2 * numel,
        "the gathered unit's gradient is back"
    );
    let b = values(&m)
        .into_iter()
        .find(|(n, _)| n == "b.weight")
        .unwrap();
    assert!(b.1.iter().all(|&v| v == 0.0), "zero-filled");
    assert!(m.release_grad("c.weight").is_err());
}
