//! Work in flight: collectives and point-to-point calls started without
//! waiting (ADR 0029).
//!
//! [`Communicator::start`] takes a [`Call`] whose buffers it **owns** and
//! returns a [`Pending`] handle at once; [`StartExt`] gives the typed forms
//! (`start_all_reduce(buf, op) -> Work<B>`) that hand the buffers back from
//! [`Work::wait`]. Because the handle owns its buffers, the compiler forbids
//! touching them until the call completed, and soundness does not rest on
//! a destructor running: a handle that is leaked (`mem::forget`) leaves its
//! buffers with the engine, never a dangling write into memory the program
//! reused.
//!
//! # Behavior common to every handle
//!
//! * **Issue order.** Calls on one communicator run in the order they were
//!   issued (started or called blocking), as NCCL and MPI promise, whatever
//!   thread issued them. Every rank must issue the same collectives in the
//!   same order, as for blocking calls.
//! * **Errors at issue, errors at completion.** [`Communicator::start`]
//!   returns the errors it can see without communicating (capability,
//!   argument and poison checks) at once; what happens on the wire
//!   (timeouts, lost peers, a mismatched call found by the call check) is
//!   returned by [`Work::wait`], naming the rank, the operation with its
//!   sequence number (`all_reduce#12`) and the backend.
//! * **Bounded.** Once the engine has begun a call, it ends within the
//!   communicator's timeout (plus a grace for the engine to return);
//!   [`Work::wait`] gives up after that, aborts the communicator and returns
//!   [`ErrorKind::Timeout`]. [`Work::wait_timeout`] waits at most the given
//!   time and never fails.
//! * **Dropped handles wait.** Dropping an unfinished handle waits for it
//!   (bounded as above, then aborting the communicator); its error, if any,
//!   is logged and, when fatal, has poisoned the communicator, so the next
//!   call reports it.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{
    Buf, BufMut, CallInfo, Communicator, DType, Element, Error, HostBuf, HostBufMut, Op, ReduceOp,
    Result,
};

/// How long past the communicator's timeout a handle waits for an engine
/// that began a call before it gives up on the engine itself.
pub const ENGINE_GRACE: Duration = Duration::from_secs(2);

/// Memory a handle can own while its call is in flight: host vectors, or a
/// framework's tensor (a device tensor's owner implements this to hand out
/// [`DeviceBuf`](crate::DeviceBuf) views).
///
/// The views must describe the same memory, element type and length every
/// time they are asked for while the call is in flight.
pub trait OwnedBuf: Any + Send {
    /// A read-only view of the memory.
    fn buf(&self) -> Buf<'_>;

    /// A writable view of the memory.
    fn buf_mut(&mut self) -> BufMut<'_>;
}

impl<T: Element> OwnedBuf for Vec<T> {
    fn buf(&self) -> Buf<'_> {
        Buf::from(self.as_slice())
    }

    fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::from(self.as_mut_slice())
    }
}

impl<T: Element> OwnedBuf for Box<[T]> {
    fn buf(&self) -> Buf<'_> {
        Buf::from(&self[..])
    }

    fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::from(&mut self[..])
    }
}

/// Host memory of a type chosen at run time (a gradient bucket), aligned
/// for every [`DType`].
#[derive(Clone, PartialEq, Eq)]
pub struct HostBytes {
    dtype: DType,
    len: usize,
    words: Vec<u64>,
}

impl fmt::Debug for HostBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBytes({} x {})", self.len, self.dtype)
    }
}

impl HostBytes {
    /// `len` zeroed elements of `dtype`.
    pub fn zeroed(dtype: DType, len: usize) -> HostBytes {
        let words = (len * dtype.size()).div_ceil(8);
        HostBytes {
            dtype,
            len,
            words: vec![0; words],
        }
    }

