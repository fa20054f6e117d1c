//! `accel launch` on one machine: the environment contract, output,
//! supervision, restarts, config files, and every bad input with its message.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::*;

#[test]
fn four_ranks_print_prefixed_lines() {
    let r = accel(&argv("launch -n 4 -- sh -c", &["echo $RANK/$WORLD_SIZE"]));
    r.code_is(0);
    let mut lines: Vec<&str> = r.stdout.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        vec![
            "[rank 0] 0/4",
            "[rank 1] 1/4",
            "[rank 2] 2/4",
            "[rank 3] 3/4"
        ],
        "{}",
        r.all()
    );
    // A successful run is quiet.
    assert_eq!(r.stderr, "", "{}", r.all());
}

#[test]
fn a_failing_rank_stops_the_group_names_the_rank_and_leaves_nothing_running() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "sleep 600 & echo $! > {d}/child-$RANK.pid; echo $$ > {d}/worker-$RANK.pid; \
         if [ \"$RANK\" = 1 ]; then sleep 0.2; echo 'rank one is failing' >&2; exit 3; fi; wait",
        d = dir.path().display()
    );
    let r = accel(&["launch", "-n", "2", "--", "sh", "-c", &script]);
    r.code_is(3);
    assert!(r.elapsed < Duration::from_secs(5), "{}", r.all());
    r.has_stderr("rank:      1 (local rank 1)");
    r.has_stderr("exit:      exit code 3");
    r.has_stderr("  | rank one is failing");
    assert!(
        r.stderr.contains("rank 1 (local rank 1 on machine 0"),
        "{}",
        r.all()
    );
    let pids = pids_in(dir.path());
    assert_eq!(pids.len(), 4, "{}", r.all());
    for pid in pids {
        assert_gone(pid, "pid {pid} still running after the launcher exited");
    }
}

#[test]
fn the_single_command_of_the_issue_exits_3_quickly() {
    let r = accel(&argv(
        "launch -n 2 -- sh -c",
        &["if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 600"],
    ));
    r.code_is(3);
    assert!(r.elapsed < Duration::from_secs(5), "{}", r.all());
    r.has_stderr("rank 1");
}

#[test]
fn workers_see_the_whole_environment_contract() {
    // Through the runtime's own reader (and a store barrier over the real
    // TCP store with the generated token).
    let r = accel(&["launch", "-n", "3", "--", ACCEL, "probe-worker"]);
    r.code_is(0);
    let mut ranks = BTreeSet::new();
    let mut run_ids = BTreeSet::new();
    for rank in 0..3 {
        let v = r.rank_json(rank);
        assert_eq!(v["rank"], rank);
        assert_eq!(v["local_rank"], rank);
        assert_eq!(v["world_size"], 3);
        assert_eq!(v["local_world_size"], 3);
        assert_eq!(v["node_rank"], 0);
        assert_eq!(v["restart_count"], 0);
        assert!(v["barrier_ms"].is_number(), "{}", r.all());
        assert!(v["store"].as_str().unwrap().starts_with("tcp://127.0.0.1:"));
        ranks.insert(v["rank"].as_u64().unwrap());
        run_ids.insert(v["run_id"].as_str().unwrap().to_string());
    }
    assert_eq!(ranks.len(), 3);
    assert_eq!(run_ids.len(), 1, "one run id for every rank");

    // And the raw variables, torchrun mirrors included.
    let r = accel(&argv(
        "launch -n 1 --run-id exp7 --timeout 90s --backend cpu-gloo --debug -- sh -c",
        &["env | sort"],
    ));
    r.code_is(0);
    let env: Vec<String> = rank_lines(&r.stdout, 0);
    let has = |kv: &str| env.iter().any(|l| l == kv);
    for kv in [
        "RANK=0",
        "LOCAL_RANK=0",
        "WORLD_SIZE=1",
        "LOCAL_WORLD_SIZE=1",
        "GROUP_RANK=0",
        "MASTER_ADDR=127.0.0.1",
        "ACCEL_LAUNCHER=accel",
        "ACCEL_RUN_ID=exp7",
        "TORCHELASTIC_RUN_ID=exp7",
        "ACCEL_TIMEOUT=90s",
        "ACCEL_BACKEND=cpu-gloo",
        "ACCEL_DEBUG=1",
        "ACCEL_RESTART_COUNT=0",
        "TORCHELASTIC_RESTART_COUNT=0",
    ] {
        assert!(has(kv), "missing {kv} in\n{}", env.join("\n"));
    }
    let get = |k: &str| {
        env.iter()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(get("ACCEL_RUN_TOKEN").len(), 32, "a generated token");
    // accel's store (with the token) and, on MASTER_PORT, the torch
    // endpoint torch workers join as torchrun's agent store (ADR 0019).
    assert!(get("ACCEL_STORE_URL").starts_with("tcp://127.0.0.1:"));
    assert_ne!(
        get("ACCEL_STORE_URL"),
        format!("tcp://127.0.0.1:{}", get("MASTER_PORT"))
    );
    assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), "True");
    assert!(get("ACCEL_ERROR_FILE").ends_with("rank-0.json"));
    assert_eq!(get("ACCEL_ERROR_FILE"), get("TORCHELASTIC_ERROR_FILE"));
}

