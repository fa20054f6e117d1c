//! The options of a launch, from flags, the environment and the config file,
//! and their resolution into [`Settings`].
//!
//! Precedence, highest first: command-line flags, the `ACCEL_*` variables
//! that have a flag (`ACCEL_RUN_TOKEN`, `ACCEL_TIMEOUT`, `ACCEL_BACKEND`,
//! `ACCEL_DEBUG`), the config file, the defaults.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use accel::train::MixedPrecision;
use accel_api::{Error, ErrorKind, Result};

/// Port of the store on a run over several machines when none is given
/// (torchrun's default).
pub const DEFAULT_MULTI_MACHINE_PORT: u16 = 29500;
/// Time between SIGTERM and SIGKILL when the launcher stops its workers.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// How long an elastic round stays open for more machines once the fewest
/// have joined (`--join-window`).
pub const DEFAULT_JOIN_WINDOW: Duration = Duration::from_secs(10);
/// Default bound for blocking calls, as in the runtime (`ACCEL_TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = accel::state::DEFAULT_TIMEOUT;

/// A comma-separated list of backend names (`--backend cpu-gloo,mpi`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backends(pub Vec<String>);

impl FromStr for Backends {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Backends, String> {
        let v: Vec<String> = s
            .split(',')
            .map(|b| b.trim().to_ascii_lowercase())
            .filter(|b| !b.is_empty())
            .collect();
        if v.is_empty() {
            return Err("name at least one backend, e.g. cpu-gloo".into());
        }
        Ok(Backends(v))
    }
}

impl fmt::Display for Backends {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

pub use accel_launch::output::{RankFilter, StdStreams};

/// `--num-machines M`, or `MIN:MAX` (torchrun's `--nnodes MIN:MAX`): an
/// elastic run (docs/adr/0026-elastic-membership.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MachineCount {
    /// The fewest machines the run goes on with.
    pub min: usize,
    /// The most machines a round takes.
    pub max: usize,
}

impl MachineCount {
    /// Exactly `n` machines.
    pub fn exact(n: usize) -> MachineCount {
        MachineCount { min: n, max: n }
    }
}

impl From<usize> for MachineCount {
    fn from(n: usize) -> MachineCount {
        MachineCount::exact(n)
    }
}

impl fmt::Display for MachineCount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.max)
        } else {
            write!(f, "{}:{}", self.min, self.max)
        }
    }
}

/// `M` or `MIN:MAX`, each at least 1, `MIN <= MAX`.
pub fn parse_machines(s: &str) -> std::result::Result<MachineCount, String> {
    match s.split_once(':') {
        None => parse_count(s).map(MachineCount::exact),
        Some((a, b)) => {
            let (min, max) = (parse_count(a)?, parse_count(b)?);
            if min > max {
                return Err(format!(
                    "MIN:MAX needs MIN <= MAX, got {min}:{max} (--nnodes 2:4 runs on 2 to 4 machines)"
                ));
            }
            Ok(MachineCount { min, max })
        }
    }
}

/// A count of at least one (`-n`, `--num-machines`); negative numbers are
/// accepted by the parser so that the message can say what is wrong.
pub fn parse_count(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if n >= 1 => Ok(n as usize),
        Ok(n) => Err(format!("must be at least 1, got {n}")),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// A machine rank: 0 or more.
pub fn parse_index(s: &str) -> std::result::Result<usize, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if n >= 0 => Ok(n as usize),
        Ok(n) => Err(format!("must be 0 or more, got {n}")),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// `no`, `bf16` or `fp16`, for clap.
pub fn parse_mixed_precision(s: &str) -> std::result::Result<MixedPrecision, String> {
    s.parse().map_err(|e: Error| e.message().to_string())
}

/// Gradient accumulation steps, at least 1, for clap.
pub fn parse_steps(s: &str) -> std::result::Result<usize, String> {
    parse_count(s).map_err(|why| format!("{why} (1 means no accumulation)"))
}

/// A ZeRO stage (`none`, `optimizer`, `gradients`, `full`, or DeepSpeed's
/// and FSDP's spellings), for clap.
pub fn parse_sharding(s: &str) -> std::result::Result<accel::zero::Stage, String> {
    s.parse().map_err(|e: Error| e.message().to_string())
}

/// A duration: `300`, `30s`, `500ms`, `5m`, `1h` (a bare number is
/// seconds), at most [`accel::worker_env::MAX_TIMEOUT`].
pub fn parse_dur(s: &str) -> std::result::Result<Duration, String> {
    accel::worker_env::parse_duration("duration", s).map_err(|e| {
        let m = e.message().to_string();
        // Drop the `duration="x": ` head: clap names the flag itself.
        let m = m.split_once(": ").map(|(_, r)| r.to_string()).unwrap_or(m);
        format!("{m} (use e.g. 300, 30s, 500ms, 5m or 1h; at most 365 days)")
    })
}

/// `30s`, `1500ms`: the shortest exact spelling [`parse_dur`] reads back.
pub fn format_dur(d: Duration) -> String {
    accel::worker_env::format_duration(d)
}

/// What `--tee` says: accel's directory, or torchrun's stream selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TeeArg {
    /// accel's `--tee DIR`: each rank's stdout and stderr in DIR/rank-N.log.
    Dir(PathBuf),
    /// torchrun's `--tee 0-3` or `--tee 0:3,1:1`: these streams of each
    /// local rank also in `--log-dir`'s stdout.log / stderr.log files.
    Streams(StdStreams),
}

