//! [`Settings`]: the options of a launch resolved into what it needs.
//!
//! The layers, highest first:
//!
//! 1. **flags** ([`Options`] as clap parsed them), with torchrun's
//!    `--rdzv-endpoint` and `--standalone` folded in ([`torchrun_flags`]);
//! 2. **environment**: the `ACCEL_*` variables that have a flag
//!    ([`Options::from_env`]);
//! 3. **config file**: accel's TOML or Accelerate's YAML/JSON, only with
//!    `--config` or `ACCEL_CONFIG_FILE` ([`file_layer`]);
//! 4. **defaults**, with every value and combination checked
//!    ([`Settings::resolve`], one function per concern: the processes and
//!    machines, the timeout, the token, the store's endpoint, the logs).

use std::path::PathBuf;
use std::time::Duration;

use accel_api::worker::{MixedPrecision, Stage, WorkerEnv};
use accel_api::{Error, ErrorKind, Result};
use accel_launch::output::say;
use accel_launch::{EtcdRendezvous, MachinesConfig};
use accel_rendezvous::EtcdAuth;

use super::args::LaunchArgs;
use super::options::{format_dur, MachineCount, Options, RankFilter, StdStreams, TeeArg};
use super::{accelerate_config, config};

/// Port of the store on a run over several machines when none is given
/// (torchrun's default).
pub const DEFAULT_MULTI_MACHINE_PORT: u16 = 29500;
/// Time between SIGTERM and SIGKILL when the launcher stops its workers.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(5);
/// How long an elastic round stays open for more machines once the fewest
/// have joined (`--join-window`).
pub const DEFAULT_JOIN_WINDOW: Duration = Duration::from_secs(10);
/// Default bound for blocking calls, as in the runtime (`ACCEL_TIMEOUT`).
pub const DEFAULT_TIMEOUT: Duration = accel_api::worker::DEFAULT_TIMEOUT;

/// torchrun's per-stream logs: the base directory (`None`: a new
/// temporary one), the teed and the redirected streams.
pub type StreamLogs = (Option<PathBuf>, StdStreams, StdStreams);

/// The config-file layer: the options of `--config` (accel's TOML, or
/// Accelerate's file mapped key by key) and the variables Accelerate's file
/// sets for the workers; nothing without `--config`.
///
/// # Errors
/// The file cannot be read, or holds a key or value accel refuses.
pub fn file_layer(args: &LaunchArgs) -> Result<(Options, Vec<(String, String)>)> {
    Ok(match &args.config {
        Some(p) if accelerate_config::is_accelerate_config(p) => {
            let c = accelerate_config::read(p)?;
            (c.options, c.env)
        }
        Some(p) => (config::read(p)?, Vec::new()),
        None => (Options::default(), Vec::new()),
    })
}

/// torchrun's flags that set other options, over the layered options `o`:
/// `--rdzv-endpoint HOST[:PORT]` (machine 0's address and port) and
/// `--standalone` (one machine).
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] when they contradict `o`.
pub fn torchrun_flags(args: &LaunchArgs, mut o: Options) -> Result<Options> {
    // Under etcd, --rdzv-endpoint names the cluster ([`etcd_rendezvous`]).
    if let Some(ep) = args.rdzv_endpoint.as_ref().filter(|_| !on_etcd(args)) {
        let (host, port) = split_endpoint(ep)?;
        if o.main_process_ip.as_deref().is_some_and(|h| h != host) {
            return Err(Error::invalid_config(
                "--rdzv-endpoint",
                ep,
                "contradicts --main-process-ip (--master-addr); give one of them",
            ));
        }
        o.main_process_ip = Some(host.to_string());
        if let Some(p) = port {
            if o.main_process_port.is_some_and(|q| q != p) {
                return Err(Error::invalid_config(
                    "--rdzv-endpoint",
                    ep,
                    "contradicts --main-process-port (--master-port); give one of them",
                ));
            }
            o.main_process_port = Some(p);
        }
    }
    if args.standalone {
        if o.num_machines.is_some_and(|m| m.max > 1) {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                "--standalone runs on one machine, but --num-machines is more than 1",
            ));
        }
        o.num_machines = Some(1.into());
        o.machine_rank = Some(0);
    }
    Ok(o)
}

