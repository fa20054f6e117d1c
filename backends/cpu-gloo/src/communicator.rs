//! [`GlooCommunicator`]: accel's [`Communicator`] on a Gloo context.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use accel_api::{
    validate, Buf, BufMut, Capabilities, Communicator, DType, Device, Error, ErrorKind, HostBuf,
    HostBufMut, Op, ReduceOp, Result, Store,
};

use crate::error::{classify, to_api, Caught, Class, GlooError};
use crate::ffi::{self, DTypeCode, OpCode};
use crate::rendezvous::StoreAdapter;
use crate::NAME;

/// Element types Gloo reduces (it has no bfloat16).
pub(crate) const REDUCE_DTYPES: [DType; 7] = [
    DType::F16,
    DType::F32,
    DType::F64,
    DType::I8,
    DType::U8,
    DType::I32,
    DType::I64,
];

/// What every cpu-gloo communicator declares: every operation and element
/// type on host memory; reductions on everything but bf16.
pub fn capabilities() -> Capabilities {
    Capabilities::all_host().with_reduce_dtypes(REDUCE_DTYPES)
}

/// Marks the header of a point-to-point message ("acc1").
const P2P_MAGIC: u32 = 0x6163_6331;
const P2P_HEADER: usize = 16;

/// The Gloo context and the tag of the next collective, behind one lock.
struct Engine {
    ctx: ffi::Context,
    next_tag: u32,
}

/// A message sent to self, waiting for its `recv`.
type Mail = (DType, Vec<u8>);

/// accel's [`Communicator`] over one Gloo context (TCP full mesh).
///
/// Every Gloo call runs under one mutex (Gloo contexts take one operation
/// at a time); sends to self go through an in-process mailbox because Gloo
/// has no connection to self.
pub struct GlooCommunicator {
    rank: usize,
    world: usize,
    device: Device,
    timeout: Duration,
    caps: Capabilities,
    gloo_device: Arc<ffi::Device>,
    engine: Mutex<Engine>,
    store: Arc<dyn Store>,
    prefix: String,
    poisoned: Mutex<Option<String>>,
    mailbox: Mutex<HashMap<u32, VecDeque<Mail>>>,
    mail: Condvar,
    splits: AtomicU64,
}

impl fmt::Debug for GlooCommunicator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GlooCommunicator")
            .field("rank", &self.rank)
            .field("world_size", &self.world)
            .field("timeout", &self.timeout)
            .field("prefix", &self.prefix)
            .field("store", &self.store.describe())
            .field("device", &self.gloo_device.describe())
            .finish_non_exhaustive()
    }
}

/// Everything needed to build one communicator.
pub(crate) struct Params {
    pub(crate) gloo_device: Arc<ffi::Device>,
    pub(crate) store: Arc<dyn Store>,
    /// Store key prefix, unique to this communicator.
    pub(crate) prefix: String,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) device: Device,
    pub(crate) timeout: Duration,
}

fn addr_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/addr/{rank}")
}

fn err_at(kind: ErrorKind, rank: usize, op: Op, message: impl Into<String>) -> Error {
    Error::new(kind, message)
        .with_op(op.name())
        .with_backend(NAME)
        .with_rank(rank)
}

/// `n` elements' worth of 8-byte aligned scratch memory, as bytes.
fn scratch(bytes: usize) -> Vec<i64> {
    vec![0i64; bytes.div_ceil(8)]
}

/// How long a rank that lost a peer waits for that peer's published root
/// cause before reporting the loss as it saw it.
const FAULT_NOTE_GRACE: Duration = Duration::from_millis(500);

fn scratch_bytes(v: &mut [i64], bytes: usize) -> &mut [u8] {
    &mut HostBufMut::from(v).into_bytes()[..bytes]
}

fn native(op: ReduceOp) -> OpCode {
    // Avg is a sum followed by a division on the host.
    let op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    OpCode(op.code() as i32)
}

fn dtype_code(d: DType) -> DTypeCode {
    DTypeCode(d.code() as i32)
}