/// `--tee`: torchrun's selector when it has torchrun's form (`0`-`3`,
/// `LOCAL_RANK:STREAMS,...`), a directory otherwise (`./3` for a directory
/// named 3).
pub fn parse_tee(s: &str) -> std::result::Result<TeeArg, String> {
    match s.parse::<StdStreams>() {
        Ok(streams) => Ok(TeeArg::Streams(streams)),
        Err(_) if s.trim().is_empty() => Err("name a directory (or torchrun's 0-3)".into()),
        Err(_) => Ok(TeeArg::Dir(PathBuf::from(s))),
    }
}

/// torchrun's `--redirects` selector, for clap.
pub fn parse_streams(s: &str) -> std::result::Result<StdStreams, String> {
    s.parse()
}

/// The options that `accel launch` takes as flags and the config file holds
/// as keys (key = long flag name with `_`, e.g. `num_processes`).
///
/// Every field is optional so that the sources can be layered; see
/// [`Options::overlay`].
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct Options {
    /// Worker processes to start on this machine [default: 1]: per
    /// machine, like torchrun's --nproc-per-node (config key
    /// `num_processes`).
    #[arg(short = 'n', long = "nproc-per-node", aliases = ["nproc_per_node"], value_name = "N",
          allow_negative_numbers = true, value_parser = parse_count)]
    pub num_processes: Option<usize>,

    /// Worker processes on all machines together, like Accelerate's
    /// --num_processes: must divide by --num-machines; not with -n.
    #[arg(long = "num-processes", aliases = ["num_processes"], value_name = "TOTAL",
          allow_negative_numbers = true, value_parser = parse_count)]
    pub total_processes: Option<usize>,

    /// Machines taking part in the run [default: 1]; `MIN:MAX` (as
    /// torchrun's --nnodes) makes it elastic: a lost machine restarts the
    /// others at a smaller world while MIN remain, a new one joins at the
    /// next restart (docs/multi-machine.md).
    #[arg(long = "num-machines", visible_alias = "nnodes", aliases = ["num_machines"],
          value_name = "M|MIN:MAX", allow_negative_numbers = true, value_parser = parse_machines)]
    pub num_machines: Option<MachineCount>,

    /// Rank of this machine, 0 to M-1; machine 0 hosts the store [default: 0].
    #[arg(long = "machine-rank", visible_alias = "node-rank",
          aliases = ["node_rank", "machine_rank"], value_name = "K",
          allow_negative_numbers = true, value_parser = parse_index)]
    pub machine_rank: Option<usize>,

    /// Address of machine 0, where the store listens (required with several
    /// machines; one machine always uses 127.0.0.1).
    #[arg(long = "main-process-ip", visible_alias = "master-addr",
          aliases = ["master_addr", "main_process_ip"], value_name = "ADDR")]
    pub main_process_ip: Option<String>,

    /// Port of the store on machine 0 [default: a free port on one machine,
    /// 29500 on several].
    #[arg(long = "main-process-port", visible_alias = "master-port",
          aliases = ["master_port", "main_process_port"], value_name = "PORT")]
    pub main_process_port: Option<u16>,

    /// Shared secret of the store; required with several machines,
    /// generated for one. Visible in `ps`: prefer --token-file or
    /// ACCEL_RUN_TOKEN.
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,

    /// Read the store's shared secret from FILE (its first line), so it
    /// does not show in `ps`.
    #[arg(long = "token-file", value_name = "FILE")]
    pub token_file: Option<PathBuf>,

    /// Backend(s) the workers should use, in order of preference
    /// (ACCEL_BACKEND); `mpi` selects the MPI launch path.
    #[arg(long, value_name = "NAME[,NAME]")]
    pub backend: Option<Backends>,

    /// Bound of every blocking call in the workers, and of the machines'
    /// join (ACCEL_TIMEOUT) [default: 300s].
    #[arg(long, value_name = "DUR", value_parser = parse_dur)]
    pub timeout: Option<Duration>,

    /// Debug mode in the workers (ACCEL_DEBUG=1): collectives are
    /// fingerprinted and mismatches reported per rank.
    #[arg(long)]
    pub debug: bool,

    /// Mixed precision of the workers' training loop
    /// (ACCEL_MIXED_PRECISION, as Accelerate's --mixed_precision): no, bf16
    /// or fp16.
    #[arg(long = "mixed-precision", aliases = ["mixed_precision"], value_name = "no|bf16|fp16",
          value_parser = parse_mixed_precision)]
    pub mixed_precision: Option<MixedPrecision>,

    /// ZeRO sharding of the workers' training loop (ACCEL_SHARDING; read
    /// by accel::train::TrainConfig::sharding): none, optimizer (ZeRO-1),
    /// gradients (ZeRO-2, SHARD_GRAD_OP) or full (ZeRO-3, FULL_SHARD).
    #[arg(long = "sharding", aliases = ["zero_stage", "zero-stage", "fsdp_sharding_strategy"],
          value_name = "none|optimizer|gradients|full", value_parser = parse_sharding)]
    pub sharding: Option<accel::zero::Stage>,

    /// Batches per optimizer step where the program leaves it at 1
    /// (ACCEL_GRADIENT_ACCUMULATION_STEPS, and Accelerate's
    /// ACCELERATE_GRADIENT_ACCUMULATION_STEPS for Accelerate scripts).
    #[arg(long = "gradient-accumulation-steps", aliases = ["gradient_accumulation_steps"],
          value_name = "K", allow_negative_numbers = true, value_parser = parse_steps)]
    pub gradient_accumulation_steps: Option<usize>,

    /// Also write each rank's output to DIR/rank-N.log; or torchrun's
    /// `--tee 0-3` (none, stdout, stderr, both; per local rank as
    /// `0:3,1:1`): those streams also to --log-dir's
    /// attempt_N/LOCAL_RANK/stdout.log and stderr.log.
    #[arg(short = 't', long = "tee", value_name = "DIR|0-3", value_parser = parse_tee)]
    pub tee: Option<TeeArg>,

    /// torchrun's --log-dir: where --tee 0-3 and --redirects write (a run
    /// directory RUN_ID_XXXX in it, as torchrun's); alone, the same as
    /// --tee DIR.
    #[arg(long = "log-dir", aliases = ["log_dir"], value_name = "DIR")]
    pub log_dir: Option<PathBuf>,

    /// torchrun's --redirects 0-3 (or `0:3,1:1`): those streams of each
    /// local rank to --log-dir's files only, not to the terminal.
    #[arg(short = 'r', long = "redirects", value_name = "0-3", value_parser = parse_streams)]
    pub redirects: Option<StdStreams>,

    /// Show the output of these global ranks only (e.g. 0 or 0,2-3; each
    /// below the world size); the others still go to --tee files and
    /// failure reports.
    #[arg(long, value_name = "RANKS")]
    pub ranks: Option<RankFilter>,

    /// Show the output of rank 0 only (same as --ranks 0).
    #[arg(long = "quiet-ranks")]
    pub quiet_ranks: bool,

    /// Restart the whole group up to K times after a failure [default: 0].
    #[arg(long = "max-restarts", aliases = ["max_restarts"], value_name = "K")]
    pub max_restarts: Option<u32>,

    /// Time between SIGTERM and SIGKILL when stopping workers [default: 5s].
    #[arg(long = "grace-period", value_name = "DUR", value_parser = parse_dur)]
    pub grace_period: Option<Duration>,

    /// Report a worker as hung, and stop the group, when it prints nothing
    /// for DUR [default: off].
    #[arg(long = "hang-timeout", value_name = "DUR", value_parser = parse_dur)]
    pub hang_timeout: Option<Duration>,

    /// How long machines wait for each other to join [default: --timeout].
    #[arg(long = "join-timeout", value_name = "DUR", value_parser = parse_dur)]
    pub join_timeout: Option<Duration>,

    /// Elastic runs: how long a round stays open for more machines once
    /// MIN have joined [default: 10s].
    #[arg(long = "join-window", value_name = "DUR", value_parser = parse_dur)]
    pub join_window: Option<Duration>,

    /// Name of the run (ACCEL_RUN_ID): up to 64 letters, digits, `.`, `_`,
    /// `-`, starting with a letter or digit [default: a random one, chosen
    /// by machine 0].
    #[arg(long = "run-id", visible_alias = "rdzv-id", aliases = ["rdzv_id", "run_id"],
          value_name = "ID")]
    pub run_id: Option<String>,
}

