//! [`Deadline`] and [`Backoff`]: the one poll loop of the backend kit, for
//! engines that look at something (a request, a stream, a communicator's
//! asynchronous error) until it is done or the accel timeout passes.
//!
//! Each engine keeps its own pause schedule (how long to spin, yield and
//! sleep between two looks); the loop, the deadline check and the rule that
//! a pause never sleeps past the deadline live here once.

use std::time::{Duration, Instant};

use crate::{Error, ErrorKind};

/// What every engine's timeout error says to do.
pub const TIMEOUT_FIX: &str = "check that every rank calls the same collectives in the same order (ACCEL_DEBUG=1 names a rank that disagrees), or raise ACCEL_TIMEOUT if the work is just slow";

/// The error of an engine call that did not complete within `after`:
/// [`ErrorKind::Timeout`] saying `message`, with the fix every engine gives
/// ([`TIMEOUT_FIX`]). The engine adds its operation, backend and rank.
pub fn timeout_error(after: Duration, message: impl Into<String>) -> Error {
    Error::new(ErrorKind::Timeout { after }, message).with_fix(TIMEOUT_FIX)
}

/// A deadline: the instant a budget of `timeout` runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadline {
    end: Instant,
    timeout: Duration,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        Deadline::since(Instant::now(), timeout)
    }

    /// `timeout` after `start`.
    pub fn since(start: Instant, timeout: Duration) -> Deadline {
        Deadline::until(start + timeout, timeout)
    }

    /// Ending at `end`, for a budget of `timeout` (which started
    /// `timeout` before `end`).
    pub fn until(end: Instant, timeout: Duration) -> Deadline {
        Deadline { end, timeout }
    }

    /// The whole budget, for the timeout error (`ErrorKind::Timeout`'s
    /// `after`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// When the budget runs out.
    pub fn end(&self) -> Instant {
        self.end
    }

    /// Time left (zero once passed).
    pub fn remaining(&self) -> Duration {
        self.remaining_at(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn passed(&self) -> bool {
        self.remaining().is_zero()
    }

    fn elapsed_at(&self, now: Instant) -> Duration {
        self.timeout.saturating_sub(self.remaining_at(now))
    }

    fn remaining_at(&self, now: Instant) -> Duration {
        self.end.saturating_duration_since(now)
    }

    /// Look with `look` until it returns `Some` (returned), an error
    /// ([`Polled::Failed`]) or the deadline passes with the last look still
    /// pending ([`Polled::TimedOut`]), pausing between looks as `backoff`
    /// says. Every call looks at least once.
    pub fn poll<T, E>(
        &self,
        backoff: &Backoff,
        look: impl FnMut() -> std::result::Result<Option<T>, E>,
    ) -> std::result::Result<T, Polled<E>> {
        self.poll_with(&SystemClock, backoff, look)
    }

    /// [`Deadline::poll`] on the time and pauses of `clock`.
    pub fn poll_with<T, E>(
        &self,
        clock: &dyn Clock,
        backoff: &Backoff,
        mut look: impl FnMut() -> std::result::Result<Option<T>, E>,
    ) -> std::result::Result<T, Polled<E>> {
        let mut poller = Poller::with_clock(*self, *backoff, clock);
        loop {
            if let Some(t) = look().map_err(Polled::Failed)? {
                return Ok(t);
            }
            if poller.wait().is_err() {
                return Err(Polled::TimedOut);
            }
        }
    }
}

/// Why [`Deadline::poll`] stopped without a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Polled<E> {
    /// A look failed.
    Failed(E),
    /// The deadline passed; the last look was still pending.
    TimedOut,
}

/// When a phase of a [`Backoff`] ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Until {
    /// After this many pauses of the whole poll (spin and yield count).
    Looks(u32),
    /// Once this much of the deadline's budget is spent.
    Elapsed(Duration),
}

impl Until {
    fn reached(self, looks: u32, elapsed: Duration) -> bool {
        match self {
            Until::Looks(n) => looks >= n,
            Until::Elapsed(d) => elapsed >= d,
        }
    }
}

/// How a sleep grows from one pause to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// The same sleep each time.
    Fixed,
    /// Longer by this much each time.
    Add(Duration),
    /// This many times longer each time.
    Mul(u32),
}

/// A pause schedule between two looks: spin until `spin` ends, then yield
/// the thread until `yield` ends, then sleep, starting at `first` and
/// growing by `growth` up to `cap`. No pause sleeps past the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    spin: Until,
    yield_until: Until,
    first: Duration,
    growth: Growth,
    cap: Duration,
}

impl Backoff {
    /// Sleep `first` between looks, from the first pause on.
    pub const fn sleep(first: Duration) -> Backoff {
        Backoff {
            spin: Until::Looks(0),
            yield_until: Until::Looks(0),
            first,
            growth: Growth::Fixed,
            cap: first,
        }
    }