/// Variables for the workers, as `(name, value)`.
type EnvPairs = Vec<(String, String)>;

/// `--rdzv-backend etcd` (or torch's `etcd-v2`).
fn on_etcd(args: &LaunchArgs) -> bool {
    matches!(args.rdzv_backend.as_deref(), Some("etcd" | "etcd-v2"))
}

/// The etcd cluster of `--rdzv-backend etcd --rdzv-endpoint H:P,H:P
/// [--rdzv-conf ...]`, and the variables that let the workers reach it
/// too; `None` under another backend.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] naming the flag: no endpoint, a malformed
/// one, an unknown `--rdzv-conf` key, a password file that cannot be read,
/// `--rdzv-conf` without etcd.
pub fn etcd_rendezvous(args: &LaunchArgs) -> Result<Option<(EtcdRendezvous, EnvPairs)>> {
    if !on_etcd(args) {
        if let Some(c) = &args.rdzv_conf {
            return Err(Error::invalid_config(
                "--rdzv-conf",
                c,
                "it configures the etcd rendezvous; pass --rdzv-backend etcd, or drop it",
            ));
        }
        return Ok(None);
    }
    if args.rdzv_backend.as_deref() == Some("etcd-v2") {
        say(
            "--rdzv-backend etcd-v2 (torch's name for its etcd rendezvous): accel's etcd \
             rendezvous runs, over etcd's v3 API, with accel's keys (torch's launchers cannot \
             join it)",
        );
    }
    let list = args.rdzv_endpoint.as_deref().unwrap_or_default();
    let mut endpoints = Vec::new();
    for ep in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let ep = ep
            .strip_prefix("http://")
            .or_else(|| ep.strip_prefix("https://"))
            .unwrap_or(ep);
        let (host, port) = split_endpoint(ep)?;
        endpoints.push(format!("{host}:{}", port.unwrap_or(2379)));
    }
    if endpoints.is_empty() {
        return Err(Error::invalid_config(
            "--rdzv-endpoint",
            list,
            "--rdzv-backend etcd needs the cluster's members, HOST:PORT[,HOST:PORT...]",
        ));
    }
    let mut auth = EtcdAuth::default();
    let mut env = Vec::new();
    let (mut user, mut password) = (None, None);
    for kv in args.rdzv_conf.iter().flat_map(|c| c.split(',')) {
        let bad = |why: &str| Error::invalid_config("--rdzv-conf", kv, why.to_string());
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| bad("expected KEY=VALUE"))?;
        let (k, v) = (k.trim(), v.trim().to_string());
        let var = match k {
            "cacert" | "ca" => "ACCEL_ETCD_CA",
            "cert" => "ACCEL_ETCD_CERT",
            "key" => "ACCEL_ETCD_KEY",
            "user" => "ACCEL_ETCD_USER",
            "password_file" => "ACCEL_ETCD_PASSWORD",
            _ => {
                return Err(bad(
                    "unknown key; --rdzv-conf takes cacert, cert, key, user and password_file",
                ))
            }
        };
        let value = match var {
            "ACCEL_ETCD_CA" => auth.ca.insert(v.clone().into()).display().to_string(),
            "ACCEL_ETCD_CERT" => auth.cert.insert(v.clone().into()).display().to_string(),
            "ACCEL_ETCD_KEY" => auth.key.insert(v.clone().into()).display().to_string(),
            "ACCEL_ETCD_USER" => user.insert(v).clone(),
            _ => {
                let p = std::fs::read_to_string(&v)
                    .map_err(|e| bad(&format!("cannot read the password file: {e}")))?;
                password.insert(p.trim().to_string()).clone()
            }
        };
        env.push((var.to_string(), value));
    }
    auth.user = match (user, password) {
        (Some(u), Some(p)) => Some((u, p)),
        (None, None) => None,
        _ => {
            return Err(Error::invalid_config(
                "--rdzv-conf",
                args.rdzv_conf.as_deref().unwrap_or_default(),
                "etcd authentication needs both user=NAME and password_file=FILE",
            ))
        }
    };
    if auth.cert.is_some() != auth.key.is_some() {
        return Err(Error::invalid_config(
            "--rdzv-conf",
            args.rdzv_conf.as_deref().unwrap_or_default(),
            "a client certificate (cert=) needs its key (key=), and the other way round",
        ));
    }
    Ok(Some((EtcdRendezvous { endpoints, auth }, env)))
}

