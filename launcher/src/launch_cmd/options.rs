//! The options of a launch as the flags, the environment and the config
//! file give them ([`Options`], every field optional so that the layers
//! stack with [`Options::overlay`]), and the parsers of their values. The
//! environment's layer is [`Options::from_env`]; resolving the layers into
//! what a launch needs is [`Settings`](super::settings::Settings).

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use accel_api::worker::{MixedPrecision, Stage};
use accel_api::{Error, Result};

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
pub fn parse_sharding(s: &str) -> std::result::Result<Stage, String> {
    s.parse().map_err(|e: Error| e.message().to_string())
}

/// A duration: `300`, `30s`, `500ms`, `5m`, `1h` (a bare number is
/// seconds), at most [`accel_api::worker::MAX_TIMEOUT`].
pub fn parse_dur(s: &str) -> std::result::Result<Duration, String> {
    accel_api::worker::parse_duration("duration", s).map_err(|e| {
        let m = e.message().to_string();
        // Drop the `duration="x": ` head: clap names the flag itself.
        let m = m.split_once(": ").map(|(_, r)| r.to_string()).unwrap_or(m);
        format!("{m} (use e.g. 300, 30s, 500ms, 5m or 1h; at most 365 days)")
    })
}

/// `30s`, `1500ms`: the shortest exact spelling [`parse_dur`] reads back.
pub fn format_dur(d: Duration) -> String {
    accel_api::worker::format_duration(d)
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
    pub sharding: Option<Stage>,

    /// Batches per optimizer step where the program leaves it at 1
    /// (ACCEL_GRADIENT_ACCUMULATION_STEPS, and Accelerate's
    /// ACCELERATE_GRADIENT_ACCUMULATION_STEPS for Accelerate scripts).
    #[arg(long = "gradient-accumulation-steps", aliases = ["gradient_accumulation_steps"],
          value_name = "K", allow_negative_numbers = true, value_parser = parse_steps)]
    pub gradient_accumulation_steps: Option<usize>,

    /// Accelerate's ParallelismConfig (`--parallelism_config_*`): replicas
    /// of the model, exported to the workers as
    /// PARALLELISM_CONFIG_DP_REPLICATE_SIZE (read by accel::mesh and by
    /// Accelerate scripts); the sizes must multiply to the world size.
    #[arg(long = "parallelism-config-dp-replicate-size",
          aliases = ["parallelism_config_dp_replicate_size"], value_name = "N")]
    pub pc_dp_replicate: Option<usize>,

    /// Ranks one replica is sharded over (PARALLELISM_CONFIG_DP_SHARD_SIZE).
    #[arg(long = "parallelism-config-dp-shard-size",
          aliases = ["parallelism_config_dp_shard_size"], value_name = "N")]
    pub pc_dp_shard: Option<usize>,

    /// Tensor-parallel ranks (PARALLELISM_CONFIG_TP_SIZE).
    #[arg(long = "parallelism-config-tp-size",
          aliases = ["parallelism_config_tp_size"], value_name = "N")]
    pub pc_tp: Option<usize>,

    /// Context-parallel ranks (PARALLELISM_CONFIG_CP_SIZE; above 1 refused:
    /// not supported yet).
    #[arg(long = "parallelism-config-cp-size",
          aliases = ["parallelism_config_cp_size"], value_name = "N")]
    pub pc_cp: Option<usize>,

    /// Accelerate's switch for the sizes above; accel uses them whenever one
    /// is given, so it changes nothing.
    #[arg(long = "use-parallelism-config", aliases = ["use_parallelism_config"])]
    pub use_parallelism_config: bool,

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

    /// Where the ranks write their flight-recorder dumps (ACCEL_DUMP_DIR;
    /// read them with `accel trace DIR`) [default: DIR/dumps under --tee
    /// or --log-dir, else <temp>/accel-dumps/RUN_ID].
    #[arg(long = "dump-dir", value_name = "DIR")]
    pub dump_dir: Option<PathBuf>,

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
            pc_dp_replicate: self.pc_dp_replicate.or(lower.pc_dp_replicate),
            pc_dp_shard: self.pc_dp_shard.or(lower.pc_dp_shard),
            pc_tp: self.pc_tp.or(lower.pc_tp),
            pc_cp: self.pc_cp.or(lower.pc_cp),
            use_parallelism_config: self.use_parallelism_config || lower.use_parallelism_config,
            tee: self.tee.or(lower.tee),
            log_dir: self.log_dir.or(lower.log_dir),
            redirects: self.redirects.or(lower.redirects),
            dump_dir: self.dump_dir.or(lower.dump_dir),
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
    /// ACCEL_TIMEOUT, ACCEL_BACKEND, ACCEL_DEBUG, ACCEL_DUMP_DIR (the
    /// machines a cluster scheduler describes join this layer in
    /// `cluster_env.rs`).
    ///
    /// # Errors
    /// [`accel_api::ErrorKind::InvalidConfig`] naming the variable when its value is
    /// malformed.
    pub fn from_env(get: impl Fn(&str) -> Option<String>) -> Result<Options> {
        let mut o = Options {
            token: get("ACCEL_RUN_TOKEN").filter(|t| !t.is_empty()),
            ..Options::default()
        };
        if let Some(v) = get("ACCEL_TIMEOUT").filter(|v| !v.trim().is_empty()) {
            o.timeout = Some(accel_api::worker::parse_duration("ACCEL_TIMEOUT", &v)?);
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
        if let Some(s) = Stage::from_env_value(get("ACCEL_SHARDING").as_deref())? {
            o.sharding = Some(s);
        }
        let steps = accel_api::worker::keys::ACCEL_GRADIENT_ACCUMULATION_STEPS;
        if let Some(v) = get(steps).filter(|v| !v.trim().is_empty()) {
            o.gradient_accumulation_steps =
                Some(accel_api::worker::parse_accumulation_steps(steps, &v)?);
        }
        o.dump_dir = get(accel_api::worker::keys::ACCEL_DUMP_DIR)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from);
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

#[cfg(test)]
mod tests {
    use super::*;

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
