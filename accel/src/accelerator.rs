use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};

use accel_api::{Communicator, CommunicatorExt, ReduceOp, Result, Store};
use accel_rendezvous::PrefixStore;

use crate::registry::Registry;
use crate::scalar::Scalar;
use crate::state::{self, ProcessState};

/// The connected runtime of one process: its [`ProcessState`], the chosen
/// backend's world communicator, the run's rendezvous store, and the
/// execution-control helpers of Accelerate.
pub struct Accelerator {
    state: Arc<ProcessState>,
    comm: Arc<dyn Communicator>,
    store: Arc<dyn Store>,
    /// The state of the layer above the runtime (the training loop's),
    /// made on its first use: the runtime does not know its type.
    extension: OnceLock<Box<dyn Any + Send + Sync>>,
}

impl fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accelerator")
            .field("rank", &self.state.rank)
            .field("world_size", &self.state.world_size)
            .field("backend", &self.comm.backend_name())
            .field("store", &self.store.describe())
            .finish()
    }
}

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
        Ok(Accelerator {
            extension: OnceLock::new(),
            state,
            comm: Arc::from(comm),
            store,
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
        Ok(Accelerator {
            extension: OnceLock::new(),
            state,
            comm,
            store,
        })
    }

    /// The extension state, made by `make` on first use. One type owns
    /// the slot (the training loop's shared state).
    ///
    /// # Panics
    /// When the slot holds another type: a bug of this crate, not of the
    /// caller's input.
    pub(crate) fn extension<T: Any + Send + Sync>(&self, make: impl FnOnce() -> T) -> &T {
        self.extension
            .get_or_init(|| Box::new(make()))
            .downcast_ref::<T>()
            .expect("one type owns the accelerator's extension slot")
    }

    /// The process state.
    pub fn state(&self) -> &ProcessState {
        &self.state
    }

    /// The world communicator.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The run's rendezvous store (scoped to this run and restart).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// The chosen backend's name.
    pub fn backend_name(&self) -> &str {
        self.comm.backend_name()
    }

    /// Global rank.
    pub fn rank(&self) -> usize {
        self.state.rank
    }

    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.state.world_size
    }

    /// Rank on this machine.
    pub fn local_rank(&self) -> usize {
        self.state.local_rank
    }

    /// `true` on global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.state.is_main_process()
    }

    /// `true` on local rank 0.
    pub fn is_local_main_process(&self) -> bool {
        self.state.is_local_main_process()
    }

    /// `true` on the last rank.
    pub fn is_last_process(&self) -> bool {
        self.state.is_last_process()
    }

    /// Run `f` on the main process only; its result comes back there
    /// (`None` elsewhere). Not collective.
    pub fn on_main_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_main_process().then(f)
    }

    /// Run `f` on local rank 0 of each machine only.
    pub fn on_local_main_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_local_main_process().then(f)
    }

    /// Run `f` on the last rank only.
    pub fn on_last_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_last_process().then(f)
    }

    /// Run `f` on global rank `rank` only.
    pub fn on_process<T>(&self, rank: usize, f: impl FnOnce() -> T) -> Option<T> {
        (self.state.rank == rank).then(f)
    }

    /// Run `f` on local rank `local_rank` of each machine only.
    pub fn on_local_process<T>(&self, local_rank: usize, f: impl FnOnce() -> T) -> Option<T> {
        (self.state.local_rank == local_rank).then(f)
    }

    /// Block until every rank reaches this point (a barrier).
    ///
    /// # Errors
    /// The backend's barrier errors: timeout, lost peer, poisoned.
    pub fn wait_for_everyone(&self) -> Result<()> {
        self.comm.barrier()
    }

    /// Run `f` on the main process first, then on all others (e.g. download
    /// or preprocess once, then read from cache). Collective.
    ///
    /// # Errors
    /// Barrier errors; `f`'s result is returned as is.
    pub fn main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        if !self.is_main_process() {
            self.wait_for_everyone()?;
        }
        let out = f();
        if self.is_main_process() {
            self.wait_for_everyone()?;
        }
        Ok(out)
    }

    /// This rank's contiguous share of `items`: `len / world_size` each, the
    /// first `len % world_size` ranks one more (Accelerate's
    /// `split_between_processes`). Not collective.
    pub fn split_between_processes<'a, T>(&self, items: &'a [T]) -> &'a [T] {
        &items[self.state.split_range(items.len())]
    }

    /// Like [`split_between_processes`](Self::split_between_processes), but
    /// every rank gets the same count, `ceil(len / world_size)`: short
    /// shares are padded with the **last element of `items`**, as
    /// Accelerate's `apply_padding` does (7 items on 3 ranks: `[0, 1, 2]`,
    /// `[3, 4, 6]`, `[5, 6, 6]`). Empty `items` give empty shares (where
    /// Accelerate raises). Not collective.
    pub fn split_between_processes_padded<T: Clone>(&self, items: &[T]) -> Vec<T> {
        accel_sharding::split_share(items, self.world_size(), self.rank(), true)
    }

    /// [`split_between_processes`](Self::split_between_processes) for a map
    /// of lists (Accelerate's dict form): every value is split alike, so the
    /// `i`-th items of all keys land on the same rank; `apply_padding` pads
    /// each as [`split_between_processes_padded`](Self::split_between_processes_padded).
    /// Not collective.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](accel_api::ErrorKind::InvalidArgument)
    /// naming two keys whose lists differ in length.
    pub fn split_between_processes_map<K: Ord + Clone + fmt::Debug, T: Clone>(
        &self,
        map: &std::collections::BTreeMap<K, Vec<T>>,
        apply_padding: bool,
    ) -> Result<std::collections::BTreeMap<K, Vec<T>>> {
        accel_sharding::split_map(map, self.world_size(), self.rank(), apply_padding)
            .map_err(|e| e.with_rank(self.rank()))
    }

    /// Print a line on the local main process only (one line per machine;
    /// Accelerate's `print`). Takes anything printable:
    /// `acc.print("done")`, `acc.print(format!("loss {loss:.4}"))` or, without
    /// allocating, `acc.print(format_args!("loss {loss:.4}"))`.
    pub fn print(&self, message: impl fmt::Display) {
        if self.is_local_main_process() {
            println!("{message}");
        }
    }

    /// All-reduce a slice in place. Takes every [`Scalar`]: the engines'
    /// element types, and `u32`, `u64`, `usize`, `bool` reduced exactly
    /// (see [`Scalar`]). Collective.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`], and as [`Scalar::all_reduce`]
    /// (an overflowing integer sum is `InvalidArgument`, `mean` of `bool`
    /// `Unsupported`).
    pub fn all_reduce<T: Scalar>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        T::all_reduce(&*self.comm, data, op).map_err(|e| e.with_rank(self.rank()))
    }

    /// Gather equal-size slices from every rank, in rank order, on every
    /// rank. Takes every [`Scalar`]. Collective.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    pub fn gather<T: Scalar>(&self, data: &[T]) -> Result<Vec<T>> {
        Ok(T::from_wire(self.comm.all_gather_vec(&T::to_wire(data))?))
    }

    /// Broadcast a slice from `root` in place. Takes every [`Scalar`].
    /// Collective.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    pub fn broadcast<T: Scalar>(&self, data: &mut [T], root: usize) -> Result<()> {
        T::broadcast(&*self.comm, data, root)
    }

    /// Abort the group with `reason`: every later collective fails.
    pub fn abort(&self, reason: &str) {
        self.comm.abort(reason);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accelerator_is_send_and_sync() {
        fn is<T: Send + Sync>() {}
        is::<Accelerator>();
    }
}
