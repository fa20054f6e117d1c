//! The threads process model of `accel launch` (docs/adr/0015): one
//! process whose rank threads are the run's ranks, with the `[rank N]`
//! prefixes and the root-cause block of process launches; `--backend xla`
//! on the PJRT CPU plugin (skipped with the reason when the plugin is
//! missing, failed under CI), and cpu-gloo with
//! `ACCEL_PROCESS_MODEL=threads`. The pure-Rust training demo ends with the
//! same parameter checksum on xla rank threads as on cpu-gloo processes.
//! Every run is under a hard deadline.

mod common;
use accel_test_support::skips;

use common::*;

/// `true` when the xla backend can run here.
fn xla_or_skip(test: &str) -> bool {
    let reason = match accel::Registry::builtin().get("xla") {
        None => Some("the xla feature is not compiled in".to_string()),
        Some(e) => e
            .backend
            .probe(&accel::ProbeContext::single_process())
            .reason()
            .map(str::to_string),
    };
    if let Some(why) = &reason {
        skips::skip(&format!(
            "{test}: xla cannot run (run `make pjrt-setup`): {why}"
        ));
    }
    reason.is_none()
}

fn seen(r: &Run, rank: usize) -> serde_json::Value {
    let l = rank_lines(&r.stdout, rank);
    assert_eq!(l.len(), 1, "one line of rank {rank}\n{}", r.all());
    serde_json::from_str(&l[0]).unwrap_or_else(|e| panic!("{e}\n{}", r.all()))
}

/// Every rank's prefixed line, from one process, with its own state.
fn one_process_of_rank_threads(r: &Run, backend: &str, n: usize) {
    r.code_is(0);
    let pid = seen(r, 0)["pid"].clone();
    let sum = (1..=n).sum::<usize>() as f64;
    for rank in 0..n {
        let v = seen(r, rank);
        assert_eq!(
            v["pid"],
            pid,
            "every rank is a thread of one process\n{}",
            r.all()
        );
        assert_eq!(v["rank"], rank, "{}", r.all());
        assert_eq!(v["local_rank"], rank, "{}", r.all());
        assert_eq!(v["world_size"], n, "{}", r.all());
        assert_eq!(v["backend"], backend, "{}", r.all());
        assert_eq!(v["all_reduce_sum"], sum, "{}", r.all());
    }
}

/// `accel launch -n 3 --backend xla -- ACCEL <worker_args>`; `None` (after
/// saying why) where xla cannot run.
fn launch_xla3(test: &str, worker_args: &[&str]) -> Option<Run> {
    let args: Vec<&str> = std::iter::once(ACCEL)
        .chain(worker_args.iter().copied())
        .collect();
    xla_or_skip(test).then(|| accel(&argv("launch -n 3 --backend xla --", &args)))
}

#[test]
fn xla_ranks_are_threads_of_one_process() {
    let test = "xla_ranks_are_threads_of_one_process";
    let Some(r) = launch_xla3(test, &["probe-worker", "--accelerator"]) else {
        return;
    };
    one_process_of_rank_threads(&r, "xla", 3);
}

#[cfg(feature = "cpu-gloo")]
#[test]
fn any_backend_runs_as_threads_when_asked() {
    let mut c = command(&argv(
        "launch -n 2 --backend cpu-gloo --",
        &[ACCEL, "probe-worker", "--accelerator"],
    ));
    c.env("ACCEL_PROCESS_MODEL", "threads");
    let r = start(c).finish(LIMIT);
    one_process_of_rank_threads(&r, "cpu-gloo", 2);
}

#[test]
fn a_rank_thread_panic_is_the_root_cause() {
    let test = "a_rank_thread_panic_is_the_root_cause";
    let Some(r) = launch_xla3(test, &["probe-worker", "--panic-on-rank", "1"]) else {
        return;
    };
    assert_ne!(r.code, Some(0), "{}", r.all());
    r.has_stderr("rank:      1 (local rank 1)");
    r.has_stderr("error:     probe-worker: deliberate panic on rank 1");
    // The panic's message is rank 1's output, not the process's.
    r.has_stderr("[rank 1] probe-worker: deliberate panic on rank 1");
    r.has_stderr("at:        launcher/src/probe_cmd.rs:");
}

