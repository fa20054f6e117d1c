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
//! * the call check ([`crate::check`], ADR 0016): before every collective
//!   the ranks compare its operation, element type, length, root and
//!   reduction with one tiny all-gather through the engine, so that a
//!   mismatched call is an [`ErrorKind::Mismatch`] error on every rank and
//!   never reaches the engine (where mismatched lengths read or write past
//!   buffers, abort the process or return wrong answers).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::check::{self, CallCheck, Digits, Plan, Shape, DIGITS};
use crate::{
    validate, Buf, BufMut, Capabilities, Communicator, ConnectContext, DType, Device, DeviceBufMut,
    Error, ErrorKind, HostBuf, HostBufMut, Op, ReduceOp, Result,
};

/// The calls into one collective engine (Gloo, MPI, NCCL, PJRT, HCCL, a
/// plugin), wrapped by [`Group`] into a [`Communicator`].
///
/// Every method is called by the group only after its checks passed, one at
/// a time (the group serialises calls), so an engine may assume:
///
/// * the operation, element type, reduction and device kind are in its
///   [`capabilities`](EngineInfo::capabilities);
/// * roots and peers are ranks of the group; buffer lengths and dtypes
///   satisfy the [`Communicator`] method's requirements; every buffer is on
///   the communicator's [`device`](EngineInfo::device);
/// * collectives get at least one element (zero-length calls never reach the
///   engine; point-to-point calls may carry zero elements);
/// * every rank of the group passes the same operation, element type,
///   length, root and reduction, in the same order (the call check, unless
///   `ACCEL_CHECK_CALLS=0`): besides the caller's collectives, the engine
///   receives the check's own `all_gather` before each of them (9 elements
///   per rank of `i32`, `i64`, `f32` or `f64`, the first of those its
///   capabilities take; without an all-gather, an `all_reduce` with `Max`
///   of 18 elements, and an all-gather after a disagreement);
/// * reductions never get [`ReduceOp::Avg`] unless
///   [`NATIVE_AVG`](Engine::NATIVE_AVG) says the engine computes it;
/// * `send`/`recv` never get `self.rank()` as the peer for host memory
///   (the group's mailbox handles it).
///
/// Errors are returned as they are: the group attaches the backend, rank and
/// operation, and poisons the group when the error is fatal. An engine that
/// knows better than the error's kind marks it with
/// [`Error::with_fatal`].
pub trait Engine: Send + Sync + Sized + 'static {
    /// `true` when the engine computes [`ReduceOp::Avg`] itself; otherwise
    /// (the default) the group asks for a sum and divides.
    const NATIVE_AVG: bool = false;

    /// Who this engine's group is (backend, rank, size, device, timeout)
    /// and what it accepts; read once by [`Group::new`], constant for the
    /// engine's lifetime.
    fn info(&self) -> &EngineInfo;

    /// [`Communicator::all_reduce`] on checked arguments.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// [`Communicator::reduce`] on checked arguments.
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()>;

    /// [`Communicator::broadcast`] on checked arguments.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;

    /// [`Communicator::all_gather`] on checked arguments.
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// [`Communicator::gather`] on checked arguments: `recv` is `Some`
    /// exactly on `root`.
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()>;

    /// [`Communicator::scatter`] on checked arguments: `send` is `Some`
    /// exactly on `root`.
    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()>;

    /// [`Communicator::reduce_scatter`] on checked arguments.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// [`Communicator::all_to_all`] on checked arguments.
    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// [`Communicator::send`] to another rank (or to self for device memory).
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()>;

    /// [`Communicator::recv`] from another rank (or from self for device
    /// memory). A message whose size or dtype differs from `buf` is an
    /// [`ErrorKind::InvalidArgument`] error (the message is dropped), never a
    /// partial write.
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()>;

    /// [`Communicator::barrier`].
    fn barrier(&self) -> Result<()>;

    /// [`Communicator::split`]: the engine of this rank's sub-group, `None`
    /// when `color` is `None`. [`SplitPlan::exchange`] computes the
    /// membership for engines that take host memory.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>>;

    /// Interrupt a call in flight if the engine can
    /// ([`Capabilities::abort_interrupts`]). Called after the group is
    /// poisoned, possibly from another thread while a call runs; never
    /// blocks. The default does nothing.
    fn abort(&self, reason: &str) {
        let _ = reason;
    }

    /// Told once, under the group's call lock, when an engine call failed
    /// with a group-fatal error (publish the cause for peers, close
    /// connections so that they notice). The default does nothing.
    fn on_fatal(&self, err: &Error) {
        let _ = err;
    }

    /// Divide every element of a device buffer by `n` (the second half of
    /// [`ReduceOp::Avg`] when the engine has no native average). Host
    /// buffers are divided by the group. The default returns
    /// [`ErrorKind::Unsupported`]: an engine that takes device memory
    /// declares `Avg` only if it has a native average or overrides this.
    fn divide_device(&self, buf: DeviceBufMut<'_>, n: usize) -> Result<()> {
        let _ = n;
        Err(Error::unsupported(
            "divide",
            format!(
                "averaging {} memory needs a native average or a device division",
                buf.device()
            ),
        ))
    }
}

