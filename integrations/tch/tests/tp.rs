//! accel-tch's tensor-parallel layers on 2 rank threads over cpu-gloo
//! against the same model on one rank (libtorch's own layers):
//! - a replicated layer, then a column-parallel layer (ReLU) into a
//!   row-parallel one, mean squared error, 3 SGD steps: every step the
//!   loss, each rank's shards of the weights and of their gradients equal
//!   the one-rank model's rows and columns, and the replicated layer's
//!   gradients (which need the column-parallel input's gradient summed
//!   over the ranks: Megatron's `f` in backward) equal its own;
//! - a vocab-parallel embedding and a column-parallel head into the
//!   vocab-parallel cross entropy: the whole vocabulary's loss and each
//!   rank's rows of the table's and the head's gradients;
//! - layers built by a tensor-parallel plan compute what one rank does, and
//!   the plan cuts each whole weight to a rank's part and gathers it back;
//! - sequence parallelism: a LayerNorm on each rank's rows, a
//!   column-parallel layer entered with an all-gather and a row-parallel
//!   one left with a reduce-scatter equal the one-rank block;
//! - a plan's parts written in torch's per-rank checkpoint layout at tp 2
//!   and 3 consolidate into the whole tensors, and load at the other size;
//! - a tensor the communicator cannot carry is an error, not a crash; a
//!   sum that fails inside libtorch's backward (a peer that never joins
//!   it) ends the backward within the timeout with accel's error.

mod common;

use std::sync::Arc;
use std::time::Duration;

use accel_api::{Communicator, ErrorKind};
use accel_tch::tp::{
    cut_by_plan, load_by_plan, reduce_from_tp, scatter_to_sp, shard_chunk, sum_partial_grads,
    vocab_parallel_cross_entropy, whole_by_plan, ColumnParallelLinear, ModuleKind, Planned,
    PlannedLinear, RowParallelLinear, TpPlan, VocabParallelEmbedding,
};
use common::det;
use tch::{nn, Kind, Tensor};

const IN: i64 = 6;
const HID: i64 = 8;
const OUT: i64 = 4;
const N: i64 = 10;
const VOCAB: i64 = 12;

fn t(seed: usize, shape: &[i64]) -> Tensor {
    let n: i64 = shape.iter().product();
    let v: Vec<f32> = (0..n as usize).map(|i| det(seed, i)).collect();
    Tensor::from_slice(&v).reshape(shape)
}

fn flat(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
}

fn close(what: &str, got: &Tensor, want: &Tensor) {
    let (g, w) = (flat(got), flat(want));
    assert_eq!(g.len(), w.len(), "{what}: lengths");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
            "{what}[{i}]: {a} against one rank's {b}"
        );
    }
}

/// Per step: the loss, then (value, gradient) of w0, b0, w1, b1, w2, b2.
type Trace = Vec<(f32, Vec<(Tensor, Tensor)>)>;

fn step(loss: &Tensor, vars: &[&Tensor]) -> (f32, Vec<(Tensor, Tensor)>) {
    loss.backward();
    let mut out = Vec::new();
    tch::no_grad(|| {
        for v in vars {
            let g = v.grad();
            out.push((v.copy(), g.copy()));
            let mut v = v.shallow_clone();
            let _ = v.f_sub_(&(&g * 0.1)).unwrap();
            let _ = v.grad().zero_();
        }
    });
    (loss.double_value(&[]) as f32, out)
}

fn one_rank() -> Trace {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let p = vs.root();
    let w: Vec<Tensor> = [(1, [IN, IN]), (3, [HID, IN]), (5, [OUT, HID])]
        .iter()
        .enumerate()
        .flat_map(|(k, (s, shape))| {
            [
                p.var_copy(&format!("w{k}"), &t(*s, shape)),
                p.var_copy(&format!("b{k}"), &t(s + 1, &shape[..1])),
            ]
        })
        .collect();
    let (x, y) = (t(7, &[N, IN]), t(8, &[N, OUT]));
    (0..3)
        .map(|_| {
            let h = x.linear(&w[0], Some(&w[1]));
            let h = h.linear(&w[2], Some(&w[3])).relu();
            let loss = (h.linear(&w[4], Some(&w[5])) - &y)
                .square()
                .mean(None::<Kind>);
            step(&loss, &w.iter().collect::<Vec<_>>())
        })
        .collect()
}

