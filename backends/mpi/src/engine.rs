//! [`MpiEngine`]: the calls into one MPI communicator;
//! [`MpiCommunicator`] is it inside accel's generic [`Group`].

use std::ffi::c_int;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::kit::{
    host, host_mut, message_does_not_fit, Backoff, Deadline, Engine, EngineInfo, Group, Growth,
    P2pHeader, Polled, Poller, SplitPlan, Until, P2P_MAGIC,
};
use accel_api::{
    Buf, BufMut, Capabilities, DType, Error, ErrorKind, Half16, HostBuf, Op, ReduceOp, Result,
};

use crate::error::timeout_error;
use crate::ffi::{self, Call, Comm, Dst, Owned, RedOp, Request, Scratch, Src, Ty};
use crate::name::NAME;
use crate::progress::{self, Progress};
use crate::watchdog::{self, Watch, Watched};

/// What every mpi communicator declares: every operation, element type and
/// reduction on host memory. f16 and bf16 reductions are computed in f32
/// (widened, reduced by MPI, rounded back once), because MPI has no 16-bit
/// float types.
pub fn capabilities() -> Capabilities {
    Capabilities::all_host()
}

/// Default of `ACCEL_MPI_STAGING_BYTES`: operations whose buffers are at
/// most this large run non-blocking on memory the communicator owns, so
/// that their timeout returns an error; larger ones run blocking, in place
/// (see the crate documentation and ADR 0017).
pub const DEFAULT_STAGING_BYTES: usize = 8 * 1024;

/// Every point-to-point message is preceded by a header message of this
/// many bytes on the same communicator and tag (MPI keeps the two in
/// order): the payload's byte count (u64) and element type (u32), and a
/// magic number. MPI carries neither the element type nor, before a
/// receive, the size: the receiver reads the header first and refuses a
/// payload of another type or size without touching its buffer, as
/// cpu-gloo does.
pub(crate) const P2P_HEADER: usize = P2pHeader::BYTES;

/// The element type (`None`: a code this build does not know) and byte
/// count of a header; `None` when it is not one.
fn p2p_parse(h: &[u8; P2P_HEADER]) -> Option<(Option<DType>, usize)> {
    let h = P2pHeader::decode(h);
    if h.tag != P2P_MAGIC {
        return None;
    }
    Some((h.element_type(), h.byte_len()?))
}

/// Settings shared by a communicator and the groups split from it.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub(crate) library: String,
    pub(crate) tag_ub: u32,
    pub(crate) staging: usize,
    /// `MPI_THREAD_*` level MPI provides (`serialized` or `multiple` when
    /// this crate initialized MPI).
    pub(crate) threading: &'static str,
    /// `true` when this crate called `MPI_Init_thread`.
    pub(crate) initialized_here: bool,
    /// Operations above the staging size run as blocking MPI calls under
    /// the watchdog: `ACCEL_MPI_BLOCKING` is not `0` and MPI granted
    /// `MPI_THREAD_MULTIPLE`.
    pub(crate) blocking: bool,
    /// Calls started without waiting poll their non-blocking form on the
    /// group's worker thread instead of blocking there
    /// (`ACCEL_MPI_STARTED`).
    pub(crate) started_poll: bool,
    /// This process's rank in `MPI_COMM_WORLD`.
    pub(crate) world_rank: usize,
}

/// The calls into one MPI communicator (a duplicate of `MPI_COMM_WORLD`,
/// or a split of one).
///
/// Operations on buffers up to the staging size (and barriers, receives,
/// the exchange of `split`) are started non-blocking (`MPI_I*`) on owned
/// memory and polled with `MPI_Test` until they complete or the timeout
/// passes, so that a timeout returns. Larger ones call the blocking MPI
/// function in place under the communicator's watchdog, which ends the job
/// when the call outlives the timeout. See the crate documentation.
pub struct MpiEngine {
    comm: Comm,
    info: EngineInfo,
    shared: Arc<Shared>,
    /// Present when large operations run blocking (see [`Shared::blocking`]).
    watch: Option<Arc<Watch>>,
    /// Set while `split` exchanges colors: every operation returns on
    /// timeout.
    returning: AtomicBool,
    /// This rank's progress record (world communicators; see
    /// [`progress`]).
    progress: Option<Arc<Progress>>,
}

