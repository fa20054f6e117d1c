//! [`MpiCommunicator`]: accel's [`Communicator`] on an MPI communicator.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use accel_api::{
    bf16, f16, validate, Buf, BufMut, Capabilities, Communicator, DType, Device, Error, ErrorKind,
    HostBuf, HostBufMut, Op, ReduceOp, Result,
};

use crate::ffi::{self, Call, Comm, Dst, Owned, RedOp, Request, Scratch, Src, Ty};
use crate::NAME;

/// What every mpi communicator declares: every operation, element type and
/// reduction on host memory. f16 and bf16 reductions are computed in f32
/// (widened, reduced by MPI, rounded back once), because MPI has no 16-bit
/// float types.
pub fn capabilities() -> Capabilities {
    Capabilities::all_host()
}

/// Default of `ACCEL_MPI_STAGING_BYTES`: operations whose buffers are at
/// most this large run on memory the communicator owns.
pub const DEFAULT_STAGING_BYTES: usize = 64 * 1024;

/// Settings shared by a communicator and the groups split from it.
#[derive(Debug, Clone)]
pub(crate) struct Shared {
    pub(crate) library: String,
    pub(crate) tag_ub: u32,
    pub(crate) staging: usize,
    pub(crate) device: Device,
    pub(crate) timeout: Duration,
    /// `MPI_THREAD_*` level MPI provides (`serialized` or `multiple` when
    /// this crate initialized MPI).
    pub(crate) threading: &'static str,
    /// `true` when this crate called `MPI_Init_thread`.
    pub(crate) initialized_here: bool,
}

/// A message sent to self, waiting for its `recv`.
type Mail = (DType, Vec<u8>);

/// accel's [`Communicator`] over one MPI communicator (a duplicate of
/// `MPI_COMM_WORLD`, or a split of one).
///
/// Every operation is started non-blocking (`MPI_I*`) and polled with
/// `MPI_Test` until it completes or [`Communicator::timeout`] passes; see
/// the crate documentation for what a timeout does.
pub struct MpiCommunicator {
    comm: Comm,
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    caps: Capabilities,
    /// One operation at a time (collectives must be issued in order).
    serial: Mutex<()>,
    poisoned: Mutex<Option<String>>,
    mailbox: Mutex<HashMap<u32, VecDeque<Mail>>>,
    mail: Condvar,
}

impl fmt::Debug for MpiCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("timeout", &self.shared.timeout)
            .field("staging_bytes", &self.shared.staging)
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

fn mpi_error(rank: usize, op: &str, e: &ffi::MpiError) -> Error {
    err_at(ErrorKind::Backend, rank, op, format!("MPI failed: {e}"))
        .with_fix("see the MPI library's message above; mpirun's output names the failed rank")
}

/// Pause between two `MPI_Test`s: spin first (latency), then yield, then
/// sleep briefly (oversubscribed runs, long waits).
fn pause(elapsed: Duration) {
    if elapsed < Duration::from_micros(200) {
        std::hint::spin_loop();
    } else if elapsed < Duration::from_millis(20) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Poll `req` until it completes (returned, complete) or `timeout` after
/// `start` (returned, still pending, in [`Waited::TimedOut`]).
pub(crate) fn poll<'a>(
    mut req: Request<'a>,
    start: Instant,
    timeout: Duration,
) -> std::result::Result<Request<'a>, Waited<'a>> {
    loop {
        match req.test() {
            Ok(true) => return Ok(req),
            Ok(false) => {}
            Err(e) => return Err(Waited::Failed(e)),
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Err(Waited::TimedOut(req));
        }
        pause(elapsed);
    }
}

