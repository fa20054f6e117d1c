//! [`GlooEngine`]: the calls into one Gloo context; [`GlooCommunicator`]
//! is it inside accel's generic [`Group`].

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use accel_api::kit::{
    host, host_mut, message_does_not_fit, Deadline, Engine, EngineInfo, Group, P2pHeader,
    SplitPlan, P2P_MAGIC,
};
use accel_api::{
    Buf, BufMut, Capabilities, DType, Error, ErrorKind, HostBuf, Op, ReduceOp, Result, Store,
};

use crate::error::{classify, to_api, Caught, Class, GlooError};
use crate::ffi::{self, Call, DTypeCode, OpCode};
use crate::name::NAME;
use crate::rendezvous::{remaining, StoreAdapter};

/// What every cpu-gloo communicator declares: every operation and element
/// type on host memory; reductions on everything but bf16 (Gloo has no
/// bfloat16).
pub fn capabilities() -> Capabilities {
    let reduce = DType::ALL.into_iter().filter(|&d| d != DType::BF16);
    Capabilities::all_host().with_reduce_dtypes(reduce)
}

/// Bytes of the point-to-point header (the kit's [`P2pHeader`], whose last
/// word is [`P2P_MAGIC`] here).
const P2P_HEADER: usize = P2pHeader::BYTES;

/// The Gloo context and the tag of the next collective, behind one lock.
struct Context {
    ctx: ffi::Context,
    next_tag: u32,
}

/// The calls into one Gloo context (TCP full mesh). The [`Group`] around
/// it serialises calls; the context's own lock is contended only by
/// [`Engine::abort`], which closes the connections when no call runs.
pub struct GlooEngine {
    info: EngineInfo,
    gloo_device: Arc<ffi::Device>,
    engine: Mutex<Context>,
    store: Arc<dyn Store>,
    prefix: String,
    splits: AtomicU64,
    /// Set once this rank published why it closed its connections.
    fault_published: AtomicBool,
}

/// accel's [`Communicator`](accel_api::Communicator) over one Gloo context.
pub type GlooCommunicator = Group<GlooEngine>;

impl fmt::Debug for GlooEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GlooEngine")
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
    /// Who this communicator is.
    pub(crate) info: EngineInfo,
}

fn addr_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/addr/{rank}")
}

/// How long a rank that lost a peer waits for that peer's published root
/// cause before reporting the loss as it saw it.
const FAULT_NOTE_GRACE: Duration = Duration::from_millis(500);

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

