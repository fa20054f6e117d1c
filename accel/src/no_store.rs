//! The store of a run an MPI launcher started without naming one: every
//! call fails with the reason (the mpi backend needs no store; others,
//! and debug mode, do).

use std::time::Duration;

use accel_api::{Error, ErrorKind, Result};

/// The store of a run whose launcher named none (an MPI launcher started
/// it directly): every call fails with the reason, naming `MASTER_ADDR`.
#[derive(Debug)]
pub(crate) struct NoStore {
    pub(crate) why: Error,
}

impl NoStore {
    fn fail<T>(&self, op: &str) -> Result<T> {
        Err(no_store_error(&self.why, op))
    }
}

/// The error of `what` (a store call, a backend) needing the store a run
/// started by an MPI launcher did not name (`why`).
pub(crate) fn no_store_error(why: &Error, what: &str) -> Error {
    Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "{what} needs the run's rendezvous store, and the launcher named none: {}",
            why.message()
        ),
    )
    .with_rank(why.rank().unwrap_or(0))
    .with_fix(
        "use the mpi backend (ACCEL_BACKEND=mpi), which needs no store under mpirun, or set \
         MASTER_ADDR and MASTER_PORT (or ACCEL_STORE_URL) to a store, or start with `accel launch`",
    )
}

impl accel_api::Store for NoStore {
    fn set(&self, _key: &str, _value: &[u8]) -> Result<()> {
        self.fail("store set")
    }
    fn get(&self, _key: &str, _timeout: Duration) -> Result<Vec<u8>> {
        self.fail("store get")
    }
    fn try_get(&self, _key: &str) -> Result<Option<Vec<u8>>> {
        self.fail("store get")
    }
    fn add(&self, _key: &str, _delta: i64) -> Result<i64> {
        self.fail("store add")
    }
    fn compare_set(&self, _: &str, _: Option<&[u8]>, _: &[u8]) -> Result<accel_api::CasOutcome> {
        self.fail("store compare_set")
    }
    fn wait(&self, _keys: &[&str], _timeout: Duration) -> Result<()> {
        self.fail("store wait")
    }
    fn delete(&self, _key: &str) -> Result<bool> {
        self.fail("store delete")
    }
    fn describe(&self) -> String {
        "none (started by an MPI launcher without MASTER_ADDR)".to_string()
    }
}
