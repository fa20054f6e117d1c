//! accel-candle's tensor-parallel layers trained on 2 rank threads over
//! cpu-gloo against the same MLP on one rank: a replicated layer, then a
//! column-parallel layer (ReLU) into a row-parallel one, mean squared
//! error, 5 SGD steps. Every step, each rank's shards of the weights and of
//! their gradients equal the one-rank model's rows and columns, the
//! replicated layer's gradients (which need the column-parallel input's
//! gradient summed over the ranks) equal its own, and the loss is the
//! same.

use std::time::Duration;

use accel_candle::tp::{vocab_parallel_cross_entropy, ColumnParallelLinear, RowParallelLinear};
mod common;
use common::values;

use candle_core::{Device, Tensor, Var};
use candle_nn::Module;

const IN: usize = 6;
const HID: usize = 8;
const OUT: usize = 4;
const N: usize = 10;

fn t(v: Vec<f32>, shape: &[usize]) -> Tensor {
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// The full model's starting values and the data.
fn start() -> [Tensor; 8] {
    [
        t(values(IN * IN, 7), &[IN, IN]),
        t(values(IN, 8), &[IN]),
        t(values(HID * IN, 1), &[HID, IN]),
        t(values(HID, 2), &[HID]),
        t(values(OUT * HID, 3), &[OUT, HID]),
        t(values(OUT, 4), &[OUT]),
        t(values(N * IN, 5), &[N, IN]),
        t(values(N * OUT, 6), &[N, OUT]),
    ]
}

/// Per step: the loss, and the weights then gradients of the four tensors,
/// as one rank holds them (the full model: all of them).
type Trace = Vec<(f32, Vec<Vec<f32>>)>;

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn sgd(vars: &[Var], grads: &candle_core::backprop::GradStore, trace: &mut Vec<Vec<f32>>) {
    for v in vars {
        let g = grads.get(v.as_tensor()).expect("a gradient");
        trace.push(flat(v.as_tensor()));
        trace.push(flat(g));
        v.set(&(v.as_tensor() - (g * 0.1).unwrap()).unwrap())
            .unwrap();
    }
}

fn one_rank() -> Trace {
    let [w0, b0, w1, b1, w2, b2, x, y] = start();
    let vars: Vec<Var> = [w0, b0, w1, b1, w2, b2]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let lin = |w: usize| {
        candle_nn::Linear::new(
            vars[w].as_tensor().clone(),
            Some(vars[w + 1].as_tensor().clone()),
        )
    };
    let mut out = Vec::new();
    for _ in 0..5 {
        let h0 = lin(0).forward(&x).unwrap();
        let h1 = lin(2).forward(&h0).unwrap().relu().unwrap();
        let p = lin(4).forward(&h1).unwrap();
        let loss = (p - &y).unwrap().sqr().unwrap().mean_all().unwrap();
        let grads = loss.backward().unwrap();
        let mut trace = Vec::new();
        sgd(&vars, &grads, &mut trace);
        out.push((loss.to_scalar::<f32>().unwrap(), trace));
    }
    out
}

/// Rows `r` of `[rows, cols]` values, or columns.
fn part(
    v: &[f32],
    cols: usize,
    rows: std::ops::Range<usize>,
    by_cols: Option<std::ops::Range<usize>>,
) -> Vec<f32> {
    let mut out = Vec::new();
    for r in rows {
        let row = &v[r * cols..(r + 1) * cols];
        match &by_cols {
            Some(c) => out.extend_from_slice(&row[c.clone()]),
            None => out.extend_from_slice(row),
        }
    }
    out
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "{what}[{i}]: {a} against {b}"
        );
    }
}

