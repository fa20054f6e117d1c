//! The flight recorder end to end: hangs made on purpose by `accel
//! flight-worker` under `accel launch` (cpu-gloo, and mpi through mpirun),
//! their dumps read back with `accel trace --json`; `accel dump` against a
//! healthy job; the `--timeline` file parsed as a Chrome trace. Each run is
//! bounded (`--timeout 3s`, a hard limit on the launcher). Cost: about 4 s
//! per cpu-gloo hang, 5-7 s per mpi one (mpirun's teardown), 4-5 s per
//! dump test; the tests run in parallel.
// Without an engine feature only the refusals run.
#![cfg_attr(not(any(feature = "cpu-gloo", feature = "mpi")), allow(dead_code))]

mod common;
#[cfg(feature = "mpi")]
use accel_test_support::skips;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// The hard limit of one launcher run here.
const HANG_LIMIT: Duration = Duration::from_secs(60);

/// `accel launch -n N --backend B --timeout 3s --dump-dir DIR --
/// accel flight-worker ARGS`.
fn hang(backend: &str, n: usize, dumps: &Path, worker: &[&str]) -> Run {
    let n = n.to_string();
    let mut args = vec![
        "launch",
        "-n",
        &n,
        "--backend",
        backend,
        "--timeout",
        "3s",
        "--dump-dir",
        dumps.to_str().unwrap(),
        "--",
        ACCEL,
        "flight-worker",
    ];
    args.extend(worker);
    start(command(&args)).finish(HANG_LIMIT)
}

/// `accel trace DIR --json [more]`, parsed.
fn trace_json(dumps: &Path, more: &[&str]) -> Value {
    let mut args = vec!["trace", dumps.to_str().unwrap(), "--json"];
    args.extend(more);
    let r = accel(&args);
    r.code_is(0);
    serde_json::from_str(&r.stdout).unwrap_or_else(|e| panic!("{e}\n{}", r.all()))
}

fn group<'a>(t: &'a Value, name: &str) -> &'a Value {
    t["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no group {name} in {t:#}"))
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

/// Rank 2 of 3 skipped all-reduce #3: the trace names it and the
/// sequence number, and ranks 0 and 1 wait for it. Rank 2 either dumped
/// (the launcher asked it to, after the first failure) and never issued
/// #3, or left no dump (mpirun ended it first).
fn skipped_rank_is_named(r: &Run, dumps: &Path) -> Value {
    assert!(r.code.is_some_and(|c| c != 0), "{}", r.all());
    r.has_stderr("flight-recorder dump(s) in");
    r.has_stderr(&format!("accel trace {}", dumps.display()));
    let t = trace_json(dumps, &[]);
    let w = group(&t, "world");
    let d = &w["divergence"];
    assert_eq!(
        (d["seq"].as_u64(), d["kind"].as_str()),
        (Some(3), Some("missing")),
        "{t:#}"
    );
    let sides = d["sides"].as_array().unwrap();
    assert_eq!(sides[0]["call"]["op"], "all_reduce", "{t:#}");
    assert_eq!(usizes(&sides[0]["ranks"]), vec![0, 1], "{t:#}");
    let never: Vec<usize> = sides[1..]
        .iter()
        .filter(|s| s["call"].is_null())
        .flat_map(|s| usizes(&s["ranks"]))
        .chain(usizes(&d["no_dump"]))
        .collect();
    assert_eq!(never, vec![2], "{t:#}");
    for rank in [0, 1] {
        let s = t["stuck"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["rank"] == rank && s["group"] == "world")
            .unwrap_or_else(|| panic!("rank {rank} is not inside a collective: {t:#}"));
        assert_eq!(s["seq"], 3, "{t:#}");
        assert_eq!(usizes(&s["waiting_for_ranks"]), vec![2], "{t:#}");
    }
    // The same in words.
    let words = accel(&["trace", dumps.to_str().unwrap()]);
    words.code_is(0);
    words.has_stdout("first divergence at #3");
    words.has_stdout("waiting for rank(s) 2");
    t
}

/// Ranks 0 and 1 each wait in a sub-group the other has not entered.
fn crossed_sub_groups_are_shown(r: &Run, dumps: &Path) {
    assert!(r.code.is_some_and(|c| c != 0), "{}", r.all());
    let t = trace_json(dumps, &[]);
    let subs: Vec<&Value> = t["groups"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["name"] != "world")
        .collect();
    assert_eq!(subs.len(), 2, "{t:#}");
    let mut issuers = Vec::new();
    for g in &subs {
        let d = &g["divergence"];
        assert_eq!(
            (d["seq"].as_u64(), d["kind"].as_str()),
            (Some(0), Some("missing")),
            "{t:#}"
        );
        let sides = d["sides"].as_array().unwrap();
        assert_eq!(sides.len(), 2, "{t:#}");
        assert!(sides[1]["call"].is_null(), "{t:#}");
        let (did, not) = (usizes(&sides[0]["ranks"]), usizes(&sides[1]["ranks"]));
        assert_eq!(did.len() + not.len(), 2, "{t:#}");
        assert_ne!(did, not, "{t:#}");
        issuers.extend(did);
    }
    issuers.sort_unstable();
    assert_eq!(
        issuers,
        vec![0, 1],
        "each sub-group has the other issuer: {t:#}"
    );
    assert_eq!(t["cycles"], serde_json::json!([[0, 1]]), "{t:#}");
    let words = accel(&["trace", dumps.to_str().unwrap()]);
    words.has_stdout("crossed: rank 0 -> rank 1 -> rank 0");
}

