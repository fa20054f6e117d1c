//! [`NcclEngine`]: the calls into NCCL for one communicator, on arguments
//! the [`Group`] has checked.
//!
//! Every call follows one path ([`NcclEngine::launch`]): bind the device's
//! primary context to the calling thread, make the communicator's stream
//! wait for the work already queued on each device view's stream, copy host
//! buffers into device staging memory, enqueue the NCCL call(s), then poll
//! `ncclCommGetAsyncError` and `cuStreamQuery` until both say done, the
//! deadline passes, or [`Engine::abort`] was called. On a timeout, an NCCL
//! error or an abort the communicator is aborted (`ncclCommAbort`) and the
//! error is fatal, so the group poisons itself.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use accel_api::kit::{
    Backoff, Deadline, Engine, EngineInfo, Group, Growth, Mailbox, P2pHeader as Header, Polled,
    Taken, Until,
};
use accel_api::{
    Buf, BufMut, Capabilities, DType, Device, DeviceKind, Error, Op, ReduceOp, Result, Store,
};
use cudarc::driver::CudaContext;

use crate::error::NcclFailure;
use crate::ffi::{Call, Comm, DeviceMem, NcclOp, NcclType, OwnedStream, Progress, Stream};
use crate::name::NAME;
use accel_api::sync::lock;

/// The communicator of the `cuda-nccl` backend.
pub type NcclCommunicator = Group<NcclEngine>;

/// What [`NcclEngine`] accepts: every operation, the eight element types,
/// every reduction (average native), on CUDA memory of its device and on
/// host memory (staged through device memory).
pub fn capabilities() -> Capabilities {
    let mut c = Capabilities::all_host()
        .with_dtypes(DType::ALL)
        .with_reduce_dtypes(DType::ALL)
        .with_device_kinds([DeviceKind::Cpu, DeviceKind::Cuda]);
    c.abort_interrupts = true;
    c
}

fn nccl_type(d: DType) -> NcclType {
    match d {
        DType::F16 => NcclType::ncclFloat16,
        DType::BF16 => NcclType::ncclBfloat16,
        DType::F32 => NcclType::ncclFloat32,
        DType::F64 => NcclType::ncclFloat64,
        DType::I8 => NcclType::ncclInt8,
        DType::U8 => NcclType::ncclUint8,
        DType::I32 => NcclType::ncclInt32,
        DType::I64 => NcclType::ncclInt64,
        // `DType` is non-exhaustive: a type added later is not declared
        // by `capabilities`, so the group refuses it before it gets here.
        #[allow(unreachable_patterns)]
        _ => NcclType::ncclUint8,
    }
}

fn nccl_op(r: ReduceOp) -> NcclOp {
    match r {
        ReduceOp::Sum => NcclOp::ncclSum,
        ReduceOp::Prod => NcclOp::ncclProd,
        ReduceOp::Min => NcclOp::ncclMin,
        ReduceOp::Max => NcclOp::ncclMax,
        ReduceOp::Avg => NcclOp::ncclAvg,
        // `ReduceOp` is non-exhaustive; a new op is not declared.
        #[allow(unreachable_patterns)]
        _ => NcclOp::ncclSum,
    }
}

/// Everything a communicator shares with the sub-groups split from it.
pub(crate) struct Shared {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) store: Arc<dyn Store>,
}

/// The engine of one NCCL communicator.
pub struct NcclEngine {
    info: EngineInfo,
    shared: Arc<Shared>,
    /// Store keys of this communicator live under this prefix.
    prefix: String,
    stream: OwnedStream,
    comm: Comm,
    /// Device staging memory for host buffers (grown on demand) and the
    /// one-element barrier buffer.
    staging: Mutex<[Option<DeviceMem>; 2]>,
    barrier_buf: DeviceMem,
    /// Device messages sent to self, each in a device copy of its own.
    self_mail: Mailbox<DeviceMem>,
    aborted: AtomicBool,
    splits: AtomicU32,
}

