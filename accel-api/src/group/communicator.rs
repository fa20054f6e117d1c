//! [`Group`]'s [`Communicator`] methods: each checks its call, then runs
//! the engine through the machinery in `mod.rs`.

use std::time::Duration;

use super::{lock, Engine, Group};
use crate::check::Shape;
use crate::{
    validate, Buf, BufMut, Capabilities, Communicator, DType, Device, Error, ErrorKind, Op,
    ReduceOp, Result,
};

impl<E: Engine> Communicator for Group<E> {
    fn backend_name(&self) -> &str {
        &self.info.backend
    }

    fn rank(&self) -> usize {
        self.info.rank
    }

    fn world_size(&self) -> usize {
        self.info.world_size
    }

    fn device(&self) -> Device {
        self.info.device
    }

    fn timeout(&self) -> Duration {
        self.info.timeout
    }

    fn capabilities(&self) -> &Capabilities {
        &self.info.capabilities
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
        validate::rank_in_group(self, op, "root", root)?;
        let shape = Shape::new(op, buf.dtype(), buf.len()).root(root);
        self.run_moving(shape, |e| e.broadcast(buf, root))
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllGather;
        self.enter_chunked(op, None, &send, &recv, true)?;
        let shape = Shape::new(op, send.dtype(), send.len());
        self.run_moving(shape, |e| e.all_gather(send, recv))
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        let op = Op::Gather;
        self.enter(op, send.dtype(), None, send.device())?;
        let recv = validate::gather(self, &send, recv, root)?;
        if let Some(r) = &recv {
            self.same_place(op, send.device(), r.device())?;
        }
        let shape = Shape::new(op, send.dtype(), send.len()).root(root);
        self.run_moving(shape, |e| e.gather(send, recv, root))
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        let op = Op::Scatter;
        self.enter(op, recv.dtype(), None, recv.device())?;
        let send = validate::scatter(self, send, &recv, root)?;
        if let Some(s) = &send {
            self.same_place(op, s.device(), recv.device())?;
        }
        let shape = Shape::new(op, recv.dtype(), recv.len()).root(root);
        self.run_moving(shape, |e| e.scatter(send, recv, root))
    }

    fn reduce_scatter(&self, send: Buf<'_>, mut recv: BufMut<'_>, reduce: ReduceOp) -> Result<()> {
        let op = Op::ReduceScatter;
        self.enter_chunked(op, Some(reduce), &send, &recv, false)?;
        let shape = Shape::new(op, recv.dtype(), recv.len()).reduce(reduce);
        let (native, divide) = self.native(reduce);
        let empty = recv.is_empty();
        self.run_moving(shape, |e| e.reduce_scatter(send, recv.reborrow(), native))?;
        if divide && !empty {
            self.divide(op, recv)?;
        }
        Ok(())
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        let op = Op::AllToAll;
        self.enter(op, send.dtype(), None, send.device())?;
        self.same_place(op, send.device(), recv.device())?;
        validate::all_to_all(self, &send, &recv)?;
        let shape = Shape::new(op, send.dtype(), send.len());
        self.run_moving(shape, |e| e.all_to_all(send, recv))
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        let op = Op::Send;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "destination", dst)?;
        if let (true, Buf::Host(h)) = (dst == self.info.rank, &buf) {
            let bytes = h.bytes().to_vec();
            self.mailbox.post(dst, tag, h.dtype(), bytes.len(), bytes);
            return Ok(());
        }
        self.run(op, |e| e.send(buf, dst, tag))
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        let op = Op::Recv;
        self.enter(op, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, op, "source", src)?;
        let buf = match buf {
            BufMut::Host(h) if src == self.info.rank => return self.recv_self(h, tag),
            other => other,
        };
        self.run(op, |e| e.recv(buf, src, tag))
    }

    fn barrier(&self) -> Result<()> {
        let op = Op::Barrier;
        self.enter(op, DType::U8, None, Device::CPU)?;
        // The check's exchange waits for every rank: it is the barrier.
        self.run_collective(Shape::new(op, DType::U8, 0), |e, checked| {
            if checked {
                Ok(())
            } else {
                e.barrier()
            }
        })
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let op = Op::Split;
        self.enter(op, DType::U8, None, Device::CPU)?;
        let sub = self.run_collective(Shape::new(op, DType::U8, 0), |e, _| e.split(color, key))?;
        Ok(sub
            .map(|e| Box::new(Group::new(e).with_call_check(self.check)) as Box<dyn Communicator>))
    }

    fn abort(&self, reason: &str) {
        let err = Error::new(ErrorKind::Aborted, format!("aborted: {reason}"));
        {
            let mut p = lock(&self.poisoned);
            if p.is_none() {
                *p = Some(err.message().to_string());
            }
        }
        self.engine.abort(reason);
        // Wake a receive from self so that it sees the poison.
        self.mailbox.wake();
    }
}

impl<E: Engine> Group<E> {
    /// Run a collective that moves the elements of `shape`: a zero-length
    /// call takes its place in the call check but never reaches the engine.
    fn run_moving(&self, shape: Shape, f: impl FnOnce(&E) -> Result<()>) -> Result<()> {
        let empty = shape.len == 0;
        self.run_collective(shape, |e, _| if empty { Ok(()) } else { f(e) })
    }

    /// Enter `op` (all_gather: `per_rank_send`, reduce_scatter: not), whose
    /// per-rank side holds `1 / world_size` of the other side's elements,
    /// with both buffers in one place and of one dtype.
    fn enter_chunked(
        &self,
        op: Op,
        reduce: Option<ReduceOp>,
        send: &Buf<'_>,
        recv: &BufMut<'_>,
        per_rank_send: bool,
    ) -> Result<()> {
        self.enter(op, send.dtype(), reduce, send.device())?;
        self.same_place(op, send.device(), recv.device())?;
        let send = ("send", send.dtype(), send.len());
        let recv = ("recv", recv.dtype(), recv.len());
        let (small, big) = if per_rank_send {
            (send, recv)
        } else {
            (recv, send)
        };
        validate::lengths(self, op, small, big, self.info.world_size)
    }
}
