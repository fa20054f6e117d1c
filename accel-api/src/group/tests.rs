use super::*;
use crate::CommunicatorExt;
use crate::{Buf, Capabilities, Communicator, Device};
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// A one-rank engine that counts the calls reaching it and fails on
/// demand: enough to pin the group's own behaviour.
#[derive(Debug)]
struct Probe {
    info: EngineInfo,
    calls: AtomicUsize,
    fail_with: Mutex<Option<ErrorKind>>,
    seen_avg: Mutex<bool>,
    fatal_seen: AtomicUsize,
}

impl Default for Probe {
    fn default() -> Probe {
        Probe {
            info: EngineInfo {
                backend: "probe".into(),
                rank: 0,
                world_size: 2,
                device: Device::CPU,
                timeout: Duration::from_millis(50),
                capabilities: Capabilities::all_host().with_reduce_dtypes([DType::F32, DType::I32]),
            },
            calls: AtomicUsize::new(0),
            fail_with: Mutex::new(None),
            seen_avg: Mutex::new(false),
            fatal_seen: AtomicUsize::new(0),
        }
    }
}

impl Probe {
    fn hit(&self) -> Result<()> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match lock(&self.fail_with).take() {
            // A timeout names the engine's own call, as engines do.
            Some(k @ ErrorKind::Timeout { .. }) => {
                Err(Error::new(k, "engine said no").with_op("all_gather"))
            }
            Some(k) => Err(Error::new(k, "engine said no")),
            None => Ok(()),
        }
    }
}

impl Engine for Probe {
    fn info(&self) -> &EngineInfo {
        &self.info
    }
    fn all_reduce(&self, _: BufMut<'_>, op: ReduceOp) -> Result<()> {
        *lock(&self.seen_avg) |= op == ReduceOp::Avg;
        self.hit()
    }
    fn reduce(&self, _: BufMut<'_>, _: ReduceOp, _: usize) -> Result<()> {
        self.hit()
    }
    fn broadcast(&self, _: BufMut<'_>, _: usize) -> Result<()> {
        self.hit()
    }
    fn all_gather(&self, _: Buf<'_>, _: BufMut<'_>) -> Result<()> {
        self.hit()
    }
    fn gather(&self, _: Buf<'_>, _: Option<BufMut<'_>>, _: usize) -> Result<()> {
        self.hit()
    }
    fn scatter(&self, _: Option<Buf<'_>>, _: BufMut<'_>, _: usize) -> Result<()> {
        self.hit()
    }
    fn reduce_scatter(&self, _: Buf<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
        self.hit()
    }
    fn all_to_all(&self, _: Buf<'_>, _: BufMut<'_>) -> Result<()> {
        self.hit()
    }
    fn send(&self, _: Buf<'_>, _: usize, _: u32) -> Result<()> {
        self.hit()
    }
    fn recv(&self, _: BufMut<'_>, _: usize, _: u32) -> Result<()> {
        self.hit()
    }
    fn barrier(&self) -> Result<()> {
        self.hit()
    }
    fn split(&self, color: Option<u32>, _: u32) -> Result<Option<Self>> {
        self.hit()?;
        Ok(color.map(|_| Probe::default()))
    }
    fn on_fatal(&self, _: &Error) {
        self.fatal_seen.fetch_add(1, Ordering::SeqCst);
    }
}

fn calls(g: &Group<Probe>) -> usize {
    g.engine().calls.load(Ordering::SeqCst)
}

/// A probe group with the call check off, past its first collective
/// (always checked), with the call counter reset: the engine sees only
/// the test's own calls.
fn group() -> Group<Probe> {
    let g = Group::new(Probe::default()).with_call_check(CallCheck::Off);
    g.barrier().unwrap();
    g.engine().calls.store(0, Ordering::SeqCst);
    g
}

#[test]
fn bad_arguments_never_reach_the_engine() {
    let g = group();
    let e = g.broadcast_slice(&mut [1i32], 2).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert!(e.to_string().contains("root 2"), "{e}");
    assert!(e.to_string().starts_with("[probe rank 0] broadcast"), "{e}");
    let mut out = [0f32; 3];
    let e = g
        .all_gather(Buf::from(&[1f32][..]), BufMut::from(&mut out[..]))
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    let e = g.all_reduce_slice(&mut [1u8], ReduceOp::Sum).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
    let e = g.gather(Buf::from(&[1f32][..]), None, 0).unwrap_err();
    assert!(e.to_string().contains("receive buffer"), "{e}");
    assert_eq!(calls(&g), 0);
    assert!(g.poison_text().is_none(), "argument errors do not poison");
}

