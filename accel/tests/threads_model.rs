//! `accel::run` under `ACCEL_PROCESS_MODEL=threads` without a launcher:
//! the whole run in this process, its ranks threads sharing an in-memory
//! store. Off the rank threads there is no one rank: `accel::state()` and
//! `Accelerator::new()` say so at once instead of waiting for peers. One
//! test in this binary, so that setting the environment races nothing.

use accel::{ErrorKind, ProcessModel, ReduceOp};

#[test]
fn run_starts_the_rank_threads_the_environment_names() {
    for (k, v) in [
        ("ACCEL_PROCESS_MODEL", "threads"),
        ("RANK", "0"),
        ("WORLD_SIZE", "3"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "3"),
        ("ACCEL_BACKEND", "cpu-gloo"),
        ("ACCEL_TIMEOUT", "30s"),
    ] {
        std::env::set_var(k, v);
    }
    for k in [
        "MASTER_ADDR",
        "MASTER_PORT",
        "ACCEL_STORE_URL",
        "ACCEL_LAUNCHER",
    ] {
        std::env::remove_var(k);
    }
    let e = accel::state().unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
    assert!(e.to_string().contains("accel::run"), "{e}");
    let e = accel::Accelerator::new().unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::InvalidConfig), "{e}");
    let process = accel::state::process_state().unwrap();
    assert_eq!(
        (process.process_model, process.ranks_in_process()),
        (ProcessModel::Threads, 3)
    );

    let out = accel::run(|acc| {
        assert_eq!(accel::state()?.rank, acc.rank());
        let mut x = [acc.rank() as i64 + 1];
        acc.all_reduce(&mut x, ReduceOp::Sum)?;
        Ok((acc.rank(), acc.backend_name().to_string(), x[0]))
    })
    .unwrap();
    assert_eq!(
        out,
        (0..3)
            .map(|r| (r, "cpu-gloo".to_string(), 6))
            .collect::<Vec<_>>()
    );
}
