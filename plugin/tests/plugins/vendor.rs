use std::sync::Arc;
use std::time::Duration;

use accel_api::{
    Backend, Buf, BufMut, Capabilities, Communicator, CommunicatorExt, ConnectContext, DType,
    Device, DeviceBufMut, DeviceKind, Element, ErrorKind, ProbeContext, ReduceOp,
};
use accel_plugin::{load_plugin, PluginBackend};
use accel_rendezvous::MemoryStore;

use crate::common::{err, with_plugins};

fn ctx(rank: usize, world_size: usize, timeout: Duration) -> ConnectContext {
    ConnectContext::local(rank, world_size, timeout, Arc::new(MemoryStore::new()))
        .with_run_id("vendor-test")
}

fn connect(path: &std::path::Path, timeout: Duration) -> Box<dyn Communicator> {
    load_plugin(path)
        .unwrap()
        .connect(ctx(0, 1, timeout))
        .unwrap()
}

#[test]
fn loads_with_name_version_priority_and_kind() {
    with_plugins(|p| {
        let b = PluginBackend::load(&p.vendor).unwrap();
        assert_eq!(b.name(), "vendor-single");
        assert_eq!(b.plugin_version(), env!("CARGO_PKG_VERSION"));
        assert_eq!(b.priority(), accel_api::kit::PRIORITY_FALLBACK - 1);
        assert_eq!(b.device_kind(), DeviceKind::Cpu);
        assert_eq!(b.abi_version(), (1, 1));
        assert_eq!(b.path(), p.vendor.as_path());
        let shown = format!("{b:?}");
        assert!(shown.contains("vendor-single"), "{shown}");
    });
}

#[test]
fn probe_crosses_with_reason_and_version() {
    with_plugins(|p| {
        let b = load_plugin(&p.vendor).unwrap();
        let ok = b.probe(&ProbeContext::single_process());
        assert!(ok.is_available(), "{ok:?}");
        assert_eq!(ok.device_count, 1);
        assert_eq!(
            ok.engine_version.as_deref(),
            Some(env!("CARGO_PKG_VERSION"))
        );
        let no = b.probe(&ProbeContext {
            world_size: 2,
            local_world_size: 2,
            mpi_launched: false,
            ranks_in_process: 1,
        });
        let reason = no.reason().unwrap();
        assert!(
            reason.contains("one process only, this run has 2"),
            "{reason}"
        );
        assert!(reason.contains(&*p.vendor.to_string_lossy()), "{reason}");
    });
}

#[test]
fn communicator_properties_cross() {
    with_plugins(|p| {
        let c = connect(&p.vendor, Duration::from_millis(750));
        assert_eq!(c.backend_name(), "vendor-single");
        assert_eq!(c.rank(), 0);
        assert_eq!(c.world_size(), 1);
        assert_eq!(c.device(), Device::CPU);
        assert_eq!(c.timeout(), Duration::from_millis(750));
        assert_eq!(c.capabilities(), &Capabilities::all_host());
    });
}

/// Every collective on one element type; world size 1 makes every result
/// exact.
fn every_collective<T: Element>(c: &dyn Communicator) {
    let data: Vec<T> = [1.0, -2.0, 3.0, 4.0]
        .iter()
        .map(|v| {
            T::from_f64(if T::DTYPE == DType::U8 {
                f64::abs(*v)
            } else {
                *v
            })
        })
        .collect();
    for op in ReduceOp::ALL {
        let mut v = data.clone();
        c.all_reduce_slice(&mut v, op).unwrap();
        assert_eq!(v, data, "all_reduce {op} {}", T::DTYPE);
        let mut v = data.clone();
        c.reduce(BufMut::from(&mut v[..]), op, 0).unwrap();
        assert_eq!(v, data, "reduce {op}");
        assert_eq!(c.reduce_scatter_vec(&data, op).unwrap(), data);
    }
    let mut v = data.clone();
    c.broadcast_slice(&mut v, 0).unwrap();
    assert_eq!(v, data);
    assert_eq!(c.all_gather_vec(&data).unwrap(), data);
    assert_eq!(c.gather_vec(&data, 0).unwrap(), Some(data.clone()));
    assert_eq!(c.scatter_vec(Some(&data), data.len(), 0).unwrap(), data);
    assert_eq!(c.all_to_all_vec(&data).unwrap(), data);
    c.send_slice(&data, 0, 3).unwrap();
    let mut got = vec![T::from_f64(0.0); data.len()];
    c.recv_slice(&mut got, 0, 3).unwrap();
    assert_eq!(got, data);
    // Empty buffers cross too.
    let empty: Vec<T> = Vec::new();
    assert_eq!(c.all_gather_vec(&empty).unwrap(), empty);
}

