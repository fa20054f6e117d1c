//! [`SingleEngine`]: the engine of a one-rank group. Every collective is
//! the identity or a copy; the group does the rest (checks, self-sends,
//! poisoning).

use std::time::Duration;

use accel_api::kit::{host, host_mut, Engine, EngineInfo, Group};
use accel_api::{Buf, BufMut, Capabilities, Device, DeviceKind, Op, ReduceOp, Result};

use crate::name::NAME;

/// The engine of a one-rank group.
#[derive(Debug, Clone)]
pub struct SingleEngine {
    info: EngineInfo,
}

/// The communicator of a one-rank group.
pub type SingleCommunicator = Group<SingleEngine>;

/// A one-rank communicator on `device` whose blocking calls (a receive from
/// self with no message) give up after `timeout`.
pub fn communicator(device: Device, timeout: Duration) -> SingleCommunicator {
    communicator_named(NAME, device, timeout)
}

/// As [`communicator`], reporting `name` as its backend (in
/// [`Communicator::backend_name`](accel_api::Communicator::backend_name) and
/// in every error): for plugins and tests that reuse this engine under
/// another name.
pub fn communicator_named(
    name: &'static str,
    device: Device,
    timeout: Duration,
) -> SingleCommunicator {
    Group::new(SingleEngine {
        info: EngineInfo {
            backend: name.to_string(),
            rank: 0,
            world_size: 1,
            device,
            timeout,
            capabilities: Capabilities::all_host().with_device_kinds([DeviceKind::Cpu]),
        },
    })
}

/// `recv` gets `send`'s bytes (the lengths were checked by the group).
fn copy(op: Op, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
    let src = host(op, send)?;
    let mut dst = host_mut(op, recv)?;
    dst.bytes_mut().copy_from_slice(src.bytes());
    Ok(())
}

impl Engine for SingleEngine {
    // One rank, no wire: a started call completes in the caller.
    const STARTS_INLINE: bool = true;

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// The reduction of one contribution is that contribution, for every op.
    fn all_reduce(&self, _buf: BufMut<'_>, _op: ReduceOp) -> Result<()> {
        Ok(())
    }

    fn reduce(&self, _buf: BufMut<'_>, _op: ReduceOp, _root: usize) -> Result<()> {
        Ok(())
    }

    fn broadcast(&self, _buf: BufMut<'_>, _root: usize) -> Result<()> {
        Ok(())
    }

    fn all_gather(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        copy(Op::AllGather, send, recv)
    }

    fn gather(&self, send: Buf<'_>, recv: Option<BufMut<'_>>, _root: usize) -> Result<()> {
        match recv {
            Some(r) => copy(Op::Gather, send, r),
            None => Ok(()),
        }
    }

    fn scatter(&self, send: Option<Buf<'_>>, recv: BufMut<'_>, _root: usize) -> Result<()> {
        match send {
            Some(s) => copy(Op::Scatter, s, recv),
            None => Ok(()),
        }
    }

    fn reduce_scatter(&self, send: Buf<'_>, recv: BufMut<'_>, _op: ReduceOp) -> Result<()> {
        copy(Op::ReduceScatter, send, recv)
    }

    fn all_to_all(&self, send: Buf<'_>, recv: BufMut<'_>) -> Result<()> {
        copy(Op::AllToAll, send, recv)
    }

    /// Never called for host memory (the group's mailbox takes sends to
    /// self) and device memory is not declared.
    fn send(&self, _buf: Buf<'_>, _dst: usize, _tag: u32) -> Result<()> {
        Err(accel_api::Error::internal(
            Op::Send.name(),
            "a one-rank group has no peer to send to",
        ))
    }

    fn recv(&self, _buf: BufMut<'_>, _src: usize, _tag: u32) -> Result<()> {
        Err(accel_api::Error::internal(
            Op::Recv.name(),
            "a one-rank group has no peer to receive from",
        ))
    }

    fn barrier(&self) -> Result<()> {
        Ok(())
    }

    fn split(&self, color: Option<u32>, _key: u32) -> Result<Option<Self>> {
        Ok(color.map(|_| self.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use accel_api::{Communicator, CommunicatorExt, ErrorKind};

    fn comm() -> SingleCommunicator {
        communicator(Device::CPU, Duration::from_millis(200))
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
