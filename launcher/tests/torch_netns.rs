//! torchrun's multi-machine rendezvous (`--nnodes 2 --rdzv-backend c10d`)
//! across two network-namespace machines, each running an accel program
//! as its workers (issue 26). Needs root, `ip netns` and the torch venv
//! (`make torch-venv`); without them it prints why and skips, and under CI
//! it fails.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::netns::Netns;
use common::*;

#[test]
fn torchrun_c10d_across_two_machines_runs_an_accel_program() {
    let name = "torchrun_c10d_across_two_machines_runs_an_accel_program";
    let torchrun =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../.accel-cache/torch-venv/bin/torchrun");
    let ns = match (torchrun.exists(), Netns::create()) {
        (true, Ok(ns)) => ns,
        (_, made) => {
            let why = match made {
                Err(why) => why,
                Ok(_) => format!("no torchrun at {} (`make torch-venv`)", torchrun.display()),
            };
            assert!(
                std::env::var_os("CI").is_none(),
                "{name} cannot run in CI: {why}"
            );
            eprintln!("SKIPPED {name}: {why}");
            return;
        }
    };
    // Each machine's torchrun agent: machine 0 hosts the c10d store on its
    // own address. In a namespace the host name resolves to no address of
    // the machine, so torchrun is told what it cannot find out itself:
    // that machine 0 is the host, and each machine's address (without
    // --local-addr it writes MASTER_ADDR=localhost; accel warns then).
    let agent = |i: usize| {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &ns.names[i]])
            .arg(&torchrun)
            .args([
                "--nnodes",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "10.231.7.1:29411",
                "--rdzv-id",
                "netns-job",
                "--rdzv-conf",
                if i == 0 { "is_host=1" } else { "is_host=0" },
                "--local-addr",
                ["10.231.7.1", "10.231.7.2"][i],
                "--nproc-per-node",
                "2",
                "--no-python",
                ACCEL,
                "probe-worker",
                "--accelerator",
            ])
            .env("ACCEL_BACKEND", "cpu-gloo")
            .env("ACCEL_TIMEOUT", "60s")
            .env_remove("ACCEL_RUN_TOKEN")
            .env_remove("OMP_NUM_THREADS")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let m0 = start(agent(0));
    let m1 = start(agent(1));
    let limit = Duration::from_secs(150);
    let (r0, r1) = (m0.finish(limit), m1.finish(limit));
    r0.code_is(0);
    r1.code_is(0);
    // torchrun's workers share its stdout, one JSON line each.
    let mut seen: Vec<serde_json::Value> = [&r0, &r1]
        .iter()
        .flat_map(|r| r.stdout.lines())
        .filter_map(|l| l.find('{').and_then(|i| serde_json::from_str(&l[i..]).ok()))
        .collect();
    seen.sort_by_key(|v| v["rank"].as_u64());
    assert_eq!(seen.len(), 4, "{}\n{}", r0.all(), r1.all());
    for (rank, v) in seen.iter().enumerate() {
        assert_eq!(v["rank"], rank);
        assert_eq!(v["world_size"], 4);
        assert_eq!(v["node_rank"], rank / 2);
        assert_eq!(v["backend"], "cpu-gloo");
        // 1 + 2 + 3 + 4: every rank's contribution, across both machines.
        assert_eq!(v["all_reduce_sum"], 10.0);
        assert_eq!(
            v["store"]
                .as_str()
                .map(|s| s.starts_with("torch://10.231.7.1:")),
            Some(true)
        );
    }
}
