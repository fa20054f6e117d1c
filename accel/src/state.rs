//! Process state: who this process is in the run, read once from the
//! environment that a launcher (accel launch, torchrun, mpirun/mpiexec of
//! OpenMPI, MPICH, Intel MPI or MVAPICH, srun) set.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use accel_api::{ConnectContext, Device, DeviceKind, Error, ErrorKind, Result, Store};

pub use crate::store_plan::StorePlan;

/// The bounds of the one timeout (`ACCEL_TIMEOUT`): the shortest accel
/// takes, and the default when it is not set.
pub use accel_api::worker::{DEFAULT_TIMEOUT, MIN_TIMEOUT};

/// Which launcher family the process state was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum LaunchSource {
    /// No launcher variables: a plain one-process run.
    None,
    /// `accel launch` (ACCEL_LAUNCHER=accel).
    Accel,
    /// torchrun / torch.distributed.launch, or anything setting RANK and
    /// WORLD_SIZE by hand.
    Torchrun,
    /// OpenMPI's mpirun (OMPI_COMM_WORLD_*).
    OpenMpi,
    /// MPICH / Intel MPI hydra (PMI_RANK, PMI_SIZE, MPI_LOCALRANKID).
    Mpich,
    /// MVAPICH (MV2_COMM_WORLD_*).
    Mvapich,
    /// Slurm's srun (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID).
    Slurm,
}

impl LaunchSource {
    /// `true` for the MPI launcher families.
    pub fn is_mpi(self) -> bool {
        matches!(
            self,
            LaunchSource::OpenMpi | LaunchSource::Mpich | LaunchSource::Mvapich
        )
    }
}

/// Who this process is in the run. Built once per process by [`state`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ProcessState {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the run.
    pub world_size: usize,
    /// Rank among the processes of this machine.
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// Rank of this machine (torchrun's GROUP_RANK, Slurm's SLURM_NODEID).
    pub node_rank: usize,
    /// The launcher family the values came from.
    pub source: LaunchSource,
    /// `true` when an MPI launcher started the process (its variables are
    /// present), whatever else set the ranks.
    pub mpi_launched: bool,
    /// MASTER_ADDR.
    pub master_addr: Option<String>,
    /// MASTER_PORT.
    pub master_port: Option<u16>,
    /// ACCEL_STORE_URL: where the rendezvous store is (`tcp://h:p`,
    /// `file:///dir`); derived from MASTER_ADDR/MASTER_PORT when absent.
    pub store_url: Option<String>,
    /// TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent hosts a torch
    /// TCPStore at MASTER_ADDR:MASTER_PORT, which this rank joins; otherwise a
    /// MASTER_ADDR/MASTER_PORT store without a token is hosted by rank 0
    /// (docs/adr/0019-torch-store.md).
    pub agent_store: bool,
    /// ACCEL_RUN_ID (torchrun's TORCHELASTIC_RUN_ID), `default` when absent.
    pub run_id: String,
    /// ACCEL_RUN_TOKEN: the store's shared secret. Never printed.
    #[serde(skip)]
    pub token: Option<String>,
    /// ACCEL_TIMEOUT: the bound for every blocking call.
    #[serde(with = "duration_secs")]
    pub timeout: Duration,
    /// ACCEL_BACKEND: backends to choose from, in order of preference.
    pub backend: Option<Vec<String>>,
    /// ACCEL_DEBUG: fingerprint every collective and report mismatches.
    pub debug: bool,
    /// ACCEL_RESTART_COUNT (TORCHELASTIC_RESTART_COUNT).
    pub restart_count: u32,
    /// ACCEL_ERROR_FILE (TORCHELASTIC_ERROR_FILE): where the panic hook
    /// writes the root cause for the launcher.
    pub error_file: Option<PathBuf>,
    /// ACCEL_SHARE_DEVICES: allow more local ranks than visible devices.
    pub share_devices: bool,
    /// ACCEL_PROCESS_MODEL: one rank per process, or this process hosting
    /// its machine's ranks as threads ([`crate::run`] starts them; in a
    /// rank thread, [`state`] is that rank's).
    pub process_model: ProcessModel,
    /// The local rank of this process's first rank: LOCAL_RANK, also in its
    /// rank threads' states (whose `local_rank` is their own).
    #[serde(skip)]
    process_local_rank: usize,
}

