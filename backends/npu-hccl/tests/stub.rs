//! Glue tests of the npu-hccl backend against stub AscendCL and HCCL
//! libraries that this test compiles from `tests/stub/*.c` with the system
//! C compiler (`cc`, or `$CC`) into temporary folders.
//!
//! The stubs are a one-rank "HCCL" that copies on host memory posing as
//! device memory (plus in-process send/recv queues for two ranks on
//! threads). These tests check the probe's failure paths and the backend's
//! own code (argument codes, staging, headers, timeouts, poisoning); they
//! never count as the backend working on Ascend hardware.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use accel_api::kit::Engine;
use accel_api::{
    Backend, Buf, BufMut, Communicator, CommunicatorExt, ConnectContext, DType, Device, DeviceKind,
    ErrorKind, ProbeContext, ReduceOp, Store,
};
use accel_backend_npu_hccl::{NpuCommunicator, NpuHcclBackend};
use accel_rendezvous::MemoryStore;
use half::{bf16, f16};
use tempfile::TempDir;

/// Stub libraries in a temporary folder.
struct Stub {
    dir: TempDir,
}

fn compile(src: &str, out: &Path, defines: &[&str]) {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/stub")
        .join(src);
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O0", "-pthread", "-o"])
        .arg(out)
        .arg(&src)
        .args(defines)
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run the C compiler `{cc}` ({e}): install gcc or set CC")
        });
    assert!(status.success(), "`{cc}` failed on {}", src.display());
}

impl Stub {
    fn build(acl_defines: &[&str], hccl: bool) -> Stub {
        let dir = tempfile::tempdir().unwrap();
        compile("acl.c", &dir.path().join("libascendcl.so"), acl_defines);
        if hccl {
            compile("hccl.c", &dir.path().join("libhccl.so"), &[]);
        }
        Stub { dir }
    }

    fn ok() -> Stub {
        Stub::build(&[], true)
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    fn backend(&self) -> NpuHcclBackend {
        NpuHcclBackend::with_lib_dir(self.path())
    }

    /// The stubs' test knobs (same handles as the backend's: dlopen of the
    /// same path returns the loaded library).
    fn knobs(&self) -> Knobs {
        Knobs {
            acl: open(&self.path().join("libascendcl.so")),
            hccl: open(&self.path().join("libhccl.so")),
        }
    }
}

fn open(p: &Path) -> libloading::Library {
    // SAFETY: the stub libraries' initialisers do nothing.
    unsafe { libloading::Library::new(p) }.unwrap()
}

struct Knobs {
    acl: libloading::Library,
    hccl: libloading::Library,
}

type SetFn = unsafe extern "C" fn(*const std::ffi::c_char, i32) -> i32;
type GetFn = unsafe extern "C" fn(*const std::ffi::c_char) -> i64;
type CountFn = unsafe extern "C" fn() -> i64;

impl Knobs {
    fn set(lib: &libloading::Library, sym: &[u8], what: &str, v: i32) {
        let what = std::ffi::CString::new(what).unwrap();
        // SAFETY: the stubs export these with exactly this prototype.
        unsafe {
            let f = lib.get::<SetFn>(sym).unwrap();
            assert!(f(what.as_ptr(), v) >= 0, "unknown knob {what:?}");
        }
    }

    fn acl(&self, what: &str, v: i32) {
        Knobs::set(&self.acl, b"stub_acl_set\0", what, v);
    }

    fn hccl(&self, what: &str, v: i32) {
        Knobs::set(&self.hccl, b"stub_hccl_set\0", what, v);
    }

    fn count(lib: &libloading::Library, sym: &[u8]) -> i64 {
        // SAFETY: the stubs export these with exactly this prototype.
        unsafe { lib.get::<CountFn>(sym).unwrap()() }
    }

    fn calls(&self) -> i64 {
        Knobs::count(&self.hccl, b"stub_hccl_calls\0")
    }

    fn live_allocs(&self) -> i64 {
        Knobs::count(&self.acl, b"stub_acl_live_allocs\0")
    }

