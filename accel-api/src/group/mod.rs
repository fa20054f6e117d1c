//! The backend kit: a small static [`Engine`] trait that backends implement,
//! and one generic [`Group`] that turns any engine into a [`Communicator`].
//!
//! wgpu-hal's rule applies: anything that can be handled in
//! backend-independent code is. A backend's engine only drives its library,
//! on arguments the group has already checked. The group owns, once for
//! every engine (and for dlopen plugins):
//!
//! * identity (backend name, rank, world size, device, timeout) and the
//!   [`Capabilities`], read once;
//! * the capability check and every argument check, before any
//!   communication: roots and peers in range, buffer lengths and dtypes, all
//!   buffers of a call on the communicator's device;
//! * zero-length collectives (no engine call but the call check: every rank
//!   passes the same length, which the check confirms, so every rank skips);
//! * [`ReduceOp::Avg`] for engines without a native average: the engine sums,
//!   the group divides ([`HostBufMut::divide_by`]), so averages agree
//!   everywhere;
//! * the send-to-self mailbox (sends to self are buffered; the engine never
//!   sees `dst == rank` for host memory);
//! * one call at a time, in order, with failure poisoning: the first error
//!   that [`Error::is_fatal_for_group`] poisons the group, the engine is told
//!   ([`Engine::on_fatal`]), and every later call returns
//!   [`ErrorKind::Poisoned`] naming that first failure;
//! * error context: every error leaves with the backend, the rank and the
//!   operation attached;
//! * the call check (`check.rs`, ADR 0016): before every collective
//!   the ranks compare its operation, element type, length, root and
//!   reduction with one tiny all-gather through the engine, so that a
//!   mismatched call is an [`ErrorKind::Mismatch`] error on every rank and
//!   never reaches the engine (where mismatched lengths read or write past
//!   buffers, abort the process or return wrong answers).
//!
//! The files: [`Engine`] and [`EngineInfo`] in `engine.rs`, [`SplitPlan`]
//! in `split.rs`, the point-to-point header engines send ([`P2pHeader`]) in
//! `p2p.rs`, the poll loop against a timeout ([`Deadline`], [`Backoff`])
//! in `deadline.rs`, the group's state and its call machinery (poison, call
//! check, mailbox) here, and its [`Communicator`] methods in
//! `communicator.rs`.

mod communicator;
mod deadline;
mod engine;
mod exec;
mod mailbox;
mod p2p;
mod recorder;
mod split;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod work_tests;

pub use deadline::{
    timeout_error, Backoff, Clock, Deadline, Expired, Growth, Pause, Polled, Poller, SystemClock,
    Until, TIMEOUT_FIX,
};
pub use engine::{host, host_mut, message_does_not_fit, Engine, EngineInfo};
pub use exec::on_group_worker;
pub use mailbox::{Mailbox, Taken};
pub use p2p::{P2pHeader, P2P_MAGIC};
pub use recorder::{
    flight_recorders, ring_size_from_env, CallRecord, CallState, FlightRecorder, GroupIdentity,
    DEFAULT_RING, FLIGHT_RECORDER_ENV,
};
pub use split::SplitPlan;

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::check::{self, CallCheck, Digits, Plan, Shape, DIGITS};
use crate::sync::lock;
use crate::{BufMut, DType, Error, ErrorKind, HostBufMut, Op, ReduceOp, Result};
use exec::{Turn, Worker};

/// Any [`Engine`] as a [`Communicator`](crate::Communicator): the checks, poisoning, mailbox,
/// average and error context described at the top of `accel-api/src/group/mod.rs`.
///
/// Backends name their communicator as an alias
/// (`pub type GlooCommunicator = Group<GlooEngine>`); engine-specific
/// accessors are reached through [`Group::engine`].
pub struct Group<E: Engine> {
    /// What the calls in flight share with the group.
    core: Arc<Core<E>>,
    /// Tickets, sequence numbers and the worker's queue, under one lock:
    /// the queue's order is the tickets' order.
    issue: Mutex<Issue>,
    /// This group's call-check setting and how its engine runs the check.
    check: CallCheck,
    plan: Option<Plan>,
}

