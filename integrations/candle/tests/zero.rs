//! ZeRO stages 0-3 on a candle model, 2 ranks as threads over cpu-gloo,
//! each run under a hard bound (tests/common): a chain of three candle-nn
//! `Linear` layers with cross-entropy, 2 micro-batches of accumulation per
//! step, trained through the accelerator's ZeRO entry points
//! (`prepare_zero`, [`sequential_loss_and_grad`] with the optimizer as the
//! gate, `zero_step`). Every stage ends on the parameters of the unsharded
//! data-parallel run (`prepare_optimizer` with SGD, candle's one-pass
//! backward) within `1e-5 × (1 + |x|)`; the checksums are printed. Between
//! steps a stage-3 model holds no variable or gradient storage and a
//! stage-2 model no gradient storage. A stage-3 run stopped half way and
//! resumed from its sharded checkpoint in a fresh group ends on the
//! uninterrupted run's bits, and the gathered model saved with
//! `save_model` is read back by candle with its shapes.

mod common;

use std::path::Path;

use accel::train::{Parameters, Sgd, TrainConfig, DEFAULT_MAX_SHARD_SIZE};
use accel::zero::{ShardedSgd, Stage, UnitGate, WrapPolicy, ZeroOptimizer};
use accel::Accelerator;
use accel_candle::{init_uniform, sequential_loss_and_grad, CandleModel, Link};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder, VarMap};

use common::two_ranks;

const IN: usize = 6;
const CLASSES: usize = 3;
const BS: usize = 4;
const K: usize = 2;
const STEPS: usize = 3;
const LR: f64 = 0.1;
const MOMENTUM: f32 = 0.9;

fn a(vb: &VarBuilder<'_>) -> candle_core::Result<Linear> {
    candle_nn::linear(IN, 12, vb.pp("a"))
}
fn b(vb: &VarBuilder<'_>) -> candle_core::Result<Linear> {
    candle_nn::linear(12, 8, vb.pp("b"))
}
fn c(vb: &VarBuilder<'_>) -> candle_core::Result<Linear> {
    candle_nn::linear(8, CLASSES, vb.pp("c"))
}

fn build() -> (VarMap, CandleModel) {
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    a(&vb).unwrap();
    b(&vb).unwrap();
    c(&vb).unwrap();
    init_uniform(&varmap, 7).unwrap();
    let model = CandleModel::new(&varmap).unwrap();
    (varmap, model)
}

/// The modules `a`, `b`, `c` over `varmap`, `tanh` between them, as the
/// gate's links, handed to `f`.
fn with_links<R>(varmap: &VarMap, f: impl FnOnce(&[Link<'_>]) -> R) -> R {
    let vb = VarBuilder::from_varmap(varmap, DType::F32, &Device::Cpu);
    let fa = |x: &Tensor| a(&vb)?.forward(x)?.tanh();
    let fb = |x: &Tensor| b(&vb)?.forward(x)?.tanh();
    let fc = |x: &Tensor| c(&vb)?.forward(x);
    let links = [
        Link {
            module: "a",
            forward: &fa,
        },
        Link {
            module: "b",
            forward: &fb,
        },
        Link {
            module: "c",
            forward: &fc,
        },
    ];
    f(&links)
}

/// Micro-batch `j` of step `s` on `rank` of 2: inputs and class labels.
fn batch(s: usize, j: usize, rank: usize) -> (Tensor, Tensor) {
    let start = ((s * K + j) * 2 + rank) * BS;
    let x: Vec<f32> = (start..start + BS)
        .flat_map(|i| (0..IN).map(move |f| (((i * 7 + f * 13) % 19) as f32 - 9.0) / 9.0))
        .collect();
    let y: Vec<u32> = (start..start + BS)
        .map(|i| ((i * 5) % CLASSES) as u32)
        .collect();
    (
        Tensor::from_vec(x, (BS, IN), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, BS, &Device::Cpu).unwrap(),
    )
}

fn named_values(model: &dyn Parameters) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.push((p.name.to_string(), p.value_f32().unwrap().to_vec())));
    out
}

fn grad_numel(model: &dyn Parameters) -> usize {
    let mut n = 0;
    model.visit_params(&mut |p| n += p.grad.len());
    n
}

fn zero_grads(model: &mut dyn Parameters) {
    model.visit_params_mut(&mut |mut p| p.f32_mut().unwrap().1.fill(0.0));
}

fn checksum(values: &[(String, Vec<f32>)]) -> f64 {
    values
        .iter()
        .flat_map(|(_, v)| v)
        .map(|x| f64::from(*x))
        .sum()
}

fn config(stage: Stage) -> TrainConfig {
    TrainConfig {
        gradient_accumulation_steps: K,
        sharding: Some(stage),
        ..TrainConfig::default()
    }
}

