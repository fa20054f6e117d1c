//! Process groups: the ways of starting the processes of one attempt, behind
//! one trait the supervisor drives (torchrun's `PContext`).
//!
//! | group | processes it waits for | ranks' output |
//! |---|---|---|
//! | [`LocalGroup`] | one per local rank, each in its own process group | one pipe pair per rank |
//! | [`MpirunGroup`] | one `mpirun` / `mpiexec` | mpirun's tagged lines, split per rank |
//! | [`ThreadsGroup`](crate::threads::ThreadsGroup) | one process hosting every local rank as a thread | the rank threads' tagged lines, split per rank |
//!
//! Both write the worker environment with [`WorkerEnv::to_vars`]; under
//! mpirun the rank fields are left to MPI and
//! [`keys::NUMBERED_BY_LAUNCHER`] is removed from its environment.

use std::ffi::OsString;
use std::ops::Range;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;

use accel::worker_env::{keys, WorkerEnv};
use accel_api::{Error, Result};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::mpirun::{culprit, mpirun_command, Hosts, MpiFlavor, MpirunSpec};
use crate::output::{pump_lines, MpirunOutput, RankSink, Stream};
use crate::report::{Exit, Failure};
use crate::supervise::Event;

/// The program every rank runs.
#[derive(Debug, Clone)]
pub struct Program {
    /// Resolved path.
    pub path: PathBuf,
    /// argv\[0\] as the user wrote it.
    pub argv0: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

/// What every process of one attempt shares.
#[derive(Debug, Clone)]
pub struct Attempt {
    /// 0 for the first, then the restart count.
    pub number: u32,
    /// The environment every rank of this machine gets; a group fills in
    /// the per-rank fields (rank, local rank, error file).
    pub env: WorkerEnv,
    /// Global rank of this machine's first rank.
    pub rank_offset: usize,
    /// Directory of this attempt's error files.
    pub error_dir: PathBuf,
    /// This machine's host name, for reports.
    pub host: String,
}

impl Attempt {
    /// This machine's rank (GROUP_RANK).
    pub fn machine(&self) -> usize {
        self.env.group_rank.unwrap_or(0)
    }
}

/// One started process the supervisor waits for.
#[derive(Debug)]
pub struct Started {
    /// Its pid.
    pub pid: u32,
    /// Its output threads.
    pub pumps: Vec<JoinHandle<()>>,
}

/// A way of starting the processes of an attempt.
pub trait ProcessGroup {
    /// `workers` or `mpirun`, for messages.
    fn kind(&self) -> &'static str;

    /// The global ranks whose output this group carries.
    fn ranks(&self, attempt: &Attempt) -> Range<usize>;

    /// Start the attempt's processes. Each one's output goes to `sinks`
    /// (index = rank − `ranks().start`), and its end is sent on `tx` as
    /// [`Event::Exited`] with its index in the returned list.
    ///
    /// # Errors
    /// A process or thread that cannot be started; whatever was started is
    /// killed first.
    fn start(
        &mut self,
        attempt: &Attempt,
        sinks: &[Arc<RankSink>],
        tx: &Sender<Event>,
    ) -> Result<Vec<Started>>;

    /// Send `sig` to started process `pid` (`alive`: it has not ended).
    fn signal(&self, pid: u32, sig: Signal, alive: bool);

    /// The root cause when process `index` (pid `pid`) ended with the
    /// failure `exit`; `None` when the group cannot name the rank.
    fn failure(
        &self,
        attempt: &Attempt,
        index: usize,
        pid: u32,
        exit: Exit,
        sinks: &[Arc<RankSink>],
    ) -> Option<Failure>;

    /// The root cause for the rank at `sinks[index]` (a hang).
    fn rank_failure(
        &self,
        attempt: &Attempt,
        index: usize,
        exit: Exit,
        sinks: &[Arc<RankSink>],
    ) -> Failure;

