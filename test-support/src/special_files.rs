//! Special files for the bounded-read tests (issue 32): FIFOs, and a runner
//! that reports how long a call took without letting a blocked call hang
//! the test.

use std::path::Path;
use std::time::{Duration, Instant};

/// `mkfifo path`; `false` (and a note) where the tool is missing.
pub fn mkfifo(path: &Path) -> bool {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        println!("skipped: no mkfifo");
    }
    ok
}

/// Run `f` on its own thread; its result and how long it took. A call
/// still blocked after 10 s fails the test (the thread is left behind).
pub fn timed<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> (T, Duration) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        let out = f();
        let _ = tx.send((out, start.elapsed()));
    });
    rx.recv_timeout(Duration::from_secs(10))
        .expect("the call blocked (no answer within 10 s)")
}
