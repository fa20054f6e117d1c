//! One supervisor over every [`ProcessGroup`], and one restart loop
//! (torchrun's `SimpleElasticAgent._invoke_run`).
//!
//! [`run_attempt`] starts a group, watches it, stops it on the first
//! failure (SIGTERM, then SIGKILL after the grace period), forwards the
//! launcher's signals, reports silent ranks as hung (`--hang-timeout`) and
//! bounds the whole attempt (`wall_limit`). [`run`] repeats attempts up to
//! the restart limit, asks a [`Coordinator`] where the store is before each
//! and how the attempt went across machines after it, prints the
//! root-cause block and the summary, and returns the `--json` summary.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::Instant;

use accel_api::worker::WorkerEnv;
use accel_api::{Error, Result};
use accel_rendezvous::{TcpStoreServer, TorchStoreServer};

mod attempt;

pub use crate::event::Event;
pub use attempt::{run_attempt, AttemptResult, LocalOutcome, Supervision};

use crate::group::{Attempt, ProcessGroup};
use crate::output::{say, say_block};
use crate::report::{self, AttemptReport, Exit, Failure, Status, Summary, WorkerEnd};

/// The last signal the launcher received (0: none), for loops that do not
/// read the event channel (the machines' join).
pub static LAST_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Forward SIGINT, SIGTERM and SIGHUP to `tx` as [`Event::Signal`] (and
/// record them in [`LAST_SIGNAL`]).
///
/// # Errors
/// The handlers or their thread cannot be installed.
pub fn install_signals(tx: Sender<Event>) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .map_err(|e| Error::io("cannot install the signal handlers", e))?;
    std::thread::Builder::new()
        .name("accel-signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                LAST_SIGNAL.store(sig, Ordering::SeqCst);
                if tx.send(Event::Signal(sig)).is_err() {
                    break;
                }
            }
        })
        .map_err(|e| Error::io("cannot start the signal thread", e))?;
    Ok(())
}

/// How an attempt went across machines.
#[derive(Debug, Clone)]
pub struct Settled {
    /// Outcome.
    pub status: Status,
    /// What failed first, anywhere.
    pub root: Option<Failure>,
    /// The launcher's exit code if the run ends here.
    pub code: u8,
    /// What interrupted it (a signal's name, another machine's launcher).
    pub interrupted_by: Option<String>,
    /// A failed attempt may be restarted (false when the store is lost).
    pub restartable: bool,
}

impl Settled {
    /// The outcome on one machine (no one to agree with).
    pub fn alone(local: LocalOutcome) -> Settled {
        let failed = |root: Option<Box<Failure>>, code: u8, why: Option<String>| Settled {
            status: Status::Failed,
            root: root.map(|b| *b),
            code,
            interrupted_by: why,
            restartable: true,
        };
        match local {
            LocalOutcome::Succeeded => Settled {
                status: Status::Succeeded,
                root: None,
                code: 0,
                interrupted_by: None,
                restartable: false,
            },
            LocalOutcome::Failed { root, code, exit } => {
                let why = root
                    .is_none()
                    .then(|| format!("process {}", exit.describe()));
                failed(root, code, why)
            }
            LocalOutcome::Interrupted(sig) => Settled {
                status: Status::Interrupted,
                root: None,
                code: u8::try_from(128 + sig).unwrap_or(1),
                interrupted_by: Some(report::signal_name(sig)),
                restartable: false,
            },
            LocalOutcome::WallLimit(d) => failed(None, 124, Some(format!("wall limit of {d:?}"))),
            LocalOutcome::Remote(f) => {
                let code = f.exit.launcher_code();
                failed(Some(f), code, None)
            }
            LocalOutcome::StoreLost(m) => Settled {
                restartable: false,
                ..failed(None, 1, Some(format!("lost store: {m}")))
            },
        }
    }
}

