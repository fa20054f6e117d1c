//! Process groups: the ways of starting the processes of one attempt, behind
//! one trait the supervisor drives (torchrun's `PContext`), one file each.
//!
//! | group | processes it waits for | ranks' output |
//! |---|---|---|
//! | [`LocalGroup`] (`local.rs`) | one per local rank, each in its own process group | one pipe pair per rank |
//! | [`MpirunGroup`] (`mpirun.rs`) | one `mpirun` / `mpiexec` | mpirun's tagged lines, split per rank |
//! | [`ThreadsGroup`] (`threads.rs`) | one process hosting every local rank as a thread | the rank threads' tagged lines, split per rank |
//!
//! `ThreadsGroup` starts its one process with `LocalGroup`'s command
//! set-up. All write the worker environment with
//! [`WorkerEnv::to_vars`](accel_api::worker::WorkerEnv::to_vars); under
//! mpirun the rank fields are left to MPI and
//! [`keys::NUMBERED_BY_LAUNCHER`](accel_api::worker::keys::NUMBERED_BY_LAUNCHER)
//! is removed from its environment.

mod local;
mod mpirun;
pub mod threads;

pub use local::LocalGroup;
pub use mpirun::MpirunGroup;
pub use threads::{ThreadsGroup, ThreadsOutput};

use std::ffi::OsString;
use std::ops::Range;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::thread::JoinHandle;

use accel_api::worker::WorkerEnv;
use accel_api::{Error, Result};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use crate::event::Event;
use crate::output::{pump_lines, RankSink};
use crate::report::{Exit, Failure};

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

/// A started process that ended: its index in [`ProcessGroup::start`]'s
/// list, its pid, and how it ended.
#[derive(Debug, Clone, Copy)]
pub struct Ended {
    /// Its index among the started processes.
    pub index: usize,
    /// Its pid.
    pub pid: u32,
    /// How it ended.
    pub exit: Exit,
}

/// The output sinks of a group's ranks, first rank first.
pub type Sinks = [Arc<RankSink>];

/// Where a group's processes report their ends ([`Event::Exited`]).
pub type Events = Sender<Event>;

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
    fn start(&mut self, attempt: &Attempt, sinks: &Sinks, tx: &Events) -> Result<Vec<Started>>;

    /// Send `sig` to started process `pid` (`alive`: it has not ended).
    /// The default signals the process's whole process group.
    fn signal(&self, pid: u32, sig: Signal, alive: bool) {
        signal_group(pid, sig, alive);
    }

    /// The root cause when a started process `ended` with a failure; `None`
    /// when the group cannot name the rank. The default blames the rank at
    /// `sinks[ended.index]` (one process per rank).
    fn failure(&self, attempt: &Attempt, ended: Ended, sinks: &Sinks) -> Option<Failure> {
        let mut f = self.rank_failure(attempt, ended.index, ended.exit, sinks);
        f.pid = Some(ended.pid);
        Some(f)
    }

    /// The root cause for the rank at `sinks[index]` (a hang).
    fn rank_failure(&self, attempt: &Attempt, index: usize, exit: Exit, sinks: &Sinks) -> Failure;

    /// Ask started process `pid` to dump its flight recorder (SIGUSR1);
    /// `false` when it was not asked. The default signals the process
    /// itself, not its group (a child of the rank may not catch SIGUSR1),
    /// and only once it catches SIGUSR1 (`accel::Accelerator::new` installs
    /// the handler; before that, or in a program without accel, SIGUSR1
    /// would end it). Under mpirun the process is the guard (or mpirun),
    /// which passes SIGUSR1 on to mpirun, which passes it on to every rank
    /// (Open MPI's mpirun propagates SIGUSR1 and SIGUSR2 to the job).
    fn request_dump(&self, pid: u32) -> bool {
        catches(pid, Signal::SIGUSR1) && kill(Pid::from_raw(pid as i32), Signal::SIGUSR1).is_ok()
    }

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

