//! Mixed precision on a candle model: f32 master `Var`s, the forward pass on
//! bf16 compute copies (gradients back on the masters, in f32), and the
//! fp16 loss scaler's skip on 2 ranks as threads over cpu-gloo: an
//! overflow on one rank skips the step on both, backs the scale off, and
//! training goes on.

mod common;

use accel::train::{MixedPrecision, Parameters, TrainConfig};
use accel::Accelerator;
use accel_candle::{
    compute_dtype, compute_var_builder, init_uniform, CandleModel, CandleOptimizer,
};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Linear, Module, VarBuilder, VarMap};

fn layers(vb: &VarBuilder<'_>) -> (Linear, Linear) {
    (
        candle_nn::linear(4, 8, vb.pp("a")).unwrap(),
        candle_nn::linear(8, 1, vb.pp("b")).unwrap(),
    )
}

fn build() -> VarMap {
    let varmap = VarMap::new();
    let _ = layers(&VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu));
    init_uniform(&varmap, 21).unwrap();
    varmap
}

fn batch(step: usize, rows: std::ops::Range<usize>) -> (Tensor, Tensor) {
    let n = rows.len();
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|r| {
            (0..4).map(move |j| ((((step * 8 + r) * 4 + j) * 29 % 17) as f32 - 8.0) / 8.0)
        })
        .collect();
    let y: Vec<f32> = rows.map(|r| ((step + r) % 3) as f32 - 1.0).collect();
    (
        Tensor::from_vec(x, (n, 4), &Device::Cpu).unwrap(),
        Tensor::from_vec(y, (n, 1), &Device::Cpu).unwrap(),
    )
}

/// The loss on compute copies in `dtype`, returned in f32.
fn loss(varmap: &VarMap, dtype: DType, x: &Tensor, y: &Tensor) -> Tensor {
    let (a, b) = layers(&compute_var_builder(varmap, dtype));
    let h = a
        .forward(&x.to_dtype(dtype).unwrap())
        .unwrap()
        .tanh()
        .unwrap();
    let out = b.forward(&h).unwrap();
    assert_eq!(out.dtype(), dtype, "the forward pass computes in {dtype:?}");
    let out = out.to_dtype(DType::F32).unwrap();
    (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

#[test]
fn bf16_compute_copies_give_f32_gradients_on_the_masters() {
    let acc = Accelerator::new()
        .unwrap()
        .with_training(TrainConfig {
            mixed_precision: Some(MixedPrecision::Bf16),
            ..TrainConfig::default()
        })
        .unwrap();
    assert_eq!(compute_dtype(&acc), DType::BF16);
    let varmap = build();
    let mut model = acc
        .prepare_model(CandleModel::new(&varmap).unwrap())
        .unwrap();
    let (x, y) = batch(0, 0..8);
    let l32 = loss(&varmap, DType::F32, &x, &y)
        .to_scalar::<f32>()
        .unwrap();
    acc.accumulate_step(false);
    let l16 = acc
        .backward(&mut model, |m, s| {
            let l = loss(&varmap, DType::BF16, &x, &y);
            m.backward(&(&l * f64::from(s)).unwrap()).unwrap();
            l.to_scalar::<f32>().unwrap()
        })
        .unwrap();
    assert!(
        (l16 - l32).abs() <= 0.02 * l32.abs().max(0.1),
        "bf16 {l16} vs f32 {l32}"
    );
    let mut any = false;
    model.visit_params(&mut |p| {
        assert_eq!(
            p.value.dtype(),
            accel::DType::F32,
            "master weights stay f32"
        );
        let g = p.grad_f32().expect("f32 gradients");
        assert!(g.iter().all(|v| v.is_finite()));
        any |= g.iter().any(|&v| v != 0.0);
    });
    assert!(any, "the gradients reached the masters");
    // A name the map does not hold is candle's error, not a new variable.
    let vb = compute_var_builder(&varmap, DType::BF16);
    assert!(candle_nn::linear(4, 8, vb.pp("nope")).is_err());
}

/// What one rank saw: per step, whether it stepped and the scale after;
/// the parameters before and after the overflowing step; the final ones.
type Seen = (Vec<(bool, f32)>, Vec<f32>, Vec<f32>, Vec<f32>);

#[test]
fn an_fp16_overflow_on_one_rank_skips_the_step_on_both() {
    let seen: Vec<Seen> = common::two_ranks(|acc| {
        acc.set_training_config(TrainConfig {
            mixed_precision: Some(MixedPrecision::Fp16),
            ..TrainConfig::default()
        })?;
        assert_eq!(compute_dtype(acc), DType::F16);
        let varmap = build();
        let model = CandleModel::new(&varmap)?;
        let opt = CandleOptimizer::<candle_nn::SGD>::new(&model, 0.1)?;
        let mut model = acc.prepare_model(model)?;
        let mut opt = acc.prepare_optimizer(opt)?;
        let params = |m: &CandleModel| {
            let mut v = Vec::new();
            m.visit_params(&mut |p| v.extend_from_slice(p.value_f32().unwrap()));
            v
        };
        let (mut steps, mut before, mut after) = (Vec::new(), Vec::new(), Vec::new());
        for step in 0..4 {
            let rows = acc.rank() * 4..acc.rank() * 4 + 4;
            let (x, y) = batch(step, rows);
            if step == 1 {
                before = params(&model);
            }
            acc.accumulate_step(false);
            acc.backward(&mut model, |m, scale| {
                let l = loss(&varmap, DType::F16, &x, &y);
                // Rank 1 overflows on step 1 (as an f16 forward can).
                let blow = if step == 1 && acc.rank() == 1 {
                    f64::INFINITY
                } else {
                    1.0
                };
                m.backward(&(&l * (f64::from(scale) * blow)).unwrap())
            })??;
            let stepped = opt.step(&mut model)?;
            assert_eq!(opt.step_was_skipped(), !stepped);
            opt.zero_grad(&mut model);
            steps.push((stepped, acc.grad_scaler().expect("fp16 has a scaler").scale));
            if step == 1 {
                after = params(&model);
            }
        }
        Ok((steps, before, after, params(&model)))
    });
    for (rank, (steps, before, after, _)) in seen.iter().enumerate() {
        let stepped: Vec<bool> = steps.iter().map(|s| s.0).collect();
        assert_eq!(stepped, [true, false, true, true], "rank {rank}");
        assert_eq!(
            before, after,
            "rank {rank}: the skipped step changed nothing"
        );
        assert_eq!(
            steps[1].1,
            steps[0].1 / 2.0,
            "rank {rank}: the scale backed off"
        );
    }
    assert_eq!(
        seen[0].0, seen[1].0,
        "both ranks saw the same steps and scales"
    );
    assert_eq!(seen[0].3, seen[1].3, "and end equal");
}
