//! The MPI launch path: with `--backend mpi`, `accel launch` delegates to the
//! system's `mpirun` / `mpiexec` instead of spawning workers itself, because
//! MPI ranks must be started by MPI's own launcher.
//!
//! # What it does
//!
//! * Builds the command with the mpi backend's
//!   [`mpirun_command`](accel_backend_mpi::mpirun_command): `-n` = all
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
//! * Output: each tagged line goes to its rank's `[rank N] ` prefix, with
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
//! Without the `mpi` cargo feature (a default feature of the launcher),
//! `--backend mpi` is an `Unsupported` error saying to rebuild with it.

use std::process::ExitCode;

use accel_api::Result;

use super::options::Settings;
use super::LaunchArgs;

/// `true` when the settings ask for the MPI launch path: `mpi` is the first
/// backend of `--backend` / `ACCEL_BACKEND` / the config file.
pub fn requested(s: &Settings) -> bool {
    s.backend
        .as_ref()
        .and_then(|b| b.first())
        .is_some_and(|b| b == "mpi")
}

/// Launch the command of `args` through mpirun / mpiexec.
///
/// # Errors
/// [`accel_api::ErrorKind::Unsupported`]: this `accel` was built without
/// the `mpi` feature.
#[cfg(not(feature = "mpi"))]
pub fn launch(s: &Settings, args: &LaunchArgs) -> Result<ExitCode> {
    use accel_api::{Error, ErrorKind};
    let program = args
        .command
        .first()
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_default();
    Err(Error::new(
        ErrorKind::Unsupported,
        "this accel was built without the `mpi` feature, so `accel launch --backend mpi` \
         (which delegates to mpirun/mpiexec) is not available",
    )
    .with_op("accel launch")
    .with_fix(format!(
        "rebuild the launcher with `--features mpi` (e.g. `cargo install --path launcher \
         --features mpi`; needs libopenmpi-dev openmpi-bin libclang-dev), start the ranks with \
         `mpirun -n {} {program} ...` directly, or choose another backend (e.g. --backend cpu-gloo)",
        s.nproc * s.num_machines
    )))
}

/// Launch the command of `args` through mpirun / mpiexec (see the module
/// docs), supervising it like a group of local workers.
///
/// # Errors
/// Configuration errors (exit code 2: a machine rank above 0, several
/// machines without a host list) and failures to host the store or start
/// mpirun; a failed run is an exit code, not an error.
#[cfg(feature = "mpi")]
pub fn launch(s: &Settings, args: &LaunchArgs) -> Result<ExitCode> {
    imp::launch(s, args)
}

#[cfg(feature = "mpi")]
mod imp {
    use std::collections::VecDeque;
    use std::ffi::{OsStr, OsString};
    use std::fs::{File, OpenOptions};
    use std::io::{BufRead, BufReader, Read, Write};
    use std::os::unix::process::CommandExt;
    use std::path::{Path, PathBuf};
    use std::process::{Child, ExitCode, ExitStatus, Stdio};
    use std::sync::atomic::Ordering;
    use std::sync::mpsc::{channel, RecvTimeoutError};
    use std::sync::{Arc, Mutex};
    use std::thread::JoinHandle;
    use std::time::{Duration, Instant};

    use accel_api::{Error, ErrorKind, Result};
    use accel_backend_mpi::{
        detect_flavor, mpirun_command, parse_tagged_line, MpiFlavor, MpirunSpec,
    };
    use accel_rendezvous::TcpStoreServer;
    use nix::sys::signal::{kill, killpg, Signal};
    use nix::unistd::Pid;

    use super::super::options::{format_dur, Settings};
    use super::super::output::{print_stdout, say, say_block, RankSink, Stream};
    use super::super::report::{self, AttemptReport, Exit, Failure, Status, Summary};
    use super::super::supervise::{Event, LAST_SIGNAL};
    use super::super::{host_name, install_signals, program, store, LaunchArgs};

