//! Waiting for a child process under a hard deadline. Shared by several
//! crates' tests through `#[path]`.
#![allow(dead_code)]

use std::process::{Child, ExitStatus};
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
