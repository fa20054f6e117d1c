//! One attempt of a [`ProcessGroup`] under supervision: [`run_attempt`].
//!
//! The supervisor is a small state machine. While **running** it waits for
//! events (a process's end, a signal, another machine's failure, the lost
//! store) and checks the wall limit and silent ranks; the first failure or
//! interruption fixes the outcome and moves it to **stopping** (the group
//! is signalled, SIGKILL follows after the grace period, and again every
//! second while anything survives). It is **done** when every started
//! process has ended; then whatever is left in their process groups
//! (grandchildren), after a success as after a failure, is killed and the
//! pipes drained.

use std::path::PathBuf;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use accel_api::{Error, Result};
use nix::sys::signal::Signal;

use super::Event;
use crate::group::{sinks_for, Attempt, Ended, ProcessGroup, Started};
use crate::output::{say, RankFilter, RankSink};
use crate::report::{Exit, Failure, WorkerEnd};

/// How the supervisor watches a group.
#[derive(Debug, Clone)]
pub struct Supervision {
    /// Ranks whose output is shown; `None` = all.
    pub ranks: Option<RankFilter>,
    /// Directory of per-rank log files (`--tee`).
    pub tee: Option<PathBuf>,
    /// torchrun's per-stream log files (`--tee 0-3`, `--redirects`).
    pub streams: Option<crate::output::StreamLogs>,
    /// SIGTERM → SIGKILL delay.
    pub grace: Duration,
    /// Silence after which a rank is hung.
    pub hang_timeout: Option<Duration>,
    /// Bound of one attempt; the group is stopped after it.
    pub wall_limit: Option<Duration>,
    /// Write ranks' lines and the launcher's messages to the terminal.
    pub echo: bool,
    /// Install handlers for SIGINT/SIGTERM/SIGHUP and forward them.
    pub forward_signals: bool,
    /// Show the ranks' stdout lines on stderr (the caller's stdout holds a
    /// result, as in `accel bench`).
    pub stdout_to_stderr: bool,
    /// After a failure that speaks of a lost peer, or the loss of another
    /// machine, leave the other workers this long to end by themselves
    /// (their collectives time out and say which ranks they miss) before
    /// SIGTERM. `None`: SIGTERM at once.
    pub peer_drain: Option<Duration>,
    /// Where to keep the launcher's record of itself
    /// ([`LauncherRecord`](crate::running::LauncherRecord)), rewritten at
    /// every attempt's start, so that `accel dump` finds this run.
    pub record: Option<PathBuf>,
}

impl Default for Supervision {
    fn default() -> Self {
        Supervision {
            ranks: None,
            tee: None,
            streams: None,
            grace: Duration::from_secs(5),
            hang_timeout: None,
            wall_limit: None,
            echo: true,
            forward_signals: true,
            stdout_to_stderr: false,
            peer_drain: None,
            record: None,
        }
    }
}

/// How this machine's attempt ended.
#[derive(Debug)]
pub enum LocalOutcome {
    /// Every process exited 0.
    Succeeded,
    /// A process failed (or a rank hung) first.
    Failed {
        /// The root cause, when the group can name the rank.
        root: Option<Box<Failure>>,
        /// The launcher's exit code for it.
        code: u8,
        /// How the failed process ended (mpirun's own exit).
        exit: Exit,
    },
    /// Stopped because a worker on another machine failed first.
    Remote(Box<Failure>),
    /// Stopped because the store went away.
    StoreLost(String),
    /// Stopped because the launcher received this signal.
    Interrupted(i32),
    /// Stopped because the attempt ran past its wall limit.
    WallLimit(Duration),
}

/// The result of an attempt on this machine.
#[derive(Debug)]
pub struct AttemptResult {
    /// How it ended.
    pub outcome: LocalOutcome,
    /// Every started process's end.
    pub workers: Vec<WorkerEnd>,
    /// Ranks that did not stop within the grace period and were killed.
    pub killed: Vec<usize>,
}

