//! Every collective and point-to-point operation as a property against the
//! oracle, plus barrier ordering and split.

use std::time::Duration;

use accel_api::{BufMut, CommunicatorExt, Op, ReduceOp};
use proptest::prelude::*;
use proptest::sample::select;

use crate::ctx::*;
use crate::data::{compare, input, tolerance, value_range};
use crate::prop::property;
use crate::{oracle, with_dtype};

/// This area's scenarios, in the order the matrix lists them.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![
        all_reduce: |c| needs(c, &[Op::AllReduce]),
        reduce: |c| needs(c, &[Op::Reduce]),
        broadcast: |c| needs(c, &[Op::Broadcast]),
        all_gather: |c| needs(c, &[Op::AllGather]),
        gather: |c| needs(c, &[Op::Gather]),
        scatter: |c| needs(c, &[Op::Scatter]),
        reduce_scatter: |c| needs(c, &[Op::ReduceScatter]),
        all_to_all: |c| needs(c, &[Op::AllToAll]),
        send_recv_ring: |c| needs(c, &[Op::Send, Op::Recv]),
        all_reduce_multi_mib: |c| needs(c, &[Op::AllReduce]),
        barrier_ordering: |c| needs(c, &[Op::Barrier]),
        split_subgroups: |c| needs(c, &[Op::Split, Op::AllReduce, Op::AllGather]),
    ]
}

/// The reduce dtypes and ops the communicator declares; `None` when it
/// declares no dtype or no op.
fn declared_reductions(ctx: &Ctx) -> Option<(Vec<accel_api::DType>, Vec<ReduceOp>)> {
    let (dts, ops) = (reduce_dtypes(ctx), reduce_ops(ctx));
    (!dts.is_empty() && !ops.is_empty()).then_some((dts, ops))
}

fn all_reduce(ctx: &Ctx) -> Outcome {
    let Some((dts, ops)) = declared_reductions(ctx) else {
        return Outcome::Skip("no reduce dtype/op declared".into());
    };
    let strat = (
        select(dts),
        select(ops),
        sizes(),
        any::<u64>(),
        any::<bool>(),
    );
    property(
        ctx,
        "all_reduce",
        strat,
        |&(dt, op, len, seed, in_place)| {
            with_dtype!(dt, T => {
                let all = everyone::<T>(ctx.world_size(), seed, len, value_range(dt, Some(op)));
                let want = oracle::reduce(&all, op, dt.is_float());
                let got = if in_place {
                    let mut mine = all[ctx.rank()].clone();
                    ctx.comm.all_reduce_slice(&mut mine, op).map_err(err_text)?;
                    mine
                } else {
                    let got = ctx.comm.all_reduce_vec(&all[ctx.rank()], op).map_err(err_text)?;
                    compare("input after out-of-place all_reduce", &all[ctx.rank()], &input::<T>(seed, ctx.rank(), len, value_range(dt, Some(op))), 0.0)?;
                    got
                };
                compare(&format!("all_reduce {op} {dt}"), &got, &want, tolerance(dt))
            })
        },
    )
}

fn reduce(ctx: &Ctx) -> Outcome {
    let Some((dts, ops)) = declared_reductions(ctx) else {
        return Outcome::Skip("no reduce dtype/op declared".into());
    };
    let n = ctx.world_size();
    let strat = (select(dts), select(ops), sizes(), 0..n, any::<u64>());
    property(ctx, "reduce", strat, |&(dt, op, len, root, seed)| {
        with_dtype!(dt, T => {
            let all = everyone::<T>(n, seed, len, value_range(dt, Some(op)));
            let mut mine = all[ctx.rank()].clone();
            ctx.comm.reduce(BufMut::from(&mut mine[..]), op, root).map_err(err_text)?;
            if ctx.rank() == root {
                compare(&format!("reduce {op} {dt} at root {root}"), &mine, &oracle::reduce(&all, op, dt.is_float()), tolerance(dt))?;
            }
            Ok(())
        })
    })
}