impl Options {
    /// Field by field, `self` where set, else `lower`.
    pub fn overlay(self, lower: Options) -> Options {
        Options {
            num_processes: self.num_processes.or(lower.num_processes),
            total_processes: self.total_processes.or(lower.total_processes),
            num_machines: self.num_machines.or(lower.num_machines),
            machine_rank: self.machine_rank.or(lower.machine_rank),
            main_process_ip: self.main_process_ip.or(lower.main_process_ip),
            main_process_port: self.main_process_port.or(lower.main_process_port),
            token: self.token.or(lower.token),
            token_file: self.token_file.or(lower.token_file),
            backend: self.backend.or(lower.backend),
            timeout: self.timeout.or(lower.timeout),
            debug: self.debug || lower.debug,
            mixed_precision: self.mixed_precision.or(lower.mixed_precision),
            sharding: self.sharding.or(lower.sharding),
            gradient_accumulation_steps: self
                .gradient_accumulation_steps
                .or(lower.gradient_accumulation_steps),
            tee: self.tee.or(lower.tee),
            log_dir: self.log_dir.or(lower.log_dir),
            redirects: self.redirects.or(lower.redirects),
            ranks: self.ranks.or(lower.ranks),
            quiet_ranks: self.quiet_ranks || lower.quiet_ranks,
            max_restarts: self.max_restarts.or(lower.max_restarts),
            grace_period: self.grace_period.or(lower.grace_period),
            hang_timeout: self.hang_timeout.or(lower.hang_timeout),
            join_timeout: self.join_timeout.or(lower.join_timeout),
            join_window: self.join_window.or(lower.join_window),
            run_id: self.run_id.or(lower.run_id),
        }
    }

