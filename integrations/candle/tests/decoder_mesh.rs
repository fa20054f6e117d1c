//! A small decoder-style language model (issue 39) trained 20 SGD steps on
//! 4 rank threads at `dp_shard=2 × tp=2` (the device mesh over cpu-gloo)
//! against the same model on one rank: vocab-parallel embedding, two
//! residual blocks (LayerNorm, a column-parallel then a row-parallel
//! layer), a final LayerNorm, a column-parallel head and the vocab-parallel
//! cross entropy (no rank holds all the logits). Each data-parallel rank
//! reads its share of the batch, gradients are averaged over the `dp`
//! group. Every step's loss agrees with one rank's to 1e-5 relative, and so
//! do the final weights' shards.
//!
//! With ZeRO over `dp_shard` on top (stages 1 to 3, SGD with momentum)
//! the run equals one rank's too, and at stage 3 a rank keeps under 30%
//! of one rank's parameters and momentum.
//!
//! The same model, larger, is the mesh benchmark
//! (`scripts/bench_mesh.sh`, an ignored test here): the step time at
//! `dp_shard=2 × tp=2` against `dp_shard=4`, interleaved, and each rank's
//! parameter bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use accel::mesh::{DeviceMesh, ParallelismConfig};
use accel::zero::{ShardedSgd, Stage, UnitGate, WrapPolicy, ZeroOptimizer};
use accel_api::{Communicator, CommunicatorExt, ReduceOp};
use accel_candle::tp::{
    vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
};
use accel_candle::CandleModel;
mod common;
use common::values;

use candle_core::{Device, Tensor, Var, D};

/// The model's and the run's sizes.
#[derive(Clone, Copy, Debug)]
struct Dims {
    /// Vocabulary, hidden width, feed-forward width, blocks.
    v: usize,
    h: usize,
    f: usize,
    layers: usize,
    /// Samples per step (all ranks together), tokens per sample.
    b: usize,
    s: usize,
    steps: usize,
}

/// The test's model.
const SMALL: Dims = Dims {
    v: 16,
    h: 8,
    f: 16,
    layers: 2,
    b: 4,
    s: 3,
    steps: 20,
};
const LR: f64 = 0.2;

fn t(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The whole model's starting tensors: the embedding, per layer (norm
/// scale, norm shift, w1, b1, w2, b2), the final norm, the head.
struct Full {
    emb: Tensor,
    layers: Vec<[Tensor; 6]>,
    norm: [Tensor; 2],
    head: Tensor,
}

fn full(d: Dims) -> Full {
    let Dims { v, h, f, .. } = d;
    Full {
        emb: t(values(v * h, 1), &[v, h]),
        layers: (0..d.layers as u64)
            .map(|l| {
                [
                    t(vec![1.0; h], &[h]),
                    t(vec![0.0; h], &[h]),
                    t(values(f * h, 10 + l), &[f, h]),
                    t(values(f, 20 + l), &[f]),
                    t(values(h * f, 30 + l), &[h, f]),
                    t(values(h, 40 + l), &[h]),
                ]
            })
            .collect(),
        norm: [t(vec![1.0; h], &[h]), t(vec![0.0; h], &[h])],
        head: t(values(v * h, 2), &[v, h]),
    }
}

/// Step `step`'s batch: `b × s` input ids and the next-token targets.
fn batch(d: Dims, step: usize) -> (Vec<u32>, Vec<u32>) {
    let v = d.v as u32;
    let ids: Vec<u32> = values(d.b * d.s, 100 + step as u64)
        .iter()
        .map(|x| (((x + 0.5) * v as f32) as u32).min(v - 1))
        .collect();
    let targets: Vec<u32> = ids.iter().map(|&i| (i * 7 + 1) % v).collect();
    (ids, targets)
}

fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(g)?
        .broadcast_add(b)
}