#[test]
fn every_collective_on_every_dtype_is_exact() {
    with_plugins(|p| {
        let c = connect(&p.vendor, Duration::from_secs(5));
        every_collective::<accel_api::f16>(&*c);
        every_collective::<accel_api::bf16>(&*c);
        every_collective::<f32>(&*c);
        every_collective::<f64>(&*c);
        every_collective::<i8>(&*c);
        every_collective::<u8>(&*c);
        every_collective::<i32>(&*c);
        every_collective::<i64>(&*c);
        c.barrier().unwrap();
    });
}

#[test]
fn split_gives_a_plugin_communicator_or_none() {
    with_plugins(|p| {
        let c = connect(&p.vendor, Duration::from_millis(600));
        let sub = c.split(Some(7), 0).unwrap().expect("color given");
        assert_eq!(sub.backend_name(), "vendor-single");
        assert_eq!(sub.world_size(), 1);
        assert_eq!(sub.timeout(), Duration::from_millis(600));
        assert_eq!(sub.all_reduce_vec(&[5i32], ReduceOp::Sum).unwrap(), vec![5]);
        assert!(c.split(None, 0).unwrap().is_none());
        drop(c);
        // The sub-group lives on its own handle.
        sub.barrier().unwrap();
    });
}

#[test]
fn a_communicator_is_shared_between_threads() {
    with_plugins(|p| {
        let c: Arc<dyn Communicator> = Arc::from(connect(&p.vendor, Duration::from_secs(5)));
        let threads: Vec<_> = (0..4)
            .map(|i| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        assert_eq!(c.all_gather_vec(&[i as i64]).unwrap(), vec![i as i64]);
                        let e = c.broadcast_slice(&mut [0u8], 9).unwrap_err();
                        assert!(e.to_string().contains("root 9"), "{e}");
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    });
}

#[test]
fn errors_cross_with_kind_and_text() {
    with_plugins(|p| {
        let c = connect(&p.vendor, Duration::from_millis(100));

        let e = c.broadcast_slice(&mut [1.0f32], 1).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::InvalidArgument), "{e:?}");
        assert_eq!(
            e.to_string(),
            "[vendor-single rank 0] broadcast: root 1 is not a rank of this group (world size 1)"
        );
        assert_eq!((e.rank(), e.op()), (Some(0), Some("broadcast")));

        let mut out = vec![0f64; 3];
        let e = c
            .all_gather(Buf::from(&[1.0f64, 2.0][..]), BufMut::from(&mut out))
            .unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::InvalidArgument), "{e:?}");
        assert!(e.to_string().contains("recv has 3 elements"), "{e}");

        let mut owner = [0f32; 4];
        // SAFETY: the view is never dereferenced: the host refuses it.
        let dev = unsafe {
            DeviceBufMut::from_raw(
                &mut owner,
                0x1000,
                4,
                DType::F32,
                Device::new(DeviceKind::Cuda, 1),
                0,
            )
        };
        let e = c.all_reduce(BufMut::from(dev), ReduceOp::Sum).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Unsupported), "{e:?}");
        assert!(e.to_string().contains("cuda memory is not accepted"), "{e}");

        let mut buf = [0u8; 2];
        let e = c.recv_slice(&mut buf, 0, 7).unwrap_err();
        assert_eq!(
            e.kind(),
            &ErrorKind::Timeout {
                after: Duration::from_millis(100)
            }
        );
        assert!(e.to_string().contains("no message with tag 7"), "{e}");
        assert_eq!(e.fix(), Some("send to self before receiving from self"));

        c.abort("the test gave up");
        let e = c.barrier().unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Poisoned), "{e:?}");
        assert!(e.to_string().contains("the test gave up"), "{e}");
    });
}

#[test]
fn connect_errors_cross() {
    with_plugins(|p| {
        let b = load_plugin(&p.vendor).unwrap();
        let e = err(b.connect(ctx(1, 2, Duration::from_secs(1))));
        assert!(matches!(e.kind(), ErrorKind::Unavailable), "{e:?}");
        assert!(
            e.to_string()
                .starts_with("[vendor-single rank 1] connect: "),
            "{e}"
        );
        assert!(e.fix().unwrap().contains("cpu-gloo"), "{e}");
    });
}
