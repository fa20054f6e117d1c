//! Forwarding layers over any [`Communicator`] (OpenDAL's layers): a
//! [`Layer`] sees a description of every call before it is forwarded, and
//! may refuse it. Debug fingerprinting is one; a vendor's tracing or
//! metrics wrapper is another. The layer forwards everything else, so it
//! never repeats the group's runtime.

use std::sync::Arc;
use std::time::Duration;

use crate::work::{Call, CallInfo, Pending};
use crate::{Buf, BufMut, Capabilities, Communicator, DType, Device, Error, Op, ReduceOp, Result};

/// A decorator over a communicator: [`before`](Layer::before) runs before
/// each call is forwarded.
pub trait Layer: Send + Sync + 'static {
    /// Inspect `call` (about to be forwarded to `inner`); an error stops the
    /// call and is returned to the caller as it is (attach context).
    fn before(&self, inner: &dyn Communicator, call: &CallInfo) -> Result<()>;

    /// Called with the error of a forwarded call (not with errors of
    /// [`before`](Layer::before)); what it returns goes to the caller. A
    /// layer adds what it knows here (the stall inspector names the ranks
    /// that never arrived). The default returns `err` as it is.
    fn on_error(&self, inner: &dyn Communicator, call: &CallInfo, err: Error) -> Error {
        let _ = (inner, call);
        err
    }

    /// Wrap the communicator of a sub-group made by `split` with `color`
    /// (the default leaves it unwrapped).
    fn wrap_split(&self, sub: Box<dyn Communicator>, color: u32) -> Box<dyn Communicator> {
        let _ = color;
        sub
    }
}

/// `inner` with `layer` in front: a [`Communicator`] that calls
/// [`Layer::before`] and then forwards.
#[derive(Debug)]
pub struct Layered<L> {
    // Shared with the error hooks of calls in flight (`start`).
    inner: Arc<dyn Communicator>,
    layer: Arc<L>,
}

impl<L: Layer> Layered<L> {
    /// Put `layer` in front of `inner`.
    pub fn new(inner: Box<dyn Communicator>, layer: L) -> Layered<L> {
        Layered {
            inner: Arc::from(inner),
            layer: Arc::new(layer),
        }
    }

    /// The layer.
    pub fn layer(&self) -> &L {
        &self.layer
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &dyn Communicator {
        &*self.inner
    }

    /// `before`, then `f` on the inner communicator, its error through
    /// `on_error`.
    fn forward<T>(
        &self,
        call: CallInfo,
        f: impl FnOnce(&dyn Communicator) -> Result<T>,
    ) -> Result<T> {
        self.layer.before(&*self.inner, &call)?;
        f(&*self.inner).map_err(|e| self.layer.on_error(&*self.inner, &call, e))
    }
}

impl<L: Layer> Communicator for Layered<L> {
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
        let call = CallInfo::new(Op::AllReduce, buf.dtype(), buf.len()).reduce(op);
        self.forward(call, |c| c.all_reduce(buf, op))
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        let call = CallInfo::new(Op::Reduce, buf.dtype(), buf.len())
            .reduce(op)
            .root(root);
        self.forward(call, |c| c.reduce(buf, op, root))
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        let call = CallInfo::new(Op::Broadcast, buf.dtype(), buf.len()).root(root);
        self.forward(call, |c| c.broadcast(buf, root))
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.forward(
            CallInfo::new(Op::AllGather, send.dtype(), send.len()),
            |c| c.all_gather(send, recv),
        )
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let call = CallInfo::new(Op::Gather, send.dtype(), send.len()).root(root);
        self.forward(call, |c| c.gather(send, recv, root))
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let call = CallInfo::new(Op::Scatter, recv.dtype(), recv.len()).root(root);
        self.forward(call, |c| c.scatter(send, recv, root))
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        let call = CallInfo::new(Op::ReduceScatter, send.dtype(), send.len()).reduce(op);
        self.forward(call, |c| c.reduce_scatter(send, recv, op))
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.forward(CallInfo::new(Op::AllToAll, send.dtype(), send.len()), |c| {
            c.all_to_all(send, recv)
        })
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let call = CallInfo::new(Op::Send, buf.dtype(), buf.len()).p2p(dst, tag);
        self.forward(call, |c| c.send(buf, dst, tag))
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let call = CallInfo::new(Op::Recv, buf.dtype(), buf.len()).p2p(src, tag);
        self.forward(call, |c| c.recv(buf, src, tag))
    }

    fn barrier(&self) -> Result<()> {
        self.forward(CallInfo::new(Op::Barrier, DType::U8, 0), |c| c.barrier())
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let sub = self.forward(CallInfo::new(Op::Split, DType::U8, 0), |c| {
            c.split(color, key)
        })?;
        Ok(match (sub, color) {
            (Some(c), Some(color)) => Some(self.layer.wrap_split(c, color)),
            (other, _) => other,
        })
    }

    fn abort(&self, reason: &str) {
        self.inner.abort(reason)
    }

    /// `before` at issue, then the inner communicator's `start`; the
    /// call's error, when the handle is waited for, goes through
    /// `on_error`.
    fn start(&self, call: Call) -> Result<Pending> {
        let info = call.info();
        self.layer.before(&*self.inner, &info)?;
        let (layer, inner) = (Arc::clone(&self.layer), Arc::clone(&self.inner));
        match self.inner.start(call) {
            Ok(p) => Ok(p.map_err(move |e| layer.on_error(&*inner, &info, e))),
            Err(e) => Err(self.layer.on_error(&*self.inner, &info, e)),
        }
    }
}
