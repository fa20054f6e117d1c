//! The mpirun guard: a single-threaded parent between the launcher and
//! mpirun, so that mpirun outlives neither.
//!
//! Linux sends the parent-death signal each time a *thread* of the parent
//! exits while the child is reparented to the next one, so a
//! multi-threaded launcher that dies sends mpirun one SIGTERM per thread.
//! Open MPI's mpirun takes a second SIGTERM as "exit now, leave the ranks"
//! and orphans them. The guard has one thread: it asks for SIGKILL when the
//! launcher dies, starts mpirun with SIGTERM as *its* parent-death signal
//! (sent once, when the guard dies), forwards the first SIGTERM, SIGINT or
//! SIGHUP it receives to mpirun as SIGTERM (and ignores repeats: the
//! launcher escalates with SIGKILL to the process group), passes every
//! SIGUSR1 on (`accel dump`; mpirun passes it on to the ranks), and ends
//! the way mpirun ended.
//!
//! Open MPI 4.1's mpirun can deadlock in its own shutdown (PMIx's server
//! finalize) after every rank has ended, leaving the ranks unreaped and
//! ignoring SIGTERM. The guard watches mpirun's children: once all of them
//! have ended and mpirun is still there [`STUCK_AFTER`] later, it reads the
//! ranks' exit statuses from `/proc`, says so, kills mpirun, and ends as
//! the ranks did.

use std::ffi::OsString;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Run `program args...` under the guard and return the exit code to end
/// with (a signal death of mpirun is re-raised on the guard itself).
pub fn run(program: &OsString, args: &[OsString]) -> i32 {
    let parent = nix::unistd::getppid();
    // Duplicates of SIGKILL are harmless.
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    if nix::unistd::getppid() != parent {
        return 143;
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGHUP,
    ] {
        // No thread: a flag set from the handler.
        if signal_hook::flag::register(sig, stop.clone()).is_err() {
            eprintln!("accel mpirun-guard: cannot install a signal handler");
            return 1;
        }
    }
    // SIGUSR1 (`accel dump`): passed on to mpirun, which passes it on to
    // the ranks.
    let dump = Arc::new(AtomicBool::new(false));
    if signal_hook::flag::register(signal_hook::consts::SIGUSR1, dump.clone()).is_err() {
        eprintln!("accel mpirun-guard: cannot install a signal handler");
        return 1;
    }
    let mut cmd = Command::new(program);
    cmd.args(args);
    crate::ffi::die_with_parent(&mut cmd, Signal::SIGTERM, false);
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("accel: cannot start {}: {e}", program.to_string_lossy());
            return 127;
        }
    };
    let pid = Pid::from_raw(child.id() as i32);
    let mut forwarded = false;
    let mut watch = Stuck::default();
    let mut polled = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) => {}
            Err(_) => return 1,
        }
        if polled.elapsed() >= Duration::from_millis(200) {
            polled = Instant::now();
            if let Some(code) = watch.poll(child.id(), &program.to_string_lossy()) {
                let _ = kill(pid, Signal::SIGKILL);
                let _ = child.wait();
                return code;
            }
        }
        // Only once mpirun has its handler (SIGUSR1 would end it before).
        if dump.swap(false, Ordering::SeqCst) && crate::group::catches(child.id(), Signal::SIGUSR1)
        {
            let _ = kill(pid, Signal::SIGUSR1);
        }
        if !forwarded && stop.load(Ordering::SeqCst) {
            forwarded = true;
            let _ = kill(pid, Signal::SIGTERM);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(sig)) => {
            let _ = signal_hook::low_level::emulate_default_handler(sig);
            128 + sig
        }
        (None, None) => 1,
    }
}

/// How long mpirun may outlive all of its ranks before the guard calls it
/// stuck in its own shutdown.
pub const STUCK_AFTER: Duration = Duration::from_secs(5);

/// What the guard has seen of mpirun's children.
#[derive(Default)]
struct Stuck {
    /// Every child seen, with its wait status once it was seen ended.
    children: std::collections::BTreeMap<u32, Option<i32>>,
    /// When all children were first seen ended.
    all_ended: Option<Instant>,
}

