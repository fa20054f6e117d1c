//! The mpirun command line `accel launch --backend mpi` delegates to.
//!
//! [`mpirun_command`] builds (does not run) the command for the system's
//! MPI launcher, with the flags each launcher family needs:
//!
//! | need | Open MPI (`mpirun`) | MPICH / Intel MPI (hydra `mpiexec`) |
//! |---|---|---|
//! | N processes | `-n N` | `-n N` |
//! | running as root | `--allow-run-as-root` (only when root) | - |
//! | N above the slots (cores, or the hosts' slots) | `--oversubscribe` and `--mca mpi_yield_when_idle 1` | - |
//! | environment | `-x NAME=VALUE` | `-genv NAME VALUE` |
//! | several machines | `--host a:2,b:2` or `--hostfile F` | `-hosts a:2,b:2` or `-f F` |
//! | rank-tagged output | `--tag-output` (`[1,R]<stdout>:line`) | `-prepend-rank` (`[R] line`) |
//!
//! Programs started this way (or directly by `mpirun -n N`, or `srun`) see
//! the launcher's variables and select the `mpi` backend by probe.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ffi;

/// The family of an MPI launcher: their flags differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiFlavor {
    /// Open MPI's `mpirun` (ORTE/PRRTE).
    OpenMpi,
    /// MPICH's hydra `mpiexec` (also Intel MPI, MVAPICH).
    Mpich,
}

/// What to launch and where. Build it with [`MpirunSpec::new`] and the
/// builder methods.
#[derive(Debug, Clone)]
pub struct MpirunSpec {
    /// The launcher program: `ACCEL_MPIRUN` when set, else `mpirun`.
    pub launcher: PathBuf,
    /// The launcher family; `None`: ask the launcher (`--version`).
    pub flavor: Option<MpiFlavor>,
    /// Number of processes (ranks).
    pub nprocs: usize,
    /// Machines and their slots (processes each may take); empty: this
    /// machine only.
    pub hosts: Vec<(String, usize)>,
    /// A hostfile in the launcher's format (used instead of `hosts`).
    pub hostfile: Option<PathBuf>,
    /// Variables every rank gets (on every machine).
    pub env: Vec<(String, String)>,
    /// Prefix every output line with its rank (see [`parse_tagged_line`]).
    pub tag_output: bool,
    /// Cores of this machine, for the oversubscription decision; `None`:
    /// `std::thread::available_parallelism()`.
    pub cores: Option<usize>,
    /// `Some(true/false)` forces `--allow-run-as-root` on or off; `None`:
    /// only when the effective user is root.
    pub as_root: Option<bool>,
    /// Extra launcher flags, placed before the program.
    pub extra_args: Vec<OsString>,
    /// The program every rank runs.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
}

impl MpirunSpec {
    /// `nprocs` copies of `program` on this machine.
    pub fn new(nprocs: usize, program: impl Into<OsString>) -> MpirunSpec {
        MpirunSpec {
            launcher: std::env::var_os("ACCEL_MPIRUN")
                .filter(|v| !v.is_empty())
                .map_or_else(|| PathBuf::from("mpirun"), PathBuf::from),
            flavor: None,
            nprocs,
            hosts: Vec::new(),
            hostfile: None,
            env: Vec::new(),
            tag_output: false,
            cores: None,
            as_root: None,
            extra_args: Vec::new(),
            program: program.into(),
            args: Vec::new(),
        }
    }

    /// Builder: the program's arguments.
    pub fn args<I, S>(mut self, args: I) -> MpirunSpec
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args = args.into_iter().map(Into::into).collect();
        self
    }

    /// Builder: give every rank `name=value`.
    pub fn env(mut self, name: impl Into<String>, value: impl Into<String>) -> MpirunSpec {
        self.env.push((name.into(), value.into()));
        self
    }

    /// Builder: run on these machines with these slots each.
    pub fn hosts(mut self, hosts: Vec<(String, usize)>) -> MpirunSpec {
        self.hosts = hosts;
        self
    }

    /// Builder: run on the machines of a hostfile.
    pub fn hostfile(mut self, path: impl Into<PathBuf>) -> MpirunSpec {
        self.hostfile = Some(path.into());
        self
    }

    /// Builder: the launcher family (skips asking the launcher).
    pub fn flavor(mut self, flavor: MpiFlavor) -> MpirunSpec {
        self.flavor = Some(flavor);
        self
    }

    /// Builder: tag output lines with the rank.
    pub fn tag_output(mut self, on: bool) -> MpirunSpec {
        self.tag_output = on;
        self
    }

    /// `true` when the processes outnumber the slots.
    pub fn oversubscribed(&self) -> bool {
        let slots = if self.hosts.is_empty() {
            self.cores.unwrap_or_else(|| {
                std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
            })
        } else {
            self.hosts.iter().map(|(_, s)| *s).sum()
        };
        self.hostfile.is_none() && self.nprocs > slots
    }
}

/// Ask `launcher --version` which family it is (Open MPI prints
/// `mpirun (Open MPI) 4.1.4`, hydra `HYDRA build details`). Anything
/// unrecognised, or a launcher that does not start, counts as Open MPI.
pub fn detect_flavor(launcher: &Path) -> MpiFlavor {
    let out = Command::new(launcher)
        .arg("--version")
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) => {
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            if text.contains("HYDRA") || text.contains("Intel(R) MPI") || text.contains("MPICH") {
                MpiFlavor::Mpich
            } else {
                MpiFlavor::OpenMpi
            }
        }
        Err(_) => MpiFlavor::OpenMpi,
    }
}