#[test]
fn column_then_row_parallel_trains_as_one_rank() {
    let full = one_rank();
    let traces = accel::Threads::new(2)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(|acc| {
            let [w0, b0, w1, b1, w2, b2, x, y] = start();
            let pre = [
                Var::from_tensor(&w0).unwrap(),
                Var::from_tensor(&b0).unwrap(),
            ];
            let g = acc.comm().clone();
            let up = ColumnParallelLinear::from_full(&w1, Some(&b1), g.clone(), false)?;
            let down = RowParallelLinear::from_full(&w2, Some(&b2), g)?;
            let vars: Vec<Var> = pre
                .iter()
                .cloned()
                .chain(up.vars())
                .chain(down.vars())
                .collect();
            let mut out = Vec::new();
            for _ in 0..5 {
                let first = candle_nn::Linear::new(
                    pre[0].as_tensor().clone(),
                    Some(pre[1].as_tensor().clone()),
                );
                let h = up.forward(&first.forward(&x).unwrap())?.relu().unwrap();
                let p = down.forward(&h)?;
                let loss = (p - &y).unwrap().sqr().unwrap().mean_all().unwrap();
                let grads = loss.backward().unwrap();
                let mut trace = Vec::new();
                sgd(&vars, &grads, &mut trace);
                out.push((loss.to_scalar::<f32>().unwrap(), trace));
            }
            Ok(out)
        })
        .unwrap();
    let half = HID / 2;
    for (rank, trace) in traces.iter().enumerate() {
        let rows = rank * half..(rank + 1) * half;
        for (step, ((loss, mine), (want_loss, all))) in trace.iter().zip(&full).enumerate() {
            let at = |what: &str| format!("rank {rank}, step {step}: {what}");
            close(&at("loss"), &[*loss], &[*want_loss]);
            // Weight then gradient, for w0, b0 (whole), w1 (rows), b1
            // (rows), w2 (columns), b2 (whole).
            for k in 0..2 {
                close(&at("w0"), &mine[k], &all[k]);
                close(&at("b0"), &mine[2 + k], &all[2 + k]);
                close(
                    &at("w1"),
                    &mine[4 + k],
                    &part(&all[4 + k], IN, rows.clone(), None),
                );
                close(&at("b1"), &mine[6 + k], &all[6 + k][rows.clone()]);
                let w2 = part(&all[8 + k], HID, 0..OUT, Some(rows.clone()));
                close(&at("w2"), &mine[8 + k], &w2);
                close(&at("b2"), &mine[10 + k], &all[10 + k]);
            }
        }
    }
}

/// A vocab-parallel embedding on 2 ranks gives every id's row, and its
/// gradient lands on the rank holding that row, as a full table's does.
#[test]
fn vocab_parallel_embedding_looks_up_and_learns_as_a_full_table() {
    const V: usize = 10;
    const H: usize = 3;
    let table = t(values(V * H, 11), &[V, H]);
    let ids = Tensor::new(&[[3u32, 7, 0], [9, 3, 5]], &Device::Cpu).unwrap();
    let weights = t(values(2 * 3 * H, 12), &[2, 3, H]);
    // One rank: the rows, and the gradient of sum(rows * weights).
    let full = Var::from_tensor(&table).unwrap();
    let rows = full
        .as_tensor()
        .index_select(&ids.flatten_all().unwrap(), 0)
        .and_then(|r| r.reshape((2, 3, H)))
        .unwrap();
    let grad = (&rows * &weights)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let (want_rows, want_grad) = (flat(&rows), flat(grad.get(full.as_tensor()).unwrap()));
    let per_rank = accel::Threads::new(2)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(move |acc| {
            let emb =
                accel_candle::tp::VocabParallelEmbedding::from_full(&table, acc.comm().clone())?;
            let rows = emb.forward(&ids)?;
            let grads = (&rows * &weights)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mine = flat(grads.get(emb.vars()[0].as_tensor()).unwrap());
            Ok((flat(&rows), mine))
        })
        .unwrap();
    let half = V / 2;
    for (rank, (rows, grad)) in per_rank.iter().enumerate() {
        close(&format!("rank {rank}: rows"), rows, &want_rows);
        let mine = &want_grad[rank * half * H..(rank + 1) * half * H];
        close(&format!("rank {rank}: gradient of its rows"), grad, mine);
    }
}