/// What the restart loop asks of the machines' coordination.
pub trait Coordinator {
    /// Prepare attempt `n`: host or join the store, agree with the other
    /// machines; `tx` receives remote failures.
    ///
    /// # Errors
    /// The store cannot be hosted or reached, the machines do not agree.
    fn begin(&mut self, n: u32, tx: &Sender<Event>) -> Result<Attempt>;

    /// A local root cause, as soon as it is known.
    fn publish(&self, _n: u32, _failure: &Failure) {}

    /// The attempt ended on this machine: how did it go everywhere?
    fn settle(&mut self, n: u32, attempt: &Attempt, local: LocalOutcome) -> Settled {
        let _ = (n, attempt);
        Settled::alone(local)
    }

    /// Restarts allowed.
    fn max_restarts(&self) -> u32;

    /// The run ended after attempt `last`.
    fn end(&mut self, _last: u32) {}

    /// Where the store of the last attempt listened (for `--json`).
    fn store_url(&self) -> String;

    /// The stall inspector's verdict for `attempt` (`accel_api::worker::stall`), when
    /// this coordinator can read the store and a rank that timed out wrote
    /// one. The default reads nothing.
    fn stall(&self, attempt: &Attempt) -> Option<report::Stall> {
        let _ = attempt;
        None
    }
}