/// What the group shares with its calls in flight (the worker's jobs hold
/// it after the caller has moved on).
pub(crate) struct Core<E: Engine> {
    engine: E,
    info: EngineInfo,
    /// The first group-fatal failure, rendered.
    poisoned: Mutex<Option<String>>,
    /// Host messages sent to self, waiting for their `recv`.
    mailbox: Mailbox<Vec<u8>>,
    /// Calls run one at a time, in ticket (issue) order.
    turn: Turn,
    /// The last calls, for dumps (`None`: `ACCEL_FLIGHT_RECORDER=0`).
    recorder: Option<Arc<FlightRecorder>>,
}

#[derive(Debug, Default)]
struct Issue {
    next_ticket: u64,
    /// Collectives issued so far (the same on every rank).
    next_seq: u64,
    /// Runs calls started without waiting; made on the first one.
    worker: Option<Worker>,
}

/// What admission gives a call: its place in issue order, its sequence
/// number among collectives, and the call check it runs first, if any.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    n: u64,
    seq: Option<u64>,
    check: Option<(Plan, CallCheck)>,
}

/// The group's identity, then the engine (whose own `Debug` shows only its
/// state: the identity is stated here, once).
impl<E: Engine + fmt::Debug> fmt::Debug for Group<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("backend", &self.core.info.backend)
            .field("rank", &self.core.info.rank)
            .field("world_size", &self.core.info.world_size)
            .field("device", &self.core.info.device)
            .field("engine", &self.core.engine)
            .field("poisoned", &self.core.poison_text())
            .finish_non_exhaustive()
    }
}

impl<E: Engine> Group<E> {
    /// Wrap `engine`, reading its identity and capabilities once. The call
    /// check follows [`CallCheck::scoped`] when set, else
    /// [`CallCheck::from_env`] (`ACCEL_CHECK_CALLS`; a malformed value
    /// keeps the check on: `accel::state()` reports it).
    pub fn new(engine: E) -> Group<E> {
        Group::named(engine, "world".into())
    }

    /// [`new`](Self::new) for the group called `name` in flight-recorder
    /// dumps (`world`, or the path of splits that made it).
    fn named(engine: E, name: String) -> Group<E> {
        let info = engine.info().clone();
        let identity = GroupIdentity {
            backend: info.backend.clone(),
            rank: info.rank,
            world_size: info.world_size,
            name,
        };
        Group {
            plan: check::plan(&info.capabilities),
            core: Arc::new(Core {
                mailbox: Mailbox::new(info.rank),
                info,
                engine,
                poisoned: Mutex::new(None),
                turn: Turn::default(),
                recorder: FlightRecorder::new(identity, ring_size_from_env()),
            }),
            issue: Mutex::new(Issue::default()),
            check: CallCheck::for_new_group(),
        }
    }

    /// Builder: this group's call-check setting (sub-groups made by
    /// `split` inherit it). Every rank of the group must use the same
    /// setting; the first collective compares it.
    pub fn with_call_check(mut self, check: CallCheck) -> Group<E> {
        self.check = check;
        self
    }

    /// Builder: no call check at all, not even on the first collective.
    /// For glue tests against engine stubs that cannot run a collective
    /// across ranks; a program that does this gives up the guarantee that
    /// mismatched calls never reach the engine (ADR 0016).
    pub fn without_call_check(mut self) -> Group<E> {
        self.plan = None;
        self
    }

    /// This group's call-check setting.
    pub fn call_check(&self) -> CallCheck {
        self.check
    }

    /// Collectives this group has issued (checked or not; blocking or
    /// started without waiting).
    pub fn collectives_entered(&self) -> u64 {
        lock(&self.issue).next_seq
    }

    /// The engine, for backend-specific accessors.
    pub fn engine(&self) -> &E {
        &self.core.engine
    }

    /// The first failure that poisoned the group, if any.
    pub fn poison_text(&self) -> Option<String> {
        self.core.poison_text()
    }

    /// This group's flight recorder (`None` when turned off).
    pub fn flight_recorder(&self) -> Option<&Arc<FlightRecorder>> {
        self.core.recorder.as_ref()
    }

    /// The next ticket, and a sequence number for a collective.
    fn ticket(&self, issue: &mut Issue, collective: bool) -> Ticket {
        let n = issue.next_ticket;
        issue.next_ticket += 1;
        let seq = collective.then(|| {
            issue.next_seq += 1;
            issue.next_seq - 1
        });
        let check = match (self.plan, seq) {
            (Some(plan), Some(seq))
                if self.core.info.world_size > 1 && (self.check == CallCheck::On || seq == 0) =>
            {
                Some((plan, self.check))
            }
            _ => None,
        };
        Ticket { n, seq, check }
    }