/// The vocab-parallel cross entropy on 2 and 4 ranks (each holding a
/// quarter or a half of the logits' columns): the loss of the whole
/// vocabulary, and each rank's columns of its gradient, as candle's own
/// cross entropy on one rank gives them.
#[test]
fn vocab_parallel_cross_entropy_is_the_whole_vocabularys_loss_and_gradient() {
    const V: usize = 12;
    const B: usize = 5;
    // Large logits: the max shift must be the global one.
    let logits: Vec<f32> = values(B * V, 21).iter().map(|v| v * 40.0).collect();
    let targets = [0u32, 11, 5, 6, 3];
    let full = Var::from_tensor(&t(logits.clone(), &[B, V])).unwrap();
    let tg = Tensor::new(&targets, &Device::Cpu).unwrap();
    let loss = candle_nn::loss::cross_entropy(full.as_tensor(), &tg).unwrap();
    let want_loss = loss.to_scalar::<f32>().unwrap();
    let want_grad = flat(loss.backward().unwrap().get(full.as_tensor()).unwrap());
    for tp in [2usize, 4] {
        let logits = logits.clone();
        let per = V / tp;
        let got = accel::Threads::new(tp)
            .backend("cpu-gloo")
            .timeout(Duration::from_secs(30))
            .run(move |acc| {
                let cols = acc.rank() * per..(acc.rank() + 1) * per;
                let mine =
                    Var::from_tensor(&t(part(&logits, V, 0..B, Some(cols.clone())), &[B, per]))
                        .unwrap();
                let tg = Tensor::new(&targets, &Device::Cpu).unwrap();
                let loss =
                    vocab_parallel_cross_entropy(mine.as_tensor(), &tg, cols.start, acc.comm())?;
                let grads = loss.backward().unwrap();
                let g = flat(grads.get(mine.as_tensor()).unwrap());
                Ok((loss.to_scalar::<f32>().unwrap(), g, cols))
            })
            .unwrap();
        for (rank, (loss, grad, cols)) in got.iter().enumerate() {
            close(
                &format!("tp {tp}, rank {rank}: loss"),
                &[*loss],
                &[want_loss],
            );
            let want = part(&want_grad, V, 0..B, Some(cols.clone()));
            close(
                &format!("tp {tp}, rank {rank}: its columns of the gradient"),
                grad,
                &want,
            );
        }
    }
}