impl std::fmt::Debug for NcclEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclEngine")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// A buffer of one call, resolved to a device address.
enum Place<'a> {
    /// Device memory of the caller, ordered on its stream.
    Device { addr: u64, stream: Stream },
    /// Host memory staged in `staging[slot]`; copied back when `out`.
    Host {
        slot: usize,
        src: &'a [u8],
        out: Option<&'a mut [u8]>,
        /// Upload `out`'s current contents (in-place collectives).
        upload_out: bool,
    },
}

/// The poll loop's wait between two looks: spin first (a small collective
/// finishes in microseconds), then yield, then sleep 1 us more each time up
/// to 250 us (a long collective is overshot by at most that).
const PAUSE: Backoff = Backoff::sleep(Duration::from_micros(1))
    .spin(Until::Looks(64))
    .then_yield(Until::Looks(256))
    .grow(
        Growth::Add(Duration::from_micros(1)),
        Duration::from_micros(250),
    );

impl NcclEngine {
    /// Connect one rank of a new communicator with the 128-byte `id`;
    /// NCCL's initialisation must finish by `deadline`, later calls get
    /// `timeout` each.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn init(
        shared: Arc<Shared>,
        prefix: String,
        rank: usize,
        world: usize,
        device: Device,
        timeout: Duration,
        deadline: Instant,
        id: &[u8; 128],
    ) -> std::result::Result<NcclEngine, NcclFailure> {
        shared
            .ctx
            .bind_to_thread()
            .map_err(|e| NcclFailure::driver("cuCtxSetCurrent", e))?;
        let comm = Comm::init_rank(world, id, rank)?;
        Self::finish(
            shared,
            prefix,
            comm,
            device,
            timeout,
            deadline,
            "ncclCommInitRankConfig",
        )
    }

    /// Wait for a new communicator to be ready and build its engine.
    fn finish(
        shared: Arc<Shared>,
        prefix: String,
        comm: Comm,
        device: Device,
        timeout: Duration,
        deadline: Instant,
        what: &str,
    ) -> std::result::Result<NcclEngine, NcclFailure> {
        let ready = Deadline::until(deadline, timeout).poll(&PAUSE, || {
            Ok(match comm.async_error()? {
                Progress::Done => Some(()),
                Progress::InProgress => None,
            })
        });
        match ready {
            Ok(()) => {}
            Err(Polled::Failed(e)) => return Err(e),
            Err(Polled::TimedOut) => {
                comm.abort();
                return Err(NcclFailure::Timeout {
                    what: format!("{what} on {device}"),
                    after: timeout,
                    culprit: None,
                });
            }
        }
        let (world_size, rank) = comm.count_and_rank()?;
        let stream =
            OwnedStream::new(&shared.ctx).map_err(|e| NcclFailure::driver("cuStreamCreate", e))?;
        let barrier_buf =
            DeviceMem::alloc(&shared.ctx, 8).map_err(|e| NcclFailure::driver("cuMemAlloc", e))?;
        Ok(NcclEngine {
            info: EngineInfo {
                backend: NAME.to_string(),
                rank,
                world_size,
                device,
                timeout,
                capabilities: capabilities(),
            },
            shared,
            prefix,
            stream,
            comm,
            staging: Mutex::new([None, None]),
            barrier_buf,
            self_mail: Mailbox::new(rank),
            aborted: AtomicBool::new(false),
            splits: AtomicU32::new(0),
        })
    }

    /// The store prefix of this communicator (`cuda-nccl/<n>` for the
    /// world group).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    fn bind(&self) -> std::result::Result<(), NcclFailure> {
        self.shared
            .ctx
            .bind_to_thread()
            .map_err(|e| NcclFailure::driver("cuCtxSetCurrent", e))
    }

    /// A staging slot of at least `bytes` bytes.
    fn staging_addr(&self, slot: usize, bytes: usize) -> std::result::Result<u64, NcclFailure> {
        let mut st = lock(&self.staging);
        if st[slot].as_ref().is_none_or(|m| m.bytes() < bytes) {
            st[slot] = None;
            let m = DeviceMem::alloc(&self.shared.ctx, bytes.next_power_of_two())
                .map_err(|e| NcclFailure::driver("cuMemAlloc", e))?;
            st[slot] = Some(m);
        }
        Ok(st[slot].as_ref().map_or(0, DeviceMem::addr))
    }

    /// The device address of a read-only argument.
    fn place_in<'a>(&self, slot: usize, b: Buf<'a>) -> Place<'a> {
        match b {
            Buf::Host(h) => Place::Host {
                slot,
                src: h.bytes(),
                out: None,
                upload_out: false,
            },
            Buf::Device(d) => Place::Device {
                addr: d.addr(),
                stream: Stream::from_view(d.stream()),
            },
        }
    }

    /// The device address of a writable argument; `read` when its current
    /// contents are an input too (in-place collectives).
    fn place_out<'a>(&self, slot: usize, b: BufMut<'a>, read: bool) -> Place<'a> {
        match b {
            BufMut::Host(h) => Place::Host {
                slot,
                src: &[],
                out: Some(h.into_bytes()),
                upload_out: read,
            },
            BufMut::Device(d) => Place::Device {
                addr: d.addr(),
                stream: Stream::from_view(d.stream()),
            },
        }
    }

    /// Run `calls` (one NCCL call, or several in an NCCL group) on the
    /// places, waiting for completion within the timeout. `calls` gets the
    /// device address of each place.
    fn launch(
        &self,
        op: Op,
        what: &str,
        places: Vec<Place<'_>>,
        calls: impl FnOnce(&[u64]) -> Vec<Call>,
    ) -> std::result::Result<(), NcclFailure> {
        let deadline = Instant::now() + self.info.timeout;
        self.bind()?;
        let mut addrs = Vec::with_capacity(places.len());
        let mut waited: Vec<Stream> = Vec::new();
        for p in &places {
            match p {
                Place::Device { addr, stream } => {
                    if *stream != self.stream.raw() && !waited.contains(stream) {
                        self.stream
                            .wait_for(*stream)
                            .map_err(|e| NcclFailure::driver("cuStreamWaitEvent", e))?;
                        waited.push(*stream);
                    }
                    addrs.push(*addr);
                }
                Place::Host {
                    slot,
                    src,
                    out,
                    upload_out,
                } => {
                    let bytes = src.len().max(out.as_ref().map_or(0, |o| o.len()));
                    let a = self.staging_addr(*slot, bytes)?;
                    let up: &[u8] = match (upload_out, out) {
                        (true, Some(o)) => o,
                        _ => src,
                    };
                    if !up.is_empty() {
                        self.stream
                            .upload(a, up)
                            .map_err(|e| NcclFailure::driver("cuMemcpyHtoDAsync", e))?;
                    }
                    addrs.push(a);
                }
            }
        }
        let calls = calls(&addrs);
        let grouped = calls.len() > 1;
        if grouped {
            self.comm.group_start()?;
        }
        let mut first_err = None;
        for c in &calls {
            if let Err(e) = self.comm.enqueue(c, self.stream.raw()) {
                first_err = Some(e);
                break;
            }
        }
        if grouped {
            let end = self.comm.group_end();
            if first_err.is_none() {
                if let Err(e) = end {
                    first_err = Some(e);
                }
            }
        }
        if let Some(e) = first_err {
            self.comm.abort();
            return Err(e);
        }
        self.wait(op, what, deadline)?;
        // Copy host outputs back, then wait for the copies.
        let mut copied = false;
        for (p, a) in places.into_iter().zip(&addrs) {
            if let Place::Host { out: Some(o), .. } = p {
                if !o.is_empty() {
                    self.stream
                        .download(o, *a)
                        .map_err(|e| NcclFailure::driver("cuMemcpyDtoHAsync", e))?;
                    copied = true;
                }
            }
        }
        if copied {
            self.wait(op, what, deadline)?;
        }
        Ok(())
    }

    /// Poll until the communicator and the stream are done, the deadline
    /// passes (abort, timeout) or someone aborted.
    fn wait(&self, op: Op, what: &str, deadline: Instant) -> std::result::Result<(), NcclFailure> {
        let done = Deadline::until(deadline, self.info.timeout).poll(&PAUSE, || {
            if self.aborted.load(Ordering::SeqCst) {
                return Err(NcclFailure::Aborted);
            }
            let nccl = self.comm.async_error()?;
            let idle = self.stream.is_idle().map_err(|code| NcclFailure::Driver {
                call: "cuStreamQuery",
                code: format!("{code:?}"),
            })?;
            Ok((nccl == Progress::Done && idle).then_some(()))
        });
        match done {
            Ok(()) => Ok(()),
            Err(Polled::Failed(e)) => {
                self.comm.abort();
                Err(e)
            }
            Err(Polled::TimedOut) => {
                self.comm.abort();
                Err(NcclFailure::Timeout {
                    what: format!("the NCCL {} ({what}) on {}", op.name(), self.info.device),
                    after: self.info.timeout,
                    culprit: self.culprit(),
                })
            }
        }
    }

    /// The first other rank that published a failure under this
    /// communicator's prefix (looked up for at most 64 ranks).
    fn culprit(&self) -> Option<(usize, String)> {
        (0..self.info.world_size.min(64))
            .filter(|&r| r != self.info.rank)
            .find_map(|r| {
                let v = self
                    .shared
                    .store
                    .try_get(&format!("{}/fault/{r}", self.prefix))
                    .ok()
                    .flatten()?;
                Some((r, String::from_utf8_lossy(&v).into_owned()))
            })
    }

    fn describe(len: usize, dtype: DType) -> String {
        format!("{len} {dtype}")
    }
}

