//! `accel launch` over several machines: two launcher processes on this box
//! (machine ranks 0 and 1), and the same across two network namespaces with
//! their own addresses when the test runs as root with `ip netns`.

mod common;

use accel_test_support::free_port;
use std::process::Command;
use std::time::Duration;

use common::netns::Netns;
use common::*;

fn machine(rank: usize, port: u16, extra: &[&str], program: &[&str]) -> Command {
    let rank = rank.to_string();
    let port = port.to_string();
    let mut args = machine_args("2", &rank, "127.0.0.1", &port);
    if !extra.contains(&"--join-timeout") {
        args.extend_from_slice(&["--join-timeout", "10s"]);
    }
    args.extend_from_slice(extra);
    args.push("--");
    args.extend_from_slice(program);
    command(&args)
}

/// Machines 0 and 1, with `flags[0]` and `flags[1]`, running `program`
/// (started in that order): their runs, once both ended.
fn two_machines(port: u16, flags: [&[&str]; 2], program: &[&str]) -> (Run, Run) {
    let m0 = start(machine(0, port, flags[0], program));
    let m1 = start(machine(1, port, flags[1], program));
    (m0.finish(LIMIT), m1.finish(LIMIT))
}

/// The probe worker; with cpu-gloo compiled in, the workers also connect a
/// real backend through accel::Accelerator across the machines.
fn probe_program() -> &'static [&'static str] {
    if cfg!(feature = "cpu-gloo") {
        &[ACCEL, "probe-worker", "--accelerator"]
    } else {
        &[ACCEL, "probe-worker"]
    }
}

fn probes(stdout: &str, ranks: std::ops::Range<usize>) -> Vec<serde_json::Value> {
    ranks
        .map(|r| {
            let l = rank_lines(stdout, r);
            assert_eq!(l.len(), 1, "rank {r} in\n{stdout}");
            serde_json::from_str(&l[0]).unwrap()
        })
        .collect()
}

#[test]
fn two_machines_on_one_box_agree_on_ranks_and_run_id() {
    let port = free_port();
    let prog = probe_program();
    // Machine 1 first: it waits for machine 0's store.
    let m1 = start(machine(1, port, &["--token", "s3", "-n", "2"], prog));
    std::thread::sleep(Duration::from_millis(100));
    let m0 = start(machine(
        0,
        port,
        &["--token", "s3", "-n", "2", "--run-id", "two"],
        prog,
    ));
    let all = four_probes(m0, m1);
    for (i, v) in all.iter().enumerate() {
        assert_eq!(v["rank"], i);
        assert_eq!(v["world_size"], 4);
        assert_eq!(v["local_rank"], i % 2);
        assert_eq!(v["local_world_size"], 2);
        assert_eq!(v["node_rank"], i / 2);
        assert_eq!(v["run_id"], "two", "machine 0 decides the run id");
        assert_eq!(v["store"], format!("tcp://127.0.0.1:{port}"));
        assert!(
            v["barrier_ms"].is_number(),
            "the barrier spans both machines"
        );
    }
}

#[test]
fn a_failure_on_one_machine_stops_the_other_and_both_report_it() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $$ > {}/w-$RANK.pid; if [ $RANK = 3 ]; then sleep 0.3; echo 'rank three broke' >&2; exit 7; fi; exec sleep 600",
        dir.path().display()
    );
    let prog = ["sh", "-c", &script];
    let flags: &[&str] = &["--token", "t", "-n", "2"];
    let (r0, r1) = two_machines(port, [flags, flags], &prog);
    for r in [&r0, &r1] {
        r.code_is(7);
        r.has_stderr("rank:      3 (local rank 1)");
        r.has_stderr("  | rank three broke");
        assert!(r.elapsed < Duration::from_secs(8), "{}", r.all());
    }
    r0.has_stderr("a worker on machine 1 failed");
    for pid in pids_in(dir.path()) {
        assert_gone(pid, "pid {pid} left");
    }
}

