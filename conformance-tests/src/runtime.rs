//! The runtime built on the collectives for every backend alike:
//! variable-size gather, padding, serde objects.

use std::collections::BTreeMap;

use accel::CollectivesExt;
use accel_api::Op;
use proptest::prelude::*;

use crate::ctx::*;
use crate::data::{compare, input};
use crate::prop::property;

/// This area's scenarios, in the order the matrix lists them.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![
        varsize_gather: |c| needs(c, &[Op::AllGather]),
        pad_across_processes: |c| needs(c, &[Op::AllGather]),
        objects: |c| needs(c, &[Op::AllGather, Op::Broadcast]),
    ]
}

fn varsize_gather(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (0usize..50, any::<u64>());
    property(ctx, "varsize_gather", strat, |&(max, seed)| {
        let lens: Vec<usize> = (0..n)
            .map(|r| input::<i64>(seed, r, 1, (0, max as i64))[0] as usize)
            .collect();
        let all: Vec<Vec<i32>> = (0..n)
            .map(|r| input::<i32>(seed, r, lens[r], (-1000, 1000)))
            .collect();
        let got = ctx
            .comm
            .all_gather_varsize(&all[ctx.rank()])
            .map_err(err_text)?;
        if got != all {
            return Err(format!(
                "variable-size gather gave lengths {:?}, expected {lens:?}",
                got.iter().map(Vec::len).collect::<Vec<_>>()
            ));
        }
        Ok(())
    })
}

fn pad_across_processes(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (1usize..4, 0usize..6, 1usize..4, any::<bool>(), any::<u64>());
    property(
        ctx,
        "pad_across_processes",
        strat,
        |&(rows, maxlen, cols, first, seed)| {
            let lens: Vec<usize> = (0..n)
                .map(|r| input::<i64>(seed, r, 1, (0, maxlen as i64))[0] as usize)
                .collect();
            let me = ctx.rank();
            let data = input::<f32>(seed, me, rows * lens[me] * cols, (-9, 9));
            let (out, shape) = ctx
                .comm
                .pad_across_processes(&data, &[rows, lens[me], cols], 1, -1.0f32, first)
                .map_err(err_text)?;
            let max = *lens.iter().max().expect("ranks");
            if shape != vec![rows, max, cols] {
                return Err(format!(
                    "padded shape {shape:?}, expected {:?}",
                    [rows, max, cols]
                ));
            }
            let mut want = Vec::new();
            for r in 0..rows {
                let block = &data[r * lens[me] * cols..(r + 1) * lens[me] * cols];
                let pad = vec![-1.0f32; (max - lens[me]) * cols];
                if first {
                    want.extend_from_slice(&pad);
                    want.extend_from_slice(block);
                } else {
                    want.extend_from_slice(block);
                    want.extend_from_slice(&pad);
                }
            }
            compare("padded tensor", &out, &want, 0.0)
        },
    )
}

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
enum Shape {
    Point,
    Named { label: String, weights: Vec<f64> },
}

fn objects(ctx: &Ctx) -> Outcome {
    let me = ctx.rank();
    let mine: BTreeMap<String, (Vec<Option<u32>>, Shape)> = [(
        format!("rank-{me}"),
        (
            vec![Some(me as u32), None],
            if me.is_multiple_of(2) {
                Shape::Point
            } else {
                Shape::Named {
                    label: "é✓".into(),
                    weights: vec![0.5; me],
                }
            },
        ),
    )]
    .into();
    let got = match ctx.comm.gather_object(&mine) {
        Ok(g) => g,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    if got.len() != ctx.world_size() || got[me] != mine {
        return Outcome::Fail(format!(
            "gather_object gave {} values; mine came back as {:?}",
            got.len(),
            got.get(me)
        ));
    }
    let root = ctx.world_size() - 1;
    let b = match ctx
        .comm
        .broadcast_object((me == root).then_some(&mine), root)
    {
        Ok(b) => b,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    if b != got[root] {
        return Outcome::Fail("broadcast_object differs from the root's value".into());
    }
    Outcome::Pass
}