    fn set_device_calls(&self) -> i64 {
        Knobs::count(&self.acl, b"stub_acl_set_device_calls\0")
    }

    fn last(&self, what: &str) -> i64 {
        let what = std::ffi::CString::new(what).unwrap();
        // SAFETY: the stub exports this with exactly this prototype.
        unsafe { self.hccl.get::<GetFn>(b"stub_hccl_last\0").unwrap()(what.as_ptr()) }
    }
}

fn probe_ctx(local: usize) -> ProbeContext {
    ProbeContext {
        world_size: local,
        local_world_size: local,
        mpi_launched: false,
        ranks_in_process: 1,
    }
}

fn ctx(store: Arc<dyn Store>, rank: usize, world: usize, timeout: Duration) -> ConnectContext {
    ConnectContext {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        device: Device::new(DeviceKind::Npu, rank as u32),
        timeout,
        store,
        run_id: "stub".into(),
    }
}

fn connect(stub: &Stub, timeout: Duration) -> NpuCommunicator {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    stub.backend()
        .connect_npu(ctx(store, 0, 1, timeout))
        .unwrap()
}

/// Fresh stubs, their knobs, and a one-rank communicator over them (5 s
/// timeout). Bind the stubs (`_stub`) for the whole test: dropping them
/// removes the libraries' folder.
fn one_rank() -> (Stub, Knobs, NpuCommunicator) {
    let stub = Stub::ok();
    let k = stub.knobs();
    let c = connect(&stub, Duration::from_secs(5));
    (stub, k, c)
}

/// A one-element f32 sum: the smallest call that reaches HCCL.
fn sum_one(c: &NpuCommunicator) -> accel_api::Result<()> {
    c.all_reduce_slice(&mut [1.0f32], ReduceOp::Sum)
}

fn reason(stub_dir: &Path) -> String {
    NpuHcclBackend::with_lib_dir(stub_dir)
        .probe(&probe_ctx(1))
        .reason()
        .expect("unavailable")
        .to_string()
}

/// The probe's reason over both stubs, ACL built with `acl_defines`.
fn reason_with(acl_defines: &[&str]) -> String {
    let stub = Stub::build(acl_defines, true);
    reason(stub.path())
}

#[test]
fn probe_names_a_missing_ascendcl() {
    let dir = tempfile::tempdir().unwrap();
    let r = reason(dir.path());
    assert!(r.starts_with("libascendcl.so not found"), "{r}");
    assert!(r.contains(&dir.path().display().to_string()), "{r}");
}

#[test]
fn probe_names_a_missing_hccl() {
    let stub = Stub::build(&[], false);
    let r = reason(stub.path());
    assert!(r.starts_with("libhccl.so not found"), "{r}");
}

#[test]
fn probe_names_a_library_that_does_not_load() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("libascendcl.so"), b"not an ELF file").unwrap();
    let r = reason(dir.path());
    assert!(
        r.contains("libascendcl.so exists but failed to load"),
        "{r}"
    );
}

#[test]
fn probe_names_a_missing_symbol() {
    let r = reason_with(&["-DSTUB_NO_STREAM_QUERY"]);
    assert!(
        r.starts_with("symbol `aclrtStreamQuery` not found in "),
        "{r}"
    );
    assert!(r.contains("libascendcl.so"), "{r}");
}

#[test]
fn probe_reports_an_init_failure() {
    let r = reason_with(&["-DSTUB_INIT_RC=507033"]);
    assert!(r.starts_with("aclInit failed: aclError 507033"), "{r}");
    assert!(
        r.contains("built to fail"),
        "ACL's own message is kept: {r}"
    );
}

#[test]
fn already_initialised_acl_is_not_a_failure() {
    let stub = Stub::build(&["-DSTUB_INIT_RC=100002"], true);
    let p = stub.backend().probe(&probe_ctx(1));
    assert!(p.is_available(), "{p:?}");
}

#[test]
fn probe_reports_zero_devices() {
    let r = reason_with(&["-DSTUB_DEVICES=0"]);
    assert!(r.starts_with("no Ascend NPU visible"), "{r}");
    assert!(r.contains("aclrtGetDeviceCount reports 0"), "{r}");
}