/// accel's [`Communicator`](accel_api::Communicator) over one MPI
/// communicator.
pub type MpiCommunicator = Group<MpiEngine>;

impl fmt::Debug for MpiEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiEngine")
            .field("staging_bytes", &self.shared.staging)
            .field("blocking", &self.watch.is_some())
            .field("library", &self.shared.library)
            .finish_non_exhaustive()
    }
}

fn err_at(kind: ErrorKind, rank: usize, op: &str, message: impl Into<String>) -> Error {
    Error::new(kind, message)
        .with_op(op)
        .with_backend(NAME)
        .with_rank(rank)
}

/// Pause between two `MPI_Test`s: spin first (latency), then yield, then
/// sleep briefly (oversubscribed runs, long waits).
const PAUSE: Backoff = Backoff::sleep(Duration::from_micros(200))
    .spin(Until::Elapsed(Duration::from_micros(200)))
    .then_yield(Until::Elapsed(Duration::from_millis(20)));

/// Poll `req` until it completes (returned, complete) or `timeout` after
/// `start` (returned, still pending, in [`Waited::TimedOut`]).
pub(crate) fn poll<'a>(
    req: Request<'a>,
    start: Instant,
    timeout: Duration,
) -> std::result::Result<Request<'a>, Waited<'a>> {
    poll_checked(req, start, timeout, &mut |_| None)
}

/// The pause of a call started without waiting, on the group's worker
/// thread while the caller computes: sleep from the first look (no spin,
/// no yield loop that would take a core from the caller), doubling up to
/// half a millisecond.
const STARTED_PAUSE: Backoff =
    Backoff::sleep(Duration::from_micros(20)).grow(Growth::Mul(2), Duration::from_micros(500));

/// How often a waiting call looks at its peers' progress records.
const PEER_CHECK: Duration = Duration::from_millis(200);

/// [`poll`], calling `check` with the time waited about every
/// [`PEER_CHECK`] after the first; an error from it stops the wait
/// ([`Waited::Stopped`], the request still pending).
fn poll_checked<'a>(
    mut req: Request<'a>,
    start: Instant,
    timeout: Duration,
    check: &mut dyn FnMut(Duration) -> Option<Error>,
) -> std::result::Result<Request<'a>, Waited<'a>> {
    let mut next_check = PEER_CHECK;
    let pause = if accel_api::kit::on_group_worker() {
        STARTED_PAUSE
    } else {
        PAUSE
    };
    let mut poller = Poller::new(Deadline::since(start, timeout), pause);
    loop {
        match req.test() {
            Ok(true) => return Ok(req),
            Ok(false) => {}
            Err(e) => return Err(Waited::Failed(e)),
        }
        if poller.deadline().passed() {
            return Err(Waited::TimedOut(req));
        }
        let elapsed = start.elapsed();
        if elapsed >= next_check {
            if let Some(e) = check(elapsed) {
                return Err(Waited::Stopped(req, e));
            }
            next_check = elapsed + PEER_CHECK;
        }
        if poller.wait().is_err() {
            return Err(Waited::TimedOut(req));
        }
    }
}

