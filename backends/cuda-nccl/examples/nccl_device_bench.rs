//! Host<->device bandwidth and cuda-nccl collectives on device buffers at
//! world size 1, on cuda:0: the GPU check's measurements that `accel bench`
//! (host buffers, staged) cannot make. One JSON object per line on stdout.
//!
//! ```text
//! cargo run --release -p accel-backend-cuda-nccl --example nccl_device_bench -- [MAX_BYTES]
//! ```
//!
//! Each size: 3 warm-up calls, then the median of 10 timed calls. Copies
//! are pageable host memory (`Vec`), as the staging path uses. Exits 2 with
//! the probe's reason when no GPU is usable.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accel_api::{
    Buf, BufMut, Communicator, ConnectContext, DType, Device, DeviceKind, HostBuf, HostBufMut,
    ReduceOp, Store,
};
use accel_backend_cuda_nccl::__test::connect;
use accel_backend_cuda_nccl::{inspect, DeviceBuffer};

const ITERS: usize = 10;

fn median_us(mut f: impl FnMut() -> accel_api::Result<()>) -> accel_api::Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut t: Vec<f64> = (0..ITERS)
        .map(|_| {
            let s = Instant::now();
            f().map(|()| s.elapsed().as_secs_f64() * 1e6)
        })
        .collect::<accel_api::Result<_>>()?;
    t.sort_by(f64::total_cmp);
    Ok(t[ITERS / 2])
}

fn main() -> ExitCode {
    let max: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(256 << 20);
    let report = inspect();
    if let Some(why) = &report.unavailable {
        eprintln!("cuda-nccl unavailable: {why}");
        return ExitCode::from(2);
    }
    println!(
        "{}",
        serde_json::json!({"probe": {"devices": report.devices, "version": report.version_line()}})
    );
    match run(max) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nccl_device_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(max: usize) -> accel_api::Result<()> {
    let dev = Device::new(DeviceKind::Cuda, 0);
    let store: Arc<dyn Store> = Arc::new(accel_rendezvous::MemoryStore::new());
    let comm = connect(
        ConnectContext::local(0, 1, Duration::from_secs(60), store)
            .with_device(dev)
            .with_run_id("device-bench"),
    )?;
    let mut bytes = 4096usize;
    while bytes <= max {
        let n = bytes / 4;
        let host = vec![1.0f32; n];
        let mut back = vec![0.0f32; n];
        let mut d = DeviceBuffer::zeros(dev, DType::F32, n)?;
        let h2d = median_us(|| d.upload(HostBuf::from(&host[..])))?;
        let d2h = median_us(|| d.download(HostBufMut::from(&mut back[..])))?;
        let ar = median_us(|| comm.all_reduce(BufMut::Device(d.view_mut()), ReduceOp::Sum))?;
        let mut r = DeviceBuffer::zeros(dev, DType::F32, n)?;
        let ag =
            median_us(|| comm.all_gather(Buf::Device(d.view()), BufMut::Device(r.view_mut())))?;
        let mut h = vec![1.0f32; n];
        let staged = median_us(|| {
            comm.all_reduce(BufMut::Host(HostBufMut::from(&mut h[..])), ReduceOp::Sum)
        })?;
        let gbs = |us: f64| bytes as f64 / us / 1e3;
        println!(
            "{}",
            serde_json::json!({
                "bytes": bytes,
                "h2d_us": h2d, "h2d_GBps": gbs(h2d),
                "d2h_us": d2h, "d2h_GBps": gbs(d2h),
                "all_reduce_device_us": ar,
                "all_gather_device_us": ag,
                "all_reduce_host_staged_us": staged,
            })
        );
        bytes *= 4;
    }
    comm.barrier()
}
