//! The processes a run left behind: every process of this session whose
//! environment carries the attempt's error-file directory
//! (`ACCEL_ERROR_FILE`, which every rank gets and its children inherit),
//! wherever it sits in the process tree. This finds what a rank started
//! even where the rank's process group cannot be named (the ranks mpirun
//! starts in process groups of its own).
//!
//! A process that started a session of its own (`setsid`) is the program's
//! and is left alone, as is one that cleared its environment.

use std::path::Path;
use std::sync::mpsc::Sender;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::{getpid, getsid, Pid};

/// How long [`end`] looks: reading another process's environment can
/// block (a process frozen or stuck in the kernel holds its memory map), and
/// the launcher must not wait on it.
pub const SCAN_LIMIT: Duration = Duration::from_secs(1);

/// SIGKILL every process of this session that carries `error_dir` in its
/// `ACCEL_ERROR_FILE`; returns their pids. The scan runs on its own thread
/// and is abandoned after [`SCAN_LIMIT`] (what it found by then is ended).
pub fn end(error_dir: &Path) -> Vec<u32> {
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = error_dir.to_path_buf();
    let spawned = std::thread::Builder::new()
        .name("accel-leftovers".into())
        .spawn(move || scan(&dir, &tx));
    if spawned.is_err() {
        return Vec::new();
    }
    let deadline = Instant::now() + SCAN_LIMIT;
    let mut ended = Vec::new();
    while let Ok(pid) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        ended.push(pid);
    }
    ended
}

/// [`end`]'s scan: each process ended is sent on `tx`.
fn scan(error_dir: &Path, tx: &Sender<u32>) {
    let Ok(session) = getsid(None) else {
        return;
    };
    let marker = format!("ACCEL_ERROR_FILE={}/", error_dir.display()).into_bytes();
    let me = getpid().as_raw();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // The session first (no memory map involved), the environment only
        // of this session's processes.
        if pid == me || getsid(Some(Pid::from_raw(pid))).ok() != Some(session) {
            continue;
        }
        if carries(pid, &marker)
            && kill(Pid::from_raw(pid), Signal::SIGKILL).is_ok()
            && tx.send(pid as u32).is_err()
        {
            return;
        }
    }
}

/// `true` when process `pid`'s environment holds a variable starting with
/// `marker`.
fn carries(pid: i32, marker: &[u8]) -> bool {
    match std::fs::read(format!("/proc/{pid}/environ")) {
        Ok(env) => env.split(|&b| b == 0).any(|v| v.starts_with(marker)),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_process_carrying_the_marker_is_ended_and_others_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let spawn = |file: &Path| {
            Command::new("sleep")
                .arg("30")
                .env("ACCEL_ERROR_FILE", file)
                .spawn()
                .unwrap()
        };
        let mut ours = spawn(&dir.path().join("rank-0.json"));
        let mut other = spawn(Path::new("/elsewhere/rank-0.json"));
        let ended = end(dir.path());
        assert_eq!(ended, vec![ours.id()]);
        assert!(ours.wait().unwrap().code().is_none(), "killed by a signal");
        assert!(other.try_wait().unwrap().is_none(), "the other one runs");
        let _ = other.kill();
        let _ = other.wait();
    }
}
