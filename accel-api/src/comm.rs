use std::time::Duration;

use crate::work::{Call, CallMut, Pending, WorkLabel};
use crate::{
    Buf, BufMut, Capabilities, DType, Device, Element, Error, ErrorKind, HostBuf, HostBufMut, Op,
    ReduceOp, Result,
};

/// Collectives over one process group, driven by one engine.
///
/// A `Communicator` is what [`Backend::connect`](crate::Backend::connect)
/// returns. It is object-safe (`Box<dyn Communicator>`), `Send + Sync`, and
/// every method takes `&self`: implementations serialise engine calls
/// internally where the engine requires it.
///
/// # Calling convention
///
/// * **Collective** methods (everything but [`send`](Self::send) and
///   [`recv`](Self::recv)) must be called by every rank of the group, in the
///   same order, with the same element type, the same element counts (as
///   each method specifies) and the same root. Breaking this is a program
///   bug; in debug mode the runtime detects it and returns
///   [`ErrorKind::Mismatch`] with a per-rank table instead of hanging.
/// * Buffers are typed views ([`Buf`], [`BufMut`]) over host memory or, where
///   [`Capabilities::device_kinds`] allows, device memory. Results are
///   written into the caller's buffers; nothing is allocated for the caller.
/// * Layouts are rank-major: chunk `i` of a gathered buffer comes from rank
///   `i`; chunk `i` of a scattered buffer goes to rank `i`.
///
/// # Errors common to every method
///
/// * [`ErrorKind::Unsupported`]: the operation, element type, reduction or
///   device is not in [`capabilities`](Self::capabilities).
/// * [`ErrorKind::InvalidArgument`]: a length, root or peer that breaks the
///   method's requirements (checked before any communication).
/// * [`ErrorKind::Timeout`]: the call did not finish within
///   [`timeout`](Self::timeout).
/// * [`ErrorKind::PeerLost`]: a peer disappeared; the error names it when the
///   engine can tell.
/// * [`ErrorKind::Poisoned`]: an earlier call failed with a group-fatal error
///   (see [`Error::is_fatal_for_group`]) or [`abort`](Self::abort) was
///   called. Every later call returns this, naming the first failure.
///
/// Errors carry the rank, the operation and the backend name.
pub trait Communicator: Send + Sync {
    /// The backend's registered name (`single`, `cpu-gloo`, ...).
    fn backend_name(&self) -> &str;

    /// This process's rank in the group, `0..world_size()`.
    fn rank(&self) -> usize;

    /// Number of ranks in the group (at least 1).
    fn world_size(&self) -> usize;

    /// The device this communicator was connected for.
    fn device(&self) -> Device;

    /// The bound every blocking call of this communicator honours. Groups
    /// made by [`split`](Self::split) inherit it.
    fn timeout(&self) -> Duration;

    /// What this communicator accepts. Constant for its lifetime.
    fn capabilities(&self) -> &Capabilities;

    /// Combine `buf` element-wise across all ranks with `op`; every rank ends
    /// with the result in `buf` (in place).
    ///
    /// Requires: same `len()` and dtype on every rank.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// Like [`all_reduce`](Self::all_reduce) but only `root` is guaranteed
    /// the result; the content of `buf` on the other ranks afterwards is
    /// unspecified.
    ///
    /// Requires: `root < world_size()`; same `len()` on every rank.
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()>;

    /// Copy `buf` of `root` into `buf` of every other rank.
    ///
    /// Requires: `root < world_size()`; same `len()` on every rank.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;

    /// Concatenate every rank's `send` in rank order into every rank's `recv`.
    ///
    /// Requires: `recv.len() == send.len() * world_size()`, same `send.len()`
    /// on every rank, same dtype for both buffers.
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// Concatenate every rank's `send` in rank order into `recv` of `root`.
    ///
    /// Requires: `recv` is `Some` with `len() == send.len() * world_size()`
    /// on `root`; it is ignored (and may be `None`) on the other ranks.
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()>;