/// Point the root cause of a failed attempt at the rank the stall
/// inspector found missing, instead of the first rank that timed out
/// waiting for it (or instead of no rank at all, when mpirun named none).
fn blame_stall(
    group: &dyn ProcessGroup,
    attempt: &Attempt,
    settled: &mut Settled,
    stall: &report::Stall,
    workers: &[WorkerEnd],
) {
    if !matches!(settled.status, Status::Failed) {
        return;
    }
    // A lost machine is the cause the stall only witnessed.
    if settled
        .root
        .as_ref()
        .is_some_and(|f| matches!(f.exit, Exit::Lost { .. }))
    {
        return;
    }
    let Some(&(missing, _)) = stall.missing.first() else {
        return;
    };
    let ranks = group.ranks(attempt);
    let here = |rank: usize, exit: Exit| {
        ranks
            .contains(&rank)
            .then(|| group.rank_failure(attempt, rank - ranks.start, exit, &[]))
    };
    let place = here(missing, Exit::Code { code: 1 }).map(|f| (f.local_rank, f.machine, f.host));
    let victim = match settled.root.take() {
        Some(v) => Some(v),
        None => here(
            stall.seen_by,
            Exit::Code {
                code: i32::from(settled.code),
            },
        ),
    };
    settled.root = victim.map(|v| {
        let Some(place) = place else {
            // The missing rank runs on another machine: keep the victim,
            // and say who it waited for.
            let mut v = v;
            let said = v.error.take().or_else(|| v.stderr_tail.last().cloned());
            let mut e = format!(
                "rank {} timed out in {} waiting for rank(s) {} (on another machine)",
                stall.seen_by,
                stall.waiting_in,
                stall
                    .missing
                    .iter()
                    .map(|(r, _)| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            if let Some(s) = said {
                e.push('\n');
                e.push_str(&s);
            }
            v.error = Some(e);
            return v;
        };
        let mut f = Failure::blame_stall(v, stall, Some(place));
        // One process per rank: the blamed rank's own pid.
        if group.kind() == "workers" {
            f.pid = workers.iter().find(|w| w.rank == f.rank).map(|w| w.pid);
        }
        f
    });
}

/// The coordination of a run on one machine (or of an mpirun started from
/// machine 0): this launcher hosts the store, a fresh one per attempt
/// unless `per_run` (several machines reach one address).
#[derive(Debug)]
pub struct HostedStore {
    /// Where the stores bind and the workers dial them.
    pub addr: String,
    /// MASTER_PORT (0: a free one): the torch-protocol endpoint torch
    /// workers join (TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun).
    /// accel's own store, with the token, listens on a free port
    /// (ACCEL_STORE_URL).
    pub port: u16,
    /// Bind exactly (several machines were told the port).
    pub per_run: bool,
    /// The store's token.
    pub token: String,
    /// What every worker of every attempt shares (run id, timeout, ...);
    /// store fields and the restart count are filled in per attempt.
    pub base: WorkerEnv,
    /// Where error-file directories go.
    pub scratch: PathBuf,
    /// Host name for reports.
    pub host: String,
    /// Restarts allowed.
    pub max_restarts: u32,
    /// Say the store's notices (a busy port avoided).
    pub echo: bool,
    server: Option<TcpStoreServer>,
    torch: Option<TorchStoreServer>,
    url: String,
}

impl HostedStore {
    /// A coordinator hosting the store at `addr:port` with `token`.
    pub fn new(addr: &str, port: u16, per_run: bool, token: &str, base: WorkerEnv) -> Self {
        HostedStore {
            addr: addr.to_string(),
            port,
            per_run,
            token: token.to_string(),
            base,
            scratch: std::env::temp_dir(),
            host: host_name(),
            max_restarts: 0,
            echo: true,
            server: None,
            torch: None,
            url: String::new(),
        }
    }
}

/// This machine's host name.
pub fn host_name() -> String {
    nix::unistd::gethostname()
        .map(|h| h.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "localhost".into())
}

impl Coordinator for HostedStore {
    fn begin(&mut self, n: u32, _tx: &Sender<Event>) -> Result<Attempt> {
        if !self.per_run || self.server.is_none() {
            // A fresh store per attempt: no key of a failed attempt can
            // confuse the next one.
            self.server = None;
            self.torch = None;
            // Across machines (mpirun) the given port is accel's store's,
            // which the other machines were told; on one machine it is the
            // torch endpoint's, and accel's store takes a free port.
            let accel_port = if self.per_run { self.port } else { 0 };
            let (server, notice) =
                crate::store::host(&self.addr, accel_port, self.per_run, &self.token)?;
            let notice = if self.per_run {
                notice
            } else {
                let (torch, notice) = crate::store::host_torch(&self.addr, self.port, false)?;
                self.torch = Some(torch);
                notice
            };
            if let Some(msg) = notice.filter(|_| n == 0 && self.echo) {
                say(&msg);
            }
            self.server = Some(server);
        }
        let accel_port = self.server.as_ref().map_or(0, |s| s.local_addr().port());
        let port = self
            .torch
            .as_ref()
            .map_or(accel_port, |s| s.local_addr().port());
        self.url = accel_api::worker::tcp_url(&self.addr, accel_port);
        let mut env = self.base.clone();
        env.master_addr = Some(
            self.addr
                .trim_start_matches('[')
                .trim_end_matches(']')
                .into(),
        );
        env.master_port = Some(port);
        env.store_url = Some(self.url.clone());
        env.agent_store = self.torch.is_some().then_some(true);
        env.token = Some(self.token.clone());
        env.restart_count = Some(n);
        env.max_restarts = Some(self.max_restarts);
        Ok(Attempt {
            number: n,
            env,
            rank_offset: 0,
            error_dir: self.scratch.join(format!("attempt-{n}")),
            host: self.host.clone(),
        })
    }

    fn max_restarts(&self) -> u32 {
        self.max_restarts
    }

    fn end(&mut self, _last: u32) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        if let Some(t) = self.torch.take() {
            t.shutdown();
        }
    }

    fn store_url(&self) -> String {
        self.url.clone()
    }

    /// Reads the verdict from the hosted store.
    fn stall(&self, attempt: &Attempt) -> Option<report::Stall> {
        read_stall(self.server.as_ref()?.store().clone(), attempt)
    }
}

/// The stall inspector's verdict for `attempt` in the run's `store` (the
/// store root, as the launcher sees it), under the key the workers'
/// `Accelerator` uses for this run and attempt.
pub fn read_stall(store: Arc<dyn accel_api::Store>, attempt: &Attempt) -> Option<report::Stall> {
    let run_id = attempt.env.run_id.as_deref().unwrap_or("default");
    let store = accel_rendezvous::PrefixStore::new(
        store,
        accel_api::worker::stall::store_prefix(run_id, attempt.number),
    );
    // Fresh at the moment of the report, not as of the first timeout.
    let v = accel_api::worker::stall::StallVerdict::read_fresh(&store)?;
    Some(report::Stall {
        seen_by: v.seen_by,
        waiting_in: v.waiting_in,
        missing: v.missing.into_iter().map(|m| (m.rank, m.last)).collect(),
    })
}

/// A whole run: its summary and exit code.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The launcher's exit code.
    pub code: u8,
    /// What `--json` prints.
    pub summary: Summary,
    /// The last attempt's root cause, if it failed.
    pub root: Option<Failure>,
    /// Why the last attempt failed when no rank is named.
    pub why: Option<String>,
}