    /// Spin (a busy wait hint) between looks until `until`.
    pub const fn spin(mut self, until: Until) -> Backoff {
        self.spin = until;
        self
    }

    /// After spinning, yield the thread between looks until `until`.
    pub const fn then_yield(mut self, until: Until) -> Backoff {
        self.yield_until = until;
        self
    }

    /// Grow each sleep by `growth`, to at most `cap`.
    pub const fn grow(mut self, growth: Growth, cap: Duration) -> Backoff {
        self.growth = growth;
        self.cap = cap;
        self
    }

    fn next_sleep(&self, d: Duration) -> Duration {
        let grown = match self.growth {
            Growth::Fixed => d,
            Growth::Add(step) => d.saturating_add(step),
            Growth::Mul(k) => d.saturating_mul(k),
        };
        grown.min(self.cap)
    }
}

/// One pause between two looks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// A busy-wait hint ([`std::hint::spin_loop`]).
    Spin,
    /// Give the core away once ([`std::thread::yield_now`]).
    Yield,
    /// Sleep this long.
    Sleep(Duration),
}

/// Where a poll reads the time and pauses: the system ([`SystemClock`]),
/// or a fake in tests.
pub trait Clock {
    /// The current instant.
    fn now(&self) -> Instant;
    /// Pause once.
    fn pause(&self, p: Pause);
}

/// The real clock: [`Instant::now`], the spin hint, `yield_now`, `sleep`.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn pause(&self, p: Pause) {
        match p {
            Pause::Spin => std::hint::spin_loop(),
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(d) => std::thread::sleep(d),
        }
    }
}

/// The deadline has passed (from [`Poller::wait`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expired;

/// The state of one poll, for loops that do more between two looks than
/// [`Deadline::poll`] allows (a check of the peers every so often): call
/// [`Poller::wait`] after each look that found the work pending.
pub struct Poller<'c> {
    deadline: Deadline,
    backoff: Backoff,
    clock: &'c dyn Clock,
    looks: u32,
    sleep: Duration,
}

impl std::fmt::Debug for Poller<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Poller")
            .field("deadline", &self.deadline)
            .field("backoff", &self.backoff)
            .field("looks", &self.looks)
            .finish_non_exhaustive()
    }
}

impl Poller<'static> {
    /// A poll against `deadline` on the system clock.
    pub fn new(deadline: Deadline, backoff: Backoff) -> Poller<'static> {
        Poller::with_clock(deadline, backoff, &SystemClock)
    }
}