#[test]
fn probe_counts_devices_and_refuses_oversubscription() {
    let stub = Stub::build(&["-DSTUB_DEVICES=2"], true);
    let b = stub.backend();
    let p = b.probe(&probe_ctx(2));
    assert!(p.is_available(), "{p:?}");
    assert_eq!(p.device_count, 2);
    assert!(p
        .engine_version
        .as_deref()
        .unwrap()
        .starts_with("AscendCL 1.0.0"));
    let p = b.probe(&probe_ctx(3));
    assert!(p.reason().unwrap().contains("one NPU per rank"), "{p:?}");
    assert_eq!(b.name(), "npu-hccl");
    assert_eq!(b.device_kind(), DeviceKind::Npu);
}

#[test]
fn connect_refuses_devices_it_cannot_drive() {
    let stub = Stub::ok();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let mut c = ctx(store.clone(), 0, 1, Duration::from_secs(1));
    c.device = Device::CPU;
    let e = stub.backend().connect_npu(c.clone()).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig);
    assert!(
        e.to_string().starts_with("[npu-hccl rank 0] connect: "),
        "{e}"
    );
    c.device = Device::new(DeviceKind::Npu, 5);
    let e = stub.backend().connect_npu(c).unwrap_err();
    assert!(
        e.to_string()
            .contains("npu:5 is not one of the 2 visible NPUs"),
        "{e}"
    );
    let e = NpuHcclBackend::with_lib_dir("/nonexistent-accel")
        .connect_npu(ctx(store, 0, 1, Duration::from_secs(1)))
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unavailable);
}

#[test]
fn one_rank_collectives_on_host_memory_pass_hccl_codes() {
    let (_stub, k, c) = one_rank();
    let base_allocs = k.live_allocs();
    assert_eq!(c.backend_name(), "npu-hccl");
    assert_eq!(c.device(), Device::new(DeviceKind::Npu, 0));

    let mut v = vec![1.5f32, -2.0, 3.25];
    c.all_reduce_slice(&mut v, ReduceOp::Max).unwrap();
    assert_eq!(v, vec![1.5, -2.0, 3.25]);
    assert_eq!((k.last("dtype"), k.last("op"), k.last("count")), (4, 2, 3));

    let mut h = vec![bf16::from_f32(2.0); 4];
    c.all_reduce_slice(&mut h, ReduceOp::Min).unwrap();
    assert_eq!(h, vec![bf16::from_f32(2.0); 4]);
    assert_eq!((k.last("dtype"), k.last("op")), (11, 3));

    let mut i = vec![7i32, -7];
    c.all_reduce_slice(&mut i, ReduceOp::Avg).unwrap();
    assert_eq!(i, vec![7, -7], "avg over one rank: sum then divide by 1");
    assert_eq!(
        (k.last("dtype"), k.last("op")),
        (2, 0),
        "avg asks HCCL for a sum"
    );

    let mut f = [f16::from_f32(1.0); 2];
    c.reduce(BufMut::from(&mut f[..]), ReduceOp::Prod, 0)
        .unwrap();
    assert_eq!((k.last("dtype"), k.last("op"), k.last("root")), (3, 1, 0));

    // Data movement goes as bytes (INT8), for every element type.
    let mut d = vec![1.0f64, 2.0];
    c.broadcast_slice(&mut d, 0).unwrap();
    assert_eq!(d, vec![1.0, 2.0]);
    assert_eq!((k.last("dtype"), k.last("count")), (0, 16));
    assert_eq!(c.all_gather_vec(&[5i64, 6]).unwrap(), vec![5, 6]);
    assert_eq!(c.gather_vec(&[9u8, 8, 7], 0).unwrap(), Some(vec![9, 8, 7]));
    assert_eq!(c.scatter_vec(Some(&[4i8, 3]), 2, 0).unwrap(), vec![4, 3]);
    assert_eq!(c.all_to_all_vec(&[1u8, 2, 3]).unwrap(), vec![1, 2, 3]);
    assert_eq!(
        c.reduce_scatter_vec(&[2.0f32, 4.0], ReduceOp::Sum).unwrap(),
        vec![2.0, 4.0]
    );
    assert_eq!((k.last("dtype"), k.last("count")), (4, 2));
    c.barrier().unwrap();
    assert_eq!(k.live_allocs(), base_allocs, "staging memory is freed");
}