/// A `tp_plan` (transformers' vocabulary) cuts a full checkpoint's
/// parameters on 2 and 3 ranks (torch's uneven chunks at 3) and puts the
/// whole tensors back together exactly.
/// Layers built by a plan: an unnamed module whole, `colwise` then
/// `rowwise` split, on 2 ranks, give one rank's output and input gradient;
/// each rank holds its half of the split layers.
#[test]
fn layers_built_by_a_plan_compute_what_one_rank_does() {
    use accel_candle::tp::{PlannedLinear, TpPlan};
    let plan = TpPlan::from_json(r#"{"mlp.up": "colwise", "mlp.down": "rowwise"}"#).unwrap();
    let [w0, b0, w1, b1, w2, b2, x, _] = start();
    // One rank: the same three layers, whole.
    let one = |x: &Tensor| -> candle_core::Result<Tensor> {
        let h = x.matmul(&w0.t()?)?.broadcast_add(&b0)?.tanh()?;
        let h = h.matmul(&w1.t()?)?.broadcast_add(&b1)?.tanh()?;
        h.matmul(&w2.t()?)?.broadcast_add(&b2)
    };
    let xv = Var::from_tensor(&x).unwrap();
    let want = one(xv.as_tensor()).unwrap();
    let want_grad = flat(
        want.sum_all()
            .unwrap()
            .backward()
            .unwrap()
            .get(xv.as_tensor())
            .unwrap(),
    );
    let want = flat(&want);
    let got = accel::Threads::new(2)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(move |acc| {
            let [w0, b0, w1, b1, w2, b2, x, _] = start();
            let g = acc.comm().clone();
            let pre = PlannedLinear::from_full("pre", &w0, Some(&b0), &plan, g.clone())?;
            let up = PlannedLinear::from_full("mlp.up", &w1, Some(&b1), &plan, g.clone())?;
            let down = PlannedLinear::from_full("mlp.down", &w2, Some(&b2), &plan, g)?;
            let kinds = [&pre, &up, &down].map(|l| match l {
                PlannedLinear::Column(_) => "column",
                PlannedLinear::Row(_) => "row",
                PlannedLinear::Whole { .. } => "whole",
            });
            assert_eq!(kinds, ["whole", "column", "row"]);
            let sizes: Vec<usize> = up.vars().iter().map(|v| v.elem_count()).collect();
            assert_eq!(sizes, [w1.elem_count() / 2, b1.elem_count() / 2]);
            let xv = Var::from_tensor(&x).unwrap();
            let h = pre.forward(xv.as_tensor())?.tanh().unwrap();
            let h = up.forward(&h)?.tanh().unwrap();
            let y = down.forward(&h)?;
            let grads = y.sum_all().unwrap().backward().unwrap();
            Ok((flat(&y), flat(grads.get(xv.as_tensor()).unwrap())))
        })
        .unwrap();
    for (rank, (y, gx)) in got.iter().enumerate() {
        close(&format!("rank {rank}: output"), y, &want);
        close(&format!("rank {rank}: input gradient"), gx, &want_grad);
    }
}

#[test]
fn a_tp_plan_cuts_whole_parameters_and_gathers_them_back() {
    use accel_candle::tp::{cut_by_plan, load_by_plan, shard_chunk, whole_by_plan, Planned};
    use accel_sharding::tp_plan::{ModuleKind, TpPlan};
    let params: Vec<(&str, ModuleKind, Vec<usize>)> = vec![
        ("embed_tokens.weight", ModuleKind::Embedding, vec![10, 4]),
        (
            "layers.0.mlp.up_proj.weight",
            ModuleKind::Linear,
            vec![8, 4],
        ),
        ("layers.0.mlp.up_proj.bias", ModuleKind::Linear, vec![8]),
        (
            "layers.0.mlp.down_proj.weight",
            ModuleKind::Linear,
            vec![4, 8],
        ),
        ("layers.0.mlp.down_proj.bias", ModuleKind::Linear, vec![4]),
        ("norm.weight", ModuleKind::Linear, vec![4]),
    ];
    fn planned<'a>(
        name: &'a str,
        kind: ModuleKind,
        shape: &'a [usize],
        plan: &'a TpPlan,
    ) -> Planned<'a> {
        Planned {
            name,
            kind,
            shape,
            plan,
        }
    }
    let plan_json = r#"{"embed_tokens": "rowwise", "layers.*.mlp.up_proj": "colwise",
                        "layers.*.mlp.down_proj": "rowwise"}"#;
    let tmp = tempfile::tempdir().unwrap();
    for tp in [2usize, 3] {
        let params = params.clone();
        let ckpt = tmp.path().join(format!("tp{tp}"));
        let saved = ckpt.clone();
        let got = accel::Threads::new(tp)
            .backend("cpu-gloo")
            .timeout(Duration::from_secs(30))
            .run(move |acc| {
                let plan = TpPlan::from_json(plan_json)?;
                let mut out = Vec::new();
                let mut chunks = Vec::new();
                for (i, (name, kind, shape)) in params.iter().enumerate() {
                    let n: usize = shape.iter().product();
                    let full = t(values(n, 30 + i as u64), shape);
                    let mine = cut_by_plan(&full, &planned(name, *kind, shape, &plan), acc.comm())?;
                    let whole =
                        whole_by_plan(&mine, &planned(name, *kind, shape, &plan), acc.comm())?;
                    chunks.extend(shard_chunk(
                        &mine,
                        &planned(name, *kind, shape, &plan),
                        acc.comm(),
                    )?);
                    out.push((
                        name.to_string(),
                        mine.dims().to_vec(),
                        flat(&whole),
                        flat(&full),
                    ));
                }
                // Each rank's parts, in torch's per-rank layout.
                acc.save_shards(chunks, &ckpt)?;
                Ok(out)
            })
            .unwrap();
        for (rank, per) in got.iter().enumerate() {
            for (name, dims, whole, full) in per {
                assert_eq!(
                    whole, full,
                    "tp {tp}, rank {rank}: {name} put back together"
                );
                let want: Vec<usize> = match name.as_str() {
                    // ceil(10 / tp) rows; at 3 the last rank holds 2.
                    "embed_tokens.weight" if tp == 3 => vec![if rank == 2 { 2 } else { 4 }, 4],
                    "embed_tokens.weight" => vec![5, 4],
                    "layers.0.mlp.up_proj.weight" => {
                        vec![8usize.div_ceil(tp).min(8 - rank * 8usize.div_ceil(tp)), 4]
                    }
                    "layers.0.mlp.up_proj.bias" => {
                        vec![8usize.div_ceil(tp).min(8 - rank * 8usize.div_ceil(tp))]
                    }
                    "layers.0.mlp.down_proj.weight" => {
                        vec![4, 8usize.div_ceil(tp).min(8 - rank * 8usize.div_ceil(tp))]
                    }
                    _ => vec![4],
                };
                assert_eq!(dims, &want, "tp {tp}, rank {rank}: {name}'s part");
            }
        }
        // The per-rank files put back together (replicated tensors written
        // once: no overlap) hold the whole tensors.
        let whole = tmp.path().join(format!("whole{tp}"));
        accel::train::consolidate_model(&saved, &whole, "5GB").unwrap();
        let read =
            candle_core::safetensors::load(whole.join("model.safetensors"), &Device::Cpu).unwrap();
        for (name, _, _, full) in &got[0] {
            assert_eq!(
                &flat(&read[name]),
                full,
                "tp {tp}: {name} from the per-rank files"
            );
        }
    }
    // Resharding across meshes: what 2 ranks saved loads at 3 and the
    // other way round, each rank reading its part of the chunks, equal to
    // the part cut from the whole tensor.
    for (saved_at, load_at) in [(2usize, 3usize), (3, 2)] {
        let params = params.clone();
        let dir = tmp.path().join(format!("tp{saved_at}"));
        let got = accel::Threads::new(load_at)
            .backend("cpu-gloo")
            .timeout(Duration::from_secs(30))
            .run(move |acc| {
                let plan = TpPlan::from_json(plan_json)?;
                let mut out = Vec::new();
                for (i, (name, kind, shape)) in params.iter().enumerate() {
                    let n: usize = shape.iter().product();
                    let full = t(values(n, 30 + i as u64), shape);
                    let want = cut_by_plan(&full, &planned(name, *kind, shape, &plan), acc.comm())?;
                    let got = load_by_plan(&dir, &planned(name, *kind, shape, &plan), acc.comm())?;
                    out.push((name.to_string(), flat(&got), flat(&want)));
                }
                Ok(out)
            })
            .unwrap();
        for (rank, per) in got.iter().enumerate() {
            for (name, got, want) in per {
                assert_eq!(
                    got, want,
                    "saved at {saved_at}, rank {rank} of {load_at}: {name}"
                );
            }
        }
    }
}