fn sgd(vars: &[Var], grads: &[Tensor]) {
    for (v, g) in vars.iter().zip(grads) {
        v.set(&(v.as_tensor() - (g * LR).unwrap()).unwrap())
            .unwrap();
    }
}

/// The momentum of the ZeRO runs' SGD.
const MU: f64 = 0.5;

/// SGD with momentum as torch (and accel's `ShardedSgd`) take it: the
/// buffer starts as the first gradient, then `mu * buf + g`.
fn sgd_momentum(vars: &[Var], grads: &[Tensor], bufs: &mut Vec<Tensor>) {
    if bufs.is_empty() {
        bufs.extend(grads.iter().cloned());
    } else {
        for (b, g) in bufs.iter_mut().zip(grads) {
            *b = ((&*b * MU).unwrap() + g).unwrap();
        }
    }
    sgd(vars, bufs);
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// One rank, the whole batch: the loss of every step and the final head.
fn one_rank(d: Dims) -> (Vec<f32>, Vec<f32>) {
    one_rank_with(d, false)
}

/// [`one_rank`], with momentum when `momentum`.
fn one_rank_with(d: Dims, momentum: bool) -> (Vec<f32>, Vec<f32>) {
    let mut bufs = Vec::new();
    let f = full(d);
    let mut vars = vec![Var::from_tensor(&f.emb).unwrap()];
    for l in &f.layers {
        vars.extend(l.iter().map(|t| Var::from_tensor(t).unwrap()));
    }
    vars.extend(f.norm.iter().map(|t| Var::from_tensor(t).unwrap()));
    vars.push(Var::from_tensor(&f.head).unwrap());
    let mut losses = Vec::new();
    for step in 0..d.steps {
        let (ids, targets) = batch(d, step);
        let v = |i: usize| vars[i].as_tensor();
        let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let mut x = v(0).index_select(&ids, 0).unwrap();
        for l in 0..d.layers {
            let p = 1 + 6 * l;
            let h = layer_norm(&x, v(p), v(p + 1)).unwrap();
            let h = h.matmul(&v(p + 2).t().unwrap()).unwrap();
            let h = h.broadcast_add(v(p + 3)).unwrap().relu().unwrap();
            let h = h.matmul(&v(p + 4).t().unwrap()).unwrap();
            x = (x + h.broadcast_add(v(p + 5)).unwrap()).unwrap();
        }
        let n = 1 + 6 * d.layers;
        let x = layer_norm(&x, v(n), v(n + 1)).unwrap();
        let logits = x.matmul(&v(n + 2).t().unwrap()).unwrap();
        let tg = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let loss = candle_nn::loss::cross_entropy(&logits, &tg).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        let g = loss.backward().unwrap();
        let grads: Vec<Tensor> = vars
            .iter()
            .map(|v| g.get(v.as_tensor()).unwrap().clone())
            .collect();
        if momentum {
            sgd_momentum(&vars, &grads, &mut bufs);
        } else {
            sgd(&vars, &grads);
        }
    }
    (losses, flat(vars.last().unwrap().as_tensor()))
}

/// The gradients of `vars` averaged over `dp`.
fn dp_average(grads: &[Tensor], dp: &Arc<dyn Communicator>) -> Vec<Tensor> {
    grads
        .iter()
        .map(|g| {
            let mut v = flat(g);
            dp.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
            let n = dp.world_size() as f32;
            v.iter_mut().for_each(|x| *x /= n);
            t(v, g.dims())
        })
        .collect()
}

/// What a rank of a mesh run gives back: every step's loss (averaged over
/// `dp`), its `tp` rank, its rows of the head, the values it keeps between
/// steps (parameters, and under ZeRO their shards and the momentum's) and
/// its step times after the first.
type Ranked = (Vec<f32>, usize, Vec<f32>, usize, Vec<Duration>);

/// `d`'s model trained on 4 rank threads over cpu-gloo under `config`.
fn mesh_run(d: Dims, config: ParallelismConfig) -> Vec<Ranked> {
    mesh_run_with(d, config, None)
}

/// [`mesh_run`], the optimizer a ZeRO one over the `dp` group at `zero`
/// (SGD with momentum [`MU`]) when given, else plain SGD with the
/// gradients averaged over `dp`.
fn mesh_run_with(d: Dims, config: ParallelismConfig, zero: Option<Stage>) -> Vec<Ranked> {
    accel::Threads::new(4)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(600))
        .run(move |acc| {
            let mesh = DeviceMesh::new(acc.comm(), config)?;
            let dp = mesh.group("dp")?.clone();
            // Without tensor parallelism the mesh has no tp group: one of
            // this rank alone (the same layers, whole).
            let tp: Arc<dyn Communicator> = match mesh.group("tp") {
                Ok(g) => g.clone(),
                Err(_) => acc
                    .comm()
                    .split(Some(acc.rank() as u32), 0)?
                    .expect("a colour")
                    .into(),
            };
            let f = full(d);
            let emb = VocabParallelEmbedding::from_full(&f.emb, tp.clone())?;
            let mut blocks = Vec::new();
            for l in &f.layers {
                let norm = [
                    Var::from_tensor(&l[0]).unwrap(),
                    Var::from_tensor(&l[1]).unwrap(),
                ];
                let col = ColumnParallelLinear::from_full(&l[2], Some(&l[3]), tp.clone(), false)?;
                let row = RowParallelLinear::from_full(&l[4], Some(&l[5]), tp.clone())?;
                blocks.push((norm, col, row));
            }
            let norm = [
                Var::from_tensor(&f.norm[0]).unwrap(),
                Var::from_tensor(&f.norm[1]).unwrap(),
            ];
            let head = ColumnParallelLinear::from_full(&f.head, None, tp.clone(), false)?;
            let mut vars = emb.vars();
            for (n, c, r) in &blocks {
                vars.extend(n.iter().cloned());
                vars.extend(c.vars());
                vars.extend(r.vars());
            }
            vars.extend(norm.iter().cloned());
            vars.extend(head.vars());
            let mut numel: usize = vars.iter().map(|v| v.as_tensor().elem_count()).sum();
            // Under ZeRO: the variables in a VarMap (named by module, for
            // the units), sharded over the data-parallel ranks.
            let mut sharded = match zero {
                None => None,
                Some(stage) => {
                    let map = candle_nn::VarMap::new();
                    let mut names = vec!["emb.weight".to_string()];
                    for l in 0..d.layers {
                        for p in ["norm.g", "norm.b", "up.w", "up.b", "down.w", "down.b"] {
                            names.push(format!("b{l}.{p}"));
                        }
                    }
                    names.extend(["norm.g", "norm.b", "head.w"].map(String::from));
                    let mut data = map.data().lock().unwrap();
                    for (n, v) in names.iter().zip(&vars) {
                        data.insert(n.clone(), v.clone());
                    }
                    drop(data);
                    let model = CandleModel::new(&map)?;
                    let opt = ShardedSgd::new(LR).with_momentum(MU as f32);
                    let z =
                        ZeroOptimizer::new(dp.clone(), &model, stage, &WrapPolicy::Depth(1), opt)?;
                    Some((model, z))
                }
            };
            let share = d.b / dp.world_size();
            let (me, s) = (dp.rank(), d.s);
            let vocab_start = tp.rank() * d.v / tp.world_size();
            let mut losses = Vec::new();
            let mut times = Vec::new();
            for step in 0..d.steps {
                let start = Instant::now();
                let (ids, targets) = batch(d, step);
                // This data-parallel rank's share of the samples.
                let mine = |v: &[u32]| v[me * share * s..(me + 1) * share * s].to_vec();
                let ids = Tensor::new(mine(&ids).as_slice(), &Device::Cpu).unwrap();
                let tg = Tensor::new(mine(&targets).as_slice(), &Device::Cpu).unwrap();
                if let Some((model, z)) = &mut sharded {
                    z.gather(model, "")?;
                }
                let mut x = emb.forward(&ids)?;
                for (n, c, r) in &blocks {
                    let h = layer_norm(&x, n[0].as_tensor(), n[1].as_tensor()).unwrap();
                    let h = c.forward(&h)?.relu().unwrap();
                    x = (x + r.forward(&h)?).unwrap();
                }
                let x = layer_norm(&x, norm[0].as_tensor(), norm[1].as_tensor()).unwrap();
                let logits = head.forward(&x)?;
                let loss = vocab_parallel_cross_entropy(&logits, &tg, vocab_start, &tp)?;
                let l = dp.all_reduce_vec(&[loss.to_scalar::<f32>().unwrap()], ReduceOp::Sum)?;
                losses.push(l[0] / dp.world_size() as f32);
                let g = loss.backward().unwrap();
                if let Some((model, z)) = &mut sharded {
                    accel::train::zero_grads(model);
                    model.add_grads(&g)?;
                    z.reduce_grads(model, "")?;
                    z.step(model)?;
                } else {
                    let grads: Vec<Tensor> = vars
                        .iter()
                        .map(|v| g.get(v.as_tensor()).unwrap().clone())
                        .collect();
                    sgd(&vars, &dp_average(&grads, &dp));
                }
                if step > 0 {
                    times.push(start.elapsed());
                }
            }
            if let Some((model, z)) = &mut sharded {
                // What stays between steps: the shards of the values and
                // the momentum, and any unit the model still holds.
                let shard = z
                    .state_dict()
                    .tensors
                    .get("zero.params")
                    .map_or(0, |t| t.data.len());
                numel = z.state_numel() + shard + model.resident_numel();
                z.gather(model, "")?;
            }
            let head_rows = flat(head.vars()[0].as_tensor());
            Ok((losses, tp.rank(), head_rows, numel, times))
        })
        .unwrap()
}