/// `f` on `n` rank threads over cpu-gloo, each rank's result.
fn ranks_at<T: Send + 'static>(
    n: usize,
    f: impl Fn(&accel::Accelerator) -> accel::Result<T> + Send + Sync + 'static,
) -> Vec<T> {
    accel::Threads::new(n)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(move |acc| f(acc))
        .unwrap()
}

/// `f` with the world's communicator on 2 rank threads.
fn threads<T: Send + 'static>(
    f: impl Fn(Arc<dyn Communicator>) -> accel::Result<T> + Send + Sync + 'static,
) -> Vec<T> {
    ranks_at(2, move |acc| f(acc.comm().clone()))
}

#[test]
fn column_then_row_parallel_trains_as_one_rank() {
    let full = one_rank();
    let traces = threads(|g| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root();
        let w0 = p.var_copy("w0", &t(1, &[IN, IN]));
        let b0 = p.var_copy("b0", &t(2, &[IN]));
        let up = ColumnParallelLinear::from_full(
            &(&p / "up"),
            &t(3, &[HID, IN]),
            Some(&t(4, &[HID])),
            g.clone(),
        )?;
        let down = RowParallelLinear::from_full(
            &(&p / "down"),
            &t(5, &[OUT, HID]),
            Some(&t(6, &[OUT])),
            g,
        )?;
        let (x, y) = (t(7, &[N, IN]), t(8, &[N, OUT]));
        let vars = [
            &w0,
            &b0,
            &up.weight,
            up.bias.as_ref().unwrap(),
            &down.weight,
            down.bias.as_ref().unwrap(),
        ];
        let mut out = Vec::new();
        for _ in 0..3 {
            let h = up.forward(&x.linear(&w0, Some(&b0)))?.relu();
            let loss = (down.forward(&h)? - &y).square().mean(None::<Kind>);
            let (l, vals) = step(&loss, &vars);
            let vals: Vec<(Vec<f32>, Vec<f32>)> =
                vals.iter().map(|(v, g)| (flat(v), flat(g))).collect();
            out.push((l, vals));
        }
        Ok(out)
    });
    let half = HID / 2;
    for (rank, trace) in traces.iter().enumerate() {
        let r = rank as i64 * half;
        for (s, ((loss, mine), (want, all))) in trace.iter().zip(&full).enumerate() {
            let at = |what: &str| format!("rank {rank}, step {s}: {what}");
            assert!(
                (loss - want).abs() <= 1e-5 * (1.0 + want.abs()),
                "{}: {loss} against {want}",
                at("loss")
            );
            // The full model's part this rank holds, per tensor.
            let part = |k: usize, t: &Tensor| match k {
                2 | 3 => t.narrow(0, r, half),
                4 => t.narrow(1, r, half),
                _ => t.shallow_clone(),
            };
            for (k, ((v, g), (fv, fg))) in mine.iter().zip(all).enumerate() {
                let name = ["w0", "b0", "w1", "b1", "w2", "b2"][k];
                let v = Tensor::from_slice(v);
                let g = Tensor::from_slice(g);
                close(&at(name), &v, &part(k, fv));
                close(&at(&format!("{name}'s gradient")), &g, &part(k, fg));
            }
        }
    }
}

