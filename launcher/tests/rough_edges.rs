//! What a new user trips over, each with its message (every test here
//! failed before the launch library): unknown flags, torchrun's `--tee N`
//! (once taken for a directory named N),
//! Accelerate's `--num_processes`, a closed stdout, huge timeouts, huge
//! process counts, the token on the command line.

mod common;

use std::process::Stdio;

use common::*;

#[test]
fn an_unknown_flag_is_named_with_the_closest_known_one() {
    // A flag that is nobody's: named, no far-fetched guess (torchrun's
    // --rdzv-backend once got "did you mean --backend"; it maps now, see
    // tests/torch.rs), and the program is not looked for.
    let r = accel(&["launch", "--frobnicate", "c10d", "-n", "2", "--", "app"]);
    r.code_is(2);
    assert!(
        r.stderr
            .contains("`--frobnicate` is not a flag of `accel launch`")
            && !r.stderr.contains("did you mean"),
        "{}",
        r.all()
    );
    assert!(!r.stderr.contains("not found on PATH"), "{}", r.all());
    let r = accel(&["launch", "--nproc_per_nod", "2", "--", "true"]);
    r.has_stderr("did you mean `--nproc-per-node`");
}

#[test]
fn torchrun_s_tee_selector_writes_torchruns_files_not_a_directory_named_3() {
    // torchrun's meaning (tests/torch.rs compares with torchrun itself):
    // without --log-dir, a new torchelastic_* directory in the temporary
    // directory, said on stderr.
    let dir = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut c = command(&[
        "launch", "--tee", "3", "-n", "1", "--", "sh", "-c", "echo hi",
    ]);
    c.current_dir(dir.path()).env("TMPDIR", tmp.path());
    let r = start(c).finish(LIMIT);
    r.code_is(0);
    r.has_stderr("log directory set to: ");
    assert!(
        rank_lines(&r.stdout, 0).contains(&"hi".to_string()),
        "{}",
        r.all()
    );
    assert!(
        !dir.path().join("3").exists(),
        "a directory named 3 was created"
    );
    let logs: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("torchelastic_")
        })
        .collect();
    assert_eq!(logs.len(), 1, "{}", r.all());
    let run = std::fs::read_dir(&logs[0])
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(run
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("none_"));
    let out = std::fs::read_to_string(run.join("attempt_0/0/stdout.log")).unwrap();
    assert_eq!(out, "hi\n");
    // accel's own spelling still names a directory; --log-dir does not
    // contradict it silently.
    refused(
        &[
            "launch",
            "--tee",
            "logs",
            "--log-dir",
            "other",
            "--",
            "true",
        ],
        "--tee logs already names the log directory",
    );
}

#[test]
fn accelerate_s_num_processes_counts_all_machines() {
    // 3 processes over 2 machines cannot be split evenly.
    refused_words("launch --num_processes 3 --num_machines 2 --main-process-ip 127.0.0.1 --join-timeout 1s -- true", "does not divide");
    // Per machine and in total at once is ambiguous.
    refused(
        &["launch", "-n", "2", "--num-processes", "2", "--", "true"],
        "both -n/--nproc-per-node",
    );
    // One machine: the total is the local count.
    let r = accel(&["launch", "--num_processes", "2", "--json", "--", "true"]);
    r.code_is(0);
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
    assert_eq!(v["world_size"], 2, "{}", r.all());
}