    /// The options the launcher's own environment sets: ACCEL_RUN_TOKEN,
    /// ACCEL_TIMEOUT, ACCEL_BACKEND, ACCEL_DEBUG.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable when its value is
    /// malformed.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let mut o = Options {
            token: get("ACCEL_RUN_TOKEN").filter(|t| !t.is_empty()),
            ..Options::default()
        };
        if let Some(v) = get("ACCEL_TIMEOUT").filter(|v| !v.trim().is_empty()) {
            o.timeout = Some(accel::state::parse_duration("ACCEL_TIMEOUT", &v)?);
        }
        if let Some(v) = get("ACCEL_BACKEND").filter(|v| !v.trim().is_empty()) {
            o.backend = Some(
                v.parse()
                    .map_err(|why: String| Error::invalid_config("ACCEL_BACKEND", &v, why))?,
            );
        }
        if let Some(v) = get("ACCEL_MIXED_PRECISION").filter(|v| !v.trim().is_empty()) {
            o.mixed_precision = Some(v.parse().map_err(|e: Error| {
                Error::invalid_config("ACCEL_MIXED_PRECISION", &v, e.to_string())
                    .with_fix("set it to no, bf16 or fp16")
            })?);
        }
        if let Some(s) = accel::zero::Stage::from_env_value(get("ACCEL_SHARDING").as_deref())? {
            o.sharding = Some(s);
        }
        let steps = accel_api::worker::keys::ACCEL_GRADIENT_ACCUMULATION_STEPS;
        if let Some(v) = get(steps).filter(|v| !v.trim().is_empty()) {
            o.gradient_accumulation_steps =
                Some(accel::worker_env::parse_accumulation_steps(steps, &v)?);
        }
        if let Some(v) = get("ACCEL_DEBUG") {
            o.debug = match v.trim().to_ascii_lowercase().as_str() {
                "" | "0" | "false" | "no" | "off" => false,
                "1" | "true" | "yes" | "on" => true,
                _ => {
                    return Err(Error::invalid_config("ACCEL_DEBUG", &v, "not a boolean")
                        .with_fix("set ACCEL_DEBUG to 1 or 0"))
                }
            };
        }
        Ok(o)
    }
}

/// Everything a launch needs, resolved and checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Workers on this machine.
    pub nproc: usize,
    /// Machines in the run (the most, in an elastic run).
    pub num_machines: usize,
    /// The fewest machines an elastic run goes on with (`num_machines`
    /// when it is not elastic).
    pub min_machines: usize,
    /// How long an elastic round stays open once `min_machines` joined.
    pub join_window: Duration,
    /// This machine's rank.
    pub machine_rank: usize,
    /// Where the store listens (machine 0 binds it; others connect to it).
    pub main_addr: String,
    /// The store's port; 0 = choose a free one (one machine only).
    pub main_port: u16,
    /// The store's token; `None` on one machine until one is generated.
    pub token: Option<String>,
    /// ACCEL_BACKEND for the workers.
    pub backend: Option<Vec<String>>,
    /// ACCEL_TIMEOUT for the workers.
    pub timeout: Duration,
    /// ACCEL_DEBUG for the workers.
    pub debug: bool,
    /// ACCEL_MIXED_PRECISION for the workers (unset: the program decides).
    pub mixed_precision: Option<MixedPrecision>,
    /// ACCEL_SHARDING for the workers (unset: the program decides).
    pub sharding: Option<accel::zero::Stage>,
    /// ACCEL_GRADIENT_ACCUMULATION_STEPS for the workers (unset: the
    /// program decides).
    pub gradient_accumulation_steps: Option<usize>,
    /// Directory for per-rank log files.
    pub tee: Option<PathBuf>,
    /// torchrun's per-stream logs: the base directory (`None`: a new
    /// temporary one), the teed and the redirected streams.
    pub stream_logs: Option<(Option<PathBuf>, StdStreams, StdStreams)>,
    /// Ranks whose output is shown; `None` = all.
    pub ranks: Option<RankFilter>,
    /// Restarts of the whole group after a failure.
    pub max_restarts: u32,
    /// SIGTERM → SIGKILL delay.
    pub grace: Duration,
    /// Silence after which a worker is reported as hung.
    pub hang_timeout: Option<Duration>,
    /// Bound of the machines' join.
    pub join_timeout: Duration,
    /// The run id asked for, if any.
    pub run_id: Option<String>,
    /// Variables of Accelerate's config file for the workers
    /// (ACCELERATE_USE_CPU, ACCELERATE_DEBUG_MODE).
    pub extra_env: Vec<(String, String)>,
}

impl Settings {
    /// `true` when the run spans several machines.
    pub fn multi_machine(&self) -> bool {
        self.num_machines > 1
    }

    /// `true` for `--num-machines MIN:MAX` with `MIN < MAX`.
    pub fn elastic(&self) -> bool {
        self.min_machines < self.num_machines
    }

    /// Total processes of the run, assuming every machine runs [`nproc`]
    /// (what this machine claims when it joins).
    ///
    /// [`nproc`]: Settings::nproc
    pub fn world_size_claim(&self) -> usize {
        self.nproc * self.num_machines
    }