impl<'c> Poller<'c> {
    /// A poll against `deadline` on `clock`.
    pub fn with_clock(deadline: Deadline, backoff: Backoff, clock: &'c dyn Clock) -> Poller<'c> {
        Poller {
            deadline,
            backoff,
            clock,
            looks: 0,
            sleep: backoff.first,
        }
    }

    /// The deadline polled against.
    pub fn deadline(&self) -> &Deadline {
        &self.deadline
    }

    /// [`Expired`] when the deadline has passed; otherwise pause once as
    /// the schedule says (a sleep ends at the deadline at the latest) and
    /// return the time spent before the pause.
    pub fn wait(&mut self) -> std::result::Result<Duration, Expired> {
        let now = self.clock.now();
        let elapsed = self.deadline.elapsed_at(now);
        let left = self.deadline.remaining_at(now);
        if left.is_zero() {
            return Err(Expired);
        }
        let b = &self.backoff;
        let pause = if !b.spin.reached(self.looks, elapsed) {
            Pause::Spin
        } else if !b.yield_until.reached(self.looks, elapsed) {
            Pause::Yield
        } else {
            let d = self.sleep;
            self.sleep = b.next_sleep(d);
            Pause::Sleep(d.min(left))
        };
        self.clock.pause(pause);
        self.looks = self.looks.saturating_add(1);
        Ok(elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    /// A clock that moves only when it sleeps (and by `per_look` on every
    /// pause), recording the pauses.
    struct Fake {
        now: Cell<Instant>,
        per_look: Duration,
        pauses: RefCell<Vec<Pause>>,
    }

    impl Fake {
        fn new(per_look: Duration) -> Fake {
            Fake {
                now: Cell::new(Instant::now()),
                per_look,
                pauses: RefCell::new(Vec::new()),
            }
        }
    }

    impl Clock for Fake {
        fn now(&self) -> Instant {
            self.now.get()
        }
        fn pause(&self, p: Pause) {
            let d = match p {
                Pause::Sleep(d) => d,
                _ => Duration::ZERO,
            };
            self.now.set(self.now.get() + d + self.per_look);
            self.pauses.borrow_mut().push(p);
        }
    }

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn ready_on_the_first_look_never_pauses() {
        let clock = Fake::new(Duration::ZERO);
        let d = Deadline::since(clock.now(), Duration::from_secs(1));
        let r: Result<u8, Polled<()>> = d.poll_with(&clock, &Backoff::sleep(US), || Ok(Some(7)));
        assert_eq!(r, Ok(7));
        assert!(clock.pauses.borrow().is_empty());
    }

    #[test]
    fn a_failed_look_stops_the_poll() {
        let clock = Fake::new(Duration::ZERO);
        let d = Deadline::since(clock.now(), Duration::from_secs(1));
        let mut n = 0;
        let r: Result<(), Polled<&str>> = d.poll_with(&clock, &Backoff::sleep(US), || {
            n += 1;
            if n == 3 {
                Err("broke")
            } else {
                Ok(None)
            }
        });
        assert_eq!(r, Err(Polled::Failed("broke")));
        assert_eq!(clock.pauses.borrow().len(), 2);
    }

    #[test]
    fn times_out_after_the_deadline_and_never_sleeps_past_it() {
        let clock = Fake::new(Duration::ZERO);
        let start = clock.now();
        let d = Deadline::since(start, Duration::from_micros(1000));
        // 300 us sleeps: 0, 300, 600, 900, then 100 (clipped) to 1000.
        let b = Backoff::sleep(300 * US);
        let mut looks = 0;
        let r: Result<(), Polled<()>> = d.poll_with(&clock, &b, || {
            looks += 1;
            Ok(None)
        });
        assert_eq!(r, Err(Polled::TimedOut));
        assert_eq!(clock.now() - start, Duration::from_micros(1000));
        let pauses = clock.pauses.borrow();
        assert_eq!(
            *pauses,
            [300, 300, 300, 100].map(|u| Pause::Sleep(u * US)).to_vec()
        );
        // A look after every pause, and one before the first.
        assert_eq!(looks, pauses.len() + 1);
    }

    #[test]
    fn a_passed_deadline_still_looks_once() {
        let clock = Fake::new(Duration::ZERO);
        let d = Deadline::since(clock.now(), Duration::ZERO);
        let mut looks = 0;
        let r: Result<(), Polled<()>> = d.poll_with(&clock, &Backoff::sleep(US), || {
            looks += 1;
            Ok(None)
        });
        assert_eq!(r, Err(Polled::TimedOut));
        assert_eq!(looks, 1);
        assert!(clock.pauses.borrow().is_empty());
    }

    #[test]
    fn spin_yield_then_growing_sleeps_by_looks() {
        // cuda-nccl's schedule: spin 4 looks, yield to 6, sleep 1 us more
        // each time up to 3 us.
        let clock = Fake::new(Duration::ZERO);
        let d = Deadline::since(clock.now(), Duration::from_secs(1));
        let b = Backoff::sleep(US)
            .spin(Until::Looks(4))
            .then_yield(Until::Looks(6))
            .grow(Growth::Add(US), 3 * US);
        let mut p = Poller::with_clock(d, b, &clock);
        for _ in 0..10 {
            p.wait().unwrap();
        }
        let want = [
            Pause::Spin,
            Pause::Spin,
            Pause::Spin,
            Pause::Spin,
            Pause::Yield,
            Pause::Yield,
            Pause::Sleep(US),
            Pause::Sleep(2 * US),
            Pause::Sleep(3 * US),
            Pause::Sleep(3 * US),
        ];
        assert_eq!(*clock.pauses.borrow(), want);
    }

    #[test]
    fn phases_by_elapsed_time_and_doubling_sleeps() {
        // Every look costs 10 us: spin below 20 us, yield below 40 us, then
        // sleep 5 us doubling up to 20 us.
        let clock = Fake::new(10 * US);
        let d = Deadline::since(clock.now(), Duration::from_secs(1));
        let b = Backoff::sleep(5 * US)
            .spin(Until::Elapsed(20 * US))
            .then_yield(Until::Elapsed(40 * US))
            .grow(Growth::Mul(2), 20 * US);
        let mut p = Poller::with_clock(d, b, &clock);
        let elapsed: Vec<Duration> = (0..7).map(|_| p.wait().unwrap()).collect();
        assert_eq!(
            elapsed,
            [0, 10, 20, 30, 40, 55, 75].map(|u| u * US).to_vec()
        );
        let want = [
            Pause::Spin,
            Pause::Spin,
            Pause::Yield,
            Pause::Yield,
            Pause::Sleep(5 * US),
            Pause::Sleep(10 * US),
            Pause::Sleep(20 * US),
        ];
        assert_eq!(*clock.pauses.borrow(), want);
    }

    #[test]
    fn the_system_clock_times_out_after_the_deadline() {
        let d = Deadline::after(Duration::from_millis(20));
        let mut looks = 0u32;
        let r: Result<(), Polled<()>> = d.poll(&Backoff::sleep(Duration::from_millis(1)), || {
            looks += 1;
            Ok(None)
        });
        assert_eq!(r, Err(Polled::TimedOut));
        assert!(d.passed());
        assert!(Instant::now() >= d.end());
        assert!(looks >= 2, "looked {looks} times");
    }
}