/// torchrun's `HOST[:PORT]` (IPv6 in brackets).
fn split_endpoint(ep: &str) -> Result<(&str, Option<u16>)> {
    let bad = |why: &str| Error::invalid_config("--rdzv-endpoint", ep, why.to_string());
    let (host, port) = match ep.strip_prefix('[') {
        Some(v6) => {
            let (h, rest) = v6.split_once(']').ok_or_else(|| bad("unclosed `[`"))?;
            (h, rest.strip_prefix(':'))
        }
        None if ep.matches(':').count() > 1 => (ep, None),
        None => match ep.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (ep, None),
        },
    };
    if host.is_empty() {
        return Err(bad("the host is missing"));
    }
    let port = port
        .map(|p| {
            p.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| bad("the port is not in 1-65535"))
        })
        .transpose()?;
    Ok((host, port))
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
    /// No rank was given to a torchrun-style c10d launch: the rendezvous
    /// hands it out (`machine_rank` is then ignored).
    pub auto_machine_rank: bool,
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
    pub sharding: Option<Stage>,
    /// ACCEL_GRADIENT_ACCUMULATION_STEPS for the workers (unset: the
    /// program decides).
    pub gradient_accumulation_steps: Option<usize>,
    /// Directory for per-rank log files.
    pub tee: Option<PathBuf>,
    /// torchrun's per-stream logs: the base directory (`None`: a new
    /// temporary one), the teed and the redirected streams.
    pub stream_logs: Option<StreamLogs>,
    /// Where the ranks dump their flight recorders (`--dump-dir`,
    /// ACCEL_DUMP_DIR, else `dumps` under the logs); `None`: the run's
    /// default, `<temp>/accel-dumps/RUN_ID`.
    pub dump_dir: Option<PathBuf>,
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
    /// Accelerate's ParallelismConfig from the `--parallelism-config-*`
    /// flags, checked against the world size; exported to the workers.
    pub parallelism: Option<accel::mesh::ParallelismConfig>,
    /// The run's store on an etcd cluster (`--rdzv-backend etcd`).
    pub etcd: Option<EtcdRendezvous>,
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

    /// The settings of `accel launch ARGS`: its layers (flags over the
    /// environment over the config file, see the [module docs](self))
    /// resolved over the defaults.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] with the flag or variable to fix, and
    /// the config file's errors.
    pub fn from_args(args: &LaunchArgs) -> Result<Settings> {
        let (file, extra_env) = file_layer(args)?;
        let get = |k: &str| std::env::var(k).ok();
        let mut env = Options::from_env(get)?;
        // Kubeflow Trainer's PET_* and SkyPilot's SKYPILOT_*.
        super::cluster_env::apply(&get, &mut env)?;
        let o = torchrun_flags(args, args.options.clone().overlay(env).overlay(file))?;
        // torchrun's c10d hands out node ranks when none is given.
        let auto_rank = args.rdzv_backend.as_deref() == Some("c10d") && o.machine_rank.is_none();
        if args.options.token.is_some() {
            say(
                "warning: --token on the command line is visible to every user of this machine \
                 (`ps`); use --token-file FILE or the ACCEL_RUN_TOKEN variable instead",
            );
        }
        let etcd = etcd_rendezvous(args)?;
        let mut s = Settings::resolve_on(o, etcd.as_ref().map(|e| &e.0))?;
        s.auto_machine_rank = auto_rank && s.multi_machine();
        s.extra_env = extra_env;
        if let Some((rdzv, env)) = etcd {
            s.extra_env.extend(env);
            s.etcd = Some(rdzv);
        }
        s.extra_env.extend(s.parallelism_env());
        Ok(s)
    }

    /// Resolve layered options into settings: each value checked, their
    /// combinations too, the defaults where nothing was given.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] with the flag to fix.
    #[cfg(test)]
    pub fn resolve(o: Options) -> Result<Settings> {
        Self::resolve_on(o, None)
    }

    /// [`resolve`](Self::resolve), the run's store on `etcd` when given:
    /// then no machine hosts it (no address, port or token to give), the
    /// run spans several machines and names itself (`--rdzv-id`).
    ///
    /// # Errors
    /// As `resolve`; under etcd, one machine or no run id.
    pub fn resolve_on(o: Options, etcd: Option<&EtcdRendezvous>) -> Result<Settings> {
        let (machines, nproc, machine_rank) = processes(&o)?;
        let parallelism = parallelism(&o, machines, nproc)?;
        let timeout = timeout(&o)?;
        let token = token(&o)?;
        let (main_addr, main_port, token) = match etcd {
            None => endpoint(&o, machines.max, token)?,
            Some(e) => {
                check_etcd_run(&o, machines.max, e)?;
                (String::new(), 0, token)
            }
        };
        if let Some(id) = &o.run_id {
            check_run_id(id)?;
        }
        if let Some(b) = &o.backend {
            check_backends(&b.0)?;
        }
        let (tee, stream_logs) = logs(o.tee, o.log_dir, o.redirects)?;
        let ranks = if o.quiet_ranks && o.ranks.is_none() {
            Some(RankFilter([0].into_iter().collect()))
        } else {
            o.ranks
        };
        let dump_dir = o.dump_dir.or_else(|| {
            let logs = tee
                .clone()
                .or_else(|| stream_logs.as_ref().and_then(|l| l.0.clone()));
            logs.map(|d| d.join("dumps"))
        });
        Ok(Settings {
            nproc,
            num_machines: machines.max,
            min_machines: machines.min,
            join_window: o.join_window.unwrap_or(DEFAULT_JOIN_WINDOW),
            machine_rank,
            auto_machine_rank: false,
            etcd: None,
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
            dump_dir,
            ranks,
            max_restarts: o.max_restarts.unwrap_or(0),
            grace: o.grace_period.unwrap_or(DEFAULT_GRACE),
            hang_timeout: o.hang_timeout,
            join_timeout: o.join_timeout.unwrap_or(timeout),
            run_id: o.run_id,
            extra_env: Vec::new(),
            parallelism,
        })
    }

    /// What the workers get for [`parallelism`](Self::parallelism):
    /// Accelerate's variables, as `accelerate launch` exports them.
    pub fn parallelism_env(&self) -> Vec<(String, String)> {
        use accel::mesh::{CP_SIZE_ENV, DP_REPLICATE_SIZE_ENV, DP_SHARD_SIZE_ENV, TP_SIZE_ENV};
        let Some(p) = self.parallelism else {
            return Vec::new();
        };
        vec![
            ("ACCELERATE_USE_PARALLELISM_CONFIG".into(), "true".into()),
            (DP_REPLICATE_SIZE_ENV.into(), p.dp_replicate.to_string()),
            (DP_SHARD_SIZE_ENV.into(), p.dp_shard.to_string()),
            (TP_SIZE_ENV.into(), p.tp.to_string()),
            (CP_SIZE_ENV.into(), p.cp.to_string()),
        ]
    }

    /// This machine's part in a run over several machines, for
    /// [`accel_launch::Machines`]: `base` is what its workers share,
    /// `scratch` where their error files go.
    pub fn machines_config(&self, base: WorkerEnv, scratch: PathBuf) -> MachinesConfig {
        MachinesConfig {
            machine_rank: self.machine_rank,
            nproc: self.nproc,
            num_machines: self.num_machines,
            min_machines: self.min_machines,
            join_window: self.join_window,
            join_timeout: self.join_timeout,
            timeout: self.timeout,
            main_addr: self.main_addr.clone(),
            main_port: self.main_port,
            run_id: self.run_id.clone(),
            max_restarts: self.max_restarts,
            base,
            scratch,
            auto_rank: self.auto_machine_rank,
            etcd: self.etcd.clone(),
        }
    }
}

