//! The scenario library. Each scenario is a plain function over a [`Ctx`],
//! gated on declared capabilities.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use accel::{debug_communicator, CollectivesExt};
use accel_api::{
    Buf, BufMut, CommunicatorExt, DType, Element, ErrorKind, HostBuf, HostBufMut, Op, ReduceOp,
};
use proptest::prelude::*;
use proptest::sample::select;

use crate::data::{compare, input, tolerance, value_range};
use crate::prop::property;
use crate::{oracle, with_dtype, Ctx, Outcome};

/// One scenario: a name, a gate (`Some(reason)` = skip) and the body.
#[derive(Debug, Clone, Copy)]
pub struct Scenario {
    /// Unique snake_case name (also the stamped test's name).
    pub name: &'static str,
    /// `Some(reason)` when the backend does not declare what this needs.
    pub gate: fn(&Ctx) -> Option<String>,
    /// The scenario itself, run on every rank.
    pub run: fn(&Ctx) -> Outcome,
}

/// Every scenario, in the order the matrix lists them.
pub fn all_scenarios() -> Vec<Scenario> {
    let mut all = vec![
        Scenario {
            name: "all_reduce",
            gate: |c| needs(c, &[Op::AllReduce]),
            run: all_reduce,
        },
        Scenario {
            name: "reduce",
            gate: |c| needs(c, &[Op::Reduce]),
            run: reduce,
        },
        Scenario {
            name: "broadcast",
            gate: |c| needs(c, &[Op::Broadcast]),
            run: broadcast,
        },
        Scenario {
            name: "all_gather",
            gate: |c| needs(c, &[Op::AllGather]),
            run: all_gather,
        },
        Scenario {
            name: "gather",
            gate: |c| needs(c, &[Op::Gather]),
            run: gather,
        },
        Scenario {
            name: "scatter",
            gate: |c| needs(c, &[Op::Scatter]),
            run: scatter,
        },
        Scenario {
            name: "reduce_scatter",
            gate: |c| needs(c, &[Op::ReduceScatter]),
            run: reduce_scatter,
        },
        Scenario {
            name: "all_to_all",
            gate: |c| needs(c, &[Op::AllToAll]),
            run: all_to_all,
        },
        Scenario {
            name: "send_recv_ring",
            gate: |c| needs(c, &[Op::Send, Op::Recv]),
            run: send_recv_ring,
        },
        Scenario {
            name: "all_reduce_multi_mib",
            gate: |c| needs(c, &[Op::AllReduce]),
            run: all_reduce_multi_mib,
        },
        Scenario {
            name: "barrier_ordering",
            gate: |c| needs(c, &[Op::Barrier]),
            run: barrier_ordering,
        },
        Scenario {
            name: "split_subgroups",
            gate: |c| needs(c, &[Op::Split, Op::AllReduce, Op::AllGather]),
            run: split_subgroups,
        },
        Scenario {
            name: "varsize_gather",
            gate: |c| needs(c, &[Op::AllGather]),
            run: varsize_gather,
        },
        Scenario {
            name: "pad_across_processes",
            gate: |c| needs(c, &[Op::AllGather]),
            run: pad_across_processes,
        },
        Scenario {
            name: "objects",
            gate: |c| needs(c, &[Op::AllGather, Op::Broadcast]),
            run: objects,
        },
        Scenario {
            name: "undeclared_is_unsupported",
            gate: gate_undeclared,
            run: undeclared_is_unsupported,
        },
        Scenario {
            name: "invalid_arguments",
            gate: |c| needs(c, &[Op::Broadcast, Op::AllGather, Op::Barrier]),
            run: invalid_arguments,
        },
        Scenario {
            name: "missing_rank_times_out",
            gate: |c| needs_peers(c, &[Op::AllReduce]),
            run: missing_rank_times_out,
        },
        Scenario {
            name: "lost_rank_is_named",
            gate: |c| needs_peers(c, &[Op::AllReduce]),
            run: lost_rank_is_named,
        },
        Scenario {
            name: "debug_mismatch_table",
            gate: |c| needs_peers(c, &[Op::AllReduce, Op::Broadcast]),
            run: debug_mismatch_table,
        },
    ];
    all.extend(crate::train_scenarios::train_scenarios());
    all
}

fn needs(ctx: &Ctx, ops: &[Op]) -> Option<String> {
    let caps = ctx.comm.capabilities();
    ops.iter()
        .find(|op| !caps.supports(**op))
        .map(|op| format!("{op} not declared"))
}

fn needs_peers(ctx: &Ctx, ops: &[Op]) -> Option<String> {
    if ctx.world_size() < 2 {
        return Some("needs 2+ ranks".into());
    }
    needs(ctx, ops)
}