/// `true` when process `pid` has a handler for `sig` (its `SigCgt` mask in
/// `/proc/PID/status`).
pub(crate) fn catches(pid: u32, sig: Signal) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
        .is_some_and(|mask| mask & (1u64 << (sig as i32 - 1)) != 0)
}

/// Send `sig` to the process group of `pid` (the process and whatever it
/// started that stayed in its group), and to the process itself while it
/// lives. A process that left the group (`setsid`, `setpgid`) is not
/// reached: it is the program's own, and outlives the run.
pub(crate) fn signal_group(pid: u32, sig: Signal, leader_alive: bool) {
    let p = Pid::from_raw(pid as i32);
    // A stopped process (SIGSTOP, a debugger's stop) acts on SIGTERM only
    // once continued: continue it, so that a stop ends it within the grace
    // period instead of waiting for SIGKILL.
    let stopping = matches!(sig, Signal::SIGTERM | Signal::SIGINT | Signal::SIGHUP);
    for s in std::iter::once(sig).chain(stopping.then_some(Signal::SIGCONT)) {
        // The whole group: the process and whatever it started.
        let _ = killpg(p, s);
        // And the process itself, should it have left its group (setsid).
        if leader_alive {
            let _ = kill(p, s);
        }
    }
}

/// Spawn `cmd` (pipes set here, own process group), pump its output, and
/// report its end as process `index` of `attempt`.
pub(crate) fn spawn_member(
    mut cmd: Command,
    label: &str,
    attempt: u32,
    index: usize,
    tx: &Events,
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

pub(crate) fn record(path: &Path) -> Option<accel_api::worker::ErrorRecord> {
    accel_api::worker::ErrorRecord::read(path).ok()
}

/// The root cause at `(rank, local rank, machine)`: the error file's
/// message and pid when the rank wrote one, the rank's stderr tail.
pub(crate) fn failure_at(
    (rank, local_rank, machine): (usize, usize, usize),
    host: &str,
    rec: Option<accel_api::worker::ErrorRecord>,
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

/// The error file of global rank `rank` in `attempt` (local workers).
pub fn error_file(attempt: &Attempt, rank: usize) -> PathBuf {
    attempt.error_dir.join(format!("rank-{rank}.json"))
}

/// The record in the one error file an attempt's ranks share (mpirun
/// ranks, rank threads), when it names `rank` or no rank.
pub(crate) fn shared_record(
    attempt: &Attempt,
    rank: usize,
) -> Option<accel_api::worker::ErrorRecord> {
    record(&attempt.error_dir.join("error.json")).filter(|r| r.rank.is_none_or(|x| x == rank))
}

/// Ranks output lines are drawn into: one sink per rank of the group.
pub(crate) fn sinks_for(
    ranks: Range<usize>,
    attempt: u32,
    show: impl Fn(usize) -> bool,
    tee: Option<&Path>,
    streams: Option<&crate::output::StreamLogs>,
    start: std::time::Instant,
    stdout_to_stderr: bool,
) -> Result<Vec<Arc<RankSink>>> {
    let mut v = Vec::with_capacity(ranks.len());
    let first = ranks.start;
    for rank in ranks {
        let file = match tee {
            Some(d) => Some(crate::output::open_log(d, rank, attempt)?),
            None => None,
        };
        let sink = match streams {
            Some(logs) => RankSink::with_stream_files(
                rank,
                show(rank),
                file,
                start,
                stdout_to_stderr,
                logs.open(rank - first, attempt)?,
            ),
            None => RankSink::with_streams(rank, show(rank), file, start, stdout_to_stderr),
        };
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
pub(crate) mod fixtures {
    use super::*;
    use std::time::Duration;

    pub(crate) fn attempt() -> Attempt {
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

    pub(crate) fn program() -> Program {
        Program {
            path: "/bin/true".into(),
            argv0: "true".into(),
            args: Vec::new(),
        }
    }
}