    /// The rank filter (`--ranks`) names only ranks of a run of `world`
    /// ranks.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming `--ranks`, the rank and the
    /// run's ranks.
    pub fn check_rank_filter(&self, world: usize) -> Result<()> {
        let Some(f) = &self.ranks else {
            return Ok(());
        };
        let Some(&r) = f.0.iter().find(|&&r| r >= world) else {
            return Ok(());
        };
        let shown: Vec<String> = f.0.iter().map(|r| r.to_string()).collect();
        Err(bad(
            "--ranks",
            &shown.join(","),
            &format!(
                "rank {r} is not in this run: its {world} rank(s) are 0 to {}",
                world.saturating_sub(1)
            ),
        )
        .with_fix("name ranks below the run's world size (-n times --num-machines)"))
    }

    /// Resolve layered options into settings, checking each value and their
    /// combinations.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] with the flag to fix.
    pub fn resolve(o: Options) -> Result<Settings> {
        let machines = o.num_machines.unwrap_or(MachineCount::exact(1));
        let num_machines = machines.max;
        if machines.min < machines.max && o.total_processes.is_some() {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "--num-processes counts all machines together, but an elastic run                      (--num-machines {machines}) has no fixed number of machines"
                ),
            )
            .with_fix("pass -n / --nproc-per-node, the processes of each machine"));
        }
        let nproc = match (o.num_processes, o.total_processes) {
            (Some(n), Some(t)) => {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "both -n/--nproc-per-node {n} (per machine) and --num-processes {t} \
                         (all machines, as in Accelerate) are given"
                    ),
                )
                .with_fix("pass one: -n / --nproc-per-node for processes per machine, or --num-processes for the total"))
            }
            (Some(n), None) => n,
            (None, Some(t)) if num_machines > 0 && t % num_machines == 0 => t / num_machines,
            (None, Some(t)) => {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "--num-processes {t} counts all machines together (as in Accelerate), \
                         and does not divide by --num-machines {num_machines}"
                    ),
                )
                .with_fix("pass a multiple of --num-machines, or -n / --nproc-per-node for processes per machine"))
            }
            (None, None) => 1,
        };
        if nproc > accel_launch::MAX_LOCAL_PROCESSES {
            return Err(Error::invalid_config(
                "--nproc-per-node",
                &nproc.to_string(),
                format!(
                    "a machine starts at most {} processes (each costs the launcher three \
                     threads and two pipes)",
                    accel_launch::MAX_LOCAL_PROCESSES
                ),
            )
            .with_fix("start fewer processes per machine, and more machines"));
        }
        let machine_rank = o.machine_rank.unwrap_or(0);
        if nproc == 0 {
            return Err(bad(
                "--num-processes",
                "0",
                "a run needs at least one process",
            ));
        }
        if num_machines == 0 {
            return Err(bad(
                "--num-machines",
                "0",
                "a run needs at least one machine",
            ));
        }
        if machine_rank >= num_machines {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "machine rank {machine_rank} is not below the number of machines {num_machines}: \
                     machine ranks go from 0 to {}",
                    num_machines - 1
                ),
            )
            .with_fix("pass --machine-rank between 0 and --num-machines minus 1"));
        }
        let timeout = o.timeout.unwrap_or(DEFAULT_TIMEOUT);
        if timeout < accel::state::MIN_TIMEOUT {
            // The workers would refuse it (ACCEL_TIMEOUT): say so once, here.
            return Err(bad(
                "--timeout",
                &format_dur(timeout),
                "below the shortest timeout accel takes, 1ms (its waits poll at millisecond \
                 steps, so a shorter one is refused, not rounded up)",
            ));
        }
        let token = match (o.token, &o.token_file) {
            (Some(_), Some(_)) => {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    "both --token and --token-file give the token",
                )
                .with_fix("pass --token-file FILE only (the token then stays out of `ps`)"))
            }
            (t, None) => t,
            (None, Some(f)) => Some(read_token(f)?),
        };
        let (main_addr, main_port, token) = if num_machines == 1 {
            // One machine: loopback only, never reachable from outside.
            (
                "127.0.0.1".to_string(),
                o.main_process_port.unwrap_or(0),
                token,
            )
        } else {
            let addr = o
                .main_process_ip
                .filter(|a| !a.trim().is_empty())
                .ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidConfig,
                        format!(
                        "--main-process-ip is required for a run over {num_machines} machines: \
                         every machine must know where machine 0's store listens"
                    ),
                    )
                    .with_fix("pass --main-process-ip ADDRESS_OF_MACHINE_0 on every machine")
                })?;
            let port = o.main_process_port.unwrap_or(DEFAULT_MULTI_MACHINE_PORT);
            if port == 0 {
                return Err(bad(
                    "--main-process-port",
                    "0",
                    "the other machines cannot find a port chosen at random; \
                     a run over several machines needs a fixed port",
                )
                .with_fix("pass the same --main-process-port (e.g. 29500) on every machine"));
            }
            let token = token.filter(|t| !t.is_empty()).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "a run over {num_machines} machines needs a shared token: the store \
                         listens on {addr}:{port}, reachable from other machines"
                    ),
                )
                .with_fix(
                    "give every machine the same token in a file: `od -An -tx1 -N16 /dev/urandom | \
                     tr -d ' \\n' > ~/.accel-token`, copy it, and pass --token-file ~/.accel-token \
                     (or set ACCEL_RUN_TOKEN, or `token` in the config file)",
                )
            })?;
            (addr, port, Some(token))
        };
        if let Some(id) = &o.run_id {
            check_run_id(id)?;
        }
        if let Some(b) = &o.backend {
            check_backends(&b.0)?;
        }
        let (tee, stream_logs) = match (o.tee, o.log_dir, o.redirects) {
            (Some(TeeArg::Dir(d)), Some(l), _) => {
                return Err(bad(
                    "--log-dir",
                    &l.to_string_lossy(),
                    &format!(
                        "--tee {} already names the log directory; --log-dir goes with \
                         torchrun's --tee 0-3 or --redirects",
                        d.display()
                    ),
                )
                .with_fix("give --tee DIR alone, or torchrun's --tee 3 --log-dir DIR"))
            }
            (Some(TeeArg::Dir(_)), _, Some(_)) => {
                return Err(Error::new(
                    ErrorKind::InvalidConfig,
                    "--redirects is torchrun's and goes with its --tee 0-3 and --log-dir, \
                     not with accel's --tee DIR",
                )
                .with_fix("give --redirects 3 --log-dir DIR (or --tee DIR alone)"))
            }
            (Some(TeeArg::Dir(d)), None, None) => (Some(d), None),
            (Some(TeeArg::Streams(t)), base, r) => {
                (None, Some((base, t, r.unwrap_or(StdStreams::All(0)))))
            }
            (None, base, Some(r)) => (None, Some((base, StdStreams::All(0), r))),
            // --log-dir alone: accel's --tee DIR (torchrun logs no stream
            // without --tee or --redirects).
            (None, base, None) => (base, None),
        };
        let ranks = if o.quiet_ranks && o.ranks.is_none() {
            Some(RankFilter([0].into_iter().collect()))
        } else {
            o.ranks
        };
        Ok(Settings {
            nproc,
            num_machines,
            min_machines: machines.min,
            join_window: o.join_window.unwrap_or(DEFAULT_JOIN_WINDOW),
            machine_rank,
            main_addr,
            main_port,
            token,
            backend: o.backend.map(|b| b.0),
            timeout,
            debug: o.debug,
            mixed_precision: o.mixed_precision,
            sharding: o.sharding,
            gradient_accumulation_steps: o.gradient_accumulation_steps,
            tee,
            stream_logs,
            ranks,
            max_restarts: o.max_restarts.unwrap_or(0),
            grace: o.grace_period.unwrap_or(DEFAULT_GRACE),
            hang_timeout: o.hang_timeout,
            join_timeout: o.join_timeout.unwrap_or(timeout),
            run_id: o.run_id,
            extra_env: Vec::new(),
        })
    }
}

