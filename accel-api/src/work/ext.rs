//! [`StartExt`]: the typed forms of [`Communicator::start`].

use super::call::{back, Call, Owned, OwnedBuf};
use super::pending::Work;
use crate::{Communicator, ReduceOp, Result};

/// The typed forms of [`Communicator::start`], for every communicator:
/// each takes ownership of its buffers and returns a [`Work`] whose
/// [`wait`](Work::wait) gives them back. Requirements and errors are those
/// of the blocking method of the same name; errors that need no
/// communication come at once, the others from `wait`.
pub trait StartExt: Communicator {
    /// [`Communicator::all_reduce`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_all_reduce<B: OwnedBuf>(&self, buf: B, op: ReduceOp) -> Result<Work<B>> {
        let p = self.start(Call::AllReduce {
            buf: Box::new(buf),
            op,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::AllReduce { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::reduce`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_reduce<B: OwnedBuf>(&self, buf: B, op: ReduceOp, root: usize) -> Result<Work<B>> {
        let p = self.start(Call::Reduce {
            buf: Box::new(buf),
            op,
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Reduce { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::broadcast`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_broadcast<B: OwnedBuf>(&self, buf: B, root: usize) -> Result<Work<B>> {
        let p = self.start(Call::Broadcast {
            buf: Box::new(buf),
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Broadcast { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::all_gather`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_all_gather<S: OwnedBuf, R: OwnedBuf>(&self, send: S, recv: R) -> Result<Work<(S, R)>> {
        let p = self.start(Call::AllGather {
            send: Box::new(send),
            recv: Box::new(recv),
        })?;
        Ok(Work::new(p, |c| match c {
            Call::AllGather { send, recv } => Some((back(send)?, back(recv)?)),
            _ => None,
        }))
    }

    /// [`Communicator::gather`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_gather<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: S,
        recv: Option<R>,
        root: usize,
    ) -> Result<Work<(S, Option<R>)>> {
        let p = self.start(Call::Gather {
            send: Box::new(send),
            recv: recv.map(|r| Box::new(r) as Owned),
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Gather { send, recv, .. } => {
                let recv = match recv {
                    Some(r) => Some(back(r)?),
                    None => None,
                };
                Some((back(send)?, recv))
            }
            _ => None,
        }))
    }

    /// [`Communicator::scatter`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_scatter<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: Option<S>,
        recv: R,
        root: usize,
    ) -> Result<Work<(Option<S>, R)>> {
        let p = self.start(Call::Scatter {
            send: send.map(|s| Box::new(s) as Owned),
            recv: Box::new(recv),
            root,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Scatter { send, recv, .. } => {
                let send = match send {
                    Some(s) => Some(back(s)?),
                    None => None,
                };
                Some((send, back(recv)?))
            }
            _ => None,
        }))
    }

    /// [`Communicator::reduce_scatter`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_reduce_scatter<S: OwnedBuf, R: OwnedBuf>(
        &self,
        send: S,
        recv: R,
        op: ReduceOp,
    ) -> Result<Work<(S, R)>> {
        let p = self.start(Call::ReduceScatter {
            send: Box::new(send),
            recv: Box::new(recv),
            op,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::ReduceScatter { send, recv, .. } => Some((back(send)?, back(recv)?)),
            _ => None,
        }))
    }

    /// [`Communicator::all_to_all`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_all_to_all<S: OwnedBuf, R: OwnedBuf>(&self, send: S, recv: R) -> Result<Work<(S, R)>> {
        let p = self.start(Call::AllToAll {
            send: Box::new(send),
            recv: Box::new(recv),
        })?;
        Ok(Work::new(p, |c| match c {
            Call::AllToAll { send, recv } => Some((back(send)?, back(recv)?)),
            _ => None,
        }))
    }

    /// [`Communicator::send`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_send<B: OwnedBuf>(&self, buf: B, dst: usize, tag: u32) -> Result<Work<B>> {
        let p = self.start(Call::Send {
            buf: Box::new(buf),
            dst,
            tag,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Send { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::recv`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_recv<B: OwnedBuf>(&self, buf: B, src: usize, tag: u32) -> Result<Work<B>> {
        let p = self.start(Call::Recv {
            buf: Box::new(buf),
            src,
            tag,
        })?;
        Ok(Work::new(p, |c| match c {
            Call::Recv { buf, .. } => back(buf),
            _ => None,
        }))
    }

    /// [`Communicator::barrier`] without waiting.
    ///
    /// # Errors
    /// As [`Communicator::start`].
    fn start_barrier(&self) -> Result<Work<()>> {
        let p = self.start(Call::Barrier)?;
        Ok(Work::new(p, |c| match c {
            Call::Barrier => Some(()),
            _ => None,
        }))
    }
}

impl<C: Communicator + ?Sized> StartExt for C {}