/// A real program: `accel::Accelerator::new()` picks cpu-gloo, bootstraps it
/// through the launcher's store and all-reduces across the workers.
#[cfg(feature = "cpu-gloo")]
#[test]
fn an_accelerator_connects_and_all_reduces_under_the_launcher() {
    let r = accel(&argv(
        "launch -n 3 --backend cpu-gloo --",
        &[ACCEL, "probe-worker", "--accelerator"],
    ));
    r.code_is(0);
    for rank in 0..3 {
        let l = rank_lines(&r.stdout, rank);
        let v: serde_json::Value = serde_json::from_str(&l[0]).unwrap();
        assert_eq!(v["backend"], "cpu-gloo", "{}", r.all());
        assert_eq!(v["all_reduce_sum"], 6.0, "{}", r.all());
    }
}

/// Without debug mode, ranks passing different lengths, reductions, dtypes
/// or operations to all_reduce end with the call check's error (Gloo's
/// transport aborted the process on mismatched lengths, and 10 against 11
/// elements gave one rank `Ok` with a wrong last element).
#[cfg(feature = "cpu-gloo")]
#[test]
fn mismatched_calls_are_errors_not_crashes_on_cpu_gloo() {
    for (what, says) in MISMATCHES {
        let r = accel(&argv(
            "launch -n 2 --backend cpu-gloo --timeout 20s --",
            &[ACCEL, "probe-worker", "--accelerator", "--mismatch", what],
        ));
        ended_with_mismatch(&r, "cpu-gloo", says);
    }
}

/// Rank 1 sleeps past the timeout instead of entering an all_reduce: the
/// survivor's error and the root-cause block name rank 1, not rank 0 (the
/// first rank that timed out).
#[cfg(feature = "cpu-gloo")]
#[test]
fn a_rank_that_never_arrives_is_named_by_the_survivor_and_the_launcher() {
    let r = accel(&argv(
        "launch -n 2 --backend cpu-gloo --timeout 3s --",
        &[ACCEL, "probe-worker", "--accelerator", "--stall-rank", "1"],
    ));
    ended_naming_the_stalled_rank(&r, "cpu-gloo");
}

/// Rank 1 exits 0 right after connecting while rank 0 enters an
/// all_reduce: rank 0 loses its peer, and the root cause is rank 1, which
/// exited early (exit code 0 mid-job is a failure), not rank 0 that noticed
/// (issue 32 item 8).
#[cfg(feature = "cpu-gloo")]
#[test]
fn a_rank_that_exits_0_early_is_the_root_cause_not_the_survivor() {
    let r = accel(&argv(
        "launch -n 2 --backend cpu-gloo --timeout 5s --",
        &[
            ACCEL,
            "probe-worker",
            "--accelerator",
            "--exit-early-rank",
            "1",
        ],
    ));
    assert!(r.code.is_some_and(|c| c != 0), "{}", r.all());
    r.has_stderr("rank:      1 (local rank 1)");
    r.has_stderr("exit:      exited early: code 0 while the other ranks still ran");
    r.has_stderr("Rank 0 said:");
}

#[test]
fn a_panic_shows_the_error_file_in_the_root_cause() {
    let r = accel(&argv(
        "launch -n 2 --",
        &[ACCEL, "probe-worker", "--panic-on-rank", "1"],
    ));
    r.code_is(101);
    r.has_stderr("error:     probe-worker: deliberate panic on rank 1");
    r.has_stderr("at:        launcher/src/probe_cmd.rs:");
}