/// Why [`poll`] stopped without a completed request.
pub(crate) enum Waited<'a> {
    /// MPI reported an error (the request is complete).
    Failed(ffi::MpiError),
    /// The deadline passed; the request is still pending.
    TimedOut(Request<'a>),
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
) -> Error {
    let err = Error::timeout(
        op,
        timeout,
        format!(
            "{op} did not complete: at least one of the {world} ranks of this group has not entered it (or is stuck)"
        ),
    )
    .with_backend(NAME)
    .with_rank(rank)
    .with_fix("check that every rank makes the same calls in the same order, or raise ACCEL_TIMEOUT");
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

fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// f16/bf16 bytes widened to f32, as scratch memory.
fn widen(d: DType, src: &[u8]) -> Scratch {
    let n = src.len() / 2;
    let mut s = Scratch::new(n * 4);
    let out = s.bytes_mut();
    for (i, ch) in src.chunks_exact(2).enumerate() {
        let bits = u16::from_le_bytes([ch[0], ch[1]]);
        let v = if d == DType::F16 {
            f16::from_bits(bits).to_f32()
        } else {
            bf16::from_bits(bits).to_f32()
        };
        out[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
    }
    s
}

/// f32 scratch narrowed back into f16/bf16 bytes (rounding once), divided
/// by `div` first when it is not 1.
fn narrow(d: DType, src: &[u8], dst: &mut [u8], div: usize) {
    for (i, ch) in src.chunks_exact(4).enumerate() {
        let mut v = f32::from_le_bytes([ch[0], ch[1], ch[2], ch[3]]);
        if div != 1 {
            v /= div as f32;
        }
        let bits = if d == DType::F16 {
            f16::from_f32(v).to_bits()
        } else {
            bf16::from_f32(v).to_bits()
        };
        dst[i * 2..i * 2 + 2].copy_from_slice(&bits.to_le_bytes());
    }
}

impl MpiCommunicator {
    pub(crate) fn new(comm: Comm, rank: usize, world: usize, shared: Arc<Shared>) -> Self {
        MpiCommunicator {
            comm,
            rank,
            world,
            shared,
            caps: capabilities(),
            serial: Mutex::new(()),
            poisoned: Mutex::new(None),
            mailbox: Mutex::new(HashMap::new()),
            mail: Condvar::new(),
        }
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

    /// Operations whose largest buffer is at most this many bytes run on
    /// memory the communicator owns (`ACCEL_MPI_STAGING_BYTES`).
    pub fn staging_bytes(&self) -> usize {
        self.shared.staging
    }

    fn poison_text(&self) -> Option<String> {
        self.poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn poison(&self, why: &Error) {
        let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        if p.is_none() {
            *p = Some(why.to_string());
        }
        drop(p);
        self.mail.notify_all();
    }

    fn poisoned_error(&self, op: Op, why: String) -> Error {
        err_at(ErrorKind::Poisoned, self.rank, op.name(), why)
            .with_fix("this group is unusable after that failure: shut down and restart the run")
    }

    fn enter(&self, op: Op, dtype: DType, reduce: Option<ReduceOp>, device: Device) -> Result<()> {
        if let Some(why) = self.poison_text() {
            return Err(self.poisoned_error(op, why));
        }
        validate::call(self, op, dtype, reduce, device)
    }

    fn lock_serial(&self, op: Op) -> Result<MutexGuard<'_, ()>> {
        let g = self.serial.lock().unwrap_or_else(|p| p.into_inner());
        // Another thread may have failed (or aborted) while we waited.
        if let Some(why) = self.poison_text() {
            return Err(self.poisoned_error(op, why));
        }
        Ok(g)
    }

    fn host<'a>(&self, op: Op, b: Buf<'a>) -> Result<HostBuf<'a>> {
        b.host().ok_or_else(|| {
            Error::unsupported(NAME, op.name(), "device memory is not accepted")
                .with_rank(self.rank)
        })
    }

    fn host_mut<'a>(&self, op: Op, b: BufMut<'a>) -> Result<HostBufMut<'a>> {
        b.into_host().ok_or_else(|| {
            Error::unsupported(NAME, op.name(), "device memory is not accepted")
                .with_rank(self.rank)
        })
    }

    fn count(&self, op: Op, n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| {
            err_at(
                ErrorKind::InvalidArgument,
                self.rank,
                op.name(),
                format!("{n} elements per rank exceed MPI's count limit (2^31 - 1)"),
            )
            .with_fix("split the buffer into several calls")
        })
    }

    fn root(&self, op: Op, root: usize) -> Result<c_int> {
        validate::rank_in_group(self, op, "root", root)?;
        Ok(root as c_int)
    }

    fn staged(&self, bytes: usize) -> bool {
        bytes <= self.shared.staging
    }

    /// Start `call` and wait for it; poison the communicator on failure.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        op: Op,
        call: Call,
        t: Ty,
        count: c_int,
        send: Src<'_>,
        recv: Dst<'_>,
        owned: Owned,
    ) -> Result<Owned> {
        let _g = self.lock_serial(op)?;
        let start = Instant::now();
        let req = ffi::start(
            &self.comm,
            call,
            t,
            count,
            send,
            recv,
            owned,
            &self.shared.library,
        )
        .map_err(|e| self.failed(op, &e))?;
        self.wait(op, req, start)
    }

    fn wait(&self, op: Op, req: Request<'_>, start: Instant) -> Result<Owned> {
        match poll(req, start, self.shared.timeout) {
            Ok(done) => Ok(done.finish()),
            Err(Waited::Failed(e)) => Err(self.failed(op, &e)),
            Err(Waited::TimedOut(req)) => {
                // Poison before the request is given up (or the job
                // aborted), so that no other thread starts another call.
                let err = Error::timeout(op.name(), self.shared.timeout, "")
                    .with_backend(NAME)
                    .with_rank(self.rank);
                self.poison(&err);
                let err = timed_out(req, self.rank, op.name(), self.shared.timeout, self.world);
                *self.poisoned.lock().unwrap_or_else(|p| p.into_inner()) = Some(err.to_string());
                Err(err)
            }
        }
    }

    fn failed(&self, op: Op, e: &ffi::MpiError) -> Error {
        let err = mpi_error(self.rank, op.name(), e);
        self.poison(&err);
        err
    }

    fn reduce_common(
        &self,
        op: Op,
        buf: BufMut<'_>,
        reduce: ReduceOp,
        root: Option<usize>,
    ) -> Result<()> {
        self.enter(op, buf.dtype(), Some(reduce), buf.device())?;
        let root = root.map(|r| self.root(op, r)).transpose()?;
        let mut host = self.host_mut(op, buf)?;
        let n = host.len();
        if n == 0 {
            return Ok(());
        }
        let count = self.count(op, n)?;
        let dtype = host.dtype();
        let gets_result = root.is_none_or(|r| r as usize == self.rank);
        let call = match root {
            None => Call::AllReduce(red(reduce)),
            Some(r) => Call::Reduce(red(reduce), r),
        };
        let div = if reduce == ReduceOp::Avg {
            self.world
        } else {
            1
        };
        if is_half(dtype) {
            let owned = Owned {
                send: Some(widen(dtype, host.bytes())),
                recv: gets_result.then(|| Scratch::new(n * 4)),
            };
            let recv = if gets_result { Dst::Scratch } else { Dst::None };
            let owned = self.run(op, call, Ty::F32, count, Src::Scratch, recv, owned)?;
            if let Some(r) = owned.recv {
                narrow(dtype, r.bytes(), host.bytes_mut(), div);
            }
            return Ok(());
        }
        let t = ty(dtype);
        if self.staged(host.bytes().len()) {
            let owned = Owned {
                send: Some(Scratch::from_bytes(host.bytes())),
                recv: gets_result.then(|| Scratch::new(host.bytes().len())),
            };
            let recv = if gets_result { Dst::Scratch } else { Dst::None };
            let owned = self.run(op, call, t, count, Src::Scratch, recv, owned)?;
            if let Some(r) = owned.recv {
                host.bytes_mut().copy_from_slice(r.bytes());
            }
        } else if !gets_result {
            self.run(
                op,
                call,
                t,
                count,
                Src::User(host.bytes()),
                Dst::None,
                Owned::default(),
            )?;
        } else if ffi::has_in_place(&self.shared.library) {
            self.run(
                op,
                call,
                t,
                count,
                Src::InPlace,
                Dst::User(host.bytes_mut()),
                Owned::default(),
            )?;
        } else {
            let owned = Owned {
                send: Some(Scratch::from_bytes(host.bytes())),
                recv: None,
            };
            self.run(
                op,
                call,
                t,
                count,
                Src::Scratch,
                Dst::User(host.bytes_mut()),
                owned,
            )?;
        }
        if div != 1 && gets_result {
            host.divide_by(div);
        }
        Ok(())
    }

    fn send_self(&self, dtype: DType, bytes: &[u8], tag: u32) {
        let mut mb = self.mailbox.lock().unwrap_or_else(|p| p.into_inner());
        mb.entry(tag)
            .or_default()
            .push_back((dtype, bytes.to_vec()));
        drop(mb);
        self.mail.notify_all();
    }

    fn recv_self(&self, dst: &mut HostBufMut<'_>, tag: u32) -> Result<()> {
        let op = Op::Recv;
        let deadline = Instant::now() + self.shared.timeout;
        let mut mb = self.mailbox.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(why) = self.poison_text() {
                return Err(self.poisoned_error(op, why));
            }
            if let Some((dtype, bytes)) = mb.get_mut(&tag).and_then(VecDeque::pop_front) {
                if dtype != dst.dtype() || bytes.len() != dst.bytes().len() {
                    return Err(err_at(
                        ErrorKind::InvalidArgument,
                        self.rank,
                        op.name(),
                        format!(
                            "this rank sent itself {} {dtype} elements with tag {tag}, the receive buffer holds {} {} elements (the message was dropped)",
                            bytes.len() / dtype.size(),
                            dst.len(),
                            dst.dtype()
                        ),
                    ));
                }
                dst.bytes_mut().copy_from_slice(&bytes);
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                drop(mb);
                let err = Error::timeout(
                    op.name(),
                    self.shared.timeout,
                    format!("no message from this rank to itself with tag {tag}"),
                )
                .with_backend(NAME)
                .with_rank(self.rank)
                .with_fix("send to self before receiving from self");
                self.poison(&err);
                return Err(err);
            }
            mb = self
                .mail
                .wait_timeout(mb, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn tag(&self, op: Op, tag: u32) -> Result<c_int> {
        if tag > self.shared.tag_ub {
            return Err(err_at(
                ErrorKind::InvalidArgument,
                self.rank,
                op.name(),
                format!(
                    "tag {tag} is above this MPI library's limit MPI_TAG_UB = {}",
                    self.shared.tag_ub
                ),
            ));
        }
        Ok(tag as c_int)
    }

    /// All-gather two i64 per rank on owned memory (the split exchange).
    fn exchange(&self, op: Op, mine: [i64; 2]) -> Result<Vec<i64>> {
        let owned = Owned {
            send: Some(Scratch::from_bytes(HostBuf::from(&mine[..]).bytes())),
            recv: Some(Scratch::new(16 * self.world)),
        };
        let owned = self.run(
            op,
            Call::AllGather,
            Ty::I64,
            2,
            Src::Scratch,
            Dst::Scratch,
            owned,
        )?;
        let r = owned.recv.unwrap_or_else(|| Scratch::new(16 * self.world));
        Ok(r.bytes()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }
}

impl Communicator for MpiCommunicator {
    fn backend_name(&self) -> &str {
        NAME
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn device(&self) -> Device {
        self.shared.device
    }

    fn timeout(&self) -> Duration {
        self.shared.timeout
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
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
        let r = self.root(op, root)?;
        let mut host = self.host_mut(op, buf)?;
        if host.is_empty() {
            return Ok(());
        }
        let count = self.count(op, host.len())?;
        let t = ty(host.dtype());
        if self.staged(host.bytes().len()) {
            let owned = Owned {
                send: None,
                recv: Some(Scratch::from_bytes(host.bytes())),
            };
            let owned = self.run(op, Call::Bcast(r), t, count, Src::None, Dst::Scratch, owned)?;
            if let Some(s) = owned.recv {
                host.bytes_mut().copy_from_slice(s.bytes());
            }
            Ok(())
        } else {
            self.run(
                op,
                Call::Bcast(r),
                t,
                count,
                Src::None,
                Dst::User(host.bytes_mut()),
                Owned::default(),
            )
            .map(drop)
        }
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllGather;
        self.enter(op, send.dtype(), None, send.device())?;
        validate::lengths(
            self,
            op,
            ("send", send.dtype(), send.len()),
            ("recv", recv.dtype(), recv.len()),
            self.world,
        )?;
        let src = self.host(op, send)?;
        let mut dst = self.host_mut(op, recv)?;
        if src.is_empty() {
            return Ok(());
        }
        let count = self.count(op, src.len())?;
        let t = ty(src.dtype());
        if self.staged(dst.bytes().len()) {
            let owned = Owned {
                send: Some(Scratch::from_bytes(src.bytes())),
                recv: Some(Scratch::new(dst.bytes().len())),
            };
            let owned = self.run(
                op,
                Call::AllGather,
                t,
                count,
                Src::Scratch,
                Dst::Scratch,
                owned,
            )?;
            if let Some(s) = owned.recv {
                dst.bytes_mut().copy_from_slice(s.bytes());
            }
            Ok(())
        } else {
            self.run(
                op,
                Call::AllGather,
                t,
                count,
                Src::User(src.bytes()),
                Dst::User(dst.bytes_mut()),
                Owned::default(),
            )
            .map(drop)
        }
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let op = Op::Gather;
        self.enter(op, send.dtype(), None, send.device())?;
        let recv = validate::gather(self, &send, recv, root)?;
        let r = root as c_int;
        let src = self.host(op, send)?;
        let mut dst = recv.map(|b| self.host_mut(op, b)).transpose()?;
        if src.is_empty() {
            return Ok(());
        }
        let count = self.count(op, src.len())?;
        let t = ty(src.dtype());
        let total = src.bytes().len() * self.world;
        if self.staged(total) {
            let owned = Owned {
                send: Some(Scratch::from_bytes(src.bytes())),
                recv: dst.as_ref().map(|d| Scratch::new(d.bytes().len())),
            };
            let to = if dst.is_some() {
                Dst::Scratch
            } else {
                Dst::None
            };
            let owned = self.run(op, Call::Gather(r), t, count, Src::Scratch, to, owned)?;
            if let (Some(d), Some(s)) = (dst.as_mut(), owned.recv) {
                d.bytes_mut().copy_from_slice(s.bytes());
            }
            Ok(())
        } else {
            let to = match dst.as_mut() {
                Some(d) => Dst::User(d.bytes_mut()),
                None => Dst::None,
            };
            self.run(
                op,
                Call::Gather(r),
                t,
                count,
                Src::User(src.bytes()),
                to,
                Owned::default(),
            )
            .map(drop)
        }
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Scatter;
        self.enter(op, recv.dtype(), None, recv.device())?;
        let src = validate::scatter(self, send, &recv, root)?
            .map(|b| self.host(op, b))
            .transpose()?;
        let r = root as c_int;
        let mut dst = self.host_mut(op, recv)?;
        if dst.is_empty() {
            return Ok(());
        }
        let count = self.count(op, dst.len())?;
        let t = ty(dst.dtype());
        let total = dst.bytes().len() * self.world;
        if self.staged(total) {
            let owned = Owned {
                send: src.map(|s| Scratch::from_bytes(s.bytes())),
                recv: Some(Scratch::new(dst.bytes().len())),
            };
            let from = if owned.send.is_some() {
                Src::Scratch
            } else {
                Src::None
            };
            let owned = self.run(op, Call::Scatter(r), t, count, from, Dst::Scratch, owned)?;
            if let Some(s) = owned.recv {
                dst.bytes_mut().copy_from_slice(s.bytes());
            }
            Ok(())
        } else {
            let from = match &src {
                Some(s) => Src::User(s.bytes()),
                None => Src::None,
            };
            self.run(
                op,
                Call::Scatter(r),
                t,
                count,
                from,
                Dst::User(dst.bytes_mut()),
                Owned::default(),
            )
            .map(drop)
        }
    }

    /// `MPI_Ireduce_scatter_block`; f16/bf16 in f32.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, reduce: ReduceOp) -> Result<()> {
        let op = Op::ReduceScatter;
        self.enter(op, send.dtype(), Some(reduce), send.device())?;
        validate::lengths(
            self,
            op,
            ("recv", recv.dtype(), recv.len()),
            ("send", send.dtype(), send.len()),
            self.world,
        )?;
        let src = self.host(op, send)?;
        let mut dst = self.host_mut(op, recv)?;
        if dst.is_empty() {
            return Ok(());
        }
        let n = dst.len();
        let count = self.count(op, n)?;
        let dtype = dst.dtype();
        let call = Call::ReduceScatterBlock(red(reduce));
        let div = if reduce == ReduceOp::Avg {
            self.world
        } else {
            1
        };
        if is_half(dtype) {
            let owned = Owned {
                send: Some(widen(dtype, src.bytes())),
                recv: Some(Scratch::new(n * 4)),
            };
            let owned = self.run(op, call, Ty::F32, count, Src::Scratch, Dst::Scratch, owned)?;
            if let Some(r) = owned.recv {
                narrow(dtype, r.bytes(), dst.bytes_mut(), div);
            }
            return Ok(());
        }
        let t = ty(dtype);
        if self.staged(src.bytes().len()) {
            let owned = Owned {
                send: Some(Scratch::from_bytes(src.bytes())),
                recv: Some(Scratch::new(dst.bytes().len())),
            };
            let owned = self.run(op, call, t, count, Src::Scratch, Dst::Scratch, owned)?;
            if let Some(r) = owned.recv {
                dst.bytes_mut().copy_from_slice(r.bytes());
            }
        } else {
            self.run(
                op,
                call,
                t,
                count,
                Src::User(src.bytes()),
                Dst::User(dst.bytes_mut()),
                Owned::default(),
            )?;
        }
        if div != 1 {
            dst.divide_by(div);
        }
        Ok(())
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllToAll;
        self.enter(op, send.dtype(), None, send.device())?;
        validate::all_to_all(self, &send, &recv)?;
        let src = self.host(op, send)?;
        let mut dst = self.host_mut(op, recv)?;
        if src.is_empty() {
            return Ok(());
        }
        let count = self.count(op, src.len() / self.world)?;
        let t = ty(src.dtype());
        if self.staged(src.bytes().len()) {
            let owned = Owned {
                send: Some(Scratch::from_bytes(src.bytes())),
                recv: Some(Scratch::new(dst.bytes().len())),
            };
            let owned = self.run(
                op,
                Call::AllToAll,
                t,
                count,
                Src::Scratch,
                Dst::Scratch,
                owned,
            )?;
            if let Some(r) = owned.recv {
                dst.bytes_mut().copy_from_slice(r.bytes());
            }
            Ok(())
        } else {
            self.run(
                op,
                Call::AllToAll,
                t,
                count,
                Src::User(src.bytes()),
                Dst::User(dst.bytes_mut()),
                Owned::default(),
            )
            .map(drop)
        }
    }

    /// `MPI_Isend` of the raw bytes; sends to self go through an in-process
    /// mailbox (buffered, as the contract requires).
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let op = Op::Send;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "destination", dst)?;
        let src = self.host(op, buf)?;
        if dst == self.rank {
            self.send_self(src.dtype(), src.bytes(), tag);
            return Ok(());
        }
        let t = self.tag(op, tag)?;
        let count = self.count(op, src.bytes().len())?;
        let call = Call::Send {
            dst: dst as c_int,
            tag: t,
        };
        if self.staged(src.bytes().len()) {
            let owned = Owned {
                send: Some(Scratch::from_bytes(src.bytes())),
                recv: None,
            };
            self.run(op, call, Ty::U8, count, Src::Scratch, Dst::None, owned)
                .map(drop)
        } else {
            self.run(
                op,
                call,
                Ty::U8,
                count,
                Src::User(src.bytes()),
                Dst::None,
                Owned::default(),
            )
            .map(drop)
        }
    }

    /// Matches the message first (`MPI_Improbe`, polled until the timeout:
    /// a message that never comes leaves nothing pending), checks its size,
    /// then receives it (`MPI_Imrecv`). A message of the wrong size is
    /// received and dropped, and the call fails with `InvalidArgument`.
    /// Only sizes are checked: MPI does not carry the element type.
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let op = Op::Recv;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "source", src)?;
        let mut dst = self.host_mut(op, buf)?;
        if src == self.rank {
            return self.recv_self(&mut dst, tag);
        }
        let t = self.tag(op, tag)?;
        let _g = self.lock_serial(op)?;
        let start = Instant::now();
        let matched = loop {
            match ffi::improbe(&self.comm, src as c_int, t) {
                Ok(Some(m)) => break m,
                Ok(None) => {}
                Err(e) => return Err(self.failed(op, &e)),
            }
            let elapsed = start.elapsed();
            if elapsed >= self.shared.timeout {
                let err = Error::timeout(
                    op.name(),
                    self.shared.timeout,
                    format!("no message from rank {src} with tag {tag}"),
                )
                .with_backend(NAME)
                .with_rank(self.rank)
                .with_fix(format!(
                    "check that rank {src} sends with tag {tag}, or raise ACCEL_TIMEOUT"
                ));
                self.poison(&err);
                return Err(err);
            }
            pause(elapsed);
        };
        let want = dst.bytes().len();
        let got = matched.bytes;
        if got != want {
            let req = matched
                .receive(
                    Dst::Scratch,
                    Owned {
                        send: None,
                        recv: Some(Scratch::new(got)),
                    },
                )
                .map_err(|e| self.failed(op, &e))?;
            self.wait(op, req, start)?;
            let d = dst.dtype();
            return Err(err_at(
                ErrorKind::InvalidArgument,
                self.rank,
                op.name(),
                format!(
                    "rank {src} sent {got} bytes with tag {tag} ({} {d} elements), the receive buffer holds {} {d} elements (the message was dropped)",
                    got as f64 / d.size() as f64,
                    dst.len(),
                ),
            ));
        }
        if self.staged(want) {
            let req = matched
                .receive(
                    Dst::Scratch,
                    Owned {
                        send: None,
                        recv: Some(Scratch::new(want)),
                    },
                )
                .map_err(|e| self.failed(op, &e))?;
            let owned = self.wait(op, req, start)?;
            if let Some(r) = owned.recv {
                dst.bytes_mut().copy_from_slice(r.bytes());
            }
            Ok(())
        } else {
            let req = matched
                .receive(Dst::User(dst.bytes_mut()), Owned::default())
                .map_err(|e| self.failed(op, &e))?;
            self.wait(op, req, start).map(drop)
        }
    }

    fn barrier(&self) -> Result<()> {
        let op = Op::Barrier;
        self.enter(op, DType::U8, None, Device::CPU)?;
        self.run(
            op,
            Call::Barrier,
            Ty::U8,
            0,
            Src::None,
            Dst::None,
            Owned::default(),
        )
        .map(drop)
    }

    /// Exchanges `(color, key)` with a timed all-gather (which also proves
    /// that every rank entered), then calls `MPI_Comm_split` with a dense
    /// color index and this rank's position in its `(key, rank)` order, so
    /// that every `u32` color and key works.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let op = Op::Split;
        self.enter(op, DType::U8, None, Device::CPU)?;
        let all = self.exchange(op, [color.map_or(-1, i64::from), i64::from(key)])?;
        let _g = self.lock_serial(op)?;
        let colors: Vec<i64> = (0..self.world).map(|r| all[2 * r]).collect();
        let mut distinct: Vec<i64> = colors.iter().copied().filter(|&c| c >= 0).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let (mpi_color, mpi_key, members) = match color {
            None => (None, 0, 0),
            Some(c) => {
                let c = i64::from(c);
                let mut members: Vec<(i64, usize)> = (0..self.world)
                    .filter(|&r| colors[r] == c)
                    .map(|r| (all[2 * r + 1], r))
                    .collect();
                members.sort_unstable();
                let pos = members
                    .iter()
                    .position(|&(_, r)| r == self.rank)
                    .unwrap_or(0);
                let dense = distinct.iter().position(|&x| x == c).unwrap_or(0);
                (Some(dense as c_int), pos as c_int, members.len())
            }
        };
        let sub = self
            .comm
            .split(mpi_color, mpi_key)
            .map_err(|e| self.failed(op, &e))?;
        match (sub, color) {
            (Some(comm), Some(_)) => Ok(Some(Box::new(MpiCommunicator::new(
                comm,
                mpi_key as usize,
                members,
                self.shared.clone(),
            )))),
            (None, None) => Ok(None),
            _ => {
                let err = err_at(
                    ErrorKind::Backend,
                    self.rank,
                    op.name(),
                    "MPI_Comm_split disagreed with the exchanged colors",
                );
                self.poison(&err);
                Err(err)
            }
        }
    }

    /// Poisons the communicator. A call in flight runs until it completes
    /// or times out (MPI cannot cancel collectives): `abort_interrupts` is
    /// `false`.
    fn abort(&self, reason: &str) {
        {
            let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
            if p.is_none() {
                *p = Some(format!("aborted: {reason}"));
            }
        }
        self.mail.notify_all();
    }
}
