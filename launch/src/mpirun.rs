//! The mpirun command line `accel launch --backend mpi` delegates to, and
//! what mpirun says back (rank-tagged lines, its report of the failed rank).
//!
//! It formats a command line and reads text: it links no MPI library, so
//! launching MPI jobs needs neither `mpi-sys` nor libclang.
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

use crate::report::Exit;

use crate::output::tags::untag;

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
    /// Prefix every output line with its rank (read back by
    /// [`crate::output::tags::parse_tagged_line`]).
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

/// `true` when the MPI launcher (`ACCEL_MPIRUN`, else `mpirun`) answers
/// `--version`.
pub fn available() -> bool {
    Command::new(MpirunSpec::new(1, "x").launcher)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
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
    // Each family's spelling of the same flags.
    let (hostfile_flag, host_flag, tag_flag) = match flavor {
        MpiFlavor::OpenMpi => ("--hostfile", "--host", "--tag-output"),
        MpiFlavor::Mpich => ("-f", "-hosts", "-prepend-rank"),
    };
    if flavor == MpiFlavor::OpenMpi {
        if spec
            .as_root
            .unwrap_or_else(|| nix::unistd::geteuid().is_root())
        {
            cmd.arg("--allow-run-as-root");
        }
        if spec.oversubscribed() {
            cmd.arg("--oversubscribe")
                .args(["--mca", "mpi_yield_when_idle", "1"]);
        }
    }
    if let Some(f) = &spec.hostfile {
        cmd.arg(hostfile_flag).arg(f);
    } else if !hosts.is_empty() {
        cmd.arg(host_flag).arg(&hosts);
    }
    if spec.tag_output {
        cmd.arg(tag_flag);
    }
    for (k, v) in &spec.env {
        match flavor {
            MpiFlavor::OpenMpi => cmd.arg("-x").arg(format!("{k}={v}")),
            MpiFlavor::Mpich => cmd.arg("-genv").arg(k).arg(v),
        };
    }
    cmd.args(&spec.extra_args);
    cmd.arg(&spec.program).args(&spec.args);
    cmd
}

/// Who failed, as mpirun reported it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Culprit {
    /// The first failed rank mpirun names.
    pub rank: Option<usize>,
    /// Its host.
    pub host: Option<String>,
    /// Its pid (Open MPI 4 may say `PID 0`: then `None`).
    pub pid: Option<u32>,
    /// How it ended.
    pub exit: Option<Exit>,
}

fn number_after(line: &str, marker: &str) -> Option<i64> {
    let (_, rest) = line.split_once(marker)?;
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '-')
        .collect();
    digits.parse().ok()
}

fn word_after(line: &str, marker: &str) -> Option<String> {
    let (_, rest) = line.split_once(marker)?;
    rest.split_whitespace()
        .next()
        .map(|w| w.trim_end_matches(['.', ',']).to_string())
}

/// Read mpirun's report of the first failed rank from its own lines
/// (Open MPI 4/5 and MPICH hydra wordings). The first rank named wins.
pub fn culprit(lines: &[String]) -> Culprit {
    let mut c = Culprit::default();
    for line in lines {
        let l = untag(line).trim().trim_start_matches('=').trim();
        if c.rank.is_none() {
            // Open MPI: `Process name: [[15498,1],1]` (5: `[prterun-h-1@1,1]`).
            if let Some((_, rest)) = l.split_once("Process name:") {
                c.rank = rest
                    .trim()
                    .trim_end_matches(']')
                    .rsplit(',')
                    .next()
                    .and_then(|r| r.trim().parse().ok());
            } else if l.contains("process rank") {
                // `mpirun noticed that process rank 1 with PID 77 on node vm exited on signal 11 (...)`
                c.rank = number_after(l, "process rank").and_then(|r| usize::try_from(r).ok());
                c.pid = number_after(l, "with PID")
                    .and_then(|p| u32::try_from(p).ok())
                    .filter(|&p| p > 0);
                c.host = word_after(l, "on node");
                if let Some(sig) = number_after(l, "exited on signal") {
                    c.exit = i32::try_from(sig)
                        .ok()
                        .map(|signal| Exit::Signal { signal });
                }
            } else if l.contains("MPI_ABORT was invoked on rank") {
                c.rank = number_after(l, "MPI_ABORT was invoked on rank")
                    .and_then(|r| usize::try_from(r).ok());
            } else if l.starts_with("RANK ") && l.contains("PID") {
                // hydra: `RANK 1 PID 1234 RUNNING AT host`
                c.rank = number_after(l, "RANK").and_then(|r| usize::try_from(r).ok());
                c.pid = number_after(l, "PID")
                    .and_then(|p| u32::try_from(p).ok())
                    .filter(|&p| p > 0);
                c.host = word_after(l, "RUNNING AT");
            }
        }
        if c.exit.is_none() {
            if let Some(code) = number_after(l, "Exit code:")
                .or_else(|| number_after(l, "with errorcode"))
                .or_else(|| number_after(l, "EXIT CODE:"))
            {
                c.exit = i32::try_from(code).ok().map(|code| Exit::Code { code });
            } else if let Some(sig) = number_after(l, "KILLED BY SIGNAL:") {
                c.exit = i32::try_from(sig)
                    .ok()
                    .map(|signal| Exit::Signal { signal });
            }
        }
    }
    c
}