impl GlooEngine {
    /// Rendezvous under `p.prefix` and connect to every rank.
    pub(crate) fn connect(p: Params) -> Result<GlooEngine> {
        let adapter = StoreAdapter::new(&*p.store, &p.prefix, p.info.rank, p.info.timeout);
        let ctx = match ffi::Context::connect(
            &p.gloo_device,
            p.info.rank,
            p.info.world_size,
            p.info.timeout,
            &adapter,
        ) {
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
                        to_api(e, &class, p.info.rank, "connect", p.info.timeout).with_fix(format!(
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
        let table: String = (0..p.info.world_size)
            .filter(|&r| r != p.info.rank)
            .map(|r| {
                let [local, advertised] = ctx.self_names(r);
                format!("{r} {local} {advertised}\n")
            })
            .collect();
        let ctx_err = |e: Error| {
            e.with_op("connect")
                .with_backend(NAME)
                .with_rank(p.info.rank)
        };
        p.store
            .set(&addr_key(&p.prefix, p.info.rank), table.as_bytes())
            .map_err(ctx_err)?;
        // Connecting is collective: no rank returns (and may drop its
        // communicator) before every rank's Gloo finished connecting, or a
        // peer whose handshake is still in flight would see its connection
        // closed (a rank that made no collective and exited at once).
        let keys: Vec<String> = (0..p.info.world_size)
            .map(|r| addr_key(&p.prefix, r))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        p.store.wait(&refs, p.info.timeout).map_err(ctx_err)?;
        Ok(GlooEngine {
            info: p.info,
            gloo_device: p.gloo_device,
            engine: Mutex::new(Context { ctx, next_tag: 0 }),
            store: p.store,
            prefix: p.prefix,
            splits: AtomicU64::new(0),
            fault_published: AtomicBool::new(false),
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
        if rank == self.info.rank || rank >= self.info.world_size {
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
                (r == self.info.rank).then(|| words.map(str::to_string).collect())
            })
            .unwrap_or_default()
    }

    /// The rank at the other end of the connection Gloo printed as `addr`.
    fn rank_of_address(&self, addr: &str) -> Option<usize> {
        (0..self.info.world_size).find(|&r| self.peer_addresses(r).iter().any(|a| a == addr))
    }

    fn lock_engine(&self) -> MutexGuard<'_, Context> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `f` on the Gloo context and classify its failure.
    fn engine_call<T>(
        &self,
        op: Op,
        f: impl FnOnce(&mut Context) -> std::result::Result<T, GlooError>,
    ) -> Result<T> {
        let mut engine = self.lock_engine();
        f(&mut engine).map_err(|e| {
            let class = classify(&e, &|a| self.rank_of_address(a));
            self.attribute(
                to_api(e, &class, self.info.rank, op.name(), self.info.timeout),
                &class,
            )
        })
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
        let grace = self.info.timeout.min(FAULT_NOTE_GRACE);
        let Ok(note) = self.store.get(&self.fault_key(*p), grace) else {
            return err;
        };
        let note = String::from_utf8_lossy(&note).into_owned();
        let (lost, why) = note.split_once('\n').unwrap_or((note.as_str(), ""));
        let lost: Option<usize> = lost.strip_prefix("lost=").and_then(|v| v.parse().ok());
        let message = format!("rank {p} gave up first: {why}");
        let op = err.op().unwrap_or("collective").to_string();
        match lost {
            Some(q) if q != self.info.rank && q != *p => Error::new(
                ErrorKind::PeerLost { peer: Some(q) },
                format!("{message} (it lost rank {q})"),
            )
            .with_fix(format!("look at rank {q}'s log for why it stopped")),
            _ => Error::new(ErrorKind::PeerLost { peer: Some(*p) }, message)
                .with_fix(format!("look at rank {p}'s log for the first failure")),
        }
        .with_op(op)
        .with_backend(NAME)
        .with_rank(self.info.rank)
        .with_boxed_source(Box::new(err))
    }

    fn fault_key(&self, rank: usize) -> String {
        format!("{}/fault/{rank}", self.prefix)
    }

    /// Tell the peers why this rank closes its connections (best effort,
    /// through the store): the rank it lost, if any, and the reason. Only
    /// the first note counts (a later abort does not hide the failure).
    fn publish_fault(&self, lost: Option<usize>, why: &str) {
        if self.fault_published.swap(true, Ordering::SeqCst) {
            return;
        }
        let lost = lost.map_or_else(|| "-".to_string(), |q| q.to_string());
        let _ = self.store.set(
            &self.fault_key(self.info.rank),
            format!("lost={lost}\n{why}").as_bytes(),
        );
    }

    /// Take the next collective tag.
    fn tag(e: &mut Context) -> u32 {
        let t = e.next_tag;
        e.next_tag = t.wrapping_add(1);
        t
    }

    /// Run the collective `call` makes of the next tag, under the group's
    /// timeout.
    fn collective<'a>(&self, op: Op, call: impl FnOnce(u32) -> Call<'a>) -> Result<()> {
        let timeout = self.info.timeout;
        self.engine_call(op, |e| {
            let tag = Self::tag(e);
            e.ctx.run(call(tag), timeout)
        })
    }

    fn reduce_common(
        &self,
        op: Op,
        buf: BufMut<'_>,
        reduce: ReduceOp,
        root: Option<usize>,
    ) -> Result<()> {
        let mut host = host_mut(op, buf)?;
        let (count, dtype, code) = (host.len(), dtype_code(host.dtype()), native(reduce));
        let b = host.bytes_mut();
        self.collective(op, move |tag| match root {
            None => Call::AllReduce(b, count, dtype, code, tag),
            Some(r) => Call::Reduce(b, count, dtype, code, r, tag),
        })
    }
}

fn parse_header(h: &[u8; P2P_HEADER]) -> std::result::Result<(Option<DType>, usize), GlooError> {
    let h = P2pHeader::decode(h);
    if h.tag != P2P_MAGIC {
        return Err(GlooError::new(
            Caught::Gloo,
            "point-to-point header is corrupt (the peer does not speak cpu-gloo's protocol)",
        ));
    }
    let nbytes = h
        .byte_len()
        .ok_or_else(|| GlooError::new(Caught::Gloo, "point-to-point message too large"))?;
    Ok((h.element_type(), nbytes))
}

/// Point-to-point slots: two per tag (header, payload), below Gloo's
/// collective slots (which use the top byte).
fn p2p_slots(tag: u32) -> (u64, u64) {
    let h = u64::from(tag) << 1;
    (h, h | 1)
}

impl Engine for GlooEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.reduce_common(Op::AllReduce, buf, op, None)
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.reduce_common(Op::Reduce, buf, op, Some(root))
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Broadcast;
        let mut host = host_mut(op, buf)?;
        let b = host.bytes_mut();
        self.collective(op, move |tag| Call::Broadcast(b, root, tag))
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllGather;
        let src = host(op, send)?;
        let mut dst = host_mut(op, recv)?;
        let (i, o, world) = (src.bytes(), dst.bytes_mut(), self.info.world_size);
        self.collective(op, move |tag| Call::AllGather(i, o, world, tag))
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let op = Op::Gather;
        let src = host(op, send)?;
        let mut dst = recv.map(|r| host_mut(op, r)).transpose()?;
        let (i, o) = (src.bytes(), dst.as_mut().map(|d| d.bytes_mut()));
        let world = self.info.world_size;
        self.collective(op, move |tag| Call::Gather(i, o, world, root, tag))
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Scatter;
        let src = send.map(|b| host(op, b)).transpose()?;
        let mut dst = host_mut(op, recv)?;
        let (i, o) = (src.as_ref().map(HostBuf::bytes), dst.bytes_mut());
        let world = self.info.world_size;
        self.collective(op, move |tag| Call::Scatter(i, o, world, root, tag))
    }

    /// A ring reduce-scatter in the shim on Gloo's unbound buffers: each
    /// rank sends `size - 1` chunks and reduces each arriving chunk into its
    /// own (half the traffic of an all-reduce), bounded by the timeout.
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, reduce: ReduceOp) -> Result<()> {
        let op = Op::ReduceScatter;
        let src = host(op, send)?;
        let mut dst = host_mut(op, recv)?;
        let (count, dtype, code) = (dst.len(), dtype_code(dst.dtype()), native(reduce));
        let (i, o) = (src.bytes(), dst.bytes_mut());
        let world = self.info.world_size;
        self.collective(op, move |tag| {
            Call::ReduceScatter(i, o, count, dtype, code, world, tag)
        })
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllToAll;
        let src = host(op, send)?;
        let mut dst = host_mut(op, recv)?;
        let (i, o) = (src.bytes(), dst.bytes_mut());
        self.collective(op, move |tag| Call::AllToAll(i, o, tag))
    }