impl GlooCommunicator {
    /// Rendezvous under `p.prefix` and connect to every rank.
    pub(crate) fn connect(p: Params) -> Result<GlooCommunicator> {
        let adapter = StoreAdapter::new(&*p.store, &p.prefix, p.rank, p.timeout);
        let ctx = match ffi::Context::connect(&p.gloo_device, p.rank, p.world, p.timeout, &adapter)
        {
            Ok(ctx) => ctx,
            Err(e) => {
                let stored = adapter.take_error();
                return Err(match (e.caught, stored) {
                    (_, Some(store_err)) => store_err,
                    (_, None) => {
                        let class = classify(&e, &|_| None);
                        let class = match class {
                            Class::InvalidArgument => Class::Backend,
                            c => c,
                        };
                        to_api(e, &class, p.rank, "connect", p.timeout).with_fix(format!(
                            "check that every rank can reach this one's address ({}); set ACCEL_GLOO_HOSTNAME or GLOO_SOCKET_IFNAME to choose it",
                            p.gloo_device.describe()
                        ))
                    }
                });
            }
        };
        // Publish the names each peer's Gloo may print for its connection
        // to this rank: a peer whose Gloo reports "connection closed by peer
        // <address>" finds the rank here.
        let table: String = (0..p.world)
            .filter(|&r| r != p.rank)
            .map(|r| {
                let [local, advertised] = ctx.self_names(r);
                format!("{r} {local} {advertised}\n")
            })
            .collect();
        p.store
            .set(&addr_key(&p.prefix, p.rank), table.as_bytes())
            .map_err(|e| e.with_op("connect").with_backend(NAME).with_rank(p.rank))?;
        Ok(GlooCommunicator {
            rank: p.rank,
            world: p.world,
            device: p.device,
            timeout: p.timeout,
            caps: capabilities(),
            gloo_device: p.gloo_device,
            engine: Mutex::new(Engine { ctx, next_tag: 0 }),
            store: p.store,
            prefix: p.prefix,
            poisoned: Mutex::new(None),
            mailbox: Mutex::new(HashMap::new()),
            mail: Condvar::new(),
            splits: AtomicU64::new(0),
        })
    }

    /// The store key prefix this communicator rendezvoused under.
    pub fn store_prefix(&self) -> &str {
        &self.prefix
    }

    /// The names Gloo may print in this rank's error messages for the
    /// connection to `rank` (`[127.0.0.1]:4660`), as `rank` published them
    /// at connect time: what lost-peer errors are matched against. Empty
    /// for this rank itself or when the store does not have them.
    pub fn peer_addresses(&self, rank: usize) -> Vec<String> {
        if rank == self.rank || rank >= self.world {
            return Vec::new();
        }
        let Ok(Some(table)) = self.store.try_get(&addr_key(&self.prefix, rank)) else {
            return Vec::new();
        };
        let table = String::from_utf8_lossy(&table).into_owned();
        table
            .lines()
            .find_map(|line| {
                let mut words = line.split_whitespace();
                let r: usize = words.next()?.parse().ok()?;
                (r == self.rank).then(|| words.map(str::to_string).collect())
            })
            .unwrap_or_default()
    }

    /// The rank at the other end of the connection Gloo printed as `addr`.
    fn rank_of_address(&self, addr: &str) -> Option<usize> {
        (0..self.world).find(|&r| self.peer_addresses(r).iter().any(|a| a == addr))
    }