/// One started process and what the supervisor knows of it.
struct Member {
    pid: u32,
    pumps: Vec<JoinHandle<()>>,
    exit: Option<Exit>,
    stopped: bool,
}

impl From<Started> for Member {
    fn from(s: Started) -> Member {
        Member {
            pid: s.pid,
            pumps: s.pumps,
            exit: None,
            stopped: false,
        }
    }
}

fn wait_pumps(pumps: &[JoinHandle<()>], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Where the supervisor of one attempt is.
enum Phase {
    /// Every process runs (or ended with success).
    Running,
    /// The outcome is fixed; the group is being stopped, and SIGKILL
    /// follows at `kill_at`; SIGTERM at `term_at` when it was put off
    /// ([`Supervision::peer_drain`]).
    Stopping {
        outcome: LocalOutcome,
        kill_at: Instant,
        term_at: Option<Instant>,
    },
}

/// How often the supervisor looks at the clock without an event.
const TICK: Duration = Duration::from_millis(50);

/// After a failure that dumped its flight recorder, how long the other
/// processes get to dump theirs before SIGTERM (less when they all have).
pub const DUMP_WAIT: Duration = Duration::from_secs(1);

/// The supervisor of one attempt.
struct Supervisor<'a> {
    group: &'a mut dyn ProcessGroup,
    attempt: &'a Attempt,
    sup: &'a Supervision,
    on_local_failure: &'a mut dyn FnMut(&Failure),
    sinks: Vec<Arc<RankSink>>,
    members: Vec<Member>,
    alive: usize,
    phase: Phase,
    killed: Vec<usize>,
    began: Instant,
    /// The same on the wall clock (dump files newer than it are this
    /// attempt's).
    began_wall: SystemTime,
    /// After a failure that dumped: when the other processes were asked to
    /// dump, and how many; SIGTERM goes once they all have (or after
    /// [`DUMP_WAIT`]).
    dumps_asked: Option<(SystemTime, Vec<u32>)>,
    /// The first process that exited 0 while others still ran (one process
    /// per rank): the root cause if another fails after it saying that it
    /// lost that peer.
    early: Option<usize>,
}

