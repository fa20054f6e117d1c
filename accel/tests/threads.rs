//! The in-process entry: a closure on 4 rank threads of this process, each
//! with its own state and `Accelerator`, doing real collectives on a real
//! engine (cpu-gloo over loopback; xla on the PJRT CPU plugin with the
//! `xla` feature). Every blocking call is bounded by a short timeout.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use accel::{ErrorKind, ProcessModel, ReduceOp, Threads};

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
    if !xla_runs_here("four_rank_threads_on_xla") {
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

/// Whether `test` can run on xla here; says why not (a failure under
/// CI=true, where the PJRT plugin must be present).
#[cfg(feature = "xla")]
fn xla_runs_here(test: &str) -> bool {
    match accel_backend_xla_probe() {
        Ok(()) => true,
        Err(e) => {
            accel_test_support::skips::skip(&format!(
                "{test}: no PJRT plugin (run `make pjrt-setup`): {e}"
            ));
            false
        }
    }
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

/// How long after a rank thread fails the other ranks and the run may take
/// to end: a hang guard far below the 60 s timeout of these runs, so that
/// passing proves the failure ended the run and not the timeout. It is not
/// a speed target (ended in well under 1 s here; a loaded CI machine or a
/// backtrace can take longer).
const FAIL_BOUND: Duration = Duration::from_secs(10);

/// What the ranks other than the failing one saw: (rank, time since the
/// failure, error kind, error text).
type Others = Vec<(usize, Duration, ErrorKind, String)>;

/// Rank 1 of `world` fails (panics when `panic`, else returns an error)
/// while the others wait for it in an all_reduce, under a timeout far above
/// the bound. Returns the run's error, the time from the failure to the
/// run's end, and what the others saw.
fn rank_one_fails(backend: &str, world: usize, panic: bool) -> (accel::Error, Duration, Others) {
    let failed_at: Mutex<Option<Instant>> = Mutex::new(None);
    let others: Mutex<Others> = Mutex::new(Vec::new());
    let e = Threads::new(world)
        .backend(backend)
        .timeout(Duration::from_secs(60))
        .run(|acc| {
            acc.wait_for_everyone()?;
            if acc.rank() == 1 {
                std::thread::sleep(Duration::from_millis(100));
                *failed_at.lock().unwrap() = Some(Instant::now());
                if panic {
                    // A panic without the panic hook: the bound measures
                    // accel, not the hook's backtrace (RUST_BACKTRACE=1
                    // symbolizes for ~0.4 s in a debug build).
                    std::panic::resume_unwind(Box::new("rank 1 breaks down"));
                }
                return Err(accel::Error::invalid_argument("step", "rank 1 gives up"));
            }
            let mut x = [1.0f32];
            acc.all_reduce(&mut x, ReduceOp::Sum).inspect_err(|e| {
                let since = failed_at.lock().unwrap().map(|t| t.elapsed());
                others.lock().unwrap().push((
                    acc.rank(),
                    since.unwrap_or_default(),
                    e.kind().clone(),
                    e.to_string(),
                ));
            })
        })
        .unwrap_err();
    let ended = failed_at.lock().unwrap().expect("rank 1 failed").elapsed();
    (e, ended, others.into_inner().unwrap())
}

/// The run's error is rank 1's, carrying `what`; it ended within the bound;
/// every other rank got `PeerLost` naming rank 1, or an error carrying the
/// cause, within the bound.
fn check_failure(backend: &str, world: usize, what: &str, out: (accel::Error, Duration, Others)) {
    let (e, ended, others) = out;
    assert_eq!(e.rank(), Some(1), "{backend}: {e}");
    assert!(e.to_string().contains(what), "{backend}: {e}");
    assert!(
        ended < FAIL_BOUND,
        "{backend}: the run ended {ended:?} after rank 1 failed (bound {FAIL_BOUND:?}): {e}"
    );
    assert_eq!(others.len(), world - 1, "{backend}: {others:?}");
    for (rank, since, kind, err) in others {
        let names_one = matches!(kind, ErrorKind::PeerLost { peer: Some(1) });
        assert!(
            names_one || err.contains(what),
            "{backend}: rank {rank} did not name rank 1 or its failure: {err}"
        );
        assert!(
            since < FAIL_BOUND,
            "{backend}: rank {rank} ended {since:?} after rank 1 failed: {err}"
        );
    }
}

#[test]
fn a_panicking_rank_thread_ends_the_others_at_once_on_cpu_gloo() {
    let out = rank_one_fails("cpu-gloo", WORLD, true);
    assert!(matches!(out.0.kind(), ErrorKind::Aborted), "{}", out.0);
    check_failure("cpu-gloo", WORLD, "rank 1 breaks down", out);
}

#[test]
fn a_rank_thread_returning_an_error_ends_the_others_at_once_on_cpu_gloo() {
    let out = rank_one_fails("cpu-gloo", WORLD, false);
    check_failure("cpu-gloo", WORLD, "rank 1 gives up", out);
}

#[test]
fn a_panicking_rank_thread_on_single_is_the_run_error() {
    let start = Instant::now();
    let e = Threads::new(1)
        .backend("single")
        .timeout(Duration::from_secs(60))
        .run(|acc| -> accel::Result<()> {
            acc.wait_for_everyone()?;
            // Without the panic hook, as in rank_one_fails.
            std::panic::resume_unwind(Box::new("the only rank breaks down"))
        })
        .unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::Aborted), "{e}");
    assert_eq!(e.rank(), Some(0), "{e}");
    assert!(e.to_string().contains("the only rank breaks down"), "{e}");
    assert!(start.elapsed() < FAIL_BOUND, "{:?}", start.elapsed());
}

#[cfg(feature = "xla")]
#[test]
fn a_panicking_rank_thread_ends_the_others_at_once_on_xla() {
    if !xla_runs_here("a_panicking_rank_thread_ends_the_others_at_once_on_xla") {
        return;
    }
    let out = rank_one_fails("xla", WORLD, true);
    assert!(matches!(out.0.kind(), ErrorKind::Aborted), "{}", out.0);
    // xla names the failed rank, never the reporting one (issue 32, item 8).
    for (rank, _, kind, err) in &out.2 {
        assert_ne!(
            kind,
            &ErrorKind::PeerLost { peer: Some(*rank) },
            "xla: rank {rank} named itself: {err}"
        );
    }
    check_failure("xla", WORLD, "rank 1 breaks down", out);
    let out = rank_one_fails("xla", WORLD, false);
    check_failure("xla", WORLD, "rank 1 gives up", out);
}
