//! Two ranks started by an outside launcher (mpirun, torchrun, or by hand)
//! that meet, all-reduce and report: what the tests that start copies of
//! their own binary share (`#[path]`-included; not part of `common`, which
//! needs a training model these tests do not).
#![allow(dead_code)]

use std::process::{Child, Output};
use std::time::{Duration, Instant};

/// The worker's body: connect with `Accelerator::new()`, all-reduce
/// `rank + 1` and print `RESULT rank=R world=W backend=B sum=S`.
pub fn reduce_and_report() {
    let acc = accel::Accelerator::new().expect("connect");
    let mut v = vec![(acc.rank() + 1) as f32; 4];
    acc.all_reduce(&mut v, accel::ReduceOp::Sum)
        .expect("all_reduce");
    acc.wait_for_everyone().expect("barrier");
    println!(
        "RESULT rank={} world={} backend={} sum={}",
        acc.rank(),
        acc.world_size(),
        acc.backend_name(),
        v[0]
    );
}

/// Wait for `child` with a hard deadline, killing it past that.
pub fn finish(mut child: Child, what: &str, limit: Duration) -> Output {
    let end = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} did not finish within {limit:?}:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// stdout then stderr.
pub fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Both ranks printed the all-reduced sum on `backend`.
pub fn assert_two_ranks_reduced(t: &str, backend: &str) {
    for r in 0..2 {
        let want = format!("RESULT rank={r} world=2 backend={backend} sum=3");
        assert!(t.contains(&want), "missing `{want}` in:\n{t}");
    }
}