mod duration_secs {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

type Vars = HashMap<String, String>;

pub use crate::worker_env::parse_duration;
pub use crate::worker_env::ProcessModel;
use crate::worker_env::{keys, parse_number, WorkerEnv};

fn fix_for(source: &str) -> String {
    format!("check the variables your launcher ({source}) sets, or start the program with `accel launch`")
}

fn num(vars: &Vars, name: &str) -> Result<Option<usize>> {
    vars.get(name)
        .map(|v| parse_number::<usize>(name, v))
        .transpose()
}

/// One launcher family's view of (rank, size, local rank, local size).
#[derive(Debug, Clone, Copy)]
struct Family {
    source: LaunchSource,
    rank: (usize, &'static str),
    size: (usize, &'static str),
    local_rank: Option<(usize, &'static str)>,
    local_size: Option<(usize, &'static str)>,
    node_rank: Option<(usize, &'static str)>,
}

fn pair(
    vars: &Vars,
    source: LaunchSource,
    rank: &'static str,
    size: &'static str,
) -> Result<Option<(usize, usize)>> {
    match (num(vars, rank)?, num(vars, size)?) {
        (None, None) => Ok(None),
        (Some(r), Some(s)) => Ok(Some((r, s))),
        (Some(_), None) => Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("{rank} is set but {size} is not"),
        )
        .with_fix(fix_for(&format!("{source:?}")))),
        (None, Some(_)) => Err(Error::new(
            ErrorKind::InvalidConfig,
            format!("{size} is set but {rank} is not"),
        )
        .with_fix(fix_for(&format!("{source:?}")))),
    }
}

fn opt(vars: &Vars, name: &'static str) -> Result<Option<(usize, &'static str)>> {
    Ok(num(vars, name)?.map(|v| (v, name)))
}

fn torch_family(vars: &Vars) -> Result<Option<Family>> {
    use keys::*;
    let Some((r, s)) = pair(vars, LaunchSource::Torchrun, RANK, WORLD_SIZE)? else {
        return Ok(None);
    };
    let source = if vars.get(ACCEL_LAUNCHER).map(String::as_str) == Some("accel") {
        LaunchSource::Accel
    } else {
        LaunchSource::Torchrun
    };
    Ok(Some(Family {
        source,
        rank: (r, RANK),
        size: (s, WORLD_SIZE),
        local_rank: opt(vars, LOCAL_RANK)?,
        local_size: opt(vars, LOCAL_WORLD_SIZE)?,
        node_rank: opt(vars, GROUP_RANK)?,
    }))
}

fn mpi_family(vars: &Vars) -> Result<Option<Family>> {
    let candidates = [
        (
            LaunchSource::OpenMpi,
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
        (
            LaunchSource::Mvapich,
            "MV2_COMM_WORLD_RANK",
            "MV2_COMM_WORLD_SIZE",
            "MV2_COMM_WORLD_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_SIZE",
        ),
        (
            LaunchSource::Mpich,
            "PMI_RANK",
            "PMI_SIZE",
            "MPI_LOCALRANKID",
            "MPI_LOCALNRANKS",
        ),
    ];
    let mut found: Option<Family> = None;
    for (source, rank, size, local_rank, local_size) in candidates {
        let Some((r, s)) = pair(vars, source, rank, size)? else {
            continue;
        };
        let f = Family {
            source,
            rank: (r, rank),
            size: (s, size),
            local_rank: opt(vars, local_rank)?,
            local_size: opt(vars, local_size)?,
            node_rank: None,
        };
        match &found {
            // Two MPI families in one environment must say the same.
            Some(first) => contradiction(
                first,
                &f,
                "the environment mixes two MPI launchers' variables: start the program with one \
                 launcher, and unset the other's variables",
            )?,
            None => found = Some(f),
        }
    }
    Ok(found)
}

/// Slurm's per-node task counts: `2(x3),1` → [2, 2, 2, 1].
fn slurm_tasks_per_node(v: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in v.split(',') {
        let part = part.trim();
        if let Some((n, rep)) = part.split_once("(x") {
            let n: usize = n.parse().ok()?;
            let rep: usize = rep.strip_suffix(')')?.parse().ok()?;
            out.extend(std::iter::repeat_n(n, rep));
        } else {
            out.push(part.parse().ok()?);
        }
    }
    Some(out)
}

fn slurm_family(vars: &Vars) -> Result<Option<Family>> {
    let Some((r, s)) = pair(vars, LaunchSource::Slurm, "SLURM_PROCID", "SLURM_NTASKS")? else {
        return Ok(None);
    };
    let node = opt(vars, "SLURM_NODEID")?;
    let local_size = match (vars.get("SLURM_TASKS_PER_NODE"), node) {
        (Some(v), Some((n, _))) => {
            let per = slurm_tasks_per_node(v).ok_or_else(|| {
                Error::invalid_config("SLURM_TASKS_PER_NODE", v, "not in Slurm's `N(xM),K` format")
            })?;
            let count = per.get(n).ok_or_else(|| {
                Error::new(
                    ErrorKind::InvalidConfig,
                    format!(
                        "SLURM_NODEID={n} is not below the {} node(s) SLURM_TASKS_PER_NODE={v} lists",
                        per.len()
                    ),
                )
                .with_fix(fix_for("Slurm"))
            })?;
            Some((*count, "SLURM_TASKS_PER_NODE"))
        }
        _ => None,
    };
    Ok(Some(Family {
        source: LaunchSource::Slurm,
        rank: (r, "SLURM_PROCID"),
        size: (s, "SLURM_NTASKS"),
        local_rank: opt(vars, "SLURM_LOCALID")?,
        local_size,
        node_rank: node,
    }))
}

/// The first host of a Slurm hostlist (`n[01-03,7],gpu1` -> `n01`).
fn slurm_first_host(list: &str) -> Option<String> {
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let first = list[..end].trim();
    let Some((prefix, rest)) = first.split_once('[') else {
        return (!first.is_empty()).then(|| first.to_string());
    };
    let (ranges, suffix) = rest.split_once(']')?;
    let lo = ranges.split([',', '-']).next()?.trim();
    if lo.is_empty() || !lo.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(format!("{prefix}{lo}{suffix}"))
}

/// Where rank 0 of a Slurm job step hosts the store when the environment
/// names none: the step's first node, and a port from the job and step ids
/// (20000-39999), so that steps running at once rarely meet on one port.
/// MASTER_ADDR / MASTER_PORT override either.
fn slurm_rendezvous(vars: &Vars) -> Option<(String, u16)> {
    let list = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .iter()
    .find_map(|k| vars.get(*k).filter(|v| !v.trim().is_empty()))?;
    let host = slurm_first_host(list)?;
    let id = |k: &str| vars.get(k).and_then(|v| v.trim().parse::<u64>().ok());
    let job = id("SLURM_JOB_ID")
        .or_else(|| id("SLURM_JOBID"))
        .unwrap_or(0);
    let step = id("SLURM_STEP_ID")
        .or_else(|| id("SLURM_STEPID"))
        .unwrap_or(0);
    let port = 20000 + (job.wrapping_mul(131).wrapping_add(step) % 20000) as u16;
    Some((host, port))
}

fn check_family(f: &Family) -> Result<()> {
    let (rank, rn) = f.rank;
    let (size, sn) = f.size;
    let fix = || fix_for(&format!("{:?}", f.source));
    let bad = |message: String| Err(Error::new(ErrorKind::InvalidConfig, message).with_fix(fix()));
    if size == 0 {
        return Err(
            Error::invalid_config(sn, "0", "a run needs at least one process").with_fix(fix()),
        );
    }
    if rank >= size {
        return bad(format!(
            "{rn}={rank} is not below {sn}={size}: ranks go from 0 to {}",
            size - 1
        ));
    }
    if let Some((ls, lsn)) = f.local_size {
        if ls == 0 || ls > size {
            return bad(format!("{lsn}={ls} must be between 1 and {sn}={size}"));
        }
        if let Some((lr, lrn)) = f.local_rank {
            if lr >= ls {
                return bad(format!("{lrn}={lr} is not below {lsn}={ls}"));
            }
        }
    }
    if let Some((lr, lrn)) = f.local_rank {
        if lr >= size {
            return bad(format!("{lrn}={lr} is not below {sn}={size}"));
        }
    }
    if let Some((node, nn)) = f.node_rank {
        // This machine holds its local ranks and every other machine at
        // least one: there are at most size - local_size + 1 machines.
        let local = f.local_size.map_or(1, |x| x.0);
        let machines = size - local + 1;
        if node >= machines {
            return bad(format!(
                "{nn}={node} is out of range: {sn}={size} ranks with {local} on this machine \
                 make at most {machines} machine(s), numbered from 0"
            ));
        }
    }
    Ok(())
}

/// Two launcher families that both number this process must agree.
fn contradiction(a: &Family, b: &Family, fix: &str) -> Result<()> {
    if a.rank.0 == b.rank.0 && a.size.0 == b.size.0 {
        return Ok(());
    }
    Err(Error::new(
        ErrorKind::InvalidConfig,
        format!(
            "{}={} {}={} contradict {}={} {}={}",
            a.rank.1, a.rank.0, a.size.1, a.size.0, b.rank.1, b.rank.0, b.size.1, b.size.0
        ),
    )
    .with_fix(fix.to_string()))
}

impl ProcessState {
    /// What [`Backend::connect`](accel_api::Backend::connect) gets for
    /// this process: its ranks, timeout and run id, on `device`,
    /// bootstrapping through `store` (already scoped to the communicator).
    pub fn connect_context(&self, device: Device, store: Arc<dyn Store>) -> ConnectContext {
        ConnectContext {
            rank: self.rank,
            world_size: self.world_size,
            local_rank: self.local_rank,
            local_world_size: self.local_world_size,
            device,
            timeout: self.timeout,
            store,
            run_id: self.run_id.clone(),
        }
    }

    /// Read the state from this process's environment.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] naming the variable and its value when a
    /// value is malformed (non-numeric, out of range) or two launcher
    /// families contradict each other.
    pub fn from_env() -> Result<ProcessState> {
        ProcessState::from_vars(std::env::vars().collect())
    }

    /// Read the state from an explicit set of variables (what
    /// [`from_env`](Self::from_env) does with the real environment).
    ///
    /// Order: accel/torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK,
    /// LOCAL_WORLD_SIZE, GROUP_RANK), then OpenMPI, MVAPICH, MPICH/Intel MPI,
    /// then Slurm (only when SLURM_PROCID is set, i.e. under srun). When
    /// RANK/WORLD_SIZE are set by hand or by torchrun inside an MPI job, the
    /// two must agree; `accel launch` workers (ACCEL_LAUNCHER=accel) ignore
    /// MPI variables inherited from an outer mpirun.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(vars: HashMap<String, String>) -> Result<ProcessState> {
        let env = WorkerEnv::from_vars(&vars)?;
        // Read by every communicator (accel_api::kit::Group); refused here so
        // that a malformed value is an error naming it, not a silent default.
        if let Some(v) = vars
            .get(accel_api::CallCheck::VARIABLE)
            .filter(|v| !v.trim().is_empty())
        {
            accel_api::CallCheck::parse(v)?;
        }
        let torch = torch_family(&vars)?;
        let mpi = mpi_family(&vars)?;
        let slurm = slurm_family(&vars)?;
        let mpi_launched = mpi.is_some() || vars.contains_key("PMIX_RANK");
        // accel launch workers inside an outer mpirun or srun ignore the
        // outer launcher's ranks; so do torchrun's workers under srun (one
        // torchrun per node is srun's usual use).
        let nested = env.from_accel_launch();
        let torchrun_set = vars.contains_key(keys::TORCHELASTIC_RUN_ID)
            || vars.contains_key(keys::TORCHELASTIC_RESTART_COUNT);
        if let (Some(t), Some(m)) = (&torch, &mpi) {
            check_family(m)?;
            if !nested {
                contradiction(t, m, "unset RANK/WORLD_SIZE when starting with mpirun, or do not wrap torchrun-style launches in mpirun")?;
            }
        }
        if let (Some(t), Some(s)) = (&torch, &slurm) {
            check_family(s)?;
            if !nested && !torchrun_set {
                contradiction(t, s, "unset RANK/WORLD_SIZE under srun (accel reads SLURM_PROCID/SLURM_NTASKS), or start the program with srun alone")?;
            }
        }
        let family = match (torch, mpi) {
            (Some(t), _) => Some(t),
            // An MPI launcher's numbering wins over Slurm's variables:
            // mpirun inside an allocation inherits the batch step's
            // SLURM_PROCID=0 on every rank.
            (None, Some(m)) => Some(m),
            (None, None) => slurm,
        };
        if let Some(f) = &family {
            check_family(f)?;
        }
        let (rank, world_size, source) = match &family {
            Some(f) => (f.rank.0, f.size.0, f.source),
            None => (0, 1, LaunchSource::None),
        };
        let local_world_size = family
            .and_then(|f| f.local_size.map(|x| x.0))
            .unwrap_or(world_size);
        let local_rank = family
            .and_then(|f| f.local_rank.map(|x| x.0))
            .unwrap_or(rank % local_world_size);
        let node_rank = family
            .and_then(|f| f.node_rank.map(|x| x.0))
            .unwrap_or(rank / local_world_size);

        if let Some(t) = env.timeout.filter(|t| *t < MIN_TIMEOUT) {
            return Err(Error::invalid_config(
                keys::ACCEL_TIMEOUT,
                &vars[keys::ACCEL_TIMEOUT],
                format!(
                    "{t:?} is below the shortest timeout accel takes, 1ms (its waits poll at \
                     millisecond steps, so a shorter one is refused, not rounded up)"
                ),
            )
            .with_fix("set ACCEL_TIMEOUT to 1ms or more, e.g. 30s"));
        }
        if env.master_port == Some(0) && world_size > 1 {
            return Err(Error::invalid_config(
                keys::MASTER_PORT,
                "0",
                "workers cannot connect to port 0",
            )
            .with_fix("set the port the store listens on"));
        }
        // srun alone (no MASTER_ADDR, no ACCEL_STORE_URL): rank 0 hosts the
        // store on the step's first node, as under torch's env:// rendezvous.
        let (mut master_addr, mut master_port) = (env.master_addr, env.master_port);
        if source == LaunchSource::Slurm && world_size > 1 && env.store_url.is_none() {
            if let Some((h, p)) = slurm_rendezvous(&vars) {
                master_addr.get_or_insert(h);
                master_port.get_or_insert(p);
            }
        }
        Ok(ProcessState {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            source,
            mpi_launched,
            master_addr,
            master_port,
            store_url: env.store_url,
            agent_store: vars
                .get(keys::TORCHELASTIC_USE_AGENT_STORE)
                .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1")),
            run_id: env.run_id.unwrap_or_else(|| "default".to_string()),
            token: env.token.filter(|t| !t.is_empty()),
            timeout: env.timeout.unwrap_or(DEFAULT_TIMEOUT),
            backend: env.backend.filter(|v| !v.is_empty()),
            debug: env.debug.unwrap_or(false),
            restart_count: env.restart_count.unwrap_or(0),
            error_file: env.error_file.filter(|p| !p.as_os_str().is_empty()),
            share_devices: env.share_devices.unwrap_or(false),
            process_model: env.process_model.unwrap_or_default(),
            process_local_rank: local_rank,
        })
    }

    /// The state of rank thread `i` of a process whose state this is
    /// (the threads process model): global rank `rank + i`, local rank
    /// `local_rank + i`, everything else shared.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidConfig`] when the process's ranks would run past
    /// WORLD_SIZE or LOCAL_WORLD_SIZE (RANK and LOCAL_RANK name the
    /// process's first rank thread).
    pub fn rank_thread(&self, i: usize) -> Result<ProcessState> {
        let threads = self.local_world_size.saturating_sub(self.local_rank);
        if self.rank + threads > self.world_size || i >= threads {
            return Err(Error::new(
                ErrorKind::InvalidConfig,
                format!(
                    "ACCEL_PROCESS_MODEL=threads: a process whose first rank is RANK={} (LOCAL_RANK={}) \
                     hosts {threads} rank thread(s) of LOCAL_WORLD_SIZE={}, past WORLD_SIZE={}",
                    self.rank, self.local_rank, self.local_world_size, self.world_size
                ),
            )
            .with_fix(
                "under the threads process model RANK and LOCAL_RANK name the process's first \
                 rank thread: start the run with `accel launch --backend xla -n N`",
            ));
        }
        let mut s = self.clone();
        s.rank += i;
        s.local_rank += i;
        Ok(s)
    }

    /// This state, for a rank thread of a process whose first rank has
    /// local rank `first` (what [`ProcessState::probe_context`] counts the
    /// process's ranks from).
    pub(crate) fn in_process_of_local_rank(mut self, first: usize) -> ProcessState {
        self.process_local_rank = first;
        self
    }

    /// The number of rank threads this process hosts: LOCAL_WORLD_SIZE −
    /// LOCAL_RANK under the threads model, else 1.
    pub fn ranks_in_process(&self) -> usize {
        match self.process_model {
            ProcessModel::Processes => 1,
            ProcessModel::Threads => self.local_world_size.saturating_sub(self.local_rank).max(1),
        }
    }

    /// `true` on global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// `true` on local rank 0 of each machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// `true` on the last global rank.
    pub fn is_last_process(&self) -> bool {
        self.rank + 1 == self.world_size
    }

    /// The probe context for a run shaped like this one.
    pub fn probe_context(&self) -> accel_api::ProbeContext {
        let ranks_in_process = match self.process_model {
            ProcessModel::Processes => 1,
            ProcessModel::Threads => self
                .local_world_size
                .saturating_sub(self.process_local_rank)
                .max(1),
        };
        accel_api::ProbeContext {
            world_size: self.world_size,
            local_world_size: self.local_world_size,
            mpi_launched: self.mpi_launched,
            ranks_in_process,
        }
    }

    /// The device this rank drives, given how many devices of `kind` are
    /// visible: local rank `i` takes device `i`.
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`] when no device of `kind` is visible;
    /// [`ErrorKind::InvalidConfig`] when there are more local ranks than
    /// devices, unless ACCEL_SHARE_DEVICES=1 asks for sharing (then devices
    /// are assigned round-robin). Accelerate silently reuses devices; accel
    /// refuses, because two ranks on one GPU is almost always a mistake.
    pub fn bind_device(&self, kind: DeviceKind, visible: usize) -> Result<Device> {
        if kind == DeviceKind::Cpu {
            return Ok(Device::CPU);
        }
        if visible == 0 {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("no {kind} device is visible to rank {}", self.rank),
            )
            .with_fix("check the driver and the *_VISIBLE_DEVICES mask"));
        }
        if self.local_rank < visible {
            return Ok(Device::new(kind, self.local_rank as u32));
        }
        if self.share_devices {
            return Ok(Device::new(kind, (self.local_rank % visible) as u32));
        }
        Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "LOCAL_RANK={} but only {visible} {kind} device(s) are visible ({} local processes)",
                self.local_rank, self.local_world_size
            ),
        )
        .with_rank(self.rank)
        .with_fix(format!(
            "start at most {visible} processes per machine, or set ACCEL_SHARE_DEVICES=1 to share devices"
        )))
    }

    /// The contiguous range of `0..len` this rank handles: ranks get
    /// `len / world_size` items each, and the first `len % world_size` ranks
    /// one more (Accelerate's `split_between_processes`).
    pub fn split_range(&self, len: usize) -> Range<usize> {
        split_range(self.rank, self.world_size, len)
    }
}

/// [`ProcessState::split_range`] for an explicit rank and world size.
pub fn split_range(rank: usize, world_size: usize, len: usize) -> Range<usize> {
    let base = len / world_size;
    let extra = len % world_size;
    let start = rank * base + rank.min(extra);
    let n = base + usize::from(rank < extra);
    start..start + n
}

static STATE: RwLock<Option<Arc<ProcessState>>> = RwLock::new(None);

/// What a rank thread of this process is (the threads process model, or
/// [`crate::Threads`]): its state, the run's store when the ranks share one
/// in memory, and how its tagged lines are written.
#[derive(Clone)]
pub(crate) struct RankThread {
    pub(crate) state: Arc<ProcessState>,
    /// The store every rank thread of an in-memory run shares (`None`: the
    /// rank opens the run's store itself, as a process would).
    pub(crate) store: Option<Arc<dyn accel_api::Store>>,
    /// `true` when `accel launch` reads this process's output and routes
    /// tagged lines to each rank ([`crate::threads::tag_line`]).
    pub(crate) tagged: bool,
}

thread_local! {
    static RANK_THREAD: std::cell::RefCell<Option<RankThread>> =
        const { std::cell::RefCell::new(None) };
}

/// Marks the calling thread as a rank thread until dropped.
pub(crate) struct RankThreadGuard {
    previous: Option<RankThread>,
}

impl Drop for RankThreadGuard {
    fn drop(&mut self) {
        let previous = self.previous.take();
        let _ = RANK_THREAD.try_with(|r| *r.borrow_mut() = previous);
    }
}

/// Make the calling thread rank thread `rt` (for [`state`], the panic
/// hook, the store and tagged output) until the guard drops.
pub(crate) fn enter_rank_thread(rt: RankThread) -> RankThreadGuard {
    let previous = RANK_THREAD.with(|r| r.borrow_mut().replace(rt));
    RankThreadGuard { previous }
}

/// The calling thread's rank context, when it is a rank thread.
pub(crate) fn current_rank_thread() -> Option<RankThread> {
    // `try_with`: the panic hook asks too, possibly while the thread's
    // locals are being destroyed.
    RANK_THREAD
        .try_with(|r| r.try_borrow().ok().and_then(|r| r.clone()))
        .ok()
        .flatten()
}

/// The shared store of the calling rank thread, when `state` is its state.
pub(crate) fn rank_thread_store(state: &ProcessState) -> Option<Arc<dyn accel_api::Store>> {
    let rt = current_rank_thread()?;
    (std::ptr::eq(&*rt.state, state) || *rt.state == *state)
        .then_some(rt.store)
        .flatten()
}

/// The calling thread's rank when it is a rank thread of this process
/// (the threads process model or [`crate::Threads`]); `None` on other
/// threads.
pub fn thread_rank() -> Option<usize> {
    current_rank_thread().map(|rt| rt.state.rank)
}

/// The state of the calling thread's rank: on a rank thread (the threads
/// process model, [`crate::run`], [`crate::Threads`]) that rank's own;
/// elsewhere the process state, read from the environment on first use and
/// kept for the life of the process.
///
/// # Errors
/// As [`ProcessState::from_env`]; an error is not cached, so a corrected
/// environment is read on the next call. Under the threads process model,
/// [`ErrorKind::InvalidConfig`] off the rank threads of a process that
/// hosts several ranks (there is no one rank to be:
/// [`process_state`] is the process's view).
pub fn state() -> Result<Arc<ProcessState>> {
    if let Some(rt) = current_rank_thread() {
        return Ok(rt.state);
    }
    let s = process_state()?;
    if s.ranks_in_process() > 1 {
        // Off the rank threads of a threads process there is no one rank:
        // an `Accelerator::new()` here would wait for peers that never come.
        return Err(Error::new(
            ErrorKind::InvalidConfig,
            format!(
                "ACCEL_PROCESS_MODEL=threads: this process hosts ranks {}-{} as threads, and \
                 this thread is none of them",
                s.rank,
                s.rank + s.ranks_in_process() - 1
            ),
        )
        .with_fix(
            "enter the program's per-rank code through `accel::run(|acc| ...)`, which starts \
             the rank threads (or launch with one process per rank, e.g. --backend cpu-gloo)",
        ));
    }
    Ok(s)
}

/// The process state, never a rank thread's: under the threads process
/// model, RANK and LOCAL_RANK are those of the process's first rank thread
/// and [`ProcessState::ranks_in_process`] says how many it hosts. Read from
/// the environment on first use and kept for the life of the process.
///
/// # Errors
/// As [`ProcessState::from_env`].
pub fn process_state() -> Result<Arc<ProcessState>> {
    if let Some(s) = STATE.read().unwrap_or_else(|p| p.into_inner()).as_ref() {
        return Ok(s.clone());
    }
    let mut slot = STATE.write().unwrap_or_else(|p| p.into_inner());
    if let Some(s) = slot.as_ref() {
        return Ok(s.clone());
    }
    let s = Arc::new(ProcessState::from_env()?);
    *slot = Some(s.clone());
    Ok(s)
}

/// Forget the cached process state (tests that change the environment).
pub fn reset_state() {
    *STATE.write().unwrap_or_else(|p| p.into_inner()) = None;
}

#[cfg(test)]
mod tests;
