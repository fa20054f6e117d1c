//! Scenarios at world size 1 on cuda:0, shared by `gpu.rs` (a real GPU)
//! and `fake_device.rs` (a fake host-memory driver and NCCL: glue only).
//! Expected values come from the one contribution (world size 1: every
//! reduction is the identity, the average divides by 1); chained calls make
//! a wrong copy or a wrong offset show.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Buf, BufMut, Communicator, CommunicatorExt, ConnectContext, DType, Device, DeviceKind, Element,
    ErrorKind, HostBuf, ReduceOp, Store,
};
use accel_backend_cuda_nccl::__test::{connect, NcclCommunicator};
use accel_backend_cuda_nccl::DeviceBuffer;

pub const CUDA0: Device = Device::new(DeviceKind::Cuda, 0);

/// The world communicator of a one-rank run on cuda:0.
pub fn connect_one(timeout: Duration) -> NcclCommunicator {
    let store: Arc<dyn Store> = Arc::new(accel_rendezvous::MemoryStore::new());
    let ctx = ConnectContext::local(0, 1, timeout, store)
        .with_device(CUDA0)
        .with_run_id("one-rank");
    connect(ctx).expect("connect on cuda:0")
}

fn values<T: Element>(n: usize) -> Vec<T> {
    (0..n)
        .map(|i| T::from_f64(((i * 7) % 23) as f64 - 5.0))
        .collect()
}

fn all_reduce_is_identity<T: Element>(c: &NcclCommunicator) {
    let want: Vec<T> = if T::DTYPE == DType::U8 {
        (0..1000).map(|i| T::from_f64((i % 200) as f64)).collect()
    } else {
        values(1000)
    };
    for op in ReduceOp::ALL {
        let mut d = DeviceBuffer::from_slice(CUDA0, &want).unwrap();
        c.all_reduce(BufMut::Device(d.view_mut()), op).unwrap();
        assert_eq!(d.to_vec::<T>().unwrap(), want, "{} {op}", T::DTYPE);
    }
}

/// Every dtype and reduction on device memory.
pub fn every_dtype_and_reduction(c: &NcclCommunicator) {
    all_reduce_is_identity::<f32>(c);
    all_reduce_is_identity::<f64>(c);
    all_reduce_is_identity::<accel_api::f16>(c);
    all_reduce_is_identity::<accel_api::bf16>(c);
    all_reduce_is_identity::<i8>(c);
    all_reduce_is_identity::<u8>(c);
    all_reduce_is_identity::<i32>(c);
    all_reduce_is_identity::<i64>(c);
}

/// Broadcast, gathers, scatters, all_to_all, reduce, barrier, self send.
pub fn data_movement(c: &NcclCommunicator) {
    let v: Vec<f32> = values(4096);
    let src = DeviceBuffer::from_slice(CUDA0, &v).unwrap();

    let mut b = DeviceBuffer::from_slice(CUDA0, &v).unwrap();
    c.broadcast(BufMut::Device(b.view_mut()), 0).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), v, "broadcast");

    let mut r = DeviceBuffer::zeros(CUDA0, DType::F32, v.len()).unwrap();
    c.all_gather(Buf::Device(src.view()), BufMut::Device(r.view_mut()))
        .unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), v, "all_gather");

    let mut r = DeviceBuffer::zeros(CUDA0, DType::F32, v.len()).unwrap();
    c.reduce_scatter(
        Buf::Device(src.view()),
        BufMut::Device(r.view_mut()),
        ReduceOp::Sum,
    )
    .unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), v, "reduce_scatter");

    let mut r = DeviceBuffer::zeros(CUDA0, DType::F32, v.len()).unwrap();
    c.gather(
        Buf::Device(src.view()),
        Some(BufMut::Device(r.view_mut())),
        0,
    )
    .unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), v, "gather");

    let mut r = DeviceBuffer::zeros(CUDA0, DType::F32, v.len()).unwrap();
    c.scatter(
        Some(Buf::Device(src.view())),
        BufMut::Device(r.view_mut()),
        0,
    )
    .unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), v, "scatter");

    let mut r = DeviceBuffer::zeros(CUDA0, DType::F32, v.len()).unwrap();
    c.all_to_all(Buf::Device(src.view()), BufMut::Device(r.view_mut()))
        .unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), v, "all_to_all");

    let mut b = DeviceBuffer::from_slice(CUDA0, &v).unwrap();
    c.reduce(BufMut::Device(b.view_mut()), ReduceOp::Max, 0)
        .unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), v, "reduce");

    c.barrier().unwrap();

    // Device send to self, then a receive of the wrong size is refused
    // without poisoning.
    c.send(Buf::Device(src.view()), 0, 5).unwrap();
    let mut r = DeviceBuffer::zeros(CUDA0, DType::F32, v.len()).unwrap();
    c.recv(BufMut::Device(r.view_mut()), 0, 5).unwrap();
    assert_eq!(r.to_vec::<f32>().unwrap(), v, "send/recv to self");
    c.send(Buf::Device(src.view()), 0, 6).unwrap();
    let mut small = DeviceBuffer::zeros(CUDA0, DType::F32, 3).unwrap();
    let e = c.recv(BufMut::Device(small.view_mut()), 0, 6).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    c.barrier().unwrap();
}

