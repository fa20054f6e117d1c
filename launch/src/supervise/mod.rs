//! One supervisor over every [`ProcessGroup`], and one restart loop
//! (torchrun's `SimpleElasticAgent._invoke_run`).
//!
//! [`run_attempt`] starts a group, watches it, stops it on the first
//! failure (SIGTERM, then SIGKILL after the grace period), forwards the
//! launcher's signals, reports silent ranks as hung (`--hang-timeout`) and
//! bounds the whole attempt (`wall_limit`). [`run`] repeats attempts up to
//! the restart limit, asks a [`Coordinator`] where the store is before each
//! and how the attempt went across machines after it, prints the
//! root-cause block (with the flight-recorder dumps the attempt wrote) and
//! the summary, and returns the `--json` summary. Each attempt's ranks get
//! `ACCEL_DUMP_DIR` (the run's default when none is set), and SIGUSR1 asks
//! them to dump (`accel dump`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::channel;
use std::time::{Instant, SystemTime};

use accel_api::Result;

mod attempt;

pub use crate::event::{install_signals, Event, LAST_SIGNAL};
pub use attempt::{run_attempt, AttemptResult, LocalOutcome, Supervision};

use crate::coordinate::{Coordinator, Settled};
use crate::group::{Attempt, ProcessGroup};
use crate::output::{say, say_block};
use crate::report::{self, AttemptReport, Exit, Failure, Status, Summary, WorkerEnd};
use crate::running::{self, LauncherRecord};

/// Point the root cause of a failed attempt at the rank the stall
/// inspector found missing, instead of the first rank that timed out
/// waiting for it (or instead of no rank at all, when mpirun named none).
/// A missing rank on another machine is placed by `coord`; a machine lost
/// stays the cause (the stall only witnessed it).
fn blame_stall(
    group: &dyn ProcessGroup,
    coord: &dyn Coordinator,
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
    let Some(&(missing, _)) = stall.furthest_behind() else {
        return;
    };
    let ranks = group.ranks(attempt);
    let here = |rank: usize, exit: Exit| {
        ranks
            .contains(&rank)
            .then(|| group.rank_failure(attempt, rank - ranks.start, exit, &[]))
    };
    let local = here(missing, Exit::Code { code: 1 }).map(|f| (f.local_rank, f.machine, f.host));
    let place = local.clone().or_else(|| coord.place(missing));
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
            // The missing rank runs where this launcher cannot place it:
            // keep the victim, and say who it waited for.
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
        if group.kind() == "workers" && local.is_some() {
            f.pid = workers.iter().find(|w| w.rank == f.rank).map(|w| w.pid);
        }
        f
    });
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

/// The root-cause block's line for the flight-recorder dumps the attempt
/// wrote (`None`: it wrote none).
fn dumps_line(dir: &Path, since: SystemTime) -> Option<String> {
    let n = running::dumps_since(dir, since).len();
    (n > 0).then(|| {
        format!(
            "dumps:     {n} flight-recorder dump(s) in {} (read them: accel trace {0})",
            dir.display()
        )
    })
}

/// Print the root-cause block of a failed attempt, or say that the group
/// could not name a rank, then the group's own explanation. `dumps`: the
/// block's line for the attempt's flight-recorder dumps.
fn print_failure(group: &dyn ProcessGroup, n: u32, s: &Settled, dumps: Option<String>) {
    let mut lines = match &s.root {
        Some(f) => f.block(n),
        None => vec![
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
        ],
    };
    if let Some(d) = dumps {
        // Before the closing bar.
        lines.insert(lines.len() - 1, d);
    }
    say_block(&lines);
    let said: Vec<String> = group
        .explain()
        .iter()
        .map(|l| crate::output::tags::untag(l))
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
            let since = SystemTime::now();
            let mut attempt = coord.begin(n, &tx)?;
            let dump_dir = dump_dir(&mut attempt);
            if let Some(path) = &sup.record {
                let rec = LauncherRecord {
                    format: running::RECORD_FORMAT.into(),
                    pid: std::process::id(),
                    run_id: attempt.env.run_id.clone().unwrap_or_default(),
                    attempt: n,
                    dump_dir: dump_dir.clone(),
                    ranks: group.ranks(&attempt).len(),
                    group: group.kind().into(),
                    since_s: running::now_s(),
                };
                if let Err(e) = rec.write(path) {
                    tracing::warn!("accel dump will not find this run: {e}");
                }
            }
            let result = {
                let c: &dyn Coordinator = coord;
                let mut publish = |f: &Failure| c.publish(n, f);
                run_attempt(group, &attempt, sup, (&tx, &rx), t0, &mut publish)?
            };
            let mut settled = coord.settle(n, &attempt, result.outcome);
            if let Some(stall) = coord.stall(&attempt) {
                blame_stall(
                    &*group,
                    &*coord,
                    &attempt,
                    &mut settled,
                    &stall,
                    &result.workers,
                );
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
                print_failure(&*group, n, &settled, dumps_line(&dump_dir, since));
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

/// Where the attempt's ranks dump their flight recorders: the attempt's
/// `ACCEL_DUMP_DIR` (`accel launch --dump-dir`), else the run's default,
/// now written into the attempt's environment.
fn dump_dir(attempt: &mut Attempt) -> PathBuf {
    let run_id = attempt
        .env
        .run_id
        .clone()
        .unwrap_or_else(|| "default".into());
    attempt
        .env
        .dump_dir
        .get_or_insert_with(|| accel_api::worker::default_dump_dir(&run_id))
        .clone()
}

fn group_world(group: &dyn ProcessGroup, attempt: Option<&Attempt>) -> usize {
    attempt.map_or(0, |a| group.ranks(a).len())
}