/// A bare abort() in one rank thread ends the process; the root cause
/// names that rank, not the process's first (issue 32).
#[cfg(feature = "cpu-gloo")]
#[test]
fn a_rank_thread_abort_is_blamed_on_its_rank() {
    let mut c = command(&argv(
        "launch -n 3 --backend cpu-gloo --",
        &[
            ACCEL,
            "probe-worker",
            "--accelerator",
            "--abort-on-rank",
            "2",
        ],
    ));
    c.env("ACCEL_PROCESS_MODEL", "threads");
    let r = start(c).finish(LIMIT);
    assert_ne!(r.code, Some(0), "{}", r.all());
    r.has_stderr("rank:      2 (local rank 2)");
    r.has_stderr("[rank 2] thread 'rank 2' aborted (SIGABRT)");
    r.lacks_stderr("no rank thread said which");
}

#[test]
fn bench_runs_on_xla_rank_threads() {
    if !xla_or_skip("bench_runs_on_xla_rank_threads") {
        return;
    }
    let r = accel_words("bench -n 2 --backend xla --op all_reduce --sizes 4K:8K --iters 2 --json");
    r.code_is(0);
    let v: serde_json::Value =
        serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}: {}", r.all()));
    assert_eq!(v["backend"], "xla", "{}", r.all());
    assert_eq!(v["world_size"], 2, "{}", r.all());
}

/// The demo's checksum on xla threads and on cpu-gloo processes (needs
/// cpu-gloo in the launcher).
#[cfg(feature = "cpu-gloo")]
mod demo {
    use std::path::Path;
    use std::time::Duration;

    use super::*;

    /// The demo on 2 ranks of `backend`: its final parameter checksum.
    fn train_checksum(backend: &str, dir: &Path) -> String {
        let ckpt = dir.join(backend);
        let r = start(command(&argv(
            &format!("launch -n 2 --backend {backend} --"),
            &[
                train_bin().to_str().expect("utf-8 path"),
                "--epochs",
                "2",
                "--train-len",
                "256",
                "--checkpoint-dir",
                ckpt.to_str().expect("utf-8 path"),
            ],
        )))
        .finish(Duration::from_secs(120));
        r.code_is(0);
        let on = format!("train: 2 ranks on {backend},");
        assert!(
            rank_lines(&r.stdout, 0).iter().any(|l| l.starts_with(&on)),
            "{on:?}\n{}",
            r.all()
        );
        let line = rank_lines(&r.stdout, 0)
            .into_iter()
            .find(|l| l.starts_with("final:"))
            .unwrap_or_else(|| panic!("no final line\n{}", r.all()));
        let sum = line
            .rsplit_once("params checksum ")
            .map(|(_, c)| c.trim().to_string())
            .unwrap_or_else(|| panic!("no checksum in {line:?}"));
        assert_eq!(sum.len(), 16, "{line}");
        sum
    }

    #[test]
    fn the_demo_ends_with_the_same_checksum_on_xla_threads_as_on_cpu_gloo() {
        if !xla_or_skip("the_demo_ends_with_the_same_checksum_on_xla_threads_as_on_cpu_gloo") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let gloo = train_checksum("cpu-gloo", dir.path());
        let xla = train_checksum("xla", dir.path());
        assert_eq!(xla, gloo, "xla rank threads vs cpu-gloo processes");
    }
}

#[test]
fn accel_env_keeps_the_pjrt_plugins_absl_lines_off_stderr_unless_logs_ask() {
    if !xla_or_skip("accel_env_keeps_the_pjrt_plugins_absl_lines_off_stderr_unless_logs_ask") {
        return;
    }
    let env = |args: &[&str]| {
        let mut c = command(args);
        c.env_remove("TF_CPP_MIN_LOG_LEVEL")
            .env_remove("RUST_LOG")
            .env_remove("ACCEL_LOG");
        start(c).finish(LIMIT)
    };
    let quiet = env(&["env"]);
    quiet.code_is(0);
    let row = env_row(&quiet.stdout, "xla");
    assert!(
        row.contains("yes"),
        "the probe loaded the plugin: {row}\n{}",
        quiet.all()
    );
    for absl in [
        "absl::InitializeLog",
        "cpu_device_count set via create_options",
    ] {
        assert!(
            !quiet.stderr.contains(absl),
            "{absl:?} on stderr\n{}",
            quiet.all()
        );
    }
    // Asked for: the plugin's own lines are shown.
    let loud = env(&["--log", "info", "env"]);
    loud.code_is(0);
    loud.has_stderr("cpu_device_count set via create_options");
}