#[test]
fn hccl_timeouts_are_derived_unless_the_user_set_them() {
    let user = (
        std::env::var_os("HCCL_CONNECT_TIMEOUT"),
        std::env::var_os("HCCL_EXEC_TIMEOUT"),
    );
    let stub = Stub::ok();
    let _c = connect(&stub, Duration::from_secs(5));
    // Every test here connects with at most 5 s, whose derived values are
    // HCCL's minimums, whichever test's connect came first.
    let (connect_s, exec_s) = accel_backend_npu_hccl::__test::hccl_timeouts(Duration::from_secs(5));
    let now = |v: &str| std::env::var(v).unwrap();
    if user.0.is_none() {
        assert_eq!(now("HCCL_CONNECT_TIMEOUT"), connect_s.to_string());
    }
    match &user.1 {
        None => assert_eq!(now("HCCL_EXEC_TIMEOUT"), exec_s.to_string()),
        Some(v) => assert_eq!(
            std::env::var_os("HCCL_EXEC_TIMEOUT").as_ref(),
            Some(v),
            "kept"
        ),
    }
}

#[test]
fn each_calling_thread_binds_the_device_once() {
    let (_stub, k, c) = one_rank();
    c.barrier().unwrap();
    let bound = k.set_device_calls();
    sum_one(&c).unwrap();
    assert_eq!(k.set_device_calls(), bound, "this thread is bound already");
    std::thread::scope(|s| {
        s.spawn(|| {
            sum_one(&c).unwrap();
            c.barrier().unwrap();
        });
    });
    assert_eq!(
        k.set_device_calls(),
        bound + 1,
        "a new thread binds before its first call"
    );
}

#[test]
fn undeclared_and_empty_calls_never_reach_hccl() {
    let (_stub, k, c) = one_rank();
    let before = k.calls();
    let e = c
        .all_reduce_slice(&mut [1.0f64], ReduceOp::Sum)
        .unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
    let e = c.broadcast_slice(&mut [1u8], 1).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    c.all_reduce_slice::<f32>(&mut [], ReduceOp::Sum).unwrap();
    assert_eq!(k.calls(), before);
    assert!(c.poison_text().is_none());
    let caps = c.capabilities();
    assert!(!caps.reduce_dtypes.contains(&DType::F64));
    assert!(caps.reduce_ops.contains(&ReduceOp::Avg));
}

#[test]
fn device_buffers_are_used_in_place_and_divided_on_avg() {
    let stub = Stub::ok();
    let c = connect(&stub, Duration::from_secs(5));
    let e = c.engine();
    let mut buf = e.upload(&[8.0f32, -4.0, 2.0]).unwrap();
    c.all_reduce(BufMut::from(buf.view_mut()), ReduceOp::Avg)
        .unwrap();
    assert_eq!(e.download::<f32>(&buf).unwrap(), vec![8.0, -4.0, 2.0]);
    // The device half of avg, at a group size the stub cannot have.
    e.divide_device(buf.view_mut(), 4).unwrap();
    assert_eq!(e.download::<f32>(&buf).unwrap(), vec![2.0, -1.0, 0.5]);
    let mut ints = e.upload(&[-7i32, 7]).unwrap();
    e.divide_device(ints.view_mut(), 2).unwrap();
    assert_eq!(
        e.download::<i32>(&ints).unwrap(),
        vec![-3, 3],
        "truncates like the host"
    );

    let src = e.upload(&[1u8, 2, 3]).unwrap();
    let mut dst = e.alloc(DType::U8, 3).unwrap();
    c.all_gather(Buf::from(src.view()), BufMut::from(dst.view_mut()))
        .unwrap();
    assert_eq!(e.download::<u8>(&dst).unwrap(), vec![1, 2, 3]);
    assert!(e.download::<i8>(&dst).is_err(), "dtype checked on download");

    // Host and device buffers may not be mixed in one call.
    let mut host = [0u8; 3];
    let err = c
        .all_gather(Buf::from(src.view()), BufMut::from(&mut host[..]))
        .unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::InvalidArgument);
}

