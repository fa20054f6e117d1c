//! The mpi backend's private error and its one conversion into
//! [`accel_api::Error`].

use std::ffi::c_int;

use accel_api::{Error, ErrorKind};

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
