//! The engine's whole path (context, stream, staging, views, grouped
//! point-to-point, the header protocol, split, abort, timeouts) through
//! cudarc's real bindings, against a FAKE driver and a FAKE one-rank NCCL
//! (`tests/fake/*.c`, built here with `cc`): "device memory" is host memory
//! and every reduction of one contribution is a copy. Glue testing only:
//! it says the engine calls the libraries as intended and handles their
//! answers, never that cuda-nccl works on a GPU (`tests/gpu.rs` does that).
//!
//! Each case runs in a child process (the loader reads `LD_LIBRARY_PATH`
//! at start); no child may print a panic message.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use accel_api::{Communicator, CommunicatorExt, ErrorKind, ReduceOp};

const CHILD: &str = "ACCEL_NCCL_FAKE_CHILD";

/// Build the fake libraries into `dir` (as `libcuda.so` and `libnccl.so`,
/// the latter from `nccl`).
fn build_fakes(dir: &Path, nccl: &str) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    for (c, so) in [("fake_cuda.c", "libcuda.so"), (nccl, "libnccl.so")] {
        let st = Command::new(&cc)
            .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
            .arg(dir.join(so))
            .arg(src.join(c))
            .status()
            .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
        assert!(st.success(), "{cc} failed on {c}");
    }
}

/// Run the child test `case` against the one-rank fakes; returns its
/// stdout.
fn run_child(case: &str, envs: &[(&str, &str)]) -> String {
    run_child_with("fake_nccl.c", case, envs)
}

/// Run the child test `case` against the fake driver and the fake NCCL
/// built from `nccl`.
fn run_child_with(nccl: &str, case: &str, envs: &[(&str, &str)]) -> String {
    let t = tempfile::tempdir().unwrap();
    build_fakes(t.path(), nccl);
    let mut cmd = Command::new("timeout");
    cmd.arg("120")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD, case)
        .env("LD_LIBRARY_PATH", t.path())
        .env_remove("CUDA_VISIBLE_DEVICES");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "child {case} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("1 passed"),
        "child {case} ran nothing:\n{stdout}"
    );
    assert!(
        !stderr.contains("panicked") && !stdout.contains("panicked"),
        "panic message in child {case}:\n{stdout}\n{stderr}"
    );
    stdout
}

/// A fresh in-memory rendezvous store.
fn memory_store() -> std::sync::Arc<dyn accel_api::Store> {
    std::sync::Arc::new(accel_rendezvous::MemoryStore::new())
}

/// The child side of every case: runs the case the parent named in
/// `ACCEL_NCCL_FAKE_CHILD`; a no-op in a normal test run.
#[test]
fn child() {
    let Ok(case) = std::env::var(CHILD) else {
        return;
    };
    let run: fn() = match case.as_str() {
        "child_scenarios" => child_scenarios,
        "child_hang" => child_hang,
        "child_remote" => child_remote,
        "child_refusals" => child_refusals,
        "child_missing_rank" => child_missing_rank,
        "child_cudarc" => child_cudarc,
        "child_abort_in_flight" => child_abort_in_flight,
        "child_two_ranks" => child_two_ranks,
        other => panic!("no child case `{other}`"),
    };
    run();
}

#[test]
fn fake_scenarios_pass_through_the_whole_engine() {
    run_child("child_scenarios", &[]);
}

fn child_scenarios() {
    let r = accel_backend_cuda_nccl::inspect();
    assert!(r.unavailable.is_none(), "the fakes should probe: {r:?}");
    assert_eq!(r.version_line().unwrap(), "NCCL 2.28.3, CUDA driver 13.0");
    let c = common::connect_one(Duration::from_secs(10));
    common::every_dtype_and_reduction(&c);
    common::data_movement(&c);
    common::host_buffers(&c);
    common::started_calls(&c);
    common::split_and_abort(&c);
    // The shared suite through the fakes: glue (staging, views, framing),
    // not NCCL.
    accel_conformance::assert_conformance(
        std::sync::Arc::new(accel_backend_cuda_nccl::BACKEND),
        &[1],
        None,
    );
}

