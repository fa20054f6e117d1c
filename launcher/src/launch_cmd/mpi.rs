//! The MPI launch path: with `--backend mpi`, `accel launch` delegates to the
//! system's `mpirun` / `mpiexec` instead of spawning workers itself, because
//! MPI ranks must be started by MPI's own launcher. With no backend named,
//! programs that link MPI take this path too ([`super::default_backend`]).
//!
//! # What it does
//!
//! * Builds the command with the launch library's
//!   [`mpirun_command`](accel_launch::mpirun::mpirun_command): `-n` = all
//!   processes of the run, `--allow-run-as-root` only when running as root,
//!   `--oversubscribe` past the cores, rank-tagged output (`--tag-output` /
//!   `-prepend-rank`). `ACCEL_MPIRUN` picks another launcher (e.g. MPICH's
//!   `mpiexec.hydra`).
//! * Hosts the store as usual (so programs can use it, e.g. for the
//!   runtime's debug mode) and hands the ranks `ACCEL_STORE_URL`,
//!   `ACCEL_RUN_TOKEN`, `ACCEL_RUN_ID`, `ACCEL_BACKEND`, `ACCEL_TIMEOUT`,
//!   `ACCEL_DEBUG`, `ACCEL_RESTART_COUNT`, `ACCEL_ERROR_FILE`, `MASTER_ADDR`
//!   and `MASTER_PORT`. Ranks, sizes and local ranks come from MPI
//!   (`OMPI_COMM_WORLD_*`, `PMI_*`): the launcher's `RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` and `ACCEL_LAUNCHER`
//!   are removed from mpirun's environment. The variables travel in the
//!   environment, never on mpirun's command line (the token would show in
//!   `ps`): local ranks inherit it, and on several machines Open MPI gets
//!   `-x NAME` per variable (hydra forwards the whole environment).
//! * Output: each tagged piece goes to its rank's `[rank N] ` prefix (Open
//!   MPI tags each write, so partial lines of several ranks can share one
//!   line of mpirun's output; they are split and joined per rank), with
//!   the rank filter and `--tee` files of the local path; mpirun's own
//!   (untagged) lines pass through as `[mpirun] ...` on stderr, and the last
//!   of them are kept for the root-cause block, whose rank, host, exit code
//!   or signal come from mpirun's report ("Process name: [[j,1],R] / Exit
//!   code", "process rank R ... exited on signal S", `MPI_ABORT was invoked
//!   on rank R`, hydra's "RANK R ... EXIT CODE").
//! * The exit code is mpirun's. Ctrl-C / SIGTERM / SIGHUP are forwarded to
//!   mpirun as SIGTERM (mpirun then stops its ranks); SIGKILL to mpirun's
//!   process group follows after `--grace-period`, or at once on a second
//!   signal. `--max-restarts` reruns the whole mpirun command with
//!   `ACCEL_RESTART_COUNT`; `--hang-timeout` watches each rank's output as
//!   on the local path.
//!
//! # Several machines
//!
//! Only machine 0 launches: its mpirun starts the ranks of every machine
//! (over ssh, or through the resource manager's allocation). It needs the
//! machines: `--mpi-hosts a,b` (each gets `-n` slots; `a:4` sets them) or
//! `--hostfile FILE` in the launcher's format. The launcher of any other
//! machine rank refuses to start (exit code 2) with a message saying so:
//! run `accel launch --backend mpi` on machine 0 only. Ranks are numbered by
//! slot (machine `r / -n`), which is Open MPI's default mapping.
//!
//! Launching needs no MPI library in the launcher: the command builder and
//! the readers of mpirun's output format and parse text. The launcher's
//! `mpi` cargo feature only puts the mpi *backend* into the `accel` binary
//! itself (its bench and probe workers, `accel env`).
//!
//! The supervision (output, restarts, hangs, signals, `--json`) is the
//! launch library's, shared with the local path: this module only decides
//! where mpirun runs the ranks.

use std::path::{Path, PathBuf};

use accel_api::{Error, ErrorKind, Result};
use accel_launch::mpirun::{detect_flavor, Hosts};
use accel_launch::{store, HostedStore, MpirunGroup};

use super::args::{finish, resolve_program, LaunchArgs};
use super::default_backend::Choice;
use super::settings::Settings;
use super::shared::{base_env, scratch_dir, supervision, with_progress_posts};

