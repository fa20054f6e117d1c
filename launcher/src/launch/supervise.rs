//! Running one attempt of the local workers: spawn, watch, stop the group
//! on the first failure (SIGTERM to every process group, SIGKILL after the
//! grace period), forward the launcher's signals, detect silent workers.

use std::ffi::OsString;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::AtomicI32;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use accel_api::{Error, Result};
use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

use super::options::RankFilter;
use super::output::{pump, say, RankSink, Stream};
use super::report::{Exit, Failure, WorkerEnd};
use super::spawn::{spawn, RunEnv};

/// The last signal the launcher received (0: none), for loops that do not
/// read the event channel (the machines' join).
pub static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// What the attempt loop reacts to.
#[derive(Debug)]
pub enum Event {
    /// A local worker ended.
    Exited {
        /// Attempt it belongs to.
        attempt: u32,
        /// Its local rank.
        local: usize,
        /// How it ended.
        exit: Exit,
    },
    /// The launcher received a signal (SIGINT, SIGTERM, SIGHUP).
    Signal(i32),
    /// A worker on another machine failed first.
    Remote {
        /// Attempt it belongs to.
        attempt: u32,
        /// The root cause it published.
        failure: Box<Failure>,
    },
    /// The store (machine 0) went away.
    StoreLost {
        /// Attempt it belongs to.
        attempt: u32,
        /// What the store client said.
        message: String,
    },
}

/// How this machine's attempt ended.
#[derive(Debug)]
pub enum LocalOutcome {
    /// Every local worker exited 0.
    Succeeded,
    /// A local worker failed (or hung) first.
    Failed(Box<Failure>),
    /// Stopped because a worker on another machine failed first.
    Remote(Box<Failure>),
    /// Stopped because the store went away.
    StoreLost(String),
    /// Stopped because the launcher received this signal.
    Interrupted(i32),
}

/// The fixed inputs of an attempt.
#[derive(Debug)]
pub struct AttemptSpec<'a> {
    /// Resolved program path.
    pub program: &'a Path,
    /// argv\[0\] as the user wrote it.
    pub argv0: &'a OsString,
    /// Its arguments.
    pub args: &'a [OsString],
    /// The environment contract of this attempt.
    pub env: &'a RunEnv,
    /// Host name, for reports.
    pub host: &'a str,
    /// Ranks whose output is shown.
    pub ranks: Option<&'a RankFilter>,
    /// Directory of per-rank log files.
    pub tee: Option<&'a Path>,
    /// SIGTERM → SIGKILL delay.
    pub grace: Duration,
    /// Silence after which a worker is hung.
    pub hang_timeout: Option<Duration>,
}

/// The result of an attempt on this machine.
#[derive(Debug)]
pub struct AttemptResult {
    /// How it ended.
    pub outcome: LocalOutcome,
    /// Every local worker's end.
    pub workers: Vec<WorkerEnd>,
    /// Ranks that did not stop within the grace period and were killed.
    pub killed: Vec<usize>,
}

struct Worker {
    rank: usize,
    pid: u32,
    sink: Arc<RankSink>,
    pumps: Vec<JoinHandle<()>>,
    exit: Option<Exit>,
    stopped: bool,
}

fn signal_group(pid: u32, sig: Signal, leader_alive: bool) {
    let p = Pid::from_raw(pid as i32);
    // The whole group: the worker and whatever it started.
    let _ = killpg(p, sig);
    // And the worker itself, should it have left its group (setsid).
    if leader_alive {
        let _ = kill(p, sig);
    }
}

fn open_log(dir: &Path, rank: usize, attempt: u32) -> Result<File> {
    std::fs::create_dir_all(dir).map_err(|e| {
        Error::io(
            format!("cannot create the log directory {}", dir.display()),
            e,
        )
    })?;
    let path: PathBuf = dir.join(format!("rank-{rank}.log"));
    let mut o = OpenOptions::new();
    o.create(true);
    if attempt == 0 {
        o.write(true).truncate(true);
    } else {
        o.append(true);
    }
    o.open(&path)
        .map_err(|e| Error::io(format!("cannot open the log file {}", path.display()), e))
}

