//! The device mesh (issue 39): at every world size its groups hold the
//! ranks the row-major mesh puts beside this one, each group's members read
//! back with an all-gather inside it; the joint groups are Accelerate's.

use accel::mesh::{DeviceMesh, ParallelismConfig, JOINT_DIMS};
use accel_api::{CommunicatorExt, Op};

use crate::ctx::*;

/// This area's scenarios.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![mesh_groups: |c| needs(c, &[Op::Split, Op::AllGather])]
}

/// The configurations tried at `n` ranks: plain data parallel always;
/// tensor parallel at 2; FSDP × TP and HSDP at 4.
fn configs(n: usize) -> Vec<ParallelismConfig> {
    let d = ParallelismConfig::default();
    let mut out = vec![d];
    match n {
        2 => out.push(ParallelismConfig { tp: 2, ..d }),
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
