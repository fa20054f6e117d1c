//! Which rank does what: running code on some ranks only, waiting for
//! every rank, splitting work between ranks, printing once per machine.

use std::fmt;

use accel_api::Result;

use super::Accelerator;

impl Accelerator {
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
    /// `split_between_processes`). Over the data-parallel ranks (the ranks
    /// of one tensor-parallel block get the same share). Not collective.
    pub fn split_between_processes<'a, T>(&self, items: &'a [T]) -> &'a [T] {
        let (rank, size) = self.data_parallel_place();
        &items[accel_sharding::split_range(items.len(), size, rank)]
    }

    /// Like [`split_between_processes`](Self::split_between_processes), but
    /// every rank gets the same count, `ceil(len / world_size)`: short
    /// shares are padded with the **last element of `items`**, as
    /// Accelerate's `apply_padding` does (7 items on 3 ranks: `[0, 1, 2]`,
    /// `[3, 4, 6]`, `[5, 6, 6]`). Empty `items` give empty shares (where
    /// Accelerate raises). Not collective.
    pub fn split_between_processes_padded<T: Clone>(&self, items: &[T]) -> Vec<T> {
        let (rank, size) = self.data_parallel_place();
        accel_sharding::split_share(items, size, rank, true)
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
        let (rank, size) = self.data_parallel_place();
        accel_sharding::split_map(map, size, rank, apply_padding)
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
}