/// A healthy 2-rank job asked to dump by `accel dump --pid`: every rank
/// dumps, the job goes on and finishes; the trace finds no divergence.
fn a_healthy_job_dumps_on_request(backend: &str) {
    let logs = tempfile::tempdir().unwrap();
    let launcher = start(command(&[
        "launch",
        "-n",
        "2",
        "--backend",
        backend,
        "--timeout",
        "3s",
        "--tee",
        logs.path().to_str().unwrap(),
        "--",
        ACCEL,
        "flight-worker",
        "--scenario",
        "steady",
        "--steps",
        "40",
        "--step-ms",
        "100",
    ]));
    let ready = |rank: usize| {
        std::fs::read_to_string(logs.path().join(format!("rank-{rank}.log")))
            .is_ok_and(|l| l.contains("ready"))
    };
    assert!(
        eventually(Duration::from_secs(30), || ready(0) && ready(1)),
        "the ranks never got ready"
    );
    let pid = launcher.pid().to_string();
    let d = accel(&["dump", "--pid", &pid, "--wait", "10s"]);
    d.code_is(0);
    // Default folder: `dumps` under the logs.
    let dumps = logs.path().join("dumps");
    d.has_stderr(&format!("dumps go to {}", dumps.display()));
    let r = launcher.finish(HANG_LIMIT);
    r.code_is(0);
    assert_eq!(
        rank_lines(&r.stdout, 0).last().map(String::as_str),
        Some("done")
    );
    assert_eq!(
        rank_lines(&r.stdout, 1).last().map(String::as_str),
        Some("done")
    );
    r.has_stderr("received SIGUSR1");
    let t = trace_json(&dumps, &[]);
    let reasons: Vec<&str> = t["dumps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    assert_eq!(reasons, vec!["signal: SIGUSR1"; 2], "{t:#}");
    let w = group(&t, "world");
    assert!(w["divergence"].is_null(), "{t:#}");
    assert_eq!(w["members"].as_array().unwrap().len(), 2, "{t:#}");
}

#[test]
fn accel_dump_without_a_running_launcher_says_so() {
    let r = accel(&["dump", "--pid", "1"]);
    assert_eq!(r.code, Some(2), "{}", r.all());
    r.has_stderr("process 1 is no running accel launch");
}

#[test]
fn accel_trace_of_a_folder_without_dumps_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let r = accel(&["trace", dir.path().to_str().unwrap()]);
    assert_eq!(r.code, Some(2), "{}", r.all());
    r.has_stderr("holds no flight-recorder dump");
}

#[cfg(feature = "cpu-gloo")]
#[test]
fn gloo_a_skipped_all_reduce_is_named_and_the_timeline_is_a_chrome_trace() {
    let dir = tempfile::tempdir().unwrap();
    let dumps = dir.path().join("dumps");
    let r = hang(
        "cpu-gloo",
        3,
        &dumps,
        &["--scenario", "skip", "--rank", "2", "--at", "3"],
    );
    // The launcher asked rank 2, busy in its other branch, to dump.
    r.has_stderr("asking the other");
    let t = skipped_rank_is_named(&r, &dumps);
    assert!(
        t["ranks_without_dump"].as_array().unwrap().is_empty(),
        "{}\n{t:#}",
        r.all()
    );
    let timeline = dir.path().join("timeline.json");
    trace_json(&dumps, &["--timeline", timeline.to_str().unwrap()]);
    let v: Value = serde_json::from_slice(&std::fs::read(&timeline).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().expect("a traceEvents array");
    for e in events {
        for k in ["ph", "ts", "pid", "tid"] {
            assert!(e.get(k).is_some(), "no {k} in {e}");
        }
    }
    let mut tracks: Vec<u64> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| e["pid"].as_u64().unwrap())
        .collect();
    tracks.sort_unstable();
    assert_eq!(tracks, vec![0, 1, 2], "one track per rank");
    let calls: Vec<&Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(
        calls.iter().all(|e| e["dur"].is_u64()),
        "complete events have a duration"
    );
    for rank in 0..3u64 {
        assert!(
            calls.iter().any(|e| e["pid"] == rank),
            "rank {rank}'s calls"
        );
    }
}

#[cfg(feature = "cpu-gloo")]
#[test]
fn gloo_sub_groups_called_in_opposite_orders_are_crossed() {
    let dir = tempfile::tempdir().unwrap();
    let dumps = dir.path().join("dumps");
    let r = hang("cpu-gloo", 3, &dumps, &["--scenario", "crossed"]);
    crossed_sub_groups_are_shown(&r, &dumps);
}

#[cfg(feature = "cpu-gloo")]
#[test]
fn gloo_accel_dump_makes_a_healthy_job_dump_and_it_goes_on() {
    a_healthy_job_dumps_on_request("cpu-gloo");
}

/// Return from the test (saying why) where mpirun is missing.
#[cfg(feature = "mpi")]
fn mpirun_available() -> bool {
    skips::or_skip_mpirun(accel_launch::mpirun::available())
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_a_skipped_all_reduce_is_named() {
    if !mpirun_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dumps = dir.path().join("dumps");
    let r = hang(
        "mpi",
        3,
        &dumps,
        &["--scenario", "skip", "--rank", "2", "--at", "3"],
    );
    skipped_rank_is_named(&r, &dumps);
}

#[cfg(feature = "mpi")]
#[test]
fn mpi_sub_groups_called_in_opposite_orders_are_crossed() {
    if !mpirun_available() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dumps = dir.path().join("dumps");
    let r = hang("mpi", 3, &dumps, &["--scenario", "crossed"]);
    crossed_sub_groups_are_shown(&r, &dumps);
}

/// SIGUSR1 reaches the ranks through the guard and mpirun.
#[cfg(feature = "mpi")]
#[test]
fn mpi_accel_dump_makes_a_healthy_job_dump_and_it_goes_on() {
    if !mpirun_available() {
        return;
    }
    a_healthy_job_dumps_on_request("mpi");
}
