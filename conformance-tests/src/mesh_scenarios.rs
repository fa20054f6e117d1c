//! The device mesh (issue 39): at every world size its groups hold the
//! ranks the row-major mesh puts beside this one, each group's members read
//! back with an all-gather inside it; the joint groups are Accelerate's.
//! Tensor parallelism over the mesh's `tp` group (`tensor_parallel`): a
//! column-parallel then a row-parallel linear layer, forward and backward,
//! equal to the same two layers on one rank.

use accel::mesh::{DeviceMesh, ParallelismConfig, JOINT_DIMS};
use accel_api::{CommunicatorExt, Op, ReduceOp};
use accel_sharding::placement::chunk;

use crate::ctx::*;

/// This area's scenarios.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![
        mesh_groups: |c| needs(c, &[Op::Split, Op::AllGather]),
        tensor_parallel: |c| needs_peers(c, &[Op::Split, Op::AllReduce]),
    ]
}

/// The configurations tried at `n` ranks: plain data parallel always;
/// tensor parallel at 2 and 3; FSDP × TP and HSDP at 4.
fn configs(n: usize) -> Vec<ParallelismConfig> {
    let d = ParallelismConfig::default();
    let mut out = vec![d];
    match n {
        2 => out.push(ParallelismConfig { tp: 2, ..d }),
        3 => out.push(ParallelismConfig { tp: 3, ..d }),
        4 => {
            out.push(ParallelismConfig {
                dp_shard: 2,
                tp: 2,
                ..d
            });
            out.push(ParallelismConfig {
                dp_replicate: 2,
                dp_shard: 2,
                ..d
            });
        }
        _ => {}
    }
    out
}

/// Row-major coordinates of `rank` over `sizes`.
fn coords(rank: usize, sizes: &[usize]) -> Vec<usize> {
    let mut rest = rank;
    let mut c = vec![0; sizes.len()];
    for d in (0..sizes.len()).rev() {
        c[d] = rest % sizes[d];
        rest /= sizes[d];
    }
    c
}

fn mesh_groups(ctx: &Ctx) -> Outcome {
    let (n, me) = (ctx.world_size(), ctx.rank());
    for config in configs(n) {
        let mesh = match DeviceMesh::new(&ctx.comm, config) {
            Ok(m) => m,
            Err(e) => return Outcome::Fail(format!("{config:?}: {e}")),
        };
        let dims = mesh.dims();
        let names: Vec<&str> = dims.iter().map(|(d, _)| *d).collect();
        let sizes: Vec<usize> = dims.iter().map(|(_, s)| *s).collect();
        let mine = coords(me, &sizes);
        for (d, name) in names.iter().enumerate() {
            if mesh.coordinate(name) != mine[d] {
                return Outcome::Fail(format!("{config:?}: coordinate along {name}"));
            }
        }
        for group in mesh.group_names() {
            // The mesh dimensions the group spans.
            let spans: Vec<usize> = match JOINT_DIMS.iter().find(|(j, _)| *j == group) {
                Some((_, parts)) => (0..names.len())
                    .filter(|&d| parts.contains(&names[d]))
                    .collect(),
                None => vec![names.iter().position(|n| *n == group).expect("a dimension")],
            };
            let want: Vec<i64> = (0..n)
                .filter(|&r| {
                    let c = coords(r, &sizes);
                    (0..names.len()).all(|d| spans.contains(&d) || c[d] == mine[d])
                })
                .map(|r| r as i64)
                .collect();
            let comm = match mesh.group(group) {
                Ok(c) => c,
                Err(e) => return Outcome::Fail(e.to_string()),
            };
            match comm.all_gather_vec(&[me as i64]) {
                Ok(got) if got == want => {}
                Ok(got) => {
                    return Outcome::Fail(format!(
                        "{config:?}: group {group} has {got:?}, expected {want:?}"
                    ))
                }
                Err(e) => return Outcome::Fail(format!("{config:?}: group {group}: {e}")),
            }
            if comm.timeout() != ctx.comm.timeout() {
                return Outcome::Fail(format!("{config:?}: group {group} lost the timeout"));
            }
        }
    }
    Outcome::Pass
}

/// Row-major `rows × cols` of small integers from `seed` (their products
/// and sums stay exact in f32, whatever the order of the additions).
fn ints(rows: usize, cols: usize, seed: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((i * 7 + seed * 3) % 9) as f32 - 4.0)
        .collect()
}

/// `a` (`m × k`) times `b` (`n × k`) transposed: `m × n`.
fn mat_bt(a: &[f32], b: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|t| a[i * k + t] * b[j * k + t]).sum();
        }
    }
    out
}

/// The transpose of `a` (`m × n`).
fn transpose(a: &[f32], m: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[j * m + i] = a[i * n + j];
        }
    }
    out
}