/// Why [`poll`] stopped without a completed request.
pub(crate) enum Waited<'a> {
    /// MPI reported an error (the request is complete).
    Failed(ffi::MpiError),
    /// The deadline passed; the request is still pending.
    TimedOut(Request<'a>),
    /// The check of [`poll_checked`] said to stop; the request is still
    /// pending.
    Stopped(Request<'a>, Error),
}

/// The `Timeout` error of `op`, and what happens to a request MPI cannot
/// cancel: leaked with its owned memory when it borrows none of the
/// caller's; otherwise the error is printed and the MPI job aborted.
pub(crate) fn timed_out(
    req: Request<'_>,
    rank: usize,
    op: &str,
    timeout: Duration,
    world: usize,
    culprits: &[(usize, String)],
) -> Error {
    let err = timeout_error(op, timeout, world, rank, culprits);
    if req.borrows_user() {
        let msg = format!(
            "{err}\n[{NAME} rank {rank}] {op} was running on the caller's memory and MPI cannot cancel it: aborting the MPI job (buffers over ACCEL_MPI_STAGING_BYTES run in place)"
        );
        ffi::abort_job(&msg, 124);
    }
    if req.abandon().is_err() {
        ffi::abort_job(
            &format!("{err}\n[{NAME} rank {rank}] aborting the MPI job"),
            124,
        );
    }
    err
}

fn ty(d: DType) -> Ty {
    match d {
        DType::F32 => Ty::F32,
        DType::F64 => Ty::F64,
        DType::I8 => Ty::I8,
        DType::U8 => Ty::U8,
        DType::I32 => Ty::I32,
        DType::I64 => Ty::I64,
        // f16 and bf16 move as opaque 16-bit units; any other (future)
        // element type is rejected by the capability check first.
        _ => Ty::U16,
    }
}

fn red(op: ReduceOp) -> RedOp {
    match op {
        ReduceOp::Prod => RedOp::Prod,
        ReduceOp::Min => RedOp::Min,
        ReduceOp::Max => RedOp::Max,
        // Avg = sum, then a division on the host.
        _ => RedOp::Sum,
    }
}

/// f16/bf16 bytes widened to f32, as scratch memory.
fn widen(half: Half16, src: &[u8]) -> Scratch {
    let mut s = Scratch::new(src.len() / 2 * 4);
    for (v, out) in half.widen(src).zip(s.bytes_mut().chunks_exact_mut(4)) {
        out.copy_from_slice(&v.to_le_bytes());
    }
    s
}

/// f32 scratch narrowed back into f16/bf16 bytes (rounding once), divided
/// by `div` first when it is not 1.
fn narrow(half: Half16, src: &[u8], dst: &mut [u8], div: usize) {
    let wide = src.chunks_exact(4).map(|c| {
        let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if div != 1 {
            v / div as f32
        } else {
            v
        }
    });
    half.narrow_into(wide, dst);
}

/// One MPI operation to start: which, on what type, how many elements.
#[derive(Debug, Clone, Copy)]
struct Spec {
    op: Op,
    call: Call,
    t: Ty,
    count: c_int,
}

impl Spec {
    /// The transfer of this operation from `send` into `recv`.
    fn transfer<'a>(&self, send: Src<'a>, recv: Dst<'a>) -> ffi::Transfer<'a> {
        ffi::Transfer {
            call: self.call,
            ty: self.t,
            count: self.count,
            send,
            recv,
        }
    }
}

impl MpiEngine {
    pub(crate) fn new(
        comm: Comm,
        info: EngineInfo,
        shared: Arc<Shared>,
        progress: Option<Arc<Progress>>,
    ) -> Self {
        let watch = if shared.blocking {
            let of = Watched::new(&info, shared.world_rank, shared.staging);
            Watch::start(of, progress.clone())
        } else {
            None
        };
        MpiEngine {
            comm,
            info,
            shared,
            watch,
            returning: AtomicBool::new(false),
            progress,
        }
    }

    /// Count collective `op` in the progress record; its index.
    fn enter(&self, op: Op) -> Option<u64> {
        let p = self.progress.as_ref()?;
        (!matches!(op, Op::Send | Op::Recv)).then(|| p.enter())
    }

    /// `true` when operations above [`staging_bytes`](Self::staging_bytes)
    /// run as blocking MPI calls under the watchdog (the default; needs
    /// `MPI_THREAD_MULTIPLE`); `false` when every operation runs
    /// non-blocking, polled (`ACCEL_MPI_BLOCKING=0`, or MPI granted a lower
    /// thread level).
    pub fn blocking_collectives(&self) -> bool {
        self.watch.is_some()
    }

    /// The MPI library this communicator runs on (`MPI_Get_library_version`).
    pub fn library_version(&self) -> &str {
        &self.shared.library
    }

    /// The `MPI_THREAD_*` level MPI runs at (`serialized`, `multiple`, or
    /// lower when the program initialized MPI itself: then it must call
    /// this communicator from the thread that initialized MPI).
    pub fn threading_level(&self) -> &'static str {
        self.shared.threading
    }

    /// `true` when this crate initialized MPI (and finalizes it at exit);
    /// `false` when the program had initialized it already.
    pub fn initialized_mpi(&self) -> bool {
        self.shared.initialized_here
    }

    /// Operations whose largest buffer is at most this many bytes run
    /// non-blocking on memory the communicator owns, and their timeout
    /// returns (`ACCEL_MPI_STAGING_BYTES`).
    pub fn staging_bytes(&self) -> usize {
        self.shared.staging
    }

    /// The [`Spec`] of `call` on `n` elements of `dtype` (the type MPI
    /// moves; f16/bf16 move as 16-bit units).
    fn spec(&self, op: Op, call: Call, dtype: DType, n: usize) -> Result<Spec> {
        let count = c_int::try_from(n).map_err(|_| {
            err_at(
                ErrorKind::InvalidArgument,
                self.info.rank,
                op.name(),
                format!("{n} elements per rank exceed MPI's count limit (2^31 - 1)"),
            )
            .with_fix("split the buffer into several calls")
        })?;
        Ok(Spec {
            op,
            call,
            t: ty(dtype),
            count,
        })
    }

    fn staged(&self, bytes: usize) -> bool {
        bytes <= self.shared.staging || self.returning.load(Ordering::Relaxed)
    }

    /// Run an operation that is not staged: the blocking MPI call under the
    /// watchdog when this communicator has one, otherwise non-blocking and
    /// polled like [`run`](Self::run).
    fn run_large(&self, s: Spec, send: Src<'_>, recv: Dst<'_>, owned: Owned) -> Result<Owned> {
        let Some(watch) = &self.watch else {
            return self.run(s, send, recv, owned);
        };
        if self.shared.started_poll && accel_api::kit::on_group_worker() {
            // A started call: the caller computes meanwhile, so wait
            // without spinning a core.
            return self.run(s, send, recv, owned);
        }
        let mut owned = owned;
        let lib = &self.shared.library;
        let _armed = watch.arm(s.op, self.enter(s.op));
        ffi::call_blocking(&self.comm, s.transfer(send, recv), &mut owned, lib)?;
        Ok(owned)
    }

    /// Start the operation non-blocking and poll it to the end or the
    /// timeout.
    fn run(&self, s: Spec, send: Src<'_>, recv: Dst<'_>, owned: Owned) -> Result<Owned> {
        let start = Instant::now();
        let lib = &self.shared.library;
        let index = self.enter(s.op);
        let req = ffi::start(&self.comm, s.transfer(send, recv), owned, lib)?;
        self.wait(s.op, req, start, index)
    }

    /// Poll `req` to its end or the timeout. For collective number `index`
    /// (counted in the progress record), a peer that ended before entering
    /// it stops the wait with `PeerLost` naming it (see [`progress`]); a
    /// timeout names the ranks that held it up when the records tell.
    fn wait(&self, op: Op, req: Request<'_>, start: Instant, index: Option<u64>) -> Result<Owned> {
        let mut check = |_: Duration| {
            let (p, i) = (self.progress.as_ref()?, index?);
            let (peer, rec) = p.left_before(i)?;
            Some(self.early_exit(op, i, peer, rec))
        };
        match poll_checked(req, start, self.info.timeout, &mut check) {
            Ok(done) => Ok(done.finish()),
            Err(Waited::Stopped(req, e)) => {
                // The request can never complete: leaked with its owned
                // memory, or the job ends when MPI may still write the
                // caller's.
                if req.borrows_user() {
                    let msg = format!(
                        "{e}\n[{NAME} rank {}] {} was running on the caller's memory and MPI cannot cancel it: aborting the MPI job",
                        self.info.rank,
                        op.name()
                    );
                    ffi::abort_job(&msg, 1);
                }
                let _ = req.abandon();
                Err(e)
            }
            Err(Waited::Failed(e)) => Err(e.into()),
            Err(Waited::TimedOut(req)) => {
                let culprits = match (&self.progress, index) {
                    (Some(p), Some(i)) => p.culprits(i),
                    _ => Vec::new(),
                };
                Err(timed_out(
                    req,
                    self.info.rank,
                    op.name(),
                    self.info.timeout,
                    self.info.world_size,
                    &culprits,
                ))
            }
        }
    }

    /// A peer ended before the collective this rank waits in: the error
    /// naming it. When its process exited, the job has failed: the record
    /// goes to the error file as the root cause, and this process ends the
    /// MPI job at its own exit (the peer waits in `MPI_Finalize`; see
    /// [`ffi::mark_peer_left`]). A peer that only dropped the communicator
    /// fails this group, as a timeout does.
    fn early_exit(&self, op: Op, index: u64, peer: usize, rec: progress::Record) -> Error {
        let text = progress::early_exit_message(op.name(), index, peer, rec);
        if rec.ended == progress::EXITED {
            watchdog::write_error_file(
                &format!("[{NAME} rank {}] {}: {text}", self.info.rank, op.name()),
                peer,
            );
            ffi::mark_peer_left();
        } else {
            ffi::mark_failed();
        }
        err_at(
            ErrorKind::PeerLost { peer: Some(peer) },
            self.info.rank,
            op.name(),
            text,
        )
        .with_fix(format!(
            "look at why rank {peer} ended: every rank must make the same collectives to the end"
        ))
    }

    /// Run `call` on memory the request owns: `send` (if any) is already a
    /// copy; the received bytes are copied into `dst` afterwards. With
    /// `dst_init`, the receive scratch starts as a copy of `dst` (for
    /// broadcast, whose root sends from its receive buffer).
    fn run_staged(
        &self,
        s: Spec,
        send: Option<Scratch>,
        dst: Option<&mut [u8]>,
        dst_init: bool,
    ) -> Result<()> {
        let src = if send.is_some() {
            Src::Scratch
        } else {
            Src::None
        };
        let recv = dst.as_ref().map(|d| {
            if dst_init {
                Scratch::from_bytes(d)
            } else {
                Scratch::new(d.len())
            }
        });
        let to = if recv.is_some() {
            Dst::Scratch
        } else {
            Dst::None
        };
        let owned = self.run(s, src, to, Owned { send, recv })?;
        if let (Some(d), Some(r)) = (dst, owned.recv) {
            d.copy_from_slice(r.bytes());
        }
        Ok(())
    }

    /// A data-movement call (no reduction): staged when its largest buffer
    /// is at most the staging size, on the caller's memory otherwise.
    fn movement(
        &self,
        s: Spec,
        src: Option<&[u8]>,
        dst: Option<&mut [u8]>,
        largest: usize,
    ) -> Result<()> {
        if self.staged(largest) {
            return self.run_staged(s, src.map(Scratch::from_bytes), dst, false);
        }
        let from = src.map_or(Src::None, Src::User);
        let to = dst.map_or(Dst::None, Dst::User);
        self.run_large(s, from, to, Owned::default()).map(drop)
    }

    /// all_reduce, reduce and reduce_scatter. f16/bf16 are widened to f32,
    /// reduced by MPI and rounded back once (dividing first for Avg, which
    /// is why this engine computes Avg itself).
    fn reduction(
        &self,
        s: Spec,
        dtype: DType,
        src: Option<&[u8]>,
        dst: Option<&mut [u8]>,
        avg: bool,
    ) -> Result<()> {
        let div = if avg { self.info.world_size } else { 1 };
        if let Some(half) = Half16::of(dtype) {
            let s = Spec { t: Ty::F32, ..s };
            let send = src.or(dst.as_deref()).map(|b| widen(half, b));
            let recv = dst.as_ref().map(|d| Scratch::new(d.len() * 2));
            let to = if recv.is_some() {
                Dst::Scratch
            } else {
                Dst::None
            };
            let bytes = src.or(dst.as_deref()).map_or(0, <[u8]>::len);
            let owned = Owned { send, recv };
            let owned = if self.staged(bytes) {
                self.run(s, Src::Scratch, to, owned)?
            } else {
                self.run_large(s, Src::Scratch, to, owned)?
            };
            if let (Some(d), Some(r)) = (dst, owned.recv) {
                narrow(half, r.bytes(), d, div);
            }
            return Ok(());
        }
        let mut dst = dst;
        let bytes = src.or(dst.as_deref()).map_or(0, <[u8]>::len);
        if self.staged(bytes) {
            let send = Scratch::from_bytes(src.or(dst.as_deref()).unwrap_or_default());
            self.run_staged(s, Some(send), dst.as_deref_mut(), false)?;
        } else {
            match (src, dst.as_deref_mut()) {
                (Some(b), d) => {
                    let to = d.map_or(Dst::None, Dst::User);
                    self.run_large(s, Src::User(b), to, Owned::default())?;
                }
                (None, Some(d)) if ffi::has_in_place(&self.shared.library) => {
                    self.run_large(s, Src::InPlace, Dst::User(d), Owned::default())?;
                }
                (None, Some(d)) => {
                    let owned = Owned {
                        send: Some(Scratch::from_bytes(d)),
                        recv: None,
                    };
                    self.run_large(s, Src::Scratch, Dst::User(d), owned)?;
                }
                (None, None) => {}
            }
        }
        if let (true, Some(d)) = (avg, dst) {
            accel_api::HostBufMut::from_bytes(dtype, d)?.divide_by(self.info.world_size);
        }
        Ok(())
    }

    fn tag(&self, op: Op, tag: u32) -> Result<c_int> {
        if tag > self.shared.tag_ub {
            return Err(err_at(
                ErrorKind::InvalidArgument,
                self.info.rank,
                op.name(),
                format!(
                    "tag {tag} is above this MPI library's limit MPI_TAG_UB = {}",
                    self.shared.tag_ub
                ),
            ));
        }
        Ok(tag as c_int)
    }

    /// Match the next message from `src` with `tag` (`t` as MPI sees it),
    /// polling until the timeout counted from `start`.
    fn next_message(&self, src: usize, t: c_int, tag: u32, start: Instant) -> Result<ffi::Matched> {
        let deadline = Deadline::since(start, self.info.timeout);
        match deadline.poll(&PAUSE, || ffi::improbe(&self.comm, src as c_int, t)) {
            Ok(m) => Ok(m),
            Err(Polled::Failed(e)) => Err(e.into()),
            Err(Polled::TimedOut) => Err(Error::timeout(
                Op::Recv.name(),
                self.info.timeout,
                format!("no message from rank {src} with tag {tag}"),
            )
            .with_fix(format!(
                "check that rank {src} sends with tag {tag}, or raise ACCEL_TIMEOUT"
            ))),
        }
    }

    /// Receive the matched message into `dst` (staged when small).
    fn receive(&self, op: Op, matched: ffi::Matched, dst: &mut [u8], start: Instant) -> Result<()> {
        if self.staged(dst.len()) {
            let owned = Owned {
                send: None,
                recv: Some(Scratch::new(dst.len())),
            };
            let req = matched.receive(Dst::Scratch, owned)?;
            if let Some(r) = self.wait(op, req, start, None)?.recv {
                dst.copy_from_slice(r.bytes());
            }
            Ok(())
        } else {
            let req = matched.receive(Dst::User(dst), Owned::default())?;
            self.wait(op, req, start, None).map(drop)
        }
    }
}

