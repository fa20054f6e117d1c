//! The [`Accelerator`] type and its runtime methods, one file per concern
//! (the table in the type's docs); the training loop's methods live in
//! `train/` and `zero/`, over this runtime.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};

use accel_api::{Communicator, Store};

use crate::state::ProcessState;

mod collectives;
mod connect;
mod identity;
mod mesh;
pub(crate) use mesh::DataParallel;
mod processes;

/// The connected runtime of one process: its [`ProcessState`], the chosen
/// backend's world communicator, the run's rendezvous store, and the
/// execution-control helpers of Accelerate.
///
/// # Where each method lives
///
/// One file per concern, under `accel/src/` (the runtime's in
/// `accelerator/`, the training loop's in `train/` and `zero/`):
///
/// | concern | file | methods |
/// |---|---|---|
/// | making one | `accelerator/connect.rs` | [`new`](Self::new), [`connect`](Self::connect), [`from_communicator`](Self::from_communicator) |
/// | who this process is | `accelerator/identity.rs` | [`state`](Self::state), [`comm`](Self::comm), [`store`](Self::store), [`backend_name`](Self::backend_name), [`rank`](Self::rank), [`world_size`](Self::world_size), [`local_rank`](Self::local_rank), [`is_main_process`](Self::is_main_process), [`is_local_main_process`](Self::is_local_main_process), [`is_last_process`](Self::is_last_process) |
/// | which rank does what | `accelerator/processes.rs` | [`on_main_process`](Self::on_main_process), [`on_local_main_process`](Self::on_local_main_process), [`on_last_process`](Self::on_last_process), [`on_process`](Self::on_process), [`on_local_process`](Self::on_local_process), [`wait_for_everyone`](Self::wait_for_everyone), [`main_process_first`](Self::main_process_first), [`split_between_processes`](Self::split_between_processes), [`split_between_processes_padded`](Self::split_between_processes_padded), [`split_between_processes_map`](Self::split_between_processes_map), [`print`](Self::print) |
/// | collectives | `accelerator/collectives.rs` | [`all_reduce`](Self::all_reduce), [`gather`](Self::gather), [`gather_varsize`](Self::gather_varsize), [`broadcast`](Self::broadcast), [`reduce`](Self::reduce), [`pad_across_processes`](Self::pad_across_processes), [`abort`](Self::abort) |
/// | training settings, RNG, triggers | `train/control.rs` | [`settings_not_applied`](Self::settings_not_applied), [`with_training`](Self::with_training), [`set_training_config`](Self::set_training_config), [`training_config`](Self::training_config), [`set_seed`](Self::set_seed), [`rng`](Self::rng), [`synchronize_rng_states`](Self::synchronize_rng_states), [`set_trigger`](Self::set_trigger), [`check_trigger`](Self::check_trigger) |
/// | preparing models, optimizers, schedulers, loaders | `train/prepare.rs` | [`prepare`](Self::prepare), [`prepare_model`](Self::prepare_model), [`prepare_optimizer`](Self::prepare_optimizer), [`prepare_scheduler`](Self::prepare_scheduler), [`prepare_scheduler_for`](Self::prepare_scheduler_for), [`prepare_loader`](Self::prepare_loader) |
/// | streaming (iterable) loaders | `train/iterable.rs` | [`prepare_iterable_loader`](Self::prepare_iterable_loader) |
/// | accumulation, backward, gradient sync, mixed precision, clipping | `train/grad_sync.rs` | [`accumulate`](Self::accumulate), [`accumulate_step`](Self::accumulate_step), [`sync_gradients`](Self::sync_gradients), [`gradient_accumulation_steps`](Self::gradient_accumulation_steps), [`backward`](Self::backward), [`backward_overlapped`](Self::backward_overlapped), [`no_sync`](Self::no_sync), [`mixed_precision`](Self::mixed_precision), [`grad_scaler`](Self::grad_scaler), [`optimizer_step_was_skipped`](Self::optimizer_step_was_skipped), [`unscale_gradients`](Self::unscale_gradients), [`clip_grad_norm`](Self::clip_grad_norm), [`clip_grad_value`](Self::clip_grad_value) |
/// | step phases, straggler reports | `train/phases.rs` | [`phase`](Self::phase), [`phase_guard`](Self::phase_guard), [`last_step_phases`](Self::last_step_phases), [`straggler_report`](Self::straggler_report) |
/// | metrics | `train/metrics.rs` | [`gather_for_metrics`](Self::gather_for_metrics), [`gather_for_metrics_rows`](Self::gather_for_metrics_rows), [`gather_objects_for_metrics`](Self::gather_objects_for_metrics) |
/// | checkpoints | `train/checkpoint.rs` | [`register_for_checkpointing`](Self::register_for_checkpointing), [`save_iteration`](Self::save_iteration), [`set_save_iteration`](Self::set_save_iteration), [`save_state`](Self::save_state), [`save_state_to`](Self::save_state_to), [`latest_checkpoint`](Self::latest_checkpoint), [`load_state`](Self::load_state), [`load_latest_intact`](Self::load_latest_intact), [`load_weights`](Self::load_weights) |
/// | background saves | `train/save.rs` | [`save_state_async`](Self::save_state_async), [`wait_for_save`](Self::wait_for_save) |
/// | model files (the Hugging Face layout) | `train/model_io.rs` | [`save_model`](Self::save_model), [`load_model`](Self::load_model), [`load_model_broadcast`](Self::load_model_broadcast), [`load_model_converting`](Self::load_model_converting) |
/// | torch's distributed-checkpoint layout (per-rank shards) | `train/torch_dcp.rs` | [`save_model_sharded`](Self::save_model_sharded), [`save_shards`](Self::save_shards) |
/// | trackers | `train/trackers.rs` | [`init_trackers`](Self::init_trackers), [`add_tracker`](Self::add_tracker), [`trackers`](Self::trackers), [`log`](Self::log), [`set_total_steps`](Self::set_total_steps), [`end_training`](Self::end_training) |
/// | the device mesh | `accelerator/mesh.rs` | [`device_mesh`](Self::device_mesh), [`set_parallelism_config`](Self::set_parallelism_config), [`parallelism_config`](Self::parallelism_config) |
/// | ZeRO sharding | `zero/accelerator.rs` | [`sharding`](Self::sharding), [`prepare_zero`](Self::prepare_zero), [`zero_step`](Self::zero_step) |
pub struct Accelerator {
    /// This rank's section, step and phase clock (section timeouts,
    /// status). First: dropped first, its last status sees the rings.
    watch: Arc<crate::watch::Watch>,
    state: Arc<ProcessState>,
    comm: Arc<dyn Communicator>,
    store: Arc<dyn Store>,
    /// The state of the layer above the runtime (the training loop's),
    /// made on its first use: the runtime does not know its type.
    extension: OnceLock<Box<dyn Any + Send + Sync>>,
    /// The device mesh, built on first use (`mesh/`).
    pub(crate) mesh: std::sync::Mutex<Option<Arc<crate::mesh::DeviceMesh>>>,
    /// The run's parallelism, checked for the world (`accelerator/mesh.rs`).
    pub(crate) parallelism: std::sync::Mutex<crate::mesh::ParallelismConfig>,
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

