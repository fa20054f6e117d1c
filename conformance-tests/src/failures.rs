//! Failure behaviour: undeclared calls, bad arguments, a missing rank, a
//! lost rank, mismatched calls (the group's call check, without debug
//! mode), and debug mode's mismatch table.

use std::time::{Duration, Instant};

use accel::debug_communicator;
use accel_api::{
    Buf, BufMut, CommunicatorExt, DType, ErrorKind, HostBuf, HostBufMut, Op, ReduceOp,
};

use crate::ctx::*;
use crate::with_dtype;

/// This area's scenarios, in the order the matrix lists them.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![
        undeclared_is_unsupported: gate_undeclared,
        invalid_arguments: |c| needs(c, &[Op::Broadcast, Op::AllGather, Op::Barrier]),
        missing_rank_times_out: |c| needs_peers(c, &[Op::AllReduce]),
        lost_rank_is_named: |c| needs_peers(c, &[Op::AllReduce]),
        mismatched_lengths_fail: gate_mismatch,
        mismatched_reductions_fail: gate_mismatch,
        mismatched_dtypes_fail: |c| {
            gate_mismatch(c).or_else(|| {
                (reduce_dtypes(c).len() < 2).then(|| "needs two reduce dtypes".into())
            })
        },
        mismatched_kinds_fail: |c| gate_mismatch(c).or_else(|| needs(c, &[Op::Broadcast])),
        debug_mismatch_table: |c| needs_peers(c, &[Op::AllReduce, Op::Broadcast]),
    ]
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

pub(crate) const SHORT: Duration = Duration::from_secs(2);
pub(crate) const SLACK: Duration = Duration::from_secs(20);

/// On the rank a scenario leaves absent (connected, never calling): wait
/// until every other rank set `<prefix>/done/<rank>`, at most long enough
/// for them to time out.
pub(crate) fn stay_absent(ctx: &Ctx, prefix: &str) {
    let keys: Vec<String> = (0..ctx.world_size() - 1)
        .map(|r| format!("{prefix}/done/{r}"))
        .collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let _ = ctx.store.wait(&refs, SHORT + SLACK + SLACK);
}

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
        stay_absent(ctx, "missing");
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

fn gate_mismatch(ctx: &Ctx) -> Option<String> {
    if matches!(
        accel_api::CallCheck::from_env(),
        Ok(accel_api::CallCheck::Off)
    ) {
        return Some("ACCEL_CHECK_CALLS=0 turns the call check off".into());
    }
    needs_peers(ctx, &[Op::AllReduce]).or_else(|| {
        (!reduce_dtypes(ctx).contains(&DType::F32)).then(|| "needs f32 reductions".into())
    })
}

/// Without debug mode, the ranks of a fresh communicator make a mismatched
/// call (`call(rank, comm)`): every rank gets `Mismatch` naming `what`
/// (`length`, ...) within the bound, never a crash, a hang or `Ok`.
fn expect_mismatch(
    ctx: &Ctx,
    name: &str,
    what: &str,
    call: impl Fn(usize, &dyn accel_api::Communicator) -> accel_api::Result<()>,
) -> Outcome {
    let comm = match ctx.fresh_comm(name, SHORT) {
        Ok(c) => c,
        Err(e) => return Outcome::Fail(format!("fresh connect: {e}")),
    };
    let start = Instant::now();
    let r = call(ctx.rank(), &*comm);
    let took = start.elapsed();
    match r {
        Ok(()) => Outcome::Fail(format!("a call with mismatched {what} returned Ok")),
        Err(e) if took > SHORT + SLACK => {
            Outcome::Fail(format!("took {took:?} (bound {SHORT:?}): {e}"))
        }
        Err(e) => match e.kind() {
            ErrorKind::Mismatch { table }
                if table.len() == ctx.world_size() && e.to_string().contains(what) =>
            {
                match comm.barrier() {
                    Err(p) if matches!(p.kind(), ErrorKind::Poisoned) => Outcome::Pass,
                    other => Outcome::Fail(format!(
                        "call after the mismatch: expected Poisoned, got {other:?}"
                    )),
                }
            }
            _ => Outcome::Fail(format!(
                "expected Mismatch naming `{what}` with {} rows, got {e}",
                ctx.world_size()
            )),
        },
    }
}

/// Rank r passes 10 + r elements (10 against 11 on two ranks: Gloo's
/// transport aborts the process, MPI reads past a buffer, without the check).
fn mismatched_lengths_fail(ctx: &Ctx) -> Outcome {
    expect_mismatch(
        ctx,
        "mismatch-len",
        "length (10 on rank 0; 11 on rank 1",
        |r, c| c.all_reduce_slice(&mut vec![1.0f32; 10 + r], ReduceOp::Sum),
    )
}

/// Rank 0 sums, the others take the maximum.
fn mismatched_reductions_fail(ctx: &Ctx) -> Outcome {
    let other = if ctx.comm.capabilities().reduce_ops.contains(&ReduceOp::Max) {
        ReduceOp::Max
    } else {
        ReduceOp::Prod
    };
    let want = format!("reduction (sum on rank 0; {} on rank", other.name());
    expect_mismatch(ctx, "mismatch-op", &want, |r, c| {
        let op = if r == 0 { ReduceOp::Sum } else { other };
        c.all_reduce_slice(&mut [3.0f32; 4], op)
    })
}

/// Rank 0 reduces f32, the others another declared reduce dtype.
fn mismatched_dtypes_fail(ctx: &Ctx) -> Outcome {
    let Some(&other) = reduce_dtypes(ctx).iter().find(|&&d| d != DType::F32) else {
        return Outcome::Fail("no second reduce dtype (the gate should have skipped)".into());
    };
    let want = format!("element type (f32 on rank 0; {other} on rank");
    expect_mismatch(ctx, "mismatch-dtype", &want, |r, c| {
        if r == 0 {
            c.all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum)
        } else {
            with_dtype!(other, T => {
                let mut v = vec![<T as bytemuck::Zeroable>::zeroed(); 4];
                c.all_reduce_slice(&mut v, ReduceOp::Sum)
            })
        }
    })
}

/// Rank 0 broadcasts while the others all-reduce (mpi returned the root's
/// data as the sum without the check).
fn mismatched_kinds_fail(ctx: &Ctx) -> Outcome {
    expect_mismatch(
        ctx,
        "mismatch-kind",
        "operation (broadcast on rank 0; all_reduce on rank",
        |r, c| {
            let mut v = [7.0f32; 4];
            if r == 0 {
                c.broadcast_slice(&mut v, 0)
            } else {
                c.all_reduce_slice(&mut v, ReduceOp::Sum)
            }
        },
    )
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