#[test]
fn vocab_parallel_embedding_head_and_cross_entropy_equal_the_whole_vocabulary() {
    const H: i64 = 5;
    let ids = Tensor::from_slice(&[0i64, 3, 5, 6, 11, 7, 2, 9]);
    let targets = Tensor::from_slice(&[1i64, 11, 6, 0, 5, 8, 3, 7]);
    // One rank: a full table and head, libtorch's cross entropy.
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let table = vs.root().var_copy("table", &t(11, &[VOCAB, H]));
    let head = vs.root().var_copy("head", &t(12, &[VOCAB, H]));
    let emb = Tensor::embedding(&table, &ids, -1, false, false);
    let loss = emb
        .linear::<Tensor>(&head, None)
        .cross_entropy_for_logits(&targets);
    loss.backward();
    let (want, want_table, want_head) = (loss.double_value(&[]), table.grad(), head.grad());

    let got = threads(move |g| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root();
        let table =
            VocabParallelEmbedding::from_full(&(&p / "emb"), &t(11, &[VOCAB, H]), g.clone())?;
        let head =
            ColumnParallelLinear::from_full(&(&p / "head"), &t(12, &[VOCAB, H]), None, g.clone())?;
        let ids = Tensor::from_slice(&[0i64, 3, 5, 6, 11, 7, 2, 9]);
        let targets = Tensor::from_slice(&[1i64, 11, 6, 0, 5, 8, 3, 7]);
        let start = g.rank() * (VOCAB as usize / 2);
        let logits = head.forward(&table.forward(&ids)?)?;
        assert_eq!(logits.size(), [8, VOCAB / 2], "this rank's columns only");
        let loss = vocab_parallel_cross_entropy(&logits, &targets, start, &g)?;
        loss.backward();
        Ok((
            loss.double_value(&[]),
            flat(&table.table.grad()),
            flat(&head.weight.grad()),
        ))
    });
    let half = VOCAB / 2;
    for (rank, (loss, table, head)) in got.iter().enumerate() {
        assert!(
            (loss - want).abs() <= 1e-5 * (1.0 + want.abs()),
            "rank {rank}: loss {loss} against the whole vocabulary's {want}"
        );
        let rows = |t: &Tensor| t.narrow(0, rank as i64 * half, half);
        close(
            &format!("rank {rank}: the table's gradient"),
            &Tensor::from_slice(table),
            &rows(&want_table),
        );
        close(
            &format!("rank {rank}: the head's gradient"),
            &Tensor::from_slice(head),
            &rows(&want_head),
        );
    }
}

#[test]
fn a_tensor_the_communicator_cannot_carry_is_an_error() {
    let errors = threads(|g| {
        let x = Tensor::from_slice(&[true, false]);
        let e = reduce_from_tp(&x, &g).expect_err("bool tensors have no accel element type");
        // The uneven split is refused naming the layer and the fix.
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let uneven = ColumnParallelLinear::from_full(&vs.root(), &t(1, &[7, 3]), None, g.clone())
            .unwrap_err();
        // A sequence of 5 rows does not split over 2 ranks.
        let rows = scatter_to_sp(&t(2, &[5, 3]), &g).unwrap_err();
        Ok((
            matches!(e.kind(), ErrorKind::Unsupported),
            e.to_string(),
            uneven.to_string(),
            rows.to_string(),
        ))
    });
    for (unsupported, msg, uneven, rows) in errors {
        assert!(
            rows.contains(
                "shape [5, 3] does not split its first dimension (the sequence) evenly over 2"
            ),
            "{rows}"
        );
        assert!(unsupported, "{msg}");
        assert!(msg.contains("Bool"), "{msg}");
        assert!(
            uneven.contains("a column-parallel layer has 7 features") && uneven.contains("tp size"),
            "{uneven}"
        );
    }
}

/// A replicated layer's weight, then a column-parallel and a row-parallel
/// layer's weights and biases.
fn plan_weights() -> (Tensor, Tensor, Tensor, Tensor, Tensor) {
    (
        t(1, &[IN, IN]),
        t(3, &[HID, IN]),
        t(4, &[HID]),
        t(5, &[OUT, HID]),
        t(6, &[OUT]),
    )
}

