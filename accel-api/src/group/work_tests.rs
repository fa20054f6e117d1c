//! Calls started without waiting, on an engine that takes its time.

use super::*;
use crate::work::{StartExt, ENGINE_GRACE};
use crate::{Buf, Capabilities, CommunicatorExt, DType, Device, Op};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Two ranks' worth of identity and an engine that sleeps `len` µs per
/// call, records the lengths it saw, fails the call numbered `fail_at` and
/// hangs (until aborted) on a call of `HANG` elements.
#[derive(Debug)]
struct Slow {
    info: EngineInfo,
    seen: Mutex<Vec<usize>>,
    fail_at: Option<usize>,
    aborted: AtomicBool,
}

const HANG: usize = 999;

fn slow(fail_at: Option<usize>) -> Group<Slow> {
    Group::new(Slow {
        info: EngineInfo {
            backend: "slow".into(),
            rank: 0,
            world_size: 2,
            device: Device::CPU,
            timeout: Duration::from_millis(100),
            capabilities: Capabilities::all_host(),
        },
        seen: Mutex::new(Vec::new()),
        fail_at,
        aborted: AtomicBool::new(false),
    })
    .without_call_check()
}

impl Slow {
    fn call(&self, len: usize) -> Result<()> {
        let n = {
            let mut s = lock(&self.seen);
            s.push(len);
            s.len() - 1
        };
        if len == HANG {
            while !self.aborted.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(5));
            }
            return Err(Error::new(ErrorKind::Aborted, "interrupted"));
        }
        std::thread::sleep(Duration::from_micros(len as u64));
        if self.fail_at == Some(n) {
            return Err(Error::timeout(
                "all_reduce",
                self.info.timeout,
                "a peer is late",
            ));
        }
        Ok(())
    }
}

impl Engine for Slow {
    fn info(&self) -> &EngineInfo {
        &self.info
    }
    fn all_reduce(&self, b: BufMut<'_>, _: ReduceOp) -> Result<()> {
        self.call(b.len())
    }
    fn reduce(&self, b: BufMut<'_>, _: ReduceOp, _: usize) -> Result<()> {
        self.call(b.len())
    }
    fn broadcast(&self, b: BufMut<'_>, _: usize) -> Result<()> {
        self.call(b.len())
    }
    fn all_gather(&self, s: Buf<'_>, _: BufMut<'_>) -> Result<()> {
        self.call(s.len())
    }
    fn gather(&self, s: Buf<'_>, _: Option<BufMut<'_>>, _: usize) -> Result<()> {
        self.call(s.len())
    }
    fn scatter(&self, _: Option<Buf<'_>>, r: BufMut<'_>, _: usize) -> Result<()> {
        self.call(r.len())
    }
    fn reduce_scatter(&self, s: Buf<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
        self.call(s.len())
    }
    fn all_to_all(&self, s: Buf<'_>, _: BufMut<'_>) -> Result<()> {
        self.call(s.len())
    }
    fn send(&self, b: Buf<'_>, _: usize, _: u32) -> Result<()> {
        self.call(b.len())
    }
    fn recv(&self, b: BufMut<'_>, _: usize, _: u32) -> Result<()> {
        self.call(b.len())
    }
    fn barrier(&self) -> Result<()> {
        self.call(0)
    }
    fn split(&self, _: Option<u32>, _: u32) -> Result<Option<Self>> {
        Ok(None)
    }
    fn abort(&self, _: &str) {
        self.aborted.store(true, Ordering::SeqCst);
    }
}

fn seen(g: &Group<Slow>) -> Vec<usize> {
    lock(&g.engine().seen).clone()
}

#[test]
fn started_and_blocking_calls_run_in_issue_order() {
    let g = slow(None);
    let sizes = [3000usize, 10, 2000, 1, 500];
    let mut works = Vec::new();
    for &n in &sizes[..3] {
        works.push(g.start_all_reduce(vec![2.0f32; n], ReduceOp::Avg).unwrap());
    }
    // A blocking call issued now runs after the three started ones.
    g.broadcast_slice(&mut [0u8; 7], 0).unwrap();
    assert!(
        works.iter().all(|w| w.is_done()),
        "issued earlier, done earlier"
    );
    for &n in &sizes[3..] {
        works.push(g.start_all_reduce(vec![2.0f32; n], ReduceOp::Avg).unwrap());
    }
    let mut want = sizes[..3].to_vec();
    want.push(7);
    want.extend(&sizes[3..]);
    for (w, &n) in works.into_iter().zip(&sizes) {
        let v = w.wait().unwrap();
        // The engine summed nothing; the group divided by the world size.
        assert_eq!(v, vec![1.0f32; n], "the buffers come back, averaged");
    }
    assert_eq!(seen(&g), want);
    assert_eq!(g.collectives_entered(), 6);
}

#[test]
fn a_started_calls_error_names_its_sequence_number() {
    let g = slow(Some(1));
    let a = g.start_all_reduce(vec![1.0f32; 4], ReduceOp::Sum).unwrap();
    let b = g.start_all_reduce(vec![1.0f32; 4], ReduceOp::Sum).unwrap();
    assert_eq!(b.label().seq, Some(1));
    a.wait().unwrap();
    let e = b.wait().unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    let text = e.to_string();
    assert!(text.starts_with("[slow rank 0] all_reduce#1: "), "{text}");
    // A timeout poisons: later calls fail at once, naming it.
    let e = g.start_barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned, "{e}");
}