    fn poison_text(&self) -> Option<String> {
        self.poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn poisoned_error(&self, op: Op, why: String) -> Error {
        err_at(ErrorKind::Poisoned, self.rank, op, why).with_fix(
            "this group is unusable after that failure: shut down and restart the run (the launcher can restart it)",
        )
    }

    fn enter(&self, op: Op, dtype: DType, reduce: Option<ReduceOp>, device: Device) -> Result<()> {
        if let Some(why) = self.poison_text() {
            return Err(self.poisoned_error(op, why));
        }
        validate::call(self, op, dtype, reduce, device)
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

    fn lock_engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `f` on the Gloo context under the lock; classify its failure and
    /// poison the communicator when the failure is fatal for the group.
    fn engine_call<T>(
        &self,
        op: Op,
        f: impl FnOnce(&mut Engine) -> std::result::Result<T, GlooError>,
    ) -> Result<T> {
        let mut engine = self.lock_engine();
        // Another thread may have failed (or aborted) while we waited.
        if let Some(why) = self.poison_text() {
            return Err(self.poisoned_error(op, why));
        }
        match f(&mut engine) {
            Ok(v) => Ok(v),
            Err(e) => {
                let class = classify(&e, &|a| self.rank_of_address(a));
                let err = self.attribute(
                    to_api(e, &class, self.rank, op.name(), self.timeout),
                    &class,
                );
                if err.is_fatal_for_group() {
                    self.fail(&mut engine, &err);
                }
                Err(err)
            }
        }
    }

    /// A peer that closed its connections because it had failed itself
    /// published why: name the rank it lost, the root cause.
    fn attribute(&self, err: Error, class: &Class) -> Error {
        let Class::PeerLost(Some(p)) = class else {
            return err;
        };
        // Gloo may close the pair on its own timeout a moment before the
        // peer publishes why: give the note a short grace period. A peer
        // that died publishes nothing and costs this wait once.
        let grace = self.timeout.min(FAULT_NOTE_GRACE);
        let Ok(note) = self.store.get(&self.fault_key(*p), grace) else {
            return err;
        };
        let note = String::from_utf8_lossy(&note).into_owned();
        let (lost, why) = note.split_once('\n').unwrap_or((note.as_str(), ""));
        let lost: Option<usize> = lost.strip_prefix("lost=").and_then(|v| v.parse().ok());
        let message = format!("rank {p} gave up first: {why}");
        let op = err.op().unwrap_or("collective").to_string();
        match lost {
            Some(q) if q != self.rank && q != *p => Error::new(
                ErrorKind::PeerLost { peer: Some(q) },
                format!("{message} (it lost rank {q})"),
            )
            .with_fix(format!("look at rank {q}'s log for why it stopped")),
            _ => Error::new(ErrorKind::PeerLost { peer: Some(*p) }, message)
                .with_fix(format!("look at rank {p}'s log for the first failure")),
        }
        .with_op(op)
        .with_backend(NAME)
        .with_rank(self.rank)
        .with_boxed_source(Box::new(err))
    }

    fn fault_key(&self, rank: usize) -> String {
        format!("{}/fault/{rank}", self.prefix)
    }

    /// Poison with `err`, tell the others why (best effort, through the
    /// store), and close every connection so that they notice at once
    /// instead of waiting for their timeout. Gloo contexts are unusable
    /// after an I/O error anyway.
    fn fail(&self, engine: &mut Engine, err: &Error) {
        {
            let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
            if p.is_some() {
                return;
            }
            *p = Some(err.to_string());
        }
        let lost = match err.kind() {
            ErrorKind::PeerLost { peer: Some(q) } => q.to_string(),
            _ => "-".to_string(),
        };
        let _ = self.store.set(
            &self.fault_key(self.rank),
            format!("lost={lost}\n{err}").as_bytes(),
        );
        engine.ctx.close();
    }

    /// Poison after a failure that did not come from Gloo (a timeout on
    /// the self mailbox, a failed split).
    fn fail_outside(&self, err: &Error) {
        let mut engine = self.lock_engine();
        self.fail(&mut engine, err);
    }

    fn reduce_common(
        &self,
        op: Op,
        buf: BufMut<'_>,
        reduce: ReduceOp,
        root: Option<usize>,
    ) -> Result<()> {
        self.enter(op, buf.dtype(), Some(reduce), buf.device())?;
        if let Some(root) = root {
            validate::rank_in_group(self, op, "root", root)?;
        }
        let mut host = self.host_mut(op, buf)?;
        let count = host.len();
        if count == 0 {
            return Ok(());
        }
        let dtype = dtype_code(host.dtype());
        let timeout = self.timeout;
        self.engine_call(op, |e| {
            let tag = e.next_tag;
            e.next_tag = tag.wrapping_add(1);
            match root {
                None => {
                    e.ctx
                        .all_reduce(host.bytes_mut(), count, dtype, native(reduce), tag, timeout)
                }
                Some(r) => e.ctx.reduce(
                    host.bytes_mut(),
                    count,
                    dtype,
                    native(reduce),
                    r,
                    tag,
                    timeout,
                ),
            }
        })?;
        if reduce == ReduceOp::Avg && root.is_none_or(|r| r == self.rank) {
            host.divide_by(self.world);
        }
        Ok(())
    }

    /// Take the next collective tag.
    fn tag(e: &mut Engine) -> u32 {
        let t = e.next_tag;
        e.next_tag = t.wrapping_add(1);
        t
    }

    fn send_self(&self, dtype: DType, bytes: &[u8], tag: u32) {
        let mut mb = self.mailbox.lock().unwrap_or_else(|p| p.into_inner());
        mb.entry(tag)
            .or_default()
            .push_back((dtype, bytes.to_vec()));
        self.mail.notify_all();
    }

    fn recv_self(&self, dst: &mut HostBufMut<'_>, tag: u32) -> Result<()> {
        let deadline = Instant::now() + self.timeout;
        let mut mb = self.mailbox.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some((dtype, msg)) = mb.get_mut(&tag).and_then(VecDeque::pop_front) {
                if dtype != dst.dtype() || msg.len() != dst.bytes().len() {
                    return Err(err_at(
                        ErrorKind::InvalidArgument,
                        self.rank,
                        Op::Recv,
                        format!(
                            "the message to self with tag {tag} holds {} {dtype} elements, the receive buffer {} {} elements",
                            msg.len() / dtype.size(),
                            dst.len(),
                            dst.dtype()
                        ),
                    ));
                }
                dst.bytes_mut().copy_from_slice(&msg);
                return Ok(());
            }
            if let Some(why) = self.poison_text() {
                return Err(self.poisoned_error(Op::Recv, why));
            }
            let now = Instant::now();
            if now >= deadline {
                drop(mb);
                let err = Error::timeout(
                    "recv",
                    self.timeout,
                    format!("no message with tag {tag} was sent to self"),
                )
                .with_backend(NAME)
                .with_rank(self.rank)
                .with_fix("send to self before receiving from self");
                self.fail_outside(&err);
                return Err(err);
            }
            mb = self
                .mail
                .wait_timeout(mb, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

fn header(dtype: DType, nbytes: usize) -> [u8; P2P_HEADER] {
    let mut h = [0u8; P2P_HEADER];
    h[..8].copy_from_slice(&(nbytes as u64).to_le_bytes());
    h[8..12].copy_from_slice(&dtype.code().to_le_bytes());
    h[12..16].copy_from_slice(&P2P_MAGIC.to_le_bytes());
    h
}

fn parse_header(h: &[u8; P2P_HEADER]) -> std::result::Result<(Option<DType>, usize), GlooError> {
    let mut w8 = [0u8; 8];
    let mut w4 = [0u8; 4];
    w4.copy_from_slice(&h[12..16]);
    if u32::from_le_bytes(w4) != P2P_MAGIC {
        return Err(GlooError::new(
            Caught::Gloo,
            "point-to-point header is corrupt (the peer does not speak cpu-gloo's protocol)",
        ));
    }
    w8.copy_from_slice(&h[..8]);
    let nbytes = usize::try_from(u64::from_le_bytes(w8))
        .map_err(|_| GlooError::new(Caught::Gloo, "point-to-point message too large"))?;
    w4.copy_from_slice(&h[8..12]);
    Ok((DType::from_code(u32::from_le_bytes(w4)), nbytes))
}

/// Point-to-point slots: two per tag (header, payload), below Gloo's
/// collective slots (which use the top byte).
fn p2p_slots(tag: u32) -> (u64, u64) {
    let h = u64::from(tag) << 1;
    (h, h | 1)
}

fn remaining(start: Instant, timeout: Duration) -> Duration {
    timeout
        .saturating_sub(start.elapsed())
        .max(Duration::from_millis(1))
}

impl Communicator for GlooCommunicator {
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
        self.device
    }

    fn timeout(&self) -> Duration {
        self.timeout
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
        self.enter(Op::Broadcast, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, Op::Broadcast, "root", root)?;
        let mut host = self.host_mut(Op::Broadcast, buf)?;
        if host.is_empty() {
            return Ok(());
        }
        let timeout = self.timeout;
        self.engine_call(Op::Broadcast, |e| {
            let tag = Self::tag(e);
            e.ctx.broadcast(host.bytes_mut(), root, tag, timeout)
        })
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
        let (world, timeout) = (self.world, self.timeout);
        self.engine_call(op, |e| {
            let tag = Self::tag(e);
            e.ctx
                .all_gather(src.bytes(), dst.bytes_mut(), world, tag, timeout)
        })
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let op = Op::Gather;
        self.enter(op, send.dtype(), None, send.device())?;
        let recv = validate::gather(self, &send, recv, root)?;
        let src = self.host(op, send)?;
        let mut dst = recv.map(|r| self.host_mut(op, r)).transpose()?;
        if src.is_empty() {
            return Ok(());
        }
        let (world, timeout) = (self.world, self.timeout);
        self.engine_call(op, |e| {
            let tag = Self::tag(e);
            e.ctx.gather(
                src.bytes(),
                dst.as_mut().map(|d| d.bytes_mut()),
                world,
                root,
                tag,
                timeout,
            )
        })
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Scatter;
        self.enter(op, recv.dtype(), None, recv.device())?;
        let src = validate::scatter(self, send, &recv, root)?
            .map(|b| self.host(op, b))
            .transpose()?;
        let mut dst = self.host_mut(op, recv)?;
        if dst.is_empty() {
            return Ok(());
        }
        let (world, timeout) = (self.world, self.timeout);
        self.engine_call(op, |e| {
            let tag = Self::tag(e);
            e.ctx.scatter(
                src.as_ref().map(HostBuf::bytes),
                dst.bytes_mut(),
                world,
                root,
                tag,
                timeout,
            )
        })
    }

    /// Implemented as a Gloo all-reduce of the whole input into a scratch
    /// buffer, then a copy of this rank's chunk. Gloo's own reduce-scatter
    /// (`ReduceScatterHalvingDoubling`) is an old-style algorithm on bound
    /// buffers that reduces in place into its input, leaves the result at
    /// the start of the buffer and does not take the per-operation timeout;
    /// the all-reduce path is exact, honours the timeout and costs one
    /// extra all-gather's worth of traffic.
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
        let total = src.bytes().len();
        let mut tmp = scratch(total);
        let work = scratch_bytes(&mut tmp, total);
        work.copy_from_slice(src.bytes());
        let (count, dtype, timeout) = (src.len(), dtype_code(src.dtype()), self.timeout);
        self.engine_call(op, |e| {
            let tag = Self::tag(e);
            e.ctx
                .all_reduce(work, count, dtype, native(reduce), tag, timeout)
        })?;
        let chunk = dst.bytes().len();
        let start = self.rank * chunk;
        let work = scratch_bytes(&mut tmp, total);
        dst.bytes_mut().copy_from_slice(&work[start..start + chunk]);
        if reduce == ReduceOp::Avg {
            dst.divide_by(self.world);
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
        let timeout = self.timeout;
        self.engine_call(op, |e| {
            let tag = Self::tag(e);
            e.ctx.all_to_all(src.bytes(), dst.bytes_mut(), tag, timeout)
        })
    }

    /// Every message travels as a 16-byte header (length, dtype) followed
    /// by the payload, so that a receive of the wrong size is an error
    /// instead of a Gloo assertion on its event-loop thread (which aborts
    /// the process). Sends to self are buffered in a mailbox.
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let op = Op::Send;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "destination", dst)?;
        let src = self.host(op, buf)?;
        if dst == self.rank {
            self.send_self(src.dtype(), src.bytes(), tag);
            return Ok(());
        }
        let hdr = header(src.dtype(), src.bytes().len());
        let (slot_h, slot_p) = p2p_slots(tag);
        let timeout = self.timeout;
        self.engine_call(op, |e| {
            let start = Instant::now();
            e.ctx.send(&hdr, dst, slot_h, timeout)?;
            if !src.is_empty() {
                e.ctx
                    .send(src.bytes(), dst, slot_p, remaining(start, timeout))?;
            }
            Ok(())
        })
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let op = Op::Recv;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "source", src)?;
        let mut dst = self.host_mut(op, buf)?;
        if src == self.rank {
            return self.recv_self(&mut dst, tag);
        }
        let (slot_h, slot_p) = p2p_slots(tag);
        let timeout = self.timeout;
        let want = dst.dtype();
        let mismatch = self.engine_call(op, |e| {
            let start = Instant::now();
            let mut hdr = [0u8; P2P_HEADER];
            e.ctx.recv(&mut hdr, src, slot_h, timeout)?;
            let (dtype, nbytes) = parse_header(&hdr)?;
            if dtype == Some(want) && nbytes == dst.bytes().len() {
                if nbytes > 0 {
                    e.ctx
                        .recv(dst.bytes_mut(), src, slot_p, remaining(start, timeout))?;
                }
                return Ok(None);
            }
            // Drain the payload so that the connection stays in step.
            if nbytes > 0 {
                let mut sink = vec![0u8; nbytes];
                e.ctx
                    .recv(&mut sink, src, slot_p, remaining(start, timeout))?;
            }
            Ok(Some((dtype, nbytes)))
        })?;
        match mismatch {
            None => Ok(()),
            Some((dtype, nbytes)) => {
                let what = match dtype {
                    Some(d) => format!("{} {d} elements", nbytes / d.size()),
                    None => format!("{nbytes} bytes of an unknown element type"),
                };
                Err(err_at(
                    ErrorKind::InvalidArgument,
                    self.rank,
                    op,
                    format!(
                        "rank {src} sent {what} with tag {tag}, the receive buffer holds {} {} elements (the message was dropped)",
                        dst.len(),
                        dst.dtype()
                    ),
                ))
            }
        }
    }

    fn barrier(&self) -> Result<()> {
        self.enter(Op::Barrier, DType::U8, None, Device::CPU)?;
        let timeout = self.timeout;
        self.engine_call(Op::Barrier, |e| {
            let tag = Self::tag(e);
            e.ctx.barrier(tag, timeout)
        })
    }

    /// Exchanges `(color, key)` with a Gloo all-gather, then every color
    /// builds its own Gloo context (sharing this one's TCP device) under a
    /// fresh store prefix `<parent>/split<n>/color<c>`.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let op = Op::Split;
        self.enter(op, DType::U8, None, Device::CPU)?;
        let mine = [color.map_or(-1, i64::from), i64::from(key)];
        let mut all = vec![0i64; 2 * self.world];
        let (world, timeout) = (self.world, self.timeout);
        {
            let src = HostBuf::from(&mine[..]);
            let mut dst = HostBufMut::from(&mut all[..]);
            self.engine_call(op, |e| {
                let tag = Self::tag(e);
                e.ctx
                    .all_gather(src.bytes(), dst.bytes_mut(), world, tag, timeout)
            })?;
        }
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let Some(color) = color else {
            return Ok(None);
        };
        let mut members: Vec<(u32, usize)> = (0..self.world)
            .filter(|&r| all[2 * r] == i64::from(color))
            .map(|r| (all[2 * r + 1] as u32, r))
            .collect();
        members.sort_unstable();
        let new_rank = members
            .iter()
            .position(|&(_, r)| r == self.rank)
            .ok_or_else(|| {
                err_at(
                    ErrorKind::Backend,
                    self.rank,
                    op,
                    "this rank is missing from its own color after the exchange",
                )
            })?;
        let sub = GlooCommunicator::connect(Params {
            gloo_device: self.gloo_device.clone(),
            store: self.store.clone(),
            prefix: format!("{}/split{seq}/color{color}", self.prefix),
            rank: new_rank,
            world: members.len(),
            device: self.device,
            timeout: self.timeout,
        });
        match sub {
            Ok(c) => Ok(Some(Box::new(c))),
            Err(e) => {
                let e = e.with_op(op.name()).with_rank(self.rank);
                if e.is_fatal_for_group() {
                    self.fail_outside(&e);
                }
                Err(e)
            }
        }
    }

    /// Poisons the communicator; when no operation is running it also
    /// closes the connections at once so that peers notice. It cannot
    /// interrupt an operation in flight (Gloo has no cancellation for
    /// collectives): that one ends at its timeout.
    fn abort(&self, reason: &str) {
        {
            let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
            if p.is_none() {
                *p = Some(format!("aborted: {reason}"));
            }
        }
        if let Ok(mut engine) = self.engine.try_lock() {
            engine.ctx.close();
        }
        // Wake a receive from self so that it sees the poison at its
        // deadline rather than waiting for a message that will not come.
        self.mail.notify_all();
    }
}
