//! [`NpuEngine`]: HCCL on one NPU, as an [`accel_api::kit::Engine`].
//!
//! Every call enqueues HCCL work on the communicator's own AscendCL stream
//! and then polls, until the accel timeout, `HcclGetCommAsyncError` and
//! `aclrtStreamQuery`; nothing blocks inside the libraries without a bound.
//! Host buffers are staged through device memory (copy in, run, copy out);
//! device views are used in place after their own stream finished.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::kit::{
    Backoff, Deadline, Engine, EngineInfo, Group, Growth, Mailbox, P2pHeader, Polled, SplitPlan,
    Taken,
};
use accel_api::{
    Buf, BufMut, Capabilities, DType, Device, DeviceKind, Element, Error, HostBufMut, ReduceOp,
    Result, Store,
};

use crate::error::{HcclError, HCCL_E_TIMEOUT};
use crate::ffi::{self, dtype, Call, Comm, DevMem, DevPtr, NpuBuffer, Runtime, Stream};
use crate::name::NAME;

/// The communicator of the `npu-hccl` backend.
pub type NpuCommunicator = Group<NpuEngine>;

/// Bytes of the header that precedes every point-to-point payload (the
/// kit's [`P2pHeader`]: payload length, dtype code, tag).
const HEADER: usize = P2pHeader::BYTES;

/// The pause between two looks at a stream: 20 us, doubling up to 1 ms.
const PAUSE: Backoff =
    Backoff::sleep(Duration::from_micros(20)).grow(Growth::Mul(2), Duration::from_millis(1));

/// What the engine declares: every operation; data movement for all eight
/// element types (moved as bytes, exact); reductions for the types HCCL
/// reduces on every Ascend generation (f16, bf16, f32, i8, i32) with sum,
/// prod, min, max and avg (sum, then divide: on the host for host buffers,
/// through a host round trip for device buffers); host memory (staged) and
/// NPU memory.
pub fn capabilities() -> Capabilities {
    Capabilities::all_host()
        .with_reduce_dtypes([DType::F16, DType::BF16, DType::F32, DType::I8, DType::I32])
        .with_device_kinds([DeviceKind::Cpu, DeviceKind::Npu])
}

fn reduce_dtype(d: DType) -> std::result::Result<i32, HcclError> {
    Ok(match d {
        DType::F16 => dtype::FP16,
        DType::BF16 => dtype::BFP16,
        DType::F32 => dtype::FP32,
        DType::I8 => dtype::INT8,
        DType::I32 => dtype::INT32,
        other => {
            return Err(HcclError::Internal {
                detail: format!("a {other} reduction passed the capability check"),
            })
        }
    })
}

fn reduce_code(op: ReduceOp) -> std::result::Result<i32, HcclError> {
    Ok(match op {
        ReduceOp::Sum => 0,
        ReduceOp::Prod => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        other => {
            return Err(HcclError::Internal {
                detail: format!("reduction {other} reached the engine (HCCL has no {other})"),
            })
        }
    })
}

/// `(HCCL_CONNECT_TIMEOUT, HCCL_EXEC_TIMEOUT)` in seconds for an accel
/// timeout: at least the accel timeout, within HCCL's ranges ([120, 7200]
/// and [68, 17340] in multiples of 68), so that accel's own bound fires
/// first with its clearer message.
pub fn hccl_timeouts(timeout: Duration) -> (u64, u64) {
    let s = timeout.as_secs_f64().ceil() as u64;
    (s.clamp(120, 7200), (s.div_ceil(68) * 68).clamp(68, 17340))
}

/// Set `HCCL_CONNECT_TIMEOUT` and `HCCL_EXEC_TIMEOUT` from the timeout of
/// the first communicator of the process, unless the user set them.
pub(crate) fn apply_hccl_env(timeout: Duration) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let (connect, exec) = hccl_timeouts(timeout);
        for (var, value) in [
            ("HCCL_CONNECT_TIMEOUT", connect),
            ("HCCL_EXEC_TIMEOUT", exec),
        ] {
            if std::env::var_os(var).is_none() {
                tracing::debug!(var, value, "npu-hccl: deriving from the accel timeout");
                // Before any HCCL communicator exists, so HCCL reads it at
                // its first initialisation.
                std::env::set_var(var, value.to_string());
            }
        }
    });
}

