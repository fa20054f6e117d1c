//! A small decoder-style language model (issue 39) trained 20 SGD steps on
//! 4 rank threads at `dp_shard=2 × tp=2` (the device mesh over cpu-gloo)
//! against the same model on one rank: vocab-parallel embedding, two
//! residual blocks (LayerNorm, a column-parallel then a row-parallel
//! layer), a final LayerNorm, a column-parallel head and the vocab-parallel
//! cross entropy (no rank holds all the logits). Each data-parallel rank
//! reads half the batch, gradients are averaged over the `dp` group. Every
//! step's loss agrees with one rank's to 1e-5 relative, and so do the
//! final weights' shards.

use std::sync::Arc;
use std::time::Duration;

use accel::mesh::{DeviceMesh, ParallelismConfig};
use accel_api::{Communicator, CommunicatorExt, ReduceOp};
use accel_candle::tp::{
    vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
};
mod common;
use common::values;

use candle_core::{Device, Tensor, Var, D};

const V: usize = 16;
const H: usize = 8;
const F: usize = 16;
const LAYERS: usize = 2;
/// Samples per step (all ranks together), tokens per sample.
const B: usize = 4;
const S: usize = 3;
const STEPS: usize = 20;
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

fn full() -> Full {
    Full {
        emb: t(values(V * H, 1), &[V, H]),
        layers: (0..LAYERS as u64)
            .map(|l| {
                [
                    t(vec![1.0; H], &[H]),
                    t(vec![0.0; H], &[H]),
                    t(values(F * H, 10 + l), &[F, H]),
                    t(values(F, 20 + l), &[F]),
                    t(values(H * F, 30 + l), &[H, F]),
                    t(values(H, 40 + l), &[H]),
                ]
            })
            .collect(),
        norm: [t(vec![1.0; H], &[H]), t(vec![0.0; H], &[H])],
        head: t(values(V * H, 2), &[V, H]),
    }
}

/// Step `step`'s batch: `B × S` input ids and the next-token targets.
fn batch(step: usize) -> (Vec<u32>, Vec<u32>) {
    let ids: Vec<u32> = values(B * S, 100 + step as u64)
        .iter()
        .map(|v| (((v + 0.5) * V as f32) as u32).min(V as u32 - 1))
        .collect();
    let targets: Vec<u32> = ids.iter().map(|&i| (i * 7 + 1) % V as u32).collect();
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

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// One rank, the whole batch: the loss of every step and the final head.
fn one_rank() -> (Vec<f32>, Vec<f32>) {
    let f = full();
    let mut vars = vec![Var::from_tensor(&f.emb).unwrap()];
    for l in &f.layers {
        vars.extend(l.iter().map(|t| Var::from_tensor(t).unwrap()));
    }
    vars.extend(f.norm.iter().map(|t| Var::from_tensor(t).unwrap()));
    vars.push(Var::from_tensor(&f.head).unwrap());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let (ids, targets) = batch(step);
        let v = |i: usize| vars[i].as_tensor();
        let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let mut x = v(0).index_select(&ids, 0).unwrap();
        for l in 0..LAYERS {
            let p = 1 + 6 * l;
            let h = layer_norm(&x, v(p), v(p + 1)).unwrap();
            let h = h.matmul(&v(p + 2).t().unwrap()).unwrap();
            let h = h.broadcast_add(v(p + 3)).unwrap().relu().unwrap();
            let h = h.matmul(&v(p + 4).t().unwrap()).unwrap();
            x = (x + h.broadcast_add(v(p + 5)).unwrap()).unwrap();
        }
        let n = 1 + 6 * LAYERS;
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
        sgd(&vars, &grads);
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

#[test]
fn a_small_decoder_trains_at_dp_shard_2_by_tp_2_as_on_one_rank() {
    let (want, want_head) = one_rank();
    let got = accel::Threads::new(4)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(60))
        .run(|acc| {
            let config = ParallelismConfig {
                dp_shard: 2,
                tp: 2,
                ..ParallelismConfig::default()
            };
            let mesh = DeviceMesh::new(acc.comm(), config)?;
            let (tp, dp) = (mesh.group("tp")?.clone(), mesh.group("dp")?.clone());
            let f = full();
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
            let (d, half) = (dp.rank(), B / 2);
            let vocab_start = tp.rank() * V / 2;
            let mut losses = Vec::new();
            for step in 0..STEPS {
                let (ids, targets) = batch(step);
                // This data-parallel rank's half of the samples.
                let mine = |v: &[u32]| v[d * half * S..(d + 1) * half * S].to_vec();
                let ids = Tensor::new(mine(&ids).as_slice(), &Device::Cpu).unwrap();
                let tg = Tensor::new(mine(&targets).as_slice(), &Device::Cpu).unwrap();
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
                let grads: Vec<Tensor> = vars
                    .iter()
                    .map(|v| g.get(v.as_tensor()).unwrap().clone())
                    .collect();
                sgd(&vars, &dp_average(&grads, &dp));
            }
            let head_rows = flat(head.vars()[0].as_tensor());
            Ok((losses, tp.rank(), head_rows))
        })
        .unwrap();
    for (rank, (losses, tp_rank, head)) in got.iter().enumerate() {
        for (step, (a, b)) in losses.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                "rank {rank}, step {step}: loss {a} against one rank's {b}"
            );
        }
        let rows = V / 2;
        let w = &want_head[tp_rank * rows * H..(tp_rank + 1) * rows * H];
        for (i, (a, b)) in head.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "rank {rank}: head[{i}] {a} against {b}"
            );
        }
    }
    // The loss went down: the model learned, so equal losses mean
    // something; and the two data-parallel halves differ.
    assert!(want[STEPS - 1] < want[0] * 0.9, "{want:?}");
    let (ids, _) = batch(0);
    assert_ne!(ids[..B * S / 2], ids[B * S / 2..]);
}