    /// Every message travels as a 16-byte header (length, dtype) followed
    /// by the payload, so that a receive of the wrong size is an error
    /// instead of a Gloo assertion on its event-loop thread (which aborts
    /// the process).
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let op = Op::Send;
        let src = host(op, buf)?;
        let hdr = P2pHeader::new(src.dtype(), src.len(), P2P_MAGIC).encode();
        let (slot_h, slot_p) = p2p_slots(tag);
        let timeout = self.info.timeout;
        self.engine_call(op, |e| {
            let deadline = Deadline::after(timeout);
            e.ctx.run(Call::Send(&hdr, dst, slot_h), timeout)?;
            if !src.is_empty() {
                let payload = Call::Send(src.bytes(), dst, slot_p);
                e.ctx.run(payload, remaining(&deadline))?;
            }
            Ok(())
        })
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let op = Op::Recv;
        let mut dst = host_mut(op, buf)?;
        let (slot_h, slot_p) = p2p_slots(tag);
        let timeout = self.info.timeout;
        let want = dst.dtype();
        let mismatch = self.engine_call(op, |e| {
            let deadline = Deadline::after(timeout);
            let mut hdr = [0u8; P2P_HEADER];
            e.ctx.run(Call::Recv(&mut hdr, src, slot_h), timeout)?;
            let (dtype, nbytes) = parse_header(&hdr)?;
            if dtype == Some(want) && nbytes == dst.bytes().len() {
                if nbytes > 0 {
                    let payload = Call::Recv(dst.bytes_mut(), src, slot_p);
                    e.ctx.run(payload, remaining(&deadline))?;
                }
                return Ok(None);
            }
            // Drain the payload so that the connection stays in step.
            if nbytes > 0 {
                let mut sink = vec![0u8; nbytes];
                let drain = Call::Recv(&mut sink, src, slot_p);
                e.ctx.run(drain, remaining(&deadline))?;
            }
            Ok(Some((dtype, nbytes)))
        })?;
        match mismatch {
            None => Ok(()),
            Some((dtype, nbytes)) => {
                Err(
                    message_does_not_fit(op, src, tag, dtype, nbytes, dst.dtype(), dst.len())
                        .with_backend(NAME)
                        .with_rank(self.info.rank),
                )
            }
        }
    }

    fn barrier(&self) -> Result<()> {
        self.collective(Op::Barrier, Call::Barrier)
    }

    /// Exchanges `(color, key)` with a Gloo all-gather, then every color
    /// builds its own Gloo context (sharing this one's TCP device) under a
    /// fresh store prefix `<parent>/split<n>/color<c>`.
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<GlooEngine>> {
        let plan = SplitPlan::exchange(self, color, key)?;
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let Some(color) = plan.color else {
            return Ok(None);
        };
        GlooEngine::connect(Params {
            gloo_device: self.gloo_device.clone(),
            store: self.store.clone(),
            prefix: format!("{}/split{seq}/color{color}", self.prefix),
            info: self.info.sub(&plan),
        })
        .map(Some)
    }

    /// Closes the connections at once when no operation is running, so
    /// that peers notice, after publishing why (one store write, as
    /// [`on_fatal`](Engine::on_fatal) does): the peers' `PeerLost` names
    /// this rank and carries the reason without waiting for a note. It
    /// cannot interrupt an operation in flight (Gloo has no cancellation
    /// for collectives): that one ends when a peer closes its connections
    /// or at its timeout.
    fn abort(&self, reason: &str) {
        if let Ok(mut engine) = self.engine.try_lock() {
            self.publish_fault(None, &format!("aborted: {reason}"));
            engine.ctx.close();
        }
    }

    /// Tell the others why (best effort, through the store), and close
    /// every connection so that they notice at once instead of waiting for
    /// their timeout. Gloo contexts are unusable after an I/O error anyway.
    fn on_fatal(&self, err: &Error) {
        let lost = match err.kind() {
            ErrorKind::PeerLost { peer: Some(q) } => Some(*q),
            _ => None,
        };
        self.publish_fault(lost, &err.to_string());
        self.lock_engine().ctx.close();
    }
}
