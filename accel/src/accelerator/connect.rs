//! Making an [`Accelerator`]: from the launcher's environment, from an
//! explicit state and registry, or over a communicator the caller
//! connected itself.

use std::sync::{Arc, OnceLock};

use accel_api::{Communicator, Result, Store};
use accel_rendezvous::PrefixStore;

use super::Accelerator;
use crate::registry::Registry;
use crate::state::{self, ProcessState};

impl Accelerator {
    /// Read the process state from the environment, pick a backend (probe
    /// order, or `ACCEL_BACKEND`), open the rendezvous store and connect.
    /// Also installs the panic hook that reports crashes to `accel launch`.
    ///
    /// Collective: every rank of the run must call it.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig) for a
    /// malformed environment (naming the variable),
    /// [`ErrorKind::Unavailable`](accel_api::ErrorKind::Unavailable) when no
    /// backend can run, store errors (unreachable, wrong token) and the
    /// backend's connect errors (peers missing after the timeout).
    pub fn new() -> Result<Accelerator> {
        crate::install_panic_hook();
        crate::flight::install_dump_on_signal();
        crate::tie_to_launcher();
        let state = state::state()?;
        // A malformed `accel launch --mixed-precision` value fails here, not
        // silently at the first prepare.
        accel_api::worker::MixedPrecision::from_env()?;
        Accelerator::connect(state, &Registry::from_env())
    }

    /// [`new`](Self::new) with an explicit state and registry.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn connect(state: Arc<ProcessState>, registry: &Registry) -> Result<Accelerator> {
        // The one validation path `accel env` runs too.
        let checked =
            crate::env_check::check_environment(&state, registry, &|k| std::env::var(k).ok())?;
        let (backend, device) = (checked.backend, checked.device);
        // Start-up's clock runs from here (ACCEL_TIMEOUT_STARTUP).
        let watch = crate::watch::Watch::from_env(
            state.rank,
            state.world_size,
            &crate::flight::dump_dir(),
            crate::flight::dump_for_watch,
        )?;
        let root = state.open_store()?;
        let scope = format!("accel/{}/{}", state.run_id, state.restart_count);
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(root, scope));
        let comm_store: Arc<dyn Store> = Arc::new(PrefixStore::new(store.clone(), "world"));
        let comm = backend
            .connect(state.connect_context(device, comm_store))
            .map_err(|e| e.with_backend(backend.name()).with_rank(state.rank))?;
        let comm: Box<dyn Communicator> = if state.debug {
            let dbg: Arc<dyn Store> = Arc::new(PrefixStore::new(store.clone(), "debug"));
            Box::new(crate::debug_communicator(comm, dbg))
        } else {
            comm
        };
        // The stall inspector names the ranks a timed-out collective waited
        // for (accel::stall); `accel launch` reads its verdict.
        let comm: Box<dyn Communicator> =
            if state.world_size > 1 && matches!(state.store_location(), Ok(Some(_))) {
                let st: Arc<dyn Store> = Arc::new(PrefixStore::new(store.clone(), "stall"));
                Box::new(crate::stall::stall_inspector(comm, st)?)
            } else {
                comm
            };
        tracing::info!(
            rank = state.rank,
            world_size = state.world_size,
            backend = backend.name(),
            %device,
            "accel connected"
        );
        let parallelism = std::sync::Mutex::new(super::mesh::env_parallelism(&state)?);
        Ok(Accelerator {
            extension: OnceLock::new(),
            mesh: std::sync::Mutex::new(None),
            parallelism,
            state,
            comm: Arc::from(comm),
            store,
            watch,
        })
    }

    /// An accelerator over a communicator the caller connected itself
    /// (threads as ranks in tests, the conformance suite, programs with
    /// their own bootstrap). The process state is built from the
    /// communicator's rank, world size and timeout, as if all ranks ran on
    /// one machine.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`](accel_api::ErrorKind::InvalidConfig)
    /// when the communicator reports an impossible rank.
    pub fn from_communicator(
        comm: Arc<dyn Communicator>,
        store: Arc<dyn Store>,
    ) -> Result<Accelerator> {
        let env = crate::WorkerEnv {
            rank: Some(comm.rank()),
            world_size: Some(comm.world_size()),
            local_rank: Some(comm.rank()),
            local_world_size: Some(comm.world_size()),
            timeout: Some(comm.timeout()),
            ..Default::default()
        };
        let vars = env
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let state = Arc::new(ProcessState::from_vars(vars)?);
        let watch = crate::watch::Watch::from_env(
            state.rank,
            state.world_size,
            &crate::flight::dump_dir(),
            crate::flight::dump_for_watch,
        )?;
        let parallelism = std::sync::Mutex::new(super::mesh::env_parallelism(&state)?);
        Ok(Accelerator {
            extension: OnceLock::new(),
            mesh: std::sync::Mutex::new(None),
            parallelism,
            state,
            comm,
            store,
            watch,
        })
    }
}
