//! Compiled programs are cached per (program, element type, length, group
//! size) for the process. Its own test binary: other tests compiling
//! concurrently would move the counter.

mod common;

use std::time::Duration;

use accel_api::{Communicator, CommunicatorExt, ReduceOp};

#[test]
fn a_repeated_shape_reuses_its_program() {
    if !common::plugin_or_skip("a_repeated_shape_reuses_its_program") {
        return;
    }
    let out = common::on_ranks(2, Duration::from_secs(60), |r, c| {
        let mut v = vec![r as f32; 3];
        c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        let first = c.engine().programs_compiled();
        for _ in 0..3 {
            c.all_reduce_slice(&mut v, ReduceOp::Sum).unwrap();
        }
        c.barrier().unwrap();
        let same = c.engine().programs_compiled();
        c.all_reduce_slice(&mut [1.0f32; 4], ReduceOp::Sum).unwrap();
        c.barrier().unwrap();
        let other = c.engine().programs_compiled();
        (v, first, same, other)
    });
    for o in out {
        let (v, first, same, other) = o.unwrap();
        assert_eq!(v, vec![8.0; 3], "1, then doubled three times");
        assert_eq!(first, same, "the same shape compiled once");
        assert_eq!(other, same + 1, "a new length is a new program");
    }
}
