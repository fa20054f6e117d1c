//! The stall inspector (Horovod's idea): every rank records in the store
//! which collective it entered last; when a collective times out, the rank
//! that timed out reads those records and names the ranks that never
//! arrived and what they were last doing:
//!
//! ```text
//! [cpu-gloo rank 0] all_reduce: timed out after 5s: ...; missing ranks: 1 (last: all_reduce#41); this rank waited in all_reduce#42
//! ```
//!
//! It also leaves a [`StallVerdict`] in the store, which `accel launch`
//! reads to blame the missing rank in its root-cause block instead of the
//! first rank that timed out (a victim).
//!
//! # Cost
//! The hot path is two relaxed atomic stores per collective. A background
//! thread publishes the latest record when it changed, at most once per
//! [`interval`](StallLayer::interval) (a quarter of the timeout, at most one
//! second), so a rank that stops calling collectives is recorded at its
//! last one long before anyone times out waiting for it. The store is read
//! only after a timeout.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use accel_api::worker::stall::{behind_key, label, parse_record, rank_key, record};
use accel_api::{CallInfo, Communicator, Error, ErrorKind, Layer, Layered, Op, Store};

/// The store format the launcher reads too ([`accel_api::worker::stall`]),
/// re-exported where it has always been.
pub use accel_api::worker::stall::{store_prefix, MissingRank, StallVerdict, VERDICT_KEY};

/// No collective entered yet.
const NONE: u64 = u64::MAX;

struct Shared {
    store: Arc<dyn Store>,
    rank: usize,
    world: usize,
    /// The collective entered last (`NONE` before the first) and its op.
    seq: AtomicU64,
    op: AtomicUsize,
    /// The record last written to the store.
    published: Mutex<u64>,
    /// A lost peer's verdict was waited for once (later errors only look).
    waited_for_verdict: AtomicBool,
    stop: Mutex<bool>,
    wake: Condvar,
}

impl Shared {
    fn current(&self) -> Option<(u64, Op)> {
        let seq = self.seq.load(Ordering::Acquire);
        (seq != NONE).then(|| {
            (
                seq,
                Op::ALL[self.op.load(Ordering::Relaxed) % Op::ALL.len()],
            )
        })
    }

    /// Write the current record if it changed since the last write.
    fn publish(&self) {
        let mut published = self.published.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((seq, op)) = self.current().filter(|(s, _)| *s != *published) {
            match self
                .store
                .set(&rank_key(self.rank), record(seq, op).as_bytes())
            {
                Ok(()) => *published = seq,
                Err(e) => tracing::debug!(error = %e, "stall inspector: cannot publish"),
            }
        }
    }
}

/// The stall inspector: a [`Layer`] in front of a world communicator (see
/// the [module docs](self)).
pub struct StallLayer {
    shared: Arc<Shared>,
    interval: Duration,
}

impl std::fmt::Debug for StallLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallLayer")
            .field("store", &self.shared.store.describe())
            .field("rank", &self.shared.rank)
            .field("interval", &self.interval)
            .finish()
    }
}

/// `inner` with the stall inspector in front.
pub type StallCommunicator = Layered<StallLayer>;

