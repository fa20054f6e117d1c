//! The "async" family: calls started without waiting
//! ([`StartExt`](accel_api::StartExt)): many handles of mixed operations in
//! flight, completion in issue order (blocking calls included), a handle
//! that times out, dropped and leaked handles, and a mismatch found after
//! the calls were started.

use std::time::{Duration, Instant};

use accel_api::{CommunicatorExt, ErrorKind, Op, ReduceOp, StartExt};

use crate::ctx::*;
use crate::data::compare;
use crate::failures::{stay_absent, SHORT, SLACK};
use crate::oracle;

/// This area's scenarios, in the order the matrix lists them.
pub(crate) fn scenarios() -> Vec<Scenario> {
    scenarios![
        async_mixed_in_flight: |c| needs(c, &[Op::AllReduce, Op::Broadcast, Op::AllGather]),
        async_issue_order: |c| needs(c, &[Op::AllReduce, Op::Broadcast]),
        async_handle_timeout: |c| needs_peers(c, &[Op::AllReduce]),
        async_dropped_handles: |c| needs(c, &[Op::AllReduce]),
        async_mismatch: gate_async_mismatch,
    ]
}

/// Integer-valued f32 data (exact under every reduction): rank `r`'s input
/// number `k` of `len` elements.
fn data(r: usize, k: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((r * 31 + k * 17 + i * 7) % 11) as f32 - 5.0)
        .collect()
}

fn all(n: usize, k: usize, len: usize) -> Vec<Vec<f32>> {
    (0..n).map(|r| data(r, k, len)).collect()
}

fn fail(what: &str, e: accel_api::Error) -> Outcome {
    Outcome::Fail(format!("{what}: {e}"))
}

fn verdict(checks: Vec<Result<(), String>>) -> Outcome {
    match checks.into_iter().find_map(Result::err) {
        Some(m) => Outcome::Fail(m),
        None => Outcome::Pass,
    }
}

/// Every declared operation started at once (all-reduce, broadcast,
/// all-gather, reduce-scatter, all-to-all, barrier, a second all-reduce,
/// a point-to-point pair), then waited for in reverse order: each result
/// equals the oracle's.
fn async_mixed_in_flight(ctx: &Ctx) -> Outcome {
    match mixed(ctx) {
        Ok(o) => o,
        Err(e) => fail("start", e),
    }
}

fn mixed(ctx: &Ctx) -> accel_api::Result<Outcome> {
    let (n, me, c) = (ctx.world_size(), ctx.rank(), &*ctx.comm);
    let caps = c.capabilities().clone();
    let len = 4 * n; // a multiple of n
    let root = n - 1;
    let ar = c.start_all_reduce(data(me, 0, len), ReduceOp::Sum)?;
    let bc_in = if me == root {
        data(root, 1, len)
    } else {
        vec![0.0; len]
    };
    let bc = c.start_broadcast(bc_in, root)?;
    let ag = c.start_all_gather(data(me, 2, len), vec![0.0f32; len * n])?;
    let rs = if caps.supports(Op::ReduceScatter) {
        Some(c.start_reduce_scatter(data(me, 3, len), vec![0.0f32; len / n], ReduceOp::Sum)?)
    } else {
        None
    };
    let a2a = if caps.supports(Op::AllToAll) {
        Some(c.start_all_to_all(data(me, 4, len), vec![0.0f32; len])?)
    } else {
        None
    };
    let bar = if caps.supports(Op::Barrier) {
        Some(c.start_barrier()?)
    } else {
        None
    };
    let max = if caps.reduce_ops.contains(&ReduceOp::Max) {
        ReduceOp::Max
    } else {
        ReduceOp::Sum
    };
    let ar2 = c.start_all_reduce(data(me, 5, len + 3), max)?;
    // A pair exchange: even ranks send first, odd ranks receive first (no
    // rank relies on buffering, as with blocking calls).
    let peer = me ^ 1;
    let p2p = if n > 1 && peer < n && caps.supports(Op::Send) && caps.supports(Op::Recv) {
        let (s, r) = if me.is_multiple_of(2) {
            let s = c.start_send(data(me, 6, 5), peer, 9)?;
            (s, c.start_recv(vec![0.0f32; 5], peer, 9)?)
        } else {
            let r = c.start_recv(vec![0.0f32; 5], peer, 9)?;
            (c.start_send(data(me, 6, 5), peer, 9)?, r)
        };
        Some((s, r))
    } else {
        None
    };

    let mut checks = Vec::new();
    if let Some((s, r)) = p2p {
        checks.push(
            r.wait()
                .map_err(|e| e.to_string())
                .and_then(|got| compare("recv from the pair", &got, &data(peer, 6, 5), 0.0)),
        );
        checks.push(s.wait().map(drop).map_err(|e| e.to_string()));
    }
    let want2 = oracle::reduce(&all(n, 5, len + 3), max, true);
    checks.push(
        ar2.wait()
            .map_err(|e| e.to_string())
            .and_then(|got| compare(&format!("all_reduce {max}"), &got, &want2, 0.0)),
    );
    if let Some(b) = bar {
        checks.push(b.wait().map_err(|e| e.to_string()));
    }
    if let Some(w) = a2a {
        checks.push(w.wait().map_err(|e| e.to_string()).and_then(|(_, got)| {
            compare(
                "all_to_all",
                &got,
                &oracle::all_to_all(&all(n, 4, len), me),
                0.0,
            )
        }));
    }
    if let Some(w) = rs {
        let full = oracle::reduce(&all(n, 3, len), ReduceOp::Sum, true);
        checks.push(w.wait().map_err(|e| e.to_string()).and_then(|(_, got)| {
            compare("reduce_scatter", &got, &oracle::chunk(&full, n, me), 0.0)
        }));
    }
    checks.push(
        ag.wait().map_err(|e| e.to_string()).and_then(|(_, got)| {
            compare("all_gather", &got, &oracle::concat(&all(n, 2, len)), 0.0)
        }),
    );
    checks.push(
        bc.wait()
            .map_err(|e| e.to_string())
            .and_then(|got| compare("broadcast", &got, &data(root, 1, len), 0.0)),
    );
    let want = oracle::reduce(&all(n, 0, len), ReduceOp::Sum, true);
    checks.push(
        ar.wait()
            .map_err(|e| e.to_string())
            .and_then(|got| compare("all_reduce sum", &got, &want, 0.0)),
    );
    Ok(verdict(checks))
}

