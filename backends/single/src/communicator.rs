use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use accel_api::{
    validate, Buf, BufMut, Capabilities, Communicator, Device, DeviceKind, Error, ErrorKind,
    HostBuf, HostBufMut, Op, ReduceOp, Result,
};

use crate::NAME;

/// The communicator of a one-rank group.
#[derive(Debug)]
pub struct SingleCommunicator {
    device: Device,
    timeout: Duration,
    caps: Capabilities,
    poisoned: Mutex<Option<String>>,
    /// Messages sent to self, by tag, waiting for their `recv`.
    mailbox: Mutex<HashMap<u32, VecDeque<Vec<u8>>>>,
    mail: Condvar,
}

impl SingleCommunicator {
    /// A one-rank group on `device` whose blocking calls give up after `timeout`.
    pub fn new(device: Device, timeout: Duration) -> SingleCommunicator {
        SingleCommunicator {
            device,
            timeout,
            caps: Capabilities::all_host().with_device_kinds([DeviceKind::Cpu]),
            poisoned: Mutex::new(None),
            mailbox: Mutex::new(HashMap::new()),
            mail: Condvar::new(),
        }
    }

    fn enter(
        &self,
        op: Op,
        dtype: accel_api::DType,
        reduce: Option<ReduceOp>,
        device: Device,
    ) -> Result<()> {
        if let Some(why) = self
            .poisoned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            return Err(Error::new(ErrorKind::Poisoned, why.clone())
                .with_backend(NAME)
                .with_rank(0)
                .with_op(op.name()));
        }
        validate::call(self, op, dtype, reduce, device)
    }

    fn host<'a>(&self, op: Op, b: Buf<'a>) -> Result<HostBuf<'a>> {
        b.host().ok_or_else(|| self.device_memory(op))
    }

    fn host_mut<'a>(&self, op: Op, b: BufMut<'a>) -> Result<HostBufMut<'a>> {
        b.into_host().ok_or_else(|| self.device_memory(op))
    }

    fn device_memory(&self, op: Op) -> Error {
        Error::unsupported(NAME, op.name(), "device memory is not accepted").with_rank(0)
    }

    fn copy(&self, op: Op, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.enter(op, send.dtype(), None, send.device())?;
        validate::lengths(
            self,
            op,
            ("send", send.dtype(), send.len()),
            ("recv", recv.dtype(), recv.len()),
            1,
        )?;
        let src = self.host(op, send)?;
        let mut dst = self.host_mut(op, recv)?;
        dst.bytes_mut().copy_from_slice(src.bytes());
        Ok(())
    }
}

