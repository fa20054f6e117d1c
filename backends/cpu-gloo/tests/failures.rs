//! Failure behaviour: a rank that never joins, a rank that leaves, abort,
//! receive timeouts; every failure poisons the communicator.

mod common;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use accel_api::kit::{BackendRegistration, PRIORITY_CPU};
use accel_api::{
    Backend, Communicator, CommunicatorExt, DeviceKind, ErrorKind, ProbeContext, ReduceOp, Store,
};
use accel_backend_cpu_gloo::BACKEND;
use accel_rendezvous::MemoryStore;

const SHORT: Duration = Duration::from_secs(2);
const DEADLINE: Duration = Duration::from_secs(30);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(3);

fn is_poisoned_by(e: &accel_api::Error, first: &str) {
    assert_eq!(e.kind(), &ErrorKind::Poisoned, "{e}");
    assert!(e.to_string().contains(first), "`{e}` should name `{first}`");
}

/// Run `f` on `world` ranks once every rank connected (a barrier).
fn connected<F>(world: usize, f: F)
where
    F: Fn(usize, Box<dyn Communicator>) + Send + Sync + 'static,
{
    common::run_ranks(world, SHORT, DEADLINE, move |rank, c| {
        c.barrier().unwrap();
        f(rank, c)
    });
}

/// This rank leaves: its communicator is dropped, then the others, waiting
/// on `left`, go on.
fn leave(c: Box<dyn Communicator>, left: &Barrier) {
    drop(c);
    left.wait();
}

#[test]
fn probe_and_registration() {
    let b = BACKEND;
    assert_eq!(b.name(), "cpu-gloo");
    assert_eq!(b.priority(), PRIORITY_CPU);
    assert_eq!(b.device_kind(), DeviceKind::Cpu);
    let p = b.probe(&ProbeContext::single_process());
    assert!(p.is_available(), "{p:?}");
    assert_eq!(p.device_count, 1);
    let v = p.engine_version.unwrap();
    assert!(v.starts_with("gloo 0.5.0"), "{v}");
    let names: Vec<String> = accel_api::__private::inventory::iter::<BackendRegistration>
        .into_iter()
        .map(|r| (r.make)().name().to_string())
        .collect();
    assert!(names.contains(&"cpu-gloo".to_string()), "{names:?}");

    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let e = common::must_fail(
        b.connect(common::context(store, 2, 2, SHORT)),
        "connecting rank 2 of 2",
    );
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{e}");
}

#[test]
fn communicators_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<accel_backend_cpu_gloo::__test::GlooCommunicator>();
}

#[test]
fn peers_have_addresses_on_both_sides_of_each_connection() {
    // In every pair one rank accepted and the other connected: both ways
    // of finding the address Gloo prints must work.
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let out = common::spawn_ranks(3, DEADLINE, move |rank| {
        let c = accel_backend_cpu_gloo::__test::connect(common::context(
            store.clone(),
            rank,
            3,
            SHORT * 5,
        ))
        .unwrap();
        c.barrier().unwrap();
        let addrs: Vec<Vec<String>> = (0..3).map(|r| c.engine().peer_addresses(r)).collect();
        addrs
    });
    for (rank, addrs) in out.iter().enumerate() {
        for (peer, a) in addrs.iter().enumerate() {
            if peer == rank {
                assert!(a.is_empty());
            } else {
                assert_eq!(a.len(), 2, "rank {rank}'s names for {peer}: {a:?}");
                for a in a {
                    assert!(a.starts_with("[127.0.0.1]:"), "{a}");
                }
            }
        }
    }
}

#[test]
fn a_rank_that_never_joins_times_out_naming_it() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let out = common::spawn_ranks(2, DEADLINE, move |rank| {
        let start = Instant::now();
        let e = common::must_fail(
            common::connect(store.clone(), rank, 3, SHORT),
            "connecting without rank 2",
        );
        (e.to_string(), e.kind().clone(), start.elapsed())
    });
    for (msg, kind, took) in out {
        assert!(matches!(kind, ErrorKind::Timeout { .. }), "{msg}");
        assert!(msg.contains("rank 2 did not join"), "{msg}");
        assert!(msg.contains("cpu-gloo"), "{msg}");
        assert!(took < SHORT + SLACK, "took {took:?}");
    }
}

