//! Failures end, with errors that name what happened: a rank thread that
//! never arrives, mismatched calls, ranks in another process, too many
//! ranks, a receive without a send.

mod common;

use std::sync::Arc;
use std::time::Duration;

use accel_api::{Communicator, CommunicatorExt, ErrorKind, ReduceOp, Store};
use accel_rendezvous::MemoryStore;

const SHORT: Duration = Duration::from_millis(1500);

/// Return from the test, saying so, when no PJRT plugin is installed.
macro_rules! need_plugin {
    ($test:literal) => {
        if !common::plugin_or_skip($test) {
            return;
        }
    };
}

/// The error of rank `rank`'s connect to a group of `world` over `store`.
fn connect_err(store: &Arc<MemoryStore>, rank: usize, world: usize) -> accel_api::Error {
    accel_backend_xla::__test::connect(common::ctx(store, rank, world, SHORT)).unwrap_err()
}

/// The error of rank `rank`'s connect to `world` ranks over a store holding
/// `keys`, which must be a configuration error, and its fix (empty if none).
fn config_fix(keys: &[(&str, &[u8])], rank: usize, world: usize) -> (accel_api::Error, String) {
    let store = Arc::new(MemoryStore::new());
    for (k, v) in keys {
        store.set(k, v).unwrap();
    }
    let e = connect_err(&store, rank, world);
    assert_eq!(e.kind(), &ErrorKind::InvalidConfig, "{e}");
    let fix = e.fix().unwrap_or_default().to_string();
    (e, fix)
}

#[test]
fn a_rank_thread_that_never_arrives_times_out_the_others() {
    need_plugin!("a_rank_thread_that_never_arrives_times_out_the_others");
    let out = common::on_ranks(3, SHORT, |r, c| {
        if r == 2 {
            // Arrive only after the others gave up: an error, not a hang.
            std::thread::sleep(SHORT * 2);
            return vec![c
                .all_reduce_slice(&mut [1.0f32], ReduceOp::Sum)
                .unwrap_err()];
        }
        let first = c
            .all_reduce_slice(&mut [1.0f32], ReduceOp::Sum)
            .unwrap_err();
        let then = c.barrier().unwrap_err();
        vec![first, then]
    });
    for (r, errs) in out.into_iter().enumerate() {
        let errs = errs.unwrap();
        if r == 2 {
            assert!(errs[0].is_fatal_for_group(), "{}", errs[0]);
            continue;
        }
        let e = &errs[0];
        assert!(
            matches!(e.kind(), ErrorKind::Timeout { .. }),
            "rank {r}: {e}"
        );
        let s = e.to_string();
        assert!(
            s.contains("all_reduce") && s.contains("rank(s) 2 of 3"),
            "rank {r}: {s}"
        );
        assert_eq!(
            errs[1].kind(),
            &ErrorKind::Poisoned,
            "rank {r}: {}",
            errs[1]
        );
    }
}

#[test]
fn connect_without_every_rank_times_out_naming_the_missing() {
    need_plugin!("connect_without_every_rank_times_out_naming_the_missing");
    let store = Arc::new(MemoryStore::new());
    let errs: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let store = &store;
                s.spawn(move || connect_err(store, r, 3))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in errs {
        assert!(matches!(e.kind(), ErrorKind::Timeout { .. }), "{e}");
        let s = e.to_string();
        assert!(s.contains("connect") && s.contains("rank(s) 2 of 3"), "{s}");
    }
}

#[test]
fn mismatched_calls_fail_every_rank() {
    need_plugin!("mismatched_calls_fail_every_rank");
    let out = common::on_ranks(2, SHORT * 4, |r, c| {
        let mut v = vec![1i32; 3 + r];
        c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap_err()
    });
    for e in out {
        let e = e.unwrap();
        // The group's call check (ADR 0016) finds it before the engine does.
        assert!(matches!(e.kind(), ErrorKind::Mismatch { .. }), "{e}");
        assert!(e.is_fatal_for_group());
        assert!(
            e.to_string().contains("length (3 on rank 0; 4 on rank 1)"),
            "{e}"
        );
    }
}

#[test]
fn ranks_in_another_process_are_refused() {
    need_plugin!("ranks_in_another_process_are_refused");
    // Rank 0 of "another process" (pid 1) published its meeting.
    let (e, fix) = config_fix(&[("xla/1/meet", b"1:0")], 1, 2);
    assert!(e.to_string().contains("rank 0 runs in process 1"), "{e}");
    assert!(fix.contains("accel launch --backend xla"), "{e}");
}

#[test]
fn more_ranks_than_devices_is_a_config_error() {
    need_plugin!("more_ranks_than_devices_is_a_config_error");
    let (e, fix) = config_fix(&[], 0, 1000);
    assert!(fix.contains("ACCEL_PJRT_CPU_DEVICES=1000"), "{e}");
}

#[test]
fn a_receive_without_a_send_times_out_and_wrong_sizes_are_refused() {
    need_plugin!("a_receive_without_a_send_times_out_and_wrong_sizes_are_refused");
    let out = common::on_ranks(2, SHORT, |r, c| {
        if r == 0 {
            c.send_slice(&[1u8, 2], 1, 4).unwrap();
            return None;
        }
        let wrong = c.recv_slice(&mut [0u8; 3], 0, 4).unwrap_err();
        let none = c.recv_slice(&mut [0u8; 2], 0, 5).unwrap_err();
        Some((wrong, none))
    });
    let (wrong, none) = out.into_iter().nth(1).unwrap().unwrap().unwrap();
    assert_eq!(wrong.kind(), &ErrorKind::InvalidArgument, "{wrong}");
    assert!(wrong.to_string().contains("rank 0 sent 2 u8"), "{wrong}");
    assert!(matches!(none.kind(), ErrorKind::Timeout { .. }), "{none}");
    assert!(none.to_string().contains("tag 5"), "{none}");
}