#[test]
fn device_sends_to_self_are_kept_and_checked() {
    let stub = Stub::ok();
    let c = connect(&stub, Duration::from_secs(5));
    let e = c.engine();
    let src = e.upload(&[1i64, 2]).unwrap();
    let mut dst = e.alloc(DType::I64, 2).unwrap();
    c.send(Buf::from(src.view()), 0, 3).unwrap();
    c.recv(BufMut::from(dst.view_mut()), 0, 3).unwrap();
    assert_eq!(e.download::<i64>(&dst).unwrap(), vec![1, 2]);
    c.send(Buf::from(src.view()), 0, 4).unwrap();
    let mut small = e.alloc(DType::I64, 1).unwrap();
    let err = c.recv(BufMut::from(small.view_mut()), 0, 4).unwrap_err();
    assert_eq!(err.kind(), &ErrorKind::InvalidArgument, "{err}");
    assert!(err.to_string().contains("the message was dropped"), "{err}");
    let err = c.recv(BufMut::from(dst.view_mut()), 0, 5).unwrap_err();
    assert!(err.to_string().contains("tag 5"), "{err}");
    assert!(c.poison_text().is_none(), "argument errors do not poison");
}

#[test]
fn hccl_failures_are_classified_and_poison() {
    let (_stub, k, c) = one_rank();
    k.hccl("fail_next", 5);
    let e = sum_one(&c).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
    assert!(
        e.to_string()
            .contains("HcclAllReduce failed: HCCL_E_NOT_SUPPORT (5): stub: not supported"),
        "{e}"
    );
    c.barrier().unwrap();
    k.hccl("fail_next", 4);
    let e = c.barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Backend, "{e}");
    assert!(
        e.to_string()
            .starts_with("[npu-hccl rank 0] barrier: HcclBarrier failed: HCCL_E_INTERNAL"),
        "{e}"
    );
    let e = c.barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned);
}

#[test]
fn started_calls_pass_hccl_codes_in_issue_order_and_fail_at_wait() {
    use accel_api::StartExt;
    let (_stub, k, c) = one_rank();
    let calls = k.calls();
    let works: Vec<_> = (0..4)
        .map(|i| {
            c.start_all_reduce(vec![i as f32, -1.5], ReduceOp::Max)
                .unwrap()
        })
        .collect();
    let b = c.start_broadcast(vec![3i64, 4], 0).unwrap();
    c.barrier().unwrap();
    assert!(
        works.iter().all(|w| w.is_done()) && b.is_done(),
        "a blocking call returns after the calls started before it"
    );
    for (i, w) in works.into_iter().enumerate() {
        assert_eq!(w.wait().unwrap(), vec![i as f32, -1.5]);
    }
    assert_eq!(b.wait().unwrap(), vec![3, 4]);
    assert!(k.calls() > calls, "the started calls reached HCCL");

    // A failure inside HCCL comes back from the handle, naming the call.
    k.hccl("fail_next", 4);
    let w = c.start_all_reduce(vec![1.0f32], ReduceOp::Sum).unwrap();
    let e = w.wait().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Backend, "{e}");
    assert!(e.to_string().contains("all_reduce"), "{e}");
    assert_eq!(c.barrier().unwrap_err().kind(), &ErrorKind::Poisoned);
}

#[test]
fn asynchronous_errors_are_lost_peers() {
    let (_stub, k, c) = one_rank();
    k.hccl("async_error", 13);
    let e = c.all_gather_vec(&[1u8]).unwrap_err();
    k.hccl("async_error", 0);
    assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: None }, "{e}");
    assert!(e.to_string().contains("HCCL_E_TCP_TRANSFER"), "{e}");
    assert_eq!(c.barrier().unwrap_err().kind(), &ErrorKind::Poisoned);
}

