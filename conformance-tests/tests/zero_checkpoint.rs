//! ZeRO stage 3 end to end (issue 21): a 4-rank `full` run checkpoints,
//! stops and resumes at 4 ranks with the uninterrupted run's parameters bit
//! for bit; its consolidated `save_model` output loads into a one-process
//! run that computes the same loss and shard again at 3 ranks; a 2-rank
//! run reshards the 4-rank shards and finishes with the same parameters. Ranks are threads over cpu-gloo
//! (loopback TCP), each run under a 60 s timeout.
#![cfg(feature = "cpu-gloo")]

use std::path::Path;
use std::time::Duration;

use accel::train::{Dataset, DEFAULT_MAX_SHARD_SIZE};
use accel::zero::{FullParameters, ShardedSgd, Stage, WrapPolicy, ZeroOptimizer};
use accel::{Accelerator, Threads};
use accel_conformance::fixtures::{Mlp, Sample, Synthetic};

const WORLD: usize = 4;
const STEPS: usize = 6;
const BS: usize = 2;
const HIDDEN: usize = 8;

fn data() -> Synthetic {
    Synthetic {
        len: WORLD * BS * STEPS + 16,
        seed: 11,
    }
}

fn batch(step: usize, rank: usize) -> Vec<Sample> {
    let start = (step * WORLD + rank) * BS;
    (start..start + BS).map(|i| data().get(i)).collect()
}

/// Samples none of the runs trains on.
fn held_out() -> Vec<Sample> {
    (WORLD * BS * STEPS..WORLD * BS * STEPS + 16)
        .map(|i| data().get(i))
        .collect()
}

fn zero_for(acc: &Accelerator, model: &Mlp) -> accel::Result<ZeroOptimizer<ShardedSgd>> {
    ZeroOptimizer::new(
        acc.comm().clone(),
        model,
        Stage::Full,
        &WrapPolicy::Depth(1),
        ShardedSgd::new(0.1).with_momentum(0.9),
    )
}

/// Steps `from..to` of training; returns the full parameters at the end.
fn train(
    acc: &Accelerator,
    model: &mut Mlp,
    zero: &mut ZeroOptimizer<ShardedSgd>,
    steps: std::ops::Range<usize>,
) -> accel::Result<FullParameters> {
    for s in steps {
        model.loss_and_grad_units(&batch(s, acc.rank()), 1.0, zero)?;
        zero.step(model)?;
    }
    zero.full_parameters(model)
}

/// Mean squared error of the full parameters on the held-out samples.
fn loss_of(full: &FullParameters) -> f32 {
    let mut m = Mlp::new(HIDDEN, 0);
    for (i, (_, v)) in full.params.iter().enumerate() {
        m.values[i].clone_from(v);
    }
    let held = held_out();
    let n = held.len() as f32;
    m.squared_errors(&held).iter().map(|e| e / n).sum()
}

fn threads(n: usize) -> Threads {
    Threads::new(n)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(60))
}

fn bits(full: &FullParameters) -> Vec<u32> {
    full.params
        .iter()
        .flat_map(|(_, v)| v.iter().map(|x| x.to_bits()))
        .collect()
}

#[test]
fn a_full_shard_run_resumes_exactly_and_saves_weights_one_process_loads() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, weights) = (dir.path().join("ckpt"), dir.path().join("weights"));

    // Uninterrupted, with the consolidated weights saved at the end.
    let whole = threads(WORLD)
        .run(|acc| {
            let mut model = Mlp::new(HIDDEN, 5);
            let mut zero = zero_for(acc, &model)?;
            let full = train(acc, &mut model, &mut zero, 0..STEPS)?;
            acc.save_model(&full, &weights, DEFAULT_MAX_SHARD_SIZE)?;
            Ok(full)
        })
        .unwrap();
    assert!(whole.windows(2).all(|w| w[0] == w[1]), "ranks disagree");

    // Stopped after half the steps, the shards checkpointed.
    threads(WORLD)
        .run(|acc| {
            let mut model = Mlp::new(HIDDEN, 5);
            let mut zero = zero_for(acc, &model)?;
            train(acc, &mut model, &mut zero, 0..STEPS / 2)?;
            acc.save_state_to(&ckpt, &[&zero])?;
            Ok(())
        })
        .unwrap();
    // Each rank wrote its own shard.
    let names: Vec<String> = std::fs::read_dir(ckpt.join("zero_0"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    for r in 0..WORLD {
        assert!(
            names.iter().any(|n| n.starts_with(&format!("rank_{r}."))),
            "no shard of rank {r} in {}: {names:?}",
            ckpt.join("zero_0").display()
        );
    }

    // Resumed from the checkpoint in fresh processes' worth of state: a
    // model initialised differently, to show the shards carry the values.
    let resumed = threads(WORLD)
        .run(|acc| {
            let mut model = Mlp::new(HIDDEN, 99);
            let mut zero = zero_for(acc, &model)?;
            acc.load_state(&ckpt, &mut [&mut zero])?;
            train(acc, &mut model, &mut zero, STEPS / 2..STEPS)
        })
        .unwrap();
    assert_eq!(
        bits(&resumed[0]),
        bits(&whole[0]),
        "the resumed run's parameters differ from the uninterrupted run's"
    );

    // The saved weights in one process give the same held-out loss.
    let single = threads(1)
        .backend("single")
        .run(|acc| {
            let mut model = Mlp::new(HIDDEN, 42);
            acc.load_model(&mut model, &weights)?;
            let full = FullParameters {
                params: ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
                    .iter()
                    .zip(&model.values)
                    .map(|(n, v)| (n.to_string(), v.clone()))
                    .collect(),
                ..Default::default()
            };
            Ok(full)
        })
        .unwrap();
    assert_eq!(bits(&single[0]), bits(&whole[0]));
    let (want, got) = (loss_of(&whole[0]), loss_of(&single[0]));
    assert_eq!(want.to_bits(), got.to_bits(), "loss {got} vs {want}");
    assert!(want.is_finite() && want > 0.0, "{want}");

    // The consolidated weights shard at another world size: 3 ranks load
    // them into a model, shard it, and gather the same values back.
    let three = threads(3)
        .run(|acc| {
            let mut model = Mlp::new(HIDDEN, 7);
            acc.load_model(&mut model, &weights)?;
            let mut zero = zero_for(acc, &model)?;
            zero.full_parameters(&model)
        })
        .unwrap();
    assert_eq!(bits(&three[2]), bits(&whole[0]));

    // The shards reshard at another world size (an elastic restart).
    reshards_at_another_world_size(&ckpt, &whole[0]);
}

/// 2 ranks load the 4-rank shards (parameters and momentum) and finish the
/// run on the same samples (each rank the batches of two old ranks): the
/// parameters are the uninterrupted run's, up to the order of the sums.
fn reshards_at_another_world_size(ckpt: &Path, whole: &FullParameters) {
    let two = threads(2)
        .run(|acc| {
            let mut model = Mlp::new(HIDDEN, 99);
            let mut zero = zero_for(acc, &model)?;
            acc.load_state(ckpt, &mut [&mut zero])?;
            for s in STEPS / 2..STEPS {
                let mut b = batch(s, 2 * acc.rank());
                b.extend(batch(s, 2 * acc.rank() + 1));
                model.loss_and_grad_units(&b, 1.0, &mut zero)?;
                zero.step(&mut model)?;
            }
            zero.full_parameters(&model)
        })
        .unwrap();
    for ((name, got), (_, want)) in two[0].params.iter().zip(&whole.params) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{name}[{i}]: {g} resharded vs {w} uninterrupted"
            );
        }
    }
}