/// Unsharded data parallelism: candle's one-pass backward, the averaged
/// gradients all-reduced by `backward`, SGD with momentum.
fn unsharded(acc: &Accelerator) -> accel::Result<Vec<(String, Vec<f32>)>> {
    acc.set_training_config(config(Stage::None))?;
    let (varmap, model) = build();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let (la, lb, lc) = (a(&vb).unwrap(), b(&vb).unwrap(), c(&vb).unwrap());
    let mut model = acc.prepare_model(model)?;
    let mut opt = acc.prepare_optimizer(Sgd::new(LR).with_momentum(MOMENTUM))?;
    for s in 0..STEPS {
        for j in 0..K {
            acc.accumulate_step(false);
            let (x, y) = batch(s, j, acc.rank());
            acc.backward(&mut model, |m, scale| {
                let logits = la
                    .forward(&x)
                    .and_then(|h| h.tanh())
                    .and_then(|h| lb.forward(&h))
                    .and_then(|h| h.tanh())
                    .and_then(|h| lc.forward(&h))
                    .unwrap();
                let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
                m.backward(&(loss * f64::from(scale)).unwrap())
            })??;
            opt.step(&mut model)?;
            opt.zero_grad(&mut model);
        }
    }
    Ok(named_values(&*model))
}

/// The same training at ZeRO `stage`, module by module through the gate.
fn sharded(acc: &Accelerator, stage: Stage) -> accel::Result<Vec<(String, Vec<f32>)>> {
    acc.set_training_config(config(stage))?;
    let (varmap, model) = build();
    let mut model = acc.prepare_model(model)?;
    let opt = ShardedSgd::new(LR).with_momentum(MOMENTUM);
    let mut zero = acc.prepare_zero(&mut model, &WrapPolicy::Depth(1), opt)?;
    if stage == Stage::Full {
        assert_eq!(
            model.resident_numel(),
            0,
            "prepare_zero left the stage-3 model's variables in place"
        );
    }
    let mut stepped = 0;
    with_links(&varmap, |links| -> accel::Result<()> {
        for s in 0..STEPS {
            for j in 0..K {
                acc.accumulate_step(false);
                let (x, y) = batch(s, j, acc.rank());
                let ce = |logits: &Tensor| candle_nn::loss::cross_entropy(logits, &y);
                acc.backward(&mut model, |m, scale| {
                    sequential_loss_and_grad(m, &mut zero, &x, links, &ce, scale)
                })??;
                if acc.zero_step(&mut zero, &mut model, None)?.is_some() {
                    stepped += 1;
                    zero_grads(&mut *model);
                    match stage {
                        Stage::Full => assert_eq!(
                            model.resident_numel(),
                            0,
                            "stage 3: variable or gradient storage left after step {s}"
                        ),
                        Stage::Gradients => assert_eq!(
                            grad_numel(&*model),
                            0,
                            "stage 2: gradient storage left after step {s}"
                        ),
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    })?;
    assert_eq!(stepped, STEPS, "zero_step stepped {stepped} times");
    assert_eq!(model.gradient_syncs(), 0, "backward all-reduced under ZeRO");
    Ok(zero.full_parameters(&*model)?.params)
}

#[test]
fn zero_stages_0_to_3_equal_the_unsharded_run_on_2_ranks() {
    let want = two_ranks(unsharded);
    assert_eq!(want[0], want[1], "the unsharded ranks differ");
    let want = &want[0];
    println!("unsharded: checksum {:.9}", checksum(want));
    for stage in [Stage::None, Stage::Optimizer, Stage::Gradients, Stage::Full] {
        let got = two_ranks(move |acc| sharded(acc, stage));
        assert_eq!(
            got[0], got[1],
            "stage {stage}: the ranks' parameters differ"
        );
        let got = &got[0];
        println!("stage {stage}: checksum {:.9}", checksum(got));
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
        assert!(
            (checksum(got) - checksum(want)).abs() <= 1e-4 * (1.0 + checksum(want).abs()),
            "stage {stage}: checksum {} vs unsharded {}",
            checksum(got),
            checksum(want)
        );
    }
}

/// A released variable reads as empty and comes back zero-filled with
/// its shape; a freed gradient comes back when a backward adds into it.
#[test]
fn released_vars_are_empty_and_come_back_with_their_shape() {
    let (varmap, mut model) = build();
    let full = model.resident_numel();
    assert_eq!(full, 2 * model.num_params());
    model.set_param_storage("a.weight", 0).unwrap();
    assert_eq!(model.resident_numel(), full - 2 * 12 * IN);
    let mut lens = Vec::new();
    model.visit_params(&mut |p| lens.push((p.name.to_string(), p.value.len(), p.grad.len())));
    assert!(lens.contains(&("a.weight".into(), 0, 0)), "{lens:?}");
    assert_eq!(
        model.num_params(),
        full / 2,
        "num_params counts released vars"
    );
    assert_eq!(model.param_shape("a.weight"), Some(vec![12, IN]));
    let e = model.set_param_storage("a.weight", 5).unwrap_err();
    assert!(e.to_string().contains("cannot hold 5"), "{e}");
    assert!(model.set_param_storage("nope", 0).is_err());
    model.set_param_storage("a.weight", 12 * IN).unwrap();
    assert_eq!(model.resident_numel(), full);
    let w = varmap.data().lock().unwrap()["a.weight"].clone();
    assert_eq!(w.dims(), [12, IN]);
    assert_eq!(w.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    // A freed gradient: empty, then back (zero-filled, plus the new one).
    model.release_grad("c.bias").unwrap();
    assert_eq!(model.resident_numel(), full - CLASSES);
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let (x, y) = batch(0, 0, 0);
    let logits = c(&vb)
        .unwrap()
        .forward(
            &b(&vb)
                .unwrap()
                .forward(&a(&vb).unwrap().forward(&x).unwrap())
                .unwrap(),
        )
        .unwrap();
    let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
    model.backward(&loss).unwrap();
    assert_eq!(model.resident_numel(), full);
    let g = model
        .grad("c.bias")
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap();
    assert!(
        g.to_scalar::<f32>().unwrap() > 0.0,
        "the gradient came back"
    );
}

/// Stage-3 steps `steps` on this rank's micro-batches (one per step),
/// module by module; the full parameters at the end.
fn train_full_shard(
    acc: &Accelerator,
    varmap: &VarMap,
    model: &mut CandleModel,
    zero: &mut ZeroOptimizer<ShardedSgd>,
    steps: std::ops::Range<usize>,
) -> accel::Result<Vec<(String, Vec<f32>)>> {
    with_links(varmap, |links| -> accel::Result<()> {
        for s in steps {
            let (x, y) = batch(s, 0, acc.rank());
            let ce = |logits: &Tensor| candle_nn::loss::cross_entropy(logits, &y);
            sequential_loss_and_grad(model, zero, &x, links, &ce, 1.0)?;
            zero.step(model)?;
            zero_grads(model);
        }
        Ok(())
    })?;
    Ok(zero.full_parameters(model)?.params)
}

fn full_shard(acc: &Accelerator, model: &CandleModel) -> accel::Result<ZeroOptimizer<ShardedSgd>> {
    ZeroOptimizer::new(
        acc.comm().clone(),
        model,
        Stage::Full,
        &WrapPolicy::Depth(1),
        ShardedSgd::new(LR).with_momentum(MOMENTUM),
    )
}

fn bits(values: &[(String, Vec<f32>)]) -> Vec<u32> {
    values
        .iter()
        .flat_map(|(_, v)| v.iter().map(|x| x.to_bits()))
        .collect()
}

#[test]
fn a_full_shard_run_resumes_exactly_and_saves_weights_candle_reads() {
    const TOTAL: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, weights) = (dir.path().join("ckpt"), dir.path().join("weights"));
    let w = weights.clone();
    let whole = two_ranks(move |acc| {
        let (varmap, mut model) = build();
        let mut zero = full_shard(acc, &model)?;
        let full = train_full_shard(acc, &varmap, &mut model, &mut zero, 0..TOTAL)?;
        // Every unit gathered back into the Vars: the model, with its
        // shapes, in the Hugging Face layout.
        zero.gather(&mut model, "")?;
        acc.save_model(&model, &w, DEFAULT_MAX_SHARD_SIZE)?;
        Ok(full)
    });
    assert_eq!(bits(&whole[0]), bits(&whole[1]), "the ranks disagree");
    let c = ckpt.clone();
    two_ranks(move |acc| {
        let (varmap, mut model) = build();
        let mut zero = full_shard(acc, &model)?;
        train_full_shard(acc, &varmap, &mut model, &mut zero, 0..TOTAL / 2)?;
        acc.save_state_to(&c, &[&zero])?;
        Ok(())
    });
    let c = ckpt.clone();
    let resumed = two_ranks(move |acc| {
        let (varmap, mut model) = build();
        init_uniform(&varmap, 99)?; // the checkpoint's shards replace these
        let mut zero = full_shard(acc, &model)?;
        acc.load_state(&c, &mut [&mut zero])?;
        train_full_shard(acc, &varmap, &mut model, &mut zero, TOTAL / 2..TOTAL)
    });
    assert_eq!(
        bits(&resumed[0]),
        bits(&whole[0]),
        "the resumed run's parameters differ from the uninterrupted run's"
    );
    read_back(&weights, &whole[0]);
}

/// candle reads the saved folder with each tensor in its variable's shape
/// and the trained values.
fn read_back(weights: &Path, want: &[(String, Vec<f32>)]) {
    let file = weights.join("model.safetensors");
    let tensors = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let (_, model) = build();
    assert_eq!(tensors.len(), want.len(), "{:?}", tensors.keys());
    for (name, values) in want {
        let t = &tensors[name];
        assert_eq!(
            Some(t.dims().to_vec()),
            model.param_shape(name),
            "{name}: the saved shape"
        );
        let got: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(&got, values, "{name}: the saved values");
    }
}