impl Stuck {
    /// Looks at mpirun's children; returns the exit code to end with when
    /// mpirun has outlived all of them by [`STUCK_AFTER`] (saying so on
    /// stderr first).
    fn poll(&mut self, mpirun: u32, name: &str) -> Option<i32> {
        let now = children_of(mpirun);
        for &(pid, status) in &now {
            let seen = self.children.entry(pid).or_insert(None);
            if status.is_some() {
                *seen = status;
            }
        }
        // Children no longer listed were reaped by mpirun: it is working.
        let live = now.iter().any(|(_, s)| s.is_none());
        if self.children.is_empty() || live || now.is_empty() {
            self.all_ended = None;
            return None;
        }
        let since = *self.all_ended.get_or_insert_with(Instant::now);
        if since.elapsed() < STUCK_AFTER {
            return None;
        }
        let statuses: Vec<String> = now
            .iter()
            .filter_map(|(pid, s)| s.map(|s| format!("{pid}: {}", describe(s))))
            .collect();
        eprintln!(
            "accel mpirun-guard: {name} (pid {mpirun}) has not exited {:.0} s after all {} of \
             its ranks ended (stuck in its own shutdown, a known Open MPI 4.1 deadlock); \
             ending it. The ranks ended as: {}",
            STUCK_AFTER.as_secs_f64(),
            now.len(),
            statuses.join(", ")
        );
        Some(exit_code(now.iter().filter_map(|(_, s)| *s)))
    }
}

/// The code to end with for ranks that ended with these wait statuses:
/// the first non-zero exit code (the rank that failed; the others are
/// usually mpirun's signal deaths), else the first signal death as 128 +
/// signal, else 0.
fn exit_code(statuses: impl Iterator<Item = i32>) -> i32 {
    let (mut exited, mut signalled) = (0, 0);
    for s in statuses {
        if s & 0x7f == 0 {
            if exited == 0 {
                exited = (s >> 8) & 0xff;
            }
        } else if signalled == 0 {
            signalled = 128 + (s & 0x7f);
        }
    }
    if exited != 0 {
        exited
    } else {
        signalled
    }
}

/// A wait status in words.
fn describe(status: i32) -> String {
    if status & 0x7f == 0 {
        format!("exit code {}", (status >> 8) & 0xff)
    } else {
        crate::report::signal_name(status & 0x7f)
    }
}

/// The children of `parent`: pid and, for one that has ended and waits to
/// be reaped (a zombie), its wait status.
fn children_of(parent: u32) -> Vec<(u32, Option<i32>)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        if let Some((ppid, ended)) = parse_stat(&stat) {
            if ppid == parent {
                out.push((pid, ended));
            }
        }
    }
    out.sort_unstable();
    out
}

/// Parent pid and, for a zombie, its wait status (field 52, Linux 3.5+)
/// from a `/proc/PID/stat` line.
fn parse_stat(stat: &str) -> Option<(u32, Option<i32>)> {
    // The command name may hold spaces and parentheses: fields follow the
    // last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ppid = f.get(1)?.parse().ok()?;
    let ended = match *f.first()? {
        "Z" => Some(f.get(49).and_then(|c| c.parse().ok()).unwrap_or(0)),
        _ => None,
    };
    Some((ppid, ended))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_give_the_parent_and_a_zombie_s_status() {
        let mut fields = vec!["0"; 49];
        fields[0] = "Z";
        fields[1] = "1337";
        let zombie = format!("1341 (tr ai)n) {} 256", fields.join(" "));
        assert_eq!(parse_stat(&zombie), Some((1337, Some(256))));
        fields[0] = "S";
        let live = format!("1341 (train) {} 0", fields.join(" "));
        assert_eq!(parse_stat(&live), Some((1337, None)));
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn the_first_failure_gives_the_exit_code() {
        assert_eq!(exit_code([0, 0].into_iter()), 0);
        assert_eq!(exit_code([0, 3 << 8, 15].into_iter()), 3);
        assert_eq!(exit_code([15, 3 << 8].into_iter()), 3);
        assert_eq!(exit_code([0, 15].into_iter()), 143);
        assert_eq!(describe(15), crate::report::signal_name(15));
        assert_eq!(describe(1 << 8), "exit code 1");
    }

    #[test]
    fn a_live_process_has_its_parent_read_from_proc() {
        let me = std::process::id();
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let kids = children_of(me);
        let _ = child.kill();
        let _ = child.wait();
        assert!(kids.contains(&(child.id(), None)), "{kids:?}");
    }
}
