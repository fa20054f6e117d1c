//! accel under a real Slurm: a one-machine cluster (munge, slurmctld,
//! slurmd from Debian; scripts/slurm_cluster.sh) started and stopped by each
//! test. Needs root and `make slurm-setup`; without them the tests print why
//! and skip, and under CI they fail.
#![cfg(feature = "cpu-gloo")]

mod common;
use accel_test_support::skips;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/slurm_cluster.sh");

/// A running cluster, stopped (every daemon, every step) when dropped.
/// One at a time: the tests share the machine's one Slurm node name.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
    _one: std::sync::MutexGuard<'static, ()>,
}

static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

impl Cluster {
    fn start() -> Option<Cluster> {
        let root = skips::is_root();
        let have = ["slurmd", "slurmctld", "srun", "munged"].iter().all(|b| {
            Command::new("sh")
                .args(["-c", &format!("command -v {b}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        if !root || !have {
            skips::skip_needs_root(&format!(
                "a Slurm cluster needs root ({root}) and slurmd, slurmctld, srun, munged ({have}; `make slurm-setup`)"
            ));
            return None;
        }
        let one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
        let dir = tempfile::Builder::new()
            .prefix("accel-slurm-")
            .tempdir()
            .unwrap()
            .keep();
        let out = Command::new(SCRIPT)
            .arg("start")
            .arg(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the cluster did not start:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let conf = dir.join("slurm.conf");
        Some(Cluster {
            dir,
            conf,
            _one: one,
        })
    }

    /// A Slurm client command against this cluster, in a clean environment
    /// (no accel variable).
    fn cmd(&self, prog: &str, args: &[&str]) -> Command {
        let mut c = Command::new(prog);
        c.args(args)
            .env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env(
                "HOME",
                std::env::var_os("HOME").unwrap_or_else(|| "/root".into()),
            )
            .env("SLURM_CONF", &self.conf)
            .env("RUST_BACKTRACE", "0")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    }

    fn squeue_empty(&self) -> bool {
        self.cmd("squeue", &["-h"]).output().is_ok_and(|o| {
            o.status.success() && String::from_utf8_lossy(&o.stdout).trim().is_empty()
        })
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(SCRIPT).arg("stop").arg(&self.dir).status();
    }
}

/// Every rank's probe line says cpu-gloo and the sum over `n` ranks.
fn all_reduced(out: &str, n: usize) {
    all_reduced_on(out, n, "cpu-gloo");
}

/// Every rank's probe line says `backend` and the sum over `n` ranks.
fn all_reduced_on(out: &str, n: usize, backend: &str) {
    let want = (n * (n + 1) / 2) as f64;
    let lines: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| l.find('{').map(|i| &l[i..]))
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v.get("all_reduce_sum").is_some())
        .collect();
    assert_eq!(lines.len(), n, "{out}");
    for v in lines {
        assert_eq!(v["backend"], backend, "{out}");
        assert_eq!(v["all_reduce_sum"], want, "{out}");
    }
}

/// `srun [FLAGS] -n 2 accel probe-worker --accelerator` with `env`.
fn srun_probe(c: &Cluster, flags: &[&str], env: &[(&str, &str)]) -> Run {
    let mut args = flags.to_vec();
    args.extend_from_slice(&[
        "-n",
        "2",
        "--kill-on-bad-exit=1",
        ACCEL,
        "probe-worker",
        "--accelerator",
    ]);
    let mut cmd = c.cmd("srun", &args);
    cmd.envs(env.iter().copied());
    start(cmd).finish(Duration::from_secs(90))
}

#[test]
fn srun_alone_runs_an_accel_program_rank_0_hosting_the_store() {
    let Some(c) = Cluster::start() else { return };
    let r = srun_probe(&c, &[], &[]);
    r.code_is(0);
    all_reduced(&r.stdout, 2);
}

#[test]
fn srun_starts_one_accel_launch_per_node() {
    let Some(c) = Cluster::start() else { return };
    let r = start(c.cmd(
        "srun",
        &[
            "-N1",
            "-n1",
            ACCEL,
            "launch",
            "-n",
            "2",
            "--backend",
            "cpu-gloo",
            "--",
            ACCEL,
            "probe-worker",
            "--accelerator",
        ],
    ))
    .finish(Duration::from_secs(90));
    r.code_is(0);
    all_reduced(&r.stdout, 2);
}

/// `sbatch MODE` of a 2-task job script running `body` on `c`, its output
/// to `job.out` in the cluster's folder: the run (bounded by `limit`) and
/// that output file.
fn sbatch(c: &Cluster, mode: &str, body: &str, limit: Duration) -> (Run, PathBuf) {
    let (script, out) = (c.dir.join("job.sh"), c.dir.join("job.out"));
    std::fs::write(
        &script,
        format!("#!/bin/bash\n#SBATCH -n 2\n#SBATCH -t 5\n{body}\n"),
    )
    .unwrap();
    let args = [mode, "-o", out.to_str().unwrap(), script.to_str().unwrap()];
    (start(c.cmd("sbatch", &args)).finish(limit), out)
}

#[test]
fn the_documented_sbatch_script_runs() {
    let Some(c) = Cluster::start() else { return };
    // docs/multi-machine.md's script: srun starts the ranks, rank 0 hosts.
    let body = format!("srun {ACCEL} probe-worker --accelerator");
    let (r, out) = sbatch(&c, "--wait", &body, Duration::from_secs(120));
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    assert_eq!(r.code, Some(0), "{}\n{text}", r.all());
    all_reduced(&text, 2);
}

#[test]
fn scancel_ends_every_rank_and_leaves_no_process() {
    let Some(c) = Cluster::start() else { return };
    let pid = std::process::id();
    // Spelled so that only the ranks' own command lines (after `exec -a`)
    // contain the marker, not the launcher's or the shell's.
    let marker = format!("accel-scancel-{pid}");
    let (r, _) = sbatch(
        &c,
        "--parsable",
        &format!(
            // The step's output straight to a file (slurmstepd writes it, so
            // nothing is lost when srun itself is cancelled).
            "srun -n1 -o {step} -e {step_err} {ACCEL} launch -n 2 -- bash -c 'echo ready; exec -a accel-scancel-$(({pid})) sleep 600'",
            step = c.dir.join("step.out").display(),
            step_err = c.dir.join("step.err").display()
        ),
        Duration::from_secs(30),
    );
    r.code_is(0);
    let job = r.stdout.trim().split(';').next().unwrap().to_string();
    assert!(
        eventually(Duration::from_secs(30), || processes_with(&marker) == 2
            && std::fs::read_to_string(c.dir.join("step.out"))
                .is_ok_and(|t| t.matches("ready").count() == 2)),
        "the ranks did not start: {}",
        std::fs::read_to_string(c.dir.join("step.out")).unwrap_or_default()
    );
    let s = start(c.cmd("scancel", &[&job])).finish(Duration::from_secs(30));
    s.code_is(0);
    assert!(
        eventually(Duration::from_secs(30), || c.squeue_empty()),
        "the job is still queued"
    );
    assert!(
        eventually(Duration::from_secs(10), || processes_with(&marker) == 0),
        "{} rank process(es) left after scancel",
        processes_with(&marker)
    );
    // What the launcher prints on SIGTERM ("received SIGTERM, forwarding
    // it") is not asserted: under load slurmstepd stops forwarding the
    // step's output when it cancels the step, before the launcher writes.
}

/// The mpi backend under `srun --mpi=pmix` (Debian's Slurm 22.05 offers
/// pmix_v4, and Debian's Open MPI 4.1 initializes through it): srun's PMIx
/// server starts MPI, no mpirun. `--mpi=pmi2` is offered by Slurm too, but
/// Debian's Open MPI is built without Slurm's PMI-2 support: MPI_Init
/// aborts before accel runs ("Local abort before MPI_INIT completed"), so
/// it is not tested. Needs the launcher's `mpi` feature (make test runs
/// this file with it too).
#[cfg(feature = "mpi")]
#[test]
fn srun_mpi_pmix_runs_the_mpi_backend() {
    let Some(c) = Cluster::start() else { return };
    let r = srun_probe(&c, &["--mpi=pmix"], &[("ACCEL_BACKEND", "mpi")]);
    r.code_is(0);
    all_reduced_on(&r.stdout, 2, "mpi");
}