#[test]
fn empty_collectives_skip_the_engine_and_avg_divides() {
    let g = group();
    g.all_reduce_slice::<f32>(&mut [], ReduceOp::Sum).unwrap();
    g.all_gather_vec::<i32>(&[]).unwrap();
    assert_eq!(calls(&g), 0);
    let mut v = [4.0f32, -6.0];
    g.all_reduce_slice(&mut v, ReduceOp::Avg).unwrap();
    assert_eq!(
        v,
        [2.0, -3.0],
        "the engine summed (left as is), the group divided by 2"
    );
    assert!(!*lock(&g.engine().seen_avg), "the engine never sees avg");
    assert_eq!(calls(&g), 1);
}

#[test]
fn self_sends_are_buffered_and_checked() {
    let g = group();
    g.send_slice(&[1u8, 2, 3], 0, 7).unwrap();
    let mut out = [0u8; 3];
    g.recv_slice(&mut out, 0, 7).unwrap();
    assert_eq!(out, [1, 2, 3]);
    g.send_slice(&[1i32], 0, 8).unwrap();
    let e = g.recv_slice(&mut [0f32], 0, 8).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument);
    assert_eq!(calls(&g), 0);
    let e = g.recv_slice(&mut out, 0, 9).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("tag 9"), "{e}");
    g.barrier().unwrap();
    assert!(
        g.poison_text().is_none(),
        "a local timeout leaves the group usable"
    );
}

#[test]
fn an_engine_error_in_the_check_names_the_callers_op() {
    let g = Group::new(Probe::default());
    *lock(&g.engine().fail_with) = Some(ErrorKind::Timeout {
        after: Duration::from_secs(1),
    });
    let e = g.all_reduce_slice(&mut [1f32], ReduceOp::Sum).unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("[probe rank 0] all_reduce: timed out"), "{s}");
    assert!(s.contains("in the call check before all_reduce #0"), "{s}");
    assert_eq!(e.op(), Some("all_reduce"));
}

#[test]
fn the_first_fatal_error_poisons_once() {
    let g = group();
    *lock(&g.engine().fail_with) = Some(ErrorKind::PeerLost { peer: Some(1) });
    let e = g.barrier().unwrap_err();
    assert!(
        e.to_string()
            .starts_with("[probe rank 0] barrier: lost peer rank 1"),
        "{e}"
    );
    let e = g.all_reduce_slice(&mut [1f32], ReduceOp::Sum).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned);
    assert!(e.to_string().contains("lost peer rank 1"), "{e}");
    assert_eq!(calls(&g), 1);
    assert_eq!(g.engine().fatal_seen.load(Ordering::SeqCst), 1);
}

#[test]
fn non_fatal_engine_errors_leave_the_group_usable() {
    let g = group();
    *lock(&g.engine().fail_with) = Some(ErrorKind::InvalidArgument);
    assert!(g.barrier().is_err());
    g.barrier().unwrap();
    assert_eq!(g.engine().fatal_seen.load(Ordering::SeqCst), 0);
}

#[test]
fn abort_poisons_and_split_wraps() {
    let g = Group::new(Probe::default());
    let sub = g.split(Some(1), 0).unwrap().unwrap();
    assert_eq!(sub.backend_name(), "probe");
    assert!(g.split(None, 0).unwrap().is_none());
    g.abort("test said so");
    let e = g.barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned);
    assert!(e.to_string().contains("test said so"), "{e}");
}

#[test]
fn split_plans_follow_key_then_rank() {
    // ranks 0..4: colors 5, -, 5, 2; keys 9, 0, 1, 0
    let all = [5, 9, -1, 0, 5, 1, 2, 0];
    let p = SplitPlan::from_exchanged(0, Some(5), &all).unwrap();
    assert_eq!(p.members, vec![2, 0]);
    assert_eq!(p.new_rank, 1);
    assert_eq!(p.color_index, 1);
    let p = SplitPlan::from_exchanged(3, Some(2), &all).unwrap();
    assert_eq!((p.members, p.new_rank, p.color_index), (vec![3], 0, 0));
    let p = SplitPlan::from_exchanged(1, None, &all).unwrap();
    assert!(p.members.is_empty());
    assert!(SplitPlan::from_exchanged(1, Some(7), &all).is_err());
}
/// Two ranks as threads over a shared slot table: enough of an engine
/// for the call check (i32 `Max` all-reduce, all-gather) and for f32
/// sums. It counts the calls that are not the check's, and refuses
/// mismatched lengths itself, so a test sees if one got through.
struct Pair {
    info: EngineInfo,
    hub: Arc<Hub>,
    user_calls: AtomicUsize,
}

