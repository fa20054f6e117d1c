//! The [`Engine`] trait a backend implements, the identity it reports
//! ([`EngineInfo`]), and the host views of buffers for host-only engines.

use std::time::Duration;

use crate::{
    Buf, BufMut, Capabilities, ConnectContext, DType, Device, DeviceBufMut, Error, HostBuf,
    HostBufMut, Op, ReduceOp, Result,
};

/// The calls into one collective engine (Gloo, MPI, NCCL, PJRT, HCCL, a
/// plugin), wrapped by [`Group`](crate::kit::Group) into a [`Communicator`](crate::Communicator).
///
/// Every method is called by the group only after its checks passed, one at
/// a time (the group serialises calls), so an engine may assume:
///
/// * the operation, element type, reduction and device kind are in its
///   [`capabilities`](EngineInfo::capabilities);
/// * roots and peers are ranks of the group; buffer lengths and dtypes
///   satisfy the [`Communicator`](crate::Communicator) method's requirements; every buffer is on
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

    /// `true` when the engine's calls complete without waiting for peers
    /// (one process, no wire): calls started without waiting
    /// ([`Communicator::start`](crate::Communicator::start)) then run in the caller's thread and
    /// return completed handles. Otherwise (the default) the group runs
    /// them on its worker thread, in issue order, through the methods
    /// below.
    const STARTS_INLINE: bool = false;

    /// Who this engine's group is (backend, rank, size, device, timeout)
    /// and what it accepts; read once by [`Group::new`](crate::kit::Group::new), constant for the
    /// engine's lifetime.
    fn info(&self) -> &EngineInfo;

    /// [`Communicator::all_reduce`](crate::Communicator::all_reduce) on checked arguments.
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// [`Communicator::reduce`](crate::Communicator::reduce) on checked arguments.
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()>;

    /// [`Communicator::broadcast`](crate::Communicator::broadcast) on checked arguments.
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()>;

    /// [`Communicator::all_gather`](crate::Communicator::all_gather) on checked arguments.
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// [`Communicator::gather`](crate::Communicator::gather) on checked arguments: `recv` is `Some`
    /// exactly on `root`.
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()>;

    /// [`Communicator::scatter`](crate::Communicator::scatter) on checked arguments: `send` is `Some`
    /// exactly on `root`.
    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()>;

    /// [`Communicator::reduce_scatter`](crate::Communicator::reduce_scatter) on checked arguments.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()>;

    /// [`Communicator::all_to_all`](crate::Communicator::all_to_all) on checked arguments.
    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()>;

    /// [`Communicator::send`](crate::Communicator::send) to another rank (or to self for device memory).
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()>;

    /// [`Communicator::recv`](crate::Communicator::recv) from another rank (or from self for device
    /// memory). A message whose size or dtype differs from `buf` is an
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) error (the message is dropped), never a
    /// partial write.
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()>;

    /// [`Communicator::barrier`](crate::Communicator::barrier).
    fn barrier(&self) -> Result<()>;

    /// [`Communicator::split`](crate::Communicator::split): the engine of this rank's sub-group, `None`
    /// when `color` is `None`. [`SplitPlan::exchange`](crate::kit::SplitPlan::exchange) computes the
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
    /// [`ErrorKind::Unsupported`](crate::ErrorKind::Unsupported): an engine that takes device memory
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
/// [`Communicator::backend_name`](crate::Communicator::backend_name), [`rank`](crate::Communicator::rank),
/// [`world_size`](crate::Communicator::world_size),
/// [`device`](crate::Communicator::device), [`timeout`](crate::Communicator::timeout)
/// and [`capabilities`](crate::Communicator::capabilities) return.
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
}

/// The host view of a buffer an engine was promised to be host memory
/// (its capabilities take only [`DeviceKind::Cpu`](crate::DeviceKind::Cpu)).
///
/// # Errors
/// [`ErrorKind::Internal`](crate::ErrorKind::Internal) for a device view (the group's checks let it
/// through: a bug).
pub fn host(op: Op, b: Buf<'_>) -> Result<HostBuf<'_>> {
    b.host().ok_or_else(|| not_host(op))
}

/// As [`host`], for a writable buffer.
///
/// # Errors
/// [`ErrorKind::Internal`](crate::ErrorKind::Internal) for a device view.
pub fn host_mut(op: Op, b: BufMut<'_>) -> Result<HostBufMut<'_>> {
    b.into_host().ok_or_else(|| not_host(op))
}

/// The error of a receive whose message does not fit the buffer, for
/// engines that carry a type header on point-to-point messages: rank `src`
/// sent `nbytes` bytes of `sent` elements (`None`: a type the header does
/// not name) with `tag`; the receive buffer holds `len` elements of
/// `dtype`. [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument):
/// the engine drops the message, so the group stays in step.
pub fn message_does_not_fit(
    op: Op,
    src: usize,
    tag: u32,
    sent: Option<DType>,
    nbytes: usize,
    dtype: DType,
    len: usize,
) -> Error {
    let what = match sent {
        Some(d) => format!("{} {d} elements", nbytes / d.size()),
        None => format!("{nbytes} bytes of an unknown element type"),
    };
    Error::invalid_argument(
        op.name(),
        format!(
            "rank {src} sent {what} with tag {tag}, the receive buffer holds {len} {dtype} elements (the message was dropped)"
        ),
    )
}

fn not_host(op: Op) -> Error {
    Error::internal(
        op.name(),
        "a device buffer reached a host-only engine past the capability check",
    )
}