    /// This rank's section, step and phase clock.
    pub(crate) fn watch(&self) -> &Arc<crate::watch::Watch> {
        &self.watch
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

    /// `(file under src/, method)` for every public method of an
    /// `impl Accelerator` block in the crate.
    fn methods_in_files() -> std::collections::BTreeSet<(String, String)> {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let (mut dirs, mut found) = (vec![src.clone()], std::collections::BTreeSet::new());
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                    continue;
                }
                let file = path
                    .strip_prefix(&src)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned();
                let text = std::fs::read_to_string(&path).unwrap();
                let mut inside = false;
                for line in text.lines() {
                    if line == "impl Accelerator {" || line == "impl crate::Accelerator {" {
                        inside = true;
                    } else if line == "}" {
                        inside = false;
                    } else if let Some(rest) = line.strip_prefix("    pub fn ") {
                        if inside {
                            let name = rest.split(['<', '(']).next().unwrap().to_string();
                            found.insert((file.clone(), name));
                        }
                    }
                }
            }
        }
        found
    }

    /// The table in `Accelerator`'s docs: `(file, method)` per row's method.
    fn methods_in_table() -> std::collections::BTreeSet<(String, String)> {
        let text = include_str!("mod.rs");
        let mut rows = std::collections::BTreeSet::new();
        for line in text.lines() {
            let Some(row) = line.strip_prefix("/// | ") else {
                continue;
            };
            let cells: Vec<&str> = row.split(" | ").collect();
            if cells.len() != 3 || !cells[1].starts_with('`') {
                continue;
            }
            let file = cells[1].trim_matches('`').to_string();
            for link in cells[2].split("(Self::").skip(1) {
                let name = link.split(')').next().unwrap().to_string();
                rows.insert((file.clone(), name));
            }
        }
        rows
    }

    #[test]
    fn the_docs_table_names_the_file_of_every_method() {
        let (files, table) = (methods_in_files(), methods_in_table());
        assert!(files.len() > 60, "read too few methods: {files:?}");
        let missing: Vec<_> = files.difference(&table).collect();
        assert!(
            missing.is_empty(),
            "Accelerator's docs table lacks (file, method) {missing:?}: add the method to its \
             concern's row (accel/src/accelerator/mod.rs)"
        );
        let stale: Vec<_> = table.difference(&files).collect();
        assert!(
            stale.is_empty(),
            "the docs table names {stale:?}, not found there"
        );
    }
}