/// Print the root-cause block of a failed attempt, or say that the group
/// could not name a rank, then the group's own explanation.
fn print_failure(group: &dyn ProcessGroup, n: u32, s: &Settled) {
    match &s.root {
        Some(f) => f.print(n),
        None => say_block(&[
            "==================== root cause ====================".to_string(),
            format!("attempt:   {n}"),
            format!(
                "rank:      unknown ({} did not name one)",
                if group.kind() == "mpirun" {
                    "mpirun's report below"
                } else {
                    "the launcher"
                }
            ),
            format!(
                "exit:      {}",
                s.interrupted_by.as_deref().unwrap_or("unknown cause")
            ),
            "====================================================".to_string(),
        ]),
    }
    let said: Vec<String> = group
        .explain()
        .iter()
        .map(|l| crate::mpirun::untag(l))
        .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with("-----"))
        .map(|l| format!("  | {l}"))
        .collect();
    if !said.is_empty() {
        let mut lines = vec![format!(
            "{} said (last {} line(s)):",
            group.kind(),
            said.len()
        )];
        lines.extend(said);
        say_block(&lines);
    }
}

/// Run `group` until an attempt succeeds, the restarts are used up, or the
/// launcher is interrupted. `label` heads the summary (`run ID`).
///
/// # Errors
/// The coordinator's errors (store, machines' join) and start failures;
/// failed attempts are exit codes, not errors.
pub fn run(
    group: &mut dyn ProcessGroup,
    coord: &mut dyn Coordinator,
    sup: &Supervision,
    label: &str,
) -> Result<RunOutcome> {
    let t0 = Instant::now();
    let (tx, rx) = channel::<Event>();
    if sup.forward_signals {
        install_signals(tx.clone())?;
    }
    let mut reports: Vec<AttemptReport> = Vec::new();
    let mut n: u32 = 0;
    let mut last: Option<(Attempt, Settled)> = None;
    let result = (|| -> Result<u8> {
        loop {
            let sig = LAST_SIGNAL.load(Ordering::SeqCst);
            if sig != 0 && sup.forward_signals {
                return Ok(u8::try_from(128 + sig).unwrap_or(1));
            }
            let a0 = Instant::now();
            let attempt = coord.begin(n, &tx)?;
            let result = {
                let c: &dyn Coordinator = coord;
                let mut publish = |f: &Failure| c.publish(n, f);
                run_attempt(group, &attempt, sup, (&tx, &rx), t0, &mut publish)?
            };
            let mut settled = coord.settle(n, &attempt, result.outcome);
            if let Some(stall) = coord.stall(&attempt) {
                blame_stall(&*group, &attempt, &mut settled, &stall, &result.workers);
            }
            reports.push(AttemptReport {
                attempt: n,
                status: settled.status.clone(),
                duration_s: a0.elapsed().as_secs_f64(),
                root_cause: settled.root.clone(),
                workers: result.workers,
                killed: result.killed,
                interrupted_by: settled.interrupted_by.clone(),
            });
            let code = settled.code;
            let status = settled.status.clone();
            if matches!(status, Status::Failed) && sup.echo {
                print_failure(&*group, n, &settled);
            }
            let again = matches!(status, Status::Failed)
                && settled.restartable
                && n < coord.max_restarts()
                && LAST_SIGNAL.load(Ordering::SeqCst) == 0;
            last = Some((attempt, settled));
            if !again {
                return Ok(code);
            }
            n += 1;
            if sup.echo {
                let what = if group.kind() == "mpirun" {
                    "mpirun"
                } else {
                    "the group"
                };
                say(&format!(
                    "restarting {what}: restart {n} of {} (ACCEL_RESTART_COUNT={n})",
                    coord.max_restarts()
                ));
            }
        }
    })();
    coord.end(reports.last().map_or(0, |r| r.attempt));
    let code = result?;
    let (attempt, settled) = match last {
        Some((a, s)) => (Some(a), Some(s)),
        None => (None, None),
    };
    let env = attempt.as_ref().map(|a| &a.env);
    let run_id = env.and_then(|e| e.run_id.clone()).unwrap_or_default();
    let world_size = env
        .and_then(|e| e.world_size)
        .unwrap_or_else(|| group_world(&*group, attempt.as_ref()));
    if sup.echo && (reports.len() > 1 || code != 0) {
        let mut lines = vec![format!(
            "{label}: {} attempt(s), exit code {code}",
            reports.len()
        )];
        lines.extend(reports.iter().map(|r| format!("  {}", r.line())));
        say_block(&lines);
    }
    let summary = Summary {
        run_id,
        machine_rank: env.and_then(|e| e.group_rank).unwrap_or(0),
        num_machines: env.and_then(|e| e.group_world_size).unwrap_or(1),
        world_size,
        store: coord.store_url(),
        exit_code: code,
        attempts: reports,
        wall_s: t0.elapsed().as_secs_f64(),
    };
    Ok(RunOutcome {
        code,
        summary,
        root: settled.as_ref().and_then(|s| s.root.clone()),
        why: settled.and_then(|s| s.interrupted_by),
    })
}

