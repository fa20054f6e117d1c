//! A started call's handle ([`Pending`], typed as [`Work`]) and the
//! engine's side of it ([`Completer`]).

use std::fmt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::call::{Call, ENGINE_GRACE};
use crate::sync::lock;
use crate::{Error, Op, Result};

/// Who a handle's call is, for the errors its handle makes itself.
#[derive(Debug, Clone)]
pub struct WorkLabel {
    /// The operation.
    pub op: Op,
    /// Its sequence number among the communicator's collectives (`None`
    /// for point-to-point calls).
    pub seq: Option<u64>,
    /// The issuing rank.
    pub rank: usize,
    /// The backend's registered name.
    pub backend: String,
    /// The communicator's timeout.
    pub timeout: Duration,
}

impl WorkLabel {
    /// `all_reduce#12`, or `send` for a point-to-point call.
    pub fn name(&self) -> String {
        match self.seq {
            Some(s) => format!("{}#{s}", self.op),
            None => self.op.to_string(),
        }
    }

    fn error(&self, e: Error) -> Error {
        e.with_op(self.name())
            .with_rank(self.rank)
            .with_backend(self.backend.as_str())
    }
}

enum State {
    /// Issued, waiting for the calls issued before it.
    Queued,
    /// The engine began it at this instant.
    Running(Instant),
    /// Finished; the call comes back with its buffers (`None` once taken).
    Done(Result<()>, Option<Call>),
}

struct Slot {
    state: Mutex<State>,
    changed: Condvar,
}

impl Slot {
    fn new(state: State) -> Arc<Slot> {
        Arc::new(Slot {
            state: Mutex::new(state),
            changed: Condvar::new(),
        })
    }

    fn set(&self, s: State) {
        *lock(&self.state) = s;
        self.changed.notify_all();
    }
}

/// The executor's side of a started call: mark it running, then complete
/// it. Dropped without [`complete`](Self::complete) (an executor that
/// panicked or went away), the call completes with an internal error, so
/// that no handle waits for ever.
pub struct Completer {
    slot: Option<Arc<Slot>>,
}

impl fmt::Debug for Completer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Completer")
    }
}

impl Completer {
    /// The engine begins the call now (its timeout counts from here).
    pub fn running(&self) {
        if let Some(s) = &self.slot {
            s.set(State::Running(Instant::now()));
        }
    }

    /// The call ended with `result`; `call` goes back to the handle.
    pub fn complete(mut self, result: Result<()>, call: Call) {
        if let Some(s) = self.slot.take() {
            s.set(State::Done(result, Some(call)));
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(s) = self.slot.take() {
            let e = Error::internal(
                "work",
                "the executor dropped a started call without completing it",
            );
            s.set(State::Done(Err(e), None));
        }
    }
}

type MapErr = Box<dyn FnOnce(Error) -> Error + Send>;
type Abort = Arc<dyn Fn(&str) + Send + Sync>;

/// A started call, type-erased: what [`Communicator::start`](crate::Communicator::start) returns.
/// [`Work`] is its typed form.
#[must_use = "a started call completes on `wait`; dropping the handle waits for it"]
pub struct Pending {
    slot: Arc<Slot>,
    label: WorkLabel,
    abort: Option<Abort>,
    map_err: Vec<MapErr>,
    taken: bool,
}

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Pending({} on rank {}, {})",
            self.label.name(),
            self.label.rank,
            if self.is_done() { "done" } else { "in flight" }
        )
    }
}

impl Pending {
    /// A handle whose call already completed with `result` (engines that
    /// finish at once, and the default [`Communicator::start`](crate::Communicator::start)).
    pub fn completed(label: WorkLabel, result: Result<()>, call: Call) -> Pending {
        Pending::with_slot(Slot::new(State::Done(result, Some(call))), label, None)
    }

    /// A handle for a call an executor will run: the executor keeps the
    /// [`Completer`]. `abort` is called when a waiter gives up on an engine
    /// that does not return (it should abort the communicator).
    pub fn queued(label: WorkLabel, abort: Option<Abort>) -> (Pending, Completer) {
        let slot = Slot::new(State::Queued);
        let completer = Completer {
            slot: Some(slot.clone()),
        };
        (Pending::with_slot(slot, label, abort), completer)
    }

    fn with_slot(slot: Arc<Slot>, label: WorkLabel, abort: Option<Abort>) -> Pending {
        Pending {
            slot,
            label,
            abort,
            map_err: Vec::new(),
            taken: false,
        }
    }