impl Engine for NcclEngine {
    /// NCCL's `ncclAvg` (floating point: each contribution is multiplied
    /// by `1/n` before the sum; integers: sum, then divide, truncating).
    const NATIVE_AVG: bool = true;

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (count, dtype) = (buf.len(), buf.dtype());
        let (ty, op) = (nccl_type(dtype), nccl_op(op));
        let p = self.place_out(0, buf, true);
        self.launch(Op::AllReduce, &Self::describe(count, dtype), vec![p], |a| {
            vec![Call::AllReduce(a[0], a[0], count, ty, op)]
        })
        .map_err(Error::from)
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        let (count, dtype) = (buf.len(), buf.dtype());
        let (ty, op) = (nccl_type(dtype), nccl_op(op));
        let p = self.place_out(0, buf, true);
        self.launch(Op::Reduce, &Self::describe(count, dtype), vec![p], |a| {
            vec![Call::Reduce(a[0], a[0], count, ty, op, root)]
        })
        .map_err(Error::from)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let (count, dtype) = (buf.len(), buf.dtype());
        let p = self.place_out(0, buf, self.info.rank == root);
        self.launch(Op::Broadcast, &Self::describe(count, dtype), vec![p], |a| {
            vec![Call::Broadcast(a[0], count, nccl_type(dtype), root)]
        })
        .map_err(Error::from)
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let (count, dtype) = (send.len(), send.dtype());
        let places = vec![self.place_in(0, send), self.place_out(1, recv, false)];
        self.launch(Op::AllGather, &Self::describe(count, dtype), places, |a| {
            vec![Call::AllGather(a[0], a[1], count, nccl_type(dtype))]
        })
        .map_err(Error::from)
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let (count, dtype) = (send.len(), send.dtype());
        let ty = nccl_type(dtype);
        let bytes = count * dtype.size();
        let world = self.info.world_size;
        let mut places = vec![self.place_in(0, send)];
        let is_root = recv.is_some();
        if let Some(r) = recv {
            places.push(self.place_out(1, r, false));
        }
        self.launch(Op::Gather, &Self::describe(count, dtype), places, |a| {
            let mut calls = vec![Call::Send(a[0], count, ty, root)];
            if is_root {
                calls.extend(
                    (0..world).map(|r| Call::Recv(a[1] + (r * bytes) as u64, count, ty, r)),
                );
            }
            calls
        })
        .map_err(Error::from)
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let (count, dtype) = (recv.len(), recv.dtype());
        let ty = nccl_type(dtype);
        let bytes = count * dtype.size();
        let world = self.info.world_size;
        let mut places = vec![self.place_out(0, recv, false)];
        let is_root = send.is_some();
        if let Some(s) = send {
            places.push(self.place_in(1, s));
        }
        self.launch(Op::Scatter, &Self::describe(count, dtype), places, |a| {
            let mut calls = Vec::new();
            if is_root {
                calls.extend(
                    (0..world).map(|r| Call::Send(a[1] + (r * bytes) as u64, count, ty, r)),
                );
            }
            calls.push(Call::Recv(a[0], count, ty, root));
            calls
        })
        .map_err(Error::from)
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (count, dtype) = (recv.len(), recv.dtype());
        let (ty, op) = (nccl_type(dtype), nccl_op(op));
        let places = vec![self.place_in(0, send), self.place_out(1, recv, false)];
        let what = Self::describe(count, dtype);
        self.launch(Op::ReduceScatter, &what, places, |a| {
            vec![Call::ReduceScatter(a[0], a[1], count, ty, op)]
        })
        .map_err(Error::from)
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let dtype = send.dtype();
        let count = send.len() / self.info.world_size;
        let ty = nccl_type(dtype);
        let bytes = (count * dtype.size()) as u64;
        let world = self.info.world_size;
        let places = vec![self.place_in(0, send), self.place_out(1, recv, false)];
        self.launch(Op::AllToAll, &Self::describe(count, dtype), places, |a| {
            (0..world)
                .flat_map(|r| {
                    let off = r as u64 * bytes;
                    [
                        Call::Send(a[0] + off, count, ty, r),
                        Call::Recv(a[1] + off, count, ty, r),
                    ]
                })
                .collect()
        })
        .map_err(Error::from)
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let (count, dtype) = (buf.len(), buf.dtype());
        if dst == self.info.rank {
            return self.send_self(buf, tag).map_err(Error::from);
        }
        let header = Header::new(dtype, count, tag).encode();
        let hp = Place::Host {
            slot: 0,
            src: &header,
            out: None,
            upload_out: false,
        };
        self.launch(Op::Send, "header", vec![hp], |a| {
            vec![Call::Send(a[0], Header::BYTES, NcclType::ncclUint8, dst)]
        })?;
        if count == 0 {
            return Ok(());
        }
        let p = self.place_in(1, buf);
        self.launch(Op::Send, &Self::describe(count, dtype), vec![p], |a| {
            vec![Call::Send(a[0], count, nccl_type(dtype), dst)]
        })
        .map_err(Error::from)
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let (count, dtype) = (buf.len(), buf.dtype());
        if src == self.info.rank {
            return self.recv_self(buf, tag).map_err(Error::from);
        }
        let mut header = [0u8; Header::BYTES];
        let hp = Place::Host {
            slot: 0,
            src: &[],
            out: Some(&mut header),
            upload_out: false,
        };
        self.launch(Op::Recv, "header", vec![hp], |a| {
            vec![Call::Recv(a[0], Header::BYTES, NcclType::ncclUint8, src)]
        })?;
        let got = Header::decode(&header);
        let want = Header::new(dtype, count, tag);
        if DType::from_code(got.dtype).is_none_or(|d| !got.bytes.is_multiple_of(d.size() as u64)) {
            // Not a header this backend wrote: the peers are out of step.
            self.comm.abort();
            return Err(NcclFailure::Nccl {
                call: crate::error::NcclCall::Recv,
                code: 0,
                text: format!("the message header from rank {src} is not one accel sent ({got:?})"),
                last: String::new(),
            }
            .into());
        }
        if got != want {
            // Drain the payload so that the stream of messages stays in
            // step, then refuse.
            if got.bytes > 0 {
                // Into device staging: no host copy of a message nobody wants.
                let sink = self.staging_addr(1, got.bytes as usize)?;
                let p = Place::Device {
                    addr: sink,
                    stream: self.stream.raw(),
                };
                self.launch(Op::Recv, "dropped message", vec![p], |a| {
                    vec![Call::Recv(
                        a[0],
                        got.bytes as usize,
                        NcclType::ncclUint8,
                        src,
                    )]
                })?;
            }
            return Err(NcclFailure::Protocol(format!(
                "the next message from rank {src} is {} bytes of {} with tag {}, this receive expects {} {dtype} elements with tag {tag} (NCCL delivers messages in order, not by tag; the message was dropped)",
                got.bytes,
                DType::from_code(got.dtype).map_or("?".to_string(), |d| d.to_string()),
                got.tag,
                count
            ))
            .into());
        }
        if count == 0 {
            return Ok(());
        }
        let p = self.place_out(1, buf, false);
        self.launch(Op::Recv, &Self::describe(count, dtype), vec![p], |a| {
            vec![Call::Recv(a[0], count, nccl_type(dtype), src)]
        })
        .map_err(Error::from)
    }

    /// A one-element all-reduce and a stream sync (NCCL has no barrier).
    fn barrier(&self) -> Result<()> {
        let addr = self.barrier_buf.addr();
        self.launch(
            Op::Barrier,
            "1 i32",
            vec![Place::Device {
                addr,
                stream: self.stream.raw(),
            }],
            |a| {
                vec![Call::AllReduce(
                    a[0],
                    a[0],
                    1,
                    NcclType::ncclInt32,
                    NcclOp::ncclSum,
                )]
            },
        )
        .map_err(Error::from)
    }

    /// `ncclCommSplit` (non-blocking), polled within the timeout.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        let too_big = |what: &str, v: u32| {
            Error::invalid_argument(
                Op::Split.name(),
                format!("{what} {v} does not fit NCCL's int (at most {})", i32::MAX),
            )
        };
        let c = match color {
            Some(c) => Some(i32::try_from(c).map_err(|_| too_big("color", c))?),
            None => None,
        };
        let k = i32::try_from(key).map_err(|_| too_big("key", key))?;
        let n = self.splits.fetch_add(1, Ordering::SeqCst);
        let deadline = Instant::now() + self.info.timeout;
        self.bind()?;
        let sub = match self.comm.split(c, k) {
            Ok(s) => s,
            Err(e) => {
                self.comm.abort();
                return Err(e.into());
            }
        };
        // The parent finishes its part of the split too.
        self.wait(Op::Split, "ncclCommSplit", deadline)?;
        let Some(sub) = sub else {
            return Ok(None);
        };
        let prefix = format!("{}/split{n}/color{}", self.prefix, color.unwrap_or(0));
        NcclEngine::finish(
            self.shared.clone(),
            prefix,
            sub,
            self.info.device,
            self.info.timeout,
            deadline,
            "ncclCommSplit",
        )
        .map(Some)
        .map_err(Error::from)
    }

    /// Interrupt a call in flight: the poll loop sees the flag, aborts the
    /// communicator and returns [`accel_api::ErrorKind::Aborted`]. Never
    /// blocks.
    fn abort(&self, reason: &str) {
        tracing::warn!(rank = self.info.rank, reason, "cuda-nccl: abort requested");
        self.aborted.store(true, Ordering::SeqCst);
    }

    /// Publish the cause for the peers (their timeouts name this rank),
    /// then abort the communicator so that NCCL's threads stop.
    fn on_fatal(&self, err: &Error) {
        let _ = self.shared.store.set(
            &format!("{}/fault/{}", self.prefix, self.info.rank),
            err.to_string().as_bytes(),
        );
        self.comm.abort();
    }
}