fn group_world(group: &dyn ProcessGroup, attempt: Option<&Attempt>) -> usize {
    attempt.map_or(0, |a| group.ranks(a).len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn hosted_store_urls_bracket_ipv6_and_fill_the_attempt() {
        let (tx, _rx) = channel();
        let mut c = HostedStore::new("127.0.0.1", 0, false, "tok", WorkerEnv::default());
        c.echo = false;
        let a = c.begin(3, &tx).unwrap();
        assert!(c.store_url().starts_with("tcp://127.0.0.1:"));
        assert_eq!(a.env.store_url.as_deref(), Some(c.store_url().as_str()));
        assert_eq!(
            (a.env.restart_count, a.env.token.as_deref()),
            (Some(3), Some("tok"))
        );
        c.end(3);
        // IPv6, where this machine has a loopback for it.
        if std::net::TcpListener::bind("[::1]:0").is_ok() {
            let mut c = HostedStore::new("::1", 0, false, "tok", WorkerEnv::default());
            c.echo = false;
            let a = c.begin(0, &tx).unwrap();
            assert!(
                c.store_url().starts_with("tcp://[::1]:"),
                "{}",
                c.store_url()
            );
            assert_eq!(a.env.master_addr.as_deref(), Some("::1"));
            c.end(0);
        }
    }

    #[test]
    fn one_machine_outcomes() {
        let s = Settled::alone(LocalOutcome::Interrupted(15));
        assert_eq!((s.code, s.restartable), (143, false));
        let s = Settled::alone(LocalOutcome::WallLimit(Duration::from_secs(1)));
        assert_eq!((s.code, s.restartable), (124, true));
        let s = Settled::alone(LocalOutcome::Failed {
            root: None,
            code: 7,
            exit: Exit::Code { code: 7 },
        });
        assert_eq!(s.code, 7);
        assert!(s.interrupted_by.unwrap().contains("code 7"));
    }
}
