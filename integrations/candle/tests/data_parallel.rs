//! Data parallel on a candle model: 2 ranks as threads over cpu-gloo
//! (`accel::Threads`, under a hard bound), each with half of every global
//! batch, with and without 2 micro-batches of accumulation and with
//! `clip_grad_norm`, end with the parameters of one process stepping on the
//! whole global batch, within `1e-5 × (1 + |x|)` (f32 sums in another
//! order), for candle-nn's SGD and this crate's AdamW.

mod common;

use accel::train::{Parameters, TrainConfig};
use accel::Accelerator;
use accel_candle::{init_uniform, AdamW, CandleModel, CandleOptimizer, OptimizerState};
use candle_core::{DType, Device, Tensor};
use candle_nn::optim::ParamsAdamW;
use candle_nn::{Linear, Module, VarBuilder, VarMap};

const GLOBAL: usize = 8;
const STEPS: usize = 3;

fn data(step: usize, rows: std::ops::Range<usize>) -> (Tensor, Tensor) {
    let n = rows.len();
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|r| {
            (0..4).map(move |j| ((((step * GLOBAL + r) * 4 + j) * 37 % 23) as f32 - 11.0) / 11.0)
        })
        .collect();
    let y: Vec<f32> = rows.map(|r| ((step + r) % 3) as f32 - 1.0).collect();
    (
        Tensor::from_vec(x, (n, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (n, 1), &Device::Cpu).unwrap(),
    )
}

#[derive(Clone, Copy, Debug)]
enum Opt {
    Sgd,
    AdamW,
}

/// Train STEPS optimizer steps on `acc`: this rank's share of each global
/// batch in `k` micro-batches; returns the parameters.
fn train(acc: &Accelerator, opt: Opt, k: usize, clip: Option<f64>) -> accel::Result<Vec<f32>> {
    acc.set_training_config(TrainConfig {
        gradient_accumulation_steps: k,
        ..TrainConfig::default()
    })?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let a: Linear = candle_nn::linear(4, 8, vb.pp("a")).unwrap();
    let b: Linear = candle_nn::linear(8, 1, vb.pp("b")).unwrap();
    init_uniform(&varmap, 11)?;
    let model = CandleModel::new(&varmap)?;
    match opt {
        Opt::Sgd => {
            let o = CandleOptimizer::<candle_nn::SGD>::new(&model, 0.2)?;
            run(acc, model, o, (a, b), k, clip)
        }
        Opt::AdamW => {
            let params = ParamsAdamW {
                lr: 0.02,
                ..ParamsAdamW::default()
            };
            let o = CandleOptimizer::<AdamW>::new(&model, params)?;
            run(acc, model, o, (a, b), k, clip)
        }
    }
}

fn run<O: candle_nn::Optimizer + OptimizerState>(
    acc: &Accelerator,
    model: CandleModel,
    opt: CandleOptimizer<O>,
    (a, b): (Linear, Linear),
    k: usize,
    clip: Option<f64>,
) -> accel::Result<Vec<f32>> {
    let mut model = acc.prepare_model(model)?;
    let mut opt = acc.prepare_optimizer(opt)?;
    let share = GLOBAL / acc.world_size();
    let micro = share / k;
    for step in 0..STEPS {
        for part in 0..k {
            let start = acc.rank() * share + part * micro;
            let (x, y) = data(step, start..start + micro);
            let d = acc.accumulate_step(false);
            acc.backward(&mut model, |m, scale| {
                let h = a.forward(&x).unwrap().tanh().unwrap();
                let loss = (b.forward(&h).unwrap() - &y)
                    .unwrap()
                    .sqr()
                    .unwrap()
                    .mean_all()
                    .unwrap();
                m.backward(&(loss * f64::from(scale)).unwrap())
            })??;
            if let (Some(max), true) = (clip, d.sync_gradients) {
                acc.clip_grad_norm(&mut model, max, 2.0)?;
            }
            opt.step(&mut model)?;
            opt.zero_grad(&mut model);
        }
    }
    let mut out = Vec::new();
    model.visit_params(&mut |p| out.extend_from_slice(p.value_f32().expect("f32 CPU")));
    Ok(out)
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}: element {i}: {g} vs {w}"
        );
    }
}

#[test]
fn two_ranks_equal_one_process_on_the_global_batch() {
    for opt in [Opt::Sgd, Opt::AdamW] {
        for clip in [None, Some(0.05)] {
            let one = train(&Accelerator::new().expect("single"), opt, 1, clip).unwrap();
            for k in [1, 2] {
                let ranks = common::two_ranks(move |acc| train(acc, opt, k, clip));
                assert_eq!(
                    ranks[0], ranks[1],
                    "{opt:?} k={k}: the ranks agree bit for bit"
                );
                assert_close(&format!("{opt:?} k={k} clip={clip:?}"), &ranks[0], &one);
            }
        }
    }
}