    /// Reuse this memory for `len` elements of `dtype` (contents
    /// unspecified; grows only when needed).
    pub fn reset(&mut self, dtype: DType, len: usize) {
        let words = (len * dtype.size()).div_ceil(8);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.dtype = dtype;
        self.len = len;
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The elements' bytes.
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len * self.dtype.size()]
    }

    /// The elements' bytes, writable.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let n = self.len * self.dtype.size();
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..n]
    }

    /// A host view.
    pub fn host(&self) -> HostBuf<'_> {
        HostBuf::from_bytes(self.dtype, self.bytes()).expect("whole elements, aligned")
    }

    /// A writable host view.
    pub fn host_mut(&mut self) -> HostBufMut<'_> {
        let dtype = self.dtype;
        HostBufMut::from_bytes(dtype, self.bytes_mut()).expect("whole elements, aligned")
    }
}

impl OwnedBuf for HostBytes {
    fn buf(&self) -> Buf<'_> {
        Buf::Host(self.host())
    }

    fn buf_mut(&mut self) -> BufMut<'_> {
        BufMut::Host(self.host_mut())
    }
}

/// An owned buffer, type-erased.
pub type Owned = Box<dyn OwnedBuf>;

/// One call with the buffers it owns, as [`Communicator::start`] takes it.
/// The requirements on each call are those of the blocking method of the
/// same name.
#[non_exhaustive]
pub enum Call {
    /// [`Communicator::all_reduce`].
    AllReduce {
        /// Reduced in place.
        buf: Owned,
        /// The reduction.
        op: ReduceOp,
    },
    /// [`Communicator::reduce`].
    Reduce {
        /// Reduced in place (the result is guaranteed on `root` only).
        buf: Owned,
        /// The reduction.
        op: ReduceOp,
        /// The rank that gets the result.
        root: usize,
    },
    /// [`Communicator::broadcast`].
    Broadcast {
        /// `root`'s data, written everywhere else.
        buf: Owned,
        /// The rank whose data is copied.
        root: usize,
    },
    /// [`Communicator::all_gather`].
    AllGather {
        /// This rank's contribution.
        send: Owned,
        /// Every rank's contributions, rank-major.
        recv: Owned,
    },
    /// [`Communicator::gather`].
    Gather {
        /// This rank's contribution.
        send: Owned,
        /// Every rank's contributions, on `root`.
        recv: Option<Owned>,
        /// The rank that gathers.
        root: usize,
    },
    /// [`Communicator::scatter`].
    Scatter {
        /// `root`'s chunks.
        send: Option<Owned>,
        /// This rank's chunk.
        recv: Owned,
        /// The rank that scatters.
        root: usize,
    },
    /// [`Communicator::reduce_scatter`].
    ReduceScatter {
        /// This rank's full-size contribution.
        send: Owned,
        /// This rank's chunk of the reduction.
        recv: Owned,
        /// The reduction.
        op: ReduceOp,
    },
    /// [`Communicator::all_to_all`].
    AllToAll {
        /// Chunk `j` goes to rank `j`.
        send: Owned,
        /// Chunk `i` comes from rank `i`.
        recv: Owned,
    },
    /// [`Communicator::send`].
    Send {
        /// The message.
        buf: Owned,
        /// The receiving rank.
        dst: usize,
        /// The message tag.
        tag: u32,
    },
    /// [`Communicator::recv`].
    Recv {
        /// Where the message lands.
        buf: Owned,
        /// The sending rank.
        src: usize,
        /// The message tag.
        tag: u32,
    },
    /// [`Communicator::barrier`].
    Barrier,
}

impl fmt::Debug for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = self.info();
        write!(f, "Call({} of {} x {})", i.op, i.len, i.dtype)
    }
}