/// Run one attempt: spawn every local worker, supervise them until all have
/// ended, and say how it went.
///
/// # Errors
/// Only when the workers cannot be started at all (log files, spawn
/// failure); whatever was started is killed first.
pub fn run_attempt(
    spec: &AttemptSpec<'_>,
    attempt: u32,
    tx: &Sender<Event>,
    rx: &Receiver<Event>,
    start: Instant,
    on_local_failure: &mut dyn FnMut(&Failure),
) -> Result<AttemptResult> {
    let env = spec.env;
    let mut workers: Vec<Worker> = Vec::with_capacity(env.local_world_size);
    std::fs::create_dir_all(&env.error_dir).map_err(|e| {
        Error::io(
            format!(
                "cannot create the error-file directory {}",
                env.error_dir.display()
            ),
            e,
        )
    })?;
    for local in 0..env.local_world_size {
        let rank = env.rank_offset + local;
        let started = (|| -> Result<Worker> {
            let tee = match spec.tee {
                Some(d) => Some(open_log(d, rank, attempt)?),
                None => None,
            };
            let show = spec.ranks.is_none_or(|f| f.shows(rank));
            let sink = RankSink::new(rank, show, tee, start);
            if attempt > 0 {
                sink.tee_marker(&format!(
                    "==== accel: attempt {attempt} (ACCEL_RESTART_COUNT={attempt}) ===="
                ));
            }
            let mut child: Child =
                spawn(spec.program, spec.argv0, spec.args, env, local).map_err(|e| {
                    Error::io(
                        format!(
                            "cannot start rank {rank} ({})",
                            spec.argv0.to_string_lossy()
                        ),
                        e,
                    )
                })?;
            sink.touch();
            let pid = child.id();
            let mut pumps = Vec::with_capacity(2);
            let io = |e| Error::io("cannot start an output thread", e);
            if let Some(out) = child.stdout.take() {
                pumps.push(pump(out, Stream::Stdout, sink.clone()).map_err(io)?);
            }
            if let Some(err) = child.stderr.take() {
                pumps.push(pump(err, Stream::Stderr, sink.clone()).map_err(io)?);
            }
            let tx = tx.clone();
            std::thread::Builder::new()
                .name(format!("accel-wait-{rank}"))
                .spawn(move || {
                    let exit = match child.wait() {
                        Ok(s) => Exit::from_status(s),
                        Err(_) => Exit::Code { code: 1 },
                    };
                    let _ = tx.send(Event::Exited {
                        attempt,
                        local,
                        exit,
                    });
                })
                .map_err(io)?;
            Ok(Worker {
                rank,
                pid,
                sink,
                pumps,
                exit: None,
                stopped: false,
            })
        })();
        match started {
            Ok(w) => workers.push(w),
            Err(e) => {
                for w in &workers {
                    signal_group(w.pid, Signal::SIGKILL, true);
                }
                // Reap them so that nothing is left behind.
                let mut left = workers.len();
                let deadline = Instant::now() + Duration::from_secs(5);
                while left > 0 && Instant::now() < deadline {
                    if let Ok(Event::Exited { attempt: a, .. }) =
                        rx.recv_timeout(Duration::from_millis(100))
                    {
                        if a == attempt {
                            left -= 1;
                        }
                    }
                }
                return Err(e);
            }
        }
    }

    let mut alive = workers.len();
    let mut outcome: Option<LocalOutcome> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed: Vec<usize> = Vec::new();
    let tick = Duration::from_millis(100);

    let begin_stop = |workers: &mut [Worker], sig: Signal, kill_at: &mut Option<Instant>| {
        for w in workers.iter_mut() {
            if w.exit.is_none() {
                w.stopped = true;
            }
            signal_group(w.pid, sig, w.exit.is_none());
        }
        kill_at.get_or_insert(Instant::now() + spec.grace);
    };

    while alive > 0 {
        let wait = match kill_at {
            Some(t) => t.saturating_duration_since(Instant::now()).min(tick),
            None if spec.hang_timeout.is_some() => tick,
            None => Duration::from_secs(1),
        };
        match rx.recv_timeout(wait) {
            Ok(Event::Exited {
                attempt: a,
                local,
                exit,
            }) if a == attempt => {
                alive -= 1;
                let w = &mut workers[local];
                w.exit = Some(exit);
                if !exit.is_success() && outcome.is_none() {
                    w.stopped = false;
                    // Let the pumps catch the last lines of stderr.
                    wait_pumps(&w.pumps, Duration::from_millis(300));
                    let f = failure_of(w, local, spec, exit);
                    on_local_failure(&f);
                    outcome = Some(LocalOutcome::Failed(Box::new(f)));
                    begin_stop(&mut workers, Signal::SIGTERM, &mut kill_at);
                }
            }
            Ok(Event::Exited { .. }) => {} // a previous attempt's straggler
            Ok(Event::Signal(sig)) => {
                let signal = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
                if matches!(outcome, Some(LocalOutcome::Interrupted(_))) {
                    // Asked twice: stop waiting.
                    say("second signal: killing every worker now");
                    begin_stop(&mut workers, Signal::SIGKILL, &mut kill_at);
                } else if outcome.is_none() {
                    say(&format!(
                        "received {}, forwarding it to the workers",
                        signal.as_str()
                    ));
                    outcome = Some(LocalOutcome::Interrupted(sig));
                    begin_stop(&mut workers, signal, &mut kill_at);
                }
            }
            Ok(Event::Remote {
                attempt: a,
                failure,
            }) if a == attempt => {
                if outcome.is_none() {
                    say(&format!(
                        "a worker on machine {} failed: {}; stopping this machine's workers",
                        failure.machine,
                        failure.headline()
                    ));
                    outcome = Some(LocalOutcome::Remote(failure));
                    begin_stop(&mut workers, Signal::SIGTERM, &mut kill_at);
                }
            }
            Ok(Event::StoreLost {
                attempt: a,
                message,
            }) if a == attempt => {
                if outcome.is_none() {
                    say(&format!(
                        "lost the store on machine 0 ({message}); stopping this machine's workers"
                    ));
                    outcome = Some(LocalOutcome::StoreLost(message));
                    begin_stop(&mut workers, Signal::SIGTERM, &mut kill_at);
                }
            }
            Ok(_) => {}
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        let now = Instant::now();
        if let Some(t) = kill_at {
            if now >= t {
                for w in workers.iter_mut().filter(|w| w.exit.is_none()) {
                    if !killed.contains(&w.rank) {
                        killed.push(w.rank);
                    }
                }
                if !killed.is_empty() {
                    let v: Vec<String> = killed.iter().map(|r| r.to_string()).collect();
                    say(&format!(
                        "rank(s) {} did not stop within {:?} of SIGTERM; sending SIGKILL",
                        v.join(", "),
                        spec.grace
                    ));
                }
                for w in workers.iter() {
                    signal_group(w.pid, Signal::SIGKILL, w.exit.is_none());
                }
                // Check again later in case something survives.
                kill_at = Some(now + Duration::from_secs(1));
            }
        }
        if let (Some(limit), None) = (spec.hang_timeout, &outcome) {
            let mut hung: Vec<(usize, Duration)> = workers
                .iter()
                .enumerate()
                .filter(|(_, w)| w.exit.is_none())
                .map(|(i, w)| (i, now.saturating_duration_since(w.sink.last_output())))
                .filter(|(_, silent)| *silent >= limit)
                .collect();
            if !hung.is_empty() {
                // The longest silence is the root cause; ties by rank.
                hung.sort_by(|(i, a), (j, b)| b.cmp(a).then(i.cmp(j)));
                let (first, silent) = hung[0];
                let exit = Exit::Hung {
                    silent_s: silent.as_secs(),
                };
                let mut f = failure_of(&workers[first], first, spec, exit);
                f.also_hung = hung[1..].iter().map(|(i, _)| workers[*i].rank).collect();
                on_local_failure(&f);
                outcome = Some(LocalOutcome::Failed(Box::new(f)));
                begin_stop(&mut workers, Signal::SIGTERM, &mut kill_at);
            }
        }
    }
    let failed = !matches!(outcome, None | Some(LocalOutcome::Succeeded));
    if failed {
        // Whatever the workers started and left behind goes too.
        for w in &workers {
            signal_group(w.pid, Signal::SIGKILL, false);
        }
    }
    // Output still in the pipes; a grandchild holding a pipe open must not
    // keep the launcher waiting.
    let deadline = Instant::now() + Duration::from_secs(2);
    for w in &workers {
        wait_pumps(&w.pumps, deadline.saturating_duration_since(Instant::now()));
    }
    let ends = workers
        .iter()
        .map(|w| WorkerEnd {
            rank: w.rank,
            pid: w.pid,
            exit: w.exit.unwrap_or(Exit::Code { code: 1 }),
            stopped: w.stopped,
        })
        .collect();
    Ok(AttemptResult {
        outcome: outcome.unwrap_or(LocalOutcome::Succeeded),
        workers: ends,
        killed,
    })
}

fn wait_pumps(pumps: &[JoinHandle<()>], limit: Duration) {
    let deadline = Instant::now() + limit;
    while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn failure_of(w: &Worker, local: usize, spec: &AttemptSpec<'_>, exit: Exit) -> Failure {
    let record = accel::ErrorRecord::read(&spec.env.error_file(local)).ok();
    Failure {
        rank: w.rank,
        local_rank: local,
        machine: spec.env.machine_rank,
        host: spec.host.to_string(),
        pid: w.pid,
        exit,
        error: record.as_ref().map(|r| r.message.clone()),
        location: record.and_then(|r| r.location),
        stderr_tail: w.sink.tail(),
        also_hung: Vec::new(),
        interrupted: false,
    }
}