#[test]
fn a_closed_stdout_is_a_normal_exit() {
    for args in [&["env", "--json"][..], &["env"], &["--help"]] {
        let mut c = command(args);
        c.stdout(Stdio::piped());
        let mut child = c.spawn().unwrap();
        // The reader goes away before the first line.
        drop(child.stdout.take());
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(0), "{args:?}: {status} {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn a_huge_timeout_is_an_error_naming_it_not_a_panic() {
    refused(
        &["launch", "--timeout", "100000000000000000000", "--", "true"],
        "365 days",
    );
    let mut c = command(&["env"]);
    c.env("ACCEL_TIMEOUT", "100000000000000000000");
    let r = start(c).finish(LIMIT);
    assert!(!r.stderr.contains("panicked"), "{}", r.all());
    assert!(
        r.all().contains("ACCEL_TIMEOUT") && r.all().contains("365 days"),
        "{}",
        r.all()
    );
}

#[test]
fn a_huge_process_count_is_an_error_not_a_sigkill() {
    refused(
        &["launch", "-n", "100000", "--", "true"],
        "at most 1024 processes",
    );
}

#[test]
fn the_token_can_stay_out_of_ps() {
    let (_dir, f) = temp_file("token", "0123456789abcdef\n");
    let r = accel(&[
        "launch",
        "--token-file",
        f.to_str().unwrap(),
        "--",
        "sh",
        "-c",
        "echo token=$ACCEL_RUN_TOKEN",
    ]);
    r.code_is(0);
    r.has_stdout("[rank 0] token=0123456789abcdef");
    assert!(!r.stderr.contains("warning"), "{}", r.all());
    // On the command line it still works, with a warning.
    let r = accel(&["launch", "--token", "abc", "--", "true"]);
    r.code_is(0);
    r.has_stderr("visible to every user");
    r.has_stderr("--token-file");
    // The environment works too, silently.
    let mut c = command(&["launch", "--", "sh", "-c", "echo token=$ACCEL_RUN_TOKEN"]);
    c.env("ACCEL_RUN_TOKEN", "fromenv");
    let r = start(c).finish(LIMIT);
    assert!(
        r.stdout.contains("token=fromenv") && !r.stderr.contains("warning"),
        "{}",
        r.all()
    );
}

/// kill -9 of the launcher leaves no worker running (the kernel signals
/// them: PR_SET_PDEATHSIG).
#[test]
fn kill_9_of_the_launcher_leaves_no_worker() {
    let marker = format!("{}.{}", 1000, std::process::id());
    let mut c = command(&["launch", "-n", "2", "--", "sleep", &marker]);
    c.stdout(Stdio::null()).stderr(Stdio::null());
    let mut child = c.spawn().unwrap();
    assert!(
        wait_for(|| processes_with(&marker) >= 3, 20),
        "the workers did not start"
    );
    child.kill().unwrap(); // SIGKILL
    let _ = child.wait();
    assert!(
        wait_for(|| processes_with(&marker) == 0, 10),
        "{} worker(s) outlived the launcher",
        processes_with(&marker)
    );
}

/// Values the launcher once accepted with exit code 0 are refused before
/// anything starts, each with its reason (issue 32 item 10).
#[test]
fn values_that_cannot_apply_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("ran");
    let touch = format!("touch {}", marker.display());
    let refused = |args: &[&str], says: &[&str]| {
        let mut words: Vec<&str> = vec!["launch"];
        words.extend_from_slice(args);
        words.extend_from_slice(&["--", "sh", "-c", &touch]);
        let r = accel(&words);
        r.code_is(2);
        for s in says {
            r.has_stderr(s);
        }
        assert!(!marker.exists(), "a worker ran: {}", r.all());
    };
    let cases: [(&str, &[&str]); 9] = [
        (
            "-n 2 --ranks 7",
            &["--ranks", "rank 7 is not in this run", "0 to 1"],
        ),
        ("-n 2 --ranks 0,2-3", &["rank 2 is not in this run"]),
        (
            "-n 2 --backend nosuch",
            &[
                "no backend named `nosuch`",
                "cpu-gloo",
                "mpi",
                "xla",
                "single",
            ],
        ),
        (
            "-n 1 --backend cpu-gloo,nosuch",
            &["no backend named `nosuch`"],
        ),
        (
            "-n 1 --run-id ../../etc",
            &["--run-id", "'/' is not allowed", "letters, digits"],
        ),
        ("-n 1 --run-id .hidden", &["must not start with"]),
        ("-n 1 --mpi-hosts=", &["--mpi-hosts", "names no machine"]),
        (
            "-n 1 --timeout 100ns",
            &["--timeout", "below the shortest timeout"],
        ),
        ("-n 1 --backend mpi --mpi-hosts=,", &["names no machine"]),
    ];
    for (args, says) in cases {
        refused(&args.split(' ').collect::<Vec<_>>(), says);
    }
    // What stays accepted: the run's own ranks, known names, a plain id.
    let r = accel(&[
        "launch",
        "-n",
        "2",
        "--ranks",
        "1",
        "--backend",
        "cpu-gloo",
        "--run-id",
        "exp-7.a_b",
        "--",
        "sh",
        "-c",
        "echo rank $RANK",
    ]);
    r.code_is(0);
    r.has_stdout("[rank 1] rank 1");
    assert!(!r.stdout.contains("rank 0"), "{}", r.all());
}
