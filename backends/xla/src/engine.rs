//! [`XlaEngine`]: the [`Engine`] of one rank thread. Collectives meet the
//! group's other rank threads ([`Meet`]); the last to arrive runs the
//! compiled StableHLO program over every rank's input on the plugin's
//! devices (replica `i` is rank `i`). Point-to-point messages go through
//! the meeting's mailbox; a barrier is a meeting without a program.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use accel_api::kit::{host, host_mut, Engine, EngineInfo, Group, SplitPlan};
use accel_api::{Buf, BufMut, Capabilities, Device, DeviceKind, Error, Op, ReduceOp, Result};

use crate::error::XlaError;
use crate::meet::{CallKey, Deposit, Meet, Outcome, Work};
use crate::name::NAME;
use crate::programs::{dtypes, Program};
use crate::runtime::Runtime;
use accel_api::sync::lock;

/// The communicator of one rank thread.
pub type XlaCommunicator = Group<XlaEngine>;

/// What every xla communicator declares: every operation, element type and
/// reduction (avg as sum then division by the group) on host memory.
pub fn capabilities() -> Capabilities {
    let mut c = Capabilities::all_host()
        .with_dtypes(dtypes())
        .with_reduce_dtypes(dtypes())
        .with_device_kinds([DeviceKind::Cpu]);
    c.reduce_ops = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
    ]
    .into_iter()
    .collect();
    c
}

/// The engine of one rank thread of a group.
pub struct XlaEngine {
    runtime: Arc<Runtime>,
    meet: Arc<Meet>,
    info: EngineInfo,
    /// This rank's next round number on `meet`.
    next_round: AtomicU64,
    /// The allocation this rank's contributions travel in (and its output
    /// comes back in), kept between calls: fresh large allocations cost a
    /// page fault per page.
    staging: Mutex<Vec<u8>>,
}

impl std::fmt::Debug for XlaEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XlaEngine")
            .field("group", &self.meet.name)
            .finish_non_exhaustive()
    }
}

impl XlaEngine {
    /// The engine of `rank` in the group meeting at `meet`, whose round
    /// `first_round` is the next to run.
    pub(crate) fn new(
        runtime: Arc<Runtime>,
        meet: Arc<Meet>,
        rank: usize,
        device: Device,
        timeout: Duration,
        first_round: u64,
    ) -> XlaEngine {
        let info = EngineInfo {
            backend: NAME.to_string(),
            rank,
            world_size: meet.size,
            device,
            timeout,
            capabilities: capabilities(),
        };
        XlaEngine {
            runtime,
            meet,
            info,
            next_round: AtomicU64::new(first_round),
            staging: Mutex::new(Vec::new()),
        }
    }

    /// Programs compiled in this process so far (cached per program text
    /// and group size).
    pub fn programs_compiled(&self) -> usize {
        self.runtime.programs_compiled()
    }

    /// The plugin, API and devices, as the probe reports them.
    pub fn describe_runtime(&self) -> String {
        self.runtime.describe()
    }

    /// A meeting without data or program: returns once every rank arrived
    /// (a barrier; `connect`'s join).
    pub(crate) fn gather_up(&self, op: &'static str) -> std::result::Result<(), XlaError> {
        let deposit = Deposit {
            key: CallKey::control(op),
            data: Vec::new(),
            split: None,
        };
        let n = self.meet.size;
        self.meet(
            deposit,
            Box::new(move |_| Ok((0..n).map(|_| None).collect())),
        )?;
        Ok(())
    }

    /// Meet the other ranks with `deposit`; the last one runs `work`.
    fn meet(&self, deposit: Deposit, work: Work<'_>) -> std::result::Result<Outcome, XlaError> {
        let n = self.next_round.fetch_add(1, Ordering::SeqCst);
        self.meet
            .round(self.info.rank, n, deposit, self.info.timeout, work)
    }