    /// Admit a call the caller runs itself (a blocking call).
    fn admit(&self, collective: bool) -> Ticket {
        let mut issue = lock(&self.issue);
        self.ticket(&mut issue, collective)
    }

    /// Admit a call the worker runs: `job` gets its ticket (none for a
    /// call that takes no turn: `ticketed` is `None`; `Some(true)` for a
    /// collective) and is queued under the same lock, so the queue keeps
    /// ticket order. Returns the collective's sequence number. Without a
    /// worker thread (the system refused one) the caller runs the job.
    fn admit_queued(
        &self,
        ticketed: Option<bool>,
        info: crate::CallInfo,
        recorder: Option<Arc<FlightRecorder>>,
        job: impl FnOnce(Option<Ticket>) + Send + 'static,
    ) -> Option<u64> {
        let mut issue = lock(&self.issue);
        let t = ticketed.map(|collective| self.ticket(&mut issue, collective));
        if let (Some(t), Some(r)) = (t, &recorder) {
            r.issued(t.n, t.seq, &info, true);
        }
        if issue.worker.is_none() {
            let name = format!("accel-{}-r{}", self.core.info.backend, self.core.info.rank);
            issue.worker = Worker::spawn(name).ok();
        }
        let job: exec::Job = Box::new(move || job(t));
        let refused = match &issue.worker {
            Some(w) => w.push(job).err(),
            None => Some(job),
        };
        drop(issue);
        if let Some(job) = refused {
            tracing::warn!(
                "no worker thread for {} rank {}: a started call runs in the caller",
                self.core.info.backend,
                self.core.info.rank
            );
            job();
        }
        t.and_then(|t| t.seq)
    }
}

impl<E: Engine> Drop for Group<E> {
    /// Calls started without waiting complete before the group goes.
    fn drop(&mut self) {
        let worker = lock(&self.issue).worker.take();
        drop(worker);
    }
}

impl<E: Engine> Core<E> {
    /// The first failure that poisoned the group, if any.
    pub(crate) fn poison_text(&self) -> Option<String> {
        lock(&self.poisoned).clone()
    }

    fn context(&self, op: Op, e: Error) -> Error {
        e.with_backend(self.info.backend.as_str())
            .with_rank(self.info.rank)
            .with_op(op.name())
    }

    fn poisoned_error(&self, op: Op, why: String) -> Error {
        self.context(op, Error::new(ErrorKind::Poisoned, why)).with_fix(
            "this group is unusable after that failure: shut down and restart the run (the launcher can restart it)",
        )
    }

    fn check_poison(&self, op: Op) -> Result<()> {
        match self.poison_text() {
            Some(why) => Err(self.poisoned_error(op, why)),
            None => Ok(()),
        }
    }

    /// Record `err` as the first failure (kept if one is recorded).
    fn poison(&self, err: &Error) -> bool {
        let mut p = lock(&self.poisoned);
        let first = p.is_none();
        if first {
            *p = Some(err.to_string());
        }
        drop(p);
        self.mailbox.wake();
        first
    }

    /// Attach context to `e`; poison and tell the engine when it is fatal.
    fn fail(&self, op: Op, e: Error) -> Error {
        let e = self.context(op, e);
        if e.is_fatal_for_group() && self.poison(&e) {
            self.engine.on_fatal(&e);
        }
        e
    }

    /// Poison the group with `reason` and interrupt the engine (what
    /// [`Communicator::abort`](crate::Communicator::abort) does).
    fn abort_now(&self, reason: &str) {
        let err = Error::new(ErrorKind::Aborted, format!("aborted: {reason}"));
        {
            let mut p = lock(&self.poisoned);
            if p.is_none() {
                *p = Some(err.message().to_string());
            }
        }
        self.engine.abort(reason);
        // Wake a receive from self so that it sees the poison.
        self.mailbox.wake();
    }

    /// Run one engine call in its turn (the caller holds it): `f` gets the
    /// engine and whether the call check ran (the check synchronises every
    /// rank, so a barrier needs nothing more). With `shape` (a collective)
    /// the call check of the ticket runs first, in the same turn, so that
    /// no other call comes between them.
    fn run_turn<T>(
        &self,
        t: Ticket,
        op: Op,
        shape: Option<&Shape>,
        f: impl FnOnce(&E, bool) -> Result<T>,
    ) -> Result<T> {
        self.record(t.n, CallState::Started);
        let out = self.run_turn_inner(t, op, shape, f);
        let state = if out.is_ok() {
            CallState::Completed
        } else {
            CallState::Failed
        };
        self.record(t.n, state);
        out
    }