struct Hub {
    slots: Mutex<Vec<Vec<u8>>>,
    enter: Barrier,
    leave: Barrier,
}

impl Pair {
    /// Two ranks; `gathers`: they declare an all-gather (otherwise the
    /// check all-reduces).
    fn two(gathers: bool) -> (Pair, Pair) {
        let hub = Arc::new(Hub {
            slots: Mutex::new(vec![Vec::new(); 2]),
            enter: Barrier::new(2),
            leave: Barrier::new(2),
        });
        let mut capabilities = Capabilities::all_host();
        if !gathers {
            capabilities.ops.remove(&Op::AllGather);
        }
        let one = |rank| Pair {
            info: EngineInfo {
                backend: "pair".into(),
                rank,
                world_size: 2,
                device: Device::CPU,
                timeout: Duration::from_secs(5),
                capabilities: capabilities.clone(),
            },
            hub: hub.clone(),
            user_calls: AtomicUsize::new(0),
        };
        (one(0), one(1))
    }

    fn swap(&self, mine: &[u8]) -> Vec<Vec<u8>> {
        lock(&self.hub.slots)[self.info.rank] = mine.to_vec();
        self.hub.enter.wait();
        let all = lock(&self.hub.slots).clone();
        self.hub.leave.wait();
        all
    }

    fn same_lengths(all: &[Vec<u8>]) -> Result<()> {
        if all.iter().any(|v| v.len() != all[0].len()) {
            return Err(Error::new(
                ErrorKind::Backend,
                "engine saw mismatched lengths",
            ));
        }
        Ok(())
    }
}

impl Engine for Pair {
    fn info(&self) -> &EngineInfo {
        &self.info
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let mut h = host_mut(Op::AllReduce, buf)?;
        let check = h.dtype() == DType::I32 && op == ReduceOp::Max && h.len() == 18;
        if !check {
            self.user_calls.fetch_add(1, Ordering::SeqCst);
        }
        let all = self.swap(h.bytes());
        Pair::same_lengths(&all)?;
        let n = h.dtype().size();
        for (i, out) in h.bytes_mut().chunks_mut(n).enumerate() {
            let at = |r: usize| &all[r][i * n..(i + 1) * n];
            match (n, op) {
                (4, ReduceOp::Max) => {
                    let v = (0..2)
                        .map(|r| i32::from_ne_bytes(at(r).try_into().unwrap()))
                        .max()
                        .unwrap();
                    out.copy_from_slice(&v.to_ne_bytes());
                }
                (4, ReduceOp::Sum) => {
                    let v: f32 = (0..2)
                        .map(|r| f32::from_ne_bytes(at(r).try_into().unwrap()))
                        .sum();
                    out.copy_from_slice(&v.to_ne_bytes());
                }
                _ => return Err(Error::unsupported("all_reduce", "pair engine")),
            }
        }
        Ok(())
    }
    fn reduce(&self, _: BufMut<'_>, _: ReduceOp, _: usize) -> Result<()> {
        Err(Error::unsupported("reduce", "pair engine"))
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.user_calls.fetch_add(1, Ordering::SeqCst);
        let mut h = host_mut(Op::Broadcast, buf)?;
        let all = self.swap(h.bytes());
        Pair::same_lengths(&all)?;
        h.bytes_mut().copy_from_slice(&all[root]);
        Ok(())
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let send = host(Op::AllGather, send)?;
        let mut recv = host_mut(Op::AllGather, recv)?;
        let all = self.swap(send.bytes());
        Pair::same_lengths(&all)?;
        recv.bytes_mut().copy_from_slice(&all.concat());
        Ok(())
    }
    fn gather(&self, _: Buf<'_>, _: Option<BufMut<'_>>, _: usize) -> Result<()> {
        Err(Error::unsupported("gather", "pair engine"))
    }
    fn scatter(&self, _: Option<Buf<'_>>, _: BufMut<'_>, _: usize) -> Result<()> {
        Err(Error::unsupported("scatter", "pair engine"))
    }
    fn reduce_scatter(&self, _: Buf<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
        Err(Error::unsupported("reduce_scatter", "pair engine"))
    }
    fn all_to_all(&self, _: Buf<'_>, _: BufMut<'_>) -> Result<()> {
        Err(Error::unsupported("all_to_all", "pair engine"))
    }
    fn send(&self, _: Buf<'_>, _: usize, _: u32) -> Result<()> {
        Err(Error::unsupported("send", "pair engine"))
    }
    fn recv(&self, _: BufMut<'_>, _: usize, _: u32) -> Result<()> {
        Err(Error::unsupported("recv", "pair engine"))
    }
    fn barrier(&self) -> Result<()> {
        self.user_calls.fetch_add(1, Ordering::SeqCst);
        self.swap(&[]);
        Ok(())
    }
    fn split(&self, _: Option<u32>, _: u32) -> Result<Option<Self>> {
        Err(Error::unsupported("split", "pair engine"))
    }
}