#[test]
fn restarts_are_coordinated_across_machines() {
    let port = free_port();
    let prog = [
        "sh",
        "-c",
        "echo try $ACCEL_RESTART_COUNT; if [ $RANK = 1 ] && [ $ACCEL_RESTART_COUNT = 0 ]; then exit 3; fi",
    ];
    // Machine 1 follows machine 0's --max-restarts.
    let flags: [&[&str]; 2] = [
        &["--token", "t", "--max-restarts", "2"],
        &["--token", "t", "-n", "1"],
    ];
    let (r0, r1) = two_machines(port, flags, &prog);
    for r in [&r0, &r1] {
        r.code_is(0);
        r.has_stderr("attempt 1: succeeded");
    }
    assert_eq!(
        rank_lines(&r1.stdout, 1),
        ["try 0", "try 1"],
        "{}",
        r1.all()
    );
}

#[test]
fn a_wrong_token_is_refused_on_both_sides() {
    let port = free_port();
    let m0 = start(machine(
        0,
        port,
        &["--token", "right", "--join-timeout", "2s"],
        &["true"],
    ));
    std::thread::sleep(Duration::from_millis(100));
    let r1 = start(machine(1, port, &["--token", "wrong"], &["true"])).finish(LIMIT);
    let r0 = m0.finish(LIMIT);
    r1.code_is(1);
    r1.has_stderr("machine 1 cannot join the run");
    r1.has_stderr("refused this machine's token");
    assert_ne!(r0.code, Some(0), "{}", r0.all());
    r0.has_stderr("refused a connection");
    r0.has_stderr("token does not match");
    r0.has_stderr("machine(s) 1 did not join");
}

#[test]
fn a_machine_with_another_world_size_is_refused_on_both_sides() {
    let port = free_port();
    let flags: [&[&str]; 2] = [&["--token", "t", "-n", "2"], &["--token", "t", "-n", "3"]];
    let (r0, r1) = two_machines(port, flags, &["true"]);
    r0.code_is(2);
    r1.code_is(2);
    let why = "expects world size 6 (3 processes x 2 machines), but machine 0 runs world size 4";
    r0.has_stderr("refused machine 1");
    r0.has_stderr(why);
    r1.has_stderr("machine 0 refused this machine");
    r1.has_stderr(why);
}

/// Two machines whose programs save into different folders (as two
/// machines with a disk each would): the first save fails on every rank,
/// naming rank 1 and the folder, and leaves the previous checkpoint the
/// newest, from which a run with one shared folder resumes (ADR 0029).
#[test]
fn a_save_into_folders_that_are_not_shared_fails_on_every_rank_naming_the_missing_rank() {
    let train = train_bin();
    let dir = tempfile::tempdir().unwrap();
    let (shared, own) = (dir.path().join("shared"), dir.path().join("own"));
    let run = |folders: [&std::path::Path; 2], flags: &str| {
        let port = free_port();
        let prog = |f: &std::path::Path| {
            let mut p = vec![train.to_str().unwrap().to_string()];
            p.extend(
                format!("--epochs 1 --train-len 64 --eval-len 8 --batch-size 4 --accumulation 1 --save-every 2 {flags}")
                    .split_whitespace()
                    .map(str::to_string),
            );
            p.extend(["--checkpoint-dir".into(), f.display().to_string()]);
            p
        };
        let (p0, p1) = (prog(folders[0]), prog(folders[1]));
        let p0: Vec<&str> = p0.iter().map(String::as_str).collect();
        let p1: Vec<&str> = p1.iter().map(String::as_str).collect();
        let flags: &[&str] = &["--token", "t", "-n", "1", "--backend", "cpu-gloo"];
        let m0 = start(machine(0, port, flags, &p0));
        let m1 = start(machine(1, port, flags, &p1));
        (m0.finish(LIMIT), m1.finish(LIMIT))
    };
    let listing = |d: &std::path::Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap_or_else(|e| panic!("{}: {e}", d.display()))
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    // One shared folder: checkpoint_0 at step 2.
    let (r0, r1) = run([&shared, &shared], "--stop-after 2");
    r0.code_is(0);
    r1.code_is(0);
    assert_eq!(listing(&shared), ["checkpoint_0"], "{}", r0.all());
    // Machine 1 gets a folder of its own (a copy, as a synced disk would
    // hold): the resume reads, the next save cannot be complete.
    let cp = std::process::Command::new("cp")
        .arg("-r")
        .arg(&shared)
        .arg(&own)
        .status()
        .unwrap();
    assert!(cp.success());
    let (r0, r1) = run([&shared, &own], "--resume --stop-after 4");
    let why = "the files of rank 1 (machine 1) are not in";
    for r in [&r0, &r1] {
        assert_ne!(r.code, Some(0), "{}", r.all());
        r.has_stderr(why);
        r.has_stderr("not one folder that every rank sees");
    }
    // Machine 1 says rank 0 failed: in its rank's own save error, or, when
    // its launcher stopped that rank first, in the launcher's line.
    assert!(
        r1.stderr.contains("rank 0 failed")
            || r1.stderr.contains("a worker on machine 0 failed: rank 0"),
        "{}",
        r1.all()
    );
    assert_eq!(listing(&shared), ["checkpoint_0"], "{}", r0.all());
    assert_eq!(listing(&own), ["checkpoint_0"], "{}", r1.all());
    // The previous checkpoint is still the newest: resume from it.
    let (r0, r1) = run([&shared, &shared], "--resume --stop-after 4");
    r0.code_is(0);
    r1.code_is(0);
    r0.has_stdout("resumed from");
    r0.has_stdout("checkpoint_0 at step 2");
    assert_eq!(
        listing(&shared),
        ["checkpoint_0", "checkpoint_1"],
        "{}",
        r0.all()
    );
}