#[test]
fn argument_errors_come_at_start_and_never_reach_the_engine() {
    let g = slow(None);
    let e = g.start_broadcast(vec![1i32; 2], 5).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    let e = g
        .start_all_gather(vec![1f32; 2], vec![0f32; 5])
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    assert!(seen(&g).is_empty());
    assert!(g.poison_text().is_none());
}

#[test]
fn dropped_handles_wait_and_leaked_ones_still_run_in_order() {
    let g = slow(None);
    drop(g.start_all_reduce(vec![0f32; 4000], ReduceOp::Sum).unwrap());
    assert_eq!(seen(&g), vec![4000], "the drop waited for the call");
    std::mem::forget(g.start_all_reduce(vec![0f32; 3000], ReduceOp::Sum).unwrap());
    g.all_reduce_slice(&mut [0f32; 5], ReduceOp::Sum).unwrap();
    assert_eq!(seen(&g), vec![4000, 3000, 5]);
}

#[test]
fn wait_timeout_waits_at_most_its_bound_and_is_done_never_blocks() {
    let g = slow(None);
    let w = g
        .start_all_reduce(vec![0f32; 200_000], ReduceOp::Sum)
        .unwrap();
    assert!(!w.is_done());
    assert!(!w.wait_timeout(Duration::from_millis(1)));
    assert!(w.wait_timeout(Duration::from_secs(30)));
    assert!(w.is_done());
    w.wait().unwrap();
}

#[test]
fn an_engine_that_ignores_its_timeout_is_aborted_by_the_waiter() {
    let g = slow(None);
    let w = g.start_all_reduce(vec![0u8; HANG], ReduceOp::Sum).unwrap();
    let start = std::time::Instant::now();
    let e = w.wait().unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("all_reduce#0"), "{e}");
    assert!(took >= ENGINE_GRACE, "gave up after {took:?}");
    assert!(
        g.engine().aborted.load(Ordering::SeqCst),
        "the communicator was aborted"
    );
    assert!(g.poison_text().is_some());
}

#[test]
fn point_to_point_and_self_messages_start_too() {
    let g = slow(None);
    let s = g.start_send(vec![1u8, 2, 3], 0, 4).unwrap();
    assert!(s.is_done(), "a send to self is posted at once");
    let r = g.start_recv(vec![0u8; 3], 0, 4).unwrap();
    assert_eq!(r.wait().unwrap(), vec![1, 2, 3]);
    let r = g.start_recv(vec![0u8; 9], 1, 4).unwrap();
    assert_eq!(r.label().seq, None, "point-to-point calls are not numbered");
    r.wait().unwrap();
    assert_eq!(seen(&g), vec![9]);
}

#[test]
fn the_flight_recorder_keeps_every_call_with_its_state_and_times() {
    let g = slow(Some(2));
    let a = g.start_all_reduce(vec![1.0f32; 3], ReduceOp::Sum).unwrap();
    g.broadcast_slice(&mut [0u8; 2], 1).unwrap();
    a.wait().unwrap();
    let e = g
        .all_reduce_slice(&mut [0i32; 5], ReduceOp::Max)
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }));
    let recs = g.flight_recorder().expect("on by default").snapshot();
    assert_eq!(recs.len(), 3, "{recs:?}");
    let (r0, r1, r2) = (&recs[0], &recs[1], &recs[2]);
    assert_eq!(
        (r0.op, r0.seq, r0.count, r0.started_async),
        (Op::AllReduce, Some(0), 3, true)
    );
    assert_eq!(
        (r1.op, r1.root, r1.started_async),
        (Op::Broadcast, Some(1), false)
    );
    assert_eq!(
        (r2.op, r2.reduce, r2.dtype),
        (Op::AllReduce, Some(ReduceOp::Max), DType::I32)
    );
    assert_eq!(
        [r0.state, r1.state, r2.state],
        [
            CallState::Completed,
            CallState::Completed,
            CallState::Failed
        ]
    );
    for r in &recs {
        assert!(
            r.issued_us <= r.started_us && r.started_us <= r.ended_us,
            "{r:?}"
        );
    }
    assert!(
        r0.ended_us <= r1.started_us,
        "issue order: {r0:?} then {r1:?}"
    );
    let id = g.flight_recorder().unwrap().identity();
    assert_eq!(
        (
            id.backend.as_str(),
            id.rank,
            id.world_size,
            id.name.as_str()
        ),
        ("slow", 0, 2, "world")
    );
}

#[test]
fn a_ring_keeps_the_newest_calls() {
    let id = GroupIdentity {
        backend: "t".into(),
        rank: 0,
        world_size: 1,
        name: "world".into(),
    };
    let r = FlightRecorder::new(id, 4).unwrap();
    let call = crate::CallInfo::new(Op::Barrier, DType::U8, 0);
    for t in 0..10 {
        r.issued(t, Some(t), &call, false);
        r.set(t, CallState::Completed);
    }
    let tickets: Vec<u64> = r.snapshot().iter().map(|c| c.ticket).collect();
    assert_eq!(tickets, vec![6, 7, 8, 9]);
    r.set(2, CallState::Failed);
    assert!(
        r.snapshot().iter().all(|c| c.state == CallState::Completed),
        "a stale ticket changes nothing"
    );
    assert!(FlightRecorder::new(
        GroupIdentity {
            backend: "t".into(),
            rank: 0,
            world_size: 1,
            name: "off".into()
        },
        0
    )
    .is_none());
}
