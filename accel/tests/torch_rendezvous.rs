//! accel programs started the ways PyTorch users start programs, meeting
//! through torch's TCPStore protocol (docs/adr/0019-torch-store.md):
//! * RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand (Kubeflow's
//!   PyTorchJob): rank 0 hosts the store;
//! * plain `mpirun` on cpu-gloo with MASTER_ADDR/MASTER_PORT: the same;
//! * `torchrun --no-python`: torchrun's agent hosts the store.
//!
//! This test binary starts copies of itself; `worker` does the work when
//! `TORCH_RDZV_WORKER` is set and nothing otherwise.
#![cfg(feature = "cpu-gloo")]

use accel_test_support::skips;
#[path = "common/two_ranks.rs"]
mod two_ranks;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use two_ranks::{assert_two_ranks_reduced, finish, text};

#[test]
fn worker() {
    if std::env::var_os("TORCH_RDZV_WORKER").is_some() {
        two_ranks::reduce_and_report();
    }
}

use accel_test_support::free_port;

/// A clean environment: only what a process needs, none of accel's contract.
fn bare(cmd: &mut Command) -> &mut Command {
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env(
            "HOME",
            std::env::var_os("HOME").unwrap_or_else(|| "/root".into()),
        )
        .env("TORCH_RDZV_WORKER", "1")
        .env("ACCEL_BACKEND", "cpu-gloo")
        .env("ACCEL_TIMEOUT", "30s")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

fn worker_args(cmd: &mut Command) -> &mut Command {
    cmd.args(["--exact", "worker", "--nocapture", "--test-threads=1"])
}

#[test]
fn variables_set_by_hand_meet_at_a_store_rank_0_hosts() {
    let exe = std::env::current_exe().unwrap();
    let port = free_port().to_string();
    let children: Vec<Child> = (0..2)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            bare(&mut cmd)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port);
            worker_args(&mut cmd).spawn().unwrap()
        })
        .collect();
    let mut all = String::new();
    for (r, c) in children.into_iter().enumerate() {
        let out = finish(c, &format!("rank {r}"), Duration::from_secs(60));
        let t = text(&out);
        assert!(out.status.success(), "rank {r} failed:\n{t}");
        all.push_str(&t);
    }
    assert_two_ranks_reduced(&all, "cpu-gloo");
}

#[test]
fn a_busy_master_port_is_named_on_rank_0() {
    let exe = std::env::current_exe().unwrap();
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let mut cmd = Command::new(&exe);
    bare(&mut cmd)
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .env("ACCEL_TIMEOUT", "5s");
    let out = finish(
        worker_args(&mut cmd).spawn().unwrap(),
        "rank 0",
        Duration::from_secs(30),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(
        t.contains(&format!("MASTER_PORT={port}")) && t.contains("in use"),
        "{t}"
    );
}

#[test]
fn plain_mpirun_on_cpu_gloo_meets_at_a_store_rank_0_hosts() {
    if !skips::mpirun_or_skip() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new("mpirun");
    bare(&mut cmd);
    skips::allow_root(&mut cmd);
    let port = free_port().to_string();
    cmd.args([
        "--oversubscribe",
        "-n",
        "2",
        "-x",
        "TORCH_RDZV_WORKER",
        "-x",
        "ACCEL_BACKEND",
        "-x",
        "ACCEL_TIMEOUT",
    ])
    .args(["-x", "MASTER_ADDR=127.0.0.1", "-x"])
    .arg(format!("MASTER_PORT={port}"))
    .arg(&exe)
    .env("OMPI_MCA_mpi_yield_when_idle", "1");
    worker_args(&mut cmd);
    let out = finish(cmd.spawn().unwrap(), "mpirun", Duration::from_secs(90));
    let t = text(&out);
    assert!(out.status.success(), "mpirun failed:\n{t}");
    assert_two_ranks_reduced(&t, "cpu-gloo");
}

/// torchrun from the torch venv (`make torch-venv`), or `None` with the reason.
fn torchrun() -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.accel-cache/torch-venv/bin");
    let dir = std::env::var_os("ACCEL_TORCH_PYTHON")
        .and_then(|p| PathBuf::from(p).parent().map(Path::to_path_buf))
        .unwrap_or(venv);
    let t = dir.join("torchrun");
    if t.exists() {
        return Some(t);
    }
    skips::skip(&format!(
        "no torchrun at {} (`make torch-venv` makes it)",
        t.display()
    ));
    None
}

#[test]
fn an_accel_program_runs_under_torchrun_on_its_agent_store() {
    let Some(torchrun) = torchrun() else { return };
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(&torchrun);
    bare(&mut cmd)
        .args(["--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(&exe);
    worker_args(&mut cmd);
    let out = finish(cmd.spawn().unwrap(), "torchrun", Duration::from_secs(120));
    let t = text(&out);
    assert!(out.status.success(), "torchrun failed:\n{t}");
    assert_two_ranks_reduced(&t, "cpu-gloo");
}