#[test]
fn a_signal_death_is_reported_by_name_with_128_plus_signal() {
    let r = accel(&argv(
        "launch -n 2 -- sh -c",
        &["[ $RANK = 0 ] && kill -SEGV $$; sleep 600"],
    ));
    r.code_is(139);
    r.has_stderr("signal SIGSEGV (11)");
}

#[test]
fn workers_ignoring_sigterm_are_killed_after_the_grace_period() {
    let r = accel(&argv(
        "launch -n 2 --grace-period 300ms -- sh -c",
        &["trap '' TERM; if [ $RANK = 1 ]; then sleep 0.2; exit 4; fi; sleep 600"],
    ));
    r.code_is(4);
    r.has_stderr("did not stop within 300ms");
    assert!(r.elapsed < Duration::from_secs(5), "{}", r.all());
}

#[test]
fn sigterm_to_the_launcher_reaches_every_worker() {
    let dir = tempfile::tempdir().unwrap();
    let script = format!(
        "echo $$ > {}/w-$RANK.pid; exec sleep 600",
        dir.path().display()
    );
    let run = start(command(&["launch", "-n", "3", "--", "sh", "-c", &script]));
    assert!(eventually(Duration::from_secs(5), || pids_in(dir.path())
        .len()
        == 3));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(run.pid() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let r = run.finish(LIMIT);
    r.code_is(143);
    r.has_stderr("received SIGTERM, forwarding it");
    r.has_stderr("interrupted after");
    for pid in pids_in(dir.path()) {
        assert_gone(pid, "pid {pid} left");
    }
}

#[test]
fn restarts_count_up_and_the_summary_lists_each_attempt() {
    let r = accel(&argv(
        "launch -n 2 --max-restarts 3 --json -- sh -c",
        &["echo try $ACCEL_RESTART_COUNT; [ $ACCEL_RESTART_COUNT -ge 2 ] || exit 5"],
    ));
    r.code_is(0);
    assert!(
        rank_lines(&r.stdout, 0).contains(&"try 2".to_string()),
        "{}",
        r.all()
    );
    r.has_stderr("restarting the group: restart 1 of 3");
    r.has_stderr("attempt 0: failed after");
    r.has_stderr("attempt 2: succeeded after");
    let v = json_summary(&r.stdout);
    let statuses = attempt_statuses(&r.stdout);
    assert_eq!(statuses, ["failed", "failed", "succeeded"]);
    assert_eq!(v["exit_code"], 0);
    assert_eq!(v["attempts"][0]["root_cause"]["exit"]["code"], 5);

    // Out of restarts: the last failure's code.
    let r = accel(&argv("launch -n 1 --max-restarts 1 -- sh -c", &["exit 9"]));
    r.code_is(9);
    r.has_stderr("2 attempt(s), exit code 9");
}

#[test]
fn tee_writes_one_file_per_rank_and_the_filter_shows_some_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let logs = dir.path().join("logs");
    let r = accel(&argv(
        "launch -n 3 --tee",
        &[
            logs.to_str().unwrap(),
            "--ranks",
            "1-2",
            "--",
            "sh",
            "-c",
            "echo out $RANK; echo err $RANK >&2",
        ],
    ));
    r.code_is(0);
    assert!(rank_lines(&r.stdout, 0).is_empty(), "{}", r.all());
    assert_eq!(rank_lines(&r.stdout, 1), ["out 1"]);
    assert_eq!(rank_lines(&r.stdout, 2), ["out 2"]);
    for rank in 0..3 {
        let text = std::fs::read_to_string(logs.join(format!("rank-{rank}.log"))).unwrap();
        let mut lines: Vec<&str> = text.lines().collect();
        lines.sort();
        assert_eq!(lines, [format!("err {rank}"), format!("out {rank}")]);
    }
    let r = accel(&argv("launch -n 2 --quiet-ranks -- sh -c", &["echo $RANK"]));
    assert_eq!(r.stdout, "[rank 0] 0\n", "{}", r.all());
}

#[test]
fn lines_are_never_mixed() {
    // Four ranks write long lines in small pieces as fast as they can.
    let script = "i=0; while [ $i -lt 200 ]; do printf '%s' $RANK$RANK$RANK$RANK; \
                  printf '%0500d' 0 | tr 0 $RANK; printf '\\n'; i=$((i+1)); done";
    let r = accel(&["launch", "-n", "4", "--", "sh", "-c", script]);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let mut count = 0;
    for l in r.stdout.lines() {
        let (head, body) = l.split_at(9);
        let rank = head
            .strip_prefix("[rank ")
            .and_then(|h| h.strip_suffix("] "))
            .unwrap_or_else(|| panic!("bad prefix in {l:?}"));
        assert_eq!(body.len(), 504, "{l:?}");
        assert!(body.chars().all(|c| c.to_string() == rank), "{l:?}");
        count += 1;
    }
    assert_eq!(count, 800);
}