/// Run one attempt of `group`: start it, supervise it until every process
/// has ended, and say how it went. `on_local_failure` sees the root cause
/// as soon as it is known (to publish it to other machines).
///
/// # Errors
/// Only when the processes cannot be started at all (log files, spawn
/// failure); whatever was started is killed first.
pub fn run_attempt(
    group: &mut dyn ProcessGroup,
    attempt: &Attempt,
    sup: &Supervision,
    events: (&Sender<Event>, &Receiver<Event>),
    start: Instant,
    on_local_failure: &mut dyn FnMut(&Failure),
) -> Result<AttemptResult> {
    let (tx, rx) = events;
    let mut s = Supervisor::start(group, attempt, sup, tx, start, on_local_failure)?;
    while s.alive > 0 {
        match rx.recv_timeout(s.wait()) {
            Ok(event) => s.on_event(event),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        s.on_tick(Instant::now());
    }
    Ok(s.finish())
}

impl<'a> Supervisor<'a> {
    /// Create the error-file directory and the sinks, start the group.
    fn start(
        group: &'a mut dyn ProcessGroup,
        attempt: &'a Attempt,
        sup: &'a Supervision,
        tx: &Sender<Event>,
        start: Instant,
        on_local_failure: &'a mut dyn FnMut(&Failure),
    ) -> Result<Supervisor<'a>> {
        std::fs::create_dir_all(&attempt.error_dir).map_err(|e| {
            let dir = attempt.error_dir.display();
            Error::io(format!("cannot create the error-file directory {dir}"), e)
        })?;
        let show = |r: usize| sup.echo && sup.ranks.as_ref().is_none_or(|f| f.shows(r));
        let ranks = group.ranks(attempt);
        let (tee, err_only) = (sup.tee.as_deref(), sup.stdout_to_stderr);
        let streams = sup.streams.as_ref();
        let sinks = sinks_for(ranks, attempt.number, show, tee, streams, start, err_only)?;
        let members: Vec<Member> = group
            .start(attempt, &sinks, tx)?
            .into_iter()
            .map(Member::from)
            .collect();
        Ok(Supervisor {
            group,
            attempt,
            sup,
            on_local_failure,
            sinks,
            alive: members.len(),
            members,
            phase: Phase::Running,
            killed: Vec::new(),
            began: Instant::now(),
            began_wall: SystemTime::now(),
            dumps_asked: None,
            early: None,
        })
    }

    fn tell(&self, line: &str) {
        if self.sup.echo {
            say(line);
        }
    }

    fn first_rank(&self) -> usize {
        self.group.ranks(self.attempt).start
    }

    /// One process per rank (not one mpirun or one threads process).
    fn one_per_rank(&self) -> bool {
        self.members.len() == self.sinks.len()
    }

    /// How long to wait for the next event.
    fn wait(&self) -> Duration {
        match &self.phase {
            Phase::Running => TICK,
            Phase::Stopping {
                kill_at, term_at, ..
            } => term_at
                .unwrap_or(*kill_at)
                .saturating_duration_since(Instant::now())
                .min(TICK),
        }
    }

    fn on_event(&mut self, event: Event) {
        let n = self.attempt.number;
        match event {
            Event::Exited {
                attempt,
                index,
                exit,
            } if attempt == n => self.on_exit(index, exit),
            Event::Signal(sig) => self.on_signal(sig),
            Event::Dump => self.on_dump_request(),
            Event::Remote { attempt, failure } if attempt == n => {
                let what = match failure.exit {
                    Exit::Lost { .. } => "was lost",
                    _ => "failed",
                };
                let line = format!(
                    "a worker on machine {} {what}: {}; stopping this machine's {}",
                    failure.machine,
                    failure.headline(),
                    self.group.kind()
                );
                if matches!(failure.exit, Exit::Lost { .. }) {
                    if let Some(d) = self.sup.peer_drain.filter(|_| self.running()) {
                        self.tell(&format!("{line} in {:.1}s", d.as_secs_f64()));
                        self.stop_later(LocalOutcome::Remote(failure), d);
                        return;
                    }
                }
                self.fail(&line, LocalOutcome::Remote(failure));
            }
            Event::StoreLost { attempt, message } if attempt == n => {
                let line = format!(
                    "lost the store on machine 0 ({message}); stopping this machine's {}",
                    self.group.kind()
                );
                self.fail(&line, LocalOutcome::StoreLost(message));
            }
            // A previous attempt's straggler.
            Event::Exited { .. } | Event::Remote { .. } | Event::StoreLost { .. } => {}
        }
    }

    /// While running: say `line`, fix `outcome` and stop the group.
    fn fail(&mut self, line: &str, outcome: LocalOutcome) {
        if matches!(self.phase, Phase::Running) {
            self.tell(line);
            self.stop(outcome, Signal::SIGTERM);
        }
    }

    fn running(&self) -> bool {
        matches!(self.phase, Phase::Running)
    }

    /// Fix `outcome` (the first one wins) and SIGTERM every process after
    /// `drain`, in which they may end by themselves; SIGKILL follows after
    /// the grace period.
    fn stop_later(&mut self, outcome: LocalOutcome, drain: Duration) {
        if self.running() {
            let term_at = Instant::now() + drain;
            self.phase = Phase::Stopping {
                outcome,
                kill_at: term_at + self.sup.grace,
                term_at: Some(term_at),
            };
        }
    }

    /// The SIGTERM that [`Self::stop_later`] put off, now.
    fn stop_now(&mut self) {
        if let Phase::Stopping { term_at, .. } = &mut self.phase {
            if term_at.take().is_some() {
                self.signal_all(Signal::SIGTERM);
            }
        }
    }

    /// Fix `outcome` (the first one wins) and signal every process with
    /// `sig`; SIGKILL follows after the grace period.
    fn stop(&mut self, outcome: LocalOutcome, sig: Signal) {
        if self.running() {
            let kill_at = Instant::now() + self.sup.grace;
            self.phase = Phase::Stopping {
                outcome,
                kill_at,
                term_at: None,
            };
        }
        self.signal_all(sig);
    }

    /// Signal every process with `sig` (the ones still running are marked
    /// as stopped by the launcher).
    fn signal_all(&mut self, sig: Signal) {
        for m in self.members.iter_mut() {
            if m.exit.is_none() {
                m.stopped = true;
            }
            self.group.signal(m.pid, sig, m.exit.is_none());
        }
    }

    fn on_exit(&mut self, index: usize, exit: Exit) {
        let Some(m) = self.members.get_mut(index) else {
            return;
        };
        if m.exit.is_some() {
            return;
        }
        self.alive -= 1;
        m.exit = Some(exit);
        if exit.is_success() {
            if self.alive > 0 && self.early.is_none() && self.one_per_rank() {
                self.early = Some(index);
            }
            return;
        }
        if !matches!(self.phase, Phase::Running) {
            return;
        }
        m.stopped = false;
        // Let the pumps catch the last lines of stderr (and mpirun's
        // report); a grandchild holding the pipes open delays the stop by
        // at most this.
        wait_pumps(&m.pumps, Duration::from_secs(1));
        let pid = m.pid;
        self.group.finish();
        let ended = Ended { index, pid, exit };
        let mut root = self.group.failure(self.attempt, ended, &self.sinks);
        if let Some(early) = self.early {
            let first = self.first_rank();
            root = root.map(|noticer| match noticer.lost_peer(first + early) {
                true => self.blame_early_exit(early, noticer),
                false => noticer,
            });
        }
        if let Some(f) = &root {
            (self.on_local_failure)(f);
        }
        let drain = self
            .sup
            .peer_drain
            .filter(|_| root.as_ref().is_some_and(Failure::speaks_of_a_peer));
        let outcome = LocalOutcome::Failed {
            root: root.map(Box::new),
            code: exit.launcher_code(),
            exit,
        };
        let dump_wait = self.ask_for_dumps(index);
        match drain.max(dump_wait) {
            Some(d) => self.stop_later(outcome, d),
            None => self.stop(outcome, Signal::SIGTERM),
        }
        if drain.is_some() {
            // The peers' drain is not cut short by the dumps.
            self.dumps_asked = None;
        }
    }

    /// The process at `failed` failed having dumped its flight recorder (a
    /// timeout, a mismatch, a lost peer, a panic): ask the others to dump
    /// too, so that `accel trace` sees every rank, and say how long to
    /// wait for them ([`DUMP_WAIT`]; `None`: nobody was asked).
    fn ask_for_dumps(&mut self, failed: usize) -> Option<Duration> {
        let dir = self.attempt.env.dump_dir.as_deref()?;
        if crate::running::dumps_since(dir, self.began_wall).is_empty() {
            return None;
        }
        let at = SystemTime::now();
        let asked: Vec<u32> = self
            .members
            .iter()
            .enumerate()
            .filter(|(i, m)| *i != failed && m.exit.is_none())
            .filter(|(_, m)| self.group.request_dump(m.pid))
            .map(|(_, m)| m.pid)
            .collect();
        if asked.is_empty() {
            return None;
        }
        self.tell(&format!(
            "asking the other {} process(es) to dump their flight recorders to {} before \
             stopping them",
            asked.len(),
            dir.display()
        ));
        self.dumps_asked = Some((at, asked));
        Some(DUMP_WAIT)
    }

    /// Every process asked by [`Self::ask_for_dumps`] has dumped (or
    /// ended).
    fn dumps_done(&self) -> bool {
        let (Some((at, asked)), Some(dir)) = (&self.dumps_asked, &self.attempt.env.dump_dir) else {
            return false;
        };
        // File times lag the clock by a tick or so.
        let since = (*at - Duration::from_millis(50)).max(self.began_wall);
        let dumped: std::collections::BTreeSet<u32> = crate::running::dumps_since(dir, since)
            .iter()
            .filter_map(|p| crate::running::dump_pid(p))
            .collect();
        asked.iter().all(|pid| {
            dumped.contains(pid)
                || self
                    .members
                    .iter()
                    .any(|m| m.pid == *pid && m.exit.is_some())
        })
    }

    /// The root cause when process `early` exited 0 before `noticer`'s
    /// process failed: the early one (exit code 0 mid-job is a failure of
    /// a distributed job).
    fn blame_early_exit(&self, early: usize, noticer: Failure) -> Failure {
        let code0 = Exit::Code { code: 0 };
        let mut f = self
            .group
            .rank_failure(self.attempt, early, code0, &self.sinks);
        f.pid = Some(self.members[early].pid);
        Failure::blame_early_exit(f, noticer)
    }

    /// SIGUSR1 (`accel dump`): ask every live process to dump its flight
    /// recorder; the attempt goes on.
    fn on_dump_request(&mut self) {
        if !self.running() {
            return;
        }
        let mut asked = 0;
        let mut not_ready = Vec::new();
        let first = self.first_rank();
        for (i, m) in self.members.iter().enumerate() {
            if m.exit.is_some() {
                continue;
            }
            if self.group.request_dump(m.pid) {
                asked += 1;
            } else {
                not_ready.push(if self.one_per_rank() {
                    format!("rank {}", first + i)
                } else {
                    format!("pid {}", m.pid)
                });
            }
        }
        let dir = self.attempt.env.dump_dir.as_ref().map_or_else(
            || "the ranks' dump folder".into(),
            |d| d.display().to_string(),
        );
        let mut line = format!(
            "received SIGUSR1: asked {asked} process(es) ({}) to dump their flight recorders to {dir}",
            self.group.kind()
        );
        if !not_ready.is_empty() {
            line.push_str(&format!(
                "; not asked (no SIGUSR1 handler yet: accel::Accelerator::new installs it): {}",
                not_ready.join(", ")
            ));
        }
        self.tell(&line);
    }

    /// Forward the launcher's signal; a second one kills everything.
    fn on_signal(&mut self, sig: i32) {
        let signal = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
        match &self.phase {
            Phase::Stopping {
                outcome: LocalOutcome::Interrupted(_),
                ..
            } => {
                self.tell("second signal: killing everything now");
                self.stop(LocalOutcome::Interrupted(sig), Signal::SIGKILL);
            }
            // A signal ends the drain: the SIGTERM goes now.
            Phase::Stopping { .. } => self.stop_now(),
            Phase::Running => {
                self.tell(&self.group.forwarding(signal.as_str()));
                self.stop(LocalOutcome::Interrupted(sig), signal);
            }
        }
    }

    /// The clock's checks: SIGKILL when due, the wall limit, silent ranks.
    fn on_tick(&mut self, now: Instant) {
        match self.phase {
            Phase::Stopping {
                term_at: Some(t), ..
            } if now >= t || self.dumps_done() => {
                self.dumps_asked = None;
                self.stop_now();
            }
            Phase::Stopping { kill_at, .. } if now >= kill_at => self.escalate(now),
            Phase::Stopping { .. } => {}
            Phase::Running => {
                self.check_wall_limit(now);
                self.check_hang(now);
            }
        }
    }

    /// The grace period is over: SIGKILL whatever survives, and look again
    /// in a second.
    fn escalate(&mut self, now: Instant) {
        let stuck: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.members[i].exit.is_none())
            .collect();
        if !stuck.is_empty() {
            let first = self.first_rank();
            let ranks: Vec<usize> = if self.one_per_rank() {
                stuck.iter().map(|i| first + i).collect()
            } else {
                (first..first + self.sinks.len()).collect()
            };
            for r in &ranks {
                if !self.killed.contains(r) {
                    self.killed.push(*r);
                }
            }
            let v: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
            self.tell(&format!(
                "{} of rank(s) {} did not stop within {:?} of SIGTERM; sending SIGKILL",
                self.group.kind(),
                v.join(", "),
                self.sup.grace
            ));
        }
        for m in &self.members {
            self.group.signal(m.pid, Signal::SIGKILL, m.exit.is_none());
        }
        if let Phase::Stopping { kill_at, .. } = &mut self.phase {
            *kill_at = now + Duration::from_secs(1);
        }
    }

    fn check_wall_limit(&mut self, now: Instant) {
        let Some(limit) = self.sup.wall_limit else {
            return;
        };
        if now.duration_since(self.began) >= limit {
            let line = format!(
                "the attempt ran past its limit of {limit:?}; stopping the {}",
                self.group.kind()
            );
            self.fail(&line, LocalOutcome::WallLimit(limit));
        }
    }

    /// Ranks silent for the hang timeout, longest silence first (ties by
    /// rank); a rank whose own process has ended is not hung.
    fn hung(&self, now: Instant, limit: Duration) -> Vec<(usize, Duration)> {
        let mut hung: Vec<(usize, Duration)> = self
            .sinks
            .iter()
            .enumerate()
            .map(|(i, s)| (i, now.saturating_duration_since(s.last_output())))
            .filter(|(_, silent)| *silent >= limit)
            .collect();
        if self.one_per_rank() {
            hung.retain(|(i, _)| self.members[*i].exit.is_none());
        }
        hung.sort_by(|(i, a), (j, b)| b.cmp(a).then(i.cmp(j)));
        hung
    }

    fn check_hang(&mut self, now: Instant) {
        let Some(limit) = self.sup.hang_timeout else {
            return;
        };
        if !matches!(self.phase, Phase::Running) {
            return;
        }
        let hung = self.hung(now, limit);
        let Some(&(index, silent)) = hung.first() else {
            return;
        };
        let exit = Exit::Hung {
            silent_s: silent.as_secs(),
        };
        let mut f = self
            .group
            .rank_failure(self.attempt, index, exit, &self.sinks);
        let first = self.first_rank();
        f.also_hung = hung[1..].iter().map(|(i, _)| first + i).collect();
        self.tell(&format!(
            "{}; stopping the {}",
            f.headline(),
            self.group.kind()
        ));
        (self.on_local_failure)(&f);
        let outcome = LocalOutcome::Failed {
            root: Some(Box::new(f)),
            code: exit.launcher_code(),
            exit,
        };
        self.stop(outcome, Signal::SIGTERM);
    }

    /// Every process has ended: clean up, drain the pipes, say how it went.
    fn finish(mut self) -> AttemptResult {
        let phase = std::mem::replace(&mut self.phase, Phase::Running);
        let outcome = match phase {
            Phase::Running => LocalOutcome::Succeeded,
            Phase::Stopping { outcome, .. } => outcome,
        };
        // Whatever the processes started and left behind in their process
        // groups goes too, after a success as after a failure: a run leaves
        // nothing running. (A child that left the group, with setsid, is
        // the program's own.)
        for m in &self.members {
            self.group.signal(m.pid, Signal::SIGKILL, false);
        }
        // And what left those groups without leaving the session (the
        // ranks mpirun starts in groups of their own, and their children).
        let left = crate::leftovers::end(&self.attempt.error_dir);
        if !left.is_empty() {
            tracing::debug!(?left, "ended processes the attempt left behind");
        }
        // Output still in the pipes; a grandchild holding a pipe open must
        // not keep the launcher waiting.
        let deadline = Instant::now() + Duration::from_secs(2);
        for m in &self.members {
            wait_pumps(&m.pumps, deadline.saturating_duration_since(Instant::now()));
        }
        self.group.finish();
        let first = self.group.ranks(self.attempt).start;
        let one_per_rank = self.one_per_rank();
        let workers = self
            .members
            .iter()
            .enumerate()
            .map(|(i, m)| WorkerEnd {
                rank: if one_per_rank { first + i } else { first },
                pid: m.pid,
                exit: m.exit.unwrap_or(Exit::Code { code: 1 }),
                stopped: m.stopped,
                process: self.group.kind().to_string(),
            })
            .collect();
        AttemptResult {
            outcome,
            workers,
            killed: self.killed,
        }
    }
}
