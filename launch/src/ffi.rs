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
pub fn die_with_parent(cmd: &mut Command, sig: Signal) {
    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs in the forked child before exec. It calls
    // only prctl(2) and getppid(2) (async-signal-safe system calls, through
    // nix's allocation-free wrappers) and builds an io::Error from a raw
    // errno, which does not allocate; it touches no lock and no memory of
    // the parent's other threads.
    unsafe {
        cmd.pre_exec(move || {
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