#[test]
fn a_silent_worker_is_reported_as_hung() {
    let r = accel(&argv(
        "launch -n 2 --hang-timeout 700ms -- sh -c",
        &["if [ $RANK = 0 ]; then while :; do echo tick; sleep 0.1; done; fi; sleep 600"],
    ));
    r.code_is(124);
    r.has_stderr("rank:      1 (local rank 1)");
    r.has_stderr("hung: no output for");
}

// ---- bad input: each with its message ----

#[test]
fn zero_or_negative_process_counts_are_refused() {
    for n in ["0", "-2"] {
        let r = accel(&["launch", "-n", n, "--", "true"]);
        r.code_is(2);
        r.has_stderr(&format!("must be at least 1, got {n}"));
        r.has_stderr("--nproc-per-node");
    }
    let r = accel(&["launch", "--nproc_per_node", "0", "--", "true"]);
    r.code_is(2);
    let r = accel(&["launch", "--num-machines", "0", "--", "true"]);
    r.has_stderr("must be at least 1, got 0");
}

#[test]
fn machine_rank_must_be_below_the_number_of_machines() {
    let r =
        accel_words("launch --nnodes 2 --node-rank 2 --master-addr 127.0.0.1 --token t -- true");
    r.code_is(2);
    r.has_stderr("machine rank 2 is not below the number of machines 2");
    let r = accel(&["launch", "--machine-rank", "-1", "--", "true"]);
    r.has_stderr("must be 0 or more, got -1");
}

#[test]
fn a_busy_port_is_an_error_on_several_machines_and_avoided_on_one() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    refused(
        &argv(
            "launch --num-machines 2 --main-process-ip 127.0.0.1 --main-process-port",
            &[&port, "--token", "t", "--", "true"],
        ),
        &format!("port {port} is already in use"),
    );
    let r = accel(&argv(
        "launch -n 2 --main-process-port",
        &[&port, "--", ACCEL, "probe-worker"],
    ));
    r.code_is(0);
    r.has_stderr(&format!("port {port} is in use on this machine"));
}

#[test]
fn missing_or_non_executable_programs_are_named_before_anything_starts() {
    let r = accel(&["launch", "-n", "2", "--", "no-such-program-4711"]);
    r.code_is(127);
    r.has_stderr("program `no-such-program-4711` not found on PATH");
    let (_dir, f) = temp_file("train.sh", "#!/bin/sh\necho hi\n");
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let r = accel(&["launch", "-n", "2", "--", f.to_str().unwrap()]);
    r.code_is(126);
    r.has_stderr("train.sh` is not executable");
    r.has_stderr("chmod +x");
    assert!(r.stdout.is_empty(), "{}", r.all());
}

#[test]
fn several_machines_need_an_address_and_a_token() {
    refused(
        &["launch", "--num-machines", "2", "--", "true"],
        "--main-process-ip is required",
    );
    refused_words(
        "launch --num-machines 2 --main-process-ip 127.0.0.1 -- true",
        "needs a shared token",
    );
}

// ---- config files ----

#[test]
fn config_files_layer_under_flags_and_refuse_unknown_keys_and_wrong_types() {
    let (_dir, cfg) = temp_file("run.toml", "num_processes = 3\nrun_id = \"fromfile\"\n");
    let c = cfg.to_str().unwrap();
    let echo = ["sh", "-c", "echo $WORLD_SIZE $ACCEL_RUN_ID"];
    let mut args = vec!["launch", "--config", c, "--"];
    args.extend(echo);
    let r = accel(&args);
    r.code_is(0);
    assert_eq!(rank_lines(&r.stdout, 2), ["3 fromfile"], "{}", r.all());
    let mut args = vec!["launch", "--config", c, "-n", "2", "--"];
    args.extend(echo);
    let r = accel(&args);
    assert_eq!(rank_lines(&r.stdout, 1), ["2 fromfile"], "{}", r.all());
    assert!(rank_lines(&r.stdout, 2).is_empty(), "{}", r.all());

    std::fs::write(&cfg, "num_processes = 2\nnum_procs = 4\n").unwrap();
    let r = refused(
        &["launch", "--config", c, "--", "true"],
        "unknown key `num_procs`",
    );
    r.has_stderr("run.toml");

    std::fs::write(&cfg, "num_processes = \"two\"\n").unwrap();
    refused(
        &["launch", "--config", c, "--", "true"],
        "key `num_processes` must be an integer, not a string",
    );
}

