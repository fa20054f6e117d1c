//! Whether a test can run here: root, mpirun. A test that cannot run says
//! so with [`skip`] and returns: one visible `SKIP <test>: <why>` line on
//! stderr, appended to the file `ACCEL_SKIP_LOG` names (`make test` prints
//! them all after its totals). Where `make test` or CI runs (`ACCEL_TEST_STRICT`
//! or `CI` set), a skip of what the Makefile's setup provides is a failure:
//! a skip is not a pass. What no setup can provide (a GPU, a bindable `::1`)
//! is [`skip_absent_hardware`]: recorded the same way, never a failure.

use std::io::Write;
use std::process::{Command, Stdio};

/// This process's effective user is root (read from `/proc/self/status`).
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(2) == Some("0"))
}

/// A skip here must fail: `make test` (`ACCEL_TEST_STRICT`, any value but
/// `0` or empty) or CI (`CI`, any value) runs after the Makefile's setup.
pub fn strict() -> bool {
    let set = |k: &str| std::env::var(k).is_ok_and(|v| !v.is_empty() && v != "0");
    set("ACCEL_TEST_STRICT") || std::env::var_os("CI").is_some()
}

/// The running test's name (libtest names each test's thread after it),
/// else this binary's.
fn test_name() -> String {
    match std::thread::current().name() {
        Some(n) if n != "main" => n.to_string(),
        _ => std::env::args()
            .next()
            .map(|a| a.rsplit('/').next().unwrap_or(&a).to_string())
            .unwrap_or_default(),
    }
}

/// Print `SKIP <test>: <why>` and append it to `ACCEL_SKIP_LOG`'s file.
pub fn record(why: &str) {
    let line = format!("SKIP {}: {why}", test_name());
    eprintln!("{line}");
    if let Some(path) = std::env::var_os("ACCEL_SKIP_LOG") {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path);
        // One write per line: lanes append to the same file at once.
        if let Ok(mut f) = file {
            let _ = f.write_all(format!("{line}\n").as_bytes());
        }
    }
}

/// Skip for a missing dependency the Makefile's setup provides: a failure
/// where [`strict`], else a recorded skip.
#[track_caller]
pub fn skip(why: &str) {
    assert!(
        !strict(),
        "{why}; a skip is not a pass under make test or CI (ACCEL_TEST_STRICT / CI): run the Makefile's setup"
    );
    record(why);
}

/// Skip for something only root can do here (network namespaces, a Slurm
/// daemon): [`skip`] as root, where the Makefile's setup provides the rest;
/// a recorded skip otherwise (no setup makes a user root).
#[track_caller]
pub fn skip_needs_root(why: &str) {
    if is_root() {
        skip(why);
    } else {
        record(&format!("{why} (needs root; make test as root runs it)"));
    }
}

/// Skip for hardware or a host facility no setup provides (a GPU, `::1`):
/// recorded, never a failure.
pub fn skip_absent_hardware(why: &str) {
    record(why);
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

#[cfg(test)]
mod tests {
    use super::*;

    // One test: it sets this process's environment.
    #[test]
    fn a_skip_is_listed_by_name_and_fails_under_make_test_but_hardware_does_not() {
        let log = std::env::temp_dir().join(format!("accel-skips-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&log);
        std::env::set_var("ACCEL_SKIP_LOG", &log);
        std::env::remove_var("CI");
        std::env::set_var("ACCEL_TEST_STRICT", "0");
        skip("no frobnicator (make setup installs it)");
        std::env::set_var("ACCEL_TEST_STRICT", "1");
        let strict = std::panic::catch_unwind(|| skip("no frobnicator"));
        let text = format!("{:?}", strict.unwrap_err().downcast_ref::<String>());
        assert!(text.contains("a skip is not a pass"), "{text}");
        skip_absent_hardware("no GPU");
        let lines = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_file(&log).unwrap();
        let name = "skips::tests::a_skip_is_listed_by_name_and_fails_under_make_test_but_hardware_does_not";
        assert_eq!(
            lines,
            format!("SKIP {name}: no frobnicator (make setup installs it)\nSKIP {name}: no GPU\n")
        );
    }
}