/// The machines (`--num-machines`, maybe `MIN:MAX`), the processes per
/// machine (`-n`, or `--num-processes` over the machines) and this
/// machine's rank.
fn processes(o: &Options) -> Result<(MachineCount, usize, usize)> {
    let machines = o.num_machines.unwrap_or(MachineCount::exact(1));
    let num_machines = machines.max;
    if machines.min < machines.max && o.total_processes.is_some() {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "--num-processes counts all machines together, but an elastic run \
                 (--num-machines {machines}) has no fixed number of machines"
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
    Ok((machines, nproc, machine_rank))
}

/// What an etcd rendezvous needs of the options: several machines and a
/// run id (the keys' namespace, shared by every machine of the run).
fn check_etcd_run(o: &Options, num_machines: usize, e: &EtcdRendezvous) -> Result<()> {
    if num_machines < 2 {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            "--rdzv-backend etcd coordinates several machines, but --nnodes / --num-machines \
             is 1",
        )
        .with_fix("pass --nnodes MIN:MAX (or N), or drop --rdzv-backend etcd for one machine"));
    }
    if o.run_id.is_none() {
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "--rdzv-backend etcd needs a run id: the run's keys on the cluster at {} live \
                 under it",
                e.endpoints.join(",")
            ),
        )
        .with_fix(
            "pass the same --rdzv-id RUN on every machine of the run, and a new one per run",
        ));
    }
    if o.machine_rank.is_some() {
        say("--machine-rank is not used under --rdzv-backend etcd: each round's plan gives the machine ranks");
    }
    Ok(())
}

