//! A process whose rank thread aborts says which rank it was; one killed by
//! SIGABRT from outside names no thread. Each case runs in a child process
//! (this test binary re-run with a mode variable) under a hard deadline.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MODE: &str = "ACCEL_SIGNALS_TEST_MODE";

/// In the child: the behaviour the parent asked for.
fn child(mode: &str) -> ! {
    assert!(accel_signals::name_aborting_rank_threads());
    match mode {
        "rank-thread-aborts" => {
            let t = std::thread::Builder::new()
                .name("rank 7".into())
                .spawn(|| std::process::abort())
                .unwrap();
            let _ = t.join();
        }
        "main-aborts" => std::process::abort(),
        "killed-from-outside" => {
            // Rank threads that sleep; the parent sends SIGABRT.
            for r in 0..4 {
                std::thread::Builder::new()
                    .name(format!("rank {r}"))
                    .spawn(|| std::thread::sleep(Duration::from_secs(30)))
                    .unwrap();
            }
            println!("ready");
            std::thread::sleep(Duration::from_secs(30));
        }
        _ => unreachable!("{mode}"),
    }
    std::process::exit(3)
}

/// Run this test binary as the child in `mode`; its stderr and signal.
fn run(mode: &str, kill: bool) -> (String, Option<i32>) {
    use std::io::{BufRead, Read};
    use std::os::unix::process::ExitStatusExt;
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env(MODE, mode)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if kill {
        let mut out = std::io::BufReader::new(c.stdout.take().unwrap());
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 && !line.contains("ready") {
            line.clear();
        }
        let pid = c.id().to_string();
        assert!(Command::new("kill")
            .args(["-ABRT", &pid])
            .status()
            .unwrap()
            .success());
    }
    let start = Instant::now();
    let status = loop {
        if let Some(s) = c.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = c.kill();
            panic!("the {mode} child did not end within 20 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut err = String::new();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (err, status.signal())
}

#[test]
fn child_entry() {
    if let Ok(mode) = std::env::var(MODE) {
        child(&mode);
    }
}

#[test]
fn an_aborting_rank_thread_names_itself_and_still_dies_by_sigabrt() {
    let (err, signal) = run("rank-thread-aborts", false);
    assert_eq!(signal, Some(libc_sigabrt()), "{err}");
    assert!(err.contains("thread 'rank 7' aborted (SIGABRT)\n"), "{err}");
}

#[test]
fn a_thread_that_is_no_rank_thread_names_nobody() {
    let (err, signal) = run("main-aborts", false);
    assert_eq!(signal, Some(libc_sigabrt()), "{err}");
    assert!(!err.contains("aborted (SIGABRT)"), "{err}");
}

#[test]
fn sigabrt_from_outside_names_no_rank_thread() {
    let (err, signal) = run("killed-from-outside", true);
    assert_eq!(signal, Some(libc_sigabrt()), "{err}");
    assert!(!err.contains("aborted (SIGABRT)"), "{err}");
}

fn libc_sigabrt() -> i32 {
    6
}
