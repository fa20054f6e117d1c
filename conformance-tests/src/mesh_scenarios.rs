//! The device mesh (issue 39): at every world size its groups hold the
//! ranks the row-major mesh puts beside this one, each group's members read
//! back with an all-gather inside it; the joint groups are Accelerate's.
//! Tensor parallelism over the mesh's `tp` group (`tensor_parallel`, one
//! per model type: the fixture's pure-Rust layers, a framework's own
//! column- and row-parallel layers): a column-parallel then a row-parallel
//! linear layer, forward and backward, equal to the same two layers on one
//! rank.

use accel::mesh::{DeviceMesh, ParallelismConfig, JOINT_DIMS};
use accel_api::{CommunicatorExt, Op};
use accel_sharding::placement::chunk;

use crate::ctx::*;
use crate::fixtures::{columns, two_layers, ScenarioModel, TpCase};

/// This area's scenarios.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![
        mesh_groups: |c| needs(c, &[Op::Split, Op::AllGather]),
    ]
}

/// The gate of [`tensor_parallel`].
pub(crate) fn gate_tp(ctx: &Ctx) -> Option<String> {
    needs_peers(ctx, &[Op::Split, Op::AllReduce])
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
    ints_by(rows, cols, seed, 7)
}

/// [`ints`] walking the integers by `step`.
fn ints_by(rows: usize, cols: usize, seed: usize, step: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((i * step + seed * 3) % 9) as f32 - 4.0)
        .collect()
}

/// The case every model type runs: batch 5, 4 inputs, 12 hidden units
/// (split evenly at tp 2, 3 and 4), 5 outputs, small integers (their
/// products and sums are exact in f32 in any order, so every rank and
/// framework must give one rank's values exactly). Every hidden unit has a
/// positive and a negative pre-activation and none is 0 (where
/// frameworks' ReLU gradients differ), so every rank's rows of every tp
/// size carry both of ReLU's branches.
fn case() -> TpCase {
    let (batch, inputs, hidden, outputs) = (5, 4, 12, 5);
    let case = TpCase {
        batch,
        inputs,
        hidden,
        outputs,
        x: ints_by(batch, inputs, 8, 5),
        w1: ints(hidden, inputs, 2),
        w2: ints(outputs, hidden, 3),
        dy: ints(batch, outputs, 4),
    };
    for unit in 0..hidden {
        let pre: Vec<f32> = (0..batch)
            .map(|r| {
                let x = &case.x[r * inputs..(r + 1) * inputs];
                let w = &case.w1[unit * inputs..(unit + 1) * inputs];
                x.iter().zip(w).map(|(a, b)| a * b).sum()
            })
            .collect();
        assert!(
            pre.iter().any(|v| *v > 0.0) && pre.iter().any(|v| *v < 0.0) && !pre.contains(&0.0),
            "the tensor-parallel case's hidden unit {unit} has pre-activations {pre:?}"
        );
    }
    case
}

/// `M`'s tensor-parallel layers on every tensor-parallel mesh of this
/// world size against the fixture's layers on one rank.
pub(crate) fn tensor_parallel<M: ScenarioModel>(ctx: &Ctx) -> Outcome {
    let case = case();
    let (b, i, h, o) = (case.batch, case.inputs, case.hidden, case.outputs);
    let whole = match two_layers(&case, &(0..h), &|v| Ok(v)) {
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
        let got = match M::tensor_parallel(&case, tp) {
            None => {
                return Outcome::Skip(format!(
                    "the {}model has no tensor-parallel layers",
                    M::PREFIX.replace('_', " ")
                ))
            }
            Some(Ok(p)) => p,
            Some(Err(e)) => return Outcome::Fail(format!("{config:?}: {e}")),
        };
        let rows = chunk(h, tp.world_size(), tp.rank());
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