fn reduce_dtypes(ctx: &Ctx) -> Vec<DType> {
    ctx.comm
        .capabilities()
        .reduce_dtypes
        .iter()
        .copied()
        .collect()
}

fn move_dtypes(ctx: &Ctx) -> Vec<DType> {
    ctx.comm.capabilities().dtypes.iter().copied().collect()
}

fn reduce_ops(ctx: &Ctx) -> Vec<ReduceOp> {
    ctx.comm.capabilities().reduce_ops.iter().copied().collect()
}

/// Sizes: 0, 1, small primes, a few hundred.
fn sizes() -> impl Strategy<Value = usize> {
    prop_oneof![
        2 => select(vec![0usize, 1, 2, 3, 5, 7, 13, 31, 97, 257]),
        1 => 0usize..700,
    ]
}

fn err_text(e: accel_api::Error) -> String {
    e.to_string()
}

fn everyone<T: Element>(n: usize, seed: u64, len: usize, range: (i64, i64)) -> Vec<Vec<T>> {
    (0..n).map(|r| input::<T>(seed, r, len, range)).collect()
}

fn all_reduce(ctx: &Ctx) -> Outcome {
    let dts = reduce_dtypes(ctx);
    let ops = reduce_ops(ctx);
    if dts.is_empty() || ops.is_empty() {
        return Outcome::Skip("no reduce dtype/op declared".into());
    }
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
    let dts = reduce_dtypes(ctx);
    let ops = reduce_ops(ctx);
    if dts.is_empty() || ops.is_empty() {
        return Outcome::Skip("no reduce dtype/op declared".into());
    }
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
    let dts = reduce_dtypes(ctx);
    let ops = reduce_ops(ctx);
    if dts.is_empty() || ops.is_empty() {
        return Outcome::Skip("no reduce dtype/op declared".into());
    }
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

fn gate_undeclared(ctx: &Ctx) -> Option<String> {
    let caps = ctx.comm.capabilities();
    if caps.supports(Op::AllReduce) && caps.reduce_dtypes.len() == DType::ALL.len() {
        Some("every dtype is declared for reductions".into())
    } else {
        None
    }
}

/// Calls outside the declared capabilities must return Unsupported on every
/// rank before any communication (so they cannot hang).
fn undeclared_is_unsupported(ctx: &Ctx) -> Outcome {
    let caps = ctx.comm.capabilities().clone();
    for dt in DType::ALL {
        if caps.supports(Op::AllReduce) && caps.reduce_dtypes.contains(&dt) {
            continue;
        }
        let r = with_dtype!(dt, T => {
            let mut v = vec![<T as bytemuck::Zeroable>::zeroed(); 3];
            ctx.comm.all_reduce_slice(&mut v, ReduceOp::Sum)
        });
        match r {
            Err(e) if matches!(e.kind(), ErrorKind::Unsupported) => {}
            Err(e) => {
                return Outcome::Fail(format!(
                    "all_reduce on undeclared {dt}: expected Unsupported, got {e}"
                ))
            }
            Ok(()) => return Outcome::Fail(format!("all_reduce on undeclared {dt} succeeded")),
        }
    }
    match ctx.comm.barrier() {
        Ok(()) => Outcome::Pass,
        Err(e) => Outcome::Fail(format!("communicator unusable after Unsupported: {e}")),
    }
}

/// Bad roots and lengths are InvalidArgument on every rank, before any
/// communication; the communicator stays usable.
fn invalid_arguments(ctx: &Ctx) -> Outcome {
    let n = ctx.world_size();
    let mut v = vec![1u8; 4];
    match ctx.comm.broadcast_slice(&mut v, n) {
        Err(e)
            if matches!(e.kind(), ErrorKind::InvalidArgument)
                && e.to_string().contains(&n.to_string()) => {}
        other => {
            return Outcome::Fail(format!(
                "broadcast from root {n}: expected InvalidArgument naming it, got {other:?}"
            ))
        }
    }
    let send = [1i32, 2];
    let mut recv = vec![0i32; 2 * n + 1];
    match ctx.comm.all_gather(
        Buf::Host(HostBuf::from(&send[..])),
        BufMut::Host(HostBufMut::from(&mut recv[..])),
    ) {
        Err(e) if matches!(e.kind(), ErrorKind::InvalidArgument) => {}
        other => {
            return Outcome::Fail(format!(
            "all_gather into a buffer of the wrong length: expected InvalidArgument, got {other:?}"
        ))
        }
    }
    match ctx.comm.barrier() {
        Ok(()) => Outcome::Pass,
        Err(e) => Outcome::Fail(format!("communicator unusable after InvalidArgument: {e}")),
    }
}

const SHORT: Duration = Duration::from_secs(2);
const SLACK: Duration = Duration::from_secs(20);

/// The last rank never enters the collective: the others get Timeout (or
/// PeerLost) within the bound, naming the operation.
fn missing_rank_times_out(ctx: &Ctx) -> Outcome {
    let comm = match ctx.fresh_comm("missing", SHORT) {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("fresh connect: {e}")),
    };
    let n = ctx.world_size();
    let done = |r: usize| format!("missing/done/{r}");
    if ctx.rank() == n - 1 {
        // Stay connected (not dead, just absent) until the others gave up.
        let keys: Vec<String> = (0..n - 1).map(done).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let _ = ctx.store.wait(&refs, SHORT + SLACK + SLACK);
        drop(comm);
        return Outcome::Pass;
    }
    let start = Instant::now();
    let r = comm.all_reduce_slice(&mut [1.0f32; 8], ReduceOp::Sum);
    let took = start.elapsed();
    let _ = ctx.store.set(&done(ctx.rank()), b"1");
    match r {
        Ok(()) => Outcome::Fail("all_reduce completed without the last rank".into()),
        Err(e) if took > SHORT + SLACK => {
            Outcome::Fail(format!("took {took:?} (bound {SHORT:?}): {e}"))
        }
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Timeout { .. } | ErrorKind::PeerLost { .. }
            ) =>
        {
            if e.to_string().contains("all_reduce") {
                Outcome::Pass
            } else {
                Outcome::Fail(format!("error does not name the op: {e}"))
            }
        }
        Err(e) => Outcome::Fail(format!("expected Timeout, got {e}")),
    }
}