    /// What the supervisor says when it forwards the launcher's `signal`.
    fn forwarding(&self, signal: &str) -> String {
        format!("received {signal}, forwarding it to the workers")
    }

    /// Lines to show under the root-cause block (mpirun's own report).
    fn explain(&self) -> Vec<String> {
        Vec::new()
    }

    /// The attempt's processes have ended and their pipes are drained.
    fn finish(&self) {}
}

pub(crate) fn signal_group(pid: u32, sig: Signal, leader_alive: bool) {
    let p = Pid::from_raw(pid as i32);
    // The whole group: the process and whatever it started.
    let _ = killpg(p, sig);
    // And the process itself, should it have left its group (setsid).
    if leader_alive {
        let _ = kill(p, sig);
    }
}

/// Spawn `cmd` (pipes set here, own process group), pump its output, and
/// report its end as process `index` of `attempt`.
pub(crate) fn spawn_member(
    mut cmd: Command,
    label: &str,
    attempt: u32,
    index: usize,
    tx: &Sender<Event>,
    on_stdout: impl FnMut(&[u8]) + Send + 'static,
    on_stderr: impl FnMut(&[u8]) + Send + 'static,
) -> Result<Started> {
    cmd.stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Ctrl-C at the terminal reaches the launcher only, which forwards it.
        .process_group(0);
    let mut child: Child = cmd
        .spawn()
        .map_err(|e| Error::io(format!("cannot start {label}"), e))?;
    let pid = child.id();
    let io = |e| Error::io("cannot start an output thread", e);
    let started = (|| -> Result<Vec<JoinHandle<()>>> {
        let mut pumps = Vec::with_capacity(2);
        if let Some(out) = child.stdout.take() {
            pumps.push(pump_lines(out, format!("accel-out-{index}"), on_stdout).map_err(io)?);
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(pump_lines(err, format!("accel-err-{index}"), on_stderr).map_err(io)?);
        }
        Ok(pumps)
    })();
    let pumps = match started {
        Ok(p) => p,
        Err(e) => {
            signal_group(pid, Signal::SIGKILL, true);
            let _ = child.wait();
            return Err(e);
        }
    };
    let tx = tx.clone();
    let waiter = std::thread::Builder::new()
        .name(format!("accel-wait-{index}"))
        .spawn(move || {
            let exit = match child.wait() {
                Ok(s) => Exit::from_status(s),
                Err(_) => Exit::Code { code: 1 },
            };
            let _ = tx.send(Event::Exited {
                attempt,
                index,
                exit,
            });
        });
    if let Err(e) = waiter {
        signal_group(pid, Signal::SIGKILL, true);
        return Err(io(e));
    }
    Ok(Started { pid, pumps })
}

pub(crate) fn record(path: &Path) -> Option<accel::ErrorRecord> {
    accel::ErrorRecord::read(path).ok()
}

/// The root cause at `(rank, local rank, machine)`: the error file's
/// message and pid when the rank wrote one, the rank's stderr tail.
pub(crate) fn failure_at(
    (rank, local_rank, machine): (usize, usize, usize),
    host: &str,
    rec: Option<accel::ErrorRecord>,
    exit: Exit,
    sink: Option<&Arc<RankSink>>,
) -> Failure {
    Failure {
        rank,
        local_rank,
        machine,
        host: host.to_string(),
        pid: rec.as_ref().map(|r| r.pid),
        exit,
        error: rec.as_ref().map(|r| r.message.clone()),
        location: rec.and_then(|r| r.location),
        stderr_tail: sink.map(|s| s.tail()).unwrap_or_default(),
        also_hung: Vec::new(),
        interrupted: false,
    }
}

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
}

/// The error file of global rank `rank` in `attempt` (local workers).
pub fn error_file(attempt: &Attempt, rank: usize) -> PathBuf {
    attempt.error_dir.join(format!("rank-{rank}.json"))
}