    /// Split `send` of `root` into `world_size()` equal chunks; chunk `i` is
    /// written into `recv` of rank `i`.
    ///
    /// Requires: on `root`, `send` is `Some` with
    /// `len() == recv.len() * world_size()`; ignored elsewhere.
    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()>;

    /// Reduce `send` element-wise across ranks with `op`, then give rank `i`
    /// chunk `i` of the result in `recv`.
    ///
    /// Requires: `send.len() == recv.len() * world_size()` on every rank.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// Chunk `j` of rank `i`'s `send` lands in chunk `i` of rank `j`'s `recv`.
    ///
    /// Requires: `send.len() == recv.len()`, divisible by `world_size()`,
    /// same on every rank.
    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// Send `buf` to rank `dst` with `tag`. Point-to-point: only `dst` takes
    /// part, with a matching [`recv`](Self::recv) (same tag, same length).
    ///
    /// May block until the matching receive is posted (as MPI's standard
    /// mode); programs must not rely on buffering, except for sends to self,
    /// which are buffered so that a later `recv` from self completes.
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()>;

    /// Receive into `buf` from rank `src` a message sent with `tag`.
    ///
    /// Requires: the message has exactly `buf.len()` elements of the same
    /// dtype.
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()>;

    /// Block until every rank of the group has entered the barrier.
    fn barrier(&self) -> Result<()>;

    /// Collective: partition the group by `color` (MPI_Comm_split). Ranks with
    /// the same `Some(color)` form a new group, ordered by `(key, rank)`; a
    /// rank passing `None` takes part in the call and gets `Ok(None)`.
    ///
    /// The new communicator inherits the backend, device and timeout.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>>;

    /// Start `call` and return at once with its handle; the call runs in
    /// issue order with every other call on this communicator (blocking or
    /// started), from any thread, and its buffers stay with the handle
    /// until [`Pending::wait`](crate::work::Pending::wait) gives them back
    /// (the typed forms are in [`StartExt`](crate::work::StartExt)).
    ///
    /// Requires what the blocking method of the same name requires, and
    /// every rank issues the same collectives in the same order.
    ///
    /// The default runs the blocking method now and returns a completed
    /// handle, so that every communicator accepts started calls; [`Group`]
    /// (every engine) overrides it to run the call on its worker thread.
    ///
    /// # Errors
    /// At once: what needs no communication ([`ErrorKind::Unsupported`],
    /// [`ErrorKind::InvalidArgument`], [`ErrorKind::Poisoned`]). Everything
    /// else from the handle's `wait`, naming the operation with its
    /// sequence number (`all_reduce#12`).
    ///
    /// [`Group`]: crate::kit::Group
    fn start(&self, mut call: Call) -> Result<Pending> {
        let op = call.info().op;
        let result = call.views_mut().run_blocking(self);
        Ok(Pending::completed(
            WorkLabel::of(self, op, None),
            result,
            call,
        ))
    }

    /// Give up on this group: poison it so that every later call returns
    /// [`ErrorKind::Poisoned`] with `reason`, and interrupt a call in flight
    /// when [`Capabilities::abort_interrupts`] says the engine can. Never
    /// blocks, never fails.
    fn abort(&self, reason: &str);
}

/// Argument checks shared by every backend, so that all of them reject the
/// same bad calls with the same words. Each returns
/// [`ErrorKind::InvalidArgument`] or [`ErrorKind::Unsupported`].
pub mod validate {
    use super::*;

    /// Check `op` on `dtype`/`device` against `caps`, tagging errors with the
    /// backend and rank.
    pub fn call(
        comm: &(impl Communicator + ?Sized),
        op: Op,
        dtype: DType,
        reduce: Option<ReduceOp>,
        device: Device,
    ) -> Result<()> {
        comm.capabilities()
            .check(op, dtype, reduce, device.kind)
            .map_err(|e| e.with_backend(comm.backend_name()).with_rank(comm.rank()))
    }