/// The workers' bound of every blocking call (`--timeout`).
fn timeout(o: &Options) -> Result<Duration> {
    let timeout = o.timeout.unwrap_or(DEFAULT_TIMEOUT);
    if timeout < accel_api::worker::MIN_TIMEOUT {
        // The workers would refuse it (ACCEL_TIMEOUT): say so once, here.
        return Err(bad(
            "--timeout",
            &format_dur(timeout),
            "below the shortest timeout accel takes, 1ms (its waits poll at millisecond \
             steps, so a shorter one is refused, not rounded up)",
        ));
    }
    Ok(timeout)
}

/// The store's token: `--token` or `--token-file`, not both.
fn token(o: &Options) -> Result<Option<String>> {
    let token = match (o.token.clone(), &o.token_file) {
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
    Ok(token)
}

/// Where the store listens and its token: loopback and any port on one
/// machine; machine 0's address, a fixed port and a token on several.
fn endpoint(
    o: &Options,
    num_machines: usize,
    token: Option<String>,
) -> Result<(String, u16, Option<String>)> {
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
            .clone()
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
    Ok((main_addr, main_port, token))
}

/// accel's `--tee DIR`, or torchrun's per-stream logs (`--tee 0-3`,
/// `--redirects`, `--log-dir`).
fn logs(
    tee: Option<TeeArg>,
    log_dir: Option<PathBuf>,
    redirects: Option<StdStreams>,
) -> Result<(Option<PathBuf>, Option<StreamLogs>)> {
    let (tee, stream_logs) = match (tee, log_dir, redirects) {
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
    Ok((tee, stream_logs))
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

/// The `--parallelism-config-*` sizes, each 1 when not given; `None` when
/// none is. Checked against the world size unless the run is elastic (its
/// workers check it against theirs), so a wrong product fails here, before
/// any worker starts.
///
/// # Errors
/// [`ErrorKind::InvalidConfig`] naming the flags and the rule.
fn parallelism(
    o: &Options,
    machines: MachineCount,
    nproc: usize,
) -> Result<Option<accel::mesh::ParallelismConfig>> {
    let sizes = [o.pc_dp_replicate, o.pc_dp_shard, o.pc_tp, o.pc_cp];
    if sizes.iter().all(Option::is_none) {
        return Ok(None);
    }
    let [dp_replicate, dp_shard, tp, cp] = sizes.map(|s| s.unwrap_or(1));
    let p = accel::mesh::ParallelismConfig {
        dp_replicate,
        dp_shard,
        tp,
        cp,
    };
    if machines.min == machines.max {
        p.for_world(nproc * machines.max).map_err(|e| {
            Error::new(
                ErrorKind::InvalidConfig,
                format!("--parallelism-config-*: {}", e.message()),
            )
            .with_fix(e.fix().unwrap_or_default().to_string())
        })?;
    }
    Ok(Some(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch_cmd::options::{
        parse_machines, parse_mixed_precision, parse_sharding, parse_tee,
    };

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
        use Stage;
        parses(parse_sharding, ("FULL_SHARD", Stage::Full), "zero9");
        let (env, s) = flag_over_env("ACCEL_SHARDING", "zero2", |o| {
            o.sharding = Some(Stage::Full)
        });
        assert_eq!(env.sharding, Some(Stage::Gradients));
        assert_eq!(s.sharding, Some(Stage::Full));
        let vars = accel_api::worker::WorkerEnv {
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
    fn parallelism_flags_are_checked_against_the_world_and_exported_as_accelerate_does() {
        let opts = |n: usize, shard: Option<usize>, tp: Option<usize>| Options {
            num_processes: Some(n),
            pc_dp_shard: shard,
            pc_tp: tp,
            ..Options::default()
        };
        let s = Settings::resolve(opts(4, Some(2), Some(2))).unwrap();
        let p = s.parallelism.unwrap();
        assert_eq!((p.dp_replicate, p.dp_shard, p.tp, p.cp), (1, 2, 2, 1));
        let env = s.parallelism_env();
        for (k, v) in [
            ("ACCELERATE_USE_PARALLELISM_CONFIG", "true"),
            ("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "1"),
            ("PARALLELISM_CONFIG_DP_SHARD_SIZE", "2"),
            ("PARALLELISM_CONFIG_TP_SIZE", "2"),
            ("PARALLELISM_CONFIG_CP_SIZE", "1"),
        ] {
            assert!(
                env.contains(&(k.to_string(), v.to_string())),
                "{k}={v} in {env:?}"
            );
        }
        // None given: nothing exported.
        let s = Settings::resolve(opts(4, None, None)).unwrap();
        assert_eq!(s.parallelism, None);
        assert!(s.parallelism_env().is_empty());
        // A product other than the world, and Accelerate's TP rule: refused
        // before any worker starts, naming the flags.
        let e = Settings::resolve(opts(3, Some(2), Some(2))).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidConfig);
        assert!(e.to_string().contains("--parallelism-config-*"), "{e}");
        assert!(e.to_string().contains("but the run has 3"), "{e}");
        let mut o = opts(4, None, Some(2));
        o.pc_dp_replicate = Some(2);
        let e = Settings::resolve(o).unwrap_err();
        assert!(e.to_string().contains("pure replication"), "{e}");
    }
}