fn broadcast(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (select(move_dtypes(ctx)), sizes(), 0..n, any::<u64>());
    property(ctx, "broadcast", strat, |&(dt, len, root, seed)| {
        with_dtype!(dt, T => {
            let all = everyone::<T>(n, seed, len, value_range(dt, None));
            let mut mine = all[ctx.rank()].clone();
            ctx.comm.broadcast_slice(&mut mine, root).map_err(err_text)?;
            compare(&format!("broadcast {dt} from {root}"), &mine, &all[root], 0.0)
        })
    })
}

fn all_gather(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (select(move_dtypes(ctx)), sizes(), any::<u64>());
    property(ctx, "all_gather", strat, |&(dt, len, seed)| {
        with_dtype!(dt, T => {
            let all = everyone::<T>(n, seed, len, value_range(dt, None));
            let got = ctx.comm.all_gather_vec(&all[ctx.rank()]).map_err(err_text)?;
            compare(&format!("all_gather {dt}"), &got, &oracle::concat(&all), 0.0)
        })
    })
}

fn gather(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (select(move_dtypes(ctx)), sizes(), 0..n, any::<u64>());
    property(ctx, "gather", strat, |&(dt, len, root, seed)| {
        with_dtype!(dt, T => {
            let all = everyone::<T>(n, seed, len, value_range(dt, None));
            match ctx.comm.gather_vec(&all[ctx.rank()], root).map_err(err_text)? {
                Some(got) if ctx.rank() == root => compare(&format!("gather {dt} to {root}"), &got, &oracle::concat(&all), 0.0),
                None if ctx.rank() != root => Ok(()),
                _ => Err("gather returned data on the wrong rank".into()),
            }
        })
    })
}

fn scatter(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (select(move_dtypes(ctx)), sizes(), 0..n, any::<u64>());
    property(ctx, "scatter", strat, |&(dt, chunk, root, seed)| {
        with_dtype!(dt, T => {
            let src = input::<T>(seed, root, chunk * n, value_range(dt, None));
            let send = (ctx.rank() == root).then_some(&src[..]);
            let got = ctx.comm.scatter_vec(send, chunk, root).map_err(err_text)?;
            compare(&format!("scatter {dt} from {root}"), &got, &oracle::chunk(&src, n, ctx.rank()), 0.0)
        })
    })
}

fn reduce_scatter(ctx: &Ctx) -> Outcome {
    let Some((dts, ops)) = declared_reductions(ctx) else {
        return Outcome::Skip("no reduce dtype/op declared".into());
    };
    let n = ctx.world_size();
    let strat = (select(dts), select(ops), sizes(), any::<u64>());
    property(ctx, "reduce_scatter", strat, |&(dt, op, chunk, seed)| {
        with_dtype!(dt, T => {
            let all = everyone::<T>(n, seed, chunk * n, value_range(dt, Some(op)));
            let got = ctx.comm.reduce_scatter_vec(&all[ctx.rank()], op).map_err(err_text)?;
            let full = oracle::reduce(&all, op, dt.is_float());
            compare(&format!("reduce_scatter {op} {dt}"), &got, &oracle::chunk(&full, n, ctx.rank()), tolerance(dt))
        })
    })
}

fn all_to_all(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (select(move_dtypes(ctx)), sizes(), any::<u64>());
    property(ctx, "all_to_all", strat, |&(dt, chunk, seed)| {
        with_dtype!(dt, T => {
            let all = everyone::<T>(n, seed, chunk * n, value_range(dt, None));
            let got = ctx.comm.all_to_all_vec(&all[ctx.rank()]).map_err(err_text)?;
            compare(&format!("all_to_all {dt}"), &got, &oracle::all_to_all(&all, ctx.rank()), 0.0)
        })
    })
}

fn send_recv_ring(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let strat = (select(move_dtypes(ctx)), sizes(), 0u32..1000, any::<u64>());
    property(ctx, "send_recv_ring", strat, |&(dt, len, tag, seed)| {
        with_dtype!(dt, T => {
            let me = ctx.rank();
            let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
            let mine = input::<T>(seed, me, len, value_range(dt, None));
            let mut got = vec![<T as bytemuck::Zeroable>::zeroed(); len];
            // Even ranks send first, odd ranks receive first: no rank relies
            // on buffering (sends to self, at world size 1, are buffered).
            if me.is_multiple_of(2) || n == 1 {
                ctx.comm.send_slice(&mine, next, tag).map_err(err_text)?;
                ctx.comm.recv_slice(&mut got, prev, tag).map_err(err_text)?;
            } else {
                ctx.comm.recv_slice(&mut got, prev, tag).map_err(err_text)?;
                ctx.comm.send_slice(&mine, next, tag).map_err(err_text)?;
            }
            compare(&format!("recv {dt} from {prev}"), &got, &input::<T>(seed, prev, len, value_range(dt, None)), 0.0)
        })
    })
}

