//! One validation path for the worker environment: what
//! [`Accelerator::new`](crate::Accelerator::new) checks before it connects,
//! and what `accel env` reports, through the same function
//! ([`check_environment`]), so that the tool a user asks "is my
//! environment right?" answers exactly as the program will.
//!
//! In order (the first failure is the answer):
//! 1. the process state ([`ProcessState::from_vars`]: ranks of every
//!    launcher family, their contradictions, timeouts, flags);
//!    `ACCEL_MIXED_PRECISION` and `ACCEL_SHARDING` among them;
//! 2. the backend: `ACCEL_BACKEND` names one that is compiled in or
//!    loaded, it is available, and this rank gets a device
//!    ([`Registry::select_for`]);
//! 3. the store: its URL's form (`ACCEL_STORE_URL`, or `MASTER_ADDR` and
//!    `MASTER_PORT`), without connecting ([`ProcessState::store_plan`]);
//!    a run an MPI launcher started without naming one is refused here
//!    unless the backend is mpi, the one that needs no store;
//! 4. the chosen backend's own variables (the mpi backend's
//!    `ACCEL_MPI_STAGING_BYTES` and `ACCEL_MPI_BLOCKING`).
//!
//! What needs the peers (the store's token, the engine's bootstrap) is
//! checked only by connecting.

use std::sync::Arc;

use accel_api::{Backend, Device, Error, Result};

use crate::state::StorePlan;
use crate::{ProcessState, Registry};

/// What a valid environment resolves to.
pub struct CheckedEnv {
    /// The backend the run would connect.
    pub backend: Arc<dyn Backend>,
    /// This rank's device.
    pub device: Device,
    /// The store it would open.
    pub store: StorePlan,
}

impl std::fmt::Debug for CheckedEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckedEnv")
            .field("backend", &self.backend.name())
            .field("device", &self.device)
            .field("store", &self.store)
            .finish()
    }
}

/// Check `state` (already read from the environment, step 1) and the rest
/// of the environment (`var`) as [`Accelerator::new`](crate::Accelerator::new)
/// does before it connects, with `registry`'s backends.
///
/// # Errors
/// The first refusal, the same error the program gets:
/// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig) naming
/// the variable, [`ErrorKind::Unavailable`](accel_api::ErrorKind::Unavailable)
/// when no backend can run.
pub fn check_environment(
    state: &ProcessState,
    registry: &Registry,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<CheckedEnv> {
    let (backend, device) = registry.select_for(state)?;
    let store = state.store_plan()?;
    if let StorePlan::Deferred(why) = &store {
        // Only the mpi backend bootstraps without a store.
        if backend.name() != "mpi" {
            let what = format!("the {} backend", backend.name());
            return Err(crate::no_store::no_store_error(why, &what));
        }
    }
    check_backend_vars(backend.name(), var).map_err(|e| e.with_backend(backend.name()))?;
    if backend.name() == "mpi" && state.mpi_launched && state.world_size > 1 {
        check_mpi_launcher(var).map_err(|e| e.with_backend("mpi").with_rank(state.rank))?;
    }
    Ok(CheckedEnv {
        backend,
        device,
        store,
    })
}

/// Variables only a running MPI launcher sets (Open MPI's mpirun, srun
/// --mpi=pmix: PMIx; MPICH's hydra, srun --mpi=pmi2: a PMI socket): rank
/// variables without any of them were set by hand or inherited, and MPI_Init
/// would start a one-process world (a singleton) instead of joining the run.
const MPI_RUNTIME_VARS: &[&str] = &[
    "PMIX_RANK",
    "PMIX_NAMESPACE",
    "OMPI_MCA_orte_hnp_uri",
    "OMPI_MCA_ess_base_jobid",
    "PMI_FD",
    "PMI_PORT",
    "HYDI_CONTROL_FD",
    "MPIRUN_RANK",
];

fn check_mpi_launcher(var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    if MPI_RUNTIME_VARS.iter().any(|k| var(k).is_some()) {
        return Ok(());
    }
    let named: Vec<&str> = [
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "MV2_COMM_WORLD_RANK",
        "PMIX_RANK",
    ]
    .into_iter()
    .filter(|k| var(k).is_some())
    .collect();
    Err(Error::new(
        accel_api::ErrorKind::InvalidConfig,
        format!(
            "MPI rank variables are set ({}) but no MPI launcher started this process (none of {} \
             is set), so MPI would start a world of one instead of joining the run",
            named.join(", "),
            MPI_RUNTIME_VARS.join(", ")
        ),
    )
    .with_fix(
        "start the program with mpirun or srun --mpi=pmix, or unset the inherited MPI variables, \
         or choose another backend with ACCEL_BACKEND (e.g. cpu-gloo)",
    ))
}

/// The variables a backend reads at connect, checked here with the same
/// rules so that `accel env` refuses what the connect would.
fn check_backend_vars(backend: &str, var: &dyn Fn(&str) -> Option<String>) -> Result<()> {
    if backend != "mpi" {
        return Ok(());
    }
    if let Some(v) = var("ACCEL_MPI_STAGING_BYTES") {
        if v.trim().parse::<usize>().is_err() {
            return Err(Error::invalid_config(
                "ACCEL_MPI_STAGING_BYTES",
                &v,
                "not a number of bytes",
            ));
        }
    }
    match var("ACCEL_MPI_BLOCKING") {
        Some(v) if !matches!(v.trim(), "" | "0" | "1") => Err(Error::invalid_config(
            "ACCEL_MPI_BLOCKING",
            &v,
            "must be 1 (blocking collectives above ACCEL_MPI_STAGING_BYTES, the default) or 0 \
             (every operation non-blocking, polled)",
        )),
        _ => Ok(()),
    }
}