/// What [`NpuEngine::connect`] needs.
pub(crate) struct Params {
    pub(crate) rt: Arc<Runtime>,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) prefix: String,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) device: Device,
    pub(crate) timeout: Duration,
}

/// HCCL on one NPU: one communicator, one stream.
pub struct NpuEngine {
    rt: Arc<Runtime>,
    comm: Comm,
    stream: Stream,
    info: EngineInfo,
    dev_id: i32,
    store: Arc<dyn Store>,
    prefix: String,
    splits: AtomicU64,
    /// Messages that arrived before their receive (another tag first), and
    /// sends of device memory to self, as host bytes.
    mail: Mailbox<Vec<u8>>,
    /// Raised after a failure that may leave work on the device: staging
    /// memory, the stream and the communicator are then leaked, not freed.
    broken: Arc<AtomicBool>,
}

impl fmt::Debug for NpuEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NpuEngine")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Drop for NpuEngine {
    /// Bind the dropping thread to the NPU first: destroying the stream and
    /// the communicator needs the device context (the fields drop next).
    fn drop(&mut self) {
        if let Err(e) = self.rt.bind(self.dev_id) {
            tracing::warn!(%e, "npu-hccl: cannot bind the device to release the communicator");
        }
    }
}

/// A device region for one call: the caller's view, or a staging copy of
/// a host buffer that is copied back by [`Staged::finish`].
struct Staged<'a> {
    ptr: DevPtr,
    mem: Option<DevMem>,
    host: Option<HostBufMut<'a>>,
}

impl Staged<'_> {
    fn finish(self, rt: &Runtime) -> std::result::Result<(), HcclError> {
        if let (Some(mem), Some(mut h)) = (self.mem, self.host) {
            rt.d2h(h.bytes_mut(), mem.ptr())?;
        }
        Ok(())
    }
}

fn header(bytes: usize, dtype: DType, tag: u32) -> [u8; HEADER] {
    P2pHeader {
        bytes: bytes as u64,
        dtype: dtype.code(),
        tag,
    }
    .encode()
}

fn parse_header(
    h: &[u8; HEADER],
    src: usize,
) -> std::result::Result<(usize, DType, u32), HcclError> {
    let h = P2pHeader::decode(h);
    match (h.byte_len(), h.element_type()) {
        (Some(len), Some(d)) if len.is_multiple_of(d.size()) => Ok((len, d, h.tag)),
        _ => Err(HcclError::Corrupt {
            detail: format!("rank {src} sent a message header that no accel npu-hccl rank writes"),
        }),
    }
}

