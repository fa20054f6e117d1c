//! The crate's only unsafe code: asking the kernel to signal a child when
//! its launcher dies, set between `fork` and `exec`.

use std::os::unix::process::CommandExt;
use std::process::Command;

use nix::sys::signal::Signal;

/// Make the kernel send `sig` to the child `cmd` starts when the thread
/// that starts it ends (the launcher dies, even by SIGKILL), so nothing
/// outlives a killed launcher. If the launcher is already gone when the
/// child starts, the start fails.
///
/// Linux sends the signal when the *thread* that forked the child ends:
/// start children from a thread that outlives them (the supervisor's).
///
/// `ignore_sigpipe`: the child ignores SIGPIPE, so that writing to the
/// dead launcher's pipes fails instead of killing it; mpirun needs that to
/// finish its SIGTERM handling (stopping its ranks) after the launcher died.
pub fn die_with_parent(cmd: &mut Command, sig: Signal, ignore_sigpipe: bool) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec. It calls
    // only prctl(2), sigaction(2) and getppid(2) (async-signal-safe system
    // calls, through nix's allocation-free wrappers) and builds an io::Error
    // from a raw errno, which does not allocate; it touches no lock and no
    // memory of the parent's other threads. Setting SIGPIPE to SIG_IGN
    // installs no handler, so no Rust code runs in signal context.
    unsafe {
        cmd.pre_exec(move || {
            if ignore_sigpipe {
                nix::sys::signal::signal(Signal::SIGPIPE, nix::sys::signal::SigHandler::SigIgn)
                    .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
            }
            nix::sys::prctl::set_pdeathsig(sig)
                .map_err(|e| std::io::Error::from_raw_os_error(e as i32))?;
            // The launcher may have died before the request took effect.
            if nix::unistd::getppid() != parent {
                return Err(std::io::Error::from_raw_os_error(nix::libc::ESRCH));
            }
            Ok(())
        });
    }
}
