//! Waiting for a child process under a hard deadline, and running one to
//! the end.

use std::process::{Child, Command, ExitStatus, Output};
use std::time::{Duration, Instant};

/// `child`'s exit status once it ends within `limit`; `None` when it is
/// still running then: it is killed and reaped (its output pipes stay
/// readable).
pub fn wait_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let end = Instant::now() + limit;
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Run `cmd` to the end; its output. Panics, naming `what` and with its
/// stderr, when it does not start or fails.
pub fn output_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// `out`'s stdout, then its stderr, as text.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}