    /// `bytes` in this rank's staging allocation.
    fn stage(&self, bytes: &[u8]) -> Vec<u8> {
        let mut v = std::mem::take(&mut *lock(&self.staging));
        v.clear();
        v.extend_from_slice(bytes);
        v
    }

    /// `n` zero bytes in this rank's staging allocation.
    fn stage_zeros(&self, n: usize) -> Vec<u8> {
        let mut v = std::mem::take(&mut *lock(&self.staging));
        v.clear();
        v.resize(n, 0);
        v
    }

    /// One collective: deposit `data` (staged), run `program` over all
    /// deposits with blocks of `len`, and copy this rank's output into
    /// `dst` (`None`: a rank that keeps no output).
    fn collective(
        &self,
        key: CallKey,
        data: Vec<u8>,
        program: Program,
        len: usize,
        dst: Option<BufMut<'_>>,
    ) -> Result<()> {
        let runtime = &self.runtime;
        let dtype = key.dtype;
        let work: Work<'_> = Box::new(move |deposits| {
            let mut bufs: Vec<Vec<u8>> = deposits.into_iter().map(|d| d.data).collect();
            runtime.run(program, dtype, len, &mut bufs)?;
            Ok(bufs.into_iter().map(|o| Some(Outcome::Bytes(o))).collect())
        });
        let deposit = Deposit {
            key,
            data,
            split: None,
        };
        let out = match self.meet(deposit, work)? {
            Outcome::Bytes(b) => b,
            other => return Err(XlaError::Broken(format!("{} got {other:?}", key.op)).into()),
        };
        let filled = match dst {
            Some(d) => fill(key.op, d, &out),
            None => Ok(()),
        };
        *lock(&self.staging) = out;
        filled
    }

    /// What every rank must agree on for a call on `send`.
    fn key(op: Op, send: &Buf<'_>, root: Option<usize>, reduce: Option<ReduceOp>) -> CallKey {
        CallKey {
            op: op.name(),
            dtype: send.dtype(),
            len: send.len(),
            root,
            reduce,
        }
    }

    /// [`collective`](Self::collective) with `send`'s bytes.
    fn run(
        &self,
        key: CallKey,
        send: Buf<'_>,
        program: Program,
        len: usize,
        dst: Option<BufMut<'_>>,
    ) -> Result<()> {
        let h = send
            .host()
            .ok_or_else(|| Error::internal(key.op, "a device buffer reached a host-only engine"))?;
        let data = self.stage(h.bytes());
        self.collective(key, data, program, len, dst)
    }
}

/// Copy `src` into the host buffer `dst` (same length, checked).
fn fill(op: &str, dst: BufMut<'_>, src: &[u8]) -> Result<()> {
    let mut d = dst
        .into_host()
        .ok_or_else(|| Error::internal(op, "a device buffer reached a host-only engine"))?;
    if d.bytes().len() != src.len() {
        return Err(XlaError::Broken(format!(
            "{op}: {} bytes came back for a {}-byte buffer",
            src.len(),
            d.bytes().len()
        ))
        .into());
    }
    d.bytes_mut().copy_from_slice(src);
    Ok(())
}

