//! Tie a worker's life to the `accel launch` that started it: if the
//! launcher dies (even by SIGKILL, when it cannot stop its workers), the
//! kernel sends the worker SIGTERM instead of leaving it orphaned, holding
//! ports and devices.

/// Ask the kernel for SIGTERM when the parent dies, if the parent is the
/// launcher named by `ACCEL_LAUNCHER_PID` (a program started through a shell
/// wrapper has another parent and is left alone; the launcher stops its
/// process group). Idempotent; does nothing off Linux or outside
/// `accel launch`.
pub fn tie_to_launcher() {
    #[cfg(target_os = "linux")]
    {
        let Some(pid) = std::env::var("ACCEL_LAUNCHER_PID")
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        else {
            return;
        };
        if nix::unistd::getppid().as_raw() != pid {
            return;
        }
        if let Err(e) = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM) {
            tracing::debug!("could not tie the worker to its launcher: {e}");
            return;
        }
        // The launcher may have died between the check and the request.
        if nix::unistd::getppid().as_raw() != pid {
            tracing::error!("the accel launcher (pid {pid}) is gone; stopping this worker");
            std::process::exit(143);
        }
    }
}