// ---- network namespaces ----

#[test]
fn two_machines_in_two_network_namespaces() {
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(why) => {
            // make test and CI run as root with iproute2 (make setup): there
            // the network-namespace variant must run, not skip.
            accel_test_support::skips::skip_needs_root(&why.to_string());
            return;
        }
    };
    let in_ns = |ns: &str, rank: &str| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, ACCEL])
            .args(machine_args("2", rank, "10.231.7.1", "29555"))
            .args(argv(
                "--token netns-token --join-timeout 10s -n 2 --",
                &[ACCEL, "probe-worker"],
            ));
        clean(&mut c);
        c
    };
    let m1 = start(in_ns(&ns.names[1], "1"));
    let m0 = start(in_ns(&ns.names[0], "0"));
    let r0 = m0.finish(LIMIT);
    let r1 = m1.finish(LIMIT);
    r0.code_is(0);
    r1.code_is(0);
    for (i, v) in probes(&r0.stdout, 0..2)
        .into_iter()
        .chain(probes(&r1.stdout, 2..4))
        .enumerate()
    {
        assert_eq!(v["rank"], i);
        assert_eq!(v["world_size"], 4);
        assert_eq!(v["store"], "tcp://10.231.7.1:29555");
        assert!(v["barrier_ms"].is_number());
    }
}

#[test]
fn two_machines_over_ipv6() {
    let Ok(l) = std::net::TcpListener::bind("[::1]:0") else {
        accel_test_support::skips::skip_absent_hardware(
            "::1 cannot be bound here (no IPv6 loopback)",
        );
        return;
    };
    let port = l.local_addr().unwrap().port().to_string();
    drop(l);
    let m = |rank: &str| {
        command(&argv(
            "launch --num-machines 2 --machine-rank",
            &[
                rank,
                "--main-process-ip",
                "::1",
                "--main-process-port",
                &port,
                "--token",
                "v6",
                "--",
                ACCEL,
                "probe-worker",
            ],
        ))
    };
    let m0 = start(m("0"));
    let r1 = start(m("1")).finish(LIMIT);
    let r0 = m0.finish(LIMIT);
    r0.code_is(0);
    r1.code_is(0);
    let v = &probes(&r1.stdout, 1..2)[0];
    assert_eq!(v["store"], format!("tcp://[::1]:{port}"));
    assert!(v["barrier_ms"].is_number());
}

/// Two "pods" of a Kubeflow TrainJob: each launcher gets only what
/// Kubeflow Trainer's torch runtime gives it (`PET_*`) and the run's token
/// (from a Secret), and runs `accel launch -- prog` without flags.
#[test]
fn kubeflow_pet_variables_alone_run_a_4_rank_job() {
    cluster_env_job(|machine, port| {
        vec![
            ("PET_NNODES", "2".to_string()),
            ("PET_NPROC_PER_NODE", "2".to_string()),
            ("PET_NODE_RANK", machine.to_string()),
            ("PET_MASTER_ADDR", "127.0.0.1".to_string()),
            ("PET_MASTER_PORT", port.to_string()),
        ]
    });
}