/// The token in `path`: its first line, trimmed.
fn read_token(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::io(format!("cannot read the token file {}", path.display()), e)
            .with_fix("pass --token-file a readable file holding the run's token")
    })?;
    let t = text.lines().next().unwrap_or("").trim().to_string();
    if t.is_empty() {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("the token file {} is empty", path.display()),
        )
        .with_fix("write the token (e.g. 32 hex digits) on its first line"));
    }
    Ok(t)
}

/// The longest run id (it names store keys and log files).
pub const MAX_RUN_ID: usize = 64;

/// A run id is 1 to [`MAX_RUN_ID`] letters, digits, `.`, `_` and `-`, not
/// starting with `.` or `-`: it becomes part of store keys and of file
/// names, so no `/`, `..`, spaces or other characters.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] naming `--run-id` and the allowed
/// characters.
pub fn check_run_id(id: &str) -> Result<()> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let why = if id.is_empty() {
        "a run id must not be empty".to_string()
    } else if id.len() > MAX_RUN_ID {
        format!(
            "a run id has at most {MAX_RUN_ID} characters, this one {}",
            id.len()
        )
    } else if let Some(c) = id.chars().find(|&c| !allowed(c)) {
        format!("{c:?} is not allowed in a run id")
    } else if id.starts_with(['.', '-']) {
        "a run id must not start with `.` or `-`".to_string()
    } else {
        return Ok(());
    };
    Err(bad("--run-id", id, &why).with_fix(
        "use letters, digits, `.`, `_` and `-` only (e.g. exp-7), starting with a letter or digit",
    ))
}

/// Every name in `names` is a backend accel knows: one of
/// [`accel::KNOWN_BACKENDS`] (compiled into the program or not:
/// the workers' program decides) or a plugin found in `ACCEL_PLUGIN_PATH`.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] naming `--backend`, the unknown name and
/// the known ones.
pub fn check_backends(names: &[String]) -> Result<()> {
    let known = |n: &str| accel::KNOWN_BACKENDS.iter().any(|k| k.0 == n);
    if names.iter().all(|n| known(n)) {
        return Ok(());
    }
    // Only an unknown name pays for loading the plugins.
    let plugins = accel::Registry::from_env().names();
    let Some(unknown) = names.iter().find(|n| !known(n) && !plugins.contains(n)) else {
        return Ok(());
    };
    let mut all: Vec<String> = accel::KNOWN_BACKENDS
        .iter()
        .map(|k| k.0.to_string())
        .collect();
    all.extend(plugins.into_iter().filter(|p| !known(p)));
    Err(bad(
        "--backend",
        &names.join(","),
        &format!("there is no backend named `{unknown}`"),
    )
    .with_fix(format!(
        "choose from: {} (a plugin's name once its library is in ACCEL_PLUGIN_PATH)",
        all.join(", ")
    )))
}