    /// mpirun's own lines kept for the root-cause block.
    const MPIRUN_LINES: usize = 40;
    /// A "line" longer than this is handled in pieces.
    const MAX_LINE: u64 = 64 * 1024;

    /// Variables of the launcher's own contract that must not reach MPI
    /// ranks: MPI numbers them (the runtime reads `OMPI_COMM_WORLD_*` /
    /// `PMI_*` when these are absent).
    const REMOVED: [&str; 9] = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ACCEL_LAUNCHER",
    ];

    /// The machines mpirun runs on, from `--mpi-hosts` / `--hostfile`.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(super) enum Hosts {
        /// This machine only.
        Local,
        /// `host:slots` each.
        List(Vec<(String, usize)>),
        /// A hostfile in the launcher's format.
        File(PathBuf),
    }

    fn config_error(msg: impl Into<String>, fix: impl Into<String>) -> Error {
        Error::new(ErrorKind::InvalidConfig, msg.into())
            .with_op("accel launch --backend mpi")
            .with_fix(fix.into())
    }

    /// Decide where mpirun runs the ranks, checking the machine flags.
    pub(super) fn hosts(s: &Settings, list: Option<&str>, file: Option<&Path>) -> Result<Hosts> {
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
                            let n =
                                n.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| {
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
                         --num-machines (with --main-process-ip and --token, since the ranks of \
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

    /// Who failed, as mpirun reported it.
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    pub(super) struct Culprit {
        pub rank: Option<usize>,
        pub host: Option<String>,
        pub pid: Option<u32>,
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
    pub(super) fn culprit(lines: &[String]) -> Culprit {
        let mut c = Culprit::default();
        for line in lines {
            let l = line.trim().trim_start_matches('=').trim();
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
                    c.pid = number_after(l, "PID").and_then(|p| u32::try_from(p).ok());
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

    /// The output of one mpirun: per-rank sinks and mpirun's own lines.
    struct Outputs {
        sinks: Vec<Arc<RankSink>>,
        mpirun: Mutex<VecDeque<String>>,
    }

    impl Outputs {
        fn line(&self, stream: Stream, raw: &[u8]) {
            let text = String::from_utf8_lossy(raw);
            match parse_tagged_line(&text) {
                Some((rank, body)) if rank < self.sinks.len() => {
                    self.sinks[rank].line(stream, body.as_bytes());
                }
                _ => {
                    let mut buf = String::with_capacity(text.len() + 10);
                    buf.push_str("[mpirun] ");
                    buf.push_str(&text);
                    buf.push('\n');
                    let _ = std::io::stderr().lock().write_all(buf.as_bytes());
                    let mut kept = self.mpirun.lock().unwrap_or_else(|p| p.into_inner());
                    if kept.len() == MPIRUN_LINES {
                        kept.pop_front();
                    }
                    kept.push_back(text.to_string());
                }
            }
        }

        fn mpirun_lines(&self) -> Vec<String> {
            self.mpirun
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect()
        }
    }

    fn pump(
        pipe: impl Read + Send + 'static,
        stream: Stream,
        out: Arc<Outputs>,
    ) -> std::io::Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name("accel-mpirun-out".into())
            .spawn(move || {
                let mut r = BufReader::with_capacity(64 * 1024, pipe);
                let mut line = Vec::with_capacity(256);
                loop {
                    line.clear();
                    let n = match (&mut r).take(MAX_LINE).read_until(b'\n', &mut line) {
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    };
                    if n == 0 {
                        break;
                    }
                    if line.last() == Some(&b'\n') {
                        line.pop();
                        if line.last() == Some(&b'\r') {
                            line.pop();
                        }
                    }
                    out.line(stream, &line);
                }
            })
    }

    fn open_log(dir: &Path, rank: usize, attempt: u32) -> Result<File> {
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::io(
                format!("cannot create the log directory {}", dir.display()),
                e,
            )
        })?;
        let path = dir.join(format!("rank-{rank}.log"));
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

    /// The launcher program: `ACCEL_MPIRUN`, else `mpirun`, checked before
    /// anything starts.
    fn find_launcher(spec: &MpirunSpec) -> std::result::Result<PathBuf, (u8, String)> {
        let from_env = std::env::var_os("ACCEL_MPIRUN").is_some_and(|v| !v.is_empty());
        program::resolve(
            spec.launcher.as_os_str(),
            std::env::var_os("PATH").as_deref(),
        )
        .map_err(|e| {
            let hint = if from_env {
                "ACCEL_MPIRUN names it; point it at your mpirun / mpiexec"
            } else {
                "install Open MPI (`make setup`, or `apt-get install openmpi-bin`) or MPICH, \
                     or point ACCEL_MPIRUN at your mpirun / mpiexec"
            };
            (
                e.exit_code(),
                format!("--backend mpi needs the system's MPI launcher: {e}\n  fix: {hint}"),
            )
        })
    }

    /// What one attempt needs that does not change between attempts.
    struct Fixed<'a> {
        s: &'a Settings,
        launcher: PathBuf,
        flavor: MpiFlavor,
        hosts: &'a Hosts,
        argv0: &'a OsStr,
        args: &'a [OsString],
        total: usize,
        token: &'a str,
        run_id: &'a str,
        host: &'a str,
        scratch: &'a Path,
    }

    struct Ended {
        status: Status,
        code: u8,
        /// How mpirun itself ended.
        mpirun_exit: Exit,
        root: Option<Failure>,
        mpirun_lines: Vec<String>,
        interrupted_by: Option<String>,
        killed: bool,
    }

    fn signal_mpirun(pid: u32, sig: Signal) {
        let p = Pid::from_raw(pid as i32);
        let _ = kill(p, sig);
        if sig == Signal::SIGKILL {
            // Whatever is left in mpirun's process group goes too.
            let _ = killpg(p, sig);
        }
    }

    fn attempt(
        f: &Fixed<'_>,
        attempt: u32,
        port: u16,
        rx: &std::sync::mpsc::Receiver<Event>,
        t0: Instant,
    ) -> Result<Ended> {
        let s = f.s;
        let mut spec = MpirunSpec::new(f.total, f.argv0)
            .args(f.args)
            .tag_output(true)
            .flavor(f.flavor);
        spec.launcher = f.launcher.clone();
        match f.hosts {
            Hosts::Local => {}
            Hosts::List(v) => spec = spec.hosts(v.clone()),
            Hosts::File(p) => spec = spec.hostfile(p),
        }
        let error_dir = f.scratch.join(format!("attempt-{attempt}"));
        std::fs::create_dir_all(&error_dir).map_err(|e| {
            Error::io(
                format!(
                    "cannot create the error-file directory {}",
                    error_dir.display()
                ),
                e,
            )
        })?;
        let error_file = error_dir.join("error.json");
        let master_addr = s.main_addr.trim_start_matches('[').trim_end_matches(']');
        let store_url = if master_addr.contains(':') {
            format!("tcp://[{master_addr}]:{port}")
        } else {
            format!("tcp://{master_addr}:{port}")
        };
        let vars: Vec<(&str, String)> = vec![
            ("ACCEL_STORE_URL", store_url),
            ("ACCEL_RUN_TOKEN", f.token.to_string()),
            ("ACCEL_RUN_ID", f.run_id.to_string()),
            (
                "ACCEL_BACKEND",
                s.backend
                    .as_ref()
                    .map_or_else(|| "mpi".to_string(), |b| b.join(",")),
            ),
            ("ACCEL_TIMEOUT", format_dur(s.timeout)),
            ("ACCEL_DEBUG", if s.debug { "1" } else { "0" }.into()),
            ("ACCEL_RESTART_COUNT", attempt.to_string()),
            (
                "ACCEL_ERROR_FILE",
                error_file.to_string_lossy().into_owned(),
            ),
            ("MASTER_ADDR", master_addr.to_string()),
            ("MASTER_PORT", port.to_string()),
            ("TORCHELASTIC_RUN_ID", f.run_id.to_string()),
            ("TORCHELASTIC_RESTART_COUNT", attempt.to_string()),
        ];
        if f.flavor == MpiFlavor::OpenMpi && *f.hosts != Hosts::Local {
            // Open MPI forwards only what `-x` names to other machines;
            // `-x NAME` takes the value from the environment, so the token
            // never appears on the command line.
            for (k, _) in &vars {
                spec.extra_args.push("-x".into());
                spec.extra_args.push(OsString::from(k));
            }
        }
        let mut cmd = mpirun_command(&spec);
        for v in REMOVED {
            cmd.env_remove(v);
        }
        cmd.envs(vars.iter().map(|(k, v)| (*k, v.as_str())))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(if f.total == 1 {
                Stdio::inherit()
            } else {
                Stdio::null()
            })
            // Its own process group: the terminal's Ctrl-C reaches the
            // launcher only, which forwards SIGTERM.
            .process_group(0);

        let mut sinks = Vec::with_capacity(f.total);
        for rank in 0..f.total {
            let tee = match &s.tee {
                Some(d) => Some(open_log(d, rank, attempt)?),
                None => None,
            };
            let show = s.ranks.as_ref().is_none_or(|r| r.shows(rank));
            let sink = RankSink::new(rank, show, tee, t0);
            if attempt > 0 {
                sink.tee_marker(&format!(
                    "==== accel: attempt {attempt} (ACCEL_RESTART_COUNT={attempt}) ===="
                ));
            }
            sinks.push(sink);
        }
        let out = Arc::new(Outputs {
            sinks,
            mpirun: Mutex::new(VecDeque::new()),
        });
        let mut child: Child = cmd.spawn().map_err(|e| {
            Error::io(format!("cannot start {}", f.launcher.display()), e)
                .with_op("accel launch --backend mpi")
        })?;
        for sink in &out.sinks {
            sink.touch();
        }
        let pid = child.id();
        let io = |e| Error::io("cannot start an output thread", e);
        let mut pumps = Vec::with_capacity(2);
        let started = (|| -> Result<()> {
            if let Some(o) = child.stdout.take() {
                pumps.push(pump(o, Stream::Stdout, out.clone()).map_err(io)?);
            }
            if let Some(e) = child.stderr.take() {
                pumps.push(pump(e, Stream::Stderr, out.clone()).map_err(io)?);
            }
            Ok(())
        })();
        if let Err(e) = started {
            signal_mpirun(pid, Signal::SIGKILL);
            let _ = child.wait();
            return Err(e);
        }

        let mut interrupted: Option<i32> = None;
        let mut hung: Option<Failure> = None;
        let mut kill_at: Option<Instant> = None;
        let mut killed = false;
        let tick = Duration::from_millis(20);
        let status: ExitStatus = loop {
            match rx.recv_timeout(tick) {
                Ok(Event::Signal(sig)) => {
                    if interrupted.is_some() {
                        say("second signal: killing mpirun and its ranks now");
                        signal_mpirun(pid, Signal::SIGKILL);
                        killed = true;
                    } else {
                        say(&format!(
                            "received {}, sending SIGTERM to mpirun",
                            report::signal_name(sig)
                        ));
                        interrupted = Some(sig);
                        signal_mpirun(pid, Signal::SIGTERM);
                        kill_at.get_or_insert(Instant::now() + s.grace);
                    }
                }
                Ok(_) | Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {}
            }
            match child.try_wait() {
                Ok(Some(st)) => break st,
                Ok(None) => {}
                Err(e) => {
                    signal_mpirun(pid, Signal::SIGKILL);
                    return Err(Error::io("cannot wait for mpirun", e));
                }
            }
            let now = Instant::now();
            if kill_at.is_some_and(|t| now >= t) {
                say(&format!(
                    "mpirun did not stop within {:?} of SIGTERM; sending SIGKILL",
                    s.grace
                ));
                signal_mpirun(pid, Signal::SIGKILL);
                killed = true;
                kill_at = Some(now + Duration::from_secs(1));
            }
            if let (Some(limit), None, None) = (s.hang_timeout, &hung, interrupted) {
                let mut silent: Vec<(usize, Duration)> = out
                    .sinks
                    .iter()
                    .enumerate()
                    .map(|(r, k)| (r, now.saturating_duration_since(k.last_output())))
                    .filter(|(_, d)| *d >= limit)
                    .collect();
                if !silent.is_empty() {
                    silent.sort_by(|(i, a), (j, b)| b.cmp(a).then(i.cmp(j)));
                    let (rank, d) = silent[0];
                    let mut fl = failure(
                        f,
                        rank,
                        None,
                        None,
                        Exit::Hung {
                            silent_s: d.as_secs(),
                        },
                        &out.sinks[rank],
                        &error_file,
                    );
                    fl.also_hung = silent[1..].iter().map(|(r, _)| *r).collect();
                    say(&format!("{}; stopping mpirun", fl.headline()));
                    hung = Some(fl);
                    signal_mpirun(pid, Signal::SIGTERM);
                    kill_at.get_or_insert(now + s.grace);
                }
            }
        };
        // The last lines still in the pipes (a stray rank holding them open
        // must not keep the launcher waiting).
        let deadline = Instant::now() + Duration::from_secs(2);
        while pumps.iter().any(|p| !p.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mpirun_lines = out.mpirun_lines();
        let mpirun_exit = Exit::from_status(status);
        if !mpirun_exit.is_success() {
            // Nothing of a failed job outlives it.
            let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
        if let Some(sig) = interrupted {
            return Ok(Ended {
                status: Status::Interrupted,
                code: u8::try_from(128 + sig).unwrap_or(1),
                mpirun_exit,
                root: None,
                mpirun_lines,
                interrupted_by: Some(report::signal_name(sig)),
                killed,
            });
        }
        if let Some(h) = hung {
            return Ok(Ended {
                status: Status::Failed,
                code: 124,
                mpirun_exit,
                root: Some(h),
                mpirun_lines,
                interrupted_by: None,
                killed,
            });
        }
        if mpirun_exit.is_success() {
            return Ok(Ended {
                status: Status::Succeeded,
                code: 0,
                mpirun_exit,
                root: None,
                mpirun_lines,
                interrupted_by: None,
                killed,
            });
        }
        let c = culprit(&mpirun_lines);
        let exit = c.exit.unwrap_or(mpirun_exit);
        let root = c.rank.filter(|&r| r < f.total).map(|rank| {
            failure(
                f,
                rank,
                c.host.clone(),
                c.pid,
                exit,
                &out.sinks[rank],
                &error_file,
            )
        });
        Ok(Ended {
            status: Status::Failed,
            code: mpirun_exit.launcher_code(),
            mpirun_exit,
            root,
            mpirun_lines,
            interrupted_by: None,
            killed,
        })
    }

    fn failure(
        f: &Fixed<'_>,
        rank: usize,
        host: Option<String>,
        pid: Option<u32>,
        exit: Exit,
        sink: &RankSink,
        error_file: &Path,
    ) -> Failure {
        // One error file per attempt (the ranks share the environment):
        // the first rank that panicked through accel's hook wrote it.
        let record = accel::ErrorRecord::read(error_file).ok();
        let (machine, local_rank) = place(f.hosts, f.s.nproc, rank);
        Failure {
            rank,
            local_rank,
            machine,
            host: host.unwrap_or_else(|| f.host.to_string()),
            // mpirun may not name the pid (Open MPI 4 says `PID 0`); the
            // error file does.
            pid: pid.or(record.as_ref().map(|r| r.pid)).unwrap_or(0),
            exit,
            error: record.as_ref().map(|r| r.message.clone()),
            location: record.and_then(|r| r.location),
            stderr_tail: sink.tail(),
            also_hung: Vec::new(),
            interrupted: false,
        }
    }

    /// `(machine, local rank)` of `rank` under by-slot mapping (Open MPI's
    /// default): the machines' slots are filled in order.
    pub(super) fn place(hosts: &Hosts, nproc: usize, rank: usize) -> (usize, usize) {
        match hosts {
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

    fn print_failure(e: &Ended, attempt: u32) {
        match &e.root {
            Some(f) => f.print(attempt),
            None => say_block(&[
                "==================== root cause ====================".to_string(),
                format!("attempt:   {attempt}"),
                // Open MPI says less when a rank fails while the job is still
                // starting, or when mpirun itself fails.
                "rank:      unknown (mpirun's report below does not name one)".to_string(),
                format!("exit:      mpirun {}", e.mpirun_exit.describe()),
                "====================================================".to_string(),
            ]),
        }
        // mpirun's last words, without its banner rules and blank lines.
        let said: Vec<String> = e
            .mpirun_lines
            .iter()
            .filter(|l| !l.trim().is_empty() && !l.trim_start().starts_with("-----"))
            .map(|l| format!("  | {l}"))
            .collect();
        if !said.is_empty() {
            let mut lines = vec![format!("mpirun said (last {} line(s)):", said.len())];
            lines.extend(said);
            say_block(&lines);
        }
    }

    pub(super) fn launch(s: &Settings, args: &LaunchArgs) -> Result<ExitCode> {
        let t0 = Instant::now();
        let hosts = hosts(s, args.mpi_hosts.as_deref(), args.hostfile.as_deref())?;
        let argv0 = args.command[0].clone();
        if let Err(e) = program::resolve(&argv0, std::env::var_os("PATH").as_deref()) {
            eprintln!("accel: error: {e}");
            return Ok(ExitCode::from(e.exit_code()));
        }
        let probe = MpirunSpec::new(1, &argv0);
        let launcher = match find_launcher(&probe) {
            Ok(p) => p,
            Err((code, msg)) => {
                eprintln!("accel: error: {msg}");
                return Ok(ExitCode::from(code));
            }
        };
        let flavor = detect_flavor(&launcher);
        let total = match &hosts {
            Hosts::List(v) => v.iter().map(|(_, n)| *n).sum::<usize>(),
            _ => s.nproc * s.num_machines,
        };
        let (tx, rx) = channel::<Event>();
        install_signals(tx)?;
        let token = match &s.token {
            Some(t) => t.clone(),
            None => store::random_hex(16)?,
        };
        let run_id = match &s.run_id {
            Some(id) => id.clone(),
            None => store::random_hex(6)?,
        };
        let host = host_name();
        let scratch = std::env::temp_dir().join(format!(
            "accel-{}-{}",
            std::process::id(),
            store::random_hex(4)?
        ));
        // Several machines: one store for the whole run, at the address and
        // port every machine was told.
        let run_server: Option<TcpStoreServer> = if s.multi_machine() {
            Some(store::host(&s.main_addr, s.main_port, true, &token)?.0)
        } else {
            None
        };
        let fixed = Fixed {
            s,
            launcher,
            flavor,
            hosts: &hosts,
            argv0: &argv0,
            args: &args.command[1..],
            total,
            token: &token,
            run_id: &run_id,
            host: &host,
            scratch: &scratch,
        };

        let mut reports: Vec<AttemptReport> = Vec::new();
        let mut store_url = String::new();
        let mut n: u32 = 0;
        let code: u8 = loop {
            let sig = LAST_SIGNAL.load(Ordering::SeqCst);
            if sig != 0 {
                break u8::try_from(128 + sig).unwrap_or(1);
            }
            let a0 = Instant::now();
            // One machine: a fresh store per attempt, as on the local path.
            let mut attempt_server: Option<TcpStoreServer> = None;
            let port = match &run_server {
                Some(srv) => srv.local_addr().port(),
                None => {
                    let (srv, notice) = store::host(&s.main_addr, s.main_port, false, &token)?;
                    if let Some(msg) = notice.filter(|_| n == 0) {
                        say(&msg);
                    }
                    let p = srv.local_addr().port();
                    attempt_server = Some(srv);
                    p
                }
            };
            store_url = format!("tcp://{}:{port}", s.main_addr);
            let ended = attempt(&fixed, n, port, &rx, t0)?;
            drop(attempt_server);
            let report = AttemptReport {
                attempt: n,
                status: ended.status.clone(),
                duration_s: a0.elapsed().as_secs_f64(),
                root_cause: ended.root.clone(),
                workers: Vec::new(),
                killed: if ended.killed {
                    (0..total).collect()
                } else {
                    Vec::new()
                },
                interrupted_by: ended.interrupted_by.clone(),
            };
            reports.push(report);
            match ended.status {
                Status::Succeeded => break 0,
                Status::Interrupted => break ended.code,
                Status::Failed => {
                    print_failure(&ended, n);
                    if n < s.max_restarts && LAST_SIGNAL.load(Ordering::SeqCst) == 0 {
                        n += 1;
                        say(&format!(
                            "restarting mpirun: restart {n} of {} (ACCEL_RESTART_COUNT={n})",
                            s.max_restarts
                        ));
                        continue;
                    }
                    break ended.code;
                }
            }
        };
        if let Some(srv) = &run_server {
            srv.shutdown();
        }
        let _ = std::fs::remove_dir_all(&scratch);

        if reports.len() > 1 || code != 0 {
            let mut lines = vec![format!(
                "run {run_id} (mpirun, {total} ranks): {} attempt(s), exit code {code}",
                reports.len()
            )];
            lines.extend(reports.iter().map(|r| format!("  {}", r.line())));
            say_block(&lines);
        }
        if args.json {
            let summary = Summary {
                run_id,
                machine_rank: s.machine_rank,
                num_machines: s.num_machines,
                world_size: total,
                store: store_url,
                exit_code: code,
                attempts: reports,
                wall_s: t0.elapsed().as_secs_f64(),
            };
            print_stdout(&serde_json::to_string(&summary).unwrap_or_default());
        }
        Ok(ExitCode::from(code))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

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
            let c = culprit(&lines(
                "MPI_ABORT was invoked on rank 1 in communicator MPI_COMM_WORLD\nwith errorcode 124.",
            ));
            assert_eq!(c.rank, Some(1));
            assert_eq!(c.exit, Some(Exit::Code { code: 124 }));
            // Open MPI 5 names processes differently.
            let c = culprit(&lines(
                "  Process name: [prterun-vm-123@1,3]\n  Exit code:    9",
            ));
            assert_eq!(c.rank, Some(3));
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

        fn settings(machines: usize, machine_rank: usize) -> Settings {
            let mut o = super::super::super::options::Options {
                num_processes: Some(2),
                num_machines: Some(machines),
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
            assert_eq!(
                place(&Hosts::List(vec![("a".into(), 2), ("b".into(), 4)]), 2, 4),
                (1, 2)
            );
            assert_eq!(place(&Hosts::Local, 2, 3), (0, 3));
            let e = hosts(&settings(2, 0), Some("a:0,b"), None).unwrap_err();
            assert!(e.to_string().contains("--mpi-hosts"), "{e}");
            assert_eq!(
                hosts(&settings(2, 0), None, Some(Path::new("/h"))).unwrap(),
                Hosts::File("/h".into())
            );
        }
    }
}