/// The machines mpirun runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hosts {
    /// This machine only.
    Local,
    /// `host:slots` each.
    List(Vec<(String, usize)>),
    /// A hostfile in the launcher's format, `nproc` ranks per machine.
    File(PathBuf),
}

impl Hosts {
    /// `(machine, local rank)` of `rank` under by-slot mapping (Open MPI's
    /// default): the machines' slots are filled in order.
    pub fn place(&self, nproc: usize, rank: usize) -> (usize, usize) {
        match self {
            Hosts::Local => (0, rank),
            Hosts::List(v) => {
                let mut first = 0;
                for (m, (_, slots)) in v.iter().enumerate() {
                    if rank < first + slots {
                        return (m, rank - first);
                    }
                    first += slots;
                }
                (v.len().saturating_sub(1), rank.saturating_sub(first))
            }
            Hosts::File(_) => (rank / nproc.max(1), rank % nproc.max(1)),
        }
    }
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

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn open_mpi_exit_code_report() {
        let c = culprit(&lines(
            "--------------------------------------------------------------------------\n\
             Primary job  terminated normally, but 1 process returned\n\
             a non-zero exit code. Per user-direction, the job has been aborted.\n\
             mpirun detected that one or more processes exited with non-zero status, thus causing\n\
             the job to be terminated. The first process to do so was:\n\
             \n  Process name: [[15498,1],1]\n  Exit code:    3\n",
        ));
        assert_eq!(c.rank, Some(1));
        assert_eq!(c.exit, Some(Exit::Code { code: 3 }));
    }

    #[test]
    fn open_mpi_signal_and_abort_reports() {
        let c = culprit(&lines(
            "mpirun noticed that process rank 2 with PID 4711 on node vm exited on signal 11 (Segmentation fault).",
        ));
        assert_eq!(
            c,
            Culprit {
                rank: Some(2),
                host: Some("vm".into()),
                pid: Some(4711),
                exit: Some(Exit::Signal { signal: 11 }),
            }
        );
        // A rank's MPI_Abort message arrives tagged with the rank's stream.
        let c = culprit(&lines(
            "[1,1]<stderr>:MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\n[1,1]<stderr>:with errorcode 124.",
        ));
        assert_eq!(c.rank, Some(1));
        assert_eq!(c.exit, Some(Exit::Code { code: 124 }));
        // Open MPI 5 names processes differently.
        let c = culprit(&lines(
            "  Process name: [prterun-vm-123@1,3]\n  Exit code:    9",
        ));
        assert_eq!(c.rank, Some(3));
        // Open MPI 4 says `PID 0` when it does not know.
        let c = culprit(&lines(
            "process rank 1 with PID 0 on node vm exited on signal 9 (Killed).",
        ));
        assert_eq!(c.pid, None);
    }

    #[test]
    fn hydra_report() {
        let c = culprit(&lines(
            "===================================================================================\n\
             =   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n\
             =   RANK 1 PID 1234 RUNNING AT node7\n\
             =   KILLED BY SIGNAL: 9 (Killed)\n",
        ));
        assert_eq!(c.rank, Some(1));
        assert_eq!(c.host.as_deref(), Some("node7"));
        assert_eq!(c.exit, Some(Exit::Signal { signal: 9 }));
        assert_eq!(culprit(&lines("nothing to see")), Culprit::default());
    }

    #[test]
    fn by_slot_placement() {
        let h = Hosts::List(vec![("a".into(), 2), ("b".into(), 4)]);
        assert_eq!(h.place(2, 4), (1, 2));
        assert_eq!(Hosts::Local.place(2, 3), (0, 3));
        assert_eq!(Hosts::File("/h".into()).place(2, 3), (1, 1));
    }
}