impl Engine for MpiEngine {
    /// MPI has no average, but the f16/bf16 path reduces in f32 and must
    /// divide before rounding back once; the other types divide on the host
    /// with [`HostBufMut::divide_by`](accel_api::HostBufMut::divide_by),
    /// like every engine.
    const NATIVE_AVG: bool = true;

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let mut h = host_mut(Op::AllReduce, buf)?;
        let s = self.spec(Op::AllReduce, Call::AllReduce(red(op)), h.dtype(), h.len())?;
        let avg = op == ReduceOp::Avg;
        self.reduction(s, h.dtype(), None, Some(h.bytes_mut()), avg)
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        let mut h = host_mut(Op::Reduce, buf)?;
        let call = Call::Reduce(red(op), root as c_int);
        let s = self.spec(Op::Reduce, call, h.dtype(), h.len())?;
        let avg = op == ReduceOp::Avg;
        if root == self.info.rank {
            self.reduction(s, h.dtype(), None, Some(h.bytes_mut()), avg)
        } else {
            self.reduction(s, h.dtype(), Some(h.bytes()), None, avg)
        }
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let mut h = host_mut(Op::Broadcast, buf)?;
        let call = Call::Bcast(root as c_int);
        let s = self.spec(Op::Broadcast, call, h.dtype(), h.len())?;
        if self.staged(h.bytes().len()) {
            self.run_staged(s, None, Some(h.bytes_mut()), true)
        } else {
            let to = Dst::User(h.bytes_mut());
            self.run_large(s, Src::None, to, Owned::default()).map(drop)
        }
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllGather;
        let (src, mut dst) = (host(op, send)?, host_mut(op, recv)?);
        let s = self.spec(op, Call::AllGather, src.dtype(), src.len())?;
        let largest = dst.bytes().len();
        self.movement(s, Some(src.bytes()), Some(dst.bytes_mut()), largest)
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let op = Op::Gather;
        let src = host(op, send)?;
        let mut dst = recv.map(|r| host_mut(op, r)).transpose()?;
        let s = self.spec(op, Call::Gather(root as c_int), src.dtype(), src.len())?;
        let largest = src.bytes().len() * self.info.world_size;
        let to = dst.as_mut().map(|d| d.bytes_mut());
        self.movement(s, Some(src.bytes()), to, largest)
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Scatter;
        let src = send.map(|b| host(op, b)).transpose()?;
        let mut dst = host_mut(op, recv)?;
        let s = self.spec(op, Call::Scatter(root as c_int), dst.dtype(), dst.len())?;
        let largest = dst.bytes().len() * self.info.world_size;
        let from = src.as_ref().map(HostBuf::bytes);
        self.movement(s, from, Some(dst.bytes_mut()), largest)
    }

    /// `MPI_Ireduce_scatter_block`; f16/bf16 in f32.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let o = Op::ReduceScatter;
        let (src, mut dst) = (host(o, send)?, host_mut(o, recv)?);
        let call = Call::ReduceScatterBlock(red(op));
        let s = self.spec(o, call, dst.dtype(), dst.len())?;
        let avg = op == ReduceOp::Avg;
        self.reduction(
            s,
            dst.dtype(),
            Some(src.bytes()),
            Some(dst.bytes_mut()),
            avg,
        )
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllToAll;
        let (src, mut dst) = (host(op, send)?, host_mut(op, recv)?);
        let s = self.spec(
            op,
            Call::AllToAll,
            src.dtype(),
            src.len() / self.info.world_size,
        )?;
        let largest = src.bytes().len();
        self.movement(s, Some(src.bytes()), Some(dst.bytes_mut()), largest)
    }

    /// `MPI_Isend` of the raw bytes.
    /// A header message (byte count, element type) and then the payload,
    /// on the same tag (see [`P2P_HEADER`]).
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let op = Op::Send;
        let src = host(op, buf)?;
        let call = Call::Send {
            dst: dst as c_int,
            tag: self.tag(op, tag)?,
        };
        let hdr = P2pHeader::new(src.dtype(), src.len(), P2P_MAGIC).encode();
        let h = self.spec(op, call, DType::U8, P2P_HEADER)?;
        self.movement(h, Some(&hdr), None, P2P_HEADER)?;
        if src.bytes().is_empty() {
            return Ok(());
        }
        let s = self.spec(op, call, DType::U8, src.bytes().len())?;
        self.movement(s, Some(src.bytes()), None, src.bytes().len())
    }

    /// Matches the header message first (`MPI_Improbe`, polled until the
    /// timeout: a message that never comes leaves nothing pending) and
    /// reads it, then matches the payload and receives it (`MPI_Imrecv`)
    /// when its element type and size are the buffer's. Otherwise the
    /// payload is received and dropped, and the call fails with
    /// `InvalidArgument` naming both (the buffer is untouched).
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let op = Op::Recv;
        let mut dst = host_mut(op, buf)?;
        let t = self.tag(op, tag)?;
        let start = Instant::now();
        let header = self.next_message(src, t, tag, start)?;
        let mut hdr = vec![0u8; header.bytes];
        self.receive(op, header, &mut hdr, start)?;
        let parsed = <&[u8; P2P_HEADER]>::try_from(&hdr[..])
            .ok()
            .and_then(p2p_parse);
        let Some((dtype, nbytes)) = parsed else {
            return Err(err_at(
                ErrorKind::Backend,
                self.info.rank,
                op.name(),
                format!(
                    "the message from rank {src} with tag {tag} has no accel header (the sender does not speak accel's point-to-point protocol)"
                ),
            )
            .with_fatal(true));
        };
        let want = (dst.dtype(), dst.bytes().len());
        let payload = if nbytes > 0 {
            Some(self.next_message(src, t, tag, start)?)
        } else {
            None
        };
        let got = payload.as_ref().map_or(0, |m| m.bytes);
        let fits = dtype == Some(want.0) && nbytes == want.1 && got == nbytes;
        if fits {
            if let Some(m) = payload {
                self.receive(op, m, dst.bytes_mut(), start)?;
            }
            return Ok(());
        }
        if let Some(m) = payload {
            let mut sink = vec![0u8; got];
            self.receive(op, m, &mut sink, start)?;
        }
        if got != nbytes {
            return Err(Error::internal(
                op.name(),
                format!("rank {src}'s header announced {nbytes} bytes, its message holds {got}"),
            ));
        }
        Err(
            message_does_not_fit(op, src, tag, dtype, nbytes, dst.dtype(), dst.len())
                .with_backend(NAME)
                .with_rank(self.info.rank),
        )
    }

    fn barrier(&self) -> Result<()> {
        let s = self.spec(Op::Barrier, Call::Barrier, DType::U8, 0)?;
        self.run(s, Src::None, Dst::None, Owned::default())
            .map(drop)
    }

    /// A peer may be stuck after this: the at-exit `MPI_Finalize` of this
    /// process is bounded from now on (a failed rank exits instead of
    /// waiting for a hung one).
    fn on_fatal(&self, _err: &Error) {
        ffi::mark_failed();
    }

    /// Exchanges `(color, key)` with a timed all-gather on owned memory
    /// (which also proves that every rank entered), then calls
    /// `MPI_Comm_split` with a dense color index and this rank's position in
    /// its `(key, rank)` order, so that every `u32` color and key works.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<MpiEngine>> {
        // The exchange runs on owned memory, non-blocking: its timeout
        // returns whatever the staging size.
        self.returning.store(true, Ordering::Relaxed);
        let plan = SplitPlan::exchange(self, color, key);
        self.returning.store(false, Ordering::Relaxed);
        let plan = plan?;
        let mpi_color = plan.color.map(|_| plan.color_index as c_int);
        let sub = self.comm.split(mpi_color, plan.new_rank as c_int)?;
        match (sub, plan.color) {
            (Some(comm), Some(_)) => Ok(Some(MpiEngine::new(
                comm,
                self.info.sub(&plan),
                self.shared.clone(),
                None,
            ))),
            (None, None) => Ok(None),
            _ => Err(err_at(
                ErrorKind::Backend,
                self.info.rank,
                Op::Split.name(),
                "MPI_Comm_split disagreed with the exchanged colors",
            )),
        }
    }
}