/// Calls complete in issue order: once the last of eight started calls
/// (largest first) is done, every earlier one is; a blocking call issued
/// after a started one returns after it completed; a started call issued
/// after a blocking one sees its result.
fn async_issue_order(ctx: &Ctx) -> Outcome {
    let (n, me, c) = (ctx.world_size(), ctx.rank(), &*ctx.comm);
    let sizes = [1 << 18, 1 << 14, 4096, 1 << 16, 7, 1, 300, 2];
    let mut works = Vec::new();
    for (k, &len) in sizes.iter().enumerate() {
        match c.start_all_reduce(data(me, 10 + k, len), ReduceOp::Sum) {
            Ok(w) => works.push(w),
            Err(e) => return fail("start", e),
        }
    }
    let last = works.pop().expect("eight calls");
    let last_len = sizes[sizes.len() - 1];
    match last.wait() {
        Ok(got) => {
            let want = oracle::reduce(&all(n, 17, last_len), ReduceOp::Sum, true);
            if let Err(m) = compare("the last started all_reduce", &got, &want, 0.0) {
                return Outcome::Fail(m);
            }
        }
        Err(e) => return fail("the last started all_reduce", e),
    }
    if let Some(i) = works.iter().position(|w| !w.is_done()) {
        return Outcome::Fail(format!(
            "call {i} (issued before the last) is not done after the last completed"
        ));
    }
    for (k, w) in works.into_iter().enumerate() {
        let want = oracle::reduce(&all(n, 10 + k, sizes[k]), ReduceOp::Sum, true);
        match w.wait() {
            Ok(got) => {
                if let Err(m) = compare(&format!("started all_reduce {k}"), &got, &want, 0.0) {
                    return Outcome::Fail(m);
                }
            }
            Err(e) => return fail(&format!("started all_reduce {k}"), e),
        }
    }
    // A blocking call after a started one.
    let big = match c.start_all_reduce(data(me, 20, 1 << 18), ReduceOp::Sum) {
        Ok(w) => w,
        Err(e) => return fail("start", e),
    };
    let mut v = data(n - 1, 21, 64);
    if let Err(e) = c.broadcast_slice(&mut v, n - 1) {
        return fail("blocking broadcast after a started all_reduce", e);
    }
    if !big.is_done() {
        return Outcome::Fail(
            "a blocking broadcast returned before the all_reduce started earlier completed".into(),
        );
    }
    if let Err(e) = big.wait() {
        return fail("started all_reduce", e);
    }
    // A started call after a blocking one.
    let mut v = data(me, 22, 33);
    if let Err(e) = c.all_reduce_slice(&mut v, ReduceOp::Sum) {
        return fail("blocking all_reduce", e);
    }
    match c.start_broadcast(if me == 0 { v.clone() } else { vec![0.0; 33] }, 0) {
        Ok(w) => match w.wait() {
            Ok(got) => verdict(vec![compare(
                "a broadcast of a blocking all_reduce's result",
                &got,
                &oracle::reduce(&all(n, 22, 33), ReduceOp::Sum, true),
                0.0,
            )]),
            Err(e) => fail("started broadcast", e),
        },
        Err(e) => fail("start", e),
    }
}