fn bad(flag: &str, value: &str, why: &str) -> Error {
    Error::invalid_config(flag, value, why)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Options from an environment holding only `key=value`.
    fn one_var(key: &str, value: &str) -> Result<Options> {
        Options::from_env(|k| (k == key).then(|| value.to_string()))
    }

    /// `key=value` read from the environment, a malformed `key` refused
    /// naming it, and `flag` resolved over the environment's options.
    fn flag_over_env(
        key: &str,
        value: &str,
        set_flag: impl FnOnce(&mut Options),
    ) -> (Options, Settings) {
        let mut flag = Options::default();
        set_flag(&mut flag);
        let env = one_var(key, value).unwrap();
        let e = one_var(key, "x").unwrap_err();
        assert!(e.to_string().contains(key), "{e}");
        let s = Settings::resolve(flag.overlay(env.clone())).unwrap();
        (env, s)
    }

    /// `parse` reads `good.0` as `good.1`, and refuses `bad` naming it.
    #[track_caller]
    fn parses<T: PartialEq + std::fmt::Debug>(
        parse: fn(&str) -> std::result::Result<T, String>,
        good: (&str, T),
        bad: &str,
    ) {
        assert_eq!(parse(good.0), Ok(good.1));
        assert!(parse(bad).unwrap_err().contains(bad));
    }

    #[test]
    fn machine_counts_are_exact_or_elastic_ranges() {
        assert_eq!(parse_machines("3"), Ok(MachineCount::exact(3)));
        assert_eq!(parse_machines("2:4"), Ok(MachineCount { min: 2, max: 4 }));
        assert_eq!(MachineCount { min: 2, max: 4 }.to_string(), "2:4");
        assert!(parse_machines("4:2").unwrap_err().contains("MIN <= MAX"));
        assert!(parse_machines("0:2").unwrap_err().contains("at least 1"));
        let s = Settings::resolve(Options {
            num_machines: Some(MachineCount { min: 2, max: 4 }),
            machine_rank: Some(3),
            main_process_ip: Some("10.0.0.1".into()),
            token: Some("t".into()),
            ..Options::default()
        })
        .unwrap();
        assert!(s.elastic() && s.multi_machine());
        assert_eq!((s.min_machines, s.num_machines), (2, 4));
        assert_eq!(s.join_window, DEFAULT_JOIN_WINDOW);
    }

    #[test]
    fn counts_refuse_zero_and_negative() {
        assert_eq!(parse_count("4"), Ok(4));
        assert!(parse_count("0").unwrap_err().contains("at least 1, got 0"));
        assert!(parse_count("-2")
            .unwrap_err()
            .contains("at least 1, got -2"));
        assert!(parse_index("-1").unwrap_err().contains("0 or more"));
    }

    #[test]
    fn process_counts_per_machine_and_in_total() {
        let r = |n: Option<usize>, t: Option<usize>, m: usize| {
            Settings::resolve(Options {
                num_processes: n,
                total_processes: t,
                num_machines: Some(m.into()),
                main_process_ip: Some("10.0.0.1".into()),
                token: Some("t".into()),
                ..Options::default()
            })
        };
        assert_eq!(r(Some(2), None, 2).unwrap().world_size_claim(), 4);
        // Accelerate's --num_processes 2 --num_machines 2: 2 ranks in all.
        let s = r(None, Some(2), 2).unwrap();
        assert_eq!((s.nproc, s.world_size_claim()), (1, 2));
        assert!(r(None, Some(3), 2)
            .unwrap_err()
            .to_string()
            .contains("does not divide"));
        assert!(r(Some(2), Some(4), 2)
            .unwrap_err()
            .to_string()
            .contains("both"));
        let e = r(Some(100_000), None, 1).unwrap_err();
        assert!(e.to_string().contains("at most 1024"), "{e}");
    }

    #[test]
    fn tokens_come_from_a_file_and_not_twice() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("tok");
        std::fs::write(&f, "abc123\n").unwrap();
        let r = |token: Option<&str>, file: Option<&std::path::Path>| {
            Settings::resolve(Options {
                token: token.map(str::to_string),
                token_file: file.map(|p| p.to_path_buf()),
                ..Options::default()
            })
        };
        assert_eq!(r(None, Some(&f)).unwrap().token.as_deref(), Some("abc123"));
        assert!(r(Some("x"), Some(&f))
            .unwrap_err()
            .to_string()
            .contains("both"));
        std::fs::write(&f, "\n").unwrap();
        assert!(r(None, Some(&f)).unwrap_err().to_string().contains("empty"));
        assert!(r(None, Some(&dir.path().join("none"))).is_err());
    }

    #[test]
    fn tee_takes_torchruns_selectors_and_accels_directories() {
        assert_eq!(parse_tee("3"), Ok(TeeArg::Streams(StdStreams::All(3))));
        assert!(matches!(parse_tee("0:1,1:2"), Ok(TeeArg::Streams(_))));
        assert_eq!(parse_tee("./3"), Ok(TeeArg::Dir(PathBuf::from("./3"))));
        let r = |tee: Option<&str>, log_dir: Option<&str>, redirects: Option<&str>| {
            Settings::resolve(Options {
                tee: tee.map(|t| parse_tee(t).unwrap()),
                log_dir: log_dir.map(PathBuf::from),
                redirects: redirects.map(|r| r.parse().unwrap()),
                ..Options::default()
            })
        };
        let s = r(Some("1"), Some("logs"), Some("2")).unwrap();
        assert_eq!(
            s.stream_logs,
            Some((
                Some(PathBuf::from("logs")),
                StdStreams::All(1),
                StdStreams::All(2)
            ))
        );
        assert_eq!(s.tee, None);
        // --log-dir alone is accel's --tee DIR.
        assert_eq!(
            r(None, Some("logs"), None).unwrap().tee,
            Some("logs".into())
        );
        let s = r(None, None, Some("3")).unwrap();
        assert_eq!(
            s.stream_logs,
            Some((None, StdStreams::All(0), StdStreams::All(3)))
        );
        assert!(r(Some("logs"), Some("x"), None)
            .unwrap_err()
            .to_string()
            .contains("--tee logs already names"));
        assert!(r(Some("logs"), None, Some("3"))
            .unwrap_err()
            .to_string()
            .contains("--redirects is torchrun's"));
    }

    #[test]
    fn durations_round_trip() {
        for d in [
            Duration::from_secs(30),
            Duration::from_millis(1500),
            Duration::from_secs(3600),
        ] {
            assert_eq!(parse_dur(&format_dur(d)).unwrap(), d);
        }
        assert!(parse_dur("soon").unwrap_err().contains("not a duration"));
    }

    #[test]
    fn mixed_precision_comes_from_the_flag_the_env_or_the_file() {
        parses(parse_mixed_precision, ("BF16", MixedPrecision::Bf16), "fp8");
        let (env, s) = flag_over_env("ACCEL_MIXED_PRECISION", "fp16", |o| {
            o.mixed_precision = Some(MixedPrecision::Bf16)
        });
        assert_eq!(env.mixed_precision, Some(MixedPrecision::Fp16));
        assert_eq!(s.mixed_precision, Some(MixedPrecision::Bf16));
    }

    #[test]
    fn sharding_comes_from_the_flag_or_the_env_and_reaches_the_workers() {
        use accel::zero::Stage;
        parses(parse_sharding, ("FULL_SHARD", Stage::Full), "zero9");
        let (env, s) = flag_over_env("ACCEL_SHARDING", "zero2", |o| {
            o.sharding = Some(Stage::Full)
        });
        assert_eq!(env.sharding, Some(Stage::Gradients));
        assert_eq!(s.sharding, Some(Stage::Full));
        let vars = accel::worker_env::WorkerEnv {
            sharding: s.sharding,
            ..Default::default()
        }
        .to_vars();
        assert!(
            vars.iter()
                .any(|(k, v)| *k == "ACCEL_SHARDING" && v == "full"),
            "{vars:?}"
        );
    }

    #[test]
    fn overlay_prefers_the_upper_layer() {
        let flags = Options {
            num_processes: Some(4),
            ..Options::default()
        };
        let file = Options {
            num_processes: Some(2),
            max_restarts: Some(3),
            debug: true,
            ..Options::default()
        };
        let o = flags.overlay(file);
        assert_eq!(
            (o.num_processes, o.max_restarts, o.debug),
            (Some(4), Some(3), true)
        );
    }

    #[test]
    fn resolve_checks_combinations() {
        let refused = |o: Options, what: &str| {
            let e = Settings::resolve(o).unwrap_err();
            assert!(e.to_string().contains(what), "{e}");
        };
        let two = Options {
            num_machines: Some(2.into()),
            ..Options::default()
        };
        refused(
            Options {
                machine_rank: Some(2),
                ..two.clone()
            },
            "machine rank 2 is not below",
        );
        refused(two.clone(), "--main-process-ip");
        refused(
            Options {
                main_process_ip: Some("10.0.0.1".into()),
                ..two.clone()
            },
            "token",
        );
        let s = Settings::resolve(Options {
            num_machines: Some(2.into()),
            main_process_ip: Some("10.0.0.1".into()),
            token: Some("t".into()),
            quiet_ranks: true,
            ..Options::default()
        })
        .unwrap();
        assert_eq!(s.main_port, DEFAULT_MULTI_MACHINE_PORT);
        assert!(s.ranks.unwrap().shows(0));
        let s = Settings::resolve(Options::default()).unwrap();
        assert_eq!((s.main_addr.as_str(), s.main_port), ("127.0.0.1", 0));
    }

    #[test]
    fn env_layer_names_the_variable() {
        let e =
            Options::from_env(|k| (k == "ACCEL_TIMEOUT").then(|| "soon".to_string())).unwrap_err();
        assert!(e.to_string().contains("ACCEL_TIMEOUT"), "{e}");
        let o = Options::from_env(|k| match k {
            "ACCEL_DEBUG" => Some("1".into()),
            "ACCEL_BACKEND" => Some("cpu-gloo".into()),
            _ => None,
        })
        .unwrap();
        assert!(o.debug);
        assert_eq!(o.backend.unwrap().0, vec!["cpu-gloo"]);
    }
}
