//! The launch path of the launcher's own process groups (every backend but
//! mpi): the process group this machine runs (a [`LocalGroup`] of workers,
//! or under the threads process model one [`ThreadsGroup`] process) and
//! the coordinator of the run ([`HostedStore`] on one machine,
//! [`Machines`] on several), handed to [`accel_launch::run`].

use accel_api::worker::ProcessModel;
use accel_api::Result;
use accel_launch::{
    store, Coordinator, HostedStore, LocalGroup, Machines, ProcessGroup, Program, ThreadsGroup,
};

use super::args::finish;
use super::settings::Settings;
use super::shared::{base_env, scratch_dir, supervision, with_progress_posts};
use super::{process_model, LaunchArgs};

/// torchrun's OMP_NUM_THREADS policy: with several workers on a machine and
/// no OMP_NUM_THREADS of the user's, each worker gets 1, so that N workers
/// do not each start a thread per core.
fn omp_policy(nproc: usize) -> Vec<(String, String)> {
    if nproc > 1 && std::env::var_os("OMP_NUM_THREADS").is_none() {
        tracing::info!("OMP_NUM_THREADS=1 for each worker (torchrun's default; set it to choose)");
        vec![("OMP_NUM_THREADS".into(), "1".into())]
    } else {
        Vec::new()
    }
}

/// The process group of this machine: `program` as `s.nproc` workers, or
/// as one process of `s.nproc` rank threads.
///
/// # Errors
/// A malformed `ACCEL_PROCESS_MODEL`.
fn group(s: &Settings, program: Program) -> Result<Box<dyn ProcessGroup>> {
    Ok(match process_model::model(s, &|k| std::env::var(k).ok())? {
        ProcessModel::Threads => Box::new(ThreadsGroup::new(program, s.nproc)),
        ProcessModel::Processes => Box::new(LocalGroup {
            program,
            local_world_size: s.nproc,
            extra_env: omp_policy(s.nproc)
                .into_iter()
                .chain(s.extra_env.iter().cloned())
                .collect(),
            remove_env: Vec::new(),
            die_with_parent: true,
        }),
    })
}

/// Run `program` with `s`: this machine's group under the run's
/// coordinator, until it succeeds or the restarts are used up.
///
/// # Errors
/// The settings' last checks (the rank filter), failures to host or reach
/// the store and the machines' join; worker failures are exit codes.
pub(super) fn launch(s: &Settings, args: &LaunchArgs, program: Program) -> Result<u8> {
    s.check_rank_filter(s.world_size_claim())?;
    let token = match &s.token {
        Some(t) => t.clone(),
        None => store::random_hex(16)?,
    };
    let mut group = group(s, program)?;
    let scratch = scratch_dir()?;
    let sup = supervision(s, args, &scratch)?;
    let (mut coord, label): (Box<dyn Coordinator>, String) = if s.multi_machine() {
        // Machine 0 decides the run id (its own or a random one).
        let cfg = s.machines_config(base_env(s, ""), scratch.clone());
        (Box::new(Machines::join(cfg, &token)?), "run".into())
    } else {
        let run_id = match &s.run_id {
            Some(id) => id.clone(),
            None => store::random_hex(6)?,
        };
        let mut coord = HostedStore::new(
            &s.main_addr,
            s.main_port,
            false,
            &token,
            base_env(s, &run_id),
        );
        coord.max_restarts = s.max_restarts;
        coord.scratch = scratch.clone();
        (Box::new(coord), format!("run {run_id}"))
    };
    let out = with_progress_posts(&sup, || {
        accel_launch::run(&mut *group, &mut *coord, &sup, &label)
    })?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(finish(args, &out?))
}