#[test]
fn layers_built_by_a_plan_compute_what_one_rank_does_and_cut_and_gather_their_weights() {
    let x = t(7, &[N, IN]);
    let (w0, w1, b1, w2, b2) = plan_weights();
    let want = x
        .linear::<Tensor>(&w0, None)
        .linear(&w1, Some(&b1))
        .relu()
        .linear(&w2, Some(&b2));
    let got = threads(|g| {
        let plan = TpPlan::from_json(r#"{"up": "colwise", "down": "rowwise"}"#)?;
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root();
        let (w0, w1, b1, w2, b2) = plan_weights();
        let layer = |m: &str, w: &Tensor, b: Option<&Tensor>| {
            PlannedLinear::from_full(&(&p / m), m, w, b, &plan, g.clone())
        };
        let first = layer("first", &w0, None)?;
        let up = layer("up", &w1, Some(&b1))?;
        let down = layer("down", &w2, Some(&b2))?;
        assert!(matches!(first, PlannedLinear::Whole { .. }), "{first:?}");
        let y = down.forward(&up.forward(&first.forward(&t(7, &[N, IN]))?)?.relu())?;
        // The plan cuts each whole weight to the layer's shard, and gathers
        // the shards back to the whole.
        let mut weights = Vec::new();
        for (name, layer, whole) in [("up.weight", &up, &w1), ("down.weight", &down, &w2)] {
            let shard = match layer {
                PlannedLinear::Column(c) => &c.weight,
                PlannedLinear::Row(r) => &r.weight,
                PlannedLinear::Whole { weight, .. } => weight,
            };
            let shape: Vec<usize> = whole.size().iter().map(|&d| d as usize).collect();
            let planned = Planned {
                name,
                kind: ModuleKind::Linear,
                shape: &shape,
                plan: &plan,
            };
            let cut = cut_by_plan(whole, &planned, &g)?;
            assert_eq!(
                flat(&cut),
                flat(shard),
                "{name}: the cut is the layer's shard"
            );
            weights.push(flat(&whole_by_plan(shard, &planned, &g)?));
        }
        Ok((flat(&y), weights))
    });
    for (rank, (y, weights)) in got.iter().enumerate() {
        close(
            &format!("rank {rank}: the output"),
            &Tensor::from_slice(y),
            &want,
        );
        assert_eq!(
            weights[0],
            flat(&w1),
            "rank {rank}: up.weight gathered whole"
        );
        assert_eq!(
            weights[1],
            flat(&w2),
            "rank {rank}: down.weight gathered whole"
        );
    }
}

/// The parameters of the checkpoint test: name, module kind, whole shape.
const PLANNED: [(&str, ModuleKind, &[i64]); 6] = [
    ("embed_tokens.weight", ModuleKind::Embedding, &[10, 4]),
    ("layers.0.mlp.up_proj.weight", ModuleKind::Linear, &[8, 4]),
    ("layers.0.mlp.up_proj.bias", ModuleKind::Linear, &[8]),
    ("layers.0.mlp.down_proj.weight", ModuleKind::Linear, &[4, 8]),
    ("layers.0.mlp.down_proj.bias", ModuleKind::Linear, &[4]),
    ("norm.weight", ModuleKind::Linear, &[4]),
];

const PLAN: &str = r#"{"embed_tokens": "rowwise", "layers.*.mlp.up_proj": "colwise",
                       "layers.*.mlp.down_proj": "rowwise"}"#;