#[test]
fn a_small_decoder_trains_at_dp_shard_2_by_tp_2_as_on_one_rank() {
    let d = SMALL;
    let (want, want_head) = one_rank(d);
    let config = ParallelismConfig {
        dp_shard: 2,
        tp: 2,
        ..ParallelismConfig::default()
    };
    let got = mesh_run(d, config);
    let (v, h) = (d.v, d.h);
    for (rank, (losses, tp_rank, head, _, _)) in got.iter().enumerate() {
        for (step, (a, b)) in losses.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "rank {rank}, step {step}: loss {a} against one rank's {b}"
            );
        }
        let rows = v / 2;
        let w = &want_head[tp_rank * rows * h..(tp_rank + 1) * rows * h];
        for (i, (a, b)) in head.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "rank {rank}: head[{i}] {a} against {b}"
            );
        }
    }
    // The loss went down: the model learned, so equal losses mean
    // something; and the two data-parallel halves differ.
    assert!(want[d.steps - 1] < want[0] * 0.9, "{want:?}");
    let (ids, _) = batch(d, 0);
    let half = d.b * d.s / 2;
    assert_ne!(ids[..half], ids[half..]);
}

/// ZeRO over `dp_shard` on top of `tp` (FSDP × TP): at every stage the
/// run equals one rank with the same SGD with momentum, and at stage 3
/// each rank keeps about a quarter of one rank's parameters and momentum.
#[test]
fn zero_over_dp_shard_composes_with_tp_as_on_one_rank() {
    let d = SMALL;
    let (want, want_head) = one_rank_with(d, true);
    let one_rank_numel = 2 * full_numel(d);
    let config = ParallelismConfig {
        dp_shard: 2,
        tp: 2,
        ..ParallelismConfig::default()
    };
    for stage in [Stage::Optimizer, Stage::Gradients, Stage::Full] {
        let got = mesh_run_with(d, config, Some(stage));
        for (rank, (losses, tp_rank, head, kept, _)) in got.iter().enumerate() {
            for (step, (a, b)) in losses.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{stage}, rank {rank}, step {step}: loss {a} against one rank's {b}"
                );
            }
            let rows = d.v / 2;
            let w = &want_head[tp_rank * rows * d.h..(tp_rank + 1) * rows * d.h];
            for (i, (a, b)) in head.iter().zip(w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{stage}, rank {rank}: head[{i}] {a} against {b}"
                );
            }
            if stage == Stage::Full {
                // The replicated norms keep it above a quarter.
                let share = *kept as f64 / one_rank_numel as f64;
                assert!(
                    (0.25..0.3).contains(&share),
                    "rank {rank} keeps {kept} of {one_rank_numel}"
                );
            }
        }
    }
}

