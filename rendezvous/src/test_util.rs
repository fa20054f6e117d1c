//! Test helpers: temporary directories, captured logs, child processes
//! (threads that must all succeed: `testkit::all_succeed`).

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

/// A directory removed on drop.
#[derive(Debug)]
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(label: &str) -> TempDir {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "accel-rdv-{label}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }

    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

// ---------------------------------------------------------------- logs

static LOGS: Mutex<Vec<String>> = Mutex::new(Vec::new());

use accel_test_support::log_lines;

/// Install the capturing subscriber for the whole test process (once).
pub(crate) fn capture_logs() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Every event (debug and above) of every thread, as one line of
        // `LEVEL field=value ...`.
        let capture = log_lines::LineSubscriber {
            wanted: |m| *m.level() <= tracing::Level::DEBUG,
            line: |l| LOGS.lock().unwrap_or_else(|p| p.into_inner()).push(l),
        };
        tracing::subscriber::set_global_default(capture).expect("no other global subscriber");
    });
}

/// Captured lines containing every one of `needles`, waiting up to 2 s for
/// one to appear (server threads log asynchronously).
pub(crate) fn wait_for_log(needles: &[&str]) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let found: Vec<String> = LOGS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|l| needles.iter().all(|n| l.contains(n)))
            .cloned()
            .collect();
        if !found.is_empty() || Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------- children

const CHILD_ENV: &str = "ACCEL_RDV_TEST_CHILD";

/// This test binary re-run as a child process running only one test (see
/// [`spawn_entry`]). Killed on drop.
pub(crate) struct ChildProc {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

/// This test binary re-run with one test as the child's entry point (its
/// full path, e.g. `file::tests::file_adder_child`): a test that does its
/// part when [`child_role`] is `role` and nothing otherwise.
pub(crate) fn spawn_entry(entry: &str, role: &str, env: &[(&str, &str)]) -> ChildProc {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", entry, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let (tx, rx) = channel();
    let out = child.stdout.take().unwrap();
    let err = child.stderr.take().unwrap();
    let tx2 = tx.clone();
    std::thread::spawn(move || forward(out, tx));
    std::thread::spawn(move || forward(err, tx2));
    ChildProc {
        child,
        lines: rx,
        seen: Vec::new(),
    }
}

fn forward(r: impl Read, tx: std::sync::mpsc::Sender<String>) {
    for line in BufReader::new(r).lines() {
        let Ok(line) = line else { return };
        if tx.send(line).is_err() {
            return;
        }
    }
}

impl ChildProc {
    /// What follows `prefix` on the first output line containing it.
    pub(crate) fn line_with(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => {
                    // libtest's "test ... " may precede it on the same line.
                    if let Some(at) = l.find(prefix) {
                        return l[at + prefix.len()..].trim().to_string();
                    }
                    self.seen.push(l);
                }
                Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                    panic!(
                        "child printed no `{prefix}` line within {timeout:?}:\n{}",
                        self.seen.join("\n")
                    )
                }
            }
        }
    }

    /// SIGKILL the child and reap it.
    pub(crate) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Everything the child printed, once it exited successfully.
    pub(crate) fn wait_output(mut self, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    self.kill();
                    panic!(
                        "child did not finish within {timeout:?}:\n{}",
                        self.seen.join("\n")
                    );
                }
            }
        }
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let out = self.seen.join("\n");
                assert!(status.success(), "child failed ({status}):\n{out}");
                return out;
            }
            if Instant::now() >= deadline {
                self.kill();
                panic!("child did not exit within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The role this process was started in by [`spawn_entry`], if any.
pub(crate) fn child_role() -> Option<String> {
    std::env::var(CHILD_ENV).ok()
}
