//! The mpi backend's private error and its one conversion into
//! [`accel_api::Error`].

use std::ffi::c_int;
use std::time::Duration;

use accel_api::{Error, ErrorKind};

use crate::name::NAME;

/// An MPI error code with the library's text for it.
#[derive(Debug, Clone)]
pub(crate) struct MpiError {
    pub(crate) code: c_int,
    pub(crate) text: String,
}

impl std::fmt::Display for MpiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (MPI error code {})", self.text, self.code)
    }
}

impl std::error::Error for MpiError {}

/// MPI reported a failure: a [`ErrorKind::Backend`] error (fatal for the
/// group: MPI's default error handler would have aborted). The caller (the
/// group, or `connect`) attaches rank, op and backend.
impl From<MpiError> for Error {
    fn from(e: MpiError) -> Error {
        Error::new(ErrorKind::Backend, format!("MPI failed: {e}"))
            .with_fix("see the MPI library's message above; mpirun's output names the failed rank")
            .with_source(e)
    }
}

/// The `Timeout` error of `op` on rank `rank` of a group of `world`: the
/// text both paths report (returned, or printed by the watchdog).
/// `culprits`: the ranks that hold it up and why, when the progress
/// records tell (see [`progress`](crate::progress)).
pub(crate) fn timeout_error(
    op: &str,
    timeout: Duration,
    world: usize,
    rank: usize,
    culprits: &[(usize, String)],
) -> Error {
    let who = if culprits.is_empty() {
        format!("at least one of the {world} ranks of this group has not entered it (or is stuck)")
    } else {
        culprits
            .iter()
            .map(|(r, why)| format!("rank {r} {why}"))
            .collect::<Vec<_>>()
            .join("; ")
    };
    accel_api::kit::timeout_error(timeout, format!("{op} did not complete: {who}"))
        .with_op(op)
        .with_backend(NAME)
        .with_rank(rank)
}
