//! `accel launch` over several machines: two launcher processes on this box
//! (machine ranks 0 and 1), and the same across two network namespaces with
//! their own addresses when the test runs as root with `ip netns`.

mod common;

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
    // With cpu-gloo compiled in, the workers also connect a real backend
    // through accel::Accelerator across both machines.
    let gloo = cfg!(feature = "cpu-gloo");
    let prog: &[&str] = if gloo {
        &[ACCEL, "probe-worker", "--accelerator"]
    } else {
        &[ACCEL, "probe-worker"]
    };
    // Machine 1 first: it waits for machine 0's store.
    let m1 = start(machine(1, port, &["--token", "s3", "-n", "2"], prog));
    std::thread::sleep(Duration::from_millis(100));
    let m0 = start(machine(
        0,
        port,
        &["--token", "s3", "-n", "2", "--run-id", "two"],
        prog,
    ));
    let r0 = m0.finish(LIMIT);
    let r1 = m1.finish(LIMIT);
    r0.code_is(0);
    r1.code_is(0);
    let all: Vec<_> = probes(&r0.stdout, 0..2)
        .into_iter()
        .chain(probes(&r1.stdout, 2..4))
        .collect();
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

// ---- network namespaces ----

#[test]
fn two_machines_in_two_network_namespaces() {
    let ns = match Netns::create() {
        Ok(ns) => ns,
        Err(why) => {
            // CI runs as root with iproute2 (make setup): there the
            // network-namespace variant must run, not skip.
            assert!(
                std::env::var_os("CI").is_none(),
                "two_machines_in_two_network_namespaces cannot run in CI: {why}"
            );
            eprintln!("SKIPPED two_machines_in_two_network_namespaces: {why}");
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
        eprintln!("SKIPPED two_machines_over_ipv6: ::1 cannot be bound here");
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