/// The record in the one error file an attempt's ranks share (mpirun
/// ranks, rank threads), when it names `rank` or no rank.
pub(crate) fn shared_record(attempt: &Attempt, rank: usize) -> Option<accel::ErrorRecord> {
    record(&attempt.error_dir.join("error.json")).filter(|r| r.rank.is_none_or(|x| x == rank))
}

/// The command starting `program` with the worker contract `env` and
/// `extra_env`, without `remove_env`; stdin only for a job of one rank
/// (several workers reading one terminal is chaos; a single one may: a
/// debugger, a prompt); SIGKILLed with the launcher when `die_with_parent`.
pub(crate) fn worker_command(
    program: &Program,
    env: &WorkerEnv,
    extra_env: &[(String, String)],
    remove_env: &[String],
    die_with_parent: bool,
) -> Command {
    let mut cmd = Command::new(&program.path);
    cmd.arg0(&program.argv0);
    for k in remove_env {
        cmd.env_remove(k);
    }
    let one = env.world_size == Some(1);
    cmd.args(&program.args)
        .envs(env.to_vars())
        .envs(extra_env.iter().map(|(k, v)| (k, v)))
        .stdin(if one { Stdio::inherit() } else { Stdio::null() });
    if die_with_parent {
        crate::ffi::die_with_parent(&mut cmd, Signal::SIGKILL, false);
    }
    cmd
}