impl NcclEngine {
    fn send_self(&self, buf: Buf<'_>, tag: u32) -> std::result::Result<(), NcclFailure> {
        let Buf::Device(d) = buf else {
            return Err(NcclFailure::Protocol(
                "a host send to self reached the engine".into(),
            ));
        };
        self.bind()?;
        let m = DeviceMem::alloc(&self.shared.ctx, d.size_bytes())
            .map_err(|e| NcclFailure::driver("cuMemAlloc", e))?;
        let deadline = Instant::now() + self.info.timeout;
        let src = Stream::from_view(d.stream());
        self.stream
            .wait_for(src)
            .map_err(|e| NcclFailure::driver("cuStreamWaitEvent", e))?;
        if d.size_bytes() > 0 {
            self.stream
                .copy(m.addr(), d.addr(), d.size_bytes())
                .map_err(|e| NcclFailure::driver("cuMemcpyDtoDAsync", e))?;
        }
        self.wait(Op::Send, "copy to self", deadline)?;
        let rank = self.info.rank;
        self.self_mail.post(rank, tag, d.dtype(), m.bytes(), m);
        Ok(())
    }

    fn recv_self(&self, buf: BufMut<'_>, tag: u32) -> std::result::Result<(), NcclFailure> {
        let BufMut::Device(d) = buf else {
            return Err(NcclFailure::Protocol(
                "a host receive from self reached the engine".into(),
            ));
        };
        let m = match self.self_mail.take(self.info.rank, tag, d.dtype(), d.len()) {
            Taken::Fits(m) => m,
            Taken::Misfit(text) => return Err(NcclFailure::Protocol(text)),
            Taken::Empty => {
                return Err(NcclFailure::Protocol(format!(
                    "no device message from this rank to itself with tag {tag}: send to self before receiving from self"
                )))
            }
        };
        self.bind()?;
        let deadline = Instant::now() + self.info.timeout;
        self.stream
            .wait_for(Stream::from_view(d.stream()))
            .map_err(|e| NcclFailure::driver("cuStreamWaitEvent", e))?;
        if m.bytes() > 0 {
            self.stream
                .copy(d.addr(), m.addr(), m.bytes())
                .map_err(|e| NcclFailure::driver("cuMemcpyDtoDAsync", e))?;
        }
        self.wait(Op::Recv, "copy from self", deadline)
    }
}