impl NpuEngine {
    /// Bootstrap a communicator of `world` ranks under `prefix` of the
    /// store: rank 0 publishes HCCL's root info, every rank initialises.
    pub(crate) fn connect(p: Params) -> Result<NpuEngine> {
        let dev_id = i32::try_from(p.device.index).map_err(|_| HcclError::Config {
            detail: format!("device index {} is out of range", p.device.index),
            fix: "check the device binding".into(),
        })?;
        let deadline = Instant::now() + p.timeout;
        p.rt.bind(dev_id)?;
        let key = format!("{}/root", p.prefix);
        let root = if p.rank == 0 {
            let info = ffi::root_info(&p.rt)?;
            p.store.set(&key, &info)?;
            info
        } else {
            p.store.get(&key, p.timeout).map_err(|e| {
                let msg = format!(
                    "waiting for rank 0's HCCL root info (`{key}` on {}): {}",
                    p.store.describe(),
                    e.message()
                );
                Error::new(e.kind().clone(), msg)
                    .with_fix("check that rank 0 started and reached connect")
            })?
        };
        let comm = init_bounded(
            &p.rt, dev_id, p.world, p.rank, root, deadline, &p.prefix, p.timeout,
        )?;
        let stream = Stream::new(&p.rt)?;
        Ok(NpuEngine {
            rt: p.rt,
            comm,
            stream,
            info: EngineInfo {
                backend: NAME.to_string(),
                rank: p.rank,
                world_size: p.world,
                device: p.device,
                timeout: p.timeout,
                capabilities: capabilities(),
            },
            dev_id,
            store: p.store,
            prefix: p.prefix,
            splits: AtomicU64::new(0),
            mail: Mailbox::new(p.rank),
            broken: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The store prefix this communicator bootstrapped under.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `len` elements of `dtype` on this engine's NPU (uninitialised
    /// content).
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::Backend`] when `aclrtMalloc` fails.
    pub fn alloc(&self, dtype: DType, len: usize) -> Result<NpuBuffer> {
        self.rt.bind(self.dev_id)?;
        let mem = DevMem::alloc(
            &self.rt,
            len * dtype.size(),
            &Arc::new(AtomicBool::new(false)),
        )?;
        Ok(NpuBuffer::new(mem, len, dtype, self.info.device)?)
    }

    /// A device copy of `data` on this engine's NPU.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc), or when the copy fails.
    pub fn upload<T: Element>(&self, data: &[T]) -> Result<NpuBuffer> {
        let buf = self.alloc(T::DTYPE, data.len())?;
        self.rt.h2d(buf.region(), bytemuck::cast_slice(data))?;
        Ok(buf)
    }

    /// The content of `buf` on the host.
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::InvalidArgument`] when `T` is not the
    /// buffer's element type; a backend error when the copy fails.
    pub fn download<T: Element>(&self, buf: &NpuBuffer) -> Result<Vec<T>> {
        if T::DTYPE != buf.dtype() {
            return Err(HcclError::Mismatch {
                detail: format!("the buffer holds {}, not {}", buf.dtype(), T::DTYPE),
            }
            .into());
        }
        self.rt.bind(self.dev_id)?;
        let mut out = vec![<T as bytemuck::Zeroable>::zeroed(); buf.len()];
        self.rt
            .d2h(bytemuck::cast_slice_mut(&mut out), buf.region())?;
        Ok(out)
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.info.timeout
    }

    /// Bind this thread to the engine's NPU (staging allocations and HCCL
    /// calls need it) and start the call's deadline.
    fn start(&self) -> std::result::Result<Instant, HcclError> {
        self.rt.bind(self.dev_id)?;
        Ok(self.deadline())
    }

    /// Stop freeing what the device may still use.
    fn break_down(&self) {
        self.broken.store(true, Ordering::SeqCst);
        self.comm.leak_on_drop();
        self.stream.leak_on_drop();
    }

    fn scratch(&self, bytes: usize) -> std::result::Result<DevMem, HcclError> {
        DevMem::alloc(&self.rt, bytes, &self.broken)
    }

    /// Wait until the stream `raw` of a caller's view has no pending work.
    fn ready(&self, raw: u64, deadline: Instant) -> std::result::Result<(), HcclError> {
        if raw == 0 {
            return Ok(());
        }
        let done = Deadline::until(deadline, self.info.timeout)
            .poll(&PAUSE, || Ok(self.rt.stream_done(raw)?.then_some(())));
        match done {
            Ok(()) => Ok(()),
            Err(Polled::Failed(e)) => Err(e),
            Err(Polled::TimedOut) => Err(HcclError::Timeout {
                what: "the stream of a device buffer still has pending work".into(),
                after: self.info.timeout,
            }),
        }
    }

    fn input(
        &self,
        b: &Buf<'_>,
        deadline: Instant,
    ) -> std::result::Result<Staged<'static>, HcclError> {
        match b {
            Buf::Host(h) => {
                let mem = self.scratch(h.bytes().len())?;
                self.rt.h2d(mem.ptr(), h.bytes())?;
                Ok(Staged {
                    ptr: mem.ptr(),
                    mem: Some(mem),
                    host: None,
                })
            }
            Buf::Device(d) => {
                self.ready(d.stream(), deadline)?;
                Ok(Staged {
                    ptr: DevPtr::of(d),
                    mem: None,
                    host: None,
                })
            }
        }
    }

    fn output<'a>(
        &self,
        b: BufMut<'a>,
        copy_in: bool,
        deadline: Instant,
    ) -> std::result::Result<Staged<'a>, HcclError> {
        match b {
            BufMut::Host(h) => {
                let mem = self.scratch(h.bytes().len())?;
                if copy_in {
                    self.rt.h2d(mem.ptr(), h.bytes())?;
                }
                Ok(Staged {
                    ptr: mem.ptr(),
                    mem: Some(mem),
                    host: Some(h),
                })
            }
            BufMut::Device(d) => {
                self.ready(d.stream(), deadline)?;
                Ok(Staged {
                    ptr: DevPtr::of_mut(&d),
                    mem: None,
                    host: None,
                })
            }
        }
    }

    /// Enqueue `calls` in order, then wait for the stream until
    /// `deadline`, watching HCCL's asynchronous error (named after the
    /// first call).
    fn go(&self, deadline: Instant, calls: &[Call]) -> std::result::Result<(), HcclError> {
        let call = calls.first().map_or("HCCL", Call::name);
        self.rt.bind(self.dev_id)?;
        for c in calls {
            self.comm.enqueue(*c, &self.stream)?;
        }
        let done = Deadline::until(deadline, self.info.timeout).poll(&PAUSE, || {
            let code = self.comm.async_error()?;
            if code != 0 {
                self.break_down();
                return Err(if code == HCCL_E_TIMEOUT {
                    HcclError::Timeout {
                        what: format!(
                            "{call}: HCCL reported HCCL_E_TIMEOUT (a peer did not take part in time)"
                        ),
                        after: self.info.timeout,
                    }
                } else {
                    HcclError::hccl(call, code, self.rt.hccl_text(code))
                });
            }
            Ok(self.stream.is_done()?.then_some(()))
        });
        match done {
            Ok(()) => Ok(()),
            Err(Polled::Failed(e)) => Err(e),
            Err(Polled::TimedOut) => {
                self.break_down();
                Err(HcclError::Timeout {
                    what: format!(
                        "{call} did not complete: its stream is still busy (a rank did not make the same call, or a peer is stuck)"
                    ),
                    after: self.info.timeout,
                })
            }
        }
    }

    /// Write the bytes of a message that fits `buf` into it.
    fn deliver(
        &self,
        bytes: &[u8],
        buf: BufMut<'_>,
        deadline: Instant,
    ) -> std::result::Result<(), HcclError> {
        match buf {
            BufMut::Host(mut h) => {
                h.bytes_mut().copy_from_slice(bytes);
                Ok(())
            }
            BufMut::Device(d) => {
                self.ready(d.stream(), deadline)?;
                self.rt.bind(self.dev_id)?;
                self.rt.h2d(DevPtr::of_mut(&d), bytes)
            }
        }
    }

    /// Stage `buf` (copied in when `copy_in`), run the call `make` builds
    /// on its region in place, and copy the result back.
    fn in_place(
        &self,
        buf: BufMut<'_>,
        copy_in: bool,
        make: impl FnOnce(DevPtr) -> Call,
    ) -> std::result::Result<(), HcclError> {
        let dl = self.start()?;
        let out = self.output(buf, copy_in, dl)?;
        self.go(dl, &[make(out.ptr)])?;
        out.finish(&self.rt)
    }

    /// Stage `send` in and `recv` out, run the call `make` builds on the
    /// two regions, and copy the result back.
    fn in_out(
        &self,
        send: &Buf<'_>,
        recv: BufMut<'_>,
        make: impl FnOnce(DevPtr, DevPtr) -> Call,
    ) -> std::result::Result<(), HcclError> {
        let dl = self.start()?;
        let inp = self.input(send, dl)?;
        let out = self.output(recv, false, dl)?;
        self.go(dl, &[make(inp.ptr, out.ptr)])?;
        out.finish(&self.rt)
    }

    fn recv_inner(
        &self,
        buf: BufMut<'_>,
        src: usize,
        tag: u32,
    ) -> std::result::Result<(), HcclError> {
        let deadline = self.deadline();
        match self.mail.take(src, tag, buf.dtype(), buf.len()) {
            Taken::Fits(bytes) => return self.deliver(&bytes, buf, deadline),
            Taken::Misfit(detail) => return Err(HcclError::Mismatch { detail }),
            Taken::Empty => {}
        }
        if src == self.info.rank {
            return Err(HcclError::NoSelfMessage { tag });
        }
        let peer = src as u32;
        loop {
            let hmem = self.scratch(HEADER)?;
            self.go(deadline, &[recv_bytes(hmem.ptr(), HEADER, peer)])?;
            let mut h = [0u8; HEADER];
            self.rt.d2h(&mut h, hmem.ptr())?;
            let (len, dt, got_tag) = parse_header(&h, src)?;
            let fits = got_tag == tag && dt == buf.dtype() && len == buf.len() * dt.size();
            if fits {
                let out = self.output(buf, false, deadline)?;
                if len > 0 {
                    self.go(deadline, &[recv_bytes(out.ptr, len, peer)])?;
                }
                return out.finish(&self.rt);
            }
            // Take the payload off the wire, then keep it for its own
            // receive (another tag) or drop it (this tag, wrong shape).
            let pmem = self.scratch(len)?;
            if len > 0 {
                self.go(deadline, &[recv_bytes(pmem.ptr(), len, peer)])?;
            }
            let mut bytes = vec![0u8; len];
            self.rt.d2h(&mut bytes, pmem.ptr())?;
            if got_tag == tag {
                let detail = self
                    .mail
                    .misfit(src, tag, (dt, len), buf.dtype(), buf.len());
                return Err(HcclError::Mismatch { detail });
            }
            self.mail.post(src, got_tag, dt, len, bytes);
        }
    }

    fn split_inner(&self, color: Option<u32>, key: u32) -> Result<Option<NpuEngine>> {
        let k = self.splits.fetch_add(1, Ordering::SeqCst);
        let base = format!("{}/split{k}", self.prefix);
        let deadline = self.deadline();
        let mine = format!("{},{key}", color.map_or(-1, i64::from));
        self.store
            .set(&format!("{base}/ck/{}", self.info.rank), mine.as_bytes())?;
        let mut all = Vec::with_capacity(2 * self.info.world_size);
        for r in 0..self.info.world_size {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .store
                .get(&format!("{base}/ck/{r}"), left)
                .map_err(|e| {
                    let msg = format!("waiting for rank {r}'s split color: {}", e.message());
                    Error::new(e.kind().clone(), msg)
                        .with_fix("every rank of the group must call split")
                })?;
            let text = String::from_utf8_lossy(&v).into_owned();
            let parsed = text
                .split_once(',')
                .and_then(|(c, k)| Some((c.parse::<i64>().ok()?, k.parse::<i64>().ok()?)));
            let Some((c, kk)) = parsed else {
                return Err(HcclError::Corrupt {
                    detail: format!("rank {r}'s split entry `{text}` is not `color,key`"),
                }
                .into());
            };
            all.extend([c, kk]);
        }
        let plan = SplitPlan::from_exchanged(self.info.rank, color, &all)?;
        let Some(c) = plan.color else {
            return Ok(None);
        };
        let left = deadline.saturating_duration_since(Instant::now());
        NpuEngine::connect(Params {
            rt: self.rt.clone(),
            store: self.store.clone(),
            prefix: format!("{base}/color{c}"),
            rank: plan.new_rank,
            world: plan.members.len(),
            device: self.info.device,
            timeout: left.max(Duration::from_millis(1)),
        })
        .map(|mut e| {
            // Sub-groups inherit the parent's bound for their calls.
            e.info.timeout = self.info.timeout;
            Some(e)
        })
    }
}

