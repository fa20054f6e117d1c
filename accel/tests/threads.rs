//! The in-process entry: a closure on 4 rank threads of this process, each
//! with its own state and `Accelerator`, doing real collectives on a real
//! engine (cpu-gloo over loopback; xla on the PJRT CPU plugin with the
//! `xla` feature). Every blocking call is bounded by a short timeout.

use std::time::Duration;

use accel::{ProcessModel, ReduceOp, Threads};

const WORLD: usize = 4;

/// What a rank saw: its rank, the all_reduce, all_gather and broadcast results.
type Seen = (usize, Vec<f32>, Vec<u64>, Vec<i64>);

/// What every rank checks: its own state, all_reduce, all_gather,
/// broadcast and a barrier; returns (rank, sum, gathered, broadcast).
fn collectives(acc: &accel::Accelerator) -> accel::Result<Seen> {
    let s = accel::state()?;
    assert_eq!((s.rank, s.world_size), (acc.rank(), WORLD));
    assert_eq!(s.local_rank, acc.local_rank());
    assert_eq!(s.process_model, ProcessModel::Threads);
    assert_eq!(accel::thread_rank(), Some(acc.rank()));
    let r = acc.rank();
    let mut x = vec![r as f32 + 1.0, (r * r) as f32];
    acc.all_reduce(&mut x, ReduceOp::Sum)?;
    let gathered = acc.gather(&[r as u64 * 10, r as u64 * 10 + 1])?;
    let mut b = if r == 2 { vec![7i64, -3] } else { vec![0, 0] };
    acc.broadcast(&mut b, 2)?;
    acc.wait_for_everyone()?;
    Ok((r, x, gathered, b))
}

fn check(backend: &str, out: Vec<Seen>) {
    assert_eq!(out.len(), WORLD, "{backend}: one result per rank");
    let sum: Vec<f32> = vec![
        (1..=WORLD).map(|v| v as f32).sum(),
        (0..WORLD).map(|r| (r * r) as f32).sum(),
    ];
    let gathered: Vec<u64> = (0..WORLD as u64)
        .flat_map(|r| [r * 10, r * 10 + 1])
        .collect();
    for (i, (rank, x, g, b)) in out.into_iter().enumerate() {
        assert_eq!(rank, i, "{backend}: results in rank order");
        assert_eq!(x, sum, "{backend}: all_reduce on rank {rank}");
        assert_eq!(g, gathered, "{backend}: all_gather on rank {rank}");
        assert_eq!(b, vec![7, -3], "{backend}: broadcast on rank {rank}");
    }
}

#[test]
fn four_rank_threads_on_cpu_gloo() {
    let out = Threads::new(WORLD)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(30))
        .run(collectives)
        .unwrap();
    check("cpu-gloo", out);
}

#[test]
fn a_failing_rank_is_the_root_cause_and_the_others_end() {
    let e = Threads::new(WORLD)
        .backend("cpu-gloo")
        .timeout(Duration::from_secs(5))
        .run(|acc| {
            if acc.rank() == 1 {
                return Err(accel::Error::invalid_argument("step", "rank 1 gives up"));
            }
            // The others wait for rank 1 in a collective that never comes.
            acc.wait_for_everyone()
        })
        .unwrap_err();
    assert_eq!(e.rank(), Some(1), "{e}");
    assert!(e.to_string().contains("rank 1 gives up"), "{e}");
}

#[test]
fn one_rank_thread_on_single() {
    let out = Threads::new(1)
        .backend("single")
        .run(|acc| {
            let mut x = [3.0f64];
            acc.all_reduce(&mut x, ReduceOp::Sum)?;
            Ok((acc.backend_name().to_string(), x[0]))
        })
        .unwrap();
    assert_eq!(out, vec![("single".to_string(), 3.0)]);
}

#[cfg(feature = "xla")]
#[test]
fn four_rank_threads_on_xla() {
    if let Err(e) = accel_backend_xla_probe() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "CI=true but the PJRT plugin is missing (run `make pjrt-setup`): {e}"
        );
        eprintln!("skipping four_rank_threads_on_xla: {e}");
        return;
    }
    // No ACCEL_PROCESS_MODEL in the environment: the entry marks its rank
    // threads, and the registry picks xla for them by priority.
    assert!(std::env::var_os("ACCEL_PROCESS_MODEL").is_none());
    let out = Threads::new(WORLD)
        .timeout(Duration::from_secs(30))
        .run(|acc| {
            assert_eq!(acc.backend_name(), "xla");
            collectives(acc)
        })
        .unwrap();
    check("xla", out);
}

/// Whether the xla backend can run here (its probe for one rank).
#[cfg(feature = "xla")]
fn accel_backend_xla_probe() -> Result<(), String> {
    let r = accel::Registry::builtin();
    let e = r.get("xla").ok_or("xla is not compiled in")?;
    let p = e.backend.probe(&accel::ProbeContext::single_process());
    match p.reason() {
        None => Ok(()),
        Some(why) => Err(why.to_string()),
    }
}