/// The borrowed form of a [`Call`]: the same operation with views of its
/// buffers (what blocking calls pass, and what a started call becomes when
/// it runs).
#[non_exhaustive]
#[derive(Debug)]
#[allow(missing_docs)] // the fields of `Call`, as views
pub enum CallMut<'a> {
    AllReduce {
        buf: BufMut<'a>,
        op: ReduceOp,
    },
    Reduce {
        buf: BufMut<'a>,
        op: ReduceOp,
        root: usize,
    },
    Broadcast {
        buf: BufMut<'a>,
        root: usize,
    },
    AllGather {
        send: Buf<'a>,
        recv: BufMut<'a>,
    },
    Gather {
        send: Buf<'a>,
        recv: Option<BufMut<'a>>,
        root: usize,
    },
    Scatter {
        send: Option<Buf<'a>>,
        recv: BufMut<'a>,
        root: usize,
    },
    ReduceScatter {
        send: Buf<'a>,
        recv: BufMut<'a>,
        op: ReduceOp,
    },
    AllToAll {
        send: Buf<'a>,
        recv: BufMut<'a>,
    },
    Send {
        buf: Buf<'a>,
        dst: usize,
        tag: u32,
    },
    Recv {
        buf: BufMut<'a>,
        src: usize,
        tag: u32,
    },
    Barrier,
}

impl CallMut<'_> {
    /// What this call asks for, as a [`Layer`](crate::Layer) sees it.
    pub fn info(&self) -> CallInfo {
        let host = |op, b: &BufMut<'_>| CallInfo::new(op, b.dtype(), b.len());
        let send = |op, b: &Buf<'_>| CallInfo::new(op, b.dtype(), b.len());
        match self {
            CallMut::AllReduce { buf, op } => host(Op::AllReduce, buf).reduce(*op),
            CallMut::Reduce { buf, op, root } => host(Op::Reduce, buf).reduce(*op).root(*root),
            CallMut::Broadcast { buf, root } => host(Op::Broadcast, buf).root(*root),
            CallMut::AllGather { send: s, .. } => send(Op::AllGather, s),
            CallMut::Gather { send: s, root, .. } => send(Op::Gather, s).root(*root),
            CallMut::Scatter { recv, root, .. } => host(Op::Scatter, recv).root(*root),
            CallMut::ReduceScatter { send: s, op, .. } => send(Op::ReduceScatter, s).reduce(*op),
            CallMut::AllToAll { send: s, .. } => send(Op::AllToAll, s),
            CallMut::Send { buf, dst, tag } => send(Op::Send, buf).p2p(*dst, *tag),
            CallMut::Recv { buf, src, tag } => host(Op::Recv, buf).p2p(*src, *tag),
            CallMut::Barrier => CallInfo::new(Op::Barrier, DType::U8, 0),
        }
    }

    /// Run this call with `comm`'s blocking method of the same name.
    ///
    /// # Errors
    /// That method's.
    pub fn run_blocking(self, comm: &(impl Communicator + ?Sized)) -> Result<()> {
        match self {
            CallMut::AllReduce { buf, op } => comm.all_reduce(buf, op),
            CallMut::Reduce { buf, op, root } => comm.reduce(buf, op, root),
            CallMut::Broadcast { buf, root } => comm.broadcast(buf, root),
            CallMut::AllGather { send, recv } => comm.all_gather(send, recv),
            CallMut::Gather { send, recv, root } => comm.gather(send, recv, root),
            CallMut::Scatter { send, recv, root } => comm.scatter(send, recv, root),
            CallMut::ReduceScatter { send, recv, op } => comm.reduce_scatter(send, recv, op),
            CallMut::AllToAll { send, recv } => comm.all_to_all(send, recv),
            CallMut::Send { buf, dst, tag } => comm.send(buf, dst, tag),
            CallMut::Recv { buf, src, tag } => comm.recv(buf, src, tag),
            CallMut::Barrier => comm.barrier(),
        }
    }
}

