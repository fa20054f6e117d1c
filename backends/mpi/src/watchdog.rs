//! The watchdog of blocking collectives.
//!
//! A blocking MPI collective cannot be cancelled or bounded from the thread
//! that calls it. Each communicator that uses them has a [`Watch`]: the
//! caller [`arm`](Watch::arm)s it around the call (a clock read and three
//! atomic stores, no lock, no system call), and one thread per process
//! looks at every live watch a few times per timeout. A call that has been
//! running for longer than its communicator's timeout is reported (the same
//! `Timeout` text the non-blocking path returns, plus how long the call has
//! been blocked) on stderr and in the error file
//! ([`ACCEL_ERROR_FILE`](accel_api::worker::keys::ACCEL_ERROR_FILE), read
//! by `accel launch`'s root-cause block), and the MPI job is ended with
//! `MPI_Abort` (exit code 124): MPI cannot cancel a collective, and the
//! calling thread is inside it.
//!
//! The thread sleeps between looks for a tenth of the shortest timeout
//! (at least 10 ms, at most 250 ms), so a hung call is reported within
//! the timeout plus that, and parks when no call was armed for a few
//! looks in a row (the next [`Watch::arm`] wakes it).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use accel_api::kit::EngineInfo;
use accel_api::Op;

use accel_api::worker::{error_file_from_env, write_first_error, ErrorRecord};

use crate::ffi;
use crate::name::NAME;
use crate::progress::{self, Progress};
use crate::registry::{self, Started};

/// What a [`Watch`] watches: the bound, and who this rank is (for the
/// error and the error file).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Watched {
    timeout: Duration,
    /// This rank in the communicator, and the communicator's size.
    rank: usize,
    size: usize,
    /// This rank in `MPI_COMM_WORLD` (for the error file).
    world_rank: usize,
    /// `ACCEL_MPI_STAGING_BYTES`, for the message.
    staging: usize,
}

impl Watched {
    /// The communicator `info` describes, on the rank `world_rank` of
    /// `MPI_COMM_WORLD`, staging up to `staging` bytes.
    pub(crate) fn new(info: &EngineInfo, world_rank: usize, staging: usize) -> Watched {
        Watched {
            timeout: info.timeout,
            rank: info.rank,
            size: info.world_size,
            world_rank,
            staging,
        }
    }
}

/// The watch of one communicator.
#[derive(Debug)]
pub(crate) struct Watch {
    /// Odd while a call is armed; every arm and disarm adds one.
    seq: AtomicU64,
    /// When the armed call started, in nanoseconds since [`epoch`].
    started_ns: AtomicU64,
    /// Index in [`Op::ALL`] of the armed call.
    op: AtomicUsize,
    of: Watched,
    /// This rank's progress record and the armed call's index in it
    /// (`u64::MAX`: not counted).
    progress: Option<Arc<Progress>>,
    index: AtomicU64,
    /// When the peers' records were last read for the armed call.
    checked_ns: AtomicU64,
}

/// The armed state of a [`Watch`]; dropping it disarms.
#[must_use = "the call is watched only while this guard lives"]
pub(crate) struct Armed<'a>(&'a Watch);

impl Drop for Armed<'_> {
    fn drop(&mut self) {
        self.0.seq.fetch_add(1, Ordering::SeqCst);
    }
}

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    u64::try_from(epoch().elapsed().as_nanos()).unwrap_or(u64::MAX)
}

impl Watch {
    /// A watch of `of`, not armed and not yet registered.
    fn new(of: Watched, progress: Option<Arc<Progress>>) -> Watch {
        Watch {
            seq: AtomicU64::new(0),
            started_ns: AtomicU64::new(0),
            op: AtomicUsize::new(0),
            of,
            progress,
            index: AtomicU64::new(u64::MAX),
            checked_ns: AtomicU64::new(0),
        }
    }

    /// A watch of `of`, registered with the process's watchdog thread
    /// (started on first use). `None` when that thread cannot be started
    /// (the engine then stays on the non-blocking path).
    pub(crate) fn start(of: Watched, progress: Option<Arc<Progress>>) -> Option<Arc<Watch>> {
        let w = Arc::new(Watch::new(of, progress));
        registry().add(&w).then_some(w)
    }