#[test]
fn a_stream_that_never_finishes_times_out() {
    let stub = Stub::ok();
    let k = stub.knobs();
    let timeout = Duration::from_millis(200);
    let c = connect(&stub, timeout);
    let before = k.live_allocs();
    k.acl("stream_busy", 1);
    let e = c
        .all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum)
        .unwrap_err();
    k.acl("stream_busy", 0);
    assert_eq!(e.kind(), &ErrorKind::Timeout { after: timeout }, "{e}");
    assert!(
        e.to_string().contains("HcclAllReduce did not complete"),
        "{e}"
    );
    assert_eq!(c.barrier().unwrap_err().kind(), &ErrorKind::Poisoned);
    assert_eq!(
        k.live_allocs(),
        before + 1,
        "the staging copy the device may still write is leaked, not freed"
    );
}

#[test]
fn allocation_failures_are_backend_errors() {
    let (_stub, k, c) = one_rank();
    k.acl("fail_malloc", 1);
    let e = sum_one(&c).unwrap_err();
    k.acl("fail_malloc", 0);
    assert_eq!(e.kind(), &ErrorKind::Backend);
    assert!(
        e.to_string()
            .contains("aclrtMalloc failed: aclError 207001: stub: out of device memory"),
        "{e}"
    );
}

#[test]
fn split_builds_sub_communicators_through_the_store() {
    let stub = Stub::ok();
    let c = connect(&stub, Duration::from_secs(5));
    let sub = c.split(Some(7), 0).unwrap().expect("a member");
    assert_eq!((sub.rank(), sub.world_size()), (0, 1));
    assert_eq!(sub.timeout(), c.timeout());
    assert_eq!(sub.all_gather_vec(&[3i32]).unwrap(), vec![3]);
    assert!(c.split(None, 0).unwrap().is_none());
}

fn two_ranks(stub: &Stub, timeout: Duration) -> (NpuCommunicator, NpuCommunicator) {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let b = stub.backend();
    let (s0, s1) = (store.clone(), store);
    let b1 = b.clone();
    // The stub runs no collective over two ranks, the call check's
    // all-gather included (ADR 0016): these groups go without it.
    let t = std::thread::spawn(move || {
        b1.connect_npu(ctx(s1, 1, 2, timeout))
            .unwrap()
            .without_call_check()
    });
    let c0 = b
        .connect_npu(ctx(s0, 0, 2, timeout))
        .unwrap()
        .without_call_check();
    (c0, t.join().unwrap())
}

#[test]
fn point_to_point_headers_match_tags_and_sizes() {
    let stub = Stub::ok();
    let (c0, c1) = two_ranks(&stub, Duration::from_secs(5));
    assert_eq!((c1.rank(), c1.world_size()), (1, 2));
    c0.send_slice(&[1.0f32, 2.0], 1, 1).unwrap();
    c0.send_slice(&[9u8], 1, 2).unwrap();
    let mut b = [0u8; 1];
    c1.recv_slice(&mut b, 0, 2).unwrap();
    assert_eq!(b, [9], "a later tag is found past an earlier message");
    let mut a = [0f32; 2];
    c1.recv_slice(&mut a, 0, 1).unwrap();
    assert_eq!(a, [1.0, 2.0], "the earlier message was kept");

    c0.send_slice(&[5i32, 6, 7], 1, 3).unwrap();
    let mut wrong = [0i32; 2];
    let e = c1.recv_slice(&mut wrong, 0, 3).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    assert!(
        e.to_string()
            .contains("rank 0 sent 3 i32 elements with tag 3"),
        "{e}"
    );
    assert_eq!(wrong, [0, 0], "nothing written");
    c0.send_slice::<u8>(&[], 1, 4).unwrap();
    c1.recv_slice::<u8>(&mut [], 0, 4).unwrap();
    assert!(c1.poison_text().is_none());
    // Collectives over two ranks are beyond the stub: it says so.
    let e = c0.barrier();
    assert!(
        e.is_ok(),
        "the stub's barrier does not check the group size"
    );
    let e = c0.all_gather_vec(&[1u8]).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
}