impl Communicator for SingleCommunicator {
    fn backend_name(&self) -> &str {
        NAME
    }

    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
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
        // The reduction of one contribution is that contribution, for every
        // op, avg included (x / 1 == x).
        self.enter(Op::AllReduce, buf.dtype(), Some(op), buf.device())
    }

    fn reduce(&self, buf: BufMut<'_>, op: ReduceOp, root: usize) -> Result<()> {
        self.enter(Op::Reduce, buf.dtype(), Some(op), buf.device())?;
        validate::rank_in_group(self, Op::Reduce, "root", root)
    }

    fn broadcast(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.enter(Op::Broadcast, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, Op::Broadcast, "root", root)
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.copy(Op::AllGather, send, recv)
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, root: usize) -> Result<()> {
        self.enter(Op::Gather, send.dtype(), None, send.device())?;
        let recv = validate::gather(self, &send, recv, root)?.expect("rank 0 is the root");
        self.copy(Op::Gather, send, recv)
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, root: usize) -> Result<()> {
        self.enter(Op::Scatter, recv.dtype(), None, recv.device())?;
        let send = validate::scatter(self, send, &recv, root)?.expect("rank 0 is the root");
        self.copy(Op::Scatter, send, recv)
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, op: ReduceOp) -> Result<()> {
        self.enter(Op::ReduceScatter, send.dtype(), Some(op), send.device())?;
        self.copy(Op::ReduceScatter, send, recv)
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        self.copy(Op::AllToAll, send, recv)
    }

    fn send(&self, buf: Buf<'_>, dst: usize, tag: u32) -> Result<()> {
        self.enter(Op::Send, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, Op::Send, "destination", dst)?;
        let data = self.host(Op::Send, buf)?.bytes().to_vec();
        let mut mb = self.mailbox.lock().unwrap_or_else(|p| p.into_inner());
        mb.entry(tag).or_default().push_back(data);
        self.mail.notify_all();
        Ok(())
    }

    fn recv(&self, buf: BufMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.enter(Op::Recv, buf.dtype(), None, buf.device())?;
        validate::rank_in_group(self, Op::Recv, "source", src)?;
        let mut dst = self.host_mut(Op::Recv, buf)?;
        let deadline = Instant::now() + self.timeout;
        let mut mb = self.mailbox.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(msg) = mb.get_mut(&tag).and_then(|q| q.pop_front()) {
                if msg.len() != dst.bytes().len() {
                    return Err(Error::invalid_argument(
                        "recv",
                        format!(
                            "message with tag {tag} has {} bytes, the receive buffer {}",
                            msg.len(),
                            dst.bytes().len()
                        ),
                    )
                    .with_backend(NAME)
                    .with_rank(0));
                }
                dst.bytes_mut().copy_from_slice(&msg);
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(
                    "recv",
                    self.timeout,
                    format!("no message with tag {tag} was sent to self"),
                )
                .with_backend(NAME)
                .with_rank(0)
                .with_fix("send to self before receiving from self"));
            }
            mb = self
                .mail
                .wait_timeout(mb, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn barrier(&self) -> Result<()> {
        self.enter(Op::Barrier, accel_api::DType::U8, None, Device::CPU)
    }

    fn split(&self, color: Option<u32>, _key: u32) -> Result<Option<Box<dyn Communicator>>> {
        self.enter(Op::Split, accel_api::DType::U8, None, Device::CPU)?;
        Ok(color.map(|_| {
            Box::new(SingleCommunicator::new(self.device, self.timeout)) as Box<dyn Communicator>
        }))
    }

    fn abort(&self, reason: &str) {
        let mut p = self.poisoned.lock().unwrap_or_else(|p| p.into_inner());
        p.get_or_insert_with(|| format!("aborted: {reason}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::CommunicatorExt;

    fn comm() -> SingleCommunicator {
        SingleCommunicator::new(Device::CPU, Duration::from_millis(200))
    }

    #[test]
    fn collectives_are_exact() {
        let c = comm();
        let mut v = vec![1i32, -2, 3];
        for op in ReduceOp::ALL {
            c.all_reduce_slice(&mut v, op).unwrap();
            assert_eq!(v, vec![1, -2, 3], "{op}");
        }
        assert_eq!(c.all_gather_vec(&[1.5f64, 2.5]).unwrap(), vec![1.5, 2.5]);
        assert_eq!(c.gather_vec(&[7u8], 0).unwrap(), Some(vec![7]));
        assert_eq!(c.scatter_vec(Some(&[4i64, 5]), 2, 0).unwrap(), vec![4, 5]);
        assert_eq!(
            c.reduce_scatter_vec(&[1.0f32], ReduceOp::Sum).unwrap(),
            vec![1.0]
        );
        assert_eq!(c.all_to_all_vec(&[9i8, 8]).unwrap(), vec![9, 8]);
    }

    #[test]
    fn self_send_then_recv_and_timeout() {
        let c = comm();
        c.send_slice(&[1u8, 2, 3], 0, 7).unwrap();
        let mut out = [0u8; 3];
        c.recv_slice(&mut out, 0, 7).unwrap();
        assert_eq!(out, [1, 2, 3]);
        let e = c.recv_slice(&mut out, 0, 7).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("tag 7"), "{e}");
    }

    #[test]
    fn bad_arguments_are_named() {
        let c = comm();
        let e = c.broadcast_slice(&mut [1u8], 1).unwrap_err();
        assert!(e.to_string().contains("root 1"), "{e}");
        let mut out = vec![0f32; 3];
        let e = c
            .all_gather(Buf::from(&[1.0f32, 2.0][..]), BufMut::from(&mut out))
            .unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::InvalidArgument), "{e}");
        let e = c.send_slice(&[1u8], 3, 0).unwrap_err();
        assert!(e.to_string().contains("destination 3"), "{e}");
    }

    #[test]
    fn abort_poisons_every_later_call() {
        let c = comm();
        c.abort("test said so");
        let e = c.barrier().unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Poisoned));
        assert!(e.to_string().contains("test said so"), "{e}");
    }

    #[test]
    fn split_gives_single_or_none() {
        let c = comm();
        let sub = c.split(Some(3), 0).unwrap().unwrap();
        assert_eq!(sub.world_size(), 1);
        assert_eq!(sub.timeout(), c.timeout());
        assert!(c.split(None, 0).unwrap().is_none());
    }
}
