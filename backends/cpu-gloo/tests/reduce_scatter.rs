//! The shim's ring reduce-scatter: exact on inputs of megabytes at 2-4
//! ranks, and bounded by the timeout when a peer never takes part or leaves
//! in the middle of the ring. The failure tests run with the call check off
//! (`ACCEL_CHECK_CALLS=0`, set for this whole test binary before any
//! communicator exists), so that the ring itself, not the check's exchange,
//! meets the missing peer.

mod common;

use std::sync::{Arc, Barrier, Once};
use std::time::{Duration, Instant};

use accel_api::{CommunicatorExt, ErrorKind, ReduceOp};

const SHORT: Duration = Duration::from_secs(2);
const TIMEOUT: Duration = Duration::from_secs(20);
const DEADLINE: Duration = Duration::from_secs(60);
/// Scheduling slack on a loaded 2-core machine.
const SLACK: Duration = Duration::from_secs(3);

fn check_off() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("ACCEL_CHECK_CALLS", "0"));
}

/// Element `i` of rank `r`'s input: an integer-valued float, so that every
/// order of summation gives the same, exact result.
fn value(r: usize, i: usize) -> f32 {
    ((i * 7 + r * 13) % 1000) as f32 - 500.0
}

#[test]
fn megabyte_reduce_scatters_are_exact() {
    check_off();
    const CHUNK: usize = 300_001;
    for world in [2usize, 3, 4] {
        common::run_ranks(world, TIMEOUT, DEADLINE, move |rank, c| {
            let mine: Vec<f32> = (0..CHUNK * world).map(|i| value(rank, i)).collect();
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                let got = c.reduce_scatter_vec(&mine, op).unwrap();
                assert_eq!(got.len(), CHUNK);
                for (k, g) in got.iter().enumerate() {
                    let i = rank * CHUNK + k;
                    let each = (0..world).map(|r| value(r, i));
                    let want = match op {
                        ReduceOp::Sum => each.sum::<f32>(),
                        ReduceOp::Max => each.fold(f32::MIN, f32::max),
                        _ => each.sum::<f32>() / world as f32,
                    };
                    assert_eq!(*g, want, "{op} at {world} ranks, rank {rank}, element {k}");
                }
            }
            let ints: Vec<i64> = (0..CHUNK * world)
                .map(|i| i64::MAX - (i + rank) as i64)
                .collect();
            let got = c.reduce_scatter_vec(&ints, ReduceOp::Sum).unwrap();
            for (k, g) in got.iter().enumerate() {
                let i = rank * CHUNK + k;
                let want = (0..world).fold(0i64, |a, r| a.wrapping_add(i64::MAX - (i + r) as i64));
                assert_eq!(*g, want, "i64 wrapping sum, element {k}");
            }
        });
    }
}

/// Three connected ranks with the call check off; `f(rank, c, missing)`
/// runs once rank 1 (`missing`) has left (`leave`) or stays out of the
/// collective until the others are done (otherwise); returns the failed
/// reduce-scatter's error and how long it took on the others.
fn without_rank_1<F>(leave: bool, f: F)
where
    F: Fn(usize, accel_api::Error, Duration, &dyn accel_api::Communicator) + Send + Sync + 'static,
{
    check_off();
    let sync = Arc::new(Barrier::new(3));
    common::run_ranks(3, SHORT, DEADLINE, move |rank, c| {
        c.barrier().unwrap();
        if rank == 1 {
            if leave {
                drop(c);
            }
            sync.wait();
            return;
        }
        if leave {
            sync.wait();
        }
        let start = Instant::now();
        let e = c
            .reduce_scatter_vec(&vec![1.0f32; 3 * 4096], ReduceOp::Sum)
            .unwrap_err();
        assert!(e.to_string().contains("reduce_scatter"), "{e}");
        assert!(e.to_string().contains("cpu-gloo"), "{e}");
        f(rank, e, start.elapsed(), &*c);
        if !leave {
            sync.wait();
        }
    });
}

#[test]
fn a_rank_that_never_enters_a_reduce_scatter_times_it_out() {
    without_rank_1(false, |rank, e, took, _| {
        // Rank 2 waits on rank 1 and times out; rank 0 waits on rank 2 and
        // either times out too or, when rank 2 gave up a moment earlier and
        // closed its connections, is told so by rank 2.
        let told = rank == 0 && matches!(e.kind(), ErrorKind::PeerLost { peer: Some(2) });
        assert!(
            matches!(e.kind(), ErrorKind::Timeout { .. }) || told,
            "rank {rank}: {e}"
        );
        if rank == 2 {
            assert!(
                took >= SHORT - Duration::from_millis(100),
                "gave up after {took:?}"
            );
        }
        assert!(took < SHORT + SLACK, "took {took:?}");
    });
}

#[test]
fn a_rank_that_leaves_before_the_ring_is_named_as_lost() {
    without_rank_1(true, |rank, e, took, c| {
        assert!(
            matches!(e.kind(), ErrorKind::PeerLost { peer: Some(1) }),
            "rank {rank}: {e}"
        );
        assert!(took < SHORT + SLACK, "took {took:?}");
        let again = c.barrier().unwrap_err();
        assert_eq!(again.kind(), &ErrorKind::Poisoned, "{again}");
    });
}