#[test]
fn a_rank_that_leaves_is_lost_and_the_survivors_are_poisoned() {
    for world in [2usize, 3] {
        let gone = world - 1;
        let dropped = Arc::new(Barrier::new(world));
        common::run_ranks(world, SHORT, DEADLINE, move |rank, c| {
            assert_eq!(
                c.all_reduce_vec(&[1i32], ReduceOp::Sum).unwrap(),
                vec![world as i32]
            );
            if rank == gone {
                return leave(c, &dropped);
            }
            dropped.wait();
            let start = Instant::now();
            let e = c.all_reduce_vec(&[1i32], ReduceOp::Sum).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: Some(gone) }, "{e}");
            assert!(e.to_string().contains("all_reduce"), "{e}");
            assert!(start.elapsed() < SHORT + SLACK);
            let first = e.to_string();
            let e2 = c.barrier().unwrap_err();
            is_poisoned_by(&e2, &first);
            let e3 = common::must_fail(c.split(Some(0), 0), "split after a failure");
            assert_eq!(e3.kind(), &ErrorKind::Poisoned);
        });
    }
}

#[test]
fn receive_from_a_dead_peer_names_it() {
    let dropped = Arc::new(Barrier::new(3));
    connected(3, move |rank, c| {
        if rank == 1 {
            return leave(c, &dropped);
        }
        dropped.wait();
        let mut buf = [0u8; 4];
        let e = c.recv_slice(&mut buf, 1, 0).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: Some(1) }, "{e}");
    });
}

#[test]
fn abort_poisons_and_peers_notice() {
    let aborted = Arc::new(Barrier::new(2));
    connected(2, move |rank, c| {
        if rank == 0 {
            c.abort("the test said so");
            aborted.wait();
            let e = c.barrier().unwrap_err();
            is_poisoned_by(&e, "the test said so");
            let mut b = [0u8];
            let e = c.recv_slice(&mut b, 0, 1).unwrap_err();
            is_poisoned_by(&e, "the test said so");
        } else {
            aborted.wait();
            let start = Instant::now();
            let e = c.barrier().unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::PeerLost { peer: Some(0) }, "{e}");
            assert!(start.elapsed() < SHORT + SLACK);
        }
    });
}

#[test]
fn a_receive_that_never_matches_times_out_and_tells_the_peer() {
    common::run_ranks(2, SHORT, DEADLINE, |rank, c| {
        let start = Instant::now();
        if rank == 1 {
            let mut b = [0f32; 2];
            let e = c.recv_slice(&mut b, 0, 5).unwrap_err();
            assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
            assert!(e.to_string().contains("[cpu-gloo rank 1] recv"), "{e}");
            assert!(start.elapsed() < SHORT + SLACK);
            is_poisoned_by(&c.barrier().unwrap_err(), "timed out");
        } else {
            // Waits for rank 1, which gives up after its timeout and
            // closes its connections: rank 0 learns why from the store.
            // (Start later, so that rank 1's timeout comes first.)
            std::thread::sleep(Duration::from_millis(800));
            let e = c.barrier().unwrap_err();
            assert!(
                matches!(
                    e.kind(),
                    ErrorKind::PeerLost { peer: Some(1) } | ErrorKind::Timeout { .. }
                ),
                "{e}"
            );
            if matches!(e.kind(), ErrorKind::PeerLost { .. }) {
                assert!(e.to_string().contains("rank 1 gave up first"), "{e}");
            }
            assert!(start.elapsed() < SHORT + SLACK);
        }
    });
}

/// Nothing crossed the wire, so the group stays usable (ADR 0006).
#[test]
fn a_receive_from_self_without_a_send_times_out() {
    common::run_ranks(1, Duration::from_millis(300), DEADLINE, |_rank, c| {
        let mut b = [0u8; 1];
        let e = c.recv_slice(&mut b, 0, 1).unwrap_err();
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("tag 1"), "{e}");
        c.barrier().unwrap();
    });
}
