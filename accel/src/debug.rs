//! Debug mode (`ACCEL_DEBUG=1`): fingerprint every collective over the store
//! and compare across ranks before entering the engine, so that ranks calling
//! different operations, dtypes, lengths or roots get a per-rank table
//! instead of a hang or a silently wrong result.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Buf, BufMut, Capabilities, Communicator, DType, Device, Error, ErrorKind, MismatchEntry, Op,
    ReduceOp, Result, Store,
};

/// A communicator that checks the collective calling convention on every
/// call. One store round trip per collective: for debugging, not production.
pub struct DebugCommunicator {
    inner: Box<dyn Communicator>,
    store: Arc<dyn Store>,
    seq: AtomicU64,
}

impl std::fmt::Debug for DebugCommunicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DebugCommunicator")
            .field("backend", &self.inner.backend_name())
            .field("rank", &self.inner.rank())
            .field("seq", &self.seq)
            .finish()
    }
}

impl DebugCommunicator {
    /// Wrap `inner`; `store` must be shared by exactly the ranks of `inner`'s
    /// group and used by nothing else.
    pub fn new(inner: Box<dyn Communicator>, store: Arc<dyn Store>) -> DebugCommunicator {
        DebugCommunicator {
            inner,
            store,
            seq: AtomicU64::new(0),
        }
    }

    fn check(
        &self,
        op: Op,
        dtype: DType,
        len: usize,
        root: Option<usize>,
        reduce: Option<ReduceOp>,
    ) -> Result<()> {
        let seq = self.seq.fetch_add(1, Ordering::SeqCst);
        let rank = self.inner.rank();
        let world = self.inner.world_size();
        let call = format!(
            "#{seq} {op} {dtype} [{len}] root={} reduce={}",
            root.map(|r| r.to_string()).unwrap_or_else(|| "-".into()),
            reduce.map(|r| r.name()).unwrap_or("-")
        );
        let tag = |e: Error| {
            e.with_backend(self.inner.backend_name())
                .with_rank(rank)
                .with_op(op.name())
        };
        self.store
            .set(&format!("{seq}/{rank}"), call.as_bytes())
            .map_err(tag)?;
        let keys: Vec<String> = (0..world).map(|r| format!("{seq}/{r}")).collect();
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = self.store.wait(&key_refs, self.inner.timeout());
        let table: Vec<MismatchEntry> = (0..world)
            .map(|r| MismatchEntry {
                rank: r,
                call: self
                    .store
                    .try_get(&keys[r])
                    .ok()
                    .flatten()
                    .map(|v| String::from_utf8_lossy(&v).into_owned()),
            })
            .collect();
        if let Err(e) = waited {
            if matches!(e.kind(), ErrorKind::Timeout { .. }) {
                let late: Vec<String> = table
                    .iter()
                    .filter(|t| t.call.is_none())
                    .map(|t| t.rank.to_string())
                    .collect();
                let rows: Vec<String> = table
                    .iter()
                    .map(|t| {
                        format!(
                            "rank {}: {}",
                            t.rank,
                            t.call.as_deref().unwrap_or("<not called>")
                        )
                    })
                    .collect();
                let err = Error::timeout(
                    op.name(),
                    self.inner.timeout(),
                    format!(
                        "rank(s) {} never called collective #{seq}; per-rank calls: {}",
                        late.join(", "),
                        rows.join(" | ")
                    ),
                )
                .with_fix("make every rank call the same collectives in the same order");
                self.inner.abort(&err.to_string());
                return Err(tag(err));
            }
            return Err(tag(e));
        }
        if table
            .iter()
            .any(|t| t.call.as_deref() != Some(call.as_str()))
        {
            let err = Error::new(
                ErrorKind::Mismatch { table },
                format!("ranks disagree on collective #{seq}"),
            )
            .with_fix(
                "make every rank call the same collective with the same dtype, length and root",
            );
            self.inner.abort(&err.to_string());
            return Err(tag(err));
        }
        if seq >= 2 {
            // Every rank has read #seq-2 before publishing #seq-1.
            let _ = self.store.delete(&format!("{}/{rank}", seq - 2));
        }
        Ok(())
    }
}

impl Communicator for DebugCommunicator {
    fn backend_name(&self) -> &str {
        self.inner.backend_name()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn capabilities(&self) -> &Capabilities {
        self.inner.capabilities()
    }
    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.check(Op::AllReduce, buf.dtype(), buf.len(), None, Some(op))?;
        self.inner.all_reduce(buf, op)
    }
    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.check(Op::Reduce, buf.dtype(), buf.len(), Some(root), Some(op))?;
        self.inner.reduce(buf, op, root)
    }
    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.check(Op::Broadcast, buf.dtype(), buf.len(), Some(root), None)?;
        self.inner.broadcast(buf, root)
    }
    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.check(Op::AllGather, send.dtype(), send.len(), None, None)?;
        self.inner.all_gather(send, recv)
    }
    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.check(Op::Gather, send.dtype(), send.len(), Some(root), None)?;
        self.inner.gather(send, recv, root)
    }
    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.check(Op::Scatter, recv.dtype(), recv.len(), Some(root), None)?;
        self.inner.scatter(send, recv, root)
    }
    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.check(Op::ReduceScatter, send.dtype(), send.len(), None, Some(op))?;
        self.inner.reduce_scatter(send, recv, op)
    }
    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.check(Op::AllToAll, send.dtype(), send.len(), None, None)?;
        self.inner.all_to_all(send, recv)
    }
    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        self.inner.send(buf, dst, tag)
    }
    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.inner.recv(buf, src, tag)
    }
    fn barrier(&self) -> Result<()> {
        self.check(Op::Barrier, DType::U8, 0, None, None)?;
        self.inner.barrier()
    }
    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let seq = self.seq.load(Ordering::SeqCst);
        self.check(Op::Split, DType::U8, 0, None, None)?;
        let sub = self.inner.split(color, key)?;
        Ok(match (sub, color) {
            (Some(c), Some(color)) => {
                let store: Arc<dyn Store> = Arc::new(accel_rendezvous::PrefixStore::new(
                    self.store.clone(),
                    format!("split{seq}/color{color}"),
                ));
                Some(Box::new(DebugCommunicator::new(c, store)) as Box<dyn Communicator>)
            }
            (other, _) => other,
        })
    }
    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }
}
