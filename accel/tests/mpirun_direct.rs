//! A program started by `mpirun -n 2` directly, with no accel variable at
//! all (no MASTER_ADDR, no ACCEL_*): the mpi backend needs no store, so
//! `Accelerator::new()` connects and all-reduces. This test binary starts
//! copies of itself under mpirun; `worker` does the work when
//! `MPIRUN_DIRECT_WORKER` is set and nothing otherwise.
#![cfg(feature = "mpi")]

use accel_test_support::skips;
#[path = "common/two_ranks.rs"]
mod two_ranks;

use std::process::{Command, Stdio};
use std::time::Duration;

#[test]
fn worker() {
    if std::env::var_os("MPIRUN_DIRECT_WORKER").is_some() {
        two_ranks::reduce_and_report();
    }
}

#[test]
fn mpirun_alone_runs_an_accel_program_without_any_accel_variable() {
    if !skips::mpirun_or_skip() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    skips::allow_root(&mut cmd);
    cmd.args(["--oversubscribe", "-n", "2"])
        .arg(&exe)
        .args(["--exact", "worker", "--nocapture", "--test-threads=1"])
        // Nothing of accel's contract: only what mpirun itself needs.
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env(
            "HOME",
            std::env::var_os("HOME").unwrap_or_else(|| "/root".into()),
        )
        .env("MPIRUN_DIRECT_WORKER", "1")
        .env("OMPI_MCA_mpi_yield_when_idle", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let out = two_ranks::finish(cmd.spawn().unwrap(), "mpirun", Duration::from_secs(90));
    let text = two_ranks::text(&out);
    assert!(out.status.success(), "{text}");
    two_ranks::assert_two_ranks_reduced(&text, "mpi");
}