impl Call {
    /// What this call asks for, as a [`Layer`](crate::Layer) sees it.
    pub fn info(&self) -> CallInfo {
        let one = |op, b: &Owned| CallInfo::new(op, b.buf().dtype(), b.buf().len());
        match self {
            Call::AllReduce { buf, op } => one(Op::AllReduce, buf).reduce(*op),
            Call::Reduce { buf, op, root } => one(Op::Reduce, buf).reduce(*op).root(*root),
            Call::Broadcast { buf, root } => one(Op::Broadcast, buf).root(*root),
            Call::AllGather { send, .. } => one(Op::AllGather, send),
            Call::Gather { send, root, .. } => one(Op::Gather, send).root(*root),
            Call::Scatter { recv, root, .. } => one(Op::Scatter, recv).root(*root),
            Call::ReduceScatter { send, op, .. } => one(Op::ReduceScatter, send).reduce(*op),
            Call::AllToAll { send, .. } => one(Op::AllToAll, send),
            Call::Send { buf, dst, tag } => one(Op::Send, buf).p2p(*dst, *tag),
            Call::Recv { buf, src, tag } => one(Op::Recv, buf).p2p(*src, *tag),
            Call::Barrier => CallInfo::new(Op::Barrier, DType::U8, 0),
        }
    }

    /// Writable views of this call's buffers.
    pub fn views_mut(&mut self) -> CallMut<'_> {
        match self {
            Call::AllReduce { buf, op } => CallMut::AllReduce {
                buf: buf.buf_mut(),
                op: *op,
            },
            Call::Reduce { buf, op, root } => CallMut::Reduce {
                buf: buf.buf_mut(),
                op: *op,
                root: *root,
            },
            Call::Broadcast { buf, root } => CallMut::Broadcast {
                buf: buf.buf_mut(),
                root: *root,
            },
            Call::AllGather { send, recv } => CallMut::AllGather {
                send: send.buf(),
                recv: recv.buf_mut(),
            },
            Call::Gather { send, recv, root } => CallMut::Gather {
                send: send.buf(),
                recv: recv.as_mut().map(|r| r.buf_mut()),
                root: *root,
            },
            Call::Scatter { send, recv, root } => CallMut::Scatter {
                send: send.as_ref().map(|s| s.buf()),
                recv: recv.buf_mut(),
                root: *root,
            },
            Call::ReduceScatter { send, recv, op } => CallMut::ReduceScatter {
                send: send.buf(),
                recv: recv.buf_mut(),
                op: *op,
            },
            Call::AllToAll { send, recv } => CallMut::AllToAll {
                send: send.buf(),
                recv: recv.buf_mut(),
            },
            Call::Send { buf, dst, tag } => CallMut::Send {
                buf: buf.buf(),
                dst: *dst,
                tag: *tag,
            },
            Call::Recv { buf, src, tag } => CallMut::Recv {
                buf: buf.buf_mut(),
                src: *src,
                tag: *tag,
            },
            Call::Barrier => CallMut::Barrier,
        }
    }
}

// ------------------------------------------------------------------ handles

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

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
    /// The label of `op` (number `seq`) on `comm`.
    pub fn of(comm: &(impl Communicator + ?Sized), op: Op, seq: Option<u64>) -> WorkLabel {
        WorkLabel {
            op,
            seq,
            rank: comm.rank(),
            backend: comm.backend_name().to_string(),
            timeout: comm.timeout(),
        }
    }

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

/// A started call, type-erased: what [`Communicator::start`] returns.
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
    /// finish at once, and the default [`Communicator::start`]).
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
    /// [`ErrorKind::Timeout`] when the engine began the call and did not
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
/// back. Made by [`StartExt`].
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

fn back<B: OwnedBuf>(b: Owned) -> Option<B> {
    let any: Box<dyn Any> = b;
    any.downcast::<B>().ok().map(|b| *b)
}