impl Drop for NcclEngine {
    /// Finalize and destroy the communicator (bounded), or abort it.
    fn drop(&mut self) {
        if self.bind().is_ok() {
            self.comm
                .close(self.info.timeout.min(Duration::from_secs(10)));
        } else {
            self.comm.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_and_reduction_has_an_nccl_code() {
        let types: std::collections::BTreeSet<u32> =
            DType::ALL.iter().map(|&d| nccl_type(d) as u32).collect();
        assert_eq!(types.len(), DType::ALL.len(), "distinct NCCL types");
        assert_eq!(nccl_type(DType::BF16) as u32, 9);
        assert_eq!(nccl_type(DType::U8) as u32, 1);
        let ops: std::collections::BTreeSet<u32> =
            ReduceOp::ALL.iter().map(|&r| nccl_op(r) as u32).collect();
        assert_eq!(ops.len(), ReduceOp::ALL.len());
        assert_eq!(nccl_op(ReduceOp::Avg) as u32, 4);
        assert_eq!(nccl_op(ReduceOp::Min) as u32, 3);
    }

    #[test]
    fn capabilities_take_host_and_cuda_memory() {
        let c = capabilities();
        assert!(c.device_kinds.contains(&DeviceKind::Cuda));
        assert!(c.device_kinds.contains(&DeviceKind::Cpu));
        assert_eq!(c.ops.len(), Op::ALL.len());
        assert_eq!(c.reduce_dtypes.len(), DType::ALL.len(), "bf16 reduces too");
        assert!(c.abort_interrupts);
    }
}