/// `true` when the settings ask for the MPI launch path: `mpi` is the first
/// backend of `--backend` / `ACCEL_BACKEND` / the config file.
pub fn requested(s: &Settings) -> bool {
    s.backend
        .as_ref()
        .and_then(|b| b.first())
        .is_some_and(|b| b == "mpi")
}

fn config_error(msg: impl Into<String>, fix: impl Into<String>) -> Error {
    Error::new(ErrorKind::InvalidConfig, msg.into())
        .with_op("accel launch --backend mpi")
        .with_fix(fix.into())
}

/// A host list that names no machine (`--mpi-hosts ""`) is refused rather
/// than read as "this machine only".
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] naming `--mpi-hosts`.
pub fn check_host_list(list: Option<&str>) -> Result<()> {
    match list {
        Some(l) if l.split(',').all(|h| h.trim().is_empty()) => {
            Err(
                Error::invalid_config("--mpi-hosts", l, "the host list names no machine").with_fix(
                    "name the machines (--mpi-hosts HOST0,HOST1,...), or leave the flag (and \
             ACCEL_MPI_HOSTS) out to run on this machine",
                ),
            )
        }
        _ => Ok(()),
    }
}

/// Decide where mpirun runs the ranks, checking the machine flags.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`]: a machine rank above 0, both a host list
/// and a hostfile, a host list of the wrong length, several machines
/// without either.
pub fn hosts(s: &Settings, list: Option<&str>, file: Option<&Path>) -> Result<Hosts> {
    if s.machine_rank > 0 {
        return Err(config_error(
            format!(
                "under --backend mpi only machine 0 launches: its mpirun starts the ranks of \
                 all {} machines, so the launcher of machine {} has nothing to start",
                s.num_machines, s.machine_rank
            ),
            "run `accel launch --backend mpi` on machine 0 only, with the machines in \
             --mpi-hosts or --hostfile (and ssh from machine 0 to each)",
        ));
    }
    match (list.filter(|l| !l.trim().is_empty()), file) {
        (Some(_), Some(_)) => Err(config_error(
            "--mpi-hosts and --hostfile both name the machines",
            "pass one of them",
        )),
        (None, Some(f)) => Ok(Hosts::File(f.to_path_buf())),
        (Some(l), None) => {
            let mut v = Vec::new();
            for item in l.split(',').map(str::trim).filter(|x| !x.is_empty()) {
                let (h, slots) = match item.rsplit_once(':') {
                    Some((h, n)) if !h.ends_with(':') && !h.is_empty() => {
                        let n = accel_api::worker::parse_number::<usize>("--mpi-hosts", n)
                            .ok()
                            .filter(|&n| n > 0)
                            .ok_or_else(|| {
                                Error::invalid_config(
                                    "--mpi-hosts",
                                    item,
                                    "the slots after `:` must be a number of at least 1",
                                )
                            })?;
                        (h, n)
                    }
                    _ => (item, s.nproc),
                };
                v.push((h.to_string(), slots));
            }
            if v.len() != s.num_machines {
                return Err(config_error(
                    format!(
                        "--mpi-hosts names {} machine(s) but --num-machines is {}",
                        v.len(),
                        s.num_machines
                    ),
                    "name one host per machine in --mpi-hosts, and pass their number to \
                     --num-machines (with --main-process-ip and a token, since the ranks of \
                     other machines reach the store over the network)",
                ));
            }
            Ok(Hosts::List(v))
        }
        (None, None) if s.multi_machine() => Err(config_error(
            format!(
                "a run over {} machines under --backend mpi needs the machines: machine 0's \
                 mpirun starts every rank",
                s.num_machines
            ),
            "pass --mpi-hosts HOST0,HOST1,... (or --hostfile FILE in your mpirun's format)",
        )),
        (None, None) => Ok(Hosts::Local),
    }
}

/// The launcher program: `ACCEL_MPIRUN`, else `mpirun`, checked before
/// anything starts; `Err(code)` after saying why.
fn find_launcher() -> std::result::Result<PathBuf, u8> {
    let from_env = std::env::var_os("ACCEL_MPIRUN").is_some_and(|v| !v.is_empty());
    super::default_backend::find_mpirun().map_err(|e| {
        let hint = if from_env {
            "ACCEL_MPIRUN names it; point it at your mpirun / mpiexec"
        } else {
            "install Open MPI (`make setup`, or `apt-get install openmpi-bin`) or MPICH, \
             or point ACCEL_MPIRUN at your mpirun / mpiexec"
        };
        eprintln!(
            "accel: error: --backend mpi needs the system's MPI launcher: {e}\n  fix: {hint}"
        );
        e.exit_code()
    })
}