    /// Move call `ticket` to `state` in the flight recorder.
    fn record(&self, ticket: u64, state: CallState) {
        if let Some(r) = &self.recorder {
            r.set(ticket, state);
        }
    }

    fn run_turn_inner<T>(
        &self,
        t: Ticket,
        op: Op,
        shape: Option<&Shape>,
        f: impl FnOnce(&E, bool) -> Result<T>,
    ) -> Result<T> {
        // Another call may have failed (or aborted) while this one waited.
        self.check_poison(op)?;
        let checked = match (t.check, shape, t.seq) {
            (Some((plan, mode)), Some(shape), Some(seq)) => {
                self.exchange(plan, mode, seq, shape).map_err(|e| {
                    // The engine named its own call; the caller's is `op`.
                    let e = match e.kind() {
                        ErrorKind::Mismatch { .. } => e,
                        _ => e.replace_op(op.name()).with_detail(format!(
                            "in the call check before {op} #{seq} (an exchange of every rank's call shape)"
                        )),
                    };
                    self.fail(op, e)
                })?;
                true
            }
            _ => false,
        };
        f(&self.engine, checked).map_err(|e| self.fail(op, e))
    }

    /// The call check of collective `seq` (see `check.rs`).
    fn exchange(&self, plan: Plan, mode: CallCheck, seq: u64, shape: &Shape) -> Result<()> {
        let mine = check::encode(shape, mode);
        match plan {
            Plan::Max(t) => {
                let mut d = Digits::new(t, &check::with_negation(&mine), 0);
                self.engine.all_reduce(d.buf_mut(), ReduceOp::Max)?;
                if check::agreed(&d.values()) {
                    return Ok(());
                }
                // Every rank saw the disagreement (no all-gather here to
                // name the ranks: this plan is for engines without one).
                Err(check::mismatch_fields(
                    seq,
                    self.info.rank,
                    self.info.world_size,
                    &mine,
                    &d.values(),
                ))
            }
            Plan::Gather(t) => {
                let all = self.gather_digits(t, &mine)?;
                if check::all_equal(&all) {
                    Ok(())
                } else {
                    Err(check::mismatch(seq, &all))
                }
            }
        }
    }

    /// Every rank's digits, rank-major.
    fn gather_digits(&self, t: DType, mine: &[i64; DIGITS]) -> Result<Vec<i64>> {
        let send = Digits::new(t, mine, 0);
        let mut all = Digits::new(t, &[], DIGITS * self.info.world_size);
        self.engine.all_gather(send.buf(), all.buf_mut())?;
        Ok(all.values())
    }

    /// The reduction the engine is asked for, and whether the group divides.
    fn native(&self, op: ReduceOp) -> (ReduceOp, bool) {
        if op == ReduceOp::Avg && !E::NATIVE_AVG {
            (ReduceOp::Sum, true)
        } else {
            (op, false)
        }
    }

    /// The second half of an average the engine does not compute: every
    /// element divided by the world size, in the caller's turn.
    fn divide(&self, e: &E, buf: BufMut<'_>) -> Result<()> {
        match buf {
            BufMut::Host(mut h) => {
                h.divide_by(self.info.world_size);
                Ok(())
            }
            BufMut::Device(d) => e.divide_device(d, self.info.world_size),
        }
    }

    fn recv_self(&self, mut dst: HostBufMut<'_>, tag: u32) -> Result<()> {
        let op = Op::Recv;
        let deadline = Instant::now() + self.info.timeout;
        let (from, want) = ((self.info.rank, tag), (dst.dtype(), dst.len()));
        let taken = self
            .mailbox
            .wait_take(from, want, deadline, || self.check_poison(op))?;
        match taken {
            Taken::Fits(msg) => {
                dst.bytes_mut().copy_from_slice(&msg);
                Ok(())
            }
            Taken::Misfit(text) => Err(self.context(op, Error::invalid_argument(op.name(), text))),
            Taken::Empty => {
                // Nothing crossed the wire: the group is still in step.
                let err = Error::timeout(
                    op.name(),
                    self.info.timeout,
                    format!("no message with tag {tag} was sent to self"),
                )
                .with_fix("send to self before receiving from self")
                .with_fatal(false);
                Err(self.fail(op, err))
            }
        }
    }
}
