//! [`Group`]'s [`Communicator`] methods. Every call takes one path:
//! admitted (the checks that need no communication, a ticket in issue
//! order), then run in its turn (the call check, the engine, the average's
//! division), by the caller for a blocking call or by the group's worker
//! thread for a call started without waiting ([`Communicator::start`]).

use std::sync::Arc;
use std::time::Duration;

use super::{Core, Engine, Group, Ticket};
use crate::check::Shape;
use crate::comm::validate;
use crate::work::{Call, CallMut, Pending, WorkLabel};
use crate::{
    Buf, BufMut, Capabilities, Communicator, DType, Device, Error, ErrorKind, Op, ReduceOp, Result,
};

/// What admission found out about a call.
#[derive(Debug, Clone)]
pub(crate) enum Admitted {
    /// A collective: the shape the call check compares.
    Collective(Shape),
    /// A point-to-point call through the engine.
    P2p,
    /// A host receive from self: the mailbox, no engine, no turn.
    RecvSelf,
    /// Already done: a host send to self, posted to the mailbox.
    Done,
}

impl<E: Engine> Communicator for Group<E> {
    fn backend_name(&self) -> &str {
        &self.core.info.backend
    }

    fn rank(&self) -> usize {
        self.core.info.rank
    }

    fn world_size(&self) -> usize {
        self.core.info.world_size
    }

    fn device(&self) -> Device {
        self.core.info.device
    }

    fn timeout(&self) -> Duration {
        self.core.info.timeout
    }

    fn capabilities(&self) -> &Capabilities {
        &self.core.info.capabilities
    }

    fn all_reduce(&self, buf: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.blocking(CallMut::AllReduce { buf, op })
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.blocking(CallMut::Reduce { buf, op, root })
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.blocking(CallMut::Broadcast { buf, root })
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.blocking(CallMut::AllGather { send, recv })
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.blocking(CallMut::Gather { send, recv, root })
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.blocking(CallMut::Scatter { send, recv, root })
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.blocking(CallMut::ReduceScatter { send, recv, op })
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.blocking(CallMut::AllToAll { send, recv })
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        self.blocking(CallMut::Send { buf, dst, tag })
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.blocking(CallMut::Recv { buf, src, tag })
    }

    fn barrier(&self) -> Result<()> {
        self.blocking(CallMut::Barrier)
    }

    fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Box<dyn Communicator>>> {
        let op = Op::Split;
        self.enter(op, DType::U8, None, Device::CPU)?;
        let shape = Shape::new(op, DType::U8, 0);
        let t = self.admit(true);
        if let Some(r) = &self.core.recorder {
            r.issued(t.n, t.seq, &crate::CallInfo::new(op, DType::U8, 0), false);
        }
        let pass = self.core.turn.take(t.n);
        let sub = self
            .core
            .run_turn(t, op, Some(&shape), |e, _| e.split(color, key));
        drop(pass);
        let sub = sub?;
        let name = match (&self.core.recorder, color, t.seq) {
            (Some(r), Some(c), Some(seq)) => format!("{}/split{seq}:c{c}", r.identity().name),
            _ => "split".to_string(),
        };
        Ok(sub.map(|e| {
            Box::new(Group::named(e, name).with_call_check(self.check)) as Box<dyn Communicator>
        }))
    }

    fn abort(&self, reason: &str) {
        self.core.abort_now(reason);
    }

    fn start(&self, mut call: Call) -> Result<Pending> {
        let admitted = self.admit_call(&mut call.views_mut())?;
        let op = call.info().op;
        let inline = E::STARTS_INLINE || self.core.info.world_size == 1;
        let ticketed = match &admitted {
            Admitted::Done => {
                return Ok(Pending::completed(
                    WorkLabel::of(self, op, None),
                    Ok(()),
                    call,
                ))
            }
            Admitted::Collective(_) => Some(true),
            Admitted::P2p => Some(false),
            Admitted::RecvSelf => None,
        };
        let info = call.info();
        if inline {
            let t = ticketed.map(|c| self.admit(c));
            if let (Some(t), Some(r)) = (t, &self.core.recorder) {
                r.issued(t.n, t.seq, &info, true);
            }
            let label = WorkLabel::of(self, op, t.and_then(|t| t.seq));
            let pass = t.map(|t| self.core.turn.take(t.n));
            let result = self.core.execute(t, &admitted, call.views_mut());
            drop(pass);
            let result = result.map_err(|e| relabel(e, &label));
            return Ok(Pending::completed(label, result, call));
        }
        let abort_core = Arc::clone(&self.core);
        let abort = Arc::new(move |why: &str| abort_core.abort_now(why));
        let (mut pending, completer) = Pending::queued(WorkLabel::of(self, op, None), Some(abort));
        let core = Arc::clone(&self.core);
        let mut label = pending.label().clone();
        let recorder = self.core.recorder.clone();
        let seq = self.admit_queued(ticketed, info, recorder, move |t: Option<Ticket>| {
            label.seq = t.and_then(|t| t.seq);
            // The handle completes inside the turn: a call issued after
            // this one never returns before this one is done.
            let pass = t.map(|t| core.turn.take(t.n));
            completer.running();
            let result = core.execute(t, &admitted, call.views_mut());
            completer.complete(result.map_err(|e| relabel(e, &label)), call);
            drop(pass);
        });
        pending.set_seq(seq);
        Ok(pending)
    }
}