/// Run `child` with the fake NCCL hanging every collective and check that
/// the engine called `ncclCommAbort` exactly once.
fn assert_one_abort_after_hang(child: &str) {
    let t = tempfile::tempdir().unwrap();
    let log: PathBuf = t.path().join("aborts");
    run_child(
        child,
        &[
            ("FAKE_NCCL_HANG", "1"),
            ("FAKE_NCCL_ABORT_LOG", log.to_str().unwrap()),
        ],
    );
    let aborts = std::fs::read_to_string(&log).unwrap_or_default();
    assert_eq!(
        aborts.lines().count(),
        1,
        "ncclCommAbort exactly once: {aborts:?}"
    );
}

#[test]
fn a_hung_collective_times_out_aborts_and_poisons() {
    assert_one_abort_after_hang("child_hang");
}

fn child_hang() {
    let c = common::connect_one(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let e = c
        .all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum)
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "bounded by the timeout"
    );
    assert_eq!(
        e.kind(),
        &ErrorKind::Timeout {
            after: Duration::from_millis(300)
        },
        "{e}"
    );
    let s = e.to_string();
    assert!(
        s.starts_with("[cuda-nccl rank 0] all_reduce: timed out after 300ms: the NCCL all_reduce (4 f32) on cuda:0 did not complete; the NCCL communicator was aborted"),
        "{s}"
    );
    let e = c.barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned, "{e}");
    assert!(
        e.to_string().contains("timed out"),
        "names the first failure: {e}"
    );
}

#[test]
fn a_remote_error_is_a_lost_peer() {
    run_child("child_remote", &[("FAKE_NCCL_REMOTE", "1")]);
}

fn child_remote() {
    let c = common::connect_one(Duration::from_secs(10));
    let e = c.broadcast_slice(&mut [1u8, 2], 0).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: None }, "{e}");
    assert!(
        e.to_string().contains("remote process exited"),
        "NCCL's text: {e}"
    );
    assert!(
        e.to_string().contains("fake last error"),
        "ncclGetLastError: {e}"
    );
    assert_eq!(c.barrier().unwrap_err().kind(), &ErrorKind::Poisoned);
}

#[test]
fn connect_refuses_what_it_cannot_drive() {
    run_child("child_refusals", &[]);
}

fn child_refusals() {
    let store = memory_store();
    let ctx = |device| {
        accel_api::ConnectContext::local(0, 1, Duration::from_secs(5), store.clone())
            .with_device(device)
            .with_run_id("r")
    };
    let e = accel_backend_cuda_nccl::__test::connect(ctx(accel_api::Device::CPU)).unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{e}");
    let e = accel_backend_cuda_nccl::__test::connect(ctx(accel_api::Device::new(
        accel_api::DeviceKind::Cuda,
        3,
    )))
    .unwrap_err();
    assert!(
        e.to_string().contains("cuda:3 is not among the 1 visible"),
        "{e}"
    );
    let c = common::connect_one(Duration::from_secs(5));
    assert_eq!((c.rank(), c.world_size()), (0, 1));
}

#[test]
fn a_rank_that_never_connects_is_counted() {
    run_child("child_missing_rank", &[]);
}

fn child_missing_rank() {
    let store = memory_store();
    let ctx = accel_api::ConnectContext::local(0, 2, Duration::from_millis(300), store.clone())
        .with_device(common::CUDA0)
        .with_run_id("r");
    let e = accel_backend_cuda_nccl::__test::connect(ctx).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
    let s = e.to_string();
    // The store's barrier names itself and counts who arrived.
    assert!(s.starts_with("[cuda-nccl rank 0] store barrier: "), "{s}");
    assert!(
        s.contains("cuda-nccl/1/joined`: 1 of 2 participants arrived"),
        "{s}"
    );
    assert!(
        store
            .try_get("cuda-nccl/1/id")
            .unwrap()
            .is_some_and(|id| id.len() == 128),
        "rank 0 published the NCCL id"
    );
}

#[test]
fn cudarc_slices_are_device_views() {
    run_child("child_cudarc", &[]);
}

fn child_cudarc() {
    let c = common::connect_one(Duration::from_secs(10));
    common::cudarc_slices(&c);
}