/// `x` normalised per row, then scaled by `g` and shifted by `b` (a
/// LayerNorm written with differentiable ops).
fn layer_norm(x: &Tensor, g: &Tensor, b: &Tensor) -> Tensor {
    let mean = x.mean_keepdim(1).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(1).unwrap();
    let xn = xc
        .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
        .unwrap();
    xn.broadcast_mul(g).unwrap().broadcast_add(b).unwrap()
}

/// Sequence parallelism on 2 ranks: a LayerNorm on each rank's rows of the
/// sequence, then a column-parallel layer entered with an all-gather and a
/// row-parallel one left with a reduce-scatter. Each rank's output rows,
/// the input's gradient, the linear layers' gradient shards and the
/// LayerNorm's gradient summed over the ranks (Megatron all-reduces it)
/// equal the one-rank block's.
#[test]
fn sequence_parallel_norm_then_column_and_row_parallel_equal_one_rank() {
    use accel_candle::tp::scatter_to_sp;
    const S: usize = 6;
    let [_, _, w1, b1, w2, b2, _, _] = start();
    let x = t(values(S * IN, 40), &[S, IN]);
    let (g, b) = (t(values(IN, 41), &[IN]), t(values(IN, 42), &[IN]));
    let target = t(values(S * OUT, 43), &[S, OUT]);
    // One rank.
    let vars: Vec<Var> = [&x, &g, &b, &w1, &b1, &w2, &b2]
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let v = |i: usize| vars[i].as_tensor();
    let h = layer_norm(v(0), v(1), v(2));
    let h = h
        .matmul(&v(3).t().unwrap())
        .unwrap()
        .broadcast_add(v(4))
        .unwrap()
        .relu()
        .unwrap();
    let y = h
        .matmul(&v(5).t().unwrap())
        .unwrap()
        .broadcast_add(v(6))
        .unwrap();
    let grads = (&y * &target)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let want_y = flat(&y);
    let want: Vec<Vec<f32>> = vars
        .iter()
        .map(|v| flat(grads.get(v.as_tensor()).unwrap()))
        .collect();
    let got = accel::Threads::new(2)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(move |acc| {
            let group = acc.comm().clone();
            let xv = Var::from_tensor(&x).unwrap();
            let (gv, bv) = (Var::from_tensor(&g).unwrap(), Var::from_tensor(&b).unwrap());
            let col = ColumnParallelLinear::from_full(&w1, Some(&b1), group.clone(), false)?;
            let row = RowParallelLinear::from_full(&w2, Some(&b2), group.clone())?;
            let rows = scatter_to_sp(xv.as_tensor(), &group)?;
            let h = layer_norm(&rows, gv.as_tensor(), bv.as_tensor());
            let h = col.forward_sequence_parallel(&h)?.relu().unwrap();
            let y = row.forward_sequence_parallel(&h)?;
            let r = acc.rank();
            let my_target = target.narrow(0, r * S / 2, S / 2).unwrap();
            let grads = (&y * &my_target)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let g = |v: &Var| flat(grads.get(v.as_tensor()).unwrap());
            Ok((
                flat(&y),
                g(&xv),
                [g(&gv), g(&bv)],
                col.vars().iter().map(g).collect::<Vec<_>>(),
                row.vars().iter().map(g).collect::<Vec<_>>(),
            ))
        })
        .unwrap();
    let half = S / 2;
    let hid_half = HID / 2;
    let mut norm_sum = [vec![0.0f32; IN], vec![0.0f32; IN]];
    let mut bias_sum = vec![0.0f32; OUT];
    for (r, (y, dx, norm, col, row)) in got.iter().enumerate() {
        close(
            &format!("rank {r}: its output rows"),
            y,
            &want_y[r * half * OUT..(r + 1) * half * OUT],
        );
        // The input is replicated: its gradient is gathered back whole.
        close(&format!("rank {r}: the input's gradient"), dx, &want[0]);
        close(
            &format!("rank {r}: column weight rows"),
            &col[0],
            &part(&want[3], IN, r * hid_half..(r + 1) * hid_half, None),
        );
        close(
            &format!("rank {r}: column bias"),
            &col[1],
            &want[4][r * hid_half..(r + 1) * hid_half],
        );
        close(
            &format!("rank {r}: row weight columns"),
            &row[0],
            &part(
                &want[5],
                HID,
                0..OUT,
                Some(r * hid_half..(r + 1) * hid_half),
            ),
        );
        // The row-parallel bias is added to each rank's rows: its
        // gradient is a partial sum, as the LayerNorm's.
        bias_sum.iter_mut().zip(&row[1]).for_each(|(s, v)| *s += v);
        for (sum, g) in norm_sum.iter_mut().zip(norm) {
            sum.iter_mut().zip(g).for_each(|(s, v)| *s += v);
        }
    }
    close(
        "the LayerNorm's scale gradient summed over the ranks",
        &norm_sum[0],
        &want[1],
    );
    close(
        "the LayerNorm's shift gradient summed over the ranks",
        &norm_sum[1],
        &want[2],
    );
    close(
        "the row-parallel bias's gradient summed over the ranks",
        &bias_sum,
        &want[6],
    );
}