/// Host buffers through staging.
pub fn host_buffers(c: &NcclCommunicator) {
    let v: Vec<i64> = values(3000);
    let mut h = v.clone();
    c.all_reduce_slice(&mut h, ReduceOp::Avg).unwrap();
    assert_eq!(h, v);
    assert_eq!(c.all_gather_vec(&v).unwrap(), v);
    let mut x = vec![0i64; v.len()];
    c.reduce_scatter(
        Buf::Host(HostBuf::from(&v[..])),
        BufMut::from(&mut x[..]),
        ReduceOp::Sum,
    )
    .unwrap();
    assert_eq!(x, v);
    let e = c
        .all_gather(Buf::Host(HostBuf::from(&v[..])), {
            // A receive buffer of the wrong length is refused.
            BufMut::from(&mut x[..1])
        })
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
}

/// Split, then abort poisons (call last: it poisons `c`).
pub fn split_and_abort(c: &NcclCommunicator) {
    let sub = c.split(Some(3), 0).unwrap().expect("color 3 gives a group");
    assert_eq!((sub.rank(), sub.world_size()), (0, 1));
    let mut v = vec![2.5f64; 17];
    sub.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v, vec![2.5; 17]);
    assert!(c.split(None, 0).unwrap().is_none());
    c.abort("test said so");
    let e = c.barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned, "{e}");
    assert!(e.to_string().contains("test said so"), "{e}");
}

/// Calls started without waiting on device buffers the handles own: the
/// buffers come back with the results, every handle done once the last
/// one is (issue order), a blocking call between them sees the earlier
/// ones' results.
pub fn started_calls(c: &NcclCommunicator) {
    use accel_api::StartExt;
    let host: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let bufs: Vec<DeviceBuffer> = (0..4)
        .map(|_| DeviceBuffer::from_slice(CUDA0, &host).unwrap())
        .collect();
    let mut works = Vec::new();
    for b in bufs {
        works.push(c.start_all_reduce(b, ReduceOp::Sum).unwrap());
    }
    let last = works.pop().unwrap().wait().unwrap();
    assert!(works.iter().all(|w| w.is_done()), "issue order");
    assert_eq!(
        last.to_vec::<f32>().unwrap(),
        host,
        "world size 1: the sum is the input"
    );
    for w in works {
        assert_eq!(w.wait().unwrap().to_vec::<f32>().unwrap(), host);
    }
    let b = DeviceBuffer::from_slice(CUDA0, &host).unwrap();
    let w = c.start_broadcast(b, 0).unwrap();
    c.barrier().unwrap();
    assert!(
        w.is_done(),
        "a blocking call returns after the call started before it"
    );
    assert_eq!(w.wait().unwrap().to_vec::<f32>().unwrap(), host);
}

/// cudarc's own slices as device views (all_reduce in place, all_gather).
pub fn cudarc_slices(c: &NcclCommunicator) {
    use accel_backend_cuda_nccl::cudarc::driver::CudaContext;
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let host: Vec<f32> = (0..300).map(|i| i as f32 * 0.5).collect();
    let mut a = stream.clone_htod(&host).unwrap();
    let mut b = stream.alloc_zeros::<f32>(host.len()).unwrap();
    c.all_reduce(
        accel_api::BufMut::Device(accel_backend_cuda_nccl::cudarc_view_mut(&mut a)),
        ReduceOp::Max,
    )
    .unwrap();
    c.all_gather(
        accel_api::Buf::Device(accel_backend_cuda_nccl::cudarc_view(&a)),
        accel_api::BufMut::Device(accel_backend_cuda_nccl::cudarc_view_mut(&mut b)),
    )
    .unwrap();
    assert_eq!(stream.clone_dtoh(&b).unwrap(), host);
    let view = accel_backend_cuda_nccl::cudarc_view(&a);
    assert_eq!((view.len(), view.dtype()), (300, accel_api::DType::F32));
    assert_eq!(view.device(), CUDA0);
}