#[test]
fn two_rank_splits_follow_color_then_key() {
    let stub = Stub::ok();
    let (c0, c1) = two_ranks(&stub, Duration::from_secs(5));
    let run = |c: &NpuCommunicator| {
        let r = c.rank() as u32;
        // Own color each: two one-rank groups that can compute.
        let alone = c.split(Some(r), 0).unwrap().unwrap();
        let sum = alone
            .all_reduce_vec(&[r as i32 + 1], ReduceOp::Sum)
            .unwrap();
        // One color, keys reversed: new ranks swap.
        let both = c.split(Some(9), 1 - r).unwrap().unwrap();
        // Rank 1 opts out of the third split.
        let third = c.split((r == 0).then_some(4), 0).unwrap();
        (
            alone.world_size(),
            sum,
            both.rank(),
            both.world_size(),
            third.is_some(),
        )
    };
    let t = std::thread::scope(|s| {
        let h = s.spawn(|| run(&c1));
        (run(&c0), h.join().unwrap())
    });
    assert_eq!(t.0, (1, vec![1], 1, 2, true));
    assert_eq!(t.1, (1, vec![2], 0, 2, false));
}

#[test]
fn a_missing_rank_zero_times_out_naming_the_key() {
    let stub = Stub::ok();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let e = stub
        .backend()
        .connect_npu(ctx(store, 1, 2, Duration::from_millis(200)))
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("rank 0's HCCL root info"), "{e}");
    assert!(e.to_string().contains("npu-hccl/1/root"), "{e}");
}

#[test]
fn the_required_symbols_are_the_stubs_exports() {
    // Every symbol the backend resolves is defined by the stubs (and so
    // named in the docs' list): a symbol added to ffi.rs without a stub
    // fails here rather than on hardware.
    let (acl, hccl) = accel_backend_npu_hccl::__test::required_symbols();
    let stub = Stub::ok();
    for (file, syms) in [("libascendcl.so", acl), ("libhccl.so", hccl)] {
        let lib = open(&stub.path().join(file));
        for s in syms {
            let name = format!("{s}\0");
            // SAFETY: only the symbol's presence is checked.
            let found = unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_ok();
            assert!(found, "{s} missing from the stub {file}");
        }
    }
    assert!(acl.contains(&"aclrtStreamQuery") && hccl.contains(&"HcclGetCommAsyncError"));
}

/// The shared conformance scenarios in this process, on one rank, through
/// the stubs: the whole path from `dlopen` to the group works with the
/// runtime's own checks. Glue only (a one-rank copy is exact by
/// construction); the conformance matrix on NPUs is the real test.
#[test]
fn conformance_scenarios_pass_on_one_stub_rank() {
    let stub = Stub::ok();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let backend: Arc<dyn Backend> = Arc::new(stub.backend());
    let world: Arc<dyn Store> =
        Arc::new(accel_rendezvous::PrefixStore::new(store.clone(), "world"));
    let comm = backend
        .connect(ctx(world, 0, 1, Duration::from_secs(10)))
        .unwrap();
    let c = accel_conformance::Ctx {
        comm: Arc::from(comm),
        backend,
        store,
        local_rank: 0,
        local_world_size: 1,
        device: Device::new(DeviceKind::Npu, 0),
        cases: 8,
        seed: accel_conformance::Seed::from_u64(17),
    };
    let results = accel_conformance::run_all(&c, None);
    let failed: Vec<String> = results
        .iter()
        .filter_map(|r| match &r.outcome {
            accel_conformance::Outcome::Fail(m) => Some(format!("{}: {m}", r.name)),
            _ => None,
        })
        .collect();
    assert!(failed.is_empty(), "{failed:#?}");
    let passed = results
        .iter()
        .filter(|r| matches!(r.outcome, accel_conformance::Outcome::Pass))
        .count();
    assert!(passed >= 20, "{results:#?}");
}
