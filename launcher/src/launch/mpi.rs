//! The MPI launch path: with `--backend mpi`, `accel launch` will delegate to
//! the system's `mpirun` / `mpiexec` (root handling, a hostfile for several
//! machines) instead of spawning workers itself, because MPI ranks must be
//! started by MPI's own launcher. It arrives with the mpi backend; this is
//! the seam it plugs into.

use std::ffi::OsString;
use std::process::ExitCode;

use accel_api::{Error, ErrorKind, Result};

use super::options::Settings;

/// `true` when the settings ask for the MPI launch path: `mpi` is the first
/// backend of `--backend` / `ACCEL_BACKEND` / the config file.
pub fn requested(s: &Settings) -> bool {
    s.backend
        .as_ref()
        .and_then(|b| b.first())
        .is_some_and(|b| b == "mpi")
}

/// Launch `command` through mpirun / mpiexec.
///
/// # Errors
/// For now always [`ErrorKind::Unsupported`]: the MPI launch path arrives
/// with the mpi backend.
pub fn launch(s: &Settings, command: &[OsString]) -> Result<ExitCode> {
    let program = command
        .first()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    Err(Error::new(
        ErrorKind::Unsupported,
        "the MPI launch path (`accel launch --backend mpi`, which delegates to mpirun/mpiexec) \
         arrives with the mpi backend and is not available yet",
    )
    .with_op("accel launch")
    .with_fix(format!(
        "start the workers with `mpirun -n {} {program} ...` directly, or choose another \
         backend (e.g. --backend cpu-gloo)",
        s.nproc * s.num_machines
    )))
}