    /// Watch the blocking call `op` (collective number `index` of the
    /// progress record, when counted) until the guard is dropped.
    pub(crate) fn arm(&self, op: Op, index: Option<u64>) -> Armed<'_> {
        let i = Op::ALL.iter().position(|o| *o == op).unwrap_or(0);
        self.op.store(i, Ordering::Relaxed);
        self.index
            .store(index.unwrap_or(u64::MAX), Ordering::Relaxed);
        let now = now_ns();
        self.started_ns.store(now, Ordering::Relaxed);
        self.checked_ns.store(now, Ordering::Relaxed);
        self.seq.fetch_add(1, Ordering::SeqCst);
        let reg = registry();
        if reg.idle.load(Ordering::SeqCst) && reg.idle.swap(false, Ordering::SeqCst) {
            if let Some(t) = reg.thread.get() {
                t.unpark();
            }
        }
        Armed(self)
    }

    fn armed(&self) -> bool {
        !self.seq.load(Ordering::SeqCst).is_multiple_of(2)
    }

    /// How often the watchdog looks at this watch.
    fn tick(&self) -> Duration {
        (self.of.timeout / 10).clamp(Duration::from_millis(10), Duration::from_millis(250))
    }

    /// The armed call and how long it has run, when that is past the
    /// timeout and the call is still the same one.
    fn overdue(&self) -> Option<(Op, Duration, u64)> {
        let s1 = self.seq.load(Ordering::Acquire);
        if s1.is_multiple_of(2) {
            return None;
        }
        let started = self.started_ns.load(Ordering::Relaxed);
        let op = self.op.load(Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Acquire);
        if self.seq.load(Ordering::Relaxed) != s1 {
            return None;
        }
        let elapsed = Duration::from_nanos(now_ns().saturating_sub(started));
        (elapsed >= self.of.timeout)
            .then(|| (Op::ALL.get(op).copied().unwrap_or(Op::Barrier), elapsed, s1))
    }

    /// The armed call's index in the progress record, if counted.
    fn index(&self) -> Option<u64> {
        let i = self.index.load(Ordering::Relaxed);
        (i != u64::MAX).then_some(i)
    }

    /// While a call is armed, about every 200 ms: a peer that ended before
    /// entering it will never come; record it as the root cause and end
    /// the job (see [`progress`]).
    fn check_peers(&self) {
        let s1 = self.seq.load(Ordering::Acquire);
        let (Some(p), Some(index)) = (&self.progress, self.index()) else {
            return;
        };
        let now = now_ns();
        let last = self.checked_ns.load(Ordering::Relaxed);
        if s1.is_multiple_of(2) || now.saturating_sub(last) < 200_000_000 {
            return;
        }
        self.checked_ns.store(now, Ordering::Relaxed);
        let op = Op::ALL
            .get(self.op.load(Ordering::Relaxed))
            .copied()
            .unwrap_or(Op::Barrier);
        if let Some((peer, rec)) = p.left_before(index) {
            if self.seq.load(Ordering::SeqCst) != s1 {
                return;
            }
            let message = format!(
                "[{NAME} rank {r}] {op}: {text}. MPI cannot cancel a collective: ending the MPI job (MPI_Abort, exit code 1)",
                r = self.of.rank,
                op = op.name(),
                text = progress::early_exit_message(op.name(), index, peer, rec),
            );
            write_error_file(&message, peer);
            ffi::abort_job(&message, 1);
        }
    }

    /// Report the overdue call and end the MPI job.
    fn fire(&self, op: Op, elapsed: Duration, seq: u64) {
        // The call may have returned since `overdue` looked.
        if self.seq.load(Ordering::SeqCst) != seq {
            return;
        }
        let culprits = match (&self.progress, self.index()) {
            (Some(p), Some(i)) => p.culprits(i),
            _ => Vec::new(),
        };
        if self.seq.load(Ordering::SeqCst) != seq {
            return;
        }
        let err = crate::error::timeout_error(
            op.name(),
            self.of.timeout,
            self.of.size,
            self.of.rank,
            &culprits,
        );
        let message = format!(
            "{err}\n[{NAME} rank {r}] {op} has been blocked in MPI for {elapsed:.2?} on this rank; \
             MPI cannot cancel a collective, so the watchdog is aborting the MPI job \
             (MPI_Abort, exit code 124). Operations on buffers up to ACCEL_MPI_STAGING_BYTES \
             (now {staging}) run non-blocking and return the Timeout instead: raise it to make \
             larger ones return too, at the cost of speed",
            r = self.of.rank,
            op = op.name(),
            staging = self.of.staging,
        );
        // The root cause is the rank that held the call up, when the
        // progress records name one; otherwise this rank.
        let blamed = culprits.first().map_or(self.of.world_rank, |(r, _)| *r);
        write_error_file(&message, blamed);
        ffi::abort_job(&message, 124);
    }
}

