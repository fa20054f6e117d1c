//! The demo under `accel launch -n 2` on cpu-gloo: an uninterrupted run, a
//! run stopped mid-epoch then resumed, and a run killed by a signal then
//! resumed must end with the same parameter checksum. Every launch runs
//! under a hard timeout.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::accel_bin;

const LIMIT: Duration = Duration::from_secs(120);

fn run_bounded(mut child: Child, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().expect("wait") {
            return s.success();
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("a command ran past {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn launch(args: &[&str]) -> Child {
    Command::new(accel_bin())
        .args(["launch", "-n", "2", "--backend", "cpu-gloo", "--"])
        .arg(env!("CARGO_BIN_EXE_train"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("starting accel launch")
}

/// Collect the run's stdout lines; `on_line` may return `true` to have the
/// launcher sent SIGTERM. Returns (lines, success).
fn drive(mut child: Child, mut on_line: impl FnMut(&str) -> bool) -> (Vec<String>, bool) {
    let out = child.stdout.take().expect("piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + LIMIT;
    let mut lines = Vec::new();
    let mut signalled = false;
    loop {
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(l) => {
                eprintln!("{l}");
                if !signalled && on_line(&l) {
                    signalled = true;
                    let _ = Command::new("kill")
                        .args(["-TERM", &child.id().to_string()])
                        .status();
                }
                lines.push(l);
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the run did not finish within {LIMIT:?}; output so far:\n{}",
                lines.join("\n")
            );
        }
    }
    let ok = run_bounded(child, Duration::from_secs(30));
    (lines, ok)
}

fn checksum(lines: &[String]) -> String {
    lines
        .iter()
        .find_map(|l| l.split("params checksum ").nth(1))
        .unwrap_or_else(|| panic!("no checksum in:\n{}", lines.join("\n")))
        .trim()
        .to_string()
}

#[test]
fn stop_or_kill_then_resume_ends_with_the_uninterrupted_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = |n: &str| tmp.path().join(n).to_string_lossy().into_owned();

    let (full, ok) = drive(launch(&["--checkpoint-dir", &dir("full")]), |_| false);
    assert!(ok, "uninterrupted run failed");
    assert!(
        full.iter().any(|l| l.contains("final: 48 steps")),
        "{full:?}"
    );
    assert!(
        full.iter()
            .filter(|l| l.contains("done: eval mse") && l.contains("over 203 samples"))
            .count()
            == 3,
        "gather_for_metrics saw exactly the 203 evaluation samples each epoch"
    );
    let want = checksum(&full);

    // Stop after step 23 (mid-epoch, three steps past checkpoint_3), resume.
    let (stopped, ok) = drive(
        launch(&["--checkpoint-dir", &dir("stop"), "--stop-after", "23"]),
        |_| false,
    );
    assert!(ok);
    assert_ne!(checksum(&stopped), want);
    let (resumed, ok) = drive(
        launch(&["--checkpoint-dir", &dir("stop"), "--resume"]),
        |_| false,
    );
    assert!(ok, "resumed run failed");
    assert!(
        resumed
            .iter()
            .any(|l| l.contains("resumed from") && l.contains("checkpoint_3")),
        "{resumed:?}"
    );
    assert_eq!(
        checksum(&resumed),
        want,
        "stop + resume differs from the uninterrupted run"
    );

    // A real signal while training (slowed down so it lands mid-run).
    let (killed, ok) = drive(
        launch(&["--checkpoint-dir", &dir("kill"), "--step-delay-ms", "40"]),
        |l| l.contains("saved") && l.contains("checkpoint_2"),
    );
    assert!(!ok, "the killed run should not succeed");
    assert!(!killed.iter().any(|l| l.contains("final:")), "{killed:?}");
    let (resumed, ok) = drive(
        launch(&["--checkpoint-dir", &dir("kill"), "--resume"]),
        |_| false,
    );
    assert!(ok, "resume after kill failed");
    assert!(
        resumed.iter().any(|l| l.contains("resumed from")),
        "{resumed:?}"
    );
    assert_eq!(
        checksum(&resumed),
        want,
        "kill + resume differs from the uninterrupted run"
    );
}