#[test]
fn abort_interrupts_a_call_in_flight() {
    assert_one_abort_after_hang("child_abort_in_flight");
}

fn child_abort_in_flight() {
    let c = std::sync::Arc::new(common::connect_one(Duration::from_secs(60)));
    assert!(c.capabilities().abort_interrupts);
    let c2 = c.clone();
    let aborter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        c2.abort("the test stops it");
    });
    let t0 = std::time::Instant::now();
    let e = c
        .all_reduce_slice(&mut [1i32; 8], ReduceOp::Sum)
        .unwrap_err();
    aborter.join().unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "returned on the abort, not the 60 s timeout"
    );
    assert_eq!(e.kind(), &ErrorKind::Aborted, "{e}");
    assert!(e.to_string().contains("all_reduce"), "{e}");
    let e = c.barrier().unwrap_err();
    assert_eq!(e.kind(), &ErrorKind::Poisoned, "{e}");
    assert!(e.to_string().contains("the test stops it"), "{e}");
}

#[test]
fn two_ranks_as_threads_bootstrap_and_talk() {
    run_child_with(
        "fake_nccl_threads.c",
        "child_two_ranks",
        &[("FAKE_CUDA_DEVICES", "2")],
    );
}

/// Two ranks as threads over the threaded fake NCCL: the id goes through
/// the store, the header protocol keeps messages in step.
fn child_two_ranks() {
    let store = memory_store();
    let ranks: Vec<_> = (0..2usize)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let c = accel_backend_cuda_nccl::__test::connect(accel_api::ConnectContext {
                    rank,
                    world_size: 2,
                    local_rank: rank,
                    local_world_size: 2,
                    device: accel_api::Device::new(accel_api::DeviceKind::Cuda, rank as u32),
                    timeout: Duration::from_secs(20),
                    store,
                    run_id: "two".into(),
                })
                .unwrap();
                two_rank_scenario(&c, rank);
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap();
    }
}

fn two_rank_scenario(c: &accel_backend_cuda_nccl::__test::NcclCommunicator, rank: usize) {
    let me = rank as f32 + 1.0;
    let mut v = vec![me; 5];
    c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
    assert_eq!(v, vec![3.0; 5], "sum of 1 and 2");
    let mut b = vec![me; 3];
    c.broadcast_slice(&mut b, 1).unwrap();
    assert_eq!(b, vec![2.0; 3], "rank 1's value");
    let g = c
        .all_gather_vec(&[rank as i32 * 10, rank as i32 * 10 + 1])
        .unwrap();
    assert_eq!(g, vec![0, 1, 10, 11]);
    let g = c.gather_vec(&[rank as i32 + 5; 2], 0).unwrap();
    assert_eq!(g, (rank == 0).then(|| vec![5, 5, 6, 6]), "gather at 0");
    let all = [1i64, 2, 3, 4];
    let s = c
        .scatter_vec((rank == 1).then_some(&all[..]), 2, 1)
        .unwrap();
    assert_eq!(
        s,
        if rank == 0 { vec![1, 2] } else { vec![3, 4] },
        "scatter from 1"
    );
    let a = c
        .all_to_all_vec(&[rank as u8 * 2, rank as u8 * 2 + 1])
        .unwrap();
    assert_eq!(
        a,
        if rank == 0 { vec![0, 2] } else { vec![1, 3] },
        "all_to_all"
    );
    c.barrier().unwrap();
    if rank == 0 {
        c.send_slice(&[1.0f32, 2.0, 3.0], 1, 7).unwrap();
        c.send_slice(&[9.0f32; 4], 1, 8).unwrap();
        c.send_slice(&[5.0f32], 1, 9).unwrap();
    } else {
        let mut r = [0f32; 3];
        c.recv_slice(&mut r, 0, 7).unwrap();
        assert_eq!(r, [1.0, 2.0, 3.0]);
        let e = c.recv_slice(&mut r, 0, 8).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("16 bytes of f32 with tag 8"), "{e}");
        let mut one = [0f32];
        c.recv_slice(&mut one, 0, 9).unwrap();
        assert_eq!(one, [5.0], "in step after the dropped message");
    }
    c.barrier().unwrap();
}
