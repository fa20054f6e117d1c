//! Small all-gathers (up to 240 bytes per rank: the call check's exchange,
//! a split's) run on the shim's second, synchronous mesh instead of
//! gloo::allgather (backends/cpu-gloo/shim/gloo_shim.cc, `SmallMesh`).
//! Both paths must give the same answers on either side of the boundary,
//! and the small one must turn ranks that disagree on the byte count into
//! an error on every rank (Gloo's own all-gather aborts the process).

mod common;

use std::time::Duration;

use accel_api::{CallCheck, CommunicatorExt, ErrorKind, ReduceOp, Store};
use accel_rendezvous::MemoryStore;
use std::sync::Arc;

const SHORT: Duration = Duration::from_secs(5);
const DEADLINE: Duration = Duration::from_secs(60);

/// What rank `r` contributes when every rank sends `n` bytes.
fn payload(r: usize, n: usize) -> Vec<u8> {
    (0..n).map(|i| (r * 31 + i * 7 + n) as u8).collect()
}

#[test]
fn both_paths_gather_every_rank_in_order_around_the_boundary() {
    for world in [2usize, 3] {
        let out = common::run_ranks(world, SHORT, DEADLINE, move |rank, c| {
            let mut seen = Vec::new();
            // 0..=240 bytes take the small mesh, 241 and up gloo::allgather;
            // interleaved, so both stay in step with each other.
            for n in [0usize, 1, 36, 239, 240, 241, 1000, 36, 4096, 240] {
                let got = c.all_gather_vec(&payload(rank, n)).unwrap();
                let want: Vec<u8> = (0..world).flat_map(|r| payload(r, n)).collect();
                seen.push((n, got == want));
            }
            seen
        });
        for (rank, seen) in out.into_iter().enumerate() {
            for (n, ok) in seen {
                assert!(ok, "world {world}, rank {rank}: all_gather of {n} bytes");
            }
        }
    }
}

#[test]
fn small_all_gathers_of_different_sizes_fail_on_every_rank_and_stay_in_step() {
    // With the call check off the engine sees the mismatched call (the
    // first collective is still checked: the barrier).
    for world in [2usize, 3] {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let out = common::spawn_ranks(world, DEADLINE, move |rank| {
            let c = CallCheck::scoped(CallCheck::Off, || {
                common::connect(store.clone(), rank, world, SHORT)
            })
            .unwrap_or_else(|e| panic!("rank {rank} could not connect: {e}"));
            c.barrier().unwrap();
            let n = if rank == world - 1 { 16 } else { 8 };
            let e = c.all_gather_vec(&payload(rank, n)).unwrap_err();
            // Every frame was read: the next calls still line up.
            let after = c.all_gather_vec(&payload(rank, 4)).unwrap();
            let sum = c.all_reduce_vec(&[1i32], ReduceOp::Sum).unwrap();
            (e.kind().clone(), e.to_string(), after, sum)
        });
        for (rank, (kind, msg, after, sum)) in out.into_iter().enumerate() {
            assert_eq!(kind, ErrorKind::InvalidArgument, "rank {rank}: {msg}");
            assert!(msg.contains("bytes"), "rank {rank}: {msg}");
            let want: Vec<u8> = (0..world).flat_map(|r| payload(r, 4)).collect();
            assert_eq!(after, want, "rank {rank}");
            assert_eq!(sum, vec![world as i32], "rank {rank}");
        }
    }
}