/// The typed forms of [`Communicator::start`], for every communicator:
/// each takes ownership of its buffers and returns a [`Work`] whose
/// [`wait`](Work::wait) gives them back. Requirements and errors are those
/// of the blocking method of the same name; errors that need no
/// communication come at once, the others from `wait`.
pub trait StartExt: Communicator {
    /// [`Communicator::all_reduce`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_all_reduce<B: OwnedBuf>(&self, buf: B, op: ReduceOp) -> Result<Work<B>> {
        let p = self.start(Call::AllReduce {
            buf: Box::new(buf),
            op,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::AllReduce { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::reduce`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_reduce<B: OwnedBuf>(&self, buf: B, op: ReduceOp, root: usize) -> Result<Work<B>> {
        let p = self.start(Call::Reduce {
            buf: Box::new(buf),
            op,
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Reduce { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::broadcast`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_broadcast<B: OwnedBuf>(&self, buf: B, root: usize) -> Result<Work<B>> {
        let p = self.start(Call::Broadcast {
            buf: Box::new(buf),
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Broadcast { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::all_gather`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_all_gather<S: OwnedBuf, R: OwnedBuf>(&self, send: S, recv: R) -> Result<Work<(S, R)>> {
        let p = self.start(Call::AllGather {
            send: Box::new(send),
            recv: Box::new(recv),
        })?;
        Ok(Work::new(p, |c| match c {
            Call::AllGather { send, recv } => Some((back(send)?, back(recv)?)),
            _ => None,
        }))
    }

    /// [`Communicator::gather`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_gather<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: S,
        recv: Option<R>,
        root: usize,
    ) -> Result<Work<(S, Option<R>)>> {
        let p = self.start(Call::Gather {
            send: Box::new(send),
            recv: recv.map(|r| Box::new(r) as Owned),
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Gather { send, recv, .. } => {
                let recv = match recv {
                    Some(r) => Some(back(r)?),
                    None => None,
                };
                Some((back(send)?, recv))
            }
            _ => None,
        }))
    }

    /// [`Communicator::scatter`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_scatter<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: Option<S>,
        recv: R,
        root: usize,
    ) -> Result<Work<(Option<S>, R)>> {
        let p = self.start(Call::Scatter {
            send: send.map(|s| Box::new(s) as Owned),
            recv: Box::new(recv),
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Scatter { send, recv, .. } => {
                let send = match send {
                    Some(s) => Some(back(s)?),
                    None => None,
                };
                Some((send, back(recv)?))
            }
            _ => None,
        }))
    }

    /// [`Communicator::reduce_scatter`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_reduce_scatter<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: S,
        recv: R,
        op: ReduceOp,
    ) -> Result<Work<(S, R)>> {
        let p = self.start(Call::ReduceScatter {
            send: Box::new(send),
            recv: Box::new(recv),
            op,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::ReduceScatter { send, recv, .. } => Some((back(send)?, back(recv)?)),
            _ => None,
        }))
    }

    /// [`Communicator::all_to_all`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_all_to_all<S: OwnedBuf, R: OwnedBuf>(&self, send: S, recv: R) -> Result<Work<(S, R)>> {
        let p = self.start(Call::AllToAll {
            send: Box::new(send),
            recv: Box::new(recv),
        })?;
        Ok(Work::new(p, |c| match c {
            Call::AllToAll { send, recv } => Some((back(send)?, back(recv)?)),
            _ => None,
        }))
    }

    /// [`Communicator::send`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_send<B: OwnedBuf>(&self, buf: B, dst: usize, tag: u32) -> Result<Work<B>> {
        let p = self.start(Call::Send {
            buf: Box::new(buf),
            dst,
            tag,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Send { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::recv`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_recv<B: OwnedBuf>(&self, buf: B, src: usize, tag: u32) -> Result<Work<B>> {
        let p = self.start(Call::Recv {
            buf: Box::new(buf),
            src,
            tag,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Recv { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::barrier`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_barrier(&self) -> Result<Work<()>> {
        let p = self.start(Call::Barrier)?;
        Ok(Work::new(p, |c| match c {
            Call::Barrier => Some(()),
            _ => None,
        }))
    }
}

impl<C: Communicator + ?Sized> StartExt for C {}

/// What [`Communicator::start`] does for a communicator that does not
/// override it: the blocking method, now, and a completed handle.
pub(crate) fn start_blocking(comm: &(impl Communicator + ?Sized), mut call: Call) -> Pending {
    let op = call.info().op;
    let result = call.views_mut().run_blocking(comm);
    Pending::completed(WorkLabel::of(comm, op, None), result, call)
}