/// Each planned parameter's whole value, its part on this rank, and what
/// `f` makes of it.
fn each_planned<T>(
    g: &Arc<dyn Communicator>,
    mut f: impl FnMut(&Planned<'_>, &Tensor, Tensor) -> accel::Result<T>,
) -> accel::Result<Vec<T>> {
    let plan = TpPlan::from_json(PLAN)?;
    let mut out = Vec::new();
    for (i, (name, kind, shape)) in PLANNED.iter().enumerate() {
        let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
        let p = Planned {
            name,
            kind: *kind,
            shape: &dims,
            plan: &plan,
        };
        let full = t(30 + i, shape);
        let mine = cut_by_plan(&full, &p, g)?;
        out.push(f(&p, &full, mine)?);
    }
    Ok(out)
}

#[test]
fn a_plans_parts_in_torchs_per_rank_layout_consolidate_and_load_at_another_tp_size() {
    let tmp = tempfile::tempdir().unwrap();
    for tp in [2usize, 3] {
        let dir = tmp.path().join(format!("tp{tp}"));
        let ckpt = dir.clone();
        ranks_at(tp, move |acc| {
            let g = acc.comm().clone();
            let chunks = each_planned(&g, |p, _, mine| shard_chunk(&mine, p, &g))?;
            acc.save_shards(chunks.into_iter().flatten().collect(), &ckpt)
        });
        // The per-rank files put back together hold the whole tensors
        // (replicated ones written once).
        let whole = tmp.path().join(format!("whole{tp}"));
        accel::train::consolidate_model(&dir, &whole, "5GB").unwrap();
        let read = Tensor::read_safetensors(whole.join("model.safetensors")).unwrap();
        for (i, (name, _, shape)) in PLANNED.iter().enumerate() {
            let (_, got) = read.iter().find(|(n, _)| n == name).expect(name);
            assert_eq!(flat(got), flat(&t(30 + i, shape)), "tp {tp}: {name}");
        }
    }
    // Resharding: what 2 ranks saved loads at 3 and the other way round,
    // each rank's part equal to the one cut from the whole tensor.
    for (saved_at, load_at) in [(2usize, 3usize), (3, 2)] {
        let dir = tmp.path().join(format!("tp{saved_at}"));
        let got = ranks_at(load_at, move |acc| {
            let g = acc.comm().clone();
            each_planned(&g, |p, _, want| {
                Ok((
                    p.name.to_string(),
                    flat(&load_by_plan(&dir, p, &g)?),
                    flat(&want),
                ))
            })
        });
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

#[test]
fn a_sum_that_fails_in_a_backward_is_libtorchs_error_naming_the_collective_not_a_hang() {
    let got = accel::Threads::new(2)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(2))
        .run(|acc| {
            if acc.rank() == 1 {
                // Rank 1 never runs the backward's all-reduce, and stays
                // connected until rank 0 has timed out.
                std::thread::sleep(Duration::from_secs(4));
                return Ok(None);
            }
            let g = acc.comm().clone();
            let x = t(1, &[2, 3]).set_requires_grad(true);
            let y = accel_tch::tp::copy_to_tp(&x, &g)?;
            let started = std::time::Instant::now();
            let e = y.sum(Kind::Float).f_backward().unwrap_err();
            Ok(Some((e.to_string(), started.elapsed())))
        })
        .unwrap();
    let (msg, took) = got[0].clone().expect("rank 0's error");
    // accel's own error, through libtorch's: backend, rank, op, timeout.
    for says in ["cpu-gloo rank 0", "all_reduce", "timed out after 2s"] {
        assert!(msg.contains(says), "{says:?} in {msg}");
    }
    assert!(took < Duration::from_secs(20), "{took:?}: {msg}");
}

/// Sequence parallelism on 2 ranks: a LayerNorm on each rank's rows of the
/// sequence, then a column-parallel layer entered with an all-gather and a
/// row-parallel one left with a reduce-scatter. Each rank's output rows,
/// the input's gradient (gathered back whole), the linear layers' gradient
/// shards, and the LayerNorm's and row bias's gradients summed over the
/// ranks (partial sums, which Megatron all-reduces) equal the one-rank
/// block's.
#[test]
fn sequence_parallel_norm_then_column_and_row_parallel_equal_one_rank() {
    const S: i64 = 6;
    let block = |x: &Tensor, ln: (&Tensor, &Tensor)| {
        x.layer_norm([IN], Some(ln.0), Some(ln.1), 1e-5, false)
    };
    // One rank.
    let leaf = |seed: usize, shape: &[i64]| t(seed, shape).set_requires_grad(true);
    let (x, g_norm, b_norm) = (leaf(40, &[S, IN]), leaf(41, &[IN]), leaf(42, &[IN]));
    let (w1, b1, w2, b2) = (
        leaf(3, &[HID, IN]),
        leaf(4, &[HID]),
        leaf(5, &[OUT, HID]),
        leaf(6, &[OUT]),
    );
    let y = block(&x, (&g_norm, &b_norm))
        .linear(&w1, Some(&b1))
        .relu()
        .linear(&w2, Some(&b2));
    (&y * t(43, &[S, OUT])).sum(Kind::Float).backward();
    let got = threads(move |group| {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let p = vs.root();
        let col = ColumnParallelLinear::from_full(
            &(&p / "up"),
            &t(3, &[HID, IN]),
            Some(&t(4, &[HID])),
            group.clone(),
        )?;
        let row = RowParallelLinear::from_full(
            &(&p / "down"),
            &t(5, &[OUT, HID]),
            Some(&t(6, &[OUT])),
            group.clone(),
        )?;
        let (x, g, b) = (leaf(40, &[S, IN]), leaf(41, &[IN]), leaf(42, &[IN]));
        let rows = scatter_to_sp(&x, &group)?;
        let h = col
            .forward_sequence_parallel(&block(&rows, (&g, &b)))?
            .relu();
        let y = row.forward_sequence_parallel(&h)?;
        let r = group.rank() as i64;
        let target = t(43, &[S, OUT]).narrow(0, r * S / 2, S / 2);
        (&y * target)
            .sum(Kind::Float)
            .f_backward()
            .map_err(|e| accel::Error::new(accel_api::ErrorKind::Backend, e.to_string()))?;
        let partial: Vec<Vec<f32>> = [&g, &b, row.bias.as_ref().unwrap()]
            .iter()
            .map(|v| flat(&v.grad()))
            .collect();
        sum_partial_grads(&[&g, &b, row.bias.as_ref().unwrap()], &group)?;
        let summed: Vec<Vec<f32>> = [&g, &b, row.bias.as_ref().unwrap()]
            .iter()
            .map(|v| flat(&v.grad()))
            .collect();
        let grads: Vec<Vec<f32>> = [&x, &g, &b, &col.weight, col.bias.as_ref().unwrap()]
            .iter()
            .chain([&row.weight, row.bias.as_ref().unwrap()].iter())
            .map(|v| flat(&v.grad()))
            .collect();
        Ok((flat(&y), grads, partial, summed))
    });
    let (half, hid) = (S / 2, HID / 2);
    let mut sums = [
        Tensor::zeros([IN], tch::kind::FLOAT_CPU),
        Tensor::zeros([IN], tch::kind::FLOAT_CPU),
        Tensor::zeros([OUT], tch::kind::FLOAT_CPU),
    ];
    for (r, (out, grads, partial, summed)) in got.iter().enumerate() {
        let r = r as i64;
        let at = |what: &str| format!("rank {r}: {what}");
        // Each rank's partial gradients, then the sums every rank holds
        // after sum_partial_grads.
        let g = |i: usize| match i {
            1 => Tensor::from_slice(&partial[0]),
            2 => Tensor::from_slice(&partial[1]),
            6 => Tensor::from_slice(&partial[2]),
            _ => Tensor::from_slice(&grads[i]),
        };
        close(
            &at("the norm scale's summed gradient"),
            &Tensor::from_slice(&summed[0]),
            &g_norm.grad(),
        );
        close(
            &at("the norm shift's summed gradient"),
            &Tensor::from_slice(&summed[1]),
            &b_norm.grad(),
        );
        close(
            &at("the row bias's summed gradient"),
            &Tensor::from_slice(&summed[2]),
            &b2.grad(),
        );
        close(
            &at("its output rows"),
            &Tensor::from_slice(out),
            &y.narrow(0, r * half, half),
        );
        close(&at("the input's gradient"), &g(0), &x.grad());
        close(
            &at("column weight rows"),
            &g(3),
            &w1.grad().narrow(0, r * hid, hid),
        );
        close(
            &at("column bias"),
            &g(4),
            &b1.grad().narrow(0, r * hid, hid),
        );
        close(
            &at("row weight columns"),
            &g(5),
            &w2.grad().narrow(1, r * hid, hid),
        );
        for (sum, i) in sums.iter_mut().zip([1, 2, 6]) {
            *sum += g(i).reshape(sum.size());
        }
    }
    close(
        "the LayerNorm scale's gradient, summed",
        &sums[0],
        &g_norm.grad(),
    );
    close(
        "the LayerNorm shift's gradient, summed",
        &sums[1],
        &b_norm.grad(),
    );
    close("the row bias's gradient, summed", &sums[2], &b2.grad());
}