/// A started call's error names its operation with its sequence number.
fn relabel(e: Error, label: &WorkLabel) -> Error {
    if e.op() == Some(label.op.name()) {
        e.replace_op(label.name())
    } else {
        e
    }
}

impl<E: Engine> Group<E> {
    /// A blocking call: admitted, then run by the caller in its turn.
    fn blocking(&self, mut call: CallMut<'_>) -> Result<()> {
        let admitted = self.admit_call(&mut call)?;
        let t = match &admitted {
            Admitted::Done => return Ok(()),
            Admitted::RecvSelf => None,
            Admitted::Collective(_) => Some(self.admit(true)),
            Admitted::P2p => Some(self.admit(false)),
        };
        if let (Some(t), Some(r)) = (t, &self.core.recorder) {
            r.issued(t.n, t.seq, &call.info(), false);
        }
        let _pass = t.map(|t| self.core.turn.take(t.n));
        self.core.execute(t, &admitted, call)
    }

    /// The checks of `call` that need no communication (poison,
    /// capabilities, devices, lengths, roots and peers), in the order the
    /// errors are reported; a host send to self is posted here.
    fn admit_call(&self, call: &mut CallMut<'_>) -> Result<Admitted> {
        let me = self.core.info.rank;
        let collective = |shape: Shape| Ok(Admitted::Collective(shape));
        match call {
            CallMut::AllReduce { buf, op } => {
                let o = Op::AllReduce;
                self.enter(o, buf.dtype(), Some(*op), buf.device())?;
                collective(Shape::new(o, buf.dtype(), buf.len()).reduce(*op))
            }
            CallMut::Reduce { buf, op, root } => {
                let o = Op::Reduce;
                self.enter(o, buf.dtype(), Some(*op), buf.device())?;
                validate::rank_in_group(self, o, "root", *root)?;
                collective(
                    Shape::new(o, buf.dtype(), buf.len())
                        .reduce(*op)
                        .root(*root),
                )
            }
            CallMut::Broadcast { buf, root } => {
                let o = Op::Broadcast;
                self.enter(o, buf.dtype(), None, buf.device())?;
                validate::rank_in_group(self, o, "root", *root)?;
                collective(Shape::new(o, buf.dtype(), buf.len()).root(*root))
            }
            CallMut::AllGather { send, recv } => {
                let o = Op::AllGather;
                self.enter_chunked(o, None, send, recv, true)?;
                collective(Shape::new(o, send.dtype(), send.len()))
            }
            CallMut::Gather { send, recv, root } => {
                let o = Op::Gather;
                self.enter(o, send.dtype(), None, send.device())?;
                let r = validate::gather(self, send, recv.as_mut().map(|r| r.reborrow()), *root)?;
                if let Some(r) = &r {
                    self.same_place(o, send.device(), r.device())?;
                }
                collective(Shape::new(o, send.dtype(), send.len()).root(*root))
            }
            CallMut::Scatter { send, recv, root } => {
                let o = Op::Scatter;
                self.enter(o, recv.dtype(), None, recv.device())?;
                let s = validate::scatter(self, *send, recv, *root)?;
                if let Some(s) = &s {
                    self.same_place(o, s.device(), recv.device())?;
                }
                collective(Shape::new(o, recv.dtype(), recv.len()).root(*root))
            }
            CallMut::ReduceScatter { send, recv, op } => {
                let o = Op::ReduceScatter;
                self.enter_chunked(o, Some(*op), send, recv, false)?;
                collective(Shape::new(o, recv.dtype(), recv.len()).reduce(*op))
            }
            CallMut::AllToAll { send, recv } => {
                let o = Op::AllToAll;
                self.enter(o, send.dtype(), None, send.device())?;
                self.same_place(o, send.device(), recv.device())?;
                validate::all_to_all(self, send, recv)?;
                collective(Shape::new(o, send.dtype(), send.len()))
            }
            CallMut::Send { buf, dst, tag } => {
                let o = Op::Send;
                self.enter(o, buf.dtype(), None, buf.device())?;
                validate::rank_in_group(self, o, "destination", *dst)?;
                if let (true, Buf::Host(h)) = (*dst == me, &*buf) {
                    let bytes = h.bytes().to_vec();
                    self.core
                        .mailbox
                        .post(*dst, *tag, h.dtype(), bytes.len(), bytes);
                    return Ok(Admitted::Done);
                }
                Ok(Admitted::P2p)
            }
            CallMut::Recv { buf, src, .. } => {
                let o = Op::Recv;
                self.enter(o, buf.dtype(), None, buf.device())?;
                validate::rank_in_group(self, o, "source", *src)?;
                if *src == me && matches!(buf, BufMut::Host(_)) {
                    return Ok(Admitted::RecvSelf);
                }
                Ok(Admitted::P2p)
            }
            CallMut::Barrier => {
                let o = Op::Barrier;
                self.enter(o, DType::U8, None, Device::CPU)?;
                collective(Shape::new(o, DType::U8, 0))
            }
        }
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
        validate::lengths(self, op, small, big, self.core.info.world_size)
    }

