//! [`LocalGroup`]: N local workers, one process group each (torchrun's
//! `SubprocessContext`), and the command set-up every locally started
//! worker process shares (rank threads' process included).

use std::ops::Range;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;

use accel_api::worker::WorkerEnv;
use accel_api::Result;
use nix::sys::signal::Signal;

use super::{
    error_file, failure_at, record, signal_group, spawn_member, Attempt, Events, ProcessGroup,
    Program, Sinks, Started,
};
use crate::output::Stream;
use crate::report::{Exit, Failure};

/// N local workers, one process group each (torchrun's
/// `SubprocessContext`).
#[derive(Debug, Clone)]
pub struct LocalGroup {
    /// What each worker runs.
    pub program: Program,
    /// Workers on this machine.
    pub local_world_size: usize,
    /// Variables added to every worker's environment (after the contract).
    pub extra_env: Vec<(String, String)>,
    /// Variables of the launcher's environment the workers do not get.
    pub remove_env: Vec<String>,
    /// Signal the workers if the launcher dies (see
    /// [`ffi::die_with_parent`](crate::ffi::die_with_parent)).
    pub die_with_parent: bool,
}

impl LocalGroup {
    /// `local_world_size` workers of `program`, killed with the launcher.
    pub fn new(program: Program, local_world_size: usize) -> LocalGroup {
        LocalGroup {
            program,
            local_world_size,
            extra_env: Vec::new(),
            remove_env: Vec::new(),
            die_with_parent: true,
        }
    }

    /// The environment of local rank `local` in `attempt`.
    pub fn worker_env(&self, attempt: &Attempt, local: usize) -> WorkerEnv {
        let rank = attempt.rank_offset + local;
        let mut env = attempt.env.clone();
        env.rank = Some(rank);
        env.local_rank = Some(local);
        env.local_world_size = Some(self.local_world_size);
        env.error_file = Some(error_file(attempt, rank));
        env
    }

    /// The global ranks of this machine in `attempt`.
    pub(crate) fn local_ranks(&self, attempt: &Attempt) -> Range<usize> {
        attempt.rank_offset..attempt.rank_offset + self.local_world_size
    }

    /// The command starting the program with the worker contract `env` and
    /// `extra_env`, without `remove_env`; stdin only for a job of one rank
    /// (several workers reading one terminal is chaos; a single one may: a
    /// debugger, a prompt); SIGKILLed with the launcher when
    /// `die_with_parent`.
    pub(crate) fn command(&self, env: &WorkerEnv) -> Command {
        let mut cmd = Command::new(&self.program.path);
        cmd.arg0(&self.program.argv0);
        for k in &self.remove_env {
            cmd.env_remove(k);
        }
        let one = env.world_size == Some(1);
        cmd.args(&self.program.args)
            .envs(env.to_vars())
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .stdin(if one { Stdio::inherit() } else { Stdio::null() });
        if self.die_with_parent {
            crate::ffi::die_with_parent(&mut cmd, Signal::SIGKILL, false);
        }
        cmd
    }

    /// Start the program with `env` as process `index` of `attempt`
    /// (`what` names it in errors), its output lines going to `on_line`.
    pub(crate) fn spawn(
        &self,
        env: &WorkerEnv,
        what: &str,
        (attempt, index): (u32, usize),
        tx: &Events,
        on_line: impl Fn(Stream, &[u8]) + Send + Sync + 'static,
    ) -> Result<Started> {
        let label = format!("{what} ({})", self.program.argv0.to_string_lossy());
        let on_line = Arc::new(on_line);
        let out = on_line.clone();
        spawn_member(
            self.command(env),
            &label,
            attempt,
            index,
            tx,
            move |l| out(Stream::Stdout, l),
            move |l| on_line(Stream::Stderr, l),
        )
    }
}

impl ProcessGroup for LocalGroup {
    fn kind(&self) -> &'static str {
        "workers"
    }

    fn ranks(&self, attempt: &Attempt) -> Range<usize> {
        self.local_ranks(attempt)
    }

    fn start(&mut self, attempt: &Attempt, sinks: &Sinks, tx: &Events) -> Result<Vec<Started>> {
        let mut started: Vec<Started> = Vec::with_capacity(self.local_world_size);
        for (local, sink) in sinks.iter().enumerate() {
            let what = format!("rank {}", attempt.rank_offset + local);
            let s = sink.clone();
            let spawned = self.spawn(
                &self.worker_env(attempt, local),
                &what,
                (attempt.number, local),
                tx,
                move |stream, l| s.line(stream, l),
            );
            match spawned {
                Ok(s) => {
                    sink.touch();
                    started.push(s);
                }
                Err(e) => {
                    for s in &started {
                        signal_group(s.pid, Signal::SIGKILL, true);
                    }
                    return Err(e);
                }
            }
        }
        Ok(started)
    }

    fn rank_failure(&self, attempt: &Attempt, index: usize, exit: Exit, sinks: &Sinks) -> Failure {
        let rank = attempt.rank_offset + index;
        let rec = record(&error_file(attempt, rank));
        let place = (rank, index, attempt.machine());
        failure_at(place, &attempt.host, rec, exit, sinks.get(index))
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{attempt, program};
    use super::*;
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::time::Duration;

    #[test]
    fn the_runtime_reads_what_a_local_worker_gets() {
        let g = LocalGroup {
            local_world_size: 4,
            die_with_parent: false,
            ..LocalGroup::new(program(), 4)
        };
        let vars: HashMap<String, String> = g
            .worker_env(&attempt(), 3)
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let s = accel::ProcessState::from_vars(vars).unwrap();
        assert_eq!((s.rank, s.world_size, s.node_rank), (7, 8, 1));
        assert_eq!((s.local_rank, s.local_world_size), (3, 4));
        assert_eq!(s.source, accel::LaunchSource::Accel);
        assert_eq!(s.store_location().unwrap().unwrap(), "tcp://10.0.0.1:29500");
        assert_eq!((s.run_id.as_str(), s.token.as_deref()), ("r1", Some("tok")));
        assert_eq!(s.timeout, Duration::from_secs(90));
        assert!(s.debug && s.restart_count == 2);
        assert_eq!(s.error_file, Some(PathBuf::from("/tmp/e/rank-7.json")));
    }
}