/// The last rank drops its communicator (its sockets close, as when a process
/// dies): the others fail within the bound with PeerLost naming it (or a
/// Timeout), and every later call is Poisoned.
fn lost_rank_is_named(ctx: &Ctx) -> Outcome {
    let comm = match ctx.fresh_comm("lost", SHORT) {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("fresh connect: {e}")),
    };
    let n = ctx.world_size();
    let lost = n - 1;
    if ctx.rank() == lost {
        drop(comm);
        return Outcome::Pass;
    }
    let start = Instant::now();
    let r = comm.all_reduce_slice(&mut [1i64; 1024], ReduceOp::Sum);
    let took = start.elapsed();
    let first = match r {
        Ok(()) => return Outcome::Fail("all_reduce completed without the lost rank".into()),
        Err(e) => e,
    };
    if took > SHORT + SLACK {
        return Outcome::Fail(format!("took {took:?}: {first}"));
    }
    match first.kind() {
        ErrorKind::PeerLost { peer: Some(p) } if *p != lost && n == 2 => {
            return Outcome::Fail(format!("named rank {p}, but rank {lost} was lost: {first}"))
        }
        ErrorKind::PeerLost { .. } | ErrorKind::Timeout { .. } => {}
        _ => return Outcome::Fail(format!("expected PeerLost or Timeout, got {first}")),
    }
    match comm.barrier() {
        Err(e) if matches!(e.kind(), ErrorKind::Poisoned) => Outcome::Pass,
        other => Outcome::Fail(format!(
            "call after the failure: expected Poisoned, got {other:?}"
        )),
    }
}

/// Debug mode: rank 0 broadcasts while the others all-reduce. Every rank
/// gets Mismatch with one row per rank, instead of a hang.
fn debug_mismatch_table(ctx: &Ctx) -> Outcome {
    let comm = match ctx.fresh_comm("debug", Duration::from_secs(10)) {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("fresh connect: {e}")),
    };
    let store = std::sync::Arc::new(accel_rendezvous::PrefixStore::new(
        ctx.store.clone(),
        "debug-mismatch",
    ));
    let dbg = debug_communicator(comm, store);
    let mut v = vec![1.0f32; 16];
    if let Err(e) = dbg.all_reduce_slice(&mut v, ReduceOp::Sum) {
        return Outcome::Fail(format!("matching call failed: {e}"));
    }
    let r = if ctx.rank() == 0 {
        dbg.broadcast_slice(&mut v, 0)
    } else {
        dbg.all_reduce_slice(&mut v, ReduceOp::Sum)
    };
    match r {
        Err(e) => match e.kind() {
            ErrorKind::Mismatch { table }
                if table.len() == ctx.world_size() && table.iter().all(|t| t.call.is_some()) =>
            {
                let s = e.to_string();
                if s.contains("broadcast") && s.contains("all_reduce") {
                    Outcome::Pass
                } else {
                    Outcome::Fail(format!("table does not show both calls: {s}"))
                }
            }
            _ => Outcome::Fail(format!(
                "expected Mismatch with {} rows, got {e}",
                ctx.world_size()
            )),
        },
        Ok(()) => Outcome::Fail("mismatched collectives succeeded".into()),
    }
}
