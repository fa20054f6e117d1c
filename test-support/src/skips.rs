//! Whether a test can run here: root, mpirun. A test that cannot run says
//! why and returns; under CI (which runs `make setup` as root) that is a
//! failure instead, because a skip is not a pass.

use std::process::{Command, Stdio};

/// This process's effective user is root (read from `/proc/self/status`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
}

/// Say why the test is skipped; a failure under CI.
pub fn skip(why: &str) {
    assert!(std::env::var_os("CI").is_none(), "{why}; CI must not skip");
    eprintln!("skipped: {why}");
}

/// `dir` when it holds `file`; `None` after [`skip`]ping with the reason
/// that there is no `what` at `dir` (`how` says how to get it).
pub fn dir_holding(
    dir: std::path::PathBuf,
    file: &str,
    what: &str,
    how: &str,
) -> Option<std::path::PathBuf> {
    if dir.join(file).is_file() {
        return Some(dir);
    }
    skip(&format!("no {what} at {} ({how})", dir.display()));
    None
}

/// `ok`, after [`skip`]ping with the reason that mpirun is missing when it
/// is not.
pub fn or_skip_mpirun(ok: bool) -> bool {
    if !ok {
        skip("mpirun not found (`make setup` installs Open MPI)");
    }
    ok
}

/// `mpirun --version` runs; otherwise the test is skipped ([`skip`]).
pub fn mpirun_or_skip() -> bool {
    or_skip_mpirun(
        Command::new("mpirun")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success()),
    )
}

/// `--allow-run-as-root` on an Open MPI `mpirun` command when root (Open
/// MPI refuses root without it).
pub fn allow_root(cmd: &mut Command) {
    if is_root() {
        cmd.arg("--allow-run-as-root");
    }
}
