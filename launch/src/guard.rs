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

use std::ffi::OsString;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) => {}
            Err(_) => return 1,
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