#[test]
fn accel_config_writes_what_launch_reads() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("a.toml");
    let c = cfg.to_str().unwrap();
    let r = accel(&argv("config -n 2 --max-restarts 1 --timeout 45s -o", &[c]));
    r.code_is(0);
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        text.contains("num_processes = 2") && text.contains("timeout = \"45s\""),
        "{text}"
    );
    refused(&["config", "-n", "2", "-o", c], "already exists");
    let r = accel(&[
        "launch",
        "--config",
        c,
        "--",
        "sh",
        "-c",
        "echo $ACCEL_TIMEOUT",
    ]);
    assert_eq!(rank_lines(&r.stdout, 1), ["45s"], "{}", r.all());

    // Interactive, answers on stdin.
    let cfg2 = dir.path().join("b.toml");
    let mut cmd = command(&["config", "--interactive", "-o", cfg2.to_str().unwrap()]);
    cmd.stdin(std::process::Stdio::piped());
    let mut run = start(cmd);
    {
        use std::io::Write;
        let mut stdin = run.child.stdin.take().unwrap();
        stdin.write_all(b"4\n\n\n\n\n\n\n\nyes\n").unwrap();
    }
    let r = run.finish(LIMIT);
    r.code_is(0);
    let text = std::fs::read_to_string(&cfg2).unwrap();
    assert!(
        text.contains("num_processes = 4") && text.contains("debug = true"),
        "{text}"
    );
}

/// A setting the program cannot use is said on rank 0's console although
/// the program (examples/train) installs no `tracing` subscriber; under
/// `ACCEL_STRICT=1` the run fails naming it.
#[test]
fn a_setting_that_cannot_apply_is_said_once_on_rank_0_and_fails_when_strict() {
    let train = train_bin();
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let run = |strict: bool| {
        let mut args = argv(
            "launch -n 2 --backend cpu-gloo --sharding optimizer --",
            &[train.to_str().unwrap()],
        );
        args.extend([
            "--epochs",
            "1",
            "--train-len",
            "32",
            "--eval-len",
            "8",
            "--save-every",
            "0",
        ]);
        args.extend(["--checkpoint-dir", ck.to_str().unwrap()]);
        let mut c = command(&args);
        c.env_remove("ACCEL_STRICT");
        if strict {
            c.env("ACCEL_STRICT", "1");
        }
        start(c).finish(LIMIT)
    };
    let said = "ACCEL_SHARDING=optimizer (accel launch --sharding) does not apply: \
                PreparedOptimizer::step steps a model that Accelerator::prepare_zero did not shard";
    let r = run(false);
    r.code_is(0);
    let lines: Vec<&str> = r.stderr.lines().filter(|l| l.contains(said)).collect();
    assert_eq!(lines.len(), 1, "{}", r.all());
    assert!(
        lines[0].starts_with("[rank 0] accel: warning: "),
        "{}",
        r.all()
    );
    let r = run(true);
    assert_ne!(r.code, Some(0), "{}", r.all());
    r.has_stderr(said);
    r.has_stderr("ACCEL_STRICT");
    r.lacks_stderr("accel: warning: ");
}

/// Several workers on a machine share its cores: torchrun's
/// OMP_NUM_THREADS=1 and RAYON_NUM_THREADS = cores / workers (1 on a 2-core
/// machine), unless the user set them.
#[test]
fn workers_get_their_share_of_the_cores_in_their_thread_pools() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let show = [
        "sh",
        "-c",
        "echo omp=$OMP_NUM_THREADS rayon=$RAYON_NUM_THREADS",
    ];
    let r = accel(&argv("launch -n 2 --", &show));
    r.code_is(0);
    let want = format!("omp=1 rayon={}", (cores / 2).max(1));
    assert_eq!(rank_lines(&r.stdout, 0), vec![want.clone()], "{}", r.all());
    assert_eq!(rank_lines(&r.stdout, 1), vec![want], "{}", r.all());
    // The user's own setting stands.
    let mut cmd = command(&argv("launch -n 2 --", &show));
    cmd.env("RAYON_NUM_THREADS", "3");
    let r = start(cmd).finish(LIMIT);
    r.code_is(0);
    assert_eq!(
        rank_lines(&r.stdout, 0),
        vec!["omp=1 rayon=3"],
        "{}",
        r.all()
    );
}