/// Put the stall inspector in front of `inner`; `store` is shared by the
/// ranks of `inner`'s group and used by nothing else. Starts the publishing
/// thread (it ends when the communicator is dropped).
///
/// # Errors
/// [`ErrorKind::Internal`] when the thread cannot be started.
pub fn stall_inspector(
    inner: Box<dyn Communicator>,
    store: Arc<dyn Store>,
) -> accel_api::Result<StallCommunicator> {
    let interval = (inner.timeout() / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let shared = Arc::new(Shared {
        store,
        rank: inner.rank(),
        world: inner.world_size(),
        seq: AtomicU64::new(NONE),
        op: AtomicUsize::new(0),
        published: Mutex::new(NONE),
        waited_for_verdict: AtomicBool::new(false),
        stop: Mutex::new(false),
        wake: Condvar::new(),
    });
    let s = shared.clone();
    std::thread::Builder::new()
        .name("accel-stall".into())
        .spawn(move || loop {
            let stop = s.stop.lock().unwrap_or_else(|p| p.into_inner());
            let (stop, _) = s
                .wake
                .wait_timeout(stop, interval)
                .unwrap_or_else(|p| p.into_inner());
            if *stop {
                return;
            }
            drop(stop);
            s.publish();
        })
        .map_err(|e| {
            Error::internal(
                "connect",
                format!("cannot start the stall inspector's thread: {e}"),
            )
        })?;
    Ok(Layered::new(inner, StallLayer { shared, interval }))
}

/// How long a rank that lost a peer waits for the verdict of a rank that
/// timed out first (it leaves it a moment after it gives up).
const PEER_VERDICT_GRACE: Duration = Duration::from_millis(500);

impl StallLayer {
    /// A peer that gave up first may have timed out waiting for ranks this
    /// rank never waited for (it had got further, into the next call): the
    /// verdict that peer leaves names them. A peer that died leaves none:
    /// the first such error waits `timeout` (at most
    /// [`PEER_VERDICT_GRACE`]) for it, later ones only look.
    fn with_peer_verdict(&self, timeout: Duration, err: Error) -> Error {
        let s = &self.shared;
        let found = if s.waited_for_verdict.swap(true, Ordering::SeqCst) {
            StallVerdict::read(&*s.store)
        } else {
            StallVerdict::wait(&*s.store, timeout.min(PEER_VERDICT_GRACE))
        };
        match found {
            Some(v) if v.seen_by != s.rank && !v.missing.is_empty() => err.with_detail(format!(
                "rank {} had timed out in {} waiting for missing ranks: {}",
                v.seen_by,
                v.waiting_in,
                v.missing_text()
            )),
            _ => err,
        }
    }

    /// How often the publishing thread writes a changed record.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Publish this rank's record now, read every other rank's, and say who
    /// is missing from collective `seq`.
    fn inspect(&self, seq: u64, op: Op) -> accel_api::Result<StallVerdict> {
        let s = &self.shared;
        s.publish();
        let mut missing = Vec::new();
        for r in (0..s.world).filter(|&r| r != s.rank) {
            let rec = s.store.try_get(&rank_key(r))?;
            let rec = rec.as_deref().and_then(parse_record);
            match rec {
                Some((theirs, _)) if theirs >= seq => {}
                Some((theirs, their_op)) => missing.push(MissingRank {
                    rank: r,
                    last: Some(label(theirs, &their_op)),
                }),
                None => missing.push(MissingRank {
                    rank: r,
                    last: None,
                }),
            }
        }
        let verdict = StallVerdict {
            seen_by: s.rank,
            waiting_in: label(seq, op.name()),
            missing,
        };
        if !verdict.missing.is_empty() {
            // The first rank to time out writes it; later ones leave it.
            verdict.write_first(&*s.store);
        }
        Ok(verdict)
    }
}

impl Drop for StallLayer {
    fn drop(&mut self) {
        *self.shared.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.shared.wake.notify_all();
    }
}

impl Layer for StallLayer {
    /// Records the collective as entered (two atomic stores).
    fn before(&self, _inner: &dyn Communicator, call: &CallInfo) -> accel_api::Result<()> {
        if call.is_collective() {
            let s = &self.shared;
            let next = s.seq.load(Ordering::Relaxed).wrapping_add(1);
            let op = Op::ALL.iter().position(|&o| o == call.op).unwrap_or(0);
            s.op.store(op, Ordering::Relaxed);
            s.seq.store(next, Ordering::Release);
        }
        Ok(())
    }

    /// A sub-group's failures dump the flight recorder as the world's do
    /// (its collectives are not the world's: no stall records).
    fn wrap_split(&self, sub: Box<dyn Communicator>, _color: u32) -> Box<dyn Communicator> {
        Box::new(accel_api::Layered::new(sub, crate::flight::DumpOnFailure))
    }

    /// After a collective's timeout, names the ranks that never entered it;
    /// after a lost peer, the ranks a peer that timed out first named.
    fn on_error(&self, inner: &dyn Communicator, call: &CallInfo, err: Error) -> Error {
        // The first timeout, mismatch or lost peer: what every communicator
        // of this process was doing (`accel trace` reads it).
        crate::flight::dump_on_failure(&err);
        if call.is_collective() && matches!(err.kind(), ErrorKind::PeerLost { .. }) {
            return self.with_peer_verdict(inner.timeout(), err);
        }
        if !call.is_collective() || !matches!(err.kind(), ErrorKind::Timeout { .. }) {
            return err;
        }
        let Some((seq, op)) = self.shared.current() else {
            return err;
        };
        match self.inspect(seq, op) {
            Ok(v) if v.missing.is_empty() => err.with_detail(format!(
                "every rank entered {} (none is missing: one may be stuck inside it)",
                v.waiting_in
            )),
            Ok(v) => {
                let fix = stall_fix(&v);
                err.with_detail(format!(
                    "missing ranks: {}; this rank waited in {}",
                    v.missing_text(),
                    v.waiting_in
                ))
                .with_fix(fix)
            }
            Err(e) => err.with_detail(format!(
                "the store could not say which rank is missing: {}",
                e.message()
            )),
        }
    }
}

/// Where to look: every missing rank, and first the one furthest behind
/// when the others got further (they may only be held up by it).
fn stall_fix(v: &StallVerdict) -> String {
    let ranks = v
        .missing
        .iter()
        .map(|m| m.rank.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let key = |m: &MissingRank| behind_key(m.rank, m.last.as_deref()).0;
    let first = v
        .furthest_behind()
        .filter(|f| v.missing.iter().any(|m| key(m) > key(f)));
    let also = "(a hang, a longer step, a different code path), or raise ACCEL_TIMEOUT";
    match first {
        Some(f) => format!(
            "look first at what rank {} did (furthest behind, last entered {}: the other missing ranks may be held up by it), then at rank(s) {ranks}, instead of entering {} {also}",
            f.rank,
            f.last.as_deref().unwrap_or("no collective"),
            v.waiting_in
        ),
        None => format!(
            "look at what rank(s) {ranks} did instead of entering {} {also}",
            v.waiting_in
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::kit::{Engine, EngineInfo, Group};
    use accel_api::{Buf, BufMut, Capabilities, CommunicatorExt, Device, ReduceOp, Result};
    use accel_rendezvous::MemoryStore;

    /// Rank 0 of 3 whose all-reduces succeed (leaving the buffer as it is)
    /// until `late` is set, then time out; whose broadcasts then lose rank
    /// 1, which gave up first.
    struct Late {
        info: EngineInfo,
        late: Arc<AtomicBool>,
    }

    impl Engine for Late {
        fn info(&self) -> &EngineInfo {
            &self.info
        }
        fn all_reduce(&self, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
            if self.late.load(Ordering::SeqCst) {
                return Err(Error::timeout("all_reduce", self.info.timeout, "gave up"));
            }
            Ok(())
        }
        fn reduce(&self, _: BufMut<'_>, _: ReduceOp, _: usize) -> Result<()> {
            Ok(())
        }
        fn broadcast(&self, _: BufMut<'_>, _: usize) -> Result<()> {
            if self.late.load(Ordering::SeqCst) {
                return Err(Error::new(
                    ErrorKind::PeerLost { peer: Some(1) },
                    "rank 1 gave up first",
                ));
            }
            Ok(())
        }
        fn all_gather(&self, _: Buf<'_>, _: BufMut<'_>) -> Result<()> {
            Ok(())
        }
        fn gather(&self, _: Buf<'_>, _: Option<BufMut<'_>>, _: usize) -> Result<()> {
            Ok(())
        }
        fn scatter(&self, _: Option<Buf<'_>>, _: BufMut<'_>, _: usize) -> Result<()> {
            Ok(())
        }
        fn reduce_scatter(&self, _: Buf<'_>, _: BufMut<'_>, _: ReduceOp) -> Result<()> {
            Ok(())
        }
        fn all_to_all(&self, _: Buf<'_>, _: BufMut<'_>) -> Result<()> {
            Ok(())
        }
        fn send(&self, _: Buf<'_>, _: usize, _: u32) -> Result<()> {
            Ok(())
        }
        fn recv(&self, _: BufMut<'_>, _: usize, _: u32) -> Result<()> {
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            Ok(())
        }
        fn split(&self, _: Option<u32>, _: u32) -> Result<Option<Self>> {
            Ok(None)
        }
    }

    fn inspected(store: &Arc<dyn Store>) -> (StallCommunicator, Arc<AtomicBool>) {
        let late = Arc::new(AtomicBool::new(false));
        let g = Group::new(Late {
            info: EngineInfo {
                backend: "late".into(),
                rank: 0,
                world_size: 3,
                device: Device::CPU,
                timeout: Duration::from_millis(40),
                capabilities: Capabilities::all_host(),
            },
            late: late.clone(),
        });
        (stall_inspector(Box::new(g), store.clone()).unwrap(), late)
    }

    #[test]
    fn a_timeout_names_the_ranks_behind_and_leaves_a_verdict() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        // Rank 1 entered collective #1 (an all_gather) and rank 2 none when
        // rank 0 times out in #2.
        store.set("rank/1", b"1 all_gather").unwrap();
        let (c, late) = inspected(&store);
        c.all_reduce_slice(&mut [1.0f32], ReduceOp::Sum).unwrap();
        c.all_gather_vec(&[1u8]).unwrap();
        late.store(true, Ordering::SeqCst);
        let e = c
            .all_reduce_slice(&mut [1.0f32], ReduceOp::Sum)
            .unwrap_err();
        let s = e.to_string();
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{s}");
        assert!(
            s.contains("missing ranks: 1 (last: all_gather#1), 2 (last: none); this rank waited in all_reduce#2"),
            "{s}"
        );
        assert!(
            s.contains(
                "look first at what rank 2 did (furthest behind, last entered no collective"
            ),
            "{s}"
        );
        let v = StallVerdict::read(&*store).expect("a verdict");
        assert_eq!(v.seen_by, 0);
        assert_eq!(v.waiting_in, "all_reduce#2");
        assert_eq!(
            v.missing.iter().map(|m| m.rank).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(
            parse_record(&store.try_get("rank/0").unwrap().unwrap()),
            Some((2, "all_reduce".into())),
            "the survivor published its own record before reading"
        );
    }

    /// A rank that lost a peer which had timed out first names the ranks
    /// that peer waited for (its verdict); without a verdict the error is
    /// the engine's, after the grace.
    #[test]
    fn a_lost_peer_that_timed_out_first_passes_on_whom_it_waited_for() {
        // A lost peer poisons the group: one communicator per case.
        let lost_with = |verdict: Option<&StallVerdict>| {
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            if let Some(v) = verdict {
                v.write_first(&*store);
            }
            let (c, late) = inspected(&store);
            late.store(true, Ordering::SeqCst);
            c.broadcast_slice(&mut [1.0f32], 0).unwrap_err()
        };
        let e = lost_with(None);
        assert_eq!(e.message(), "rank 1 gave up first", "no verdict: {e}");
        let v = StallVerdict {
            seen_by: 1,
            waiting_in: "broadcast#52".into(),
            missing: vec![MissingRank {
                rank: 2,
                last: None,
            }],
        };
        let e = lost_with(Some(&v));
        assert!(
            matches!(e.kind(), ErrorKind::PeerLost { peer: Some(1) }),
            "{e}"
        );
        assert!(
            e.message().ends_with(
                "; rank 1 had timed out in broadcast#52 waiting for missing ranks: 2 (last: none)"
            ),
            "{e}"
        );
        // Its own verdict says nothing new to the rank that wrote it.
        let e = lost_with(Some(&StallVerdict { seen_by: 0, ..v }));
        assert_eq!(e.message(), "rank 1 gave up first", "{e}");
    }

    #[test]
    fn the_fix_names_a_rank_furthest_behind_only_when_one_is() {
        let missing = |lasts: &[(usize, u64)]| StallVerdict {
            seen_by: 0,
            waiting_in: "all_reduce#384".into(),
            missing: lasts
                .iter()
                .map(|&(rank, n)| MissingRank {
                    rank,
                    last: Some(label(n, "all_reduce")),
                })
                .collect(),
        };
        let f = stall_fix(&missing(&[(1, 383), (3, 380), (4, 383)]));
        assert!(
            f.starts_with(
                "look first at what rank 3 did (furthest behind, last entered all_reduce#380"
            ),
            "{f}"
        );
        assert!(
            f.contains("then at rank(s) 1, 3, 4, instead of entering all_reduce#384"),
            "{f}"
        );
        let f = stall_fix(&missing(&[(1, 383), (2, 383)]));
        assert!(
            f.starts_with("look at what rank(s) 1, 2 did instead of entering all_reduce#384"),
            "{f}"
        );
    }

    #[test]
    fn no_verdict_when_every_rank_arrived() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        store.set("rank/1", b"0 all_reduce").unwrap();
        store.set("rank/2", b"3 barrier").unwrap();
        let (c, late) = inspected(&store);
        late.store(true, Ordering::SeqCst);
        let e = c
            .all_reduce_slice(&mut [1.0f32], ReduceOp::Sum)
            .unwrap_err();
        assert!(
            e.to_string().contains("every rank entered all_reduce#0"),
            "{e}"
        );
        assert!(StallVerdict::read(&*store).is_none());
    }

    /// The verdict as the launcher reads it is fresh at that moment: a
    /// missing rank's later record replaces the one seen at the timeout,
    /// and a rank that has since arrived is no longer missing.
    #[test]
    fn a_verdict_read_later_carries_the_records_of_that_moment() {
        let store = MemoryStore::new();
        let stale = StallVerdict {
            seen_by: 0,
            waiting_in: "all_reduce#7".into(),
            missing: vec![
                MissingRank {
                    rank: 1,
                    last: None,
                },
                MissingRank {
                    rank: 2,
                    last: None,
                },
                MissingRank {
                    rank: 3,
                    last: None,
                },
            ],
        };
        store
            .set(VERDICT_KEY, &serde_json::to_vec(&stale).unwrap())
            .unwrap();
        store
            .set("rank/1", record(5, Op::AllReduce).as_bytes())
            .unwrap();
        store
            .set("rank/2", record(7, Op::AllReduce).as_bytes())
            .unwrap();
        let v = StallVerdict::read_fresh(&store).unwrap();
        assert_eq!(v.missing_text(), "1 (last: all_reduce#5), 3 (last: none)");
        assert_eq!(StallVerdict::read(&store).unwrap(), stale);
    }

    #[test]
    fn the_thread_publishes_a_rank_that_stopped_calling() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let (c, _) = inspected(&store);
        c.barrier().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while store.try_get("rank/0").unwrap().is_none() {
            assert!(std::time::Instant::now() < deadline, "never published");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            parse_record(&store.try_get("rank/0").unwrap().unwrap()),
            Some((0, "barrier".into()))
        );
    }
}