/// Columns `c` of `a` (`m × n`), row-major.
fn columns(a: &[f32], n: usize, c: &std::ops::Range<usize>) -> Vec<f32> {
    a.chunks(n)
        .flat_map(|row| row[c.clone()].to_vec())
        .collect()
}

/// The two layers' outputs and gradients: `y`, `dx`, `dw1`, `dw2`.
struct Pass {
    y: Vec<f32>,
    dx: Vec<f32>,
    dw1: Vec<f32>,
    dw2: Vec<f32>,
}

/// `y = relu(x w1ᵀ) w2ᵀ` and its backward for `dy`, with `w1` the rows
/// `rows` of the whole (column parallel: outputs split) and `w2` the
/// matching columns (row parallel: inputs split); `reduce` sums the
/// partial `y` and `dx` over the group (nothing on one rank).
fn two_layers(
    dims: (usize, usize, usize, usize),
    rows: &std::ops::Range<usize>,
    reduce: &dyn Fn(Vec<f32>) -> accel_api::Result<Vec<f32>>,
) -> accel_api::Result<Pass> {
    let (b, i, h, o) = dims;
    let x = ints(b, i, 1);
    let (w1, w2, dy) = (ints(h, i, 2), ints(o, h, 3), ints(b, o, 4));
    let hl = rows.len();
    let w1l = w1[rows.start * i..rows.end * i].to_vec();
    let w2l = columns(&w2, h, rows);
    let pre = mat_bt(&x, &w1l, (b, i, hl));
    let act: Vec<f32> = pre.iter().map(|v| v.max(0.0)).collect();
    let y = reduce(mat_bt(&act, &w2l, (b, hl, o)))?;
    // Backward: dW2's columns, dh's columns, dW1's rows, dx summed.
    let dw2 = mat_bt(&transpose(&dy, b, o), &transpose(&act, b, hl), (o, b, hl));
    let dact = mat_bt(&dy, &transpose(&w2l, o, hl), (b, o, hl));
    let dpre: Vec<f32> = dact
        .iter()
        .zip(&pre)
        .map(|(g, p)| if *p > 0.0 { *g } else { 0.0 })
        .collect();
    let dw1 = mat_bt(&transpose(&dpre, b, hl), &transpose(&x, b, i), (hl, b, i));
    let dx = reduce(mat_bt(&dpre, &transpose(&w1l, hl, i), (b, hl, i)))?;
    Ok(Pass { y, dx, dw1, dw2 })
}

fn tensor_parallel(ctx: &Ctx) -> Outcome {
    // Batch, inputs, hidden (split over tp), outputs; 7 hidden: uneven chunks.
    let dims = (3, 4, 7, 5);
    let (b, i, h, o) = dims;
    let whole = match two_layers(dims, &(0..h), &|v| Ok(v)) {
        Ok(p) => p,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    let configs: Vec<ParallelismConfig> = configs(ctx.world_size())
        .into_iter()
        .filter(|c| c.tp > 1)
        .collect();
    if configs.is_empty() {
        return Outcome::Skip(format!(
            "no tensor-parallel mesh at {} rank(s) (tried at 2, 3 and 4)",
            ctx.world_size()
        ));
    }
    for config in configs {
        let mesh = match DeviceMesh::new(&ctx.comm, config) {
            Ok(m) => m,
            Err(e) => return Outcome::Fail(format!("{config:?}: {e}")),
        };
        let tp = match mesh.group("tp") {
            Ok(c) => c,
            Err(e) => return Outcome::Fail(e.to_string()),
        };
        let rows = chunk(h, tp.world_size(), tp.rank());
        let reduce = |v: Vec<f32>| tp.all_reduce_vec(&v, ReduceOp::Sum);
        let got = match two_layers(dims, &rows, &reduce) {
            Ok(p) => p,
            Err(e) => return Outcome::Fail(format!("{config:?}: {e}")),
        };
        let want_dw1 = &whole.dw1[rows.start * i..rows.end * i];
        let want_dw2 = columns(&whole.dw2, h, &rows);
        for (what, g, w) in [
            ("the output", &got.y[..], &whole.y[..]),
            ("the input gradient", &got.dx[..], &whole.dx[..]),
            (
                "the column-parallel weight gradient",
                &got.dw1[..],
                want_dw1,
            ),
            (
                "the row-parallel weight gradient",
                &got.dw2[..],
                &want_dw2[..],
            ),
        ] {
            if g != w {
                return Outcome::Fail(format!(
                    "{config:?}, tp rank {}: {what} differs from one rank's ({b}x{i} -> {h} -> {o}): \
                     {g:?} against {w:?}",
                    tp.rank()
                ));
            }
        }
    }
    Outcome::Pass
}