/// `TrainConfig::sharding` through the accelerator: with 2 batches per
/// optimizer step, `backward` leaves gradients to the ZeRO optimizer (no
/// DDP all-reduce), `zero_step` steps only at the end of each group, and
/// every stage ends where one process on the global batches ends.
#[test]
fn the_configured_stage_trains_through_backward_and_zero_step() {
    use accel::train::{Optimizer, Sgd, TrainConfig};
    const K: usize = 2;
    const N: usize = 2;
    let steps = 3;
    let per_step = |s: usize, j: usize, r: usize| {
        let start = ((s * K + j) * N + r) * BS;
        (start..start + BS)
            .map(|i| data().get(i))
            .collect::<Vec<_>>()
    };
    // One process: each optimizer step sees the K × N batches at once.
    let want = {
        let mut m = Mlp::new(HIDDEN, 5);
        let mut opt = Sgd::new(0.1).with_momentum(0.9);
        for s in 0..steps {
            let all: Vec<Sample> = (0..K)
                .flat_map(|j| (0..N).flat_map(move |r| per_step(s, j, r)))
                .collect();
            m.loss_and_grad(&all, 1.0);
            opt.step(&mut m).unwrap();
            opt.zero_grad(&mut m);
        }
        m.flat_values()
    };
    for stage in [Stage::None, Stage::Optimizer, Stage::Gradients, Stage::Full] {
        let out = threads(N)
            .run(|acc| {
                acc.set_training_config(TrainConfig {
                    gradient_accumulation_steps: K,
                    sharding: Some(stage),
                    ..TrainConfig::default()
                })?;
                assert_eq!(acc.sharding(), stage);
                let mut model = acc.prepare_model(Mlp::new(HIDDEN, 5))?;
                let opt = ShardedSgd::new(0.1).with_momentum(0.9);
                let mut zero = acc.prepare_zero(&mut model, &WrapPolicy::Depth(1), opt)?;
                if stage == Stage::Full && model.resident_numel() != 0 {
                    return Err(accel::Error::invalid_argument(
                        "test",
                        "prepare_zero left the stage-3 model's parameters in place",
                    ));
                }
                let mut stepped = 0;
                for s in 0..steps {
                    for j in 0..K {
                        acc.accumulate_step(false);
                        let b = per_step(s, j, acc.rank());
                        // `scale` is 1/k: the group's gradients average.
                        acc.backward(&mut model, |m, scale| {
                            m.loss_and_grad_units(&b, scale, &mut zero)
                        })??;
                        if acc.zero_step(&mut zero, &mut model, None)?.is_some() {
                            stepped += 1;
                            model.grads.iter_mut().for_each(|g| g.fill(0.0));
                        }
                    }
                }
                assert_eq!(stepped, steps, "zero_step stepped {stepped} times");
                assert_eq!(model.gradient_syncs(), 0, "backward all-reduced");
                let full = zero.full_parameters(&*model)?;
                Ok(full
                    .params
                    .into_iter()
                    .flat_map(|(_, v)| v)
                    .collect::<Vec<f32>>())
            })
            .unwrap();
        assert_eq!(out[0].len(), want.len(), "stage {stage}: parameter count");
        for (i, (a, b)) in out[0].iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "stage {stage}: value {i} is {a}, one process gives {b}"
            );
        }
    }
}