    /// Pass the call's error, if any, through `f` before it is returned
    /// (what a [`Layer`](crate::Layer) adds on error).
    pub fn map_err(mut self, f: impl FnOnce(Error) -> Error + Send + 'static) -> Pending {
        self.map_err.push(Box::new(f));
        self
    }

    /// Who this call is.
    pub fn label(&self) -> &WorkLabel {
        &self.label
    }

    /// Set the sequence number once admission gave it.
    pub(crate) fn set_seq(&mut self, seq: Option<u64>) {
        self.label.seq = seq;
    }

    /// Whether the call has completed (successfully or not). Never blocks.
    pub fn is_done(&self) -> bool {
        matches!(*lock(&self.slot.state), State::Done(..))
    }

    /// Wait at most `d` for the call to complete; `true` when it has.
    /// Never fails and never aborts anything: the outcome is [`wait`]'s.
    ///
    /// [`wait`]: Pending::wait
    pub fn wait_timeout(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut st = lock(&self.slot.state);
        loop {
            if matches!(*st, State::Done(..)) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = self
                .slot
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Wait for the call to complete and return it with its buffers.
    ///
    /// # Errors
    /// The call's own error (timeout, lost peer, mismatch, ...) naming the
    /// rank, the operation and its sequence number, and the backend; or
    /// [`ErrorKind::Timeout`](crate::ErrorKind::Timeout) when the engine began the call and did not
    /// return within the communicator's timeout plus [`ENGINE_GRACE`] (the
    /// communicator is then aborted).
    pub fn wait(mut self) -> Result<Call> {
        self.taken = true;
        let out = self.wait_inner();
        match out {
            Ok(call) => Ok(call),
            Err(mut e) => {
                for f in std::mem::take(&mut self.map_err) {
                    e = f(e);
                }
                Err(e)
            }
        }
    }

    fn wait_inner(&self) -> Result<Call> {
        let tick = Duration::from_millis(100);
        let mut st = lock(&self.slot.state);
        loop {
            match &mut *st {
                State::Done(result, call) => {
                    return match (std::mem::replace(result, Ok(())), call.take()) {
                        (Err(e), _) => Err(e),
                        (Ok(()), Some(c)) => Ok(c),
                        (Ok(()), None) => Err(self.label.error(Error::internal(
                            "work",
                            "the call's buffers were already taken",
                        ))),
                    };
                }
                State::Running(since) => {
                    let bound = self.label.timeout + ENGINE_GRACE;
                    if since.elapsed() > bound {
                        drop(st);
                        return Err(self.engine_hung(bound));
                    }
                }
                State::Queued => {}
            }
            st = self
                .slot
                .changed
                .wait_timeout(st, tick)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn engine_hung(&self, bound: Duration) -> Error {
        let name = self.label.name();
        let why = format!("{name} did not return within {bound:?} of starting");
        if let Some(a) = &self.abort {
            a(&why);
        }
        self.label
            .error(Error::timeout(name, bound, why))
            .with_fix("the engine ignored its timeout: the communicator was aborted; restart the run and report the engine's version")
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        if let Err(e) = self.wait_inner() {
            tracing::warn!(
                "a dropped handle's call failed: {e} (the error is not returned to anyone; wait for handles to see their errors)"
            );
        }
    }
}

/// A started call with its typed buffers: [`wait`](Work::wait) hands them
/// back. Made by [`StartExt`](crate::StartExt).
#[must_use = "a started call completes on `wait`; dropping the handle waits for it"]
pub struct Work<T> {
    pending: Pending,
    take: fn(Call) -> Option<T>,
}

impl<T> fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.pending.fmt(f)
    }
}

impl<T> Work<T> {
    /// Wrap `pending`, whose call `take` turns back into `T`.
    pub fn new(pending: Pending, take: fn(Call) -> Option<T>) -> Work<T> {
        Work { pending, take }
    }

    /// Whether the call has completed. Never blocks.
    pub fn is_done(&self) -> bool {
        self.pending.is_done()
    }

    /// Wait at most `d`; `true` when the call has completed.
    pub fn wait_timeout(&self, d: Duration) -> bool {
        self.pending.wait_timeout(d)
    }

    /// Who this call is.
    pub fn label(&self) -> &WorkLabel {
        self.pending.label()
    }

    /// Wait for the call and return its buffers.
    ///
    /// # Errors
    /// As [`Pending::wait`].
    pub fn wait(self) -> Result<T> {
        let label = self.pending.label.clone();
        let call = self.pending.wait()?;
        (self.take)(call).ok_or_else(|| {
            label.error(Error::internal(
                "work",
                "the call came back with buffers of another type",
            ))
        })
    }
}