/// `accel checkpoint inspect|verify` on the demo's own checkpoint folder:
/// the objects, world size and tensors; then a flipped byte found and named.
#[test]
fn checkpoint_inspect_and_verify_read_what_save_state_wrote() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let ck_s = ck.to_str().unwrap();
    let out = Command::new(train_bin())
        .args([
            "--epochs",
            "1",
            "--train-len",
            "200",
            "--save-every",
            "5",
            "--checkpoint-dir",
            ck_s,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = accel(&["checkpoint", "inspect", ck_s, "--json"]);
    r.code_is(0);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["format"], "accel");
    assert_eq!(v["world_size"], 1);
    assert!(
        v["objects"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o == "model_0"),
        "{v}"
    );
    let model = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "model_0.safetensors")
        .unwrap_or_else(|| panic!("{v}"));
    assert!(!model["tensors"].as_array().unwrap().is_empty(), "{model}");
    let r = accel(&["checkpoint", "verify", ck_s]);
    r.code_is(0);
    r.has_stdout("every size and checksum matches the manifest");
    // A flipped byte in the newest checkpoint's model file.
    let dir = PathBuf::from(v["dir"].as_str().unwrap());
    let f = dir.join("model_0.safetensors");
    let mut bytes = std::fs::read(&f).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&f, bytes).unwrap();
    let r = accel(&["checkpoint", "verify", ck_s]);
    r.code_is(1);
    r.has_stderr("model_0.safetensors");
}

/// A safetensors file of f32 rows: `(name, shape, offsets)` per tensor,
/// the offsets under `DCP_SHARDING_INFO` as torch's per-rank writer puts
/// them.
fn dcp_file(path: &Path, tensors: &[(&str, [u64; 2], [u64; 2])]) {
    let mut header = serde_json::Map::new();
    let mut info = serde_json::Map::new();
    let mut at = 0u64;
    for (name, shape, off) in tensors {
        let n = shape[0] * shape[1] * 4;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}),
        );
        info.insert(name.to_string(), serde_json::json!({"saved_offsets": off}));
        at += n;
    }
    let info = serde_json::Value::Object(info).to_string();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"DCP_SHARDING_INFO": info}),
    );
    let head = serde_json::Value::Object(header).to_string();
    let mut bytes = (head.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(head.as_bytes());
    bytes.resize(bytes.len() + at as usize, 0);
    std::fs::write(path, bytes).unwrap();
}

/// `accel checkpoint inspect|verify` on torch's per-rank layout: each
/// file's chunks and offsets, the world size it was saved at; a folder
/// whose first rank's file is gone fails verify naming the tensor.
#[test]
fn checkpoint_inspect_and_verify_read_torchs_per_rank_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let name = |r: usize| format!("shard-{:05}-model-00001-of-00001.safetensors", r + 1);
    dcp_file(
        &d.join(name(0)),
        &[("w", [2, 3], [0, 0]), ("b", [1, 4], [0, 0])],
    );
    dcp_file(&d.join(name(1)), &[("w", [1, 3], [2, 0])]);
    let ds = d.to_str().unwrap();
    let r = accel(&["checkpoint", "inspect", ds, "--json"]);
    r.code_is(0);
    let v: serde_json::Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        (&v["format"], &v["world_size"]),
        (&"torch-dcp".into(), &2.into()),
        "{v}"
    );
    let second = &v["files"][1];
    assert_eq!(second["name"], name(1).as_str(), "{v}");
    assert_eq!(
        second["tensors"][0]["offsets"],
        serde_json::json!([2, 0]),
        "{v}"
    );
    let r = accel(&["checkpoint", "inspect", ds]);
    r.code_is(0);
    r.has_stdout("torch's per-rank distributed-checkpoint layout");
    r.has_stdout("w F32 [1, 3] at [2, 0]");
    let r = accel(&["checkpoint", "verify", ds]);
    r.code_is(0);
    r.has_stdout("2 files");
    r.has_stdout("every element held by exactly one chunk");
    std::fs::remove_file(d.join(name(0))).unwrap();
    let r = accel(&["checkpoint", "verify", ds]);
    r.code_is(1);
    r.has_stderr("tensor \"w\" [3, 3]");
    r.has_stderr("a rank's file is missing");
}