/// Launch the command of `args` through mpirun / mpiexec (see the module
/// docs), supervised like a group of local workers. `default` is the
/// default-engine choice that picked mpi (it found the launcher already),
/// `None` under `--backend mpi`.
///
/// # Errors
/// Configuration errors (exit code 2: a machine rank above 0, several
/// machines without a host list) and failures to host the store or start
/// mpirun; a failed run is an exit code, not an error.
pub fn launch(s: &Settings, args: &LaunchArgs, default: Option<&Choice>) -> Result<u8> {
    let hosts = hosts(s, args.mpi_hosts.as_deref(), args.hostfile.as_deref())?;
    let program = match resolve_program(args) {
        Ok(p) => p,
        Err(code) => return Ok(code),
    };
    let found = default.and_then(|c| Some((c.mpirun.clone()?, c.flavor?)));
    let (launcher, flavor) = match found {
        Some(f) => f,
        None => match find_launcher() {
            Ok(p) => {
                let f = detect_flavor(&p);
                (p, f)
            }
            Err(code) => return Ok(code),
        },
    };
    let total = match &hosts {
        Hosts::List(v) => v.iter().map(|(_, n)| *n).sum::<usize>(),
        _ => s.nproc * s.num_machines,
    };
    s.check_rank_filter(total)?;
    let token = match &s.token {
        Some(t) => t.clone(),
        None => store::random_hex(16)?,
    };
    let run_id = match &s.run_id {
        Some(id) => id.clone(),
        None => store::random_hex(6)?,
    };
    let mut group = MpirunGroup::new(program, launcher, flavor, total);
    group.hosts = hosts;
    group.nproc = s.nproc;
    group.die_with_parent = true;
    group.extra_env = s.extra_env.clone();
    // A single-threaded parent for mpirun, so that a SIGKILLed launcher
    // leaves no rank behind (accel_launch::guard).
    if let Ok(me) = std::env::current_exe() {
        group.guard = Some((me, vec!["mpirun-guard".into(), "--".into()]));
    }
    let mut base = base_env(s, &run_id);
    base.world_size = Some(total);
    // Several machines: one store for the whole run, at the address and
    // port every machine was told; one machine: a fresh one per attempt.
    let mut coord = HostedStore::new(&s.main_addr, s.main_port, s.multi_machine(), &token, base);
    coord.max_restarts = s.max_restarts;
    let scratch = scratch_dir()?;
    coord.scratch = scratch.clone();
    let label = format!("run {run_id} (mpirun, {total} ranks)");
    let sup = supervision(s, args, &scratch)?;
    let out = with_progress_posts(&sup, || {
        accel_launch::run(&mut group, &mut coord, &sup, &label)
    })?;
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(finish(args, &out?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(machines: usize, machine_rank: usize) -> Settings {
        let mut o = super::super::options::Options {
            num_processes: Some(2),
            num_machines: Some(machines.into()),
            machine_rank: Some(machine_rank),
            ..Default::default()
        };
        if machines > 1 {
            o.main_process_ip = Some("10.0.0.1".into());
            o.token = Some("t".into());
        }
        Settings::resolve(o).unwrap()
    }

    #[test]
    fn hosts_follow_the_machine_flags() {
        assert_eq!(hosts(&settings(1, 0), None, None).unwrap(), Hosts::Local);
        let e = hosts(&settings(2, 1), Some("a,b"), None).unwrap_err();
        assert!(e.to_string().contains("only machine 0 launches"), "{e}");
        let e = hosts(&settings(2, 0), None, None).unwrap_err();
        assert!(e.to_string().contains("needs the machines"), "{e}");
        assert_eq!(
            hosts(&settings(2, 0), Some("a, b:4"), None).unwrap(),
            Hosts::List(vec![("a".into(), 2), ("b".into(), 4)])
        );
        let e = hosts(&settings(2, 0), Some("a"), None).unwrap_err();
        assert!(e.to_string().contains("names 1 machine(s)"), "{e}");
        let e = hosts(&settings(2, 0), Some("a:0,b"), None).unwrap_err();
        assert!(e.to_string().contains("--mpi-hosts"), "{e}");
        let e = hosts(&settings(2, 0), Some("a:+2,b"), None).unwrap_err();
        assert!(e.to_string().contains("--mpi-hosts"), "{e}");
        assert_eq!(
            hosts(&settings(2, 0), None, Some(Path::new("/h"))).unwrap(),
            Hosts::File("/h".into())
        );
    }
}