/// The last rank never issues the call: on the others the handle is not
/// done after a short wait, and `wait` returns Timeout (or PeerLost)
/// within the bound, naming the operation with its sequence number.
fn async_handle_timeout(ctx: &Ctx) -> Outcome {
    let comm = match ctx.fresh_comm("async-missing", SHORT) {
        Ok(c) => c,
        Err(e) => return fail("fresh connect", e),
    };
    let n = ctx.world_size();
    let done = |r: usize| format!("async-missing/done/{r}");
    if ctx.rank() == n - 1 {
        stay_absent(ctx, "async-missing");
        drop(comm);
        return Outcome::Pass;
    }
    let start = Instant::now();
    let w = match comm.start_all_reduce(vec![1.0f32; 8], ReduceOp::Sum) {
        Ok(w) => w,
        Err(e) => return fail("start", e),
    };
    if w.wait_timeout(Duration::from_millis(200)) {
        let _ = ctx.store.set(&done(ctx.rank()), b"1");
        return Outcome::Fail("the handle completed without the last rank".into());
    }
    let r = w.wait();
    let took = start.elapsed();
    let _ = ctx.store.set(&done(ctx.rank()), b"1");
    match r {
        Ok(_) => Outcome::Fail("all_reduce completed without the last rank".into()),
        Err(e) if took > SHORT + SLACK => Outcome::Fail(format!("took {took:?}: {e}")),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Timeout { .. } | ErrorKind::PeerLost { .. }
            ) =>
        {
            let text = e.to_string();
            if text.contains("all_reduce#0") && text.contains(&format!("rank {}", ctx.rank())) {
                Outcome::Pass
            } else {
                Outcome::Fail(format!(
                    "the error does not name all_reduce#0 and this rank: {text}"
                ))
            }
        }
        Err(e) => Outcome::Fail(format!("expected Timeout, got {e}")),
    }
}

/// A dropped handle waits for its call; a leaked one (`mem::forget`)
/// leaves its buffer with the call: either way the calls issued after them
/// run in order and give the right answers.
fn async_dropped_handles(ctx: &Ctx) -> Outcome {
    let (n, me, c) = (ctx.world_size(), ctx.rank(), &*ctx.comm);
    let mut checks = Vec::new();
    for (k, leak) in [(30, false), (32, true)] {
        match c.start_all_reduce(data(me, k, 1 << 15), ReduceOp::Sum) {
            Ok(w) if leak => std::mem::forget(w),
            Ok(w) => drop(w),
            Err(e) => return fail("start", e),
        }
        let mut v = data(me, k + 1, 100);
        let what = if leak { "leaked" } else { "dropped" };
        checks.push(
            c.all_reduce_slice(&mut v, ReduceOp::Sum)
                .map_err(|e| format!("after a {what} handle: {e}"))
                .and_then(|()| {
                    compare(
                        &format!("all_reduce after a {what} handle"),
                        &v,
                        &oracle::reduce(&all(n, k + 1, 100), ReduceOp::Sum, true),
                        0.0,
                    )
                }),
        );
    }
    verdict(checks)
}

fn gate_async_mismatch(ctx: &Ctx) -> Option<String> {
    if matches!(
        accel_api::CallCheck::from_env(),
        Ok(accel_api::CallCheck::Off)
    ) {
        return Some("ACCEL_CHECK_CALLS=0 turns the call check off".into());
    }
    needs_peers(ctx, &[Op::AllReduce])
}

/// Rank r starts an all-reduce of 10 + r elements: every rank's `wait`
/// returns Mismatch naming the lengths, with a row per rank; the next call
/// is Poisoned.
fn async_mismatch(ctx: &Ctx) -> Outcome {
    let comm = match ctx.fresh_comm("async-mismatch", SHORT) {
        Ok(c) => c,
        Err(e) => return fail("fresh connect", e),
    };
    let start = Instant::now();
    let w = match comm.start_all_reduce(vec![1.0f32; 10 + ctx.rank()], ReduceOp::Sum) {
        Ok(w) => w,
        Err(e) => return fail("start", e),
    };
    let r = w.wait();
    let took = start.elapsed();
    match r {
        Ok(_) => Outcome::Fail("a started call with mismatched lengths returned Ok".into()),
        Err(e) if took > SHORT + SLACK => Outcome::Fail(format!("took {took:?}: {e}")),
        Err(e) => match e.kind() {
            ErrorKind::Mismatch { table }
                if table.len() == ctx.world_size()
                    && e.to_string().contains("length (10 on rank 0; 11 on rank 1") =>
            {
                match comm.barrier() {
                    Err(p) if matches!(p.kind(), ErrorKind::Poisoned) => Outcome::Pass,
                    other => Outcome::Fail(format!(
                        "call after the mismatch: expected Poisoned, got {other:?}"
                    )),
                }
            }
            _ => Outcome::Fail(format!("expected a Mismatch naming the lengths, got {e}")),
        },
    }
}
