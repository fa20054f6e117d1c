//! The SIGABRT handler (everything it calls is async-signal-safe: `prctl`,
//! `getpid`, `write` and copies into stack buffers), and glibc's allocator
//! settings ([`malloc`]).

pub(crate) mod malloc;
use std::mem::MaybeUninit;

extern "C" fn on_abort(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    if !info.is_null() {
        say_which_rank(info);
    }
    // The default action is back (SA_RESETHAND): a SIGABRT from outside,
    // which nothing raises again, still ends the process once this returns.
    // SAFETY: raise is async-signal-safe; SIGABRT stays blocked until the
    // handler returns.
    unsafe { libc::raise(libc::SIGABRT) };
}

/// Write the aborting rank thread's line, if the abort came from this
/// process and the thread is a rank thread.
fn say_which_rank(info: *mut libc::siginfo_t) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler;
    // the caller checked it for null.
    let (code, pid) = unsafe { ((*info).si_code, (*info).si_pid()) };
    // abort() and raise() send with tgkill (SI_TKILL) from this process, to
    // the calling thread. Anything else may have landed on any thread.
    // SAFETY: getpid has no preconditions.
    if code != libc::SI_TKILL || pid != unsafe { libc::getpid() } {
        return;
    }
    let mut name = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (NUL included) into the
    // buffer, which has 17.
    let got = unsafe {
        libc::prctl(
            libc::PR_GET_NAME,
            name.as_mut_ptr() as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if got != 0 {
        return;
    }
    let len = name.iter().position(|&b| b == 0).unwrap_or(16);
    let mut out = [0u8; 64];
    if let Some(n) = super::abort_line(&name[..len], &mut out) {
        // SAFETY: writes n initialised bytes of `out` to stderr; a failed
        // or short write is ignored (the process is dying).
        let _ = unsafe { libc::write(2, out.as_ptr().cast(), n) };
    }
}

/// Install the handler unless SIGABRT already has one that is not the
/// default. Returns whether it is installed.
pub(crate) fn install() -> bool {
    let mut old = MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: a null new action only reads the current one into `old`.
    if unsafe { libc::sigaction(libc::SIGABRT, std::ptr::null(), old.as_mut_ptr()) } != 0 {
        return false;
    }
    // SAFETY: sigaction succeeded, so it filled `old`.
    let old = unsafe { old.assume_init() };
    if old.sa_sigaction != libc::SIG_DFL {
        return false;
    }
    // SAFETY: a zeroed sigaction is a valid value (empty mask, no flags).
    let mut act: libc::sigaction = unsafe { MaybeUninit::zeroed().assume_init() };
    act.sa_sigaction = on_abort as *const () as usize;
    // SA_RESETHAND: the default action is back on entry, so the raise at
    // the handler's end (and abort()'s own second raise) ends the process.
    act.sa_flags = libc::SA_SIGINFO | libc::SA_RESETHAND;
    // SAFETY: `act` is fully initialised and the handler is an
    // async-signal-safe extern "C" function of the SA_SIGINFO shape.
    unsafe { libc::sigaction(libc::SIGABRT, &act, std::ptr::null_mut()) == 0 }
}