/// `HcclCommInitRootInfo` on a helper thread, so that the wait for the
/// other ranks ends at `deadline` even when HCCL_CONNECT_TIMEOUT is longer
/// (its minimum is 120 s). A late success is destroyed by the helper.
#[allow(clippy::too_many_arguments)]
fn init_bounded(
    rt: &Arc<Runtime>,
    dev_id: i32,
    world: usize,
    rank: usize,
    root: Vec<u8>,
    deadline: Instant,
    prefix: &str,
    timeout: Duration,
) -> Result<Comm> {
    let (tx, rx) = mpsc::channel();
    let helper_rt = rt.clone();
    let spawned = std::thread::Builder::new()
        .name("accel-hccl-init".into())
        .spawn(move || {
            let r = helper_rt
                .bind(dev_id)
                .and_then(|()| Comm::init(&helper_rt, world as u32, &root, rank as u32));
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return Err(Error::io("starting the HCCL init thread", e));
    }
    match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        Ok(r) => Ok(r?),
        Err(_) => Err(HcclError::Timeout {
            what: format!(
                "HcclCommInitRootInfo did not return: not all {world} ranks joined the communicator under `{prefix}`"
            ),
            after: timeout,
        }
        .into()),
    }
}

/// `HcclRecv` of `len` bytes from `peer` into `p`.
fn recv_bytes(p: DevPtr, len: usize, peer: u32) -> Call {
    Call::Recv(p, len as u64, dtype::INT8, peer)
}