impl ProcessGroup for LocalGroup {
    fn kind(&self) -> &'static str {
        "workers"
    }

    fn ranks(&self, attempt: &Attempt) -> Range<usize> {
        attempt.rank_offset..attempt.rank_offset + self.local_world_size
    }

    fn start(
        &mut self,
        attempt: &Attempt,
        sinks: &[Arc<RankSink>],
        tx: &Sender<Event>,
    ) -> Result<Vec<Started>> {
        let mut started: Vec<Started> = Vec::with_capacity(self.local_world_size);
        for (local, sink) in sinks.iter().enumerate() {
            let cmd = worker_command(
                &self.program,
                &self.worker_env(attempt, local),
                &self.extra_env,
                &self.remove_env,
                self.die_with_parent,
            );
            let label = format!(
                "rank {} ({})",
                attempt.rank_offset + local,
                self.program.argv0.to_string_lossy()
            );
            let (out, err) = (sink.clone(), sink.clone());
            match spawn_member(
                cmd,
                &label,
                attempt.number,
                local,
                tx,
                move |l| out.line(Stream::Stdout, l),
                move |l| err.line(Stream::Stderr, l),
            ) {
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

    fn signal(&self, pid: u32, sig: Signal, alive: bool) {
        signal_group(pid, sig, alive);
    }

    fn failure(
        &self,
        attempt: &Attempt,
        index: usize,
        pid: u32,
        exit: Exit,
        sinks: &[Arc<RankSink>],
    ) -> Option<Failure> {
        let mut f = self.rank_failure(attempt, index, exit, sinks);
        f.pid = Some(pid);
        Some(f)
    }

    fn rank_failure(
        &self,
        attempt: &Attempt,
        index: usize,
        exit: Exit,
        sinks: &[Arc<RankSink>],
    ) -> Failure {
        let rank = attempt.rank_offset + index;
        let rec = record(&error_file(attempt, rank));
        let place = (rank, index, attempt.machine());
        failure_at(place, &attempt.host, rec, exit, sinks.get(index))
    }
}

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

    fn start(
        &mut self,
        attempt: &Attempt,
        sinks: &[Arc<RankSink>],
        tx: &Sender<Event>,
    ) -> Result<Vec<Started>> {
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

    fn signal(&self, pid: u32, sig: Signal, _alive: bool) {
        let p = Pid::from_raw(pid as i32);
        if sig == Signal::SIGKILL {
            // Whatever is left in mpirun's process group goes too.
            let _ = kill(p, sig);
            let _ = killpg(p, sig);
        } else {
            // mpirun stops its ranks (and reaps them) on SIGTERM.
            let _ = kill(p, Signal::SIGTERM);
        }
    }

    fn forwarding(&self, signal: &str) -> String {
        format!("received {signal}, sending SIGTERM to mpirun")
    }

    fn failure(
        &self,
        attempt: &Attempt,
        _index: usize,
        _pid: u32,
        exit: Exit,
        sinks: &[Arc<RankSink>],
    ) -> Option<Failure> {
        let c = culprit(&self.explain());
        let rank = c.rank.filter(|&r| r < self.total)?;
        let mut f = self.rank_failure(attempt, rank, c.exit.unwrap_or(exit), sinks);
        if let Some(h) = c.host {
            f.host = h;
        }
        f.pid = c.pid.or(f.pid);
        Some(f)
    }

    fn rank_failure(
        &self,
        attempt: &Attempt,
        index: usize,
        exit: Exit,
        sinks: &[Arc<RankSink>],
    ) -> Failure {
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

/// Ranks output lines are drawn into: one sink per rank of the group.
pub(crate) fn sinks_for(
    ranks: Range<usize>,
    attempt: u32,
    show: impl Fn(usize) -> bool,
    tee: Option<&Path>,
    start: std::time::Instant,
    stdout_to_stderr: bool,
) -> Result<Vec<Arc<RankSink>>> {
    let mut v = Vec::with_capacity(ranks.len());
    for rank in ranks {
        let file = match tee {
            Some(d) => Some(crate::output::open_log(d, rank, attempt)?),
            None => None,
        };
        let sink = RankSink::with_streams(rank, show(rank), file, start, stdout_to_stderr);
        if attempt > 0 {
            sink.tee_marker(&format!(
                "==== accel: attempt {attempt} (ACCEL_RESTART_COUNT={attempt}) ===="
            ));
        }
        v.push(sink);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::time::Duration;

    fn attempt() -> Attempt {
        Attempt {
            number: 2,
            env: WorkerEnv {
                world_size: Some(8),
                group_rank: Some(1),
                group_world_size: Some(2),
                master_addr: Some("10.0.0.1".into()),
                master_port: Some(29500),
                store_url: Some("tcp://10.0.0.1:29500".into()),
                token: Some("tok".into()),
                run_id: Some("r1".into()),
                timeout: Some(Duration::from_secs(90)),
                backend: Some(vec!["cpu-gloo".into()]),
                debug: Some(true),
                restart_count: Some(2),
                max_restarts: Some(3),
                launcher: Some("accel".into()),
                ..WorkerEnv::default()
            },
            rank_offset: 4,
            error_dir: PathBuf::from("/tmp/e"),
            host: "h".into(),
        }
    }

    fn program() -> Program {
        Program {
            path: "/bin/true".into(),
            argv0: "true".into(),
            args: Vec::new(),
        }
    }

    #[test]
    fn the_runtime_reads_what_a_local_worker_gets() {
        let g = LocalGroup {
            program: program(),
            local_world_size: 4,
            extra_env: Vec::new(),
            remove_env: Vec::new(),
            die_with_parent: false,
        };
        let vars: HashMap<String, String> = g
            .worker_env(&attempt(), 3)
            .to_vars()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        let s = accel::ProcessState::from_vars(vars).unwrap();
        assert_eq!(
            (
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size,
                s.node_rank
            ),
            (7, 8, 3, 4, 1)
        );
        assert_eq!(s.source, accel::LaunchSource::Accel);
        assert_eq!(s.store_location().unwrap().unwrap(), "tcp://10.0.0.1:29500");
        assert_eq!((s.run_id.as_str(), s.token.as_deref()), ("r1", Some("tok")));
        assert_eq!(s.timeout, Duration::from_secs(90));
        assert!(s.debug && s.restart_count == 2);
        assert_eq!(s.error_file, Some(PathBuf::from("/tmp/e/rank-7.json")));
    }

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