/// Write `message` as accel's error record ([`ErrorRecord`], what the
/// facade's panic hook writes) to the process's error file
/// ([`error_file_from_env`]), unless a record is there already (the first
/// failure is the root cause). Best effort: the job is ending.
pub(crate) fn write_error_file(message: &str, world_rank: usize) {
    let Some(path) = error_file_from_env() else {
        return;
    };
    let record = ErrorRecord::now(Some(world_rank), message.to_string(), None);
    let _ = write_first_error(&path, &record);
}

/// Every live watch of the process, and the thread that looks at them.
struct Registry {
    watches: registry::Registry<Watch>,
    thread: OnceLock<Thread>,
    /// Set by the thread before it parks; [`Watch::arm`] clears it and
    /// wakes the thread.
    idle: AtomicBool,
}

fn registry() -> &'static Registry {
    static REGISTRY: Registry = Registry {
        watches: registry::Registry::new(),
        thread: OnceLock::new(),
        idle: AtomicBool::new(false),
    };
    &REGISTRY
}

/// Looks without an armed call before the thread parks.
const QUIET_LOOKS: u32 = 4;

impl Registry {
    fn live(&self) -> Vec<Arc<Watch>> {
        self.watches.live()
    }

    /// Register `w`, starting the thread on first use; `false` when it
    /// cannot be started.
    fn add(&'static self, w: &Arc<Watch>) -> bool {
        match self
            .watches
            .add(w, "accel-mpi-watchdog", move || self.run())
        {
            Ok(Started::Now(t)) => {
                let _ = self.thread.set(t);
            }
            Ok(Started::Before) => {}
            Err(_) => return false,
        }
        // Wake it: the new watch may have a shorter tick.
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
        true
    }

    fn run(&self) {
        let mut quiet = 0u32;
        loop {
            let live = self.live();
            let mut armed = false;
            for w in &live {
                if let Some((op, elapsed, seq)) = w.overdue() {
                    w.fire(op, elapsed, seq);
                }
                w.check_peers();
                armed |= w.armed();
            }
            let tick = live
                .iter()
                .map(|w| w.tick())
                .min()
                .unwrap_or(Duration::from_millis(250));
            drop(live);
            quiet = if armed { 0 } else { quiet + 1 };
            if quiet >= QUIET_LOOKS {
                self.idle.store(true, Ordering::SeqCst);
                // An arm between the look above and `idle` is seen here.
                if !self.live().iter().any(|w| w.armed()) {
                    std::thread::park();
                }
                self.idle.store(false, Ordering::SeqCst);
                quiet = 0;
                continue;
            }
            std::thread::park_timeout(tick);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank `rank` of `size` (and of the world), no staging.
    fn watched(timeout: Duration, rank: usize, size: usize) -> Watched {
        Watched {
            timeout,
            rank,
            size,
            world_rank: rank,
            staging: 0,
        }
    }

    #[test]
    fn arming_is_visible_and_disarming_ends_it() {
        let of = watched(Duration::from_secs(3600), 0, 2);
        let w = Watch::start(of, None).expect("watchdog thread");
        assert!(!w.armed());
        {
            let _a = w.arm(Op::AllReduce, None);
            assert!(w.armed());
            // Far from the timeout: not overdue.
            assert!(w.overdue().is_none());
        }
        assert!(!w.armed());
        assert!(w.overdue().is_none());
    }

    #[test]
    fn an_armed_call_past_the_timeout_is_overdue_with_its_op() {
        let w = Watch::new(watched(Duration::from_millis(1), 1, 2), None);
        // Not registered: the thread never sees it (it would abort).
        let _a = w.arm(Op::Broadcast, None);
        std::thread::sleep(Duration::from_millis(5));
        let (op, elapsed, _) = w.overdue().expect("overdue");
        assert_eq!(op, Op::Broadcast);
        assert!(elapsed >= Duration::from_millis(1));
    }

    #[test]
    fn the_tick_stays_within_bounds() {
        let w = |t| Watch::new(watched(t, 0, 1), None);
        assert_eq!(
            w(Duration::from_millis(1)).tick(),
            Duration::from_millis(10)
        );
        assert_eq!(w(Duration::from_secs(1)).tick(), Duration::from_millis(100));
        assert_eq!(
            w(Duration::from_secs(600)).tick(),
            Duration::from_millis(250)
        );
    }
}
