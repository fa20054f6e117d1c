//! A program started by `mpirun -n 2` directly, with no accel variable at
//! all (no MASTER_ADDR, no ACCEL_*): the mpi backend needs no store, so
//! `Accelerator::new()` connects and all-reduces. This test binary starts
//! copies of itself under mpirun; `worker` does the work when
//! `MPIRUN_DIRECT_WORKER` is set and nothing otherwise.
#![cfg(feature = "mpi")]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[test]
fn worker() {
    if std::env::var_os("MPIRUN_DIRECT_WORKER").is_none() {
        return;
    }
    let acc = accel::Accelerator::new().expect("connect under plain mpirun");
    let mut v = vec![(acc.rank() + 1) as f32; 4];
    acc.all_reduce(&mut v, accel::ReduceOp::Sum)
        .expect("all_reduce");
    println!(
        "RESULT rank={} world={} backend={} sum={}",
        acc.rank(),
        acc.world_size(),
        acc.backend_name(),
        v[0]
    );
}

#[test]
fn mpirun_alone_runs_an_accel_program_without_any_accel_variable() {
    let ok = Command::new("mpirun")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "mpirun not found under CI"
        );
        eprintln!("skipped: mpirun not found");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    let root = std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"));
    if root {
        cmd.arg("--allow-run-as-root");
    }
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
    let mut child = cmd.spawn().unwrap();
    let end = Instant::now() + Duration::from_secs(90);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > end {
            let _ = child.kill();
            panic!("mpirun did not finish within 90 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    for rank in 0..2 {
        assert!(
            text.contains(&format!("RESULT rank={rank} world=2 backend=mpi sum=3")),
            "{text}"
        );
    }
}