fn all_reduce_multi_mib(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let len = (4 << 20) / 4 + 3; // 4 MiB of f32, not a multiple of anything
    let all = everyone::<f32>(n, 7, len, (-15, 15));
    let mut mine = all[ctx.rank()].clone();
    if let Err(e) = ctx.comm.all_reduce_slice(&mut mine, ReduceOp::Sum) {
        return Outcome::Fail(e.to_string());
    }
    match compare(
        "4 MiB f32 all_reduce sum",
        &mine,
        &oracle::reduce(&all, ReduceOp::Sum, true),
        0.0,
    ) {
        Ok(()) => Outcome::Pass,
        Err(m) => Outcome::Fail(m),
    }
}

fn barrier_ordering(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    for round in 0..3 {
        // The last rank arrives late: nobody may leave before it arrived.
        if ctx.rank() == n - 1 {
            std::thread::sleep(Duration::from_millis(150));
        }
        let key = format!("barrier/{round}/{}", ctx.rank());
        if let Err(e) = ctx.store.set(&key, b"arrived") {
            return Outcome::Fail(e.to_string());
        }
        if let Err(e) = ctx.comm.barrier() {
            return Outcome::Fail(e.to_string());
        }
        for r in 0..n {
            match ctx.store.try_get(&format!("barrier/{round}/{r}")) {
                Ok(Some(_)) => {}
                _ => {
                    return Outcome::Fail(format!(
                        "round {round}: left the barrier before rank {r} arrived"
                    ))
                }
            }
        }
    }
    Outcome::Pass
}

fn split_subgroups(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let me = ctx.rank();
    // Rank 0 opts out when there are 3+ ranks; the rest split by parity,
    // ordered by descending old rank.
    let color = if n >= 3 && me == 0 {
        None
    } else {
        Some((me % 2) as u32)
    };
    let key = (n - me) as u32;
    let sub = match ctx.comm.split(color, key) {
        Ok(s) => s,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    let Some(color) = color else {
        return if sub.is_none() {
            Outcome::Pass
        } else {
            Outcome::Fail("color None got a communicator".into())
        };
    };
    let Some(sub) = sub else {
        return Outcome::Fail("split returned no communicator".into());
    };
    let mut members: Vec<usize> = (0..n)
        .filter(|&r| !(n >= 3 && r == 0) && (r % 2) as u32 == color)
        .collect();
    members.sort_by_key(|&r| std::cmp::Reverse(r));
    let want_rank = members.iter().position(|&r| r == me).expect("member");
    if sub.world_size() != members.len() || sub.rank() != want_rank {
        return Outcome::Fail(format!(
            "sub-group rank {}/{} expected {want_rank}/{}",
            sub.rank(),
            sub.world_size(),
            members.len()
        ));
    }
    if sub.timeout() != ctx.comm.timeout() {
        return Outcome::Fail("sub-group did not inherit the timeout".into());
    }
    let got = match sub.all_gather_vec(&[me as i64]) {
        Ok(v) => v,
        Err(e) => return Outcome::Fail(e.to_string()),
    };
    let want: Vec<i64> = members.iter().map(|&r| r as i64).collect();
    if got != want {
        return Outcome::Fail(format!(
            "sub-group all_gather gave {got:?}, expected {want:?}"
        ));
    }
    let mut s = vec![me as i32 + 1];
    if let Err(e) = sub.all_reduce_slice(&mut s, ReduceOp::Sum) {
        return Outcome::Fail(e.to_string());
    }
    let want_sum: i32 = members.iter().map(|&r| r as i32 + 1).sum();
    if s[0] != want_sum {
        return Outcome::Fail(format!("sub-group sum {} expected {want_sum}", s[0]));
    }
    Outcome::Pass
}