/// The identity of one engine's group and what it accepts: what
/// [`Communicator::backend_name`], [`rank`](Communicator::rank),
/// [`world_size`](Communicator::world_size),
/// [`device`](Communicator::device), [`timeout`](Communicator::timeout)
/// and [`capabilities`](Communicator::capabilities) return.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// The backend's registered name.
    pub backend: String,
    /// This process's rank in the group.
    pub rank: usize,
    /// Number of ranks in the group.
    pub world_size: usize,
    /// The device the group was connected for.
    pub device: Device,
    /// The bound every blocking engine call honours (sub-groups inherit it).
    pub timeout: Duration,
    /// What the engine accepts (sub-groups inherit it).
    pub capabilities: Capabilities,
}

impl EngineInfo {
    /// The identity of the world group `ctx` describes, for `backend`,
    /// whose engine accepts `capabilities`.
    pub fn world(backend: &str, ctx: &ConnectContext, capabilities: Capabilities) -> EngineInfo {
        EngineInfo {
            backend: backend.to_string(),
            rank: ctx.rank,
            world_size: ctx.world_size,
            device: ctx.device,
            timeout: ctx.timeout,
            capabilities,
        }
    }

    /// The identity of a sub-group made by `split`: same backend, device,
    /// timeout and capabilities, this rank's new rank and size.
    pub fn sub(&self, plan: &SplitPlan) -> EngineInfo {
        EngineInfo {
            rank: plan.new_rank,
            world_size: plan.members.len(),
            ..self.clone()
        }
    }
}