    /// Check that `root` (or a peer) is a rank of the group.
    pub fn rank_in_group(
        comm: &(impl Communicator + ?Sized),
        op: Op,
        what: &str,
        rank: usize,
    ) -> Result<()> {
        if rank >= comm.world_size() {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "{what} {rank} is not a rank of this group (world size {})",
                    comm.world_size()
                ),
            )
            .with_op(op.name())
            .with_backend(comm.backend_name())
            .with_rank(comm.rank()));
        }
        Ok(())
    }

    /// Arguments of [`Communicator::gather`]: `root` is a rank of the group
    /// and, on `root`, `recv` is present with `send.len() * world_size()`
    /// elements of `send`'s dtype. Returns `recv` on `root`, `None` elsewhere
    /// (a buffer passed by another rank is ignored, as documented).
    pub fn gather<'a>(
        comm: &(impl Communicator + ?Sized),
        send: &Buf<'_>,
        recv: Option<BufMut<'a>>,
        root: usize,
    ) -> Result<Option<BufMut<'a>>> {
        let small = ("send", send.dtype(), send.len());
        root_buffer(comm, Op::Gather, root, recv, "a receive", small, |r| {
            ("recv", r.dtype(), r.len())
        })
    }

    /// Arguments of [`Communicator::scatter`]: `root` is a rank of the group
    /// and, on `root`, `send` is present with `recv.len() * world_size()`
    /// elements of `recv`'s dtype. Returns `send` on `root`, `None` elsewhere.
    pub fn scatter<'a>(
        comm: &(impl Communicator + ?Sized),
        send: Option<Buf<'a>>,
        recv: &BufMut<'_>,
        root: usize,
    ) -> Result<Option<Buf<'a>>> {
        let small = ("recv", recv.dtype(), recv.len());
        root_buffer(comm, Op::Scatter, root, send, "a send", small, |s| {
            ("send", s.dtype(), s.len())
        })
    }

    /// What [`gather`] and [`scatter`] check: `root` is a rank of the group
    /// and, on `root`, the root's buffer `big` (described by `meta`) is
    /// present with `small`'s dtype and `world_size()` times its length.
    /// Returns `big` on `root`, `None` elsewhere.
    fn root_buffer<B>(
        comm: &(impl Communicator + ?Sized),
        op: Op,
        root: usize,
        big: Option<B>,
        article: &str,
        small: (&str, DType, usize),
        meta: impl Fn(&B) -> (&'static str, DType, usize),
    ) -> Result<Option<B>> {
        rank_in_group(comm, op, "root", root)?;
        if comm.rank() != root {
            return Ok(None);
        }
        let big = big.ok_or_else(|| {
            let msg = format!("the root must pass {article} buffer");
            Error::invalid_argument(op.name(), msg)
                .with_backend(comm.backend_name())
                .with_rank(comm.rank())
        })?;
        lengths(comm, op, small, meta(&big), comm.world_size())?;
        Ok(Some(big))
    }

    /// Arguments of [`Communicator::all_to_all`]: same dtype and length on
    /// both sides, and a length divisible by the group size.
    pub fn all_to_all(
        comm: &(impl Communicator + ?Sized),
        send: &Buf<'_>,
        recv: &BufMut<'_>,
    ) -> Result<()> {
        let op = Op::AllToAll;
        lengths(
            comm,
            op,
            ("send", send.dtype(), send.len()),
            ("recv", recv.dtype(), recv.len()),
            1,
        )?;
        if !send.len().is_multiple_of(comm.world_size()) {
            return Err(Error::invalid_argument(
                op.name(),
                format!(
                    "send has {} elements, not a multiple of the world size {}",
                    send.len(),
                    comm.world_size()
                ),
            )
            .with_backend(comm.backend_name())
            .with_rank(comm.rank()));
        }
        Ok(())
    }

    /// Check that two buffers have the same dtype and `big == small * factor`.
    pub fn lengths(
        comm: &(impl Communicator + ?Sized),
        op: Op,
        small: (&str, DType, usize),
        big: (&str, DType, usize),
        factor: usize,
    ) -> Result<()> {
        let err = |m: String| {
            Err(Error::new(ErrorKind::InvalidArgument, m)
                .with_op(op.name())
                .with_backend(comm.backend_name())
                .with_rank(comm.rank()))
        };
        if small.1 != big.1 {
            return err(format!(
                "{} is {} but {} is {}",
                small.0, small.1, big.0, big.1
            ));
        }
        if small.2.checked_mul(factor) != Some(big.2) {
            return err(format!(
                "{} has {} elements, expected {} x {} = {} (it has {})",
                big.0,
                big.2,
                small.0,
                factor,
                small.2.saturating_mul(factor),
                big.2
            ));
        }
        Ok(())
    }
}

