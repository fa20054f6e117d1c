//! `accel dump [RUN | --pid PID]`: ask a running `accel launch` on this
//! machine to make every rank dump its flight recorder. The launcher keeps
//! a record of itself in its scratch folder
//! ([`accel_launch::running::LauncherRecord`], `<temp>/accel-*/launcher.json`):
//! this command finds it, sends the launcher SIGUSR1 (which it passes on
//! to its ranks, through mpirun under `--backend mpi`), says where the
//! dumps go and waits for them.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime};

use accel_api::{Error, Result};
use accel_launch::running::{dump_pid, dumps_since, LauncherRecord, RECORD_FILE};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::launch_cmd::options::parse_dur;

/// Arguments of `accel dump`.
#[derive(Debug, clap::Args)]
pub struct DumpArgs {
    /// The run (its ACCEL_RUN_ID, `accel launch --run-id`) [default: the
    /// only `accel launch` running on this machine].
    #[arg(value_name = "RUN", conflicts_with = "pid")]
    run: Option<String>,
    /// The `accel launch` process to ask.
    #[arg(long, value_name = "PID")]
    pid: Option<u32>,
    /// How long to wait for the dumps (0: do not wait).
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = parse_dur)]
    wait: Duration,
}

/// Every live launcher's record on this machine, with its file.
fn records() -> Vec<(PathBuf, LauncherRecord)> {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return Vec::new();
    };
    let mut v: Vec<(PathBuf, LauncherRecord)> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("accel-"))
        .map(|e| e.path().join(RECORD_FILE))
        .filter_map(|p| LauncherRecord::read(&p).ok().map(|r| (p, r)))
        // A launcher that was SIGKILLed leaves its record: skip the dead.
        .filter(|(_, r)| kill(Pid::from_raw(r.pid as i32), None).is_ok())
        .collect();
    v.sort_by_key(|(_, r)| r.pid);
    v
}

fn describe(r: &LauncherRecord) -> String {
    format!(
        "pid {}, run {}, attempt {}, {} rank(s) ({})",
        r.pid, r.run_id, r.attempt, r.ranks, r.group
    )
}

/// The launcher `a` names.
fn choose(a: &DumpArgs) -> Result<LauncherRecord> {
    let all = records();
    let fix = "start the job with `accel launch` (it records itself under the temporary folder), \
               or dump one process with `kill -USR1 PID`";
    let mut matching: Vec<LauncherRecord> = all
        .into_iter()
        .map(|(_, r)| r)
        .filter(|r| a.pid.is_none_or(|p| r.pid == p))
        .filter(|r| a.run.as_ref().is_none_or(|id| &r.run_id == id))
        .collect();
    match matching.len() {
        0 => {
            let what = match (&a.run, a.pid) {
                (Some(id), _) => format!("no running accel launch of run {id} on this machine"),
                (None, Some(p)) => format!("process {p} is no running accel launch"),
                (None, None) => "no accel launch is running on this machine".to_string(),
            };
            Err(Error::invalid_argument("accel dump", what).with_fix(fix))
        }
        1 => Ok(matching.remove(0)),
        _ => {
            let list: Vec<String> = matching.iter().map(describe).collect();
            Err(Error::invalid_argument(
                "accel dump",
                format!(
                    "{} accel launch runs on this machine: {}",
                    matching.len(),
                    list.join("; ")
                ),
            )
            .with_fix("name one: accel dump RUN_ID, or accel dump --pid PID"))
        }
    }
}

/// Run `accel dump`.
///
/// # Errors
/// No launcher (or several) matches; the signal cannot be sent. Dumps that
/// do not all arrive within `--wait` are exit code 1, not an error.
pub fn run(a: DumpArgs) -> Result<ExitCode> {
    let r = choose(&a)?;
    // A second's slack: file times are coarser than the clock.
    let since = SystemTime::now() - Duration::from_secs(1);
    kill(Pid::from_raw(r.pid as i32), Signal::SIGUSR1).map_err(|e| {
        Error::io(
            format!("sending SIGUSR1 to accel launch (pid {})", r.pid),
            std::io::Error::from(e),
        )
    })?;
    eprintln!(
        "accel dump: asked accel launch ({}) to make every rank dump; dumps go to {}",
        describe(&r),
        r.dump_dir.display()
    );
    // One file per process: a process of rank threads dumps once.
    let expected = if r.group == "threads" { 1 } else { r.ranks };
    let deadline = Instant::now() + a.wait;
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut pids: BTreeSet<u32> = BTreeSet::new();
    while !a.wait.is_zero() {
        for p in dumps_since(&r.dump_dir, since) {
            if !seen.contains(&p) {
                outln!("{}", p.display());
                pids.extend(dump_pid(&p));
                seen.push(p);
            }
        }
        if pids.len() >= expected || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if a.wait.is_zero() {
        return Ok(ExitCode::SUCCESS);
    }
    if pids.len() < expected {
        eprintln!(
            "accel dump: {} of {expected} process(es) dumped after {:?} (a rank that has not reached \
             accel::Accelerator::new yet, or is stuck in the kernel, cannot dump)",
            pids.len(),
            a.wait
        );
        return Ok(ExitCode::from(1));
    }
    eprintln!(
        "accel dump: {} dump(s); read them: accel trace {}",
        seen.len(),
        r.dump_dir.display()
    );
    Ok(ExitCode::SUCCESS)
}