/// The command that starts `spec.nprocs` ranks of `spec.program` under the
/// system's MPI launcher. Not started: the caller sets stdio, spawns and
/// supervises it (mpirun itself ends the job when a rank dies, naming it).
pub fn mpirun_command(spec: &MpirunSpec) -> Command {
    let flavor = spec.flavor.unwrap_or_else(|| detect_flavor(&spec.launcher));
    let mut cmd = Command::new(&spec.launcher);
    cmd.arg("-n").arg(spec.nprocs.to_string());
    let hosts = spec
        .hosts
        .iter()
        .map(|(h, s)| format!("{h}:{s}"))
        .collect::<Vec<_>>()
        .join(",");
    match flavor {
        MpiFlavor::OpenMpi => {
            if spec.as_root.unwrap_or_else(ffi::running_as_root) {
                cmd.arg("--allow-run-as-root");
            }
            if spec.oversubscribed() {
                cmd.arg("--oversubscribe")
                    .args(["--mca", "mpi_yield_when_idle", "1"]);
            }
            if let Some(f) = &spec.hostfile {
                cmd.arg("--hostfile").arg(f);
            } else if !hosts.is_empty() {
                cmd.arg("--host").arg(&hosts);
            }
            if spec.tag_output {
                cmd.arg("--tag-output");
            }
            for (k, v) in &spec.env {
                cmd.arg("-x").arg(format!("{k}={v}"));
            }
        }
        MpiFlavor::Mpich => {
            if let Some(f) = &spec.hostfile {
                cmd.arg("-f").arg(f);
            } else if !hosts.is_empty() {
                cmd.arg("-hosts").arg(&hosts);
            }
            if spec.tag_output {
                cmd.arg("-prepend-rank");
            }
            for (k, v) in &spec.env {
                cmd.arg("-genv").arg(k).arg(v);
            }
        }
    }
    cmd.args(&spec.extra_args);
    cmd.arg(&spec.program).args(&spec.args);
    cmd
}

/// Split a line tagged by the launcher into `(rank, line)`: Open MPI's
/// `--tag-output` form `[1,3]<stdout>:text` and hydra's `-prepend-rank`
/// form `[3] text`. `None` for an untagged line (the launcher's own
/// messages).
pub fn parse_tagged_line(line: &str) -> Option<(usize, &str)> {
    let rest = line.strip_prefix('[')?;
    let (inside, after) = rest.split_once(']')?;
    let rank = match inside.split_once(',') {
        Some((_job, r)) => r.trim().parse().ok()?,
        None => inside.trim().parse().ok()?,
    };
    let text = match after.strip_prefix('<') {
        Some(tagged) => tagged.split_once(">:")?.1,
        None => after.strip_prefix(' ').unwrap_or(after),
    };
    Some((rank, text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn open_mpi_flags() {
        let mut spec = MpirunSpec::new(4, "/bin/worker")
            .flavor(MpiFlavor::OpenMpi)
            .env("ACCEL_TIMEOUT", "5s")
            .args(["--x", "1"]);
        spec.cores = Some(2);
        spec.as_root = Some(true);
        let a = args(&mpirun_command(&spec));
        assert_eq!(
            a,
            [
                "-n",
                "4",
                "--allow-run-as-root",
                "--oversubscribe",
                "--mca",
                "mpi_yield_when_idle",
                "1",
                "-x",
                "ACCEL_TIMEOUT=5s",
                "/bin/worker",
                "--x",
                "1"
            ]
        );
        spec.as_root = Some(false);
        spec.cores = Some(8);
        let a = args(&mpirun_command(&spec));
        assert!(!a.iter().any(|x| x == "--allow-run-as-root"), "{a:?}");
        assert!(!a.iter().any(|x| x == "--oversubscribe"), "{a:?}");
    }

    #[test]
    fn hosts_decide_slots() {
        let mut spec = MpirunSpec::new(4, "w")
            .flavor(MpiFlavor::OpenMpi)
            .hosts(vec![("a".into(), 2), ("b".into(), 2)]);
        spec.as_root = Some(false);
        let a = args(&mpirun_command(&spec));
        assert_eq!(a, ["-n", "4", "--host", "a:2,b:2", "w"]);
        let spec = spec.hostfile("/tmp/hosts");
        let a = args(&mpirun_command(&spec));
        assert_eq!(a, ["-n", "4", "--hostfile", "/tmp/hosts", "w"]);
    }

    #[test]
    fn mpich_flags() {
        let mut spec = MpirunSpec::new(3, "w")
            .flavor(MpiFlavor::Mpich)
            .env("A", "b c")
            .tag_output(true);
        spec.as_root = Some(true);
        spec.cores = Some(1);
        let a = args(&mpirun_command(&spec));
        assert_eq!(a, ["-n", "3", "-prepend-rank", "-genv", "A", "b c", "w"]);
    }

    #[test]
    fn tagged_lines() {
        assert_eq!(
            parse_tagged_line("[1,3]<stdout>:hello: world"),
            Some((3, "hello: world"))
        );
        assert_eq!(parse_tagged_line("[2] hi"), Some((2, "hi")));
        assert_eq!(parse_tagged_line("mpirun noticed"), None);
    }
}