fn chunk(bytes: usize, n: usize) -> usize {
    bytes / n.max(1)
}

impl Engine for NpuEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (dt, rop) = (reduce_dtype(buf.dtype())?, reduce_code(op)?);
        let n = buf.len() as u64;
        Ok(self.in_place(buf, true, |p| Call::AllReduce(p, n, dt, rop))?)
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        let (dt, rop) = (reduce_dtype(buf.dtype())?, reduce_code(op)?);
        let n = buf.len() as u64;
        Ok(self.in_place(buf, true, |p| Call::Reduce(p, n, dt, rop, root as u32))?)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        Ok(self.in_place(buf, root == self.info.rank, |p| {
            Call::Broadcast(p, p.bytes() as u64, dtype::INT8, root as u32)
        })?)
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        Ok(self.in_out(&send, recv, |i, o| {
            Call::AllGather(i, o, i.bytes() as u64, dtype::INT8)
        })?)
    }

    /// HCCL has no gather: an all-gather into scratch memory, of which the
    /// root keeps the result.
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, _root: usize) -> Result<()> {
        let dl = self.start()?;
        let inp = self.input(&send, dl)?;
        let bytes = inp.ptr.bytes();
        let all = self.scratch(bytes * self.info.world_size)?;
        let gathered = Call::AllGather(inp.ptr, all.ptr(), bytes as u64, dtype::INT8);
        self.go(dl, &[gathered])?;
        match recv {
            None => Ok(()),
            Some(BufMut::Host(mut h)) => Ok(self.rt.d2h(h.bytes_mut(), all.ptr())?),
            Some(BufMut::Device(d)) => {
                self.ready(d.stream(), dl)?;
                Ok(self
                    .rt
                    .d2d(DevPtr::of_mut(&d), all.ptr(), bytes * self.info.world_size)?)
            }
        }
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let dl = self.start()?;
        let inp = match &send {
            Some(b) => Some(self.input(b, dl)?),
            None => None,
        };
        let out = self.output(recv, false, dl)?;
        let bytes = out.ptr.bytes() as u64;
        let src = inp.as_ref().map(|i| i.ptr);
        self.go(
            dl,
            &[Call::Scatter(src, out.ptr, bytes, dtype::INT8, root as u32)],
        )?;
        Ok(out.finish(&self.rt)?)
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (dt, rop) = (reduce_dtype(send.dtype())?, reduce_code(op)?);
        let n = recv.len() as u64;
        Ok(self.in_out(&send, recv, |i, o| Call::ReduceScatter(i, o, n, dt, rop))?)
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let world = self.info.world_size;
        Ok(self.in_out(&send, recv, |i, o| {
            Call::AllToAll(i, o, chunk(i.bytes(), world) as u64, dtype::INT8)
        })?)
    }

    /// A 16-byte header (length, dtype, tag), then the payload, so that the
    /// receiver can check both (HCCL has neither tags nor message sizes).
    /// Device memory sent to self is kept for the matching receive.
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let dl = self.start()?;
        if dst == self.info.rank {
            let inp = self.input(&buf, dl)?;
            let mut bytes = vec![0u8; inp.ptr.bytes()];
            self.rt.d2h(&mut bytes, inp.ptr)?;
            self.mail.post(dst, tag, buf.dtype(), bytes.len(), bytes);
            return Ok(());
        }
        let inp = self.input(&buf, dl)?;
        let len = inp.ptr.bytes();
        let hmem = self.scratch(HEADER)?;
        self.rt.h2d(hmem.ptr(), &header(len, buf.dtype(), tag))?;
        let peer = dst as u32;
        let calls = [
            Call::Send(hmem.ptr(), HEADER as u64, dtype::INT8, peer),
            Call::Send(inp.ptr, len as u64, dtype::INT8, peer),
        ];
        // An empty payload is not sent.
        Ok(self.go(dl, &calls[..if len > 0 { 2 } else { 1 }])?)
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.rt.bind(self.dev_id)?;
        Ok(self.recv_inner(buf, src, tag)?)
    }

    fn barrier(&self) -> Result<()> {
        let dl = self.start()?;
        Ok(self.go(dl, &[Call::Barrier])?)
    }

    /// `(color, key)` exchanged through the store, then a new HCCL
    /// communicator per color from its first member's root info.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        self.split_inner(color, key)
    }

    fn on_fatal(&self, err: &Error) {
        tracing::warn!(%err, "npu-hccl: communicator failed; its device resources are left to the process exit");
        self.break_down();
    }

    /// Copy to the host, divide there exactly as host buffers are divided
    /// ([`HostBufMut::divide_by`]), copy back: slow, but the same answer as
    /// every other backend.
    fn divide_device(&self, buf: accel_api::DeviceBufMut<'_>, n: usize) -> Result<()> {
        let dl = self.start()?;
        self.ready(buf.stream(), dl)?;
        let bytes = buf.size_bytes();
        let mut words = vec![0u64; bytes.div_ceil(8)];
        let host = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes];
        let dev = DevPtr::of_mut(&buf);
        self.rt.d2h(host, dev)?;
        HostBufMut::from_bytes(buf.dtype(), host)?.divide_by(n);
        self.rt.h2d(dev, host)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_stay_in_hccl_ranges_and_above_accel() {
        assert_eq!(hccl_timeouts(Duration::from_secs(300)), (300, 340));
        assert_eq!(hccl_timeouts(Duration::from_millis(500)), (120, 68));
        assert_eq!(hccl_timeouts(Duration::from_secs(100_000)), (7200, 17340));
        let (_, exec) = hccl_timeouts(Duration::from_secs(69));
        assert_eq!(exec % 68, 0);
        assert!(exec >= 69);
    }

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        let h = header(12, DType::F32, 7);
        assert_eq!(parse_header(&h, 1).unwrap(), (12, DType::F32, 7));
        let mut bad = h;
        bad[8] = 99;
        assert!(parse_header(&bad, 1).is_err());
        let ragged = header(6, DType::F32, 0);
        let e = parse_header(&ragged, 3).unwrap_err();
        assert!(e.to_string().contains("rank 3"), "{e}");
    }

    #[test]
    fn reductions_map_to_hccl_codes() {
        assert_eq!(reduce_code(ReduceOp::Min).unwrap(), 3);
        assert!(reduce_code(ReduceOp::Avg).is_err());
        assert_eq!(reduce_dtype(DType::BF16).unwrap(), dtype::BFP16);
        assert!(reduce_dtype(DType::F64).is_err());
        let caps = capabilities();
        for d in &caps.reduce_dtypes {
            assert!(reduce_dtype(*d).is_ok(), "{d}");
        }
        // What an HCCL element type weighs, for the wrappers' size checks.
        for (d, code) in [
            (DType::F16, dtype::FP16),
            (DType::BF16, dtype::BFP16),
            (DType::F32, dtype::FP32),
            (DType::F64, dtype::FP64),
            (DType::I8, dtype::INT8),
            (DType::U8, dtype::UINT8),
            (DType::I32, dtype::INT32),
            (DType::I64, dtype::INT64),
        ] {
            assert_eq!(ffi::dtype_size(code), d.size(), "{d}");
        }
    }
}
