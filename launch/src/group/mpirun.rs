//! [`MpirunGroup`]: one mpirun / mpiexec starting every rank (of every
//! machine, from machine 0); the rank fields of the worker contract are
//! left to MPI.

use std::ffi::OsString;
use std::ops::Range;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;

use accel_api::worker::{keys, WorkerEnv};
use accel_api::Result;
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use super::{
    failure_at, shared_record, spawn_member, Attempt, Ended, Events, ProcessGroup, Program, Sinks,
    Started,
};
use crate::mpirun::{culprit, mpirun_command, Hosts, MpiFlavor, MpirunSpec};
use crate::output::MpirunOutput;
use crate::report::{Exit, Failure};

/// One mpirun / mpiexec starting every rank (of every machine, from
/// machine 0).
#[derive(Debug)]
pub struct MpirunGroup {
    /// What each rank runs.
    pub program: Program,
    /// The launcher program (`ACCEL_MPIRUN`, else `mpirun`), resolved.
    pub launcher: PathBuf,
    /// Its family.
    pub flavor: MpiFlavor,
    /// Where the ranks run.
    pub hosts: Hosts,
    /// Ranks in the job.
    pub total: usize,
    /// Ranks per machine, for placing a rank on its machine.
    pub nproc: usize,
    /// Variables added to every rank's environment.
    pub extra_env: Vec<(String, String)>,
    /// Variables of the launcher's environment the ranks do not get.
    pub remove_env: Vec<String>,
    /// SIGTERM to mpirun if the launcher dies, so that mpirun stops its
    /// ranks.
    pub die_with_parent: bool,
    /// Show mpirun's own lines on stderr as `[mpirun] ...`.
    pub echo: bool,
    /// Start mpirun under this guard program (and its arguments), which
    /// runs [`guard::run`](crate::guard::run) on the mpirun command line
    /// that follows them: with `die_with_parent`, the only way mpirun stops
    /// its ranks when the launcher is SIGKILLed (see [`crate::guard`]).
    pub guard: Option<(PathBuf, Vec<OsString>)>,
    out: Option<Arc<MpirunOutput>>,
}

impl MpirunGroup {
    /// A group of `total` ranks of `program` under `launcher`.
    pub fn new(program: Program, launcher: PathBuf, flavor: MpiFlavor, total: usize) -> Self {
        MpirunGroup {
            program,
            launcher,
            flavor,
            hosts: Hosts::Local,
            total,
            nproc: total,
            extra_env: Vec::new(),
            remove_env: Vec::new(),
            die_with_parent: false,
            echo: true,
            guard: None,
            out: None,
        }
    }

    /// The environment every rank gets: the attempt's, without the rank
    /// fields (MPI numbers the ranks), with one error file per attempt.
    pub fn rank_env(&self, attempt: &Attempt) -> WorkerEnv {
        let mut env = attempt.env.clone();
        env.rank = None;
        env.world_size = None;
        env.local_rank = None;
        env.local_world_size = None;
        env.group_rank = None;
        env.group_world_size = None;
        env.launcher = None;
        env.launcher_pid = None;
        env.error_file = Some(attempt.error_dir.join("error.json"));
        if env.backend.is_none() {
            env.backend = Some(vec!["mpi".into()]);
        }
        env
    }