/// Run `f(rank, group)` on both ranks of a fresh pair, in threads.
fn on_pair<T: Send>(
    check: [CallCheck; 2],
    f: impl Fn(usize, &Group<Pair>) -> T + Sync,
) -> (Vec<T>, Vec<usize>) {
    on_pair_with(true, check, f)
}

fn on_pair_with<T: Send>(
    gathers: bool,
    check: [CallCheck; 2],
    f: impl Fn(usize, &Group<Pair>) -> T + Sync,
) -> (Vec<T>, Vec<usize>) {
    let (a, b) = Pair::two(gathers);
    let groups = [
        Group::new(a).with_call_check(check[0]),
        Group::new(b).with_call_check(check[1]),
    ];
    let out = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .iter()
            .enumerate()
            .map(|(r, g)| {
                let f = &f;
                s.spawn(move || f(r, g))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let calls = groups
        .iter()
        .map(|g| g.engine().user_calls.load(Ordering::SeqCst))
        .collect();
    (out, calls)
}

fn mismatch_text(r: &Result<()>) -> String {
    let e = r.as_ref().expect_err("a mismatch must fail");
    assert!(
        matches!(e.kind(), ErrorKind::Mismatch { .. }),
        "expected a mismatch, got {e}"
    );
    e.to_string()
}

const ON: [CallCheck; 2] = [CallCheck::On, CallCheck::On];

/// One rank's side of a two-rank call.
type PairCall = fn(usize, &Group<Pair>) -> Result<()>;

#[test]
fn agreeing_calls_pass_the_check_and_compute() {
    let (out, calls) = on_pair(ON, |r, g| {
        let mut v = vec![r as f32 + 1.0; 3];
        g.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        g.barrier().unwrap();
        g.all_reduce_slice::<f32>(&mut [], ReduceOp::Sum).unwrap();
        v
    });
    assert_eq!(out, vec![vec![3.0; 3], vec![3.0; 3]]);
    assert_eq!(
        calls,
        vec![1, 1],
        "only the all_reduce reached the engine: the check was the barrier"
    );
}

#[test]
fn mismatched_lengths_fail_on_every_rank_before_the_engine() {
    let (out, calls) = on_pair(ON, |r, g| {
        let mut v = vec![1.0f32; 10 + r];
        g.all_reduce_slice(&mut v, ReduceOp::Sum)
    });
    for (r, res) in out.iter().enumerate() {
        let s = mismatch_text(res);
        assert!(s.contains("length (10 on rank 0; 11 on rank 1)"), "{s}");
        assert!(s.contains(&format!("[pair rank {r}] all_reduce")), "{s}");
        assert!(
            s.contains("rank 1: #0 all_reduce f32 [11] reduce=sum"),
            "{s}"
        );
    }
    assert_eq!(calls, vec![0, 0], "the engine never saw the call");
}

#[test]
fn without_an_all_gather_the_check_all_reduces_and_still_fails_everywhere() {
    let (out, calls) = on_pair_with(false, ON, |r, g| {
        let mut v = vec![1.0f32; 10 + r];
        g.all_reduce_slice(&mut v, ReduceOp::Sum)
    });
    for res in &out {
        let s = mismatch_text(res);
        assert!(
            s.contains("#0: length differs (this engine has no all-gather"),
            "{s}"
        );
    }
    assert_eq!(calls, vec![0, 0], "only the check's all-reduce ran");
    let (out, calls) = on_pair_with(false, ON, |r, g| {
        let mut v = vec![r as f32; 2];
        g.all_reduce_slice(&mut v, ReduceOp::Sum).map(|()| v)
    });
    assert_eq!(out[1].as_ref().unwrap(), &vec![1.0, 1.0]);
    assert_eq!(calls, vec![1, 1]);
}

#[test]
fn without_the_check_a_mismatch_reaches_the_engine() {
    let (a, b) = Pair::two(true);
    let groups = [
        Group::new(a).without_call_check(),
        Group::new(b).without_call_check(),
    ];
    let out: Vec<Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = groups
            .iter()
            .enumerate()
            .map(|(r, g)| {
                s.spawn(move || g.all_reduce_slice(&mut vec![1.0f32; 10 + r], ReduceOp::Sum))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in out {
        let e = r.unwrap_err();
        assert!(
            e.to_string().contains("engine saw mismatched lengths"),
            "{e}"
        );
    }
}

#[test]
fn zero_against_nonzero_lengths_fail_too() {
    let (out, calls) = on_pair(ON, |r, g| {
        let mut v = vec![1.0f32; 4 * r];
        g.all_reduce_slice(&mut v, ReduceOp::Sum)
    });
    for res in &out {
        assert!(mismatch_text(res).contains("length (0 on rank 0; 4 on rank 1)"));
    }
    assert_eq!(calls, vec![0, 0]);
}

#[test]
fn mismatched_ops_dtypes_kinds_and_roots_fail_on_every_rank() {
    let cases: [(&str, PairCall); 4] = [
        ("reduction (sum on rank 0; max on rank 1)", |r, g| {
            let op = [ReduceOp::Sum, ReduceOp::Max][r];
            g.all_reduce_slice(&mut [1.0f32; 4], op)
        }),
        ("element type (f32 on rank 0; i32 on rank 1)", |r, g| {
            if r == 0 {
                g.all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum)
            } else {
                g.all_reduce_slice(&mut [1i32; 4], ReduceOp::Sum)
            }
        }),
        (
            "operation (broadcast on rank 0; all_reduce on rank 1)",
            |r, g| {
                if r == 0 {
                    g.broadcast_slice(&mut [7.0f32; 4], 0)
                } else {
                    g.all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum)
                }
            },
        ),
        ("root (0 on rank 0; 1 on rank 1)", |r, g| {
            g.broadcast_slice(&mut [7u8; 4], r)
        }),
    ];
    for (want, call) in cases {
        let (out, calls) = on_pair(ON, call);
        for res in &out {
            let s = mismatch_text(res);
            assert!(s.contains(want), "want `{want}` in {s}");
        }
        assert_eq!(calls, vec![0, 0], "{want}");
    }
}

#[test]
fn a_mismatch_poisons_the_group() {
    let (out, _) = on_pair(ON, |r, g| {
        let _ = g.all_reduce_slice(&mut vec![1.0f32; 1 + r], ReduceOp::Sum);
        g.all_reduce_slice(&mut [1.0f32], ReduceOp::Sum)
    });
    for res in out {
        let e = res.unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Poisoned, "{e}");
        assert!(
            e.to_string().contains("ranks disagree on collective #0"),
            "{e}"
        );
    }
}

#[test]
fn the_check_off_skips_later_exchanges_but_compares_the_setting_first() {
    let (out, calls) = on_pair([CallCheck::Off; 2], |r, g| {
        let mut v = vec![r as f32; 2];
        g.all_reduce_slice(&mut v, ReduceOp::Sum)?;
        g.barrier()?;
        Ok::<_, Error>(v)
    });
    assert_eq!(out[0].as_ref().unwrap(), &vec![1.0, 1.0]);
    assert_eq!(calls, vec![2, 2], "the barrier reached the engine");
    let (out, calls) = on_pair([CallCheck::On, CallCheck::Off], |_, g| {
        g.all_reduce_slice(&mut [1.0f32; 2], ReduceOp::Sum)
    });
    for res in &out {
        assert!(mismatch_text(res).contains("ACCEL_CHECK_CALLS (1 on rank 0; 0 on rank 1)"));
    }
    assert_eq!(calls, vec![0, 0]);
}
