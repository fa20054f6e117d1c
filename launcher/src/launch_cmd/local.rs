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

/// The workers' thread pools, with several workers on a machine: each gets
/// torchrun's `OMP_NUM_THREADS=1` and `RAYON_NUM_THREADS` = its share of
/// the cores given to the job (`available_parallelism`: the affinity mask
/// and cgroup quota, at least 1), so that candle's and burn's rayon pools
/// do not each take every core. A variable the user set is kept. (libtorch
/// sizes its intra-op pool from the same share: `accel_tch::set_threads_per_rank`.)
fn thread_policy(
    nproc: usize,
    cores: usize,
    get: impl Fn(&str) -> Option<String>,
) -> Vec<(String, String)> {
    if nproc <= 1 {
        return Vec::new();
    }
    let share = (cores / nproc).max(1);
    let mut env = Vec::new();
    for (k, v) in [("OMP_NUM_THREADS", 1), ("RAYON_NUM_THREADS", share)] {
        if get(k).is_none() {
            env.push((k.to_string(), v.to_string()));
        }
    }
    if !env.is_empty() {
        let said: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
        tracing::info!(
            "each of the {nproc} workers gets {} ({cores} cores; set them to choose)",
            said.join(" ")
        );
    }
    env
}

/// The cores this launcher's workers may use.
fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
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
            extra_env: thread_policy(s.nproc, cores(), |k| std::env::var(k).ok())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workers_share_the_cores_and_the_user_s_settings_stand() {
        let none = |_: &str| None;
        assert!(thread_policy(1, 16, none).is_empty(), "one worker: its own");
        let env = thread_policy(4, 16, none);
        assert!(env.contains(&("OMP_NUM_THREADS".into(), "1".into())));
        assert!(env.contains(&("RAYON_NUM_THREADS".into(), "4".into())));
        // More workers than cores: one thread each, never 0.
        let env = thread_policy(8, 2, none);
        assert!(env.contains(&("RAYON_NUM_THREADS".into(), "1".into())));
        let mine = |k: &str| (k == "RAYON_NUM_THREADS").then(|| "3".to_string());
        assert_eq!(
            thread_policy(2, 16, mine),
            vec![("OMP_NUM_THREADS".into(), "1".into())]
        );
    }
}