/// The whole model's parameter count.
fn full_numel(d: Dims) -> usize {
    let f = full(d);
    let layers: usize = f.layers.iter().flatten().map(Tensor::elem_count).sum();
    f.emb.elem_count() + layers + 2 * d.h + f.head.elem_count()
}

/// The mesh benchmark (`scripts/bench_mesh.sh`; ACCEL_BENCH_ROUNDS rounds,
/// default 3): a larger decoder at `dp_shard=2 × tp=2`, at `dp_shard=4`
/// and at `dp_shard=2 × tp=2` with ZeRO-3 over `dp_shard` (SGD with
/// momentum), interleaved; per round each configuration's median step time
/// (the slowest rank's), then the medians and bests, and the values each
/// keeps per rank between steps.
#[test]
#[ignore = "a benchmark: scripts/bench_mesh.sh runs it"]
fn bench_mesh_step_time() {
    let d = Dims {
        v: 4096,
        h: 256,
        f: 1024,
        layers: 4,
        b: 16,
        s: 64,
        steps: 6,
    };
    let rounds: usize = std::env::var("ACCEL_BENCH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(3);
    let tp2 = ParallelismConfig {
        dp_shard: 2,
        tp: 2,
        ..ParallelismConfig::default()
    };
    let dp4 = ParallelismConfig {
        dp_shard: 4,
        ..ParallelismConfig::default()
    };
    let configs = [
        ("dp_shard=2 x tp=2", tp2, None),
        ("dp_shard=4", dp4, None),
        (
            "dp_shard=2 x tp=2, ZeRO-3 over dp_shard",
            tp2,
            Some(Stage::Full),
        ),
    ];
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let mut per: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let mut numel = vec![(0, 0); configs.len()];
    println!("decoder {d:?}");
    for round in 0..rounds {
        for (k, (name, config, zero)) in configs.iter().enumerate() {
            let got = mesh_run_with(d, *config, *zero);
            // Each step's time is the slowest rank's.
            let steps = got[0].4.len();
            let slowest: Vec<f64> = (0..steps)
                .map(|i| {
                    got.iter()
                        .map(|r| r.4[i].as_secs_f64() * 1e3)
                        .fold(0.0, f64::max)
                })
                .collect();
            let m = median(slowest);
            per[k].push(m);
            let counts = got.iter().map(|r| r.3);
            numel[k] = (counts.clone().min().unwrap(), counts.max().unwrap());
            println!("round {round}: {name}: step {m:.1} ms (median of {steps})");
        }
    }
    println!("| configuration | step, median | best | values kept per rank |");
    println!("|---|---|---|---|");
    for (k, (name, _, _)) in configs.iter().enumerate() {
        let best = per[k].iter().copied().fold(f64::INFINITY, f64::min);
        let (lo, hi) = numel[k];
        println!(
            "| {name} | {:.1} ms | {best:.1} ms | {lo}..{hi} ({:.1} MiB f32) |",
            median(per[k].clone()),
            hi as f64 * 4.0 / (1 << 20) as f64
        );
    }
    let best = |k: usize| per[k].iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "tp / dp step time: median {:.2}, best {:.2}",
        median(per[0].clone()) / median(per[1].clone()),
        best(0) / best(1)
    );
}