    /// The poison and capability check for one call on `device`.
    fn enter(&self, op: Op, dtype: DType, reduce: Option<ReduceOp>, device: Device) -> Result<()> {
        self.core.check_poison(op)?;
        validate::call(self, op, dtype, reduce, device)?;
        if !device.is_cpu() && device != self.core.info.device {
            return Err(self.core.context(
                op,
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!(
                        "the buffer is on {device}, this communicator on {}",
                        self.core.info.device
                    ),
                )
                .with_fix("move the buffer to the communicator's device"),
            ));
        }
        Ok(())
    }

    /// Both buffers of a call live in the same place.
    fn same_place(&self, op: Op, a: Device, b: Device) -> Result<()> {
        if a != b {
            return Err(self.core.context(
                op,
                Error::new(
                    ErrorKind::InvalidArgument,
                    format!("the send buffer is on {a}, the receive buffer on {b}"),
                )
                .with_fix("pass both buffers on the same device"),
            ));
        }
        Ok(())
    }
}

impl<E: Engine> Core<E> {
    /// Run an admitted call: a receive from self through the mailbox, any
    /// other in its ticket's turn, which the caller holds.
    pub(crate) fn execute(
        &self,
        t: Option<Ticket>,
        admitted: &Admitted,
        call: CallMut<'_>,
    ) -> Result<()> {
        let op = call.info().op;
        match (admitted, call, t) {
            (Admitted::Done, ..) => Ok(()),
            (
                Admitted::RecvSelf,
                CallMut::Recv {
                    buf: BufMut::Host(h),
                    tag,
                    ..
                },
                _,
            ) => self.recv_self(h, tag),
            (Admitted::Collective(shape), call, Some(t)) => {
                self.run_turn(t, op, Some(shape), |e, checked| {
                    self.engine_call(e, checked, call)
                })
            }
            (Admitted::P2p, call, Some(t)) => {
                self.run_turn(t, op, None, |e, _| self.engine_call(e, false, call))
            }
            _ => Err(self.context(
                op,
                Error::internal(op.name(), "a call reached the executor unadmitted"),
            )),
        }
    }

    /// The engine's part of an admitted call, in its turn. Collectives that
    /// move no element never reach the engine (the call check, which ran,
    /// kept every rank in step); `checked` says the check ran.
    fn engine_call(&self, e: &E, checked: bool, call: CallMut<'_>) -> Result<()> {
        let me = self.info.rank;
        match call {
            CallMut::AllReduce { mut buf, op } => {
                if buf.is_empty() {
                    return Ok(());
                }
                let (native, divide) = self.native(op);
                e.all_reduce(buf.reborrow(), native)?;
                if divide {
                    self.divide(e, buf)?;
                }
                Ok(())
            }
            CallMut::Reduce { mut buf, op, root } => {
                if buf.is_empty() {
                    return Ok(());
                }
                let (native, divide) = self.native(op);
                e.reduce(buf.reborrow(), native, root)?;
                if divide && root == me {
                    self.divide(e, buf)?;
                }
                Ok(())
            }
            CallMut::Broadcast { buf, root } if !buf.is_empty() => e.broadcast(buf, root),
            CallMut::AllGather { send, recv } if !send.is_empty() => e.all_gather(send, recv),
            CallMut::Gather { send, recv, root } if !send.is_empty() => {
                e.gather(send, recv.filter(|_| me == root), root)
            }
            CallMut::Scatter { send, recv, root } if !recv.is_empty() => {
                e.scatter(send.filter(|_| me == root), recv, root)
            }
            CallMut::ReduceScatter { send, mut recv, op } if !recv.is_empty() => {
                let (native, divide) = self.native(op);
                e.reduce_scatter(send, recv.reborrow(), native)?;
                if divide {
                    self.divide(e, recv)?;
                }
                Ok(())
            }
            CallMut::AllToAll { send, recv } if !send.is_empty() => e.all_to_all(send, recv),
            CallMut::Send { buf, dst, tag } => e.send(buf, dst, tag),
            CallMut::Recv { buf, src, tag } => e.recv(buf, src, tag),
            CallMut::Barrier if !checked => e.barrier(),
            // An empty collective, or a barrier the call check already was.
            _ => Ok(()),
        }
    }
}
