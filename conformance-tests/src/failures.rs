//! Failure behaviour: undeclared calls, bad arguments, a missing rank, a
//! lost rank, and debug mode's mismatch table.

use std::time::{Duration, Instant};

use accel::debug_communicator;
use accel_api::{
    Buf, BufMut, CommunicatorExt, DType, ErrorKind, HostBuf, HostBufMut, Op, ReduceOp,
};

use crate::ctx::*;
use crate::with_dtype;

/// This area's scenarios, in the order the matrix lists them.
pub(crate) fn scenarios() -> Vec<Scenario> {
    vec![
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