    /// The mpirun command of `attempt`, environment included.
    pub fn command(&self, attempt: &Attempt) -> Command {
        let mut spec = MpirunSpec::new(self.total, &self.program.argv0)
            .args(&self.program.args)
            .tag_output(true)
            .flavor(self.flavor);
        spec.launcher = self.launcher.clone();
        match &self.hosts {
            Hosts::Local => {}
            Hosts::List(v) => spec = spec.hosts(v.clone()),
            Hosts::File(p) => spec = spec.hostfile(p),
        }
        let mut vars: Vec<(String, String)> = self
            .rank_env(attempt)
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        vars.extend(self.extra_env.iter().cloned());
        if self.flavor == MpiFlavor::OpenMpi && self.hosts != Hosts::Local {
            // Open MPI forwards only what `-x` names to other machines;
            // `-x NAME` takes the value from the environment, so the token
            // never appears on the command line.
            for (k, _) in &vars {
                spec.extra_args.push("-x".into());
                spec.extra_args.push(OsString::from(k));
            }
        }
        let mut cmd = mpirun_command(&spec);
        for k in keys::NUMBERED_BY_LAUNCHER {
            cmd.env_remove(k);
        }
        for k in &self.remove_env {
            cmd.env_remove(k);
        }
        cmd.envs(vars).stdin(if self.total == 1 {
            Stdio::inherit()
        } else {
            Stdio::null()
        });
        cmd
    }
}
impl ProcessGroup for MpirunGroup {
    fn kind(&self) -> &'static str {
        "mpirun"
    }

    fn ranks(&self, _attempt: &Attempt) -> Range<usize> {
        0..self.total
    }

    fn start(&mut self, attempt: &Attempt, sinks: &Sinks, tx: &Events) -> Result<Vec<Started>> {
        let inner = self.command(attempt);
        let mut cmd = match &self.guard {
            None => inner,
            Some((guard, guard_args)) => {
                let mut c = Command::new(guard);
                c.args(guard_args)
                    .arg(inner.get_program())
                    .args(inner.get_args());
                for (k, v) in inner.get_envs() {
                    match v {
                        Some(v) => c.env(k, v),
                        None => c.env_remove(k),
                    };
                }
                c.stdin(if self.total == 1 {
                    Stdio::inherit()
                } else {
                    Stdio::null()
                });
                c
            }
        };
        match (self.die_with_parent, self.guard.is_some()) {
            // The guard dies with the launcher, mpirun once with the guard.
            (true, true) => crate::ffi::die_with_parent(&mut cmd, Signal::SIGKILL, false),
            (true, false) => crate::ffi::die_with_parent(&mut cmd, Signal::SIGTERM, true),
            (false, _) => {}
        }
        let out = MpirunOutput::new(sinks.to_vec(), self.echo);
        self.out = Some(out.clone());
        let (o, e) = (out.clone(), out);
        let s = spawn_member(
            cmd,
            &self.launcher.display().to_string(),
            attempt.number,
            0,
            tx,
            move |l| o.line(l),
            move |l| e.line(l),
        )
        .map_err(|e| e.with_op("accel launch --backend mpi"))?;
        for sink in sinks {
            sink.touch();
        }
        Ok(vec![s])
    }

    fn signal(&self, pid: u32, sig: Signal, alive: bool) {
        let p = Pid::from_raw(pid as i32);
        if sig == Signal::SIGKILL {
            // Whatever is left in mpirun's process group goes too (a
            // reaped mpirun's pid is never signalled: it may be reused).
            if alive {
                let _ = kill(p, sig);
            }
            let _ = killpg(p, sig);
        } else {
            // mpirun stops its ranks (and reaps them) on SIGTERM.
            let _ = kill(p, Signal::SIGTERM);
        }
    }

    fn forwarding(&self, signal: &str) -> String {
        format!("received {signal}, sending SIGTERM to mpirun")
    }

    fn failure(&self, attempt: &Attempt, ended: Ended, sinks: &Sinks) -> Option<Failure> {
        let c = culprit(&self.explain());
        let named = c.rank.filter(|&r| r < self.total);
        // A record that names its rank is the cause (a panic, a rank another
        // saw end early, a rank the watchdog saw frozen: ADR 0021); mpirun
        // names the rank that called MPI_Abort, often the one that noticed.
        let recorded = super::record(&attempt.error_dir.join("error.json"))
            .and_then(|r| r.rank)
            .filter(|&r| r < self.total);
        let rank = recorded.or(named)?;
        let mut f = self.rank_failure(attempt, rank, c.exit.unwrap_or(ended.exit), sinks);
        if named == Some(rank) {
            if let Some(h) = c.host {
                f.host = h;
            }
            f.pid = c.pid.or(f.pid);
        }
        Some(f)
    }

    fn rank_failure(&self, attempt: &Attempt, index: usize, exit: Exit, sinks: &Sinks) -> Failure {
        // One error file per attempt (the ranks share the environment):
        // the first rank that panicked through accel's hook wrote it.
        let rec = shared_record(attempt, index);
        let (machine, local_rank) = self.hosts.place(self.nproc, index);
        let place = (index, local_rank, machine);
        failure_at(place, &attempt.host, rec, exit, sinks.get(index))
    }

    fn explain(&self) -> Vec<String> {
        self.out.as_ref().map(|o| o.own_lines()).unwrap_or_default()
    }

    fn finish(&self) {
        if let Some(o) = &self.out {
            o.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{attempt, program};
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn mpirun_ranks_get_the_contract_without_the_rank_fields() {
        let g = MpirunGroup::new(program(), "mpirun".into(), MpiFlavor::OpenMpi, 2);
        let cmd = g.command(&attempt());
        let envs: HashMap<String, Option<String>> = cmd
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        for k in keys::NUMBERED_BY_LAUNCHER {
            assert_eq!(envs.get(k), Some(&None), "{k} is removed");
        }
        assert_eq!(envs["ACCEL_RUN_TOKEN"].as_deref(), Some("tok"));
        assert_eq!(
            envs["ACCEL_ERROR_FILE"].as_deref(),
            Some("/tmp/e/error.json")
        );
        // The token never reaches the command line.
        assert!(!cmd.get_args().any(|a| a.to_string_lossy().contains("tok")));
    }
}