/// Typed conveniences over any [`Communicator`], provided for free
/// (object_store's `ObjectStoreExt` pattern). Each forwards to the
/// corresponding required method and has its requirements and errors.
pub trait CommunicatorExt: Communicator {
    /// [`Communicator::all_reduce`] on a slice.
    fn all_reduce_slice<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(BufMut::Host(HostBufMut::from(data)), op)
    }

    /// Out-of-place all-reduce: returns the reduction of `data`.
    fn all_reduce_vec<T: Element>(&self, data: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let mut out = data.to_vec();
        self.all_reduce_slice(&mut out, op)?;
        Ok(out)
    }

    /// [`Communicator::broadcast`] on a slice.
    fn broadcast_slice<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        self.broadcast(BufMut::Host(HostBufMut::from(data)), root)
    }

    /// [`Communicator::all_gather`], allocating the result.
    fn all_gather_vec<T: Element>(&self, data: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); data.len() * self.world_size()];
        self.all_gather(
            Buf::Host(HostBuf::from(data)),
            BufMut::Host(HostBufMut::from(&mut out[..])),
        )?;
        Ok(out)
    }

    /// [`Communicator::gather`], allocating the result on `root` (`None`
    /// elsewhere).
    fn gather_vec<T: Element>(&self, data: &[T], root: usize) -> Result<Option<Vec<T>>> {
        if self.rank() == root {
            let mut out = vec![T::zeroed(); data.len() * self.world_size()];
            self.gather(
                Buf::Host(HostBuf::from(data)),
                Some(BufMut::Host(HostBufMut::from(&mut out[..]))),
                root,
            )?;
            Ok(Some(out))
        } else {
            self.gather(Buf::Host(HostBuf::from(data)), None, root)?;
            Ok(None)
        }
    }

    /// [`Communicator::scatter`] receiving `chunk_len` elements.
    fn scatter_vec<T: Element>(
        &self,
        data: Option<&[T]>,
        chunk_len: usize,
        root: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); chunk_len];
        self.scatter(
            data.map(|d| Buf::Host(HostBuf::from(d))),
            BufMut::Host(HostBufMut::from(&mut out[..])),
            root,
        )?;
        Ok(out)
    }

    /// [`Communicator::reduce_scatter`], allocating this rank's chunk.
    fn reduce_scatter_vec<T: Element>(&self, data: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let n = self.world_size();
        let mut out = vec![T::zeroed(); data.len() / n];
        self.reduce_scatter(
            Buf::Host(HostBuf::from(data)),
            BufMut::Host(HostBufMut::from(&mut out[..])),
            op,
        )?;
        Ok(out)
    }

    /// [`Communicator::all_to_all`], allocating the result.
    fn all_to_all_vec<T: Element>(&self, data: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); data.len()];
        self.all_to_all(
            Buf::Host(HostBuf::from(data)),
            BufMut::Host(HostBufMut::from(&mut out[..])),
        )?;
        Ok(out)
    }

    /// [`Communicator::send`] of a slice.
    fn send_slice<T: Element>(&self, data: &[T], dst: usize, tag: u32) -> Result<()> {
        self.send(Buf::Host(HostBuf::from(data)), dst, tag)
    }

    /// [`Communicator::recv`] into a slice.
    fn recv_slice<T: Element>(&self, data: &mut [T], src: usize, tag: u32) -> Result<()> {
        self.recv(BufMut::Host(HostBufMut::from(data)), src, tag)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}

impl std::fmt::Debug for dyn Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("backend", &self.backend_name())
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", &self.device())
            .finish()
    }
}

impl CallMut<'_> {
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
}
