//! What is particular to cpu-gloo's collectives. The conformance suite
//! (`tests/conformance.rs`) checks every operation, dtype and reduction
//! against its oracle; these tests pin Gloo's own framing and rounding.

mod common;

use std::time::Duration;

use accel_api::{f16, Communicator, CommunicatorExt, DType, ErrorKind, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(10);
const DEADLINE: Duration = Duration::from_secs(50);

/// Point-to-point messages carry a header (length, dtype): a receive of the
/// wrong size or type is an error, and the connection stays in step.
fn mismatched_receives(c: &dyn Communicator) {
    let (n, rank) = (c.world_size(), c.rank());
    if n < 2 {
        return;
    }
    if rank == 0 {
        c.send_slice(&[1.0f32, 2.0, 3.0], 1, 77).unwrap();
        c.send_slice(&[5i32, 6], 1, 78).unwrap();
        c.send_slice(&[9i64], 1, 79).unwrap();
    } else if rank == 1 {
        let mut two = [0f32; 2];
        let e = c.recv_slice(&mut two, 0, 77).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("3 f32 elements"), "{e}");
        // Same byte count, other element type.
        let mut one = [0i64; 1];
        let e = c.recv_slice(&mut one, 0, 78).unwrap_err();
        assert!(e.to_string().contains("2 i32 elements"), "{e}");
        // The connection is still in step.
        c.recv_slice(&mut one, 0, 79).unwrap();
        assert_eq!(one, [9]);
    }
    c.barrier().unwrap();
}

#[test]
fn mismatched_receives_are_errors() {
    common::run_ranks(2, TIMEOUT, DEADLINE, |_rank, c| mismatched_receives(&*c));
}

/// What cpu-gloo declares: every dtype for data movement, every one but
/// bf16 (which Gloo cannot reduce) for reductions.
#[test]
fn capabilities_leave_out_bf16_reductions() {
    let caps = accel_backend_cpu_gloo::__test::capabilities();
    assert_eq!(caps.dtypes.len(), DType::ALL.len());
    assert!(!caps.reduce_dtypes.contains(&DType::BF16));
    assert_eq!(caps.reduce_dtypes.len(), DType::ALL.len() - 1);
}

#[test]
fn f16_sums_round_like_ieee_half() {
    // 2048 + 1 is not a half (spacing 2 there): each pairwise sum rounds
    // to nearest even, as IEEE half addition does.
    common::run_ranks(2, TIMEOUT, DEADLINE, |rank, c| {
        let mut v = vec![
            if rank == 0 {
                f16::from_f32(2048.0)
            } else {
                f16::from_f32(1.0)
            },
            f16::from_f32(0.1),
        ];
        c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], f16::from_f32(2048.0) + f16::from_f32(1.0));
        assert_eq!(v[1], f16::from_f32(0.1) + f16::from_f32(0.1));
        let mut m = vec![f16::from_f32(rank as f32 - 0.5); 3];
        c.all_reduce_slice(&mut m, ReduceOp::Max).unwrap();
        assert_eq!(m, vec![f16::from_f32(0.5); 3]);
    });
}