/// The host view of a buffer an engine was promised to be host memory
/// (its capabilities take only [`DeviceKind::Cpu`](crate::DeviceKind::Cpu)).
///
/// # Errors
/// [`ErrorKind::Internal`] for a device view (the group's checks let it
/// through: a bug).
pub fn host(op: Op, b: Buf<'_>) -> Result<HostBuf<'_>> {
    b.host().ok_or_else(|| not_host(op))
}

/// As [`host`], for a writable buffer.
///
/// # Errors
/// [`ErrorKind::Internal`] for a device view.
pub fn host_mut(op: Op, b: BufMut<'_>) -> Result<HostBufMut<'_>> {
    b.into_host().ok_or_else(|| not_host(op))
}

fn not_host(op: Op) -> Error {
    Error::internal(
        op.name(),
        "a device buffer reached a host-only engine past the capability check",
    )
}

/// Who is in which sub-group after a [`Communicator::split`]: what every
/// engine needs to build its sub-group, computed from the `(color, key)` of
/// every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitPlan {
    /// This rank's color (`None`: it opted out).
    pub color: Option<u32>,
    /// Index of this rank's color among the distinct colors in increasing
    /// order (for engines that want dense colors, like `MPI_Comm_split`).
    pub color_index: usize,
    /// Members of this rank's sub-group as parent ranks, ordered by
    /// `(key, parent rank)`: position `i` is the new rank `i`. Empty when
    /// `color` is `None`.
    pub members: Vec<usize>,
    /// This rank's rank in the sub-group.
    pub new_rank: usize,
}

impl SplitPlan {
    /// The plan of `rank` from every rank's `[color or -1, key]`, laid out
    /// rank-major (`all[2 * r]`, `all[2 * r + 1]`).
    ///
    /// # Errors
    /// [`ErrorKind::Internal`] when `all` does not have two entries per rank
    /// or does not contain this rank's own color.
    pub fn from_exchanged(rank: usize, color: Option<u32>, all: &[i64]) -> Result<SplitPlan> {
        if !all.len().is_multiple_of(2) || rank >= all.len() / 2 {
            return Err(Error::internal(
                Op::Split.name(),
                format!("split exchange has {} values for rank {rank}", all.len()),
            ));
        }
        let world = all.len() / 2;
        let Some(c) = color else {
            return Ok(SplitPlan {
                color: None,
                color_index: 0,
                members: Vec::new(),
                new_rank: 0,
            });
        };
        let c = i64::from(c);
        let mut distinct: Vec<i64> = (0..world).map(|r| all[2 * r]).filter(|&x| x >= 0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let mut members: Vec<(i64, usize)> = (0..world)
            .filter(|&r| all[2 * r] == c)
            .map(|r| (all[2 * r + 1], r))
            .collect();
        members.sort_unstable();
        let members: Vec<usize> = members.into_iter().map(|(_, r)| r).collect();
        let new_rank = members.iter().position(|&r| r == rank).ok_or_else(|| {
            Error::internal(
                Op::Split.name(),
                "this rank is missing from its own color after the exchange",
            )
        })?;
        Ok(SplitPlan {
            color,
            color_index: distinct.iter().position(|&x| x == c).unwrap_or(0),
            members,
            new_rank,
        })
    }

    /// Exchange `(color, key)` with an all-gather of two `i64` per rank on
    /// host memory through `engine`, then compute the plan. For engines
    /// whose capabilities include host memory and `i64` all-gathers.
    ///
    /// # Errors
    /// The all-gather's errors.
    pub fn exchange<E: Engine>(engine: &E, color: Option<u32>, key: u32) -> Result<SplitPlan> {
        let mine = [color.map_or(-1, i64::from), i64::from(key)];
        let mut all = vec![0i64; 2 * engine.info().world_size];
        engine.all_gather(
            Buf::Host(HostBuf::from(&mine[..])),
            BufMut::Host(HostBufMut::from(&mut all[..])),
        )?;
        SplitPlan::from_exchanged(engine.info().rank, color, &all)
    }
}

/// A message sent to self, waiting for its `recv`.
type Mail = (DType, Vec<u8>);

/// Any [`Engine`] as a [`Communicator`]: the checks, poisoning, mailbox,
/// average and error context described at the top of `accel-api/src/group.rs`.
///
/// Backends name their communicator as an alias
/// (`pub type GlooCommunicator = Group<GlooEngine>`); engine-specific
/// accessors are reached through [`Group::engine`].
pub struct Group<E: Engine> {
    engine: E,
    info: EngineInfo,
    /// One engine call at a time, in program order.
    serial: Mutex<()>,
    /// The first group-fatal failure, rendered.
    poisoned: Mutex<Option<String>>,
    mailbox: Mutex<HashMap<u32, VecDeque<Mail>>>,
    mail: Condvar,
    /// This group's call-check setting and how its engine runs the check.
    check: CallCheck,
    plan: Option<Plan>,
    /// Collectives entered so far (under `serial`: the same on every rank).
    seq: AtomicU64,
}

/// The group's identity, then the engine (whose own `Debug` shows only its
/// state: the identity is stated here, once).
impl<E: Engine + fmt::Debug> fmt::Debug for Group<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("backend", &self.info.backend)
            .field("rank", &self.info.rank)
            .field("world_size", &self.info.world_size)
            .field("device", &self.info.device)
            .field("engine", &self.engine)
            .field("poisoned", &self.poison_text())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<E: Engine> Group<E> {
    /// Wrap `engine`, reading its identity and capabilities once. The call
    /// check follows [`CallCheck::scoped`] when set, else
    /// [`CallCheck::from_env`] (`ACCEL_CHECK_CALLS`; a malformed value
    /// keeps the check on: `accel::state()` reports it).
    pub fn new(engine: E) -> Group<E> {
        let info = engine.info().clone();
        Group {
            plan: check::plan(&info.capabilities),
            info,
            engine,
            serial: Mutex::new(()),
            poisoned: Mutex::new(None),
            mailbox: Mutex::new(HashMap::new()),
            mail: Condvar::new(),
            check: CallCheck::for_new_group(),
            seq: AtomicU64::new(0),
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

    /// Collectives this group has entered (checked or not).
    pub fn collectives_entered(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    /// The engine, for backend-specific accessors.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The first failure that poisoned the group, if any.
    pub fn poison_text(&self) -> Option<String> {
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
        self.mail.notify_all();
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

    /// The poison and capability check for one call on `device`.
    fn enter(&self, op: Op, dtype: DType, reduce: Option<ReduceOp>, device: Device) -> Result<()> {
        self.check_poison(op)?;
        validate::call(self, op, dtype, reduce, device)?;
        if !device.is_cpu() && device != self.info.device {
            return Err(self.context(
                op,
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "the buffer is on {device}, this communicator on {}",
                        self.info.device
                    ),
                )
                .with_fix("move the buffer to the communicator's device"),
            ));
        }
        Ok(())
    }

    /// Both buffers of a call live in the same place.
    fn same_place(&self, op: Op, a: Device, b: Device) -> Result<()> {
        if a != b {
            return Err(self.context(
                op,
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("the send buffer is on {a}, the receive buffer on {b}"),
                )
                .with_fix("pass both buffers on the same device"),
            ));
        }
        Ok(())
    }

    /// Run one engine call under the call lock.
    fn run<T>(&self, op: Op, f: impl FnOnce(&E) -> Result<T>) -> Result<T> {
        let _g = lock(&self.serial);
        // Another thread may have failed (or aborted) while this one waited.
        self.check_poison(op)?;
        f(&self.engine).map_err(|e| self.fail(op, e))
    }

    /// Run one collective under the call lock: the call check first (every
    /// collective with the check on, the first one always), then `f`,
    /// told whether the check ran (the check synchronises every rank, so a
    /// barrier needs nothing more). Check and call share one lock hold, so
    /// another thread's collective cannot come between them.
    fn run_collective<T>(&self, shape: Shape, f: impl FnOnce(&E, bool) -> Result<T>) -> Result<T> {
        let op = shape.op;
        let _g = lock(&self.serial);
        self.check_poison(op)?;
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let checked = match self.plan {
            Some(plan) if self.info.world_size > 1 && (self.check == CallCheck::On || seq == 0) => {
                self.exchange(plan, seq, &shape).map_err(|e| {
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

    /// The call check of collective `seq` (see [`crate::check`]).
    fn exchange(&self, plan: Plan, seq: u64, shape: &Shape) -> Result<()> {
        let mine = check::encode(shape, self.check);
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

    fn divide(&self, op: Op, buf: BufMut<'_>) -> Result<()> {
        match buf {
            BufMut::Host(mut h) => {
                h.divide_by(self.info.world_size);
                Ok(())
            }
            BufMut::Device(d) => self.run(op, |e| e.divide_device(d, self.info.world_size)),
        }
    }

    fn reduce_common(
        &self,
        op: Op,
        mut buf: BufMut<'_>,
        reduce: ReduceOp,
        root: Option<usize>,
    ) -> Result<()> {
        self.enter(op, buf.dtype(), Some(reduce), buf.device())?;
        let mut shape = Shape::new(op, buf.dtype(), buf.len()).reduce(reduce);
        if let Some(root) = root {
            validate::rank_in_group(self, op, "root", root)?;
            shape = shape.root(root);
        }
        if buf.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        let (native, divide) = self.native(reduce);
        self.run_collective(shape, |e, _| match root {
            None => e.all_reduce(buf.reborrow(), native),
            Some(r) => e.reduce(buf.reborrow(), native, r),
        })?;
        if divide && root.is_none_or(|r| r == self.info.rank) {
            self.divide(op, buf)?;
        }
        Ok(())
    }

    fn recv_self(&self, mut dst: HostBufMut<'_>, tag: u32) -> Result<()> {
        let op = Op::Recv;
        let deadline = Instant::now() + self.info.timeout;
        let mut mb = lock(&self.mailbox);
        loop {
            if let Some((dtype, msg)) = mb.get_mut(&tag).and_then(VecDeque::pop_front) {
                if dtype != dst.dtype() || msg.len() != dst.bytes().len() {
                    return Err(self.context(
                        op,
                        Error::invalid_argument(
                            op.name(),
                            format!(
                                "this rank sent itself {} {dtype} elements with tag {tag}, the receive buffer holds {} {} elements (the message was dropped)",
                                msg.len() / dtype.size(),
                                dst.len(),
                                dst.dtype()
                            ),
                        ),
                    ));
                }
                dst.bytes_mut().copy_from_slice(&msg);
                return Ok(());
            }
            drop(mb);
            self.check_poison(op)?;
            mb = lock(&self.mailbox);
            let now = Instant::now();
            if now >= deadline {
                drop(mb);
                // Nothing crossed the wire: the group is still in step.
                let err = Error::timeout(
                    op.name(),
                    self.info.timeout,
                    format!("no message with tag {tag} was sent to self"),
                )
                .with_fix("send to self before receiving from self")
                .with_fatal(false);
                return Err(self.fail(op, err));
            }
            mb = self
                .mail
                .wait_timeout(mb, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl<E: Engine> Communicator for Group<E> {
    fn backend_name(&self) -> &str {
        &self.info.backend
    }

    fn rank(&self) -> usize {
        self.info.rank
    }

    fn world_size(&self) -> usize {
        self.info.world_size
    }

    fn device(&self) -> Device {
        self.info.device
    }

    fn timeout(&self) -> Duration {
        self.info.timeout
    }

    fn capabilities(&self) -> &Capabilities {
        &self.info.capabilities
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.reduce_common(Op::AllReduce, buf, op, None)
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.reduce_common(Op::Reduce, buf, op, Some(root))
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Broadcast;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "root", root)?;
        let shape = Shape::new(op, buf.dtype(), buf.len()).root(root);
        if buf.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        self.run_collective(shape, |e, _| e.broadcast(buf, root))
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllGather;
        self.enter(op, send.dtype(), None, send.device())?;
        self.same_place(op, send.device(), recv.device())?;
        validate::lengths(
            self,
            op,
            ("send", send.dtype(), send.len()),
            ("recv", recv.dtype(), recv.len()),
            self.info.world_size,
        )?;
        let shape = Shape::new(op, send.dtype(), send.len());
        if send.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        self.run_collective(shape, |e, _| e.all_gather(send, recv))
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let op = Op::Gather;
        self.enter(op, send.dtype(), None, send.device())?;
        let recv = validate::gather(self, &send, recv, root)?;
        if let Some(r) = &recv {
            self.same_place(op, send.device(), r.device())?;
        }
        let shape = Shape::new(op, send.dtype(), send.len()).root(root);
        if send.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        self.run_collective(shape, |e, _| e.gather(send, recv, root))
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Scatter;
        self.enter(op, recv.dtype(), None, recv.device())?;
        let send = validate::scatter(self, send, &recv, root)?;
        if let Some(s) = &send {
            self.same_place(op, s.device(), recv.device())?;
        }
        let shape = Shape::new(op, recv.dtype(), recv.len()).root(root);
        if recv.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        self.run_collective(shape, |e, _| e.scatter(send, recv, root))
    }

    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, reduce: ReduceOp) -> Result<()> {
        let op = Op::ReduceScatter;
        self.enter(op, send.dtype(), Some(reduce), send.device())?;
        self.same_place(op, send.device(), recv.device())?;
        validate::lengths(
            self,
            op,
            ("recv", recv.dtype(), recv.len()),
            ("send", send.dtype(), send.len()),
            self.info.world_size,
        )?;
        let shape = Shape::new(op, recv.dtype(), recv.len()).reduce(reduce);
        if recv.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        let (native, divide) = self.native(reduce);
        self.run_collective(shape, |e, _| {
            e.reduce_scatter(send, recv.reborrow(), native)
        })?;
        if divide {
            self.divide(op, recv)?;
        }
        Ok(())
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllToAll;
        self.enter(op, send.dtype(), None, send.device())?;
        self.same_place(op, send.device(), recv.device())?;
        validate::all_to_all(self, &send, &recv)?;
        let shape = Shape::new(op, send.dtype(), send.len());
        if send.is_empty() {
            return self.run_collective(shape, |_, _| Ok(()));
        }
        self.run_collective(shape, |e, _| e.all_to_all(send, recv))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let op = Op::Send;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "destination", dst)?;
        if let (true, Buf::Host(h)) = (dst == self.info.rank, &buf) {
            lock(&self.mailbox)
                .entry(tag)
                .or_default()
                .push_back((h.dtype(), h.bytes().to_vec()));
            self.mail.notify_all();
            return Ok(());
        }
        self.run(op, |e| e.send(buf, dst, tag))
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let op = Op::Recv;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "source", src)?;
        let buf = match buf {
            BufMut::Host(h) if src == self.info.rank => return self.recv_self(h, tag),
            other => other,
        };
        self.run(op, |e| e.recv(buf, src, tag))
    }

    fn barrier(&self) -> Result<()> {
        let op = Op::Barrier;
        self.enter(op, DType::U8, None, Device::CPU)?;
        // The check's exchange waits for every rank: it is the barrier.
        self.run_collective(Shape::new(op, DType::U8, 0), |e, checked| {
            if checked {
                Ok(())
            } else {
                e.barrier()
            }
        })
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let op = Op::Split;
        self.enter(op, DType::U8, None, Device::CPU)?;
        let sub = self.run_collective(Shape::new(op, DType::U8, 0), |e, _| e.split(color, key))?;
        Ok(sub
            .map(|e| Box::new(Group::new(e).with_call_check(self.check)) as Box<dyn Communicator>))
    }

    fn abort(&self, reason: &str) {
        let err = Error::new(ErrorKind::Aborted, format!("aborted: {reason}"));
        {
            let mut p = lock(&self.poisoned);
            if p.is_none() {
                *p = Some(err.message().to_string());
            }
        }
        self.engine.abort(reason);
        // Wake a receive from self so that it sees the poison.
        self.mail.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommunicatorExt;
    use std::sync::atomic::AtomicUsize;
    use std::sync::{Arc, Barrier};

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
                    capabilities: Capabilities::all_host()
                        .with_reduce_dtypes([DType::F32, DType::I32]),
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
}