impl Engine for XlaEngine {
    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let (key, len) = (
            Self::key(Op::AllReduce, &buf.as_buf(), None, Some(op)),
            buf.len(),
        );
        let data = self.stage(host(Op::AllReduce, buf.as_buf())?.bytes());
        self.collective(key, data, Program::AllReduce(op), len, Some(buf))
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        let (key, len) = (
            Self::key(Op::Reduce, &buf.as_buf(), Some(root), Some(op)),
            buf.len(),
        );
        let data = self.stage(host(Op::Reduce, buf.as_buf())?.bytes());
        let dst = (self.info.rank == root).then_some(buf);
        self.collective(key, data, Program::AllReduce(op), len, dst)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let (key, len) = (
            Self::key(Op::Broadcast, &buf.as_buf(), Some(root), None),
            buf.len(),
        );
        let data = self.stage(host(Op::Broadcast, buf.as_buf())?.bytes());
        self.collective(key, data, Program::Broadcast { root }, len, Some(buf))
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let key = Self::key(Op::AllGather, &send, None, None);
        let len = send.len();
        self.run(key, send, Program::AllGather, len, Some(recv))
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let key = Self::key(Op::Gather, &send, Some(root), None);
        let len = send.len();
        self.run(key, send, Program::AllGather, len, recv)
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let len = recv.len();
        let key = Self::key(Op::Scatter, &recv.as_buf(), Some(root), None);
        let data = match send {
            Some(s) => self.stage(host(Op::Scatter, s)?.bytes()),
            // Non-roots contribute zeros: only the root's blocks are kept.
            None => self.stage_zeros(self.meet.size * len * recv.dtype().size()),
        };
        self.collective(key, data, Program::Scatter { root }, len, Some(recv))
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let key = Self::key(Op::ReduceScatter, &recv.as_buf(), None, Some(op));
        let len = recv.len();
        self.run(key, send, Program::ReduceScatter(op), len, Some(recv))
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let key = Self::key(Op::AllToAll, &send, None, None);
        let len = send.len() / self.meet.size;
        self.run(key, send, Program::AllToAll, len, Some(recv))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let h = host(Op::Send, buf)?;
        self.meet
            .send(self.info.rank, dst, tag, h.dtype(), h.bytes().to_vec());
        Ok(())
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let mut h = host_mut(Op::Recv, buf)?;
        let data = self.meet.recv(
            src,
            self.info.rank,
            tag,
            h.dtype(),
            h.bytes().len(),
            self.info.timeout,
        )?;
        h.bytes_mut().copy_from_slice(&data);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        Ok(self.gather_up(Op::Barrier.name())?)
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Self>> {
        let deposit = Deposit {
            key: CallKey::control(Op::Split.name()),
            data: Vec::new(),
            split: Some((color, key)),
        };
        let parent = self.meet.name.clone();
        let round = self.next_round.load(Ordering::SeqCst);
        let work: Work<'_> = Box::new(move |deposits| {
            let all: Vec<i64> = deposits
                .iter()
                .flat_map(|d| {
                    let (c, k) = d.split.unwrap_or((None, 0));
                    [c.map_or(-1, i64::from), i64::from(k)]
                })
                .collect();
            let mut meets: std::collections::HashMap<u32, Arc<Meet>> = Default::default();
            let mut out = Vec::with_capacity(deposits.len());
            for (r, d) in deposits.iter().enumerate() {
                let c = d.split.and_then(|s| s.0);
                let plan = SplitPlan::from_exchanged(r, c, &all)
                    .map_err(|e| XlaError::Broken(e.to_string()))?;
                out.push(Some(Outcome::Sub(c.map(|c| {
                    let m = meets.entry(c).or_insert_with(|| {
                        Meet::new(
                            format!("{parent}/split{round}/color{c}"),
                            plan.members.len(),
                        )
                    });
                    (m.clone(), plan.new_rank)
                }))));
            }
            Ok(out)
        });
        match self.meet(deposit, work)? {
            Outcome::Sub(None) => Ok(None),
            Outcome::Sub(Some((meet, rank))) => Ok(Some(XlaEngine::new(
                self.runtime.clone(),
                meet,
                rank,
                self.info.device,
                self.info.timeout,
                0,
            ))),
            other => Err(XlaError::Broken(format!("split got {other:?}")).into()),
        }
    }

    fn abort(&self, reason: &str) {
        self.meet.break_with(XlaError::PeerFailed {
            rank: self.info.rank,
            why: format!("aborted: {reason}"),
        });
    }

    fn on_fatal(&self, err: &Error) {
        // A timeout already broke the meeting with its own message; other
        // failures tell the peers which rank failed first.
        self.meet.break_with(XlaError::PeerFailed {
            rank: self.info.rank,
            why: err.to_string(),
        });
    }
}