/// Two SkyPilot nodes: `SKYPILOT_NODE_IPS`, `SKYPILOT_NODE_RANK` and
/// `SKYPILOT_NUM_GPUS_PER_NODE` (2 "GPUs" each: two ranks per machine);
/// the port is the launcher's multi-machine default unless given.
#[test]
fn skypilot_variables_alone_run_a_4_rank_job() {
    cluster_env_job(|machine, port| {
        vec![
            ("SKYPILOT_NODE_IPS", "127.0.0.1\n127.0.0.1\n".to_string()),
            ("SKYPILOT_NODE_RANK", machine.to_string()),
            ("SKYPILOT_NUM_GPUS_PER_NODE", "2".to_string()),
            // Not SkyPilot's: a free port instead of 29500 for the test.
            ("PET_MASTER_PORT", port.to_string()),
        ]
    });
}

/// `accel launch -- probe-worker` twice with no flags, each with `vars`:
/// ranks 0-3 once each, at world size 4.
fn cluster_env_job(vars: impl Fn(usize, u16) -> Vec<(&'static str, String)>) {
    let port = free_port();
    let prog = probe_program();
    let pod = |machine: usize| {
        let mut args = vec!["launch", "--join-timeout", "20s", "--"];
        args.extend_from_slice(prog);
        let mut cmd = command(&args);
        cmd.env("ACCEL_RUN_TOKEN", "from-a-secret");
        for (k, v) in vars(machine, port) {
            cmd.env(k, v);
        }
        start(cmd)
    };
    let m1 = pod(1);
    std::thread::sleep(Duration::from_millis(100));
    let m0 = pod(0);
    for (i, v) in four_probes(m0, m1).iter().enumerate() {
        assert_eq!(v["rank"], i);
        assert_eq!(v["world_size"], 4);
        assert_eq!(v["node_rank"], i / 2);
    }
}

/// Machines 0 and 1 of 2 × 2 probe workers, both succeeded: ranks 0-3's
/// probe lines, machine 0's first.
fn four_probes(m0: Running, m1: Running) -> Vec<serde_json::Value> {
    let (r0, r1) = (m0.finish(LIMIT), m1.finish(LIMIT));
    r0.code_is(0);
    r1.code_is(0);
    probes(&r0.stdout, 0..2)
        .into_iter()
        .chain(probes(&r1.stdout, 2..4))
        .collect()
}

/// torchrun's c10d launch, started twice as torchrun users do, with no
/// `--node-rank`: the launcher that can listen at the endpoint hosts the
/// rendezvous and is machine 0, the other gets machine rank 1 from it;
/// ranks 0-3 each run once, at world size 4.
#[test]
fn c10d_launchers_without_a_node_rank_get_their_ranks_from_the_rendezvous() {
    let port = free_port();
    let endpoint = format!("127.0.0.1:{port}");
    let launcher = || {
        let mut args = vec![
            "launch",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            &endpoint,
            "--rdzv-id",
            "j1",
            "--join-timeout",
            "20s",
            "--",
        ];
        args.extend_from_slice(&[ACCEL, "probe-worker"]);
        let mut cmd = command(&args);
        cmd.env("ACCEL_RUN_TOKEN", "t");
        start(cmd)
    };
    let first = launcher();
    std::thread::sleep(Duration::from_millis(300));
    let second = launcher();
    let (a, b) = (first.finish(LIMIT), second.finish(LIMIT));
    a.code_is(0);
    b.code_is(0);
    let mut seen: Vec<(u64, u64)> = [&a, &b]
        .iter()
        .flat_map(|r| {
            (0..4).flat_map(move |rank| {
                rank_lines(&r.stdout, rank)
                    .into_iter()
                    .map(|l| serde_json::from_str::<serde_json::Value>(&l).unwrap())
            })
        })
        .map(|v| {
            assert_eq!(v["world_size"], 4, "{v}");
            (
                v["rank"].as_u64().unwrap(),
                v["node_rank"].as_u64().unwrap(),
            )
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        [(0, 0), (1, 0), (2, 1), (3, 1)],
        "{}\n{}",
        a.all(),
        b.all()
    );
}
