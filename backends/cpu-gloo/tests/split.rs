//! `split` (MPI_Comm_split semantics) and collectives inside the groups.

mod common;

use std::time::Duration;

use accel_api::{CommunicatorExt, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(40);

#[test]
fn split_orders_by_key_then_rank_and_groups_work() {
    common::run_ranks(4, TIMEOUT, DEADLINE, |rank, c| {
        // Parity colors, keys reversed: color 0 = ranks {0, 2} ordered
        // (2, 0); color 1 = ranks {1, 3} ordered (3, 1).
        let sub = c
            .split(Some((rank % 2) as u32), (10 - rank) as u32)
            .unwrap()
            .expect("a color gives a group");
        assert_eq!(sub.world_size(), 2);
        assert_eq!(sub.rank(), if rank < 2 { 1 } else { 0 });
        assert_eq!(sub.timeout(), c.timeout());
        assert_eq!(sub.backend_name(), "cpu-gloo");
        let members = sub.all_gather_vec(&[rank as i32]).unwrap();
        assert_eq!(
            members,
            if rank % 2 == 0 {
                vec![2, 0]
            } else {
                vec![3, 1]
            }
        );
        let sum = sub.all_reduce_vec(&[rank as f64], ReduceOp::Sum).unwrap();
        assert_eq!(sum, vec![if rank % 2 == 0 { 2.0 } else { 4.0 }]);
        let mut b = [rank as u8; 3];
        sub.broadcast_slice(&mut b, 0).unwrap();
        assert_eq!(b, [if rank % 2 == 0 { 2 } else { 3 }; 3]);
        // Point to point inside the group uses group ranks.
        let peer = 1 - sub.rank();
        if sub.rank() == 0 {
            sub.send_slice(&[rank as i64], peer, 3).unwrap();
        } else {
            let mut got = [0i64];
            sub.recv_slice(&mut got, peer, 3).unwrap();
            assert_eq!(got, [(rank + 2) as i64]);
        }

        // The parent still works, interleaved with the group.
        assert_eq!(
            c.all_reduce_vec(&[rank as i64], ReduceOp::Sum).unwrap(),
            vec![6]
        );

        // A rank passing None takes part and gets None; equal keys keep
        // parent order.
        let color = if rank == 3 { None } else { Some(7) };
        let s2 = c.split(color, 0).unwrap();
        if rank == 3 {
            assert!(s2.is_none());
        } else {
            let s2 = s2.unwrap();
            assert_eq!((s2.rank(), s2.world_size()), (rank, 3));
            // Nested split: every member in one group of its own color.
            let s3 = s2.split(Some(rank as u32), 0).unwrap().unwrap();
            assert_eq!((s3.rank(), s3.world_size()), (0, 1));
            assert_eq!(s3.all_reduce_vec(&[5u8], ReduceOp::Avg).unwrap(), vec![5]);
            s2.barrier().unwrap();
            assert_eq!(
                s2.all_reduce_vec(&[rank as i32], ReduceOp::Max).unwrap(),
                vec![2]
            );
        }
        drop(sub);
        c.barrier().unwrap();
    });
}

#[test]
fn split_of_a_single_rank_and_everyone_out() {
    common::run_ranks(1, TIMEOUT, DEADLINE, |_rank, c| {
        let s = c.split(Some(0), 0).unwrap().unwrap();
        assert_eq!((s.rank(), s.world_size()), (0, 1));
        assert!(c.split(None, 0).unwrap().is_none());
        assert_eq!(s.all_reduce_vec(&[3i64], ReduceOp::Prod).unwrap(), vec![3]);
    });
    common::run_ranks(3, TIMEOUT, DEADLINE, |_rank, c| {
        assert!(c.split(None, 1).unwrap().is_none());
        c.barrier().unwrap();
    });
}
